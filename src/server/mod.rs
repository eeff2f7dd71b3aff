//! `lathe serve`: an OpenAI-compatible HTTP server.
//!
//! Routes: `POST /v1/chat/completions` (messages through the model's chat template),
//! `POST /v1/completions` (a raw prompt), both with `n` choices and streamed as server-sent
//! events with `"stream": true`; `POST /v1/responses` (OpenAI's Responses API over the chat
//! path); `POST /v1/embeddings` (pooled final-norm hidden states); `GET /v1/models`; `GET /health` (200 ready, 503 loading); llama-server's
//! `/tokenize`, `/detokenize`, `/props`, `/slots`; `/metrics`; a chat page at `/`.
//!
//! Layout: [`api`] reads and checks requests and shapes errors; [`output`] splits a reply
//! into content, reasoning and tool calls; [`scheduler`] is the engine thread (slots, queue,
//! chunked prefill, prompt cache); `http` holds the routes. The HTTP side runs on tokio; the
//! model runs on one plain thread that owns the [`Engine`], so the GPU is never shared.

pub mod api;
pub mod clients;
pub mod constrain;
mod http;
pub mod metrics;
pub mod output;
pub mod scheduler;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::engine::{Engine, LoadOptions};
use crate::tokenizer::{ChatTemplate, TemplateLimits, Tokenizer, CHATML};
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
    /// Time a client has to send a request's headers (and, on a kept-alive connection, to
    /// start the next request) before the connection is closed.
    pub header_timeout: Duration,
    /// Time a client has to send a request's body once its headers are in (408 after).
    pub body_timeout: Duration,
    /// Connections held open at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// Connections one client address may hold at once (see [`clients`]).
    pub max_client_connections: usize,
    /// Work and output one chat template rendering may take.
    pub template_limits: TemplateLimits,
    pub api_key: Option<String>,
    /// A tokenizer.json to use instead of the model's own vocabulary.
    pub tokenizer: Option<PathBuf>,
    /// A chat template to use instead of the model's (`--chat-template`, read by the CLI).
    pub chat_template: Option<crate::tokenizer::TemplateChoice>,
    /// The model's name in `/v1/models` and responses (default: the file's name).
    pub alias: Option<String>,
    /// Split `<think>…</think>` into `reasoning_content` (`--reasoning-format auto`).
    pub reasoning: bool,
    /// After SIGINT/SIGTERM, how long requests in flight may take to finish.
    pub shutdown_grace: Duration,
    /// Testing aid: sleep this long before loading (to observe the loading state).
    pub load_delay: Duration,
    /// Speculative decoding (`--spec`, `--draft`, `--draft-vocab`).
    pub spec: crate::spec::SpecOptions,
    /// `--draft-model`: loaded on the model's adapter after the model.
    pub draft_model: Option<PathBuf>,
    /// How `/v1/embeddings` pools an input's hidden states (`--pooling`).
    pub pooling: Pooling,
}

/// How an embedding is made of the final-norm hidden states of an input's tokens
/// (`--pooling`, llama-server's names), before it is L2-normalised.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over the tokens (the default: every token counts, as sentence-embedding
    /// models pooled from causal LMs commonly do).
    #[default]
    Mean,
    /// The last token's state: in a causal model the only one that has seen the whole input
    /// (what last-token embedding models such as Qwen3-Embedding and E5-Mistral are trained
    /// for).
    Last,
    /// The first token's state (BERT's `[CLS]` position; in a causal model it has seen only
    /// itself).
    Cls,
}

impl std::str::FromStr for Pooling {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "mean" => Ok(Pooling::Mean),
            "last" => Ok(Pooling::Last),
            "cls" => Ok(Pooling::Cls),
            _ => Err(Error::Invalid(format!(
                "--pooling {s}: expected mean, last or cls"
            ))),
        }
    }
}

