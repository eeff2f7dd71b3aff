//! Speculative decoding on the Qwen3.5 GPU forward: the MTP block that drafts tokens, the
//! verify pass whose rows carry the bits of one-token decode steps, and the rollback of the
//! recurrent state past a rejected draft.
//!
//! The MTP block (Qwen3-Next / Qwen3.5 `mtp.*`, llama.cpp `nextn`; vLLM's
//! `Qwen3NextMultiTokenPredictor`): row `p` reads the hidden state `h_p` the head saw at
//! position `p` and the token `t_{p+1}`, `x = fc([enorm(embed(t_{p+1})) | hnorm(h_p)])`, runs
//! one full-attention decoder layer at position `p` (its own KV cache, the layer after the
//! trunk's in the pools) and `norm`; the shared head gives the draft of `t_{p+2}`, and the
//! normed row is the hidden state of the next chained draft.

use super::*;
use crate::models::spec::{Hidden, Speculate};

/// Most rows of a verify pass (the drafted tokens plus one): up to here a MoE layer runs the
/// per-pair matvec of decode (`matvec::MAX_TOKENS`), whose rows have one-token bits.
pub const MAX_VERIFY: usize = crate::gpu::matvec::MAX_TOKENS as usize;

/// The MTP block's weights (its decoder layer is `GpuModel::w.layers[n_layer]`) and rows.
pub(super) struct MtpGpu {
    /// [n_embd, 2·n_embd]
    fc: GpuTensor,
    enorm: GpuTensor,
    hnorm: GpuTensor,
    norm: GpuTensor,
    /// [n_vocab, n_embd]; `None`: the trunk's.
    head: Option<GpuTensor>,
    embd: Option<GpuTensor>,
    /// [rows, 2·n_embd]: `enorm(embedding) | hnorm(hidden)` per row.
    cat: wgpu::Buffer,
    /// [rows, n_embd]: the hidden states the rows read.
    hid: wgpu::Buffer,
    /// [rows, n_embd]: the block's output after `norm` (the head's input).
    out: wgpu::Buffer,
    /// (slot, position, row of `out`) of the last row run: what a chained draft reads.
    last: Option<(u32, usize, u32)>,
    /// The head the drafts take: the model's, or its first rows only
    /// ([`Speculate::set_draft_vocab`]); the top-1 of each draft row.
    draft_head: Option<GpuTensor>,
    top: topk::LogitsTop,
    /// [2·MAX_VERIFY] u32: position and KV row of each chained draft row.
    stage: wgpu::Buffer,
    /// [slots·MAX_VERIFY, n_embd]: per sequence slot the last trunk rows of its last pass
    /// (`SpecState::saved`), so that other sequences' passes can run before its drafts.
    saved: wgpu::Buffer,
}

/// Where the hidden states of an MTP pass come from.
#[derive(Clone, Copy)]
enum Src {
    /// Rows of `Scratch::x` from this row on: the trunk's last pass.
    Scratch(u32),
    /// Rows of `MtpGpu::saved` from this row on.
    Saved(u32),
    /// Row of `MtpGpu::out`: the last MTP pass's output (a chained draft).
    Out(u32),
}

/// One slot's recurrent state saved before a verify pass: per layer (conv, GDN state).
struct Snap {
    slot: u32,
    pos: usize,
    bufs: Vec<Option<(wgpu::Buffer, wgpu::Buffer)>>,
}

/// What speculation keeps in the model.
#[derive(Default)]
pub struct SpecState {
    /// Run the next pass's rows through the decode kernels (recurrent GDN steps, one
    /// attention call per row): each row then has the bits of a one-token decode step.
    pub(super) exact: bool,
    /// (slot, first position, rows) of the last pass fed through [`Speculate`]: the rows
    /// `Scratch::x` still holds, whose hidden states the MTP block reads.
    pub(super) trunk: Option<(u32, usize, usize)>,
    /// Per slot (first position, rows) of the trunk rows `MtpGpu::saved` holds: the last
    /// (up to [`MAX_VERIFY`]) rows of the slot's last [`Speculate`] pass.
    saved: Vec<Option<(usize, usize)>>,
    /// Per slot its state before its last verify pass.
    snaps: std::collections::HashMap<u32, Snap>,
    pub(super) mtp: Option<MtpGpu>,
}

