//! The cold path of MoE layers: routed experts without an arena slot, computed on the CPU
//! with rayon straight from their stored bytes (`quant::dot` per row: no dequantised copy of
//! any expert; DeepSeek's block-scaled release experts are repacked a task's rows at a time,
//! see `moe::layout`), while the GPU runs the hot experts.
//!
//! Each expert is a gated FFN `y = down(act(g) ⊙ u)`, `g = gate·x`, `u = up·x` ([`Glu`]):
//! SwiGLU with DeepSeek-V4's optional clamp (model.py `Expert.forward`): `g ← min(g, limit)`,
//! `u ← clamp(u, −limit, limit)`; or Gemma's GeGLU (tanh GELU). The activation runs in f32
//! as the GPU's `swiglu` / `geglu` do.
//!
//! Work is grouped by expert: all pairs of one expert (a prefill batch's tokens) go through
//! each of its rows at once (`quant::dot_many`: each block decoded once for up to 16 tokens,
//! results equal to `quant::dot` per token bit for bit, so grouping never shows), and every
//! chosen cold expert is read from memory once per call. Parallel tasks are (expert, block of
//! rows) sized by multiply-adds ([`TASK_WORK`]), over all experts at once, so a decode step
//! with a few cold experts still spreads over every core.
//!
//! Output rows are per PAIR, in the order of `pairs`; the caller puts row c at its (token,
//! top-k slot) position and the fixed-order sum of `moe/mod.rs` ("Summation contract") adds
//! them. [`combine_slots`] is that sum on the CPU.

use super::q8dot::{self, Q8Row, Q8Rows};
use super::simd::SimdLevel;
use crate::quant;
use crate::tensor::MatShape;
use crate::{Error, Result};
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::Range;

/// The three matrices of a SwiGLU expert: `down(silu(gate·x) ⊙ up·x)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Gate,
    Up,
    Down,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Gate, Kind::Up, Kind::Down];
    pub fn name(self) -> &'static str {
        match self {
            Kind::Gate => "gate",
            Kind::Up => "up",
            Kind::Down => "down",
        }
    }
}

/// The gated activation of an expert FFN: `act(g) ⊙ u`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Glu {
    /// `silu(g) ⊙ u`, with DeepSeek-V4's clamp `limit` when given.
    Swiglu(Option<f32>),
    /// `min(silu(g), limit) ⊙ clamp(u, ±limit)`: Step-3.5/3.7's clamp, after SiLU
    /// (`ops::swiglu_act_clamp`).
    SwigluActClamp(f32),
    /// `gelu_tanh(g) ⊙ u` (Gemma's experts, HF `Gemma4TextExperts`).
    GegluTanh,
}

impl Glu {
    #[inline]
    fn apply(self, g: f32, u: f32) -> f32 {
        match self {
            Glu::Swiglu(limit) => swiglu(g, u, limit),
            Glu::SwigluActClamp(l) => {
                let s = g / (1.0 + (-g).exp());
                s.min(l) * u.clamp(-l, l)
            }
            Glu::GegluTanh => super::ops::gelu_tanh(g) * u,
        }
    }
}

/// The activations the cold experts' products take: as the GPU's products of the same
/// weights take them, so results do not depend on where an expert runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activations {
    /// f32 activations (the GPU's default).
    #[default]
    F32,
    /// x and the SwiGLU output quantized per 32 values as the GPU's `quantize_x` does
    /// (`cpu::q8x`), integer dots (`cpu::q8dot`) for the weight types that have one there and
    /// on the GPU; other types keep f32 (as on the GPU).
    Int8,
}

/// How the cold path computes: activations and instruction set, picked once at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColdOptions {
    pub activations: Activations,
    /// The kernels' level (`SimdLevel::detect()` unless forced by `--cpu-simd`; must be one
    /// the CPU has). The f32 dots have a scalar and an AVX2 form (AVX-512 levels run the AVX2
    /// one): they differ by f32 rounding only. The int8 dots give the same bits at every level.
    pub simd: SimdLevel,
}

impl Default for ColdOptions {
    fn default() -> Self {
        ColdOptions {
            activations: Activations::F32,
            simd: SimdLevel::detect(),
        }
    }
}