impl Pooling {
    /// The pooled, L2-normalised embedding of `hidden` (`[n, width]` row-major, n ≥ 1),
    /// accumulated in f64.
    pub fn embed(self, hidden: &[f32], width: usize) -> Vec<f32> {
        let n = hidden.len() / width.max(1);
        let rows = match self {
            Pooling::Mean => 0..n,
            Pooling::Last => n.saturating_sub(1)..n,
            Pooling::Cls => 0..n.min(1),
        };
        let mut acc = vec![0f64; width];
        for r in rows.clone() {
            for (a, &x) in acc.iter_mut().zip(&hidden[r * width..(r + 1) * width]) {
                *a += x as f64;
            }
        }
        let norm = acc.iter().map(|a| a * a).sum::<f64>().sqrt();
        let scale = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        acc.iter().map(|a| (a * scale) as f32).collect()
    }
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
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
            max_connections: 256,
            max_client_connections: 64,
            template_limits: TemplateLimits::default(),
            api_key: None,
            tokenizer: None,
            chat_template: None,
            alias: None,
            reasoning: true,
            shutdown_grace: Duration::from_secs(30),
            load_delay: Duration::ZERO,
            spec: crate::spec::SpecOptions::default(),
            draft_model: None,
            pooling: Pooling::default(),
        }
    }

    /// Refuses settings after which every request would fail (a zero body size, timeout
    /// or prompt length) or that would silently mean something else (`--parallel 0`).
    pub fn check(&self) -> Result<()> {
        let positive: [(&str, bool); 12] = [
            ("--parallel", self.parallel > 0),
            ("--queue", self.queue > 0),
            ("--prefill-chunk", self.prefill_chunk > 0),
            ("--max-prompt-tokens", self.max_prompt_tokens > 0),
            ("--max-body", self.max_body_bytes > 0),
            ("--timeout", !self.timeout.is_zero()),
            ("--header-timeout", !self.header_timeout.is_zero()),
            ("--body-timeout", !self.body_timeout.is_zero()),
            ("--max-connections", self.max_connections > 0),
            ("--max-client-connections", self.max_client_connections > 0),
            ("--template-fuel", self.template_limits.fuel > 0),
            ("template output limit", self.template_limits.max_output > 0),
        ];
        if let Some((flag, _)) = positive.iter().find(|p| !p.1) {
            return Err(Error::Invalid(format!(
                "{flag} 0: must be greater than 0 (every request would fail)"
            )));
        }
        if self.ctx < 2 {
            return Err(Error::Invalid(format!(
                "--ctx {}: must be at least 2",
                self.ctx
            )));
        }
        Ok(())
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
/// period; a second signal quits at once, and so does the end of the grace period: open
/// streams get an error event and `[DONE]`, other requests 503, and the call fails). Fails
/// when a setting is refused, the address cannot be bound, the tokenizer or template file
/// cannot be read (checked before the weights load), or the model cannot be loaded.
pub fn run(mut cfg: ServerConfig) -> Result<()> {
    cfg.check()?;
    // Per slot its live sequence and its checkpoint.
    cfg.load.max_seqs = cfg
        .load
        .max_seqs
        .max(scheduler::SEQS_PER_SLOT * cfg.parallel);
    let given = Given::read(&cfg)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("lathe-http")
        .build()
        .map_err(|e| Error::Invalid(format!("starting the async runtime: {e}")))?;
    let r = rt.block_on(serve(cfg, given));
    rt.shutdown_timeout(Duration::from_secs(1));
    r
}

/// What the flags name besides the model, read before the model loads so that a wrong
/// path fails at once rather than after minutes of loading weights.
struct Given {
    tokenizer: Option<Tokenizer>,
    /// The `--chat-template` or `--chat-template-file` template, compiled.
    template: Option<ChatTemplate>,
}

impl Given {
    fn read(cfg: &ServerConfig) -> Result<Given> {
        let tokenizer = cfg
            .tokenizer
            .as_ref()
            .map(|p| {
                if !p.is_file() {
                    return Err(Error::Invalid(format!(
                        "--tokenizer {}: no such file",
                        p.display()
                    )));
                }
                Tokenizer::from_file(p)
            })
            .transpose()?;
        let template = cfg
            .chat_template
            .as_ref()
            .map(|c| c.compile(cfg.template_limits))
            .transpose()?;
        Ok(Given {
            tokenizer,
            template,
        })
    }
}

/// Loads the engine (and the tokenizer and chat template when no flag gave them), on the
/// engine thread.
fn load(
    cfg: &ServerConfig,
    given: Given,
    template: &OnceLock<Arc<ChatTemplate>>,
) -> Result<(Engine, Tokenizer)> {
    if !cfg.load_delay.is_zero() {
        std::thread::sleep(cfg.load_delay);
    }
    let t0 = std::time::Instant::now();
    let mut engine = Engine::load(&cfg.model, &cfg.load)?;
    eprintln!("{}", engine.report());
    let tokenizer = match given.tokenizer {
        Some(t) => t,
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
    let compiled = match given.template {
        Some(t) => t,
        None => {
            let source = match tokenizer.chat_template() {
                Some(s) => s,
                None => {
                    eprintln!("lathe serve: the model has no chat template: using ChatML");
                    CHATML
                }
            };
            ChatTemplate::with_limits(source, cfg.template_limits)?
        }
    };
    let _ = template.set(Arc::new(compiled));
    // After the checks above, so bad input fails at once. Without it, the first concurrent
    // requests compile the batched passes' pipelines: the first 15 s of 16 streams on an
    // H200 served 17 requests, one waiting 5.1 s for its first token.
    let tw = std::time::Instant::now();
    engine.warm_up(cfg.parallel, cfg.prefill_chunk)?;
    eprintln!(
        "lathe serve: warmed up in {:.1} s",
        tw.elapsed().as_secs_f64()
    );
    eprintln!(
        "lathe serve: loaded {} in {:.1} s",
        cfg.model.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok((engine, tokenizer))
}

async fn serve(cfg: ServerConfig, given: Given) -> Result<()> {
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
        n_slots: cfg.parallel,
        queue: cfg.queue,
        prefill_chunk: cfg.prefill_chunk,
        ctx: cfg.ctx,
        spec: cfg.spec.clone(),
        // One draft sequence per slot.
        draft_model: cfg.draft_model.clone().map(|p| {
            let opts = LoadOptions {
                max_seqs: cfg.parallel,
                progress: None,
                save_expert_stats: None,
                ..cfg.load.clone()
            };
            (p, opts)
        }),
        spec_costs: None,
    };
    let (lc, lt) = (cfg.clone(), template.clone());
    let (sched, engine_thread) = scheduler::start(
        sched_cfg,
        move || load(&lc, given, &lt),
        move |r| {
            let _ = load_tx.send(r);
        },
    );
    let (hard_tx, hard_rx) = tokio::sync::watch::channel(false);
    let cut = Arc::new(AtomicUsize::new(0));
    let state = http::AppState {
        sched,
        cfg: Arc::new(http::HttpConfig {
            api_key: cfg.api_key.clone(),
            model_name: cfg.model_name(),
            ctx: cfg.ctx,
            max_prompt_tokens: cfg.max_prompt_tokens,
            max_body_bytes: cfg.max_body_bytes,
            body_timeout: cfg.body_timeout,
            timeout: cfg.timeout,
            reasoning: cfg.reasoning,
            n_slots: cfg.parallel,
            pooling: cfg.pooling,
        }),
        template,
        started: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        hard_stop: hard_rx,
        cut: cut.clone(),
    };
    let conns = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections));
    let (drain_tx, drain_rx) = tokio::sync::watch::channel(false);
    let mut accept = Box::pin(accept_loop(
        listener,
        http::router(state),
        conns.clone(),
        clients::ClientCounts::new(cfg.max_connections, cfg.max_client_connections),
        cfg.header_timeout,
        drain_rx,
    ));
    let signal = shutdown_signal();
    tokio::pin!(signal);
    let mut load_rx = load_rx;
    let mut loaded = false;
    loop {
        tokio::select! {
            _ = &mut accept => unreachable!("the accept loop never ends"),
            r = &mut load_rx, if !loaded => {
                loaded = true;
                match r {
                    Ok(Ok(())) => {}
                    Ok(Err(msg)) => return Err(Error::Invalid(format!("loading the model failed: {msg}"))),
                    Err(_) => return Err(Error::Invalid("the engine thread ended while loading".into())),
                }
            }
            _ = &mut signal => break,
        }
    }
    // Dropping the accept loop closes the listener and its handle on the router (and so on
    // the scheduler); the connections' tasks hold the rest.
    drop(accept);
    let grace = cfg.shutdown_grace;
    eprintln!(
        "lathe serve: shutting down: finishing requests in flight (up to {} s; signal again to quit now)",
        grace.as_secs()
    );
    let _ = drain_tx.send(true);
    let all = u32::try_from(cfg.max_connections).unwrap_or(u32::MAX);
    // Every connection closed, then every job done: the engine thread ends once the last
    // handle on the scheduler is gone (it went with the connections).
    let finished = async {
        let _ = conns.acquire_many(all).await;
        if loaded {
            let _ = tokio::task::spawn_blocking(move || engine_thread.join()).await;
        }
    };
    tokio::select! {
        _ = finished => {
            eprintln!("lathe serve: stopped");
            return Ok(());
        }
        _ = shutdown_signal() => {}
        _ = tokio::time::sleep(grace) => {}
    }
    // Past the grace period: every open request ends now, streams with an error event and
    // `[DONE]`, the others with 503; give them a moment to be written.
    let _ = hard_tx.send(true);
    let _ = tokio::time::timeout(HARD_STOP_FLUSH, conns.acquire_many(all)).await;
    let n = cut.load(Ordering::SeqCst);
    if n == 0 {
        eprintln!("lathe serve: stopped");
        return Ok(());
    }
    Err(Error::Invalid(format!(
        "the server quit with {n} request(s) cut short (past --shutdown-grace, or a second signal)"
    )))
}

