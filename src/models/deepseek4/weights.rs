//! Tensor names (one table per format) and the loader that brings both formats into one
//! internal layout.
//!
//! The two formats hold the same values in the same orientation (checked tensor by tensor
//! on the fixtures: llama.cpp's converter copies DeepSeek's tensors unchanged), so the
//! layout is simply DeepSeek's own, with these transforms:
//! - norms are plain `w` in both (model.py multiplies `w · x̂`; no `1+w` anywhere);
//! - routed experts are stacked `[n_expert, rows, cols]`: GGUF stores the stack in ggml
//!   MXFP4 blocks; the release stores one packed-MXFP4 tensor (+ E8M0 `.scale`) per expert,
//!   repacked here into ggml MXFP4 bytes (`Weight::Owned`, see `experts_upstream`);
//! - FP8 e4m3 block-scaled linears (and FP8 experts) of the release stay FP8: repacked into
//!   lathe's `F8_E4M3_B128` blocks (each 128 columns with their f32 block scale; a layout
//!   change, no rounding, `Weight::Owned`, see `Loader::mat`), read by the GPU kernels and
//!   dequantized by the CPU reference through `quant`;
//! - `tid2eid` (GGUF I32, release I64) becomes exact f32 expert ids.

use super::Hparams;
use crate::models::{expect_shape, read_f32, ModelFile, Weight};
use crate::safetensors::scaled::repack_fp8_block_to_b128;
use crate::safetensors::{find_block_scale, repack_mxfp4_to_ggml, HfModel};
use crate::tensor::TensorRef;
use crate::{DType, Error, Result};

/// Every tensor a DeepSeek-V4 model has, by role.
#[derive(Clone, Copy, Debug)]
pub enum W {
    TokEmbd,
    Output,
    OutputNorm,
    HcHeadFn,
    HcHeadBase,
    HcHeadScale,
    AttnNorm(usize),
    FfnNorm(usize),
    HcAttnFn(usize),
    HcAttnBase(usize),
    HcAttnScale(usize),
    HcFfnFn(usize),
    HcFfnBase(usize),
    HcFfnScale(usize),
    // Attention
    Sink(usize),
    WqA(usize),
    QNorm(usize),
    WqB(usize),
    Wkv(usize),
    KvNorm(usize),
    WoA(usize),
    WoB(usize),
    // KV compressor of the attention (ratio > 0 layers)
    CmpApe(usize),
    CmpNorm(usize),
    CmpGate(usize),
    CmpKv(usize),
    // Lightning indexer (ratio-4 layers) and its own compressor
    IxWqB(usize),
    IxProj(usize),
    IxCmpApe(usize),
    IxCmpNorm(usize),
    IxCmpGate(usize),
    IxCmpKv(usize),
    // MoE
    Router(usize),
    RouterBias(usize),
    Tid2Eid(usize),
    /// Routed experts: GGUF stacks them; the release stores one tensor per expert
    /// (the second index): w1 = gate, w3 = up, w2 = down.
    GateExps(usize),
    UpExps(usize),
    DownExps(usize),
    GateExp(usize, usize),
    UpExp(usize, usize),
    DownExp(usize, usize),
    ShGate(usize),
    ShUp(usize),
    ShDown(usize),
    // The MTP block's own tensors (index: `mtp_block(i)`); its attention, FFN and
    // hyper-connection tensors are the layer roles above at that index.
    MtpEProj(usize),
    MtpHProj(usize),
    MtpENorm(usize),
    MtpHNorm(usize),
    MtpNorm(usize),
    MtpHcHeadFn(usize),
    MtpHcHeadBase(usize),
    MtpHcHeadScale(usize),
}

/// The layer index of MTP block `i` in [`W`]'s roles. Its tensors are named under
/// `mtp.{i}.` in both formats: the release's own names (model.py `MTPBlock`, a full `Block`
/// plus `e_proj`, `h_proj`, `enorm`, `hnorm`, `norm` and its own `hc_head_*`), and in GGUF,
/// where llama.cpp defines no DeepSeek-V4 MTP tensors, a table of lathe's mirroring that
/// layout with llama.cpp's per-tensor names (`mtp.0.attn_q_a.weight`, `mtp.0.e_proj.weight`),
/// flagged by the `deepseek4.nextn_predict_layers` key.
pub fn mtp_block(i: usize) -> usize {
    MTP_BLOCK + i
}

