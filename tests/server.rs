//! `lathe serve` end to end: the built binary on 127.0.0.1 (port 0, the address read from
//! its log) with plain HTTP/1.1 over std's TcpStream.
//!
//! The model: tests/fixtures/models/qwen35-tiny/model-f32.gguf (random weights, 512 ids)
//! given a real vocabulary: its tensors copied by `GgufWriter` with `tokenizer.ggml.*` keys
//! for the first 512 tokens of DeepSeek-V4's tokenizer.json (3 specials, the 256 byte
//! tokens, 253 merged tokens) and the 253 merges among them, pre-tokenizer `deepseek-v3`.
//! Any text encodes (every byte has a token); `<｜end▁of▁sentence｜>` (id 1) is EOS. No chat
//! template: the server's ChatML fallback renders chats. Outputs are gibberish, but greedy
//! outputs are deterministic, which is what the tests compare.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use lathe::gguf::{GgufFile, GgufWriter, Value as GV};
use serde_json::{json, Value};

const N_VOCAB: usize = 512;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Builds (once per test binary) the tiny model with a 512-token vocabulary.
fn model() -> &'static Path {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("server-test-demo.gguf");
        let src = GgufFile::open(root().join("tests/fixtures/models/qwen35-tiny/model-f32.gguf"))
            .expect("qwen35-tiny fixture");
        let tj: Value = serde_json::from_slice(
            &std::fs::read(root().join("tests/fixtures/tokenizer/deepseek-v4/tokenizer.json"))
                .expect("deepseek-v4 tokenizer.json"),
        )
        .unwrap();
        let vocab = tj["model"]["vocab"].as_object().unwrap();
        let mut tokens = vec![String::new(); N_VOCAB];
        for (t, id) in vocab {
            let id = id.as_u64().unwrap() as usize;
            if id < N_VOCAB {
                tokens[id] = t.clone();
            }
        }
        assert!(tokens.iter().all(|t| !t.is_empty()), "ids 0..512 all used");
        let known: std::collections::HashSet<&str> = tokens.iter().map(String::as_str).collect();
        let merges: Vec<GV> = tj["model"]["merges"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| {
                let (a, b) = match m {
                    Value::String(s) => {
                        let (a, b) = s.split_once(' ')?;
                        (a.to_string(), b.to_string())
                    }
                    Value::Array(p) => (p[0].as_str()?.to_string(), p[1].as_str()?.to_string()),
                    _ => return None,
                };
                let ab = format!("{a}{b}");
                (known.contains(a.as_str())
                    && known.contains(b.as_str())
                    && known.contains(ab.as_str()))
                .then(|| GV::from(format!("{a} {b}").as_str()))
            })
            .collect();
        let mut w = GgufWriter::new();
        for (k, v) in src.metadata() {
            if !k.starts_with("tokenizer.") {
                w.set(k.clone(), v.clone()).unwrap();
            }
        }
        w.set("tokenizer.ggml.model", "gpt2").unwrap();
        w.set("tokenizer.ggml.pre", "deepseek-v3").unwrap();
        w.set(
            "tokenizer.ggml.tokens",
            GV::Array(tokens.iter().map(|t| GV::from(t.as_str())).collect()),
        )
        .unwrap();
        let types: Vec<GV> = (0..N_VOCAB)
            .map(|i| GV::I32(if i < 3 { 3 } else { 1 }))
            .collect();
        w.set("tokenizer.ggml.token_type", GV::Array(types))
            .unwrap();
        w.set("tokenizer.ggml.merges", GV::Array(merges)).unwrap();
        w.set("tokenizer.ggml.bos_token_id", GV::U32(0)).unwrap();
        w.set("tokenizer.ggml.eos_token_id", GV::U32(1)).unwrap();
        w.set("tokenizer.ggml.padding_token_id", GV::U32(2))
            .unwrap();
        w.set("tokenizer.ggml.add_bos_token", GV::Bool(false))
            .unwrap();
        let tensors: Vec<_> = src.tensors().collect();
        for t in &tensors {
            w.add_tensor_info(t.name, t.dtype, t.shape).unwrap();
        }
        w.write(&out, |i, o| o.write_all(tensors[i].data)).unwrap();
        out
    })
}

/// A running `lathe serve`, killed on drop.
struct Server {
    child: Child,
    addr: String,
    log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    fn start(args: &[&str]) -> Server {
        Server::start_with(args, true)
    }

    fn start_with(args: &[&str], wait_ready: bool) -> Server {
        Server::launch(model(), args, wait_ready)
    }

    fn launch(model: &Path, args: &[&str], wait_ready: bool) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_lathe"))
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting lathe serve");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let l2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
                if let Some(a) = line.split("listening on http://").nth(1) {
                    let _ = tx.send(a.trim().to_string());
                }
                l2.lock().unwrap().push(line);
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!("server did not start: {:?}", log.lock().unwrap());
            }
        };
        let s = Server { child, addr, log };
        if wait_ready {
            s.wait_ready();
        }
        s
    }

    fn wait_ready(&self) {
        let t0 = Instant::now();
        loop {
            if let Ok((200, _)) = self.try_get("/health") {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "not ready: {:?}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    fn try_get(&self, path: &str) -> std::io::Result<(u16, Value)> {
        let (s, _, b) = request(&self.addr, "GET", path, &[], None)?;
        Ok((s, serde_json::from_slice(&b).unwrap_or(Value::Null)))
    }

    fn get(&self, path: &str) -> (u16, Value) {
        self.try_get(path).unwrap()
    }

    /// POST a JSON body; (status, parsed body).
    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_raw(path, &[], body.to_string().as_bytes())
    }

    fn post_raw(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, Value) {
        let (s, _, b) = request(&self.addr, "POST", path, headers, Some(body)).unwrap();
        let v = serde_json::from_slice(&b)
            .unwrap_or_else(|_| panic!("not JSON ({s}): {}", String::from_utf8_lossy(&b)));
        (s, v)
    }

    /// POST with `stream: true`; the `data:` payloads in order ([DONE] included).
    fn stream(&self, path: &str, body: &Value) -> (u16, Vec<String>) {
        let (s, h, b) = request(
            &self.addr,
            "POST",
            path,
            &[],
            Some(body.to_string().as_bytes()),
        )
        .unwrap();
        if s == 200 {
            assert!(h.contains("text/event-stream"), "{h}");
        }
        let text = String::from_utf8(b).unwrap();
        let events = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(String::from)
            .collect();
        (s, events)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request with `Connection: close`: (status, raw headers, body with any
/// chunked encoding undone).
fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> std::io::Result<(u16, String, Vec<u8>)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    if let Some(b) = body {
        s.write_all(b)?;
    }
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("end of headers");
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut body = raw[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = unchunk(&body);
    }
    Ok((status, head, body))
}

fn unchunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(std::str::from_utf8(&b[..eol]).unwrap().trim(), 16).unwrap();
        if n == 0 {
            break;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + n]);
        b = &b[eol + 2 + n + 2..];
    }
    out
}

