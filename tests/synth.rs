//! `lathe synth` and `lathe bench`.
//!
//! The plans are checked against llama.cpp's own files: built with the fixture models'
//! dimensions, a plan must name, shape, type and order every tensor, and write every
//! metadata key, exactly as `convert_hf_to_gguf.py` and `llama-quantize` did for the
//! fixtures (tests/fixtures/models; the bigger `*-dims` files from ../shared when present).
//! The demo model is written, inspected, run on the GPU (lavapipe here) and benchmarked.

use lathe::engine::{Engine, LoadOptions};
use lathe::gguf::{GgufFile, Value};
use lathe::synth::{
    self, Dims, DsDims, FileType, GemmaDims, LlamaDims, PlanOptions, Preset, QwenDims, QwenMoe,
    StepDims, Yarn,
};
use lathe::DType;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str, file: &str) -> PathBuf {
    root().join("tests/fixtures/models").join(name).join(file)
}

/// `../shared/fixtures/models/<name>/<file>`; the test fails when this machine lacks it.
fn shared(name: &str, file: &str) -> PathBuf {
    let p = root()
        .join("../shared/fixtures/models")
        .join(name)
        .join(file);
    assert!(
        p.is_file(),
        "{} is absent: this test needs ../shared/fixtures (CI has it)",
        p.display()
    );
    p
}

fn tmp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lathe-synth-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn preset(name: &str, display: &str, dims: Dims) -> Preset {
    Preset {
        name: name.into(),
        display: display.into(),
        dims,
        default_type: FileType::Q4_K_M,
        demo: false,
    }
}

/// `qwen35-tiny` of the fixtures: hidden 64, attention every second layer, heads of 16.
fn qwen35_tiny() -> Preset {
    preset(
        "qwen35-tiny",
        "Qwen35 Tiny",
        Dims::Qwen35(QwenDims {
            n_embd: 64,
            n_layer: 4,
            n_ff: 128,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 16,
            rope_dim: 4,
            n_k_heads: 2,
            n_v_heads: 4,
            d_k: 16,
            d_v: 16,
            conv_kernel: 4,
            full_attention_interval: 2,
            n_vocab: 512,
            tied: false,
            ctx: 4096,
            rope_theta: 1e7,
            eps: 1e-6,
            moe: None,
        }),
    )
}

/// `qwen35-dims`: the real head sizes (4 q / 1 kv × 256, GDN 2 k / 4 v × 128).
fn qwen35_dims() -> Preset {
    preset(
        "qwen35-dims",
        "Qwen35 Dims",
        Dims::Qwen35(QwenDims {
            n_embd: 256,
            n_layer: 4,
            n_ff: 512,
            n_head: 4,
            n_head_kv: 1,
            head_dim: 256,
            rope_dim: 64,
            n_k_heads: 2,
            n_v_heads: 4,
            d_k: 128,
            d_v: 128,
            conv_kernel: 4,
            full_attention_interval: 4,
            n_vocab: 1024,
            tied: false,
            ctx: 4096,
            rope_theta: 1e7,
            eps: 1e-6,
            moe: None,
        }),
    )
}

/// `qwen35moe-dims`: 16 experts × 256, top-4, shared expert 256.
fn qwen35moe_dims() -> Preset {
    let Dims::Qwen35(mut d) = qwen35_dims().dims else {
        unreachable!()
    };
    d.n_layer = 2;
    d.n_head = 2;
    d.full_attention_interval = 2;
    d.moe = Some(QwenMoe {
        n_expert: 16,
        n_used: 4,
        n_ff_exp: 256,
        n_ff_shexp: 256,
    });
    preset("qwen35moe-dims", "Qwen35Moe Dims", Dims::Qwen35(d))
}

/// `dsv4-tiny`: hidden 64, 4 heads × 32, ratios 0 / 4 / 128 / 4, one hash layer.
fn dsv4_tiny() -> Preset {
    preset(
        "dsv4-tiny",
        "Upstream",
        Dims::Deepseek4(DsDims {
            n_embd: 64,
            n_layer: 4,
            n_head: 4,
            head_dim: 32,
            rope_dim: 8,
            q_lora: 32,
            o_groups: 2,
            o_lora: 16,
            n_expert: 8,
            n_used: 2,
            n_ff_exp: 32,
            n_shared: 1,
            window: 8,
            ix_heads: 8,
            ix_dim: 16,
            ix_top_k: 2,
            compress_ratios: vec![0, 4, 128, 4],
            n_hash: 1,
            hc: 4,
            sinkhorn_iters: 20,
            hc_eps: 1e-6,
            n_vocab: 512,
            ctx: 1_048_576,
            rope_theta: 10_000.0,
            compress_rope_theta: 160_000.0,
            yarn: None,
            eps: 1e-6,
            route_scale: 1.5,
            swiglu_limit: 10.0,
        }),
    )
}

