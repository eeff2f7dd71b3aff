//! Sequence checkpoints (`Engine::copy_seq`): a copy of a sequence continues exactly as the
//! original does. Tokens A run on seq 1; seq 1 is copied into seq 2 (which held other, longer
//! content before: its stale KV rows and recurrent state must not leak through); then tokens
//! B (a prefill chunk, then single-token decode steps) go to seq 1, seq 2 and a third seq that
//! was fed A and then B the same way. Same kernels on the same inputs: the logits must be
//! bit-identical. The caches start small (`ctx` 16) so the copies cross cache growth:
//! Qwen3.5's shared pools double while A runs, and DeepSeek-V4's compressed caches of seq 1
//! outgrow the fresh seq 2's, which the copy must grow.
//!
//! Then the [`Session`] checkpoint built on it: a chat turn whose rendering rewrites what the
//! sequence holds restores the checkpoint and generates what a fresh prefill gives, with
//! Qwen3.6's own template and vocabulary; and a prefill cancelled between pieces leaves the
//! session consistent.

use lathe::engine::{Engine, LoadOptions, Seq};
use lathe::generate::{reusable_prefix, ChatPrompt, GenerateOptions, Session};
use lathe::sample::SamplerConfig;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

fn model(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(rel)
}

/// Deterministic ids in `[0, vocab)` (a 64-bit LCG's high bits).
fn ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// B's logits on `seq`: every position of a prefill of all but the last 3 tokens, then one
/// decode step per remaining token.
fn feed_b(e: &mut Engine, seq: &mut Seq, b: &[u32]) -> Vec<f32> {
    let split = b.len() - 3;
    let mut out = e.forward(seq, &b[..split], true).unwrap();
    for t in &b[split..] {
        out.extend(e.forward(seq, std::slice::from_ref(t), true).unwrap());
    }
    out
}

fn check(rel: &str, n_a: usize, n_b: usize) {
    let opts = LoadOptions {
        ctx: 16,
        ..Default::default()
    };
    let mut e = Engine::load(&model(rel), &opts).unwrap();
    let v = e.vocab_size();
    let a = ids(n_a, v, 1);
    let b = ids(n_b, v, 2);
    let other = ids(n_a + 40, v, 3);

    let mut s1 = e.new_seq().unwrap();
    e.forward(&mut s1, &a, false).unwrap();
    // Seq 2 holds something else first, further along than A.
    let mut s2 = e.new_seq().unwrap();
    e.forward(&mut s2, &other, false).unwrap();
    e.copy_seq(&s1, &mut s2).unwrap();
    assert_eq!(s2.pos(), n_a, "{rel}: position copied");
    // A fresh, small seq 3 receives a copy too (DeepSeek-V4: its caches must grow).
    let mut s3 = e.new_seq().unwrap();
    e.copy_seq(&s1, &mut s3).unwrap();

    let l1 = feed_b(&mut e, &mut s1, &b);
    let l2 = feed_b(&mut e, &mut s2, &b);
    let l3 = feed_b(&mut e, &mut s3, &b);
    drop((s1, s2, s3));
    let mut s4 = e.new_seq().unwrap();
    e.forward(&mut s4, &a, false).unwrap();
    let l4 = feed_b(&mut e, &mut s4, &b);
    assert_eq!(l1.len(), n_b * v);
    let first_diff = |x: &[f32]| {
        x.iter()
            .zip(&l4)
            .position(|(p, q)| p.to_bits() != q.to_bits())
    };
    assert_eq!(first_diff(&l1), None, "{rel}: the original after copying");
    assert_eq!(first_diff(&l2), None, "{rel}: copy over other content");
    assert_eq!(first_diff(&l3), None, "{rel}: copy into a fresh seq");
    // The state decides the logits: B after other content differs (the check can fail).
    let mut s5 = e.new_seq().unwrap();
    e.forward(&mut s5, &other, false).unwrap();
    assert!(first_diff(&feed_b(&mut e, &mut s5, &b)).is_some(), "{rel}");
}

#[test]
fn qwen35_copy_continues_exactly() {
    check("qwen35-tiny/model-f32.gguf", 300, 40);
}

#[test]
fn qwen35moe_copy_continues_exactly() {
    check("qwen35moe-tiny/model-f32.gguf", 300, 40);
}

#[test]
fn deepseek4_copy_continues_exactly() {
    check("dsv4-tiny/model-f32.gguf", 300, 40);
}

/// A sequence of another model is refused, not mixed up.
#[test]
fn copy_between_models_is_an_error() {
    let q = Engine::load(&model("qwen35-tiny/model-f32.gguf"), &Default::default()).unwrap();
    let d = Engine::load(&model("dsv4-tiny/model-f32.gguf"), &Default::default()).unwrap();
    let sq = q.new_seq().unwrap();
    let mut sd = d.new_seq().unwrap();
    let err = q.copy_seq(&sq, &mut sd).unwrap_err();
    assert!(err.to_string().contains("another model"), "{err}");
}

fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens: Some(n),
        sampler: SamplerConfig::greedy(),
        ..Default::default()
    }
}

/// Without a chat template: a prompt that agrees with the checkpoint (saved after 200 of
/// its 300 tokens) but not with what the sequence holds restores it, reports 200 cached
/// tokens, and samples what a fresh session samples.
#[test]
fn session_restores_its_checkpoint() {
    let mut e = Engine::load(&model("qwen35-tiny/model-f32.gguf"), &Default::default()).unwrap();
    let v = e.vocab_size();
    let p1 = ids(300, v, 4);
    let mut s = Session::with_checkpoint(&e).unwrap();
    let out = s.generate_at(&mut e, &p1, 200, &greedy(5), |_| {}).unwrap();
    assert_eq!(out.timings.n_cached, 0);
    assert_eq!(s.checkpoint(), Some(&p1[..200]));
    assert_eq!(s.tokens().len(), 300 + 4);
    // Diverges at token 250: the sequence (304 tokens) cannot be kept, the checkpoint can.
    let mut p2 = p1[..250].to_vec();
    p2.extend(ids(30, v, 5));
    assert_eq!(s.reusable(&p2), 200);
    let got = s.generate(&mut e, &p2, &greedy(8), |_| {}).unwrap();
    assert_eq!(got.timings.n_cached, 200);
    // The checkpoint moved to the end of this prompt.
    assert_eq!(s.checkpoint(), Some(&p2[..]));
    let mut fresh = Session::new(&e).unwrap();
    let want = fresh.generate(&mut e, &p2, &greedy(8), |_| {}).unwrap();
    assert_eq!(want.timings.n_cached, 0);
    assert_eq!(got.tokens, want.tokens);
    // A prompt agreeing with neither starts over; reset forgets the checkpoint too.
    let p3 = ids(20, v, 6);
    assert_eq!(s.reusable(&p3), 0);
    s.reset(&e).unwrap();
    assert_eq!(s.checkpoint(), Some(&[][..]));
    assert_eq!(s.reusable(&p2), 0);
}

/// Ctrl-C during a long prefill: the flag, set while the prompt's 8 pieces run, stops the
/// prefill between two pieces; the session holds exactly the pieces fed (a multiple of the
/// 256-token pass), and the same prompt then goes on from there and samples what a fresh
/// session samples.
#[test]
fn cancelled_prefill_stops_between_pieces() {
    let mut e = Engine::load(&model("qwen35-tiny/model-f32.gguf"), &Default::default()).unwrap();
    let v = e.vocab_size();
    let prompt = ids(8 * 256 - 10, v, 7);
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = GenerateOptions {
        cancel: Some(cancel.clone()),
        ..greedy(4)
    };
    let mut s = Session::new(&e).unwrap();
    let setter = {
        let c = cancel.clone();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(5));
            c.store(true, Ordering::SeqCst);
        })
    };
    let out = s.generate(&mut e, &prompt, &opts, |_| {}).unwrap();
    setter.join().unwrap();
    let fed = s.tokens().len();
    eprintln!("cancelled after {fed} of {} prompt tokens", prompt.len());
    assert!(out.finish.is_none() && out.tokens.is_empty());
    assert!(fed < prompt.len() && fed.is_multiple_of(256), "{fed}");
    assert_eq!(s.tokens(), &prompt[..fed]);
    cancel.store(false, Ordering::SeqCst);
    let rest = s.generate(&mut e, &prompt, &opts, |_| {}).unwrap();
    assert_eq!(rest.timings.n_cached, fed);
    let want = Session::new(&e)
        .unwrap()
        .generate(&mut e, &prompt, &opts, |_| {})
        .unwrap();
    assert_eq!(rest.tokens, want.tokens);
}

/// `lathe synth --preset demo` with Qwen3.6's vocabulary and Qwen3.5's template (from
/// ../shared, which keeps llama.cpp's template files), once per test binary.
fn qwen_chat_model() -> PathBuf {
    static MODEL: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    MODEL.get_or_init(make_qwen_chat_model).clone()
}

fn make_qwen_chat_model() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmpl = root.join("../shared/fixtures/tokenizer/chat/qwen35.jinja");
    assert!(
        tmpl.is_file(),
        "{} is absent: this test needs ../shared/fixtures (templates stay there; CI has it)",
        tmpl.display()
    );
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("checkpoint-qwen-chat.gguf");
    let st = std::process::Command::new(env!("CARGO_BIN_EXE_lathe"))
        .args(["synth", "--preset", "demo", "--tokenizer"])
        .arg(root.join("tests/fixtures/tokenizer/qwen36/tokenizer.json.gz"))
        .arg("--chat-template")
        .arg(&tmpl)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    out
}

