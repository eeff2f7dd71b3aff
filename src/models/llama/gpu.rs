//! The Llama-family forward on the GPU: one pass (one submission) per chunk of at most
//! [`DEFAULT_BATCH`] tokens of one sequence. Products run through `matmul` (matvec for a
//! few rows, the tiled kernels for more), attention over the sequence's KV rows (flash
//! tiles for a chunk, split-K for one token); only the wanted logits come back. Routed
//! experts run as `models::qwen35`'s do: stacked on the GPU, or through the expert arena and
//! the CPU (`moe::Offload`) when the planner leaves some experts cold.

use super::{Hparams, RopeScaling, W};
use crate::forward::{KvType, LoadOptions, Logits, Want};
use crate::gpu::attention::{self, Attention, Keys, KvShape, KvSource, OutView, QView};
use crate::gpu::elementwise as ew;
use crate::gpu::matmul;
use crate::gpu::matmul::MoeRoute;
use crate::gpu::matvec::MatvecOpts;
use crate::gpu::moe::{routed_ffn, ExpertStacks, FfnBufs, Picks};
use crate::gpu::norm;
use crate::gpu::operand::Operand;
use crate::gpu::rope::{self, Positions, RopeTable, RopeView};
use crate::gpu::topk::TopLogits;
use crate::gpu::{embed, fit_rows, topk, BufferLimits, Gpu, GpuTensor, Pass, PassBuffer};
use crate::model_file::PartSpec;
use crate::models::runtime::family::FamilyModel;
use crate::models::runtime::link::Link;
use crate::models::runtime::rounds::{self, RoundSeq};
use crate::models::runtime::state::{copy_regions, Region};
use crate::models::{expect_shape, ModelFile, SeqState, Weight};
use crate::moe::{Needs, Offload, Plan, RunShape};
use crate::{Error, Result};
use std::sync::{Arc, Mutex};

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
        gate: GpuTensor,
        up: GpuTensor,
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

