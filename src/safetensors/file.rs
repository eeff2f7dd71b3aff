//! One `.safetensors` file: an 8-byte little-endian header length, a JSON header
//! `{name: {dtype, shape, data_offsets: [start, end]}, "__metadata__": {..}}`, then the data
//! section the offsets index into (the format as specified by huggingface/safetensors).
//!
//! Everything in the header is checked against the file before any tensor is handed out, so
//! a [`TensorRef`] from here always has exactly `n_elements * size` bytes inside the file.

use crate::tensor::TensorRef;
use crate::{DType, Error, Result};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::ops::Deref;
use std::path::{Path, PathBuf};

/// Headers larger than this are treated as corrupt. The biggest released checkpoints have
/// headers of a few MB (the upstream implementation refuses above 100 MB as well).
pub const HEADER_MAX_BYTES: u64 = 100_000_000;

/// The bytes of a file: an mmap for files on disk, or an owned buffer (tests, generated
/// files).
enum Bytes {
    Map(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Map(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A tensor's type as the header spells it: a lathe [`DType`], or a safetensors type lathe
/// does not compute with (recorded so that asking for the tensor says why it is refused).
#[derive(Clone, Debug, PartialEq, Eq)]
enum StType {
    Known(DType),
    Unsupported(String),
}

/// One header entry, validated: `start..end` is inside the data section.
#[derive(Debug)]
struct Entry {
    name: String,
    dtype: StType,
    shape: Vec<u64>,
    /// Byte range relative to the data section.
    start: usize,
    end: usize,
}

/// An mmapped safetensors file with its validated tensor table.
pub struct SafetensorsFile {
    path: PathBuf,
    bytes: Bytes,
    /// Offset of the data section in the file: `8 + header length`.
    data_start: usize,
    /// In header order.
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
    metadata: Option<serde_json::Value>,
}

impl fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.entries.len())
            .finish()
    }
}

/// Bits per element of every dtype the safetensors format defines, and lathe's type for it
/// where lathe has one. Unknown names get `None` bits: offsets are still checked, sizes not.
fn parse_dtype(s: &str) -> (StType, Option<u64>) {
    let known = |t: DType, bits| (StType::Known(t), Some(bits));
    let other = |bits| (StType::Unsupported(s.to_string()), bits);
    match s {
        "F64" => known(DType::F64, 64),
        "F32" => known(DType::F32, 32),
        "F16" => known(DType::F16, 16),
        "BF16" => known(DType::BF16, 16),
        "I64" => known(DType::I64, 64),
        "I32" => known(DType::I32, 32),
        "I16" => known(DType::I16, 16),
        "I8" => known(DType::I8, 8),
        "U8" => known(DType::U8, 8),
        "F8_E4M3" => known(DType::F8_E4M3, 8),
        "F8_E8M0" => known(DType::F8_E8M0, 8),
        "U64" | "C64" => other(Some(64)),
        "U32" => other(Some(32)),
        "U16" => other(Some(16)),
        "BOOL" | "F8_E5M2" => other(Some(8)),
        "F6_E2M3" | "F6_E3M2" => other(Some(6)),
        "F4" => other(Some(4)),
        _ => other(None),
    }
}

/// A header entry as written; checked against the file in [`SafetensorsFile::from_parts`].
#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// The header object, read with duplicate names refused: JSON allows repeated keys and
/// serde_json's maps keep the last one silently, which would hide a tensor.
struct RawHeader {
    tensors: Vec<(String, RawEntry)>,
    metadata: Option<serde_json::Value>,
}

impl<'de> Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a safetensors header object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<RawHeader, A::Error> {
                let mut seen = HashSet::new();
                let mut tensors = Vec::new();
                let mut metadata = None;
                while let Some(key) = map.next_key::<String>()? {
                    if !seen.insert(key.clone()) {
                        return Err(de::Error::custom(format!("duplicate entry `{key}`")));
                    }
                    if key == "__metadata__" {
                        metadata = Some(map.next_value::<serde_json::Value>()?);
                    } else {
                        let e = map
                            .next_value::<RawEntry>()
                            .map_err(|e| de::Error::custom(format!("tensor `{key}`: {e}")))?;
                        tensors.push((key, e));
                    }
                }
                Ok(RawHeader { tensors, metadata })
            }
        }
        d.deserialize_map(V)
    }
}

