//! MoE expert offload is exact: whatever share of the experts holds GPU slots (`--gpu-experts`
//! 0, 0.25, 0.5, 1) and under a residency policy that uploads and evicts on every miss, the
//! logits match the all-GPU run (relative RMS ≤ 1e-3, argmax agreeing at ≥ 95% of positions),
//! the fixtures' reference bar still holds, and 64 greedy tokens are the same (except after a
//! near-tie of the all-GPU run). The summation contract of `moe/mod.rs` makes a mixed
//! placement differ only by the rounding of the cold experts' rows (CPU `quant::dot` vs GPU).
//! DeepSeek's release layout is covered too: dsv4-tiny's `upstream/` (packed MXFP4 experts,
//! one tensor per expert), and dsv4-dims rewritten with FP8 experts (`--ignored`, needs
//! ../shared/fixtures).

mod common;
use common::*;
use lathe::engine::{logits, Engine, LoadOptions, Want};
use lathe::moe::CacheConfig;
use std::path::{Path, PathBuf};

/// Greedy tokens generated after the prompt.
const STEPS: usize = 64;
/// Top-2 logit gaps below this (in the all-GPU run) are near-ties: a placement may pick the
/// other token there, so comparison stops at the first one.
const NEAR_TIE: f32 = 1e-3;

struct Variant {
    label: &'static str,
    opts: LoadOptions,
}

fn variants() -> Vec<Variant> {
    let frac = |f: f64| LoadOptions {
        gpu_experts: Some(f),
        ..Default::default()
    };
    vec![
        Variant {
            label: "gpu-experts 0",
            opts: frac(0.0),
        },
        Variant {
            label: "gpu-experts 0.25",
            opts: frac(0.25),
        },
        Variant {
            label: "gpu-experts 0.5",
            opts: frac(0.5),
        },
        Variant {
            label: "gpu-experts 1",
            opts: frac(1.0),
        },
        // Half of all expert bytes as whole hot layers (llama.cpp's -ncmoe arrangement).
        Variant {
            label: "whole layers 0.5",
            opts: LoadOptions {
                gpu_experts: Some(0.5),
                cold_layers: lathe::engine::ColdLayers::Whole,
                ..Default::default()
            },
        },
        // A quarter of the slots, an upload (and so an eviction) on every miss.
        Variant {
            label: "evict every miss",
            opts: LoadOptions {
                gpu_experts: Some(0.25),
                expert_cache: Some(CacheConfig::global_lru()),
                ..Default::default()
            },
        },
    ]
}

/// A `--gpu-mem` under which the budget gives some experts slots but not all (bisection on
/// the placement a load reports).
fn partial_budget(path: &Path) -> u64 {
    let share = |mem: u64| {
        let e = Engine::load(
            path,
            &LoadOptions {
                gpu_mem: vec![mem],
                ..Default::default()
            },
        )
        .unwrap();
        e.placement_report().unwrap().hot_share
    };
    let (mut lo, mut hi) = (1u64 << 20, 1u64 << 32);
    for _ in 0..40 {
        let mid = lo + (hi - lo) / 2;
        match share(mid) {
            s if s <= 0.0 => lo = mid,
            s if s >= 1.0 => hi = mid,
            _ => return mid,
        }
    }
    panic!("{}: no --gpu-mem gives a partial placement", path.display());
}

fn fixture(name: &str, file: &str) -> (PathBuf, PathBuf, Vec<u32>) {
    let (dir, files) = model_files(name);
    assert!(
        files.iter().any(|f| f == file),
        "{name}/{file} is absent from {}: this test needs ../shared/fixtures (CI has it)",
        dir.display()
    );
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let ids = toks.data.iter().map(|&t| t as u32).collect();
    (dir.join(file), reference_for(&dir, file), ids)
}

fn argmax(x: &[f32]) -> usize {
    x.iter()
        .enumerate()
        .fold(0, |b, (i, &v)| if v > x[b] { i } else { b })
}

/// Gap between the largest and second largest logit.
fn top2_gap(x: &[f32]) -> f32 {
    let a = argmax(x);
    let second = x
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != a)
        .map(|(_, &v)| v)
        .fold(f32::NEG_INFINITY, f32::max);
    x[a] - second
}

