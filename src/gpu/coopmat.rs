//! Products of many tokens on the matrix units (`shaders/matmul_coop.wgsl`, on the pieces of
//! `matvec.wgsl`): cooperative matrices of 16x16x16 with f16 inputs and f32 accumulation, for
//! every stored type but F32. Same contract as the tiled kernels of [`super::matmul`]: dense
//! `Y[t, r] (=|+=) Σ_c W[r, c] X[t, c]` and the MoE form over a [`MoeRoute`].
//!
//! Each product is two dispatches: `coop_x` stages X as f16 rows (a power-of-two scale per row,
//! so no value overflows f16 and the scale leaves the result exactly), then the matrix kernel.
//! Numerics: weights round to f16 once (quantized blocks, FP8 blocks: relative 2^-11 at most;
//! F16 and BF16 weights are exact in f16), activations round to f16, or, for F16/BF16 weights,
//! split into two f16 parts whose sum holds ~22 bits, so float weights keep f32-level products.
//! F32 weights stay on the tiled f32 kernel: f16 would round every weight.
//!
//! [`Precision::Split`] (`--matmul coop-split`) splits every operand into two f16 parts (~22
//! bits each; three products into two accumulators), so quantized weights too get f32-level
//! products: a MoE router or DeepSeek's indexer picks its top-k from values that f16 rounding
//! upstream moves across near-ties (the fixture bars of the MoE and DeepSeek-V4 files hold on
//! it, not on [`Precision::F16`]). On the H200 it runs at the tiled kernel's speed.
//! [`Precision::XSplit`] (`--matmul coop-xsplit`) is the same exact product on the 8-subgroup
//! tile of 128 rows x 128 tokens with all four operand tiles (weights and x, hi and lo) staged
//! in workgroup memory, three products per step into one set of accumulators, where
//! coop-split's 64 x 64 tile reads x from L2. H200, 2026-12-03, 12288x4096 x 512 tokens
//! (TFLOP/s): Q4_K 63.2 against coop-split 26.2 and tiled 23.2, Q6_K 56.9 against 23.3, Q8_0
//! 52.2 against 22.0 and tiled 21.1. It covers dense products of split weights; dense MXFP4
//! weights (exact in f16: no third product) take coop-split's kernel, MoE products the tiled
//! f32 one ([`usable_indexed`]).
//! [`Precision::SplitX`] (`--matmul coop-splitx`) splits the activations only: two products
//! per step on f16 weights. It holds the committed Qwen3.5 MoE fixture bars (not DeepSeek-V4's)
//! but missed the bar on a Q8_0 35B-A3B-shaped file, so `auto` no longer takes it (H200,
//! 2026-12-03, 35B-A3B Q4_K_M pp512: 3265 tok/s against 2927 tiled and 2585 coop-split).
//!
//! Staging lives in device scratch buffers (`Gpu::scratch`): X as f16,
//! with `halves` = the row's 32-weight chunks rounded up to pairs, times 32 (`[rows + 128,
//! halves]`: a tile reads 128 rows from its first); one f32 scale per row.

use super::matvec::{check_span, x_vec, BlockType, Geometry, MatvecOpts};
use super::moe_route::{MoeRoute, RoutePairs};
use super::operand::Operand;
use super::{
    grid, Binding, Gpu, GpuTensor, MatmulPath, Pass, PipelineKey, PipelineSpec, StaticDefines,
    StaticName, MAX_GROUPS,
};
use crate::dtype::DType;
use crate::{Error, Result};
use std::sync::Arc;

pub(crate) const SRC: &str = include_str!("../../shaders/matmul_coop.wgsl");

/// Subgroups per workgroup (`NSG`): 8 (128 rows per workgroup), or 4 (64 rows) when 128-row
/// tiles would leave the GPU short of workgroups.
const NSG_BIG: u32 = 8;
const NSG_SMALL: u32 = 4;
/// Workgroups of 128-row tiles below which a dense product takes 64-row tiles: one per
/// multiprocessor of an H200 (132). H200, 4096 x 12288 Q4_K at 512 tokens (128 big tiles): 0.48 ms
/// on 128-row tiles (x staged in workgroup memory) against 0.72 on 64-row ones.
const FILL: u32 = 128;

