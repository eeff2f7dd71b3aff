//! DeepSeek-V4 (Flash, Pro): hyper-connections (`hc` copies of the hidden state mixed by a
//! Sinkhorn-normalised matrix), attention with one shared K=V head over a sliding window plus
//! compressed KV entries (ratio 4 with a lightning indexer choosing the top-k, ratio 128 all
//! of them), a grouped low-rank output projection, and a sqrt-softplus routed MoE with a
//! shared expert (the first layers route by token id through a hash table).
//!
//! Two formats load into one internal layout (see `weights.rs`): llama.cpp's GGUF
//! (`deepseek4`) and DeepSeek's own release layout (`config.json` with
//! `DeepseekV4ForCausalLM` + safetensors named `layers.N.attn.wq_a.weight`, FP8 block-scaled
//! linears, packed-MXFP4 routed experts). The math follows DeepSeek's `inference/model.py`
//! (see `cpu.rs`).

pub mod cpu;
pub mod gpu;
pub mod weights;

use super::ModelFile;
use crate::gguf::{GgufFile, Value};
use crate::safetensors::HfModel;
use crate::{Error, Result};

/// Router score function (`scoring_func` / GGUF `expert_gating_func`). The releases use
/// `SqrtSoftplus`; model.py also defines the other two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreFunc {
    Softmax,
    Sigmoid,
    SqrtSoftplus,
}

/// YaRN frequency interpolation of the compressed layers' RoPE (model.py
/// `precompute_freqs_cis` with `original_seq_len > 0`). There is no magnitude factor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    /// Positions the model was trained on before extension (`original_max_position_embeddings`).
    pub orig_ctx: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// Hyper-parameters. Widths are per head; products are derived by the methods.
#[derive(Clone, Debug)]
pub struct Hparams {
    /// Loaded from a GGUF (true) or DeepSeek's release layout (false).
    pub gguf: bool,
    /// Trunk layers (the MTP block not counted).
    pub n_layer: usize,
    /// The file has DeepSeek's multi-token prediction block (`mtp.0.*`, see `weights.rs`):
    /// one full block after the trunk, whose per-layer entries below sit at index `n_layer`.
    pub mtp: bool,
    pub n_embd: usize,
    pub n_vocab: usize,
    pub n_head: usize,
    /// Width of a query head and of the one shared K=V head.
    pub head_dim: usize,
    /// RoPE dims: the LAST `n_rot` of every head (q, kv, compressed kv, indexer q/k).
    pub n_rot: usize,
    pub q_lora: usize,
    /// Output projection: heads split into `o_groups`, each projected to `o_lora`.
    pub o_groups: usize,
    pub o_lora: usize,
    /// Sliding window, the current token included.
    pub window: usize,
    /// Per block (trunk layers, then the MTP block): 0 = sliding window only; 4 =
    /// overlapping compressor + indexer; other m = a compressor of ratio m whose entries are
    /// all attended.
    pub compress_ratio: Vec<usize>,
    /// RoPE base of sliding-only layers (no YaRN there).
    pub rope_theta: f32,
    /// RoPE base of compressed layers, with `yarn` when set.
    pub compress_rope_theta: f32,
    pub yarn: Option<Yarn>,
    pub n_ix_head: usize,
    pub ix_head_dim: usize,
    pub ix_topk: usize,
    /// Hyper-connection copies, Sinkhorn iterations and epsilon.
    pub hc: usize,
    pub hc_iters: usize,
    pub hc_eps: f32,
    /// RMSNorm epsilon (every norm, the per-head q norm and the hc RMS scale).
    pub eps: f32,
    pub n_expert: usize,
    pub n_used: usize,
    pub n_ff_exp: usize,
    /// Shared expert width (`n_shared_experts · moe_intermediate_size`).
    pub n_ff_shexp: usize,
    /// Layers `0..n_hash_layers` pick experts by `tid2eid[token]`.
    pub n_hash_layers: usize,
    pub score_func: ScoreFunc,
    pub route_scale: f32,
    pub norm_topk: bool,
    /// Per block SwiGLU clamp of routed and shared experts (0: none).
    pub swiglu_limit: Vec<f32>,
    pub swiglu_limit_shexp: Vec<f32>,
}

