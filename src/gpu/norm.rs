//! Row norms (`shaders/norm.wgsl`): RMSNorm (weighted, unweighted, per head, fused residual),
//! L2 norm, gated RMSNorm. CPU references: `cpu::ops::{rms_norm, l2_norm, gated_rms_norm}`.
//!
//! Rows are [`Operand`]s of f32 buffers; "per head" is just more rows (`n_rows = n_tokens ·
//! n_heads`, stride = head_dim, or 2·head_dim for Qwen's `[q | gate]` per-head layout). `y:
//! None` normalises in place. Weights are `GpuTensor`s of F32, F16 or BF16 `[dim]` multiplied
//! as stored (the loaders turn HF's `1+w` into plain `w`).

use super::operand::Operand;
use super::{grid, Binding, GpuTensor, Pass, PipelineSpec};
use crate::cpu::ops::L2Mode;
use crate::{DType, Error, Result};

const SRC: &str = include_str!("../../shaders/norm.wgsl");
/// Threads per workgroup of `norm.wgsl` (`WG`).
const WG: u32 = 256;

/// Uniforms of `norm.wgsl` (same fields, same order).
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
    z_off: u32,
    z_stride: u32,
    eps: f32,
    scale: f32,
    _pad: [u32; 2],
}
const _: () = assert!(std::mem::size_of::<Params>() == 48);

/// An RMSNorm's rows and epsilon: `n_rows` rows of `dim`.
#[derive(Clone, Copy, Debug)]
pub struct Rms {
    pub n_rows: u32,
    pub dim: u32,
    pub eps: f32,
}

/// An L2 norm's rows and parameters: `n_rows` rows of `dim`, the formula's epsilon (see
/// [`L2Mode`]) and the factor the normalised rows are multiplied by.
#[derive(Clone, Copy, Debug)]
pub struct L2 {
    pub n_rows: u32,
    pub dim: u32,
    pub eps: f32,
    pub mode: L2Mode,
    pub scale: f32,
}

/// Which formula (`norm.wgsl`'s `MODE`) with its parameters.
#[derive(Clone, Copy, Debug)]
enum Formula {
    Rms(Rms),
    L2(L2),
}