impl ColdOptions {
    /// Whether `dtype`'s products take int8 activations.
    fn int8(&self, dtype: crate::DType) -> bool {
        self.activations == Activations::Int8 && q8dot::supported(dtype)
    }

    /// `out[t] = row · x_t` for the tokens `f` (f32 rows), or `q` (the same rows as int8
    /// blocks) when `dtype` takes int8 activations.
    fn dots(
        &self,
        dtype: crate::DType,
        row: &[u8],
        f: &[&[f32]],
        q: &[Q8Row<'_>],
        out: &mut [f32],
    ) {
        if self.int8(dtype) {
            q8dot::dot_many(self.simd, dtype, row, q, out);
        } else if self.simd == SimdLevel::Scalar {
            quant::dot_many_portable(dtype, row, f, out);
        } else {
            quant::dot_many(dtype, row, f, out);
        }
    }
}

/// One routed (token, expert) pair computed on the CPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ColdPair {
    /// Row of the batch.
    pub token: u32,
    /// Top-k position (0..n_used): where the output goes in the fixed-order sum.
    pub slot: u32,
    pub expert: u32,
    /// Scale of the output row: 1 when the GPU applies the router weight in its combine
    /// (the summation contract of `moe/mod.rs`); the router weight for a CPU-only sum.
    pub weight: f32,
}

/// One MoE layer's routed experts as [`expert_rows`] reads them; `moe::ExpertWeights`
/// (rows borrowed from the mapped file, or repacked from a release's block-scaled tensors)
/// is the one the offload passes.
pub trait Experts: Sync {
    /// Model layer (for error messages).
    fn layer(&self) -> usize;
    fn n_expert(&self) -> usize;
    /// Shape of every expert's `kind` matrix.
    fn shape(&self, kind: Kind) -> MatShape;
    /// Rows `r0..r0 + n` of expert `e`'s `kind` matrix in `shape(kind).dtype`.
    fn rows(&self, kind: Kind, e: usize, r0: usize, n: usize) -> Result<Cow<'_, [u8]>>;
}

/// Multiply-adds per rayon task: 64 K, e.g. 32 rows × 2048 for one token or 4 rows × 2048 ×
/// 8 tokens in a prefill. About 10-30 µs with `quant::dot`'s AVX2 kernels (0.1-0.2 ns per
/// weight and token on one core, `examples/cpu_moe_bench.rs`), well above rayon's ~1 µs per
/// task, and small enough that a decode step's 8 cold experts make 128 gate/up tasks (512 rows
/// of 2048) and 256 down tasks (2048 rows of 512): 8+ per core on 16 cores.
const TASK_WORK: usize = 1 << 16;

/// Rows per task for `cols`-wide rows shared by `n_pairs` tokens: [`TASK_WORK`]
/// multiply-adds, 4 to 64 rows (block-scaled release experts repack per task).
fn rows_per_task(cols: usize, n_pairs: usize) -> usize {
    (TASK_WORK / (cols * n_pairs).max(1)).clamp(4, 64)
}

