//! A tokenizer for a synthetic model: the `tokenizer.ggml.*` keys llama.cpp's converter
//! writes for a byte-level BPE vocabulary (`model = gpt2`, the pre-tokenizer's name, tokens,
//! token types, merges, special ids), read from a Hugging Face `tokenizer.json` (plain or
//! gzip'd) or copied from another GGUF file.

use crate::gguf::{keys, GgufFile, Value};
use crate::{Error, Result};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};

/// llama.cpp's `llama_token_type` values.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

/// A vocabulary ready to be written into a GGUF file.
#[derive(Clone, Debug)]
pub struct Vocab {
    /// `tokenizer.ggml.pre`: `qwen35` for Qwen's vocabulary, `deepseek-v3` for DeepSeek's.
    pub pre: String,
    /// [n] byte-level token strings, by id.
    pub tokens: Vec<String>,
    /// [n] llama.cpp token types.
    pub types: Vec<i32>,
    /// BPE merges, highest priority first, each `left right`.
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
    /// Other `tokenizer.*` keys copied from a GGUF source, written after the standard ones.
    pub extra: Vec<(String, Value)>,
    /// Where it came from, for messages.
    pub source: PathBuf,
}

/// Texts of the special tokens that tell the vocabularies apart, and their ids' roles.
const QWEN_MARK: &str = "<|im_start|>";
const DEEPSEEK_BOS: &str = "<｜begin▁of▁sentence｜>";
const DEEPSEEK_EOS: &str = "<｜end▁of▁sentence｜>";

impl Vocab {
    /// Number of ids.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Loads `path`: a GGUF file (its `tokenizer.*` keys) or a `tokenizer.json` (`.gz` too).
    pub fn load(path: &Path) -> Result<Vocab> {
        let mut head = [0u8; 4];
        {
            use std::io::Read;
            let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
            let n = f.read(&mut head).map_err(|e| Error::io(path, e))?;
            if n < 4 {
                return Err(Error::format(path, "too short for a tokenizer"));
            }
        }
        if &head == b"GGUF" {
            from_gguf(path)
        } else {
            from_tokenizer_json(path)
        }
    }

    /// The `tokenizer.*` keys for a model of `n_vocab` ids (≥ the vocabulary's own size;
    /// missing ids get llama.cpp's `[PAD<id>]` tokens of type unused, as its converter pads
    /// a vocabulary to the embedding rows).
    pub fn keys(&self, n_vocab: usize) -> Result<Vec<(String, Value)>> {
        if n_vocab < self.tokens.len() {
            return Err(Error::Invalid(format!(
                "{}: {} tokens do not fit a vocabulary of {n_vocab}",
                self.source.display(),
                self.tokens.len()
            )));
        }
        let mut tokens: Vec<Value> = self.tokens.iter().map(|s| s.as_str().into()).collect();
        let mut types: Vec<Value> = self.types.iter().map(|&t| Value::I32(t)).collect();
        for i in self.tokens.len()..n_vocab {
            tokens.push(format!("[PAD{i}]").into());
            types.push(Value::I32(UNUSED));
        }
        let mut out: Vec<(String, Value)> = vec![
            (keys::TOKENIZER_MODEL.into(), "gpt2".into()),
            (keys::TOKENIZER_PRE.into(), self.pre.as_str().into()),
            (keys::TOKENIZER_TOKENS.into(), Value::Array(tokens)),
            (keys::TOKENIZER_TOKEN_TYPE.into(), Value::Array(types)),
            (
                keys::TOKENIZER_MERGES.into(),
                Value::Array(self.merges.iter().map(|s| s.as_str().into()).collect()),
            ),
        ];
        for (key, id) in [
            (keys::TOKENIZER_BOS_ID, self.bos),
            (keys::TOKENIZER_EOS_ID, self.eos),
            (keys::TOKENIZER_EOT_ID, self.eot),
            (keys::TOKENIZER_PAD_ID, self.pad),
        ] {
            if let Some(id) = id {
                out.push((key.into(), Value::U32(id)));
            }
        }
        out.push((keys::TOKENIZER_ADD_BOS.into(), self.add_bos.into()));
        out.extend(self.extra.iter().cloned());
        if let Some(t) = &self.chat_template {
            out.push((keys::TOKENIZER_CHAT_TEMPLATE.into(), t.as_str().into()));
        }
        Ok(out)
    }

