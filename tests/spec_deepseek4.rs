//! DeepSeek-V4 on the dsv4-tiny fixture (release layout, f32: window 8, ratios 0/4/128/4
//! with an indexer choosing 2 entries) and `--preset demo-deepseek4` files (Q8_0, window
//! 32): sequences batched in one pass against each sequence run alone; the MTP block's
//! logits against an independent numpy reference (`mtp_ref_dsv4.py`); verify rows bit for
//! bit against one-token decode steps; generation with speculation (MTP drafts 1..4, a
//! draft model) against generation without it, greedy and sampled at fixed seeds.
//!
//! The MTP weights of the tiny model are random, written at test time into a copy of the
//! fixture (the release's `mtp.0.*` names and shapes; f32 experts).
//!
//! Batching tolerance: a batched pass runs its products over all rows (the tiled matmul
//! above `matvec::MAX_TOKENS` rows, matvec below), a lone decode step over one row, so
//! values agree to f32 rounding, not bits: max |Δ| ≤ 1e-3 · max(1, max |logit|) per row.

mod common;

use lathe::engine::{Engine, KvType, LoadOptions, Logits, Want};
use lathe::generate::{generate, GenerateOptions};
use lathe::models::spec::Hidden;
use lathe::sample::SamplerConfig;
use lathe::spec::{SpecMode, SpecOptions};
use std::path::{Path, PathBuf};

fn load(path: &Path) -> Engine {
    let opts = LoadOptions {
        kv_type: KvType::F32,
        max_seqs: 4,
        ctx: 256,
        ..Default::default()
    };
    Engine::load(path, &opts).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn tiny() -> PathBuf {
    common::fixtures().join("dsv4-tiny").join("upstream")
}

/// A `--preset demo-deepseek4` file (vocabulary 512) in a temp dir; the dir is the caller's
/// to remove.
fn demo(tag: &str, mtp: bool) -> (PathBuf, PathBuf) {
    use lathe::synth::{self, PlanOptions};
    let dir = std::env::temp_dir().join(format!("lathe-dsv4-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("demo-dsv4.gguf");
    let opts = PlanOptions {
        n_vocab: Some(512),
        mtp,
        ..Default::default()
    };
    let plan = synth::plan(&synth::preset("demo-deepseek4").unwrap(), &opts, None).unwrap();
    plan.write(&path, 1, None).unwrap();
    (dir, path)
}

/// Deterministic token ids below `v`.
fn toks(seed: u32, n: usize, v: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed.wrapping_mul(2654435761).wrapping_add(i * 97 + 13)) % v)
        .collect()
}

fn close(label: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{label}: lengths");
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    let max = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        max <= 1e-3 * scale,
        "{label}: max |Δ| {max:.3e} (logits up to {scale:.2})"
    );
}

