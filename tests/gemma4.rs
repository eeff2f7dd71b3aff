//! Gemma-4 fixtures (`tests/oracle/make_gemma4.py`: transformers 5.24 `Gemma4ForCausalLM`
//! with random weights; llama.cpp's converter and llama-quantize for the GGUFs) through
//! `lathe::engine::logits`: every file against its reference (the HF logits; for q8_0,
//! llama.cpp on the file's dequantized weights), in one batch and with prefill T-4 then
//! one token at a time, at the fixtures' bar. The sequences are longer than the sliding
//! window.

mod common;
use common::*;
use lathe::engine::{logits, LoadOptions};

fn check_model(name: &str) {
    let dir = fixtures().join(name);
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
    let t = ids.len();
    for f in ["model-f32.gguf", "model-q8_0.gguf", ""] {
        let path = if f.is_empty() {
            dir.clone()
        } else {
            dir.join(f)
        };
        let want = lathe::npy::read_f32(reference_for(&dir, f)).unwrap();
        let ty = f
            .strip_prefix("model-")
            .and_then(|s| s.strip_suffix(".gguf"))
            .unwrap_or("f32");
        for prefill in [t, t - 4] {
            let (got, vocab) = logits(&path, &ids, prefill, &LoadOptions::default()).unwrap();
            let s = score(&got, &want.data, vocab);
            let label = format!(
                "{name}/{} prefill {prefill}",
                if f.is_empty() { "hf" } else { f }
            );
            assert_bar(&label, &s, llamacpp_rms(name, ty));
        }
    }
}

#[test]
fn gemma4_tiny() {
    check_model("gemma4-tiny");
}
