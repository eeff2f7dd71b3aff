//! The Qwen3.5-family forward on the GPU. One pass (one submission) per chunk of tokens:
//! prefill chunks use the tiled matmul, the chunked GDN scan and flash attention; a decode
//! step (one token) uses matvec, the recurrent GDN step and split-K attention. Nothing is
//! read back inside the layer loop; only the requested logits come back.
//!
//! Every dispatch has a fixed cost at decode (a barrier drains the GPU between dependent
//! ones), so products over one input run as one per stored type ([`ProjSet`]: GDN
//! qkv|z|beta|alpha, attention q|k|v, FFN gate|up, MoE router|shared expert) and the MoE
//! combine sums all slots in one dispatch: a Qwen3.5-9B Q4_K_M step takes 405 dispatches
//! instead of 509.

use super::weights::{self, Ffn, Mixer, SetOut, Sink, Weights};
use super::{HeadMap, Hparams};
use crate::forward::{KvType, LoadOptions, Logits, TopLogits, Want, GREEDY};
use crate::gpu::attention::{self, Attention, Keys, KvShape, KvSource, OutView, QView};
use crate::gpu::conv::{self, ConvIo};
use crate::gpu::elementwise::{self as ew, View};
use crate::gpu::gdn::{self, GdnIo, GdnShape, KeyHeadMap, SeqBatch, SeqSpan};
use crate::gpu::matmul::{self, MoeRoute};
use crate::gpu::matvec::MatvecOpts;
use crate::gpu::moe::{routed_ffn, ExpertStacks, FfnBufs};
use crate::gpu::norm;
use crate::gpu::rope::{self, Positions, RopeStyle, RopeTable, RopeView};
use crate::gpu::{embed, topk, Gpu, GpuTensor, Pass};
use crate::models::{Forward, ModelFile, Seq, SeqState, Weight};
use crate::moe::{Needs, Offload, Plan, RunShape};
use crate::tensor::TensorRef;
use crate::{DType, Error, Result};
use std::sync::{Arc, Mutex};

/// Tokens per prefill pass: activations are sized for this many rows. 512 as llama.cpp's
/// micro-batch: the matrix kernels fill an H200 only from ~512 tokens (4096x12288 Q4_K on the
/// cooperative-matrix path: 49 TFLOP/s at 256 tokens, 71 at 512).
pub const DEFAULT_BATCH: usize = 512;

/// Activation buffers, sized once for `rows` tokens per pass (f32 unless said).
struct Scratch {
    rows: usize,
    /// [rows] u32 token ids, positions, KV cache destination rows; [rows, 2] u32 visible
    /// key ranges of decode rows.
    ids: wgpu::Buffer,
    pos: wgpu::Buffer,
    kv_rows: wgpu::Buffer,
    ranges: wgpu::Buffer,
    /// [rows, n_embd]: the residual stream, and its normed copy.
    x: wgpu::Buffer,
    h: wgpu::Buffer,
    /// [rows, width of the widest ProjSet]: a product set's outputs, one row per token
    /// (`ProjSet::off` gives each member's columns).
    proj: wgpu::Buffer,
    /// [rows, conv_dim]: fused q|k|v after the conv.
    qkv: wgpu::Buffer,
    /// [rows, Hv·dv] each: z packed from `proj` (passes of several rows), the GDN output.
    z: wgpu::Buffer,
    o: wgpu::Buffer,
    /// [rows, n_head·2·head_dim]: q and gate interleaved per head (packed from `proj`).
    qg: wgpu::Buffer,
    /// [rows, n_head_kv·head_dim]: k packed from `proj` (v is read from `proj`).
    k: wgpu::Buffer,
    /// [rows, n_head·head_dim]: attention output, and after the gate.
    att: wgpu::Buffer,
    att_g: wgpu::Buffer,
    /// [rows·n_used, routed expert width]: the experts' gate / up.
    f_gate: wgpu::Buffer,
    f_up: wgpu::Buffer,
    /// [rows·n_used, n_embd]: routed expert outputs; [rows, n_used] ids (u32) and weights;
    /// [rows, n_embd] the shared expert's output kept across the cold path's passes
    /// (offload only). Router logits and the shared-expert gate are columns of `proj`.
    moe_out: wgpu::Buffer,
    moe_ids: wgpu::Buffer,
    moe_w: wgpu::Buffer,
    sh_out: wgpu::Buffer,
    route: Option<MoeRoute>,
    /// GDN chunk scratch and the one-sequence batch table.
    gdn_scratch: wgpu::Buffer,
    batch: SeqBatch,
    /// Split-K attention partials for decode.
    attn_split: wgpu::Buffer,
    /// [logit_rows, n_vocab]
    logits: wgpu::Buffer,
    logit_rows: usize,
    /// Top-k (+ log-sum-exp) of up to `rows` logits rows, for [`Want::Top`] items.
    top: topk::LogitsTop,
}

/// State pools shared by all sequences, one per layer kind; sequence slot `s` owns KV rows
/// `s·cap ..` and conv / recurrent slot `s`. One pool per layer lets a batched pass serve
/// many sequences with one dispatch per kernel.
struct Pools {
    slots: usize,
    /// KV rows per slot; grows by doubling (copied on the GPU).
    cap: usize,
    /// Per layer: (K, V) [slots·cap, n_head_kv, head_dim] (f16 or f32).
    kv: Vec<Option<(wgpu::Buffer, wgpu::Buffer)>>,
    /// Per layer: conv state [slots, K-1, conv_dim] and GDN state [slots, Hv, dk, dv].
    conv: Vec<Option<wgpu::Buffer>>,
    ssm: Vec<Option<wgpu::Buffer>>,
    free: Arc<Mutex<Vec<u32>>>,
}

/// One sequence: a slot in the model's state pools and the number of tokens it has seen.
/// Dropping it returns the slot.
pub struct GpuSeq {
    slot: u32,
    pos: usize,
    free: Arc<Mutex<Vec<u32>>>,
}

impl GpuSeq {
    /// Tokens consumed so far.
    pub fn pos(&self) -> usize {
        self.pos
    }
}

impl Drop for GpuSeq {
    fn drop(&mut self) {
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.slot);
    }
}

/// The [`Want::Top`] rows of a round: their rows in the pass, one k (the largest asked) and
/// whether any item wants the log-sum-exp.
#[derive(Default)]
struct TopReq {
    rows: Vec<usize>,
    k: u32,
    lse: bool,
}

/// One round's share of a batch item: rows `row .. row + n` of the pass.
struct Part {
    item: usize,
    start: usize,
    n: usize,
    row: usize,
    slot: u32,
    pos0: usize,
}

pub struct GpuModel {
    pub gpu: Arc<Gpu>,
    pub hp: Hparams,
    w: Weights<GpuTensor, ProjSet>,
    rope: RopeTable,
    kv_type: attention::KvType,
    pools: Pools,
    scratch: Scratch,
    /// Debugging: stop the next pass after this layer and return the residual stream
    /// `[n_tokens, n_embd]` instead of logits.
    pub trace_layer: Option<usize>,
    /// Profiling: when `Some`, passes are timed per dispatch (GPU timestamps) and the last
    /// round's `(kernel label, ns)` list is stored here.
    pub profile: Option<Vec<(String, f64)>>,
    /// The expert arena and cold path when not every routed expert has a slot (or routing
    /// is counted); `None`: the per-layer expert stacks of `w`.
    pub offload: Option<Offload>,
}