impl GpuModel {
    /// Take the MTP block out of the loaded weights: its layer goes after the trunk's (so
    /// the layer blocks and the pools serve it by index) with a KV cache of its own.
    pub(super) fn attach_mtp(&mut self) -> Result<()> {
        let Some(m) = self.w.mtp.take() else {
            return Ok(());
        };
        let weights::Mtp {
            fc,
            enorm,
            hnorm,
            norm,
            head,
            embd,
            layer,
        } = m;
        debug_assert_eq!(self.w.layers.len(), self.hp.n_layer);
        self.w.layers.push(layer);
        let p = &mut self.pools;
        let shape = state::kv_shape(&self.hp, self.kv_type);
        let rows = (p.slots * p.cap) as u64;
        p.kv.push(Some((
            self.gpu.buffer(shape.bytes(rows), "kv.k")?,
            self.gpu.buffer(shape.bytes(rows), "kv.v")?,
        )));
        p.conv.push(None);
        p.ssm.push(None);
        let (r, e) = (self.scratch.rows as u64, self.hp.n_embd as u64);
        self.spec.mtp = Some(MtpGpu {
            fc,
            enorm,
            hnorm,
            norm,
            head,
            embd,
            cat: self.gpu.buffer(r * 2 * e * 4, "mtp.cat")?,
            hid: self.gpu.buffer(r * e * 4, "mtp.hid")?,
            out: self.gpu.buffer(r * e * 4, "mtp.out")?,
            last: None,
            draft_head: None,
            top: topk::LogitsTop::new(&self.gpu, MAX_VERIFY as u32, self.hp.n_vocab as u32)?,
            stage: self.gpu.buffer(2 * MAX_VERIFY as u64 * 4, "mtp.stage")?,
            saved: self
                .gpu
                .buffer(p.slots as u64 * MAX_VERIFY as u64 * e * 4, "mtp.saved")?,
        });
        self.spec.saved = vec![None; p.slots];
        Ok(())
    }

    /// Saves each slot's conv and GDN state and position (one submission of copies), each
    /// into its own [`Snap`].
    fn save_states(&mut self, seqs: &[(u32, usize)]) -> Result<()> {
        let hp = &self.hp;
        let conv_len = ((hp.conv_kernel - 1) * hp.conv_dim() * 4) as u64;
        let ssm_len = (hp.n_v_heads * hp.d_k * hp.d_v * 4) as u64;
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        for &(slot, pos) in seqs {
            if !self.spec.snaps.contains_key(&slot) {
                let mut bufs = Vec::new();
                for l in 0..self.pools.conv.len() {
                    bufs.push(match self.pools.conv[l] {
                        Some(_) => Some((
                            self.gpu.buffer(conv_len, "spec.conv")?,
                            self.gpu.buffer(ssm_len, "spec.ssm")?,
                        )),
                        None => None,
                    });
                }
                self.spec.snaps.insert(slot, Snap { slot, pos, bufs });
            }
            let snap = self.spec.snaps.get_mut(&slot).expect("made above");
            let s = slot as u64;
            for (l, b) in snap.bufs.iter().enumerate() {
                if let (Some((c, h)), Some(pc), Some(ph)) =
                    (b, &self.pools.conv[l], &self.pools.ssm[l])
                {
                    enc.copy_buffer_to_buffer(pc, s * conv_len, c, 0, conv_len);
                    enc.copy_buffer_to_buffer(ph, s * ssm_len, h, 0, ssm_len);
                }
            }
            snap.pos = pos;
        }
        self.gpu.queue.submit([enc.finish()]);
        Ok(())
    }

