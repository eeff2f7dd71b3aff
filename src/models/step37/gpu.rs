//! The Step-3.7 forward on the GPU: one pass (one submission) per round of at most
//! [`DEFAULT_BATCH`] rows of the runtime's scheduler (prefill chunks and the decode rows of
//! every sequence of a batch), as the Llama family's. Each block has its own
//! geometry (heads, rotary width, RoPE base, window), so its own KV pool and RoPE table.
//! Routed experts run through the shared MoE blocks (`gpu::moe::routed_ffn`, the sigmoid
//! router of `gpu::router`), or through the expert arena and the CPU (`moe::Offload`) when
//! the planner leaves some experts cold.

use super::{Hparams, LayerGeom, Llama3, W};
use crate::forward::{KvType, LoadOptions, Logits, Want};
use crate::gpu::attention::{self, Attention, KvShape, KvSource, OutView, QView};
use crate::gpu::elementwise as ew;
use crate::gpu::matmul;
use crate::gpu::matmul::MoeRoute;
use crate::gpu::matvec::MatvecOpts;
use crate::gpu::moe::{ExpertStacks, FfnBufs, Glu};
use crate::gpu::norm;
use crate::gpu::operand::Operand;
use crate::gpu::rope::{self, RopeStyle, RopeTable, RopeView};
use crate::gpu::{embed, fit_rows, topk, BufferLimits, Gpu, GpuTensor, Pass, PassBuffer};
use crate::model_file::PartSpec;
use crate::models::runtime::family::FamilyModel;
use crate::models::runtime::head::{head_logits, suppress_mask, Head};
use crate::models::runtime::kv::{self, Pools, Slot};
use crate::models::runtime::link::Link;
use crate::models::runtime::moe::{MoeLayer, MoeScratch, Router};
use crate::models::runtime::rounds::{self, Part, RoundOut, RoundSeq, TopReq};
use crate::models::runtime::rows::{self, RowTables};
use crate::models::{expect_shape, read_f32, ModelFile, SeqState, Weight};
use crate::moe::{Needs, Offload, Plan, RunShape};
use crate::{Error, Result};
use std::sync::Arc;

/// Tokens per pass: activations are sized for this many rows (llama.cpp's micro-batch, as
/// the other families').
pub const DEFAULT_BATCH: usize = 512;

mod mtp;

/// One block's weights (`[out, in]` products as stored; norms as `1+w`).
struct Layer {
    g: LayerGeom,
    attn_norm: GpuTensor,
    q: GpuTensor,
    k: GpuTensor,
    v: GpuTensor,
    /// `[head_dim]` each.
    q_norm: GpuTensor,
    k_norm: GpuTensor,
    /// `[n_head, n_embd]`; `None` only where the file says the model has no gate.
    gate: Option<GpuTensor>,
    o: GpuTensor,
    ffn_norm: GpuTensor,
    /// A dense block's FFN, or a MoE block's shared expert beside its routed `experts`.
    mlp: Mlp,
    experts: Option<Experts>,
    rope: RopeTable,
}

/// A SwiGLU: gate and up `[n_ff, n_embd]`, down `[n_embd, n_ff]`.
struct Mlp {
    gate: GpuTensor,
    up: GpuTensor,
    down: GpuTensor,
}

/// Router `[n_expert, n_embd]` and its f32 selection bias `[n_expert]`; stacks
/// `[n_expert, n_ff_exp, n_embd]` ×2 and `[n_expert, n_embd, n_ff_exp]` (stand-ins without
/// buffers when offloaded).
struct Experts {
    router: GpuTensor,
    bias: Option<GpuTensor>,
    gate: GpuTensor,
    up: GpuTensor,
    down: GpuTensor,
}

/// Widest query and FFN rows over the blocks (the trunk's and any MTP block's).
fn widths(hp: &Hparams) -> (usize, usize, usize) {
    let trunk = &hp.layers;
    let nh = trunk.iter().map(|g| g.n_head).max().unwrap_or(1);
    let nkv = trunk.iter().map(|g| g.n_head_kv).max().unwrap_or(1);
    let ff = hp
        .moe
        .as_ref()
        .map_or(0, |m| m.n_ff_shexp)
        .max(if trunk.iter().any(|g| !g.moe) {
            hp.n_ff
        } else {
            0
        });
    (nh, nkv, ff)
}

