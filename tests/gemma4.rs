//! Gemma-4 fixtures (`tests/oracle/make_gemma4.py`: transformers 5.24 `Gemma4ForCausalLM`
//! with random weights; llama.cpp's converter and llama-quantize for the GGUFs) through
//! `lathe::engine::logits`: every file against its reference (the HF logits; for q8_0,
//! llama.cpp on the file's dequantized weights), in one batch and with prefill T-4 then
//! one token at a time, at the fixtures' bar. The sequences are longer than the sliding
//! window.

mod common;
use common::*;
use lathe::engine::{logits, LoadOptions};

fn check_model(name: &str, opts: &LoadOptions) {
    let dir = fixtures().join(name);
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
    let t = ids.len();
    for f in ["model-f32.gguf", "model-q8_0.gguf", ""] {
        let path = if f.is_empty() {
            dir.clone()
        } else {
            dir.join(f)
        };
        let want = lathe::npy::read_f32(reference_for(&dir, f)).unwrap();
        let ty = f
            .strip_prefix("model-")
            .and_then(|s| s.strip_suffix(".gguf"))
            .unwrap_or("f32");
        for prefill in [t, t - 4] {
            let (got, vocab) = logits(&path, &ids, prefill, opts).unwrap();
            let s = score(&got, &want.data, vocab);
            let label = format!(
                "{name}/{} prefill {prefill}",
                if f.is_empty() { "hf" } else { f }
            );
            assert_bar(&label, &s, llamacpp_rms(name, ty));
        }
    }
}

#[test]
fn gemma4_tiny() {
    check_model("gemma4-tiny", &LoadOptions::default());
}

/// The MoE fixture's experts as the planner sees them, from GGUF (`ffn_gate_up_exps`) and HF
/// (`experts.gate_up_proj`): fused gate+up stacks split in place, gate rows first, so an
/// expert's gate and up are the first and last halves of its fused matrix.
#[test]
fn gemma4moe_tiny_experts_read_fused() {
    use lathe::model_file::ModelFile;
    use lathe::moe::{ExpertWeights, MoeInfo};
    let dir = fixtures().join("gemma4moe-tiny");
    for path in [dir.join("model-f32.gguf"), dir.clone()] {
        let f = ModelFile::open(&path).unwrap();
        let names = lathe::models::registry::expert_names(&f);
        let info = MoeInfo::from_file(&f, names).unwrap();
        assert_eq!((info.n_layer, info.n_used, info.layers.len()), (3, 2, 3));
        let m = &info.layers[1];
        assert_eq!((m.n_expert, m.n_ff(), m.n_embd()), (4, 32, 64));
        let w = ExpertWeights::from_file(&f, names, m).unwrap();
        let fused = f
            .tensors()
            .find(|t| t.name.contains(".1.") && t.name.contains("gate_up"))
            .unwrap();
        let half = (32 * 64 * 4) as usize;
        for e in 0..4 {
            let all = &fused.data[e * 2 * half..(e + 1) * 2 * half];
            assert_eq!(&w.gate.expert(e).unwrap()[..], &all[..half]);
            assert_eq!(&w.up.expert(e).unwrap()[..], &all[half..]);
        }
        let hp = lathe::models::gemma4::Hparams::from_file(&f).unwrap();
        let moe = hp.moe.unwrap();
        assert_eq!((moe.n_expert, moe.n_used, moe.n_ff_exp), (4, 2, 32));
        assert!(hp.layers.iter().all(|g| g.moe));
    }
}

/// The MoE fixture (three MoE blocks, 4 experts, 2 per token) at the same bars.
#[test]
fn gemma4moe_tiny() {
    check_model("gemma4moe-tiny", &LoadOptions::default());
}

/// Half the experts left on the CPU (`moe::Offload`: the arena's hot experts and the CPU's
/// cold GeGLU pairs summed in slot order), at the same bars.
#[test]
fn gemma4moe_tiny_offloaded() {
    let opts = LoadOptions {
        gpu_experts: Some(0.5),
        ..Default::default()
    };
    check_model("gemma4moe-tiny", &opts);
}