impl SafetensorsFile {
    /// Map `path` and validate its header.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = crate::error::open_regular(path)?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if len < 8 {
            // Also keeps an empty file away from mmap, which refuses zero lengths.
            return Err(Error::format(
                path,
                format!("file is {len} bytes, too short for the 8-byte safetensors header length"),
            ));
        }
        // SAFETY: the map is read-only and lives as long as `self`; like every mmap-based
        // model loader, this assumes nobody truncates or rewrites the file while it is open.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::from_parts(path.to_path_buf(), Bytes::Map(map))
    }

    /// Parse a safetensors file held in memory; `path` is only used in error messages and
    /// [`TensorRef::path`].
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self> {
        Self::from_parts(path.into(), Bytes::Owned(bytes))
    }

    fn from_parts(path: PathBuf, bytes: Bytes) -> Result<Self> {
        let len = bytes.len() as u64;
        if len < 8 {
            return Err(Error::format(
                &path,
                format!("file is {len} bytes, too short for the 8-byte safetensors header length"),
            ));
        }
        let mut n8 = [0u8; 8];
        n8.copy_from_slice(&bytes[..8]);
        let n = u64::from_le_bytes(n8);
        if n > HEADER_MAX_BYTES {
            return Err(Error::format(
                &path,
                format!("header length {n} exceeds {HEADER_MAX_BYTES} bytes: not a safetensors file or corrupt"),
            ));
        }
        if 8 + n > len {
            return Err(Error::format(
                &path,
                format!(
                    "header length {n} runs past the end of the file ({len} bytes): truncated?"
                ),
            ));
        }
        let data_start = 8 + n as usize;
        let header = std::str::from_utf8(&bytes[8..data_start])
            .map_err(|e| Error::format(&path, format!("header is not UTF-8: {e}")))?;
        let raw: RawHeader = serde_json::from_str(header)
            .map_err(|e| Error::format(&path, format!("header JSON: {e}")))?;
        let data_len = len - data_start as u64;

        let mut entries = Vec::with_capacity(raw.tensors.len());
        for (name, e) in raw.tensors {
            let bad = |what: String| Error::tensor(&path, &name, what);
            let (dtype, bits) = parse_dtype(&e.dtype);
            let n_el = e
                .shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad(format!("shape {:?} overflows 64 bits", e.shape)))?;
            let [start, end] = e.data_offsets;
            if end < start {
                return Err(bad(format!(
                    "data_offsets [{start}, {end}]: end before start"
                )));
            }
            if end > data_len {
                return Err(bad(format!(
                    "data_offsets [{start}, {end}] run past the data section ({data_len} bytes)"
                )));
            }
            if let Some(bits) = bits {
                let want = n_el
                    .checked_mul(bits)
                    .filter(|b| b.is_multiple_of(8))
                    .map(|b| b / 8)
                    .ok_or_else(|| {
                        bad(format!(
                            "shape {:?} of {} is not a whole number of bytes",
                            e.shape, e.dtype
                        ))
                    })?;
                if end - start != want {
                    return Err(bad(format!(
                        "{} bytes for {} {:?} ({want} bytes expected)",
                        end - start,
                        e.dtype,
                        e.shape
                    )));
                }
            }
            entries.push(Entry {
                name,
                dtype,
                shape: e.shape,
                // Both fit: they are at most `len`, which is a mapped size.
                start: start as usize,
                end: end as usize,
            });
        }

        // No two tensors may share bytes (empty tensors own none).
        let mut spans: Vec<usize> = (0..entries.len())
            .filter(|&i| entries[i].end > entries[i].start)
            .collect();
        spans.sort_by_key(|&i| (entries[i].start, entries[i].end));
        for w in spans.windows(2) {
            let (a, b) = (&entries[w[0]], &entries[w[1]]);
            if b.start < a.end {
                return Err(Error::tensor(
                    &path,
                    &b.name,
                    format!(
                        "bytes [{}, {}) overlap tensor `{}` [{}, {})",
                        b.start, b.end, a.name, a.start, a.end
                    ),
                ));
            }
        }

        let index = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.clone(), i))
            .collect();
        Ok(SafetensorsFile {
            path,
            bytes,
            data_start,
            entries,
            index,
            metadata: raw.metadata,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of tensors in the header, including those of unsupported types.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The `__metadata__` object, if the header has one (kept as written).
    pub fn metadata(&self) -> Option<&serde_json::Value> {
        self.metadata.as_ref()
    }

    /// All tensor names in header order, including those of unsupported types.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.name.as_str())
    }

    /// The dtype of a tensor as the header spells it (`"F32"`, `"BOOL"`, ...).
    pub fn dtype_name(&self, name: &str) -> Option<&str> {
        let e = &self.entries[*self.index.get(name)?];
        Some(match &e.dtype {
            StType::Known(t) => t.name(),
            StType::Unsupported(s) => s,
        })
    }

    /// Tensors whose type lathe does not support, with the type's name.
    pub fn unsupported(&self) -> impl Iterator<Item = (&str, &str)> {
        self.entries.iter().filter_map(|e| match &e.dtype {
            StType::Unsupported(s) => Some((e.name.as_str(), s.as_str())),
            StType::Known(_) => None,
        })
    }

    /// Every tensor of a supported type, in header order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorRef<'_>> {
        (0..self.entries.len()).filter_map(move |i| self.entry_ref(i, &self.entries[i].name).ok())
    }

    /// The tensor called `name`; `None` when absent or of an unsupported type (see
    /// [`SafetensorsFile::require`] for the reason).
    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        let i = *self.index.get(name)?;
        self.entry_ref(i, &self.entries[i].name).ok()
    }

    /// The tensor called `name`, or an error naming the file and tensor.
    pub fn require(&self, name: &str) -> Result<TensorRef<'_>> {
        match self.index.get(name) {
            Some(&i) => self.entry_ref(i, &self.entries[i].name),
            None => Err(Error::MissingTensor {
                path: self.path.clone(),
                name: name.to_string(),
            }),
        }
    }

    pub(crate) fn name_at(&self, i: usize) -> &str {
        &self.entries[i].name
    }

    /// Entry `i` as a tensor called `name` (the caller may hand out a normalised name).
    pub(crate) fn entry_ref<'a>(&'a self, i: usize, name: &'a str) -> Result<TensorRef<'a>> {
        let e = &self.entries[i];
        match &e.dtype {
            StType::Known(dtype) => Ok(TensorRef {
                name,
                dtype: *dtype,
                shape: &e.shape,
                data: &self.bytes[self.data_start + e.start..self.data_start + e.end],
                path: &self.path,
            }),
            StType::Unsupported(s) => Err(Error::Unsupported(format!(
                "{}: tensor `{}`: dtype {s} is not supported by lathe",
                self.path.display(),
                e.name
            ))),
        }
    }
}