/// MoE products with fewer pairs per expert than this on average take [`THIN`] tiles
/// (measured on the H200: DeepSeek-V4's 6 pairs per expert ran 2.5x faster on them, the
/// 35B-A3B's 16 per expert 1.3x slower: two thin workgroups decode the same weights; at
/// DeepSeek-V4's 12 of a 512-row pass the 64-pair tiles multiply fragments three quarters
/// empty: each of its three 8-layer expert products took 42 ms on thin tiles with vector
/// weight stores, against 74 on 64-pair tiles with scalar ones).
pub const THIN_PAIRS: u32 = 14;
/// Tokens per workgroup of the dense kernel (`CBN`); the MoE kernel takes the route's tiles of
/// [`super::matmul`]'s 64 pairs.
const CBN_DENSE: u32 = 128;
const CBN_ID: u32 = 64;
/// Staged rows read past the last valid one: a tile reads CBN rows from its first.
const ROW_PAD: u32 = CBN_DENSE;

/// The precision products of `dtype` weights take on the matrix units of `gpu`; `None` where
/// they run elsewhere.
pub fn usable(gpu: &Gpu, dtype: DType) -> Option<Precision> {
    Precision::of(gpu).filter(|_| dtype != DType::F32)
}

/// [`usable`] for the MoE form. At [`Precision::XSplit`] the experts take the tiled f32
/// kernel (exact as well): coop-split's 64-pair tile is slower than it. H200, 2026-12-03,
/// Qwen3.5-35B-A3B Q4_K_M pp512 (tok/s): dense on XSTAGE + experts tiled 3527, all tiled 2915,
/// all coop-split 2593; DeepSeek-V4-Flash 8 layers 2611 / 2407 / 2392.
pub fn usable_indexed(gpu: &Gpu, dtype: DType) -> Option<Precision> {
    usable(gpu, dtype).filter(|&p| p != Precision::XSplit)
}

/// How the operands of a product reach the f16 matrix units.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Weights round to f16 (F16 / BF16 weights are exact; their activations split in two).
    F16,
    /// Weights and activations each split into two f16 parts (f32-level products).
    Split,
    /// [`Precision::Split`] with dense products of split weights on the XSTAGE tile (x and
    /// the split weights staged in workgroup memory).
    XSplit,
    /// Weights round to f16, activations split into two f16 parts (two products per step):
    /// the weights' rounding alone.
    SplitX,
}

impl Precision {
    /// The precision of `gpu`'s matrix path; `None` where it has none.
    pub fn of(gpu: &Gpu) -> Option<Precision> {
        match gpu.matmul_path() {
            MatmulPath::Coop => Some(Precision::F16),
            MatmulPath::CoopSplit => Some(Precision::Split),
            MatmulPath::CoopXSplit => Some(Precision::XSplit),
            MatmulPath::CoopSplitX => Some(Precision::SplitX),
            _ => None,
        }
    }
}

/// F16 and BF16 weights are exact in f16: their products, and every product at
/// [`Precision::Split`], take the split (hi + lo) activations.
fn split_x(dtype: DType, prec: Precision) -> bool {
    matches!(dtype, DType::F16 | DType::BF16) || prec != Precision::F16
}

/// Weights that f16 does not hold exactly split too at [`Precision::Split`] and
/// [`Precision::XSplit`] (`WSPLIT`).
/// MXFP4 values are E2M1 codes times a power of two (OCP MX spec: 3 significant bits), exact
/// in f16 for scales 2^-23..2^13 (every real weight): their low part would be zero, so they
/// skip the third product.
fn split_w(dtype: DType, prec: Precision) -> bool {
    matches!(prec, Precision::Split | Precision::XSplit)
        && !matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::MXFP4)
}

/// Staged activations of one product.
struct Staged {
    xh: wgpu::Buffer,
    xl: Option<wgpu::Buffer>,
    sc: wgpu::Buffer,
}

