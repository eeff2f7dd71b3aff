//! The OpenAI API's request fields and error shape. Requests are read from a plain JSON value
//! field by field, not by a derived deserializer, so every error names the field it is about
//! (`param`) the way OpenAI's own errors do, and fields this server does not know are ignored
//! as OpenAI ignores them.
//!
//! Sampling fields a request leaves out take `SamplerConfig::default()`'s values (llama.cpp's
//! defaults: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), as llama.cpp's server does;
//! OpenAI's own defaults are temperature 1 and top_p 1. Extensions: `top_k`, `min_p`,
//! `repeat_penalty`, `ignore_eos`, `chat_template_kwargs`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use super::constrain::{gbnf_to_lark, Constraint, Requested};
use crate::sample::SamplerConfig;

/// Most stop strings a request may give.
const MAX_STOP: usize = 16;
/// Most alternatives per token `top_logprobs` / `logprobs` may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `server_error`, ...
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// The engine failed the request after it was queued (counted as an error, not a
    /// rejection, in `/metrics`).
    pub from_engine: bool,
}

/// Put on every error response ([`ApiError`]'s): what the request log and `/metrics` read.
#[derive(Clone, Debug)]
pub struct Rejection {
    pub reason: String,
    pub from_engine: bool,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            from_engine: false,
        }
    }

    /// 400 about one field of the request.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 400 about the request as a whole.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn server(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = json_response(self.status, &self.body());
        let reason = match &self.param {
            Some(p) => format!("{} (param {p})", self.message),
            None => self.message,
        };
        r.extensions_mut().insert(Rejection {
            reason,
            from_engine: self.from_engine,
        });
        r
    }
}

/// A JSON response with the right content type.
pub fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

type R<T> = std::result::Result<T, ApiError>;

/// Generation settings shared by both endpoints.
#[derive(Clone, Debug)]
pub struct GenParams {
    /// `max_tokens` / `max_completion_tokens`; None = up to the context length.
    pub max_tokens: Option<usize>,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Log-probabilities: None = off; Some(k) = the chosen token's and the k best.
    pub logprobs: Option<usize>,
    /// `logit_bias`: (token id, added to its logit).
    pub logit_bias: Vec<(u32, f32)>,
    /// Extension (llama.cpp's): go on through end-of-generation tokens, to `max_tokens`.
    pub ignore_eos: bool,
    /// Structured output: what the reply must follow.
    pub constraint: Option<Requested>,
    /// Choices to generate (`n`), each from the same prompt.
    pub n: usize,
}

/// The sampling seed of choice `i` of a request seeded with `seed`: `seed` itself for the
/// first (so `n = 1` is what it always was), then splitmix64 (Steele et al., the
/// `SplittableRandom` finaliser) of `seed` stepped `i` times by the golden-ratio increment:
/// reproducible for a given seed, and a different stream per choice.
pub fn choice_seed(seed: u64, i: usize) -> u64 {
    if i == 0 {
        return seed;
    }
    let mut z = seed.wrapping_add((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A request's fields, absent and `null` alike read as "not given".
pub struct Fields<'a>(pub &'a Map<String, Value>);

impl<'a> Fields<'a> {
    /// The body as an object, or the 400 that says it is not one.
    pub fn of(body: &'a Value) -> R<Fields<'a>> {
        body.as_object()
            .map(Fields)
            .ok_or_else(|| ApiError::bad_request("the request body must be a JSON object"))
    }

    pub fn get(&self, k: &str) -> Option<&'a Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    pub fn number(&self, k: &str, lo: f64, hi: f64) -> R<Option<f32>> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        match v.as_f64() {
            Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(Some(x as f32)),
            Some(x) => Err(ApiError::invalid(
                k,
                format!("`{k}` is {x}; it must be between {lo} and {hi}"),
            )),
            None => Err(ApiError::invalid(k, format!("`{k}` must be a number"))),
        }
    }

    pub fn uint(&self, k: &str) -> R<Option<u64>> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        v.as_u64()
            .map(Some)
            .ok_or_else(|| ApiError::invalid(k, format!("`{k}` must be a non-negative integer")))
    }

    pub fn boolean(&self, k: &str) -> R<Option<bool>> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| ApiError::invalid(k, format!("`{k}` must be true or false")))
    }

    pub fn string(&self, k: &str) -> R<Option<&'a str>> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        v.as_str()
            .map(Some)
            .ok_or_else(|| ApiError::invalid(k, format!("`{k}` must be a string")))
    }

    pub fn object(&self, k: &str) -> R<Option<&'a Map<String, Value>>> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        v.as_object()
            .map(Some)
            .ok_or_else(|| ApiError::invalid(k, format!("`{k}` must be an object")))
    }
}

