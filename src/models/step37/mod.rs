//! Step-3.7-Flash (and Step-3.5-Flash, the same trunk): pre-norm blocks whose attention is
//! per layer sliding-window or full, each kind with its own query-head count, rotary width and
//! RoPE base (per-layer arrays in the file); per-head q/k RMSNorm; a head-wise sigmoid gate on
//! the attention output; leading dense SwiGLU blocks, then sigmoid-routed experts with a
//! shared expert; an untied head. MTP ships as a separate GGUF.
//!
//! Facts from transformers 5.24's `modeling_step3p7.py` (the reference), llama.cpp's
//! `src/models/step35.cpp` and its converter (`conversion/step3.py`, `Step35Model`):
//! - RMSNorm computes `x̂·(1+w)` (Gemma style); the converter stores `1+w`, Hugging Face
//!   checkpoints `w` (this loader adds the 1).
//! - Full-attention layers rotate `partial_rotary_factor = 0.5` of the head (llama.cpp halves
//!   `rope.dimension_count` for them), sliding layers all of it; both NEOX halves over the
//!   rotated dims (HF `rotate_half`, llama.cpp `LLAMA_ROPE_TYPE_NEOX`). Only full layers take
//!   the llama3 frequency factors (`rope_freqs.weight`, `[head_dim/2]`, of which the first
//!   `n_rot/2` apply; HF derives them from `rope_scaling`).
//! - Attention: `o_proj(attn ⊙ sigmoid(g_proj(h)))` with one gate per head, scores scaled by
//!   `head_dim^-½`; sliding layers see keys `p - window < j ≤ p`.
//! - Router: `sigmoid(logits)` in f32, top-k of sigmoid + `router_bias` (selection only),
//!   weights the unbiased sigmoids of the winners renormalised, times
//!   `moe_router_scaling_factor`; the shared expert's output is added unweighted.
//! - SwiGLU clamps (`swiglu_limits` for the routed experts, `swiglu_limits_shared` for the
//!   shared expert and the dense FFN; the release sets them on blocks 43-44, at 7 and 16):
//!   `min(silu(g), L) ⊙ clamp(u, ±L)`, SiLU's output bounded, not its input as DeepSeek's
//!   (transformers' `Step3p7MLP` / `Step3p7Experts._apply_gate`; llama.cpp's `build_ffn` and
//!   `build_moe_ffn` for step35 with `swiglu_clamp_shexp` / `swiglu_clamp_exp`). A limit of 0
//!   means none (llama.cpp: none at or below 1e-6).

pub mod gpu;

use super::ModelFile;
use crate::gguf::keys::{self, key};
use crate::gguf::GgufFile;
use crate::safetensors::HfModel;
use crate::{Error, Result};

/// GGUF `general.architecture` and HF `architectures` values of the family.
pub const ARCHS: &[&str] = &[
    "step35",
    "Step3p7ForConditionalGeneration",
    "Step3p5ForCausalLM",
];

/// Step's own GGUF keys (llama.cpp's `LLM_KV_*`, under the architecture prefix); the shared
/// ones are in `gguf::keys`.
pub mod gguf_keys {
    pub const SLIDING_WINDOW_PATTERN: &str = "attention.sliding_window_pattern";
    pub const ROPE_FREQ_BASE_SWA: &str = "rope.freq_base_swa";
    pub const ROPE_DIMENSION_COUNT_SWA: &str = "rope.dimension_count_swa";
}