/// Layer indices from here on name MTP blocks (far above any trunk's layer count).
const MTP_BLOCK: usize = 1 << 20;

/// `{prefix}{l}.{s}` for a trunk layer, `mtp.{i}.{s}` for MTP block `i`.
fn block_name(prefix: &str, l: usize, s: &str) -> String {
    match l.checked_sub(MTP_BLOCK) {
        Some(i) => format!("mtp.{i}.{s}"),
        None => format!("{prefix}{l}.{s}"),
    }
}

impl W {
    /// llama.cpp's names (`llama-arch.cpp`, `LLM_ARCH_DEEPSEEK4`).
    pub fn gguf_name(self) -> String {
        use W::*;
        let b = |l: usize, s: &str| block_name("blk.", l, s);
        match self {
            TokEmbd => "token_embd.weight".into(),
            Output => "output.weight".into(),
            OutputNorm => "output_norm.weight".into(),
            HcHeadFn => "output_hc_fn.weight".into(),
            HcHeadBase => "output_hc_base.weight".into(),
            HcHeadScale => "output_hc_scale.weight".into(),
            AttnNorm(l) => b(l, "attn_norm.weight"),
            FfnNorm(l) => b(l, "ffn_norm.weight"),
            HcAttnFn(l) => b(l, "hc_attn_fn.weight"),
            HcAttnBase(l) => b(l, "hc_attn_base.weight"),
            HcAttnScale(l) => b(l, "hc_attn_scale.weight"),
            HcFfnFn(l) => b(l, "hc_ffn_fn.weight"),
            HcFfnBase(l) => b(l, "hc_ffn_base.weight"),
            HcFfnScale(l) => b(l, "hc_ffn_scale.weight"),
            Sink(l) => b(l, "attn_sinks.weight"),
            WqA(l) => b(l, "attn_q_a.weight"),
            QNorm(l) => b(l, "attn_q_a_norm.weight"),
            WqB(l) => b(l, "attn_q_b.weight"),
            Wkv(l) => b(l, "attn_kv.weight"),
            KvNorm(l) => b(l, "attn_kv_a_norm.weight"),
            WoA(l) => b(l, "attn_output_a.weight"),
            WoB(l) => b(l, "attn_output_b.weight"),
            CmpApe(l) => b(l, "attn_compressor_ape.weight"),
            CmpNorm(l) => b(l, "attn_compressor_norm.weight"),
            CmpGate(l) => b(l, "attn_compressor_gate.weight"),
            CmpKv(l) => b(l, "attn_compressor_kv.weight"),
            IxWqB(l) => b(l, "indexer.attn_q_b.weight"),
            IxProj(l) => b(l, "indexer.proj.weight"),
            IxCmpApe(l) => b(l, "indexer_compressor_ape.weight"),
            IxCmpNorm(l) => b(l, "indexer_compressor_norm.weight"),
            IxCmpGate(l) => b(l, "indexer_compressor_gate.weight"),
            IxCmpKv(l) => b(l, "indexer_compressor_kv.weight"),
            Router(l) => b(l, "ffn_gate_inp.weight"),
            RouterBias(l) => b(l, "exp_probs_b.bias"),
            Tid2Eid(l) => b(l, "ffn_gate_tid2eid.weight"),
            GateExps(l) | GateExp(l, _) => b(l, "ffn_gate_exps.weight"),
            UpExps(l) | UpExp(l, _) => b(l, "ffn_up_exps.weight"),
            DownExps(l) | DownExp(l, _) => b(l, "ffn_down_exps.weight"),
            ShGate(l) => b(l, "ffn_gate_shexp.weight"),
            ShUp(l) => b(l, "ffn_up_shexp.weight"),
            ShDown(l) => b(l, "ffn_down_shexp.weight"),
            MtpEProj(l) => b(l, "e_proj.weight"),
            MtpHProj(l) => b(l, "h_proj.weight"),
            MtpENorm(l) => b(l, "enorm.weight"),
            MtpHNorm(l) => b(l, "hnorm.weight"),
            MtpNorm(l) => b(l, "norm.weight"),
            MtpHcHeadFn(l) => b(l, "hc_head_fn.weight"),
            MtpHcHeadBase(l) => b(l, "hc_head_base.weight"),
            MtpHcHeadScale(l) => b(l, "hc_head_scale.weight"),
        }
    }

