//! Dispatches of a Qwen3.5 decode step (`Engine::profile_step` lists every one): each set of
//! products over one input (`weights::Layer`'s sets) runs as one product per stored type.
//!
//! `LATHE_DISPATCH_FILE=model.gguf cargo test --test qwen35_dispatch -- --ignored --nocapture`
//! prints the count for any file (e.g. `lathe synth --preset qwen3.5-9b --layers 4`), with
//! what the same step took when every product was its own dispatch.

mod common;
use common::*;
use lathe::engine::{Engine, LoadOptions};
use lathe::models::qwen35::weights::{self, Sink};
use lathe::models::qwen35::Hparams;
use lathe::models::{ModelFile, Weight};
use lathe::synth::{self, Dims, FileType, PlanOptions, Preset, QwenDims};
use lathe::Result;
use std::path::Path;

/// Records each set's members (name, stored type); single weights are ignored.
#[derive(Default)]
struct Sets(Vec<Vec<(String, lathe::DType)>>);

impl Sink for Sets {
    type T = ();
    type Set = ();
    fn one(&mut self, _: Weight<'_>) -> Result<()> {
        Ok(())
    }
    fn set(&mut self, ws: Vec<Weight<'_>>) -> Result<(Vec<()>, Option<()>)> {
        self.0.push(
            ws.iter()
                .map(|w| (w.name().to_string(), w.dtype()))
                .collect(),
        );
        Ok((vec![(); ws.len()], None))
    }
}

fn sets(path: &Path) -> Vec<Vec<(String, lathe::DType)>> {
    let f = ModelFile::open(path).unwrap();
    let hp = Hparams::from_file(&f).unwrap();
    let mut s = Sets::default();
    weights::load_sets(&f, &hp, &mut s).unwrap();
    s.0
}

/// The labels of a decode step's dispatches; `fused_loads` `None`: the default load options.
fn step_labels(path: &Path, fused_loads: Option<bool>) -> Vec<String> {
    let mut opts = LoadOptions::default();
    if let Some(f) = fused_loads {
        opts.fused_loads = f;
    }
    let mut e = Engine::load(path, &opts).unwrap();
    let mut s = e.new_seq().unwrap();
    e.forward(&mut s, &[1, 2, 3], false).unwrap();
    let prof = e.profile_step(&mut s, 4).unwrap();
    prof.into_iter().map(|(l, _)| l).collect()
}

/// Checks that every set ran as one dispatch per stored type, each member in exactly one;
/// returns the dispatches the sets saved (members minus groups).
fn check_sets(what: &str, labels: &[String], sets: &[Vec<(String, lathe::DType)>]) -> usize {
    let mut saved = 0;
    for set in sets {
        // Dispatches whose label starts with a member's name; a group's label is its first
        // member's name followed by "+member" for each other one.
        let runs: Vec<&String> = labels
            .iter()
            .filter(|l| {
                let head = l.split('+').next().unwrap_or("");
                set.iter().any(|(n, _)| n == head)
            })
            .collect();
        let mut types: Vec<_> = set.iter().map(|m| m.1).collect();
        types.sort_by_key(|t| t.name());
        types.dedup();
        let members: usize = runs.iter().map(|l| l.split('+').count()).sum();
        assert_eq!(
            (runs.len(), members),
            (types.len(), set.len()),
            "{what}: set {:?} ran as {runs:?}",
            set.iter().map(|m| &m.0).collect::<Vec<_>>()
        );
        saved += set.len() - runs.len();
    }
    saved
}

#[test]
fn sets_run_as_one_product_per_type() {
    for name in [
        "qwen35-tiny",
        "qwen35moe-tiny",
        "qwen3next-tiny",
        "qwen35-dims",
        "qwen35moe-dims",
    ] {
        let (dir, files) = model_files(name);
        for f in files {
            let path = if f.is_empty() {
                dir.clone()
            } else {
                dir.join(&f)
            };
            let what = format!("{name}/{}", if f.is_empty() { "hf" } else { &f });
            let labels = step_labels(&path, Some(false));
            let saved = check_sets(&what, &labels, &sets(&path));
            assert!(saved > 0, "{what}: no set saved a dispatch");
            eprintln!(
                "{what}: {} dispatches per decode step ({} with one per product)",
                labels.len(),
                labels.len() + saved
            );
        }
    }
}

