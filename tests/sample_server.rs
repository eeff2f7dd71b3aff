//! The server's engine thread samples from the GPU's best logits (`Want::Top`) when a request
//! allows it, and from full logits when `logit_bias` must change them first. A zero bias
//! changes nothing, so the same request with and without one must stream the same tokens
//! with the same log-probabilities (to f32 rounding of the log-sum-exp): run both at once,
//! so one batched forward serves a Top item and a full-logits item.

mod common;

use std::time::{Duration, Instant};

use lathe::engine::{Engine, LoadOptions};
use lathe::sample::SamplerConfig;
use lathe::server::scheduler::{self, Event, Job, SchedulerConfig, TokenLogprob};
use lathe::tokenizer::Tokenizer;

fn job(
    id: &str,
    sampler: SamplerConfig,
    bias: Vec<(u32, f32)>,
) -> (Job, tokio::sync::mpsc::UnboundedReceiver<Event>) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let prompt = vec![10, 20, 30, 40, 50];
    let job = Job {
        id: id.into(),
        checkpoint: prompt.len(),
        prompt,
        max_tokens: 10,
        sampler,
        stop: Vec::new(),
        logprobs: Some(3),
        logit_bias: bias,
        ignore_eos: true,
        constraint: None,
        deadline: Instant::now() + Duration::from_secs(300),
        events: tx,
        siblings: Vec::new(),
    };
    (job, rx)
}

fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Vec<TokenLogprob> {
    let mut out = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Delta { logprob, .. } => out.push(logprob.expect("logprobs were asked for")),
            Event::Done { .. } => return out,
            Event::Error { message, .. } => panic!("{message}"),
            _ => {}
        }
    }
    panic!("the engine thread hung up");
}

#[test]
fn top_path_streams_what_full_logits_stream() {
    let model = common::fixtures().join("qwen35-tiny/model-f32.gguf");
    let tok_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer/deepseek-v4");
    let cfg = SchedulerConfig {
        n_slots: 2,
        queue: 8,
        prefill_chunk: 64,
        ctx: 256,
        spec: lathe::spec::SpecOptions {
            mode: lathe::spec::SpecMode::Off,
            ..Default::default()
        },
        draft_model: None,
        spec_costs: None,
    };
    let (sched, _thread) = scheduler::start(
        cfg,
        move || {
            let e = Engine::load(&model, &LoadOptions::default())?;
            Ok((e, Tokenizer::from_hf_dir(&tok_dir)?))
        },
        |r| r.expect("the model loads"),
    );
    let seeded = SamplerConfig {
        temperature: 1.0,
        top_k: 20,
        top_p: 0.9,
        min_p: 0.0,
        seed: 5,
        ..SamplerConfig::default()
    };
    for sampler in [SamplerConfig::greedy(), seeded] {
        // Token 0 biased by 0: full logits, the host path.
        let (a, ra) = job("top", sampler.clone(), Vec::new());
        let (b, rb) = job("full", sampler.clone(), vec![(0, 0.0)]);
        sched.submit(a).expect("queued");
        sched.submit(b).expect("queued");
        let (top, full) = (collect(ra), collect(rb));
        assert_eq!(top.len(), 10);
        assert_eq!(full.len(), 10);
        // Log-probabilities are logit - lse: the GPU sums exp over the vocabulary in f32, the
        // host in f64, and the two requests may share a pass or not (batched attention over
        // ranges vs alone): they agree to ~1e-5 of values near -5, not bit for bit.
        const LP_TOL: f32 = 1e-4;
        for (i, (t, f)) in top.iter().zip(&full).enumerate() {
            let what = format!("{sampler:?} token {i}");
            assert_eq!(t.id, f.id, "{what}: sampled ids");
            assert!(
                (t.logprob - f.logprob).abs() < LP_TOL,
                "{what}: {t:?} vs {f:?}"
            );
            assert!(t.logprob.is_finite() && t.logprob <= 0.0, "{what}: {t:?}");
            assert_eq!(t.top.len(), 3, "{what}");
            for (x, y) in t.top.iter().zip(&f.top) {
                assert_eq!(x.0, y.0, "{what}: top ids");
                assert!((x.1 - y.1).abs() < LP_TOL, "{what}: {t:?} vs {f:?}");
            }
        }
    }
}

