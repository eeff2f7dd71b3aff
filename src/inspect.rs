//! `lathe inspect`: what a model file holds, and what a decode step reads.

use crate::model_file::ModelFile;
use crate::{DType, Result};
use std::collections::BTreeMap;
use std::fmt::Write;

/// Routed-expert tensors: read `n_used / n_expert` of their bytes per decode step.
fn is_expert(name: &str) -> bool {
    name.contains("_exps") || name.contains(".experts.")
}

fn expert_counts(f: &ModelFile) -> Option<(u64, u64)> {
    match f {
        ModelFile::Gguf(g) => {
            let arch = g.architecture().ok()?;
            let n = g.opt_u64(&format!("{arch}.expert_count")).ok()??;
            let k = g.opt_u64(&format!("{arch}.expert_used_count")).ok()??;
            Some((k, n))
        }
        ModelFile::Hf(h) => {
            let n = h
                .cfg_opt_u64("num_experts")
                .ok()?
                .or(h.cfg_opt_u64("n_routed_experts").ok()?)?;
            let k = h
                .cfg_opt_u64("num_experts_per_tok")
                .ok()?
                .or(h.cfg_opt_u64("n_activated_experts").ok()?)?;
            Some((k, n))
        }
    }
}

/// Bytes a decode step reads: every weight once, except the embedding table (one row)
/// unless it doubles as the output head, and routed experts (`n_used / n_expert`).
pub fn decode_bytes(f: &ModelFile) -> u64 {
    let (k, n) = expert_counts(f).unwrap_or((1, 1));
    let tied = f.tensor("output.weight").is_none()
        && f.tensor("lm_head.weight").is_none()
        && f.tensor("head.weight").is_none();
    let mut total = 0u64;
    for t in f.tensors() {
        let mut b = t.data.len() as u64;
        if t.dtype == DType::F8_E4M3 {
            // read as F8_E4M3_B128: 132 bytes per 128 weights (the f32 block scale beside them)
            b = b / 128 * 132;
        }
        let emb = matches!(
            t.name,
            "token_embd.weight" | "model.embed_tokens.weight" | "embed.weight"
        );
        total += if emb && !tied {
            b / t.shape.first().copied().unwrap_or(1).max(1)
        } else if is_expert(t.name) {
            b * k / n.max(1)
        } else {
            b
        };
    }
    total
}

pub fn human_bytes(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", U[i])
    }
}

/// The full report printed by `lathe inspect` (stdout: it is the command's output).
pub fn report(f: &ModelFile) -> Result<String> {
    let mut s = String::new();
    let arch = f.architecture()?;
    writeln!(s, "file: {}", f.path().display()).ok();
    writeln!(s, "architecture: {arch}").ok();
    match f {
        ModelFile::Gguf(g) => {
            writeln!(
                s,
                "format: GGUF v{} ({} tensors, alignment {})",
                g.version(),
                g.n_tensors(),
                g.alignment()
            )
            .ok();
            let tok = g
                .opt_str("tokenizer.ggml.model")
                .ok()
                .flatten()
                .unwrap_or("(none)");
            let pre = g
                .opt_str("tokenizer.ggml.pre")
                .ok()
                .flatten()
                .unwrap_or("-");
            writeln!(s, "tokenizer: {tok} (pre {pre})").ok();
            writeln!(s, "hyper-parameters:").ok();
            for (k, v) in g.metadata() {
                if k.starts_with(&format!("{arch}.")) || k.starts_with("general.") {
                    writeln!(s, "  {k} = {}", v.describe()).ok();
                }
            }
        }
        ModelFile::Hf(h) => {
            writeln!(
                s,
                "format: Hugging Face safetensors ({} files, {} tensors)",
                h.files().len(),
                h.len()
            )
            .ok();
            let tj = h.dir().join("tokenizer.json");
            writeln!(
                s,
                "tokenizer: {}",
                if tj.exists() {
                    "tokenizer.json"
                } else {
                    "(none)"
                }
            )
            .ok();
            writeln!(s, "config:").ok();
            if let Some(obj) = h.config().as_object() {
                for (k, v) in obj {
                    if !v.is_object() {
                        writeln!(s, "  {k} = {v}").ok();
                    }
                }
            }
        }
    }
    writeln!(s, "tensors:").ok();
    writeln!(
        s,
        "  {:<48} {:<8} {:<22} {:>12}",
        "name", "type", "shape", "bytes"
    )
    .ok();
    let mut by_type: BTreeMap<DType, (u64, u64)> = BTreeMap::new();
    let mut total = 0u64;
    for t in f.tensors() {
        let b = t.data.len() as u64;
        writeln!(
            s,
            "  {:<48} {:<8} {:<22} {:>12}",
            t.name,
            t.dtype.name(),
            format!("{:?}", t.shape),
            b
        )
        .ok();
        let e = by_type.entry(t.dtype).or_default();
        e.0 += 1;
        e.1 += b;
        total += b;
    }
    writeln!(s, "totals by type:").ok();
    for (d, (n, b)) in &by_type {
        writeln!(
            s,
            "  {:<8} {:>5} tensors {:>12}",
            d.name(),
            n,
            human_bytes(*b)
        )
        .ok();
    }
    writeln!(s, "total: {} ({total} bytes)", human_bytes(total)).ok();
    let db = decode_bytes(f);
    writeln!(s, "decode step reads: {} ({db} bytes)", human_bytes(db)).ok();
    Ok(s)
}