    /// Puts back what [`GpuModel::save_states`] saved of `seq`; its position returns too.
    fn restore_state(&mut self, seq: &mut GpuSeq) -> Result<()> {
        let hp = &self.hp;
        let conv_len = ((hp.conv_kernel - 1) * hp.conv_dim() * 4) as u64;
        let ssm_len = (hp.n_v_heads * hp.d_k * hp.d_v * 4) as u64;
        let snap = match self.spec.snaps.get(&seq.slot) {
            Some(s) if s.slot == seq.slot && s.pos <= seq.pos => s,
            _ => {
                return Err(Error::Invalid(
                    "rollback without a verify pass of this sequence before it".into(),
                ))
            }
        };
        let s = seq.slot as u64;
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        for (l, b) in snap.bufs.iter().enumerate() {
            if let (Some((c, h)), Some(pc), Some(ph)) = (b, &self.pools.conv[l], &self.pools.ssm[l])
            {
                enc.copy_buffer_to_buffer(c, 0, pc, s * conv_len, conv_len);
                enc.copy_buffer_to_buffer(h, 0, ph, s * ssm_len, ssm_len);
            }
        }
        self.gpu.queue.submit([enc.finish()]);
        seq.pos = snap.pos;
        Ok(())
    }

    /// Copies the last (up to [`MAX_VERIFY`]) trunk rows of each `(slot, first row, first
    /// position, rows)` of the last round from `Scratch::x` to the slot's rows of
    /// `MtpGpu::saved` (one submission).
    fn save_trunks(&mut self, parts: &[(u32, usize, usize, usize)]) {
        let Some(m) = &self.spec.mtp else {
            return;
        };
        let w = self.hp.n_embd as u64 * 4;
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        for &(slot, row, pos0, n) in parts {
            let keep = n.min(MAX_VERIFY);
            let from = (row + n - keep) as u64 * w;
            let to = (slot as usize * MAX_VERIFY) as u64 * w;
            enc.copy_buffer_to_buffer(&self.scratch.x, from, &m.saved, to, keep as u64 * w);
            self.spec.saved[slot as usize] = Some((pos0 + n - keep, keep));
        }
        self.gpu.queue.submit([enc.finish()]);
    }

    /// The trunk rows an MTP pass over `n` tokens of `seq` reads: the last `n` rows of its
    /// last [`Speculate`] pass, which must have ended at its position. Returns their first
    /// position and where they are.
    fn trunk_src(&self, seq: &GpuSeq, n: usize) -> Option<(usize, Src)> {
        self.spec.mtp.as_ref()?;
        let ends_here = |p0: usize, r: usize| n > 0 && n <= r && p0 + r == seq.pos;
        if let Some(&Some((p0, r))) = self.spec.saved.get(seq.slot as usize) {
            if ends_here(p0, r) {
                let row = seq.slot as usize * MAX_VERIFY + r - n;
                return Some((p0 + r - n, Src::Saved(row as u32)));
            }
        }
        match self.spec.trunk {
            Some((slot, p0, r)) if slot == seq.slot && ends_here(p0, r) => {
                Some((p0 + r - n, Src::Scratch((r - n) as u32)))
            }
            _ => None,
        }
    }

