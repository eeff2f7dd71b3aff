//! Structured output: a request's `response_format`, `json_schema`, `grammar` or forced
//! `tool_choice` becomes an llguidance grammar, and a [`Matcher`] per request says before each
//! token which tokens may come next (a bitset over the vocabulary, [`mask`]).
//!
//! llguidance is the constraint engine llama.cpp (`--grammar` with `%llguidance`) and vLLM use:
//! JSON schemas (with local `$ref`), its Lark dialect, one mask per step in tens of µs for a
//! 128k vocabulary. Every constraint here is written as a Lark grammar: a JSON schema as its
//! `%json {...}` rule, llama-server's GBNF converted by [`gbnf_to_lark`] (llguidance reads
//! Lark, not GBNF). JSON is generated compact (no free whitespace), so an output ends when its
//! value does rather than wander through blanks.

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, InferenceCapabilities, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use crate::tokenizer::Tokenizer;

/// What a request's output must follow.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    /// A JSON value of this schema. `strict: false` ignores schema keywords llguidance cannot
    /// enforce (its `lenient` mode); `strict: true` refuses the schema instead.
    Json { schema: Value, strict: bool },
    /// A grammar in llguidance's Lark dialect (GBNF already converted).
    Lark(String),
    /// One call of one of these tools (`{"type": "function", "function": {...}}` each), in
    /// the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form the output parser
    /// reads (`output::parse_tool_calls`); the arguments follow the tool's `parameters`.
    ToolCall(Vec<Value>),
}

/// A [`Constraint`] and the request field it came from, for errors.
#[derive(Clone, Debug)]
pub struct Requested {
    pub constraint: Constraint,
    pub param: &'static str,
}

impl Constraint {
    /// The Lark grammar of the constraint; `prefix` is text the output must start with (the
    /// `</think>` that closes a reasoning block the prompt opened, so the constrained part
    /// lands in `content`).
    pub fn lark(&self, prefix: &str) -> String {
        let body = match self {
            Constraint::Json { schema, strict } => json_rule(schema, *strict),
            Constraint::Lark(g) => return with_prefix(g, prefix),
            Constraint::ToolCall(tools) => {
                let calls: Vec<Value> = tools.iter().map(tool_call_schema).collect();
                format!(
                    "{} {} {}",
                    lark_str("<tool_call>\n"),
                    json_rule(&json!({ "anyOf": calls }), false),
                    lark_str("\n</tool_call>")
                )
            }
        };
        if prefix.is_empty() {
            format!("start: {body}\n")
        } else {
            format!("start: {} {body}\n", lark_str(prefix))
        }
    }
}

/// A Lark grammar whose `start` is `prefix` then the grammar's own start.
fn with_prefix(g: &str, prefix: &str) -> String {
    if prefix.is_empty() {
        return g.to_string();
    }
    // `%lark { ... }` nests a grammar with its own start rule (llguidance's syntax).
    format!("start: {} %lark {{\n{g}\n}}\n", lark_str(prefix))
}

/// `%json {schema}` with llguidance's options: compact output; lenient unless strict.
fn json_rule(schema: &Value, strict: bool) -> String {
    let mut s = match schema {
        Value::Object(_) => schema.clone(),
        // `true` (anything) and other non-object schemas: llguidance wants an object.
        Value::Bool(true) => json!({}),
        other => other.clone(),
    };
    if let Value::Object(m) = &mut s {
        m.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "lenient": !strict}),
        );
    }
    format!("%json {s}")
}

/// The JSON schema of one call of `tool`: `{"name": NAME, "arguments": PARAMETERS}`.
fn tool_call_schema(tool: &Value) -> Value {
    let f = tool.get("function").unwrap_or(tool);
    let name = f.get("name").cloned().unwrap_or(Value::Null);
    let params = match f.get("parameters") {
        Some(p @ Value::Object(_)) => p.clone(),
        _ => json!({"type": "object"}),
    };
    json!({
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": false,
    })
}

/// A Lark string literal (llguidance reads its escapes as JSON's).
fn lark_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// Compiles constraints against one vocabulary.
pub struct Constrainer {
    factory: ParserFactory,
}

