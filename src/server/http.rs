//! Routes and handlers: each request is checked, turned into prompt tokens (chat template and
//! tokenizer on a blocking thread), queued for the engine thread, and answered from the
//! events it sends back: collected into one JSON body, or streamed as server-sent events in
//! OpenAI's chunk format ending with `data: [DONE]`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::StreamExt;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::watch;

use super::api::{self, json_response, ApiError, GenParams, Prompt};
use super::output::{OutputParser, Piece, ToolCall};
use super::random_id;
use super::scheduler::{Event, Finish, Job, Loaded, Scheduler, SubmitError, TokenLogprob};
use crate::spec::SpecStats;
use crate::tokenizer::{ChatTemplate, Tokenizer};

/// What the handlers need besides the scheduler.
pub struct HttpConfig {
    pub api_key: Option<String>,
    pub model_name: String,
    pub ctx: usize,
    pub max_prompt_tokens: usize,
    pub max_body_bytes: usize,
    /// Time a client has to send the body once its headers are in.
    pub body_timeout: Duration,
    pub timeout: Duration,
    /// Split `<think>` blocks into `reasoning_content`.
    pub reasoning: bool,
    pub n_slots: usize,
}

#[derive(Clone)]
pub struct AppState {
    pub sched: Scheduler,
    pub cfg: Arc<HttpConfig>,
    /// Compiled by the loader once the tokenizer is known.
    pub template: Arc<OnceLock<Arc<ChatTemplate>>>,
    pub started: u64,
    /// Turns true when the server quits before requests in flight are done: each ends at
    /// once (a stream with an error event and `[DONE]`, a whole answer with 503).
    pub hard_stop: watch::Receiver<bool>,
    /// Requests ended by `hard_stop`.
    pub cut: Arc<AtomicUsize>,
}

type R<T> = std::result::Result<T, ApiError>;

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .with_state(state)
}

/// `--api-key`: every route but /health wants `Authorization: Bearer <key>`.
async fn auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        if req.uri().path() != "/health" && !bearer_matches(req.headers(), key) {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "missing or wrong API key: send `Authorization: Bearer <key>`",
            )
            .with_code("invalid_api_key")
            .into_response();
        }
    }
    next.run(req).await
}

fn bearer_matches(h: &HeaderMap, key: &str) -> bool {
    let Some(got) = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            // The scheme is case-insensitive (RFC 9110, section 11.1).
            let (scheme, rest) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(rest)
        })
    else {
        return false;
    };
    // Compare every byte, so the time taken does not tell how much of the key matched.
    let (a, b) = (got.trim().as_bytes(), key.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(req: Request) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("no route {} {}", req.method(), req.uri().path()),
    )
    .with_code("not_found")
    .into_response()
}

async fn method_not_allowed(req: Request) -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
    .into_response()
}

async fn health(State(st): State<AppState>) -> Response {
    let sh = &st.sched.shared;
    if let Some(why) = sh.failure() {
        return json_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            &json!({"status": "error", "error": why}),
        );
    }
    if sh.loaded.get().is_none() {
        return json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "loading"}),
        );
    }
    let mut body = json!({"status": "ok", "slots": {
        "total": st.cfg.n_slots,
        "active": sh.active.load(Ordering::Relaxed),
        "queued": sh.queued.load(Ordering::Relaxed),
    }});
    // Speculative decoding over the finished requests.
    if let Some(s) = sh.spec.lock().ok().and_then(|s| *s) {
        body["speculation"] = json!({
            "drafted": s.drafted,
            "accepted": s.accepted,
            "acceptance": s.acceptance(),
            "verify_passes": s.verify_passes,
            "tokens_per_forward": s.tokens_per_forward(),
        });
    }
    json_response(StatusCode::OK, &body)
}

fn model_object(st: &AppState) -> Value {
    json!({"id": st.cfg.model_name, "object": "model", "created": st.started, "owned_by": "lathe"})
}

async fn models(State(st): State<AppState>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [model_object(&st)]}),
    )
}

