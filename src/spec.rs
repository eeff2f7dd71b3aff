//! Speculative decoding for the generation loop: the model's MTP block drafts `k` tokens, the
//! target checks them in one verify pass of `k + 1` rows, and the loop samples from those
//! rows in order for as long as each sampled token is the draft the next row was fed.
//!
//! The drafts are greedy (a one-hot draft distribution `q`), so the standard rejection rule
//! (accept `x` with probability `min(1, p(x)/q(x))`, else sample `max(0, p - q)`
//! renormalised) comes down to: sample `y` from the target's row as without speculation and
//! accept the draft when `y` is it. Each row's logits have the bits of a one-token decode
//! step at that position (the verify pass runs the decode kernels) and the sampler draws
//! once per token either way, so speculation changes neither greedy output nor, at a fixed
//! seed, sampled output: only how many target passes it takes.
//!
//! Drafts come from the model's MTP block or from a draft model (`--draft-model`: another
//! model of the same vocabulary run greedily on its own sequence, rolled back as the target
//! is).
//!
//! Past the first rejected draft the target's state is rolled back (the recurrent state
//! saved before the verify pass, the accepted tokens fed again); KV rows past the position
//! are simply overwritten later.
//!
//! The server speculates for many sequences at once: each request has its own
//! [`Speculator`] (the models keep each sequence's MTP trunk rows and rollback state apart),
//! [`Speculator::advance`] takes the rows of a pass as long as the drafts hold,
//! [`settle_many`] rolls every sequence back in shared passes, [`Speculator::prepare`]
//! drafts per sequence and [`verify_many`] checks all sequences' drafts in shared verify
//! passes (rows of several sequences, each with one-token bits).

use crate::engine::{Engine, Logits, Want};
use crate::models::spec::{Hidden, Speculate};
use crate::models::Seq;
use crate::{Error, Result};
use std::sync::{Arc, Mutex};

/// `--spec`: where drafts come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpecMode {
    /// The model's MTP block when the file has one, else the draft model when one is
    /// given, else no speculation.
    #[default]
    Auto,
    Mtp,
    /// A draft model (`--draft-model`).
    Draft,
    Off,
}

impl std::str::FromStr for SpecMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(SpecMode::Auto),
            "mtp" => Ok(SpecMode::Mtp),
            "draft" => Ok(SpecMode::Draft),
            "off" => Ok(SpecMode::Off),
            _ => Err(Error::Invalid(format!(
                "--spec {s}: expected mtp, draft, off or auto"
            ))),
        }
    }
}

/// Tokens drafted per verify pass when `--draft` is not given: a verify pass of up to 4
/// rows costs about one decode step where weight reads bound it.
pub const DEFAULT_DRAFT: usize = 3;

#[derive(Clone, Debug, PartialEq)]
pub struct SpecOptions {
    pub mode: SpecMode,
    /// Tokens drafted per verify pass (`--draft`).
    pub draft: usize,
    /// Take every draft as accepted whatever the target picks (benchmarks only: the output
    /// is then the drafts', showing the mechanism's ceiling).
    pub accept_all: bool,
    /// The draft model of [`SpecMode::Draft`].
    pub draft_model: Option<DraftModel>,
    /// MTP drafts pick among the first this-many tokens (`--draft-vocab`; `None`: all).
    pub draft_vocab: Option<usize>,
}

impl Default for SpecOptions {
    fn default() -> Self {
        SpecOptions {
            mode: SpecMode::Auto,
            draft: DEFAULT_DRAFT,
            accept_all: false,
            draft_model: None,
            draft_vocab: None,
        }
    }
}

/// A loaded draft model, shared by the generations that use it (one at a time).
#[derive(Clone)]
pub struct DraftModel(pub Arc<Mutex<Engine>>);

impl DraftModel {
    pub fn new(engine: Engine) -> DraftModel {
        DraftModel(Arc::new(Mutex::new(engine)))
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, Engine> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DraftModel({})", self.lock().path.display())
    }
}

