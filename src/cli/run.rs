//! `lathe run`: one prompt in, the continuation streamed to stdout, speeds on stderr. Also
//! the pieces `lathe chat` shares: model and sampling flags, loading with a progress bar.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use lathe::engine::{Engine, LoadOptions};

use super::load::LoadArgs;
use lathe::generate::{ChatPrompt, GenerateOptions, Output, Session};
use lathe::sample::{FinishReason, SamplerConfig};
use lathe::{Error, Result};

/// Which model and where to run it.
#[derive(Args, Debug)]
pub struct ModelArgs {
    /// Model: a GGUF file (the first part of a split one), a Hugging Face checkpoint
    /// directory (config.json + *.safetensors + tokenizer.json), or a Hub model
    /// `owner/repo[:QUANT]` or `hf://owner/repo/file.gguf` (downloaded into the Hugging Face
    /// cache; an existing path wins).
    #[arg(short, long, value_name = "PATH")]
    pub model: PathBuf,
    /// Context length to size the KV cache for (it grows past this when needed; `-n -1`
    /// generates until it is full). `-c` and `--ctx-size` as in llama.cpp.
    #[arg(short = 'c', long, visible_alias = "ctx-size", value_name = "N",
          default_value_t = LoadOptions::default().ctx, value_parser = ctx_arg)]
    pub ctx: usize,
    #[command(flatten)]
    pub load: LoadArgs,
}

/// A context length: at least one token.
pub fn ctx_arg(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("`{s}`: a number of tokens, 1 or more")),
    }
}

/// `-n`: a number of tokens, or -1 for no limit but the context (llama.cpp's `-n -1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenLimit(pub Option<usize>);

impl std::str::FromStr for TokenLimit {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<TokenLimit, String> {
        match s.trim() {
            "-1" => Ok(TokenLimit(None)),
            t => t.parse().map(|n| TokenLimit(Some(n))).map_err(|_| {
                format!("`{s}`: a number of tokens (0 or more), or -1 for until the context ends")
            }),
        }
    }
}

impl std::fmt::Display for TokenLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self.0 {
            Some(n) => write!(f, "{n}"),
            None => f.write_str("-1"),
        }
    }
}

impl TokenLimit {
    /// The most tokens to generate after a prompt of `prompt` tokens in a context of `ctx`.
    pub fn tokens(self, ctx: usize, prompt: usize) -> usize {
        self.0.unwrap_or(ctx.saturating_sub(prompt))
    }
}

/// `--seed`: a number, or -1 for a fresh random one (the default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seed(pub Option<u64>);

impl std::str::FromStr for Seed {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Seed, String> {
        match s.trim() {
            "-1" => Ok(Seed(None)),
            t => t.parse().map(|n| Seed(Some(n))).map_err(|_| {
                format!(
                    "`{s}`: a seed from 0 to {}, or -1 for a random one",
                    u64::MAX
                )
            }),
        }
    }
}

impl std::fmt::Display for Seed {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self.0 {
            Some(n) => write!(f, "{n}"),
            None => f.write_str("-1"),
        }
    }
}

impl Seed {
    /// The seed, or a random one: std's `RandomState` keys come from the operating system's
    /// random source, fresh per process.
    pub fn get(self) -> u64 {
        use std::hash::{BuildHasher, Hasher};
        self.0.unwrap_or_else(|| {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            h.finish()
        })
    }
}

/// How the next token is chosen. Defaults are llama.cpp's; `--temp 0` is greedy.
#[derive(Args, Debug)]
pub struct SamplingArgs {
    /// Temperature: divides the logits; 0 = greedy (always the most likely token).
    #[arg(long, value_name = "T", default_value_t = SamplerConfig::default().temperature, allow_negative_numbers = true)]
    pub temp: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, value_name = "K", default_value_t = SamplerConfig::default().top_k)]
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities add up to P (1 = off).
    #[arg(long, value_name = "P", default_value_t = SamplerConfig::default().top_p, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than M times the most likely one (0 = off).
    #[arg(long, value_name = "M", default_value_t = SamplerConfig::default().min_p, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Divide the logit of every recently seen token by R (1 = off; 1.1 is a mild penalty).
    #[arg(long, value_name = "R", default_value_t = SamplerConfig::default().repeat_penalty, allow_negative_numbers = true)]
    pub repeat_penalty: f32,
    /// Subtract this once from the logit of every recently seen token (0 = off).
    #[arg(long, value_name = "X", default_value_t = SamplerConfig::default().presence_penalty, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtract this from a token's logit once per recent occurrence (0 = off).
    #[arg(long, value_name = "X", default_value_t = SamplerConfig::default().frequency_penalty, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// How many of the last tokens the three penalties look at.
    #[arg(long, value_name = "N", default_value_t = SamplerConfig::default().penalty_window)]
    pub penalty_window: usize,
    /// Random seed: the same seed, model and prompt give the same text; -1 (the default)
    /// picks a fresh one each run (--verbose prints it, to repeat a run).
    #[arg(long, value_name = "S", default_value_t = Seed(None), allow_negative_numbers = true)]
    pub seed: Seed,
    /// Print the sampling settings, the seed among them, on stderr.
    #[arg(short, long)]
    pub verbose: bool,
}

