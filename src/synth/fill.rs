//! Writing a [`Plan`]: random tensor data, deterministic for a seed, generated in parallel
//! while the previous chunk goes to disk.
//!
//! Quantized blocks are made directly: quantizing f32 values with the reference K-quant
//! quantizers runs at ~80 MB/s of input per thread, far too slow for a 20 GB file. Instead
//! a small pool of blocks per tensor is quantized exactly from values of the tensor's
//! distribution (so scales, mins and their packing are genuine, finite and of the right
//! size), and every block of the file takes a random pool block's scale fields with fresh
//! random quant indices. Each block is unique and valid; values stay of the intended scale.
//!
//! Determinism: a tensor is cut into grains of whole rows (about [`GRAIN_BYTES`]), and
//! each grain draws from its own generator seeded by (seed, tensor index, grain index), so
//! the bytes do not depend on the thread count.

use super::{Init, Plan, TensorPlan};
use crate::gguf::{keys, GgufWriter};
use crate::quant::{self, BlockIq4Nl, BlockIq4Xs, BlockMxfp4, BlockQ2K, BlockQ3K, BlockQ4K};
use crate::quant::{BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0};
use crate::{DType, Error, Result};
use rayon::prelude::*;
use std::io::{self, Write};
use std::mem::{offset_of, size_of};
use std::path::Path;
use std::sync::mpsc;
use std::time::Instant;

/// Bytes per generator grain (whole rows): small enough to balance across threads.
const GRAIN_BYTES: usize = 1 << 20;
/// Bytes handed to the writer at a time; two are in flight (one written, one generated).
const CHUNK_BYTES: usize = 64 << 20;
/// Exactly quantized blocks per tensor that lend their scales to the random blocks.
const POOL_BLOCKS: usize = 64;

/// wyrand (Wang Yi's generator): one multiply per 64 random bits, good enough statistics
/// for weights, and splittable by seeding.
#[derive(Clone)]
pub(crate) struct Rng(u64);

/// SplitMix64's finaliser: spreads nearby seeds apart.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(mix(seed))
    }

    #[inline]
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xa076_1d64_78bd_642f);
        let t = (self.0 as u128).wrapping_mul((self.0 ^ 0xe703_7ed1_a0b4_28db) as u128);
        (t >> 64) as u64 ^ t as u64
    }

    /// Uniform on [0, 1).
    #[inline]
    pub(crate) fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Approximately standard normal: four 16-bit uniforms summed (Irwin–Hall), centred and
    /// scaled to unit variance. Bounded by ±2√3, which suits weights.
    #[inline]
    pub(crate) fn normal(&mut self) -> f32 {
        let r = self.next_u64();
        let s = (r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48);
        // Mean 2·65535, variance 4·(65536² − 1)/12.
        (s as f32 - 131_070.0) * (3.0f32.sqrt() / 65_536.0)
    }

    /// Uniform integer in [0, n).
    #[inline]
    pub(crate) fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    #[inline]
    fn fill_bytes(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let tail = chunks.into_remainder();
        let r = self.next_u64().to_le_bytes();
        let n = tail.len();
        tail.copy_from_slice(&r[..n]);
    }
}

/// Byte range of a block's quant indices; everything else is scales (and mins).
fn payload(dtype: DType) -> Option<(usize, usize)> {
    use DType as T;
    Some(match dtype {
        T::Q4_0 => (offset_of!(BlockQ4_0, qs), size_of::<BlockQ4_0>()),
        T::Q4_1 => (offset_of!(BlockQ4_1, qs), size_of::<BlockQ4_1>()),
        T::Q5_0 => (offset_of!(BlockQ5_0, qh), size_of::<BlockQ5_0>()),
        T::Q5_1 => (offset_of!(BlockQ5_1, qh), size_of::<BlockQ5_1>()),
        T::Q8_0 => (offset_of!(BlockQ8_0, qs), size_of::<BlockQ8_0>()),
        T::Q2_K => (offset_of!(BlockQ2K, qs), offset_of!(BlockQ2K, d)),
        T::Q3_K => (offset_of!(BlockQ3K, hmask), offset_of!(BlockQ3K, scales)),
        T::Q4_K => (offset_of!(BlockQ4K, qs), size_of::<BlockQ4K>()),
        T::Q5_K => (offset_of!(BlockQ5K, qh), size_of::<BlockQ5K>()),
        T::Q6_K => (offset_of!(BlockQ6K, ql), offset_of!(BlockQ6K, scales)),
        T::IQ4_NL => (offset_of!(BlockIq4Nl, qs), size_of::<BlockIq4Nl>()),
        T::IQ4_XS => (offset_of!(BlockIq4Xs, qs), size_of::<BlockIq4Xs>()),
        T::MXFP4 => (offset_of!(BlockMxfp4, qs), size_of::<BlockMxfp4>()),
        _ => return None,
    })
}

