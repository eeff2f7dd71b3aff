//! Shapes of the released models synth imitates, plus a small demo.
//!
//! Numbers from the models' own `config.json` files (Qwen3.5: `text_config`; DeepSeek-V4:
//! the release's flat config, `inference/config_flash.json` of DeepSeek's repository). The tokenizer
//! and vision tower are not part of the shape: synth writes the text model only, as
//! `convert_hf_to_gguf.py --no-mtp` does (no MTP layers).

use super::ftype::FileType;
use crate::{Error, Result};

/// A Qwen3.5 / 3.6 text model (`qwen35`, or `qwen35moe` with `moe`).
#[derive(Clone, Debug, PartialEq)]
pub struct QwenDims {
    pub n_embd: usize,
    pub n_layer: usize,
    /// Dense FFN width (unused by MoE models).
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Rotated dims per head (a quarter of the head in the releases).
    pub rope_dim: usize,
    /// Gated DeltaNet key heads (`ssm.group_count`) and value heads (`ssm.time_step_rank`).
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub d_k: usize,
    pub d_v: usize,
    pub conv_kernel: usize,
    /// Layer i is full attention iff (i + 1) % interval == 0.
    pub full_attention_interval: usize,
    pub n_vocab: usize,
    /// No `output.weight`: the embedding doubles as the output head.
    pub tied: bool,
    pub ctx: usize,
    pub rope_theta: f32,
    pub eps: f32,
    pub moe: Option<QwenMoe>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct QwenMoe {
    pub n_expert: usize,
    pub n_used: usize,
    pub n_ff_exp: usize,
    pub n_ff_shexp: usize,
}

/// DeepSeek-V4 (`deepseek4`).
#[derive(Clone, Debug, PartialEq)]
pub struct DsDims {
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora: usize,
    pub o_groups: usize,
    pub o_lora: usize,
    pub n_expert: usize,
    pub n_used: usize,
    pub n_ff_exp: usize,
    pub n_shared: usize,
    pub window: usize,
    pub ix_heads: usize,
    pub ix_dim: usize,
    pub ix_top_k: usize,
    /// Per layer: 0 (sliding window only), 4 (overlapping compressor + indexer) or 128.
    pub compress_ratios: Vec<u32>,
    /// The first this-many layers route by `tid2eid[token]`.
    pub n_hash: usize,
    pub hc: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub n_vocab: usize,
    pub ctx: usize,
    pub rope_theta: f32,
    pub compress_rope_theta: f32,
    pub yarn: Option<Yarn>,
    pub eps: f32,
    pub route_scale: f32,
    pub swiglu_limit: f32,
}

/// YaRN of the compressed layers (`rope.scaling.*`).
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    pub orig_ctx: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// The plain transformer family: `llama`, `qwen3` (q/k norms), `qwen3moe` (routed experts,
/// no shared one).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaDims {
    /// GGUF architecture.
    pub arch: &'static str,
    pub n_embd: usize,
    pub n_layer: usize,
    /// Dense FFN width (MoE files carry it too: the converter writes `intermediate_size`).
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub qk_norm: bool,
    pub n_vocab: usize,
    pub tied: bool,
    pub ctx: usize,
    pub rope_theta: f32,
    pub eps: f32,
    /// Routed experts; `n_ff_shexp` is 0.
    pub moe: Option<QwenMoe>,
}

/// Step-3.5/3.7-Flash (`step35`): sliding and full layers with their own query heads, dense
/// layers first, then sigmoid-routed experts with a shared one.
#[derive(Clone, Debug, PartialEq)]
pub struct StepDims {
    pub n_embd: usize,
    pub n_layer: usize,
    /// Width of the leading dense blocks' FFN.
    pub n_ff: usize,
    /// Query heads of full and of sliding layers; KV heads of both.
    pub n_head: usize,
    pub n_head_swa: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Per layer: sliding window (else full attention).
    pub swa: Vec<bool>,
    pub window: usize,
    /// The first this-many layers are dense.
    pub n_dense: usize,
    pub n_vocab: usize,
    pub ctx: usize,
    pub rope_theta: f32,
    pub rope_theta_swa: f32,
    /// llama3 divisors of the full layers (`rope_freqs.weight`).
    pub rope_freqs: bool,
    pub eps: f32,
    pub moe: QwenMoe,
    /// `moe_router_scaling_factor`.
    pub route_scale: f32,
    /// Per layer SwiGLU clamps of the routed and the shared experts (0: none).
    pub clamp_exp: Vec<f32>,
    pub clamp_shexp: Vec<f32>,
}

