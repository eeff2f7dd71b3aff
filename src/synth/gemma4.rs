//! Gemma-4 (`gemma4`) as llama.cpp's converter (`conversion/gemma.py`, `Gemma4Model`) writes
//! it: the sliding pattern as a bool array, the sliding layers' head size and RoPE base
//! beside the global ones, per-layer KV head counts as an array where sliding and global
//! layers differ, the global layers' proportional-RoPE divisors as `rope_freqs.weight` (1 for
//! the rotated pairs, 1e30 for the rest), the head tied to the embedding, and on global
//! layers no `attn_v` when V is the K projection (`attention_k_eq_v`). MoE layouts add the
//! router with its input scale, per-expert output scales, the fused gate+up expert stack and
//! the two branches' norms. The E2B/E4B layouts add the per-layer embeddings (the second
//! token table right after the first, the embedding's projection and its norm after the
//! output norm, and per block `inp_gate`, `proj` and `post_norm`) and leave out the K/V
//! weights of the KV-shared last blocks, whose FFN may be double wide (per-layer
//! `feed_forward_length`), as the converter writes them.

use super::presets::GemmaDims;
use super::{norm, router, weight, ArchDraft, Draft, Init, Kind};
use crate::gguf::{keys, Value};

/// llama.cpp's Gemma-4 keys (`LLM_KV_*`) that `gguf::keys` does not share.
const ROPE_FREQ_BASE_SWA: &str = "rope.freq_base_swa";
const FINAL_LOGIT_SOFTCAPPING: &str = "final_logit_softcapping";
const SHARED_KV_LAYERS: &str = "attention.shared_kv_layers";
const EMBEDDING_LENGTH_PER_LAYER: &str = "embedding_length_per_layer_input";
const SLIDING_WINDOW_PATTERN: &str = "attention.sliding_window_pattern";
const KEY_LENGTH_SWA: &str = "attention.key_length_swa";
const VALUE_LENGTH_SWA: &str = "attention.value_length_swa";
const ROPE_DIMENSION_COUNT_SWA: &str = "rope.dimension_count_swa";

/// The KV-shared blocks of `d` shortened to `n` blocks: the same share of them, fewer where
/// the blocks before them would lack one of the attention types the shared ones use.
pub(super) fn shared_of(d: &GemmaDims, n: usize) -> usize {
    let mut k = d.n_kv_shared * n / d.n_layer.max(1);
    while k > 0 {
        let (own, shared) = d.swa[..n].split_at(n - k);
        if shared.iter().all(|s| own.contains(s)) {
            break;
        }
        k -= 1;
    }
    k
}

