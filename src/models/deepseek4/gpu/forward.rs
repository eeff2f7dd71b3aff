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

pub(super) use crate::models::runtime::rounds::{Part, TopReq};

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

/// The output head a pass ends with: the fold of the copies and the final norm (the
/// model's, or its MTP block's), the output matrix (the model's, or a draft's first rows
/// only, see `Speculate::set_draft_vocab`) and the buffer its top-k goes to.
pub(super) struct HeadOut<'a> {
    pub hc: &'a weights::Hc<GpuTensor>,
    pub norm: &'a GpuTensor,
    /// [n_vocab, n_embd]
    pub w: &'a GpuTensor,
    pub top: &'a topk::LogitsTop,
    pub n_vocab: usize,
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
        let (v, rows, last) = (self.hp.n_vocab, self.scratch.rows, self.part.last);
        rounds::run_rounds(items, v, rows, last, rowwise, |r| {
            self.run_round(&r.parts, &r.toks, &r.wants, &r.top)
        })
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
        let bytes = (self.scratch.rows * hp.hc * hp.n_embd * 4) as u64;
        self.trace.prepare(&gpu, bytes)?;

        if self.profile.is_some() || self.trace.on() {
            pass.hold();
        }
        let hp = &self.hp;
        let sc = &self.scratch;
        let hs = self.hc_shape();
        let (e, nt) = (hp.n_embd as u32, n as u32);
        if self.part.first {
            for j in 0..hs.hc {
                embed::embed(
                    &mut pass,
                    &self.w.tok_embd,
                    &sc.ids,
                    0,
                    nt,
                    Operand::strided(&sc.x, j * e, hs.hc * e),
                )?;
            }
        } else {
            self.link.receive_into(&gpu, &sc.x, n, hp.hc * hp.n_embd)?;
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
            self.trace
                .point(&mut pass, "attn_in", l, &sc.h, n * hp.n_embd);
            self.attn_block(&mut pass, st, parts, &tabs, l, &lw.attn)?;
            self.trace
                .point(&mut pass, "attn_out", l, blk, n * hp.n_embd);
            hc::post(&mut pass, &hs, nt, x, blk, &sc.pc)?;
            self.hc_pre(&mut pass, &lw.hc_ffn, &lw.ffn_norm, nt)?;
            self.trace
                .point(&mut pass, "ffn_in", l, &sc.h, n * hp.n_embd);
            self.moe_block(&mut pass, l, &lw.moe, nt)?;
            self.trace
                .point(&mut pass, "moe_out", l, blk, n * hp.n_embd);
            hc::post(&mut pass, &hs, nt, x, blk, &sc.pc)?;
            self.trace.point(&mut pass, "layer_out", l, x, n * width);
            pass.flush_every(crate::gpu::FLUSH_OPS)?;
        }
        if let (true, [_], Some(m)) = (self.spec.keep, parts, &self.spec.mtp) {
            pass.copy(&sc.x, 0, &m.trunk, 0, (n * width * 4) as u64);
        }
        let mut prof = self.profile.as_ref().map(|_| Vec::new());
        let result = if let Some(rb) = &self.handoff {
            // Not the last device part: the residual stream goes on to the next device.
            self.link
                .hand_off(pass, &sc.x, rb, n, width, prof.as_mut())?;
            (Vec::new(), Vec::new())
        } else {
            let out = HeadOut {
                hc: &self.w.hc_head,
                norm: &self.w.output_norm,
                w: &self.w.output,
                top: &sc.top,
                n_vocab: hp.n_vocab,
            };
            self.head(pass, &out, nt, wants, top, &mut prof)?
        };
        if let (Some(all), Some(new)) = (self.profile.as_mut(), prof) {
            all.extend(new);
        }
        self.trace.collect(&gpu)?;
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
        let inp = HcInput {
            n_tok: nt,
            x: &sc.x,
            mixes: &sc.mixes,
        };
        hc::pre(pass, &self.hc_shape(), inp, &hw, &sc.h, &sc.pc)
    }

    /// The head over the rows of the residual stream `x`: fold (sigmoid gate) and final norm
    /// into `h`, then the runtime's head and readback ([`head_logits`]: the top rows'
    /// logits with a decode step's bits and their top-k, then the wanted runs). Submits
    /// `pass`.
    pub(super) fn head(
        &self,
        mut pass: Pass<'_>,
        out: &HeadOut<'_>,
        nt: u32,
        wants: &[(usize, usize)],
        top: &TopReq,
        prof: &mut Option<Vec<(String, f64)>>,
    ) -> Result<(Vec<f32>, Vec<TopLogits>)> {
        let sc = &self.scratch;
        let hp = &self.hp;
        if wants.is_empty() && top.rows.is_empty() {
            pass.submit_or_profile(prof.as_mut())?;
            return Ok((Vec::new(), Vec::new()));
        }
        let hs = self.hc_shape();
        let hh = out.hc;
        self.linear_exact(&mut pass, &hh.fn_, &sc.x, &sc.mixes, nt)?;
        let hw = HcWeights {
            base: &hh.base,
            scale: &hh.scale,
            norm: out.norm,
        };
        let inp = HcInput {
            n_tok: nt,
            x: &sc.x,
            mixes: &sc.mixes,
        };
        hc::head(&mut pass, &hs, inp, &hw, &sc.h)?;
        let head = Head {
            w: out.w,
            n_vocab: out.n_vocab,
            h: &sc.h,
            n_embd: hp.n_embd,
            logits: &sc.logits,
            logit_rows: sc.logit_rows,
            top: out.top,
            hidden: self.hidden_out,
            softcap: None,
            suppress: self.suppress.as_ref(),
        };
        head_logits(pass, &head, wants, top, prof.as_mut())
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
        matmul::matmul(pass, w, Operand::new(x, 0), Operand::new(y, 0), n)
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
        matmul::matmul_opts(pass, w, Operand::new(x, 0), Operand::new(y, 0), n, &opts)
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
            exact: true,
            ..Default::default()
        };
        let x = Operand::new(&sc.h, 0);
        let kv = Operand::strided(&sc.cmp, 0, 2 * width);
        let score = Operand::strided(&sc.cmp, width, 2 * width);
        matmul::matmul_opts(pass, &c.wkv, x, kv, n, &opts)?;
        matmul::matmul_opts(pass, &c.wgate, x, score, n, &opts)
    }

    /// Append the projected rows of the pass to a compressor's store pool (each row into its
    /// sequence's ring) and pool the windows they complete into `out`.
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
        let tab = &self.scratch.tab.buf;
        let rows = self.rows(tabs, 0, tabs.n);
        let src = Operand::new(&self.scratch.cmp, 0);
        compress::store(pass, &s, rows, src, &c.ape, &cs.store)?;
        let wins = tabs.windows(tab, s.ratio as usize);
        let norm = compress::EntryNorm {
            w: &c.norm,
            eps: self.hp.eps,
        };
        compress::pool(pass, &s, wins, norm, table, &cs.store, out)?;
        Ok(wins)
    }

    /// `n_tok` rows of `tabs` from row `row` on, for the compressor kernels.
    fn rows<'a>(&'a self, tabs: &RowTabs, row: usize, n_tok: u32) -> compress::Rows<'a> {
        compress::Rows {
            tab: &self.scratch.tab.buf,
            tab_rows: tabs.n,
            row0: tabs.pos + row as u32,
            n_tok,
        }
    }

    /// Layer `l`'s attention over the rows of `parts` (`st`: the layer's state pools, `tabs`:
    /// the rows' tables): `h` in, `blk` out.
    pub(super) fn attn_block(
        &self,
        pass: &mut Pass<'_>,
        st: &LayerState,
        parts: &[Part],
        tabs: &RowTabs,
        l: usize,
        a: &Attn<GpuTensor>,
    ) -> Result<()> {
        let n = tabs.n;
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
            Operand::new(&sc.qr, 0),
            None,
            Some(&a.q_norm),
            hp.eps,
        )?;
        self.linear(pass, &a.wq_b, &sc.qr, &sc.q, n)?;
        norm::rms_norm(pass, n * nh, hd, Operand::new(&sc.q, 0), None, None, hp.eps)?;
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
            Operand::new(&sc.kv, 0),
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
            self.attend(pass, st, tabs, l, a, Some(p))?;
        }
        if tabs.rw0 < n as usize {
            self.attend(pass, st, tabs, l, a, None)?;
        }
        // Grouped low-rank output: wo_a as a stack of o_groups matrices, token t's group g
        // (pair t·o_groups + g) reading its slice of the heads; then wo_b.
        let og = hp.o_groups as u32;
        let opts = MatvecOpts::default();
        if n <= matvec::MAX_TOKENS {
            matvec::matvec_indexed(
                pass,
                &a.wo_a,
                Operand::new(&sc.att, 0),
                &matvec::Pairs {
                    ids: Operand::new(&sc.wo_ids, 0),
                    n_tokens: n,
                    n_used: og,
                    x_per_pair: true,
                },
                Operand::new(&sc.mid, 0),
                &opts,
            )?;
        } else {
            matmul::matmul_indexed(
                pass,
                &a.wo_a,
                Operand::new(&sc.att, 0),
                &matmul::RoutePairs {
                    route: &sc.wo_route,
                    n_tokens: n,
                    n_used: og,
                    x_per_pair: true,
                },
                Operand::new(&sc.mid, 0),
                &opts,
            )?;
        }
        self.linear(pass, &a.wo_b, &sc.mid, &sc.blk, n)
    }

    /// The attention of the rows of chunk part `Some(p)` or of the row-wise rows (`None`):
    /// the indexer's top-k (ratio-4 layers), the index lists, one flash-attention call with
    /// sinks, the inverse RoPE of its output. A chunk of a sequence ending at `pos_end` has
    /// one list length for all its rows; row-wise rows each attend as a one-token decode
    /// step (its own list and split, from the tables' descriptors).
    fn attend(
        &self,
        pass: &mut Pass<'_>,
        st: &LayerState,
        tabs: &RowTabs,
        l: usize,
        a: &Attn<GpuTensor>,
        part: Option<&Part>,
    ) -> Result<()> {
        let (row, cnt, pos_end) = match part {
            Some(p) => (p.row, p.n, p.pos0 + p.n),
            None => (tabs.rw0, tabs.n as usize - tabs.rw0, 0),
        };
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
        let rows = self.rows(tabs, row, n);
        let cap_e = self.pools.cap_e(ratio) as u32;
        if let (Some(_), Some(is)) = (&a.ix, &st.ix) {
            let ish = IndexerShape {
                n_head: hp.n_ix_head as u32,
                d: hp.ix_head_dim as u32,
                ratio: ratio as u32,
                top_k: hp.ix_topk as u32,
            };
            let queries = compress::Queries {
                q: &sc.ixq,
                w: &sc.ixw,
                row0: row as u32,
            };
            let ents = compress::SlotEntries { n_ent, cap_e };
            let scores = &sc.scores.buf;
            compress::index_scores(pass, &ish, rows, queries, &is.cache, ents, scores)?;
            compress::select_topk(pass, &ish, rows, ents, hp.window as u32, scores, list)?;
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