/// The concatenated text of streamed chunks: (content or text, reasoning, finish_reason,
/// the usage chunk's usage).
fn assemble(events: &[String]) -> (String, String, Option<String>, Option<Value>) {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let (mut text, mut reasoning, mut finish, mut usage) =
        (String::new(), String::new(), None, None);
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            usage = Some(u.clone());
        }
        for c in v["choices"].as_array().unwrap() {
            if let Some(s) = c["text"].as_str() {
                text.push_str(s);
            }
            if let Some(s) = c.pointer("/delta/content").and_then(Value::as_str) {
                text.push_str(s);
            }
            if let Some(s) = c
                .pointer("/delta/reasoning_content")
                .and_then(Value::as_str)
            {
                reasoning.push_str(s);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (text, reasoning, finish, usage)
}

/// Bans EOS so a generation runs to its token budget.
fn no_eos() -> Value {
    json!({"1": -100})
}

fn completion(prompt: &str, n: usize) -> Value {
    json!({"model": "x", "prompt": prompt, "max_tokens": n, "temperature": 0, "logit_bias": no_eos()})
}

#[test]
fn health_models_completions_chat_and_concurrency() {
    let s = Server::start(&["--parallel", "4"]);
    let (st, h) = s.get("/health");
    assert_eq!((st, h["status"].as_str()), (200, Some("ok")), "{h}");
    assert_eq!(h["slots"]["total"], 4);
    let (st, m) = s.get("/v1/models");
    assert_eq!(st, 200);
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], "server-test-demo");

    // Completions, whole.
    let (st, r) = s.post("/v1/completions", &completion("The quick brown fox", 12));
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["object"], "text_completion");
    assert_eq!(r["model"], "x");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 12);
    assert_eq!(
        r["usage"]["total_tokens"],
        r["usage"]["prompt_tokens"].as_u64().unwrap() + 12
    );
    let text = r["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!text.is_empty());

    // The same, streamed: the same text, then usage and [DONE].
    let mut body = completion("The quick brown fox", 12);
    body["stream"] = true.into();
    body["stream_options"] = json!({"include_usage": true});
    let (st, ev) = s.stream("/v1/completions", &body);
    assert_eq!(st, 200);
    let (t2, _, finish, usage) = assemble(&ev);
    assert_eq!(t2, text, "streamed text differs from the whole one");
    assert_eq!(finish.as_deref(), Some("length"));
    assert_eq!(usage.unwrap()["completion_tokens"], 12);

    // A stop string cuts the same greedy text just before it: finish_reason stop.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let mut body = completion("The quick brown fox", 12);
    body["stop"] = json!(["never appears in it", stop]);
    let (st, r) = s.post("/v1/completions", &body);
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["choices"][0]["text"], &text[..text.find(&stop).unwrap()]);
    assert_eq!(r["choices"][0]["finish_reason"], "stop");

    // Sampling with a seed is repeatable.
    let seeded = json!({"prompt": "Dice:", "max_tokens": 10, "temperature": 1.0, "top_k": 0,
                        "top_p": 1.0, "min_p": 0, "seed": 42, "logit_bias": no_eos()});
    let (_, a) = s.post("/v1/completions", &seeded);
    let (_, b) = s.post("/v1/completions", &seeded);
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);

    // Token-id prompts and logprobs (legacy format).
    let (st, r) = s.post(
        "/v1/completions",
        &json!({"prompt": [10, 20, 30], "max_tokens": 3, "temperature": 0, "logprobs": 2, "logit_bias": no_eos()}),
    );
    assert_eq!(st, 200, "{r}");
    let lp = &r["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3);
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 2);
        // Greedy: the chosen token is the most likely one (logprobs are of the logits
        // after `logit_bias`, so the banned EOS is not it).
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(chosen < 0.0 && (best - chosen).abs() < 1e-6, "{lp}");
    }

    // Chat, whole and streamed.
    let chat = json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
                      "max_completion_tokens": 10, "temperature": 0, "logit_bias": no_eos(),
                      "logprobs": true, "top_logprobs": 3});
    let (st, r) = s.post("/v1/chat/completions", &chat);
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["object"], "chat.completion");
    assert!(r["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let msg = &r["choices"][0]["message"];
    assert_eq!(msg["role"], "assistant");
    let content = msg["content"].as_str().unwrap().to_string();
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    let lps = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(lps.len(), 10);
    assert_eq!(lps[0]["top_logprobs"].as_array().unwrap().len(), 3);
    let mut sc = chat.clone();
    sc["stream"] = true.into();
    let (st, ev) = s.stream("/v1/chat/completions", &sc);
    assert_eq!(st, 200);
    let first: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let (c2, _, finish, usage) = assemble(&ev);
    assert_eq!(c2, content.trim_start());
    assert_eq!(finish.as_deref(), Some("length"));
    assert!(
        usage.is_none(),
        "usage only with stream_options.include_usage"
    );

    // Concurrent clients get what they got alone (greedy). Two prompts are longer than a
    // prefill chunk (256 tokens), so their prefills are split and interleaved with the
    // others' decoding.
    let long: Vec<String> = (0..2)
        .map(|k| (0..60).map(|i| format!("word{} ", i * (k + 1))).collect())
        .collect();
    let prompts = [
        "Once upon a time",
        long[0].as_str(),
        "def main():",
        long[1].as_str(),
    ];
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| {
            let (st, r) = s.post("/v1/completions", &completion(p, 16));
            assert_eq!(st, 200, "{r}");
            r["choices"][0]["text"].as_str().unwrap().to_string()
        })
        .collect();
    let together: Vec<String> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let s = &s;
                sc.spawn(move || {
                    let mut body = completion(p, 16);
                    if i % 2 == 1 {
                        body["stream"] = true.into();
                        let (st, ev) = s.stream("/v1/completions", &body);
                        assert_eq!(st, 200);
                        assemble(&ev).0
                    } else {
                        let (st, r) = s.post("/v1/completions", &body);
                        assert_eq!(st, 200, "{r}");
                        r["choices"][0]["text"].as_str().unwrap().to_string()
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone);
}

#[test]
fn errors_auth_limits_and_loading() {
    let s = Server::start_with(
        &[
            "--api-key",
            "sekret",
            "--max-body",
            "2000",
            "--ctx",
            "64",
            "--debug-load-delay-ms",
            "1500",
        ],
        false,
    );
    let auth = [("Authorization", "Bearer sekret")];
    let post = |body: &[u8]| {
        let (st, _, b) =
            request(&s.addr, "POST", "/v1/chat/completions", &auth, Some(body)).unwrap();
        (st, serde_json::from_slice::<Value>(&b).unwrap())
    };
    // Loading: /health 503, generation 503 in OpenAI's error shape.
    let (st, h) = s.get("/health");
    assert_eq!((st, h["status"].as_str()), (503, Some("loading")), "{h}");
    let hello = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let (st, e) = post(hello.to_string().as_bytes());
    assert_eq!(st, 503, "{e}");
    assert_eq!(e["error"]["code"], "model_loading");
    s.wait_ready();

    // API key: everything but /health wants it.
    assert_eq!(s.get("/health").0, 200);
    let (st, e) = s.get("/v1/models");
    assert_eq!(st, 401);
    assert_eq!(e["error"]["code"], "invalid_api_key");
    let (st, e) = s.post_raw(
        "/v1/chat/completions",
        &[("Authorization", "Bearer wrong")],
        hello.to_string().as_bytes(),
    );
    assert_eq!(st, 401, "{e}");
    let (st, _, _) = request(&s.addr, "GET", "/v1/models", &auth, None).unwrap();
    assert_eq!(st, 200);
    let (st, r) = post(hello.to_string().as_bytes());
    assert_eq!(st, 200, "{r}");

    // Bad requests: 400 with the error shape and the field named.
    let (st, e) = post(b"{not json");
    assert_eq!(st, 400);
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("JSON"),
        "{e}"
    );
    for key in ["message", "type", "param", "code"] {
        assert!(e["error"].get(key).is_some(), "{e}");
    }
    // No choices, or more than --parallel slots.
    for n in [0, 1000] {
        let mut bad_n = hello.clone();
        bad_n["n"] = n.into();
        let (st, e) = post(bad_n.to_string().as_bytes());
        assert_eq!((st, e["error"]["param"].as_str()), (400, Some("n")), "{e}");
    }
    let (st, e) = post(json!({"messages": "hi"}).to_string().as_bytes());
    assert_eq!(
        (st, e["error"]["param"].as_str()),
        (400, Some("messages")),
        "{e}"
    );
    let mut t = hello.clone();
    t["temperature"] = "hot".into();
    let (st, e) = post(t.to_string().as_bytes());
    assert_eq!(
        (st, e["error"]["param"].as_str()),
        (400, Some("temperature")),
        "{e}"
    );
    // Too long for --ctx 64.
    let long = json!({"messages": [{"role": "user", "content": "word ".repeat(100)}]});
    let (st, e) = post(long.to_string().as_bytes());
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["code"], "context_length_exceeded");
    // Over --max-body.
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(3000)}]});
    let (st, e) = post(big.to_string().as_bytes());
    assert_eq!(st, 413, "{e}");
    // Unknown route, wrong method.
    let (st, _, b) = request(&s.addr, "GET", "/v1/nothing", &auth, None).unwrap();
    assert_eq!(st, 404);
    assert!(serde_json::from_slice::<Value>(&b).unwrap()["error"].is_object());
    let (st, _, _) = request(&s.addr, "GET", "/v1/chat/completions", &auth, None).unwrap();
    assert_eq!(st, 405);
    // The server still serves after all that.
    let (st, r) = post(hello.to_string().as_bytes());
    assert_eq!(st, 200, "{r}");
    // max_tokens past the context is cut at the context: finish_reason length.
    let mut m = hello.clone();
    m["max_tokens"] = 1000.into();
    m["logit_bias"] = no_eos();
    let (st, r) = post(m.to_string().as_bytes());
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    let u = &r["usage"];
    assert!(u["total_tokens"].as_u64().unwrap() <= 65, "{u}");
}

/// Opens a streaming request and reads until the first content chunk arrives.
fn open_stream(addr: &str, body: &Value) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let b = body.to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
        b.len()
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("\"text\"") {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "stream closed early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    s
}

