//! Qwen3.5 / 3.6 (`qwen35`, `qwen35moe`) as llama.cpp's converter writes them: tensor list
//! in the converter's order (checked against the fixtures' `model-bf16.gguf`), shapes in
//! llama.cpp's layout (fused `attn_qkv` of the GDN layers, `attn_q` holding q and the output
//! gate per head, experts stacked `[n_expert, rows, cols]`), and the `qwen35*.` keys.

use super::presets::QwenDims;
use super::{fan_in, norm, router, weight, ArchDraft, Draft, Init, Kind};
use crate::gguf::{keys, Value};

/// MRoPE sections over the rotated pairs, Qwen's 11 / 11 / 10 split of 32 scaled to the
/// head (text positions use all three sections alike, so only the sum matters to lathe).
fn rope_sections(rope_dim: usize) -> [i32; 4] {
    let pairs = rope_dim / 2;
    let a = (pairs * 11).div_ceil(32);
    let a = a.min(pairs / 2);
    [a as i32, a as i32, (pairs - 2 * a) as i32, 0]
}

/// `mtp`: add a multi-token prediction block as llama.cpp names it: block `n_layer` (counted
/// in `block_count`, `nextn_predict_layers` = 1) with a full-attention decoder layer of the
/// trunk's FFN kind and `nextn.{eh_proj, enorm, hnorm, shared_head_norm}`.
pub(super) fn draft(d: &QwenDims, skew: f32, mtp: bool) -> ArchDraft {
    let arch = if d.moe.is_some() {
        keys::ARCH_QWEN35MOE
    } else {
        keys::ARCH_QWEN35
    };
    let h = d.n_embd;
    let k = |s: &str| keys::key(arch, s);
    let is_full = |l: usize| l >= d.n_layer || (l + 1).is_multiple_of(d.full_attention_interval);
    let n_blocks = d.n_layer + usize::from(mtp);
    let q_heads = d.n_head * d.head_dim;
    let kv_width = d.n_head_kv * d.head_dim;
    let inner = d.n_v_heads * d.d_v;
    let conv_dim = 2 * d.n_k_heads * d.d_k + inner;

    let mut meta: Vec<(String, Value)> = vec![
        (k(keys::BLOCK_COUNT), (n_blocks as u32).into()),
        (k(keys::CONTEXT_LENGTH), (d.ctx as u32).into()),
        (k(keys::EMBEDDING_LENGTH), (h as u32).into()),
    ];
    if d.moe.is_none() {
        meta.push((k(keys::FEED_FORWARD_LENGTH), (d.n_ff as u32).into()));
    }
    meta.extend([
        (k(keys::ATTENTION_HEAD_COUNT), (d.n_head as u32).into()),
        (
            k(keys::ATTENTION_HEAD_COUNT_KV),
            (d.n_head_kv as u32).into(),
        ),
        (
            k(keys::ROPE_DIMENSION_SECTIONS),
            Value::from(&rope_sections(d.rope_dim)[..]),
        ),
        (k(keys::ROPE_FREQ_BASE), d.rope_theta.into()),
        (k(keys::ATTENTION_LAYERNORM_RMS_EPS), d.eps.into()),
    ]);
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
        meta.push((
            k(keys::EXPERT_SHARED_FEED_FORWARD_LENGTH),
            (m.n_ff_shexp as u32).into(),
        ));
    }
    let recurrent: Vec<Value> = (0..n_blocks).map(|l| Value::Bool(!is_full(l))).collect();
    meta.extend([
        (k(keys::SSM_CONV_KERNEL), (d.conv_kernel as u32).into()),
        (k(keys::SSM_STATE_SIZE), (d.d_k as u32).into()),
        (k(keys::SSM_GROUP_COUNT), (d.n_k_heads as u32).into()),
        (k(keys::SSM_TIME_STEP_RANK), (d.n_v_heads as u32).into()),
        (k(keys::SSM_INNER_SIZE), (inner as u32).into()),
        (k(keys::ATTENTION_RECURRENT_LAYERS), Value::Array(recurrent)),
        (
            k(keys::FULL_ATTENTION_INTERVAL),
            (d.full_attention_interval as u32).into(),
        ),
        (k(keys::ROPE_DIMENSION_COUNT), (d.rope_dim as u32).into()),
    ]);
    if mtp {
        meta.push((k(keys::NEXTN_PREDICT_LAYERS), 1u32.into()));
    }

    let mut t: Vec<Draft> = Vec::new();
    if !d.tied {
        t.push(weight("output.weight".into(), &[d.n_vocab, h]));
    }
    t.push(weight("token_embd.weight".into(), &[d.n_vocab, h]));
    for l in 0..n_blocks {
        let b = |s: &str| format!("blk.{l}.{s}");
        if l == d.n_layer {
            t.push(weight(b("nextn.eh_proj.weight"), &[h, 2 * h]));
            t.push(norm(b("nextn.enorm.weight"), h));
            t.push(norm(b("nextn.hnorm.weight"), h));
            t.push(norm(b("nextn.shared_head_norm.weight"), h));
        }
        t.push(norm(b("attn_norm.weight"), h));
        if !is_full(l) {
            // Gated DeltaNet: `ssm_a` is −exp(A_log) (A_log = log U(1, 16) in HF's init),
            // dt_bias near one, a short depthwise causal conv.
            t.push(Draft::new(
                b("ssm_a"),
                &[d.n_v_heads],
                Kind::F32,
                Init::Uniform { lo: -8.0, hi: -0.5 },
            ));
            t.push(Draft::new(
                b("ssm_conv1d.weight"),
                &[conv_dim, d.conv_kernel],
                Kind::F32,
                fan_in(d.conv_kernel),
            ));
            t.push(Draft::new(
                b("ssm_dt.bias"),
                &[d.n_v_heads],
                Kind::F32,
                Init::Around {
                    mean: 1.0,
                    std: 0.1,
                },
            ));
            t.push(weight(b("ssm_alpha.weight"), &[d.n_v_heads, h]));
            t.push(weight(b("ssm_beta.weight"), &[d.n_v_heads, h]));
            t.push(weight(b("attn_qkv.weight"), &[conv_dim, h]));
            t.push(weight(b("attn_gate.weight"), &[inner, h]));
            t.push(norm(b("ssm_norm.weight"), d.d_v));
            t.push(weight(b("ssm_out.weight"), &[h, inner]));
        }
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
                t.push(weight(b("ffn_down_shexp.weight"), &[h, m.n_ff_shexp]));
                t.push(weight(b("ffn_gate_shexp.weight"), &[m.n_ff_shexp, h]));
                t.push(weight(b("ffn_up_shexp.weight"), &[m.n_ff_shexp, h]));
                t.push(Draft::new(
                    b("ffn_gate_inp_shexp.weight"),
                    &[1, h],
                    Kind::F32,
                    fan_in(h),
                ));
            }
        }
        t.push(norm(b("post_attention_norm.weight"), h));
        if is_full(l) {
            t.push(norm(b("attn_k_norm.weight"), d.head_dim));
            t.push(weight(b("attn_k.weight"), &[kv_width, h]));
            t.push(weight(b("attn_output.weight"), &[h, q_heads]));
            t.push(norm(b("attn_q_norm.weight"), d.head_dim));
            // Per head: the query, then its output gate.
            t.push(weight(b("attn_q.weight"), &[2 * q_heads, h]));
            t.push(weight(b("attn_v.weight"), &[kv_width, h]));
        }
    }
    t.push(norm("output_norm.weight".into(), h));
    ArchDraft {
        arch,
        meta,
        tensors: t,
        n_layer: d.n_layer,
        n_blocks,
        n_expert: d.moe.as_ref().map_or(0, |m| m.n_expert),
        float_file_type: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_sections_scale_qwens_split() {
        assert_eq!(rope_sections(64), [11, 11, 10, 0]);
        assert_eq!(rope_sections(16), [3, 3, 2, 0]);
        assert_eq!(rope_sections(4), [1, 1, 0, 0]);
    }
}
