//! OpenAI's Responses API, `POST /v1/responses`: the subset a chat client needs. The request
//! becomes a chat request ([`chat_body`]: `input` items as messages, `instructions` as the
//! system message, `max_output_tokens`, flat function `tools`, `tool_choice`, `text.format` as
//! `response_format`) and runs as any chat does, through the chat template, the tool-call
//! parser and structured output; the reply comes back as `reasoning`, `message` (with
//! `output_text`) and `function_call` output items, whole or as the API's named server-sent
//! events (`response.created` … `response.completed`). The server keeps no responses:
//! `previous_response_id`, `store: true`, `background: true` and `conversation` are 400s
//! naming the field; the client sends the whole conversation as `input` each time.

use super::*;

/// Fields the Responses API has that this server does not do, with why.
const REFUSED: &[(&str, &str)] = &[
    (
        "previous_response_id",
        "this server keeps no responses: send the whole conversation as `input`",
    ),
    (
        "conversation",
        "this server keeps no conversations: send the whole conversation as `input`",
    ),
    (
        "store",
        "this server keeps no responses (`store` must be false)",
    ),
    (
        "background",
        "background responses are not supported (`background` must be false)",
    ),
    ("prompt", "stored prompt templates are not supported"),
];

/// Fields read as the chat API reads them (lathe's extensions included).
const SAME_AS_CHAT: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "ignore_eos",
    "chat_template_kwargs",
];

/// Fields echoed back in the response object as the request gave them.
const ECHOED: &[&str] = &[
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "text",
    "metadata",
    "parallel_tool_calls",
];

type R<T> = std::result::Result<T, ApiError>;

/// The chat completions body a Responses request means, or the 400 naming the field.
pub(super) fn chat_body(body: &Value) -> R<Value> {
    let f = api::Fields::of(body)?;
    for (k, why) in REFUSED {
        let given = match f.get(k) {
            None | Some(Value::Bool(false)) => false,
            Some(Value::String(s)) => !s.is_empty(),
            Some(_) => true,
        };
        if given {
            return Err(ApiError::invalid(k, format!("`{k}`: {why}")));
        }
    }
    let mut chat = Map::new();
    for k in SAME_AS_CHAT {
        if let Some(v) = f.get(k) {
            chat.insert(k.to_string(), v.clone());
        }
    }
    if let Some(m) = f.get("max_output_tokens") {
        chat.insert("max_completion_tokens".into(), m.clone());
    }
    chat.insert("messages".into(), messages(&f)?);
    if let Some(t) = f.get("tools") {
        chat.insert("tools".into(), tools(t)?);
    }
    if let Some(c) = f.get("tool_choice") {
        let c = match c {
            // {"type": "function", "name"} is chat's {"type": "function", "function": {"name"}}.
            Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
                json!({"type": "function", "function": {"name": o.get("name")}})
            }
            c => c.clone(),
        };
        chat.insert("tool_choice".into(), c);
    }
    if let Some(text) = f.object("text")? {
        if let Some(format) = text.get("format").filter(|v| !v.is_null()) {
            let Some(fo) = format.as_object() else {
                return Err(ApiError::invalid(
                    "text.format",
                    "`text.format` must be an object",
                ));
            };
            let rf = match fo.get("type").and_then(Value::as_str) {
                // Flat here, nested under `json_schema` in the chat API.
                Some("json_schema") => json!({"type": "json_schema", "json_schema": {
                    "name": fo.get("name"), "schema": fo.get("schema"), "strict": fo.get("strict"),
                }}),
                _ => format.clone(),
            };
            chat.insert("response_format".into(), rf);
        }
    }
    Ok(Value::Object(chat))
}

/// `instructions` and `input` as chat messages.
fn messages(f: &api::Fields) -> R<Value> {
    let mut out = Vec::new();
    if let Some(i) = f.string("instructions")? {
        out.push(json!({"role": "system", "content": i}));
    }
    let bad = || {
        ApiError::invalid(
            "input",
            "`input` must be a string or a non-empty list of input items",
        )
    };
    match f.get("input") {
        Some(Value::String(s)) if !s.is_empty() => {
            out.push(json!({"role": "user", "content": s}));
        }
        Some(Value::Array(items)) if !items.is_empty() => {
            for (i, it) in items.iter().enumerate() {
                item(i, it, &mut out)?;
            }
        }
        _ => return Err(bad()),
    }
    Ok(Value::Array(out))
}