#[test]
fn disconnect_frees_the_slot_queue_limit_and_prompt_cache() {
    let s = Server::start(&["--parallel", "1", "--queue", "1", "--ctx", "2048"]);
    let mut long = completion("A long story:", 2000);
    long["stream"] = true.into();
    let conn = open_stream(&s.addr, &long);
    // The one slot is busy: one request may wait, the next is refused.
    let addr = s.addr.clone();
    let waiting = std::thread::spawn(move || {
        let (st, _, b) = request(
            &addr,
            "POST",
            "/v1/completions",
            &[],
            Some(completion("Hi", 2).to_string().as_bytes()),
        )
        .unwrap();
        (st, String::from_utf8_lossy(&b).into_owned())
    });
    let t0 = Instant::now();
    while s.get("/health").1["slots"]["queued"] != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "second request never queued"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let (st, e) = s.post("/v1/completions", &completion("Hi", 2));
    assert_eq!(st, 429, "{e}");
    assert_eq!(e["error"]["type"], "rate_limit_error");
    // Hanging up frees the slot at once: the queued request runs and finishes.
    let t0 = Instant::now();
    drop(conn);
    let (st, body) = waiting.join().unwrap();
    assert_eq!(st, 200, "{body}");
    assert!(t0.elapsed() < Duration::from_secs(20));
    // The log line comes through a pipe: give it a moment.
    let t0 = Instant::now();
    while !s
        .log()
        .iter()
        .any(|l| l.contains("cancelled (client gone)"))
    {
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.get("/health").1["slots"]["active"], 0);

    // Prompt cache: after a 1-token reply the slot holds exactly the prompt, so a prompt
    // that extends it reuses it, and gives what a fresh slot gives.
    let p: Vec<u32> = (100..140).collect();
    let req = |ids: &[u32], n: usize| json!({"prompt": ids, "max_tokens": n, "temperature": 0, "logit_bias": no_eos()});
    let (st, r) = s.post("/v1/completions", &req(&p, 1));
    assert_eq!(st, 200, "{r}");
    let mut p2 = p.clone();
    p2.extend([7, 8, 9]);
    let (_, cached) = s.post("/v1/completions", &req(&p2, 8));
    assert_eq!(
        cached["usage"]["prompt_tokens_details"]["cached_tokens"],
        p.len()
    );
    let (_, other) = s.post("/v1/completions", &req(&[5, 6, 7], 1));
    assert_eq!(other["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, fresh) = s.post("/v1/completions", &req(&p2, 8));
    assert_eq!(fresh["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(fresh["choices"][0]["text"], cached["choices"][0]["text"]);
}

/// Template variables reach the template: DeepSeek-V4's template (read from ../shared, never
/// copied) with `enable_thinking` leaves `<think>` open, so the reply is reasoning.
#[test]
fn chat_template_kwargs_and_reasoning() {
    let tmpl = root().join("../shared/fixtures/tokenizer/chat/deepseek-v4.jinja");
    assert!(
        tmpl.is_file(),
        "{} is absent: this test needs ../shared/fixtures (templates stay there; CI has it)",
        tmpl.display()
    );
    let s = Server::start(&["--chat-template", tmpl.to_str().unwrap()]);
    let ask = |thinking: bool| {
        let (st, r) = s.post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 8,
                    "temperature": 0, "logit_bias": no_eos(),
                    "chat_template_kwargs": {"enable_thinking": thinking}}),
        );
        assert_eq!(st, 200, "{r}");
        r["choices"][0]["message"].clone()
    };
    let m = ask(true);
    assert!(
        !m["reasoning_content"].as_str().unwrap_or("").is_empty(),
        "{m}"
    );
    let m = ask(false);
    assert!(m.get("reasoning_content").is_none(), "{m}");
    assert!(!m["content"].as_str().unwrap().is_empty(), "{m}");
    // `tools` reach the template (its tool section lengthens the prompt); tool calls in
    // earlier turns, arguments given as JSON text, render too.
    let msgs = json!([{"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let n_prompt = |with_tools: bool| {
        let mut b = json!({"messages": msgs, "max_tokens": 1});
        if with_tools {
            b["tools"] = tools.clone();
        }
        let (st, r) = s.post("/v1/chat/completions", &b);
        assert_eq!(st, 200, "{r}");
        r["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    assert!(n_prompt(true) > n_prompt(false) + 100);
}

/// The official `openai` Python client against the server (tests/server_openai.py), when
/// python3 can import it.
#[test]
fn openai_python_client() {
    let has = Command::new("python3")
        .args(["-c", "import openai"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has {
        eprintln!("note: python3 cannot import `openai` (pip install openai): skipping");
        return;
    }
    let s = Server::start(&["--parallel", "4", "--api-key", "k"]);
    let out = Command::new("python3")
        .arg(root().join("tests/server_openai.py"))
        .env("LATHE_URL", format!("http://{}/v1", s.addr))
        .env("LATHE_API_KEY", "k")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}\nserver log: {:?}", s.log());
    eprintln!("{text}");
}

/// SIGTERM: no new connections, the request in flight runs to its end, then exit 0.
#[cfg(unix)]
#[test]
fn sigterm_finishes_requests_in_flight() {
    let mut s = Server::start(&[]);
    let mut body = completion("Shutting down", 150);
    body["stream"] = true.into();
    let mut conn = open_stream(&s.addr, &body);
    let ok = Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let mut rest = Vec::new();
    conn.read_to_end(&mut rest).unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("\"finish_reason\":\"length\""), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    assert!(TcpStream::connect(&s.addr).is_err());
}

/// `--timeout`: a request still running at its deadline ends with 504 (whole) or an error
/// event (streamed), and its slot is free again.
#[test]
fn request_timeout() {
    let s = Server::start(&["--timeout", "0.5", "--parallel", "1"]);
    let mut body = completion("Tick tock", 4000);
    body["ignore_eos"] = true.into();
    let (st, e) = s.post("/v1/completions", &body);
    assert_eq!(st, 504, "{e}");
    assert_eq!(e["error"]["code"], "timeout");
    body["stream"] = true.into();
    let (st, ev) = s.stream("/v1/completions", &body);
    assert_eq!(st, 200);
    let err: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(err["error"]["code"], "timeout", "{ev:?}");
    assert_eq!(s.get("/health").1["slots"]["active"], 0);
    let (st, r) = s.post("/v1/completions", &completion("Quick", 2));
    assert_eq!(st, 200, "{r}");
}

/// No head-of-line blocking: a short chat sent while a long prompt is in prefill is answered
/// while the long one is still in prefill. Each step's prompt budget (`--prefill-chunk`) is
/// shared among the prompts in prefill, so the short one is fed whole in its first step;
/// given to the oldest prompt first, it waited for the long one's whole prefill (issue 38:
/// 90 s behind 7,900 tokens on lavapipe).
#[test]
fn short_prompt_is_not_blocked_by_a_long_prefill() {
    const LONG: usize = 1500;
    let s = Server::start(&["--parallel", "2", "--prefill-chunk", "32"]);
    let long: Vec<u32> = (0..LONG as u32).map(|i| 3 + (i * 7) % 500).collect();
    let body = json!({"prompt": long, "max_tokens": 1, "temperature": 0}).to_string();
    // Its reply is not awaited: the server is stopped while it is still in prefill.
    let mut held = TcpStream::connect(&s.addr).unwrap();
    write!(
        held,
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        s.addr,
        body.len()
    )
    .unwrap();
    let long_slot = |s: &Server| {
        let (_, v) = s.get("/slots");
        let v = v.as_array().cloned().unwrap_or_default();
        v.into_iter().find(|x| x["n_prompt_tokens"] == LONG)
    };
    let t0 = Instant::now();
    while long_slot(&s).is_none_or(|x| x["n_tokens"].as_u64() <= Some(0)) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the long prompt never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let t1 = Instant::now();
    let chat =
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0});
    let (st, r) = s.post("/v1/chat/completions", &chat);
    assert_eq!(st, 200, "{r}");
    let slot = long_slot(&s).unwrap_or_else(|| {
        panic!("the short chat waited for the long prompt's whole prefill and reply")
    });
    eprintln!(
        "short chat answered in {:?}; the long prompt then: {slot}",
        t1.elapsed()
    );
    assert_eq!(
        slot["prefilling"], true,
        "the short chat waited for the long prefill: {slot}"
    );
    drop(held);
}

/// Prompt cache through a template that rewrites the last assistant turn: Qwen3.5's template
/// (read from ../shared, never copied) opens `<think>` in the generation prompt and drops it
/// from history, so turn 2 cannot keep what the slot's sequence holds. It restores the slot's
/// checkpoint, saved where turn 1's conversation ended (before the generation prompt), and
/// answers what a fresh slot answers.
#[test]
fn chat_follow_up_reuses_the_slot_checkpoint() {
    let tmpl = root().join("../shared/fixtures/tokenizer/chat/qwen35.jinja");
    assert!(
        tmpl.is_file(),
        "{} is absent: this test needs ../shared/fixtures (templates stay there; CI has it)",
        tmpl.display()
    );
    let s = Server::start(&["--parallel", "1", "--chat-template", tmpl.to_str().unwrap()]);
    let ask = |messages: &Value| {
        let body = json!({"messages": messages, "max_tokens": 6, "temperature": 0,
                          "logit_bias": no_eos()});
        let (st, r) = s.post("/v1/chat/completions", &body);
        assert_eq!(st, 200, "{r}");
        r
    };
    let cached = |r: &Value| {
        r["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let turn1 = json!([{"role": "user", "content": "Name a prime number."}]);
    let r1 = ask(&turn1);
    assert_eq!(cached(&r1), 0, "{r1}");
    let p1 = r1["usage"]["prompt_tokens"].as_u64().unwrap();
    let turn2 = json!([{"role": "user", "content": "Name a prime number."},
                       {"role": "assistant", "content": "Seven."},
                       {"role": "user", "content": "And another?"}]);
    let r2 = ask(&turn2);
    // Turn 1's conversation without its generation prompt: more than nothing, less than
    // turn 1's prompt.
    let c2 = cached(&r2);
    assert!(c2 > 0 && c2 < p1, "cached {c2} of turn 1's {p1}: {r2}");
    // An unrelated request takes the slot and its checkpoint: turn 2 then runs fresh.
    let (st, r) = s.post(
        "/v1/completions",
        &json!({"prompt": [5, 6, 7], "max_tokens": 1}),
    );
    assert_eq!(st, 200, "{r}");
    let r3 = ask(&turn2);
    assert_eq!(cached(&r3), 0, "{r3}");
    assert_eq!(r3["choices"][0]["message"], r2["choices"][0]["message"]);
}

/// A field of `/proc/<pid>/status` in bytes: `VmRSS` (resident now), `VmHWM` (peak).
#[cfg(target_os = "linux")]
fn mem_status(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| {
            v.trim_start_matches(':')
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()
        })
        .unwrap();
    kb << 10
}

/// A body of megabytes over the prompt limit is refused for a small constant over its own
/// size: the tokenizer never sees it whole (it held ~110 bytes per byte: 870 MB for this
/// body before).
#[cfg(target_os = "linux")]
#[test]
fn huge_prompts_are_refused_without_tokenizing_them_whole() {
    let s = Server::start(&["--ctx", "512"]);
    let words = "word ".repeat(1_500_000);
    let pid = s.child.id();
    // Reset the peak to what is resident now (Linux clear_refs 5), so that the peak after
    // is this request's and not the model load's.
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
    let before = mem_status(pid, "VmRSS");
    let chat = json!({"messages": [{"role": "user", "content": words}], "max_tokens": 1});
    let (st, e) = s.post("/v1/chat/completions", &chat);
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["code"], "context_length_exceeded", "{e}");
    let (st, e) = s.post(
        "/v1/completions",
        &json!({"prompt": words, "max_tokens": 1}),
    );
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["code"], "context_length_exceeded", "{e}");
    let grown = mem_status(pid, "VmHWM").saturating_sub(before);
    eprintln!(
        "peak RSS grew {} MB for a {} MB body",
        grown >> 20,
        words.len() >> 20
    );
    assert!(
        grown < 20 * words.len() as u64,
        "peak RSS grew {grown} bytes"
    );
    // A prompt that fits still runs.
    let (st, r) = s.post("/v1/completions", &completion("word word", 2));
    assert_eq!(st, 200, "{r}");
}

/// Slow and greedy clients: a Content-Length over --max-body is refused before any of the
/// body; headers that trickle and idle connections are closed after --header-timeout; a
/// body that trickles gets 408 after --body-timeout; and beyond --max-connections a client
/// waits for one to close.
#[test]
fn slow_clients_are_cut_off() {
    let s = Server::start(&[
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
        "--max-connections",
        "4",
        "--max-body",
        "1000",
    ]);
    let connect_to = |addr: &str| {
        let c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        c
    };
    let connect = || connect_to(&s.addr);
    let read_all = |mut c: TcpStream| {
        let mut got = Vec::new();
        let _ = c.read_to_end(&mut got);
        String::from_utf8_lossy(&got).into_owned()
    };
    // 100 GB announced, nothing sent: 413 at once.
    let t0 = Instant::now();
    let mut c = connect();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000000000\r\n\r\n"
    )
    .unwrap();
    let got = read_all(c);
    assert!(got.starts_with("HTTP/1.1 413"), "{got}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // Half the headers, then silence: closed after the header timeout.
    let t0 = Instant::now();
    let mut c = connect();
    write!(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n").unwrap();
    let got = read_all(c);
    assert!(!got.contains("200 OK"), "{got}");
    let dt = t0.elapsed();
    assert!(
        dt >= Duration::from_millis(800) && dt < Duration::from_secs(10),
        "{dt:?}"
    );
    // Headers, then 10 of 100 body bytes: 408 after the body timeout.
    let t0 = Instant::now();
    let mut c = connect();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\":"
    )
    .unwrap();
    let got = read_all(c);
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(t0.elapsed() < Duration::from_secs(10));
    drop(s);
    // Idle connections from one address take the cap but its reserve (one of four slots,
    // kept for other addresses: tests/fuzz.rs's slowloris test): a fourth is refused at once
    // with a readable 503, and the address is served again once its idle ones time out. Its
    // own server with a header timeout of 8 s: with 1 s, a runner whose two cores are busy
    // with the other tests' servers stalled this one past the idle ones' timeout before it
    // accepted the fourth (CI, stop 45), and the fourth was served.
    let s = Server::start(&["--header-timeout", "8", "--max-connections", "4"]);
    // Three idle connections held: one the server answered at once was refused (the start's
    // readiness probes may still hold a slot for a moment: CI, stop 46), so it is replaced.
    let t_first = Instant::now();
    let mut idle: Vec<TcpStream> = Vec::new();
    while idle.len() < 3 {
        assert!(
            t_first.elapsed() < Duration::from_secs(5),
            "no idle slot held"
        );
        let c = connect_to(&s.addr);
        c.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        match c.peek(&mut [0u8; 1]) {
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                idle.push(c)
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    let mut fourth = connect_to(&s.addr);
    write!(fourth, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let got = read_all(fourth);
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    loop {
        if let Ok((200, _)) = s.try_get("/health") {
            break;
        }
        assert!(
            t_first.elapsed() < Duration::from_secs(30),
            "never served again"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Not before the first idle one's header timeout (8 s after it connected).
    assert!(
        t_first.elapsed() >= Duration::from_secs(7),
        "{:?}",
        t_first.elapsed()
    );
    drop(idle);
}

/// Settings after which every request would fail are refused at start, as are a
/// --tokenizer or --chat-template that is not there: before the weights load (the load
/// delay would hold the server up for a minute otherwise).
#[test]
fn bad_settings_are_refused_at_start() {
    let serve = |args: &[&str]| {
        let t0 = Instant::now();
        let o = Command::new(env!("CARGO_BIN_EXE_lathe"))
            .arg("serve")
            .arg("--model")
            .arg(model())
            .args(["--port", "0", "--debug-load-delay-ms", "60000"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert!(t0.elapsed() < Duration::from_secs(30), "{args:?}");
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    for (args, says) in [
        (vec!["--max-body", "0"], "--max-body 0"),
        (vec!["--timeout", "0"], "--timeout 0"),
        (vec!["--max-prompt-tokens", "0"], "--max-prompt-tokens 0"),
        (vec!["--parallel", "0"], "--parallel 0"),
        (vec!["--max-connections", "0"], "--max-connections 0"),
        (
            vec!["--tokenizer", "no/such/tokenizer.json"],
            "no/such/tokenizer.json",
        ),
        (
            vec!["--chat-template", "no/such/t.jinja"],
            "no/such/t.jinja",
        ),
    ] {
        let (code, err) = serve(&args);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// The Authorization scheme is case-insensitive (RFC 9110): `bearer KEY` is accepted.
#[test]
fn bearer_scheme_any_case() {
    let s = Server::start(&["--api-key", "k3y"]);
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let auth = format!("{scheme} k3y");
        let (st, _, _) = request(
            &s.addr,
            "GET",
            "/v1/models",
            &[("Authorization", &auth)],
            None,
        )
        .unwrap();
        assert_eq!(st, 200, "{scheme}");
    }
    let (st, _, _) = request(
        &s.addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Basic k3y")],
        None,
    )
    .unwrap();
    assert_eq!(st, 401);
}

/// Past --shutdown-grace, every open request ends at once and says so: a stream with an
/// error event and `[DONE]`, a queued whole answer with 503; and the exit code says that
/// requests were cut.
#[cfg(unix)]
#[test]
fn shutdown_past_the_grace_period_is_honest() {
    let mut s = Server::start(&["--shutdown-grace", "0.5", "--parallel", "1"]);
    let mut body = completion("Shutting down hard", 100_000);
    body["ignore_eos"] = true.into();
    let mut streamed = body.clone();
    streamed["stream"] = true.into();
    let mut conn = open_stream(&s.addr, &streamed);
    let addr = s.addr.clone();
    let queued = std::thread::spawn(move || {
        let (st, _, b) = request(
            &addr,
            "POST",
            "/v1/completions",
            &[],
            Some(body.to_string().as_bytes()),
        )
        .unwrap();
        (st, String::from_utf8_lossy(&b).into_owned())
    });
    let t0 = Instant::now();
    while s.get("/health").1["slots"]["queued"] != 1 {
        assert!(t0.elapsed() < Duration::from_secs(10), "never queued");
        std::thread::sleep(Duration::from_millis(10));
    }
    let ok = Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let mut rest = Vec::new();
    conn.read_to_end(&mut rest).unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("\"code\":\"shutdown\""), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
    let (st, b) = queued.join().unwrap();
    assert_eq!(st, 503, "{b}");
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(1), "{:?}", s.log());
    assert!(
        s.log().iter().any(|l| l.contains("2 request(s) cut short")),
        "{:?}",
        s.log()
    );
}

/// The HTTP layer under mutated raw requests (fixed seed, a few hundred cases): every one
/// is answered with a status or closed, none hangs past the timeouts, and the server still
/// serves afterwards. Prints the totals by outcome.
#[test]
fn raw_http_fuzz() {
    let s = Server::start(&[
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
        "--timeout",
        "3",
        "--ctx",
        "64",
        "--max-body",
        "4096",
    ]);
    let body = completion("Fuzz", 2).to_string();
    let base = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut x: u64 = 0x6874_7470_6675_7a7a;
    let mut next = move || {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) as usize
    };
    let tokens = [
        "\r\n",
        "\r\n\r\n",
        ":",
        " ",
        "\0",
        "Content-Length: 99999999999\r\n",
        "Transfer-Encoding: chunked\r\n",
        "GET",
        "HTTP/1.0",
        "HTTP/9.9",
        "%00",
        "/../../",
        "Content-Length: -1\r\n",
        "Expect: 100-continue\r\n",
        "{",
        "\u{ff}",
    ];
    let cases: Vec<Vec<u8>> = (0..240)
        .map(|_| {
            let mut b = base.clone().into_bytes();
            for _ in 0..1 + next() % 3 {
                let at = next() % (b.len() + 1);
                match next() % 4 {
                    0 if at < b.len() => b[at] ^= 1 << (next() % 8),
                    1 => b.truncate(at),
                    2 => {
                        let t = tokens[next() % tokens.len()].as_bytes().to_vec();
                        b.splice(at..at, t);
                    }
                    _ => {
                        let end = (at + next() % 32).min(b.len());
                        b.drain(at..end);
                    }
                }
            }
            b
        })
        .collect();
    // (status line seen, closed without one, still open at the deadline)
    let outcomes: Vec<u8> = std::thread::scope(|sc| {
        cases
            .chunks(16)
            .flat_map(|batch| {
                let hs: Vec<_> = batch
                    .iter()
                    .map(|req| {
                        let addr = &s.addr;
                        sc.spawn(move || {
                            let mut c = TcpStream::connect(addr).unwrap();
                            c.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
                            let _ = c.write_all(req);
                            let mut got = Vec::new();
                            match c.read_to_end(&mut got) {
                                Err(e)
                                    if e.kind() == ErrorKind::WouldBlock
                                        || e.kind() == std::io::ErrorKind::TimedOut =>
                                {
                                    2
                                }
                                _ if got.starts_with(b"HTTP/1.") => 0,
                                _ => 1,
                            }
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap())
                    .collect::<Vec<u8>>()
            })
            .collect()
    });
    let count = |k| outcomes.iter().filter(|&&o| o == k).count();
    eprintln!(
        "fuzz raw HTTP: {} cases: answered {}, closed without an answer {}, hung {}",
        outcomes.len(),
        count(0),
        count(1),
        count(2)
    );
    assert_eq!(count(2), 0, "requests hung past the timeouts");
    assert!(count(0) > 0);
    assert_eq!(s.get("/health").0, 200);
    let (st, r) = s.post("/v1/completions", &completion("Still here", 2));
    assert_eq!(st, 200, "{r}");
}

/// A model whose weights make NaN logits: the request ends with an error naming the file,
/// whole (500) and streamed (an error event, then `[DONE]`), instead of token 0 repeated.
#[test]
fn non_finite_logits_end_the_request() {
    let src = GgufFile::open(model()).unwrap();
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("server-test-nan.gguf");
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.set(k.clone(), v.clone()).unwrap();
    }
    let tensors: Vec<_> = src.tensors().collect();
    for t in &tensors {
        w.add_tensor_info(t.name, t.dtype, t.shape).unwrap();
    }
    w.write(&out, |i, o| {
        let t = &tensors[i];
        if t.name == "output_norm.weight" {
            o.write_all(&f32::NAN.to_le_bytes().repeat(t.data.len() / 4))
        } else {
            o.write_all(t.data)
        }
    })
    .unwrap();
    let s = Server::launch(&out, &[], true);
    let (st, e) = s.post("/v1/completions", &completion("NaN", 4));
    assert_eq!(st, 500, "{e}");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("server-test-nan.gguf") && msg.contains("not finite"),
        "{e}"
    );
    let mut body = completion("NaN", 4);
    body["stream"] = true.into();
    let (st, ev) = s.stream("/v1/completions", &body);
    assert_eq!(st, 200);
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{ev:?}");
    assert!(ev[ev.len() - 2].contains("not finite"), "{ev:?}");
}

/// A chat template whose slow path the message text triggers stops at --template-fuel with
/// a 400 naming the limit, and the server goes on serving.
#[test]
fn runaway_chat_template_is_a_400() {
    let t = Path::new(env!("CARGO_TARGET_TMPDIR")).join("server-test-runaway.jinja");
    std::fs::write(
        &t,
        "{% for m in messages %}{% if 'slow' in m.content %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let s = Server::start(&[
        "--chat-template",
        t.to_str().unwrap(),
        "--template-fuel",
        "200000",
    ]);
    let ask = |text: &str| {
        let body = json!({"messages": [{"role": "user", "content": text}], "max_tokens": 2,
                          "temperature": 0});
        s.post("/v1/chat/completions", &body)
    };
    let t0 = Instant::now();
    let (st, e) = ask("be slow");
    assert_eq!(st, 400, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("fuel limit"),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    let (st, r) = ask("be quick");
    assert_eq!(st, 200, "{r}");
}

/// `lathe serve --devices 0,0` (two devices on one adapter, a batch in two micro-batches):
/// greedy completions are the one-device ones, and concurrent requests all finish.
#[test]
fn several_devices_serve_the_same_text() {
    let prompts = [
        "The quick brown fox",
        "Once upon a time",
        "Hello",
        "1 2 3 4",
    ];
    let texts = |s: &Server| -> Vec<String> {
        prompts
            .iter()
            .map(|p| {
                let (st, r) = s.post("/v1/completions", &completion(p, 8));
                assert_eq!(st, 200, "{r}");
                r["choices"][0]["text"].as_str().unwrap().to_string()
            })
            .collect()
    };
    let one = texts(&Server::start(&["--parallel", "4"]));
    let s = Server::start(&[
        "--parallel",
        "4",
        "--devices",
        "0,0",
        "--micro-batches",
        "2",
    ]);
    assert_eq!(texts(&s), one, "two devices wrote other greedy text");
    std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| sc.spawn(|| s.post("/v1/completions", &completion(p, 8))))
            .collect();
        for h in hs {
            let (st, r) = h.join().unwrap();
            assert_eq!(st, 200, "{r}");
            assert_eq!(r["usage"]["completion_tokens"], 8);
        }
    });
}

/// `--spec draft --draft-model`: two requests at once, each drafting with the model itself,
/// stream what the server without speculation streams; the drafts show in each reply's
/// usage (`completion_tokens_details`) and in /health. `--spec mtp` on a file without an
/// MTP block is refused at load.
#[test]
fn speculation_flags_and_stats() {
    let m = model().to_str().unwrap();
    let prompts = ["The quick brown fox", "Once upon a time"];
    let want: Vec<Value> = {
        let plain = Server::start(&["--parallel", "2"]);
        prompts
            .iter()
            .map(|p| plain.post("/v1/completions", &completion(p, 12)).1)
            .collect()
    };
    let s = Server::start(&[
        "--parallel",
        "2",
        "--spec",
        "draft",
        "--draft",
        "3",
        "--draft-model",
        m,
    ]);
    let got: Vec<Value> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let s = &s;
                sc.spawn(move || s.post("/v1/completions", &completion(p, 12)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().1).collect()
    });
    let mut drafted = 0;
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g["choices"][0]["text"], w["choices"][0]["text"], "{g}");
        let d = &g["usage"]["completion_tokens_details"];
        let (acc, rej) = (
            d["accepted_prediction_tokens"].as_u64().unwrap(),
            d["rejected_prediction_tokens"].as_u64().unwrap(),
        );
        assert!(acc > 0, "{g}");
        drafted += acc + rej;
    }
    let (_, h) = s.get("/health");
    assert_eq!(h["speculation"]["drafted"].as_u64(), Some(drafted), "{h}");
    let a = h["speculation"]["acceptance"].as_f64().unwrap();
    assert!(a > 0.0 && a <= 1.0, "{h}");
    drop(s);

    let out = Command::new(env!("CARGO_BIN_EXE_lathe"))
        .args(["serve", "--model", m, "--port", "0", "--spec", "mtp"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no MTP block"), "{err}");
}

/// The schema the structured-output test asks for: nested objects, enums, arrays and a
/// `$ref`, each bounded so a random model's reply ends well inside its token budget.
fn pet_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "kind": {"enum": ["cat", "dog", "owl"]},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
            "at": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 99},
                    "ok": {"type": "boolean"}
                },
                "required": ["x", "ok"],
                "additionalProperties": false
            }
        },
        "required": ["name", "kind", "tags", "at"],
        "additionalProperties": false,
        "$defs": {"tag": {"enum": ["a", "bb"]}}
    })
}

