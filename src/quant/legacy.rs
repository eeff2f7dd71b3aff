//! The 32-element "legacy" quants Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (ggml-common.h
//! `block_q4_0` ... `block_q8_0`; ggml-quants.c `dequantize_row_*`, `quantize_row_*_ref`).
//!
//! Layout shared by the 4- and 5-bit ones: byte j of `qs` holds element j in its low nibble and
//! element j+16 in its high nibble; Q5's fifth bits sit in a little-endian u32 `qh`, bit j for
//! element j. Scales are f16 (stored here as raw bytes so every block struct has alignment 1
//! and can be cast from any `&[u8]`).

#![allow(clippy::needless_range_loop)] // index loops mirror the reference's block layout arithmetic

use super::float::{f16_to_f32, f32_to_f16, sum8};
use super::simd::{axpy8, dot32_into, h16, madd};
use bytemuck::{Pod, Zeroable};

pub(super) const QK: usize = 32;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// f16 scale: value = d · (q − 8).
    pub d: [u8; 2],
    pub qs: [u8; QK / 2],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_1 {
    /// f16 scale and offset: value = d · q + m.
    pub d: [u8; 2],
    pub m: [u8; 2],
    pub qs: [u8; QK / 2],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_0 {
    /// f16 scale: value = d · (q − 16).
    pub d: [u8; 2],
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_1 {
    pub d: [u8; 2],
    pub m: [u8; 2],
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ8_0 {
    /// f16 scale: value = d · q, q an i8.
    pub d: [u8; 2],
    pub qs: [u8; QK],
}

const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

#[inline]
fn h(b: [u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(b))
}

#[inline]
fn store_h(x: f32) -> [u8; 2] {
    f32_to_f16(x).to_le_bytes()
}

// ---------------------------------------------------------------------------------------
// Dequantize (the products are the reference's, `(float)q * d (+ m)`, so results are exact
// matches of ggml and gguf-py).

pub(super) fn dequant_q4_0(b: &BlockQ4_0, y: &mut [f32; QK]) {
    let d = h(b.d);
    for j in 0..QK / 2 {
        y[j] = ((b.qs[j] & 0x0f) as i32 - 8) as f32 * d;
        y[j + QK / 2] = ((b.qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

pub(super) fn dequant_q4_1(b: &BlockQ4_1, y: &mut [f32; QK]) {
    let (d, m) = (h(b.d), h(b.m));
    for j in 0..QK / 2 {
        y[j] = (b.qs[j] & 0x0f) as f32 * d + m;
        y[j + QK / 2] = (b.qs[j] >> 4) as f32 * d + m;
    }
}

/// The 5-bit levels of elements j and j+16 of a Q5 block (fifth bits from `qh`).
#[inline]
fn q5_pair(qs: &[u8; 16], qh: u32, j: usize) -> (u8, u8) {
    let h0 = (((qh >> j) << 4) & 0x10) as u8;
    let h1 = ((qh >> (j + 12)) & 0x10) as u8;
    ((qs[j] & 0x0f) | h0, (qs[j] >> 4) | h1)
}

pub(super) fn dequant_q5_0(b: &BlockQ5_0, y: &mut [f32; QK]) {
    let d = h(b.d);
    let qh = u32::from_le_bytes(b.qh);
    for j in 0..QK / 2 {
        let (q0, q1) = q5_pair(&b.qs, qh, j);
        y[j] = (q0 as i32 - 16) as f32 * d;
        y[j + QK / 2] = (q1 as i32 - 16) as f32 * d;
    }
}

pub(super) fn dequant_q5_1(b: &BlockQ5_1, y: &mut [f32; QK]) {
    let (d, m) = (h(b.d), h(b.m));
    let qh = u32::from_le_bytes(b.qh);
    for j in 0..QK / 2 {
        let (q0, q1) = q5_pair(&b.qs, qh, j);
        y[j] = q0 as f32 * d + m;
        y[j + QK / 2] = q1 as f32 * d + m;
    }
}

pub(super) fn dequant_q8_0(b: &BlockQ8_0, y: &mut [f32; QK]) {
    let d = h(b.d);
    for (v, &q) in y.iter_mut().zip(&b.qs) {
        *v = q as i8 as f32 * d;
    }
}

// ---------------------------------------------------------------------------------------
// Quantize: ggml's `quantize_row_*_ref`, step for step (same f32 operations in the same
// order, C's truncating float→int casts), so the bytes equal llama.cpp's and gguf-py's.

/// The signed value of largest magnitude (the first one on ties), as the reference picks it.
#[inline]
fn signed_absmax(x: &[f32; QK]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

#[inline]
fn min_max(x: &[f32; QK]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

pub(super) fn quant_q4_0(x: &[f32; QK], b: &mut BlockQ4_0) {
    let d = signed_absmax(x) / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b.d = store_h(d);
    for j in 0..QK / 2 {
        // (int8_t)(v + 8.5f), capped at 15: the value of largest magnitude maps to level 0.
        let q0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let q1 = ((x[j + QK / 2] * id + 8.5) as i8).min(15) as u8;
        b.qs[j] = q0 | (q1 << 4);
    }
}

pub(super) fn quant_q4_1(x: &[f32; QK], b: &mut BlockQ4_1) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b.d = store_h(d);
    b.m = store_h(min);
    for j in 0..QK / 2 {
        let q0 = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
        let q1 = (((x[j + QK / 2] - min) * id + 0.5) as i8).min(15) as u8;
        b.qs[j] = q0 | (q1 << 4);
    }
}

/// Packs 32 five-bit levels into Q5's `qs` and `qh`.
#[inline]
fn pack_q5(q: &[u8; QK], qs: &mut [u8; 16], qh: &mut [u8; 4]) {
    let mut h = 0u32;
    for j in 0..QK / 2 {
        let (q0, q1) = (q[j], q[j + QK / 2]);
        qs[j] = (q0 & 0x0f) | ((q1 & 0x0f) << 4);
        h |= (((q0 & 0x10) >> 4) as u32) << j;
        h |= (((q1 & 0x10) >> 4) as u32) << (j + QK / 2);
    }
    *qh = h.to_le_bytes();
}

pub(super) fn quant_q5_0(x: &[f32; QK], b: &mut BlockQ5_0) {
    let d = signed_absmax(x) / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b.d = store_h(d);
    let mut q = [0u8; QK];
    for (l, &v) in q.iter_mut().zip(x) {
        *l = ((v * id + 16.5) as i8).min(31) as u8;
    }
    pack_q5(&q, &mut b.qs, &mut b.qh);
}

pub(super) fn quant_q5_1(x: &[f32; QK], b: &mut BlockQ5_1) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b.d = store_h(d);
    b.m = store_h(min);
    let mut q = [0u8; QK];
    for (l, &v) in q.iter_mut().zip(x) {
        // The reference has no cap here: (uint8_t)(v + 0.5f).
        *l = ((v - min) * id + 0.5) as u8;
    }
    pack_q5(&q, &mut b.qs, &mut b.qh);
}

pub(super) fn quant_q8_0(x: &[f32; QK], b: &mut BlockQ8_0) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b.d = store_h(d);
    for (q, &v) in b.qs.iter_mut().zip(x) {
        // roundf: halves away from zero.
        *q = (v * id).round() as i8 as u8;
    }
}

// ---------------------------------------------------------------------------------------
// Dot products against f32 activations, one block at a time with 8 independent lanes.

#[inline]
pub(super) fn dot_q8_0(blocks: &[BlockQ8_0], x: &[[f32; QK]]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, xs) in blocks.iter().zip(x) {
        let q = b.qs.map(|v| v as i8 as f32);
        let mut s = [0f32; 8];
        dot32_into(&mut s, &q, xs);
        axpy8(&mut acc, h16(b.d), &s);
    }
    sum8(acc)
}

/// Q4_0: levels `q − 8`, the scale factored out of each block's lane sums.
#[inline]
pub(super) fn dot_q4_0(blocks: &[BlockQ4_0], x: &[[f32; QK]]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, xs) in blocks.iter().zip(x) {
        let mut s = [0f32; 8];
        for c in 0..2 {
            for i in 0..8 {
                let j = 8 * c + i;
                let (lo, hi) = ((b.qs[j] & 0x0f) as i32 - 8, (b.qs[j] >> 4) as i32 - 8);
                s[i] = madd(lo as f32, xs[j], s[i]);
                s[i] = madd(hi as f32, xs[j + QK / 2], s[i]);
            }
        }
        axpy8(&mut acc, h16(b.d), &s);
    }
    sum8(acc)
}
