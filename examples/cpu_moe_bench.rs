//! Micro-benchmark of the cold MoE path (`cpu::moe::expert_rows`) on a Qwen3.5-35B-A3B-shaped
//! expert layer: n_embd 2048, n_ff 512, 256 experts, Q4_K gate/up and Q6_K down (as
//! llama.cpp's Q4_K_M mixes them; `--down q4_k` for its Q4_K layers), random weights quantized
//! with `quant::quantize`. Times 1 token × 8 experts (decode) and 512 tokens × 8 (prefill) and
//! prints ms per call and the expert bytes read per second (each chosen expert counted once).
//!
//! `cargo run --release --example cpu_moe_bench -- [--threads N] [--down q6_k|q4_k]
//! [--iters N] [--tokens N] [--cpu-simd scalar|avx2|avx512vnni] [--activations f32|int8]
//! [--idle-us N [--warm]] [--decode-pairs N]`
//!
//! `--idle-us N` sleeps N µs before each decode call, as the host waits for the GPU's `pre`
//! between layers (the workers fall asleep); `--warm` keeps them spinning through it
//! (`cpu::moe::Warm`, as the offload does).
//!
//! The per-type table times one core's row dots at every SIMD level the CPU has, with f32
//! activations (`quant::dot`) and int8 ones (`cpu::q8dot`).
//!
//! Decode picks 8 experts not used in the previous 31 calls, so the weights come from memory
//! (the layer is ~500 MB, far beyond any cache), as they do in a real decode over 40 layers.

use lathe::cpu::moe::{expert_rows_with, Activations, ColdOptions, Warm};
use lathe::cpu::q8dot::{self, Q8Rows};
use lathe::cpu::simd::SimdLevel;
use lathe::moe::{ColdPair, ExpertMats, ExpertWeights, MatShape};
use lathe::{quant, DType};
use std::time::Instant;

const N_EMBD: u64 = 2048;
const N_FF: u64 = 512;
const N_EXPERT: usize = 256;
const N_USED: usize = 8;
/// Experts quantized from distinct random data; the others copy their bytes (quantizing all
/// 256 takes minutes, and copies are still distinct memory).
const N_DISTINCT: usize = 4;

/// splitmix64 + Box–Muller: deterministic data without a rand dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn normal(&mut self) -> f32 {
        let u = ((self.next_u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32;
        let v = ((self.next_u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32;
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
}

/// `N_EXPERT` experts of `shape`, as one leaked buffer.
fn stack(rng: &mut Rng, shape: MatShape) -> &'static [u8] {
    let eb = shape.bytes() as usize;
    let n = (shape.rows * shape.cols) as usize;
    let mut all = Vec::with_capacity(eb * N_EXPERT);
    let distinct: Vec<Vec<u8>> = (0..N_DISTINCT)
        .map(|_| {
            let x: Vec<f32> = (0..n).map(|_| rng.normal() * 0.02).collect();
            quant::quantize(shape.dtype, &x).expect("quantize")
        })
        .collect();
    for e in 0..N_EXPERT {
        all.extend_from_slice(&distinct[e % N_DISTINCT]);
    }
    all.leak()
}

/// One thread, rows in L2: the kernels' own speed per type (a 2048-wide row, 64 rows of
/// 2048 × 64 elements reused), for `quant::dot` and `quant::dot_many` over 16 tokens.
fn hot_dots(rng: &mut Rng) {
    let (n, rows, toks) = (2048usize, 64usize, 16usize);
    let xs: Vec<Vec<f32>> = (0..toks)
        .map(|_| (0..n).map(|_| rng.normal()).collect())
        .collect();
    let xr: Vec<&[f32]> = xs.iter().map(|x| x.as_slice()).collect();
    let mut out = vec![0f32; toks];
    let reps: usize = std::env::var("HOT_REPS").map_or(20, |v| v.parse().unwrap());
    for dtype in [
        DType::Q4_0,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_NL,
        DType::MXFP4,
        DType::F8_E4M3_B128,
    ] {
        let x: Vec<f32> = (0..n * rows).map(|_| rng.normal()).collect();
        let m = quant::quantize(dtype, &x).expect("quantize");
        let rb = m.len() / rows;
        let time = |f: &mut dyn FnMut()| {
            (0..reps)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::MAX, f64::min)
        };
        let mut acc = 0f32;
        let s1 = time(&mut || {
            for r in m.chunks(rb) {
                acc += quant::dot(dtype, r, &xs[0]);
            }
        });
        let sm = time(&mut || {
            for r in m.chunks(rb) {
                quant::dot_many(dtype, r, &xr, &mut out);
                acc += out[0];
            }
        });
        let ne = (n * rows) as f64;
        if q8dot::supported(dtype) {
            let q = Q8Rows::quantize(&xs[0], n);
            for level in SimdLevel::all_supported() {
                let s8 = time(&mut || {
                    for r in m.chunks(rb) {
                        acc += q8dot::dot(level, dtype, r, q.row(0));
                    }
                });
                println!(
                    "hot {:12} int8 {:10} {:6.2} GB/s {:5.3} ns/weight",
                    dtype.name(),
                    level.name(),
                    m.len() as f64 / s8 / 1e9,
                    s8 * 1e9 / ne
                );
            }
        }
        println!(
            "hot {:12} dot {:6.2} GB/s {:5.3} ns/weight   dot_many x{toks} {:5.3} ns/weight·token",
            dtype.name(),
            m.len() as f64 / s1 / 1e9,
            s1 * 1e9 / ne,
            sm * 1e9 / ne / toks as f64,
        );
        assert!(acc.is_finite());
    }
}

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().unwrap_or_else(|_| panic!("bad value for {name}")))
        .unwrap_or(default)
}