/// Gemma-4 (`gemma4`): sliding and global layers with their own head size and KV head count,
/// a GELU-gated dense FFN on every layer and, in MoE layouts, routed experts beside it.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmaDims {
    pub n_embd: usize,
    pub n_layer: usize,
    /// The dense FFN's width (the shared branch of MoE layers).
    pub n_ff: usize,
    pub n_head: usize,
    /// KV heads of sliding and of global layers.
    pub n_head_kv: usize,
    pub n_head_kv_global: usize,
    /// Head size of sliding and of global layers.
    pub head_dim_swa: usize,
    pub head_dim: usize,
    /// Per layer: sliding window (else global attention).
    pub swa: Vec<bool>,
    pub window: usize,
    pub n_vocab: usize,
    pub ctx: usize,
    pub rope_theta: f32,
    pub rope_theta_swa: f32,
    /// The global layers' `partial_rotary_factor` (their other pairs do not turn).
    pub rope_frac: f32,
    pub eps: f32,
    pub softcap: f32,
    /// Global layers take V from the K projection (`attention_k_eq_v`: no `attn_v`).
    pub k_eq_v: bool,
    /// Routed experts beside the dense branch; `n_ff_shexp` is 0.
    pub moe: Option<QwenMoe>,
    /// Per-layer embedding columns per block (E2B/E4B; 0: none).
    pub n_epl: usize,
    /// The last blocks, without K/V of their own, attending an earlier block's cache.
    pub n_kv_shared: usize,
    /// The KV-shared blocks' FFN is twice `n_ff` wide (`use_double_wide_mlp`).
    pub double_wide: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Dims {
    Qwen35(QwenDims),
    Deepseek4(DsDims),
    Llama(LlamaDims),
    Step(StepDims),
    Gemma(GemmaDims),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Preset {
    /// The `--preset` name.
    pub name: String,
    /// `general.name`.
    pub display: String,
    pub dims: Dims,
    pub default_type: FileType,
    /// Small enough for lavapipe: the vocabulary follows a given tokenizer exactly.
    pub demo: bool,
}

/// Qwen3.5's vocabulary (the embedding rows; the tokenizer has a few hundred fewer ids).
pub const QWEN35_VOCAB: usize = 248_320;
/// DeepSeek-V4's vocabulary.
pub const DSV4_VOCAB: usize = 129_280;

/// The names `--preset` takes.
pub const PRESET_NAMES: &[&str] = &[
    "demo",
    "demo-deepseek4",
    "qwen3.5-0.8b",
    "qwen3.5-4b",
    "qwen3.5-9b",
    "qwen3.5-27b",
    "qwen3.5-35b-a3b",
    "qwen3.5-122b-a10b",
    "deepseek-v4-flash",
    "qwen3-8b",
    "qwen3-30b-a3b",
    "llama-3.1-8b",
    "step-3.7-flash",
    "gemma-4-31b",
    "gemma-4-26b-a4b",
    "gemma-4-e4b",
];

/// Qwen3's vocabulary (embedding rows) and Llama 3's.
pub const QWEN3_VOCAB: usize = 151_936;
pub const LLAMA3_VOCAB: usize = 128_256;
/// Step-3.7's vocabulary (transformers' `Step3p7TextConfig` default, from the release).
pub const STEP37_VOCAB: usize = 128_815;
/// Gemma-4's vocabulary.
pub const GEMMA4_VOCAB: usize = 262_144;

/// Step-3.7-Flash (stepfun-ai/Step-3.7-Flash `config.json`, `text_config`): 45 layers, full
/// attention on every fourth from 0 (64 heads, RoPE 5e6 on half the head, llama3 factors),
/// sliding window 512 elsewhere (96 heads, RoPE 1e4 on all of it), 8 KV heads of 128; 3 dense
/// layers, then 288 experts top-8 of 1280 with a 1280 shared expert; SwiGLU clamps 7 (routed)
/// and 16 (shared) on the last two layers. The MTP blocks ship in their own file.
fn step_3_7_flash() -> StepDims {
    let n_layer = 45;
    let clamp = |v: f32| {
        (0..n_layer)
            .map(|l| if l >= 43 { v } else { 0.0 })
            .collect()
    };
    StepDims {
        n_embd: 4096,
        n_layer,
        n_ff: 11264,
        n_head: 64,
        n_head_swa: 96,
        n_head_kv: 8,
        head_dim: 128,
        swa: (0..n_layer).map(|l| l % 4 != 0).collect(),
        window: 512,
        n_dense: 3,
        n_vocab: STEP37_VOCAB,
        ctx: 262_144,
        rope_theta: 5e6,
        rope_theta_swa: 1e4,
        rope_freqs: true,
        eps: 1e-5,
        moe: QwenMoe {
            n_expert: 288,
            n_used: 8,
            n_ff_exp: 1280,
            n_ff_shexp: 1280,
        },
        route_scale: 3.0,
        clamp_exp: clamp(7.0),
        clamp_shexp: clamp(16.0),
    }
}

/// What the Gemma-4 releases share (google/gemma-4-31B and gemma-4-26B-A4B `config.json`,
/// `text_config`): a global layer after every five sliding ones (the last layer is global),
/// window 1024, sliding heads of 256 with RoPE 1e4 on all of them, global heads of 512 with
/// RoPE 1e6 on a quarter and V taken from K, logits softcapped at 30.
fn gemma(
    n_embd: usize,
    n_layer: usize,
    n_ff: usize,
    n_head: usize,
    kv_heads: (usize, usize),
    moe: Option<QwenMoe>,
) -> GemmaDims {
    GemmaDims {
        n_embd,
        n_layer,
        n_ff,
        n_head,
        n_head_kv: kv_heads.0,
        n_head_kv_global: kv_heads.1,
        head_dim_swa: 256,
        head_dim: 512,
        swa: (0..n_layer).map(|l| l % 6 != 5).collect(),
        window: 1024,
        n_vocab: GEMMA4_VOCAB,
        ctx: 262_144,
        rope_theta: 1e6,
        rope_theta_swa: 1e4,
        rope_frac: 0.25,
        eps: 1e-6,
        softcap: 30.0,
        k_eq_v: true,
        moe,
        n_epl: 0,
        n_kv_shared: 0,
        double_wide: false,
    }
}

/// Gemma 4 E4B (google/gemma-4-E4B `config.json`, `text_config`, as NVIDIA's Megatron-Bridge
/// Gemma 4 recipe and gemma.cpp's `ConfigGemma4_E4B` restate it): 42 layers of 2560, FFN
/// 10240 on every layer, 8 heads, 2 KV heads of 256 (sliding) and of 512 (global, with their
/// own V), a global layer after every five sliding ones, window 512, context 128K, per-layer embeddings of
/// 256 per layer over the whole vocabulary, and the last 18 layers sharing KV.
fn gemma_4_e4b() -> GemmaDims {
    GemmaDims {
        window: 512,
        ctx: 131_072,
        k_eq_v: false,
        n_epl: 256,
        n_kv_shared: 18,
        ..gemma(2560, 42, 10240, 8, (2, 2), None)
    }
}

/// Everything the Qwen3.5 releases share: 256-wide attention heads rotating a quarter,
/// GDN heads of 128, conv kernel 4, full attention every fourth layer, theta 1e7.
fn qwen(
    n_embd: usize,
    n_layer: usize,
    n_ff: usize,
    heads: (usize, usize),
    gdn_heads: (usize, usize),
    tied: bool,
    moe: Option<QwenMoe>,
) -> QwenDims {
    QwenDims {
        n_embd,
        n_layer,
        n_ff,
        n_head: heads.0,
        n_head_kv: heads.1,
        head_dim: 256,
        rope_dim: 64,
        n_k_heads: gdn_heads.0,
        n_v_heads: gdn_heads.1,
        d_k: 128,
        d_v: 128,
        conv_kernel: 4,
        full_attention_interval: 4,
        n_vocab: QWEN35_VOCAB,
        tied,
        ctx: 262_144,
        rope_theta: 1e7,
        eps: 1e-6,
        moe,
    }
}

fn moe(n_ff_exp: usize) -> Option<QwenMoe> {
    Some(QwenMoe {
        n_expert: 256,
        n_used: 8,
        n_ff_exp,
        n_ff_shexp: n_ff_exp,
    })
}

/// DeepSeek-V4-Flash: 43 layers, ratios 0, 0, then 4 / 128 alternating, the last 4.
fn deepseek_v4_flash() -> DsDims {
    let n_layer = 43;
    let compress_ratios = (0..n_layer)
        .map(|i| match i {
            0 | 1 => 0,
            i if i % 2 == 0 => 4,
            _ => 128,
        })
        .collect();
    DsDims {
        n_embd: 4096,
        n_layer,
        n_head: 64,
        head_dim: 512,
        rope_dim: 64,
        q_lora: 1024,
        o_groups: 8,
        o_lora: 1024,
        n_expert: 256,
        n_used: 6,
        n_ff_exp: 2048,
        n_shared: 1,
        window: 128,
        ix_heads: 64,
        ix_dim: 128,
        ix_top_k: 512,
        compress_ratios,
        n_hash: 3,
        hc: 4,
        sinkhorn_iters: 20,
        hc_eps: 1e-6,
        n_vocab: DSV4_VOCAB,
        ctx: 1_048_576,
        rope_theta: 10_000.0,
        compress_rope_theta: 160_000.0,
        yarn: Some(Yarn {
            factor: 16.0,
            orig_ctx: 65_536,
            beta_fast: 32.0,
            beta_slow: 1.0,
        }),
        eps: 1e-6,
        route_scale: 1.5,
        swiglu_limit: 10.0,
    }
}

/// The preset called `name` (see [`PRESET_NAMES`]).
pub fn preset(name: &str) -> Result<Preset> {
    let q = |display: &str, dims: QwenDims| Preset {
        name: name.to_string(),
        display: display.to_string(),
        dims: Dims::Qwen35(dims),
        default_type: FileType::Q4_K_M,
        demo: false,
    };
    Ok(match name.to_ascii_lowercase().as_str() {
        // Qwen3.5 architecture at lavapipe scale: 3 GDN layers and 1 attention layer, heads
        // of 64, every matrix row a whole number of 256-blocks so Q4_K_M needs no fallback.
        "demo" => Preset {
            name: "demo".into(),
            display: "Lathe Demo".into(),
            dims: Dims::Qwen35(QwenDims {
                n_embd: 256,
                n_layer: 4,
                n_ff: 512,
                n_head: 4,
                n_head_kv: 2,
                head_dim: 64,
                rope_dim: 16,
                n_k_heads: 2,
                n_v_heads: 4,
                d_k: 64,
                d_v: 64,
                conv_kernel: 4,
                full_attention_interval: 4,
                n_vocab: QWEN35_VOCAB,
                tied: false,
                ctx: 32_768,
                rope_theta: 1e7,
                eps: 1e-6,
                moe: None,
            }),
            default_type: FileType::Q4_K_M,
            demo: true,
        },
        // DeepSeek-V4 at lavapipe scale: 4 layers (window only, ratio 4 with its indexer,
        // ratio 128, window only), 4 heads of 128 rotating 64, 16 experts top-2 behind one
        // hash-routed layer; every row a whole number of 32-blocks for Q8_0 and MXFP4.
        "demo-deepseek4" => Preset {
            name: "demo-deepseek4".into(),
            display: "Lathe Demo DeepSeek-V4".into(),
            dims: Dims::Deepseek4(DsDims {
                n_embd: 256,
                n_layer: 4,
                n_head: 4,
                head_dim: 128,
                rope_dim: 64,
                q_lora: 128,
                o_groups: 2,
                o_lora: 128,
                n_expert: 16,
                n_used: 2,
                n_ff_exp: 256,
                n_shared: 1,
                window: 32,
                ix_heads: 4,
                ix_dim: 64,
                ix_top_k: 16,
                compress_ratios: vec![0, 4, 128, 0],
                n_hash: 1,
                ..deepseek_v4_flash()
            }),
            default_type: FileType::Q8_0,
            demo: true,
        },
        // The small releases tie the output head to the embedding (0.8B's config says
        // tie_word_embeddings: true; the 4B is taken to do the same).
        "qwen3.5-0.8b" => q(
            "Qwen3.5 0.8B",
            qwen(1024, 24, 3584, (8, 2), (16, 16), true, None),
        ),
        "qwen3.5-4b" => q(
            "Qwen3.5 4B",
            qwen(2560, 32, 9216, (16, 4), (16, 32), true, None),
        ),
        "qwen3.5-9b" => q(
            "Qwen3.5 9B",
            qwen(4096, 32, 12288, (16, 4), (16, 32), false, None),
        ),
        "qwen3.5-27b" => q(
            "Qwen3.5 27B",
            qwen(5120, 64, 17408, (24, 4), (16, 48), false, None),
        ),
        "qwen3.5-35b-a3b" => q(
            "Qwen3.5 35B A3B",
            qwen(2048, 40, 0, (16, 2), (16, 32), false, moe(512)),
        ),
        "qwen3.5-122b-a10b" => q(
            "Qwen3.5 122B A10B",
            qwen(3072, 48, 0, (32, 2), (16, 64), false, moe(1024)),
        ),
        // Qwen/Qwen3-8B and Qwen/Qwen3-30B-A3B config.json (heads of 128, theta 1e6).
        "qwen3-8b" => Preset {
            name: name.to_string(),
            display: "Qwen3 8B".into(),
            dims: Dims::Llama(LlamaDims {
                arch: "qwen3",
                n_embd: 4096,
                n_layer: 36,
                n_ff: 12288,
                n_head: 32,
                n_head_kv: 8,
                head_dim: 128,
                qk_norm: true,
                n_vocab: QWEN3_VOCAB,
                tied: false,
                ctx: 40_960,
                rope_theta: 1e6,
                eps: 1e-6,
                moe: None,
            }),
            default_type: FileType::Q4_K_M,
            demo: false,
        },
        "qwen3-30b-a3b" => Preset {
            name: name.to_string(),
            display: "Qwen3 30B A3B".into(),
            dims: Dims::Llama(LlamaDims {
                arch: "qwen3moe",
                n_embd: 2048,
                n_layer: 48,
                n_ff: 6144,
                n_head: 32,
                n_head_kv: 4,
                head_dim: 128,
                qk_norm: true,
                n_vocab: QWEN3_VOCAB,
                tied: false,
                ctx: 40_960,
                rope_theta: 1e6,
                eps: 1e-6,
                moe: Some(QwenMoe {
                    n_expert: 128,
                    n_used: 8,
                    n_ff_exp: 768,
                    n_ff_shexp: 0,
                }),
            }),
            default_type: FileType::Q4_K_M,
            demo: false,
        },
        // meta-llama/Llama-3.1-8B config.json.
        "llama-3.1-8b" => Preset {
            name: name.to_string(),
            display: "Llama 3.1 8B".into(),
            dims: Dims::Llama(LlamaDims {
                arch: "llama",
                n_embd: 4096,
                n_layer: 32,
                n_ff: 14336,
                n_head: 32,
                n_head_kv: 8,
                head_dim: 128,
                qk_norm: false,
                n_vocab: LLAMA3_VOCAB,
                tied: false,
                ctx: 131_072,
                rope_theta: 500_000.0,
                eps: 1e-5,
                moe: None,
            }),
            default_type: FileType::Q4_K_M,
            demo: false,
        },
        "step-3.7-flash" => Preset {
            name: name.to_string(),
            display: "Step 3.7 Flash".into(),
            dims: Dims::Step(step_3_7_flash()),
            default_type: FileType::Q4_K_M,
            demo: false,
        },
        "gemma-4-e4b" => Preset {
            name: name.to_string(),
            display: "Gemma 4 E4B".into(),
            dims: Dims::Gemma(gemma_4_e4b()),
            default_type: FileType::Q4_K_M,
            demo: false,
        },
        "gemma-4-31b" => Preset {
            name: name.to_string(),
            display: "Gemma 4 31B".into(),
            dims: Dims::Gemma(gemma(5376, 60, 21504, 32, (16, 4), None)),
            default_type: FileType::Q4_K_M,
            demo: false,
        },
        // 128 experts top-8 of 704 beside a 2112-wide dense branch.
        "gemma-4-26b-a4b" => Preset {
            name: name.to_string(),
            display: "Gemma 4 26B A4B".into(),
            dims: Dims::Gemma(gemma(
                2816,
                30,
                2112,
                16,
                (8, 2),
                Some(QwenMoe {
                    n_expert: 128,
                    n_used: 8,
                    n_ff_exp: 704,
                    n_ff_shexp: 0,
                }),
            )),
            default_type: FileType::Q4_K_M,
            demo: false,
        },
        // llama.cpp's own V4 files: Q8_0 with the routed experts kept in MXFP4.
        "deepseek-v4-flash" => Preset {
            name: name.to_string(),
            display: "DeepSeek V4 Flash".into(),
            dims: Dims::Deepseek4(deepseek_v4_flash()),
            default_type: FileType::Q8_0,
            demo: false,
        },
        _ => {
            return Err(Error::Invalid(format!(
                "--preset {name}: expected one of {}",
                PRESET_NAMES.join(", ")
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_builds() {
        for n in PRESET_NAMES {
            let p = preset(n).unwrap();
            assert_eq!(&p.name, n);
        }
        assert!(preset("qwen3.5-1t").is_err());
    }

    #[test]
    fn flash_ratios_follow_the_release() {
        let Dims::Deepseek4(d) = preset("deepseek-v4-flash").unwrap().dims else {
            panic!("not deepseek4")
        };
        assert_eq!(d.compress_ratios.len(), 43);
        assert_eq!(&d.compress_ratios[..6], &[0, 0, 4, 128, 4, 128]);
        assert_eq!(d.compress_ratios[42], 4);
        assert_eq!(d.compress_ratios.iter().filter(|&&r| r == 4).count(), 21);
    }
}