/// One input item as chat messages: a message (role and text content), a function call the
/// model made earlier, or a function call's output.
fn item(i: usize, it: &Value, out: &mut Vec<Value>) -> R<()> {
    let at = |k: &str| format!("input[{i}]{k}");
    let Some(o) = it.as_object() else {
        return Err(ApiError::invalid(
            &at(""),
            "each input item must be an object",
        ));
    };
    let text = |k: &str| -> R<String> {
        o.get(k)
            .and_then(Value::as_str)
            .map(String::from)
            .ok_or_else(|| {
                ApiError::invalid(&at(&format!(".{k}")), format!("`{k}` must be a string"))
            })
    };
    match o.get("type").and_then(Value::as_str).unwrap_or("message") {
        "message" => {
            let role = match o.get("role").and_then(Value::as_str) {
                Some(r @ ("user" | "assistant" | "system")) => r,
                // The Responses API's name for instructions given as a message.
                Some("developer") => "system",
                _ => {
                    return Err(ApiError::invalid(
                        &at(".role"),
                        "`role` must be user, assistant, system or developer",
                    ))
                }
            };
            let content = match o.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut t = Vec::with_capacity(parts.len());
                    for (j, p) in parts.iter().enumerate() {
                        let ty = p.get("type").and_then(Value::as_str);
                        match (ty, p.get("text").and_then(Value::as_str)) {
                            (Some("input_text" | "output_text"), Some(s)) => t.push(s),
                            _ => {
                                return Err(ApiError::invalid(
                                    &at(&format!(".content[{j}]")),
                                    format!(
                                        "content part type `{}` is not supported: only input_text \
                                         and output_text with a `text`",
                                        ty.unwrap_or("?")
                                    ),
                                ))
                            }
                        }
                    }
                    t.join("\n")
                }
                _ => {
                    return Err(ApiError::invalid(
                        &at(".content"),
                        "`content` must be a string or a list of input_text parts",
                    ))
                }
            };
            out.push(json!({"role": role, "content": content}));
        }
        "function_call" => {
            let call = json!({"id": text("call_id")?, "type": "function",
                              "function": {"name": text("name")?, "arguments": text("arguments")?}});
            // Calls made in one turn are one assistant message.
            match out.last_mut() {
                Some(m) if m["role"] == "assistant" && m["tool_calls"].is_array() => {
                    if let Some(a) = m["tool_calls"].as_array_mut() {
                        a.push(call);
                    }
                }
                _ => out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        "function_call_output" => {
            out.push(json!({"role": "tool", "tool_call_id": text("call_id")?,
                            "content": text("output")?}));
        }
        // Earlier reasoning: chat templates drop it from earlier turns anyway.
        "reasoning" => {}
        other => {
            return Err(ApiError::invalid(
                &at(".type"),
                format!(
                    "input item type `{other}` is not supported: message, function_call, \
                     function_call_output or reasoning"
                ),
            ))
        }
    }
    Ok(())
}

/// Flat function tools (`{"type": "function", "name", "description", "parameters"}`) as the
/// chat API's; other tool types (web search, file search, ...) are 400s.
fn tools(t: &Value) -> R<Value> {
    let Some(a) = t.as_array() else {
        return Err(ApiError::invalid("tools", "`tools` must be a list"));
    };
    let mut out = Vec::with_capacity(a.len());
    for (i, t) in a.iter().enumerate() {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            ty => {
                return Err(ApiError::invalid(
                    &format!("tools[{i}].type"),
                    format!(
                        "tool type `{}` is not supported: only function tools",
                        ty.unwrap_or("?")
                    ),
                ))
            }
        }
        let mut function = Map::new();
        for k in ["name", "description", "parameters", "strict"] {
            if let Some(v) = t.get(k) {
                function.insert(k.into(), v.clone());
            }
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Value::Array(out))
}

/// A chat error's `param` in the Responses API's names.
fn responses_param(mut e: ApiError) -> ApiError {
    if let Some(p) = e.param.take() {
        let p = if p == "max_completion_tokens" {
            "max_output_tokens".into()
        } else if let Some(rest) = p.strip_prefix("response_format.json_schema") {
            format!("text.format{rest}")
        } else if let Some(rest) = p.strip_prefix("response_format") {
            format!("text.format{rest}")
        } else if p.starts_with("messages") {
            "input".into()
        } else {
            p.replace(".function.", ".")
        };
        e.param = Some(p);
    }
    e
}

pub(super) async fn responses(State(st): State<AppState>, req: Request) -> Response {
    responses_inner(st, req)
        .await
        .unwrap_or_else(|e| e.into_response())
}

