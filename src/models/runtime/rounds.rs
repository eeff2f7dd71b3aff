//! The batch round scheduler every family's GPU forward runs: the items of a batch (each a
//! sequence, its new tokens and what it wants back) are fed in rounds of at most `rows`
//! rows shared by all items, multi-token parts first and single tokens after (so a long
//! prefill is split into chunks and the decode steps of other items never wait longer than
//! a chunk). A family runs one round's pass; the scheduler plans the rounds, says which
//! rows' logits come back, and hands each item what it asked for.
//!
//! One rule for positions: a sequence's position advances when a round that fed it has run
//! (its KV rows, recurrent and compressor state were written by that round), so after an
//! error in a later round the position still names exactly the state on the GPU. Every
//! part of a chain plans the same rounds from the same items (token counts and positions
//! only), so the rounds line up across devices.

use crate::forward::{Logits, Want};
use crate::gpu::topk::TopLogits;
use crate::models::{Seq, SeqState};
use crate::{Error, Result};

/// One round's share of a batch item: rows `row .. row + n` of the pass.
#[derive(Clone, Copy, Debug)]
pub struct Part {
    /// The item (sequence) of the batch.
    pub item: usize,
    /// Its first token in this round, and how many.
    pub start: usize,
    pub n: usize,
    /// Its first row in the pass.
    pub row: usize,
    /// The position of its first token.
    pub pos0: usize,
    /// Each row attends as a one-token decode step at its position (a single token, or
    /// every row of a row-wise call).
    pub rowwise: bool,
    /// Its sequence's slot in the state pools.
    pub slot: u32,
}

/// The rows of a pass whose best logits come back ([`Want::Top`]), one `k` (the largest
/// asked) and whether any item wants the log-sum-exp.
#[derive(Default)]
pub struct TopReq {
    pub k: u32,
    pub lse: bool,
    pub rows: Vec<usize>,
}

/// A sequence the scheduler feeds: its slot in the state pools, and its position
/// ([`SeqState::pos`]) set when a round has fed it.
pub trait RoundSeq: SeqState {
    fn slot(&self) -> u32;
    fn set_pos(&mut self, pos: usize);
}

/// One round to run: its parts, their tokens in row order, the row runs `(first row,
/// rows)` whose full logits come back, and the top rows.
pub struct Round {
    pub parts: Vec<Part>,
    pub toks: Vec<u32>,
    pub wants: Vec<(usize, usize)>,
    pub top: TopReq,
}

/// What a round's pass returns: the logits of the `wants` runs (packed, `[rows, vocab]`)
/// and the top logits of the top rows, in order.
pub type RoundOut = (Vec<f32>, Vec<TopLogits>);