impl SamplingArgs {
    /// The settings, checked as the server checks a request's ([`SamplerConfig::check`]).
    pub fn config(&self) -> Result<SamplerConfig> {
        let c = SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            penalty_window: self.penalty_window,
            seed: self.seed.get(),
        };
        c.check().map_err(|e| {
            let flag = match e.field {
                "temperature" => "temp".to_string(),
                f => f.replace('_', "-"),
            };
            Error::Invalid(format!("--{flag} {}: must be {}", e.value, e.allowed))
        })?;
        if self.verbose {
            eprintln!(
                "sampling: --temp {} --top-k {} --top-p {} --min-p {} --repeat-penalty {} \
                 --presence-penalty {} --frequency-penalty {} --penalty-window {} --seed {}",
                c.temperature,
                c.top_k,
                c.top_p,
                c.min_p,
                c.repeat_penalty,
                c.presence_penalty,
                c.frequency_penalty,
                c.penalty_window,
                c.seed
            );
        }
        Ok(c)
    }
}

/// Speculative decoding: how the next tokens are drafted before the model checks them in
/// one pass (the output is what it would be without: greedy token for token, sampled at
/// the same seed alike).
#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// Drafts from: mtp (the model's multi-token prediction block), draft (--draft-model),
    /// off, or auto (mtp when the file has the block, else the draft model when given; in
    /// `serve` whenever it pays: the draft length, up to --draft, chosen per request from
    /// verify costs measured at warm-up and the acceptance measured so far).
    #[arg(long = "spec", value_name = "MODE", default_value = "auto")]
    pub mode: lathe::spec::SpecMode,
    /// Tokens drafted per verify pass.
    #[arg(long, value_name = "N", default_value_t = lathe::spec::DEFAULT_DRAFT)]
    pub draft: usize,
    /// A smaller model of the same vocabulary (Qwen3.5 family) that drafts greedily.
    #[arg(long, value_name = "FILE")]
    pub draft_model: Option<PathBuf>,
    /// MTP drafts pick among the first N tokens of the vocabulary only (a smaller draft
    /// head; the output is unchanged).
    #[arg(long, value_name = "N")]
    pub draft_vocab: Option<usize>,
}

impl SpecArgs {
    /// Most rows of one decode pass (one sequence): a verify pass's `--draft` + 1 when
    /// drafts are asked for (`--spec mtp` or `draft`, or a `--draft-model`); one for `off`
    /// and for `auto` without a draft model (most files carry no MTP block: `auto` then
    /// decodes plainly).
    pub fn decode_rows(&self) -> usize {
        use lathe::spec::SpecMode;
        match (self.mode, &self.draft_model) {
            (SpecMode::Mtp | SpecMode::Draft, _) | (SpecMode::Auto, Some(_)) => self.draft + 1,
            _ => 1,
        }
    }

