//! The Llama-family forward on the GPU: one pass (one submission) per round of at most
//! [`DEFAULT_BATCH`] rows of the runtime's scheduler (prefill chunks and the decode rows of
//! every sequence of a batch). Products run through `matmul` (matvec for a
//! few rows, the tiled kernels for more), attention over the sequence's KV rows (flash
//! tiles for a chunk, split-K for one token); only the wanted logits come back. Routed
//! experts run as `models::qwen35`'s do: stacked on the GPU, or through the expert arena and
//! the CPU (`moe::Offload`) when the planner leaves some experts cold.

use super::{Hparams, RopeScaling, W};
use crate::forward::{KvType, LoadOptions, Logits, Want};
use crate::gpu::attention::{self, Attention, KvShape, KvSource, OutView, QView};
use crate::gpu::elementwise as ew;
use crate::gpu::matmul;
use crate::gpu::matmul::MoeRoute;
use crate::gpu::matvec::{self, Epilogue, MatvecOpts, Prologue};
use crate::gpu::moe::{ExpertStacks, FfnBufs, Glu};
use crate::gpu::norm;
use crate::gpu::operand::Operand;
use crate::gpu::rope::{self, RopeTable, RopeView};
use crate::gpu::{embed, fit_rows, topk, BufferLimits, Gpu, GpuTensor, Pass, PassBuffer};
use crate::model_file::PartSpec;
use crate::models::runtime::family::FamilyModel;
use crate::models::runtime::head::{head_logits, suppress_mask, Head};
use crate::models::runtime::kv::{self, Pools, Slot};
use crate::models::runtime::link::Link;
use crate::models::runtime::moe::{MoeLayer, MoeScratch, Router};
use crate::models::runtime::rounds::{self, Part, RoundOut, RoundSeq, TopReq};
use crate::models::runtime::rows::{self, RowTables};
use crate::models::runtime::trace::Tracer;
use crate::models::{expect_shape, ModelFile, SeqState, Weight};
use crate::moe::{Needs, Offload, Plan, RunShape};
use crate::{DType, Error, Result};
use std::sync::Arc;

/// Tokens per pass: activations are sized for this many rows (llama.cpp's micro-batch, as
/// the other families').
pub const DEFAULT_BATCH: usize = 512;

/// One block's weights (`[out, in]` products as stored).
struct Layer {
    attn_norm: GpuTensor,
    q: GpuTensor,
    k: GpuTensor,
    v: GpuTensor,
    /// Qwen2: f32 `[n_head·head_dim]`, `[n_head_kv·head_dim]` ×2.
    bias: Option<[wgpu::Buffer; 3]>,
    /// Qwen3: per-head RMSNorm weights `[head_dim]` of q and k.
    qk_norm: Option<(GpuTensor, GpuTensor)>,
    o: GpuTensor,
    ffn_norm: GpuTensor,
    ffn: Ffn,
}

enum Ffn {
    Dense {
        gate_up: GateUp,
        down: GpuTensor,
    },
    /// Router `[n_expert, n_embd]`; stacks `[n_expert, n_ff_exp, n_embd]` ×2 and
    /// `[n_expert, n_embd, n_ff_exp]` (stand-ins without buffers when offloaded).
    Moe {
        router: GpuTensor,
        gate: GpuTensor,
        up: GpuTensor,
        down: GpuTensor,
    },
}

/// A dense FFN's gate and up products, writing `gu` rows `[gate | up]` of `2·n_ff`.
enum GateUp {
    /// One `[2·n_ff, n_embd]` weight, gate rows first (both of one stored type): one product,
    /// and at decode the SwiGLU in its store.
    Joined(GpuTensor),
    /// Of different stored types: a product into each half of `gu`'s rows.
    Apart { gate: GpuTensor, up: GpuTensor },
}

