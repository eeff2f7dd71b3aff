//! The GPU side of MoE models bigger than VRAM (`shaders/moe.wgsl`): the expert arena, the
//! per-layer remap tables, the kernels that map router ids to slots and put the CPU's cold
//! rows in place, and the one readback per MoE layer. The recipe that ties them into a
//! forward is in `moe/mod.rs`. CPU references: `moe::remap_ids`, a plain scatter, and the
//! arena's bytes against the mmap.

use super::elementwise::{self as ew, View};
use super::matmul::{self, MoeRoute};
use super::matvec::{self, MatvecOpts};
use super::{grid, Binding, Gpu, GpuTensor, Pass, PipelineSpec, TensorPart};
use crate::engine::LoadOptions;
use crate::models::ModelFile;
use crate::moe::{
    AdapterMemory, Budget, ColdPair, ExpertStats, ExpertWeights, Fill, Kind, MemSource, MoeInfo,
    Placement, ResidencyCache, RunShape, COLD,
};
use crate::{Error, Result};
use std::sync::Mutex;

const SRC: &str = include_str!("../../shaders/moe.wgsl");
const WG: u32 = 256;

/// Uniforms of `moe.wgsl` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,          // remap: ids; scatter_rows: rows; copy_bytes: destination words
    n_expert: u32,   // remap: table entries
    width: u32,      // scatter_rows: words per row
    n_out: u32,      // scatter_rows: rows of the output
    in_off: u32,     // words
    out_off: u32,    // words
    out_stride: u32, // words
    tab_off: u32,    // words
    byte_off: u32,   // bytes
    n_bytes: u32,    // bytes
    _pad: [u32; 2],
}
const _: () = assert!(std::mem::size_of::<Params>() == 48);

fn pipe(gpu: &Gpu, entry: &'static str) -> Result<std::sync::Arc<wgpu::ComputePipeline>> {
    gpu.pipeline(&PipelineSpec::new(format!("moe_{entry}"), SRC, entry))
}

fn words_check(what: &str, buf: &wgpu::Buffer, end_words: u64) -> Result<()> {
    if end_words * 4 > buf.size() || end_words > u32::MAX as u64 {
        return Err(Error::Invalid(format!(
            "moe: {what} needs {end_words} words, its buffer holds {}",
            buf.size() / 4
        )));
    }
    Ok(())
}

/// One arena group on the GPU: gate, up, down as `[n_slots, rows, cols]` tensors in the
/// stored type, split into parts of whole slots (binding limit), so `matvec_indexed` /
/// `matmul_indexed` read them with slot ids.
pub struct ArenaTensors {
    pub gate: GpuTensor,
    pub up: GpuTensor,
    pub down: GpuTensor,
    pub n_slots: u32,
}

impl ArenaTensors {
    pub fn get(&self, kind: Kind) -> &GpuTensor {
        match kind {
            Kind::Gate => &self.gate,
            Kind::Up => &self.up,
            Kind::Down => &self.down,
        }
    }
}

/// The model-wide expert arena: one [`ArenaTensors`] per placement group (`None` for a
/// group without slots).
pub struct ExpertArena {
    pub groups: Vec<Option<ArenaTensors>>,
}

/// A zeroed `[n_slots, rows, cols]` tensor in parts of at most the binding limit.
fn arena_tensor(
    gpu: &Gpu,
    name: String,
    s: crate::moe::MatShape,
    n_slots: u32,
) -> Result<GpuTensor> {
    let eb = s.bytes();
    let max = gpu.max_binding() & !3;
    if eb > max {
        return Err(Error::Gpu(format!(
            "{name}: one expert matrix of {eb} bytes exceeds the binding limit {max}"
        )));
    }
    let per_part = (max / eb).max(1);
    let mut parts = Vec::new();
    let mut s0 = 0u64;
    while s0 < n_slots as u64 {
        let n = per_part.min(n_slots as u64 - s0);
        // ≥ 16 bytes: the matvec kernels view weights as 16-byte vectors.
        let buffer = gpu.buffer((n * eb).max(16), &name)?;
        parts.push(TensorPart {
            buffer,
            row_start: s0 * s.rows,
            n_rows: n * s.rows,
        });
        s0 += n;
    }
    Ok(GpuTensor {
        name,
        dtype: s.dtype,
        shape: vec![n_slots as u64, s.rows, s.cols],
        parts,
    })
}

