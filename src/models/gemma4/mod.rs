//! Gemma-4 (dense): pre-norm blocks whose attention is per layer sliding-window or global,
//! with their own head size, KV head count and RoPE each (the pattern comes from the file);
//! RMSNorm on the q and k heads and a weightless one on v; post-attention and post-FFN norms
//! before each residual add; a GELU-gated FFN; a per-layer output scalar; embeddings scaled
//! by `sqrt(n_embd)`; the head tied to the embedding unless the file has `output.weight`;
//! and the final logits softcapped when the config says so.
//!
//! Facts from llama.cpp's `src/models/gemma4.cpp` and its converter (`conversion/gemma.py`,
//! `Gemma4Model`) and from transformers 5.24's `modeling_gemma4.py`:
//! - Global layers may ship no `attn_v` (`attention_k_eq_v`): V is the K projection before
//!   its norm and RoPE, normed by the weightless RMSNorm.
//! - Global layers use HF's "proportional" RoPE: the whole head rotates in NEOX pairs
//!   `(i, i + head_dim/2)` with `inv_freq_i = theta^(-2i/head_dim)` for the first
//!   `partial_rotary_factor · head_dim/2` pairs and 0 for the rest; llama.cpp's converter
//!   writes that as `rope_freqs.weight` (1 then 1e30 divisors) over `n_rot = head_dim`.
//! - Gemma-4's RMSNorm multiplies by `w` (not `1 + w` as Gemma 3's): the converter's
//!   `norm_shift` is 0, so GGUF and HF weights are the same numbers.
//! - Attention scores are not scaled (`self.scaling = 1.0`): the q/k norms set the scale.
//!
//! MoE blocks (the 26B-A4B layout; a block is MoE when its file has the router
//! `ffn_gate_inp`, as llama.cpp decides): the dense MLP runs as a shared branch, normed by
//! `post_ffw_norm_1`, beside the routed experts, whose input is `pre_ffw_norm_2(x)` and whose
//! weighted sum is normed by `post_ffw_norm_2`; the two add before `post_ffw_norm`. The
//! router reads the block's input `x` itself: `proj · (rms_norm(x) ⊙ scale / sqrt(n_embd))`
//! (HF `Gemma4TextRouter`), softmax over all experts, top-k renormalised, each weight times
//! its expert's `per_expert_scale` (GGUF `ffn_down_exps.scale`). Experts are GeGLU, gate and
//! up fused in one stack, gate rows first (the registry's `ExpertNames`).
//!
//! The E2B/E4B layout (files with `per_layer_token_embd`, HF `embed_tokens_per_layer`) adds
//! per-layer embeddings (HF `Gemma4TextModel.get_per_layer_inputs` and
//! `project_per_layer_inputs`, llama.cpp `build_inp_per_layer` and `project_per_layer_inputs`):
//! a second token table of `n_epl` columns per block, its rows times `sqrt(n_epl)`, plus
//! `rms_norm(per_layer_model_proj · x0 / sqrt(n_embd))` per block's `n_epl` slice (`x0` the
//! scaled embedding, the norm `per_layer_proj_norm`), the sum times `1/sqrt(2)`: block `l`'s
//! input `p_l`. After its FFN residual (before the layer scalar) each block adds
//! `post_norm(proj · (gelu_tanh(inp_gate · x) ⊙ p_l))` (HF `Gemma4TextDecoderLayer`).
//!
//! KV sharing (`num_kv_shared_layers`, GGUF `attention.shared_kv_layers`): the last blocks
//! have no K/V of their own and attend the cache of the last earlier non-shared block of
//! their attention type (HF `kv_sharing_modes` "store"/"reuse", llama.cpp
//! `n_layer_kv_from_start`); K/V weights a file ships for them are ignored, as HF ignores
//! them (`_keys_to_ignore_on_load_unexpected`). With `use_double_wide_mlp` (E2B) the shared
//! blocks' FFN is twice `intermediate_size` wide (GGUF files say so per layer).

pub mod gpu;

use super::ModelFile;
use crate::gguf::keys::{self, key};
use crate::gguf::GgufFile;
use crate::safetensors::HfModel;
use crate::{Error, Result};

