//! Placement: how many arena slots each MoE layer gets and which experts fill them.
//!
//! The arena is model-wide: one [`ArenaGroup`] per distinct expert signature (the stored
//! type and shape of gate, up and down), usually one for the whole model; llama.cpp's
//! Q4_K_M files give `ffn_down_exps` Q6_K on some layers and Q4_K on others, hence two. A
//! slot holds one expert's three matrices; slot `s` of a group is matrix `s` of each of the
//! group's three GPU tensors `[n_slots, rows, cols]`, so the existing indexed matvec reads
//! the arena with slot ids in place of expert ids. Each layer's remap table (`u32
//! [n_expert]`: slot, or [`COLD`]) says where its experts are.
//!
//! Filling ([`Placement::new`]):
//! - `Fill::Fraction(f)`: every layer gets `round(f · n_expert)` slots (`--gpu-experts`),
//!   whatever the budget says.
//! - `Fill::Budget(bytes)` without statistics: spread evenly, layer by layer, each taking
//!   `remaining budget / remaining layers` (a greedy pack would give early layers everything
//!   and starve the tail); slots a capped layer cannot use pass to the layers after it, and
//!   what rounding leaves is handed out one slot per layer in turn.
//! - `Fill::Budget(bytes)` with statistics: experts are taken in decreasing expected picks
//!   per token (over all layers: a slot saves `p · expert_bytes` host bytes per token at a
//!   cost of `expert_bytes`, so `p` is the value per byte), skipping those that no longer
//!   fit; the budget left after every expert seen in the statistics is spread evenly as
//!   above over the rest.
//!   Within a layer, hot experts are the most picked (statistics) or the lowest ids.

use super::{ExpertStats, MatShape, MoeInfo, MoeLayerInfo, COLD};
use crate::{Error, Result};

/// How to size the arena.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fill {
    /// Bytes for expert slots ([`super::Budget::experts`]).
    Budget(u64),
    /// Share of each layer's experts given slots (0..=1).
    Fraction(f64),
}

/// Slots of one expert signature.
#[derive(Clone, Debug, PartialEq)]
pub struct ArenaGroup {
    /// gate, up, down of one expert.
    pub shapes: [MatShape; 3],
    pub n_slots: u32,
    /// Model layers whose experts live here.
    pub layers: Vec<usize>,
}

impl ArenaGroup {
    pub fn slot_bytes(&self) -> u64 {
        self.shapes.iter().map(MatShape::bytes).sum()
    }
    pub fn bytes(&self) -> u64 {
        self.slot_bytes() * self.n_slots as u64
    }
}

/// One MoE layer's share of the arena.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerPlacement {
    pub layer: usize,
    pub n_expert: usize,
    /// Index into [`Placement::groups`].
    pub group: usize,
    /// `[n_expert]`: the slot of each expert in its group, or [`COLD`].
    pub remap: Vec<u32>,
}

impl LayerPlacement {
    /// (expert, slot) of the hot experts, by expert id.
    pub fn hot(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.remap
            .iter()
            .enumerate()
            .filter(|(_, &s)| s != COLD)
            .map(|(e, &s)| (e as u32, s))
    }
    pub fn n_slots(&self) -> usize {
        self.remap.iter().filter(|&&s| s != COLD).count()
    }
}

/// The whole model's placement.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    pub groups: Vec<ArenaGroup>,
    /// One per MoE layer, in [`MoeInfo::layers`] order.
    pub layers: Vec<LayerPlacement>,
}

/// Expected picks per token of each expert of `m`: from the statistics when they cover the
/// layer, else uniform `n_used / n_expert`.
pub fn picks_per_token(m: &MoeLayerInfo, n_used: usize, stats: Option<&ExpertStats>) -> Vec<f64> {
    match stats.and_then(|s| s.layer(m.layer)) {
        Some(l) if l.tokens > 0 && l.counts.len() == m.n_expert => {
            (0..m.n_expert).map(|e| l.picks_per_token(e)).collect()
        }
        _ => vec![n_used as f64 / m.n_expert as f64; m.n_expert],
    }
}