    /// The built-in chat template that speaks this vocabulary's special tokens, for a
    /// tokenizer that carries none: DeepSeek-V4's for DeepSeek's vocabulary (ChatML's
    /// `<|im_start|>` is no token there: it would be 7 ids of plain text), ChatML otherwise.
    pub fn builtin_template(&self) -> &'static crate::tokenizer::Builtin {
        let name = match self.pre.as_str() {
            "deepseek-v3" => "deepseek-v4",
            _ => "chatml",
        };
        crate::tokenizer::builtin_template(name).expect("a built-in template's name")
    }

    fn id_of(&self, text: &str) -> Option<u32> {
        self.tokens.iter().position(|t| t == text).map(|i| i as u32)
    }
}

fn read_maybe_gz(path: &Path) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    if !bytes.starts_with(&[0x1f, 0x8b]) {
        return Ok(bytes);
    }
    let mut out = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&bytes[..]), &mut out)
        .map_err(|e| Error::format(path, format!("bad gzip data: {e}")))?;
    Ok(out)
}

fn from_tokenizer_json(path: &Path) -> Result<Vocab> {
    let bytes = read_maybe_gz(path)?;
    let j: Json = serde_json::from_slice(&bytes)
        .map_err(|e| Error::format(path, format!("not a tokenizer.json: {e}")))?;
    let bad = |what: &str| Error::format(path, what.to_string());
    let model = j.get("model").ok_or_else(|| bad("no `model`"))?;
    if model.get("type").and_then(Json::as_str) != Some("BPE") {
        return Err(Error::Unsupported(format!(
            "{}: synth writes byte-level BPE vocabularies; this model is {}",
            path.display(),
            model
                .get("type")
                .map_or("untyped".into(), |t| t.to_string())
        )));
    }
    let vocab = model
        .get("vocab")
        .and_then(Json::as_object)
        .ok_or_else(|| bad("`model.vocab` is not an object"))?;
    let mut by_id: Vec<Option<(String, i32)>> = Vec::new();
    let mut put = |id: u64, text: &str, ty: i32| -> Result<()> {
        let id = usize::try_from(id)
            .ok()
            .filter(|&i| i < 16 << 20)
            .ok_or_else(|| bad(&format!("token id {id} is out of range")))?;
        if by_id.len() <= id {
            by_id.resize(id + 1, None);
        }
        by_id[id] = Some((text.to_string(), ty));
        Ok(())
    };
    for (text, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(&format!("token `{text}` has no integer id")))?;
        put(id, text, NORMAL)?;
    }
    if let Some(added) = j.get("added_tokens").and_then(Json::as_array) {
        for a in added {
            let (Some(id), Some(text)) = (
                a.get("id").and_then(Json::as_u64),
                a.get("content").and_then(Json::as_str),
            ) else {
                return Err(bad("an added token without `id` or `content`"));
            };
            let special = a.get("special").and_then(Json::as_bool).unwrap_or(false);
            put(id, text, if special { CONTROL } else { USER_DEFINED })?;
        }
    }
    let (tokens, types): (Vec<String>, Vec<i32>) = by_id
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.unwrap_or_else(|| (format!("[PAD{i}]"), UNUSED)))
        .unzip();
    // Merges are "a b" strings in older files, ["a", "b"] pairs in newer ones.
    let merges = model
        .get("merges")
        .and_then(Json::as_array)
        .ok_or_else(|| bad("`model.merges` is not an array"))?
        .iter()
        .map(|m| match m {
            Json::String(s) => Ok(s.clone()),
            Json::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                (Some(a), Some(b)) => Ok(format!("{a} {b}")),
                _ => Err(bad("a merge pair that is not two strings")),
            },
            _ => Err(bad("a merge that is neither a string nor a pair")),
        })
        .collect::<Result<Vec<_>>>()?;

    // Special ids and the template from the tokenizer's own side files, when present.
    let tk = crate::tokenizer::Tokenizer::from_file(path)?;
    let mut v = Vocab {
        pre: String::new(),
        tokens,
        types,
        merges,
        bos: tk.bos_id(),
        eos: tk.eos_id(),
        eot: tk.eot_id(),
        pad: tk.pad_id(),
        add_bos: tk.add_bos(),
        chat_template: tk.chat_template().map(str::to_string),
        extra: Vec::new(),
        source: path.to_path_buf(),
    };
    if v.id_of(QWEN_MARK).is_some() {
        v.pre = "qwen35".into();
        // Qwen's GGUFs: EOS <|im_end|>, padding <|endoftext|>, no BOS added.
        v.eos = v.eos.or_else(|| v.id_of("<|im_end|>"));
        v.pad = v.pad.or_else(|| v.id_of("<|endoftext|>"));
        v.bos = v.bos.or_else(|| v.id_of("<|endoftext|>"));
    } else if v.id_of(DEEPSEEK_BOS).is_some() {
        v.pre = "deepseek-v3".into();
        v.bos = v.bos.or_else(|| v.id_of(DEEPSEEK_BOS));
        v.eos = v.eos.or_else(|| v.id_of(DEEPSEEK_EOS));
        v.pad = v.pad.or_else(|| v.id_of(DEEPSEEK_EOS));
    } else {
        // GPT-2's split: right for GPT-2-style vocabularies, a fallback for the rest.
        v.pre = "default".into();
    }
    Ok(v)
}

