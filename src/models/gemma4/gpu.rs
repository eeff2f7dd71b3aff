//! The Gemma-4 forward on the GPU: one pass (one submission) per round of at most
//! [`DEFAULT_BATCH`] rows of the runtime's scheduler (prefill chunks and the decode rows of
//! every sequence of a batch), as the Llama family's. Each block's attention
//! has its own geometry ([`LayerGeom`]), so each has its own KV pool shape and its RoPE
//! table (sliding or global); only the wanted logits come back. KV-shared blocks have no
//! pool: they attend their KV block's rows, written earlier in the same pass. Per-layer
//! embeddings (E2B/E4B) are gathered and projected once per pass into `pl`, each block's
//! tail reading its slice. MoE blocks run their
//! routed experts as the Llama family's Qwen3-MoE does: stacked on the GPU, or through the
//! expert arena and the CPU (`moe::Offload`) when the planner leaves some experts cold.
//!
//! A dense block's decode step is 9 or 10 dispatches (gemma4-tiny on lavapipe: 121 a step
//! before, 53 after): the q, k (and v) products, the per-head norms, RoPE and KV writes in one
//! (`rope::qk_norm_rope_kv`), attention, the output product, the sandwich norms in one
//! (`norm::sandwich`: post-attention norm, residual add, pre-FFN norm), gate+up with the GeGLU
//! in its store (`matvec::Epilogue::GeGlu`), down, and the sandwich again (post-FFN norm, add,
//! `layer_scalar`, the next block's input norm); a MoE block's first sandwich also writes the
//! router's and the routed experts' input norms, its second takes both branches' post norms
//! (gemma4moe-tiny: 114 a step before, 57 after). Every fused kernel has the bits of the
//! kernels it replaces, so the logits are those of the unfused forward.

use super::{Hparams, LayerGeom, W};
use crate::forward::{KvType, LoadOptions, Logits, Want};
use crate::gpu::attention::{self, Attention, KvShape, KvSource, OutView, QView};
use crate::gpu::elementwise as ew;
use crate::gpu::matmul::{self, MoeRoute};
use crate::gpu::matvec::{self, Epilogue, MatvecOpts};
use crate::gpu::moe::{ExpertStacks, FfnBufs, Glu};
use crate::gpu::norm::{self, Branch, Sandwich};
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
use crate::models::{expect_shape, ModelFile, SeqState, Weight};
use crate::moe::{Needs, Offload, Plan, RunShape};
use crate::{DType, Error, Result};
use std::sync::Arc;

/// Tokens per pass (llama.cpp's micro-batch, as the other families').
pub const DEFAULT_BATCH: usize = 512;

/// One block's weights (`[out, in]` products as stored).
struct Layer {
    g: LayerGeom,
    attn_norm: GpuTensor,
    q: GpuTensor,
    /// `None` on KV-shared blocks: they attend [`Hparams::kv_layer`]'s cache.
    kv: Option<OwnKv>,
    q_norm: GpuTensor,
    o: GpuTensor,
    post_attn_norm: GpuTensor,
    ffn_norm: GpuTensor,
    gate_up: GateUp,
    down: GpuTensor,
    post_ffn_norm: GpuTensor,
    /// The block's output multiplier (`layer_scalar`), 1 when the file has none.
    out_scale: f32,
    /// MoE blocks: the routed branch beside the dense one.
    moe: Option<MoeBlock>,
    /// Per-layer embedding models: the block's tail (module doc of `gemma4`).
    ple: Option<PleLayer>,
}

/// A block's own K and V projections (`[n_head_kv·head_dim, n_embd]`) and K's norm
/// (`[head_dim]`).
struct OwnKv {
    k: GpuTensor,
    /// `None`: V is K's projection (`attention_k_eq_v`).
    v: Option<GpuTensor>,
    k_norm: GpuTensor,
}

/// A block's per-layer-embedding tail: `x += post_norm(proj · (gelu_tanh(gate · x) ⊙ p_l))`.
struct PleLayer {
    /// `[n_epl, n_embd]`, `[n_embd, n_epl]`, `[n_embd]`.
    gate: GpuTensor,
    proj: GpuTensor,
    post_norm: GpuTensor,
}

/// The per-layer inputs' weights: the token table `[n_vocab, n_layer·n_epl]` (in host
/// memory), the embedding's projection `[n_layer·n_epl, n_embd]` and its per-block norm
/// `[n_epl]`.
struct Ple {
    tok: HostTable,
    model_proj: GpuTensor,
    proj_norm: GpuTensor,
}

/// A token table read on the host: each pass's rows are copied from the file's pages to a
/// staging buffer that the embedding kernel reads as a table of those rows alone (ids
/// `0..n`), as llama.cpp keeps Gemma-3n/4's per-layer token table off the GPU
/// (`per_layer_token_embd`: `[262144, 42·256]` on E4B, ~2.9 GB at q8_0, more than the rest
/// of a Q4_K_M file). The kernel decodes each row as it would in the whole table.
struct HostTable {
    /// The model file mapped again (the loader's `ModelFile` is borrowed).
    file: ModelFile,
    name: String,
    n_rows: u64,
    row_bytes: usize,
    /// `staging`'s rows as a table `[rows, cols]` of the stored type.
    rows: GpuTensor,
    /// u32 `[rows]`: 0, 1, ...
    iota: wgpu::Buffer,
}

impl HostTable {
    /// `t`, a tensor of `file`, read for passes of up to `rows` tokens.
    fn new(
        gpu: &Gpu,
        file: &ModelFile,
        t: &crate::tensor::TensorRef<'_>,
        rows: usize,
    ) -> Result<HostTable> {
        let row_bytes = t.row_bytes();
        let staging = gpu.buffer((rows * row_bytes).next_multiple_of(4) as u64, t.name)?;
        let iota: Vec<u32> = (0..rows as u32).collect();
        Ok(HostTable {
            n_rows: t.n_rows(),
            rows: GpuTensor {
                name: t.name.to_string(),
                dtype: t.dtype,
                shape: vec![rows as u64, t.row_len()],
                parts: vec![crate::gpu::TensorPart {
                    buffer: staging,
                    row_start: 0,
                    n_rows: rows as u64,
                }],
            },
            iota: gpu.upload(bytemuck::cast_slice(&iota), "gemma4.ple.iota")?,
            file: ModelFile::open(file.path())?,
            name: t.name.to_string(),
            row_bytes,
        })
    }