/// GGUF `general.architecture` and HF `architectures` values of the family.
pub const ARCHS: &[&str] = &["gemma4", "Gemma4ForCausalLM"];

/// Gemma-4's own GGUF keys (llama.cpp's `LLM_KV_*` names, under the architecture prefix);
/// the shared ones are in `gguf::keys`.
pub mod gguf_keys {
    pub const SLIDING_WINDOW_PATTERN: &str = "attention.sliding_window_pattern";
    pub const KEY_LENGTH_SWA: &str = "attention.key_length_swa";
    pub const VALUE_LENGTH_SWA: &str = "attention.value_length_swa";
    pub const ROPE_FREQ_BASE_SWA: &str = "rope.freq_base_swa";
    pub const ROPE_DIMENSION_COUNT_SWA: &str = "rope.dimension_count_swa";
    pub const FINAL_LOGIT_SOFTCAPPING: &str = "final_logit_softcapping";
    pub const SHARED_KV_LAYERS: &str = "attention.shared_kv_layers";
    pub const EMBEDDING_LENGTH_PER_LAYER: &str = "embedding_length_per_layer_input";
}

/// Tensor roles; [`W::gguf_name`] and [`W::hf_name`] are the one name table (llama.cpp's
/// `LLM_TENSOR_*` names, transformers' `Gemma4ForCausalLM` state dict).
#[derive(Clone, Copy, Debug)]
pub enum W {
    TokEmbd,
    /// Optional: absent when the head is tied to the embedding.
    Output,
    OutputNorm,
    /// GGUF only: the global layers' RoPE divisors (HF derives them from the config).
    RopeFreqs,
    AttnNorm(usize),
    Q(usize),
    K(usize),
    /// Optional on global layers (`attention_k_eq_v`).
    V(usize),
    QNorm(usize),
    KNorm(usize),
    O(usize),
    PostAttnNorm(usize),
    FfnNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    PostFfnNorm(usize),
    /// `[1]`: the block's output multiplier.
    OutScale(usize),
    /// MoE blocks only: the router `[n_expert, n_embd]`, its input scale `[n_embd]`, the
    /// per-expert output scales `[n_expert]`, and the norms of the two branches `[n_embd]`.
    Router(usize),
    RouterScale(usize),
    ExpertScale(usize),
    PreFfnNorm2(usize),
    PostFfnNorm1(usize),
    PostFfnNorm2(usize),
    /// MoE blocks only: the fused gate+up stack `[n_expert, 2·n_ff_exp, n_embd]` (gate rows
    /// first) and the down stack `[n_expert, n_embd, n_ff_exp]`, as the registry's
    /// `GEMMA4_FUSED` names them for the planner.
    GateUpExps(usize),
    DownExps(usize),
    /// MoE blocks of GGUF files that carry the gate and up stacks apart
    /// (`[n_expert, n_ff_exp, n_embd]` each; llama.cpp's `LLM_TENSOR_FFN_GATE_EXPS` /
    /// `_UP_EXPS`, which its Gemma-4 graph takes where the fused stack is absent).
    /// transformers' `Gemma4TextExperts` has only the fused `gate_up_proj`: the checkpoint
    /// names below are never present, so a checkpoint needs the fused stack.
    GateExps(usize),
    UpExps(usize),
    /// Per-layer embeddings only (module doc): the token table `[n_vocab, n_layer·n_epl]`,
    /// the embedding's projection `[n_layer·n_epl, n_embd]` and its norm `[n_epl]`; per
    /// block the gate `[n_epl, n_embd]`, the projection back `[n_embd, n_epl]` and its norm
    /// `[n_embd]`.
    PerLayerTokEmbd,
    PerLayerModelProj,
    PerLayerProjNorm,
    PerLayerGate(usize),
    PerLayerProj(usize),
    PerLayerPostNorm(usize),
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
            O(l) => b(l, "attn_output.weight"),
            PostAttnNorm(l) => b(l, "post_attention_norm.weight"),
            FfnNorm(l) => b(l, "ffn_norm.weight"),
            Gate(l) => b(l, "ffn_gate.weight"),
            Up(l) => b(l, "ffn_up.weight"),
            Down(l) => b(l, "ffn_down.weight"),
            PostFfnNorm(l) => b(l, "post_ffw_norm.weight"),
            OutScale(l) => b(l, "layer_output_scale.weight"),
            Router(l) => b(l, "ffn_gate_inp.weight"),
            RouterScale(l) => b(l, "ffn_gate_inp.scale"),
            ExpertScale(l) => b(l, "ffn_down_exps.scale"),
            PreFfnNorm2(l) => b(l, "pre_ffw_norm_2.weight"),
            PostFfnNorm1(l) => b(l, "post_ffw_norm_1.weight"),
            PostFfnNorm2(l) => b(l, "post_ffw_norm_2.weight"),
            GateUpExps(l) => b(l, "ffn_gate_up_exps.weight"),
            DownExps(l) => b(l, "ffn_down_exps.weight"),
            GateExps(l) => b(l, "ffn_gate_exps.weight"),
            UpExps(l) => b(l, "ffn_up_exps.weight"),
            PerLayerTokEmbd => "per_layer_token_embd.weight".into(),
            PerLayerModelProj => "per_layer_model_proj.weight".into(),
            PerLayerProjNorm => "per_layer_proj_norm.weight".into(),
            PerLayerGate(l) => b(l, "inp_gate.weight"),
            PerLayerProj(l) => b(l, "proj.weight"),
            PerLayerPostNorm(l) => b(l, "post_norm.weight"),
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
            O(l) => b(l, "self_attn.o_proj.weight"),
            PostAttnNorm(l) => b(l, "post_attention_layernorm.weight"),
            FfnNorm(l) => b(l, "pre_feedforward_layernorm.weight"),
            Gate(l) => b(l, "mlp.gate_proj.weight"),
            Up(l) => b(l, "mlp.up_proj.weight"),
            Down(l) => b(l, "mlp.down_proj.weight"),
            PostFfnNorm(l) => b(l, "post_feedforward_layernorm.weight"),
            OutScale(l) => b(l, "layer_scalar"),
            Router(l) => b(l, "router.proj.weight"),
            RouterScale(l) => b(l, "router.scale"),
            ExpertScale(l) => b(l, "router.per_expert_scale"),
            PreFfnNorm2(l) => b(l, "pre_feedforward_layernorm_2.weight"),
            PostFfnNorm1(l) => b(l, "post_feedforward_layernorm_1.weight"),
            PostFfnNorm2(l) => b(l, "post_feedforward_layernorm_2.weight"),
            GateUpExps(l) => b(l, "experts.gate_up_proj"),
            DownExps(l) => b(l, "experts.down_proj"),
            GateExps(l) => b(l, "experts.gate_proj"),
            UpExps(l) => b(l, "experts.up_proj"),
            PerLayerTokEmbd => "model.embed_tokens_per_layer.weight".into(),
            PerLayerModelProj => "model.per_layer_model_projection.weight".into(),
            PerLayerProjNorm => "model.per_layer_projection_norm.weight".into(),
            PerLayerGate(l) => b(l, "per_layer_input_gate.weight"),
            PerLayerProj(l) => b(l, "per_layer_projection.weight"),
            PerLayerPostNorm(l) => b(l, "post_per_layer_input_norm.weight"),
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

/// One block's attention geometry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerGeom {
    /// Sliding-window layer (else global).
    pub swa: bool,
    pub head_dim: usize,
    pub n_head_kv: usize,
    pub n_ff: usize,
    /// A MoE block (its file has the router): the dense FFN is its shared branch.
    pub moe: bool,
}

