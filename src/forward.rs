//! The contract between a forward and its callers, below every layer that implements or
//! calls it: how to load a model ([`LoadOptions`] and the choices it carries), which logits a
//! forward returns ([`Want`], [`Logits`], [`TopLogits`]). `engine` re-exports it as the
//! library's API; the kernels (`gpu::topk`), the planner (`moe`) and the model families
//! use it without importing the engine.

use crate::{Error, Result};
use std::sync::Arc;

/// Which adapter to use. `Default` picks the first discrete GPU, then any GPU, then a CPU
/// adapter (lavapipe), so `lathe run` works unchanged on a laptop, a server and in CI.
#[derive(Clone, Debug, Default)]
pub enum AdapterChoice {
    #[default]
    Auto,
    /// Index into [`crate::gpu::list_adapters`].
    Index(usize),
    /// Case-insensitive substring of the adapter name.
    Name(String),
}

impl std::str::FromStr for AdapterChoice {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Ok(match s.parse::<usize>() {
            Ok(i) => AdapterChoice::Index(i),
            Err(_) if s.eq_ignore_ascii_case("auto") => AdapterChoice::Auto,
            Err(_) => AdapterChoice::Name(s.to_string()),
        })
    }
}

/// Which kernels run products of many tokens (`--matmul`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulChoice {
    /// The matrix units where the adapter has them, else the two-level int8 path (`Int8x2`);
    /// models that route on values (MoE routers, DeepSeek-V4's indexer) take the tiled f32
    /// kernel (`gpu::AutoProducts::F32`).
    #[default]
    Auto,
    /// Cooperative matrices (f16 16x16x16, f32 accumulation); an error where absent.
    Coop,
    /// Cooperative matrices with weights and activations each split into two f16 parts
    /// (f32-level products at three times the multiply-adds); an error where absent.
    CoopSplit,
    /// Cooperative matrices with f16 weights and activations split into two f16 parts (the
    /// weights' rounding alone, at twice the multiply-adds); an error where absent.
    CoopSplitX,
    /// The portable tiled f32 kernel.
    Tiled,
    /// The tiled kernel with activations quantized to int8 per block of 32 (ggml's q8_1) for
    /// weights with integer codes (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K); others run tiled. llama.cpp's
    /// numerics: the fixture bars do not all hold.
    Int8,
    /// As `Int8` with the residual of x quantized again (two int8 levels): f32-level products.
    Int8x2,
}

impl MatmulChoice {
    /// The `--matmul` spelling.
    pub fn name(self) -> &'static str {
        match self {
            MatmulChoice::Auto => "auto",
            MatmulChoice::Coop => "coop",
            MatmulChoice::CoopSplit => "coop-split",
            MatmulChoice::CoopSplitX => "coop-splitx",
            MatmulChoice::Tiled => "tiled",
            MatmulChoice::Int8 => "int8",
            MatmulChoice::Int8x2 => "int8x2",
        }
    }
}

impl std::str::FromStr for MatmulChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(MatmulChoice::Auto),
            "coop" => Ok(MatmulChoice::Coop),
            "coop-split" => Ok(MatmulChoice::CoopSplit),
            "coop-splitx" => Ok(MatmulChoice::CoopSplitX),
            "tiled" | "f32" => Ok(MatmulChoice::Tiled),
            "int8" => Ok(MatmulChoice::Int8),
            "int8x2" => Ok(MatmulChoice::Int8x2),
            _ => Err(format!(
                "--matmul {s}: expected auto, coop, coop-split, coop-splitx, tiled, int8 or int8x2"
            )),
        }
    }
}

/// Which activations the decode products take (`--activations`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActivationsChoice {
    /// f32 (as [`ActivationsChoice::F32`]). The two-level int8 path meets every fixture bar
    /// (tests/activations.rs; lavapipe, RMS against the reference: qwen35-dims Q4_K_M 3.5e-4
    /// with int8 against 1.9e-4 with f32, qwen35moe-dims Q4_K_M 4.7e-4, DeepSeek-V4 dims
    /// Q4_K_M 1.6e-4, every top-1 ≥ 0.997, against the 0.02 bar), but on the H200 it decodes
    /// slower: Qwen3.5-9B Q4_K_M 147.3 against 169.1 tok/s (GPU 7.6 against 6.3 ms per
    /// token: a quantize pass per product, and each weight word dotted with two levels of
    /// codes), so auto keeps f32 until an adapter where int8 wins is measured.
    #[default]
    Auto,
    /// f32 activations everywhere (exactness checks).
    F32,
    /// One-token products (decode matvec, the MoE indexed matvec) of the weight types with an
    /// integer-dot kernel (`gpu::matvec::int8_x_supported`) quantize x to blocks of 32 in two
    /// int8 levels (ggml's `block_q8_1` numerics, then its residual the same way: within
    /// max|x|/64516 of x; one level alone missed every quantized fixture bar). The cold
    /// experts of an offloaded MoE take the same two levels (`cpu::q8dot`). Float weights stay
    /// f32, as do products that feed a discrete choice (`MatvecOpts::exact`), prefill's
    /// many-token products (batched decode rows take int8 as a lone decode does, so their bits
    /// match) and products reading x through a fused prologue (`LoadOptions::fused_loads`).
    Int8,
}