/// Products of one layer that read the same input, run as few matvecs as their stored types
/// allow: members of equal type and width are concatenated by rows at load
/// ([`Gpu::upload_concat`]), one product per group. Per token the outputs form one row of
/// `width` values in `Scratch::proj`, member `i` at columns `off[i]..` (a group's members
/// adjacent, in set order). A product's rows are independent, so each member's values are
/// what its own product would give.
pub struct ProjSet {
    /// Each group's concatenated weight and its first column.
    groups: Vec<(GpuTensor, u32)>,
    /// Per member (in the set's order, `weights::Layer`): its first column.
    off: Vec<u32>,
    width: u32,
}

impl ProjSet {
    /// `proj[t, :] = [W_g x_t for each group g]` for the `n` rows of `x` ([n, cols] packed).
    fn run(&self, pass: &mut Pass<'_>, x: &wgpu::Buffer, y: &wgpu::Buffer, n: u32) -> Result<()> {
        self.run_opts(pass, x, y, n, false)
    }

    /// [`ProjSet::run`]; `exact`: f32 products (a set holding the MoE router, whose top-k
    /// f16 rounding would flip; see [`MatvecOpts::exact`]).
    fn run_opts(
        &self,
        pass: &mut Pass<'_>,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n: u32,
        exact: bool,
    ) -> Result<()> {
        let opts = MatvecOpts {
            y_stride: self.width,
            exact,
            ..Default::default()
        };
        for (w, col) in &self.groups {
            matmul::matmul_opts(pass, w, x, 0, y, *col, n, &opts)?;
        }
        Ok(())
    }