/// Keeps rayon's worker threads but two spinning, awake, until dropped (or `most` has passed): a
/// decode step's cold experts are a few hundred microseconds of work after a wait of about
/// as long for the GPU, and a worker that went to sleep in that wait takes tens of
/// microseconds to wake for each of the two parallel phases. Start it when the wait
/// begins, drop it when the inputs are there (llama.cpp's CPU threadpool spins the same way
/// between graph nodes). Spinning workers run any job that arrives meanwhile
/// (`rayon::yield_now`), so another user of the pool (a second device's offload) is not
/// held up by the spin.
pub struct Warm {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Warm {
    pub fn start(most: std::time::Duration) -> Warm {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        rayon::spawn_broadcast(move |ctx| {
            // two threads never spin: the host thread waiting on the GPU's fence (and the
            // driver's) must find a free core when it wakes. With every worker spinning, the
            // H200 host (16 cores) woke late for 11 of 40 MoE layers, at the 2 ms cap each.
            if ctx.index() + 2 >= ctx.num_threads() {
                return;
            }
            let t0 = std::time::Instant::now();
            while !s.load(Ordering::Relaxed) && t0.elapsed() < most {
                if rayon::yield_now() != Some(rayon::Yield::Executed) {
                    std::hint::spin_loop();
                }
            }
        });
        Warm { stop }
    }
}

impl Drop for Warm {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Tokens whose per-task up-projection results live on the stack.
const STACK_PAIRS: usize = 16;

thread_local! {
    /// The caller's scratch (`act`, `act_t`, `y`), kept between calls: a prefill's 32 MB `y`
    /// would otherwise be fresh zeroed pages, faulted in on every layer.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[inline]
fn swiglu(g: f32, u: f32, limit: Option<f32>) -> f32 {
    let (g, u) = match limit {
        Some(l) => (g.min(l), u.clamp(-l, l)),
        None => (g, u),
    };
    g / (1.0 + (-g).exp()) * u
}

/// Pairs grouped by expert: pair indices ordered by (expert, token, index), and per group
/// (expert, range of that order).
fn group_by_expert(pairs: &[ColdPair]) -> (Vec<usize>, Vec<(usize, Range<usize>)>) {
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    order.sort_by_key(|&q| (pairs[q].expert, pairs[q].token, q));
    let mut groups: Vec<(usize, Range<usize>)> = Vec::new();
    for (i, &q) in order.iter().enumerate() {
        let e = pairs[q].expert as usize;
        match groups.last_mut() {
            Some((ge, r)) if *ge == e => r.end = i + 1,
            _ => groups.push((e, i..i + 1)),
        }
    }
    (order, groups)
}

/// Split `buf` into per-group regions of `rows · n_pairs(g)` and those into tasks of
/// [`rows_per_task`] rows: (group, first row, chunk laid out [row][pair]).
fn tasks<'b>(
    buf: &'b mut [f32],
    groups: &[(usize, Range<usize>)],
    rows: usize,
    cols: usize,
) -> Vec<(usize, usize, &'b mut [f32])> {
    let mut out = Vec::new();
    let mut rest = buf;
    for (gi, (_, r)) in groups.iter().enumerate() {
        let np = r.len();
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(rows * np);
        rest = tail;
        let rpt = rows_per_task(cols, np);
        for (ci, chunk) in mine.chunks_mut(rpt * np).enumerate() {
            out.push((gi, ci * rpt, chunk));
        }
    }
    out
}

/// Cold expert outputs: row c of `out` (`[pairs.len(), n_embd]`) becomes
/// `pairs[c].weight · FFN_{pairs[c].expert}(x[pairs[c].token])`, where `x` is
/// `[n_tokens, n_embd]` f32 (the normed FFN input rows of the batch).
///
/// Errors (nothing written) when `x` or `out` do not match `n_embd` and the pairs, a pair
/// names a token or expert out of range, or a block-scaled expert's scales cannot be
/// repacked. Any stored type `quant::dot` reads works (block-scaled release experts arrive as
/// MXFP4 or `F8_E4M3_B128` rows, repacked per task of [`rows_per_task`] rows). f32
/// activations at the CPU's widest level; [`expert_rows_with`] chooses.
pub fn expert_rows(
    w: &(impl Experts + ?Sized),
    x: &[f32],
    pairs: &[ColdPair],
    limit: Option<f32>,
    out: &mut [f32],
) -> Result<()> {
    expert_rows_with(w, x, pairs, limit, &ColdOptions::default(), out)
}

/// [`expert_rows`] with the activations and SIMD level of `opts`. With int8 activations
/// the products of the types `cpu::q8dot` has take x quantized per token, and the down
/// projection the SwiGLU output quantized per pair, as the GPU's int8 path quantizes them.
pub fn expert_rows_with(
    w: &(impl Experts + ?Sized),
    x: &[f32],
    pairs: &[ColdPair],
    limit: Option<f32>,
    opts: &ColdOptions,
    out: &mut [f32],
) -> Result<()> {
    expert_rows_glu(w, x, pairs, Glu::Swiglu(limit), opts, out)
}

/// [`expert_rows_with`] for experts of any gated activation `glu`.
pub fn expert_rows_glu(
    w: &(impl Experts + ?Sized),
    x: &[f32],
    pairs: &[ColdPair],
    glu: Glu,
    opts: &ColdOptions,
    out: &mut [f32],
) -> Result<()> {
    let (gs, us, ds) = (w.shape(Kind::Gate), w.shape(Kind::Up), w.shape(Kind::Down));
    let (e_dim, ff) = (gs.cols as usize, gs.rows as usize);
    let layer = w.layer();
    if e_dim == 0 || !x.len().is_multiple_of(e_dim) {
        return Err(Error::Invalid(format!(
            "moe layer {layer}: {} activations are not rows of {e_dim}",
            x.len()
        )));
    }
    if out.len() != pairs.len() * e_dim {
        return Err(Error::Invalid(format!(
            "moe layer {layer}: output of {} floats for {} pairs of {e_dim}",
            out.len(),
            pairs.len()
        )));
    }
    let n_tokens = x.len() / e_dim;
    if let Some(p) = pairs
        .iter()
        .find(|p| p.token as usize >= n_tokens || p.expert as usize >= w.n_expert())
    {
        return Err(Error::Invalid(format!(
            "moe layer {layer}: pair {p:?} out of range ({n_tokens} tokens, {} experts)",
            w.n_expert()
        )));
    }
    if !opts.simd.supported() {
        return Err(Error::Invalid(format!(
            "moe layer {layer}: this CPU lacks {}",
            opts.simd
        )));
    }
    if pairs.is_empty() {
        return Ok(());
    }
    let (order, groups) = group_by_expert(pairs);
    let total_pairs = pairs.len();
    // The pairs' x rows in group order: group g's tokens are `xs[range(g)]`.
    let xs: Vec<&[f32]> = order
        .iter()
        .map(|&q| {
            let t = pairs[q].token as usize;
            &x[t * e_dim..(t + 1) * e_dim]
        })
        .collect();
    // The same rows as int8 blocks, quantized once per token, when gate or up takes them.
    let xq = (opts.int8(gs.dtype) || opts.int8(us.dtype)).then(|| Q8Rows::quantize(x, e_dim));
    let xqs: Vec<Q8Row<'_>> = xq.as_ref().map_or(Vec::new(), |q| {
        order
            .iter()
            .map(|&p| q.row(pairs[p].token as usize))
            .collect()
    });

