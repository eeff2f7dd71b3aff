//! The runtime's trace hook (`models::runtime::trace`): a named intermediate of one layer,
//! captured in the GPU passes, equals the CPU reference's value at the same point
//! (`step_traced`), for both families that record points. f32 weights and KV, 4 tokens of
//! the tiny fixtures: the two forwards agree to ~1e-6 there, so 1e-4 catches a wrong
//! buffer, row count or layer and never rounding.

mod common;

use lathe::models::runtime::trace::Trace;
use lathe::models::{deepseek4, qwen35, ModelFile};
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