#[test]
#[ignore = "needs LATHE_DISPATCH_FILE"]
fn report_file() {
    let path = std::env::var("LATHE_DISPATCH_FILE").expect("LATHE_DISPATCH_FILE");
    let path = Path::new(&path);
    let labels = step_labels(path, None);
    let sets = sets(path);
    let saved = check_sets(&path.display().to_string(), &labels, &sets);
    for l in &labels {
        eprintln!("  {l}");
    }
    eprintln!(
        "{}: {} dispatches per decode step ({} with one per product)",
        path.display(),
        labels.len(),
        labels.len() + saved
    );
}

/// Qwen3.5-9B's layer pattern and head counts (3 GDN layers then one attention layer; 16 q /
/// 4 kv heads of 256, GDN 16 k / 32 v heads of 128, Q4_K_M with its Q6_K layers) at a width of
/// 256: a decode step's dispatches per layer do not depend on the width.
fn nine_b_pattern(n_layer: usize) -> Preset {
    Preset {
        name: "qwen35-9b-pattern".into(),
        display: "Qwen35 9B pattern".into(),
        dims: Dims::Qwen35(QwenDims {
            n_embd: 256,
            n_layer,
            n_ff: 768,
            n_head: 16,
            n_head_kv: 4,
            head_dim: 256,
            rope_dim: 64,
            n_k_heads: 16,
            n_v_heads: 32,
            d_k: 128,
            d_v: 128,
            conv_kernel: 4,
            full_attention_interval: 4,
            n_vocab: 1024,
            tied: false,
            ctx: 4096,
            rope_theta: 1e7,
            eps: 1e-6,
            moe: None,
        }),
        default_type: FileType::Q4_K_M,
        demo: false,
    }
}

/// Issue #14's measure: (dispatches of a decode step with 8 layers − with 4 layers) / 4, as
/// `lathe bench -p 0 -n 2 --json` counts them (one per recorded dispatch) between
/// `lathe synth --preset qwen3.5-9b --layers 8` and `--layers 4`. By default (fused activation
/// loads, `LoadOptions::fused_loads`) decode stays at ≤ 6 dispatches per layer (12.5 before
/// the fused kernels); with them off the norms are their own kernels, while the GDN conv step
/// still joins the qkv product's store and SwiGLU the gate+up product's (7.75).
#[test]
fn nine_b_decode_dispatches_per_layer() {
    let dir = std::env::temp_dir().join(format!("lathe-dispatch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut count = Vec::new();
    for (n_layer, fused) in [(4, None), (8, None), (4, Some(false)), (8, Some(false))] {
        let path = dir.join(format!("l{n_layer}.gguf"));
        synth::plan(&nine_b_pattern(n_layer), &PlanOptions::default(), None)
            .unwrap()
            .write(&path, 7, None)
            .unwrap();
        let labels = step_labels(&path, fused);
        count.push(labels.len());
        if n_layer == 8 && fused.is_none() {
            for l in &labels {
                eprintln!("  {l}");
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    let per_layer = (count[1] - count[0]) as f64 / 4.0;
    let unfused = (count[3] - count[2]) as f64 / 4.0;
    eprintln!("decode dispatches: {count:?}, {per_layer} per layer ({unfused} unfused)");
    assert!(per_layer <= 6.0, "{per_layer} dispatches per layer");
    assert!(
        unfused > per_layer && unfused <= 7.75,
        "{unfused} unfused against {per_layer} fused"
    );
}

/// Bind groups are made once per (call site, buffers): a decode step after the first makes
/// none (it reuses the cached groups over the uniform arena), on every Qwen3.5 fixture family.
#[test]
fn decode_steps_reuse_bind_groups() {
    for name in ["qwen35-tiny", "qwen35moe-tiny", "qwen3next-tiny"] {
        let (dir, files) = model_files(name);
        let path = dir.join(files.iter().find(|f| !f.is_empty()).expect("a GGUF file"));
        let mut e = Engine::load(&path, &LoadOptions::default()).unwrap();
        let mut s = e.new_seq().unwrap();
        e.forward(&mut s, &[1, 2, 3], false).unwrap();
        e.forward(&mut s, &[4], false).unwrap();
        let made = e.gpu.bind_groups_made();
        for t in 5..9 {
            e.forward(&mut s, &[t], false).unwrap();
        }
        assert_eq!(
            e.gpu.bind_groups_made(),
            made,
            "{name}: decode steps made new bind groups"
        );
    }
}
