//! Command recording: a whole forward pass becomes one submission.
//!
//! Binding convention for every lathe kernel: `@group(0) @binding(0)` is the kernel's
//! uniform struct (`var<uniform> p: Params`), bindings `1..` are storage buffers in the
//! order the wrapper passes them. Recording does no GPU work: it appends the uniform bytes
//! and the bindings to host lists.
//!
//! Host cost per dispatch: the uniform bytes of a submission go to one persistent buffer per
//! device (the arena, written with one `queue.write_buffer` per submission: queue order keeps
//! earlier submissions reading their own bytes), dispatch `i` of a submission at an offset
//! that depends only on the uniform sizes before it. A decode step records the same
//! sequence every token, so each dispatch's bind group (pipeline layout, arena range, storage
//! ranges) is the same object every token: it is made once and looked up in a cache
//! ([`Recorder`](super::recorder::Recorder)) instead of made per dispatch (`create_bind_group` costs 1.3-2 µs on
//! lavapipe, more than recording the dispatch: FACTS.md).
//!
//! A pass may be flushed part-way ([`Pass::flush`]): what is recorded so far is submitted
//! and recording goes on. A decode step encodes ~400 dispatches on the host; flushing
//! every few layers lets the GPU run the first layers while the host encodes the rest,
//! instead of idling through the whole encode.

use super::recorder::{Cached, GroupKey, PipelineId, RecorderInner, KEEP_SUBMITS};
use super::{Binding, Gpu};
use crate::{Error, Result};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

impl Gpu {
    /// Host nanoseconds spent in passes so far: recording (from a pass's creation or last
    /// flush) and encoding, up to the `queue.submit` call; waits for results excluded.
    pub fn host_ns(&self) -> u64 {
        self.recorder.host_ns.load(Ordering::Relaxed)
    }

    /// Bind groups made so far (each cache miss); a repeated decode step makes none.
    pub fn bind_groups_made(&self) -> u64 {
        self.recorder.inner.lock().unwrap().made
    }
}

enum Op {
    Dispatch {
        key: GroupKey,
        label: String,
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
    /// Start of the host time this pass has spent since its creation or last flush.
    since: Instant,
}

impl Gpu {
    pub fn pass(&self) -> Pass<'_> {
        Pass {
            gpu: self,
            ops: Vec::new(),
            uniforms: Vec::new(),
            align: self.limits.min_uniform_buffer_offset_alignment.max(16) as u64,
            hold: false,
            since: Instant::now(),
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
            key: GroupKey {
                pipeline: PipelineId(pipeline.clone()),
                uniform: (off, len),
                bindings,
            },
            label: label.to_string(),
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
            since: self.since,
        };
        head.submit()?;
        self.since = Instant::now();
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

    /// Write the uniforms to the arena, encode everything recorded into a command buffer
    /// (with a query set, every dispatch gets its own compute pass with timestamps `2i`
    /// (begin) and `2i+1` (end), resolved into `resolve`) and submit it, all under the
    /// recorder's lock.
    fn encode_submit(self, timing: Timing<'_>) -> Result<wgpu::SubmissionIndex> {
        let gpu = self.gpu;
        let mut rec = gpu.recorder.inner.lock().unwrap();
        let enc = self.encode_locked(&mut rec, timing)?;
        Ok(enc.submit_locked())
    }

    /// Encode everything recorded into a command buffer now, to submit later
    /// ([`Encoded::submit`]): the host's encoding can overlap other host work (the MoE
    /// offload encodes the next layer while the CPU computes cold experts). Submissions
    /// made in between run before it (queue order); its uniform bytes are written to the
    /// arena at its own submission.
    pub fn encode(self) -> Result<Encoded<'g>> {
        let gpu = self.gpu;
        let mut rec = gpu.recorder.inner.lock().unwrap();
        self.encode_locked(&mut rec, Timing::None)
    }

