//! Score-function MoE router of DeepSeek-V3/V4 (`shaders/router.wgsl`): scores by softmax,
//! sigmoid or sqrt(softplus); top-k of score + bias, or a hash table's ids; weights =
//! the chosen unbiased scores, renormalised, times `route_scale`. CPU reference:
//! `cpu::router::route`. Also [`combine`]: the weighted sum of the routed experts' outputs
//! in one dispatch (CPU reference `cpu::router::combine`), and [`expert_scale`]: the chosen
//! weights times a per-expert factor (CPU reference `cpu::router::expert_scale`).

use super::operand::Operand;
use super::{grid, Binding, GpuTensor, Pass, PipelineSpec};
use crate::{DType, Error, Result};

const SRC: &str = include_str!("../../shaders/router.wgsl");

/// The family's pipeline keys ([`Gpu::pipeline_for`](super::Gpu::pipeline_for)), one variant
/// per kernel.
#[derive(PartialEq, Eq, Hash)]
enum Kernel {
    /// The router over `ne` (a power of two ≥ 64) expert slots.
    Route {
        ne: u32,
    },
    Combine,
    ExpertScale,
}

impl super::PipelineKey for Kernel {
    fn source(&self) -> &'static str {
        SRC
    }
    fn entry(&self) -> &'static str {
        match self {
            Kernel::Route { .. } => "main",
            Kernel::Combine => "combine",
            Kernel::ExpertScale => "expert_scale",
        }
    }
    fn label(&self) -> String {
        match self {
            Kernel::Route { ne } => format!("router_ne{ne}"),
            Kernel::Combine => "router_combine".into(),
            Kernel::ExpertScale => "router_expert_scale".into(),
        }
    }
    fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
        match *self {
            Kernel::Route { ne } => spec.define("NE", ne),
            Kernel::Combine => spec.define("COMBINE", true),
            Kernel::ExpertScale => spec.define("EXPERT_SCALE", true),
        }
    }
}
/// Most experts one router handles (workgroup memory: 3 × 4 bytes each).
pub const MAX_EXPERTS: u32 = 1024;

/// Uniforms of `router.wgsl` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n_tok: u32,
    n_exp: u32,
    k: u32,
    func: u32,
    /// In elements.
    logits_off: u32,
    logits_stride: u32,
    out_off: u32,
    out_stride: u32,
    /// In u32 elements.
    tok_off: u32,
    has_bias: u32,
    hash: u32,
    renorm: u32,
    route_scale: f32,
    _pad: [u32; 3],
}
const _: () = assert!(std::mem::size_of::<Params>() == 64);

/// Score function (model.py `score_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreFn {
    Softmax,
    Sigmoid,
    SqrtSoftplus,
}

/// How experts are chosen.
#[derive(Clone, Copy)]
pub enum Select<'a> {
    /// Top-k of score + `bias` (F32 [n_exp]) when given.
    TopK { bias: Option<&'a GpuTensor> },
    /// Row `tokens[tok_off + t]` of `table` (F32 expert ids [vocab, k]).
    Hash {
        table: &'a GpuTensor,
        tokens: &'a wgpu::Buffer,
        tok_off: u32,
    },
}

/// The rows of one router call: `n_tok` rows of `n_exp` logits in; `ids` (u32) and
/// `weights` (f32) rows of `k` out. Also what `topk::router_softmax_topk` takes.
#[derive(Clone, Copy)]
pub struct RouterRows<'a> {
    pub n_tok: u32,
    pub n_exp: u32,
    pub k: u32,
    pub logits: Operand<'a>,
    pub ids: Operand<'a>,
    pub weights: Operand<'a>,
}

/// How [`route`] scores and picks: the score function, the selection, whether the chosen
/// weights are renormalised to sum 1, and the factor they are multiplied by after.
#[derive(Clone, Copy)]
pub struct Scoring<'a> {
    pub func: ScoreFn,
    pub select: Select<'a>,
    pub renorm: bool,
    pub route_scale: f32,
}

