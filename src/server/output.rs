//! What the model wrote, split the way OpenAI-style clients read it: the reasoning between
//! `<think>` and `</think>` goes to `reasoning_content`, tool calls to `tool_calls`, the rest to
//! `content`. It works on the text stream as it arrives, so a stream never shows a marker
//! (or its first half) as content: text that may begin one is held back until the next piece
//! settles it.
//!
//! Tool-call syntaxes, as the models' chat templates write them into earlier turns:
//! - Qwen3.5 / 3.6 (Qwen3-Coder style): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n
//!   </parameter>\n</function>\n</tool_call>`, one block per call; values are raw text, typed
//!   by the tool's JSON schema. The older Qwen form with a JSON body
//!   (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) is read too.
//! - DeepSeek-V4 (DSML): `<｜DSML｜tool_calls>` holding `<｜DSML｜invoke name="NAME">` blocks of
//!   `<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>`, where
//!   `string="true"` marks raw text and `"false"` a JSON value. The ASCII `|` spelling of the
//!   delimiters is accepted as well.

use serde_json::{Map, Value};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_OPENERS: &[&str] = &["<tool_call>", "<｜DSML｜tool_calls>", "<|DSML|tool_calls>"];
const DSML: &str = "｜DSML｜";

/// A piece of the reply, classified.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Content(String),
    Reasoning(String),
}

/// One parsed call: `arguments` is the JSON text of an object, as OpenAI sends it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Content,
    Reasoning,
    Tools,
}

/// Splits one reply as it streams in.
#[derive(Clone, Debug)]
pub struct OutputParser {
    reasoning: bool,
    tools: Option<Vec<Value>>,
    state: State,
    /// Text not yet given out: it may be the start of a marker, or whitespace that a marker
    /// right after it would swallow.
    held: String,
    /// Everything from the first tool-call marker on.
    tool_text: String,
    /// No content given out yet: a `<think>` may still open, and leading whitespace is dropped.
    content_fresh: bool,
    /// No reasoning given out yet in this block: leading whitespace is dropped.
    reasoning_fresh: bool,
}

impl OutputParser {
    /// `reasoning`: split `<think>` blocks out at all; `think_open`: the prompt ended inside
    /// one (the template wrote `<think>` for the model), so the reply starts as reasoning;
    /// `tools`: the request's tool definitions when calls are to be parsed.
    pub fn new(reasoning: bool, think_open: bool, tools: Option<Vec<Value>>) -> OutputParser {
        OutputParser {
            reasoning,
            tools,
            state: if reasoning && think_open {
                State::Reasoning
            } else {
                State::Content
            },
            held: String::new(),
            tool_text: String::new(),
            content_fresh: true,
            reasoning_fresh: true,
        }
    }