impl PartialEq for DraftModel {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A draft model's sequence in one generation.
struct DraftSeq {
    model: DraftModel,
    seq: Seq,
    /// Tokens the target holds that the draft model has not been fed yet.
    pending: Vec<u32>,
}

impl DraftSeq {
    /// `k` greedy drafts after `id`. Every pass runs the decode kernels (a one-row verify
    /// pass has decode's bits), so a draft model equal to the target drafts what the target
    /// picks; the state before the second token is saved for [`DraftSeq::settle`].
    fn draft(&mut self, id: u32, k: usize) -> Result<Vec<u32>> {
        let greedy = Want::Top { k: 1, lse: false };
        let mut eng = self.model.lock();
        let mut toks = std::mem::take(&mut self.pending);
        toks.push(id);
        let mut d = top1(&spec_of(&mut eng)?.verify(&mut self.seq, &toks, greedy)?)?;
        let mut out = vec![d];
        if k >= 2 {
            d = top1(&spec_of(&mut eng)?.verify(&mut self.seq, &[d], greedy)?)?;
            out.push(d);
        }
        for _ in 2..k {
            d = top1(&eng.forward_batch_with(&mut [(&mut self.seq, &[d], greedy)])?)?;
            out.push(d);
        }
        Ok(out)
    }

    /// The target kept `m` of `drafts`: the draft model, which was fed all but the last,
    /// goes back to hold exactly those (or is told the last one).
    fn settle(&mut self, drafts: &[u32], m: usize) -> Result<()> {
        let k = drafts.len();
        if m == k {
            self.pending = vec![drafts[k - 1]];
        } else if k >= 2 && m + 1 < k {
            spec_of(&mut self.model.lock())?.rollback(&mut self.seq, &drafts[..m])?;
        }
        Ok(())
    }
}

/// What speculation did over a generation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpecStats {
    pub drafted: usize,
    pub accepted: usize,
    /// Verify passes of the target.
    pub verify_passes: usize,
    /// Tokens the verify passes produced (accepted drafts plus one per pass).
    pub tokens: usize,
}

impl SpecStats {
    /// Accepted / drafted, 0..1.
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            return 0.0;
        }
        self.accepted as f64 / self.drafted as f64
    }
    /// Tokens per target pass while decoding.
    pub fn tokens_per_forward(&self) -> f64 {
        if self.verify_passes == 0 {
            return 0.0;
        }
        self.tokens as f64 / self.verify_passes as f64
    }
}

/// The speculation state of one generation on one sequence.
pub struct Speculator {
    k: usize,
    accept_all: bool,
    /// The tokens of the current verify pass: the last sampled token, then the drafts.
    fed: Vec<u32>,
    /// Its rows' logits; rows `..used` were sampled from.
    rows: Vec<Logits>,
    used: usize,
    /// The tokens after each trunk row of the last pass but the last row's (which is the
    /// next sampled token): what the MTP block reads with those rows.
    next: Vec<u32>,
    /// The draft model's sequence; `None`: the MTP block drafts.
    draft: Option<DraftSeq>,
    pub stats: SpecStats,
}

fn spec_of(engine: &mut Engine) -> Result<&mut dyn Speculate> {
    engine.model.speculate().ok_or_else(|| {
        Error::Unsupported(
            "speculative decoding: Qwen3.5 and DeepSeek-V4 models on one device only".into(),
        )
    })
}

impl Speculator {
    /// A speculator for `engine` when `opts` asks for one and the model can run it;
    /// `None`: decode without speculation.
    pub fn new(engine: &mut Engine, opts: &SpecOptions) -> Result<Option<Speculator>> {
        let has_mtp = engine.model.speculate().is_some_and(|s| s.has_mtp());
        let mode = match (opts.mode, &opts.draft_model) {
            (SpecMode::Auto, _) if has_mtp => SpecMode::Mtp,
            (SpecMode::Auto, Some(_)) => SpecMode::Draft,
            (SpecMode::Auto, None) | (SpecMode::Off, _) => return Ok(None),
            (m, _) => m,
        };
        let draft = match (mode, &opts.draft_model) {
            (SpecMode::Mtp, _) if !has_mtp => {
                return Err(Error::Invalid(format!(
                    "{}: --spec mtp, but the file has no MTP block (a block kept in a file of its own, as Step-3.5/3.7 ship it, is given by --mtp-model FILE)",
                    engine.path.display()
                )))
            }
            (SpecMode::Draft, None) => {
                return Err(Error::Invalid("--spec draft needs --draft-model".into()))
            }
            (SpecMode::Draft, Some(dm)) => {
                let mut d = dm.lock();
                if d.vocab_size() != engine.vocab_size() {
                    return Err(Error::Invalid(format!(
                        "--draft-model {}: a vocabulary of {} ids, the model's has {}",
                        d.path.display(),
                        d.vocab_size(),
                        engine.vocab_size()
                    )));
                }
                if d.model.speculate().is_none() {
                    return Err(Error::Unsupported(format!(
                        "--draft-model {}: draft models of this architecture (a Qwen3.5-family or DeepSeek-V4 model drafts)",
                        d.path.display()
                    )));
                }
                Some(DraftSeq {
                    model: dm.clone(),
                    seq: d.new_seq()?,
                    pending: Vec::new(),
                })
            }
            _ => None,
        };
        if mode == SpecMode::Mtp {
            spec_of(engine)?.set_draft_vocab(opts.draft_vocab)?;
        }
        let max = spec_of(engine)?.max_verify();
        if opts.draft == 0 || opts.draft >= max {
            return Err(Error::Invalid(format!(
                "--draft {}: expected 1 to {} tokens",
                opts.draft,
                max - 1
            )));
        }
        Ok(Some(Speculator {
            k: opts.draft,
            accept_all: opts.accept_all,
            fed: Vec::new(),
            rows: Vec::new(),
            used: 0,
            next: Vec::new(),
            draft,
            stats: SpecStats::default(),
        }))
    }