    /// The options, with the draft model loaded (on the model's adapter) when one is given.
    pub fn options(&self, model: &ModelArgs) -> Result<lathe::spec::SpecOptions> {
        let draft_model = match &self.draft_model {
            Some(path) => {
                check_model_path(path)?;
                // The model's adapter and kernels; its own experts' placement.
                let load = model.load.load_options(self.decode_rows())?;
                let opts = LoadOptions {
                    adapter: load.adapter,
                    kv_type: load.kv_type,
                    ctx: model.ctx,
                    max_seqs: 1,
                    matmul: load.matmul,
                    activations: load.activations,
                    fused_loads: load.fused_loads,
                    ..Default::default()
                };
                let e = Engine::load(path, &opts).map_err(|e| explain_load_error(e, path))?;
                eprintln!("draft model {} loaded", path.display());
                Some(lathe::spec::DraftModel::new(e))
            }
            None => None,
        };
        Ok(lathe::spec::SpecOptions {
            mode: self.mode,
            draft: self.draft,
            accept_all: false,
            draft_model,
            draft_vocab: self.draft_vocab,
        })
    }
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text. Special tokens written in it (`<|im_start|>`) are parsed as such
    /// unless --no-parse-special. Without -p, -f or --prompt-tokens the prompt is read from
    /// stdin when it is not a terminal (`echo Hi | lathe run -m M`).
    #[arg(short, long, value_name = "TEXT", allow_hyphen_values = true)]
    pub prompt: Option<String>,
    /// Read the prompt from this file (`-` for stdin), as llama.cpp's -f.
    #[arg(short = 'f', long, value_name = "FILE", conflicts_with = "prompt")]
    pub file: Option<PathBuf>,
    /// Run from token ids instead of text (for models without a vocabulary, such as the test
    /// fixtures); the generated ids are printed, space separated.
    #[arg(long, value_name = "IDS", value_delimiter = ',', conflicts_with_all = ["prompt", "file", "chat", "system", "chat_template", "chat_template_file"])]
    pub prompt_tokens: Option<Vec<u32>>,
    /// Most tokens to generate (generation also ends at the model's end-of-turn token); -1:
    /// until the context (--ctx) is full.
    #[arg(
        short = 'n',
        long,
        value_name = "N",
        default_value_t = TokenLimit(Some(256)),
        visible_alias = "n-predict",
        allow_negative_numbers = true
    )]
    pub max_tokens: TokenLimit,
    /// Wrap the prompt in the model's chat template as a user message, ready for the
    /// assistant's reply (lathe's ChatML when the model has no template; --chat-template
    /// picks another and implies --chat).
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat (implies --chat).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    #[command(flatten)]
    pub template: super::text::ChatTemplateArgs,
    /// End generation before this text (repeatable; the text is not printed).
    #[arg(long, value_name = "STR", num_args = 1..)]
    pub stop: Vec<String>,
    /// Tokenize special-token text in the prompt as plain text (not with --chat, whose
    /// template needs its markers).
    #[arg(long, conflicts_with_all = ["chat", "system", "chat_template", "chat_template_file"])]
    pub no_parse_special: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// Loads the model with a progress bar on stderr (bytes uploaded), then one line saying what
/// was loaded where. State for one sequence, decoded as `spec` asks.
pub fn load_engine(args: &ModelArgs, spec: &SpecArgs) -> Result<Engine> {
    load_engine_seqs(args, 1, spec)
}

/// [`load_engine`] with state for `max_seqs` sequences (`lathe chat`: the conversation and
/// its checkpoint).
pub fn load_engine_seqs(args: &ModelArgs, max_seqs: usize, spec: &SpecArgs) -> Result<Engine> {
    check_architecture(&args.model)?;
    note_random_weights(&args.model);
    let opts = args.load.load_options(spec.decode_rows())?;
    // A spinner from the start (opening the file, the vocabulary and the device take a
    // while), then a bar of the weight bytes uploaded.
    let spinner = indicatif::ProgressStyle::with_template("{spinner} {msg}")
        .map_err(|e| Error::Invalid(format!("progress bar: {e}")))?;
    let bytes = indicatif::ProgressStyle::with_template(
        "{spinner} {msg} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec}",
    )
    .map_err(|e| Error::Invalid(format!("progress bar: {e}")))?
    .progress_chars("=> ");
    let bar = indicatif::ProgressBar::new(0).with_style(spinner.clone());
    // indicatif draws nothing when stderr is not a terminal (a log file, a service): there
    // each stage gets one line, so a slow start (shader compiles on a CPU adapter) is seen.
    let log = !std::io::stderr().is_terminal();
    // Ctrl-C while loading and compiling ends the process at once: there is no reply to
    // stop yet (the handler's idle mode).
    interrupt_flag()?;
    set_busy(false);
    if log {
        eprintln!("loading {}", args.model.display());
    }
    bar.set_message(format!("loading {}", args.model.display()));
    bar.enable_steady_tick(std::time::Duration::from_millis(100));
    let b = bar.clone();
    let opts = LoadOptions {
        ctx: args.ctx,
        progress: Some(Arc::new(move |done, total| {
            if b.length() != Some(total) {
                b.set_style(bytes.clone());
                b.set_length(total);
            }
            b.set_position(done);
        })),
        max_seqs,
        ..opts
    };
    let t = Instant::now();
    let engine = Engine::load(&args.model, &opts).map_err(|e| explain_load_error(e, &args.model));
    let mut engine = engine.inspect_err(|_| bar.finish_and_clear())?;
    let loaded = t.elapsed();
    bar.set_style(spinner);
    bar.set_message("warming up (compiling kernels)");
    if log {
        eprintln!("warming up (compiling kernels; a later run reuses them)");
    }
    let warm = warm_up(&mut engine, max_seqs);
    bar.finish_and_clear();
    warm?;
    set_busy(true);
    eprintln!(
        "loaded {} ({:.1} MiB of weights) in {:.1} s (+{:.1} s warm-up) on {} ({:?})",
        args.model.display(),
        engine.model_bytes as f64 / (1u64 << 20) as f64,
        loaded.as_secs_f64(),
        (t.elapsed() - loaded).as_secs_f64(),
        engine.gpu.info.name,
        engine.gpu.info.backend,
    );
    Ok(engine)
}

