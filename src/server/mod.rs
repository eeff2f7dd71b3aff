//! `lathe serve`: an OpenAI-compatible HTTP server.
//!
//! Routes: `POST /v1/chat/completions` (messages through the model's chat template),
//! `POST /v1/completions` (a raw prompt), both streamed as server-sent events with
//! `"stream": true`; `GET /v1/models`; `GET /health` (200 ready, 503 loading).
//!
//! Layout: [`api`] reads and checks requests and shapes errors; [`output`] splits a reply
//! into content, reasoning and tool calls; [`scheduler`] is the engine thread (slots, queue,
//! chunked prefill, prompt cache); `http` holds the routes. The HTTP side runs on tokio; the
//! model runs on one plain thread that owns the [`Engine`], so the GPU is never shared.

pub mod api;
mod http;
pub mod output;
pub mod scheduler;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::engine::{Engine, LoadOptions};
use crate::tokenizer::{ChatTemplate, Tokenizer, CHATML};
use crate::{Error, Result};

/// Everything `lathe serve` is told.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub model: PathBuf,
    pub load: LoadOptions,
    pub host: String,
    /// 0 = any free port (the address is printed on stderr once bound).
    pub port: u16,
    /// Requests generated at once, each in its own sequence.
    pub parallel: usize,
    /// Requests that may wait for a slot; more get 429.
    pub queue: usize,
    /// Prompt tokens per step, over all prefilling requests.
    pub prefill_chunk: usize,
    /// Most tokens one sequence holds (prompt + reply).
    pub ctx: usize,
    /// Longest prompt accepted, in tokens (at most `ctx - 1`).
    pub max_prompt_tokens: usize,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Wall-clock limit of one request, queueing included.
    pub timeout: Duration,
    pub api_key: Option<String>,
    /// A tokenizer.json to use instead of the model's own vocabulary.
    pub tokenizer: Option<PathBuf>,
    /// A Jinja chat template file to use instead of the model's.
    pub chat_template: Option<PathBuf>,
    /// The model's name in `/v1/models` and responses (default: the file's name).
    pub alias: Option<String>,
    /// Split `<think>…</think>` into `reasoning_content` (`--reasoning-format auto`).
    pub reasoning: bool,
    /// After SIGINT/SIGTERM, how long requests in flight may take to finish.
    pub shutdown_grace: Duration,
    /// Testing aid: sleep this long before loading (to observe the loading state).
    pub load_delay: Duration,
}

impl ServerConfig {
    /// Defaults for everything but the model.
    pub fn new(model: PathBuf) -> ServerConfig {
        ServerConfig {
            model,
            load: LoadOptions::default(),
            host: "127.0.0.1".into(),
            port: 8080,
            parallel: 4,
            queue: 64,
            prefill_chunk: 256,
            ctx: 8192,
            max_prompt_tokens: usize::MAX,
            max_body_bytes: 8 << 20,
            timeout: Duration::from_secs(600),
            api_key: None,
            tokenizer: None,
            chat_template: None,
            alias: None,
            reasoning: true,
            shutdown_grace: Duration::from_secs(30),
            load_delay: Duration::ZERO,
        }
    }

    fn model_name(&self) -> String {
        if let Some(a) = &self.alias {
            return a.clone();
        }
        let p = &self.model;
        let name = if p.is_dir() {
            p.file_name()
        } else {
            p.file_stem()
        };
        name.map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "lathe".into())
    }
}

/// A random id: `prefix` and `n` characters of [0-9a-f], from the clock, a counter and
/// splitmix64 (ids only need to be unique, not secret).
pub fn random_id(prefix: &str, n: usize) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut x = nanos
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut s = String::with_capacity(prefix.len() + n);
    s.push_str(prefix);
    while s.len() < prefix.len() + n {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        s.push_str(&format!("{z:016x}"));
    }
    s.truncate(prefix.len() + n);
    s
}