/// Three sequences of different lengths: prefilled together (one of them only in part),
/// then passes where that one finishes its prompt while the others decode, then decode
/// steps of all three; every logits row against the sequence run alone.
fn batched_matches_lone(path: &Path) {
    let mut eng = load(path);
    let v = eng.vocab_size() as u32;
    let prompts = [toks(1, 5, v), toks(2, 11, v), toks(3, 19, v)];
    let steps = 4;
    let next = |i: usize, s: usize| (i as u32 * 31 + s as u32 * 7 + 3) % v;
    // Alone: the prompt, then `steps` decode steps, each step's logits.
    let mut lone: Vec<Vec<Vec<f32>>> = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut seq = eng.new_seq().unwrap();
        let mut rows = vec![eng.forward(&mut seq, p, false).unwrap()];
        for s in 0..steps {
            rows.push(eng.forward(&mut seq, &[next(i, s)], false).unwrap());
        }
        lone.push(rows);
    }
    // Batched: sequence 2 prefills 12 tokens with the others, then its last 7 while the
    // others take their first decode step.
    let mut seqs: Vec<_> = (0..3).map(|_| eng.new_seq().unwrap()).collect();
    let (a, rest) = seqs.split_at_mut(1);
    let (b, c) = rest.split_at_mut(1);
    let (s0, s1, s2) = (&mut a[0], &mut b[0], &mut c[0]);
    let out = eng
        .forward_batch(&mut [
            (&mut *s0, &prompts[0][..], Want::Last),
            (&mut *s1, &prompts[1][..], Want::Last),
            (&mut *s2, &prompts[2][..12], Want::None),
        ])
        .unwrap();
    close("seq 0 prompt", &out[0], &lone[0][0]);
    close("seq 1 prompt", &out[1], &lone[1][0]);
    assert!(out[2].is_empty());
    let (t0, t1) = ([next(0, 0)], [next(1, 0)]);
    let out = eng
        .forward_batch(&mut [
            (&mut *s0, &t0[..], Want::Last),
            (&mut *s1, &t1[..], Want::Last),
            (&mut *s2, &prompts[2][12..], Want::Last),
        ])
        .unwrap();
    close("seq 0 step 0 beside a prefill", &out[0], &lone[0][1]);
    close("seq 1 step 0 beside a prefill", &out[1], &lone[1][1]);
    close("seq 2 prompt in two chunks", &out[2], &lone[2][0]);
    for s in 0..steps {
        let (t0, t1, t2) = ([next(0, s + 1)], [next(1, s + 1)], [next(2, s)]);
        let mut items = vec![(&mut *s2, &t2[..], Want::Last)];
        // The first two run one step ahead; their last step is left out.
        if s + 1 < steps {
            items.push((&mut *s0, &t0[..], Want::Last));
            items.push((&mut *s1, &t1[..], Want::Last));
        }
        let out = eng.forward_batch(&mut items).unwrap();
        close(&format!("seq 2 step {s}"), &out[0], &lone[2][s + 1]);
        if s + 1 < steps {
            close(&format!("seq 0 step {}", s + 1), &out[1], &lone[0][s + 2]);
            close(&format!("seq 1 step {}", s + 1), &out[2], &lone[1][s + 2]);
        }
    }
    assert_eq!(s0.pos(), 5 + steps);
    assert_eq!(s2.pos(), 19 + steps);
}

#[test]
fn batched_sequences_match_lone_runs_tiny() {
    batched_matches_lone(&tiny());
}

#[test]
fn batched_sequences_match_lone_runs_demo() {
    let (dir, path) = demo("batch", false);
    batched_matches_lone(&path);
    std::fs::remove_dir_all(&dir).ok();
}

/// Deterministic noise (xorshift64*), roughly normal (sum of four uniforms, unit variance).
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (r >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        ((0..4).map(|_| self.uniform()).sum::<f32>() - 2.0) * 3f32.sqrt()
    }
}

/// A copy of dsv4-tiny's release checkpoint with an MTP block (`mtp.0.*`): the tensors of
/// its window-only layer 0 (score-routed: a gate bias instead of the hash table; f32
/// experts), plus `e_proj`, `h_proj`, `enorm`, `hnorm`, `norm` and `hc_head_*`.
fn tiny_mtp(tag: &str) -> PathBuf {
    let src = tiny();
    let dir = std::env::temp_dir().join(format!("lathe-dsv4-mtp-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    let u = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let (e, hc, ne, f) = (
        u("hidden_size"),
        u("hc_mult"),
        u("n_routed_experts"),
        u("moe_intermediate_size"),
    );
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut data = bytes[8 + n..].to_vec();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut tensors: Vec<(String, Vec<usize>)> = header
        .iter()
        .filter_map(|(k, v)| {
            let rest = k.strip_prefix("layers.0.")?;
            if rest.starts_with("ffn.experts.") || rest.contains("tid2eid") || v["dtype"] != "F32" {
                return None;
            }
            let shape = v["shape"].as_array()?.iter();
            Some((
                rest.to_string(),
                shape.map(|d| d.as_u64().unwrap() as usize).collect(),
            ))
        })
        .collect();
    for x in 0..ne {
        for (w, shape) in [("w1", [f, e]), ("w2", [e, f]), ("w3", [f, e])] {
            tensors.push((format!("ffn.experts.{x}.{w}.weight"), shape.to_vec()));
        }
    }
    tensors.push(("ffn.gate.bias".into(), vec![ne]));
    tensors.push(("e_proj.weight".into(), vec![e, e]));
    tensors.push(("h_proj.weight".into(), vec![e, e]));
    for norm in ["enorm.weight", "hnorm.weight", "norm.weight"] {
        tensors.push((norm.into(), vec![e]));
    }
    tensors.push(("hc_head_fn".into(), vec![hc, hc * e]));
    tensors.push(("hc_head_base".into(), vec![hc]));
    tensors.push(("hc_head_scale".into(), vec![1]));
    tensors.sort();
    for (rest, shape) in tensors {
        let len: usize = shape.iter().product();
        let fan = *shape.last().unwrap();
        let vals: Vec<f32> = (0..len)
            .map(|_| match shape.len() {
                1 if rest.ends_with("norm.weight") => 1.0 + 0.1 * rng.normal(),
                1 => 0.3 * rng.normal(),
                _ => rng.normal() / (fan as f32).sqrt(),
            })
            .collect();
        let lo = data.len();
        data.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
        header.insert(
            format!("mtp.0.{rest}"),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [lo, data.len()]}),
        );
    }
    let mut head = serde_json::to_vec(&header).unwrap();
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let mut out = (head.len() as u64).to_le_bytes().to_vec();
    out.extend(head);
    out.extend(data);
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
    dir
}