    /// Group the members of a set by (stored type, width), first appearance first, and
    /// upload each group with `upload` (given the group's weights and a label).
    fn build(
        ws: &[Weight<'_>],
        mut upload: impl FnMut(&[&Weight<'_>], &str) -> Result<GpuTensor>,
    ) -> Result<ProjSet> {
        let key = |w: &Weight<'_>| (w.dtype(), w.shape().last().copied().unwrap_or(1));
        let mut keys: Vec<(DType, u64)> = Vec::new();
        let mut members: Vec<Vec<usize>> = Vec::new();
        for (i, w) in ws.iter().enumerate() {
            match keys.iter().position(|k| *k == key(w)) {
                Some(g) => members[g].push(i),
                None => {
                    keys.push(key(w));
                    members.push(vec![i]);
                }
            }
        }
        let rows = |w: &Weight<'_>| {
            let s = w.shape();
            s.iter().product::<u64>() / s.last().copied().unwrap_or(1).max(1)
        };
        let mut off = vec![0u32; ws.len()];
        let mut groups = Vec::with_capacity(members.len());
        let mut col = 0u64;
        for m in &members {
            let refs: Vec<&Weight<'_>> = m.iter().map(|&i| &ws[i]).collect();
            let t = upload(&refs, &group_label(&refs))?;
            groups.push((t, col as u32));
            for &i in m {
                off[i] = col as u32;
                col += rows(&ws[i]);
            }
        }
        if col > u32::MAX as u64 / 4 {
            return Err(Error::Invalid(format!(
                "{}: {col} output columns",
                group_label(&ws.iter().collect::<Vec<_>>())
            )));
        }
        Ok(ProjSet {
            groups,
            off,
            width: col as u32,
        })
    }
}

/// A group's label: its first member's name, then the others' without the prefix they share
/// with it up to a dot (`blk.0.attn_qkv.weight+attn_gate.weight`).
fn group_label(ws: &[&Weight<'_>]) -> String {
    let first = ws.first().map_or("", |w| w.name());
    let mut label = first.to_string();
    for w in ws.iter().skip(1) {
        let name = w.name();
        let common = first
            .bytes()
            .zip(name.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        let cut = name[..common].rfind('.').map_or(0, |i| i + 1);
        label.push('+');
        label.push_str(&name[cut..]);
    }
    label
}

/// `f` over the stored-type bytes of all `ws` at once (`Weight::with_tensor`, nested: only
/// row selections and computed vectors are copies).
fn with_tensors<R>(
    ws: &[&Weight<'_>],
    f: &mut dyn FnMut(&[TensorRef<'_>]) -> Result<R>,
) -> Result<R> {
    fn go<R>(
        ws: &[&Weight<'_>],
        acc: &[TensorRef<'_>],
        f: &mut dyn FnMut(&[TensorRef<'_>]) -> Result<R>,
    ) -> Result<R> {
        match ws.split_first() {
            None => f(acc),
            Some((w, rest)) => w.with_tensor(|t| {
                let mut next: Vec<TensorRef<'_>> = acc.to_vec();
                next.push(*t);
                go(rest, &next, f)
            }),
        }
    }
    go(ws, &[], f)
}

/// The GPU loader: weights go from the mmap to the GPU as they are stored; product sets as
/// [`ProjSet`]s (their members' own tensors are then empty stand-ins carrying name, type and
/// shape); routed experts of an offloaded model are left to the expert arena.
struct GpuSink<'a> {
    gpu: &'a Gpu,
    experts_elsewhere: bool,
    opts: &'a LoadOptions,
    done: u64,
    total: u64,
}

impl GpuSink<'_> {
    fn progress(&mut self, bytes: u64) {
        self.done += bytes;
        if let Some(p) = &self.opts.progress {
            p(self.done.min(self.total), self.total);
        }
    }
}

impl Sink for GpuSink<'_> {
    type T = GpuTensor;
    type Set = ProjSet;

    fn one(&mut self, w: Weight<'_>) -> Result<GpuTensor> {
        if self.experts_elsewhere && crate::moe::is_expert_tensor(w.name()) {
            return Ok(w.stand_in());
        }
        let t = w.with_tensor(|t| self.gpu.upload_tensor(t))?;
        self.progress(t.bytes());
        Ok(t)
    }

    fn set(&mut self, ws: Vec<Weight<'_>>) -> Result<SetOut<GpuTensor, ProjSet>> {
        let gpu = self.gpu;
        let mut bytes = 0;
        let set = ProjSet::build(&ws, |group, label| {
            let t = with_tensors(group, &mut |ts| gpu.upload_concat(ts, label))?;
            bytes += t.bytes();
            Ok(t)
        })?;
        self.progress(bytes);
        Ok((ws.iter().map(Weight::stand_in).collect(), Some(set)))
    }
}

fn kv_shape(hp: &Hparams, t: attention::KvType) -> KvShape {
    KvShape {
        dtype: t,
        n_head_kv: hp.n_head_kv as u32,
        head_dim: hp.head_dim as u32,
    }
}

impl GpuModel {
    pub fn load(gpu: Arc<Gpu>, file: &ModelFile, opts: &LoadOptions) -> Result<GpuModel> {
        let hp = Hparams::from_file(file)?;
        // Placement first: experts without the stacks go to the arena after the rest.
        let plan = Plan::new(
            &gpu,
            file,
            opts,
            &needs(&hp, RunShape::new(opts, DEFAULT_BATCH)),
        )?;
        let sink = GpuSink {
            gpu: &gpu,
            experts_elsewhere: plan.is_some(),
            opts,
            done: 0,
            total: file.tensors().map(|t| t.data.len() as u64).sum(),
        };
        let w = weights::load_sets(file, &hp, sink)?;
        let inv = crate::cpu::ops::rope_inv_freq(hp.rope_theta, hp.n_rot.max(2));
        let rope = RopeTable::new(&gpu, &inv, "qwen35.rope")?;
        let kv_type = match opts.kv_type {
            KvType::Auto | KvType::F16 => attention::KvType::F16,
            KvType::F32 => attention::KvType::F32,
        };
        let scratch = Scratch::new(&gpu, &hp, DEFAULT_BATCH, opts.max_seqs.max(1))?;
        let pools = Pools::new(
            &gpu,
            &hp,
            kv_type,
            opts.max_seqs.max(1),
            opts.ctx.clamp(16, 4096),
        )?;
        let offload = match plan {
            Some(p) => Some(Offload::new(&gpu, file, p, opts, DEFAULT_BATCH)?),
            None => None,
        };
        Ok(GpuModel {
            gpu,
            hp,
            w,
            rope,
            kv_type,
            pools,
            scratch,
            trace_layer: None,
            profile: None,
            offload,
        })
    }

    /// Layers with routed experts.
    pub fn n_moe_layers(&self) -> usize {
        self.w
            .layers
            .iter()
            .filter(|l| matches!(l.ffn, Ffn::Moe(_)))
            .count()
    }

    /// A new sequence in a free slot (at most `LoadOptions::max_seqs` live at once).
    pub fn new_seq(&self) -> Result<GpuSeq> {
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
        let mut seq = GpuSeq {
            slot,
            pos: 0,
            free: self.pools.free.clone(),
        };
        self.reset(&mut seq)?;
        Ok(seq)
    }

    /// Forget everything the sequence has seen (zeroes its recurrent state).
    pub fn reset(&self, seq: &mut GpuSeq) -> Result<()> {
        let hp = &self.hp;
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        let s = seq.slot as u64;
        let conv_len = ((hp.conv_kernel - 1) * hp.conv_dim() * 4) as u64;
        let ssm_len = (hp.n_v_heads * hp.d_k * hp.d_v * 4) as u64;
        for b in self.pools.conv.iter().flatten() {
            enc.clear_buffer(b, s * conv_len, Some(conv_len));
        }
        for b in self.pools.ssm.iter().flatten() {
            enc.clear_buffer(b, s * ssm_len, Some(ssm_len));
        }
        self.gpu.queue.submit([enc.finish()]);
        seq.pos = 0;
        Ok(())
    }

    /// Make `dst` a copy of `src` (a checkpoint, or its restore): KV rows `[0, pos)` of every
    /// attention layer and the conv + GDN state of every recurrent layer, slot to slot, all
    /// on the GPU in one submission. Both slots live in the same pool buffers and WebGPU
    /// forbids a copy within one buffer, so each region goes through a staging buffer (wgpu
    /// orders the copies with barriers). Every slot has the pool's `cap` rows, so `dst`
    /// never needs to grow.
    pub fn copy_seq(&self, src: &GpuSeq, dst: &mut GpuSeq) -> Result<()> {
        let hp = &self.hp;
        let p = &self.pools;
        debug_assert!(src.pos <= p.cap && src.slot != dst.slot);
        let (s, d) = (src.slot as u64, dst.slot as u64);
        let conv_len = ((hp.conv_kernel - 1) * hp.conv_dim() * 4) as u64;
        let ssm_len = (hp.n_v_heads * hp.d_k * hp.d_v * 4) as u64;
        let ks = kv_shape(hp, self.kv_type);
        // [pos, n_head_kv, head_dim]: a multiple of 4 bytes (head_dim is, see KvShape).
        let kv_len = ks.bytes(src.pos as u64);
        let (kv_src, kv_dst) = (ks.bytes(s * p.cap as u64), ks.bytes(d * p.cap as u64));
        let mut regions: Vec<(&wgpu::Buffer, u64, u64, u64)> = Vec::new();
        for (l, kv) in p.kv.iter().enumerate() {
            if let Some((k, v)) = kv {
                if kv_len > 0 {
                    regions.push((k, kv_src, kv_dst, kv_len));
                    regions.push((v, kv_src, kv_dst, kv_len));
                }
            }
            if let Some(c) = &p.conv[l] {
                regions.push((c, s * conv_len, d * conv_len, conv_len));
            }
            if let Some(b) = &p.ssm[l] {
                regions.push((b, s * ssm_len, d * ssm_len, ssm_len));
            }
        }
        let stage_len = regions.iter().map(|r| r.3).max().unwrap_or(0);
        if stage_len > 0 {
            let stage = self.gpu.buffer(stage_len, "seq.copy_stage")?;
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            for (buf, from, to, len) in regions {
                enc.copy_buffer_to_buffer(buf, from, &stage, 0, len);
                enc.copy_buffer_to_buffer(&stage, 0, buf, to, len);
            }
            self.gpu.queue.submit([enc.finish()]);
            self.gpu.check()?;
        }
        dst.pos = src.pos;
        Ok(())
    }

    /// Grow every slot's KV rows to at least `need` (doubling; old rows copied on the GPU).
    fn reserve(&mut self, pass: &mut Pass<'_>, need: usize) -> Result<()> {
        if need <= self.pools.cap {
            return Ok(());
        }
        // Doubling amortizes the copies; near the binding limit take what still fits.
        let max_cap = self.max_positions();
        let p = &mut self.pools;
        let s = kv_shape(&self.hp, self.kv_type);
        if need > max_cap {
            return Err(Error::Invalid(format!(
                "a KV cache of {need} positions x {} sequences exceeds the adapter's binding \
                 limit ({max_cap} positions fit): use fewer sequences (`--parallel`) or a \
                 shorter context",
                p.slots
            )));
        }
        let new_cap = need.max(p.cap * 2).next_multiple_of(256).min(max_cap);
        let rows = (p.slots * new_cap) as u64;
        for kv in p.kv.iter_mut().flatten() {
            let k = self.gpu.buffer(s.bytes(rows), "kv.k")?;
            let v = self.gpu.buffer(s.bytes(rows), "kv.v")?;
            for slot in 0..p.slots as u64 {
                let (from, to, len) = (
                    s.bytes(slot * p.cap as u64),
                    s.bytes(slot * new_cap as u64),
                    s.bytes(p.cap as u64),
                );
                pass.copy(&kv.0, from, &k, to, len);
                pass.copy(&kv.1, from, &v, to, len);
            }
            *kv = (k, v);
        }
        p.cap = new_cap;
        Ok(())
    }

    /// Positions per sequence the KV pools can grow to: each attention layer's K (and V)
    /// pool is one buffer of `slots x positions` rows, bounded by the adapter's binding limit.
    pub fn max_positions(&self) -> usize {
        let row = kv_shape(&self.hp, self.kv_type).bytes(1).max(1);
        let per_seq = (self.gpu.max_binding() / row / self.pools.slots.max(1) as u64) as usize;
        if per_seq >= 256 {
            per_seq / 256 * 256
        } else {
            per_seq
        }
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let v = self.hp.n_vocab;
        match tokens.iter().find(|&&t| t as usize >= v) {
            Some(&bad) => Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary of {v}"
            ))),
            None => Ok(()),
        }
    }

    /// Feed `tokens`; returns logits for every token (`all`) or only the last one.
    pub fn forward(&mut self, seq: &mut GpuSeq, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        let want = if all { Want::All } else { Want::Last };
        let mut out = self.forward_batch(&mut [(seq, tokens, want)])?;
        Ok(out.pop().map(Logits::into_full).unwrap_or_default())
    }

    /// Feed several sequences at once: each item's tokens are appended to its sequence, in
    /// passes of at most `DEFAULT_BATCH` rows shared by all items (a long prefill is split
    /// into chunks, so decode steps of other items never wait longer than a chunk).
    /// Returns, per item, the logits it wants (`[n, vocab]` row-major), or for
    /// [`Want::Top`] the best logits of its last token, found in the round's pass.
    pub fn forward_batch(
        &mut self,
        items: &mut [(&mut GpuSeq, &[u32], Want)],
    ) -> Result<Vec<Logits>> {
        for (_, t, w) in items.iter() {
            self.check_tokens(t)?;
            crate::forward::check_want(*w)?;
        }
        let v = self.hp.n_vocab;
        // One k for every Top item (the largest); each item keeps its own k of it.
        let mut top = TopReq::default();
        for (_, _, w) in items.iter() {
            if let Want::Top { k, lse } = *w {
                top.k = top.k.max(k);
                top.lse |= lse;
            }
        }
        let mut out: Vec<Logits> = items.iter().map(|_| Logits::Full(Vec::new())).collect();
        let mut done: Vec<usize> = vec![0; items.len()];
        loop {
            // One round: multi-token parts first, single tokens after (one batched decode
            // attention call covers those).
            let mut parts = Vec::new();
            let mut rows = 0;
            for pass_single in [false, true] {
                for (i, (seq, toks, _)) in items.iter().enumerate() {
                    let left = toks.len() - done[i];
                    if left == 0 || (left == 1) != pass_single || rows == self.scratch.rows {
                        continue;
                    }
                    let n = left.min(self.scratch.rows - rows);
                    parts.push(Part {
                        item: i,
                        start: done[i],
                        n,
                        row: rows,
                        slot: seq.slot,
                        pos0: seq.pos + done[i],
                    });
                    rows += n;
                }
            }
            if parts.is_empty() {
                break;
            }
            let wants: Vec<(usize, usize)> = parts
                .iter()
                .filter_map(|p| {
                    let toks_len = items[p.item].1.len();
                    match items[p.item].2 {
                        Want::All => Some((p.row, p.n)),
                        Want::Last if p.start + p.n == toks_len => Some((p.row + p.n - 1, 1)),
                        _ => None,
                    }
                })
                .collect();
            top.rows = parts
                .iter()
                .filter(|p| {
                    matches!(items[p.item].2, Want::Top { .. })
                        && p.start + p.n == items[p.item].1.len()
                })
                .map(|p| p.row + p.n - 1)
                .collect();
            let toks: Vec<u32> = parts
                .iter()
                .flat_map(|p| items[p.item].1[p.start..p.start + p.n].iter().copied())
                .collect();
            let (logits, tops) = self.run_round(&parts, &toks, &wants, &top)?;
            if self.trace_layer.is_some() {
                // Debug pass: the residual stream came back instead of logits; the
                // sequences' positions are left as they were.
                return Ok(vec![Logits::Full(logits)]);
            }
            let mut off = 0;
            let mut tops = tops.into_iter();
            for p in &parts {
                let got = wants
                    .iter()
                    .find(|w| w.0 >= p.row && w.0 < p.row + p.n)
                    .map(|w| w.1);
                if let (Some(nw), Logits::Full(o)) = (got, &mut out[p.item]) {
                    o.extend_from_slice(&logits[off * v..(off + nw) * v]);
                    off += nw;
                }
                if top.rows.contains(&(p.row + p.n - 1)) {
                    let Want::Top { k, lse } = items[p.item].2 else {
                        unreachable!("top rows come from Top items")
                    };
                    let mut t = tops.next().ok_or_else(|| {
                        Error::Gpu("the round returned too few top-logits rows".into())
                    })?;
                    t.cands.truncate(k as usize);
                    if !lse {
                        t.lse = None;
                    }
                    out[p.item] = Logits::Top(t);
                }
                done[p.item] += p.n;
            }
        }
        for (i, (seq, toks, _)) in items.iter_mut().enumerate() {
            debug_assert_eq!(done[i], toks.len());
            seq.pos += toks.len();
        }
        Ok(out)
    }

    /// One pass over the rows of `parts`; returns the logits of the `wants` row runs and the
    /// top logits of the `top` rows (in order).
    fn run_round(
        &mut self,
        parts: &[Part],
        toks: &[u32],
        wants: &[(usize, usize)],
        top: &TopReq,
    ) -> Result<(Vec<f32>, Vec<TopLogits>)> {
        let gpu = self.gpu.clone();
        let n = toks.len() as u32;
        let e = self.hp.n_embd as u32;
        let need = parts.iter().map(|p| p.pos0 + p.n).max().unwrap_or(0);
        let mut pass = gpu.pass();
        if self.profile.is_some() {
            pass.hold();
        }
        self.reserve(&mut pass, need)?;
        let cap = self.pools.cap as u32;
        // Per-row positions and KV destination rows; per decode row its visible key range.
        let mut pos = Vec::with_capacity(toks.len());
        let mut kv_rows = Vec::with_capacity(toks.len());
        let mut ranges = Vec::new();
        for p in parts {
            for j in 0..p.n {
                let q = (p.pos0 + j) as u32;
                pos.push(q);
                kv_rows.push(p.slot * cap + q);
                if p.n == 1 {
                    ranges.extend_from_slice(&[p.slot * cap, q + 1]);
                }
            }
        }
        let sc = &mut self.scratch;
        gpu.write(&sc.ids, 0, bytemuck::cast_slice(toks));
        gpu.write(&sc.pos, 0, bytemuck::cast_slice(&pos));
        gpu.write(&sc.kv_rows, 0, bytemuck::cast_slice(&kv_rows));
        if !ranges.is_empty() {
            gpu.write(&sc.ranges, 0, bytemuck::cast_slice(&ranges));
        }
        let spans: Vec<SeqSpan> = parts
            .iter()
            .map(|p| SeqSpan {
                row: p.row as u32,
                n_tokens: p.n as u32,
                slot: p.slot,
            })
            .collect();
        sc.batch.update(&gpu, &spans)?;
        let sc = &self.scratch;
        let hp = &self.hp;
        embed::embed(
            &mut pass,
            &self.w.tok_embd,
            &sc.ids,
            0,
            n,
            View::new(&sc.x, 0),
        )?;
        for (l, lw) in self.w.layers.iter().enumerate() {
            norm::rms_norm(
                &mut pass,
                n,
                e,
                View::new(&sc.x, 0),
                Some(View::new(&sc.h, 0)),
                Some(&lw.attn_norm),
                hp.eps,
            )?;
            match &lw.mixer {
                Mixer::Gdn(g) => self.gdn_block(&mut pass, parts, l, g, n)?,
                Mixer::Attn(a) => self.attn_block(&mut pass, parts, l, a, n)?,
            }
            norm::rms_norm(
                &mut pass,
                n,
                e,
                View::new(&sc.x, 0),
                Some(View::new(&sc.h, 0)),
                Some(&lw.post_norm),
                hp.eps,
            )?;
            self.ffn_block(&mut pass, l, &lw.ffn, n)?;
            if self.trace_layer == Some(l) {
                pass.submit()?;
                let x = gpu.read_f32(&sc.x, 0, toks.len() * hp.n_embd)?;
                return Ok((x, Vec::new()));
            }
            pass.flush_every(crate::gpu::FLUSH_OPS)?;
        }
        let total: usize = wants.iter().map(|w| w.1).sum();
        let profiling = self.profile.is_some();
        let mut prof = Vec::new();
        let result = self.finish_round(pass, n, wants, top, total, profiling, &mut prof);
        if profiling {
            self.profile = Some(prof);
        }
        result
    }

    /// The head over the wanted rows of a round, then submit (and read back the logits, or
    /// only the top logits of the `top` rows).
    #[allow(clippy::too_many_arguments)]
    fn finish_round(
        &self,
        mut pass: Pass<'_>,
        n: u32,
        wants: &[(usize, usize)],
        top: &TopReq,
        total: usize,
        profiling: bool,
        prof: &mut Vec<(String, f64)>,
    ) -> Result<(Vec<f32>, Vec<TopLogits>)> {
        let submit = |p: Pass<'_>, profiling: bool, prof: &mut Vec<(String, f64)>| {
            p.submit_or_profile(profiling.then_some(prof))
        };
        let gpu = self.gpu.clone();
        let sc = &self.scratch;
        let hp = &self.hp;
        let e = hp.n_embd as u32;
        if total == 0 && top.rows.is_empty() {
            submit(pass, profiling, prof)?;
            return Ok((Vec::new(), Vec::new()));
        }
        norm::rms_norm(
            &mut pass,
            n,
            e,
            View::new(&sc.x, 0),
            Some(View::new(&sc.h, 0)),
            Some(&self.w.output_norm),
            hp.eps,
        )?;
        let head = self.w.output.as_ref().unwrap_or(&self.w.tok_embd);
        let v = hp.n_vocab;
        // Top rows first, in this pass: each row's head (one row per call, as for full
        // logits, so the values are bit-identical) into the logits buffer, then their top-k
        // into `sc.top`; the full-logits runs below reuse the buffer after them.
        let mut r0 = 0;
        for chunk in top.rows.chunks(sc.logit_rows) {
            for (j, &r) in chunk.iter().enumerate() {
                matmul::matmul(
                    &mut pass,
                    head,
                    &sc.h,
                    (r * hp.n_embd) as u32,
                    &sc.logits,
                    (j * v) as u32,
                    1,
                )?;
            }
            let rows = chunk.len() as u32;
            sc.top.record(
                &mut pass,
                View::new(&sc.logits, 0),
                rows,
                r0,
                top.k,
                top.lse,
            )?;
            r0 += rows;
        }
        // The head over the wanted rows, packed into the logits buffer; more passes (each
        // read back) only when they outgrow it.
        let mut logits = Vec::with_capacity(total * v);
        let mut pending = Some(pass);
        let mut used = 0usize;
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for &(r0, nr) in wants {
            let mut r = r0;
            while r < r0 + nr {
                let take = (r0 + nr - r).min(sc.logit_rows);
                runs.push((r, take));
                r += take;
            }
        }
        for (i, &(r, take)) in runs.iter().enumerate() {
            if used + take > sc.logit_rows {
                let p = pending.take().unwrap_or_else(|| gpu.pass());
                submit(p, profiling, prof)?;
                logits.extend(gpu.read_f32(&sc.logits, 0, used * v)?);
                used = 0;
            }
            let p = pending.get_or_insert_with(|| gpu.pass());
            matmul::matmul(
                p,
                head,
                &sc.h,
                (r * hp.n_embd) as u32,
                &sc.logits,
                (used * v) as u32,
                take as u32,
            )?;
            used += take;
            if i + 1 == runs.len() {
                let p = pending.take().expect("a pass holds the head");
                submit(p, profiling, prof)?;
                logits.extend(gpu.read_f32(&sc.logits, 0, used * v)?);
            }
        }
        if let Some(p) = pending {
            submit(p, profiling, prof)?;
        }
        let tops = sc.top.read(&gpu, r0, top.k, top.lse)?;
        Ok((logits, tops))
    }

    /// The layer's product set (the GPU sink makes one for every set).
    fn set<'s>(&self, s: &'s Option<ProjSet>) -> &'s ProjSet {
        s.as_ref().expect("the GPU loader makes every product set")
    }

    /// Member `i` of `set` in `proj`: one row of its outputs per token.
    fn col(&self, set: &ProjSet, i: usize) -> View<'_> {
        View::strided(&self.scratch.proj, set.off[i], set.width)
    }

    /// `src` (one row of `len` per token) as packed rows: itself for one token, else
    /// copied into `dst`. Returns the buffer and the element offset of the rows.
    fn packed_rows<'s>(
        &'s self,
        pass: &mut Pass<'_>,
        src: View<'s>,
        len: u32,
        n: u32,
        dst: &'s wgpu::Buffer,
    ) -> Result<(&'s wgpu::Buffer, u32)> {
        if n == 1 {
            return Ok((src.buf, src.off));
        }
        ew::copy(pass, n, len, View::new(dst, 0), src)?;
        Ok((dst, 0))
    }

