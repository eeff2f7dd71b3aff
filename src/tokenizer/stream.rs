//! Decoding one token at a time. A byte-level token can end inside a UTF-8 character (an emoji
//! is often three or four byte tokens), so the decoder keeps the unfinished tail of the bytes
//! and hands out only whole characters.

use super::Tokenizer;

/// Turns ids, fed one at a time, into text that is complete so far. Owns no reference to the
/// tokenizer, so a session can keep it next to an `Arc<Tokenizer>`.
#[derive(Clone, Debug, Default)]
pub struct StreamDecoder {
    /// Bytes of an unfinished character (at most 3).
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Adds one token and returns the text it completes (may be empty). Bytes that can never
    /// become valid UTF-8 come out as U+FFFD, as [`Tokenizer::decode`] writes them.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.pending
            .extend_from_slice(tokenizer.token_bytes(id).unwrap_or(&[]));
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, tail) = rest.split_at(e.valid_up_to());
                    // `good` is valid UTF-8: from_utf8 checked it up to there.
                    out.push_str(std::str::from_utf8(good).unwrap_or_default());
                    match e.error_len() {
                        // Invalid bytes: replace them and go on.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &tail[n..];
                        }
                        // A character cut short at the end: wait for more bytes.
                        None => {
                            rest = tail;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// Text of any unfinished character at the end of generation (U+FFFD for it), leaving
    /// the decoder empty.
    pub fn flush(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Whether bytes are held back waiting for the rest of a character.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}