/// The second input: a gate (`silu(z)` multiplies the output) or a residual (`x += z` first).
#[derive(Clone, Copy)]
enum Extra<'a> {
    None,
    Gate(Operand<'a>),
    Residual(Operand<'a>),
}

fn run(
    pass: &mut Pass<'_>,
    f: Formula,
    x: Operand<'_>,
    y: Option<Operand<'_>>,
    w: Option<&GpuTensor>,
    extra: Extra<'_>,
) -> Result<()> {
    let op = match (f, extra) {
        (Formula::Rms(_), Extra::Gate(_)) => "gated_rms_norm",
        (Formula::Rms(_), Extra::Residual(_)) => "add_rms_norm",
        (Formula::Rms(_), Extra::None) => "rms_norm",
        (Formula::L2(_), _) => "l2_norm",
    };
    let (n_rows, dim, eps, scale) = match f {
        Formula::Rms(r) => (r.n_rows, r.dim, r.eps, 1.0),
        Formula::L2(l) => (l.n_rows, l.dim, l.eps, l.scale),
    };
    if n_rows == 0 {
        return Ok(());
    }
    if dim == 0 {
        return Err(Error::Invalid(format!("{op}: rows of 0 elements")));
    }
    x.check(op, "x", n_rows, dim)?;
    if let Some(y) = &y {
        y.check(op, "y", n_rows, dim)?;
    }
    let wdt = match w {
        None => None,
        Some(w) => {
            if w.n_rows() * w.row_len() != dim as u64 || w.parts.len() != 1 {
                return Err(Error::Invalid(format!(
                    "{op}: weight `{}` has shape {:?}, expected [{dim}] in one buffer",
                    w.name, w.shape
                )));
            }
            match w.dtype {
                DType::F32 | DType::F16 | DType::BF16 => Some(w.dtype),
                t => {
                    return Err(Error::Unsupported(format!(
                        "{op}: weight `{}` of type {t} (F32, F16 or BF16 only)",
                        w.name
                    )))
                }
            }
        }
    };
    let (z, gated, residual) = match extra {
        Extra::None => (None, false, false),
        Extra::Gate(v) => (Some(v), true, false),
        Extra::Residual(v) => (Some(v), false, true),
    };
    if let Some(z) = &z {
        z.check(op, if gated { "z" } else { "residual" }, n_rows, dim)?;
    }
    let inplace = y.is_none();
    let mode_id = match f {
        Formula::Rms(_) => 0,
        Formula::L2(L2 {
            mode: L2Mode::Hf, ..
        }) => 1,
        Formula::L2(L2 {
            mode: L2Mode::Ggml, ..
        }) => 2,
    };
    let yv = y.unwrap_or(x);
    let zv = z.unwrap_or(x);
    // vec4 items (`V4`, see norm.wgsl) for ungated rows longer than a workgroup whose x, y
    // and z rows all start on a multiple of 4 elements
    let v4 = !gated
        && dim > WG
        && dim.is_multiple_of(4)
        && [x, yv, zv]
            .iter()
            .all(|v| v.off.is_multiple_of(4) && v.stride_for(dim).is_multiple_of(4));
    #[derive(PartialEq, Eq, Hash)]
    struct Norm {
        /// `MODE` of norm.wgsl.
        mode_id: u32,
        /// The weight's stored type, if any.
        wdt: Option<DType>,
        inplace: bool,
        gated: bool,
        residual: bool,
        /// vec4 items.
        v4: bool,
    }
    impl super::PipelineKey for Norm {
        fn source(&self) -> &'static str {
            SRC
        }
        fn entry(&self) -> &'static str {
            "main"
        }
        fn label(&self) -> String {
            format!(
                "norm_m{}_w{}{}{}{}{}",
                self.mode_id,
                self.wdt.map_or("none", |t| t.name()),
                if self.inplace { "_inplace" } else { "" },
                if self.gated { "_gated" } else { "" },
                if self.residual { "_residual" } else { "" },
                if self.v4 { "_v4" } else { "" },
            )
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            let spec = spec
                .define("MODE", format!("{}u", self.mode_id))
                .define("INPLACE", self.inplace)
                .define("RESIDUAL", self.residual)
                .define("GATED", self.gated)
                .define("HAS_Z", self.gated || self.residual)
                .define("HAS_W", self.wdt.is_some())
                .define("V4", self.v4);
            match self.wdt {
                Some(t) => spec.define(&format!("W_{}", t.name()), true),
                None => spec,
            }
        }
    }
    let pl = pass.gpu().pipeline_for(Norm {
        mode_id,
        wdt,
        inplace,
        gated,
        residual,
        v4,
    })?;
    let params = Params {
        dim,
        n_rows,
        x_off: x.off,
        x_stride: x.stride_for(dim),
        y_off: yv.off,
        y_stride: yv.stride_for(dim),
        z_off: zv.off,
        z_stride: zv.stride_for(dim),
        eps,
        scale,
        _pad: [0; 2],
    };
    let mut bindings = vec![Binding::from(x.buf)];
    if let Some(y) = y {
        bindings.push(y.buf.into());
    }
    if let Some(w) = w {
        bindings.push((&w.parts[0].buffer).into());
    }
    if let Some(z) = z {
        bindings.push(z.buf.into());
    }
    pass.dispatch(&pl, op, &params, &bindings, grid(n_rows));
    Ok(())
}

/// RMSNorm of `n_rows` rows of `dim`: `y = x · rsqrt(mean(x²) + eps) · w` (`w` optional;
/// `y: None` in place).
pub fn rms_norm(
    pass: &mut Pass<'_>,
    n_rows: u32,
    dim: u32,
    x: Operand<'_>,
    y: Option<Operand<'_>>,
    w: Option<&GpuTensor>,
    eps: f32,
) -> Result<()> {
    let f = Formula::Rms(Rms { n_rows, dim, eps });
    run(pass, f, x, y, w, Extra::None)
}

/// Fused residual add and RMSNorm: `x += r` (written back to `x`), then `y = rmsnorm(x) · w`.
pub fn add_rms_norm(
    pass: &mut Pass<'_>,
    rms: Rms,
    x: Operand<'_>,
    r: Operand<'_>,
    y: Operand<'_>,
    w: Option<&GpuTensor>,
) -> Result<()> {
    run(pass, Formula::Rms(rms), x, Some(y), w, Extra::Residual(r))
}

