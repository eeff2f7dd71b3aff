//! Row dots against int8 activations, the CPU side of `--activations int8` for the cold
//! experts: x quantized per 32 values in two levels exactly as the GPU's `quantize_x2` does
//! ([`super::q8x::quantize_x2`]: ggml's `block_q8_1`, then its residual the same way,
//! x̂ = dx·q + dx₂·q₂), weight levels times each level's int8 codes summed in integers, block
//! scales applied once per 32 values and level, as ggml's `ggml_vec_dot_*_q8_*` do per level. The weight types are the
//! GPU's int8 matvec (`gpu::matvec::int8_x_supported`; tests/cpu_moe_simd.rs checks they agree): Q4_0, Q8_0, Q4_K, Q5_K, Q6_K.
//!
//! **One result at every SIMD level.** A block's integer sum is exact whatever order its
//! products are added in, so the only rounding is in the f32 steps after it, and those are
//! fixed here: block b's contribution `c_b` (per type below, plain multiplies and subtracts, no
//! fused multiply-add) goes to lane `b mod 8` of eight f32 accumulators in increasing b, and
//! the lanes are added as `((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7))`. The scalar loops, AVX2
//! (`maddubs`) and AVX-512 VNNI (`vpdpbusd`) kernels all do exactly this, so their results are
//! equal bit for bit (`tests` below force every level the machine has).
//!
//! Per 32-value block b with x scales `dx`, `dx₂`, `sx = dx·Σq + dx₂·Σq₂` (Σx̂), integer sums
//! `i`, `i₂` of weight levels × each level's codes, and `xi = dx·i + dx₂·i₂`:
//! - Q8_0: `c = d·xi` (signed levels);
//! - Q4_0: `c = d·(xi − 8·sx)` (levels 0..15, the −8 offset through Σx̂);
//! - Q4_K, Q5_K: `c = (d·sc_j)·xi − (dmin·m_j)·sx` (sub-block j of 32 is one x block);
//! - Q6_K: `c = d·xi`, `i = sc_a·Σ(q−32)·x + sc_b·Σ(q−32)·x` over the block's two 16-value
//!   halves per level (their i8 scales folded into the integer sums).

#![allow(clippy::needless_range_loop)] // index loops mirror the block layouts

use super::q8x;
use super::simd::SimdLevel;
use crate::quant::{scale_min_k4, BlockQ4K, BlockQ4_0, BlockQ5K, BlockQ6K, BlockQ8_0};
use crate::DType;

/// Values per int8 block.
pub const BLOCK: usize = q8x::BLOCK;

/// True for the weight types with an int8-activation dot here (the GPU's set,
/// `gpu::matvec::int8_x_supported`; other types take f32 activations on both sides).
pub fn supported(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q4_0 | DType::Q8_0 | DType::Q4_K | DType::Q5_K | DType::Q6_K
    )
}

/// Rows of x as two-level int8 blocks, laid out for the dots: each level's codes, and per
/// block `d`, `d₂` and `s = d·Σq + d₂·Σq₂` in separate arrays (eight blocks' scales are one
/// vector load).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Q8Rows {
    pub cols: usize,
    /// [rows, cols] each level
    pub qs: Vec<i8>,
    pub qs2: Vec<i8>,
    /// [rows, cols / 32] each
    pub d: Vec<f32>,
    pub d2: Vec<f32>,
    pub s: Vec<f32>,
}

/// One row of [`Q8Rows`].
#[derive(Clone, Copy, Debug)]
pub struct Q8Row<'a> {
    pub qs: &'a [i8],
    pub qs2: &'a [i8],
    pub d: &'a [f32],
    pub d2: &'a [f32],
    pub s: &'a [f32],
}

impl Q8Rows {
    /// `x` ([rows, cols], cols a multiple of 32) quantized as the GPU's `quantize_x2`; `s` is
    /// the f32 sum of the levels' `d·Σq`, as the GPU's kernels take it.
    pub fn quantize(x: &[f32], cols: usize) -> Q8Rows {
        let (a, b) = q8x::quantize_x2(x, cols);
        Q8Rows {
            cols,
            d: a.scales.iter().map(|s| s[0]).collect(),
            d2: b.scales.iter().map(|s| s[0]).collect(),
            s: a.scales
                .iter()
                .zip(&b.scales)
                .map(|(s, t)| s[1] + t[1])
                .collect(),
            qs: a.qs,
            qs2: b.qs,
        }
    }