/// Which API a request came through: they spell `logprobs` differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
}

/// Reads the generation fields common to both endpoints. `vocab` bounds `logit_bias` ids.
pub fn gen_params(f: &Fields, api: Api, vocab: usize, default_seed: u64) -> R<GenParams> {
    // The bound above 1 (`--parallel`: each choice takes a slot) is checked where the
    // server's settings are known.
    let n = match f.uint("n")? {
        Some(0) => return Err(ApiError::invalid("n", "`n` must be at least 1")),
        Some(n) => n.min(usize::MAX as u64) as usize,
        None => 1,
    };
    if let Some(b) = f.uint("best_of")? {
        if b != 1 {
            return Err(ApiError::invalid("best_of", "`best_of` must be 1"));
        }
    }
    let max_tokens = match (f.uint("max_completion_tokens")?, f.uint("max_tokens")?) {
        (Some(m), _) | (None, Some(m)) => Some(m),
        (None, None) => None,
    };
    if max_tokens == Some(0) {
        let param = if f.get("max_completion_tokens").is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        return Err(ApiError::invalid(
            param,
            format!("`{param}` must be at least 1"),
        ));
    }
    let d = SamplerConfig::default();
    let seed = match f.get("seed") {
        None => default_seed,
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(u), _) => u,
            (None, Some(i)) => i as u64,
            _ => return Err(ApiError::invalid("seed", "`seed` must be an integer")),
        },
    };
    // Any number is read here; `SamplerConfig::check` says which are allowed, for the CLI too.
    let any = |k: &str| f.number(k, f64::MIN, f64::MAX);
    let sampler = SamplerConfig {
        temperature: any("temperature")?.unwrap_or(d.temperature),
        top_k: f
            .uint("top_k")?
            .map(|k| k.min(u32::MAX as u64) as usize)
            .unwrap_or(d.top_k),
        top_p: any("top_p")?.unwrap_or(d.top_p),
        min_p: any("min_p")?.unwrap_or(d.min_p),
        repeat_penalty: any("repeat_penalty")?.unwrap_or(d.repeat_penalty),
        presence_penalty: any("presence_penalty")?.unwrap_or(d.presence_penalty),
        frequency_penalty: any("frequency_penalty")?.unwrap_or(d.frequency_penalty),
        penalty_window: d.penalty_window,
        seed,
    };
    sampler
        .check()
        .map_err(|e| ApiError::invalid(e.field, format!("`{}` {e}", e.field)))?;
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            if a.len() > MAX_STOP {
                return Err(ApiError::invalid(
                    "stop",
                    format!("`stop` has {} strings; at most {MAX_STOP}", a.len()),
                ));
            }
            a.iter()
                .map(|s| {
                    s.as_str().map(String::from).ok_or_else(|| {
                        ApiError::invalid("stop", "`stop` must be a string or a list of strings")
                    })
                })
                .collect::<R<_>>()?
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "`stop` must be a string or a list of strings",
            ))
        }
    };
    let stream = f.boolean("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        Some(o) => Fields(o).boolean("include_usage").map_err(|mut e| {
            e.param = Some("stream_options.include_usage".into());
            e
        })?,
        None => None,
    }
    .unwrap_or(false);
    let logprobs = match api {
        Api::Chat => {
            let on = f.boolean("logprobs")?.unwrap_or(false);
            let top = f.uint("top_logprobs")?;
            match (on, top) {
                (false, Some(_)) => {
                    return Err(ApiError::invalid(
                        "top_logprobs",
                        "`top_logprobs` needs `logprobs` set to true",
                    ))
                }
                (false, None) => None,
                (true, t) => Some(t.unwrap_or(0) as usize),
            }
        }
        Api::Completions => f.uint("logprobs")?.map(|k| k as usize),
    };
    if let Some(k) = logprobs {
        if k > MAX_TOP_LOGPROBS {
            let param = if api == Api::Chat {
                "top_logprobs"
            } else {
                "logprobs"
            };
            return Err(ApiError::invalid(
                param,
                format!("`{param}` is {k}; at most {MAX_TOP_LOGPROBS}"),
            ));
        }
    }
    let mut logit_bias = Vec::new();
    if let Some(m) = f.object("logit_bias")? {
        for (k, v) in m {
            let id = k.parse::<u32>().ok().filter(|&i| (i as usize) < vocab);
            let b = v.as_f64().filter(|b| (-100.0..=100.0).contains(b));
            match (id, b) {
                (Some(id), Some(b)) => logit_bias.push((id, b as f32)),
                (None, _) => {
                    return Err(ApiError::invalid(
                        "logit_bias",
                        format!("`logit_bias` key `{k}` is not a token id below {vocab}"),
                    ))
                }
                (_, None) => {
                    return Err(ApiError::invalid(
                        "logit_bias",
                        format!("`logit_bias` for token {k} must be a number in [-100, 100]"),
                    ))
                }
            }
        }
    }
    let constraint = output_constraint(f)?;
    Ok(GenParams {
        max_tokens: max_tokens.map(|m| m.min(usize::MAX as u64) as usize),
        sampler,
        stop,
        stream,
        include_usage,
        logprobs,
        logit_bias,
        ignore_eos: f.boolean("ignore_eos")?.unwrap_or(false),
        constraint,
        n,
    })
}