impl ExpertArena {
    /// Allocate every group's slots (zeroed; [`fill`](Self::fill) uploads the placement).
    pub fn new(gpu: &Gpu, placement: &Placement) -> Result<ExpertArena> {
        let mut groups = Vec::with_capacity(placement.groups.len());
        for (g, grp) in placement.groups.iter().enumerate() {
            if grp.n_slots == 0 {
                groups.push(None);
                continue;
            }
            let t = |i: usize| {
                arena_tensor(
                    gpu,
                    format!("moe.arena.g{g}.{}", Kind::ALL[i].name()),
                    grp.shapes[i],
                    grp.n_slots,
                )
            };
            groups.push(Some(ArenaTensors {
                gate: t(0)?,
                up: t(1)?,
                down: t(2)?,
                n_slots: grp.n_slots,
            }));
        }
        Ok(ExpertArena { groups })
    }

    /// Group `g`'s tensors (`None` when it has no slots).
    pub fn group(&self, g: usize) -> Option<&ArenaTensors> {
        self.groups.get(g).and_then(Option::as_ref)
    }

    /// Copy expert `expert` of `w` (its three matrices in the stored type: bytes from the
    /// mmap, or repacked from a release's block-scaled tensors) into slot `slot` of group `g`. Ordered before the next submission and after everything
    /// submitted so far. Slots whose size is a multiple of 4 bytes take one
    /// `queue.write_buffer` per matrix; others go through a staging buffer and the
    /// `copy_bytes` kernel (one submission), which keeps the neighbouring slots' bytes.
    pub fn write_expert(
        &self,
        gpu: &Gpu,
        g: usize,
        slot: u32,
        w: &ExpertWeights<'_>,
        expert: u32,
    ) -> Result<()> {
        let at = self
            .group(g)
            .ok_or_else(|| Error::Invalid(format!("moe arena: group {g} has no slots")))?;
        if slot >= at.n_slots || expert as usize >= w.n_expert() {
            return Err(Error::Invalid(format!(
                "moe arena: slot {slot} of {} / expert {expert} of {} (layer {})",
                at.n_slots,
                w.n_expert(),
                w.layer
            )));
        }
        let mut pass: Option<Pass<'_>> = None;
        for kind in Kind::ALL {
            let t = at.get(kind);
            let m = w.mats(kind);
            if m.shape.dtype != t.dtype || [m.shape.rows, m.shape.cols] != [t.shape[1], t.shape[2]]
            {
                return Err(Error::Invalid(format!(
                    "moe arena: layer {} {} experts are {}x{} {}, group {g} holds {:?} {}",
                    w.layer,
                    kind.name(),
                    m.shape.rows,
                    m.shape.cols,
                    m.shape.dtype,
                    &t.shape[1..],
                    t.dtype
                )));
            }
            let eb = m.shape.bytes();
            let row0 = slot as u64 * m.shape.rows;
            let part = t
                .parts
                .iter()
                .find(|p| (p.row_start..p.row_start + p.n_rows).contains(&row0))
                .expect("arena parts cover every slot");
            let off = (row0 - part.row_start) / m.shape.rows * eb;
            let bytes = m.expert(expert as usize)?;
            if eb.is_multiple_of(4) {
                gpu.write(&part.buffer, off, &bytes);
            } else {
                let staging = gpu.upload(&bytes, "moe.arena.staging")?;
                let first = off / 4;
                let end = (off + eb).div_ceil(4);
                let prm = Params {
                    n: (end - first) as u32,
                    byte_off: off as u32,
                    n_bytes: eb as u32,
                    ..Default::default()
                };
                if off + eb > u32::MAX as u64 {
                    return Err(Error::Gpu(format!(
                        "{}: part beyond 4 GiB with unaligned slots",
                        t.name
                    )));
                }
                let p = pass.get_or_insert_with(|| gpu.pass());
                p.dispatch(
                    &pipe(gpu, "copy_bytes")?,
                    "moe_copy_bytes",
                    &prm,
                    &[(&staging).into(), Binding::from(&part.buffer)],
                    grid(prm.n.div_ceil(WG)),
                );
            }
        }
        if let Some(p) = pass {
            p.submit()?;
        }
        Ok(())
    }