fn from_gguf(path: &Path) -> Result<Vocab> {
    let g = GgufFile::open(path)?;
    let mut v = Vocab {
        pre: "default".into(),
        tokens: Vec::new(),
        types: Vec::new(),
        merges: Vec::new(),
        bos: None,
        eos: None,
        eot: None,
        pad: None,
        add_bos: false,
        chat_template: None,
        extra: Vec::new(),
        source: path.to_path_buf(),
    };
    match g.opt_str(keys::TOKENIZER_MODEL)? {
        Some("gpt2") => {}
        other => {
            return Err(Error::config(
                path,
                keys::TOKENIZER_MODEL,
                format!(
                    "is {}; synth copies byte-level BPE (gpt2) vocabularies",
                    other.unwrap_or("absent")
                ),
            ))
        }
    }
    let id = |key: &str| -> Result<Option<u32>> {
        Ok(g.opt_u64(key)
            .ok()
            .flatten()
            .and_then(|n| u32::try_from(n).ok()))
    };
    for (k, val) in g.metadata() {
        if !k.starts_with("tokenizer.") {
            continue;
        }
        match k.as_str() {
            keys::TOKENIZER_MODEL => {}
            keys::TOKENIZER_PRE => v.pre = g.get_str(k)?.to_string(),
            keys::TOKENIZER_TOKENS => {
                v.tokens = g.get_str_array(k)?.into_iter().map(String::from).collect()
            }
            keys::TOKENIZER_TOKEN_TYPE => {
                v.types = g.get_i64_array(k)?.into_iter().map(|t| t as i32).collect()
            }
            keys::TOKENIZER_MERGES => {
                v.merges = g.get_str_array(k)?.into_iter().map(String::from).collect()
            }
            keys::TOKENIZER_BOS_ID => v.bos = id(k)?,
            keys::TOKENIZER_EOS_ID => v.eos = id(k)?,
            keys::TOKENIZER_EOT_ID => v.eot = id(k)?,
            keys::TOKENIZER_PAD_ID => v.pad = id(k)?,
            keys::TOKENIZER_ADD_BOS => v.add_bos = g.get_bool(k)?,
            keys::TOKENIZER_CHAT_TEMPLATE => v.chat_template = Some(g.get_str(k)?.to_string()),
            // Scores would need padding too; byte-level BPE does not use them.
            keys::TOKENIZER_SCORES => {}
            _ => v.extra.push((k.clone(), val.clone())),
        }
    }
    if v.types.is_empty() {
        v.types = vec![NORMAL; v.tokens.len()];
    }
    if v.types.len() != v.tokens.len() {
        return Err(Error::config(
            path,
            keys::TOKENIZER_TOKEN_TYPE,
            format!("{} entries for {} tokens", v.types.len(), v.tokens.len()),
        ));
    }
    if v.tokens.is_empty() {
        return Err(Error::config(
            path,
            keys::TOKENIZER_TOKENS,
            "missing or empty",
        ));
    }
    Ok(v)
}
