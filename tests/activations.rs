//! `--activations int8` against the fixture bar (../shared/fixtures/README.md, "What matching
//! means") on every model file committed under tests/fixtures/models: every token runs
//! through the decode path (a prefill of one token, then one token per step), so every
//! one-token product of a type with an int8 kernel takes int8 activations.
//!
//! Where int8 misses the bar, `--activations auto` must keep f32 and meet it. Measured on
//! lavapipe: every quantized file misses it with int8 (qwen35-dims Q4_K_M RMS 0.066, top-1
//! 0.875; qwen35-tiny Q4_0 0.031), float files take no int8 products and meet it, so `auto`
//! is f32.

mod common;
use common::*;
use lathe::engine::{logits, ActivationsChoice, LoadOptions};
use std::path::{Path, PathBuf};

/// Every model file of the committed fixture `name`: (path, manifest type).
fn files(name: &str) -> Vec<(PathBuf, String)> {
    let dir = fixtures().join(name);
    let mut v: Vec<(PathBuf, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|f| {
            let ty = f.strip_prefix("model-")?.strip_suffix(".gguf")?.to_string();
            Some((dir.join(&f), ty))
        })
        .collect();
    v.sort();
    // Hugging Face checkpoints: the fixture's own directory, or DeepSeek's `upstream/`.
    let float = if name.ends_with("dims") {
        "bf16"
    } else {
        "f32"
    };
    if dir.join("model.safetensors").exists() {
        v.push((dir.clone(), float.into()));
    } else if dir.join("upstream").is_dir() {
        v.push((dir.join("upstream"), float.into()));
    }
    assert!(!v.is_empty(), "{}: no model files", dir.display());
    v
}

fn reference(dir: &Path, path: &Path) -> Vec<f32> {
    let f = path.file_name().unwrap().to_string_lossy();
    let f = if f.ends_with(".gguf") { &f[..] } else { "" };
    lathe::npy::read_f32(reference_for(dir, f)).unwrap().data
}

/// Scores every file of `name` decoded token by token with `act`.
fn run(name: &str, act: ActivationsChoice) -> Vec<(String, Score, Option<f64>)> {
    let opts = LoadOptions {
        activations: act,
        ..Default::default()
    };
    run_with(name, &opts, &format!("activations {act:?}"))
}

/// Scores every file of `name` decoded token by token with `opts`.
fn run_with(name: &str, opts: &LoadOptions, what: &str) -> Vec<(String, Score, Option<f64>)> {
    let dir = fixtures().join(name);
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
    files(name)
        .into_iter()
        .map(|(path, ty)| {
            let (got, vocab) =
                logits(&path, &ids, 1, opts).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let s = score(&got, &reference(&dir, &path), vocab);
            let label = format!(
                "{name}/{} {what}",
                path.file_name().unwrap().to_string_lossy()
            );
            (label, s, llamacpp_rms(name, &ty))
        })
        .collect()
}

/// The fixture bar (`common::assert_bar`) as a yes or no.
fn meets(s: &Score, llama: Option<f64>) -> bool {
    s.rms <= llama.unwrap_or(0.001).clamp(0.001, 0.02) && s.top1 >= 0.95
}

/// int8 on every file; where it misses the bar, `auto` must keep f32 and meet it.
fn check(name: &str) {
    let mut missed = false;
    for (label, s, llama) in run(name, ActivationsChoice::Int8) {
        let ok = meets(&s, llama);
        let cap = llama.unwrap_or(0.001).clamp(0.001, 0.02);
        eprintln!(
            "{label}: rms {:.3e} max_abs {:.3e} top1 {:.3} (bar rms ≤ {cap:.3e}): {}",
            s.rms,
            s.max_abs,
            s.top1,
            if ok {
                "meets the bar"
            } else {
                "misses the bar"
            }
        );
        missed |= !ok;
    }
    if missed {
        assert!(
            !ActivationsChoice::Auto.int8(),
            "{name}: int8 misses the bar, so auto must keep f32"
        );
        for (label, s, llama) in run(name, ActivationsChoice::Auto) {
            assert_bar(&label, &s, llama);
        }
    }
}

#[test]
fn qwen35_tiny() {
    check("qwen35-tiny");
}
#[test]
fn qwen35_dims() {
    check("qwen35-dims");
}
#[test]
fn qwen35moe_tiny() {
    check("qwen35moe-tiny");
}
#[test]
fn qwen35moe_dims() {
    check("qwen35moe-dims");
}
#[test]
fn qwen3next_tiny() {
    check("qwen3next-tiny");
}
#[test]
fn dsv4_tiny() {
    check("dsv4-tiny");
}

/// The fused activation loads (`--fused-loads on`: RMSNorm with Σx² from the product's own
/// loads, SwiGLU, the gates and the conv step in the products) meet the bar on every Qwen3.5
/// family file, every token through the decode path.
#[test]
fn fused_loads_meet_the_bar() {
    let opts = LoadOptions {
        fused_loads: true,
        ..Default::default()
    };
    for name in [
        "qwen35-tiny",
        "qwen35-dims",
        "qwen35moe-tiny",
        "qwen35moe-dims",
        "qwen3next-tiny",
    ] {
        for (label, s, llama) in run_with(name, &opts, "fused loads") {
            assert_bar(&label, &s, llama);
        }
    }
}

/// `--activations` and `--fused-loads` reach the model (`lathe bench --json` reports what ran)
/// and bad values are refused with the flag named.
#[test]
fn flags_reach_the_bench_report() {
    let model = fixtures().join("qwen35-tiny/model-q8_0.gguf");
    let bench = |extra: &[&str]| {
        let mut args = vec!["bench", "-m", model.to_str().unwrap()];
        args.extend(["-p", "0", "-n", "2", "-r", "1", "--json"]);
        args.extend(extra);
        std::process::Command::new(env!("CARGO_BIN_EXE_lathe"))
            .args(&args)
            .output()
            .unwrap()
    };
    for (extra, act, fused) in [
        (&[][..], "f32", false),
        (
            &["--activations", "int8", "--fused-loads", "on"][..],
            "int8",
            true,
        ),
        (
            &["--activations", "f32", "--fused-loads", "off"][..],
            "f32",
            false,
        ),
    ] {
        let out = bench(extra);
        assert!(
            out.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["activations"], act, "{extra:?}");
        assert_eq!(v["fused_loads"], fused, "{extra:?}");
    }
    for (flag, bad) in [("--activations", "int4"), ("--fused-loads", "yes")] {
        let out = bench(&[flag, bad]);
        assert!(!out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(bad),
            "{flag} {bad}"
        );
    }
}