/// Even spread of `budget` over layers with per-layer slot costs and capacities: each next
/// slot goes to the layer holding the fewest bytes that can still take one (water-filling).
/// With equal costs this is "the remaining budget divided by the remaining layers"; with
/// unequal ones (Q6_K vs Q4_K down tensors) it keeps per-layer bytes within one slot of each
/// other, where a single pass in layer order would hand every rounding remainder to the
/// last layers. Adds to `count`; returns the bytes left.
fn spread_even(budget: u64, cost: &[u64], cap: &[usize], count: &mut [usize]) -> u64 {
    use std::cmp::Reverse;
    let mut left = budget;
    let mut heap: std::collections::BinaryHeap<Reverse<(u64, usize)>> = (0..cost.len())
        .filter(|&i| count[i] < cap[i])
        .map(|i| Reverse((count[i] as u64 * cost[i], i)))
        .collect();
    while let Some(Reverse((bytes, i))) = heap.pop() {
        // `left` only shrinks: a layer that cannot pay now never can.
        if cost[i] > left {
            continue;
        }
        count[i] += 1;
        left -= cost[i];
        if count[i] < cap[i] {
            heap.push(Reverse((bytes + cost[i], i)));
        }
    }
    left
}

/// Experts of a layer in the order they get slots: most picked first, then lowest id.
fn preference(p: &[f64]) -> Vec<usize> {
    let mut v: Vec<usize> = (0..p.len()).collect();
    v.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    v
}

impl Placement {
    pub fn new(info: &MoeInfo, fill: Fill, stats: Option<&ExpertStats>) -> Result<Placement> {
        let nl = info.layers.len();
        let p: Vec<Vec<f64>> = info
            .layers
            .iter()
            .map(|m| picks_per_token(m, info.n_used, stats))
            .collect();
        let has_stats = |i: usize| {
            stats
                .and_then(|s| s.layer(info.layers[i].layer))
                .is_some_and(|l| l.tokens > 0 && l.counts.len() == info.layers[i].n_expert)
        };
        // hot[i][e]: expert e of layer i gets a slot.
        let mut hot: Vec<Vec<bool>> = info
            .layers
            .iter()
            .map(|m| vec![false; m.n_expert])
            .collect();
        match fill {
            Fill::Fraction(f) => {
                if !(0.0..=1.0).contains(&f) {
                    return Err(Error::Invalid(format!(
                        "--gpu-experts {f}: a share between 0 and 1"
                    )));
                }
                for (i, m) in info.layers.iter().enumerate() {
                    let k = (f * m.n_expert as f64).round() as usize;
                    for &e in preference(&p[i]).iter().take(k) {
                        hot[i][e] = true;
                    }
                }
            }
            Fill::Budget(budget) => {
                let cost: Vec<u64> = info.layers.iter().map(|m| m.expert_bytes()).collect();
                let mut left = budget;
                // 1. Experts the statistics saw, most picked first, over all layers.
                let mut ranked: Vec<(f64, usize, usize)> = Vec::new();
                for i in (0..nl).filter(|&i| has_stats(i)) {
                    for (e, &pe) in p[i].iter().enumerate() {
                        if pe > 0.0 {
                            ranked.push((pe, i, e));
                        }
                    }
                }
                ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
                for &(_, i, e) in &ranked {
                    if cost[i] <= left {
                        hot[i][e] = true;
                        left -= cost[i];
                    }
                }
                // 2. The rest evenly over layers (all of it without statistics).
                let cap: Vec<usize> = hot
                    .iter()
                    .map(|h| h.iter().filter(|&&x| !x).count())
                    .collect();
                let mut extra = vec![0usize; nl];
                spread_even(left, &cost, &cap, &mut extra);
                for i in 0..nl {
                    let order = preference(&p[i]);
                    for &e in order
                        .iter()
                        .filter(|&&e| !hot[i][e])
                        .take(extra[i])
                        .collect::<Vec<_>>()
                    {
                        hot[i][e] = true;
                    }
                }
            }
        }
        Placement::from_hot(info, &hot)
    }