impl Hparams {
    /// Entries of `hc_*_fn` / `hc_*_base`: pre (hc) | post (hc) | comb (hc·hc).
    pub fn hc_mix(&self) -> usize {
        (2 + self.hc) * self.hc
    }
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
    /// Ratio-4 layers overlap consecutive windows (model.py `overlap = compress_ratio == 4`).
    pub fn overlap(&self, l: usize) -> bool {
        self.compress_ratio[l] == 4
    }
    /// Ratio-4 layers choose their compressed entries with a lightning indexer.
    pub fn has_indexer(&self, l: usize) -> bool {
        self.compress_ratio[l] == 4
    }
    pub fn is_hash(&self, l: usize) -> bool {
        l < self.n_hash_layers
    }
    /// Blocks with per-block entries: the trunk's layers, then the MTP block if any.
    pub fn n_blocks(&self) -> usize {
        self.n_layer + usize::from(self.mtp)
    }

    /// RoPE inverse frequencies of layer `l` (`n_rot / 2` pairs), in f32 as model.py and
    /// transformers compute them: base `rope_theta` on sliding-only layers, and
    /// `compress_rope_theta` with YaRN interpolation on compressed layers.
    pub fn rope_freqs(&self, l: usize) -> Vec<f32> {
        let compressed = self.compress_ratio[l] != 0;
        let base = if compressed {
            self.compress_rope_theta
        } else {
            self.rope_theta
        };
        let yarn = if compressed { self.yarn } else { None };
        rope_freqs(self.n_rot, base, yarn)
    }

    pub fn from_file(f: &ModelFile) -> Result<Hparams> {
        match f {
            ModelFile::Gguf(g) => Self::from_gguf(g),
            ModelFile::Hf(h) => Self::from_upstream(h),
        }
    }