    /// One pass over several sequences' tokens (`items`, each at most [`MAX_VERIFY`]
    /// tokens when `exact`; the rows together at most `Scratch::rows`) in one round;
    /// `exact`: through the decode kernels. Per row the logits its `want` asks for (`Top`
    /// and `All` per row; `Last` as `All`). Keeps each sequence's last trunk rows.
    fn spec_round(
        &mut self,
        items: &mut [(&mut GpuSeq, &[u32], Want)],
        exact: bool,
    ) -> Result<Vec<Vec<Logits>>> {
        let mut total = 0;
        for (_, t, w) in items.iter() {
            self.check_tokens(t)?;
            crate::forward::check_want(*w)?;
            if t.is_empty() {
                return Err(Error::Invalid("a speculative pass of 0 tokens".into()));
            }
            total += t.len();
        }
        if total > self.scratch.rows {
            return Err(Error::Invalid(format!(
                "a speculative pass of {total} tokens (1..={} in one pass)",
                self.scratch.rows
            )));
        }
        self.spec.trunk = None;
        // Multi-token parts first, single tokens at the end (the batched decode attention
        // call covers those).
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by_key(|&i| items[i].1.len() == 1);
        let mut parts = Vec::with_capacity(items.len());
        let mut toks = Vec::with_capacity(total);
        let mut top = TopReq::default();
        let mut wants = Vec::new();
        for &i in &order {
            let (seq, t, want) = &items[i];
            let (row, n) = (toks.len(), t.len());
            parts.push(Part {
                item: i,
                start: 0,
                n,
                row,
                slot: seq.slot,
                pos0: seq.pos,
                rowwise: n == 1,
            });
            toks.extend_from_slice(t);
            match *want {
                Want::Top { k, lse } => {
                    top.rows.extend(row..row + n);
                    top.k = top.k.max(k);
                    top.lse |= lse;
                }
                Want::All | Want::Last => wants.push((row, n)),
                Want::None => {}
            }
        }
        self.spec.exact = exact;
        let r = self.run_round(&parts, &toks, &wants, &top);
        self.spec.exact = false;
        let (logits, tops) = r?;
        let v = self.hp.n_vocab;
        let mut out: Vec<Vec<Logits>> = items.iter().map(|_| Vec::new()).collect();
        let (mut logits, mut tops) = (logits.chunks_exact(v), tops.into_iter());
        for p in &parts {
            let o = &mut out[p.item];
            match items[p.item].2 {
                Want::Top { k, lse } => {
                    for _ in 0..p.n {
                        let mut t = tops.next().ok_or_else(|| {
                            Error::Gpu("the round returned too few top-logits rows".into())
                        })?;
                        t.cands.truncate(k as usize);
                        if !lse {
                            t.lse = None;
                        }
                        o.push(Logits::Top(t));
                    }
                }
                Want::All | Want::Last => {
                    for _ in 0..p.n {
                        let r = logits.next().ok_or_else(|| {
                            Error::Gpu("the round returned too few logits rows".into())
                        })?;
                        o.push(Logits::Full(r.to_vec()));
                    }
                }
                Want::None => {}
            }
        }
        let kept: Vec<_> = parts.iter().map(|p| (p.slot, p.row, p.pos0, p.n)).collect();
        self.save_trunks(&kept);
        if let [p] = &parts[..] {
            self.spec.trunk = Some((p.slot, p.pos0, p.n));
        }
        for (seq, t, _) in items.iter_mut() {
            seq.pos += t.len();
        }
        Ok(out)
    }

    /// Passes through the decode kernels over several sequences, in rounds of up to
    /// [`MAX_VERIFY`] rows (the most rows whose products run decode's matvec), each row
    /// with a one-token decode step's bits; `save`:
    /// each sequence's state is saved first, for a rollback (a verify pass,
    /// [`Speculate::verify_batch`]).
    fn rounds(
        &mut self,
        items: &mut [(&mut GpuSeq, &[u32], Want)],
        save: bool,
    ) -> Result<Vec<Vec<Logits>>> {
        let max = self.max_verify();
        if let Some((_, t, _)) = items.iter().find(|(_, t, _)| t.is_empty() || t.len() > max) {
            return Err(Error::Invalid(format!(
                "a verify pass of {} tokens (1..={max})",
                t.len()
            )));
        }
        let mut out = Vec::with_capacity(items.len());
        let mut rest = items;
        while !rest.is_empty() {
            let mut rows = 0;
            let n = rest
                .iter()
                .take_while(|(_, t, _)| {
                    rows += t.len();
                    rows <= max
                })
                .count();
            let (round, tail) = rest.split_at_mut(n);
            if save {
                let seqs: Vec<(u32, usize)> =
                    round.iter().map(|(s, _, _)| (s.slot, s.pos)).collect();
                self.save_states(&seqs)?;
            }
            out.extend(self.spec_round(round, true)?);
            rest = tail;
        }
        Ok(out)
    }