    /// Feeds one prompt piece (`want` for its last token), keeping its hidden states for
    /// the MTP block; `after`: the token that follows the piece when the prompt goes on.
    /// A piece longer than one pass goes in passes of [`Speculate::pass_rows`] tokens, as
    /// the forward would split it.
    pub fn feed_prompt(
        &mut self,
        engine: &mut Engine,
        seq: &mut Seq,
        piece: &[u32],
        after: Option<u32>,
        want: Want,
    ) -> Result<Logits> {
        let rows = spec_of(engine)?.pass_rows().max(1);
        let mut logits = Vec::new();
        for (i, part) in piece.chunks(rows).enumerate() {
            let end = (i + 1) * rows;
            let last = end >= piece.len();
            let s = spec_of(engine)?;
            logits = s.feed(seq, part, if last { want } else { Want::None })?;
            if let Some(d) = &mut self.draft {
                // The draft model reads the prompt in the same pieces.
                d.model
                    .lock()
                    .forward_batch_with(&mut [(&mut d.seq, part, Want::None)])?;
            } else {
                // The MTP rows over the part, each reading the token after its row.
                // Without the next prompt token the last row's is not known yet: it reads
                // the part's last token for now and is run again when the token is sampled
                // (its KV row rewritten), from the sequence's saved trunk rows.
                self.next = part[1..].to_vec();
                let next = piece.get(end).copied().or(after);
                self.next.push(next.unwrap_or(part[part.len() - 1]));
                s.mtp(seq, Hidden::Trunk, &self.next, Want::None)?;
                self.next.clear();
            }
        }
        logits
            .into_iter()
            .last()
            .ok_or_else(|| Error::Gpu("the forward returned nothing".into()))
    }

    /// The sequence already holds `prefix` (a reused prompt cache): a draft model reads it
    /// too, so that its sequence holds what the target's does.
    pub fn held(&mut self, prefix: &[u32]) -> Result<()> {
        if let Some(d) = &mut self.draft {
            let mut eng = d.model.lock();
            let rows = spec_of(&mut eng)?.pass_rows().max(1);
            for part in prefix.chunks(rows) {
                eng.forward_batch_with(&mut [(&mut d.seq, part, Want::None)])?;
            }
        }
        Ok(())
    }

    /// The draft the next unused row was fed, while a verify pass has rows left.
    fn expected(&self) -> Option<u32> {
        (self.used > 0 && self.used < self.fed.len()).then(|| self.fed[self.used])
    }

    /// The tokens of the verify pass in flight that the rows sampled so far followed: the
    /// sequence holds them past what was settled (the context a sampler's penalties read).
    pub fn in_flight(&self) -> &[u32] {
        &self.fed[..self.used.min(self.fed.len())]
    }

    /// `id` was sampled from the last row taken: the next row's logits when the verify
    /// pass in flight has it (the draft that row was fed is `id`; with `accept_all` any
    /// draft), and the token that counts as sampled. `None`: a new pass is needed
    /// ([`Speculator::prepare`], then [`verify_many`]).
    pub fn advance(&mut self, id: u32) -> Option<(Logits, u32)> {
        let d = self.expected()?;
        let id = if self.accept_all { d } else { id };
        if id != d {
            return None;
        }
        self.stats.accepted += 1;
        self.used += 1;
        Some((self.rows[self.used - 1].clone(), id))
    }