async fn responses_inner(st: AppState, req: Request) -> R<Response> {
    let body = read_json(&st.cfg, req).await?;
    let loaded = ready(&st)?;
    let chat = chat_body(&body)?;
    let req = api::chat_request(&chat, loaded.vocab, fresh_seed()).map_err(responses_param)?;
    let mut echo = Map::new();
    if let Some(o) = body.as_object() {
        for k in ECHOED {
            if let Some(v) = o.get(*k).filter(|v| !v.is_null()) {
                echo.insert(k.to_string(), v.clone());
            }
        }
    }
    let (meta, kind, events) = chat_submit(&st, req, random_id("resp_", 24))
        .await
        .map_err(responses_param)?;
    let out = Out { meta, echo };
    if out.meta.params.stream {
        return Ok(events_response(ResponsesStream::new(out, kind, events)));
    }
    let mut out = out;
    let (mut choices, totals) = gather(&mut out.meta, &kind, events).await?;
    let c = choices.remove(0);
    let (finish, calls) = c.done.clone().unwrap_or((Finish::Stop, Vec::new()));
    let mut items = Vec::new();
    if !c.reasoning.is_empty() {
        items.push(reasoning_item(
            &random_id("rs_", 24),
            &c.reasoning,
            "completed",
        ));
    }
    if !c.content.is_empty() || calls.is_empty() {
        items.push(message_item(
            &random_id("msg_", 24),
            &c.content,
            "completed",
        ));
    }
    items.extend(calls.iter().map(|c| call_item(&random_id("fc_", 24), c)));
    let body = out.response(finish_status(finish), items, Some(&totals));
    Ok(json_response(StatusCode::OK, &body))
}

/// `completed`, or `incomplete` for a reply cut at `max_output_tokens` (or the context).
fn finish_status(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "completed",
        Finish::Length => "incomplete",
    }
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "reasoning", "id": id, "status": status, "summary": [],
           "content": [{"type": "reasoning_text", "text": text}]})
}

fn call_item(id: &str, c: &ToolCall) -> Value {
    json!({"type": "function_call", "id": id, "call_id": random_id("call_", 24),
           "name": c.name, "arguments": c.arguments, "status": "completed"})
}

/// What every event of one response shares.
struct Out {
    meta: Meta,
    /// The request's fields echoed in the response object ([`ECHOED`]).
    echo: Map<String, Value>,
}

impl Out {
    /// The response object; `totals`: its usage, once done.
    fn response(&self, status: &str, output: Vec<Value>, totals: Option<&Totals>) -> Value {
        let m = &self.meta;
        let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
        let usage = totals.map(|t| {
            json!({
                "input_tokens": t.n_prompt,
                "input_tokens_details": {"cached_tokens": t.n_cached},
                "output_tokens": t.n_generated,
                "total_tokens": t.n_prompt + t.n_generated,
            })
        });
        let mut v = json!({
            "id": m.id, "object": "response", "created_at": m.created, "status": status,
            "model": m.model, "output": output, "usage": usage, "error": null,
            "incomplete_details": incomplete, "previous_response_id": null, "store": false,
            "instructions": null, "max_output_tokens": null, "temperature": null,
            "top_p": null, "tools": [], "tool_choice": "auto", "parallel_tool_calls": true,
            "text": {"format": {"type": "text"}}, "metadata": {},
        });
        for (k, e) in &self.echo {
            v[k.as_str()] = e.clone();
        }
        v
    }
}

/// The output item being streamed.
struct OpenItem {
    reasoning: bool,
    id: String,
    index: usize,
    text: String,
}

/// A streamed response: `response.created`, `response.in_progress`, then per output item
/// `response.output_item.added`, its content (`response.content_part.added`,
/// `response.output_text.delta` … `.done`, `response.content_part.done`; reasoning as
/// `response.reasoning_text.delta` / `.done`; a call's `response.function_call_arguments.delta`
/// / `.done`) and `response.output_item.done`, then `response.completed` (or
/// `response.incomplete` at `max_output_tokens`); an engine error is an `error` event.
struct ResponsesStream {
    out: Out,
    kind: Kind,
    rx: Events,
    seq: u64,
    started: bool,
    open: Option<OpenItem>,
    /// Output items done, for the final response object.
    items: Vec<Value>,
    done: bool,
}

impl ResponsesStream {
    fn new(out: Out, kind: Kind, rx: Events) -> ResponsesStream {
        ResponsesStream {
            out,
            kind,
            rx,
            seq: 0,
            started: false,
            open: None,
            items: Vec::new(),
            done: false,
        }
    }

    /// One named event; its data carries the `type` and the `sequence_number`.
    fn event(&mut self, buf: &mut Vec<u8>, ty: &str, mut data: Value) {
        data["type"] = ty.into();
        data["sequence_number"] = self.seq.into();
        self.seq += 1;
        buf.extend_from_slice(format!("event: {ty}\ndata: {data}\n\n").as_bytes());
    }