/// Tensor roles; [`W::gguf_name`] and [`W::hf_name`] are the one name table (llama.cpp's
/// `LLM_TENSOR_*` names; the release's checkpoint names, which transformers' `step3p7`
/// conversion mapping reads and writes).
#[derive(Clone, Copy, Debug)]
pub enum W {
    TokEmbd,
    Output,
    OutputNorm,
    /// GGUF only: the full layers' llama3 divisors `[head_dim/2]`.
    RopeFreqs,
    AttnNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    QNorm(usize),
    KNorm(usize),
    /// `[n_head_l, n_embd]`: one gate logit per head.
    Gate(usize),
    O(usize),
    FfnNorm(usize),
    FfnGate(usize),
    FfnUp(usize),
    FfnDown(usize),
    /// `[n_expert, n_embd]`; the selection bias `[n_expert]`.
    Router(usize),
    RouterBias(usize),
    /// Stacks `[n_expert, rows, cols]` in both formats.
    GateExps(usize),
    UpExps(usize),
    DownExps(usize),
    GateShexp(usize),
    UpShexp(usize),
    DownShexp(usize),
    /// MTP block: `[n_embd, 2·n_embd]` over `[enorm(embed) | hnorm(h)]`, the two norms,
    /// and its own head and head norm.
    EhProj(usize),
    ENorm(usize),
    HNorm(usize),
    SharedHeadNorm(usize),
    SharedHead(usize),
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
            QNorm(l) => b(l, "attn_q_norm.weight"),
            KNorm(l) => b(l, "attn_k_norm.weight"),
            Gate(l) => b(l, "attn_gate.weight"),
            O(l) => b(l, "attn_output.weight"),
            FfnNorm(l) => b(l, "ffn_norm.weight"),
            FfnGate(l) => b(l, "ffn_gate.weight"),
            FfnUp(l) => b(l, "ffn_up.weight"),
            FfnDown(l) => b(l, "ffn_down.weight"),
            Router(l) => b(l, "ffn_gate_inp.weight"),
            RouterBias(l) => b(l, "exp_probs_b.bias"),
            GateExps(l) => b(l, "ffn_gate_exps.weight"),
            UpExps(l) => b(l, "ffn_up_exps.weight"),
            DownExps(l) => b(l, "ffn_down_exps.weight"),
            GateShexp(l) => b(l, "ffn_gate_shexp.weight"),
            UpShexp(l) => b(l, "ffn_up_shexp.weight"),
            DownShexp(l) => b(l, "ffn_down_shexp.weight"),
            EhProj(l) => b(l, "nextn.eh_proj.weight"),
            ENorm(l) => b(l, "nextn.enorm.weight"),
            HNorm(l) => b(l, "nextn.hnorm.weight"),
            SharedHeadNorm(l) => b(l, "nextn.shared_head_norm.weight"),
            SharedHead(l) => b(l, "nextn.shared_head_head.weight"),
        }
    }

    pub fn hf_name(self) -> String {
        use W::*;
        let b = |l: usize, s: &str| format!("model.layers.{l}.{s}");
        match self {
            TokEmbd => "model.embed_tokens.weight".into(),
            Output => "lm_head.weight".into(),
            OutputNorm => "model.norm.weight".into(),
            RopeFreqs => "rope_freqs.weight".into(),
            AttnNorm(l) => b(l, "input_layernorm.weight"),
            Q(l) => b(l, "self_attn.q_proj.weight"),
            K(l) => b(l, "self_attn.k_proj.weight"),
            V(l) => b(l, "self_attn.v_proj.weight"),
            QNorm(l) => b(l, "self_attn.q_norm.weight"),
            KNorm(l) => b(l, "self_attn.k_norm.weight"),
            Gate(l) => b(l, "self_attn.g_proj.weight"),
            O(l) => b(l, "self_attn.o_proj.weight"),
            FfnNorm(l) => b(l, "post_attention_layernorm.weight"),
            FfnGate(l) => b(l, "mlp.gate_proj.weight"),
            FfnUp(l) => b(l, "mlp.up_proj.weight"),
            FfnDown(l) => b(l, "mlp.down_proj.weight"),
            Router(l) => b(l, "moe.gate.weight"),
            RouterBias(l) => b(l, "moe.router_bias"),
            GateExps(l) => b(l, "moe.gate_proj.weight"),
            UpExps(l) => b(l, "moe.up_proj.weight"),
            DownExps(l) => b(l, "moe.down_proj.weight"),
            GateShexp(l) => b(l, "share_expert.gate_proj.weight"),
            UpShexp(l) => b(l, "share_expert.up_proj.weight"),
            DownShexp(l) => b(l, "share_expert.down_proj.weight"),
            EhProj(l) => b(l, "eh_proj.weight"),
            ENorm(l) => b(l, "enorm.weight"),
            HNorm(l) => b(l, "hnorm.weight"),
            SharedHeadNorm(l) => b(l, "transformer.shared_head.norm.weight"),
            SharedHead(l) => b(l, "transformer.shared_head.output.weight"),
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

/// One block's geometry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerGeom {
    /// Sliding-window attention (else full).
    pub swa: bool,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Rotated dims of each head (the first `n_rot`).
    pub n_rot: usize,
    pub rope_theta: f32,
    /// Routed experts and a shared expert (else a dense SwiGLU of `n_ff`).
    pub moe: bool,
    /// SwiGLU clamp limits of the routed experts, and of the shared expert or dense FFN.
    pub clamp_exp: Option<f32>,
    pub clamp_shexp: Option<f32>,
}

/// The routed experts of the MoE blocks.
#[derive(Clone, Debug)]
pub struct Moe {
    pub n_expert: usize,
    pub n_used: usize,
    /// Width of one routed expert's gate / up, and of the shared expert's.
    pub n_ff_exp: usize,
    pub n_ff_shexp: usize,
    /// Renormalise the winners' weights to sum 1.
    pub norm: bool,
    /// Multiplier of the routed experts' weights.
    pub scale: f32,
}

/// Llama 3's frequency scaling of the full layers (HF `rope_scaling`, `rope_type = llama3`);
/// GGUF files carry its divisors as `rope_freqs.weight` instead.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3 {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_positions: f32,
}

