//! `--activations int8` (two int8 levels per block of 32) against the fixture bar
//! (../shared/fixtures/README.md, "What matching means") on every model file committed under
//! tests/fixtures/models: every token runs through the decode path (a prefill of one token,
//! then one token per step), with the fused loads off (every one-token product of a type with
//! an int8 kernel takes int8 activations) and on (the products reading x through a prologue
//! stay f32). `--activations auto` is f32 (int8 meets the bars but decodes slower on the
//! H200).
//!
//! Measured on lavapipe (RMS against the reference, int8 two levels / f32 / the earlier one
//! level): qwen35-dims Q4_K_M 3.5e-4 / 1.9e-4 / 6.6e-2, qwen35moe-dims Q4_K_M 4.7e-4 /
//! 4.1e-4 / 6.9e-2, qwen35-tiny Q4_0 2.8e-4 / 2.5e-4 / 3.1e-2, dsv4-tiny Q8_0 6.1e-5 /
//! 6.0e-7 / 1.1e-1; every top-1 1.000 with two levels (one level: 0.67-0.96).

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

/// Scores every file of `name` decoded token by token with `act`, with or without the fused
/// loads (without: every one-token product of an int8 type takes `act`).
fn run(name: &str, act: ActivationsChoice, fused: bool) -> Vec<(String, Score, Option<f64>)> {
    let opts = LoadOptions {
        activations: act,
        fused_loads: fused,
        ..Default::default()
    };
    run_with(name, &opts, &format!("activations {act:?} fused {fused}"))
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

/// int8 meets the bar on every file of `name`.
fn check(name: &str) {
    assert!(
        !ActivationsChoice::Auto.int8(),
        "auto keeps f32 (int8 decodes slower on the H200)"
    );
    assert!(!ActivationsChoice::F32.int8() && ActivationsChoice::Int8.int8());
    for fused in [false, true] {
        for (label, s, llama) in run(name, ActivationsChoice::Int8, fused) {
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

/// The fused decode (`--fused-loads on`, the default: the RMSNorms in the products, over the
/// residual product's x · w store where it has one, the gates, SwiGLU and the conv step in the
/// products) meets the bar on every Qwen3.5 family file, every token through the decode path.
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
    let report = |extra: &[&str]| -> serde_json::Value {
        let out = bench(extra);
        assert!(
            out.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    for (extra, act, fused) in [
        (&[][..], "f32", true),
        (&["--fused-loads", "auto"][..], "f32", true),
        (&["--fused-loads", "on"][..], "f32", true),
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
        let v = report(extra);
        assert_eq!(v["activations"], act, "{extra:?}");
        assert_eq!(v["fused_loads"], fused, "{extra:?}");
    }
    // --parallel: one batched step per token of each sequence, aggregate speed; auto fused
    // loads as `lathe serve` takes them for several sequences
    for (extra, fused) in [
        (&["--parallel", "3"][..], false),
        (&["--parallel", "3", "--fused-loads", "on"][..], true),
    ] {
        let v = report(extra);
        assert_eq!(v["parallel"], 3, "{extra:?}");
        assert_eq!(
            v["decode"]["tokens"], 6,
            "{extra:?}: 2 steps of 3 sequences"
        );
        assert_eq!(v["fused_loads"], fused, "{extra:?}");
    }
    for bad in [
        &["--parallel", "0"][..],
        &["--parallel", "2", "--moe-timeline"][..],
    ] {
        let out = bench(bad);
        assert!(!out.status.success(), "{bad:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("--parallel"),
            "{bad:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
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
