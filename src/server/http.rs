//! Routes and handlers: each request is checked, turned into prompt tokens (chat template and
//! tokenizer on a blocking thread), queued for the engine thread, and answered from the
//! events it sends back: collected into one JSON body, or streamed as server-sent events in
//! OpenAI's chunk format ending with `data: [DONE]`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::Poll;
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

use llguidance::Matcher;

use super::api::{self, json_response, ApiError, GenParams, Prompt};
use super::constrain::{Constrainer, Requested};
use super::output::{OutputParser, Piece, ToolCall};
use super::random_id;
use super::scheduler::{
    EmbedJob, Event, Finish, Job, Loaded, Scheduler, Shared, SubmitError, TokenLogprob,
};
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
    /// How `/v1/embeddings` pools (`--pooling`).
    pub pooling: super::Pooling,
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

mod responses;

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/", get(web_page))
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/embeddings", post(embeddings))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/props", get(props))
        .route("/slots", get(slots))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            log_rejections,
        ))
        .with_state(state)
}

/// Every error answer goes to stderr with its status and reason, and counts as `rejected`
/// in `/metrics` (those of a request the engine failed count as `error` or `timeout`).
async fn log_rejections(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let what = format!("{} {}", req.method(), req.uri().path());
    let resp = next.run(req).await;
    if let Some(r) = resp.extensions().get::<api::Rejection>() {
        if !r.from_engine {
            st.sched.shared.metrics.count("rejected");
        }
        let status = resp.status();
        eprintln!(
            "lathe serve: {what}: {} {}: {}",
            status.as_u16(),
            status.canonical_reason().unwrap_or(""),
            r.reason
        );
    }
    resp
}

/// `--api-key`: every route but /health and the chat page wants `Authorization: Bearer
/// <key>` (a browser sends none when it opens a page; the page sends the key it is given).
async fn auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let open = matches!(req.uri().path(), "/health" | "/");
        if !open && !bearer_matches(req.headers(), key) {
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

/// The chat page: one self-contained HTML file (no CDN), embedded in the binary.
async fn web_page() -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("web/index.html"),
    )
        .into_response()
}

/// Prometheus' scrape ([`super::metrics`]): the gauges read now, then every metric.
async fn metrics(State(st): State<AppState>) -> Response {
    let sh = &st.sched.shared;
    let m = &sh.metrics;
    m.queue_depth.set(sh.queued.load(Ordering::Relaxed) as i64);
    m.active_slots.set(sh.active.load(Ordering::Relaxed) as i64);
    (
        StatusCode::OK,
        // The OpenMetrics text format prometheus-client writes (Prometheus reads it).
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.encode(),
    )
        .into_response()
}

/// llama-server's `POST /tokenize`: `{"content", "add_special", "parse_special",
/// "with_pieces"}` to `{"tokens": [...]}` (ids, or `{"id", "piece"}` with `with_pieces`).
async fn tokenize(State(st): State<AppState>, req: Request) -> Response {
    tokenize_inner(st, req)
        .await
        .unwrap_or_else(|e| e.into_response())
}

async fn tokenize_inner(st: AppState, req: Request) -> R<Response> {
    let body = read_json(&st.cfg, req).await?;
    let loaded = ready(&st)?;
    let f = api::Fields::of(&body)?;
    let content = f
        .string("content")?
        .ok_or_else(|| ApiError::invalid("content", "`content` (a string) is required"))?
        .to_string();
    let add_special = f.boolean("add_special")?.unwrap_or(false);
    let parse_special = f.boolean("parse_special")?.unwrap_or(true);
    let with_pieces = f.boolean("with_pieces")?.unwrap_or(false);
    let tok = loaded.tokenizer.clone();
    let ids = tokio::task::spawn_blocking(move || {
        match add_special {
            true => tok.encode_with_bos(&content, parse_special),
            false => tok.encode(&content, parse_special),
        }
        .map(|ids| (ids, tok))
    })
    .await
    .map_err(|e| ApiError::server(format!("tokenizing failed: {e}")))?
    .map_err(|e| ApiError::invalid("content", e.to_string()));
    let (ids, tok) = ids?;
    let tokens: Vec<Value> = ids
        .iter()
        .map(|&id| match with_pieces {
            true => {
                let bytes = tok.token_bytes(id).unwrap_or(&[]);
                let piece = match std::str::from_utf8(bytes) {
                    Ok(s) => Value::from(s),
                    // llama-server gives a piece that is not UTF-8 as its byte values.
                    Err(_) => Value::from(bytes.to_vec()),
                };
                json!({"id": id, "piece": piece})
            }
            false => Value::from(id),
        })
        .collect();
    Ok(json_response(StatusCode::OK, &json!({"tokens": tokens})))
}

