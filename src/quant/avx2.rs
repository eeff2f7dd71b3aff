//! x86_64 AVX2 + FMA (+ F16C) row dots for the types MoE experts ship in, chosen at run time
//! by `quant::dot` when the CPU has them. Same arithmetic as the portable loops of the type
//! files (levels widened to f32 in 8 lanes, block scales and K-quant mins applied to the lane
//! sums: `d·Σq·x − m·Σx` as ggml's `ggml_vec_dot_q4_K_q8_K`), written with intrinsics because
//! LLVM's SLP vectorizer picked 4-wide vectors for the portable form (measured 3-6× slower).
//!
//! Every function here requires the CPU features (callers check `simd::has_avx2_fma`) and
//! whole blocks (`x` holds exactly the row's elements as `[f32; block]` chunks).

#![allow(clippy::needless_range_loop)] // index loops mirror the block layout arithmetic

use super::fp8::{BlockF8B128, QK_F8};
use super::iq::{BlockIq4Nl, KVALUES_IQ4NL};
use super::k::{scale_min_k4, BlockQ4K, BlockQ5K, BlockQ6K, QK_K};
use super::legacy::{BlockQ4_0, BlockQ8_0};
use super::mxfp4::{e8m0_to_f32_half, BlockMxfp4, KVALUES_MXFP4};
use std::arch::x86_64::*;

#[inline(always)]
unsafe fn h16(b: [u8; 2]) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(
        _mm_cvtsi32_si128(u16::from_le_bytes(b) as i32),
    ))
}

/// Eight bytes at `p` zero-extended to i32 lanes.
#[inline(always)]
unsafe fn u8x8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))
}

/// The low 8 i8 lanes of `v` as f32.
#[inline(always)]
unsafe fn i8x8_ps(v: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
}

/// `((v >> sh) & 3) << 4`: two high bits of Q6_K levels in place.
#[inline(always)]
unsafe fn q6_high(v: __m256i, sh: i32) -> __m256i {
    let m3 = _mm256_set1_epi32(3);
    _mm256_slli_epi32(
        _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(sh)), m3),
        4,
    )
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// One Q4_K block's levels as f32 lanes and its folded scales: `lo[c][k]` / `hi[c][k]` are
/// elements `64c + 8k..` / `64c + 32 + 8k..`; `s` holds `d·sc` and `m` `dmin·min` per
/// sub-block (2c, 2c + 1).
struct Q4kDecoded {
    lo: [[__m256; 4]; 4],
    hi: [[__m256; 4]; 4],
    s: [f32; 8],
    m: [f32; 8],
}

#[inline(always)]
unsafe fn q4_k_decode(b: &BlockQ4K) -> Q4kDecoded {
    let m4 = _mm256_set1_epi32(0x0f);
    let (d, dmin) = (h16(b.d), h16(b.dmin));
    let mut out = Q4kDecoded {
        lo: [[_mm256_setzero_ps(); 4]; 4],
        hi: [[_mm256_setzero_ps(); 4]; 4],
        s: [0.0; 8],
        m: [0.0; 8],
    };
    for c in 0..4 {
        for k in 0..4 {
            let q = u8x8(b.qs.as_ptr().add(32 * c + 8 * k));
            out.lo[c][k] = _mm256_cvtepi32_ps(_mm256_and_si256(q, m4));
            out.hi[c][k] = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
        }
    }
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &b.scales);
        out.s[j] = d * sc as f32;
        out.m[j] = dmin * m as f32;
    }
    out
}

