//! Sampling from the best logits found on the GPU (`Want::Top`) against sampling from the
//! full logits read back: the kernel (`gpu::topk::LogitsTop`: top-k + log-sum-exp) against
//! its CPU references over odd and real vocabulary sizes, `Sampler::sample_top` against
//! `Sampler::sample`, and whole generations on the fixture models (qwen35-tiny, dsv4-tiny)
//! through both paths: the same tokens, the same candidates (ids exactly, logits to 1e-6),
//! the same log-sum-exp (1e-5 relative).

mod common;

use lathe::engine::{Engine, LoadOptions, Logits, Want};
use lathe::gpu::operand::Operand;
use lathe::gpu::topk::{LogitsTop, MAX_TOP_K};
use lathe::gpu::{AdapterChoice, Gpu};
use lathe::sample::{log_sum_exp, Sampler, SamplerConfig, TopLogits};

/// xorshift64*: deterministic test data.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-a, a).
    fn f32(&mut self, a: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
    }
}

fn config(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature,
        top_k,
        top_p,
        min_p,
        seed,
        ..SamplerConfig::default()
    }
}

/// What the GPU path returns for a row, computed on the CPU: the k best (ties to the lower
/// id, NaN never) and the log-sum-exp.
fn cpu_top(logits: &[f32], k: usize) -> TopLogits {
    let (ids, vals) = lathe::cpu::ops::topk(logits, k);
    TopLogits {
        cands: ids
            .into_iter()
            .zip(vals)
            .filter(|c| c.0 != u32::MAX)
            .collect(),
        lse: Some(log_sum_exp(logits) as f32),
    }
}

fn assert_top_eq(what: &str, got: &TopLogits, want: &TopLogits) {
    assert_top_near(what, got, want, 1e-6);
}

/// [`assert_top_eq`] with logits to `tol` relative.
fn assert_top_near(what: &str, got: &TopLogits, want: &TopLogits, tol: f32) {
    let ids = |t: &TopLogits| t.cands.iter().map(|c| c.0).collect::<Vec<_>>();
    assert_eq!(ids(got), ids(want), "{what}: candidate ids");
    for (g, w) in got.cands.iter().zip(&want.cands) {
        assert!(
            g.1 == w.1 || (g.1 - w.1).abs() <= tol * w.1.abs().max(1.0),
            "{what}: logit of {}: {} vs {}",
            g.0,
            g.1,
            w.1
        );
    }
    if let (Some(g), Some(w)) = (got.lse, want.lse) {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{what}: lse {g} vs {w}"
        );
    }
}

// ---------------------------------------------------------------- the sampler alone (CPU)

/// `sample_top` over the CPU's top-k gives the very tokens `sample` gives over the full
/// logits, draw after draw (same random stream), for every setting the GPU path serves.
#[test]
fn sample_top_matches_sample() {
    let mut rng = Rng(0x5eed);
    for n in [3usize, 50, 1000] {
        let mut logits: Vec<f32> = (0..n).map(|_| rng.f32(4.0)).collect();
        // Ties at the top and in the middle: the lower id must win both ways.
        logits[n / 2] = 9.0;
        logits[n - 1] = 9.0;
        logits[1] = logits[2];
        let configs = [
            config(0.0, 40, 0.95, 0.05, 1),
            config(0.8, 40, 0.95, 0.05, 2),
            config(1.0, 5, 1.0, 0.0, 3),
            config(1.5, 64, 0.5, 0.0, 4),
            config(0.7, 20, 1.0, 0.2, 5),
            config(2.0, 1, 1.0, 0.0, 6),
        ];
        for cfg in configs {
            let Want::Top { k, lse } = cfg.gpu_want(None) else {
                panic!("{cfg:?} should take the GPU path");
            };
            assert!(!lse);
            let top = cpu_top(&logits, k as usize);
            let (mut a, mut b) = (Sampler::new(cfg.clone()), Sampler::new(cfg.clone()));
            for step in 0..200 {
                let want = a.sample(&mut logits.clone(), &[]);
                let got = b.sample_top(&top);
                assert_eq!(got, want, "n {n}, {cfg:?}, draw {step}");
            }
        }
    }
}

