//! The Qwen3.5-family forward on the GPU. One pass (one submission) per chunk of tokens:
//! prefill chunks use the tiled matmul, the chunked GDN scan and flash attention; a decode
//! step (one token) uses matvec, the recurrent GDN step and split-K attention. Nothing is
//! read back inside the layer loop; only the requested logits come back.
//!
//! Every dispatch has a fixed cost at decode (a barrier drains the GPU between dependent
//! ones), so products over one input run as one per stored type ([`ProjSet`]: GDN
//! qkv|z|beta|alpha, attention q|k|v, FFN gate|up, MoE router|shared expert) and the MoE
//! combine sums all slots in one dispatch: a Qwen3.5-9B Q4_K_M step took 405 dispatches
//! instead of 509. A decode step (products as matvec) fuses further: the layer norms, SwiGLU,
//! the attention output gate and the GDN conv step ride in the products' loads and stores
//! (`matvec::Prologue`, `matvec::ConvStep`), the GDN step carries its gated norm
//! (`gdn::recurrent_normed`), and q/k norms, RoPE and the KV writes are one dispatch
//! (`rope::qk_norm_rope`): 5.75 dispatches per layer on the 9B (12.5 unfused).

mod forward;
mod load;
mod spec;
mod state;

pub use spec::{SpecState, MAX_VERIFY};
pub use state::{needs, needs_part};

use super::weights::{self, Ffn, Mixer, SetOut, Sink, Weights};
use super::{HeadMap, Hparams};
use crate::forward::{KvType, LoadOptions, Logits, Want};
use crate::gpu::attention::{self, Attention, Keys, KvShape, KvSource, OutView, QView};
use crate::gpu::conv::{self, ConvIo};
use crate::gpu::elementwise as ew;
use crate::gpu::gdn::{self, GdnIo, GdnShape, KeyHeadMap, SeqBatch, SeqSpan};
use crate::gpu::matmul::{self, MoeRoute};
use crate::gpu::matvec::{self, MatvecOpts, Prologue};
use crate::gpu::moe::{routed_ffn, ExpertStacks, FfnBufs, Picks};
use crate::gpu::norm;
use crate::gpu::operand::Operand;
use crate::gpu::rope::{self, Positions, RopeStyle, RopeTable, RopeView};
use crate::gpu::topk::TopLogits;
use crate::gpu::{embed, fit_rows, topk, BufferLimits, Gpu, GpuTensor, Pass, PassBuffer};
use crate::model_file::PartSpec;
use crate::models::runtime::family::FamilyModel;
use crate::models::runtime::head::{head_logits, Head};
use crate::models::runtime::link::{Link, Readback};
use crate::models::runtime::rounds::{self, Part, RoundOut, RoundSeq, TopReq};
use crate::models::runtime::state::copy_regions;
use crate::models::runtime::trace::Tracer;
use crate::models::{ModelFile, Seq, SeqState, Weight};
use crate::moe::{Needs, Offload, Plan, RunShape};
use crate::tensor::TensorRef;
use crate::{DType, Error, Result};
use std::sync::{Arc, Mutex};

/// Tokens per prefill pass: activations are sized for this many rows. 512 as llama.cpp's
/// micro-batch: the matrix kernels fill an H200 only from ~512 tokens (4096x12288 Q4_K on the
/// cooperative-matrix path: 49 TFLOP/s at 256 tokens, 71 at 512).
pub const DEFAULT_BATCH: usize = 512;