/// `acc += ` one decoded Q4_K block against 256 activations at `xp`: the single order of
/// operations both `dot_q4_k` and `dot_many_q4_k` use, so they agree bit for bit.
#[inline(always)]
unsafe fn q4_k_apply(q: &Q4kDecoded, xp: *const f32, mut acc: __m256) -> __m256 {
    for c in 0..4 {
        let xp = xp.add(64 * c);
        let (mut sl, mut sh) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let (mut xsl, mut xsh) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for k in 0..4 {
            let xl = _mm256_loadu_ps(xp.add(8 * k));
            let xh = _mm256_loadu_ps(xp.add(32 + 8 * k));
            sl = _mm256_fmadd_ps(q.lo[c][k], xl, sl);
            sh = _mm256_fmadd_ps(q.hi[c][k], xh, sh);
            xsl = _mm256_add_ps(xsl, xl);
            xsh = _mm256_add_ps(xsh, xh);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(q.s[2 * c]), sl, acc);
        acc = _mm256_fnmadd_ps(_mm256_set1_ps(q.m[2 * c]), xsl, acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(q.s[2 * c + 1]), sh, acc);
        acc = _mm256_fnmadd_ps(_mm256_set1_ps(q.m[2 * c + 1]), xsh, acc);
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q4_k(blocks: &[BlockQ4K], x: &[[f32; QK_K]]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, xs) in blocks.iter().zip(x) {
        acc = q4_k_apply(&q4_k_decode(b), xs.as_ptr(), acc);
    }
    hsum(acc)
}

/// Tokens per pass of the `dot_many_*` kernels (their accumulators stay in L1).
const MANY: usize = 16;

/// [`dot_q4_k`] for every x of `xs`, each block decoded once per [`MANY`] tokens; equal to
/// `dot_q4_k` per token bit for bit.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_many_q4_k(blocks: &[BlockQ4K], xs: &[&[f32]], out: &mut [f32]) {
    for (xg, og) in xs.chunks(MANY).zip(out.chunks_mut(MANY)) {
        let mut acc = [_mm256_setzero_ps(); MANY];
        for (i, b) in blocks.iter().enumerate() {
            let q = q4_k_decode(b);
            for (a, x) in acc.iter_mut().zip(xg) {
                *a = q4_k_apply(&q, x.as_ptr().add(QK_K * i), *a);
            }
        }
        for (o, a) in og.iter_mut().zip(&acc) {
            *o = hsum(*a);
        }
    }
}

/// A Q5_K block decoded as Q4_K's (levels 0..31 with the fifth bit from `qh`: bit 2c of
/// `qh[l]` for element 64c + l, bit 2c + 1 for 64c + 32 + l), applied by `q4_k_apply`.
#[inline(always)]
unsafe fn q5_k_decode(b: &BlockQ5K) -> Q4kDecoded {
    let (m4, one) = (_mm256_set1_epi32(0x0f), _mm256_set1_epi32(1));
    let (d, dmin) = (h16(b.d), h16(b.dmin));
    let mut out = Q4kDecoded {
        lo: [[_mm256_setzero_ps(); 4]; 4],
        hi: [[_mm256_setzero_ps(); 4]; 4],
        s: [0.0; 8],
        m: [0.0; 8],
    };
    for k in 0..4 {
        let hb = u8x8(b.qh.as_ptr().add(8 * k));
        for c in 0..4 {
            let q = u8x8(b.qs.as_ptr().add(32 * c + 8 * k));
            let h1 = _mm256_and_si256(_mm256_srl_epi32(hb, _mm_cvtsi32_si128(2 * c as i32)), one);
            let h2 = _mm256_and_si256(
                _mm256_srl_epi32(hb, _mm_cvtsi32_si128(2 * c as i32 + 1)),
                one,
            );
            let lo = _mm256_or_si256(_mm256_and_si256(q, m4), _mm256_slli_epi32(h1, 4));
            let hi = _mm256_or_si256(_mm256_srli_epi32(q, 4), _mm256_slli_epi32(h2, 4));
            out.lo[c][k] = _mm256_cvtepi32_ps(lo);
            out.hi[c][k] = _mm256_cvtepi32_ps(hi);
        }
    }
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &b.scales);
        out.s[j] = d * sc as f32;
        out.m[j] = dmin * m as f32;
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q5_k(blocks: &[BlockQ5K], x: &[[f32; QK_K]]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, xs) in blocks.iter().zip(x) {
        acc = q4_k_apply(&q5_k_decode(b), xs.as_ptr(), acc);
    }
    hsum(acc)
}

/// [`dot_q5_k`] for every x of `xs`, bit for bit, each block decoded once per [`MANY`]
/// tokens.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_many_q5_k(blocks: &[BlockQ5K], xs: &[&[f32]], out: &mut [f32]) {
    for (xg, og) in xs.chunks(MANY).zip(out.chunks_mut(MANY)) {
        let mut acc = [_mm256_setzero_ps(); MANY];
        for (i, b) in blocks.iter().enumerate() {
            let q = q5_k_decode(b);
            for (a, x) in acc.iter_mut().zip(xg) {
                *a = q4_k_apply(&q, x.as_ptr().add(QK_K * i), *a);
            }
        }
        for (o, a) in og.iter_mut().zip(&acc) {
            *o = hsum(*a);
        }
    }
}