/// The routed experts of the MoE blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Moe {
    pub n_expert: usize,
    /// Experts per token (top-k).
    pub n_used: usize,
    /// Each expert's FFN width.
    pub n_ff_exp: usize,
}

/// Experts per token and each expert's FFN width, as a MoE file's metadata says.
type ExpertCounts = (Option<usize>, Option<usize>);

/// Hyper-parameters.
#[derive(Clone, Debug)]
pub struct Hparams {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_vocab: usize,
    pub n_head: usize,
    pub layers: Vec<LayerGeom>,
    /// Keys a sliding layer's query sees: positions `p - window < j <= p`.
    pub window: usize,
    pub rope_theta: f32,
    pub rope_theta_swa: f32,
    /// Rotated pairs of a global head (the rest have frequency 0); GGUF files carry it as
    /// `rope_freqs.weight` instead (`None`).
    pub rope_pairs_global: Option<usize>,
    pub eps: f32,
    /// `final_logit_softcapping`.
    pub softcap: Option<f32>,
    /// `Some` when any block is MoE.
    pub moe: Option<Moe>,
    /// Per-layer embedding columns per block (0: none).
    pub n_epl: usize,
    /// The last blocks that attend an earlier block's KV cache (module doc).
    pub n_kv_shared: usize,
}

