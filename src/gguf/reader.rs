//! Parsing of one GGUF file's header, metadata and tensor infos from its mmap, with every
//! length and count checked against the bytes that are left before it is used.
//!
//! Layout (GGUF v2/v3, little-endian, ggml's `docs/gguf.md`):
//! `"GGUF" | u32 version | u64 n_tensors | u64 n_kv | n_kv × (string key, u32 type, value)
//!  | n_tensors × (string name, u32 n_dims, n_dims × u64 ne, u32 ggml_type, u64 offset)
//!  | padding to `general.alignment` | tensor data`. A string is `u64 len | bytes` (no NUL);
//! an array is `u32 elem_type | u64 count | elements`. `ne[0]` is the innermost dimension.

use super::value::{type_id, Value};
use crate::{DType, Error, Result};
use std::collections::HashMap;
use std::path::Path;

pub(crate) const MAGIC: &[u8; 4] = b"GGUF";
pub(crate) const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
pub(crate) const MAX_DIMS: u32 = 4;
/// Deepest nesting of arrays accepted; real files use 1 level, and the limit keeps a
/// malicious file from exhausting the stack.
const MAX_ARRAY_DEPTH: u32 = 16;

/// Smallest possible encodings, used to reject counts that cannot fit in the file before
/// anything is allocated for them.
const MIN_KV_BYTES: u64 = 8 + 4 + 1; // empty key, type, a u8 value
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8; // empty name, n_dims = 0, type, offset

/// A tensor as its file describes it; `start` is the absolute offset in that file.
#[derive(Clone, Debug)]
pub(crate) struct RawTensor {
    pub name: String,
    pub dtype: DType,
    /// Outermost first (GGUF's `ne` reversed).
    pub shape: Vec<u64>,
    pub start: u64,
    pub n_bytes: u64,
}

/// Everything one file's header says.
pub(crate) struct Parsed {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub key_index: HashMap<String, usize>,
    pub tensors: Vec<RawTensor>,
    pub alignment: u64,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    /// Takes `n` bytes or fails with "truncated" naming `what` (a closure so the happy path
    /// formats nothing).
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(Error::format(
                self.path,
                format!(
                    "truncated {}: needs {n} bytes at offset {}, the file has {} left",
                    what(),
                    self.pos,
                    self.remaining()
                ),
            ));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A GGUF string's raw bytes (`u64 len | bytes`); the length is checked against what is
    /// left in the file before anything is read.
    fn string_bytes(&mut self, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let at = self.pos;
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(Error::format(
                self.path,
                format!(
                    "{}: string length {len} at offset {at} is longer than the {} bytes left in the file",
                    what(),
                    self.remaining()
                ),
            ));
        }
        self.take(len, what)
    }
}

fn fmt_key(key: &str) -> impl Fn() -> String + '_ {
    move || format!("value of key `{}`", crate::error::shown(key))
}

/// Reads one value of type `ty` for metadata key `key`.
fn read_value(c: &mut Cursor<'_>, ty: u32, key: &str, depth: u32) -> Result<Value> {
    let what = fmt_key(key);
    let what: &dyn Fn() -> String = &what;
    Ok(match ty {
        type_id::U8 => Value::U8(c.array::<1>(what)?[0]),
        type_id::I8 => Value::I8(c.array::<1>(what)?[0] as i8),
        type_id::U16 => Value::U16(u16::from_le_bytes(c.array(what)?)),
        type_id::I16 => Value::I16(i16::from_le_bytes(c.array(what)?)),
        type_id::U32 => Value::U32(u32::from_le_bytes(c.array(what)?)),
        type_id::I32 => Value::I32(i32::from_le_bytes(c.array(what)?)),
        type_id::U64 => Value::U64(u64::from_le_bytes(c.array(what)?)),
        type_id::I64 => Value::I64(i64::from_le_bytes(c.array(what)?)),
        type_id::F32 => Value::F32(f32::from_le_bytes(c.array(what)?)),
        type_id::F64 => Value::F64(f64::from_le_bytes(c.array(what)?)),
        type_id::BOOL => match c.array::<1>(what)?[0] {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            b => {
                return Err(Error::config(
                    c.path,
                    key,
                    format!("bool value {b} at offset {} (must be 0 or 1)", c.pos - 1),
                ))
            }
        },
        type_id::STR => {
            let bytes = c.string_bytes(what)?;
            let s = std::str::from_utf8(bytes).map_err(|e| {
                Error::config(
                    c.path,
                    key,
                    format!("string value is not valid UTF-8 ({e})"),
                )
            })?;
            Value::Str(s.to_string())
        }
        type_id::ARRAY => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(Error::config(
                    c.path,
                    key,
                    format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels"),
                ));
            }
            let elem_ty = c.u32(what)?;
            let count = c.u64(what)?;
            let min_elem = match elem_ty {
                type_id::U8 | type_id::I8 | type_id::BOOL => 1,
                type_id::U16 | type_id::I16 => 2,
                type_id::U32 | type_id::I32 | type_id::F32 => 4,
                type_id::U64 | type_id::I64 | type_id::F64 | type_id::STR => 8,
                type_id::ARRAY => 12,
                t => {
                    return Err(Error::config(
                        c.path,
                        key,
                        format!("array element type id {t} is not a GGUF type (0..=12)"),
                    ))
                }
            };
            if count.saturating_mul(min_elem) > c.remaining() {
                return Err(Error::config(
                    c.path,
                    key,
                    format!(
                        "array of {count} elements cannot fit in the {} bytes left in the file",
                        c.remaining()
                    ),
                ));
            }
            // Bounded by the file size above; the cap keeps a huge-but-valid count from
            // reserving everything up front.
            let mut items = Vec::with_capacity(count.min(1 << 16) as usize);
            for _ in 0..count {
                items.push(read_value(c, elem_ty, key, depth + 1)?);
            }
            Value::Array(items)
        }
        t => {
            return Err(Error::config(
                c.path,
                key,
                format!("value type id {t} is not a GGUF type (0..=12)"),
            ))
        }
    })
}

