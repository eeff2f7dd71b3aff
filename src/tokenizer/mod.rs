//! Text <-> token ids: a Hugging Face `tokenizer.json` or a GGUF vocabulary, both run by the
//! `tokenizers` crate, plus the chat template ([`template`]) and an incremental decoder
//! ([`StreamDecoder`]).
//!
//! Special tokens are split out of the text here rather than by `tokenizers`: the inner
//! tokenizer is set to treat special added tokens as plain text, and [`Tokenizer::encode`]
//! cuts them out itself when asked to, so one loaded vocabulary serves both modes without
//! a mutable switch or a second copy.
//!
//! Decoding is ours too: every id maps to the bytes it stands for (byte-level BPE tokens
//! through the inverse of GPT-2's byte-to-unicode table, added tokens as their text), so
//! decoding is a concatenation and a stream can hold back half a UTF-8 character exactly.

mod builtin;
mod gguf_vocab;
mod hf;
mod stream;
pub mod template;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

pub use builtin::{builtin_names, builtin_template, Builtin, TemplateChoice, BUILTIN_TEMPLATES};
pub use gguf_vocab::GgufVocab;
pub use stream::StreamDecoder;
pub use template::{ChatTemplate, TemplateLimits, CHATML};

/// Texts of special tokens that end a turn or a document in the model families we know. A
/// token with one of these texts counts as end-of-generation only when the vocabulary marks
/// it special (HF `special: true`, GGUF control type), as llama.cpp does.
const EOG_TEXTS: &[&str] = &[
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
    "</s>",
];

/// Candidates for the end-of-turn token when the vocabulary names none, in order of preference.
const EOT_TEXTS: &[&str] = &["<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"];

/// A tokenizer with its special ids and chat template.
pub struct Tokenizer {
    /// Encodes plain text; special added tokens are NOT recognised by it (see module doc).
    inner: tokenizers::Tokenizer,
    /// Special added tokens, searched in the text when `parse_special` is set.
    specials: SpecialMatcher,
    /// [n_ids] the bytes each id decodes to; empty for ids that no token uses.
    pieces: Vec<Vec<u8>>,
    /// Ids of special (control) tokens.
    special_ids: HashSet<u32>,
    eog_ids: HashSet<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    chat_template: Option<String>,
    /// Where it came from, for messages.
    source: PathBuf,
}