    /// Text of the reply: into the open item of its kind, opening one (and closing the
    /// other kind's) as needed.
    fn text(&mut self, buf: &mut Vec<u8>, reasoning: bool, s: &str) {
        if self.open.as_ref().is_some_and(|o| o.reasoning != reasoning) {
            self.close(buf);
        }
        if self.open.is_none() {
            let (id, index) = match reasoning {
                true => (random_id("rs_", 24), self.items.len()),
                false => (random_id("msg_", 24), self.items.len()),
            };
            let item = match reasoning {
                true => json!({"type": "reasoning", "id": id, "status": "in_progress",
                               "summary": [], "content": []}),
                false => json!({"type": "message", "id": id, "status": "in_progress",
                                "role": "assistant", "content": []}),
            };
            self.event(
                buf,
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            );
            if !reasoning {
                let part = json!({"type": "output_text", "text": "", "annotations": []});
                self.event(
                    buf,
                    "response.content_part.added",
                    json!({"item_id": id,
                    "output_index": index, "content_index": 0, "part": part}),
                );
            }
            self.open = Some(OpenItem {
                reasoning,
                id,
                index,
                text: String::new(),
            });
        }
        let Some(o) = self.open.as_mut() else { return };
        o.text.push_str(s);
        let ty = match reasoning {
            true => "response.reasoning_text.delta",
            false => "response.output_text.delta",
        };
        let data =
            json!({"item_id": o.id, "output_index": o.index, "content_index": 0, "delta": s});
        self.event(buf, ty, data);
    }

    /// Ends the open item: its `.done` events, and into `items`.
    fn close(&mut self, buf: &mut Vec<u8>) {
        let Some(o) = self.open.take() else { return };
        let at =
            json!({"item_id": o.id, "output_index": o.index, "content_index": 0, "text": o.text});
        let item = match o.reasoning {
            true => {
                self.event(buf, "response.reasoning_text.done", at);
                reasoning_item(&o.id, &o.text, "completed")
            }
            false => {
                self.event(buf, "response.output_text.done", at);
                let part = json!({"type": "output_text", "text": o.text, "annotations": []});
                self.event(
                    buf,
                    "response.content_part.done",
                    json!({"item_id": o.id,
                    "output_index": o.index, "content_index": 0, "part": part}),
                );
                message_item(&o.id, &o.text, "completed")
            }
        };
        self.event(
            buf,
            "response.output_item.done",
            json!({"output_index": o.index, "item": item}),
        );
        self.items.push(item);
    }

    fn pieces(&mut self, buf: &mut Vec<u8>, ps: Vec<Piece>) {
        for p in ps {
            match p {
                Piece::Content(s) => self.text(buf, false, &s),
                Piece::Reasoning(s) => self.text(buf, true, &s),
            }
        }
    }

    fn fail(&mut self, buf: &mut Vec<u8>, e: &ApiError) {
        let data = json!({"code": e.code, "message": e.message, "param": e.param});
        self.event(buf, "error", data);
        self.done = true;
    }

