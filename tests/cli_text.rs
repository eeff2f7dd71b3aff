//! The text commands of the built `lathe` binary: `tokenize` and `template` against the
//! independent references in tests/fixtures/tokenizer, `run --prompt-tokens` against greedy
//! argmax of the CPU reference, `run` and `chat` with text on a tiny model given a vocabulary
//! made here, and the one-line errors.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use lathe::models::qwen35::cpu::CpuModel;
use lathe::models::ModelFile;
use lathe::tokenizer::Tokenizer;
use serde_json::{json, Value};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn tiny() -> PathBuf {
    root().join("tests/fixtures/models/qwen35-tiny")
}

fn lathe(args: &[&str]) -> Output {
    lathe_stdin(args, None)
}

fn lathe_stdin(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lathe"))
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start lathe");
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    child.wait_with_output().expect("run lathe")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).expect("stdout is UTF-8")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs and asserts exit 0, showing stderr otherwise.
fn ok(args: &[&str]) -> String {
    let o = lathe(args);
    assert!(o.status.success(), "lathe {args:?}: {}", stderr(&o));
    stdout(&o)
}

/// A fresh scratch directory for one test, removed when dropped.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("lathe-cli-text-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect()
}

/// `lathe tokenize --file` on every text of an expected.json: one line of ids per text.
fn check_tokenize(model: &Path, expected: &Path, what: &str) {
    let cases: Value = serde_json::from_str(&std::fs::read_to_string(expected).unwrap()).unwrap();
    let cases = cases.as_array().unwrap();
    assert!(cases.len() >= 20, "{what}: only {} cases", cases.len());
    let dir = scratch(&format!("tokenize-{what}"));
    let input = dir.join("texts.jsonl");
    let lines: Vec<String> = cases.iter().map(|c| c["text"].to_string()).collect();
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let out = ok(&[
        "tokenize",
        "--model",
        model.to_str().unwrap(),
        "--file",
        input.to_str().unwrap(),
    ]);
    let got: Vec<&str> = out.lines().collect();
    assert_eq!(got.len(), cases.len(), "{what}: one line per text");
    for (c, line) in cases.iter().zip(got) {
        let ids: Vec<u32> = serde_json::from_str(line).unwrap();
        assert_eq!(ids, ids_of(&c["ids"]), "{what}: {}", c["text"]);
    }
}

#[test]
fn tokenize_matches_references() {
    let f = root().join("tests/fixtures/tokenizer");
    // A gzip'd tokenizer.json given as a file, and a HF directory.
    check_tokenize(
        &f.join("qwen36/tokenizer.json.gz"),
        &f.join("qwen36/expected.json"),
        "qwen36",
    );
    check_tokenize(
        &f.join("deepseek-v4"),
        &f.join("deepseek-v4/expected.json"),
        "deepseek-v4",
    );
    let q = f.join("qwen36/tokenizer.json.gz");
    let q = q.to_str().unwrap();
    // --text, special-token parsing on and off, an empty text.
    assert_eq!(
        ok(&["tokenize", "-m", q, "--text", "<|im_start|>user"]),
        "[248045,846]\n"
    );
    let plain = ok(&[
        "tokenize",
        "-m",
        q,
        "--text",
        "<|im_start|>user",
        "--no-parse-special",
    ]);
    let plain: Vec<u32> = serde_json::from_str(&plain).unwrap();
    assert!(plain.len() > 2 && !plain.contains(&248_045), "{plain:?}");
    assert_eq!(ok(&["tokenize", "-m", q, "--text", ""]), "[]\n");
}