/// `src` with every MoE block's fused `ffn_gate_up_exps` `[E, 2F, H]` written as separate
/// `ffn_gate_exps` and `ffn_up_exps` stacks `[E, F, H]` (each expert's first and last F rows),
/// the layout llama.cpp's Gemma-4 graph also loads.
fn gguf_with_gate_up_apart(src: &std::path::Path, tag: &str) -> std::path::PathBuf {
    use lathe::gguf::{GgufFile, GgufWriter};
    let g = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        w.set(k.clone(), v.clone()).unwrap();
    }
    // (name, dtype, shape, bytes) of the written tensors, in order
    let mut out: Vec<(String, lathe::DType, Vec<u64>, Vec<u8>)> = Vec::new();
    let mut split = 0;
    for t in g.tensors() {
        let Some(blk) = t.name.strip_suffix("ffn_gate_up_exps.weight") else {
            out.push((
                t.name.to_string(),
                t.dtype,
                t.shape.to_vec(),
                t.data.to_vec(),
            ));
            continue;
        };
        let (ne, f2) = (t.shape[0] as usize, t.shape[1] as usize);
        let row = t.data.len() / (ne * f2);
        let half = |first: usize| -> Vec<u8> {
            (0..ne)
                .flat_map(|x| {
                    let at = (x * f2 + first) * row;
                    t.data[at..at + f2 / 2 * row].to_vec()
                })
                .collect()
        };
        let shape = vec![t.shape[0], t.shape[1] / 2, t.shape[2]];
        for (name, first) in [("ffn_gate_exps", 0), ("ffn_up_exps", f2 / 2)] {
            out.push((
                format!("{blk}{name}.weight"),
                t.dtype,
                shape.clone(),
                half(first),
            ));
        }
        split += 1;
    }
    assert!(split > 0, "{}: no fused gate+up stack", src.display());
    for (name, dtype, shape, _) in &out {
        w.add_tensor_info(name, *dtype, shape).unwrap();
    }
    let path = std::env::temp_dir().join(format!(
        "lathe-gemma4-apart-{}-{tag}.gguf",
        std::process::id()
    ));
    w.write(&path, |i, o| o.write_all(&out[i].3)).unwrap();
    path
}

/// Separate gate and up expert stacks load as the fused one does: the same expert rows, so
/// logits bit for bit those of the fused file, whole and with prefill T-4, the experts all
/// on the GPU and half on the CPU.
#[test]
fn gemma4moe_tiny_gate_up_apart() {
    let dir = fixtures().join("gemma4moe-tiny");
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
    let t = ids.len();
    for f in ["model-f32.gguf", "model-q8_0.gguf"] {
        let fused = dir.join(f);
        let apart = gguf_with_gate_up_apart(&fused, f);
        for gpu_experts in [None, Some(0.5)] {
            let opts = LoadOptions {
                gpu_experts,
                ..Default::default()
            };
            for prefill in [t, t - 4] {
                let (want, _) = logits(&fused, &ids, prefill, &opts).unwrap();
                let (got, _) = logits(&apart, &ids, prefill, &opts).unwrap();
                let same = got.len() == want.len()
                    && got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{f} experts {gpu_experts:?} prefill {prefill}: apart differs"
                );
            }
        }
        std::fs::remove_file(apart).unwrap();
    }
}

/// The per-layer token table stays in host memory (read per pass): the planner's GPU bytes
/// of the E4B-layout fixture are every tensor's but the table's, from GGUF and HF.
#[test]
fn gemma4e_tiny_token_table_not_in_gpu_budget() {
    use lathe::model_file::ModelFile;
    use lathe::moe::MoeInfo;
    let dir = fixtures().join("gemma4e-tiny");
    for (path, table) in [
        (dir.join("model-q8_0.gguf"), "per_layer_token_embd.weight"),
        (dir.clone(), "model.embed_tokens_per_layer.weight"),
    ] {
        let f = ModelFile::open(&path).unwrap();
        let info = MoeInfo::from_file(&f, lathe::models::registry::expert_names(&f)).unwrap();
        let all: u64 = f.tensors().map(|t| t.data.len() as u64).sum();
        let t = f.tensor(table).unwrap().data.len() as u64;
        assert!(t > 0);
        assert_eq!(info.other_bytes, all - t, "{}", path.display());
    }
}

