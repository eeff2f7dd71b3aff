//! Step-3.5/3.7-Flash (`step35`) as llama.cpp's converter (`conversion/step3.py`,
//! `Step35Model`, run `--no-mtp`) writes it: per-layer head counts and the sliding pattern
//! as arrays, the full layers' RoPE base and the sliding one's, the llama3 divisors
//! `rope_freqs.weight` first, leading dense blocks, then MoE blocks with the selection bias
//! and a shared expert, the head-wise `attn_gate` on every block.

use super::presets::StepDims;
use super::{norm, router, weight, ArchDraft, Draft, Init, Kind};
use crate::gguf::{keys, Value};

pub(super) fn draft(d: &StepDims, skew: f32) -> ArchDraft {
    let arch = "step35";
    let h = d.n_embd;
    let n = d.n_layer;
    let k = |s: &str| keys::key(arch, s);
    let heads = |l: usize| if d.swa[l] { d.n_head_swa } else { d.n_head };
    let ints = |f: &dyn Fn(usize) -> usize| {
        Value::Array((0..n).map(|l| Value::I32(f(l) as i32)).collect())
    };
    let floats = |v: &[f32]| Value::Array(v[..n].iter().map(|&x| Value::F32(x)).collect());
    let m = &d.moe;
    let meta: Vec<(String, Value)> = vec![
        (k(keys::BLOCK_COUNT), (n as u32).into()),
        (k(keys::CONTEXT_LENGTH), (d.ctx as u32).into()),
        (k(keys::EMBEDDING_LENGTH), (h as u32).into()),
        (k(keys::FEED_FORWARD_LENGTH), (d.n_ff as u32).into()),
        (k(keys::ATTENTION_HEAD_COUNT), ints(&heads)),
        (k(keys::ROPE_FREQ_BASE), d.rope_theta.into()),
        (k("rope.freq_base_swa"), d.rope_theta_swa.into()),
        (k(keys::ATTENTION_LAYERNORM_RMS_EPS), d.eps.into()),
        // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID.
        (k(keys::EXPERT_GATING_FUNC), 2u32.into()),
        (k(keys::ATTENTION_KEY_LENGTH), (d.head_dim as u32).into()),
        (k(keys::ATTENTION_VALUE_LENGTH), (d.head_dim as u32).into()),
        (k(keys::ATTENTION_HEAD_COUNT_KV), ints(&|_| d.n_head_kv)),
        (k(keys::ATTENTION_SLIDING_WINDOW), (d.window as u32).into()),
        (
            k("attention.sliding_window_pattern"),
            Value::Array(d.swa[..n].iter().map(|&s| Value::Bool(s)).collect()),
        ),
        (k(keys::EXPERT_COUNT), (m.n_expert as u32).into()),
        (k(keys::EXPERT_USED_COUNT), (m.n_used as u32).into()),
        (
            k(keys::EXPERT_FEED_FORWARD_LENGTH),
            (m.n_ff_exp as u32).into(),
        ),
        (
            k(keys::EXPERT_SHARED_FEED_FORWARD_LENGTH),
            (m.n_ff_shexp as u32).into(),
        ),
        (k(keys::EXPERT_WEIGHTS_SCALE), d.route_scale.into()),
        (k(keys::EXPERT_WEIGHTS_NORM), true.into()),
        (k("leading_dense_block_count"), (d.n_dense as u32).into()),
        (k("moe_every_n_layers"), 1u32.into()),
        (k(keys::SWIGLU_CLAMP_EXP), floats(&d.clamp_exp)),
        (k(keys::SWIGLU_CLAMP_SHEXP), floats(&d.clamp_shexp)),
    ];

    let mut t: Vec<Draft> = Vec::new();
    if d.rope_freqs {
        // Divisors ≥ 1 over head_dim/2 (the full layers use the first n_rot/2).
        t.push(Draft::new(
            "rope_freqs.weight",
            &[d.head_dim / 2],
            Kind::F32,
            Init::Uniform { lo: 1.0, hi: 8.0 },
        ));
    }
    t.push(weight("output.weight".into(), &[d.n_vocab, h]));
    t.push(weight("token_embd.weight".into(), &[d.n_vocab, h]));
    for l in 0..n {
        let b = |s: &str| format!("blk.{l}.{s}");
        let q_width = heads(l) * d.head_dim;
        let kv_width = d.n_head_kv * d.head_dim;
        t.push(norm(b("attn_norm.weight"), h));
        if l < d.n_dense {
            t.push(weight(b("ffn_down.weight"), &[h, d.n_ff]));
            t.push(weight(b("ffn_gate.weight"), &[d.n_ff, h]));
            t.push(weight(b("ffn_up.weight"), &[d.n_ff, h]));
        } else {
            let (e, f) = (m.n_expert, m.n_ff_exp);
            t.push(weight(b("ffn_down_exps.weight"), &[e, h, f]));
            t.push(router(b("ffn_gate_inp.weight"), (e, h), skew, m.n_used, l));
            t.push(weight(b("ffn_gate_exps.weight"), &[e, f, h]));
            t.push(Draft::new(
                b("exp_probs_b.bias"),
                &[e],
                Kind::F32,
                Init::ExpertBias {
                    skew,
                    top_k: m.n_used,
                    layer: l,
                },
            ));
            t.push(weight(b("ffn_up_exps.weight"), &[e, f, h]));
        }
        t.push(norm(b("ffn_norm.weight"), h));
        t.push(weight(b("attn_gate.weight"), &[heads(l), h]));
        t.push(norm(b("attn_k_norm.weight"), d.head_dim));
        t.push(weight(b("attn_k.weight"), &[kv_width, h]));
        t.push(weight(b("attn_output.weight"), &[h, q_width]));
        t.push(norm(b("attn_q_norm.weight"), d.head_dim));
        t.push(weight(b("attn_q.weight"), &[q_width, h]));
        t.push(weight(b("attn_v.weight"), &[kv_width, h]));
        if l >= d.n_dense {
            t.push(weight(b("ffn_down_shexp.weight"), &[h, m.n_ff_shexp]));
            t.push(weight(b("ffn_gate_shexp.weight"), &[m.n_ff_shexp, h]));
            t.push(weight(b("ffn_up_shexp.weight"), &[m.n_ff_shexp, h]));
        }
    }
    t.push(norm("output_norm.weight".into(), h));
    ArchDraft {
        arch,
        meta,
        tensors: t,
        n_layer: n,
        n_blocks: n,
        n_expert: m.n_expert,
        float_file_type: None,
    }
}
