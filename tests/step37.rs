//! Step-3.7 fixture (`tests/oracle/make_step37.py`: transformers 5.24
//! `Step3p7ForConditionalGeneration` with random weights, in the release's checkpoint layout;
//! llama.cpp's converter and llama-quantize for the GGUFs) through `lathe::engine::logits`:
//! every file against its reference (the HF logits; for q8_0, llama.cpp on the file's
//! dequantized weights), in one batch and with prefill T-4 then one token at a time, at the
//! fixtures' bar. Its blocks differ in heads, rotary width and RoPE base (full and sliding),
//! two dense blocks come before the MoE ones, and the sequence is longer than the window.

mod common;
use common::*;
use lathe::engine::{logits, LoadOptions};

const NAME: &str = "step37-tiny";

fn check(file: &str) {
    let dir = fixtures().join(NAME);
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
    let t = ids.len();
    let path = if file.is_empty() {
        dir.clone()
    } else {
        dir.join(file)
    };
    let want = lathe::npy::read_f32(reference_for(&dir, file)).unwrap();
    let ty = file
        .strip_prefix("model-")
        .and_then(|s| s.strip_suffix(".gguf"))
        .unwrap_or("f32");
    for prefill in [t, t - 4] {
        let (got, vocab) = logits(&path, &ids, prefill, &LoadOptions::default()).unwrap();
        let s = score(&got, &want.data, vocab);
        let label = format!(
            "{NAME}/{} prefill {prefill}",
            if file.is_empty() { "hf" } else { file }
        );
        assert_bar(&label, &s, llamacpp_rms(NAME, ty));
    }
}

#[test]
fn step37_tiny_gguf_f32() {
    check("model-f32.gguf");
}

#[test]
fn step37_tiny_gguf_q8_0() {
    check("model-q8_0.gguf");
}

#[test]
fn step37_tiny_hf() {
    check("");
}

/// The head-wise gate is part of the architecture: a step35 file without one block's
/// `attn_gate.weight` is refused with the tensor's name, not run without the gate.
#[test]
fn step37_missing_attn_gate_is_named() {
    use lathe::gguf::{GgufFile, GgufWriter};
    let src = GgufFile::open(fixtures().join(NAME).join("model-f32.gguf")).unwrap();
    let drop = "blk.1.attn_gate.weight";
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.set(k.clone(), v.clone()).unwrap();
    }
    let kept: Vec<_> = src.tensors().filter(|t| t.name != drop).collect();
    assert_eq!(
        kept.len() + 1,
        src.tensors().count(),
        "{drop} is in the fixture"
    );
    for t in &kept {
        w.add_tensor_info(t.name, t.dtype, t.shape).unwrap();
    }
    let path = std::env::temp_dir().join(format!("step37-no-gate-{}.gguf", std::process::id()));
    w.write(&path, |i, out| out.write_all(kept[i].data))
        .unwrap();
    let r = logits(&path, &[1, 2, 3], 3, &LoadOptions::default());
    std::fs::remove_file(&path).unwrap();
    let e = r.expect_err("a file without its attention gate must not load");
    assert!(
        e.to_string().contains(drop),
        "error does not name {drop}: {e}"
    );
}