    fn linear(
        &self,
        pass: &mut Pass<'_>,
        w: &GpuTensor,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n: u32,
        accumulate: bool,
    ) -> Result<()> {
        // A member of a product set has no buffers of its own: it runs through `ProjSet::run`.
        debug_assert!(!w.parts.is_empty(), "{}: no GPU buffers", w.name);
        let opts = MatvecOpts {
            accumulate,
            ..Default::default()
        };
        matmul::matmul_opts(pass, w, x, 0, y, 0, n, &opts)
    }

    fn gdn_block(
        &self,
        pass: &mut Pass<'_>,
        parts: &[Part],
        l: usize,
        g: &weights::Gdn<GpuTensor>,
        n: u32,
    ) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let cd = hp.conv_dim() as u32;
        let hv = hp.n_v_heads as u32;
        let vd = hp.v_dim() as u32;
        // qkv, z, beta, alpha: one product per stored type, into columns of `proj`.
        let set = self.set(&self.w.layers[l].mixer_set);
        set.run(pass, &sc.h, &sc.proj, n)?;
        let (off_qkv, off_b, off_a, width) = (set.off[0], set.off[2], set.off[3], set.width);
        let conv_state = self.pools.conv[l]
            .as_ref()
            .expect("GDN layer has conv state");
        let ssm_state = self.pools.ssm[l]
            .as_ref()
            .expect("GDN layer has recurrent state");
        conv::conv1d_silu(
            pass,
            cd,
            hp.conv_kernel as u32,
            &sc.batch,
            &ConvIo {
                x: &sc.proj,
                x_off: off_qkv,
                x_stride: width,
                w: &g.conv.parts[0].buffer,
                state: conv_state,
                state_off: 0,
                y: &sc.qkv,
                y_off: 0,
                y_stride: cd,
            },
        )?;
        let shape = GdnShape {
            n_head_k: hp.n_k_heads,
            n_head_v: hp.n_v_heads,
            d_k: hp.d_k,
            d_v: hp.d_v,
            map: match hp.head_map {
                HeadMap::Div => KeyHeadMap::Repeat,
                HeadMap::Mod => KeyHeadMap::Tile,
            },
        };
        let io = GdnIo {
            qkv: &sc.qkv,
            qkv_off: 0,
            qkv_stride: cd,
            a: &sc.proj,
            a_off: off_a,
            a_stride: width,
            b: &sc.proj,
            b_off: off_b,
            b_stride: width,
            a_neg: &g.a.parts[0].buffer,
            dt_bias: &g.dt_bias.parts[0].buffer,
            state: ssm_state,
            state_off: 0,
            o: &sc.o,
            o_off: 0,
            o_stride: vd,
        };
        if parts.iter().all(|p| p.n == 1) {
            gdn::recurrent(pass, &shape, &sc.batch, &io)?;
        } else {
            gdn::chunked(pass, &shape, &sc.batch, &io, &sc.gdn_scratch)?;
        }
        // The norm takes z as packed [n·Hv, dv] rows: one token's are (in `proj`), several
        // tokens' are not (a row of `proj` per token), so those are packed first.
        let (z, z_off) = self.packed_rows(pass, self.col(set, 1), vd, n, &sc.z)?;
        norm::gated_rms_norm(
            pass,
            n * hv,
            hp.d_v as u32,
            View::new(&sc.o, 0),
            View::new(z, z_off),
            None,
            Some(&g.norm),
            hp.eps,
        )?;
        self.linear(pass, &g.out, &sc.o, &sc.x, n, true)
    }

    fn attn_block(
        &self,
        pass: &mut Pass<'_>,
        parts: &[Part],
        l: usize,
        a: &weights::Attn<GpuTensor>,
        n: u32,
    ) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let (nh, nkv, hd) = (hp.n_head as u32, hp.n_head_kv as u32, hp.head_dim as u32);
        // q (with its gates), k, v: one product per stored type, into columns of `proj`;
        // q and k are normed per head in place, so several tokens' are packed first.
        let set = self.set(&self.w.layers[l].mixer_set);
        set.run(pass, &sc.h, &sc.proj, n)?;
        let (qg, qg_off) = self.packed_rows(pass, self.col(set, 0), 2 * nh * hd, n, &sc.qg)?;
        let (kb, k_off) = self.packed_rows(pass, self.col(set, 1), nkv * hd, n, &sc.k)?;
        // Per-head q/k RMSNorm; q heads sit every 2·head_dim (interleaved with their gates).
        norm::rms_norm(
            pass,
            n * nh,
            hd,
            View::strided(qg, qg_off, 2 * hd),
            None,
            Some(&a.q_norm),
            hp.eps,
        )?;
        norm::rms_norm(
            pass,
            n * nkv,
            hd,
            View::new(kb, k_off),
            None,
            Some(&a.k_norm),
            hp.eps,
        )?;
        let positions = Positions::Buffer {
            buf: &sc.pos,
            off: 0,
        };
        let qv = RopeView {
            buf: qg,
            off: qg_off,
            n_tokens: n,
            n_heads: nh,
            head_dim: hd,
            token_stride: nh * 2 * hd,
            head_stride: 2 * hd,
        };
        rope::rope(pass, &qv, RopeStyle::Neox, 0, &self.rope, positions, false)?;
        rope::rope(
            pass,
            &RopeView::packed(kb, k_off, n, nkv, hd),
            RopeStyle::Neox,
            0,
            &self.rope,
            positions,
            false,
        )?;
        let (kc, vc) = self.pools.kv[l]
            .as_ref()
            .expect("attention layer has a KV cache");
        let shape = kv_shape(hp, self.kv_type);
        let dst = attention::DstRows::List {
            rows: &sc.kv_rows,
            off: 0,
        };
        attention::write_kv(pass, shape, kb, k_off, nkv * hd, n, kc, dst)?;
        // v straight from `proj` (write_kv takes a row stride).
        attention::write_kv(pass, shape, &sc.proj, set.off[2], set.width, n, vc, dst)?;
        let cap = self.pools.cap as u32;
        let q_stride = nh * 2 * hd;
        let o_stride = nh * hd;
        let call = |pass: &mut Pass<'_>,
                    row: u32,
                    n_q: u32,
                    keys: Keys<'_>,
                    max_keys: u32,
                    per_query: bool|
         -> Result<()> {
            // Split-K only when a few query rows face many keys (decode); the scratch is
            // sized for `SPLIT_ROWS` query rows.
            let mut n_split = attention::pick_n_split(n_q, nh, shape, max_keys, per_query);
            while n_split > 1
                && attention::scratch_elems(n_q, nh, hd, n_split) * 4 > sc.attn_split.size()
            {
                n_split /= 2;
            }
            attention::attention(
                pass,
                &Attention {
                    n_q,
                    n_head: nh,
                    kv: shape,
                    scale: 1.0 / (hd as f32).sqrt(),
                    q: QView {
                        buf: qg,
                        off: qg_off + row * q_stride,
                        tok_stride: q_stride,
                        head_stride: 2 * hd,
                    },
                    out: OutView {
                        buf: &sc.att,
                        off: row * o_stride,
                        tok_stride: o_stride,
                    },
                    a: KvSource { k: kc, v: Some(vc) },
                    b: None,
                    keys,
                    sinks: None,
                    split: (n_split > 1).then_some((&sc.attn_split, n_split)),
                },
            )
        };
        // Prefill parts: causal over their own slot's rows (flash tiles shared by queries).
        for p in parts.iter().filter(|p| p.n > 1) {
            let (pos0, np) = (p.pos0 as u32, p.n as u32);
            let keys = Keys::Causal {
                row0: p.slot * cap,
                pos0,
                n_kv: pos0 + np,
                window: 0,
            };
            call(pass, p.row as u32, np, keys, pos0 + np, false)?;
        }
        // Decode rows (contiguous at the end of the pass): one call for all of them.
        let singles: Vec<&Part> = parts.iter().filter(|p| p.n == 1).collect();
        if let [p] = singles[..] {
            let keys = Keys::Causal {
                row0: p.slot * cap,
                pos0: p.pos0 as u32,
                n_kv: p.pos0 as u32 + 1,
                window: 0,
            };
            call(pass, p.row as u32, 1, keys, p.pos0 as u32 + 1, false)?;
        } else if let Some(first) = singles.first() {
            let max_keys = singles.iter().map(|p| p.pos0 as u32 + 1).max().unwrap_or(1);
            let keys = Keys::Ranges {
                desc: &sc.ranges,
                off: 0,
                max_keys,
            };
            call(
                pass,
                first.row as u32,
                singles.len() as u32,
                keys,
                max_keys,
                true,
            )?;
        }
        // Output gate: attn ⊙ sigmoid(gate), the gate being the second half of each head's q row.
        ew::sigmoid_mul(
            pass,
            n * nh,
            hd,
            View::new(&sc.att_g, 0),
            View::strided(qg, qg_off + hd, 2 * hd),
            View::new(&sc.att, 0),
        )?;
        self.linear(pass, &a.o, &sc.att_g, &sc.x, n, true)
    }

    /// A MoE layer whose experts live in the offload's arena (recipe in `moe/mod.rs`): the
    /// same router, per-pair outputs, slot-order combine and shared expert as the stacked
    /// path below, with cold pairs computed on the CPU between passes.
    fn moe_offload_block(
        &self,
        pass: &mut Pass<'_>,
        l: usize,
        m: &weights::Moe<GpuTensor>,
        n: u32,
    ) -> Result<()> {
        let off = self.offload.as_ref().expect("offload layer");
        let hp = &self.hp;
        let sc = &self.scratch;
        let e = hp.n_embd as u32;
        let mp = hp.moe.as_ref().expect("MoE layer in a MoE model");
        let (ne, k) = (mp.n_expert as u32, mp.n_used as u32);
        // Router logits and the shared expert's gate, up and gate input: one product per
        // stored type, into columns of `proj` (see `ProjSet`).
        let set = self.set(&self.w.layers[l].ffn_set);
        set.run_opts(pass, &sc.h, &sc.proj, n, true)?;
        topk::router_softmax_topk(
            pass,
            n,
            ne,
            k,
            mp.norm_topk,
            self.col(set, 0),
            View::new(&sc.moe_ids, 0),
            View::new(&sc.moe_w, 0),
        )?;
        let cold = off.route(pass, l, &sc.moe_ids, &sc.h, n)?;
        let bufs = FfnBufs {
            gate: &sc.f_gate,
            up: &sc.f_up,
            act: &sc.o,
            out: &sc.moe_out,
        };
        off.hot_ffn(pass, l, &sc.h, n, &bufs, None)?;
        // The shared expert while the CPU runs the cold pairs; added after the routed sum
        // as in the stacked path.
        if let Some((g, _, d, _)) = &m.shared {
            let fs = g.shape[0] as u32;
            ew::swiglu(
                pass,
                n,
                fs,
                View::new(&sc.o, 0),
                self.col(set, 1),
                self.col(set, 2),
                None,
            )?;
            self.linear(pass, d, &sc.o, &sc.sh_out, n, false)?;
            ew::sigmoid_mul_row_inplace(pass, n, e, View::new(&sc.sh_out, 0), self.col(set, 3))?;
        }
        off.cold_ffn(pass, cold, &sc.moe_out, n, None)?;
        ew::moe_combine(
            pass,
            n,
            e,
            k,
            View::new(&sc.x, 0),
            View::new(&sc.moe_w, 0),
            View::new(&sc.moe_out, 0),
        )?;
        if m.shared.is_some() {
            ew::add_inplace(pass, n, e, View::new(&sc.x, 0), View::new(&sc.sh_out, 0))?;
        }
        Ok(())
    }

    fn ffn_block(&self, pass: &mut Pass<'_>, l: usize, f: &Ffn<GpuTensor>, n: u32) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let e = hp.n_embd as u32;
        match f {
            Ffn::Dense { gate, down, .. } => {
                let ff = gate.shape[0] as u32;
                // gate and up: one product when they share a stored type, into `proj`.
                let set = self.set(&self.w.layers[l].ffn_set);
                set.run(pass, &sc.h, &sc.proj, n)?;
                ew::swiglu(
                    pass,
                    n,
                    ff,
                    View::new(&sc.o, 0),
                    self.col(set, 0),
                    self.col(set, 1),
                    None,
                )?;
                self.linear(pass, down, &sc.o, &sc.x, n, true)
            }
            Ffn::Moe(m) if self.offload.as_ref().is_some_and(|o| o.has_layer(l)) => {
                self.moe_offload_block(pass, l, m, n)
            }
            Ffn::Moe(m) => {
                let mp = hp.moe.as_ref().expect("MoE layer in a MoE model");
                let (ne, k) = (mp.n_expert as u32, mp.n_used as u32);
                // Router logits and the shared expert's gate, up and gate input: one product
                // per stored type, into columns of `proj` (see `ProjSet`).
                let set = self.set(&self.w.layers[l].ffn_set);
                set.run_opts(pass, &sc.h, &sc.proj, n, true)?;
                topk::router_softmax_topk(
                    pass,
                    n,
                    ne,
                    k,
                    mp.norm_topk,
                    self.col(set, 0),
                    View::new(&sc.moe_ids, 0),
                    View::new(&sc.moe_w, 0),
                )?;
                let r = sc.route.as_ref().expect("route made for MoE models");
                let stacks = ExpertStacks {
                    gate: &m.gate_exps,
                    up: &m.up_exps,
                    down: &m.down_exps,
                };
                let bufs = FfnBufs {
                    gate: &sc.f_gate,
                    up: &sc.f_up,
                    act: &sc.o,
                    out: &sc.moe_out,
                };
                routed_ffn(pass, &stacks, &sc.h, &sc.moe_ids, r, n, k, &bufs, None)?;
                // Combine in slot order (fixed order: placement never changes the sum).
                ew::moe_combine(
                    pass,
                    n,
                    e,
                    k,
                    View::new(&sc.x, 0),
                    View::new(&sc.moe_w, 0),
                    View::new(&sc.moe_out, 0),
                )?;
                if let Some((g, _, d, _)) = &m.shared {
                    let fs = g.shape[0] as u32;
                    ew::swiglu(
                        pass,
                        n,
                        fs,
                        View::new(&sc.o, 0),
                        self.col(set, 1),
                        self.col(set, 2),
                        None,
                    )?;
                    self.linear(pass, d, &sc.o, &sc.moe_out, n, false)?;
                    ew::sigmoid_mul_row_inplace(
                        pass,
                        n,
                        e,
                        View::new(&sc.moe_out, 0),
                        self.col(set, 3),
                    )?;
                    ew::add_inplace(pass, n, e, View::new(&sc.x, 0), View::new(&sc.moe_out, 0))?;
                }
                Ok(())
            }
        }
    }
}

