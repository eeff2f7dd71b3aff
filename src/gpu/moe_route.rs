//! The routing list of a MoE product: below the products that read it (`matmul.rs`, the
//! matrix-unit `coopmat.rs`) and the kernel that fills it (`matmul::route`).

use super::{Gpu, GpuTensor};
use crate::{Error, Result};

/// Pairs per tile of the route (the `BN` token tile of matmul.wgsl's routed kernels).
pub(super) const TILE_PAIRS: u32 = 64;

/// The routing list of one MoE layer's batch on the GPU: which (token, slot) pairs chose each
/// expert, grouped into tiles of 64 pairs. One u32 buffer; layout in matmul.wgsl (`route`):
/// `[n_tiles, count[E], start[E+1], tiles[ceil(max_pairs/64)+E], pairs[max_pairs]]`.
/// Made once per (n_expert, largest batch) and refilled by [`route`](super::matmul::route) for every batch.
pub struct MoeRoute {
    pub buffer: wgpu::Buffer,
    pub n_expert: u32,
    pub max_pairs: u32,
    tiles_off: u32,
    pairs_off: u32,
}

impl MoeRoute {
    pub fn new(gpu: &Gpu, n_expert: u32, max_pairs: u32) -> Result<MoeRoute> {
        if n_expert == 0 || n_expert > 1 << 16 || max_pairs == 0 {
            return Err(Error::Invalid(format!(
                "moe route: {n_expert} experts (1..=65536), {max_pairs} pairs"
            )));
        }
        let (tiles_off, pairs_off) = Self::offsets(n_expert, max_pairs);
        let buffer = gpu.buffer(Self::bytes(n_expert, max_pairs), "moe_route")?;
        Ok(MoeRoute {
            buffer,
            n_expert,
            max_pairs,
            tiles_off,
            pairs_off,
        })
    }

    /// Word offsets of the tile list and the pair list in the buffer.
    fn offsets(n_expert: u32, max_pairs: u32) -> (u32, u32) {
        let tiles_off = 2 + 2 * n_expert;
        let max_tiles = max_pairs.div_ceil(TILE_PAIRS) + n_expert;
        (tiles_off, tiles_off + max_tiles)
    }

    /// Bytes of the buffer [`MoeRoute::new`] makes (for memory budgets).
    pub fn bytes(n_expert: u32, max_pairs: u32) -> u64 {
        (Self::offsets(n_expert, max_pairs).1 as u64 + max_pairs as u64) * 4
    }

    /// The pairs of `n_tokens` x `n_used` for the stacked weight `w`, checked against what
    /// this route was made for.
    pub(crate) fn check(&self, w: &GpuTensor, n_tokens: u32, n_used: u32) -> Result<u32> {
        if w.shape[0] != self.n_expert as u64 {
            return Err(Error::Invalid(format!(
                "{}: {} experts, route made for {}",
                w.name, w.shape[0], self.n_expert
            )));
        }
        let n_pairs = n_tokens as u64 * n_used as u64;
        if n_pairs == 0 || n_pairs > self.max_pairs as u64 {
            return Err(Error::Invalid(format!(
                "{}: {n_tokens} tokens x {n_used} slots, route made for {} pairs",
                w.name, self.max_pairs
            )));
        }
        Ok(n_pairs as u32)
    }

    /// Upper bound on the tile count for `n_pairs` pairs (the matmul_id grid height).
    pub(crate) fn max_tiles(&self, n_pairs: u32) -> u32 {
        n_pairs.div_ceil(TILE_PAIRS) + self.n_expert
    }

    /// Word of the tile list in the route buffer.
    pub(crate) fn tiles_off(&self) -> u32 {
        self.tiles_off
    }

    /// Word of the grouped pair list in the route buffer.
    pub(crate) fn pairs_off(&self) -> u32 {
        self.pairs_off
    }
}

/// The (token, slot) pairs of a routed product over a [`MoeRoute`] filled by [`super::matmul::route`] for
/// them: pair `q = t · n_used + s` for token `t < n_tokens`, slot `s < n_used`; its x row the
/// token's or its own (`x_per_pair`, as [`super::matvec::Pairs`]).
#[derive(Clone, Copy)]
pub struct RoutePairs<'a> {
    pub route: &'a MoeRoute,
    pub n_tokens: u32,
    pub n_used: u32,
    pub x_per_pair: bool,
}