fn prompt() -> Vec<u32> {
    vec![3, 141, 59, 265, 358, 97, 93, 238, 462, 64, 33, 83]
}

fn full(l: &Logits) -> &[f32] {
    match l {
        Logits::Full(v) => v,
        Logits::Top(_) => panic!("full logits expected"),
    }
}

/// `python3 tests/mtp_ref_dsv4.py` on the GPU block's inputs: its logits `[n, vocab]`.
fn reference(dir: &Path, hidden: &[f32], tokens: &[u32]) -> Vec<f32> {
    let n = tokens.len();
    let h = dir.join("hidden.npy");
    let t = dir.join("tokens.npy");
    let o = dir.join("ref.npy");
    lathe::npy::write_f32(&h, &[n, hidden.len() / n], hidden).unwrap();
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    lathe::npy::write_i32(&t, &[n], &ids).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mtp_ref_dsv4.py");
    let st = std::process::Command::new("python3")
        .arg(&script)
        .args([dir, &h, &t])
        .arg("0")
        .arg(&o)
        .status()
        .expect("python3 runs (with numpy: the MTP reference needs it)");
    assert!(st.success(), "mtp_ref_dsv4.py failed");
    lathe::npy::read_f32(&o).unwrap().data
}

fn check_ref(label: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{label}: lengths");
    let mut max = 0f32;
    let mut sq = 0f64;
    for (a, b) in got.iter().zip(want) {
        max = max.max((a - b).abs());
        sq += ((a - b) as f64).powi(2);
    }
    let rms = (sq / got.len() as f64).sqrt();
    let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max);
    eprintln!("{label}: rms {rms:.2e}, max {max:.2e} (logits up to {scale:.2})");
    assert!(
        rms < 1e-4 && max < 1e-3 * scale.max(1.0),
        "{label}: rms {rms}, max {max}"
    );
}

