//! Tokenizers against independent references: tiktoken's ids for the Qwen3.5/3.6 vocabulary,
//! Hugging Face `tokenizers` for DeepSeek-V4, llama.cpp's own test vectors for its `qwen35`
//! pre-tokenizer. Regenerate the expected files with `../shared/oracle/` scripts.

use std::path::{Path, PathBuf};

use lathe::tokenizer::{GgufVocab, StreamDecoder, Tokenizer};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

/// `[(text, ids)]` from an expected.json.
fn cases(path: &Path) -> Vec<(String, Vec<u32>)> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let text = c["text"].as_str().unwrap().to_string();
            let ids = c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap() as u32)
                .collect();
            (text, ids)
        })
        .collect()
}

fn check_cases(tok: &Tokenizer, expected: &Path, what: &str) {
    let cases = cases(expected);
    assert!(cases.len() >= 20, "{what}: only {} cases", cases.len());
    for (text, ids) in &cases {
        let got = tok.encode(text, true).unwrap();
        assert_eq!(&got, ids, "{what}: encode({text:?})");
        assert_eq!(&tok.decode(&got), text, "{what}: decode(encode({text:?}))");
    }
}

/// The GGUF view of a tokenizer.json: vocabulary strings by id, merges as "a b", added tokens
/// as control tokens (type 3), everything else normal (type 1).
/// A tokenizer.json's text, gunzipped when the fixture is stored as `.json.gz`.
fn read_json_text(path: &Path) -> String {
    let gz = path.with_extension("json.gz");
    if !path.exists() && gz.exists() {
        let mut s = String::new();
        std::io::Read::read_to_string(
            &mut flate2::read::GzDecoder::new(std::fs::File::open(&gz).unwrap()),
            &mut s,
        )
        .unwrap();
        return s;
    }
    std::fs::read_to_string(path).unwrap()
}

fn gguf_vocab_from_hf(path: &Path, pre: &str) -> GgufVocab {
    let j: Value = serde_json::from_str(&read_json_text(path)).unwrap();
    let vocab = j["model"]["vocab"].as_object().unwrap();
    let added = j["added_tokens"].as_array().unwrap();
    let n = vocab
        .values()
        .map(|v| v.as_u64().unwrap())
        .chain(added.iter().map(|a| a["id"].as_u64().unwrap()))
        .max()
        .unwrap() as usize
        + 1;
    let mut tokens = vec![String::new(); n];
    let mut types = vec![1i32; n];
    for (t, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = t.clone();
    }
    for a in added {
        let id = a["id"].as_u64().unwrap() as usize;
        tokens[id] = a["content"].as_str().unwrap().to_string();
        types[id] = 3;
    }
    // Unused ids (holes) are unused-type tokens with unique placeholder text, as llama.cpp's
    // converter writes them.
    for (id, t) in tokens.iter_mut().enumerate() {
        if t.is_empty() {
            *t = format!("[PAD{id}]");
            types[id] = 5;
        }
    }
    let merges = j["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Value::String(s) => s.clone(),
            Value::Array(p) => format!("{} {}", p[0].as_str().unwrap(), p[1].as_str().unwrap()),
            _ => panic!("merge {m}"),
        })
        .collect();
    GgufVocab {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens,
        token_types: Some(types),
        merges,
        ..Default::default()
    }
}

#[test]
fn qwen36_matches_tiktoken() {
    let dir = fixtures().join("qwen36");
    let tok = Tokenizer::from_file(dir.join("tokenizer.json.gz")).unwrap();
    check_cases(&tok, &dir.join("expected.json"), "qwen36");
    let im_end = tok.token_id("<|im_end|>").unwrap();
    let eot = tok.token_id("<|endoftext|>").unwrap();
    assert_eq!(tok.eot_id(), Some(im_end));
    assert!(tok.is_eog(im_end) && tok.is_eog(eot));
    assert!(!tok.is_eog(tok.token_id("<|im_start|>").unwrap()));
    assert!(!tok.is_eog(9419));
    assert_eq!(tok.vocab_size(), 248_070);
    assert_eq!(tok.token_text(21251).as_deref(), Some("ĠHello"));
    // Without special parsing the markers are plain text.
    let plain = tok.encode("<|im_start|>user", false).unwrap();
    assert!(!plain.contains(&248_045), "{plain:?}");
    assert_eq!(tok.decode(&plain), "<|im_start|>user");
}