/// One Q6_K block's signed levels as f32 lanes, `q[n][hl][c][k]` = elements
/// `128n + 32k + 16hl + 8c..` (positions l of `ql[l]`, `ql[l+32]`, `qh[l]`), and `d·sc` per
/// 16 elements, `s[n][hl][k]`.
struct Q6kDecoded {
    q: [[[[__m256; 4]; 2]; 2]; 2],
    s: [[[f32; 4]; 2]; 2],
}

#[inline(always)]
unsafe fn q6_k_decode(b: &BlockQ6K) -> Q6kDecoded {
    let (m4, off) = (_mm256_set1_epi32(0x0f), _mm256_set1_epi32(32));
    let d = h16(b.d);
    let mut out = Q6kDecoded {
        q: [[[[_mm256_setzero_ps(); 4]; 2]; 2]; 2],
        s: [[[0.0; 4]; 2]; 2],
    };
    for n in 0..2 {
        let ql = b.ql.as_ptr().add(64 * n);
        let qh = b.qh.as_ptr().add(32 * n);
        for hl in 0..2 {
            for c in 0..2 {
                let l = 16 * hl + 8 * c;
                let (a, bb, hh) = (u8x8(ql.add(l)), u8x8(ql.add(l + 32)), u8x8(qh.add(l)));
                let q = [
                    _mm256_or_si256(_mm256_and_si256(a, m4), q6_high(hh, 0)),
                    _mm256_or_si256(_mm256_and_si256(bb, m4), q6_high(hh, 2)),
                    _mm256_or_si256(_mm256_srli_epi32(a, 4), q6_high(hh, 4)),
                    _mm256_or_si256(_mm256_srli_epi32(bb, 4), q6_high(hh, 6)),
                ];
                for k in 0..4 {
                    out.q[n][hl][c][k] = _mm256_cvtepi32_ps(_mm256_sub_epi32(q[k], off));
                }
            }
            for k in 0..4 {
                out.s[n][hl][k] = d * (b.scales[8 * n + hl + 2 * k] as i8) as f32;
            }
        }
    }
    out
}

/// `acc += ` one decoded Q6_K block against 256 activations at `xp` (the one order of
/// operations of `dot_q6_k` and `dot_many_q6_k`).
#[inline(always)]
unsafe fn q6_k_apply(q: &Q6kDecoded, xp: *const f32, mut acc: __m256) -> __m256 {
    for n in 0..2 {
        for hl in 0..2 {
            let mut s = [_mm256_setzero_ps(); 4];
            for c in 0..2 {
                let l = 16 * hl + 8 * c;
                for k in 0..4 {
                    let xv = _mm256_loadu_ps(xp.add(128 * n + 32 * k + l));
                    s[k] = _mm256_fmadd_ps(q.q[n][hl][c][k], xv, s[k]);
                }
            }
            for k in 0..4 {
                acc = _mm256_fmadd_ps(_mm256_set1_ps(q.s[n][hl][k]), s[k], acc);
            }
        }
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q6_k(blocks: &[BlockQ6K], x: &[[f32; QK_K]]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, xs) in blocks.iter().zip(x) {
        acc = q6_k_apply(&q6_k_decode(b), xs.as_ptr(), acc);
    }
    hsum(acc)
}

/// [`dot_q6_k`] for every x of `xs`, bit for bit, each block decoded once per [`MANY`]
/// tokens.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_many_q6_k(blocks: &[BlockQ6K], xs: &[&[f32]], out: &mut [f32]) {
    for (xg, og) in xs.chunks(MANY).zip(out.chunks_mut(MANY)) {
        let mut acc = [_mm256_setzero_ps(); MANY];
        for (i, b) in blocks.iter().enumerate() {
            let q = q6_k_decode(b);
            for (a, x) in acc.iter_mut().zip(xg) {
                *a = q6_k_apply(&q, x.as_ptr().add(QK_K * i), *a);
            }
        }
        for (o, a) in og.iter_mut().zip(&acc) {
            *o = hsum(*a);
        }
    }
}