    let mut scratch = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    let need = 2 * ff * total_pairs + e_dim * total_pairs;
    if scratch.len() < need {
        scratch.resize(need, 0.0);
    }
    // act [ff, n_pairs(g)] per group, act_t [n_pairs(g), ff] per group, y [n_embd, n_pairs(g)]
    // per group: each fully written below before it is read.
    let (act, rest) = scratch[..need].split_at_mut(ff * total_pairs);
    let (act_t, y) = rest.split_at_mut(ff * total_pairs);

    // Phase 1: act = glu(gate·x, up·x), each row read once for all of its group's tokens.
    let (gd, ud) = (gs.dtype, us.dtype);
    let (gb, ub) = (gs.row_bytes() as usize, us.row_bytes() as usize);
    tasks(act, &groups, ff, e_dim)
        .into_par_iter()
        .try_for_each(|(gi, r0, chunk)| -> Result<()> {
            let (e, range) = &groups[gi];
            let gx = &xs[range.clone()];
            let gq = xqs.get(range.clone()).unwrap_or(&[]);
            let np = gx.len();
            let n = chunk.len() / np;
            // The task's rows (repacked here for block-scaled release experts).
            let (g, u) = (w.rows(Kind::Gate, *e, r0, n)?, w.rows(Kind::Up, *e, r0, n)?);
            let (mut up_stack, mut up_heap) = ([0f32; STACK_PAIRS], Vec::new());
            let up: &mut [f32] = if np <= STACK_PAIRS {
                &mut up_stack[..np]
            } else {
                up_heap.resize(np, 0.0);
                &mut up_heap
            };
            for (i, row_out) in chunk.chunks_mut(np).enumerate() {
                let (gr, ur) = (&g[i * gb..(i + 1) * gb], &u[i * ub..(i + 1) * ub]);
                opts.dots(gd, gr, gx, gq, row_out);
                opts.dots(ud, ur, gx, gq, up);
                for (o, &uv) in row_out.iter_mut().zip(up.iter()) {
                    *o = glu.apply(*o, uv);
                }
            }
            Ok(())
        })?;