/// A kernel variant: the MoE form or not, tokens per workgroup (`CBN`), subgroups (`NSG`),
/// and the operands' precision.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Tile {
    id: bool,
    cbn: u32,
    nsg: u32,
    prec: Precision,
}

const MOE: Tile = Tile {
    id: true,
    cbn: CBN_ID,
    nsg: NSG_BIG,
    prec: Precision::F16,
};

/// The dense tile (and the staging kernel's, which ignores the tile but for precision).
const STAGE: Tile = Tile {
    id: false,
    cbn: CBN_DENSE,
    nsg: NSG_BIG,
    prec: Precision::F16,
};

/// Split weights take two staged tiles: 4 subgroups of 64 rows x 16 tokens fit the
/// workgroup memory with both double-buffered (see the shader's budget).
const SPLIT_W: Tile = Tile {
    id: false,
    cbn: 64,
    nsg: NSG_SMALL,
    prec: Precision::Split,
};

/// Few pairs per expert (MoE prefill of a few hundred tokens over hundreds of experts): 16
/// pairs per workgroup, 2 subgroups of 64 rows, so the route's mostly empty 64-pair tiles
/// cost no multiply-adds for their empty part (one staged buffer: the split weights' two
/// tiles of 128 rows fill the workgroup memory). The tile is bound by workgroups in flight,
/// not by the decode: H200, DeepSeek-V4 8 layers at 512 rows, the MXFP4 experts' three
/// products took 120 ms as this, 179 with the tile's x staged in workgroup memory too, 199
/// double-buffered (38 KiB a workgroup), 136 on 4 subgroups of 32 rows (124 with x staged),
/// 244 on 8 subgroups of 16.
const THIN: Tile = Tile {
    id: true,
    cbn: 16,
    nsg: 2,
    prec: Precision::F16,
};

impl Tile {
    fn thin(&self) -> bool {
        self.cbn == THIN.cbn
    }

    /// Rows per workgroup (`CBM`): NSG / 4 subgroups of 64 rows, or NSG of them when thin.
    fn rows(&self) -> u32 {
        if self.thin() {
            64 * self.nsg
        } else {
            16 * self.nsg
        }
    }
}

/// The product tile for weights of `dtype`: `t` unless they split.
fn product_tile(t: Tile, dtype: DType) -> Tile {
    if split_w(dtype, t.prec) && !t.thin() {
        Tile {
            id: t.id,
            ..SPLIT_W
        }
    } else {
        t
    }
}

/// Typed key of the family's kernels: the weights' type, the entry point, the x loads, the
/// tile and the kernel lab's defines ([`MatvecOpts::defines`]).
#[derive(PartialEq, Eq, Hash)]
struct Coop {
    ty: BlockType,
    entry: StaticName,
    /// x read as 16-byte vectors.
    xvec: bool,
    /// The element-by-element paths of misaligned float rows.
    slow: bool,
    tile: Tile,
    extra: StaticDefines,
}

/// The key of `entry`'s variant for weights of `geo`.
fn key(
    geo: &Geometry,
    entry: &'static str,
    xvec: bool,
    t: Tile,
    extra: &'static [(&'static str, &'static str)],
) -> Coop {
    Coop {
        ty: geo.block_type(),
        entry: StaticName(entry),
        xvec,
        slow: geo.misaligned(),
        tile: t,
        extra: StaticDefines(extra),
    }
}

/// What a [`Coop`] key's variant stages and splits.
struct Flags {
    /// Split activations (`SPLIT`).
    sp: bool,
    /// Split weights.
    sw: bool,
    /// x (and split weights) staged in workgroup memory (`XSTAGE`).
    xs: bool,
    /// Split weights on the XSTAGE tile (`XSPLIT`).
    xsplit: bool,
}

