//! Speculative decoding on the Step-3.7 forward: the MTP block that drafts, verify passes
//! whose rows are one-token decode steps, and the rollback.
//!
//! The MTP block (llama.cpp's `step35.cpp` `graph_mtp`, vLLM's `step3p5_mtp`): row `p` reads
//! the residual stream `h_p` the trunk left at position `p` (before the final norm) and the
//! token `t_{p+1}`: `x = eh_proj([enorm(embed(t_{p+1})) | hnorm(h_p)])`, one decoder block
//! of the trunk's kind (its own KV rows) at position `p`, then `shared_head_norm` and
//! `shared_head_head` (the file's `output_norm` / `output` where it has none) give the draft
//! of `t_{p+2}`. The block's output before that norm is the hidden state of the next
//! chained draft.
//!
//! Step ships the block in a GGUF of its own (llama.cpp's converter `--mtp`): its
//! `block_count` and per-layer arrays count the trunk's blocks and the MTP block, the
//! trunk's file (`--no-mtp`) only its own, so the block's geometry, clamps and tensors come
//! from the draft file, checked against the trunk. A file that holds both (HF checkpoints,
//! a GGUF converted without either flag) needs no second file.
//!
//! Verify passes run their rows as one-token passes, so each row has a decode step's bits
//! by construction. Rollback needs no saved state: every KV row is addressed by position
//! and a row past the sequence's position is rewritten before any query reads it.

use super::*;
use crate::model_file::WeightRole;
use crate::models::spec::{Hidden, Speculate};
use crate::models::Seq;
use std::collections::HashMap;

/// Most rows of a verify pass (the drafts plus one), as the other families'.
const MAX_VERIFY: usize = crate::gpu::matvec::MAX_TOKENS as usize;

/// The MTP block's weights and row buffers.
pub(super) struct Mtp {
    pub(super) layer: Layer,
    /// `[n_embd]` each (as `1+w`).
    enorm: GpuTensor,
    hnorm: GpuTensor,
    /// `[n_embd, 2·n_embd]` over `[enorm(embed t) | hnorm(h)]`.
    eh_proj: GpuTensor,
    /// `[n_embd]` and `[n_vocab, n_embd]`.
    head_norm: GpuTensor,
    head: GpuTensor,
    /// `[rows, 2·n_embd]`: the concatenated norms.
    cat: wgpu::Buffer,
    /// `[rows, n_embd]`: the hidden rows the last MTP pass read.
    hid: wgpu::Buffer,
    /// `[rows, n_embd]`: the block's output rows (what a chained draft reads).
    out: wgpu::Buffer,
    /// (sequence, position, row of `out`) of the last row run.
    last: Option<(u64, usize, u32)>,
    /// Rows of the last MTP pass.
    rows: usize,
}

/// What speculation keeps per sequence.
#[derive(Default)]
pub(super) struct SpecState {
    /// `[pass rows, n_embd]` trunk rows of the sequence's last [`Speculate`] pass, their first
    /// position and count.
    saved: HashMap<u64, (wgpu::Buffer, usize, usize)>,
    /// Its position before its last verify pass.
    verify: HashMap<u64, usize>,
}