impl ActivationsChoice {
    /// Whether one-token products take int8 activations (those reading x through a fused
    /// prologue stay f32 either way, see [`ActivationsChoice::Int8`]).
    pub fn int8(self) -> bool {
        match self {
            ActivationsChoice::F32 | ActivationsChoice::Auto => false,
            ActivationsChoice::Int8 => true,
        }
    }
}

impl std::str::FromStr for ActivationsChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(ActivationsChoice::Auto),
            "f32" => Ok(ActivationsChoice::F32),
            "int8" => Ok(ActivationsChoice::Int8),
            _ => Err(format!("--activations {s}: expected auto, f32 or int8")),
        }
    }
}

/// An instruction set for the cold-expert kernels, from plain Rust to the widest integer dot
/// (`--cpu-simd`; detection and the checks in `cpu::simd`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SimdLevel {
    /// Plain Rust (what LLVM makes of it for the build's baseline): every CPU.
    Scalar,
    /// x86_64 AVX2 + FMA + F16C (Haswell, Zen 1 and later).
    Avx2,
    /// x86_64 AVX-512 VNNI on 256-bit vectors (`vpdpbusd`, with AVX-512VL and BW) on top of
    /// AVX2: Ice Lake, Sapphire Rapids, Zen 4 and later. The f32-activation kernels stay AVX2.
    Avx512Vnni,
}

impl SimdLevel {
    pub const ALL: [SimdLevel; 3] = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512Vnni];

    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512Vnni => "avx512vnni",
        }
    }
}

impl std::fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for SimdLevel {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        SimdLevel::ALL
            .into_iter()
            .find(|l| l.name() == s.to_ascii_lowercase())
            .ok_or_else(|| format!("--cpu-simd {s}: expected scalar, avx2 or avx512vnni"))
    }
}

/// Knobs of the policy.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheConfig {
    /// Share of each layer's initial slots it keeps whatever other layers ask (0..=1).
    pub floor_share: f64,
    /// A cold expert is uploaded only if picked within this many earlier steps; `None`
    /// uploads on every miss (the plain LRU behaviour).
    pub reuse_window: Option<u64>,
    pub max_uploads_per_step: usize,
    /// Admission test (TinyLFU-like): an upload that evicts happens only when the
    /// candidate's pick count, decayed with this half-life in steps, exceeds the victim's.
    /// `None`: no test.
    pub half_life: Option<f64>,
}

impl Default for CacheConfig {
    /// Half of each layer's placement as a floor; re-picks within 8 tokens; 4 uploads per
    /// token (a Qwen3.5-35B Q4_K expert is ~1.7 MB: 4 take ~0.3 ms over PCIe 4, small next
    /// to a decode step); pick counts with a 32-token half-life. Chosen on the synthetic
    /// sweeps of `tests/moe.rs` (a 32-token reuse window or no admission test churned the
    /// bounded uploads every step and lost to the plain LRU).
    fn default() -> Self {
        CacheConfig {
            floor_share: 0.5,
            reuse_window: Some(8),
            max_uploads_per_step: 4,
            half_life: Some(32.0),
        }
    }
}

impl CacheConfig {
    /// A plain global LRU over (layer, expert): no floor, upload on every miss, no bound.
    /// The baseline the policy is measured against.
    pub fn global_lru() -> Self {
        CacheConfig {
            floor_share: 0.0,
            reuse_window: None,
            max_uploads_per_step: usize::MAX,
            half_life: None,
        }
    }
}

/// Element type of the attention KV cache. `Auto` is the architecture's default: f16 for
/// Qwen3.5 (its fixtures meet the bar with it, at half the bytes), f32 for DeepSeek-V4, whose
/// one shared K=V head is small but whose indexer top-k flips on f16-rounded keys (measured:
/// dsv4-dims RMS 0.02-0.033 against the reference with f16, 4e-6 with f32).
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
    /// `lathe serve` with several sequences at once takes it off by default: its batches
    /// pay the norm's pass over each token's row in every product workgroup.
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
}

/// One device's share of a model split over several (`models::chain`): a contiguous range
/// of layers; the first part also embeds the tokens, the last one holds the output head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartSpec {
    pub layers: std::ops::Range<usize>,
    pub first: bool,
    pub last: bool,
}