    /// The MTP block over `tokens` (see the module doc). `Hidden::Trunk`: row `j` reads
    /// row `j` of the last [`Speculate`] pass of `seq` (as many rows, from its first
    /// position); `Hidden::Chain`: one row after the last MTP row, reading its output.
    /// `Want::Top`: the last row's best logits; `All`: every row's logits.
    fn mtp_pass(
        &mut self,
        seq: &GpuSeq,
        hidden: Hidden,
        tokens: &[u32],
        want: Want,
    ) -> Result<Vec<Logits>> {
        self.check_tokens(tokens)?;
        crate::forward::check_want(want)?;
        let n = tokens.len();
        let Some(m) = &self.spec.mtp else {
            return Err(Error::Invalid("the model has no MTP block".into()));
        };
        let (pos0, src) = match hidden {
            Hidden::Trunk => self.trunk_src(seq, n).ok_or_else(|| {
                Error::Invalid(format!(
                    "MTP over {n} trunk rows: the last pass of this sequence fed fewer"
                ))
            })?,
            Hidden::Chain => match m.last {
                Some((slot, p, row)) if slot == seq.slot && n == 1 => (p + 1, Src::Out(row)),
                _ => {
                    return Err(Error::Invalid(
                        "a chained MTP draft needs one token after an MTP row of this sequence"
                            .into(),
                    ))
                }
            },
        };
        let n = n as u32;
        if n as usize > self.scratch.rows
            || n as usize > self.scratch.logit_rows && want == Want::All
        {
            return Err(Error::Invalid(format!("MTP pass of {n} rows")));
        }
        let gpu = self.gpu.clone();
        let mut pass = gpu.pass();
        self.reserve(&mut pass, pos0 + n as usize)?;
        self.write_rows(seq.slot, pos0, tokens);
        self.record_mtp(&mut pass, seq.slot, pos0, n, src)?;
        // This pass overwrites the rows of `Scratch::x` (`MtpGpu::saved` keeps its own).
        self.spec.trunk = None;
        let hp = &self.hp;
        let e = hp.n_embd as u32;
        let sc = &self.scratch;
        let m = self.spec.mtp.as_ref().expect("checked above");
        let head = m
            .head
            .as_ref()
            .or(self.w.output.as_ref())
            .unwrap_or(&self.w.tok_embd);
        let v = hp.n_vocab;
        let out = match want {
            Want::Top { k, lse } => {
                matmul::matmul(
                    &mut pass,
                    head,
                    Operand::new(&m.out, (n - 1) * e),
                    Operand::new(&sc.logits, 0),
                    1,
                )?;
                sc.top
                    .record(&mut pass, Operand::new(&sc.logits, 0), 1, 0, k, lse)?;
                pass.submit()?;
                sc.top
                    .read(&gpu, 1, k, lse)?
                    .into_iter()
                    .map(Logits::Top)
                    .collect()
            }
            Want::None => {
                pass.submit()?;
                Vec::new()
            }
            Want::All | Want::Last => {
                matmul::matmul(
                    &mut pass,
                    head,
                    Operand::new(&m.out, 0),
                    Operand::new(&sc.logits, 0),
                    n,
                )?;
                pass.submit()?;
                gpu.read_f32(&sc.logits, 0, n as usize * v)?
                    .chunks_exact(v)
                    .map(|r| Logits::Full(r.to_vec()))
                    .collect()
            }
        };
        let m = self.spec.mtp.as_mut().expect("checked above");
        m.last = Some((seq.slot, pos0 + n as usize - 1, n - 1));
        Ok(out)
    }

