//! Speculative decoding on the DeepSeek-V4 GPU forward: the MTP block that drafts tokens,
//! verify passes whose rows carry the bits of one-token decode steps, and the rollback.
//!
//! The MTP block (DeepSeek's model.py `MTPBlock`, one in the releases): row `p` reads the
//! residual stream `h_p` (`[hc, n_embd]`, the hyper-connection copies the head folds) the
//! trunk left at position `p` and the token `t_{p+1}`:
//! `x_j = e_proj(enorm(embed(t_{p+1}))) + h_proj(hnorm(h_p,j))` for each copy `j`, one full
//! block (hc mixes, attention over its own window ring, MoE) at position `p`, then the
//! shared head through the block's own hc fold and `norm` gives the draft of `t_{p+2}`.
//! The block's output copies are the hidden state of the next chained draft.
//!
//! Rollback needs no saved state: every piece of a sequence's state is addressed by
//! position (window rings, compressor stores, compressed caches), a verify pass of `k + 1`
//! rows overwrites nothing a kept position still reads (the rings hold a pass's rows beyond
//! the window), and every entry a rejected row wrote is invisible to earlier positions and
//! rewritten before a later one reads it. So a rollback moves the position back; the kept
//! rows' state, written by rows with decode's bits, is what re-feeding them would write.

use super::forward::{HeadOut, Part, RowTabs, TopReq};
use super::*;
use crate::models::spec::{Hidden, Speculate};

/// Most rows of a verify pass (the drafted tokens plus one): up to here the products run
/// matvec, whose rows have one-token bits (`matvec::MAX_TOKENS`).
pub const MAX_VERIFY: usize = matvec::MAX_TOKENS as usize;

/// The MTP block's weights and its row buffers.
pub(super) struct MtpGpu {
    pub w: weights::Mtp<GpuTensor>,
    /// [rows, hc·n_embd]: the trunk rows of the last pass that kept them.
    pub trunk: wgpu::Buffer,
    /// [rows, hc·n_embd]: the hidden rows the last MTP pass read.
    hid: wgpu::Buffer,
    /// [rows, hc·n_embd]: the block's output copies (what a chained draft reads).
    out: wgpu::Buffer,
    /// [rows, n_embd]: `enorm(embed(t))`, then `e_proj` of it.
    emb: wgpu::Buffer,
    ep: wgpu::Buffer,
    /// [rows·hc, n_embd]: `hnorm` of the hidden copies.
    hn: wgpu::Buffer,
    /// (sequence, position, row of `out`) of the last row run: what a chained draft reads.
    last: Option<(u64, usize, u32)>,
    /// Rows of the last MTP pass.
    rows: usize,
    /// The drafts' head when they pick among the first tokens only, and its top-k buffer.
    draft: Option<(GpuTensor, topk::LogitsTop)>,
}

/// What speculation keeps in the model.
#[derive(Default)]
pub(super) struct SpecState {
    /// The next pass (one sequence) copies its rows' residual stream to `MtpGpu::trunk`.
    pub keep: bool,
    /// (sequence, first position, rows) of the last pass fed through [`Speculate`] whose
    /// rows `MtpGpu::trunk` holds.
    pub trunk: Option<(u64, usize, usize)>,
    /// Per sequence: `[MAX_VERIFY, hc·n_embd]` rows, their first position and count: the
    /// last trunk rows of its last [`Speculate`] pass, kept while other sequences run.
    pub saved: std::collections::HashMap<u64, (wgpu::Buffer, usize, usize)>,
    /// Per sequence its position before its last verify pass.
    pub verify: std::collections::HashMap<u64, usize>,
    pub mtp: Option<MtpGpu>,
}

impl MtpGpu {
    pub(super) fn new(
        gpu: &Gpu,
        hp: &Hparams,
        w: weights::Mtp<GpuTensor>,
        rows: usize,
    ) -> Result<MtpGpu> {
        let (r, e, hc) = (rows as u64, hp.n_embd as u64, hp.hc as u64);
        Ok(MtpGpu {
            w,
            trunk: gpu.buffer(r * hc * e * 4, "mtp.trunk")?,
            hid: gpu.buffer(r * hc * e * 4, "mtp.hid")?,
            out: gpu.buffer(r * hc * e * 4, "mtp.out")?,
            emb: gpu.buffer(r * e * 4, "mtp.emb")?,
            ep: gpu.buffer(r * e * 4, "mtp.ep")?,
            hn: gpu.buffer(r * hc * e * 4, "mtp.hn")?,
            last: None,
            rows: 0,
            draft: None,
        })
    }

