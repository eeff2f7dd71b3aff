//! Every GGUF metadata key lathe reads or writes, in one place.
//!
//! Names as llama.cpp's converter writes them (`gguf-py/gguf/constants.py`, `Keys`), checked
//! against the fixture files. Per-architecture keys are `<arch>.<suffix>`: build them with
//! [`key`], e.g. `key(arch, ATTENTION_HEAD_COUNT)` = `"qwen35.attention.head_count"`.

/// `<arch>.<suffix>`.
pub fn key(arch: &str, suffix: &str) -> String {
    format!("{arch}.{suffix}")
}

// Architecture names (`general.architecture`).
pub const ARCH_QWEN35: &str = "qwen35";
pub const ARCH_QWEN35MOE: &str = "qwen35moe";
pub const ARCH_QWEN3NEXT: &str = "qwen3next";
pub const ARCH_DEEPSEEK4: &str = "deepseek4";

// general.*
pub const GENERAL_ARCHITECTURE: &str = "general.architecture";
/// u32, a power of two; 32 when absent. Tensor data offsets are multiples of it.
pub const GENERAL_ALIGNMENT: &str = "general.alignment";
pub const GENERAL_TYPE: &str = "general.type";
pub const GENERAL_NAME: &str = "general.name";
pub const GENERAL_SIZE_LABEL: &str = "general.size_label";
/// u32, llama.cpp's `enum llama_ftype` (0 = all F32, 32 = mostly BF16, ...).
pub const GENERAL_FILE_TYPE: &str = "general.file_type";
pub const GENERAL_QUANTIZATION_VERSION: &str = "general.quantization_version";
/// string: what the model is, for people (gguf-py's `Keys.General.DESCRIPTION`).
pub const GENERAL_DESCRIPTION: &str = "general.description";

// lathe.*: lathe's own keys.
/// bool: the tensor data is random (`lathe synth`): the loaders say so, the text is noise.
pub const LATHE_RANDOM_WEIGHTS: &str = "lathe.random_weights";

// split.* (llama.cpp's gguf-split): in every shard.
/// u16, 0-based index of this shard.
pub const SPLIT_NO: &str = "split.no";
/// u16, number of shards.
pub const SPLIT_COUNT: &str = "split.count";
/// i32, number of tensors in all shards together.
pub const SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

// <arch>.* : shared hyper-parameters.
pub const VOCAB_SIZE: &str = "vocab_size";
pub const BLOCK_COUNT: &str = "block_count";
pub const CONTEXT_LENGTH: &str = "context_length";
pub const EMBEDDING_LENGTH: &str = "embedding_length";
pub const FEED_FORWARD_LENGTH: &str = "feed_forward_length";
pub const ATTENTION_HEAD_COUNT: &str = "attention.head_count";
pub const ATTENTION_HEAD_COUNT_KV: &str = "attention.head_count_kv";
pub const ATTENTION_KEY_LENGTH: &str = "attention.key_length";
pub const ATTENTION_VALUE_LENGTH: &str = "attention.value_length";
pub const ATTENTION_LAYERNORM_RMS_EPS: &str = "attention.layer_norm_rms_epsilon";
pub const ATTENTION_SLIDING_WINDOW: &str = "attention.sliding_window";
pub const ROPE_FREQ_BASE: &str = "rope.freq_base";
pub const ROPE_DIMENSION_COUNT: &str = "rope.dimension_count";
/// i32[4]: MRoPE sections (qwen35 / qwen35moe); text-only use treats it as plain RoPE.
pub const ROPE_DIMENSION_SECTIONS: &str = "rope.dimension_sections";
/// string: `none`, `linear`, `yarn`, ...
pub const ROPE_SCALING_TYPE: &str = "rope.scaling.type";
pub const ROPE_SCALING_FACTOR: &str = "rope.scaling.factor";
pub const ROPE_SCALING_ORIG_CTX_LEN: &str = "rope.scaling.original_context_length";
pub const ROPE_SCALING_ATTN_FACTOR: &str = "rope.scaling.attn_factor";
pub const ROPE_SCALING_YARN_BETA_FAST: &str = "rope.scaling.yarn_beta_fast";
pub const ROPE_SCALING_YARN_BETA_SLOW: &str = "rope.scaling.yarn_beta_slow";
pub const ROPE_SCALING_YARN_LOG_MUL: &str = "rope.scaling.yarn_log_multiplier";
pub const NEXTN_PREDICT_LAYERS: &str = "nextn_predict_layers";

// <arch>.* : mixture of experts.
pub const EXPERT_COUNT: &str = "expert_count";
pub const EXPERT_USED_COUNT: &str = "expert_used_count";
pub const EXPERT_FEED_FORWARD_LENGTH: &str = "expert_feed_forward_length";
pub const EXPERT_SHARED_FEED_FORWARD_LENGTH: &str = "expert_shared_feed_forward_length";
pub const EXPERT_SHARED_COUNT: &str = "expert_shared_count";
pub const EXPERT_WEIGHTS_SCALE: &str = "expert_weights_scale";
pub const EXPERT_WEIGHTS_NORM: &str = "expert_weights_norm";
/// u32, llama.cpp's `llama_expert_gating_func_type` (1 softmax, 2 sigmoid; deepseek4 files
/// carry 4, its sqrt(softplus) router).
pub const EXPERT_GATING_FUNC: &str = "expert_gating_func";