/// llama-server's `POST /detokenize`: `{"tokens": [ids]}` to `{"content"}`.
async fn detokenize(State(st): State<AppState>, req: Request) -> Response {
    detokenize_inner(st, req)
        .await
        .unwrap_or_else(|e| e.into_response())
}

async fn detokenize_inner(st: AppState, req: Request) -> R<Response> {
    let body = read_json(&st.cfg, req).await?;
    let loaded = ready(&st)?;
    let f = api::Fields::of(&body)?;
    let bad = || ApiError::invalid("tokens", "`tokens` must be a list of token ids");
    let vocab = loaded.tokenizer.vocab_size();
    let ids = f
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or_else(bad)?
        .iter()
        .map(|t| match t.as_u64() {
            Some(id) if (id as usize) < vocab => Ok(id as u32),
            Some(id) => Err(ApiError::invalid(
                "tokens",
                format!("token {id} is not below the vocabulary size {vocab}"),
            )),
            None => Err(bad()),
        })
        .collect::<R<Vec<u32>>>()?;
    let content = loaded.tokenizer.decode(&ids);
    Ok(json_response(StatusCode::OK, &json!({"content": content})))
}

/// llama-server's `GET /props`: the server's settings.
async fn props(State(st): State<AppState>) -> Response {
    let loaded = match ready(&st) {
        Ok(l) => l,
        Err(e) => return e.into_response(),
    };
    let t = &loaded.tokenizer;
    let text = |id: Option<u32>| id.map(|i| t.decode(&[i]));
    let d = crate::sample::SamplerConfig::default();
    json_response(
        StatusCode::OK,
        &json!({
            "model_alias": st.cfg.model_name,
            "total_slots": st.cfg.n_slots,
            "n_ctx": st.cfg.ctx,
            "vocab_size": loaded.vocab,
            "bos_token": text(t.bos_id()),
            "eos_token": text(t.eos_id()),
            "build_info": concat!("lathe ", env!("CARGO_PKG_VERSION")),
            "default_generation_settings": {
                "n_ctx": st.cfg.ctx,
                "params": {
                    "temperature": d.temperature,
                    "top_k": d.top_k,
                    "top_p": d.top_p,
                    "min_p": d.min_p,
                    "repeat_penalty": d.repeat_penalty,
                    "presence_penalty": d.presence_penalty,
                    "frequency_penalty": d.frequency_penalty,
                    "repeat_last_n": d.penalty_window,
                },
            },
        }),
    )
}

/// llama-server's `GET /slots`: each slot, as of the end of the engine's last step.
async fn slots(State(st): State<AppState>) -> Response {
    if let Err(e) = ready(&st) {
        return e.into_response();
    }
    let info = st
        .sched
        .shared
        .slots
        .lock()
        .map(|s| s.clone())
        .unwrap_or_default();
    let slots: Vec<Value> = info
        .iter()
        .enumerate()
        .map(|(id, s)| {
            json!({
                "id": id,
                "n_ctx": st.cfg.ctx,
                "is_processing": s.task.is_some(),
                "id_task": s.task,
                "n_tokens": s.n_tokens,
                "n_prompt_tokens": s.n_prompt,
                "n_cached_tokens": s.n_cached,
                "n_decoded": s.n_generated,
                "prefilling": s.prefilling,
                "speculative": s.speculating,
                "constrained": s.constrained,
            })
        })
        .collect();
    json_response(StatusCode::OK, &Value::Array(slots))
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
    let id = random_id("chatcmpl-", 24);
    let (meta, kind, events) = chat_submit(&st, req, id).await?;
    answer(meta, kind, events).await
}