/// Which forward each setting asks for.
#[test]
fn gpu_want_plans() {
    let top = |k, lse| Want::Top { k, lse };
    assert_eq!(SamplerConfig::greedy().gpu_want(None), top(1, false));
    assert_eq!(SamplerConfig::greedy().gpu_want(Some(5)), top(5, true));
    assert_eq!(SamplerConfig::default().gpu_want(None), top(40, false));
    assert_eq!(SamplerConfig::default().gpu_want(Some(20)), top(40, true));
    assert_eq!(SamplerConfig::default().gpu_want(Some(0)), top(40, true));
    // top-k off (nucleus over the whole vocabulary), k beyond the kernel, penalties.
    assert_eq!(config(0.8, 0, 0.9, 0.0, 1).gpu_want(None), Want::Last);
    assert_eq!(
        config(0.8, MAX_TOP_K as usize + 1, 1.0, 0.0, 1).gpu_want(None),
        Want::Last
    );
    let pen = SamplerConfig {
        repeat_penalty: 1.1,
        ..SamplerConfig::greedy()
    };
    assert_eq!(pen.gpu_want(None), Want::Last);
    // A penalty with an empty window changes nothing: the GPU path still serves it.
    let idle = SamplerConfig {
        penalty_window: 0,
        ..pen
    };
    assert_eq!(idle.gpu_want(None), top(1, false));
}

// ---------------------------------------------------------------- the kernel

fn gpu() -> Gpu {
    let gpu = Gpu::new(&AdapterChoice::Auto).expect("a wgpu adapter (lavapipe in CI)");
    eprintln!("{}", gpu.report());
    gpu
}

/// `LogitsTop` against `cpu::ops::topk` + `sample::log_sum_exp` on rows of odd sizes and of
/// the released vocabularies (DeepSeek-V4 129,280; Qwen3.5 248,320), with planted ties, NaNs
/// and −inf, k from 1 to MAX_TOP_K and k larger than the row; results written at a row
/// offset, two calls sharing one pass.
#[test]
fn logits_top_matches_cpu() {
    let gpu = gpu();
    let mut rng = Rng(0x70b);
    for (n, rows) in [
        (1usize, 2usize),
        (7, 3),
        (2047, 2),
        (2049, 2),
        (5000, 3),
        (129_280, 1),
        (248_320, 2),
    ] {
        let mut x: Vec<f32> = (0..rows * n).map(|_| rng.f32(8.0)).collect();
        for r in 0..rows {
            let row = &mut x[r * n..(r + 1) * n];
            if n >= 4 {
                row[n - 1] = 30.0;
                row[n / 2] = 30.0;
                row[1] = f32::NAN;
                row[2] = f32::NEG_INFINITY;
            }
        }
        let xbuf = gpu.upload_f32(&x, "x").unwrap();
        let top = LogitsTop::new(&gpu, 2 * rows as u32, n as u32).unwrap();
        for k in [1u32, 3, 40, MAX_TOP_K] {
            let mut pass = gpu.pass();
            // Rows 0.. of x into result rows `rows..`, then (lse off) nothing else: the
            // second record must not disturb the first's results.
            top.record(&mut pass, Operand::new(&xbuf, 0), rows as u32, 0, k, true)
                .unwrap();
            top.record(
                &mut pass,
                Operand::new(&xbuf, 0),
                rows as u32,
                rows as u32,
                k,
                false,
            )
            .unwrap();
            pass.submit().unwrap();
            let got = top.read(&gpu, 2 * rows as u32, k, true).unwrap();
            for r in 0..2 * rows {
                let row = &x[(r % rows) * n..(r % rows + 1) * n];
                let want = cpu_top(row, k as usize);
                assert_eq!(want.cands.len(), (k as usize).min(n - (n >= 4) as usize));
                let what = format!("n {n} k {k} row {r}");
                let got_r = TopLogits {
                    lse: if r < rows { got[r].lse } else { None },
                    ..got[r].clone()
                };
                assert_top_eq(&what, &got_r, &want);
                // The values are the logits themselves, bit for bit.
                for c in &got[r].cands {
                    assert_eq!(c.1.to_bits(), row[c.0 as usize].to_bits(), "{what}");
                }
            }
        }
    }
}