/// The file that holds the MTP block (`--mtp-model`, else the trunk's file when it has the
/// block's tensors) and its hyper-parameters, checked against the trunk's `hp`; `None`
/// where there is none.
pub(super) fn open_draft(
    file: &ModelFile,
    hp: &Hparams,
    opts: &LoadOptions,
) -> Result<Option<(ModelFile, Hparams)>> {
    let draft = match &opts.mtp_model {
        Some(path) => ModelFile::open(path)?,
        None => {
            let l = hp.n_layer;
            if hp.n_nextn == 0 || file.tensor(&W::EhProj(l).name(file)).is_none() {
                return Ok(None);
            }
            ModelFile::open(file.path())?
        }
    };
    let path = draft.path();
    let dhp = Hparams::from_file(&draft)?;
    let bad = |what: String| Err(Error::format(&path, what));
    if dhp.n_nextn == 0 {
        return bad("declares no MTP block (nextn_predict_layers), so it is no MTP file".into());
    }
    let trunk = file.path();
    let t = trunk.display();
    for (what, d, m) in [
        ("n_embd", dhp.n_embd, hp.n_embd),
        ("n_vocab", dhp.n_vocab, hp.n_vocab),
        ("head_dim", dhp.head_dim, hp.head_dim),
        ("trunk blocks", dhp.n_layer, hp.n_layer),
    ] {
        if d != m {
            return bad(format!("{what} {d}, but the model {t} has {m}"));
        }
    }
    let g = dhp.layers[dhp.n_layer];
    if g.moe {
        let (a, b) = (dhp.moe.as_ref(), hp.moe.as_ref());
        let same = a.zip(b).is_some_and(|(a, b)| {
            (a.n_expert, a.n_used, a.n_ff_exp, a.n_ff_shexp, a.norm)
                == (b.n_expert, b.n_used, b.n_ff_exp, b.n_ff_shexp, b.norm)
                && a.scale == b.scale
        });
        if !same {
            return bad(format!("an MTP block whose experts differ from {t}'s"));
        }
    } else if dhp.n_ff != hp.n_ff {
        return bad(format!("FFN width {}, but {t} has {}", dhp.n_ff, hp.n_ff));
    }
    if g.swa && dhp.window != hp.window {
        return bad(format!(
            "sliding window {}, but {t} has {}",
            dhp.window, hp.window
        ));
    }
    Ok(Some((draft, dhp)))
}

/// What the MTP block of `draft` (from [`open_draft`]) adds to the trunk's [`needs_part`]
/// for `run`: its own KV rows, its row buffers, and, where it comes from a file apart from
/// the trunk's (`--mtp-model`), the weights [`Mtp::load`] uploads from that file, which the
/// trunk's `MoeInfo::other_bytes` cannot count. (In a file holding both, the block's
/// tensors are the trunk file's head tensors and already counted there.)
pub(super) fn draft_needs(
    file: &ModelFile,
    draft: &ModelFile,
    dhp: &Hparams,
    run: RunShape,
) -> Needs {
    let l = dhp.n_layer;
    let g = &dhp.layers[l];
    let seqs = run.seqs.max(1);
    let kv_elem: u64 = if run.kv == KvType::F32 { 4 } else { 2 };
    let kv = kv_shape(dhp, g, run.kv).bytes(seqs * kv::first_cap(run.ctx as usize) as u64);
    let weights = if draft.path() == file.path() {
        0
    } else {
        // The block's tensors, and the file's head where the block ships none of its own.
        let borrowed = [
            (W::SharedHead(l), W::Output),
            (W::SharedHeadNorm(l), W::OutputNorm),
        ]
        .map(|(own, shared)| {
            let has = |w: W| draft.tensor(&w.name(draft)).is_some();
            (!has(own)).then(|| shared.name(draft))
        });
        draft
            .tensors()
            .filter(|t| {
                PartSpec::role(t.name, l + 1, "", false) == WeightRole::Layer(l)
                    || borrowed.iter().flatten().any(|n| n == t.name)
            })
            .map(|t| t.data.len() as u64)
            .sum()
    };
    let e = dhp.n_embd as u64;
    Needs {
        weights,
        kv_per_token: 2 * (g.n_head_kv * dhp.head_dim) as u64 * kv_elem * seqs,
        state: 0,
        // `cat`, `hid` and `out` of [`Mtp`] and the trunk rows speculation saves per sequence.
        activations: run.batch.max(1) * 4 * e * 4 + seqs * run.batch.max(1) * e * 4,
        buffers: vec![
            PassBuffer::bound("step37.mtp.kv.k", kv),
            PassBuffer::bound("step37.mtp.kv.v", kv),
        ],
        kv_elem,
        note: None,
    }
}