    /// DeepSeek's release names (model.py's module paths). The stacked expert roles have no
    /// tensor of their own there; they name the per-expert prefix.
    pub fn upstream_name(self) -> String {
        use W::*;
        let b = |l: usize, s: &str| block_name("layers.", l, s);
        match self {
            TokEmbd => "embed.weight".into(),
            Output => "head.weight".into(),
            OutputNorm => "norm.weight".into(),
            HcHeadFn => "hc_head_fn".into(),
            HcHeadBase => "hc_head_base".into(),
            HcHeadScale => "hc_head_scale".into(),
            AttnNorm(l) => b(l, "attn_norm.weight"),
            FfnNorm(l) => b(l, "ffn_norm.weight"),
            HcAttnFn(l) => b(l, "hc_attn_fn"),
            HcAttnBase(l) => b(l, "hc_attn_base"),
            HcAttnScale(l) => b(l, "hc_attn_scale"),
            HcFfnFn(l) => b(l, "hc_ffn_fn"),
            HcFfnBase(l) => b(l, "hc_ffn_base"),
            HcFfnScale(l) => b(l, "hc_ffn_scale"),
            Sink(l) => b(l, "attn.attn_sink"),
            WqA(l) => b(l, "attn.wq_a.weight"),
            QNorm(l) => b(l, "attn.q_norm.weight"),
            WqB(l) => b(l, "attn.wq_b.weight"),
            Wkv(l) => b(l, "attn.wkv.weight"),
            KvNorm(l) => b(l, "attn.kv_norm.weight"),
            WoA(l) => b(l, "attn.wo_a.weight"),
            WoB(l) => b(l, "attn.wo_b.weight"),
            CmpApe(l) => b(l, "attn.compressor.ape"),
            CmpNorm(l) => b(l, "attn.compressor.norm.weight"),
            CmpGate(l) => b(l, "attn.compressor.wgate.weight"),
            CmpKv(l) => b(l, "attn.compressor.wkv.weight"),
            IxWqB(l) => b(l, "attn.indexer.wq_b.weight"),
            IxProj(l) => b(l, "attn.indexer.weights_proj.weight"),
            IxCmpApe(l) => b(l, "attn.indexer.compressor.ape"),
            IxCmpNorm(l) => b(l, "attn.indexer.compressor.norm.weight"),
            IxCmpGate(l) => b(l, "attn.indexer.compressor.wgate.weight"),
            IxCmpKv(l) => b(l, "attn.indexer.compressor.wkv.weight"),
            Router(l) => b(l, "ffn.gate.weight"),
            RouterBias(l) => b(l, "ffn.gate.bias"),
            Tid2Eid(l) => b(l, "ffn.gate.tid2eid"),
            GateExps(l) | UpExps(l) | DownExps(l) => b(l, "ffn.experts"),
            GateExp(l, e) => b(l, &format!("ffn.experts.{e}.w1.weight")),
            UpExp(l, e) => b(l, &format!("ffn.experts.{e}.w3.weight")),
            DownExp(l, e) => b(l, &format!("ffn.experts.{e}.w2.weight")),
            ShGate(l) => b(l, "ffn.shared_experts.w1.weight"),
            ShUp(l) => b(l, "ffn.shared_experts.w3.weight"),
            ShDown(l) => b(l, "ffn.shared_experts.w2.weight"),
            MtpEProj(l) => b(l, "e_proj.weight"),
            MtpHProj(l) => b(l, "h_proj.weight"),
            MtpENorm(l) => b(l, "enorm.weight"),
            MtpHNorm(l) => b(l, "hnorm.weight"),
            MtpNorm(l) => b(l, "norm.weight"),
            MtpHcHeadFn(l) => b(l, "hc_head_fn"),
            MtpHcHeadBase(l) => b(l, "hc_head_base"),
            MtpHcHeadScale(l) => b(l, "hc_head_scale"),
        }
    }
}