/// Whether `v` is valid under [`pet_schema`].
fn is_pet(v: &Value) -> bool {
    let o = v.as_object().unwrap();
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort();
    keys == ["at", "kind", "name", "tags"]
        && v["name"].as_str().is_some_and(|n| n.chars().count() <= 6)
        && ["cat", "dog", "owl"].contains(&v["kind"].as_str().unwrap_or(""))
        && v["tags"]
            .as_array()
            .is_some_and(|t| t.len() <= 3 && t.iter().all(|x| x == "a" || x == "bb"))
        && v["at"].as_object().is_some_and(|a| a.len() == 2)
        && v["at"]["x"].as_u64().is_some_and(|x| x <= 99)
        && v["at"]["ok"].is_boolean()
}

#[test]
fn structured_output_schemas_grammars_and_tool_choice() {
    let s = Server::start(&["--parallel", "2"]);
    let chat = |extra: Value| {
        let mut b = json!({
            "messages": [{"role": "user", "content": "a pet, please"}],
            "max_tokens": 200, "temperature": 1.0, "seed": 11,
        });
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    // json_schema (strict), in a whole answer and streamed, over several seeds.
    for seed in [1, 2, 3] {
        let b = chat(
            json!({"seed": seed, "response_format": {"type": "json_schema",
            "json_schema": {"name": "pet", "strict": true, "schema": pet_schema()}}}),
        );
        let (st, r) = s.post("/v1/chat/completions", &b);
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        let content = r["choices"][0]["message"]["content"].as_str().unwrap();
        let v: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {content}"));
        assert!(is_pet(&v), "{v}");
        let mut b = b.clone();
        b["stream"] = true.into();
        let (st, ev) = s.stream("/v1/chat/completions", &b);
        assert_eq!(st, 200);
        let (text, _, finish, _) = assemble(&ev);
        assert_eq!(text, content, "streamed = whole");
        assert_eq!(finish.as_deref(), Some("stop"));
    }
    // llama-server's `json_schema` field, on /v1/completions.
    let b = json!({"prompt": "pet:", "max_tokens": 200, "temperature": 1.0, "seed": 4,
        "json_schema": pet_schema()});
    let (st, r) = s.post("/v1/completions", &b);
    assert_eq!(st, 200, "{r}");
    let v: Value = serde_json::from_str(r["choices"][0]["text"].as_str().unwrap()).unwrap();
    assert!(is_pet(&v), "{v}");
    // GBNF `grammar` (llama-server's field) on both endpoints.
    let gbnf = r#"root ::= ("yes" | "no" | "maybe-" [0-9]{1,3}) "."
"#;
    let ok = |t: &str| {
        let t = t.strip_suffix('.').unwrap_or("?");
        t == "yes"
            || t == "no"
            || t.strip_prefix("maybe-").is_some_and(|d| {
                (1..=3).contains(&d.len()) && d.bytes().all(|b| b.is_ascii_digit())
            })
    };
    for seed in [5, 6] {
        let (st, r) = s.post(
            "/v1/chat/completions",
            &chat(json!({"seed": seed, "grammar": gbnf})),
        );
        assert_eq!(st, 200, "{r}");
        let t = r["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(ok(t), "{t:?}");
        let b = json!({"prompt": "ok?", "max_tokens": 20, "seed": seed, "grammar": gbnf});
        let (st, r) = s.post("/v1/completions", &b);
        assert_eq!(st, 200, "{r}");
        assert!(ok(r["choices"][0]["text"].as_str().unwrap()), "{r}");
    }
    // tool_choice: a named function and `required`; the call parses as a tool call whose
    // arguments follow the tool's schema.
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "now", "parameters": {
            "type": "object", "properties": {}, "additionalProperties": false}}}
    ]);
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    for (choice, names) in [
        (named, vec!["get_weather"]),
        (json!("required"), vec!["get_weather", "now"]),
    ] {
        let b = chat(json!({"tools": tools, "tool_choice": choice}));
        let (st, r) = s.post("/v1/chat/completions", &b);
        assert_eq!(st, 200, "{r}");
        let c = &r["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{r}");
        let call = &c["message"]["tool_calls"][0]["function"];
        let name = call["name"].as_str().unwrap();
        assert!(names.contains(&name), "{r}");
        let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
        if name == "get_weather" {
            assert!(
                ["Paris", "Oslo"].contains(&args["city"].as_str().unwrap()),
                "{args}"
            );
            assert!((1..=7).contains(&args["days"].as_u64().unwrap()), "{args}");
        } else {
            assert_eq!(args, json!({}));
        }
    }
    // json_object: a JSON object, when the reply ends before its budget.
    let b = chat(json!({"response_format": {"type": "json_object"}, "max_tokens": 300}));
    let (st, r) = s.post("/v1/chat/completions", &b);
    assert_eq!(st, 200, "{r}");
    let content = r["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.starts_with('{'), "{content:?}");
    if r["choices"][0]["finish_reason"] == "stop" {
        let v: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {content}"));
        assert!(v.is_object());
    }
    // What cannot be enforced is a 400 naming the field.
    let bad = [
        (json!({"grammar": "root ::= \"a"}), "grammar"),
        (
            json!({"grammar": "%llguidance {}\nstart: nothere"}),
            "grammar",
        ),
        (
            json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "strict": true, "schema": {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}}),
            "response_format.json_schema",
        ),
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format.json_schema",
        ),
        (
            json!({"grammar": "root ::= \"a\"", "json_schema": {"type": "object"}}),
            "grammar",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice.function.name",
        ),
        (
            json!({"tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}}),
            "tool_choice",
        ),
    ];
    for (extra, param) in bad {
        let (st, e) = s.post("/v1/chat/completions", &chat(extra.clone()));
        assert_eq!(
            (st, e["error"]["param"].as_str()),
            (400, Some(param)),
            "{extra}: {e}"
        );
    }
}