    /// `id` was sampled and the verify pass in flight has no row for it: settles that pass
    /// and drafts up to `limit` tokens after `id` (at most `--draft`; 0: the next pass
    /// checks `id` alone) for [`verify_many`]. `on_fed` gets the tokens the sequence now
    /// holds for good.
    pub fn prepare(
        &mut self,
        engine: &mut Engine,
        seq: &mut Seq,
        id: u32,
        limit: usize,
        on_fed: &mut dyn FnMut(&[u32]),
    ) -> Result<()> {
        self.settle(engine, seq, on_fed)?;
        let k = self.k.min(limit);
        self.fed.clear();
        self.fed.push(id);
        if k == 0 {
            self.next.clear();
            return Ok(());
        }
        if let Some(dm) = &mut self.draft {
            self.fed.extend(dm.draft(id, k)?);
        } else {
            // The MTP rows over the new trunk rows, the last one reading `id`: its draft is
            // the first; the chain drafts the rest.
            self.next.push(id);
            let drafts = spec_of(engine)?.mtp_drafts(seq, &self.next, k)?;
            self.next.clear();
            self.fed.extend(drafts);
        }
        Ok(())
    }

    /// `id` was sampled (from the prompt's last logits or the previous row): the logits of
    /// the next position, from the current verify pass while its drafts hold, else from a
    /// new draft and verify pass. Returns them and the token that counts as sampled (`id`,
    /// or with `accept_all` the draft). `on_fed` gets the tokens the sequence now holds
    /// for good.
    pub fn next(
        &mut self,
        engine: &mut Engine,
        seq: &mut Seq,
        id: u32,
        want: Want,
        on_fed: &mut dyn FnMut(&[u32]),
    ) -> Result<(Logits, u32)> {
        if let Some(r) = self.advance(id) {
            return Ok(r);
        }
        self.prepare(engine, seq, id, self.k, on_fed)?;
        let logits = verify_many(engine, &mut [(self, seq, want)])?
            .pop()
            .ok_or_else(|| Error::Gpu("the verify pass returned nothing".into()))?;
        Ok((logits, id))
    }

    /// Ends the current verify pass: the rows sampled from say which of its tokens count;
    /// the state past them is rolled back. Call it when generation stops, so that the
    /// sequence holds exactly the tokens fed before the last sampled one.
    pub fn settle(
        &mut self,
        engine: &mut Engine,
        seq: &mut Seq,
        on_fed: &mut dyn FnMut(&[u32]),
    ) -> Result<()> {
        for t in settle_many(engine, &mut [(self, seq)])? {
            on_fed(&t);
        }
        Ok(())
    }
}

/// [`Speculator::settle`] of several sequences, their rollbacks in shared passes
/// ([`Speculate::rollback_batch`]); per item the tokens its sequence now holds for good.
pub fn settle_many(
    engine: &mut Engine,
    items: &mut [(&mut Speculator, &mut Seq)],
) -> Result<Vec<Vec<u32>>> {
    let mut back: Vec<(&mut Seq, &[u32])> = items
        .iter_mut()
        .filter(|(s, _)| s.used > 0 && s.used < s.fed.len())
        .map(|(s, seq)| (&mut **seq, &s.fed[..s.used]))
        .collect();
    if !back.is_empty() {
        spec_of(engine)?.rollback_batch(&mut back)?;
    }
    drop(back);
    let mut out = Vec::with_capacity(items.len());
    for (s, _) in items.iter_mut() {
        if s.used == 0 {
            out.push(Vec::new());
            continue;
        }
        let keep = s.used;
        s.stats.tokens += keep - 1;
        if let Some(d) = &mut s.draft {
            match s.fed.len() {
                // Nothing was drafted: the draft model has not read the token yet.
                1 => d.pending.push(s.fed[0]),
                _ => d.settle(&s.fed[1..], keep - 1)?,
            }
        }
        out.push(s.fed[..keep].to_vec());
        s.next = s.fed[1..keep].to_vec();
        s.used = 0;
        s.rows.clear();
    }
    Ok(out)
}

