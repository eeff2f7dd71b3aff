//! GGUF model files (llama.cpp's format, versions 2 and 3, little-endian), read by mmap.
//!
//! [`GgufFile::open`] parses the header, metadata and tensor infos, checks every tensor's
//! type, shape and data range, and maps the file. Split models (`<prefix>-00001-of-00003.gguf`,
//! as llama.cpp's `gguf-split` writes them) open as one: every shard is a full GGUF carrying
//! `split.no` (0-based), `split.count` and `split.tensors.count`, the metadata lives in the
//! first shard, and each tensor's bytes come from its own shard's map.
//!
//! Shapes are exposed outermost first (GGUF stores `ne[0]`, the innermost, first), matching
//! [`TensorRef`]. Metadata key names live in [`keys`]; [`GgufWriter`] writes files.

pub mod keys;
mod reader;
mod value;
pub mod writer;

pub use value::Value;
pub use writer::{GgufWriter, Split};

use crate::tensor::TensorRef;
use crate::{DType, Error, Result};
use memmap2::Mmap;
use reader::RawTensor;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One mapped file of a (possibly split) model.
struct Shard {
    path: PathBuf,
    map: Mmap,
}

struct TensorEntry {
    raw: RawTensor,
    shard: usize,
}

/// An open GGUF model: one file, or all shards of a split model.
pub struct GgufFile {
    shards: Vec<Shard>,
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorEntry>,
    tensor_index: HashMap<String, usize>,
}

/// The path of shard `no` (1-based) of `count`, as llama.cpp names them:
/// `<prefix>-00001-of-00003.gguf` (`%s-%05d-of-%05d.gguf`).
pub fn split_path(prefix: impl AsRef<Path>, no: usize, count: usize) -> PathBuf {
    let prefix = prefix.as_ref();
    let mut name = prefix.file_name().unwrap_or_default().to_os_string();
    name.push(format!("-{no:05}-of-{count:05}.gguf"));
    prefix.with_file_name(name)
}

/// Splits `<prefix>-NNNNN-of-MMMMM.gguf` into (prefix path, NNNNN, MMMMM).
fn parse_split_name(path: &Path) -> Option<(PathBuf, usize, usize)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (left, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = left.rsplit_once('-')?;
    let digits = |s: &str| s.len() >= 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(count) || prefix.is_empty() {
        return None;
    }
    Some((
        path.with_file_name(prefix),
        no.parse().ok()?,
        count.parse().ok()?,
    ))
}

fn map_file(path: &Path) -> Result<Mmap> {
    let file = crate::error::open_regular(path)?;
    // SAFETY: the map is read-only and lives as long as the GgufFile. As with every
    // mmap-based loader (llama.cpp included), a file truncated or rewritten by another
    // process while mapped is outside what we can guard against.
    unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))
}

/// The split keys of one parsed file: (split.no, split.count), both absent for a plain file.
fn split_keys(path: &Path, p: &reader::Parsed) -> Result<Option<(u64, u64)>> {
    let get = |key: &str| -> Result<Option<u64>> {
        match p.key_index.get(key) {
            None => Ok(None),
            Some(&i) => p.metadata[i].1.as_u64().map(Some).ok_or_else(|| {
                Error::config(
                    path,
                    key,
                    format!(
                        "expected an unsigned integer, found {}",
                        p.metadata[i].1.describe()
                    ),
                )
            }),
        }
    };
    let count = get(keys::SPLIT_COUNT)?;
    let no = get(keys::SPLIT_NO)?;
    match (count, no) {
        (None, _) | (Some(0 | 1), _) => Ok(None),
        (Some(count), None) => Err(Error::config(
            path,
            keys::SPLIT_NO,
            format!("missing while split.count is {count}"),
        )),
        (Some(count), Some(no)) if no >= count => Err(Error::config(
            path,
            keys::SPLIT_NO,
            format!("is {no}, out of range for split.count {count}"),
        )),
        (Some(count), Some(no)) => Ok(Some((no, count))),
    }
}

impl GgufFile {
    /// Opens a GGUF file; a shard of a split model (any of them) opens the whole model.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let map = map_file(path)?;
        let parsed = reader::parse(path, &map)?;
        let Some((no, count)) = split_keys(path, &parsed)? else {
            let shard = Shard {
                path: path.to_path_buf(),
                map,
            };
            return Ok(Self::assemble(vec![(shard, parsed)]));
        };