/// Salt of the per-layer expert ranking, shared by a layer's router, bias and hash table so
/// that the same experts are the popular ones.
const RANK_SALT: u64 = 0x005e_ed0f_e8e7;

/// Per-expert popularity gains `1 + skew·e^(−rank/top_k)`.
fn expert_gains(seed: u64, layer: usize, n_expert: usize, skew: f32, top_k: usize) -> Vec<f32> {
    let mut rank: Vec<usize> = (0..n_expert).collect();
    let mut rng = Rng::new(seed ^ RANK_SALT ^ mix(layer as u64));
    for i in (1..n_expert).rev() {
        rank.swap(i, rng.below(i + 1));
    }
    let k = top_k.max(1) as f32;
    rank.iter()
        .map(|&r| 1.0 + skew * (-(r as f32) / k).exp())
        .collect()
}

/// What a tensor's generator needs besides the random stream.
struct Prepared {
    /// Per-expert gains for routers, biases and hash tables.
    gains: Vec<f32>,
    /// Cumulative gains, for drawing hash-table experts.
    cumulative: Vec<f32>,
    /// `POOL_BLOCKS` exactly quantized blocks (quantized types).
    pool: Vec<u8>,
}

impl Prepared {
    fn new(t: &TensorPlan, seed: u64, index: usize) -> Result<Prepared> {
        let (gains, cumulative) = match t.init {
            Init::Router {
                skew, top_k, layer, ..
            } => (
                expert_gains(seed, layer, t.shape[0] as usize, skew, top_k),
                Vec::new(),
            ),
            Init::ExpertBias { skew, top_k, layer } => (
                expert_gains(seed, layer, t.shape[0] as usize, skew, top_k),
                Vec::new(),
            ),
            Init::ExpertIds {
                n_expert,
                skew,
                layer,
            } => {
                let top_k = *t.shape.last().unwrap_or(&1) as usize;
                let g = expert_gains(seed, layer, n_expert, skew, top_k);
                let c = g
                    .iter()
                    .scan(0.0f32, |s, &x| {
                        *s += x;
                        Some(*s)
                    })
                    .collect();
                (g, c)
            }
            _ => (Vec::new(), Vec::new()),
        };
        let mut pool = Vec::new();
        if t.dtype.is_quantized() {
            if payload(t.dtype).is_none() {
                return Err(Error::Unsupported(format!(
                    "{}: synth cannot make {} blocks",
                    t.name, t.dtype
                )));
            }
            let mut rng = Rng::new(seed ^ mix(index as u64 ^ 0x9001));
            let n = POOL_BLOCKS * t.dtype.block_size();
            let cols = *t.shape.last().unwrap_or(&1) as usize;
            let prep = Prepared {
                gains: gains.clone(),
                cumulative: Vec::new(),
                pool: Vec::new(),
            };
            let values: Vec<f32> = (0..n)
                .map(|i| sample(&t.init, &prep, i / cols, i % cols, &mut rng))
                .collect();
            pool = vec![0u8; t.dtype.bytes_for(n as u64).expect("whole blocks") as usize];
            quant::quantize_into(t.dtype, &values, &mut pool)
                .map_err(|e| Error::Invalid(format!("{}: {e}", t.name)))?;
        }
        Ok(Prepared {
            gains,
            cumulative,
            pool,
        })
    }
}