/// f32 elements of each scratch buffer, by label: the one list [`Scratch::new`] allocates
/// and [`needs_part`] counts.
fn scratch_elems(hp: &Hparams, rows: usize) -> [(&'static str, usize); 20] {
    let (nh, nkv, ff) = widths(hp);
    let (q, kv) = (nh * hp.head_dim, nkv * hp.head_dim);
    let (ne, k, fe) = hp
        .moe
        .as_ref()
        .map_or((0, 0, 0), |m| (m.n_expert, m.n_used, m.n_ff_exp));
    [
        ("step37.ids", rows),
        ("step37.x", rows * hp.n_embd),
        ("step37.h", rows * hp.n_embd),
        ("step37.q", rows * q),
        ("step37.k", rows * kv),
        ("step37.v", rows * kv),
        ("step37.att", rows * q),
        ("step37.attn_gate", rows * nh),
        ("step37.gate", rows * ff),
        ("step37.up", rows * ff),
        ("step37.act", rows * ff),
        ("step37.attn_split", split_elems(hp) as usize),
        ("step37.rows", RowTables::elems(rows, table_pairs(hp))),
        ("step37.router", rows * ne),
        ("step37.moe_ids", rows * k),
        ("step37.moe_w", rows * k),
        ("step37.f_gate", rows * k * fe),
        ("step37.f_up", rows * k * fe),
        ("step37.f_act", rows * k * fe),
        ("step37.moe_out", rows * k * hp.n_embd),
    ]
}

/// The (KV heads, window) pairs of the blocks (the MTP block's too): their pools'
/// (capacity, window) pairs are at most as many (blocks of one geometry grow alike).
fn table_pairs(hp: &Hparams) -> usize {
    let mut seen = Vec::new();
    for g in &hp.layers {
        let k = (g.n_head_kv, window(hp, g));
        if !seen.contains(&k) {
            seen.push(k);
        }
    }
    seen.len()
}

/// The window of a block's attention: the model's on sliding blocks, none (0) on full ones.
fn window(hp: &Hparams, g: &LayerGeom) -> usize {
    if g.swa {
        hp.window
    } else {
        0
    }
}

/// Split-K scratch of one decode token (16 Mi elements at most, as the split count shrinks
/// to fit).
fn split_elems(hp: &Hparams) -> u64 {
    let (nh, _, _) = widths(hp);
    attention::scratch_elems(1, nh as u32, hp.head_dim as u32, attention::MAX_SPLIT).min(16 << 20)
}

/// Activation buffers for passes of `rows` tokens (f32 unless said).
struct Scratch {
    rows: usize,
    /// [rows] u32 token ids.
    ids: wgpu::Buffer,
    /// [rows, n_embd]: the residual stream and its normed copy.
    x: wgpu::Buffer,
    h: wgpu::Buffer,
    /// [rows, n_head·head_dim], [rows, n_head_kv·head_dim] ×2 (widest block): q, k, v;
    /// `att` the attention output; `attn_gate` [rows, n_head] the gate logits.
    q: wgpu::Buffer,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    att: wgpu::Buffer,
    attn_gate: wgpu::Buffer,
    /// [rows, max(n_ff, n_ff_shexp)]: gate, up and SwiGLU of a dense or shared FFN.
    gate: wgpu::Buffer,
    up: wgpu::Buffer,
    act: wgpu::Buffer,
    /// Split-K partials of a decode step's attention.
    attn_split: wgpu::Buffer,
    /// Each row's position; per (pool capacity, window) pair of the blocks each row's KV
    /// cache row and each decode row's visible cache rows.
    tables: RowTables,
    /// MoE only (else one element each): [rows, n_expert] router logits; [rows, n_used]
    /// ids (u32) and weights; [rows·n_used, n_ff_exp] the experts' gate, up and SwiGLU;
    /// [rows·n_used, n_embd] their unweighted outputs.
    router: wgpu::Buffer,
    moe_ids: wgpu::Buffer,
    moe_w: wgpu::Buffer,
    f_gate: wgpu::Buffer,
    f_up: wgpu::Buffer,
    f_act: wgpu::Buffer,
    moe_out: wgpu::Buffer,
    route: Option<MoeRoute>,
    /// [logit_rows, n_vocab]
    logits: wgpu::Buffer,
    logit_rows: usize,
    top: topk::LogitsTop,
}

impl Scratch {
    fn new(gpu: &Gpu, hp: &Hparams, rows: usize) -> Result<Scratch> {
        let e = scratch_elems(hp, rows);
        let f = |i: usize| gpu.buffer((e[i].1.max(1) * 4) as u64, e[i].0);
        let logit_rows = ((gpu.max_binding() / 4) as usize / hp.n_vocab).clamp(1, rows);
        Ok(Scratch {
            rows,
            ids: f(0)?,
            x: f(1)?,
            h: f(2)?,
            q: f(3)?,
            k: f(4)?,
            v: f(5)?,
            att: f(6)?,
            attn_gate: f(7)?,
            gate: f(8)?,
            up: f(9)?,
            act: f(10)?,
            attn_split: f(11)?,
            tables: RowTables::new(gpu, rows, table_pairs(hp), e[12].0)?,
            router: f(13)?,
            moe_ids: f(14)?,
            moe_w: f(15)?,
            f_gate: f(16)?,
            f_up: f(17)?,
            f_act: f(18)?,
            moe_out: f(19)?,
            route: match &hp.moe {
                Some(m) => Some(MoeRoute::new(
                    gpu,
                    m.n_expert as u32,
                    (rows * m.n_used) as u32,
                )?),
                None => None,
            },
            logits: gpu.buffer((logit_rows * hp.n_vocab * 4) as u64, "step37.logits")?,
            logit_rows,
            top: topk::LogitsTop::new(gpu, rows as u32, hp.n_vocab as u32)?,
        })
    }
}

/// What the layers of `part` need beside their weights for `run`: f16 or f32 K and V rows
/// per position (each block its own KV heads), and the scratch of one pass.
pub fn needs_part(hp: &Hparams, run: RunShape, part: &PartSpec) -> Needs {
    let seqs = run.seqs.max(1);
    let kv_elem: u64 = if run.kv == KvType::F32 { 4 } else { 2 };
    let rows = run.batch.max(1) as usize;
    let e = scratch_elems(hp, rows);
    let logits = (rows * hp.n_vocab) as u64 * 4;
    let route = hp.moe.as_ref().map_or(0, |m| {
        MoeRoute::bytes(m.n_expert as u32, (rows * m.n_used) as u32)
    });
    let mut buffers: Vec<PassBuffer> = e
        .iter()
        .map(|&(l, n)| PassBuffer::bound(l, n as u64 * 4))
        .collect();
    // One row of logits (their rows follow the binding limit), and the KV pools at their
    // first capacity (they grow to `KvShape::max_positions`).
    buffers.push(PassBuffer::bound("step37.logits", hp.n_vocab as u64 * 4));
    let mut kv_per_token = 0;
    for l in part.layers.clone() {
        let g = &hp.layers[l];
        let kv = kv_shape(hp, g, run.kv).bytes(seqs * kv::first_cap(run.ctx as usize) as u64);
        buffers.extend([
            PassBuffer::bound("step37.kv.k", kv),
            PassBuffer::bound("step37.kv.v", kv),
        ]);
        kv_per_token += 2 * (g.n_head_kv * hp.head_dim) as u64 * kv_elem * seqs;
    }
    Needs {
        weights: 0,
        kv_per_token,
        state: 0,
        activations: e.iter().map(|&(_, n)| n as u64 * 4).sum::<u64>() + logits + route,
        buffers,
        kv_elem,
        note: None,
    }
}

/// What the MTP block `opts` loads with the model in `file` (`--mtp-model`, else the file's
/// own) adds to its [`needs_part`] for `run` (`lathe plan`'s share of the loader's sum);
/// nothing without one.
pub fn draft_needs(file: &ModelFile, opts: &LoadOptions, run: RunShape) -> Result<Needs> {
    let hp = Hparams::from_file(file)?;
    Ok(match mtp::open_draft(file, &hp, opts)? {
        Some((df, dhp)) => mtp::draft_needs(file, &df, &dhp, run),
        None => Needs::default(),
    })
}

/// Block `g`'s KV rows for `--kv-type` (f16 by default).
fn kv_shape(hp: &Hparams, g: &LayerGeom, t: KvType) -> KvShape {
    KvShape {
        dtype: kv::kv_dtype(t),
        n_head_kv: g.n_head_kv as u32,
        head_dim: hp.head_dim as u32,
    }
}

/// One sequence: a slot of the pools and the tokens it has seen. Dropping it frees the slot.
pub struct StepSeq {
    /// Unique per sequence of the model (slots are reused): what speculation keys its rows by.
    id: u64,
    slot: Slot,
    pos: usize,
}

impl SeqState for StepSeq {
    fn pos(&self) -> usize {
        self.pos
    }
}

impl RoundSeq for StepSeq {
    fn slot(&self) -> u32 {
        self.slot.index
    }
    fn set_pos(&mut self, pos: usize) {
        self.pos = pos;
    }
}

pub struct GpuModel {
    pub gpu: Arc<Gpu>,
    pub hp: Hparams,
    tok_embd: GpuTensor,
    output: GpuTensor,
    output_norm: GpuTensor,
    /// [n_vocab]: `runtime::head::suppress_mask`.
    suppress: Option<wgpu::Buffer>,
    layers: Vec<Layer>,
    pools: Pools,
    scratch: Scratch,
    /// The expert arena and cold experts when the planner left some experts off the GPU.
    offload: Option<Offload>,
    /// [`FamilyModel::hidden_out`]: the wanted rows' final-norm hidden states come back
    /// instead of their logits.
    hidden_out: bool,
    /// Per-dispatch GPU times of the next pass when set ([`FamilyModel::profile_sink`]).
    profile: Option<Vec<(String, f64)>>,
    /// The MTP block (block `n_layer`; its KV pool is `pools[n_layer]`) and what
    /// speculation keeps.
    mtp: Option<mtp::Mtp>,
    spec: mtp::SpecState,
    next_id: std::sync::atomic::AtomicU64,
}

/// The tensor `w` of `file`, checked against `shape`.
fn shaped<'f>(file: &'f ModelFile, w: W, shape: &[u64]) -> Result<crate::tensor::TensorRef<'f>> {
    let t = file.require(&w.name(file))?;
    expect_shape(&t, shape)?;
    Ok(t)
}