/// Any name is served by the one model, as the completion routes accept any `model`.
async fn model(State(st): State<AppState>) -> Response {
    json_response(StatusCode::OK, &model_object(&st))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The body as JSON, or the error that says why not: 413 at once for a `Content-Length`
/// over `--max-body` (before any of it is read) or a body that grows past it, 408 for a
/// body that takes longer than `--body-timeout` to arrive, 400 for one that is not JSON.
async fn read_json(cfg: &HttpConfig, req: Request) -> R<Value> {
    let limit = cfg.max_body_bytes;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is larger than {limit} bytes (--max-body)"),
        )
        .with_code("request_too_large")
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let read = async {
        let mut body = req.into_body().into_data_stream();
        let mut bytes = Vec::new();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::bad_request(format!("reading the request body failed: {e}"))
            })?;
            if bytes.len() + chunk.len() > limit {
                return Err(too_large());
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    };
    let bytes = tokio::time::timeout(cfg.body_timeout, read)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {} s (--body-timeout)",
                    cfg.body_timeout.as_secs_f64()
                ),
            )
            .with_code("request_timeout")
        })??;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))
}

/// The loaded model, or 503 while it loads / 500 when the engine is gone.
fn ready(st: &AppState) -> R<&Loaded> {
    if let Some(why) = st.sched.shared.failure() {
        return Err(ApiError::server(why).with_code("engine_unavailable"));
    }
    st.sched.shared.loaded.get().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the model is still loading; GET /health says when it is ready",
        )
        .with_code("model_loading")
    })
}

/// A seed for requests that give none: different every request, as OpenAI's sampling is.
fn fresh_seed() -> u64 {
    let id = random_id("", 16);
    u64::from_str_radix(&id, 16).unwrap_or(0x1a7e_5eed)
}

async fn chat(State(st): State<AppState>, req: Request) -> Response {
    chat_inner(st, req)
        .await
        .unwrap_or_else(|e| e.into_response())
}

async fn chat_inner(st: AppState, req: Request) -> R<Response> {
    let body = read_json(&st.cfg, req).await?;
    let loaded = ready(&st)?;
    let req = api::chat_request(&body, loaded.vocab, fresh_seed())?;
    let template = st
        .template
        .get()
        .cloned()
        .ok_or_else(|| ApiError::server("no chat template"))?;
    let tokenizer = loaded.tokenizer.clone();
    let mut vars = tokenizer.template_tokens();
    vars.extend(req.template_vars);
    let messages = req.messages;
    let limits = (prompt_limit(&st.cfg), st.cfg.ctx);
    let (text, ids, conversation) = tokio::task::spawn_blocking(move || -> R<_> {
        let text = template
            .render(&messages, true, &vars)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        let ids = encode_bounded(&tokenizer, &text, limits, "messages")?;
        // Where the slot's checkpoint goes (see `Job::checkpoint`).
        let conversation =
            crate::generate::conversation_len(&template, &vars, &messages, &tokenizer, &ids);
        Ok((text, ids, conversation))
    })
    .await
    .map_err(|e| ApiError::server(format!("rendering the prompt failed: {e}")))??;
    let think_open = OutputParser::prompt_opens_thinking(&text);
    let parser = OutputParser::new(st.cfg.reasoning, think_open, req.tools);
    let model = req.model.unwrap_or_else(|| st.cfg.model_name.clone());
    let ids = (ids, Some(conversation));
    start(&st, Kind::Chat(parser), model, ids, req.params, "messages").await
}

async fn completions(State(st): State<AppState>, req: Request) -> Response {
    completions_inner(st, req)
        .await
        .unwrap_or_else(|e| e.into_response())
}

