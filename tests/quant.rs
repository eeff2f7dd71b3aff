//! The CPU quant reference against independent implementations and its own invariants.
//!
//! Golden files (tests/fixtures/quant, made by make_quant.py):
//! - dequantization equals gguf-py's (ml_dtypes' for FP8 / E8M0) bit for bit: gguf-py
//!   computes the same f32 products in the same order as ggml, so no ulp slack is needed;
//!   NaNs must be NaN on both sides (payload compared for BF16, where gguf-py keeps it).
//! - quantization equals gguf-py's quantizers and the bytes llama-quantize wrote into the
//!   fixture models (Q4_0, Q8_0, Q5_0, Q4_K, Q6_K), byte for byte.
//!
//! A stale golden file: `pip install gguf numpy ml_dtypes`, then
//! `python3 tests/fixtures/quant/make_quant.py` (deterministic; the llama-quantize cases need
//! ../shared/fixtures, else the committed ones are kept).
//!
//! Properties: round trips stay within `max_abs_error_bound` per block; `dot` agrees with
//! `dot_ref` to 1e-5 of Σ|wᵢxᵢ|; bad lengths and inputs are errors, not panics.

use lathe::quant::{self, dot, dot_ref, max_abs_error_bound};
use lathe::{DType, Error};
use std::path::PathBuf;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant")
}

struct Case {
    name: String,
    kind: String,
    dtype: DType,
    n: usize,
    source: String,
    input: Vec<u8>,
    output: Vec<u8>,
}

fn cases(kind: &str) -> Vec<Case> {
    let dir = fixture_dir();
    let text = std::fs::read_to_string(dir.join("manifest.json")).expect("manifest.json");
    let list: Vec<serde_json::Value> = serde_json::from_str(&text).expect("manifest is JSON");
    list.into_iter()
        .map(|c| {
            let name = c["name"].as_str().expect("name").to_string();
            let read = |ext: &str| std::fs::read(dir.join(format!("{name}{ext}"))).expect(&name);
            Case {
                kind: c["kind"].as_str().expect("kind").to_string(),
                dtype: DType::from_name(c["dtype"].as_str().expect("dtype")).expect("known dtype"),
                n: c["n"].as_u64().expect("n") as usize,
                source: c["source"].as_str().expect("source").to_string(),
                input: read(".in"),
                output: read(".out"),
                name,
            }
        })
        .filter(|c| c.kind == kind)
        .collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// splitmix64 + Box–Muller: deterministic test data without a rand dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

const QUANTIZABLE: [DType; 17] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::IQ4_NL,
    DType::IQ4_XS,
    DType::MXFP4,
    DType::F8_E4M3_B128,
];