/// An RMSNorm weight as the kernels multiply by it: GGUF stores `1+w`, HF `w`.
fn norm_weight<'f>(file: &'f ModelFile, w: W, n: u64) -> Result<Weight<'f>> {
    let t = shaped(file, w, &[n])?;
    Ok(match file {
        ModelFile::Gguf(_) => Weight::Stored(t),
        ModelFile::Hf(_) => Weight::F32 {
            name: t.name.to_string(),
            shape: vec![n],
            data: read_f32(&t)?.iter().map(|x| 1.0 + x).collect(),
        },
    })
}

impl GpuModel {
    pub fn load(gpu: Arc<Gpu>, file: &ModelFile, opts: &LoadOptions) -> Result<GpuModel> {
        let hp = Hparams::from_file(file)?;
        if opts.part.as_ref().is_some_and(|p| !(p.first && p.last)) {
            return Err(Error::Unsupported(
                "a Step-3.7 model split over several devices".into(),
            ));
        }
        let gated = Hparams::gated(file)?;
        let mut hp = hp;
        let draft = mtp::open_draft(file, &hp, opts)?;
        if let Some((_, dhp)) = &draft {
            // The block's geometry from the file that holds it: the scratch is sized over it.
            hp.layers.truncate(hp.n_layer);
            hp.layers.push(dhp.layers[dhp.n_layer]);
            hp.n_nextn = 1;
        }
        let hp = hp;
        let whole = PartSpec::whole(hp.n_layer);
        let needs = |r| {
            let run = RunShape::new(opts, r);
            let mut n = needs_part(&hp, run, &whole);
            if let Some((df, dhp)) = &draft {
                n.add(mtp::draft_needs(file, df, dhp, run));
            }
            n
        };
        let batch = fit_rows(
            DEFAULT_BATCH,
            BufferLimits::of(&gpu.limits),
            &file.path(),
            |r| needs(r).buffers,
        )?;
        // Placement before any upload: offloaded experts go to the arena after the rest.
        let experts = crate::models::registry::family(file)?.experts;
        let plan = Plan::new(&gpu, file, experts, opts, &needs, batch)?;
        let pass_rows = plan.as_ref().map_or(batch, |p| p.rows);
        let offloaded = plan.is_some();
        let total: u64 = file.tensors().map(|t| t.data.len() as u64).sum();
        let done = std::cell::Cell::new(0u64);
        let put = |w: Weight<'_>| -> Result<GpuTensor> {
            let g = w.with_tensor(|t| gpu.upload_tensor(t))?;
            done.set(done.get() + g.bytes());
            if let Some(p) = &opts.progress {
                p(done.get().min(total), total);
            }
            Ok(g)
        };
        let up = |w: W, shape: &[u64]| put(Weight::Stored(shaped(file, w, shape)?));
        let norm = |w: W, n: u64| put(norm_weight(file, w, n)?);
        let (e, v) = (hp.n_embd as u64, hp.n_vocab as u64);
        let tok_embd = up(W::TokEmbd, &[v, e])?;
        let output = up(W::Output, &[v, e])?;
        let output_norm = norm(W::OutputNorm, e)?;
        let rope_freqs = rope_freqs(file)?;
        let src = LayerSrc {
            gpu: &gpu,
            file,
            hp: &hp,
            gated,
            offloaded,
            rope_freqs: rope_freqs.as_deref(),
            put: &put,
        };
        let layers = (0..hp.n_layer)
            .map(|l| load_layer(&src, l))
            .collect::<Result<Vec<_>>>()?;
        let mtp = match &draft {
            Some((df, dhp)) => Some(mtp::Mtp::load(&gpu, df, dhp, &hp, pass_rows, &put)?),
            None => None,
        };
        let blocks = layers.iter().chain(mtp.as_ref().map(|m| &m.layer));
        let shapes = blocks.map(|lw| kv_shape(&hp, &lw.g, opts.kv_type));
        let slots = opts.max_seqs.max(1);
        let pools = Pools::new(&gpu, shapes, slots, kv::first_cap(opts.ctx), "step37.kv")?;
        let scratch = Scratch::new(&gpu, &hp, pass_rows)?;
        let offload = match plan {
            Some(p) => Some(Offload::new(&gpu, file, p, opts, pass_rows)?),
            None => None,
        };
        Ok(GpuModel {
            suppress: suppress_mask(&gpu, file, hp.n_vocab)?,
            gpu,
            hp,
            tok_embd,
            output,
            output_norm,
            layers,
            pools,
            scratch,
            offload,
            hidden_out: false,
            profile: None,
            mtp,
            spec: Default::default(),
            next_id: Default::default(),
        })
    }

    /// Feed the items in the runtime's rounds of at most [`DEFAULT_BATCH`] rows shared by
    /// all of them ([`rounds::run_batch`]: prefill chunks first, the decode rows of every
    /// sequence together after them); per item the logits it wants.
    fn run_items(&mut self, items: &mut [(&mut StepSeq, &[u32], Want)]) -> Result<Vec<Logits>> {
        let (v, rows) = (self.hp.n_vocab, self.scratch.rows);
        rounds::run_batch(items, v, rows, true, |r| {
            let mut prof = self.profile.take();
            let out = self.round(&r.parts, &r.toks, &r.wants, &r.top, prof.as_mut());
            if prof.is_some() {
                self.profile = prof;
            }
            out
        })
    }

    /// One pass over the rows of `parts` (their tokens `toks` in row order): the logits of
    /// the `wants` row runs and the top logits of the `top` rows; every dispatch timed into
    /// `prof` when given.
    fn round(
        &mut self,
        parts: &[Part],
        toks: &[u32],
        wants: &[(usize, usize)],
        top: &TopReq,
        prof: Option<&mut Vec<(String, f64)>>,
    ) -> Result<RoundOut> {
        let gpu = self.gpu.clone();
        let mut pass = gpu.pass();
        if prof.is_some() {
            pass.hold();
        }
        let need = parts.iter().map(|p| p.pos0 + p.n).max().unwrap_or(0);
        self.pools.reserve(&mut pass, need)?;
        let hp = &self.hp;
        let trunk = self.pools.blocks.iter().zip(&hp.layers).take(hp.n_layer);
        let pairs = trunk.map(|(p, g)| (p.cap, window(hp, g)));
        self.scratch.tables.write(&gpu, parts, pairs)?;
        let sc = &self.scratch;
        let n = toks.len() as u32;
        gpu.write(&sc.ids, 0, bytemuck::cast_slice(toks));
        embed::embed(
            &mut pass,
            &self.tok_embd,
            &sc.ids,
            0,
            n,
            Operand::new(&sc.x, 0),
        )?;
        for (l, lw) in self.layers.iter().enumerate() {
            self.block(&mut pass, l, lw, parts, n)?;
            pass.flush_every(crate::gpu::FLUSH_OPS)?;
        }
        let head = (&self.output_norm, &self.output);
        self.head(pass, n, (wants, top), head, self.hidden_out, prof)
    }

    /// Block `l` (weights `lw`) over the `n` rows of the residual stream in `x`.
    fn block(
        &self,
        pass: &mut Pass<'_>,
        l: usize,
        lw: &Layer,
        parts: &[Part],
        n: u32,
    ) -> Result<()> {
        let (hp, sc) = (&self.hp, &self.scratch);
        let e = hp.n_embd as u32;
        let norm = |pass: &mut Pass<'_>, w| {
            norm::rms_norm(
                pass,
                n,
                e,
                Operand::new(&sc.x, 0),
                Some(Operand::new(&sc.h, 0)),
                Some(w),
                hp.eps,
            )
        };
        norm(pass, &lw.attn_norm)?;
        self.attention(pass, l, lw, parts, n)?;
        norm(pass, &lw.ffn_norm)?;
        if let Some(x) = &lw.experts {
            self.moe(pass, l, x, n)?;
        }
        self.swiglu(pass, &lw.mlp, lw.g.clamp_shexp, n)
    }

    /// The `n` rows in `x` through the final norm and the head (`(norm, output)`; `hidden`:
    /// the wanted normed rows come back instead): the logits of the `wants` row runs and the
    /// top logits of the `top` rows ([`head_logits`]), `pass` submitted (its dispatches timed
    /// into `prof` when given).
    fn head(
        &self,
        mut pass: Pass<'_>,
        n: u32,
        (wants, top): (&[(usize, usize)], &TopReq),
        (final_norm, output): (&GpuTensor, &GpuTensor),
        hidden: bool,
        prof: Option<&mut Vec<(String, f64)>>,
    ) -> Result<RoundOut> {
        let (hp, sc) = (&self.hp, &self.scratch);
        if wants.is_empty() && top.rows.is_empty() {
            pass.submit_or_profile(prof)?;
            return Ok((Vec::new(), Vec::new()));
        }
        norm::rms_norm(
            &mut pass,
            n,
            hp.n_embd as u32,
            Operand::new(&sc.x, 0),
            Some(Operand::new(&sc.h, 0)),
            Some(final_norm),
            hp.eps,
        )?;
        let head = Head {
            w: output,
            n_vocab: hp.n_vocab,
            h: &sc.h,
            n_embd: hp.n_embd,
            logits: &sc.logits,
            logit_rows: sc.logit_rows,
            top: &sc.top,
            hidden,
            softcap: None,
            suppress: self.suppress.as_ref(),
        };
        head_logits(pass, &head, wants, top, prof)
    }

    /// `x += down(silu(gate h) ⊙ up h)`: a dense block's FFN or the shared expert, with
    /// Step's clamp after SiLU where the block has a `limit`.
    fn swiglu(&self, pass: &mut Pass<'_>, m: &Mlp, limit: Option<f32>, n: u32) -> Result<()> {
        let sc = &self.scratch;
        linear(pass, &m.gate, &sc.h, &sc.gate, n, false)?;
        linear(pass, &m.up, &sc.h, &sc.up, n, false)?;
        let (ff, act) = (m.gate.shape[0] as u32, Operand::new(&sc.act, 0));
        let (g, u) = (Operand::new(&sc.gate, 0), Operand::new(&sc.up, 0));
        match limit {
            Some(l) => ew::swiglu_act_clamp(pass, n, ff, act, g, u, l)?,
            None => ew::swiglu(pass, n, ff, act, g, u, None)?,
        }
        linear(pass, &m.down, &sc.act, &sc.x, n, true)
    }

    /// Block `l`'s routed experts over the normed rows in `h`, added to the residual stream
    /// (`runtime::moe`): sigmoid scores, top-k of score + bias, SwiGLU experts with Step's
    /// clamp where the block has one.
    fn moe(&self, pass: &mut Pass<'_>, l: usize, x: &Experts, n: u32) -> Result<()> {
        let sc = &self.scratch;
        let m = self.hp.moe.as_ref().expect("MoE block in a MoE model");
        let layer = MoeLayer {
            layer: l,
            n_embd: self.hp.n_embd as u32,
            n_expert: m.n_expert as u32,
            k: m.n_used as u32,
            router_w: &x.router,
            router: Router::Sigmoid {
                bias: x.bias.as_ref(),
                renorm: m.norm,
                scale: m.scale,
            },
            expert_scale: None,
            glu: match self.hp.layers[l].clamp_exp {
                Some(limit) => Glu::SwigluActClamp(limit),
                None => Glu::Swiglu(None),
            },
            stacks: ExpertStacks {
                gate: &x.gate,
                up: &x.up,
                down: &x.down,
            },
        };
        let msc = MoeScratch {
            logits: &sc.router,
            ids: &sc.moe_ids,
            weights: &sc.moe_w,
            ffn: FfnBufs {
                gate: &sc.f_gate,
                up: &sc.f_up,
                act: &sc.f_act,
                out: &sc.moe_out,
            },
            route: sc.route.as_ref(),
        };
        layer.run(pass, &msc, self.offload.as_ref(), (&sc.h, &sc.x), n)
    }

    /// Block `l`'s attention over the normed rows in `h`, added to the residual stream:
    /// q/k per-head norms, RoPE on the block's rotated dims, attention over the block's own
    /// KV rows (its window on sliding blocks), each head's output times sigmoid of its gate.
    fn attention(
        &self,
        pass: &mut Pass<'_>,
        l: usize,
        lw: &Layer,
        parts: &[Part],
        n: u32,
    ) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let g = &lw.g;
        let pool = &self.pools.blocks[l];
        let (cap, window) = (pool.cap, window(hp, g));
        let tables = &sc.tables;
        let (nh, nkv, hd) = (g.n_head as u32, g.n_head_kv as u32, hp.head_dim as u32);
        linear(pass, &lw.q, &sc.h, &sc.q, n, false)?;
        linear(pass, &lw.k, &sc.h, &sc.k, n, false)?;
        linear(pass, &lw.v, &sc.h, &sc.v, n, false)?;
        for (buf, heads, w) in [(&sc.q, nh, &lw.q_norm), (&sc.k, nkv, &lw.k_norm)] {
            norm::rms_norm(
                pass,
                n * heads,
                hd,
                Operand::new(buf, 0),
                None,
                Some(w),
                hp.eps,
            )?;
            rope::rope(
                pass,
                &RopeView::packed(buf, 0, n, heads, hd),
                RopeStyle::Neox,
                0,
                &lw.rope,
                tables.positions(),
                false,
            )?;
        }
        let (kc, vc) = &pool.kv;
        let dst = tables.kv_rows(cap, window)?;
        attention::write_kv(pass, pool.shape, &sc.k, 0, nkv * hd, n, kc, dst)?;
        attention::write_kv(pass, pool.shape, &sc.v, 0, nkv * hd, n, vc, dst)?;
        let qw = nh * hd;
        let ranges = tables.ranges(cap, window)?;
        rows::attend(parts, cap, window, ranges, |row, n_q, keys, max_keys| {
            let split = rows::split(&sc.attn_split, n_q, nh, hd, pool.shape, max_keys, &keys);
            attention::attention(
                pass,
                &Attention {
                    n_q,
                    n_head: nh,
                    kv: pool.shape,
                    scale: 1.0 / (hd as f32).sqrt(),
                    q: QView {
                        buf: &sc.q,
                        off: row * qw,
                        tok_stride: qw,
                        head_stride: hd,
                    },
                    out: OutView {
                        buf: &sc.att,
                        off: row * qw,
                        tok_stride: qw,
                    },
                    a: KvSource { k: kc, v: Some(vc) },
                    b: None,
                    keys,
                    sinks: None,
                    split,
                },
            )
        })?;
        if let Some(gate) = &lw.gate {
            // att [n, nh, hd] as n·nh rows, each times sigmoid of its head's gate logit.
            linear(pass, gate, &sc.h, &sc.attn_gate, n, false)?;
            ew::sigmoid_mul_row_inplace(
                pass,
                n * nh,
                hd,
                Operand::new(&sc.att, 0),
                Operand::new(&sc.attn_gate, 0),
            )?;
        }
        linear(pass, &lw.o, &sc.att, &sc.x, n, true)
    }

    fn new_step_seq(&self) -> Result<StepSeq> {
        Ok(StepSeq {
            id: self
                .next_id
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            slot: self.pools.take_slot()?,
            pos: 0,
        })
    }

    /// Make `dst` hold `src`'s KV rows `[0, pos)`, slot to slot.
    fn copy_rows(&self, src: &StepSeq, dst: &mut StepSeq) -> Result<()> {
        self.pools
            .copy_rows(&self.gpu, &src.slot, &dst.slot, src.pos)?;
        dst.pos = src.pos;
        Ok(())
    }
}

