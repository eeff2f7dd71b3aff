//! A part's ends in a chain of devices (`models::chain`): the residual stream it receives
//! instead of embedding tokens, and the one it hands on instead of running the head. Below
//! the chain and the families: a family's model is a [`Part`] and talks to its neighbours
//! through a [`Link`]; the chain wires the links.

use super::super::Forward;
use crate::gpu::Gpu;
use crate::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;

/// One round's residual stream on its way to the next device: `[rows, width]` f32.
pub struct Hidden {
    pub rows: usize,
    pub data: Vec<f32>,
}

/// Counters of the device boundaries crossed since load.
#[derive(Default)]
pub struct HopCounters {
    pub(crate) hops: AtomicU64,
    pub(crate) bytes: AtomicU64,
    /// Host time of the crossings: the sender's map and copy out, the receiver's write.
    pub(crate) ns: AtomicU64,
}

impl HopCounters {
    fn add(&self, bytes: u64, ns: u64) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.ns.fetch_add(ns, Ordering::Relaxed);
    }
}

/// A part's ends in the chain for one call: where its residual stream comes from (the
/// first part embeds tokens instead) and where it goes (the last part runs the head).
#[derive(Default)]
pub struct Link {
    /// Behind a lock only so that a part's model is `Sync` (the MoE offload records a
    /// layer on a worker thread while the host thread computes cold experts).
    pub input: Option<std::sync::Mutex<Receiver<Hidden>>>,
    pub output: Option<SyncSender<Hidden>>,
    pub counters: Arc<HopCounters>,
}

/// The message of a part whose neighbour stopped (its own error is the one to report).
pub(crate) const LINK_BROKEN: &str = "the neighbouring device's part stopped";

impl Link {
    /// The previous part's rows for a round of `rows` rows of `width` values.
    pub fn recv(&self, rows: usize, width: usize) -> Result<Hidden> {
        let rx = self
            .input
            .as_ref()
            .ok_or_else(|| Error::Invalid("a middle part of a chain run alone".into()))?;
        let h = rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .recv()
            .map_err(|_| Error::Gpu(LINK_BROKEN.into()))?;
        if h.rows != rows || h.data.len() != rows * width {
            return Err(Error::Gpu(format!(
                "chain parts disagree on a round: {} rows of {} values came, {rows} x {width} \
                 expected",
                h.rows,
                h.data.len() / h.rows.max(1)
            )));
        }
        Ok(h)
    }

    /// Hand a round's rows on; `ns`: host time the sender spent reading them back.
    pub fn send(&self, h: Hidden, ns: u64) -> Result<()> {
        let tx = self
            .output
            .as_ref()
            .ok_or_else(|| Error::Invalid("a middle part of a chain run alone".into()))?;
        self.counters.hops.fetch_add(1, Ordering::Relaxed);
        self.counters.add(h.data.len() as u64 * 4, ns);
        tx.send(h).map_err(|_| Error::Gpu(LINK_BROKEN.into()))
    }

    /// Count the receiver's write of a round.
    pub fn note_write(&self, ns: u64) {
        self.counters.add(0, ns);
    }
}

/// A persistent `MAP_READ` buffer a part copies its residual stream into at the end of its
/// pass, reused every round (one buffer made at load, none per step).
pub struct Readback {
    buf: wgpu::Buffer,
}

impl Readback {
    pub fn new(gpu: &Gpu, bytes: u64) -> Readback {
        Readback {
            buf: gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("chain.readback"),
                size: bytes.next_multiple_of(4).max(4),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
        }
    }

    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buf
    }

    /// The first `n` f32 values, once the submitted work (whose last copy filled the
    /// buffer) is done. Returns them and the host time spent after the GPU finished.
    pub fn read(&self, gpu: &Gpu, n: usize) -> Result<(Vec<f32>, u64)> {
        gpu.wait()?;
        let t0 = std::time::Instant::now();
        let slice = self.buf.slice(..(n as u64 * 4).max(4));
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        gpu.wait()?;
        rx.recv()
            .map_err(|_| Error::Gpu("chain readback: map callback never ran".into()))?
            .map_err(|e| Error::Gpu(format!("chain readback: {e}")))?;
        let v = {
            let m = slice
                .get_mapped_range()
                .map_err(|e| Error::Gpu(format!("chain readback: {e:?}")))?;
            bytemuck::pod_collect_to_vec(&m[..n * 4])
        };
        self.buf.unmap();
        Ok((v, t0.elapsed().as_nanos() as u64))
    }
}

/// A family's GPU model as a part of a chain.
pub trait Part: Forward {
    /// Set the ends for the next calls (`Link::default()` to cut them).
    fn link(&mut self, link: Link);
    fn gpu(&self) -> &Arc<Gpu>;
}

impl Link {
    /// The first part of a round on a part that is not the first: the previous part's rows
    /// (`[rows, width]`) written into the residual stream `x`.
    pub fn receive_into(
        &self,
        gpu: &Gpu,
        x: &wgpu::Buffer,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        let h = self.recv(rows, width)?;
        let t0 = std::time::Instant::now();
        gpu.write(x, 0, bytemuck::cast_slice(&h.data));
        self.note_write(t0.elapsed().as_nanos() as u64);
        Ok(())
    }

    /// The end of a round on a part that is not the last: the residual stream `x`
    /// (`[rows, width]`) copied into `rb` in `pass`, which is submitted (its per-dispatch
    /// times appended to `prof`), read back and sent on.
    pub fn hand_off(
        &self,
        mut pass: crate::gpu::Pass<'_>,
        x: &wgpu::Buffer,
        rb: &Readback,
        rows: usize,
        width: usize,
        prof: Option<&mut Vec<(String, f64)>>,
    ) -> Result<()> {
        let gpu = pass.gpu();
        let len = rows * width;
        pass.copy(x, 0, rb.buffer(), 0, len as u64 * 4);
        pass.submit_or_profile(prof)?;
        let (data, ns) = rb.read(gpu, len)?;
        self.send(Hidden { rows, data }, ns)
    }
}
