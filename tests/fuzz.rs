//! Deterministic mutation fuzzing of every parser that reads what a user or a file gives:
//! the GGUF reader, safetensors + config.json, tokenizer.json and the tokenizer on any
//! text, chat templates, and the server's request fields. Fixed seeds and a few hundred
//! cases each, so CI runs them (well under two minutes in all); each case must end in
//! success or a clean error, without a panic, within a time bound, and the process's peak
//! memory stays bounded. Each test prints its totals by outcome
//! (`cargo test --test fuzz -- --nocapture`). The raw HTTP parser is fuzzed against a
//! running server in tests/server.rs; cargo-fuzz targets for long runs live in fuzz/.
//! Device limits are probed too: expert offload at several settings on lavapipe's own
//! binding limit, and every family on devices created with far smaller ones.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lathe::models::ModelFile;
use lathe::tokenizer::{ChatTemplate, TemplateLimits, Tokenizer, CHATML};
use serde_json::{json, Map, Value};

/// splitmix64: a fixed seed gives the same cases on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// Values that break size arithmetic.
const INTERESTING: [u64; 12] = [
    0,
    1,
    2,
    0x7f,
    0xff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    i64::MAX as u64,
    u64::MAX,
];

/// One to four byte-level mutations, most of them in the first `hot` bytes (headers and
/// metadata, where the lengths and counts are).
fn mutate_bytes(rng: &mut Rng, data: &mut Vec<u8>, hot: usize) {
    for _ in 0..1 + rng.below(4) {
        if data.is_empty() {
            data.push(rng.next() as u8);
        }
        let span = if rng.below(5) < 4 {
            hot.min(data.len())
        } else {
            data.len()
        };
        let at = rng.below(span);
        match rng.below(7) {
            0 => data[at] ^= 1 << rng.below(8),
            1 => data[at] = rng.next() as u8,
            2 | 3 => {
                let v = rng.pick(&INTERESTING).to_le_bytes();
                let n = if rng.below(2) == 0 { 8 } else { 4 };
                for (i, b) in v[..n].iter().enumerate() {
                    if let Some(d) = data.get_mut(at + i) {
                        *d = *b;
                    }
                }
            }
            4 => data.truncate(at),
            5 => {
                let n = 1 + rng.below(16);
                let fill: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                data.splice(at..at, fill);
            }
            _ => {
                let end = (at + 1 + rng.below(64)).min(data.len());
                data.drain(at..end);
            }
        }
    }
}

/// A JSON value to put where another was: extreme numbers, wrong types, deep nesting.
fn wild_value(rng: &mut Rng, depth: usize) -> Value {
    match rng.below(if depth > 3 { 9 } else { 12 }) {
        0 => Value::Null,
        1 => json!(rng.below(2) == 0),
        2 => json!(*rng.pick(&INTERESTING)),
        3 => json!(-(rng.next() as i64 >> rng.below(63))),
        4 => json!(*rng.pick(&[0.0, -1.0, 1e-300, 1e300, 0.5, -0.0, 3.5])),
        5 => json!(rng.below(10)),
        6 => json!(""),
        7 => json!("x".repeat(rng.below(1000))),
        8 => json!(*rng.pick(&["user", "assistant", "system", "tool", "<|im_end|>", "\u{0}"])),
        9 => Value::Array(
            (0..rng.below(4))
                .map(|_| wild_value(rng, depth + 1))
                .collect(),
        ),
        10 => {
            let mut m = Map::new();
            for _ in 0..rng.below(4) {
                let k = rng.pick(&["role", "content", "type", "text", "name", "x"]);
                m.insert(k.to_string(), wild_value(rng, depth + 1));
            }
            Value::Object(m)
        }
        _ => {
            let mut v = json!(1);
            for _ in 0..rng.below(200) {
                v = json!([v]);
            }
            v
        }
    }
}

