//! `lathe tokenize` and `lathe template`: the text front end alone, without a model on the GPU.

use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};

use clap::Args;
use lathe::gguf::GgufFile;
use lathe::tokenizer::{builtin_template, ChatTemplate, TemplateChoice, Tokenizer};
use lathe::{Error, Result};
use serde_json::{Map, Value};

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Where the vocabulary is: a GGUF file (a vocab-only GGUF of any architecture works; no
    /// weights are loaded), a Hugging Face directory with tokenizer.json, or a tokenizer.json
    /// (.json.gz too), or a Hub model `owner/repo[:QUANT]` (downloaded into the Hugging Face
    /// cache).
    #[arg(short, long, value_name = "PATH")]
    pub model: PathBuf,
    /// The text to tokenize; prints one JSON array of ids.
    #[arg(
        long,
        value_name = "TEXT",
        required_unless_present = "file",
        conflicts_with = "file"
    )]
    pub text: Option<String>,
    /// A file with one JSON string per line; prints one JSON array of ids per line.
    #[arg(long, value_name = "F")]
    pub file: Option<PathBuf>,
    /// Put BOS in front when the vocabulary asks for it (tokenizer_config `add_bos_token`,
    /// GGUF `tokenizer.ggml.add_bos_token`); without it no BOS/EOS is added.
    #[arg(long)]
    pub add_special: bool,
    /// Tokenize special-token text (`<|im_start|>`) as plain text instead of as the token.
    #[arg(long)]
    pub no_parse_special: bool,
}

/// `--chat-template NAME|FILE` and `--chat-template-file FILE`, as llama-server has them;
/// shared by every command that renders a chat.
#[derive(Args, Debug, Clone, Default)]
pub struct ChatTemplateArgs {
    /// Chat template to use instead of the model's: a built-in name (chatml, deepseek-v4,
    /// llama3, smollm2) or a Jinja file.
    #[arg(long, value_name = "NAME|FILE", conflicts_with = "chat_template_file")]
    pub chat_template: Option<String>,
    /// A Jinja chat template file to use instead of the model's.
    #[arg(long, value_name = "FILE")]
    pub chat_template_file: Option<PathBuf>,
}

impl ChatTemplateArgs {
    /// The template the flags chose, read (and compiled once, so a bad one fails before the
    /// model loads), or `None` for the model's own.
    pub fn choice(&self) -> Result<Option<TemplateChoice>> {
        match (&self.chat_template, &self.chat_template_file) {
            (Some(v), _) => TemplateChoice::name_or_file("--chat-template", v).map(Some),
            (None, Some(p)) => TemplateChoice::file("--chat-template-file", p).map(Some),
            (None, None) => Ok(None),
        }
    }
}

#[derive(Args, Debug)]
pub struct TemplateArgs {
    /// A built-in template's name (chatml, deepseek-v4, llama3, smollm2), a Jinja chat
    /// template, or a GGUF file or tokenizer_config.json that carries one.
    #[arg(short, long, visible_alias = "chat-template", value_name = "NAME|FILE")]
    pub template: PathBuf,
    /// A JSON list of messages (`[{"role": "user", "content": "Hi"}]`), or an object with
    /// `messages` and any other variables the template reads (`tools`, `enable_thinking`).
    #[arg(long, value_name = "MESSAGES.json")]
    pub messages: PathBuf,
    /// End the rendering where the assistant's reply begins.
    #[arg(long)]
    pub add_generation_prompt: bool,
    /// Text of `bos_token` in the template (empty by default).
    #[arg(long, value_name = "T")]
    pub bos_token: Option<String>,
    /// Text of `eos_token` in the template (empty by default).
    #[arg(long, value_name = "T")]
    pub eos_token: Option<String>,
}

/// Loads only the tokenizer of `path` (see [`TokenizeArgs::model`]).
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    if !path.exists() {
        return Err(Error::Invalid(format!(
            "{}: no such file or directory; pass --model a GGUF file, a Hugging Face directory or a tokenizer.json",
            path.display()
        )));
    }
    if path.is_dir() {
        let json = path.join("tokenizer.json");
        if !json.is_file() {
            return Err(Error::Invalid(format!(
                "{}: no tokenizer.json in this directory; pass the model's GGUF file or its tokenizer.json",
                path.display()
            )));
        }
        return Tokenizer::from_hf_dir(path);
    }
    if has_gguf_magic(path)? {
        let file = GgufFile::open(path)?;
        return Tokenizer::from_gguf(&file);
    }
    let named_gguf = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if named_gguf {
        return Err(Error::Invalid(format!(
            "{}: not a GGUF file (it does not start with the magic `GGUF`: truncated, or \
             another format renamed); pass a GGUF model, a Hugging Face directory or a tokenizer.json",
            path.display()
        )));
    }
    Tokenizer::from_file(path)
}

fn has_gguf_magic(path: &Path) -> Result<bool> {
    let mut magic = [0u8; 4];
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    Ok(std::io::Read::read_exact(&mut f, &mut magic).is_ok() && &magic == b"GGUF")
}

/// Longest line `tokenize --file` reads.
const MAX_LINE: usize = 64 << 20;

