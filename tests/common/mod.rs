//! Shared fixture checks: the bar of `../shared/fixtures/README.md` ("What matching means").
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models")
}

/// `../shared/fixtures/models` beside the checkout, when this machine has it (CI does).
pub fn shared() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/models");
    p.is_dir().then_some(p)
}

/// `../shared/fixtures/models/<name>`, for tests that need a fixture kept only there: a
/// missing one fails the test with a message that says so, rather than passing unchecked.
pub fn require_shared(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures/models")
        .join(name);
    assert!(
        p.is_dir(),
        "{} is absent: this test needs ../shared/fixtures (CI has it; see ../shared/fixtures/README.md)",
        p.display()
    );
    p
}

/// The model files of fixture `name` to check: every file in `../shared` when present, else
/// the subset committed under tests/fixtures (big bf16/q8 files of the `*-dims` models stay
/// in ../shared only, to keep the repository small). Returns (directory, file names; "" for
/// the HF checkpoint directory itself).
pub fn model_files(name: &str) -> (PathBuf, Vec<String>) {
    let dir = match shared() {
        Some(s) if s.join(name).is_dir() => s.join(name),
        _ => {
            eprintln!("note: ../shared/fixtures absent: checking the committed subset of {name}");
            fixtures().join(name)
        }
    };
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".gguf"))
        .collect();
    files.sort();
    if dir.join("model.safetensors").exists() {
        files.push(String::new());
    }
    assert!(!files.is_empty(), "{}: no model files", dir.display());
    (dir, files)
}

pub struct Score {
    pub rms: f64,
    pub max_abs: f64,
    pub top1: f64,
}

pub fn score(got: &[f32], want: &[f32], vocab: usize) -> Score {
    assert_eq!(got.len(), want.len(), "logit counts differ");
    let (mut se, mut mx) = (0f64, 0f64);
    for (a, b) in got.iter().zip(want) {
        let d = (*a as f64 - *b as f64).abs();
        se += d * d;
        mx = mx.max(d);
    }
    let am = |x: &[f32]| {
        x.iter()
            .enumerate()
            .fold(0, |b, (i, y)| if *y > x[b] { i } else { b })
    };
    let rows = got.len() / vocab;
    let agree = (0..rows)
        .filter(|&r| am(&got[r * vocab..(r + 1) * vocab]) == am(&want[r * vocab..(r + 1) * vocab]))
        .count();
    Score {
        rms: (se / got.len() as f64).sqrt(),
        max_abs: mx,
        top1: agree as f64 / rows as f64,
    }
}

/// llama.cpp's RMS error on this file against the reference lathe is held to
/// (`manifest.json`): `llamacpp_vs_dequant_ref` for quantized files, `llamacpp_vs_hf` otherwise.
pub fn llamacpp_rms(model: &str, ty: &str) -> Option<f64> {
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("manifest.json")).ok()?)
            .ok()?;
    let e = &m[model]["gguf"][ty];
    e["llamacpp_vs_dequant_ref"]["rms"]
        .as_f64()
        .or(e["llamacpp_vs_hf"]["rms"].as_f64())
}

/// The reference logits file for a model file name (`model-q8_0.gguf` -> `ref-q8_0.npy`).
pub fn reference_for(dir: &Path, file: &str) -> PathBuf {
    match file
        .strip_prefix("model-")
        .and_then(|s| s.strip_suffix(".gguf"))
    {
        Some(t) if dir.join(format!("ref-{t}.npy")).exists() => dir.join(format!("ref-{t}.npy")),
        _ => dir.join("logits.npy"),
    }
}

/// The fixture bar: RMS ≤ 0.02, top-1 ≥ 95%, and RMS no larger than llama.cpp's own on the
/// same file or 0.001, whichever is larger.
pub fn assert_bar(label: &str, s: &Score, llama: Option<f64>) {
    let cap = llama.unwrap_or(0.001).clamp(0.001, 0.02);
    eprintln!(
        "{label}: rms {:.3e} max_abs {:.3e} top1 {:.3} (bar rms ≤ {cap:.3e})",
        s.rms, s.max_abs, s.top1
    );
    assert!(s.rms <= cap, "{label}: rms {:.3e} above {cap:.3e}", s.rms);
    assert!(
        s.top1 >= 0.95,
        "{label}: top-1 agreement {:.3} below 0.95",
        s.top1
    );
}

/// Three sequences fed together by `forward_batch` (prompts of different lengths in one
/// round, then decode steps of all three in one round) against each fed alone: per
/// sequence the same logits, bit for bit. `model` needs `max_seqs` ≥ 3.
pub fn check_batched_equals_lone(label: &str, model: &Path, ids: &[u32]) {
    use lathe::engine::{Engine, LoadOptions, Want};
    assert!(
        ids.len() >= 18,
        "{label}: the fixture has {} tokens",
        ids.len()
    );
    let opts = LoadOptions {
        max_seqs: 3,
        ..Default::default()
    };
    let mut e = Engine::load(model, &opts).unwrap();
    // 7 + 9 + 2 = 18 rows batched, past the per-pair products' 8 (`matvec::MAX_TOKENS`),
    // within the token-group matvec's 32 (`matmul::DENSE_MATVEC_TOKENS`) and the routed
    // experts' (`moe::EXPERT_MATVEC_ROWS`): above those, products run tiled kernels, which sum
    // in another order than matvec, so a row's bits would depend on how many rows share its
    // pass. Within them every row meets the same kernels both ways.
    let prompts = [&ids[..7], &ids[2..11], &ids[1..3]];
    // Eight decode steps each: the last ones at positions past the fixtures' sliding window
    // (8), so a decode row sees only its window's rows.
    let steps = [&ids[9..17], &ids[3..11], &ids[10..18]];
    let mut lone = Vec::new();
    for (p, s) in prompts.iter().zip(steps) {
        let mut seq = e.new_seq().unwrap();
        let mut rows = vec![e.forward(&mut seq, p, true).unwrap()];
        for t in s.chunks(1) {
            rows.push(e.forward(&mut seq, t, false).unwrap());
        }
        lone.push(rows);
    }
    let mut seqs: Vec<_> = (0..3).map(|_| e.new_seq().unwrap()).collect();
    let mut together: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 3];
    let [a, b, c] = &mut seqs[..] else {
        unreachable!("three sequences")
    };
    let r = e
        .forward_batch(&mut [
            (a, prompts[0], Want::All),
            (b, prompts[1], Want::All),
            (c, prompts[2], Want::All),
        ])
        .unwrap();
    r.into_iter()
        .zip(&mut together)
        .for_each(|(r, t)| t.push(r));
    for j in 0..8 {
        let [a, b, c] = &mut seqs[..] else {
            unreachable!("three sequences")
        };
        let r = e
            .forward_batch(&mut [
                (a, &steps[0][j..j + 1], Want::Last),
                (b, &steps[1][j..j + 1], Want::Last),
                (c, &steps[2][j..j + 1], Want::Last),
            ])
            .unwrap();
        r.into_iter()
            .zip(&mut together)
            .for_each(|(r, t)| t.push(r));
    }
    for (i, (l, t)) in lone.iter().zip(&together).enumerate() {
        for (round, (lr, tr)) in l.iter().zip(t).enumerate() {
            assert_eq!(lr.len(), tr.len(), "{label}: sequence {i} round {round}");
            let same = lr.iter().zip(tr).all(|(x, y)| x.to_bits() == y.to_bits());
            let worst = lr
                .iter()
                .zip(tr)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(
                same,
                "{label}: sequence {i} round {round} batched differs from alone by {worst:.3e}"
            );
        }
    }
}