async fn completions_inner(st: AppState, req: Request) -> R<Response> {
    let body = read_json(&st.cfg, req).await?;
    let loaded = ready(&st)?;
    let req = api::completion_request(&body, loaded.vocab, fresh_seed())?;
    let ids = match req.prompt {
        Prompt::Tokens(t) => t,
        Prompt::Text(s) => {
            let tokenizer = loaded.tokenizer.clone();
            let limits = (prompt_limit(&st.cfg), st.cfg.ctx);
            tokio::task::spawn_blocking(move || encode_bounded(&tokenizer, &s, limits, "prompt"))
                .await
                .map_err(|e| ApiError::server(format!("tokenizing failed: {e}")))??
        }
    };
    let model = req.model.unwrap_or_else(|| st.cfg.model_name.clone());
    let ids = (ids, None);
    start(&st, Kind::Completion, model, ids, req.params, "prompt").await
}

/// Longest prompt accepted, in tokens.
fn prompt_limit(cfg: &HttpConfig) -> usize {
    cfg.max_prompt_tokens.min(cfg.ctx - 1)
}

/// The 400 for a prompt of `n` tokens over `limit`.
fn too_long(n: &str, (limit, ctx): (usize, usize), param: &str) -> ApiError {
    ApiError::invalid(
        param,
        format!(
            "the prompt has {n} tokens; this server takes at most {limit} (context length {ctx})"
        ),
    )
    .with_code("context_length_exceeded")
}

/// `text`'s ids (BOS as the vocabulary wants it), or the 400 for a prompt over `limit`
/// tokens, found before encoding a long text whole ([`Tokenizer::exceeds`]): a body of
/// megabytes over the limit costs little more memory than its own size.
fn encode_bounded(
    tokenizer: &Tokenizer,
    text: &str,
    (limit, ctx): (usize, usize),
    param: &str,
) -> R<Vec<u32>> {
    let over = tokenizer
        .exceeds(text, true, limit)
        .map_err(|e| ApiError::server(e.to_string()))?;
    if let Some(n) = over {
        return Err(too_long(&format!("at least {n}"), (limit, ctx), param));
    }
    tokenizer
        .encode_with_bos(text, true)
        .map_err(|e| ApiError::server(e.to_string()))
}

/// Which endpoint a response is for.
enum Kind {
    Chat(OutputParser),
    Completion,
}

/// What every response of one request shares.
struct Meta {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    params: GenParams,
    /// [`AppState::hard_stop`].
    hard_stop: watch::Receiver<bool>,
    cut: Arc<AtomicUsize>,
}

impl Meta {
    /// Resolves when the server quits before this request is done, counting it as cut.
    async fn cut_short(&mut self) -> ApiError {
        if self.hard_stop.wait_for(|s| *s).await.is_err() {
            // The server is gone without a hard stop: nothing to wait for.
            std::future::pending::<()>().await;
        }
        self.cut.fetch_add(1, Ordering::SeqCst);
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the server is shutting down: the request was cut short",
        )
        .with_code("shutdown")
    }
}

/// Checks the prompt's length, queues the job and answers (streamed or whole). `ids`: the
/// prompt, and where its slot checkpoint goes when not at its end (`Job::checkpoint`).
async fn start(
    st: &AppState,
    kind: Kind,
    model: String,
    (ids, checkpoint): (Vec<u32>, Option<usize>),
    params: GenParams,
    prompt_param: &str,
) -> R<Response> {
    let loaded = ready(st)?;
    let ctx = st.cfg.ctx;
    let limit = prompt_limit(&st.cfg);
    if ids.is_empty() {
        return Err(ApiError::invalid(prompt_param, "the prompt has no tokens"));
    }
    if ids.len() > limit {
        let n = ids.len().to_string();
        return Err(too_long(&n, (limit, ctx), prompt_param));
    }
    let room = ctx - ids.len();
    let max_tokens = params.max_tokens.unwrap_or(room).min(room);
    let (tx, rx) = unbounded_channel();
    let id = match kind {
        Kind::Chat(_) => random_id("chatcmpl-", 24),
        Kind::Completion => random_id("cmpl-", 24),
    };
    let job = Job {
        id: id.clone(),
        checkpoint: checkpoint.unwrap_or(ids.len()),
        prompt: ids,
        max_tokens,
        sampler: params.sampler.clone(),
        stop: params.stop.clone(),
        logprobs: params.logprobs,
        logit_bias: params.logit_bias.clone(),
        ignore_eos: params.ignore_eos,
        deadline: Instant::now() + st.cfg.timeout,
        events: tx,
    };
    st.sched.submit(job).map_err(|e| match e {
        SubmitError::Full => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "the server's queue is full; retry later",
        )
        .with_code("queue_full"),
        SubmitError::Closed => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the server is shutting down",
        ),
    })?;
    let meta = Meta {
        id,
        created: unix_now(),
        model,
        tokenizer: loaded.tokenizer.clone(),
        params,
        hard_stop: st.hard_stop.clone(),
        cut: st.cut.clone(),
    };
    if meta.params.stream {
        Ok(stream_response(Stream::new(meta, kind, rx)))
    } else {
        collect(meta, kind, rx).await
    }
}

