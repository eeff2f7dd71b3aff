//! Tensor names (one table per format) and the loader that brings both formats into one
//! internal layout: llama.cpp's, i.e. fused `qkv` rows ordered q | k | v, separate z, beta,
//! alpha projections, norm weights that are multiplied as they are (`1+w` folded at load
//! for HF), `ssm_a = -exp(A_log)`, conv weight `[conv_dim, K]`, experts stacked
//! `[n_expert, rows, cols]`.

use super::{Family, Hparams};
use crate::models::{ModelFile, Weight};
use crate::{Error, Result};

/// Every tensor a Qwen3.5-family model has, by role. `names()` maps it per format.
#[derive(Clone, Copy, Debug)]
pub enum W {
    TokEmbd,
    Output,
    OutputNorm,
    AttnNorm(usize),
    PostNorm(usize),
    // Gated DeltaNet
    Qkv(usize),
    /// qwen3next HF: q,k,v,z fused and interleaved per key head.
    Qkvz(usize),
    Z(usize),
    Beta(usize),
    Alpha(usize),
    /// qwen3next: beta and alpha fused, interleaved per key head.
    Ba(usize),
    Conv(usize),
    /// GGUF: `-exp(A_log)`; HF: `A_log`.
    SsmA(usize),
    DtBias(usize),
    SsmNorm(usize),
    SsmOut(usize),
    // Full attention
    Q(usize),
    K(usize),
    V(usize),
    QNorm(usize),
    KNorm(usize),
    O(usize),
    // FFN
    Gate(usize),
    Up(usize),
    Down(usize),
    Router(usize),
    /// Routed experts; HF stores one tensor per expert (the `usize` second index).
    GateExps(usize),
    UpExps(usize),
    DownExps(usize),
    GateExp(usize, usize),
    UpExp(usize, usize),
    DownExp(usize, usize),
    ShGate(usize),
    ShUp(usize),
    ShDown(usize),
    ShGateInp(usize),
    // Multi-token prediction (MTP / NextN) block: the index is its GGUF block (`n_layer`);
    // its decoder layer's tensors are the roles above at that index (HF: at
    // [`MTP_HF_LAYER`]).
    /// `[n_embd, 2·n_embd]` over `[enorm(embedding) | hnorm(hidden)]`.
    MtpFc(usize),
    MtpEnorm(usize),
    MtpHnorm(usize),
    /// The norm before the head.
    MtpNorm(usize),
    /// GGUF only, optional: the block's own head and embedding (else the model's).
    MtpHead(usize),
    MtpEmbd(usize),
}

/// The layer index that names the HF checkpoint's MTP decoder layer (`mtp.layers.0.*`) with
/// the layer roles of [`W`]: the GGUF names it `blk.{n_layer}.*`, an index a table without
/// the hyper-parameters cannot tell from a trunk layer's.
pub const MTP_HF_LAYER: usize = 1 << 24;

impl W {
    pub fn gguf_name(self) -> String {
        use W::*;
        let b = |l: usize, s: &str| format!("blk.{l}.{s}");
        match self {
            TokEmbd => "token_embd.weight".into(),
            Output => "output.weight".into(),
            OutputNorm => "output_norm.weight".into(),
            AttnNorm(l) => b(l, "attn_norm.weight"),
            PostNorm(l) => b(l, "post_attention_norm.weight"),
            Qkv(l) => b(l, "attn_qkv.weight"),
            Qkvz(l) => b(l, "attn_qkvz.weight"),
            Z(l) => b(l, "attn_gate.weight"),
            Beta(l) => b(l, "ssm_beta.weight"),
            Alpha(l) => b(l, "ssm_alpha.weight"),
            Ba(l) => b(l, "ssm_ba.weight"),
            Conv(l) => b(l, "ssm_conv1d.weight"),
            SsmA(l) => b(l, "ssm_a"),
            DtBias(l) => b(l, "ssm_dt.bias"),
            SsmNorm(l) => b(l, "ssm_norm.weight"),
            SsmOut(l) => b(l, "ssm_out.weight"),
            Q(l) => b(l, "attn_q.weight"),
            K(l) => b(l, "attn_k.weight"),
            V(l) => b(l, "attn_v.weight"),
            QNorm(l) => b(l, "attn_q_norm.weight"),
            KNorm(l) => b(l, "attn_k_norm.weight"),
            O(l) => b(l, "attn_output.weight"),
            Gate(l) => b(l, "ffn_gate.weight"),
            Up(l) => b(l, "ffn_up.weight"),
            Down(l) => b(l, "ffn_down.weight"),
            Router(l) => b(l, "ffn_gate_inp.weight"),
            GateExps(l) | GateExp(l, _) => b(l, "ffn_gate_exps.weight"),
            UpExps(l) | UpExp(l, _) => b(l, "ffn_up_exps.weight"),
            DownExps(l) | DownExp(l, _) => b(l, "ffn_down_exps.weight"),
            ShGate(l) => b(l, "ffn_gate_shexp.weight"),
            ShUp(l) => b(l, "ffn_up_shexp.weight"),
            ShDown(l) => b(l, "ffn_down_shexp.weight"),
            ShGateInp(l) => b(l, "ffn_gate_inp_shexp.weight"),
            // llama.cpp's NextN names (`LLM_TENSOR_NEXTN_*`).
            MtpFc(l) => b(l, "nextn.eh_proj.weight"),
            MtpEnorm(l) => b(l, "nextn.enorm.weight"),
            MtpHnorm(l) => b(l, "nextn.hnorm.weight"),
            MtpNorm(l) => b(l, "nextn.shared_head_norm.weight"),
            MtpHead(l) => b(l, "nextn.shared_head_head.weight"),
            MtpEmbd(l) => b(l, "nextn.embed_tokens.weight"),
        }
    }