/// What the output must follow, from OpenAI's `response_format` (`json_object`, or
/// `json_schema` with `strict`; llama-server's `json_object` with a `schema` too) or
/// llama-server's `json_schema` (a schema) and `grammar` (GBNF, or llguidance's Lark after a
/// leading `%llguidance {}` line, as llama.cpp reads it). At most one of them.
fn output_constraint(f: &Fields) -> R<Option<Requested>> {
    let mut found: Vec<Requested> = Vec::new();
    if let Some(rf) = f.object("response_format")? {
        let json = |schema: Value, strict| Constraint::Json { schema, strict };
        let param = "response_format";
        match rf.get("type").and_then(Value::as_str) {
            Some("text") | None => {}
            Some("json_object") => {
                let schema = rf.get("schema").cloned();
                let schema = schema.unwrap_or_else(|| json!({"type": "object"}));
                let constraint = json(schema, false);
                found.push(Requested { constraint, param });
            }
            Some("json_schema") => {
                let param = "response_format.json_schema";
                let Some(js) = rf.get("json_schema").and_then(Value::as_object) else {
                    return Err(ApiError::invalid(
                        param,
                        "`response_format` of type `json_schema` needs a `json_schema` object \
                         ({\"name\", \"schema\", \"strict\"})",
                    ));
                };
                let strict = match js.get("strict") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(_) => {
                        return Err(ApiError::invalid(
                            "response_format.json_schema.strict",
                            "`strict` must be true or false",
                        ))
                    }
                };
                let schema = match js.get("schema") {
                    None | Some(Value::Null) => json!({"type": "object"}),
                    Some(s @ (Value::Object(_) | Value::Bool(true))) => s.clone(),
                    Some(_) => {
                        return Err(ApiError::invalid(
                            "response_format.json_schema.schema",
                            "`schema` must be a JSON schema object",
                        ))
                    }
                };
                let constraint = json(schema, strict);
                found.push(Requested { constraint, param });
            }
            Some(t) => {
                return Err(ApiError::invalid(
                    param,
                    format!(
                        "`response_format` type `{t}`: expected text, json_object or json_schema"
                    ),
                ))
            }
        }
    }
    match f.get("json_schema") {
        None => {}
        Some(s @ (Value::Object(_) | Value::Bool(true))) => found.push(Requested {
            constraint: Constraint::Json {
                schema: s.clone(),
                strict: false,
            },
            param: "json_schema",
        }),
        Some(_) => {
            return Err(ApiError::invalid(
                "json_schema",
                "`json_schema` must be a JSON schema object",
            ))
        }
    }
    if let Some(g) = f.string("grammar")?.filter(|g| !g.trim().is_empty()) {
        let lark = match g.trim_start().strip_prefix("%llguidance") {
            Some(rest) => {
                // llama.cpp's marker line is `%llguidance {}`; the grammar follows it.
                let rest = rest.trim_start();
                rest.strip_prefix("{}").unwrap_or(rest).to_string()
            }
            None => gbnf_to_lark(g)
                .map_err(|e| ApiError::invalid("grammar", format!("`grammar` (GBNF): {e}")))?,
        };
        found.push(Requested {
            constraint: Constraint::Lark(lark),
            param: "grammar",
        });
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|r| r.param).collect();
        return Err(ApiError::invalid(
            found[1].param,
            format!(
                "give one of `response_format`, `json_schema` and `grammar`, not {}",
                names.join(" and ")
            ),
        ));
    }
    Ok(found.pop())
}