/// The chat page at `/` in headless Chromium (tests/server_web.py over the DevTools
/// protocol): it loads with nothing from elsewhere, streams a reply with `--api-key`, stops
/// one, renders markdown and shows reasoning apart. Chromium and Python's websocket-client
/// are test dependencies (`.ci/run` installs them): missing, the test fails.
#[test]
fn web_chat_page_in_headless_chromium() {
    let chromium = ["chromium", "chromium-browser"]
        .into_iter()
        .find(|c| {
            Command::new(c)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .expect("no chromium on PATH: install it (Debian: apt-get install chromium; .ci/run does)");
    let ws = Command::new("python3")
        .args(["-c", "import websocket"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ws,
        "python3 cannot import `websocket` (pip install websocket-client; .ci/run does)"
    );
    let s = Server::start(&["--api-key", "k"]);
    let (st, _, page) = request(&s.addr, "GET", "/", &[], None).unwrap();
    assert_eq!(st, 200, "the page needs no key");
    let page = String::from_utf8(page).unwrap();
    assert!(page.contains("<title>lathe chat</title>"));
    assert!(
        !page.contains("src=\"http") && !page.contains("href=\"http"),
        "no CDN"
    );
    let out = Command::new("python3")
        .arg(root().join("tests/server_web.py"))
        .env("LATHE_URL", format!("http://{}/", s.addr))
        .env("LATHE_API_KEY", "k")
        .env("LATHE_CHROMIUM", chromium)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}\nserver log: {:?}", s.log());
    eprintln!("{text}");
}

/// `/metrics`, `/tokenize`, `/detokenize`, `/props`, `/slots`, and rejected requests logged.
#[test]
fn metrics_tokenize_props_slots_and_rejection_log() {
    let s = Server::start(&["--parallel", "2"]);
    let (st, r) = s.post("/v1/completions", &completion("hello", 5));
    assert_eq!(st, 200, "{r}");
    let (st, e) = s.post(
        "/v1/completions",
        &json!({"prompt": "x", "temperature": "hot"}),
    );
    assert_eq!(st, 400, "{e}");
    let (st, _, m) = request(&s.addr, "GET", "/metrics", &[], None).unwrap();
    assert_eq!(st, 200);
    let m = String::from_utf8(m).unwrap();
    for line in [
        "lathe_requests_total{outcome=\"length\"} 1",
        "lathe_requests_total{outcome=\"rejected\"} 1",
        "lathe_generated_tokens_total 5",
        "lathe_slots 2",
        "lathe_active_slots 0",
        "lathe_time_to_first_token_seconds_count 1",
        "lathe_time_per_output_token_seconds_count 4",
    ] {
        assert!(m.lines().any(|l| l == line), "no `{line}` in\n{m}");
    }
    assert!(m.contains("lathe_gpu_memory_bytes{kind=\"model\"}"), "{m}");
    let (st, t) = s.post(
        "/tokenize",
        &json!({"content": "hello world", "with_pieces": true}),
    );
    assert_eq!(st, 200, "{t}");
    let ids: Vec<Value> = t["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].clone())
        .collect();
    let pieces: String = t["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["piece"].as_str().unwrap())
        .collect();
    assert_eq!(pieces, "hello world");
    let (st, d) = s.post("/detokenize", &json!({"tokens": ids}));
    assert_eq!(
        (st, d["content"].as_str()),
        (200, Some("hello world")),
        "{d}"
    );
    let (st, e) = s.post("/detokenize", &json!({"tokens": [99999]}));
    assert_eq!(
        (st, e["error"]["param"].as_str()),
        (400, Some("tokens")),
        "{e}"
    );
    let (st, p) = s.get("/props");
    assert_eq!((st, p["total_slots"].as_u64()), (200, Some(2)), "{p}");
    // The slots are published after each step, which may end after the last answer went out:
    // they read idle within a bounded wait.
    let t0 = Instant::now();
    loop {
        let (st, sl) = s.get("/slots");
        assert_eq!(st, 200);
        assert_eq!(sl.as_array().unwrap().len(), 2, "{sl}");
        let idle = sl
            .as_array()
            .unwrap()
            .iter()
            .all(|x| x["is_processing"] == false);
        if idle {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{sl}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The server's stderr reaches the log through a reader thread: wait for the lines (up to
    // 10 s) rather than assume they landed when the slots went idle.
    let t0 = Instant::now();
    let mut log = s.log().join("\n");
    while !(log.contains("POST /v1/completions: 400 Bad Request:") && log.contains("finish length"))
        && t0.elapsed() < Duration::from_secs(10)
    {
        std::thread::sleep(Duration::from_millis(50));
        log = s.log().join("\n");
    }
    assert!(
        log.contains("POST /v1/completions: 400 Bad Request:") && log.contains("temperature"),
        "{log}"
    );
    assert!(
        log.contains("finish length"),
        "finish reasons as words: {log}"
    );
}

/// A GGUF whose chat template builds huge values (a string doubled in a loop, a list nested
/// 20,000 deep and printed with `tojson`) used to abort `lathe serve` (out of memory, or the
/// HTTP thread's stack): each chat request is a 400 naming the limit, and the server goes on
/// serving.
#[test]
fn template_that_builds_huge_values_is_a_400() {
    let src = GgufFile::open(model()).unwrap();
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("server-test-hostile-template.gguf");
    let template = "{% set ns = namespace(s='ab', l=[]) %}\
        {% if messages[0].content == 'deep' %}\
        {% for i in range(20000) %}{% set ns.l = [ns.l] %}{% endfor %}{{ ns.l|tojson }}\
        {% else %}\
        {% for i in range(48) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}\
        {% endif %}";
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.set(k.clone(), v.clone()).unwrap();
    }
    w.set("tokenizer.chat_template", template).unwrap();
    let tensors: Vec<_> = src.tensors().collect();
    for t in &tensors {
        w.add_tensor_info(t.name, t.dtype, t.shape).unwrap();
    }
    w.write(&out, |i, o| o.write_all(tensors[i].data)).unwrap();
    let s = Server::launch(&out, &[], true);
    for text in ["double", "deep"] {
        let body = json!({"messages": [{"role": "user", "content": text}], "max_tokens": 2});
        let (st, e) = s.post("/v1/chat/completions", &body);
        assert_eq!(st, 400, "{text}: {e}");
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.contains("limit"), "{text}: {msg}");
        assert_eq!(s.get("/health").0, 200, "{text}");
    }
    let (st, r) = s.post("/v1/completions", &completion("Still here", 2));
    assert_eq!(st, 200, "{r}");
}

/// The value of an unlabelled counter in a `/metrics` scrape.
fn metric(s: &Server, name: &str) -> f64 {
    let (st, _, m) = request(&s.addr, "GET", "/metrics", &[], None).unwrap();
    assert_eq!(st, 200);
    let m = String::from_utf8(m).unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in\n{m}"))
        .parse()
        .unwrap()
}

/// `n > 1`: n choices indexed 0..n, decoded side by side in their own slots, the prompt
/// computed once (the other choices copy its state: their prompt tokens count as cached),
/// usage summing the choices' tokens; greedy choices are equal, seeded ones repeatable and
/// distinct, the first the same as `n = 1`'s; streamed chunks carry their choice's index;
/// constraints hold for every choice; `n` over `--parallel` is a 400 naming `n`.
#[test]
fn several_choices_per_request() {
    let s = Server::start(&["--parallel", "3"]);
    let prompt = "Three ways to say hello";
    let cached0 = metric(&s, "lathe_prompt_cached_tokens_total");
    let mut body = completion(prompt, 8);
    body["n"] = 3.into();
    let (st, r) = s.post("/v1/completions", &body);
    assert_eq!(st, 200, "{r}");
    let ch = r["choices"].as_array().unwrap();
    assert_eq!(ch.len(), 3);
    for (i, c) in ch.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], ch[0]["text"], "greedy choices are equal: {r}");
    }
    let n_prompt = r["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(r["usage"]["completion_tokens"], 24);
    assert_eq!(r["usage"]["total_tokens"], n_prompt + 24);
    // Two choices took all but the prompt's last token by copy.
    let copied = metric(&s, "lathe_prompt_cached_tokens_total") - cached0;
    assert_eq!(copied, 2.0 * (n_prompt - 1) as f64);

    // Seeded sampling: the first choice is n = 1's, the others differ, all repeatable.
    let seeded = |n: usize| {
        json!({"prompt": "Dice:", "max_tokens": 10, "temperature": 1.0, "top_k": 0,
               "top_p": 1.0, "min_p": 0, "seed": 7, "logit_bias": no_eos(), "n": n})
    };
    let texts = |r: &Value| -> Vec<String> {
        r["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["text"].as_str().unwrap().to_string())
            .collect()
    };
    let (_, a) = s.post("/v1/completions", &seeded(3));
    let (_, b) = s.post("/v1/completions", &seeded(3));
    let (_, single) = s.post("/v1/completions", &seeded(1));
    let (ta, tb) = (texts(&a), texts(&b));
    assert_eq!(ta, tb, "seeded choices repeat");
    assert_eq!(ta[0], texts(&single)[0]);
    assert!(ta[0] != ta[1] && ta[1] != ta[2], "{ta:?}");

    // Chat, streamed: every chunk names its choice; each choice's text is the whole reply's.
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                      "temperature": 0, "logit_bias": no_eos(), "n": 2,
                      "stream": true, "stream_options": {"include_usage": true}});
    let (st, ev) = s.stream("/v1/chat/completions", &chat);
    assert_eq!(st, 200);
    let mut per = [String::new(), String::new()];
    let mut finishes = 0;
    let mut usage = Value::Null;
    for e in &ev[..ev.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
        for c in v["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            per[i].push_str(
                c.pointer("/delta/content")
                    .and_then(Value::as_str)
                    .unwrap_or(""),
            );
            finishes += c["finish_reason"].is_string() as usize;
        }
    }
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(finishes, 2);
    assert_eq!(usage["completion_tokens"], 12, "{usage}");
    let mut whole = chat.clone();
    whole["stream"] = false.into();
    let (st, w) = s.post("/v1/chat/completions", &whole);
    assert_eq!(st, 200, "{w}");
    for (i, text) in per.iter().enumerate() {
        let c = &w["choices"][i];
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"].as_str().unwrap(), text.as_str());
    }

    // A schema holds for every choice.
    let constrained = json!({"messages": [{"role": "user", "content": "A pet"}], "n": 3,
        "max_tokens": 200, "temperature": 1.0, "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": pet_schema(), "strict": true}}});
    let (st, r) = s.post("/v1/chat/completions", &constrained);
    assert_eq!(st, 200, "{r}");
    for c in r["choices"].as_array().unwrap() {
        let v: Value = serde_json::from_str(c["message"]["content"].as_str().unwrap())
            .unwrap_or_else(|e| panic!("{e}: {c}"));
        assert!(is_pet(&v), "{v}");
    }

    let mut too_many = completion(prompt, 2);
    too_many["n"] = 4.into();
    let (st, e) = s.post("/v1/completions", &too_many);
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["param"], "n", "{e}");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--parallel"));
    let (_, h) = s.get("/health");
    assert_eq!(
        h["slots"]["active"], 0,
        "every choice's slot is free again: {h}"
    );
}

