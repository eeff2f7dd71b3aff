//! Hyper-connection kernels of DeepSeek-V4 (`shaders/hc.wgsl`). CPU reference: `cpu::hc`.
//!
//! The residual stream is `hc` copies per token: `x` [n_tok, hc, n_embd] f32, packed. Before
//! each block a matmul gives the mixes (`fn` [mix, hc·n_embd] times x), then [`pre`] turns
//! them into the block input `h` [n_tok, n_embd] (fold + weighted RMSNorm) and the
//! `(post, comb)` weights `pc` [n_tok, hc + hc·hc]; after the block [`post`] writes the new
//! copies in place. [`head`] is the final fold (sigmoid gate only) with the output norm.
//! Small weights (`base`, `scale`, norms) are F32 tensors in one buffer.

use super::{check_f32, check_len, grid, Binding, GpuTensor, Pass, PipelineSpec};
use crate::{Error, Result};

const SRC: &str = include_str!("../../shaders/hc.wgsl");
const WG: u32 = 256;

/// The family's pipeline keys ([`Gpu::pipeline_for`](super::Gpu::pipeline_for)) for `hc`
/// streams.
#[derive(PartialEq, Eq, Hash)]
enum Kernel {
    /// The pre-block fold, or the output head's (`head`).
    Fold {
        head: bool,
        hc: u32,
    },
    Post {
        hc: u32,
    },
}

impl super::PipelineKey for Kernel {
    fn source(&self) -> &'static str {
        SRC
    }
    fn entry(&self) -> &'static str {
        match self {
            Kernel::Fold { .. } => "fold",
            Kernel::Post { .. } => "post",
        }
    }
    fn label(&self) -> String {
        match *self {
            Kernel::Fold { head: true, hc } => format!("hc_head_hc{hc}"),
            Kernel::Fold { head: false, hc } => format!("hc_pre_hc{hc}"),
            Kernel::Post { hc } => format!("hc_post_hc{hc}"),
        }
    }
    fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
        let (flag, hc) = match *self {
            Kernel::Fold { head: true, hc } => ("HEAD", hc),
            Kernel::Fold { head: false, hc } => ("PRE", hc),
            Kernel::Post { hc } => ("POST", hc),
        };
        spec.define(flag, true).define("HC", format!("{hc}u"))
    }
}
/// Largest supported copy count (the kernels keep `hc·hc` values in registers).
pub const MAX_HC: u32 = 16;

/// Uniforms of `hc.wgsl` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n_tok: u32,
    n_embd: u32,
    /// Sinkhorn iterations.
    iters: u32,
    _pad0: u32,
    eps: f32,
    hc_eps: f32,
    _pad1: [u32; 2],
}
const _: () = assert!(std::mem::size_of::<Params>() == 32);

/// Sizes and constants of one model's hyper-connections.
#[derive(Clone, Copy, Debug)]
pub struct HcShape {
    pub n_embd: u32,
    /// Copies of the hidden state.
    pub hc: u32,
    /// Sinkhorn iterations (≥ 1).
    pub iters: u32,
    /// RMSNorm epsilon (the copies' RMS and the block norm).
    pub eps: f32,
    pub hc_eps: f32,
}

impl HcShape {
    /// Mixes per token of a block site: pre (hc) | post (hc) | comb (hc·hc).
    pub fn n_mix(&self) -> u32 {
        (2 + self.hc) * self.hc
    }
    /// Floats per token of `pc`: post (hc) | comb (hc·hc).
    pub fn pc_width(&self) -> u32 {
        self.hc + self.hc * self.hc
    }
    fn check(&self) -> Result<()> {
        if self.hc == 0 || self.hc > MAX_HC || self.n_embd == 0 || self.iters == 0 {
            return Err(Error::Invalid(format!(
                "hyper-connections: {} copies (1..={MAX_HC}) of {}, {} Sinkhorn iterations",
                self.hc, self.n_embd, self.iters
            )));
        }
        Ok(())
    }
}

/// Weights of one site: `base` [n_mix], `scale` [3] (block) or [1] (head), `norm` [n_embd].
#[derive(Clone, Copy)]
pub struct HcWeights<'a> {
    pub base: &'a GpuTensor,
    pub scale: &'a GpuTensor,
    pub norm: &'a GpuTensor,
}

/// What a fold reads: `n_tok` tokens' copies `x` [n_tok, hc, n_embd] and their unscaled
/// mixes (rows of [`HcShape::n_mix`] for a block site, of hc for the head).
#[derive(Clone, Copy)]
pub struct HcInput<'a> {
    pub n_tok: u32,
    pub x: &'a wgpu::Buffer,
    pub mixes: &'a wgpu::Buffer,
}