/// The GPU MTP block over the prompt's trunk rows, then one chained row, against the
/// numpy reference; the drafts of one call are the chained passes' picks.
#[test]
fn mtp_block_matches_numpy_reference() {
    let dir = tiny_mtp("ref");
    let mut eng = load(&dir);
    let v = eng.vocab_size();
    let p = prompt();
    let mut seq = eng.new_seq().unwrap();
    let s = eng.model.speculate().expect("DeepSeek-V4 speculates");
    assert!(s.has_mtp(), "the MTP block loaded");
    s.feed(&mut seq, &p, Want::None).unwrap();
    let mut next = p[1..].to_vec();
    next.push(7);
    let rows = s.mtp(&seq, Hidden::Trunk, &next, Want::All).unwrap();
    assert_eq!(rows.len(), p.len());
    let got: Vec<f32> = rows.iter().flat_map(|r| full(r).iter().copied()).collect();
    let hidden = s.mtp_hidden(p.len()).unwrap();
    assert_eq!(hidden.len(), p.len() * 4 * 64, "[rows, hc·n_embd]");
    let want = reference(&dir, &hidden, &next);
    check_ref("dsv4-tiny MTP rows", &got, &want);
    // A chained row reads the last row's output copies (position n).
    let chain = s.mtp(&seq, Hidden::Chain, &[11], Want::All).unwrap();
    let mut hidden2 = hidden.clone();
    hidden2.extend(s.mtp_hidden(1).unwrap());
    let mut next2 = next.clone();
    next2.push(11);
    let want2 = reference(&dir, &hidden2, &next2);
    check_ref(
        "dsv4-tiny chained MTP row",
        full(&chain[0]),
        &want2[p.len() * v..],
    );
    // The drafts of one call are the chained passes' picks.
    let g = Want::Top { k: 1, lse: false };
    let pick = |l: Vec<Logits>| match &l[0] {
        Logits::Top(t) => t.cands[0].0,
        _ => panic!("top"),
    };
    let mut seq2 = eng.new_seq().unwrap();
    let s = eng.model.speculate().unwrap();
    s.feed(&mut seq2, &p, Want::None).unwrap();
    let mut d = vec![pick(s.mtp(&seq2, Hidden::Trunk, &next, g).unwrap())];
    for _ in 0..3 {
        let last = *d.last().unwrap();
        d.push(pick(s.mtp(&seq2, Hidden::Chain, &[last], g).unwrap()));
    }
    s.feed(&mut seq, &[5], Want::None).unwrap();
    let mut seq3 = eng.new_seq().unwrap();
    let s = eng.model.speculate().unwrap();
    s.feed(&mut seq3, &p, Want::None).unwrap();
    assert_eq!(
        s.mtp_drafts(&seq3, &next, 4).unwrap(),
        d,
        "drafts in one call"
    );
    // A trimmed draft head picks among the first 64 tokens: the best of the last row's.
    let last = full(&rows[p.len() - 1]);
    let mut seq4 = eng.new_seq().unwrap();
    let s = eng.model.speculate().unwrap();
    s.set_draft_vocab(Some(64)).unwrap();
    s.feed(&mut seq4, &p, Want::None).unwrap();
    let trimmed = s.mtp_drafts(&seq4, &next, 2).unwrap();
    assert_eq!(trimmed[0], argmax(&last[..64]), "--draft-vocab 64");
    assert!(trimmed[1] < 64);
    s.set_draft_vocab(None).unwrap();
    drop((seq, seq2, seq3, seq4, eng));
    std::fs::remove_dir_all(&dir).ok();
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in l.iter().enumerate() {
        if x > l[best] {
            best = i;
        }
    }
    best as u32
}

/// Verify rows give the bits of one-token decode steps: all drafts right, then a wrong
/// draft after two right ones (rollback), then decode goes on with the bits it would have
/// had.
fn verify_has_decode_bits(path: &Path) {
    let mut eng = load(path);
    let p = prompt();
    let mut seq = eng.new_seq().unwrap();
    let mut l = eng.forward(&mut seq, &p, false).unwrap();
    let (mut rows, mut toks) = (Vec::new(), Vec::new());
    for _ in 0..12 {
        let t = argmax(&l);
        toks.push(t);
        rows.push(l);
        l = eng.forward(&mut seq, &[t], false).unwrap();
    }
    rows.push(l);
    let wrong = (toks[7] + 1) % eng.vocab_size() as u32;
    let mut seq = eng.new_seq().unwrap();
    eng.forward(&mut seq, &p, false).unwrap();
    let s = eng.model.speculate().unwrap();
    assert_eq!(s.max_verify(), 8);
    let got = s.verify(&mut seq, &toks[..5], Want::All).unwrap();
    for (j, r) in got.iter().enumerate() {
        assert_eq!(bits(full(r)), bits(&rows[j + 1]), "verify row {j}");
    }
    let fed2 = [toks[5], toks[6], toks[7], wrong];
    let got = s
        .verify(&mut seq, &fed2, Want::Top { k: 3, lse: true })
        .unwrap();
    assert_eq!(got.len(), 4);
    for (j, r) in got.iter().take(3).enumerate() {
        let Logits::Top(t) = r else {
            panic!("top rows")
        };
        assert_eq!(
            t.cands[0].0,
            toks[6 + j],
            "verify row {j} picks decode's token"
        );
        assert_eq!(
            t.cands[0].1.to_bits(),
            rows[6 + j][t.cands[0].0 as usize].to_bits()
        );
    }
    s.rollback(&mut seq, &fed2[..3]).unwrap();
    assert_eq!(seq.pos(), p.len() + 8);
    for (j, &t) in toks[8..11].iter().enumerate() {
        let l = eng.forward(&mut seq, &[t], false).unwrap();
        assert_eq!(
            bits(&l),
            bits(&rows[9 + j]),
            "decode after the rollback, step {j}"
        );
    }
}

