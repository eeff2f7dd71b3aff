//! The plain transformer family (`llama`, `qwen3`, `qwen3moe`) as llama.cpp's converter
//! writes it: the `<arch>.*` keys in its order and the tensors with llama.cpp's names and
//! layout (experts stacked `[n_expert, rows, cols]`, Qwen3's per-head q/k norms).
//!
//! Llama 3.1's `rope_freqs` divisors are left out: they change which positions the random
//! weights see, not the work, and synth files are for speed and memory.

use super::presets::LlamaDims;
use super::{norm, router, weight, ArchDraft, Draft};
use crate::gguf::{keys, Value};

pub(super) fn draft(d: &LlamaDims, skew: f32) -> ArchDraft {
    let arch = d.arch;
    let h = d.n_embd;
    let k = |s: &str| keys::key(arch, s);
    let q_heads = d.n_head * d.head_dim;
    let kv_width = d.n_head_kv * d.head_dim;
    let mut meta: Vec<(String, Value)> = vec![
        (k(keys::BLOCK_COUNT), (d.n_layer as u32).into()),
        (k(keys::CONTEXT_LENGTH), (d.ctx as u32).into()),
        (k(keys::EMBEDDING_LENGTH), (h as u32).into()),
        (k(keys::FEED_FORWARD_LENGTH), (d.n_ff as u32).into()),
        (k(keys::ATTENTION_HEAD_COUNT), (d.n_head as u32).into()),
        (
            k(keys::ATTENTION_HEAD_COUNT_KV),
            (d.n_head_kv as u32).into(),
        ),
        (k(keys::ROPE_FREQ_BASE), d.rope_theta.into()),
        (k(keys::ATTENTION_LAYERNORM_RMS_EPS), d.eps.into()),
    ];
    if let Some(m) = &d.moe {
        meta.push((k(keys::EXPERT_COUNT), (m.n_expert as u32).into()));
        meta.push((k(keys::EXPERT_USED_COUNT), (m.n_used as u32).into()));
    }
    meta.push((k(keys::ATTENTION_KEY_LENGTH), (d.head_dim as u32).into()));
    meta.push((k(keys::ATTENTION_VALUE_LENGTH), (d.head_dim as u32).into()));
    if let Some(m) = &d.moe {
        meta.push((
            k(keys::EXPERT_FEED_FORWARD_LENGTH),
            (m.n_ff_exp as u32).into(),
        ));
    }
    // llama.cpp's LlamaModel writes the rotated dims (after the vocabulary size, which
    // synth writes with the tokenizer keys); its Qwen models leave them to the head size.
    if arch == "llama" {
        meta.push((k(keys::ROPE_DIMENSION_COUNT), (d.head_dim as u32).into()));
    }

    let mut t: Vec<Draft> = Vec::new();
    if !d.tied {
        t.push(weight("output.weight".into(), &[d.n_vocab, h]));
    }
    t.push(weight("token_embd.weight".into(), &[d.n_vocab, h]));
    for l in 0..d.n_layer {
        let b = |s: &str| format!("blk.{l}.{s}");
        t.push(norm(b("attn_norm.weight"), h));
        match &d.moe {
            None => {
                t.push(weight(b("ffn_down.weight"), &[h, d.n_ff]));
                t.push(weight(b("ffn_gate.weight"), &[d.n_ff, h]));
                t.push(weight(b("ffn_up.weight"), &[d.n_ff, h]));
            }
            Some(m) => {
                let (e, f) = (m.n_expert, m.n_ff_exp);
                t.push(weight(b("ffn_down_exps.weight"), &[e, h, f]));
                t.push(weight(b("ffn_gate_exps.weight"), &[e, f, h]));
                t.push(weight(b("ffn_up_exps.weight"), &[e, f, h]));
                t.push(router(b("ffn_gate_inp.weight"), (e, h), skew, m.n_used, l));
            }
        }
        t.push(norm(b("ffn_norm.weight"), h));
        if d.qk_norm {
            t.push(norm(b("attn_k_norm.weight"), d.head_dim));
        }
        t.push(weight(b("attn_k.weight"), &[kv_width, h]));
        t.push(weight(b("attn_output.weight"), &[h, q_heads]));
        if d.qk_norm {
            t.push(norm(b("attn_q_norm.weight"), d.head_dim));
        }
        t.push(weight(b("attn_q.weight"), &[q_heads, h]));
        t.push(weight(b("attn_v.weight"), &[kv_width, h]));
    }
    t.push(norm("output_norm.weight".into(), h));
    ArchDraft {
        arch,
        meta,
        tensors: t,
        n_layer: d.n_layer,
        n_blocks: d.n_layer,
        n_expert: d.moe.as_ref().map_or(0, |m| m.n_expert),
        float_file_type: None,
    }
}
