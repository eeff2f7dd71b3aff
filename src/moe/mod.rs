//! MoE models bigger than VRAM: a model-wide arena of expert slots on the GPU, cold experts
//! on the CPU straight from the mmap, and the policy that decides which are which.
//!
//! Pieces:
//! - [`layout`]: the experts of a model file ([`MoeInfo`]) and their stored bytes
//!   ([`ExpertWeights`]).
//! - [`budget`]: adapter memory ([`AdapterMemory`], `--gpu-mem`), what the model needs
//!   beside its experts, and the bytes left for slots ([`Budget`]).
//! - [`plan`]: the arena's groups and each layer's slots and remap table ([`Placement`]),
//!   the expected traffic of a decode step.
//! - [`stats`]: routing statistics, written by `--save-expert-stats`, read by the planner.
//! - [`cache`]: adaptive residency while decoding ([`ResidencyCache`]).
//! - GPU side: `gpu::moe` ([`crate::gpu::moe::ExpertArena`], [`crate::gpu::moe::RemapTables`],
//!   the remap / scatter kernels, the one readback); CPU side: `cpu::moe` (cold experts).
//! - [`offload`], in the forwards: [`Plan`] decides at load (before any upload) whether
//!   the model needs the arena at all; [`Offload`] is the recipe below as
//!   four calls per MoE layer (`route`, `hot_ffn`, the model's shared expert, `cold_ffn`,
//!   the model's combine), used by `models::qwen35::gpu` and `models::deepseek4::gpu`.
//!   When every expert has a slot and no statistics are counted, there is no offload: the
//!   layers keep their expert stacks and the forward stays one pass per token.
//!
//! The router always ranges over all experts: residency changes speed, never the selection.
//!
//! # Summation contract
//! Per token t the routed output is `Σ_{s=0}^{n_used-1} w[t,s] · y[t,s]`, summed in top-k
//! slot order s (the order the router wrote the ids), where `y[t,s]` is the UNWEIGHTED output
//! of expert `ids[t,s]` for token t. The GPU holds `y` in its per-pair buffer `moe_out`
//! `[n_tokens · n_used, n_embd]` (row `t·n_used + s`): hot pairs are written there by the
//! indexed matvec on the arena, cold pairs by [`crate::gpu::moe::scatter_rows`] from the
//! CPU's rows (computed with weight 1). The weighted sum then runs on the GPU exactly as for
//! an all-GPU model (one combine dispatch adding slot s = 0, 1, ... in order per row). So a
//! mixed placement differs from an all-GPU one only by the rounding of the individual
//! `y[t,s]` computed on the CPU (`quant::dot`, f32 accumulation) instead of the GPU; the
//! order and the arithmetic of the sum are the same. `cpu::moe::combine_slots` is the CPU statement of the same sum.
//!
//! # Integration recipe (one MoE layer of a forward)
//! At load:
//! 1. `info = MoeInfo::from_file(&file, names)` with the family's `names`; `mem = AdapterMemory::detect(&gpu.info, gpu_mem)`;
//!    `budget = budget_for(&info, mem.bytes, ctx, &needs)` with the family's `needs` for
//!    the run (`lathe plan` gets the same numbers through `models::model_budget`). Upload
//!    the non-expert weights (the output head first: every token reads it) before the arena
//!    claims memory.
//! 2. `placement = Placement::new(&info, Fill::Budget(budget.experts), stats.as_ref())`, or
//!    `Fill::Fraction(f)` for `--gpu-experts f`.
//! 3. `weights[i] = ExpertWeights::from_file(&file, info.names, &info.layers[i])` (borrows the mmap;
//!    DeepSeek's block-scaled release experts are repacked as they are read);
//!    `arena = new_arena(&gpu, &placement)`; `fill_arena(&arena, &gpu, &placement, &weights,
//!    report)`; `remaps = remap_tables(&gpu, &placement)`;
//!    `cache = ResidencyCache::new(&placement, CacheConfig::default())`.
//!
//! Scratch beyond the usual: `slot_ids` u32 `[rows · n_used]`, `cold_rows` f32
//! `[rows · n_used, n_embd]`, `cold_index` u32 `[rows · n_used]`.
//!
//! Per MoE layer L, `n` tokens, `k = n_used`, `g = placement.layer(L).group`:
//! 4. In the forward's pass: router matvec → `topk::router_softmax_topk` → `moe_ids` u32
//!    `[n, k]` and `moe_w` f32 `[n, k]` as today, then `gpu::moe::remap(pass, &remaps, L,
//!    moe_ids, slot_ids, n·k)`.
//! 5. Only if the layer has cold experts now (`cache.remap(L)` holds a `COLD`): submit the
//!    pass, then `(ids, h) = gpu::moe::read_back(&gpu, (&moe_ids, 0, n·k), (&h, 0,
//!    n·n_embd))`: the ONE readback of this layer (chosen ids and FFN input rows, one
//!    staging buffer, one wait); `pairs = cold_pairs(cache.remap(L), &ids, k)`. Continue
//!    recording into a new pass.
//! 6. `gpu::moe::routed_ffn` (the block the stacked path uses too; with a `MoeRoute` made
//!    for `n_expert = placement.groups[g].n_slots`, one per group) on `arena.group(g)`'s
//!    gate / up / down, reading `slot_ids` instead of `moe_ids`: cold pairs write nothing.
//!    The shared expert into its own buffer as today. With cold pairs, submit this pass now
//!    so the GPU runs the hot experts while the CPU runs the cold ones (step 7).
//! 7. With cold pairs: `cpu::moe::expert_rows_with(&weights[i], &h, &pairs, limit, &cold,
//!    &mut rows)` (rayon, the workers kept awake through the wait of step 5 by
//!    `cpu::moe::Warm`; each cold expert read once for all the batch's tokens; `cold`: the
//!    activations as the GPU's and the `--cpu-simd` level); `gpu.write` `rows` to
//!    `cold_rows` and `token·k + slot` of each pair to `cold_index` (ordered before the next
//!    submission); in the next pass `scatter_rows(pass, cold_rows, cold_index,
//!    pairs.len(), n_embd, moe_out, n·k)`. Then the unchanged combine: one
//!    dispatch that adds the top-k slots in order per row (`ew::moe_combine`,
//!    `router::combine`), the shared expert added after.
//!    `cold_ffn`'s `after` lets the model record the combine and the next layer up to its
//!    router on a rayon worker while the host thread computes the cold rows; that pass is
//!    encoded there and submitted as soon as the rows are written (queue order keeps the
//!    scatter before the combine).
//!    A prompt whose cold experts may stream runs in longer passes (`Plan::rows`, up to
//!    `offload::STREAM_ROWS`, bounded by the budget), so each selected cold expert crosses
//!    the link once per pass.
//! 8. `for u in cache.observe(L, &ids)`: `write_expert(&arena, &gpu, g, u.slot,
//!    &weights[index of u.layer], u.expert)`; then `remaps.write(&gpu, L', cache.remap(L'))`
//!    for `u.layer` and for `u.evicted`'s layer. These writes land before the next
//!    submission and after the work already submitted (queue order): kernels in flight see
//!    the old arena and tables, later layers the new ones, consistently with the host copy
//!    `cache.remap` that step 5 reads. With `--save-expert-stats`, `ExpertStats::record(L,
//!    &ids)` here (a layer without cold experts skips step 5: read its ids at the end of the
//!    token instead, or record only while some experts are cold).
//!
//! A model whose experts all have slots never takes step 5, 7 or 8 and stays one pass per
//! token; the remap is then a fixed permutation.
//!
//! Decide placement before any state advances: a layer that declines half-way and falls
//! back must not advance caches twice.

