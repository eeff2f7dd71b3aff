//! Loading a Hugging Face tokenizer folder: `tokenizer.json` (the `tokenizers` format) and the
//! transformers side files that say which tokens are BOS/EOS and which chat template to use.

use std::path::Path;

use serde_json::Value;
use tokenizers::DecoderWrapper;

use super::Parts;
use crate::error::{Error, Result};

pub(super) fn load(path: &Path) -> Result<Parts> {
    let mut bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    // A gzip'd tokenizer.json (`.json.gz`): lathe ships its demo vocabulary compressed.
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&bytes[..]), &mut out)
            .map_err(|e| Error::format(path, format!("bad gzip data: {e}")))?;
        bytes = out;
    }
    check_merges(&bytes).map_err(|w| Error::format(path, w))?;
    // `tokenizers` panics on some malformed files rather than failing: a bad file is the
    // user's error, not a bug of ours.
    let parsed = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(&bytes))
        .map_err(|p| Error::format(path, format!("not a tokenizer.json: {}", panic_text(&p))))?;
    let inner = parsed.map_err(|e| Error::format(path, format!("not a tokenizer.json: {e}")))?;
    let byte_level = match inner.get_decoder() {
        Some(DecoderWrapper::ByteLevel(_)) => true,
        Some(DecoderWrapper::Sequence(seq)) => seq
            .get_decoders()
            .iter()
            .any(|d| matches!(d, DecoderWrapper::ByteLevel(_))),
        _ => false,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let config_path = dir.join("tokenizer_config.json");
    let config = read_json_if_present(&config_path)?;
    let token_id = |key: &str| -> Result<Option<u32>> {
        let Some(entry) = config.as_ref().and_then(|c| c.get(key)) else {
            return Ok(None);
        };
        // A token is written either as its text or as an AddedToken object with `content`.
        let text = match entry {
            Value::Null => return Ok(None),
            Value::String(s) => s.as_str(),
            Value::Object(o) => match o.get("content").and_then(Value::as_str) {
                Some(s) => s,
                None => return Err(Error::config(&config_path, key, "object without `content`")),
            },
            _ => {
                return Err(Error::config(
                    &config_path,
                    key,
                    "expected a string or an object",
                ))
            }
        };
        inner.token_to_id(text).map(Some).ok_or_else(|| {
            Error::config(
                &config_path,
                key,
                format!("`{text}` is not in the vocabulary"),
            )
        })
    };
    let bos = token_id("bos_token")?;
    let eos = token_id("eos_token")?;
    let pad = token_id("pad_token")?;
    let add_bos = config
        .as_ref()
        .and_then(|c| c.get("add_bos_token"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let mut chat_template = match config.as_ref().and_then(|c| c.get("chat_template")) {
        Some(t) => template_from_config(t, &config_path)?,
        None => None,
    };
    // transformers 4.43+ may keep the template in its own file instead.
    let jinja_path = dir.join("chat_template.jinja");
    if chat_template.is_none() && jinja_path.is_file() {
        chat_template =
            Some(std::fs::read_to_string(&jinja_path).map_err(|e| Error::io(&jinja_path, e))?);
    }
    let gen_path = dir.join("generation_config.json");
    let extra_eog = match read_json_if_present(&gen_path)? {
        Some(g) => match g.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().map(|n| n as u32).into_iter().collect(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(Value::as_u64)
                .map(|n| n as u32)
                .collect(),
            _ => Vec::new(),
        },
        None => Vec::new(),
    };
    Ok(Parts {
        inner,
        byte_level,
        bos,
        eos,
        eot: None,
        pad,
        add_bos,
        chat_template,
        extra_eog,
        source: path.to_path_buf(),
    })
}

fn read_json_if_present(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::format(path, format!("invalid JSON: {e}")))
}

/// `chat_template` is a string, or a list of `{name, template}` of which `default` is the one
/// transformers uses when none is asked for.
fn template_from_config(t: &Value, path: &Path) -> Result<Option<String>> {
    match t {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Array(list) => {
            let named = |want: &str| {
                list.iter().find_map(|e| {
                    (e.get("name")?.as_str()? == want)
                        .then(|| e.get("template")?.as_str().map(String::from))
                        .flatten()
                })
            };
            Ok(named("default"))
        }
        _ => Err(Error::config(
            path,
            "chat_template",
            "expected a string or a list",
        )),
    }
}

/// The message of a caught panic.
fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "the tokenizers library panicked".into())
}

/// A BPE model with a `continuing_subword_prefix` must start the second part of every merge
/// with it: `tokenizers` cuts the prefix off by byte count and panics when it is not there.
fn check_merges(bytes: &[u8]) -> std::result::Result<(), String> {
    #[derive(serde::Deserialize)]
    struct File {
        model: Option<Model>,
    }
    #[derive(serde::Deserialize)]
    struct Model {
        continuing_subword_prefix: Option<String>,
        merges: Option<Value>,
    }
    // Not JSON or another shape: `tokenizers` says what is wrong.
    let Ok(File { model: Some(m) }) = serde_json::from_slice::<File>(bytes) else {
        return Ok(());
    };
    let (Some(prefix), Some(Value::Array(merges))) = (m.continuing_subword_prefix, m.merges) else {
        return Ok(());
    };
    for (i, merge) in merges.iter().enumerate() {
        let second = match merge {
            Value::String(s) => s.split_once(' ').map(|(_, b)| b),
            Value::Array(pair) => pair.get(1).and_then(Value::as_str),
            _ => None,
        };
        if let Some(b) = second.filter(|b| !b.starts_with(prefix.as_str())) {
            return Err(format!(
                "merge #{i}: `{}` does not start with the continuing_subword_prefix `{}`",
                crate::error::shown(b),
                crate::error::shown(&prefix)
            ));
        }
    }
    Ok(())
}