    /// `k` greedy drafts in one submission: the MTP rows over the trunk's last pass (the
    /// last reading `tokens`' last), then `k - 1` chained rows, each fed the pick of the
    /// row before it on the GPU (positions and KV rows copied in from `MtpGpu::stage`).
    /// Picks from `MtpGpu::draft_head`'s rows.
    fn mtp_drafts_pass(&mut self, seq: &GpuSeq, tokens: &[u32], k: usize) -> Result<Vec<u32>> {
        self.check_tokens(tokens)?;
        let n = tokens.len();
        let (pos0, src) = self.trunk_src(seq, n).ok_or_else(|| {
            Error::Invalid(format!(
                "MTP drafts over {n} trunk rows: the last pass of this sequence fed fewer, or \
                 the model has no MTP block"
            ))
        })?;
        if k == 0 || k > MAX_VERIFY {
            return Err(Error::Invalid(format!("{k} drafts (1..={MAX_VERIFY})")));
        }
        let gpu = self.gpu.clone();
        let mut pass = gpu.pass();
        self.reserve(&mut pass, pos0 + n + k)?;
        self.write_rows(seq.slot, pos0, tokens);
        let cap = self.pools.cap as u32;
        let last = (pos0 + n - 1) as u32;
        let stage: Vec<u32> = (1..k as u32)
            .flat_map(|j| [last + j, seq.slot * cap + last + j])
            .collect();
        let e = self.hp.n_embd as u32;
        let m = self.spec.mtp.as_ref().expect("checked above");
        if !stage.is_empty() {
            gpu.write(&m.stage, 0, bytemuck::cast_slice(&stage));
        }
        let head = m
            .draft_head
            .as_ref()
            .or(m.head.as_ref())
            .or(self.w.output.as_ref())
            .unwrap_or(&self.w.tok_embd);
        let sc = &self.scratch;
        self.record_mtp(&mut pass, seq.slot, pos0, n as u32, src)?;
        let mut row = n as u32 - 1;
        for j in 0..k as u32 {
            if j > 0 {
                let (ids, off) = m.top.id_at(j - 1, 1);
                pass.copy(ids, off, &sc.ids, 0, 4);
                pass.copy(&m.stage, (2 * (j - 1) * 4) as u64, &sc.pos, 0, 4);
                pass.copy(&m.stage, ((2 * (j - 1) + 1) * 4) as u64, &sc.kv_rows, 0, 4);
                self.record_mtp(&mut pass, seq.slot, (last + j) as usize, 1, Src::Out(row))?;
                row = 0;
            }
            matmul::matmul(
                &mut pass,
                head,
                Operand::new(&m.out, row * e),
                Operand::new(&sc.logits, 0),
                1,
            )?;
            m.top
                .record(&mut pass, Operand::new(&sc.logits, 0), 1, j, 1, false)?;
        }
        pass.submit()?;
        self.spec.trunk = None;
        let picks = m.top.read(&gpu, k as u32, 1, false)?;
        let ids = picks
            .iter()
            .map(|t| t.cands.first().map(|c| c.0))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| Error::Gpu("an MTP draft row had no pick".into()))?;
        let m = self.spec.mtp.as_mut().expect("checked above");
        m.last = Some((seq.slot, last as usize + k - 1, row));
        Ok(ids)
    }

    /// Drafts pick among the first `n` tokens of the vocabulary only (`None`: all): the
    /// head of a draft is then that much smaller (FR-Spec trims it to the frequent tokens;
    /// BPE vocabularies number their merges about by frequency).
    fn draft_vocab(&mut self, n: Option<usize>) -> Result<()> {
        let v = self.hp.n_vocab;
        let n = n.unwrap_or(v);
        if n == 0 || n > v {
            return Err(Error::Invalid(format!(
                "--draft-vocab {n}: 1 to the vocabulary's {v}"
            )));
        }
        let full = self.spec.mtp.as_ref().and_then(|m| m.head.clone());
        let full = full
            .or_else(|| self.w.output.clone())
            .unwrap_or_else(|| self.w.tok_embd.clone());
        let Some(m) = self.spec.mtp.as_mut() else {
            return Ok(());
        };
        m.top = topk::LogitsTop::new(&self.gpu, MAX_VERIFY as u32, n as u32)?;
        m.draft_head = (n < v).then(|| GpuTensor {
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
        });
        Ok(())
    }

    /// Token ids, positions and KV rows of `tokens` at `pos0..` of slot `slot` into the
    /// scratch (element 0 on).
    fn write_rows(&self, slot: u32, pos0: usize, tokens: &[u32]) {
        let cap = self.pools.cap as u32;
        let pos: Vec<u32> = (0..tokens.len() as u32).map(|j| pos0 as u32 + j).collect();
        let kv_rows: Vec<u32> = pos.iter().map(|p| slot * cap + p).collect();
        let sc = &self.scratch;
        self.gpu.write(&sc.ids, 0, bytemuck::cast_slice(tokens));
        self.gpu.write(&sc.pos, 0, bytemuck::cast_slice(&pos));
        self.gpu
            .write(&sc.kv_rows, 0, bytemuck::cast_slice(&kv_rows));
    }

    /// Records the MTP block over `n` rows of slot `slot` at `pos0..` whose ids, positions
    /// and KV rows are in the scratch: hidden states from trunk rows (normed as the head saw
    /// them) or from a row of the block's last output (`src`); the output (after the
    /// block's norm) into `MtpGpu::out`.
    fn record_mtp(
        &self,
        pass: &mut Pass<'_>,
        slot: u32,
        pos0: usize,
        n: u32,
        src: Src,
    ) -> Result<()> {
        let sc = &self.scratch;
        let hp = &self.hp;
        let e = hp.n_embd as u32;
        let m = self
            .spec
            .mtp
            .as_ref()
            .expect("the callers check for the block");
        let trunk = match src {
            Src::Scratch(r) => Some(Operand::new(&sc.x, r * e)),
            Src::Saved(r) => Some(Operand::new(&m.saved, r * e)),
            Src::Out(r) => {
                ew::copy(
                    pass,
                    1,
                    e,
                    Operand::new(&m.hid, 0),
                    Operand::new(&m.out, r * e),
                )?;
                None
            }
        };
        if let Some(rows) = trunk {
            // The trunk's rows as its head saw them.
            norm::rms_norm(
                pass,
                n,
                e,
                rows,
                Some(Operand::new(&m.hid, 0)),
                Some(&self.w.output_norm),
                hp.eps,
            )?;
        }
        let embd = m.embd.as_ref().unwrap_or(&self.w.tok_embd);
        embed::embed(pass, embd, &sc.ids, 0, n, Operand::new(&sc.x, 0))?;
        norm::rms_norm(
            pass,
            n,
            e,
            Operand::new(&sc.x, 0),
            Some(Operand::strided(&m.cat, 0, 2 * e)),
            Some(&m.enorm),
            hp.eps,
        )?;
        norm::rms_norm(
            pass,
            n,
            e,
            Operand::new(&m.hid, 0),
            Some(Operand::strided(&m.cat, e, 2 * e)),
            Some(&m.hnorm),
            hp.eps,
        )?;
        matmul::matmul(
            pass,
            &m.fc,
            Operand::new(&m.cat, 0),
            Operand::new(&sc.x, 0),
            n,
        )?;
        let l = hp.n_layer;
        let lw = &self.w.layers[l];
        let parts = [Part {
            item: 0,
            start: 0,
            n: n as usize,
            row: 0,
            slot,
            pos0,
            rowwise: n == 1,
        }];
        norm::rms_norm(
            pass,
            n,
            e,
            Operand::new(&sc.x, 0),
            Some(Operand::new(&sc.h, 0)),
            Some(&lw.attn_norm),
            hp.eps,
        )?;
        self.attn_block(pass, &parts, l, n, None, None)?;
        norm::rms_norm(
            pass,
            n,
            e,
            Operand::new(&sc.x, 0),
            Some(Operand::new(&sc.h, 0)),
            Some(&lw.post_norm),
            hp.eps,
        )?;
        self.ffn_block(pass, l, &lw.ffn, n, None, None)?;
        norm::rms_norm(
            pass,
            n,
            e,
            Operand::new(&sc.x, 0),
            Some(Operand::new(&m.out, 0)),
            Some(&m.norm),
            hp.eps,
        )?;
        Ok(())
    }

    /// The hidden states the last MTP pass read, `[rows, n_embd]` (tests: the reference
    /// block gets the same input).
    pub fn mtp_hidden(&self, rows: usize) -> Result<Vec<f32>> {
        let m = self
            .spec
            .mtp
            .as_ref()
            .ok_or_else(|| Error::Invalid("the model has no MTP block".into()))?;
        self.gpu.read_f32(&m.hid, 0, rows * self.hp.n_embd)
    }
}

