//! DeepSeek-V4 CPU reference forward against the fixtures' reference logits (DeepSeek's
//! model.py math in f32, computed by transformers), from both formats: llama.cpp's GGUF and
//! DeepSeek's release layout (`upstream/`). FP8 e4m3 block-scaled linears, as the releases
//! store them: tests/deepseek4_fp8.rs.
//!
//! dsv4-tiny lives in tests/fixtures/models (copied from ../shared/fixtures/models); the
//! dsv4-dims tests are `#[ignore]` (slow on the CPU) and read ../shared, failing with a
//! note when it is absent: `cargo test --release --test deepseek4_cpu -- --ignored`.

mod common;
use common::*;
use lathe::models::deepseek4::cpu::{CpuModel, CpuSeq};
use lathe::models::deepseek4::Hparams;
use lathe::models::ModelFile;
use std::path::{Path, PathBuf};

fn tiny() -> PathBuf {
    fixtures().join("dsv4-tiny")
}

/// ../shared/fixtures/models/<name>; the test fails when this checkout lacks it.
fn shared(name: &str) -> PathBuf {
    require_shared(name)
}

fn tokens(dir: &Path) -> Vec<u32> {
    let t = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    t.data.iter().map(|&v| v as u32).collect()
}

fn load(path: &Path) -> CpuModel {
    let f = ModelFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    CpuModel::load(&f).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Logits of every position, [T, vocab] flattened, from one sequence fed token by token.
fn run(m: &CpuModel, seq: &mut CpuSeq, toks: &[u32]) -> Vec<f32> {
    toks.iter().flat_map(|&t| m.step(seq, t).unwrap()).collect()
}

/// One model file (GGUF or upstream dir) against a reference .npy, with the fixture bar.
fn check(dir: &Path, file: &str, reference: &str, cap: Option<f64>) -> Vec<f32> {
    let m = load(&dir.join(file));
    let toks = tokens(dir);
    let got = run(&m, &mut m.new_seq(), &toks);
    let want = lathe::npy::read_f32(dir.join(reference)).unwrap();
    let s = score(&got, &want.data, m.hp.n_vocab);
    let name = dir.file_name().unwrap().to_string_lossy();
    assert_bar(&format!("{name}/{file} vs {reference}"), &s, cap);
    got
}

#[test]
fn tiny_hparams_from_both_formats() {
    let g = Hparams::from_file(&ModelFile::open(tiny().join("model-f32.gguf")).unwrap()).unwrap();
    let u = Hparams::from_file(&ModelFile::open(tiny().join("upstream")).unwrap()).unwrap();
    for hp in [&g, &u] {
        assert_eq!(
            (
                hp.n_layer,
                hp.n_embd,
                hp.n_vocab,
                hp.n_head,
                hp.head_dim,
                hp.n_rot
            ),
            (4, 64, 512, 4, 32, 8)
        );
        assert_eq!(
            (hp.q_lora, hp.o_groups, hp.o_lora, hp.window),
            (32, 2, 16, 8)
        );
        assert_eq!(hp.compress_ratio, vec![0, 4, 128, 4]);
        assert_eq!((hp.n_ix_head, hp.ix_head_dim, hp.ix_topk), (8, 16, 2));
        assert_eq!((hp.hc, hp.hc_iters), (4, 20));
        assert_eq!(
            (
                hp.n_expert,
                hp.n_used,
                hp.n_ff_exp,
                hp.n_ff_shexp,
                hp.n_hash_layers
            ),
            (8, 2, 32, 32, 1)
        );
        assert_eq!(
            (hp.rope_theta, hp.compress_rope_theta, hp.route_scale),
            (10000.0, 160000.0, 1.5)
        );
        assert!(hp.yarn.is_none() && hp.norm_topk);
        assert_eq!(hp.swiglu_limit, vec![10.0; 4]);
        assert_eq!(hp.swiglu_limit_shexp, vec![10.0; 4]);
    }
}

#[test]
fn tiny_gguf_f32_and_upstream() {
    let g = check(&tiny(), "model-f32.gguf", "logits.npy", None);
    let u = check(&tiny(), "upstream", "logits.npy", None);
    // Same values in both files (experts exactly MXFP4 in both): the same logits.
    let s = score(&g, &u, 512);
    eprintln!("dsv4-tiny gguf vs upstream: max_abs {:.3e}", s.max_abs);
    assert!(
        s.max_abs <= 1e-5,
        "GGUF and upstream loads disagree by {:.3e}",
        s.max_abs
    );
}

#[test]
fn tiny_gguf_q8_0() {
    check(&tiny(), "model-q8_0.gguf", "ref-q8_0.npy", None);
}

/// A sequence's state is all decode needs: a clone taken after any prefix continues exactly
/// as the original does, and an unrelated sequence run in between changes nothing.
#[test]
fn tiny_state_forks_at_any_prefix() {
    let m = load(&tiny().join("model-f32.gguf"));
    let toks = tokens(&tiny());
    let toks = &toks[..40];
    let full = run(&m, &mut m.new_seq(), toks);
    let v = m.hp.n_vocab;
    for cut in [1, 3, 4, 8, 9, 17, 33] {
        let mut a = m.new_seq();
        run(&m, &mut a, &toks[..cut]);
        let mut fork = a.clone();
        let mut other = m.new_seq();
        run(&m, &mut other, &toks[cut..]);
        assert_eq!(fork.pos(), cut);
        let rest = run(&m, &mut fork, &toks[cut..]);
        assert_eq!(rest, full[cut * v..], "fork at {cut} diverged");
    }
}

#[test]
fn bad_input_is_an_error() {
    let m = load(&tiny().join("model-f32.gguf"));
    let err = m.step(&mut m.new_seq(), 512).unwrap_err();
    assert!(err.to_string().contains("512"), "{err}");
    // A Qwen checkpoint is not a DeepSeek-V4 model.
    let qwen = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/qwen35-tiny");
    let err = Hparams::from_file(&ModelFile::open(&qwen).unwrap()).unwrap_err();
    assert!(err.to_string().contains("not DeepSeek-V4"), "{err}");
}

// ---------------------------------------------------------------- dsv4-dims (slow)

#[test]
#[ignore = "slow: real head sizes, 300 tokens"]
fn dims_bf16_gguf() {
    let d = shared("dsv4-dims");
    check(
        &d,
        "model-bf16.gguf",
        "logits.npy",
        llamacpp_rms("dsv4-dims", "bf16"),
    );
}

#[test]
#[ignore = "slow: real head sizes, 300 tokens"]
fn dims_upstream() {
    let d = shared("dsv4-dims");
    check(
        &d,
        "upstream",
        "logits.npy",
        llamacpp_rms("dsv4-dims", "bf16"),
    );
}

#[test]
#[ignore = "slow: real head sizes, 300 tokens"]
fn dims_q8_0() {
    let d = shared("dsv4-dims");
    check(
        &d,
        "model-q8_0.gguf",
        "ref-q8_0.npy",
        llamacpp_rms("dsv4-dims", "q8_0"),
    );
}

#[test]
#[ignore = "slow: real head sizes, 300 tokens"]
fn dims_q4_k_m() {
    let d = shared("dsv4-dims");
    check(
        &d,
        "model-q4_k_m.gguf",
        "ref-q4_k_m.npy",
        llamacpp_rms("dsv4-dims", "q4_k_m"),
    );
}

/// Debug runner: per-position RMS error of a model file against its reference, with the
/// layer-0 attention input norm (trace hook), to localise where a mismatch starts.
#[test]
#[ignore = "debug runner"]
fn debug_errors_per_position() {
    let dir = tiny();
    let m = load(&dir.join("model-f32.gguf"));
    let want = lathe::npy::read_f32(dir.join("logits.npy")).unwrap();
    let v = m.hp.n_vocab;
    let mut seq = m.new_seq();
    for (p, &t) in tokens(&dir).iter().enumerate() {
        let mut l0 = 0f32;
        let got = m
            .step_traced(&mut seq, t, &mut |name, l, d| {
                if name == "attn_in" && l == 0 {
                    l0 = d.iter().map(|x| x * x).sum::<f32>().sqrt();
                }
            })
            .unwrap();
        let s = score(&got, &want.data[p * v..(p + 1) * v], v);
        eprintln!(
            "pos {p:3}: rms {:.3e} max {:.3e} |attn_in[0]| {l0:.4}",
            s.rms, s.max_abs
        );
    }
}
