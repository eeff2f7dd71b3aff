//! Step-3.7 fixture (`tests/oracle/make_step37.py`: transformers 5.24
//! `Step3p7ForConditionalGeneration` with random weights, in the release's checkpoint layout;
//! llama.cpp's converter and llama-quantize for the GGUFs) through `lathe::engine::logits`:
//! every file against its reference (the HF logits; for q8_0, llama.cpp on the file's
//! dequantized weights), in one batch and with prefill T-4 then one token at a time, at the
//! fixtures' bar. Its blocks differ in heads, rotary width and RoPE base (full and sliding),
//! two dense blocks come before the MoE ones, and the sequence is longer than the window.

mod common;
use common::*;
use lathe::engine::{logits, LoadOptions};

const NAME: &str = "step37-tiny";

fn check(file: &str) {
    check_with(file, &LoadOptions::default())
}

fn check_with(file: &str, opts: &LoadOptions) {
    let dir = fixtures().join(NAME);
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
    let t = ids.len();
    let path = if file.is_empty() {
        dir.clone()
    } else {
        dir.join(file)
    };
    let want = lathe::npy::read_f32(reference_for(&dir, file)).unwrap();
    let ty = file
        .strip_prefix("model-")
        .and_then(|s| s.strip_suffix(".gguf"))
        .unwrap_or("f32");
    for prefill in [t, t - 4] {
        let (got, vocab) = logits(&path, &ids, prefill, opts).unwrap();
        let s = score(&got, &want.data, vocab);
        let label = format!(
            "{NAME}/{} prefill {prefill}",
            if file.is_empty() { "hf" } else { file }
        );
        assert_bar(&label, &s, llamacpp_rms(NAME, ty));
    }
}

#[test]
fn step37_tiny_gguf_f32() {
    check("model-f32.gguf");
}

#[test]
fn step37_tiny_gguf_q8_0() {
    check("model-q8_0.gguf");
}

#[test]
fn step37_tiny_hf() {
    check("");
}

/// Half of each MoE layer's experts off the GPU (the arena and the CPU's cold path, the
/// SwiGLU clamp of blocks 3-4 included), from the GGUF stacks and from the checkpoint's
/// `moe.*_proj.weight` stacks: the same logits at the same bar.
#[test]
fn step37_tiny_offloaded() {
    let opts = LoadOptions {
        gpu_experts: Some(0.5),
        ..Default::default()
    };
    check_with("model-f32.gguf", &opts);
    check_with("", &opts);
}

/// The head-wise gate is part of the architecture: a step35 file without one block's
/// `attn_gate.weight` is refused with the tensor's name, not run without the gate.
#[test]
fn step37_missing_attn_gate_is_named() {
    use lathe::gguf::{GgufFile, GgufWriter};
    let src = GgufFile::open(fixtures().join(NAME).join("model-f32.gguf")).unwrap();
    let drop = "blk.1.attn_gate.weight";
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.set(k.clone(), v.clone()).unwrap();
    }
    let kept: Vec<_> = src.tensors().filter(|t| t.name != drop).collect();
    assert_eq!(
        kept.len() + 1,
        src.tensors().count(),
        "{drop} is in the fixture"
    );
    for t in &kept {
        w.add_tensor_info(t.name, t.dtype, t.shape).unwrap();
    }
    let path = std::env::temp_dir().join(format!("step37-no-gate-{}.gguf", std::process::id()));
    w.write(&path, |i, out| out.write_all(kept[i].data))
        .unwrap();
    let r = logits(&path, &[1, 2, 3], 3, &LoadOptions::default());
    std::fs::remove_file(&path).unwrap();
    let e = r.expect_err("a file without its attention gate must not load");
    assert!(
        e.to_string().contains(drop),
        "error does not name {drop}: {e}"
    );
}

