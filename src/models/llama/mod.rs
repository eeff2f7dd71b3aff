//! The plain transformer (Llama and its descendants): pre-norm blocks of grouped-query
//! attention with RoPE and a SwiGLU FFN (or routed experts), RMSNorm everywhere, the head
//! tied to the embedding when the file has no output head.
//!
//! Variants, told apart by the file: Qwen2's q/k/v biases and Qwen3's per-head q/k RMSNorm
//! (present tensors), Qwen3-MoE's routed experts (softmax top-k, renormalised as configured,
//! no shared expert), Mistral-style head sizes and sliding window.
//!
//! RoPE: llama.cpp's converter permutes HF's Q and K rows for its `llama` files so they rotate
//! interleaved pairs (its `LLAMA_ROPE_TYPE_NORM`); its `qwen2`/`qwen3`/`qwen3moe` files keep
//! HF's order and rotate NeoX halves (`LLAMA_ROPE_TYPE_NEOX`). Hugging Face checkpoints are
//! never permuted: they all rotate halves (`rotate_half`).

pub mod gpu;

use super::ModelFile;
use crate::gguf::keys::{self, key};
use crate::gguf::GgufFile;
use crate::gpu::rope::RopeStyle;
use crate::safetensors::HfModel;
use crate::{Error, Result};

/// Every architecture name of the family (the registry's list).
pub const ARCHS: &[&str] = &[
    "llama",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
];

/// Tensor roles; [`W::gguf_name`] and [`W::hf_name`] are the one name table (llama.cpp's
/// `LLM_TENSOR_*` names, transformers' module paths).
#[derive(Clone, Copy, Debug)]
pub enum W {
    TokEmbd,
    /// Optional: absent when the head is tied to the embedding.
    Output,
    OutputNorm,
    /// Optional (GGUF only): per-frequency divisors of the rotation (Llama 3.1's
    /// `rope_freqs`, written by llama.cpp's converter from `rope_type = llama3`).
    RopeFreqs,
    AttnNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    /// Optional: Qwen2's biases.
    QBias(usize),
    KBias(usize),
    VBias(usize),
    /// Optional: Qwen3's per-head RMSNorm of q and k, `[head_dim]`.
    QNorm(usize),
    KNorm(usize),
    O(usize),
    FfnNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    /// Routed experts: the router `[n_expert, n_embd]`; GGUF stacks `[n_expert, rows, cols]`,
    /// HF one matrix per expert.
    Router(usize),
    GateExps(usize),
    UpExps(usize),
    DownExps(usize),
    GateExp(usize, usize),
    UpExp(usize, usize),
    DownExp(usize, usize),
}

impl W {
    pub fn gguf_name(self) -> String {
        use W::*;
        let b = |l: usize, s: &str| format!("blk.{l}.{s}");
        match self {
            TokEmbd => "token_embd.weight".into(),
            Output => "output.weight".into(),
            OutputNorm => "output_norm.weight".into(),
            RopeFreqs => "rope_freqs.weight".into(),
            AttnNorm(l) => b(l, "attn_norm.weight"),
            Q(l) => b(l, "attn_q.weight"),
            K(l) => b(l, "attn_k.weight"),
            V(l) => b(l, "attn_v.weight"),
            QBias(l) => b(l, "attn_q.bias"),
            KBias(l) => b(l, "attn_k.bias"),
            VBias(l) => b(l, "attn_v.bias"),
            QNorm(l) => b(l, "attn_q_norm.weight"),
            KNorm(l) => b(l, "attn_k_norm.weight"),
            O(l) => b(l, "attn_output.weight"),
            FfnNorm(l) => b(l, "ffn_norm.weight"),
            Gate(l) => b(l, "ffn_gate.weight"),
            Up(l) => b(l, "ffn_up.weight"),
            Down(l) => b(l, "ffn_down.weight"),
            Router(l) => b(l, "ffn_gate_inp.weight"),
            GateExps(l) | GateExp(l, _) => b(l, "ffn_gate_exps.weight"),
            UpExps(l) | UpExp(l, _) => b(l, "ffn_up_exps.weight"),
            DownExps(l) | DownExp(l, _) => b(l, "ffn_down_exps.weight"),
        }
    }

