//! Safetensors reader, Hugging Face checkpoint directories and block-scaled weights.
//!
//! Fixtures in tests/fixtures/safetensors/ and tests/fixtures/hf/ were written by Hugging
//! Face's `safetensors` (numpy API) with ml_dtypes' float types, by
//! tests/fixtures/safetensors/make_fixtures.py; re-run it to regenerate them. Tests that use
//! ../shared/fixtures fail, saying so, when it is absent (CI has it).

use lathe::safetensors::scaled::{e4m3_to_f32, e8m0_to_f32};
use lathe::safetensors::{
    dequant_fp8_block, dequant_mxfp4_packed, find_block_scale, normalise_name,
    repack_mxfp4_to_ggml, HfModel, SafetensorsFile,
};
use lathe::tensor::TensorRef;
use lathe::{DType, Error};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixtures() -> PathBuf {
    root().join("tests/fixtures/safetensors")
}

/// ../shared/fixtures/models; the test fails when this checkout lacks it.
fn shared_models() -> PathBuf {
    let p = root().join("../shared/fixtures/models");
    assert!(
        p.is_dir(),
        "{} is absent: this test needs ../shared/fixtures (CI has it)",
        p.display()
    );
    p
}

/// A scratch directory unique to this process and test.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lathe-st-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn f32s(t: &TensorRef) -> Vec<f32> {
    assert_eq!(t.dtype, DType::F32, "{}", t.name);
    t.data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The fixture script's value formula: `(i * 37 + k) % 101 - 50`.
fn formula(n: usize, k: i64) -> Vec<f64> {
    (0..n as i64)
        .map(|i| ((i * 37 + k) % 101 - 50) as f64)
        .collect()
}