/// Greedy decode: the prompt as one batch, then `STEPS` tokens one at a time. Returns the
/// tokens and the logits each was chosen from.
fn greedy(path: &Path, prompt: &[u32], opts: &LoadOptions) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut e = Engine::load(path, opts).unwrap();
    let mut seq = e.new_seq().unwrap();
    let mut last = e.forward(&mut seq, prompt, false).unwrap();
    let (mut toks, mut rows) = (Vec::new(), Vec::new());
    for _ in 0..STEPS {
        let t = argmax(&last) as u32;
        toks.push(t);
        rows.push(last);
        last = e.forward(&mut seq, &[t], false).unwrap();
    }
    (toks, rows)
}

fn check(name: &str, file: &str, ty: &str) {
    let (path, refp, ids) = fixture(name, file);
    let mut vs = variants();
    vs.push(Variant {
        label: "partial --gpu-mem budget",
        opts: LoadOptions {
            gpu_mem: vec![partial_budget(&path)],
            ..Default::default()
        },
    });
    let llama = llamacpp_rms(name, ty);
    check_variants(&format!("{name}/{file}"), &path, &refp, &ids, llama, vs);
}

/// Every variant of `vs` against the all-GPU run of `path` (logits of a prefill + 4 decode
/// steps, and greedy tokens) and against the reference `refp` (the fixture bar).
fn check_variants(
    what: &str,
    path: &Path,
    refp: &Path,
    ids: &[u32],
    llama: Option<f64>,
    vs: Vec<Variant>,
) {
    let path = path.to_path_buf();
    let want = lathe::npy::read_f32(refp).unwrap();
    let t = ids.len();
    // Prefill of all but 4 tokens (a batched pass, matmul path), then 4 decode steps.
    let prefill = t - 4;
    let (base, vocab) = logits(&path, ids, prefill, &LoadOptions::default()).unwrap();
    let base_rms = (base.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / base.len() as f64)
        .sqrt()
        .max(1e-12);
    let prompt = &ids[..t.min(8)];
    let (base_toks, base_rows) = greedy(&path, prompt, &LoadOptions::default());
    for v in vs {
        let label = format!("{what} {}", v.label);
        let (got, _) = logits(&path, ids, prefill, &v.opts).unwrap();
        let s = score(&got, &base, vocab);
        let rel = s.rms / base_rms;
        eprintln!(
            "{label}: vs all-GPU rel rms {rel:.3e} max_abs {:.3e} argmax {:.3}",
            s.max_abs, s.top1
        );
        assert!(rel <= 1e-3, "{label}: relative rms {rel:.3e} vs all-GPU");
        assert!(s.top1 >= 0.95, "{label}: argmax agreement {:.3}", s.top1);
        let r = score(&got, &want.data, vocab);
        assert_bar(&label, &r, llama);

        let (toks, _) = greedy(&path, prompt, &v.opts);
        for i in 0..STEPS {
            if toks[i] != base_toks[i] {
                let gap = top2_gap(&base_rows[i]);
                assert!(
                    gap < NEAR_TIE,
                    "{label}: greedy token {i} is {} vs all-GPU {} (top-2 gap {gap:.3e})",
                    toks[i],
                    base_toks[i]
                );
                eprintln!("{label}: near-tie at step {i} (gap {gap:.3e}): stop comparing");
                break;
            }
        }
    }
}

/// The offload really runs: cold pairs go through the CPU, the eviction policy uploads, and
/// `--gpu-experts 1` needs no offload at all.
fn check_placement(name: &str, file: &str) {
    let (path, _, ids) = fixture(name, file);
    let run = |opts: &LoadOptions| {
        let mut e = Engine::load(&path, opts).unwrap();
        let mut seq = e.new_seq().unwrap();
        e.forward(&mut seq, &ids[..4], false).unwrap();
        for &t in &ids[4..12] {
            e.forward(&mut seq, &[t], false).unwrap();
        }
        e.placement_report()
            .expect("a MoE model reports its placement")
    };
    let all = run(&LoadOptions {
        gpu_experts: Some(1.0),
        ..Default::default()
    });
    assert_eq!(all.hot_share, 1.0, "{name}: --gpu-experts 1");
    assert_eq!(all.cold_pairs, 0);
    let none = run(&LoadOptions {
        gpu_experts: Some(0.0),
        ..Default::default()
    });
    assert_eq!(
        none.hot_experts, 0,
        "{name}: --gpu-experts 0 holds no slots"
    );
    assert!(
        none.cold_pairs > 0,
        "{name}: --gpu-experts 0 ran nothing cold"
    );
    // Evict-every-miss: every decode step uploads (its slots were full, so it evicts).
    let mut e = Engine::load(
        &path,
        &LoadOptions {
            gpu_experts: Some(0.25),
            expert_cache: Some(CacheConfig::global_lru()),
            ..Default::default()
        },
    )
    .unwrap();
    let mut seq = e.new_seq().unwrap();
    e.forward(&mut seq, &ids[..4], false).unwrap();
    for &t in &ids[4..12] {
        let before = e.placement_report().unwrap();
        e.forward(&mut seq, &[t], false).unwrap();
        let after = e.placement_report().unwrap();
        assert!(
            after.uploads > before.uploads,
            "{name}: a decode step without uploads under evict-every-miss"
        );
        assert_eq!(after.hot_experts, before.hot_experts, "slots are reused");
    }
}