impl Pools {
    fn new(
        gpu: &Gpu,
        hp: &Hparams,
        kv_type: attention::KvType,
        slots: usize,
        cap: usize,
    ) -> Result<Pools> {
        let shape = kv_shape(hp, kv_type);
        let (mut kv, mut conv, mut ssm) = (Vec::new(), Vec::new(), Vec::new());
        let rows = (slots * cap) as u64;
        for l in 0..hp.n_layer {
            if hp.recurrent[l] {
                kv.push(None);
                conv.push(Some(gpu.buffer(
                    (slots * (hp.conv_kernel - 1) * hp.conv_dim() * 4) as u64,
                    "pool.conv",
                )?));
                ssm.push(Some(gpu.buffer(
                    (slots * hp.n_v_heads * hp.d_k * hp.d_v * 4) as u64,
                    "pool.ssm",
                )?));
            } else {
                kv.push(Some((
                    gpu.buffer(shape.bytes(rows), "kv.k")?,
                    gpu.buffer(shape.bytes(rows), "kv.v")?,
                )));
                conv.push(None);
                ssm.push(None);
            }
        }
        Ok(Pools {
            slots,
            cap,
            kv,
            conv,
            ssm,
            // Popped from the end: slot 0 first.
            free: Arc::new(Mutex::new((0..slots as u32).rev().collect())),
        })
    }
}