    /// HF name, after the safetensors reader's `model.language_model.` → `model.` mapping.
    pub fn hf_name(self) -> String {
        use W::*;
        let b = |l: usize, s: &str| match l.checked_sub(MTP_HF_LAYER) {
            Some(m) => format!("mtp.layers.{m}.{s}"),
            None => format!("model.layers.{l}.{s}"),
        };
        match self {
            TokEmbd => "model.embed_tokens.weight".into(),
            Output => "lm_head.weight".into(),
            OutputNorm => "model.norm.weight".into(),
            AttnNorm(l) => b(l, "input_layernorm.weight"),
            PostNorm(l) => b(l, "post_attention_layernorm.weight"),
            Qkv(l) => b(l, "linear_attn.in_proj_qkv.weight"),
            Qkvz(l) => b(l, "linear_attn.in_proj_qkvz.weight"),
            Z(l) => b(l, "linear_attn.in_proj_z.weight"),
            Beta(l) => b(l, "linear_attn.in_proj_b.weight"),
            Alpha(l) => b(l, "linear_attn.in_proj_a.weight"),
            Ba(l) => b(l, "linear_attn.in_proj_ba.weight"),
            Conv(l) => b(l, "linear_attn.conv1d.weight"),
            SsmA(l) => b(l, "linear_attn.A_log"),
            DtBias(l) => b(l, "linear_attn.dt_bias"),
            SsmNorm(l) => b(l, "linear_attn.norm.weight"),
            SsmOut(l) => b(l, "linear_attn.out_proj.weight"),
            Q(l) => b(l, "self_attn.q_proj.weight"),
            K(l) => b(l, "self_attn.k_proj.weight"),
            V(l) => b(l, "self_attn.v_proj.weight"),
            QNorm(l) => b(l, "self_attn.q_norm.weight"),
            KNorm(l) => b(l, "self_attn.k_norm.weight"),
            O(l) => b(l, "self_attn.o_proj.weight"),
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
            ShGate(l) => b(l, "mlp.shared_expert.gate_proj.weight"),
            ShUp(l) => b(l, "mlp.shared_expert.up_proj.weight"),
            ShDown(l) => b(l, "mlp.shared_expert.down_proj.weight"),
            ShGateInp(l) => b(l, "mlp.shared_expert_gate.weight"),
            MtpFc(_) => "mtp.fc.weight".into(),
            MtpEnorm(_) => "mtp.pre_fc_norm_embedding.weight".into(),
            MtpHnorm(_) => "mtp.pre_fc_norm_hidden.weight".into(),
            MtpNorm(_) => "mtp.norm.weight".into(),
            // The releases share the trunk's head and embedding: no such tensors.
            MtpHead(_) | MtpEmbd(_) => String::new(),
        }
    }
}