/// Parses the header, metadata and tensor infos of one file held in `buf`, and checks every
/// tensor's data range against the file.
pub(crate) fn parse(path: &Path, buf: &[u8]) -> Result<Parsed> {
    let mut c = Cursor { buf, pos: 0, path };
    let magic = c.array::<4>(&|| "header (magic)".into())?;
    if &magic != MAGIC {
        return Err(Error::format(
            path,
            format!("not a GGUF file: magic {magic:02x?}, expected \"GGUF\""),
        ));
    }
    let version = c.u32(&|| "header (version)".into())?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(Error::format(
                path,
                "GGUF version 1 (32-bit lengths) is not supported; lathe reads versions 2 and 3",
            ))
        }
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            return Err(Error::format(
                path,
                "big-endian GGUF is not supported; lathe reads little-endian files",
            ))
        }
        v => {
            return Err(Error::format(
                path,
                format!("unsupported GGUF version {v}; lathe reads versions 2 and 3"),
            ))
        }
    }
    let n_tensors = c.u64(&|| "header (tensor count)".into())?;
    let n_kv = c.u64(&|| "header (metadata count)".into())?;
    if n_kv.saturating_mul(MIN_KV_BYTES) > c.remaining() {
        return Err(Error::format(
            path,
            format!(
                "header says {n_kv} metadata entries, impossible in a file of {} bytes",
                buf.len()
            ),
        ));
    }
    if n_tensors.saturating_mul(MIN_TENSOR_INFO_BYTES) > c.remaining() {
        return Err(Error::format(
            path,
            format!(
                "header says {n_tensors} tensors, impossible in a file of {} bytes",
                buf.len()
            ),
        ));
    }

    let mut metadata = Vec::with_capacity(n_kv.min(1 << 12) as usize);
    let mut key_index = HashMap::with_capacity(n_kv.min(1 << 12) as usize);
    for i in 0..n_kv {
        let what = || format!("metadata entry #{i} (key)");
        let key_bytes = c.string_bytes(&what)?;
        let key = std::str::from_utf8(key_bytes)
            .map_err(|e| {
                Error::format(
                    path,
                    format!(
                        "metadata key #{i} (`{}`) is not valid UTF-8 ({e})",
                        crate::error::shown_bytes(key_bytes)
                    ),
                )
            })?
            .to_string();
        if key_index.contains_key(&key) {
            return Err(Error::config(path, key, "duplicate key"));
        }
        let ty = c.u32(&|| format!("type of key `{}`", crate::error::shown(&key)))?;
        let value = read_value(&mut c, ty, &key, 0)?;
        key_index.insert(key.clone(), metadata.len());
        metadata.push((key, value));
    }

    let alignment = match key_index.get(super::keys::GENERAL_ALIGNMENT) {
        None => DEFAULT_ALIGNMENT,
        Some(&i) => {
            let v = &metadata[i].1;
            match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 30 => a,
                _ => {
                    return Err(Error::config(
                        path,
                        super::keys::GENERAL_ALIGNMENT,
                        format!("must be a power of two, got {}", v.describe()),
                    ))
                }
            }
        }
    };

    let mut tensors = Vec::with_capacity(n_tensors.min(1 << 16) as usize);
    let mut seen: HashMap<String, usize> = HashMap::with_capacity(n_tensors.min(1 << 16) as usize);
    // Data offsets are relative to the data section, which starts after the infos; keep
    // them relative until the infos are all read.
    let mut rel_offsets = Vec::with_capacity(tensors.capacity());
    for i in 0..n_tensors {
        let name_bytes = c.string_bytes(&|| format!("tensor info #{i} (name)"))?;
        let name = std::str::from_utf8(name_bytes)
            .map_err(|e| {
                Error::format(
                    path,
                    format!(
                        "tensor #{i} name (`{}`) is not valid UTF-8 ({e})",
                        crate::error::shown_bytes(name_bytes)
                    ),
                )
            })?
            .to_string();
        let what = || format!("tensor info of `{}`", crate::error::shown(&name));
        if seen.contains_key(&name) {
            return Err(Error::tensor(path, name, "duplicate tensor name"));
        }
        let n_dims = c.u32(&what)?;
        if n_dims > MAX_DIMS {
            return Err(Error::tensor(
                path,
                name,
                format!("{n_dims} dimensions (GGUF allows at most {MAX_DIMS})"),
            ));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            ne.push(c.u64(&what)?);
        }
        let type_id = c.u32(&what)?;
        let offset = c.u64(&what)?;

        let dtype = DType::from_ggml_id(type_id).ok_or_else(|| {
            Error::tensor(
                path,
                &name,
                format!("ggml type id {type_id} is unknown or not supported by lathe"),
            )
        })?;
        let raw = check_tensor(path, &name, dtype, &ne)?;
        if !offset.is_multiple_of(alignment) {
            return Err(Error::tensor(
                path,
                name,
                format!("data offset {offset} is not a multiple of the alignment {alignment}"),
            ));
        }
        seen.insert(name.clone(), tensors.len());
        rel_offsets.push(offset);
        tensors.push(RawTensor {
            name,
            dtype,
            shape: raw.0,
            start: 0,
            n_bytes: raw.1,
        });
    }

    // The data section starts at the next multiple of the alignment; a file without tensors
    // may end before it (llama.cpp's vocab-only files do).
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;
    for (t, &rel) in tensors.iter_mut().zip(&rel_offsets) {
        let end = data_start
            .checked_add(rel)
            .and_then(|s| s.checked_add(t.n_bytes));
        match end {
            Some(end) if end <= file_len => t.start = data_start + rel,
            _ => {
                return Err(Error::tensor(
                    path,
                    &t.name,
                    format!(
                        "data [{rel}, +{}) at data section offset {data_start} lies outside the file ({file_len} bytes)",
                        t.n_bytes
                    ),
                ))
            }
        }
    }
    check_overlaps(path, &tensors)?;

    Ok(Parsed {
        version,
        metadata,
        key_index,
        tensors,
        alignment,
    })
}