    /// Whether the prompt text leaves a `<think>` block open for the model to continue.
    pub fn prompt_opens_thinking(prompt: &str) -> bool {
        match (prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)) {
            (Some(o), Some(c)) => o > c,
            (Some(_), None) => true,
            _ => false,
        }
    }

    /// Takes the next text of the reply; returns what can be shown now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Tools => {
                    self.tool_text.push_str(&std::mem::take(&mut self.held));
                    break;
                }
                State::Reasoning => {
                    if let Some(at) = self.held.find(THINK_CLOSE) {
                        let rest = self.held.split_off(at + THINK_CLOSE.len());
                        self.held.truncate(at);
                        let r = std::mem::take(&mut self.held);
                        self.emit_reasoning(r.trim_end(), &mut out);
                        self.held = rest;
                        self.state = State::Content;
                        self.content_fresh = true;
                        continue;
                    }
                    let keep = held_len(&self.held, &[THINK_CLOSE], true);
                    let tail = self.held.split_off(self.held.len() - keep);
                    let r = std::mem::replace(&mut self.held, tail);
                    self.emit_reasoning(&r, &mut out);
                    break;
                }
                State::Content => {
                    if self.content_fresh {
                        let t = self.held.trim_start();
                        if self.reasoning && t.starts_with(THINK_OPEN) {
                            self.held = t[THINK_OPEN.len()..].to_string();
                            self.state = State::Reasoning;
                            self.reasoning_fresh = true;
                            continue;
                        }
                        if t.is_empty() || (self.reasoning && THINK_OPEN.starts_with(t)) {
                            self.held = t.to_string();
                            break;
                        }
                        self.held = t.to_string();
                    }
                    let tools = self.tools.is_some();
                    if tools {
                        let first = TOOL_OPENERS.iter().filter_map(|m| self.held.find(m)).min();
                        if let Some(at) = first {
                            let calls = self.held.split_off(at);
                            let c = std::mem::take(&mut self.held);
                            self.emit_content(c.trim_end(), &mut out);
                            self.held = calls;
                            self.state = State::Tools;
                            continue;
                        }
                    }
                    let keep = if tools {
                        held_len(&self.held, TOOL_OPENERS, true)
                    } else {
                        0
                    };
                    let tail = self.held.split_off(self.held.len() - keep);
                    let c = std::mem::replace(&mut self.held, tail);
                    self.emit_content(&c, &mut out);
                    break;
                }
            }
        }
        out
    }

    /// The end of the reply: what was held back, and the tool calls. Calls that do not parse
    /// are given back as content, unchanged.
    pub fn finish(&mut self) -> (Vec<Piece>, Vec<ToolCall>) {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Reasoning => self.emit_reasoning(held.trim_end(), &mut out),
            State::Content => self.emit_content(&held, &mut out),
            State::Tools => {
                self.tool_text.push_str(&held);
                let text = std::mem::take(&mut self.tool_text);
                let tools = self.tools.as_deref().unwrap_or_default();
                match parse_tool_calls(&text, tools) {
                    Some(calls) => return (out, calls),
                    None => {
                        self.content_fresh = false;
                        self.emit_content(&text, &mut out)
                    }
                }
            }
        }
        (out, Vec::new())
    }

    fn emit_reasoning(&mut self, text: &str, out: &mut Vec<Piece>) {
        let text = if self.reasoning_fresh {
            text.trim_start()
        } else {
            text
        };
        if !text.is_empty() {
            self.reasoning_fresh = false;
            out.push(Piece::Reasoning(text.to_string()));
        }
    }

    fn emit_content(&mut self, text: &str, out: &mut Vec<Piece>) {
        let text = if self.content_fresh {
            text.trim_start()
        } else {
            text
        };
        if !text.is_empty() {
            self.content_fresh = false;
            out.push(Piece::Content(text.to_string()));
        }
    }
}

/// How many bytes at the end of `s` to hold back: the longest suffix that is a proper start
/// of one of `markers`, and with `ws` the whitespace just before it (a marker swallows it).
fn held_len(s: &str, markers: &[&str], ws: bool) -> usize {
    let mut keep = 0;
    for m in markers {
        for (i, _) in m.char_indices().skip(1) {
            if i > keep && s.ends_with(&m[..i]) {
                keep = i;
            }
        }
    }
    if ws {
        let before = &s[..s.len() - keep];
        keep += before.len() - before.trim_end().len();
    }
    keep
}

/// Every tool call in `text` (which starts at the first marker), or None when any of them
/// does not parse. `tools` are the request's definitions, whose schemas type raw values.
pub fn parse_tool_calls(text: &str, tools: &[Value]) -> Option<Vec<ToolCall>> {
    let calls = if text.contains("DSML|tool_calls>") || text.contains("DSML｜tool_calls>") {
        parse_dsml(&text.replace("|DSML|", DSML), tools)?
    } else {
        parse_qwen(text, tools)?
    };
    (!calls.is_empty()).then_some(calls)
}

/// Qwen's `<tool_call>` blocks; the last one may lack its closing tag (generation ended).
fn parse_qwen(text: &str, tools: &[Value]) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("<tool_call>") {
        let body_start = &rest[at + "<tool_call>".len()..];
        let (body, next) = match body_start.find("</tool_call>") {
            Some(end) => (
                &body_start[..end],
                &body_start[end + "</tool_call>".len()..],
            ),
            None => (body_start, ""),
        };
        calls.push(parse_qwen_call(body.trim(), tools)?);
        rest = next;
    }
    Some(calls)
}

