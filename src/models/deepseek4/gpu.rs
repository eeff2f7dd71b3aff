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
use crate::forward::{KvType, LoadOptions, Logits, PartSpec, TopLogits, Want, GREEDY};
use crate::gpu::attention::{self, Attention, DstRows, Keys, KvShape, KvSource, OutView, QView};
use crate::gpu::compress::{self, CmpShape, IndexList, IndexerShape};
use crate::gpu::elementwise::{self as ew, View};
use crate::gpu::hc::{self, HcShape, HcWeights};
use crate::gpu::matmul::{self, MoeRoute};
use crate::gpu::matvec::{self, MatvecOpts};
use crate::gpu::moe::{routed_ffn, ExpertStacks, FfnBufs, Picks};
use crate::gpu::norm;
use crate::gpu::rope::{self, Positions, RopeTable, RopeView};
use crate::gpu::router::{self, ScoreFn, Select};
use crate::gpu::{embed, topk, Gpu, GpuTensor, Pass};
use crate::models::chain::{self, Link, Readback};
use crate::models::{Forward, ModelFile, Seq, SeqState, Weight};
use crate::moe::{Needs, Offload, Plan, RunShape};
use crate::tensor::TensorRef;
use crate::{DType, Error, Result};
use std::collections::HashSet;
use std::sync::Arc;

/// Tokens per prefill pass: activations are sized for this many rows.
pub const DEFAULT_BATCH: usize = 256;

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
    /// [windows per chunk, head_dim]: pooled entries before they enter the (f16) cache.
    ent: wgpu::Buffer,
    /// [rows, n_ix_head·ix_head_dim] indexer queries, [rows, n_ix_head] its head weights.
    ixq: wgpu::Buffer,
    ixw: wgpu::Buffer,
    /// [rows, entries] indexer scores; [rows, n_idx] u32 attention key lists.
    scores: Grown,
    idx: Grown,
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
    /// Split-K attention partials for decode.
    attn_split: wgpu::Buffer,
    /// [logit_rows, n_vocab]
    logits: wgpu::Buffer,
    logit_rows: usize,
    /// Top-k (+ log-sum-exp) of the last logits row, for [`Want::Top`].
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
    fn ensure(&mut self, gpu: &Gpu, elems: usize) -> Result<()> {
        if elems > self.elems {
            let n = elems.max(self.elems * 2);
            self.buf = gpu.buffer((n * 4) as u64, self.label)?;
            self.elems = n;
        }
        Ok(())
    }
}

/// One compressor's per-sequence state: its store ring and its cache of pooled entries.
struct CmpState {
    shape: CmpShape,
    /// [cap][2·width] f32 (see `gpu::compress`).
    store: wgpu::Buffer,
    /// Entries [cap_entries][d]: the KV type for the attention's compressor (it is source B
    /// of the attention), f32 for the indexer's.
    cache: wgpu::Buffer,
    cap_entries: usize,
    /// Bytes of one cached entry.
    entry_bytes: u64,
}

/// Per-layer state of a sequence.
struct LayerState {
    /// [ring, head_dim] K=V rows: position p in row p % ring.
    ring: wgpu::Buffer,
    cmp: Option<CmpState>,
    ix: Option<CmpState>,
}

/// The per-sequence state: window rings, compressor stores (the partial windows, and the
/// previous window for overlapping compressors) and compressed caches, so that decode
/// continues exactly where a prefill of any length stopped. Caches grow by doubling (a copy
/// on the GPU).
pub struct GpuSeq {
    pos: usize,
    /// The state of the model's part's layers, first held layer first.
    layers: Vec<LayerState>,
}

impl GpuSeq {
    /// Tokens consumed so far.
    pub fn pos(&self) -> usize {
        self.pos
    }
}

/// A named intermediate of one layer (the CPU reference's `step_traced` names): `attn_in`,
/// `attn_out`, `ffn_in`, `moe_out` ([n, n_embd]) and `layer_out` ([n, hc·n_embd]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trace {
    pub name: &'static str,
    pub layer: usize,
}