/// A vocab-only GGUF (llama.cpp's qwen35 test vocabulary): only the tokenizer is loaded.
#[test]
fn tokenize_reads_a_vocab_only_gguf() {
    let dir = root().join("../shared/fixtures/tokenizer/qwen35-llamacpp-vocab");
    let gguf = dir.join("ggml-vocab-qwen35.gguf");
    assert!(
        gguf.is_file(),
        "{} is absent: this test needs ../shared/fixtures (llama.cpp's files stay there; CI has it)",
        gguf.display()
    );
    let inp = std::fs::read_to_string(dir.join("ggml-vocab-qwen35.gguf.inp")).unwrap();
    let want = std::fs::read_to_string(dir.join("ggml-vocab-qwen35.gguf.out")).unwrap();
    let sep = "\n__ggml_vocab_test__\n";
    let texts: Vec<&str> = inp.strip_suffix(sep).unwrap_or(&inp).split(sep).collect();
    let s = scratch("vocab-gguf");
    let input = s.join("texts.jsonl");
    let lines: Vec<String> = texts.iter().map(|t| json!(t).to_string()).collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    // llama.cpp's vectors: special parsing off, no BOS.
    let out = ok(&[
        "tokenize",
        "-m",
        gguf.to_str().unwrap(),
        "--file",
        input.to_str().unwrap(),
        "--no-parse-special",
    ]);
    let got: Vec<&str> = out.lines().collect();
    let want: Vec<&str> = want.lines().collect();
    assert_eq!(got.len(), want.len());
    for ((text, g), w) in texts.iter().zip(got).zip(want) {
        let g: Vec<u32> = serde_json::from_str(g).unwrap();
        let w: Vec<u32> = w.split_whitespace().map(|t| t.parse().unwrap()).collect();
        assert_eq!(g, w, "{text:?}");
    }
}

/// Every case of tests/fixtures/tokenizer/chat/*.expected.json through `lathe template`; the
/// templates themselves stay in ../shared.
#[test]
fn template_prints_exactly_the_rendering() {
    let local = root().join("tests/fixtures/tokenizer/chat");
    let shared = root().join("../shared/fixtures/tokenizer/chat");
    let s = scratch("template");
    let mut checked = 0;
    for entry in std::fs::read_dir(&local).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let Some(model) = name.strip_suffix(".expected.json") else {
            continue;
        };
        let jinja = shared.join(format!("{model}.jinja"));
        assert!(
            jinja.is_file(),
            "{} is absent: this test needs ../shared/fixtures (templates stay there; CI has it)",
            jinja.display()
        );
        let cases: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for (i, case) in cases.as_array().unwrap().iter().enumerate() {
            let messages = s.join(format!("{model}-{i}.json"));
            std::fs::write(&messages, case["messages"].to_string()).unwrap();
            let mut args = vec![
                "template",
                "--template",
                jinja.to_str().unwrap(),
                "--messages",
                messages.to_str().unwrap(),
            ];
            if case["add_generation_prompt"].as_bool().unwrap() {
                args.push("--add-generation-prompt");
            }
            assert_eq!(
                ok(&args),
                case["rendered"].as_str().unwrap(),
                "{model} case {i}"
            );
            checked += 1;
        }
    }
    assert!(checked >= 4, "only {checked} template cases");
    // Extra variables ride along in an object; --bos-token fills `bos_token`.
    let t = s.join("t.jinja");
    std::fs::write(
        &t,
        "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}{{ flavour }}",
    )
    .unwrap();
    let m = s.join("m.json");
    std::fs::write(
        &m,
        r#"{"messages": [{"role": "user", "content": "hi"}], "flavour": "x"}"#,
    )
    .unwrap();
    let out = ok(&[
        "template",
        "-t",
        t.to_str().unwrap(),
        "--messages",
        m.to_str().unwrap(),
        "--bos-token",
        "<s>",
    ]);
    assert_eq!(out, "<s>user:hi;x");
}

/// Greedy ids of the CPU reference after `prompt`, with each step's margin between the top
/// logit and every other one (for ties).
fn cpu_greedy(prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let file = ModelFile::open(tiny().join("model-f32.gguf")).unwrap();
    let m = CpuModel::load(&file).unwrap();
    let mut seq = m.new_seq();
    let mut logits = Vec::new();
    for &t in prompt {
        logits = m.step(&mut seq, t);
    }
    let (mut ids, mut all) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let best = lathe::sample::argmax(&logits).unwrap();
        ids.push(best);
        all.push(logits.clone());
        logits = m.step(&mut seq, best);
    }
    (ids, all)
}

