//! FP8 e4m3 block-scaled linears, as DeepSeek's releases store them (`X.weight` F8_E4M3 +
//! `X.scale` E8M0 per 128×128 block), through both forwards. The test writes two copies of a
//! fixture's upstream checkpoint: `fp8/` with the non-expert linears rounded to FP8, and `ref/`
//! with the same rounded values stored as F32. lathe keeps FP8 weights as FP8
//! (`F8_E4M3_B128`, 132 bytes per 128 weights) on the GPU and in RAM, so:
//! - the loader turns every FP8 linear (and FP8 routed experts, in a second copy whose experts
//!   are FP8 too) into `F8_E4M3_B128` (nothing widened to f32);
//! - CPU reference: fp8 and ref give the same logits (max_abs ≤ 1e-5: the dequantized
//!   weights are bit-identical);
//! - GPU: fp8 and ref logits agree to 1e-4 (different kernels, f32 accumulation in a
//!   different order), and the FP8 rounding really moved the logits.
//!
//! dsv4-tiny's dimensions (64, 32, 16) are not multiples of 128, which lathe's FP8 block needs
//! (DeepSeek's releases are): its FP8 copy must be refused with the tensor named. dsv4-dims
//! (real head sizes, every dimension a multiple of 128) comes from ../shared/fixtures (its
//! tests fail, saying so, when that is absent; CI has it); its CPU forward is slow (`#[ignore]`):
//! `cargo test --release --test deepseek4_fp8 -- --ignored`.

mod common;
use common::*;
use lathe::engine::{self, KvType, LoadOptions};
use lathe::models::deepseek4::cpu::CpuModel;
use lathe::models::deepseek4::{weights, Hparams};
use lathe::models::ModelFile;
use lathe::safetensors::SafetensorsFile;
use lathe::DType;
use std::path::{Path, PathBuf};

fn tiny() -> PathBuf {
    fixtures().join("dsv4-tiny")
}

fn dims() -> PathBuf {
    require_shared("dsv4-dims")
}

fn tokens(dir: &Path) -> Vec<u32> {
    let t = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    t.data.iter().map(|&v| v as u32).collect()
}

