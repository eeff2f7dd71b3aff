//! Row softmax (`shaders/softmax.wgsl`), max-subtracted, with an optional scale on the
//! logits. CPU reference: `cpu::ops::softmax`.

use super::operand::Operand;
use super::{grid, Binding, Pass, PipelineSpec};
use crate::{Error, Result};

const SRC: &str = include_str!("../../shaders/softmax.wgsl");

/// Uniforms of `softmax.wgsl` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    dim: u32,
    n_rows: u32,
    /// Offsets and row strides in elements.
    x_off: u32,
    x_stride: u32,
    y_off: u32,
    y_stride: u32,
    scale: f32,
    _pad: u32,
}
const _: () = assert!(std::mem::size_of::<Params>() == 32);

/// `y = softmax(scale · x)` per row of `dim`; `y: None` in place.
pub fn softmax(
    pass: &mut Pass<'_>,
    n_rows: u32,
    dim: u32,
    x: Operand<'_>,
    y: Option<Operand<'_>>,
    scale: f32,
) -> Result<()> {
    if n_rows == 0 {
        return Ok(());
    }
    if dim == 0 {
        return Err(Error::Invalid("softmax: rows of 0 elements".into()));
    }
    x.check("softmax", "x", n_rows, dim)?;
    if let Some(y) = &y {
        y.check("softmax", "y", n_rows, dim)?;
    }
    #[derive(PartialEq, Eq, Hash)]
    struct Softmax {
        /// y is x.
        inplace: bool,
    }
    impl super::PipelineKey for Softmax {
        fn source(&self) -> &'static str {
            SRC
        }
        fn entry(&self) -> &'static str {
            "main"
        }
        fn label(&self) -> String {
            let inplace = if self.inplace { "_inplace" } else { "" };
            format!("softmax{inplace}")
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec.define("INPLACE", self.inplace)
        }
    }
    let inplace = y.is_none();
    let pl = pass.gpu().pipeline_for(Softmax { inplace })?;
    let yv = y.unwrap_or(x);
    let params = Params {
        dim,
        n_rows,
        x_off: x.off,
        x_stride: x.stride_for(dim),
        y_off: yv.off,
        y_stride: yv.stride_for(dim),
        scale,
        _pad: 0,
    };
    let mut bindings = vec![Binding::from(x.buf)];
    if let Some(y) = y {
        bindings.push(y.buf.into());
    }
    pass.dispatch(&pl, "softmax", &params, &bindings, grid(n_rows));
    Ok(())
}