#[test]
fn run_prompt_tokens_is_greedy_argmax_of_the_cpu_reference() {
    let toks = lathe::npy::read_i64(tiny().join("tokens.npy")).unwrap();
    let prompt: Vec<u32> = toks.data[..10].iter().map(|&t| t as u32).collect();
    let arg: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
    let model = tiny().join("model-f32.gguf");
    let out = ok(&[
        "run",
        "-m",
        model.to_str().unwrap(),
        "--prompt-tokens",
        &arg.join(","),
        "--temp",
        "0",
        "-n",
        "8",
    ]);
    assert!(out.ends_with('\n'), "{out:?}");
    let got: Vec<u32> = out
        .split_whitespace()
        .map(|t| t.parse().expect("ids on stdout"))
        .collect();
    assert_eq!(got.len(), 8, "{out:?}");
    let (want, logits) = cpu_greedy(&prompt, 8);
    for i in 0..8 {
        if got[i] != want[i] {
            // Only a near tie may go either way (f32 GPU vs CPU differ by ~1e-5); after it
            // the sequences part, so stop comparing.
            let l = &logits[i];
            let gap = l[want[i] as usize] - l[got[i] as usize];
            assert!(
                gap < 1e-3,
                "step {i}: GPU chose {} but the CPU reference's {} leads by {gap}",
                got[i],
                want[i]
            );
            eprintln!("near tie at step {i} (gap {gap}); compared {i} ids");
            return;
        }
    }
}

/// GPT-2's byte-to-unicode table: how a byte-level BPE vocabulary writes byte `b`.
fn byte_char(b: u8) -> char {
    let printable = |c: u32| (0x21..=0x7e).contains(&c) || (0xa1..=0xac).contains(&c) || c >= 0xae;
    if printable(b as u32) {
        return char::from(b);
    }
    let k = (0..b as u32).filter(|&c| !printable(c)).count() as u32;
    char::from_u32(256 + k).unwrap()
}

/// qwen35-tiny's HF checkpoint (vocab 512) plus a tokenizer made for it, in which every id
/// has a text that tokenizes back to that id alone: printable ASCII, space and newline as
/// single bytes (no merges), the ChatML specials, and the other ids as added one-character
/// CJK tokens. So any generated ids re-tokenize to themselves, and a chat's earlier turns are
/// a token-level prefix of the next rendering (no chat template: lathe's ChatML).
fn tiny_with_vocab(name: &str, config: Value) -> Scratch {
    let dir = scratch(name);
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(tiny().join(f), dir.join(f)).unwrap();
    }
    let mut vocab = serde_json::Map::new();
    let bytes: Vec<u8> = (0x21..=0x7e).chain([b' ', b'\n']).collect();
    for (id, &b) in bytes.iter().enumerate() {
        vocab.insert(byte_char(b).to_string(), json!(id));
    }
    let added_token = |id: usize, content: String, special: bool| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": special})
    };
    let mut added = Vec::new();
    for (i, s) in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .enumerate()
    {
        added.push(added_token(bytes.len() + i, s.to_string(), true));
    }
    for id in bytes.len() + 3..512 {
        let c = char::from_u32(0x4e00 + id as u32).unwrap();
        added.push(added_token(id, c.to_string(), false));
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": true, "use_regex": true});
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added, "normalizer": null,
        "pre_tokenizer": byte_level, "post_processor": null, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

#[test]
fn tokenize_add_special_puts_bos_when_asked() {
    let dir = tiny_with_vocab(
        "bos",
        json!({"bos_token": "<|endoftext|>", "add_bos_token": true}),
    );
    let d = dir.to_str().unwrap();
    // 'H' and 'i' are bytes 0x48, 0x69: ids 0x48-0x21 and 0x69-0x21; BOS is id 96.
    assert_eq!(ok(&["tokenize", "-m", d, "--text", "Hi"]), "[39,72]\n");
    assert_eq!(
        ok(&["tokenize", "-m", d, "--text", "Hi", "--add-special"]),
        "[96,39,72]\n"
    );
}

#[test]
fn run_streams_text_and_stops() {
    let dir = tiny_with_vocab("run", json!({"eos_token": "<|im_end|>"}));
    let d = dir.to_str().unwrap();
    let tok = Tokenizer::from_hf_dir(&*dir).unwrap();
    let greedy = ["--temp", "0", "-n", "12"];
    // The ids the model picks for the prompt's tokens...
    let prompt = tok.encode("Hello there", true).unwrap();
    let arg: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
    let mut args = vec!["run", "-m", d, "--prompt-tokens"];
    let joined = arg.join(",");
    args.push(&joined);
    args.extend(greedy);
    let ids: Vec<u32> = ok(&args)
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    assert!(!ids.is_empty() && ids.len() <= 12, "{ids:?}");
    // ...are the text `run -p` prints, less an ending end-of-turn token.
    let shown = match ids.last() {
        Some(&last) if tok.is_eog(last) => &ids[..ids.len() - 1],
        _ => &ids[..],
    };
    let want = tok.decode(shown);
    let mut args = vec!["run", "-m", d, "-p", "Hello there"];
    args.extend(greedy);
    let o = lathe(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), want);
    let err = stderr(&o);
    let stats = err.lines().last().unwrap();
    assert!(
        stats.contains(&format!("prompt {} tokens", prompt.len()))
            && stats.contains(&format!("generated {} tokens", ids.len()))
            && stats.contains("first token"),
        "{err}"
    );
    // A stop string: the text ends just before its first occurrence.
    let chars: Vec<char> = want.chars().collect();
    if chars.len() >= 4 {
        let stop: String = chars[2..4].iter().collect();
        let cut = &want[..want.find(&stop).unwrap()];
        args.extend(["--stop", &stop]);
        assert_eq!(ok(&args), cut, "stop {stop:?}");
    } else {
        eprintln!(
            "only {} characters generated: stop string not tested",
            chars.len()
        );
    }
}