        let (prefix, name_no, name_count) = parse_split_name(path)
            .filter(|&(_, n, c)| n as u64 == no + 1 && c as u64 == count)
            .ok_or_else(|| {
                Error::format(
                    path,
                    format!(
                        "split.no = {no} and split.count = {count}, but the file name is not \
                         <prefix>-{:05}-of-{count:05}.gguf, so the other shards cannot be found",
                        no + 1
                    ),
                )
            })?;
        let count = count as usize;
        debug_assert_eq!(name_count, count);
        let mut parts = Vec::with_capacity(count);
        let mut opened = Some((map, parsed));
        for i in 1..=count {
            let shard_path = split_path(&prefix, i, count);
            let (map, parsed) = if i == name_no {
                opened.take().expect("the opened shard is used once")
            } else {
                let map = map_file(&shard_path)?;
                let parsed = reader::parse(&shard_path, &map)?;
                (map, parsed)
            };
            match split_keys(&shard_path, &parsed)? {
                Some((n, c)) if n as usize == i - 1 && c as usize == count => {}
                other => {
                    return Err(Error::format(
                        &shard_path,
                        format!(
                            "expected shard {i} of {count} (split.no = {}), found split keys {}",
                            i - 1,
                            match other {
                                Some((n, c)) => format!("split.no = {n}, split.count = {c}"),
                                None => "absent".to_string(),
                            }
                        ),
                    ))
                }
            }
            parts.push((
                Shard {
                    path: shard_path,
                    map,
                },
                parsed,
            ));
        }