    /// The next bytes to send; None after the last event.
    async fn next(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let mut buf = Vec::new();
        if !self.started {
            self.started = true;
            let r = self.out.response("in_progress", Vec::new(), None);
            self.event(&mut buf, "response.created", json!({"response": r}));
            self.event(&mut buf, "response.in_progress", json!({"response": r}));
            return Some(Bytes::from(buf));
        }
        while buf.is_empty() {
            let ev = tokio::select! {
                biased;
                e = self.out.meta.cut_short() => {
                    self.fail(&mut buf, &e);
                    break;
                }
                ev = self.rx.recv() => ev,
            };
            let stopped = || ApiError::server("the engine stopped before the request finished");
            let Some((_, Some(ev))) = ev else {
                self.fail(&mut buf, &stopped());
                break;
            };
            match ev {
                Event::Started { .. } => {}
                Event::Delta { text, .. } => {
                    if let Kind::Chat(p) = &mut self.kind {
                        let ps = p.push(&text);
                        self.pieces(&mut buf, ps);
                    }
                }
                Event::Error { message, code } => {
                    let e = engine_error(&self.out.meta.shared, message, code);
                    self.fail(&mut buf, &e);
                }
                Event::Done {
                    finish,
                    n_prompt,
                    n_cached,
                    n_generated,
                    spec,
                } => {
                    let (rest, calls) = match &mut self.kind {
                        Kind::Chat(p) => p.finish(),
                        Kind::Completion => (Vec::new(), Vec::new()),
                    };
                    self.pieces(&mut buf, rest);
                    // An empty reply is still one (empty) message.
                    if self.items.is_empty() && self.open.is_none() && calls.is_empty() {
                        self.text(&mut buf, false, "");
                    }
                    self.close(&mut buf);
                    for c in &calls {
                        let index = self.items.len();
                        let item = call_item(&random_id("fc_", 24), c);
                        let mut added = item.clone();
                        added["arguments"] = "".into();
                        added["status"] = "in_progress".into();
                        self.event(
                            &mut buf,
                            "response.output_item.added",
                            json!({"output_index": index, "item": added}),
                        );
                        let at = |extra: (&str, &str)| {
                            let mut v = json!({"item_id": item["id"], "output_index": index});
                            v[extra.0] = extra.1.into();
                            v
                        };
                        self.event(
                            &mut buf,
                            "response.function_call_arguments.delta",
                            at(("delta", &c.arguments)),
                        );
                        self.event(
                            &mut buf,
                            "response.function_call_arguments.done",
                            at(("arguments", &c.arguments)),
                        );
                        self.event(
                            &mut buf,
                            "response.output_item.done",
                            json!({"output_index": index, "item": item}),
                        );
                        self.items.push(item);
                    }
                    let mut totals = Totals::default();
                    totals.add(0, n_prompt, n_cached, n_generated, spec);
                    let status = finish_status(finish);
                    let r =
                        self.out
                            .response(status, std::mem::take(&mut self.items), Some(&totals));
                    let ty = match finish {
                        Finish::Stop => "response.completed",
                        Finish::Length => "response.incomplete",
                    };
                    self.event(&mut buf, ty, json!({"response": r}));
                    self.done = true;
                }
            }
        }
        Some(Bytes::from(buf))
    }
}

/// The SSE response of a streamed response (the client going away drops the receiver, as
/// for [`stream_response`]).
fn events_response(s: ResponsesStream) -> Response {
    super::sse_response(futures_util::stream::unfold(s, |mut s| async move {
        let b = s.next().await?;
        Some((Ok::<Bytes, Infallible>(b), s))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_become_chat_requests() {
        let c = chat_body(&json!({
            "model": "m", "instructions": "Be brief.", "max_output_tokens": 9,
            "input": [
                {"role": "developer", "content": "Rules."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
        }))
        .unwrap();
        let roles: Vec<&str> = c["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "system", "user", "assistant", "tool"]);
        assert_eq!(c["messages"][2]["content"], "a\nb");
        assert_eq!(c["messages"][3]["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(c["max_completion_tokens"], 9);
        assert_eq!(c["tools"][0]["function"]["name"], "f");
        assert_eq!(c["tool_choice"]["function"]["name"], "f");
        let r = api::chat_request(&c, 100, 1).unwrap();
        assert!(r.params.constraint.is_some() && r.tools.is_some());
        let c = chat_body(
            &json!({"input": "x", "text": {"format": {"type": "json_schema",
            "name": "x", "schema": {"type": "object"}, "strict": true}}}),
        )
        .unwrap();
        assert_eq!(c["response_format"]["json_schema"]["strict"], true);
        let r = api::chat_request(&c, 100, 1).unwrap();
        assert_eq!(
            r.params.constraint.map(|c| c.param),
            Some("response_format.json_schema")
        );
    }

    #[test]
    fn unsupported_fields_are_400s_naming_them() {
        let param = |b: Value| chat_body(&b).unwrap_err().param;
        let input = json!("hi");
        for (k, v) in [
            ("previous_response_id", json!("resp_1")),
            ("store", json!(true)),
            ("background", json!(true)),
            ("conversation", json!("c")),
        ] {
            let mut b = json!({"input": input});
            b[k] = v;
            assert_eq!(param(b).as_deref(), Some(k));
        }
        assert!(chat_body(&json!({"input": "hi", "store": false})).is_ok());
        assert_eq!(param(json!({"input": []})).as_deref(), Some("input"));
        let image = json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]});
        assert_eq!(param(image).as_deref(), Some("input[0].content[0]"));
        let search = json!({"input": "x", "tools": [{"type": "web_search"}]});
        assert_eq!(param(search).as_deref(), Some("tools[0].type"));
        let e = api::chat_request(
            &chat_body(&json!({"input": "x", "max_output_tokens": 0})).unwrap(),
            10,
            1,
        )
        .unwrap_err();
        assert_eq!(
            responses_param(e).param.as_deref(),
            Some("max_output_tokens")
        );
    }
}