/// One to three JSON mutations of `v`: a value replaced, a key removed or added.
fn mutate_json(rng: &mut Rng, v: &mut Value) {
    for _ in 0..1 + rng.below(3) {
        // A random path down containers, as a JSON pointer.
        let mut pointer = String::new();
        let mut at = &*v;
        for _ in 0..rng.below(4) {
            let (step, next) = match at {
                Value::Object(m) if !m.is_empty() => {
                    let (k, n) = m.iter().nth(rng.below(m.len())).unwrap();
                    (k.replace('~', "~0").replace('/', "~1"), n)
                }
                Value::Array(a) if !a.is_empty() => {
                    let i = rng.below(a.len());
                    (i.to_string(), &a[i])
                }
                _ => break,
            };
            if !matches!(next, Value::Object(_) | Value::Array(_)) {
                break;
            }
            pointer.push('/');
            pointer.push_str(&step);
            at = next;
        }
        let Some(at) = v.pointer_mut(&pointer) else {
            continue;
        };
        match at {
            Value::Object(m) if !m.is_empty() => {
                let k = m
                    .keys()
                    .nth(rng.below(m.len()))
                    .cloned()
                    .unwrap_or_default();
                if rng.below(4) == 0 {
                    m.remove(&k);
                } else {
                    m.insert(k, wild_value(rng, 0));
                }
            }
            Value::Array(a) if !a.is_empty() => {
                let i = rng.below(a.len());
                a[i] = wild_value(rng, 0);
            }
            other => *other = wild_value(rng, 0),
        }
    }
}

#[derive(Default, Debug)]
struct Tally {
    ok: usize,
    error: usize,
    panic: usize,
    timeout: usize,
    /// The first few panics and timeouts: (case, what).
    bad: Vec<(usize, String)>,
}

impl Tally {
    /// Runs case `i`: `Ok(())` / `Err(message)` from `f`, a panic caught, or `limit` passed.
    fn run(&mut self, i: usize, limit: Duration, f: impl FnOnce() -> Result<(), String>) {
        let t0 = Instant::now();
        let r = catch_unwind(AssertUnwindSafe(f));
        let dt = t0.elapsed();
        match r {
            Err(p) => {
                self.panic += 1;
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                self.bad.push((i, format!("panic: {msg}")));
            }
            Ok(_) if dt > limit => {
                self.timeout += 1;
                self.bad.push((i, format!("took {dt:?}")));
            }
            Ok(Ok(())) => self.ok += 1,
            Ok(Err(_)) => self.error += 1,
        }
    }

    /// Prints the totals and fails on any panic or timeout, or when the cases never
    /// succeeded or (for mutated files: `mutated`) never reached an error: mutations that
    /// change nothing, or break everything, test little.
    fn check(&self, what: &str, mutated: bool) {
        eprintln!(
            "fuzz {what}: {} cases: ok {}, clean error {}, panic {}, timeout {}",
            self.ok + self.error + self.panic + self.timeout,
            self.ok,
            self.error,
            self.panic,
            self.timeout
        );
        assert!(
            self.panic == 0 && self.timeout == 0,
            "{what}: {:?}",
            &self.bad[..self.bad.len().min(5)]
        );
        assert!(
            !mutated || self.error > 0,
            "{what}: no case failed: the mutations do nothing"
        );
        assert!(self.ok > 0, "{what}: no case succeeded");
        let peak = peak_rss();
        assert!(peak < 6 << 30, "{what}: peak RSS {} MB", peak >> 20);
    }
}

