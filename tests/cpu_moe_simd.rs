//! The cold-expert path (`cpu::moe::expert_rows_with`) at every SIMD level this machine has,
//! forced, for each weight type the cold path reads, with f32 and int8 activations:
//! - int8 activations: every level gives the scalar level's bits, for every type (the int8
//!   types through `cpu::q8dot`, whose f32 steps are fixed; the others through the f32 dots,
//!   whose AVX2 form every x86 level shares, compared among those levels);
//! - f32 activations: the vector levels agree bit for bit; scalar within f32 rounding;
//! - both against an f64 reference FFN (int8: with x and the SwiGLU output quantized in two
//!   levels as the GPU's `quantize_x2` does, relative RMS ≤ 1e-3).
//!
//! Shapes have row counts that are not multiples of the task or vector sizes, and several
//! tokens per expert (a prefill group) beside a lone token.

use lathe::cpu::moe::{expert_rows_with, Activations, ColdOptions, ColdPair};
use lathe::cpu::q8x;
use lathe::cpu::simd::SimdLevel;
use lathe::moe::{ExpertMats, ExpertWeights, MatShape};
use lathe::{quant, DType};

/// splitmix64 → uniform in [-1, 1).
struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

const N_EXPERT: usize = 3;

/// (n_embd, n_ff) fitting `dtype`'s block: 288 × 96 rows for 32-value blocks (9 and 3
/// blocks), 768 × 256 for 256-value ones, 256 × 128 for 128-value ones.
fn dims(dtype: DType) -> (u64, u64) {
    match dtype.block_size() {
        1 => (72, 40),
        32 => (288, 96),
        128 => (256, 128),
        _ => (768, 256),
    }
}

/// Three experts' gate, up and down in `dtype`, from random weights.
fn experts(dtype: DType, rng: &mut Rng) -> (Vec<Vec<u8>>, [MatShape; 3]) {
    let (ne, ff) = dims(dtype);
    let gu = MatShape {
        dtype,
        rows: ff,
        cols: ne,
    };
    let dn = MatShape {
        dtype,
        rows: ne,
        cols: ff,
    };
    let shapes = [gu, gu, dn];
    let bytes = shapes
        .iter()
        .map(|s| {
            let n = (s.rows * s.cols) as usize * N_EXPERT;
            let w: Vec<f32> = (0..n).map(|_| rng.f() * 0.2).collect();
            quant::quantize(dtype, &w).unwrap()
        })
        .collect();
    (bytes, shapes)
}

fn weights<'a>(bytes: &'a [Vec<u8>], shapes: &[MatShape; 3]) -> ExpertWeights<'a> {
    let m = |i: usize| {
        let s = shapes[i];
        ExpertMats::from_parts(s, "test", bytes[i].chunks(s.bytes() as usize).collect()).unwrap()
    };
    ExpertWeights::new(0, m(0), m(1), m(2)).unwrap()
}

/// The f64 FFN of expert `e` on `x`, from the dequantized matrices; `int8`: x and the SwiGLU
/// output go through `q8x::quantize_x2` first (the latter rounded to f32, as the kernels
/// hold it).
fn reference(w: &ExpertWeights<'_>, e: usize, x: &[f32], int8: bool) -> Vec<f64> {
    let deq = |m: &ExpertMats<'_>| {
        let n = (m.shape.rows * m.shape.cols) as usize;
        quant::dequantize_to_vec(m.shape.dtype, &m.expert(e).unwrap(), n).unwrap()
    };
    let (g, u, d) = (deq(&w.gate), deq(&w.up), deq(&w.down));
    let (ne, ff) = (w.n_embd(), w.n_ff());
    let q = |v: &[f32]| {
        if int8 {
            let (a, b) = q8x::quantize_x2(v, v.len());
            q8x::dequantize2(&a, &b)
        } else {
            v.to_vec()
        }
    };
    let x = q(x);
    let h: Vec<f32> = (0..ff)
        .map(|r| {
            let dot = |m: &[f32]| {
                (0..ne)
                    .map(|c| m[r * ne + c] as f64 * x[c] as f64)
                    .sum::<f64>()
            };
            let (gv, uv) = (dot(&g), dot(&u));
            (gv / (1.0 + (-gv).exp()) * uv) as f32
        })
        .collect();
    let h = q(&h);
    (0..ne)
        .map(|r| (0..ff).map(|c| d[r * ff + c] as f64 * h[c] as f64).sum())
        .collect()
}