/// Activation buffers for passes of `rows` tokens (f32 unless said).
struct Scratch {
    rows: usize,
    /// [rows] u32 token ids.
    ids: wgpu::Buffer,
    /// [rows, n_embd]: the residual stream and its normed copy.
    x: wgpu::Buffer,
    h: wgpu::Buffer,
    /// A pass of n rows: q `[n, n_head·head_dim]` from element 0, k and v
    /// `[n, n_head_kv·head_dim]` after it ([`qkv_offs`]; one token's q|k|v are contiguous, as
    /// `rope::qk_norm_rope` takes them). Sized for `rows`.
    qkv: wgpu::Buffer,
    /// [rows, n_head·head_dim]: the attention output.
    att: wgpu::Buffer,
    /// [rows, 2·n_ff]: gate | up per row; [rows, n_ff]: SwiGLU of them.
    gu: wgpu::Buffer,
    act: wgpu::Buffer,
    /// Each row's position and KV cache row, each decode row's visible cache rows (one
    /// capacity and window: one pair).
    tables: RowTables,
    /// Split-K partials of a decode step's attention.
    attn_split: wgpu::Buffer,
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

/// f32 elements of each scratch buffer, by label: the one list [`Scratch::new`] allocates
/// and [`needs_part`] counts.
fn scratch_elems(hp: &Hparams, rows: usize) -> [(&'static str, usize); 16] {
    let (q, kv) = (hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim);
    let (ne, k, fe) = hp
        .moe
        .as_ref()
        .map_or((0, 0, 0), |m| (m.n_expert, m.n_used, m.n_ff_exp));
    let ff = if hp.moe.is_some() { 0 } else { hp.n_ff };
    [
        ("llama.ids", rows),
        ("llama.x", rows * hp.n_embd),
        ("llama.h", rows * hp.n_embd),
        ("llama.qkv", rows * (q + 2 * kv)),
        ("llama.att", rows * q),
        ("llama.gu", rows * 2 * ff),
        ("llama.act", rows * ff),
        ("llama.rows", RowTables::elems(rows, 1)),
        ("llama.attn_split", split_elems(hp) as usize),
        ("llama.router", rows * ne),
        ("llama.moe_ids", rows * k),
        ("llama.moe_w", rows * k),
        ("llama.f_gate", rows * k * fe),
        ("llama.f_up", rows * k * fe),
        ("llama.f_act", rows * k * fe),
        ("llama.moe_out", rows * k * hp.n_embd),
    ]
}

/// Split-K scratch of one decode token (16 Mi elements at most, as the split count shrinks
/// to fit).
fn split_elems(hp: &Hparams) -> u64 {
    attention::scratch_elems(
        1,
        hp.n_head as u32,
        hp.head_dim as u32,
        attention::MAX_SPLIT,
    )
    .min(16 << 20)
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
            qkv: f(3)?,
            att: f(4)?,
            gu: f(5)?,
            act: f(6)?,
            tables: RowTables::new(gpu, rows, 1, e[7].0)?,
            attn_split: f(8)?,
            router: f(9)?,
            moe_ids: f(10)?,
            moe_w: f(11)?,
            f_gate: f(12)?,
            f_up: f(13)?,
            f_act: f(14)?,
            moe_out: f(15)?,
            route: match &hp.moe {
                Some(m) => Some(MoeRoute::new(
                    gpu,
                    m.n_expert as u32,
                    (rows * m.n_used) as u32,
                )?),
                None => None,
            },
            logits: gpu.buffer((logit_rows * hp.n_vocab * 4) as u64, "llama.logits")?,
            logit_rows,
            top: topk::LogitsTop::new(gpu, rows as u32, hp.n_vocab as u32)?,
        })
    }
}

/// What the layers of `part` need beside their weights for `run`: f16 or f32 K and V rows
/// per position, and the scratch of one pass.
pub fn needs_part(hp: &Hparams, run: RunShape, part: &PartSpec) -> Needs {
    let seqs = run.seqs.max(1);
    let kv_elem: u64 = if run.kv == KvType::F32 { 4 } else { 2 };
    let layers = part.layers.len() as u64;
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
    buffers.push(PassBuffer::bound("llama.logits", hp.n_vocab as u64 * 4));
    let kv = kv_shape(hp, run.kv).bytes(seqs * kv::first_cap(run.ctx as usize) as u64);
    for _ in part.layers.clone() {
        buffers.extend([
            PassBuffer::bound("llama.kv.k", kv),
            PassBuffer::bound("llama.kv.v", kv),
        ]);
    }
    Needs {
        weights: 0,
        kv_per_token: layers * 2 * (hp.n_head_kv * hp.head_dim) as u64 * kv_elem * seqs,
        state: 0,
        activations: e.iter().map(|&(_, n)| n as u64 * 4).sum::<u64>() + logits + route,
        buffers,
        kv_elem,
        note: None,
    }
}

