//! A per-layer timeline of the offload's MoE layers in one step (`lathe bench
//! --moe-timeline`): what the host did (record, wait, cold experts on the CPU) on its clock
//! and how long the GPU was busy with each of the layer's two submissions (timestamps
//! written inside the command buffers, so nothing waits for them).
//!
//! Per MoE layer with cold experts the offload submits twice back to back: `pre` (the
//! previous layer's scatter and combine, this layer's attention / GDN, router, remap and the
//! copy of ids and FFN inputs to the readback buffer) and `hot` (hot experts on the arena
//! and the shared expert). The host waits for `pre` only, then runs the cold experts while
//! `hot` runs. GPU idle in a layer ≈ its wall time − `gpu_pre_ms` − `gpu_hot_ms`.

use std::time::Instant;

/// One MoE layer of a step; times in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct LayerTimes {
    pub layer: usize,
    /// Host: from the previous MoE layer's end (or the step's start) to this layer's `pre`
    /// submission: recording, encoding and submitting.
    pub host_ms: f64,
    /// Host blocked until `pre` finished on the GPU (the readback's submission only).
    pub wait_ms: f64,
    /// CPU busy with the cold experts (rayon, all cores).
    pub cpu_ms: f64,
    /// Host: staging writes, residency uploads and bookkeeping after the CPU's rows.
    pub after_ms: f64,
    /// Whether the GPU had finished `hot` when the CPU finished (true: the GPU waited for
    /// the CPU; false: the CPU's rows were ready first).
    pub gpu_done_first: bool,
    /// GPU busy in `pre` and in `hot` (`None` without in-encoder timestamps).
    pub gpu_pre_ms: Option<f64>,
    pub gpu_hot_ms: Option<f64>,
    /// Routed pairs of the layer computed on the CPU.
    pub cold_pairs: usize,
}

/// Timeline recording in progress (held by the offload between `start_timeline` and
/// `take_timeline`).
pub(crate) struct Recording {
    /// Timestamp pairs: `pre` at 4i, 4i+1; `hot` at 4i+2, 4i+3 for layer entry i.
    pub queries: Option<wgpu::QuerySet>,
    pub capacity: u32,
    pub layers: Vec<LayerTimes>,
    /// End of the last MoE layer (or the start).
    pub last: Instant,
}

impl Recording {
    pub fn new(gpu: &crate::gpu::Gpu, max_layers: usize) -> Recording {
        let capacity = (4 * max_layers.max(1)) as u32;
        let f = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS;
        let queries = gpu.features.contains(f).then(|| {
            gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("moe.timeline"),
                ty: wgpu::QueryType::Timestamp,
                count: capacity,
            })
        });
        Recording {
            queries,
            capacity,
            layers: Vec::new(),
            last: Instant::now(),
        }
    }

    /// First query of the next layer entry, when timestamps are available and fit.
    pub fn next_query(&self) -> Option<(&wgpu::QuerySet, u32)> {
        let q = 4 * self.layers.len() as u32;
        self.queries
            .as_ref()
            .filter(|_| q + 4 <= self.capacity)
            .map(|qs| (qs, q))
    }

    /// The layers with their GPU times filled from the timestamps (waits for the GPU).
    pub fn finish(mut self, gpu: &crate::gpu::Gpu) -> crate::Result<Vec<LayerTimes>> {
        let Some(qs) = self.queries.as_ref() else {
            return Ok(self.layers);
        };
        let n = (4 * self.layers.len() as u32).min(self.capacity);
        if n == 0 {
            return Ok(self.layers);
        }
        let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("moe.timeline.resolve"),
            size: 8 * n as u64,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        enc.resolve_query_set(qs, 0..n, &resolve, 0);
        gpu.queue.submit([enc.finish()]);
        let raw = gpu.read_bytes(&resolve, 0, 8 * n as u64)?;
        let ticks: Vec<u64> = bytemuck::pod_collect_to_vec(&raw);
        let period = gpu.queue.get_timestamp_period() as f64;
        let ms = |a: usize| {
            let (s, e) = (ticks.get(a)?, ticks.get(a + 1)?);
            Some(e.saturating_sub(*s) as f64 * period / 1e6)
        };
        for (i, l) in self.layers.iter_mut().enumerate() {
            l.gpu_pre_ms = ms(4 * i);
            l.gpu_hot_ms = ms(4 * i + 2);
        }
        Ok(self.layers)
    }
}

/// The timeline as a table (stderr of `lathe bench --moe-timeline`), totals last.
pub fn table(layers: &[LayerTimes]) -> String {
    use std::fmt::Write;
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
    let mut s = String::from(
        "layer  host_ms  wait_ms  cpu_ms  after_ms  gpu_pre_ms  gpu_hot_ms  gpu_done_first  cold_pairs\n",
    );
    for l in layers {
        let _ = writeln!(
            s,
            "{:>5}  {:>7.3}  {:>7.3}  {:>6.3}  {:>8.3}  {:>10}  {:>10}  {:>14}  {:>10}",
            l.layer,
            l.host_ms,
            l.wait_ms,
            l.cpu_ms,
            l.after_ms,
            opt(l.gpu_pre_ms),
            opt(l.gpu_hot_ms),
            l.gpu_done_first,
            l.cold_pairs
        );
    }
    let sum = |f: fn(&LayerTimes) -> f64| layers.iter().map(f).sum::<f64>();
    let sum_opt = |f: fn(&LayerTimes) -> Option<f64>| {
        layers.iter().map(f).try_fold(0.0, |a, v| v.map(|v| a + v))
    };
    let _ = writeln!(
        s,
        "total  {:>7.3}  {:>7.3}  {:>6.3}  {:>8.3}  {:>10}  {:>10}  {:>14}  {:>10}",
        sum(|l| l.host_ms),
        sum(|l| l.wait_ms),
        sum(|l| l.cpu_ms),
        sum(|l| l.after_ms),
        opt(sum_opt(|l| l.gpu_pre_ms)),
        opt(sum_opt(|l| l.gpu_hot_ms)),
        layers.iter().filter(|l| l.gpu_done_first).count(),
        layers.iter().map(|l| l.cold_pairs).sum::<usize>()
    );
    s
}
