//! Synthetic models: GGUF files with random but valid weights and exactly the tensor names,
//! shapes, types and metadata that llama.cpp's `convert_hf_to_gguf.py` (and, for quantized
//! file types, `llama-quantize`) write for a released architecture, so that speed can be
//! measured on any model size without downloading weights.
//!
//! [`plan`] builds the file's table of contents ([`Plan`]): per-architecture tensor lists
//! (`qwen35`, `deepseek4`) in the converter's order, the per-tensor type rules of
//! llama-quantize ([`ftype`]), and the metadata in the order the converter writes it.
//! [`Plan::write`] streams the data: random values drawn per tensor ([`Init`]), quantized
//! blocks made directly (scales from a small pool of genuinely quantized blocks, random
//! quant indices), generated in parallel while the previous chunk is written.

mod deepseek4;
mod fill;
pub mod ftype;
mod gemma4;
mod llama;
pub mod presets;
mod qwen35;
mod step37;
pub mod vocab;

pub use fill::WriteStats;
pub use ftype::FileType;
pub use presets::{
    preset, Dims, DsDims, GemmaDims, LlamaDims, Preset, QwenDims, QwenMoe, StepDims, Yarn,
    PRESET_NAMES,
};
pub use vocab::Vocab;

use crate::gguf::{keys, Value};
use crate::{DType, Error, Result};

/// How a tensor's values are drawn. Scales follow the usual initialisations so activations
/// stay of order one through many layers: weights `N(0, 1/fan_in)`, norm weights near 1
/// (stored as `1 + w` where the converter does so), decays and biases in their usual ranges.
#[derive(Clone, Debug, PartialEq)]
pub enum Init {
    /// `N(0, std²)` (approximately: a sum of four uniforms, scaled to unit variance).
    Normal { std: f32 },
    /// `mean + N(0, std²)`.
    Around { mean: f32, std: f32 },
    /// Uniform on `[lo, hi)`.
    Uniform { lo: f32, hi: f32 },
    /// `head` for the first `n` elements of a row, `tail` for the rest (Gemma-4's
    /// proportional-RoPE divisors).
    Split { n: usize, head: f32, tail: f32 },
    /// Router rows `[n_expert, n_embd]`: `N(0, std²)` times a per-expert gain
    /// `1 + skew·e^(−rank/top_k)`, `rank` a permutation seeded by `layer`. A larger row norm
    /// gives larger logits of either sign, so the expert lands in the top-k far more often.
    Router {
        std: f32,
        skew: f32,
        top_k: usize,
        layer: usize,
    },
    /// DeepSeek's selection bias `[n_expert]`: `0.5·skew·e^(−rank/top_k)` (same ranks).
    ExpertBias {
        skew: f32,
        top_k: usize,
        layer: usize,
    },
    /// DeepSeek's hash-routing table `[n_vocab, top_k]` (i32): distinct experts per token,
    /// drawn with weights `1 + skew·e^(−rank/top_k)` (same ranks).
    ExpertIds {
        n_expert: usize,
        skew: f32,
        layer: usize,
    },
}

/// One tensor of the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorPlan {
    pub name: String,
    pub dtype: DType,
    /// Outermost first.
    pub shape: Vec<u64>,
    pub init: Init,
}

impl TensorPlan {
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }
    pub fn n_bytes(&self) -> u64 {
        self.dtype
            .bytes_for(self.n_elements())
            .expect("planned shapes are whole blocks")
    }
}

/// A file's table of contents: metadata in file order and tensors in file order.
#[derive(Clone, Debug)]
pub struct Plan {
    pub arch: String,
    pub ftype: FileType,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorPlan>,
    pub n_layer: usize,
    pub n_vocab: usize,
}

impl Plan {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorPlan> {
        self.tensors.iter().find(|t| t.name == name)
    }
    /// Tensor data bytes (alignment padding excluded).
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorPlan::n_bytes).sum()
    }
    /// Bytes of routed-expert tensors (`*_exps`).
    pub fn expert_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|t| t.name.contains("_exps"))
            .map(TensorPlan::n_bytes)
            .sum()
    }
}