        // The first shard holds the metadata, including the total tensor count.
        let first = &parts[0];
        let total: usize = parts.iter().map(|(_, p)| p.tensors.len()).sum();
        if let Some(&i) = first.1.key_index.get(keys::SPLIT_TENSORS_COUNT) {
            let v = &first.1.metadata[i].1;
            if v.as_u64() != Some(total as u64) {
                return Err(Error::config(
                    &first.0.path,
                    keys::SPLIT_TENSORS_COUNT,
                    format!(
                        "says {}, but the {count} shards hold {total} tensors",
                        v.describe()
                    ),
                ));
            }
        }
        let mut seen: HashMap<&str, &Path> = HashMap::with_capacity(total);
        for (shard, p) in &parts {
            for t in &p.tensors {
                if let Some(other) = seen.insert(&t.name, &shard.path) {
                    return Err(Error::tensor(
                        &shard.path,
                        &t.name,
                        format!("duplicate tensor name (also in {})", other.display()),
                    ));
                }
            }
        }
        Ok(Self::assemble(parts))
    }

    /// Builds the combined view: metadata from the first part, tensors of all parts in order.
    fn assemble(parts: Vec<(Shard, reader::Parsed)>) -> Self {
        let mut shards = Vec::with_capacity(parts.len());
        let mut tensors = Vec::new();
        let mut head = None;
        for (i, (shard, parsed)) in parts.into_iter().enumerate() {
            shards.push(shard);
            tensors.extend(
                parsed
                    .tensors
                    .into_iter()
                    .map(|raw| TensorEntry { raw, shard: i }),
            );
            if i == 0 {
                head = Some((
                    parsed.version,
                    parsed.alignment,
                    parsed.metadata,
                    parsed.key_index,
                ));
            }
        }
        let (version, alignment, metadata, key_index) = head.expect("at least one part");
        let tensor_index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.raw.name.clone(), i))
            .collect();
        GgufFile {
            shards,
            version,
            alignment,
            metadata,
            key_index,
            tensors,
            tensor_index,
        }
    }

    /// The file holding the metadata (the first shard of a split model).
    pub fn path(&self) -> &Path {
        &self.shards[0].path
    }

    /// All files of the model, first shard first (one path for a plain file).
    pub fn shard_paths(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }

    /// GGUF version of the (first) file: 2 or 3.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// `general.alignment` of the (first) file, 32 when absent.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// All metadata in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require_key(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| Error::config(self.path(), key, "missing"))
    }

    fn wrong_type(&self, key: &str, expected: &str, v: &Value) -> Error {
        Error::config(
            self.path(),
            key,
            format!("expected {expected}, found {}", v.describe()),
        )
    }

    /// `Ok(None)` when missing, the converted value, or an error naming the key.
    fn opt_with<'s, T>(
        &'s self,
        key: &str,
        expected: &str,
        f: impl FnOnce(&'s Value) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => f(v)
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, expected, v)),
        }
    }

    fn get_with<'s, T>(
        &'s self,
        key: &str,
        expected: &str,
        f: impl FnOnce(&'s Value) -> Option<T>,
    ) -> Result<T> {
        let v = self.require_key(key)?;
        f(v).ok_or_else(|| self.wrong_type(key, expected, v))
    }

    /// Any non-negative integer value.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get_with(key, "an unsigned integer", Value::as_u64)
    }
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.opt_with(key, "an unsigned integer", Value::as_u64)
    }
    /// [`get_u64`](Self::get_u64) as a usize (for sizes and counts).
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        self.get_with(key, "an unsigned integer", |v| {
            v.as_u64().and_then(|x| usize::try_from(x).ok())
        })
    }
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.opt_with(key, "an unsigned integer", |v| {
            v.as_u64().and_then(|x| usize::try_from(x).ok())
        })
    }
    /// Any integer value that fits an i64.
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.get_with(key, "an integer", Value::as_i64)
    }
    pub fn opt_i64(&self, key: &str) -> Result<Option<i64>> {
        self.opt_with(key, "an integer", Value::as_i64)
    }
    /// A float (or integer) value, as f32.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.get_with(key, "a number", |v| v.as_f64().map(|x| x as f32))
    }
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.opt_with(key, "a number", |v| v.as_f64().map(|x| x as f32))
    }
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.get_with(key, "a number", Value::as_f64)
    }
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.opt_with(key, "a number", Value::as_f64)
    }
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.get_with(key, "a string", Value::as_str)
    }
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.opt_with(key, "a string", Value::as_str)
    }
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.get_with(key, "a bool", Value::as_bool)
    }
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.opt_with(key, "a bool", Value::as_bool)
    }
    pub fn get_array(&self, key: &str) -> Result<&[Value]> {
        self.get_with(key, "an array", Value::as_array)
    }
    pub fn opt_array(&self, key: &str) -> Result<Option<&[Value]>> {
        self.opt_with(key, "an array", Value::as_array)
    }

    /// An array whose every element converts with `f`; errors name the key and the index.
    fn array_of<'s, T>(
        &'s self,
        key: &str,
        expected: &str,
        f: impl Fn(&'s Value) -> Option<T>,
    ) -> Result<Vec<T>> {
        let a = self.get_array(key)?;
        a.iter()
            .enumerate()
            .map(|(i, v)| {
                f(v).ok_or_else(|| {
                    Error::config(
                        self.path(),
                        key,
                        format!("element {i}: expected {expected}, found {}", v.describe()),
                    )
                })
            })
            .collect()
    }
    /// An array of non-negative integers.
    pub fn get_u64_array(&self, key: &str) -> Result<Vec<u64>> {
        self.array_of(key, "an unsigned integer", Value::as_u64)
    }
    /// An array of integers.
    pub fn get_i64_array(&self, key: &str) -> Result<Vec<i64>> {
        self.array_of(key, "an integer", Value::as_i64)
    }
    /// An array of numbers, as f32 (e.g. `tokenizer.ggml.scores`).
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        self.array_of(key, "a number", |v| v.as_f64().map(|x| x as f32))
    }
    pub fn get_bool_array(&self, key: &str) -> Result<Vec<bool>> {
        self.array_of(key, "a bool", Value::as_bool)
    }
    /// An array of strings (e.g. `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        self.array_of(key, "a string", Value::as_str)
    }

    /// A per-layer unsigned value stored either as one scalar for every layer or as an array
    /// of `n_layer` values (llama.cpp's `get_key_or_arr`).
    pub fn get_u64_per_layer(&self, key: &str, n_layer: usize) -> Result<Vec<u64>> {
        match self.require_key(key)? {
            Value::Array(_) => {
                let a = self.get_u64_array(key)?;
                if a.len() != n_layer {
                    return Err(Error::config(
                        self.path(),
                        key,
                        format!(
                            "array has {} elements, expected one per layer ({n_layer})",
                            a.len()
                        ),
                    ));
                }
                Ok(a)
            }
            _ => Ok(vec![self.get_u64(key)?; n_layer]),
        }
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str(keys::GENERAL_ARCHITECTURE)
    }

    fn tensor_ref<'s>(&'s self, t: &'s TensorEntry) -> TensorRef<'s> {
        let shard = &self.shards[t.shard];
        // In bounds: reader::parse checked start + n_bytes <= file length.
        let (start, len) = (t.raw.start as usize, t.raw.n_bytes as usize);
        TensorRef {
            name: &t.raw.name,
            dtype: t.raw.dtype,
            shape: &t.raw.shape,
            data: &shard.map[start..start + len],
            path: &shard.path,
        }
    }

    /// All tensors in file order (shard by shard for a split model).
    pub fn tensors(&self) -> impl Iterator<Item = TensorRef<'_>> {
        self.tensors.iter().map(|t| self.tensor_ref(t))
    }

    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        self.tensor_index
            .get(name)
            .map(|&i| self.tensor_ref(&self.tensors[i]))
    }

    /// The tensor, or [`Error::MissingTensor`] naming the file and the tensor.
    pub fn require(&self, name: &str) -> Result<TensorRef<'_>> {
        self.tensor(name).ok_or_else(|| Error::MissingTensor {
            path: self.path().to_path_buf(),
            name: name.to_string(),
        })
    }

    /// The file holding the tensor's bytes and their absolute offset in it.
    pub fn tensor_location(&self, name: &str) -> Option<(&Path, u64)> {
        let t = &self.tensors[*self.tensor_index.get(name)?];
        Some((&self.shards[t.shard].path, t.raw.start))
    }

    pub fn n_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// Total bytes of all tensors' data (padding excluded).
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.raw.n_bytes).sum()
    }

    /// Bytes of tensor data per type, sorted by type (for summaries).
    pub fn bytes_by_dtype(&self) -> Vec<(DType, u64)> {
        let mut m: HashMap<DType, u64> = HashMap::new();
        for t in &self.tensors {
            *m.entry(t.raw.dtype).or_default() += t.raw.n_bytes;
        }
        let mut v: Vec<_> = m.into_iter().collect();
        v.sort();
        v
    }
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path())
            .field("shards", &self.shards.len())
            .field("version", &self.version)
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}