    /// Bytes [`MtpGpu::new`] allocates for `rows` rows (for memory budgets).
    pub(super) fn bytes(hp: &Hparams, rows: usize) -> u64 {
        let (r, e, hc) = (rows as u64, hp.n_embd as u64, hp.hc as u64);
        (5 * hc + 2) * r * e * 4
    }
}

impl GpuModel {
    /// One pass of `tokens` on `seq` through the [`Speculate`] entry points: the rows'
    /// residual stream is kept for the MTP block when they fit one pass.
    fn spec_pass(
        &mut self,
        seq: &mut GpuSeq,
        tokens: &[u32],
        want: Want,
        rowwise: bool,
    ) -> Result<Vec<Logits>> {
        let (id, pos0, n) = (seq.id, seq.pos, tokens.len());
        self.spec.trunk = None;
        self.spec.keep = self.spec.mtp.is_some() && n <= self.scratch.rows;
        let r = self.forward_rows(&mut [(seq, tokens, want)], rowwise);
        self.spec.keep = false;
        let out = r?.pop().unwrap_or_default();
        if self.spec.mtp.is_some() && n <= self.scratch.rows {
            self.spec.trunk = Some((id, pos0, n));
            self.save_trunk(id, pos0, n)?;
        }
        Ok(out)
    }

    /// Copies the last (up to [`MAX_VERIFY`]) rows of `MtpGpu::trunk` (a pass of `n` rows
    /// of sequence `id` from `pos0`) to the sequence's own rows.
    fn save_trunk(&mut self, id: u64, pos0: usize, n: usize) -> Result<()> {
        let Some(m) = &self.spec.mtp else {
            return Ok(());
        };
        let w = (self.hp.hc * self.hp.n_embd * 4) as u64;
        if !self.spec.saved.contains_key(&id) {
            let b = self.gpu.buffer(MAX_VERIFY as u64 * w, "mtp.saved")?;
            self.spec.saved.insert(id, (b, 0, 0));
        }
        let keep = n.min(MAX_VERIFY);
        let saved = self.spec.saved.get_mut(&id).expect("made above");
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(
            &m.trunk,
            (n - keep) as u64 * w,
            &saved.0,
            0,
            keep as u64 * w,
        );
        self.gpu.queue.submit([enc.finish()]);
        (saved.1, saved.2) = (pos0 + n - keep, keep);
        Ok(())
    }

    /// The trunk rows an MTP pass over `n` tokens of `seq` reads: the last `n` rows of its
    /// last [`Speculate`] pass, which must have ended at its position. Returns their first
    /// position, whether they are in `MtpGpu::trunk` (else the sequence's saved rows) and
    /// their first row there.
    fn trunk_src(&self, seq: &GpuSeq, n: usize) -> Option<(usize, bool, u32)> {
        self.spec.mtp.as_ref()?;
        let ends_here = |p0: usize, r: usize| n > 0 && n <= r && p0 + r == seq.pos;
        if let Some((_, p0, r)) = self.spec.saved.get(&seq.id) {
            if ends_here(*p0, *r) {
                return Some((p0 + r - n, false, (r - n) as u32));
            }
        }
        match self.spec.trunk {
            Some((id, p0, r)) if id == seq.id && ends_here(p0, r) => {
                Some((p0 + r - n, true, (r - n) as u32))
            }
            _ => None,
        }
    }

    /// The buffer [`GpuModel::trunk_src`] names.
    fn trunk_buf(&self, seq: &GpuSeq, scratch: bool) -> &wgpu::Buffer {
        let m = self.spec.mtp.as_ref().expect("trunk_src checked the block");
        match self.spec.saved.get(&seq.id) {
            Some((b, _, _)) if !scratch => b,
            _ => &m.trunk,
        }
    }