impl Constrainer {
    /// The token trie of `tok`'s vocabulary, `vocab` ids long (the model's logits, which may
    /// pad past the tokenizer's ids). Special tokens, and ids with no text, are spelled with
    /// toktrie's marker byte (0xFF, never in UTF-8 text) so no text rule can produce them;
    /// `eos` is what a finished grammar allows next.
    pub fn new(tok: &Tokenizer, vocab: usize) -> Result<Constrainer, String> {
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tok.token_bytes(id) {
                Some(b) if !b.is_empty() && !tok.is_special(id) => b.to_vec(),
                Some(b) if !b.is_empty() => [&[TokTrie::SPECIAL_TOKEN_MARKER], b].concat(),
                _ => [
                    &[TokTrie::SPECIAL_TOKEN_MARKER][..],
                    format!("<[{id}]>").as_bytes(),
                ]
                .concat(),
            })
            .collect();
        let eos = tok
            .eot_id()
            .or(tok.eos_id())
            .or(tok.eog_ids().first().copied())
            .ok_or("the vocabulary has no end-of-generation token to end a constrained reply")?;
        let mut info = TokRxInfo::new(vocab as u32, eos);
        info.tok_bos = tok.bos_id();
        info.tok_pad = tok.pad_id();
        let trie = TokTrie::from(&info, &words);
        let env: llguidance::toktrie::TokEnv = std::sync::Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| e.to_string())?;
        // Grammar errors come back to the request; nothing on stderr.
        factory.quiet();
        Ok(Constrainer { factory })
    }

    /// A fresh matcher for `c` (`prefix`: see [`Constraint::lark`]), or why the grammar or
    /// schema does not compile.
    pub fn matcher(&self, c: &Constraint, prefix: &str) -> Result<Matcher, String> {
        let grammar = TopLevelGrammar::from_lark(c.lark(prefix));
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let m = Matcher::new(Ok(parser));
        match m.get_error() {
            Some(e) => Err(e),
            None => Ok(m),
        }
    }
}

/// The tokens `m` allows next, as a bitset (bit `i % 32` of word `i / 32`).
pub fn mask(m: &mut Matcher) -> Result<Vec<u32>, String> {
    m.compute_mask()
        .map(|v| v.as_slice().to_vec())
        .map_err(|e| e.to_string())
}

/// llama.cpp's GBNF (`grammars/README.md` there) as an llguidance Lark grammar: rules
/// `name ::= ...` become `name: ...` (names mangled to Lark's lowercase rule names, `root`
/// the start), literals keep their text, character classes and `.` become one-character
/// regexes, `{m,n}` repetitions and groups carry over.
pub fn gbnf_to_lark(src: &str) -> Result<String, String> {
    let toks = gbnf_tokens(src)?;
    let mut out = String::from("start: r_root\n");
    let mut i = 0;
    let mut have_root = false;
    while i < toks.len() {
        let GTok::Name(name) = &toks[i] else {
            return Err(format!("expected a rule name, found {}", toks[i].show()));
        };
        if toks.get(i + 1) != Some(&GTok::Def) {
            return Err(format!("expected `::=` after rule name `{name}`"));
        }
        have_root |= name == "root";
        out.push_str(&rule_name(name));
        out.push(':');
        i += 2;
        let start = i;
        // The body runs to the next `name ::=`.
        while i < toks.len()
            && !(matches!(toks[i], GTok::Name(_)) && toks.get(i + 1) == Some(&GTok::Def))
        {
            i += 1;
        }
        if start == i {
            return Err(format!("rule `{name}` is empty"));
        }
        for t in &toks[start..i] {
            out.push(' ');
            match t {
                GTok::Name(n) => out.push_str(&rule_name(n)),
                GTok::Lit(s) if s.is_empty() => out.push_str("\"\""),
                GTok::Lit(s) => out.push_str(&lark_str(s)),
                GTok::Class(rx) => {
                    out.push('/');
                    out.push_str(rx);
                    out.push('/');
                }
                GTok::Sym(c) => out.push(*c),
                GTok::Rep(a, b) => match b {
                    Some(b) => out.push_str(&format!("{{{a},{b}}}")),
                    None => out.push_str(&format!("{{{a},}}")),
                },
                GTok::Def => return Err("`::=` without a rule name".into()),
            }
        }
        out.push('\n');
    }
    if !have_root {
        return Err("the grammar has no `root` rule".into());
    }
    Ok(out)
}