/// The usage block; with speculative decoding, its drafts in OpenAI's predicted-output
/// fields (`completion_tokens_details`: drafted tokens the reply kept, and those it did not).
fn usage(n_prompt: usize, n_cached: usize, n_generated: usize, spec: Option<SpecStats>) -> Value {
    let mut u = json!({
        "prompt_tokens": n_prompt,
        "completion_tokens": n_generated,
        "total_tokens": n_prompt + n_generated,
        "prompt_tokens_details": {"cached_tokens": n_cached},
    });
    if let Some(s) = spec {
        u["completion_tokens_details"] = json!({
            "accepted_prediction_tokens": s.accepted,
            "rejected_prediction_tokens": s.drafted - s.accepted,
        });
    }
    u
}

fn engine_error(message: String, code: &'static str) -> ApiError {
    if code == "timeout" {
        ApiError::new(StatusCode::GATEWAY_TIMEOUT, "server_error", message).with_code("timeout")
    } else {
        ApiError::server(message)
    }
}

fn finish_str(finish: Finish, calls: &[ToolCall]) -> &'static str {
    match finish {
        Finish::Length => "length",
        Finish::Stop if !calls.is_empty() => "tool_calls",
        Finish::Stop => "stop",
    }
}

fn tool_calls_json(calls: &[ToolCall], with_index: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({
                    "id": random_id("call_", 24),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                });
                if with_index {
                    v["index"] = i.into();
                }
                v
            })
            .collect(),
    )
}

fn token_string(t: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let b = t.token_bytes(id).unwrap_or_default().to_vec();
    (String::from_utf8_lossy(&b).into_owned(), b)
}

/// Chat's `logprobs.content` entries.
fn chat_logprobs(t: &Tokenizer, lps: &[TokenLogprob]) -> Value {
    let entry = |id: u32, lp: f32| {
        let (s, b) = token_string(t, id);
        json!({"token": s, "logprob": lp, "bytes": b})
    };
    Value::Array(
        lps.iter()
            .map(|l| {
                let mut e = entry(l.id, l.logprob);
                e["top_logprobs"] = l.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
                e
            })
            .collect(),
    )
}

/// The legacy completions `logprobs` object; `offset` is where the first token's text starts.
fn completion_logprobs(t: &Tokenizer, lps: &[TokenLogprob], mut offset: usize) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top = Vec::new();
    let mut text_offset = Vec::new();
    for l in lps {
        let (s, _) = token_string(t, l.id);
        text_offset.push(offset);
        offset += s.chars().count();
        tokens.push(s);
        token_logprobs.push(l.logprob);
        let mut m = Map::new();
        for &(id, lp) in &l.top {
            m.insert(token_string(t, id).0, lp.into());
        }
        top.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset})
}