impl Coop {
    fn flags(&self) -> Flags {
        let (entry, t, extra) = (self.entry.0, self.tile, self.extra.0);
        let sp = split_x(self.ty.dtype, t.prec);
        let sw = split_w(self.ty.dtype, t.prec) && entry != "coop_x";
        // products of f16 operands in one accumulator on 8-subgroup tiles stage x through
        // workgroup memory too: H200, 512 tokens, 12288 x 4096 Q4_K 0.52 ms against 0.83 with x
        // fragments from L2; 4-subgroup tiles (64 rows share each copy) ran 4096 x 12288 in 1.04
        // against 0.72 ms, so they keep L2. The kernel lab's LAB_NOXSTAGE keeps L2 for comparison.
        // Without the decode (LAB_NODECODE) this tile takes 0.355 ms (145 TFLOP/s): Q4_K 0.455,
        // Q6_K 0.570, MXFP4 0.551, Q8_0 0.710. Measured slower on the H200 and dropped: weights
        // decoded once into an f16 copy that every token tile then copies (0.662 ms for every
        // type; 9B prefill 4520 against 5800 tok/s), and 4 subgroups of 64 rows x 64 tokens on
        // the same 128 x 128 tile (Q4_K 0.649 ms).
        let lab_l2 = extra.iter().any(|(n, _)| *n == "LAB_NOXSTAGE");
        let big = entry != "coop_x" && !t.thin() && t.nsg == NSG_BIG;
        // split weights on the XSTAGE tile: `coop-xsplit` (or the kernel lab's LAB_XSPLIT)
        let xsplit = big && sw && !t.id && xsplit_tile(t.prec, extra);
        let xs = (big && !sp && !sw && !lab_l2) || xsplit;
        Flags { sp, sw, xs, xsplit }
    }
}

impl super::PipelineKey for Coop {
    fn source(&self) -> &'static str {
        SRC
    }
    fn entry(&self) -> &'static str {
        self.entry.0
    }
    fn label(&self) -> String {
        let (t, f) = (self.tile, self.flags());
        let mut label = format!(
            "{}_{}{}{}{}{}{}_n{}_g{}",
            self.entry.0,
            self.ty.label(self.xvec, self.slow),
            if t.id { "_id" } else { "" },
            if f.sp { "_split" } else { "" },
            if f.sw { "_wsplit" } else { "" },
            if f.xs { "_xstage" } else { "" },
            if f.xsplit { "_xsplit" } else { "" },
            t.cbn,
            t.nsg
        );
        for (n, v) in self.extra.0 {
            label += &format!("_{n}={v}");
        }
        label
    }
    fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
        let (t, f) = (self.tile, self.flags());
        let mut s = self
            .ty
            .defines(spec, self.xvec, self.slow)
            .define("CBN", format!("{}u", t.cbn))
            .define("NSG", format!("{}u", t.nsg))
            .define("TT", format!("{}u", (t.cbn / 64).max(1)))
            .define("TT2", t.cbn == 128)
            .define("THIN", t.thin())
            .define("SPLIT", f.sp)
            .define("WSPLIT", f.sw && !f.xsplit)
            .define("XSTAGE", f.xs)
            .define("XSPLIT", f.xsplit)
            .define("ID", t.id);
        for (n, v) in self.extra.0 {
            s = s.define(n, v);
        }
        s
    }
    // The kernel lab's LAB_UNCHECKED compiles the product without naga's bounds checks, to
    // time what the clamps cost (naga's `Restrict` policy puts a `UMin` on every
    // workgroup-array index: 18 in the XSTAGE tile, one per fragment load and staging store).
    // Its workgroup indices are constant tile offsets plus lane and subgroup ids below the
    // workgroup size, so in range; its storage reads are clamped in the shader (weight rows to
    // `p.rows - 1`, staged x rows padded by ROW_PAD, stores guarded by `row < p.rows`).
    fn unchecked(&self) -> bool {
        self.entry.0 != "coop_x" && self.extra.0.iter().any(|(n, _)| *n == "LAB_UNCHECKED")
    }
}

fn pipeline(
    gpu: &Gpu,
    geo: &Geometry,
    entry: &'static str,
    xvec: bool,
    t: Tile,
    extra: &'static [(&'static str, &'static str)],
) -> Result<Arc<wgpu::ComputePipeline>> {
    gpu.pipeline_for(key(geo, entry, xvec, t, extra))
}

