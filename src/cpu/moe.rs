//! The cold path of MoE layers: routed experts without an arena slot, computed on the CPU
//! with rayon straight from their stored bytes (`quant::dot` per row: no dequantised copy of
//! any expert), while the GPU runs the hot experts.
//!
//! Each expert is a SwiGLU FFN `y = down(silu(g) ⊙ u)`, `g = gate·x`, `u = up·x`, with
//! DeepSeek-V4's optional clamp (model.py `Expert.forward`): `g ← min(g, limit)`,
//! `u ← clamp(u, −limit, limit)`. The activation runs in f32 as the GPU's `swiglu` does.
//!
//! Work is grouped by expert: all pairs of one expert (a prefill batch's tokens) go through
//! each of its rows while the row is in cache, so every chosen cold expert is read from
//! memory once per call. Parallel tasks are (expert, block of rows), over all experts at
//! once, so a decode step with a few cold experts still spreads over every core.
//!
//! Output rows are per PAIR, in the order of `pairs`; the caller puts row c at its (token,
//! top-k slot) position and the fixed-order sum of `moe/mod.rs` ("Summation contract") adds
//! them. [`combine_slots`] is that sum on the CPU.

use crate::moe::{ColdPair, ExpertWeights};
use crate::quant;
use crate::{Error, Result};
use rayon::prelude::*;

/// Rows of one matrix per rayon task: ~32 rows × 2048 weights ≈ 25-40 µs of `quant::dot`
/// per task (0.3-0.5 ns per weight, `quant::dot`'s doc), well above rayon's overhead and
/// small enough that a decode step's 8 cold experts × 512 rows make 128+ tasks.
const ROWS_PER_TASK: usize = 32;

#[inline]
fn swiglu(g: f32, u: f32, limit: Option<f32>) -> f32 {
    let (g, u) = match limit {
        Some(l) => (g.min(l), u.clamp(-l, l)),
        None => (g, u),
    };
    g / (1.0 + (-g).exp()) * u
}

/// Pairs grouped by expert: (expert, pair indices).
fn group_by_expert(pairs: &[ColdPair]) -> Vec<(usize, Vec<usize>)> {
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    order.sort_by_key(|&q| (pairs[q].expert, pairs[q].token, q));
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    for q in order {
        let e = pairs[q].expert as usize;
        match groups.last_mut() {
            Some((ge, v)) if *ge == e => v.push(q),
            _ => groups.push((e, vec![q])),
        }
    }
    groups
}

/// Split `buf` into per-group regions of `rows · n_pairs(g)` and those into tasks of
/// [`ROWS_PER_TASK`] rows: (group, first row, chunk laid out [row][pair]).
fn tasks<'b>(
    buf: &'b mut [f32],
    groups: &[(usize, Vec<usize>)],
    rows: usize,
) -> Vec<(usize, usize, &'b mut [f32])> {
    let mut out = Vec::new();
    let mut rest = buf;
    for (gi, (_, qs)) in groups.iter().enumerate() {
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(rows * qs.len());
        rest = tail;
        for (ci, chunk) in mine.chunks_mut(ROWS_PER_TASK * qs.len()).enumerate() {
            out.push((gi, ci * ROWS_PER_TASK, chunk));
        }
    }
    out
}

/// Cold expert outputs: row c of `out` (`[pairs.len(), n_embd]`) becomes
/// `pairs[c].weight · FFN_{pairs[c].expert}(x[pairs[c].token])`, where `x` is
/// `[n_tokens, n_embd]` f32 (the normed FFN input rows of the batch).
///
/// Errors (nothing written) when `x` or `out` do not match `n_embd` and the pairs, or a pair
/// names a token or expert out of range.
pub fn expert_rows(
    w: &ExpertWeights<'_>,
    x: &[f32],
    pairs: &[ColdPair],
    limit: Option<f32>,
    out: &mut [f32],
) -> Result<()> {
    let (e_dim, ff) = (w.n_embd(), w.n_ff());
    let layer = w.layer;
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
    if pairs.is_empty() {
        return Ok(());
    }
    let groups = group_by_expert(pairs);
    let xrow = |t: u32| &x[t as usize * e_dim..(t as usize + 1) * e_dim];

    // Phase 1: act[g] [ff, n_pairs(g)] = swiglu(gate·x, up·x), read row by row.
    let total_pairs = pairs.len();
    let mut act = vec![0f32; ff * total_pairs];
    let (gd, ud) = (w.gate.shape.dtype, w.up.shape.dtype);
    tasks(&mut act, &groups, ff)
        .into_par_iter()
        .for_each(|(gi, r0, chunk)| {
            let (e, qs) = &groups[gi];
            for (i, row_out) in chunk.chunks_mut(qs.len()).enumerate() {
                let r = r0 + i;
                let (gr, ur) = (w.gate.row(*e, r), w.up.row(*e, r));
                for (o, &q) in row_out.iter_mut().zip(qs) {
                    let xt = xrow(pairs[q].token);
                    *o = swiglu(quant::dot(gd, gr, xt), quant::dot(ud, ur, xt), limit);
                }
            }
        });

    // Each pair's activation vector contiguous for the down rows: [n_pairs(g), ff] per group.
    let mut act_t = vec![0f32; ff * total_pairs];
    let mut base = 0;
    for (_, qs) in &groups {
        let n = qs.len();
        for r in 0..ff {
            for j in 0..n {
                act_t[base + j * ff + r] = act[base + r * n + j];
            }
        }
        base += ff * n;
    }

    // Phase 2: y[g] [n_embd, n_pairs(g)] = down · act.
    let mut y = vec![0f32; e_dim * total_pairs];
    let dd = w.down.shape.dtype;
    let offsets: Vec<usize> = groups
        .iter()
        .scan(0, |o, (_, qs)| {
            let cur = *o;
            *o += ff * qs.len();
            Some(cur)
        })
        .collect();
    tasks(&mut y, &groups, e_dim)
        .into_par_iter()
        .for_each(|(gi, r0, chunk)| {
            let (e, qs) = &groups[gi];
            let a = &act_t[offsets[gi]..offsets[gi] + ff * qs.len()];
            for (i, row_out) in chunk.chunks_mut(qs.len()).enumerate() {
                let dr = w.down.row(*e, r0 + i);
                for (j, o) in row_out.iter_mut().enumerate() {
                    *o = quant::dot(dd, dr, &a[j * ff..(j + 1) * ff]);
                }
            }
        });

    // Scatter to pair rows with their weights.
    let mut base = 0;
    for (_, qs) in &groups {
        let n = qs.len();
        for (j, &q) in qs.iter().enumerate() {
            let wgt = pairs[q].weight;
            let o = &mut out[q * e_dim..(q + 1) * e_dim];
            for (r, v) in o.iter_mut().enumerate() {
                *v = wgt * y[base + r * n + j];
            }
        }
        base += e_dim * n;
    }
    Ok(())
}

/// The fixed-order routed sum on the CPU: `out[t] += Σ_s w[t,s] · y[t,s]`, s ascending, one
/// multiply-add per slot as the GPU's per-slot `axpy_row` does. `y` is `[n_tokens, n_used,
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