pub struct Gdn<T> {
    /// [conv_dim, n_embd], rows q (Hk·dk) | k (Hk·dk) | v (Hv·dv).
    pub qkv: T,
    /// [Hv·dv, n_embd]
    pub z: T,
    /// [Hv, n_embd] each.
    pub beta: T,
    pub alpha: T,
    /// [conv_dim, K]
    pub conv: T,
    /// [Hv] f32: `-exp(A_log)`.
    pub a: T,
    /// [Hv]
    pub dt_bias: T,
    /// [dv]: plain `w` of the gated norm (no `1+`).
    pub norm: T,
    /// [n_embd, Hv·dv]
    pub out: T,
}

pub struct Attn<T> {
    /// [n_head·2·head_dim, n_embd]: per head `[q (head_dim) | gate (head_dim)]`.
    pub q: T,
    /// [n_head_kv·head_dim, n_embd] each.
    pub k: T,
    pub v: T,
    /// [head_dim], already `1+w`.
    pub q_norm: T,
    pub k_norm: T,
    /// [n_embd, n_head·head_dim]
    pub o: T,
}

pub enum Mixer<T> {
    Gdn(Gdn<T>),
    Attn(Attn<T>),
}

pub struct Moe<T> {
    /// [n_expert, n_embd]
    pub router: T,
    /// [n_expert, n_ff_exp, n_embd] (gate, up); [n_expert, n_embd, n_ff_exp] (down).
    pub gate_exps: T,
    pub up_exps: T,
    pub down_exps: T,
    /// Shared expert: [n_ff_shexp, n_embd] (gate, up), [n_embd, n_ff_shexp] (down),
    /// gate input [1, n_embd].
    pub shared: Option<(T, T, T, T)>,
}

pub enum Ffn<T> {
    /// [n_ff, n_embd] gate, up; [n_embd, n_ff] down.
    Dense {
        gate: T,
        up: T,
        down: T,
    },
    Moe(Moe<T>),
}

/// `S`: what the sink made of the layer's product sets ([`Sink::set`]); the members' own
/// fields then hold whatever the sink returned for them.
pub struct Layer<T, S = ()> {
    /// [n_embd] each, already `1+w`.
    pub attn_norm: T,
    pub post_norm: T,
    pub mixer: Mixer<T>,
    pub ffn: Ffn<T>,
    /// The mixer's products over the normed input, in this order: GDN `qkv, z, beta, alpha`;
    /// attention `q, k, v`. `None` from sinks that take each weight alone.
    pub mixer_set: Option<S>,
    /// The FFN's products over the normed input: dense `gate, up`; MoE `router`, then
    /// with a shared expert its `gate, up, gate_inp`.
    pub ffn_set: Option<S>,
}

pub struct Weights<T, S = ()> {
    /// [n_vocab, n_embd]
    pub tok_embd: T,
    /// [n_vocab, n_embd]; `None`: tied to `tok_embd`.
    pub output: Option<T>,
    /// [n_embd], already `1+w`.
    pub output_norm: T,
    pub layers: Vec<Layer<T, S>>,
    /// The MTP block, when the file has one (`Hparams::n_mtp`).
    pub mtp: Option<Mtp<T, S>>,
}

/// The multi-token prediction block (Qwen3-Next / Qwen3.5 `mtp.*`, llama.cpp `nextn`):
/// `x = fc([enorm(embed(t)) | hnorm(h)])`, one full-attention decoder layer, `norm`, the
/// head. `h` is the hidden state the head saw at the previous position.
pub struct Mtp<T, S = ()> {
    /// [n_embd, 2·n_embd]
    pub fc: T,
    /// [n_embd] each, already `1+w`.
    pub enorm: T,
    pub hnorm: T,
    pub norm: T,
    /// [n_vocab, n_embd]; `None`: the model's head (and embedding).
    pub head: Option<T>,
    pub embd: Option<T>,
    /// Its decoder layer (full attention, the model's FFN kind).
    pub layer: Layer<T, S>,
}

/// What a sink makes of a set: one `T` per member (in order), and the set's own form.
pub type SetOut<T, S> = (Vec<T>, Option<S>);

