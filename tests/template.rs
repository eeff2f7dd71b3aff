//! Chat templates rendered as transformers renders them. The models' templates come from
//! llama.cpp's repository and stay in ../shared (never copied): those tests fail, saying
//! so, when it is absent (CI has it). The expected renderings are copied here.

use std::path::{Path, PathBuf};

use lathe::tokenizer::{ChatTemplate, TemplateLimits, CHATML};
use serde_json::{json, Map, Value};

fn shared_chat() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/tokenizer/chat")
}

/// A template from ../shared: the test fails, saying why, when this checkout lacks it.
fn require(jinja: &Path) {
    assert!(
        jinja.is_file(),
        "{} is absent: this test needs ../shared/fixtures (templates stay there, never copied; CI has it)",
        jinja.display()
    );
}

fn local_chat() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/chat")
}

fn render(src: &str, messages: Value, gen: bool, extra: Value) -> String {
    let extra: Map<String, Value> = match extra {
        Value::Object(m) => m,
        _ => Map::new(),
    };
    ChatTemplate::new(src)
        .unwrap()
        .render(&messages, gen, &extra)
        .unwrap()
}

/// Every `<model>.expected.json` (copied) against `<model>.jinja` (read from ../shared).
#[test]
fn model_templates_render_exactly() {
    let mut checked = 0;
    for entry in std::fs::read_dir(local_chat()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let Some(model) = name.strip_suffix(".expected.json") else {
            continue;
        };
        let jinja = shared_chat().join(format!("{model}.jinja"));
        require(&jinja);
        let tmpl = ChatTemplate::new(&std::fs::read_to_string(&jinja).unwrap()).unwrap();
        let cases: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for case in cases.as_array().unwrap() {
            let gen = case["add_generation_prompt"].as_bool().unwrap();
            let got = tmpl.render(&case["messages"], gen, &Map::new()).unwrap();
            assert_eq!(
                got,
                case["rendered"].as_str().unwrap(),
                "{model}, add_generation_prompt={gen}"
            );
            checked += 1;
        }
    }
    assert!(checked >= 8, "only {checked} renderings checked");
}

/// Features the model templates use beyond the fixture cases: thinking switch, tools, tool
/// calls, reasoning split, raise_exception.
#[test]
fn qwen35_template_features() {
    let jinja = shared_chat().join("qwen35.jinja");
    require(&jinja);
    let src = std::fs::read_to_string(jinja).unwrap();
    let user = json!([{"role": "user", "content": "Hi"}]);
    let off = render(&src, user.clone(), true, json!({"enable_thinking": false}));
    assert!(
        off.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{off:?}"
    );
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let with_tools = render(&src, user.clone(), true, json!({"tools": tools}));
    assert!(
        with_tools.contains(
            "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}}\n</tools>"
        ),
        "{with_tools}"
    );
    let history = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "<think>\nneed tool\n</think>\n\nLet me check.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}}]},
        {"role": "tool", "content": "sunny"},
    ]);
    let out = render(&src, history, true, json!({}));
    let want = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>\nneed tool\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n";
    assert_eq!(out, want);
    let err = ChatTemplate::new(&src)
        .unwrap()
        .render(&json!([]), true, &Map::new())
        .unwrap_err();
    assert!(err.to_string().contains("No messages provided."), "{err}");
}

#[test]
fn deepseek_v4_template_features() {
    let jinja = shared_chat().join("deepseek-v4.jinja");
    require(&jinja);
    let src = std::fs::read_to_string(jinja).unwrap();
    let user = json!([{"role": "user", "content": "Hi"}]);
    let out = render(
        &src,
        user,
        true,
        json!({"bos_token": "<｜begin▁of▁sentence｜>", "enable_thinking": true}),
    );
    assert_eq!(
        out,
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>"
    );
    // String arguments go through from_json; strings and JSON values are marked apart.
    let history = json!([
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{\"a\": \"x\", \"b\": 2}"}}]},
    ]);
    let out = render(&src, history, false, json!({}));
    assert!(out.contains("<｜DSML｜parameter name=\"a\" string=\"true\">x</｜DSML｜parameter>\n<｜DSML｜parameter name=\"b\" string=\"false\">2</｜DSML｜parameter>"), "{out}");
}

#[test]
fn chatml_default_template() {
    let msgs = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bye"},
    ]);
    let want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n";
    assert_eq!(render(CHATML, msgs.clone(), false, json!({})), want);
    assert_eq!(
        render(CHATML, msgs, true, json!({})),
        format!("{want}<|im_start|>assistant\n")
    );
}

