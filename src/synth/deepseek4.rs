//! DeepSeek-V4 (`deepseek4`) as llama.cpp's converter writes it: tensor names, shapes and
//! order as in the fixtures' `dsv4-*/model-{f32,bf16}.gguf` (hash tables first, then the
//! MXFP4 expert stacks of every layer, the embedding and output head, then each layer's
//! attention, compressor, indexer, FFN and hyper-connection tensors), and the `deepseek4.`
//! keys. Routed experts stay MXFP4 in every file type, as in llama.cpp's own V4 files
//! (`llama-quantize --tensor-type exps=mxfp4`).

use super::presets::DsDims;
use super::{fan_in, norm, weight, ArchDraft, Draft, Init, Kind};
use crate::gguf::{keys, Value};
use crate::DType;

/// `mtp`: add DeepSeek's MTP block (model.py `MTPBlock`: a full block of the trunk's
/// shapes, window attention only, score-routed MoE, plus `e_proj`, `h_proj`, `enorm`,
/// `hnorm`, `norm` and its own `hc_head_*`) under `mtp.0.` (lathe's GGUF names for it, see
/// `models::deepseek4::weights::mtp_block`), with `nextn_predict_layers` = 1 and its
/// ratio (0) appended to `compress_ratios` as the releases do.
pub(super) fn draft(d: &DsDims, skew: f32, mtp: bool) -> ArchDraft {
    let arch = keys::ARCH_DEEPSEEK4;
    let h = d.n_embd;
    let k = |s: &str| keys::key(arch, s);
    let n = d.n_layer;
    let per_layer = |v: f32| Value::Array(vec![Value::F32(v); n]);

    let mut meta: Vec<(String, Value)> = vec![
        (k(keys::BLOCK_COUNT), (n as u32).into()),
        (k(keys::CONTEXT_LENGTH), (d.ctx as u32).into()),
        (k(keys::EMBEDDING_LENGTH), (h as u32).into()),
        (k(keys::ATTENTION_HEAD_COUNT), (d.n_head as u32).into()),
        // One shared K=V head.
        (k(keys::ATTENTION_HEAD_COUNT_KV), 1u32.into()),
    ];
    if let Some(y) = &d.yarn {
        meta.extend([
            (k(keys::ROPE_SCALING_TYPE), "yarn".into()),
            (k(keys::ROPE_SCALING_FACTOR), y.factor.into()),
            (
                k(keys::ROPE_SCALING_ORIG_CTX_LEN),
                (y.orig_ctx as u32).into(),
            ),
            (k(keys::ROPE_SCALING_YARN_BETA_FAST), y.beta_fast.into()),
            (k(keys::ROPE_SCALING_YARN_BETA_SLOW), y.beta_slow.into()),
        ]);
    }
    meta.extend([
        (k(keys::ROPE_FREQ_BASE), d.rope_theta.into()),
        (k(keys::ATTENTION_LAYERNORM_RMS_EPS), d.eps.into()),
        (k(keys::EXPERT_COUNT), (d.n_expert as u32).into()),
        (k(keys::EXPERT_USED_COUNT), (d.n_used as u32).into()),
        // sqrt(softplus(x)) scores.
        (k(keys::EXPERT_GATING_FUNC), 4u32.into()),
        (k(keys::ATTENTION_KEY_LENGTH), (d.head_dim as u32).into()),
        (k(keys::ATTENTION_VALUE_LENGTH), (d.head_dim as u32).into()),
        (k(keys::ROPE_DIMENSION_COUNT), (d.rope_dim as u32).into()),
        (k(keys::ATTENTION_Q_LORA_RANK), (d.q_lora as u32).into()),
        (k(keys::ATTENTION_SLIDING_WINDOW), (d.window as u32).into()),
        (
            k(keys::EXPERT_FEED_FORWARD_LENGTH),
            (d.n_ff_exp as u32).into(),
        ),
        (k(keys::EXPERT_SHARED_COUNT), (d.n_shared as u32).into()),
        (k(keys::EXPERT_WEIGHTS_SCALE), d.route_scale.into()),
        (k(keys::EXPERT_WEIGHTS_NORM), true.into()),
        (k(keys::SWIGLU_CLAMP_EXP), per_layer(d.swiglu_limit)),
        (k(keys::SWIGLU_CLAMP_SHEXP), per_layer(d.swiglu_limit)),
        (
            k(keys::ATTENTION_INDEXER_HEAD_COUNT),
            (d.ix_heads as u32).into(),
        ),
        (
            k(keys::ATTENTION_INDEXER_KEY_LENGTH),
            (d.ix_dim as u32).into(),
        ),
        (k(keys::ATTENTION_INDEXER_TOP_K), (d.ix_top_k as u32).into()),
        (
            k(keys::ATTENTION_OUTPUT_GROUP_COUNT),
            (d.o_groups as u32).into(),
        ),
        (
            k(keys::ATTENTION_OUTPUT_LORA_RANK),
            (d.o_lora as u32).into(),
        ),
        (
            k(keys::ATTENTION_COMPRESS_RATIOS),
            Value::Array(
                d.compress_ratios
                    .iter()
                    .chain(mtp.then_some(&0))
                    .map(|&r| Value::I32(r as i32))
                    .collect(),
            ),
        ),
        (
            k(keys::ATTENTION_COMPRESS_ROPE_FREQ_BASE),
            d.compress_rope_theta.into(),
        ),
        (k(keys::HYPER_CONNECTION_COUNT), (d.hc as u32).into()),
        (
            k(keys::HYPER_CONNECTION_SINKHORN_ITERATIONS),
            (d.sinkhorn_iters as u32).into(),
        ),
        (k(keys::HYPER_CONNECTION_EPSILON), d.hc_eps.into()),
        (k(keys::HASH_LAYER_COUNT), (d.n_hash as u32).into()),
        (k(keys::EMBEDDING_LENGTH_OUT), ((d.hc * h) as u32).into()),
    ]);
    if mtp {
        meta.push((k(keys::NEXTN_PREDICT_LAYERS), 1u32.into()));
    }

    let f32v = |name: String, shape: &[usize], init: Init| Draft::new(name, shape, Kind::F32, init);
    let mix = (2 + d.hc) * d.hc;
    let hc_in = d.hc * h;
    let shexp = d.n_ff_exp * d.n_shared;

    let mut t: Vec<Draft> = Vec::new();
    for l in 0..d.n_hash {
        t.push(Draft::new(
            format!("blk.{l}.ffn_gate_tid2eid.weight"),
            &[d.n_vocab, d.n_used],
            Kind::Fixed(DType::I32),
            Init::ExpertIds {
                n_expert: d.n_expert,
                skew,
                layer: l,
            },
        ));
    }
    let experts = |t: &mut Vec<Draft>, prefix: &str| {
        let (e, f) = (d.n_expert, d.n_ff_exp);
        for (s, shape) in [
            ("ffn_gate_exps", [e, f, h]),
            ("ffn_down_exps", [e, h, f]),
            ("ffn_up_exps", [e, f, h]),
        ] {
            let mut x = Draft::new(
                format!("{prefix}{s}.weight"),
                &shape,
                Kind::Fixed(DType::MXFP4),
                fan_in(shape[2]),
            );
            x.forced = Some(DType::MXFP4);
            t.push(x);
        }
    };
    for l in 0..n {
        experts(&mut t, &format!("blk.{l}."));
    }
    t.push(weight("token_embd.weight".into(), &[d.n_vocab, h]));
    t.push(f32v(
        "output_hc_base.weight".into(),
        &[d.hc],
        Init::Normal { std: 0.1 },
    ));
    t.push(weight("output_hc_fn.weight".into(), &[d.hc, hc_in]));
    t.push(f32v(
        "output_hc_scale.weight".into(),
        &[1],
        Init::Uniform { lo: 0.1, hi: 1.0 },
    ));
    t.push(weight("output.weight".into(), &[d.n_vocab, h]));
    // One block's tensors but its experts: `prefix` names it, `l` seeds its routing.
    let block = |t: &mut Vec<Draft>, prefix: &str, l: usize, ratio: usize, hashed: bool| {
        let b = |s: &str| format!("{prefix}{s}");
        t.push(f32v(
            b("attn_sinks.weight"),
            &[d.n_head],
            Init::Normal { std: 1.0 },
        ));
        if ratio > 0 {
            // Ratio-4 compressors overlap windows: twice the width.
            let c = if ratio == 4 { 2 } else { 1 };
            t.push(weight(
                b("attn_compressor_ape.weight"),
                &[ratio, c * d.head_dim],
            ));
            t.push(norm(b("attn_compressor_norm.weight"), d.head_dim));
            t.push(weight(
                b("attn_compressor_gate.weight"),
                &[c * d.head_dim, h],
            ));
            t.push(weight(b("attn_compressor_kv.weight"), &[c * d.head_dim, h]));
        }
        if ratio == 4 {
            t.push(weight(
                b("indexer_compressor_ape.weight"),
                &[4, 2 * d.ix_dim],
            ));
            t.push(norm(b("indexer_compressor_norm.weight"), d.ix_dim));
            t.push(weight(
                b("indexer_compressor_gate.weight"),
                &[2 * d.ix_dim, h],
            ));
            t.push(weight(
                b("indexer_compressor_kv.weight"),
                &[2 * d.ix_dim, h],
            ));
            t.push(weight(b("indexer.proj.weight"), &[d.ix_heads, h]));
            t.push(weight(
                b("indexer.attn_q_b.weight"),
                &[d.ix_heads * d.ix_dim, d.q_lora],
            ));
        }
        t.push(norm(b("attn_kv_a_norm.weight"), d.head_dim));
        t.push(norm(b("attn_q_a_norm.weight"), d.q_lora));
        t.push(weight(b("attn_kv.weight"), &[d.head_dim, h]));
        t.push(weight(
            b("attn_output_a.weight"),
            &[d.o_groups * d.o_lora, d.n_head * d.head_dim / d.o_groups],
        ));
        t.push(weight(
            b("attn_output_b.weight"),
            &[h, d.o_groups * d.o_lora],
        ));
        t.push(weight(b("attn_q_a.weight"), &[d.q_lora, h]));
        t.push(weight(
            b("attn_q_b.weight"),
            &[d.n_head * d.head_dim, d.q_lora],
        ));
        t.push(norm(b("attn_norm.weight"), h));
        if !hashed {
            t.push(f32v(
                b("exp_probs_b.bias"),
                &[d.n_expert],
                Init::ExpertBias {
                    skew,
                    top_k: d.n_used,
                    layer: l,
                },
            ));
        }
        // The router stays in the converter's type: llama-quantize never touches it.
        t.push(Draft::new(
            b("ffn_gate_inp.weight"),
            &[d.n_expert, h],
            Kind::Out,
            Init::Router {
                std: 1.0 / (h as f32).sqrt(),
                skew,
                top_k: d.n_used,
                layer: l,
            },
        ));
        t.push(weight(b("ffn_gate_shexp.weight"), &[shexp, h]));
        t.push(weight(b("ffn_down_shexp.weight"), &[h, shexp]));
        t.push(weight(b("ffn_up_shexp.weight"), &[shexp, h]));
        t.push(norm(b("ffn_norm.weight"), h));
        for s in ["attn", "ffn"] {
            t.push(f32v(
                b(&format!("hc_{s}_base.weight")),
                &[mix],
                Init::Normal { std: 0.1 },
            ));
            t.push(weight(b(&format!("hc_{s}_fn.weight")), &[mix, hc_in]));
            t.push(f32v(
                b(&format!("hc_{s}_scale.weight")),
                &[3],
                Init::Uniform { lo: 0.1, hi: 1.0 },
            ));
        }
    };
    for l in 0..n {
        let ratio = d.compress_ratios[l] as usize;
        block(&mut t, &format!("blk.{l}."), l, ratio, l < d.n_hash);
    }
    t.push(norm("output_norm.weight".into(), h));
    if mtp {
        let p = "mtp.0.";
        experts(&mut t, p);
        block(&mut t, p, n, 0, false);
        t.push(weight(format!("{p}e_proj.weight"), &[h, h]));
        t.push(weight(format!("{p}h_proj.weight"), &[h, h]));
        for s in ["enorm", "hnorm", "norm"] {
            t.push(norm(format!("{p}{s}.weight"), h));
        }
        t.push(f32v(
            format!("{p}hc_head_base.weight"),
            &[d.hc],
            Init::Normal { std: 0.1 },
        ));
        t.push(weight(format!("{p}hc_head_fn.weight"), &[d.hc, hc_in]));
        t.push(f32v(
            format!("{p}hc_head_scale.weight"),
            &[1],
            Init::Uniform { lo: 0.1, hi: 1.0 },
        ));
    }
    ArchDraft {
        arch,
        meta,
        tensors: t,
        n_layer: n,
        n_blocks: n,
        n_expert: d.n_expert,
        // The converter marks the file MOSTLY_MXFP4_MOE whatever its outtype.
        float_file_type: Some(38),
    }
}
