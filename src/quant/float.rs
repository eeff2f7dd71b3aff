//! Plain element types: IEEE floats, bf16, FP8 e4m3fn, E8M0 exponents and integer tables.
//!
//! Conversions follow ggml (`ggml-impl.h`): f32 → f16 and f32 → bf16 round to nearest even,
//! bf16 quiets NaNs; FP8 and E8M0 follow the OCP microscaling spec as torch implements it
//! (`float8_e4m3fn`, `float8_e8m0fnu`).

#![allow(clippy::needless_range_loop)] // index loops mirror the reference's block layout arithmetic

use half::slice::HalfFloatSliceExt;

/// IEEE binary16 bits → f32 (exact).
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// f32 → IEEE binary16 bits, round to nearest even (as `GGML_FP32_TO_FP16` and numpy).
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// bfloat16 bits → f32 (exact: the bits are the top half of an f32).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 → bfloat16 bits as ggml's `ggml_compute_fp32_to_bf16`: NaNs become quiet NaNs with the
/// same sign and top payload bits, everything else rounds to nearest even (overflow gives inf).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u as u64 + 0x7fff + ((u as u64 >> 16) & 1)) >> 16) as u16
}

/// FP8 e4m3fn → f32: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, `S.1111.111`
/// is NaN; exponent 0 is subnormal (`m/8 · 2^-6`). Largest finite value 448.
#[inline]
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0x0f) as u32;
    let m = (b & 0x07) as u32;
    if e == 0x0f && m == 0x07 {
        return f32::NAN.copysign(sign);
    }
    if e == 0 {
        // Subnormal: m · 2^-9, exact in f32.
        return sign * (m as f32) * (1.0 / 512.0);
    }
    let bits = ((b as u32 & 0x80) << 24) | ((e + 127 - 7) << 23) | (m << 20);
    f32::from_bits(bits)
}

/// E8M0 scale byte → `2^(b-127)`; 0 gives 2^-127 (an f32 subnormal) and 255 is NaN, as the OCP
/// spec and torch's `float8_e8m0fnu` say (ggml's `ggml_e8m0_to_fp32` gives inf for 255).
#[inline]
pub fn e8m0_to_f32(b: u8) -> f32 {
    match b {
        0 => f32::from_bits(0x0040_0000),
        255 => f32::NAN,
        _ => f32::from_bits((b as u32) << 23),
    }
}

/// Elements converted per step by the chunked f16 paths (a stack buffer, no allocation).
const F16_CHUNK: usize = 64;

fn read_u16s<const N: usize>(bytes: &[u8], dst: &mut [u16; N]) {
    for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
        *d = u16::from_le_bytes([b[0], b[1]]);
    }
}

