//! NumPy `.npy` (format v1/v2) reading and writing for the dtypes lathe exchanges:
//! `<f4` and `<i4` (and `<i8` read as i64), C order.

use crate::{Error, Result};
use std::path::Path;

/// An array read from a `.npy` file.
#[derive(Debug, Clone)]
pub struct Npy<T> {
    pub shape: Vec<usize>,
    pub data: Vec<T>,
}

fn parse_header(path: &Path, bytes: &[u8]) -> Result<(String, Vec<usize>, usize)> {
    let bad = |w: &str| Error::format(path, format!("npy: {w}"));
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file (bad magic)"));
    }
    let major = bytes[6];
    let (hlen, start) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10usize),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err(bad("truncated header"));
            }
            (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            )
        }
        v => return Err(bad(&format!("unsupported version {v}"))),
    };
    let end = start
        .checked_add(hlen)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| bad("truncated header"))?;
    let h = std::str::from_utf8(&bytes[start..end]).map_err(|_| bad("header is not UTF-8"))?;
    let field = |key: &str| -> Option<&str> {
        let i = h.find(&format!("'{key}'"))?;
        Some(h[i + key.len() + 2..].trim_start_matches([':', ' ']))
    };
    let descr = field("descr").ok_or_else(|| bad("no descr"))?;
    let descr = descr
        .trim_start_matches('\'')
        .split('\'')
        .next()
        .unwrap_or("")
        .to_string();
    let fo = field("fortran_order").ok_or_else(|| bad("no fortran_order"))?;
    if fo.starts_with("True") {
        return Err(bad("Fortran order is not supported"));
    }
    let sh = field("shape").ok_or_else(|| bad("no shape"))?;
    let sh = sh
        .trim_start_matches('(')
        .split(')')
        .next()
        .ok_or_else(|| bad("bad shape"))?;
    let mut shape = Vec::new();
    for p in sh.split(',') {
        let p = p.trim();
        if !p.is_empty() {
            shape.push(p.parse::<usize>().map_err(|_| bad("bad shape"))?);
        }
    }
    Ok((descr, shape, end))
}

fn read_raw(path: &Path) -> Result<(String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let (descr, shape, off) = parse_header(path, &bytes)?;
    Ok((descr, shape, bytes[off..].to_vec()))
}

fn check_len(path: &Path, shape: &[usize], have: usize, elem: usize) -> Result<usize> {
    let n: usize = shape.iter().product();
    if have < n * elem {
        return Err(Error::format(
            path,
            format!("npy: data truncated: {have} bytes for shape {shape:?}"),
        ));
    }
    Ok(n)
}

/// Read a float array (`<f4`, or `<f8`/`<f2` converted).
pub fn read_f32(path: impl AsRef<Path>) -> Result<Npy<f32>> {
    let path = path.as_ref();
    let (descr, shape, raw) = read_raw(path)?;
    let data = match descr.as_str() {
        "<f4" => {
            let n = check_len(path, &shape, raw.len(), 4)?;
            raw[..n * 4]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        }
        "<f8" => {
            let n = check_len(path, &shape, raw.len(), 8)?;
            raw[..n * 8]
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32)
                .collect()
        }
        "<f2" => {
            let n = check_len(path, &shape, raw.len(), 2)?;
            raw[..n * 2]
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect()
        }
        d => {
            return Err(Error::format(
                path,
                format!("npy: expected a float array, found dtype {d}"),
            ))
        }
    };
    Ok(Npy { shape, data })
}

/// Read an integer array (`<i4`, `<i8`, `<u4`) as i64.
pub fn read_i64(path: impl AsRef<Path>) -> Result<Npy<i64>> {
    let path = path.as_ref();
    let (descr, shape, raw) = read_raw(path)?;
    let data = match descr.as_str() {
        "<i4" => {
            let n = check_len(path, &shape, raw.len(), 4)?;
            raw[..n * 4]
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                .collect()
        }
        "<u4" => {
            let n = check_len(path, &shape, raw.len(), 4)?;
            raw[..n * 4]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                .collect()
        }
        "<i8" => {
            let n = check_len(path, &shape, raw.len(), 8)?;
            raw[..n * 8]
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect()
        }
        d => {
            return Err(Error::format(
                path,
                format!("npy: expected an integer array, found dtype {d}"),
            ))
        }
    };
    Ok(Npy { shape, data })
}

fn write_raw(path: &Path, descr: &str, shape: &[usize], data: &[u8]) -> Result<()> {
    let shape_s = match shape.len() {
        1 => format!("({},)", shape[0]),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_s}, }}");
    // Pad so that the data starts on a 64-byte boundary, newline-terminated (format v1).
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    std::fs::write(path, out).map_err(|e| Error::io(path, e))
}

/// Refuses an output path that a later write would refuse: a directory, or one in a folder
/// that does not exist. Commands check before their work, so a typo costs no computation.
pub fn check_writable(path: &Path) -> Result<()> {
    if path.is_dir() {
        return Err(Error::Invalid(format!(
            "{}: is a directory; name the .npy file to write",
            path.display()
        )));
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(dir) = parent.filter(|d| !d.is_dir()) {
        return Err(Error::Invalid(format!(
            "{}: no folder {} to write it in",
            path.display(),
            dir.display()
        )));
    }
    Ok(())
}

/// Write an f32 array (`<f4`).
pub fn write_f32(path: impl AsRef<Path>, shape: &[usize], data: &[f32]) -> Result<()> {
    assert_eq!(shape.iter().product::<usize>(), data.len());
    write_raw(path.as_ref(), "<f4", shape, bytemuck::cast_slice(data))
}

/// Write an i32 array (`<i4`).
pub fn write_i32(path: impl AsRef<Path>, shape: &[usize], data: &[i32]) -> Result<()> {
    assert_eq!(shape.iter().product::<usize>(), data.len());
    write_raw(path.as_ref(), "<i4", shape, bytemuck::cast_slice(data))
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip() {
        let dir = std::env::temp_dir().join(format!("lathe-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.npy");
        super::write_f32(&p, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.5]).unwrap();
        let a = super::read_f32(&p).unwrap();
        assert_eq!(a.shape, vec![2, 3]);
        assert_eq!(a.data[5], 6.5);
        let q = dir.join("b.npy");
        super::write_i32(&q, &[3], &[7, -1, 9]).unwrap();
        assert_eq!(super::read_i64(&q).unwrap().data, vec![7, -1, 9]);
    }
}