    pub fn hf_name(self) -> String {
        use W::*;
        let b = |l: usize, s: &str| format!("model.layers.{l}.{s}");
        match self {
            TokEmbd => "model.embed_tokens.weight".into(),
            Output => "lm_head.weight".into(),
            OutputNorm => "model.norm.weight".into(),
            // HF configs carry the frequencies' scaling; no tensor of this name exists.
            RopeFreqs => "rope_freqs.weight".into(),
            AttnNorm(l) => b(l, "input_layernorm.weight"),
            Q(l) => b(l, "self_attn.q_proj.weight"),
            K(l) => b(l, "self_attn.k_proj.weight"),
            V(l) => b(l, "self_attn.v_proj.weight"),
            QBias(l) => b(l, "self_attn.q_proj.bias"),
            KBias(l) => b(l, "self_attn.k_proj.bias"),
            VBias(l) => b(l, "self_attn.v_proj.bias"),
            QNorm(l) => b(l, "self_attn.q_norm.weight"),
            KNorm(l) => b(l, "self_attn.k_norm.weight"),
            O(l) => b(l, "self_attn.o_proj.weight"),
            FfnNorm(l) => b(l, "post_attention_layernorm.weight"),
            Gate(l) => b(l, "mlp.gate_proj.weight"),
            Up(l) => b(l, "mlp.up_proj.weight"),
            Down(l) => b(l, "mlp.down_proj.weight"),
            Router(l) => b(l, "mlp.gate.weight"),
            GateExps(l) => b(l, "mlp.experts.gate_proj"),
            UpExps(l) => b(l, "mlp.experts.up_proj"),
            DownExps(l) => b(l, "mlp.experts.down_proj"),
            GateExp(l, e) => b(l, &format!("mlp.experts.{e}.gate_proj.weight")),
            UpExp(l, e) => b(l, &format!("mlp.experts.{e}.up_proj.weight")),
            DownExp(l, e) => b(l, &format!("mlp.experts.{e}.down_proj.weight")),
        }
    }

    /// The name in `file`'s format.
    pub fn name(self, file: &ModelFile) -> String {
        match file {
            ModelFile::Gguf(_) => self.gguf_name(),
            ModelFile::Hf(_) => self.hf_name(),
        }
    }
}

/// Routed experts (Qwen3-MoE): every layer's FFN.
#[derive(Clone, Debug)]
pub struct Moe {
    pub n_expert: usize,
    pub n_used: usize,
    /// Width of one expert's gate / up.
    pub n_ff_exp: usize,
    /// Renormalise the top-k softmax weights to sum 1 (HF `norm_topk_prob`).
    pub norm_topk: bool,
}

/// How the rotation's frequencies are scaled.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by the factor (`linear`).
    Linear(f32),
    /// Llama 3.1's per-frequency scaling (`rope_type = llama3`, HF's
    /// `_compute_llama3_parameters`); GGUF files carry its divisors as `rope_freqs`.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_positions: f32,
    },
}

/// Hyper-parameters.
#[derive(Clone, Debug)]
pub struct Hparams {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_vocab: usize,
    /// Dense FFN width (unused by a MoE model's layers).
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Rotated dims of each head (the first `n_rot`).
    pub n_rot: usize,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub rope_style: RopeStyle,
    /// Keys a query sees: `pos - j < window` (Mistral's sliding window); 0 for all.
    pub window: usize,
    pub eps: f32,
    /// `None`: dense FFN layers.
    pub moe: Option<Moe>,
    /// The head is the embedding (no output tensor, or HF's `tie_word_embeddings`).
    pub tied: bool,
}

impl Hparams {
    pub fn from_file(f: &ModelFile) -> Result<Hparams> {
        let hp = match f {
            ModelFile::Gguf(g) => Self::from_gguf(f, g)?,
            ModelFile::Hf(h) => Self::from_hf(f, h)?,
        };
        hp.check(f)?;
        Ok(hp)
    }

