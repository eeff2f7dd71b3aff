//! The K-quants Q2_K ... Q6_K: 256-element super-blocks of 16- or 32-element sub-blocks with
//! quantized sub-block scales (ggml-common.h `block_q2_K` ... `block_q6_K`; ggml-quants.c
//! `dequantize_row_q*_K` and `quantize_row_q*_K_ref`).
//!
//! The quantizers are llama.cpp's reference (no importance matrix) searches, step for step:
//! same f32 operations in the same order and ggml's `nearest_int` (round half to even through
//! the 1.5·2^23 trick), so the bytes equal what `llama-quantize` writes without an imatrix.

#![allow(clippy::needless_range_loop)] // index loops mirror the reference's block layout arithmetic

use super::float::{f16_to_f32, f32_to_f16, sum8};
use super::search::{make_qkx2_x8, make_qx_x8, to_lanes, GROUP_MAX_EPS, LANES};
use super::simd::{axpy8, h16, madd};
use bytemuck::{Pod, Zeroable};

pub(super) const QK_K: usize = 256;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ2K {
    /// Per 16-element sub-block: scale in the low nibble, min in the high nibble.
    pub scales: [u8; 16],
    /// 2-bit levels; byte l of each 32-byte group holds elements l, l+32, l+64, l+96 of its
    /// 128-element half (bits 0-1, 2-3, 4-5, 6-7).
    pub qs: [u8; 64],
    /// f16 super-scales: value = d·sc·q − dmin·m.
    pub d: [u8; 2],
    pub dmin: [u8; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ3K {
    /// High bit of each 3-bit level: bit k of byte l is element 32k + l; a set bit means
    /// "no −4 offset".
    pub hmask: [u8; 32],
    /// Low 2 bits, packed as Q2_K's `qs`.
    pub qs: [u8; 64],
    /// Sixteen 6-bit signed scales (offset 32): low nibbles in bytes 0-7 (j and j+8 share a
    /// byte), high 2-bit pairs in bytes 8-11.
    pub scales: [u8; 12],
    pub d: [u8; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    /// Eight 6-bit scales and eight 6-bit mins, packed as `get_scale_min_k4` reads them.
    pub scales: [u8; 12],
    /// Byte l of each 32-byte group: element l (low nibble) and l+32 (high) of its 64.
    pub qs: [u8; 128],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; 12],
    /// Fifth bits: bit 2c of byte l for element 64c + l, bit 2c+1 for element 64c + 32 + l.
    pub qh: [u8; 32],
    pub qs: [u8; 128],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ6K {
    /// Low 4 bits: in each 128-half, byte l holds elements l (low) and l+64 (high), byte l+32
    /// holds l+32 and l+96.
    pub ql: [u8; 128],
    /// High 2 bits: byte l of each 32-byte group holds elements l, l+32, l+64, l+96.
    pub qh: [u8; 64],
    /// i8 scale per 16 elements.
    pub scales: [u8; 16],
    pub d: [u8; 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ2K>() == 84);
const _: () = assert!(std::mem::size_of::<BlockQ3K>() == 110);
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);

#[inline]
fn h(b: [u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(b))
}

#[inline]
fn store_h(x: f32) -> [u8; 2] {
    f32_to_f16(x).to_le_bytes()
}

/// ggml's `nearest_int`: add 1.5·2^23 so the FPU rounds (half to even) into the mantissa.
/// Valid for |x| ≤ 2^22; outside that it returns what ggml's returns (garbage, but the same).
#[inline]
pub(super) fn nearest_int(x: f32) -> i32 {
    let v = x + 12582912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Scale and min of sub-block `j` (0..8) of a Q4_K / Q5_K block (`get_scale_min_k4`).
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Signed 6-bit scale `j` (0..16) of a Q3_K block, offset removed.
#[inline]
fn scale_q3k(j: usize, s: &[u8; 12]) -> i8 {
    let lo = if j < 8 { s[j] & 0x0f } else { s[j - 8] >> 4 };
    let hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    (lo | (hi << 4)) as i8 - 32
}

// ---------------------------------------------------------------------------------------
// Dequantize (products in the reference's order, so results match ggml and gguf-py exactly).

pub(super) fn dequant_q2_k(b: &BlockQ2K, y: &mut [f32; QK_K]) {
    let (d, min) = (h(b.d), h(b.dmin));
    for n in 0..2 {
        let q = &b.qs[32 * n..32 * n + 32];
        for j in 0..4 {
            let shift = 2 * j;
            for half in 0..2 {
                let sc = b.scales[8 * n + 2 * j + half];
                let dl = d * (sc & 0x0f) as f32;
                let ml = min * (sc >> 4) as f32;
                let base = 128 * n + 32 * j + 16 * half;
                for l in 0..16 {
                    y[base + l] = dl * ((q[16 * half + l] >> shift) & 3) as f32 - ml;
                }
            }
        }
    }
}

pub(super) fn dequant_q3_k(b: &BlockQ3K, y: &mut [f32; QK_K]) {
    let d_all = h(b.d);
    for n in 0..2 {
        let q = &b.qs[32 * n..32 * n + 32];
        for j in 0..4 {
            let shift = 2 * j;
            let m = 1u8 << (4 * n + j);
            for half in 0..2 {
                let dl = d_all * scale_q3k(8 * n + 2 * j + half, &b.scales) as f32;
                let base = 128 * n + 32 * j + 16 * half;
                for l in 0..16 {
                    let lo = ((q[16 * half + l] >> shift) & 3) as i32;
                    let off = if b.hmask[16 * half + l] & m != 0 {
                        0
                    } else {
                        4
                    };
                    y[base + l] = dl * (lo - off) as f32;
                }
            }
        }
    }
}

pub(super) fn dequant_q4_k(b: &BlockQ4K, y: &mut [f32; QK_K]) {
    let (d, min) = (h(b.d), h(b.dmin));
    for c in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * c, &b.scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, &b.scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let q = &b.qs[32 * c..32 * c + 32];
        for l in 0..32 {
            y[64 * c + l] = d1 * (q[l] & 0x0f) as f32 - m1;
            y[64 * c + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

pub(super) fn dequant_q5_k(b: &BlockQ5K, y: &mut [f32; QK_K]) {
    let (d, min) = (h(b.d), h(b.dmin));
    for c in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * c, &b.scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, &b.scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
        let q = &b.qs[32 * c..32 * c + 32];
        for l in 0..32 {
            let h1 = if b.qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if b.qh[l] & u2 != 0 { 16 } else { 0 };
            y[64 * c + l] = d1 * ((q[l] & 0x0f) + h1) as f32 - m1;
            y[64 * c + 32 + l] = d2 * ((q[l] >> 4) + h2) as f32 - m2;
        }
    }
}

/// The four signed 6-bit levels (elements l, l+32, l+64, l+96 of a 128-half) of Q6_K.
#[inline]
fn q6_levels(ql: &[u8], qh: &[u8], l: usize) -> [i32; 4] {
    let (a, b, hh) = (ql[l], ql[l + 32], qh[l]);
    [
        ((a & 0x0f) | ((hh & 3) << 4)) as i32 - 32,
        ((b & 0x0f) | (((hh >> 2) & 3) << 4)) as i32 - 32,
        ((a >> 4) | (((hh >> 4) & 3) << 4)) as i32 - 32,
        ((b >> 4) | (((hh >> 6) & 3) << 4)) as i32 - 32,
    ]
}

pub(super) fn dequant_q6_k(b: &BlockQ6K, y: &mut [f32; QK_K]) {
    let d = h(b.d);
    for n in 0..2 {
        let ql = &b.ql[64 * n..64 * n + 64];
        let qh = &b.qh[32 * n..32 * n + 32];
        let sc = &b.scales[8 * n..8 * n + 8];
        for l in 0..32 {
            let q = q6_levels(ql, qh, l);
            let is = l / 16;
            for (k, &qk) in q.iter().enumerate() {
                y[128 * n + 32 * k + l] = d * (sc[is + 2 * k] as i8) as f32 * qk as f32;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Fused dots against f32 activations (`quant::dot`): integer levels converted in 8-lane
// groups, the sub-block scales and mins factored out of the inner sums as ggml's
// `ggml_vec_dot_q*_K_q8_K` does (Σ(d·q − m)·x = d·Σq·x − m·Σx), lanes folded once per row.

/// The Q4_K / Q5_K dot: per 32-element sub-block `d·sc·Σq·x − dmin·m·Σx`, with
/// `levels(c, l)` the (low, high) sub-block levels of byte `l` of quarter `c`.
#[inline(always)]
fn dot_k4_levels(
    d: f32,
    dmin: f32,
    scales: &[u8; 12],
    xs: &[f32; QK_K],
    acc: &mut [f32; 8],
    levels: impl Fn(usize, usize) -> (u8, u8),
) {
    for c in 0..4 {
        let xl: &[f32; 32] = xs[64 * c..64 * c + 32].try_into().unwrap();
        let xh: &[f32; 32] = xs[64 * c + 32..64 * c + 64].try_into().unwrap();
        let (mut sl, mut sh, mut xsl, mut xsh) = ([0f32; 8], [0f32; 8], [0f32; 8], [0f32; 8]);
        for k in 0..4 {
            for i in 0..8 {
                let l = 8 * k + i;
                let (lo, hi) = levels(c, l);
                sl[i] = madd(lo as f32, xl[l], sl[i]);
                sh[i] = madd(hi as f32, xh[l], sh[i]);
                xsl[i] += xl[l];
                xsh[i] += xh[l];
            }
        }
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        axpy8(acc, d * sc1 as f32, &sl);
        axpy8(acc, -(dmin * m1 as f32), &xsl);
        axpy8(acc, d * sc2 as f32, &sh);
        axpy8(acc, -(dmin * m2 as f32), &xsh);
    }
}

/// Q4_K: per 32-element sub-block `d·sc·Σq·x − dmin·m·Σx`.
#[inline]
pub(super) fn dot_q4_k(blocks: &[BlockQ4K], x: &[[f32; QK_K]]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, xs) in blocks.iter().zip(x) {
        let (d, dmin) = (h16(b.d), h16(b.dmin));
        dot_k4_levels(d, dmin, &b.scales, xs, &mut acc, |c, l| {
            let q = b.qs[32 * c + l];
            (q & 0x0f, q >> 4)
        });
    }
    sum8(acc)
}

/// Q5_K: Q4_K with the fifth bit of each level from `qh`.
#[inline]
pub(super) fn dot_q5_k(blocks: &[BlockQ5K], x: &[[f32; QK_K]]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, xs) in blocks.iter().zip(x) {
        let (d, dmin) = (h16(b.d), h16(b.dmin));
        dot_k4_levels(d, dmin, &b.scales, xs, &mut acc, |c, l| {
            let q = b.qs[32 * c + l];
            let hb = b.qh[l] >> (2 * c);
            ((q & 0x0f) | ((hb & 1) << 4), (q >> 4) | ((hb & 2) << 3))
        });
    }
    sum8(acc)
}

/// Q6_K: per 16-element sub-block `d·sc·Σq·x` with the signed levels.
#[inline]
pub(super) fn dot_q6_k(blocks: &[BlockQ6K], x: &[[f32; QK_K]]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, xs) in blocks.iter().zip(x) {
        let d = h16(b.d);
        for n in 0..2 {
            let ql = &b.ql[64 * n..64 * n + 64];
            let qh = &b.qh[32 * n..32 * n + 32];
            let sc = &b.scales[8 * n..8 * n + 8];
            let xh = &xs[128 * n..128 * n + 128];
            for hl in 0..2 {
                let mut s = [[0f32; 8]; 4];
                for c in 0..2 {
                    for i in 0..8 {
                        let l = 16 * hl + 8 * c + i;
                        let q = q6_levels(ql, qh, l);
                        for k in 0..4 {
                            s[k][i] = madd(q[k] as f32, xh[32 * k + l], s[k][i]);
                        }
                    }
                }
                for (k, sk) in s.iter().enumerate() {
                    axpy8(&mut acc, d * (sc[hl + 2 * k] as i8) as f32, sk);
                }
            }
        }
    }
    sum8(acc)
}

// ---------------------------------------------------------------------------------------
// Reference quantizers.

/// The signed value of largest magnitude (first on ties) and its magnitude.
#[inline]
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

/// ggml's `make_q3_quants` with `do_rmse`: symmetric levels −nmax..nmax−1, weights x², then
/// up to 5 rounds of moving single levels while the weighted fit improves. `l` gets the
/// levels offset by nmax. Returns the scale.
fn make_q3<const N: usize>(nmax: i32, x: &[f32; N], l: &mut [i8; N]) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..N {
        let q = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l[i] = q as i8;
        let w = x[i] * x[i];
        sumlx += w * x[i] * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for i in 0..N {
            let w = x[i] * x[i];
            let li = l[i] as f32;
            let mut slx = sumlx - w * x[i] * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l[i] as i32 {
                    let nl = new_l as f32;
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for v in l.iter_mut() {
        *v += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Packs 256 two-bit levels as Q2_K / Q3_K `qs`.
fn pack_2bit(l: &[u8; QK_K], qs: &mut [u8; 64]) {
    for n in 0..2 {
        for i in 0..32 {
            let j = 128 * n + i;
            qs[32 * n + i] = l[j] | (l[j + 32] << 2) | (l[j + 64] << 4) | (l[j + 96] << 6);
        }
    }
}

pub(super) fn quant_q2_k(x: &[f32; QK_K], b: &mut BlockQ2K) {
    const Q4SCALE: f32 = 15.0;
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; 16];
    let mut mins = [0f32; 16];
    // 16 sub-blocks of 16, weights |x|, searched 8 at a time.
    for half in 0..2 {
        let xs = &x[128 * half..128 * half + 128];
        let xt = to_lanes::<16>(xs);
        let wt = xt.map(|v| v.map(f32::abs));
        let mut lt = [[0u8; LANES]; 16];
        let (s, m) = make_qkx2_x8::<16, true>(3, &xt, &wt, &mut lt, -0.5, 0.1, 15);
        for k in 0..LANES {
            scales[8 * half + k] = s[k];
            mins[8 * half + k] = m[k];
            for i in 0..16 {
                l[128 * half + 16 * k + i] = lt[i][k];
            }
        }
    }
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..16 {
        max_scale = max_scale.max_ref(scales[j]);
        max_min = max_min.max_ref(mins[j]);
    }
    if max_scale > 0.0 {
        let iscale = Q4SCALE / max_scale;
        for j in 0..16 {
            b.scales[j] = nearest_int(iscale * scales[j]) as u8;
        }
        b.d = store_h(max_scale / Q4SCALE);
    } else {
        b.scales = [0; 16];
        b.d = store_h(0.0);
    }
    if max_min > 0.0 {
        let iscale = Q4SCALE / max_min;
        for j in 0..16 {
            b.scales[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
        }
        b.dmin = store_h(max_min / Q4SCALE);
    } else {
        b.dmin = store_h(0.0);
    }
    let (d_all, m_all) = (h(b.d), h(b.dmin));
    for j in 0..16 {
        let d = d_all * (b.scales[j] & 0x0f) as f32;
        if d == 0.0 {
            continue;
        }
        let dm = m_all * (b.scales[j] >> 4) as f32;
        for ii in 0..16 {
            l[16 * j + ii] = nearest_int((x[16 * j + ii] + dm) / d).clamp(0, 3) as u8;
        }
    }
    pack_2bit(&l, &mut b.qs);
}

pub(super) fn quant_q3_k(x: &[f32; QK_K], b: &mut BlockQ3K) {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut amax) = (0f32, 0f32);
    for j in 0..16 {
        let xs: &[f32; 16] = x[16 * j..16 * j + 16].try_into().expect("16");
        let ls: &mut [i8; 16] = (&mut l[16 * j..16 * j + 16]).try_into().expect("16");
        scales[j] = make_q3(4, xs, ls);
        if scales[j].abs() > amax {
            amax = scales[j].abs();
            max_scale = scales[j];
        }
    }
    b.scales = [0; 12];
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for j in 0..16 {
            let q = ((nearest_int(iscale * scales[j]) as i8).clamp(-32, 31) + 32) as u8;
            if j < 8 {
                b.scales[j] = q & 0x0f;
            } else {
                b.scales[j - 8] |= (q & 0x0f) << 4;
            }
            b.scales[j % 4 + 8] |= (q >> 4) << (2 * (j / 4));
        }
        b.d = store_h(1.0 / iscale);
    } else {
        b.d = store_h(0.0);
    }
    let d_all = h(b.d);
    for j in 0..16 {
        let d = d_all * scale_q3k(j, &b.scales) as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            l[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-4, 3) + 4) as i8;
        }
    }
    // Levels are 0..8 now; the high bit goes to hmask (bit k of byte m for element 32k + m).
    b.hmask = [0; 32];
    let mut lo = [0u8; QK_K];
    for j in 0..QK_K {
        let mut v = l[j] as u8;
        if v > 3 {
            b.hmask[j % 32] |= 1 << (j / 32);
            v -= 4;
        }
        lo[j] = v;
    }
    pack_2bit(&lo, &mut b.qs);
}

/// Packs eight 6-bit scales and mins as Q4_K / Q5_K `scales`.
fn pack_scales_k4(ls: &[u8; 8], lm: &[u8; 8], s: &mut [u8; 12]) {
    for j in 0..8 {
        let (a, m) = (ls[j], lm[j]);
        if j < 4 {
            s[j] = a;
            s[j + 4] = m;
        } else {
            s[j + 4] = (a & 0x0f) | ((m & 0x0f) << 4);
            s[j - 4] |= (a >> 4) << 6;
            s[j] |= (m >> 4) << 6;
        }
    }
}

/// The shared front half of Q4_K / Q5_K: per 32-element sub-block `make_qkx2` with weights
/// `rms(x) + |x|`, then 6-bit scales and mins relative to the largest ones, then the levels
/// recomputed against the stored (f16-rounded) scales. Returns the levels.
fn quant_k4_scales(
    x: &[f32; QK_K],
    nmax: i32,
    rmin: f32,
    nstep: i32,
    d_out: &mut [u8; 2],
    dmin_out: &mut [u8; 2],
    scales_out: &mut [u8; 12],
) -> [u8; QK_K] {
    // Weights rms(sub-block) + |x|, as the reference.
    let xt = to_lanes::<32>(x);
    let mut wt = [[0f32; LANES]; 32];
    for k in 0..LANES {
        let mut sum_x2 = 0f32;
        for i in 0..32 {
            sum_x2 += xt[i][k] * xt[i][k];
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for i in 0..32 {
            wt[i][k] = av_x + xt[i][k].abs();
        }
    }
    let mut lt = [[0u8; LANES]; 32];
    let (scales, mins) = make_qkx2_x8::<32, false>(nmax, &xt, &wt, &mut lt, rmin, 0.1, nstep);
    let mut l = [0u8; QK_K];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for k in 0..LANES {
        for i in 0..32 {
            l[32 * k + i] = lt[i][k];
        }
        max_scale = max_scale.max_ref(scales[k]);
        max_min = max_min.max_ref(mins[k]);
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        // uint8_t of the int, then capped at 63 (a negative scale wraps high and caps).
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    *scales_out = [0; 12];
    pack_scales_k4(&ls, &lm, scales_out);
    *d_out = store_h(max_scale / 63.0);
    *dmin_out = store_h(max_min / 63.0);
    let (d_all, m_all) = (h(*d_out), h(*dmin_out));
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, scales_out);
        let d = d_all * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = m_all * m as f32;
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, nmax) as u8;
        }
    }
    l
}

pub(super) fn quant_q4_k(x: &[f32; QK_K], b: &mut BlockQ4K) {
    let l = quant_k4_scales(x, 15, -1.0, 20, &mut b.d, &mut b.dmin, &mut b.scales);
    for c in 0..4 {
        for i in 0..32 {
            b.qs[32 * c + i] = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
        }
    }
}

pub(super) fn quant_q5_k(x: &[f32; QK_K], b: &mut BlockQ5K) {
    let l = quant_k4_scales(x, 31, -0.5, 15, &mut b.d, &mut b.dmin, &mut b.scales);
    b.qh = [0; 32];
    for c in 0..4 {
        let (m1, m2) = (1u8 << (2 * c), 2u8 << (2 * c));
        for i in 0..32 {
            let (mut l1, mut l2) = (l[64 * c + i], l[64 * c + 32 + i]);
            if l1 > 15 {
                l1 -= 16;
                b.qh[i] |= m1;
            }
            if l2 > 15 {
                l2 -= 16;
                b.qh[i] |= m2;
            }
            b.qs[32 * c + i] = l1 | (l2 << 4);
        }
    }
}

pub(super) fn quant_q6_k(x: &[f32; QK_K], b: &mut BlockQ6K) {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    for half in 0..2 {
        let mut lt = [[0i8; LANES]; 16];
        let s = make_qx_x8::<16>(32, &to_lanes(&x[128 * half..128 * half + 128]), &mut lt);
        for k in 0..LANES {
            scales[8 * half + k] = s[k];
            for i in 0..16 {
                l[128 * half + 16 * k + i] = lt[i][k];
            }
        }
    }
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for j in 0..16 {
        if scales[j].abs() > max_abs_scale {
            max_abs_scale = scales[j].abs();
            max_scale = scales[j];
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        *b = BlockQ6K::zeroed();
        return;
    }
    let iscale = -128.0 / max_scale;
    b.d = store_h(1.0 / iscale);
    for j in 0..16 {
        // int8_t of MIN(127, ·), as the reference stores it.
        b.scales[j] = nearest_int(iscale * scales[j]).min(127) as i8 as u8;
    }
    let d_all = h(b.d);
    for j in 0..16 {
        let d = d_all * (b.scales[j] as i8) as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            l[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-32, 31) + 32) as i8;
        }
    }
    for n in 0..2 {
        for i in 0..32 {
            let j = 128 * n + i;
            let q = [l[j], l[j + 32], l[j + 64], l[j + 96]].map(|v| v as u8);
            b.ql[64 * n + i] = (q[0] & 0x0f) | ((q[2] & 0x0f) << 4);
            b.ql[64 * n + i + 32] = (q[1] & 0x0f) | ((q[3] & 0x0f) << 4);
            b.qh[32 * n + i] =
                (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
        }
    }
}

/// `if (v > m) m = v;` (unlike `f32::max`, never lets a NaN in, as the reference).
trait MaxRef {
    fn max_ref(self, v: f32) -> f32;
}

impl MaxRef for f32 {
    #[inline]
    fn max_ref(self, v: f32) -> f32 {
        if v > self {
            v
        } else {
            self
        }
    }
}