    fn from_gguf(g: &GgufFile) -> Result<Hparams> {
        let arch = g.architecture()?;
        if arch != "deepseek4" {
            return Err(Error::Unsupported(format!(
                "{}: architecture {arch} is not DeepSeek-V4 (deepseek4)",
                g.path().display()
            )));
        }
        let k = |s: &str| format!("deepseek4.{s}");
        let n_layer = g.get_usize(&k("block_count"))?;
        let n_embd = g.get_usize(&k("embedding_length"))?;
        let n_head = g.get_usize(&k("attention.head_count"))?;
        let kv = g.opt_usize(&k("attention.head_count_kv"))?.unwrap_or(1);
        if kv != 1 {
            return Err(Error::config(
                g.path(),
                k("attention.head_count_kv"),
                format!("{kv}: DeepSeek-V4 has one shared K=V head"),
            ));
        }
        let head_dim = g.get_usize(&k("attention.key_length"))?;
        let n_vocab = match g.opt_usize(&k("vocab_size"))? {
            Some(v) => v,
            None => g.require("token_embd.weight")?.shape[0] as usize,
        };
        let ratios_key = k("attention.compress_ratios");
        let ratios = g.get_u64_array(&ratios_key)?;
        let yarn = match g.opt_str(&k("rope.scaling.type"))? {
            Some("yarn") => Some(Yarn {
                factor: g.get_f32(&k("rope.scaling.factor"))?,
                orig_ctx: g.get_usize(&k("rope.scaling.original_context_length"))?,
                beta_fast: g
                    .opt_f32(&k("rope.scaling.yarn_beta_fast"))?
                    .unwrap_or(32.0),
                beta_slow: g.opt_f32(&k("rope.scaling.yarn_beta_slow"))?.unwrap_or(1.0),
            }),
            Some("none") | None => None,
            Some(t) => {
                return Err(Error::config(
                    g.path(),
                    k("rope.scaling.type"),
                    format!("{t}: only yarn is supported"),
                ))
            }
        };
        // llama.cpp's enum llama_expert_gating_func_type: 1 softmax, 2 sigmoid, 4 sqrt(softplus);
        // its deepseek4 loader treats a missing / 0 value as sqrt(softplus).
        let score_func = match g.opt_u64(&k("expert_gating_func"))?.unwrap_or(4) {
            0 | 4 => ScoreFunc::SqrtSoftplus,
            1 => ScoreFunc::Softmax,
            2 => ScoreFunc::Sigmoid,
            v => {
                return Err(Error::config(
                    g.path(),
                    k("expert_gating_func"),
                    format!("unknown gating function {v}"),
                ))
            }
        };
        let n_ff_exp = g.get_usize(&k("expert_feed_forward_length"))?;
        let n_shared = g.opt_usize(&k("expert_shared_count"))?.unwrap_or(1);
        // llama.cpp's `nextn_predict_layers` key; the block is there when its attention is.
        let mtp = g.opt_usize(&k("nextn_predict_layers"))?.unwrap_or(0) > 0
            && g.tensor(&weights::W::WqA(weights::mtp_block(0)).gguf_name())
                .is_some();
        let n_blocks = n_layer + usize::from(mtp);
        let hp = Hparams {
            gguf: true,
            n_layer,
            mtp,
            n_embd,
            n_vocab,
            n_head,
            head_dim,
            n_rot: g.get_usize(&k("rope.dimension_count"))?,
            q_lora: g.get_usize(&k("attention.q_lora_rank"))?,
            o_groups: g.get_usize(&k("attention.output_group_count"))?,
            o_lora: g.get_usize(&k("attention.output_lora_rank"))?,
            window: g.get_usize(&k("attention.sliding_window"))?,
            compress_ratio: per_layer_ratios(ratios, n_layer, mtp)
                .map_err(|w| Error::config(g.path(), &ratios_key, w))?,
            rope_theta: g.opt_f32(&k("rope.freq_base"))?.unwrap_or(10000.0),
            compress_rope_theta: g.get_f32(&k("attention.compress_rope_freq_base"))?,
            yarn,
            n_ix_head: g
                .opt_usize(&k("attention.indexer.head_count"))?
                .unwrap_or(0),
            ix_head_dim: g
                .opt_usize(&k("attention.indexer.key_length"))?
                .unwrap_or(0),
            ix_topk: g.opt_usize(&k("attention.indexer.top_k"))?.unwrap_or(0),
            hc: g.get_usize(&k("hyper_connection.count"))?,
            hc_iters: g.get_usize(&k("hyper_connection.sinkhorn_iterations"))?,
            hc_eps: g.opt_f32(&k("hyper_connection.epsilon"))?.unwrap_or(1e-6),
            eps: g
                .opt_f32(&k("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-6),
            n_expert: g.get_usize(&k("expert_count"))?,
            n_used: g.get_usize(&k("expert_used_count"))?,
            n_ff_exp,
            n_ff_shexp: n_ff_exp * n_shared,
            n_hash_layers: g.opt_usize(&k("hash_layer_count"))?.unwrap_or(0),
            score_func,
            route_scale: g.opt_f32(&k("expert_weights_scale"))?.unwrap_or(1.0),
            norm_topk: g.opt_bool(&k("expert_weights_norm"))?.unwrap_or(true),
            swiglu_limit: gguf_f32_per_layer(g, &k("swiglu_clamp_exp"), n_layer, n_blocks)?,
            swiglu_limit_shexp: gguf_f32_per_layer(g, &k("swiglu_clamp_shexp"), n_layer, n_blocks)?,
        };
        hp.validate(&g.path().display().to_string())
    }

    /// DeepSeek's release `config.json` (the keys transformers' `DeepseekV4Config` shares
    /// with it, rope spelled flat: `rope_theta`, `compress_rope_theta`, `rope_scaling`).
    fn from_upstream(h: &HfModel) -> Result<Hparams> {
        let arch = h.architecture()?;
        if arch != "DeepseekV4ForCausalLM" {
            return Err(Error::Unsupported(format!(
                "{}: architecture {arch} is not DeepSeek-V4 (DeepseekV4ForCausalLM)",
                h.dir().display()
            )));
        }
        let u = |key: &str| h.cfg_u64(key).map(|v| v as usize);
        let ou = |key: &str| h.cfg_opt_u64(key).map(|v| v.map(|v| v as usize));
        let of = |key: &str| h.cfg_opt_f64(key).map(|v| v.map(|v| v as f32));
        let n_layer = u("num_hidden_layers")?;
        if let Some(kv) = ou("num_key_value_heads")? {
            if kv != 1 {
                return Err(Error::config(
                    h.config_path(),
                    "num_key_value_heads",
                    format!("{kv}: DeepSeek-V4 has one shared K=V head"),
                ));
            }
        }
        let yarn = match h.cfg_value("rope_scaling") {
            None | Some(serde_json::Value::Null) => None,
            Some(_) => {
                let ty = match h.cfg_opt_str("rope_scaling.type")? {
                    Some(t) => Some(t),
                    None => h.cfg_opt_str("rope_scaling.rope_type")?,
                };
                match ty {
                    Some("yarn") => Some(Yarn {
                        factor: h.cfg_f64("rope_scaling.factor")? as f32,
                        orig_ctx: u("rope_scaling.original_max_position_embeddings")?,
                        beta_fast: of("rope_scaling.beta_fast")?.unwrap_or(32.0),
                        beta_slow: of("rope_scaling.beta_slow")?.unwrap_or(1.0),
                    }),
                    t => {
                        return Err(Error::config(
                            h.config_path(),
                            "rope_scaling.type",
                            format!("{t:?}: only yarn is supported"),
                        ))
                    }
                }
            }
        };
        let score_func = match h.cfg_opt_str("scoring_func")?.unwrap_or("sqrtsoftplus") {
            "sqrtsoftplus" => ScoreFunc::SqrtSoftplus,
            "sigmoid" => ScoreFunc::Sigmoid,
            "softmax" => ScoreFunc::Softmax,
            s => {
                return Err(Error::config(
                    h.config_path(),
                    "scoring_func",
                    format!("unknown score function {s}"),
                ))
            }
        };
        let ratios = h.cfg_u64_list("compress_ratios")?;
        let n_ff_exp = u("moe_intermediate_size")?;
        let limit = of("swiglu_limit")?.unwrap_or(0.0);
        // `num_nextn_predict_layers` may be set in a config whose file has no `mtp.*`: the
        // block is there when its attention is.
        let mtp = ou("num_nextn_predict_layers")?.unwrap_or(0) > 0
            && h.tensor(&weights::W::WqA(weights::mtp_block(0)).upstream_name())
                .is_some();
        let n_blocks = n_layer + usize::from(mtp);
        let hp = Hparams {
            gguf: false,
            n_layer,
            mtp,
            n_embd: u("hidden_size")?,
            n_vocab: u("vocab_size")?,
            n_head: u("num_attention_heads")?,
            head_dim: u("head_dim")?,
            n_rot: u("qk_rope_head_dim")?,
            q_lora: u("q_lora_rank")?,
            o_groups: u("o_groups")?,
            o_lora: u("o_lora_rank")?,
            window: u("sliding_window")?,
            compress_ratio: per_layer_ratios(ratios, n_layer, mtp)
                .map_err(|w| Error::config(h.config_path(), "compress_ratios", w))?,
            rope_theta: of("rope_theta")?.unwrap_or(10000.0),
            compress_rope_theta: of("compress_rope_theta")?.unwrap_or(160000.0),
            yarn,
            n_ix_head: ou("index_n_heads")?.unwrap_or(0),
            ix_head_dim: ou("index_head_dim")?.unwrap_or(0),
            ix_topk: ou("index_topk")?.unwrap_or(0),
            hc: ou("hc_mult")?.unwrap_or(4),
            hc_iters: ou("hc_sinkhorn_iters")?.unwrap_or(20),
            hc_eps: of("hc_eps")?.unwrap_or(1e-6),
            eps: of("rms_norm_eps")?.unwrap_or(1e-6),
            n_expert: u("n_routed_experts")?,
            n_used: u("num_experts_per_tok")?,
            n_ff_exp,
            n_ff_shexp: n_ff_exp * ou("n_shared_experts")?.unwrap_or(1),
            n_hash_layers: ou("num_hash_layers")?.unwrap_or(0),
            score_func,
            route_scale: of("routed_scaling_factor")?.unwrap_or(1.0),
            // model.py renormalises the chosen weights for every score function but softmax.
            norm_topk: score_func != ScoreFunc::Softmax,
            swiglu_limit: vec![limit; n_blocks],
            swiglu_limit_shexp: vec![limit; n_blocks],
        };
        hp.validate(&h.config_path().display().to_string())
    }

    fn validate(self, file: &str) -> Result<Hparams> {
        let bad = |what: String| Err(Error::Invalid(format!("{file}: {what}")));
        if self.n_layer == 0 || self.n_embd == 0 || self.n_vocab == 0 || self.n_head == 0 {
            return bad("zero layers, width, heads or vocabulary".into());
        }
        if self.n_rot > self.head_dim || !self.n_rot.is_multiple_of(2) || self.n_rot == 0 {
            return bad(format!(
                "rope dims {} invalid for head size {}",
                self.n_rot, self.head_dim
            ));
        }
        if self.o_groups == 0 || !self.n_head.is_multiple_of(self.o_groups) {
            return bad(format!(
                "{} heads not a multiple of {} output groups",
                self.n_head, self.o_groups
            ));
        }
        if self.window == 0 || self.hc == 0 || self.hc_iters == 0 {
            return bad("zero window, hyper-connection copies or Sinkhorn iterations".into());
        }
        if self.hc_iters > MAX_SINKHORN_ITERS {
            return bad(format!(
                "{} Sinkhorn iterations (`hyper_connection.sinkhorn_iterations` / `hc_sinkhorn_iters`): at most {MAX_SINKHORN_ITERS} (the released models use 20)",
                self.hc_iters
            ));
        }
        if self.n_used == 0 || self.n_used > self.n_expert {
            return bad(format!("{} experts used of {}", self.n_used, self.n_expert));
        }
        if self.n_hash_layers > self.n_layer {
            return bad(format!(
                "{} hash layers of {}",
                self.n_hash_layers, self.n_layer
            ));
        }
        if self.compress_ratio.contains(&4)
            && (self.n_ix_head == 0 || self.ix_topk == 0 || self.ix_head_dim < self.n_rot)
        {
            return bad(format!(
                "ratio-4 layers need an indexer: {} heads × {} (rope {}), top-{}",
                self.n_ix_head, self.ix_head_dim, self.n_rot, self.ix_topk
            ));
        }
        if let Some(y) = self.yarn {
            if y.factor <= 0.0 || y.orig_ctx == 0 {
                return bad(format!(
                    "YaRN factor {} from {} positions",
                    y.factor, y.orig_ctx
                ));
            }
        }
        Ok(self)
    }
}

/// Most Sinkhorn iterations of the hyper-connection mix accepted. The normalisation has
/// converged long before; more would only burn time per token.
const MAX_SINKHORN_ITERS: usize = 1000;

/// The first `n_layer` ratios, and with `mtp` the MTP block's: the releases append it
/// (0, window only, when absent).
fn per_layer_ratios(
    ratios: Vec<u64>,
    n_layer: usize,
    mtp: bool,
) -> std::result::Result<Vec<usize>, String> {
    if ratios.len() < n_layer {
        return Err(format!("{} entries for {n_layer} layers", ratios.len()));
    }
    let n = n_layer + usize::from(mtp);
    Ok((0..n)
        .map(|i| ratios.get(i).copied().unwrap_or(0) as usize)
        .collect())
}

/// A per-layer float stored as one scalar or one value per layer (llama.cpp
/// `get_key_or_arr`); missing: 0 (no clamp). `n_blocks` entries: an MTP block without its
/// own entry takes the last layer's.
fn gguf_f32_per_layer(
    g: &GgufFile,
    key: &str,
    n_layer: usize,
    n_blocks: usize,
) -> Result<Vec<f32>> {
    match g.get(key) {
        None => Ok(vec![0.0; n_blocks]),
        Some(Value::Array(_)) => {
            let a = g.get_f32_array(key)?;
            if a.len() < n_layer {
                return Err(Error::config(
                    g.path(),
                    key,
                    format!("{} entries for {n_layer} layers", a.len()),
                ));
            }
            Ok((0..n_blocks)
                .map(|i| a.get(i).or(a.last()).copied().unwrap_or(0.0))
                .collect())
        }
        Some(_) => Ok(vec![g.get_f32(key)?; n_blocks]),
    }
}

/// model.py `precompute_freqs_cis`: `1/base^(2i/dim)` for `i < dim/2`; with YaRN, blended
/// towards `freq/factor` below the `beta_fast`/`beta_slow` correction range (a linear ramp
/// over pair indices whose ends are clamped to `[0, dim-1]`, as the reference clamps them).
pub fn rope_freqs(dim: usize, base: f32, yarn: Option<Yarn>) -> Vec<f32> {
    let mut freqs: Vec<f32> = (0..dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32))
        .collect();
    if let Some(y) = yarn {
        let corr = |rot: f32| {
            dim as f64 * (y.orig_ctx as f64 / (rot as f64 * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * (base as f64).ln())
        };
        let low = corr(y.beta_fast).floor().max(0.0);
        let mut high = corr(y.beta_slow).ceil().min(dim as f64 - 1.0);
        if low == high {
            high += 0.001;
        }
        for (i, f) in freqs.iter_mut().enumerate() {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0) as f32;
            let smooth = 1.0 - ramp;
            *f = *f / y.factor * (1.0 - smooth) + *f * smooth;
        }
    }
    freqs
}