/// A 32-element block's levels as f32 lanes and its scale.
struct Dec32 {
    q: [__m256; 4],
    d: f32,
}

#[inline(always)]
unsafe fn q8_0_decode(b: &BlockQ8_0) -> Dec32 {
    let p = b.qs.as_ptr();
    Dec32 {
        q: [
            i8x8_ps(_mm_loadl_epi64(p.cast())),
            i8x8_ps(_mm_loadl_epi64(p.add(8).cast())),
            i8x8_ps(_mm_loadl_epi64(p.add(16).cast())),
            i8x8_ps(_mm_loadl_epi64(p.add(24).cast())),
        ],
        d: h16(b.d),
    }
}

/// 32 nibble levels through a 16-entry i8 table (`pshufb`): element j is
/// `table[qs[j] & 15]`, j + 16 `table[qs[j] >> 4]`.
#[inline(always)]
unsafe fn lut_decode(table: __m128i, qs: &[u8; 16], d: f32) -> Dec32 {
    let m = _mm_set1_epi8(0x0f);
    let q = _mm_loadu_si128(qs.as_ptr().cast());
    let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, m));
    let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), m));
    Dec32 {
        q: [
            i8x8_ps(lo),
            i8x8_ps(_mm_srli_si128(lo, 8)),
            i8x8_ps(hi),
            i8x8_ps(_mm_srli_si128(hi, 8)),
        ],
        d,
    }
}

/// `acc += d · Σ q·x` over one decoded 32-element block (the one order of operations of the
/// single- and multi-token kernels).
#[inline(always)]
unsafe fn apply32(q: &Dec32, xp: *const f32, acc: __m256) -> __m256 {
    let mut s = _mm256_mul_ps(q.q[0], _mm256_loadu_ps(xp));
    s = _mm256_fmadd_ps(q.q[1], _mm256_loadu_ps(xp.add(8)), s);
    s = _mm256_fmadd_ps(q.q[2], _mm256_loadu_ps(xp.add(16)), s);
    s = _mm256_fmadd_ps(q.q[3], _mm256_loadu_ps(xp.add(24)), s);
    _mm256_fmadd_ps(_mm256_set1_ps(q.d), s, acc)
}

/// The single-token dot and the bit-identical multi-token dot (each block decoded once per
/// [`MANY`] tokens) of a 32-element block type, from its decoder.
macro_rules! dot32_kernels {
    ($dot:ident, $many:ident, $block:ty, |$t:ident| $setup:expr, |$b:ident| $decode:expr) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn $dot(blocks: &[$block], x: &[[f32; 32]]) -> f32 {
            let $t = $setup;
            let mut acc = _mm256_setzero_ps();
            for ($b, xs) in blocks.iter().zip(x) {
                acc = apply32(&$decode, xs.as_ptr(), acc);
            }
            hsum(acc)
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn $many(blocks: &[$block], xs: &[&[f32]], out: &mut [f32]) {
            let $t = $setup;
            for (xg, og) in xs.chunks(MANY).zip(out.chunks_mut(MANY)) {
                let mut acc = [_mm256_setzero_ps(); MANY];
                for (i, $b) in blocks.iter().enumerate() {
                    let q = $decode;
                    for (a, x) in acc.iter_mut().zip(xg) {
                        *a = apply32(&q, x.as_ptr().add(32 * i), *a);
                    }
                }
                for (o, a) in og.iter_mut().zip(&acc) {
                    *o = hsum(*a);
                }
            }
        }
    };
}

dot32_kernels!(
    dot_q8_0,
    dot_many_q8_0,
    BlockQ8_0,
    |_t| (),
    |b| q8_0_decode(b)
);
dot32_kernels!(
    dot_iq4_nl,
    dot_many_iq4_nl,
    BlockIq4Nl,
    |t| _mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast()),
    |b| lut_decode(t, &b.qs, h16(b.d))
);
dot32_kernels!(
    dot_mxfp4,
    dot_many_mxfp4,
    BlockMxfp4,
    |t| _mm_loadu_si128(KVALUES_MXFP4.as_ptr().cast()),
    |b| lut_decode(t, &b.qs, e8m0_to_f32_half(b.e))
);