#[test]
fn dequantize_equals_gguf_py_bitwise() {
    let cs = cases("dequantize");
    assert!(
        cs.len() >= 17,
        "expected a dequantize case per type, got {}",
        cs.len()
    );
    for c in cs {
        // One byte of offset: block structs must not assume any alignment.
        let mut shifted = vec![0u8; c.input.len() + 1];
        shifted[1..].copy_from_slice(&c.input);
        let got = quant::dequantize_to_vec(c.dtype, &shifted[1..], c.n).expect(&c.name);
        let want = f32s(&c.output);
        assert_eq!(got.len(), want.len(), "{}", c.name);
        let mut bad = 0;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let same = if w.is_nan() {
                g.is_nan() && (c.dtype != DType::BF16 || g.to_bits() == w.to_bits())
            } else {
                g.to_bits() == w.to_bits()
            };
            if !same {
                if bad < 5 {
                    eprintln!("{}: element {i}: lathe {g:e}, {} {w:e}", c.name, c.source);
                }
                bad += 1;
            }
        }
        assert_eq!(bad, 0, "{}: {bad} of {} elements differ", c.name, c.n);
        // The slice API agrees with the vector API.
        let mut out = vec![f32::NAN; c.n];
        quant::dequantize(c.dtype, &c.input, &mut out).expect(&c.name);
        assert!(out
            .iter()
            .zip(&got)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

fn assert_quantize_equals(c: &Case) {
    let x = f32s(&c.input);
    assert_eq!(x.len(), c.n, "{}", c.name);
    let got = quant::quantize(c.dtype, &x).expect(&c.name);
    assert_eq!(got.len(), c.output.len(), "{}", c.name);
    let bb = c.dtype.block_bytes();
    let bad: Vec<usize> = (0..got.len() / bb)
        .filter(|&b| got[b * bb..(b + 1) * bb] != c.output[b * bb..(b + 1) * bb])
        .collect();
    if let Some(&b) = bad.first() {
        panic!(
            "{}: {} of {} blocks differ from {}; block {b}:\n lathe {:?}\n want  {:?}",
            c.name,
            bad.len(),
            got.len() / bb,
            c.source,
            &got[b * bb..(b + 1) * bb],
            &c.output[b * bb..(b + 1) * bb]
        );
    }
}

#[test]
fn quantize_equals_gguf_py() {
    let cs: Vec<Case> = cases("quantize")
        .into_iter()
        .filter(|c| c.name.starts_with("qpy_"))
        .collect();
    assert_eq!(
        cs.len(),
        8,
        "F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4"
    );
    for c in &cs {
        assert_quantize_equals(c);
    }
}

#[test]
fn quantize_equals_llama_quantize() {
    let cs: Vec<Case> = cases("quantize")
        .into_iter()
        .filter(|c| c.name.starts_with("qll_"))
        .collect();
    assert_eq!(
        cs.len(),
        5,
        "Q4_0, Q8_0, Q4_K, Q6_K, Q5_0 from the fixture models"
    );
    for c in &cs {
        assert_quantize_equals(c);
    }
}

/// Test data: normal, uniform in [−1, 1] and heavy-tailed (normal³), each block scaled by a
/// random power of ten, with one all-zero and one constant block.
fn test_data(rng: &mut Rng, n: usize, block: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(n);
    for b in 0..n.div_ceil(block) {
        let scale = 10f32.powf(rng.uniform() * 4.0 - 3.0);
        for _ in 0..block.min(n - b * block) {
            let v = match b % 5 {
                0 | 3 => rng.normal(),
                1 => 2.0 * rng.uniform() - 1.0,
                2 => rng.normal().powi(3),
                _ => rng.normal() + 0.5,
            };
            x.push(v * scale);
        }
    }
    if n >= 3 * block {
        x[block..2 * block].fill(0.0);
        x[2 * block..3 * block].fill(-0.3);
    }
    x
}

/// Relative RMS error limits for [`round_trip_within_bounds`]: about 1.3× what these
/// quantizers reach on its data (a third of the blocks heavy-tailed).
fn rms_limit(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 0.0,
        DType::F16 => 1e-3,
        DType::BF16 => 4e-3,
        DType::Q8_0 => 0.01,
        DType::Q6_K => 0.035,
        DType::Q5_0 | DType::Q5_1 | DType::Q5_K => 0.07,
        DType::Q4_K => 0.09,
        DType::Q4_1 => 0.12,
        DType::Q4_0 | DType::IQ4_NL | DType::IQ4_XS => 0.15,
        DType::MXFP4 | DType::Q3_K => 0.18,
        DType::Q2_K => 0.4,
        DType::F8_E4M3_B128 => 0.035,
        _ => unreachable!("{dtype} is not quantizable"),
    }
}

/// Every element within `max_abs_error_bound` of its block, and the whole tensor within
/// `rms_limit`. Set QUANT_STATS=1 to print the worst error/bound ratio and the RMS error.
#[test]
fn round_trip_within_bounds() {
    let mut rng = Rng(7);
    for dtype in QUANTIZABLE {
        let bs = dtype.block_size().max(32);
        for nblocks in [3usize, 7, 13] {
            let n = if dtype.block_size() >= 128 {
                dtype.block_size() * nblocks
            } else {
                32 * nblocks * 3
            };
            let x = test_data(&mut rng, n, bs);
            let q = quant::quantize(dtype, &x).expect("quantize");
            assert_eq!(q.len() as u64, dtype.bytes_for(n as u64).unwrap());
            let y = quant::dequantize_to_vec(dtype, &q, n).expect("dequantize");
            assert!(
                y.iter().all(|v| v.is_finite()),
                "{dtype}: non-finite output"
            );
            let (mut se, mut sx, mut worst) = (0f64, 0f64, 0f32);
            let mut first_bad = None;
            for (b, (xb, yb)) in x.chunks(bs).zip(y.chunks(bs)).enumerate() {
                let bound = max_abs_error_bound(dtype, xb);
                for (i, (a, r)) in xb.iter().zip(yb).enumerate() {
                    let e = (a - r).abs();
                    if e > bound && first_bad.is_none() {
                        first_bad = Some(format!(
                            "block {b} elem {i}: |{a} − {r}| = {e:e} > {bound:e}"
                        ));
                    }
                    worst = worst.max(e / bound.max(f32::MIN_POSITIVE));
                    se += (e as f64).powi(2);
                    sx += (*a as f64).powi(2);
                }
            }
            let rel = (se / sx).sqrt();
            if std::env::var("QUANT_STATS").is_ok() {
                eprintln!("{dtype} n={n}: relative RMS {rel:.4}, worst error/bound {worst:.3}");
            }
            if let Some(msg) = first_bad {
                panic!("{dtype} n={n}: {msg}");
            }
            let limit = rms_limit(dtype);
            assert!(
                rel <= limit,
                "{dtype} n={n}: relative RMS error {rel:.4} > {limit}"
            );
        }
    }
}

/// A row of `n` elements of `dtype`: quantized test data where lathe can quantize, otherwise
/// random bytes (finite values only).
fn random_row(rng: &mut Rng, dtype: DType, n: usize) -> Vec<u8> {
    if quant::can_quantize(dtype) {
        return quant::quantize(dtype, &test_data(rng, n, dtype.block_size().max(32))).unwrap();
    }
    if dtype == DType::F64 {
        return (0..n)
            .flat_map(|_| (rng.normal() as f64).to_le_bytes())
            .collect();
    }
    let mut b = rng.bytes(dtype.bytes_for(n as u64).unwrap() as usize);
    if matches!(dtype, DType::F8_E4M3 | DType::F8_E8M0) {
        for v in b.iter_mut() {
            if *v & 0x7f == 0x7f {
                *v &= 0xf0;
            }
        }
        if dtype == DType::F8_E8M0 {
            // Keep 2^(b−127) within a sane range.
            b.iter_mut().for_each(|v| *v = 100 + *v % 50);
        }
    }
    b
}

#[test]
fn dot_agrees_with_dot_ref() {
    let mut rng = Rng(11);
    for dtype in DType::ALL {
        let bs = dtype.block_size();
        let lengths: Vec<usize> = if bs == 1 {
            vec![1, 7, 65, 300, 1031]
        } else {
            vec![bs, 3 * bs, 7 * bs, 13 * bs]
        };
        for n in lengths {
            let row = random_row(&mut rng, dtype, n);
            let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
            let got = dot(dtype, &row, &x);
            let want = dot_ref(dtype, &row, &x);
            let w = quant::dequantize_to_vec(dtype, &row, n).unwrap();
            let scale: f64 = w.iter().zip(&x).map(|(a, b)| (a * b).abs() as f64).sum();
            let err = (got as f64 - want as f64).abs();
            assert!(
                err <= 1e-5 * scale + 1e-30,
                "{dtype} n={n}: dot {got} vs dot_ref {want} (|err| {err:e}, Σ|wx| {scale:e})"
            );
        }
    }
}

/// The types with fused dot loops (the ones MoE experts ship in).
const FUSED: [DType; 8] = [
    DType::Q4_0,
    DType::Q8_0,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::IQ4_NL,
    DType::MXFP4,
    DType::F8_E4M3_B128,
];

/// A row of random bytes in `dtype`'s block layout (every level, scale and high-bit pattern,
/// not only what the quantizers write), with the block scales set to finite values of ±2^±8
/// and no FP8 NaN codes.
fn random_bytes_row(rng: &mut Rng, dtype: DType, n: usize) -> Vec<u8> {
    let mut b = rng.bytes(dtype.bytes_for(n as u64).unwrap() as usize);
    let f16 = |rng: &mut Rng| {
        let v = rng.normal() * 2f32.powi((rng.next_u64() % 17) as i32 - 8);
        half::f16::from_f32(v).to_le_bytes()
    };
    let bb = dtype.block_bytes();
    for blk in b.chunks_mut(bb) {
        match dtype {
            DType::Q4_0 | DType::Q8_0 | DType::IQ4_NL => blk[..2].copy_from_slice(&f16(rng)),
            DType::Q4_K | DType::Q5_K => {
                blk[..2].copy_from_slice(&f16(rng));
                blk[2..4].copy_from_slice(&f16(rng));
            }
            DType::Q6_K => blk[bb - 2..].copy_from_slice(&f16(rng)),
            DType::MXFP4 => blk[0] = 110 + blk[0] % 30,
            DType::F8_E4M3_B128 => {
                blk[..4].copy_from_slice(&(rng.normal() * 1e-2).to_le_bytes());
                for v in &mut blk[4..] {
                    if *v & 0x7f == 0x7f {
                        *v &= 0xf0;
                    }
                }
            }
            _ => unreachable!(),
        }
    }
    b
}

/// `|got − dot_ref| ≤ 1e-5 · Σ|wᵢxᵢ|` (f32 rounding of sums of up to 8192 terms in 8 lanes,
/// with K-quant mins factored out as `d·Σq·x − m·Σx`).
#[track_caller]
fn assert_dot_close(what: &str, dtype: DType, row: &[u8], x: &[f32], got: f32) {
    let want = dot_ref(dtype, row, x);
    let w = quant::dequantize_to_vec(dtype, row, x.len()).unwrap();
    let scale: f64 = w.iter().zip(x).map(|(a, b)| (a * b).abs() as f64).sum();
    let err = (got as f64 - want as f64).abs();
    assert!(
        err <= 1e-5 * scale + 1e-30,
        "{what} {dtype} n={}: {got} vs dot_ref {want} (|err| {err:e}, Σ|wx| {scale:e})",
        x.len()
    );
}

#[test]
fn fused_dots_agree_with_dot_ref_on_both_paths() {
    let mut rng = Rng(23);
    for dtype in FUSED {
        for n in [256, 512, 1280, 2048, 4096, 8192] {
            for random_bytes in [false, true] {
                let row = if random_bytes {
                    random_bytes_row(&mut rng, dtype, n)
                } else {
                    random_row(&mut rng, dtype, n)
                };
                let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
                assert_dot_close("dot", dtype, &row, &x, dot(dtype, &row, &x));
                assert_dot_close(
                    "dot_portable",
                    dtype,
                    &row,
                    &x,
                    quant::dot_portable(dtype, &row, &x),
                );
            }
        }
    }
}

/// `dot_many` equals `dot` per token bit for bit (so grouping pairs by expert never shows),
/// over token counts around its 16-token passes and every fused type.
#[test]
fn dot_many_equals_dot_per_token_bitwise() {
    let mut rng = Rng(29);
    for dtype in FUSED.into_iter().chain([DType::F16, DType::Q2_K]) {
        let n = if dtype.block_size() == 32 { 96 } else { 768 };
        let row = random_bytes_or_quantized(&mut rng, dtype, n);
        for n_tok in [0, 1, 2, 3, 15, 16, 17, 37] {
            let xs: Vec<Vec<f32>> = (0..n_tok)
                .map(|_| (0..n).map(|_| rng.normal()).collect())
                .collect();
            let xr: Vec<&[f32]> = xs.iter().map(|x| x.as_slice()).collect();
            let mut out = vec![f32::NAN; n_tok];
            let mut outp = vec![f32::NAN; n_tok];
            quant::dot_many(dtype, &row, &xr, &mut out);
            quant::dot_many_portable(dtype, &row, &xr, &mut outp);
            for (t, x) in xs.iter().enumerate() {
                let (one, onep) = (dot(dtype, &row, x), quant::dot_portable(dtype, &row, x));
                assert_eq!(
                    out[t].to_bits(),
                    one.to_bits(),
                    "{dtype} {n_tok} tokens, t {t}"
                );
                assert_eq!(outp[t].to_bits(), onep.to_bits(), "{dtype} portable, t {t}");
                assert_dot_close("dot_many", dtype, &row, x, out[t]);
            }
        }
    }
}

/// Random block bytes for the fused types, quantized test data for the others.
fn random_bytes_or_quantized(rng: &mut Rng, dtype: DType, n: usize) -> Vec<u8> {
    if FUSED.contains(&dtype) {
        random_bytes_row(rng, dtype, n)
    } else {
        random_row(rng, dtype, n)
    }
}

#[test]
#[should_panic(expected = "quant::dot_many")]
fn dot_many_panics_on_ragged_activations() {
    let (a, b) = (vec![0f32; 32], vec![0f32; 64]);
    quant::dot_many(DType::Q8_0, &[0u8; 34], &[&a, &b], &mut [0.0; 2]);
}

#[test]
fn bad_lengths_and_inputs_are_errors() {
    let invalid = |r: lathe::Result<Vec<f32>>| matches!(r, Err(Error::Invalid(_)));
    assert!(invalid(quant::dequantize_to_vec(DType::Q4_0, &[0; 18], 64)));
    assert!(invalid(quant::dequantize_to_vec(DType::Q4_0, &[0; 18], 33)));
    assert!(invalid(quant::dequantize_to_vec(
        DType::Q4_K,
        &[0; 143],
        256
    )));
    assert!(invalid(quant::dequantize_to_vec(DType::F32, &[0; 7], 2)));
    let mut out = [0f32; 32];
    assert!(quant::dequantize(DType::Q8_0, &[0; 33], &mut out).is_err());
    assert!(matches!(
        quant::quantize(DType::Q4_K, &[0.0; 255]),
        Err(Error::Invalid(_))
    ));
    assert!(matches!(
        quant::quantize(DType::I8, &[0.0; 4]),
        Err(Error::Unsupported(_))
    ));
    let mut x = vec![1.0f32; 32];
    x[5] = f32::NAN;
    assert!(matches!(
        quant::quantize(DType::Q8_0, &x),
        Err(Error::Invalid(_))
    ));
    x[5] = f32::INFINITY;
    assert!(matches!(
        quant::quantize(DType::MXFP4, &x),
        Err(Error::Invalid(_))
    ));
    // Plain floats carry non-finite values as they are.
    assert!(quant::quantize(DType::F16, &x).is_ok());
    let mut buf = vec![0u8; 17];
    assert!(quant::quantize_into(DType::MXFP4, &[0.0; 32], &mut buf[..16]).is_err());
    assert!(quant::quantize_into(DType::MXFP4, &[0.0; 32], &mut buf).is_ok());
}

#[test]
#[should_panic(expected = "quant::dot")]
fn dot_panics_on_length_mismatch() {
    dot(DType::Q4_0, &[0u8; 18], &[0f32; 64]);
}

#[test]
fn zero_and_constant_blocks_round_trip_exactly_where_representable() {
    for dtype in QUANTIZABLE {
        let n = dtype.block_size().max(32) * 2;
        let x = vec![0f32; n];
        let y = quant::dequantize_to_vec(dtype, &quant::quantize(dtype, &x).unwrap(), n).unwrap();
        assert!(
            y.iter().all(|&v| v == 0.0),
            "{dtype}: zeros do not stay zero"
        );
    }
}

/// Quantize throughput per type (f32 input MB/s, one thread and all threads over 4096-element
/// rows with rayon), dequantize and dot throughput on one thread. Run with
/// `cargo test --release --test quant -- --ignored --nocapture quantize_throughput`.
#[test]
#[ignore]
fn quantize_throughput() {
    use rayon::prelude::*;
    let mut rng = Rng(3);
    let n = 1 << 22;
    let row = 4096;
    let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
    let best_of = |reps: usize, f: &mut dyn FnMut()| {
        (0..reps)
            .map(|_| {
                let t = std::time::Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min)
    };
    println!("{} threads", rayon::current_num_threads());
    for dtype in QUANTIZABLE {
        let bytes = dtype.bytes_for(n as u64).unwrap() as usize;
        let rb = bytes / (n / row);
        let mut out = vec![0u8; bytes];
        let s1 = best_of(2, &mut || {
            quant::quantize_into(dtype, &x, &mut out).unwrap()
        });
        let sp = best_of(3, &mut || {
            out.par_chunks_mut(rb)
                .zip(x.par_chunks(row))
                .for_each(|(o, xs)| quant::quantize_into(dtype, xs, o).unwrap())
        });
        let mut y = vec![0f32; n];
        let sd = best_of(3, &mut || quant::dequantize(dtype, &out, &mut y).unwrap());
        let mut acc = 0f32;
        let sdot = best_of(3, &mut || {
            acc = out
                .chunks(rb)
                .zip(x.chunks(row))
                .map(|(r, xs)| dot(dtype, r, xs))
                .sum()
        });
        let mb = |b: usize, s: f64| b as f64 / s / 1e6;
        println!(
            "{:7} quantize {:7.1} MB/s in, {:8.1} MB/s in all threads ({:7.1} MB/s out)   \
             dequantize {:6.0} MB/s out   dot {:6.0} MB/s row, {:.2} ns/elem",
            dtype.name(),
            mb(4 * n, s1),
            mb(4 * n, sp),
            mb(bytes, sp),
            mb(4 * n, sd),
            mb(bytes, sdot),
            sdot * 1e9 / n as f64,
        );
        assert!(acc.is_finite());
    }
}