/// The verify pass of every item's prepared tokens ([`Speculator::prepare`]) in as few
/// target passes as keep one-token bits ([`Speculate::verify_batch`]); per item the first
/// row's logits (what `want` asks of each row). The other rows wait in each speculator for
/// [`Speculator::advance`].
pub fn verify_many(
    engine: &mut Engine,
    items: &mut [(&mut Speculator, &mut Seq, Want)],
) -> Result<Vec<Logits>> {
    if let Some((s, _, _)) = items
        .iter()
        .find(|(s, _, _)| s.fed.is_empty() || s.used > 0)
    {
        return Err(Error::Invalid(format!(
            "a verify pass of {} prepared tokens ({} rows of the last one taken)",
            s.fed.len(),
            s.used
        )));
    }
    let rows = {
        let mut batch: Vec<(&mut Seq, &[u32], Want)> = items
            .iter_mut()
            .map(|(s, seq, want)| {
                let per_row = match *want {
                    Want::Top { .. } => *want,
                    _ => Want::All,
                };
                (&mut **seq, s.fed.as_slice(), per_row)
            })
            .collect();
        spec_of(engine)?.verify_batch(&mut batch)?
    };
    if rows.len() != items.len() {
        return Err(Error::Gpu("the verify pass returned too few items".into()));
    }
    let mut out = Vec::with_capacity(items.len());
    for ((s, _, _), r) in items.iter_mut().zip(rows) {
        if r.len() != s.fed.len() {
            return Err(Error::Gpu("the verify pass returned too few rows".into()));
        }
        s.rows = r;
        s.stats.drafted += s.fed.len() - 1;
        s.stats.verify_passes += 1;
        s.stats.tokens += 1;
        s.used = 1;
        out.push(s.rows[0].clone());
    }
    Ok(out)
}

fn top1(l: &[Logits]) -> Result<u32> {
    match l.last() {
        Some(Logits::Top(t)) if !t.cands.is_empty() => Ok(t.cands[0].0),
        _ => Err(Error::Gpu("the MTP pass returned no draft".into())),
    }
}

/// Greedy generation of `n` tokens after `first` on `seq` with speculation, as `lathe bench`
/// times it (the argmax found on the GPU): what the verify passes did, and the tokens.
pub fn greedy_run(
    engine: &mut Engine,
    seq: &mut Seq,
    first: u32,
    n: usize,
    opts: &SpecOptions,
) -> Result<(SpecStats, Vec<u32>)> {
    let greedy = Want::Top { k: 1, lse: false };
    let Some(mut s) = Speculator::new(engine, opts)? else {
        return Err(Error::Invalid(format!(
            "{}: speculation is off for this model (--spec)",
            engine.path.display()
        )));
    };
    let mut logits = s.feed_prompt(engine, seq, &[first], None, greedy)?;
    let mut out = Vec::with_capacity(n);
    for _ in 1..n {
        let id = top1(std::slice::from_ref(&logits))?;
        let (l, id) = s.next(engine, seq, id, greedy, &mut |_| {})?;
        out.push(id);
        logits = l;
    }
    out.push(top1(std::slice::from_ref(&logits))?);
    s.settle(engine, seq, &mut |_| {})?;
    Ok((s.stats, out))
}

/// Runs, on a scratch sequence, every pass a speculative generation with `opts` runs, so
/// that the first timed one compiles nothing (`lathe bench --spec`: the first timed
/// repetition was a compile, 8.6 tok/s on the H200, issue 34): a one-token prompt piece,
/// then per `m` in `0..=--draft` a verify pass with `m` drafts kept, so that the rollbacks
/// of every length (`m + 1` rows fed again), the MTP rows over every number of trunk rows
/// and a draft model's passes all run once. Nothing when `opts` does not speculate.
pub fn warm_up(engine: &mut Engine, opts: &SpecOptions) -> Result<()> {
    let greedy = Want::Top { k: 1, lse: false };
    let mut seq = engine.new_seq()?;
    let k = opts.draft;
    for m in 0..=k {
        let Some(mut s) = Speculator::new(engine, opts)? else {
            return Ok(());
        };
        engine.reset(&mut seq)?;
        s.feed_prompt(engine, &mut seq, &[0], None, greedy)?;
        for keep in [m, 0] {
            s.prepare(engine, &mut seq, 0, k, &mut |_| {})?;
            verify_many(engine, &mut [(&mut s, &mut seq, greedy)])?;
            // `keep` drafts taken whatever they are (the rows' tokens do not matter here).
            s.accept_all = true;
            for _ in 0..keep {
                s.advance(0);
            }
            s.accept_all = opts.accept_all;
        }
        s.settle(engine, &mut seq, &mut |_| {})?;
    }
    Ok(())
}

