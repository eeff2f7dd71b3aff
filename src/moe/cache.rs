//! Adaptive residency while decoding: which experts hold arena slots, as a pure host-side
//! policy (no GPU): [`ResidencyCache::observe`] sees each MoE layer's chosen experts and
//! answers with the uploads to make. The caller copies the bytes and rewrites the remap
//! tables (see the recipe in `moe/mod.rs`).
//!
//! Policy (measured on this project's earlier prototypes: a plain global LRU over (layer,
//! expert) under a layer-by-layer sweep hit 4.7%, equal per-layer LRUs ~70%):
//! - LRU with a per-layer floor: a layer never drops below `floor_share` of the slots the
//!   initial placement gave it; slots above floors are borrowed across the layers of one
//!   arena group, the least recently used slot of the layer itself or of a layer above its
//!   floor going first. A slot used during the current step is never evicted in that step.
//! - Upload only experts picked repeatedly: a cold expert is uploaded when it was also
//!   picked within the last `reuse_window` steps (or twice in this call, for a prefill
//!   batch); a first pick runs cold on the CPU, since an upload costs link time that a
//!   single use never repays.
//! - Admission (as TinyLFU): an upload that evicts must beat the victim on a pick count
//!   decayed with a half-life of `half_life` steps, so a burst of mid-popular experts cannot
//!   flush a steady working set (without it the bounded uploads churn every step).
//! - At most `max_uploads_per_step` uploads per step (token or prefill chunk).
//!
//! On the synthetic layer sweep of `tests/moe.rs` (Zipf-like routing with drift) this hits
//! 67% vs a global LRU's 59% with 25% of the experts in slots, 27% vs 13% with 5% (fewer
//! slots than picks per sweep), at 2-5% of the global LRU's uploads.
//!
//! Steps: a call whose layer number is not above the previous call's starts a new step, so a
//! forward that calls `observe` once per MoE layer in layer order needs no other signal.

use super::{Placement, COLD};

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

/// One expert to copy into the arena before the next submission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Upload {
    /// Model layer and expert whose bytes go into `slot` of the layer's arena group.
    pub layer: usize,
    pub expert: u32,
    pub slot: u32,
    /// The (layer, expert) that held the slot and is cold from now on.
    pub evicted: Option<(usize, u32)>,
}

/// Hit accounting of one layer, in routed (token, expert) pairs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerHits {
    pub layer: usize,
    pub hits: u64,
    pub misses: u64,
    pub uploads: u64,
    pub evictions: u64,
    /// Slots held now.
    pub slots: usize,
}

impl LayerHits {
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

#[derive(Clone, Debug)]
struct Slot {
    /// (MoE layer index, expert) held, if any.
    owner: Option<(usize, u32)>,
    /// Clock of the last use (upload or hit).
    last_use: u64,
}

#[derive(Clone, Debug)]
struct LayerState {
    layer: usize,
    group: usize,
    floor: usize,
    held: usize,
    remap: Vec<u32>,
    /// Step of the last pick + 1 (0: never picked).
    last_pick: Vec<u64>,
    /// Decayed pick count as of step `last_pick - 1`.
    score: Vec<f64>,
    hits: LayerHits,
}

/// The residency policy over a [`Placement`]'s arena.
#[derive(Clone, Debug)]
pub struct ResidencyCache {
    cfg: CacheConfig,
    groups: Vec<Vec<Slot>>,
    layers: Vec<LayerState>,
    step: u64,
    step_clock: u64,
    clock: u64,
    last_layer: Option<usize>,
    uploads_this_step: usize,
}

impl ResidencyCache {
    /// Start from `placement` (its hot experts resident, its slot counts the floors' base).
    pub fn new(placement: &Placement, cfg: CacheConfig) -> ResidencyCache {
        let mut groups: Vec<Vec<Slot>> = placement
            .groups
            .iter()
            .map(|g| {
                vec![
                    Slot {
                        owner: None,
                        last_use: 0
                    };
                    g.n_slots as usize
                ]
            })
            .collect();
        let mut layers = Vec::with_capacity(placement.layers.len());
        for (i, lp) in placement.layers.iter().enumerate() {
            for (e, s) in lp.hot() {
                groups[lp.group][s as usize].owner = Some((i, e));
            }
            let held = lp.n_slots();
            layers.push(LayerState {
                layer: lp.layer,
                group: lp.group,
                floor: (cfg.floor_share.clamp(0.0, 1.0) * held as f64).floor() as usize,
                held,
                remap: lp.remap.clone(),
                last_pick: vec![0; lp.n_expert],
                score: vec![0.0; lp.n_expert],
                hits: LayerHits {
                    layer: lp.layer,
                    slots: held,
                    ..Default::default()
                },
            });
        }
        ResidencyCache {
            cfg,
            groups,
            layers,
            step: 0,
            // Initial residents (last use 0) are evictable from the first step on.
            step_clock: 1,
            clock: 1,
            last_layer: None,
            uploads_this_step: 0,
        }
    }

    fn index(&self, layer: usize) -> Option<usize> {
        self.layers.iter().position(|l| l.layer == layer)
    }

    /// The remap table (`[n_expert]`: slot or [`COLD`]) of model layer `layer`.
    pub fn remap(&self, layer: usize) -> Option<&[u32]> {
        self.index(layer).map(|i| self.layers[i].remap.as_slice())
    }