/// Compiles what `run` and `chat` run first: prompt passes up to the first many-token
/// product's size (a chat's first turn is dozens of tokens; without it `chat`'s first reply
/// on lavapipe waited minutes for compiles), decode steps, and with a checkpoint
/// (`max_seqs` 2) the copy between sequences. Then saves the pipeline cache, so the next run
/// starts from compiled pipelines even if this one is cut short.
fn warm_up(engine: &mut Engine, max_seqs: usize) -> Result<()> {
    let rows = lathe::gpu::matmul::DENSE_MATVEC_TOKENS as usize + 1;
    engine.warm_up(1, rows)?;
    if max_seqs > 1 {
        let a = engine.new_seq()?;
        let mut b = engine.new_seq()?;
        engine.copy_seq(&a, &mut b)?;
    }
    // A cache that cannot be written costs the next run its compiles, not this run.
    for gpu in std::iter::once(&engine.gpu).chain(&engine.gpus) {
        if let Err(e) = gpu.save_pipeline_cache() {
            eprintln!("note: pipeline cache not saved: {e}");
        }
    }
    Ok(())
}

/// A missing path, or a directory that holds no model, gets its own message before
/// anything opens it.
pub fn check_model_path(path: &Path) -> Result<()> {
    if !path.exists() {
        return Err(Error::Invalid(format!(
            "{}: no such file or directory; pass -m/--model a GGUF file or a Hugging Face checkpoint directory",
            path.display()
        )));
    }
    if path.is_dir() && !path.join("config.json").is_file() {
        return Err(Error::Invalid(format!(
            "{}: not a model directory (no config.json); pass -m/--model a GGUF file or a Hugging Face checkpoint directory",
            path.display()
        )));
    }
    Ok(())
}

