//! Speculative decoding in the server's engine thread: several requests at once, each
//! drafting on its own sequence (MTP block or draft model) and all checked in shared verify
//! passes. Greedy replies must be `run`'s (no speculation, one sequence alone) token for
//! token, for Qwen3.5 and DeepSeek-V4 files with an MTP block (`--preset demo --mtp`,
//! `--preset demo-deepseek4 --mtp`, written at test time) with `--draft 1..4`, and with a
//! draft model; a sampled reply at a fixed seed must be `run`'s at that seed (the server
//! samples each verify row as a decode step's and keeps a draft only when it is the token
//! drawn: the rejection rule of greedy drafts).

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lathe::engine::{ActivationsChoice, Engine, KvType, LoadOptions};
use lathe::generate::{generate, GenerateOptions};
use lathe::sample::SamplerConfig;
use lathe::server::scheduler::{self, Event, Job, SchedulerConfig};
use lathe::spec::{PassCosts, SpecMode, SpecOptions, SpecStats};
use lathe::tokenizer::Tokenizer;

/// Requests at once.
const SLOTS: usize = 3;

fn load_opts() -> LoadOptions {
    LoadOptions {
        kv_type: KvType::F32,
        // Per slot its sequence and checkpoint, as `lathe serve` asks.
        max_seqs: scheduler::SEQS_PER_SLOT * SLOTS,
        ctx: 256,
        ..Default::default()
    }
}