    /// Records the MTP block over the rows of `part` (its tables `tabs`) reading the hidden
    /// rows at row `src_row` of `src` (`[rows, hc·n_embd]`) and the token ids in
    /// `Scratch::ids`; leaves the output copies in `Scratch::x` and `MtpGpu::out`.
    fn record_mtp(
        &self,
        pass: &mut Pass<'_>,
        part: &Part,
        tabs: &RowTabs,
        src: &wgpu::Buffer,
        src_row: u32,
    ) -> Result<()> {
        let n = part.n;
        let hp = &self.hp;
        let sc = &self.scratch;
        let m = self.spec.mtp.as_ref().expect("the model has an MTP block");
        let (e, hc, nt) = (hp.n_embd as u32, hp.hc as u32, n as u32);
        let width = (hc * e) as u64 * 4;
        pass.copy(src, src_row as u64 * width, &m.hid, 0, n as u64 * width);
        embed::embed(
            pass,
            &self.w.tok_embd,
            &sc.ids,
            0,
            nt,
            Operand::new(&m.emb, 0),
        )?;
        norm::rms_norm(
            pass,
            nt,
            e,
            Operand::new(&m.emb, 0),
            None,
            Some(&m.w.enorm),
            hp.eps,
        )?;
        self.linear(pass, &m.w.e_proj, &m.emb, &m.ep, nt)?;
        norm::rms_norm(
            pass,
            nt * hc,
            e,
            Operand::new(&m.hid, 0),
            Some(Operand::new(&m.hn, 0)),
            Some(&m.w.hnorm),
            hp.eps,
        )?;
        self.linear(pass, &m.w.h_proj, &m.hn, &sc.x, nt * hc)?;
        for j in 0..hc {
            ew::add_inplace(
                pass,
                nt,
                e,
                Operand::strided(&sc.x, j * e, hc * e),
                Operand::new(&m.ep, 0),
            )?;
        }
        let (l, lw) = (hp.n_layer, &m.w.layer);
        let st = self.pools.mtp.as_ref().expect("the model has an MTP block");
        let hs = self.hc_shape();
        self.route_groups(pass, nt)?;
        self.hc_pre(pass, &lw.hc_attn, &lw.attn_norm, nt)?;
        self.attn_block(pass, st, std::slice::from_ref(part), tabs, l, &lw.attn)?;
        hc::post(pass, &hs, nt, &sc.x, &sc.blk, &sc.pc)?;
        self.hc_pre(pass, &lw.hc_ffn, &lw.ffn_norm, nt)?;
        self.moe_block(pass, l, &lw.moe, nt)?;
        hc::post(pass, &hs, nt, &sc.x, &sc.blk, &sc.pc)?;
        pass.copy(&sc.x, 0, &m.out, 0, n as u64 * width);
        Ok(())
    }

