//! The generation loop that `lathe run`, `lathe chat` and the HTTP server share: prompt
//! tokens in; sampled tokens and the text they make streamed out through a callback; timings
//! at the end.
//!
//! A [`Session`] owns one sequence and remembers the tokens it has consumed, so a caller that
//! sends the whole conversation each turn pays only for the new part: when the consumed
//! tokens are a prefix of the new prompt, only the rest is fed; otherwise the sequence is
//! reset and the whole prompt is fed again (recurrent layers cannot be rolled back to a
//! shorter prefix).
//!
//! Text is streamed the way llama.cpp's server streams it: each token goes through the
//! [`StreamDecoder`] (never half a UTF-8 character) and then the [`StopCondition`] (text that
//! may start a stop string is held back until the next tokens show whether it does).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::engine::{Engine, Seq};
use crate::sample::{FinishReason, Sampler, SamplerConfig, StopCondition};
use crate::tokenizer::{ChatTemplate, StreamDecoder, Tokenizer, CHATML};
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
}

impl Default for GenerateOptions {
    fn default() -> GenerateOptions {
        GenerateOptions {
            max_tokens: Some(256),
            sampler: SamplerConfig::default(),
            stop: Vec::new(),
            ignore_eog: false,
            cancel: None,
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
}

/// One sequence and the tokens it has consumed.
pub struct Session {
    seq: Seq,
    /// The tokens `seq` holds, in order: prompts and fed generated tokens. The last sampled
    /// token of a generation is never fed, so it is not here.
    tokens: Vec<u32>,
    /// An error left the sequence in an unknown state: reset before the next use.
    stale: bool,
}

impl Session {
    pub fn new(engine: &Engine) -> Result<Session> {
        Ok(Session {
            seq: engine.new_seq()?,
            tokens: Vec::new(),
            stale: false,
        })
    }

    /// The tokens the sequence holds.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Forget everything.
    pub fn reset(&mut self, engine: &Engine) -> Result<()> {
        self.stale = true;
        engine.reset(&mut self.seq)?;
        self.tokens.clear();
        self.stale = false;
        Ok(())
    }

    /// How many tokens of `prompt` the sequence already holds and can keep: all it holds
    /// when that is a proper prefix of `prompt` (at least one token must be fed to get
    /// logits), else 0.
    pub fn reusable(&self, prompt: &[u32]) -> usize {
        let n = self.tokens.len();
        if !self.stale && n < prompt.len() && prompt[..n] == self.tokens[..] {
            n
        } else {
            0
        }
    }

    /// Generates a continuation of `prompt` (the whole context: earlier turns included),
    /// calling `on_piece` for every sampled token as soon as it is sampled.
    pub fn generate(
        &mut self,
        engine: &mut Engine,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_piece: impl FnMut(Piece<'_>),
    ) -> Result<Output> {
        // The tokenizer lives in the engine, which `forward` borrows mutably: lend it out for
        // the loop and put it back whatever happens.
        let tokenizer = engine.tokenizer.take();
        let out = self.generate_with(engine, tokenizer.as_ref(), prompt, opts, on_piece);
        engine.tokenizer = tokenizer;
        out
    }

    fn generate_with(
        &mut self,
        engine: &mut Engine,
        tokenizer: Option<&Tokenizer>,
        prompt: &[u32],
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
        let n_cached = self.reusable(prompt);
        if n_cached == 0 && (self.stale || !self.tokens.is_empty()) {
            self.reset(engine)?;
        }
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
        };
        if cancelled() {
            out.timings = timings;
            return Ok(out);
        }
        let mut logits = self.feed(engine, &prompt[n_cached..])?;
        timings.prefill = t0.elapsed();

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
            let id = sampler.sample(&mut logits, &context);
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
            logits = self.feed(engine, &[id])?;
        }
        timings.n_generated = out.tokens.len();
        timings.decode = t_first.map(|t| t.elapsed()).unwrap_or_default();
        out.timings = timings;
        Ok(out)
    }

    /// Feeds `tokens` (at least one) and returns the last one's logits [vocab].
    fn feed(&mut self, engine: &mut Engine, tokens: &[u32]) -> Result<Vec<f32>> {
        self.stale = true;
        let logits = engine.forward(&mut self.seq, tokens, false)?;
        self.tokens.extend_from_slice(tokens);
        self.stale = false;
        Ok(logits)
    }
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
}