    pub fn rows(&self) -> usize {
        self.qs.len() / self.cols.max(1)
    }

    pub fn row(&self, t: usize) -> Q8Row<'_> {
        let (c, nb) = (self.cols, self.cols / BLOCK);
        Q8Row {
            qs: &self.qs[t * c..(t + 1) * c],
            qs2: &self.qs2[t * c..(t + 1) * c],
            d: &self.d[t * nb..(t + 1) * nb],
            d2: &self.d2[t * nb..(t + 1) * nb],
            s: &self.s[t * nb..(t + 1) * nb],
        }
    }
}

/// `row · x̂` for one stored row of a [`supported`] type against one int8 row, at `level`
/// (which the CPU must have: `SimdLevel::check`). The same bits at every level.
///
/// Panics (our invariant) when the type is not supported or `row` is not exactly the bytes
/// of `x.qs.len()` values.
#[track_caller]
pub fn dot(level: SimdLevel, dtype: DType, row: &[u8], x: Q8Row<'_>) -> f32 {
    let mut out = [0f32];
    dot_many(level, dtype, row, &[x], &mut out);
    out[0]
}

/// `out[t] = row · x̂_t` for every int8 row of `xs` (one expert's row against a prefill
/// group's tokens): each block's weights decoded once for several tokens, every token's
/// result equal to [`dot`]'s bit for bit.
#[track_caller]
pub fn dot_many(level: SimdLevel, dtype: DType, row: &[u8], xs: &[Q8Row<'_>], out: &mut [f32]) {
    assert!(supported(dtype), "q8dot: no int8 dot for {dtype}");
    assert_eq!(
        xs.len(),
        out.len(),
        "q8dot: {} rows, {} outputs",
        xs.len(),
        out.len()
    );
    for x in xs {
        assert_eq!(
            dtype.bytes_for(x.qs.len() as u64),
            Some(row.len() as u64),
            "q8dot: a {dtype} row of {} bytes against {} activations",
            row.len(),
            x.qs.len()
        );
        assert!(
            x.d.len() * BLOCK == x.qs.len()
                && x.qs2.len() == x.qs.len()
                && x.s.len() == x.d.len()
                && x.d2.len() == x.d.len(),
            "q8dot: levels and scales"
        );
    }
    // MANY tokens at a time, their lanes on the stack
    for (xg, og) in xs.chunks(MANY).zip(out.chunks_mut(MANY)) {
        let mut lanes = [[0f32; 8]; MANY];
        let lanes = &mut lanes[..xg.len()];
        match level {
            SimdLevel::Scalar => {
                for (l, x) in lanes.iter_mut().zip(xg) {
                    *l = scalar::dot(dtype, row, *x);
                }
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 | SimdLevel::Avx512Vnni => {
                assert!(level.supported(), "q8dot: the CPU lacks {level}");
                // SAFETY: the CPU has the level's features (checked above); lengths checked.
                unsafe {
                    if level == SimdLevel::Avx512Vnni {
                        x86::dot_vnni(dtype, row, xg, lanes)
                    } else {
                        x86::dot_avx2(dtype, row, xg, lanes)
                    }
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => panic!("q8dot: {level} on a CPU that is not x86_64"),
        }
        for (o, l) in og.iter_mut().zip(lanes.iter()) {
            *o = finish(*l);
        }
    }
}

/// Tokens per pass of [`dot_many`]: each block's weights are decoded once for this many
/// tokens' x; one token runs the same code with one accumulator, so a token's result never
/// depends on the others.
const MANY: usize = 8;

/// The fixed sum of the eight lanes.
#[inline(always)]
fn finish(a: [f32; 8]) -> f32 {
    ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))
}

/// `xi = dx·i + dx₂·i₂` of one block: both levels' integer sums scaled (plain multiplies and
/// an add, as the vector kernels do them).
#[inline(always)]
fn lv2(dx: f32, i: i32, dx2: f32, i2: i32) -> f32 {
    dx * i as f32 + dx2 * i2 as f32
}

#[inline(always)]
fn h16(b: [u8; 2]) -> f32 {
    crate::quant::f16_to_f32(u16::from_le_bytes(b))
}

/// `d·sc_j` and `dmin·m_j` of a Q4_K / Q5_K block's eight sub-blocks.
#[inline(always)]
fn k4_scales(d: [u8; 2], dmin: [u8; 2], scales: &[u8; 12]) -> ([f32; 8], [f32; 8]) {
    let (d, dmin) = (h16(d), h16(dmin));
    let (mut ds, mut dm) = ([0f32; 8], [0f32; 8]);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, scales);
        ds[j] = d * sc as f32;
        dm[j] = dmin * m as f32;
    }
    (ds, dm)
}