/// Elements (4 bytes each: f32 values or u32 ids) of the plain scratch buffers for passes of
/// `rows` rows: the one list that [`Scratch::new`] allocates and [`Scratch::bytes`] counts.
struct Dims {
    ids: usize,
    pos: usize,
    kv_rows: usize,
    ranges: usize,
    x: usize,
    h: usize,
    proj: usize,
    qkv: usize,
    z: usize,
    o: usize,
    qg: usize,
    k: usize,
    att: usize,
    att_g: usize,
    f_gate: usize,
    f_up: usize,
    moe_out: usize,
    moe_ids: usize,
    moe_w: usize,
    sh_out: usize,
    logits: usize,
}

impl Dims {
    /// `logit_rows`: rows of logits a pass holds (the binding limit may allow fewer than
    /// `rows`).
    fn new(hp: &Hparams, rows: usize, logit_rows: usize) -> Dims {
        let r = rows;
        let (k, ffw) = match &hp.moe {
            Some(m) => (m.n_used, m.n_ff_exp.max(m.n_ff_shexp)),
            None => (1, 0),
        };
        let ff = hp.n_ff.max(ffw);
        let att = hp.n_head * hp.head_dim;
        // The widest product set (see `weights::Layer`): GDN qkv|z|beta|alpha, attention
        // q|k|v, dense gate|up, MoE router|shared gate|up|gate input.
        let proj_w = (hp.conv_dim() + hp.v_dim() + 2 * hp.n_v_heads)
            .max(2 * att + 2 * hp.n_head_kv * hp.head_dim)
            .max(2 * hp.n_ff)
            .max(
                hp.moe
                    .as_ref()
                    .map_or(0, |m| m.n_expert + 2 * m.n_ff_shexp + 1),
            );
        // `o` doubles as the SwiGLU output, so it holds the widest of the three uses.
        let o_w = hp.v_dim().max(ff * k).max(att);
        Dims {
            ids: r,
            pos: r,
            kv_rows: r,
            ranges: 2 * r,
            x: r * hp.n_embd,
            h: r * hp.n_embd,
            proj: r * proj_w,
            qkv: r * hp.conv_dim(),
            z: r * hp.v_dim(),
            o: r * o_w,
            qg: r * 2 * att,
            k: r * hp.n_head_kv * hp.head_dim,
            att: r * att,
            att_g: r * att,
            // routed experts only: dense and shared-expert gate/up land in `proj`
            f_gate: r * ffw * k,
            f_up: r * ffw * k,
            moe_out: r * k * hp.n_embd,
            moe_ids: r * k,
            moe_w: r * k,
            sh_out: if hp.moe.is_some() { r * hp.n_embd } else { 1 },
            logits: logit_rows * hp.n_vocab,
        }
    }

