//! Choosing the next token from the logits on the CPU, and deciding when to stop.
//!
//! The chain follows llama.cpp's default order: penalties -> top-k -> top-p -> min-p ->
//! temperature -> draw. Top-p and min-p therefore see the untempered distribution, and the
//! temperature only reshapes what survived them. Temperature 0 is greedy (argmax after
//! penalties). Probabilities are computed with the maximum subtracted first and summed in f64.
//!
//! Without penalties, greedy and top-k sampling only ever look at the k best logits, so the
//! forward can find those on the GPU and read back only them ([`SamplerConfig::gpu_want`] says
//! what to ask for, [`Sampler::sample_top`] draws from them): the same candidates (ties to
//! the lower id, as [`argmax`] and [`top_k`]), the same probabilities, the same random
//! stream, hence the same tokens as [`Sampler::sample`] on the full logits.

mod stop;

use std::collections::HashMap;

use crate::forward::{Logits, Want};
use crate::gpu::topk::MAX_TOP_K;

pub use stop::{FinishReason, StopCondition, StopStep};

pub use crate::gpu::topk::TopLogits;

/// Whether a forward's logits can be sampled from: every logit of a full row finite, or
/// the best the GPU found finite (its top-k pass skips NaNs, so a row of NaNs comes back
/// with no candidates). Weights holding NaN or infinity, or a norm epsilon <= 0, make
/// non-finite logits, from which every sampler would pick token 0 forever without a word.
pub fn logits_are_finite(logits: &Logits) -> bool {
    match logits {
        Logits::Full(l) => l.iter().all(|x| x.is_finite()),
        Logits::Top(t) => {
            t.cands.first().is_some_and(|c| c.1.is_finite()) && t.lse.is_none_or(|l| l.is_finite())
        }
    }
}

/// Sampling settings. The defaults are llama.cpp's (`temp 0.8, top_k 40, top_p 0.95, min_p
/// 0.05`, no penalties, a 64-token penalty window) with a fixed seed.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// Divides the logits; 0 (or less) means greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities add up to at least p; 1 = off.
    pub top_p: f32,
    /// Keep tokens with probability >= min_p x the top probability; 0 = off.
    pub min_p: f32,
    /// llama.cpp's repetition penalty: a seen token's logit is divided by it when positive,
    /// multiplied when negative; 1 = off.
    pub repeat_penalty: f32,
    /// Subtracted once from the logit of every token seen in the window; 0 = off.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the window; 0 = off.
    pub frequency_penalty: f32,
    /// How many of the last tokens of the history the penalties look at; 0 = none.
    pub penalty_window: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> SamplerConfig {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_window: 64,
            seed: 0x1a7e_5eed,
        }
    }
}

/// A sampling setting outside the values it can take, as both front ends report it (the
/// server names the request field, the CLI its flag).
#[derive(Clone, Debug, PartialEq)]
pub struct OutOfRange {
    /// The setting's name in the OpenAI API (`temperature`, `top_p`, ...).
    pub field: &'static str,
    pub value: f32,
    /// What it may be, in words.
    pub allowed: &'static str,
}

impl std::fmt::Display for OutOfRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "is {}; it must be {}", self.value, self.allowed)
    }
}

impl SamplerConfig {
    /// Checks every setting against the values it can take: a NaN, a negative temperature,
    /// a probability above 1, or a repeat penalty of 0 (which divides by zero: an infinite
    /// boost) would otherwise sample something other than what was asked, without a word.
    /// The ranges are those the OpenAI API documents, and llama.cpp's for its extensions.
    pub fn check(&self) -> std::result::Result<(), OutOfRange> {
        let checks: [(&'static str, f32, bool, &'static str); 6] = [
            (
                "temperature",
                self.temperature,
                (0.0..=100.0).contains(&self.temperature),
                "between 0 and 100 (0 = greedy)",
            ),
            (
                "top_p",
                self.top_p,
                (0.0..=1.0).contains(&self.top_p),
                "between 0 and 1 (1 = off)",
            ),
            (
                "min_p",
                self.min_p,
                (0.0..=1.0).contains(&self.min_p),
                "between 0 and 1 (0 = off)",
            ),
            (
                "repeat_penalty",
                self.repeat_penalty,
                self.repeat_penalty > 0.0 && self.repeat_penalty <= 100.0,
                "greater than 0 and at most 100 (1 = off)",
            ),
            (
                "presence_penalty",
                self.presence_penalty,
                (-2.0..=2.0).contains(&self.presence_penalty),
                "between -2 and 2 (0 = off)",
            ),
            (
                "frequency_penalty",
                self.frequency_penalty,
                (-2.0..=2.0).contains(&self.frequency_penalty),
                "between -2 and 2 (0 = off)",
            ),
        ];
        // `contains` and `>` are false for NaN, so NaN fails every check.
        match checks.into_iter().find(|c| !c.2) {
            Some((field, value, _, allowed)) => Err(OutOfRange {
                field,
                value,
                allowed,
            }),
            None => Ok(()),
        }
    }

