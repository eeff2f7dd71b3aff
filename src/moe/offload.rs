//! The offload at run time: [`Plan`] places a model's experts at load (before any upload),
//! [`Offload`] runs the recipe of `moe/mod.rs` in the forwards over the GPU's arena and remap
//! kernels (`gpu::moe`) and the CPU's cold path (`cpu::moe`). The arena and tables are filled
//! from a [`Placement`] here, so the kernel layer knows slots, not plans.

use super::timeline::{LayerTimes, Recording};
use super::{
    budget_for, cold_pairs, AdapterMemory, Budget, Costs, ExpertNames, ExpertStats, ExpertWeights,
    Fill, MemSource, MoeInfo, Needs, Placement, ResidencyCache, COLD,
};
use super::{ColdLayers, ExpertStream};
use crate::cpu::moe::{Activations, ColdOptions, ColdPair};
use crate::forward::LoadOptions;
use crate::gpu::limits::BufferUse;
use crate::gpu::matmul::MoeRoute;
use crate::gpu::moe::{
    remap, routed_ffn_glu, scatter_rows, ExpertArena, ExpertStacks, FfnBufs, Glu, Picks,
    RemapTables,
};
use crate::gpu::operand::Operand;
use crate::gpu::{check_len, fit_rows, BufferLimits, Gpu, Pass, PassBuffer};
use crate::model_file::ModelFile;
use crate::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// GPU slots per arena group that a prefill batch's cold experts stream through, a round of
/// at most this many experts per submission. 16 Qwen3.5-35B Q4_K experts are 28 MB (one
/// staging buffer); a 512-row batch picks ~128 of a layer's cold experts at half the experts
/// on the GPU: 8 rounds, each filled while the GPU copies and runs the previous one.
pub const STREAM_SLOTS: usize = 16;

/// Longest pass of a model whose prompts may stream cold experts (`--expert-stream` other
/// than `never`, some experts cold): a streamed expert crosses the host link once per pass
/// that selects it, so a prompt of `p` tokens moves each selected cold expert `p / rows`
/// times. A few thousand rows, as the target; longer passes would also make other
/// sequences' decode steps wait behind one pass. Fewer where the scratch does not fit
/// ([`stream_rows`]).
pub const STREAM_ROWS: usize = 4096;

/// Under a byte budget, the longest pass may take at most this share (1/N) of the bytes left
/// for expert slots: every byte of scratch is a byte of slots decode no longer has.
const STREAM_ROWS_SHARE: u64 = 4;

/// Host → GPU copy speed `auto` streaming assumes (bytes/s): PCIe 4.0 x16 moves ~25 GB/s
/// in practice, less through wgpu's staging copy.
pub const LINK_BYTES_PER_S: f64 = 20e9;

/// Weights per second and core of the CPU's quantised dot products (`quant::dot`, Q4_K:
/// 0.3-0.5 ns per weight per core, as [`super::plan::stream_beats_cpu`] notes).
pub const CPU_PARAMS_PER_CORE_S: f64 = 2.5e9;

/// Longest the CPU's workers spin through a wait for `pre` ([`crate::cpu::moe::Warm`]):
/// a decode layer's `pre` takes ~0.2 ms on the H200; a long prompt's pass sleeps after this.
const WARM_MOST: std::time::Duration = std::time::Duration::from_millis(2);

/// The arena of `placement`: every group's slots, zeroed ([`fill_arena`] uploads the hot
/// experts).
pub fn new_arena(gpu: &Gpu, placement: &Placement) -> Result<ExpertArena> {
    let groups: Vec<_> = placement
        .groups
        .iter()
        .map(|g| (g.n_slots, g.shapes))
        .collect();
    ExpertArena::new(gpu, &groups)
}

/// The remap tables of `placement` on the GPU.
pub fn remap_tables(gpu: &Gpu, placement: &Placement) -> Result<RemapTables> {
    let tables: Vec<_> = placement
        .layers
        .iter()
        .map(|lp| (lp.layer, &lp.remap[..]))
        .collect();
    RemapTables::new(gpu, &tables)
}

/// Copy expert `expert` of `w` (its three matrices in the stored type: bytes from the mmap,
/// or repacked from a release's block-scaled tensors) into slot `slot` of group `g`.
pub fn write_expert(
    arena: &ExpertArena,
    gpu: &Gpu,
    g: usize,
    slot: u32,
    w: &ExpertWeights<'_>,
    expert: u32,
) -> Result<()> {
    if expert as usize >= w.n_expert() {
        return Err(Error::Invalid(format!(
            "moe arena: expert {expert} of {} (layer {})",
            w.n_expert(),
            w.layer
        )));
    }
    let e = expert as usize;
    let (gate, up, down) = (w.gate.expert(e)?, w.up.expert(e)?, w.down.expert(e)?);
    let mats = [
        (w.gate.shape, &gate[..]),
        (w.up.shape, &up[..]),
        (w.down.shape, &down[..]),
    ];
    let what = format!("layer {} expert {expert}", w.layer);
    arena.write_expert(gpu, g, slot, &mats, &what)
}