impl Hparams {
    pub fn from_file(f: &ModelFile) -> Result<Hparams> {
        let (mut hp, (n_used, n_ff_exp)) = match f {
            ModelFile::Gguf(g) => Self::from_gguf(g)?,
            ModelFile::Hf(h) => Self::from_hf(h)?,
        };
        // MoE blocks by tensor presence, as llama.cpp decides (`ffn_gate_inp`).
        let mut n_expert = None;
        for l in 0..hp.n_layer {
            let Some(r) = f.tensor(&W::Router(l).name(f)) else {
                continue;
            };
            let n = match r.shape {
                [n, e] if *e as usize == hp.n_embd && *n > 0 => *n as usize,
                s => {
                    return Err(Error::tensor(
                        r.path,
                        r.name,
                        format!("shape {s:?}, expected [n_expert, {}]", hp.n_embd),
                    ))
                }
            };
            if *n_expert.get_or_insert(n) != n {
                return Err(Error::tensor(
                    r.path,
                    r.name,
                    format!("{n} experts, earlier blocks have {}", n_expert.unwrap_or(0)),
                ));
            }
            hp.layers[l].moe = true;
        }
        hp.n_epl = per_layer_width(f, &hp)?;
        if let Some(n_expert) = n_expert {
            let n_used = n_used.unwrap_or(0);
            if n_used == 0 || n_used > n_expert {
                return Err(Error::format(
                    f.path(),
                    format!("Gemma-4: {n_used} experts used of {n_expert}"),
                ));
            }
            let n_ff_exp = n_ff_exp.unwrap_or(0);
            if n_ff_exp == 0 {
                return Err(Error::format(
                    f.path(),
                    "Gemma-4 MoE: no expert FFN width (GGUF expert_feed_forward_length, \
                     HF moe_intermediate_size)",
                ));
            }
            hp.moe = Some(Moe {
                n_expert,
                n_used,
                n_ff_exp,
            });
        }
        Ok(hp)
    }

    /// Blocks with a KV cache of their own: the first `n_layer - n_kv_shared`.
    pub fn n_kv_layers(&self) -> usize {
        self.n_layer - self.n_kv_shared
    }

    /// The block whose KV cache block `l` attends: itself, or for a shared block the last
    /// non-shared block of its attention type ([`Hparams::check`] makes sure there is one).
    pub fn kv_layer(&self, l: usize) -> usize {
        let own = self.n_kv_layers();
        if l < own {
            return l;
        }
        let swa = self.layers[l].swa;
        (0..own)
            .rev()
            .find(|&s| self.layers[s].swa == swa)
            .unwrap_or(l)
    }

