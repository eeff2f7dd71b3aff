//! The contract between a forward and its callers: how to load a model ([`LoadOptions`],
//! which carries the choices of the layers that own them: adapter and kernels from `gpu`,
//! the CPU's instruction set from `cpu`, the expert policies from `moe`, a device's part from
//! `model_file`) and which logits a forward returns ([`Want`], [`Logits`]). `engine`
//! re-exports it as the library's API; the planner (`moe`) and the model families use it
//! without importing the engine.

use crate::cpu::simd::SimdLevel;
use crate::gpu::topk::{TopLogits, MAX_TOP_K};
use crate::gpu::{ActivationsChoice, AdapterChoice, MatmulChoice};
use crate::model_file::PartSpec;
use crate::moe::{CacheConfig, ColdLayers, ExpertStream};
use crate::{Error, Result};
use std::sync::Arc;

/// Element type of the attention KV cache. `Auto` is the architecture's default: f16 for
/// Qwen3.5, the Llama family and Step-3.7 (their fixtures meet the bar with it, at half the
/// bytes), f32 for DeepSeek-V4, whose one shared K=V head is small but whose indexer top-k
/// flips on f16-rounded keys (measured: dsv4-dims RMS 0.02-0.033 against the reference with
/// f16, 4e-6 with f32), and for Gemma-4, whose unscaled scores of normed heads make f16 rows
/// cost ~2e-3 RMS on its fixtures (`models::gemma4::gpu`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvType {
    #[default]
    Auto,
    F16,
    F32,
}

impl std::str::FromStr for KvType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(KvType::Auto),
            "f16" => Ok(KvType::F16),
            "f32" => Ok(KvType::F32),
            _ => Err(Error::Invalid(format!(
                "--kv-type {s}: expected auto, f16 or f32"
            ))),
        }
    }
}

/// Called while weights upload: `(bytes done, bytes total)`.
pub type Progress = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// How to load and run a model. Defaults are what most users want.
#[derive(Clone)]
pub struct LoadOptions {
    pub adapter: AdapterChoice,
    pub kv_type: KvType,
    /// Context length the caches are sized for (they grow beyond it when needed).
    pub ctx: usize,
    /// Sequences that can be live at once (each holds a slot of KV and recurrent state).
    pub max_seqs: usize,
    pub progress: Option<Progress>,
    /// Adapter memory the budget divides (`--gpu-mem`): empty, detected
    /// (`moe::AdapterMemory::detect`); one size, that of every device; with `devices`, one
    /// per device ([`LoadOptions::gpu_mem_of`]). What the model needs beside its routed
    /// experts is taken first; the rest holds expert slots, so a model that fits runs all on
    /// the GPU.
    pub gpu_mem: Vec<u64>,
    /// Share of each MoE layer's experts given arena slots (`--gpu-experts`, 0..=1);
    /// overrides the budget.
    pub gpu_experts: Option<f64>,
    /// Routing statistics (`--expert-stats`, written by `--save-expert-stats`) that choose
    /// the hot experts; without them the slots are spread evenly.
    pub expert_stats: Option<std::path::PathBuf>,
    /// Count every MoE layer's router picks ([`crate::engine::Engine::save_expert_stats`]),
    /// adding to the counts of `expert_stats` when given; costs one readback per MoE layer
    /// and token.
    pub collect_expert_stats: bool,
    /// Count them (as `collect_expert_stats`) and write them here by
    /// [`crate::engine::Engine::finish_expert_stats`], or when the model is dropped
    /// (`--save-expert-stats`).
    pub save_expert_stats: Option<std::path::PathBuf>,
    /// Residency policy while decoding; `None`: `moe::CacheConfig::default()`.
    pub expert_cache: Option<CacheConfig>,
    /// Kernels of many-token products (`--matmul`).
    pub matmul: MatmulChoice,
    /// Activations of the one-token products (`--activations`).
    pub activations: ActivationsChoice,
    /// Cold experts of large batches: streamed to the GPU or run on the CPU
    /// (`--expert-stream`).
    pub expert_stream: ExpertStream,
    /// Spread the cold experts over every layer or keep whole layers cold (`--cold-layers`).
    pub cold_layers: ColdLayers,
    /// Instruction set of the cold experts' CPU kernels (`--cpu-simd`); `None`: the widest
    /// the CPU has.
    pub cpu_simd: Option<SimdLevel>,
    /// Decode folds the RMSNorms and the output gates into the next product's activation load
    /// (`matvec::Prologue`; r from one pass over the row per workgroup after the product),
    /// `--fused-loads`, on by default. Qwen3.5-9B decode takes 5.75 dispatches per layer
    /// against 7.75 with it off (SwiGLU joins the gate+up product's store either way,
    /// `matvec::Epilogue::SwiGlu`). The fused products read f32 x (see `ActivationsChoice`).
    /// `--fused-loads auto` is [`LoadOptions::fused_loads_auto`] of the command's rows per
    /// decode pass (the default here: one).
    pub fused_loads: bool,
    /// Several devices (`--devices`): the model's layers split over them in contiguous
    /// ranges (`models::chain`); empty or one: the single device of `adapter`.
    pub devices: Vec<AdapterChoice>,
    /// Share of the layers per device (`--split`, any positive ratios); `None`: by each
    /// adapter's memory (`gpu_mem` or detected), equal where it is unknown.
    pub split: Option<Vec<f64>>,
    /// The layers this load holds, set by the chain loader for each device's part; `None`:
    /// the whole model.
    pub part: Option<PartSpec>,
    /// With several devices: a batch of several sequences runs as this many micro-batches,
    /// one after another through the devices, so the first device starts the next while
    /// the second runs the one before (`--micro-batches`; 1: the batch at once).
    pub micro_batches: usize,
    /// A multi-token prediction block kept in a file of its own (`--mtp-model`): Step-3.5/3.7
    /// ship theirs apart from the trunk (llama.cpp's converter `--mtp`).
    pub mtp_model: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("adapter", &self.adapter)
            .field("kv_type", &self.kv_type)
            .field("ctx", &self.ctx)
            .field("max_seqs", &self.max_seqs)
            .field("gpu_mem", &self.gpu_mem)
            .field("gpu_experts", &self.gpu_experts)
            .field("expert_stats", &self.expert_stats)
            .field("collect_expert_stats", &self.collect_expert_stats)
            .field("save_expert_stats", &self.save_expert_stats)
            .field("expert_cache", &self.expert_cache)
            .field("expert_stream", &self.expert_stream)
            .field("cold_layers", &self.cold_layers)
            .field("cpu_simd", &self.cpu_simd)
            .field("matmul", &self.matmul)
            .field("activations", &self.activations)
            .field("fused_loads", &self.fused_loads)
            .field("devices", &self.devices)
            .field("split", &self.split)
            .field("part", &self.part)
            .field("micro_batches", &self.micro_batches)
            .field("mtp_model", &self.mtp_model)
            .finish()
    }
}

