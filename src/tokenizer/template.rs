//! Chat templates: the Jinja programs that models ship to turn a list of messages into the
//! prompt text, rendered by minijinja the way transformers' `apply_chat_template` renders them
//! with Jinja2:
//! - `trim_blocks` and `lstrip_blocks` on, a single trailing newline of the source dropped;
//! - lenient undefined: an unknown variable renders empty and tests false;
//! - Python's string and dict methods (`.startswith`, `.split`, `.items()`, ...) through
//!   minijinja-contrib's `pycompat`;
//! - `raise_exception(msg)`, `strftime_now(fmt)`, and transformers' `tojson` (json.dumps with
//!   `ensure_ascii=False`, Python's separators, `indent`, `sort_keys`);
//! - `none` prints as `None` and booleans as `True`/`False`, as Python prints them;
//! - transformers' `{% generation %}` tag (used for assistant masks) renders its body.

use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::{filters, Environment, ErrorKind, UndefinedBehavior};

use crate::error::{escaped, Error, Result};

/// Text of a message's `content`: a string, or the `text` of its parts.
macro_rules! text_of {
    () => {
        r#"{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content if part is mapping and part.text is defined -%}
            {{- part.text -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"#
    };
}

pub(super) use text_of;

/// lathe's default template (ChatML, as Qwen models speak it), for models that carry none.
/// A message's `content` may be a string or a list of `{"type": "text", "text": ...}` parts.
pub const CHATML: &str = concat!(
    text_of!(),
    r#"{%- for message in messages -%}
    {{- '<|im_start|>' + message.role + '\n' + text_of(message.content) + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"#
);

const NAME: &str = "chat_template";

/// How much work one rendering may do and how large the values it builds may grow, so that a
/// template (from a model file or `--chat-template`) whose loops never end, or which doubles a
/// string in a loop, stops with an error instead of holding a CPU or taking memory without
/// bound. Fuel counts steps, not bytes, and minijinja has no memory limit, so sizes are checked
/// where values grow: after every `{% set %}` (the template is rewritten to pass each assigned
/// value through a check), in every builtin that can build a long string from short arguments
/// (`indent`, `format`, `replace`, `join`, `string`, `list`, `pprint`, `tojson`, and the Python
/// methods `.replace`, `.format`, `.join`), and on every `{{ }}` emission, captured ones
/// included. What remains unchecked grows by at most the template's own length per step: a
/// single expression (`a ~ a ~ a`) and raw text inside a captured block. A macro that recurses
/// with a doubled argument (`f(s ~ s)`) is the one known way around the checks; minijinja's
/// recursion limit (500 calls) is then the only bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TemplateLimits {
    /// minijinja "fuel": instructions one rendering may execute. Qwen3.5's and
    /// DeepSeek-V4's templates over a 150-message conversation with tools take under
    /// 30,000; the default allows ~700 times that (a runaway loop stops after ~1 s of CPU).
    pub fuel: u64,
    /// Bytes one rendering may write, and may emit into captured blocks.
    pub max_output: usize,
    /// Bytes one value may take (a string's length; a list's or map's items, summed).
    pub max_value: usize,
    /// How deep values may nest, and `tojson` may descend.
    pub max_depth: usize,
}

impl Default for TemplateLimits {
    fn default() -> TemplateLimits {
        TemplateLimits {
            fuel: 20_000_000,
            max_output: 64 << 20,
            // The largest real conversations (150 messages with tools) are well under 1 MiB.
            max_value: 16 << 20,
            // serde_json refuses input nested deeper than 128, so messages never reach this.
            max_depth: 256,
        }
    }
}

/// The stack of the thread each rendering runs on: minijinja recurses on nested values and
/// macro calls, and `max_depth` levels of `tojson` or 500 macro calls (minijinja's recursion
/// limit) must fit whatever thread asked for the rendering (tokio's blocking threads have
/// 2 MiB). Reserved, not committed: the pages are touched only as deep as a rendering goes.
const RENDER_STACK: usize = 64 << 20;

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    limits: TemplateLimits,
}

impl ChatTemplate {
    /// Compiles a template with the default [`TemplateLimits`]; a syntax error comes back
    /// with its line.
    pub fn new(source: &str) -> Result<ChatTemplate> {
        ChatTemplate::with_limits(source, TemplateLimits::default())
    }

    /// Compiles a template whose renderings stop at `limits`.
    pub fn with_limits(source: &str, limits: TemplateLimits) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_fuel(Some(limits.fuel));
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_unknown_method_callback(move |state, value, method, args| {
            python_method(state, value, method, args, &limits)
        });
        env.set_formatter(move |out, state, value| python_formatter(out, state, value, &limits));
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", move |v: &Value, args: Rest<Value>| {
            tojson(v, args, &limits)
        });
        env.add_filter("from_json", from_json);
        env.add_filter(
            CHECKED,
            move |v: Value| -> std::result::Result<Value, minijinja::Error> {
                check_size(&v, &limits)?;
                Ok(v)
            },
        );
        let builtins: [(&'static str, Value, SizeBound); 6] = [
            ("indent", Value::from_function(filters::indent), indent_size),
            ("format", Value::from_function(filters::format), format_size),
            (
                "replace",
                Value::from_function(filters::replace),
                replace_size,
            ),
            ("join", Value::from_function(filters::join), join_size),
            ("string", Value::from_function(filters::string), first_size),
            ("list", Value::from_function(filters::list), first_size),
        ];
        for (name, builtin, bound) in builtins {
            env.add_filter(name, move |state: &minijinja::State, args: Rest<Value>| {
                bounded_call(&args, &limits, bound, || builtin.call(state, &args))
            });
        }
        env.add_filter(
            "pprint",
            move |state: &minijinja::State, args: Rest<Value>| {
                bounded_call(&args, &limits, first_size, || {
                    Value::from_function(filters::pprint).call(state, &args)
                })
            },
        );
        env.add_template_owned(NAME, rewrite_tags(source))
            .map_err(|e| Error::Invalid(format!("chat template: {}", describe(&e))))?;
        Ok(ChatTemplate { env, limits })
    }

    /// Renders the prompt for `messages` (a JSON list of `{role, content, ...}`). `extra`
    /// holds the other variables a template may read: `bos_token`, `eos_token`, `tools`,
    /// `enable_thinking`, ... (transformers passes `tools` and `documents` as None when
    /// absent, and so does this).
    pub fn render(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("lathe-template".into())
                .stack_size(RENDER_STACK)
                .spawn_scoped(scope, || {
                    self.render_here(messages, add_generation_prompt, extra)
                })
                .map_err(|e| Error::Invalid(format!("chat template: no thread to render on: {e}")))?
                .join()
                .map_err(|_| Error::Invalid("chat template: the rendering panicked".into()))?
        })
    }

    fn render_here(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let mut ctx = extra.clone();
        for key in ["tools", "documents"] {
            ctx.entry(key).or_insert(serde_json::Value::Null);
        }
        ctx.insert("messages".into(), messages.clone());
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| Error::Invalid(format!("chat template: {}", describe(&e))))?;
        let mut out = CappedWriter {
            buf: Vec::new(),
            cap: self.limits.max_output,
            over: false,
        };
        let rendered = tmpl.render_captured_to(Value::from_serialize(&ctx), &mut out);
        if out.over {
            return Err(Error::Invalid(format!(
                "chat template: the rendering is longer than {} bytes (the template's output limit)",
                self.limits.max_output
            )));
        }
        match rendered {
            Ok(_) => String::from_utf8(out.buf)
                .map_err(|e| Error::Invalid(format!("chat template: output is not UTF-8: {e}"))),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(Error::Invalid(format!(
                "chat template: the rendering took more than {} steps (the template's fuel limit): a loop that does not end, or too much work for these messages",
                self.limits.fuel
            ))),
            Err(e) => Err(Error::Invalid(format!("chat template: {}", describe(&e)))),
        }
    }
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