/// `collect_expert_stats` counts every routed pair; the saved file loads back as
/// `--expert-stats` and the run stays exact under it.
fn check_stats(name: &str, file: &str) {
    let (path, _, ids) = fixture(name, file);
    let mut e = Engine::load(
        &path,
        &LoadOptions {
            collect_expert_stats: true,
            ..Default::default()
        },
    )
    .unwrap();
    let mut seq = e.new_seq().unwrap();
    e.forward(&mut seq, &ids, false).unwrap();
    let out = std::env::temp_dir().join(format!(
        "lathe-moe-stats-{}-{name}.json",
        std::process::id()
    ));
    e.save_expert_stats(&out).unwrap();
    let stats = lathe::moe::ExpertStats::load(&out).unwrap();
    for l in &stats.layers {
        assert_eq!(l.tokens, ids.len() as u64, "layer {}", l.layer);
        assert_eq!(
            l.counts.iter().sum::<u64>(),
            ids.len() as u64 * stats.n_used as u64,
            "layer {}",
            l.layer
        );
    }
    let opts = LoadOptions {
        gpu_experts: Some(0.5),
        expert_stats: Some(out.clone()),
        ..Default::default()
    };
    let (got, vocab) = logits(&path, &ids, ids.len(), &opts).unwrap();
    let (base, _) = logits(&path, &ids, ids.len(), &LoadOptions::default()).unwrap();
    let s = score(&got, &base, vocab);
    assert!(
        s.top1 >= 0.95 && s.max_abs < 1e-2,
        "{name} with stats: {:.3e}",
        s.max_abs
    );
    let _ = std::fs::remove_file(out);
    // Without collection there is nothing to save.
    let e = Engine::load(&path, &LoadOptions::default()).unwrap();
    assert!(e
        .save_expert_stats(Path::new("/nonexistent/x.json"))
        .is_err());
}

/// Several sequences in shared passes (a prefill chunk beside decode rows, then decode rows of
/// both): the offload's per-row cold work matches the all-GPU run.
fn check_batched(name: &str, file: &str) {
    let (path, _, ids) = fixture(name, file);
    let run = |opts: &LoadOptions| -> Vec<f32> {
        let mut e = Engine::load(&path, opts).unwrap();
        let (mut a, mut b) = (e.new_seq().unwrap(), e.new_seq().unwrap());
        let mut out = Vec::new();
        e.forward(&mut b, &ids[..3], false).unwrap();
        let r = e
            .forward_batch(&mut [
                (&mut a, &ids[..12], Want::All),
                (&mut b, &ids[3..4], Want::Last),
            ])
            .unwrap();
        out.extend(r.into_iter().flatten());
        for step in 0..4 {
            let (ta, tb) = (&ids[12 + step..13 + step], &ids[4 + step..5 + step]);
            let r = e
                .forward_batch(&mut [(&mut a, ta, Want::Last), (&mut b, tb, Want::Last)])
                .unwrap();
            out.extend(r.into_iter().flatten());
        }
        out
    };
    let base = run(&LoadOptions::default());
    let vocab = base.len() / (12 + 1 + 8);
    for f in [0.0, 0.25] {
        let got = run(&LoadOptions {
            gpu_experts: Some(f),
            ..Default::default()
        });
        let s = score(&got, &base, vocab);
        eprintln!(
            "{name} batched gpu-experts {f}: max_abs {:.3e} argmax {:.3}",
            s.max_abs, s.top1
        );
        assert!(
            s.max_abs < 1e-3 && s.top1 >= 0.95,
            "{name} batched gpu-experts {f}: max_abs {:.3e}",
            s.max_abs
        );
    }
}