pub(super) fn draft(d: &GemmaDims, skew: f32) -> ArchDraft {
    let arch = "gemma4";
    let h = d.n_embd;
    let n = d.n_layer;
    let k = |s: &str| keys::key(arch, s);
    let kv_heads = |l: usize| {
        if d.swa[l] {
            d.n_head_kv
        } else {
            d.n_head_kv_global
        }
    };
    let head_dim = |l: usize| if d.swa[l] { d.head_dim_swa } else { d.head_dim };
    let kv_count: Value = if (0..n).all(|l| kv_heads(l) == kv_heads(0)) {
        (kv_heads(0) as u32).into()
    } else {
        Value::Array((0..n).map(|l| Value::I32(kv_heads(l) as i32)).collect())
    };
    let own_kv = n - d.n_kv_shared;
    let n_ff = |l: usize| {
        if d.double_wide && l >= own_kv {
            2 * d.n_ff
        } else {
            d.n_ff
        }
    };
    let ff_count: Value = if (0..n).all(|l| n_ff(l) == d.n_ff) {
        (d.n_ff as u32).into()
    } else {
        Value::Array((0..n).map(|l| Value::I32(n_ff(l) as i32)).collect())
    };
    let mut meta: Vec<(String, Value)> = vec![
        (k(keys::BLOCK_COUNT), (n as u32).into()),
        (k(keys::CONTEXT_LENGTH), (d.ctx as u32).into()),
        (k(keys::EMBEDDING_LENGTH), (h as u32).into()),
        (k(keys::FEED_FORWARD_LENGTH), ff_count),
        (k(keys::ATTENTION_HEAD_COUNT), (d.n_head as u32).into()),
        (k(keys::ATTENTION_HEAD_COUNT_KV), kv_count),
        (k(keys::ROPE_FREQ_BASE), d.rope_theta.into()),
        (k(ROPE_FREQ_BASE_SWA), d.rope_theta_swa.into()),
        (k(keys::ATTENTION_LAYERNORM_RMS_EPS), d.eps.into()),
    ];
    if let Some(m) = &d.moe {
        meta.push((k(keys::EXPERT_COUNT), (m.n_expert as u32).into()));
        meta.push((k(keys::EXPERT_USED_COUNT), (m.n_used as u32).into()));
    }
    meta.extend([
        (k(keys::ATTENTION_KEY_LENGTH), (d.head_dim as u32).into()),
        (k(keys::ATTENTION_VALUE_LENGTH), (d.head_dim as u32).into()),
        (k(FINAL_LOGIT_SOFTCAPPING), d.softcap.into()),
        (k(keys::ATTENTION_SLIDING_WINDOW), (d.window as u32).into()),
        (k(SHARED_KV_LAYERS), (d.n_kv_shared as u32).into()),
        (k(EMBEDDING_LENGTH_PER_LAYER), (d.n_epl as u32).into()),
        (
            k(SLIDING_WINDOW_PATTERN),
            Value::Array(d.swa[..n].iter().map(|&s| Value::Bool(s)).collect()),
        ),
        (k(KEY_LENGTH_SWA), (d.head_dim_swa as u32).into()),
        (k(VALUE_LENGTH_SWA), (d.head_dim_swa as u32).into()),
    ]);
    if let Some(m) = &d.moe {
        meta.push((
            k(keys::EXPERT_FEED_FORWARD_LENGTH),
            (m.n_ff_exp as u32).into(),
        ));
    }
    // Both RoPEs are written over whole heads; the global one's pairs past the rotated
    // fraction get the 1e30 divisors below.
    meta.push((k(keys::ROPE_DIMENSION_COUNT), (d.head_dim as u32).into()));
    meta.push((k(ROPE_DIMENSION_COUNT_SWA), (d.head_dim_swa as u32).into()));

    let mut t: Vec<Draft> = Vec::new();
    // HF's `_compute_proportional_rope_parameters`: int(factor · head_dim // 2) pairs turn.
    t.push(Draft::new(
        "rope_freqs.weight",
        &[d.head_dim / 2],
        Kind::F32,
        Init::Split {
            n: (d.rope_frac * (d.head_dim / 2) as f32) as usize,
            head: 1.0,
            tail: 1e30,
        },
    ));
    t.push(weight("token_embd.weight".into(), &[d.n_vocab, h]));
    let pl_cols = n * d.n_epl;
    if d.n_epl > 0 {
        t.push(weight(
            "per_layer_token_embd.weight".into(),
            &[d.n_vocab, pl_cols],
        ));
    }
    for l in 0..n {
        let ff = n_ff(l);
        let b = |s: &str| format!("blk.{l}.{s}");
        let hd = head_dim(l);
        let (q_width, kv_width) = (d.n_head * hd, kv_heads(l) * hd);
        if let Some(m) = &d.moe {
            let (e, f) = (m.n_expert, m.n_ff_exp);
            t.push(weight(b("ffn_down_exps.weight"), &[e, h, f]));
            t.push(weight(b("ffn_gate_up_exps.weight"), &[e, 2 * f, h]));
        }
        t.push(norm(b("attn_norm.weight"), h));
        t.push(norm(b("layer_output_scale.weight"), 1));
        t.push(weight(b("ffn_down.weight"), &[h, ff]));
        t.push(weight(b("ffn_gate.weight"), &[ff, h]));
        t.push(weight(b("ffn_up.weight"), &[ff, h]));
        if d.n_epl > 0 {
            t.push(weight(b("inp_gate.weight"), &[d.n_epl, h]));
            t.push(weight(b("proj.weight"), &[h, d.n_epl]));
        }
        t.push(norm(b("post_attention_norm.weight"), h));
        t.push(norm(b("post_ffw_norm.weight"), h));
        if d.n_epl > 0 {
            t.push(norm(b("post_norm.weight"), h));
        }
        if d.moe.is_some() {
            t.push(norm(b("post_ffw_norm_1.weight"), h));
            t.push(norm(b("post_ffw_norm_2.weight"), h));
        }
        t.push(norm(b("ffn_norm.weight"), h));
        if let Some(m) = &d.moe {
            let e = m.n_expert;
            t.push(norm(b("pre_ffw_norm_2.weight"), h));
            t.push(norm(b("ffn_down_exps.scale"), e));
            t.push(router(b("ffn_gate_inp.weight"), (e, h), skew, m.n_used, l));
            t.push(norm(b("ffn_gate_inp.scale"), h));
        }
        if l < own_kv {
            t.push(norm(b("attn_k_norm.weight"), hd));
            t.push(weight(b("attn_k.weight"), &[kv_width, h]));
        }
        t.push(weight(b("attn_output.weight"), &[h, q_width]));
        t.push(norm(b("attn_q_norm.weight"), hd));
        t.push(weight(b("attn_q.weight"), &[q_width, h]));
        if l < own_kv && (d.swa[l] || !d.k_eq_v) {
            t.push(weight(b("attn_v.weight"), &[kv_width, h]));
        }
    }
    t.push(norm("output_norm.weight".into(), h));
    if d.n_epl > 0 {
        t.push(weight("per_layer_model_proj.weight".into(), &[pl_cols, h]));
        t.push(norm("per_layer_proj_norm.weight".into(), d.n_epl));
    }
    ArchDraft {
        arch,
        meta,
        tensors: t,
        n_layer: n,
        n_blocks: n,
        n_expert: d.moe.as_ref().map_or(0, |m| m.n_expert),
        float_file_type: None,
    }
}