    fn check(self, path: &std::path::Path) -> Result<Hparams> {
        let bad = |what: String| Err(Error::format(path, what));
        if self.n_kv_shared >= self.n_layer {
            return bad(format!(
                "{} of {} blocks share KV (at least the first must have its own)",
                self.n_kv_shared, self.n_layer
            ));
        }
        for l in self.n_kv_layers()..self.n_layer {
            let s = self.kv_layer(l);
            let (a, b) = (&self.layers[l], &self.layers[s]);
            if s == l {
                return bad(format!(
                    "KV-shared block {l} ({}) has no earlier non-shared block of its type",
                    if a.swa { "sliding" } else { "global" }
                ));
            }
            if (a.head_dim, a.n_head_kv) != (b.head_dim, b.n_head_kv) {
                return bad(format!(
                    "KV-shared block {l} has {} KV heads of {}, its KV block {s} {} of {}",
                    a.n_head_kv, a.head_dim, b.n_head_kv, b.head_dim
                ));
            }
        }
        if self.n_head == 0 || self.layers.len() != self.n_layer {
            return bad(format!(
                "{} heads, {} layer types for {} blocks",
                self.n_head,
                self.layers.len(),
                self.n_layer
            ));
        }
        for (l, g) in self.layers.iter().enumerate() {
            if g.n_head_kv == 0
                || !self.n_head.is_multiple_of(g.n_head_kv)
                || g.head_dim == 0
                || !g.head_dim.is_multiple_of(2)
            {
                return bad(format!(
                    "block {l}: {} KV heads of {} for {} query heads",
                    g.n_head_kv, g.head_dim, self.n_head
                ));
            }
        }
        if self.layers.iter().any(|g| g.swa) && self.window == 0 {
            return bad("sliding layers with a window of 0".into());
        }
        if let Some(c) = self.softcap {
            if !(c.is_finite() && c > 0.0) {
                return bad(format!("final logit softcapping {c}"));
            }
        }
        Ok(self)
    }

    /// The hyper-parameters, the experts a token uses and their FFN width (MoE files).
    fn from_gguf(g: &GgufFile) -> Result<(Hparams, ExpertCounts)> {
        use gguf_keys::*;
        let arch = g.architecture()?.to_string();
        if !ARCHS.contains(&arch.as_str()) {
            return Err(Error::Unsupported(format!(
                "{}: architecture {arch} is not Gemma-4",
                g.path().display()
            )));
        }
        let k = |s: &str| key(&arch, s);
        let n_layer = g.get_usize(&k(keys::BLOCK_COUNT))?;
        let n_embd = g.get_usize(&k(keys::EMBEDDING_LENGTH))?;
        let swa = g.get_bool_array(&k(SLIDING_WINDOW_PATTERN))?;
        if swa.len() != n_layer {
            return Err(Error::config(
                g.path(),
                k(SLIDING_WINDOW_PATTERN),
                format!("{} entries for {n_layer} blocks", swa.len()),
            ));
        }
        let kv = g.get_u64_per_layer(&k(keys::ATTENTION_HEAD_COUNT_KV), n_layer)?;
        let ff = g.get_u64_per_layer(&k(keys::FEED_FORWARD_LENGTH), n_layer)?;
        let hd_full = g.get_usize(&k(keys::ATTENTION_KEY_LENGTH))?;
        let hd_swa = g.get_usize(&k(KEY_LENGTH_SWA))?;
        for (kk, vk, d) in [
            (
                keys::ATTENTION_KEY_LENGTH,
                keys::ATTENTION_VALUE_LENGTH,
                hd_full,
            ),
            (KEY_LENGTH_SWA, VALUE_LENGTH_SWA, hd_swa),
        ] {
            if let Some(dv) = g.opt_usize(&k(vk))? {
                if dv != d {
                    return Err(Error::config(
                        g.path(),
                        k(vk),
                        format!("{dv}, unlike {} = {d}", k(kk)),
                    ));
                }
            }
        }
        // Both RoPEs turn whole heads (the converter writes n_rot = head_dim for global
        // layers, and `partial_rotary_factor` 1 for sliding ones).
        for (name, d) in [
            (keys::ROPE_DIMENSION_COUNT, hd_full),
            (ROPE_DIMENSION_COUNT_SWA, hd_swa),
        ] {
            if let Some(r) = g.opt_usize(&k(name))? {
                if r != d {
                    return Err(Error::Unsupported(format!(
                        "{}: {} = {r} rotated dims of a head of {d}",
                        g.path().display(),
                        k(name)
                    )));
                }
            }
        }
        let layers = (0..n_layer)
            .map(|l| LayerGeom {
                swa: swa[l],
                head_dim: if swa[l] { hd_swa } else { hd_full },
                n_head_kv: kv[l] as usize,
                n_ff: ff[l] as usize,
                moe: false,
            })
            .collect();
        let embd = g.require(&W::TokEmbd.gguf_name())?;
        let n_vocab = vocab_of(&embd, n_embd)?;
        let n_used = (
            g.opt_usize(&k(keys::EXPERT_USED_COUNT))?,
            g.opt_usize(&k(keys::EXPERT_FEED_FORWARD_LENGTH))?,
        );
        Hparams {
            n_layer,
            n_embd,
            n_vocab,
            n_head: g.get_usize(&k(keys::ATTENTION_HEAD_COUNT))?,
            layers,
            window: g
                .opt_usize(&k(keys::ATTENTION_SLIDING_WINDOW))?
                .unwrap_or(0),
            rope_theta: g.opt_f32(&k(keys::ROPE_FREQ_BASE))?.unwrap_or(1e6),
            rope_theta_swa: g.opt_f32(&k(ROPE_FREQ_BASE_SWA))?.unwrap_or(1e4),
            rope_pairs_global: None,
            eps: g
                .opt_f32(&k(keys::ATTENTION_LAYERNORM_RMS_EPS))?
                .unwrap_or(1e-6),
            softcap: g.opt_f32(&k(FINAL_LOGIT_SOFTCAPPING))?,
            moe: None,
            n_epl: g.opt_usize(&k(EMBEDDING_LENGTH_PER_LAYER))?.unwrap_or(0),
            n_kv_shared: g.opt_usize(&k(SHARED_KV_LAYERS))?.unwrap_or(0),
        }
        .check(g.path())
        .map(|hp| (hp, n_used))
    }