#[test]
fn deepseek_v4_matches_hf_tokenizers() {
    let dir = fixtures().join("deepseek-v4");
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    check_cases(&tok, &dir.join("expected.json"), "deepseek-v4");
    assert_eq!(tok.bos_id(), Some(0));
    assert_eq!(tok.eos_id(), Some(1));
    assert!(!tok.add_bos());
    assert!(tok.is_eog(1));
    assert_eq!(
        tok.encode_with_bos("Hello world", false).unwrap(),
        vec![19923, 2058]
    );
    let special = tok.encode("<｜begin▁of▁sentence｜>Hi", true).unwrap();
    assert_eq!(special[0], 0);
}

#[test]
fn gguf_vocab_path_matches_qwen36() {
    let dir = fixtures().join("qwen36");
    let v = gguf_vocab_from_hf(&dir.join("tokenizer.json"), "qwen35");
    let tok = Tokenizer::from_gguf_vocab(v).unwrap();
    check_cases(&tok, &dir.join("expected.json"), "qwen36 via GgufVocab");
}

#[test]
fn gguf_vocab_path_matches_deepseek_v4() {
    let dir = fixtures().join("deepseek-v4");
    let mut v = gguf_vocab_from_hf(&dir.join("tokenizer.json"), "deepseek-v3");
    v.bos = Some(0);
    v.eos = Some(1);
    let tok = Tokenizer::from_gguf_vocab(v).unwrap();
    check_cases(
        &tok,
        &dir.join("expected.json"),
        "deepseek-v4 via GgufVocab",
    );
    assert!(tok.is_eog(1));
}

#[test]
fn llamacpp_qwen35_vocab_vectors() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures/tokenizer/qwen35-llamacpp-vocab");
    let gguf = dir.join("ggml-vocab-qwen35.gguf");
    assert!(
        gguf.is_file(),
        "{} is absent: this test needs ../shared/fixtures (llama.cpp's files stay there, never \
         copied; CI has it)",
        gguf.display()
    );
    let file = lathe::gguf::GgufFile::open(&gguf).unwrap();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let inp = std::fs::read_to_string(dir.join("ggml-vocab-qwen35.gguf.inp")).unwrap();
    let out = std::fs::read_to_string(dir.join("ggml-vocab-qwen35.gguf.out")).unwrap();
    // Every text is followed by the separator, the last one too.
    let sep = "\n__ggml_vocab_test__\n";
    let texts: Vec<&str> = inp.strip_suffix(sep).unwrap_or(&inp).split(sep).collect();
    let ids: Vec<&str> = out.lines().collect();
    assert_eq!(texts.len(), ids.len(), "texts vs id lines");
    for (text, line) in texts.iter().zip(&ids) {
        let want: Vec<u32> = line
            .split_whitespace()
            .map(|t| t.parse().unwrap())
            .collect();
        // llama.cpp's test tokenizes with special parsing off and no BOS.
        let got = tok.encode(text, false).unwrap();
        assert_eq!(got, want, "encode({text:?})");
        assert_eq!(&tok.decode(&got), text, "decode(encode({text:?}))");
    }
    assert_eq!(tok.eos_id(), Some(151_643));
    assert!(tok.is_eog(151_643) && tok.is_eog(151_645));
    assert!(tok.chat_template().unwrap().contains("<|im_start|>"));
}

#[test]
fn gguf_without_vocabulary_says_so() {
    let v = GgufVocab {
        model: "none".into(),
        ..Default::default()
    };
    let err = Tokenizer::from_gguf_vocab(v).expect_err("an error");
    assert!(
        err.to_string()
            .contains("this model has no vocabulary; pass token ids"),
        "{err}"
    );
}

#[test]
fn stream_decoder_never_splits_a_character() {
    let tok = Tokenizer::from_file(fixtures().join("qwen36/tokenizer.json.gz")).unwrap();
    let text = "Emoji 🦙🚀👍🏽 and flags 🇯🇵, café — 中文测试";
    let ids = tok.encode(text, true).unwrap();
    // The emoji are spread over byte tokens that are not valid UTF-8 alone.
    let partial = ids
        .iter()
        .filter(|&&id| std::str::from_utf8(tok.token_bytes(id).unwrap()).is_err())
        .count();
    assert!(
        partial >= 4,
        "expected byte tokens inside characters, got {partial}"
    );
    let mut dec = StreamDecoder::new();
    let mut out = String::new();
    let mut held_steps = 0;
    for &id in &ids {
        let piece = dec.push(&tok, id);
        assert!(
            !piece.contains('\u{FFFD}'),
            "half a character leaked: {piece:?}"
        );
        if piece.is_empty() {
            held_steps += 1;
        }
        out.push_str(&piece);
        assert!(text.starts_with(&out), "{out:?} is not a prefix");
    }
    assert!(held_steps > 0);
    assert!(!dec.has_pending());
    assert_eq!(dec.flush(), "");
    assert_eq!(out, text);
}

