//! The plain transformer family's variants on tiny random-weight fixtures
//! (`tests/oracle/make_llama_family.py`, made as `../shared/oracle`'s): every file of each
//! model (llama.cpp's GGUF conversions and the Hugging Face checkpoint) through
//! `lathe::engine::logits`, in one batch and with the last 4 tokens decoded one at a time,
//! against transformers' logits (f32 files, HF) or the exact reference of a quantized file,
//! at the fixtures' bar (RMS ≤ 0.02, top-1 ≥ 95%, RMS ≤ max(llama.cpp's, 1e-3)).
//!
//! - `llama-tiny`: `LlamaForCausalLM` with a Mistral-style head size (32, not 64/4) and
//!   Llama 3.1's `llama3` rope scaling (GGUF: `rope_freqs`; HF: computed from the config);
//!   interleaved RoPE in the GGUF (the converter permutes Q/K), halves in HF.
//! - `qwen2-tiny`: q/k/v biases. `qwen3-tiny`: per-head q/k norms, tied head.
//! - `qwen3moe-tiny`: 8 experts, top-2, `norm_topk_prob`; also with half of each layer's
//!   experts on the CPU (`--gpu-experts 0.5`).
//! - `mistral-tiny`: `MistralForCausalLM` with a sliding window of 8 over 24 tokens (without
//!   it transformers' logits move by 0.40 RMS); HF checkpoint only, as llama.cpp's converter
//!   drops the window.

mod common;
use common::*;
use lathe::engine::{logits, LoadOptions};

/// llama.cpp's RMS on this file against its reference (`llama-family.json`, written by the
/// fixture script like `manifest.json`).
fn llamacpp_rms_of(model: &str, ty: &str) -> Option<f64> {
    let p = fixtures().join("llama-family.json");
    let m: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()?;
    let e = &m[model]["gguf"][ty];
    e["llamacpp_vs_dequant_ref"]["rms"]
        .as_f64()
        .or(e["llamacpp_vs_hf"]["rms"].as_f64())
}

fn check_model(name: &str, opts: &LoadOptions) {
    let dir = fixtures().join(name);
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".gguf"))
        .collect();
    files.sort();
    files.push(String::new());
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
    let t = ids.len();
    for f in files {
        let path = if f.is_empty() {
            dir.clone()
        } else {
            dir.join(&f)
        };
        let want = lathe::npy::read_f32(reference_for(&dir, &f)).unwrap();
        let ty = f
            .strip_prefix("model-")
            .and_then(|s| s.strip_suffix(".gguf"))
            .unwrap_or("f32");
        for prefill in [t, t - 4] {
            let (got, vocab) = logits(&path, &ids, prefill, opts).unwrap();
            let s = score(&got, &want.data, vocab);
            let label = format!(
                "{name}/{} prefill {prefill} gpu_experts {:?}",
                if f.is_empty() { "hf" } else { &f },
                opts.gpu_experts
            );
            assert_bar(&label, &s, llamacpp_rms_of(name, ty));
        }
    }
}

#[test]
fn llama_tiny() {
    check_model("llama-tiny", &LoadOptions::default());
}

#[test]
fn mistral_tiny() {
    check_model("mistral-tiny", &LoadOptions::default());
}

#[test]
fn qwen2_tiny() {
    check_model("qwen2-tiny", &LoadOptions::default());
}

#[test]
fn qwen3_tiny() {
    check_model("qwen3-tiny", &LoadOptions::default());
}

#[test]
fn qwen3moe_tiny() {
    check_model("qwen3moe-tiny", &LoadOptions::default());
}

/// Half of every layer's experts cold (run on the CPU from the mapped file): the same bar.
#[test]
fn qwen3moe_tiny_offloaded() {
    let opts = LoadOptions {
        gpu_experts: Some(0.5),
        ..Default::default()
    };
    check_model("qwen3moe-tiny", &opts);
}

/// Fused activation loads and stores (the norms in the products' loads, SwiGLU in the
/// gate+up store, q/k norm + RoPE + cache write in one dispatch at decode) against the
/// unfused kernels on every file of the dense variants, the prompt in one pass (24 tokens:
/// matvec's token groups) and then 4 tokens decoded one at a time: equal to rounding
/// (the norm's factor is applied after the product: max |Δ| ≤ 1e-4 of the largest logit).
#[test]
fn fused_loads_match_unfused() {
    for name in ["llama-tiny", "qwen2-tiny", "qwen3-tiny"] {
        let dir = fixtures().join(name);
        let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
        let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect();
        files.sort();
        files.push(dir.clone());
        for path in files {
            for prefill in [ids.len(), ids.len() - 4] {
                let run = |fused_loads| {
                    let opts = LoadOptions {
                        fused_loads,
                        ..Default::default()
                    };
                    logits(&path, &ids, prefill, &opts).unwrap().0
                };
                let (a, b) = (run(true), run(false));
                assert_eq!(a.len(), b.len());
                let top = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                let diff = a
                    .iter()
                    .zip(&b)
                    .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                assert!(
                    diff <= 1e-4 * top,
                    "{} prefill {prefill}: fused max |Δ| {diff} (largest logit {top})",
                    path.display()
                );
            }
        }
    }
}

/// A Qwen3 decode step's dispatches (GPU timestamps, which lavapipe has): per layer the three
/// products reading the norm through their loads, one q/k norm + RoPE + cache write, the
/// attention, the output product, gate+up with SwiGLU in its store and the down product —
/// 8, no separate norm, RoPE, cache write or SwiGLU (the fusions `fused_loads_match_unfused`
/// checks the numbers of).
#[test]
fn qwen3_decode_step_is_eight_dispatches_per_layer() {
    let path = fixtures().join("qwen3-tiny/model-q8_0.gguf");
    let mut e = lathe::engine::Engine::load(&path, &LoadOptions::default()).unwrap();
    let mut seq = e.new_seq().unwrap();
    e.forward(&mut seq, &[1, 2, 3], false).unwrap();
    let prof = e.profile_step(&mut seq, 4).unwrap();
    let labels: Vec<&str> = prof.iter().map(|(l, _)| l.as_str()).collect();
    let per_layer = labels.iter().filter(|l| l.starts_with("blk.")).count()
        + labels
            .iter()
            .filter(|l| ["attend", "qk_norm_rope"].contains(l))
            .count();
    let n_layer = labels.iter().filter(|l| **l == "qk_norm_rope").count();
    assert!(n_layer > 0, "no fused q/k norm + RoPE in {labels:?}");
    assert_eq!(per_layer, 8 * n_layer, "{labels:?}");
    for op in ["rope", "write_kv", "swiglu"] {
        assert!(
            !labels.iter().any(|l| l.starts_with(op)),
            "{op} in {labels:?}"
        );
    }
    // The one norm left is the final one.
    assert_eq!(
        labels.iter().filter(|l| l.starts_with("rms_norm")).count(),
        1,
        "{labels:?}"
    );
}

/// Sequences fed in one `forward_batch` (shared rounds: prefill parts beside each other,
/// then the decode rows of all in one attention call) get the logits each gets alone.
#[test]
fn llama_batched_equals_lone() {
    for name in ["llama-tiny", "qwen3moe-tiny"] {
        let dir = fixtures().join(name);
        let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
        let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
        check_batched_equals_lone(name, &dir.join("model-q8_0.gguf"), &ids);
    }
}