/// A chat request rendered, tokenized and queued (the Responses API's too).
async fn chat_submit(st: &AppState, req: api::ChatRequest, id: String) -> R<(Meta, Kind, Events)> {
    let loaded = ready(st)?;
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
    // A constrained reply closes the reasoning block the prompt opened first, so what the
    // constraint shapes is the content.
    let prefix = match st.cfg.reasoning && think_open {
        true => "</think>\n\n",
        false => "",
    };
    let parser = OutputParser::new(st.cfg.reasoning, think_open, req.tools);
    let model = req.model.unwrap_or_else(|| st.cfg.model_name.clone());
    let ids = (ids, Some(conversation));
    let kind = Kind::Chat(parser);
    let (meta, events) = submit(st, (id, model), ids, req.params, ("messages", prefix)).await?;
    Ok((meta, kind, events))
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
    let kind = Kind::Completion;
    let id = (random_id("cmpl-", 24), model);
    let (meta, events) = submit(&st, id, ids, req.params, ("prompt", "")).await?;
    answer(meta, kind, events).await
}

/// OpenAI's `POST /v1/embeddings`: per input the final-norm hidden states of its tokens
/// (BOS as for a completion's prompt), pooled (`--pooling`) and L2-normalised.
async fn embeddings(State(st): State<AppState>, req: Request) -> Response {
    embeddings_inner(st, req)
        .await
        .unwrap_or_else(|e| e.into_response())
}

async fn embeddings_inner(st: AppState, req: Request) -> R<Response> {
    let body = read_json(&st.cfg, req).await?;
    let loaded = ready(&st)?;
    let req = api::embedding_request(&body, loaded.vocab)?;
    let n_inputs = req.inputs.len();
    let at = move |i: usize| match n_inputs {
        1 => "input".to_string(),
        _ => format!("input[{i}]"),
    };
    let limits = (prompt_limit(&st.cfg), st.cfg.ctx);
    let tokenizer = loaded.tokenizer.clone();
    let inputs = req.inputs;
    let ids = tokio::task::spawn_blocking(move || {
        inputs
            .into_iter()
            .enumerate()
            .map(|(i, p)| match p {
                Prompt::Tokens(t) if t.len() > limits.0 => {
                    Err(too_long(&t.len().to_string(), limits, &at(i)))
                }
                Prompt::Tokens(t) => Ok(t),
                Prompt::Text(s) => encode_bounded(&tokenizer, &s, limits, &at(i)),
            })
            .collect::<R<Vec<Vec<u32>>>>()
    })
    .await
    .map_err(|e| ApiError::server(format!("tokenizing failed: {e}")))??;
    let n_tokens: usize = ids.iter().map(Vec::len).sum();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job = EmbedJob {
        inputs: ids.clone(),
        deadline: Instant::now() + st.cfg.timeout,
        reply: tx,
    };
    st.sched.embed(job).map_err(queue_error)?;
    let hidden = rx
        .await
        .map_err(|_| ApiError::server("the engine stopped before the request finished"))?
        .map_err(|e| engine_error(&st.sched.shared, e, "internal"))?;
    let mut data = Vec::with_capacity(hidden.len());
    for (i, (h, t)) in hidden.iter().zip(&ids).enumerate() {
        let width = h.len() / t.len().max(1);
        if let Some(d) = req.dimensions.filter(|&d| d != width) {
            return Err(ApiError::invalid(
                "dimensions",
                format!(
                    "`dimensions` is {d}: this model's embeddings have {width} (they are not \
                     shortened)"
                ),
            ));
        }
        let e = st.cfg.pooling.embed(h, width);
        let embedding = match req.encoding {
            api::Encoding::Float => Value::from(e),
            api::Encoding::Base64 => {
                use base64::Engine as _;
                let bytes: Vec<u8> = e.iter().flat_map(|x| x.to_le_bytes()).collect();
                base64::engine::general_purpose::STANDARD
                    .encode(bytes)
                    .into()
            }
        };
        data.push(json!({"object": "embedding", "index": i, "embedding": embedding}));
    }
    let model = req.model.unwrap_or_else(|| st.cfg.model_name.clone());
    Ok(json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}),
    ))
}