    /// The placement whose hot experts are `hot[i][e]` (layer i of `info.layers`, expert e):
    /// groups by signature, in first-layer order; slots per layer contiguous, by expert id.
    pub fn from_hot(info: &MoeInfo, hot: &[Vec<bool>]) -> Result<Placement> {
        let nl = info.layers.len();
        assert_eq!(hot.len(), nl, "one row of hot flags per MoE layer");
        let mut groups: Vec<ArenaGroup> = Vec::new();
        let mut layers = Vec::with_capacity(nl);
        for (i, m) in info.layers.iter().enumerate() {
            let g = match groups.iter().position(|g| g.shapes == m.shapes()) {
                Some(g) => g,
                None => {
                    groups.push(ArenaGroup {
                        shapes: m.shapes(),
                        n_slots: 0,
                        layers: Vec::new(),
                    });
                    groups.len() - 1
                }
            };
            let grp = &mut groups[g];
            grp.layers.push(m.layer);
            let mut remap = vec![COLD; m.n_expert];
            for (e, _) in hot[i].iter().enumerate().filter(|(_, &h)| h) {
                remap[e] = grp.n_slots;
                grp.n_slots = grp
                    .n_slots
                    .checked_add(1)
                    .ok_or_else(|| Error::Invalid("more than 2^32 expert slots".into()))?;
            }
            layers.push(LayerPlacement {
                layer: m.layer,
                n_expert: m.n_expert,
                group: g,
                remap,
            });
        }
        Ok(Placement { groups, layers })
    }

    /// Whole layers hot, from the last MoE layer down, while `fill` lasts (bytes; under
    /// `Fill::Fraction(f)`, f of all expert bytes); the first layer that does not fit whole
    /// takes what is left as its most picked experts (the one mixed layer), the layers
    /// before it stay all cold, as llama.cpp's `-ncmoe N` keeps the first N layers' experts
    /// on the CPU. Fewer layers with cold experts: fewer GPU → CPU → GPU hops per token.
    pub fn whole_layers(
        info: &MoeInfo,
        fill: Fill,
        stats: Option<&ExpertStats>,
    ) -> Result<Placement> {
        let all: u64 = info
            .layers
            .iter()
            .map(|m| m.expert_bytes() * m.n_expert as u64)
            .sum();
        let mut left = match fill {
            Fill::Budget(b) => b,
            Fill::Fraction(f) if (0.0..=1.0).contains(&f) => (f * all as f64).round() as u64,
            Fill::Fraction(f) => {
                return Err(Error::Invalid(format!(
                    "--gpu-experts {f}: a share between 0 and 1"
                )))
            }
        };
        let mut hot: Vec<Vec<bool>> = info
            .layers
            .iter()
            .map(|m| vec![false; m.n_expert])
            .collect();
        for (i, m) in info.layers.iter().enumerate().rev() {
            let eb = m.expert_bytes().max(1);
            let n = ((left / eb) as usize).min(m.n_expert);
            let p = picks_per_token(m, info.n_used, stats);
            for &e in preference(&p).iter().take(n) {
                hot[i][e] = true;
            }
            left -= n as u64 * eb;
            if n < m.n_expert {
                break;
            }
        }
        Placement::from_hot(info, &hot)
    }

    /// Expected seconds of the routed experts of one decode step under `c`: per MoE layer the
    /// hot experts' bytes at VRAM speed and, when it has cold picks, one hop plus the
    /// slower of the CPU's cold experts (host bytes at the CPU's speed) and the GPU's hot
    /// ones, which overlap. What `--cold-layers auto` compares.
    pub fn decode_seconds(&self, info: &MoeInfo, stats: Option<&ExpertStats>, c: &Costs) -> f64 {
        self.traffic(info, stats)
            .iter()
            .map(|t| {
                let gpu = t.vram_bytes / c.vram_bytes_per_s;
                if t.cold_picks > 1e-9 {
                    c.hop_s + (t.host_bytes / c.host_bytes_per_s).max(gpu)
                } else {
                    gpu
                }
            })
            .sum()
    }