/// `dsv4-dims`: 2 heads × 512, indexer 16 × 128, YaRN on the compressed layers.
fn dsv4_dims() -> Preset {
    let Dims::Deepseek4(t) = dsv4_tiny().dims else {
        unreachable!()
    };
    preset(
        "dsv4-dims",
        "Upstream",
        Dims::Deepseek4(DsDims {
            n_embd: 256,
            n_head: 2,
            head_dim: 512,
            rope_dim: 64,
            q_lora: 128,
            o_lora: 64,
            n_expert: 16,
            n_used: 4,
            n_ff_exp: 128,
            window: 128,
            ix_heads: 16,
            ix_dim: 128,
            ix_top_k: 16,
            n_hash: 2,
            n_vocab: 1024,
            yarn: Some(Yarn {
                factor: 16.0,
                orig_ctx: 65_536,
                beta_fast: 32.0,
                beta_slow: 1.0,
            }),
            ..t
        }),
    )
}

fn plan_of(p: &Preset, ftype: FileType, base: DType) -> synth::Plan {
    let opts = PlanOptions {
        ftype: Some(ftype),
        base,
        ..Default::default()
    };
    synth::plan(p, &opts, None).unwrap()
}

/// The plan against a file llama.cpp wrote: every key with its value in order, every
/// tensor with its type and shape in order.
fn assert_same_layout(plan: &synth::Plan, file: &Path) {
    let g = GgufFile::open(file).unwrap();
    let want: Vec<(&str, &Value)> = g.metadata().iter().map(|(k, v)| (k.as_str(), v)).collect();
    let got: Vec<(&str, &Value)> = plan.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let want_keys: Vec<&str> = want.iter().map(|(k, _)| *k).collect();
    let got_keys: Vec<&str> = got.iter().map(|(k, _)| *k).collect();
    assert_eq!(got_keys, want_keys, "{}: metadata keys", file.display());
    for ((k, a), (_, b)) in got.iter().zip(&want) {
        assert_eq!(a, b, "{}: key {k}", file.display());
    }
    let want: Vec<(String, DType, Vec<u64>)> = g
        .tensors()
        .map(|t| (t.name.to_string(), t.dtype, t.shape.to_vec()))
        .collect();
    let got: Vec<(String, DType, Vec<u64>)> = plan
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
        .collect();
    assert_eq!(got.len(), want.len(), "{}: tensor count", file.display());
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(a, b, "{}: tensor", file.display());
    }
    assert_eq!(plan.data_bytes(), g.data_bytes(), "{}", file.display());
}

#[test]
fn qwen35_plans_match_llama_cpps_files() {
    let p = qwen35_tiny();
    for (ft, file) in [
        (FileType::F32, "model-f32.gguf"),
        (FileType::Q8_0, "model-q8_0.gguf"),
        (FileType::Q4_0, "model-q4_0.gguf"),
    ] {
        assert_same_layout(&plan_of(&p, ft, DType::F32), &fixture("qwen35-tiny", file));
    }
    // Q4_K_M: Q6_K for the output head and, by use_more_bits, attn_qkv/attn_v and ffn_down
    // of the last two of four layers.
    let dims = plan_of(&qwen35_dims(), FileType::Q4_K_M, DType::BF16);
    assert_same_layout(&dims, &fixture("qwen35-dims", "model-q4_k_m.gguf"));
    let moe = plan_of(&qwen35moe_dims(), FileType::Q4_K_M, DType::BF16);
    assert_same_layout(&moe, &fixture("qwen35moe-dims", "model-q4_k_m.gguf"));
    for (p, name) in [
        (qwen35_dims(), "qwen35-dims"),
        (qwen35moe_dims(), "qwen35moe-dims"),
    ] {
        for (ft, file) in [
            (FileType::BF16, "model-bf16.gguf"),
            (FileType::Q8_0, "model-q8_0.gguf"),
        ] {
            assert_same_layout(&plan_of(&p, ft, DType::BF16), &shared(name, file));
        }
    }
}

/// `qwen3-tiny` / `qwen3moe-tiny` of `tests/oracle/make_llama_family.py`: hidden 64, 2
/// layers, 4 q / 2 kv heads (of 32 and 16), vocabulary 256.
fn qwen3_tiny(moe: bool) -> Preset {
    let d = LlamaDims {
        arch: if moe { "qwen3moe" } else { "qwen3" },
        n_embd: 64,
        n_layer: 2,
        n_ff: 64,
        n_head: 4,
        n_head_kv: 2,
        head_dim: if moe { 16 } else { 32 },
        qk_norm: true,
        n_vocab: 256,
        tied: !moe,
        ctx: 4096,
        rope_theta: 1e6,
        eps: 1e-6,
        moe: moe.then_some(QwenMoe {
            n_expert: 8,
            n_used: 2,
            n_ff_exp: 32,
            n_ff_shexp: 0,
        }),
    };
    // `general.name` as the converter writes it from the directory name.
    let display = if moe { "Qwen3Moe Tiny" } else { "Qwen3 Tiny" };
    preset("qwen3-tiny", display, Dims::Llama(d))
}

#[test]
fn qwen3_plans_match_llama_cpps_files() {
    for (moe, name) in [(false, "qwen3-tiny"), (true, "qwen3moe-tiny")] {
        let plan = plan_of(&qwen3_tiny(moe), FileType::F32, DType::F32);
        assert_same_layout(&plan, &fixture(name, "model-f32.gguf"));
    }
}