/// The rendering's bytes, refusing to grow past `cap` (minijinja then stops with a write
/// error, which [`ChatTemplate::render`] reports as the output limit).
struct CappedWriter {
    buf: Vec<u8>,
    cap: usize,
    over: bool,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.cap {
            self.over = true;
            return Err(std::io::Error::other("template output limit"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The error's text, its cause (a `raise_exception` message) and the template line.
fn describe(e: &minijinja::Error) -> String {
    // A `raise_exception` message is the template's text: it may hold newlines or
    // terminal escapes.
    let mut s = escaped(&match e.detail() {
        Some(d) if e.kind() == ErrorKind::InvalidOperation => d.to_string(),
        _ => e.to_string(),
    });
    if let Some(line) = e.line() {
        if !s.contains("line") {
            s.push_str(&format!(" (line {line})"));
        }
    }
    s
}

/// The filter every `{% set %}` passes its value through (see [`rewrite_tags`]).
const CHECKED: &str = "__lathe_checked";

/// Rewrites two kinds of tag before compiling:
/// - transformers adds a `{% generation %}...{% endgeneration %}` block tag for assistant token
///   masks; rendering ignores it. Rewriting the tags as `{% if true %}`/`{% endif %}` keeps
///   their whitespace-control dashes, so the text around them trims exactly as before.
/// - `{% set target = expr %}` becomes `{% set target = (expr)|__lathe_checked %}`, which
///   returns the value after checking its size against [`TemplateLimits`]: assignments are
///   where a template's values grow from one step to the next (`ns.s = ns.s ~ ns.s`).
///
/// The line count stays the same, so errors name the template's own lines.
fn rewrite_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag_end(tag) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let open_ws = if inner.starts_with(['-', '+']) {
            &inner[..1]
        } else {
            ""
        };
        let close_ws = if inner.ends_with(['-', '+']) && inner.len() > open_ws.len() {
            &inner[inner.len() - 1..]
        } else {
            ""
        };
        let word = &inner[open_ws.len()..inner.len() - close_ws.len()];
        let assignment = word
            .trim_start()
            .strip_prefix("set")
            .filter(|r| r.starts_with(char::is_whitespace))
            .and_then(|r| r.split_once('='))
            .filter(|(target, _)| {
                target
                    .chars()
                    .all(|c| c.is_alphanumeric() || c.is_whitespace() || "_.,()".contains(c))
            });
        match (word.trim(), assignment) {
            ("generation", _) => out.push_str(&format!("{{%{open_ws} if true {close_ws}%}}")),
            ("endgeneration", _) => out.push_str(&format!("{{%{open_ws} endif {close_ws}%}}")),
            // A target is names, dots, commas and parentheses, so its first `=` is the
            // assignment's; `expr` keeps its own whitespace and newlines.
            (_, Some((target, expr))) => out.push_str(&format!(
                "{{%{open_ws} set{target}= ({expr})|{CHECKED} {close_ws}%}}"
            )),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Where the `%}` that closes the tag starting `tag` is, skipping quoted strings (a set may
/// assign `'%}'`).
fn tag_end(tag: &str) -> Option<usize> {
    let b = tag.as_bytes();
    let mut quote = None;
    let mut i = 2;
    while i + 1 < b.len() {
        match (quote, b[i]) {
            (Some(_), b'\\') => i += 1,
            (Some(q), c) if c == q => quote = None,
            (None, b'\'' | b'"') => quote = Some(b[i]),
            (None, b'%') if b[i + 1] == b'}' => return Some(i),
            _ => {}
        }
        i += 1;
    }
    None
}

/// What one item of a list or map costs besides its content: a minijinja `Value` is 24 bytes.
/// Counting it also bounds the work of a check (a map that holds itself twice, doubled in a
/// loop, is walked at most `max_value / 24` items deep each time).
const VALUE_BYTES: usize = 24;

/// Bytes `v` takes, counted as its text roughly would be (a string's length, 8 for a number,
/// a container's items and keys plus [`VALUE_BYTES`] each), refused once past `limits.max_value` or
/// nested deeper than `limits.max_depth`. Stops counting at the limit, so a lazily repeated
/// list (`[x] * 10**12`) costs no more than the limit to check.
fn check_size(v: &Value, limits: &TemplateLimits) -> std::result::Result<usize, minijinja::Error> {
    let mut total = 0;
    add_size(v, limits, 0, &mut total)?;
    Ok(total)
}

fn add_size(
    v: &Value,
    limits: &TemplateLimits,
    depth: usize,
    total: &mut usize,
) -> std::result::Result<(), minijinja::Error> {
    if depth > limits.max_depth {
        return Err(too_deep(limits));
    }
    match v.kind() {
        ValueKind::String => *total += v.as_str().map_or(0, str::len),
        ValueKind::Bytes => *total += v.as_bytes().map_or(0, <[u8]>::len),
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Map => {
            let is_map = v.kind() == ValueKind::Map;
            for item in v.try_iter()? {
                *total += VALUE_BYTES;
                if is_map {
                    add_size(&v.get_item(&item)?, limits, depth + 1, total)?;
                }
                add_size(&item, limits, depth + 1, total)?;
            }
        }
        _ => *total += 8,
    }
    if *total > limits.max_value {
        return Err(too_large(limits));
    }
    Ok(())
}

fn too_large(limits: &TemplateLimits) -> minijinja::Error {
    minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "a value larger than {} bytes (the template's value limit)",
            limits.max_value
        ),
    )
}

fn too_deep(limits: &TemplateLimits) -> minijinja::Error {
    minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "values nested deeper than {} (the template's depth limit)",
            limits.max_depth
        ),
    )
}

/// An upper bound on the bytes a builtin's result takes, from its arguments (the filtered
/// value first, keyword arguments last), or the error when an argument is already too large.
type SizeBound = fn(&[Value], &TemplateLimits) -> std::result::Result<usize, minijinja::Error>;

/// Calls a builtin once `bound` says its result fits `limits.max_value`, so the builtin never
/// allocates what the limit refuses (`indent(3000000000)` would ask for gigabytes at once).
fn bounded_call(
    args: &[Value],
    limits: &TemplateLimits,
    bound: SizeBound,
    call: impl FnOnce() -> std::result::Result<Value, minijinja::Error>,
) -> std::result::Result<Value, minijinja::Error> {
    if bound(args, limits)? > limits.max_value {
        return Err(too_large(limits));
    }
    call()
}

fn str_arg(args: &[Value], i: usize) -> &str {
    args.get(i).and_then(Value::as_str).unwrap_or_default()
}

/// A keyword argument's value, if the call passed keyword arguments.
fn kwarg(args: &[Value], name: &str) -> Option<Value> {
    let last = args.last().filter(|v| v.is_kwargs())?;
    Kwargs::try_from(last.clone())
        .ok()?
        .peek::<Value>(name)
        .ok()
}

fn first_size(
    args: &[Value],
    limits: &TemplateLimits,
) -> std::result::Result<usize, minijinja::Error> {
    args.first().map_or(Ok(0), |v| check_size(v, limits))
}

/// `indent(width)`: every line grows by `width`.
fn indent_size(args: &[Value], _: &TemplateLimits) -> std::result::Result<usize, minijinja::Error> {
    let width = args
        .get(1)
        .filter(|v| !v.is_kwargs())
        .cloned()
        .or_else(|| kwarg(args, "width"))
        .and_then(|v| v.as_usize())
        .unwrap_or(4);
    let s = str_arg(args, 0);
    Ok(width
        .saturating_mul(s.lines().count() + 1)
        .saturating_add(s.len()))
}

/// `format` / `.format`: the format string, every width or precision it names (any number in
/// it, `%3000000000d` or `{:>3000000000}`), and the arguments.
fn format_size(
    args: &[Value],
    limits: &TemplateLimits,
) -> std::result::Result<usize, minijinja::Error> {
    let fmt = str_arg(args, 0);
    let widths = fmt
        .split(|c: char| !c.is_ascii_digit())
        .filter(|d| !d.is_empty())
        .fold(0usize, |sum, d| {
            sum.saturating_add(d.parse().unwrap_or(usize::MAX))
        });
    let mut total = fmt.len().saturating_add(widths);
    for a in args.iter().skip(1) {
        total = total.saturating_add(check_size(a, limits)?);
    }
    Ok(total)
}

/// `replace(old, new)`: each match of `old` (every character boundary for an empty `old`)
/// becomes `new`.
fn replace_size(
    args: &[Value],
    _: &TemplateLimits,
) -> std::result::Result<usize, minijinja::Error> {
    let (s, old, new) = (str_arg(args, 0), str_arg(args, 1), str_arg(args, 2));
    let matches = if old.is_empty() {
        s.chars().count() + 1
    } else {
        s.matches(old).count()
    };
    Ok(matches.saturating_mul(new.len()).saturating_add(s.len()))
}

/// `join(sep)`: the items and one separator between each two.
fn join_size(
    args: &[Value],
    limits: &TemplateLimits,
) -> std::result::Result<usize, minijinja::Error> {
    let Some(items) = args.first() else {
        return Ok(0);
    };
    let sep = str_arg(args, 1).len();
    let mut total = 0usize;
    for item in items.try_iter()? {
        total = total
            .saturating_add(check_size(&item, limits)?)
            .saturating_add(sep);
        if total > limits.max_value {
            return Err(too_large(limits));
        }
    }
    Ok(total)
}

/// minijinja-contrib's Python methods (`.startswith`, `.items()`, ...), the three that build
/// strings from their arguments bounded as their filters are.
fn python_method(
    state: &minijinja::State,
    value: &Value,
    method: &str,
    args: &[Value],
    limits: &TemplateLimits,
) -> std::result::Result<Value, minijinja::Error> {
    let call = || minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args);
    if value.kind() != ValueKind::String {
        return call();
    }
    let with_self: Vec<Value> = std::iter::once(value.clone())
        .chain(args.iter().cloned())
        .collect();
    match method {
        "replace" => bounded_call(&with_self, limits, replace_size, call),
        "format" => bounded_call(&with_self, limits, format_size, call),
        // `sep.join(items)`: the items first, as the filter takes them.
        "join" => bounded_call(
            &[args.first().cloned().unwrap_or_default(), value.clone()],
            limits,
            join_size,
            call,
        ),
        _ => call(),
    }
}

/// Bytes emitted by `{{ }}` so far in one rendering, captured blocks (`{% set x %}...`)
/// included: a captured block's text is a value that no writer caps.
#[derive(Debug, Default)]
struct Emitted(std::sync::atomic::AtomicUsize);

impl minijinja::value::Object for Emitted {}

/// Prints values as Jinja2 prints Python objects: `None`, `True`, `False`; counts what it
/// prints against `limits.max_output`.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &minijinja::State,
    value: &Value,
    limits: &TemplateLimits,
) -> std::result::Result<(), minijinja::Error> {
    let emitted = state.get_or_set_temp_object("lathe_emitted", Emitted::default);
    let size = check_size(value, limits)?;
    let before = emitted
        .0
        .fetch_add(size, std::sync::atomic::Ordering::Relaxed);
    if before + size > limits.max_output {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "the rendering emits more than {} bytes (the template's output limit)",
                limits.max_output
            ),
        ));
    }
    match value.kind() {
        ValueKind::None => out.write_str("None").map_err(minijinja::Error::from),
        ValueKind::Bool => out
            .write_str(if value.is_true() { "True" } else { "False" })
            .map_err(minijinja::Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// Python's `datetime.now().strftime(fmt)`, in UTC.
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime_utc(fmt, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// C/Python `strftime` for the common directives (`%Y %y %m %B %b %d %e %j %A %a %H %I %M %S
/// %p %%`, and glibc's `%-d`-style unpadded forms) at `secs` after the Unix epoch, UTC.
pub fn strftime_utc(fmt: &str, secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (Monday = 0).
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (sod / 3600, sod % 3600 / 60, sod % 60);
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num = |v: i64, width: usize| {
            if unpadded {
                v.to_string()
            } else {
                format!("{v:0width$}")
            }
        };
        let text = match spec {
            Some('Y') => year.to_string(),
            Some('y') => num(year.rem_euclid(100), 2),
            Some('m') => num(month as i64, 2),
            Some('B') => MONTHS[month as usize - 1].to_string(),
            Some('b') | Some('h') => MONTHS[month as usize - 1][..3].to_string(),
            Some('d') => num(day as i64, 2),
            Some('e') => format!("{day:2}"),
            Some('j') => num(yday, 3),
            Some('A') => WEEKDAYS[weekday].to_string(),
            Some('a') => WEEKDAYS[weekday][..3].to_string(),
            Some('H') => num(hour, 2),
            Some('I') => num(hour12, 2),
            Some('M') => num(minute, 2),
            Some('S') => num(second, 2),
            Some('p') => (if hour < 12 { "AM" } else { "PM" }).to_string(),
            Some('%') => "%".to_string(),
            Some(other) => format!("%{}{other}", if unpadded { "-" } else { "" }),
            None => "%".to_string(),
        };
        out.push_str(&text);
    }
    out
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = year - i64::from(month <= 2);
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = month as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `from_json`: parses a JSON string (DeepSeek's template uses it on tool arguments).
fn from_json(s: &str) -> std::result::Result<Value, minijinja::Error> {
    let v: serde_json::Value = serde_json::from_str(s).map_err(|e| {
        minijinja::Error::new(ErrorKind::InvalidOperation, format!("from_json: {e}"))
    })?;
    Ok(Value::from_serialize(&v))
}

/// Options of Python's `json.dumps` that transformers' `tojson` exposes.
struct JsonStyle {
    ensure_ascii: bool,
    /// Text of one indentation level; None = everything on one line.
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    /// Refused: deeper than `max_depth` (the writer recurses) or longer than `max_value`.
    limits: TemplateLimits,
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// i.e. `json.dumps` with those arguments (positional or by name).
fn tojson(
    value: &Value,
    args: Rest<Value>,
    limits: &TemplateLimits,
) -> std::result::Result<Value, minijinja::Error> {
    let mut positional: Vec<Value> = args.0;
    let kwargs = match positional.last() {
        Some(last) if last.is_kwargs() => Kwargs::try_from(positional.pop().unwrap_or_default())?,
        _ => Kwargs::from_iter(std::iter::empty::<(&str, Value)>()),
    };
    if positional.len() > 4 {
        return Err(minijinja::Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes ensure_ascii, indent, separators, sort_keys",
        ));
    }
    let mut positional = positional.into_iter();
    let (ensure_ascii, indent, separators, sort_keys) = (
        positional.next(),
        positional.next(),
        positional.next(),
        positional.next(),
    );
    let pick =
        |pos: Option<Value>, name: &str| -> std::result::Result<Option<Value>, minijinja::Error> {
            Ok(match pos {
                Some(v) => Some(v),
                None => kwargs.get::<Option<Value>>(name)?,
            })
        };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match pick(indent, "indent")? {
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => Some(match v.as_i64() {
            Some(n) if n as u64 > limits.max_value as u64 => return Err(too_large(limits)),
            Some(n) => " ".repeat(n.max(0) as usize),
            None => v.to_string(),
        }),
        None => None,
    };
    let (mut item_sep, key_sep) = match indent {
        Some(_) => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let mut key_sep = key_sep;
    if let Some(seps) = pick(separators, "separators")?.filter(|v| !v.is_none()) {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        if parts.len() != 2 {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be (item_separator, key_separator)",
            ));
        }
        item_sep = parts[0].to_string();
        key_sep = parts[1].to_string();
    }
    let sort_keys = pick(sort_keys, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
        limits: *limits,
    };
    let mut out = String::new();
    write_json(value, &style, 0, &mut out)?;
    Ok(Value::from(out))
}

fn write_json(
    v: &Value,
    style: &JsonStyle,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    if depth > style.limits.max_depth {
        return Err(too_deep(&style.limits));
    }
    if out.len() > style.limits.max_value {
        return Err(too_large(&style.limits));
    }
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let x = f64::try_from(v.clone())?;
                out.push_str(&python_float_repr(x));
            }
        }
        ValueKind::String => {
            write_json_str(v.as_str().unwrap_or_default(), style.ensure_ascii, out)
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if style.sort_keys {
                keys.sort_by_key(|a| a.to_string());
            }
            let items: Vec<(Value, Value)> = keys
                .into_iter()
                .map(|k| v.get_item(&k).map(|item| (k, item)))
                .collect::<std::result::Result<_, _>>()?;
            write_container(out, style, depth, '{', '}', items.len(), |i, out| {
                let (k, item) = &items[i];
                match k.as_str() {
                    Some(s) => write_json_str(s, style.ensure_ascii, out),
                    // json.dumps turns int, float, bool and None keys into their JSON text.
                    None => {
                        let mut text = String::new();
                        write_json(k, style, depth + 1, &mut text)?;
                        write_json_str(&text, style.ensure_ascii, out);
                    }
                }
                out.push_str(&style.key_sep);
                write_json(item, style, depth + 1, out)
            })?;
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, style, depth, '[', ']', items.len(), |i, out| {
                write_json(&items[i], style, depth + 1, out)
            })?;
        }
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {} value", v.kind()),
            ))
        }
    }
    Ok(())
}