/// What to synthesize, besides the preset.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// None: the preset's default.
    pub ftype: Option<FileType>,
    /// Keep only the first N layers.
    pub n_layer: Option<usize>,
    /// Router popularity skew (0: uniform).
    pub skew: f32,
    /// Vocabulary size when no tokenizer is given (None: the preset's).
    pub n_vocab: Option<usize>,
    /// Type the converter wrote before llama-quantize ran (the `--outtype`): it decides the
    /// type of tensors llama-quantize leaves alone, e.g. DeepSeek's router. BF16 by default,
    /// as the fixture files were made.
    pub base: DType,
    /// Add the multi-token prediction block of the releases (`--mtp`).
    pub mtp: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            ftype: None,
            n_layer: None,
            skew: 0.0,
            n_vocab: None,
            base: DType::BF16,
            mtp: false,
        }
    }
}

/// How the converter stores a tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// In the `--outtype`; llama-quantize may quantize it.
    Out,
    /// Always F32 (norms, 1-D tensors, conv kernels, Qwen's router).
    F32,
    /// Kept in this type by the converter (DeepSeek's MXFP4 experts, the i32 hash table).
    Fixed(DType),
}

/// A tensor as an architecture module lists it, before types are chosen.
struct Draft {
    name: String,
    shape: Vec<u64>,
    kind: Kind,
    init: Init,
    /// llama-quantize `--tensor-type` override (DeepSeek's `exps=mxfp4`).
    forced: Option<DType>,
}

impl Draft {
    fn new(name: impl Into<String>, shape: &[usize], kind: Kind, init: Init) -> Draft {
        Draft {
            name: name.into(),
            shape: shape.iter().map(|&d| d as u64).collect(),
            kind,
            init,
            forced: None,
        }
    }
}

/// An architecture's part of a plan: converter-order metadata (arch keys only) and tensors.
struct ArchDraft {
    arch: &'static str,
    /// `<arch>.*` keys in converter order.
    meta: Vec<(String, Value)>,
    tensors: Vec<Draft>,
    n_layer: usize,
    /// `block_count`: the layers and the MTP blocks after them.
    n_blocks: usize,
    n_expert: usize,
    /// `general.file_type` the converter writes for float outtypes when it differs from the
    /// outtype's (DeepSeek-V4: 38, MXFP4_MOE, since its experts stay MXFP4).
    float_file_type: Option<u32>,
}

/// `std = 1/sqrt(fan_in)`: unit-variance inputs give unit-variance outputs.
fn fan_in(n: usize) -> Init {
    Init::Normal {
        std: 1.0 / (n as f32).sqrt(),
    }
}

/// A weight matrix in the `--outtype`, `N(0, 1/row length)`.
fn weight(name: String, shape: &[usize]) -> Draft {
    let fan = *shape.last().expect("weights have a row length");
    Draft::new(name, shape, Kind::Out, fan_in(fan))
}

/// A norm's weight `[n]`, F32 near one.
fn norm(name: String, n: usize) -> Draft {
    Draft::new(name, &[n], Kind::F32, near_one())
}

/// An F32 router `[n_expert, n_embd]` of layer `layer` (llama.cpp keeps Qwen's, Step's and
/// Gemma's routers in F32), skewed towards a few experts per layer by `skew`.
fn router(
    name: String,
    (n_expert, n_embd): (usize, usize),
    skew: f32,
    top_k: usize,
    layer: usize,
) -> Draft {
    Draft::new(
        name,
        &[n_expert, n_embd],
        Kind::F32,
        Init::Router {
            std: 1.0 / (n_embd as f32).sqrt(),
            skew,
            top_k,
            layer,
        },
    )
}

/// Norm weights stored as `1 + w` (or plain weights near one).
fn near_one() -> Init {
    Init::Around {
        mean: 1.0,
        std: 0.02,
    }
}