    /// Bytes of all of them (each at least one element, as allocated).
    fn bytes(&self) -> u64 {
        let Dims {
            ids,
            pos,
            kv_rows,
            ranges,
            x,
            h,
            proj,
            qkv,
            z,
            o,
            qg,
            k,
            att,
            att_g,
            f_gate,
            f_up,
            moe_out,
            moe_ids,
            moe_w,
            sh_out,
            logits,
        } = *self;
        [
            ids, pos, kv_rows, ranges, x, h, proj, qkv, z, o, qg, k, att, att_g, f_gate, f_up,
            moe_out, moe_ids, moe_w, sh_out, logits,
        ]
        .iter()
        .map(|&n| n.max(1) as u64 * 4)
        .sum()
    }
}

/// The GDN layers' shape (for the chunk scratch).
fn gdn_shape(hp: &Hparams) -> GdnShape {
    GdnShape {
        n_head_k: hp.n_k_heads,
        n_head_v: hp.n_v_heads,
        d_k: hp.d_k,
        d_v: hp.d_v,
        map: KeyHeadMap::Repeat,
    }
}

/// Chunk slots of the GDN scratch for a pass of `rows` rows: Σ ceil(n_i / CHUNK) ≤
/// ceil(rows / CHUNK) + one partial chunk per sequence sharing the pass.
fn gdn_chunks(rows: usize, max_seqs: usize) -> u32 {
    (rows as u32).div_ceil(gdn::CHUNK as u32) + max_seqs as u32
}