    /// The placement of model layer `layer`.
    pub fn layer(&self, layer: usize) -> Option<&LayerPlacement> {
        self.layers.iter().find(|l| l.layer == layer)
    }

    /// Bytes of the whole arena.
    pub fn arena_bytes(&self) -> u64 {
        self.groups.iter().map(ArenaGroup::bytes).sum()
    }

    /// Expected expert traffic of one decode step (one token) per layer: each picked expert's
    /// bytes are read once, from VRAM when it has a slot, from host memory when not.
    pub fn traffic(&self, info: &MoeInfo, stats: Option<&ExpertStats>) -> Vec<LayerTraffic> {
        self.layers
            .iter()
            .zip(&info.layers)
            .map(|(lp, m)| {
                let p = picks_per_token(m, info.n_used, stats);
                let hot: f64 = lp.hot().map(|(e, _)| p[e as usize]).sum();
                let all: f64 = p.iter().sum();
                let eb = m.expert_bytes() as f64;
                LayerTraffic {
                    layer: m.layer,
                    hot_picks: hot,
                    cold_picks: (all - hot).max(0.0),
                    vram_bytes: hot * eb,
                    host_bytes: (all - hot).max(0.0) * eb,
                }
            })
            .collect()
    }
}

/// The costs the planner weighs between placements.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// One MoE layer's GPU → CPU → GPU round trip in a decode step (readback, wake-up, the
    /// rows' upload and the next submission): 0.25 ms measured on the H200 (issue 15).
    pub hop_s: f64,
    /// Expert bytes per second the CPU's cold path gets through (host memory bandwidth as
    /// the quantised dot products reach it; `lathe plan --host-bw`).
    pub host_bytes_per_s: f64,
    /// Expert bytes per second the GPU reads (`lathe plan --vram-bw`).
    pub vram_bytes_per_s: f64,
}

impl Default for Costs {
    /// The H200 machine of the issue: 0.25 ms hops, 20 GB/s on 16 cores, 4 TB/s VRAM.
    fn default() -> Self {
        Costs {
            hop_s: 0.25e-3,
            host_bytes_per_s: 20e9,
            vram_bytes_per_s: 4000e9,
        }
    }
}

/// Expected per-token expert reads of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerTraffic {
    pub layer: usize,
    /// Expected picks per token that hit a slot / run on the CPU (sum = n_used).
    pub hot_picks: f64,
    pub cold_picks: f64,
    pub vram_bytes: f64,
    pub host_bytes: f64,
}

/// The GPU remap kernel's CPU reference: `ids` → slot ids (`COLD` for cold experts and for
/// ids outside the table).
pub fn remap_ids(remap: &[u32], ids: &[u32]) -> Vec<u32> {
    ids.iter()
        .map(|&e| remap.get(e as usize).copied().unwrap_or(COLD))
        .collect()
}

/// For a prefill batch: whether streaming one cold expert over the host link (then running it
/// on the GPU) beats the CPU. The CPU reads the expert once per batch but computes every
/// pair: `n_pairs · n_params / cpu_params_per_s`; the link moves `bytes / link_bytes_per_s`
/// once. `cpu_params_per_s` is the whole CPU's quantised dot rate (e.g. 16 cores at ~2.5e9
/// weights/s each for Q4_K, `quant::dot`'s measured 0.3-0.5 ns per weight per core).
pub fn stream_beats_cpu(
    m: &MoeLayerInfo,
    n_pairs: usize,
    link_bytes_per_s: f64,
    cpu_params_per_s: f64,
) -> bool {
    let params = (3 * m.n_ff() * m.n_embd()) as f64;
    let cpu = n_pairs as f64 * params / cpu_params_per_s;
    let link = m.expert_bytes() as f64 / link_bytes_per_s;
    link < cpu
}