/// Greedy tokens of `path` (the MTP block from `mtp` where given) after a prompt of the
/// fixture's tokens, speculating as `spec` asks; the speculation counts where it ran.
fn greedy(
    path: &std::path::Path,
    mtp: Option<&std::path::Path>,
    spec: lathe::spec::SpecOptions,
) -> (Vec<u32>, Option<lathe::spec::SpecStats>) {
    use lathe::generate::{generate, GenerateOptions};
    let opts = LoadOptions {
        max_seqs: 2,
        ctx: 128,
        mtp_model: mtp.map(|p| p.to_path_buf()),
        ..Default::default()
    };
    let mut eng = lathe::engine::Engine::load(path, &opts).unwrap();
    let dir = fixtures().join(NAME);
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let prompt: Vec<u32> = toks.data[..12].iter().map(|&t| t as u32).collect();
    let g = GenerateOptions {
        max_tokens: Some(20),
        sampler: lathe::sample::SamplerConfig::greedy(),
        ignore_eog: true,
        spec,
        ..Default::default()
    };
    let out = generate(&mut eng, &prompt, &g, |_| {}).unwrap();
    (out.tokens, out.spec)
}

fn spec(mode: lathe::spec::SpecMode, draft: usize) -> lathe::spec::SpecOptions {
    lathe::spec::SpecOptions {
        mode,
        draft,
        ..Default::default()
    }
}

/// `--spec mtp` with the MTP block from its own GGUF (`mtp-f32.gguf`: 6 blocks declared,
/// the trunk's file 5) and from the HF checkpoint that holds both: greedy output token for
/// token the plain decode's, for drafts of 1 to 3 (verify rows are one-token passes).
#[test]
fn step37_mtp_speculation_keeps_greedy_output() {
    use lathe::spec::SpecMode;
    let dir = fixtures().join(NAME);
    let (trunk, mtp) = (dir.join("model-f32.gguf"), dir.join("mtp-f32.gguf"));
    let (plain, none) = greedy(&trunk, None, spec(SpecMode::Off, 1));
    assert!(none.is_none());
    assert_eq!(plain.len(), 20);
    for k in 1..=3 {
        let (got, st) = greedy(&trunk, Some(&mtp), spec(SpecMode::Mtp, k));
        assert_eq!(got, plain, "gguf + mtp-f32.gguf, --draft {k}");
        let st = st.expect("speculation ran");
        assert!(st.verify_passes > 0 && st.drafted == k * st.verify_passes);
        eprintln!(
            "step37 draft {k}: acceptance {:.2}, {:.2} tokens per pass",
            st.acceptance(),
            st.tokens_per_forward()
        );
    }
    let (hf_plain, _) = greedy(&dir, None, spec(SpecMode::Off, 1));
    let (hf, st) = greedy(&dir, None, spec(SpecMode::Mtp, 2));
    assert_eq!(hf, hf_plain, "hf with its own MTP block, --draft 2");
    assert!(st.is_some_and(|s| s.verify_passes > 0));
}

/// An MTP file that does not fit the trunk is refused with the file named: one whose
/// head dim is not the trunk's, and the trunk's own file (no MTP block).
#[test]
fn step37_mismatched_mtp_file_is_named() {
    use lathe::gguf::{GgufFile, GgufWriter};
    let dir = fixtures().join(NAME);
    let trunk = dir.join("model-f32.gguf");
    let src = GgufFile::open(dir.join("mtp-f32.gguf")).unwrap();
    let key = "step35.attention.key_length";
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        let v = match k.as_str() {
            "step35.attention.key_length" | "step35.attention.value_length" => {
                lathe::gguf::Value::U32(8)
            }
            _ => v.clone(),
        };
        w.set(k.clone(), v).unwrap();
    }
    assert!(
        src.metadata().iter().any(|(k, _)| k == key),
        "{key} in the fixture"
    );
    let tensors: Vec<_> = src.tensors().collect();
    for t in &tensors {
        w.add_tensor_info(t.name, t.dtype, t.shape).unwrap();
    }
    let bad = std::env::temp_dir().join(format!("step37-mtp-hd8-{}.gguf", std::process::id()));
    w.write(&bad, |i, out| out.write_all(tensors[i].data))
        .unwrap();
    for (mtp, says) in [(bad.clone(), "head_dim 8"), (trunk.clone(), "no MTP block")] {
        let opts = LoadOptions {
            mtp_model: Some(mtp.clone()),
            ..Default::default()
        };
        let e = match lathe::engine::Engine::load(&trunk, &opts) {
            Ok(_) => panic!("{} loaded as the MTP block", mtp.display()),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains(&mtp.display().to_string()) && e.contains(says),
            "error does not name {} ({says}): {e}",
            mtp.display()
        );
    }
    std::fs::remove_file(&bad).unwrap();
}

