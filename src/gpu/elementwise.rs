//! Elementwise kernels (`shaders/elementwise.wgsl`) over `[n_rows, n_cols]` views of f32
//! buffers. CPU references: `cpu::ops` (`silu`, `sigmoid`, `swiglu`, `swiglu_act_clamp`, `geglu`, `softcap`) or plain arithmetic.
//!
//! Buffers: an op's output and its inputs must be different buffers (wgpu rejects a dispatch
//! that binds one buffer both read-only and writable); updates of a buffer by itself go
//! through the `*_inplace` ops, `add_inplace` and `axpy_row`.

use super::operand::Operand;
use super::{grid, Binding, Pass, PipelineSpec};
use crate::{Error, Result};

const SRC: &str = include_str!("../../shaders/elementwise.wgsl");
const WG: u32 = 256;

/// Uniforms of `elementwise.wgsl` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n_cols: u32,
    n_rows: u32,
    /// Offsets and row strides in elements.
    y_off: u32,
    y_stride: u32,
    a_off: u32,
    a_stride: u32,
    b_off: u32,
    b_stride: u32,
    /// Scale, or SwiGLU's clamp limit.
    alpha: f32,
    /// Slots of `moe_combine`.
    k: u32,
    _pad: [u32; 2],
}
const _: () = assert!(std::mem::size_of::<Params>() == 48);

/// How an operand is read: a full row, or one scalar per row (`cols = 1`).
#[derive(Clone, Copy)]
enum Arg<'a> {
    Rows(Operand<'a>),
    Scalar(Operand<'a>),
}

impl<'a> Arg<'a> {
    fn view(&self) -> Operand<'a> {
        match self {
            Arg::Rows(v) | Arg::Scalar(v) => *v,
        }
    }
}

/// Record `entry` on `[n_rows, n_cols]` with output `y` and inputs `args` (bindings 1, 2, 3).
fn run(
    pass: &mut Pass<'_>,
    entry: &'static str,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    args: &[Arg<'_>],
    alpha: f32,
) -> Result<()> {
    run_k(
        pass,
        entry,
        n_rows,
        n_cols,
        y,
        args,
        Scalars { alpha, k: 0 },
    )
}

/// The scalar uniforms of an op (`Params::alpha`, `Params::k`).
#[derive(Clone, Copy)]
struct Scalars {
    /// Scale, or SwiGLU's clamp limit.
    alpha: f32,
    /// Slots of `moe_combine`.
    k: u32,
}

/// [`run`] with the slot count of `moe_combine`.
fn run_k(
    pass: &mut Pass<'_>,
    entry: &'static str,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    args: &[Arg<'_>],
    sc: Scalars,
) -> Result<()> {
    let n = n_rows as u64 * n_cols as u64;
    if n == 0 {
        return Ok(());
    }
    if n > u32::MAX as u64 - WG as u64 {
        return Err(Error::Invalid(format!(
            "{entry}: {n_rows}×{n_cols} elements is too many for one dispatch"
        )));
    }
    y.check(entry, "y", n_rows, n_cols)?;
    let mut offs = [(0u32, 0u32); 2];
    for (i, a) in args.iter().enumerate() {
        let (v, len) = match a {
            Arg::Rows(v) => (v, n_cols),
            Arg::Scalar(v) => (v, 1),
        };
        v.check(entry, ["a", "b"][i], n_rows, len)?;
        offs[i] = (v.off, v.stride_for(len));
    }
    let params = Params {
        n_cols,
        n_rows,
        y_off: y.off,
        y_stride: y.stride_for(n_cols),
        a_off: offs[0].0,
        a_stride: offs[0].1,
        b_off: offs[1].0,
        b_stride: offs[1].1,
        alpha: sc.alpha,
        k: sc.k,
        _pad: [0; 2],
    };
    #[derive(PartialEq, Eq, Hash)]
    struct Elementwise {
        entry: super::StaticName,
    }
    impl super::PipelineKey for Elementwise {
        fn source(&self) -> &'static str {
            SRC
        }
        fn entry(&self) -> &'static str {
            self.entry.0
        }
        fn label(&self) -> String {
            format!("elementwise_{}", self.entry.0)
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec
        }
    }
    let pl = pass.gpu().pipeline_for(Elementwise {
        entry: super::StaticName(entry),
    })?;
    let mut bindings = vec![Binding::from(y.buf)];
    bindings.extend(args.iter().map(|a| Binding::from(a.view().buf)));
    pass.dispatch(
        &pl,
        entry,
        &params,
        &bindings,
        grid((n as u32).div_ceil(WG)),
    );
    Ok(())
}

