//! What a family's attention reads of a round, written once: per row its position, and per
//! distinct (pool capacity, window) pair of the family's KV pools each row's cache row and
//! each decode row's visible cache rows ([`RowTables`]); the attention calls over a round's
//! parts ([`attend`]) and their split-K scratch ([`split`]).

use super::rounds::Part;
use crate::gpu::attention::{self, DstRows, Keys, KvShape};
use crate::gpu::rope::Positions;
use crate::gpu::Gpu;
use crate::{Error, Result};

/// The u32 tables of a round of at most `rows` rows in one buffer: the positions
/// `[rows]`, then per (capacity, window) pair the cache rows `[rows]` and the decode rows'
/// ranges `[rows, 2]` (`Keys::Ranges`: first row, count).
pub struct RowTables {
    buf: wgpu::Buffer,
    rows: usize,
    max_pairs: usize,
    /// This round's (capacity, window) pairs, in the order their tables lie.
    pairs: Vec<(u32, u32)>,
}

impl RowTables {
    /// u32 elements of the tables of `rows` rows and `max_pairs` pairs.
    pub fn elems(rows: usize, max_pairs: usize) -> usize {
        rows * (1 + 3 * max_pairs)
    }

    pub fn new(gpu: &Gpu, rows: usize, max_pairs: usize, label: &str) -> Result<RowTables> {
        let bytes = (Self::elems(rows, max_pairs).max(1) * 4) as u64;
        Ok(RowTables {
            buf: gpu.buffer(bytes, label)?,
            rows,
            max_pairs,
            pairs: Vec::new(),
        })
    }

    /// Write the tables of `parts`, each (capacity, window) pair of `pairs` once (a window
    /// of 0: all of the sequence's rows); slot `s` owns cache rows `s·cap ..`.
    pub fn write(
        &mut self,
        gpu: &Gpu,
        parts: &[Part],
        pairs: impl IntoIterator<Item = (usize, usize)>,
    ) -> Result<()> {
        self.pairs.clear();
        for (cap, window) in pairs {
            let p = (cap as u32, window as u32);
            if !self.pairs.contains(&p) {
                self.pairs.push(p);
            }
        }
        if self.pairs.len() > self.max_pairs {
            return Err(Error::Invalid(format!(
                "a round over {} (KV capacity, window) pairs; its row tables hold {}",
                self.pairs.len(),
                self.max_pairs
            )));
        }
        let pos: Vec<u32> = parts
            .iter()
            .flat_map(|p| (0..p.n as u32).map(move |j| p.pos0 as u32 + j))
            .collect();
        if pos.len() > self.rows {
            return Err(Error::Invalid(format!(
                "a round of {} rows; its row tables hold {}",
                pos.len(),
                self.rows
            )));
        }
        gpu.write(&self.buf, 0, bytemuck::cast_slice(&pos));
        for (i, &(cap, window)) in self.pairs.iter().enumerate() {
            let mut kv_rows = Vec::with_capacity(pos.len());
            let mut ranges = Vec::new();
            for p in parts {
                let base = p.slot * cap + p.pos0 as u32;
                kv_rows.extend((0..p.n as u32).map(|j| base + j));
                if p.n == 1 {
                    let q = p.pos0 as u32;
                    let seen = match window {
                        0 => q + 1,
                        w => w.min(q + 1),
                    };
                    ranges.extend_from_slice(&[base + 1 - seen, seen]);
                }
            }
            let (k_off, r_off) = self.offs(i);
            gpu.write(&self.buf, k_off as u64 * 4, bytemuck::cast_slice(&kv_rows));
            if !ranges.is_empty() {
                gpu.write(&self.buf, r_off as u64 * 4, bytemuck::cast_slice(&ranges));
            }
        }
        Ok(())
    }

    /// Where pair `i`'s cache rows and ranges start (elements).
    fn offs(&self, i: usize) -> (u32, u32) {
        let base = self.rows * (1 + 3 * i);
        (base as u32, (base + self.rows) as u32)
    }