    fn from_hf(h: &HfModel) -> Result<(Hparams, ExpertCounts)> {
        let arch = h.architecture()?;
        if !ARCHS.contains(&arch.as_str()) {
            return Err(Error::Unsupported(format!(
                "{}: architecture {arch} is not Gemma-4",
                h.dir().display()
            )));
        }
        let cfg_err = |key: &str, what: String| Error::config(h.config_path(), key, what);
        if let Some(a) = h.cfg_opt_str("hidden_activation")? {
            if a != "gelu_pytorch_tanh" {
                return Err(cfg_err(
                    "hidden_activation",
                    format!("{a} (lathe runs gelu_pytorch_tanh)"),
                ));
            }
        }
        let n_layer = h.cfg_u64("num_hidden_layers")? as usize;
        let types = h.cfg_str_list("layer_types")?;
        if types.len() != n_layer {
            return Err(cfg_err(
                "layer_types",
                format!("{} entries for {n_layer} blocks", types.len()),
            ));
        }
        let hd = h.cfg_u64("head_dim")? as usize;
        let kv = h.cfg_u64("num_key_value_heads")? as usize;
        let n_ff = h.cfg_u64("intermediate_size")? as usize;
        let n_kv_shared = h.cfg_opt_u64("num_kv_shared_layers")?.unwrap_or(0) as usize;
        // HF `Gemma4TextMLP`: KV-shared blocks are twice as wide with `use_double_wide_mlp`.
        let wide = h.cfg_opt_bool("use_double_wide_mlp")?.unwrap_or(false);
        let mut layers = Vec::with_capacity(n_layer);
        for (l, t) in types.iter().enumerate() {
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
            let over = |k: &str| h.cfg_opt_u64(&format!("per_layer_config.{l}.{k}"));
            layers.push(LayerGeom {
                swa,
                head_dim: over("head_dim")?.map_or(hd, |v| v as usize),
                n_head_kv: over("num_key_value_heads")?.map_or(kv, |v| v as usize),
                n_ff: if wide && l + n_kv_shared >= n_layer {
                    2 * n_ff
                } else {
                    n_ff
                },
                moe: false,
            });
        }
        let rp = |t: &str, k: &str| h.cfg_opt_f64(&format!("rope_parameters.{t}.{k}"));
        for t in ["sliding_attention", "full_attention"] {
            let ty = h.cfg_opt_str(&format!("rope_parameters.{t}.rope_type"))?;
            let want = if t == "full_attention" {
                "proportional"
            } else {
                "default"
            };
            if ty.is_some_and(|ty| ty != want) || rp(t, "factor")?.is_some_and(|f| f != 1.0) {
                return Err(cfg_err(
                    &format!("rope_parameters.{t}"),
                    format!("rope_type {ty:?} (lathe runs {want}, unscaled)"),
                ));
            }
        }
        let hd_full = layers
            .iter()
            .find(|g| !g.swa)
            .map_or(hd, |g: &LayerGeom| g.head_dim);
        let frac = rp("full_attention", "partial_rotary_factor")?.unwrap_or(1.0);
        let n_embd = h.cfg_u64("hidden_size")? as usize;
        let embd = h.require(&W::TokEmbd.hf_name())?;
        let n_used = (
            h.cfg_opt_u64("top_k_experts")?.map(|k| k as usize),
            h.cfg_opt_u64("moe_intermediate_size")?.map(|k| k as usize),
        );
        Hparams {
            n_layer,
            n_embd,
            n_vocab: vocab_of(&embd, n_embd)?,
            n_head: h.cfg_u64("num_attention_heads")? as usize,
            layers,
            window: h.cfg_opt_u64("sliding_window")?.unwrap_or(0) as usize,
            rope_theta: rp("full_attention", "rope_theta")?.unwrap_or(1e6) as f32,
            rope_theta_swa: rp("sliding_attention", "rope_theta")?.unwrap_or(1e4) as f32,
            // HF's `_compute_proportional_rope_parameters`: int(factor · head_dim // 2).
            rope_pairs_global: Some((frac * hd_full as f64 / 2.0) as usize),
            eps: h.cfg_opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            softcap: h.cfg_opt_f64("final_logit_softcapping")?.map(|c| c as f32),
            moe: None,
            n_epl: h.cfg_opt_u64("hidden_size_per_layer_input")?.unwrap_or(0) as usize,
            n_kv_shared,
        }
        .check(&h.config_path())
        .map(|hp| (hp, n_used))
    }
}