/// A streamed Responses API answer: (event name, data) in order.
fn named_events(s: &Server, path: &str, body: &Value) -> Vec<(String, Value)> {
    let (st, h, b) = request(
        &s.addr,
        "POST",
        path,
        &[],
        Some(body.to_string().as_bytes()),
    )
    .unwrap();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert!(h.contains("text/event-stream"), "{h}");
    String::from_utf8(b)
        .unwrap()
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let (name, data) = e.split_once('\n').expect("event and data lines");
            let name = name.strip_prefix("event: ").expect("an event line");
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], name, "{data}");
            (name.to_string(), data)
        })
        .collect()
}

/// `/v1/responses`: `instructions` + `input` run as the same chat does (the same greedy text
/// as `/v1/chat/completions`), as a `message` item with `output_text`, `usage` in input and
/// output tokens, `incomplete` at `max_output_tokens`; streamed as OpenAI's named events, in
/// order, with sequence numbers; `text.format` and forced tools through structured output
/// (a `function_call` item); input items of every kind; unsupported fields are 400s naming them.
#[test]
fn responses_api() {
    let s = Server::start(&["--parallel", "2"]);
    let chat = json!({"messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hello there"}],
                      "max_tokens": 8, "temperature": 0, "logit_bias": no_eos()});
    let (st, c) = s.post("/v1/chat/completions", &chat);
    assert_eq!(st, 200, "{c}");
    let want = c["choices"][0]["message"]["content"].as_str().unwrap();
    let body = json!({"model": "m", "instructions": "Be brief.", "input": "Hello there",
                      "max_output_tokens": 8, "temperature": 0, "logit_bias": no_eos()});
    let (st, r) = s.post("/v1/responses", &body);
    assert_eq!(st, 200, "{r}");
    assert!(r["id"].as_str().unwrap().starts_with("resp_"), "{r}");
    assert_eq!(r["object"], "response");
    assert_eq!(r["status"], "incomplete", "{r}");
    assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(r["instructions"], "Be brief.");
    assert_eq!(r["max_output_tokens"], 8);
    let out = r["output"].as_array().unwrap();
    assert_eq!(out.len(), 1, "{r}");
    assert_eq!(
        (out[0]["type"].as_str(), out[0]["role"].as_str()),
        (Some("message"), Some("assistant"))
    );
    assert_eq!(out[0]["content"][0]["type"], "output_text");
    assert_eq!(out[0]["content"][0]["text"], want, "the chat's reply");
    assert_eq!(r["usage"]["output_tokens"], 8);
    assert_eq!(r["usage"]["input_tokens"], c["usage"]["prompt_tokens"]);

    // The same as input items (a developer message, text parts), streamed.
    let mut sb = body.clone();
    sb["instructions"] = Value::Null;
    sb["input"] = json!([{"role": "developer", "content": "Be brief."},
                         {"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": "Hello there"}]}]);
    sb["stream"] = true.into();
    let ev = named_events(&s, "/v1/responses", &sb);
    let names: Vec<&str> = ev
        .iter()
        .map(|e| e.0.as_str())
        .filter(|n| !n.ends_with(".delta"))
        .collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
    );
    for (i, e) in ev.iter().enumerate() {
        assert_eq!(e.1["sequence_number"], i);
    }
    let deltas: String = ev
        .iter()
        .filter(|e| e.0 == "response.output_text.delta")
        .map(|e| e.1["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, want);
    let done = &ev
        .iter()
        .find(|e| e.0 == "response.output_text.done")
        .unwrap()
        .1;
    assert_eq!(done["text"], want);
    let last = &ev.last().unwrap().1["response"];
    assert_eq!(last["output"][0]["content"][0]["text"], want);
    assert_eq!(last["usage"]["output_tokens"], 8);

    // text.format json_schema: the reply follows the schema and completes.
    let fmt = json!({"input": "a pet", "max_output_tokens": 200, "temperature": 1.0, "seed": 2,
        "text": {"format": {"type": "json_schema", "name": "pet", "schema": pet_schema(), "strict": true}}});
    let (st, r) = s.post("/v1/responses", &fmt);
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["status"], "completed", "{r}");
    let text = r["output"][0]["content"][0]["text"].as_str().unwrap();
    assert!(is_pet(&serde_json::from_str(text).unwrap()), "{text}");

    // A forced tool: a function_call item; then the call and its output go back as input.
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": false}}]);
    let tb = json!({"input": "weather?", "tools": tools, "tool_choice": "required",
                    "max_output_tokens": 100, "temperature": 0});
    let (st, r) = s.post("/v1/responses", &tb);
    assert_eq!(st, 200, "{r}");
    let call = r["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["type"] == "function_call");
    let call = call.unwrap_or_else(|| panic!("no function_call: {r}"));
    assert_eq!(call["name"], "get_weather");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(
        ["Paris", "Oslo"].contains(&args["city"].as_str().unwrap()),
        "{args}"
    );
    let mut sb = tb.clone();
    sb["stream"] = true.into();
    let ev = named_events(&s, "/v1/responses", &sb);
    let fc = ev
        .iter()
        .find(|e| e.0 == "response.function_call_arguments.done")
        .unwrap();
    assert_eq!(fc.1["arguments"], call["arguments"]);
    assert_eq!(ev.last().unwrap().0, "response.completed");
    let follow = json!({"input": [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": call["call_id"], "name": "get_weather", "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}],
        "tools": tools, "max_output_tokens": 4, "temperature": 0});
    let (st, r) = s.post("/v1/responses", &follow);
    assert_eq!(st, 200, "{r}");

    for (extra, param) in [
        (
            json!({"previous_response_id": "resp_x"}),
            "previous_response_id",
        ),
        (json!({"store": true}), "store"),
        (json!({"background": true}), "background"),
        (json!({"input": []}), "input"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input[0].content[0]",
        ),
        (json!({"tools": [{"type": "web_search"}]}), "tools[0].type"),
        (json!({"max_output_tokens": 0}), "max_output_tokens"),
        (json!({"text": {"format": {"type": "xml"}}}), "text.format"),
    ] {
        let mut b = json!({"input": "x"});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let (st, e) = s.post("/v1/responses", &b);
        assert_eq!(
            (st, e["error"]["param"].as_str()),
            (400, Some(param)),
            "{extra}: {e}"
        );
    }
}

