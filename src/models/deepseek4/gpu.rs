//! The DeepSeek-V4 forward on the GPU, the math of `cpu.rs` (DeepSeek's model.py in f32).
//! One pass (one submission) per chunk of tokens: a decode step is a chunk of one token;
//! prefill chunks use the tiled matmuls. Nothing is read back inside the layer loop; only the
//! requested logits come back.
//!
//! Per layer and chunk (n tokens at positions pos0..pos0+n):
//!   hc mixes (matmul) → `hc::pre` (RMS, Sinkhorn, fold, attn_norm) → attention → `hc::post`
//!   → hc mixes → `hc::pre` (ffn_norm) → MoE → `hc::post`.
//! Attention: q = rmsnorm_head(wq_b · q_norm(wq_a · h)) with RoPE; one K=V row
//! kv_norm(wkv · h) with RoPE into a window ring; compressors append their rows to a store
//! ring and pool every window the chunk completes into the compressed cache; the index list
//! (window slots + all visible compressed entries, or the indexer's top-k on ratio-4 layers)
//! drives one flash-attention call with sinks; inverse RoPE; grouped wo_a (an indexed matmul
//! over the groups) and wo_b.
//!
//! Which windows complete in a chunk, how many compressed entries each token sees and how
//! long the index lists are follow from positions alone: the host computes them, the GPU
//! never reports back.

use super::weights::{self, Attn, Compressor, Moe, Weights, W};
use super::{Hparams, ScoreFunc};
use crate::forward::{KvType, LoadOptions, Logits, Want};
use crate::gpu::attention::{self, Attention, DstRows, Keys, KvShape, KvSource, OutView, QView};
use crate::gpu::compress::{self, CmpShape, IndexList, IndexerShape};
use crate::gpu::elementwise as ew;
use crate::gpu::hc::{self, HcInput, HcShape, HcWeights};
use crate::gpu::matmul::{self, MoeRoute};
use crate::gpu::matvec::{self, MatvecOpts};
use crate::gpu::moe::{routed_ffn, ExpertStacks, FfnBufs, Picks};
use crate::gpu::norm;
use crate::gpu::operand::Operand;
use crate::gpu::rope::{self, Positions, RopeTable, RopeView};
use crate::gpu::router::{self, RouterRows, ScoreFn, Scoring, Select};
use crate::gpu::topk::TopLogits;
use crate::gpu::{embed, fit_rows, topk, BufferLimits, Gpu, GpuTensor, Pass, PassBuffer};
use crate::model_file::PartSpec;
use crate::models::runtime::family::FamilyModel;
use crate::models::runtime::head::{head_logits, Head};
use crate::models::runtime::link::{Link, Readback};
use crate::models::runtime::rounds::{self, RoundSeq};
use crate::models::runtime::state::copy_regions;
use crate::models::runtime::trace::Tracer;
use crate::models::{ModelFile, Seq, SeqState, Weight};
use crate::moe::{Needs, Offload, Plan, RunShape};
use crate::tensor::TensorRef;
use crate::{DType, Error, Result};
use std::collections::HashSet;
use std::sync::Arc;

mod forward;
mod mtp;

pub use mtp::MAX_VERIFY;

/// Tokens per prefill pass: activations are sized for this many rows. 512 as llama.cpp's
/// micro-batch: a pass's routed experts see twice the pairs per expert of 256 rows, so each
/// expert's weights are decoded once for twice the tokens (H200, DeepSeek-V4-Flash 8 layers,
/// pp512 tiled: 2418 tok/s against 1582 with 256-row passes; the three expert products 116
/// against 197 ms of the prompt's GPU time).
pub const DEFAULT_BATCH: usize = 512;

/// Activation buffers, sized once for `rows` tokens per pass (f32 unless said). The
/// indexer scores and the attention index lists grow with the context (`ensure`).
struct Scratch {
    rows: usize,
    /// [rows] u32 token ids.
    ids: wgpu::Buffer,
    /// [rows, hc, n_embd]: the hyper-connection copies (the residual stream).
    x: wgpu::Buffer,
    /// [rows, n_embd]: a block's input (folded, normed), and a block's output.
    h: wgpu::Buffer,
    blk: wgpu::Buffer,
    /// [rows, (2+hc)·hc] mixes of a site; [rows, hc + hc·hc] its (post, comb).
    mixes: wgpu::Buffer,
    pc: wgpu::Buffer,
    /// [rows, q_lora]: the normed low-rank query `qr`.
    qr: wgpu::Buffer,
    /// [rows, n_head·head_dim]: queries, and the attention output.
    q: wgpu::Buffer,
    att: wgpu::Buffer,
    /// [rows, head_dim]: the K=V row.
    kv: wgpu::Buffer,
    /// [rows, o_groups·o_lora]
    mid: wgpu::Buffer,
    /// [rows, 2·width]: a compressor's kv | score rows (width = coff·d, the widest layer).
    cmp: wgpu::Buffer,
    /// [rows, head_dim]: pooled entries (at most one window per row completes) before they
    /// enter the (f16) cache.
    ent: wgpu::Buffer,
    /// [rows, n_ix_head·ix_head_dim] indexer queries, [rows, n_ix_head] its head weights.
    ixq: wgpu::Buffer,
    ixw: wgpu::Buffer,
    /// [rows, entries] indexer scores; u32 per-row attention descriptors, then [rows, n_idx]
    /// attention key lists.
    scores: Grown,
    idx: Grown,
    /// u32 row tables of a pass (`forward::RowTabs`): positions, slots, ring rows, windows.
    tab: Grown,
    /// [rows, n_expert] router logits; [rows, n_used] ids (u32) and weights.
    router: wgpu::Buffer,
    moe_ids: wgpu::Buffer,
    moe_w: wgpu::Buffer,
    /// [rows·max(n_used, 1), ffn width]: gate / up / SwiGLU.
    f_gate: wgpu::Buffer,
    f_up: wgpu::Buffer,
    f_act: wgpu::Buffer,
    /// [rows·n_used, n_embd]: routed expert outputs.
    moe_out: wgpu::Buffer,
    route: MoeRoute,
    /// [rows·o_groups] u32 group ids 0..o_groups repeated (wo_a as an indexed stack), and
    /// their route for prefill.
    wo_ids: wgpu::Buffer,
    wo_route: MoeRoute,
    /// Split-K attention partials of the decode rows.
    attn_split: Grown,
    /// [logit_rows, n_vocab]
    logits: wgpu::Buffer,
    logit_rows: usize,
    /// Top-k (+ log-sum-exp) of the top rows of a pass, for [`Want::Top`].
    top: topk::LogitsTop,
}