/// Seconds of the pieces of a speculative step on `seq` (which must hold a few tokens):
/// per `k` in `1..max_verify` the verify pass of `k + 1` tokens (then rolled back), one
/// chained MTP draft, one step of the draft model, and a plain one-token decode step; each
/// the mean of `reps`.
#[derive(Clone, Debug)]
pub struct StepCosts {
    pub verify: Vec<(usize, f64)>,
    pub mtp_draft: Option<f64>,
    /// A one-token step of the draft model (`--draft-model`), on its own sequence.
    pub draft_step: Option<f64>,
    pub decode: f64,
}

pub fn step_costs(
    engine: &mut Engine,
    seq: &mut Seq,
    token: u32,
    reps: usize,
    draft_model: Option<&DraftModel>,
) -> Result<StepCosts> {
    let greedy = Want::Top { k: 1, lse: false };
    let reps = reps.max(1);
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        f()?;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            f()?;
        }
        Ok(t.elapsed().as_secs_f64() / reps as f64)
    };
    let mut scratch = engine.new_seq()?;
    engine.copy_seq(seq, &mut scratch)?;
    let decode = time(&mut || {
        engine.copy_seq(seq, &mut scratch)?;
        engine.forward_batch_with(&mut [(&mut scratch, &[token], greedy)])?;
        Ok(())
    })? - time(&mut || engine.copy_seq(seq, &mut scratch))?;
    let max = spec_of(engine)?.max_verify();
    let mut verify = Vec::new();
    for k in 1..max {
        let toks = vec![token; k + 1];
        let secs = time(&mut || {
            let s = spec_of(engine)?;
            s.verify(seq, &toks, greedy)?;
            s.rollback(seq, &[])
        })?;
        verify.push((k, secs));
    }
    let mtp_draft = if spec_of(engine)?.has_mtp() {
        let s = spec_of(engine)?;
        s.feed(seq, &[token], Want::None)?;
        s.mtp(seq, Hidden::Trunk, &[token], greedy)?;
        Some(time(&mut || {
            spec_of(engine)?
                .mtp(seq, Hidden::Chain, &[token], greedy)
                .map(drop)
        })?)
    } else {
        None
    };
    let draft_step = match draft_model {
        Some(dm) => {
            let mut d = dm.lock();
            let mut dseq = d.new_seq()?;
            d.forward_batch_with(&mut [(&mut dseq, &[token, token, token], Want::None)])?;
            let mut one = d.new_seq()?;
            let copy = time(&mut || d.copy_seq(&dseq, &mut one))?;
            Some(
                time(&mut || {
                    d.copy_seq(&dseq, &mut one)?;
                    d.forward_batch_with(&mut [(&mut one, &[token], greedy)])?;
                    Ok(())
                })? - copy,
            )
        }
        None => None,
    };
    Ok(StepCosts {
        verify,
        mtp_draft,
        draft_step,
        decode,
    })
}

/// What the device's passes cost, as `serve --spec auto` decides from them
/// ([`measure_pass_costs`] at warm-up).
#[derive(Clone, Debug, PartialEq)]
pub struct PassCosts {
    /// Seconds of a verify pass of `r` rows at index `r - 1`, for `r` in
    /// `1..=max_verify`. A plain batched decode step of `r` sequences runs the same decode
    /// kernels over as many rows, so it costs about as much.
    pub pass: Vec<f64>,
    /// Seconds to draft one token: a chained MTP row, or a step of the draft model.
    pub draft: f64,
}

impl PassCosts {
    /// Seconds of the verify passes of `n` sequences of `rows` rows each, packed whole into
    /// passes of up to `pass.len()` rows as [`Speculate::verify_batch`] packs them.
    fn packed(&self, n: usize, rows: usize) -> f64 {
        let max = self.pass.len();
        let per = (max / rows.max(1)).max(1);
        let full = (n / per) as f64 * self.pass[(per * rows).min(max) - 1];
        match n % per {
            0 => full,
            r => full + self.pass[r * rows - 1],
        }
    }

    /// Seconds of a plain batched decode step of `n` sequences. Past the largest verify
    /// pass measured, the cost of that pass: a lower bound (more rows never cost less), so
    /// that the choice speculates only where it pays against the cheapest plain step.
    fn plain(&self, n: usize) -> f64 {
        self.pass[n.clamp(1, self.pass.len()) - 1]
    }
}

