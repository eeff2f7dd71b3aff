//! The library's front door: load a model by path with typed options, run tokens.

use crate::gpu::{AdapterChoice, Gpu};
use crate::models::ModelFile;
use crate::{Error, Result};
use std::path::Path;
use std::sync::Arc;

/// Element type of the attention KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvType {
    #[default]
    F16,
    F32,
}

impl std::str::FromStr for KvType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Ok(KvType::F16),
            "f32" => Ok(KvType::F32),
            _ => Err(Error::Invalid(format!(
                "--kv-type {s}: expected f16 or f32"
            ))),
        }
    }
}

/// How to load and run a model. Defaults are what most users want.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub adapter: AdapterChoice,
    pub kv_type: KvType,
    /// Context length the caches are sized for (they grow beyond it when needed).
    pub ctx: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            adapter: AdapterChoice::Auto,
            kv_type: KvType::F16,
            ctx: 4096,
        }
    }
}

/// Logits for every position of `tokens`: the first `prefill` tokens as one batch, the rest
/// one per step through the decode path. Returns `(logits [T·vocab], vocab)`.
pub fn logits(
    path: &Path,
    tokens: &[u32],
    prefill: usize,
    opts: &LoadOptions,
) -> Result<(Vec<f32>, usize)> {
    let file = ModelFile::open(path)?;
    let arch = file.architecture()?;
    match arch.as_str() {
        "qwen35"
        | "qwen35moe"
        | "qwen3next"
        | "Qwen3_5ForCausalLM"
        | "Qwen3_5MoeForCausalLM"
        | "Qwen3NextForCausalLM"
        | "Qwen3_5ForConditionalGeneration"
        | "Qwen3_5MoeForConditionalGeneration" => {
            let gpu = Arc::new(Gpu::new(&opts.adapter)?);
            eprintln!("{}", gpu.report());
            let mut m = crate::models::qwen35::gpu::GpuModel::load(gpu, &file, opts)?;
            let v = m.hp.n_vocab;
            let mut seq = m.new_seq()?;
            let prefill = prefill.min(tokens.len());
            let mut out = Vec::with_capacity(tokens.len() * v);
            if prefill > 0 {
                out.extend(m.forward(&mut seq, &tokens[..prefill], true)?);
            }
            for t in &tokens[prefill..] {
                out.extend(m.forward(&mut seq, std::slice::from_ref(t), true)?);
            }
            Ok((out, v))
        }
        a => Err(Error::Unsupported(format!(
            "{}: architecture {a}",
            path.display()
        ))),
    }
}