/// The numbers of one stats line: (prompt tokens, cached tokens, generated tokens).
fn stats_numbers(line: &str) -> (usize, usize, usize) {
    let num_after = |key: &str| -> Option<usize> {
        let at = line.find(key)? + key.len();
        line[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    };
    let prompt = num_after("prompt ").unwrap();
    let cached = line
        .find(" cached)")
        .map(|end| {
            let open = line[..end].rfind('(').unwrap();
            line[open + 1..end].parse().unwrap()
        })
        .unwrap_or(0);
    (prompt, cached, num_after("generated ").unwrap())
}

#[test]
fn chat_keeps_history_in_the_sequence() {
    let dir = tiny_with_vocab("chat", json!({"eos_token": "<|im_end|>"}));
    let d = dir.to_str().unwrap();
    let greedy = ["--temp", "0", "-n", "6"];
    let mut args = vec!["run", "-m", d, "--chat", "-p", "Hi"];
    args.extend(greedy);
    let o = lathe(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("no chat template; using ChatML"));
    let first = stdout(&o);
    let mut args = vec!["chat", "-m", d, "--stats"];
    args.extend(greedy);
    let o = lathe_stdin(&args, Some("Hi\nHow are\\\nyou?\n/reset\nHi\n"));
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success(), "{err}");
    let stats: Vec<(usize, usize, usize)> = err
        .lines()
        .filter(|l| l.starts_with("[prompt"))
        .map(stats_numbers)
        .collect();
    assert_eq!(stats.len(), 3, "{err}");
    // Turn 2 feeds only its new tokens: all that turn 1 fed (its prompt and all but the
    // last sampled token) is kept.
    let (p1, c1, g1) = stats[0];
    assert_eq!(c1, 0);
    assert_eq!(stats[1].1, p1 + g1 - 1, "{err}");
    assert!(stats[1].0 > stats[1].1);
    // After /reset the conversation starts over and gives turn 1's reply again.
    assert_eq!(stats[2], stats[0], "{err}");
    let reply = |r: &str| {
        if r.ends_with('\n') && !r.is_empty() {
            r.to_string()
        } else {
            format!("{r}\n")
        }
    };
    assert!(out.starts_with(&reply(&first)), "{out:?} vs {first:?}");
    assert!(out.ends_with(&reply(&first)), "{out:?} vs {first:?}");
    assert!(err.contains("(conversation cleared)"));
}