    fn pair(&self, cap: usize, window: usize) -> Result<(u32, u32)> {
        let p = (cap as u32, window as u32);
        let i = self.pairs.iter().position(|&q| q == p).ok_or_else(|| {
            Error::Invalid(format!(
                "no row tables of KV capacity {cap} and window {window} this round"
            ))
        })?;
        Ok(self.offs(i))
    }

    /// The buffer of every table (u32).
    pub fn buf(&self) -> &wgpu::Buffer {
        &self.buf
    }

    /// Each row's position.
    pub fn positions(&self) -> Positions<'_> {
        Positions::Buffer {
            buf: &self.buf,
            off: 0,
        }
    }

    /// Where each row's K and V go in pools of `cap` rows per slot: the element offset of
    /// its table in [`Self::buf`].
    pub fn kv_rows_off(&self, cap: usize, window: usize) -> Result<u32> {
        Ok(self.pair(cap, window)?.0)
    }

    /// [`Self::kv_rows_off`] as `write_kv`'s destination.
    pub fn kv_rows(&self, cap: usize, window: usize) -> Result<DstRows<'_>> {
        Ok(DstRows::List {
            rows: &self.buf,
            off: self.kv_rows_off(cap, window)?,
        })
    }

    /// The decode rows' visible cache rows in pools of `cap` rows per slot with `window`.
    pub fn ranges(&self, cap: usize, window: usize) -> Result<(&wgpu::Buffer, u32)> {
        Ok((&self.buf, self.pair(cap, window)?.1))
    }
}

/// The attention calls of a round over pools of `cap` rows per slot with `window` (0:
/// none): each multi-token part, and a lone decode row, causal over its own slot's rows;
/// the decode rows of several sequences (contiguous at the end of the pass: the scheduler
/// puts single tokens last) in one call over their `ranges` ([`RowTables::ranges`]).
/// `call(first row, query rows, keys, most keys a row sees)` runs one.
pub fn attend(
    parts: &[Part],
    cap: usize,
    window: usize,
    ranges: (&wgpu::Buffer, u32),
    mut call: impl FnMut(u32, u32, Keys<'_>, u32) -> Result<()>,
) -> Result<()> {
    let cap = cap as u32;
    let singles: Vec<&Part> = parts.iter().filter(|p| p.n == 1).collect();
    for p in parts.iter().filter(|p| p.n > 1 || singles.len() == 1) {
        let (pos0, np) = (p.pos0 as u32, p.n as u32);
        let keys = Keys::Causal {
            row0: p.slot * cap,
            pos0,
            n_kv: pos0 + np,
            window: window as u32,
        };
        call(p.row as u32, np, keys, pos0 + np)?;
    }
    if let [first, _, ..] = singles[..] {
        let max_keys = singles.iter().map(|p| p.pos0 as u32 + 1).max().unwrap_or(1);
        let keys = Keys::Ranges {
            desc: ranges.0,
            off: ranges.1,
            max_keys,
        };
        call(first.row as u32, singles.len() as u32, keys, max_keys)?;
    }
    Ok(())
}

/// The split-K scratch and split count of an attention call of `n_q` query rows and
/// `n_head` heads of `head_dim` facing at most `max_keys` keys: split only when a few query
/// rows face many keys (decode), halved until the partials fit `scratch` (sized for one
/// query row); `None` unsplit.
pub fn split<'a>(
    scratch: &'a wgpu::Buffer,
    n_q: u32,
    n_head: u32,
    head_dim: u32,
    kv: KvShape,
    max_keys: u32,
    keys: &Keys<'_>,
) -> Option<(&'a wgpu::Buffer, u32)> {
    let per_query = matches!(keys, Keys::Ranges { .. });
    let mut n_split = attention::pick_n_split(n_q, n_head, kv, max_keys, per_query);
    while n_split > 1
        && attention::scratch_elems(n_q, n_head, head_dim, n_split) * 4 > scratch.size()
    {
        n_split /= 2;
    }
    (n_split > 1).then_some((scratch, n_split))
}