/// How long a refused connection gets to take its 503 (a client that reads nothing must not
/// hold the slot).
const REFUSAL_WRITE: Duration = Duration::from_secs(1);

/// How long a refused connection's request bytes are read and dropped after its 503 (they are
/// in flight or already received: a request head is one packet).
const REFUSAL_LINGER: Duration = Duration::from_millis(250);

/// How long requests cut by a hard stop get to write their last bytes.
const HARD_STOP_FLUSH: Duration = Duration::from_secs(2);

/// Accepts connections while fewer than `conns`' permits are out, serving each on its own
/// task (HTTP/1.1, with `header_timeout` for every request's head) when `clients` admits its
/// address, answering 503 and closing otherwise; when `drain` turns true, each connection
/// finishes its request in flight and closes.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    conns: Arc<tokio::sync::Semaphore>,
    clients: Arc<clients::ClientCounts>,
    header_timeout: Duration,
    drain: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let Ok(permit) = conns.clone().acquire_owned().await else {
            return;
        };
        let free = conns.available_permits() + 1;
        let (io, slot) = match listener.accept().await {
            Ok((io, peer)) => (io, clients.admit(peer.ip(), free)),
            Err(e) => {
                // Out of file descriptors and the like: wait for connections to close.
                eprintln!("lathe serve: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let slot = match slot {
            Ok(slot) => slot,
            Err(why) => {
                tokio::spawn(async move {
                    // A few hundred bytes (one write once the socket is writable), then a
                    // lingering close (RFC 9112 section 9.6): the request bytes the client
                    // already sent are read and dropped, since closing with them unread resets
                    // the connection and the client may lose the 503.
                    // The slot is given back once the answer is written: the linger holds
                    // only a socket, for at most REFUSAL_LINGER.
                    let write = async {
                        let _ = io.writable().await;
                        let _ = io.try_write(clients::refusal(why).as_bytes());
                        io
                    };
                    let Ok(io) = tokio::time::timeout(REFUSAL_WRITE, write).await else {
                        return;
                    };
                    drop(permit);
                    let linger = async {
                        let Ok(io) = io.into_std().and_then(|std| {
                            std.shutdown(std::net::Shutdown::Write)?;
                            tokio::net::TcpStream::from_std(std)
                        }) else {
                            return;
                        };
                        let mut sink = [0u8; 4096];
                        loop {
                            if io.readable().await.is_err() {
                                return;
                            }
                            match io.try_read(&mut sink) {
                                Ok(0) => return,
                                Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => return,
                                _ => {}
                            }
                        }
                    };
                    let _ = tokio::time::timeout(REFUSAL_LINGER, linger).await;
                });
                continue;
            }
        };
        let app = app.clone();
        let mut drain = drain.clone();
        tokio::spawn(async move {
            let _permit = (permit, slot);
            let service = hyper_util::service::TowerToHyperService::new(app);
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout);
            let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(io), service);
            tokio::pin!(conn);
            let mut draining = false;
            loop {
                tokio::select! {
                    _ = conn.as_mut() => break,
                    _ = drain.wait_for(|d| *d), if !draining => {
                        draining = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
        });
    }
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