/// The KV rows' shape for `--kv-type` (f16 by default).
fn kv_shape(hp: &Hparams, t: KvType) -> KvShape {
    KvShape {
        dtype: kv::kv_dtype(t),
        n_head_kv: hp.n_head_kv as u32,
        head_dim: hp.head_dim as u32,
    }
}

/// One sequence: a slot of the pools and the tokens it has seen. Dropping it frees the slot.
pub struct LlamaSeq {
    slot: Slot,
    pos: usize,
}

impl SeqState for LlamaSeq {
    fn pos(&self) -> usize {
        self.pos
    }
}

impl RoundSeq for LlamaSeq {
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
    /// `None`: the head is the embedding (tied).
    output: Option<GpuTensor>,
    output_norm: GpuTensor,
    /// [n_vocab]: `runtime::head::suppress_mask`.
    suppress: Option<wgpu::Buffer>,
    layers: Vec<Layer>,
    rope: RopeTable,
    kv: KvShape,
    pools: Pools,
    scratch: Scratch,
    /// The expert arena and cold experts when the planner left some experts off the GPU.
    offload: Option<Offload>,
    /// [`Forward::hidden_out`]: the wanted rows' final-norm hidden states come back instead
    /// of their logits.
    hidden_out: bool,
    /// `LoadOptions::fused_loads`: decode products read the norms and SwiGLU through their
    /// activation loads and stores (`matvec::Prologue`, `Epilogue`).
    fused_loads: bool,
    /// Per-dispatch GPU times of the next pass when set ([`FamilyModel::profile_sink`]).
    profile: Option<Vec<(String, f64)>>,
    /// The trace hook: `attn_out` (the residual stream after a layer's attention) and
    /// `layer_out` (after its FFN), `[n_tokens, n_embd]` per pass.
    pub trace: Tracer,
}