/// k out of range is an error, not a panic.
#[test]
fn logits_top_rejects_bad_k() {
    let gpu = gpu();
    let x = gpu.buffer(4 * 100, "x").unwrap();
    let top = LogitsTop::new(&gpu, 1, 100).unwrap();
    let mut pass = gpu.pass();
    for k in [0, MAX_TOP_K + 1] {
        let err = top
            .record(&mut pass, Operand::new(&x, 0), 1, 0, k, false)
            .unwrap_err();
        assert!(err.to_string().contains("k = "), "{err}");
    }
    let err = top
        .record(&mut pass, Operand::new(&x, 0), 1, 1, 1, false)
        .unwrap_err();
    assert!(err.to_string().contains("rows"), "{err}");
}

/// Runs `LogitsTop` over `rows` (each of `n`) at every k of `ks`, with the lse, in one
/// record per k; checks ids, value bits and the lse against the CPU row by row.
fn check_logits_top(gpu: &Gpu, what: &str, x: &[f32], n: usize, ks: &[u32]) {
    let rows = x.len() / n;
    let xbuf = gpu.upload_f32(x, "x").unwrap();
    let top = LogitsTop::new(gpu, rows as u32, n as u32).unwrap();
    for &k in ks {
        let mut pass = gpu.pass();
        top.record(&mut pass, Operand::new(&xbuf, 0), rows as u32, 0, k, true)
            .unwrap();
        pass.submit().unwrap();
        let got = top.read(gpu, rows as u32, k, true).unwrap();
        for (r, g) in got.iter().enumerate() {
            let row = &x[r * n..(r + 1) * n];
            let want = cpu_top(row, k as usize);
            let what = format!("{what}: n {n} k {k} row {r}");
            let ids = |t: &TopLogits| t.cands.iter().map(|c| c.0).collect::<Vec<_>>();
            assert_eq!(ids(g), ids(&want), "{what}: candidate ids");
            for c in &g.cands {
                assert_eq!(c.1.to_bits(), row[c.0 as usize].to_bits(), "{what}");
            }
            // −inf for a row without a finite value, else 1e-5 relative.
            let (gl, wl) = (g.lse.unwrap(), want.lse.unwrap());
            assert!(
                gl == wl || (gl - wl).abs() <= 1e-5 * wl.abs().max(1.0),
                "{what}: lse {gl} vs {wl}"
            );
        }
    }
}

/// The rows that stress the kernel's threshold (`topk.wgsl` `main`) on the Qwen3.5
/// vocabulary at k = 64 and 40, several rows per call: one value everywhere (every element
/// ties: ids 0..k); four levels (62k ties at the top); −inf everywhere but k finite values;
/// −inf everywhere but 10 finite values and NaNs (the tail is −inf by lowest id, NaN never);
/// every 4096-chunk's best values on the first 64 threads' strided slots (close to the most
/// survivors the kernel allows, K·PER = 1024); all NaN (nothing selected).
#[test]
fn logits_top_ties_and_sparse_rows() {
    let gpu = gpu();
    let n = 248_320usize;
    let mut rng = Rng(0x7135);
    let mut x = Vec::with_capacity(6 * n);
    x.extend(std::iter::repeat_n(0.25f32, n));
    x.extend((0..n).map(|_| (rng.next() % 4) as f32));
    let mut sparse = vec![f32::NEG_INFINITY; n];
    for j in 0..MAX_TOP_K as usize {
        sparse[(j * 3_877 + 11) % n] = (j % 5) as f32 - 2.0;
    }
    x.extend(&sparse);
    let mut few = vec![f32::NEG_INFINITY; n];
    for j in 0..10 {
        few[j * 20_000 + 5] = j as f32;
    }
    for j in (0..n).step_by(7) {
        few[j] = f32::NAN;
    }
    x.extend(&few);
    // Thread t < 64 of a chunk holds 1000 − 4t + q/8 at its slot q: its best (q = 15) is
    // worse than all 16 values of each thread before it, so T (thread 63's best) passes
    // 63·16 + 1 elements; every chunk repeats the values (ties across chunks).
    x.extend((0..n).map(|e| {
        let (t, q) = (e % 256, e % 4096 / 256);
        if t < 64 {
            1000.0 - 4.0 * t as f32 + q as f32 * 0.125
        } else {
            rng.f32(5.0)
        }
    }));
    x.extend(std::iter::repeat_n(f32::NAN, n));
    check_logits_top(&gpu, "ties", &x, n, &[MAX_TOP_K, 40]);
}