/// Where [`load_layer`] reads blocks from: `file` (geometry `hp`), its attention gates
/// required when `gated`, its routed experts as stand-ins when `offloaded` (the arena
/// holds them), its llama3 divisors, each weight uploaded through `put`.
struct LayerSrc<'a, 'f> {
    gpu: &'a Gpu,
    file: &'f ModelFile,
    hp: &'a Hparams,
    gated: bool,
    offloaded: bool,
    rope_freqs: Option<&'a [f32]>,
    put: &'a dyn Fn(Weight<'_>) -> Result<GpuTensor>,
}

/// Block `l` of `src` (geometry `hp.layers[l]`).
fn load_layer(src: &LayerSrc<'_, '_>, l: usize) -> Result<Layer> {
    let LayerSrc {
        gpu,
        file,
        hp,
        gated,
        offloaded,
        rope_freqs,
        put,
    } = *src;
    let up = |w: W, shape: &[u64]| put(Weight::Stored(shaped(file, w, shape)?));
    let norm = |w: W, n: u64| put(norm_weight(file, w, n)?);
    let (e, hd) = (hp.n_embd as u64, hp.head_dim as u64);
    let mlp = |g: W, u: W, d: W, ff: u64| -> Result<Mlp> {
        Ok(Mlp {
            gate: up(g, &[ff, e])?,
            up: up(u, &[ff, e])?,
            down: up(d, &[e, ff])?,
        })
    };
    let g = hp.layers[l];
    let (qw, kvw) = ((g.n_head as u64) * hd, (g.n_head_kv as u64) * hd);
    let gate = match gated {
        // Required: a missing gate would drop the per-head sigmoid silently.
        true => Some(up(W::Gate(l), &[g.n_head as u64, e])?),
        false => None,
    };
    let (mlp_w, experts) = match (&hp.moe, g.moe) {
        (Some(m), true) => {
            let (ne, fe) = (m.n_expert as u64, m.n_ff_exp as u64);
            let router = up(W::Router(l), &[ne, e])?;
            let bias = match file.tensor(&W::RouterBias(l).name(file)) {
                None => None,
                Some(_) => {
                    let t = shaped(file, W::RouterBias(l), &[ne])?;
                    Some(put(Weight::F32 {
                        name: t.name.to_string(),
                        shape: vec![ne],
                        data: read_f32(&t)?,
                    })?)
                }
            };
            let ws = [
                (W::GateExps(l), [ne, fe, e]),
                (W::UpExps(l), [ne, fe, e]),
                (W::DownExps(l), [ne, e, fe]),
            ]
            .map(|(w, sh)| {
                let w = Weight::Stored(shaped(file, w, &sh)?);
                match offloaded {
                    true => Ok(w.stand_in()),
                    false => put(w),
                }
            });
            let [gate_x, up_x, down_x] = ws;
            let shared = mlp(
                W::GateShexp(l),
                W::UpShexp(l),
                W::DownShexp(l),
                m.n_ff_shexp as u64,
            )?;
            let x = Experts {
                router,
                bias,
                gate: gate_x?,
                up: up_x?,
                down: down_x?,
            };
            (shared, Some(x))
        }
        _ => (
            mlp(W::FfnGate(l), W::FfnUp(l), W::FfnDown(l), hp.n_ff as u64)?,
            None,
        ),
    };
    let inv = inv_freq(hp, &g, rope_freqs, file)?;
    Ok(Layer {
        g,
        attn_norm: norm(W::AttnNorm(l), e)?,
        q: up(W::Q(l), &[qw, e])?,
        k: up(W::K(l), &[kvw, e])?,
        v: up(W::V(l), &[kvw, e])?,
        q_norm: norm(W::QNorm(l), hd)?,
        k_norm: norm(W::KNorm(l), hd)?,
        gate,
        o: up(W::O(l), &[e, qw])?,
        ffn_norm: norm(W::FfnNorm(l), e)?,
        mlp: mlp_w,
        experts,
        rope: RopeTable::new(gpu, &inv, "step37.rope")?,
    })
}

