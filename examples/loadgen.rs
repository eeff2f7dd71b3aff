//! Load generator for `lathe serve` (std and serde_json only, so it runs where no package
//! registry is reachable): for each concurrency level, that many clients send streamed
//! completions back to back for a while; it reports aggregate decode throughput, per-stream
//! speed and time to first token under that load.
//!
//! ```text
//! cargo run --release --example loadgen -- --addr 127.0.0.1:8080 --levels 1,4,16,64 \
//!     --duration 30 --max-tokens 256 --prompt-words 200 [--chat] [--api-key KEY] [--json out.json]
//! ```
//!
//! Replies run to `--max-tokens` (`ignore_eos`), so every level decodes the same work per
//! request. Each client's prompt differs in its first word, so the prompt cache does not
//! make later requests cheaper than the first.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

struct Opts {
    addr: String,
    levels: Vec<usize>,
    duration: Duration,
    max_tokens: usize,
    prompt_words: usize,
    chat: bool,
    api_key: Option<String>,
    json: Option<String>,
}

fn usage() -> ! {
    eprintln!(
        "usage: loadgen [--addr HOST:PORT] [--levels 1,4,16,64] [--duration S] [--max-tokens N] \
         [--prompt-words N] [--chat] [--api-key KEY] [--json PATH]"
    );
    std::process::exit(2)
}

fn parse_opts() -> Opts {
    let mut o = Opts {
        addr: "127.0.0.1:8080".into(),
        levels: vec![1, 4, 16, 64],
        duration: Duration::from_secs(30),
        max_tokens: 256,
        prompt_words: 200,
        chat: false,
        api_key: std::env::var("LATHE_API_KEY").ok(),
        json: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| usage());
        match a.as_str() {
            "--addr" => {
                o.addr = val()
                    .trim_start_matches("http://")
                    .trim_end_matches('/')
                    .into()
            }
            "--levels" => {
                o.levels = val()
                    .split(',')
                    .map(|x| x.trim().parse().unwrap_or_else(|_| usage()))
                    .collect()
            }
            "--duration" => {
                o.duration = Duration::from_secs_f64(val().parse().unwrap_or_else(|_| usage()))
            }
            "--max-tokens" => o.max_tokens = val().parse().unwrap_or_else(|_| usage()),
            "--prompt-words" => o.prompt_words = val().parse().unwrap_or_else(|_| usage()),
            "--chat" => o.chat = true,
            "--api-key" => o.api_key = Some(val()),
            "--json" => o.json = Some(val()),
            _ => usage(),
        }
    }
    o
}

/// What one request measured.
#[derive(Clone, Debug)]
struct Sample {
    /// From sending the request to the first text chunk.
    ttft: Duration,
    total: Duration,
    tokens: usize,
}