    /// Argmax, no penalties.
    pub fn greedy() -> SamplerConfig {
        SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        }
    }

    /// What a forward should return so that [`Sampler::sample_top`] can pick the token:
    /// greedy needs the best logit (`Top { k: 1 }`), top-k sampling the k best; with
    /// `logprobs` = `Some(n)` at least n candidates and the log-sum-exp as well. Full logits
    /// (`Want::Last`) when the penalties change logits first, when top-k is off (top-p or
    /// min-p over the whole vocabulary) or when k exceeds [`MAX_TOP_K`].
    pub fn gpu_want(&self, logprobs: Option<usize>) -> Want {
        if self.has_penalties() {
            return Want::Last;
        }
        let k = if self.temperature <= 0.0 {
            1
        } else if self.top_k > 0 {
            self.top_k
        } else {
            return Want::Last;
        };
        let k = k.max(logprobs.unwrap_or(0));
        if k > MAX_TOP_K as usize {
            return Want::Last;
        }
        Want::Top {
            k: k as u32,
            lse: logprobs.is_some(),
        }
    }

    pub fn has_penalties(&self) -> bool {
        self.penalty_window > 0
            && (self.repeat_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }
}

/// A sampler: the settings and its own random stream (xoshiro256**, seeded by splitmix64), so
/// the same seed, logits and history give the same tokens on every machine.
#[derive(Clone, Debug)]
pub struct Sampler {
    pub config: SamplerConfig,
    rng: Xoshiro256,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Sampler {
        let rng = Xoshiro256::seeded(config.seed);
        Sampler { config, rng }
    }