/// A chat request, checked and ready to render.
#[derive(Debug)]
pub struct ChatRequest {
    pub model: Option<String>,
    /// Messages with text-part lists joined into strings and tool-call arguments given as
    /// JSON text turned into objects (templates iterate over them).
    pub messages: Value,
    /// Variables for the template besides the messages: `tools`, `chat_template_kwargs`,
    /// `reasoning_effort`.
    pub template_vars: Map<String, Value>,
    /// The request's tool definitions, when tool calls are to be parsed from the output.
    pub tools: Option<Vec<Value>>,
    pub params: GenParams,
}

pub fn chat_request(body: &Value, vocab: usize, default_seed: u64) -> R<ChatRequest> {
    let f = Fields::of(body)?;
    let model = f.string("model")?.map(String::from);
    let messages = normalize_messages(f.get("messages"))?;
    let params = gen_params(&f, Api::Chat, vocab, default_seed)?;
    let mut template_vars = Map::new();
    let tools = match f.get("tools") {
        None => None,
        Some(Value::Array(a)) => {
            for (i, t) in a.iter().enumerate() {
                let name = t
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str);
                if name.is_none() {
                    return Err(ApiError::invalid(
                        &format!("tools[{i}].function.name"),
                        "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ));
                }
            }
            (!a.is_empty()).then(|| a.clone())
        }
        Some(_) => return Err(ApiError::invalid("tools", "`tools` must be a list")),
    };
    // Forcing a tool call ("required", or a named function) constrains the reply to one
    // call of those tools, their `parameters` schemas shaping the arguments.
    let no_tools = |what: &str| {
        ApiError::invalid(
            "tool_choice",
            format!("`tool_choice` {what} needs `tools` to choose from"),
        )
    };
    let mut params = params;
    let (tool_choice_none, forced) = match f.get("tool_choice") {
        None => (false, None),
        Some(Value::String(s)) => match s.as_str() {
            "none" => (true, None),
            "auto" => (false, None),
            "required" => (
                false,
                Some(tools.clone().ok_or_else(|| no_tools("\"required\""))?),
            ),
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` `{other}`: expected none, auto or required"),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice.function.name",
                        "`tool_choice` naming a function is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            let all = tools.clone().ok_or_else(|| no_tools("naming a function"))?;
            let named: Vec<Value> = all
                .into_iter()
                .filter(|t| {
                    t.get("function")
                        .and_then(|f| f.get("name"))
                        .and_then(Value::as_str)
                        == Some(name)
                })
                .collect();
            if named.is_empty() {
                return Err(ApiError::invalid(
                    "tool_choice.function.name",
                    format!("`tool_choice` names `{name}`, which is not in `tools`"),
                ));
            }
            (false, Some(named))
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` must be a string or an object",
            ))
        }
    };
    if let Some(t) = forced {
        if let Some(other) = &params.constraint {
            return Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "a forced `tool_choice` and `{}` both shape the reply; give one",
                    other.param
                ),
            ));
        }
        params.constraint = Some(Requested {
            constraint: Constraint::ToolCall(t),
            param: "tool_choice",
        });
    }
    if let Some(t) = &tools {
        template_vars.insert("tools".into(), Value::Array(t.clone()));
    }
    if let Some(e) = f.string("reasoning_effort")? {
        template_vars.insert("reasoning_effort".into(), e.into());
    }
    if let Some(kw) = f.object("chat_template_kwargs")? {
        for (k, v) in kw {
            template_vars.insert(k.clone(), v.clone());
        }
    }
    Ok(ChatRequest {
        model,
        messages,
        template_vars,
        tools: if tool_choice_none { None } else { tools },
        params,
    })
}