/// Tokens one verify pass of `k` drafts yields when each draft is kept with probability
/// `a` (independently, until the first rejection), counting the row after the last kept
/// draft: `(1 - a^(k+1)) / (1 - a)` (Leviathan et al. 2023, "Fast Inference from
/// Transformers via Speculative Decoding", eq. 1).
pub fn expected_tokens(k: usize, a: f64) -> f64 {
    let a = a.clamp(0.0, 1.0);
    if a >= 1.0 {
        return (k + 1) as f64;
    }
    (1.0 - a.powi(k as i32 + 1)) / (1.0 - a)
}

/// `serve --spec auto`'s choice for `n` sequences speculating together at acceptance `a`:
/// the draft length in `1..=max_draft` that gives the most expected tokens per second,
/// or 0 when a plain batched step of the `n` sequences gives more. A speculative step
/// costs the packed verify passes, `k` drafts per sequence and, when any draft is
/// rejected, a rollback pass that feeds the kept tokens again; it yields
/// [`expected_tokens`] per sequence.
pub fn choose_draft(c: &PassCosts, n: usize, a: f64, max_draft: usize) -> usize {
    let n = n.max(1);
    if c.pass.is_empty() {
        return 0;
    }
    let mut best = (0, n as f64 / c.plain(n));
    for k in 1..=max_draft.min(c.pass.len() - 1) {
        let tokens = expected_tokens(k, a);
        let rejected = 1.0 - a.clamp(0.0, 1.0).powi((k * n) as i32);
        // The kept tokens (all but the row after them) of every sequence, fed again.
        let kept = ((tokens - 1.0).max(0.0).ceil() as usize).max(1);
        let cost = c.packed(n, k + 1)
            + (n * k) as f64 * c.draft
            + rejected * c.packed(n, kept.min(c.pass.len()));
        let rate = n as f64 * tokens / cost;
        if rate > best.1 {
            best = (k, rate);
        }
    }
    best.0
}

/// Drafts `serve --spec auto` assumes before it has measured any (pseudo-counts of a
/// prior at [`PRIOR_ACCEPTANCE`]): enough that the first requests speculate and measure,
/// few enough that a few replies of real acceptance outweigh it.
pub const PRIOR_DRAFTS: f64 = 16.0;
/// The acceptance assumed before measurements: about what MTP drafts of real checkpoints
/// keep (DeepSeek-V3 reports 85-90% for its second token, arXiv 2412.19437 §5.4.3). Each
/// rejection costs a rollback pass, so at one half speculation at best breaks even even
/// with free verify rows, and a lower prior would never measure; random weights keep
/// almost none and stop speculating after their first replies.
pub const PRIOR_ACCEPTANCE: f64 = 0.8;

/// The acceptance `serve --spec auto` decides with: what the finished requests measured,
/// with [`PRIOR_DRAFTS`] drafts at [`PRIOR_ACCEPTANCE`] added.
pub fn acceptance_estimate(measured: Option<SpecStats>) -> f64 {
    let (acc, drafted) = measured.map_or((0.0, 0.0), |s| (s.accepted as f64, s.drafted as f64));
    (acc + PRIOR_DRAFTS * PRIOR_ACCEPTANCE) / (drafted + PRIOR_DRAFTS)
}

