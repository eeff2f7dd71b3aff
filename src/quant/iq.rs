//! The non-linear 4-bit quants IQ4_NL (32-element blocks) and IQ4_XS (256-element
//! super-blocks with 6-bit sub-block scales): each nibble indexes the 16-entry table
//! `kvalues_iq4nl` (ggml-common.h), scaled by the block's scale.
//!
//! Quantizers: ggml-quants.c `quantize_row_iq4_nl_impl` without importance weights and with
//! `ntry = 7`, i.e. what `llama-quantize` writes for these types without an imatrix (weights
//! x², 15 candidate scales, least-squares refit).

#![allow(clippy::needless_range_loop)] // index loops mirror the reference's block layout arithmetic

use super::float::{f16_to_f32, f32_to_f16, sum8};
use super::k::nearest_int;
use super::search::{best_index_iq4, fit_iq4_x8, to_lanes, LANES};
use super::simd::{axpy8, dot32_into, h16, lut_nibbles};
use bytemuck::{Pod, Zeroable};

pub(super) const QK4_NL: usize = 32;
pub(super) const QK_K: usize = 256;

/// ggml's `kvalues_iq4nl`: the levels a nibble selects, sorted.
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockIq4Nl {
    /// f16 scale: value = d · KVALUES_IQ4NL[nibble].
    pub d: [u8; 2],
    /// Byte j: element j (low nibble) and j+16 (high nibble).
    pub qs: [u8; QK4_NL / 2],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockIq4Xs {
    pub d: [u8; 2],
    /// Little-endian u16: high 2 bits of sub-block scale ib at bits 2ib..2ib+2.
    pub scales_h: [u8; 2],
    /// Low 4 bits of the 6-bit scales (offset 32), two sub-blocks per byte (even ib low).
    pub scales_l: [u8; QK_K / 64],
    /// Per 32-element sub-block, 16 bytes laid out as IQ4_NL's `qs`.
    pub qs: [u8; QK_K / 2],
}

const _: () = assert!(std::mem::size_of::<BlockIq4Nl>() == 18);
const _: () = assert!(std::mem::size_of::<BlockIq4Xs>() == 136);

#[inline]
fn h(b: [u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(b))
}

/// The table as f32, so a lookup needs no conversion.
const KV_F32: [f32; 16] = {
    let mut t = [0f32; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = KVALUES_IQ4NL[i] as f32;
        i += 1;
    }
    t
};

#[inline]
fn kv(nibble: u8) -> f32 {
    KV_F32[(nibble & 0x0f) as usize]
}

pub(super) fn dequant_iq4_nl(b: &BlockIq4Nl, y: &mut [f32; QK4_NL]) {
    let d = h(b.d);
    for j in 0..16 {
        y[j] = d * kv(b.qs[j]);
        y[j + 16] = d * kv(b.qs[j] >> 4);
    }
}

/// 6-bit scale of sub-block `ib` (0..8) of an IQ4_XS block, offset removed.
#[inline]
fn scale_iq4_xs(b: &BlockIq4Xs, ib: usize) -> i32 {
    let sh = u16::from_le_bytes(b.scales_h);
    let lo = (b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0f;
    let hi = ((sh >> (2 * ib)) & 3) as u8;
    (lo | (hi << 4)) as i32 - 32
}

pub(super) fn dequant_iq4_xs(b: &BlockIq4Xs, y: &mut [f32; QK_K]) {
    let d = h(b.d);
    for ib in 0..8 {
        let dl = d * scale_iq4_xs(b, ib) as f32;
        let qs = &b.qs[16 * ib..16 * ib + 16];
        for j in 0..16 {
            y[32 * ib + j] = dl * kv(qs[j]);
            y[32 * ib + 16 + j] = dl * kv(qs[j] >> 4);
        }
    }
}

/// Table levels (a `pshufb` lookup with AVX2) dotted in 8 lanes, the scale factored out.
#[inline]
pub(super) fn dot_iq4_nl(blocks: &[BlockIq4Nl], x: &[[f32; QK4_NL]]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, xs) in blocks.iter().zip(x) {
        let q = lut_nibbles(&KVALUES_IQ4NL, &b.qs);
        let mut s = [0f32; 8];
        dot32_into(&mut s, &q, xs);
        axpy8(&mut acc, h16(b.d), &s);
    }
    sum8(acc)
}

// ---------------------------------------------------------------------------------------
// Quantize.

/// Candidate scales tried on each side of the first guess (`ntry` in the reference).
const NTRY: i32 = 7;

fn pack_nibbles(l: &[u8; 32], qs: &mut [u8]) {
    for j in 0..16 {
        qs[j] = l[j] | (l[j + 16] << 4);
    }
}

/// Levels of one 32-element group against the inverse scale `id`.
fn levels(id: f32, x: &[f32]) -> [u8; 32] {
    let mut l = [0u8; 32];
    for (li, &v) in l.iter_mut().zip(x) {
        *li = best_index_iq4(id * v) as u8;
    }
    l
}

/// IQ4_NL blocks, 8 at a time through the lane search (a short tail is padded with zeros).
pub(super) fn quant_iq4_nl(x: &[f32], out: &mut [BlockIq4Nl]) {
    for (xs, bs) in x.chunks(LANES * QK4_NL).zip(out.chunks_mut(LANES)) {
        let mut padded = [0f32; LANES * QK4_NL];
        padded[..xs.len()].copy_from_slice(xs);
        let d = fit_iq4_x8(&to_lanes::<32>(&padded), NTRY);
        for (k, b) in bs.iter_mut().enumerate() {
            b.d = f32_to_f16(d[k]).to_le_bytes();
            let id = if d[k] != 0.0 { 1.0 / d[k] } else { 0.0 };
            pack_nibbles(&levels(id, &xs[32 * k..32 * k + 32]), &mut b.qs);
        }
    }
}

pub(super) fn quant_iq4_xs(x: &[f32; QK_K], b: &mut BlockIq4Xs) {
    let scales = fit_iq4_x8(&to_lanes::<32>(x), NTRY);
    let (mut max_scale, mut amax_scale) = (0f32, 0f32);
    for &s in &scales {
        if s.abs() > amax_scale {
            amax_scale = s.abs();
            max_scale = s;
        }
    }
    // The sub-block scales are stored as 6-bit multiples of d; levels are recomputed against
    // the f32 product d·l (not the f16-rounded d), as the reference does.
    let d = -max_scale / 32.0;
    b.d = f32_to_f16(d).to_le_bytes();
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sh = 0u16;
    b.scales_l = [0; 4];
    for ib in 0..8 {
        let ls = nearest_int(id * scales[ib]).clamp(-32, 31);
        let dl = d * ls as f32;
        let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
        let l = levels(idl, &x[32 * ib..32 * ib + 32]);
        let ls = (ls + 32) as u8;
        b.scales_l[ib / 2] |= (ls & 0x0f) << (4 * (ib % 2));
        sh |= ((ls >> 4) as u16) << (2 * ib);
        pack_nibbles(&l, &mut b.qs[16 * ib..16 * ib + 16]);
    }
    b.scales_h = sh.to_le_bytes();
}