pub struct GpuModel {
    pub gpu: Arc<Gpu>,
    pub hp: Hparams,
    w: Weights<GpuTensor>,
    /// Per layer RoPE table (`Hparams::rope_freqs`).
    rope: Vec<RopeTable>,
    kv_type: attention::KvType,
    ctx: usize,
    /// Rows of every window ring: window + chunk − 1 keeps a chunk's own rows from
    /// overwriting positions its first tokens still see.
    ring: usize,
    scratch: Scratch,
    /// Debugging: capture this intermediate in every pass (a copy inside the pass, read back
    /// after it) and append it, `[n_tokens, width]`, to `traced`.
    pub trace: Option<Trace>,
    pub traced: Vec<f32>,
    trace_buf: Option<wgpu::Buffer>,
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
            .flat_map(|l| [name(W::CmpApe(l)), name(W::IxCmpApe(l))])
            .collect();
        let total: u64 = file.tensors().map(|t| t.data.len() as u64).sum();
        let mut done = 0u64;
        let part = opts
            .part
            .clone()
            .unwrap_or_else(|| PartSpec::whole(hp.n_layer));
        // Placement first: experts without the stacks go to the arena after the rest.
        let plan = Plan::new(
            &gpu,
            file,
            opts,
            &needs_part(&hp, RunShape::new(opts, DEFAULT_BATCH), &part),
        )?;
        let embedding = name(W::TokEmbd);
        let mut w = weights::load_with(file, &hp, plan.is_some(), |w| {
            let held = part.holds(PartSpec::role(w.name(), hp.n_layer, &embedding, false));
            if !held || (plan.is_some() && crate::moe::is_expert_tensor(w.name())) {
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
        for lw in &mut w.layers {
            as_groups(&mut lw.attn.wo_a, hp.o_groups)?;
        }
        let rope = (0..hp.n_layer)
            .map(|l| RopeTable::new(&gpu, &hp.rope_freqs(l), "deepseek4.rope"))
            .collect::<Result<Vec<_>>>()?;
        let kv_type = match opts.kv_type {
            KvType::F16 => attention::KvType::F16,
            // f32 by default: see `KvType`.
            KvType::Auto | KvType::F32 => attention::KvType::F32,
        };
        let scratch = Scratch::new(&gpu, &hp, DEFAULT_BATCH)?;
        let offload = match plan {
            Some(p) => Some(Offload::new(&gpu, file, p, opts, DEFAULT_BATCH)?),
            None => None,
        };
        let handoff = (!part.last)
            .then(|| Readback::new(&gpu, (DEFAULT_BATCH * hp.hc * hp.n_embd * 4) as u64));
        Ok(GpuModel {
            part,
            link: Link::default(),
            handoff,
            ring: hp.window + DEFAULT_BATCH - 1,
            gpu,
            hp,
            w,
            rope,
            kv_type,
            ctx: opts.ctx.max(16),
            scratch,
            trace: None,
            traced: Vec::new(),
            trace_buf: None,
            profile: None,
            offload,
        })
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
        let shape = CmpShape {
            ratio: ratio as u32,
            d: d as u32,
            overlap,
            cap: CmpShape::store_rows(ratio as u32, overlap, self.scratch.rows as u32),
        };
        let cap_entries = (self.ctx / ratio).max(16).next_power_of_two();
        let entry_bytes = if f32_cache {
            d as u64 * 4
        } else {
            kv_shape(self.kv_type, d).row_bytes()
        };
        Ok(CmpState {
            store: self.gpu.buffer(shape.store_bytes(), "seq.cmp_store")?,
            cache: self
                .gpu
                .buffer(entry_bytes * cap_entries as u64, "seq.cmp_cache")?,
            shape,
            cap_entries,
            entry_bytes,
        })
    }

    pub fn new_seq(&self) -> Result<GpuSeq> {
        let hp = &self.hp;
        let ks = kv_shape(self.kv_type, hp.head_dim);
        let mut layers = Vec::with_capacity(self.part.layers.len());
        for l in self.part.layers.clone() {
            let ratio = hp.compress_ratio[l];
            layers.push(LayerState {
                ring: self.gpu.buffer(ks.bytes(self.ring as u64), "seq.ring")?,
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
        Ok(GpuSeq { pos: 0, layers })
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
    /// addressed by position modulo their size, the same for every sequence of the model),
    /// and the compressed entries `src` has pooled so far; `dst`'s caches grow to hold them.
    pub fn copy_seq(&self, src: &GpuSeq, dst: &mut GpuSeq) -> Result<()> {
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        for (s, d) in src.layers.iter().zip(dst.layers.iter_mut()) {
            debug_assert_eq!(s.ring.size(), d.ring.size());
            enc.copy_buffer_to_buffer(&s.ring, 0, &d.ring, 0, s.ring.size());
            for (sc, dc) in [(&s.cmp, &mut d.cmp), (&s.ix, &mut d.ix)] {
                let (Some(sc), Some(dc)) = (sc, dc.as_mut()) else {
                    continue;
                };
                debug_assert_eq!(sc.store.size(), dc.store.size());
                enc.copy_buffer_to_buffer(&sc.store, 0, &dc.store, 0, sc.store.size());
                let entries = src.pos / sc.shape.ratio as usize;
                if entries > dc.cap_entries {
                    // `src` grew to hold them: its capacity is enough.
                    dc.cache = self
                        .gpu
                        .buffer(dc.entry_bytes * sc.cap_entries as u64, "seq.cmp_cache")?;
                    dc.cap_entries = sc.cap_entries;
                }
                if entries > 0 {
                    let used = sc.entry_bytes * entries as u64;
                    enc.copy_buffer_to_buffer(&sc.cache, 0, &dc.cache, 0, used);
                }
            }
        }
        self.gpu.queue.submit([enc.finish()]);
        self.gpu.check()?;
        dst.pos = src.pos;
        Ok(())
    }

    /// Grow the compressed caches to hold the entries of `need` positions (doubling; old
    /// entries copied on the GPU).
    fn reserve(&self, pass: &mut Pass<'_>, seq: &mut GpuSeq, need: usize) -> Result<()> {
        for st in &mut seq.layers {
            for c in [st.cmp.as_mut(), st.ix.as_mut()].into_iter().flatten() {
                let ratio = c.shape.ratio as usize;
                let want = need / ratio;
                if want <= c.cap_entries {
                    continue;
                }
                let cap = want.max(2 * c.cap_entries).next_power_of_two();
                let cache = self
                    .gpu
                    .buffer(c.entry_bytes * cap as u64, "seq.cmp_cache")?;
                let used = c.entry_bytes * (seq.pos / ratio) as u64;
                if used > 0 {
                    pass.copy(&c.cache, 0, &cache, 0, used);
                }
                c.cache = cache;
                c.cap_entries = cap;
            }
        }
        Ok(())
    }

    /// Compressed key slots of layer `l`'s index list for a chunk ending at `pos_end`.
    fn comp_slots(&self, l: usize, pos_end: usize) -> usize {
        let hp = &self.hp;
        match hp.compress_ratio[l] {
            0 => 0,
            r if hp.has_indexer(l) => hp.ix_topk.min(pos_end / r),
            r => pos_end / r,
        }
    }

    /// Feed `tokens`; returns logits for every token (`all`) or only the last one.
    pub fn forward(&mut self, seq: &mut GpuSeq, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        let want = if all { Want::All } else { Want::Last };
        Ok(self.forward_want(seq, tokens, want)?.into_full())
    }

    /// Feed `tokens`; returns what `want` asks for: every token's logits, the last one's,
    /// none, or the last one's best logits found on the GPU ([`Want::Top`]).
    pub fn forward_want(&mut self, seq: &mut GpuSeq, tokens: &[u32], want: Want) -> Result<Logits> {
        crate::forward::check_want(want)?;
        let all = want == Want::All;
        let top = match want {
            Want::Top { k, lse } => Some((k, lse)),
            _ => None,
        };
        let v = self.hp.n_vocab;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= v) {
            return Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary of {v}"
            )));
        }
        let mut out = Vec::with_capacity(if all { tokens.len() * v } else { v });
        let chunk = self.scratch.rows;
        let n_chunks = tokens.len().div_ceil(chunk);
        for (ci, c) in tokens.chunks(chunk).enumerate() {
            let last = ci + 1 == n_chunks;
            let n_want = if all {
                c.len()
            } else if last && want == Want::Last {
                1
            } else {
                0
            };
            let (logits, t) = self.forward_chunk(seq, c, n_want, top.filter(|_| last))?;
            out.extend(logits);
            if let Some(t) = t {
                return Ok(Logits::Top(t));
            }
        }
        Ok(Logits::Full(out))
    }

    /// One pass over `toks` (≤ scratch rows); logits of the last `want` tokens.
    /// With `top` = `Some((k, lse))` instead the best `k` logits of the last token (and the
    /// log-sum-exp of its row), found in the same pass.
    fn forward_chunk(
        &mut self,
        seq: &mut GpuSeq,
        toks: &[u32],
        want: usize,
        top: Option<(u32, bool)>,
    ) -> Result<(Vec<f32>, Option<TopLogits>)> {
        let gpu = self.gpu.clone();
        let n = toks.len();
        let pos0 = seq.pos;
        let pos_end = pos0 + n;
        // Sizes that grow with the context, known from positions alone.
        let hp = &self.hp;
        let n_win = hp.window.min(pos_end);
        let max_idx = (0..hp.n_layer)
            .map(|l| n_win + self.comp_slots(l, pos_end))
            .max()
            .unwrap_or(n_win);
        let max_ent = (0..hp.n_layer)
            .filter(|&l| hp.has_indexer(l))
            .map(|l| pos_end / hp.compress_ratio[l])
            .max()
            .unwrap_or(0);
        self.scratch.idx.ensure(&gpu, n * max_idx)?;
        self.scratch.scores.ensure(&gpu, n * max_ent)?;
        gpu.write(&self.scratch.ids, 0, bytemuck::cast_slice(toks));
        if self.trace.is_some() && self.trace_buf.is_none() {
            let bytes = (self.scratch.rows * hp.hc * hp.n_embd * 4) as u64;
            self.trace_buf = Some(gpu.buffer(bytes, "trace")?);
        }
        let mut trace_len = 0;

        let mut pass = gpu.pass();
        if self.profile.is_some() || self.trace.is_some() {
            pass.hold();
        }
        self.reserve(&mut pass, seq, pos_end)?;
        let hp = &self.hp;
        let sc = &self.scratch;
        let hs = self.hc_shape();
        let (e, nt) = (hp.n_embd as u32, n as u32);
        macro_rules! trace_point {
            ($name:expr, $l:expr, $buf:expr, $width:expr) => {
                if let (Some(tb), true) = (
                    &self.trace_buf,
                    self.trace
                        == Some(Trace {
                            name: $name,
                            layer: $l,
                        }),
                ) {
                    trace_len = n * $width;
                    pass.copy($buf, 0, tb, 0, trace_len as u64 * 4);
                }
            };
        }
        if self.part.first {
            for j in 0..hs.hc {
                embed::embed(
                    &mut pass,
                    &self.w.tok_embd,
                    &sc.ids,
                    0,
                    nt,
                    View::strided(&sc.x, j * e, hs.hc * e),
                )?;
            }
        } else {
            let h = self.link.recv(n, hp.hc * hp.n_embd)?;
            let t0 = std::time::Instant::now();
            gpu.write(&sc.x, 0, bytemuck::cast_slice(&h.data));
            self.link.note_write(t0.elapsed().as_nanos() as u64);
        }
        if nt > matvec::MAX_TOKENS {
            matmul::route(
                &mut pass,
                &sc.wo_route,
                &sc.wo_ids,
                0,
                nt,
                hp.o_groups as u32,
            )?;
        }
        let width = hp.hc * hp.n_embd;
        let held = self.part.layers.clone();
        for (l, lw) in self
            .w
            .layers
            .iter()
            .enumerate()
            .take(held.end)
            .skip(held.start)
        {
            let st = &seq.layers[l - held.start];
            self.linear_exact(&mut pass, &lw.hc_attn.fn_, &sc.x, &sc.mixes, nt)?;
            let hw = HcWeights {
                base: &lw.hc_attn.base,
                scale: &lw.hc_attn.scale,
                norm: &lw.attn_norm,
            };
            hc::pre(&mut pass, &hs, nt, &sc.x, &sc.mixes, &hw, &sc.h, &sc.pc)?;
            trace_point!("attn_in", l, &sc.h, hp.n_embd);
            self.attn_block(&mut pass, st, l, &lw.attn, nt, pos0)?;
            trace_point!("attn_out", l, &sc.blk, hp.n_embd);
            hc::post(&mut pass, &hs, nt, &sc.x, &sc.blk, &sc.pc)?;

            self.linear_exact(&mut pass, &lw.hc_ffn.fn_, &sc.x, &sc.mixes, nt)?;
            let hw = HcWeights {
                base: &lw.hc_ffn.base,
                scale: &lw.hc_ffn.scale,
                norm: &lw.ffn_norm,
            };
            hc::pre(&mut pass, &hs, nt, &sc.x, &sc.mixes, &hw, &sc.h, &sc.pc)?;
            trace_point!("ffn_in", l, &sc.h, hp.n_embd);
            self.moe_block(&mut pass, l, &lw.moe, nt)?;
            trace_point!("moe_out", l, &sc.blk, hp.n_embd);
            hc::post(&mut pass, &hs, nt, &sc.x, &sc.blk, &sc.pc)?;
            trace_point!("layer_out", l, &sc.x, width);
            pass.flush_every(crate::gpu::FLUSH_OPS)?;
        }
        let submit =
            |p: Pass<'_>, prof: &mut Option<Vec<(String, f64)>>| p.submit_or_profile(prof.as_mut());
        let mut prof = self.profile.as_ref().map(|_| Vec::new());
        let mut logits = Vec::new();
        let mut top_out = None;
        if let Some(rb) = &self.handoff {
            // Not the last part: the residual stream goes on to the next device.
            let len = n * width;
            pass.copy(&sc.x, 0, rb.buffer(), 0, len as u64 * 4);
            submit(pass, &mut prof)?;
            let (data, ns) = rb.read(&gpu, len)?;
            self.link.send(chain::Hidden { rows: n, data }, ns)?;
        } else if want > 0 || top.is_some() {
            // Head fold (sigmoid gate only) and the final norm, then the head for the
            // wanted rows, in chunks the logits buffer holds.
            let hh = &self.w.hc_head;
            self.linear_exact(&mut pass, &hh.fn_, &sc.x, &sc.mixes, nt)?;
            let hw = HcWeights {
                base: &hh.base,
                scale: &hh.scale,
                norm: &self.w.output_norm,
            };
            hc::head(&mut pass, &hs, nt, &sc.x, &sc.mixes, &hw, &sc.h)?;
            let v = hp.n_vocab;
            let mut r = n - want;
            let mut pending = Some(pass);
            if let Some((k, lse)) = top {
                // The last row's head, then its top-k (+ lse) in the same pass: only
                // those come back.
                let mut p = pending.take().expect("the forward's pass");
                matmul::matmul(
                    &mut p,
                    &self.w.output,
                    &sc.h,
                    ((n - 1) * hp.n_embd) as u32,
                    &sc.logits,
                    0,
                    1,
                )?;
                sc.top
                    .record(&mut p, View::new(&sc.logits, 0), 1, 0, k, lse)?;
                submit(p, &mut prof)?;
                top_out = sc.top.read(&gpu, 1, k, lse)?.pop();
                r = n;
            }
            while r < n {
                let rows = (n - r).min(sc.logit_rows);
                let mut p = pending.take().unwrap_or_else(|| gpu.pass());
                matmul::matmul(
                    &mut p,
                    &self.w.output,
                    &sc.h,
                    (r * hp.n_embd) as u32,
                    &sc.logits,
                    0,
                    rows as u32,
                )?;
                submit(p, &mut prof)?;
                logits.extend(gpu.read_f32(&sc.logits, 0, rows * v)?);
                r += rows;
            }
        } else {
            submit(pass, &mut prof)?;
        }
        if let (Some(all), Some(new)) = (self.profile.as_mut(), prof) {
            all.extend(new);
        }
        seq.pos = pos_end;
        if let (Some(tb), true) = (&self.trace_buf, trace_len > 0) {
            let v = gpu.read_f32(tb, 0, trace_len)?;
            self.traced.extend(v);
        }
        Ok((logits, top_out))
    }

    /// `y = W x` for `n` packed rows.
    fn linear(
        &self,
        pass: &mut Pass<'_>,
        w: &GpuTensor,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n: u32,
    ) -> Result<()> {
        matmul::matmul(pass, w, x, 0, y, 0, n)
    }

    /// [`Self::linear`] in f32 whatever the device's product path: for the products that feed
    /// a discrete choice (router, indexer top-k) or the Sinkhorn-normalised hyper-connection
    /// mixes (see [`MatvecOpts::exact`]).
    fn linear_exact(
        &self,
        pass: &mut Pass<'_>,
        w: &GpuTensor,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n: u32,
    ) -> Result<()> {
        let opts = MatvecOpts {
            exact: true,
            ..Default::default()
        };
        matmul::matmul_opts(pass, w, x, 0, y, 0, n, &opts)
    }

    /// Append the chunk's rows to a compressor and pool the windows it completes into
    /// `out` rows of d at `out_off` (relative to the chunk's first completed window).
    /// Returns (first window, windows).
    #[allow(clippy::too_many_arguments)]
    fn compress(
        &self,
        pass: &mut Pass<'_>,
        c: &Compressor<GpuTensor>,
        cs: &CmpState,
        table: &RopeTable,
        n: u32,
        pos0: usize,
        out: &wgpu::Buffer,
        out_off: u32,
    ) -> Result<(u32, u32)> {
        let sc = &self.scratch;
        let s = cs.shape;
        let w = s.width();
        // f32 products: the indexer's compressed keys decide its top-k (see MatvecOpts::exact)
        let opts = MatvecOpts {
            y_stride: 2 * w,
            exact: true,
            ..Default::default()
        };
        matmul::matmul_opts(pass, &c.wkv, &sc.h, 0, &sc.cmp, 0, n, &opts)?;
        matmul::matmul_opts(pass, &c.wgate, &sc.h, 0, &sc.cmp, w, n, &opts)?;
        compress::store(
            pass,
            &s,
            n,
            pos0 as u32,
            &sc.cmp,
            0,
            2 * w,
            &c.ape,
            &cs.store,
        )?;
        // Window w closes at position (w+1)·m − 1: those closing in [pos0, pos0 + n).
        let m = s.ratio as usize;
        let w0 = pos0 / m;
        let n_win = (pos0 + n as usize) / m - w0;
        compress::pool(
            pass,
            &s,
            w0 as u32,
            n_win as u32,
            &c.norm,
            table,
            self.hp.eps,
            &cs.store,
            out,
            out_off,
        )?;
        Ok((w0 as u32, n_win as u32))
    }

    fn attn_block(
        &self,
        pass: &mut Pass<'_>,
        st: &LayerState,
        l: usize,
        a: &Attn<GpuTensor>,
        n: u32,
        pos0: usize,
    ) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let (nh, hd) = (hp.n_head as u32, hp.head_dim as u32);
        let table = &self.rope[l];
        let p0 = pos0 as u32;
        let pos_end = pos0 + n as usize;
        // Queries: low rank, weighted norm, up-projection, unweighted norm per head, RoPE.
        self.linear(pass, &a.wq_a, &sc.h, &sc.qr, n)?;
        let ql = hp.q_lora as u32;
        norm::rms_norm(
            pass,
            n,
            ql,
            View::new(&sc.qr, 0),
            None,
            Some(&a.q_norm),
            hp.eps,
        )?;
        self.linear(pass, &a.wq_b, &sc.qr, &sc.q, n)?;
        norm::rms_norm(pass, n * nh, hd, View::new(&sc.q, 0), None, None, hp.eps)?;
        rope::rope_interleaved(
            pass,
            &RopeView::packed(&sc.q, 0, n, nh, hd),
            table,
            Positions::From(p0),
            false,
        )?;
        // The one K=V head, into the window ring (two writes when the chunk wraps).
        self.linear(pass, &a.wkv, &sc.h, &sc.kv, n)?;
        norm::rms_norm(
            pass,
            n,
            hd,
            View::new(&sc.kv, 0),
            None,
            Some(&a.kv_norm),
            hp.eps,
        )?;
        rope::rope_interleaved(
            pass,
            &RopeView::packed(&sc.kv, 0, n, 1, hd),
            table,
            Positions::From(p0),
            false,
        )?;
        let ks = kv_shape(self.kv_type, hp.head_dim);
        let slot = pos0 % self.ring;
        let n1 = (n as usize).min(self.ring - slot);
        attention::write_kv(
            pass,
            ks,
            &sc.kv,
            0,
            hd,
            n1 as u32,
            &st.ring,
            DstRows::Range { row0: slot as u32 },
        )?;
        if n1 < n as usize {
            attention::write_kv(
                pass,
                ks,
                &sc.kv,
                n1 as u32 * hd,
                hd,
                n - n1 as u32,
                &st.ring,
                DstRows::Range { row0: 0 },
            )?;
        }

        // Compressed entries of the windows this chunk completes.
        let ratio = hp.compress_ratio[l];
        if let (Some(c), Some(cs)) = (&a.cmp, &st.cmp) {
            let (w0, n_win) = self.compress(pass, c, cs, table, n, pos0, &sc.ent, 0)?;
            attention::write_kv(
                pass,
                ks,
                &sc.ent,
                0,
                hd,
                n_win,
                &cs.cache,
                DstRows::Range { row0: w0 },
            )?;
        }
        let n_win = hp.window.min(pos_end) as u32;
        let n_idx = n_win + self.comp_slots(l, pos_end) as u32;
        let mut fill_comp = ratio > 0;
        if let (Some(ix), Some(is)) = (&a.ix, &st.ix) {
            fill_comp = false;
            let d = hp.ix_head_dim as u32;
            let off = (pos0 / ratio) as u32 * d;
            self.compress(pass, &ix.cmp, is, table, n, pos0, &is.cache, off)?;
            let nih = hp.n_ix_head as u32;
            self.linear_exact(pass, &ix.wq_b, &sc.qr, &sc.ixq, n)?;
            rope::rope_interleaved(
                pass,
                &RopeView::packed(&sc.ixq, 0, n, nih, d),
                table,
                Positions::From(p0),
                false,
            )?;
            self.linear_exact(pass, &ix.proj, &sc.h, &sc.ixw, n)?;
            let ish = IndexerShape {
                n_head: nih,
                d,
                ratio: ratio as u32,
                top_k: hp.ix_topk as u32,
            };
            let n_ent = (pos_end / ratio) as u32;
            compress::index_scores(
                pass,
                &ish,
                n,
                p0,
                n_ent,
                &sc.ixq,
                &sc.ixw,
                &is.cache,
                &sc.scores.buf,
            )?;
            compress::select_topk(
                pass,
                &ish,
                n,
                p0,
                n_ent,
                &sc.scores.buf,
                &sc.idx.buf,
                n_idx,
                n_win,
                n_idx - n_win,
            )?;
        }
        compress::index_list(
            pass,
            &IndexList {
                n_idx,
                n_win,
                window: hp.window as u32,
                ring: self.ring as u32,
                ratio: ratio as u32,
                fill_comp,
            },
            n,
            p0,
            &sc.idx.buf,
        )?;
        // Window ∪ compressed keys (K = V), per-head sinks.
        let n_split = if n == 1 {
            attention::pick_n_split(1, nh, ks, n_idx, true)
        } else {
            1
        };
        attention::attention(
            pass,
            &Attention {
                n_q: n,
                n_head: nh,
                kv: ks,
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
                a: KvSource {
                    k: &st.ring,
                    v: None,
                },
                b: st.cmp.as_ref().map(|c| KvSource {
                    k: &c.cache,
                    v: None,
                }),
                keys: Keys::Index {
                    idx: &sc.idx.buf,
                    off: 0,
                    n_idx,
                },
                sinks: Some((&a.sink.parts[0].buffer, 0)),
                split: (n_split > 1).then_some((&sc.attn_split, n_split)),
            },
        )?;
        // The values carry the keys' rotation: undo it at the query position.
        rope::rope_interleaved(
            pass,
            &RopeView::packed(&sc.att, 0, n, nh, hd),
            table,
            Positions::From(p0),
            true,
        )?;
        // Grouped low-rank output: wo_a as a stack of o_groups matrices, token t's group g
        // (pair t·o_groups + g) reading its slice of the heads; then wo_b.
        let og = hp.o_groups as u32;
        let opts = MatvecOpts::default();
        if n <= matvec::MAX_TOKENS {
            matvec::matvec_indexed(
                pass, &a.wo_a, &sc.att, 0, true, &sc.wo_ids, 0, og, &sc.mid, 0, n, &opts,
            )?;
        } else {
            matmul::matmul_indexed(
                pass,
                &a.wo_a,
                &sc.att,
                0,
                true,
                &sc.wo_route,
                n,
                og,
                &sc.mid,
                0,
                &opts,
            )?;
        }
        self.linear(pass, &a.wo_b, &sc.mid, &sc.blk, n)
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
        router::route(
            pass,
            n,
            ne,
            k,
            func,
            select,
            hp.norm_topk,
            hp.route_scale,
            View::new(&sc.router, 0),
            View::new(&sc.moe_ids, 0),
            View::new(&sc.moe_w, 0),
        )?;
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
            off.cold_ffn(pass, cold, &bufs, limit(hp.swiglu_limit[l]))?;
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
            View::new(&sc.f_act, 0),
            View::new(&sc.f_gate, 0),
            View::new(&sc.f_up, 0),
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
        let mut max_win = 0;
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
            max_win = max_win.max(r / ratio + 1);
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
            ent: max_win * hp.head_dim,
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

    /// Bytes of all of them (each at least one element, as allocated).
    fn bytes(&self) -> u64 {
        let Dims {
            ids,
            x,
            h,
            blk,
            mixes,
            pc,
            qr,
            q,
            att,
            kv,
            mid,
            cmp,
            ent,
            ixq,
            ixw,
            scores,
            idx,
            router,
            moe_ids,
            moe_w,
            f_gate,
            f_up,
            f_act,
            moe_out,
            wo_ids,
            logits,
        } = *self;
        [
            ids, x, h, blk, mixes, pc, qr, q, att, kv, mid, cmp, ent, ixq, ixw, scores, idx,
            router, moe_ids, moe_w, f_gate, f_up, f_act, moe_out, wo_ids, logits,
        ]
        .iter()
        .map(|&n| n.max(1) as u64 * 4)
        .sum()
    }
}

/// Split-K attention partials for decode (one sequence): elements.
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
        let attn_split = gpu.buffer(attn_split_elems(hp) * 4, "attn.split")?;
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
            top: topk::LogitsTop::new(gpu, 1, hp.n_vocab as u32)?,
        })
    }

    /// Bytes [`Scratch::new`] allocates for `rows` rows, counting logits for every row (the
    /// binding limit may hold fewer): the activation part of [`needs`].
    fn bytes(hp: &Hparams, rows: usize) -> u64 {
        let (k, og) = (hp.n_used, hp.o_groups);
        Dims::new(hp, rows, rows).bytes()
            + attn_split_elems(hp) * 4
            + MoeRoute::bytes(hp.n_expert as u32, (rows * k) as u32)
            + MoeRoute::bytes(og as u32, (rows * og) as u32)
            + topk::LogitsTop::bytes(1, hp.n_vocab as u32)
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
    Needs {
        kv_per_token: kv_per_token * seqs,
        state: state * seqs,
        activations: Scratch::bytes(hp, batch as usize),
        kv_elem,
        note: None,
    }
}

