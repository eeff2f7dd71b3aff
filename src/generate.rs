//! The generation loop that `lathe run`, `lathe chat` and the HTTP server share: prompt
//! tokens in; sampled tokens and the text they make streamed out through a callback; timings
//! at the end.
//!
//! A [`Session`] owns one sequence and remembers the tokens it has consumed, so a caller that
//! sends the whole conversation each turn pays only for the new part: when the consumed
//! tokens are a prefix of the new prompt, only the rest is fed. Recurrent layers cannot be
//! rolled back to a shorter prefix, so a session can keep a [`Checkpoint`]: a copy of its
//! state where the last prompt's conversation ended, restored when the next prompt agrees
//! with it but not with everything the sequence holds (a chat template that rewrites the
//! last assistant turn). Otherwise the sequence is reset and the whole prompt is fed again.
//!
//! Text is streamed the way llama.cpp's server streams it: each token goes through the
//! [`StreamDecoder`] (never half a UTF-8 character) and then the [`StopCondition`] (text that
//! may start a stop string is held back until the next tokens show whether it does).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::engine::{Engine, Logits, Seq, Want};
use crate::sample::{FinishReason, Sampler, SamplerConfig, StopCondition};
use crate::spec::{SpecOptions, SpecStats, Speculator};
use crate::tokenizer::{ChatTemplate, StreamDecoder, TemplateChoice, Tokenizer, CHATML};
use crate::{Error, Result};

/// How to generate.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to sample; `None` = until an end-of-generation token or a stop string.
    pub max_tokens: Option<usize>,
    pub sampler: SamplerConfig,
    /// Generation ends before the first of these strings; it is not part of the text.
    pub stop: Vec<String>,
    /// Go on through end-of-generation tokens (they are then ordinary text).
    pub ignore_eog: bool,
    /// Set it (Ctrl-C, a closed connection) to end the generation before the next step.
    pub cancel: Option<Arc<AtomicBool>>,
    /// Speculative decoding (`--spec`, `--draft`).
    pub spec: SpecOptions,
}

impl Default for GenerateOptions {
    fn default() -> GenerateOptions {
        GenerateOptions {
            max_tokens: Some(256),
            sampler: SamplerConfig::default(),
            stop: Vec::new(),
            ignore_eog: false,
            cancel: None,
            spec: SpecOptions::default(),
        }
    }
}

/// One sampled token, as the callback sees it.
#[derive(Clone, Copy, Debug)]
pub struct Piece<'a> {
    /// The token id (an ending end-of-generation token included).
    pub id: u32,
    /// 0 for the first sampled token.
    pub index: usize,
    /// Text that is safe to show now: may be empty (half a character, a possible stop
    /// string) or carry text held back from earlier tokens. Always empty without a tokenizer.
    pub text: &'a str,
}

/// Where the time went. Durations are wall clock on the host, each ending after the logits
/// it needed were read back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    /// Tokens in the prompt.
    pub n_prompt: usize,
    /// Prompt tokens the sequence already held and that were not fed again.
    pub n_cached: usize,
    /// Tokens sampled.
    pub n_generated: usize,
    /// Feeding the `n_prompt - n_cached` new prompt tokens.
    pub prefill: Duration,
    /// From the call to the first sampled token (prefill + first sample).
    pub first_token: Duration,
    /// From the first sampled token to the last: `n_generated - 1` decode steps.
    pub decode: Duration,
}

impl Timings {
    /// Prompt tokens fed per second.
    pub fn prompt_tok_s(&self) -> Option<f64> {
        rate(self.n_prompt - self.n_cached, self.prefill)
    }

    /// Decode steps per second (the first token comes from the prefill, so it is not counted).
    pub fn gen_tok_s(&self) -> Option<f64> {
        rate(self.n_generated.saturating_sub(1), self.decode)
    }
}

fn rate(n: usize, d: Duration) -> Option<f64> {
    (n > 0 && d > Duration::ZERO).then(|| n as f64 / d.as_secs_f64())
}