    /// Copy the rows of `toks` to the staging buffer (written before the pass's next
    /// submission), then embed them into `y`.
    fn embed(&self, pass: &mut Pass<'_>, toks: &[u32], y: Operand<'_>) -> Result<()> {
        let t = self.file.require(&self.name)?;
        let mut bytes = Vec::with_capacity((toks.len() * self.row_bytes).next_multiple_of(4));
        for &id in toks {
            if id as u64 >= self.n_rows {
                return Err(Error::Invalid(format!(
                    "token id {id} outside {} ({} rows)",
                    self.name, self.n_rows
                )));
            }
            bytes.extend_from_slice(&t.data[id as usize * self.row_bytes..][..self.row_bytes]);
        }
        bytes.resize(bytes.len().next_multiple_of(4), 0);
        pass.gpu().write(&self.rows.parts[0].buffer, 0, &bytes);
        embed::embed(pass, &self.rows, &self.iota, 0, toks.len() as u32, y)
    }
}

/// A dense FFN's gate and up products.
enum GateUp {
    /// `[2·n_ff, n_embd]`, the gate's rows then the up's (`Gpu::upload_concat`): one product,
    /// at decode with the GeGLU in its store (`matvec::Epilogue::GeGlu`).
    Joined(GpuTensor),
    /// `[n_ff, n_embd]` each, where their types differ.
    Apart { gate: GpuTensor, up: GpuTensor },
}

/// A MoE block's routed experts (module doc).
struct MoeBlock {
    /// `[n_expert, n_embd]`.
    router: GpuTensor,
    /// `[n_embd]`: the router input's scale times `1/sqrt(n_embd)`, one vector folded at
    /// load, the weight of the router's RMSNorm.
    router_in: GpuTensor,
    /// `[n_expert]` F32: each expert's output scale.
    expert_scale: GpuTensor,
    /// `[n_embd]`: the norms of the routed input, the dense and the routed outputs.
    pre_norm_2: GpuTensor,
    post_norm_1: GpuTensor,
    post_norm_2: GpuTensor,
    /// Stacks `[n_expert, n_ff_exp, n_embd]` ×2 (the fused stack's halves) and
    /// `[n_expert, n_embd, n_ff_exp]` (stand-ins without buffers when offloaded).
    gate: GpuTensor,
    up: GpuTensor,
    down: GpuTensor,
}

/// Activation buffers for passes of `rows` tokens (f32 unless said).
struct Scratch {
    rows: usize,
    /// [rows] u32 token ids.
    ids: wgpu::Buffer,
    /// [rows, n_embd]: the residual stream, its normed copy, a branch's output.
    x: wgpu::Buffer,
    h: wgpu::Buffer,
    br: wgpu::Buffer,
    /// [rows, n_head·max head_dim] q and the attention output; [rows, max n_head_kv·head_dim]
    /// k and v.
    q: wgpu::Buffer,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    att: wgpu::Buffer,
    /// [rows, 2·max n_ff]: per row the gate's n_ff values then the up's; [rows, max n_ff]
    /// GeGLU of them.
    gu: wgpu::Buffer,
    act: wgpu::Buffer,
    /// Split-K partials of a decode step's attention.
    attn_split: wgpu::Buffer,
    /// Each row's position; per (pool capacity, window) pair of the blocks each row's KV
    /// cache row and each decode row's visible cache rows.
    tables: RowTables,
    /// MoE only (else one element each): [rows, n_embd] the router's and the routed experts'
    /// normed inputs; [rows, n_expert] router logits; [rows, n_used]
    /// ids (u32) and weights; [rows·n_used, n_ff_exp] the experts' gate, up and GeGLU;
    /// [rows·n_used, n_embd] their unweighted outputs; [rows, n_embd] their weighted sum,
    /// and zeros it starts from (never written: wgpu buffers start zeroed).
    router: wgpu::Buffer,
    moe_ids: wgpu::Buffer,
    moe_w: wgpu::Buffer,
    f_gate: wgpu::Buffer,
    f_up: wgpu::Buffer,
    f_act: wgpu::Buffer,
    moe_out: wgpu::Buffer,
    moe_sum: wgpu::Buffer,
    zeros: wgpu::Buffer,
    h_router: wgpu::Buffer,
    h_exp: wgpu::Buffer,
    route: Option<MoeRoute>,
    /// Per-layer embedding models only (else one element each): [rows, n_layer·n_epl] the
    /// blocks' inputs `p_l` (row-major per token, block `l` at columns `l·n_epl..`) and the
    /// embedding's projection; [rows, n_epl] a block's gate and gated product.
    pl: wgpu::Buffer,
    pl_proj: wgpu::Buffer,
    pl_gate: wgpu::Buffer,
    pl_act: wgpu::Buffer,
    /// [logit_rows, n_vocab]
    logits: wgpu::Buffer,
    logit_rows: usize,
    top: topk::LogitsTop,
}

fn max_of(hp: &Hparams, f: impl Fn(&LayerGeom) -> usize) -> usize {
    hp.layers.iter().map(f).max().unwrap_or(0)
}