/// Where loaded weights go: the CPU reference takes each weight alone (a closure, through
/// [`load`]); the GPU also takes the products that read one input as a set, to run them
/// as one ([`load_sets`]).
pub trait Sink {
    type T;
    type Set;
    fn one(&mut self, w: Weight<'_>) -> Result<Self::T>;
    /// The products of one layer that read the same input, in the order [`Layer`]'s sets
    /// list: one `T` per member, and the set's own form.
    fn set(&mut self, ws: Vec<Weight<'_>>) -> Result<SetOut<Self::T, Self::Set>> {
        let ts = ws.into_iter().map(|w| self.one(w)).collect::<Result<_>>()?;
        Ok((ts, None))
    }
}

/// A sink lent to a loader (the caller keeps what it recorded).
impl<S: Sink + ?Sized> Sink for &mut S {
    type T = S::T;
    type Set = S::Set;
    fn one(&mut self, w: Weight<'_>) -> Result<S::T> {
        (**self).one(w)
    }
    fn set(&mut self, ws: Vec<Weight<'_>>) -> Result<SetOut<S::T, S::Set>> {
        (**self).set(ws)
    }
}

/// A closure as a [`Sink`] of single weights.
struct Each<F, T>(F, std::marker::PhantomData<T>);

impl<T, F: FnMut(Weight<'_>) -> Result<T>> Sink for Each<F, T> {
    type T = T;
    type Set = ();
    fn one(&mut self, w: Weight<'_>) -> Result<T> {
        (self.0)(w)
    }
}

/// The shared role-by-name loader (`models::Loader`) over this family's table.
type Loader<'a> = crate::models::Loader<'a, W>;

impl crate::models::TensorNames for W {
    fn gguf_name(self) -> String {
        W::gguf_name(self)
    }
    fn other_name(self) -> String {
        W::hf_name(self)
    }
}

impl<'a> Loader<'a> {
    /// A norm weight: GGUF stores `1+w` already; HF stores `w` and is folded here.
    fn norm(&self, w: W, n: usize) -> Result<Weight<'a>> {
        let t = self.shaped(w, &[n as u64])?;
        if self.gguf {
            return Ok(Weight::Stored(t));
        }
        let v = crate::models::read_f32(&t)?;
        Ok(Weight::F32 {
            name: t.name.to_string(),
            shape: vec![n as u64],
            data: v.iter().map(|x| 1.0 + x).collect(),
        })
    }
}