    /// Picks the next token. `logits` [n_vocab] gets the penalties applied in place;
    /// `history` is the context so far (prompt and generated tokens), of which the last
    /// `penalty_window` count. NaN logits count as -inf. Empty logits give 0.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let cands = self.candidates(logits, history);
        self.draw(&cands)
    }

    /// Picks the next token from the best logits the GPU found, as [`Sampler::sample`] would
    /// from the full row: `top` must come from the [`Want`] that
    /// [`SamplerConfig::gpu_want`] gave for this config (no penalties apply there).
    pub fn sample_top(&mut self, top: &TopLogits) -> u32 {
        let cands = self.candidates_top(top);
        self.draw(&cands)
    }

    /// [`Sampler::sample`] or [`Sampler::sample_top`], whichever `logits` allows (a forward
    /// asked for [`SamplerConfig::gpu_want`]). Full logits get the penalties in place.
    pub fn sample_logits(&mut self, logits: &mut Logits, history: &[u32]) -> u32 {
        match logits {
            Logits::Full(l) => self.sample(l, history),
            Logits::Top(t) => self.sample_top(t),
        }
    }

    /// [`Sampler::candidates`] from the GPU's best logits.
    pub fn candidates_top(&self, top: &TopLogits) -> Vec<(u32, f32)> {
        let cfg = &self.config;
        let mut cands = top.cands.clone();
        if cfg.temperature <= 0.0 {
            cands.truncate(1);
            return cands;
        }
        // More than top_k may have come back (for log-probabilities); fewer means the
        // vocabulary is smaller than k, where the full path keeps every token too.
        if cfg.top_k > 0 {
            cands.truncate(cfg.top_k);
        }
        self.narrow(cands, false)
    }

    /// Draws from softmax(cands) (sorted, most likely first); the first one when greedy.
    fn draw(&mut self, cands: &[(u32, f32)]) -> u32 {
        if cands.len() <= 1 || self.config.temperature <= 0.0 {
            return cands.first().map(|c| c.0).unwrap_or(0);
        }
        // Draw from softmax(cands): the candidates are sorted, most likely first.
        let max = cands[0].1;
        if !max.is_finite() {
            return cands[0].0;
        }
        let weights: Vec<f64> = cands.iter().map(|c| ((c.1 - max) as f64).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut target = self.rng.next_f64() * total;
        for (c, w) in cands.iter().zip(&weights) {
            if target < *w {
                return c.0;
            }
            target -= w;
        }
        cands[cands.len() - 1].0
    }

    /// The tokens that survive the chain, most likely first (ties: lower id first), each with
    /// its final logit (after penalties and temperature). Greedy gives the argmax alone.
    pub fn candidates(&self, logits: &mut [f32], history: &[u32]) -> Vec<(u32, f32)> {
        let cfg = &self.config;
        apply_penalties(logits, history, cfg);
        if cfg.temperature <= 0.0 {
            return argmax(logits)
                .map(|i| vec![(i, logits[i as usize])])
                .unwrap_or_default();
        }
        // The whole-vocabulary branches give what `narrow` would on all tokens sorted,
        // without sorting all of them (top-p already applied when `top_p_of_all` ran).
        let (cands, nucleus_done) = if cfg.top_k > 0 && cfg.top_k < logits.len() {
            (top_k(logits, cfg.top_k), false)
        } else if cfg.top_p < 1.0 {
            (top_p_of_all(logits, cfg.top_p), true)
        } else if cfg.min_p > 0.0 {
            (above_min_p(logits, cfg.min_p), false)
        } else {
            (top_k(logits, 0), false)
        };
        self.narrow(cands, nucleus_done)
    }

    /// Top-p (unless `nucleus_done`), min-p and temperature over sorted candidates.
    fn narrow(&self, mut cands: Vec<(u32, f32)>, nucleus_done: bool) -> Vec<(u32, f32)> {
        let cfg = &self.config;
        if cfg.top_p < 1.0 && !nucleus_done {
            top_p(&mut cands, cfg.top_p);
        }
        if cfg.min_p > 0.0 {
            min_p(&mut cands, cfg.min_p);
        }
        let inv_t = 1.0 / cfg.temperature;
        for c in &mut cands {
            c.1 *= inv_t;
        }
        cands
    }
}

