//! The runtime's trace hook (`models::runtime::trace`): a named intermediate of one layer,
//! captured in the GPU passes, equals the CPU reference's value at the same point
//! (`step_traced`; for the Llama family, the numpy reference `tests/llama_ref.py`). f32
//! weights and KV, the tiny fixtures: the forwards agree to ~1e-6 there, so 1e-4 catches a
//! wrong buffer, row count or layer and never rounding.

mod common;

use lathe::engine::Forward;
use lathe::models::runtime::trace::Trace;
use lathe::models::{deepseek4, llama, qwen35, ModelFile};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

const TOL: f32 = 1e-4;

/// A committed fixture (tests/fixtures/models).
fn fixture(model: &str, file: &str) -> PathBuf {
    common::fixtures().join(model).join(file)
}

fn tokens(model: &str) -> Vec<u32> {
    let t = lathe::npy::read_i64(fixture(model, "tokens.npy")).unwrap();
    t.data.iter().take(4).map(|&t| t as u32).collect()
}

fn opts() -> lathe::engine::LoadOptions {
    lathe::engine::LoadOptions {
        kv_type: lathe::engine::KvType::F32,
        ..Default::default()
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "traced values");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn qwen35_layer_out_matches_the_cpu_reference() {
    let f = ModelFile::open(fixture("qwen35-tiny", "model-f32.gguf")).unwrap();
    let toks = tokens("qwen35-tiny");
    let cpu = qwen35::cpu::CpuModel::load(&f).unwrap();
    let e = cpu.hp.n_embd;
    let mut want = vec![vec![0f32; toks.len() * e]; cpu.hp.n_layer];
    let mut seq = cpu.new_seq();
    for (t, &tok) in toks.iter().enumerate() {
        cpu.step_traced(&mut seq, tok, &mut |l, x| {
            want[l][t * e..(t + 1) * e].copy_from_slice(x)
        });
    }
    let gpu = Arc::new(lathe::gpu::Gpu::new(&Default::default()).unwrap());
    let mut m = qwen35::gpu::GpuModel::load(gpu, &f, &opts()).unwrap();
    for (l, want_l) in want.iter().enumerate() {
        m.trace.want = Some(Trace {
            name: "layer_out",
            layer: l,
        });
        m.trace.traced.clear();
        let mut s = m.new_seq().unwrap();
        m.forward(&mut s, &toks, false).unwrap();
        let d = max_diff(&m.trace.traced, want_l);
        assert!(d < TOL, "layer {l}: max |gpu - cpu| {d}");
    }
}

#[test]
fn deepseek4_points_match_the_cpu_reference() {
    let f = ModelFile::open(fixture("dsv4-tiny", "model-f32.gguf")).unwrap();
    let toks = tokens("dsv4-tiny");
    let cpu = deepseek4::cpu::CpuModel::load(&f).unwrap();
    let mut want: HashMap<(String, usize), Vec<f32>> = HashMap::new();
    let mut seq = cpu.new_seq();
    for &tok in &toks {
        cpu.step_traced(&mut seq, tok, &mut |name, l, x| {
            want.entry((name.to_string(), l))
                .or_default()
                .extend_from_slice(x)
        })
        .unwrap();
    }
    let gpu = Arc::new(lathe::gpu::Gpu::new(&Default::default()).unwrap());
    let mut m = deepseek4::gpu::GpuModel::load(gpu, &f, &opts()).unwrap();
    let last = cpu.hp.n_layer - 1;
    for (name, l) in [("attn_in", 0), ("moe_out", 0), ("layer_out", last)] {
        m.trace.want = Some(Trace { name, layer: l });
        m.trace.traced.clear();
        let mut s = m.new_seq().unwrap();
        m.forward(&mut s, &toks, false).unwrap();
        let d = max_diff(&m.trace.traced, &want[&(name.to_string(), l)]);
        assert!(d < TOL, "{name} of layer {l}: max |gpu - cpu| {d}");
    }
}

/// The Llama family's points (the residual stream after each layer's attention and after
/// its FFN) against `tests/llama_ref.py` (HF's Llama math in numpy on gguf-py's
/// dequantization), over a prefill of all but 4 tokens and then 4 decode steps (the fused
/// decode products), each pass's capture appended.
#[test]
fn llama_points_match_the_numpy_reference() {
    let path = fixture("llama-tiny", "model-f32.gguf");
    let dir = std::env::temp_dir().join(format!("lathe-trace-llama-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (logits, hidden) = (dir.join("logits.npy"), dir.join("hidden.npy"));
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/llama_ref.py");
    let st = std::process::Command::new("python3")
        .arg(script)
        .arg(&path)
        .arg(fixture("llama-tiny", "tokens.npy"))
        .args([&logits, &hidden])
        .status()
        .expect("python3 runs tests/llama_ref.py");
    assert!(st.success(), "llama_ref.py failed");
    // [n_layer, 2 (attn_out, layer_out), T, n_embd]
    let want = lathe::npy::read_f32(&hidden).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let toks: Vec<u32> = lathe::npy::read_i64(fixture("llama-tiny", "tokens.npy"))
        .unwrap()
        .data
        .iter()
        .map(|&t| t as u32)
        .collect();
    let (n_layer, t) = (want.shape[0], want.shape[2]);
    assert_eq!(t, toks.len());
    let per = want.data.len() / (n_layer * 2);
    let f = ModelFile::open(&path).unwrap();
    let gpu = Arc::new(lathe::gpu::Gpu::new(&Default::default()).unwrap());
    let mut m = llama::gpu::GpuModel::load(gpu, &f, &opts()).unwrap();
    for l in 0..n_layer {
        for (i, name) in ["attn_out", "layer_out"].into_iter().enumerate() {
            m.trace.want = Some(Trace { name, layer: l });
            m.trace.traced.clear();
            let mut s = m.new_seq().unwrap();
            m.forward(&mut s, &toks[..t - 4], false).unwrap();
            for &tok in &toks[t - 4..] {
                m.forward(&mut s, &[tok], false).unwrap();
            }
            let at = (l * 2 + i) * per;
            let d = max_diff(&m.trace.traced, &want.data[at..at + per]);
            assert!(d < TOL, "{name} of layer {l}: max |gpu - numpy| {d}");
        }
    }
}