/// Activation buffers for passes of `rows` tokens (f32 unless said).
struct Scratch {
    rows: usize,
    /// [rows] u32 token ids.
    ids: wgpu::Buffer,
    /// [rows, n_embd]: the residual stream and its normed copy.
    x: wgpu::Buffer,
    h: wgpu::Buffer,
    /// [rows, n_head·head_dim], [rows, n_head_kv·head_dim] ×2: q, k, v; `att` the attention
    /// output.
    q: wgpu::Buffer,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    att: wgpu::Buffer,
    /// [rows, n_ff]: gate, up, and SwiGLU of them.
    gate: wgpu::Buffer,
    up: wgpu::Buffer,
    act: wgpu::Buffer,
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
fn scratch_elems(hp: &Hparams, rows: usize) -> [(&'static str, usize); 18] {
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
        ("llama.q", rows * q),
        ("llama.k", rows * kv),
        ("llama.v", rows * kv),
        ("llama.att", rows * q),
        ("llama.gate", rows * ff),
        ("llama.up", rows * ff),
        ("llama.act", rows * ff),
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
            q: f(3)?,
            k: f(4)?,
            v: f(5)?,
            att: f(6)?,
            gate: f(7)?,
            up: f(8)?,
            act: f(9)?,
            attn_split: f(10)?,
            router: f(11)?,
            moe_ids: f(12)?,
            moe_w: f(13)?,
            f_gate: f(14)?,
            f_up: f(15)?,
            f_act: f(16)?,
            moe_out: f(17)?,
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
            top: topk::LogitsTop::new(gpu, 1, hp.n_vocab as u32)?,
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
    let kv = kv_shape(hp, run.kv).bytes(seqs * kv_cap(run.ctx as usize) as u64);
    for _ in part.layers.clone() {
        buffers.extend([
            PassBuffer::bound("llama.kv.k", kv),
            PassBuffer::bound("llama.kv.v", kv),
        ]);
    }
    Needs {
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
        dtype: match t {
            KvType::Auto | KvType::F16 => attention::KvType::F16,
            KvType::F32 => attention::KvType::F32,
        },
        n_head_kv: hp.n_head_kv as u32,
        head_dim: hp.head_dim as u32,
    }
}

/// KV rows per sequence the pools start with for a context of `ctx` (doubling from there).
fn kv_cap(ctx: usize) -> usize {
    ctx.clamp(16, 4096)
}

/// K and V rows of every layer for all sequence slots: slot `s` owns rows `s·cap ..`.
struct Pools {
    slots: usize,
    /// Rows per slot; grows by doubling (copied on the GPU).
    cap: usize,
    /// Per layer: (K, V) `[slots·cap, n_head_kv, head_dim]`.
    kv: Vec<(wgpu::Buffer, wgpu::Buffer)>,
    free: Arc<Mutex<Vec<u32>>>,
}

/// One sequence: a slot of the pools and the tokens it has seen. Dropping it frees the slot.
pub struct LlamaSeq {
    slot: u32,
    pos: usize,
    free: Arc<Mutex<Vec<u32>>>,
}

impl SeqState for LlamaSeq {
    fn pos(&self) -> usize {
        self.pos
    }
}

impl RoundSeq for LlamaSeq {
    fn slot(&self) -> u32 {
        self.slot
    }
    fn set_pos(&mut self, pos: usize) {
        self.pos = pos;
    }
}

impl Drop for LlamaSeq {
    fn drop(&mut self) {
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.slot);
    }
}

pub struct GpuModel {
    pub gpu: Arc<Gpu>,
    pub hp: Hparams,
    tok_embd: GpuTensor,
    /// `None`: the head is the embedding (tied).
    output: Option<GpuTensor>,
    output_norm: GpuTensor,
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
}

/// What one chunk's pass returns: its wanted logits rows.
enum ChunkWant {
    None,
    Last,
    All,
    Top { k: u32, lse: bool },
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
        let put = |w: Weight<'_>| -> Result<GpuTensor> {
            let g = w.with_tensor(|t| gpu.upload_tensor(t))?;
            done.set(done.get() + g.bytes());
            if let Some(p) = &opts.progress {
                p(done.get().min(total), total);
            }
            Ok(g)
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
                None => Ffn::Dense {
                    gate: up(W::Gate(l), &[ff, e])?,
                    up: up(W::Up(l), &[ff, e])?,
                    down: up(W::Down(l), &[e, ff])?,
                },
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
        let slots = opts.max_seqs.max(1);
        let cap = kv_cap(opts.ctx);
        let rows = (slots * cap) as u64;
        let pools = Pools {
            slots,
            cap,
            kv: (0..hp.n_layer)
                .map(|_| {
                    Ok((
                        gpu.buffer(kv.bytes(rows), "llama.kv.k")?,
                        gpu.buffer(kv.bytes(rows), "llama.kv.v")?,
                    ))
                })
                .collect::<Result<_>>()?,
            // Popped from the end: slot 0 first.
            free: Arc::new(Mutex::new((0..slots as u32).rev().collect())),
        };
        let scratch = Scratch::new(&gpu, &hp, pass_rows)?;
        let offload = match plan {
            Some(p) => Some(Offload::new(&gpu, file, p, opts, pass_rows)?),
            None => None,
        };
        Ok(GpuModel {
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
        })
    }

    /// Feed each item's tokens, one item after the other, in the runtime's rounds of at
    /// most [`DEFAULT_BATCH`] rows ([`rounds::run_batch`]; a pass holds one sequence);
    /// per item the logits it wants.
    fn run_items(&mut self, items: &mut [(&mut LlamaSeq, &[u32], Want)]) -> Result<Vec<Logits>> {
        let (v, rows) = (self.hp.n_vocab, self.scratch.rows);
        rounds::check_items(items, v)?;
        let mut out = Vec::with_capacity(items.len());
        for (seq, toks, want) in items.iter_mut() {
            let one = rounds::run_batch(&mut [(&mut **seq, *toks, *want)], v, rows, true, |r| {
                let cw = match (&r.wants[..], r.top.rows.is_empty()) {
                    (_, false) => ChunkWant::Top {
                        k: r.top.k,
                        lse: r.top.lse,
                    },
                    ([(0, n)], _) if *n == r.toks.len() => ChunkWant::All,
                    ([_], _) => ChunkWant::Last,
                    _ => ChunkWant::None,
                };
                let p = &r.parts[0];
                let (logits, top) = self.run_chunk(p.slot, p.pos0, &r.toks, cw)?;
                Ok((logits, top.into_iter().collect()))
            })?;
            out.extend(one);
        }
        Ok(out)
    }