/// A GBNF rule name as a Lark rule name: lowercase letters and digits kept, others spelled
/// out, so distinct names stay distinct.
fn rule_name(n: &str) -> String {
    let mut s = String::from("r_");
    for c in n.chars() {
        match c {
            'a'..='z' | '0'..='9' => s.push(c),
            'A'..='Z' => {
                s.push_str("_u");
                s.push(c.to_ascii_lowercase());
            }
            '-' => s.push_str("_h"),
            _ => s.push_str("__"),
        }
    }
    s
}

#[derive(Debug, PartialEq)]
enum GTok {
    Name(String),
    Def,
    Lit(String),
    /// A one-character regex (a class or any character).
    Class(String),
    /// `(`, `)`, `|`, `*`, `+`, `?`.
    Sym(char),
    Rep(u32, Option<u32>),
}

impl GTok {
    fn show(&self) -> String {
        match self {
            GTok::Name(n) => format!("`{n}`"),
            GTok::Def => "`::=`".into(),
            GTok::Lit(s) => format!("{s:?}"),
            GTok::Class(c) => format!("/{c}/"),
            GTok::Sym(c) => format!("`{c}`"),
            GTok::Rep(a, b) => format!("{{{a},{b:?}}}"),
        }
    }
}

fn gbnf_tokens(src: &str) -> Result<Vec<GTok>, String> {
    let cs: Vec<char> = src.chars().collect();
    let mut i = 0;
    let mut out = Vec::new();
    while i < cs.len() {
        let c = cs[i];
        match c {
            c if c.is_whitespace() => i += 1,
            '#' => {
                while i < cs.len() && cs[i] != '\n' {
                    i += 1;
                }
            }
            ':' if cs[i..].starts_with(&[':', ':', '=']) => {
                out.push(GTok::Def);
                i += 3;
            }
            '"' => {
                i += 1;
                let mut s = String::new();
                loop {
                    match cs.get(i) {
                        None => return Err("a string literal is not closed".into()),
                        Some('"') => break,
                        Some('\\') => {
                            let (ch, n) = gbnf_escape(&cs[i..])?;
                            s.push(ch);
                            i += n;
                        }
                        Some(&ch) => {
                            s.push(ch);
                            i += 1;
                        }
                    }
                }
                i += 1;
                out.push(GTok::Lit(s));
            }
            '[' => {
                i += 1;
                let mut rx = String::from("[");
                if cs.get(i) == Some(&'^') {
                    rx.push('^');
                    i += 1;
                }
                // Characters so far: a `-` first or last is itself, else a range.
                let mut n_chars = 0;
                loop {
                    match cs.get(i) {
                        None => return Err("a character class `[` is not closed".into()),
                        Some(']') => break,
                        Some('-') if n_chars > 0 && cs.get(i + 1) != Some(&']') => {
                            rx.push('-');
                            i += 1;
                        }
                        Some(&ch) => {
                            let (ch, n) = if ch == '\\' {
                                gbnf_escape(&cs[i..])?
                            } else {
                                (ch, 1)
                            };
                            i += n;
                            n_chars += 1;
                            rx.push_str(&regex_class_char(ch));
                        }
                    }
                }
                i += 1;
                rx.push(']');
                out.push(GTok::Class(rx));
            }
            '.' => {
                out.push(GTok::Class("(?s:.)".into()));
                i += 1;
            }
            '(' | ')' | '|' | '*' | '+' | '?' => {
                out.push(GTok::Sym(c));
                i += 1;
            }
            '{' => {
                let end = cs[i..]
                    .iter()
                    .position(|&c| c == '}')
                    .ok_or("a repetition `{` is not closed")?;
                let inner: String = cs[i + 1..i + end].iter().collect();
                let num = |s: &str| {
                    s.trim()
                        .parse::<u32>()
                        .map_err(|_| format!("repetition `{{{inner}}}`: expected numbers"))
                };
                let (a, b) = match inner.split_once(',') {
                    None => (num(&inner)?, Some(num(&inner)?)),
                    Some((a, b)) => (
                        if a.trim().is_empty() { 0 } else { num(a)? },
                        if b.trim().is_empty() {
                            None
                        } else {
                            Some(num(b)?)
                        },
                    ),
                };
                if b == Some(0) {
                    // `x{0}` is nothing: an empty literal, and the atom before it repeated 0..=1
                    // times would be wrong, so refuse it plainly.
                    return Err(format!("repetition `{{{inner}}}` allows nothing"));
                }
                out.push(GTok::Rep(a, b));
                i += end + 1;
            }
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let st = i;
                while i < cs.len()
                    && (cs[i].is_ascii_alphanumeric() || cs[i] == '-' || cs[i] == '_')
                {
                    i += 1;
                }
                out.push(GTok::Name(cs[st..i].iter().collect()));
            }
            c => return Err(format!("unexpected character `{c}`")),
        }
    }
    Ok(out)
}