#[test]
fn verify_rows_have_decode_bits_tiny() {
    let dir = tiny_mtp("bits");
    verify_has_decode_bits(&dir);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn verify_rows_have_decode_bits_demo() {
    let (dir, path) = demo("bits", true);
    verify_has_decode_bits(&path);
    std::fs::remove_dir_all(&dir).ok();
}

fn gen(
    eng: &mut Engine,
    sampler: SamplerConfig,
    spec: SpecOptions,
    n: usize,
) -> (Vec<u32>, Option<lathe::spec::SpecStats>) {
    let opts = GenerateOptions {
        max_tokens: Some(n),
        sampler,
        ignore_eog: true,
        spec,
        ..Default::default()
    };
    let out = generate(eng, &prompt(), &opts, |_| {}).unwrap();
    (out.tokens, out.spec)
}

fn spec(mode: SpecMode, draft: usize) -> SpecOptions {
    SpecOptions {
        mode,
        draft,
        accept_all: false,
        draft_model: None,
        draft_vocab: None,
    }
}

/// Greedy output with MTP speculation equals the output without it for drafts of 1..4
/// tokens; sampled outputs at fixed seeds too (the rows have decode's bits and the
/// sampler draws once per token either way: equality, the tightest statistical bound).
fn generation_unchanged(path: &Path, sampled: bool) {
    let mut eng = load(path);
    let (plain, none) = gen(
        &mut eng,
        SamplerConfig::greedy(),
        spec(SpecMode::Off, 1),
        20,
    );
    assert!(none.is_none());
    for k in 1..=4 {
        let (got, stats) = gen(
            &mut eng,
            SamplerConfig::greedy(),
            spec(SpecMode::Mtp, k),
            20,
        );
        assert_eq!(got, plain, "greedy with --draft {k}");
        let st = stats.expect("speculation ran");
        assert_eq!(st.drafted, k * st.verify_passes);
        assert!(st.verify_passes > 0 && st.tokens <= 20 + st.verify_passes);
        eprintln!(
            "draft {k}: acceptance {:.2}, {:.2} tokens per pass",
            st.acceptance(),
            st.tokens_per_forward()
        );
    }
    // Every draft taken as accepted (`--accept-all`): the MTP block then reads all k + 1
    // trunk rows of each verify pass and chains on its own output.
    let all = SpecOptions {
        accept_all: true,
        ..spec(SpecMode::Mtp, 3)
    };
    let (got, stats) = gen(&mut eng, SamplerConfig::greedy(), all, 17);
    let st = stats.expect("speculation ran");
    assert_eq!((got.len(), st.accepted, st.drafted), (17, 12, 12));
    assert_eq!(st.tokens_per_forward(), 4.0);
    if !sampled {
        return;
    }
    for seed in [1, 2] {
        let sampler = SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed,
            ..Default::default()
        };
        let (plain, _) = gen(&mut eng, sampler.clone(), spec(SpecMode::Off, 1), 12);
        let (got, _) = gen(&mut eng, sampler.clone(), spec(SpecMode::Mtp, 3), 12);
        assert_eq!(got, plain, "sampled at seed {seed}");
        let trimmed = SpecOptions {
            draft_vocab: Some(64),
            ..spec(SpecMode::Mtp, 2)
        };
        let (got, _) = gen(&mut eng, sampler, trimmed, 12);
        assert_eq!(got, plain, "sampled at seed {seed}, --draft-vocab 64");
    }
}