pub fn tokenize(args: TokenizeArgs) -> Result<()> {
    let tok = load_tokenizer(&args.model)?;
    let parse_special = !args.no_parse_special;
    let encode = |text: &str| -> Result<String> {
        let ids = if args.add_special {
            tok.encode_with_bos(text, parse_special)?
        } else {
            tok.encode(text, parse_special)?
        };
        serde_json::to_string(&ids).map_err(|e| Error::Invalid(format!("ids to JSON: {e}")))
    };
    let stdout = std::io::stdout();
    let mut w = std::io::BufWriter::new(stdout.lock());
    let write_err = |e: std::io::Error| Error::Invalid(format!("writing to stdout: {e}"));
    match (&args.text, &args.file) {
        (Some(text), _) => writeln!(w, "{}", encode(text)?).map_err(write_err)?,
        (None, Some(file)) => {
            let f = std::fs::File::open(file).map_err(|e| Error::io(file, e))?;
            let mut r = std::io::BufReader::new(f);
            let mut raw = Vec::new();
            for i in 0.. {
                raw.clear();
                // A line at most MAX_LINE bytes: `/dev/zero` (or a file with no newline)
                // would otherwise be read until memory runs out.
                let n = (&mut r)
                    .take(MAX_LINE as u64 + 1)
                    .read_until(b'\n', &mut raw)
                    .map_err(|e| Error::io(file, e))?;
                if n == 0 {
                    break;
                }
                if raw.len() > MAX_LINE {
                    return Err(Error::format(
                        file,
                        format!(
                            "line {}: longer than {MAX_LINE} bytes (one JSON string per line)",
                            i + 1
                        ),
                    ));
                }
                let line = std::str::from_utf8(&raw)
                    .map_err(|e| Error::format(file, format!("line {}: not UTF-8 ({e})", i + 1)))?;
                let text: String = serde_json::from_str(line).map_err(|e| {
                    Error::format(
                        file,
                        format!("line {}: not a JSON string ({e}); write one JSON string per line, e.g. \"Hello\\n\"", i + 1),
                    )
                })?;
                writeln!(w, "{}", encode(&text)?).map_err(write_err)?;
            }
        }
        (None, None) => {
            return Err(Error::Invalid("pass --text TEXT or --file F".into()));
        }
    }
    w.flush().map_err(write_err)
}

/// The template source in `path`: a Jinja file, or the `tokenizer.chat_template` of a GGUF,
/// or the `chat_template` of a tokenizer_config.json.
fn read_template(path: &Path) -> Result<String> {
    if !path.is_file() {
        return Err(Error::Invalid(format!(
            "{}: no such file; pass --template a built-in name ({}), a .jinja file, a GGUF or a tokenizer_config.json",
            path.display(),
            lathe::tokenizer::builtin_names()
        )));
    }
    if has_gguf_magic(path)? {
        let file = GgufFile::open(path)?;
        return match file.opt_str("tokenizer.chat_template")? {
            Some(s) => Ok(s.to_string()),
            None => Err(Error::config(
                path,
                "tokenizer.chat_template",
                "this GGUF carries no chat template",
            )),
        };
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    if path.extension().is_some_and(|e| e == "json") {
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Error::format(path, format!("not JSON: {e}")))?;
        return match v.get("chat_template") {
            Some(Value::String(s)) => Ok(s.clone()),
            // The list form names templates; the one called "default" is the chat template.
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Value::as_str))
                .map(str::to_string)
                .ok_or_else(|| Error::config(path, "chat_template", "no template named `default`")),
            _ => Err(Error::config(
                path,
                "chat_template",
                "missing; pass a .jinja file instead",
            )),
        };
    }
    Ok(text)
}

pub fn template(args: TemplateArgs) -> Result<()> {
    let tmpl = match args.template.to_str().and_then(builtin_template) {
        Some(b) => ChatTemplate::new(b.source)?,
        None => {
            let source = read_template(&args.template)?;
            ChatTemplate::new(&source)
                .map_err(|e| Error::Invalid(format!("{}: {e}", args.template.display())))?
        }
    };
    let path = &args.messages;
    if !path.is_file() {
        return Err(Error::Invalid(format!(
            "{}: no such file; pass --messages a JSON file with a list of {{\"role\", \"content\"}} messages",
            path.display()
        )));
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| Error::format(path, format!("not JSON: {e}")))?;
    let (messages, mut vars) = match v {
        Value::Array(_) => (v, Map::new()),
        Value::Object(mut o) => match o.remove("messages") {
            Some(m @ Value::Array(_)) => (m, o),
            _ => {
                return Err(Error::format(path, "an object needs a `messages` list"));
            }
        },
        _ => {
            return Err(Error::format(
                path,
                "expected a list of messages or an object with `messages`",
            ))
        }
    };
    for (name, value) in [
        ("bos_token", &args.bos_token),
        ("eos_token", &args.eos_token),
    ] {
        if let Some(t) = value {
            vars.insert(name.into(), t.clone().into());
        }
    }
    let rendered = tmpl
        .render(&messages, args.add_generation_prompt, &vars)
        .map_err(|e| Error::Invalid(format!("{}: {e}", args.template.display())))?;
    let mut w = std::io::stdout().lock();
    w.write_all(rendered.as_bytes())
        .and_then(|_| w.flush())
        .map_err(|e| Error::Invalid(format!("writing to stdout: {e}")))
}