    /// Checks shared by both formats, and what the tensors say (vocabulary, tied head).
    fn check(&self, f: &ModelFile) -> Result<()> {
        let (n_head, n_head_kv) = (self.n_head, self.n_head_kv);
        if n_head == 0 || n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(Error::Invalid(format!(
                "{}: {n_head_kv} KV heads for {n_head} query heads",
                f.path().display()
            )));
        }
        let (n_rot, head_dim) = (self.n_rot, self.head_dim);
        if n_rot == 0 || n_rot > head_dim || !n_rot.is_multiple_of(2) {
            return Err(Error::Invalid(format!(
                "{}: {n_rot} rotated dims of a head of {head_dim}",
                f.path().display()
            )));
        }
        if let Some(m) = &self.moe {
            if m.n_expert == 0 || m.n_used == 0 || m.n_used > m.n_expert || m.n_ff_exp == 0 {
                return Err(Error::Invalid(format!(
                    "{}: {} of {} experts of width {}",
                    f.path().display(),
                    m.n_used,
                    m.n_expert,
                    m.n_ff_exp
                )));
            }
        }
        Ok(())
    }

    /// `[n_vocab, n_embd]` of the embedding (GGUF lists the dims the other way).
    fn vocab(f: &ModelFile, n_embd: usize) -> Result<usize> {
        let embd = f.require(&W::TokEmbd.name(f))?;
        match embd.shape {
            [v, e] if *e as usize == n_embd => Ok(*v as usize),
            s => Err(Error::tensor(
                embd.path,
                embd.name,
                format!("shape {s:?}, expected [n_vocab, {n_embd}]"),
            )),
        }
    }

    fn from_gguf(f: &ModelFile, g: &GgufFile) -> Result<Hparams> {
        let arch = g.architecture()?.to_string();
        // llama.cpp's `llama_model_rope_type`: NORM for llama, NEOX for the Qwen files.
        let rope_style = match arch.as_str() {
            "llama" => RopeStyle::Interleaved,
            "qwen2" | "qwen3" | "qwen3moe" => RopeStyle::Neox,
            _ => {
                return Err(Error::Unsupported(format!(
                    "{}: architecture {arch} is not a Llama family model",
                    g.path().display()
                )))
            }
        };
        let k = |s: &str| key(&arch, s);
        let n_embd = g.get_usize(&k(keys::EMBEDDING_LENGTH))?;
        let n_head = g.get_usize(&k(keys::ATTENTION_HEAD_COUNT))?;
        let n_head_kv = g
            .opt_usize(&k(keys::ATTENTION_HEAD_COUNT_KV))?
            .unwrap_or(n_head);
        let bad = |field: &str, why: String| Error::config(g.path(), k(field), why);
        let head_dim = match g.opt_usize(&k(keys::ATTENTION_KEY_LENGTH))? {
            Some(d) => d,
            None if n_head > 0 && n_embd.is_multiple_of(n_head) => n_embd / n_head,
            None => {
                return Err(bad(
                    keys::ATTENTION_HEAD_COUNT,
                    format!("{n_head} heads do not divide {n_embd}"),
                ))
            }
        };
        if let Some(dv) = g.opt_usize(&k(keys::ATTENTION_VALUE_LENGTH))? {
            if dv != head_dim {
                return Err(bad(
                    keys::ATTENTION_VALUE_LENGTH,
                    format!("{dv}, unlike the key length {head_dim}"),
                ));
            }
        }
        let rope_scaling = match g.opt_str(&k(keys::ROPE_SCALING_TYPE))? {
            None | Some("none") => RopeScaling::None,
            Some("linear") => {
                let f = g.get_f32(&k(keys::ROPE_SCALING_FACTOR))?;
                if !(f.is_finite() && f > 0.0) {
                    return Err(bad(
                        keys::ROPE_SCALING_FACTOR,
                        format!("{f}: not a positive factor"),
                    ));
                }
                RopeScaling::Linear(f)
            }
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "{}: {} = {other} (lathe reads none and linear)",
                    g.path().display(),
                    k(keys::ROPE_SCALING_TYPE)
                )))
            }
        };
        let moe = match g.opt_usize(&k(keys::EXPERT_COUNT))? {
            Some(n_expert) if n_expert > 0 => Some(Moe {
                n_expert,
                n_used: g.get_usize(&k(keys::EXPERT_USED_COUNT))?,
                n_ff_exp: g.get_usize(&k(keys::EXPERT_FEED_FORWARD_LENGTH))?,
                // llama.cpp's qwen3moe graph always renormalises (`build_moe_ffn(.., true,
                // ..)`); its converter writes no key for it.
                norm_topk: g.opt_bool(&k(keys::EXPERT_WEIGHTS_NORM))?.unwrap_or(true),
            }),
            _ => None,
        };
        Ok(Hparams {
            n_layer: g.get_usize(&k(keys::BLOCK_COUNT))?,
            n_embd,
            n_vocab: Self::vocab(f, n_embd)?,
            n_ff: match moe {
                Some(_) => g.opt_usize(&k(keys::FEED_FORWARD_LENGTH))?.unwrap_or(0),
                None => g.get_usize(&k(keys::FEED_FORWARD_LENGTH))?,
            },
            n_head,
            n_head_kv,
            head_dim,
            n_rot: g
                .opt_usize(&k(keys::ROPE_DIMENSION_COUNT))?
                .unwrap_or(head_dim),
            rope_theta: g.opt_f32(&k(keys::ROPE_FREQ_BASE))?.unwrap_or(10000.0),
            rope_scaling,
            rope_style,
            window: g
                .opt_usize(&k(keys::ATTENTION_SLIDING_WINDOW))?
                .unwrap_or(0),
            eps: g
                .opt_f32(&k(keys::ATTENTION_LAYERNORM_RMS_EPS))?
                .unwrap_or(1e-5),
            moe,
            tied: f.tensor(&W::Output.gguf_name()).is_none(),
        })
    }

    fn from_hf(f: &ModelFile, h: &HfModel) -> Result<Hparams> {
        let arch = h.architecture()?;
        if !ARCHS.contains(&arch.as_str()) {
            return Err(Error::Unsupported(format!(
                "{}: architecture {arch} is not a Llama family model",
                h.dir().display()
            )));
        }
        let u = |key: &str| -> Result<usize> { Ok(h.cfg_u64(key)? as usize) };
        let n_embd = u("hidden_size")?;
        let n_head = u("num_attention_heads")?;
        let n_head_kv = match h.cfg_opt_u64("num_key_value_heads")? {
            Some(n) => n as usize,
            None => n_head,
        };
        let head_dim = match h.cfg_opt_u64("head_dim")? {
            Some(d) => d as usize,
            None if n_head > 0 && n_embd.is_multiple_of(n_head) => n_embd / n_head,
            None => {
                return Err(Error::config(
                    h.config_path(),
                    "num_attention_heads",
                    format!("{n_head} heads do not divide hidden_size {n_embd}"),
                ))
            }
        };
        // transformers 5 writes `rope_parameters`; older configs `rope_theta` and
        // `rope_scaling` (with `type` or `rope_type`).
        let rp = |k: &str| -> Option<&serde_json::Value> {
            h.cfg_value(&format!("rope_parameters.{k}"))
                .or_else(|| h.cfg_value(&format!("rope_scaling.{k}")))
                .filter(|v| !v.is_null())
        };
        let rf = |k: &str| -> Result<f32> {
            rp(k)
                .and_then(|v| v.as_f64())
                .map(|v| v as f32)
                .ok_or_else(|| {
                    Error::config(h.config_path(), format!("rope_parameters.{k}"), "missing")
                })
        };
        let rope_theta = match rp("rope_theta") {
            Some(v) => v.as_f64().unwrap_or(10000.0) as f32,
            None => h.cfg_opt_f64("rope_theta")?.unwrap_or(10000.0) as f32,
        };
        let rope_type = rp("rope_type")
            .or_else(|| rp("type"))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let rope_scaling = match rope_type {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear(rf("factor")?),
            "llama3" => RopeScaling::Llama3 {
                factor: rf("factor")?,
                low_freq_factor: rf("low_freq_factor")?,
                high_freq_factor: rf("high_freq_factor")?,
                original_max_positions: rf("original_max_position_embeddings")?,
            },
            other => {
                return Err(Error::Unsupported(format!(
                    "{}: rope type {other} (lathe reads default, linear and llama3)",
                    h.config_path().display()
                )))
            }
        };
        // Mistral: every layer sees `sliding_window` keys when set. Qwen2/3 window only
        // with `use_sliding_window` (and then per layer): not read.
        let window = match arch.as_str() {
            "MistralForCausalLM" => h.cfg_opt_u64("sliding_window")?.unwrap_or(0) as usize,
            _ if h.cfg_opt_bool("use_sliding_window")? == Some(true) => {
                return Err(Error::Unsupported(format!(
                    "{}: use_sliding_window (per-layer windows of Qwen configs)",
                    h.config_path().display()
                )))
            }
            _ => 0,
        };
        let moe = if arch == "Qwen3MoeForCausalLM" {
            let sparse_all = h.cfg_opt_u64("decoder_sparse_step")?.unwrap_or(1) == 1
                && h.cfg_u64_list("mlp_only_layers")
                    .unwrap_or_default()
                    .is_empty();
            if !sparse_all {
                return Err(Error::Unsupported(format!(
                    "{}: dense layers among the MoE ones (decoder_sparse_step, mlp_only_layers)",
                    h.config_path().display()
                )));
            }
            Some(Moe {
                // Released configs say `num_experts`; transformers 5 writes
                // `num_local_experts`.
                n_expert: match h.cfg_opt_u64("num_experts")? {
                    Some(n) => n as usize,
                    None => u("num_local_experts")?,
                },
                n_used: u("num_experts_per_tok")?,
                n_ff_exp: u("moe_intermediate_size")?,
                // transformers' Qwen3MoeConfig default.
                norm_topk: h.cfg_opt_bool("norm_topk_prob")?.unwrap_or(false),
            })
        } else {
            None
        };
        Ok(Hparams {
            n_layer: u("num_hidden_layers")?,
            n_embd,
            n_vocab: Self::vocab(f, n_embd)?,
            n_ff: match moe {
                Some(_) => h.cfg_opt_u64("intermediate_size")?.unwrap_or(0) as usize,
                None => u("intermediate_size")?,
            },
            n_head,
            n_head_kv,
            head_dim,
            n_rot: head_dim,
            rope_theta,
            rope_scaling,
            rope_style: RopeStyle::Neox,
            window,
            eps: h.cfg_opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            moe,
            tied: h.cfg_opt_bool("tie_word_embeddings")? == Some(true)
                || f.tensor(&W::Output.hf_name()).is_none(),
        })
    }
}