/// Feed `items` in rounds of at most `rows_max` rows, each run by `round`. `last`: this
/// device part runs the head (a part that is not the last hands its residual stream on
/// and wants no logits). With `rowwise` every row attends as a one-token decode step and
/// a [`Want::Top`] item gets the best logits of every row (one entry per row); otherwise
/// (and for other wants) one entry per item.
pub fn run_rounds<S: RoundSeq>(
    items: &mut [(&mut S, &[u32], Want)],
    n_vocab: usize,
    rows_max: usize,
    last: bool,
    rowwise: bool,
    mut round: impl FnMut(&Round) -> Result<RoundOut>,
) -> Result<Vec<Vec<Logits>>> {
    check_items(items, n_vocab)?;
    let v = n_vocab;
    // One k for every Top item (the largest); each item keeps its own k of it.
    let mut top = TopReq::default();
    for (_, _, w) in items.iter() {
        if let Want::Top { k, lse } = *w {
            top.k = top.k.max(k);
            top.lse |= lse;
        }
    }
    let mut out: Vec<Vec<Logits>> = items
        .iter()
        .map(|(_, _, w)| match w {
            Want::Top { .. } => Vec::new(),
            _ => vec![Logits::Full(Vec::new())],
        })
        .collect();
    let mut done: Vec<usize> = vec![0; items.len()];
    loop {
        // One round: multi-token parts first, single tokens after (one batched decode
        // attention call covers those).
        let mut parts = Vec::new();
        let mut rows = 0;
        for single in [false, true] {
            for (i, (seq, toks, _)) in items.iter().enumerate() {
                let left = toks.len() - done[i];
                if left == 0 || (left == 1) != single || rows == rows_max {
                    continue;
                }
                let n = left.min(rows_max - rows);
                parts.push(Part {
                    item: i,
                    start: done[i],
                    n,
                    row: rows,
                    pos0: seq.pos(),
                    rowwise: rowwise || n == 1,
                    slot: seq.slot(),
                });
                rows += n;
            }
        }
        if parts.is_empty() {
            break;
        }
        // A part that is not the last hands its residual stream on instead of logits.
        let ends = |p: &Part| p.start + p.n == items[p.item].1.len();
        let wants: Vec<(usize, usize)> = parts
            .iter()
            .filter(|_| last)
            .filter_map(|p| match items[p.item].2 {
                Want::All => Some((p.row, p.n)),
                Want::Last if ends(p) => Some((p.row + p.n - 1, 1)),
                _ => None,
            })
            .collect();
        top.rows = parts
            .iter()
            .filter(|p| last && matches!(items[p.item].2, Want::Top { .. }))
            .flat_map(|p| {
                if rowwise {
                    p.row..p.row + p.n
                } else if ends(p) {
                    p.row + p.n - 1..p.row + p.n
                } else {
                    0..0
                }
            })
            .collect();
        let toks: Vec<u32> = parts
            .iter()
            .flat_map(|p| items[p.item].1[p.start..p.start + p.n].iter().copied())
            .collect();
        let r = Round {
            parts,
            toks,
            wants,
            top,
        };
        let (logits, tops) = round(&r)?;
        let Round {
            parts,
            wants,
            top: t,
            ..
        } = r;
        top = t;
        // A wanted row is `n_vocab` logits, or `n_embd` hidden values (`Forward::hidden_out`).
        let total: usize = wants.iter().map(|w| w.1).sum();
        let v = match total {
            0 => v,
            t => logits.len() / t,
        };
        let mut off = 0;
        let mut tops = tops.into_iter();
        for p in &parts {
            items[p.item].0.set_pos(p.pos0 + p.n);
            let got = wants
                .iter()
                .find(|w| w.0 >= p.row && w.0 < p.row + p.n)
                .map(|w| w.1);
            if let (Some(nw), Some(Logits::Full(o))) = (got, out[p.item].first_mut()) {
                o.extend_from_slice(&logits[off * v..(off + nw) * v]);
                off += nw;
            }
            for r in p.row..p.row + p.n {
                if !top.rows.contains(&r) {
                    continue;
                }
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
                out[p.item].push(Logits::Top(t));
            }
            done[p.item] += p.n;
        }
    }
    Ok(out)
}

/// A batch of [`Seq`]s as the family's own sequences `S` (an error for a sequence of
/// another model): what every family's `Forward::forward_batch` hands its scheduler.
pub fn own_items<'s, 't, S: SeqState>(
    items: &'s mut [(&mut Seq, &'t [u32], Want)],
) -> Result<Vec<(&'s mut S, &'t [u32], Want)>> {
    items
        .iter_mut()
        .map(|(s, t, w)| Ok((s.get_mut::<S>()?, *t, *w)))
        .collect()
}

/// Every item's want, and its tokens against the vocabulary, before anything runs.
pub fn check_items<S>(items: &[(&mut S, &[u32], Want)], n_vocab: usize) -> Result<()> {
    for (_, toks, want) in items {
        crate::forward::check_want(*want)?;
        if let Some(&bad) = toks.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary of {n_vocab}"
            )));
        }
    }
    Ok(())
}

/// [`run_rounds`] without row-wise attention: one [`Logits`] per item (an empty one for an
/// item that wanted none).
pub fn run_batch<S: RoundSeq>(
    items: &mut [(&mut S, &[u32], Want)],
    n_vocab: usize,
    rows_max: usize,
    last: bool,
    round: impl FnMut(&Round) -> Result<RoundOut>,
) -> Result<Vec<Logits>> {
    let out = run_rounds(items, n_vocab, rows_max, last, false, round)?;
    Ok(out
        .into_iter()
        .map(|mut v| v.pop().unwrap_or(Logits::Full(Vec::new())))
        .collect())
}