impl std::fmt::Display for Timings {
    /// `prompt 12 tokens (340 cached) at 350.2 tok/s | generated 8 tokens at 25.1 tok/s |
    /// first token 40 ms`
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let speed = |r: Option<f64>| match r {
            Some(r) => format!(" at {r:.1} tok/s"),
            None => String::new(),
        };
        write!(f, "prompt {} tokens", self.n_prompt)?;
        if self.n_cached > 0 {
            write!(f, " ({} cached)", self.n_cached)?;
        }
        write!(
            f,
            "{} | generated {} tokens{} | first token {:.0} ms",
            speed(self.prompt_tok_s()),
            self.n_generated,
            speed(self.gen_tok_s()),
            self.first_token.as_secs_f64() * 1e3
        )
    }
}

/// What a generation produced.
#[derive(Clone, Debug)]
pub struct Output {
    /// Every sampled id in order, an ending end-of-generation token included.
    pub tokens: Vec<u32>,
    /// The text the callback was given, concatenated.
    pub text: String,
    /// Why it ended; `None` when cancelled.
    pub finish: Option<FinishReason>,
    pub timings: Timings,
    /// What speculation did; `None` without it.
    pub spec: Option<SpecStats>,
}

/// `held.len()` when `held` is a proper prefix of `prompt` (at least one prompt token must
/// be fed to get logits), else 0.
pub fn reusable_prefix(held: &[u32], prompt: &[u32]) -> usize {
    let n = held.len();
    if n < prompt.len() && prompt[..n] == *held {
        n
    } else {
        0
    }
}

/// A saved sequence state to come back to: a second sequence holding a copy of another's
/// state after `tokens`. Recurrent state (Gated DeltaNet, DeepSeek-V4's compressors)
/// cannot be rolled back to a shorter prefix, so when the next prompt rewrites part of what
/// a sequence holds (chat templates drop the reasoning of earlier assistant turns), the
/// sequence restarts from here instead of from nothing. Costs one sequence state of memory
/// and one GPU copy per save or restore.
pub struct Checkpoint {
    seq: Seq,
    /// The tokens `seq` holds; empty while nothing is saved.
    tokens: Vec<u32>,
}

impl Checkpoint {
    pub fn new(engine: &Engine) -> Result<Checkpoint> {
        Ok(Checkpoint {
            seq: engine.new_seq()?,
            tokens: Vec::new(),
        })
    }

    /// The tokens saved.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// How many tokens of `prompt` a restore gives (see [`reusable_prefix`]).
    pub fn reusable(&self, prompt: &[u32]) -> usize {
        reusable_prefix(&self.tokens, prompt)
    }

    /// Saves the state of `seq`, which holds `tokens`.
    pub fn save(&mut self, engine: &Engine, seq: &Seq, tokens: &[u32]) -> Result<()> {
        if self.tokens == tokens {
            return Ok(());
        }
        // Nothing counts as saved unless the copy went through.
        self.tokens.clear();
        engine.copy_seq(seq, &mut self.seq)?;
        self.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// Copies the saved state into `seq`; returns the tokens `seq` now holds.
    pub fn restore(&self, engine: &Engine, seq: &mut Seq) -> Result<&[u32]> {
        engine.copy_seq(&self.seq, seq)?;
        Ok(&self.tokens)
    }

    /// Forget what is saved.
    pub fn clear(&mut self) {
        self.tokens.clear();
    }
}

/// A sequence, the tokens it holds and optionally a [`Checkpoint`] of it: the prefix
/// bookkeeping a chat [`Session`] and each server slot share.
pub struct HeldSeq {
    seq: Seq,
    /// The tokens `seq` holds, in order: prompts and fed generated tokens. The last sampled
    /// token of a generation is never fed, so it is not here.
    tokens: Vec<u32>,
    /// A forward failed half-way: the sequence may hold more than `tokens` says; reset
    /// before the next use.
    stale: bool,
    /// The state at the checkpoint position of the last prompt.
    checkpoint: Option<Checkpoint>,
}

impl HeldSeq {
    /// A fresh sequence, without checkpoint.
    pub fn new(engine: &Engine) -> Result<HeldSeq> {
        Ok(HeldSeq {
            seq: engine.new_seq()?,
            tokens: Vec::new(),
            stale: false,
            checkpoint: None,
        })
    }

