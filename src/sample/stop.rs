//! When generation ends: an end-of-generation token, a stop string in the decoded text, or the
//! token budget. A stop string can arrive split over several tokens, so text that might be the
//! start of one is held back until the next tokens show whether it is.

use std::collections::HashSet;

/// Why generation ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token; its text is not part of the output.
    Eog(u32),
    /// The stop string with this index appeared; the output ends just before it.
    StopString(usize),
    /// `max_tokens` tokens were generated.
    Length,
}

impl FinishReason {
    /// The OpenAI API's `finish_reason`.
    pub fn as_api_str(&self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            _ => "stop",
        }
    }
}

/// What one token changed: text that is now safe to show, and the end if this was it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopStep {
    pub text: String,
    pub finish: Option<FinishReason>,
}

/// Tracks one generation's stop rules. Feed it every generated token with the text the
/// [`crate::tokenizer::StreamDecoder`] made of it.
#[derive(Clone, Debug)]
pub struct StopCondition {
    max_tokens: Option<usize>,
    stops: Vec<String>,
    eog: HashSet<u32>,
    n_tokens: usize,
    /// The end of the text so far that could be the start of a stop string.
    held: String,
    finished: Option<FinishReason>,
}

impl StopCondition {
    /// `max_tokens` None = no budget; empty stop strings are ignored. With `max_tokens` 0 it
    /// is finished before the first token.
    pub fn new(
        max_tokens: Option<usize>,
        stops: Vec<String>,
        eog_ids: impl IntoIterator<Item = u32>,
    ) -> StopCondition {
        StopCondition {
            max_tokens,
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            eog: eog_ids.into_iter().collect(),
            n_tokens: 0,
            held: String::new(),
            finished: (max_tokens == Some(0)).then_some(FinishReason::Length),
        }
    }

    /// Takes one generated token and its decoded text. After the end it returns nothing new.
    pub fn push(&mut self, id: u32, piece: &str) -> StopStep {
        if let Some(f) = &self.finished {
            return StopStep {
                text: String::new(),
                finish: Some(f.clone()),
            };
        }
        self.n_tokens += 1;
        if self.eog.contains(&id) {
            let text = std::mem::take(&mut self.held);
            return self.end(text, FinishReason::Eog(id));
        }
        let mut pending = std::mem::take(&mut self.held);
        pending.push_str(piece);
        // The earliest stop string in the new text; by construction none started earlier.
        let hit = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| pending.find(s.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, i)) = hit {
            pending.truncate(at);
            return self.end(pending, FinishReason::StopString(i));
        }
        let hold = self.longest_stop_prefix_suffix(&pending);
        self.held = pending.split_off(pending.len() - hold);
        if self.max_tokens.is_some_and(|m| self.n_tokens >= m) {
            pending.push_str(&std::mem::take(&mut self.held));
            return self.end(pending, FinishReason::Length);
        }
        StopStep {
            text: pending,
            finish: None,
        }
    }

    /// Releases the held text when the caller ends generation for its own reasons.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Text held back now because it may begin a stop string.
    pub fn held(&self) -> &str {
        &self.held
    }

    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    pub fn finished(&self) -> Option<&FinishReason> {
        self.finished.as_ref()
    }

    fn end(&mut self, text: String, why: FinishReason) -> StopStep {
        self.finished = Some(why.clone());
        StopStep {
            text,
            finish: Some(why),
        }
    }

    /// Length in bytes of the longest end of `text` that is a proper prefix of a stop string.
    fn longest_stop_prefix_suffix(&self, text: &str) -> usize {
        let mut best = 0;
        for s in &self.stops {
            for k in (best + 1..s.len()).rev() {
                if s.is_char_boundary(k) && text.ends_with(&s[..k]) {
                    best = k;
                    break;
                }
            }
        }
        best
    }
}