/// A scratch buffer that grows (contents not kept) when a pass needs more elements.
struct Grown {
    buf: wgpu::Buffer,
    elems: usize,
    label: &'static str,
}

impl Grown {
    fn new(gpu: &Gpu, elems: usize, label: &'static str) -> Result<Grown> {
        Ok(Grown {
            buf: gpu.buffer((elems.max(1) * 4) as u64, label)?,
            elems: elems.max(1),
            label,
        })
    }
    /// A pass whose lists outgrow the binding limit (a context past the one the pass length
    /// was chosen for, `pass_buffers`) is an error naming the buffer, not a validation error.
    fn ensure(&mut self, gpu: &Gpu, elems: usize) -> Result<()> {
        if elems > self.elems {
            let most = (gpu.max_binding() / 4) as usize;
            if elems > most {
                return Err(Error::Unsupported(format!(
                    "buffer `{}` of {} bytes exceeds the adapter's binding limit of {} bytes: \
                     use a shorter context, or load for this one (--ctx) so passes are shorter",
                    self.label,
                    elems as u64 * 4,
                    most as u64 * 4
                )));
            }
            let n = elems.max(self.elems * 2).min(most);
            self.buf = gpu.buffer((n * 4) as u64, self.label)?;
            self.elems = n;
        }
        Ok(())
    }
}

/// One compressor of a layer for every sequence slot: store rings and caches of pooled
/// entries (slot s: store rows `s·cap ..`, entries `s·cap_e ..` with `Pools::cap_e`).
struct CmpState {
    shape: CmpShape,
    /// [slots·cap][2·width] f32 (see `gpu::compress`).
    store: wgpu::Buffer,
    /// Entries [slots·cap_e][d]: the KV type for the attention's compressor (it is source B
    /// of the attention), f32 for the indexer's.
    cache: wgpu::Buffer,
    /// Bytes of one cached entry.
    entry_bytes: u64,
}

/// Per-layer state of every sequence slot.
struct LayerState {
    /// [slots·ring, head_dim] K=V rows: slot s, position p in row s·ring + p % ring.
    ring: wgpu::Buffer,
    cmp: Option<CmpState>,
    ix: Option<CmpState>,
}

/// The state of all sequences, one pool per layer: window rings, compressor stores (the
/// partial windows, and the previous window for overlapping compressors) and compressed
/// caches, so that decode continues exactly where a prefill of any length stopped, and one
/// dispatch per kernel serves the rows of every sequence of a pass.
struct Pools {
    slots: usize,
    /// The model's part's layers, first held layer first.
    layers: Vec<LayerState>,
    /// The MTP block's window rings (models with one).
    mtp: Option<LayerState>,
    /// Compressed entries per slot of the caches of each ratio, `(ratio, cap_e)`; they grow
    /// by doubling (copied on the GPU).
    cap_e: Vec<(usize, usize)>,
    free: Arc<std::sync::Mutex<Vec<u32>>>,
}

impl Pools {
    fn cap_e(&self, ratio: usize) -> usize {
        self.cap_e.iter().find(|c| c.0 == ratio).map_or(0, |c| c.1)
    }
}

/// One sequence: a slot in the model's state pools and the number of tokens it has seen.
/// Dropping it returns the slot.
pub struct GpuSeq {
    pos: usize,
    slot: u32,
    /// Unique among the model's sequences: which one the speculation state belongs to.
    id: u64,
    free: Arc<std::sync::Mutex<Vec<u32>>>,
}

impl Drop for GpuSeq {
    fn drop(&mut self) {
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.slot);
    }
}

impl GpuSeq {
    /// Tokens consumed so far.
    pub fn pos(&self) -> usize {
        self.pos
    }
}

pub struct GpuModel {
    pub gpu: Arc<Gpu>,
    pub hp: Hparams,
    w: Weights<GpuTensor>,
    /// [n_vocab]: `runtime::head::suppress_mask`.
    suppress: Option<wgpu::Buffer>,
    /// Per layer RoPE table (`Hparams::rope_freqs`).
    rope: Vec<RopeTable>,
    kv_type: attention::KvType,
    ctx: usize,
    /// Rows of every window ring: window + chunk − 1 keeps a chunk's own rows from
    /// overwriting positions its first tokens still see.
    ring: usize,
    pools: Pools,
    scratch: Scratch,
    /// Debugging: capture a named intermediate of one layer in every pass (the CPU
    /// reference's `step_traced` names): `attn_in`, `attn_out`, `ffn_in`, `moe_out`
    /// ([n, n_embd]) and `layer_out` ([n, hc·n_embd]).
    pub trace: Tracer,
    /// [`Forward::hidden_out`]: the wanted rows' final-norm hidden states come back instead
    /// of their logits.
    hidden_out: bool,
    /// Profiling: while `Some`, passes submit with GPU timestamps around every dispatch and
    /// append `(label, ns)` here (slow; for per-kernel breakdowns).
    pub profile: Option<Vec<(String, f64)>>,
    /// The expert arena and cold path when not every routed expert has a slot (or routing
    /// is counted); `None`: the per-layer expert stacks of `w`.
    pub offload: Option<Offload>,
    /// The layers this device holds (all of them unless the model is split over several:
    /// `models::chain`), its neighbours, and where a part that is not the last reads its
    /// residual stream back.
    part: PartSpec,
    link: Link,
    handoff: Option<Readback>,
    /// The MTP block and what speculative decoding keeps between passes.
    spec: mtp::SpecState,
    /// The next sequence's id.
    next_id: std::sync::atomic::AtomicU64,
}