/// Keeps only the tokens a constraint allows: a logit whose bit is clear in `allowed` (bit
/// `i % 32` of word `i / 32`, the layout of llguidance's token sets) becomes -inf, which no
/// sampler step (penalties, top-k, top-p, min-p, the draw) can pick. Ids past `allowed`'s
/// words are not allowed.
pub fn mask_logits(logits: &mut [f32], allowed: &[u32]) {
    for (i, chunk) in logits.chunks_mut(32).enumerate() {
        let word = allowed.get(i).copied().unwrap_or(0);
        if word == u32::MAX {
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if word >> b & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// llama.cpp's penalties over the last `penalty_window` tokens of `history`: for a token seen
/// c times, `l = l / r` if l > 0 else `l * r` (r = repeat_penalty), then
/// `l -= c * frequency_penalty + presence_penalty`. Ids outside `logits` are ignored.
pub fn apply_penalties(logits: &mut [f32], history: &[u32], cfg: &SamplerConfig) {
    if !cfg.has_penalties() {
        return;
    }
    let window = &history[history.len().saturating_sub(cfg.penalty_window)..];
    let mut counts: HashMap<u32, u32> = HashMap::with_capacity(window.len());
    for &t in window {
        *counts.entry(t).or_insert(0) += 1;
    }
    for (&t, &c) in &counts {
        let Some(l) = logits.get_mut(t as usize) else {
            continue;
        };
        if *l > 0.0 {
            *l /= cfg.repeat_penalty;
        } else {
            *l *= cfg.repeat_penalty;
        }
        *l -= c as f32 * cfg.frequency_penalty + cfg.presence_penalty;
    }
}

/// ln Σ exp(l) over `logits` in f64 (max subtracted first; NaNs skipped; −inf when nothing
/// else is left). The CPU reference of `gpu::topk::log_sum_exp`.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    let sum: f64 = logits
        .iter()
        .filter(|x| !x.is_nan())
        .map(|&x| ((x - max) as f64).exp())
        .sum();
    max as f64 + sum.ln()
}

/// Sort key: larger logit first, NaN as -inf, then lower id.
fn order(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    let key = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
    key(b.1).total_cmp(&key(a.1)).then(a.0.cmp(&b.0))
}

/// Index of the largest logit (the lowest such index on ties, NaN never wins).
pub fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(u32, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        let c = (i as u32, l);
        if best.is_none_or(|b| order(&c, &b).is_lt()) {
            best = Some(c);
        }
    }
    best.map(|b| b.0)
}

/// The k largest logits as (id, logit), sorted; all of them when k is 0 or >= n.
pub fn top_k(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut cands = top_k_unsorted(logits);
    if k > 0 && k < cands.len() {
        cands.select_nth_unstable_by(k - 1, order);
        cands.truncate(k);
    }
    cands.sort_unstable_by(order);
    cands
}

/// Keeps the shortest prefix of the sorted candidates whose probability (softmax over all
/// candidates) reaches `p`; at least one.
pub fn top_p(cands: &mut Vec<(u32, f32)>, p: f32) {
    if cands.is_empty() {
        return;
    }
    let max = cands[0].1;
    if !max.is_finite() {
        cands.truncate(1);
        return;
    }
    let total: f64 = cands.iter().map(|c| ((c.1 - max) as f64).exp()).sum();
    let target = p as f64 * total;
    let mut cum = 0.0;
    for (i, c) in cands.iter().enumerate() {
        cum += ((c.1 - max) as f64).exp();
        if cum >= target {
            cands.truncate(i + 1);
            return;
        }
    }
}

/// [`top_p`] over the whole vocabulary without sorting all of it: the nucleus is found among
/// the best m tokens, m growing 8x until their mass reaches p (a 248k-entry sort would cost
/// ~10 ms a token; the nucleus is usually a few hundred).
fn top_p_of_all(logits: &[f32], p: f32) -> Vec<(u32, f32)> {
    let mut all = top_k_unsorted(logits);
    let Some(max) = all.iter().map(|c| c.1).max_by(f32::total_cmp) else {
        return all;
    };
    if !max.is_finite() {
        return top_k(logits, 1);
    }
    let total: f64 = all.iter().map(|c| ((c.1 - max) as f64).exp()).sum();
    let target = p as f64 * total;
    let mut m = 256usize;
    loop {
        if m < all.len() {
            all.select_nth_unstable_by(m - 1, order);
        }
        let len = m.min(all.len());
        let prefix = &mut all[..len];
        prefix.sort_unstable_by(order);
        let mut cum = 0.0;
        for (i, c) in prefix.iter().enumerate() {
            cum += ((c.1 - max) as f64).exp();
            if cum >= target {
                all.truncate(i + 1);
                return all;
            }
        }
        if m >= all.len() {
            return all;
        }
        m = m.saturating_mul(8);
    }
}

/// [`min_p`] over the whole vocabulary: filter first, sort the few survivors.
fn above_min_p(logits: &[f32], m: f32) -> Vec<(u32, f32)> {
    let mut all = top_k_unsorted(logits);
    let Some(max) = all.iter().map(|c| c.1).max_by(f32::total_cmp) else {
        return all;
    };
    let floor = max as f64 + (m as f64).ln();
    all.retain(|c| c.1 as f64 >= floor || c.1 == max);
    all.sort_unstable_by(order);
    all
}

/// Every (id, logit), NaN replaced by -inf, in id order.
fn top_k_unsorted(logits: &[f32]) -> Vec<(u32, f32)> {
    logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, if l.is_nan() { f32::NEG_INFINITY } else { l }))
        .collect()
}

/// Keeps candidates whose probability is at least `m` x the top one, i.e. whose logit is at
/// least `max + ln(m)`; at least one.
pub fn min_p(cands: &mut Vec<(u32, f32)>, m: f32) {
    if cands.is_empty() {
        return;
    }
    let floor = cands[0].1 as f64 + (m as f64).ln();
    let keep = cands.iter().take_while(|c| c.1 as f64 >= floor).count();
    cands.truncate(keep.max(1));
}

/// xoshiro256** (Blackman & Vigna), state filled from the seed by splitmix64.
#[derive(Clone, Debug)]
struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    fn seeded(seed: u64) -> Xoshiro256 {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Xoshiro256 {
            s: [next(), next(), next(), next()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in [0, 1) with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}