/// One router call over `rows` as `how` says.
pub fn route(pass: &mut Pass<'_>, rows: &RouterRows<'_>, how: &Scoring<'_>) -> Result<()> {
    let RouterRows {
        n_tok,
        n_exp,
        k,
        logits,
        ids,
        weights,
    } = *rows;
    let Scoring {
        func,
        select,
        renorm,
        route_scale,
    } = *how;
    if n_exp == 0 || n_exp > MAX_EXPERTS || k == 0 || k > n_exp {
        return Err(Error::Invalid(format!(
            "router: {n_exp} experts (1..={MAX_EXPERTS}), k = {k}"
        )));
    }
    if n_tok == 0 {
        return Ok(());
    }
    logits.check("router", "logits", n_tok, n_exp)?;
    ids.check("router", "ids", n_tok, k)?;
    weights.check("router", "weights", n_tok, k)?;
    if ids.stride_for(k) != weights.stride_for(k) || ids.off != weights.off {
        return Err(Error::Invalid(
            "router: ids and weights must share offset and stride".into(),
        ));
    }
    let f32_of = |w: &GpuTensor, n: u64| -> Result<()> {
        if w.dtype != DType::F32 || w.n_rows() * w.row_len() != n || w.parts.len() != 1 {
            return Err(Error::Invalid(format!(
                "router: `{}` is {} {:?}, expected F32 with {n} elements in one buffer",
                w.name, w.dtype, w.shape
            )));
        }
        Ok(())
    };
    // Unused bindings get a buffer the dispatch already reads (the layout keeps them all).
    let stand_in = logits.buf;
    let (bias, table, tokens, tok_off, has_bias, hash) = match select {
        Select::TopK { bias } => {
            if let Some(b) = bias {
                f32_of(b, n_exp as u64)?;
            }
            (
                bias.map_or(stand_in, |b| &b.parts[0].buffer),
                stand_in,
                stand_in,
                0,
                bias.is_some(),
                false,
            )
        }
        Select::Hash {
            table,
            tokens,
            tok_off,
        } => {
            if table.dtype != DType::F32 || table.row_len() != k as u64 || table.parts.len() != 1 {
                return Err(Error::Invalid(format!(
                    "router: hash table `{}` is {} {:?}, expected F32 [vocab, {k}] in one buffer",
                    table.name, table.dtype, table.shape
                )));
            }
            if (tok_off as u64 + n_tok as u64) * 4 > tokens.size() {
                return Err(Error::Invalid(
                    "router: token ids run past their buffer".into(),
                ));
            }
            (
                stand_in,
                &table.parts[0].buffer,
                tokens,
                tok_off,
                false,
                true,
            )
        }
    };
    let ne = n_exp.next_power_of_two().max(64);
    let pl = pass.gpu().pipeline_for(Kernel::Route { ne })?;
    let params = Params {
        n_tok,
        n_exp,
        k,
        func: match func {
            ScoreFn::Softmax => 0,
            ScoreFn::Sigmoid => 1,
            ScoreFn::SqrtSoftplus => 2,
        },
        logits_off: logits.off,
        logits_stride: logits.stride_for(n_exp),
        out_off: ids.off,
        out_stride: ids.stride_for(k),
        tok_off,
        has_bias: has_bias as u32,
        hash: hash as u32,
        renorm: renorm as u32,
        route_scale,
        _pad: [0; 3],
    };
    pass.dispatch(
        &pl,
        "router",
        &params,
        &[
            Binding::from(logits.buf),
            bias.into(),
            table.into(),
            tokens.into(),
            ids.buf.into(),
            weights.buf.into(),
        ],
        grid(n_tok),
    );
    Ok(())
}

/// Uniforms of `combine`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct CombineParams {
    n_tok: u32,
    n_embd: u32,
    k: u32,
    _pad: u32,
}
const _: () = assert!(std::mem::size_of::<CombineParams>() == 16);

/// `y[t] += Σ_s w[t·k + s]·x[t·k + s]` in slot order, for `n_tok` tokens: `y` [n, n_embd],
/// `w` [n, k] (router weights), `x` [n·k, n_embd] (expert outputs), all packed from 0.
pub fn combine(
    pass: &mut Pass<'_>,
    n_tok: u32,
    n_embd: u32,
    k: u32,
    y: &wgpu::Buffer,
    w: &wgpu::Buffer,
    x: &wgpu::Buffer,
) -> Result<()> {
    if n_tok == 0 {
        return Ok(());
    }
    let n = n_tok as u64 * n_embd as u64;
    for (what, b, elems) in [
        ("y", y, n),
        ("w", w, n_tok as u64 * k as u64),
        ("x", x, n * k as u64),
    ] {
        if elems * 4 > b.size() {
            return Err(Error::Invalid(format!(
                "moe combine: {what} needs {elems} f32, its buffer holds {}",
                b.size() / 4
            )));
        }
    }
    if n > (u32::MAX - 256) as u64 {
        return Err(Error::Invalid("moe combine: too many elements".into()));
    }
    let pl = pass.gpu().pipeline_for(Kernel::Combine)?;
    let prm = CombineParams {
        n_tok,
        n_embd,
        k,
        _pad: 0,
    };
    pass.dispatch(
        &pl,
        "moe_combine",
        &prm,
        &[Binding::from(y), w.into(), x.into()],
        grid((n as u32).div_ceil(256)),
    );
    Ok(())
}

/// Uniforms of `expert_scale`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct ScaleParams {
    n: u32,
    n_exp: u32,
    _pad: [u32; 2],
}
const _: () = assert!(std::mem::size_of::<ScaleParams>() == 16);

/// `w[i] *= scale[ids[i]]` for the `n` (token, slot) pairs of a router's output: `w` f32 and
/// `ids` u32 `[n]` packed from 0, `scale` F32 `[n_exp]` (Gemma-4's per-expert output scales,
/// HF `Gemma4TextRouter.per_expert_scale`). Ids at or past `n_exp` keep their weight.
pub fn expert_scale(
    pass: &mut Pass<'_>,
    n: u32,
    w: &wgpu::Buffer,
    ids: &wgpu::Buffer,
    scale: &GpuTensor,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let n_exp = scale.n_rows() * scale.row_len();
    if scale.dtype != DType::F32 || scale.parts.len() != 1 || n_exp > u32::MAX as u64 {
        return Err(Error::Invalid(format!(
            "expert_scale: `{}` is {} {:?}, expected F32 in one buffer",
            scale.name, scale.dtype, scale.shape
        )));
    }
    for (what, b) in [("w", w), ("ids", ids)] {
        if n as u64 * 4 > b.size() {
            return Err(Error::Invalid(format!(
                "expert_scale: {what} needs {n} elements, its buffer holds {}",
                b.size() / 4
            )));
        }
    }
    if n > u32::MAX - 256 {
        return Err(Error::Invalid("expert_scale: too many pairs".into()));
    }
    let pl = pass.gpu().pipeline_for(Kernel::ExpertScale)?;
    let prm = ScaleParams {
        n,
        n_exp: n_exp as u32,
        _pad: [0; 2],
    };
    pass.dispatch(
        &pl,
        "expert_scale",
        &prm,
        &[
            Binding::from(w),
            ids.into(),
            (&scale.parts[0].buffer).into(),
        ],
        grid(n.div_ceil(256)),
    );
    Ok(())
}
