//! DeepSeek-V4 CPU reference forward against the fixtures' reference logits (DeepSeek's
//! model.py math in f32, computed by transformers), from both formats: llama.cpp's GGUF and
//! DeepSeek's release layout (`upstream/`). Also: FP8 e4m3 block-scaled linears, as the
//! releases store them, written by this test and checked against the same rounded weights
//! stored in f32.
//!
//! dsv4-tiny lives in tests/fixtures/models (copied from ../shared/fixtures/models); the
//! dsv4-dims tests are `#[ignore]` (slow on the CPU) and read ../shared, skipping with a
//! note when it is absent: `cargo test --release --test deepseek4_cpu -- --ignored`.

mod common;
use common::*;
use lathe::models::deepseek4::cpu::{CpuModel, CpuSeq};
use lathe::models::deepseek4::Hparams;
use lathe::models::ModelFile;
use lathe::safetensors::SafetensorsFile;
use lathe::DType;
use std::path::{Path, PathBuf};

fn tiny() -> PathBuf {
    fixtures().join("dsv4-tiny")
}

/// ../shared/fixtures/models/<name>, when this checkout has it.
fn shared(name: &str) -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures/models")
        .join(name);
    if p.is_dir() {
        Some(p)
    } else {
        eprintln!("note: {} absent, skipping", p.display());
        None
    }
}

fn tokens(dir: &Path) -> Vec<u32> {
    let t = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    t.data.iter().map(|&v| v as u32).collect()
}