/// L2 norm per row times `l2.scale`: `x · rsqrt(Σx² + eps)` ([`L2Mode::Hf`], the default) or
/// `x / max(‖x‖, eps)` ([`L2Mode::Ggml`]). `y: None` in place.
pub fn l2_norm(pass: &mut Pass<'_>, l2: L2, x: Operand<'_>, y: Option<Operand<'_>>) -> Result<()> {
    run(pass, Formula::L2(l2), x, y, None, Extra::None)
}

/// Gated RMSNorm (Qwen3.5 GDN output): `y = w ⊙ rmsnorm(o) ⊙ silu(z)`, `y: None` writes over `o`.
pub fn gated_rms_norm(
    pass: &mut Pass<'_>,
    rms: Rms,
    o: Operand<'_>,
    z: Operand<'_>,
    y: Option<Operand<'_>>,
    w: Option<&GpuTensor>,
) -> Result<()> {
    run(pass, Formula::Rms(rms), o, y, w, Extra::Gate(z))
}

const SANDWICH_SRC: &str = include_str!("../../shaders/sandwich.wgsl");

/// Uniforms of `sandwich.wgsl` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct SandwichParams {
    dim: u32,
    n_rows: u32,
    eps: f32,
    scale: f32,
}
const _: () = assert!(std::mem::size_of::<SandwichParams>() == 16);

/// What joins the residual stream in [`sandwich`]: buffers of `[n_rows, dim]` f32 rows packed
/// from element 0, weights `[dim]`.
#[derive(Clone, Copy)]
pub enum Branch<'a> {
    /// Nothing: the stream is only scaled.
    None,
    /// `rms(z) · w` (Gemma's post-attention / post-FFN norm of a branch's output).
    One {
        z: &'a wgpu::Buffer,
        w: &'a GpuTensor,
    },
    /// `rms(rms(z) · w + rms(z2) · w2) · wb` (Gemma-4 MoE blocks: `post_feedforward_layernorm_1`
    /// of the dense branch, `_2` of the routed one, then `post_feedforward_layernorm`).
    Two {
        z: &'a wgpu::Buffer,
        w: &'a GpuTensor,
        z2: &'a wgpu::Buffer,
        w2: &'a GpuTensor,
        wb: &'a GpuTensor,
    },
}

/// Gemma's sandwich norms over `n_rows` rows of `dim` in one dispatch (`shaders/sandwich.wgsl`):
/// `x = (x + branch) · scale`, then `y = rms(x) · wy` (the next norm's input) and the same for
/// each of `more` (at most [`SANDWICH_MORE`]). `x`, `y` and `more`'s buffers `[n_rows, dim]`
/// f32 packed from element 0, `eps` every RMSNorm's.
pub struct Sandwich<'a> {
    pub n_rows: u32,
    pub dim: u32,
    pub eps: f32,
    pub x: &'a wgpu::Buffer,
    pub branch: Branch<'a>,
    pub scale: f32,
    pub y: &'a wgpu::Buffer,
    pub wy: &'a GpuTensor,
    /// More norms of the new x: `(out, weight)`.
    pub more: &'a [(&'a wgpu::Buffer, &'a GpuTensor)],
}

/// The most norms of the new x beside `y` in one [`sandwich`] (`MORE1`, `MORE2`).
pub const SANDWICH_MORE: usize = 2;

/// The widest rows [`sandwich`] takes: `sandwich.wgsl` keeps every element of a row in its
/// threads' registers (`K · WG · L`).
pub const SANDWICH_MAX_DIM: u32 = 8192;

impl Sandwich<'_> {
    fn weights(&self) -> Vec<&GpuTensor> {
        let mut ws = vec![self.wy];
        match self.branch {
            Branch::None => {}
            Branch::One { w, .. } => ws.push(w),
            Branch::Two { w, w2, wb, .. } => ws.extend([w, w2, wb]),
        }
        ws.extend(self.more.iter().map(|&(_, w)| w));
        ws
    }

    /// Whether [`sandwich`] takes these rows: at most [`SANDWICH_MAX_DIM`] elements, every
    /// weight `[dim]` in one buffer of one type (F32, F16 or BF16), at most [`SANDWICH_MORE`]
    /// more norms.
    pub fn fits(&self) -> bool {
        let ws = self.weights();
        let dt = ws[0].dtype;
        self.more.len() <= SANDWICH_MORE
            && self.dim > 0
            && self.dim <= SANDWICH_MAX_DIM
            && matches!(dt, DType::F32 | DType::F16 | DType::BF16)
            && ws.iter().all(|w| {
                w.dtype == dt && w.parts.len() == 1 && w.n_rows() * w.row_len() == self.dim as u64
            })
    }
}