/// Rows around the chunk sizes of the stages (4,096 elements; 4,096 / k candidates; three
/// stages for 300,000 at k = 64), with random values and many ties, at k from 1 to
/// MAX_TOP_K.
#[test]
fn logits_top_chunk_edges() {
    let gpu = gpu();
    let mut rng = Rng(0xed9e);
    for n in [
        63usize, 64, 65, 4095, 4096, 4097, 8191, 65_600, 262_144, 300_000,
    ] {
        let rows = if n < 100_000 { 3 } else { 1 };
        let x: Vec<f32> = (0..rows * n)
            .map(|_| match rng.next() % 16 {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                2..=5 => (rng.next() % 8) as f32,
                _ => rng.f32(8.0),
            })
            .collect();
        check_logits_top(&gpu, "edges", &x, n, &[1, 2, 33, 63, MAX_TOP_K]);
    }
}

// ---------------------------------------------------------------- whole models

fn load(model: &str) -> Engine {
    let path = common::fixtures().join(model).join("model-f32.gguf");
    let opts = LoadOptions {
        max_seqs: 6,
        ..LoadOptions::default()
    };
    Engine::load(&path, &opts).unwrap()
}

fn prompt(model: &str) -> Vec<u32> {
    let t = lathe::npy::read_i64(common::fixtures().join(model).join("tokens.npy")).unwrap();
    t.data.iter().take(12).map(|&v| v as u32).collect()
}

/// Generates `steps` tokens twice from the same prompt, once from full logits (the host
/// sampler) and once from the GPU's top-k; checks every step's candidates and lse against
/// the full row, and that the tokens agree.
fn both_paths(e: &mut Engine, prompt: &[u32], cfg: &SamplerConfig, steps: usize) -> Vec<u32> {
    let Want::Top { k, .. } = cfg.gpu_want(Some(3)) else {
        panic!("{cfg:?} should take the GPU path")
    };
    let mut full = e.new_seq().unwrap();
    let mut top = e.new_seq().unwrap();
    let (mut sf, mut st) = (Sampler::new(cfg.clone()), Sampler::new(cfg.clone()));
    let mut tokens = Vec::new();
    let (mut feed_f, mut feed_t) = (prompt.to_vec(), prompt.to_vec());
    for step in 0..steps {
        let mut logits = e.forward(&mut full, &feed_f, false).unwrap();
        let t = e.forward_top(&mut top, &feed_t, k, true).unwrap();
        let what = format!("{cfg:?} step {step}");
        assert_top_eq(&what, &t, &cpu_top(&logits, k as usize));
        let a = sf.sample(&mut logits, &[]);
        let b = st.sample_top(&t);
        assert_eq!(a, b, "{what}: sampled tokens");
        tokens.push(a);
        feed_f = vec![a];
        feed_t = vec![b];
    }
    tokens
}

