//! Start-up and flag habits of the built `lathe` binary (issue 37): the pipeline cache file,
//! headless quiet, progress lines, negative numbers, `version`, and errors in words. Each
//! run is the tiny fixture or no model at all, so the file costs seconds.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn tiny() -> String {
    root()
        .join("tests/fixtures/models/qwen35-tiny")
        .display()
        .to_string()
}

/// A fresh scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("lathe-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

fn lathe_with(args: &[&str], f: impl FnOnce(&mut Command)) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lathe"));
    c.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    f(&mut c);
    c.output().expect("run lathe")
}

fn lathe(args: &[&str]) -> Output {
    lathe_with(args, |_| {})
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Fails (1: lathe's errors, 2: clap's usage errors) with a stderr containing every one of
/// `want`.
fn fails_with(args: &[&str], want: &[&str]) -> String {
    let o = lathe(args);
    let e = err(&o);
    assert!(
        matches!(o.status.code(), Some(1 | 2)),
        "lathe {args:?}: {e}"
    );
    for w in want {
        assert!(e.contains(w), "lathe {args:?}: wanted {w:?} in: {e}");
    }
    e
}

fn cache_files(cache: &Path) -> Vec<PathBuf> {
    match std::fs::read_dir(cache.join("lathe/pipelines")) {
        Ok(rd) => rd.map(|e| e.unwrap().path()).collect(),
        Err(_) => Vec::new(),
    }
}

#[test]
fn pipeline_cache_is_saved_and_damaged_files_are_ignored() {
    let cache = scratch("cache");
    let model = tiny();
    let args = [
        "run",
        "-m",
        &model,
        "--prompt-tokens",
        "1,2,3",
        "-n",
        "3",
        "--temp",
        "0",
    ];
    let run = || {
        // Mesa's own shader cache stays where it was (it follows XDG_CACHE_HOME too), so
        // the runs compile no more than any other test's.
        let mesa = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")));
        let o = lathe_with(&args, |c| {
            c.env("XDG_CACHE_HOME", &cache.0);
            if let Some(m) = &mesa {
                c.env("MESA_SHADER_CACHE_DIR", m);
            }
        });
        assert!(o.status.success(), "{}", err(&o));
        out(&o)
    };
    let first = run();
    let files = cache_files(&cache.0);
    if files.is_empty() {
        // A backend without pipeline caches (not Vulkan) writes nothing; lavapipe has one.
        let o = lathe(&["devices"]);
        assert!(!out(&o).contains("Vulkan"), "no cache file on Vulkan");
        return;
    }
    assert_eq!(files.len(), 1, "one file per adapter and driver: {files:?}");
    let bytes = std::fs::read(&files[0]).unwrap();
    assert!(bytes.starts_with(b"LATHEPC1") && bytes.len() > 48);
    // Truncated, then garbage: each run ignores the file, gives the same tokens, and
    // leaves a whole file again.
    for damaged in [bytes[..bytes.len() / 2].to_vec(), vec![7u8; 1000]] {
        std::fs::write(&files[0], &damaged).unwrap();
        assert_eq!(run(), first);
        let again = std::fs::read(&files[0]).unwrap();
        assert!(again.starts_with(b"LATHEPC1") && again.len() > 48);
    }
    assert_eq!(cache_files(&cache.0).len(), 1, "no temporary file left");
}

#[test]
fn headless_machines_get_no_wayland_noise() {
    let o = lathe_with(&["devices"], |c| {
        c.env_remove("XDG_RUNTIME_DIR")
            .env_remove("WAYLAND_DISPLAY")
            .env_remove("NODEVICE_SELECT");
    });
    assert!(o.status.success(), "{}", err(&o));
    assert!(!err(&o).contains("XDG_RUNTIME_DIR"), "{}", err(&o));
}

#[test]
fn progress_lines_reach_a_log_and_counts_follow_the_flags() {
    let model = tiny();
    // stderr is a pipe here: the warm-up says so in a line.
    let o = lathe(&[
        "run",
        "-m",
        &model,
        "--prompt-tokens",
        "1,2",
        "-n",
        "-1",
        "-c",
        "8",
        "--temp",
        "0",
    ]);
    assert!(o.status.success(), "{}", err(&o));
    assert!(err(&o).contains("warming up"), "{}", err(&o));
    // -n -1: until the context of 8 is full, 6 tokens after a prompt of 2.
    assert_eq!(out(&o).split_whitespace().count(), 6, "{}", out(&o));
    // --seed -1 (the default) picks a fresh seed; --verbose prints it.
    let seed = || {
        let o = lathe(&[
            "run",
            "-m",
            &model,
            "--prompt-tokens",
            "1",
            "-n",
            "1",
            "--verbose",
        ]);
        assert!(o.status.success(), "{}", err(&o));
        let e = err(&o);
        let at = e.find("--seed ").expect("seed printed") + 7;
        e[at..].split_whitespace().next().unwrap().to_string()
    };
    assert_ne!(seed(), seed(), "two runs, two seeds");
}

#[test]
fn negative_and_zero_values_get_their_range() {
    let model = tiny();
    let e = fails_with(
        &["run", "-m", &model, "--prompt-tokens", "1", "--temp", "-1"],
        &["--temp -1: must be"],
    );
    assert!(!e.contains("unexpected argument"), "{e}");
    fails_with(
        &["run", "-m", &model, "--prompt-tokens", "1", "--ctx", "0"],
        &["1 or more"],
    );
    fails_with(
        &["run", "-m", &model, "--prompt-tokens", "1", "-n", "-2"],
        &["-1 for until the context ends"],
    );
}

#[test]
fn version_and_errors_in_words() {
    let o = lathe(&["version"]);
    assert!(o.status.success());
    assert!(out(&o).starts_with(&format!("lathe {}", env!("CARGO_PKG_VERSION"))));
    let model = tiny();
    let e = fails_with(
        &["run", "-m", &model, "--prompt-tokens", "1", "--device", "7"],
        &["no adapter number 7", "lathe devices"],
    );
    assert!(!e.contains("Index("), "{e}");
    let dir = scratch("errors");
    let fake = dir.0.join("fake.gguf");
    std::fs::write(&fake, "not a model").unwrap();
    let e = fails_with(
        &["tokenize", "-m", fake.to_str().unwrap(), "--text", "hi"],
        &["not a GGUF file"],
    );
    assert!(!e.contains("tokenizer.json:"), "{e}");
    let empty = dir.0.join("empty");
    std::fs::create_dir(&empty).unwrap();
    fails_with(
        &["inspect", empty.to_str().unwrap()],
        &["not a model directory"],
    );
    // An architecture no family runs is named before the GPU starts, not "no vocabulary".
    let bert = dir.0.join("bert");
    std::fs::create_dir(&bert).unwrap();
    std::fs::write(
        bert.join("config.json"),
        r#"{"architectures": ["BertForMaskedLM"]}"#,
    )
    .unwrap();
    let e = fails_with(
        &["run", "-m", bert.to_str().unwrap(), "-p", "hi"],
        &["architecture BertForMaskedLM"],
    );
    assert!(!e.contains("vocabulary") && !e.contains("llvmpipe"), "{e}");
    fails_with(
        &["run", "-m", "qwen3.5:0.8b", "-p", "hi"],
        &["ollama-style name", "owner/repo"],
    );
}

#[test]
fn the_model_goes_by_flag_or_position() {
    let model = tiny();
    let by_flag = lathe(&["inspect", "-m", &model]);
    let by_pos = lathe(&["inspect", &model]);
    assert!(by_flag.status.success(), "{}", err(&by_flag));
    assert_eq!(out(&by_flag), out(&by_pos));
    let tok = root().join("tests/fixtures/tokenizer/deepseek-v4/tokenizer.json");
    let tok = tok.to_str().unwrap();
    let a = lathe(&["tokenize", tok, "--text", "Hello"]);
    let b = lathe(&["tokenize", "-m", tok, "--text", "Hello"]);
    assert!(a.status.success(), "{}", err(&a));
    assert_eq!(out(&a), out(&b));
}

#[test]
fn synth_says_its_weights_are_random() {
    let dir = scratch("synth");
    let out_file = dir.0.join("m.gguf");
    let o = lathe(&[
        "synth",
        "--preset",
        "demo",
        "--layers",
        "1",
        "-o",
        out_file.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", err(&o));
    assert!(
        err(&o).contains("weights of") && err(&o).contains("are random"),
        "{}",
        err(&o)
    );
}

/// `--chat-template NAME|FILE` and `--chat-template-file FILE` (llama-server's flags): a bad
/// one fails before any model loads, naming the flag and the file; the help lists every
/// built-in name; a built-in renders its model's format.
#[test]
fn chat_template_names_and_files() {
    let names: Vec<&str> = lathe::tokenizer::BUILTIN_TEMPLATES
        .iter()
        .map(|b| b.name)
        .collect();
    for cmd in ["run", "chat", "serve", "template"] {
        let help = out(&lathe(&[cmd, "--help"]));
        for n in &names {
            assert!(help.contains(n), "`lathe {cmd} --help` misses {n}: {help}");
        }
    }
    let model = tiny();
    let dir = scratch("template-flags");
    let bad = dir.0.join("bad.jinja");
    std::fs::write(&bad, "{% for %}").unwrap();
    let bad = bad.to_str().unwrap();
    for cmd in ["run", "chat", "serve"] {
        fails_with(
            &[cmd, "-m", &model, "--chat-template", "nosuch", "-p", "x"]
                [..if cmd == "run" { 7 } else { 5 }],
            &[
                "--chat-template nosuch",
                "neither a built-in template (chatml, deepseek-v4, llama3, smollm2) nor a file",
            ],
        );
        fails_with(
            &[cmd, "-m", &model, "--chat-template-file", "no/such.jinja"],
            &["--chat-template-file no/such.jinja", "no such file"],
        );
        fails_with(
            &[cmd, "-m", &model, "--chat-template-file", bad],
            &["--chat-template-file", "bad.jinja", "syntax"],
        );
        let o = lathe(&[
            cmd,
            "-m",
            &model,
            "--chat-template",
            "llama3",
            "--chat-template-file",
            bad,
        ]);
        assert_eq!(o.status.code(), Some(2), "{}", err(&o));
    }
    let messages = dir.0.join("m.json");
    std::fs::write(
        &messages,
        r#"[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]"#,
    )
    .unwrap();
    let m = messages.to_str().unwrap();
    let render = |args: &[&str]| {
        let o = lathe(
            &[
                &["template", "--messages", m, "--add-generation-prompt"],
                args,
            ]
            .concat(),
        );
        assert!(o.status.success(), "{args:?}: {}", err(&o));
        out(&o)
    };
    assert_eq!(
        render(&[
            "--chat-template",
            "llama3",
            "--bos-token",
            "<|begin_of_text|>"
        ]),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    assert_eq!(
        render(&["-t", "chatml"]),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        render(&[
            "-t",
            "deepseek-v4",
            "--bos-token",
            "<｜begin▁of▁sentence｜>"
        ]),
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>"
    );
    assert_eq!(
        render(&["-t", "smollm2"]),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

/// A `lathe synth` model says at load that its weights are random (GGUF
/// `lathe.random_weights`), before the GPU starts.
#[test]
fn a_random_model_says_so_at_load() {
    let dir = scratch("random-note");
    let file = dir.0.join("m.gguf");
    let f = file.to_str().unwrap();
    let o = lathe(&[
        "synth", "--preset", "demo", "--layers", "1", "--vocab", "512", "-o", f,
    ]);
    assert!(o.status.success(), "{}", err(&o));
    // An adapter that is not there: the load stops right after the note.
    let o = lathe(&["run", "-m", f, "--prompt-tokens", "1", "--device", "99"]);
    assert_eq!(o.status.code(), Some(1), "{}", err(&o));
    assert!(err(&o).contains("are random"), "{}", err(&o));
    // A trained model's file (the fixture, written by llama.cpp's converter) says nothing.
    let fixture = root().join("tests/fixtures/models/qwen35-tiny/model-f32.gguf");
    let o = lathe(&[
        "run",
        "-m",
        fixture.to_str().unwrap(),
        "--prompt-tokens",
        "1",
        "--device",
        "99",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", err(&o));
    assert!(!err(&o).contains("are random"), "{}", err(&o));
}

/// `lathe plan` on lavapipe (a CPU adapter) takes the host's measured memory bandwidth, says
/// so, and its speed limit is that bandwidth over the bytes a decode step reads: nowhere
/// near the H200's 611,517 tok/s it used to predict here.
#[test]
fn plan_uses_the_adapters_own_bandwidth() {
    let model = root().join("tests/fixtures/models/qwen35moe-tiny/model-q4_0.gguf");
    let o = lathe(&["plan", "-m", model.to_str().unwrap(), "--gpu-mem", "1GiB"]);
    assert!(o.status.success(), "{}", err(&o));
    let s = out(&o);
    let line = |start: &str| -> String {
        let l = s
            .lines()
            .map(str::trim_start)
            .find(|l| l.starts_with(start));
        l.unwrap_or_else(|| panic!("no `{start}` line in\n{s}"))
            .to_string()
    };
    let number = |text: &str, after: &str| -> f64 {
        let rest = &text[text
            .find(after)
            .unwrap_or_else(|| panic!("{after} in {text}"))
            + after.len()..];
        let n: String = rest
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        n.parse()
            .unwrap_or_else(|_| panic!("a number after {after} in {text}"))
    };
    let bw = line("bandwidth:");
    assert!(bw.contains("measured: a CPU adapter, host memory"), "{s}");
    let gbps = number(&bw, "bandwidth:");
    // Host memory: more than a slow disk, less than any machine's DRAM can give.
    assert!(gbps > 0.5 && gbps < 2000.0, "{bw}");
    // human_bytes: "1.23 MiB".
    let reads = line("VRAM reads:");
    let value = number(&reads, "VRAM reads:");
    let unit = reads.split_whitespace().nth(3).unwrap();
    let scale = match unit {
        "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        u => panic!("unit {u} in {reads}"),
    };
    let bytes = value * scale;
    let limit = line("limit (VRAM");
    assert!(
        (number(&limit, "limit (VRAM") - gbps).abs() < 0.1,
        "{limit} vs {bw}"
    );
    let alone = number(&limit, "VRAM alone");
    let want = gbps * 1e9 / bytes;
    assert!(
        (alone - want).abs() <= 0.02 * want,
        "{alone} tok/s, but {gbps} GB/s over {bytes} bytes is {want}:\n{s}"
    );
    assert!(alone < 611_517.0 / 10.0, "{s}");
    // A given bandwidth is taken as it is, and said to be the flag's.
    let o = lathe(&[
        "plan",
        "-m",
        model.to_str().unwrap(),
        "--gpu-mem",
        "1GiB",
        "--vram-bw",
        "100",
    ]);
    let s = out(&o);
    assert!(s.contains("bandwidth: 100.0 GB/s (--vram-bw)"), "{s}");
}