/// Whether dense products of split weights at `prec` take the 8-subgroup XSTAGE tile of 128
/// rows x 128 tokens with all four operand tiles (weights and x, hi and lo) in workgroup
/// memory, one buffer, instead of [`SPLIT_W`]'s 64 x 64 tile with x from L2: at
/// [`Precision::XSplit`], or at [`Precision::Split`] with the kernel lab's `LAB_XSPLIT` among
/// `extra` (bench_kernels times both tiles of one path).
fn xsplit_tile(prec: Precision, extra: &[(&str, &str)]) -> bool {
    prec == Precision::XSplit || extra.iter().any(|(n, _)| *n == "LAB_XSPLIT")
}

/// Every variant a weight of `dtype` with rows of `cols` compiles (staging and product, dense
/// and MoE, vector and scalar x), without a device: for the naga validation and translation
/// test, since adapters without cooperative matrices (lavapipe in CI) never compile them.
pub fn variant_specs(dtype: DType, cols: u64) -> Result<Vec<PipelineSpec>> {
    let mut v = Vec::new();
    for id in [false, true] {
        let w = GpuTensor {
            name: format!("{dtype} x {cols}"),
            dtype,
            shape: if id {
                vec![4, 16, cols]
            } else {
                vec![16, cols]
            },
            parts: Vec::new(),
        };
        let geo = Geometry::of(&w, id)?;
        for xvec in [false, true] {
            for prec in [Precision::F16, Precision::Split, Precision::SplitX] {
                v.push(key(&geo, "coop_x", xvec, Tile { id, prec, ..STAGE }, &[]).spec());
                if id {
                    for t in [MOE, THIN] {
                        let t = product_tile(Tile { prec, ..t }, dtype);
                        v.push(key(&geo, "matmul_coop_id", xvec, t, &[]).spec());
                    }
                } else {
                    for nsg in [NSG_BIG, NSG_SMALL] {
                        let t = product_tile(Tile { nsg, prec, ..STAGE }, dtype);
                        v.push(key(&geo, "matmul_coop", xvec, t, &[]).spec());
                    }
                    // coop-xsplit's dense tile (its staging and MoE tiles are Split's)
                    if split_w(dtype, prec) {
                        let t = Tile {
                            nsg: NSG_BIG,
                            prec: Precision::XSplit,
                            ..STAGE
                        };
                        v.push(key(&geo, "matmul_coop", xvec, t, &[]).spec());
                    }
                }
            }
        }
    }
    Ok(v)
}

/// Halves per staged row: the row's chunks rounded up to the kernel's steps of two.
fn staged_halves(geo: &Geometry) -> u32 {
    geo.n_items(false).div_ceil(2) * 64
}

/// Stage `base.n_tokens` x rows as f16 (`coop_x`): rows `x_off + i * x_stride` of `base`, or
/// with a route the pairs in its grouped order; `xvec`: x read as vectors.
fn stage(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    geo: &Geometry,
    (x, xvec): (&wgpu::Buffer, bool),
    base: super::matvec::Params,
    route: Option<&MoeRoute>,
    prec: Precision,
) -> Result<Staged> {
    let n_rows = base.n_tokens;
    let gpu = pass.gpu();
    let halves = staged_halves(geo) as u64;
    let rows = n_rows as u64 + ROW_PAD as u64;
    let xh_bytes = rows * halves * 2;
    if xh_bytes > gpu.max_binding() {
        return Err(Error::Invalid(format!(
            "{}: {n_rows} staged rows of {halves} halves exceed the binding limit",
            w.name
        )));
    }
    let xh = gpu.scratch("coop_xh", xh_bytes)?;
    let xl = if split_x(geo.dtype, prec) {
        Some(gpu.scratch("coop_xl", xh_bytes)?)
    } else {
        None
    };
    let sc = gpu.scratch("coop_sc", rows * 4)?;
    let t = Tile {
        id: route.is_some(),
        prec,
        ..STAGE
    };
    let pipe = pipeline(gpu, geo, "coop_x", xvec, t, &[])?;
    let prm = base;
    let mut slots = vec![
        (3, Binding::from(x)),
        (9, Binding::from(&xh)),
        (10, Binding::from(&sc)),
    ];
    if let Some(xl) = &xl {
        slots.push((11, Binding::from(xl)));
    }
    if let Some(r) = route {
        slots.push((5, Binding::from(&r.buffer)));
    }
    pass.dispatch_slots(&pipe, &w.name, &prm, slots, grid(n_rows));
    Ok(Staged { xh, xl, sc })
}