/// Q4_0: levels `(q & 15) − 8` (elements j) and `(q >> 4) − 8` (j + 16).
#[inline(always)]
unsafe fn q4_0_decode(b: &BlockQ4_0) -> Dec32 {
    let (m4, eight) = (_mm256_set1_epi32(0x0f), _mm256_set1_epi32(8));
    let (q0, q1) = (u8x8(b.qs.as_ptr()), u8x8(b.qs.as_ptr().add(8)));
    let (lo0, lo1) = (_mm256_and_si256(q0, m4), _mm256_and_si256(q1, m4));
    let (hi0, hi1) = (_mm256_srli_epi32(q0, 4), _mm256_srli_epi32(q1, 4));
    Dec32 {
        q: [
            _mm256_cvtepi32_ps(_mm256_sub_epi32(lo0, eight)),
            _mm256_cvtepi32_ps(_mm256_sub_epi32(lo1, eight)),
            _mm256_cvtepi32_ps(_mm256_sub_epi32(hi0, eight)),
            _mm256_cvtepi32_ps(_mm256_sub_epi32(hi1, eight)),
        ],
        d: h16(b.d),
    }
}

dot32_kernels!(
    dot_q4_0,
    dot_many_q4_0,
    BlockQ4_0,
    |_t| (),
    |b| q4_0_decode(b)
);

/// One F8_E4M3_B128 block's 128 values as f32 lanes, decoded as `fp8::e4m3_lane` does
/// (normals by moving the bits into f32's exponent/mantissa and rebiasing by 120,
/// subnormals `m·2^-9`), and its scale.
struct F8Decoded {
    q: [__m256; QK_F8 / 8],
    d: f32,
}

#[inline(always)]
unsafe fn f8_decode(b: &BlockF8B128) -> F8Decoded {
    let (m7f, m80, bias) = (
        _mm256_set1_epi32(0x7f),
        _mm256_set1_epi32(0x80),
        _mm256_set1_epi32(120 << 23),
    );
    let (eight, sub_step) = (_mm256_set1_epi32(8), _mm256_set1_ps(1.0 / 512.0));
    let mut out = F8Decoded {
        q: [_mm256_setzero_ps(); QK_F8 / 8],
        d: b.scale(),
    };
    for k in 0..QK_F8 / 8 {
        let q = u8x8(b.qs.as_ptr().add(8 * k));
        let mag = _mm256_and_si256(q, m7f);
        let normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), bias));
        let sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), sub_step);
        let is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(eight, mag));
        let v = _mm256_blendv_ps(normal, sub, is_sub);
        let sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(q, m80), 24));
        out.q[k] = _mm256_or_ps(v, sign);
    }
    out
}

#[inline(always)]
unsafe fn f8_apply(q: &F8Decoded, xp: *const f32, acc: __m256) -> __m256 {
    let mut s = _mm256_mul_ps(q.q[0], _mm256_loadu_ps(xp));
    for k in 1..QK_F8 / 8 {
        s = _mm256_fmadd_ps(q.q[k], _mm256_loadu_ps(xp.add(8 * k)), s);
    }
    _mm256_fmadd_ps(_mm256_set1_ps(q.d), s, acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_f8_b128(blocks: &[BlockF8B128], x: &[[f32; QK_F8]]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, xs) in blocks.iter().zip(x) {
        acc = f8_apply(&f8_decode(b), xs.as_ptr(), acc);
    }
    hsum(acc)
}

/// [`dot_f8_b128`] for every x of `xs`, bit for bit, each block decoded once per [`MANY`]
/// tokens.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_many_f8_b128(blocks: &[BlockF8B128], xs: &[&[f32]], out: &mut [f32]) {
    for (xg, og) in xs.chunks(MANY).zip(out.chunks_mut(MANY)) {
        let mut acc = [_mm256_setzero_ps(); MANY];
        for (i, b) in blocks.iter().enumerate() {
            let q = f8_decode(b);
            for (a, x) in acc.iter_mut().zip(xg) {
                *a = f8_apply(&q, x.as_ptr().add(QK_F8 * i), *a);
            }
        }
        for (o, a) in og.iter_mut().zip(&acc) {
            *o = hsum(*a);
        }
    }
}