/// What a loader knows besides the `tokenizers` object; finished by [`Tokenizer::assemble`].
struct Parts {
    inner: tokenizers::Tokenizer,
    byte_level: bool,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    chat_template: Option<String>,
    /// More end-of-generation ids (e.g. from `generation_config.json`).
    extra_eog: Vec<u32>,
    source: PathBuf,
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`, with `tokenizer_config.json` (BOS/EOS, add_bos,
    /// chat template), `chat_template.jinja` and `generation_config.json` (EOS ids) from the
    /// same folder when they are there.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer> {
        hf::load(path.as_ref()).and_then(Tokenizer::assemble)
    }

    /// Loads `dir/tokenizer.json` and its companions (see [`Tokenizer::from_file`]).
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Tokenizer> {
        Tokenizer::from_file(dir.as_ref().join("tokenizer.json"))
    }

    /// Builds a tokenizer from the `tokenizer.ggml.*` fields of a GGUF file.
    pub fn from_gguf_vocab(v: GgufVocab) -> Result<Tokenizer> {
        gguf_vocab::build(v).and_then(Tokenizer::assemble)
    }

    fn assemble(p: Parts) -> Result<Tokenizer> {
        let mut inner = p.inner;
        inner.set_encode_special_tokens(true);
        // A tokenizer.json may carry training-time truncation or padding; prompts get neither.
        inner
            .with_truncation(None)
            .map_err(|e| Error::format(&p.source, format!("truncation: {e}")))?;
        inner.with_padding(None);
        let added = inner.get_added_tokens_decoder();
        let model_vocab = inner.get_vocab(false);
        let n_ids = model_vocab
            .values()
            .chain(added.keys())
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        let mut pieces = vec![Vec::new(); n_ids];
        for (text, &id) in &model_vocab {
            pieces[id as usize] = if p.byte_level {
                byte_level_bytes(text)
            } else {
                sentencepiece_bytes(text)
            };
        }
        let mut special_ids = HashSet::new();
        let mut specials = Vec::new();
        for (&id, tok) in &added {
            pieces[id as usize] = tok.content.as_bytes().to_vec();
            if tok.special {
                special_ids.insert(id);
                if !tok.content.is_empty() {
                    specials.push((tok.content.clone(), id));
                }
            }
        }
        let special_id = |text: &str| {
            specials
                .iter()
                .find(|(content, _)| content == text)
                .map(|&(_, id)| id)
        };
        let eot = p
            .eot
            .or_else(|| EOT_TEXTS.iter().find_map(|t| special_id(t)));
        let mut eog_ids: HashSet<u32> = EOG_TEXTS.iter().filter_map(|t| special_id(t)).collect();
        eog_ids.extend(p.eos.iter().chain(eot.iter()).chain(p.extra_eog.iter()));
        for (name, id) in [("bos", p.bos), ("eos", p.eos), ("eot", eot), ("pad", p.pad)] {
            if let Some(id) = id {
                if id as usize >= n_ids {
                    return Err(Error::format(
                        &p.source,
                        format!("{name} token id {id} is outside the vocabulary ({n_ids} ids)"),
                    ));
                }
            }
        }
        Ok(Tokenizer {
            inner,
            specials: SpecialMatcher::new(specials),
            pieces,
            special_ids,
            eog_ids,
            bos: p.bos,
            eos: p.eos,
            eot,
            pad: p.pad,
            add_bos: p.add_bos,
            chat_template: p.chat_template,
            source: p.source,
        })
    }

    /// Token ids of `text`, without BOS. With `parse_special`, special tokens written in the
    /// text (`<|im_start|>`) become their ids; without it they are tokenized as plain text.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        if !parse_special {
            self.encode_plain(text, &mut ids)?;
            return Ok(ids);
        }
        let mut rest = text;
        while let Some((start, len, id)) = self.specials.find(rest) {
            self.encode_plain(&rest[..start], &mut ids)?;
            ids.push(id);
            rest = &rest[start + len..];
        }
        self.encode_plain(rest, &mut ids)?;
        Ok(ids)
    }

    /// Whether `text` encodes to more than `limit` tokens, decided with work and memory
    /// bounded by `limit` rather than by the text's length: `Some(n)` when it takes at least
    /// `n > limit` tokens, `None` when [`Tokenizer::encode`] should run on it.
    ///
    /// `encode` holds per-byte offsets and copies of the whole text (~100 bytes of memory
    /// per byte of input), so a server must not run it on megabytes it will refuse anyway.
    /// Long texts are counted in pieces of [`PROBE_CHUNK`] bytes cut after whitespace, and
    /// the count stops once past the limit. A cut can change the tokens around it by a
    /// few, so each cut is granted [`PROBE_SLACK`] tokens before the text is refused.
    pub fn exceeds(&self, text: &str, parse_special: bool, limit: usize) -> Result<Option<usize>> {
        // A short text costs little to encode whole, and a text of at most `limit` bytes is
        // at most `limit` tokens but for a normalizer that expands it (a token stands for
        // one byte or more); the caller compares the exact count after encoding anyway.
        if text.len() <= PROBE_CHUNK.max(limit) {
            return Ok(None);
        }
        let (mut n, mut cuts, mut rest) = (0usize, 0usize, text);
        while !rest.is_empty() {
            let end = probe_cut(rest, PROBE_CHUNK);
            n += self.encode(&rest[..end], parse_special)?.len();
            rest = &rest[end..];
            let at_least = n.saturating_sub(cuts * PROBE_SLACK);
            if at_least > limit {
                return Ok(Some(at_least));
            }
            cuts += 1;
        }
        Ok(None)
    }

    /// [`Tokenizer::encode`] with BOS in front when the vocabulary asks for it (`add_bos`),
    /// unless the text already starts with BOS (a chat template often writes it).
    pub fn encode_with_bos(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let mut ids = self.encode(text, parse_special)?;
        if let (true, Some(bos)) = (self.add_bos, self.bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        let enc = self.inner.encode_fast(text, false).map_err(|e| {
            Error::Invalid(format!("{}: encoding failed: {e}", self.source.display()))
        })?;
        out.extend_from_slice(enc.get_ids());
        Ok(())
    }

    /// The text of `ids`, special tokens included. Bytes that do not form valid UTF-8 become
    /// U+FFFD; ids outside the vocabulary decode to nothing.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id).unwrap_or(&[]));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The bytes one token stands for (a byte-level token may hold part of a character).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize).map(|p| p.as_slice())
    }

    /// The token's string as stored in the vocabulary (byte-level form, e.g. `Ġworld`).
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token given its vocabulary string.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }
    /// End of turn (`<|im_end|>` for Qwen), when the vocabulary has one.
    pub fn eot_id(&self) -> Option<u32> {
        self.eot
    }
    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }
    /// Whether [`Tokenizer::encode_with_bos`] puts BOS in front.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether generation stops at this token: EOS, EOT, and special tokens such as
    /// `<|im_end|>` or `<|endoftext|>`.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog_ids.contains(&id)
    }

    /// All end-of-generation ids, sorted.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.eog_ids.iter().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Whether the id is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    /// Number of ids: one past the largest id any token uses (base vocabulary + added).
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// The chat template that came with the vocabulary (Jinja source), if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// `bos_token` and `eos_token` as a chat template expects them in its context (what
    /// transformers passes from the tokenizer's special tokens map).
    pub fn template_tokens(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        for (name, id) in [
            ("bos_token", self.bos),
            ("eos_token", self.eos),
            ("pad_token", self.pad),
        ] {
            if let Some(id) = id {
                m.insert(name.into(), self.decode(&[id]).into());
            }
        }
        m
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eot", &self.eot)
            .field("add_bos", &self.add_bos)
            .field("eog_ids", &self.eog_ids())
            .finish_non_exhaustive()
    }
}

/// Bytes of text counted at once by [`Tokenizer::exceeds`]: ~2 MB of encoder memory.
const PROBE_CHUNK: usize = 16 << 10;
/// Tokens a cut between two probe pieces may add to the count (a word or a run of spaces
/// split in two: one or two more; a special token split: its length in bytes at worst, but
/// cuts fall after whitespace, which special tokens rarely hold).
const PROBE_SLACK: usize = 4;

/// Where to end a probe piece of at most about `max` bytes of `text`: after the last
/// whitespace before `max` when there is one in its second half, else at the character
/// boundary at `max` (the whole text when it is shorter).
fn probe_cut(text: &str, max: usize) -> usize {
    if text.len() <= max {
        return text.len();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let bytes = text.as_bytes();
    match bytes[max / 2..end]
        .iter()
        .rposition(|b| b.is_ascii_whitespace())
    {
        Some(i) => max / 2 + i + 1,
        None => end,
    }
}

/// Finds special-token texts in a string, leftmost first and the longest at a position (the
/// rule of HF's added-vocabulary split).
struct SpecialMatcher {
    /// [256] per first byte: (text, id), longest text first.
    by_first: Vec<Vec<(String, u32)>>,
}

impl SpecialMatcher {
    fn new(tokens: Vec<(String, u32)>) -> SpecialMatcher {
        let mut by_first = vec![Vec::new(); 256];
        for (text, id) in tokens {
            by_first[text.as_bytes()[0] as usize].push((text, id));
        }
        for list in &mut by_first {
            list.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        }
        SpecialMatcher { by_first }
    }

    /// (byte offset, byte length, id) of the first special token in `text`.
    fn find(&self, text: &str) -> Option<(usize, usize, u32)> {
        let bytes = text.as_bytes();
        for (i, &b) in bytes.iter().enumerate() {
            for (tok, id) in &self.by_first[b as usize] {
                if bytes[i..].starts_with(tok.as_bytes()) {
                    return Some((i, tok.len(), *id));
                }
            }
        }
        None
    }
}

/// GPT-2's byte-level alphabet: each byte is shown as a printable character. Bytes that are
/// printable already (`!`..`~`, `¡`..`¬`, `®`..`ÿ`) stand for themselves; the other 68 take
/// the characters from U+0100 on, in byte order.
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let cp = c as u32;
    if cp < 256 {
        return printable(cp).then_some(cp as u8);
    }
    let n = cp - 256;
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

/// The bytes a byte-level vocabulary string stands for; a string with characters outside the
/// alphabet (it should have none) keeps its own UTF-8 for them.
fn byte_level_bytes(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match byte_level_lookup(c) {
            Some(b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out
}

/// The bytes of a SentencePiece-style vocabulary string (`▁` for a space, `<0x0A>` for a raw
/// byte), for tokenizer.json files that are not byte-level. The space SentencePiece puts in
/// front of the first word is kept.
fn sentencepiece_bytes(text: &str) -> Vec<u8> {
    let hex = text
        .strip_prefix("<0x")
        .and_then(|t| t.strip_suffix('>'))
        .filter(|h| h.len() == 2);
    if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
        return vec![b];
    }
    text.replace('\u{2581}', " ").into_bytes()
}

/// Table form of [`byte_of_char`] for the 324 characters of the alphabet.
fn byte_level_lookup(c: char) -> Option<u8> {
    static TABLE: std::sync::OnceLock<Vec<Option<u8>>> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        (0u32..324)
            .map(|cp| char::from_u32(cp).and_then(byte_of_char))
            .collect()
    });
    table.get(c as usize).copied().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_is_a_bijection() {
        let mut seen = [false; 256];
        for cp in 0u32..324 {
            if let Some(b) = byte_level_lookup(char::from_u32(cp).unwrap()) {
                assert!(!seen[b as usize], "byte {b} twice");
                seen[b as usize] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(byte_level_lookup('Ġ'), Some(b' '));
        assert_eq!(byte_level_lookup('Ċ'), Some(b'\n'));
        assert_eq!(byte_level_lookup('a'), Some(b'a'));
    }

    #[test]
    fn sentencepiece_pieces() {
        assert_eq!(sentencepiece_bytes("\u{2581}Hello"), b" Hello");
        assert_eq!(sentencepiece_bytes("<0x0A>"), b"\n");
        assert_eq!(sentencepiece_bytes("<0x0A"), b"<0x0A");
    }

    #[test]
    fn special_matcher_prefers_longest_leftmost() {
        let m = SpecialMatcher::new(vec![
            ("<a>".into(), 1),
            ("<a><b>".into(), 2),
            ("<b>".into(), 3),
        ]);
        assert_eq!(m.find("x<b><a><b>"), Some((1, 3, 3)));
        assert_eq!(m.find("xx<a><b>"), Some((2, 6, 2)));
        assert_eq!(m.find("plain"), None);
    }
}
