//! Chat templates built into lathe, picked by name (`--chat-template NAME`, as llama-server's
//! built-in names), and the one place a `--chat-template NAME|FILE` or `--chat-template-file
//! FILE` value becomes template text.
//!
//! Each is written from the model family's published chat format, not copied from a model's
//! file; a model's own template (GGUF `tokenizer.chat_template`, `chat_template.jinja`) stays
//! the default. A message's `content` may be a string or a list of `{"type": "text", "text"}`
//! parts (the OpenAI form) in all of them.

use std::path::Path;

use super::template::{text_of, ChatTemplate, TemplateLimits, CHATML};
use crate::error::{Error, Result};

/// SmolLM2-Instruct (Hugging Face, ChatML): a conversation without a system message gets the
/// model card's default one.
const SMOLLM2: &str = concat!(
    text_of!(),
    r#"{%- if messages and messages[0].role != 'system' -%}
    {{- '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {{- '<|im_start|>' + message.role + '\n' + text_of(message.content) + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"#
);

/// Llama 3 (Meta's prompt format): BOS once, then per message a header
/// `<|start_header_id|>ROLE<|end_header_id|>` and a blank line, the content with its
/// surrounding whitespace trimmed, and `<|eot_id|>`; the reply starts after the assistant
/// header.
const LLAMA3: &str = concat!(
    text_of!(),
    r#"{{- bos_token -}}
{%- for message in messages -%}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + (text_of(message.content) | trim) + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"#
);

/// DeepSeek-V4 (DeepSeek's chat format, with the special tokens of its vocabulary): BOS, the
/// system text (system messages joined by blank lines, then the tool list), then user turns
/// opened by `<｜User｜>` and assistant turns by `<｜Assistant｜>`, each reply ended by
/// `<｜end▁of▁sentence｜>`. A reply opens with `<think>` when thinking (`enable_thinking` or
/// `thinking` true), else with `</think>`; earlier replies keep their `reasoning_content`
/// only while thinking and after the last user turn (a tool loop). Tool calls are DSML
/// blocks (`<｜DSML｜tool_calls>` of `<｜DSML｜invoke name=...>` with `<｜DSML｜parameter
/// name=... string="true|false">`: strings as they are, other values as JSON), what
/// lathe's server parses back; tool results go back in the user turn as
/// `<tool_result>...</tool_result>`. The tool instructions' wording is lathe's own.
const DEEPSEEK_V4: &str = concat!(
    text_of!(),
    r#"{%- set think = (enable_thinking is defined and enable_thinking) or (thinking is defined and thinking) -%}
{%- set dsml = '｜DSML｜' -%}
{%- set ns = namespace(system='', in_user=false, last_user=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- set ns.system = ns.system + ('\n\n' if ns.system else '') + text_of(message.content) -%}
    {%- elif message.role in ['user', 'developer', 'tool'] -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- if tools -%}
    {%- set ts = namespace(text='## Tools\n\nTo call tools, write one <' + dsml + 'tool_calls> block:\n\n<' + dsml + 'tool_calls>\n<' + dsml + 'invoke name="TOOL_NAME">\n<' + dsml + 'parameter name="PARAMETER_NAME" string="true|false">VALUE</' + dsml + 'parameter>\n</' + dsml + 'invoke>\n</' + dsml + 'tool_calls>\n\nA string parameter is written as it is with string="true"; numbers, booleans, arrays and objects as JSON with string="false".\n\n### Available Tool Schemas\n\n') -%}
    {%- for tool in tools if tool.type == 'function' -%}
        {%- set ts.text = ts.text + (tool.function | tojson) + '\n' -%}
    {%- endfor -%}
    {%- set ns.system = ns.system + ('\n\n' if ns.system else '') + ts.text + '\nCall tools only by the names and with the parameters above.\n' -%}
{%- endif -%}
{{- bos_token -}}
{{- ns.system -}}
{%- for message in messages -%}
    {%- if message.role in ['user', 'developer', 'tool'] -%}
        {{- '\n\n' if ns.in_user else '<｜User｜>' -}}
        {%- set ns.in_user = true -%}
        {%- if message.role == 'tool' -%}
            {{- '<tool_result>' + text_of(message.content) + '</tool_result>' -}}
        {%- else -%}
            {{- text_of(message.content) -}}
        {%- endif -%}
    {%- elif message.role == 'assistant' -%}
        {%- set ns.in_user = false -%}
        {{- '<｜Assistant｜>' -}}
        {%- if think and loop.index0 > ns.last_user -%}
            {{- '<think>' + (message.reasoning_content or '') + '</think>' -}}
        {%- else -%}
            {{- '</think>' -}}
        {%- endif -%}
        {{- text_of(message.content) -}}
        {%- if message.tool_calls -%}
            {{- '\n\n<' + dsml + 'tool_calls>\n' -}}
            {%- for call in message.tool_calls -%}
                {%- set f = call.function if call.function is defined else call -%}
                {%- set args = (f.arguments | from_json) if f.arguments is string else f.arguments -%}
                {{- '<' + dsml + 'invoke name="' + f.name + '">\n' -}}
                {%- for key, value in (args or {}).items() -%}
                    {%- if value is string -%}
                        {{- '<' + dsml + 'parameter name="' + key + '" string="true">' + value -}}
                    {%- else -%}
                        {{- '<' + dsml + 'parameter name="' + key + '" string="false">' + (value | tojson) -}}
                    {%- endif -%}
                    {{- '</' + dsml + 'parameter>\n' -}}
                {%- endfor -%}
                {{- '</' + dsml + 'invoke>\n' -}}
            {%- endfor -%}
            {{- '</' + dsml + 'tool_calls>' -}}
        {%- endif -%}
        {{- '<｜end▁of▁sentence｜>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<｜Assistant｜>' + ('<think>' if think else '</think>') -}}
{%- endif -%}
"#
);

/// A template built into lathe.
#[derive(Debug)]
pub struct Builtin {
    /// What `--chat-template` calls it.
    pub name: &'static str,
    /// The models that speak it.
    pub models: &'static str,
    pub source: &'static str,
}

/// Every built-in template, by name. `--chat-template`'s help lists the same names (a test
/// keeps them together).
pub const BUILTIN_TEMPLATES: &[Builtin] = &[
    Builtin {
        name: "chatml",
        models: "ChatML: Qwen (lathe's default for a model without a template)",
        source: CHATML,
    },
    Builtin {
        name: "deepseek-v4",
        models: "DeepSeek-V4, with thinking and DSML tool calls (lathe's demo model)",
        source: DEEPSEEK_V4,
    },
    Builtin {
        name: "llama3",
        models: "Llama 3",
        source: LLAMA3,
    },
    Builtin {
        name: "smollm2",
        models: "SmolLM2-Instruct (ChatML with its default system message)",
        source: SMOLLM2,
    },
];

/// The built-in template called `name`.
pub fn builtin_template(name: &str) -> Option<&'static Builtin> {
    BUILTIN_TEMPLATES.iter().find(|b| b.name == name)
}

/// The built-in names, comma separated (for messages).
pub fn builtin_names() -> String {
    let names: Vec<&str> = BUILTIN_TEMPLATES.iter().map(|b| b.name).collect();
    names.join(", ")
}

/// A chat template a flag chose: its text, and where it came from for messages (`--chat-template
/// llama3`, `--chat-template-file t.jinja`).
#[derive(Clone, Debug)]
pub struct TemplateChoice {
    pub origin: String,
    pub source: String,
}

impl TemplateChoice {
    /// `FLAG VALUE` where VALUE is a built-in name or a Jinja file: the name wins (a file
    /// called `chatml` is passed as `./chatml` or with `--chat-template-file`).
    pub fn name_or_file(flag: &str, value: &str) -> Result<TemplateChoice> {
        if let Some(b) = builtin_template(value) {
            return Ok(TemplateChoice {
                origin: format!("{flag} {value} (built in)"),
                source: b.source.to_string(),
            });
        }
        let path = Path::new(value);
        if !path.is_file() {
            return Err(Error::Invalid(format!(
                "{flag} {value}: neither a built-in template ({}) nor a file",
                builtin_names()
            )));
        }
        TemplateChoice::file(flag, path)
    }

    /// `FLAG FILE`: a Jinja file.
    pub fn file(flag: &str, path: &Path) -> Result<TemplateChoice> {
        let origin = format!("{flag} {}", path.display());
        if !path.is_file() {
            return Err(Error::Invalid(format!(
                "{origin}: no such file (a Jinja chat template)"
            )));
        }
        let source =
            std::fs::read_to_string(path).map_err(|e| Error::Invalid(format!("{origin}: {e}")))?;
        let choice = TemplateChoice { origin, source };
        // Compiled once here, so a syntax error names the flag and the file before any model
        // loads.
        choice.compile(TemplateLimits::default())?;
        Ok(choice)
    }

    /// The template compiled with `limits`; an error names the flag and the file.
    pub fn compile(&self, limits: TemplateLimits) -> Result<ChatTemplate> {
        ChatTemplate::with_limits(&self.source, limits)
            .map_err(|e| Error::Invalid(format!("{}: {e}", self.origin)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Map, Value};

    fn render(source: &str, messages: Value, gen: bool, vars: Value) -> String {
        let Value::Object(vars) = vars else {
            unreachable!()
        };
        ChatTemplate::new(source)
            .unwrap()
            .render(&messages, gen, &vars)
            .unwrap()
    }

    #[test]
    fn every_builtin_compiles_and_renders_a_turn() {
        let user = json!([{"role": "user", "content": "Hi"}]);
        for b in BUILTIN_TEMPLATES {
            let out = render(b.source, user.clone(), true, json!({}));
            assert!(out.contains("Hi"), "{}: {out:?}", b.name);
        }
    }

    #[test]
    fn llama3_and_smollm2_render_their_formats() {
        let msgs = json!([
            {"role": "system", "content": " Be brief. "},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        ]);
        assert_eq!(
            render(
                LLAMA3,
                msgs,
                true,
                json!({"bos_token": "<|begin_of_text|>"})
            ),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        assert_eq!(
            render(SMOLLM2, json!([{"role": "user", "content": "Hi"}]), true, json!({})),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    /// The rendering of DeepSeek's format, token by token, for the cases the fixtures of its
    /// published template show (tests/fixtures/tokenizer/chat/deepseek-v4.expected.json).
    #[test]
    fn deepseek_v4_renders_its_format() {
        let cases: Value = serde_json::from_str(include_str!(
            "../../tests/fixtures/tokenizer/chat/deepseek-v4.expected.json"
        ))
        .unwrap();
        for case in cases.as_array().unwrap() {
            let gen = case["add_generation_prompt"].as_bool().unwrap();
            let got = ChatTemplate::new(DEEPSEEK_V4)
                .unwrap()
                .render(&case["messages"], gen, &Map::new())
                .unwrap();
            assert_eq!(got, case["rendered"].as_str().unwrap());
        }
        let bos = json!({"bos_token": "<｜begin▁of▁sentence｜>", "enable_thinking": true});
        assert_eq!(
            render(
                DEEPSEEK_V4,
                json!([{"role": "user", "content": "Hi"}]),
                true,
                bos
            ),
            "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>"
        );
        let history = json!([
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{\"a\": \"x\", \"b\": 2}"}}]},
            {"role": "tool", "content": "ok"},
        ]);
        let tools =
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]});
        let out = render(DEEPSEEK_V4, history, true, tools);
        assert!(out.starts_with("## Tools\n\n"), "{out}");
        assert!(
            out.contains("{\"name\": \"f\", \"parameters\": {}}\n"),
            "{out}"
        );
        assert!(out.ends_with(
            "<｜User｜>Q<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\
             <｜DSML｜parameter name=\"a\" string=\"true\">x</｜DSML｜parameter>\n\
             <｜DSML｜parameter name=\"b\" string=\"false\">2</｜DSML｜parameter>\n\
             </｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>\
             <｜User｜><tool_result>ok</tool_result><｜Assistant｜></think>"
        ), "{out}");
    }

    #[test]
    fn a_choice_names_its_flag_and_file() {
        let c = TemplateChoice::name_or_file("--chat-template", "llama3").unwrap();
        assert_eq!(c.source, LLAMA3);
        let e = TemplateChoice::name_or_file("--chat-template", "nosuch").unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("--chat-template nosuch") && e.contains("chatml, deepseek-v4"),
            "{e}"
        );
        let dir = std::env::temp_dir().join(format!("lathe-builtin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("bad.jinja");
        std::fs::write(&bad, "{% for %}").unwrap();
        let e = TemplateChoice::file("--chat-template-file", &bad)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--chat-template-file") && e.contains("bad.jinja"),
            "{e}"
        );
        let e = TemplateChoice::name_or_file("--chat-template", bad.to_str().unwrap());
        assert!(e.unwrap_err().to_string().contains("--chat-template "));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