/// Most rows per decode pass for which `--fused-loads auto` takes fused loads. The
/// token-group kernel runs the fused norm's pass over each token's row inside every
/// workgroup, so batches lose with them (H200, Qwen3.5-9B, issue 34, 2026-12-03: a verify
/// pass of 4 rows 18.0 ms fused against 11.9 ms unfused, one decode step 5.7 ms; 16 server
/// streams about 5 against 12 tok/s each). Raise it once that kernel computes the prologue
/// once per token group: `run`, `serve` and `bench` all follow.
pub const FUSED_LOADS_AUTO_ROWS: usize = 1;

impl LoadOptions {
    /// `--fused-loads auto` for a command whose decode passes carry up to `decode_rows`
    /// rows (sequences decoded together times the rows of a verify pass): the one default
    /// of `run`, `serve` and `bench`.
    pub fn fused_loads_auto(decode_rows: usize) -> bool {
        decode_rows <= FUSED_LOADS_AUTO_ROWS
    }

    /// The `gpu_mem` size of device `i` (of `devices`; 0 for a single device): the one size
    /// given for all, or the device's own; `None`: detect it.
    pub fn gpu_mem_of(&self, i: usize) -> Option<u64> {
        match self.gpu_mem[..] {
            [one] => Some(one),
            ref sizes => sizes.get(i).copied(),
        }
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            adapter: AdapterChoice::Auto,
            kv_type: KvType::Auto,
            ctx: 4096,
            max_seqs: 4,
            progress: None,
            gpu_mem: Vec::new(),
            gpu_experts: None,
            expert_stats: None,
            collect_expert_stats: false,
            save_expert_stats: None,
            expert_cache: None,
            matmul: Default::default(),
            activations: Default::default(),
            expert_stream: Default::default(),
            cold_layers: Default::default(),
            cpu_simd: None,
            fused_loads: LoadOptions::fused_loads_auto(1),
            devices: Vec::new(),
            split: None,
            part: None,
            micro_batches: 1,
            mtp_model: None,
        }
    }
}

/// Which logits a batched forward returns for one sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    None,
    Last,
    All,
    /// The `k` (≤ `MAX_TOP_K`) best logits of the last token, found on the GPU in
    /// the forward's pass, and with `lse` their row's log-sum-exp: only those come back
    /// ([`Logits::Top`]). What a sampler needs is [`crate::sample::SamplerConfig::gpu_want`].
    Top {
        k: u32,
        lse: bool,
    },
}

/// What a forward returned for one sequence.
#[derive(Clone, Debug, PartialEq)]
pub enum Logits {
    /// `[n, vocab]` row-major (empty for [`Want::None`]).
    Full(Vec<f32>),
    /// For [`Want::Top`].
    Top(TopLogits),
}

impl Logits {
    /// The full logits; a [`Logits::Top`] gives an empty vector.
    pub fn into_full(self) -> Vec<f32> {
        match self {
            Logits::Full(v) => v,
            Logits::Top(_) => Vec::new(),
        }
    }
}

/// What greedy decoding asks for: the argmax, found on the GPU.
pub const GREEDY: Want = Want::Top { k: 1, lse: false };

/// Checks the `k` of a [`Want::Top`].
pub(crate) fn check_want(w: Want) -> Result<()> {
    let max = MAX_TOP_K;
    match w {
        Want::Top { k, .. } if k == 0 || k > max => Err(Error::Invalid(format!(
            "top-{k} logits requested: supported 1..={max}"
        ))),
        _ => Ok(()),
    }
}