fn check_model(model: &str) {
    let mut e = load(model);
    let p = prompt(model);
    let greedy = both_paths(&mut e, &p, &SamplerConfig::greedy(), 12);
    // Greedy picks the argmax every step (the fixtures' logits have no exact ties).
    assert_eq!(greedy.len(), 12);
    for cfg in [
        config(1.0, 40, 0.95, 0.05, 7),
        config(1.3, 5, 0.9, 0.0, 11),
        config(0.9, 64, 1.0, 0.1, 13),
    ] {
        both_paths(&mut e, &p, &cfg, 12);
    }
    // The library's generation loop takes the GPU path and gives the same tokens.
    let opts = lathe::generate::GenerateOptions {
        max_tokens: Some(12),
        sampler: SamplerConfig::greedy(),
        ..Default::default()
    };
    let out = lathe::generate::generate(&mut e, &p, &opts, |_| {}).unwrap();
    assert_eq!(out.tokens, greedy, "generate() vs the full-logits path");
}

#[test]
fn qwen35_tiny_top_path_matches_full_logits() {
    check_model("qwen35-tiny");
}

#[test]
fn dsv4_tiny_top_path_matches_full_logits() {
    check_model("dsv4-tiny");
}

/// A batched decode step (one token of each of 5 sequences, as `lathe serve` and `lathe bench
/// --parallel` run them) gives every sequence the bits a lone decode step gives it: its
/// products and its head run the token-group matvec, whose rows have one-token bits.
fn check_batched_decode_bits(model: &str) {
    // The f32 GGUF, or the Hugging Face checkpoint where there is none.
    let dir = common::fixtures().join(model);
    let path = Some(dir.join("model-f32.gguf"))
        .filter(|p| p.exists())
        .unwrap_or(dir);
    let opts = LoadOptions {
        max_seqs: 10,
        ..LoadOptions::default()
    };
    let mut e = Engine::load(&path, &opts).unwrap();
    let p = prompt(model);
    let want = Want::Top { k: 5, lse: true };
    let mut batch: Vec<_> = (0..5).map(|_| e.new_seq().unwrap()).collect();
    let mut alone: Vec<_> = (0..5).map(|_| e.new_seq().unwrap()).collect();
    // different prefixes, so each sequence attends over its own context
    for (i, (b, a)) in batch.iter_mut().zip(alone.iter_mut()).enumerate() {
        e.forward(b, &p[..4 + i], false).unwrap();
        e.forward(a, &p[..4 + i], false).unwrap();
    }
    for step in 0..3u32 {
        let toks: Vec<u32> = (0..5).map(|i| 3 + 7 * i + step).collect();
        let mut items: Vec<_> = batch
            .iter_mut()
            .zip(&toks)
            .map(|(s, t)| (s, std::slice::from_ref(t), want))
            .collect();
        let out = e.forward_batch_with(&mut items).unwrap();
        for (i, (a, t)) in alone.iter_mut().zip(&toks).enumerate() {
            let lone = e.forward_top(a, &[*t], 5, true).unwrap();
            assert_eq!(
                out[i],
                Logits::Top(lone),
                "{model} step {step} seq {i}: batched against alone"
            );
        }
    }
}

#[test]
fn qwen35_batched_decode_has_lone_bits() {
    check_batched_decode_bits("qwen35-tiny");
}

#[test]
fn dsv4_batched_decode_has_lone_bits() {
    check_batched_decode_bits("dsv4-tiny");
}

/// The Llama family's batched rounds: decode rows of several sequences in one pass, their
/// attention in one `Keys::Ranges` call (interleaved RoPE here; NeoX with q/k norms, which a
/// lone decode fuses into `qk_norm_rope`, in `qwen3-tiny`; routed experts in `qwen3moe-tiny`;
/// a sliding window of 8 that positions 8-10 outgrow in `mistral-tiny`).
#[test]
fn llama_family_batched_decode_has_lone_bits() {
    for model in ["llama-tiny", "qwen3-tiny", "qwen3moe-tiny", "mistral-tiny"] {
        check_batched_decode_bits(model);
    }
}