/// Split-K partials for a decode step of every sequence at MAX_SPLIT splits, capped at 64 MiB
/// (fewer splits are used beyond it): elements.
fn attn_split_elems(hp: &Hparams, max_seqs: usize) -> u64 {
    attention::scratch_elems(
        max_seqs as u32,
        hp.n_head as u32,
        hp.head_dim as u32,
        attention::MAX_SPLIT,
    )
    .min(16 << 20)
}

impl Scratch {
    fn new(gpu: &Gpu, hp: &Hparams, rows: usize, max_seqs: usize) -> Result<Scratch> {
        let f = |n: usize, label: &str| gpu.buffer((n.max(1) * 4) as u64, label);
        let r = rows;
        let batch = SeqBatch::new(
            gpu,
            &[SeqSpan {
                row: 0,
                n_tokens: r as u32,
                slot: 0,
            }],
        )?;
        let gdn_scratch = gpu.buffer(
            gdn::scratch_bytes(&gdn_shape(hp), gdn_chunks(r, max_seqs)).max(4),
            "gdn.scratch",
        )?;
        let attn_split = gpu.buffer(attn_split_elems(hp, max_seqs) * 4, "attn.split")?;
        let logit_rows = ((gpu.max_binding() / 4) as usize / hp.n_vocab).clamp(1, r);
        let d = Dims::new(hp, r, logit_rows);
        Ok(Scratch {
            rows: r,
            ids: f(d.ids, "ids")?,
            pos: f(d.pos, "pos")?,
            kv_rows: f(d.kv_rows, "kv_rows")?,
            ranges: f(d.ranges, "ranges")?,
            x: f(d.x, "x")?,
            h: f(d.h, "h")?,
            proj: f(d.proj, "proj")?,
            qkv: f(d.qkv, "qkv")?,
            z: f(d.z, "z")?,
            o: f(d.o, "o")?,
            qg: f(d.qg, "qg")?,
            k: f(d.k, "k")?,
            att: f(d.att, "att")?,
            att_g: f(d.att_g, "att_g")?,
            f_gate: f(d.f_gate, "f_gate")?,
            f_up: f(d.f_up, "f_up")?,
            moe_out: f(d.moe_out, "moe_out")?,
            moe_ids: f(d.moe_ids, "moe_ids")?,
            moe_w: f(d.moe_w, "moe_w")?,
            sh_out: f(d.sh_out, "sh_out")?,
            route: match &hp.moe {
                Some(m) => Some(MoeRoute::new(
                    gpu,
                    m.n_expert as u32,
                    (r * m.n_used) as u32,
                )?),
                None => None,
            },
            gdn_scratch,
            batch,
            attn_split,
            logits: f(d.logits, "logits")?,
            logit_rows,
            top: topk::LogitsTop::new(gpu, r as u32, hp.n_vocab as u32)?,
        })
    }

    /// Bytes [`Scratch::new`] allocates for `rows` rows and `max_seqs` sequences, counting
    /// logits for every row (the binding limit may hold fewer): the activation part of
    /// [`needs`]. The one-sequence GDN batch table (16 bytes) is left out.
    fn bytes(hp: &Hparams, rows: usize, max_seqs: usize) -> u64 {
        let route = hp.moe.as_ref().map_or(0, |m| {
            MoeRoute::bytes(m.n_expert as u32, (rows * m.n_used) as u32)
        });
        Dims::new(hp, rows, rows).bytes()
            + gdn::scratch_bytes(&gdn_shape(hp), gdn_chunks(rows, max_seqs)).max(4)
            + attn_split_elems(hp, max_seqs) * 4
            + route
            + topk::LogitsTop::bytes(rows as u32, hp.n_vocab as u32)
    }
}

/// What a Qwen3.5-family model needs beside its weights for `run` (the planner's budget
/// input, `lathe plan` and the loader alike): KV rows of the attention layers, the GDN
/// layers' recurrent and conv state (as [`Pools`] allocates them), and [`Scratch::bytes`].
/// `KvType::Auto` is f16 here, as the loader picks.
pub fn needs(hp: &Hparams, run: RunShape) -> Needs {
    let seqs = run.seqs.max(1);
    let kv_elem: u64 = if run.kv == KvType::F32 { 4 } else { 2 };
    let n_attn = hp.recurrent.iter().filter(|r| !**r).count() as u64;
    let n_gdn = hp.recurrent.len() as u64 - n_attn;
    let kv_per_token = n_attn * 2 * (hp.n_head_kv * hp.head_dim) as u64 * kv_elem;
    // f32 recurrent state [Hv, dk, dv] and the conv's last K-1 inputs per GDN layer.
    let state = n_gdn
        * 4
        * ((hp.n_v_heads * hp.d_k * hp.d_v) as u64
            + (hp.conv_kernel.saturating_sub(1) * hp.conv_dim()) as u64);
    Needs {
        kv_per_token: kv_per_token * seqs,
        state: state * seqs,
        activations: Scratch::bytes(hp, run.batch.max(1) as usize, seqs as usize),
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
    fn forward_batch(&mut self, items: &mut [(&mut Seq, &[u32], Want)]) -> Result<Vec<Logits>> {
        let mut v: Vec<(&mut GpuSeq, &[u32], Want)> = Vec::with_capacity(items.len());
        for (s, t, w) in items.iter_mut() {
            v.push((s.get_mut()?, *t, *w));
        }
        GpuModel::forward_batch(self, &mut v)
    }
    fn forward(&mut self, seq: &mut Seq, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        GpuModel::forward(self, seq.get_mut()?, tokens, all)
    }
    fn profile(&mut self, seq: &mut Seq, tokens: &[u32]) -> Result<Vec<(String, f64)>> {
        // The step a greedy generation takes: argmax on the GPU, a few bytes back.
        let s = seq.get_mut()?;
        self.profile = Some(Vec::new());
        let r = GpuModel::forward_batch(self, &mut [(s, tokens, GREEDY)]);
        let prof = self.profile.take().unwrap_or_default();
        r.map(|_| prof)
    }
    fn offload(&self) -> Option<&Offload> {
        self.offload.as_ref()
    }
    fn routed_experts(&self) -> usize {
        self.hp
            .moe
            .as_ref()
            .map_or(0, |p| self.n_moe_layers() * p.n_expert)
    }
    fn max_context(&self) -> Option<usize> {
        Some(self.max_positions())
    }
}