/// A safetensors file from (name, dtype, shape, bytes), laid out in order, with the header
/// padded to 8 bytes as the reference writer does.
fn build(tensors: &[(&str, &str, Vec<u64>, Vec<u8>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.to_string(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    with_header(&serde_json::to_string(&header).unwrap(), &data)
}

/// A file with this exact header text and data section.
fn with_header(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

// ---------------------------------------------------------------------------------- files

#[test]
fn qwen35_tiny_values_match_python_safetensors() {
    let dir = root().join("tests/fixtures/hf/qwen35-tiny");
    let expected: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("qwen35-tiny-expected.json")).unwrap(),
    )
    .unwrap();
    let m = HfModel::open(&dir).unwrap();
    assert_eq!(m.architecture().unwrap(), "Qwen3_5ForCausalLM");
    assert!(!m.is_multimodal());
    assert_eq!(m.files().len(), 1);
    assert_eq!(
        m.tensors().count() as u64,
        expected["n_tensors"].as_u64().unwrap()
    );
    assert_eq!(m.files()[0].metadata().unwrap()["format"], "pt");
    for e in expected["tensors"].as_array().unwrap() {
        let name = e["name"].as_str().unwrap();
        let t = m.require(name).unwrap();
        assert_eq!(t.name, name);
        assert_eq!(t.dtype.name(), e["dtype"].as_str().unwrap());
        let shape: Vec<u64> = e["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(t.shape, &shape[..], "{name}");
        assert_eq!(t.path, dir.join("model.safetensors"));
        let v = f32s(&t);
        // f32 values written by Python as exact doubles: equal once rounded back to f32
        // (serde_json's default float parsing may be 1 ulp off in f64).
        for (a, b) in v.iter().zip(e["first"].as_array().unwrap()) {
            assert_eq!(*a, b.as_f64().unwrap() as f32, "{name}");
        }
        assert_eq!(
            *v.last().unwrap(),
            e["last"].as_f64().unwrap() as f32,
            "{name}"
        );
        // numpy sums pairwise, we sum in order: agree to f64 rounding.
        let sum: f64 = v.iter().map(|&x| x as f64).sum();
        assert!(
            (sum - e["sum"].as_f64().unwrap()).abs() < 1e-9,
            "{name}: {sum} vs {}",
            e["sum"]
        );
    }
    // Every tensor's bytes are exactly its size.
    for t in m.tensors() {
        assert_eq!(
            t.data.len() as u64,
            t.dtype.bytes_for(t.n_elements()).unwrap(),
            "{}",
            t.name
        );
    }
    // The same file opened directly agrees.
    let f = SafetensorsFile::open(dir.join("model.safetensors")).unwrap();
    assert_eq!(f.tensors().count(), m.tensors().count());
    assert_eq!(
        f.tensor("model.norm.weight").unwrap().data,
        m.tensor("model.norm.weight").unwrap().data
    );
    assert!(f.tensor("nope").is_none());
    assert!(matches!(
        f.require("nope"),
        Err(Error::MissingTensor { .. })
    ));
}

#[test]
fn config_accessors_name_file_and_key() {
    let m = HfModel::open(root().join("tests/fixtures/hf/qwen35-tiny")).unwrap();
    assert_eq!(m.cfg_u64("hidden_size").unwrap(), 64);
    assert_eq!(m.cfg_f64("rms_norm_eps").unwrap(), 1e-6);
    assert_eq!(m.cfg_f64("rope_parameters.rope_theta").unwrap(), 1e7);
    assert_eq!(
        m.cfg_u64_list("rope_parameters.mrope_section").unwrap(),
        vec![1, 1, 0]
    );
    assert_eq!(m.cfg_str("model_type").unwrap(), "qwen3_5_text");
    assert_eq!(m.cfg_str_list("layer_types").unwrap()[1], "full_attention");
    assert!(!m.cfg_bool("tie_word_embeddings").unwrap());
    assert_eq!(m.cfg_opt_u64("pad_token_id").unwrap(), None); // null
    assert_eq!(m.cfg_opt_f64("no_such_key").unwrap(), None);
    assert_eq!(m.cfg_opt_str("hidden_act").unwrap(), Some("silu"));
    assert_eq!(m.cfg_opt_bool("use_cache").unwrap(), Some(true));
    assert_eq!(m.config_path(), m.dir().join("config.json"));
    assert_eq!(m.config()["vocab_size"], 512);

    let msg = m.cfg_u64("no_such_key").unwrap_err().to_string();
    assert!(
        msg.contains("config.json") && msg.contains("no_such_key") && msg.contains("missing"),
        "{msg}"
    );
    let msg = m.cfg_u64("hidden_act").unwrap_err().to_string();
    assert!(
        msg.contains("config.json") && msg.contains("hidden_act") && msg.contains("silu"),
        "{msg}"
    );
    let msg = m.cfg_u64("rms_norm_eps").unwrap_err().to_string();
    assert!(msg.contains("rms_norm_eps"), "{msg}");
    assert!(m.cfg_opt_str("hidden_size").is_err()); // present with the wrong type
    assert!(m.cfg_u64("pad_token_id").is_err()); // null is not a value
}

#[test]
fn sharded_index_round_trip() {
    let dir = fixtures().join("sharded");
    let m = HfModel::open(&dir).unwrap();
    assert_eq!(m.files().len(), 2);
    assert_eq!(m.len(), 13);
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    for (name, shard) in index["weight_map"].as_object().unwrap() {
        if name == "model.layers.0.flags" {
            continue; // BOOL: see below
        }
        let t = m.require(name).unwrap();
        assert_eq!(t.path, dir.join(shard.as_str().unwrap()), "{name}");
    }

    let emb = m.require("model.embed_tokens.weight").unwrap();
    assert_eq!((emb.dtype, emb.shape), (DType::F32, &[32u64, 8][..]));
    let want: Vec<f32> = formula(256, 1).iter().map(|x| (x * 0.25) as f32).collect();
    assert_eq!(f32s(&emb), want);

    let up = m.require("model.layers.0.mlp.up_proj.weight").unwrap();
    assert_eq!((up.dtype, up.shape), (DType::F16, &[16u64, 8][..]));
    let got: Vec<f64> = up
        .data
        .chunks_exact(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
        .collect();
    assert_eq!(
        got,
        formula(128, 2).iter().map(|x| x * 0.5).collect::<Vec<_>>()
    );

    let ln = m.require("model.layers.0.input_layernorm.weight").unwrap();
    assert_eq!(ln.dtype, DType::F64);
    let got: Vec<f64> = ln
        .data
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(
        got,
        formula(8, 3).iter().map(|x| x / 8.0).collect::<Vec<_>>()
    );

    let ids = m.require("model.layers.0.ids").unwrap();
    assert_eq!((ids.dtype, ids.shape), (DType::I64, &[2u64, 3][..]));
    let got: Vec<f64> = ids
        .data
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
        .collect();
    assert_eq!(got, formula(6, 6));

    let i32t = m.require("model.layers.0.i32").unwrap();
    assert_eq!(i32t.dtype, DType::I32);
    let got: Vec<f64> = i32t
        .data
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as f64)
        .collect();
    assert_eq!(got, formula(4, 7));
    let i16t = m.require("model.layers.0.i16").unwrap();
    assert_eq!(i16t.dtype, DType::I16);
    let got: Vec<f64> = i16t
        .data
        .chunks_exact(2)
        .map(|c| i16::from_le_bytes([c[0], c[1]]) as f64)
        .collect();
    assert_eq!(got, formula(4, 8));
    let i8t = m.require("model.layers.0.i8").unwrap();
    assert_eq!(i8t.dtype, DType::I8);
    assert_eq!(
        i8t.data.iter().map(|&b| b as i8 as f64).collect::<Vec<_>>(),
        formula(4, 9)
    );
    let u8t = m.require("model.layers.0.u8").unwrap();
    assert_eq!(u8t.dtype, DType::U8);
    let want: Vec<f64> = formula(4, 10).iter().map(|x| x + 50.0).collect();
    assert_eq!(u8t.data.iter().map(|&b| b as f64).collect::<Vec<_>>(), want);
    let bf = m.require("model.layers.0.bf16").unwrap();
    assert_eq!(bf.dtype, DType::BF16);
    let got: Vec<f64> = bf
        .data
        .chunks_exact(2)
        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
        .collect();
    assert_eq!(
        got,
        formula(4, 11).iter().map(|x| x * 0.5).collect::<Vec<_>>()
    );

    let empty = m.require("model.layers.0.empty").unwrap();
    assert_eq!((empty.shape, empty.data.len()), (&[0u64, 4][..], 0));

    // BOOL is recorded but refused on access, naming file, tensor and type.
    assert!(m.tensor("model.layers.0.flags").is_none());
    let msg = m.require("model.layers.0.flags").unwrap_err().to_string();
    assert!(
        msg.contains("model-00002-of-00002.safetensors")
            && msg.contains("model.layers.0.flags")
            && msg.contains("BOOL"),
        "{msg}"
    );
    assert_eq!(
        m.files()[1].dtype_name("model.layers.0.flags"),
        Some("BOOL")
    );
    assert_eq!(m.files()[1].unsupported().count(), 1);
    assert_eq!(m.tensors().count(), 12);

    // A float written as 4096.0 reads as an integer; lists of integers.
    assert_eq!(m.cfg_u64("max_position_embeddings").unwrap(), 4096);
    assert_eq!(
        m.cfg_u64_list("rope_parameters.mrope_section").unwrap(),
        vec![1, 1, 0]
    );
}

/// A copy of the sharded fixture with a rewritten index.
fn sharded_with_index(name: &str, weight_map: Value) -> PathBuf {
    let src = fixtures().join("sharded");
    let d = scratch(name);
    for f in [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        std::fs::copy(src.join(f), d.join(f)).unwrap();
    }
    let idx = json!({ "weight_map": weight_map });
    std::fs::write(d.join("model.safetensors.index.json"), idx.to_string()).unwrap();
    d
}

#[test]
fn sharded_index_errors() {
    let d = sharded_with_index(
        "wrong-shard",
        json!({"model.norm.weight": "model-00001-of-00002.safetensors"}),
    );
    let msg = HfModel::open(&d).unwrap_err().to_string();
    assert!(
        msg.contains("model.safetensors.index.json") && msg.contains("model.norm.weight"),
        "{msg}"
    );
    std::fs::remove_dir_all(&d).unwrap();

    let d = sharded_with_index(
        "missing-shard",
        json!({"model.norm.weight": "model-00003-of-00002.safetensors"}),
    );
    let msg = HfModel::open(&d).unwrap_err().to_string();
    assert!(msg.contains("model-00003-of-00002.safetensors"), "{msg}");
    std::fs::remove_dir_all(&d).unwrap();

    let d = sharded_with_index(
        "escape",
        json!({"model.norm.weight": "../model-00002-of-00002.safetensors"}),
    );
    let msg = HfModel::open(&d).unwrap_err().to_string();
    assert!(
        msg.contains("model.norm.weight") && msg.contains("inside"),
        "{msg}"
    );
    std::fs::remove_dir_all(&d).unwrap();

    // Duplicate keys in weight_map are refused, not silently merged.
    let d = sharded_with_index("dup", json!({}));
    std::fs::write(
        d.join("model.safetensors.index.json"),
        r#"{"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors",
                           "model.norm.weight": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let msg = HfModel::open(&d).unwrap_err().to_string();
    assert!(
        msg.contains("duplicate") && msg.contains("model.norm.weight"),
        "{msg}"
    );
    std::fs::remove_dir_all(&d).unwrap();

    // No config.json.
    let d = scratch("no-config");
    let msg = HfModel::open(&d).unwrap_err().to_string();
    assert!(msg.contains("config.json"), "{msg}");
    // Config but no weights.
    std::fs::write(d.join("config.json"), "{}").unwrap();
    let msg = HfModel::open(&d).unwrap_err().to_string();
    assert!(msg.contains("safetensors"), "{msg}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn directory_of_files_without_index() {
    // DeepSeek's inference-style release: several *.safetensors, no index.
    let d = scratch("no-index");
    std::fs::write(
        d.join("config.json"),
        r#"{"architectures": ["DeepseekV4ForCausalLM"]}"#,
    )
    .unwrap();
    let a = build(&[(
        "embed.weight",
        "F32",
        vec![2, 2],
        f32_bytes(&[1.0, 2.0, 3.0, 4.0]),
    )]);
    let b = build(&[
        (
            "layers.0.attn_norm.weight",
            "F32",
            vec![2],
            f32_bytes(&[5.0, 6.0]),
        ),
        ("head.weight", "F32", vec![1, 2], f32_bytes(&[7.0, 8.0])),
    ]);
    std::fs::write(d.join("model0-mp1.safetensors"), &a).unwrap();
    std::fs::write(d.join("model1-mp1.safetensors"), &b).unwrap();
    std::fs::write(d.join("notes.txt"), "not a weight file").unwrap();
    let m = HfModel::open(&d).unwrap();
    assert_eq!(m.files().len(), 2);
    assert_eq!(m.tensors().count(), 3);
    assert_eq!(f32s(&m.require("head.weight").unwrap()), vec![7.0, 8.0]);
    assert_eq!(
        m.require("embed.weight").unwrap().path,
        d.join("model0-mp1.safetensors")
    );

    // The same name in two files is an error naming both.
    std::fs::write(d.join("model2-mp1.safetensors"), &a).unwrap();
    let msg = HfModel::open(&d).unwrap_err().to_string();
    assert!(
        msg.contains("embed.weight")
            && msg.contains("model0-mp1.safetensors")
            && msg.contains("model2-mp1.safetensors"),
        "{msg}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn multimodal_prefix_is_normalised() {
    let m = HfModel::open(fixtures().join("multimodal")).unwrap();
    assert_eq!(m.architecture().unwrap(), "Qwen3_5ForConditionalGeneration");
    assert!(m.is_multimodal());
    let mut names: Vec<&str> = m.tensors().map(|t| t.name).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "lm_head.weight",
            "model.embed_tokens.weight",
            "model.layers.0.input_layernorm.weight",
            "model.norm.weight",
            "mtp.fc.weight"
        ]
    );
    let norm = m.require("model.norm.weight").unwrap();
    assert_eq!(norm.name, "model.norm.weight");
    assert_eq!(
        f32s(&norm),
        formula(8, 3).iter().map(|&x| x as f32).collect::<Vec<_>>()
    );
    assert_eq!(
        f32s(&m.require("model.embed_tokens.weight").unwrap()),
        formula(256, 1)
            .iter()
            .map(|&x| x as f32)
            .collect::<Vec<_>>()
    );
    // Raw names stay reachable, vision included; the normalised view has neither.
    let raw = m.raw_tensor("model.language_model.norm.weight").unwrap();
    assert_eq!(
        (raw.name, raw.data),
        ("model.language_model.norm.weight", norm.data)
    );
    assert!(m
        .raw_tensor("model.visual.patch_embed.proj.weight")
        .is_some());
    assert_eq!(m.raw_tensors().count(), 7);
    assert!(m.tensor("model.visual.patch_embed.proj.weight").is_none());
    assert!(m.tensor("model.language_model.norm.weight").is_none());
    // Text hyper-parameters come from text_config first, others from the top level.
    assert_eq!(m.cfg_u64("hidden_size").unwrap(), 8);
    assert_eq!(m.cfg_f64("rope_parameters.rope_theta").unwrap(), 1e7);
    assert_eq!(m.cfg_u64("vision_config.depth").unwrap(), 1);
    assert!(!m.cfg_bool("tie_word_embeddings").unwrap());

    assert_eq!(
        normalise_name("model.language_model.layers.3.mlp.up_proj.weight").unwrap(),
        "model.layers.3.mlp.up_proj.weight"
    );
    assert_eq!(
        normalise_name("model.visual.blocks.0.attn.qkv.weight"),
        None
    );
    assert_eq!(
        normalise_name("layers.0.attn.wq_a.weight").unwrap(),
        "layers.0.attn.wq_a.weight"
    );
}

#[test]
fn multimodal_name_collision_is_an_error() {
    let d = scratch("collide");
    std::fs::write(d.join("config.json"), "{}").unwrap();
    let f = build(&[
        ("model.norm.weight", "F32", vec![1], f32_bytes(&[1.0])),
        (
            "model.language_model.norm.weight",
            "F32",
            vec![1],
            f32_bytes(&[2.0]),
        ),
    ]);
    std::fs::write(d.join("model.safetensors"), f).unwrap();
    let msg = HfModel::open(&d).unwrap_err().to_string();
    assert!(
        msg.contains("model.norm.weight") && msg.contains("model.language_model.norm.weight"),
        "{msg}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

// ------------------------------------------------------------------------------ validation

const LABEL: &str = "corrupt.safetensors";

fn open_err(bytes: Vec<u8>) -> String {
    match SafetensorsFile::from_bytes(LABEL, bytes) {
        Ok(_) => panic!("corrupt file accepted"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(LABEL), "error does not name the file: {msg}");
            msg
        }
    }
}

fn entry(dtype: &str, shape: &[u64], start: u64, end: u64) -> Value {
    json!({"dtype": dtype, "shape": shape, "data_offsets": [start, end]})
}

#[test]
fn corrupt_files_are_errors_naming_file_and_tensor() {
    let good = build(&[
        ("a", "F32", vec![2, 2], f32_bytes(&[1.0, 2.0, 3.0, 4.0])),
        (
            "b",
            "BF16",
            vec![3],
            vec![0x80, 0x3f, 0x00, 0x40, 0x40, 0x40],
        ),
    ]);
    let f = SafetensorsFile::from_bytes(LABEL, good.clone()).unwrap();
    assert_eq!(f.len(), 2);
    assert_eq!(f32s(&f.require("a").unwrap()), vec![1.0, 2.0, 3.0, 4.0]);
    let b = f.require("b").unwrap();
    let v: Vec<f32> = b
        .data
        .chunks_exact(2)
        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_eq!(v, vec![1.0, 2.0, 3.0]);

    // Shorter than the header length field; truncated anywhere.
    assert!(open_err(vec![1, 2, 3]).contains("too short"));
    for cut in [8, 20, good.len() - 1] {
        open_err(good[..cut].to_vec());
    }
    // Header length beyond the file, and absurd.
    let mut bad = good.clone();
    bad[..8].copy_from_slice(&(good.len() as u64).to_le_bytes());
    assert!(open_err(bad).contains("past the end"));
    let mut bad = good.clone();
    bad[..8].copy_from_slice(&(200_000_000u64).to_le_bytes());
    assert!(open_err(bad).contains("exceeds"));
    let mut bad = good.clone();
    bad[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    open_err(bad);
    // Not UTF-8, not JSON, not an object.
    let mut bad = with_header("{\"x\": 1}", &[]);
    bad[10] = 0xff;
    assert!(open_err(bad).contains("UTF-8"));
    assert!(open_err(with_header("{\"a\": {\"dtype\": ", &[])).contains("JSON"));
    assert!(open_err(with_header("[1, 2]", &[])).contains("JSON"));

    let data = [0u8; 32];
    let one = |name: &str, e: Value| with_header(&json!({ name: e }).to_string(), &data);
    // Offsets outside the data section, end before start, wrong byte count.
    let msg = open_err(one("w", entry("F32", &[16], 0, 64)));
    assert!(msg.contains("`w`") && msg.contains("data section"), "{msg}");
    let msg = open_err(one("w", entry("F32", &[2], 16, 8)));
    assert!(
        msg.contains("`w`") && msg.contains("end before start"),
        "{msg}"
    );
    let msg = open_err(one("w", entry("F32", &[3], 0, 16)));
    assert!(
        msg.contains("`w`") && msg.contains("12 bytes expected"),
        "{msg}"
    );
    let msg = open_err(one("w", entry("F32", &[4], u64::MAX - 3, u64::MAX)));
    assert!(msg.contains("`w`"), "{msg}");
    // Shape overflow.
    let msg = open_err(one("w", entry("F32", &[1 << 40, 1 << 40], 0, 16)));
    assert!(msg.contains("`w`") && msg.contains("overflow"), "{msg}");
    let msg = open_err(one("w", entry("F32", &[1 << 62], 0, 16)));
    assert!(msg.contains("`w`"), "{msg}");
    // Malformed entries name the tensor.
    let msg = open_err(one(
        "w",
        json!({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}),
    ));
    assert!(msg.contains("`w`"), "{msg}");
    let msg = open_err(one(
        "w",
        json!({"dtype": "F32", "shape": [1], "data_offsets": [0]}),
    ));
    assert!(msg.contains("`w`"), "{msg}");
    let msg = open_err(one("w", json!({"dtype": "F32", "shape": [1]})));
    assert!(msg.contains("`w`") && msg.contains("data_offsets"), "{msg}");
    // Overlapping tensors.
    let h = json!({"p": entry("F32", &[4], 0, 16), "q": entry("F32", &[4], 8, 24)});
    let msg = open_err(with_header(&h.to_string(), &data));
    assert!(
        msg.contains("overlap") && msg.contains("`p`") && msg.contains("`q`"),
        "{msg}"
    );
    // Duplicate names (JSON allows repeated keys; serde would keep the last one).
    let h = r#"{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}"#;
    let msg = open_err(with_header(h, &data));
    assert!(msg.contains("duplicate") && msg.contains("`w`"), "{msg}");
    // Packed sub-byte types must fill whole bytes.
    let msg = open_err(one("f4", entry("F4", &[3], 0, 2)));
    assert!(msg.contains("`f4`"), "{msg}");

    // Unsupported and unknown types open, and are refused only on access.
    let h = json!({"ok": entry("F32", &[1], 0, 4), "e5": entry("F8_E5M2", &[4], 4, 8),
                   "odd": entry("Q7", &[3], 8, 11), "__metadata__": {"k": "v"}});
    let f = SafetensorsFile::from_bytes(LABEL, with_header(&h.to_string(), &data)).unwrap();
    assert_eq!(f.len(), 3);
    assert_eq!(f.tensors().count(), 1);
    assert_eq!(f.metadata().unwrap()["k"], "v");
    assert!(f.tensor("e5").is_none());
    let msg = f.require("e5").unwrap_err().to_string();
    assert!(
        msg.contains(LABEL) && msg.contains("`e5`") && msg.contains("F8_E5M2"),
        "{msg}"
    );
    let msg = f.require("odd").unwrap_err().to_string();
    assert!(msg.contains("`odd`") && msg.contains("Q7"), "{msg}");
    // Zero-sized tensors own no bytes and may share an offset.
    let h = json!({"z1": entry("F32", &[0], 4, 4), "z2": entry("F32", &[0, 3], 4, 4), "x": entry("F32", &[2], 0, 8)});
    let f = SafetensorsFile::from_bytes(LABEL, with_header(&h.to_string(), &data)).unwrap();
    assert_eq!(f.require("z2").unwrap().data.len(), 0);
}

#[test]
fn corrupt_files_on_disk() {
    let d = scratch("disk");
    let p = d.join("empty.safetensors");
    std::fs::write(&p, b"").unwrap();
    let msg = SafetensorsFile::open(&p).unwrap_err().to_string();
    assert!(
        msg.contains("empty.safetensors") && msg.contains("too short"),
        "{msg}"
    );
    let good = build(&[("a", "F32", vec![4], f32_bytes(&[1.0, 2.0, 3.0, 4.0]))]);
    let p = d.join("cut.safetensors");
    std::fs::write(&p, &good[..good.len() - 2]).unwrap();
    let msg = SafetensorsFile::open(&p).unwrap_err().to_string();
    assert!(
        msg.contains("cut.safetensors") && msg.contains("`a`"),
        "{msg}"
    );
    let msg = SafetensorsFile::open(d.join("absent.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("absent.safetensors"), "{msg}");
    std::fs::remove_dir_all(&d).unwrap();
}

// ------------------------------------------------------------------------ scaled weights

#[test]
fn e4m3_and_e8m0_decoding() {
    assert_eq!(e4m3_to_f32(0x00), 0.0);
    assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
    assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
    assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6)); // smallest normal
    assert_eq!(e4m3_to_f32(0x38), 1.0);
    assert_eq!(e4m3_to_f32(0x7e), 448.0);
    assert_eq!(e4m3_to_f32(0xfe), -448.0);
    assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
    assert_eq!(e4m3_to_f32(0x78), 256.0); // exponent 15 is finite in e4m3fn
    assert_eq!(e8m0_to_f32(127), 1.0);
    assert_eq!(e8m0_to_f32(130), 8.0);
    assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
    assert_eq!(e8m0_to_f32(254), 2f32.powi(127));
    assert!(e8m0_to_f32(255).is_nan());
}

fn read_npy(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let a = lathe::npy::read_f32(path).unwrap();
    (a.shape, a.data)
}

#[test]
fn fp8_block_dequant_matches_numpy() {
    let dir = fixtures().join("fp8_block");
    let m = HfModel::open(&dir).unwrap();
    for (weight, expected, scale_name, scale_dtype) in [
        (
            "layers.0.attn.wq.weight",
            "wq.expected.npy",
            "layers.0.attn.wq.scale",
            DType::F8_E8M0,
        ),
        (
            "model.layers.0.self_attn.o_proj.weight",
            "o_proj.expected.npy",
            "model.layers.0.self_attn.o_proj.weight_scale_inv",
            DType::F32,
        ),
    ] {
        let w = m.require(weight).unwrap();
        assert_eq!(w.dtype, DType::F8_E4M3);
        let s = find_block_scale(&m, weight).unwrap();
        assert_eq!((s.name, s.dtype), (scale_name, scale_dtype));
        let (shape, want) = read_npy(&dir.join(expected));
        assert_eq!(shape.iter().map(|&x| x as u64).collect::<Vec<_>>(), w.shape);
        let mut got = vec![0f32; want.len()];
        dequant_fp8_block(&w, &s, &mut got).unwrap();
        // Both sides round e4m3 × scale once to f32: bit-identical.
        let bad = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(bad, 0, "{weight}: {bad} of {} values differ", want.len());
    }
    assert!(find_block_scale(&m, "no.such.weight").is_none());

    // Mismatches are errors naming the tensor.
    let w = m.require("layers.0.attn.wq.weight").unwrap();
    let s = m
        .require("model.layers.0.self_attn.o_proj.weight_scale_inv")
        .unwrap(); // [1, 2]
    let mut out = vec![0f32; w.n_elements() as usize];
    let msg = dequant_fp8_block(&w, &s, &mut out).unwrap_err().to_string();
    assert!(
        msg.contains("o_proj.weight_scale_inv") && msg.contains("[2, 2]"),
        "{msg}"
    );
    let s = find_block_scale(&m, "layers.0.attn.wq.weight").unwrap();
    let msg = dequant_fp8_block(&w, &s, &mut out[1..])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("layers.0.attn.wq.weight") && msg.contains("output"),
        "{msg}"
    );
    let msg = dequant_fp8_block(&s, &s, &mut out).unwrap_err().to_string();
    assert!(msg.contains("F8_E4M3"), "{msg}");
}

/// ggml's own MXFP4 dequantization, written from ggml-quants.c `dequantize_row_mxfp4`:
/// `kvalues_mxfp4` doubled e2m1 values, scale `GGML_E8M0_TO_FP32_HALF(e)` built from bits.
fn ggml_mxfp4_dequant(blocks: &[u8]) -> Vec<f32> {
    const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
    let mut y = Vec::new();
    for b in blocks.chunks_exact(17) {
        let e = b[0] as u32;
        let d = f32::from_bits(if e < 2 {
            0x0020_0000 << e
        } else {
            (e - 1) << 23
        });
        let mut blk = [0f32; 32];
        for j in 0..16 {
            blk[j] = KVALUES[(b[1 + j] & 0x0f) as usize] as f32 * d;
            blk[j + 16] = KVALUES[(b[1 + j] >> 4) as usize] as f32 * d;
        }
        y.extend_from_slice(&blk);
    }
    y
}

/// xorshift64*: reproducible bytes without a dependency.
struct Rng(u64);
impl Rng {
    fn byte(&mut self) -> u8 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
    }
}

#[test]
fn mxfp4_repack_equals_ggml_for_random_inputs() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for (rows, cols, wdtype) in [(1u64, 32u64, "U8"), (5, 96, "I8"), (3, 256, "U8")] {
        let w: Vec<u8> = (0..rows * cols / 2).map(|_| rng.byte()).collect();
        let mut s: Vec<u8> = (0..rows * cols / 32)
            .map(|_| 100 + rng.byte() % 54)
            .collect();
        // Scale extremes ggml special-cases (subnormal halves) and the largest finite.
        s[0] = 0;
        if s.len() > 2 {
            s[1] = 1;
            s[2] = 254;
        }
        let file = build(&[
            ("w", wdtype, vec![rows, cols / 2], w),
            ("s", "F8_E8M0", vec![rows, cols / 32], s),
        ]);
        let f = SafetensorsFile::from_bytes("random.safetensors", file).unwrap();
        let (w, s) = (f.require("w").unwrap(), f.require("s").unwrap());
        let mut ours = vec![0f32; (rows * cols) as usize];
        dequant_mxfp4_packed(&w, &s, &mut ours).unwrap();
        let blocks = repack_mxfp4_to_ggml(&w, &s).unwrap();
        assert_eq!(blocks.len() as u64, rows * cols / 32 * 17);
        let theirs = ggml_mxfp4_dequant(&blocks);
        // Compared as values: ggml's integer table has no -0 (and 6·2^127 is inf on both
        // sides, which compares equal).
        assert_eq!(ours, theirs, "[{rows}, {cols}] {wdtype}");
    }

    // A NaN scale has no ggml equivalent: dequant gives NaN, repack refuses naming the scale.
    let file = build(&[
        ("w", "U8", vec![1, 16], vec![0x11; 16]),
        ("w.scale", "U8", vec![1, 1], vec![0xff]),
    ]);
    let f = SafetensorsFile::from_bytes("nan.safetensors", file).unwrap();
    let (w, s) = (f.require("w").unwrap(), f.require("w.scale").unwrap());
    let mut out = vec![0f32; 32];
    dequant_mxfp4_packed(&w, &s, &mut out).unwrap();
    assert!(out.iter().all(|x| x.is_nan()));
    let msg = repack_mxfp4_to_ggml(&w, &s).unwrap_err().to_string();
    assert!(
        msg.contains("nan.safetensors") && msg.contains("w.scale") && msg.contains("0xFF"),
        "{msg}"
    );

    // Shape mismatches are errors naming the scale.
    let file = build(&[
        ("w", "U8", vec![2, 16], vec![0; 32]),
        ("w.scale", "U8", vec![2, 2], vec![127; 4]),
    ]);
    let f = SafetensorsFile::from_bytes("shape.safetensors", file).unwrap();
    let (w, s) = (f.require("w").unwrap(), f.require("w.scale").unwrap());
    let msg = repack_mxfp4_to_ggml(&w, &s).unwrap_err().to_string();
    assert!(msg.contains("w.scale") && msg.contains("[2, 2]"), "{msg}");
    let msg = dequant_mxfp4_packed(&w, &w, &mut [0f32; 64])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("shape.safetensors"), "{msg}");
}

#[test]
fn dsv4_experts_repack_matches_llamacpp_and_dequant_matches_ml_dtypes() {
    let f = SafetensorsFile::open(fixtures().join("dsv4-experts.safetensors")).unwrap();
    for w in ["w1", "w2", "w3"] {
        let base = format!("layers.1.ffn.experts.0.{w}");
        let wt = f.require(&format!("{base}.weight")).unwrap();
        let sc = f.require(&format!("{base}.scale")).unwrap();
        assert_eq!((wt.dtype, sc.dtype), (DType::U8, DType::U8));
        // llama.cpp's converter wrote these blocks into model-f32.gguf.
        let ggml = f.require(&format!("ggml.{base}")).unwrap();
        assert_eq!(repack_mxfp4_to_ggml(&wt, &sc).unwrap(), ggml.data, "{base}");
        let want = f32s(&f.require(&format!("expected.{base}")).unwrap());
        let mut got = vec![0f32; want.len()];
        dequant_mxfp4_packed(&wt, &sc, &mut got).unwrap();
        assert_eq!(got, want, "{base}");
        assert_eq!(ggml_mxfp4_dequant(ggml.data), want, "{base}");
    }
}

/// Every routed expert of a DeepSeek-V4 upstream checkpoint dequantizes to finite values.
fn check_dsv4_upstream(dir: &Path) -> usize {
    let m = HfModel::open(dir).unwrap();
    assert_eq!(m.architecture().unwrap(), "DeepseekV4ForCausalLM");
    let n_experts = m.cfg_u64("n_routed_experts").unwrap();
    let layers = m.cfg_u64("num_hidden_layers").unwrap();
    assert_eq!(
        m.cfg_u64_list("compress_ratios").unwrap().len() as u64,
        layers
    );
    assert_eq!(
        m.require("layers.0.ffn.gate.tid2eid").unwrap().dtype,
        DType::I64
    );
    let mut n = 0;
    for t in m.tensors() {
        if !(t.name.contains(".ffn.experts.") && t.name.ends_with(".weight")) {
            continue;
        }
        let s = find_block_scale(&m, t.name).unwrap();
        let mut out = vec![0f32; 2 * t.n_elements() as usize];
        dequant_mxfp4_packed(&t, &s, &mut out).unwrap();
        assert!(out.iter().all(|x| x.is_finite()), "{}", t.name);
        assert!(out.iter().any(|&x| x != 0.0), "{}", t.name);
        let blocks = repack_mxfp4_to_ggml(&t, &s).unwrap();
        assert_eq!(ggml_mxfp4_dequant(&blocks), out, "{}", t.name);
        n += 1;
    }
    assert!((n as u64).is_multiple_of(3 * n_experts));
    assert!(n > 0);
    n
}

#[test]
fn shared_dsv4_upstream_experts_dequant() {
    let models = shared_models();
    for name in ["dsv4-tiny", "dsv4-dims"] {
        let dir = models.join(name).join("upstream");
        assert!(dir.is_dir(), "{} is absent", dir.display());
        let n = check_dsv4_upstream(&dir);
        eprintln!("{name}: {n} expert matrices");
    }
}

#[test]
fn shared_hf_checkpoints_open() {
    let models = shared_models();
    for name in ["qwen35-tiny", "qwen35moe-tiny", "qwen3next-tiny"] {
        let dir = models.join(name);
        assert!(
            dir.join("model.safetensors").is_file(),
            "{} has no model.safetensors",
            dir.display()
        );
        let m = HfModel::open(&dir).unwrap();
        assert!(m.architecture().unwrap().ends_with("ForCausalLM"), "{name}");
        assert!(m.cfg_u64("hidden_size").unwrap() > 0);
        assert!(m.tensor("model.embed_tokens.weight").is_some(), "{name}");
        assert_eq!(m.tensors().count(), m.len(), "{name}");
        for t in m.tensors() {
            assert_eq!(
                t.data.len() as u64,
                t.dtype.bytes_for(t.n_elements()).unwrap(),
                "{name} {}",
                t.name
            );
        }
    }
}