/// Measures [`PassCosts`] on `engine` for speculation with `opts`: verify passes of every
/// row count up to [`Speculate::max_verify`] (each rolled back) on a fresh sequence holding a
/// few tokens, and one draft: a chained MTP row, or a one-token step of the draft model on
/// its own sequence. Each the mean of `reps` after one untimed run (which also compiles).
pub fn measure_pass_costs(
    engine: &mut Engine,
    opts: &SpecOptions,
    reps: usize,
) -> Result<PassCosts> {
    let greedy = Want::Top { k: 1, lse: false };
    let reps = reps.max(1);
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        f()?;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            f()?;
        }
        Ok(t.elapsed().as_secs_f64() / reps as f64)
    };
    let verify_costs = |e: &mut Engine, seq: &mut Seq, rows: usize| -> Result<Vec<f64>> {
        spec_of(e)?.feed(seq, &[0, 0, 0], Want::None)?;
        (1..=rows)
            .map(|r| {
                let toks = vec![0; r];
                time(&mut || {
                    let s = spec_of(e)?;
                    s.verify(seq, &toks, greedy)?;
                    s.rollback(seq, &[])
                })
            })
            .collect()
    };
    let mut seq = engine.new_seq()?;
    let max = spec_of(engine)?.max_verify();
    let pass = verify_costs(engine, &mut seq, max)?;
    // The drafts `Speculator::new` takes: the MTP block unless --spec draft or none.
    let mtp = spec_of(engine)?.has_mtp() && opts.mode != SpecMode::Draft;
    let draft = match (&opts.draft_model, mtp) {
        (Some(dm), false) => {
            let mut d = dm.lock();
            let mut dseq = d.new_seq()?;
            verify_costs(&mut d, &mut dseq, 1)?[0]
        }
        (None, false) => {
            return Err(Error::Invalid(
                "no drafts to measure: neither an MTP block nor a draft model".into(),
            ))
        }
        (_, true) => {
            // The trunk row the chain starts from (the rollbacks above left none).
            let s = spec_of(engine)?;
            s.feed(&mut seq, &[0], Want::None)?;
            s.mtp(&seq, Hidden::Trunk, &[0], greedy)?;
            time(&mut || {
                spec_of(engine)?
                    .mtp(&seq, Hidden::Chain, &[0], greedy)
                    .map(drop)
            })?
        }
    };
    Ok(PassCosts { pass, draft })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Verify passes that cost `per_row` seconds a row over a base of `base`.
    fn costs(base: f64, per_row: f64, draft: f64) -> PassCosts {
        PassCosts {
            pass: (1..=8).map(|r| base + per_row * r as f64).collect(),
            draft,
        }
    }

    #[test]
    fn expected_tokens_follow_the_geometric_series() {
        assert_eq!(expected_tokens(3, 0.0), 1.0);
        assert_eq!(expected_tokens(3, 1.0), 4.0);
        // 1 + a + a^2 + a^3
        let a: f64 = 0.6;
        let want = 1.0 + a + a * a + a * a * a;
        assert!((expected_tokens(3, a) - want).abs() < 1e-12);
    }

    #[test]
    fn verify_passes_pack_whole_sequences() {
        let c = costs(0.0, 1.0, 0.0);
        // 3 sequences of 4 rows: passes of 8 and 4 rows
        assert_eq!(c.packed(3, 4), 12.0);
        // 3 of 3 rows: 6 rows (two sequences) and 3
        assert_eq!(c.packed(3, 3), 9.0);
        assert_eq!(c.packed(1, 8), 8.0);
        assert_eq!(c.plain(3), 3.0);
        assert_eq!(c.plain(20), 8.0);
    }

    #[test]
    fn choice_speculates_only_where_it_pays() {
        // Weight reads bound the passes (8 rows cost little more than one), drafts are
        // cheap: speculate, with longer drafts at higher acceptance.
        let cheap = costs(1.0, 0.02, 0.05);
        let k_mid = choose_draft(&cheap, 1, 0.8, 7);
        let k_high = choose_draft(&cheap, 1, 0.95, 7);
        assert!(k_mid >= 1, "{k_mid}");
        assert!(k_high > k_mid, "{k_high} > {k_mid}");
        // never more than asked, nor than a pass holds
        assert_eq!(choose_draft(&cheap, 1, 0.99, 2), 2);
        assert!(choose_draft(&cheap, 1, 0.99, 50) <= 7);
        // Drafts that are never kept: every pass is a verify plus a rollback.
        assert_eq!(choose_draft(&cheap, 1, 0.0, 7), 0);
        // Each row costs a decode step (issue 34's fused verify: 4 rows 3.2x a step).
        let dear = costs(0.0, 1.0, 0.1);
        assert_eq!(choose_draft(&dear, 1, 0.9, 7), 0);
        // Many sequences: a plain batched step already serves them all at the cost of one
        // pass, so what pays for one sequence does not for 8.
        assert!(choose_draft(&cheap, 1, 0.8, 3) > 0);
        assert_eq!(choose_draft(&cheap, 8, 0.8, 3), 0);
        assert_eq!(
            choose_draft(
                &PassCosts {
                    pass: vec![],
                    draft: 0.0
                },
                1,
                0.9,
                3
            ),
            0
        );
    }

    #[test]
    fn acceptance_estimate_starts_at_the_prior_and_follows_measurements() {
        assert_eq!(acceptance_estimate(None), PRIOR_ACCEPTANCE);
        let low = SpecStats {
            drafted: 1000,
            accepted: 10,
            ..Default::default()
        };
        let a = acceptance_estimate(Some(low));
        assert!(a < 0.03 && a > 0.01, "{a}");
    }
}