    /// Steps seen so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Record the experts `layer` chose (`[n_tokens · n_used]` ids, any order; ids outside
    /// the layer's experts ignored) and return the uploads to make, in order. An unknown
    /// layer returns nothing.
    pub fn observe(&mut self, layer: usize, chosen: &[u32]) -> Vec<Upload> {
        let Some(li) = self.index(layer) else {
            return Vec::new();
        };
        if self.last_layer.is_some_and(|p| layer <= p) {
            self.step += 1;
            self.step_clock = self.clock;
            self.uploads_this_step = 0;
        }
        self.last_layer = Some(layer);
        let n_expert = self.layers[li].remap.len();
        // Picks per distinct expert in this call.
        let mut count = vec![0u32; n_expert];
        for &e in chosen.iter().filter(|&&e| (e as usize) < n_expert) {
            count[e as usize] += 1;
        }
        let picks: Vec<(u32, u32)> = (0..n_expert as u32)
            .map(|e| (e, count[e as usize]))
            .filter(|&(_, n)| n > 0)
            .collect();
        let mut misses: Vec<(u32, u32)> = Vec::new();
        for &(e, n) in &picks {
            let st = &mut self.layers[li];
            match st.remap[e as usize] {
                COLD => {
                    st.hits.misses += n as u64;
                    misses.push((e, n));
                }
                s => {
                    st.hits.hits += n as u64;
                    self.groups[st.group][s as usize].last_use = self.clock;
                    self.clock += 1;
                }
            }
        }
        // Repeated picks (before this call's picks are recorded), then the scores.
        let repeated: Vec<bool> = misses
            .iter()
            .map(|&(e, n)| {
                let last = self.layers[li].last_pick[e as usize];
                match self.cfg.reuse_window {
                    None => true,
                    Some(w) => n >= 2 || (last > 0 && self.step + 1 - last <= w),
                }
            })
            .collect();
        for &(e, n) in &picks {
            let s = self.score(li, e) + n as f64;
            let st = &mut self.layers[li];
            st.score[e as usize] = s;
            st.last_pick[e as usize] = self.step + 1;
        }
        // Most-picked misses first, then lower ids: the bounded uploads go where they pay.
        let mut order: Vec<usize> = (0..misses.len()).filter(|&i| repeated[i]).collect();
        order.sort_by(|&a, &b| {
            misses[b]
                .1
                .cmp(&misses[a].1)
                .then(misses[a].0.cmp(&misses[b].0))
        });
        let mut out = Vec::new();
        for i in order {
            if self.uploads_this_step >= self.cfg.max_uploads_per_step {
                break;
            }
            if let Some(u) = self.claim(li, misses[i].0) {
                self.uploads_this_step += 1;
                out.push(u);
            }
        }
        out
    }

    /// Decayed pick count of expert `e` of layer `li` now (0 without a half-life).
    fn score(&self, li: usize, e: u32) -> f64 {
        let Some(h) = self.cfg.half_life else {
            return 0.0;
        };
        let st = &self.layers[li];
        let last = st.last_pick[e as usize];
        if last == 0 {
            return 0.0;
        }
        let age = (self.step + 1 - last) as f64;
        st.score[e as usize] * (-age / h).exp2()
    }

    /// Give expert `e` of layer `li` a slot: a free one, else the least recently used slot
    /// (not used this step) of `li` itself or of a layer above its floor, when `e`'s decayed
    /// pick count beats its holder's.
    fn claim(&mut self, li: usize, e: u32) -> Option<Upload> {
        let g = self.layers[li].group;
        let mut best: Option<(u64, usize)> = None;
        for (s, slot) in self.groups[g].iter().enumerate() {
            let key = match slot.owner {
                None => 0,
                Some((o, _)) => {
                    let st = &self.layers[o];
                    if slot.last_use >= self.step_clock || (o != li && st.held <= st.floor) {
                        continue;
                    }
                    slot.last_use + 1
                }
            };
            if best.is_none_or(|(k, _)| key < k) {
                best = Some((key, s));
                if key == 0 {
                    break;
                }
            }
        }
        let (_, s) = best?;
        if let (Some((o, oe)), Some(_)) = (self.groups[g][s].owner, self.cfg.half_life) {
            if self.score(o, oe) >= self.score(li, e) {
                return None;
            }
        }
        let evicted = self.groups[g][s].owner.map(|(o, oe)| {
            let st = &mut self.layers[o];
            st.remap[oe as usize] = COLD;
            st.held -= 1;
            st.hits.evictions += 1;
            st.hits.slots = st.held;
            (st.layer, oe)
        });
        self.groups[g][s] = Slot {
            owner: Some((li, e)),
            last_use: self.clock,
        };
        self.clock += 1;
        let st = &mut self.layers[li];
        st.remap[e as usize] = s as u32;
        st.held += 1;
        st.hits.uploads += 1;
        st.hits.slots = st.held;
        Some(Upload {
            layer: st.layer,
            expert: e,
            slot: s as u32,
            evicted,
        })
    }

    /// Per-layer accounting, in MoE layer order.
    pub fn hits(&self) -> Vec<LayerHits> {
        self.layers.iter().map(|l| l.hits.clone()).collect()
    }

    /// Hits over all routed pairs so far.
    pub fn hit_rate(&self) -> f64 {
        let (h, m) = self.layers.iter().fold((0u64, 0u64), |(h, m), l| {
            (h + l.hits.hits, m + l.hits.misses)
        });
        if h + m == 0 {
            0.0
        } else {
            h as f64 / (h + m) as f64
        }
    }

    /// Slots model layer `layer` holds now.
    pub fn held(&self, layer: usize) -> Option<usize> {
        self.index(layer).map(|i| self.layers[i].held)
    }

    /// Its floor.
    pub fn floor(&self, layer: usize) -> Option<usize> {
        self.index(layer).map(|i| self.layers[i].floor)
    }

    /// Total uploads so far.
    pub fn uploads(&self) -> u64 {
        self.layers.iter().map(|l| l.hits.uploads).sum()
    }
}