/// A synthetic file of `preset` with an MTP block (vocabulary 512), in a temp dir (one per
/// `tag`) the caller removes.
fn synth_mtp(preset: &str, tag: &str) -> (PathBuf, PathBuf) {
    use lathe::synth::{self, FileType, PlanOptions};
    let dir = std::env::temp_dir().join(format!(
        "lathe-spec-server-{preset}-{tag}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.gguf");
    let opts = PlanOptions {
        ftype: (preset == "demo").then_some(FileType::Q8_0),
        n_vocab: Some(512),
        mtp: true,
        ..Default::default()
    };
    let plan = synth::plan(&synth::preset(preset).unwrap(), &opts, None).unwrap();
    plan.write(&path, 1, None).unwrap();
    (dir, path)
}

/// Prompts of different lengths and reply budgets, so that the requests join and leave
/// the shared passes at different steps.
fn requests() -> Vec<(Vec<u32>, usize)> {
    vec![
        (vec![3, 141, 59, 265, 358, 97, 93, 238, 462, 64, 33, 83], 20),
        (vec![7, 9, 300, 12], 14),
        ((0..40).map(|i| (i * 37 + 11) % 500).collect(), 17),
    ]
}

/// `run`'s options: `n` tokens, no speculation.
fn run_opts(n: usize, sampler: &SamplerConfig) -> GenerateOptions {
    GenerateOptions {
        max_tokens: Some(n),
        sampler: sampler.clone(),
        ignore_eog: true,
        spec: SpecOptions {
            mode: SpecMode::Off,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// `run`'s reply: one sequence alone, no speculation.
fn run_reply(eng: &mut Engine, prompt: &[u32], n: usize, sampler: &SamplerConfig) -> Vec<u32> {
    generate(eng, prompt, &run_opts(n, sampler), |_| {})
        .unwrap()
        .tokens
}

/// Every request of [`requests`] submitted at once to an engine thread speculating with
/// `spec` (slots of `ctx` positions); per request its sampled ids and speculation counts.
fn serve(
    path: &Path,
    spec: SpecOptions,
    draft_model: Option<&Path>,
    sampler: &SamplerConfig,
    ctx: usize,
) -> Vec<(Vec<u32>, Option<SpecStats>)> {
    let waves = serve_waves(path, spec, None, draft_model, sampler, ctx, &[requests()]);
    waves[0].iter().map(|r| (r.0.clone(), r.1)).collect()
}

/// A request's sampled ids, speculation counts and the prompt tokens its slot held.
type Reply = (Vec<u32>, Option<SpecStats>, usize);

/// [`serve`] of several waves of requests on one engine thread, each wave submitted at once
/// after the last one finished; per request also the prompt tokens its slot held already.
/// `costs`: what `--spec auto` decides from (`None`: measured on the device).
fn serve_waves(
    path: &Path,
    spec: SpecOptions,
    costs: Option<PassCosts>,
    draft_model: Option<&Path>,
    sampler: &SamplerConfig,
    ctx: usize,
    waves: &[Vec<(Vec<u32>, usize)>],
) -> Vec<Vec<Reply>> {
    let cfg = SchedulerConfig {
        n_slots: SLOTS,
        queue: 8,
        prefill_chunk: 16,
        ctx,
        spec,
        draft_model: draft_model.map(|p| {
            let o = LoadOptions {
                max_seqs: SLOTS,
                ..load_opts()
            };
            (p.to_path_buf(), o)
        }),
        spec_costs: costs,
    };
    let tok_dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/deepseek-v4");
    let model = path.to_path_buf();
    let (sched, thread) = scheduler::start(
        cfg,
        move || {
            Ok((
                Engine::load(&model, &load_opts())?,
                Tokenizer::from_hf_dir(&tok_dir)?,
            ))
        },
        |r| r.expect("the model loads"),
    );
    let mut out = Vec::new();
    for wave in waves {
        let rxs: Vec<_> = wave
            .iter()
            .cloned()
            .enumerate()
            .map(|(i, (prompt, n))| {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let job = Job {
                    id: format!("r{i}"),
                    checkpoint: prompt.len(),
                    prompt,
                    max_tokens: n,
                    sampler: sampler.clone(),
                    stop: Vec::new(),
                    // The ids come back with the log-probabilities.
                    logprobs: Some(1),
                    logit_bias: Vec::new(),
                    ignore_eos: true,
                    constraint: None,
                    deadline: Instant::now() + Duration::from_secs(600),
                    events: tx,
                    siblings: Vec::new(),
                };
                sched.submit(job).expect("queued");
                rx
            })
            .collect();
        out.push(
            rxs.into_iter()
                .map(|mut rx| {
                    let (mut ids, mut cached) = (Vec::new(), 0);
                    while let Some(ev) = rx.blocking_recv() {
                        match ev {
                            Event::Delta { logprob, .. } => ids.push(logprob.expect("logprobs").id),
                            Event::Done { spec, .. } => return (ids, spec, cached),
                            Event::Error { message, .. } => panic!("{message}"),
                            Event::Started { n_cached } => cached = n_cached,
                        }
                    }
                    panic!("the engine thread hung up");
                })
                .collect::<Vec<_>>(),
        );
    }
    // The server's counts (/health) add the requests' up (none when none speculated).
    let total = sched.shared.spec.lock().unwrap().unwrap_or_default();
    let drafted: usize = out
        .iter()
        .flatten()
        .map(|o| o.1.map_or(0, |s| s.drafted))
        .sum();
    assert_eq!(total.drafted, drafted);
    drop(sched);
    thread.join().unwrap();
    out
}

fn mtp(k: usize) -> SpecOptions {
    SpecOptions {
        mode: SpecMode::Mtp,
        draft: k,
        ..Default::default()
    }
}

/// Greedy replies of concurrent speculating requests are `run`'s, for `--draft 1..4`.
fn greedy_matches_run(preset: &str) {
    let (dir, path) = synth_mtp(preset, "greedy");
    let greedy = SamplerConfig::greedy();
    let want: Vec<Vec<u32>> = {
        let mut eng = Engine::load(&path, &load_opts()).unwrap();
        requests()
            .iter()
            .map(|(p, n)| run_reply(&mut eng, p, *n, &greedy))
            .collect()
    };
    for k in 1..=4 {
        let got = serve(&path, mtp(k), None, &greedy, 256);
        for (i, ((ids, st), want)) in got.iter().zip(&want).enumerate() {
            assert_eq!(ids, want, "{preset}: request {i}, --draft {k}");
            let st = st.expect("the request speculated");
            assert!(
                st.verify_passes > 0 && st.drafted > 0,
                "{preset} {i} k {k}: {st:?}"
            );
            assert!(st.accepted <= st.drafted);
            eprintln!(
                "{preset} request {i} --draft {k}: acceptance {:.2}, {:.2} tokens per pass",
                st.acceptance(),
                st.tokens_per_forward()
            );
        }
    }
    // `--spec auto` decides from the pass costs and the acceptance (the prior: no request
    // has finished when the three start). Measured here (lavapipe) it may choose either
    // way; where verify rows cost almost nothing beside the pass (weight reads bound it)
    // every request speculates; where each row costs a decode step none does. The replies
    // are `run`'s whatever it chose.
    let auto = SpecOptions {
        mode: SpecMode::Auto,
        draft: 3,
        ..Default::default()
    };
    let cheap = PassCosts {
        pass: (1..=8).map(|r| 1e-3 * (1.0 + 0.01 * r as f64)).collect(),
        draft: 1e-5,
    };
    let dear = PassCosts {
        pass: (1..=8).map(|r| 1e-3 * r as f64).collect(),
        draft: 5e-4,
    };
    for (costs, speculating) in [(None, None), (Some(cheap), Some(3)), (Some(dear), Some(0))] {
        let waves = serve_waves(
            &path,
            auto.clone(),
            costs,
            None,
            &greedy,
            256,
            &[requests()],
        );
        for (i, ((ids, _, _), want)) in waves[0].iter().zip(&want).enumerate() {
            assert_eq!(ids, want, "{preset}: request {i}, --spec auto");
        }
        let n = waves[0].iter().filter(|g| g.1.is_some()).count();
        if let Some(s) = speculating {
            assert_eq!(n, s, "{preset}: requests speculating under --spec auto");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn server_greedy_speculation_matches_run_qwen35() {
    greedy_matches_run("demo");
}

#[test]
fn server_greedy_speculation_matches_run_deepseek4() {
    greedy_matches_run("demo-deepseek4");
}

/// The target as its own draft model in the server: every draft is accepted and the
/// replies are `run`'s; sampled at a fixed seed with MTP drafts, the replies are `run`'s at
/// that seed.
#[test]
fn server_draft_model_and_sampled_speculation() {
    let (dir, path) = synth_mtp("demo", "draft");
    let greedy = SamplerConfig::greedy();
    let sampled = SamplerConfig {
        temperature: 1.0,
        seed: 11,
        ..Default::default()
    };
    let (want, want_sampled): (Vec<Vec<u32>>, Vec<Vec<u32>>) = {
        let mut eng = Engine::load(&path, &load_opts()).unwrap();
        requests()
            .iter()
            .map(|(p, n)| {
                (
                    run_reply(&mut eng, p, *n, &greedy),
                    run_reply(&mut eng, p, *n, &sampled),
                )
            })
            .unzip()
    };
    let draft = SpecOptions {
        mode: SpecMode::Draft,
        draft: 3,
        ..Default::default()
    };
    // Follow-ups (prompt, reply, three more tokens) reuse their slot's tokens: the draft
    // model's fresh sequence reads them first. `run`'s: a session that keeps its sequence.
    let follow: Vec<(Vec<u32>, usize)> = requests()
        .iter()
        .zip(&want)
        .map(|((p, _), r)| ([&p[..], r, &[5, 6, 7]].concat(), 8))
        .collect();
    let want_follow: Vec<Vec<u32>> = {
        let mut eng = Engine::load(&path, &load_opts()).unwrap();
        requests()
            .iter()
            .zip(&follow)
            .map(|((p, n), (q, m))| {
                let mut s = lathe::generate::Session::new(&eng).unwrap();
                s.generate(&mut eng, p, &run_opts(*n, &greedy), |_| {})
                    .unwrap();
                s.generate(&mut eng, q, &run_opts(*m, &greedy), |_| {})
                    .unwrap()
                    .tokens
            })
            .collect()
    };
    for spec in [draft.clone(), mtp(3)] {
        let dm = (spec.mode == SpecMode::Draft).then_some(path.as_path());
        let waves = [requests(), follow.clone()];
        let got = serve_waves(&path, spec.clone(), None, dm, &greedy, 256, &waves);
        for (i, (ids, st, _)) in got[0].iter().enumerate() {
            assert_eq!(ids, &want[i], "request {i}, {:?}", spec.mode);
            let st = st.expect("the request speculated");
            assert!(st.drafted > 0);
            if spec.mode == SpecMode::Draft {
                assert_eq!(
                    st.accepted, st.drafted,
                    "request {i}: the target drafts itself"
                );
            }
        }
        for (i, (ids, _, cached)) in got[1].iter().enumerate() {
            assert!(
                *cached > requests()[i].0.len(),
                "follow-up {i} reuses its slot"
            );
            assert_eq!(ids, &want_follow[i], "follow-up {i}, {:?}", spec.mode);
        }
    }
    let got = serve(&path, mtp(3), None, &sampled, 256);
    for (i, ((ids, st), want)) in got.iter().zip(&want_sampled).enumerate() {
        assert_eq!(ids, want, "request {i} sampled at seed 11");
        assert!(st.expect("the request speculated").verify_passes > 0);
    }
    // Slots of 48 positions: the 40-token prompt's reply stops at the context length (its
    // drafts cut to fit), a prefix of `run`'s.
    let got = serve(&path, mtp(4), None, &greedy, 48);
    for (i, ((ids, _), want)) in got.iter().zip(&want).enumerate() {
        let (p, _) = &requests()[i];
        assert!(
            p.len() + ids.len() <= 49,
            "request {i}: {} tokens",
            ids.len()
        );
        assert_eq!(ids[..], want[..ids.len()], "request {i} at --ctx 48");
    }
    assert!(got[2].0.len() < want[2].len());
    std::fs::remove_dir_all(&dir).ok();
}

fn bits(l: &[lathe::engine::Logits]) -> Vec<Vec<u32>> {
    l.iter()
        .map(|l| match l {
            lathe::engine::Logits::Full(v) => v.iter().map(|x| x.to_bits()).collect(),
            lathe::engine::Logits::Top(_) => panic!("full logits expected"),
        })
        .collect()
}

/// What the server asks of the model for each sequence, with `others` sequences taking
/// the same steps in between (their passes overwrite every shared row buffer): the MTP
/// logits over the prompt's rows, a verify pass batched with the others', the MTP logits
/// over its rows, a rollback batched with the others' and the MTP logits over the last kept
/// row. Per step the bits.
fn interleaved(eng: &mut Engine, prompts: &[Vec<u32>]) -> Vec<Vec<Vec<Vec<u32>>>> {
    use lathe::engine::Want;
    use lathe::models::spec::Hidden;
    let mut seqs: Vec<_> = prompts.iter().map(|_| eng.new_seq().unwrap()).collect();
    let s = eng.model.speculate().expect("the model speculates");
    let mut out: Vec<Vec<Vec<Vec<u32>>>> = prompts.iter().map(|_| Vec::new()).collect();
    for (seq, p) in seqs.iter_mut().zip(prompts) {
        s.feed(seq, p, Want::None).unwrap();
    }
    let next = |p: &[u32], j: u32| (p[0] * 7 + j * 13) % 500;
    for ((seq, p), o) in seqs.iter_mut().zip(prompts).zip(&mut out) {
        let mut t = p[1..].to_vec();
        t.push(next(p, 0));
        o.push(bits(&s.mtp(seq, Hidden::Trunk, &t, Want::All).unwrap()));
    }
    let fed: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| (0..4).map(|j| next(p, j)).collect())
        .collect();
    let rows = {
        let mut items: Vec<_> = seqs
            .iter_mut()
            .zip(&fed)
            .map(|(s, f)| (s, f.as_slice(), Want::All))
            .collect();
        s.verify_batch(&mut items).unwrap()
    };
    for (((seq, f), r), o) in seqs.iter_mut().zip(&fed).zip(rows).zip(&mut out) {
        o.push(bits(&r));
        let mut t = f[1..].to_vec();
        t.push(next(f, 9));
        o.push(bits(&s.mtp(seq, Hidden::Trunk, &t, Want::All).unwrap()));
    }
    // Rolled back together, keeping 1 + len % 3 tokens (several keep one: single rows).
    let keep = |p: &[u32]| 1 + p.len() % 3;
    {
        let mut items: Vec<_> = seqs
            .iter_mut()
            .zip(&fed)
            .zip(prompts)
            .map(|((s, f), p)| (s, &f[..keep(p)]))
            .collect();
        s.rollback_batch(&mut items).unwrap();
    }
    for (((seq, f), p), o) in seqs.iter_mut().zip(&fed).zip(prompts).zip(&mut out) {
        let t = [f[keep(p)]];
        o.push(bits(&s.mtp(seq, Hidden::Trunk, &t, Want::All).unwrap()));
    }
    out
}

/// Each sequence's MTP rows read its own trunk rows and its verify rows have its lone run's
/// bits while other sequences' passes run in between (per-sequence trunk storage,
/// rollback state and batched verify).
fn sequences_keep_their_own_trunks(preset: &str, activations: ActivationsChoice) {
    let (dir, path) = synth_mtp(preset, &format!("trunks-{activations:?}"));
    let opts = LoadOptions {
        activations,
        ..load_opts()
    };
    let mut eng = Engine::load(&path, &opts).unwrap();
    let prompts: Vec<Vec<u32>> = vec![
        vec![3, 141, 59, 265, 358, 97],
        vec![7, 9, 300, 12, 44],
        vec![100, 200, 300],
        vec![17, 18, 19, 20, 21, 22],
    ];
    let together = interleaved(&mut eng, &prompts);
    for (i, p) in prompts.iter().enumerate() {
        let alone = interleaved(&mut eng, std::slice::from_ref(p));
        for (step, (a, b)) in alone[0].iter().zip(&together[i]).enumerate() {
            assert!(
                a == b,
                "{preset} {activations:?}: sequence {i}, step {step}: bits differ from its lone run"
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn sequences_keep_their_own_trunks_qwen35() {
    sequences_keep_their_own_trunks("demo", ActivationsChoice::F32);
}

#[test]
fn sequences_keep_their_own_trunks_deepseek4() {
    sequences_keep_their_own_trunks("demo-deepseek4", ActivationsChoice::F32);
}

/// `--activations int8`: the batched rows' products quantize x as their lone runs do
/// (the demo file is Q8_0, whose products take int8 x).
#[test]
fn sequences_keep_their_own_trunks_qwen35_int8() {
    sequences_keep_their_own_trunks("demo", ActivationsChoice::Int8);
}