/// The plan of `preset` with `opts`; `vocab` (a tokenizer) makes it a chat model.
pub fn plan(preset: &Preset, opts: &PlanOptions, vocab: Option<&Vocab>) -> Result<Plan> {
    let ftype = opts.ftype.unwrap_or(preset.default_type);
    if !(opts.skew >= 0.0 && opts.skew.is_finite()) {
        return Err(Error::Invalid(format!(
            "--skew {}: expected a finite number ≥ 0",
            opts.skew
        )));
    }
    let preset_vocab = match &preset.dims {
        Dims::Qwen35(d) => d.n_vocab,
        Dims::Deepseek4(d) => d.n_vocab,
        Dims::Llama(d) => d.n_vocab,
        Dims::Step(d) => d.n_vocab,
        Dims::Gemma(d) => d.n_vocab,
    };
    let n_vocab = match vocab {
        // The demo takes the tokenizer's size; a release keeps its (padded) embedding rows.
        Some(v) if preset.demo => v.len(),
        Some(v) => v.len().max(preset_vocab),
        None => opts.n_vocab.unwrap_or(preset_vocab),
    };
    if n_vocab == 0 {
        return Err(Error::Invalid("vocabulary size must be positive".into()));
    }
    let draft = match &preset.dims {
        Dims::Qwen35(d) => {
            let mut d = d.clone();
            if let Some(n) = opts.n_layer {
                check_layers(n, d.n_layer)?;
                d.n_layer = n;
            }
            d.n_vocab = n_vocab;
            qwen35::draft(&d, opts.skew, opts.mtp)
        }
        Dims::Deepseek4(d) => {
            let mut d = d.clone();
            if let Some(n) = opts.n_layer {
                check_layers(n, d.n_layer)?;
                d.n_layer = n;
                d.compress_ratios.truncate(n);
                d.n_hash = d.n_hash.min(n);
            }
            d.n_vocab = n_vocab;
            deepseek4::draft(&d, opts.skew, opts.mtp)
        }
        Dims::Llama(d) => {
            no_mtp_block(preset, opts)?;
            let mut d = d.clone();
            if let Some(n) = opts.n_layer {
                check_layers(n, d.n_layer)?;
                d.n_layer = n;
            }
            d.n_vocab = n_vocab;
            llama::draft(&d, opts.skew)
        }
        Dims::Step(d) => {
            if opts.mtp {
                return Err(Error::Invalid(format!(
                    "--mtp: {}'s MTP blocks ship in their own file (not synthesized)",
                    preset.name
                )));
            }
            let mut d = d.clone();
            if let Some(n) = opts.n_layer {
                check_layers(n, d.n_layer)?;
                d.n_layer = n;
                d.n_dense = d.n_dense.min(n);
            }
            d.n_vocab = n_vocab;
            step37::draft(&d, opts.skew)
        }
        Dims::Gemma(d) => {
            no_mtp_block(preset, opts)?;
            let mut d = d.clone();
            if let Some(n) = opts.n_layer {
                check_layers(n, d.n_layer)?;
                d.n_kv_shared = gemma4::shared_of(&d, n);
                d.n_layer = n;
            }
            d.n_vocab = n_vocab;
            gemma4::draft(&d, opts.skew)
        }
    };
    finish(preset, draft, ftype, opts.base, vocab, n_vocab)
}

/// `--mtp` for a release that ships no multi-token prediction block.
fn no_mtp_block(preset: &Preset, opts: &PlanOptions) -> Result<()> {
    if opts.mtp {
        return Err(Error::Invalid(format!(
            "--mtp: {} has no multi-token prediction block",
            preset.name
        )));
    }
    Ok(())
}

fn check_layers(n: usize, max: usize) -> Result<()> {
    if n == 0 || n > max {
        return Err(Error::Invalid(format!(
            "--layers {n}: expected 1 to {max} (the preset's layer count)"
        )));
    }
    Ok(())
}