fn normalize_messages(v: Option<&Value>) -> R<Value> {
    let Some(Value::Array(msgs)) = v else {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must be a non-empty list of {\"role\", \"content\"} objects",
        ));
    };
    if msgs.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` is empty"));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let Some(obj) = m.as_object() else {
            return Err(ApiError::invalid(
                &format!("messages[{i}]"),
                "each message must be an object",
            ));
        };
        if !obj.get("role").is_some_and(Value::is_string) {
            return Err(ApiError::invalid(
                &format!("messages[{i}].role"),
                "each message needs a string `role`",
            ));
        }
        let mut obj = obj.clone();
        match obj.get("content") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                let mut text = Vec::with_capacity(parts.len());
                for (j, p) in parts.iter().enumerate() {
                    match (
                        p.get("type").and_then(Value::as_str),
                        p.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text") | None, Some(t)) => text.push(t),
                        (ty, _) => {
                            return Err(ApiError::invalid(
                                &format!("messages[{i}].content[{j}]"),
                                format!(
                                    "content part type `{}` is not supported: only text",
                                    ty.unwrap_or("?")
                                ),
                            ))
                        }
                    }
                }
                obj.insert("content".into(), Value::String(text.join("\n")));
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].content"),
                    "`content` must be a string, a list of text parts or null",
                ))
            }
        }
        if let Some(Value::Array(calls)) = obj.get_mut("tool_calls") {
            for c in calls {
                if let Some(Value::String(args)) = c.pointer("/function/arguments") {
                    if let Ok(parsed @ Value::Object(_)) = serde_json::from_str::<Value>(args) {
                        if let Some(f) = c.get_mut("function") {
                            f["arguments"] = parsed;
                        }
                    }
                }
            }
        }
        out.push(Value::Object(obj));
    }
    Ok(Value::Array(out))
}

/// A completion request's prompt: text, or token ids given directly.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub params: GenParams,
}

pub fn completion_request(body: &Value, vocab: usize, default_seed: u64) -> R<CompletionRequest> {
    let f = Fields::of(body)?;
    let model = f.string("model")?.map(String::from);
    let prompt = read_prompt(f.get("prompt"), vocab)?;
    if f.boolean("echo")?.unwrap_or(false) {
        return Err(ApiError::invalid("echo", "`echo` is not supported"));
    }
    if f.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "`suffix` is not supported"));
    }
    let params = gen_params(&f, Api::Completions, vocab, default_seed)?;
    Ok(CompletionRequest {
        model,
        prompt,
        params,
    })
}

fn read_prompt(v: Option<&Value>, vocab: usize) -> R<Prompt> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "`prompt` must be a string, a list of token ids, or a list holding one of those",
        )
    };
    let ids = |a: &[Value]| -> R<Vec<u32>> {
        a.iter()
            .map(|t| match t.as_u64() {
                Some(id) if (id as usize) < vocab => Ok(id as u32),
                Some(id) => Err(ApiError::invalid(
                    "prompt",
                    format!("token id {id} is outside the vocabulary ({vocab} ids)"),
                )),
                None => Err(bad()),
            })
            .collect()
    };
    let p = match v {
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) && !a.is_empty() => {
            Prompt::Tokens(ids(a)?)
        }
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => Prompt::Text(s.clone()),
            Value::Array(t) => Prompt::Tokens(ids(t)?),
            _ => return Err(bad()),
        },
        Some(Value::Array(a)) if a.len() > 1 => {
            return Err(ApiError::invalid(
                "prompt",
                format!(
                    "`prompt` holds {} prompts: this server takes one per request",
                    a.len()
                ),
            ))
        }
        _ => return Err(bad()),
    };
    match &p {
        Prompt::Text(s) if s.is_empty() => Err(ApiError::invalid("prompt", "`prompt` is empty")),
        Prompt::Tokens(t) if t.is_empty() => Err(ApiError::invalid("prompt", "`prompt` is empty")),
        _ => Ok(p),
    }
}

/// Most inputs one embeddings request may give (OpenAI's limit).
pub const MAX_EMBED_INPUTS: usize = 2048;

/// How `/v1/embeddings` sends the vectors (`encoding_format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    /// A list of numbers.
    Float,
    /// The f32 values' little-endian bytes in base64, as OpenAI sends them (its Python client
    /// asks for this by default).
    Base64,
}