/// One value of element (`row`, `col`) under `init`.
#[inline]
fn sample(init: &Init, prep: &Prepared, row: usize, col: usize, rng: &mut Rng) -> f32 {
    match *init {
        Init::Normal { std } => std * rng.normal(),
        Init::Around { mean, std } => mean + std * rng.normal(),
        Init::Uniform { lo, hi } => lo + (hi - lo) * rng.uniform(),
        Init::Split { n, head, tail } => {
            if col < n {
                head
            } else {
                tail
            }
        }
        Init::Router { std, .. } => {
            std * prep.gains.get(row).copied().unwrap_or(1.0) * rng.normal()
        }
        Init::ExpertBias { .. } => 0.5 * (prep.gains.get(col).copied().unwrap_or(1.0) - 1.0),
        Init::ExpertIds { .. } => 0.0,
    }
}

/// Writes `f(col, rng)` for each element of a float row, in the row's type.
#[inline(always)]
fn write_row(
    dtype: DType,
    row: &mut [u8],
    rng: &mut Rng,
    mut f: impl FnMut(usize, &mut Rng) -> f32,
) {
    match dtype {
        DType::F32 => {
            for (c, e) in row.chunks_exact_mut(4).enumerate() {
                e.copy_from_slice(&f(c, rng).to_le_bytes());
            }
        }
        DType::F16 => {
            for (c, e) in row.chunks_exact_mut(2).enumerate() {
                e.copy_from_slice(&quant::f32_to_f16(f(c, rng)).to_le_bytes());
            }
        }
        _ => {
            for (c, e) in row.chunks_exact_mut(2).enumerate() {
                e.copy_from_slice(&quant::f32_to_bf16(f(c, rng)).to_le_bytes());
            }
        }
    }
}

/// Fills `out` (whole rows starting at `row0`) of tensor `t`.
fn fill_rows(t: &TensorPlan, prep: &Prepared, mut rng: Rng, row0: usize, out: &mut [u8]) {
    let cols = *t.shape.last().expect("shapes are not empty") as usize;
    match t.dtype {
        DType::F32 | DType::F16 | DType::BF16 => {
            let row_len = cols * t.dtype.block_bytes();
            for (i, row) in out.chunks_exact_mut(row_len).enumerate() {
                let r = row0 + i;
                match t.init {
                    Init::Uniform { lo, hi } => {
                        write_row(t.dtype, row, &mut rng, |_, g| lo + (hi - lo) * g.uniform())
                    }
                    Init::Split { n, head, tail } => {
                        write_row(
                            t.dtype,
                            row,
                            &mut rng,
                            |c, _| {
                                if c < n {
                                    head
                                } else {
                                    tail
                                }
                            },
                        )
                    }
                    Init::ExpertBias { .. } => write_row(t.dtype, row, &mut rng, |c, _| {
                        0.5 * (prep.gains.get(c).copied().unwrap_or(1.0) - 1.0)
                    }),
                    _ => {
                        // Every other init is `mean + scale·N(0, 1)` along a row.
                        let (mean, scale) = match t.init {
                            Init::Around { mean, std } => (mean, std),
                            Init::Router { std, .. } => {
                                (0.0, std * prep.gains.get(r).copied().unwrap_or(1.0))
                            }
                            Init::Normal { std } => (0.0, std),
                            _ => (0.0, 0.0),
                        };
                        write_row(t.dtype, row, &mut rng, |_, g| mean + scale * g.normal())
                    }
                }
            }
        }
        DType::I32 => {
            // A hash-routing row: `cols` distinct experts drawn by popularity.
            let total = prep.cumulative.last().copied().unwrap_or(0.0);
            let n = prep.cumulative.len();
            for row in out.chunks_exact_mut(4 * cols) {
                let mut picked: Vec<i32> = Vec::with_capacity(cols);
                while picked.len() < cols.min(n) {
                    let x = rng.uniform() * total;
                    let e = prep.cumulative.partition_point(|&c| c <= x).min(n - 1) as i32;
                    if !picked.contains(&e) {
                        picked.push(e);
                    }
                }
                picked.resize(cols, 0);
                for (d, e) in row.chunks_exact_mut(4).zip(&picked) {
                    d.copy_from_slice(&e.to_le_bytes());
                }
            }
        }
        q => {
            let (lo, hi) = payload(q).expect("checked in Prepared::new");
            let bb = q.block_bytes();
            let n_pool = prep.pool.len() / bb;
            for b in out.chunks_exact_mut(bb) {
                let p = rng.below(n_pool);
                b.copy_from_slice(&prep.pool[p * bb..(p + 1) * bb]);
                rng.fill_bytes(&mut b[lo..hi]);
            }
        }
    }
}