/// Hyper-parameters.
#[derive(Clone, Debug)]
pub struct Hparams {
    /// Trunk blocks (MTP blocks past them are not counted).
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_vocab: usize,
    /// Dense FFN width.
    pub n_ff: usize,
    pub head_dim: usize,
    /// Per block of the file (trunk, then any MTP blocks the file declares).
    pub layers: Vec<LayerGeom>,
    /// Keys a sliding layer's query sees: positions `p - window < j <= p`.
    pub window: usize,
    /// HF only (GGUF: `rope_freqs.weight`).
    pub llama3: Option<Llama3>,
    pub eps: f32,
    pub moe: Option<Moe>,
    /// MTP blocks the file declares after the trunk (`nextn_predict_layers`).
    pub n_nextn: usize,
}

impl Hparams {
    pub fn from_file(f: &ModelFile) -> Result<Hparams> {
        match f {
            ModelFile::Gguf(g) => Self::from_gguf(f, g),
            ModelFile::Hf(h) => Self::from_hf(f, h),
        }?
        .check(&f.path())
    }

    fn check(self, path: &std::path::Path) -> Result<Hparams> {
        let bad = |what: String| Err(Error::format(path, what));
        if self.layers.len() != self.n_layer + self.n_nextn || self.head_dim == 0 {
            return bad(format!(
                "{} layer geometries for {} blocks and {} MTP blocks (head dim {})",
                self.layers.len(),
                self.n_layer,
                self.n_nextn,
                self.head_dim
            ));
        }
        for (l, g) in self.layers.iter().enumerate() {
            if g.n_head == 0
                || g.n_head_kv == 0
                || !g.n_head.is_multiple_of(g.n_head_kv)
                || g.n_rot == 0
                || g.n_rot > self.head_dim
                || !g.n_rot.is_multiple_of(2)
            {
                return bad(format!(
                    "block {l}: {} query heads over {} KV heads, {} rotated dims of {}",
                    g.n_head, g.n_head_kv, g.n_rot, self.head_dim
                ));
            }
            if g.moe && self.moe.is_none() {
                return bad(format!("block {l} is MoE in a file without experts"));
            }
        }
        if let Some(m) = &self.moe {
            if m.n_expert == 0 || m.n_used == 0 || m.n_used > m.n_expert || m.n_ff_exp == 0 {
                return bad(format!(
                    "{} of {} experts of width {}",
                    m.n_used, m.n_expert, m.n_ff_exp
                ));
            }
        }
        if self.layers.iter().any(|g| g.swa) && self.window == 0 {
            return bad("sliding layers with a window of 0".into());
        }
        Ok(self)
    }