    /// Upload every hot expert of `placement` (`weights` in `placement.layers` order).
    pub fn fill(
        &self,
        gpu: &Gpu,
        placement: &Placement,
        weights: &[ExpertWeights<'_>],
    ) -> Result<()> {
        self.fill_reporting(gpu, placement, weights, &mut |_, _| {})
    }

    /// [`fill`](Self::fill), calling `report(bytes written, bytes to write)` after each
    /// expert (for a load progress bar).
    pub fn fill_reporting(
        &self,
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
                self.write_expert(gpu, lp.group, s, w, e)?;
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
}

/// Every MoE layer's remap table (`u32 [n_expert]`: slot or `COLD`) in one buffer.
pub struct RemapTables {
    pub buffer: wgpu::Buffer,
    /// (model layer, first word, n_expert).
    layers: Vec<(usize, u32, u32)>,
}

impl RemapTables {
    /// Upload the tables of `placement`.
    pub fn new(gpu: &Gpu, placement: &Placement) -> Result<RemapTables> {
        let mut words = Vec::new();
        let mut layers = Vec::new();
        for lp in &placement.layers {
            layers.push((lp.layer, words.len() as u32, lp.remap.len() as u32));
            words.extend_from_slice(&lp.remap);
        }
        let buffer = gpu.upload(bytemuck::cast_slice(&words), "moe.remap")?;
        Ok(RemapTables { buffer, layers })
    }

    /// (first word, n_expert) of model layer `layer`'s table.
    pub fn table(&self, layer: usize) -> Option<(u32, u32)> {
        self.layers
            .iter()
            .find(|l| l.0 == layer)
            .map(|&(_, o, n)| (o, n))
    }

    /// Replace `layer`'s table (e.g. with `ResidencyCache::remap(layer)` after uploads);
    /// ordered before the next submission.
    pub fn write(&self, gpu: &Gpu, layer: usize, remap: &[u32]) -> Result<()> {
        let (off, n) = self.table(layer).ok_or_else(|| {
            Error::Invalid(format!("moe remap: layer {layer} is not a MoE layer"))
        })?;
        if remap.len() != n as usize {
            return Err(Error::Invalid(format!(
                "moe remap: layer {layer} has {n} experts, table of {}",
                remap.len()
            )));
        }
        gpu.write(&self.buffer, off as u64 * 4, bytemuck::cast_slice(remap));
        Ok(())
    }
}

/// `slots[slots_off + i] = table_L[ids[ids_off + i]]` for `i < n` (`COLD` for ids outside the
/// table): router ids → arena slot ids of layer `layer`. `ids` and `slots` u32 buffers (must
/// be different buffers).
#[allow(clippy::too_many_arguments)]
pub fn remap(
    pass: &mut Pass<'_>,
    tables: &RemapTables,
    layer: usize,
    ids: &wgpu::Buffer,
    ids_off: u32,
    slots: &wgpu::Buffer,
    slots_off: u32,
    n: u32,
) -> Result<()> {
    let (tab_off, n_expert) = tables
        .table(layer)
        .ok_or_else(|| Error::Invalid(format!("moe remap: layer {layer} is not a MoE layer")))?;
    words_check("remap ids", ids, ids_off as u64 + n as u64)?;
    words_check("remap slots", slots, slots_off as u64 + n as u64)?;
    if n == 0 {
        return Ok(());
    }
    let prm = Params {
        n,
        n_expert,
        in_off: ids_off,
        out_off: slots_off,
        tab_off,
        ..Default::default()
    };
    pass.dispatch(
        &pipe(pass.gpu(), "remap")?,
        "moe_remap",
        &prm,
        &[(&tables.buffer).into(), Binding::from(slots), ids.into()],
        grid(n.div_ceil(WG)),
    );
    Ok(())
}

/// Row r < n_rows of `rows` (f32 `[n_rows, width]` from `rows_off`) goes to row
/// `index[index_off + r]` of `out` (at `out_off + row·out_stride`); index values ≥ `n_out`
/// are skipped. Puts the CPU's cold expert rows into the per-pair buffer: `index` =
/// `token·n_used + slot` of each cold pair, `n_out` = `n_tokens·n_used`.
#[allow(clippy::too_many_arguments)]
pub fn scatter_rows(
    pass: &mut Pass<'_>,
    rows: &wgpu::Buffer,
    rows_off: u32,
    index: &wgpu::Buffer,
    index_off: u32,
    n_rows: u32,
    width: u32,
    out: &wgpu::Buffer,
    out_off: u32,
    out_stride: u32,
    n_out: u32,
) -> Result<()> {
    if n_rows == 0 || width == 0 {
        return Ok(());
    }
    if out_stride < width {
        return Err(Error::Invalid(format!(
            "moe scatter: stride {out_stride} below the row width {width}"
        )));
    }
    let total = n_rows as u64 * width as u64;
    if total > u32::MAX as u64 {
        return Err(Error::Invalid(format!(
            "moe scatter: {n_rows} rows of {width}"
        )));
    }
    words_check("scatter rows", rows, rows_off as u64 + total)?;
    words_check("scatter index", index, index_off as u64 + n_rows as u64)?;
    words_check(
        "scatter output",
        out,
        out_off as u64 + (n_out.max(1) as u64 - 1) * out_stride as u64 + width as u64,
    )?;
    let prm = Params {
        n: n_rows,
        width,
        n_out,
        in_off: rows_off,
        out_off,
        out_stride,
        tab_off: index_off,
        ..Default::default()
    };
    pass.dispatch(
        &pipe(pass.gpu(), "scatter_rows")?,
        "moe_scatter_rows",
        &prm,
        &[rows.into(), Binding::from(out), index.into()],
        grid((total as u32).div_ceil(WG)),
    );
    Ok(())
}

/// The one readback of a MoE layer with cold experts: `n_ids` u32 at word `ids_off` of `ids`
/// and `n_x` f32 at element `x_off` of `x`, through one staging buffer, one submission and
/// one wait (everything submitted before is finished when it returns).
pub fn read_back(
    gpu: &Gpu,
    ids: (&wgpu::Buffer, u32, u32),
    x: (&wgpu::Buffer, u32, u32),
) -> Result<(Vec<u32>, Vec<f32>)> {
    let (ib, io, ni) = ids;
    let (xb, xo, nx) = x;
    words_check("readback ids", ib, io as u64 + ni as u64)?;
    words_check("readback rows", xb, xo as u64 + nx as u64)?;
    let (ilen, xlen) = (ni as u64 * 4, nx as u64 * 4);
    let staging = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("moe.readback"),
        size: (ilen + xlen).max(4),
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    if ilen > 0 {
        enc.copy_buffer_to_buffer(ib, io as u64 * 4, &staging, 0, ilen);
    }
    if xlen > 0 {
        enc.copy_buffer_to_buffer(xb, xo as u64 * 4, &staging, ilen, xlen);
    }
    gpu.queue.submit([enc.finish()]);
    map_read(gpu, &staging, ilen, xlen)
}

/// Waits for the queue, maps `staging` (MAP_READ) and splits its first `ilen + xlen` bytes into
/// u32 ids and f32 rows; unmapped again before returning, so the buffer can be reused.
fn map_read(
    gpu: &Gpu,
    staging: &wgpu::Buffer,
    ilen: u64,
    xlen: u64,
) -> Result<(Vec<u32>, Vec<f32>)> {
    let slice = staging.slice(..(ilen + xlen).max(4));
    let (tx, rx) = std::sync::mpsc::channel();
    slice.map_async(wgpu::MapMode::Read, move |r| {
        let _ = tx.send(r);
    });
    gpu.wait()?;
    rx.recv()
        .map_err(|_| Error::Gpu("moe readback: map callback never ran".into()))?
        .map_err(|e| Error::Gpu(format!("moe readback: {e}")))?;
    let (ids_v, x_v) = {
        let data = slice
            .get_mapped_range()
            .map_err(|e| Error::Gpu(format!("moe readback: {e:?}")))?;
        (
            bytemuck::pod_collect_to_vec(&data[..ilen as usize]),
            bytemuck::pod_collect_to_vec(&data[ilen as usize..(ilen + xlen) as usize]),
        )
    };
    staging.unmap();
    Ok((ids_v, x_v))
}

/// Where the experts go, decided at load before any weight is uploaded.
pub struct Plan {
    pub info: MoeInfo,
    pub placement: Placement,
    pub stats: Option<ExpertStats>,
    pub budget: Option<Budget>,
    pub memory: Option<AdapterMemory>,
}

impl Plan {
    /// The placement of `file`'s experts under `opts` (`--gpu-experts`, else the budget of
    /// `--gpu-mem` or the detected adapter memory; `--expert-stats` chooses which experts).
    /// `None` for a model without routed experts, and when every expert has a slot and no
    /// statistics are collected: the forward then keeps its per-layer expert stacks and one
    /// pass per token, exactly as without a planner.
    /// `batch`: rows of the model's passes (its activations are sized for them).
    pub fn new(
        gpu: &Gpu,
        file: &ModelFile,
        opts: &LoadOptions,
        batch: usize,
    ) -> Result<Option<Plan>> {
        let info = MoeInfo::from_file(file)?;
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
        let (fill, budget, memory) = match opts.gpu_experts {
            Some(f) => (Fill::Fraction(f), None, None),
            None => {
                let mem = AdapterMemory::detect(&gpu.info, opts.gpu_mem);
                let run = RunShape {
                    kv: opts.kv_type,
                    ctx: opts.ctx as u64,
                    batch: batch as u64,
                    seqs: opts.max_seqs as u64,
                };
                let (b, _) = crate::moe::model_budget(file, &info, mem.bytes, run);
                if !b.fits() {
                    eprintln!(
                        "warning: {} needs {} beside its routed experts, {} more than the GPU \
                         memory planned for ({}): every expert runs on the CPU and the rest \
                         may not fit (--gpu-mem SIZE)",
                        file.path().display(),
                        crate::inspect::human_bytes(b.beside_experts()),
                        crate::inspect::human_bytes(b.shortfall),
                        mem.describe()
                    );
                }
                (Fill::Budget(b.experts), Some(b), Some(mem))
            }
        };
        let placement = Placement::new(&info, fill, stats.as_ref())?;
        let plan = Plan {
            info,
            placement,
            stats,
            budget,
            memory,
        };
        if plan.all_hot() && !collects(opts) {
            return Ok(None);
        }
        // Fail before any upload when the experts cannot be read where they are stored
        // (missing tensors or scales, types that cannot be repacked).
        for m in &plan.info.layers {
            ExpertWeights::from_file(file, m)?;
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

fn collects(opts: &LoadOptions) -> bool {
    opts.collect_expert_stats || opts.save_expert_stats.is_some()
}

/// Scratch of one routed FFN: `gate`, `up` `[rows·n_used, n_ff]`, `act` (SwiGLU output, same
/// size), `out` `[rows·n_used, n_embd]` (the per-pair buffer `moe_out`).
pub struct FfnBufs<'b> {
    pub gate: &'b wgpu::Buffer,
    pub up: &'b wgpu::Buffer,
    pub act: &'b wgpu::Buffer,
    pub out: &'b wgpu::Buffer,
}

/// A MoE layer's cold work, from [`Offload::route`] to [`Offload::cold_ffn`].
pub struct Cold {
    layer: usize,
    /// Router ids `[n, n_used]` and FFN input rows `[n, n_embd]` read back.
    ids: Vec<u32>,
    h: Vec<f32>,
    pairs: Vec<ColdPair>,
}

/// Host-side state of the offload: the residency policy, statistics, counters.
struct OffloadState {
    cache: ResidencyCache,
    stats: Option<ExpertStats>,
    /// Routed (token, expert) pairs run on the CPU, and all routed pairs seen by readbacks.
    cold_pairs: u64,
    seen_pairs: u64,
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
        } = plan;
        let weights = info
            .layers
            .iter()
            .map(|m| ExpertWeights::from_file(&file, m))
            .collect::<Result<Vec<_>>>()?;
        let arena = ExpertArena::new(gpu, &placement)?;
        // The loaders count the bytes of every tensor of the file and upload all but the
        // routed experts: the arena's uploads take the bar from there to the end (cold
        // experts take no time; the hot ones count in proportion to their share).
        let progress = opts.progress.as_ref().map(|p| {
            let total: u64 = file.tensors().map(|t| t.data.len() as u64).sum();
            let experts: u64 = file
                .tensors()
                .filter(|t| crate::moe::is_expert_tensor(t.name))
                .map(|t| t.data.len() as u64)
                .sum();
            (p, total, experts.min(total))
        });
        arena.fill_reporting(gpu, &placement, &weights, &mut |done, all| {
            if let Some((p, total, experts)) = &progress {
                let part = (*experts as u128 * done as u128 / all.max(1) as u128) as u64;
                p(total - experts + part, *total);
            }
        })?;
        if let Some((p, total, _)) = &progress {
            p(*total, *total);
        }
        drop(weights);
        let remaps = RemapTables::new(gpu, &placement)?;
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
            n_used: k as u32,
            n_embd: n_embd as u32,
            rows: rows as u32,
            collect_stats: collects(opts),
            save_to: Mutex::new(opts.save_expert_stats.clone()),
            memory,
            profile: Mutex::new(None),
            state: Mutex::new(OffloadState {
                cache,
                stats,
                cold_pairs: 0,
                seen_pairs: 0,
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

    /// Submit what `pass` holds and continue in a fresh pass (held as one submission too
    /// while profiling, so its dispatches are timed).
    fn submit(&self, pass: &mut Pass<'_>) -> Result<()> {
        let gpu = pass.gpu();
        let mut next = gpu.pass();
        if self.profile_lock().is_some() {
            next.hold();
        }
        let done = std::mem::replace(pass, next);
        done.submit_or_profile(self.profile_lock().as_mut())
    }

    /// True for a model layer whose experts are managed here.
    pub fn has_layer(&self, layer: usize) -> bool {
        self.placement.layer(layer).is_some()
    }

    /// Steps 4-5 of the recipe for MoE layer `layer` over `n` rows: map the router's ids
    /// (`ids` u32 `[n, n_used]`) to slots; when the layer has cold experts now (or routing is
    /// counted), submit `pass`, read back the ids and the FFN input rows `h` (`[n, n_embd]`)
    /// in one readback, and continue in a fresh pass.
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
        remap(pass, &self.remaps, layer, ids, 0, &self.slot_ids, 0, nk)?;
        let any_cold = {
            let st = self.state();
            st.cache.remap(layer).is_some_and(|r| r.contains(&COLD))
        };
        if !any_cold && !self.collect_stats {
            return Ok(None);
        }
        let gpu = pass.gpu();
        let (ilen, xlen) = (nk as u64 * 4, (n * self.n_embd) as u64 * 4);
        words_check("readback ids", ids, nk as u64)?;
        words_check("readback rows", h, (n * self.n_embd) as u64)?;
        pass.copy(ids, 0, &self.staging, 0, ilen);
        pass.copy(h, 0, &self.staging, ilen, xlen);
        self.submit(pass)?;
        let (ids_v, h_v) = map_read(gpu, &self.staging, ilen, xlen)?;
        let pairs = {
            let st = self.state();
            let table = st.cache.remap(layer).unwrap_or(&[]);
            crate::moe::cold_pairs(table, &ids_v, self.n_used as usize)
        };
        Ok(Some(Cold {
            layer,
            ids: ids_v,
            h: h_v,
            pairs,
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
        let lp = self
            .placement
            .layer(layer)
            .ok_or_else(|| Error::Invalid(format!("moe: layer {layer} is not a MoE layer")))?;
        let g = lp.group;
        let Some(at) = self.arena.group(g) else {
            return Ok(());
        };
        let k = self.n_used;
        let ff = at.gate.shape[1] as u32;
        let opts = MatvecOpts::default();
        let ids = &self.slot_ids;
        let small = n <= matvec::MAX_TOKENS;
        let route = self.routes[g]
            .as_ref()
            .expect("a group with slots has a route");
        if small {
            for (w, y) in [(&at.gate, b.gate), (&at.up, b.up)] {
                matvec::matvec_indexed(pass, w, x, 0, false, ids, 0, k, y, 0, n, &opts)?;
            }
        } else {
            matmul::route(pass, route, ids, 0, n, k)?;
            for (w, y) in [(&at.gate, b.gate), (&at.up, b.up)] {
                matmul::matmul_indexed(pass, w, x, 0, false, route, n, k, y, 0, &opts)?;
            }
        }
        ew::swiglu(
            pass,
            n * k,
            ff,
            View::new(b.act, 0),
            View::new(b.gate, 0),
            View::new(b.up, 0),
            limit,
        )?;
        if small {
            matvec::matvec_indexed(
                pass, &at.down, b.act, 0, true, ids, 0, k, b.out, 0, n, &opts,
            )
        } else {
            matmul::matmul_indexed(pass, &at.down, b.act, 0, true, route, n, k, b.out, 0, &opts)
        }
    }

    /// Steps 7-8: with cold pairs, submit `pass` (the GPU runs the hot experts meanwhile),
    /// compute the cold pairs on the CPU from the mapped file, and scatter their rows into
    /// `out` (`[n·n_used, n_embd]`) in the fresh pass; then let the residency cache see the
    /// layer's picks and make its uploads (they land after the submitted work, before the
    /// next submission). The caller combines after this.
    pub fn cold_ffn(
        &self,
        pass: &mut Pass<'_>,
        cold: Option<Cold>,
        out: &wgpu::Buffer,
        n: u32,
        limit: Option<f32>,
    ) -> Result<()> {
        let Some(c) = cold else {
            return Ok(());
        };
        let gpu = pass.gpu();
        let li = self
            .info
            .layers
            .iter()
            .position(|m| m.layer == c.layer)
            .ok_or_else(|| Error::Invalid(format!("moe: layer {} is not a MoE layer", c.layer)))?;
        if !c.pairs.is_empty() {
            self.submit(pass)?;
            let mut experts: Vec<u32> = c.pairs.iter().map(|p| p.expert).collect();
            experts.sort_unstable();
            experts.dedup();
            let w = ExpertWeights::from_file_only(&self.file, &self.info.layers[li], &experts)?;
            let e = self.n_embd as usize;
            let mut rows = vec![0f32; c.pairs.len() * e];
            crate::cpu::moe::expert_rows(&w, &c.h, &c.pairs, limit, &mut rows)?;
            let index: Vec<u32> = c
                .pairs
                .iter()
                .map(|p| p.token * self.n_used + p.slot)
                .collect();
            gpu.write(&self.cold_rows, 0, bytemuck::cast_slice(&rows));
            gpu.write(&self.cold_index, 0, bytemuck::cast_slice(&index));
            scatter_rows(
                pass,
                &self.cold_rows,
                0,
                &self.cold_index,
                0,
                c.pairs.len() as u32,
                self.n_embd,
                out,
                0,
                self.n_embd,
                n * self.n_used,
            )?;
        }
        let mut st = self.state();
        st.cold_pairs += c.pairs.len() as u64;
        st.seen_pairs += c.ids.len() as u64;
        if let Some(s) = st.stats.as_mut() {
            s.record(c.layer, &c.ids);
        }
        let uploads = st.cache.observe(c.layer, &c.ids);
        for u in uploads {
            let m = self
                .info
                .layer(u.layer)
                .expect("the cache uploads experts of MoE layers");
            let w = ExpertWeights::from_file_only(&self.file, m, &[u.expert])?;
            let g = self.placement.layer(u.layer).expect("placed layer").group;
            self.arena.write_expert(gpu, g, u.slot, &w, u.expert)?;
            let r = st.cache.remap(u.layer).expect("cached layer");
            self.remaps.write(gpu, u.layer, r)?;
            if let Some((el, _)) = u.evicted.filter(|&(el, _)| el != u.layer) {
                let r = st.cache.remap(el).expect("cached layer");
                self.remaps.write(gpu, el, r)?;
            }
        }
        Ok(())
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

    pub fn report(&self) -> PlacementReport {
        let st = self.state();
        let mut hot = 0;
        let mut total = 0;
        for lp in &self.placement.layers {
            hot += st.cache.held(lp.layer).unwrap_or(0);
            total += lp.n_expert;
        }
        let hits = st.cache.hits();
        let (h, m) = hits
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
            cold_pairs: st.cold_pairs,
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