/// A whole (non-streamed) answer. If the client goes away, this future is dropped with the
/// receiver, and the engine frees the slot at its next step.
async fn collect(mut meta: Meta, mut kind: Kind, mut rx: UnboundedReceiver<Event>) -> R<Response> {
    let (mut content, mut reasoning) = (String::new(), String::new());
    let mut lps = Vec::new();
    let mut take = |ps: Vec<Piece>, content: &mut String| {
        for p in ps {
            match p {
                Piece::Content(s) => content.push_str(&s),
                Piece::Reasoning(s) => reasoning.push_str(&s),
            }
        }
    };
    loop {
        let ev = tokio::select! {
            biased;
            e = meta.cut_short() => return Err(e),
            ev = rx.recv() => match ev {
                Some(ev) => ev,
                None => break,
            },
        };
        match ev {
            Event::Started { .. } => {}
            Event::Delta { text, logprob } => {
                match &mut kind {
                    Kind::Chat(p) => take(p.push(&text), &mut content),
                    Kind::Completion => content.push_str(&text),
                }
                lps.extend(logprob);
            }
            Event::Error { message, code } => return Err(engine_error(message, code)),
            Event::Done {
                finish,
                n_prompt,
                n_cached,
                n_generated,
                spec,
            } => {
                let usage = usage(n_prompt, n_cached, n_generated, spec);
                let want_lp = meta.params.logprobs.is_some();
                let t = &meta.tokenizer;
                let body = match &mut kind {
                    Kind::Chat(p) => {
                        let (rest, calls) = p.finish();
                        take(rest, &mut content);
                        let mut message = json!({"role": "assistant", "content": content});
                        if !reasoning.is_empty() {
                            message["reasoning_content"] = reasoning.clone().into();
                        }
                        if !calls.is_empty() {
                            if content.is_empty() {
                                message["content"] = Value::Null;
                            }
                            message["tool_calls"] = tool_calls_json(&calls, false);
                        }
                        let logprobs = if want_lp {
                            json!({"content": chat_logprobs(t, &lps)})
                        } else {
                            Value::Null
                        };
                        json!({
                            "id": meta.id, "object": "chat.completion", "created": meta.created,
                            "model": meta.model, "system_fingerprint": null,
                            "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                                         "finish_reason": finish_str(finish, &calls)}],
                            "usage": usage,
                        })
                    }
                    Kind::Completion => {
                        let logprobs = if want_lp {
                            completion_logprobs(t, &lps, 0)
                        } else {
                            Value::Null
                        };
                        json!({
                            "id": meta.id, "object": "text_completion", "created": meta.created,
                            "model": meta.model, "system_fingerprint": null,
                            "choices": [{"index": 0, "text": content, "logprobs": logprobs,
                                         "finish_reason": finish_str(finish, &[])}],
                            "usage": usage,
                        })
                    }
                };
                return Ok(json_response(StatusCode::OK, &body));
            }
        }
    }
    Err(ApiError::server(
        "the engine stopped before the request finished",
    ))
}

/// A streamed answer in progress.
struct Stream {
    meta: Meta,
    kind: Kind,
    rx: UnboundedReceiver<Event>,
    /// Log-probabilities of tokens whose text has not gone out in a chunk yet.
    pending_lp: Vec<TokenLogprob>,
    /// Characters of completion text sent so far (for `text_offset`).
    sent_chars: usize,
    done: bool,
}

impl Stream {
    fn new(meta: Meta, kind: Kind, rx: UnboundedReceiver<Event>) -> Stream {
        Stream {
            meta,
            kind,
            rx,
            pending_lp: Vec::new(),
            sent_chars: 0,
            done: false,
        }
    }

    fn event(out: &mut Vec<u8>, v: &Value) {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(v.to_string().as_bytes());
        out.extend_from_slice(b"\n\n");
    }