/// Peak resident memory of this process (Linux `VmHWM`; 0 elsewhere).
fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb << 10)
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("fuzz-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const CASE_LIMIT: Duration = Duration::from_secs(5);

/// What lathe does with a model file before running it: open, describe, read the
/// hyper-parameters, and (for the small Qwen3.5 files) load the weights on the CPU.
fn open_model(path: &Path) -> Result<(), String> {
    let f = ModelFile::open(path).map_err(|e| e.to_string())?;
    if let ModelFile::Gguf(g) = &f {
        if !matches!(g.opt_str("tokenizer.ggml.model"), Ok(None | Some("none"))) {
            lathe::tokenizer::Tokenizer::from_gguf(g).map_err(|e| e.to_string())?;
        }
        if g.get("general.architecture").is_none() {
            // A GGUF of values only (the type-coverage fixture): read, nothing to run.
            return Ok(());
        }
    }
    lathe::inspect::report(&f).map_err(|e| e.to_string())?;
    match f.architecture().map_err(|e| e.to_string())?.as_str() {
        "qwen35" | "qwen35moe" | "qwen3next" => {
            lathe::models::qwen35::Hparams::from_file(&f).map_err(|e| e.to_string())?;
            lathe::models::qwen35::cpu::CpuModel::load(&f).map_err(|e| e.to_string())?;
        }
        "deepseek4" => {
            lathe::models::deepseek4::Hparams::from_file(&f).map_err(|e| e.to_string())?;
        }
        _ => {}
    }
    Ok(())
}

#[test]
fn gguf_reader() {
    let sources = [
        root().join("tests/fixtures/gguf/all_types.gguf"),
        root().join("tests/fixtures/models/qwen35-tiny/model-q4_0.gguf"),
        root().join("tests/fixtures/models/qwen35moe-tiny/model-q4_0.gguf"),
        root().join("tests/fixtures/models/dsv4-tiny/model-q8_0.gguf"),
    ];
    let originals: Vec<Vec<u8>> = sources.iter().map(|p| std::fs::read(p).unwrap()).collect();
    let dir = scratch("gguf");
    let mut rng = Rng(0x6775_6675);
    let mut t = Tally::default();
    for i in 0..400 {
        let k = rng.below(originals.len());
        let mut data = originals[k].clone();
        mutate_bytes(&mut rng, &mut data, 16 << 10);
        let p = dir.join("case.gguf");
        std::fs::write(&p, &data).unwrap();
        t.run(i, CASE_LIMIT, || open_model(&p));
    }
    t.check("GGUF reader", true);
}

#[test]
fn safetensors_and_config() {
    let src = root().join("tests/fixtures/hf/qwen35-tiny");
    let weights = std::fs::read(src.join("model.safetensors")).unwrap();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let header = 8 + u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    let dir = scratch("safetensors");
    let mut rng = Rng(0x7361_6665);
    let mut t = Tally::default();
    for i in 0..300 {
        let mut w = weights.clone();
        let mut c = config.clone();
        match rng.below(3) {
            0 => mutate_bytes(&mut rng, &mut w, header),
            1 => mutate_json(&mut rng, &mut c),
            _ => {
                mutate_bytes(&mut rng, &mut w, header);
                mutate_json(&mut rng, &mut c);
            }
        }
        std::fs::write(dir.join("model.safetensors"), &w).unwrap();
        std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
        t.run(i, CASE_LIMIT, || open_model(&dir));
    }
    t.check("safetensors + config.json", true);
}

/// A small byte-level BPE tokenizer.json: the 256 bytes, a few merges, two specials.
fn small_tokenizer_json() -> Value {
    let printable = |c: u32| (0x21..=0x7e).contains(&c) || (0xa1..=0xac).contains(&c) || c >= 0xae;
    let mut n = 0;
    let mut chars = Vec::new();
    for b in 0u32..256 {
        if printable(b) {
            chars.push(char::from_u32(b).unwrap());
        } else {
            chars.push(char::from_u32(256 + n).unwrap());
            n += 1;
        }
    }
    let mut vocab = Map::new();
    for (i, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), json!(i));
    }
    let merges = ["t h", "th e", "Ġ t", "h e", "Ġt he", "a n", "i n"];
    for (i, m) in merges.iter().enumerate() {
        vocab.insert(m.replace(' ', ""), json!(256 + i));
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": true, "use_regex": true});
    let special = |id: usize, s: &str| {
        json!({"id": id, "content": s, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(263, "<|im_start|>"), special(264, "<|im_end|>")],
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    })
}

const SPECIAL_BITS: &[&str] = &["<|im_start|>", "<|im_end|>", "<|im_", "|>"];
const ODD_BITS: &[&str] = &["the", "Ġ", "中文", "é", "😀", "\u{0}", "\r\n", "\u{fffd}"];