/// Activation buffers, sized once for `rows` tokens per pass (f32 unless said).
struct Scratch {
    rows: usize,
    /// [rows] u32 token ids, positions, KV cache destination rows; [rows, 2] u32 visible
    /// key ranges of decode rows.
    ids: wgpu::Buffer,
    pos: wgpu::Buffer,
    kv_rows: wgpu::Buffer,
    ranges: wgpu::Buffer,
    /// [rows, n_embd]: the residual stream, and its normed copy.
    x: wgpu::Buffer,
    h: wgpu::Buffer,
    /// [rows, width of the widest ProjSet]: a product set's outputs, one row per token
    /// (`ProjSet::off` gives each member's columns).
    proj: wgpu::Buffer,
    /// [rows, conv_dim]: fused q|k|v after the conv.
    qkv: wgpu::Buffer,
    /// [rows, Hv·dv] each: z packed from `proj` (passes of several rows), the GDN output.
    z: wgpu::Buffer,
    o: wgpu::Buffer,
    /// [rows, n_head·2·head_dim]: q and gate interleaved per head (packed from `proj`).
    qg: wgpu::Buffer,
    /// [rows, n_head_kv·head_dim]: k packed from `proj` (v is read from `proj`).
    k: wgpu::Buffer,
    /// [rows, n_head·head_dim]: attention output, and after the gate.
    att: wgpu::Buffer,
    att_g: wgpu::Buffer,
    /// [rows·n_used, routed expert width]: the experts' gate / up.
    f_gate: wgpu::Buffer,
    f_up: wgpu::Buffer,
    /// [rows·n_used, n_embd]: routed expert outputs; [rows, n_used] ids (u32) and weights;
    /// [rows, n_embd] the shared expert's output kept across the cold path's passes
    /// (offload only). Router logits and the shared-expert gate are columns of `proj`.
    moe_out: wgpu::Buffer,
    moe_ids: wgpu::Buffer,
    moe_w: wgpu::Buffer,
    sh_out: wgpu::Buffer,
    route: Option<MoeRoute>,
    /// GDN chunk scratch and the one-sequence batch table.
    gdn_scratch: wgpu::Buffer,
    batch: SeqBatch,
    /// Split-K attention partials for decode.
    attn_split: wgpu::Buffer,
    /// [logit_rows, n_vocab]
    logits: wgpu::Buffer,
    logit_rows: usize,
    /// Top-k (+ log-sum-exp) of up to `rows` logits rows, for [`Want::Top`] items.
    top: topk::LogitsTop,
}

/// State pools shared by all sequences, one per layer kind; sequence slot `s` owns KV rows
/// `s·cap ..` and conv / recurrent slot `s`. One pool per layer lets a batched pass serve
/// many sequences with one dispatch per kernel.
struct Pools {
    slots: usize,
    /// KV rows per slot; grows by doubling (copied on the GPU).
    cap: usize,
    /// Per layer: (K, V) [slots·cap, n_head_kv, head_dim] (f16 or f32).
    kv: Vec<Option<(wgpu::Buffer, wgpu::Buffer)>>,
    /// Per layer: conv state [slots, K-1, conv_dim] and GDN state [slots, Hv, dk, dv].
    conv: Vec<Option<wgpu::Buffer>>,
    ssm: Vec<Option<wgpu::Buffer>>,
    free: Arc<Mutex<Vec<u32>>>,
}

/// One sequence: a slot in the model's state pools and the number of tokens it has seen.
/// Dropping it returns the slot.
pub struct GpuSeq {
    slot: u32,
    pos: usize,
    free: Arc<Mutex<Vec<u32>>>,
}

impl GpuSeq {
    /// Tokens consumed so far.
    pub fn pos(&self) -> usize {
        self.pos
    }
}

impl Drop for GpuSeq {
    fn drop(&mut self) {
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.slot);
    }
}

pub struct GpuModel {
    pub gpu: Arc<Gpu>,
    pub hp: Hparams,
    w: Weights<GpuTensor, ProjSet>,
    /// [n_vocab]: `runtime::head::suppress_mask`.
    suppress: Option<wgpu::Buffer>,
    rope: RopeTable,
    kv_type: attention::KvType,
    pools: Pools,
    scratch: Scratch,
    /// Debugging: capture a named intermediate in every pass (`layer_out`: the residual
    /// stream after a layer, `[n_tokens, n_embd]`).
    pub trace: Tracer,
    /// [`Forward::hidden_out`]: the wanted rows' final-norm hidden states come back instead
    /// of their logits.
    hidden_out: bool,
    /// Profiling: when `Some`, passes are timed per dispatch (GPU timestamps) and the last
    /// round's `(kernel label, ns)` list is stored here.
    pub profile: Option<Vec<(String, f64)>>,
    /// The expert arena and cold path when not every routed expert has a slot (or routing
    /// is counted); `None`: the per-layer expert stacks of `w`.
    pub offload: Option<Offload>,
    /// The MTP block, verify mode and rollback state of speculative decoding.
    pub spec: SpecState,
    /// `LoadOptions::fused_loads`.
    fused_loads: bool,
    /// The layers this device holds (all of them unless the model is split over several:
    /// `models::chain`), its neighbours, and where a part that is not the last reads its
    /// residual stream back.
    part: PartSpec,
    link: Link,
    handoff: Option<Readback>,
}