// <arch>.* : Gated DeltaNet (qwen35, qwen35moe, qwen3next; llama.cpp files them under ssm.*).
pub const SSM_CONV_KERNEL: &str = "ssm.conv_kernel";
/// Key/value head dimension of the linear-attention state.
pub const SSM_STATE_SIZE: &str = "ssm.state_size";
/// Number of key heads.
pub const SSM_GROUP_COUNT: &str = "ssm.group_count";
/// Number of value heads.
pub const SSM_TIME_STEP_RANK: &str = "ssm.time_step_rank";
/// Value heads × value head dim.
pub const SSM_INNER_SIZE: &str = "ssm.inner_size";
/// u32: layer i is full attention iff (i + 1) % interval == 0.
pub const FULL_ATTENTION_INTERVAL: &str = "full_attention_interval";
/// bool[n_layer]: true for linear-attention (recurrent) layers.
pub const ATTENTION_RECURRENT_LAYERS: &str = "attention.recurrent_layers";

// <arch>.* : DeepSeek-V4 (deepseek4).
pub const ATTENTION_Q_LORA_RANK: &str = "attention.q_lora_rank";
pub const ATTENTION_OUTPUT_GROUP_COUNT: &str = "attention.output_group_count";
pub const ATTENTION_OUTPUT_LORA_RANK: &str = "attention.output_lora_rank";
/// i32[n_layer]: 0 (sliding only), 4 (overlapping compressor + indexer) or 128.
pub const ATTENTION_COMPRESS_RATIOS: &str = "attention.compress_ratios";
/// f32: RoPE theta of the compressed layers (the YaRN `rope.scaling.*` keys apply to them).
pub const ATTENTION_COMPRESS_ROPE_FREQ_BASE: &str = "attention.compress_rope_freq_base";
pub const ATTENTION_INDEXER_HEAD_COUNT: &str = "attention.indexer.head_count";
pub const ATTENTION_INDEXER_KEY_LENGTH: &str = "attention.indexer.key_length";
pub const ATTENTION_INDEXER_TOP_K: &str = "attention.indexer.top_k";
/// f32[n_layer]: clamp of the routed experts' SwiGLU (`swiglu_limit`).
pub const SWIGLU_CLAMP_EXP: &str = "swiglu_clamp_exp";
/// f32[n_layer]: clamp of the shared expert's SwiGLU.
pub const SWIGLU_CLAMP_SHEXP: &str = "swiglu_clamp_shexp";
/// u32: hyper-connection copies (`hc_mult`).
pub const HYPER_CONNECTION_COUNT: &str = "hyper_connection.count";
pub const HYPER_CONNECTION_SINKHORN_ITERATIONS: &str = "hyper_connection.sinkhorn_iterations";
pub const HYPER_CONNECTION_EPSILON: &str = "hyper_connection.epsilon";
/// u32: the first this-many layers route by `tid2eid[token]`.
pub const HASH_LAYER_COUNT: &str = "hash_layer_count";
/// u32: hc_mult × hidden, the width of the output head's hyper-connection input.
pub const EMBEDDING_LENGTH_OUT: &str = "embedding_length_out";

// tokenizer.*
/// string: `gpt2` (byte-level BPE), `llama` (SentencePiece), `none` (no tokenizer), ...
pub const TOKENIZER_MODEL: &str = "tokenizer.ggml.model";
/// string: the pre-tokenizer name (`qwen35`, `deepseek-v3`, ...).
pub const TOKENIZER_PRE: &str = "tokenizer.ggml.pre";
pub const TOKENIZER_TOKENS: &str = "tokenizer.ggml.tokens";
pub const TOKENIZER_SCORES: &str = "tokenizer.ggml.scores";
/// i32[]: llama.cpp's `llama_token_type` per token (1 normal, 2 unknown, 3 control,
/// 4 user-defined, 5 unused, 6 byte).
pub const TOKENIZER_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
pub const TOKENIZER_MERGES: &str = "tokenizer.ggml.merges";
pub const TOKENIZER_BOS_ID: &str = "tokenizer.ggml.bos_token_id";
pub const TOKENIZER_EOS_ID: &str = "tokenizer.ggml.eos_token_id";
pub const TOKENIZER_EOT_ID: &str = "tokenizer.ggml.eot_token_id";
pub const TOKENIZER_EOM_ID: &str = "tokenizer.ggml.eom_token_id";
pub const TOKENIZER_UNK_ID: &str = "tokenizer.ggml.unknown_token_id";
pub const TOKENIZER_PAD_ID: &str = "tokenizer.ggml.padding_token_id";
pub const TOKENIZER_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
pub const TOKENIZER_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
pub const TOKENIZER_CHAT_TEMPLATE: &str = "tokenizer.chat_template";
/// i32[]: ids the model must never emit, masked before sampling (llama.cpp's
/// `LLM_KV_TOKENIZER_SUPPRESS_TOKENS`; Gemma-4 QAT conversions carry two control ids).
pub const TOKENIZER_SUPPRESS_TOKENS: &str = "tokenizer.ggml.suppress_tokens";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_keys_join_with_a_dot() {
        assert_eq!(
            key(ARCH_QWEN35MOE, EXPERT_SHARED_FEED_FORWARD_LENGTH),
            "qwen35moe.expert_shared_feed_forward_length"
        );
        assert_eq!(
            key(ARCH_DEEPSEEK4, ATTENTION_INDEXER_TOP_K),
            "deepseek4.attention.indexer.top_k"
        );
    }
}