impl GpuModel {
    pub fn load(gpu: Arc<Gpu>, file: &ModelFile, opts: &LoadOptions) -> Result<GpuModel> {
        let hp = Hparams::from_file(file)?;
        if opts.part.as_ref().is_some_and(|p| !(p.first && p.last)) {
            return Err(Error::Unsupported(
                "a Llama-family model split over several devices".into(),
            ));
        }
        let whole = PartSpec::whole(hp.n_layer);
        let needs = |r| needs_part(&hp, RunShape::new(opts, r), &whole);
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
        let count = |g: GpuTensor| -> GpuTensor {
            done.set(done.get() + g.bytes());
            if let Some(p) = &opts.progress {
                p(done.get().min(total), total);
            }
            g
        };
        let put = |w: Weight<'_>| -> Result<GpuTensor> {
            Ok(count(w.with_tensor(|t| gpu.upload_tensor(t))?))
        };
        let shaped = |w: W, shape: &[u64]| -> Result<_> {
            let t = file.require(&w.name(file))?;
            expect_shape(&t, shape)?;
            Ok(t)
        };
        let up = |w: W, shape: &[u64]| put(Weight::Stored(shaped(w, shape)?));
        let (e, v, ff) = (hp.n_embd as u64, hp.n_vocab as u64, hp.n_ff as u64);
        let (qw, kvw) = (
            (hp.n_head * hp.head_dim) as u64,
            (hp.n_head_kv * hp.head_dim) as u64,
        );
        let tok_embd = up(W::TokEmbd, &[v, e])?;
        let output = match hp.tied {
            true => None,
            false => Some(up(W::Output, &[v, e])?),
        };
        let output_norm = up(W::OutputNorm, &[e])?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        for l in 0..hp.n_layer {
            let bias = match file.tensor(&W::QBias(l).name(file)) {
                None => None,
                Some(_) => {
                    let b = |w: W, n: u64| -> Result<wgpu::Buffer> {
                        let t = shaped(w, &[n])?;
                        gpu.upload_f32(&crate::models::read_f32(&t)?, t.name)
                    };
                    Some([
                        b(W::QBias(l), qw)?,
                        b(W::KBias(l), kvw)?,
                        b(W::VBias(l), kvw)?,
                    ])
                }
            };
            let hd = hp.head_dim as u64;
            let qk_norm = match file.tensor(&W::QNorm(l).name(file)) {
                None => None,
                Some(_) => Some((up(W::QNorm(l), &[hd])?, up(W::KNorm(l), &[hd])?)),
            };
            let attn_norm = up(W::AttnNorm(l), &[e])?;
            let (q, k, vv, o) = (
                up(W::Q(l), &[qw, e])?,
                up(W::K(l), &[kvw, e])?,
                up(W::V(l), &[kvw, e])?,
                up(W::O(l), &[e, qw])?,
            );
            let ffn_norm = up(W::FfnNorm(l), &[e])?;
            let ffn = match &hp.moe {
                None => {
                    let (g, u) = (shaped(W::Gate(l), &[ff, e])?, shaped(W::Up(l), &[ff, e])?);
                    let gate_up = if g.dtype == u.dtype {
                        GateUp::Joined(count(
                            gpu.upload_concat(&[g, u], &format!("{}+up", g.name))?,
                        ))
                    } else {
                        GateUp::Apart {
                            gate: put(Weight::Stored(g))?,
                            up: put(Weight::Stored(u))?,
                        }
                    };
                    Ffn::Dense {
                        gate_up,
                        down: up(W::Down(l), &[e, ff])?,
                    }
                }
                Some(m) => {
                    let (ne, fe) = (m.n_expert as u64, m.n_ff_exp as u64);
                    let router = up(W::Router(l), &[ne, e])?;
                    // GGUF stacks, or HF's one matrix per expert stacked at upload.
                    let stack = |one: fn(usize, usize) -> W, all: W, sh: [u64; 3]| {
                        if matches!(file, ModelFile::Gguf(_)) {
                            return Ok(Weight::Stored(shaped(all, &sh)?));
                        }
                        let parts = (0..m.n_expert)
                            .map(|x| shaped(one(l, x), &sh[1..]))
                            .collect::<Result<Vec<_>>>()?;
                        Ok::<_, Error>(Weight::Stack {
                            parts,
                            shape: sh.to_vec(),
                        })
                    };
                    let ws = [
                        stack(W::GateExp, W::GateExps(l), [ne, fe, e])?,
                        stack(W::UpExp, W::UpExps(l), [ne, fe, e])?,
                        stack(W::DownExp, W::DownExps(l), [ne, e, fe])?,
                    ];
                    let [gate, upw, down] = ws.map(|w| match offloaded {
                        true => Ok(w.stand_in()),
                        false => put(w),
                    });
                    Ffn::Moe {
                        router,
                        gate: gate?,
                        up: upw?,
                        down: down?,
                    }
                }
            };
            layers.push(Layer {
                attn_norm,
                q,
                k,
                v: vv,
                bias,
                qk_norm,
                o,
                ffn_norm,
                ffn,
            });
        }
        let rope = RopeTable::new(&gpu, &inv_freq(file, &hp)?, "llama.rope")?;
        let kv = kv_shape(&hp, opts.kv_type);
        let shapes = std::iter::repeat_n(kv, hp.n_layer);
        let slots = opts.max_seqs.max(1);
        let pools = Pools::new(&gpu, shapes, slots, kv::first_cap(opts.ctx), "llama.kv")?;
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
            rope,
            kv,
            pools,
            scratch,
            offload,
            hidden_out: false,
            fused_loads: opts.fused_loads,
            profile: None,
            trace: Tracer::default(),
        })
    }

    /// Feed the items in the runtime's rounds of at most [`DEFAULT_BATCH`] rows shared by
    /// all of them ([`rounds::run_batch`]: prefill chunks first, the decode rows of every
    /// sequence together after them); per item the logits it wants.
    fn run_items(&mut self, items: &mut [(&mut LlamaSeq, &[u32], Want)]) -> Result<Vec<Logits>> {
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
        let pairs = self.pools.blocks.iter().map(|p| (p.cap, self.hp.window));
        self.scratch.tables.write(&gpu, parts, pairs)?;
        let n = toks.len() as u32;
        let width = toks.len() * self.hp.n_embd;
        self.trace
            .prepare(&gpu, self.scratch.rows as u64 * self.hp.n_embd as u64 * 4)?;
        let (hp, sc) = (&self.hp, &self.scratch);
        gpu.write(&sc.ids, 0, bytemuck::cast_slice(toks));
        embed::embed(
            &mut pass,
            &self.tok_embd,
            &sc.ids,
            0,
            n,
            Operand::new(&sc.x, 0),
        )?;
        let fused = self.fused(n);
        // Whether the last residual product also wrote x · (the next norm's weight) into `h`
        // (`Epilogue::Normed`), which the next products read through `RmsNormRaw`.
        let mut weighted = false;
        for (l, lw) in self.layers.iter().enumerate() {
            let dense = matches!(lw.ffn, Ffn::Dense { .. });
            let pre = self.normed(&mut pass, n, &lw.attn_norm, fused, weighted)?;
            let next = (fused && dense).then_some(&lw.ffn_norm);
            weighted = self.attention(&mut pass, l, lw, parts, pre, next)?;
            self.trace.point(&mut pass, "attn_out", l, &sc.x, width);
            match &lw.ffn {
                Ffn::Dense { gate_up, down } => {
                    let pre = self.normed(&mut pass, n, &lw.ffn_norm, fused, weighted)?;
                    let next = self
                        .layers
                        .get(l + 1)
                        .filter(|_| fused)
                        .map(|nl| &nl.attn_norm);
                    weighted = self.dense_ffn(&mut pass, gate_up, down, n, pre, next)?;
                }
                Ffn::Moe {
                    router,
                    gate,
                    up,
                    down,
                } => {
                    // The router and the experts read normed rows from `h`.
                    self.normed(&mut pass, n, &lw.ffn_norm, false, weighted)?;
                    let stacks = ExpertStacks { gate, up, down };
                    self.moe(&mut pass, l, router, stacks, n)?;
                    weighted = false;
                }
            }
            self.trace.point(&mut pass, "layer_out", l, &sc.x, width);
            pass.flush_every(crate::gpu::FLUSH_OPS)?;
        }
        if wants.is_empty() && top.rows.is_empty() {
            pass.submit_or_profile(prof)?;
            self.trace.collect(&gpu)?;
            return Ok((Vec::new(), Vec::new()));
        }
        norm::rms_norm(
            &mut pass,
            n,
            hp.n_embd as u32,
            Operand::new(&sc.x, 0),
            Some(Operand::new(&sc.h, 0)),
            Some(&self.output_norm),
            hp.eps,
        )?;
        let head = Head {
            w: self.output.as_ref().unwrap_or(&self.tok_embd),
            n_vocab: hp.n_vocab,
            h: &sc.h,
            n_embd: hp.n_embd,
            logits: &sc.logits,
            logit_rows: sc.logit_rows,
            top: &sc.top,
            hidden: self.hidden_out,
            softcap: None,
            suppress: self.suppress.as_ref(),
        };
        let out = head_logits(pass, &head, wants, top, prof)?;
        self.trace.collect(&gpu)?;
        Ok(out)
    }

    /// Layer `l`'s routed experts over the normed rows in `h`, added to the residual stream
    /// (`runtime::moe`: softmax top-k, SwiGLU experts).
    fn moe(
        &self,
        pass: &mut Pass<'_>,
        l: usize,
        router: &GpuTensor,
        stacks: ExpertStacks<'_>,
        n: u32,
    ) -> Result<()> {
        let sc = &self.scratch;
        let m = self.hp.moe.as_ref().expect("MoE layer in a MoE model");
        let layer = MoeLayer {
            layer: l,
            n_embd: self.hp.n_embd as u32,
            n_expert: m.n_expert as u32,
            k: m.n_used as u32,
            router_w: router,
            router: Router::Softmax {
                renorm: m.norm_topk,
            },
            expert_scale: None,
            glu: Glu::Swiglu(None),
            stacks,
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

    /// Whether products of `n` tokens take fused activation loads and stores
    /// (`LoadOptions::fused_loads`, where `matmul` runs them as matvec).
    fn fused(&self, n: u32) -> bool {
        self.fused_loads && matvec::prologue_fits(n)
    }

    /// RMSNorm with weight `w` of the residual stream as the input of the next products:
    /// fused into their activation load (returned) when `fused` (`weighted`: the residual
    /// product before wrote x · w into `h`), else written to `h` (`None`).
    fn normed<'w>(
        &'w self,
        pass: &mut Pass<'_>,
        n: u32,
        w: &'w GpuTensor,
        fused: bool,
        weighted: bool,
    ) -> Result<Option<Prologue<'w>>> {
        let sc = &self.scratch;
        let eps = self.hp.eps;
        if fused && weighted {
            return Ok(Some(Prologue::RmsNormRaw { raw: &sc.x, eps }));
        }
        if fused && w.dtype == DType::F32 && w.parts.len() == 1 {
            let w = &w.parts[0].buffer;
            return Ok(Some(Prologue::RmsNorm { w, eps, keep: None }));
        }
        let e = self.hp.n_embd as u32;
        let (x, h) = (Operand::new(&sc.x, 0), Operand::new(&sc.h, 0));
        norm::rms_norm(pass, n, e, x, Some(h), Some(w), eps)?;
        Ok(None)
    }

    /// The buffer products reading the layer's input through `pre` read: the residual stream
    /// (through a norm), or `h` (the normed rows, or x · w for `RmsNormRaw`).
    fn pre_x(&self, pre: Option<&Prologue<'_>>) -> &wgpu::Buffer {
        match pre {
            Some(Prologue::RmsNorm { .. }) => &self.scratch.x,
            _ => &self.scratch.h,
        }
    }

    /// `y = W a` over `n` rows read through `pre`.
    fn product(
        &self,
        pass: &mut Pass<'_>,
        w: &GpuTensor,
        pre: Option<&Prologue<'_>>,
        y: Operand<'_>,
        n: u32,
    ) -> Result<()> {
        let opts = MatvecOpts::default();
        let x = Operand::new(self.pre_x(pre), 0);
        match pre {
            Some(p) => matvec::matvec_pro(pass, w, x, y, n, &opts, p),
            None => matmul::matmul_opts(pass, w, x, y, n, &opts),
        }
    }

    /// `x += W a` over `n` rows of `a` (read through `pro`); with `next` (the next norm's weight) x · next also written into `h` where the
    /// fused store takes it (`Epilogue::Normed`): returns whether it did.
    fn residual(
        &self,
        pass: &mut Pass<'_>,
        w: &GpuTensor,
        a: Operand<'_>,
        n: u32,
        pro: Option<&Prologue<'_>>,
        next: Option<&GpuTensor>,
    ) -> Result<bool> {
        let sc = &self.scratch;
        let opts = MatvecOpts {
            accumulate: true,
            ..Default::default()
        };
        let e = self.hp.n_embd as u64;
        let fits = |nw: &&GpuTensor| {
            self.fused(n)
                && nw.dtype == DType::F32
                && nw.parts.len() == 1
                && nw.shape == [e]
                && w.parts.len() == 1
        };
        if let Some(nw) = next.filter(fits) {
            let epi = Epilogue::Normed {
                w: &nw.parts[0].buffer,
                out: &sc.h,
            };
            let y = Operand::new(&sc.x, 0);
            matvec::matvec_fused(pass, w, a, y, n, &opts, matvec::Fused { pro, epi })?;
            return Ok(true);
        }
        match pro {
            Some(p) => matvec::matvec_pro(pass, w, a, Operand::new(&sc.x, 0), n, &opts, p)?,
            None => matmul::matmul_opts(pass, w, a, Operand::new(&sc.x, 0), n, &opts)?,
        }
        Ok(false)
    }

    /// A dense FFN over the layer's input read through `pre`, added to the residual stream;
    /// returns whether the down product wrote x · `next` into `h` ([`Self::residual`]).
    fn dense_ffn(
        &self,
        pass: &mut Pass<'_>,
        gate_up: &GateUp,
        down: &GpuTensor,
        n: u32,
        pre: Option<Prologue<'_>>,
        next: Option<&GpuTensor>,
    ) -> Result<bool> {
        let sc = &self.scratch;
        let ff = self.hp.n_ff as u32;
        let pre = pre.as_ref();
        match gate_up {
            // Decode with f32 x: SwiGLU as the product's store, into `act`.
            GateUp::Joined(gu)
                if self.fused(n)
                    && !self.gpu.int8_decode()
                    && matvec::glu_fits(gu.n_rows(), gu.parts.len()) =>
            {
                let x = Operand::new(self.pre_x(pre), 0);
                let opts = MatvecOpts::default();
                let fused = matvec::Fused {
                    pro: pre,
                    epi: Epilogue::SwiGlu,
                };
                let act = Operand::new(&sc.act, 0);
                matvec::matvec_fused(pass, gu, x, act, n, &opts, fused)?;
                return self.residual(pass, down, act, n, None, next);
            }
            GateUp::Joined(gu) => self.product(pass, gu, pre, Operand::new(&sc.gu, 0), n)?,
            GateUp::Apart { gate, up } => {
                let (g, u) = (
                    Operand::strided(&sc.gu, 0, 2 * ff),
                    Operand::strided(&sc.gu, ff, 2 * ff),
                );
                self.product(pass, gate, pre, g, n)?;
                self.product(pass, up, pre, u, n)?;
            }
        }
        if self.fused(n) {
            // SwiGLU in the down product's activation load.
            let glu = Prologue::SwiGlu { up: ff };
            let gu = Operand::strided(&sc.gu, 0, 2 * ff);
            return self.residual(pass, down, gu, n, Some(&glu), next);
        }
        ew::swiglu(
            pass,
            n,
            ff,
            Operand::new(&sc.act, 0),
            Operand::strided(&sc.gu, 0, 2 * ff),
            Operand::strided(&sc.gu, ff, 2 * ff),
            None,
        )?;
        self.residual(pass, down, Operand::new(&sc.act, 0), n, None, next)
    }

    /// Layer `l`'s attention over its input read through `pre` (`None`: the normed rows in
    /// `h`), added to the residual stream; returns whether the output product wrote x · `next`
    /// into `h` ([`Self::residual`]).
    fn attention(
        &self,
        pass: &mut Pass<'_>,
        l: usize,
        lw: &Layer,
        parts: &[Part],
        pre: Option<Prologue<'_>>,
        next: Option<&GpuTensor>,
    ) -> Result<bool> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let n = parts.iter().map(|p| p.n as u32).sum::<u32>();
        let (nh, nkv, hd) = (hp.n_head as u32, hp.n_head_kv as u32, hp.head_dim as u32);
        let [q_off, k_off, v_off] = qkv_offs(hp, n);
        let pre = pre.as_ref();
        self.product(pass, &lw.q, pre, Operand::new(&sc.qkv, q_off), n)?;
        self.product(pass, &lw.k, pre, Operand::new(&sc.qkv, k_off), n)?;
        self.product(pass, &lw.v, pre, Operand::new(&sc.qkv, v_off), n)?;
        if let Some(b) = &lw.bias {
            for ((off, heads), bias) in [(q_off, nh), (k_off, nkv), (v_off, nkv)].iter().zip(b) {
                ew::add_inplace(
                    pass,
                    n,
                    heads * hd,
                    Operand::new(&sc.qkv, *off),
                    Operand::strided(bias, 0, 0),
                )?;
            }
        }
        let pool = &self.pools.blocks[l];
        let (kc, vc) = &pool.kv;
        let (cap, window) = (pool.cap, hp.window);
        let tables = &sc.tables;
        let one = match &lw.qk_norm {
            Some((qn, kn))
                if n == 1
                    && hp.rope_style == rope::RopeStyle::Neox
                    && qn.dtype == DType::F32
                    && kn.dtype == DType::F32
                    && hd <= 256 =>
            {
                Some((qn, kn))
            }
            _ => None,
        };
        if let Some((qn, kn)) = one {
            // One token: q/k norms, RoPE and the cache writes in one dispatch.
            rope::qk_norm_rope(
                pass,
                &rope::QkvDecode {
                    buf: &sc.qkv,
                    n_head: nh,
                    n_head_kv: nkv,
                    head_dim: hd,
                    q_off,
                    q_stride: hd,
                    k_off,
                    v_off,
                    q_norm: &qn.parts[0].buffer,
                    k_norm: &kn.parts[0].buffer,
                    eps: hp.eps,
                    positions: tables.buf(),
                    pos_off: 0,
                    rows: tables.buf(),
                    row_off: tables.kv_rows_off(cap, window)?,
                    k_cache: kc,
                    v_cache: vc,
                    f16: self.kv.dtype == attention::KvType::F16,
                },
                &self.rope,
            )?;
        } else {
            if let Some((qn, kn)) = &lw.qk_norm {
                for (off, heads, w) in [(q_off, nh, qn), (k_off, nkv, kn)] {
                    let x = Operand::new(&sc.qkv, off);
                    norm::rms_norm(pass, n * heads, hd, x, None, Some(w), hp.eps)?;
                }
            }
            let positions = tables.positions();
            for (off, heads) in [(q_off, nh), (k_off, nkv)] {
                rope::rope(
                    pass,
                    &RopeView::packed(&sc.qkv, off, n, heads, hd),
                    hp.rope_style,
                    0,
                    &self.rope,
                    positions,
                    false,
                )?;
            }
            let dst = tables.kv_rows(cap, window)?;
            attention::write_kv(pass, self.kv, &sc.qkv, k_off, nkv * hd, n, kc, dst)?;
            attention::write_kv(pass, self.kv, &sc.qkv, v_off, nkv * hd, n, vc, dst)?;
        }
        let qw = nh * hd;
        let ranges = tables.ranges(cap, window)?;
        rows::attend(parts, cap, window, ranges, |row, n_q, keys, max_keys| {
            let split = rows::split(&sc.attn_split, n_q, nh, hd, self.kv, max_keys, &keys);
            attention::attention(
                pass,
                &Attention {
                    n_q,
                    n_head: nh,
                    kv: self.kv,
                    scale: 1.0 / (hd as f32).sqrt(),
                    q: QView {
                        buf: &sc.qkv,
                        off: q_off + row * qw,
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
        self.residual(pass, &lw.o, Operand::new(&sc.att, 0), n, None, next)
    }

    fn new_llama_seq(&self) -> Result<LlamaSeq> {
        Ok(LlamaSeq {
            slot: self.pools.take_slot()?,
            pos: 0,
        })
    }

    /// Make `dst` hold `src`'s KV rows `[0, pos)`, slot to slot.
    fn copy_rows(&self, src: &LlamaSeq, dst: &mut LlamaSeq) -> Result<()> {
        self.pools
            .copy_rows(&self.gpu, &src.slot, &dst.slot, src.pos)?;
        dst.pos = src.pos;
        Ok(())
    }
}

/// Where q, k and v of a pass of `n` rows start in `qkv` (elements): q `[n, n_head·head_dim]`,
/// then k and v `[n, n_head_kv·head_dim]` each.
fn qkv_offs(hp: &Hparams, n: u32) -> [u32; 3] {
    let (q, kv) = (
        (hp.n_head * hp.head_dim) as u32,
        (hp.n_head_kv * hp.head_dim) as u32,
    );
    [0, n * q, n * (q + kv)]
}

/// RoPE inverse frequencies: `theta^(-2i/n_rot)`, divided by `rope_freqs` where the file has
/// it (llama.cpp's `freq_factors`), by a linear scaling factor, or scaled as Llama 3.1's
/// (transformers' `_compute_llama3_parameters`: long wavelengths divided by `factor`,
/// short ones kept, a smooth blend between).
fn inv_freq(file: &ModelFile, hp: &Hparams) -> Result<Vec<f32>> {
    let mut inv = crate::cpu::ops::rope_inv_freq(hp.rope_theta, hp.n_rot);
    if let Some(t) = file.tensor(&W::RopeFreqs.name(file)) {
        expect_shape(&t, &[inv.len() as u64])?;
        for (f, d) in inv.iter_mut().zip(crate::models::read_f32(&t)?) {
            *f /= d;
        }
    }
    match hp.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear(s) => inv.iter_mut().for_each(|f| *f /= s),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor: lo,
            high_freq_factor: hi,
            original_max_positions: old,
        } => {
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
    }
    Ok(inv)
}

impl FamilyModel for GpuModel {
    type Seq = LlamaSeq;
    fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
    fn n_vocab(&self) -> usize {
        self.hp.n_vocab
    }
    fn new_seq(&self) -> Result<LlamaSeq> {
        self.new_llama_seq()
    }
    fn reset(&self, seq: &mut LlamaSeq) -> Result<()> {
        seq.pos = 0;
        Ok(())
    }
    fn copy_seq(&self, src: &LlamaSeq, dst: &mut LlamaSeq) -> Result<()> {
        self.copy_rows(src, dst)
    }
    fn hidden_out(&mut self, on: bool) -> Result<()> {
        self.hidden_out = on;
        Ok(())
    }
    fn forward_batch(
        &mut self,
        items: &mut [(&mut LlamaSeq, &[u32], Want)],
    ) -> Result<Vec<Logits>> {
        self.run_items(items)
    }
    fn profile_sink(&mut self) -> Result<&mut Option<Vec<(String, f64)>>> {
        Ok(&mut self.profile)
    }
    fn max_context(&self) -> Option<usize> {
        Some(self.pools.max_positions(&self.gpu))
    }
    fn pass_rows(&self) -> usize {
        self.scratch.rows
    }
    /// One device holds the whole model ([`GpuModel::load`] refuses a part): no neighbours.
    fn set_link(&mut self, _link: Link) {}
}