/// f32 elements of each scratch buffer, by label: the one list [`Scratch::new`] allocates
/// and [`needs_part`] counts.
fn scratch_elems(hp: &Hparams, rows: usize) -> [(&'static str, usize); 27] {
    let q = hp.n_head * max_of(hp, |g| g.head_dim);
    let kv = max_of(hp, |g| g.n_head_kv * g.head_dim);
    let ff = max_of(hp, |g| g.n_ff);
    let (ne, k, fe, me) = hp.moe.as_ref().map_or((0, 0, 0, 0), |m| {
        (m.n_expert, m.n_used, m.n_ff_exp, hp.n_embd)
    });
    [
        ("gemma4.ids", rows),
        ("gemma4.x", rows * hp.n_embd),
        ("gemma4.h", rows * hp.n_embd),
        ("gemma4.br", rows * hp.n_embd),
        ("gemma4.q", rows * q),
        ("gemma4.k", rows * kv),
        ("gemma4.v", rows * kv),
        ("gemma4.att", rows * q),
        ("gemma4.gu", rows * 2 * ff),
        ("gemma4.act", rows * ff),
        ("gemma4.attn_split", split_elems(hp) as usize),
        ("gemma4.rows", RowTables::elems(rows, table_pairs(hp))),
        ("gemma4.router", rows * ne),
        ("gemma4.moe_ids", rows * k),
        ("gemma4.moe_w", rows * k),
        ("gemma4.f_gate", rows * k * fe),
        ("gemma4.f_up", rows * k * fe),
        ("gemma4.f_act", rows * k * fe),
        ("gemma4.moe_out", rows * k * me),
        ("gemma4.moe_sum", rows * me),
        ("gemma4.zeros", rows * me),
        ("gemma4.h_router", rows * me),
        ("gemma4.h_exp", rows * me),
        ("gemma4.pl", rows * hp.n_layer * hp.n_epl),
        ("gemma4.pl_proj", rows * hp.n_layer * hp.n_epl),
        ("gemma4.pl_gate", rows * hp.n_epl),
        ("gemma4.pl_act", rows * hp.n_epl),
    ]
}

/// The (KV geometry, window) pairs of the blocks: their pools' (capacity, window) pairs
/// are at most as many (blocks of one geometry grow alike).
fn table_pairs(hp: &Hparams) -> usize {
    let mut seen = Vec::new();
    for g in &hp.layers {
        let k = (g.n_head_kv, g.head_dim, window(hp, g));
        if !seen.contains(&k) {
            seen.push(k);
        }
    }
    seen.len()
}

/// The window of a block's attention: the model's on sliding blocks, none (0) on global ones.
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
    attention::scratch_elems(
        1,
        hp.n_head as u32,
        max_of(hp, |g| g.head_dim) as u32,
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
            br: f(3)?,
            q: f(4)?,
            k: f(5)?,
            v: f(6)?,
            att: f(7)?,
            gu: f(8)?,
            act: f(9)?,
            attn_split: f(10)?,
            tables: RowTables::new(gpu, rows, table_pairs(hp), e[11].0)?,
            router: f(12)?,
            moe_ids: f(13)?,
            moe_w: f(14)?,
            f_gate: f(15)?,
            f_up: f(16)?,
            f_act: f(17)?,
            moe_out: f(18)?,
            moe_sum: f(19)?,
            zeros: f(20)?,
            h_router: f(21)?,
            h_exp: f(22)?,
            pl: f(23)?,
            pl_proj: f(24)?,
            pl_gate: f(25)?,
            pl_act: f(26)?,
            route: match &hp.moe {
                Some(m) => Some(MoeRoute::new(
                    gpu,
                    m.n_expert as u32,
                    (rows * m.n_used) as u32,
                )?),
                None => None,
            },
            logits: gpu.buffer((logit_rows * hp.n_vocab * 4) as u64, "gemma4.logits")?,
            logit_rows,
            top: topk::LogitsTop::new(gpu, rows as u32, hp.n_vocab as u32)?,
        })
    }
}