/// The character of a GBNF escape at `s[0] == '\\'` and how many chars it takes.
fn gbnf_escape(s: &[char]) -> Result<(char, usize), String> {
    let hex = |n: usize| -> Result<(char, usize), String> {
        let h: String = s.iter().skip(2).take(n).collect();
        u32::from_str_radix(&h, 16)
            .ok()
            .filter(|_| h.len() == n)
            .and_then(char::from_u32)
            .map(|c| (c, 2 + n))
            .ok_or_else(|| format!("bad escape `\\{}{h}`", s[1]))
    };
    match s.get(1) {
        Some('n') => Ok(('\n', 2)),
        Some('r') => Ok(('\r', 2)),
        Some('t') => Ok(('\t', 2)),
        Some('x') => hex(2),
        Some('u') => hex(4),
        Some('U') => hex(8),
        Some(&c @ ('\\' | '"' | '[' | ']' | '-' | '^')) => Ok((c, 2)),
        Some(c) => Err(format!("unknown escape `\\{c}`")),
        None => Err("a `\\` ends the grammar".into()),
    }
}

/// A character inside a regex class `[...]`, escaped where the regex syntax (or the Lark
/// `/.../` delimiter) would read it otherwise.
fn regex_class_char(c: char) -> String {
    match c {
        '\\' | ']' | '[' | '^' | '-' | '/' | '&' | '~' => format!("\\{c}"),
        '\n' => "\\n".into(),
        '\r' => "\\r".into(),
        '\t' => "\\t".into(),
        c => c.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gbnf_converts_to_lark() {
        let g = r#"
            # a list of small words
            root ::= "[" item ("," item){0,3} "]"
            item ::= [a-z\-]+ | "\"q\"" | my-Rule
            my-Rule ::= [^\n\]]? .
        "#;
        let lark = gbnf_to_lark(g).unwrap();
        assert_eq!(
            lark,
            "start: r_root\n\
             r_root: \"[\" r_item ( \",\" r_item ) {0,3} \"]\"\n\
             r_item: /[a-z\\-]/ + | \"\\\"q\\\"\" | r_my_h_urule\n\
             r_my_h_urule: /[^\\n\\]]/ ? /(?s:.)/\n"
        );
        assert!(gbnf_to_lark("item ::= \"a\"").unwrap_err().contains("root"));
        assert!(gbnf_to_lark("root ::= \"a")
            .unwrap_err()
            .contains("not closed"));
        assert!(gbnf_to_lark("root ::= [a")
            .unwrap_err()
            .contains("not closed"));
        assert!(gbnf_to_lark("root = \"a\"").is_err());
    }

    #[test]
    fn json_constraints_are_compact_and_lenient_unless_strict() {
        let c = Constraint::Json {
            schema: json!({"type": "object"}),
            strict: true,
        };
        let l = c.lark("");
        assert!(l.starts_with("start: %json {"), "{l}");
        assert!(l.contains("\"whitespace_flexible\":false"), "{l}");
        assert!(l.contains("\"lenient\":false"), "{l}");
        let l = c.lark("</think>\n\n");
        assert!(l.starts_with("start: \"</think>\\n\\n\" %json"), "{l}");
    }
}