pub mod budget;
pub mod cache;
pub mod layout;
pub mod offload;
pub mod plan;
pub mod policy;
pub mod stats;
pub mod timeline;

pub use crate::cpu::moe::ColdPair;
pub use budget::{
    budget_for, parse_size, AdapterMemory, Budget, BudgetInputs, MemSource, Needs, RunShape,
};
pub use cache::{CacheConfig, LayerHits, ResidencyCache, Upload};
pub use layout::{
    EachExpert, ExpertMats, ExpertNames, ExpertWeights, FusedStacks, Kind, MatShape, MoeInfo,
    MoeLayerInfo,
};
pub use offload::{
    fill_arena, new_arena, remap_tables, write_expert, Offload, PlacementReport, Plan,
};
pub use plan::{remap_ids, ArenaGroup, Costs, Fill, LayerPlacement, LayerTraffic, Placement};
pub use policy::{ColdLayers, ExpertStream};
pub use stats::{ExpertStats, LayerStats};
pub use timeline::LayerTimes;

/// Remap-table entry and slot id of an expert without a slot. The indexed matvec writes
/// nothing for ids at or above the arena's slot count, so a cold pair is skipped on the GPU.
pub const COLD: u32 = u32::MAX;

/// The pairs of `ids` (`[n_tokens, n_used]`, as the router wrote them) whose expert is cold
/// in `remap`, in pair order, with weight 1. Ids outside the table (padding) are skipped:
/// they have no expert to run.
pub fn cold_pairs(remap: &[u32], ids: &[u32], n_used: usize) -> Vec<ColdPair> {
    let k = n_used.max(1);
    ids.iter()
        .enumerate()
        .filter(|(_, &e)| remap.get(e as usize) == Some(&COLD))
        .map(|(q, &e)| ColdPair {
            token: (q / k) as u32,
            slot: (q % k) as u32,
            expert: e,
            weight: 1.0,
        })
        .collect()
}
