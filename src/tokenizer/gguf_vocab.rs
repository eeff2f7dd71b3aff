//! A tokenizer from a GGUF vocabulary (`tokenizer.ggml.*`), llama.cpp's convention: `model`
//! names the algorithm, `pre` the pre-tokenizer (the regexes that cut text into words before
//! BPE), `tokens`/`merges` are in GPT-2's byte-level form, `token_type` marks specials.

use std::path::PathBuf;

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::Parts;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// The `tokenizer.ggml.*` fields of a GGUF file.
#[derive(Clone, Debug, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: "gpt2" (byte-level BPE) or "none" (no vocabulary).
    pub model: String,
    /// `tokenizer.ggml.pre`: which pre-tokenizer ("qwen35", "deepseek-v3", ...).
    pub pre: Option<String>,
    /// [n_vocab] token strings, byte-level encoded (`Ġ` for a space).
    pub tokens: Vec<String>,
    /// [n_vocab] llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined,
    /// 5 unused, 6 byte.
    pub token_types: Option<Vec<i32>>,
    /// BPE merges, highest priority first, each "left right".
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
}

const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// GPT-2's split (also llama.cpp's "default").
const GPT2: &[&str] =
    &[r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"];
/// Qwen2 / Qwen3: single digits, a letter run may take one leading non-letter.
const QWEN2: &[&str] = &[
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];
/// Qwen3.5 / 3.6: as Qwen2, with combining marks (`\p{M}`) kept inside words.
const QWEN35: &[&str] = &[
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];
/// SmolLM (HF: `Digits(individual_digits)` then GPT-2's `ByteLevel` split; llama.cpp's
/// `smollm`): every digit alone, then GPT-2's words.
const SMOLLM: &[&str] = &[r"\p{N}", GPT2[0]];
/// Llama 3: as Qwen2 with digits in groups of up to three.
const LLAMA3: &[&str] = &[
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];
/// DeepSeek-V3 and V4 (one tokenizer): three splits in turn, digits in threes, then runs of
/// CJK ideographs and kana, then words and punctuation.
const DEEPSEEK3: &[&str] = &[
    r"\p{N}{1,3}",
    "[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

/// The regexes for a `tokenizer.ggml.pre` name, and whether a word found whole in the
/// vocabulary skips the merges (llama.cpp sets that for Llama 3 only).
fn pre_tokenizer(pre: Option<&str>) -> Result<(&'static [&'static str], bool)> {
    Ok(match pre.unwrap_or("default") {
        "default" | "gpt2" | "gpt-2" => (GPT2, false),
        "qwen2" | "deepseek-r1-qwen" => (QWEN2, false),
        "qwen35" => (QWEN35, false),
        "smollm" => (SMOLLM, false),
        "llama-bpe" | "llama3" => (LLAMA3, true),
        "deepseek-v3" | "deepseek-v4" => (DEEPSEEK3, false),
        other => {
            return Err(Error::Unsupported(format!(
                "pre-tokenizer `{other}` (tokenizer.ggml.pre); known: default, gpt2, qwen2, \
                 qwen35, smollm, llama-bpe, deepseek-v3, deepseek-v4"
            )))
        }
    })
}

impl GgufVocab {
    /// Reads the `tokenizer.ggml.*` keys (and `tokenizer.chat_template`). A file without
    /// `tokenizer.ggml.model` gets model "none".
    pub fn from_gguf(file: &GgufFile) -> Result<GgufVocab> {
        let path = file.path();
        let bad = |key: &str, want: &str| Error::config(path, key, format!("expected {want}"));
        let string = |key: &str| -> Result<Option<String>> {
            match file.get(key) {
                None => Ok(None),
                Some(v) => v
                    .as_str()
                    .map(|s| Some(s.to_string()))
                    .ok_or_else(|| bad(key, "a string")),
            }
        };
        let strings = |key: &str| -> Result<Vec<String>> {
            let Some(v) = file.get(key) else {
                return Ok(Vec::new());
            };
            let arr = v
                .as_array()
                .ok_or_else(|| bad(key, "an array of strings"))?;
            arr.iter()
                .map(|e| {
                    e.as_str()
                        .map(String::from)
                        .ok_or_else(|| bad(key, "an array of strings"))
                })
                .collect()
        };
        let id = |key: &str| -> Result<Option<u32>> {
            match file.get(key) {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(n) => u32::try_from(n)
                        .map(Some)
                        .map_err(|_| bad(key, "a token id")),
                    // Some converters write -1 for "none".
                    None if v.as_i64() == Some(-1) => Ok(None),
                    None => Err(bad(key, "a token id")),
                },
            }
        };
        let token_types = match file.get("tokenizer.ggml.token_type") {
            None => None,
            Some(v) => {
                let key = "tokenizer.ggml.token_type";
                let arr = v
                    .as_array()
                    .ok_or_else(|| bad(key, "an array of integers"))?;
                let types: Option<Vec<i32>> = arr
                    .iter()
                    .map(|e| e.as_i64().and_then(|n| i32::try_from(n).ok()))
                    .collect();
                Some(types.ok_or_else(|| bad(key, "an array of integers"))?)
            }
        };
        let pre = string("tokenizer.ggml.pre")?;
        let add_bos = match file.get("tokenizer.ggml.add_bos_token") {
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad("tokenizer.ggml.add_bos_token", "a bool"))?,
            // llama.cpp adds BOS by default for Llama 3's vocabulary only among the BPE ones.
            None => matches!(pre.as_deref(), Some("llama-bpe" | "llama3")),
        };
        Ok(GgufVocab {
            model: string("tokenizer.ggml.model")?.unwrap_or_else(|| "none".into()),
            pre,
            tokens: strings("tokenizer.ggml.tokens")?,
            token_types,
            merges: strings("tokenizer.ggml.merges")?,
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            eot: id("tokenizer.ggml.eot_token_id")?,
            pad: id("tokenizer.ggml.padding_token_id")?,
            add_bos,
            chat_template: string("tokenizer.chat_template")?,
        })
    }
}