fn product_slots(part: &wgpu::Buffer, y: &wgpu::Buffer, st: &Staged) -> Vec<(u32, Binding)> {
    let mut slots = vec![
        (1, Binding::from(part)),
        (2, Binding::from(part)),
        (4, Binding::from(y)),
        (7, Binding::from(&st.xh)),
        (8, Binding::from(&st.sc)),
    ];
    if let Some(xl) = &st.xl {
        slots.push((12, Binding::from(xl)));
    }
    slots
}

/// Dense `Y = X Wᵀ` for `n_tokens` tokens on the matrix units at `prec` (see
/// [`super::matmul::matmul`] for the layout; `opts`: accumulate).
pub fn matmul_coop(
    pass: &mut Pass<'_>,
    prec: Precision,
    w: &GpuTensor,
    x: Operand<'_>,
    y: Operand<'_>,
    n_tokens: u32,
    opts: &MatvecOpts,
) -> Result<()> {
    let gpu = pass.gpu();
    let geo = Geometry::of(w, false)?;
    if w.dtype == DType::F32 {
        return Err(Error::Unsupported(format!(
            "{}: F32 weights stay on the tiled kernel",
            w.name
        )));
    }
    if n_tokens == 0 || n_tokens.div_ceil(CBN_DENSE) > MAX_GROUPS {
        return Err(Error::Invalid(format!(
            "{}: matmul of {n_tokens} tokens",
            w.name
        )));
    }
    let (x_stride, y_stride) = geo.strides(&x, &y);
    let xvec = x_vec(&x, x_stride, n_tokens);
    let (x, x_off, y, y_off) = (x.buf, x.off, y.buf, y.off);
    check_span(&w.name, "x", x, x_off, x_stride, n_tokens, geo.cols)?;
    check_span(&w.name, "y", y, y_off, y_stride, n_tokens, geo.rows)?;
    let mut base = geo.params(geo.rows, false);
    base.x_off = x_off;
    base.x_stride = x_stride;
    base.n_tokens = n_tokens;
    let st = stage(pass, w, &geo, (x, xvec), base, None, prec)?;
    let big_tiles = n_tokens.div_ceil(CBN_DENSE);
    // the kernel lab's LAB_NSG8 takes 128-row tiles whatever the product's size
    let lab_big = opts.defines.iter().any(|(n, _)| *n == "LAB_NSG8");
    let nsg = if geo.rows.div_ceil(STAGE.rows()) * big_tiles < FILL && !lab_big {
        NSG_SMALL
    } else {
        NSG_BIG
    };
    let t = if split_w(w.dtype, prec) && xsplit_tile(prec, opts.defines) {
        Tile {
            nsg: NSG_BIG,
            prec,
            ..STAGE
        }
    } else {
        product_tile(Tile { nsg, prec, ..STAGE }, w.dtype)
    };
    let token_tiles = n_tokens.div_ceil(t.cbn);
    let pipe = pipeline(gpu, &geo, "matmul_coop", xvec, t, opts.defines)?;
    for part in &w.parts {
        let rows = part.n_rows as u32;
        if rows.div_ceil(t.rows()) > MAX_GROUPS || token_tiles > MAX_GROUPS {
            return Err(Error::Invalid(format!(
                "{}: {rows} rows in one part",
                w.name
            )));
        }
        let mut prm = geo.params(rows, false);
        prm.y_off = y_off + part.row_start as u32;
        prm.y_stride = y_stride;
        prm.accumulate = opts.accumulate as u32;
        prm.n_tokens = n_tokens;
        pass.dispatch_slots(
            &pipe,
            &w.name,
            &prm,
            product_slots(&part.buffer, y, &st),
            [rows.div_ceil(t.rows()), token_tiles, 1],
        );
    }
    gpu.note_matmul(path(prec));
    Ok(())
}

