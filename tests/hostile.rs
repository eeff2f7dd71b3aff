//! Model files that lie: hyper-parameters that disagree with the tensors, values out of the
//! range the kernels handle, names too long to print, weights that make non-finite logits.
//! Each must fail with an error that names what is wrong, never run on and answer
//! something else without a word.

use std::path::{Path, PathBuf};

use lathe::gguf::{GgufFile, GgufWriter, Value as GV};
use lathe::models::ModelFile;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
        .join("model-f32.gguf")
}

/// A copy of `src` at `name` (in the test's scratch folder) whose metadata went through
/// `meta` (None drops the key) and whose tensor bytes through `data`.
fn rewrite(
    src: &Path,
    name: &str,
    meta: impl Fn(&str, &GV) -> Option<GV>,
    data: impl Fn(&str, &[u8]) -> Vec<u8>,
) -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let g = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        if let Some(v) = meta(k, v) {
            w.set(k.clone(), v).unwrap();
        }
    }
    let tensors: Vec<_> = g.tensors().collect();
    for t in &tensors {
        w.add_tensor_info(t.name, t.dtype, t.shape).unwrap();
    }
    w.write(&out, |i, o| {
        o.write_all(&data(tensors[i].name, tensors[i].data))
    })
    .unwrap();
    out
}

fn same(_: &str, d: &[u8]) -> Vec<u8> {
    d.to_vec()
}

#[test]
fn shared_expert_tensors_without_their_width_are_refused() {
    let src = fixture("qwen35moe-tiny");
    let key = "qwen35moe.expert_shared_feed_forward_length";
    assert!(GgufFile::open(&src).unwrap().get(key).is_some());
    for (label, value) in [("missing", None), ("zero", Some(GV::U32(0)))] {
        let p = rewrite(
            &src,
            &format!("hostile-shexp-{label}.gguf"),
            |k, v| {
                if k == key {
                    value.clone()
                } else {
                    Some(v.clone())
                }
            },
            same,
        );
        let e = lathe::models::qwen35::cpu::CpuModel::load(&ModelFile::open(&p).unwrap())
            .err()
            .unwrap_or_else(|| panic!("{label}: loaded without its shared expert"))
            .to_string();
        assert!(e.contains("ffn_gate_shexp"), "{label}: {e}");
        assert!(
            e.contains("expert_shared_feed_forward_length"),
            "{label}: {e}"
        );
    }
}

#[test]
fn rope_dims_zero_is_refused_for_qwen35() {
    let p = rewrite(
        &fixture("qwen35-tiny"),
        "hostile-rope0.gguf",
        |k, v| {
            Some(if k == "qwen35.rope.dimension_count" {
                GV::U32(0)
            } else {
                v.clone()
            })
        },
        same,
    );
    let e = lathe::models::qwen35::Hparams::from_file(&ModelFile::open(&p).unwrap())
        .expect_err("rope dims 0 accepted")
        .to_string();
    assert!(e.contains("rotary dims 0"), "{e}");
}

#[test]
fn sinkhorn_iterations_beyond_the_limit_are_refused() {
    let key = "deepseek4.hyper_connection.sinkhorn_iterations";
    assert!(GgufFile::open(fixture("dsv4-tiny"))
        .unwrap()
        .get(key)
        .is_some());
    let p = rewrite(
        &fixture("dsv4-tiny"),
        "hostile-sinkhorn.gguf",
        |k, v| Some(if k == key { GV::U32(65_600) } else { v.clone() }),
        same,
    );
    let e = lathe::models::deepseek4::Hparams::from_file(&ModelFile::open(&p).unwrap())
        .expect_err("65,600 Sinkhorn iterations accepted")
        .to_string();
    assert!(e.contains("65600 Sinkhorn iterations"), "{e}");
}

/// A GGUF (v3, no tensors) with one metadata entry: `key` of value type `ty`.
fn one_key_gguf(key: &[u8], ty: u32) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend((key.len() as u64).to_le_bytes());
    b.extend_from_slice(key);
    b.extend(ty.to_le_bytes());
    b.extend([0u8; 64]);
    b
}