    fn encode_locked(self, rec: &mut RecorderInner, timing: Timing<'_>) -> Result<Encoded<'g>> {
        let profile = match timing {
            Timing::PerDispatch(qs, resolve) => Some((qs, resolve)),
            _ => None,
        };
        let gpu = self.gpu;
        let need = (self.uniforms.len() as u64).max(256);
        if need > gpu.limits.max_buffer_size {
            return Err(Error::Gpu(format!(
                "{} bytes of uniforms exceed max_buffer_size",
                self.uniforms.len()
            )));
        }
        if rec.arena.as_ref().is_none_or(|a| a.size() < need) {
            // The cached groups bind the old arena: they go with it.
            rec.groups.clear();
            let size = need
                .next_power_of_two()
                .max(64 << 10)
                .min(gpu.limits.max_buffer_size);
            rec.arena = Some(gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("lathe.uniforms"),
                size,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
        }
        let arena = rec.arena.clone().expect("arena made above");
        let mut uniforms = self.uniforms;
        uniforms.resize(uniforms.len().next_multiple_of(4), 0);
        rec.epoch += 1;
        let epoch = rec.epoch;
        if epoch.is_multiple_of(KEEP_SUBMITS) {
            rec.groups.retain(|_, c| c.used + KEEP_SUBMITS > epoch);
        }
        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("lathe"),
            });
        if let Timing::Around(qs, first) = timing {
            enc.write_timestamp(qs, first);
        }
        let mut n_dispatch = 0u32;
        {
            let mut cpass: Option<wgpu::ComputePass<'_>> = None;
            for op in self.ops {
                match op {
                    Op::Dispatch { key, label, groups } => {
                        let cached = match rec.groups.get_mut(&key) {
                            Some(c) => c,
                            None => {
                                let group = make_group(gpu, &arena, &key, &label);
                                rec.made += 1;
                                rec.groups
                                    .entry(key.clone())
                                    .or_insert(Cached { group, used: epoch })
                            }
                        };
                        cached.used = epoch;
                        if profile.is_some() {
                            cpass = None;
                        }
                        let tw = profile.map(|(qs, _)| wgpu::ComputePassTimestampWrites {
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
                        cp.set_pipeline(&key.pipeline.0);
                        cp.set_bind_group(0, &cached.group, &[]);
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
        }
        if let Some((qs, resolve)) = profile {
            if n_dispatch > 0 {
                enc.resolve_query_set(qs, 0..2 * n_dispatch, resolve, 0);
            }
        }
        if let Timing::Around(qs, first) = timing {
            enc.write_timestamp(qs, first + 1);
        }
        let cb = enc.finish();
        gpu.recorder
            .host_ns
            .fetch_add(self.since.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(Encoded {
            gpu,
            arena,
            uniforms,
            cb,
        })
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
        self.encode_submit(Timing::PerDispatch(&qs, &resolve))?;
        gpu.check()?;
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
        let idx = self.encode_submit(Timing::None)?;
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
        let idx = self.encode_submit(Timing::Around(qs, first))?;
        gpu.check()?;
        Ok(idx)
    }
}

/// A pass encoded ahead of its submission ([`Pass::encode`]).
pub struct Encoded<'g> {
    gpu: &'g Gpu,
    /// The arena its bind groups read, and the bytes to write there before it runs.
    arena: wgpu::Buffer,
    uniforms: Vec<u8>,
    cb: wgpu::CommandBuffer,
}

impl Encoded<'_> {
    /// Write its uniforms and submit it, under the recorder's lock (no other pass's bytes
    /// land in the arena between the two). Does not wait.
    pub fn submit(self) -> Result<wgpu::SubmissionIndex> {
        let gpu = self.gpu;
        let idx = {
            let _rec = gpu.recorder.inner.lock().unwrap();
            self.submit_locked()
        };
        gpu.check()?;
        Ok(idx)
    }

    /// With the recorder's lock held by the caller.
    fn submit_locked(self) -> wgpu::SubmissionIndex {
        let gpu = self.gpu;
        let t = Instant::now();
        if !self.uniforms.is_empty() {
            gpu.queue.write_buffer(&self.arena, 0, &self.uniforms);
        }
        // Counted up to the submit call: lavapipe runs compute inside `queue.submit` at times
        // (the CPU is the device), which is GPU time, not host overhead.
        gpu.recorder
            .host_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        gpu.queue.submit([self.cb])
    }
}

/// GPU timestamps a submission takes.
#[derive(Clone, Copy)]
enum Timing<'a> {
    None,
    /// A pair per dispatch (each in its own compute pass), resolved into the buffer.
    PerDispatch(&'a wgpu::QuerySet, &'a wgpu::Buffer),
    /// Queries `first` and `first + 1` before and after the recorded work.
    Around(&'a wgpu::QuerySet, u32),
}

/// The bind group of `key`: binding 0 the arena range, then the storage ranges.
fn make_group(gpu: &Gpu, arena: &wgpu::Buffer, key: &GroupKey, label: &str) -> wgpu::BindGroup {
    let layout = key.pipeline.0.get_bind_group_layout(0);
    let mut entries = Vec::with_capacity(key.bindings.len() + 1);
    entries.push(wgpu::BindGroupEntry {
        binding: 0,
        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: arena,
            offset: key.uniform.0,
            size: std::num::NonZeroU64::new(key.uniform.1),
        }),
    });
    for (slot, b) in key.bindings.iter() {
        entries.push(wgpu::BindGroupEntry {
            binding: *slot,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &b.buffer,
                offset: b.offset,
                size: b.size.and_then(std::num::NonZeroU64::new),
            }),
        });
    }
    gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some(label),
        layout: &layout,
        entries: &entries,
    })
}