impl super::Tokenizer {
    /// The tokenizer of a GGUF model file; errors name the file. A model converted without a
    /// vocabulary (`tokenizer.ggml.model = "none"`) gives "this model has no vocabulary; pass
    /// token ids".
    pub fn from_gguf(file: &GgufFile) -> Result<super::Tokenizer> {
        let v = GgufVocab::from_gguf(file)?;
        let mut parts = build(v).map_err(|e| match e {
            Error::Invalid(what) | Error::Unsupported(what) => {
                Error::config(file.path(), "tokenizer.ggml.model", what)
            }
            Error::Format { what, .. } => Error::format(file.path(), what),
            other => other,
        })?;
        parts.source = file.path().to_path_buf();
        super::Tokenizer::assemble(parts)
    }
}

pub(super) fn build(v: GgufVocab) -> Result<Parts> {
    let source = PathBuf::from("<gguf vocabulary>");
    match v.model.as_str() {
        "gpt2" => {}
        "none" | "" => {
            return Err(Error::Invalid(
                "this model has no vocabulary; pass token ids".into(),
            ))
        }
        other => {
            return Err(Error::Unsupported(format!(
            "tokenizer model `{other}` (tokenizer.ggml.model); lathe reads byte-level BPE (gpt2)"
        )))
        }
    }
    if let Some(types) = &v.token_types {
        if types.len() != v.tokens.len() {
            return Err(Error::format(
                &source,
                format!(
                    "tokenizer.ggml.token_type has {} entries for {} tokens",
                    types.len(),
                    v.tokens.len()
                ),
            ));
        }
    }
    let (regexes, ignore_merges) = pre_tokenizer(v.pre.as_deref())?;

    let mut vocab = tokenizers::models::bpe::Vocab::with_capacity(v.tokens.len());
    for (id, tok) in v.tokens.iter().enumerate() {
        if !tok.is_empty() {
            vocab.entry(tok.clone()).or_insert(id as u32);
        }
    }
    let mut merges = Vec::with_capacity(v.merges.len());
    for (i, m) in v.merges.iter().enumerate() {
        // The separator is the first space after the first character (a byte-level token has
        // no raw spaces, but a left part made of a space alone would start with one).
        let split = m
            .char_indices()
            .skip(1)
            .find(|&(_, c)| c == ' ')
            .map(|(at, _)| at);
        let Some(at) = split else {
            return Err(Error::format(
                &source,
                format!("tokenizer.ggml.merges[{i}] `{m}` is not two tokens separated by a space"),
            ));
        };
        merges.push((m[..at].to_string(), m[at + 1..].to_string()));
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| Error::format(&source, format!("tokenizer.ggml.merges: {e}")))?;

    let mut pre: Vec<PreTokenizerWrapper> = Vec::with_capacity(regexes.len() + 1);
    for r in regexes {
        let split = Split::new(
            SplitPattern::Regex(r.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| Error::Invalid(format!("pre-tokenizer regex `{r}`: {e}")))?;
        pre.push(split.into());
    }
    pre.push(ByteLevel::new(false, true, false).into());

    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(Sequence::new(pre)));
    inner.with_decoder(Some(ByteLevel::default()));

    // Control tokens are special: recognised in text only when asked. User-defined tokens are
    // always cut out of the text, as llama.cpp does (its tokenizer skips only control and
    // unknown tokens when special parsing is off).
    if let Some(types) = &v.token_types {
        let added = |kind: i32, special: bool| -> Vec<AddedToken> {
            v.tokens
                .iter()
                .zip(types)
                .filter(|(t, &ty)| ty == kind && !t.is_empty())
                .map(|(t, _)| AddedToken::from(t.clone(), special).normalized(false))
                .collect()
        };
        inner.add_special_tokens(&added(TOKEN_TYPE_CONTROL, true));
        inner.add_tokens(&added(TOKEN_TYPE_USER_DEFINED, false));
    }
    Ok(Parts {
        inner,
        byte_level: true,
        bos: v.bos,
        eos: v.eos,
        eot: v.eot,
        pad: v.pad,
        add_bos: v.add_bos,
        chat_template: v.chat_template,
        extra_eog: Vec::new(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_pre_tokenizer_compiles() {
        for name in [
            "default",
            "gpt2",
            "qwen2",
            "qwen35",
            "smollm",
            "llama-bpe",
            "deepseek-v3",
            "deepseek-v4",
        ] {
            let (regexes, _) = pre_tokenizer(Some(name)).unwrap();
            for r in regexes {
                Split::new(
                    SplitPattern::Regex(r.to_string()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            }
        }
        assert!(pre_tokenizer(Some("no-such-pre")).is_err());
    }

    #[test]
    fn no_vocabulary_says_so() {
        let v = GgufVocab {
            model: "none".into(),
            ..Default::default()
        };
        let err = super::super::Tokenizer::from_gguf_vocab(v).unwrap_err();
        assert!(
            err.to_string().contains("no vocabulary; pass token ids"),
            "{err}"
        );
    }
}