fn kv_shape(t: attention::KvType, d: usize) -> KvShape {
    KvShape {
        dtype: t,
        n_head_kv: 1,
        head_dim: d as u32,
    }
}

/// Upload one weight: matmul weights and tables in their stored type; vectors (norms,
/// biases, sinks, hc bases and scales) and the compressors' `ape` as f32, which is how the
/// small kernels read them.
fn upload(gpu: &Gpu, w: &Weight<'_>, as_f32: bool) -> Result<GpuTensor> {
    if as_f32 && w.dtype() != DType::F32 {
        let data = w.to_f32()?;
        let shape = w.shape().to_vec();
        return gpu.upload_tensor(&TensorRef {
            name: w.name(),
            dtype: DType::F32,
            shape: &shape,
            data: bytemuck::cast_slice(&data),
            path: std::path::Path::new("(converted at load)"),
        });
    }
    w.with_tensor(|t| gpu.upload_tensor(t))
}

/// View `[groups·rows, cols]` as a stack `[groups, rows, cols]` (wo_a's groups as the
/// "experts" of an indexed matmul); every buffer part must hold whole groups.
fn as_groups(t: &mut GpuTensor, groups: usize) -> Result<()> {
    let rows = t.shape[0] / groups as u64;
    if t.parts
        .iter()
        .any(|p| p.row_start % rows != 0 || p.n_rows % rows != 0)
    {
        return Err(Error::Unsupported(format!(
            "{}: split across buffers inside an output group",
            t.name
        )));
    }
    t.shape = vec![groups as u64, rows, t.shape[1]];
    Ok(())
}

impl GpuModel {
    pub fn load(gpu: Arc<Gpu>, file: &ModelFile, opts: &LoadOptions) -> Result<GpuModel> {
        let hp = Hparams::from_file(file)?;
        let name = |w: W| {
            if hp.gguf {
                w.gguf_name()
            } else {
                w.upstream_name()
            }
        };
        let tables: HashSet<String> = (0..hp.n_layer)
            .chain(hp.mtp.then(|| weights::mtp_block(0)))
            .flat_map(|l| [name(W::CmpApe(l)), name(W::IxCmpApe(l))])
            .collect();
        let total: u64 = file.tensors().map(|t| t.data.len() as u64).sum();
        let mut done = 0u64;
        let part = opts
            .part
            .clone()
            .unwrap_or_else(|| PartSpec::whole(hp.n_layer));
        // Placement first: experts without the stacks go to the arena after the rest.
        let needs = |rows| needs_part(&hp, RunShape::new(opts, rows), &part);
        let limits = BufferLimits::of(&gpu.limits);
        let batch = fit_rows(DEFAULT_BATCH, limits, &file.path(), |r| needs(r).buffers)?;
        let experts = crate::models::registry::family(file)?.experts;
        let plan = Plan::new(&gpu, file, experts, opts, &needs, batch)?;
        // Rows of one pass: longer where a prompt's cold experts stream (`Plan::rows`).
        let rows = plan.as_ref().map_or(batch, |p| p.rows);
        let embedding = name(W::TokEmbd);
        let mut w = weights::load_with(file, &hp, plan.is_some(), |w| {
            let held = part.holds(PartSpec::role(w.name(), hp.n_layer, &embedding, false));
            // The MTP block's experts stay in its stacks (the arena serves the trunk).
            let arena =
                plan.is_some() && experts.is_expert(w.name()) && !w.name().starts_with("mtp.");
            if !held || arena {
                return Ok(w.stand_in());
            }
            let f32_table = w.shape().len() == 1 || tables.contains(w.name());
            let t = upload(&gpu, &w, f32_table)?;
            done += t.bytes();
            if let Some(p) = &opts.progress {
                p(done.min(total), total);
            }
            Ok(t)
        })?;
        for lw in w
            .layers
            .iter_mut()
            .chain(w.mtp.as_mut().map(|m| &mut m.layer))
        {
            as_groups(&mut lw.attn.wo_a, hp.o_groups)?;
        }
        if hp.mtp && hp.compress_ratio[hp.n_layer] != 0 {
            return Err(Error::Unsupported(format!(
                "{}: an MTP block with a compressor (ratio {}); the releases' attends its window only",
                file.path().display(),
                hp.compress_ratio[hp.n_layer]
            )));
        }
        // The MTP block runs on the device that holds the head.
        let mtp_w = w.mtp.take().filter(|_| part.last);
        let rope = (0..hp.n_blocks())
            .map(|l| RopeTable::new(&gpu, &hp.rope_freqs(l), "deepseek4.rope"))
            .collect::<Result<Vec<_>>>()?;
        let kv_type = kv_type_of(opts.kv_type);
        let scratch = Scratch::new(&gpu, &hp, rows)?;
        let offload = match plan {
            Some(p) => Some(Offload::new(&gpu, file, p, opts, rows)?),
            None => None,
        };
        let handoff =
            (!part.last).then(|| Readback::new(&gpu, (rows * hp.hc * hp.n_embd * 4) as u64));
        let spec = mtp::SpecState {
            mtp: match mtp_w {
                Some(m) => Some(mtp::MtpGpu::new(&gpu, &hp, m, rows)?),
                None => None,
            },
            ..Default::default()
        };
        let mut model = GpuModel {
            pools: Pools {
                slots: opts.max_seqs.max(1),
                layers: Vec::new(),
                mtp: None,
                cap_e: Vec::new(),
                free: Arc::new(std::sync::Mutex::new(
                    (0..opts.max_seqs.max(1) as u32).rev().collect(),
                )),
            },
            spec,
            next_id: Default::default(),
            part,
            link: Link::default(),
            handoff,
            ring: ring_rows(&hp, rows),
            suppress: crate::models::runtime::head::suppress_mask(&gpu, file, hp.n_vocab)?,
            gpu,
            hp,
            w,
            rope,
            kv_type,
            ctx: opts.ctx.max(16),
            scratch,
            trace: Tracer::default(),
            hidden_out: false,
            profile: None,
            offload,
        };
        model.new_pools()?;
        Ok(model)
    }

