//! The offload at run time: [`Plan`] places a model's experts at load (before any upload),
//! [`Offload`] runs the recipe of `moe/mod.rs` in the forwards over the GPU's arena and remap
//! kernels (`gpu::moe`) and the CPU's cold path (`cpu::moe`). The arena and tables are filled
//! from a [`Placement`] here, so the kernel layer knows slots, not plans.

use super::{
    budget_for, cold_pairs, AdapterMemory, Budget, ExpertStats, ExpertWeights, Fill, MemSource,
    MoeInfo, Needs, Placement, ResidencyCache, COLD,
};
use crate::cpu::moe::ColdPair;
use crate::forward::LoadOptions;
use crate::gpu::matmul::MoeRoute;
use crate::gpu::moe::{
    map_read, remap, routed_ffn, scatter_rows, ExpertArena, ExpertStacks, FfnBufs, Picks,
    RemapTables,
};
use crate::gpu::{check_len, Gpu, Pass};
use crate::model_file::ModelFile;
use crate::{Error, Result};
use std::sync::Mutex;

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
}

impl Plan {
    /// The placement of `file`'s experts under `opts` (`--gpu-experts`, else the budget of
    /// `--gpu-mem` or the detected adapter memory; `--expert-stats` chooses which experts).
    /// `None` for a model without routed experts, and when every expert has a slot and no
    /// statistics are collected: the forward then keeps its per-layer expert stacks and one
    /// pass per token, exactly as without a planner.
    /// `needs`: what the model's family needs beside its weights for the run of `opts`
    /// (KV, state, activations; its `needs` function).
    pub fn new(
        gpu: &Gpu,
        file: &ModelFile,
        opts: &LoadOptions,
        needs: &Needs,
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
                let b = budget_for(&info, mem.bytes, opts.ctx as u64, needs);
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
        let arena = new_arena(gpu, &placement)?;
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
        check_len("moe", "readback ids", ids, nk as u64)?;
        check_len("moe", "readback rows", h, (n * self.n_embd) as u64)?;
        pass.copy(ids, 0, &self.staging, 0, ilen);
        pass.copy(h, 0, &self.staging, ilen, xlen);
        self.submit(pass)?;
        let (ids_v, h_v) = map_read(gpu, &self.staging, ilen, xlen)?;
        let pairs = {
            let st = self.state();
            let table = st.cache.remap(layer).unwrap_or(&[]);
            cold_pairs(table, &ids_v, self.n_used as usize)
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
        routed_ffn(pass, &stacks, x, &picks, b, limit)
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
            write_expert(&self.arena, gpu, g, u.slot, &w, u.expert)?;
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