/// Chooses types, orders tensors and assembles the metadata.
fn finish(
    preset: &Preset,
    draft: ArchDraft,
    ftype: FileType,
    base: DType,
    vocab: Option<&Vocab>,
    n_vocab: usize,
) -> Result<Plan> {
    let arch = draft.arch;
    let size_label = size_label(&draft.tensors);
    let mut tensors: Vec<TensorPlan>;
    if ftype.is_float() {
        tensors = draft
            .tensors
            .into_iter()
            .map(|d| TensorPlan {
                dtype: match d.kind {
                    Kind::Out => ftype.default_type(),
                    Kind::F32 => DType::F32,
                    Kind::Fixed(t) => t,
                },
                name: d.name,
                shape: d.shape,
                init: d.init,
            })
            .collect();
    } else {
        if base.is_quantized() {
            return Err(Error::Invalid(format!(
                "base type {base}: the converter writes F32, F16 or BF16"
            )));
        }
        let mut drafts = draft.tensors;
        drafts.sort_by(|a, b| ftype::quantize_order(&a.name, &b.name));
        let shapes: Vec<Vec<u64>> = drafts.iter().map(|d| ftype::trimmed(&d.shape)).collect();
        let inputs: Vec<ftype::QuantInput<'_>> = drafts
            .iter()
            .zip(&shapes)
            .map(|(d, s)| ftype::QuantInput {
                name: &d.name,
                dtype: match d.kind {
                    Kind::Out => base,
                    Kind::F32 => DType::F32,
                    Kind::Fixed(t) => t,
                },
                shape: s,
                forced: d.forced,
            })
            .collect();
        let model = ftype::QuantModel {
            n_layer: draft.n_blocks,
            n_expert: draft.n_expert,
        };
        let types = ftype::quantized_types(&inputs, &model, ftype)?;
        drop(inputs);
        tensors = drafts
            .into_iter()
            .zip(shapes)
            .zip(types)
            .map(|((d, shape), dtype)| TensorPlan {
                name: d.name,
                dtype,
                shape,
                init: d.init,
            })
            .collect();
    }
    for t in &mut tensors {
        if !t.dtype.is_quantized() || t.dtype.bytes_for(t.n_elements()).is_some() {
            continue;
        }
        return Err(Error::Invalid(format!(
            "{}: shape {:?} is not whole {} blocks",
            t.name, t.shape, t.dtype
        )));
    }

    // Metadata in the converter's order; llama-quantize moves the two version keys last.
    let mut meta: Vec<(String, Value)> = vec![
        (keys::GENERAL_ARCHITECTURE.into(), arch.into()),
        (keys::GENERAL_TYPE.into(), "model".into()),
        (keys::GENERAL_NAME.into(), preset.display.as_str().into()),
        (keys::GENERAL_SIZE_LABEL.into(), size_label.into()),
    ];
    let file_type = if ftype.is_float() {
        draft.float_file_type.unwrap_or(ftype.llama_id())
    } else {
        ftype.llama_id()
    };
    let value_length = keys::key(arch, keys::ATTENTION_VALUE_LENGTH);
    for (k, v) in draft.meta {
        let after = k == value_length;
        meta.push((k, v));
        if after && ftype.is_float() {
            meta.push((keys::GENERAL_FILE_TYPE.into(), Value::U32(file_type)));
        }
    }
    if ftype.is_float() {
        meta.push((keys::GENERAL_QUANTIZATION_VERSION.into(), Value::U32(2)));
    }
    match vocab {
        Some(v) => meta.extend(v.keys(n_vocab)?),
        None => {
            meta.push((keys::TOKENIZER_MODEL.into(), "none".into()));
            meta.push((
                keys::key(arch, keys::VOCAB_SIZE),
                Value::U32(n_vocab as u32),
            ));
        }
    }
    if !ftype.is_float() {
        meta.push((keys::GENERAL_QUANTIZATION_VERSION.into(), Value::U32(2)));
        meta.push((keys::GENERAL_FILE_TYPE.into(), Value::U32(file_type)));
    }
    Ok(Plan {
        arch: arch.to_string(),
        ftype,
        metadata: meta,
        tensors,
        n_layer: draft.n_layer,
        n_vocab,
    })
}

/// `general.size_label` as gguf-py computes it: parameters rounded to two significant
/// digits, `<n_expert>x<shared + one expert's>` for MoE models.
fn size_label(tensors: &[Draft]) -> String {
    let (mut total, mut shared, mut expert, mut expert_sum, mut n_expert_tensors) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    for t in tensors {
        let size: u64 = t.shape.iter().product();
        total += size;
        if t.name.contains("_exps.") && t.shape.len() >= 3 {
            let n = t.shape[t.shape.len() - 3];
            expert += size / n;
            expert_sum += n;
            n_expert_tensors += 1;
        } else {
            shared += size;
        }
    }
    match expert_sum.checked_div(n_expert_tensors) {
        Some(n_expert) => format!("{n_expert}x{}", rounded_count(shared + expert)),
        None => rounded_count(total),
    }
}

/// gguf-py's `model_weight_count_rounded_notation` with two digits.
fn rounded_count(n: u64) -> String {
    let n = n as f64;
    let (scaled, suffix) = if n > 1e12 {
        (n * 1e-12, "T")
    } else if n > 1e9 {
        (n * 1e-9, "B")
    } else if n > 1e6 {
        (n * 1e-6, "M")
    } else {
        (n * 1e-3, "K")
    };
    // Python's round() is half-to-even; only the digit count matters here.
    let digits = format!("{}", scaled.round_ties_even() as u64)
        .trim_start_matches('0')
        .len();
    let fix = 2usize.saturating_sub(digits);
    format!("{scaled:.fix$}{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounded_counts_match_gguf_py() {
        assert_eq!(rounded_count(4_609_176), "4.6M");
        assert_eq!(rounded_count(232_000), "232K");
        assert_eq!(rounded_count(8_953_000_000), "9.0B");
        assert_eq!(rounded_count(2_376_072), "2.4M");
        assert_eq!(rounded_count(27_000_000_000), "27B");
    }
}