/// Hyper-connection mixing weights of one site (attention or FFN half of a block, or the
/// head fold). Block sites: `fn_` [hc_mix, hc·n_embd], `base` [hc_mix], `scale` [3]
/// (pre | post | comb). Head: `fn_` [hc, hc·n_embd], `base` [hc], `scale` [1].
pub struct Hc<T> {
    pub fn_: T,
    pub base: T,
    pub scale: T,
}

/// A KV compressor of ratio m over `d`-wide entries; `coff` = 2 when overlapping (ratio 4),
/// else 1.
pub struct Compressor<T> {
    /// [m, coff·d]: added to the scores by position in the window.
    pub ape: T,
    /// [coff·d, n_embd] each: the kv stream and its pooling scores. Overlapping: channels
    /// `..d` pool into the NEXT window's entry, `d..` into this window's.
    pub wkv: T,
    pub wgate: T,
    /// [d]: weighted RMSNorm of a pooled entry.
    pub norm: T,
}

/// Lightning indexer of a ratio-4 layer.
pub struct Indexer<T> {
    /// [n_ix_head·ix_head_dim, q_lora]: indexer queries from the normed q low-rank `qr`.
    pub wq_b: T,
    /// [n_ix_head, n_embd]: per-head weights from the attention input.
    pub proj: T,
    /// Its own overlapping compressor with d = ix_head_dim.
    pub cmp: Compressor<T>,
}

pub struct Attn<T> {
    /// [n_head]: per-head sink logit.
    pub sink: T,
    /// [q_lora, n_embd]
    pub wq_a: T,
    /// [q_lora]
    pub q_norm: T,
    /// [n_head·head_dim, q_lora]
    pub wq_b: T,
    /// [head_dim, n_embd]: the one K=V head.
    pub wkv: T,
    /// [head_dim]
    pub kv_norm: T,
    /// [o_groups·o_lora, n_head·head_dim/o_groups]: group g uses rows g·o_lora.. against
    /// its own slice of the heads.
    pub wo_a: T,
    /// [n_embd, o_groups·o_lora]
    pub wo_b: T,
    /// Layers with ratio > 0.
    pub cmp: Option<Compressor<T>>,
    /// Ratio-4 layers.
    pub ix: Option<Indexer<T>>,
}

pub struct Moe<T> {
    /// [n_expert, n_embd]
    pub router: T,
    /// [n_expert]: selection-only bias (score-routed layers).
    pub bias: Option<T>,
    /// [n_vocab, n_used] f32 expert ids (hash layers).
    pub tid2eid: Option<T>,
    /// [n_expert, n_ff_exp, n_embd] (gate = w1, up = w3), [n_expert, n_embd, n_ff_exp] (down = w2).
    pub gate_exps: T,
    pub up_exps: T,
    pub down_exps: T,
    /// Shared expert: [n_ff_shexp, n_embd] (gate, up), [n_embd, n_ff_shexp] (down).
    pub sh_gate: T,
    pub sh_up: T,
    pub sh_down: T,
}

pub struct Layer<T> {
    pub hc_attn: Hc<T>,
    /// [n_embd] each, plain `w`.
    pub attn_norm: T,
    pub attn: Attn<T>,
    pub hc_ffn: Hc<T>,
    pub ffn_norm: T,
    pub moe: Moe<T>,
}

/// DeepSeek's MTP block (model.py `MTPBlock`): `x = e_proj(enorm(embed(t))) + h_proj(hnorm(h))`
/// per hyper-connection copy of the trunk's residual stream `h`, one full block, then the
/// shared head through its own hc fold and `norm`.
pub struct Mtp<T> {
    /// [n_embd, n_embd] each.
    pub e_proj: T,
    pub h_proj: T,
    /// [n_embd] each, plain `w`.
    pub enorm: T,
    pub hnorm: T,
    pub norm: T,
    /// The head fold: `fn_` [hc, hc·n_embd], `base` [hc], `scale` [1].
    pub hc_head: Hc<T>,
    pub layer: Layer<T>,
}