/// MoE prefill on the matrix units at `prec` over a route filled by [`super::matmul::route`]:
/// the contract of [`super::matmul::matmul_indexed`].
pub fn matmul_coop_indexed(
    pass: &mut Pass<'_>,
    prec: Precision,
    w: &GpuTensor,
    x: Operand<'_>,
    pairs: &RoutePairs<'_>,
    y: Operand<'_>,
    opts: &MatvecOpts,
) -> Result<()> {
    let RoutePairs {
        route: r,
        n_tokens,
        n_used,
        x_per_pair,
    } = *pairs;
    let gpu = pass.gpu();
    let geo = Geometry::of(w, true)?;
    if w.dtype == DType::F32 {
        return Err(Error::Unsupported(format!(
            "{}: F32 weights stay on the tiled kernel",
            w.name
        )));
    }
    let n_pairs = r.check(w, n_tokens, n_used)?;
    let (x_stride, y_stride) = geo.strides(&x, &y);
    let x_rows = if x_per_pair { n_pairs } else { n_tokens };
    let xvec = x_vec(&x, x_stride, x_rows);
    let (x, x_off, y, y_off) = (x.buf, x.off, y.buf, y.off);
    check_span(&w.name, "x", x, x_off, x_stride, x_rows, geo.cols)?;
    check_span(&w.name, "y", y, y_off, y_stride, n_pairs, geo.rows)?;
    let thin = n_pairs < THIN_PAIRS * r.n_expert;
    let t = product_tile(
        Tile {
            prec,
            ..if thin { THIN } else { MOE }
        },
        w.dtype,
    );
    let slots_n = r.max_tiles(n_pairs) * (CBN_ID / t.cbn);
    let row_tiles = geo.rows.div_ceil(t.rows());
    if slots_n > MAX_GROUPS || row_tiles > MAX_GROUPS {
        return Err(Error::Invalid(format!(
            "{}: grid of {row_tiles} x {slots_n} tiles",
            w.name
        )));
    }
    let mut base = geo.params(geo.rows, false);
    base.x_off = x_off;
    base.x_stride = x_stride;
    base.n_used = n_used;
    base.x_per_pair = x_per_pair as u32;
    base.pairs_off = r.pairs_off();
    base.n_tokens = n_pairs;
    let st = stage(pass, w, &geo, (x, xvec), base, Some(r), prec)?;
    let pipe = pipeline(gpu, &geo, "matmul_coop_id", xvec, t, opts.defines)?;
    let expert_bytes = geo.rows as u64 * geo.row_bytes as u64;
    for part in &w.parts {
        let (e_lo, e_n) = geo.part_experts(w, part, r.n_expert as u64)?;
        let mut prm = geo.params(geo.rows, false);
        prm.y_off = y_off;
        prm.y_stride = y_stride;
        prm.accumulate = opts.accumulate as u32;
        prm.n_used = n_used;
        prm.e_lo = e_lo as u32;
        prm.e_n = e_n as u32;
        prm.expert_bytes = expert_bytes as u32;
        prm.n_tokens = n_pairs;
        prm.n_expert = r.n_expert;
        prm.tiles_off = r.tiles_off();
        prm.pairs_off = r.pairs_off();
        let mut slots = product_slots(&part.buffer, y, &st);
        slots.push((5, Binding::from(&r.buffer)));
        pass.dispatch_slots(&pipe, &w.name, &prm, slots, [row_tiles, slots_n, 1]);
    }
    gpu.note_matmul(path(prec));
    Ok(())
}

fn path(prec: Precision) -> MatmulPath {
    match prec {
        Precision::F16 => MatmulPath::Coop,
        Precision::Split => MatmulPath::CoopSplit,
        Precision::XSplit => MatmulPath::CoopXSplit,
        Precision::SplitX => MatmulPath::CoopSplitX,
    }
}