    fn from_gguf(f: &ModelFile, g: &GgufFile) -> Result<Hparams> {
        use gguf_keys::*;
        let arch = g.architecture()?.to_string();
        if !ARCHS.contains(&arch.as_str()) {
            return Err(Error::Unsupported(format!(
                "{}: architecture {arch} is not Step-3.5/3.7",
                g.path().display()
            )));
        }
        let k = |s: &str| key(&arch, s);
        let n_all = g.get_usize(&k(keys::BLOCK_COUNT))?;
        let n_nextn = g.opt_usize(&k(keys::NEXTN_PREDICT_LAYERS))?.unwrap_or(0);
        if n_nextn > n_all {
            return Err(Error::config(
                g.path(),
                k(keys::NEXTN_PREDICT_LAYERS),
                format!("{n_nextn} MTP blocks of {n_all}"),
            ));
        }
        let n_embd = g.get_usize(&k(keys::EMBEDDING_LENGTH))?;
        let swa = g.get_bool_array(&k(SLIDING_WINDOW_PATTERN))?;
        if swa.len() != n_all {
            return Err(Error::config(
                g.path(),
                k(SLIDING_WINDOW_PATTERN),
                format!("{} entries for {n_all} blocks", swa.len()),
            ));
        }
        let heads = g.get_u64_per_layer(&k(keys::ATTENTION_HEAD_COUNT), n_all)?;
        let kv = g.get_u64_per_layer(&k(keys::ATTENTION_HEAD_COUNT_KV), n_all)?;
        let head_dim = g.get_usize(&k(keys::ATTENTION_KEY_LENGTH))?;
        if let Some(dv) = g.opt_usize(&k(keys::ATTENTION_VALUE_LENGTH))? {
            if dv != head_dim {
                return Err(Error::config(
                    g.path(),
                    k(keys::ATTENTION_VALUE_LENGTH),
                    format!("{dv}, unlike the key length {head_dim}"),
                ));
            }
        }
        // llama.cpp: `n_rot` defaults to the head, sliding layers keep it (or
        // `dimension_count_swa`), full layers rotate half of it (`load_arch_hparams`).
        let n_rot = g
            .opt_usize(&k(keys::ROPE_DIMENSION_COUNT))?
            .unwrap_or(head_dim);
        let n_rot_swa = g.opt_usize(&k(ROPE_DIMENSION_COUNT_SWA))?.unwrap_or(n_rot);
        let theta = g.opt_f32(&k(keys::ROPE_FREQ_BASE))?.unwrap_or(10000.0);
        let theta_swa = g.opt_f32(&k(ROPE_FREQ_BASE_SWA))?.unwrap_or(theta);
        let clamp_exp = limits(opt_f32_per_layer(g, &k(keys::SWIGLU_CLAMP_EXP), n_all)?);
        let clamp_shexp = limits(opt_f32_per_layer(g, &k(keys::SWIGLU_CLAMP_SHEXP), n_all)?);
        let moe = match g.opt_usize(&k(keys::EXPERT_COUNT))? {
            Some(n_expert) if n_expert > 0 => {
                // llama.cpp's step35 defaults the gating to sigmoid (`expert_gating_func` 2).
                let func = g.opt_u64(&k(keys::EXPERT_GATING_FUNC))?.unwrap_or(2);
                if func != 2 {
                    return Err(Error::Unsupported(format!(
                        "{}: {} = {func} (Step routes by sigmoid, 2)",
                        g.path().display(),
                        k(keys::EXPERT_GATING_FUNC)
                    )));
                }
                Some(Moe {
                    n_expert,
                    n_used: g.get_usize(&k(keys::EXPERT_USED_COUNT))?,
                    n_ff_exp: g.get_usize(&k(keys::EXPERT_FEED_FORWARD_LENGTH))?,
                    n_ff_shexp: g.get_usize(&k(keys::EXPERT_SHARED_FEED_FORWARD_LENGTH))?,
                    norm: g.opt_bool(&k(keys::EXPERT_WEIGHTS_NORM))?.unwrap_or(false),
                    scale: g.opt_f32(&k(keys::EXPERT_WEIGHTS_SCALE))?.unwrap_or(1.0),
                })
            }
            _ => None,
        };
        let layers = (0..n_all)
            .map(|l| LayerGeom {
                swa: swa[l],
                n_head: heads[l] as usize,
                n_head_kv: kv[l] as usize,
                n_rot: if swa[l] { n_rot_swa } else { n_rot / 2 },
                rope_theta: if swa[l] { theta_swa } else { theta },
                // Dense or MoE by tensor presence, as llama.cpp's graph decides.
                moe: f.tensor(&W::Router(l).gguf_name()).is_some(),
                clamp_exp: clamp_exp[l],
                clamp_shexp: clamp_shexp[l],
            })
            .collect();
        Ok(Hparams {
            n_layer: n_all - n_nextn,
            n_embd,
            n_vocab: vocab_of(f, n_embd)?,
            n_ff: g.get_usize(&k(keys::FEED_FORWARD_LENGTH))?,
            head_dim,
            layers,
            window: g
                .opt_usize(&k(keys::ATTENTION_SLIDING_WINDOW))?
                .unwrap_or(0),
            llama3: None,
            eps: g
                .opt_f32(&k(keys::ATTENTION_LAYERNORM_RMS_EPS))?
                .unwrap_or(1e-5),
            moe,
            n_nextn,
        })
    }