/// A prefill longer than one pass (chunks of 256 rows, the matmul path over the arena, each
/// cold expert run once per chunk for all its rows).
fn check_long_prefill(name: &str, file: &str) {
    let (path, _, ids) = fixture(name, file);
    let long: Vec<u32> = ids.iter().cycle().take(300).copied().collect();
    let run = |opts: &LoadOptions| {
        let mut e = Engine::load(&path, opts).unwrap();
        let mut seq = e.new_seq().unwrap();
        let mut out = e.forward(&mut seq, &long, false).unwrap();
        out.extend(e.forward(&mut seq, &ids[..1], false).unwrap());
        out
    };
    let base = run(&LoadOptions::default());
    let got = run(&LoadOptions {
        gpu_experts: Some(0.25),
        ..Default::default()
    });
    let s = score(&got, &base, base.len() / 2);
    eprintln!("{name} 300-token prefill: max_abs {:.3e}", s.max_abs);
    assert!(
        s.max_abs < 1e-3 && s.top1 == 1.0,
        "{name}: max_abs {:.3e}",
        s.max_abs
    );
}

/// `--expert-stream always` under a `--gpu-mem` too small for any expert slot: a prompt's
/// cold experts are copied to the GPU's streaming slots and run there with the GPU's own
/// kernels, so every position's logits equal the all-GPU run's, and bytes were streamed.
/// `never` keeps them on the CPU (nothing streamed, pairs on the CPU).
fn check_stream(name: &str, file: &str) {
    let (path, _, ids) = fixture(name, file);
    let long: Vec<u32> = ids.iter().cycle().take(300).copied().collect();
    let run = |opts: &LoadOptions| {
        let mut e = Engine::load(&path, opts).unwrap();
        let mut seq = e.new_seq().unwrap();
        let out = e.forward(&mut seq, &long, true).unwrap();
        (out, e.placement_report().unwrap())
    };
    let (base, _) = run(&LoadOptions::default());
    let small = |mode| LoadOptions {
        gpu_mem: vec![1 << 20],
        expert_stream: mode,
        ..Default::default()
    };
    let (got, rep) = run(&small(lathe::engine::ExpertStream::Always));
    let s = score(&got, &base, base.len() / long.len());
    eprintln!("{name} streamed: max_abs {:.3e}, {rep:?}", s.max_abs);
    assert_eq!(rep.hot_experts, 0, "{rep:?}");
    assert!(rep.streamed_bytes > 0 && rep.streamed_pairs > 0, "{rep:?}");
    assert_eq!(rep.cold_pairs, 0, "every cold pair streamed: {rep:?}");
    assert!(
        s.max_abs <= 1e-6,
        "{name}: streamed max_abs {:.3e}",
        s.max_abs
    );
    let (got, rep) = run(&small(lathe::engine::ExpertStream::Never));
    assert_eq!(rep.streamed_bytes, 0, "{rep:?}");
    assert!(rep.cold_pairs > 0, "{rep:?}");
    let s = score(&got, &base, base.len() / long.len());
    assert!(s.max_abs < 1e-3, "{name}: CPU max_abs {:.3e}", s.max_abs);
}