/// The embedding of `ids` from the CPU reference forward (tests/qwen35.rs checks it against
/// the fixtures): each position's final-norm hidden state, pooled (`last`: the last one;
/// else the mean), L2-normalised.
fn cpu_embedding(ids: &[u32], last: bool) -> Vec<f64> {
    let file = lathe::model_file::ModelFile::open(model()).unwrap();
    let m = lathe::models::qwen35::cpu::CpuModel::load(&file).unwrap();
    let mut seq = m.new_seq();
    let states: Vec<Vec<f32>> = ids.iter().map(|&t| m.hidden(&mut seq, t)).collect();
    let rows = if last {
        &states[states.len() - 1..]
    } else {
        &states[..]
    };
    let mut acc = vec![0f64; rows[0].len()];
    for r in rows {
        for (a, &x) in acc.iter_mut().zip(r) {
            *a += x as f64;
        }
    }
    let norm = acc.iter().map(|a| a * a).sum::<f64>().sqrt();
    acc.iter().map(|a| a / norm).collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// `/v1/embeddings`: the final-norm hidden states pooled and L2-normalised equal the CPU
/// reference forward's (mean pooling by default, `--pooling last`) within 1e-4 per value;
/// a batch gives what each input gives alone; text and its token ids give the same vector;
/// base64 is the same f32 values; usage counts the tokens; bad inputs are 400s naming the
/// field.
#[test]
fn embeddings_match_the_cpu_reference() {
    let s = Server::start(&["--parallel", "2"]);
    let ids: Vec<u32> = {
        let (_, t) = s.post("/tokenize", &json!({"content": "The quick brown fox"}));
        t["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let (st, r) = s.post(
        "/v1/embeddings",
        &json!({"model": "e", "input": "The quick brown fox"}),
    );
    assert_eq!(st, 200, "{r}");
    assert_eq!(
        (r["object"].as_str(), r["model"].as_str()),
        (Some("list"), Some("e"))
    );
    assert_eq!(r["data"][0]["object"], "embedding");
    assert_eq!(r["usage"]["prompt_tokens"], ids.len());
    let e = floats(&r["data"][0]["embedding"]);
    let norm = e.iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    let want = cpu_embedding(&ids, false);
    let d = max_diff(&e, &want);
    assert!(d < 1e-4, "mean pooling: max |gpu - cpu| = {d}");

    // A batch (text, token ids, another text) gives each input's own vector.
    let (st, b) = s.post(
        "/v1/embeddings",
        &json!({"input": ["The quick brown fox", ids, "Jumps over"]}),
    );
    assert_eq!(st, 200, "{b}");
    let (_, alone) = s.post("/v1/embeddings", &json!({"input": "Jumps over"}));
    let data = b["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    assert!(max_diff(&floats(&data[0]["embedding"]), &e) < 1e-6);
    assert!(max_diff(&floats(&data[1]["embedding"]), &e) < 1e-6);
    assert!(
        max_diff(
            &floats(&data[2]["embedding"]),
            &floats(&alone["data"][0]["embedding"])
        ) < 1e-6
    );
    assert_eq!(data[2]["index"], 2);

    // base64: the same values, as little-endian f32.
    let (st, b64) = s.post(
        "/v1/embeddings",
        &json!({"input": "The quick brown fox", "encoding_format": "base64", "dimensions": e.len()}),
    );
    assert_eq!(st, 200, "{b64}");
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let got: Vec<f64> = bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
        .collect();
    assert!(max_diff(&got, &e) < 1e-7);

    for (body, param) in [
        (json!({"input": []}), "input"),
        (json!({"input": ["a", ""]}), "input[1]"),
        (json!({"input": [[1, 2], [600]]}), "input[1]"),
        (
            json!({"input": "a", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (json!({"input": "a", "dimensions": 3}), "dimensions"),
    ] {
        let (st, r) = s.post("/v1/embeddings", &body);
        assert_eq!(
            (st, r["error"]["param"].as_str()),
            (400, Some(param)),
            "{body}: {r}"
        );
    }
    // The slots still generate.
    let (st, r) = s.post("/v1/completions", &completion("The quick brown fox", 4));
    assert_eq!(st, 200, "{r}");
    drop(s);

    let s = Server::start(&["--pooling", "last"]);
    let (st, r) = s.post("/v1/embeddings", &json!({"input": ids}));
    assert_eq!(st, 200, "{r}");
    let d = max_diff(
        &floats(&r["data"][0]["embedding"]),
        &cpu_embedding(&ids, true),
    );
    assert!(d < 1e-4, "last pooling: max |gpu - cpu| = {d}");
}