    /// One pass over `toks` of the sequence in `slot` from position `pos0`.
    fn run_chunk(
        &mut self,
        slot: u32,
        pos0: usize,
        toks: &[u32],
        want: ChunkWant,
    ) -> Result<(Vec<f32>, Option<TopLogits>)> {
        let gpu = self.gpu.clone();
        let mut pass = gpu.pass();
        self.reserve(&mut pass, pos0 + toks.len())?;
        let hp = &self.hp;
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
        let e = hp.n_embd as u32;
        for (l, lw) in self.layers.iter().enumerate() {
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
            norm(&mut pass, &lw.attn_norm)?;
            self.attention(&mut pass, l, lw, slot, pos0 as u32, n)?;
            norm(&mut pass, &lw.ffn_norm)?;
            match &lw.ffn {
                Ffn::Dense { gate, up, down } => {
                    linear(&mut pass, gate, &sc.h, &sc.gate, n, false)?;
                    linear(&mut pass, up, &sc.h, &sc.up, n, false)?;
                    ew::swiglu(
                        &mut pass,
                        n,
                        hp.n_ff as u32,
                        Operand::new(&sc.act, 0),
                        Operand::new(&sc.gate, 0),
                        Operand::new(&sc.up, 0),
                        None,
                    )?;
                    linear(&mut pass, down, &sc.act, &sc.x, n, true)?;
                }
                Ffn::Moe {
                    router,
                    gate,
                    up,
                    down,
                } => {
                    let stacks = ExpertStacks { gate, up, down };
                    self.moe(&mut pass, l, router, &stacks, n)?;
                }
            }
            pass.flush_every(crate::gpu::FLUSH_OPS)?;
        }
        let (r0, rows) = match want {
            ChunkWant::None => {
                pass.submit()?;
                return Ok((Vec::new(), None));
            }
            ChunkWant::All => (0, n as usize),
            ChunkWant::Last | ChunkWant::Top { .. } => (n as usize - 1, 1),
        };
        // The final norm of the wanted rows only.
        norm::rms_norm(
            &mut pass,
            rows as u32,
            e,
            Operand::new(&sc.x, r0 as u32 * e),
            Some(Operand::new(&sc.h, 0)),
            Some(&self.output_norm),
            hp.eps,
        )?;
        if self.hidden_out {
            pass.submit()?;
            let h = crate::models::read_rows(&gpu, &sc.h, &[(0, rows)], hp.n_embd)?;
            return Ok((h, None));
        }
        let head = self.output.as_ref().unwrap_or(&self.tok_embd);
        let v = hp.n_vocab;
        if let ChunkWant::Top { k, lse } = want {
            crate::models::head_rows(
                &mut pass,
                head,
                &sc.h,
                (0, hp.n_embd),
                &sc.logits,
                (0, v),
                1,
            )?;
            sc.top
                .record(&mut pass, Operand::new(&sc.logits, 0), 1, 0, k, lse)?;
            pass.submit()?;
            let t = sc.top.read(&gpu, 1, k, lse)?.pop();
            return Ok((Vec::new(), t));
        }
        // The head in runs that fit the logits buffer, each read back.
        let mut logits = Vec::with_capacity(rows * v);
        let mut pending = Some(pass);
        for (r, take) in crate::models::head_runs(&[(0, rows)], sc.logit_rows) {
            let mut p = pending.take().unwrap_or_else(|| gpu.pass());
            crate::models::head_rows(
                &mut p,
                head,
                &sc.h,
                (r, hp.n_embd),
                &sc.logits,
                (0, v),
                take,
            )?;
            p.submit()?;
            logits.extend(gpu.read_f32(&sc.logits, 0, take * v)?);
        }
        Ok((logits, None))
    }

