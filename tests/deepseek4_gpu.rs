//! DeepSeek-V4 GPU forward (`lathe::engine::logits`) against the fixtures' reference logits,
//! with the bar of ../shared/fixtures/README.md ("What matching means"): whole-sequence
//! prefill, and prefill of all but 4 tokens then decode, for every model file.
//!
//! dsv4-tiny lives in tests/fixtures/models; dsv4-dims (real head sizes: 512-wide heads,
//! 16 indexer heads × 128, window 128, YaRN) is read from ../shared/fixtures, and its tests
//! fail, saying so, when that is absent (CI has it). Every dims file runs in CI (about 30 s
//! each on lavapipe).
//!
//! KV cache type: the bar is met with room to spare by f32 math (RMS ~1e-5 against the
//! references), which is DeepSeek-V4's default (`KvType::Auto`). An f16 cache rounds K = V
//! to 11 bits, which these random-weight models amplify: dsv4-tiny stays at RMS 3e-4
//! (checked below), but dsv4-dims drifts to 0.02–0.033 (indexer top-k choices flip
//! downstream of the rounding), so the dims checks run with the default f32 cache.

mod common;
use common::*;
use lathe::engine::{self, Engine, KvType, LoadOptions};
use lathe::gpu::MatmulChoice;
use std::path::{Path, PathBuf};

fn tiny() -> PathBuf {
    fixtures().join("dsv4-tiny")
}

fn dims() -> PathBuf {
    require_shared("dsv4-dims")
}

fn tokens(dir: &Path) -> Vec<u32> {
    let t = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    t.data.iter().map(|&v| v as u32).collect()
}

/// `file` ("" for the upstream dir) against its reference, prefill T and T − 4; `ty` names
/// llama.cpp's manifest entry of the same weights.
fn check(dir: &Path, file: &str, ty: &str, kv: KvType) {
    check_with(dir, file, ty, kv, MatmulChoice::Auto)
}

fn check_with(dir: &Path, file: &str, ty: &str, kv: KvType, matmul: MatmulChoice) {
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let path = if file.is_empty() {
        dir.join("upstream")
    } else {
        dir.join(file)
    };
    let want = lathe::npy::read_f32(reference_for(dir, file)).unwrap();
    let toks = tokens(dir);
    let t = toks.len();
    for prefill in [t, t - 4] {
        let opts = LoadOptions {
            kv_type: kv,
            matmul,
            ..Default::default()
        };
        let (got, v) = engine::logits(&path, &toks, prefill, &opts)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let s = score(&got, &want.data, v);
        let label = format!(
            "{name}/{} prefill {prefill}/{t} kv {kv:?} matmul {matmul:?}",
            if file.is_empty() { "upstream" } else { file }
        );
        assert_bar(&label, &s, llamacpp_rms(&name, ty));
    }
}

#[test]
fn tiny_f32() {
    check(
        &tiny(),
        "model-f32.gguf",
        "f32",
        LoadOptions::default().kv_type,
    );
    // An f16 cache still meets the bar on tiny (RMS ~3e-4).
    check(&tiny(), "model-f32.gguf", "f32", KvType::F16);
}

#[test]
fn tiny_q8_0() {
    check(&tiny(), "model-q8_0.gguf", "q8_0", KvType::F32);
}

#[test]
fn tiny_q4_0() {
    check(&tiny(), "model-q4_0.gguf", "q4_0", KvType::F32);
}

/// The two-level int8 path (`--matmul int8x2`) on the quantized tiny files keeps the bar
/// (RMS ~6e-5 against 1e-3; on the 300-token dims file it does not, so `auto` keeps
/// DeepSeek-V4 on f32-level products: coop-split, or tiled without matrix units).
#[test]
fn tiny_int8x2_matmul() {
    check_with(
        &tiny(),
        "model-q8_0.gguf",
        "q8_0",
        KvType::F32,
        MatmulChoice::Int8x2,
    );
    check_with(
        &tiny(),
        "model-q4_0.gguf",
        "q4_0",
        KvType::F32,
        MatmulChoice::Int8x2,
    );
}

#[test]
fn tiny_upstream() {
    check(&tiny(), "", "f32", KvType::F32);
}

/// Decode continues exactly where a prefill of any length stopped: windows, partial
/// compressor windows and the previous window of the overlapping compressors carry over.
/// Cuts around the window (8) and the ratios (4; 128 is crossed by the decode tail).
#[test]
fn tiny_prefill_then_decode_matches_one_prefill() {
    let path = tiny().join("model-f32.gguf");
    let toks = tokens(&tiny());
    let toks = &toks[..140];
    let opts = LoadOptions {
        kv_type: KvType::F32,
        ..Default::default()
    };
    let mut e = Engine::load(&path, &opts).unwrap();
    let v = e.vocab_size();
    let mut s = e.new_seq().unwrap();
    let full = e.forward(&mut s, toks, true).unwrap();
    for cut in [1, 3, 4, 7, 9, 17, 126] {
        e.reset(&mut s).unwrap();
        let mut got = e.forward(&mut s, &toks[..cut], true).unwrap();
        // Decode a few, then prefill a chunk again, then decode to the end.
        let mid = (cut + 5).min(toks.len());
        for t in &toks[cut..mid] {
            got.extend(e.forward(&mut s, std::slice::from_ref(t), true).unwrap());
        }
        let mid2 = (mid + 11).min(toks.len());
        got.extend(e.forward(&mut s, &toks[mid..mid2], true).unwrap());
        for t in &toks[mid2..] {
            got.extend(e.forward(&mut s, std::slice::from_ref(t), true).unwrap());
        }
        assert_eq!(s.pos(), toks.len());
        let sc = score(&got, &full, v);
        eprintln!("cut {cut}: max_abs {:.3e}", sc.max_abs);
        assert!(
            sc.max_abs <= 1e-4,
            "cut {cut}: prefill + decode differs from one prefill by {:.3e}",
            sc.max_abs
        );
    }
}

#[test]
fn tiny_bad_token_is_an_error() {
    let mut e = Engine::load(&tiny().join("model-f32.gguf"), &LoadOptions::default()).unwrap();
    let mut s = e.new_seq().unwrap();
    let err = e.forward(&mut s, &[3, 512], false).unwrap_err();
    assert!(err.to_string().contains("512"), "{err}");
    assert_eq!(s.pos(), 0);
}

#[test]
fn dims_q8_0() {
    let d = dims();
    // The default options users get (KvType::Auto: f32 for DeepSeek-V4).
    check(
        &d,
        "model-q8_0.gguf",
        "q8_0",
        LoadOptions::default().kv_type,
    );
}

#[test]
fn dims_bf16() {
    let d = dims();
    check(&d, "model-bf16.gguf", "bf16", KvType::Auto);
}

#[test]
fn dims_q4_k_m() {
    let d = dims();
    check(&d, "model-q4_k_m.gguf", "q4_k_m", KvType::Auto);
}

#[test]
fn dims_upstream() {
    let d = dims();
    check(&d, "", "bf16", KvType::Auto);
}