/// How long writing took.
#[derive(Clone, Copy, Debug)]
pub struct WriteStats {
    /// File size in bytes.
    pub bytes: u64,
    pub seconds: f64,
}

impl WriteStats {
    /// Megabytes (10⁶) per second.
    pub fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.seconds.max(1e-9)
    }
}

/// Generated bytes of one tensor, in file order.
struct Chunk {
    tensor: usize,
    data: Vec<u8>,
}

impl Plan {
    /// Writes the model to `path` with data drawn from `seed`; `progress(done, total)` is
    /// called as tensor bytes are written. A failed write removes the partial file.
    pub fn write(
        &self,
        path: &Path,
        seed: u64,
        progress: Option<&(dyn Fn(u64, u64) + Sync)>,
    ) -> Result<WriteStats> {
        let start = Instant::now();
        let mut w = GgufWriter::new();
        for (k, v) in &self.metadata {
            w.set(k.as_str(), v.clone())?;
        }
        // Beside the release's own keys (the plan matches those one for one): what the data
        // drawn below is, for people and other tools, and for lathe's loaders to say at load.
        w.set(
            keys::GENERAL_DESCRIPTION,
            format!("random weights from lathe synth (seed {seed}): its output is noise"),
        )?;
        w.set(keys::LATHE_RANDOM_WEIGHTS, true)?;
        for t in &self.tensors {
            w.add_tensor_info(t.name.as_str(), t.dtype, &t.shape)?;
        }
        let total = w.data_bytes();
        let (tx, rx) = mpsc::sync_channel::<Chunk>(1);
        let (back_tx, back_rx) = mpsc::channel::<Vec<u8>>();
        let (written, generated) = std::thread::scope(|s| {
            let producer = s.spawn(move || self.generate(seed, &tx, &back_rx));
            let mut done = 0u64;
            let written = w.write(path, |i, out: &mut dyn Write| {
                let mut left = self.tensors[i].n_bytes();
                while left > 0 {
                    let c = rx
                        .recv()
                        .map_err(|_| io::Error::other("the data generator stopped"))?;
                    debug_assert_eq!(c.tensor, i);
                    out.write_all(&c.data)?;
                    left -= c.data.len() as u64;
                    done += c.data.len() as u64;
                    if let Some(p) = progress {
                        p(done, total);
                    }
                    let _ = back_tx.send(c.data);
                }
                Ok(())
            });
            // A writer that stopped early must not leave the generator blocked on a send.
            drop(rx);
            let generated = producer
                .join()
                .unwrap_or_else(|_| Err(Error::Invalid("the data generator panicked".into())));
            (written, generated)
        });
        // The generator's error explains a writer that saw it stop.
        generated?;
        written?;
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        // A special file (`/dev/null`, to time generation alone) has no length.
        let bytes = if meta.is_file() { meta.len() } else { total };
        Ok(WriteStats {
            bytes,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// Produces every tensor's bytes in order, in chunks of whole grains.
    fn generate(
        &self,
        seed: u64,
        tx: &mpsc::SyncSender<Chunk>,
        recycled: &mpsc::Receiver<Vec<u8>>,
    ) -> Result<()> {
        for (ti, t) in self.tensors.iter().enumerate() {
            let prep = Prepared::new(t, seed, ti)?;
            let cols = *t.shape.last().expect("shapes are not empty");
            let row_bytes = t.dtype.bytes_for(cols).expect("whole blocks") as usize;
            let n_rows = (t.n_elements() / cols) as usize;
            let grain_rows = (GRAIN_BYTES / row_bytes).max(1);
            let chunk_rows = grain_rows * (CHUNK_BYTES / (grain_rows * row_bytes)).max(1);
            let tensor_seed = mix(seed ^ mix(ti as u64 + 1));
            let mut r = 0;
            while r < n_rows {
                let rows = chunk_rows.min(n_rows - r);
                let mut buf = recycled.try_recv().unwrap_or_default();
                buf.clear();
                buf.resize(rows * row_bytes, 0);
                buf.par_chunks_mut(grain_rows * row_bytes)
                    .enumerate()
                    .for_each(|(j, g)| {
                        let row0 = r + j * grain_rows;
                        let rng = Rng::new(tensor_seed ^ mix((row0 / grain_rows) as u64));
                        fill_rows(t, &prep, rng, row0, g);
                    });
                if tx
                    .send(Chunk {
                        tensor: ti,
                        data: buf,
                    })
                    .is_err()
                {
                    // The writer gave up; its error is the one to report.
                    return Ok(());
                }
                r += rows;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_has_unit_variance() {
        let mut r = Rng::new(7);
        let n = 200_000;
        let xs: Vec<f32> = (0..n).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f32>() / n as f32;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n as f32;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "variance {var}");
    }

    #[test]
    fn payload_ranges_lie_inside_the_blocks() {
        for t in DType::ALL {
            if let Some((lo, hi)) = payload(t) {
                assert!(lo < hi && hi <= t.block_bytes(), "{t}: {lo}..{hi}");
            }
        }
    }

    /// Random blocks dequantize to finite values of about the planned scale.
    #[test]
    fn random_blocks_are_valid_and_scaled() {
        for dtype in [
            DType::Q4_0,
            DType::Q4_1,
            DType::Q5_0,
            DType::Q5_1,
            DType::Q8_0,
            DType::Q2_K,
            DType::Q3_K,
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
            DType::IQ4_NL,
            DType::IQ4_XS,
            DType::MXFP4,
        ] {
            let std = 0.03;
            let t = TensorPlan {
                name: "w".into(),
                dtype,
                shape: vec![64, 512],
                init: Init::Normal { std },
            };
            let prep = Prepared::new(&t, 1, 0).unwrap();
            let mut bytes = vec![0u8; t.n_bytes() as usize];
            fill_rows(&t, &prep, Rng::new(3), 0, &mut bytes);
            let v = quant::dequantize_to_vec(dtype, &bytes, t.n_elements() as usize).unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "{dtype}");
            let rms = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
            // Uniform indices spread wider than quantized normals: within 0.5x..4x.
            assert!(
                rms > 0.5 * std && rms < 4.0 * std,
                "{dtype}: rms {rms} for std {std}"
            );
        }
    }

    #[test]
    fn hash_rows_hold_distinct_experts_and_skew_concentrates_them() {
        let count = |skew: f32| {
            let t = TensorPlan {
                name: "blk.0.ffn_gate_tid2eid.weight".into(),
                dtype: DType::I32,
                shape: vec![4000, 6],
                init: Init::ExpertIds {
                    n_expert: 64,
                    skew,
                    layer: 0,
                },
            };
            let prep = Prepared::new(&t, 5, 0).unwrap();
            let mut bytes = vec![0u8; t.n_bytes() as usize];
            fill_rows(&t, &prep, Rng::new(9), 0, &mut bytes);
            let ids: Vec<i32> = bytes
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let mut hist = vec![0usize; 64];
            for row in ids.chunks(6) {
                let mut r = row.to_vec();
                r.sort();
                r.dedup();
                assert_eq!(r.len(), 6, "{row:?}");
                for &e in row {
                    assert!((0..64).contains(&e));
                    hist[e as usize] += 1;
                }
            }
            *hist.iter().max().unwrap() as f64 / (4000.0 * 6.0 / 64.0)
        };
        assert!(count(0.0) < 1.3);
        assert!(count(20.0) > 4.0);
    }
}