#[derive(Debug)]
pub struct EmbeddingRequest {
    pub model: Option<String>,
    pub inputs: Vec<Prompt>,
    pub encoding: Encoding,
    pub dimensions: Option<usize>,
}

/// An embeddings request: `input` a string, a list of strings, a list of token ids or a list
/// of such lists; `encoding_format` float or base64; `dimensions` (checked against the
/// model's width once it is known: this server does not shorten embeddings).
pub fn embedding_request(body: &Value, vocab: usize) -> R<EmbeddingRequest> {
    let f = Fields::of(body)?;
    let model = f.string("model")?.map(String::from);
    let bad = || {
        ApiError::invalid(
            "input",
            "`input` must be a string, a list of strings, a list of token ids or a list of \
             lists of token ids",
        )
    };
    let ids = |at: &str, a: &[Value]| -> R<Vec<u32>> {
        a.iter()
            .map(|t| match t.as_u64() {
                Some(id) if (id as usize) < vocab => Ok(id as u32),
                Some(id) => Err(ApiError::invalid(
                    at,
                    format!("token id {id} is outside the vocabulary ({vocab} ids)"),
                )),
                None => Err(bad()),
            })
            .collect()
    };
    let inputs = match f.get("input") {
        Some(Value::String(s)) => vec![Prompt::Text(s.clone())],
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => {
            vec![Prompt::Tokens(ids("input", a)?)]
        }
        Some(Value::Array(a)) if !a.is_empty() => {
            if a.len() > MAX_EMBED_INPUTS {
                return Err(ApiError::invalid(
                    "input",
                    format!("`input` has {} items; at most {MAX_EMBED_INPUTS}", a.len()),
                ));
            }
            a.iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(Prompt::Text(s.clone())),
                    Value::Array(t) => Ok(Prompt::Tokens(ids(&format!("input[{i}]"), t)?)),
                    _ => Err(ApiError::invalid(
                        &format!("input[{i}]"),
                        "each input must be a string or a list of token ids",
                    )),
                })
                .collect::<R<_>>()?
        }
        _ => return Err(bad()),
    };
    for (i, p) in inputs.iter().enumerate() {
        let empty = match p {
            Prompt::Text(s) => s.is_empty(),
            Prompt::Tokens(t) => t.is_empty(),
        };
        if empty {
            let at = match inputs.len() {
                1 => "input".to_string(),
                _ => format!("input[{i}]"),
            };
            return Err(ApiError::invalid(&at, format!("`{at}` is empty")));
        }
    }
    let encoding = match f.string("encoding_format")? {
        None | Some("float") => Encoding::Float,
        Some("base64") => Encoding::Base64,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("`encoding_format` `{other}`: expected float or base64"),
            ))
        }
    };
    let dimensions = match f.uint("dimensions")? {
        Some(0) => {
            return Err(ApiError::invalid(
                "dimensions",
                "`dimensions` must be at least 1",
            ))
        }
        d => d.map(|d| d.min(usize::MAX as u64) as usize),
    };
    Ok(EmbeddingRequest {
        model,
        inputs,
        encoding,
        dimensions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedding_inputs_of_every_shape_and_their_400s() {
        let r = |v: Value| embedding_request(&v, 10);
        let inputs = |v: Value| r(json!({"input": v})).unwrap().inputs;
        assert_eq!(inputs(json!("a")), vec![Prompt::Text("a".into())]);
        assert_eq!(inputs(json!([1, 2])), vec![Prompt::Tokens(vec![1, 2])]);
        assert_eq!(
            inputs(json!(["a", [3]])),
            vec![Prompt::Text("a".into()), Prompt::Tokens(vec![3])]
        );
        let b = r(json!({"input": "a", "encoding_format": "base64", "dimensions": 8})).unwrap();
        assert_eq!((b.encoding, b.dimensions), (Encoding::Base64, Some(8)));
        for (body, param) in [
            (json!({}), "input"),
            (json!({"input": ""}), "input"),
            (json!({"input": []}), "input"),
            (json!({"input": [5, 10]}), "input"),
            (json!({"input": ["a", ""]}), "input[1]"),
            (json!({"input": ["a", [99]]}), "input[1]"),
            (json!({"input": ["a", {"x": 1}]}), "input[1]"),
            (
                json!({"input": "a", "encoding_format": "int8"}),
                "encoding_format",
            ),
            (json!({"input": "a", "dimensions": 0}), "dimensions"),
        ] {
            let e = r(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn n_is_read_and_zero_is_a_400_naming_n() {
        let req = |n: Value| {
            chat_request(
                &json!({"messages": [{"role": "user", "content": "hi"}], "n": n}),
                100,
                1,
            )
        };
        assert_eq!(req(json!(3)).unwrap().params.n, 3);
        assert_eq!(req(Value::Null).unwrap().params.n, 1);
        for bad in [json!(0), json!(-1), json!("2")] {
            let e = req(bad).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert_eq!(e.param.as_deref(), Some("n"));
        }
    }

    /// Choice 0 keeps the request's seed; the others differ from it and from each other.
    #[test]
    fn choice_seeds_are_the_seed_then_distinct() {
        assert_eq!(choice_seed(42, 0), 42);
        let seeds: std::collections::HashSet<u64> = (0..64).map(|i| choice_seed(42, i)).collect();
        assert_eq!(seeds.len(), 64);
        assert_eq!(choice_seed(42, 5), choice_seed(42, 5));
        assert_ne!(choice_seed(42, 1), choice_seed(43, 1));
    }

    #[test]
    fn fields_are_read_and_checked() {
        let r = chat_request(
            &json!({
                "model": "x", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                "max_tokens": 7, "temperature": 0, "top_p": 0.5, "stop": "END", "seed": -1,
                "logprobs": true, "top_logprobs": 3, "stream": true,
                "stream_options": {"include_usage": true}, "logit_bias": {"5": -100},
                "chat_template_kwargs": {"enable_thinking": false}
            }),
            100,
            1,
        )
        .unwrap();
        assert_eq!(r.messages[0]["content"], "a\nb");
        assert_eq!(r.params.max_tokens, Some(7));
        assert_eq!(r.params.sampler.temperature, 0.0);
        assert_eq!(r.params.sampler.seed, u64::MAX);
        assert_eq!(r.params.stop, vec!["END".to_string()]);
        assert_eq!(r.params.logprobs, Some(3));
        assert!(r.params.stream && r.params.include_usage);
        assert_eq!(r.params.logit_bias, vec![(5, -100.0)]);
        assert_eq!(r.template_vars["enable_thinking"], false);
        for bad in [
            json!({"messages": []}),
            json!({"messages": [{"content": "x"}]}),
            json!({"messages": [{"role": "user", "content": "x"}], "temperature": -1}),
            json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
            json!({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"100": 1}}),
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        ] {
            assert!(chat_request(&bad, 100, 1).is_err(), "{bad}");
        }
    }

    /// A forced `tool_choice` constrains the reply to a call of the tools it allows; a name
    /// not among the tools, or no tools, is a 400 on `tool_choice`.
    #[test]
    fn forced_tool_choice_becomes_a_tool_call_constraint() {
        let f = json!({"type": "function", "function": {"name": "f"}});
        let g = json!({"type": "function", "function": {"name": "g"}});
        let tools = json!([f, g]);
        let req = |choice: Value, tools: &Value| {
            chat_request(
                &json!({"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": choice}),
                10,
                1,
            )
        };
        let forced = |choice: Value| {
            req(choice, &tools)
                .unwrap()
                .params
                .constraint
                .map(|r| r.constraint)
        };
        assert_eq!(forced(json!("auto")), None);
        assert_eq!(forced(json!("none")), None);
        assert_eq!(
            forced(json!("required")),
            Some(Constraint::ToolCall(vec![f.clone(), g.clone()]))
        );
        let named = json!({"type": "function", "function": {"name": "g"}});
        assert_eq!(forced(named), Some(Constraint::ToolCall(vec![g.clone()])));
        let missing = json!({"type": "function", "function": {"name": "h"}});
        let e = req(missing, &tools).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice.function.name"));
        let e = req(json!("required"), &Value::Null).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn sampling_values_are_checked_once_for_every_front_end() {
        let msg = json!([{"role": "user", "content": "x"}]);
        for (field, v) in [
            ("temperature", json!(-1)),
            ("top_p", json!(2)),
            ("min_p", json!(2)),
            ("repeat_penalty", json!(0)),
            ("presence_penalty", json!(3)),
            ("frequency_penalty", json!(-3)),
        ] {
            let mut body = json!({"messages": msg});
            body[field] = v.clone();
            let e = chat_request(&body, 10, 1).unwrap_err();
            assert_eq!(
                e.param.as_deref(),
                Some(field),
                "{field}={v}: {}",
                e.message
            );
        }
    }

    #[test]
    fn prompts_of_every_shape() {
        let p = |v: Value| read_prompt(Some(&v), 10);
        assert_eq!(p(json!("hi")).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!(["hi"])).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!([1, 2])).unwrap(), Prompt::Tokens(vec![1, 2]));
        assert_eq!(p(json!([[3]])).unwrap(), Prompt::Tokens(vec![3]));
        assert!(p(json!([10])).is_err());
        assert!(p(json!(["a", "b"])).is_err());
        assert!(p(json!("")).is_err());
    }

    #[test]
    fn tool_call_arguments_become_objects() {
        let r = chat_request(
            &json!({"messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}
            ]}),
            10,
            1,
        )
        .unwrap();
        assert_eq!(
            r.messages[1]["tool_calls"][0]["function"]["arguments"]["a"],
            1
        );
    }
}