    /// Keep (or stop keeping) a checkpoint.
    pub fn set_checkpoint(&mut self, c: Option<Checkpoint>) {
        self.checkpoint = c;
    }

    /// The sequence, for a batched forward; report its outcome with [`HeldSeq::fed`] or
    /// [`HeldSeq::mark_stale`].
    pub fn seq_mut(&mut self) -> &mut Seq {
        &mut self.seq
    }

    /// The tokens the sequence holds.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The tokens of the saved checkpoint (`None` without checkpoints; empty before any).
    pub fn checkpoint(&self) -> Option<&[u32]> {
        self.checkpoint.as_ref().map(Checkpoint::tokens)
    }

    /// `tokens` went through the sequence.
    pub fn fed(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
        self.stale = false;
    }

    /// A forward over the sequence failed: what it holds is unknown until a reset.
    pub fn mark_stale(&mut self) {
        self.stale = true;
    }

    /// Saves the checkpoint (when one is kept) at what the sequence holds now.
    pub fn save_checkpoint(&mut self, engine: &Engine) -> Result<()> {
        match &mut self.checkpoint {
            Some(c) => c.save(engine, &self.seq, &self.tokens),
            None => Ok(()),
        }
    }

    /// Make the sequence hold what `other` holds (a GPU copy, [`Engine::copy_seq`]): the
    /// prompt state the choices of one request share. The checkpoint is kept.
    pub fn copy_from(&mut self, engine: &Engine, other: &HeldSeq) -> Result<()> {
        self.stale = true;
        engine.copy_seq(&other.seq, &mut self.seq)?;
        self.tokens.clear();
        self.tokens.extend_from_slice(&other.tokens);
        self.stale = other.stale;
        Ok(())
    }

    /// Forget everything, the checkpoint included.
    pub fn reset(&mut self, engine: &Engine) -> Result<()> {
        if let Some(c) = &mut self.checkpoint {
            c.clear();
        }
        self.reset_seq(engine)
    }

    fn reset_seq(&mut self, engine: &Engine) -> Result<()> {
        self.stale = true;
        engine.reset(&mut self.seq)?;
        self.tokens.clear();
        self.stale = false;
        Ok(())
    }

    fn reusable_live(&self, prompt: &[u32]) -> usize {
        if self.stale {
            0
        } else {
            reusable_prefix(&self.tokens, prompt)
        }
    }

    /// How many tokens of `prompt` need not be fed again: what the sequence holds when that
    /// is a proper prefix of `prompt`, or the checkpoint's tokens when those are (the
    /// longer of the two), else 0.
    pub fn reusable(&self, prompt: &[u32]) -> usize {
        let saved = self.checkpoint.as_ref().map_or(0, |c| c.reusable(prompt));
        self.reusable_live(prompt).max(saved)
    }

    /// Brings the sequence to the longest reusable prefix of `prompt` ([`HeldSeq::reusable`]):
    /// keeps it, restores the checkpoint, or resets. Returns the tokens kept.
    pub fn resume(&mut self, engine: &Engine, prompt: &[u32]) -> Result<usize> {
        let live = self.reusable_live(prompt);
        if let Some(c) = self
            .checkpoint
            .as_ref()
            .filter(|c| c.reusable(prompt) > live)
        {
            self.stale = true;
            let held = c.restore(engine, &mut self.seq)?;
            self.tokens.clear();
            self.tokens.extend_from_slice(held);
            self.stale = false;
            return Ok(self.tokens.len());
        }
        if live == 0 && (self.stale || !self.tokens.is_empty()) {
            self.reset_seq(engine)?;
        }
        Ok(live)
    }

