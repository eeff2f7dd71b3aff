//! The forward: passes shared by several sequences (each its own positions, window rings,
//! compressor stores and compressed caches), and the logits each sequence wants.
//!
//! Every product reads its weights once for all rows of a pass, and so does every kernel
//! that depends on a sequence's positions or state (RoPE, ring and store writes, pooling):
//! a row table ([`RowTabs`]) gives each row its position and its sequence's slot in the
//! state pools. A part of a pass is either a chunk (one index list and attention call over
//! its rows, as a prefill) or row-wise: each row attends exactly as a one-token decode step
//! at its position (its own index list, indexer top-k and split-K attention), and the
//! row-wise rows of all parts share one dispatch per kernel, so a verify pass of k + 1
//! rows, and every single-token row of a batch, has a decode step's bits at the dispatch
//! count of one row.

use super::*;

/// One sequence's rows in a pass.
#[derive(Clone, Copy, Debug)]
pub(super) struct Part {
    /// The item (sequence) of the batch.
    pub item: usize,
    /// Its first token in this pass, and how many.
    pub start: usize,
    pub n: usize,
    /// Its first row in the pass.
    pub row: usize,
    pub pos0: usize,
    /// Each row attends as a one-token decode step at its position.
    pub rowwise: bool,
    /// Its sequence's slot in the state pools.
    pub slot: u32,
}

/// Where the host tables of the rows of one [`GpuModel::attn_block`] call lie (offsets in
/// u32 elements): positions, slots and window-ring rows of every row, the windows each
/// compressor ratio completes, and the per-row attention descriptors of the row-wise rows
/// (`attention::Keys::Rows`) per layer kind. Row-wise parts come after the chunk parts.
pub(super) struct RowTabs {
    /// In `Scratch::tab`: positions [n] | slots [n] | ring rows [n].
    pub pos: u32,
    pub n: u32,
    /// Completed windows per ratio: (ratio, offset in `Scratch::tab`, count).
    wins: Vec<(usize, u32, u32)>,
    /// The row-wise rows are `rw0..n`.
    rw0: usize,
    descs: Vec<RowDesc>,
    /// In `Scratch::idx`: the index lists (after every group's descriptors).
    lists: u32,
}

/// The row-wise rows' attention of one layer kind (compress ratio, indexer).
struct RowDesc {
    ratio: usize,
    ix: bool,
    /// In `Scratch::idx`: (n_idx, n_split, split_len, list) per row.
    off: u32,
    /// Slots per row of the index lists; the most splits and indexer entries of a row.
    stride: u32,
    max_split: u32,
    n_ent: u32,
}

impl RowTabs {
    fn windows<'a>(&self, buf: &'a wgpu::Buffer, ratio: usize) -> compress::Windows<'a> {
        let &(_, off, n_win) = self
            .wins
            .iter()
            .find(|w| w.0 == ratio)
            .expect("the tables cover the group's ratios");
        compress::Windows { buf, off, n_win }
    }
    fn desc(&self, ratio: usize, ix: bool) -> &RowDesc {
        self.descs
            .iter()
            .find(|d| d.ratio == ratio && d.ix == ix)
            .expect("the tables cover the group's layer kinds")
    }
}

/// The output head a pass ends with (the model's, or a draft's first rows only, see
/// `Speculate::set_draft_vocab`) and the buffer its top-k goes to.
pub(super) struct HeadOut<'a> {
    /// [n_vocab, n_embd]
    pub w: &'a GpuTensor,
    pub top: &'a topk::LogitsTop,
    pub n_vocab: usize,
}

/// The rows of a pass whose best logits come back, and one `k` (the largest asked) for all.
#[derive(Default)]
pub(super) struct TopReq {
    pub k: u32,
    pub lse: bool,
    pub rows: Vec<usize>,
}