fn parse_qwen_call(body: &str, tools: &[Value]) -> Option<ToolCall> {
    if body.starts_with('{') {
        let v: Value = serde_json::from_str(body).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        let arguments = match v.get("arguments") {
            Some(Value::String(s)) => s.clone(),
            Some(a @ Value::Object(_)) => a.to_string(),
            None | Some(Value::Null) => "{}".to_string(),
            Some(_) => return None,
        };
        return Some(ToolCall { name, arguments });
    }
    let rest = body.strip_prefix("<function=")?;
    let close = rest.find('>')?;
    let name = rest[..close].trim().to_string();
    let mut rest = &rest[close + 1..];
    let end = rest.find("</function>").unwrap_or(rest.len());
    rest = &rest[..end];
    let mut args = Map::new();
    while let Some(at) = rest.find("<parameter=") {
        let p = &rest[at + "<parameter=".len()..];
        let close = p.find('>')?;
        let key = p[..close].trim().to_string();
        let v = &p[close + 1..];
        // A missing `</parameter>` ends the value at the next parameter.
        let (value, next) = match (v.find("</parameter>"), v.find("<parameter=")) {
            (Some(e), n) if n.is_none_or(|n| e < n) => (&v[..e], &v[e + "</parameter>".len()..]),
            (_, Some(n)) => (&v[..n], &v[n..]),
            _ => (v, ""),
        };
        // The template writes one newline on each side of the value.
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let typed = typed_value(tools, &name, &key, value, None);
        args.insert(key, typed);
        rest = next;
    }
    Some(ToolCall {
        name,
        arguments: Value::Object(args).to_string(),
    })
}

/// DeepSeek-V4's DSML block (delimiters already in their full-width spelling).
fn parse_dsml(text: &str, tools: &[Value]) -> Option<Vec<ToolCall>> {
    let invoke = format!("<{DSML}invoke");
    let invoke_end = format!("</{DSML}invoke>");
    let param = format!("<{DSML}parameter");
    let param_end = format!("</{DSML}parameter>");
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(&invoke) {
        let p = &rest[at + invoke.len()..];
        let close = p.find('>')?;
        let name = attr(&p[..close], "name")?;
        let body_all = &p[close + 1..];
        let (body, next) = match body_all.find(&invoke_end) {
            Some(e) => (&body_all[..e], &body_all[e + invoke_end.len()..]),
            None => (body_all, ""),
        };
        let mut args = Map::new();
        let mut b = body;
        while let Some(at) = b.find(&param) {
            let q = &b[at + param.len()..];
            let close = q.find('>')?;
            let head = &q[..close];
            let key = attr(head, "name")?;
            let is_string = attr(head, "string").map(|s| s == "true");
            let v = &q[close + 1..];
            let (value, after) = match v.find(&param_end) {
                Some(e) => (&v[..e], &v[e + param_end.len()..]),
                None => (v, ""),
            };
            let typed = typed_value(tools, &name, &key, value, is_string);
            args.insert(key, typed);
            b = after;
        }
        calls.push(ToolCall {
            name,
            arguments: Value::Object(args).to_string(),
        });
        rest = next;
    }
    Some(calls)
}

/// `key="value"` inside a tag head.
fn attr(head: &str, key: &str) -> Option<String> {
    let pat = format!("{key}=\"");
    let mut from = 0;
    // Match `key=` only as a whole attribute name (not the tail of another).
    while let Some(i) = head[from..].find(&pat) {
        let at = from + i;
        if at == 0 || head[..at].ends_with(char::is_whitespace) {
            let v = &head[at + pat.len()..];
            return Some(v[..v.find('"')?].to_string());
        }
        from = at + pat.len();
    }
    None
}

/// A raw parameter value as JSON. `is_string` is DSML's own marker; otherwise the tool's
/// schema decides: a `string` parameter stays text, anything else is read as JSON when it
/// parses (a number, a bool, an object) and kept as text when it does not.
fn typed_value(
    tools: &[Value],
    func: &str,
    key: &str,
    raw: &str,
    is_string: Option<bool>,
) -> Value {
    let as_string = match is_string {
        Some(s) => s,
        None => schema_type(tools, func, key).is_some_and(|t| t == "string"),
    };
    if as_string {
        return Value::String(raw.to_string());
    }
    serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_string()))
}