impl Speculate for GpuModel {
    fn has_mtp(&self) -> bool {
        self.spec.mtp.is_some()
    }
    fn max_verify(&self) -> usize {
        MAX_VERIFY.min(self.scratch.rows)
    }
    fn pass_rows(&self) -> usize {
        self.scratch.rows
    }
    fn feed(&mut self, seq: &mut Seq, tokens: &[u32], want: Want) -> Result<Vec<Logits>> {
        let s: &mut GpuSeq = seq.get_mut()?;
        let pos0 = s.pos;
        let out = self.forward_batch(&mut [(&mut *s, tokens, want)])?;
        // One round of the model's pass size leaves every row in the scratch.
        if tokens.len() <= self.scratch.rows {
            self.spec.trunk = Some((s.slot, pos0, tokens.len()));
            self.save_trunks(&[(s.slot, 0, pos0, tokens.len())]);
        }
        Ok(out)
    }
    fn verify(&mut self, seq: &mut Seq, tokens: &[u32], want: Want) -> Result<Vec<Logits>> {
        let per_row = match want {
            Want::All | Want::Last => Want::All,
            w => w,
        };
        let mut out = self.rounds(&mut [(seq.get_mut()?, tokens, per_row)], true)?;
        Ok(out.pop().unwrap_or_default())
    }
    fn verify_batch(&mut self, items: &mut [(&mut Seq, &[u32], Want)]) -> Result<Vec<Vec<Logits>>> {
        let mut v: Vec<(&mut GpuSeq, &[u32], Want)> = Vec::with_capacity(items.len());
        for (s, t, w) in items.iter_mut() {
            let per_row = match *w {
                Want::All | Want::Last => Want::All,
                w => w,
            };
            v.push((s.get_mut()?, *t, per_row));
        }
        self.rounds(&mut v, true)
    }
    fn rollback(&mut self, seq: &mut Seq, keep: &[u32]) -> Result<()> {
        self.rollback_batch(&mut [(seq, keep)])
    }
    fn rollback_batch(&mut self, items: &mut [(&mut Seq, &[u32])]) -> Result<()> {
        let mut v: Vec<(&mut GpuSeq, &[u32], Want)> = Vec::with_capacity(items.len());
        for (seq, keep) in items.iter_mut() {
            let s = seq.get_mut()?;
            self.restore_state(s)?;
            if !keep.is_empty() {
                v.push((s, *keep, Want::None));
            }
        }
        self.spec.trunk = None;
        self.rounds(&mut v, false).map(drop)
    }
    fn mtp(
        &mut self,
        seq: &Seq,
        hidden: Hidden,
        tokens: &[u32],
        want: Want,
    ) -> Result<Vec<Logits>> {
        self.mtp_pass(seq.get()?, hidden, tokens, want)
    }
    fn mtp_hidden(&self, rows: usize) -> Result<Vec<f32>> {
        GpuModel::mtp_hidden(self, rows)
    }
    fn mtp_drafts(&mut self, seq: &Seq, tokens: &[u32], k: usize) -> Result<Vec<u32>> {
        self.mtp_drafts_pass(seq.get()?, tokens, k)
    }
    fn set_draft_vocab(&mut self, n: Option<usize>) -> Result<()> {
        self.draft_vocab(n)
    }
}