/// A prompt longer than the family's pass under `--expert-stream always` with some experts
/// cold: the pass grows (`moe::offload::STREAM_ROWS`) so the whole prompt is one pass, and
/// each cold expert the prompt selects crosses the link once: `streamed_bytes` is exactly
/// the bytes of the distinct selected cold experts (the residency cache held still, so the
/// cold set is the placement's). In passes of the family's batch it would be up to a copy
/// per pass. Logits match the all-GPU run's at the long-prefill bar: the all-GPU run
/// takes the prompt in passes of its batch, and the pass length moves rounding (its
/// attention tiles), so the streaming bar of equal passes does not apply.
fn check_stream_long(name: &str, file: &str) {
    let (path, _, ids) = fixture(name, file);
    let long: Vec<u32> = ids.iter().cycle().take(1100).copied().collect();
    let run = |opts: &LoadOptions| {
        let mut e = Engine::load(&path, opts).unwrap();
        let mut seq = e.new_seq().unwrap();
        let out = e.forward(&mut seq, &long, true).unwrap();
        (out, e)
    };
    let (base, e) = run(&LoadOptions::default());
    let batch = e.pass_rows();
    assert!(
        batch < long.len(),
        "{name}: the all-GPU pass is {batch} rows"
    );
    let (got, e) = run(&LoadOptions {
        gpu_experts: Some(0.25),
        gpu_mem: vec![256 << 20],
        expert_stream: lathe::engine::ExpertStream::Always,
        expert_cache: Some(CacheConfig {
            max_uploads_per_step: 0,
            ..Default::default()
        }),
        collect_expert_stats: true,
        ..Default::default()
    });
    assert!(
        e.pass_rows() >= long.len(),
        "{name}: pass of {}",
        e.pass_rows()
    );
    let off = e.offload().expect("a partial placement has an offload");
    let stats = off.stats().expect("statistics collected");
    let mut want = 0u64;
    for lp in &off.placement.layers {
        let counts = &stats
            .layer(lp.layer)
            .expect("a MoE layer's statistics")
            .counts;
        let cold = (0..lp.n_expert)
            .filter(|&x| counts[x] > 0 && lp.remap[x] == lathe::moe::COLD)
            .count() as u64;
        want += cold * off.placement.groups[lp.group].slot_bytes();
    }
    let rep = e.placement_report().unwrap();
    let s = score(&got, &base, base.len() / long.len());
    eprintln!(
        "{name} {}-token prompt in one pass of {}: streamed {} bytes, selected cold {want}, \
         max_abs {:.3e}",
        long.len(),
        e.pass_rows(),
        rep.streamed_bytes,
        s.max_abs
    );
    assert!(want > 0 && rep.cold_pairs == 0, "{rep:?}");
    assert_eq!(rep.streamed_bytes, want, "{rep:?}");
    assert!(
        s.max_abs < 1e-3 && s.top1 == 1.0,
        "{name}: streamed max_abs {:.3e}",
        s.max_abs
    );
}

#[test]
fn qwen35moe_tiny_stream_long() {
    check_stream_long("qwen35moe-tiny", "model-q8_0.gguf");
}

#[test]
fn dsv4_tiny_stream_long() {
    check_stream_long("dsv4-tiny", "model-q8_0.gguf");
}

#[test]
fn qwen35moe_tiny_stream() {
    check_stream("qwen35moe-tiny", "model-q8_0.gguf");
}

#[test]
fn dsv4_tiny_stream() {
    check_stream("dsv4-tiny", "model-q8_0.gguf");
}

#[test]
fn qwen35moe_tiny_batched() {
    check_batched("qwen35moe-tiny", "model-q8_0.gguf");
}

#[test]
fn qwen35moe_tiny_long_prefill() {
    check_long_prefill("qwen35moe-tiny", "model-q8_0.gguf");
}

#[test]
fn dsv4_tiny_long_prefill() {
    check_long_prefill("dsv4-tiny", "model-q8_0.gguf");
}

#[test]
fn qwen35moe_tiny_exact() {
    check("qwen35moe-tiny", "model-q8_0.gguf", "q8_0");
}

#[test]
fn qwen35moe_tiny_placement() {
    check_placement("qwen35moe-tiny", "model-q4_0.gguf");
}

#[test]
fn qwen35moe_tiny_stats() {
    check_stats("qwen35moe-tiny", "model-q8_0.gguf");
}

#[test]
fn dsv4_tiny_exact() {
    check("dsv4-tiny", "model-q8_0.gguf", "q8_0");
}

/// DeepSeek's release layout (`upstream/`: packed MXFP4 experts, one tensor per expert, read
/// through their E8M0 scales and repacked per expert or per rows): offloaded placements match
/// the all-GPU load of the same checkpoint, and the offload really runs cold pairs.
#[test]
fn dsv4_tiny_upstream_exact() {
    let (dir, _) = model_files("dsv4-tiny");
    let path = dir.join("upstream");
    assert!(
        path.join("model.safetensors").exists(),
        "{} is absent",
        path.display()
    );
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
    let frac = |f: f64| LoadOptions {
        gpu_experts: Some(f),
        ..Default::default()
    };
    let vs = vec![
        Variant {
            label: "gpu-experts 0",
            opts: frac(0.0),
        },
        Variant {
            label: "gpu-experts 0.5",
            opts: frac(0.5),
        },
        Variant {
            label: "gpu-experts 1",
            opts: frac(1.0),
        },
        Variant {
            label: "evict every miss",
            opts: LoadOptions {
                gpu_experts: Some(0.25),
                expert_cache: Some(CacheConfig::global_lru()),
                ..Default::default()
            },
        },
    ];
    let llama = llamacpp_rms("dsv4-tiny", "f32");
    let refp = dir.join("logits.npy");
    check_variants("dsv4-tiny/upstream", &path, &refp, &ids, llama, vs);
    // The offload is there and runs experts on the CPU (not a silent all-GPU fallback; the
    // prompt's cold experts would stream to the GPU under the default `auto`).
    let opts = LoadOptions {
        expert_stream: lathe::engine::ExpertStream::Never,
        ..frac(0.5)
    };
    let mut e = Engine::load(&path, &opts).unwrap();
    let mut seq = e.new_seq().unwrap();
    e.forward(&mut seq, &ids[..8], false).unwrap();
    let r = e.placement_report().unwrap();
    assert!(r.hot_share > 0.0 && r.hot_share < 1.0, "{r:?}");
    assert!(r.cold_pairs > 0, "{r:?}");
}