    /// The release's `config.json` (its remote-code form, under `text_config` for 3.7):
    /// per-layer lists padded with the MTP blocks' entries, the sliding layers' heads in
    /// `attention_other_setting`, the MoE blocks in `moe_layers_enum`.
    fn from_hf(f: &ModelFile, h: &HfModel) -> Result<Hparams> {
        let arch = h.architecture()?;
        if !ARCHS.contains(&arch.as_str()) {
            return Err(Error::Unsupported(format!(
                "{}: architecture {arch} is not Step-3.5/3.7",
                h.dir().display()
            )));
        }
        let cfg_err = |key: &str, what: String| Error::config(h.config_path(), key, what);
        let u = |key: &str| -> Result<usize> { Ok(h.cfg_u64(key)? as usize) };
        let n_layer = u("num_hidden_layers")?;
        let n_nextn = h.cfg_opt_u64("num_nextn_predict_layers")?.unwrap_or(0) as usize;
        let n_all = n_layer + n_nextn;
        let n_embd = u("hidden_size")?;
        let head_dim = u("head_dim")?;
        let n_head = u("num_attention_heads")?;
        let n_kv = match h.cfg_opt_u64("num_attention_groups")? {
            Some(n) => n as usize,
            None => u("num_key_value_heads")?,
        };
        let (n_head_swa, n_kv_swa) = (
            h.cfg_opt_u64("attention_other_setting.num_attention_heads")?
                .map_or(n_head, |n| n as usize),
            h.cfg_opt_u64("attention_other_setting.num_attention_groups")?
                .map_or(n_kv, |n| n as usize),
        );
        // A list per block (padded past the trunk) or one value for all.
        let per_layer = |key: &str, default: f64| -> Result<Vec<f64>> {
            match h.cfg_value(key) {
                None | Some(serde_json::Value::Null) => Ok(vec![default; n_all]),
                Some(serde_json::Value::Array(a)) if a.len() >= n_all => a[..n_all]
                    .iter()
                    .map(|v| match v {
                        serde_json::Value::Null => Ok(default),
                        v => v
                            .as_f64()
                            .ok_or_else(|| cfg_err(key, format!("entry {v}: expected a number"))),
                    })
                    .collect(),
                Some(serde_json::Value::Array(a)) => Err(cfg_err(
                    key,
                    format!("{} entries for {n_all} blocks", a.len()),
                )),
                Some(v) => v
                    .as_f64()
                    .map(|x| vec![x; n_all])
                    .ok_or_else(|| cfg_err(key, format!("{v}: expected a number or a list"))),
            }
        };
        let types = h.cfg_str_list("layer_types")?;
        if types.len() < n_all {
            return Err(cfg_err(
                "layer_types",
                format!("{} entries for {n_all} blocks", types.len()),
            ));
        }
        let theta = per_layer("rope_theta", 10000.0)?;
        let partial = per_layer("partial_rotary_factors", 1.0)?;
        let [clamp_exp, clamp_shexp] =
            ["swiglu_limits", "swiglu_limits_shared"].map(|key| -> Result<Vec<Option<f32>>> {
                Ok(limits(
                    per_layer(key, 0.0)?.iter().map(|&x| x as f32).collect(),
                ))
            });
        let (clamp_exp, clamp_shexp) = (clamp_exp?, clamp_shexp?);
        // transformers' Step3p7TextConfig: MoE from block 3 on when the list is absent.
        let moe_layers: Vec<usize> = match h.cfg_value("moe_layers_enum") {
            None | Some(serde_json::Value::Null) => (3..n_layer).collect(),
            Some(serde_json::Value::String(s)) => s
                .split(',')
                .filter(|x| !x.trim().is_empty())
                .map(|x| {
                    x.trim()
                        .parse()
                        .map_err(|_| cfg_err("moe_layers_enum", format!("entry {x:?}")))
                })
                .collect::<Result<_>>()?,
            Some(_) => h
                .cfg_u64_list("moe_layers_enum")?
                .into_iter()
                .map(|x| x as usize)
                .collect(),
        };
        if let Some(a) = h.cfg_opt_str("moe_router_activation")? {
            if a != "sigmoid" {
                return Err(cfg_err(
                    "moe_router_activation",
                    format!("{a} (Step routes by sigmoid)"),
                ));
            }
        }
        let mut layers = Vec::with_capacity(n_all);
        for (l, t) in types[..n_all].iter().enumerate() {
            let swa = match *t {
                "sliding_attention" => true,
                "full_attention" => false,
                other => {
                    return Err(cfg_err(
                        "layer_types",
                        format!("entry {l}: {other} (sliding_attention or full_attention)"),
                    ))
                }
            };
            let rot = partial[l] * head_dim as f64;
            layers.push(LayerGeom {
                swa,
                n_head: if swa { n_head_swa } else { n_head },
                n_head_kv: if swa { n_kv_swa } else { n_kv },
                n_rot: rot as usize,
                rope_theta: theta[l] as f32,
                moe: moe_layers.contains(&l),
                clamp_exp: clamp_exp[l],
                clamp_shexp: clamp_shexp[l],
            });
        }
        let any_moe = layers.iter().any(|g| g.moe);
        let moe = if any_moe {
            Some(Moe {
                n_expert: match h.cfg_opt_u64("moe_num_experts")? {
                    Some(n) => n as usize,
                    None => u("n_routed_experts")?,
                },
                n_used: match h.cfg_opt_u64("moe_top_k")? {
                    Some(n) => n as usize,
                    None => u("num_experts_per_tok")?,
                },
                n_ff_exp: u("moe_intermediate_size")?,
                n_ff_shexp: u("share_expert_dim")?,
                // transformers' Step3p7TopKRouter always renormalises.
                norm: true,
                scale: h.cfg_opt_f64("moe_router_scaling_factor")?.unwrap_or(1.0) as f32,
            })
        } else {
            None
        };
        let llama3 = match h.cfg_opt_str("rope_scaling.rope_type")? {
            None | Some("default") => None,
            Some("llama3") => {
                let r = |k: &str| -> Result<f32> {
                    Ok(h.cfg_f64(&format!("rope_scaling.{k}"))? as f32)
                };
                Some(Llama3 {
                    factor: r("factor")?,
                    low_freq_factor: r("low_freq_factor")?,
                    high_freq_factor: r("high_freq_factor")?,
                    original_max_positions: r("original_max_position_embeddings")?,
                })
            }
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "{}: rope_scaling type {other} (lathe reads llama3)",
                    h.config_path().display()
                )))
            }
        };
        Ok(Hparams {
            n_layer,
            n_embd,
            n_vocab: vocab_of(f, n_embd)?,
            n_ff: u("intermediate_size")?,
            head_dim,
            layers,
            window: h.cfg_opt_u64("sliding_window")?.unwrap_or(0) as usize,
            llama3,
            eps: h.cfg_opt_f64("rms_norm_eps")?.unwrap_or(1e-5) as f32,
            moe,
            n_nextn,
        })
    }

    /// Whether the blocks gate their attention output per head (HF
    /// `use_head_wise_attn_gate`; every step35 GGUF: the released models all do, and
    /// llama.cpp's graph would silently skip a missing gate).
    pub fn gated(f: &ModelFile) -> Result<bool> {
        match f {
            ModelFile::Gguf(_) => Ok(true),
            ModelFile::Hf(h) => Ok(h.cfg_opt_bool("use_head_wise_attn_gate")? != Some(false)),
        }
    }
}

/// Per-layer f32 values written as one scalar or an array of `n` (llama.cpp's
/// `get_key_or_arr`); all zero when absent.
fn opt_f32_per_layer(g: &GgufFile, key: &str, n: usize) -> Result<Vec<f32>> {
    match g.opt_array(key)? {
        Some(_) => {
            let a = g.get_f32_array(key)?;
            if a.len() != n {
                return Err(Error::config(
                    g.path(),
                    key,
                    format!("{} entries for {n} blocks", a.len()),
                ));
            }
            Ok(a)
        }
        None => Ok(vec![g.opt_f32(key)?.unwrap_or(0.0); n]),
    }
}

/// Per-block clamp limits, `None` where unclamped (llama.cpp's `limit > 1e-6` test).
fn limits(v: Vec<f32>) -> Vec<Option<f32>> {
    v.into_iter().map(|x| (x > 1e-6).then_some(x)).collect()
}

/// `[n_vocab, n_embd]` of the embedding (GGUF lists the dims the other way).
fn vocab_of(f: &ModelFile, n_embd: usize) -> Result<usize> {
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