/// What a user gets wrong: exit 1 and one line that says what to do.
#[test]
fn errors_are_one_line_and_exit_1() {
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "run".into(),
                "-m".into(),
                "no/such.gguf".into(),
                "-p".into(),
                "hi".into(),
            ],
            "no such file",
        ),
        (
            vec!["chat".into(), "-m".into(), "no/such.gguf".into()],
            "no such file",
        ),
        (
            vec![
                "run".into(),
                "-m".into(),
                root().join("Cargo.toml").display().to_string(),
                "-p".into(),
                "hi".into(),
            ],
            "not a GGUF",
        ),
        (
            vec![
                "run".into(),
                "-m".into(),
                tiny().join("model-f32.gguf").display().to_string(),
                "-p".into(),
                "hi".into(),
            ],
            "pass --prompt-tokens",
        ),
        (
            vec![
                "tokenize".into(),
                "-m".into(),
                "no/such.json".into(),
                "--text".into(),
                "x".into(),
            ],
            "no such file",
        ),
        (
            vec![
                "tokenize".into(),
                "-m".into(),
                tiny().join("model-f32.gguf").display().to_string(),
                "--text".into(),
                "x".into(),
            ],
            "no vocabulary",
        ),
        (
            vec![
                "template".into(),
                "-t".into(),
                "no/such.jinja".into(),
                "--messages".into(),
                "m.json".into(),
            ],
            "no such file",
        ),
    ];
    for (args, says) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = lathe(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        let ours: Vec<&str> = err.lines().filter(|l| l.starts_with("lathe:")).collect();
        assert_eq!(ours.len(), 1, "{args:?}: {err}");
        assert!(ours[0].contains(says), "{args:?}: {err}");
        assert!(stdout(&o).is_empty(), "{args:?}");
    }
}

/// The library loop under the CLI: cancellation from the callback, a zero budget, prefix
/// reuse and the timings' bookkeeping.
#[test]
fn generate_loop_cancels_reuses_and_counts() {
    use lathe::generate::{GenerateOptions, Session};
    use lathe::sample::{FinishReason, SamplerConfig};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let dir = tiny_with_vocab("lib", json!({"eos_token": "<|im_end|>"}));
    let mut engine = lathe::engine::Engine::load(&dir, &Default::default()).unwrap();
    let tok = engine.tokenizer.as_ref().unwrap();
    let prompt = tok.encode("Once upon", true).unwrap();
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = GenerateOptions {
        max_tokens: Some(10),
        sampler: SamplerConfig::greedy(),
        ignore_eog: true,
        cancel: Some(cancel.clone()),
        ..Default::default()
    };
    let mut s = Session::new(&engine).unwrap();
    let full = s.generate(&mut engine, &prompt, &opts, |_| {}).unwrap();
    assert_eq!(full.finish, Some(FinishReason::Length));
    assert_eq!(full.tokens.len(), 10);
    let t = &full.timings;
    assert_eq!(
        (t.n_prompt, t.n_cached, t.n_generated),
        (prompt.len(), 0, 10)
    );
    assert!(t.first_token >= t.prefill && t.gen_tok_s().is_some());
    // The sequence holds the prompt and all but the last sampled token.
    assert_eq!(s.tokens().len(), prompt.len() + 9);
    assert_eq!(&s.tokens()[..prompt.len()], &prompt[..]);

    // Continuing the same context feeds only what is new, and greedy gives the same ids.
    let mut longer = s.tokens().to_vec();
    longer.push(full.tokens[9]);
    let more = s.generate(&mut engine, &longer, &opts, |_| {}).unwrap();
    assert_eq!(more.timings.n_cached, prompt.len() + 9);
    let mut fresh = Session::new(&engine).unwrap();
    let again = fresh.generate(&mut engine, &longer, &opts, |_| {}).unwrap();
    drop(fresh);
    assert_eq!(again.timings.n_cached, 0);
    assert_eq!(more.tokens, again.tokens);

    // A prompt that is not a continuation starts over.
    let other = s.generate(&mut engine, &prompt, &opts, |_| {}).unwrap();
    assert_eq!(other.timings.n_cached, 0);
    assert_eq!(other.tokens, full.tokens);

    // Cancelled from the callback after 3 tokens: no finish reason, 3 tokens.
    let mut seen = 0;
    let out = s
        .generate(&mut engine, &prompt, &opts, |p| {
            seen += 1;
            if p.index == 2 {
                cancel.store(true, Ordering::SeqCst);
            }
        })
        .unwrap();
    assert_eq!((out.finish.clone(), out.tokens.len(), seen), (None, 3, 3));
    assert_eq!(out.tokens, full.tokens[..3]);
    // Already cancelled: nothing runs.
    let out = s.generate(&mut engine, &prompt, &opts, |_| {}).unwrap();
    assert!(out.tokens.is_empty() && out.finish.is_none());
    cancel.store(false, Ordering::SeqCst);

    // No budget: the prompt is consumed, nothing sampled.
    let none = GenerateOptions {
        max_tokens: Some(0),
        ..opts.clone()
    };
    let out = s.generate(&mut engine, &prompt, &none, |_| {}).unwrap();
    assert_eq!(
        (out.finish, out.tokens.len()),
        (Some(FinishReason::Length), 0)
    );
    // Bad ids are refused before anything runs.
    let err = s
        .generate(&mut engine, &[0, 100_000], &opts, |_| {})
        .unwrap_err();
    assert!(
        err.to_string().contains("outside the model's vocabulary"),
        "{err}"
    );
}

