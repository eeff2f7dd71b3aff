//! Qwen3.5 / 3.6 hybrid models and Qwen3-Next: Gated DeltaNet (linear attention) layers
//! interleaved with gated full attention, dense SwiGLU or routed MoE with a shared expert.
//!
//! GGUF files (`qwen35`, `qwen35moe`, `qwen3next`: llama.cpp's converter) and HF checkpoints
//! (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, `Qwen3NextForCausalLM`, and the text model
//! of the multimodal releases) load into one internal layout (see `weights.rs`).

pub mod cpu;
pub mod gpu;
pub mod weights;

use super::ModelFile;
use crate::{Error, Result};

/// Which value heads share a key head. HF `repeat_interleave`s key heads: value head `h`
/// reads key head `h / (Hv/Hk)`. llama.cpp's qwen35/qwen35moe converter reorders value heads
/// so that the runtime uses `h % Hk` (`convert_hf_to_gguf.py`, `Qwen3_5TextModel`); qwen3next
/// GGUFs are not reordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadMap {
    Div,
    Mod,
}

impl HeadMap {
    pub fn key_head(self, h: usize, n_k: usize, n_v: usize) -> usize {
        match self {
            HeadMap::Div => h / (n_v / n_k),
            HeadMap::Mod => h % n_k,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Qwen35,
    Qwen35Moe,
    Qwen3Next,
}

#[derive(Clone, Debug)]
pub struct MoeParams {
    pub n_expert: usize,
    pub n_used: usize,
    /// Routed expert FFN width.
    pub n_ff_exp: usize,
    /// Shared expert FFN width (0: none).
    pub n_ff_shexp: usize,
    /// Renormalise the top-k softmax weights (Qwen3.5: always).
    pub norm_topk: bool,
}

/// Hyper-parameters. Head sizes are per head; `*_dim` products are derived.
#[derive(Clone, Debug)]
pub struct Hparams {
    pub family: Family,
    pub gguf: bool,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_vocab: usize,
    /// Dense FFN width (layers without MoE).
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Rotated dims per head (NEOX halves on the leading `n_rot` dims).
    pub n_rot: usize,
    pub rope_theta: f32,
    pub eps: f32,
    /// Per layer: true for Gated DeltaNet, false for full attention.
    pub recurrent: Vec<bool>,
    pub conv_kernel: usize,
    /// GDN key heads (`Hk`) and value heads (`Hv`), and their sizes.
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub d_k: usize,
    pub d_v: usize,
    pub head_map: HeadMap,
    pub moe: Option<MoeParams>,
    /// Multi-token prediction blocks in the file (GGUF `nextn_predict_layers`, counted in
    /// `block_count` after the trunk; HF `mtp_num_hidden_layers` when `mtp.*` is present).
    /// lathe runs the first.
    pub n_mtp: usize,
}

impl Hparams {
    /// Channels of the fused q|k|v projection that the causal conv runs over.
    pub fn conv_dim(&self) -> usize {
        2 * self.n_k_heads * self.d_k + self.n_v_heads * self.d_v
    }
    pub fn v_dim(&self) -> usize {
        self.n_v_heads * self.d_v
    }

    pub fn from_file(f: &ModelFile) -> Result<Hparams> {
        match f {
            ModelFile::Gguf(g) => {
                let arch = g.architecture()?.to_string();
                let family = match arch.as_str() {
                    "qwen35" => Family::Qwen35,
                    "qwen35moe" => Family::Qwen35Moe,
                    "qwen3next" => Family::Qwen3Next,
                    a => {
                        return Err(Error::Unsupported(format!(
                            "{}: architecture {a} is not a Qwen3.5 family model",
                            g.path().display()
                        )))
                    }
                };
                let k = |s: &str| format!("{arch}.{s}");
                let n_blocks = g.get_usize(&k("block_count"))?;
                let n_mtp = g.opt_usize(&k("nextn_predict_layers"))?.unwrap_or(0);
                let n_layer = n_blocks.checked_sub(n_mtp).ok_or_else(|| {
                    Error::config(
                        g.path(),
                        k("nextn_predict_layers"),
                        format!("{n_mtp} MTP blocks of {n_blocks} blocks"),
                    )
                })?;
                let n_embd = g.get_usize(&k("embedding_length"))?;
                let n_head = g.get_usize(&k("attention.head_count"))?;
                let n_head_kv = g.get_usize(&k("attention.head_count_kv"))?;
                let head_dim = g
                    .opt_usize(&k("attention.key_length"))?
                    .unwrap_or(n_embd / n_head.max(1));
                let n_rot = g
                    .opt_usize(&k("rope.dimension_count"))?
                    .unwrap_or(head_dim / 4);
                let n_vocab = match g.opt_usize(&k("vocab_size"))? {
                    Some(v) => v,
                    None => g.require("token_embd.weight")?.shape[0] as usize,
                };
                let recurrent = match g.get(&k("attention.recurrent_layers")) {
                    // The MTP blocks' entries (full attention) follow the trunk's.
                    Some(_) => {
                        let mut r = g.get_bool_array(&k("attention.recurrent_layers"))?;
                        if r.len() == n_blocks {
                            r.truncate(n_layer);
                        }
                        r
                    }
                    None => {
                        let key = k("full_attention_interval");
                        let every = g.opt_usize(&key)?.unwrap_or(4);
                        layer_pattern(n_layer, every)
                            .map_err(|w| Error::config(g.path(), key, w))?
                    }
                };
                if recurrent.len() != n_layer {
                    return Err(Error::config(
                        g.path(),
                        k("attention.recurrent_layers"),
                        format!("{} entries for {n_layer} layers", recurrent.len()),
                    ));
                }
                let n_v_heads = g.get_usize(&k("ssm.time_step_rank"))?;
                let inner = g.get_usize(&k("ssm.inner_size"))?;
                let moe = match g.opt_usize(&k("expert_count"))? {
                    Some(n) if n > 0 => Some(MoeParams {
                        n_expert: n,
                        n_used: g.get_usize(&k("expert_used_count"))?,
                        n_ff_exp: g.get_usize(&k("expert_feed_forward_length"))?,
                        n_ff_shexp: g
                            .opt_usize(&k("expert_shared_feed_forward_length"))?
                            .unwrap_or(0),
                        norm_topk: true,
                    }),
                    _ => None,
                };
                let hp = Hparams {
                    family,
                    gguf: true,
                    n_layer,
                    n_embd,
                    n_vocab,
                    n_ff: g.opt_usize(&k("feed_forward_length"))?.unwrap_or(0),
                    n_head,
                    n_head_kv,
                    head_dim,
                    n_rot,
                    rope_theta: g.opt_f32(&k("rope.freq_base"))?.unwrap_or(1e7),
                    eps: g
                        .opt_f32(&k("attention.layer_norm_rms_epsilon"))?
                        .unwrap_or(1e-6),
                    recurrent,
                    conv_kernel: g.get_usize(&k("ssm.conv_kernel"))?,
                    n_k_heads: g.get_usize(&k("ssm.group_count"))?,
                    n_v_heads,
                    d_k: g.get_usize(&k("ssm.state_size"))?,
                    d_v: inner / n_v_heads.max(1),
                    head_map: if family == Family::Qwen3Next {
                        HeadMap::Div
                    } else {
                        HeadMap::Mod
                    },
                    moe,
                    n_mtp,
                };
                hp.validate(&g.path().display().to_string())
            }
            ModelFile::Hf(h) => {
                let arch = h.architecture()?;
                let family = match arch.as_str() {
                    "Qwen3_5ForCausalLM" | "Qwen3_5ForConditionalGeneration" => Family::Qwen35,
                    "Qwen3_5MoeForCausalLM" | "Qwen3_5MoeForConditionalGeneration" => {
                        Family::Qwen35Moe
                    }
                    "Qwen3NextForCausalLM" => Family::Qwen3Next,
                    a => {
                        return Err(Error::Unsupported(format!(
                            "{}: architecture {a} is not a Qwen3.5 family model",
                            h.dir().display()
                        )))
                    }
                };
                let n_layer = h.cfg_u64("num_hidden_layers")? as usize;
                let n_embd = h.cfg_u64("hidden_size")? as usize;
                let n_head = h.cfg_u64("num_attention_heads")? as usize;
                let head_dim = h
                    .cfg_opt_u64("head_dim")?
                    .map(|v| v as usize)
                    .unwrap_or(n_embd / n_head.max(1));
                // rope_parameters (transformers 5) or top-level rope_theta / partial_rotary_factor.
                let rp = h.cfg_value("rope_parameters");
                let rp_f = |key: &str| rp.and_then(|v| v.get(key)).and_then(|v| v.as_f64());
                let rope_theta = match rp_f("rope_theta") {
                    Some(t) => t,
                    None => h.cfg_opt_f64("rope_theta")?.unwrap_or(1e7),
                };
                let partial = match rp_f("partial_rotary_factor") {
                    Some(t) => t,
                    None => h.cfg_opt_f64("partial_rotary_factor")?.unwrap_or(0.25),
                };
                let recurrent = match h.cfg_value("layer_types") {
                    Some(_) => h
                        .cfg_str_list("layer_types")?
                        .iter()
                        .map(|s| *s == "linear_attention")
                        .collect(),
                    None => {
                        let every = h.cfg_opt_u64("full_attention_interval")?.unwrap_or(4) as usize;
                        layer_pattern(n_layer, every).map_err(|w| {
                            Error::config(h.config_path(), "full_attention_interval", w)
                        })?
                    }
                };
                let moe = match h.cfg_opt_u64("num_experts")? {
                    Some(n) if n > 0 => Some(MoeParams {
                        n_expert: n as usize,
                        n_used: h.cfg_u64("num_experts_per_tok")? as usize,
                        n_ff_exp: h.cfg_u64("moe_intermediate_size")? as usize,
                        n_ff_shexp: h
                            .cfg_opt_u64("shared_expert_intermediate_size")?
                            .unwrap_or(0) as usize,
                        norm_topk: h.cfg_opt_bool("norm_topk_prob")?.unwrap_or(true),
                    }),
                    _ => None,
                };
                let n_vocab = h.cfg_u64("vocab_size")? as usize;
                // Conversions often drop the MTP weights while keeping the config key.
                let n_mtp = match h.tensor("mtp.fc.weight") {
                    Some(_) => h
                        .cfg_opt_u64("mtp_num_hidden_layers")?
                        .or(h.cfg_opt_u64("num_nextn_predict_layers")?)
                        .unwrap_or(1) as usize,
                    None => 0,
                };
                let hp = Hparams {
                    family,
                    gguf: false,
                    n_layer,
                    n_embd,
                    n_vocab,
                    n_ff: h.cfg_opt_u64("intermediate_size")?.unwrap_or(0) as usize,
                    n_head,
                    n_head_kv: h.cfg_u64("num_key_value_heads")? as usize,
                    head_dim,
                    n_rot: ((head_dim as f64 * partial).round() as usize) & !1,
                    rope_theta: rope_theta as f32,
                    eps: h.cfg_opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
                    recurrent,
                    conv_kernel: h.cfg_opt_u64("linear_conv_kernel_dim")?.unwrap_or(4) as usize,
                    n_k_heads: h.cfg_u64("linear_num_key_heads")? as usize,
                    n_v_heads: h.cfg_u64("linear_num_value_heads")? as usize,
                    d_k: h.cfg_u64("linear_key_head_dim")? as usize,
                    d_v: h.cfg_u64("linear_value_head_dim")? as usize,
                    head_map: HeadMap::Div,
                    moe,
                    n_mtp,
                };
                hp.validate(&h.config_path().display().to_string())
            }
        }
    }

    fn validate(self, file: &str) -> Result<Hparams> {
        let bad = |what: String| Err(Error::Invalid(format!("{file}: {what}")));
        if self.n_layer == 0 || self.n_embd == 0 || self.n_vocab == 0 {
            return bad("zero layers, width or vocabulary".into());
        }
        if self.recurrent.len() != self.n_layer {
            return bad(format!(
                "layer pattern has {} entries for {} layers",
                self.recurrent.len(),
                self.n_layer
            ));
        }
        if self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad(format!(
                "{} query heads not a multiple of {} kv heads",
                self.n_head, self.n_head_kv
            ));
        }
        if self.n_k_heads == 0 || !self.n_v_heads.is_multiple_of(self.n_k_heads) {
            return bad(format!(
                "{} GDN value heads not a multiple of {} key heads",
                self.n_v_heads, self.n_k_heads
            ));
        }
        // The full-attention layers always rotate: 0 would silently run them without RoPE.
        if self.n_rot == 0 || self.n_rot > self.head_dim || !self.n_rot.is_multiple_of(2) {
            return bad(format!(
                "rotary dims {} invalid for head size {}",
                self.n_rot, self.head_dim
            ));
        }
        if let Some(m) = &self.moe {
            if m.n_used == 0 || m.n_used > m.n_expert {
                return bad(format!("{} experts used of {}", m.n_used, m.n_expert));
            }
        }
        Ok(self)
    }
}

/// Most layers a file may declare before a per-layer table is built from the number alone
/// (released models have at most a few hundred).
const MAX_LAYERS: usize = 1 << 16;

/// Which of `n_layer` layers are recurrent (GDN) when every `every`-th is full attention.
fn layer_pattern(n_layer: usize, every: usize) -> std::result::Result<Vec<bool>, String> {
    if every == 0 {
        return Err("0: every how many layers one is full attention must be at least 1".into());
    }
    if n_layer > MAX_LAYERS {
        return Err(format!("{n_layer} layers: at most {MAX_LAYERS}"));
    }
    Ok((0..n_layer).map(|i| (i + 1) % every != 0).collect())
}