impl GpuModel {
    pub(super) fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
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
        Ok(self.forward_want(seq, tokens, want)?.into_full())
    }

    /// Feed `tokens`; returns what `want` asks for: every token's logits, the last one's,
    /// none, or the last one's best logits found on the GPU ([`Want::Top`]).
    pub fn forward_want(&mut self, seq: &mut GpuSeq, tokens: &[u32], want: Want) -> Result<Logits> {
        let mut out = self.forward_batch(&mut [(seq, tokens, want)])?;
        Ok(out.pop().unwrap_or(Logits::Full(Vec::new())))
    }

    /// Feed several sequences at once: each item's tokens are appended to its sequence, in
    /// passes of at most `DEFAULT_BATCH` rows shared by all items (a long prefill is split
    /// into chunks, so the decode steps of other items never wait longer than a chunk).
    /// Returns per item the logits it wants (`[n, vocab]` row-major), or for [`Want::Top`]
    /// the best logits of its last token.
    pub fn forward_batch(
        &mut self,
        items: &mut [(&mut GpuSeq, &[u32], Want)],
    ) -> Result<Vec<Logits>> {
        let out = self.forward_rows(items, false)?;
        Ok(out
            .into_iter()
            .map(|mut v| v.pop().unwrap_or(Logits::Full(Vec::new())))
            .collect())
    }

    /// [`Self::forward_batch`]; with `rowwise` every row attends as a one-token decode step
    /// at its position does, and a [`Want::Top`] item gets the best logits of every row
    /// (one entry per row; other wants one entry).
    pub(super) fn forward_rows(
        &mut self,
        items: &mut [(&mut GpuSeq, &[u32], Want)],
        rowwise: bool,
    ) -> Result<Vec<Vec<Logits>>> {
        for (_, t, w) in items.iter() {
            self.check_tokens(t)?;
            crate::forward::check_want(*w)?;
        }
        // Per wanted row: its logits, or its hidden state (`Forward::hidden_out`).
        let v = match self.hidden_out {
            true => self.hp.n_embd,
            false => self.hp.n_vocab,
        };
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
        let rows_max = self.scratch.rows;
        loop {
            // One pass: multi-token parts first, single tokens after.
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
                        pos0: seq.pos,
                        rowwise: rowwise || n == 1,
                        slot: seq.slot,
                    });
                    rows += n;
                }
            }
            if parts.is_empty() {
                break;
            }
            // A device part that is not the last hands its residual stream on instead.
            let last = self.part.last;
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
            let (logits, tops) = self.run_round(items, &parts, &toks, &wants, &top)?;
            let mut off = 0;
            let mut tops = tops.into_iter();
            for p in &parts {
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
                        Error::Gpu("the pass returned too few top-logits rows".into())
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

    /// The layer kind of layer `l` for the attention's key lists: (compress ratio, indexer).
    fn kind(&self, l: usize) -> (usize, bool) {
        (self.hp.compress_ratio[l], self.hp.has_indexer(l))
    }

    /// Build the row tables of one pass's [`Self::attn_block`] calls, `groups` of (parts,
    /// layers), write them (row tables and descriptors: before the pass is submitted) and
    /// grow the index-list, indexer-score and split scratch. Chunk parts must precede
    /// row-wise ones in each group; the compressed caches must be reserved first (their
    /// rows are in the tables).
    pub(super) fn row_tabs(&mut self, groups: &[(&[Part], &[usize])]) -> Result<Vec<RowTabs>> {
        let hp = &self.hp;
        let ks = kv_shape(self.kv_type, hp.head_dim);
        let nh = hp.n_head as u32;
        let (mut tab, mut descs) = (Vec::<u32>::new(), Vec::<u32>::new());
        let (mut list_len, mut scores, mut split) = (0usize, 0usize, 0u64);
        let mut out = Vec::with_capacity(groups.len());
        for &(parts, layers) in groups {
            let rows: Vec<(u32, u32)> = parts
                .iter()
                .flat_map(|p| (0..p.n).map(move |j| ((p.pos0 + j) as u32, p.slot)))
                .collect();
            let n = rows.len();
            let rw0 = parts.iter().find(|p| p.rowwise).map_or(n, |p| p.row);
            debug_assert!(parts.iter().all(|p| p.rowwise == (p.row >= rw0)));
            let pos = tab.len() as u32;
            tab.extend(rows.iter().map(|r| r.0));
            tab.extend(rows.iter().map(|r| r.1));
            tab.extend(
                rows.iter()
                    .map(|r| r.1 * self.ring as u32 + r.0 % self.ring as u32),
            );
            let mut kinds: Vec<(usize, bool)> = layers.iter().map(|&l| self.kind(l)).collect();
            kinds.sort_unstable();
            kinds.dedup();
            let mut wins = Vec::new();
            for &(ratio, _) in &kinds {
                if ratio == 0 || wins.iter().any(|w: &(usize, u32, u32)| w.0 == ratio) {
                    continue;
                }
                // Window w closes at position (w+1)·m − 1: those closing in each part.
                let done: Vec<(u32, u32)> = parts
                    .iter()
                    .flat_map(|p| {
                        let w0 = p.pos0 / ratio;
                        (w0..(p.pos0 + p.n) / ratio).map(move |w| (w as u32, p.slot))
                    })
                    .collect();
                let cap_e = self.pools.cap_e(ratio) as u32;
                wins.push((ratio, tab.len() as u32, done.len() as u32));
                tab.extend(compress::Windows::words(&done, cap_e));
            }
            // Chunk parts: one list (and score) row per token, its lists as long as the last
            // token's.
            for p in parts.iter().filter(|p| !p.rowwise) {
                let pos_end = p.pos0 + p.n;
                let n_win = hp.window.min(pos_end);
                for &l in layers {
                    list_len = list_len.max(p.n * (n_win + self.comp_slots(l, pos_end)));
                    if hp.has_indexer(l) {
                        scores = scores.max(p.n * (pos_end / hp.compress_ratio[l]));
                    }
                }
            }
            let mut row_descs = Vec::new();
            for &(ratio, ix) in kinds.iter().filter(|_| rw0 < n) {
                let l = *layers
                    .iter()
                    .find(|&&l| self.kind(l) == (ratio, ix))
                    .expect("kinds come from the layers");
                let lens: Vec<u32> = rows[rw0..]
                    .iter()
                    .map(|r| {
                        let pos_end = r.0 as usize + 1;
                        (hp.window.min(pos_end) + self.comp_slots(l, pos_end)) as u32
                    })
                    .collect();
                let stride = lens.iter().copied().max().unwrap_or(0);
                let off = descs.len() as u32;
                let mut max_split = 1;
                for (j, &n_idx) in lens.iter().enumerate() {
                    let (n_split, split_len) = attention::row_split(&self.gpu, nh, ks, n_idx)?;
                    max_split = max_split.max(n_split);
                    // The list offset is relative to the lists until they are placed.
                    descs.extend([n_idx, n_split, split_len, j as u32 * stride]);
                }
                let m = n - rw0;
                let n_ent = match ix {
                    true => rows[rw0..]
                        .iter()
                        .map(|r| (r.0 as usize + 1) / ratio)
                        .max()
                        .unwrap_or(0) as u32,
                    false => 0,
                };
                list_len = list_len.max(m * stride as usize);
                scores = scores.max(m * n_ent as usize);
                split = split.max(attention::scratch_elems(
                    m as u32,
                    nh,
                    hp.head_dim as u32,
                    max_split,
                ));
                row_descs.push(RowDesc {
                    ratio,
                    ix,
                    off,
                    stride,
                    max_split,
                    n_ent,
                });
            }
            out.push(RowTabs {
                pos,
                n: n as u32,
                wins,
                rw0,
                descs: row_descs,
                lists: 0,
            });
        }
        // Lists after every descriptor: place them, and point the descriptors at them.
        let lists = descs.len() as u32;
        for d in descs.chunks_exact_mut(4) {
            d[3] += lists;
        }
        for t in &mut out {
            t.lists = lists;
        }
        let gpu = self.gpu.clone();
        let sc = &mut self.scratch;
        sc.idx.ensure(&gpu, descs.len() + list_len)?;
        sc.scores.ensure(&gpu, scores)?;
        sc.attn_split.ensure(&gpu, split as usize)?;
        sc.tab.ensure(&gpu, tab.len())?;
        if !descs.is_empty() {
            gpu.write(&sc.idx.buf, 0, bytemuck::cast_slice(&descs));
        }
        if !tab.is_empty() {
            gpu.write(&sc.tab.buf, 0, bytemuck::cast_slice(&tab));
        }
        Ok(out)
    }

    /// One pass over the rows of `parts`; returns the logits of the `wants` row runs and the
    /// top logits of the `top` rows (in order).
    fn run_round(
        &mut self,
        items: &mut [(&mut GpuSeq, &[u32], Want)],
        parts: &[Part],
        toks: &[u32],
        wants: &[(usize, usize)],
        top: &TopReq,
    ) -> Result<(Vec<f32>, Vec<TopLogits>)> {
        let gpu = self.gpu.clone();
        let n = toks.len();
        let held = self.part.layers.clone();
        let mut pass = gpu.pass();
        let need = parts.iter().map(|p| p.pos0 + p.n).max().unwrap_or(0);
        self.reserve(&mut pass, need)?;
        let layers: Vec<usize> = held.clone().collect();
        let tabs = self.row_tabs(&[(parts, &layers)])?.remove(0);
        gpu.write(&self.scratch.ids, 0, bytemuck::cast_slice(toks));
        let hp = &self.hp;
        if self.trace.is_some() && self.trace_buf.is_none() {
            let bytes = (self.scratch.rows * hp.hc * hp.n_embd * 4) as u64;
            self.trace_buf = Some(gpu.buffer(bytes, "trace")?);
        }
        let mut trace_len = 0;

        if self.profile.is_some() || self.trace.is_some() {
            pass.hold();
        }
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
        self.route_groups(&mut pass, nt)?;
        let width = hp.hc * hp.n_embd;
        for (l, lw) in self
            .w
            .layers
            .iter()
            .enumerate()
            .take(held.end)
            .skip(held.start)
        {
            let st = &self.pools.layers[l - held.start];
            let (blk, x) = (&sc.blk, &sc.x);
            self.hc_pre(&mut pass, &lw.hc_attn, &lw.attn_norm, nt)?;
            trace_point!("attn_in", l, &sc.h, hp.n_embd);
            self.attn_block(&mut pass, st, parts, &tabs, l, &lw.attn, nt)?;
            trace_point!("attn_out", l, blk, hp.n_embd);
            hc::post(&mut pass, &hs, nt, x, blk, &sc.pc)?;
            self.hc_pre(&mut pass, &lw.hc_ffn, &lw.ffn_norm, nt)?;
            trace_point!("ffn_in", l, &sc.h, hp.n_embd);
            self.moe_block(&mut pass, l, &lw.moe, nt)?;
            trace_point!("moe_out", l, blk, hp.n_embd);
            hc::post(&mut pass, &hs, nt, x, blk, &sc.pc)?;
            trace_point!("layer_out", l, x, width);
            pass.flush_every(crate::gpu::FLUSH_OPS)?;
        }
        if let (true, [_], Some(m)) = (self.spec.keep, parts, &self.spec.mtp) {
            pass.copy(&sc.x, 0, &m.trunk, 0, (n * width * 4) as u64);
        }
        let mut prof = self.profile.as_ref().map(|_| Vec::new());
        let result = if let Some(rb) = &self.handoff {
            // Not the last device part: the residual stream goes on to the next device.
            let len = n * width;
            pass.copy(&sc.x, 0, rb.buffer(), 0, len as u64 * 4);
            pass.submit_or_profile(prof.as_mut())?;
            let (data, ns) = rb.read(&gpu, len)?;
            self.link.send(chain::Hidden { rows: n, data }, ns)?;
            (Vec::new(), Vec::new())
        } else {
            let hh = &self.w.hc_head;
            let out = HeadOut {
                w: &self.w.output,
                top: &sc.top,
                n_vocab: hp.n_vocab,
            };
            let norm = &self.w.output_norm;
            self.head(pass, hh, norm, &out, nt, wants, top, &mut prof)?
        };
        if let (Some(all), Some(new)) = (self.profile.as_mut(), prof) {
            all.extend(new);
        }
        for p in parts {
            items[p.item].0.pos = p.pos0 + p.n;
        }
        if let (Some(tb), true) = (&self.trace_buf, trace_len > 0) {
            let v = gpu.read_f32(tb, 0, trace_len)?;
            self.traced.extend(v);
        }
        Ok(result)
    }

    /// wo_a's group route for a pass of `nt` rows (the matmul path only).
    pub(super) fn route_groups(&self, pass: &mut Pass<'_>, nt: u32) -> Result<()> {
        if nt <= matvec::MAX_TOKENS {
            return Ok(());
        }
        let sc = &self.scratch;
        matmul::route(
            pass,
            &sc.wo_route,
            &sc.wo_ids,
            0,
            nt,
            self.hp.o_groups as u32,
        )
    }

    /// A site's hyper-connection mixes and `hc::pre` (fold and weighted norm): the block
    /// input into `h`, (post, comb) into `pc`.
    pub(super) fn hc_pre(
        &self,
        pass: &mut Pass<'_>,
        site: &weights::Hc<GpuTensor>,
        norm: &GpuTensor,
        nt: u32,
    ) -> Result<()> {
        let sc = &self.scratch;
        self.linear_exact(pass, &site.fn_, &sc.x, &sc.mixes, nt)?;
        let hw = HcWeights {
            base: &site.base,
            scale: &site.scale,
            norm,
        };
        hc::pre(
            pass,
            &self.hc_shape(),
            nt,
            &sc.x,
            &sc.mixes,
            &hw,
            &sc.h,
            &sc.pc,
        )
    }

    /// The head over the rows of the residual stream `x`: fold (sigmoid gate) and final norm
    /// into `h`, then the top rows' logits (matvec, so each row's values are a decode
    /// step's) and top-k, then the wanted runs packed into the logits buffer (more passes,
    /// each read back, only when they outgrow it). Submits `pass`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn head(
        &self,
        mut pass: Pass<'_>,
        hh: &weights::Hc<GpuTensor>,
        out_norm: &GpuTensor,
        out: &HeadOut<'_>,
        nt: u32,
        wants: &[(usize, usize)],
        top: &TopReq,
        prof: &mut Option<Vec<(String, f64)>>,
    ) -> Result<(Vec<f32>, Vec<TopLogits>)> {
        let gpu = self.gpu.clone();
        let sc = &self.scratch;
        let hp = &self.hp;
        if wants.is_empty() && top.rows.is_empty() {
            pass.submit_or_profile(prof.as_mut())?;
            return Ok((Vec::new(), Vec::new()));
        }
        let hs = self.hc_shape();
        self.linear_exact(&mut pass, &hh.fn_, &sc.x, &sc.mixes, nt)?;
        let hw = HcWeights {
            base: &hh.base,
            scale: &hh.scale,
            norm: out_norm,
        };
        hc::head(&mut pass, &hs, nt, &sc.x, &sc.mixes, &hw, &sc.h)?;
        if self.hidden_out {
            pass.submit_or_profile(prof.as_mut())?;
            return Ok((
                crate::models::read_rows(&gpu, &sc.h, wants, hp.n_embd)?,
                Vec::new(),
            ));
        }
        let v = out.n_vocab;
        let mut r0 = 0;
        for chunk in top.rows.chunks(sc.logit_rows) {
            // One product per run of consecutive rows (a verify pass, a batch's decode
            // rows; `head_rows`: up to 24 rows each with a lone decode's bits).
            for (j, r, m) in crate::models::row_runs(chunk) {
                crate::models::head_rows(
                    &mut pass,
                    out.w,
                    &sc.h,
                    (r, hp.n_embd),
                    &sc.logits,
                    (j, v),
                    m,
                )?;
            }
            let rows = chunk.len() as u32;
            out.top.record(
                &mut pass,
                View::new(&sc.logits, 0),
                rows,
                r0,
                top.k,
                top.lse,
            )?;
            r0 += rows;
        }
        let total: usize = wants.iter().map(|w| w.1).sum();
        let mut logits = Vec::with_capacity(total * v);
        let mut pending = Some(pass);
        let mut used = 0usize;
        let runs = crate::models::head_runs(wants, sc.logit_rows);
        for (i, &(r, take)) in runs.iter().enumerate() {
            if used + take > sc.logit_rows {
                let p = pending.take().unwrap_or_else(|| gpu.pass());
                p.submit_or_profile(prof.as_mut())?;
                logits.extend(gpu.read_f32(&sc.logits, 0, used * v)?);
                used = 0;
            }
            let p = pending.get_or_insert_with(|| gpu.pass());
            matmul::matmul(
                p,
                out.w,
                &sc.h,
                (r * hp.n_embd) as u32,
                &sc.logits,
                (used * v) as u32,
                take as u32,
            )?;
            used += take;
            if i + 1 == runs.len() {
                let p = pending.take().expect("a pass holds the head");
                p.submit_or_profile(prof.as_mut())?;
                logits.extend(gpu.read_f32(&sc.logits, 0, used * v)?);
            }
        }
        if let Some(p) = pending {
            p.submit_or_profile(prof.as_mut())?;
        }
        let tops = out.top.read(&gpu, r0, top.k, top.lse)?;
        Ok((logits, tops))
    }

    /// `y = W x` for `n` packed rows.
    pub(super) fn linear(
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
    pub(super) fn linear_exact(
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

    /// A compressor's kv | score projections of all `n` rows into `cmp` (rows of 2·width).
    fn compress_proj(
        &self,
        pass: &mut Pass<'_>,
        c: &Compressor<GpuTensor>,
        width: u32,
        n: u32,
    ) -> Result<()> {
        let sc = &self.scratch;
        // f32 products: the indexer's compressed keys decide its top-k (see MatvecOpts::exact)
        let opts = MatvecOpts {
            y_stride: 2 * width,
            exact: true,
            ..Default::default()
        };
        matmul::matmul_opts(pass, &c.wkv, &sc.h, 0, &sc.cmp, 0, n, &opts)?;
        matmul::matmul_opts(pass, &c.wgate, &sc.h, 0, &sc.cmp, width, n, &opts)
    }

    /// Append the projected rows of the pass to a compressor's store pool (each row into its
    /// sequence's ring) and pool the windows they complete into `out`.
    #[allow(clippy::too_many_arguments)]
    fn compress_rows(
        &self,
        pass: &mut Pass<'_>,
        c: &Compressor<GpuTensor>,
        cs: &CmpState,
        table: &RopeTable,
        tabs: &RowTabs,
        out: compress::PoolOut<'_>,
    ) -> Result<compress::Windows<'_>> {
        let s = cs.shape;
        let w = s.width();
        let tab = &self.scratch.tab.buf;
        compress::store(
            pass,
            &s,
            tabs.n,
            self.rows(tabs, 0),
            &self.scratch.cmp,
            0,
            2 * w,
            &c.ape,
            &cs.store,
        )?;
        let wins = tabs.windows(tab, s.ratio as usize);
        compress::pool(pass, &s, wins, &c.norm, table, self.hp.eps, &cs.store, out)?;
        Ok(wins)
    }

    /// The rows of `tabs` from row `row` on, for the compressor kernels.
    fn rows<'a>(&'a self, tabs: &RowTabs, row: usize) -> compress::Rows<'a> {
        compress::Rows {
            tab: &self.scratch.tab.buf,
            tab_rows: tabs.n,
            row0: tabs.pos + row as u32,
        }
    }

    /// Layer `l`'s attention over the rows of `parts` (`st`: the layer's state pools, `tabs`:
    /// the rows' tables): `h` in, `blk` out.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attn_block(
        &self,
        pass: &mut Pass<'_>,
        st: &LayerState,
        parts: &[Part],
        tabs: &RowTabs,
        l: usize,
        a: &Attn<GpuTensor>,
        n: u32,
    ) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let (nh, hd) = (hp.n_head as u32, hp.head_dim as u32);
        let table = &self.rope[l];
        let positions = Positions::Buffer {
            buf: &sc.tab.buf,
            off: tabs.pos,
        };
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
            positions,
            false,
        )?;
        // The one K=V head, each row into its sequence's window ring.
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
        let ks = kv_shape(self.kv_type, hp.head_dim);
        rope::rope_interleaved(
            pass,
            &RopeView::packed(&sc.kv, 0, n, 1, hd),
            table,
            positions,
            false,
        )?;
        attention::write_kv(
            pass,
            ks,
            &sc.kv,
            0,
            hd,
            n,
            &st.ring,
            DstRows::List {
                rows: &sc.tab.buf,
                off: tabs.pos + 2 * tabs.n,
            },
        )?;

        // Compressed entries of the windows the rows complete.
        if let (Some(c), Some(cs)) = (&a.cmp, &st.cmp) {
            self.compress_proj(pass, c, cs.shape.width(), n)?;
            let out = compress::PoolOut::Packed {
                buf: &sc.ent,
                off: 0,
            };
            let wins = self.compress_rows(pass, c, cs, table, tabs, out)?;
            attention::write_kv(
                pass,
                ks,
                &sc.ent,
                0,
                hd,
                wins.n_win,
                &cs.cache,
                DstRows::List {
                    rows: wins.buf,
                    off: wins.off + 2 * wins.n_win,
                },
            )?;
        }
        if let (Some(ix), Some(is)) = (&a.ix, &st.ix) {
            let d = hp.ix_head_dim as u32;
            self.compress_proj(pass, &ix.cmp, is.shape.width(), n)?;
            let out = compress::PoolOut::CacheRows { buf: &is.cache };
            self.compress_rows(pass, &ix.cmp, is, table, tabs, out)?;
            let nih = hp.n_ix_head as u32;
            self.linear_exact(pass, &ix.wq_b, &sc.qr, &sc.ixq, n)?;
            rope::rope_interleaved(
                pass,
                &RopeView::packed(&sc.ixq, 0, n, nih, d),
                table,
                positions,
                false,
            )?;
            self.linear_exact(pass, &ix.proj, &sc.h, &sc.ixw, n)?;
        }
        // One attention call per chunk part, one for all row-wise rows (a decode step's each).
        for p in parts.iter().filter(|p| !p.rowwise) {
            self.attend(pass, st, tabs, l, a, p.row, p.n, p.pos0 + p.n)?;
        }
        if tabs.rw0 < n as usize {
            self.attend(pass, st, tabs, l, a, tabs.rw0, n as usize - tabs.rw0, 0)?;
        }
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

    /// The attention of `cnt` rows from `row` on: the indexer's top-k (ratio-4 layers), the
    /// index lists, one flash-attention call with sinks, the inverse RoPE of its output.
    /// `pos_end` > 0: one chunk of a sequence ending there (one list length for all its
    /// rows); 0: row-wise rows, each attending as a one-token decode step (its own list and
    /// split, from the tables' descriptors).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        pass: &mut Pass<'_>,
        st: &LayerState,
        tabs: &RowTabs,
        l: usize,
        a: &Attn<GpuTensor>,
        row: usize,
        cnt: usize,
        pos_end: usize,
    ) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let (nh, hd) = (hp.n_head as u32, hp.head_dim as u32);
        let table = &self.rope[l];
        let (ratio, has_ix) = self.kind(l);
        let n = cnt as u32;
        let rowwise = pos_end == 0;
        let (n_idx, n_ent) = match rowwise {
            true => {
                let d = tabs.desc(ratio, has_ix);
                (d.stride, d.n_ent)
            }
            false => {
                let n_win = hp.window.min(pos_end);
                let n_ent = pos_end.checked_div(ratio).unwrap_or(0);
                ((n_win + self.comp_slots(l, pos_end)) as u32, n_ent as u32)
            }
        };
        let list = compress::ListView {
            buf: &sc.idx.buf,
            off: tabs.lists,
            n_idx,
        };
        let rows = self.rows(tabs, row);
        let cap_e = self.pools.cap_e(ratio) as u32;
        if let (Some(_), Some(is)) = (&a.ix, &st.ix) {
            let ish = IndexerShape {
                n_head: hp.n_ix_head as u32,
                d: hp.ix_head_dim as u32,
                ratio: ratio as u32,
                top_k: hp.ix_topk as u32,
            };
            compress::index_scores(
                pass,
                &ish,
                n,
                rows,
                row as u32,
                n_ent,
                cap_e,
                &sc.ixq,
                &sc.ixw,
                &is.cache,
                &sc.scores.buf,
            )?;
            compress::select_topk(
                pass,
                &ish,
                n,
                rows,
                n_ent,
                cap_e,
                hp.window as u32,
                &sc.scores.buf,
                list,
            )?;
        }
        compress::index_list(
            pass,
            &IndexList {
                window: hp.window as u32,
                ring: self.ring as u32,
                ratio: ratio as u32,
                fill_comp: ratio > 0 && !has_ix,
                top_k: if has_ix { hp.ix_topk as u32 } else { 0 },
                cap_e,
            },
            n,
            rows,
            list,
        )?;
        // Window ∪ compressed keys (K = V), per-head sinks.
        let ks = kv_shape(self.kv_type, hp.head_dim);
        let (keys, split) = match rowwise {
            true => {
                let d = tabs.desc(ratio, has_ix);
                let keys = Keys::Rows {
                    aux: &sc.idx.buf,
                    off: d.off,
                    max_keys: d.stride,
                };
                (keys, Some((&sc.attn_split.buf, d.max_split)))
            }
            false => {
                let keys = Keys::Index {
                    idx: &sc.idx.buf,
                    off: tabs.lists,
                    n_idx,
                };
                (keys, None)
            }
        };
        let q_off = row as u32 * nh * hd;
        attention::attention(
            pass,
            &Attention {
                n_q: n,
                n_head: nh,
                kv: ks,
                scale: 1.0 / (hd as f32).sqrt(),
                q: QView {
                    buf: &sc.q,
                    off: q_off,
                    tok_stride: nh * hd,
                    head_stride: hd,
                },
                out: OutView {
                    buf: &sc.att,
                    off: q_off,
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
                keys,
                sinks: Some((&a.sink.parts[0].buffer, 0)),
                split,
            },
        )?;
        // The values carry the keys' rotation: undo it at the query position.
        rope::rope_interleaved(
            pass,
            &RopeView::packed(&sc.att, q_off, n, nh, hd),
            table,
            Positions::Buffer {
                buf: &sc.tab.buf,
                off: tabs.pos + row as u32,
            },
            true,
        )
    }
}