impl Mtp {
    /// The block of `file` (`dhp`, checked by [`open_draft`]) for passes of `rows` rows.
    pub(super) fn load(
        gpu: &Gpu,
        file: &ModelFile,
        dhp: &Hparams,
        hp: &Hparams,
        rows: usize,
        put: &dyn Fn(Weight<'_>) -> Result<GpuTensor>,
    ) -> Result<Mtp> {
        let l = dhp.n_layer;
        let gated = Hparams::gated(file)?;
        let freqs = rope_freqs(file)?;
        let src = LayerSrc {
            gpu,
            file,
            hp: dhp,
            gated,
            offloaded: false,
            rope_freqs: freqs.as_deref(),
            put,
        };
        let layer = load_layer(&src, l)?;
        let (e, v) = (hp.n_embd as u64, hp.n_vocab as u64);
        let norm = |w: W| put(norm_weight(file, w, e)?);
        let has = |w: W| file.tensor(&w.name(file)).is_some();
        let head_norm = match has(W::SharedHeadNorm(l)) {
            true => norm(W::SharedHeadNorm(l))?,
            false => norm(W::OutputNorm)?,
        };
        let head = match has(W::SharedHead(l)) {
            true => W::SharedHead(l),
            false => W::Output,
        };
        let buf = |n: u64, label| gpu.buffer(rows as u64 * n * 4, label);
        Ok(Mtp {
            layer,
            enorm: norm(W::ENorm(l))?,
            hnorm: norm(W::HNorm(l))?,
            eh_proj: put(Weight::Stored(shaped(file, W::EhProj(l), &[e, 2 * e])?))?,
            head_norm,
            head: put(Weight::Stored(shaped(file, head, &[v, e])?))?,
            cat: buf(2 * e, "step37.mtp.cat")?,
            hid: buf(e, "step37.mtp.hid")?,
            out: buf(e, "step37.mtp.out")?,
            last: None,
            rows: 0,
        })
    }
}

impl GpuModel {
    /// Copies rows `[0, n)` of the residual stream the last pass left in `x` to the rows
    /// of sequence `id` kept for the MTP block, from row `at` on; they then hold positions
    /// `first ..` (`at + n` of them).
    fn keep_rows(&mut self, id: u64, first: usize, at: usize, n: usize) -> Result<()> {
        if self.mtp.is_none() {
            return Ok(());
        }
        let w = (self.hp.n_embd * 4) as u64;
        if !self.spec.saved.contains_key(&id) {
            let b = self
                .gpu
                .buffer(self.scratch.rows as u64 * w, "step37.mtp.saved")?;
            self.spec.saved.insert(id, (b, 0, 0));
        }
        let saved = self.spec.saved.get_mut(&id).expect("made above");
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&self.scratch.x, 0, &saved.0, at as u64 * w, n as u64 * w);
        self.gpu.queue.submit([enc.finish()]);
        (saved.1, saved.2) = (first, at + n);
        Ok(())
    }