fn main() -> lathe::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = arg(&args, "--threads", 0);
    let iters: usize = arg(&args, "--iters", 64);
    let n_tok: usize = arg(&args, "--tokens", 512);
    let down: String = arg(&args, "--down", "q6_k".to_string());
    let simd: String = arg(&args, "--cpu-simd", SimdLevel::detect().name().to_string());
    let act: String = arg(&args, "--activations", "f32".to_string());
    let idle_us: u64 = arg(&args, "--idle-us", 0);
    let warm = args.iter().any(|a| a == "--warm");
    let dp: usize = arg(&args, "--decode-pairs", N_USED);
    let opts = ColdOptions {
        simd: simd.parse::<SimdLevel>().expect("--cpu-simd").check()?,
        activations: match act.as_str() {
            "f32" => Activations::F32,
            "int8" => Activations::Int8,
            _ => panic!("--activations f32|int8"),
        },
    };
    let dd = DType::from_name(&down.to_uppercase())
        .unwrap_or_else(|| panic!("--down {down}: not a type name"));
    if threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global()
            .expect("rayon pool");
    }
    let threads = rayon::current_num_threads();
    if args.iter().any(|a| a == "--hot-only") {
        hot_dots(&mut Rng(1));
        return Ok(());
    }

    let mut rng = Rng(7);
    hot_dots(&mut rng);
    let gu = MatShape {
        dtype: DType::Q4_K,
        rows: N_FF,
        cols: N_EMBD,
    };
    let ds = MatShape {
        dtype: dd,
        rows: N_EMBD,
        cols: N_FF,
    };
    let t = Instant::now();
    let mats = |b: &'static [u8], s: MatShape| {
        ExpertMats::from_parts(s, "bench", b.chunks(s.bytes() as usize).collect())
    };
    let w = ExpertWeights::new(
        0,
        mats(stack(&mut rng, gu), gu)?,
        mats(stack(&mut rng, gu), gu)?,
        mats(stack(&mut rng, ds), ds)?,
    )?;
    let expert_bytes = (2 * gu.bytes() + ds.bytes()) as f64;
    println!(
        "{threads} threads, {opts:?}; layer of {N_EXPERT} experts × {:.2} MB (Q4_K gate/up, {dd} down), \
         built in {:.1} s",
        expert_bytes / 1e6,
        t.elapsed().as_secs_f64()
    );

    let ne = N_EMBD as usize;
    let report = |name: &str, secs: &[f64], distinct: usize| {
        let mut s = secs.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        let med = s[s.len() / 2];
        let gbs = distinct as f64 * expert_bytes / med / 1e9;
        println!(
            "{name:28} median {:8.3} ms  min {:8.3} ms  {:6.2} GB/s  {:5.2} GB/s per thread",
            med * 1e3,
            s[0] * 1e3,
            gbs,
            gbs / threads as f64
        );
    };

    // Decode: one token, `dp` experts (8: all of them cold), a fresh set every call.
    let x: Vec<f32> = (0..ne).map(|_| rng.normal()).collect();
    let mut out = vec![0f32; dp * ne];
    let mut secs = Vec::new();
    for it in 0..iters + 4 {
        let pairs: Vec<ColdPair> = (0..dp)
            .map(|s| ColdPair {
                token: 0,
                slot: s as u32,
                expert: ((it * dp + s) % N_EXPERT) as u32,
                weight: 1.0,
            })
            .collect();
        if idle_us > 0 {
            let spin = warm.then(|| Warm::start(std::time::Duration::from_millis(2)));
            std::thread::sleep(std::time::Duration::from_micros(idle_us));
            drop(spin);
        }
        let t = Instant::now();
        expert_rows_with(&w, &x, &pairs, None, &opts, &mut out)?;
        if it >= 4 {
            secs.push(t.elapsed().as_secs_f64());
        }
    }
    report(&format!("decode 1 token x {dp}"), &secs, dp);
    let mut sorted = secs.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    println!(
        "decode: {:.1} us per (token, expert) pair (median call / {dp})",
        sorted[sorted.len() / 2] * 1e6 / dp as f64
    );

    // Prefill: n_tok tokens, 8 distinct random experts each.
    let x: Vec<f32> = (0..n_tok * ne).map(|_| rng.normal()).collect();
    let mut pairs = Vec::with_capacity(n_tok * N_USED);
    for t in 0..n_tok {
        let mut chosen: Vec<u32> = Vec::new();
        while chosen.len() < N_USED {
            let e = (rng.next_u64() % N_EXPERT as u64) as u32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        for (s, &e) in chosen.iter().enumerate() {
            pairs.push(ColdPair {
                token: t as u32,
                slot: s as u32,
                expert: e,
                weight: 1.0,
            });
        }
    }
    let used = {
        let mut u: Vec<u32> = pairs.iter().map(|p| p.expert).collect();
        u.sort_unstable();
        u.dedup();
        u.len()
    };
    let mut out = vec![0f32; pairs.len() * ne];
    let reps = (iters / 16).max(2);
    let mut secs = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        expert_rows_with(&w, &x, &pairs, None, &opts, &mut out)?;
        secs.push(t.elapsed().as_secs_f64());
    }
    report(&format!("prefill {n_tok} tokens x 8"), &secs, used);
    let med = {
        let mut s = secs.clone();
        s.sort_by(|a, b| a.total_cmp(b));
        s[s.len() / 2]
    };
    println!(
        "prefill: {:.1} tokens/s for this layer, {:.2} GFLOP/s",
        n_tok as f64 / med,
        (pairs.len() as f64 * 3.0 * 2.0 * (N_EMBD * N_FF) as f64) / med / 1e9
    );
    Ok(())
}
