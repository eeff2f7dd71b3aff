//! `lathe selftest` and the `--matmul` choice through the binary, on whatever adapter the machine
//! has (lavapipe in CI: the tiled and matvec paths; the cooperative-matrix path is checked by
//! running the same command on a GPU that has it).

use std::path::Path;
use std::process::Command;

fn lathe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_lathe"))
        .args(args)
        .output()
        .expect("run lathe")
}

#[test]
fn selftest_runs_every_check_and_summarises() {
    let out = lathe(&["selftest"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "selftest failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    let last = lines.last().expect("selftest printed nothing");
    let (passed, failed) = last
        .split_once(" passed, ")
        .and_then(|(p, f)| {
            Some((
                p.parse::<usize>().ok()?,
                f.strip_suffix(" failed")?.parse::<usize>().ok()?,
            ))
        })
        .unwrap_or_else(|| panic!("last line is not `N passed, M failed`: {last}"));
    assert_eq!(failed, 0);
    assert!(passed >= 40, "only {passed} checks");
    // one line per check before the summary, every one passing
    assert_eq!(lines.len(), passed + 1);
    assert!(lines[..passed].iter().all(|l| l.starts_with("ok ")));
    for path in ["matvec", "tiled", "int8", "int8x2"] {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("ok   {path} "))),
            "no {path} check"
        );
    }
    // the fused decode kernels and the int8-activation matvec
    for what in [
        "matvec rms_norm ",
        "matvec rms_norm keep ",
        "matvec swiglu ",
        "matvec swiglu gated ",
        "matvec sigmoid gate ",
        "matvec conv step ",
        "matvec int8-x ",
        "matvec indexed int8-x ",
        "qk_norm_rope ",
        "gdn recurrent + gated norm ",
    ] {
        assert!(lines.iter().any(|l| l.contains(what)), "no `{what}` check");
    }
}

#[test]
fn selftest_json_counts_match() {
    let out = lathe(&["selftest", "--json", "--matmul", "tiled"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let checks = v["checks"].as_array().expect("checks");
    assert_eq!(v["failed"], 0);
    assert_eq!(v["passed"].as_u64().unwrap() as usize, checks.len());
    assert_eq!(v["matmul"], "tiled");
    assert!(checks
        .iter()
        .all(|c| c["passed"] == true && c["worst"].as_f64().unwrap() <= 1.0));
}

#[test]
fn matmul_flag_is_checked_and_reported() {
    let out = lathe(&["selftest", "--matmul", "fast"]);
    assert_eq!(out.status.code(), Some(2), "clap rejects an unknown path");
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("auto, coop, coop-split, coop-xsplit, coop-splitx, tiled, int8 or int8x2"));

    let model = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models/qwen35-tiny/model-q8_0.gguf");
    let model = model.to_str().unwrap();
    let devices = String::from_utf8_lossy(&lathe(&["devices"]).stdout).to_string();
    assert!(devices.contains("matmul: tiled"), "{devices}");
    if !devices.contains(", coop") {
        // an adapter without cooperative matrices refuses the forced path with the reason
        let out = lathe(&[
            "bench", "-m", model, "-p", "40", "-n", "0", "-r", "1", "--matmul", "coop",
        ]);
        assert_eq!(out.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&out.stderr).contains("no cooperative-matrix path"));
        for path in ["coop-split", "coop-xsplit", "coop-splitx"] {
            let out = lathe(&[
                "bench", "-m", model, "-p", "40", "-n", "0", "-r", "1", "--matmul", path,
            ]);
            assert_eq!(out.status.code(), Some(1));
            let err = String::from_utf8_lossy(&out.stderr).to_string();
            assert!(err.contains(&format!("--matmul {path}:")), "{err}");
        }
    }
    // bench names the path its prefill ran (40 tokens: past the matvec batch size)
    let out = lathe(&[
        "bench", "-m", model, "-p", "40", "-n", "0", "-r", "1", "--json", "--matmul", "tiled",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench JSON");
    assert_eq!(v["matmul"], "tiled");
    // the int8 paths run on every adapter; a Q8_0 file's products take them
    for path in ["int8", "int8x2"] {
        let out = lathe(&[
            "bench", "-m", model, "-p", "40", "-n", "0", "-r", "1", "--json", "--matmul", path,
        ]);
        assert!(out.status.success());
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench JSON");
        assert_eq!(v["matmul"], path);
    }
}

/// `--matmul auto` takes less rounding for the models that pick a top-k from computed values
/// (MoE routers, DeepSeek-V4's indexer: f32-level products) and no others.
#[test]
fn models_that_route_on_values_are_known() {
    use lathe::gpu::AutoProducts::{Any, F32};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
    for (model, auto) in [
        ("qwen35-tiny/model-q8_0.gguf", Any),
        ("qwen35-dims/model-q4_k_m.gguf", Any),
        ("qwen35moe-tiny/model-q8_0.gguf", F32),
        ("qwen3next-tiny/model-q8_0.gguf", F32),
        ("dsv4-tiny/model-q4_0.gguf", F32),
    ] {
        let f = lathe::model_file::ModelFile::open(dir.join(model)).expect(model);
        assert_eq!(lathe::models::auto_products(&f), auto, "{model}");
    }
}