impl SeqState for GpuSeq {
    fn pos(&self) -> usize {
        self.pos
    }
}

impl Forward for GpuModel {
    fn vocab_size(&self) -> usize {
        self.hp.n_vocab
    }
    fn new_seq(&self) -> Result<Seq> {
        Ok(Seq::new(GpuModel::new_seq(self)?))
    }
    fn reset(&self, seq: &mut Seq) -> Result<()> {
        GpuModel::reset(self, seq.get_mut()?)
    }
    fn copy_seq(&self, src: &Seq, dst: &mut Seq) -> Result<()> {
        GpuModel::copy_seq(self, src.get()?, dst.get_mut()?)
    }
    /// One sequence after another (no shared passes yet).
    fn forward_batch(&mut self, items: &mut [(&mut Seq, &[u32], Want)]) -> Result<Vec<Logits>> {
        items
            .iter_mut()
            .map(|(s, t, w)| GpuModel::forward_want(self, s.get_mut()?, t, *w))
            .collect()
    }
    fn forward(&mut self, seq: &mut Seq, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        GpuModel::forward(self, seq.get_mut()?, tokens, all)
    }
    fn profile(&mut self, seq: &mut Seq, tokens: &[u32]) -> Result<Vec<(String, f64)>> {
        // The step a greedy generation takes: argmax on the GPU, a few bytes back.
        let s = seq.get_mut()?;
        self.profile = Some(Vec::new());
        let r = GpuModel::forward_want(self, s, tokens, GREEDY);
        let prof = self.profile.take().unwrap_or_default();
        r.map(|_| prof)
    }
    fn offload(&self) -> Option<&Offload> {
        self.offload.as_ref()
    }
    fn routed_experts(&self) -> usize {
        self.hp.n_layer * self.hp.n_expert
    }
    /// No binding limit bounds the compressed caches below what memory allows.
    fn max_context(&self) -> Option<usize> {
        None
    }
}

impl chain::Part for GpuModel {
    fn link(&mut self, link: Link) {
        self.link = link;
    }
    fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}
