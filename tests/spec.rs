//! Speculative decoding on the Qwen3.5 fixtures (dense and MoE) with an MTP block added:
//! the GPU block's logits against an independent numpy reference (`mtp_ref.py`), verify
//! rows bit for bit against one-token decode steps, and generation with speculation against
//! generation without it (greedy and sampled at fixed seeds), draft lengths 1..4.
//!
//! The MTP weights are random and written at test time into a copy of the fixture's HF
//! checkpoint (the released `mtp.*` names and shapes; its decoder layer shaped as the
//! fixture's full-attention layer 1).

mod common;

use lathe::engine::{Engine, KvType, LoadOptions, Logits, Want};
use lathe::generate::{generate, GenerateOptions};
use lathe::models::spec::Hidden;
use lathe::sample::SamplerConfig;
use lathe::spec::{SpecMode, SpecOptions};
use std::path::{Path, PathBuf};

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

/// A copy of fixture `name`'s HF checkpoint with an MTP block added.
fn with_mtp(name: &str) -> PathBuf {
    let src = common::fixtures().join(name);
    let dir = std::env::temp_dir().join(format!("lathe-spec-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    cfg["mtp_num_hidden_layers"] = 1.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();

    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut data = bytes[8 + n..].to_vec();
    let e = cfg["hidden_size"].as_u64().unwrap() as usize;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ name.len() as u64);
    let mut add =
        |header: &mut serde_json::Map<_, _>, name: String, shape: Vec<usize>, vals: Vec<f32>| {
            let lo = data.len();
            data.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
            header.insert(
            name,
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [lo, data.len()]}),
        );
        };
    let mut layer: Vec<(String, Vec<usize>)> = header
        .iter()
        .filter_map(|(k, v)| {
            let rest = k.strip_prefix("model.layers.1.")?;
            let shape = v["shape"]
                .as_array()?
                .iter()
                .map(|d| d.as_u64().unwrap() as usize);
            Some((rest.to_string(), shape.collect()))
        })
        .collect();
    layer.sort();
    for (rest, shape) in layer {
        let len: usize = shape.iter().product();
        let fan = *shape.last().unwrap();
        let vals = (0..len)
            .map(|_| match shape.len() {
                1 => 0.1 * rng.normal(),
                _ => rng.normal() / (fan as f32).sqrt(),
            })
            .collect();
        add(&mut header, format!("mtp.layers.0.{rest}"), shape, vals);
    }
    let fc = (0..e * 2 * e)
        .map(|_| rng.normal() / (2.0 * e as f32).sqrt())
        .collect();
    add(&mut header, "mtp.fc.weight".into(), vec![e, 2 * e], fc);
    for norm in [
        "mtp.pre_fc_norm_embedding",
        "mtp.pre_fc_norm_hidden",
        "mtp.norm",
    ] {
        let vals = (0..e).map(|_| 0.1 * rng.normal()).collect();
        add(&mut header, format!("{norm}.weight"), vec![e], vals);
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

fn load(dir: &Path, kv: KvType) -> Engine {
    let opts = LoadOptions {
        kv_type: kv,
        max_seqs: 2,
        ctx: 256,
        ..Default::default()
    };
    Engine::load(dir, &opts).unwrap()
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

/// `python3 tests/mtp_ref.py` on the GPU block's inputs: its logits `[n, vocab]`.
fn reference(dir: &Path, hidden: &[f32], tokens: &[u32], e: usize) -> Vec<f32> {
    let n = tokens.len();
    let h = dir.join("hidden.npy");
    let t = dir.join("tokens.npy");
    let o = dir.join("ref.npy");
    lathe::npy::write_f32(&h, &[n, e], hidden).unwrap();
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    lathe::npy::write_i32(&t, &[n], &ids).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mtp_ref.py");
    let st = std::process::Command::new("python3")
        .arg(&script)
        .args([dir, &h, &t])
        .arg("0")
        .arg(&o)
        .status()
        .expect("python3 runs (with numpy: the MTP reference needs it)");
    assert!(st.success(), "mtp_ref.py failed");
    lathe::npy::read_f32(&o).unwrap().data
}

fn check_close(label: &str, got: &[f32], want: &[f32]) {
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

/// The GPU MTP block over trunk rows, then one chained row, against the numpy reference.
fn mtp_matches_reference(name: &str) {
    let dir = with_mtp(name);
    let mut eng = load(&dir, KvType::F32);
    let e = 64;
    let v = eng.vocab_size();
    let p = prompt();
    let mut seq = eng.new_seq().unwrap();
    let s = eng.model.speculate().expect("Qwen3.5 speculates");
    assert!(s.has_mtp(), "{name}: the MTP block loaded");
    s.feed(&mut seq, &p, Want::None).unwrap();
    let mut next = p[1..].to_vec();
    next.push(7);
    let rows = s.mtp(&seq, Hidden::Trunk, &next, Want::All).unwrap();
    assert_eq!(rows.len(), p.len());
    let got: Vec<f32> = rows.iter().flat_map(|r| full(r).iter().copied()).collect();
    let hidden = s.mtp_hidden(p.len()).unwrap();
    let want = reference(&dir, &hidden, &next, e);
    check_close(&format!("{name} MTP rows"), &got, &want);
    // A chained row reads the last row's output (position n).
    let chain = s.mtp(&seq, Hidden::Chain, &[11], Want::All).unwrap();
    let mut hidden2 = hidden.clone();
    hidden2.extend(s.mtp_hidden(1).unwrap());
    let mut next2 = next.clone();
    next2.push(11);
    let want2 = reference(&dir, &hidden2, &next2, e);
    check_close(
        &format!("{name} chained MTP row"),
        full(&chain[0]),
        &want2[p.len() * v..],
    );
    // The greedy draft is the argmax of the last row.
    let top = s
        .mtp(&seq, Hidden::Chain, &[5], Want::Top { k: 1, lse: false })
        .unwrap();
    assert!(matches!(&top[0], Logits::Top(t) if t.cands.len() == 1));
    // The drafts of one submission are the chained passes' picks (fresh sequences).
    drop(seq);
    let chained: Vec<u32> = {
        let mut seq2 = eng.new_seq().unwrap();
        let s = eng.model.speculate().unwrap();
        s.feed(&mut seq2, &p, Want::None).unwrap();
        let g = Want::Top { k: 1, lse: false };
        let pick = |l: Vec<Logits>| match &l[0] {
            Logits::Top(t) => t.cands[0].0,
            _ => panic!("top"),
        };
        let mut d = vec![pick(s.mtp(&seq2, Hidden::Trunk, &next, g).unwrap())];
        for _ in 0..3 {
            let last = *d.last().unwrap();
            d.push(pick(s.mtp(&seq2, Hidden::Chain, &[last], g).unwrap()));
        }
        d
    };
    let mut seq = eng.new_seq().unwrap();
    let s = eng.model.speculate().unwrap();
    s.feed(&mut seq, &p, Want::None).unwrap();
    assert_eq!(
        s.mtp_drafts(&seq, &next, 4).unwrap(),
        chained,
        "{name}: drafts in one pass"
    );
    drop(seq);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn mtp_block_matches_numpy_reference_dense() {
    mtp_matches_reference("qwen35-tiny");
}

#[test]
fn mtp_block_matches_numpy_reference_moe() {
    mtp_matches_reference("qwen35moe-tiny");
}

/// Plain decode's full logits at every generated position, and its greedy tokens.
fn decode_logits(eng: &mut Engine, p: &[u32], n: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut seq = eng.new_seq().unwrap();
    let mut l = eng.forward(&mut seq, p, false).unwrap();
    let mut rows = Vec::new();
    let mut toks = Vec::new();
    for _ in 0..n {
        let t = argmax(&l);
        toks.push(t);
        rows.push(l);
        l = eng.forward(&mut seq, &[t], false).unwrap();
    }
    rows.push(l);
    (rows, toks)
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

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Verify rows give the bits of one-token decode steps: all drafts right (no rollback),
/// then drafts wrong after the first (rollback, the accepted ones fed again), then decode
/// goes on with the bits it would have had.
fn verify_has_decode_bits(name: &str) {
    let dir = with_mtp(name);
    let mut eng = load(&dir, KvType::F16);
    let p = prompt();
    let (rows, toks) = decode_logits(&mut eng, &p, 12);
    let wrong = (toks[7] + 1) % eng.vocab_size() as u32;
    let mut seq = eng.new_seq().unwrap();
    eng.forward(&mut seq, &p, false).unwrap();
    let s = eng.model.speculate().unwrap();
    let k = s.max_verify() - 1;
    assert!(k >= 4, "{name}: verify passes of {} rows", k + 1);
    // Rows of [t0, g1..g4]: the logits after each, as decode had them.
    let fed = &toks[..5];
    let got = s.verify(&mut seq, fed, Want::All).unwrap();
    for (j, r) in got.iter().enumerate() {
        assert_eq!(bits(full(r)), bits(&rows[j + 1]), "{name}: verify row {j}");
    }
    // Two right then a wrong draft: keep three tokens.
    let fed2 = [toks[5], toks[6], toks[7], wrong];
    let got = s
        .verify(&mut seq, &fed2, Want::Top { k: 3, lse: true })
        .unwrap();
    for (j, r) in got.iter().take(3).enumerate() {
        let Logits::Top(t) = r else {
            panic!("top rows")
        };
        assert_eq!(
            t.cands[0].0,
            toks[6 + j],
            "{name}: verify row {j} picks decode's token"
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
            "{name}: decode after the rollback, step {j}"
        );
    }
    drop(seq);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn verify_rows_have_decode_bits_dense() {
    verify_has_decode_bits("qwen35-tiny");
}

#[test]
fn verify_rows_have_decode_bits_moe() {
    verify_has_decode_bits("qwen35moe-tiny");
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

/// Greedy output with speculation equals the output without it, for drafts of 1..4 tokens;
/// so do sampled outputs at fixed seeds (the rows have decode's bits and the sampler draws
/// once per token either way).
fn generation_unchanged(name: &str) {
    let dir = with_mtp(name);
    let mut eng = load(&dir, KvType::F16);
    let (plain, none) = gen(
        &mut eng,
        SamplerConfig::greedy(),
        spec(SpecMode::Off, 1),
        24,
    );
    assert!(none.is_none());
    for k in 1..=4 {
        let (got, stats) = gen(
            &mut eng,
            SamplerConfig::greedy(),
            spec(SpecMode::Mtp, k),
            24,
        );
        assert_eq!(got, plain, "{name}: greedy with --draft {k}");
        let st = stats.expect("speculation ran");
        assert_eq!(st.drafted, k * st.verify_passes);
        assert!(st.verify_passes > 0 && st.tokens <= 24 + st.verify_passes);
        eprintln!(
            "{name} draft {k}: acceptance {:.2}, {:.2} tokens per pass",
            st.acceptance(),
            st.tokens_per_forward()
        );
    }
    for seed in [1, 2, 3] {
        let sampler = SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed,
            ..Default::default()
        };
        let (plain, _) = gen(&mut eng, sampler.clone(), spec(SpecMode::Off, 1), 16);
        let trimmed = SpecOptions {
            draft_vocab: Some(64),
            ..spec(SpecMode::Mtp, 3)
        };
        let (got, _) = gen(&mut eng, sampler.clone(), trimmed, 16);
        assert_eq!(got, plain, "{name}: sampled at seed {seed}");
        let top = SamplerConfig {
            top_k: 20,
            ..sampler
        };
        let (plain, _) = gen(&mut eng, top.clone(), spec(SpecMode::Off, 1), 16);
        let (got, _) = gen(&mut eng, top, spec(SpecMode::Mtp, 2), 16);
        assert_eq!(got, plain, "{name}: top-k sampled at seed {seed}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn speculation_keeps_output_dense() {
    generation_unchanged("qwen35-tiny");
}

#[test]
fn speculation_keeps_output_moe() {
    generation_unchanged("qwen35moe-tiny");
}

/// `lathe synth --mtp` writes the block with llama.cpp's names (`blk.{n_layer}.nextn.*`,
/// counted in `block_count`); the loader finds it and speculation keeps the output.
#[test]
fn synth_mtp_gguf_loads_and_keeps_output() {
    use lathe::synth::{self, FileType, PlanOptions};
    let dir = std::env::temp_dir().join(format!("lathe-spec-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("demo-mtp.gguf");
    let opts = PlanOptions {
        ftype: Some(FileType::Q8_0),
        n_vocab: Some(512),
        mtp: true,
        ..Default::default()
    };
    let plan = synth::plan(&synth::preset("demo").unwrap(), &opts, None).unwrap();
    let u = |k: &str| plan.get(k).and_then(lathe::gguf::Value::as_u64).unwrap();
    assert_eq!(u("qwen35.block_count"), 5);
    assert_eq!(u("qwen35.nextn_predict_layers"), 1);
    for name in [
        "blk.4.nextn.eh_proj.weight",
        "blk.4.nextn.enorm.weight",
        "blk.4.nextn.hnorm.weight",
        "blk.4.nextn.shared_head_norm.weight",
        "blk.4.attn_q.weight",
        "blk.4.ffn_down.weight",
    ] {
        assert!(plan.tensor(name).is_some(), "{name} planned");
    }
    // [n_embd, 2·n_embd] (rows, columns), as `mtp.fc`.
    assert_eq!(
        plan.tensor("blk.4.nextn.eh_proj.weight").unwrap().shape,
        [256, 512]
    );
    plan.write(&path, 1, None).unwrap();
    let mut eng = load(&path, KvType::F16);
    assert!(eng.model.speculate().unwrap().has_mtp());
    let (plain, _) = gen(
        &mut eng,
        SamplerConfig::greedy(),
        spec(SpecMode::Off, 1),
        12,
    );
    let (got, st) = gen(
        &mut eng,
        SamplerConfig::greedy(),
        spec(SpecMode::Auto, 3),
        12,
    );
    assert_eq!(got, plain, "synth demo --mtp: greedy with speculation");
    assert!(
        st.unwrap().verify_passes > 0,
        "auto speculates when the file has MTP"
    );
    drop(eng);
    std::fs::remove_dir_all(&dir).ok();
}

/// `--preset demo-deepseek4` writes a DeepSeek-V4 file the GPU forward runs.
#[test]
fn synth_demo_deepseek4_runs() {
    use lathe::synth::{self, PlanOptions};
    let dir = std::env::temp_dir().join(format!("lathe-spec-dsv4-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("demo-dsv4.gguf");
    let opts = PlanOptions {
        n_vocab: Some(512),
        ..Default::default()
    };
    let plan = synth::plan(&synth::preset("demo-deepseek4").unwrap(), &opts, None).unwrap();
    assert_eq!(plan.arch, "deepseek4");
    plan.write(&path, 1, None).unwrap();
    let mut eng = load(&path, KvType::Auto);
    let mut seq = eng.new_seq().unwrap();
    let l = eng.forward(&mut seq, &prompt(), true).unwrap();
    assert_eq!(l.len(), prompt().len() * 512);
    assert!(l.iter().all(|x| x.is_finite()));
    // No MTP block there: auto decodes without speculation.
    let (_, st) = gen(
        &mut eng,
        SamplerConfig::greedy(),
        spec(SpecMode::Auto, 3),
        4,
    );
    assert!(st.is_none());
    drop((seq, eng));
    std::fs::remove_dir_all(&dir).ok();
}

/// The target as its own draft model: every draft is what the target picks (the draft
/// model runs the decode kernels), so all are accepted; the output is unchanged.
fn self_draft(name: &str) {
    use lathe::spec::DraftModel;
    let dir = common::fixtures().join(name);
    let mut eng = load(&dir, KvType::F16);
    let draft = DraftModel::new(load(&dir, KvType::F16));
    let (plain, _) = gen(
        &mut eng,
        SamplerConfig::greedy(),
        spec(SpecMode::Off, 1),
        25,
    );
    for k in [1, 3] {
        let opts = SpecOptions {
            draft_model: Some(draft.clone()),
            ..spec(SpecMode::Draft, k)
        };
        // 25 tokens: the prompt's pick, then whole passes of k + 1 (k = 1, 3).
        let (got, st) = gen(&mut eng, SamplerConfig::greedy(), opts.clone(), 25);
        assert_eq!(
            got, plain,
            "{name}: greedy with itself as draft model, k {k}"
        );
        let st = st.unwrap();
        assert_eq!(
            st.accepted, st.drafted,
            "{name}: k {k}: every draft accepted"
        );
        assert_eq!(st.tokens_per_forward(), (k + 1) as f64);
        let sampler = SamplerConfig {
            temperature: 1.0,
            seed: 5,
            ..Default::default()
        };
        let (a, _) = gen(&mut eng, sampler.clone(), spec(SpecMode::Off, 1), 16);
        let (b, _) = gen(&mut eng, sampler, opts, 16);
        assert_eq!(a, b, "{name}: sampled with a draft model");
    }
}

#[test]
fn target_as_its_own_draft_model_accepts_everything() {
    self_draft("qwen35-tiny");
    self_draft("qwen35moe-tiny");
}

/// `lathe bench --spec`: the warm-up compiles every pipeline the timed repetitions use
/// (none is compiled while they run, on the model's device or the draft model's), and bench's
/// greedy speculation (MTP drafts, or a draft model as `run` and `serve` run it: here the
/// target itself, so every draft is kept) gives plain greedy decoding's tokens.
#[test]
fn bench_speculation_warms_up_and_keeps_greedy_output() {
    use lathe::bench::{self, BenchOptions};
    use lathe::synth::{self, FileType, PlanOptions};
    let dir = std::env::temp_dir().join(format!("lathe-spec-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("demo-mtp.gguf");
    let opts = PlanOptions {
        ftype: Some(FileType::Q8_0),
        n_vocab: Some(512),
        mtp: true,
        ..Default::default()
    };
    synth::plan(&synth::preset("demo").unwrap(), &opts, None)
        .unwrap()
        .write(&path, 1, None)
        .unwrap();
    for (mode, k) in [(SpecMode::Mtp, 3), (SpecMode::Draft, 2)] {
        let draft_model = (mode == SpecMode::Draft).then(|| path.clone());
        let o = BenchOptions {
            n_prompt: 0,
            n_gen: 10,
            reps: 1,
            spec: Some(spec(mode, k)),
            draft_model,
            ..Default::default()
        };
        let r = bench::run(&path, &o).unwrap();
        assert_eq!(r.compiled_while_timed, 0, "{mode:?}: compiles while timed");
        let (st, costs) = r.spec.expect("speculation measured");
        assert_eq!(r.decode.unwrap().tokens, 10);
        assert!(st.verify_passes > 0 && st.drafted > 0, "{mode:?}: {st:?}");
        assert_eq!(costs.draft_step.is_some(), mode == SpecMode::Draft);
        if mode == SpecMode::Draft {
            assert_eq!(st.accepted, st.drafted, "the target drafts itself");
        }
    }
    // bench's generation against plain greedy decoding, from one token
    let mut eng = load(&path, KvType::F16);
    let first = 141;
    let plain = {
        let opts = GenerateOptions {
            max_tokens: Some(14),
            sampler: SamplerConfig::greedy(),
            ignore_eog: true,
            spec: spec(SpecMode::Off, 1),
            ..Default::default()
        };
        generate(&mut eng, &[first], &opts, |_| {}).unwrap().tokens
    };
    let draft = lathe::spec::DraftModel::new(load(&path, KvType::F16));
    for (mode, k) in [
        (SpecMode::Mtp, 3),
        (SpecMode::Draft, 3),
        (SpecMode::Draft, 1),
    ] {
        let so = SpecOptions {
            draft_model: (mode == SpecMode::Draft).then(|| draft.clone()),
            ..spec(mode, k)
        };
        let mut seq = eng.new_seq().unwrap();
        let (st, got) = lathe::spec::greedy_run(&mut eng, &mut seq, first, 14, &so).unwrap();
        assert_eq!(
            got, plain,
            "{mode:?} --draft {k}: bench's greedy speculation"
        );
        assert!(st.verify_passes > 0);
    }
    drop(eng);
    std::fs::remove_dir_all(&dir).ok();
}

/// `--activations int8`: a verify pass's products quantize each row's x as a lone decode
/// step's do (the token-group kernels take int8 exactly when one token would), so greedy
/// output with speculation is the output without it (the demo file is Q8_0: int8 products).
#[test]
fn int8_activations_speculation_keeps_greedy_output() {
    use lathe::engine::ActivationsChoice;
    use lathe::synth::{self, FileType, PlanOptions};
    let dir = std::env::temp_dir().join(format!("lathe-spec-int8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("demo-mtp.gguf");
    let opts = PlanOptions {
        ftype: Some(FileType::Q8_0),
        n_vocab: Some(512),
        mtp: true,
        ..Default::default()
    };
    synth::plan(&synth::preset("demo").unwrap(), &opts, None)
        .unwrap()
        .write(&path, 1, None)
        .unwrap();
    for fused_loads in [false, true] {
        let opts = LoadOptions {
            kv_type: KvType::F16,
            max_seqs: 2,
            ctx: 256,
            activations: ActivationsChoice::Int8,
            fused_loads,
            ..Default::default()
        };
        let mut eng = Engine::load(&path, &opts).unwrap();
        assert!(eng.gpu.int8_decode());
        let (plain, _) = gen(
            &mut eng,
            SamplerConfig::greedy(),
            spec(SpecMode::Off, 1),
            16,
        );
        for k in [1, 3] {
            let (got, st) = gen(
                &mut eng,
                SamplerConfig::greedy(),
                spec(SpecMode::Mtp, k),
                16,
            );
            assert_eq!(got, plain, "int8, fused loads {fused_loads}, --draft {k}");
            assert!(st.unwrap().verify_passes > 0);
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
