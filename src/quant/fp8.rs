//! `F8_E4M3_B128`: FP8 e4m3fn weights with 128-wide block scales, lathe's load-time layout of
//! the DeepSeek-V3/V4 release linears (`X.weight` F8_E4M3 [out, in] + `X.scale` per 128×128
//! block). One block holds 128 consecutive elements of a row: the scale of the 128×128 block
//! they belong to, as f32 (E8M0 scales convert exactly), then their 128 e4m3 bytes unchanged;
//! value = e4m3(q) · d, exactly what `safetensors::dequant_fp8_block` computes on the release
//! pair (one f32 rounding of the product). `safetensors::repack_fp8_block_to_b128` builds it
//! from a release; [`quant_f8_b128`] quantizes f32 per 128-element block (lathe's own: test
//! weights and synthetic models, no reference quantizer to match).

use super::float::sum8;
use super::simd::{axpy8, dot32_into};
use bytemuck::{Pod, Zeroable};

pub(super) const QK_F8: usize = 128;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockF8B128 {
    /// The block scale, f32 little-endian (raw bytes: alignment 1).
    pub d: [u8; 4],
    /// e4m3fn codes of elements 0..128.
    pub qs: [u8; QK_F8],
}

const _: () = assert!(std::mem::size_of::<BlockF8B128>() == 132);

/// e4m3fn code → f32 for every byte, as `float::fp8_e4m3_to_f32` (checked by a test):
/// magnitude `(8 + m) · 2^(e − 10)` for e > 0, `m · 2^-9` for e = 0; 0x7F / 0xFF are NaN
/// (never in valid weights).
static E4M3: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        let (e, m) = ((i >> 3) & 15, i & 7);
        // f32 bits: the 3 mantissa bits on top of f32's mantissa, exponent rebiased 7 → 127;
        // subnormals (e = 0) are m · 2^-9, exact: 2^-9 · m built from bits as well.
        let mag = if e == 15 && m == 7 {
            0x7fc0_0000
        } else if e != 0 {
            (((e + 127 - 7) as u32) << 23) | ((m as u32) << 20)
        } else if m == 0 {
            0
        } else {
            // m · 2^-9 with m in 1..8: normalise m = 2^k · (1 + f)
            let k = if m >= 4 {
                2
            } else if m >= 2 {
                1
            } else {
                0
            };
            let f = ((m as u32) << (23 - k)) & 0x007f_ffff;
            (((127 - 9 + k) as u32) << 23) | f
        };
        let sign = if i & 0x80 != 0 { 0x8000_0000u32 } else { 0 };
        t[i] = f32::from_bits(sign | mag);
        i += 1;
    }
    t
};

impl BlockF8B128 {
    #[inline]
    pub fn scale(&self) -> f32 {
        f32::from_le_bytes(self.d)
    }
}

pub(super) fn dequant_f8_b128(b: &BlockF8B128, y: &mut [f32; QK_F8]) {
    let d = b.scale();
    for (y, &q) in y.iter_mut().zip(&b.qs) {
        *y = E4M3[q as usize] * d;
    }
}

/// Round-to-nearest-even e4m3fn code of `v`, saturating at ±448 (the largest finite value;
/// the NaN code is never produced). Exact arithmetic: scaling by powers of two only.
pub(super) fn f32_to_e4m3(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    let a = v.abs();
    let mag = if a >= 448.0 {
        0x7e
    } else if a < 2f32.powi(-6) {
        // subnormal step 2^-9; 8 steps round up into the smallest normal, code 0x08
        (a * 512.0).round_ties_even() as u8
    } else {
        let e = ((a.to_bits() >> 23) as i32) - 127; // -6..=8
        let q = ((a / 2f32.powi(e) - 1.0) * 8.0).round_ties_even() as u8; // 0..=8
        (((e + 7) as u8) << 3) + q // q = 8 carries into the exponent
    };
    sign | mag.min(0x7e)
}