    fn hc_shape(&self) -> HcShape {
        HcShape {
            n_embd: self.hp.n_embd as u32,
            hc: self.hp.hc as u32,
            iters: self.hp.hc_iters as u32,
            eps: self.hp.eps,
            hc_eps: self.hp.hc_eps,
        }
    }

    fn new_cmp(&self, ratio: usize, d: usize, overlap: bool, f32_cache: bool) -> Result<CmpState> {
        let slots = self.pools.slots as u64;
        let shape = cmp_shape(ratio, d, overlap, self.scratch.rows);
        let entry_bytes = if f32_cache {
            d as u64 * 4
        } else {
            kv_shape(self.kv_type, d).row_bytes()
        };
        let cap_e = self.pools.cap_e(ratio) as u64;
        Ok(CmpState {
            store: self
                .gpu
                .buffer(shape.store_bytes() * slots, "pool.cmp_store")?,
            cache: self
                .gpu
                .buffer(entry_bytes * cap_e * slots, "pool.cmp_cache")?,
            shape,
            entry_bytes,
        })
    }

    /// Every slot's state: window rings, compressor stores and caches sized for the context.
    fn new_pools(&mut self) -> Result<()> {
        let hp = &self.hp;
        let mut cap_e: Vec<(usize, usize)> = Vec::new();
        for l in self.part.layers.clone() {
            let r = hp.compress_ratio[l];
            if r > 0 && !cap_e.iter().any(|c| c.0 == r) {
                cap_e.push((r, cap_e_of(self.ctx, r)));
            }
        }
        self.pools.cap_e = cap_e;
        let ring = |m: &GpuModel, label| {
            let ks = kv_shape(m.kv_type, m.hp.head_dim);
            m.gpu
                .buffer(ks.bytes((m.ring * m.pools.slots) as u64), label)
        };
        let mut layers = Vec::with_capacity(self.part.layers.len());
        for l in self.part.layers.clone() {
            let hp = &self.hp;
            let ratio = hp.compress_ratio[l];
            layers.push(LayerState {
                ring: ring(self, "pool.ring")?,
                cmp: if ratio > 0 {
                    Some(self.new_cmp(ratio, hp.head_dim, hp.overlap(l), false)?)
                } else {
                    None
                },
                ix: if hp.has_indexer(l) {
                    Some(self.new_cmp(ratio, hp.ix_head_dim, hp.overlap(l), true)?)
                } else {
                    None
                },
            });
        }
        self.pools.layers = layers;
        self.pools.mtp = match &self.spec.mtp {
            Some(_) => Some(LayerState {
                ring: ring(self, "pool.mtp_ring")?,
                cmp: None,
                ix: None,
            }),
            None => None,
        };
        Ok(())
    }