/// Checks dims and block alignment; returns the shape outermost first and the byte size.
fn check_tensor(path: &Path, name: &str, dtype: DType, ne: &[u64]) -> Result<(Vec<u64>, u64)> {
    if let Some(d) = ne.iter().position(|&d| d == 0) {
        return Err(Error::tensor(
            path,
            name,
            format!("dimension ne[{d}] is zero (shape ne = {ne:?})"),
        ));
    }
    // ggml counts elements in an int64_t.
    let n = ne
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| {
            Error::tensor(
                path,
                name,
                format!("element count of shape ne = {ne:?} overflows"),
            )
        })?;
    let row = ne.first().copied().unwrap_or(1);
    let bs = dtype.block_size() as u64;
    // ggml quantizes along rows: each row (ne[0]) must be whole blocks, which also makes the
    // element count a multiple of the block size.
    if !row.is_multiple_of(bs) {
        return Err(Error::tensor(
            path,
            name,
            format!(
                "innermost dimension {row} (of {n} elements) is not a multiple of the {} block size {bs}",
                dtype.name()
            ),
        ));
    }
    let n_bytes = dtype.bytes_for(n).ok_or_else(|| {
        Error::tensor(
            path,
            name,
            format!("byte size of {n} {} elements overflows", dtype.name()),
        )
    })?;
    Ok((ne.iter().rev().copied().collect(), n_bytes))
}

fn check_overlaps(path: &Path, tensors: &[RawTensor]) -> Result<()> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| tensors[i].start);
    for w in order.windows(2) {
        let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
        if a.start + a.n_bytes > b.start {
            return Err(Error::tensor(
                path,
                &b.name,
                format!(
                    "data [{}, {}) overlaps tensor `{}` [{}, {})",
                    b.start,
                    b.start + b.n_bytes,
                    a.name,
                    a.start,
                    a.start + a.n_bytes
                ),
            ));
        }
    }
    Ok(())
}