/// Qwen3.6's template opens `<think>` in the generation prompt and drops reasoning from
/// history, so turn 2's rendering leaves what the sequence holds right after turn 1's
/// `<|im_start|>assistant\n`. The checkpoint sits where turn 1's conversation ended (the
/// rendering without generation prompt): turn 2 restores it and samples exactly what a
/// fresh prefill of turn 2's prompt samples.
#[test]
fn qwen_chat_second_turn_reuses_the_checkpoint() {
    let path = qwen_chat_model();
    let mut e = Engine::load(&path, &Default::default()).unwrap();
    let tok = e.tokenizer.take().unwrap();
    let chat = ChatPrompt::for_tokenizer(&tok).unwrap();
    assert!(!chat.fallback);
    let mut messages = vec![
        json!({"role": "system", "content": "You are terse."}),
        json!({"role": "user", "content": "Name a prime number."}),
    ];
    let (p1, c1) = chat.encode(&tok, &json!(messages)).unwrap();
    let head = tok
        .encode_with_bos(&chat.render(&json!(messages), false).unwrap(), true)
        .unwrap();
    assert_eq!((c1, &p1[..c1]), (head.len(), &head[..]));
    assert!(c1 < p1.len(), "the generation prompt adds tokens");
    e.tokenizer = Some(tok);
    let opts = GenerateOptions {
        ignore_eog: true,
        ..greedy(6)
    };
    let mut s = Session::with_checkpoint(&e).unwrap();
    let out1 = s.generate_at(&mut e, &p1, c1, &opts, |_| {}).unwrap();
    assert_eq!(out1.tokens.len(), 6);
    assert_eq!(s.checkpoint(), Some(&p1[..c1]));

    messages.push(json!({"role": "assistant", "content": out1.text}));
    messages.push(json!({"role": "user", "content": "And another?"}));
    let tok = e.tokenizer.take().unwrap();
    let (p2, c2) = chat.encode(&tok, &json!(messages)).unwrap();
    e.tokenizer = Some(tok);
    // The rewrite: what the sequence holds is not a prefix of turn 2's prompt...
    assert_eq!(reusable_prefix(s.tokens(), &p2), 0);
    assert!(c2 > c1);
    let out2 = s.generate_at(&mut e, &p2, c2, &opts, |_| {}).unwrap();
    // ...but the checkpoint is.
    assert_eq!(out2.timings.n_cached, c1);
    assert_eq!(s.checkpoint(), Some(&p2[..c2]));
    let want = Session::new(&e)
        .unwrap()
        .generate(&mut e, &p2, &opts, |_| {})
        .unwrap();
    assert_eq!(want.timings.n_cached, 0);
    assert_eq!(out2.tokens, want.tokens);
    assert_eq!(out2.text, want.text);
}

/// `lathe chat --stats` on the same model: turn 2's stats line reports the prompt tokens the
/// checkpoint gave (more than none, fewer than turn 1's prompt, which ends in the generation
/// prompt that turn 2's rendering rewrites).
#[test]
fn chat_command_reports_reused_tokens() {
    let path = qwen_chat_model();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lathe"))
        .args(["chat", "--stats", "--temp", "0", "-n", "4", "-m"])
        .arg(&path)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Name a prime number.\nAnd another?\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    // `[prompt P tokens (C cached) at ...`
    let stats: Vec<(usize, usize)> = err
        .lines()
        .filter_map(|l| l.strip_prefix("[prompt "))
        .map(|l| {
            let p = l.split(' ').next().unwrap().parse().unwrap();
            let c = l
                .split_once(" tokens (")
                .and_then(|(_, r)| r.split(' ').next()?.parse().ok())
                .unwrap_or(0);
            (p, c)
        })
        .collect();
    assert_eq!(stats.len(), 2, "{err}");
    assert_eq!(stats[0].1, 0, "{err}");
    assert!(stats[1].1 > 0 && stats[1].1 < stats[0].0, "{err}");
}

/// The KV pools of all sequences share one buffer per layer under the adapter's binding limit:
/// the positions each sequence can reach shrink in proportion to the sequences held, and a
/// model reports the bound (the server caps its context with it).
#[test]
fn kv_capacity_divides_among_sequences() {
    let load = |seqs: usize| {
        let opts = LoadOptions {
            max_seqs: seqs,
            ..Default::default()
        };
        Engine::load(&model("qwen35-tiny/model-f32.gguf"), &opts).unwrap()
    };
    let one = load(1).max_context().expect("Qwen3.5 KV pools are bounded");
    let eight = load(8).max_context().unwrap();
    assert!(one >= 8 * 256, "one sequence fits {one} positions");
    assert!(
        eight <= one / 8 && eight + 256 > one / 8,
        "8 sequences fit {eight} positions each, one fits {one}"
    );
}
