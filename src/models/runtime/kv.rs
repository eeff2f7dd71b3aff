//! The KV pools of a family's attention blocks, written once: per block its K and V rows
//! for every sequence slot (slot `s` owns rows `s·cap ..`), grown by doubling; the free
//! list of slots, a sequence's slot (freed when dropped), and copies of a sequence's rows
//! slot to slot.

use super::state::{copy_regions, Region};
use crate::gpu::attention::KvShape;
use crate::gpu::{Gpu, Pass};
use crate::{Error, Result};
use std::sync::{Arc, Mutex};

/// One block's K and V rows for all sequence slots.
pub struct Pool {
    pub shape: KvShape,
    /// Rows per slot; grows by doubling (copied on the GPU). Per block: near the binding
    /// limit, blocks of different geometry fit different counts.
    pub cap: usize,
    /// (K, V) `[slots·cap, n_head_kv, head_dim]`.
    pub kv: (wgpu::Buffer, wgpu::Buffer),
}

/// Every block's pool and the slots' free list.
pub struct Pools {
    pub slots: usize,
    pub blocks: Vec<Pool>,
    free: Arc<Mutex<Vec<u32>>>,
    /// Names the buffers: `{label}.k`, `{label}.v`.
    label: &'static str,
}

/// A sequence's slot of the pools; dropping it frees the slot.
pub struct Slot {
    pub index: u32,
    free: Arc<Mutex<Vec<u32>>>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.index);
    }
}

impl Pools {
    /// A pool of `cap` rows per slot for each block's `shapes`, for `slots` sequences.
    pub fn new(
        gpu: &Gpu,
        shapes: impl IntoIterator<Item = KvShape>,
        slots: usize,
        cap: usize,
        label: &'static str,
    ) -> Result<Pools> {
        let rows = (slots * cap) as u64;
        let (k, v) = (format!("{label}.k"), format!("{label}.v"));
        let blocks = shapes
            .into_iter()
            .map(|shape| {
                Ok(Pool {
                    shape,
                    cap,
                    kv: (
                        gpu.buffer(shape.bytes(rows), &k)?,
                        gpu.buffer(shape.bytes(rows), &v)?,
                    ),
                })
            })
            .collect::<Result<_>>()?;
        Ok(Pools {
            slots,
            blocks,
            // Popped from the end: slot 0 first.
            free: Arc::new(Mutex::new((0..slots as u32).rev().collect())),
            label,
        })
    }

    /// Grow every block's rows per slot to at least `need` (doubling; old rows copied on the
    /// GPU).
    pub fn reserve(&mut self, pass: &mut Pass<'_>, need: usize) -> Result<()> {
        for p in &mut self.blocks {
            if need > p.cap {
                let kv = std::iter::once(&mut p.kv);
                p.cap = p
                    .shape
                    .grow_pools(pass, kv, self.slots, p.cap, need, self.label)?;
            }
        }
        Ok(())
    }

    /// Positions per sequence every block's pool can grow to ([`KvShape::max_positions`]).
    pub fn max_positions(&self, gpu: &Gpu) -> usize {
        self.blocks
            .iter()
            .map(|p| p.shape.max_positions(gpu, self.slots))
            .min()
            .unwrap_or(0)
    }

    /// A free slot, or an error when every one is in use.
    pub fn take_slot(&self) -> Result<Slot> {
        let index = self
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "all {} sequence slots are in use (raise LoadOptions::max_seqs / --parallel)",
                    self.slots
                ))
            })?;
        Ok(Slot {
            index,
            free: self.free.clone(),
        })
    }

    /// Make slot `to` hold slot `from`'s rows `[0, pos)` in every block ([`copy_regions`]).
    pub fn copy_rows(&self, gpu: &Gpu, from: &Slot, to: &Slot, pos: usize) -> Result<()> {
        let regions: Vec<Region<'_>> = self
            .blocks
            .iter()
            .flat_map(|p| {
                let (cap, s) = (p.cap as u64, p.shape);
                let (a, b, len) = (
                    s.bytes(from.index as u64 * cap),
                    s.bytes(to.index as u64 * cap),
                    s.bytes(pos as u64),
                );
                [(&p.kv.0, a, b, len), (&p.kv.1, a, b, len)]
            })
            .collect();
        copy_regions(gpu, &regions, &format!("{}.copy_stage", self.label))
    }
}

/// KV rows per sequence the pools start with for a context of `ctx` (doubling from there,
/// up to [`KvShape::max_positions`]).
pub fn first_cap(ctx: usize) -> usize {
    ctx.clamp(16, 4096)
}

/// The KV rows' element type for `--kv-type` (f16 by default).
pub fn kv_dtype(t: crate::forward::KvType) -> crate::gpu::attention::KvType {
    use crate::forward::KvType;
    match t {
        KvType::Auto | KvType::F16 => crate::gpu::attention::KvType::F16,
        KvType::F32 => crate::gpu::attention::KvType::F32,
    }
}