    /// One chunk object around `choice` (or `choices: []` with usage).
    fn chunk(&self, choice: Option<Value>, usage: Option<Value>) -> Value {
        let object = match self.kind {
            Kind::Chat(_) => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let mut v = json!({
            "id": self.meta.id, "object": object, "created": self.meta.created,
            "model": self.meta.model, "system_fingerprint": null,
            "choices": choice.map(|c| vec![c]).unwrap_or_default(),
        });
        if self.meta.params.include_usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        v
    }

    fn take_logprobs(&mut self) -> Value {
        if self.meta.params.logprobs.is_none() {
            return Value::Null;
        }
        let lps = std::mem::take(&mut self.pending_lp);
        let t = &self.meta.tokenizer;
        match self.kind {
            Kind::Chat(_) => json!({"content": chat_logprobs(t, &lps)}),
            Kind::Completion => completion_logprobs(t, &lps, self.sent_chars),
        }
    }

    fn chat_choice(&mut self, delta: Value, finish: Option<&str>) -> Value {
        let logprobs = self.take_logprobs();
        json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
    }

    fn text_choice(&mut self, text: &str, finish: Option<&str>) -> Value {
        let logprobs = self.take_logprobs();
        self.sent_chars += text.chars().count();
        json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish})
    }

    fn pieces(&mut self, ps: Vec<Piece>, out: &mut Vec<u8>) {
        for p in ps {
            let delta = match p {
                Piece::Content(s) => json!({"content": s}),
                Piece::Reasoning(s) => json!({"reasoning_content": s}),
            };
            let c = self.chat_choice(delta, None);
            Self::event(out, &self.chunk(Some(c), None));
        }
    }

    /// The next bytes to send; None after `[DONE]`.
    async fn next(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let mut out = Vec::new();
        while out.is_empty() {
            let ev = tokio::select! {
                biased;
                e = self.meta.cut_short() => {
                    Self::event(&mut out, &e.body());
                    out.extend_from_slice(b"data: [DONE]\n\n");
                    self.done = true;
                    break;
                }
                ev = self.rx.recv() => ev,
            };
            let Some(ev) = ev else {
                let e = ApiError::server("the engine stopped before the request finished");
                Self::event(&mut out, &e.body());
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.done = true;
                break;
            };
            match ev {
                Event::Started { .. } => {
                    if let Kind::Chat(_) = self.kind {
                        let c = self.chat_choice(json!({"role": "assistant", "content": ""}), None);
                        Self::event(&mut out, &self.chunk(Some(c), None));
                    }
                }
                Event::Delta { text, logprob } => {
                    self.pending_lp.extend(logprob);
                    match &mut self.kind {
                        Kind::Chat(p) => {
                            let ps = p.push(&text);
                            self.pieces(ps, &mut out);
                        }
                        Kind::Completion => {
                            if !text.is_empty() {
                                let c = self.text_choice(&text, None);
                                Self::event(&mut out, &self.chunk(Some(c), None));
                            }
                        }
                    }
                }
                Event::Error { message, code } => {
                    Self::event(&mut out, &engine_error(message, code).body());
                    out.extend_from_slice(b"data: [DONE]\n\n");
                    self.done = true;
                }
                Event::Done {
                    finish,
                    n_prompt,
                    n_cached,
                    n_generated,
                    spec,
                } => {
                    let last = match &mut self.kind {
                        Kind::Chat(p) => {
                            let (rest, calls) = p.finish();
                            self.pieces(rest, &mut out);
                            if !calls.is_empty() {
                                let d = json!({"tool_calls": tool_calls_json(&calls, true)});
                                let c = self.chat_choice(d, None);
                                Self::event(&mut out, &self.chunk(Some(c), None));
                            }
                            self.chat_choice(json!({}), Some(finish_str(finish, &calls)))
                        }
                        Kind::Completion => self.text_choice("", Some(finish_str(finish, &[]))),
                    };
                    Self::event(&mut out, &self.chunk(Some(last), None));
                    if self.meta.params.include_usage {
                        let u = usage(n_prompt, n_cached, n_generated, spec);
                        Self::event(&mut out, &self.chunk(None, Some(u)));
                    }
                    out.extend_from_slice(b"data: [DONE]\n\n");
                    self.done = true;
                }
            }
        }
        Some(Bytes::from(out))
    }
}

/// The SSE response. When the client disconnects, hyper drops the body, and with it the
/// receiver: the engine sees that at its next step and frees the slot.
fn stream_response(s: Stream) -> Response {
    let body = futures_util::stream::unfold(s, |mut s| async move {
        let b = s.next().await?;
        Some((Ok::<Bytes, Infallible>(b), s))
    });
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}