fn load(path: &Path) -> CpuModel {
    let f = ModelFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    CpuModel::load(&f).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Logits of every position, [T, vocab] flattened, from one sequence fed token by token.
fn run(m: &CpuModel, seq: &mut CpuSeq, toks: &[u32]) -> Vec<f32> {
    toks.iter().flat_map(|&t| m.step(seq, t).unwrap()).collect()
}

/// One model file (GGUF or upstream dir) against a reference .npy, with the fixture bar.
fn check(dir: &Path, file: &str, reference: &str, cap: Option<f64>) -> Vec<f32> {
    let m = load(&dir.join(file));
    let toks = tokens(dir);
    let got = run(&m, &mut m.new_seq(), &toks);
    let want = lathe::npy::read_f32(dir.join(reference)).unwrap();
    let s = score(&got, &want.data, m.hp.n_vocab);
    let name = dir.file_name().unwrap().to_string_lossy();
    assert_bar(&format!("{name}/{file} vs {reference}"), &s, cap);
    got
}

#[test]
fn tiny_hparams_from_both_formats() {
    let g = Hparams::from_file(&ModelFile::open(tiny().join("model-f32.gguf")).unwrap()).unwrap();
    let u = Hparams::from_file(&ModelFile::open(tiny().join("upstream")).unwrap()).unwrap();
    for hp in [&g, &u] {
        assert_eq!(
            (
                hp.n_layer,
                hp.n_embd,
                hp.n_vocab,
                hp.n_head,
                hp.head_dim,
                hp.n_rot
            ),
            (4, 64, 512, 4, 32, 8)
        );
        assert_eq!(
            (hp.q_lora, hp.o_groups, hp.o_lora, hp.window),
            (32, 2, 16, 8)
        );
        assert_eq!(hp.compress_ratio, vec![0, 4, 128, 4]);
        assert_eq!((hp.n_ix_head, hp.ix_head_dim, hp.ix_topk), (8, 16, 2));
        assert_eq!((hp.hc, hp.hc_iters), (4, 20));
        assert_eq!(
            (
                hp.n_expert,
                hp.n_used,
                hp.n_ff_exp,
                hp.n_ff_shexp,
                hp.n_hash_layers
            ),
            (8, 2, 32, 32, 1)
        );
        assert_eq!(
            (hp.rope_theta, hp.compress_rope_theta, hp.route_scale),
            (10000.0, 160000.0, 1.5)
        );
        assert!(hp.yarn.is_none() && hp.norm_topk);
        assert_eq!(hp.swiglu_limit, vec![10.0; 4]);
        assert_eq!(hp.swiglu_limit_shexp, vec![10.0; 4]);
    }
}

#[test]
fn tiny_gguf_f32_and_upstream() {
    let g = check(&tiny(), "model-f32.gguf", "logits.npy", None);
    let u = check(&tiny(), "upstream", "logits.npy", None);
    // Same values in both files (experts exactly MXFP4 in both): the same logits.
    let s = score(&g, &u, 512);
    eprintln!("dsv4-tiny gguf vs upstream: max_abs {:.3e}", s.max_abs);
    assert!(
        s.max_abs <= 1e-5,
        "GGUF and upstream loads disagree by {:.3e}",
        s.max_abs
    );
}

#[test]
fn tiny_gguf_q8_0() {
    check(&tiny(), "model-q8_0.gguf", "ref-q8_0.npy", None);
}

/// A sequence's state is all decode needs: a clone taken after any prefix continues exactly
/// as the original does, and an unrelated sequence run in between changes nothing.
#[test]
fn tiny_state_forks_at_any_prefix() {
    let m = load(&tiny().join("model-f32.gguf"));
    let toks = tokens(&tiny());
    let toks = &toks[..40];
    let full = run(&m, &mut m.new_seq(), toks);
    let v = m.hp.n_vocab;
    for cut in [1, 3, 4, 8, 9, 17, 33] {
        let mut a = m.new_seq();
        run(&m, &mut a, &toks[..cut]);
        let mut fork = a.clone();
        let mut other = m.new_seq();
        run(&m, &mut other, &toks[cut..]);
        assert_eq!(fork.pos(), cut);
        let rest = run(&m, &mut fork, &toks[cut..]);
        assert_eq!(rest, full[cut * v..], "fork at {cut} diverged");
    }
}

#[test]
fn bad_input_is_an_error() {
    let m = load(&tiny().join("model-f32.gguf"));
    let err = m.step(&mut m.new_seq(), 512).unwrap_err();
    assert!(err.to_string().contains("512"), "{err}");
    // A Qwen checkpoint is not a DeepSeek-V4 model.
    let qwen = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/qwen35-tiny");
    let err = Hparams::from_file(&ModelFile::open(&qwen).unwrap()).unwrap_err();
    assert!(err.to_string().contains("not DeepSeek-V4"), "{err}");
}

// ---------------------------------------------------------------- FP8 e4m3 block scales

/// The non-expert linears the releases store in FP8 (model.py `Linear` with the default
/// dtype): attention projections, the indexer's queries, the shared expert.
fn is_fp8_linear(name: &str) -> bool {
    const P: [&str; 9] = [
        "attn.wq_a.weight",
        "attn.wq_b.weight",
        "attn.wkv.weight",
        "attn.wo_a.weight",
        "attn.wo_b.weight",
        "attn.indexer.wq_b.weight",
        "shared_experts.w1.weight",
        "shared_experts.w2.weight",
        "shared_experts.w3.weight",
    ];
    P.iter().any(|p| name.ends_with(p))
}

/// e4m3fn (OCP FP8) decoding, written here independently of the library: sign, 4 exponent
/// bits (bias 7), 3 mantissa bits; 0x7F / 0xFF are NaN.
fn e4m3(b: u8) -> f32 {
    let (e, m) = (((b >> 3) & 15) as i32, (b & 7) as f32);
    let mag = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    if b & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

/// Round-to-nearest e4m3 code of `x` (|x| ≤ 448).
fn to_e4m3(x: f32) -> u8 {
    let mag = (0u8..0x7f)
        .min_by(|&a, &b| {
            (e4m3(a) - x.abs())
                .abs()
                .total_cmp(&(e4m3(b) - x.abs()).abs())
        })
        .unwrap();
    if x < 0.0 {
        mag | 0x80
    } else {
        mag
    }
}

/// FP8 with 128×128 block scales as DeepSeek stores it: codes [rows, cols], E8M0 scale
/// bytes [⌈rows/128⌉, ⌈cols/128⌉] (scale = 2^(b−127), the power of two that maps the
/// block's largest magnitude to ≤ 448), and the values the pair stands for.
fn fp8_blocks(w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
    const B: usize = 128;
    let (sr, sc) = (rows.div_ceil(B), cols.div_ceil(B));
    let mut codes = vec![0u8; rows * cols];
    let mut scales = vec![0u8; sr * sc];
    let mut vals = vec![0f32; rows * cols];
    for bi in 0..sr {
        for bj in 0..sc {
            let cells = || {
                (bi * B..((bi + 1) * B).min(rows)).flat_map(move |r| {
                    (bj * B..((bj + 1) * B).min(cols)).map(move |c| r * cols + c)
                })
            };
            let amax = cells().map(|i| w[i].abs()).fold(0f32, f32::max).max(1e-30);
            let e = (amax / 448.0).log2().ceil() as i32;
            scales[bi * sc + bj] = (e + 127) as u8;
            let s = 2f32.powi(e);
            for i in cells() {
                codes[i] = to_e4m3(w[i] / s);
                vals[i] = e4m3(codes[i]) * s;
            }
        }
    }
    (codes, scales, vals)
}

/// A safetensors file from (name, dtype string, shape, bytes).
fn write_safetensors(path: &Path, tensors: &[(String, &str, Vec<u64>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (name, dt, shape, bytes) in tensors {
        header.insert(name.clone(), serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [off, off + bytes.len()]}));
        off += bytes.len();
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    for (_, _, _, bytes) in tensors {
        out.extend(bytes);
    }
    std::fs::write(path, out).unwrap();
}

/// Writes two copies of an upstream checkpoint under `dir`: `fp8/` with the FP8 linears as
/// F8_E4M3 + `.scale` F8_E8M0, and `ref/` with the same rounded values stored as F32.
/// Returns how many tensors were rounded.
fn write_fp8_pair(upstream: &Path, dir: &Path) -> usize {
    let src = SafetensorsFile::open(upstream.join("model.safetensors")).unwrap();
    let (mut fp8, mut refw) = (Vec::new(), Vec::new());
    let mut n = 0;
    for t in src.tensors() {
        let raw = (
            t.name.to_string(),
            dtype_str(t.dtype),
            t.shape.to_vec(),
            t.data.to_vec(),
        );
        if !is_fp8_linear(t.name) {
            fp8.push(raw.clone());
            refw.push(raw);
            continue;
        }
        let w = lathe::models::read_f32(&t).unwrap();
        let (rows, cols) = (t.shape[0] as usize, t.shape[1] as usize);
        let (codes, scales, vals) = fp8_blocks(&w, rows, cols);
        let sname = format!("{}.scale", t.name.strip_suffix(".weight").unwrap());
        fp8.push((t.name.to_string(), "F8_E4M3", t.shape.to_vec(), codes));
        fp8.push((
            sname,
            "F8_E8M0",
            vec![rows.div_ceil(128) as u64, cols.div_ceil(128) as u64],
            scales,
        ));
        refw.push((
            t.name.to_string(),
            "F32",
            t.shape.to_vec(),
            vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ));
        n += 1;
    }
    for (sub, ts) in [("fp8", &fp8), ("ref", &refw)] {
        let d = dir.join(sub);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::copy(upstream.join("config.json"), d.join("config.json")).unwrap();
        write_safetensors(&d.join("model.safetensors"), ts);
    }
    n
}

fn dtype_str(d: DType) -> &'static str {
    match d {
        DType::F32 => "F32",
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        DType::I64 => "I64",
        DType::I32 => "I32",
        DType::U8 => "U8",
        DType::I8 => "I8",
        DType::F8_E8M0 => "F8_E8M0",
        DType::F8_E4M3 => "F8_E4M3",
        d => panic!("no safetensors name for {d}"),
    }
}

/// FP8 checkpoint vs the same rounded weights in f32: the loader's dequantization must give
/// the same model, and the rounding must really have happened (the logits move).
fn check_fp8(upstream: &Path, n_tok: usize) {
    let dir = std::env::temp_dir().join(format!(
        "lathe-dsv4-fp8-{}-{}",
        std::process::id(),
        upstream
            .parent()
            .unwrap()
            .file_name()
            .unwrap()
            .to_string_lossy()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let n = write_fp8_pair(upstream, &dir);
    assert!(n > 0);
    let toks = tokens(upstream.parent().unwrap());
    let toks = &toks[..n_tok.min(toks.len())];
    let fp8 = load(&dir.join("fp8"));
    let refm = load(&dir.join("ref"));
    let a = run(&fp8, &mut fp8.new_seq(), toks);
    let b = run(&refm, &mut refm.new_seq(), toks);
    let v = fp8.hp.n_vocab;
    let s = score(&a, &b, v);
    let orig = lathe::npy::read_f32(upstream.parent().unwrap().join("logits.npy")).unwrap();
    let moved = score(&a, &orig.data[..a.len()], v);
    eprintln!(
        "{} FP8 ({n} tensors) vs f32 of the rounded weights: max_abs {:.3e}; vs the unrounded reference: rms {:.3e} top1 {:.3}",
        upstream.display(),
        s.max_abs,
        moved.rms,
        moved.top1
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        s.max_abs <= 1e-5,
        "FP8 load differs from its f32 reference by {:.3e}",
        s.max_abs
    );
    assert!(
        moved.max_abs > 1e-3,
        "FP8 rounding left the logits unchanged: were the weights rounded?"
    );
}

#[test]
fn tiny_upstream_fp8_block_scaled() {
    check_fp8(&tiny().join("upstream"), 160);
}

// ---------------------------------------------------------------- dsv4-dims (slow)

#[test]
#[ignore = "slow: real head sizes, 300 tokens"]
fn dims_bf16_gguf() {
    if let Some(d) = shared("dsv4-dims") {
        check(
            &d,
            "model-bf16.gguf",
            "logits.npy",
            llamacpp_rms("dsv4-dims", "bf16"),
        );
    }
}

#[test]
#[ignore = "slow: real head sizes, 300 tokens"]
fn dims_upstream() {
    if let Some(d) = shared("dsv4-dims") {
        check(
            &d,
            "upstream",
            "logits.npy",
            llamacpp_rms("dsv4-dims", "bf16"),
        );
    }
}

#[test]
#[ignore = "slow: real head sizes, 300 tokens"]
fn dims_q8_0() {
    if let Some(d) = shared("dsv4-dims") {
        check(
            &d,
            "model-q8_0.gguf",
            "ref-q8_0.npy",
            llamacpp_rms("dsv4-dims", "q8_0"),
        );
    }
}

#[test]
#[ignore = "slow: real head sizes, 300 tokens"]
fn dims_q4_k_m() {
    if let Some(d) = shared("dsv4-dims") {
        check(
            &d,
            "model-q4_k_m.gguf",
            "ref-q4_k_m.npy",
            llamacpp_rms("dsv4-dims", "q4_k_m"),
        );
    }
}

#[test]
#[ignore = "slow: real head sizes, 300 tokens"]
fn dims_upstream_fp8_block_scaled() {
    if let Some(d) = shared("dsv4-dims") {
        check_fp8(&d.join("upstream"), 64);
    }
}

/// Debug runner: per-position RMS error of a model file against its reference, with the
/// layer-0 attention input norm (trace hook), to localise where a mismatch starts.
#[test]
#[ignore = "debug runner"]
fn debug_errors_per_position() {
    let dir = tiny();
    let m = load(&dir.join("model-f32.gguf"));
    let want = lathe::npy::read_f32(dir.join("logits.npy")).unwrap();
    let v = m.hp.n_vocab;
    let mut seq = m.new_seq();
    for (p, &t) in tokens(&dir).iter().enumerate() {
        let mut l0 = 0f32;
        let got = m
            .step_traced(&mut seq, t, &mut |name, l, d| {
                if name == "attn_in" && l == 0 {
                    l0 = d.iter().map(|x| x * x).sum::<f32>().sqrt();
                }
            })
            .unwrap();
        let s = score(&got, &want.data[p * v..(p + 1) * v], v);
        eprintln!(
            "pos {p:3}: rms {:.3e} max {:.3e} |attn_in[0]| {l0:.4}",
            s.rms, s.max_abs
        );
    }
}