/// `--mtp-model` with a trunk of another family (whose files carry no separate MTP block)
/// is refused with both files and the family named, not silently ignored.
#[test]
fn mtp_model_on_another_family_is_refused() {
    let mtp = fixtures().join(NAME).join("mtp-f32.gguf");
    let trunk = fixtures().join("gemma4-tiny").join("model-f32.gguf");
    let opts = LoadOptions {
        mtp_model: Some(mtp.clone()),
        ..Default::default()
    };
    let e = match lathe::engine::Engine::load(&trunk, &opts) {
        Ok(_) => panic!("{} loaded with an MTP file", trunk.display()),
        Err(e) => e.to_string(),
    };
    for want in [
        "--mtp-model".to_string(),
        mtp.display().to_string(),
        trunk.display().to_string(),
        "Gemma-4".to_string(),
    ] {
        assert!(e.contains(&want), "error lacks {want}: {e}");
    }
}

/// The MTP block's logits over the fixture's sequence (row `p`: the trunk's row `p` and
/// token `p + 1`, the last row token 0) against `mtp-logits.npy` (transformers' decoder layer
/// with the MTP weights, wired as llama.cpp's `graph_mtp`), at the fixtures' bar: from the
/// separate GGUF beside the trunk's, and from the HF checkpoint.
#[test]
fn step37_mtp_logits_match_reference() {
    use lathe::engine::Want;
    use lathe::models::spec::Hidden;
    let dir = fixtures().join(NAME);
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
    let want = lathe::npy::read_f32(dir.join("mtp-logits.npy")).unwrap();
    let mut next = ids[1..].to_vec();
    next.push(0);
    for (path, mtp) in [
        (dir.join("model-f32.gguf"), Some(dir.join("mtp-f32.gguf"))),
        (dir.clone(), None),
    ] {
        let opts = LoadOptions {
            mtp_model: mtp.clone(),
            ..Default::default()
        };
        let mut eng = lathe::engine::Engine::load(&path, &opts).unwrap();
        let mut seq = eng.new_seq().unwrap();
        let s = eng.model.speculate().expect("Step speculates");
        s.feed(&mut seq, &ids, Want::None).unwrap();
        let rows = s.mtp(&seq, Hidden::Trunk, &next, Want::All).unwrap();
        let got: Vec<f32> = rows.into_iter().flat_map(|l| l.into_full()).collect();
        let sc = score(&got, &want.data, 256);
        assert_bar(&format!("{} mtp", path.display()), &sc, None);
    }
}