fn fold(
    pass: &mut Pass<'_>,
    s: &HcShape,
    head: bool,
    inp: HcInput<'_>,
    w: &HcWeights<'_>,
    h: &wgpu::Buffer,
    pc: Option<&wgpu::Buffer>,
) -> Result<()> {
    let HcInput { n_tok, x, mixes } = inp;
    s.check()?;
    let op = if head { "hc_head" } else { "hc_pre" };
    let n_mix = if head { s.hc } else { s.n_mix() };
    check_f32(op, w.base, n_mix as u64)?;
    check_f32(op, w.scale, if head { 1 } else { 3 })?;
    check_f32(op, w.norm, s.n_embd as u64)?;
    if n_tok == 0 {
        return Ok(());
    }
    let n = n_tok as u64;
    check_len(op, "x", x, n * (s.hc * s.n_embd) as u64)?;
    check_len(op, "mixes", mixes, n * n_mix as u64)?;
    check_len(op, "h", h, n * s.n_embd as u64)?;
    let pl = pass.gpu().pipeline_for(Kernel::Fold { head, hc: s.hc })?;
    let params = Params {
        n_tok,
        n_embd: s.n_embd,
        iters: s.iters,
        _pad0: 0,
        eps: s.eps,
        hc_eps: s.hc_eps,
        _pad1: [0; 2],
    };
    let mut b = vec![
        Binding::from(x),
        mixes.into(),
        (&w.base.parts[0].buffer).into(),
        (&w.scale.parts[0].buffer).into(),
        (&w.norm.parts[0].buffer).into(),
        h.into(),
    ];
    if let Some(pc) = pc {
        check_len(op, "pc", pc, n * s.pc_width() as u64)?;
        b.push(pc.into());
    }
    pass.dispatch(&pl, op, &params, &b, grid(n_tok));
    Ok(())
}

/// Block input of one site for `n` tokens: from the copies `x` [n, hc, n_embd] and the
/// unscaled mixes [n, (2+hc)·hc], write `h` [n, n_embd] = rmsnorm(Σ_j pre[j]·x[j])·norm and
/// `pc` [n, hc + hc·hc] = (post, Sinkhorn-normalised comb).
pub fn pre(
    pass: &mut Pass<'_>,
    s: &HcShape,
    inp: HcInput<'_>,
    w: &HcWeights<'_>,
    h: &wgpu::Buffer,
    pc: &wgpu::Buffer,
) -> Result<()> {
    fold(pass, s, false, inp, w, h, Some(pc))
}

/// The head's fold: mixes [n, hc] gate the copies (`σ(m·r·scale + base) + hc_eps`), then the
/// output norm: `h` [n, n_embd].
pub fn head(
    pass: &mut Pass<'_>,
    s: &HcShape,
    inp: HcInput<'_>,
    w: &HcWeights<'_>,
    h: &wgpu::Buffer,
) -> Result<()> {
    fold(pass, s, true, inp, w, h, None)
}

/// After a block: `x[j] = post[j]·blk + Σ_i comb[i][j]·x[i]` in place, `blk` [n, n_embd],
/// `pc` as written by [`pre`].
pub fn post(
    pass: &mut Pass<'_>,
    s: &HcShape,
    n_tok: u32,
    x: &wgpu::Buffer,
    blk: &wgpu::Buffer,
    pc: &wgpu::Buffer,
) -> Result<()> {
    s.check()?;
    if n_tok == 0 {
        return Ok(());
    }
    let n = n_tok as u64;
    check_len("hc_post", "x", x, n * (s.hc * s.n_embd) as u64)?;
    check_len("hc_post", "blk", blk, n * s.n_embd as u64)?;
    check_len("hc_post", "pc", pc, n * s.pc_width() as u64)?;
    let threads = n * s.n_embd as u64;
    if threads > (u32::MAX - WG) as u64 {
        return Err(Error::Invalid(format!(
            "hc_post: {threads} elements is too many for one dispatch"
        )));
    }
    let pl = pass.gpu().pipeline_for(Kernel::Post { hc: s.hc })?;
    let params = Params {
        n_tok,
        n_embd: s.n_embd,
        iters: s.iters,
        _pad0: 0,
        eps: s.eps,
        hc_eps: s.hc_eps,
        _pad1: [0; 2],
    };
    pass.dispatch(
        &pl,
        "hc_post",
        &params,
        &[Binding::from(x), blk.into(), pc.into()],
        grid((threads as u32).div_ceil(WG)),
    );
    Ok(())
}