#[test]
fn stream_decoder_flushes_a_dangling_byte() {
    let tok = Tokenizer::from_file(fixtures().join("qwen36/tokenizer.json.gz")).unwrap();
    // The first byte token of 🦙 alone.
    let ids = tok.encode("🦙", false).unwrap();
    assert!(ids.len() > 1);
    let mut dec = StreamDecoder::new();
    assert_eq!(dec.push(&tok, ids[0]), "");
    assert!(dec.has_pending());
    assert_eq!(dec.flush(), "\u{FFFD}");
}

/// 1 MB of text, twice: the fixture sentences repeated (the BPE word cache stays warm) and
/// pseudo-random words (every word new: the worst case). Prints the rates; run it with
/// `cargo test --test tokenizer -- --ignored --nocapture` (dependencies are optimised in the
/// test profile, so the numbers are those of a release build).
#[test]
#[ignore]
fn encode_speed_one_megabyte() {
    let tok = Tokenizer::from_file(fixtures().join("qwen36/tokenizer.json.gz")).unwrap();
    let all: Vec<(String, Vec<u32>)> = cases(&fixtures().join("qwen36/expected.json"));
    let mut repeated = String::new();
    let mut i = 0;
    while repeated.len() < 1 << 20 {
        repeated.push_str(&all[i % all.len()].0);
        repeated.push_str(if i % 7 == 0 { "\n\n" } else { " " });
        i += 1;
    }
    let mut random = String::new();
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let letters: Vec<char> = "etaoinshrdlucmfwypvbgkjqxzéü中文".chars().collect();
    while random.len() < 1 << 20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        for k in 0..(2 + x % 9) {
            random.push(letters[((x >> (5 * k)) % letters.len() as u64) as usize]);
        }
        random.push(if x.is_multiple_of(13) { '\n' } else { ' ' });
    }
    for (name, text) in [("repeated", &repeated), ("random words", &random)] {
        let t = std::time::Instant::now();
        let ids = tok.encode(text, true).unwrap();
        let dt = t.elapsed().as_secs_f64();
        println!(
            "encode {name}: {} bytes -> {} tokens in {:.3} s ({:.2} MB/s)",
            text.len(),
            ids.len(),
            dt,
            text.len() as f64 / dt / 1e6
        );
        assert_eq!(&tok.decode(&ids), text);
    }
}

#[test]
fn shareable_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Tokenizer>();
    send_sync::<lathe::tokenizer::ChatTemplate>();
    send_sync::<StreamDecoder>();
}

/// `exceeds`, the server's check before it encodes a prompt: megabytes over the limit are
/// refused after reading a few pieces, and a text that fits is never refused (its exact
/// count is what the server then compares).
#[test]
fn exceeds_refuses_long_texts_early_and_never_what_fits() {
    let tok = Tokenizer::from_file(fixtures().join("qwen36/tokenizer.json.gz")).unwrap();
    // Short texts are left to `encode`.
    assert_eq!(tok.exceeds("hello world", true, 1).unwrap(), None);
    let big = "word ".repeat(8 << 20 >> 2);
    let t0 = std::time::Instant::now();
    let n = tok
        .exceeds(&big, true, 8191)
        .unwrap()
        .expect("8 MB over 8191 tokens");
    assert!(n > 8191, "{n}");
    // A full encode of 8 MB takes seconds and ~1 GB; the probe stops after ~64 KB.
    assert!(t0.elapsed().as_secs_f64() < 2.0, "{:?}", t0.elapsed());
    let all = cases(&fixtures().join("qwen36/expected.json"));
    let mut text = String::new();
    let mut i = 0;
    while text.len() < 100 << 10 {
        text.push_str(&all[i % all.len()].0);
        text.push_str(if i % 5 == 0 { "\n\n" } else { " " });
        i += 1;
    }
    for kb in [20, 45, 100] {
        let mut end = (kb << 10).min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let t = &text[..end];
        let exact = tok.encode(t, true).unwrap().len();
        assert_eq!(tok.exceeds(t, true, exact).unwrap(), None, "{kb} KB");
        let m = tok.exceeds(t, true, exact / 2).unwrap();
        assert!(
            m.is_some_and(|m| m > exact / 2),
            "{kb} KB, {exact} tokens: {m:?}"
        );
    }
}