    /// The MTP block over `tokens`: `Hidden::Trunk` reads the rows of the last
    /// [`Speculate`] pass of `seq` (as many, from its first position), `Hidden::Chain` one
    /// row after the last MTP row reading its output. `Want::Top`: the last row's best
    /// logits; `All`: every row's; `Last`: the last row's. `draft`: through the drafts' head
    /// ([`Speculate::set_draft_vocab`]) where one is set.
    fn mtp_pass(
        &mut self,
        seq: &GpuSeq,
        hidden: Hidden,
        tokens: &[u32],
        want: Want,
        draft: bool,
    ) -> Result<Vec<Logits>> {
        self.check_tokens(tokens)?;
        crate::forward::check_want(want)?;
        let n = tokens.len();
        let (Some(m), Some(_)) = (&self.spec.mtp, &self.pools.mtp) else {
            return Err(Error::Invalid("the model has no MTP block".into()));
        };
        // (first position, read trunk rows (else the last output), in `MtpGpu::trunk`, row)
        let (pos0, trunk, scratch, src_row) = match hidden {
            Hidden::Trunk => {
                let (p0, scratch, row) = self.trunk_src(seq, n).ok_or_else(|| {
                    Error::Invalid(format!(
                        "MTP over {n} trunk rows: the last pass of this sequence fed fewer"
                    ))
                })?;
                (p0, true, scratch, row)
            }
            Hidden::Chain => match m.last {
                Some((id, p, row)) if id == seq.id && n == 1 => (p + 1, false, false, row),
                _ => {
                    return Err(Error::Invalid(
                        "a chained MTP draft needs one token after an MTP row of this sequence"
                            .into(),
                    ))
                }
            },
        };
        if n > self.scratch.rows || (want == Want::All && n > self.scratch.logit_rows) {
            return Err(Error::Invalid(format!("MTP pass of {n} rows")));
        }
        let gpu = self.gpu.clone();
        let parts = [Part {
            item: 0,
            start: 0,
            n,
            row: 0,
            pos0,
            rowwise: n == 1,
            slot: seq.slot,
        }];
        let tabs = self.row_tabs(&[(&parts, &[self.hp.n_layer])])?.remove(0);
        gpu.write(&self.scratch.ids, 0, bytemuck::cast_slice(tokens));
        let m = self.spec.mtp.as_ref().expect("checked above");
        let src = if trunk {
            self.trunk_buf(seq, scratch)
        } else {
            &m.out
        };
        let mut pass = gpu.pass();
        self.record_mtp(&mut pass, &parts[0], &tabs, src, src_row)?;
        let mut top = TopReq::default();
        let mut wants = Vec::new();
        match want {
            Want::Top { k, lse } => {
                top = TopReq {
                    k,
                    lse,
                    rows: vec![n - 1],
                }
            }
            Want::All => wants.push((0, n)),
            Want::Last => wants.push((n - 1, 1)),
            Want::None => {}
        }
        let (hc, norm) = (&m.w.hc_head, &m.w.norm);
        let out = match (&m.draft, draft) {
            (Some((w, top)), true) => HeadOut {
                hc,
                norm,
                w,
                top,
                n_vocab: w.shape[0] as usize,
            },
            _ => HeadOut {
                hc,
                norm,
                w: &self.w.output,
                top: &self.scratch.top,
                n_vocab: self.hp.n_vocab,
            },
        };
        let (logits, tops) = self.head(pass, &out, n as u32, &wants, &top, &mut None)?;
        let v = out.n_vocab;
        // Where `MtpGpu::trunk` rows were read, they are used up (another MTP pass needs a
        // new one); the sequence's saved rows stay.
        self.spec.trunk = None;
        let m = self.spec.mtp.as_mut().expect("checked above");
        m.last = Some((seq.id, pos0 + n - 1, n as u32 - 1));
        m.rows = n;
        Ok(match want {
            Want::Top { .. } => tops.into_iter().map(Logits::Top).collect(),
            Want::None => Vec::new(),
            _ => logits
                .chunks_exact(v)
                .map(|r| Logits::Full(r.to_vec()))
                .collect(),
        })
    }
}

