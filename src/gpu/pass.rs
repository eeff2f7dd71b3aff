//! Command recording: a whole forward pass becomes one submission.
//!
//! Binding convention for every lathe kernel: `@group(0) @binding(0)` is the kernel's
//! uniform struct (`var<uniform> p: Params`), bindings `1..` are storage buffers in the
//! order the wrapper passes them. Uniform bytes of all dispatches of a submission go into
//! one buffer made at submit time, so recording does no GPU work.
//!
//! A pass may be flushed part-way ([`Pass::flush`]): what is recorded so far is submitted
//! and recording goes on. A decode step encodes ~400 dispatches on the host; flushing
//! every few layers lets the GPU run the first layers while the host encodes the rest,
//! instead of idling through the whole encode.

use super::Gpu;
use crate::{Error, Result};
use std::sync::Arc;
use wgpu::util::DeviceExt;

/// A storage binding: a whole buffer or a byte range of it (offset aligned to the
/// adapter's `min_storage_buffer_offset_alignment`).
#[derive(Clone, Debug)]
pub struct Binding {
    pub buffer: wgpu::Buffer,
    pub offset: u64,
    pub size: Option<u64>,
}

impl From<&wgpu::Buffer> for Binding {
    fn from(b: &wgpu::Buffer) -> Self {
        Binding {
            buffer: b.clone(),
            offset: 0,
            size: None,
        }
    }
}

enum Op {
    Dispatch {
        pipeline: Arc<wgpu::ComputePipeline>,
        label: String,
        uniform: (u64, u64),
        /// (binding number, buffer range)
        bindings: Vec<(u32, Binding)>,
        groups: [u32; 3],
    },
    Copy {
        src: wgpu::Buffer,
        src_off: u64,
        dst: wgpu::Buffer,
        dst_off: u64,
        size: u64,
    },
}

/// Records dispatches and copies; `submit` uploads the uniforms and submits once.
pub struct Pass<'g> {
    gpu: &'g Gpu,
    ops: Vec<Op>,
    uniforms: Vec<u8>,
    align: u64,
    /// `flush` does nothing: the pass stays one submission (per-dispatch profiling).
    hold: bool,
}

impl Gpu {
    pub fn pass(&self) -> Pass<'_> {
        Pass {
            gpu: self,
            ops: Vec::new(),
            uniforms: Vec::new(),
            align: self.limits.min_uniform_buffer_offset_alignment.max(16) as u64,
            hold: false,
        }
    }
}

/// Dispatches per submission when a forward flushes at layer boundaries
/// ([`Pass::flush_every`]): small enough that the GPU starts early, large enough that the
/// per-submission cost (a uniform buffer, a queue submit) stays negligible.
pub const FLUSH_OPS: usize = 48;

/// Largest workgroup count per grid dimension WebGPU guarantees.
pub const MAX_GROUPS: u32 = 65535;

/// Spread `n` workgroups over x and y (x ≤ 65535). Kernels rebuild the linear id as
/// `wid.x + wid.y * nwg.x` and return when it is ≥ n.
pub fn grid(n: u32) -> [u32; 3] {
    if n <= MAX_GROUPS {
        [n.max(1), 1, 1]
    } else {
        let y = n.div_ceil(MAX_GROUPS);
        [n.div_ceil(y), y, 1]
    }
}

