//! Qwen3.5-family fixtures through `lathe::engine::logits` (the `lathe logits` path): every
//! file of every model against its reference, in one batch and with `--prefill T-4`.

mod common;
use common::*;
use lathe::engine::{logits, LoadOptions};

fn check_model(name: &str) {
    check_model_with(name, &LoadOptions::default());
}

fn check_model_with(name: &str, opts: &LoadOptions) {
    let (dir, files) = model_files(name);
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
    let t = ids.len();
    for f in files {
        let path = if f.is_empty() {
            dir.clone()
        } else {
            dir.join(&f)
        };
        let refp = reference_for(&dir, &f);
        let want = lathe::npy::read_f32(&refp).unwrap();
        let ty = f
            .strip_prefix("model-")
            .and_then(|s| s.strip_suffix(".gguf"))
            .unwrap_or(if name.ends_with("dims") {
                "bf16"
            } else {
                "f32"
            });
        for prefill in [t, t - 4] {
            let (got, vocab) = logits(&path, &ids, prefill, opts).unwrap();
            let s = score(&got, &want.data, vocab);
            let label = format!(
                "{name}/{} prefill {prefill} matmul {:?}",
                if f.is_empty() { "hf" } else { &f },
                opts.matmul
            );
            assert_bar(&label, &s, llamacpp_rms(name, ty));
        }
    }
}

#[test]
fn qwen35_tiny() {
    check_model("qwen35-tiny");
}
#[test]
fn qwen35moe_tiny() {
    check_model("qwen35moe-tiny");
}
#[test]
fn qwen3next_tiny() {
    check_model("qwen3next-tiny");
}
#[test]
fn qwen35_dims() {
    check_model("qwen35-dims");
}
#[test]
fn qwen35moe_dims() {
    check_model("qwen35moe-dims");
}

/// The two-level int8 path (`--matmul int8x2`, `auto` on adapters without matrix units for the
/// dense models) keeps every bar. Only the `dims` fixtures (48 tokens) have products above the
/// matvec range.
#[test]
fn dims_int8x2_matmul() {
    let opts = LoadOptions {
        matmul: lathe::gpu::MatmulChoice::Int8x2,
        ..Default::default()
    };
    check_model_with("qwen35-dims", &opts);
    check_model_with("qwen35moe-dims", &opts);
}