/// Upload every hot expert of `placement` (`weights` in `placement.layers` order), calling
/// `report(bytes written, bytes to write)` after each expert (for a load progress bar).
pub fn fill_arena(
    arena: &ExpertArena,
    gpu: &Gpu,
    placement: &Placement,
    weights: &[ExpertWeights<'_>],
    report: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    if weights.len() != placement.layers.len() {
        return Err(Error::Invalid(format!(
            "moe arena: {} layers of weights for {} MoE layers",
            weights.len(),
            placement.layers.len()
        )));
    }
    // `queue.write_buffer` stages its bytes until the next submission: flush every
    // FLUSH bytes so a large arena never sits in host staging memory at once.
    const FLUSH: u64 = 1 << 30;
    let mut staged = 0u64;
    let all: u64 = placement
        .layers
        .iter()
        .map(|lp| placement.groups[lp.group].slot_bytes() * lp.hot().count() as u64)
        .sum();
    let mut written = 0u64;
    for (lp, w) in placement.layers.iter().zip(weights) {
        let eb = placement.groups[lp.group].slot_bytes();
        for (e, s) in lp.hot() {
            write_expert(arena, gpu, lp.group, s, w, e)?;
            written += eb;
            report(written, all);
            staged += eb;
            if staged >= FLUSH {
                gpu.queue.submit(std::iter::empty());
                gpu.wait()?;
                staged = 0;
            }
        }
    }
    Ok(())
}

/// Where the experts go, decided at load before any weight is uploaded.
pub struct Plan {
    pub info: MoeInfo,
    pub placement: Placement,
    pub stats: Option<ExpertStats>,
    pub budget: Option<Budget>,
    pub memory: Option<AdapterMemory>,
    /// Rows of one pass: the family's batch, or up to [`STREAM_ROWS`] when a prompt's cold
    /// experts may stream ([`stream_rows`]); the loader sizes its scratch for this.
    pub rows: usize,
}

impl Plan {
    /// The placement of `file`'s experts under `opts` (`--gpu-experts`, else the budget of
    /// `--gpu-mem` or the detected adapter memory; `--expert-stats` chooses which experts).
    /// `None` for a model without routed experts, and when every expert has a slot and no
    /// statistics are collected: the forward then keeps its per-layer expert stacks and one
    /// pass per token, exactly as without a planner.
    /// `needs`: what the model's family needs beside its weights for the run of `opts`
    /// (KV, state, activations; its `needs` function).
    /// `names`: where the family's files keep their experts.
    pub fn new(
        gpu: &Gpu,
        file: &ModelFile,
        names: &'static ExpertNames,
        opts: &LoadOptions,
        needs: &dyn Fn(usize) -> Needs,
        batch: usize,
    ) -> Result<Option<Plan>> {
        let mut info = MoeInfo::from_file(file, names)?;
        if info.layers.is_empty() {
            return Ok(None);
        }
        let stats = match &opts.expert_stats {
            Some(p) => {
                let s = ExpertStats::load(p)?;
                s.check(&info, p)?;
                Some(s)
            }
            None => None,
        };
        // One device's part of a split model places the experts of its own layers.
        if let Some(part) = &opts.part {
            info.restrict(file, part);
            if info.layers.is_empty() {
                return Ok(None);
            }
        }
        let mem = AdapterMemory::detect(&gpu.info, gpu.memory.as_ref(), opts.gpu_mem_of(0));
        let ctx = opts.ctx as u64;
        let base = budget_for(&info, mem.bytes, ctx, &needs(batch));
        let (fill, mut budget, memory) = match opts.gpu_experts {
            Some(f) => (Fill::Fraction(f), None, None),
            None => {
                if !base.fits() {
                    eprintln!(
                        "warning: {} needs {} beside its routed experts, {} more than the GPU \
                         memory planned for ({}): every expert runs on the CPU and the rest \
                         may not fit (--gpu-mem SIZE)",
                        file.path().display(),
                        crate::inspect::human_bytes(base.beside_experts()),
                        crate::inspect::human_bytes(base.shortfall),
                        mem.describe()
                    );
                }
                (
                    Fill::Budget(base.experts),
                    Some(base.clone()),
                    Some(mem.clone()),
                )
            }
        };
        let place = |fill| {
            place_streaming(
                &info,
                fill,
                stats.as_ref(),
                opts.cold_layers,
                opts.expert_stream,
            )
        };
        let mut placement = place(fill)?;
        // Every buffer of a pass of `r` rows, the family's and the offload's: passes of the
        // family's batch where they fit, shorter where the device's limits are smaller.
        let limits = BufferLimits::of(&gpu.limits);
        let buffers = |r: usize, placement: &Placement| {
            let mut b = needs(r).buffers;
            b.extend(offload_buffers(&info, placement, r));
            b
        };
        let batch = fit_rows(batch, limits, &file.path(), |r| buffers(r, &placement))?;
        // A longer pass for prompts whose cold experts may stream (one device only: a split
        // model's parts hand rows on in passes of the family's batch).
        let mut rows = batch;
        let all_hot = placement.layers.iter().all(|l| l.n_slots() == l.n_expert);
        if opts.expert_stream != ExpertStream::Never && opts.part.is_none() && !all_hot {
            // Bytes a pass of `r` rows needs beyond one of `batch` rows: the family's
            // scratch and state (its budget shrinks by them) and the offload's own; `None`
            // where one of their buffers would outgrow the device's limits.
            let extra = |r: usize| {
                let fits = limits.over(&buffers(r, &placement)).is_none();
                let b = budget_for(&info, mem.bytes, ctx, &needs(r));
                fits.then(|| {
                    base.experts.saturating_sub(b.experts)
                        + offload_scratch(&info, &placement, r)
                            .saturating_sub(offload_scratch(&info, &placement, batch))
                })
            };
            // Under a budget, a share of the slots' bytes; under `--gpu-experts`, what the
            // budget leaves beside the share's arena and the streaming slots.
            let spare = match fill {
                Fill::Budget(b) => b / STREAM_ROWS_SHARE,
                Fill::Fraction(_) => base
                    .experts
                    .saturating_sub(placement.arena_bytes() + stream_bytes(&placement)),
            };
            rows = stream_rows(batch, spare, extra);
            if rows > batch {
                if let Fill::Budget(b) = fill {
                    let e = extra(rows).expect("stream_rows takes rows that fit");
                    let nb = budget_for(&info, mem.bytes, ctx, &needs(rows));
                    placement = place(Fill::Budget(b.saturating_sub(e)))?;
                    budget = Some(Budget {
                        experts: b.saturating_sub(e),
                        ..nb
                    });
                }
            }
        }
        let plan = Plan {
            info,
            placement,
            stats,
            budget,
            memory,
            rows,
        };
        if plan.all_hot() && !collects(opts) {
            return Ok(None);
        }
        // Fail before any upload when the experts cannot be read where they are stored
        // (missing tensors or scales, types that cannot be repacked).
        for m in &plan.info.layers {
            ExpertWeights::from_file(file, plan.info.names, m)?;
        }
        if !plan.all_hot() {
            let hot: usize = plan.placement.layers.iter().map(|l| l.n_slots()).sum();
            let all: usize = plan.placement.layers.iter().map(|l| l.n_expert).sum();
            let why = match &plan.memory {
                Some(m) if m.source == MemSource::Assumed => format!(
                    "; GPU memory {}: pass --gpu-mem SIZE if it has more",
                    m.describe()
                ),
                Some(m) => format!("; GPU memory {}", m.describe()),
                None => String::new(),
            };
            eprintln!(
                "experts: {hot} of {all} on the GPU ({}), the rest run on the CPU{why}",
                crate::inspect::human_bytes(plan.placement.arena_bytes())
            );
        }
        Ok(Some(plan))
    }

    pub fn all_hot(&self) -> bool {
        self.placement
            .layers
            .iter()
            .all(|l| l.n_slots() == l.n_expert)
    }
}

/// The placement of `fill` under `--cold-layers`: `auto` takes whichever of the spread and
/// whole-layer placements [`Placement::decode_seconds`] finds faster with the default
/// [`Costs`] for a byte budget, and spreads a `--gpu-experts` share (a share per layer).
pub fn place(
    info: &MoeInfo,
    fill: Fill,
    stats: Option<&ExpertStats>,
    mode: ColdLayers,
) -> Result<Placement> {
    match (mode, fill) {
        (ColdLayers::Spread, _) | (ColdLayers::Auto, Fill::Fraction(_)) => {
            Placement::new(info, fill, stats)
        }
        (ColdLayers::Whole, _) => Placement::whole_layers(info, fill, stats),
        (ColdLayers::Auto, Fill::Budget(_)) => {
            let spread = Placement::new(info, fill, stats)?;
            let whole = Placement::whole_layers(info, fill, stats)?;
            let c = Costs::default();
            let t = |p: &Placement| p.decode_seconds(info, stats, &c);
            Ok(if t(&whole) < t(&spread) {
                whole
            } else {
                spread
            })
        }
    }
}

/// [`place`] as a load does it: under a byte budget, a placement that leaves experts on the
/// CPU gives up the streaming slots' bytes (`--expert-stream` other than `never`) and is
/// placed again without them. `lathe plan` uses this too, so it prints what a load places.
pub fn place_streaming(
    info: &MoeInfo,
    fill: Fill,
    stats: Option<&ExpertStats>,
    mode: ColdLayers,
    stream: ExpertStream,
) -> Result<Placement> {
    let placement = place(info, fill, stats, mode)?;
    let all_hot = placement.layers.iter().all(|l| l.n_slots() == l.n_expert);
    match fill {
        Fill::Budget(b) if stream != ExpertStream::Never && !all_hot => {
            let reserve = stream_bytes(&placement);
            place(info, Fill::Budget(b.saturating_sub(reserve)), stats, mode)
        }
        _ => Ok(placement),
    }
}

/// `batch` doubled while the pass's extra bytes (`extra(rows)`, beyond a pass of `batch`
/// rows; `None`: its buffers outgrow the device's limits) fit in `spare`, up to
/// [`STREAM_ROWS`]; `batch` when no longer pass fits.
pub fn stream_rows(batch: usize, spare: u64, extra: impl Fn(usize) -> Option<u64>) -> usize {
    let mut rows = batch;
    while rows * 2 <= STREAM_ROWS && extra(rows * 2).is_some_and(|e| e <= spare) {
        rows *= 2;
    }
    rows
}

/// GPU bytes of the [`Offload`]'s per-pass scratch for passes of `rows` rows: slot ids, the
/// CPU's rows and their index, the streaming ids, and the routes of the arena's and the
/// streaming slots' groups.
fn offload_scratch(info: &MoeInfo, placement: &Placement, rows: usize) -> u64 {
    offload_buffers(info, placement, rows)
        .iter()
        .filter(|b| b.usage == BufferUse::Bound)
        .map(|b| b.bytes)
        .sum()
}

/// The buffers [`Offload::new`] makes for passes of `rows` rows, by label (the streaming
/// slots' where any group has some).
fn offload_buffers(info: &MoeInfo, placement: &Placement, rows: usize) -> Vec<PassBuffer> {
    let pairs = (rows * info.n_used).max(1) as u64;
    let n_embd = info.layers.first().map_or(0, |l| l.n_embd());
    let mut v = vec![
        PassBuffer::bound("moe.slot_ids", pairs * 4),
        PassBuffer::bound("moe.cold_rows", pairs * n_embd * 4),
        PassBuffer::bound("moe.cold_index", pairs * 4),
        PassBuffer::bound("moe.stream_ids", pairs * 4),
        PassBuffer::copied("moe.readback", (pairs + rows as u64 * n_embd) * 4),
        PassBuffer::copied("moe.upload", pairs * (n_embd + 1) * 4),
    ];
    v.extend(
        (0..placement.groups.len())
            .flat_map(|g| [placement.groups[g].n_slots, stream_slots(placement, g)])
            .filter(|&n| n > 0)
            .map(|n| PassBuffer::bound("moe_route", MoeRoute::bytes(n, pairs as u32))),
    );
    v
}

/// Slots of each arena group for streamed experts: [`STREAM_SLOTS`], or fewer when the
/// group's layers have fewer experts.
fn stream_slots(placement: &Placement, g: usize) -> u32 {
    let most = placement
        .layers
        .iter()
        .filter(|l| l.group == g)
        .map(|l| l.n_expert)
        .max()
        .unwrap_or(0);
    most.min(STREAM_SLOTS) as u32
}

/// GPU bytes of the streaming slots of `placement` ([`stream_slots`] per group).
pub fn stream_bytes(placement: &Placement) -> u64 {
    (0..placement.groups.len())
        .map(|g| stream_slots(placement, g) as u64 * placement.groups[g].slot_bytes())
        .sum()
}

fn collects(opts: &LoadOptions) -> bool {
    opts.collect_expert_stats || opts.save_expert_stats.is_some()
}

/// Records what follows a MoE layer's routed rows in the model's pass ([`Offload::cold_ffn`]).
pub type After<'a> = &'a mut (dyn FnMut(&mut Pass<'_>) -> Result<()> + Send);

/// A MoE layer's cold work, from [`Offload::route`] to [`Offload::cold_ffn`]: the
/// submission whose end brings the readback, and the buffers the layer reads.
pub struct Cold {
    layer: usize,
    n: u32,
    /// The `pre` submission (`None` while profiling: it has finished already).
    pre: Option<wgpu::SubmissionIndex>,
    /// Router ids u32 `[n, n_used]` and FFN input rows f32 `[n, n_embd]` on the GPU.
    ids: wgpu::Buffer,
    x: wgpu::Buffer,
    /// Timeline: host time spent before `pre` was submitted, and its first query.
    host_ms: f64,
    query: Option<u32>,
}

/// GPU slots a prefill batch's cold experts stream through (`--expert-stream`): per arena
/// group [`stream_slots`] slots, a remap table per layer (the round's experts → slots, the
/// rest `COLD`), the slot ids and the matmul route of each group.
struct Streams {
    arena: ExpertArena,
    remaps: RemapTables,
    routes: Vec<Option<MoeRoute>>,
    /// u32 `[rows·n_used]`: router ids mapped to streaming slots.
    ids: wgpu::Buffer,
    /// Two MAP_WRITE staging buffers of one round's experts (gate slots, then up, then
    /// down), used in turn: the host fills one from the mapped file (rayon) while the GPU
    /// copies and runs the other; each with the submission that last read it.
    staging: [wgpu::Buffer; 2],
    last_use: Mutex<[Option<wgpu::SubmissionIndex>; 2]>,
    rounds: std::sync::atomic::AtomicUsize,
}

/// Host-side state of the offload: the residency policy, statistics, counters.
struct OffloadState {
    cache: ResidencyCache,
    stats: Option<ExpertStats>,
    traffic: Traffic,
    /// The CPU's rows f32 `[pairs, n_embd]` then their pair index u32 `[pairs]`, kept
    /// between layers (the mapped upload buffer is write-only: written from here in one
    /// copy).
    rows: Vec<u32>,
}

/// The offload's traffic counters, for its report.
#[derive(Clone, Copy, Debug, Default)]
struct Traffic {
    /// Routed (token, expert) pairs run on the CPU.
    cold_pairs: u64,
    /// Bytes of experts copied to the streaming slots, and the pairs they ran.
    streamed_bytes: u64,
    streamed_pairs: u64,
    /// Bytes copied into arena slots by the residency cache.
    uploaded_bytes: u64,
    /// Tokens run through offloaded layers (rows of the first MoE layer's calls).
    tokens: u64,
}

/// A snapshot of an offload's counts ([`Offload::counts`]): the routing statistics and the
/// traffic counters.
#[derive(Clone, Debug)]
pub struct Counts {
    stats: Option<ExpertStats>,
    traffic: Traffic,
}

/// Placement report for speed reports (`lathe bench`).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct PlacementReport {
    /// Experts with slots now / all routed experts.
    pub hot_experts: usize,
    pub total_experts: usize,
    /// `hot_experts / total_experts`.
    pub hot_share: f64,
    pub arena_bytes: u64,
    /// Hits of the residency cache over the routed pairs it saw (1 when none were cold).
    pub hit_rate: f64,
    pub uploads: u64,
    /// Routed pairs computed on the CPU.
    pub cold_pairs: u64,
    /// Bytes the residency cache copied into arena slots, per token run.
    pub uploaded_bytes_per_token: f64,
    /// Bytes of cold experts streamed to the GPU for prompt batches (`--expert-stream`).
    pub streamed_bytes: u64,
    /// Routed pairs run on streamed experts.
    pub streamed_pairs: u64,
    /// Budget line (`None` under `--gpu-experts`).
    pub memory: Option<String>,
}

/// A MoE model whose experts do not all have arena slots, or whose routing is counted: the
/// arena, remap tables, residency cache and cold path of the recipe in `moe/mod.rs`. The
/// model's forward calls, per MoE layer after the router: [`route`](Self::route), then
/// [`hot_ffn`](Self::hot_ffn), its shared expert, [`cold_ffn`](Self::cold_ffn), and its
/// fixed-order combine.
pub struct Offload {
    /// The model file mapped again: cold experts are read from its pages.
    file: ModelFile,
    pub info: MoeInfo,
    pub placement: Placement,
    arena: ExpertArena,
    remaps: RemapTables,
    /// Per arena group: the prefill route over its slots (`None` without slots).
    routes: Vec<Option<MoeRoute>>,
    /// u32 `[rows·n_used]`: router ids mapped to slots.
    slot_ids: wgpu::Buffer,
    /// f32 `[rows·n_used, n_embd]` and u32 `[rows·n_used]`: the CPU's rows and their pair.
    cold_rows: wgpu::Buffer,
    cold_index: wgpu::Buffer,
    /// MAP_READ, u32 `[rows·n_used]` then f32 `[rows, n_embd]`: each layer's readback, copied
    /// at the end of the layer's own pass (no buffer made or extra submission per layer).
    staging: wgpu::Buffer,
    /// MAP_WRITE, f32 `[rows·n_used, n_embd]` then u32 `[rows·n_used]`: the CPU writes its
    /// rows and their pair index here, mapped, and the next pass copies them to `cold_rows`
    /// and `cold_index` (no allocation or extra copy per layer).
    upload: wgpu::Buffer,
    /// `--expert-stream` and its slots (`None` under `never`, or with every expert hot).
    stream: ExpertStream,
    streams: Option<Streams>,
    /// How the cold pairs compute on the CPU (activations, `--cpu-simd`).
    cold: ColdOptions,
    n_used: u32,
    n_embd: u32,
    rows: u32,
    collect_stats: bool,
    /// `--save-expert-stats`: written by `finish_stats` or on drop.
    save_to: Mutex<Option<std::path::PathBuf>>,
    memory: Option<String>,
    state: Mutex<OffloadState>,
    /// While `Some`, the passes submitted here are timed per dispatch (`lathe bench`).
    profile: Mutex<Option<Vec<(String, f64)>>>,
    /// While `Some`, each MoE layer's host and GPU times are recorded (`--moe-timeline`).
    timeline: Mutex<Option<Recording>>,
}

impl Offload {
    /// Allocate and fill the arena of `plan` for passes of up to `rows` tokens. Call after
    /// the non-expert weights are on the GPU.
    pub fn new(
        gpu: &Gpu,
        file: &ModelFile,
        plan: Plan,
        opts: &LoadOptions,
        rows: usize,
    ) -> Result<Offload> {
        // A second mapping of the same file: the loader's `ModelFile` is borrowed, the cold
        // path needs the pages for the model's lifetime.
        let file = ModelFile::open(file.path())?;
        let Plan {
            info,
            placement,
            stats,
            budget,
            memory,
            rows: _,
        } = plan;
        let weights = info
            .layers
            .iter()
            .map(|m| ExpertWeights::from_file(&file, info.names, m))
            .collect::<Result<Vec<_>>>()?;
        let arena = new_arena(gpu, &placement)?;
        // The loaders count the bytes of every tensor of the file and upload all but the
        // routed experts: the arena's uploads take the bar from there to the end (cold
        // experts take no time; the hot ones count in proportion to their share).
        let progress = opts.progress.as_ref().map(|p| {
            let total: u64 = file.tensors().map(|t| t.data.len() as u64).sum();
            let experts: u64 = file
                .tensors()
                .filter(|t| info.names.is_expert(t.name))
                .map(|t| t.data.len() as u64)
                .sum();
            (p, total, experts.min(total))
        });
        fill_arena(&arena, gpu, &placement, &weights, &mut |done, all| {
            if let Some((p, total, experts)) = &progress {
                let part = (*experts as u128 * done as u128 / all.max(1) as u128) as u64;
                p(total - experts + part, *total);
            }
        })?;
        if let Some((p, total, _)) = &progress {
            p(*total, *total);
        }
        drop(weights);
        let remaps = remap_tables(gpu, &placement)?;
        let k = info.n_used;
        let n_embd = info.layers[0].n_embd() as usize;
        let pairs = (rows * k).max(1);
        let routes = placement
            .groups
            .iter()
            .map(|g| {
                (g.n_slots > 0)
                    .then(|| MoeRoute::new(gpu, g.n_slots, pairs as u32))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let all_hot = placement.layers.iter().all(|l| l.n_slots() == l.n_expert);
        let streams = if opts.expert_stream == ExpertStream::Never || all_hot {
            None
        } else {
            let groups: Vec<_> = (0..placement.groups.len())
                .map(|g| (stream_slots(&placement, g), placement.groups[g].shapes))
                .collect();
            let cold: Vec<Vec<u32>> = placement
                .layers
                .iter()
                .map(|l| vec![COLD; l.n_expert])
                .collect();
            let tables: Vec<_> = placement
                .layers
                .iter()
                .zip(&cold)
                .map(|(l, t)| (l.layer, &t[..]))
                .collect();
            Some(Streams {
                arena: ExpertArena::new(gpu, &groups)?,
                remaps: RemapTables::new(gpu, &tables)?,
                routes: groups
                    .iter()
                    .map(|&(n, _)| {
                        (n > 0)
                            .then(|| MoeRoute::new(gpu, n, pairs as u32))
                            .transpose()
                    })
                    .collect::<Result<Vec<_>>>()?,
                ids: gpu.buffer(pairs as u64 * 4, "moe.stream_ids")?,
                staging: [0, 1].map(|_| {
                    let bytes = groups
                        .iter()
                        .zip(&placement.groups)
                        .map(|(&(n, _), g)| n as u64 * g.slot_bytes())
                        .max()
                        .unwrap_or(0);
                    gpu.device.create_buffer(&wgpu::BufferDescriptor {
                        label: Some("moe.stream.staging"),
                        size: bytes.next_multiple_of(4).max(4),
                        usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                        mapped_at_creation: false,
                    })
                }),
                last_use: Mutex::new([None, None]),
                rounds: Default::default(),
            })
        };
        let cold = ColdOptions {
            activations: Activations::F32, // per call: see `cold_ffn`
            simd: match opts.cpu_simd {
                Some(l) => l.check()?,
                None => crate::cpu::simd::SimdLevel::detect(),
            },
        };
        let cache = ResidencyCache::new(&placement, opts.expert_cache.clone().unwrap_or_default());
        let stats =
            collects(opts).then(|| stats.clone().unwrap_or_else(|| ExpertStats::new(&info)));
        let memory = memory.map(|m| match &budget {
            Some(b) => format!(
                "{}; {} for expert slots",
                m.describe(),
                crate::inspect::human_bytes(b.experts)
            ),
            None => m.describe(),
        });
        Ok(Offload {
            arena,
            remaps,
            routes,
            slot_ids: gpu.buffer(pairs as u64 * 4, "moe.slot_ids")?,
            cold_rows: gpu.buffer((pairs * n_embd) as u64 * 4, "moe.cold_rows")?,
            cold_index: gpu.buffer(pairs as u64 * 4, "moe.cold_index")?,
            staging: gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("moe.readback"),
                size: ((pairs + rows * n_embd) as u64 * 4).max(4),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            upload: gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("moe.upload"),
                size: (pairs * (n_embd + 1)) as u64 * 4,
                usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            stream: opts.expert_stream,
            streams,
            cold,
            n_used: k as u32,
            n_embd: n_embd as u32,
            rows: rows as u32,
            collect_stats: collects(opts),
            save_to: Mutex::new(opts.save_expert_stats.clone()),
            memory,
            profile: Mutex::new(None),
            timeline: Mutex::new(None),
            state: Mutex::new(OffloadState {
                cache,
                stats,
                traffic: Traffic::default(),
                rows: Vec::new(),
            }),
            file,
            info,
            placement,
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, OffloadState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn profile_lock(&self) -> std::sync::MutexGuard<'_, Option<Vec<(String, f64)>>> {
        self.profile.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Time the passes submitted here per dispatch until [`take_profile`](Self::take_profile).
    pub fn start_profile(&self) {
        *self.profile_lock() = Some(Vec::new());
    }

    /// `(label, ns)` of the dispatches timed since [`start_profile`](Self::start_profile).
    pub fn take_profile(&self) -> Vec<(String, f64)> {
        self.profile_lock().take().unwrap_or_default()
    }

    fn timeline_lock(&self) -> std::sync::MutexGuard<'_, Option<Recording>> {
        self.timeline.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record each MoE layer's host and GPU times until [`take_timeline`](Self::take_timeline)
    /// (one decode step: `lathe bench --moe-timeline`).
    pub fn start_timeline(&self, gpu: &Gpu) {
        *self.timeline_lock() = Some(Recording::new(gpu, 2 * self.placement.layers.len()));
    }

    /// The layers recorded since [`start_timeline`](Self::start_timeline), GPU times filled
    /// in (waits for the GPU).
    pub fn take_timeline(&self, gpu: &Gpu) -> Result<Vec<LayerTimes>> {
        match self.timeline_lock().take() {
            Some(r) => r.finish(gpu),
            None => Ok(Vec::new()),
        }
    }

    /// Submit what `pass` holds and continue in a fresh pass (held as one submission too
    /// while profiling, so its dispatches are timed); with `stamp`, timestamps `q`, `q + 1`
    /// around it. The submission's index, except while profiling (it has finished then).
    fn submit(
        &self,
        pass: &mut Pass<'_>,
        stamp: Option<(&wgpu::QuerySet, u32)>,
    ) -> Result<Option<wgpu::SubmissionIndex>> {
        let gpu = pass.gpu();
        let mut next = gpu.pass();
        let mut profile = self.profile_lock();
        if profile.is_some() {
            next.hold();
        }
        let done = std::mem::replace(pass, next);
        match (profile.as_mut(), stamp) {
            (Some(p), _) => done.submit_or_profile(Some(p)).map(|()| None),
            (None, Some((qs, q))) => done.submit_stamped(qs, q).map(Some),
            (None, None) => done.submit().map(Some),
        }
    }

    /// True for a model layer whose experts are managed here.
    pub fn has_layer(&self, layer: usize) -> bool {
        self.placement.layer(layer).is_some()
    }

    /// Steps 4-5 of the recipe for MoE layer `layer` over `n` rows: map the router's ids
    /// (`ids` u32 `[n, n_used]`) to slots; when the layer has cold experts now (or routing is
    /// counted), copy the ids and the FFN input rows `h` (`[n, n_embd]`) to the readback
    /// buffer and submit `pass` (`pre`) without waiting: [`cold_ffn`](Self::cold_ffn)
    /// waits for this submission only, after the hot experts are submitted behind it.
    pub fn route(
        &self,
        pass: &mut Pass<'_>,
        layer: usize,
        ids: &wgpu::Buffer,
        h: &wgpu::Buffer,
        n: u32,
    ) -> Result<Option<Cold>> {
        if n > self.rows {
            return Err(Error::Invalid(format!(
                "moe layer {layer}: {n} rows, scratch for {}",
                self.rows
            )));
        }
        let nk = n * self.n_used;
        let slots = Operand::new(&self.slot_ids, 0);
        remap(pass, &self.remaps, layer, Operand::new(ids, 0), slots, nk)?;
        let any_cold = {
            let mut st = self.state();
            if self.placement.layers.first().map(|l| l.layer) == Some(layer) {
                st.traffic.tokens += n as u64;
            }
            st.cache.remap(layer).is_some_and(|r| r.contains(&COLD))
        };
        if !any_cold && !self.collect_stats {
            return Ok(None);
        }
        let (ilen, xlen) = (nk as u64 * 4, (n * self.n_embd) as u64 * 4);
        check_len("moe", "readback ids", ids, nk as u64)?;
        check_len("moe", "readback rows", h, (n * self.n_embd) as u64)?;
        pass.copy(ids, 0, &self.staging, 0, ilen);
        pass.copy(h, 0, &self.staging, ilen, xlen);
        let tl = self.timeline_lock();
        let host_ms = tl
            .as_ref()
            .map_or(0.0, |r| r.last.elapsed().as_secs_f64() * 1e3);
        let stamp = tl.as_ref().and_then(|r| r.next_query());
        let query = stamp.map(|(_, q)| q);
        let pre = self.submit(pass, stamp)?;
        drop(tl);
        Ok(Some(Cold {
            layer,
            n,
            pre,
            ids: ids.clone(),
            x: h.clone(),
            host_ms,
            query,
        }))
    }

    /// Step 6: the hot experts of `layer` on the arena, reading the slot ids of
    /// [`route`](Self::route): `b.out` row `t·n_used + s` gets expert `ids[t,s]`'s unweighted
    /// output for the hot pairs; cold pairs write nothing. `x` is `[n, n_embd]`; `limit` is
    /// DeepSeek's SwiGLU clamp.
    pub fn hot_ffn(
        &self,
        pass: &mut Pass<'_>,
        layer: usize,
        x: &wgpu::Buffer,
        n: u32,
        b: &FfnBufs<'_>,
        limit: Option<f32>,
    ) -> Result<()> {
        self.hot_ffn_glu(pass, layer, x, n, b, Glu::Swiglu(limit))
    }

    /// [`hot_ffn`](Self::hot_ffn) for experts of any gated activation (Gemma's GeGLU).
    pub fn hot_ffn_glu(
        &self,
        pass: &mut Pass<'_>,
        layer: usize,
        x: &wgpu::Buffer,
        n: u32,
        b: &FfnBufs<'_>,
        glu: Glu,
    ) -> Result<()> {
        let lp = self
            .placement
            .layer(layer)
            .ok_or_else(|| Error::Invalid(format!("moe: layer {layer} is not a MoE layer")))?;
        let g = lp.group;
        let Some(at) = self.arena.group(g) else {
            return Ok(());
        };
        let route = self.routes[g]
            .as_ref()
            .expect("a group with slots has a route");
        let stacks = ExpertStacks {
            gate: &at.gate,
            up: &at.up,
            down: &at.down,
        };
        let picks = Picks {
            ids: &self.slot_ids,
            route,
            n,
            k: self.n_used,
        };
        routed_ffn_glu(pass, &stacks, x, &picks, b, glu)
    }

    /// Steps 7-8. `pass` holds the hot experts and the shared expert (`hot`): submitted
    /// first, so the GPU runs them while the host waits for `pre`'s readback (that
    /// submission only, never a queue drain) and the CPU computes the cold pairs from the
    /// mapped file straight into the mapped upload buffer; the fresh pass then copies the
    /// rows up and scatters them into `b.out` (`[n·n_used, n_embd]`). A batch whose cold
    /// experts stream (`--expert-stream`) runs them on the GPU instead, through the streaming
    /// slots, with the same kernels as the hot ones. Then the residency cache sees the
    /// layer's picks and makes its uploads (they land after the submitted work, before the
    /// next submission).
    ///
    /// `after` records what follows the layer's rows in `pass` (the model's combine, and
    /// the next layer up to its router); when given, it is called exactly once, after the
    /// scatter (without it the caller records that after this returns). With
    /// cold pairs on the CPU it runs on a rayon worker while this thread computes them, and
    /// the pass it recorded is encoded there too and submitted as soon as the rows are
    /// written (queue order puts the copy and the scatter before the combine that reads
    /// them), so the host's recording and encoding of the next layer leave the critical path.
    pub fn cold_ffn(
        &self,
        pass: &mut Pass<'_>,
        cold: Option<Cold>,
        b: &FfnBufs<'_>,
        limit: Option<f32>,
        after: Option<After<'_>>,
    ) -> Result<()> {
        self.cold_ffn_glu(pass, cold, b, Glu::Swiglu(limit), after)
    }

    /// [`cold_ffn`](Self::cold_ffn) for experts of any gated activation (Gemma's GeGLU).
    pub fn cold_ffn_glu(
        &self,
        pass: &mut Pass<'_>,
        cold: Option<Cold>,
        b: &FfnBufs<'_>,
        glu: Glu,
        mut after: Option<After<'_>>,
    ) -> Result<()> {
        let has_after = after.is_some();
        let mut after = |pass: &mut Pass<'_>| match after.take() {
            Some(f) => f(pass),
            None => Ok(()),
        };
        let Some(c) = cold else {
            return after(pass);
        };
        let gpu = pass.gpu();
        let li = self
            .info
            .layers
            .iter()
            .position(|m| m.layer == c.layer)
            .ok_or_else(|| Error::Invalid(format!("moe: layer {} is not a MoE layer", c.layer)))?;
        let (n, k, e) = (c.n, self.n_used as usize, self.n_embd as usize);
        let mut tl = self.timeline_lock();
        let stamp = tl
            .as_ref()
            .and_then(|r| r.queries.as_ref())
            .zip(c.query)
            .map(|(qs, q)| (qs, q + 2));
        self.submit(pass, stamp)?;
        let gpu_done = tl.is_some().then(|| {
            let flag = Arc::new(AtomicBool::new(false));
            let f = flag.clone();
            gpu.queue
                .on_submitted_work_done(move || f.store(true, Ordering::Release));
            flag
        });
        // Wait for `pre` only: the readback, and the upload buffer (its last copy was in
        // `pre` or before). Both mapped at that one wait.
        let t_wait = Instant::now();
        // The CPU's workers stay awake through the wait (they run the cold pairs next).
        let mut warm = Some(crate::cpu::moe::Warm::start(WARM_MOST));
        let nk = n as usize * k;
        let (ilen, xlen) = (nk as u64 * 4, (n as usize * e) as u64 * 4);
        let up_len = (nk * (e + 1)) as u64 * 4;
        let read = self.staging.slice(..ilen + xlen);
        let write = self.upload.slice(..up_len);
        let (tx, rx) = std::sync::mpsc::channel();
        let tx2 = tx.clone();
        read.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        write.map_async(wgpu::MapMode::Write, move |r| {
            let _ = tx2.send(r);
        });
        gpu.device
            .poll(wgpu::PollType::Wait {
                submission_index: c.pre.clone(),
                timeout: None,
            })
            .map_err(|e| Error::Gpu(format!("moe readback: {e}")))?;
        for _ in 0..2 {
            rx.recv()
                .map_err(|_| Error::Gpu("moe readback: map callback never ran".into()))?
                .map_err(|e| Error::Gpu(format!("moe readback: {e}")))?;
        }
        gpu.check()?;
        let (ids, h) = {
            let data = read
                .get_mapped_range()
                .map_err(|e| Error::Gpu(format!("moe readback: {e:?}")))?;
            let ids: Vec<u32> = bytemuck::pod_collect_to_vec(&data[..ilen as usize]);
            let h: Vec<f32> = bytemuck::pod_collect_to_vec(&data[ilen as usize..]);
            (ids, h)
        };
        self.staging.unmap();
        let wait_ms = t_wait.elapsed().as_secs_f64() * 1e3;
        let pairs = {
            let st = self.state();
            let table = st.cache.remap(c.layer).unwrap_or(&[]);
            cold_pairs(table, &ids, k)
        };
        let t_cpu = Instant::now();
        let streamed = !pairs.is_empty() && self.streams_batch(li, n, &pairs);
        if pairs.is_empty() || streamed {
            self.upload.unmap();
            drop(warm.take());
        }
        if streamed {
            self.stream_layer(pass, li, &c, &pairs, b, glu)?;
        } else if !pairs.is_empty() {
            let mut experts: Vec<u32> = pairs.iter().map(|p| p.expert).collect();
            experts.sort_unstable();
            experts.dedup();
            let w = ExpertWeights::from_file_only(
                &self.file,
                self.info.names,
                &self.info.layers[li],
                &experts,
            )?;
            let rows_len = pairs.len() * e * 4;
            let np = pairs.len() as u64;
            // Recorded before the rows exist: the upload buffer is unmapped before this pass
            // is submitted, and the copies run then.
            pass.copy(&self.upload, 0, &self.cold_rows, 0, rows_len as u64);
            pass.copy(&self.upload, rows_len as u64, &self.cold_index, 0, np * 4);
            scatter_rows(
                pass,
                Operand::new(&self.cold_rows, 0),
                Operand::new(&self.cold_index, 0),
                np as u32,
                self.n_embd,
                Operand::strided(b.out, 0, self.n_embd),
                n * self.n_used,
            )?;
            // int8 activations exactly where the GPU's experts take them (its indexed
            // matvec, `experts_by_matvec`, under `--activations int8`), so placement does not
            // change the sums
            let opts = ColdOptions {
                activations: if crate::gpu::moe::experts_by_matvec(n) && gpu.int8_decode() {
                    Activations::Int8
                } else {
                    Activations::F32
                },
                ..self.cold
            };
            // A profiled run times every dispatch of its own held submissions.
            let overlap = has_after && self.profile_lock().is_none();
            let mut buf = std::mem::take(&mut self.state().rows);
            buf.clear();
            buf.resize(pairs.len() * (e + 1), 0);
            let (rows, index) = buf.split_at_mut(pairs.len() * e);
            let mut ahead = Ok(None);
            // The recording on a worker (one of those `warm` keeps awake: it starts at once),
            // the cold rows on this thread as without it (its scratch is thread-local).
            let cpu = rayon::in_place_scope(|s| {
                if overlap {
                    s.spawn(|_| {
                        ahead = after(pass).and_then(|()| {
                            let next = std::mem::replace(pass, gpu.pass());
                            next.encode().map(Some)
                        });
                    });
                }
                drop(warm.take());
                crate::cpu::moe::expert_rows_glu(
                    &w,
                    &h,
                    &pairs,
                    glu,
                    &opts,
                    bytemuck::cast_slice_mut(rows),
                )
            });
            cpu?;
            let ahead = ahead?;
            for (i, p) in index.iter_mut().zip(&pairs) {
                *i = p.token * self.n_used + p.slot;
            }
            {
                let mut data = write
                    .get_mapped_range_mut()
                    .map_err(|e| Error::Gpu(format!("moe upload: {e:?}")))?;
                data.slice(..buf.len() * 4)
                    .copy_from_slice(bytemuck::cast_slice(&buf[..]));
            }
            self.upload.unmap();
            self.state().rows = buf;
            match ahead {
                Some(enc) => {
                    enc.submit()?;
                }
                None => after(pass)?,
            }
        }
        if pairs.is_empty() || streamed {
            after(pass)?;
        }
        let cpu_ms = t_cpu.elapsed().as_secs_f64() * 1e3;
        let gpu_done_first = gpu_done.is_some_and(|f| {
            let _ = gpu.device.poll(wgpu::PollType::Poll);
            f.load(Ordering::Acquire)
        });
        let t_after = Instant::now();
        self.observe(gpu, &c, &ids, &pairs, streamed)?;
        if let Some(r) = tl.as_mut() {
            r.layers.push(LayerTimes {
                layer: c.layer,
                host_ms: c.host_ms,
                wait_ms,
                cpu_ms,
                after_ms: t_after.elapsed().as_secs_f64() * 1e3,
                gpu_done_first,
                gpu_pre_ms: None,
                gpu_hot_ms: None,
                cold_pairs: pairs.len(),
            });
            r.last = Instant::now();
        }
        Ok(())
    }

    /// Whether layer `li`'s cold pairs of an `n`-row batch stream to the GPU
    /// (`--expert-stream`; `auto`: [`super::plan::stream_beats_cpu`]).
    fn streams_batch(&self, li: usize, n: u32, pairs: &[ColdPair]) -> bool {
        if self.streams.is_none() || n < 2 {
            return false;
        }
        match self.stream {
            ExpertStream::Never => false,
            ExpertStream::Always => true,
            ExpertStream::Auto => {
                let mut experts: Vec<u32> = pairs.iter().map(|p| p.expert).collect();
                experts.sort_unstable();
                experts.dedup();
                // Per expert on average: its pairs on the CPU against one copy over the link.
                crate::moe::plan::stream_beats_cpu(
                    &self.info.layers[li],
                    pairs.len().div_ceil(experts.len()),
                    LINK_BYTES_PER_S,
                    CPU_PARAMS_PER_CORE_S * rayon::current_num_threads() as f64,
                )
            }
        }
    }

    /// The cold experts `pairs` pick, in rounds of the group's streaming slots: copy the
    /// round's experts from the mapped file into the slots, point the layer's streaming
    /// table at them (the other experts `COLD`: they write nothing), and run the routed FFN
    /// on the slots over all `n` rows (`b.out` gets the round's pairs' rows). One submission
    /// per round, so each round's table and copies land after the previous round's work.
    fn stream_layer(
        &self,
        pass: &mut Pass<'_>,
        li: usize,
        c: &Cold,
        pairs: &[ColdPair],
        b: &FfnBufs<'_>,
        glu: Glu,
    ) -> Result<()> {
        let gpu = pass.gpu();
        let st = self.streams.as_ref().expect("streams_batch checked");
        let lp = &self.placement.layers[li];
        let g = lp.group;
        let at = st
            .arena
            .group(g)
            .expect("a group with layers has streaming slots");
        let route = st.routes[g]
            .as_ref()
            .expect("a group with slots has a route");
        let mut experts: Vec<u32> = pairs.iter().map(|p| p.expert).collect();
        experts.sort_unstable();
        experts.dedup();
        let slot_bytes = self.placement.groups[g].slot_bytes();
        let nk = c.n * self.n_used;
        let shapes = self.placement.groups[g].shapes;
        let aligned = shapes.iter().all(|m| m.bytes().is_multiple_of(4));
        let mut used = None;
        for round in experts.chunks(at.n_slots as usize) {
            let w = ExpertWeights::from_file_only(
                &self.file,
                self.info.names,
                &self.info.layers[li],
                round,
            )?;
            let mut table = vec![COLD; lp.n_expert];
            for (slot, &ex) in round.iter().enumerate() {
                table[ex as usize] = slot as u32;
            }
            if aligned {
                used = Some(self.stage_round(pass, st, at, &shapes, &w, round)?);
            } else {
                for (slot, &ex) in round.iter().enumerate() {
                    write_expert(&st.arena, gpu, g, slot as u32, &w, ex)?;
                }
            }
            st.remaps.write(gpu, c.layer, &table)?;
            let (ids, slots) = (Operand::new(&c.ids, 0), Operand::new(&st.ids, 0));
            remap(pass, &st.remaps, c.layer, ids, slots, nk)?;
            let stacks = ExpertStacks {
                gate: &at.gate,
                up: &at.up,
                down: &at.down,
            };
            let picks = Picks {
                ids: &st.ids,
                route,
                n: c.n,
                k: self.n_used,
            };
            routed_ffn_glu(pass, &stacks, &c.x, &picks, b, glu)?;
            let sub = self.submit(pass, None)?;
            if let Some(i) = used {
                st.last_use.lock().unwrap_or_else(|p| p.into_inner())[i] = sub;
            }
            self.state().traffic.streamed_bytes += slot_bytes * round.len() as u64;
        }
        self.state().traffic.streamed_pairs += pairs.len() as u64;
        Ok(())
    }

    /// One round's experts into the next staging buffer (mapped once its last copy is done;
    /// filled by rayon straight from the mapped file) and the copies into streaming slots
    /// `0..round.len()` of `at`, recorded in `pass`. The staging buffer used.
    fn stage_round(
        &self,
        pass: &mut Pass<'_>,
        st: &Streams,
        at: &crate::gpu::moe::ArenaTensors,
        shapes: &[crate::moe::MatShape; 3],
        w: &ExpertWeights<'_>,
        round: &[u32],
    ) -> Result<usize> {
        use rayon::prelude::*;
        let gpu = pass.gpu();
        let i = st.rounds.fetch_add(1, Ordering::Relaxed) % 2;
        let buf = &st.staging[i];
        let mb: Vec<u64> = shapes.iter().map(|m| m.bytes()).collect();
        let n = round.len() as u64;
        let len: u64 = mb.iter().map(|b| b * n).sum();
        let slice = buf.slice(..len);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Write, move |r| {
            let _ = tx.send(r);
        });
        let last = st.last_use.lock().unwrap_or_else(|p| p.into_inner())[i].clone();
        let poll = match last {
            Some(idx) => wgpu::PollType::Wait {
                submission_index: Some(idx),
                timeout: None,
            },
            None => wgpu::PollType::Poll,
        };
        let res = loop {
            gpu.device
                .poll(poll.clone())
                .map_err(|e| Error::Gpu(format!("moe stream: {e}")))?;
            match rx.try_recv() {
                Ok(r) => break r,
                Err(std::sync::mpsc::TryRecvError::Empty) => std::thread::yield_now(),
                Err(_) => return Err(Error::Gpu("moe stream: map callback lost".into())),
            }
        };
        res.map_err(|e| Error::Gpu(format!("moe stream: {e}")))?;
        {
            let mut view = slice
                .get_mapped_range_mut()
                .map_err(|e| Error::Gpu(format!("moe stream: {e:?}")))?;
            // Gate slots, then up, then down; each (matrix, expert) piece copied by its own
            // rayon task (a cold file's page faults and the copies spread over the cores).
            let mut pieces = Vec::with_capacity(3 * round.len());
            let mut off = 0usize;
            for (m, &b) in mb.iter().enumerate() {
                for &ex in round {
                    pieces.push((m, ex, off));
                    off += b as usize;
                }
            }
            let mut all = view.slice(..);
            assert_eq!(all.len(), off, "the round's pieces cover the mapped range");
            // The address as an integer: raw pointers are not `Send`.
            let base = all.as_raw_element_ptr().as_ptr() as usize;
            let mats = [&w.gate, &w.up, &w.down];
            pieces
                .into_par_iter()
                .try_for_each(|(m, ex, off)| -> Result<()> {
                    let bytes = mats[m].expert(ex as usize)?;
                    assert_eq!(bytes.len() as u64, mb[m], "an expert matrix of its shape");
                    // SAFETY: the pieces are disjoint ranges `off..off + mb[m]` of the mapped
                    // range (checked to end at its length above), which `view` keeps mapped
                    // and writable until every task has returned.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            bytes.as_ptr(),
                            (base as *mut u8).add(off),
                            bytes.len(),
                        );
                    }
                    Ok(())
                })?;
        }
        buf.unmap();
        let mut off = 0u64;
        for (m, &b) in mb.iter().enumerate() {
            let t = at.get(m);
            let rows = shapes[m].rows;
            for part in &t.parts {
                let first = part.row_start / rows;
                let end = (part.row_start + part.n_rows) / rows;
                let (s0, s1) = (first.min(n), end.min(n));
                if s0 < s1 {
                    pass.copy(buf, off + s0 * b, &part.buffer, 0, (s1 - s0) * b);
                }
            }
            off += n * b;
        }
        Ok(i)
    }

    /// Step 8: counters and statistics of layer `c`'s picks `ids`, and the residency
    /// cache's uploads (written after the submitted work, before the next submission).
    fn observe(
        &self,
        gpu: &Gpu,
        c: &Cold,
        ids: &[u32],
        pairs: &[ColdPair],
        streamed: bool,
    ) -> Result<()> {
        let mut st = self.state();
        if !streamed {
            st.traffic.cold_pairs += pairs.len() as u64;
        }
        if let Some(s) = st.stats.as_mut() {
            s.record(c.layer, ids);
        }
        let uploads = st.cache.observe(c.layer, ids);
        for u in uploads {
            let m = self
                .info
                .layer(u.layer)
                .expect("the cache uploads experts of MoE layers");
            let w = ExpertWeights::from_file_only(&self.file, self.info.names, m, &[u.expert])?;
            let g = self.placement.layer(u.layer).expect("placed layer").group;
            write_expert(&self.arena, gpu, g, u.slot, &w, u.expert)?;
            st.traffic.uploaded_bytes += self.placement.groups[g].slot_bytes();
            let r = st.cache.remap(u.layer).expect("cached layer");
            self.remaps.write(gpu, u.layer, r)?;
            if let Some((el, _)) = u.evicted.filter(|&(el, _)| el != u.layer) {
                let r = st.cache.remap(el).expect("cached layer");
                self.remaps.write(gpu, el, r)?;
            }
        }
        Ok(())
    }

    /// What the offload has counted so far: routing statistics and the traffic counters of
    /// its report.
    pub fn counts(&self) -> Counts {
        let st = self.state();
        Counts {
            stats: st.stats.clone(),
            traffic: st.traffic,
        }
    }

    /// Puts back what [`Offload::counts`] returned, forgetting what passes since counted
    /// (`Engine::warm_up`'s scratch passes are no traffic to learn routing from or to
    /// report); the residency cache keeps its state: it adapts to what follows.
    pub fn restore_counts(&self, c: Counts) {
        let mut st = self.state();
        st.stats = c.stats;
        st.traffic = c.traffic;
    }

    /// Routing statistics collected so far (`LoadOptions::collect_expert_stats`).
    pub fn stats(&self) -> Option<ExpertStats> {
        self.state().stats.clone()
    }

    /// Write the statistics to `LoadOptions::save_expert_stats` (once); the path written.
    pub fn finish_stats(&self) -> Result<Option<std::path::PathBuf>> {
        let path = self
            .save_to
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match (path, self.stats()) {
            (Some(p), Some(s)) => {
                s.save(&p)?;
                Ok(Some(p))
            }
            _ => Ok(None),
        }
    }

    /// Residency cache hits and misses so far, in routed pairs, over all layers.
    pub fn cache_hits(&self) -> (u64, u64) {
        self.state()
            .cache
            .hits()
            .iter()
            .fold((0, 0), |(h, m), l| (h + l.hits, m + l.misses))
    }

    pub fn report(&self) -> PlacementReport {
        let st = self.state();
        let mut hot = 0;
        let mut total = 0;
        for lp in &self.placement.layers {
            hot += st.cache.held(lp.layer).unwrap_or(0);
            total += lp.n_expert;
        }
        let (h, m) = st
            .cache
            .hits()
            .iter()
            .fold((0u64, 0u64), |(h, m), l| (h + l.hits, m + l.misses));
        PlacementReport {
            hot_experts: hot,
            total_experts: total,
            hot_share: hot as f64 / total.max(1) as f64,
            arena_bytes: self.placement.arena_bytes(),
            hit_rate: if h + m == 0 {
                1.0
            } else {
                h as f64 / (h + m) as f64
            },
            uploads: st.cache.uploads(),
            cold_pairs: st.traffic.cold_pairs,
            uploaded_bytes_per_token: st.traffic.uploaded_bytes as f64
                / st.traffic.tokens.max(1) as f64,
            streamed_bytes: st.traffic.streamed_bytes,
            streamed_pairs: st.traffic.streamed_pairs,
            memory: self.memory.clone(),
        }
    }
}

impl Drop for Offload {
    /// `--save-expert-stats` of a model dropped without `finish_stats` (a server shutting
    /// down): write them, or say why not.
    fn drop(&mut self) {
        match self.finish_stats() {
            Ok(Some(p)) => eprintln!("expert statistics written to {}", p.display()),
            Ok(None) => {}
            Err(e) => eprintln!("error: expert statistics not written: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_rows_doubles_while_the_scratch_fits() {
        let extra = |r: usize| Some((r as u64 - 512) * 1000);
        assert_eq!(stream_rows(512, 0, extra), 512);
        assert_eq!(stream_rows(512, 512_000, extra), 1024);
        assert_eq!(stream_rows(512, 1_535_999, extra), 1024);
        assert_eq!(stream_rows(512, 1_536_000, extra), 2048);
        assert_eq!(stream_rows(512, u64::MAX, extra), STREAM_ROWS);
        assert_eq!(stream_rows(256, u64::MAX, |_| Some(0)), STREAM_ROWS);
        // A binding limit stops it even with memory to spare.
        let bound = |r: usize| (r <= 2048).then_some(0);
        assert_eq!(stream_rows(512, u64::MAX, bound), 2048);
    }
}
