//! The trace hook: any named intermediate of one layer (`attn_in` of layer 3) captured in
//! every pass, to diff against a reference (the CPU forwards' `step_traced` names) when a
//! fixture disagrees. A typed option of the model (`GpuModel::trace`), not an environment
//! flag.

use crate::gpu::{Gpu, Pass};
use crate::Result;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A named intermediate of one layer. The names a family records are listed where it
/// records them (`Tracer::point` calls).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trace {
    pub name: &'static str,
    pub layer: usize,
}

/// The capture of one [`Trace`]: a copy recorded inside the pass at the named point, read
/// back after the pass and appended, `[n_tokens, width]`, to `traced`.
#[derive(Default)]
pub struct Tracer {
    /// What to capture; `None`: nothing (the points record nothing).
    pub want: Option<Trace>,
    /// Every capture so far, in pass order.
    pub traced: Vec<f32>,
    buf: Option<wgpu::Buffer>,
    /// f32 values copied in the current pass (atomic: a point is recorded through `&self`,
    /// beside borrows of the model, and the model is `Sync`).
    len: AtomicUsize,
}

impl Tracer {
    pub fn on(&self) -> bool {
        self.want.is_some()
    }

    /// Whether a point of layer `l` is captured (a family keeps that layer's output from
    /// being fused into the next layer's first kernels).
    pub fn at(&self, l: usize) -> bool {
        self.want.is_some_and(|t| t.layer == l)
    }

    /// Before a pass: the capture buffer of `bytes` (made once).
    pub fn prepare(&mut self, gpu: &Gpu, bytes: u64) -> Result<()> {
        if self.want.is_some() && self.buf.is_none() {
            self.buf = Some(gpu.buffer(bytes, "trace")?);
        }
        *self.len.get_mut() = 0;
        Ok(())
    }

    /// The point `name` of layer `l`: `buf`'s first `values` f32 copied when it is the one
    /// wanted.
    pub fn point(
        &self,
        pass: &mut Pass<'_>,
        name: &'static str,
        l: usize,
        buf: &wgpu::Buffer,
        values: usize,
    ) {
        if let (Some(tb), true) = (&self.buf, self.want == Some(Trace { name, layer: l })) {
            self.len.store(values, Ordering::Relaxed);
            pass.copy(buf, 0, tb, 0, values as u64 * 4);
        }
    }

    /// After the pass is submitted: append what it captured.
    pub fn collect(&mut self, gpu: &Gpu) -> Result<()> {
        let len = std::mem::take(self.len.get_mut());
        if let (Some(tb), true) = (&self.buf, len > 0) {
            let v = gpu.read_f32(tb, 0, len)?;
            self.traced.extend(v);
        }
        Ok(())
    }
}