impl<'g> Pass<'g> {
    pub fn gpu(&self) -> &'g Gpu {
        self.gpu
    }

    /// Record one dispatch of `pipeline` with uniform `params` and storage `bindings`.
    pub fn dispatch<P: bytemuck::Pod>(
        &mut self,
        pipeline: &Arc<wgpu::ComputePipeline>,
        label: &str,
        params: &P,
        bindings: &[Binding],
        groups: [u32; 3],
    ) {
        let slots: Vec<(u32, Binding)> = (1..).zip(bindings.iter().cloned()).collect();
        self.dispatch_slots(pipeline, label, params, slots, groups);
    }

    /// [`Pass::dispatch`] with explicit binding numbers, for kernels compiled from a family
    /// file whose entry points each read a different subset of its bindings (wgpu derives
    /// each pipeline's layout from what its entry point uses).
    pub fn dispatch_slots<P: bytemuck::Pod>(
        &mut self,
        pipeline: &Arc<wgpu::ComputePipeline>,
        label: &str,
        params: &P,
        bindings: Vec<(u32, Binding)>,
        groups: [u32; 3],
    ) {
        let bytes = bytemuck::bytes_of(params);
        let off = (self.uniforms.len() as u64).next_multiple_of(self.align);
        self.uniforms.resize(off as usize, 0);
        self.uniforms.extend_from_slice(bytes);
        // Uniform bindings must cover at least 16 bytes on some backends.
        let len = (bytes.len() as u64).next_multiple_of(16);
        self.uniforms.resize((off + len) as usize, 0);
        self.ops.push(Op::Dispatch {
            pipeline: pipeline.clone(),
            label: label.to_string(),
            uniform: (off, len),
            bindings,
            groups,
        });
    }

    /// Record a buffer-to-buffer copy (ordered with the dispatches around it).
    pub fn copy(
        &mut self,
        src: &wgpu::Buffer,
        src_off: u64,
        dst: &wgpu::Buffer,
        dst_off: u64,
        size: u64,
    ) {
        self.ops.push(Op::Copy {
            src: src.clone(),
            src_off,
            dst: dst.clone(),
            dst_off,
            size,
        });
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Operations recorded since the last flush.
    pub fn pending(&self) -> usize {
        self.ops.len()
    }

    /// Keep this pass one submission: later `flush` calls do nothing.
    pub fn hold(&mut self) {
        self.hold = true;
    }

    /// Submit what is recorded so far (without waiting) and keep recording into this pass.
    /// Queue order is kept, so the GPU sees the same sequence of work; but a `gpu.write`
    /// made after a flush lands before the *next* submission only, after the flushed work.
    pub fn flush(&mut self) -> Result<()> {
        if self.hold || self.ops.is_empty() {
            return Ok(());
        }
        let head = Pass {
            gpu: self.gpu,
            ops: std::mem::take(&mut self.ops),
            uniforms: std::mem::take(&mut self.uniforms),
            align: self.align,
            hold: false,
        };
        head.submit()?;
        Ok(())
    }

    /// `flush` when at least `n` operations are pending: called at layer boundaries, it cuts
    /// a forward into submissions of about `n` dispatches.
    pub fn flush_every(&mut self, n: usize) -> Result<()> {
        if self.ops.len() >= n {
            self.flush()?;
        }
        Ok(())
    }

    /// Encode everything recorded into `enc`, with the uniforms in a buffer of their own.
    fn encode(self, enc: &mut wgpu::CommandEncoder) -> Result<()> {
        self.encode_with(enc, None)
    }

    /// `encode`; with a query set, every dispatch gets its own compute pass with timestamps
    /// `2i` (begin) and `2i+1` (end).
    fn encode_with(
        self,
        enc: &mut wgpu::CommandEncoder,
        profile: Option<&wgpu::QuerySet>,
    ) -> Result<()> {
        let mut n_dispatch = 0u32;
        let gpu = self.gpu;
        // A fresh buffer per submission: nothing to lock against other passes, and the
        // bytes are written at creation (no queue write to order).
        let mut uniforms = self.uniforms;
        uniforms.resize(uniforms.len().max(256), 0);
        if uniforms.len() as u64 > gpu.limits.max_buffer_size {
            return Err(Error::Gpu(format!(
                "{} bytes of uniforms exceed max_buffer_size",
                uniforms.len()
            )));
        }
        let ubuf = gpu
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("lathe.uniforms"),
                contents: &uniforms,
                usage: wgpu::BufferUsages::UNIFORM,
            });
        let mut cpass: Option<wgpu::ComputePass<'_>> = None;
        for op in self.ops {
            match op {
                Op::Dispatch {
                    pipeline,
                    label,
                    uniform,
                    bindings,
                    groups,
                } => {
                    let layout = pipeline.get_bind_group_layout(0);
                    let mut entries = Vec::with_capacity(bindings.len() + 1);
                    entries.push(wgpu::BindGroupEntry {
                        binding: 0,
                        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer: &ubuf,
                            offset: uniform.0,
                            size: std::num::NonZeroU64::new(uniform.1),
                        }),
                    });
                    for (slot, b) in bindings.iter() {
                        entries.push(wgpu::BindGroupEntry {
                            binding: *slot,
                            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                buffer: &b.buffer,
                                offset: b.offset,
                                size: b.size.and_then(std::num::NonZeroU64::new),
                            }),
                        });
                    }
                    let bg = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: Some(&label),
                        layout: &layout,
                        entries: &entries,
                    });
                    if profile.is_some() {
                        cpass = None;
                    }
                    let tw = profile.map(|qs| wgpu::ComputePassTimestampWrites {
                        query_set: qs,
                        beginning_of_pass_write_index: Some(2 * n_dispatch),
                        end_of_pass_write_index: Some(2 * n_dispatch + 1),
                    });
                    n_dispatch += 1;
                    let cp = cpass.get_or_insert_with(|| {
                        enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                            label: Some("lathe"),
                            timestamp_writes: tw,
                        })
                        .forget_lifetime()
                    });
                    cp.set_pipeline(&pipeline);
                    cp.set_bind_group(0, &bg, &[]);
                    cp.dispatch_workgroups(groups[0], groups[1], groups[2]);
                }
                Op::Copy {
                    src,
                    src_off,
                    dst,
                    dst_off,
                    size,
                } => {
                    cpass = None;
                    enc.copy_buffer_to_buffer(&src, src_off, &dst, dst_off, size);
                }
            }
        }
        drop(cpass);
        Ok(())
    }

    /// Submit with a GPU timestamp pair around every dispatch (each in its own compute
    /// pass, so only `TIMESTAMP_QUERY` is needed), wait, and return `(label, ns)` per
    /// dispatch in order. For breakdowns of one step; never on the normal path.
    pub fn submit_profiled(self) -> Result<Vec<(String, f64)>> {
        let gpu = self.gpu;
        if !gpu.features.contains(wgpu::Features::TIMESTAMP_QUERY) {
            return Err(Error::Gpu(format!(
                "{}: no timestamp queries on this adapter",
                gpu.info.name
            )));
        }
        let labels: Vec<String> = self
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Dispatch { label, .. } => Some(label.clone()),
                Op::Copy { .. } => None,
            })
            .collect();
        let n = labels.len() as u32;
        if n == 0 {
            self.submit()?;
            return Ok(Vec::new());
        }
        let qs = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("lathe.profile"),
            ty: wgpu::QueryType::Timestamp,
            count: 2 * n,
        });
        let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("lathe.profile.resolve"),
            size: 16 * n as u64,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("lathe.profile"),
            });
        self.encode_with(&mut enc, Some(&qs))?;
        enc.resolve_query_set(&qs, 0..2 * n, &resolve, 0);
        gpu.queue.submit([enc.finish()]);
        let raw = gpu.read_bytes(&resolve, 0, 16 * n as u64)?;
        let ticks: Vec<u64> = bytemuck::pod_collect_to_vec(&raw);
        let period = gpu.queue.get_timestamp_period() as f64;
        Ok(labels
            .into_iter()
            .enumerate()
            .map(|(i, l)| {
                (
                    l,
                    ticks[2 * i + 1].saturating_sub(ticks[2 * i]) as f64 * period,
                )
            })
            .collect())
    }

    /// [`submit`](Self::submit), or with `profile` [`submit_profiled`](Self::submit_profiled)
    /// appending the dispatches' `(label, ns)` to it: the one switch every forward shares.
    pub fn submit_or_profile(self, profile: Option<&mut Vec<(String, f64)>>) -> Result<()> {
        match profile {
            Some(v) => v.extend(self.submit_profiled()?),
            None => {
                self.submit()?;
            }
        }
        Ok(())
    }

    /// Encode and submit as one command buffer. Does not wait.
    pub fn submit(self) -> Result<wgpu::SubmissionIndex> {
        let gpu = self.gpu;
        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("lathe"),
            });
        self.encode(&mut enc)?;
        let idx = gpu.queue.submit([enc.finish()]);
        gpu.check()?;
        Ok(idx)
    }
}

impl Pass<'_> {
    /// [`submit`](Self::submit) with GPU timestamps `first` (before the recorded work) and
    /// `first + 1` (after it) written into `qs` (`TIMESTAMP_QUERY_INSIDE_ENCODERS`): the busy
    /// time of one submission, measured without waiting for it (the MoE offload's timeline).
    pub fn submit_stamped(self, qs: &wgpu::QuerySet, first: u32) -> Result<wgpu::SubmissionIndex> {
        let gpu = self.gpu;
        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("lathe.stamped"),
            });
        enc.write_timestamp(qs, first);
        self.encode(&mut enc)?;
        enc.write_timestamp(qs, first + 1);
        let idx = gpu.queue.submit([enc.finish()]);
        gpu.check()?;
        Ok(idx)
    }
}