pub struct Weights<T> {
    /// [n_vocab, n_embd]
    pub tok_embd: T,
    pub layers: Vec<Layer<T>>,
    /// With `Hparams::mtp`.
    pub mtp: Option<Mtp<T>>,
    pub hc_head: Hc<T>,
    /// [n_embd], plain `w`.
    pub output_norm: T,
    /// [n_vocab, n_embd]
    pub output: T,
}

/// The shared role-by-name loader (`models::Loader`) over this family's table.
type Loader<'a> = crate::models::Loader<'a, W>;

impl crate::models::TensorNames for W {
    fn gguf_name(self) -> String {
        W::gguf_name(self)
    }
    fn other_name(self) -> String {
        W::upstream_name(self)
    }
}

impl<'a> Loader<'a> {
    /// Any weight: stored as it is, except the release's FP8 e4m3 linears (`X.weight` +
    /// `X.scale` per 128×128 block), repacked into `F8_E4M3_B128` (one byte per weight still).
    fn mat(&self, w: W, shape: &[u64]) -> Result<Weight<'a>> {
        let t = self.shaped(w, shape)?;
        if t.dtype != DType::F8_E4M3 {
            return Ok(Weight::Stored(t));
        }
        Ok(Weight::Owned {
            name: t.name.to_string(),
            dtype: DType::F8_E4M3_B128,
            shape: shape.to_vec(),
            bytes: self.fp8_repack(&t)?,
        })
    }

    /// An FP8 weight and its block scale as `F8_E4M3_B128` bytes.
    fn fp8_repack(&self, t: &TensorRef<'a>) -> Result<Vec<u8>> {
        let ModelFile::Hf(h) = self.file else {
            return Err(Error::tensor(t.path, t.name, "FP8 weight in a GGUF file"));
        };
        let scale = find_block_scale(h, t.name).ok_or_else(|| {
            Error::tensor(
                t.path,
                t.name,
                "FP8 weight without a `.scale` / `.weight_scale_inv` tensor",
            )
        })?;
        repack_fp8_block_to_b128(t, &scale)
    }

    fn hc(
        &self,
        f: W,
        b: W,
        s: W,
        mix: usize,
        n_scale: u64,
        hp: &Hparams,
    ) -> Result<Hc<Weight<'a>>> {
        let mix = mix as u64;
        Ok(Hc {
            fn_: self.mat(f, &[mix, (hp.hc * hp.n_embd) as u64])?,
            base: self.mat(b, &[mix])?,
            scale: self.mat(s, &[n_scale])?,
        })
    }

    fn compressor(
        &self,
        names: [W; 4],
        ratio: usize,
        d: usize,
        overlap: bool,
        hp: &Hparams,
    ) -> Result<Compressor<Weight<'a>>> {
        let [ape, norm, gate, kv] = names;
        let width = if overlap { 2 * d } else { d } as u64;
        let e = hp.n_embd as u64;
        Ok(Compressor {
            ape: self.mat(ape, &[ratio as u64, width])?,
            wkv: self.mat(kv, &[width, e])?,
            wgate: self.mat(gate, &[width, e])?,
            norm: self.mat(norm, &[d as u64])?,
        })
    }

    /// Routed experts of the release: one tensor per expert, stacked to
    /// `[n_expert, rows, cols]`. Packed MXFP4 (I8/U8 + E8M0 scale) is repacked into ggml's
    /// MXFP4 blocks and FP8 (+ block scale) into `F8_E4M3_B128` (layout changes, no
    /// rounding), so the GPU's kernels serve both formats and the CPU reference dequantizes
    /// the same bytes.
    ///
    /// `elsewhere`: the expert arena reads them (`moe::ExpertWeights`); repack nothing and
    /// give a placeholder of the repacked type and shape without bytes.
    fn experts_upstream(
        &self,
        h: &'a HfModel,
        one: fn(usize, usize) -> W,
        l: usize,
        shape: [u64; 3],
        elsewhere: bool,
    ) -> Result<Weight<'a>> {
        let (ne, rows, cols) = (shape[0] as usize, shape[1], shape[2]);
        let ts = (0..ne)
            .map(|x| self.req(one(l, x)))
            .collect::<Result<Vec<_>>>()?;
        let repacked = match ts[0].dtype {
            DType::I8 | DType::U8 => Some(DType::MXFP4),
            DType::F8_E4M3 => Some(DType::F8_E4M3_B128),
            _ => None,
        };
        if let (true, Some(dtype)) = (elsewhere, repacked) {
            return Ok(Weight::Owned {
                name: ts[0].name.to_string(),
                dtype,
                shape: shape.to_vec(),
                bytes: Vec::new(),
            });
        }
        match ts[0].dtype {
            DType::I8 | DType::U8 => {
                let mut bytes = Vec::new();
                for t in &ts {
                    expect_shape(t, &[rows, cols / 2])?;
                    let scale = find_block_scale(h, t.name).ok_or_else(|| {
                        Error::tensor(
                            t.path,
                            t.name,
                            "packed MXFP4 expert without a `.scale` tensor",
                        )
                    })?;
                    bytes.extend(repack_mxfp4_to_ggml(t, &scale)?);
                }
                Ok(Weight::Owned {
                    name: ts[0].name.to_string(),
                    dtype: DType::MXFP4,
                    shape: shape.to_vec(),
                    bytes,
                })
            }
            DType::F8_E4M3 => {
                let mut bytes = Vec::new();
                for t in &ts {
                    expect_shape(t, &[rows, cols])?;
                    bytes.extend(self.fp8_repack(t)?);
                }
                Ok(Weight::Owned {
                    name: ts[0].name.to_string(),
                    dtype: DType::F8_E4M3_B128,
                    shape: shape.to_vec(),
                    bytes,
                })
            }
            _ => {
                for t in &ts {
                    expect_shape(t, &[rows, cols])?;
                }
                Ok(Weight::Stack {
                    parts: ts,
                    shape: shape.to_vec(),
                })
            }
        }
    }

    fn experts(
        &self,
        all: W,
        one: fn(usize, usize) -> W,
        l: usize,
        shape: [u64; 3],
        elsewhere: bool,
    ) -> Result<Weight<'a>> {
        match self.file {
            ModelFile::Gguf(_) => Ok(Weight::Stored(self.shaped(all, &shape)?)),
            ModelFile::Hf(h) => self.experts_upstream(h, one, l, shape, elsewhere),
        }
    }

    /// `tid2eid` [n_vocab, n_used] as f32 ids, each checked to name an expert.
    fn tid2eid(&self, l: usize, hp: &Hparams) -> Result<Weight<'a>> {
        let t = self.shaped(W::Tid2Eid(l), &[hp.n_vocab as u64, hp.n_used as u64])?;
        if !matches!(
            t.dtype,
            DType::I32 | DType::I64 | DType::I16 | DType::I8 | DType::U8
        ) {
            return Err(Error::tensor(
                t.path,
                t.name,
                format!("expert ids stored as {}, expected an integer type", t.dtype),
            ));
        }
        let ids = read_f32(&t)?;
        if let Some(i) = ids
            .iter()
            .position(|&v| !(v >= 0.0 && (v as usize) < hp.n_expert))
        {
            return Err(Error::tensor(
                t.path,
                t.name,
                format!(
                    "entry {i} = {} is not an expert id below {}",
                    ids[i], hp.n_expert
                ),
            ));
        }
        Ok(Weight::F32 {
            name: t.name.to_string(),
            shape: vec![hp.n_vocab as u64, hp.n_used as u64],
            data: ids,
        })
    }
}