/// Load every weight through `sink`, one by one (CPU dequantization).
pub fn load<T>(
    file: &ModelFile,
    hp: &Hparams,
    sink: impl FnMut(Weight<'_>) -> Result<T>,
) -> Result<Weights<T>> {
    load_sets(file, hp, Each(sink, std::marker::PhantomData))
}

/// Load every weight through `sink`, the products sharing an input as sets (GPU upload).
pub fn load_sets<S: Sink>(
    file: &ModelFile,
    hp: &Hparams,
    mut sink: S,
) -> Result<Weights<S::T, S::Set>> {
    let ld = Loader::new(file);
    debug_assert_eq!(ld.gguf, hp.gguf);
    let e = hp.n_embd as u64;
    let tok = ld.shaped(W::TokEmbd, &[hp.n_vocab as u64, e])?;
    let tok_embd = sink.one(Weight::Stored(tok))?;
    let output = match ld.get(W::Output) {
        Some(t) => {
            crate::models::expect_shape(&t, &[hp.n_vocab as u64, e])?;
            Some(sink.one(Weight::Stored(t))?)
        }
        None => None,
    };
    let output_norm = sink.one(ld.norm(W::OutputNorm, hp.n_embd)?)?;
    let mut layers = Vec::with_capacity(hp.n_layer);
    for l in 0..hp.n_layer {
        let attn_norm = sink.one(ld.norm(W::AttnNorm(l), hp.n_embd)?)?;
        let post_norm = sink.one(ld.norm(W::PostNorm(l), hp.n_embd)?)?;
        let (mixer, mixer_set) = if hp.recurrent[l] {
            let (g, s) = load_gdn(&ld, hp, l, &mut sink)?;
            (Mixer::Gdn(g), s)
        } else {
            let (a, s) = load_attn(&ld, hp, l, &mut sink)?;
            (Mixer::Attn(a), s)
        };
        let (ffn, ffn_set) = load_ffn(&ld, hp, l, &mut sink)?;
        layers.push(Layer {
            attn_norm,
            post_norm,
            mixer,
            ffn,
            mixer_set,
            ffn_set,
        });
    }
    let mtp = match hp.n_mtp {
        0 => None,
        _ => Some(load_mtp(&ld, hp, &mut sink)?),
    };
    Ok(Weights {
        tok_embd,
        output,
        output_norm,
        layers,
        mtp,
    })
}

/// The MTP block: GGUF `blk.{n_layer}.*` with its `nextn.*` tensors, HF `mtp.*`.
fn load_mtp<S: Sink>(ld: &Loader<'_>, hp: &Hparams, sink: &mut S) -> Result<Mtp<S::T, S::Set>> {
    let l = if ld.gguf { hp.n_layer } else { MTP_HF_LAYER };
    let e = hp.n_embd as u64;
    let fc = sink.one(Weight::Stored(ld.shaped(W::MtpFc(l), &[e, 2 * e])?))?;
    let enorm = sink.one(ld.norm(W::MtpEnorm(l), hp.n_embd)?)?;
    let hnorm = sink.one(ld.norm(W::MtpHnorm(l), hp.n_embd)?)?;
    let norm = sink.one(ld.norm(W::MtpNorm(l), hp.n_embd)?)?;
    let mut vocab = |w: W| -> Result<Option<S::T>> {
        let Some(t) = ld.get(w).filter(|_| ld.gguf) else {
            return Ok(None);
        };
        crate::models::expect_shape(&t, &[hp.n_vocab as u64, e])?;
        sink.one(Weight::Stored(t)).map(Some)
    };
    let head = vocab(W::MtpHead(l))?;
    let embd = vocab(W::MtpEmbd(l))?;
    let attn_norm = sink.one(ld.norm(W::AttnNorm(l), hp.n_embd)?)?;
    let post_norm = sink.one(ld.norm(W::PostNorm(l), hp.n_embd)?)?;
    let (a, mixer_set) = load_attn(ld, hp, l, sink)?;
    let (ffn, ffn_set) = load_ffn(ld, hp, l, sink)?;
    Ok(Mtp {
        fc,
        enorm,
        hnorm,
        norm,
        head,
        embd,
        layer: Layer {
            attn_norm,
            post_norm,
            mixer: Mixer::Attn(a),
            ffn,
            mixer_set,
            ffn_set,
        },
    })
}

/// Products of a layer and what the sink made of their set.
type WithSet<X, S> = (X, Option<<S as Sink>::Set>);

/// Four members, in order, from a sink's answer to a set.
fn take4<T>(ts: Vec<T>) -> (T, T, T, T) {
    let mut it = ts.into_iter();
    match (it.next(), it.next(), it.next(), it.next()) {
        (Some(a), Some(b), Some(c), Some(d)) => (a, b, c, d),
        _ => panic!("a sink answered a set with fewer weights than it was given"),
    }
}

fn load_gdn<S: Sink>(
    ld: &Loader<'_>,
    hp: &Hparams,
    l: usize,
    sink: &mut S,
) -> Result<WithSet<Gdn<S::T>, S>> {
    let e = hp.n_embd as u64;
    let (hk, hv, dk, dv) = (
        hp.n_k_heads as u64,
        hp.n_v_heads as u64,
        hp.d_k as u64,
        hp.d_v as u64,
    );
    let r = hv / hk;
    let conv_dim = hp.conv_dim() as u64;
    let (qkv, z, beta, alpha);
    if hp.family == Family::Qwen3Next && !hp.gguf {
        // HF Qwen3-Next fuses q,k,v,z per key head g: [q_g (dk) | k_g (dk) | v_g (r·dv) | z_g (r·dv)],
        // and b,a per key head: [b_g (r) | a_g (r)]. Gather whole rows into lathe's layout.
        let t = ld.shaped(W::Qkvz(l), &[2 * hk * dk + 2 * hv * dv, e])?;
        let grp = 2 * dk + 2 * r * dv;
        let mut rows = Vec::new();
        for part in 0..3u64 {
            for g in 0..hk {
                let (off, n) = match part {
                    0 => (0, dk),
                    1 => (dk, dk),
                    _ => (2 * dk, r * dv),
                };
                rows.extend((0..n).map(|i| g * grp + off + i));
            }
        }
        qkv = Weight::Rows {
            src: t,
            rows,
            shape: vec![conv_dim, e],
        };
        let zrows = (0..hk)
            .flat_map(|g| (0..r * dv).map(move |i| g * grp + 2 * dk + r * dv + i))
            .collect();
        z = Weight::Rows {
            src: t,
            rows: zrows,
            shape: vec![hv * dv, e],
        };
    } else {
        qkv = Weight::Stored(ld.shaped(W::Qkv(l), &[conv_dim, e])?);
        z = Weight::Stored(ld.shaped(W::Z(l), &[hv * dv, e])?);
    }
    if hp.family == Family::Qwen3Next {
        // Both formats keep b,a fused per key head: [b_g (r) | a_g (r)] for each g.
        let t = ld.shaped(W::Ba(l), &[2 * hv, e])?;
        let b_rows = (0..hk)
            .flat_map(|g| (0..r).map(move |i| g * 2 * r + i))
            .collect();
        let a_rows = (0..hk)
            .flat_map(|g| (0..r).map(move |i| g * 2 * r + r + i))
            .collect();
        beta = Weight::Rows {
            src: t,
            rows: b_rows,
            shape: vec![hv, e],
        };
        alpha = Weight::Rows {
            src: t,
            rows: a_rows,
            shape: vec![hv, e],
        };
    } else {
        beta = Weight::Stored(ld.shaped(W::Beta(l), &[hv, e])?);
        alpha = Weight::Stored(ld.shaped(W::Alpha(l), &[hv, e])?);
    }
    let k = hp.conv_kernel as u64;
    let conv_t = ld.req(W::Conv(l))?;
    // GGUF [conv_dim, K]; HF conv1d.weight [conv_dim, 1, K]: same bytes.
    if conv_t.n_elements() != conv_dim * k || conv_t.row_len() != k {
        return Err(Error::tensor(
            conv_t.path,
            conv_t.name,
            format!("shape {:?}, expected [{conv_dim}, {k}]", conv_t.shape),
        ));
    }
    let conv = Weight::F32 {
        name: conv_t.name.to_string(),
        shape: vec![conv_dim, k],
        data: crate::models::read_f32(&conv_t)?,
    };
    let a_t = ld.shaped(W::SsmA(l), &[hv])?;
    let a_v = crate::models::read_f32(&a_t)?;
    // `-exp(A_log)` in f32, as llama.cpp's `convert_hf_to_gguf.py` stores `ssm_a`.
    let a_data = if ld.gguf {
        a_v
    } else {
        a_v.iter().map(|x| -x.exp()).collect()
    };
    let a = Weight::F32 {
        name: a_t.name.to_string(),
        shape: vec![hv],
        data: a_data,
    };
    let dt = ld.shaped(W::DtBias(l), &[hv])?;
    let dt_bias = Weight::F32 {
        name: dt.name.to_string(),
        shape: vec![hv],
        data: crate::models::read_f32(&dt)?,
    };
    let nt = ld.shaped(W::SsmNorm(l), &[dv])?;
    let norm = Weight::F32 {
        name: nt.name.to_string(),
        shape: vec![dv],
        data: crate::models::read_f32(&nt)?,
    };
    let out = Weight::Stored(ld.shaped(W::SsmOut(l), &[e, hv * dv])?);
    let (ts, set) = sink.set(vec![qkv, z, beta, alpha])?;
    let (qkv, z, beta, alpha) = take4(ts);
    let g = Gdn {
        qkv,
        z,
        beta,
        alpha,
        conv: sink.one(conv)?,
        a: sink.one(a)?,
        dt_bias: sink.one(dt_bias)?,
        norm: sink.one(norm)?,
        out: sink.one(out)?,
    };
    Ok((g, set))
}

fn load_attn<S: Sink>(
    ld: &Loader<'_>,
    hp: &Hparams,
    l: usize,
    sink: &mut S,
) -> Result<WithSet<Attn<S::T>, S>> {
    let e = hp.n_embd as u64;
    let hd = hp.head_dim as u64;
    let q = ld.shaped(W::Q(l), &[hp.n_head as u64 * 2 * hd, e])?;
    let k = ld.shaped(W::K(l), &[hp.n_head_kv as u64 * hd, e])?;
    let v = ld.shaped(W::V(l), &[hp.n_head_kv as u64 * hd, e])?;
    let o = ld.shaped(W::O(l), &[e, hp.n_head as u64 * hd])?;
    let (ts, set) = sink.set(vec![
        Weight::Stored(q),
        Weight::Stored(k),
        Weight::Stored(v),
    ])?;
    let mut ts = ts.into_iter();
    let (Some(q), Some(k), Some(v)) = (ts.next(), ts.next(), ts.next()) else {
        panic!("a sink answered a set with fewer weights than it was given");
    };
    let a = Attn {
        q,
        k,
        v,
        q_norm: sink.one(ld.norm(W::QNorm(l), hp.head_dim)?)?,
        k_norm: sink.one(ld.norm(W::KNorm(l), hp.head_dim)?)?,
        o: sink.one(Weight::Stored(o))?,
    };
    Ok((a, set))
}

fn load_ffn<S: Sink>(
    ld: &Loader<'_>,
    hp: &Hparams,
    l: usize,
    sink: &mut S,
) -> Result<WithSet<Ffn<S::T>, S>> {
    let e = hp.n_embd as u64;
    let is_moe = hp.moe.is_some() && ld.get(W::Router(l)).is_some();
    let Some(m) = hp.moe.as_ref().filter(|_| is_moe) else {
        let f = hp.n_ff as u64;
        let gate = ld.shaped(W::Gate(l), &[f, e])?;
        let up = ld.shaped(W::Up(l), &[f, e])?;
        let down = ld.shaped(W::Down(l), &[e, f])?;
        let (ts, set) = sink.set(vec![Weight::Stored(gate), Weight::Stored(up)])?;
        let mut ts = ts.into_iter();
        let (Some(gate), Some(up)) = (ts.next(), ts.next()) else {
            panic!("a sink answered a set with fewer weights than it was given");
        };
        let ffn = Ffn::Dense {
            gate,
            up,
            down: sink.one(Weight::Stored(down))?,
        };
        return Ok((ffn, set));
    };
    let (ne, f) = (m.n_expert as u64, m.n_ff_exp as u64);
    let router = ld.shaped(W::Router(l), &[ne, e])?;
    let stack = |one: fn(usize, usize) -> W, all: W, shape: [u64; 3]| -> Result<Weight<'_>> {
        if ld.gguf {
            return Ok(Weight::Stored(ld.shaped(all, &shape)?));
        }
        let parts = (0..m.n_expert)
            .map(|x| ld.shaped(one(l, x), &shape[1..]))
            .collect::<Result<Vec<_>>>()?;
        Ok(Weight::Stack {
            parts,
            shape: shape.to_vec(),
        })
    };
    let gate_exps = stack(W::GateExp, W::GateExps(l), [ne, f, e])?;
    let up_exps = stack(W::UpExp, W::UpExps(l), [ne, f, e])?;
    let down_exps = stack(W::DownExp, W::DownExps(l), [ne, e, f])?;
    let (router, shared, set) = if m.n_ff_shexp > 0 {
        let fs = m.n_ff_shexp as u64;
        let g = ld.shaped(W::ShGate(l), &[fs, e])?;
        let u = ld.shaped(W::ShUp(l), &[fs, e])?;
        let d = ld.shaped(W::ShDown(l), &[e, fs])?;
        let gi = ld.req(W::ShGateInp(l))?;
        if gi.n_elements() != e {
            return Err(Error::tensor(
                gi.path,
                gi.name,
                format!("shape {:?}, expected [1, {e}]", gi.shape),
            ));
        }
        let gi = Weight::F32 {
            name: gi.name.to_string(),
            shape: vec![1, e],
            data: crate::models::read_f32(&gi)?,
        };
        let (ts, set) = sink.set(vec![
            Weight::Stored(router),
            Weight::Stored(g),
            Weight::Stored(u),
            gi,
        ])?;
        let (router, g, u, gi) = take4(ts);
        let d = sink.one(Weight::Stored(d))?;
        (router, Some((g, u, d, gi)), set)
    } else {
        // A file whose shared-expert width is missing or 0 but which has the expert's
        // tensors would otherwise run without it and answer differently.
        if let Some(t) = ld.get(W::ShGate(l)) {
            let key = if ld.gguf {
                "expert_shared_feed_forward_length"
            } else {
                "shared_expert_intermediate_size"
            };
            return Err(Error::tensor(
                t.path,
                t.name,
                format!("a shared-expert tensor, but the hyper-parameter `{key}` is missing or 0"),
            ));
        }
        let (ts, set) = sink.set(vec![Weight::Stored(router)])?;
        let router = ts
            .into_iter()
            .next()
            .expect("a sink answers a set with one weight per member");
        (router, None, set)
    };
    let moe = Moe {
        router,
        gate_exps: sink.one(gate_exps)?,
        up_exps: sink.one(up_exps)?,
        down_exps: sink.one(down_exps)?,
        shared,
    };
    Ok((Ffn::Moe(moe), set))
}
