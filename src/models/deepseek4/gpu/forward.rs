//! The forward: passes shared by several sequences (each its own positions, window rings,
//! compressor stores and compressed caches), and the logits each sequence wants.
//!
//! Every product reads its weights once for all rows of a pass; what depends on a
//! sequence's positions or state (RoPE, ring and store writes, pooling, the indexer's
//! scores, the index lists and the attention) runs per sequence. A part of a pass is
//! either a chunk (one index list and attention call over its rows, as a prefill) or
//! row-wise: each row attends exactly as a one-token decode step at its position (its own
//! index list, indexer top-k and split-K attention), so a verify pass of k + 1 rows, and
//! every single-token row of a batch, has a decode step's bits.

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
        let v = self.hp.n_vocab;
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

    /// Grow the index-list and indexer-score scratch for `parts` (each attention call
    /// reuses them from the start).
    pub(super) fn ensure_lists(&mut self, parts: &[Part], layers: &[usize]) -> Result<()> {
        let hp = &self.hp;
        let (mut idx, mut scores) = (0, 0);
        for p in parts {
            let pos_end = p.pos0 + p.n;
            let per_call = if p.rowwise { 1 } else { p.n };
            let n_win = hp.window.min(pos_end);
            for &l in layers {
                idx = idx.max(per_call * (n_win + self.comp_slots(l, pos_end)));
                if hp.has_indexer(l) {
                    scores = scores.max(per_call * (pos_end / hp.compress_ratio[l]));
                }
            }
        }
        let gpu = self.gpu.clone();
        self.scratch.idx.ensure(&gpu, idx)?;
        self.scratch.scores.ensure(&gpu, scores)
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
        self.ensure_lists(parts, &held.clone().collect::<Vec<_>>())?;
        gpu.write(&self.scratch.ids, 0, bytemuck::cast_slice(toks));
        let hp = &self.hp;
        if self.trace.is_some() && self.trace_buf.is_none() {
            let bytes = (self.scratch.rows * hp.hc * hp.n_embd * 4) as u64;
            self.trace_buf = Some(gpu.buffer(bytes, "trace")?);
        }
        let mut trace_len = 0;

        let mut pass = gpu.pass();
        if self.profile.is_some() || self.trace.is_some() {
            pass.hold();
        }
        for p in parts {
            self.reserve(&mut pass, items[p.item].0, p.pos0 + p.n)?;
        }
        let seqs: Vec<&GpuSeq> = parts.iter().map(|p| &*items[p.item].0).collect();
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
            let states: Vec<&LayerState> = seqs.iter().map(|s| &s.layers[l - held.start]).collect();
            let (blk, x) = (&sc.blk, &sc.x);
            self.hc_pre(&mut pass, &lw.hc_attn, &lw.attn_norm, nt)?;
            trace_point!("attn_in", l, &sc.h, hp.n_embd);
            self.attn_block(&mut pass, &states, parts, l, &lw.attn, nt)?;
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
        let v = out.n_vocab;
        let mut r0 = 0;
        for chunk in top.rows.chunks(sc.logit_rows) {
            // One product per run of consecutive rows (a verify pass, a batch's decode
            // rows), at most matvec's rows: those have one-token bits.
            let mut j = 0;
            while j < chunk.len() {
                let mut m = 1;
                while j + m < chunk.len()
                    && chunk[j + m] == chunk[j] + m
                    && m < matvec::MAX_TOKENS as usize
                {
                    m += 1;
                }
                matmul::matmul(
                    &mut pass,
                    out.w,
                    &sc.h,
                    (chunk[j] * hp.n_embd) as u32,
                    &sc.logits,
                    (j * v) as u32,
                    m as u32,
                )?;
                j += m;
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

    /// Append one part's projected rows to its compressor store and pool the windows they
    /// complete into `out` rows of d at `out_off` (relative to the part's first completed
    /// window). Returns (first window, windows).
    #[allow(clippy::too_many_arguments)]
    fn compress_part(
        &self,
        pass: &mut Pass<'_>,
        c: &Compressor<GpuTensor>,
        cs: &CmpState,
        table: &RopeTable,
        p: &Part,
        out: &wgpu::Buffer,
        out_off: u32,
    ) -> Result<(u32, u32)> {
        let s = cs.shape;
        let w = s.width();
        let (n, pos0) = (p.n as u32, p.pos0);
        compress::store(
            pass,
            &s,
            n,
            pos0 as u32,
            &self.scratch.cmp,
            p.row as u32 * 2 * w,
            2 * w,
            &c.ape,
            &cs.store,
        )?;
        // Window w closes at position (w+1)·m − 1: those closing in [pos0, pos0 + n).
        let m = s.ratio as usize;
        let w0 = pos0 / m;
        let n_win = (pos0 + p.n) / m - w0;
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

    /// Layer `l`'s attention over the rows of `parts` (`states[i]` is part i's layer state):
    /// `h` in, `blk` out.
    pub(super) fn attn_block(
        &self,
        pass: &mut Pass<'_>,
        states: &[&LayerState],
        parts: &[Part],
        l: usize,
        a: &Attn<GpuTensor>,
        n: u32,
    ) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let (nh, hd) = (hp.n_head as u32, hp.head_dim as u32);
        let table = &self.rope[l];
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
        for p in parts {
            rope::rope_interleaved(
                pass,
                &RopeView::packed(&sc.q, p.row as u32 * nh * hd, p.n as u32, nh, hd),
                table,
                Positions::From(p.pos0 as u32),
                false,
            )?;
        }
        // The one K=V head, into each sequence's window ring (two writes when it wraps).
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
        for (p, st) in parts.iter().zip(states) {
            let (row, np) = (p.row as u32, p.n as u32);
            rope::rope_interleaved(
                pass,
                &RopeView::packed(&sc.kv, row * hd, np, 1, hd),
                table,
                Positions::From(p.pos0 as u32),
                false,
            )?;
            let slot = p.pos0 % self.ring;
            let n1 = p.n.min(self.ring - slot) as u32;
            attention::write_kv(
                pass,
                ks,
                &sc.kv,
                row * hd,
                hd,
                n1,
                &st.ring,
                DstRows::Range { row0: slot as u32 },
            )?;
            if n1 < np {
                attention::write_kv(
                    pass,
                    ks,
                    &sc.kv,
                    (row + n1) * hd,
                    hd,
                    np - n1,
                    &st.ring,
                    DstRows::Range { row0: 0 },
                )?;
            }
        }

        // Compressed entries of the windows each part completes.
        let ratio = hp.compress_ratio[l];
        if let (Some(c), Some(cs0)) = (&a.cmp, &states[0].cmp) {
            self.compress_proj(pass, c, cs0.shape.width(), n)?;
            for (p, st) in parts.iter().zip(states) {
                let cs = st
                    .cmp
                    .as_ref()
                    .expect("the layer's states have a compressor");
                let (w0, n_win) = self.compress_part(pass, c, cs, table, p, &sc.ent, 0)?;
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
        }
        if let (Some(ix), Some(is0)) = (&a.ix, &states[0].ix) {
            let d = hp.ix_head_dim as u32;
            self.compress_proj(pass, &ix.cmp, is0.shape.width(), n)?;
            for (p, st) in parts.iter().zip(states) {
                let is = st.ix.as_ref().expect("the layer's states have an indexer");
                let off = (p.pos0 / ratio) as u32 * d;
                self.compress_part(pass, &ix.cmp, is, table, p, &is.cache, off)?;
            }
            let nih = hp.n_ix_head as u32;
            self.linear_exact(pass, &ix.wq_b, &sc.qr, &sc.ixq, n)?;
            for p in parts {
                rope::rope_interleaved(
                    pass,
                    &RopeView::packed(&sc.ixq, p.row as u32 * nih * d, p.n as u32, nih, d),
                    table,
                    Positions::From(p.pos0 as u32),
                    false,
                )?;
            }
            self.linear_exact(pass, &ix.proj, &sc.h, &sc.ixw, n)?;
        }
        // Per part, one attention call over its rows, or one per row (a decode step's).
        for (p, st) in parts.iter().zip(states) {
            if p.rowwise {
                for j in 0..p.n {
                    self.attend(pass, st, l, a, p.row + j, p.pos0 + j, 1)?;
                }
            } else {
                self.attend(pass, st, l, a, p.row, p.pos0, p.n)?;
            }
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

    /// The attention of `cnt` rows from `row` on, one sequence's positions `pos0..`: the
    /// indexer's top-k (ratio-4 layers), the index list, one flash-attention call with sinks
    /// (split-K for a single row), the inverse RoPE of its output.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        pass: &mut Pass<'_>,
        st: &LayerState,
        l: usize,
        a: &Attn<GpuTensor>,
        row: usize,
        pos0: usize,
        cnt: usize,
    ) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let (nh, hd) = (hp.n_head as u32, hp.head_dim as u32);
        let table = &self.rope[l];
        let ratio = hp.compress_ratio[l];
        let (p0, n) = (pos0 as u32, cnt as u32);
        let pos_end = pos0 + cnt;
        let n_win = hp.window.min(pos_end) as u32;
        let n_idx = n_win + self.comp_slots(l, pos_end) as u32;
        let mut fill_comp = ratio > 0;
        if let (Some(_), Some(is)) = (&a.ix, &st.ix) {
            fill_comp = false;
            let ish = IndexerShape {
                n_head: hp.n_ix_head as u32,
                d: hp.ix_head_dim as u32,
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
                row as u32,
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
        let ks = kv_shape(self.kv_type, hp.head_dim);
        let n_split = if n == 1 {
            attention::pick_n_split(1, nh, ks, n_idx, true)
        } else {
            1
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
            &RopeView::packed(&sc.att, q_off, n, nh, hd),
            table,
            Positions::From(p0),
            true,
        )
    }
}