/// `y = a + b` on `[n_rows, n_cols]`.
pub fn add_rows(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    a: Operand<'_>,
    b: Operand<'_>,
) -> Result<()> {
    run(
        pass,
        "add",
        n_rows,
        n_cols,
        y,
        &[Arg::Rows(a), Arg::Rows(b)],
        0.0,
    )
}

/// `y = a ⊙ b`.
pub fn mul(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    a: Operand<'_>,
    b: Operand<'_>,
) -> Result<()> {
    run(
        pass,
        "mul",
        n_rows,
        n_cols,
        y,
        &[Arg::Rows(a), Arg::Rows(b)],
        0.0,
    )
}

/// `y = alpha · a`.
pub fn scale(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    a: Operand<'_>,
    alpha: f32,
) -> Result<()> {
    run(pass, "scale", n_rows, n_cols, y, &[Arg::Rows(a)], alpha)
}

/// `y = a` (a strided copy; use `Pass::copy` for plain byte ranges).
pub fn copy(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    a: Operand<'_>,
) -> Result<()> {
    run(pass, "copy", n_rows, n_cols, y, &[Arg::Rows(a)], 0.0)
}

/// `y = silu(a) = a / (1 + e^−a)`.
pub fn silu(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    a: Operand<'_>,
) -> Result<()> {
    run(pass, "silu_op", n_rows, n_cols, y, &[Arg::Rows(a)], 0.0)
}

/// `y = sigmoid(a)`.
pub fn sigmoid(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    a: Operand<'_>,
) -> Result<()> {
    run(pass, "sigmoid_op", n_rows, n_cols, y, &[Arg::Rows(a)], 0.0)
}

/// SwiGLU `y = silu(g) ⊙ u`; with `limit` DeepSeek-V4's clamps `g ← min(g, limit)`,
/// `u ← clamp(u, ±limit)` (`cpu::ops::swiglu`).
pub fn swiglu(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    g: Operand<'_>,
    u: Operand<'_>,
    limit: Option<f32>,
) -> Result<()> {
    let limit = limit.unwrap_or(f32::MAX);
    if limit.is_nan() || limit < 0.0 {
        return Err(Error::Invalid(format!(
            "swiglu: clamp limit {limit} must be ≥ 0"
        )));
    }
    run(
        pass,
        "swiglu",
        n_rows,
        n_cols,
        y,
        &[Arg::Rows(g), Arg::Rows(u)],
        limit,
    )
}

/// Step-3.5/3.7's clamped SwiGLU `y = min(silu(g), limit) ⊙ clamp(u, ±limit)`
/// (`cpu::ops::swiglu_act_clamp`): the limit bounds SiLU's output, where [`swiglu`]'s
/// DeepSeek clamp bounds its input.
pub fn swiglu_act_clamp(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    g: Operand<'_>,
    u: Operand<'_>,
    limit: f32,
) -> Result<()> {
    if limit.is_nan() || limit < 0.0 {
        return Err(Error::Invalid(format!(
            "swiglu_act_clamp: clamp limit {limit} must be ≥ 0"
        )));
    }
    run(
        pass,
        "swiglu_act_clamp",
        n_rows,
        n_cols,
        y,
        &[Arg::Rows(g), Arg::Rows(u)],
        limit,
    )
}

/// GeGLU `y = gelu_tanh(g) ⊙ u` (`cpu::ops::geglu`): Gemma's FFN activation.
pub fn geglu(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    g: Operand<'_>,
    u: Operand<'_>,
) -> Result<()> {
    run(
        pass,
        "geglu",
        n_rows,
        n_cols,
        y,
        &[Arg::Rows(g), Arg::Rows(u)],
        0.0,
    )
}

/// `y = cap · tanh(y / cap)` (`cpu::ops::softcap`): Gemma's final logit softcapping.
pub fn softcap_inplace(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    cap: f32,
) -> Result<()> {
    if !(cap.is_finite() && cap > 0.0) {
        return Err(Error::Invalid(format!(
            "softcap: cap {cap} must be a positive number"
        )));
    }
    run(pass, "softcap_inplace", n_rows, n_cols, y, &[], cap)
}