fn pick_str(rng: &mut Rng, xs: &[&'static str]) -> &'static str {
    xs[rng.below(xs.len())]
}

/// Random text: bytes, multi-byte characters, specials, long runs.
fn wild_text(rng: &mut Rng) -> String {
    let mut s = String::new();
    for _ in 0..rng.below(40) {
        match rng.below(6) {
            0 => s.push_str(&String::from_utf8_lossy(
                &(0..rng.below(20))
                    .map(|_| rng.next() as u8)
                    .collect::<Vec<u8>>(),
            )),
            1 => s.push_str(pick_str(rng, SPECIAL_BITS)),
            2 => s.push_str(&" ".repeat(rng.below(3000))),
            3 => s.push_str(pick_str(rng, ODD_BITS)),
            4 => s.push_str(&"ab".repeat(rng.below(20_000))),
            _ => s.push(char::from_u32(rng.below(0x11_0000) as u32).unwrap_or('x')),
        }
    }
    s
}

#[test]
fn tokenizer_files_and_texts() {
    let dir = scratch("tokenizer");
    let base = small_tokenizer_json();
    std::fs::write(dir.join("tokenizer.json"), base.to_string()).unwrap();
    let tok = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    assert_eq!(
        tok.decode(&tok.encode("the thin", true).unwrap()),
        "the thin"
    );
    let mut rng = Rng(0x746f_6b65);
    let mut t = Tally::default();
    for i in 0..200 {
        let mut j = base.clone();
        mutate_json(&mut rng, &mut j);
        let mut bytes = j.to_string().into_bytes();
        if rng.below(4) == 0 {
            mutate_bytes(&mut rng, &mut bytes, 4096);
        }
        let p = dir.join("tokenizer.json");
        std::fs::write(&p, &bytes).unwrap();
        let text = wild_text(&mut rng);
        t.run(i, CASE_LIMIT, || {
            let tok = Tokenizer::from_file(&p).map_err(|e| e.to_string())?;
            let ids = tok.encode(&text, true).map_err(|e| e.to_string())?;
            tok.decode(&ids);
            Ok(())
        });
    }
    t.check("tokenizer.json", true);

    // The real Qwen3.6 vocabulary on wild texts: encode, the server's bound, decode and the
    // stream decoder all take anything.
    let tok =
        Tokenizer::from_file(root().join("tests/fixtures/tokenizer/qwen36/tokenizer.json.gz"))
            .unwrap();
    let mut t = Tally::default();
    for i in 0..300 {
        let text = wild_text(&mut rng);
        let limit = rng.below(5000);
        t.run(i, CASE_LIMIT, || {
            let ids = tok
                .encode(&text, rng.below(2) == 0)
                .map_err(|e| e.to_string())?;
            if let Some(n) = tok.exceeds(&text, true, limit).map_err(|e| e.to_string())? {
                assert!(n > limit, "exceeds said {n} for a limit of {limit}");
            }
            let mut d = lathe::tokenizer::StreamDecoder::new();
            let mut streamed = String::new();
            for &id in &ids {
                streamed.push_str(&d.push(&tok, id));
            }
            streamed.push_str(&d.flush());
            assert_eq!(
                streamed,
                tok.decode(&ids),
                "stream and whole decodes differ"
            );
            Ok(())
        });
    }
    t.check("tokenizer on texts", false);
}

/// Pieces of Jinja that templates are made of, including the expensive ones.
const FRAGMENTS: &[&str] = &[
    "{% for m in messages %}",
    "{% endfor %}",
    "{% for i in range(100000) %}",
    "{% for i in range(50) %}",
    "{% if messages %}",
    "{% else %}",
    "{% endif %}",
    "{{ m.content }}",
    "{{ m.role|upper }}",
    "{{ messages|tojson }}",
    "{{ messages[0].content.split(' ') }}",
    "{{ 'ab' * 100000 }}",
    "{{ 'x' * 1000000 }}",
    "{% set ns = namespace(s='ab') %}",
    "{% set ns.s = ns.s ~ 'xy' %}",
    "{% set ns.s = ns.s ~ ns.s %}",
    "{{ ns.s|length }}",
    "{% macro f(x) %}{{ x }}{{ f(x) }}{% endmacro %}{{ f(1) }}",
    "{{ raise_exception('no') }}",
    "{{ strftime_now('%Y-%m-%d') }}",
    "{{ bos_token }}",
    "{% generation %}",
    "{% endgeneration %}",
    "{{ tools|tojson(indent=2) }}",
    "{{ 1 / 0 }}",
    "{{ (messages|length) * 99999999999 }}",
    "{%- ",
    " -%}",
    "{{",
    "}}",
    "text\n",
];

#[test]
fn chat_templates() {
    let mut rng = Rng(0x746d_706c);
    let limits = TemplateLimits {
        fuel: 500_000,
        max_output: 4 << 20,
        ..TemplateLimits::default()
    };
    let mut t = Tally::default();
    for i in 0..400 {
        let src = if rng.below(4) == 0 {
            let mut b = CHATML.as_bytes().to_vec();
            let n = b.len();
            mutate_bytes(&mut rng, &mut b, n);
            String::from_utf8_lossy(&b).into_owned()
        } else {
            (0..1 + rng.below(10))
                .map(|_| *rng.pick(FRAGMENTS))
                .collect::<String>()
        };
        let mut messages = json!([{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "yo"}]);
        if rng.below(2) == 0 {
            mutate_json(&mut rng, &mut messages);
        }
        t.run(i, CASE_LIMIT, || {
            let tmpl = ChatTemplate::with_limits(&src, limits).map_err(|e| e.to_string())?;
            tmpl.render(&messages, rng.below(2) == 0, &Map::new())
                .map(drop)
                .map_err(|e| e.to_string())
        });
    }
    t.check("chat templates", true);
}

/// Templates that build huge values in a few steps, each construct that used to take
/// gigabytes (and abort the process) or overflow the stack: every one stops with an error
/// naming the limit, quickly, and the process stays small.
#[test]
fn templates_that_build_huge_values() {
    let double = |init: &str, step: &str, n: usize| {
        format!(
            "{{% set ns = namespace(v={init}) %}}{{% for i in range({n}) %}}{{% set ns.v = {step} %}}{{% endfor %}}{{{{ ns.v|tojson|length }}}}"
        )
    };
    let nest = |n: usize| {
        format!("{{% set ns = namespace(l=[]) %}}{{% for i in range({n}) %}}{{% set ns.l = [ns.l] %}}{{% endfor %}}{{{{ ns.l|tojson }}}}")
    };
    let cases = [
        double("'ab'", "ns.v ~ ns.v", 48),
        double("'ab'", "ns.v + ns.v", 48),
        double("[1, 2]", "ns.v + ns.v", 64),
        double("{}", "{'a': ns.v, 'b': ns.v}", 48),
        "{% set l = [1] * 1000000000 %}{{ l|join(',') }}".into(),
        double("'a' * 1000", "ns.v.replace('a', 'aaaaaaaaaa')", 12),
        double("'a' * 1000", "ns.v|replace('a', 'aaaaaaaaaa')", 12),
        "{{ ('a\n' * 8)|indent(3000000000) }}".into(),
        "{{ ('a\n' * 8)|indent(width=3000000000) }}".into(),
        "{{ '%3000000000d'|format(1) }}".into(),
        "{{ '{:>3000000000}'.format(1) }}".into(),
        "{{ ('a' * 100000000)|replace('a', 'a' * 100) }}".into(),
        "{{ ('a' * 100000000).replace('a', 'aa') }}".into(),
        "{{ (['x' * 10000000] * 100000)|join(',') }}".into(),
        "{{ [1]|tojson(indent=3000000000) }}".into(),
        "{% set ns = namespace(s='x' * 10000000) %}{% set c %}{% for i in range(100000) %}{{ ns.s }}{% endfor %}{% endset %}{{ c|length }}".into(),
        nest(5000),
        nest(20_000),
    ];
    let mut t = Tally::default();
    for (i, src) in cases.iter().enumerate() {
        let messages = json!([{"role": "user", "content": "hi"}]);
        t.run(i, CASE_LIMIT, || {
            let tmpl = ChatTemplate::new(src).map_err(|e| e.to_string())?;
            let e = tmpl
                .render(&messages, true, &Map::new())
                .expect_err(src)
                .to_string();
            assert!(e.contains("limit"), "{src}: {e}");
            Err(e)
        });
    }
    // Messages nested deeper than `tojson` goes (serde_json's parser stops at 128, but a
    // caller of the library may build any value; 1,000 deep, as the test thread's stack
    // drops it).
    let mut deep = json!("x");
    for _ in 0..1000 {
        deep = json!([deep]);
    }
    let tmpl = ChatTemplate::new("{{ messages|tojson }}").unwrap();
    t.run(cases.len(), CASE_LIMIT, || {
        let e = tmpl
            .render(&deep, true, &Map::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("depth limit"), "{e}");
        Err(e)
    });
    // The same constructs at sizes within the limits still render.
    let fine = ChatTemplate::new(&double("'ab'", "ns.v ~ ns.v", 10)).unwrap();
    t.run(cases.len() + 1, CASE_LIMIT, || {
        assert_eq!(fine.render(&json!([]), true, &Map::new()).unwrap(), "2050");
        Ok(())
    });
    t.check("templates that build huge values", false);
}

#[test]
fn server_request_fields() {
    let mut rng = Rng(0x6874_7470);
    let chat = json!({
        "model": "m", "messages": [{"role": "system", "content": "s"},
                                   {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "stop": ["x"], "stream": true,
        "stream_options": {"include_usage": true}, "logprobs": true, "top_logprobs": 2,
        "logit_bias": {"5": 1}, "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto", "seed": 3, "chat_template_kwargs": {"enable_thinking": false}
    });
    let completion = json!({"prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 2, "echo": false});
    let template = ChatTemplate::new(CHATML).unwrap();
    let mut t = Tally::default();
    for i in 0..600 {
        let is_chat = rng.below(2) == 0;
        let mut body = if is_chat {
            chat.clone()
        } else {
            completion.clone()
        };
        mutate_json(&mut rng, &mut body);
        t.run(i, CASE_LIMIT, || {
            if is_chat {
                let r = lathe::server::api::chat_request(&body, 100, 1).map_err(|e| {
                    assert_eq!(e.status.as_u16(), 400, "{}", e.message);
                    e.message
                })?;
                template
                    .render(&r.messages, true, &r.template_vars)
                    .map(drop)
                    .map_err(|e| e.to_string())
            } else {
                lathe::server::api::completion_request(&body, 100, 1)
                    .map(drop)
                    .map_err(|e| {
                        assert_eq!(e.status.as_u16(), 400, "{}", e.message);
                        e.message
                    })
            }
        });
    }
    t.check("server request fields", true);
}

/// Slowloris against a live `lathe serve`: 40 connections from 127.0.0.2 that send half a
/// request head and then nothing (they would hold their slots until --header-timeout, 30 s)
/// take at most --max-client-connections of the 16 slots, and `/health` from 127.0.0.1
/// still answers at once; the connections past the share get a 503.
#[test]
fn slowloris_leaves_room_for_health() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::process::{Command, Stdio};
    let model = root().join("tests/fixtures/models/qwen35-tiny/model-f32.gguf");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lathe"))
        .args(["serve", "--model"])
        .arg(&model)
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--max-connections",
            "16",
        ])
        .args([
            "--max-client-connections",
            "8",
            "--debug-load-delay-ms",
            "60000",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stderr = child.stderr.take().unwrap();
    let _server = Kill(child);
    let addr = BufReader::new(stderr)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.split("listening on http://").nth(1).map(str::to_string))
        .expect("the server's address");
    let addr: std::net::SocketAddr = addr.trim().parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let slow: Vec<std::net::TcpStream> = (0..40)
        .map(|_| {
            rt.block_on(async {
                let s = tokio::net::TcpSocket::new_v4().unwrap();
                s.bind("127.0.0.2:0".parse().unwrap()).unwrap();
                let mut c = s.connect(addr).await.unwrap().into_std().unwrap();
                c.set_nonblocking(false).unwrap();
                c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").unwrap();
                c
            })
        })
        .collect();
    let t0 = Instant::now();
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    let _ = c.read_to_string(&mut answer);
    let dt = t0.elapsed();
    assert!(
        answer.starts_with("HTTP/1.1 "),
        "no answer in {dt:?}: {answer:?}"
    );
    assert!(dt < Duration::from_secs(3), "/health took {dt:?}");
    // A slow connection past its address's share was told so.
    let mut last = &slow[slow.len() - 1];
    last.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut refused = String::new();
    let _ = last.read_to_string(&mut refused);
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused:?}");
}

/// Prompt tokens of the offload cases: the first `OFFLOAD_PROMPT` of the fixture's, the last
/// four fed one at a time (decode steps), the rest as one pass. Short, as the pass length
/// (and so every buffer a pass binds) is chosen at load, whatever the prompt.
const OFFLOAD_PROMPT: usize = 24;

/// Prompt tokens of the small-limit cases: more than one of their shortened passes.
const SMALL_LIMIT_PROMPT: usize = 160;

/// Relative RMS of `got` against `want`.
fn rel_rms(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "logit counts differ");
    let (mut se, mut ss) = (0f64, 0f64);
    for (a, b) in got.iter().zip(want) {
        se += (*a as f64 - *b as f64).powi(2);
        ss += (*b as f64).powi(2);
    }
    (se / ss.max(f64::MIN_POSITIVE)).sqrt()
}

/// The model file `file` of fixture `name` (../shared's copy where this machine has one, as
/// the `*-dims` files live only there) and a prompt of `n` of its tokens (repeated where it
/// has fewer).
fn offload_fixture(name: &str, file: &str, n: usize) -> (PathBuf, Vec<u32>) {
    let committed = root().join("tests/fixtures/models").join(name);
    let shared = root().join("../shared/fixtures/models").join(name);
    let dir = if shared.join(file).is_file() {
        shared
    } else {
        committed
    };
    assert!(
        dir.join(file).is_file(),
        "{}/{file} is absent: this test needs ../shared/fixtures (CI has it)",
        dir.display()
    );
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let ids = toks.data.iter().cycle().take(n).map(|&t| t as u32);
    (dir.join(file), ids.collect())
}

/// A device for `path`'s model created with at most `cap`'s binding and buffer sizes
/// (`None`: the adapter's), its product path as `Engine::load` picks it.
fn offload_gpu(path: &Path, cap: Option<lathe::gpu::BufferLimits>) -> Arc<lathe::gpu::Gpu> {
    use lathe::gpu::{AdapterChoice, Gpu, MatmulChoice};
    let auto = lathe::models::auto_products(&ModelFile::open(path).unwrap());
    let gpu = Gpu::with_limits(&AdapterChoice::Auto, MatmulChoice::Auto, auto, cap);
    Arc::new(gpu.expect("a wgpu adapter (lavapipe in CI)"))
}

/// Logits of every position of `tokens` (all but the last four in one pass) of `path`'s
/// model loaded on `gpu` with `opts`, and the rows of one pass the loader chose.
fn offload_logits(
    gpu: &Arc<lathe::gpu::Gpu>,
    path: &Path,
    tokens: &[u32],
    opts: &lathe::engine::LoadOptions,
) -> Result<(Vec<f32>, usize), String> {
    let file = ModelFile::open(path).map_err(|e| e.to_string())?;
    let mut m = lathe::models::load(gpu.clone(), &file, opts).map_err(|e| e.to_string())?;
    let mut seq = m.new_seq().map_err(|e| e.to_string())?;
    let pre = tokens.len() - 4;
    let mut out = m
        .forward(&mut seq, &tokens[..pre], true)
        .map_err(|e| e.to_string())?;
    for t in &tokens[pre..] {
        out.extend(
            m.forward(&mut seq, std::slice::from_ref(t), true)
                .map_err(|e| e.to_string())?,
        );
    }
    Ok((out, m.pass_rows()))
}

/// Bar of an offload run against the all-GPU one: the cold experts' rows differ by the
/// rounding of the CPU's dot products against the GPU's (the summation contract of
/// `moe/mod.rs`), which tests/moe_exact.rs bars at 1e-3; measured 7e-8 on dsv4-dims.
const OFFLOAD_RMS: f64 = 1e-3;

/// Expert offload on lavapipe's own limits (128 MiB bindings): at several `--gpu-experts`
/// and `--gpu-mem` settings the longer passes chosen for streaming cold experts fit every
/// binding, and the logits match the all-GPU run's. DeepSeek-V4's compressor stores and
/// window rings grow with the pass: dsv4-dims at `--gpu-experts 0` bound a 134,479,872-byte
/// `pool.cmp_store` (a wgpu validation error) before passes were sized by them.
fn check_offload_on_lavapipe(cases: &[(&str, &[f64], u64)]) {
    use lathe::engine::LoadOptions;
    for &(name, shares, mem) in cases {
        let (path, tokens) = offload_fixture(name, "model-q8_0.gguf", OFFLOAD_PROMPT);
        let gpu = offload_gpu(&path, None);
        let all = LoadOptions {
            gpu_experts: Some(1.0),
            ..Default::default()
        };
        let (want, _) = offload_logits(&gpu, &path, &tokens, &all).unwrap();
        let settings = shares
            .iter()
            .map(|&f| LoadOptions {
                gpu_experts: Some(f),
                ..Default::default()
            })
            .chain([LoadOptions {
                gpu_mem: vec![mem],
                ..Default::default()
            }]);
        for opts in settings {
            let what = format!(
                "{name} --gpu-experts {:?} --gpu-mem {:?}",
                opts.gpu_experts, opts.gpu_mem
            );
            let (got, rows) = offload_logits(&gpu, &path, &tokens, &opts)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let r = rel_rms(&got, &want);
            eprintln!("{what}: passes of {rows} rows, relative RMS {r:.2e}");
            assert!(r <= OFFLOAD_RMS, "{what}: relative RMS {r:.2e}");
        }
    }
}

#[test]
fn expert_offload_fits_lavapipe_deepseek4() {
    check_offload_on_lavapipe(&[
        ("dsv4-dims", &[0.0, 0.5], 84 << 20),
        ("dsv4-tiny", &[0.25], 2 << 20),
    ]);
}

#[test]
fn expert_offload_fits_lavapipe_qwen35() {
    check_offload_on_lavapipe(&[
        ("qwen35moe-dims", &[0.0, 0.5], 64 << 20),
        ("qwen35moe-tiny", &[0.25], 11 << 20),
    ]);
}

/// Bytes of the largest buffer bound by a pass of `rows` rows of `path`'s model under `opts`
/// (its family's `needs`).
fn largest_bound(path: &Path, opts: &lathe::engine::LoadOptions, rows: usize) -> u64 {
    let f = ModelFile::open(path).unwrap();
    let run = lathe::moe::RunShape::new(opts, rows);
    let nd = lathe::models::needs(&f, run);
    nd.buffers.iter().map(|b| b.bytes).max().unwrap()
}

/// On a device whose bindings are far smaller than lavapipe's (the limits a device is created
/// with are what wgpu validates), every family shortens its passes until each buffer fits:
/// with and without experts off the GPU the logits match the full-limit run's, the prompt
/// now spread over several passes; a limit no pass fits is an error at load that names the
/// buffer, its size and the limit (not a validation error at the first pass).
#[test]
fn small_binding_limits_shorten_passes() {
    use lathe::engine::LoadOptions;
    use lathe::gpu::BufferLimits;
    let base = LoadOptions {
        ctx: 256,
        max_seqs: 1,
        ..Default::default()
    };
    let moe = [None, Some(0.0)];
    for (name, shares) in [
        ("dsv4-tiny", &moe[..]),
        ("qwen35moe-tiny", &moe[..]),
        ("qwen35-tiny", &[None][..]),
    ] {
        let (path, tokens) = offload_fixture(name, "model-q8_0.gguf", SMALL_LIMIT_PROMPT);
        let (want, full_rows) = offload_logits(&offload_gpu(&path, None), &path, &tokens, &base)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        // A binding of 1/64 of the widest buffer of a full pass (passes of ~8 rows), or what
        // passes of one row bind where buffers that do not follow the pass length (a
        // ratio-128 compressor's store, the decode attention's split scratch) are wider.
        let max_binding = (largest_bound(&path, &base, full_rows) / 64)
            .max(largest_bound(&path, &base, 1))
            .next_multiple_of(256);
        let cap = BufferLimits {
            max_binding,
            max_buffer: 4 * max_binding,
        };
        let small = offload_gpu(&path, Some(cap));
        for &share in shares {
            let opts = LoadOptions {
                gpu_experts: share,
                ..base.clone()
            };
            let what = format!("{name} --gpu-experts {share:?}, bindings of {max_binding} bytes");
            let (got, rows) = offload_logits(&small, &path, &tokens, &opts)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let r = rel_rms(&got, &want);
            eprintln!(
                "{what}: passes of {rows} rows (full limits: {full_rows}), relative RMS {r:.2e}"
            );
            assert!(
                rows < SMALL_LIMIT_PROMPT - 4,
                "{what}: passes of {rows} rows"
            );
            assert!(
                largest_bound(&path, &opts, rows) <= max_binding,
                "{what}: passes of {rows} rows"
            );
            assert!(r <= OFFLOAD_RMS, "{what}: relative RMS {r:.2e}");
        }
        // One row of logits (n_vocab f32) is the least any pass binds.
        let tiny = BufferLimits {
            max_binding: 1024,
            max_buffer: 1 << 20,
        };
        let e = offload_logits(&offload_gpu(&path, Some(tiny)), &path, &tokens, &base)
            .expect_err("a 1 KiB binding limit");
        eprintln!("{name}, 1 KiB bindings: {e}");
        assert!(
            e.contains(&path.display().to_string())
                && e.contains("` of ")
                && e.contains(
                    "bytes exceeds the adapter's max_storage_buffer_binding_size of 1024 bytes"
                ),
            "{name}: {e}"
        );
    }
}