/// One batched forward with items wanting different things (top-k with lse, top-1, full
/// logits, nothing) gives each what a forward of its own would.
#[test]
fn batch_mixes_wants() {
    let mut e = load("qwen35-tiny");
    let p = prompt("qwen35-tiny");
    let mut seqs: Vec<_> = (0..4).map(|_| e.new_seq().unwrap()).collect();
    let mut reference = e.new_seq().unwrap();
    let want_full = e.forward(&mut reference, &p, false).unwrap();
    let wants = [
        Want::Top { k: 7, lse: true },
        Want::Top { k: 1, lse: false },
        Want::Last,
        Want::None,
    ];
    // Prefill in one batch, then one decode step for all.
    for step in 0..2 {
        let feed: Vec<u32> = if step == 0 { p.clone() } else { vec![5] };
        let mut items: Vec<_> = seqs
            .iter_mut()
            .zip(wants)
            .map(|(s, w)| (s, feed.as_slice(), w))
            .collect();
        let out = e.forward_batch_with(&mut items).unwrap();
        let full = if step == 0 {
            want_full.clone()
        } else {
            e.forward(&mut reference, &[5], false).unwrap()
        };
        // The batch runs 4x the rows of the lone reference, so its products may take the
        // tiled kernel where the reference took matvec (`matmul::DENSE_MATVEC_TOKENS`): the
        // same sums in another order, equal to f32 rounding, not bit for bit; a K or V value
        // that lands on the other side of an f16 rounding step (the default KV cache) carries
        // that to ~1e-4 of the logits.
        const BATCH_TOL: f32 = 2e-4;
        match &out[0] {
            Logits::Top(t) => {
                assert_eq!(t.cands.len(), 7);
                assert_top_near("k 7", t, &cpu_top(&full, 7), BATCH_TOL);
            }
            o => panic!("item 0: {o:?}"),
        }
        match &out[1] {
            Logits::Top(t) => {
                assert_eq!(t.lse, None);
                assert_top_near("k 1", t, &cpu_top(&full, 1), BATCH_TOL);
                assert_eq!(t.cands[0].0, lathe::sample::argmax(&full).unwrap());
            }
            o => panic!("item 1: {o:?}"),
        }
        match &out[2] {
            Logits::Full(v) => {
                assert_eq!(v.len(), full.len(), "full logits item");
                for (i, (a, b)) in v.iter().zip(&full).enumerate() {
                    assert!(
                        (a - b).abs() <= BATCH_TOL * b.abs().max(1.0),
                        "full logits item, id {i}: {a} vs {b}"
                    );
                }
            }
            o => panic!("item 2: {o:?}"),
        }
        assert_eq!(out[3], Logits::Full(Vec::new()), "no logits item");
    }
    // k past MAX_TOP_K is an error (a vocabulary smaller than k: the kernel test).
    let err = e
        .forward_top(&mut seqs[0], &[1], MAX_TOP_K + 1, false)
        .unwrap_err();
    assert!(err.to_string().contains("top-"), "{err}");
    // `forward_batch` (full logits only) refuses Top items.
    let mut s = e.new_seq().unwrap();
    assert!(e
        .forward_batch(&mut [(&mut s, &[1u32][..], Want::Top { k: 2, lse: false })])
        .is_err());
}

/// The kernels the top path compiles (packed final stage, pairs stages, log-sum-exp) also
/// translate to SPIR-V, MSL and HLSL (as tests/shaders.rs checks for the forward's kernels).
#[test]
fn top_variants_translate_to_every_backend() {
    let gpu = gpu();
    let n = 5000u32;
    let x = gpu.buffer(4 * n as u64, "x").unwrap();
    let top = LogitsTop::new(&gpu, 1, n).unwrap();
    let mut pass = gpu.pass();
    for k in [1, 40] {
        top.record(&mut pass, Operand::new(&x, 0), 1, 0, k, true)
            .unwrap();
    }
    pass.submit().unwrap();
    let mut checked = 0;
    for spec in gpu.compiled_specs() {
        let wgsl = spec.wgsl().unwrap();
        let module = naga::front::wgsl::parse_str(&wgsl)
            .unwrap_or_else(|e| panic!("{}: {}", spec.label, e.emit_to_string(&wgsl)));
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}: {}", spec.label, e.emit_to_string(&wgsl)));
        naga::back::spv::write_vec(&module, &info, &Default::default(), None)
            .unwrap_or_else(|e| panic!("{}: SPIR-V: {e}", spec.label));
        let mut msl = String::new();
        naga::back::msl::Writer::new(&mut msl)
            .write(&module, &info, &Default::default(), &Default::default())
            .unwrap_or_else(|e| panic!("{}: MSL: {e}", spec.label));
        let mut hlsl = String::new();
        let hopts = naga::back::hlsl::Options::default();
        naga::back::hlsl::Writer::new(&mut hlsl, &hopts, &Default::default())
            .write(&module, &info, None)
            .unwrap_or_else(|e| panic!("{}: HLSL: {e}", spec.label));
        checked += 1;
    }
    // k 1 and 40: two stages each (5000 → 3 chunks), pairs + packed final; and the lse.
    assert!(checked >= 5, "{checked} variants compiled");
}