#[test]
fn dsv4_tiny_placement() {
    check_placement("dsv4-tiny", "model-q8_0.gguf");
}

#[test]
#[ignore = "slow on lavapipe"]
fn qwen35moe_dims_exact() {
    check("qwen35moe-dims", "model-q4_k_m.gguf", "q4_k_m");
}

#[test]
#[ignore = "slow on lavapipe; ../shared only"]
fn dsv4_dims_exact() {
    check("dsv4-dims", "model-q8_0.gguf", "q8_0");
}

/// e4m3fn code nearest to `v` (round to nearest; positive codes 0..=0x7E increase with
/// their value, 0x7F is NaN), saturating at ±448.
fn to_e4m3(v: f32) -> u8 {
    use lathe::safetensors::scaled::e4m3_to_f32;
    let a = v.abs().min(448.0);
    let hi = (0u8..=0x7e)
        .collect::<Vec<_>>()
        .partition_point(|&c| e4m3_to_f32(c) < a) as u8;
    let c = if hi == 0 {
        0
    } else if hi > 0x7e || a - e4m3_to_f32(hi - 1) <= e4m3_to_f32(hi) - a {
        hi - 1
    } else {
        hi
    };
    c | if v < 0.0 { 0x80 } else { 0 }
}

fn safetensors_dtype(d: lathe::DType) -> &'static str {
    use lathe::DType as T;
    match d {
        T::F32 => "F32",
        T::BF16 => "BF16",
        T::F16 => "F16",
        T::I64 => "I64",
        T::I32 => "I32",
        T::U8 => "U8",
        T::I8 => "I8",
        T::F8_E8M0 => "F8_E8M0",
        T::F8_E4M3 => "F8_E4M3",
        d => panic!("no safetensors name for {d}"),
    }
}