/// What the layers of `part` need beside their weights for `run`: each block's K and V rows
/// per position at its own geometry, and the scratch of one pass.
pub fn needs_part(hp: &Hparams, run: RunShape, part: &PartSpec) -> Needs {
    let seqs = run.seqs.max(1);
    let kv_elem: u64 = if kv_type(run.kv) == KvType::F32 { 4 } else { 2 };
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
    buffers.push(PassBuffer::bound("gemma4.logits", hp.n_vocab as u64 * 4));
    let mut kv_per_token = 0;
    // KV-shared blocks hold no rows of their own.
    for l in part.layers.clone().filter(|&l| l < hp.n_kv_layers()) {
        let g = &hp.layers[l];
        let kv = kv_shape(g, run.kv).bytes(seqs * kv::first_cap(run.ctx as usize) as u64);
        buffers.extend([
            PassBuffer::bound("gemma4.kv.k", kv),
            PassBuffer::bound("gemma4.kv.v", kv),
        ]);
        kv_per_token += 2 * (g.n_head_kv * g.head_dim) as u64 * kv_elem * seqs;
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

/// `--kv-type auto` here: f32. Gemma's scores are unscaled dot products of RMS-normed q and
/// k heads (HF `Gemma4Attention`, `scaling = 1.0`), and f16-rounded rows move the fixtures'
/// logits by ~2e-3 RMS (gemma4e-tiny f32 file: 2.21e-3 with f16 rows, over llama.cpp's
/// 2.20e-3; 2.6e-6 with f32; gemma4-tiny's top-1 0.958 with f16, 1.0 with f32; 2026-12-07).
/// Sliding blocks keep window-sized rows, so the cost is the global blocks' rows.
fn kv_type(t: KvType) -> KvType {
    match t {
        KvType::Auto => KvType::F32,
        t => t,
    }
}

/// A block's KV rows' shape for `--kv-type` (f32 by default, [`kv_type`]).
fn kv_shape(g: &LayerGeom, t: KvType) -> KvShape {
    KvShape {
        dtype: kv::kv_dtype(kv_type(t)),
        n_head_kv: g.n_head_kv as u32,
        head_dim: g.head_dim as u32,
    }
}

/// One sequence: a slot of the pools and the tokens it has seen. Dropping it frees the slot.
pub struct GemmaSeq {
    slot: Slot,
    pos: usize,
}

impl SeqState for GemmaSeq {
    fn pos(&self) -> usize {
        self.pos
    }
}

impl RoundSeq for GemmaSeq {
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
    /// Per-layer embedding models only.
    ple: Option<Ple>,
    layers: Vec<Layer>,
    /// RoPE of sliding and of global blocks (`None` where the model has no such block).
    rope_swa: Option<RopeTable>,
    rope_global: Option<RopeTable>,
    pools: Pools,
    scratch: Scratch,
    /// The expert arena and cold experts when the planner left some experts off the GPU.
    offload: Option<Offload>,
    /// [`Forward::hidden_out`]: the wanted rows' final-norm hidden states come back instead
    /// of their logits.
    hidden_out: bool,
    /// Per-dispatch GPU times of the next pass when set ([`FamilyModel::profile_sink`]).
    profile: Option<Vec<(String, f64)>>,
    /// `LoadOptions::fused_loads`: decode products write the GeGLU in their store
    /// (`matvec::Epilogue::GeGlu`).
    fused_loads: bool,
}

impl GpuModel {
    pub fn load(gpu: Arc<Gpu>, file: &ModelFile, opts: &LoadOptions) -> Result<GpuModel> {
        let hp = Hparams::from_file(file)?;
        if opts.part.as_ref().is_some_and(|p| !(p.first && p.last)) {
            return Err(Error::Unsupported(
                "a Gemma-4 model split over several devices".into(),
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
        let (e, v, nh) = (hp.n_embd as u64, hp.n_vocab as u64, hp.n_head as u64);
        let tok_embd = up(W::TokEmbd, &[v, e])?;
        let output = match file.tensor(&W::Output.name(file)) {
            Some(_) => Some(up(W::Output, &[v, e])?),
            None => None,
        };
        let output_norm = up(W::OutputNorm, &[e])?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        for (l, g) in hp.layers.iter().enumerate() {
            let (hd, kvw, ff) = (
                g.head_dim as u64,
                (g.n_head_kv * g.head_dim) as u64,
                g.n_ff as u64,
            );
            // KV-shared blocks' K/V weights, where a file ships them, are not used (HF
            // lists them in `_keys_to_ignore_on_load_unexpected`).
            let kv = match l < hp.n_kv_layers() {
                true => Some(OwnKv {
                    k: up(W::K(l), &[kvw, e])?,
                    v: match file.tensor(&W::V(l).name(file)) {
                        Some(_) => Some(up(W::V(l), &[kvw, e])?),
                        None => None,
                    },
                    k_norm: up(W::KNorm(l), &[hd])?,
                }),
                false => None,
            };
            let epl = hp.n_epl as u64;
            let ple = match epl {
                0 => None,
                _ => Some(PleLayer {
                    gate: up(W::PerLayerGate(l), &[epl, e])?,
                    proj: up(W::PerLayerProj(l), &[e, epl])?,
                    post_norm: up(W::PerLayerPostNorm(l), &[e])?,
                }),
            };
            let (gt, ut) = (shaped(W::Gate(l), &[ff, e])?, shaped(W::Up(l), &[ff, e])?);
            let gate_up = if gt.dtype == ut.dtype {
                let name = format!("{}+up", gt.name);
                GateUp::Joined(count(gpu.upload_concat(&[gt, ut], &name)?))
            } else {
                GateUp::Apart {
                    gate: put(Weight::Stored(gt))?,
                    up: put(Weight::Stored(ut))?,
                }
            };
            let out_scale = match file.tensor(&W::OutScale(l).name(file)) {
                Some(t) => {
                    expect_shape(&t, &[1])?;
                    crate::models::read_f32(&t)?[0]
                }
                None => 1.0,
            };
            layers.push(Layer {
                g: *g,
                attn_norm: up(W::AttnNorm(l), &[e])?,
                q: up(W::Q(l), &[nh * hd, e])?,
                kv,
                q_norm: up(W::QNorm(l), &[hd])?,
                o: up(W::O(l), &[e, nh * hd])?,
                post_attn_norm: up(W::PostAttnNorm(l), &[e])?,
                ffn_norm: up(W::FfnNorm(l), &[e])?,
                gate_up,
                down: up(W::Down(l), &[e, ff])?,
                post_ffn_norm: up(W::PostFfnNorm(l), &[e])?,
                out_scale,
                moe: match (&hp.moe, g.moe) {
                    (Some(m), true) => {
                        Some(MoeBlock::load((&hp, file), m, l, &shaped, &put, offloaded)?)
                    }
                    _ => None,
                },
                ple,
            });
        }
        let ple = match hp.n_epl as u64 {
            0 => None,
            epl => {
                let cols = hp.n_layer as u64 * epl;
                let t = shaped(W::PerLayerTokEmbd, &[v, cols])?;
                // counted as loaded: the pages are read per pass
                done.set(done.get() + t.data.len() as u64);
                Some(Ple {
                    tok: HostTable::new(&gpu, file, &t, pass_rows)?,
                    model_proj: up(W::PerLayerModelProj, &[cols, e])?,
                    proj_norm: up(W::PerLayerProjNorm, &[epl])?,
                })
            }
        };
        let head_dim_of = |swa: bool| hp.layers.iter().find(|g| g.swa == swa).map(|g| g.head_dim);
        let rope_swa = match head_dim_of(true) {
            Some(d) => {
                let inv = crate::cpu::ops::rope_inv_freq(hp.rope_theta_swa, d);
                Some(RopeTable::new(&gpu, &inv, "gemma4.rope_swa")?)
            }
            None => None,
        };
        let rope_global = match head_dim_of(false) {
            Some(d) => {
                let inv = global_inv_freq(file, &hp, d)?;
                Some(RopeTable::new(&gpu, &inv, "gemma4.rope_global")?)
            }
            None => None,
        };
        // Pools for the blocks with KV of their own (the first ones); shared blocks read them.
        let shapes = hp.layers[..hp.n_kv_layers()]
            .iter()
            .map(|g| kv_shape(g, opts.kv_type));
        let slots = opts.max_seqs.max(1);
        let pools = Pools::new(&gpu, shapes, slots, kv::first_cap(opts.ctx), "gemma4.kv")?;
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
            ple,
            layers,
            rope_swa,
            rope_global,
            pools,
            scratch,
            offload,
            hidden_out: false,
            profile: None,
            fused_loads: opts.fused_loads,
        })
    }

    /// Feed the items in the runtime's rounds of at most [`DEFAULT_BATCH`] rows shared by
    /// all of them ([`rounds::run_batch`]: prefill chunks first, the decode rows of every
    /// sequence together after them); per item the logits it wants.
    fn run_items(&mut self, items: &mut [(&mut GemmaSeq, &[u32], Want)]) -> Result<Vec<Logits>> {
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
        let pairs = self.pools.blocks.iter().zip(&hp.layers);
        let pairs = pairs.map(|(p, g)| (p.cap, window(hp, g)));
        self.scratch.tables.write(&gpu, parts, pairs)?;
        let sc = &self.scratch;
        let n = toks.len() as u32;
        let e = hp.n_embd as u32;
        gpu.write(&sc.ids, 0, bytemuck::cast_slice(toks));
        embed::embed(
            &mut pass,
            &self.tok_embd,
            &sc.ids,
            0,
            n,
            Operand::new(&sc.x, 0),
        )?;
        // HF `Gemma4TextScaledWordEmbedding`: the rows times sqrt(n_embd); h = attn_norm(x).
        // Each block's input norm comes with the residual update before it (`Self::join`),
        // the last block's output norm too.
        let first = self
            .layers
            .first()
            .map_or(&self.output_norm, |l| &l.attn_norm);
        self.join(&mut pass, n, Branch::None, (e as f32).sqrt(), (first, &[]))?;
        if let Some(ple) = &self.ple {
            self.per_layer_inputs(&mut pass, ple, toks)?;
        }
        for (l, lw) in self.layers.iter().enumerate() {
            // x += post_attn_norm(attn(attn_norm(x))), h = ffn_norm(x)
            self.attention(&mut pass, l, lw, parts, n)?;
            let post = Branch::One {
                z: &sc.br,
                w: &lw.post_attn_norm,
            };
            // MoE blocks: the router's and the routed experts' inputs too (`Self::moe`)
            let moe_in = lw
                .moe
                .as_ref()
                .map(|mb| [(&sc.h_router, &mb.router_in), (&sc.h_exp, &mb.pre_norm_2)]);
            let more = moe_in.as_ref().map_or(&[][..], |m| &m[..]);
            self.join(&mut pass, n, post, 1.0, (&lw.ffn_norm, more))?;
            // x = (x + post_ffn_norm(down(gelu_tanh(gate h) ⊙ up h))) · out_scale, h = the
            // next norm of x
            self.geglu(&mut pass, lw, n)?;
            linear(&mut pass, &lw.down, &sc.act, &sc.br, n)?;
            let post = match &lw.moe {
                // the branch: post_ffn_norm(post_norm_1(dense) + post_norm_2(routed experts
                // of x))
                Some(mb) => {
                    self.moe(&mut pass, l, mb, n)?;
                    Branch::Two {
                        z: &sc.br,
                        w: &mb.post_norm_1,
                        z2: &sc.moe_sum,
                        w2: &mb.post_norm_2,
                        wb: &lw.post_ffn_norm,
                    }
                }
                None => Branch::One {
                    z: &sc.br,
                    w: &lw.post_ffn_norm,
                },
            };
            let next = self
                .layers
                .get(l + 1)
                .map_or(&self.output_norm, |nl| &nl.attn_norm);
            match &lw.ple {
                None => self.join(&mut pass, n, post, lw.out_scale, (next, &[]))?,
                // x += the FFN's branch, then the block's per-layer tail joins, scaled
                Some(pl) => {
                    self.join(&mut pass, n, post, 1.0, (next, &[]))?;
                    self.per_layer_tail(&mut pass, l, pl, n, lw.out_scale, next)?;
                }
            }
            pass.flush_every(crate::gpu::FLUSH_OPS)?;
        }
        if wants.is_empty() && top.rows.is_empty() {
            pass.submit_or_profile(prof)?;
            return Ok((Vec::new(), Vec::new()));
        }
        let head = Head {
            w: self.output.as_ref().unwrap_or(&self.tok_embd),
            n_vocab: hp.n_vocab,
            h: &sc.h,
            n_embd: hp.n_embd,
            logits: &sc.logits,
            logit_rows: sc.logit_rows,
            top: &sc.top,
            hidden: self.hidden_out,
            softcap: hp.softcap,
            suppress: self.suppress.as_ref(),
        };
        head_logits(pass, &head, wants, top, prof)
    }

    /// The blocks' per-layer inputs of the pass's `n` rows into `pl` (HF
    /// `get_per_layer_inputs` + `project_per_layer_inputs`), from the token ids and the
    /// scaled embeddings in `x`: `(sqrt(n_epl) · table[id] + proj_norm(model_proj · x /
    /// sqrt(n_embd))) / sqrt(2)`, the norm over each block's `n_epl` slice.
    fn per_layer_inputs(&self, pass: &mut Pass<'_>, ple: &Ple, toks: &[u32]) -> Result<()> {
        let (hp, sc) = (&self.hp, &self.scratch);
        let n = toks.len() as u32;
        let epl = hp.n_epl as u32;
        let cols = hp.n_layer as u32 * epl;
        let (pl, proj) = (Operand::new(&sc.pl, 0), Operand::new(&sc.pl_proj, 0));
        ple.tok.embed(pass, toks, pl)?;
        ew::scale_inplace(pass, n, cols, pl, (epl as f32).sqrt())?;
        linear(pass, &ple.model_proj, &sc.x, &sc.pl_proj, n)?;
        let root = 1.0 / (hp.n_embd as f32).sqrt();
        ew::scale_inplace(pass, n, cols, proj, root)?;
        let blocks = n * hp.n_layer as u32;
        norm::rms_norm(pass, blocks, epl, proj, None, Some(&ple.proj_norm), hp.eps)?;
        ew::add_inplace(pass, n, cols, pl, proj)?;
        ew::scale_inplace(pass, n, cols, pl, std::f32::consts::FRAC_1_SQRT_2)
    }

    /// Block `l`'s per-layer-embedding tail on the residual rows `x` (`br` is overwritten),
    /// joined as the FFN's branch is: `x = (x + post_norm(proj · (gelu_tanh(gate · x) ⊙ p_l)))
    /// · scale`, `p_l` block `l`'s slice of each row of `pl`, then `h = rms_norm(x) · next`.
    fn per_layer_tail(
        &self,
        pass: &mut Pass<'_>,
        l: usize,
        pl: &PleLayer,
        n: u32,
        scale: f32,
        next: &GpuTensor,
    ) -> Result<()> {
        let (hp, sc) = (&self.hp, &self.scratch);
        let epl = hp.n_epl as u32;
        linear(pass, &pl.gate, &sc.x, &sc.pl_gate, n)?;
        let p_l = Operand::strided(&sc.pl, l as u32 * epl, hp.n_layer as u32 * epl);
        ew::geglu(
            pass,
            n,
            epl,
            Operand::new(&sc.pl_act, 0),
            Operand::new(&sc.pl_gate, 0),
            p_l,
        )?;
        linear(pass, &pl.proj, &sc.pl_act, &sc.br, n)?;
        let branch = Branch::One {
            z: &sc.br,
            w: &pl.post_norm,
        };
        self.join(pass, n, branch, scale, (next, &[]))
    }

    /// The residual rows `x` joined by `branch` and scaled, `x = (x + branch) · scale`, then
    /// `h = rms_norm(x) · next` and each `(out, w)` of `more` `out = rms_norm(x) · w` (HF
    /// `Gemma4TextDecoderLayer`'s sandwich norms: the branch's post norm, the residual add,
    /// `layer_scalar`, the next pre-norms): one dispatch (`norm::sandwich`, the bits of the
    /// separate kernels) where the rows fit it, else those kernels (`br` and `moe_sum` then
    /// normed in place).
    fn join(
        &self,
        pass: &mut Pass<'_>,
        n: u32,
        branch: Branch<'_>,
        scale: f32,
        (next, more): (&GpuTensor, &[(&wgpu::Buffer, &GpuTensor)]),
    ) -> Result<()> {
        let (hp, sc) = (&self.hp, &self.scratch);
        let e = hp.n_embd as u32;
        let s = Sandwich {
            n_rows: n,
            dim: e,
            eps: hp.eps,
            x: &sc.x,
            branch,
            scale,
            y: &sc.h,
            wy: next,
            more,
        };
        if s.fits() {
            return norm::sandwich(pass, &s);
        }
        let (x, h) = (Operand::new(&sc.x, 0), Operand::new(&sc.h, 0));
        let rms = |pass: &mut Pass<'_>, z: &wgpu::Buffer, y, w| {
            norm::rms_norm(pass, n, e, Operand::new(z, 0), y, Some(w), hp.eps)
        };
        match branch {
            Branch::None => {}
            Branch::One { z, w } => {
                rms(pass, z, Some(h), w)?;
                ew::add_inplace(pass, n, e, x, h)?;
            }
            Branch::Two { z, w, z2, w2, wb } => {
                rms(pass, z, None, w)?;
                rms(pass, z2, None, w2)?;
                ew::add_inplace(pass, n, e, Operand::new(z, 0), Operand::new(z2, 0))?;
                rms(pass, z, Some(h), wb)?;
                ew::add_inplace(pass, n, e, x, h)?;
            }
        }
        if scale != 1.0 {
            ew::scale_inplace(pass, n, e, x, scale)?;
        }
        rms(pass, &sc.x, Some(h), next)?;
        for &(out, w) in more {
            rms(pass, &sc.x, Some(Operand::new(out, 0)), w)?;
        }
        Ok(())
    }

    /// GeGLU of the dense FFN's gate and up products of the normed rows in `h`, into `act`:
    /// at decode one product with the GeGLU in its store (`LoadOptions::fused_loads`, where
    /// `matmul` runs it as matvec: the bits of the product then `elementwise::geglu`).
    fn geglu(&self, pass: &mut Pass<'_>, lw: &Layer, n: u32) -> Result<()> {
        let sc = &self.scratch;
        let ff = lw.g.n_ff as u32;
        let (h, act) = (Operand::new(&sc.h, 0), Operand::new(&sc.act, 0));
        let (g, u) = (
            Operand::strided(&sc.gu, 0, 2 * ff),
            Operand::strided(&sc.gu, ff, 2 * ff),
        );
        let opts = MatvecOpts::default();
        match &lw.gate_up {
            GateUp::Joined(gu)
                if self.fused_loads
                    && matvec::prologue_fits(n)
                    && !self.gpu.int8_decode()
                    && matvec::glu_fits(gu.n_rows(), gu.parts.len()) =>
            {
                let fused = matvec::Fused::epi(Epilogue::GeGlu);
                return matvec::matvec_fused(pass, gu, h, act, n, &opts, fused);
            }
            GateUp::Joined(gu) => {
                matmul::matmul_opts(pass, gu, h, Operand::new(&sc.gu, 0), n, &opts)?
            }
            GateUp::Apart { gate, up } => {
                matmul::matmul_opts(pass, gate, h, g, n, &opts)?;
                matmul::matmul_opts(pass, up, h, u, n, &opts)?;
            }
        }
        ew::geglu(pass, n, ff, act, g, u)
    }

    /// Block `l`'s routed experts of the residual rows into `moe_sum` (`runtime::moe`): the
    /// router on `h_router` (x through its weightless RMSNorm times the folded scale, written
    /// by [`Self::join`]), softmax top-k renormalised and times each expert's output scale;
    /// the GeGLU experts on `h_exp` (`pre_norm_2(x)`, by `join` too), their weighted sum from
    /// zero.
    fn moe(&self, pass: &mut Pass<'_>, l: usize, mb: &MoeBlock, n: u32) -> Result<()> {
        let (hp, sc) = (&self.hp, &self.scratch);
        let m = hp.moe.as_ref().expect("MoE block in a MoE model");
        let e = hp.n_embd as u32;
        let layer = MoeLayer {
            layer: l,
            n_embd: e,
            n_expert: m.n_expert as u32,
            k: m.n_used as u32,
            router_w: &mb.router,
            router: Router::Softmax { renorm: true },
            expert_scale: Some(&mb.expert_scale),
            glu: Glu::GegluTanh,
            stacks: ExpertStacks {
                gate: &mb.gate,
                up: &mb.up,
                down: &mb.down,
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
        layer.route(pass, &msc, &sc.h_router, n)?;
        let sum_bytes = n as u64 * e as u64 * 4;
        pass.copy(&sc.zeros, 0, &sc.moe_sum, 0, sum_bytes);
        let off = self.offload.as_ref();
        layer.experts(pass, &msc, off, (&sc.h_exp, &sc.moe_sum), n)
    }

    /// Block `l`'s attention over the normed rows in `h`, its output projection in `br`.
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
        let pool = &self.pools.blocks[hp.kv_layer(l)];
        let (cap, window) = (pool.cap, window(hp, g));
        let tables = &sc.tables;
        let (nh, nkv, hd) = (hp.n_head as u32, g.n_head_kv as u32, g.head_dim as u32);
        linear(pass, &lw.q, &sc.h, &sc.q, n)?;
        let table = if g.swa {
            &self.rope_swa
        } else {
            &self.rope_global
        };
        let table = table
            .as_ref()
            .ok_or_else(|| Error::Invalid(format!("gemma4: block {l} has no RoPE table")))?;
        let rope_of = |pass: &mut Pass<'_>, buf: &wgpu::Buffer, heads: u32| {
            rope::rope(
                pass,
                &RopeView::packed(buf, 0, n, heads, hd),
                RopeStyle::Neox,
                0,
                table,
                tables.positions(),
                false,
            )
        };
        let (kc, vc) = &pool.kv;
        let f32_one = |w: &GpuTensor| w.dtype == DType::F32 && w.parts.len() == 1;
        match &lw.kv {
            // A KV-shared block reads the rows its KV block wrote earlier in this pass: only
            // q's per-head norm and RoPE.
            None => {
                let q = Operand::new(&sc.q, 0);
                norm::rms_norm(pass, n * nh, hd, q, None, Some(&lw.q_norm), hp.eps)?;
                rope_of(pass, &sc.q, nh)?;
            }
            Some(kv) => {
                linear(pass, &kv.k, &sc.h, &sc.k, n)?;
                if n == 1
                    && f32_one(&lw.q_norm)
                    && f32_one(&kv.k_norm)
                    && rope::qk_norm_rope_fits(hd, table)
                {
                    // One token: the per-head norms (v's without a weight), RoPE and the cache
                    // writes in one dispatch; V is the K projection before K's norm and RoPE
                    // where the block has no V (`attention_k_eq_v`).
                    let v = match &kv.v {
                        Some(v) => {
                            linear(pass, v, &sc.h, &sc.v, n)?;
                            &sc.v
                        }
                        None => &sc.k,
                    };
                    let qkv = rope::QkvDecode {
                        buf: &sc.q,
                        n_head: nh,
                        n_head_kv: nkv,
                        head_dim: hd,
                        q_off: 0,
                        q_stride: hd,
                        k_off: 0,
                        v_off: 0,
                        q_norm: &lw.q_norm.parts[0].buffer,
                        k_norm: &kv.k_norm.parts[0].buffer,
                        eps: hp.eps,
                        positions: tables.buf(),
                        pos_off: 0,
                        rows: tables.buf(),
                        row_off: tables.kv_rows_off(cap, window)?,
                        k_cache: kc,
                        v_cache: vc,
                        f16: pool.shape.dtype == attention::KvType::F16,
                    };
                    let heads = rope::KvHeads {
                        k: &sc.k,
                        v,
                        v_norm: true,
                    };
                    rope::qk_norm_rope_kv(pass, &qkv, &heads, table)?;
                } else {
                    match &kv.v {
                        Some(v) => linear(pass, v, &sc.h, &sc.v, n)?,
                        // V is the K projection before K's norm and RoPE.
                        None => ew::copy(
                            pass,
                            n,
                            nkv * hd,
                            Operand::new(&sc.v, 0),
                            Operand::new(&sc.k, 0),
                        )?,
                    }
                    // Per-head RMSNorms: q and k with weights, v without.
                    for (buf, heads, w) in [
                        (&sc.q, nh, Some(&lw.q_norm)),
                        (&sc.k, nkv, Some(&kv.k_norm)),
                        (&sc.v, nkv, None),
                    ] {
                        norm::rms_norm(pass, n * heads, hd, Operand::new(buf, 0), None, w, hp.eps)?;
                    }
                    rope_of(pass, &sc.q, nh)?;
                    rope_of(pass, &sc.k, nkv)?;
                    let dst = tables.kv_rows(cap, window)?;
                    attention::write_kv(pass, pool.shape, &sc.k, 0, nkv * hd, n, kc, dst)?;
                    attention::write_kv(pass, pool.shape, &sc.v, 0, nkv * hd, n, vc, dst)?;
                }
            }
        }
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
                    // Unscaled scores (HF `self.scaling = 1.0`): the q/k norms stand for it.
                    scale: 1.0,
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
        linear(pass, &lw.o, &sc.att, &sc.br, n)
    }

    fn new_gemma_seq(&self) -> Result<GemmaSeq> {
        Ok(GemmaSeq {
            slot: self.pools.take_slot()?,
            pos: 0,
        })
    }

    /// Make `dst` hold `src`'s KV rows `[0, pos)`, slot to slot.
    fn copy_rows(&self, src: &GemmaSeq, dst: &mut GemmaSeq) -> Result<()> {
        self.pools
            .copy_rows(&self.gpu, &src.slot, &dst.slot, src.pos)?;
        dst.pos = src.pos;
        Ok(())
    }
}

impl MoeBlock {
    /// Block `l`'s router, scales, branch norms and expert stacks; the stacks as stand-ins
    /// when `offloaded` (the arena holds them).
    fn load<'f>(
        (hp, file): (&Hparams, &ModelFile),
        m: &super::Moe,
        l: usize,
        shaped: &dyn Fn(W, &[u64]) -> Result<crate::tensor::TensorRef<'f>>,
        put: &dyn Fn(Weight<'_>) -> Result<GpuTensor>,
        offloaded: bool,
    ) -> Result<MoeBlock> {
        let (e, ne, fe) = (hp.n_embd as u64, m.n_expert as u64, m.n_ff_exp as u64);
        let vec = |w: W| put(Weight::Stored(shaped(w, &[e])?));
        // HF `Gemma4TextRouter`: `proj(rms_norm(x) · scale · hidden_size^-0.5)`; llama.cpp
        // scales by `1/sqrtf(n_embd)` then multiplies by `ffn_gate_inp.scale`.
        let rs = shaped(W::RouterScale(l), &[e])?;
        let root = 1.0 / (hp.n_embd as f32).sqrt();
        let router_in = put(Weight::F32 {
            name: rs.name.to_string(),
            shape: vec![e],
            data: crate::models::read_f32(&rs)?
                .iter()
                .map(|s| s * root)
                .collect(),
        })?;
        let es = shaped(W::ExpertScale(l), &[ne])?;
        let expert_scale = put(Weight::F32 {
            name: es.name.to_string(),
            shape: vec![ne],
            data: crate::models::read_f32(&es)?,
        })?;
        // The fused stack's gate and up halves as two stacks: per expert its first and last
        // `n_ff_exp` rows (`Weight::Rows` of the stack flattened to `[n_expert·2·n_ff_exp,
        // n_embd]`); or the file's separate stacks, where it has no fused one.
        let apart = file.tensor(&W::GateUpExps(l).name(file)).is_none()
            && file.tensor(&W::GateExps(l).name(file)).is_some();
        let [gate, upw] = if apart {
            [W::GateExps(l), W::UpExps(l)].map(|w| shaped(w, &[ne, fe, e]).map(Weight::Stored))
        } else {
            let gu = shaped(W::GateUpExps(l), &[ne, 2 * fe, e])?;
            let half = |first: u64| Weight::Rows {
                src: gu,
                rows: (0..ne)
                    .flat_map(|x| (0..fe).map(move |r| x * 2 * fe + first + r))
                    .collect(),
                shape: vec![ne, fe, e],
            };
            [Ok(half(0)), Ok(half(fe))]
        };
        let ws = [
            gate?,
            upw?,
            Weight::Stored(shaped(W::DownExps(l), &[ne, e, fe])?),
        ];
        let [gate, upw, down] = ws.map(|w| match offloaded {
            true => Ok(w.stand_in()),
            false => put(w),
        });
        Ok(MoeBlock {
            router: put(Weight::Stored(shaped(W::Router(l), &[ne, e])?))?,
            router_in,
            expert_scale,
            pre_norm_2: vec(W::PreFfnNorm2(l))?,
            post_norm_1: vec(W::PostFfnNorm1(l))?,
            post_norm_2: vec(W::PostFfnNorm2(l))?,
            gate: gate?,
            up: upw?,
            down: down?,
        })
    }
}

/// `y = W x` over `n` rows.
fn linear(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    n: u32,
) -> Result<()> {
    matmul::matmul_opts(
        pass,
        w,
        Operand::new(x, 0),
        Operand::new(y, 0),
        n,
        &MatvecOpts::default(),
    )
}

/// The global blocks' RoPE inverse frequencies over a head of `head_dim`:
/// `theta^(-2i/head_dim)`, divided by `rope_freqs` (GGUF: 1 for rotated pairs, 1e30 for the
/// rest) or zero past the rotated pairs (HF's "proportional" RoPE).
fn global_inv_freq(file: &ModelFile, hp: &Hparams, head_dim: usize) -> Result<Vec<f32>> {
    let mut inv = crate::cpu::ops::rope_inv_freq(hp.rope_theta, head_dim);
    match hp.rope_pairs_global {
        Some(pairs) => inv.iter_mut().skip(pairs).for_each(|f| *f = 0.0),
        None => {
            let t = file.require(&W::RopeFreqs.gguf_name())?;
            expect_shape(&t, &[inv.len() as u64])?;
            for (f, d) in inv.iter_mut().zip(crate::models::read_f32(&t)?) {
                *f /= d;
            }
        }
    }
    Ok(inv)
}

impl FamilyModel for GpuModel {
    type Seq = GemmaSeq;
    fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
    fn n_vocab(&self) -> usize {
        self.hp.n_vocab
    }
    fn new_seq(&self) -> Result<GemmaSeq> {
        self.new_gemma_seq()
    }
    fn reset(&self, seq: &mut GemmaSeq) -> Result<()> {
        seq.pos = 0;
        Ok(())
    }
    fn copy_seq(&self, src: &GemmaSeq, dst: &mut GemmaSeq) -> Result<()> {
        self.copy_rows(src, dst)
    }
    fn hidden_out(&mut self, on: bool) -> Result<()> {
        self.hidden_out = on;
        Ok(())
    }
    fn forward_batch(
        &mut self,
        items: &mut [(&mut GemmaSeq, &[u32], Want)],
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
