//! Writing GGUF v3 files: metadata and tensor infos are collected first, then the file is
//! written in one pass, tensor data streamed through a callback so a 20 GB model never
//! has to sit in memory. [`GgufWriter::write_split`] writes llama.cpp `gguf-split` shards.

use super::keys;
use super::reader::{DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use super::value::{type_id, Value};
use crate::{DType, Error, Result};
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// ggml's `GGML_MAX_NAME` is 64 including the NUL: llama.cpp rejects longer tensor names.
const MAX_TENSOR_NAME: usize = 63;
/// Write buffer: large enough that each syscall moves a useful amount of data.
const WRITE_BUFFER: usize = 8 << 20;

#[derive(Clone, Debug)]
struct TensorSpec {
    name: String,
    dtype: DType,
    /// Outermost first.
    shape: Vec<u64>,
    n_bytes: u64,
}

/// How to cut a model into shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// At most this many tensors per shard (gguf-split's `--split-max-tensors`).
    MaxTensors(usize),
    /// At most this many bytes of tensor data per shard (gguf-split's `--split-max-size`):
    /// a soft limit, since a tensor larger than it gets a shard of its own.
    MaxBytes(u64),
}

/// Builds a GGUF file: metadata in insertion order, tensor infos in order, then
/// [`write`](Self::write) streams the data.
///
/// ```no_run
/// # use lathe::{gguf::GgufWriter, DType};
/// let mut w = GgufWriter::new();
/// w.set("general.architecture", "qwen35")?;
/// w.add_tensor_info("output_norm.weight", DType::F32, &[64])?;
/// w.write("out.gguf", |_i, out| out.write_all(&[0u8; 256]))?;
/// # Ok::<(), lathe::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorSpec>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

/// Checks that every array holds one element type (GGUF stores the type once per array).
fn check_value(key: &str, v: &Value) -> Result<()> {
    if let Value::Array(a) = v {
        if let Some(first) = a.first() {
            let t = first.type_id();
            if let Some((i, other)) = a.iter().enumerate().find(|(_, x)| x.type_id() != t) {
                return Err(Error::Invalid(format!(
                    "metadata key `{key}`: array element {i} is {}, element 0 is {}",
                    other.type_name(),
                    first.type_name()
                )));
            }
        }
        for x in a {
            check_value(key, x)?;
        }
    }
    Ok(())
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A value's payload (without its type id).
fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::Str(s) => put_str(out, s),
        Value::Array(a) => {
            // An empty array has no element to take a type from; u8 is as good as any.
            let elem = a.first().map_or(type_id::U8, Value::type_id);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(a.len() as u64).to_le_bytes());
            for x in a {
                put_value(out, x);
            }
        }
    }
}

/// Passes at most `left` bytes through to the file, so a callback that writes too much
/// fails at once instead of shifting every later tensor.
struct TensorSink<'a, W: Write> {
    inner: &'a mut W,
    left: u64,
}