/// A copy of the release checkpoint `src` whose routed experts are FP8 e4m3 with F32
/// 128×128 block scales (amax/448 per block), as DeepSeek's FP8 releases store experts.
fn write_fp8_experts(src: &Path, dst: &Path) {
    use lathe::safetensors::{dequant_mxfp4_packed, find_block_scale};
    let f = lathe::models::ModelFile::open(src).unwrap();
    let lathe::models::ModelFile::Hf(h) = &f else {
        panic!("{} is not a checkpoint directory", src.display())
    };
    let _ = std::fs::remove_dir_all(dst);
    std::fs::create_dir_all(dst).unwrap();
    std::fs::copy(src.join("config.json"), dst.join("config.json")).unwrap();
    let expert = |n: &str| n.contains(".ffn.experts.");
    let mut out: Vec<(String, &str, Vec<u64>, Vec<u8>)> = Vec::new();
    for t in f.tensors() {
        if expert(t.name) && t.name.ends_with(".scale") {
            continue;
        }
        if !(expert(t.name) && t.name.ends_with(".weight")) {
            let dt = safetensors_dtype(t.dtype);
            out.push((t.name.to_string(), dt, t.shape.to_vec(), t.data.to_vec()));
            continue;
        }
        let (rows, cols) = (t.shape[0] as usize, t.shape[1] as usize * 2);
        let mut w = vec![0f32; rows * cols];
        let s = find_block_scale(h, t.name).unwrap();
        dequant_mxfp4_packed(&t, &s, &mut w).unwrap();
        let (br, bc) = (rows / 128, cols / 128);
        let mut scales = vec![0f32; br * bc];
        let mut codes = vec![0u8; rows * cols];
        for (b, sc) in scales.iter_mut().enumerate() {
            let (r0, c0) = (b / bc * 128, b % bc * 128);
            let at = |r: usize, c: usize| (r0 + r) * cols + c0 + c;
            let amax = (0..128 * 128).fold(0f32, |a, i| a.max(w[at(i / 128, i % 128)].abs()));
            *sc = if amax > 0.0 { amax / 448.0 } else { 1.0 };
            for i in 0..128 * 128 {
                codes[at(i / 128, i % 128)] = to_e4m3(w[at(i / 128, i % 128)] / *sc);
            }
        }
        // Random MXFP4 weights: most codes are non-zero after the rounding too.
        let zeros = codes.iter().filter(|&&c| c & 0x7f == 0).count();
        assert!(zeros < codes.len() / 2, "{}: {zeros} zero codes", t.name);
        let base = t.name.strip_suffix(".weight").unwrap();
        let sb: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
        let shape = vec![rows as u64, cols as u64];
        out.push((t.name.to_string(), "F8_E4M3", shape, codes));
        out.push((
            format!("{base}.scale"),
            "F32",
            vec![br as u64, bc as u64],
            sb,
        ));
    }
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (name, dt, shape, bytes) in &out {
        let end = off + bytes.len();
        let v = serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [off, end]});
        header.insert(name.clone(), v);
        off = end;
    }
    let mut hb = serde_json::Value::Object(header).to_string().into_bytes();
    while !hb.len().is_multiple_of(8) {
        hb.push(b' ');
    }
    let mut file = (hb.len() as u64).to_le_bytes().to_vec();
    file.extend(hb);
    for (_, _, _, bytes) in &out {
        file.extend(bytes);
    }
    std::fs::write(dst.join("model.safetensors"), file).unwrap();
}

/// FP8 routed experts (a release's `F8_E4M3` + block scale, one tensor per expert) offloaded:
/// dsv4-dims (every dimension a multiple of 128) rewritten with FP8 experts, under
/// `--gpu-experts 0` and `0.5`, against its own all-GPU load (prefill of 296 tokens: the
/// matmul path over the arena; 4 decode steps: the matvec path).
#[test]
#[ignore = "slow on lavapipe; ../shared only"]
fn dsv4_dims_fp8_experts_offload() {
    let src = require_shared("dsv4-dims");
    assert!(
        src.join("upstream").is_dir(),
        "{} is absent",
        src.join("upstream").display()
    );
    let dst = std::env::temp_dir().join(format!("lathe-moe-fp8-experts-{}", std::process::id()));
    write_fp8_experts(&src.join("upstream"), &dst);
    let f = lathe::models::ModelFile::open(&dst).unwrap();
    let info =
        lathe::moe::MoeInfo::from_file(&f, lathe::models::registry::family(&f).unwrap().experts)
            .unwrap();
    assert!(info
        .layers
        .iter()
        .all(|m| m.gate.dtype == lathe::DType::F8_E4M3_B128));
    drop(f);
    let toks = lathe::npy::read_i64(src.join("tokens.npy")).unwrap();
    let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
    let prefill = ids.len() - 4;
    let (base, vocab) = logits(&dst, &ids, prefill, &LoadOptions::default()).unwrap();
    let base_rms = (base.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / base.len() as f64)
        .sqrt()
        .max(1e-12);
    for fr in [0.0, 0.5] {
        let opts = LoadOptions {
            gpu_experts: Some(fr),
            ..Default::default()
        };
        let (got, _) = logits(&dst, &ids, prefill, &opts).unwrap();
        let s = score(&got, &base, vocab);
        let rel = s.rms / base_rms;
        eprintln!(
            "dsv4-dims FP8 experts, gpu-experts {fr}: rel rms {rel:.3e} argmax {:.3}",
            s.top1
        );
        assert!(
            rel <= 1e-3 && s.top1 >= 0.95,
            "gpu-experts {fr}: rel rms {rel:.3e}"
        );
    }
    std::fs::remove_dir_all(&dst).ok();
}