fn schema_type<'a>(tools: &'a [Value], func: &str, key: &str) -> Option<&'a str> {
    let f = tools
        .iter()
        .filter_map(|t| t.get("function"))
        .find(|f| f.get("name").and_then(Value::as_str) == Some(func))?;
    f.pointer(&format!(
        "/parameters/properties/{}/type",
        key.replace('~', "~0").replace('/', "~1")
    ))?
    .as_str()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(p: &mut OutputParser, chunks: &[&str]) -> (String, String, Vec<ToolCall>) {
        let (mut content, mut reasoning) = (String::new(), String::new());
        let mut take = |ps: Vec<Piece>| {
            for x in ps {
                match x {
                    Piece::Content(s) => content.push_str(&s),
                    Piece::Reasoning(s) => reasoning.push_str(&s),
                }
            }
        };
        for c in chunks {
            take(p.push(c));
        }
        let (rest, calls) = p.finish();
        take(rest);
        (content, reasoning, calls)
    }

    /// Every way of cutting `text` into two pieces gives the same result as the whole.
    fn all_splits(make: impl Fn() -> OutputParser, text: &str) -> (String, String, Vec<ToolCall>) {
        let whole = run(&mut make(), &[text]);
        for (i, _) in text.char_indices() {
            let got = run(&mut make(), &[&text[..i], &text[i..]]);
            assert_eq!(got, whole, "split at {i}");
        }
        // One character at a time, as a token stream might arrive.
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(&mut make(), &refs), whole);
        whole
    }

    #[test]
    fn reasoning_is_split_from_content() {
        let (c, r, _) = all_splits(
            || OutputParser::new(true, false, None),
            "<think>\nLet me see.\n</think>\n\nThe answer is 4.",
        );
        assert_eq!(r, "Let me see.");
        assert_eq!(c, "The answer is 4.");
        // The template opened the block: the reply starts inside it.
        let (c, r, _) = all_splits(
            || OutputParser::new(true, true, None),
            "Hmm, 2+2.\n</think>\n\n4",
        );
        assert_eq!((c.as_str(), r.as_str()), ("4", "Hmm, 2+2."));
        // Reasoning off: the tags are content.
        let (c, r, _) = all_splits(|| OutputParser::new(false, true, None), "<think>x</think>y");
        assert_eq!((c.as_str(), r.as_str()), ("<think>x</think>y", ""));
        // A `<think>` that is not at the start is content.
        let (c, _, _) = all_splits(|| OutputParser::new(true, false, None), "a <think>b");
        assert_eq!(c, "a <think>b");
        // Unfinished reasoning stays reasoning.
        let (c, r, _) = all_splits(|| OutputParser::new(true, true, None), "still thinking");
        assert_eq!((c.as_str(), r.as_str()), ("", "still thinking"));
    }

    #[test]
    fn qwen_xml_tool_calls() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}}),
        ];
        let text = "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>";
        let (c, _, calls) =
            all_splits(|| OutputParser::new(true, false, Some(tools.clone())), text);
        assert_eq!(c, "Let me check.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert_eq!(args, json!({"city": "Paris", "days": 3, "zip": "75001"}));
    }

    #[test]
    fn qwen_json_tool_calls_and_several() {
        let text = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
        let (c, _, calls) = all_splits(|| OutputParser::new(true, false, Some(vec![])), text);
        assert_eq!(c, "");
        assert_eq!(
            calls,
            vec![
                ToolCall {
                    name: "a".into(),
                    arguments: "{\"x\":1}".into()
                },
                ToolCall {
                    name: "b".into(),
                    arguments: "{}".into()
                }
            ]
        );
    }

    #[test]
    fn deepseek_dsml_tool_calls() {
        let text = "<think>need weather</think>I will look.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">杭州</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">5</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"now\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        let (c, r, calls) = all_splits(|| OutputParser::new(true, false, Some(vec![])), text);
        assert_eq!((c.as_str(), r.as_str()), ("I will look.", "need weather"));
        assert_eq!(calls.len(), 2);
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert_eq!(args, json!({"city": "杭州", "days": 5}));
        assert_eq!(
            calls[1],
            ToolCall {
                name: "now".into(),
                arguments: "{}".into()
            }
        );
        // ASCII pipes.
        let ascii = text.replace('｜', "|");
        let (_, _, calls2) = run(&mut OutputParser::new(true, false, Some(vec![])), &[&ascii]);
        assert_eq!(calls2, calls);
    }

    #[test]
    fn broken_tool_calls_come_back_as_content() {
        let text = "x <tool_call>\n<nonsense";
        let (c, _, calls) = run(&mut OutputParser::new(true, false, Some(vec![])), &[text]);
        assert!(calls.is_empty());
        assert_eq!(c, "x<tool_call>\n<nonsense");
        // Without tools the markers are plain content.
        let (c, _, calls) = run(
            &mut OutputParser::new(true, false, None),
            &["a <tool_call>{}"],
        );
        assert!(calls.is_empty());
        assert_eq!(c, "a <tool_call>{}");
    }

    #[test]
    fn prompt_thinking_state() {
        assert!(OutputParser::prompt_opens_thinking(
            "<|im_start|>assistant\n<think>\n"
        ));
        assert!(!OutputParser::prompt_opens_thinking(
            "assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!OutputParser::prompt_opens_thinking(
            "<｜Assistant｜></think>"
        ));
        assert!(!OutputParser::prompt_opens_thinking("hello"));
    }
}