#[test]
fn long_or_binary_names_are_cut_and_escaped_in_errors() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let mut key = "k\n\x1b[31m".repeat(16 << 10).into_bytes();
    key.truncate(64 << 10);
    let mut bad_utf8 = key.clone();
    bad_utf8[100] = 0xff;
    for (label, bytes) in [
        ("bad type", one_key_gguf(&key, 99)),
        ("bad UTF-8", one_key_gguf(&bad_utf8, 4)),
    ] {
        let p = dir.join("hostile-long-key.gguf");
        std::fs::write(&p, bytes).unwrap();
        let e = GgufFile::open(&p).expect_err(label).to_string();
        assert!(e.len() < 1000, "{label}: a {}-byte message", e.len());
        assert!(e.contains("65536 bytes"), "{label}: {e}");
        assert!(!e.contains('\n') && !e.contains('\x1b'), "{label}: {e:?}");
    }
}

/// Weights that make NaN logits: every sampling path (greedy and top-k read the best
/// logits found on the GPU; penalties read the full row) stops at the first step with an
/// error naming the file, instead of printing token 0 forever.
#[test]
fn non_finite_logits_stop_generation_with_the_file_named() {
    use lathe::engine::{Engine, LoadOptions};
    use lathe::generate::{generate, GenerateOptions};
    use lathe::sample::SamplerConfig;
    let p = rewrite(
        &fixture("qwen35-tiny"),
        "hostile-nan.gguf",
        |_, v| Some(v.clone()),
        |name, d| {
            if name == "output_norm.weight" {
                f32::NAN.to_le_bytes().repeat(d.len() / 4)
            } else {
                d.to_vec()
            }
        },
    );
    let mut engine = Engine::load(&p, &LoadOptions::default()).unwrap();
    let samplers = [
        SamplerConfig::greedy(),
        SamplerConfig::default(),
        SamplerConfig {
            repeat_penalty: 1.1,
            ..SamplerConfig::default()
        },
    ];
    for sampler in samplers {
        let opts = GenerateOptions {
            max_tokens: Some(8),
            sampler: sampler.clone(),
            ..GenerateOptions::default()
        };
        let e = generate(&mut engine, &[1, 2, 3], &opts, |_| {})
            .expect_err("generated from NaN logits")
            .to_string();
        assert!(e.contains("hostile-nan.gguf"), "{sampler:?}: {e}");
        assert!(e.contains("step 0") && e.contains("not finite"), "{e}");
    }
}

/// A GGUF split in shards (gguf-split's layout: the first shard named, the rest found
/// beside it) runs through the engine and gives exactly the logits of the one-file model.
#[test]
fn split_gguf_runs_like_the_whole_file() {
    use lathe::engine::{logits, LoadOptions};
    use lathe::gguf::Split;
    let src = fixture("qwen35-tiny");
    let g = GgufFile::open(&src).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        w.set(k.clone(), v.clone()).unwrap();
    }
    let tensors: Vec<_> = g.tensors().collect();
    for t in &tensors {
        w.add_tensor_info(t.name, t.dtype, t.shape).unwrap();
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hostile-split");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let shards = w
        .write_split(dir.join("tiny"), Split::MaxTensors(7), |i, o| {
            o.write_all(tensors[i].data)
        })
        .unwrap();
    assert!(shards.len() >= 3, "{shards:?}");
    let toks: Vec<u32> = (1..20).collect();
    let opts = LoadOptions::default();
    let (whole, v) = logits(&src, &toks, toks.len(), &opts).unwrap();
    let (split, v2) = logits(&shards[0], &toks, 12, &opts).unwrap();
    assert_eq!(v, v2);
    let (whole_inc, _) = logits(&src, &toks, 12, &opts).unwrap();
    assert_eq!(split, whole_inc, "split shards vs the one file");
    assert_eq!(split.len(), whole.len());
}

/// A config.json without `layer_types` builds the layer pattern from
/// `full_attention_interval` and the layer count: 0 and an absurd count are errors naming
/// the key, not a division by zero or an allocation of terabytes.
#[test]
fn absurd_layer_patterns_are_refused() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/qwen35-tiny");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hostile-layer-pattern");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    for (key, value, says) in [
        (
            "full_attention_interval",
            serde_json::json!(0),
            "full_attention_interval",
        ),
        ("num_hidden_layers", serde_json::json!(1u64 << 40), "layers"),
    ] {
        let mut c = base.clone();
        c.as_object_mut().unwrap().remove("layer_types");
        c[key] = value;
        std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
        let e = lathe::models::qwen35::Hparams::from_file(&ModelFile::open(&dir).unwrap())
            .expect_err(key)
            .to_string();
        assert!(e.contains(says), "{key}: {e}");
    }
}