/// Slots that learn: on a synthetic model whose routers favour a few experts per layer
/// (`lathe synth --skew`), the residency cache's uploads raise the hit rate of a decode run
/// above that of the same slots held fixed, and the hit rate of the run's second half above
/// its first half's (the popular experts have moved into slots by then). Its prompt also
/// streams in several rounds per layer.
#[test]
fn skewed_router_slots_learn() {
    use lathe::synth::{self, Dims, FileType, PlanOptions, QwenMoe};
    let mut p = synth::preset("demo").unwrap();
    let Dims::Qwen35(d) = &mut p.dims else {
        unreachable!("demo is a Qwen3.5 preset")
    };
    d.n_vocab = 1024;
    d.moe = Some(QwenMoe {
        n_expert: 32,
        n_used: 4,
        n_ff_exp: 256,
        n_ff_shexp: 256,
    });
    let opts = PlanOptions {
        ftype: Some(FileType::Q8_0),
        skew: 8.0,
        ..Default::default()
    };
    let dir = std::env::temp_dir().join(format!("lathe-learn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("skewed.gguf");
    synth::plan(&p, &opts, None)
        .unwrap()
        .write(&path, 5, None)
        .unwrap();
    let toks: Vec<u32> = (0..64u32).map(|i| (i * 389 + 17) % 1024).collect();
    let stats = dir.join("stats.json");
    // Hit rates of the first and second half of a 64-token decode, one token per step.
    let run = |cache: CacheConfig, load: Option<&Path>, save: Option<&Path>| {
        let mut e = Engine::load(
            &path,
            &LoadOptions {
                gpu_experts: Some(0.25),
                expert_cache: Some(cache),
                expert_stats: load.map(Path::to_path_buf),
                save_expert_stats: save.map(Path::to_path_buf),
                ..Default::default()
            },
        )
        .unwrap();
        let mut seq = e.new_seq().unwrap();
        let hits = |e: &Engine| {
            let o = e.offload().expect("a partial placement has an offload");
            o.cache_hits()
        };
        e.forward(&mut seq, &toks[..1], false).unwrap();
        let h0 = hits(&e);
        for &t in &toks[1..32] {
            e.forward(&mut seq, &[t], false).unwrap();
        }
        let h1 = hits(&e);
        for &t in &toks[32..] {
            e.forward(&mut seq, &[t], false).unwrap();
        }
        let h2 = hits(&e);
        let rate = |a: (u64, u64), b: (u64, u64)| {
            let (h, m) = (b.0 - a.0, b.1 - a.1);
            h as f64 / (h + m).max(1) as f64
        };
        e.finish_expert_stats().unwrap();
        (rate(h0, h1), rate(h1, h2), rate(h0, h2))
    };
    let held = CacheConfig {
        max_uploads_per_step: 0,
        ..Default::default()
    };
    let fixed = run(held.clone(), None, Some(&stats));
    let learn = run(CacheConfig::default(), None, None);
    // --expert-stats from the previous run places the popular experts from the start.
    let placed = run(held, Some(&stats), None);
    eprintln!(
        "hit rates (first half, second half, all): fixed {fixed:?}, learning {learn:?}, \
         placed by statistics {placed:?}"
    );
    assert!(
        learn.2 > fixed.2 + 0.05,
        "fixed {fixed:?}, learning {learn:?}"
    );
    assert!(learn.1 > learn.0, "learning {learn:?}");
    assert!(
        placed.2 > fixed.2 + 0.05,
        "fixed {fixed:?}, placed {placed:?}"
    );
    // A prompt whose layers pick more cold experts than the streaming slots hold (32 >
    // `offload::STREAM_SLOTS`): rounds through both staging buffers, logits still the
    // all-GPU run's.
    const { assert!(32 > lathe::moe::offload::STREAM_SLOTS) };
    let prefill = |opts: &LoadOptions| {
        let mut e = Engine::load(&path, opts).unwrap();
        let mut seq = e.new_seq().unwrap();
        let out = e.forward(&mut seq, &toks, true).unwrap();
        (out, e.placement_report().unwrap())
    };
    let (base, _) = prefill(&LoadOptions::default());
    let (got, rep) = prefill(&LoadOptions {
        gpu_mem: vec![1 << 20],
        expert_stream: lathe::engine::ExpertStream::Always,
        ..Default::default()
    });
    let s = score(&got, &base, 1024);
    assert!(rep.streamed_bytes > 0 && rep.cold_pairs == 0, "{rep:?}");
    assert!(
        s.max_abs <= 1e-6,
        "streamed in rounds: max_abs {:.3e}",
        s.max_abs
    );
    std::fs::remove_dir_all(&dir).ok();
}