/// The answer to a job the queue did not take.
fn queue_error(e: SubmitError) -> ApiError {
    match e {
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
    }
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

/// Which endpoint a response is for (a chat's parser: one per choice).
#[derive(Clone)]
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
    /// The engine's shared state (`/metrics`).
    shared: Arc<Shared>,
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

/// The matcher of a request's constraint (`prefix`: see [`Constraint::lark`]), compiled on a
/// blocking thread; the first such request also builds the vocabulary's token trie. A
/// grammar or schema that does not compile is a 400 naming its field.
async fn compile(st: &AppState, r: Requested, prefix: &'static str) -> R<Matcher> {
    let shared = st.sched.shared.clone();
    tokio::task::spawn_blocking(move || {
        let loaded = shared
            .loaded
            .get()
            .ok_or_else(|| ApiError::server("the model is not loaded"))?;
        let c = shared
            .constrainer
            .get_or_init(|| Constrainer::new(&loaded.tokenizer, loaded.vocab));
        let c = c
            .as_ref()
            .map_err(|e| ApiError::server(format!("structured output is unavailable: {e}")))?;
        c.matcher(&r.constraint, prefix)
            .map_err(|e| ApiError::invalid(r.param, format!("`{}`: {e}", r.param)))
    })
    .await
    .map_err(|e| ApiError::server(format!("compiling the output constraint failed: {e}")))?
}

/// Checks the prompt's length and queues the job (one per choice) as `id`, for `model`.
/// `ids`: the prompt, and where its slot checkpoint goes when not at its end
/// (`Job::checkpoint`); `prefix`: what a constrained reply starts with ([`compile`]).
async fn submit(
    st: &AppState,
    (id, model): (String, String),
    (ids, checkpoint): (Vec<u32>, Option<usize>),
    params: GenParams,
    (prompt_param, prefix): (&str, &'static str),
) -> R<(Meta, Events)> {
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
    if params.n > st.cfg.n_slots {
        return Err(ApiError::invalid(
            "n",
            format!(
                "`n` is {}: each choice takes a slot, and this server has {} (--parallel)",
                params.n, st.cfg.n_slots
            ),
        ));
    }
    let room = ctx - ids.len();
    let max_tokens = params.max_tokens.unwrap_or(room).min(room);
    let constraint = match &params.constraint {
        Some(r) => Some(compile(st, r.clone(), prefix).await?),
        None => None,
    };
    let deadline = Instant::now() + st.cfg.timeout;
    let mut rxs = Vec::with_capacity(params.n);
    let mut jobs: Vec<Job> = (0..params.n)
        .map(|i| {
            let (tx, rx) = unbounded_channel();
            rxs.push(Some(rx));
            let mut sampler = params.sampler.clone();
            sampler.seed = api::choice_seed(sampler.seed, i);
            Job {
                id: id.clone(),
                checkpoint: checkpoint.unwrap_or(ids.len()),
                prompt: ids.clone(),
                max_tokens,
                sampler,
                stop: params.stop.clone(),
                logprobs: params.logprobs,
                logit_bias: params.logit_bias.clone(),
                ignore_eos: params.ignore_eos,
                // Every choice under the same constraint, each with its own matcher.
                constraint: constraint.clone(),
                deadline,
                events: tx,
                siblings: Vec::new(),
            }
        })
        .collect();
    let mut job = jobs.remove(0);
    job.siblings = jobs;
    st.sched.submit(job).map_err(queue_error)?;
    let meta = Meta {
        id,
        created: unix_now(),
        model,
        tokenizer: loaded.tokenizer.clone(),
        params,
        hard_stop: st.hard_stop.clone(),
        cut: st.cut.clone(),
        shared: st.sched.shared.clone(),
    };
    Ok((meta, Events(rxs)))
}

/// The answer of a chat or completion request: streamed or whole.
async fn answer(meta: Meta, kind: Kind, events: Events) -> R<Response> {
    if meta.params.stream {
        Ok(stream_response(Stream::new(meta, kind, events)))
    } else {
        collect(meta, kind, events).await
    }
}

/// The events of a request's choices, merged.
struct Events(Vec<Option<UnboundedReceiver<Event>>>);

impl Events {
    /// The next event of any choice with its index; `(i, None)` when choice i's channel
    /// closes (it is not read again); `None` once all are closed.
    async fn recv(&mut self) -> Option<(usize, Option<Event>)> {
        std::future::poll_fn(|cx| {
            let mut open = false;
            for (i, slot) in self.0.iter_mut().enumerate() {
                let Some(rx) = slot else { continue };
                open = true;
                match rx.poll_recv(cx) {
                    Poll::Ready(Some(ev)) => return Poll::Ready(Some((i, Some(ev)))),
                    Poll::Ready(None) => {
                        *slot = None;
                        return Poll::Ready(Some((i, None)));
                    }
                    Poll::Pending => {}
                }
            }
            match open {
                true => Poll::Pending,
                false => Poll::Ready(None),
            }
        })
        .await
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

/// What a request's choices add up to once each is done: the prompt counted once (the
/// first choice's, whose cache the others share), the completion tokens and speculation of
/// every choice.
#[derive(Default)]
struct Totals {
    n_prompt: usize,
    n_cached: usize,
    n_generated: usize,
    spec: Option<SpecStats>,
}

impl Totals {
    fn add(
        &mut self,
        i: usize,
        n_prompt: usize,
        n_cached: usize,
        n_generated: usize,
        spec: Option<SpecStats>,
    ) {
        if i == 0 {
            (self.n_prompt, self.n_cached) = (n_prompt, n_cached);
        }
        self.n_generated += n_generated;
        if let Some(s) = spec {
            let t = self.spec.get_or_insert_with(SpecStats::default);
            t.drafted += s.drafted;
            t.accepted += s.accepted;
            t.verify_passes += s.verify_passes;
            t.tokens += s.tokens;
        }
    }

    fn usage(&self) -> Value {
        usage(self.n_prompt, self.n_cached, self.n_generated, self.spec)
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

/// The answer to an engine's `Event::Error`, counted in `/metrics` as `timeout` or `error`.
fn engine_error(shared: &Shared, message: String, code: &'static str) -> ApiError {
    let mut e = if code == "timeout" {
        ApiError::new(StatusCode::GATEWAY_TIMEOUT, "server_error", message).with_code("timeout")
    } else {
        ApiError::server(message)
    };
    shared.metrics.count(if code == "timeout" {
        "timeout"
    } else {
        "error"
    });
    e.from_engine = true;
    e
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

/// One choice of a whole answer, as it comes in.
struct Whole {
    kind: Kind,
    content: String,
    reasoning: String,
    lps: Vec<TokenLogprob>,
    /// Set by its `Done`: why it ended and the tool calls parsed from it.
    done: Option<(Finish, Vec<ToolCall>)>,
}

impl Whole {
    fn take(&mut self, ps: Vec<Piece>) {
        for p in ps {
            match p {
                Piece::Content(s) => self.content.push_str(&s),
                Piece::Reasoning(s) => self.reasoning.push_str(&s),
            }
        }
    }

    /// The choice's JSON in a chat or completion answer.
    fn json(&self, index: usize, t: &Tokenizer, want_lp: bool) -> Value {
        let (finish, calls) = match &self.done {
            Some((f, c)) => (*f, c.as_slice()),
            None => (Finish::Stop, &[][..]),
        };
        match &self.kind {
            Kind::Chat(_) => {
                let mut message = json!({"role": "assistant", "content": self.content});
                if !self.reasoning.is_empty() {
                    message["reasoning_content"] = self.reasoning.clone().into();
                }
                if !calls.is_empty() {
                    if self.content.is_empty() {
                        message["content"] = Value::Null;
                    }
                    message["tool_calls"] = tool_calls_json(calls, false);
                }
                let logprobs = match want_lp {
                    true => json!({"content": chat_logprobs(t, &self.lps)}),
                    false => Value::Null,
                };
                json!({"index": index, "message": message, "logprobs": logprobs,
                       "finish_reason": finish_str(finish, calls)})
            }
            Kind::Completion => {
                let logprobs = match want_lp {
                    true => completion_logprobs(t, &self.lps, 0),
                    false => Value::Null,
                };
                json!({"index": index, "text": self.content, "logprobs": logprobs,
                       "finish_reason": finish_str(finish, &[])})
            }
        }
    }
}

/// Every choice of a request, whole: once each is done. If the client goes away, this
/// future is dropped with the receivers, and the engine frees the slots at its next step.
async fn gather(meta: &mut Meta, kind: &Kind, mut rx: Events) -> R<(Vec<Whole>, Totals)> {
    let mut choices: Vec<Whole> = (0..rx.len())
        .map(|_| Whole {
            kind: kind.clone(),
            content: String::new(),
            reasoning: String::new(),
            lps: Vec::new(),
            done: None,
        })
        .collect();
    let mut totals = Totals::default();
    let stopped = || ApiError::server("the engine stopped before the request finished");
    loop {
        let (i, ev) = tokio::select! {
            biased;
            e = meta.cut_short() => return Err(e),
            ev = rx.recv() => match ev {
                Some(ev) => ev,
                None => break,
            },
        };
        let c = &mut choices[i];
        match ev {
            None if c.done.is_none() => return Err(stopped()),
            None | Some(Event::Started { .. }) => {}
            Some(Event::Delta { text, logprob }) => {
                match &mut c.kind {
                    Kind::Chat(p) => {
                        let ps = p.push(&text);
                        c.take(ps);
                    }
                    Kind::Completion => c.content.push_str(&text),
                }
                c.lps.extend(logprob);
            }
            Some(Event::Error { message, code }) => {
                return Err(engine_error(&meta.shared, message, code))
            }
            Some(Event::Done {
                finish,
                n_prompt,
                n_cached,
                n_generated,
                spec,
            }) => {
                totals.add(i, n_prompt, n_cached, n_generated, spec);
                let calls = match &mut c.kind {
                    Kind::Chat(p) => {
                        let (rest, calls) = p.finish();
                        c.take(rest);
                        calls
                    }
                    Kind::Completion => Vec::new(),
                };
                c.done = Some((finish, calls));
            }
        }
    }
    if choices.iter().any(|c| c.done.is_none()) {
        return Err(stopped());
    }
    Ok((choices, totals))
}

/// A whole (non-streamed) chat or completion answer.
async fn collect(mut meta: Meta, kind: Kind, rx: Events) -> R<Response> {
    let (choices, totals) = gather(&mut meta, &kind, rx).await?;
    let want_lp = meta.params.logprobs.is_some();
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| c.json(i, &meta.tokenizer, want_lp))
        .collect();
    let object = match kind {
        Kind::Chat(_) => "chat.completion",
        Kind::Completion => "text_completion",
    };
    let body = json!({
        "id": meta.id, "object": object, "created": meta.created,
        "model": meta.model, "system_fingerprint": null,
        "choices": choices,
        "usage": totals.usage(),
    });
    Ok(json_response(StatusCode::OK, &body))
}

/// A streamed answer in progress.
struct Stream {
    meta: Meta,
    chat: bool,
    rx: Events,
    choices: Vec<Streamed>,
    totals: Totals,
    /// Choices not done yet.
    open: usize,
    done: bool,
}

/// One choice of a streamed answer.
struct Streamed {
    kind: Kind,
    /// Log-probabilities of tokens whose text has not gone out in a chunk yet.
    pending_lp: Vec<TokenLogprob>,
    /// Characters of completion text sent so far (for `text_offset`).
    sent_chars: usize,
    done: bool,
}

impl Stream {
    fn new(meta: Meta, kind: Kind, rx: Events) -> Stream {
        let n = rx.len();
        Stream {
            meta,
            chat: matches!(kind, Kind::Chat(_)),
            choices: (0..n)
                .map(|_| Streamed {
                    kind: kind.clone(),
                    pending_lp: Vec::new(),
                    sent_chars: 0,
                    done: false,
                })
                .collect(),
            rx,
            totals: Totals::default(),
            open: n,
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
        let object = match self.chat {
            true => "chat.completion.chunk",
            false => "text_completion",
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

    fn take_logprobs(&mut self, i: usize) -> Value {
        if self.meta.params.logprobs.is_none() {
            return Value::Null;
        }
        let c = &mut self.choices[i];
        let lps = std::mem::take(&mut c.pending_lp);
        let t = &self.meta.tokenizer;
        match self.chat {
            true => json!({"content": chat_logprobs(t, &lps)}),
            false => completion_logprobs(t, &lps, c.sent_chars),
        }
    }

    fn chat_choice(&mut self, i: usize, delta: Value, finish: Option<&str>) -> Value {
        let logprobs = self.take_logprobs(i);
        json!({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
    }

    fn text_choice(&mut self, i: usize, text: &str, finish: Option<&str>) -> Value {
        let logprobs = self.take_logprobs(i);
        self.choices[i].sent_chars += text.chars().count();
        json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish})
    }

    fn pieces(&mut self, i: usize, ps: Vec<Piece>, out: &mut Vec<u8>) {
        for p in ps {
            let delta = match p {
                Piece::Content(s) => json!({"content": s}),
                Piece::Reasoning(s) => json!({"reasoning_content": s}),
            };
            let c = self.chat_choice(i, delta, None);
            Self::event(out, &self.chunk(Some(c), None));
        }
    }

    /// An error event and `[DONE]`: the end of the stream.
    fn fail(&mut self, out: &mut Vec<u8>, e: &ApiError) {
        Self::event(out, &e.body());
        out.extend_from_slice(b"data: [DONE]\n\n");
        self.done = true;
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
                    self.fail(&mut out, &e);
                    break;
                }
                ev = self.rx.recv() => ev,
            };
            let stopped = || ApiError::server("the engine stopped before the request finished");
            let Some((i, ev)) = ev else {
                self.fail(&mut out, &stopped());
                break;
            };
            let Some(ev) = ev else {
                if !self.choices[i].done {
                    self.fail(&mut out, &stopped());
                }
                continue;
            };
            match ev {
                Event::Started { .. } => {
                    if self.chat {
                        let d = json!({"role": "assistant", "content": ""});
                        let c = self.chat_choice(i, d, None);
                        Self::event(&mut out, &self.chunk(Some(c), None));
                    }
                }
                Event::Delta { text, logprob } => {
                    self.choices[i].pending_lp.extend(logprob);
                    match &mut self.choices[i].kind {
                        Kind::Chat(p) => {
                            let ps = p.push(&text);
                            self.pieces(i, ps, &mut out);
                        }
                        Kind::Completion => {
                            if !text.is_empty() {
                                let c = self.text_choice(i, &text, None);
                                Self::event(&mut out, &self.chunk(Some(c), None));
                            }
                        }
                    }
                }
                Event::Error { message, code } => {
                    let e = engine_error(&self.meta.shared, message, code);
                    self.fail(&mut out, &e);
                }
                Event::Done {
                    finish,
                    n_prompt,
                    n_cached,
                    n_generated,
                    spec,
                } => {
                    let last = match &mut self.choices[i].kind {
                        Kind::Chat(p) => {
                            let (rest, calls) = p.finish();
                            self.pieces(i, rest, &mut out);
                            if !calls.is_empty() {
                                let d = json!({"tool_calls": tool_calls_json(&calls, true)});
                                let c = self.chat_choice(i, d, None);
                                Self::event(&mut out, &self.chunk(Some(c), None));
                            }
                            self.chat_choice(i, json!({}), Some(finish_str(finish, &calls)))
                        }
                        Kind::Completion => self.text_choice(i, "", Some(finish_str(finish, &[]))),
                    };
                    Self::event(&mut out, &self.chunk(Some(last), None));
                    self.choices[i].done = true;
                    self.totals.add(i, n_prompt, n_cached, n_generated, spec);
                    self.open -= 1;
                    if self.open == 0 {
                        if self.meta.params.include_usage {
                            let u = self.totals.usage();
                            Self::event(&mut out, &self.chunk(None, Some(u)));
                        }
                        out.extend_from_slice(b"data: [DONE]\n\n");
                        self.done = true;
                    }
                }
            }
        }
        Some(Bytes::from(out))
    }
}

/// The SSE response. When the client disconnects, hyper drops the body, and with it the
/// receiver: the engine sees that at its next step and frees the slot.
fn stream_response(s: Stream) -> Response {
    sse_response(futures_util::stream::unfold(s, |mut s| async move {
        let b = s.next().await?;
        Some((Ok::<Bytes, Infallible>(b), s))
    }))
}

/// A `text/event-stream` answer of `body`'s events, unbuffered by proxies
/// (`X-Accel-Buffering: no`).
pub(super) fn sse_response(
    body: impl futures_util::Stream<Item = std::result::Result<Bytes, Infallible>> + Send + 'static,
) -> Response {
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
