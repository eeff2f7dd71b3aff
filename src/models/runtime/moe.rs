//! The routed-experts block of every family's MoE layer, written once: the router product
//! in f32 (`MatvecOpts::exact`: a near-tie must not flip on rounding), the pick of a
//! [`Router`] kind, an optional per-expert output scale, the experts' unweighted rows of a
//! gated activation ([`Glu`]), then their weighted sum in slot order (`moe`'s summation
//! contract, the same with and without offload). The experts run stacked on the GPU, or
//! through the expert arena and the CPU (`moe::Offload`) where the planner left some cold.

use crate::gpu::elementwise as ew;
use crate::gpu::matmul::{self, MoeRoute};
use crate::gpu::matvec::MatvecOpts;
use crate::gpu::moe::{routed_ffn_glu, ExpertStacks, FfnBufs, Glu, Picks};
use crate::gpu::operand::Operand;
use crate::gpu::router::{self, RouterRows, ScoreFn, Scoring, Select};
use crate::gpu::{topk, GpuTensor, Pass};
use crate::moe::Offload;
use crate::Result;

/// How the router turns a row's logits into `k` experts and their weights.
#[derive(Clone, Copy)]
pub enum Router<'a> {
    /// Softmax over all experts, top-k, renormalised to sum 1 when `renorm` (Qwen, Gemma).
    Softmax { renorm: bool },
    /// Sigmoid scores, top-k of score + `bias`, the chosen unbiased scores renormalised when
    /// `renorm`, times `scale` (Step's `moe_router_scaling_factor`).
    Sigmoid {
        bias: Option<&'a GpuTensor>,
        renorm: bool,
        scale: f32,
    },
}

/// The family's scratch the block runs in (f32 unless said): `logits` `[rows, n_expert]`,
/// `ids` (u32) and `weights` `[rows, k]`, the experts' buffers, and the route the tiled
/// path groups pairs by (made for MoE models).
pub struct MoeScratch<'a> {
    pub logits: &'a wgpu::Buffer,
    pub ids: &'a wgpu::Buffer,
    pub weights: &'a wgpu::Buffer,
    pub ffn: FfnBufs<'a>,
    pub route: Option<&'a MoeRoute>,
}

/// One layer's routed experts: router `[n_expert, n_embd]`, `k` picked per row, each
/// expert's output times `expert_scale[e]` (F32 `[n_expert]`) where given.
pub struct MoeLayer<'a> {
    /// The layer's index (the offload's placement is by layer).
    pub layer: usize,
    pub n_embd: u32,
    pub n_expert: u32,
    pub k: u32,
    pub router_w: &'a GpuTensor,
    pub router: Router<'a>,
    pub expert_scale: Option<&'a GpuTensor>,
    pub glu: Glu,
    pub stacks: ExpertStacks<'a>,
}

impl MoeLayer<'_> {
    /// Route and run the experts over the `n` rows of `x`, their weighted sum added to `acc`.
    pub fn run(
        &self,
        pass: &mut Pass<'_>,
        sc: &MoeScratch<'_>,
        offload: Option<&Offload>,
        (x, acc): (&wgpu::Buffer, &wgpu::Buffer),
        n: u32,
    ) -> Result<()> {
        self.route(pass, sc, x, n)?;
        self.experts(pass, sc, offload, (x, acc), n)
    }

    /// The router over the `n` rows of `x`: each row's `k` expert ids and weights into
    /// `sc.ids` / `sc.weights`.
    pub fn route(
        &self,
        pass: &mut Pass<'_>,
        sc: &MoeScratch<'_>,
        x: &wgpu::Buffer,
        n: u32,
    ) -> Result<()> {
        let exact = MatvecOpts {
            exact: true,
            ..Default::default()
        };
        let logits = Operand::new(sc.logits, 0);
        matmul::matmul_opts(pass, self.router_w, Operand::new(x, 0), logits, n, &exact)?;
        let rows = RouterRows {
            n_tok: n,
            n_exp: self.n_expert,
            k: self.k,
            logits,
            ids: Operand::new(sc.ids, 0),
            weights: Operand::new(sc.weights, 0),
        };
        match self.router {
            Router::Softmax { renorm } => topk::router_softmax_topk(pass, &rows, renorm)?,
            Router::Sigmoid {
                bias,
                renorm,
                scale,
            } => {
                let how = Scoring {
                    func: ScoreFn::Sigmoid,
                    select: Select::TopK { bias },
                    renorm,
                    route_scale: scale,
                };
                router::route(pass, &rows, &how)?
            }
        }
        match self.expert_scale {
            Some(s) => router::expert_scale(pass, n * self.k, sc.weights, sc.ids, s),
            None => Ok(()),
        }
    }

    /// The experts [`route`](Self::route) picked over the `n` rows of `x`, their weighted
    /// sum added to `acc` (`[n, n_embd]`).
    pub fn experts(
        &self,
        pass: &mut Pass<'_>,
        sc: &MoeScratch<'_>,
        offload: Option<&Offload>,
        (x, acc): (&wgpu::Buffer, &wgpu::Buffer),
        n: u32,
    ) -> Result<()> {
        let (l, e, k, glu, bufs) = (self.layer, self.n_embd, self.k, self.glu, &sc.ffn);
        let mut combine = |p: &mut Pass<'_>| -> Result<()> {
            ew::moe_combine(
                p,
                n,
                e,
                k,
                Operand::new(acc, 0),
                Operand::new(sc.weights, 0),
                Operand::new(bufs.out, 0),
            )
        };
        match offload.filter(|o| o.has_layer(l)) {
            Some(off) => {
                let cold = off.route(pass, l, sc.ids, x, n)?;
                off.hot_ffn_glu(pass, l, x, n, bufs, glu)?;
                off.cold_ffn_glu(pass, cold, bufs, glu, Some(&mut combine))
            }
            None => {
                let picks = Picks {
                    ids: sc.ids,
                    route: sc.route.expect("route made for MoE models"),
                    n,
                    k,
                };
                routed_ffn_glu(pass, &self.stacks, x, &picks, bufs, glu)?;
                combine(pass)
            }
        }
    }
}