/// A fresh scratch directory for one model's FP8 pair.
fn scratch(model: &str, what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "lathe-dsv4-fp8-{}-{model}-{what}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

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

/// A routed expert's weight (`layers.L.ffn.experts.E.wN.weight`).
fn is_expert_weight(name: &str) -> bool {
    name.contains(".ffn.experts.") && name.ends_with(".weight")
}

/// Writes two copies of an upstream checkpoint under `dir`: `fp8/` with the FP8 linears (and,
/// with `experts`, the routed experts, dequantized from their MXFP4 first) as F8_E4M3 +
/// `.scale` F8_E8M0, and `ref/` with the same rounded values stored as F32. Returns how many
/// tensors were rounded.
fn write_fp8_pair(upstream: &Path, dir: &Path, experts: bool) -> usize {
    let src = SafetensorsFile::open(upstream.join("model.safetensors")).unwrap();
    let (mut fp8, mut refw) = (Vec::new(), Vec::new());
    let mut n = 0;
    for t in src.tensors() {
        let expert = experts && is_expert_weight(t.name);
        if experts && t.name.contains(".ffn.experts.") && t.name.ends_with(".scale") {
            continue; // the MXFP4 scales: replaced by the FP8 block scales below
        }
        if !is_fp8_linear(t.name) && !expert {
            let raw = (
                t.name.to_string(),
                dtype_str(t.dtype),
                t.shape.to_vec(),
                t.data.to_vec(),
            );
            fp8.push(raw.clone());
            refw.push(raw);
            continue;
        }
        let (w, shape) = if expert {
            let sname = t.name.replace(".weight", ".scale");
            let scale = src.tensor(&sname).unwrap();
            let shape = vec![t.shape[0], t.shape[1] * 2];
            let mut w = vec![0f32; (shape[0] * shape[1]) as usize];
            lathe::safetensors::dequant_mxfp4_packed(&t, &scale, &mut w).unwrap();
            (w, shape)
        } else {
            (lathe::models::read_f32(&t).unwrap(), t.shape.to_vec())
        };
        let (rows, cols) = (shape[0] as usize, shape[1] as usize);
        let (codes, scales, vals) = fp8_blocks(&w, rows, cols);
        let sname = format!("{}.scale", t.name.strip_suffix(".weight").unwrap());
        fp8.push((t.name.to_string(), "F8_E4M3", shape.clone(), codes));
        fp8.push((
            sname,
            "F8_E8M0",
            vec![rows.div_ceil(128) as u64, cols.div_ceil(128) as u64],
            scales,
        ));
        refw.push((
            t.name.to_string(),
            "F32",
            shape,
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

/// Every FP8 linear (and FP8 expert stack) of the written checkpoint loads as `F8_E4M3_B128`
/// with 132 bytes per 128 weights, and no weight but `tid2eid` (ids) comes out as computed f32.
fn check_loaded_types(fp8_dir: &Path, n_fp8: usize, expert_stacks: bool) {
    let f = ModelFile::open(fp8_dir).unwrap();
    let hp = Hparams::from_file(&f).unwrap();
    let mut n = 0;
    weights::load(&f, &hp, |w| {
        let (dt, name) = (w.dtype(), w.name().to_string());
        if is_fp8_linear(&name) || (expert_stacks && is_expert_weight(&name)) {
            assert_eq!(dt, DType::F8_E4M3_B128, "{name}");
            let elems: u64 = w.shape().iter().product();
            w.with_tensor(|t| {
                assert_eq!(t.data.len() as u64, elems / 128 * 132, "{name}");
                Ok(())
            })
            .unwrap();
            // a stack of n_expert FP8 tensors counts as that many
            n += if w.shape().len() == 3 {
                w.shape()[0] as usize
            } else {
                1
            };
        }
        if matches!(w, lathe::models::Weight::F32 { .. }) {
            assert!(name.contains("tid2eid"), "{name} widened to f32");
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(n, n_fp8, "FP8 linears loaded");
}

/// dsv4-tiny's linears have 32 or 64 columns: the FP8 copy is refused by both forwards,
/// naming a tensor and the 128-column requirement.
#[test]
fn tiny_fp8_partial_column_blocks_are_refused() {
    let dir = scratch("tiny", "refused");
    let n = write_fp8_pair(&tiny().join("upstream"), &dir, false);
    assert!(n > 0);
    let f = ModelFile::open(dir.join("fp8")).unwrap();
    let cpu = CpuModel::load(&f)
        .err()
        .expect("CPU load of FP8 with 64 columns");
    let gpu = engine::Engine::load(&dir.join("fp8"), &LoadOptions::default())
        .err()
        .expect("GPU load of FP8 with 64 columns");
    std::fs::remove_dir_all(&dir).unwrap();
    for e in [cpu.to_string(), gpu.to_string()] {
        assert!(
            e.contains("multiple of 128") && e.contains(".weight"),
            "{e}"
        );
    }
}

/// GPU forward of the FP8 copy against the GPU forward of the same rounded weights in f32
/// (whole prefill, and prefill + 4 decode steps), and against the unrounded reference. The
/// routed experts stay MXFP4 as released; FP8 expert stacks are checked at the loader (below)
/// and by the CPU forward (`dims_fp8_cpu`): the GPU's expert planner (`moe::layout`) takes
/// every release-layout expert for packed MXFP4.
#[test]
fn dims_fp8_gpu() {
    let d = dims();
    let dir = scratch("dims", "gpu");
    let n = write_fp8_pair(&d.join("upstream"), &dir, false);
    check_loaded_types(&dir.join("fp8"), n, false);
    let toks = tokens(&d);
    let toks = &toks[..64];
    let t = toks.len();
    let orig = lathe::npy::read_f32(d.join("logits.npy")).unwrap();
    let opts = LoadOptions {
        kv_type: KvType::F32,
        ..Default::default()
    };
    for prefill in [t, t - 4] {
        let (a, v) = engine::logits(&dir.join("fp8"), toks, prefill, &opts).unwrap();
        let (b, _) = engine::logits(&dir.join("ref"), toks, prefill, &opts).unwrap();
        let s = score(&a, &b, v);
        let moved = score(&a, &orig.data[..a.len()], v);
        eprintln!(
            "dsv4-dims FP8 ({n} tensors) GPU prefill {prefill}/{t} vs f32 of the rounded weights: max_abs {:.3e} rms {:.3e}; vs the unrounded reference: rms {:.3e} top1 {:.3}",
            s.max_abs, s.rms, moved.rms, moved.top1
        );
        assert!(
            s.max_abs <= 1e-4,
            "GPU FP8 forward differs from its f32 reference by {:.3e}",
            s.max_abs
        );
        assert!(
            moved.max_abs > 1e-3,
            "FP8 rounding left the logits unchanged: were the weights rounded?"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The loader makes FP8 routed experts `F8_E4M3_B128` stacks too.
#[test]
fn dims_fp8_experts_load_as_fp8_blocks() {
    let d = dims();
    let dir = scratch("dims", "experts-types");
    let n = write_fp8_pair(&d.join("upstream"), &dir, true);
    check_loaded_types(&dir.join("fp8"), n, true);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// CPU reference: the FP8 copy and the f32 copy of the rounded weights give the same logits.
#[test]
#[ignore = "slow: real head sizes on the CPU reference"]
fn dims_fp8_cpu() {
    let d = dims();
    let dir = scratch("dims", "cpu");
    let n = write_fp8_pair(&d.join("upstream"), &dir, true);
    let toks = tokens(&d);
    let toks = &toks[..64];
    let load = |p: PathBuf| CpuModel::load(&ModelFile::open(p).unwrap()).unwrap();
    let (fp8, refm) = (load(dir.join("fp8")), load(dir.join("ref")));
    let run = |m: &CpuModel| -> Vec<f32> {
        let mut seq = m.new_seq();
        toks.iter()
            .flat_map(|&t| m.step(&mut seq, t).unwrap())
            .collect()
    };
    let (a, b) = (run(&fp8), run(&refm));
    let v = fp8.hp.n_vocab;
    let s = score(&a, &b, v);
    let orig = lathe::npy::read_f32(d.join("logits.npy")).unwrap();
    let moved = score(&a, &orig.data[..a.len()], v);
    eprintln!(
        "dsv4-dims FP8 ({n} tensors, experts included) CPU vs f32 of the rounded weights: max_abs {:.3e}; vs the unrounded reference: rms {:.3e} top1 {:.3}",
        s.max_abs, moved.rms, moved.top1
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