/// One block of 128: scale `amax / 448` (f32) so the largest magnitude maps to e4m3's largest
/// finite value, codes rounded to nearest even.
pub(super) fn quant_f8_b128(x: &[f32; QK_F8], b: &mut BlockF8B128) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 448.0;
    b.d = d.to_le_bytes();
    // divide (not multiply by 1/d): 1/d overflows for subnormal d
    for (q, &v) in b.qs.iter_mut().zip(x) {
        *q = if d > 0.0 { f32_to_e4m3(v / d) } else { 0 };
    }
}

/// e4m3fn code → f32 with lane-friendly arithmetic instead of [`E4M3`]'s gather (equal to it
/// for every code but the NaN pair 0x7F / 0xFF, which reads 480: never in valid weights).
/// Normals: the 7 magnitude bits moved to f32's exponent/mantissa position, exponent rebiased
/// by 120 (127 − 7); subnormals (exponent 0): `m · 2^-9`, exact in f32.
#[inline(always)]
fn e4m3_lane(b: u8) -> f32 {
    let mag = (b & 0x7f) as u32;
    let normal = f32::from_bits((mag << 20) + (120 << 23));
    let sub = mag as f32 * (1.0 / 512.0);
    let v = if mag < 8 { sub } else { normal };
    f32::from_bits(v.to_bits() | (((b & 0x80) as u32) << 24))
}

/// Per block: the e4m3 values dotted with x in 8 lanes, then times the scale (the scale leaves
/// the inner sum, as the GPU kernel does).
#[inline]
pub(super) fn dot_f8_b128(blocks: &[BlockF8B128], x: &[[f32; QK_F8]]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, xs) in blocks.iter().zip(x) {
        let mut s = [0f32; 8];
        for (q, xc) in b.qs.as_chunks::<32>().0.iter().zip(xs.as_chunks::<32>().0) {
            let w: [f32; 32] = std::array::from_fn(|i| e4m3_lane(q[i]));
            dot32_into(&mut s, &w, xc);
        }
        axpy8(&mut acc, b.scale(), &s);
    }
    sum8(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_inverts_decode_and_rounds_to_nearest() {
        for b in (0..=255u8).filter(|b| b & 0x7f != 0x7f) {
            let v = E4M3[b as usize];
            let back = f32_to_e4m3(v);
            // ±0 both decode to 0: the encoder keeps the sign
            assert_eq!(E4M3[back as usize], v, "{b:#04x}");
        }
        // every midpoint between neighbours rounds to the even code, nudges to the nearer one
        for b in 0..0x7eu8 {
            let (lo, hi) = (E4M3[b as usize], E4M3[b as usize + 1]);
            let mid = (lo + hi) / 2.0;
            let even = if b % 2 == 0 { b } else { b + 1 };
            assert_eq!(f32_to_e4m3(mid), even, "midpoint {mid}");
            assert_eq!(f32_to_e4m3(mid - (hi - lo) / 8.0), b);
            assert_eq!(f32_to_e4m3(mid + (hi - lo) / 8.0), b + 1);
        }
        assert_eq!(f32_to_e4m3(1e9), 0x7e);
        assert_eq!(f32_to_e4m3(-460.0), 0xfe);
    }

    #[test]
    fn table_matches_the_scalar_decoder() {
        for b in 0..=255u8 {
            let (t, r) = (E4M3[b as usize], super::super::fp8_e4m3_to_f32(b));
            assert!(
                t.to_bits() == r.to_bits() || (t.is_nan() && r.is_nan()),
                "{b:#04x}: {t} vs {r}"
            );
        }
    }

    #[test]
    fn lane_decoder_matches_the_table_except_nan() {
        for b in (0..=255u8).filter(|b| b & 0x7f != 0x7f) {
            let (t, l) = (E4M3[b as usize], e4m3_lane(b));
            assert_eq!(t.to_bits(), l.to_bits(), "{b:#04x}: {t} vs {l}");
        }
    }
}