    /// A new sequence in a free slot (at most `LoadOptions::max_seqs` live at once).
    pub fn new_seq(&self) -> Result<GpuSeq> {
        let p = &self.pools;
        let slot = p
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "all {} sequence slots are in use (raise LoadOptions::max_seqs / --parallel)",
                    p.slots
                ))
            })?;
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(GpuSeq {
            pos: 0,
            slot,
            id,
            free: p.free.clone(),
        })
    }

    /// Forget everything the sequence has seen. Nothing needs clearing: every read of a ring,
    /// store or cache is of a row written since (the index lists and window counts follow
    /// the position).
    pub fn reset(&self, seq: &mut GpuSeq) -> Result<()> {
        seq.pos = 0;
        Ok(())
    }

    /// Make `dst` a copy of `src` (a checkpoint, or its restore), on the GPU in one
    /// submission: every layer's window ring and compressor stores whole (their rows are
    /// addressed by position modulo their size), and the compressed entries `src` has pooled
    /// so far. Both slots live in the same pool buffers and WebGPU forbids a copy within one
    /// buffer, so each region goes through a staging buffer (wgpu orders the copies).
    pub fn copy_seq(&self, src: &GpuSeq, dst: &mut GpuSeq) -> Result<()> {
        let p = &self.pools;
        let (s, d) = (src.slot as u64, dst.slot as u64);
        let mut regions: Vec<(&wgpu::Buffer, u64, u64, u64)> = Vec::new();
        let ring_len = kv_shape(self.kv_type, self.hp.head_dim).bytes(self.ring as u64);
        for st in p.layers.iter().chain(&p.mtp) {
            regions.push((&st.ring, s * ring_len, d * ring_len, ring_len));
            for c in [&st.cmp, &st.ix].into_iter().flatten() {
                let store_len = c.shape.store_bytes();
                regions.push((&c.store, s * store_len, d * store_len, store_len));
                let ratio = c.shape.ratio as usize;
                let slot_len = c.entry_bytes * p.cap_e(ratio) as u64;
                let used = c.entry_bytes * (src.pos / ratio) as u64;
                if used > 0 {
                    regions.push((&c.cache, s * slot_len, d * slot_len, used));
                }
            }
        }
        if s != d {
            copy_regions(&self.gpu, &regions, "seq.copy_stage")?;
        }
        dst.pos = src.pos;
        Ok(())
    }

    /// Grow every slot's compressed caches to hold the entries of `need` positions
    /// (doubling; old entries copied on the GPU).
    fn reserve(&mut self, pass: &mut Pass<'_>, need: usize) -> Result<()> {
        let slots = self.pools.slots as u64;
        let max = self.gpu.max_binding();
        for i in 0..self.pools.cap_e.len() {
            let (ratio, cap) = self.pools.cap_e[i];
            let want = need / ratio;
            if want <= cap {
                continue;
            }
            let new_cap = want.max(2 * cap).next_power_of_two();
            for st in &mut self.pools.layers {
                for c in [st.cmp.as_mut(), st.ix.as_mut()].into_iter().flatten() {
                    if c.shape.ratio as usize != ratio {
                        continue;
                    }
                    let (old, new) = (c.entry_bytes * cap as u64, c.entry_bytes * new_cap as u64);
                    if new * slots > max {
                        return Err(Error::Invalid(format!(
                            "compressed caches of {need} positions x {slots} sequences exceed \
                             the adapter's binding limit ({max} bytes): use fewer sequences \
                             (`--parallel`) or a shorter context"
                        )));
                    }
                    let cache = self.gpu.buffer(new * slots, "pool.cmp_cache")?;
                    for slot in 0..slots {
                        pass.copy(&c.cache, slot * old, &cache, slot * new, old);
                    }
                    c.cache = cache;
                }
            }
            self.pools.cap_e[i].1 = new_cap;
        }
        Ok(())
    }

    /// Compressed key slots of layer `l`'s index list for a chunk ending at `pos_end`.
    fn comp_slots(&self, l: usize, pos_end: usize) -> usize {
        comp_slots(&self.hp, l, pos_end)
    }

    fn moe_block(&self, pass: &mut Pass<'_>, l: usize, m: &Moe<GpuTensor>, n: u32) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let e = hp.n_embd as u32;
        let (ne, k) = (hp.n_expert as u32, hp.n_used as u32);
        self.linear_exact(pass, &m.router, &sc.h, &sc.router, n)?;
        let select = match &m.tid2eid {
            Some(table) => Select::Hash {
                table,
                tokens: &sc.ids,
                tok_off: 0,
            },
            None => Select::TopK {
                bias: m.bias.as_ref(),
            },
        };
        let func = match hp.score_func {
            ScoreFunc::Softmax => ScoreFn::Softmax,
            ScoreFunc::Sigmoid => ScoreFn::Sigmoid,
            ScoreFunc::SqrtSoftplus => ScoreFn::SqrtSoftplus,
        };
        let rows = RouterRows {
            n_tok: n,
            n_exp: ne,
            k,
            logits: Operand::new(&sc.router, 0),
            ids: Operand::new(&sc.moe_ids, 0),
            weights: Operand::new(&sc.moe_w, 0),
        };
        let how = Scoring {
            func,
            select,
            renorm: hp.norm_topk,
            route_scale: hp.route_scale,
        };
        router::route(pass, &rows, &how)?;
        let limit = |v: f32| (v > 0.0).then_some(v);
        let bufs = FfnBufs {
            gate: &sc.f_gate,
            up: &sc.f_up,
            act: &sc.f_act,
            out: &sc.moe_out,
        };
        if let Some(off) = self.offload.as_ref().filter(|o| o.has_layer(l)) {
            // Experts in the arena (recipe in `moe/mod.rs`): hot pairs on the GPU, cold ones
            // on the CPU between passes; the shared expert and the slot-order combine as
            // below.
            let cold = off.route(pass, l, &sc.moe_ids, &sc.h, n)?;
            off.hot_ffn(pass, l, &sc.h, n, &bufs, limit(hp.swiglu_limit[l]))?;
            self.shared_expert(pass, l, m, n)?;
            off.cold_ffn(pass, cold, &bufs, limit(hp.swiglu_limit[l]), None)?;
            return router::combine(pass, n, e, k, &sc.blk, &sc.moe_w, &sc.moe_out);
        }
        let stacks = ExpertStacks {
            gate: &m.gate_exps,
            up: &m.up_exps,
            down: &m.down_exps,
        };
        let lim = limit(hp.swiglu_limit[l]);
        let picks = Picks {
            ids: &sc.moe_ids,
            route: &sc.route,
            n,
            k,
        };
        routed_ffn(pass, &stacks, &sc.h, &picks, &bufs, lim)?;
        // Shared expert first (it writes blk), then the routed slots in slot order.
        self.shared_expert(pass, l, m, n)?;
        router::combine(pass, n, e, k, &sc.blk, &sc.moe_w, &sc.moe_out)
    }

    /// The shared expert of layer `l` into `blk` (`[n, n_embd]`); uses the gate / up / act
    /// scratch, so it runs after the routed experts' SwiGLU.
    fn shared_expert(
        &self,
        pass: &mut Pass<'_>,
        l: usize,
        m: &Moe<GpuTensor>,
        n: u32,
    ) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let limit = |v: f32| (v > 0.0).then_some(v);
        let fs = hp.n_ff_shexp as u32;
        self.linear(pass, &m.sh_gate, &sc.h, &sc.f_gate, n)?;
        self.linear(pass, &m.sh_up, &sc.h, &sc.f_up, n)?;
        ew::swiglu(
            pass,
            n,
            fs,
            Operand::new(&sc.f_act, 0),
            Operand::new(&sc.f_gate, 0),
            Operand::new(&sc.f_up, 0),
            limit(hp.swiglu_limit_shexp[l]),
        )?;
        self.linear(pass, &m.sh_down, &sc.f_act, &sc.blk, n)
    }
}