/// Pairs: token 0 alone on expert 2; tokens 1..4 all on expert 0 (a prefill group) and
/// on expert 1 in turn.
fn pairs() -> Vec<ColdPair> {
    let mut p = vec![ColdPair {
        token: 0,
        slot: 0,
        expert: 2,
        weight: 1.0,
    }];
    for t in 1..5 {
        for (s, e) in [(0, 0), (1, t % 2)] {
            p.push(ColdPair {
                token: t,
                slot: s,
                expert: e,
                weight: 0.5 + 0.1 * t as f32,
            });
        }
    }
    p
}

#[test]
fn every_level_every_type() {
    let levels = SimdLevel::all_supported();
    eprintln!(
        "levels tested: {levels:?} (detected {})",
        SimdLevel::detect()
    );
    let mut rng = Rng(5);
    for dtype in [
        DType::Q4_0,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::MXFP4,
        DType::IQ4_NL,
        DType::F8_E4M3_B128,
        DType::BF16,
        DType::F16,
        DType::F32,
    ] {
        let (bytes, shapes) = experts(dtype, &mut rng);
        let w = weights(&bytes, &shapes);
        let ne = w.n_embd();
        let x: Vec<f32> = (0..5 * ne).map(|_| rng.f() * 2.0).collect();
        let pairs = pairs();
        for act in [Activations::F32, Activations::Int8] {
            let run = |simd| {
                let mut out = vec![0f32; pairs.len() * ne];
                let opts = ColdOptions {
                    activations: act,
                    simd,
                };
                expert_rows_with(&w, &x, &pairs, None, &opts, &mut out).unwrap();
                out
            };
            let scalar = run(SimdLevel::Scalar);
            let int8_type = lathe::cpu::q8dot::supported(dtype);
            let vector: Vec<_> = levels.iter().filter(|l| **l != SimdLevel::Scalar).collect();
            for &l in &vector {
                let got = run(*l);
                if act == Activations::Int8 && int8_type {
                    assert!(
                        got.iter()
                            .zip(&scalar)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{dtype} int8 at {l}: not the scalar bits"
                    );
                }
                // the vector levels share their f32 dots
                assert_eq!(got, run(*vector[0]), "{dtype} {act:?} at {l}");
            }
            // against the f64 reference
            let int8 = act == Activations::Int8 && int8_type;
            let (mut err2, mut ref2) = (0f64, 0f64);
            for (c, p) in pairs.iter().enumerate() {
                let t = p.token as usize;
                let r = reference(&w, p.expert as usize, &x[t * ne..(t + 1) * ne], int8);
                for l in std::iter::once(SimdLevel::Scalar).chain(vector.iter().map(|l| **l)) {
                    let out = if l == SimdLevel::Scalar {
                        scalar.clone()
                    } else {
                        run(l)
                    };
                    for (i, &rv) in r.iter().enumerate() {
                        let want = rv * p.weight as f64;
                        err2 += (out[c * ne + i] as f64 - want).powi(2);
                        ref2 += want * want;
                    }
                }
            }
            // f32: rounding only; int8: the reference quantizes as the kernels do, so only
            // a rare code that rounds the other way (the SwiGLU output differs by rounding
            // before it is quantized) separates them.
            let rel = (err2 / ref2).sqrt();
            let bar = if int8 { 1e-4 } else { 1e-5 };
            eprintln!(
                "{dtype} {act:?}: relative RMS {rel:.2e} against the reference (bar {bar:.0e})"
            );
            assert!(rel <= bar, "{dtype} {act:?}: relative RMS {rel:.2e}");
        }
    }
}

#[test]
fn a_level_the_cpu_lacks_is_an_error() {
    for l in SimdLevel::ALL {
        assert_eq!(l.check().is_ok(), l.supported(), "{l}");
        assert_eq!(l.name().parse::<SimdLevel>(), Ok(l));
    }
    assert!("sse9".parse::<SimdLevel>().is_err());
    assert!(SimdLevel::Scalar.supported());
    assert!(SimdLevel::detect().supported());
}

/// The CPU's int8 cold-expert kernels cover exactly the GPU's int8 matvec types, so a pair's
/// activations are int8 on both sides or f32 on both (placement never changes the sums).
#[test]
fn int8_types_match_the_gpu_set() {
    for dt in DType::ALL {
        assert_eq!(
            lathe::cpu::q8dot::supported(dt),
            lathe::gpu::matvec::int8_x_supported(dt),
            "{dt}"
        );
    }
}