/// The E2B/E4B layout (`gemma4e-tiny`: per-layer embeddings of 16 columns per block, the
/// last 3 of 6 blocks sharing the KV of blocks 1 (sliding) and 2 (global), their FFN double
/// wide) at the same bars, on the default (f32) KV rows: there lathe is the HF math to ~3e-6
/// RMS, where f16 rows (`--kv-type f16`, as llama.cpp's manifest run) give 2.205e-3 on the
/// f32 file, level with llama.cpp's own 2.198e-3 rather than under it.
#[test]
fn gemma4e_tiny() {
    check_model("gemma4e-tiny", &LoadOptions::default());
}

/// What the E4B fixture's files say, from GGUF and HF alike: the per-layer width found from
/// the per-layer token table, the KV blocks of the shared blocks, and the shared blocks'
/// double-wide FFN (GGUF per-layer `feed_forward_length`, HF `use_double_wide_mlp`).
#[test]
fn gemma4e_tiny_hparams() {
    use lathe::model_file::ModelFile;
    let dir = fixtures().join("gemma4e-tiny");
    for path in [dir.join("model-f32.gguf"), dir.clone()] {
        let f = ModelFile::open(&path).unwrap();
        let hp = lathe::models::gemma4::Hparams::from_file(&f).unwrap();
        assert_eq!((hp.n_epl, hp.n_kv_shared, hp.n_kv_layers()), (16, 3, 3));
        let kv: Vec<usize> = (0..hp.n_layer).map(|l| hp.kv_layer(l)).collect();
        assert_eq!(kv, [0, 1, 2, 1, 1, 2], "{}", path.display());
        let ff: Vec<usize> = hp.layers.iter().map(|g| g.n_ff).collect();
        assert_eq!(ff, [64, 64, 64, 128, 128, 128], "{}", path.display());
        // KV bytes per token and sequence: K and V rows (f32 by default, f16 asked for) of
        // the three own-KV blocks only, two of 1 head × 32 and one of 1 × 64 (all six blocks
        // would need twice that).
        for (kv_type, elem) in [
            (lathe::engine::KvType::Auto, 4),
            (lathe::engine::KvType::F16, 2),
        ] {
            let opts = LoadOptions {
                kv_type,
                ..Default::default()
            };
            let run = lathe::moe::RunShape::new(&opts, 8);
            let whole = lathe::model_file::PartSpec::whole(hp.n_layer);
            let needs = lathe::models::gemma4::gpu::needs_part(&hp, run, &whole);
            let seqs = opts.max_seqs.max(1) as u64;
            assert_eq!(needs.kv_per_token, 2 * (32 + 32 + 64) * elem * seqs);
        }
    }
}