    /// The MTP block over `tokens` at `pos0 ..`, reading hidden rows from row `src_row` of
    /// `src` (`[rows, n_embd]`), its head as `want` asks; per row its logits.
    fn mtp_rows(
        &mut self,
        seq: &StepSeq,
        src: Src,
        pos0: usize,
        tokens: &[u32],
        want: Want,
    ) -> Result<Vec<Logits>> {
        crate::forward::check_want(want)?;
        let n = tokens.len();
        if n == 0 || n > self.scratch.rows {
            return Err(Error::Invalid(format!("an MTP pass of {n} rows")));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.hp.n_vocab) {
            return Err(Error::Invalid(format!(
                "token id {t} is outside the vocabulary of {}",
                self.hp.n_vocab
            )));
        }
        let gpu = self.gpu.clone();
        let mut pass = gpu.pass();
        self.pools.reserve(&mut pass, pos0 + n)?;
        let part = Part {
            item: 0,
            start: 0,
            n,
            row: 0,
            pos0,
            rowwise: n == 1,
            slot: seq.slot.index,
        };
        let l = self.hp.n_layer;
        let pair = (
            self.pools.blocks[l].cap,
            window(&self.hp, &self.hp.layers[l]),
        );
        self.scratch.tables.write(&gpu, &[part], [pair])?;
        let (hp, sc) = (&self.hp, &self.scratch);
        let m = self.mtp.as_ref().expect("callers check the block");
        let (e, nt) = (hp.n_embd as u32, n as u32);
        let (src_buf, src_row) = match src {
            Src::Saved(row) => (&self.spec.saved[&seq.id].0, row),
            Src::Out(row) => (&m.out, row),
        };
        let w = e as u64 * 4;
        pass.copy(src_buf, src_row as u64 * w, &m.hid, 0, n as u64 * w);
        gpu.write(&sc.ids, 0, bytemuck::cast_slice(tokens));
        embed::embed(
            &mut pass,
            &self.tok_embd,
            &sc.ids,
            0,
            nt,
            Operand::new(&sc.h, 0),
        )?;
        let halves = [(&sc.h, &m.enorm, 0), (&m.hid, &m.hnorm, e)];
        for (x, norm_w, off) in halves {
            norm::rms_norm(
                &mut pass,
                nt,
                e,
                Operand::new(x, 0),
                Some(Operand::strided(&m.cat, off, 2 * e)),
                Some(norm_w),
                hp.eps,
            )?;
        }
        linear(&mut pass, &m.eh_proj, &m.cat, &sc.x, nt, false)?;
        self.block(&mut pass, l, &m.layer, &[part], nt)?;
        pass.copy(&sc.x, 0, &m.out, 0, n as u64 * w);
        let mut top = TopReq::default();
        let wants = match want {
            Want::All => vec![(0, n)],
            Want::Last => vec![(n - 1, 1)],
            Want::Top { k, lse } => {
                top = TopReq {
                    k,
                    lse,
                    rows: vec![n - 1],
                };
                Vec::new()
            }
            Want::None => Vec::new(),
        };
        let head = (&m.head_norm, &m.head);
        let (logits, tops) = self.head(pass, nt, (&wants, &top), head, false, None)?;
        let top = tops.into_iter().next();
        let m = self.mtp.as_mut().expect("checked above");
        m.last = Some((seq.id, pos0 + n - 1, nt - 1));
        m.rows = n;
        let v = self.hp.n_vocab;
        Ok(match (want, top) {
            (_, Some(t)) => vec![Logits::Top(t)],
            (Want::None, _) => Vec::new(),
            _ => logits
                .chunks_exact(v)
                .map(|r| Logits::Full(r.to_vec()))
                .collect(),
        })
    }

    /// The MTP block over `tokens`, reading what `hidden` names (see [`Hidden`]).
    fn mtp_pass(
        &mut self,
        seq: &StepSeq,
        hidden: Hidden,
        tokens: &[u32],
        want: Want,
    ) -> Result<Vec<Logits>> {
        let Some(m) = &self.mtp else {
            return Err(Error::Invalid("the model has no MTP block".into()));
        };
        let n = tokens.len();
        let (src, pos0) = match hidden {
            Hidden::Trunk => match self.spec.saved.get(&seq.id) {
                Some(&(_, first, count)) if n > 0 && n <= count && first + count == seq.pos => {
                    (Src::Saved((count - n) as u32), first + count - n)
                }
                _ => {
                    return Err(Error::Invalid(format!(
                        "MTP over {n} trunk rows: the last pass of this sequence fed fewer"
                    )))
                }
            },
            Hidden::Chain => match m.last {
                Some((id, p, row)) if id == seq.id && n == 1 => (Src::Out(row), p + 1),
                _ => {
                    return Err(Error::Invalid(
                        "a chained MTP draft needs one token after an MTP row of this sequence"
                            .into(),
                    ))
                }
            },
        };
        self.mtp_rows(seq, src, pos0, tokens, want)
    }
}

/// Where an MTP pass reads its hidden rows: the sequence's kept trunk rows or the last
/// MTP pass's output, from this row.
#[derive(Clone, Copy)]
enum Src {
    Saved(u32),
    Out(u32),
}

fn top1(l: &[Logits]) -> Result<u32> {
    match l.last() {
        Some(Logits::Top(t)) => t
            .cands
            .first()
            .map(|c| c.0)
            .ok_or_else(|| Error::Gpu("an MTP draft row had no pick".into())),
        _ => Err(Error::Gpu(
            "an MTP draft row came back without its top".into(),
        )),
    }
}