/// The release presets of the plain transformer family plan with their released shapes and
/// a shortened file of each loads and runs (finite logits of order one).
#[test]
fn llama_family_presets_plan_and_run() {
    let gb = |name: &str| {
        synth::plan(&synth::preset(name).unwrap(), &PlanOptions::default(), None)
            .unwrap()
            .data_bytes() as f64
            / 1e9
    };
    // llama.cpp's Q4_K_M files of the releases: Qwen3-8B 5.0 GB, Llama-3.1-8B 4.9 GB,
    // Qwen3-30B-A3B 18.6 GB.
    for (name, lo, hi) in [
        ("qwen3-8b", 4.5, 5.5),
        ("llama-3.1-8b", 4.4, 5.4),
        ("qwen3-30b-a3b", 17.0, 20.0),
    ] {
        let g = gb(name);
        assert!((lo..hi).contains(&g), "{name}: {g} GB");
    }
    // Each preset at lavapipe scale (its architecture, norms, head tying and routing kept):
    // hidden 256, 2 layers, heads of 64, 16 experts.
    let dir = tmp_dir("llama");
    for name in ["qwen3-8b", "llama-3.1-8b", "qwen3-30b-a3b"] {
        let mut p = synth::preset(name).unwrap();
        let Dims::Llama(d) = &mut p.dims else {
            panic!("{name}: not a Llama-family preset")
        };
        (
            d.n_embd,
            d.n_layer,
            d.n_ff,
            d.n_head,
            d.n_head_kv,
            d.head_dim,
        ) = (256, 2, 512, 4, 2, 64);
        if let Some(m) = &mut d.moe {
            (m.n_expert, m.n_used, m.n_ff_exp) = (16, 4, 128);
        }
        let opts = PlanOptions {
            ftype: Some(FileType::Q8_0),
            n_vocab: Some(512),
            skew: 4.0,
            ..Default::default()
        };
        let path = dir.join(format!("{name}.gguf"));
        synth::plan(&p, &opts, None)
            .unwrap()
            .write(&path, 3, None)
            .unwrap();
        check_forward(&path);
        std::fs::remove_file(&path).ok();
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn deepseek4_plans_match_llama_cpps_files() {
    let p = dsv4_tiny();
    assert_same_layout(
        &plan_of(&p, FileType::F32, DType::F32),
        &fixture("dsv4-tiny", "model-f32.gguf"),
    );
    assert_same_layout(
        &plan_of(&p, FileType::Q8_0, DType::F32),
        &fixture("dsv4-tiny", "model-q8_0.gguf"),
    );
    let p = dsv4_dims();
    for (ft, file) in [
        (FileType::BF16, "model-bf16.gguf"),
        (FileType::Q8_0, "model-q8_0.gguf"),
        (FileType::Q4_K_M, "model-q4_k_m.gguf"),
    ] {
        assert_same_layout(&plan_of(&p, ft, DType::BF16), &shared("dsv4-dims", file));
    }
}

#[test]
fn release_presets_have_the_released_sizes() {
    let gb = |name: &str, layers: Option<usize>| {
        let opts = PlanOptions {
            n_layer: layers,
            ..Default::default()
        };
        synth::plan(&synth::preset(name).unwrap(), &opts, None)
            .unwrap()
            .data_bytes() as f64
            / 1e9
    };
    // llama.cpp's Q4_K_M files: 9B 5.7 GB, 35B-A3B 21 GB; llama.cpp's quantize: DeepSeek-V4-Flash cut to
    // 8 layers (Q8_0 + MXFP4 experts) 27.7 GiB.
    let nine = gb("qwen3.5-9b", None);
    assert!((5.0..6.5).contains(&nine), "9B: {nine} GB");
    let moe = gb("qwen3.5-35b-a3b", None);
    assert!((19.0..23.0).contains(&moe), "35B-A3B: {moe} GB");
    let ds = gb("deepseek-v4-flash", Some(8)) * 1e9 / (1u64 << 30) as f64;
    assert!((ds - 27.7).abs() < 0.8, "V4-Flash 8 layers: {ds} GiB");
    // The small releases tie the head to the embedding, which then gets the head's Q6_K.
    let small = synth::plan(
        &synth::preset("qwen3.5-0.8b").unwrap(),
        &PlanOptions::default(),
        None,
    )
    .unwrap();
    assert!(small.tensor("output.weight").is_none());
    assert_eq!(
        small.tensor("token_embd.weight").unwrap().dtype,
        DType::Q6_K
    );
}

/// Qwen's own vocabulary: 248,070 ids padded to the 248,320 embedding rows with llama.cpp's
/// `[PAD<id>]` tokens, `qwen35` pre-tokenizer, `<|im_end|>` as EOS (plan only: the file
/// would be hundreds of MB).
#[test]
fn qwen_vocabulary_pads_to_the_embedding() {
    let v = synth::Vocab::load(&root().join("tests/fixtures/tokenizer/qwen36/tokenizer.json.gz"))
        .unwrap();
    assert_eq!(v.len(), 248_070);
    let plan = synth::plan(
        &synth::preset("qwen3.5-0.8b").unwrap(),
        &PlanOptions::default(),
        Some(&v),
    )
    .unwrap();
    assert_eq!(plan.n_vocab, 248_320);
    assert_eq!(
        plan.tensor("token_embd.weight").unwrap().shape,
        [248_320, 1024]
    );
    let str_of = |k: &str| plan.get(k).and_then(Value::as_str).unwrap().to_string();
    assert_eq!(str_of("tokenizer.ggml.model"), "gpt2");
    assert_eq!(str_of("tokenizer.ggml.pre"), "qwen35");
    let tokens = plan
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .unwrap();
    let types = plan
        .get("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .unwrap();
    assert_eq!((tokens.len(), types.len()), (248_320, 248_320));
    assert_eq!(tokens[248_319].as_str(), Some("[PAD248319]"));
    assert_eq!(types[248_319].as_i64(), Some(5));
    assert_eq!(
        types[248_045].as_i64(),
        Some(3),
        "<|im_start|> is a control token"
    );
    let eos = plan
        .get("tokenizer.ggml.eos_token_id")
        .and_then(Value::as_u64)
        .unwrap() as usize;
    assert_eq!(tokens[eos].as_str(), Some("<|im_end|>"));
    assert!(plan.get("qwen35.vocab_size").is_none());
}

/// `--layers 2` of the 9B: the full width, two GDN layers, consistent keys (the file would
/// be 1.7 GB with the real vocabulary, so only the plan is checked).
#[test]
fn shortened_9b_plan_is_consistent() {
    let opts = PlanOptions {
        n_layer: Some(2),
        ..Default::default()
    };
    let plan = synth::plan(&synth::preset("qwen3.5-9b").unwrap(), &opts, None).unwrap();
    let u = |k: &str| plan.get(k).and_then(Value::as_u64).unwrap();
    assert_eq!(u("qwen35.block_count"), 2);
    assert_eq!(u("qwen35.embedding_length"), 4096);
    assert_eq!(u("qwen35.feed_forward_length"), 12288);
    assert_eq!(u("qwen35.vocab_size"), 248_320);
    assert_eq!(u("general.file_type"), 15);
    assert_eq!(
        plan.get("qwen35.attention.recurrent_layers")
            .and_then(Value::as_array)
            .map(<[Value]>::len),
        Some(2)
    );
    // 2 globals + output_norm + 14 tensors per GDN layer.
    assert_eq!(plan.tensors.len(), 3 + 2 * 14);
    for t in &plan.tensors {
        if let Some(rest) = t.name.strip_prefix("blk.") {
            assert!(
                rest.starts_with("0.") || rest.starts_with("1."),
                "{}",
                t.name
            );
        }
    }
    let t = |n: &str| plan.tensor(n).unwrap();
    assert_eq!(
        (t("output.weight").dtype, &t("output.weight").shape[..]),
        (DType::Q6_K, &[248_320, 4096][..])
    );
    assert_eq!(t("token_embd.weight").dtype, DType::Q4_K);
    // GDN: 16 key heads and 32 value heads of 128: q, k, v rows 2048 + 2048 + 4096.
    assert_eq!(t("blk.0.attn_qkv.weight").shape, [8192, 4096]);
    assert_eq!(t("blk.0.ssm_conv1d.weight").shape, [8192, 4]);
    assert_eq!(t("blk.0.ssm_out.weight").shape, [4096, 4096]);
    assert_eq!(t("blk.1.ssm_a").shape, [32]);
    // use_more_bits over 2 layers picks layer 1 only.
    assert_eq!(t("blk.0.ffn_down.weight").dtype, DType::Q4_K);
    assert_eq!(t("blk.1.ffn_down.weight").dtype, DType::Q6_K);
    assert_eq!(t("blk.1.attn_qkv.weight").dtype, DType::Q6_K);
    assert_eq!(t("blk.0.ssm_conv1d.weight").dtype, DType::F32);
    // The embedding (Q4_K) and output head (Q6_K) of 248,320 rows are 1.4 GB alone.
    let gb = plan.data_bytes() as f64 / 1e9;
    assert!((1.5..1.9).contains(&gb), "{gb} GB");
}

fn lathe() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lathe"))
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn synth_demo(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let out = dir.join(name);
    let mut c = lathe();
    c.args(["synth", "--preset", "demo", "-o"])
        .arg(&out)
        .args(extra);
    run_ok(&mut c);
    out
}

/// Logits of a short prefill and two decode steps: finite and not all alike.
fn check_forward(path: &Path) {
    let mut e = Engine::load(path, &LoadOptions::default()).unwrap();
    let v = e.vocab_size();
    let mut seq = e.new_seq().unwrap();
    let mut rows = e.forward(&mut seq, &[1, 2, 3, 4, 5], true).unwrap();
    assert_eq!(rows.len(), 5 * v);
    for t in [7u32, 11] {
        rows.extend(e.forward(&mut seq, &[t], false).unwrap());
    }
    assert!(rows.iter().all(|x| x.is_finite()), "{}", path.display());
    for row in rows.chunks(v) {
        let mean = row.iter().sum::<f32>() / v as f32;
        let sd = (row.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v as f32).sqrt();
        // Unit-variance weights give logits of order one.
        assert!(sd > 0.05 && sd < 50.0, "{}: logit sd {sd}", path.display());
    }
}

/// The MoE and DeepSeek-V4 layouts run too (dims-sized plans, skewed routers): finite logits
/// of order one.
#[test]
fn moe_and_deepseek4_synthetic_models_run() {
    let dir = tmp_dir("run");
    for (p, ftype, name) in [
        (qwen35moe_dims(), FileType::Q4_K_M, "moe.gguf"),
        (dsv4_dims(), FileType::Q8_0, "dsv4.gguf"),
    ] {
        let opts = PlanOptions {
            ftype: Some(ftype),
            skew: 4.0,
            ..Default::default()
        };
        let path = dir.join(name);
        synth::plan(&p, &opts, None)
            .unwrap()
            .write(&path, 3, None)
            .unwrap();
        check_forward(&path);
        std::fs::remove_file(&path).ok();
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn demo_model_loads_runs_and_benches() {
    let dir = tmp_dir("demo");
    // The default type (Q4_K_M) with the real Qwen vocabulary.
    let q4 = synth_demo(&dir, "demo-q4_k_m.gguf", &["--json"]);
    let plan = synth::plan(
        &synth::preset("demo").unwrap(),
        &PlanOptions::default(),
        None,
    )
    .unwrap();
    let g = GgufFile::open(&q4).unwrap();
    assert_eq!(g.n_tensors(), plan.tensors.len());
    for (t, p) in g.tensors().zip(&plan.tensors) {
        assert_eq!(
            (t.name, t.dtype, t.shape),
            (p.name.as_str(), p.dtype, &p.shape[..])
        );
    }
    drop(g);
    let report = run_ok(lathe().arg("inspect").arg(&q4));
    assert!(report.contains("qwen35"), "{report}");
    check_forward(&q4);
    for ty in ["q8_0", "bf16"] {
        let f = synth_demo(
            &dir,
            &format!("demo-{ty}.gguf"),
            &["--type", ty, "--vocab", "4096"],
        );
        run_ok(lathe().arg("inspect").arg(&f));
        check_forward(&f);
    }

    let out = run_ok(
        lathe()
            .args(["bench", "-p", "8", "-n", "4", "-r", "1", "--json", "-m"])
            .arg(&q4),
    );
    let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(j["model"].as_str(), Some(q4.to_str().unwrap()));
    assert_eq!(j["bytes"].as_u64(), Some(plan.data_bytes()));
    for (test, n) in [("prefill", 8), ("decode", 4)] {
        assert_eq!(j[test]["tokens"].as_u64(), Some(n), "{out}");
        assert!(j[test]["tok_s"].as_f64().unwrap() > 0.0, "{out}");
        assert!(j[test]["sd"].as_f64().unwrap() >= 0.0, "{out}");
    }
    let bpt = j["bytes_per_token"].as_u64().unwrap();
    assert!(bpt > 0 && bpt < plan.data_bytes(), "{out}");
    let bw = j["bandwidth_gbs"].as_f64().unwrap();
    let roof = j["roofline_fraction"].as_f64().unwrap();
    let want = j["decode"]["tok_s"].as_f64().unwrap() * bpt as f64 / (bw * 1e9);
    assert!(
        bw > 0.0 && (roof - want).abs() <= 1e-9 * want.max(1.0),
        "{out}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn tokenizer_makes_a_chat_model() {
    let dir = tmp_dir("tok");
    let gz = root().join("assets/deepseek-v4-tokenizer.json.gz");
    let json = root().join("tests/fixtures/tokenizer/deepseek-v4/tokenizer.json");
    // The shipped copy is the fixture, compressed.
    let mut raw = Vec::new();
    std::io::Read::read_to_end(
        &mut flate2::read::GzDecoder::new(std::fs::File::open(&gz).unwrap()),
        &mut raw,
    )
    .unwrap();
    assert_eq!(raw, std::fs::read(&json).unwrap());

    let f = synth_demo(
        &dir,
        "chat.gguf",
        &["--tokenizer", gz.to_str().unwrap(), "--type", "q8_0"],
    );
    let g = GgufFile::open(&f).unwrap();
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), "deepseek-v3");
    // DeepSeek's vocabulary gets DeepSeek-V4's template: ChatML's `<|im_start|>` is no token
    // in it.
    assert_eq!(
        g.get_str("tokenizer.chat_template").unwrap(),
        lathe::tokenizer::builtin_template("deepseek-v4")
            .unwrap()
            .source
    );
    // The demo's vocabulary follows the tokenizer: 128,000 BPE tokens + 1,280 added.
    assert_eq!(
        g.require("token_embd.weight").unwrap().shape,
        [129_280, 256]
    );
    assert!(g.get("qwen35.vocab_size").is_none());
    let from_gguf = lathe::tokenizer::Tokenizer::from_gguf(&g).unwrap();
    let from_json = lathe::tokenizer::Tokenizer::from_file(&json).unwrap();
    for text in [
        "Hello, world!",
        "数字 12345 and émigré\n\ttabs",
        "<｜begin▁of▁sentence｜>hi",
    ] {
        assert_eq!(
            from_gguf.encode(text, true).unwrap(),
            from_json.encode(text, true).unwrap(),
            "{text}"
        );
    }
    assert_eq!(from_gguf.bos_id(), from_json.bos_id());
    assert_eq!(from_gguf.eos_id(), from_json.eos_id());

    // The demo's prompt, as `run --chat` and `serve` build it: its markers are the
    // vocabulary's special tokens, one id each, and the tools are in it.
    let mut chat = lathe::generate::ChatPrompt::for_tokenizer(&from_gguf).unwrap();
    assert!(!chat.fallback);
    let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    chat.vars.insert("tools".into(), tools);
    let messages = serde_json::json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
    ]);
    let (ids, _) = chat.encode(&from_gguf, &messages).unwrap();
    let id = |text: &str| {
        let v = from_gguf.encode(text, true).unwrap();
        assert_eq!(v.len(), 1, "{text} is not one token: {v:?}");
        v[0]
    };
    let count = |t: u32| ids.iter().filter(|&&i| i == t).count();
    assert_eq!(ids[0], 0, "BOS <｜begin▁of▁sentence｜> first");
    assert_eq!(count(0), 1);
    assert_eq!(count(id("<｜User｜>")), 2);
    assert_eq!(count(id("<｜Assistant｜>")), 2);
    assert_eq!(count(id("</think>")), 2);
    assert_eq!(count(id("<｜end▁of▁sentence｜>")), 1);
    // <｜DSML｜tool_calls>, <｜DSML｜invoke, <｜DSML｜parameter and their closers.
    assert!(count(id("｜DSML｜")) >= 6, "{ids:?}");
    assert_eq!(*ids.last().unwrap(), id("</think>"));
    let text = from_gguf.decode(&ids);
    assert!(text.contains("\"name\": \"get_weather\""), "{text}");
    assert!(!text.contains("<|im_start|>"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn same_seed_same_bytes_and_skew_favours_a_few_experts() {
    let dir = tmp_dir("seed");
    let p = qwen35moe_dims();
    let write = |name: &str, seed: u64, skew: f32| {
        let opts = PlanOptions {
            ftype: Some(FileType::Q4_K_M),
            skew,
            ..Default::default()
        };
        let path = dir.join(name);
        synth::plan(&p, &opts, None)
            .unwrap()
            .write(&path, seed, None)
            .unwrap();
        path
    };
    let a = std::fs::read(write("a.gguf", 1, 0.0)).unwrap();
    let b = std::fs::read(write("b.gguf", 1, 0.0)).unwrap();
    let c = std::fs::read(write("c.gguf", 2, 0.0)).unwrap();
    assert!(a == b, "same seed, different bytes");
    assert!(a != c, "different seeds, same bytes");

    // Router row norms: equal in distribution without skew, a few far larger with it.
    let norms = |path: &Path| -> Vec<f32> {
        let g = GgufFile::open(path).unwrap();
        let t = g.require("blk.0.ffn_gate_inp.weight").unwrap();
        assert_eq!(t.dtype, DType::F32);
        let w: Vec<f32> = t
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        w.chunks(256)
            .map(|r| r.iter().map(|x| x * x).sum::<f32>().sqrt())
            .collect()
    };
    let ratio = |n: Vec<f32>| {
        let max = n.iter().cloned().fold(0.0, f32::max);
        let min = n.iter().cloned().fold(f32::INFINITY, f32::min);
        max / min
    };
    // Gains 1 + 8·e^(−rank/4) over 16 experts: 9 for the first, 1.19 for the last.
    let flat = ratio(norms(&dir.join("a.gguf")));
    let skewed = ratio(norms(&write("s.gguf", 1, 8.0)));
    assert!(flat < 1.5, "no skew: max/min row norm {flat}");
    assert!(skewed > 5.0, "skew 8: max/min row norm {skewed}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_arguments_fail_with_one_line() {
    let dir = tmp_dir("bad");
    let out = dir.join("x.gguf");
    for args in [
        &["--preset", "qwen9"][..],
        &["--preset", "demo", "--layers", "9"][..],
        &["--preset", "demo", "--type", "q3_k_xl"][..],
        &[
            "--preset",
            "demo",
            "--tokenizer",
            "/nonexistent/tokenizer.json",
        ][..],
    ] {
        let r = lathe()
            .arg("synth")
            .args(args)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        assert!(!r.status.success(), "{args:?}");
        assert!(
            matches!(r.status.code(), Some(1 | 2)),
            "{args:?}: {:?}",
            r.status
        );
        assert!(!out.exists(), "{args:?} left a file");
    }
    // A model lathe cannot run yet fails cleanly in bench too.
    let r = lathe()
        .args(["bench", "-m", "/nonexistent.gguf", "-p", "8", "-n", "4"])
        .output()
        .unwrap();
    assert_eq!(r.status.code(), Some(1));
    std::fs::remove_dir_all(&dir).ok();
}

/// `step37-tiny` of `tests/oracle/make_step37.py`: hidden 64, 5 layers (full, sliding,
/// sliding, full, sliding: 2 or 3 heads of 16 over 1 KV head), 2 dense, 4 experts top-2,
/// SwiGLU clamps on blocks 1, 3 and 4.
fn step37_tiny() -> Preset {
    let d = StepDims {
        n_embd: 64,
        n_layer: 5,
        n_ff: 64,
        n_head: 2,
        n_head_swa: 3,
        n_head_kv: 1,
        head_dim: 16,
        swa: vec![false, true, true, false, true],
        window: 8,
        n_dense: 2,
        n_vocab: 256,
        ctx: 4096,
        rope_theta: 5e6,
        rope_theta_swa: 1e4,
        rope_freqs: true,
        eps: 1e-5,
        moe: QwenMoe {
            n_expert: 4,
            n_used: 2,
            n_ff_exp: 16,
            n_ff_shexp: 16,
        },
        route_scale: 3.0,
        clamp_exp: vec![0.0, 0.0, 0.0, 0.6, 0.6],
        clamp_shexp: vec![0.0, 0.5, 0.0, 0.0, 0.5],
    };
    preset("step37-tiny", "Step37 Tiny", Dims::Step(d))
}

#[test]
fn step37_plans_match_llama_cpps_files() {
    for (ft, file) in [
        (FileType::F32, "model-f32.gguf"),
        (FileType::Q8_0, "model-q8_0.gguf"),
    ] {
        let plan = plan_of(&step37_tiny(), ft, DType::F32);
        assert_same_layout(&plan, &fixture("step37-tiny", file));
    }
}

/// The release preset plans at Step-3.7-Flash's size (196B text parameters, 11B active:
/// the model card's numbers less the 1.8B vision tower), and a shortened, narrowed file of it
/// (its per-layer geometry, dense-then-MoE layout and routing kept) loads and runs.
#[test]
fn step37_preset_plans_and_runs() {
    let p = synth::preset("step-3.7-flash").unwrap();
    let plan = synth::plan(&p, &PlanOptions::default(), None).unwrap();
    let params: u64 = plan.tensors.iter().map(|t| t.n_elements()).sum();
    assert!(
        (190e9..200e9).contains(&(params as f64)),
        "{params} parameters"
    );
    assert_eq!(
        plan.get("step35.attention.head_count"),
        Some(&Value::Array(
            (0..45)
                .map(|l| Value::I32(if l % 4 == 0 { 64 } else { 96 }))
                .collect()
        ))
    );
    let mut p = p;
    let Dims::Step(d) = &mut p.dims else {
        panic!("step-3.7-flash: not a Step preset")
    };
    (
        d.n_embd,
        d.n_ff,
        d.n_head,
        d.n_head_swa,
        d.n_head_kv,
        d.head_dim,
    ) = (256, 512, 2, 3, 1, 64);
    (
        d.moe.n_expert,
        d.moe.n_used,
        d.moe.n_ff_exp,
        d.moe.n_ff_shexp,
    ) = (16, 4, 64, 64);
    let opts = PlanOptions {
        ftype: Some(FileType::Q8_0),
        n_layer: Some(5),
        n_vocab: Some(512),
        skew: 4.0,
        ..Default::default()
    };
    let dir = tmp_dir("step37");
    let path = dir.join("step37.gguf");
    synth::plan(&p, &opts, None)
        .unwrap()
        .write(&path, 3, None)
        .unwrap();
    check_forward(&path);
    std::fs::remove_dir_all(&dir).ok();
}

/// `gemma4-tiny` and `gemma4moe-tiny` of `tests/oracle/make_gemma4.py`: hidden 64, 2 heads,
/// 1 KV head, sliding heads of 32 and global heads of 64 (a quarter of them rotating),
/// window 8, V from K on global layers; the MoE one with 4 experts top-2 of 32.
fn gemma4_tiny(swa: Vec<bool>, n_ff: usize, n_vocab: usize, moe: Option<QwenMoe>) -> GemmaDims {
    GemmaDims {
        n_embd: 64,
        n_layer: swa.len(),
        n_ff,
        n_head: 2,
        n_head_kv: 1,
        n_head_kv_global: 1,
        head_dim_swa: 32,
        head_dim: 64,
        swa,
        window: 8,
        n_vocab,
        ctx: 4096,
        rope_theta: 1e6,
        rope_theta_swa: 1e4,
        rope_frac: 0.25,
        eps: 1e-6,
        softcap: 30.0,
        k_eq_v: true,
        moe,
        n_epl: 0,
        n_kv_shared: 0,
        double_wide: false,
    }
}

#[test]
fn gemma4_plans_match_llama_cpps_files() {
    let dense = gemma4_tiny(vec![true, true, false, true, false], 128, 512, None);
    let moe = gemma4_tiny(
        vec![true, false, false],
        64,
        256,
        Some(QwenMoe {
            n_expert: 4,
            n_used: 2,
            n_ff_exp: 32,
            n_ff_shexp: 0,
        }),
    );
    // `gemma4e-tiny`: per-layer embeddings of 16, the last 3 of 6 blocks KV-shared with a
    // double-wide FFN, global layers with their own V.
    let e4b = GemmaDims {
        n_epl: 16,
        n_kv_shared: 3,
        double_wide: true,
        k_eq_v: false,
        ..gemma4_tiny(vec![true, true, false, true, true, false], 64, 256, None)
    };
    for (name, display, dims) in [
        ("gemma4-tiny", "Gemma4 Tiny", dense),
        ("gemma4moe-tiny", "Gemma4Moe Tiny", moe),
        ("gemma4e-tiny", "Gemma4E Tiny", e4b),
    ] {
        let p = preset(name, display, Dims::Gemma(dims));
        for (ft, file) in [
            (FileType::F32, "model-f32.gguf"),
            (FileType::Q8_0, "model-q8_0.gguf"),
        ] {
            assert_same_layout(&plan_of(&p, ft, DType::F32), &fixture(name, file));
        }
    }
}

/// The release presets plan at their sizes (the model cards: 30.7B for the 31B; 25.2B in
/// all and 3.8B active for the 26B-A4B, vision towers excluded, which are not in these
/// text-only files), with the global layers' own KV head counts as an array; shortened,
/// narrowed files of both (sliding and global layers, MoE routing kept) load and run.
#[test]
fn gemma4_presets_plan_and_run() {
    for (name, lo, hi) in [
        ("gemma-4-31b", 30.0e9, 31.5e9),
        ("gemma-4-26b-a4b", 24.5e9, 26.0e9),
    ] {
        let p = synth::preset(name).unwrap();
        let plan = synth::plan(&p, &PlanOptions::default(), None).unwrap();
        let params: u64 = plan.tensors.iter().map(|t| t.n_elements()).sum();
        assert!(
            (lo..hi).contains(&(params as f64)),
            "{name}: {params} parameters"
        );
        let Dims::Gemma(d) = &p.dims else {
            panic!("{name}: not a Gemma preset")
        };
        let kv = |l: usize| {
            if l % 6 == 5 {
                d.n_head_kv_global
            } else {
                d.n_head_kv
            }
        };
        assert_eq!(
            plan.get("gemma4.attention.head_count_kv"),
            Some(&Value::Array(
                (0..d.n_layer).map(|l| Value::I32(kv(l) as i32)).collect()
            )),
            "{name}"
        );
        assert!(
            plan.tensor("blk.5.attn_v.weight").is_none(),
            "{name}: V is K on global layers"
        );
        assert!(plan.tensor("blk.4.attn_v.weight").is_some(), "{name}");
        assert!(
            plan.tensor("output.weight").is_none(),
            "{name}: the head is tied"
        );

        let mut p = p;
        let Dims::Gemma(d) = &mut p.dims else {
            unreachable!()
        };
        (
            d.n_embd,
            d.n_ff,
            d.n_head,
            d.head_dim_swa,
            d.head_dim,
            d.window,
        ) = (256, 512, 4, 64, 128, 4);
        (d.n_head_kv, d.n_head_kv_global) = (2, 1);
        if let Some(m) = &mut d.moe {
            (m.n_expert, m.n_used, m.n_ff_exp) = (16, 4, 64);
        }
        let opts = PlanOptions {
            ftype: Some(FileType::Q8_0),
            n_layer: Some(7),
            n_vocab: Some(512),
            skew: 4.0,
            ..Default::default()
        };
        let dir = tmp_dir(name);
        let path = dir.join("gemma4.gguf");
        synth::plan(&p, &opts, None)
            .unwrap()
            .write(&path, 3, None)
            .unwrap();
        check_forward(&path);
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// The E4B preset plans at its size (7.5B text parameters: NVIDIA Megatron-Bridge's and
/// fairseq2's Gemma 4 E4B pages; ~8B with the vision and audio towers, which text-only files
/// lack), 2.8B of them the per-layer token table; the last 18 blocks have no K/V; a
/// shortened, narrowed file (5 of 12 blocks shared) loads and runs.
#[test]
fn gemma4_e4b_preset_plans_and_runs() {
    let p = synth::preset("gemma-4-e4b").unwrap();
    let plan = synth::plan(&p, &PlanOptions::default(), None).unwrap();
    let params: u64 = plan.tensors.iter().map(|t| t.n_elements()).sum();
    assert!(
        (7.3e9..7.7e9).contains(&(params as f64)),
        "{params} parameters"
    );
    assert_eq!(
        plan.get("gemma4.attention.shared_kv_layers"),
        Some(&Value::U32(18))
    );
    assert_eq!(
        plan.get("gemma4.embedding_length_per_layer_input"),
        Some(&Value::U32(256))
    );
    let pl = plan.tensor("per_layer_token_embd.weight").unwrap();
    assert_eq!(pl.shape, [262_144, 42 * 256]);
    for (name, there) in [
        ("blk.23.attn_k.weight", true),
        ("blk.23.attn_v.weight", true),
        ("blk.17.attn_v.weight", true),
        ("blk.24.attn_k.weight", false),
        ("blk.41.attn_v.weight", false),
        ("blk.41.inp_gate.weight", true),
    ] {
        assert_eq!(plan.tensor(name).is_some(), there, "{name}");
    }

    let mut p = p;
    let Dims::Gemma(d) = &mut p.dims else {
        panic!("not a Gemma preset")
    };
    (
        d.n_embd,
        d.n_ff,
        d.n_head,
        d.head_dim_swa,
        d.head_dim,
        d.window,
        d.n_epl,
    ) = (256, 512, 4, 64, 128, 4, 32);
    let opts = PlanOptions {
        ftype: Some(FileType::Q8_0),
        n_layer: Some(12),
        n_vocab: Some(512),
        ..Default::default()
    };
    let plan = synth::plan(&p, &opts, None).unwrap();
    assert_eq!(
        plan.get("gemma4.attention.shared_kv_layers"),
        Some(&Value::U32(5))
    );
    let dir = tmp_dir("gemma-4-e4b");
    let path = dir.join("gemma4e.gguf");
    plan.write(&path, 3, None).unwrap();
    check_forward(&path);
    std::fs::remove_dir_all(&dir).ok();
}