/// A GGUF file's llama3 divisors (`rope_freqs.weight`), where it has them.
fn rope_freqs(file: &ModelFile) -> Result<Option<Vec<f32>>> {
    match file {
        ModelFile::Gguf(_) => match file.tensor(&W::RopeFreqs.gguf_name()) {
            Some(t) => Ok(Some(read_f32(&t)?)),
            None => Ok(None),
        },
        ModelFile::Hf(_) => Ok(None),
    }
}

/// `y = W x` (or `y += W x`) over `n` rows.
fn linear(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    n: u32,
    accumulate: bool,
) -> Result<()> {
    let opts = MatvecOpts {
        accumulate,
        ..Default::default()
    };
    matmul::matmul_opts(pass, w, Operand::new(x, 0), Operand::new(y, 0), n, &opts)
}

/// Block `g`'s RoPE inverse frequencies over its `n_rot` dims: `theta^(-2i/n_rot)`; on full
/// blocks divided by the first `n_rot/2` of `rope_freqs` (GGUF, llama.cpp's
/// `freq_factors`) or scaled as Llama 3.1's (HF `rope_scaling`, transformers'
/// `_compute_llama3_parameters`: long wavelengths divided by `factor`, short ones kept, a
/// smooth blend between). Sliding blocks take neither (llama.cpp passes them no factors).
fn inv_freq(
    hp: &Hparams,
    g: &LayerGeom,
    rope_freqs: Option<&[f32]>,
    file: &ModelFile,
) -> Result<Vec<f32>> {
    let mut inv = crate::cpu::ops::rope_inv_freq(g.rope_theta, g.n_rot);
    if g.swa {
        return Ok(inv);
    }
    if let Some(d) = rope_freqs {
        if d.len() < inv.len() {
            return Err(Error::tensor(
                file.path(),
                W::RopeFreqs.gguf_name(),
                format!("{} factors for {} rotated pairs", d.len(), inv.len()),
            ));
        }
        inv.iter_mut().zip(d).for_each(|(f, d)| *f /= d);
    }
    if let Some(Llama3 {
        factor,
        low_freq_factor: lo,
        high_freq_factor: hi,
        original_max_positions: old,
    }) = hp.llama3
    {
        let (lo_wave, hi_wave) = (old / lo, old / hi);
        for f in &mut inv {
            let wave = 2.0 * std::f32::consts::PI / *f;
            if wave > lo_wave {
                *f /= factor;
            } else if wave >= hi_wave {
                let smooth = (old / wave - lo) / (hi - lo);
                *f = (1.0 - smooth) * *f / factor + smooth * *f;
            }
        }
    }
    Ok(inv)
}