/// Elements (4 bytes each: f32 values or u32 ids) of the plain scratch buffers for passes of
/// `rows` rows (`scores` and `idx` at their first size; they grow with the context): the one
/// list that [`Scratch::new`] allocates and [`Scratch::bytes`] counts.
struct Dims {
    ids: usize,
    x: usize,
    h: usize,
    blk: usize,
    mixes: usize,
    pc: usize,
    qr: usize,
    q: usize,
    att: usize,
    kv: usize,
    mid: usize,
    cmp: usize,
    ent: usize,
    ixq: usize,
    ixw: usize,
    scores: usize,
    idx: usize,
    router: usize,
    moe_ids: usize,
    moe_w: usize,
    f_gate: usize,
    f_up: usize,
    f_act: usize,
    moe_out: usize,
    wo_ids: usize,
    logits: usize,
}

impl Dims {
    /// `logit_rows`: rows of logits a pass holds (the binding limit may allow fewer than
    /// `rows`).
    fn new(hp: &Hparams, rows: usize, logit_rows: usize) -> Dims {
        let r = rows;
        let (k, og) = (hp.n_used, hp.o_groups);
        let ff = (hp.n_ff_exp * k).max(hp.n_ff_shexp);
        let att = hp.n_head * hp.head_dim;
        let mut width = 0;
        let mut compressed = false;
        for l in 0..hp.n_layer {
            let ratio = hp.compress_ratio[l];
            if ratio == 0 {
                continue;
            }
            let coff = if hp.overlap(l) { 2 } else { 1 };
            width = width.max(coff * hp.head_dim);
            if hp.has_indexer(l) {
                width = width.max(coff * hp.ix_head_dim);
            }
            compressed = true;
        }
        let ix = hp.n_ix_head * hp.ix_head_dim;
        Dims {
            ids: r,
            x: r * hp.hc * hp.n_embd,
            h: r * hp.n_embd,
            blk: r * hp.n_embd,
            mixes: r * hp.hc_mix(),
            pc: r * (hp.hc + hp.hc * hp.hc),
            qr: r * hp.q_lora,
            q: r * att,
            att: r * att,
            kv: r * hp.head_dim,
            mid: r * og * hp.o_lora,
            cmp: r * 2 * width,
            ent: if compressed { r * hp.head_dim } else { 0 },
            ixq: r * ix,
            ixw: r * hp.n_ix_head,
            scores: r * 64,
            idx: r * (hp.window + 64),
            router: r * hp.n_expert,
            moe_ids: r * k,
            moe_w: r * k,
            f_gate: r * ff,
            f_up: r * ff,
            f_act: r * ff,
            moe_out: r * k * hp.n_embd,
            wo_ids: r * og,
            logits: logit_rows * hp.n_vocab,
        }
    }

    /// Each with the label [`Scratch::new`] allocates it under.
    fn named(&self) -> [(&'static str, usize); 26] {
        let d = self;
        [
            ("ids", d.ids),
            ("x", d.x),
            ("h", d.h),
            ("blk", d.blk),
            ("mixes", d.mixes),
            ("pc", d.pc),
            ("qr", d.qr),
            ("q", d.q),
            ("att", d.att),
            ("kv", d.kv),
            ("mid", d.mid),
            ("cmp", d.cmp),
            ("ent", d.ent),
            ("ixq", d.ixq),
            ("ixw", d.ixw),
            ("ix_scores", d.scores),
            ("attn_idx", d.idx),
            ("router", d.router),
            ("moe_ids", d.moe_ids),
            ("moe_w", d.moe_w),
            ("f_gate", d.f_gate),
            ("f_up", d.f_up),
            ("f_act", d.f_act),
            ("moe_out", d.moe_out),
            ("wo_ids", d.wo_ids),
            ("logits", d.logits),
        ]
    }

    /// Bytes of all of them (each at least one element, as allocated).
    fn bytes(&self) -> u64 {
        self.named().iter().map(|&(_, n)| n.max(1) as u64 * 4).sum()
    }
}

/// Split-K attention partials of one decode row at the most splits: elements (the scratch
/// grows with the decode rows of a pass).
fn attn_split_elems(hp: &Hparams) -> u64 {
    attention::scratch_elems(
        1,
        hp.n_head as u32,
        hp.head_dim as u32,
        attention::MAX_SPLIT,
    )
}

impl Scratch {
    fn new(gpu: &Gpu, hp: &Hparams, rows: usize) -> Result<Scratch> {
        let f = |n: usize, label: &str| gpu.buffer((n.max(1) * 4) as u64, label);
        let r = rows;
        let (k, og) = (hp.n_used, hp.o_groups);
        let attn_split = Grown::new(gpu, attn_split_elems(hp) as usize, "attn.split")?;
        let logit_rows = ((gpu.max_binding() / 4) as usize / hp.n_vocab).clamp(1, r);
        let d = Dims::new(hp, r, logit_rows);
        let wo_ids: Vec<u32> = (0..d.wo_ids).map(|q| (q % og) as u32).collect();
        Ok(Scratch {
            rows: r,
            ids: f(d.ids, "ids")?,
            x: f(d.x, "x")?,
            h: f(d.h, "h")?,
            blk: f(d.blk, "blk")?,
            mixes: f(d.mixes, "mixes")?,
            pc: f(d.pc, "pc")?,
            qr: f(d.qr, "qr")?,
            q: f(d.q, "q")?,
            att: f(d.att, "att")?,
            kv: f(d.kv, "kv")?,
            mid: f(d.mid, "mid")?,
            cmp: f(d.cmp, "cmp")?,
            ent: f(d.ent, "ent")?,
            ixq: f(d.ixq, "ixq")?,
            ixw: f(d.ixw, "ixw")?,
            scores: Grown::new(gpu, d.scores, "ix_scores")?,
            idx: Grown::new(gpu, d.idx, "attn_idx")?,
            tab: Grown::new(gpu, 8 * r, "row_tab")?,
            router: f(d.router, "router")?,
            moe_ids: f(d.moe_ids, "moe_ids")?,
            moe_w: f(d.moe_w, "moe_w")?,
            f_gate: f(d.f_gate, "f_gate")?,
            f_up: f(d.f_up, "f_up")?,
            f_act: f(d.f_act, "f_act")?,
            moe_out: f(d.moe_out, "moe_out")?,
            route: MoeRoute::new(gpu, hp.n_expert as u32, (r * k) as u32)?,
            wo_ids: gpu.upload(bytemuck::cast_slice(&wo_ids), "wo_ids")?,
            wo_route: MoeRoute::new(gpu, og as u32, (r * og) as u32)?,
            attn_split,
            logits: f(d.logits, "logits")?,
            logit_rows,
            top: topk::LogitsTop::new(gpu, r as u32, hp.n_vocab as u32)?,
        })
    }