/// `y = sigmoid(g) ⊙ x`.
pub fn sigmoid_mul(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    g: Operand<'_>,
    x: Operand<'_>,
) -> Result<()> {
    run(
        pass,
        "sigmoid_mul",
        n_rows,
        n_cols,
        y,
        &[Arg::Rows(g), Arg::Rows(x)],
        0.0,
    )
}

/// `y[r] = sigmoid(g[r]) · x[r]` with one gate scalar per row (`g` row r at `g.off + r·stride`,
/// packed stride 1): Qwen's shared-expert gate.
pub fn sigmoid_mul_row(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    g: Operand<'_>,
    x: Operand<'_>,
) -> Result<()> {
    run(
        pass,
        "sigmoid_mul_row",
        n_rows,
        n_cols,
        y,
        &[Arg::Rows(x), Arg::Scalar(g)],
        0.0,
    )
}

/// `y += a` (the residual add).
pub fn add_inplace(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    a: Operand<'_>,
) -> Result<()> {
    run(pass, "add_inplace", n_rows, n_cols, y, &[Arg::Rows(a)], 0.0)
}

/// `y ⊙= a`.
pub fn mul_inplace(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    a: Operand<'_>,
) -> Result<()> {
    run(pass, "mul_inplace", n_rows, n_cols, y, &[Arg::Rows(a)], 0.0)
}

/// `y *= alpha`.
pub fn scale_inplace(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    alpha: f32,
) -> Result<()> {
    run(pass, "scale_inplace", n_rows, n_cols, y, &[], alpha)
}

/// `y ⊙= sigmoid(g)` (Qwen3.5 gated attention output `attn · sigmoid(gate)`).
pub fn sigmoid_mul_inplace(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    g: Operand<'_>,
) -> Result<()> {
    run(
        pass,
        "sigmoid_mul_inplace",
        n_rows,
        n_cols,
        y,
        &[Arg::Rows(g)],
        0.0,
    )
}

/// `y[r] *= sigmoid(g[r])`, one gate scalar per row.
pub fn sigmoid_mul_row_inplace(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    g: Operand<'_>,
) -> Result<()> {
    run(
        pass,
        "sigmoid_mul_row_inplace",
        n_rows,
        n_cols,
        y,
        &[Arg::Scalar(g)],
        0.0,
    )
}

/// `y[r] += w[r] · x[r]`, one weight scalar per row (`w` row r at `w.off + r·stride`, packed
/// stride 1): the MoE combine of one expert slot, e.g. `w` = routing weights `[n_tok, k]`
/// viewed with `off = slot`, `stride = k`.
pub fn axpy_row(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    y: Operand<'_>,
    w: Operand<'_>,
    x: Operand<'_>,
) -> Result<()> {
    run(
        pass,
        "axpy_row",
        n_rows,
        n_cols,
        y,
        &[Arg::Rows(x), Arg::Scalar(w)],
        0.0,
    )
}

/// `y[r] += Σ_{s<k} w[r, s] · x[r, s]` in slot order: the MoE combine of all `k` expert slots in
/// one dispatch (what `k` [`axpy_row`] calls compute, one slot each). `x` row r holds the k
/// slots' rows of `n_cols` back to back (packed stride `k·n_cols`); `w` row r the k weights
/// (packed stride `k`).
pub fn moe_combine(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_cols: u32,
    k: u32,
    y: Operand<'_>,
    w: Operand<'_>,
    x: Operand<'_>,
) -> Result<()> {
    if k == 0 {
        return Ok(());
    }
    let slots = n_cols
        .checked_mul(k)
        .ok_or_else(|| Error::Invalid(format!("moe_combine: {k} slots of {n_cols} columns")))?;
    let x = Operand::strided(x.buf, x.off, x.stride_for(slots));
    let w = Operand::strided(w.buf, w.off, w.stride_for(k));
    x.check("moe_combine", "x", n_rows, slots)?;
    w.check("moe_combine", "w", n_rows, k)?;
    run_k(
        pass,
        "moe_combine",
        n_rows,
        n_cols,
        y,
        &[Arg::Rows(x), Arg::Scalar(w)],
        Scalars { alpha: 0.0, k },
    )
}