/// The plain loops: the definition the SIMD kernels reproduce.
mod scalar {
    use super::*;

    /// A Q4_K / Q5_K super-block: levels, fifth bits (Q5_K), `d·sc` and `dmin·m`.
    type KBlock<'a> = (&'a [u8; 128], Option<&'a [u8; 32]>, ([f32; 8], [f32; 8]));

    /// `acc[b mod 8] += c(b)` for every block, in groups of eight (lanes past the end add 0,
    /// as the vector kernels' zeroed tail lanes do).
    fn lanes(nb: usize, mut c: impl FnMut(usize) -> f32) -> [f32; 8] {
        let mut acc = [0f32; 8];
        for g in 0..nb.div_ceil(8) {
            for l in 0..8 {
                let b = 8 * g + l;
                acc[l] += if b < nb { c(b) } else { 0.0 };
            }
        }
        acc
    }

    fn isum(w: impl Iterator<Item = i32>, x: &[i8]) -> i32 {
        w.zip(x).map(|(w, &x)| w * x as i32).sum()
    }

    /// xi of block b of `x` from the block's 32 weight levels `lv`.
    fn xi_of(x: &Q8Row<'_>, b: usize, lv: impl Fn(usize) -> i32) -> f32 {
        let r = BLOCK * b..BLOCK * (b + 1);
        let i = isum((0..BLOCK).map(&lv), &x.qs[r.clone()]);
        let i2 = isum((0..BLOCK).map(&lv), &x.qs2[r]);
        lv2(x.d[b], i, x.d2[b], i2)
    }