impl Speculate for GpuModel {
    fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }
    fn max_verify(&self) -> usize {
        MAX_VERIFY
    }
    fn pass_rows(&self) -> usize {
        self.scratch.rows
    }

    fn feed(&mut self, seq: &mut Seq, tokens: &[u32], want: Want) -> Result<Vec<Logits>> {
        let s: &mut StepSeq = seq.get_mut()?;
        let (id, pos0, n) = (s.id, s.pos, tokens.len());
        let out = self.run_items(&mut [(s, tokens, want)])?;
        // A feed of one pass leaves its rows in `x`; a longer one keeps none.
        match n <= self.scratch.rows {
            true => self.keep_rows(id, pos0, 0, n)?,
            false => drop(self.spec.saved.remove(&id)),
        }
        Ok(out)
    }

    /// Each row is a one-token pass: a decode step's bits, and its residual row kept.
    fn verify(&mut self, seq: &mut Seq, tokens: &[u32], want: Want) -> Result<Vec<Logits>> {
        let s: &mut StepSeq = seq.get_mut()?;
        let n = tokens.len();
        if n == 0 || n > MAX_VERIFY {
            return Err(Error::Invalid(format!(
                "a verify pass of {n} tokens (1..={MAX_VERIFY})"
            )));
        }
        let (id, p0) = (s.id, s.pos);
        self.spec.verify.insert(id, p0);
        let per_row = match want {
            Want::Last => Want::All,
            w => w,
        };
        let mut out = Vec::with_capacity(n);
        for (j, t) in tokens.iter().enumerate() {
            let mut r = self.run_items(&mut [(&mut *s, std::slice::from_ref(t), per_row)])?;
            self.keep_rows(id, p0, j, 1)?;
            if per_row != Want::None {
                out.extend(r.pop());
            }
        }
        Ok(out)
    }

    fn rollback(&mut self, seq: &mut Seq, keep: &[u32]) -> Result<()> {
        let s: &mut StepSeq = seq.get_mut()?;
        match self.spec.verify.get(&s.id).copied() {
            Some(p0) if p0 + keep.len() <= s.pos => {
                s.pos = p0 + keep.len();
                // The kept rows are the verify pass's first ones.
                if let Some(saved) = self.spec.saved.get_mut(&s.id) {
                    if saved.1 != p0 || keep.is_empty() {
                        self.spec.saved.remove(&s.id);
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
        self.mtp_pass(seq.get()?, hidden, tokens, want)
    }

    /// `[rows, n_embd]`: the trunk (or chained) rows each MTP row read.
    fn mtp_hidden(&self, rows: usize) -> Result<Vec<f32>> {
        let m = self
            .mtp
            .as_ref()
            .ok_or_else(|| Error::Invalid("the model has no MTP block".into()))?;
        if rows > m.rows {
            return Err(Error::Invalid(format!(
                "{rows} hidden rows of an MTP pass of {}",
                m.rows
            )));
        }
        self.gpu.read_f32(&m.hid, 0, rows * self.hp.n_embd)
    }

    /// The first draft over the trunk rows, then `k - 1` chained ones, a pass each.
    fn mtp_drafts(&mut self, seq: &Seq, tokens: &[u32], k: usize) -> Result<Vec<u32>> {
        if k == 0 || k > MAX_VERIFY {
            return Err(Error::Invalid(format!("{k} drafts (1..={MAX_VERIFY})")));
        }
        let s: &StepSeq = seq.get()?;
        let greedy = Want::Top { k: 1, lse: false };
        let mut d = top1(&self.mtp_pass(s, Hidden::Trunk, tokens, greedy)?)?;
        let mut out = vec![d];
        for _ in 1..k {
            d = top1(&self.mtp_pass(s, Hidden::Chain, &[d], greedy)?)?;
            out.push(d);
        }
        Ok(out)
    }

    /// Only the whole vocabulary: a trimmed draft head is not built for Step yet.
    fn set_draft_vocab(&mut self, n: Option<usize>) -> Result<()> {
        match n {
            Some(n) if n != self.hp.n_vocab => Err(Error::Unsupported(format!(
                "--draft-vocab {n} on a Step-3.7 model (its MTP drafts over all {} ids)",
                self.hp.n_vocab
            ))),
            _ => Ok(()),
        }
    }
}
