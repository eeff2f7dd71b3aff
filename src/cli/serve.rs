//! `lathe serve`: the OpenAI-compatible HTTP server (see `lathe::server`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use lathe::engine::LoadOptions;
use lathe::server::ServerConfig;
use lathe::tokenizer::TemplateLimits;
use lathe::Result;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Model: a GGUF file (the first part of a split one), a Hugging Face checkpoint
    /// directory, or a Hub model `owner/repo[:QUANT]` (downloaded into the Hugging Face cache).
    #[arg(short, long, value_name = "PATH")]
    pub model: PathBuf,
    /// Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed on stderr).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Requests generated at once, each with its own sequence (KV cache and state).
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub parallel: usize,
    /// Requests that may wait for a free slot; more are refused with 429.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub queue: usize,
    /// Prompt tokens fed per step over all requests in prefill, so a long prompt delays the
    /// other requests' next token by at most this much work.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Context length of each slot: prompt + reply tokens.
    #[arg(long, value_name = "N", default_value_t = 8192)]
    pub ctx: usize,
    /// Longest prompt accepted, in tokens (default: the context length - 1). A text far over
    /// it is refused after counting a few pieces of it, never tokenized whole.
    #[arg(long, value_name = "N")]
    pub max_prompt_tokens: Option<usize>,
    /// Largest request body accepted, in bytes (a larger Content-Length gets 413 at once).
    #[arg(long, value_name = "BYTES", default_value_t = 8 << 20)]
    pub max_body: usize,
    /// Wall-clock limit of one request in seconds, queueing included.
    #[arg(long, value_name = "S", default_value_t = 600.0)]
    pub timeout: f64,
    /// Seconds a client has to send a request's headers (also how long an idle kept-alive
    /// connection stays open).
    #[arg(long, value_name = "S", default_value_t = 30.0)]
    pub header_timeout: f64,
    /// Seconds a client has to send a request's body once its headers are in (408 after).
    #[arg(long, value_name = "S", default_value_t = 60.0)]
    pub body_timeout: f64,
    /// Connections held open at once; further clients wait until one closes.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_connections: usize,
    /// Connections one client address may hold at once; the last eighth of
    /// --max-connections is kept for addresses that hold none (a slow client cannot take
    /// them all, and `/health` still answers).
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub max_client_connections: usize,
    /// Steps (template instructions) one chat template rendering may take before the
    /// request fails with 400: a template whose loops run away cannot hold a CPU.
    #[arg(long, value_name = "N", default_value_t = TemplateLimits::default().fuel)]
    pub template_fuel: u64,
    /// Require `Authorization: Bearer KEY` on every route but /health (also read from
    /// LATHE_API_KEY).
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// A tokenizer.json to use instead of the vocabulary in the model file.
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    #[command(flatten)]
    pub template: super::text::ChatTemplateArgs,
    /// The model's name in /v1/models and in responses (default: the file name, or the Hub
    /// name a model was fetched by).
    #[arg(long, value_name = "NAME")]
    pub alias: Option<String>,
    /// `auto`: `<think>` blocks go to `reasoning_content`; `none`: they stay in `content`.
    #[arg(long, value_name = "FORMAT", default_value = "auto", value_parser = ["auto", "none"])]
    pub reasoning_format: String,
    /// How /v1/embeddings pools the final-norm hidden states of an input's tokens before
    /// L2-normalising: `mean` (over the tokens), `last` (the last token: what last-token
    /// embedding models are trained for) or `cls` (the first token).
    #[arg(long, value_name = "TYPE", default_value = "mean", value_parser = ["mean", "last", "cls"])]
    pub pooling: String,
    /// After SIGINT/SIGTERM, seconds that requests in flight get to finish; past it (or at a
    /// second signal) they are cut: streams get an error event and `[DONE]`, the others 503,
    /// and the exit status is 1.
    #[arg(long, value_name = "S", default_value_t = 30.0)]
    pub shutdown_grace: f64,
    #[command(flatten)]
    pub load: super::load::LoadArgs,
    // Speculative decoding: every decoding request drafts tokens (the model's MTP block or
    // --draft-model) and the model checks all requests' drafts in shared verify passes.
    #[command(flatten)]
    pub spec: super::run::SpecArgs,
    /// Testing aid: wait this many milliseconds before loading the model.
    #[arg(long, hide = true, default_value_t = 0)]
    pub debug_load_delay_ms: u64,
}

fn seconds(flag: &str, s: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| lathe::Error::Invalid(format!("--{flag} {s}: expected seconds >= 0")))
}

pub fn run(a: ServeArgs) -> Result<()> {
    super::run::note_random_weights(&a.model);
    let mut cfg = ServerConfig::new(a.model);
    let total_shown = Arc::new(std::sync::atomic::AtomicU64::new(0));
    // Upload progress in tenths, on stderr (a server's log, not a terminal bar).
    let progress: lathe::engine::Progress = Arc::new(move |done, total| {
        let tenth = (done * 10).checked_div(total).unwrap_or(10);
        let prev = total_shown.fetch_max(tenth, std::sync::atomic::Ordering::Relaxed);
        if tenth > prev {
            eprintln!("lathe serve: loading {}%", tenth * 10);
        }
    });
    // --save-expert-stats: written when the engine thread drops the model at shutdown.
    cfg.load = LoadOptions {
        ctx: a.ctx,
        // One live sequence per slot.
        max_seqs: a.parallel,
        progress: Some(progress),
        ..a.load.load_options(a.parallel * a.spec.decode_rows())?
    };
    cfg.host = a.host;
    cfg.port = a.port;
    cfg.parallel = a.parallel;
    cfg.queue = a.queue;
    cfg.prefill_chunk = a.prefill_chunk;
    cfg.ctx = a.ctx;
    cfg.max_prompt_tokens = a.max_prompt_tokens.unwrap_or(usize::MAX);
    cfg.max_body_bytes = a.max_body;
    cfg.timeout = seconds("timeout", a.timeout)?;
    cfg.header_timeout = seconds("header-timeout", a.header_timeout)?;
    cfg.body_timeout = seconds("body-timeout", a.body_timeout)?;
    cfg.max_connections = a.max_connections;
    cfg.max_client_connections = a.max_client_connections;
    cfg.template_limits.fuel = a.template_fuel;
    cfg.api_key = a
        .api_key
        .or_else(|| std::env::var("LATHE_API_KEY").ok())
        .filter(|k| !k.is_empty());
    cfg.tokenizer = a.tokenizer;
    cfg.chat_template = a.template.choice()?;
    cfg.alias = a.alias;
    cfg.reasoning = a.reasoning_format == "auto";
    cfg.pooling = a.pooling.parse()?;
    cfg.shutdown_grace = seconds("shutdown-grace", a.shutdown_grace)?;
    cfg.load_delay = Duration::from_millis(a.debug_load_delay_ms);
    if let Some(p) = &a.spec.draft_model {
        super::run::check_model_path(p)?;
    }
    cfg.spec = lathe::spec::SpecOptions {
        mode: a.spec.mode,
        draft: a.spec.draft,
        accept_all: false,
        draft_model: None,
        draft_vocab: a.spec.draft_vocab,
    };
    cfg.draft_model = a.spec.draft_model;
    lathe::server::run(cfg)
}