    /// `id` was sampled: the next logits through `spec` (see [`Speculator::next`]). While
    /// a verify pass is in flight the sequence holds more than `tokens`: stale until settled.
    fn speculate(
        &mut self,
        engine: &mut Engine,
        spec: &mut Speculator,
        id: u32,
        want: Want,
    ) -> Result<Logits> {
        self.stale = true;
        let tokens = &mut self.tokens;
        let (logits, _) = spec.next(engine, &mut self.seq, id, want, &mut |t| {
            tokens.extend_from_slice(t)
        })?;
        Ok(logits)
    }

    /// Ends `spec`'s verify pass in flight (the state past the accepted tokens rolled back).
    pub fn settle(&mut self, engine: &mut Engine, spec: &mut Speculator) -> Result<()> {
        self.stale = true;
        let tokens = &mut self.tokens;
        spec.settle(engine, &mut self.seq, &mut |t| tokens.extend_from_slice(t))?;
        self.stale = false;
        Ok(())
    }

    /// `id` was sampled and `spec` has no row for it: [`Speculator::prepare`] (at most
    /// `limit` drafts) for a [`crate::spec::verify_many`] of several sequences. Stale until
    /// settled.
    pub fn spec_prepare(
        &mut self,
        engine: &mut Engine,
        spec: &mut Speculator,
        id: u32,
        limit: usize,
    ) -> Result<()> {
        self.stale = true;
        let tokens = &mut self.tokens;
        spec.prepare(engine, &mut self.seq, id, limit, &mut |t| {
            tokens.extend_from_slice(t)
        })
    }

    /// Feeds one prompt piece through `spec` ([`Speculator::feed_prompt`]; `after`: the
    /// prompt's next token when it goes on) and returns what `want` asks of its last
    /// token's logits.
    pub fn spec_feed_prompt(
        &mut self,
        engine: &mut Engine,
        spec: &mut Speculator,
        piece: &[u32],
        after: Option<u32>,
        want: Want,
    ) -> Result<Logits> {
        self.stale = true;
        let l = spec.feed_prompt(engine, &mut self.seq, piece, after, want)?;
        self.fed(piece);
        Ok(l)
    }

    /// Feeds `tokens` (at least one) and returns what `want` asks of the last one's logits.
    fn feed(&mut self, engine: &mut Engine, tokens: &[u32], want: Want) -> Result<Logits> {
        self.stale = true;
        let logits = engine
            .forward_batch_with(&mut [(&mut self.seq, tokens, want)])?
            .pop()
            .ok_or_else(|| Error::Gpu("the forward returned nothing".into()))?;
        self.fed(tokens);
        Ok(logits)
    }
}

/// One sequence for a conversation or a one-shot generation ([`HeldSeq`]), with the
/// generation loop.
pub struct Session {
    held: HeldSeq,
}

impl Session {
    /// A session without checkpoint: a prompt that does not extend what the sequence holds
    /// is fed again from the start.
    pub fn new(engine: &Engine) -> Result<Session> {
        Ok(Session {
            held: HeldSeq::new(engine)?,
        })
    }

    /// A session that keeps a [`Checkpoint`] (a second sequence) of the state where each
    /// prompt's conversation ends, for chats whose template rewrites earlier turns.
    pub fn with_checkpoint(engine: &Engine) -> Result<Session> {
        let mut s = Session::new(engine)?;
        s.held.set_checkpoint(Some(Checkpoint::new(engine)?));
        Ok(s)
    }

    /// The tokens the sequence holds.
    pub fn tokens(&self) -> &[u32] {
        self.held.tokens()
    }

    /// The tokens of the saved checkpoint (`None` without checkpoints; empty before any).
    pub fn checkpoint(&self) -> Option<&[u32]> {
        self.held.checkpoint()
    }