impl FamilyModel for GpuModel {
    type Seq = StepSeq;
    fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
    fn n_vocab(&self) -> usize {
        self.hp.n_vocab
    }
    fn new_seq(&self) -> Result<StepSeq> {
        self.new_step_seq()
    }
    fn reset(&self, seq: &mut StepSeq) -> Result<()> {
        seq.pos = 0;
        Ok(())
    }
    fn copy_seq(&self, src: &StepSeq, dst: &mut StepSeq) -> Result<()> {
        self.copy_rows(src, dst)
    }
    fn hidden_out(&mut self, on: bool) -> Result<()> {
        self.hidden_out = on;
        Ok(())
    }
    fn forward_batch(&mut self, items: &mut [(&mut StepSeq, &[u32], Want)]) -> Result<Vec<Logits>> {
        self.run_items(items)
    }
    fn profile_sink(&mut self) -> Result<&mut Option<Vec<(String, f64)>>> {
        Ok(&mut self.profile)
    }
    fn offload(&self) -> Option<&Offload> {
        self.offload.as_ref()
    }
    fn routed_experts(&self) -> usize {
        self.hp.moe.as_ref().map_or(0, |m| {
            m.n_expert
                * self.hp.layers[..self.hp.n_layer]
                    .iter()
                    .filter(|g| g.moe)
                    .count()
        })
    }
    fn max_context(&self) -> Option<usize> {
        Some(self.pools.max_positions(&self.gpu))
    }
    fn pass_rows(&self) -> usize {
        self.scratch.rows
    }
    /// One device holds the whole model ([`GpuModel::load`] refuses a part): no neighbours.
    fn set_link(&mut self, _link: Link) {}
    fn speculate(&mut self) -> Option<&mut dyn crate::models::spec::Speculate> {
        Some(self)
    }
}