/// [`Sandwich`] in one dispatch: the bits of `rms_norm` of the branch(es), `elementwise::add`
/// (MoE: of the two normed branches, then their `rms_norm`), `elementwise::add_inplace` into
/// x, `elementwise::scale_inplace` and `rms_norm` of x into y (each RMSNorm's items, order and
/// tree replayed, see the shader). An error unless [`Sandwich::fits`].
pub fn sandwich(pass: &mut Pass<'_>, s: &Sandwich<'_>) -> Result<()> {
    let op = "sandwich_norm";
    if !s.fits() {
        return Err(Error::Invalid(format!(
            "{op}: rows of {} (at most {SANDWICH_MAX_DIM}) with weights of one type in one \
             buffer each, {} more norms (at most {SANDWICH_MORE})",
            s.dim,
            s.more.len()
        )));
    }
    if s.n_rows == 0 {
        return Ok(());
    }
    let (n, d) = (s.n_rows, s.dim);
    super::check_span(op, "x", s.x, 0u32, d, n, d)?;
    super::check_span(op, "y", s.y, 0u32, d, n, d)?;
    let (z, z2) = match s.branch {
        Branch::None => (None, None),
        Branch::One { z, .. } => (Some(z), None),
        Branch::Two { z, z2, .. } => (Some(z), Some(z2)),
    };
    for (what, b) in [("z", z), ("z2", z2)] {
        if let Some(b) = b {
            super::check_span(op, what, b, 0u32, d, n, d)?;
        }
    }
    for &(b, _) in s.more {
        super::check_span(op, "more", b, 0u32, d, n, d)?;
    }
    // norm.rs's vec4 items: rows longer than a workgroup, a multiple of 4 (packed from 0)
    let v4 = d > WG && d.is_multiple_of(4);
    #[derive(PartialEq, Eq, Hash)]
    struct Key {
        wdt: DType,
        branches: u32,
        more: usize,
        v4: bool,
    }
    impl super::PipelineKey for Key {
        fn source(&self) -> &'static str {
            SANDWICH_SRC
        }
        fn entry(&self) -> &'static str {
            "main"
        }
        fn label(&self) -> String {
            format!(
                "sandwich_norm_b{}_m{}_w{}{}",
                self.branches,
                self.more,
                self.wdt.name(),
                if self.v4 { "_v4" } else { "" }
            )
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec.define("V4", self.v4)
                .define("HAS_Z", self.branches >= 1)
                .define("TWO", self.branches == 2)
                .define("MORE1", self.more >= 1)
                .define("MORE2", self.more >= 2)
                .define(&format!("W_{}", self.wdt.name()), true)
        }
    }
    let branches = z.is_some() as u32 + z2.is_some() as u32;
    let pl = pass.gpu().pipeline_for(Key {
        wdt: s.wy.dtype,
        branches,
        more: s.more.len(),
        v4,
    })?;
    let params = SandwichParams {
        dim: d,
        n_rows: n,
        eps: s.eps,
        scale: s.scale,
    };
    let wb = |w: &GpuTensor| -> Binding { (&w.parts[0].buffer).into() };
    let mut bindings = vec![Binding::from(s.x), Binding::from(s.y), wb(s.wy)];
    match s.branch {
        Branch::None => {}
        Branch::One { z, w } => bindings.extend([Binding::from(z), wb(w)]),
        Branch::Two {
            z,
            w,
            z2,
            w2,
            wb: b,
        } => bindings.extend([Binding::from(z), wb(w), Binding::from(z2), wb(w2), wb(b)]),
    }
    let mut slots: Vec<(u32, Binding)> = (1..).zip(bindings).collect();
    for (i, &(b, w)) in s.more.iter().enumerate() {
        slots.push((9 + 2 * i as u32, b.into()));
        slots.push((10 + 2 * i as u32, wb(w)));
    }
    pass.dispatch_slots(&pl, op, &params, slots, grid(n));
    Ok(())
}