/// Structured output in the engine thread: a request under a grammar beside one without, in
/// one batched step. The constrained one's text follows its grammar; its neighbour streams
/// exactly what it streams alone (the mask is per sequence).
#[test]
fn a_constraint_shapes_its_own_sequence_only() {
    use lathe::server::constrain::{Constrainer, Constraint};
    let model = common::fixtures().join("qwen35-tiny/model-f32.gguf");
    let tok_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer/deepseek-v4");
    let tok = Tokenizer::from_hf_dir(&tok_dir).unwrap();
    let cfg = SchedulerConfig {
        n_slots: 2,
        queue: 8,
        prefill_chunk: 64,
        ctx: 256,
        spec: lathe::spec::SpecOptions {
            mode: lathe::spec::SpecMode::Off,
            ..Default::default()
        },
        draft_model: None,
        spec_costs: None,
    };
    let (sched, _thread) = scheduler::start(
        cfg,
        move || {
            let e = Engine::load(&model, &LoadOptions::default())?;
            Ok((e, Tokenizer::from_hf_dir(&tok_dir)?))
        },
        |r| r.expect("the model loads"),
    );
    let text = |rx: tokio::sync::mpsc::UnboundedReceiver<Event>| {
        let ids: Vec<u32> = collect(rx).iter().map(|t| t.id).collect();
        (ids.clone(), tok.decode(&ids))
    };
    let (alone, ra) = job("alone", SamplerConfig::greedy(), Vec::new());
    sched.submit(alone).expect("queued");
    let (alone, _) = text(ra);
    // The model's vocabulary: the fixture's first 512 ids.
    let vocab = sched.shared.loaded.get().expect("loaded").vocab;
    let c = Constrainer::new(&tok, vocab).unwrap();
    let grammar = Constraint::Lark("start: \"[\" /[0-9]{6}/ \"]\"".into());
    let seeded = SamplerConfig {
        temperature: 1.0,
        seed: 7,
        ..SamplerConfig::default()
    };
    let (mut constrained, rc) = job("constrained", seeded, Vec::new());
    constrained.constraint = Some(c.matcher(&grammar, "").unwrap());
    let (free, rf) = job("free", SamplerConfig::greedy(), Vec::new());
    sched.submit(constrained).expect("queued");
    sched.submit(free).expect("queued");
    let (_, shaped) = text(rc);
    let (beside, _) = text(rf);
    assert_eq!(beside, alone, "the unconstrained neighbour is unchanged");
    // The grammar is done after `[dddddd]`: the request ends there, before max_tokens.
    let digits = shaped.strip_prefix('[').and_then(|s| s.strip_suffix(']'));
    assert!(
        digits.is_some_and(|d| d.len() == 6 && d.bytes().all(|b| b.is_ascii_digit())),
        "{shaped:?}"
    );
}

/// The mask's cost per token on DeepSeek-V4's full vocabulary (129k ids), walking a
/// schema-valid document token by token: every token of it is allowed where it stands, and
/// a token that breaks the schema is not. Prints µs per token (`--nocapture`).
#[test]
fn mask_allows_valid_json_and_its_cost_per_token() {
    use lathe::server::constrain::{mask, Constrainer, Constraint};
    let tok_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer/deepseek-v4");
    let tok = Tokenizer::from_hf_dir(&tok_dir).unwrap();
    let vocab = tok.vocab_size();
    let t0 = Instant::now();
    let c = Constrainer::new(&tok, vocab).unwrap();
    let build = t0.elapsed();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "kind": {"enum": ["cat", "dog"]},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}},
            "at": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
        },
        "required": ["name", "kind", "tags", "at"],
        "additionalProperties": false,
        "$defs": {"tag": {"type": "string", "maxLength": 12}}
    });
    let doc = r#"{"name":"Tiberius the Third","kind":"cat","tags":["old","grumpy","orange"],"at":{"x":-1234}}"#;
    let ids = tok.encode(doc, false).unwrap();
    let mut m = c
        .matcher(
            &Constraint::Json {
                schema,
                strict: true,
            },
            "",
        )
        .unwrap();
    let allowed = |mask: &[u32], id: u32| mask[id as usize / 32] >> (id % 32) & 1 == 1;
    let t0 = Instant::now();
    for (i, &id) in ids.iter().enumerate() {
        let mk = mask(&mut m).unwrap();
        assert!(
            allowed(&mk, id),
            "token {i} ({id}) of the document is masked out"
        );
        if i == 0 {
            let bad = tok.encode("x", false).unwrap()[0];
            assert!(!allowed(&mk, bad), "an object cannot start with `x`");
        }
        m.consume_token(id).unwrap();
    }
    let per = t0.elapsed().as_secs_f64() * 1e6 / ids.len() as f64;
    assert!(m.is_stopped(), "the document completes the schema");
    eprintln!(
        "mask: {per:.0} µs/token over {} tokens, vocabulary {vocab} (trie built in {:.0} ms)",
        ids.len(),
        build.as_secs_f64() * 1e3
    );
}