/// Runs the server until SIGINT or SIGTERM (then requests in flight finish, within the grace
/// period; a second signal quits at once). Fails when the address cannot be bound or the
/// model cannot be loaded.
pub fn run(mut cfg: ServerConfig) -> Result<()> {
    // Per slot its live sequence and its checkpoint.
    cfg.load.max_seqs = cfg
        .load
        .max_seqs
        .max(scheduler::SEQS_PER_SLOT * cfg.parallel.max(1));
    if cfg.ctx < 2 {
        return Err(Error::Invalid(format!(
            "--ctx {}: must be at least 2",
            cfg.ctx
        )));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("lathe-http")
        .build()
        .map_err(|e| Error::Invalid(format!("starting the async runtime: {e}")))?;
    let r = rt.block_on(serve(cfg));
    rt.shutdown_timeout(Duration::from_secs(1));
    r
}

/// Loads the engine and tokenizer and compiles the chat template (on the engine thread).
fn load(cfg: &ServerConfig, template: &OnceLock<Arc<ChatTemplate>>) -> Result<(Engine, Tokenizer)> {
    if !cfg.load_delay.is_zero() {
        std::thread::sleep(cfg.load_delay);
    }
    let t0 = std::time::Instant::now();
    let mut engine = Engine::load(&cfg.model, &cfg.load)?;
    eprintln!("{}", engine.gpu.report());
    let tokenizer = match &cfg.tokenizer {
        Some(p) => Tokenizer::from_file(p)?,
        None => engine.tokenizer.take().ok_or_else(|| {
            Error::Invalid(format!(
                "{}: the model carries no tokenizer; pass --tokenizer tokenizer.json",
                cfg.model.display()
            ))
        })?,
    };
    if tokenizer.vocab_size() > engine.vocab_size() {
        return Err(Error::Invalid(format!(
            "the tokenizer has {} ids but the model only {}",
            tokenizer.vocab_size(),
            engine.vocab_size()
        )));
    }
    let source = match &cfg.chat_template {
        Some(p) => std::fs::read_to_string(p).map_err(|e| Error::io(p, e))?,
        None => match tokenizer.chat_template() {
            Some(s) => s.to_string(),
            None => {
                eprintln!("lathe serve: the model has no chat template: using ChatML");
                CHATML.to_string()
            }
        },
    };
    let compiled = ChatTemplate::new(&source).map_err(|e| match &cfg.chat_template {
        Some(p) => Error::Invalid(format!("{}: {e}", p.display())),
        None => e,
    })?;
    let _ = template.set(Arc::new(compiled));
    eprintln!(
        "lathe serve: loaded {} in {:.1} s",
        cfg.model.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok((engine, tokenizer))
}

async fn serve(cfg: ServerConfig) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .map_err(|e| Error::Invalid(format!("cannot listen on {}:{}: {e}", cfg.host, cfg.port)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::Invalid(format!("listening socket: {e}")))?;
    eprintln!("lathe serve: listening on http://{addr}");

    let template = Arc::new(OnceLock::new());
    let (load_tx, load_rx) = tokio::sync::oneshot::channel();
    let sched_cfg = scheduler::SchedulerConfig {
        n_slots: cfg.parallel.max(1),
        queue: cfg.queue.max(1),
        prefill_chunk: cfg.prefill_chunk.max(1),
        ctx: cfg.ctx,
    };
    let (lc, lt) = (cfg.clone(), template.clone());
    let (sched, engine_thread) = scheduler::start(
        sched_cfg,
        move || load(&lc, &lt),
        move |r| {
            let _ = load_tx.send(r);
        },
    );
    let state = http::AppState {
        sched,
        cfg: Arc::new(http::HttpConfig {
            api_key: cfg.api_key.clone(),
            model_name: cfg.model_name(),
            ctx: cfg.ctx,
            max_prompt_tokens: cfg.max_prompt_tokens,
            max_body_bytes: cfg.max_body_bytes,
            timeout: cfg.timeout,
            reasoning: cfg.reasoning,
            n_slots: cfg.parallel.max(1),
        }),
        template,
        started: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    let (hard_tx, hard_rx) = tokio::sync::oneshot::channel::<()>();
    let grace = cfg.shutdown_grace;
    let server = axum::serve(listener, http::router(state)).with_graceful_shutdown(async move {
        shutdown_signal().await;
        eprintln!(
            "lathe serve: shutting down: finishing requests in flight (up to {} s; signal again to quit now)",
            grace.as_secs()
        );
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown_signal() => {}
                _ = tokio::time::sleep(grace) => {}
            }
            let _ = hard_tx.send(());
        });
    });
    let mut load_rx = load_rx;
    let mut loaded = false;
    let mut hard_rx = hard_rx;
    let server = std::future::IntoFuture::into_future(server);
    tokio::pin!(server);
    loop {
        tokio::select! {
            r = &mut server => {
                r.map_err(|e| Error::Invalid(format!("server: {e}")))?;
                break;
            }
            r = &mut load_rx, if !loaded => {
                loaded = true;
                match r {
                    Ok(Ok(())) => {}
                    Ok(Err(msg)) => return Err(Error::Invalid(format!("loading the model failed: {msg}"))),
                    Err(_) => return Err(Error::Invalid("the engine thread ended while loading".into())),
                }
            }
            _ = &mut hard_rx => {
                eprintln!("lathe serve: quitting with requests still in flight");
                return Ok(());
            }
        }
    }
    if !loaded {
        // Stopped while loading: no request ever ran.
        eprintln!("lathe serve: stopped");
        return Ok(());
    }
    // Every handle on the scheduler went with the server: the engine thread ends once its
    // last request is done (or the grace period ends first).
    let join = tokio::task::spawn_blocking(move || engine_thread.join());
    tokio::select! {
        _ = join => eprintln!("lathe serve: stopped"),
        _ = &mut hard_rx => eprintln!("lathe serve: quitting with requests still in flight"),
    }
    Ok(())
}

/// SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