/// Writes `open item, item close` with json.dumps' layout: on one line without indent, one item
/// a line with it; an empty container is `[]`/`{}` either way.
fn write_container(
    out: &mut String,
    style: &JsonStyle,
    depth: usize,
    open: char,
    close: char,
    n: usize,
    mut item: impl FnMut(usize, &mut String) -> std::result::Result<(), minijinja::Error>,
) -> std::result::Result<(), minijinja::Error> {
    out.push(open);
    if n == 0 {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &style.indent {
            if out.len() + ind.len().saturating_mul(level) > style.limits.max_value {
                return Err(too_large(&style.limits));
            }
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
        Ok(())
    };
    for i in 0..n {
        if i > 0 {
            out.push_str(&style.item_sep);
        }
        newline(out, depth + 1)?;
        item(i, out)?;
    }
    newline(out, depth)?;
    out.push(close);
    Ok(())
}

/// A JSON string as Python's json module writes it.
fn write_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest digits that read back the same, in fixed notation for
/// decimal exponents -4..16 (always with a fraction, `1.0`) and as `1e+16` / `1e-05` outside.
fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // `{:e}` gives the shortest round-trip digits as d.ddde±x.
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    let body = if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            let mut d = digits.clone();
            while d.len() < int_len {
                d.push('0');
            }
            let frac = if d.len() > int_len {
                &d[int_len..]
            } else {
                "0"
            };
            format!("{}.{}", &d[..int_len], frac)
        } else {
            format!("0.{}{}", "0".repeat((-exp - 1) as usize), digits)
        }
    } else {
        let frac = if digits.len() > 1 {
            format!(".{}", &digits[1..])
        } else {
            String::new()
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{}{}e{}{:02}", &digits[..1], frac, esign, exp.abs())
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        for (x, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (123456789.125, "123456789.125"),
            (1e15, "1000000000000000.0"),
            (f64::NAN, "NaN"),
        ] {
            assert_eq!(python_float_repr(x), want, "{x}");
        }
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC was a Thursday, day 60 of the year.
        let t = 1_709_211_909;
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(
            strftime_utc("%d %b %Y, %A %j %I%p %-d/%-m", t),
            "29 Feb 2024, Thursday 060 01PM 29/2"
        );
        assert_eq!(strftime_utc("%B %e %y %%", 0), "January  1 70 %");
    }

    #[test]
    fn assignments_pass_through_the_size_check() {
        assert_eq!(
            rewrite_tags("{%- set ns.s = ns.s ~ '%}' -%}{% set a, b = 1, 2 %}{% set x %}y{% endset %}"),
            "{%- set ns.s = ( ns.s ~ '%}' )|__lathe_checked -%}{% set a, b = ( 1, 2 )|__lathe_checked %}{% set x %}y{% endset %}"
        );
    }

    #[test]
    fn generation_tags_keep_whitespace_control() {
        let src = "a{%- generation -%} b {% endgeneration %}c";
        assert_eq!(rewrite_tags(src), "a{%- if true -%} b {% endif %}c");
    }
}