/// A prompt longer than one pass (split into chunks): the top logits come from its last
/// token, as the full logits do.
#[test]
fn long_prompt_top() {
    for model in ["qwen35-tiny", "dsv4-tiny"] {
        let mut e = load(model);
        let toks: Vec<u32> = (0..300).map(|i| (i * 37 % 500) as u32).collect();
        let mut a = e.new_seq().unwrap();
        let mut b = e.new_seq().unwrap();
        let full = e.forward(&mut a, &toks, false).unwrap();
        let top = e.forward_top(&mut b, &toks, 10, true).unwrap();
        assert_top_eq(model, &top, &cpu_top(&full, 10));
        assert_eq!(a.pos(), b.pos());
    }
}

/// After `Engine::warm_up(n, rows)` (as `lathe serve --parallel n` runs it), what such a
/// server's steps take (prompt passes of `rows` tokens and fewer, batched decode steps of 1
/// to n sequences, one of them wanting full logits) compiles no pipeline of its own, so its
/// first requests wait for none; with fused loads (one stream) and without (serve's default
/// for several).
#[test]
fn warm_up_compiles_what_server_steps_take() {
    for (model, fused_loads) in [
        ("qwen35-tiny", true),
        ("qwen35-tiny", false),
        ("dsv4-tiny", false),
    ] {
        let path = common::fixtures().join(model).join("model-f32.gguf");
        let opts = LoadOptions {
            max_seqs: 12,
            fused_loads,
            ..LoadOptions::default()
        };
        let mut e = Engine::load(&path, &opts).unwrap();
        e.warm_up(12, 30).unwrap();
        let before: Vec<String> = e
            .gpu
            .compiled_specs()
            .into_iter()
            .map(|s| s.label)
            .collect();
        let n_before = before.len();
        let p = prompt(model);
        let long: Vec<u32> = p.iter().copied().cycle().take(30).collect();
        let mut seqs: Vec<_> = (0..12).map(|_| e.new_seq().unwrap()).collect();
        e.forward(&mut seqs[0], &long, false).unwrap();
        e.forward(&mut seqs[1], &p, false).unwrap();
        let want = Want::Top { k: 40, lse: true };
        for n in 1..=12usize {
            let toks: Vec<u32> = (0..n as u32).map(|i| 5 + 3 * i).collect();
            // full logits (penalties, logit_bias) for one sequence of each step
            let mut items: Vec<_> = seqs
                .iter_mut()
                .zip(&toks)
                .enumerate()
                .map(|(i, (s, t))| {
                    let w = if i == 1 { Want::Last } else { want };
                    (s, std::slice::from_ref(t), w)
                })
                .collect();
            e.forward_batch_with(&mut items).unwrap();
        }
        let after = e.gpu.compiled_specs();
        let n_after = after.len();
        let new: Vec<String> = after
            .into_iter()
            .map(|s| s.label)
            .filter(|l| !before.contains(l))
            .collect();
        assert!(
            new.is_empty() && n_after == n_before,
            "{model}, fused loads {fused_loads}: compiled after the warm-up: {new:?}"
        );
    }
}