impl GpuModel {
    /// Trunk layers with routed experts (the MTP block's are not counted).
    pub fn n_moe_layers(&self) -> usize {
        self.w
            .layers
            .iter()
            .take(self.hp.n_layer)
            .filter(|l| matches!(l.ffn, Ffn::Moe(_)))
            .count()
    }
}

/// Products of one layer that read the same input, run as few matvecs as their stored types
/// allow: members of equal type and width are concatenated by rows at load
/// ([`Gpu::upload_concat`]), one product per group. Per token the outputs form one row of
/// `width` values in `Scratch::proj`, member `i` at columns `off[i]..` (a group's members
/// adjacent, in set order). A product's rows are independent, so each member's values are
/// what its own product would give.
pub struct ProjSet {
    /// Each group's concatenated weight and its first column.
    groups: Vec<(GpuTensor, u32)>,
    /// Per member (in the set's order, `weights::Layer`): its first column.
    off: Vec<u32>,
    width: u32,
}

/// The GPU loader: weights go from the mmap to the GPU as they are stored; product sets as
/// [`ProjSet`]s (their members' own tensors are then empty stand-ins carrying name, type and
/// shape); routed experts of an offloaded model are left to the expert arena.
struct GpuSink<'a> {
    gpu: &'a Gpu,
    /// The names of the experts the arena holds, when it holds them.
    experts_elsewhere: Option<&'static crate::moe::ExpertNames>,
    /// Whether this device uploads the named weight (its part's layers, embedding, head).
    held: &'a dyn Fn(&str) -> bool,
    opts: &'a LoadOptions,
    done: u64,
    total: u64,
}

/// Elements (4 bytes each: f32 values or u32 ids) of the plain scratch buffers for passes of
/// `rows` rows: the one list that [`Scratch::new`] allocates and [`Scratch::bytes`] counts.
struct Dims {
    ids: usize,
    pos: usize,
    kv_rows: usize,
    ranges: usize,
    x: usize,
    h: usize,
    proj: usize,
    qkv: usize,
    z: usize,
    o: usize,
    qg: usize,
    k: usize,
    att: usize,
    att_g: usize,
    f_gate: usize,
    f_up: usize,
    moe_out: usize,
    moe_ids: usize,
    moe_w: usize,
    sh_out: usize,
    logits: usize,
}

impl SeqState for GpuSeq {
    fn pos(&self) -> usize {
        self.pos
    }
}

impl RoundSeq for GpuSeq {
    fn slot(&self) -> u32 {
        self.slot
    }
    fn set_pos(&mut self, pos: usize) {
        self.pos = pos;
    }
}

impl FamilyModel for GpuModel {
    type Seq = GpuSeq;
    fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
    fn n_vocab(&self) -> usize {
        self.hp.n_vocab
    }
    fn new_seq(&self) -> Result<GpuSeq> {
        GpuModel::new_seq(self)
    }
    fn reset(&self, seq: &mut GpuSeq) -> Result<()> {
        GpuModel::reset(self, seq)
    }
    fn copy_seq(&self, src: &GpuSeq, dst: &mut GpuSeq) -> Result<()> {
        GpuModel::copy_seq(self, src, dst)
    }
    fn hidden_out(&mut self, on: bool) -> Result<()> {
        self.hidden_out = on;
        Ok(())
    }
    fn forward_batch(&mut self, items: &mut [(&mut GpuSeq, &[u32], Want)]) -> Result<Vec<Logits>> {
        GpuModel::forward_batch(self, items)
    }
    fn profile_sink(&mut self) -> Result<&mut Option<Vec<(String, f64)>>> {
        Ok(&mut self.profile)
    }
    fn offload(&self) -> Option<&Offload> {
        self.offload.as_ref()
    }
    fn routed_experts(&self) -> usize {
        self.hp
            .moe
            .as_ref()
            .map_or(0, |p| self.n_moe_layers() * p.n_expert)
    }
    fn max_context(&self) -> Option<usize> {
        Some(self.max_positions())
    }
    fn pass_rows(&self) -> usize {
        self.scratch.rows
    }
    fn speculate(&mut self) -> Option<&mut dyn crate::models::spec::Speculate> {
        Some(self)
    }
    fn set_link(&mut self, link: Link) {
        self.link = link;
    }
}