impl GpuModel {
    /// The drafts' head: the MTP block's fold and norm, then the trimmed output matrix
    /// ([`Speculate::set_draft_vocab`]) or the model's.
    fn draft_head(&self) -> HeadOut<'_> {
        let m = self.spec.mtp.as_ref().expect("the model has an MTP block");
        let (hc, norm) = (&m.w.hc_head, &m.w.norm);
        match &m.draft {
            Some((w, top)) => HeadOut {
                hc,
                norm,
                w,
                top,
                n_vocab: w.shape[0] as usize,
            },
            None => HeadOut {
                hc,
                norm,
                w: &self.w.output,
                top: &self.scratch.top,
                n_vocab: self.hp.n_vocab,
            },
        }
    }

    /// Records the head of row `row` of the last [`Self::record_mtp`] (`nt` rows): the
    /// block's hc fold and norm, the drafts' head, its best id into result row `j`.
    fn record_draft_top(&self, pass: &mut Pass<'_>, nt: u32, row: u32, j: u32) -> Result<()> {
        let sc = &self.scratch;
        let out = self.draft_head();
        let hh = out.hc;
        self.linear_exact(pass, &hh.fn_, &sc.x, &sc.mixes, nt)?;
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
        hc::head(pass, &self.hc_shape(), inp, &hw, &sc.h)?;
        let e = self.hp.n_embd as u32;
        matmul::matmul(
            pass,
            out.w,
            Operand::new(&sc.h, row * e),
            Operand::new(&sc.logits, 0),
            1,
        )?;
        out.top
            .record(pass, Operand::new(&sc.logits, 0), 1, j, 1, false)
    }

    /// `k` greedy drafts in one submission: the MTP rows over the trunk's last pass (the
    /// last reading `tokens`' last), then `k - 1` chained rows, each fed the pick of the row
    /// before it on the GPU (copied from the top-k buffer into the token ids).
    fn mtp_drafts_pass(&mut self, seq: &GpuSeq, tokens: &[u32], k: usize) -> Result<Vec<u32>> {
        self.check_tokens(tokens)?;
        if k == 0 || k > MAX_VERIFY {
            return Err(Error::Invalid(format!("{k} drafts (1..={MAX_VERIFY})")));
        }
        let n = tokens.len();
        let (pos0, scratch, src_row) = match (self.trunk_src(seq, n), &self.pools.mtp) {
            (Some(t), Some(_)) => t,
            _ => {
                return Err(Error::Invalid(format!(
                    "MTP drafts over {n} trunk rows: the last pass of this sequence fed fewer, \
                     or the model has no MTP block"
                )))
            }
        };
        if n > self.scratch.rows {
            return Err(Error::Invalid(format!("MTP pass of {n} rows")));
        }
        let last = pos0 + n - 1;
        let part = |n: usize, pos0: usize| Part {
            item: 0,
            start: 0,
            n,
            row: 0,
            pos0,
            rowwise: n == 1,
            slot: seq.slot,
        };
        // One table per MTP row run: the trunk's rows, then each chained row.
        let parts: Vec<Part> = std::iter::once(part(n, pos0))
            .chain((1..k).map(|j| part(1, last + j)))
            .collect();
        let layers = [self.hp.n_layer];
        let groups: Vec<(&[Part], &[usize])> = parts
            .iter()
            .map(|p| (std::slice::from_ref(p), &layers[..]))
            .collect();
        let tabs = self.row_tabs(&groups)?;
        let gpu = self.gpu.clone();
        gpu.write(&self.scratch.ids, 0, bytemuck::cast_slice(tokens));
        let m = self.spec.mtp.as_ref().expect("checked above");
        let sc = &self.scratch;
        let mut pass = gpu.pass();
        self.record_mtp(
            &mut pass,
            &parts[0],
            &tabs[0],
            self.trunk_buf(seq, scratch),
            src_row,
        )?;
        self.record_draft_top(&mut pass, n as u32, n as u32 - 1, 0)?;
        let mut row = n as u32 - 1;
        for j in 1..k {
            let (ids, off) = self.draft_head().top.id_at(j as u32 - 1, 1);
            pass.copy(ids, off, &sc.ids, 0, 4);
            self.record_mtp(&mut pass, &parts[j], &tabs[j], &m.out, row)?;
            self.record_draft_top(&mut pass, 1, 0, j as u32)?;
            row = 0;
        }
        pass.submit()?;
        let picks = self.draft_head().top.read(&gpu, k as u32, 1, false)?;
        let ids = picks
            .iter()
            .map(|t| t.cands.first().map(|c| c.0))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| Error::Gpu("an MTP draft row had no pick".into()))?;
        self.spec.trunk = None;
        let m = self.spec.mtp.as_mut().expect("checked above");
        m.last = Some((seq.id, last + k - 1, row));
        m.rows = if k == 1 { n } else { 1 };
        Ok(ids)
    }
}

impl Speculate for GpuModel {
    fn has_mtp(&self) -> bool {
        self.spec.mtp.is_some()
    }

    fn max_verify(&self) -> usize {
        MAX_VERIFY
    }
    fn pass_rows(&self) -> usize {
        self.scratch.rows
    }

    fn feed(&mut self, seq: &mut Seq, tokens: &[u32], want: Want) -> Result<Vec<Logits>> {
        Ok(vec![self
            .spec_pass(seq.get_mut()?, tokens, want, false)?
            .pop()
            .unwrap_or(Logits::Full(Vec::new()))])
    }