#[test]
fn hf_semantics() {
    // trim_blocks + lstrip_blocks: block lines leave no blank lines or indentation.
    let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
    let msgs = json!([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}, {"role": "user", "content": "c"}]);
    assert_eq!(render(src, msgs.clone(), false, json!({})), "[a]\n[c]\n");
    // Undefined renders empty; None / booleans print as Python prints them.
    assert_eq!(
        render(
            "<{{ nothing }}>{{ nothing is defined }}",
            json!([]),
            false,
            json!({})
        ),
        "<>False"
    );
    assert_eq!(
        render(
            "{{ tools }} {{ add_generation_prompt }}",
            json!([]),
            true,
            json!({})
        ),
        "None True"
    );
    // Python string methods, slicing, namespace, loop controls.
    let src = "{% set ns = namespace(n=0) %}{% for m in messages[::-1] %}{% if loop.index > 2 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{{ m.content.strip().upper().split(',')[0] }}|{% endfor %}{{ ns.n }}{{ 'x'.startswith('x') }}{{ ' a\n'.rstrip('\\n') }}";
    assert_eq!(render(src, msgs, false, json!({})), "C|B|2True a");
    // transformers' tojson: no HTML escaping, non-ASCII kept, Python separators, indent.
    let v = json!({"b": "<é>\n", "a": [1, 2.5, true, null], "c": {}});
    assert_eq!(
        render(
            "{{ v | tojson }}",
            json!([]),
            false,
            json!({"v": v.clone()})
        ),
        r#"{"b": "<é>\n", "a": [1, 2.5, true, null], "c": {}}"#
    );
    assert_eq!(
        render(
            "{{ v | tojson(indent=2) }}",
            json!([]),
            false,
            json!({"v": {"a": [1], "b": 2}})
        ),
        "{\n  \"a\": [\n    1\n  ],\n  \"b\": 2\n}"
    );
    assert_eq!(
        render(
            "{{ v | tojson(ensure_ascii=true, sort_keys=true) }}",
            json!([]),
            false,
            json!({"v": {"z": "é😀", "a": 1}})
        ),
        r#"{"a": 1, "z": "\u00e9\ud83d\ude00"}"#
    );
    // raise_exception carries the template's message.
    let err = ChatTemplate::new("{{ raise_exception('bad role') }}")
        .unwrap()
        .render(&json!([]), false, &Map::new())
        .unwrap_err();
    assert!(err.to_string().contains("bad role"), "{err}");
    // strftime_now gives a four-digit year first.
    let year = render("{{ strftime_now('%Y') }}", json!([]), false, json!({}));
    assert!(year.len() == 4 && year.starts_with('2'), "{year}");
    // transformers' generation tag renders its body.
    assert_eq!(
        render(
            "a{% generation %}b{% endgeneration %}c",
            json!([]),
            false,
            json!({})
        ),
        "abc"
    );
    // A syntax error names its line.
    let err = ChatTemplate::new("line1\n{% if %}").expect_err("syntax error");
    assert!(err.to_string().contains("line 2"), "{err}");
}

/// Templates whose loops run away, or whose output grows without end, stop with an error
/// that says which limit they hit, quickly, instead of holding a CPU or memory for good.
#[test]
fn runaway_templates_stop_at_their_limits() {
    let run = |src: &str, limits: TemplateLimits| {
        let t0 = std::time::Instant::now();
        let e = ChatTemplate::with_limits(src, limits)
            .unwrap()
            .render(
                &json!([{"role": "user", "content": "hi"}]),
                true,
                &Map::new(),
            )
            .expect_err(src)
            .to_string();
        (e, t0.elapsed())
    };
    // 10^10 iterations without the limit.
    let (e, dt) = run(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        TemplateLimits::default(),
    );
    assert!(e.contains("fuel limit"), "{e}");
    assert!(dt.as_secs() < 30, "{dt:?}");
    // 100 MB of output.
    let (e, _) = run(
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
        TemplateLimits::default(),
    );
    assert!(e.contains("output limit"), "{e}");
    // The limits are the caller's: a small fuel stops ChatML over many messages.
    let msgs: Vec<Value> = (0..100)
        .map(|i| json!({"role": "user", "content": format!("m{i}")}))
        .collect();
    let small = TemplateLimits {
        fuel: 100,
        ..TemplateLimits::default()
    };
    let e = ChatTemplate::with_limits(CHATML, small)
        .unwrap()
        .render(&Value::Array(msgs.clone()), true, &Map::new())
        .unwrap_err();
    assert!(e.to_string().contains("more than 100 steps"), "{e}");
    // ... and the default lets it through.
    ChatTemplate::new(CHATML)
        .unwrap()
        .render(&Value::Array(msgs), true, &Map::new())
        .unwrap();
}