impl<W: Write> Write for TensorSink<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.len() as u64 > self.left {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} bytes written past the end of the tensor's data",
                    buf.len() as u64 - self.left
                ),
            ));
        }
        let n = self.inner.write(buf)?;
        self.left -= n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter {
            metadata: Vec::new(),
            key_index: HashMap::new(),
            tensors: Vec::new(),
            tensor_index: HashMap::new(),
            alignment: DEFAULT_ALIGNMENT,
        }
    }

    /// Sets a metadata key: a new key goes last, an existing one keeps its place. Arrays must
    /// hold one element type. Setting `general.alignment` changes the data alignment.
    pub fn set(&mut self, key: impl Into<String>, value: impl Into<Value>) -> Result<()> {
        let key = key.into();
        let value = value.into();
        check_value(&key, &value)?;
        if key == keys::GENERAL_ALIGNMENT {
            match value.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 30 => self.alignment = a,
                _ => {
                    return Err(Error::Invalid(format!(
                        "metadata key `{key}`: must be a power of two, got {}",
                        value.describe()
                    )))
                }
            }
        }
        match self.key_index.get(&key) {
            Some(&i) => self.metadata[i].1 = value,
            None => {
                self.key_index.insert(key.clone(), self.metadata.len());
                self.metadata.push((key, value));
            }
        }
        Ok(())
    }

    /// Sets the data alignment (a power of two) and writes it as `general.alignment` (u32).
    pub fn set_alignment(&mut self, alignment: u32) -> Result<()> {
        self.set(keys::GENERAL_ALIGNMENT, alignment)
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// Declares the next tensor: `shape` outermost first (`[rows, cols]`). Returns its index,
    /// the `i` the data callback of [`write`](Self::write) is called with.
    pub fn add_tensor_info(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: &[u64],
    ) -> Result<usize> {
        let name = name.into();
        let bad = |what: String| Error::Invalid(format!("tensor `{name}`: {what}"));
        if name.is_empty() || name.len() > MAX_TENSOR_NAME {
            return Err(bad(format!(
                "name must be 1 to {MAX_TENSOR_NAME} bytes (ggml's limit)"
            )));
        }
        if self.tensor_index.contains_key(&name) {
            return Err(bad("duplicate tensor name".into()));
        }
        if dtype.ggml_id().is_none() {
            return Err(bad(format!("{dtype} has no ggml type id")));
        }
        if shape.is_empty() || shape.len() > MAX_DIMS as usize {
            return Err(bad(format!(
                "shape {shape:?} must have 1 to {MAX_DIMS} dimensions"
            )));
        }
        if shape.contains(&0) {
            return Err(bad(format!("shape {shape:?} has a zero dimension")));
        }
        let row = *shape.last().expect("shape is not empty");
        if !row.is_multiple_of(dtype.block_size() as u64) {
            return Err(bad(format!(
                "innermost dimension {row} is not a multiple of the {dtype} block size {}",
                dtype.block_size()
            )));
        }
        let n_bytes = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .and_then(|n| dtype.bytes_for(n))
            .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
        let i = self.tensors.len();
        self.tensor_index.insert(name.clone(), i);
        self.tensors.push(TensorSpec {
            name,
            dtype,
            shape: shape.to_vec(),
            n_bytes,
        });
        Ok(i)
    }

    pub fn n_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// Bytes the data callback must write for tensor `i`.
    pub fn tensor_bytes(&self, i: usize) -> u64 {
        self.tensors[i].n_bytes
    }

    /// Name of tensor `i`.
    pub fn tensor_name(&self, i: usize) -> &str {
        &self.tensors[i].name
    }

    /// Total tensor data bytes (padding excluded).
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.n_bytes).sum()
    }

    /// Writes a GGUF v3 file. `fill(i, out)` must write exactly
    /// [`tensor_bytes(i)`](Self::tensor_bytes) bytes of tensor `i` (in ggml layout); it is
    /// called once per tensor, in order. A failed write removes the partial file. `split.*`
    /// keys are left out (use [`write_split`](Self::write_split) for shards).
    pub fn write<F>(&self, path: impl AsRef<Path>, mut fill: F) -> Result<()>
    where
        F: FnMut(usize, &mut dyn Write) -> io::Result<()>,
    {
        let path = path.as_ref();
        // One file is never a shard: split keys copied from a split source would send a
        // reader looking for shards that do not exist.
        let meta: Vec<&(String, Value)> = self
            .metadata
            .iter()
            .filter(|(k, _)| !k.starts_with("split."))
            .collect();
        self.write_part(path, &meta, 0..self.tensors.len(), &mut fill)
    }

    /// Writes the model as shards `<prefix>-00001-of-0000N.gguf`, ... as llama.cpp's
    /// gguf-split does: the first shard carries all metadata, every shard carries `split.no`
    /// (u16, 0-based), `split.count` (u16) and `split.tensors.count` (i32, all shards).
    /// `fill` gets the tensor's index in this writer, as with [`write`](Self::write).
    /// Returns the shard paths in order.
    pub fn write_split<F>(
        &self,
        prefix: impl AsRef<Path>,
        split: Split,
        mut fill: F,
    ) -> Result<Vec<PathBuf>>
    where
        F: FnMut(usize, &mut dyn Write) -> io::Result<()>,
    {
        let prefix = prefix.as_ref();
        let plan = self.plan_split(split)?;
        let count = plan.len();
        let total = i32::try_from(self.tensors.len())
            .map_err(|_| Error::Invalid("too many tensors for split.tensors.count (i32)".into()))?;
        let mut written = Vec::with_capacity(count);
        for (no, range) in plan.into_iter().enumerate() {
            let split_kv = [
                (keys::SPLIT_NO.to_string(), Value::U16(no as u16)),
                (keys::SPLIT_COUNT.to_string(), Value::U16(count as u16)),
                (keys::SPLIT_TENSORS_COUNT.to_string(), Value::I32(total)),
            ];
            let align_kv = (
                keys::GENERAL_ALIGNMENT.to_string(),
                Value::U32(self.alignment as u32),
            );
            let mut meta: Vec<&(String, Value)> = Vec::new();
            if no == 0 {
                meta.extend(
                    self.metadata
                        .iter()
                        .filter(|(k, _)| !k.starts_with("split.")),
                );
            } else if self.alignment != DEFAULT_ALIGNMENT {
                // Alignment shapes each shard's own layout, so every shard says it.
                meta.push(&align_kv);
            }
            meta.extend(split_kv.iter());
            let path = super::split_path(prefix, no + 1, count);
            if let Err(e) = self.write_part(&path, &meta, range, &mut fill) {
                for p in &written {
                    let _ = std::fs::remove_file(p);
                }
                return Err(e);
            }
            written.push(path);
        }
        Ok(written)
    }

    /// Tensor index ranges, one per shard.
    fn plan_split(&self, split: Split) -> Result<Vec<Range<usize>>> {
        let n = self.tensors.len();
        let mut plan = Vec::new();
        match split {
            Split::MaxTensors(0) | Split::MaxBytes(0) => {
                return Err(Error::Invalid(format!(
                    "split limit must be positive: {split:?}"
                )))
            }
            Split::MaxTensors(m) => {
                let mut s = 0;
                while s < n {
                    plan.push(s..(s + m).min(n));
                    s += m;
                }
            }
            Split::MaxBytes(m) => {
                let (mut s, mut bytes) = (0, 0u64);
                for (i, t) in self.tensors.iter().enumerate() {
                    if i > s && bytes + t.n_bytes > m {
                        plan.push(s..i);
                        (s, bytes) = (i, 0);
                    }
                    bytes += t.n_bytes;
                }
                plan.push(s..n);
            }
        }
        if plan.is_empty() {
            plan.push(0..0);
        }
        if plan.len() > u16::MAX as usize {
            return Err(Error::Invalid(format!(
                "{} shards exceed split.count's u16 range",
                plan.len()
            )));
        }
        Ok(plan)
    }

    /// Header bytes (padded to the alignment) for `meta` and the tensors in `range`, whose
    /// data follow in order, each padded to the alignment.
    fn header(&self, meta: &[&(String, Value)], range: Range<usize>) -> Vec<u8> {
        let a = self.alignment;
        let mut h = Vec::new();
        h.extend_from_slice(MAGIC);
        h.extend_from_slice(&3u32.to_le_bytes());
        h.extend_from_slice(&(range.len() as u64).to_le_bytes());
        h.extend_from_slice(&(meta.len() as u64).to_le_bytes());
        for (k, v) in meta {
            put_str(&mut h, k);
            h.extend_from_slice(&v.type_id().to_le_bytes());
            put_value(&mut h, v);
        }
        let mut offset = 0u64;
        for t in &self.tensors[range] {
            put_str(&mut h, &t.name);
            h.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            // GGUF's ne[] is innermost first.
            for d in t.shape.iter().rev() {
                h.extend_from_slice(&d.to_le_bytes());
            }
            h.extend_from_slice(&t.dtype.ggml_id().expect("checked on add").to_le_bytes());
            h.extend_from_slice(&offset.to_le_bytes());
            offset = (offset + t.n_bytes).div_ceil(a) * a;
        }
        h.resize((h.len() as u64).div_ceil(a) as usize * a as usize, 0);
        h
    }

    fn write_part<F>(
        &self,
        path: &Path,
        meta: &[&(String, Value)],
        range: Range<usize>,
        fill: &mut F,
    ) -> Result<()>
    where
        F: FnMut(usize, &mut dyn Write) -> io::Result<()>,
    {
        let result = self.write_part_inner(path, meta, range, fill);
        if result.is_err() {
            let _ = std::fs::remove_file(path);
        }
        result
    }

    fn write_part_inner<F>(
        &self,
        path: &Path,
        meta: &[&(String, Value)],
        range: Range<usize>,
        fill: &mut F,
    ) -> Result<()>
    where
        F: FnMut(usize, &mut dyn Write) -> io::Result<()>,
    {
        let io_err = |e| Error::io(path, e);
        let file = File::create(path).map_err(io_err)?;
        let mut out = BufWriter::with_capacity(WRITE_BUFFER, file);
        out.write_all(&self.header(meta, range.clone()))
            .map_err(io_err)?;
        let zeros = vec![0u8; self.alignment as usize];
        for i in range {
            let t = &self.tensors[i];
            let mut sink = TensorSink {
                inner: &mut out,
                left: t.n_bytes,
            };
            fill(i, &mut sink)
                .map_err(|e| Error::tensor(path, &t.name, format!("writing data: {e}")))?;
            if sink.left != 0 {
                return Err(Error::tensor(
                    path,
                    &t.name,
                    format!(
                        "data callback wrote {} of the {} bytes",
                        t.n_bytes - sink.left,
                        t.n_bytes
                    ),
                ));
            }
            let pad = t.n_bytes.div_ceil(self.alignment) * self.alignment - t.n_bytes;
            out.write_all(&zeros[..pad as usize]).map_err(io_err)?;
        }
        out.flush().map_err(io_err)
    }
}