#[test]
fn speculation_keeps_output_tiny() {
    let dir = tiny_mtp("gen");
    generation_unchanged(&dir, true);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn speculation_keeps_output_demo() {
    let (dir, path) = demo("gen", true);
    generation_unchanged(&path, false);
    std::fs::remove_dir_all(&dir).ok();
}

/// The target as its own draft model: every draft is what the target picks, so all are
/// accepted; the output, greedy and sampled, is unchanged.
#[test]
fn target_as_its_own_draft_model_accepts_everything() {
    use lathe::spec::DraftModel;
    let path = tiny();
    let mut eng = load(&path);
    let draft = DraftModel::new(load(&path));
    let (plain, _) = gen(
        &mut eng,
        SamplerConfig::greedy(),
        spec(SpecMode::Off, 1),
        21,
    );
    for k in [1, 2, 3, 4] {
        let opts = SpecOptions {
            draft_model: Some(draft.clone()),
            ..spec(SpecMode::Draft, k)
        };
        // The prompt's pick, then four whole passes of k + 1 (every draft used).
        let n = 1 + 4 * (k + 1);
        let (got, st) = gen(&mut eng, SamplerConfig::greedy(), opts.clone(), n);
        assert_eq!(got, plain[..n], "greedy with itself as draft model, k {k}");
        let st = st.unwrap();
        assert_eq!(st.accepted, st.drafted, "k {k}: every draft accepted");
        assert_eq!(st.tokens_per_forward(), (k + 1) as f64);
        let sampler = SamplerConfig {
            temperature: 1.0,
            seed: 5,
            ..Default::default()
        };
        let (a, _) = gen(&mut eng, sampler.clone(), spec(SpecMode::Off, 1), 10);
        let (b, _) = gen(&mut eng, sampler, opts, 10);
        assert_eq!(a, b, "sampled with a draft model, k {k}");
    }
}

/// `lathe synth --mtp` on a DeepSeek-V4 preset writes the block under `mtp.0.` with the
/// release's shapes and `nextn_predict_layers`; the loader finds it.
#[test]
fn synth_mtp_deepseek4_names_and_shapes() {
    use lathe::synth::{self, PlanOptions};
    let opts = PlanOptions {
        n_vocab: Some(512),
        mtp: true,
        ..Default::default()
    };
    let plan = synth::plan(&synth::preset("demo-deepseek4").unwrap(), &opts, None).unwrap();
    let u = |k: &str| plan.get(k).and_then(lathe::gguf::Value::as_u64).unwrap();
    assert_eq!(u("deepseek4.block_count"), 4);
    assert_eq!(u("deepseek4.nextn_predict_layers"), 1);
    for (name, shape) in [
        ("mtp.0.e_proj.weight", vec![256u64, 256]),
        ("mtp.0.h_proj.weight", vec![256, 256]),
        ("mtp.0.enorm.weight", vec![256]),
        ("mtp.0.hnorm.weight", vec![256]),
        ("mtp.0.norm.weight", vec![256]),
        ("mtp.0.hc_head_fn.weight", vec![4, 1024]),
        ("mtp.0.hc_head_scale.weight", vec![1]),
        ("mtp.0.attn_q_a.weight", vec![128, 256]),
        ("mtp.0.exp_probs_b.bias", vec![16]),
        ("mtp.0.ffn_gate_exps.weight", vec![16, 256, 256]),
    ] {
        let t = plan
            .tensor(name)
            .unwrap_or_else(|| panic!("{name} planned"));
        assert_eq!(t.shape, shape, "{name}: [rows, columns] as the release");
    }
    assert!(plan.tensor("mtp.0.attn_compressor_kv.weight").is_none());
}