/// Load every weight through `sink` (GPU upload or CPU dequantization), in the layout
/// described at the top of this file.
pub fn load<T>(
    file: &ModelFile,
    hp: &Hparams,
    sink: impl FnMut(Weight<'_>) -> Result<T>,
) -> Result<Weights<T>> {
    load_with(file, hp, false, sink)
}

/// [`load`]; with `experts_elsewhere` (the expert arena holds the routed experts,
/// `moe::Offload`) the release's block-scaled experts reach `sink` as placeholders
/// without bytes: nothing is repacked that the sink would drop.
pub fn load_with<T>(
    file: &ModelFile,
    hp: &Hparams,
    experts_elsewhere: bool,
    mut sink: impl FnMut(Weight<'_>) -> Result<T>,
) -> Result<Weights<T>> {
    let ld = Loader::new(file);
    debug_assert_eq!(ld.gguf, hp.gguf);
    let e = hp.n_embd as u64;
    let v = hp.n_vocab as u64;
    let tok_embd = sink(ld.mat(W::TokEmbd, &[v, e])?)?;
    let mut layers = Vec::with_capacity(hp.n_layer);
    for l in 0..hp.n_layer {
        layers.push(load_layer(&ld, hp, l, l, experts_elsewhere, &mut sink)?);
    }
    let hc_head = ld.hc(W::HcHeadFn, W::HcHeadBase, W::HcHeadScale, hp.hc, 1, hp)?;
    let hc_head = sink_hc(hc_head, &mut sink)?;
    let output_norm = sink(ld.mat(W::OutputNorm, &[e])?)?;
    let output = sink(ld.mat(W::Output, &[v, e])?)?;
    let mtp = if hp.mtp {
        // The block's experts stay in their stacks: the expert arena serves the trunk.
        let b = mtp_block(0);
        let layer = load_layer(&ld, hp, hp.n_layer, b, false, &mut sink)?;
        let hc_head = ld.hc(
            W::MtpHcHeadFn(b),
            W::MtpHcHeadBase(b),
            W::MtpHcHeadScale(b),
            hp.hc,
            1,
            hp,
        )?;
        Some(Mtp {
            e_proj: sink(ld.mat(W::MtpEProj(b), &[e, e])?)?,
            h_proj: sink(ld.mat(W::MtpHProj(b), &[e, e])?)?,
            enorm: sink(ld.mat(W::MtpENorm(b), &[e])?)?,
            hnorm: sink(ld.mat(W::MtpHNorm(b), &[e])?)?,
            norm: sink(ld.mat(W::MtpNorm(b), &[e])?)?,
            hc_head: sink_hc(hc_head, &mut sink)?,
            layer,
        })
    } else {
        None
    };
    Ok(Weights {
        tok_embd,
        layers,
        mtp,
        hc_head,
        output_norm,
        output,
    })
}

/// Block `l` (its per-block hyper-parameters), named as layer `nl` (`l` itself, or
/// `mtp_block(i)`).
fn load_layer<T>(
    ld: &Loader<'_>,
    hp: &Hparams,
    l: usize,
    nl: usize,
    experts_elsewhere: bool,
    sink: &mut impl FnMut(Weight<'_>) -> Result<T>,
) -> Result<Layer<T>> {
    let e = hp.n_embd as u64;
    let hc_attn = ld.hc(
        W::HcAttnFn(nl),
        W::HcAttnBase(nl),
        W::HcAttnScale(nl),
        hp.hc_mix(),
        3,
        hp,
    )?;
    let hc_attn = sink_hc(hc_attn, sink)?;
    let attn_norm = sink(ld.mat(W::AttnNorm(nl), &[e])?)?;
    let attn = load_attn(ld, hp, l, nl, sink)?;
    let hc_ffn = ld.hc(
        W::HcFfnFn(nl),
        W::HcFfnBase(nl),
        W::HcFfnScale(nl),
        hp.hc_mix(),
        3,
        hp,
    )?;
    let hc_ffn = sink_hc(hc_ffn, sink)?;
    let ffn_norm = sink(ld.mat(W::FfnNorm(nl), &[e])?)?;
    let moe = load_moe(ld, hp, l, nl, experts_elsewhere, sink)?;
    Ok(Layer {
        hc_attn,
        attn_norm,
        attn,
        hc_ffn,
        ffn_norm,
        moe,
    })
}

fn sink_hc<T>(h: Hc<Weight<'_>>, sink: &mut impl FnMut(Weight<'_>) -> Result<T>) -> Result<Hc<T>> {
    Ok(Hc {
        fn_: sink(h.fn_)?,
        base: sink(h.base)?,
        scale: sink(h.scale)?,
    })
}

fn sink_cmp<T>(
    c: Compressor<Weight<'_>>,
    sink: &mut impl FnMut(Weight<'_>) -> Result<T>,
) -> Result<Compressor<T>> {
    Ok(Compressor {
        ape: sink(c.ape)?,
        wkv: sink(c.wkv)?,
        wgate: sink(c.wgate)?,
        norm: sink(c.norm)?,
    })
}

fn load_attn<T>(
    ld: &Loader<'_>,
    hp: &Hparams,
    l: usize,
    nl: usize,
    sink: &mut impl FnMut(Weight<'_>) -> Result<T>,
) -> Result<Attn<T>> {
    let e = hp.n_embd as u64;
    let (hd, ql) = (hp.head_dim as u64, hp.q_lora as u64);
    let q_dim = hp.q_dim() as u64;
    let ratio = hp.compress_ratio[l];
    let cmp = if ratio > 0 {
        let names = [W::CmpApe(nl), W::CmpNorm(nl), W::CmpGate(nl), W::CmpKv(nl)];
        let c = ld.compressor(names, ratio, hp.head_dim, hp.overlap(l), hp)?;
        Some(sink_cmp(c, sink)?)
    } else {
        None
    };
    let ix = if hp.has_indexer(l) {
        let names = [
            W::IxCmpApe(nl),
            W::IxCmpNorm(nl),
            W::IxCmpGate(nl),
            W::IxCmpKv(nl),
        ];
        let c = ld.compressor(names, ratio, hp.ix_head_dim, hp.overlap(l), hp)?;
        let wq_b = ld.mat(W::IxWqB(nl), &[(hp.n_ix_head * hp.ix_head_dim) as u64, ql])?;
        let proj = ld.mat(W::IxProj(nl), &[hp.n_ix_head as u64, e])?;
        Some(Indexer {
            wq_b: sink(wq_b)?,
            proj: sink(proj)?,
            cmp: sink_cmp(c, sink)?,
        })
    } else {
        None
    };
    let og = hp.o_groups as u64;
    let ol = hp.o_lora as u64;
    Ok(Attn {
        sink: sink(ld.mat(W::Sink(nl), &[hp.n_head as u64])?)?,
        wq_a: sink(ld.mat(W::WqA(nl), &[ql, e])?)?,
        q_norm: sink(ld.mat(W::QNorm(nl), &[ql])?)?,
        wq_b: sink(ld.mat(W::WqB(nl), &[q_dim, ql])?)?,
        wkv: sink(ld.mat(W::Wkv(nl), &[hd, e])?)?,
        kv_norm: sink(ld.mat(W::KvNorm(nl), &[hd])?)?,
        wo_a: sink(ld.mat(W::WoA(nl), &[og * ol, q_dim / og])?)?,
        wo_b: sink(ld.mat(W::WoB(nl), &[e, og * ol])?)?,
        cmp,
        ix,
    })
}

fn load_moe<T>(
    ld: &Loader<'_>,
    hp: &Hparams,
    l: usize,
    nl: usize,
    elsewhere: bool,
    sink: &mut impl FnMut(Weight<'_>) -> Result<T>,
) -> Result<Moe<T>> {
    let e = hp.n_embd as u64;
    let (ne, f, fs) = (hp.n_expert as u64, hp.n_ff_exp as u64, hp.n_ff_shexp as u64);
    let router = sink(ld.mat(W::Router(nl), &[ne, e])?)?;
    let (bias, tid2eid) = if hp.is_hash(l) {
        (None, Some(sink(ld.tid2eid(nl, hp)?)?))
    } else {
        (Some(sink(ld.mat(W::RouterBias(nl), &[ne])?)?), None)
    };
    Ok(Moe {
        router,
        bias,
        tid2eid,
        gate_exps: sink(ld.experts(W::GateExps(nl), W::GateExp, nl, [ne, f, e], elsewhere)?)?,
        up_exps: sink(ld.experts(W::UpExps(nl), W::UpExp, nl, [ne, f, e], elsewhere)?)?,
        down_exps: sink(ld.experts(W::DownExps(nl), W::DownExp, nl, [ne, e, f], elsewhere)?)?,
        sh_gate: sink(ld.mat(W::ShGate(nl), &[fs, e])?)?,
        sh_up: sink(ld.mat(W::ShUp(nl), &[fs, e])?)?,
        sh_down: sink(ld.mat(W::ShDown(nl), &[e, fs])?)?,
    })
}