    /// Forget everything, the checkpoint included.
    pub fn reset(&mut self, engine: &Engine) -> Result<()> {
        self.held.reset(engine)
    }

    /// See [`HeldSeq::reusable`].
    pub fn reusable(&self, prompt: &[u32]) -> usize {
        self.held.reusable(prompt)
    }

    /// Generates a continuation of `prompt` (the whole context: earlier turns included),
    /// calling `on_piece` for every sampled token as soon as it is sampled. A checkpoint,
    /// when the session keeps one, is saved at the end of the prompt.
    pub fn generate(
        &mut self,
        engine: &mut Engine,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_piece: impl FnMut(Piece<'_>),
    ) -> Result<Output> {
        self.generate_at(engine, prompt, prompt.len(), opts, on_piece)
    }

    /// [`Session::generate`], saving the checkpoint (when the session keeps one) once the
    /// first `checkpoint_at` prompt tokens are in the sequence: for a chat, where the
    /// conversation ends and the generation prompt begins ([`ChatPrompt::encode`]), the
    /// last point the next turn's rendering is sure to share. Nothing is saved when the
    /// sequence already held more than `checkpoint_at` tokens of the prompt.
    ///
    /// The prompt is fed in pieces of the model's pass size; a cancellation between two
    /// ends the call with nothing sampled, and the session holds the pieces fed.
    pub fn generate_at(
        &mut self,
        engine: &mut Engine,
        prompt: &[u32],
        checkpoint_at: usize,
        opts: &GenerateOptions,
        on_piece: impl FnMut(Piece<'_>),
    ) -> Result<Output> {
        // The tokenizer lives in the engine, which `forward` borrows mutably: lend it out for
        // the loop and put it back whatever happens.
        let tokenizer = engine.tokenizer.take();
        let out = self.generate_with(
            engine,
            tokenizer.as_ref(),
            prompt,
            checkpoint_at.min(prompt.len()),
            opts,
            on_piece,
        );
        engine.tokenizer = tokenizer;
        out
    }

    fn generate_with(
        &mut self,
        engine: &mut Engine,
        tokenizer: Option<&Tokenizer>,
        prompt: &[u32],
        checkpoint_at: usize,
        opts: &GenerateOptions,
        mut on_piece: impl FnMut(Piece<'_>),
    ) -> Result<Output> {
        let t0 = Instant::now();
        if prompt.is_empty() {
            return Err(Error::Invalid(
                "the prompt is empty: nothing to continue".into(),
            ));
        }
        let vocab = engine.vocab_size();
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::Invalid(format!(
                "prompt token id {bad} is outside the model's vocabulary ({vocab} ids)"
            )));
        }
        let cancelled = || {
            opts.cancel
                .as_ref()
                .is_some_and(|c| c.load(Ordering::Relaxed))
        };
        let n_cached = self.held.resume(engine, prompt)?;
        let mut timings = Timings {
            n_prompt: prompt.len(),
            n_cached,
            ..Timings::default()
        };
        let mut out = Output {
            tokens: Vec::new(),
            text: String::new(),
            finish: None,
            timings: Timings::default(),
            spec: None,
        };
        if cancelled() {
            out.timings = timings;
            return Ok(out);
        }
        // Greedy and top-k sampling read back only the best logits, found on the GPU.
        let want = opts.sampler.gpu_want(None);
        let mut spec = Speculator::new(engine, &opts.spec)?;
        let prefilled = self.prefill(
            engine,
            prompt,
            (n_cached, checkpoint_at),
            want,
            &cancelled,
            spec.as_mut(),
        )?;
        timings.prefill = t0.elapsed();
        let Some(mut logits) = prefilled else {
            out.timings = timings;
            return Ok(out);
        };
        check_finite(engine, &logits, 0)?;

        let eog = match (opts.ignore_eog, tokenizer) {
            (false, Some(t)) => t.eog_ids(),
            _ => Vec::new(),
        };
        let mut stop = StopCondition::new(opts.max_tokens, opts.stop.clone(), eog);
        let mut sampler = Sampler::new(opts.sampler.clone());
        let mut decoder = StreamDecoder::new();
        // The penalties' history: the whole context, prompt included.
        let mut context = prompt.to_vec();
        let mut t_first = None;
        out.finish = stop.finished().cloned();
        while out.finish.is_none() {
            let id = sampler.sample_logits(&mut logits, &context);
            context.push(id);
            out.tokens.push(id);
            let piece = tokenizer.map(|t| decoder.push(t, id)).unwrap_or_default();
            let step = stop.push(id, &piece);
            let mut text = step.text;
            // Bytes of a character that will never be finished (the budget ran out).
            if step.finish == Some(FinishReason::Length) {
                text.push_str(&decoder.flush());
            }
            if t_first.is_none() {
                timings.first_token = t0.elapsed();
                t_first = Some(Instant::now());
            }
            on_piece(Piece {
                id,
                index: out.tokens.len() - 1,
                text: &text,
            });
            out.text.push_str(&text);
            if step.finish.is_some() {
                out.finish = step.finish;
                break;
            }
            if cancelled() {
                // Show what was held back for a stop string that never came.
                let mut rest = stop.finish();
                rest.push_str(&decoder.flush());
                if !rest.is_empty() {
                    on_piece(Piece {
                        id,
                        index: out.tokens.len() - 1,
                        text: &rest,
                    });
                    out.text.push_str(&rest);
                }
                break;
            }
            logits = match spec.as_mut() {
                None => self.held.feed(engine, &[id], want)?,
                Some(s) => self.held.speculate(engine, s, id, want)?,
            };
            check_finite(engine, &logits, out.tokens.len())?;
        }
        if let Some(mut s) = spec {
            self.held.settle(engine, &mut s)?;
            out.spec = Some(s.stats);
        }
        timings.n_generated = out.tokens.len();
        timings.decode = t_first.map(|t| t.elapsed()).unwrap_or_default();
        out.timings = timings;
        Ok(out)
    }

    /// Feeds `prompt[from..]` (at least one token) in pieces of the model's pass size
    /// (`Engine::pass_rows`: one call's passes exactly, a cancellation seen between them), saving
    /// the checkpoint once `checkpoint_at` tokens are held, and returns what `want` asks of
    /// the last token's logits; `None` when `cancelled` turned true between two pieces.
    /// With `spec` the pieces go through it (the MTP block reads their hidden states).
    fn prefill(
        &mut self,
        engine: &mut Engine,
        prompt: &[u32],
        (from, checkpoint_at): (usize, usize),
        want: Want,
        cancelled: &dyn Fn() -> bool,
        mut spec: Option<&mut Speculator>,
    ) -> Result<Option<Logits>> {
        let mut at = from;
        let piece = engine.pass_rows().max(1);
        loop {
            let mut end = (at + piece).min(prompt.len());
            if at < checkpoint_at && checkpoint_at < end {
                end = checkpoint_at;
            }
            let last = end == prompt.len();
            let piece_want = if last { want } else { Want::None };
            let logits = match spec.as_deref_mut() {
                None => self.held.feed(engine, &prompt[at..end], piece_want)?,
                Some(s) => {
                    let after = prompt.get(end).copied();
                    self.held
                        .spec_feed_prompt(engine, s, &prompt[at..end], after, piece_want)?
                }
            };
            at = end;
            if at == checkpoint_at {
                self.held.save_checkpoint(engine)?;
            }
            if last {
                return Ok(Some(logits));
            }
            if cancelled() {
                return Ok(None);
            }
        }
    }
}

/// The error for logits that cannot be sampled ([`crate::sample::logits_are_finite`]) at
/// generation step `step` (0: the prompt's last token).
pub fn check_finite(engine: &Engine, logits: &Logits, step: usize) -> Result<()> {
    if crate::sample::logits_are_finite(logits) {
        return Ok(());
    }
    Err(Error::Invalid(format!(
        "{}: the logits at generation step {step} are not finite (NaN or infinity): the model's weights or hyper-parameters (such as a norm epsilon <= 0) give non-finite numbers",
        engine.path.display()
    )))
}

/// One-shot generation on a fresh sequence.
pub fn generate(
    engine: &mut Engine,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_piece: impl FnMut(Piece<'_>),
) -> Result<Output> {
    Session::new(engine)?.generate(engine, prompt, opts, on_piece)
}

/// A model's chat template, ready to render conversations.
#[derive(Debug)]
pub struct ChatPrompt {
    template: ChatTemplate,
    /// Variables the template reads besides the messages: `bos_token`, `eos_token`, and
    /// whatever the caller adds (`enable_thinking`, `tools`).
    pub vars: serde_json::Map<String, serde_json::Value>,
    /// True when the vocabulary carries no template and lathe's ChatML stands in.
    pub fallback: bool,
}

impl ChatPrompt {
    /// The template that came with the tokenizer, else [`CHATML`] (`fallback` set).
    pub fn for_tokenizer(tokenizer: &Tokenizer) -> Result<ChatPrompt> {
        let (source, fallback) = match tokenizer.chat_template() {
            Some(s) => (s, false),
            None => (CHATML, true),
        };
        Ok(ChatPrompt {
            template: ChatTemplate::new(source)?,
            vars: tokenizer.template_tokens(),
            fallback,
        })
    }

    /// `choice` (a `--chat-template` flag's) when given, else [`ChatPrompt::for_tokenizer`].
    pub fn chosen(tokenizer: &Tokenizer, choice: Option<&TemplateChoice>) -> Result<ChatPrompt> {
        match choice {
            Some(c) => Ok(ChatPrompt {
                template: c.compile(crate::tokenizer::TemplateLimits::default())?,
                vars: tokenizer.template_tokens(),
                fallback: false,
            }),
            None => ChatPrompt::for_tokenizer(tokenizer),
        }
    }

    /// The prompt text for `messages` (a JSON list of `{role, content}`); with
    /// `add_generation_prompt` it ends where the assistant's reply begins.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.template
            .render(messages, add_generation_prompt, &self.vars)
    }

    /// The prompt tokens for `messages` (rendered with the generation prompt, BOS as the
    /// tokenizer wants it) and how many of them the conversation fills
    /// ([`conversation_len`]): the checkpoint position for [`Session::generate_at`].
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        messages: &serde_json::Value,
    ) -> Result<(Vec<u32>, usize)> {
        let prompt = tokenizer.encode_with_bos(&self.render(messages, true)?, true)?;
        let n = conversation_len(&self.template, &self.vars, messages, tokenizer, &prompt);
        Ok((prompt, n))
    }
}

/// How many leading tokens of `prompt` (the encoding of `template` over `messages` with
/// the generation prompt) the conversation itself fills: the encoding of the rendering
/// without the generation prompt when it is a prefix of `prompt`, else all of `prompt`.
/// A checkpoint belongs there: templates rewrite earlier assistant turns (Qwen3.5 and
/// DeepSeek-V4 drop their reasoning, and their generation prompt opens a `<think>` block
/// that the same turn in history lacks), so the next turn's rendering is only sure to
/// agree with this one up to the end of the conversation.
pub fn conversation_len(
    template: &ChatTemplate,
    vars: &serde_json::Map<String, serde_json::Value>,
    messages: &serde_json::Value,
    tokenizer: &Tokenizer,
    prompt: &[u32],
) -> usize {
    let head = template
        .render(messages, false, vars)
        .and_then(|text| tokenizer.encode_with_bos(&text, true));
    match head {
        Ok(h) if h.len() <= prompt.len() && prompt[..h.len()] == h[..] => h.len(),
        _ => prompt.len(),
    }
}