/// Sampling values the server refuses are refused by the CLI too, with the flag named, and
/// before the model loads (the model path here does not even exist).
#[test]
fn sampling_flags_out_of_range_are_refused() {
    for (flag, value) in [
        ("--temp", "-1"),
        ("--temp", "NaN"),
        ("--top-p", "2"),
        ("--top-p", "NaN"),
        ("--min-p", "2"),
        ("--repeat-penalty", "0"),
        ("--repeat-penalty", "NaN"),
        ("--presence-penalty", "5"),
    ] {
        let arg = format!("{flag}={value}");
        for cmd in ["run", "chat"] {
            let mut args = vec![cmd, "-m", "no/such.gguf", &arg];
            if cmd == "run" {
                args.extend(["-p", "hi"]);
            }
            let o = lathe(&args);
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(1), "{cmd} {flag} {value}: {err}");
            assert!(
                err.contains(&format!("{flag} {}", value.parse::<f32>().unwrap())),
                "{cmd} {flag} {value}: {err}"
            );
        }
    }
}

/// `lathe run … | head -c 3`: the first failed write ends the generation (the stats line
/// says interrupted), instead of generating the whole budget for nobody.
#[test]
fn run_stops_at_a_closed_pipe() {
    use std::io::Read;
    let model = tiny().join("model-f32.gguf");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lathe"))
        .args([
            "run",
            "-m",
            model.to_str().unwrap(),
            "--prompt-tokens",
            "1,2",
        ])
        .args(["--temp", "0", "-n", "100000"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut three = [0u8; 3];
    out.read_exact(&mut three).unwrap();
    drop(out);
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let stats = err.lines().last().unwrap_or_default();
    assert!(stats.contains("interrupted"), "{err}");
    let (_, _, generated) = stats_numbers(stats);
    assert!(generated < 100_000, "{stats}");
}

/// A line that is not UTF-8 is refused alone; the conversation goes on.
#[test]
fn chat_skips_a_line_of_invalid_utf8() {
    let dir = tiny_with_vocab("chat-utf8", json!({"eos_token": "<|im_end|>"}));
    let mut child = Command::new(env!("CARGO_BIN_EXE_lathe"))
        .args([
            "chat",
            "-m",
            dir.to_str().unwrap(),
            "--stats",
            "--temp",
            "0",
        ])
        .args(["-n", "3"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"\xff\xfe bad\nHi\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("not valid UTF-8: ignored"), "{err}");
    assert_eq!(
        err.lines().filter(|l| l.starts_with("[prompt")).count(),
        1,
        "{err}"
    );
}

/// More of what a user gets wrong, each caught before the model runs (or loads).
#[test]
fn bad_paths_and_arrays_are_refused_up_front() {
    let s = scratch("upfront");
    let model = tiny().join("model-f32.gguf");
    let m = model.to_str().unwrap();
    // A directory that is not a model.
    let o = lathe(&["run", "-m", s.to_str().unwrap(), "-p", "hi"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("not a model directory"),
        "{}",
        stderr(&o)
    );
    // --save-expert-stats where nothing can be written: refused before loading.
    let o = lathe(&[
        "run",
        "-m",
        m,
        "--prompt-tokens",
        "1",
        "-n",
        "1",
        "--save-expert-stats",
        "/no/such/dir/stats.json",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("/no/such/dir/stats.json"),
        "{}",
        stderr(&o)
    );
    assert!(!stderr(&o).contains("loaded"), "{}", stderr(&o));
    // `logits` wants a non-empty 1-D array of ids.
    for (name, shape, data) in [
        ("2d.npy", vec![2usize, 2], vec![1i32, 2, 3, 4]),
        ("empty.npy", vec![0], vec![]),
    ] {
        let p = s.join(name);
        lathe::npy::write_i32(&p, &shape, &data).unwrap();
        let out = s.join("out.npy");
        let o = lathe(&[
            "logits",
            "-m",
            m,
            "--tokens",
            p.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(1), "{name}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("non-empty 1-D"),
            "{name}: {}",
            stderr(&o)
        );
    }
}

/// `lathe template` on a template that never ends: exit 1 with the limit named.
#[test]
fn template_with_a_runaway_loop_fails() {
    let s = scratch("runaway");
    let t = s.join("t.jinja");
    std::fs::write(
        &t,
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
    )
    .unwrap();
    let m = s.join("m.json");
    std::fs::write(&m, r#"[{"role": "user", "content": "hi"}]"#).unwrap();
    let o = lathe(&[
        "template",
        "-t",
        t.to_str().unwrap(),
        "--messages",
        m.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("fuel limit"), "{}", stderr(&o));
}

/// `lathe template` on a template that builds a huge value exits 1 with the limit named
/// (it used to abort on an allocation of gigabytes), and a `raise_exception` message reaches
/// stderr with its control characters escaped.
#[test]
fn template_limits_and_escaped_exceptions() {
    let s = scratch("template-hostile");
    let m = s.join("m.json");
    std::fs::write(&m, r#"[{"role": "user", "content": "hi"}]"#).unwrap();
    let run = |name: &str, source: &str| {
        let t = s.join(name);
        std::fs::write(&t, source).unwrap();
        lathe(&[
            "template",
            "-t",
            t.to_str().unwrap(),
            "--messages",
            m.to_str().unwrap(),
        ])
    };
    let o = run(
        "double.jinja",
        "{% set ns = namespace(s='ab') %}{% for i in range(48) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("value limit"), "{}", stderr(&o));
    let o = run(
        "raise.jinja",
        "{{ raise_exception('bad\\u001b[31m red\\nsecond line') }}",
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("bad\\u{1b}[31m red\\nsecond line"), "{e}");
    assert!(!e.trim_end().contains(['\n', '\u{1b}']), "{e:?}");
}

/// Inputs that used to be read without end or checked late: `tokenize --file /dev/zero`
/// stops at the line limit, `logits --out DIR` fails before loading anything, `-m` on a FIFO
/// is an error instead of a hang, and config.json's standard keys with the wrong type are
/// errors naming the key.
#[test]
fn unbounded_and_late_inputs_fail_at_once() {
    let s = scratch("unbounded");
    let model = tiny().join("model-f32.gguf");
    let vocab = root().join("tests/fixtures/tokenizer/deepseek-v4");
    let o = lathe(&[
        "tokenize",
        "-m",
        vocab.to_str().unwrap(),
        "--file",
        "/dev/zero",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("longer than"), "{}", stderr(&o));
    let ids = s.join("ids.npy");
    lathe::npy::write_i32(&ids, &[2], &[1, 2]).unwrap();
    let t0 = std::time::Instant::now();
    let o = lathe(&[
        "logits",
        "-m",
        model.to_str().unwrap(),
        "--tokens",
        ids.to_str().unwrap(),
        "--out",
        s.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("is a directory"), "{}", stderr(&o));
    assert!(t0.elapsed() < std::time::Duration::from_secs(5));
    let fifo = s.join("model.gguf");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let mut child = Command::new(env!("CARGO_BIN_EXE_lathe"))
        .args(["inspect", fifo.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > std::time::Duration::from_secs(10) {
            let _ = child.kill();
            panic!("lathe inspect FIFO hangs");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let o = child.wait_with_output().unwrap();
    assert!(stderr(&o).contains("not a regular file"), "{}", stderr(&o));

    let src = root().join("tests/fixtures/hf/qwen35-tiny");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    for (key, bad) in [
        ("tie_word_embeddings", json!("yes")),
        ("max_position_embeddings", json!("x")),
    ] {
        let dir = s.join(key);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
        let mut c = config.clone();
        c[key] = bad;
        std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
        let o = lathe(&["inspect", dir.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1), "{key}: {}", stderr(&o));
        assert!(stderr(&o).contains(key), "{key}: {}", stderr(&o));
    }
}
