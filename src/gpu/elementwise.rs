//! Elementwise kernels (`shaders/elementwise.wgsl`). CPU references: `cpu::ops`.

use super::{grid, Binding, Pass, PipelineSpec};
use crate::Result;

const SRC: &str = include_str!("../../shaders/elementwise.wgsl");
const WG: u32 = 256;

/// Uniforms of `elementwise.wgsl` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    a_off: u32,
    b_off: u32,
    y_off: u32,
}
const _: () = assert!(std::mem::size_of::<Params>() == 16);

/// `y[y_off..][..n] = a[a_off..][..n] + b[b_off..][..n]` (offsets in elements).
#[allow(clippy::too_many_arguments)]
pub fn add(
    pass: &mut Pass<'_>,
    a: &wgpu::Buffer,
    a_off: u32,
    b: &wgpu::Buffer,
    b_off: u32,
    y: &wgpu::Buffer,
    y_off: u32,
    n: u32,
) -> Result<()> {
    let pl = pass.gpu().pipeline(&PipelineSpec::new("elementwise_add", SRC, "add"))?;
    pass.dispatch(
        &pl,
        "add",
        &Params { n, a_off, b_off, y_off },
        &[a.into(), b.into(), Binding::from(y)],
        grid(n.div_ceil(WG)),
    );
    Ok(())
}