    /// Bytes [`Scratch::new`] allocates for `rows` rows, counting logits for every row (the
    /// binding limit may hold fewer): the activation part of [`needs`].
    fn bytes(hp: &Hparams, rows: usize) -> u64 {
        let (k, og) = (hp.n_used, hp.o_groups);
        Dims::new(hp, rows, rows).bytes()
            + attn_split_elems(hp) * 4
            + 8 * rows as u64 * 4
            + MoeRoute::bytes(hp.n_expert as u32, (rows * k) as u32)
            + MoeRoute::bytes(og as u32, (rows * og) as u32)
            + topk::LogitsTop::bytes(rows as u32, hp.n_vocab as u32)
    }
}

/// What a DeepSeek-V4 model needs beside its weights for `run` (the planner's budget input,
/// `lathe plan` and the loader alike): per sequence the compressed layers' KV entries, every
/// layer's ring of K=V rows, and [`Scratch::bytes`]. `KvType::Auto` is f32 here, as the
/// loader picks.
pub fn needs(hp: &Hparams, run: RunShape) -> Needs {
    needs_part(hp, run, &PartSpec::whole(hp.n_layer))
}

/// [`needs`] of the layers of one device's `part` (`models::chain`).
pub fn needs_part(hp: &Hparams, run: RunShape, part: &PartSpec) -> Needs {
    let seqs = run.seqs.max(1);
    let batch = run.batch.max(1);
    let kv_elem: u64 = if run.kv == KvType::F16 { 2 } else { 4 };
    let hd = hp.head_dim as u64;
    let mut kv_per_token = 0u64;
    let mut state = 0u64;
    for &r in &hp.compress_ratio[part.layers.clone()] {
        // Every layer keeps a ring of K=V rows (the window plus a pass's rows);
        // compressed layers add one entry per `r` positions (and the indexer's keys on
        // ratio-4 layers).
        state += (hp.window as u64 + batch) * hd * kv_elem;
        if r > 0 {
            let r = r as u64;
            kv_per_token += hd * kv_elem / r;
            if r == 4 {
                kv_per_token += hp.ix_head_dim as u64 * kv_elem / r;
            }
        }
    }
    let mut activations = Scratch::bytes(hp, batch as usize);
    if hp.mtp && part.last {
        // The MTP block's window ring, and its row buffers.
        state += (hp.window as u64 + batch) * hd * kv_elem;
        activations += mtp::MtpGpu::bytes(hp, batch as usize);
    }
    Needs {
        weights: 0,
        kv_per_token: kv_per_token * seqs,
        state: state * seqs,
        activations,
        buffers: pass_buffers(hp, run, part),
        kv_elem,
        note: None,
    }
}

/// Every buffer a run of `run` allocates whose size follows it (as [`Scratch::new`],
/// [`GpuModel::new_pools`], the MTP block and a chain's handoff make them): the scratch at
/// `run.batch` rows with one row of logits and the indexer scores and index lists of a pass
/// at `run.ctx`, every layer's window ring, compressor stores and compressed caches for
/// `run.seqs` sequences.
fn pass_buffers(hp: &Hparams, run: RunShape, part: &PartSpec) -> Vec<PassBuffer> {
    let (rows, slots, ctx) = (
        run.batch.max(1) as usize,
        run.seqs.max(1),
        (run.ctx as usize).max(16),
    );
    let (k, og) = (hp.n_used, hp.o_groups);
    let mut d = Dims::new(hp, rows, 1);
    // The lists grow with the context (`Grown`): at `ctx`, a pass's lists as its last row's,
    // after four descriptor words per row and layer kind.
    let held = part.layers.clone();
    d.scores = held
        .clone()
        .filter(|&l| hp.has_indexer(l))
        .map(|l| rows * (ctx / hp.compress_ratio[l]))
        .fold(d.scores, usize::max);
    let kinds: HashSet<(usize, bool)> = held
        .clone()
        .map(|l| (hp.compress_ratio[l], hp.has_indexer(l)))
        .collect();
    let kinds = kinds.len();
    d.idx = held
        .clone()
        .map(|l| 4 * rows * kinds + rows * (hp.window.min(ctx) + comp_slots(hp, l, ctx)))
        .fold(d.idx, usize::max);
    let mut v: Vec<PassBuffer> = d
        .named()
        .iter()
        .map(|&(l, n)| PassBuffer::bound(l, n as u64 * 4))
        .collect();
    v.extend([
        PassBuffer::bound(
            "moe_route",
            MoeRoute::bytes(hp.n_expert as u32, (rows * k) as u32),
        ),
        PassBuffer::bound("moe_route", MoeRoute::bytes(og as u32, (rows * og) as u32)),
        PassBuffer::bound("row_tab", 8 * rows as u64 * 4),
        PassBuffer::bound("attn.split", attn_split_elems(hp) * 4),
        PassBuffer::bound(
            "logits_top",
            topk::LogitsTop::bytes(rows as u32, hp.n_vocab as u32),
        ),
    ]);
    let kv = kv_type_of(run.kv);
    let ring = kv_shape(kv, hp.head_dim).bytes(ring_rows(hp, rows) as u64 * slots);
    for l in held {
        v.push(PassBuffer::bound("pool.ring", ring));
        let r = hp.compress_ratio[l];
        if r == 0 {
            continue;
        }
        let mut cmp = |dim: usize, entry_bytes: u64| {
            let shape = cmp_shape(r, dim, hp.overlap(l), rows);
            v.push(PassBuffer::bound(
                "pool.cmp_store",
                shape.store_bytes() * slots,
            ));
            v.push(PassBuffer::bound(
                "pool.cmp_cache",
                entry_bytes * cap_e_of(ctx, r) as u64 * slots,
            ));
        };
        cmp(hp.head_dim, kv_shape(kv, hp.head_dim).row_bytes());
        if hp.has_indexer(l) {
            cmp(hp.ix_head_dim, hp.ix_head_dim as u64 * 4);
        }
    }
    let (r, e, hc) = (rows as u64, hp.n_embd as u64, hp.hc as u64);
    if hp.mtp && part.last {
        v.push(PassBuffer::bound("pool.mtp_ring", ring));
        for l in ["mtp.trunk", "mtp.hid", "mtp.out", "mtp.hn"] {
            v.push(PassBuffer::bound(l, r * hc * e * 4));
        }
        for l in ["mtp.emb", "mtp.ep"] {
            v.push(PassBuffer::bound(l, r * e * 4));
        }
    }
    if !part.last {
        v.push(PassBuffer::copied("chain.readback", r * hc * e * 4));
    }
    v
}

/// Rows of every window ring for passes of `rows` rows: window + rows − 1 keeps a pass's
/// own rows from overwriting positions its first tokens still see.
fn ring_rows(hp: &Hparams, rows: usize) -> usize {
    hp.window + rows - 1
}

/// The compressor of ratio `ratio` over entries of `d` channels, its store ring sized for
/// passes of `rows` rows.
fn cmp_shape(ratio: usize, d: usize, overlap: bool, rows: usize) -> CmpShape {
    CmpShape {
        ratio: ratio as u32,
        d: d as u32,
        overlap,
        cap: CmpShape::store_rows(ratio as u32, overlap, rows as u32),
    }
}

/// Compressed entries per slot a cache of ratio `ratio` starts with for a context of `ctx`.
fn cap_e_of(ctx: usize, ratio: usize) -> usize {
    (ctx / ratio).max(16).next_power_of_two()
}

/// The attention's KV type for `--kv-type` (f32 by default: see `KvType`).
fn kv_type_of(t: KvType) -> attention::KvType {
    match t {
        KvType::F16 => attention::KvType::F16,
        KvType::Auto | KvType::F32 => attention::KvType::F32,
    }
}

/// Compressed key slots of layer `l`'s index list for a chunk ending at `pos_end`.
fn comp_slots(hp: &Hparams, l: usize, pos_end: usize) -> usize {
    match hp.compress_ratio[l] {
        0 => 0,
        r if hp.has_indexer(l) => hp.ix_topk.min(pos_end / r),
        r => pos_end / r,
    }
}

impl SeqState for GpuSeq {
    fn pos(&self) -> usize {
        self.pos
    }
}

impl RoundSeq for GpuSeq {
    fn slot(&self) -> u32 {
        self.slot
    }
    fn set_pos(&mut self, pos: usize) {
        self.pos = pos;
    }
}

impl FamilyModel for GpuModel {
    type Seq = GpuSeq;
    fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
    fn n_vocab(&self) -> usize {
        self.hp.n_vocab
    }
    fn new_seq(&self) -> Result<GpuSeq> {
        GpuModel::new_seq(self)
    }
    fn reset(&self, seq: &mut GpuSeq) -> Result<()> {
        GpuModel::reset(self, seq)
    }
    fn copy_seq(&self, src: &GpuSeq, dst: &mut GpuSeq) -> Result<()> {
        GpuModel::copy_seq(self, src, dst)
    }
    fn hidden_out(&mut self, on: bool) -> Result<()> {
        self.hidden_out = on;
        Ok(())
    }
    fn forward_batch(&mut self, items: &mut [(&mut GpuSeq, &[u32], Want)]) -> Result<Vec<Logits>> {
        GpuModel::forward_batch(self, items)
    }
    fn profile_sink(&mut self) -> Result<&mut Option<Vec<(String, f64)>>> {
        Ok(&mut self.profile)
    }
    fn offload(&self) -> Option<&Offload> {
        self.offload.as_ref()
    }
    fn routed_experts(&self) -> usize {
        self.hp.n_layer * self.hp.n_expert
    }
    fn speculate(&mut self) -> Option<&mut dyn crate::models::spec::Speculate> {
        Some(self)
    }
    /// Each compressed cache pool (every slot's entries) is one binding.
    fn max_context(&self) -> Option<usize> {
        let p = &self.pools;
        let max = self.gpu.max_binding();
        p.layers
            .iter()
            .flat_map(|st| [&st.cmp, &st.ix])
            .flatten()
            .map(|c| (max / (c.entry_bytes * p.slots as u64)) as usize * c.shape.ratio as usize)
            .min()
    }
    fn pass_rows(&self) -> usize {
        self.scratch.rows
    }
    fn set_link(&mut self, link: Link) {
        self.link = link;
    }
}
