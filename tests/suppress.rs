//! Suppressed tokens (GGUF `tokenizer.ggml.suppress_tokens`, a checkpoint's
//! `generation_config.json` `suppress_tokens`): on copies of fixtures that name the two ids
//! the plain file ranks first, every row's logits at those ids are
//! `runtime::head::SUPPRESSED` and every other logit is the plain file's bit for bit (whole
//! prefill and one token at a time; Gemma-4's soft-capped head and a Llama one), the GPU
//! top-k of a decode step never returns them, and an id outside the vocabulary or a
//! malformed list is refused with the key and the file named.

mod common;
use common::*;
use lathe::engine::{logits, Engine, LoadOptions};
use lathe::models::runtime::head::SUPPRESSED;
use std::path::{Path, PathBuf};

fn tmp(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lathe-suppress-{}-{tag}", std::process::id()))
}

/// `src` with `tokenizer.ggml.suppress_tokens = ids` added.
fn gguf_with(src: &Path, ids: &[i64], tag: &str) -> PathBuf {
    use lathe::gguf::{GgufFile, GgufWriter, Value};
    let g = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        w.set(k.clone(), v.clone()).unwrap();
    }
    let list = Value::Array(ids.iter().map(|&i| Value::I32(i as i32)).collect());
    w.set("tokenizer.ggml.suppress_tokens", list).unwrap();
    let tensors: Vec<_> = g.tensors().collect();
    for t in &tensors {
        w.add_tensor_info(t.name, t.dtype, t.shape).unwrap();
    }
    let out = tmp(&format!("{tag}.gguf"));
    w.write(&out, |i, o| o.write_all(tensors[i].data)).unwrap();
    out
}

/// The checkpoint `src` (its files linked) with a `generation_config.json` of `json`.
fn hf_with(src: &Path, json: &str, tag: &str) -> PathBuf {
    let out = tmp(tag);
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::os::unix::fs::symlink(src.join(f).canonicalize().unwrap(), out.join(f)).unwrap();
    }
    std::fs::write(out.join("generation_config.json"), json).unwrap();
    out
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// The masked file's logits against the plain one's, whole and with prefill T-4, and its
/// decode step's top-k.
fn check_masked(plain: &Path, masked: &Path, ids: &[u32], sup: &[u32]) {
    let t = ids.len();
    let opts = LoadOptions::default();
    for prefill in [t, t - 4] {
        let (want, v) = logits(plain, ids, prefill, &opts).unwrap();
        let (got, _) = logits(masked, ids, prefill, &opts).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let id = (i % v) as u32;
            if sup.contains(&id) {
                assert_eq!(
                    *g,
                    SUPPRESSED,
                    "{}: row {} id {id}",
                    masked.display(),
                    i / v
                );
            } else {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{}: row {} id {id}",
                    masked.display(),
                    i / v
                );
            }
        }
    }
    let (want, v) = logits(plain, ids, t, &opts).unwrap();
    let last = &want[(t - 1) * v..];
    let mut rest = last.to_vec();
    for &s in sup {
        rest[s as usize] = f32::NEG_INFINITY;
    }
    let mut e = Engine::load(masked, &opts).unwrap();
    let mut seq = e.new_seq().unwrap();
    let top = e.forward_top(&mut seq, ids, 4, true).unwrap();
    assert!(
        top.cands.iter().all(|c| !sup.contains(&c.0)),
        "{}: top-k {:?} holds a suppressed id of {sup:?}",
        masked.display(),
        top.cands
    );
    assert_eq!(top.cands[0].0, argmax(&rest), "{}", masked.display());
    let m = rest.iter().cloned().fold(f32::MIN, f32::max) as f64;
    let lse = m + rest.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    let got = top.lse.unwrap() as f64;
    assert!(
        (got - lse).abs() < 1e-4,
        "lse {got} vs {lse} without the suppressed ids"
    );
}

/// The two ids the plain file ranks first at the last and the first position.
fn top_two(plain: &Path, ids: &[u32]) -> Vec<u32> {
    let (l, v) = logits(plain, ids, ids.len(), &LoadOptions::default()).unwrap();
    let a = argmax(&l[(ids.len() - 1) * v..]);
    let mut first = l[..v].to_vec();
    first[a as usize] = f32::NEG_INFINITY;
    vec![a, argmax(&first)]
}

fn tokens(dir: &Path) -> Vec<u32> {
    let toks = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    toks.data.iter().map(|&t| t as u32).collect()
}

#[test]
fn suppressed_tokens_are_masked_in_gguf_files() {
    for (name, file) in [
        ("gemma4-tiny", "model-q8_0.gguf"),
        ("llama-tiny", "model-q8_0.gguf"),
    ] {
        let dir = fixtures().join(name);
        let plain = dir.join(file);
        let ids = tokens(&dir);
        let sup = top_two(&plain, &ids);
        let list: Vec<i64> = sup.iter().map(|&s| s as i64).collect();
        let masked = gguf_with(&plain, &list, name);
        check_masked(&plain, &masked, &ids, &sup);
        std::fs::remove_file(&masked).unwrap();
    }
}

#[test]
fn suppressed_tokens_are_masked_in_checkpoints() {
    let dir = fixtures().join("gemma4-tiny");
    let ids = tokens(&dir);
    let sup = top_two(&dir, &ids);
    let json = format!(
        r#"{{"bos_token_id": 2, "suppress_tokens": [{}, {}]}}"#,
        sup[0], sup[1]
    );
    let masked = hf_with(&dir, &json, "hf");
    check_masked(&dir, &masked, &ids, &sup);
    std::fs::remove_dir_all(&masked).unwrap();
}

#[test]
fn bad_suppress_lists_are_refused_by_name() {
    let dir = fixtures().join("llama-tiny");
    let plain = dir.join("model-f32.gguf");
    let v = Engine::load(&plain, &LoadOptions::default())
        .unwrap()
        .vocab_size() as i64;
    for (ids, says) in [
        (vec![3, v], format!("token id {v}")),
        (vec![-1], "token id -1".into()),
    ] {
        let bad = gguf_with(&plain, &ids, "bad");
        let e = Engine::load(&bad, &LoadOptions::default())
            .err()
            .expect("loaded");
        let e = e.to_string();
        assert!(
            e.contains("tokenizer.ggml.suppress_tokens")
                && e.contains(&bad.display().to_string())
                && e.contains(&says),
            "{e}"
        );
        std::fs::remove_file(&bad).unwrap();
    }
    let dir = fixtures().join("gemma4-tiny");
    for json in [
        r#"{"suppress_tokens": "1"}"#,
        r#"{"suppress_tokens": [1, "x"]}"#,
    ] {
        let bad = hf_with(&dir, json, "hfbad");
        let e = Engine::load(&bad, &LoadOptions::default())
            .err()
            .expect("loaded");
        let e = e.to_string();
        assert!(
            e.contains("generation_config.json") && e.contains("suppress_tokens"),
            "{json}: {e}"
        );
        std::fs::remove_dir_all(&bad).unwrap();
    }
}