    pub(super) fn dot(dtype: DType, row: &[u8], x: Q8Row<'_>) -> [f32; 8] {
        let nb = x.d.len();
        let xi = |b: usize, lv: &dyn Fn(usize) -> i32| xi_of(&x, b, lv);
        match dtype {
            DType::Q8_0 => {
                let bl: &[BlockQ8_0] = bytemuck::cast_slice(row);
                lanes(nb, |b| h16(bl[b].d) * xi(b, &|j| bl[b].qs[j] as i8 as i32))
            }
            DType::Q4_0 => {
                let bl: &[BlockQ4_0] = bytemuck::cast_slice(row);
                lanes(nb, |b| {
                    let q = &bl[b].qs;
                    let lv = |j: usize| (if j < 16 { q[j] & 15 } else { q[j - 16] >> 4 }) as i32;
                    h16(bl[b].d) * (xi(b, &lv) - 8.0 * x.s[b])
                })
            }
            DType::Q4_K | DType::Q5_K => {
                // (qs, fifth bits, d·sc, dmin·m) of super-block i
                let sb = |i: usize| -> KBlock<'_> {
                    if dtype == DType::Q4_K {
                        let b = &bytemuck::cast_slice::<u8, BlockQ4K>(row)[i];
                        (&b.qs, None, k4_scales(b.d, b.dmin, &b.scales))
                    } else {
                        let b = &bytemuck::cast_slice::<u8, BlockQ5K>(row)[i];
                        (&b.qs, Some(&b.qh), k4_scales(b.d, b.dmin, &b.scales))
                    }
                };
                lanes(nb, |b| {
                    let (j, c) = (b % 8, b % 8 / 2);
                    let (qs, qh, (ds, dm)) = sb(b / 8);
                    let lv = |l: usize| {
                        let q = qs[32 * c + l];
                        let nib = if j % 2 == 0 { q & 15 } else { q >> 4 };
                        let fifth = qh.map_or(0, |h| ((h[l] >> j) & 1) << 4);
                        (nib | fifth) as i32
                    };
                    ds[j] * xi(b, &lv) - dm[j] * x.s[b]
                })
            }
            DType::Q6_K => {
                let bl: &[BlockQ6K] = bytemuck::cast_slice(row);
                lanes(nb, |b| {
                    let (blk, j) = (&bl[b / 8], b % 8);
                    let (n, k) = (j / 4, j % 4);
                    let lv = |l: usize| {
                        let ql = blk.ql[64 * n + 32 * (k % 2) + l];
                        let lo = if k < 2 { ql & 15 } else { ql >> 4 };
                        let hi = (blk.qh[32 * n + l] >> (2 * k)) & 3;
                        (lo | (hi << 4)) as i32 - 32
                    };
                    // both halves of one level's codes xs, each times its i8 scale
                    let isc = |xs: &[i8]| {
                        (0..2)
                            .map(|h| {
                                let s = blk.scales[8 * n + 2 * k + h] as i8 as i32;
                                s * (16 * h..16 * h + 16)
                                    .map(|l| lv(l) * xs[l] as i32)
                                    .sum::<i32>()
                            })
                            .sum::<i32>()
                    };
                    let r = BLOCK * b..BLOCK * (b + 1);
                    let (i, i2) = (isc(&x.qs[r.clone()]), isc(&x.qs2[r]));
                    h16(blk.d) * lv2(x.d[b], i, x.d2[b], i2)
                })
            }
            _ => unreachable!("q8dot::dot checked the type"),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// Σ of four u8 × i8 products per i32 lane: `vpdpbusd` with VNNI, else `maddubs` (i16
    /// pairs: every level here times a code stays below 2^15 with the pair) and `madd`.
    #[inline(always)]
    unsafe fn dot4<const VNNI: bool>(w: __m256i, x: __m256i) -> __m256i {
        if VNNI {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
        } else {
            _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
        }
    }

    /// Eight blocks' i32 lane partials → one vector of their eight sums (lane l: block l).
    #[inline(always)]
    unsafe fn reduce8(v: &[__m256i; 8]) -> __m256i {
        let h01 = _mm256_hadd_epi32(v[0], v[1]);
        let h23 = _mm256_hadd_epi32(v[2], v[3]);
        let h45 = _mm256_hadd_epi32(v[4], v[5]);
        let h67 = _mm256_hadd_epi32(v[6], v[7]);
        let a = _mm256_hadd_epi32(h01, h23);
        let b = _mm256_hadd_epi32(h45, h67);
        _mm256_add_epi32(
            _mm256_permute2x128_si256(a, b, 0x20),
            _mm256_permute2x128_si256(a, b, 0x31),
        )
    }

    /// An f16 scale → f32 through F16C (exact, as `quant::f16_to_f32`).
    #[inline(always)]
    unsafe fn h16x(b: [u8; 2]) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(
            _mm_cvtsi32_si128(u16::from_le_bytes(b) as i32),
        ))
    }

    /// `d·sc_j` and `dmin·m_j` of a Q4_K / Q5_K block as lanes j, the 6-bit fields unpacked
    /// with 32-bit masks as ggml's AVX2 `ggml_vec_dot_q4_K_q8_K` does (the values of
    /// `quant::scale_min_k4`; the products are the scalar ones).
    #[inline(always)]
    unsafe fn k4_scales_v(d: [u8; 2], dmin: [u8; 2], s: &[u8; 12]) -> (__m256, __m256) {
        const M1: u32 = 0x3f3f_3f3f;
        const M2: u32 = 0x0f0f_0f0f;
        const M3: u32 = 0x0303_0303;
        let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
        let (u0, u1, u2) = (w(0), w(1), w(2));
        let sc_lo = u0 & M1;
        let sc_hi = (u2 & M2) | (((u0 >> 6) & M3) << 4);
        let m_lo = u1 & M1;
        let m_hi = ((u2 >> 4) & M2) | (((u1 >> 6) & M3) << 4);
        let lanes = |lo: u32, hi: u32| {
            let v = _mm_set_epi32(0, 0, hi as i32, lo as i32);
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
        };
        (
            _mm256_mul_ps(_mm256_set1_ps(h16x(d)), lanes(sc_lo, sc_hi)),
            _mm256_mul_ps(_mm256_set1_ps(h16x(dmin)), lanes(m_lo, m_hi)),
        )
    }

    #[inline(always)]
    unsafe fn load(p: *const i8) -> __m256i {
        _mm256_loadu_si256(p.cast())
    }

    /// `xi = dx·i + dx₂·i₂` of eight blocks (lane l: block l of `x`'s blocks `r`) from both
    /// levels' i32 lane partials (`lv2`, in vectors).
    #[inline(always)]
    unsafe fn xi8(
        x: &Q8Row<'_>,
        r: std::ops::Range<usize>,
        v: &[__m256i; 8],
        v2: &[__m256i; 8],
    ) -> __m256 {
        let i = _mm256_cvtepi32_ps(reduce8(v));
        let i2 = _mm256_cvtepi32_ps(reduce8(v2));
        let dx = load8(&x.d[r.clone()]);
        let dx2 = load8(&x.d2[r]);
        _mm256_add_ps(_mm256_mul_ps(dx, i), _mm256_mul_ps(dx2, i2))
    }

    /// Eight f32 lanes from up to eight values (the rest 0).
    #[inline(always)]
    unsafe fn load8(v: &[f32]) -> __m256 {
        if v.len() >= 8 {
            _mm256_loadu_ps(v.as_ptr())
        } else {
            let mut a = [0f32; 8];
            a[..v.len()].copy_from_slice(v);
            _mm256_loadu_ps(a.as_ptr())
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_avx2(
        dtype: DType,
        row: &[u8],
        xs: &[Q8Row<'_>],
        out: &mut [[f32; 8]],
    ) {
        dot_x86::<false>(dtype, row, xs, out)
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn dot_vnni(
        dtype: DType,
        row: &[u8],
        xs: &[Q8Row<'_>],
        out: &mut [[f32; 8]],
    ) {
        dot_x86::<true>(dtype, row, xs, out)
    }

    /// The eight lanes of every token of `xg` (at most [`MANY`]) into `out`.
    #[inline(always)]
    unsafe fn dot_x86<const VNNI: bool>(
        dtype: DType,
        row: &[u8],
        xg: &[Q8Row<'_>],
        out: &mut [[f32; 8]],
    ) {
        // Full passes with MANY accumulators; the rest one token at a time, in registers
        // (the same operations per token either way).
        let mut i = 0;
        while i < xg.len() {
            if xg.len() - i >= MANY {
                let xs: &[Q8Row<'_>; MANY] = xg[i..i + MANY].try_into().expect("MANY rows");
                store(kernel::<VNNI, MANY>(dtype, row, xs), &mut out[i..i + MANY]);
                i += MANY;
            } else {
                store(kernel::<VNNI, 1>(dtype, row, &[xg[i]]), &mut out[i..i + 1]);
                i += 1;
            }
        }
    }

    #[inline(always)]
    unsafe fn store<const T: usize>(acc: [__m256; T], out: &mut [[f32; 8]]) {
        for (o, a) in out.iter_mut().zip(acc) {
            _mm256_storeu_ps(o.as_mut_ptr(), a);
        }
    }

    #[inline(always)]
    unsafe fn kernel<const VNNI: bool, const T: usize>(
        dtype: DType,
        row: &[u8],
        xs: &[Q8Row<'_>; T],
    ) -> [__m256; T] {
        match dtype {
            DType::Q8_0 => {
                blocks32::<false, BlockQ8_0, T>(bytemuck::cast_slice(row), xs, |b, p| {
                    q8_0::<VNNI>(b, p)
                })
            }
            DType::Q4_0 => blocks32::<true, BlockQ4_0, T>(bytemuck::cast_slice(row), xs, |b, p| {
                q4_0::<VNNI>(b, p)
            }),
            DType::Q4_K => q4_k::<VNNI, false, T>(row, xs),
            DType::Q5_K => q4_k::<VNNI, true, T>(row, xs),
            DType::Q6_K => q6_k::<VNNI, T>(bytemuck::cast_slice(row), xs),
            _ => unreachable!("q8dot checked the type"),
        }
    }

    /// Q8_0: signed levels through `|w|` and the codes with w's sign (x codes are never
    /// −128, so the sign flip cannot overflow). Integer partials against the codes at `xp`.
    #[inline(always)]
    unsafe fn q8_0<const VNNI: bool>(w: &BlockQ8_0, xp: *const i8) -> __m256i {
        let w = _mm256_loadu_si256(w.qs.as_ptr().cast());
        dot4::<VNNI>(_mm256_abs_epi8(w), _mm256_sign_epi8(load(xp), w))
    }

    /// Q4_0: low nibbles are values 0..16, high ones 16..32.
    #[inline(always)]
    unsafe fn q4_0<const VNNI: bool>(b: &BlockQ4_0, xp: *const i8) -> __m256i {
        let m = _mm_set1_epi8(0x0f);
        let q = _mm_loadu_si128(b.qs.as_ptr().cast());
        let w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
        dot4::<VNNI>(w, load(xp))
    }

    /// Q8_0 / Q4_0 rows (`OFFSET8`: Q4_0's formula): eight blocks per step, the last one
    /// zero-padded. The weights stay in L1 across a pass's tokens.
    #[inline(always)]
    unsafe fn blocks32<const OFFSET8: bool, B: HasD, const T: usize>(
        bl: &[B],
        xs: &[Q8Row<'_>; T],
        f: impl Fn(&B, *const i8) -> __m256i,
    ) -> [__m256; T] {
        let mut acc = [_mm256_setzero_ps(); T];
        let nb = bl.len();
        for (g, grp) in bl.chunks(8).enumerate() {
            let mut dw = [0u16; 8];
            for (l, b) in grp.iter().enumerate() {
                dw[l] = u16::from_le_bytes(b.d());
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(dw.as_ptr().cast()));
            let r = 8 * g..(8 * g + 8).min(nb);
            for (a, x) in acc.iter_mut().zip(xs) {
                let mut v = [_mm256_setzero_si256(); 8];
                let mut v2 = [_mm256_setzero_si256(); 8];
                for (l, b) in grp.iter().enumerate() {
                    v[l] = f(b, x.qs.as_ptr().add(BLOCK * (8 * g + l)));
                    v2[l] = f(b, x.qs2.as_ptr().add(BLOCK * (8 * g + l)));
                }
                let xi = xi8(x, r.clone(), &v, &v2);
                let c = if OFFSET8 {
                    let sx = load8(&x.s[r.clone()]);
                    let eight = _mm256_set1_ps(8.0);
                    _mm256_mul_ps(dw, _mm256_sub_ps(xi, _mm256_mul_ps(eight, sx)))
                } else {
                    _mm256_mul_ps(dw, xi)
                };
                *a = _mm256_add_ps(*a, c);
            }
        }
        acc
    }

    /// The f16 scale of a 32-value block.
    pub(super) trait HasD {
        fn d(&self) -> [u8; 2];
    }
    impl HasD for BlockQ8_0 {
        fn d(&self) -> [u8; 2] {
            self.d
        }
    }
    impl HasD for BlockQ4_0 {
        fn d(&self) -> [u8; 2] {
            self.d
        }
    }

    /// Q4_K, or Q5_K (`Q5`: the fifth bit of sub-block j's value l is bit j of `qh[l]`):
    /// per super-block the eight sub-blocks' levels (unsigned bytes) and `d·sc`, `dmin·m`,
    /// then per token `c = ds·(dx·i) − dm·sx`.
    #[inline(always)]
    unsafe fn q4_k<const VNNI: bool, const Q5: bool, const T: usize>(
        row: &[u8],
        xs: &[Q8Row<'_>; T],
    ) -> [__m256; T] {
        let mut acc = [_mm256_setzero_ps(); T];
        let (m4, one) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(1));
        let n = row.len() / if Q5 { 176 } else { 144 };
        for i in 0..n {
            let (qs, qh, (ds, dm)) = if Q5 {
                let b = &bytemuck::cast_slice::<u8, BlockQ5K>(row)[i];
                (&b.qs, Some(&b.qh), k4_scales_v(b.d, b.dmin, &b.scales))
            } else {
                let b = &bytemuck::cast_slice::<u8, BlockQ4K>(row)[i];
                (&b.qs, None, k4_scales_v(b.d, b.dmin, &b.scales))
            };
            let mut w = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let q = _mm256_loadu_si256(qs.as_ptr().add(32 * c).cast());
                w[2 * c] = _mm256_and_si256(q, m4);
                w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            }
            if let Some(qh) = qh {
                let qh = _mm256_loadu_si256(qh.as_ptr().cast());
                for j in 0..8 {
                    let bit =
                        _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j as i32)), one);
                    w[j] = _mm256_or_si256(w[j], _mm256_slli_epi16(bit, 4));
                }
            }
            for (a, x) in acc.iter_mut().zip(xs) {
                let (xp, xp2) = (x.qs.as_ptr().add(256 * i), x.qs2.as_ptr().add(256 * i));
                let mut v = [_mm256_setzero_si256(); 8];
                let mut v2 = [_mm256_setzero_si256(); 8];
                for j in 0..8 {
                    v[j] = dot4::<VNNI>(w[j], load(xp.add(32 * j)));
                    v2[j] = dot4::<VNNI>(w[j], load(xp2.add(32 * j)));
                }
                let xi = xi8(x, 8 * i..8 * i + 8, &v, &v2);
                let sx = _mm256_loadu_ps(x.s.as_ptr().add(8 * i));
                let c = _mm256_sub_ps(_mm256_mul_ps(ds, xi), _mm256_mul_ps(dm, sx));
                *a = _mm256_add_ps(*a, c);
            }
        }
        acc
    }

    /// Σ sc·(q − 32)·x of one Q6_K block (levels `w`, scales `sc` as `q6_k` lays them out,
    /// `off` = 32 per byte) against the codes `xv`, as i32 lane partials.
    #[inline(always)]
    unsafe fn q6_part<const VNNI: bool>(
        w: __m256i,
        sc: __m256i,
        off: __m256i,
        xv: __m256i,
    ) -> __m256i {
        if VNNI {
            let p = _mm256_sub_epi32(dot4::<true>(w, xv), dot4::<true>(off, xv));
            _mm256_mullo_epi32(p, sc)
        } else {
            // i16 pairs: |(q − 32)·x| pairs < 2^13
            let p = _mm256_sub_epi16(_mm256_maddubs_epi16(w, xv), _mm256_maddubs_epi16(off, xv));
            _mm256_madd_epi16(p, sc)
        }
    }

    /// Q6_K: per super-block the eight 32-value blocks' levels (0..63) and their two i8
    /// scales, then per token `i = Σ sc·(q − 32)·x` over the halves and `c = d·(dx·i)`.
    #[inline(always)]
    unsafe fn q6_k<const VNNI: bool, const T: usize>(
        bl: &[BlockQ6K],
        xs: &[Q8Row<'_>; T],
    ) -> [__m256; T] {
        let mut acc = [_mm256_setzero_ps(); T];
        let (m4, m3, off) = (
            _mm256_set1_epi8(0x0f),
            _mm256_set1_epi8(3),
            _mm256_set1_epi8(32),
        );
        for (i, b) in bl.iter().enumerate() {
            let mut w = [_mm256_setzero_si256(); 8];
            let mut sc = [_mm256_setzero_si256(); 8];
            for n in 0..2 {
                let qa = _mm256_loadu_si256(b.ql.as_ptr().add(64 * n).cast());
                let qb = _mm256_loadu_si256(b.ql.as_ptr().add(64 * n + 32).cast());
                let qh = _mm256_loadu_si256(b.qh.as_ptr().add(32 * n).cast());
                let lows = [
                    _mm256_and_si256(qa, m4),
                    _mm256_and_si256(qb, m4),
                    _mm256_and_si256(_mm256_srli_epi16(qa, 4), m4),
                    _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4),
                ];
                for k in 0..4 {
                    let hi =
                        _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32)), m3);
                    w[4 * n + k] = _mm256_or_si256(lows[k], _mm256_slli_epi16(hi, 4));
                    let s0 = b.scales[8 * n + 2 * k] as i8;
                    let s1 = b.scales[8 * n + 2 * k + 1] as i8;
                    sc[4 * n + k] = if VNNI {
                        // i32 lanes 0..4 hold values 0..16: s0; lanes 4..8: s1
                        let (s0, s1) = (s0 as i32, s1 as i32);
                        _mm256_set_epi32(s1, s1, s1, s1, s0, s0, s0, s0)
                    } else {
                        // i16 lanes 0..8 hold values 0..16
                        _mm256_set_m128i(_mm_set1_epi16(s1 as i16), _mm_set1_epi16(s0 as i16))
                    };
                }
            }
            let d = _mm256_set1_ps(h16x(b.d));
            for (a, x) in acc.iter_mut().zip(xs) {
                let (xp, xp2) = (x.qs.as_ptr().add(256 * i), x.qs2.as_ptr().add(256 * i));
                let mut v = [_mm256_setzero_si256(); 8];
                let mut v2 = [_mm256_setzero_si256(); 8];
                for j in 0..8 {
                    v[j] = q6_part::<VNNI>(w[j], sc[j], off, load(xp.add(32 * j)));
                    v2[j] = q6_part::<VNNI>(w[j], sc[j], off, load(xp2.add(32 * j)));
                }
                let xi = xi8(x, 8 * i..8 * i + 8, &v, &v2);
                *a = _mm256_add_ps(*a, _mm256_mul_ps(d, xi));
            }
        }
        acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant;

    /// splitmix64 → uniform in [-1, 1).
    fn data(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^= z >> 31;
                (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Every level the machine has gives the scalar bits, and the scalar result is the
    /// dequantized row times x̂ (the int8 x dequantized) up to f32 rounding.
    #[test]
    fn every_level_equals_scalar_bits() {
        let levels = SimdLevel::all_supported();
        eprintln!("q8dot levels tested: {levels:?}");
        for dtype in [
            DType::Q4_0,
            DType::Q8_0,
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
        ] {
            // 32·k and 256·k columns, odd block counts (a partial last group of 8 blocks)
            let cols_list: &[usize] = if dtype.block_size() == 32 {
                &[32, 96, 288, 544, 2048]
            } else {
                &[256, 768, 2304]
            };
            for &cols in cols_list {
                let rows = 5;
                let w = data(cols as u64, rows * cols);
                let wq = quant::quantize(dtype, &w).unwrap();
                let rb = wq.len() / rows;
                let mut x = data(7 + cols as u64, cols);
                x[3] = 0.0;
                x[cols - 1] *= 9.0; // one large value per row: a coarse block scale
                let qx = Q8Rows::quantize(&x, cols);
                let (x1, x2) = q8x::quantize_x2(&x, cols);
                let xh = q8x::dequantize2(&x1, &x2);
                // 11 tokens: a full pass of MANY and a partial one
                let xs: Vec<f32> = (0..11).flat_map(|t| data(100 + t, cols)).collect();
                let qxs = Q8Rows::quantize(&xs, cols);
                let rows_x: Vec<Q8Row<'_>> = (0..11).map(|t| qxs.row(t)).collect();
                for r in 0..rows {
                    let row = &wq[rb * r..rb * (r + 1)];
                    let want = dot(SimdLevel::Scalar, dtype, row, qx.row(0));
                    for &l in &levels {
                        let mut many = [0f32; 11];
                        dot_many(l, dtype, row, &rows_x, &mut many);
                        for (t, m) in many.iter().enumerate() {
                            let one = dot(SimdLevel::Scalar, dtype, row, rows_x[t]);
                            assert_eq!(m.to_bits(), one.to_bits(), "{dtype} {cols} {l} token {t}");
                        }
                        let got = dot(l, dtype, row, qx.row(0));
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{dtype} {cols} row {r} at {l}: {got} vs {want}"
                        );
                    }
                    let wd = quant::dequantize_to_vec(dtype, row, cols).unwrap();
                    let exact: f64 = wd.iter().zip(&xh).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let mag: f64 = wd
                        .iter()
                        .zip(&xh)
                        .map(|(a, b)| (*a as f64 * *b as f64).abs())
                        .sum();
                    assert!(
                        (want as f64 - exact).abs() <= 1e-5 * mag + 1e-30,
                        "{dtype} {cols} row {r}: {want} vs {exact} (Σ|wx| {mag})"
                    );
                }
            }
        }
    }
}