/// Which part of a model a weight belongs to, for [`PartSpec::holds`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightRole {
    /// A block's weight.
    Layer(usize),
    /// The token embedding (also the head of a model that ties them).
    Embedding { tied: bool },
    /// Everything after the blocks: output norm, head, extra blocks past `n_layer`.
    Head,
}

impl PartSpec {
    /// The whole model of `n_layer` blocks.
    pub fn whole(n_layer: usize) -> PartSpec {
        PartSpec {
            layers: 0..n_layer,
            first: true,
            last: true,
        }
    }

    /// Whether this part uploads a weight of `role`.
    pub fn holds(&self, role: WeightRole) -> bool {
        match role {
            WeightRole::Layer(l) => self.layers.contains(&l),
            WeightRole::Embedding { tied } => self.first || (self.last && tied),
            WeightRole::Head => self.last,
        }
    }

    /// The role of the tensor `name` of a model of `n_layer` blocks whose embedding is
    /// `embedding`: blocks by the layer number of the naming schemes lathe reads (GGUF
    /// `blk.N.`, Hugging Face `model.layers.N.` / `model.language_model.layers.N.`,
    /// DeepSeek `layers.N.`); numbers past the blocks (llama.cpp's next-token-prediction
    /// blocks) and other prefixes (`mtp.`) belong with the head.
    pub fn role(name: &str, n_layer: usize, embedding: &str, tied: bool) -> WeightRole {
        if name == embedding {
            return WeightRole::Embedding { tied };
        }
        let rest = [
            "blk.",
            "model.language_model.layers.",
            "model.layers.",
            "layers.",
        ]
        .iter()
        .find_map(|p| name.strip_prefix(p));
        match rest.and_then(|r| r.split('.').next()?.parse::<usize>().ok()) {
            Some(l) if l < n_layer => WeightRole::Layer(l),
            _ => WeightRole::Head,
        }
    }
}

/// How the planner keeps experts off the GPU (`--cold-layers`). Each MoE layer with cold
/// experts costs a GPU → CPU → GPU hop per decode step; whole cold layers (as llama.cpp's
/// `-ncmoe`) take fewer hops, a share of every layer lets the CPU's work overlap the GPU's
/// hot experts and the hottest experts of each layer stay on the GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ColdLayers {
    /// Whichever the planner's decode estimate (`moe::Placement::decode_seconds`) finds
    /// faster, for a budget (`--gpu-mem`); `spread` under `--gpu-experts`, whose share is
    /// per layer.
    #[default]
    Auto,
    /// Every layer keeps its share of slots.
    Spread,
    /// Whole layers hot from the last one down while the budget lasts (under
    /// `--gpu-experts F`: F of all expert bytes); at most one layer mixed.
    Whole,
}

impl std::str::FromStr for ColdLayers {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(ColdLayers::Auto),
            "spread" => Ok(ColdLayers::Spread),
            "whole" => Ok(ColdLayers::Whole),
            _ => Err(Error::Invalid(format!(
                "--cold-layers {s}: expected auto, spread or whole"
            ))),
        }
    }
}

/// Where a prefill batch's cold experts run (`--expert-stream`). Streaming copies the
/// experts the batch picks into a few GPU slots and runs them with the GPU's kernels; the
/// CPU path reads them from the mmap where they are. Decode steps (one row) always take
/// the CPU path: a token uses each expert once, which never repays a copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertStream {
    /// Stream when the batch is large enough that the copies cost less than the CPU's work
    /// (`moe::plan::stream_beats_cpu`).
    #[default]
    Auto,
    /// Every batch of more than one row streams (tests, measurements).
    Always,
    /// Never stream: cold experts run on the CPU.
    Never,
}

impl std::str::FromStr for ExpertStream {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(ExpertStream::Auto),
            "always" => Ok(ExpertStream::Always),
            "never" => Ok(ExpertStream::Never),
            _ => Err(Error::Invalid(format!(
                "--expert-stream {s}: expected auto, always or never"
            ))),
        }
    }
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
            .finish()
    }
}

impl LoadOptions {
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
            fused_loads: true,
            devices: Vec::new(),
            split: None,
            part: None,
            micro_batches: 1,
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

/// Largest k of `gpu::topk::LogitsTop`: covers llama.cpp's default sampler top-k of 40 and the
/// OpenAI API's 20 `top_logprobs`.
pub const MAX_TOP_K: u32 = 64;

/// The best logits of one row as the GPU found them ([`crate::gpu::topk::LogitsTop`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TopLogits {
    /// (id, logit), best first: larger logit, then lower id; NaNs never. Shorter than asked
    /// when the row has fewer selectable logits.
    pub cands: Vec<(u32, f32)>,
    /// ln Σ exp(logit) over the whole row (NaNs skipped), when asked for.
    pub lse: Option<f32>,
}