/// A verify pass, a rollback that keeps two of its three rows, the MTP block over the kept
/// rows, and the next verify row: every verify row bit-equal to plain one-token decode at its
/// position (the rejected row's KV rewritten before it is read).
#[test]
fn step37_verify_and_rollback_match_decode() {
    use lathe::engine::Want;
    use lathe::models::spec::Hidden;
    let dir = fixtures().join(NAME);
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
    let opts = LoadOptions {
        mtp_model: Some(dir.join("mtp-f32.gguf")),
        ..Default::default()
    };
    let mut eng = lathe::engine::Engine::load(&dir.join("model-f32.gguf"), &opts).unwrap();
    // Plain decode of ids[12..16] after the prompt ids[..12].
    let mut plain = eng.new_seq().unwrap();
    eng.forward(&mut plain, &ids[..12], false).unwrap();
    let decode: Vec<Vec<f32>> = (12..16)
        .map(|p| eng.forward(&mut plain, &ids[p..p + 1], false).unwrap())
        .collect();
    let mut seq = eng.new_seq().unwrap();
    let s = eng.model.speculate().expect("Step speculates");
    s.feed(&mut seq, &ids[..12], Want::None).unwrap();
    // Row 14 is fed a wrong token, then rolled back.
    let rows = s
        .verify(&mut seq, &[ids[12], ids[13], 7], Want::All)
        .unwrap();
    for (j, r) in rows.iter().take(2).enumerate() {
        assert_eq!(r.clone().into_full(), decode[j], "verify row {j}");
    }
    s.rollback(&mut seq, &ids[12..14]).unwrap();
    assert_eq!(seq.pos(), 14);
    let d = s.mtp(&seq, Hidden::Trunk, &ids[13..15], Want::All).unwrap();
    assert_eq!(d.len(), 2, "one MTP row per kept trunk row");
    let rows = s.verify(&mut seq, &ids[14..16], Want::All).unwrap();
    for (j, r) in rows.iter().enumerate() {
        assert_eq!(
            r.clone().into_full(),
            decode[2 + j],
            "verify row {} after rollback",
            2 + j
        );
    }
}

/// Sequences fed in one `forward_batch` get the logits each gets alone.
#[test]
fn step37_batched_equals_lone() {
    let dir = fixtures().join(NAME);
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    let ids: Vec<u32> = toks.data.iter().map(|&t| t as u32).collect();
    check_batched_equals_lone(NAME, &dir.join("model-q8_0.gguf"), &ids);
}

/// The MTP block from its own file (`--mtp-model`) is in the budget the loader places experts
/// with and in `lathe plan`'s alike: its weights count with the non-expert weights and its KV
/// rows with the KV, so what is left for expert slots shrinks by them.
#[test]
fn mtp_file_is_in_the_budget() {
    let dir = fixtures().join(NAME);
    let (trunk, mtp) = (dir.join("model-f32.gguf"), dir.join("mtp-f32.gguf"));
    let plan = |extra: &[&std::ffi::OsStr]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lathe"))
            .args(["plan", "-m"])
            .arg(&trunk)
            .args(["--gpu-mem", "1GiB", "--ctx", "512"])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let line = |s: &str, what: &str| -> String {
        let l = s.lines().find(|l| l.trim_start().starts_with(what));
        l.unwrap_or_else(|| panic!("no `{what}` in\n{s}"))
            .trim_start()
            .trim_start_matches(what)
            .trim()
            .to_string()
    };
    let alone = plan(&[]);
    let with = plan(&["--mtp-model".as_ref(), mtp.as_os_str()]);
    eprintln!("{alone}\n{with}");
    for what in ["non-expert weights", "KV cache", "left for experts"] {
        assert_ne!(line(&alone, what), line(&with, what), "{what}");
    }
    // The loader's budget for the same run (statistics keep the offload and its report).
    for (mtp_model, report) in [(None, &alone), (Some(mtp.clone()), &with)] {
        let e = lathe::engine::Engine::load(
            &trunk,
            &LoadOptions {
                gpu_mem: vec![1 << 30],
                ctx: 512,
                max_seqs: 1,
                collect_expert_stats: true,
                mtp_model,
                ..Default::default()
            },
        )
        .unwrap();
        let mem = e.placement_report().unwrap().memory.unwrap();
        let left = line(report, "left for experts");
        assert!(
            mem.ends_with(&format!("; {left} for expert slots")),
            "loader: {mem}; lathe plan: {left}"
        );
    }
}