    fn verify(&mut self, seq: &mut Seq, tokens: &[u32], want: Want) -> Result<Vec<Logits>> {
        let s: &mut GpuSeq = seq.get_mut()?;
        let n = tokens.len();
        if n == 0 || n > MAX_VERIFY {
            return Err(Error::Invalid(format!(
                "a verify pass of {n} tokens (1..={MAX_VERIFY})"
            )));
        }
        self.spec.verify.insert(s.id, s.pos);
        let per_row = match want {
            Want::Top { .. } | Want::None => want,
            Want::All | Want::Last => Want::All,
        };
        let out = self.spec_pass(s, tokens, per_row, true)?;
        let v = self.hp.n_vocab;
        Ok(match per_row {
            Want::All => out
                .into_iter()
                .flat_map(|l| {
                    l.into_full()
                        .chunks_exact(v)
                        .map(|r| Logits::Full(r.to_vec()))
                        .collect::<Vec<_>>()
                })
                .collect(),
            _ => out,
        })
    }

    fn rollback(&mut self, seq: &mut Seq, keep: &[u32]) -> Result<()> {
        let s: &mut GpuSeq = seq.get_mut()?;
        match self.spec.verify.get(&s.id).copied() {
            Some(p0) if p0 + keep.len() <= s.pos => {
                let id = s.id;
                s.pos = p0 + keep.len();
                // The trunk's first rows are the kept tokens' (the verify pass's rows).
                self.spec.trunk = match self.spec.trunk {
                    Some((tid, tp, _)) if tid == id && tp == p0 && !keep.is_empty() => {
                        Some((id, p0, keep.len()))
                    }
                    _ => None,
                };
                if let Some(saved) = self.spec.saved.get_mut(&id) {
                    if saved.1 != p0 || keep.is_empty() {
                        self.spec.saved.remove(&id);
                    } else {
                        saved.2 = keep.len();
                    }
                }
                Ok(())
            }
            _ => Err(Error::Invalid(
                "rollback without a verify pass of this sequence".into(),
            )),
        }
    }

    fn mtp(
        &mut self,
        seq: &Seq,
        hidden: Hidden,
        tokens: &[u32],
        want: Want,
    ) -> Result<Vec<Logits>> {
        self.mtp_pass(seq.get()?, hidden, tokens, want, false)
    }

    /// `[rows, hc·n_embd]`: the residual-stream copies each row read.
    fn mtp_hidden(&self, rows: usize) -> Result<Vec<f32>> {
        let m = self
            .spec
            .mtp
            .as_ref()
            .ok_or_else(|| Error::Invalid("the model has no MTP block".into()))?;
        if rows > m.rows {
            return Err(Error::Invalid(format!(
                "{rows} hidden rows of an MTP pass of {}",
                m.rows
            )));
        }
        self.gpu
            .read_f32(&m.hid, 0, rows * self.hp.hc * self.hp.n_embd)
    }

    fn mtp_drafts(&mut self, seq: &Seq, tokens: &[u32], k: usize) -> Result<Vec<u32>> {
        self.mtp_drafts_pass(seq.get()?, tokens, k)
    }

    /// Drafts pick among the first `n` tokens only (`None`: all): the draft's head is then
    /// that much smaller (FR-Spec trims it to the frequent tokens; BPE vocabularies number
    /// their merges about by frequency).
    fn set_draft_vocab(&mut self, n: Option<usize>) -> Result<()> {
        let v = self.hp.n_vocab;
        let n = n.unwrap_or(v);
        if n == 0 || n > v {
            return Err(Error::Invalid(format!(
                "--draft-vocab {n}: 1 to the vocabulary's {v}"
            )));
        }
        let full = &self.w.output;
        let draft = if n < v {
            let head = GpuTensor {
                name: format!("{} (first {n} rows)", full.name),
                dtype: full.dtype,
                shape: vec![n as u64, full.row_len()],
                parts: full
                    .parts
                    .iter()
                    .filter(|p| p.row_start < n as u64)
                    .map(|p| crate::gpu::TensorPart {
                        n_rows: p.n_rows.min(n as u64 - p.row_start),
                        ..p.clone()
                    })
                    .collect(),
            };
            let rows = self.scratch.rows as u32;
            Some((head, topk::LogitsTop::new(&self.gpu, rows, n as u32)?))
        } else {
            None
        };
        if let Some(m) = self.spec.mtp.as_mut() {
            m.draft = draft;
        }
        Ok(())
    }
}