/// Refuses a model file of an architecture no family runs, from its header or config.json
/// alone: before the GPU starts (seconds) and before questions it cannot answer (its
/// vocabulary).
pub fn check_architecture(path: &Path) -> Result<()> {
    check_model_path(path)?;
    if !path.is_dir() && !starts_with_gguf_magic(path) {
        // Let the loader say what is wrong with it.
        return Ok(());
    }
    let arch = if path.is_dir() {
        // config.json alone: the weights may be what is missing.
        let config = path.join("config.json");
        let text = std::fs::read_to_string(&config).map_err(|e| Error::io(&config, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::format(&config, format!("JSON: {e}")))?;
        match v["architectures"][0].as_str() {
            Some(a) => a.to_string(),
            // Let the loader say what is missing.
            None => return Ok(()),
        }
    } else {
        lathe::model_file::ModelFile::open(path)?.architecture()?
    };
    if lathe::models::is_supported(&arch) {
        return Ok(());
    }
    Err(Error::Unsupported(format!(
        "{}: architecture {arch}: no model family of lathe runs it (README.md, \"Supported models and formats\")",
        path.display()
    )))
}

/// Says on stderr that the model's weights are random when its file says so (`lathe synth`
/// writes GGUF `lathe.random_weights`): nothing in the text it generates would.
pub fn note_random_weights(path: &Path) {
    if path.is_dir() || !starts_with_gguf_magic(path) {
        return;
    }
    let random = lathe::gguf::GgufFile::open(path).ok().and_then(|g| {
        g.opt_bool(lathe::gguf::keys::LATHE_RANDOM_WEIGHTS)
            .ok()
            .flatten()
    });
    if random == Some(true) {
        eprintln!(
            "note: the weights of {} are random (a `lathe synth` model): whatever it generates is noise",
            path.display()
        );
    }
}

/// Adds what to do to the errors a user meets most while loading.
fn explain_load_error(e: Error, path: &Path) -> Error {
    match e {
        Error::Format { .. } if !path.is_dir() && !starts_with_gguf_magic(path) => Error::Invalid(format!(
            "{e}; pass -m/--model a .gguf model file or a Hugging Face checkpoint directory"
        )),
        Error::Gpu(msg) if msg.to_ascii_lowercase().contains("memory") => Error::Gpu(format!(
            "{msg}; the model or its cache does not fit on this device: try a smaller quantization, a smaller --ctx, or another --device"
        )),
        other => other,
    }
}

fn starts_with_gguf_magic(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// Whether Ctrl-C should interrupt work (true) or end the process at once (false: `lathe
/// chat` waiting for input).
static BUSY: AtomicBool = AtomicBool::new(true);

pub fn set_busy(busy: bool) {
    BUSY.store(busy, Ordering::SeqCst);
}

/// The Ctrl-C flag of this process: while busy, the first Ctrl-C sets it (the generation
/// stops after the current token) and a second one ends the process; while idle, Ctrl-C
/// ends the process.
pub fn interrupt_flag() -> Result<Arc<AtomicBool>> {
    static FLAG: std::sync::OnceLock<Arc<AtomicBool>> = std::sync::OnceLock::new();
    if let Some(f) = FLAG.get() {
        return Ok(f.clone());
    }
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    ctrlc::set_handler(move || {
        if !BUSY.load(Ordering::SeqCst) || f.swap(true, Ordering::SeqCst) {
            println!();
            std::process::exit(130);
        }
    })
    .map_err(|e| Error::Invalid(format!("cannot catch Ctrl-C: {e}")))?;
    Ok(FLAG.get_or_init(|| flag).clone())
}

/// The speeds line on stderr, after the generated text.
pub fn print_stats(out: &Output) {
    let why = match &out.finish {
        None => "interrupted".to_string(),
        Some(FinishReason::Eog(_)) => "end of turn".to_string(),
        Some(FinishReason::StopString(i)) => format!("stop string {}", i + 1),
        Some(FinishReason::Length) => "token limit".to_string(),
    };
    let spec = match &out.spec {
        Some(s) => format!(
            " | drafts accepted {:.1}% ({} of {}), {:.2} tokens per pass",
            100.0 * s.acceptance(),
            s.accepted,
            s.drafted,
            s.tokens_per_forward()
        ),
        None => String::new(),
    };
    eprintln!("[{}{spec} | {why}]", out.timings);
}

/// Whether the model file carries a vocabulary, found without loading the weights: GGUF
/// `tokenizer.ggml.model` other than `none`, or a tokenizer.json in a HF directory.
pub fn has_vocabulary(path: &Path) -> Result<bool> {
    check_architecture(path)?;
    if path.is_dir() {
        return Ok(path.join("tokenizer.json").is_file());
    }
    if !starts_with_gguf_magic(path) {
        // Let the loader say what is wrong with it.
        return Ok(true);
    }
    let g = lathe::gguf::GgufFile::open(path)?;
    Ok(!matches!(
        g.opt_str("tokenizer.ggml.model")?,
        None | Some("none")
    ))
}

/// The error for text commands on a model without a vocabulary.
pub fn no_vocabulary(path: &Path, hint: &str) -> Error {
    Error::Invalid(format!(
        "{} has no vocabulary (GGUF tokenizer.ggml.model = none, or no tokenizer.json): {hint}",
        path.display()
    ))
}

pub fn run(args: RunArgs) -> Result<()> {
    let sampler = args.sampling.config()?;
    // Before the model loads: a bad template fails at once.
    let template = args.template.choice()?;
    if args.prompt_tokens.is_none() && !has_vocabulary(&args.model.model)? {
        return Err(no_vocabulary(
            &args.model.model,
            "pass --prompt-tokens 1,2,3 to run it from token ids",
        ));
    }
    // Before the model loads: a missing prompt file fails at once.
    let text = match args.prompt_tokens {
        Some(_) => String::new(),
        None => prompt_text(&args)?,
    };
    let mut engine = load_engine(&args.model, &args.spec)?;
    let prompt: Vec<u32> = match (&args.prompt_tokens, engine.tokenizer.as_ref()) {
        (Some(ids), _) => ids.clone(),
        (None, None) => {
            return Err(no_vocabulary(
                &args.model.model,
                "pass --prompt-tokens 1,2,3 to run it from token ids",
            ))
        }
        (None, Some(tok)) => {
            if args.chat || args.system.is_some() || template.is_some() {
                let chat = ChatPrompt::chosen(tok, template.as_ref())?;
                if chat.fallback {
                    eprintln!("note: the model carries no chat template; using ChatML");
                }
                let mut messages = Vec::new();
                if let Some(s) = &args.system {
                    messages.push(serde_json::json!({"role": "system", "content": s}));
                }
                messages.push(serde_json::json!({"role": "user", "content": text}));
                let rendered = chat.render(&serde_json::Value::Array(messages), true)?;
                tok.encode_with_bos(&rendered, true)?
            } else {
                tok.encode_with_bos(&text, !args.no_parse_special)?
            }
        }
    };
    if prompt.is_empty() {
        return Err(Error::Invalid(
            "the prompt is empty and the model adds no BOS: pass a non-empty -p/--prompt".into(),
        ));
    }
    let ids_only = args.prompt_tokens.is_some();
    let cancel = interrupt_flag()?;
    let opts = GenerateOptions {
        max_tokens: Some(args.max_tokens.tokens(args.model.ctx, prompt.len())),
        sampler,
        stop: args.stop.clone(),
        ignore_eog: false,
        cancel: Some(cancel.clone()),
        spec: args.spec.options(&args.model)?,
    };
    let stdout = std::io::stdout();
    let mut w = stdout.lock();
    let mut write_err = None;
    let mut ends_with_newline = true;
    let out = Session::new(&engine)?.generate(&mut engine, &prompt, &opts, |p| {
        let r = if ids_only {
            let sep = if p.index == 0 { "" } else { " " };
            write!(w, "{sep}{}", p.id)
        } else if p.text.is_empty() {
            Ok(())
        } else {
            ends_with_newline = p.text.ends_with('\n');
            w.write_all(p.text.as_bytes())
        };
        // A closed pipe (`| head`) is not worth a panic, nor more tokens nobody reads:
        // remember it and stop after this one, as `tokenize` does.
        if let Err(e) = r.and_then(|_| w.flush()) {
            write_err.get_or_insert(e);
            cancel.store(true, Ordering::SeqCst);
        }
    })?;
    if ids_only {
        let _ = writeln!(w);
    } else if !ends_with_newline && stdout_is_terminal() {
        // Keep the stats line off the end of the text in a terminal; a pipe gets the text as is.
        let _ = writeln!(w);
    }
    let _ = w.flush();
    drop(w);
    if let Some(e) = write_err {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(Error::Invalid(format!("writing to stdout: {e}")));
        }
    }
    print_stats(&out);
    args.model.load.moe.save(&engine)
}

/// The prompt of -p, -f FILE (`-` for stdin) or a piped stdin.
fn prompt_text(args: &RunArgs) -> Result<String> {
    let stdin = || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
            .map_err(|e| Error::Invalid(format!("reading the prompt from stdin: {e}")))?;
        Ok(s)
    };
    match (&args.prompt, &args.file) {
        (Some(p), _) => Ok(p.clone()),
        (None, Some(f)) if f.as_os_str() == "-" => stdin(),
        (None, Some(f)) => std::fs::read_to_string(f).map_err(|e| Error::io(f, e)),
        (None, None) if !std::io::stdin().is_terminal() => stdin(),
        (None, None) => Err(Error::Invalid(
            "no prompt: pass -p TEXT, -f FILE, or pipe it on stdin".into(),
        )),
    }
}

fn stdout_is_terminal() -> bool {
    std::io::stdout().is_terminal()
}
