//! What a device keeps between passes ([`Recorder`]): the uniform arena and the bind-group
//! cache (keyed by pipeline, arena range and storage ranges), below the [`Gpu`](super::Gpu)
//! that owns it and the passes (`pass.rs`) that record into it.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

/// A storage binding: a whole buffer or a byte range of it (offset aligned to the
/// adapter's `min_storage_buffer_offset_alignment`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
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

/// A pipeline compared and hashed by identity (the key holds it, so the address stays its own).
#[derive(Clone)]
pub(super) struct PipelineId(pub(super) Arc<wgpu::ComputePipeline>);

impl PartialEq for PipelineId {
    fn eq(&self, o: &Self) -> bool {
        Arc::ptr_eq(&self.0, &o.0)
    }
}
impl Eq for PipelineId {}
impl std::hash::Hash for PipelineId {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        Arc::as_ptr(&self.0).hash(h)
    }
}

/// What one bind group binds: the pipeline (its layout), the arena range and the storage ranges.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(super) struct GroupKey {
    pub(super) pipeline: PipelineId,
    /// (offset, size) in the arena, bytes.
    pub(super) uniform: (u64, u64),
    /// (binding number, buffer range)
    pub(super) bindings: Vec<(u32, Binding)>,
}

/// A cached bind group and the submission that last used it.
pub(super) struct Cached {
    pub(super) group: wgpu::BindGroup,
    pub(super) used: u64,
}

/// Bind groups unused for this many submissions are dropped (they hold their buffers alive):
/// a decode step is ~10 submissions, so the groups of the step stay cached, those of a
/// prefill chunk or a freed scratch go after a few tokens.
pub(super) const KEEP_SUBMITS: u64 = 256;

/// Per-device state of the recorder: the uniform arena, the bind-group cache, and the host
/// time spent recording and submitting (read by `lathe bench`). One lock covers write,
/// encode and submit, so two threads' passes never interleave their arena bytes.
#[derive(Default)]
pub(crate) struct Recorder {
    pub(super) inner: Mutex<RecorderInner>,
    pub(super) host_ns: AtomicU64,
}

#[derive(Default)]
pub(super) struct RecorderInner {
    pub(super) arena: Option<wgpu::Buffer>,
    pub(super) groups: HashMap<GroupKey, Cached>,
    /// Submissions so far.
    pub(super) epoch: u64,
    /// Bind groups made (cache misses) since the device was made.
    pub(super) made: u64,
}