    /// Layer `l`'s routed experts over the normed rows in `h`, added to the residual stream:
    /// softmax top-k of f32 router logits (a near-tie must not flip on rounding), the
    /// experts' unweighted rows, then their weighted sum in slot order (`moe`'s summation
    /// contract, the same with and without offload).
    fn moe(
        &self,
        pass: &mut Pass<'_>,
        l: usize,
        router: &GpuTensor,
        stacks: &ExpertStacks<'_>,
        n: u32,
    ) -> Result<()> {
        let sc = &self.scratch;
        let m = self.hp.moe.as_ref().expect("MoE layer in a MoE model");
        let (e, k) = (self.hp.n_embd as u32, m.n_used as u32);
        let opts = MatvecOpts {
            exact: true,
            ..Default::default()
        };
        matmul::matmul_opts(
            pass,
            router,
            Operand::new(&sc.h, 0),
            Operand::new(&sc.router, 0),
            n,
            &opts,
        )?;
        topk::router_softmax_topk(
            pass,
            n,
            m.n_expert as u32,
            k,
            m.norm_topk,
            Operand::new(&sc.router, 0),
            Operand::new(&sc.moe_ids, 0),
            Operand::new(&sc.moe_w, 0),
        )?;
        let bufs = FfnBufs {
            gate: &sc.f_gate,
            up: &sc.f_up,
            act: &sc.f_act,
            out: &sc.moe_out,
        };
        let mut combine = |p: &mut Pass<'_>| -> Result<()> {
            ew::moe_combine(
                p,
                n,
                e,
                k,
                Operand::new(&sc.x, 0),
                Operand::new(&sc.moe_w, 0),
                Operand::new(&sc.moe_out, 0),
            )
        };
        match self.offload.as_ref().filter(|o| o.has_layer(l)) {
            Some(off) => {
                let cold = off.route(pass, l, &sc.moe_ids, &sc.h, n)?;
                off.hot_ffn(pass, l, &sc.h, n, &bufs, None)?;
                off.cold_ffn(pass, cold, &bufs, None, Some(&mut combine))
            }
            None => {
                let picks = Picks {
                    ids: &sc.moe_ids,
                    route: sc.route.as_ref().expect("route made for MoE models"),
                    n,
                    k,
                };
                routed_ffn(pass, stacks, &sc.h, &picks, &bufs, None)?;
                combine(pass)
            }
        }
    }

    /// Layer `l`'s attention over the normed rows in `h`, added to the residual stream.
    fn attention(
        &self,
        pass: &mut Pass<'_>,
        l: usize,
        lw: &Layer,
        slot: u32,
        pos0: u32,
        n: u32,
    ) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let (nh, nkv, hd) = (hp.n_head as u32, hp.n_head_kv as u32, hp.head_dim as u32);
        linear(pass, &lw.q, &sc.h, &sc.q, n, false)?;
        linear(pass, &lw.k, &sc.h, &sc.k, n, false)?;
        linear(pass, &lw.v, &sc.h, &sc.v, n, false)?;
        if let Some(b) = &lw.bias {
            for ((buf, heads), bias) in [(&sc.q, nh), (&sc.k, nkv), (&sc.v, nkv)].iter().zip(b) {
                ew::add_inplace(
                    pass,
                    n,
                    heads * hd,
                    Operand::new(buf, 0),
                    Operand::strided(bias, 0, 0),
                )?;
            }
        }
        if let Some((qn, kn)) = &lw.qk_norm {
            for (buf, heads, w) in [(&sc.q, nh, qn), (&sc.k, nkv, kn)] {
                norm::rms_norm(
                    pass,
                    n * heads,
                    hd,
                    Operand::new(buf, 0),
                    None,
                    Some(w),
                    hp.eps,
                )?;
            }
        }
        let positions = Positions::From(pos0);
        for (buf, heads) in [(&sc.q, nh), (&sc.k, nkv)] {
            rope::rope(
                pass,
                &RopeView::packed(buf, 0, n, heads, hd),
                hp.rope_style,
                0,
                &self.rope,
                positions,
                false,
            )?;
        }
        let (kc, vc) = &self.pools.kv[l];
        let row0 = slot * self.pools.cap as u32;
        let dst = attention::DstRows::Range { row0: row0 + pos0 };
        attention::write_kv(pass, self.kv, &sc.k, 0, nkv * hd, n, kc, dst)?;
        attention::write_kv(pass, self.kv, &sc.v, 0, nkv * hd, n, vc, dst)?;
        let n_kv = pos0 + n;
        // Split-K only when a few query rows face many keys (decode); halved to fit the
        // scratch, which is sized for one query row.
        let mut n_split = attention::pick_n_split(n, nh, self.kv, n_kv, false);
        while n_split > 1 && attention::scratch_elems(n, nh, hd, n_split) * 4 > sc.attn_split.size()
        {
            n_split /= 2;
        }
        attention::attention(
            pass,
            &Attention {
                n_q: n,
                n_head: nh,
                kv: self.kv,
                scale: 1.0 / (hd as f32).sqrt(),
                q: QView {
                    buf: &sc.q,
                    off: 0,
                    tok_stride: nh * hd,
                    head_stride: hd,
                },
                out: OutView {
                    buf: &sc.att,
                    off: 0,
                    tok_stride: nh * hd,
                },
                a: KvSource { k: kc, v: Some(vc) },
                b: None,
                keys: Keys::Causal {
                    row0,
                    pos0,
                    n_kv,
                    window: hp.window as u32,
                },
                sinks: None,
                split: (n_split > 1).then_some((&sc.attn_split, n_split)),
            },
        )?;
        linear(pass, &lw.o, &sc.att, &sc.x, n, true)
    }

    /// Grow every slot's KV rows to at least `need` (doubling; old rows copied on the GPU).
    fn reserve(&mut self, pass: &mut Pass<'_>, need: usize) -> Result<()> {
        if need <= self.pools.cap {
            return Ok(());
        }
        let p = &mut self.pools;
        p.cap = self
            .kv
            .grow_pools(pass, p.kv.iter_mut(), p.slots, p.cap, need, "llama.kv")?;
        Ok(())
    }

    /// Positions per sequence the pools can grow to ([`KvShape::max_positions`]).
    fn max_positions(&self) -> usize {
        self.kv.max_positions(&self.gpu, self.pools.slots)
    }

    fn new_llama_seq(&self) -> Result<LlamaSeq> {
        let slot = self
            .pools
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "all {} sequence slots are in use (raise LoadOptions::max_seqs / --parallel)",
                    self.pools.slots
                ))
            })?;
        Ok(LlamaSeq {
            slot,
            pos: 0,
            free: self.pools.free.clone(),
        })
    }

    /// Make `dst` hold `src`'s KV rows `[0, pos)`, slot to slot ([`copy_regions`]).
    fn copy_rows(&self, src: &LlamaSeq, dst: &mut LlamaSeq) -> Result<()> {
        let cap = self.pools.cap as u64;
        let len = self.kv.bytes(src.pos as u64);
        let (from, to) = (
            self.kv.bytes(src.slot as u64 * cap),
            self.kv.bytes(dst.slot as u64 * cap),
        );
        let regions: Vec<Region<'_>> = self
            .pools
            .kv
            .iter()
            .flat_map(|(k, v)| [(k, from, to, len), (v, from, to, len)])
            .collect();
        copy_regions(&self.gpu, &regions, "llama.seq.copy_stage")?;
        dst.pos = src.pos;
        Ok(())
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
        Err(Error::Unsupported(
            "per-dispatch profiles of a Llama-family model".into(),
        ))
    }
    fn max_context(&self) -> Option<usize> {
        Some(self.max_positions())
    }
    fn pass_rows(&self) -> usize {
        self.scratch.rows
    }
    /// One device holds the whole model ([`GpuModel::load`] refuses a part): no neighbours.
    fn set_link(&mut self, _link: Link) {}
}
