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
use minijinja::{Environment, ErrorKind, UndefinedBehavior};

use crate::error::{Error, Result};

/// lathe's default template (ChatML, as Qwen models speak it), for models that carry none.
/// A message's `content` may be a string or a list of `{"type": "text", "text": ...}` parts.
pub const CHATML: &str = r#"{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content if part is mapping and part.text is defined -%}
            {{- part.text -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- for message in messages -%}
    {{- '<|im_start|>' + message.role + '\n' + text_of(message.content) + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"#;

const NAME: &str = "chat_template";

/// How much work one rendering may do, so that a template (from a model file or
/// `--chat-template`) whose loops never end, or whose slow path the message text triggers,
/// stops with an error instead of holding a CPU and memory without bound. One gap remains:
/// fuel counts steps, not bytes, and minijinja has no memory limit, so a template that
/// doubles a string in a loop (`{% set ns.s = ns.s ~ ns.s %}`) can allocate gigabytes in
/// a few dozen steps before its output reaches `max_output`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TemplateLimits {
    /// minijinja "fuel": instructions one rendering may execute. Qwen3.5's and
    /// DeepSeek-V4's templates over a 150-message conversation with tools take under
    /// 30,000; the default allows ~700 times that (a runaway loop stops after ~1 s of CPU).
    pub fuel: u64,
    /// Bytes one rendering may write.
    pub max_output: usize,
}

impl Default for TemplateLimits {
    fn default() -> TemplateLimits {
        TemplateLimits {
            fuel: 20_000_000,
            max_output: 64 << 20,
        }
    }
}

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
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_filter("from_json", from_json);
        env.add_template_owned(NAME, generation_tags_as_ifs(source))
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
    let mut s = match e.detail() {
        Some(d) if e.kind() == ErrorKind::InvalidOperation => d.to_string(),
        _ => e.to_string(),
    };
    if let Some(line) = e.line() {
        if !s.contains("line") {
            s.push_str(&format!(" (line {line})"));
        }
    }
    s
}

/// transformers adds a `{% generation %}...{% endgeneration %}` block tag for assistant token
/// masks; rendering ignores it. Rewriting the tags as `{% if true %}`/`{% endif %}` keeps their
/// whitespace-control dashes, so the text around them trims exactly as before.
fn generation_tags_as_ifs(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let open_ws = if inner.starts_with(['-', '+']) {
            &inner[..1]
        } else {
            ""
        };
        let close_ws = if inner.ends_with(['-', '+']) {
            &inner[inner.len() - 1..]
        } else {
            ""
        };
        let word = inner
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+'])
            .trim();
        match word {
            "generation" => out.push_str(&format!("{{%{open_ws} if true {close_ws}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{open_ws} endif {close_ws}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Prints values as Jinja2 prints Python objects: `None`, `True`, `False`.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &minijinja::State,
    value: &Value,
) -> std::result::Result<(), minijinja::Error> {
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
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// i.e. `json.dumps` with those arguments (positional or by name).
fn tojson(value: &Value, args: Rest<Value>) -> std::result::Result<Value, minijinja::Error> {
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
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    for i in 0..n {
        if i > 0 {
            out.push_str(&style.item_sep);
        }
        newline(out, depth + 1);
        item(i, out)?;
    }
    newline(out, depth);
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
    fn generation_tags_keep_whitespace_control() {
        let src = "a{%- generation -%} b {% endgeneration %}c";
        assert_eq!(
            generation_tags_as_ifs(src),
            "a{%- if true -%} b {% endif %}c"
        );
    }
}