/// `[rows, cols]` = `[n_vocab, n_embd]` of the token table.
fn vocab_of(embd: &crate::tensor::TensorRef<'_>, n_embd: usize) -> Result<usize> {
    match embd.shape {
        [v, e] if *e as usize == n_embd => Ok(*v as usize),
        s => Err(Error::tensor(
            embd.path,
            embd.name,
            format!("shape {s:?}, expected [n_vocab, {n_embd}]"),
        )),
    }
}

/// Per-layer embedding columns per block, by the presence of the per-layer token table (as
/// llama.cpp and HF decide: a file without it runs none, whatever its metadata says is
/// refused): `[n_vocab, n_layer·n_epl]`, `n_epl` as the metadata says when it says one.
fn per_layer_width(f: &ModelFile, hp: &Hparams) -> Result<usize> {
    let name = W::PerLayerTokEmbd.name(f);
    let Some(t) = f.tensor(&name) else {
        if hp.n_epl != 0 {
            return Err(Error::format(
                f.path(),
                format!(
                    "per-layer embeddings of {} columns, but no tensor {name}",
                    hp.n_epl
                ),
            ));
        }
        return Ok(0);
    };
    let n = match t.shape {
        [v, c]
            if *v as usize == hp.n_vocab && *c > 0 && (*c as usize).is_multiple_of(hp.n_layer) =>
        {
            *c as usize / hp.n_layer
        }
        s => {
            return Err(Error::tensor(
                t.path,
                t.name,
                format!(
                    "shape {s:?}, expected [{}, {} blocks × columns]",
                    hp.n_vocab, hp.n_layer
                ),
            ))
        }
    };
    if hp.n_epl != 0 && hp.n_epl != n {
        return Err(Error::tensor(
            t.path,
            t.name,
            format!(
                "{n} columns per block, the metadata says {} (GGUF {}, HF \
                 hidden_size_per_layer_input)",
                hp.n_epl,
                gguf_keys::EMBEDDING_LENGTH_PER_LAYER
            ),
        ));
    }
    Ok(n)
}
