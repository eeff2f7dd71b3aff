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
        deadline: Instant::now() + Duration::from_secs(300),
        events: tx,
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