/// Dequantize a plain (block size 1) type. `data.len() == n · dtype.block_bytes()` is checked by
/// the caller.
pub(super) fn dequantize(dtype: crate::DType, data: &[u8], out: &mut [f32]) {
    use crate::DType as T;
    match dtype {
        T::F32 => {
            for (y, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        T::F16 => {
            let mut bits = [0u16; F16_CHUNK];
            for (y, b) in out.chunks_mut(F16_CHUNK).zip(data.chunks(2 * F16_CHUNK)) {
                read_u16s(b, &mut bits);
                let h: &[half::f16] = bytemuck::cast_slice(&bits[..y.len()]);
                h.convert_to_f32_slice(y);
            }
        }
        T::BF16 => {
            for (y, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *y = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        T::F64 => {
            for (y, b) in out.iter_mut().zip(data.chunks_exact(8)) {
                *y = f64::from_le_bytes(b.try_into().expect("8-byte chunk")) as f32;
            }
        }
        T::F8_E4M3 => {
            for (y, &b) in out.iter_mut().zip(data) {
                *y = fp8_e4m3_to_f32(b);
            }
        }
        T::F8_E8M0 => {
            for (y, &b) in out.iter_mut().zip(data) {
                *y = e8m0_to_f32(b);
            }
        }
        T::I8 => {
            for (y, &b) in out.iter_mut().zip(data) {
                *y = b as i8 as f32;
            }
        }
        T::U8 => {
            for (y, &b) in out.iter_mut().zip(data) {
                *y = b as f32;
            }
        }
        T::I16 => {
            for (y, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *y = i16::from_le_bytes([b[0], b[1]]) as f32;
            }
        }
        T::I32 => {
            for (y, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *y = i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32;
            }
        }
        T::I64 => {
            for (y, b) in out.iter_mut().zip(data.chunks_exact(8)) {
                *y = i64::from_le_bytes(b.try_into().expect("8-byte chunk")) as f32;
            }
        }
        _ => unreachable!("float::dequantize called with block type {dtype}"),
    }
}

/// Store `x` as F32, F16 or BF16 (little-endian), `out.len() == x.len() · element size`.
pub(super) fn quantize(dtype: crate::DType, x: &[f32], out: &mut [u8]) {
    use crate::DType as T;
    match dtype {
        T::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        T::F16 => {
            for (o, &v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f32_to_f16(v).to_le_bytes());
            }
        }
        T::BF16 => {
            for (o, &v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f32_to_bf16(v).to_le_bytes());
            }
        }
        _ => unreachable!("float::quantize called with {dtype}"),
    }
}

/// Sum of 8 independent lanes: the lanes let the compiler vectorise the loops that feed them
/// (a single f32 accumulator is a serial chain it may not reorder).
#[inline]
pub(super) fn sum8(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

/// `row · x` for an F32 row.
pub(super) fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (xc, xt) = x.as_chunks::<8>();
    let (rc, rt) = row.as_chunks::<32>();
    for (r, xs) in rc.iter().zip(xc) {
        for i in 0..8 {
            let w = f32::from_le_bytes([r[4 * i], r[4 * i + 1], r[4 * i + 2], r[4 * i + 3]]);
            acc[i] += w * xs[i];
        }
    }
    let mut s = sum8(acc);
    for (b, &v) in rt.chunks_exact(4).zip(xt) {
        s += f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * v;
    }
    s
}

/// `row · x` for a BF16 row (the conversion is a shift, so this vectorises).
pub(super) fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (xc, xt) = x.as_chunks::<8>();
    let (rc, rt) = row.as_chunks::<16>();
    for (r, xs) in rc.iter().zip(xc) {
        for i in 0..8 {
            acc[i] += bf16_to_f32(u16::from_le_bytes([r[2 * i], r[2 * i + 1]])) * xs[i];
        }
    }
    let mut s = sum8(acc);
    for (b, &v) in rt.chunks_exact(2).zip(xt) {
        s += bf16_to_f32(u16::from_le_bytes([b[0], b[1]])) * v;
    }
    s
}

/// `row · x` for an F16 row: converts 64 elements at a time into a stack buffer with `half`'s
/// slice conversion (F16C / NEON when the CPU has it), then an 8-lane dot.
pub(super) fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    let mut bits = [0u16; F16_CHUNK];
    let mut w = [0f32; F16_CHUNK];
    let mut acc = [0f32; 8];
    let mut tail = 0f32;
    for (r, xs) in row.chunks(2 * F16_CHUNK).zip(x.chunks(F16_CHUNK)) {
        let n = xs.len();
        read_u16s(r, &mut bits);
        let h: &[half::f16] = bytemuck::cast_slice(&bits[..n]);
        h.convert_to_f32_slice(&mut w[..n]);
        if n == F16_CHUNK {
            for (wc, xc) in w.as_chunks::<8>().0.iter().zip(xs.as_chunks::<8>().0) {
                for i in 0..8 {
                    acc[i] += wc[i] * xc[i];
                }
            }
        } else {
            for (a, b) in w[..n].iter().zip(xs) {
                tail += a * b;
            }
        }
    }
    sum8(acc) + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_e4m3_known_values() {
        // OCP spec table: 0x7e = 448 (max), 0x08 = 2^-6 (min normal), 0x01 = 2^-9 (min
        // subnormal), 0x38 = 1, 0xb8 = -1, 0x7f NaN.
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0);
        assert_eq!(fp8_e4m3_to_f32(0xb8), -1.0);
        assert!(fp8_e4m3_to_f32(0x7f).is_nan() && fp8_e4m3_to_f32(0xff).is_nan());
        assert_eq!(fp8_e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn e8m0_and_bf16_known_values() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(128), 2.0);
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert!(e8m0_to_f32(255).is_nan());
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // Ties round to even: 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125.
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0);
    }
}
