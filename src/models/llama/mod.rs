//! The plain transformer (Llama and its descendants): pre-norm blocks of grouped-query
//! attention with RoPE and a SwiGLU FFN, RMSNorm everywhere, the head tied to the embedding
//! when the file has no `output.weight`.
//!
//! GGUF `llama` only for now. llama.cpp's converter permutes HF's Q and K rows so that its
//! `llama` files rotate interleaved pairs (its `LLAMA_ROPE_TYPE_NORM`): lathe rotates them as
//! stored ([`RopeStyle::Interleaved`]).

pub mod gpu;

use super::ModelFile;
use crate::gguf::keys::{self, key};
use crate::gguf::GgufFile;
use crate::gpu::rope::RopeStyle;
use crate::{Error, Result};

/// GGUF architecture names of the family.
pub const GGUF_ARCHS: &[&str] = &["llama"];

/// Tensor roles; [`W::gguf_name`] is the one name table (llama.cpp's `LLM_TENSOR_*` names).
#[derive(Clone, Copy, Debug)]
pub enum W {
    TokEmbd,
    /// Optional: absent when the head is tied to the embedding.
    Output,
    OutputNorm,
    /// Optional: per-frequency divisors of the rotation (Llama 3.1's `rope_freqs`).
    RopeFreqs,
    AttnNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    FfnNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
}

impl W {
    pub fn gguf_name(self) -> String {
        use W::*;
        let b = |l: usize, s: &str| format!("blk.{l}.{s}");
        match self {
            TokEmbd => "token_embd.weight".into(),
            Output => "output.weight".into(),
            OutputNorm => "output_norm.weight".into(),
            RopeFreqs => "rope_freqs.weight".into(),
            AttnNorm(l) => b(l, "attn_norm.weight"),
            Q(l) => b(l, "attn_q.weight"),
            K(l) => b(l, "attn_k.weight"),
            V(l) => b(l, "attn_v.weight"),
            O(l) => b(l, "attn_output.weight"),
            FfnNorm(l) => b(l, "ffn_norm.weight"),
            Gate(l) => b(l, "ffn_gate.weight"),
            Up(l) => b(l, "ffn_up.weight"),
            Down(l) => b(l, "ffn_down.weight"),
        }
    }
}

/// Hyper-parameters.
#[derive(Clone, Debug)]
pub struct Hparams {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_vocab: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Rotated dims of each head (the first `n_rot`).
    pub n_rot: usize,
    pub rope_theta: f32,
    /// Linear position scaling (`rope.scaling.type = linear`): positions divided by it.
    pub rope_linear: f32,
    pub rope_style: RopeStyle,
    pub eps: f32,
}

impl Hparams {
    pub fn from_file(f: &ModelFile) -> Result<Hparams> {
        match f {
            ModelFile::Gguf(g) => Self::from_gguf(g),
            ModelFile::Hf(h) => Err(Error::Unsupported(format!(
                "{}: Hugging Face checkpoints of the Llama family (convert to GGUF)",
                h.dir().display()
            ))),
        }
    }

    fn from_gguf(g: &GgufFile) -> Result<Hparams> {
        let arch = g.architecture()?.to_string();
        if !GGUF_ARCHS.contains(&arch.as_str()) {
            return Err(Error::Unsupported(format!(
                "{}: architecture {arch} is not a Llama family model",
                g.path().display()
            )));
        }
        let k = |s: &str| key(&arch, s);
        let n_embd = g.get_usize(&k(keys::EMBEDDING_LENGTH))?;
        let n_head = g.get_usize(&k(keys::ATTENTION_HEAD_COUNT))?;
        let n_head_kv = g
            .opt_usize(&k(keys::ATTENTION_HEAD_COUNT_KV))?
            .unwrap_or(n_head);
        let bad = |field: &str, why: String| Error::config(g.path(), k(field), why);
        if n_head == 0 || n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(bad(
                keys::ATTENTION_HEAD_COUNT_KV,
                format!("{n_head_kv} KV heads for {n_head} query heads"),
            ));
        }
        let head_dim = match g.opt_usize(&k(keys::ATTENTION_KEY_LENGTH))? {
            Some(d) => d,
            None if n_embd.is_multiple_of(n_head) => n_embd / n_head,
            None => {
                return Err(bad(
                    keys::ATTENTION_HEAD_COUNT,
                    format!("{n_head} heads do not divide {n_embd}"),
                ))
            }
        };
        if let Some(dv) = g.opt_usize(&k(keys::ATTENTION_VALUE_LENGTH))? {
            if dv != head_dim {
                return Err(bad(
                    keys::ATTENTION_VALUE_LENGTH,
                    format!("{dv}, unlike the key length {head_dim}"),
                ));
            }
        }
        let n_rot = g
            .opt_usize(&k(keys::ROPE_DIMENSION_COUNT))?
            .unwrap_or(head_dim);
        if n_rot == 0 || n_rot > head_dim || !n_rot.is_multiple_of(2) {
            return Err(bad(
                keys::ROPE_DIMENSION_COUNT,
                format!("{n_rot} rotated dims of a head of {head_dim}"),
            ));
        }
        let rope_linear = match g.opt_str(&k(keys::ROPE_SCALING_TYPE))? {
            None | Some("none") => 1.0,
            Some("linear") => g.get_f32(&k(keys::ROPE_SCALING_FACTOR))?,
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "{}: {} = {other} (lathe reads none and linear)",
                    g.path().display(),
                    k(keys::ROPE_SCALING_TYPE)
                )))
            }
        };
        if !(rope_linear.is_finite() && rope_linear > 0.0) {
            return Err(bad(
                keys::ROPE_SCALING_FACTOR,
                format!("{rope_linear}: not a positive factor"),
            ));
        }
        let embd = g.require(&W::TokEmbd.gguf_name())?;
        // `[rows, cols]` = `[n_vocab, n_embd]` (GGUF lists the dims the other way).
        let n_vocab = match embd.shape {
            [v, e] if *e as usize == n_embd => *v as usize,
            s => {
                return Err(Error::tensor(
                    embd.path,
                    embd.name,
                    format!("shape {s:?}, expected [n_vocab, {n_embd}]"),
                ))
            }
        };
        Ok(Hparams {
            n_layer: g.get_usize(&k(keys::BLOCK_COUNT))?,
            n_embd,
            n_vocab,
            n_ff: g.get_usize(&k(keys::FEED_FORWARD_LENGTH))?,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rope_theta: g.opt_f32(&k(keys::ROPE_FREQ_BASE))?.unwrap_or(10000.0),
            rope_linear,
            rope_style: RopeStyle::Interleaved,
            eps: g
                .opt_f32(&k(keys::ATTENTION_LAYERNORM_RMS_EPS))?
                .unwrap_or(1e-5),
        })
    }
}