/// One streamed request over HTTP/1.1 (chunked SSE), timed.
fn one_request(o: &Opts, prompt: &str) -> std::io::Result<Sample> {
    let (path, body) = if o.chat {
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": prompt}]}),
        )
    } else {
        ("/v1/completions", json!({"prompt": prompt}))
    };
    let mut body = body;
    body["max_tokens"] = o.max_tokens.into();
    body["stream"] = true.into();
    body["stream_options"] = json!({"include_usage": true});
    body["ignore_eos"] = true.into();
    body["temperature"] = 0.into();
    let body = body.to_string();
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        o.addr,
        body.len()
    );
    if let Some(k) = &o.api_key {
        req.push_str(&format!("Authorization: Bearer {k}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(&body);

    let t0 = Instant::now();
    let mut s = TcpStream::connect(&o.addr)?;
    s.set_nodelay(true)?;
    s.write_all(req.as_bytes())?;
    let mut r = BufReader::new(s);
    let mut status = String::new();
    r.read_line(&mut status)?;
    let mut chunked = false;
    loop {
        let mut h = String::new();
        r.read_line(&mut h)?;
        if h.trim().is_empty() {
            break;
        }
        if h.to_ascii_lowercase().starts_with("transfer-encoding:") && h.contains("chunked") {
            chunked = true;
        }
    }
    if !status.contains(" 200 ") {
        let mut rest = String::new();
        let _ = r.read_to_string(&mut rest);
        return Err(std::io::Error::other(format!("{} {rest}", status.trim())));
    }
    let mut ttft = None;
    let mut tokens = 0;
    let mut pending = String::new();
    let mut error = None;
    let mut on_bytes =
        |b: &[u8], ttft: &mut Option<Duration>, tokens: &mut usize, error: &mut Option<String>| {
            pending.push_str(&String::from_utf8_lossy(b));
            while let Some(end) = pending.find("\n\n") {
                let ev: String = pending.drain(..end + 2).collect();
                let Some(data) = ev.trim().strip_prefix("data: ") else {
                    continue;
                };
                if data == "[DONE]" {
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if let Some(e) = v.get("error") {
                    *error = Some(e.to_string());
                }
                if let Some(u) = v.get("usage").and_then(|u| u.get("completion_tokens")) {
                    *tokens = u.as_u64().unwrap_or(0) as usize;
                }
                let c = &v["choices"][0];
                let text = c["text"]
                    .as_str()
                    .or(c["delta"]["content"].as_str())
                    .or(c["delta"]["reasoning_content"].as_str())
                    .unwrap_or("");
                if ttft.is_none() && !text.is_empty() {
                    *ttft = Some(t0.elapsed());
                }
            }
        };
    if chunked {
        loop {
            let mut line = String::new();
            if r.read_line(&mut line)? == 0 {
                break;
            }
            let n = usize::from_str_radix(line.trim(), 16)
                .map_err(|_| std::io::Error::other(format!("bad chunk size {line:?}")))?;
            if n == 0 {
                break;
            }
            let mut buf = vec![0u8; n + 2];
            r.read_exact(&mut buf)?;
            on_bytes(&buf[..n], &mut ttft, &mut tokens, &mut error);
        }
    } else {
        let mut buf = [0u8; 8192];
        loop {
            let n = r.read(&mut buf)?;
            if n == 0 {
                break;
            }
            on_bytes(&buf[..n], &mut ttft, &mut tokens, &mut error);
        }
    }
    if let Some(e) = error {
        return Err(std::io::Error::other(format!("error event: {e}")));
    }
    let total = t0.elapsed();
    Ok(Sample {
        ttft: ttft.unwrap_or(total),
        total,
        tokens,
    })
}

fn prompt_for(client: usize, round: usize, words: usize) -> String {
    const TEXT: &[&str] = &[
        "the", "engine", "reads", "weights", "from", "memory", "and", "every", "token", "costs",
        "one", "pass", "over", "them", "so", "batching", "many", "streams", "shares", "that",
    ];
    let mut s = format!("Client {client} request {round}:");
    for i in 0..words {
        s.push(' ');
        s.push_str(TEXT[(i * 7 + client) % TEXT.len()]);
    }
    s
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let o = parse_opts();
    // One request first: shaders compile and caches warm before anything is timed.
    if let Err(e) = one_request(&o, "warm up") {
        eprintln!("loadgen: {}: {e}", o.addr);
        std::process::exit(1);
    }
    println!(
        "{:>6} {:>9} {:>8} {:>12} {:>12} {:>10} {:>10} {:>10} {:>7}",
        "conc",
        "requests",
        "tokens",
        "agg tok/s",
        "stream tok/s",
        "ttft p50",
        "ttft p90",
        "ttft max",
        "errors"
    );
    let mut report = Vec::new();
    for &c in &o.levels {
        let t0 = Instant::now();
        let results: Vec<(Vec<Sample>, usize)> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..c)
                .map(|client| {
                    let o = &o;
                    sc.spawn(move || {
                        let (mut samples, mut errors) = (Vec::new(), 0);
                        let mut round = 0;
                        while t0.elapsed() < o.duration {
                            match one_request(o, &prompt_for(client, round, o.prompt_words)) {
                                Ok(s) => samples.push(s),
                                Err(e) => {
                                    errors += 1;
                                    eprintln!("loadgen: client {client}: {e}");
                                    std::thread::sleep(Duration::from_millis(200));
                                }
                            }
                            round += 1;
                        }
                        (samples, errors)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let wall = t0.elapsed().as_secs_f64();
        let errors: usize = results.iter().map(|r| r.1).sum();
        let samples: Vec<Sample> = results.into_iter().flat_map(|r| r.0).collect();
        let tokens: usize = samples.iter().map(|s| s.tokens).sum();
        let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
        let mut per_stream: Vec<f64> = samples
            .iter()
            .filter(|s| s.tokens > 1 && s.total > s.ttft)
            .map(|s| (s.tokens - 1) as f64 / (s.total - s.ttft).as_secs_f64())
            .collect();
        let agg = tokens as f64 / wall;
        let stream = percentile(&mut per_stream, 0.5);
        let (p50, p90) = (percentile(&mut ttft, 0.5), percentile(&mut ttft, 0.9));
        let max = ttft.iter().copied().fold(f64::NAN, f64::max);
        println!(
            "{c:>6} {:>9} {tokens:>8} {agg:>12.1} {stream:>12.1} {p50:>8.0}ms {p90:>8.0}ms {max:>8.0}ms {errors:>7}",
            samples.len()
        );
        report.push(json!({
            "concurrency": c, "requests": samples.len(), "errors": errors, "wall_s": wall,
            "completion_tokens": tokens, "aggregate_tok_s": agg, "stream_tok_s_p50": stream,
            "ttft_ms_p50": p50, "ttft_ms_p90": p90, "ttft_ms_max": max,
        }));
    }
    if let Some(p) = &o.json {
        let v = json!({"addr": o.addr, "max_tokens": o.max_tokens, "prompt_words": o.prompt_words,
                       "chat": o.chat, "levels": report});
        if let Err(e) = std::fs::write(p, serde_json::to_string_pretty(&v).unwrap()) {
            eprintln!("loadgen: {p}: {e}");
            std::process::exit(1);
        }
    }
}