/// A checkpoint whose config disagrees with its per-layer table, or lacks the table, is
/// refused in words naming the file and the tensor.
#[test]
fn gemma4e_tiny_bad_per_layer_config() {
    use lathe::model_file::ModelFile;
    let src = fixtures().join("gemma4e-tiny");
    let cfg = std::fs::read_to_string(src.join("config.json")).unwrap();
    let dir = std::env::temp_dir().join(format!("lathe-gemma4e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let bad = cfg.replace(
        "\"hidden_size_per_layer_input\": 16",
        "\"hidden_size_per_layer_input\": 8",
    );
    assert_ne!(bad, cfg);
    std::fs::write(dir.join("config.json"), bad).unwrap();
    let err = lathe::models::gemma4::Hparams::from_file(&ModelFile::open(&dir).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.embed_tokens_per_layer.weight") && err.contains("says 8"),
        "{err}"
    );
    // gemma4-tiny's weights (no per-layer table) under a config that asks for one.
    let dense = fixtures().join("gemma4-tiny");
    let cfg = std::fs::read_to_string(dense.join("config.json")).unwrap();
    let bad = cfg.replace(
        "\"hidden_size_per_layer_input\": 0",
        "\"hidden_size_per_layer_input\": 16",
    );
    assert_ne!(bad, cfg);
    std::fs::write(dir.join("config.json"), bad).unwrap();
    std::fs::copy(
        dense.join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let err = lathe::models::gemma4::Hparams::from_file(&ModelFile::open(&dir).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no tensor model.embed_tokens_per_layer.weight")
            && err.contains(&dir.display().to_string()),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Sequences fed in one `forward_batch` get the logits each gets alone, dense, MoE and E4B.
#[test]
fn gemma4_batched_equals_lone() {
    for name in ["gemma4-tiny", "gemma4moe-tiny", "gemma4e-tiny"] {
        let dir = fixtures().join(name);
        let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
        let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
        check_batched_equals_lone(name, &dir.join("model-q8_0.gguf"), &ids);
    }
}

/// The dispatch labels of one profiled decode step of fixture `name`'s q8_0 file, after a
/// 3-token prompt.
fn step_labels(name: &str) -> Vec<String> {
    let path = fixtures().join(name).join("model-q8_0.gguf");
    let mut e = lathe::engine::Engine::load(&path, &LoadOptions::default()).unwrap();
    let mut seq = e.new_seq().unwrap();
    e.forward(&mut seq, &[1, 2, 3], false).unwrap();
    let prof = e.profile_step(&mut seq, 4).unwrap();
    prof.into_iter().map(|(l, _)| l).collect()
}

/// A Gemma-4 decode step's dispatches (GPU timestamps, which lavapipe has): per block the q, k
/// (and v) products, one q/k/v norm + RoPE + cache write, the attention, the output product,
/// a sandwich norm (post-attention norm, residual add, pre-FFN norm; on MoE blocks the router's
/// and the experts' input norms too), gate+up with the GeGLU in its store, down (the routed
/// experts on MoE blocks) and a second sandwich (post-FFN norm(s), add, `layer_scalar`, the
/// next norm); the embedding's scale and block 0's norm one more sandwich. No separate
/// RMSNorm, RoPE, cache write, add, scale or copy; no dense GeGLU.
#[test]
fn gemma4_decode_step_fuses_norms_rope_and_geglu() {
    for (name, blocks) in [("gemma4-tiny", 5), ("gemma4moe-tiny", 3)] {
        let labels = step_labels(name);
        let count = |op: &str| labels.iter().filter(|l| **l == op).count();
        assert_eq!(count("qk_norm_rope"), blocks, "{name}: {labels:?}");
        assert_eq!(count("sandwich_norm"), 2 * blocks + 1, "{name}: {labels:?}");
        let gate_up = labels.iter().filter(|l| l.ends_with("ffn_gate.weight+up"));
        assert_eq!(gate_up.count(), blocks, "{name}: {labels:?}");
        for op in [
            "rms_norm",
            "rope",
            "write_kv",
            "add_inplace",
            "scale_inplace",
            "copy",
        ] {
            assert_eq!(count(op), 0, "{name}: {op} in {labels:?}");
        }
        if name == "gemma4-tiny" {
            assert_eq!(count("geglu"), 0, "{name}: {labels:?}");
        }
    }
    // E4B: the 3 own-KV blocks fused; the 3 KV-shared ones norm and rotate q alone and write
    // no rows; each block's per-layer tail joins through one more sandwich.
    let labels = step_labels("gemma4e-tiny");
    let count = |op: &str| labels.iter().filter(|l| **l == op).count();
    for (op, want) in [
        ("qk_norm_rope", 3),
        ("rope", 3),
        ("write_kv", 0),
        ("sandwich_norm", 3 * 6 + 1),
    ] {
        assert_eq!(count(op), want, "gemma4e-tiny: {op} in {labels:?}");
    }
}
