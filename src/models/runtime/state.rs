//! Copies between the sequence slots of a family's state pools (a checkpoint, or its
//! restore).

use crate::gpu::Gpu;
use crate::Result;

/// One region to copy: `(buffer, from, to, bytes)`, both offsets in the same buffer.
pub type Region<'a> = (&'a wgpu::Buffer, u64, u64, u64);

/// Copy every region slot to slot, on the GPU in one submission. Both slots live in the
/// same pool buffers and WebGPU forbids a copy within one buffer, so each region goes
/// through a staging buffer as large as the largest region (wgpu orders the copies with
/// barriers). `label` names the staging buffer.
pub fn copy_regions(gpu: &Gpu, regions: &[Region<'_>], label: &str) -> Result<()> {
    let stage_len = regions.iter().map(|r| r.3).max().unwrap_or(0);
    if stage_len == 0 {
        return Ok(());
    }
    let stage = gpu.buffer(stage_len, label)?;
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    for &(buf, from, to, len) in regions {
        enc.copy_buffer_to_buffer(buf, from, &stage, 0, len);
        enc.copy_buffer_to_buffer(&stage, 0, buf, to, len);
    }
    gpu.queue.submit([enc.finish()]);
    gpu.check()
}
