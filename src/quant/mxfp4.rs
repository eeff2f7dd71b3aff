//! MXFP4 (OCP microscaling FP4) in ggml's block: one E8M0 scale byte, then 16 bytes of e2m1
//! nibbles (element j low, j+16 high, as Q4_0). ggml keeps the e2m1 values doubled
//! (`kvalues_mxfp4`, integers) and halves the scale instead (`GGML_E8M0_TO_FP32_HALF`), so
//! value = kvalues_mxfp4[nibble] · 2^(e−128). The quantizer is `quantize_row_mxfp4_ref`.

#![allow(clippy::needless_range_loop)] // index loops mirror the reference's block layout arithmetic

use super::float::sum8;
use super::simd::{axpy8, dot32_into, lut_nibbles};
use bytemuck::{Pod, Zeroable};

pub(super) const QK_MXFP4: usize = 32;

/// ggml's `kvalues_mxfp4`: e2m1 values {0, .5, 1, 1.5, 2, 3, 4, 6} doubled, then negated.
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockMxfp4 {
    /// E8M0 exponent byte.
    pub e: u8,
    pub qs: [u8; QK_MXFP4 / 2],
}

const _: () = assert!(std::mem::size_of::<BlockMxfp4>() == 17);

/// Half of the E8M0 scale, `2^(e−128)`, exactly (subnormal for e < 2), as
/// `ggml_e8m0_to_fp32_half`.
#[inline]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits((e as u32 - 1) << 23)
    }
}

/// The table as f32, so a lookup needs no conversion.
const KV_F32: [f32; 16] = {
    let mut t = [0f32; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = KVALUES_MXFP4[i] as f32;
        i += 1;
    }
    t
};

#[inline]
fn kv(nibble: u8) -> f32 {
    KV_F32[(nibble & 0x0f) as usize]
}

pub(super) fn dequant_mxfp4(b: &BlockMxfp4, y: &mut [f32; QK_MXFP4]) {
    let d = e8m0_to_f32_half(b.e);
    for j in 0..16 {
        y[j] = kv(b.qs[j]) * d;
        y[j + 16] = kv(b.qs[j] >> 4) * d;
    }
}

/// e2m1 levels (a `pshufb` lookup with AVX2) dotted in 8 lanes, the E8M0 half-scale
/// factored out (exact: a power of two).
#[inline]
pub(super) fn dot_mxfp4(blocks: &[BlockMxfp4], x: &[[f32; QK_MXFP4]]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, xs) in blocks.iter().zip(x) {
        let q = lut_nibbles(&KVALUES_MXFP4, &b.qs);
        let mut s = [0f32; 8];
        dot32_into(&mut s, &q, xs);
        axpy8(&mut acc, e8m0_to_f32_half(b.e), &s);
    }
    sum8(acc)
}

/// The nibble whose value (times the half scale `d`) is nearest to `x`; the first on ties.
#[inline]
fn best_index(x: f32, d: f32) -> u8 {
    let mut best = 0;
    let mut best_err = (kv(0) * d - x).abs();
    for i in 1..16u8 {
        let err = (kv(i) * d - x).abs();
        if err < best_err {
            best = i;
            best_err = err;
        }
    }
    best
}

pub(super) fn quant_mxfp4(x: &[f32; QK_MXFP4], b: &mut BlockMxfp4) {
    let mut amax = 0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
        }
    }
    // With E = floor(log2 amax), e = E − 2 + 127 makes the half scale d = 2^(E−3), so
    // amax / d lies in [8, 16) doubled units: the top level 12 (e2m1 6.0) sits near amax and
    // elements above 1.5·2^E clip to it. (uint8_t) of the float and the C library's log2, as
    // the reference.
    b.e = if amax > 0.0 {
        (amax.log2().floor() - 2.0 + 127.0) as u8
    } else {
        0
    };
    let d = e8m0_to_f32_half(b.e);
    for j in 0..16 {
        b.qs[j] = best_index(x[j], d) | (best_index(x[j + 16], d) << 4);
    }
}