    // Each pair's activation vector contiguous for the down rows: [n_pairs(g), ff] per group.
    let mut base = 0;
    for (_, r) in &groups {
        let n = r.len();
        for rr in 0..ff {
            for j in 0..n {
                act_t[base + j * ff + rr] = act[base + rr * n + j];
            }
        }
        base += ff * n;
    }
    // Per pair in group order: its activation vector.
    let acts: Vec<&[f32]> = act_t.chunks(ff).collect();
    let aq = opts.int8(ds.dtype).then(|| Q8Rows::quantize(act_t, ff));
    let aqs: Vec<Q8Row<'_>> = aq
        .as_ref()
        .map_or(Vec::new(), |q| (0..q.rows()).map(|i| q.row(i)).collect());

    // Phase 2: y [n_embd, n_pairs(g)] per group = down · act.
    let dd = ds.dtype;
    let db = ds.row_bytes() as usize;
    tasks(y, &groups, e_dim, ff)
        .into_par_iter()
        .try_for_each(|(gi, r0, chunk)| -> Result<()> {
            let (e, range) = &groups[gi];
            let ga = &acts[range.clone()];
            let gq = aqs.get(range.clone()).unwrap_or(&[]);
            let d = w.rows(Kind::Down, *e, r0, chunk.len() / ga.len())?;
            for (i, row_out) in chunk.chunks_mut(ga.len()).enumerate() {
                opts.dots(dd, &d[i * db..(i + 1) * db], ga, gq, row_out);
            }
            Ok(())
        })?;

    // Scatter to pair rows with their weights.
    let mut base = 0;
    for (_, r) in &groups {
        let n = r.len();
        for (j, &q) in order[r.clone()].iter().enumerate() {
            let wgt = pairs[q].weight;
            let o = &mut out[q * e_dim..(q + 1) * e_dim];
            for (rr, v) in o.iter_mut().enumerate() {
                *v = wgt * y[base + rr * n + j];
            }
        }
        base += e_dim * n;
    }
    SCRATCH.with(|s| *s.borrow_mut() = scratch);
    Ok(())
}

/// The fixed-order routed sum on the CPU: `out[t] += Σ_s w[t,s] · y[t,s]`, s ascending, one
/// multiply-add per slot as the GPU's combine (`moe_combine`) does. `y` is `[n_tokens, n_used,
/// n_embd]` unweighted expert outputs, `w` `[n_tokens, n_used]`, `out` `[n_tokens, n_embd]`.
#[track_caller]
pub fn combine_slots(out: &mut [f32], y: &[f32], w: &[f32], n_used: usize) {
    let n_tokens = w.len() / n_used.max(1);
    let e = out.len() / n_tokens.max(1);
    assert_eq!(w.len(), n_tokens * n_used, "combine_slots: weights");
    assert_eq!(out.len(), n_tokens * e, "combine_slots: output");
    assert_eq!(y.len(), n_tokens * n_used * e, "combine_slots: expert rows");
    for t in 0..n_tokens {
        let o = &mut out[t * e..(t + 1) * e];
        for s in 0..n_used {
            let ws = w[t * n_used + s];
            let yr = &y[(t * n_used + s) * e..(t * n_used + s + 1) * e];
            for (ov, &yv) in o.iter_mut().zip(yr) {
                *ov += ws * yv;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Work submitted while the workers spin runs at once, and dropping `Warm` lets them go
    /// long before its limit.
    #[test]
    fn warm_workers_take_work_and_stop_when_dropped() {
        let most = Duration::from_secs(20);
        let t0 = Instant::now();
        let warm = Warm::start(most);
        let sum: u64 = (0..1000u64).into_par_iter().map(|i| i * i).sum();
        assert_eq!(sum, 332_833_500);
        drop(warm);
        // every worker must be free again to run this
        rayon::broadcast(|_| ());
        assert!(
            t0.elapsed() < most / 4,
            "workers held for {:?}",
            t0.elapsed()
        );
    }
}
