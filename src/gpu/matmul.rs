//! Weight × activations for prefill (`shaders/matmul.wgsl`, on the pieces of `matvec.wgsl`,
//! whose block decoders it shares): `Y[t, r] = Σ_c W[r, c] X[t, c]` for many tokens, tiled 64 rows ×
//! 64 tokens so each decoded chunk of W serves 64 tokens; and the MoE form over a route built on
//! the GPU (llama.cpp's mul_mat_id idea: each chosen expert is read once for the whole batch).
//!
//! Shapes (row-major, f32, offsets in elements): `w` [rows, cols] (or [n_expert, rows, cols]);
//! X: n rows of `cols` from `x.off`, `x.stride` apart; Y: n rows of `rows` from `y.off`,
//! `y.stride` apart ([`Operand`]s; packed: cols / rows apart). Types: as [`matvec`](super::matvec). Weights split into
//! parts take one dispatch per part.

use super::matvec::{self, check_span, x_vec, BlockType, Geometry, MatvecOpts};
pub use super::moe_route::{MoeRoute, RoutePairs};
use super::operand::Operand;
use super::{
    coopmat, Binding, Gpu, GpuTensor, MatmulPath, Pass, PipelineSpec, StaticName, MAX_GROUPS,
};
use crate::{DType, Error, Result};

pub(crate) const SRC: &str = include_str!("../../shaders/matmul.wgsl");

/// The int8-activation kernel (`matmul_q8`), on matvec.wgsl's pieces with `Q8X` and `MMQ`
/// (which leaves the decoders' matvec-only slices out).
pub(crate) const SRC_Q8: &str = include_str!("../../shaders/matmul_q8.wgsl");

/// Rows × tokens of one `matmul_q8` workgroup.
const BM_Q8: u32 = 64;
const BN_Q8: u32 = 64;

/// Rows × tokens of one workgroup's tile (`BM`, `BN` in matmul.wgsl; `BN` is also the pairs
/// per tile of a [`MoeRoute`]).
const BM: u32 = 64;
const BN: u32 = super::moe_route::TILE_PAIRS;
/// Tokens of a thin MoE tile (`THIN` in matmul.wgsl): four workgroups per route tile.
const BN_THIN: u32 = 16;

/// MoE products with fewer pairs per expert than this on average take thin tiles. Measured
/// on the H200: DeepSeek-V4-Flash (~6 pairs per expert in a 256-token round) 2.5x faster
/// experts; the 35B-A3B (16 per expert at 512 tokens) 34 -> 26 ms per projection set. A
/// 128-row wide tile (8 rows x 4 tokens per thread) measured slower (34 -> 44 ms).
const THIN_PAIRS: u32 = 24;

pub use super::matvec::DENSE_MATVEC_TOKENS;

/// `Y = X Wᵀ` for `n_tokens` tokens: up to [`DENSE_MATVEC_TOKENS`] through matvec (one token
/// through [`matvec::matvec_opts`], more through [`matvec::matvec_multi`], every token with the
/// bits of a one-token product), the matrix-unit or tiled kernel beyond.
pub fn matmul(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: Operand<'_>,
    y: Operand<'_>,
    n_tokens: u32,
) -> Result<()> {
    matmul_opts(pass, w, x, y, n_tokens, &MatvecOpts::default())
}

/// [`matmul`] with options (accumulate, `exact`; `portable` / `tune` apply to the matvec
/// path).
pub fn matmul_opts(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: Operand<'_>,
    y: Operand<'_>,
    n_tokens: u32,
    opts: &MatvecOpts,
) -> Result<()> {
    if n_tokens == 1 {
        matvec::matvec_opts(pass, w, x, y, n_tokens, opts)
    } else if n_tokens <= DENSE_MATVEC_TOKENS {
        matvec::matvec_multi(pass, w, x, y, n_tokens, opts)
    } else if let Some(prec) = coopmat::usable(pass.gpu(), w.dtype).filter(|_| !opts.exact) {
        coopmat::matmul_coop(pass, prec, w, x, y, n_tokens, opts)
    } else if let Some(levels) = int8_levels(pass.gpu(), w).filter(|_| !opts.exact) {
        matmul_int8(pass, levels, w, x, y, n_tokens, opts)
    } else {
        matmul_tiled(pass, w, x, y, n_tokens, opts)
    }
}

/// Typed key of the tiled f32 kernels (`matmul`, `matmul_id`).
#[derive(PartialEq, Eq, Hash)]
struct Tiled {
    ty: BlockType,
    entry: StaticName,
    /// x read as 16-byte vectors.
    xvec: bool,
    /// The element-by-element paths of misaligned float rows.
    slow: bool,
    /// The thin MoE tile ([`BN_THIN`] tokens).
    thin: bool,
}

impl super::PipelineKey for Tiled {
    fn source(&self) -> &'static str {
        SRC
    }
    fn entry(&self) -> &'static str {
        self.entry.0
    }
    fn label(&self) -> String {
        let bn = if self.thin { BN_THIN } else { BN };
        let ty = self.ty.label(self.xvec, self.slow);
        format!("{}_{ty}_bm{BM}_bn{bn}", self.entry.0)
    }
    fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
        let spec = spec.define("THIN", self.thin);
        self.ty.defines(spec, self.xvec, self.slow)
    }
}

fn pipeline(
    gpu: &Gpu,
    geo: &Geometry,
    entry: &'static str,
    xvec: bool,
    thin: bool,
) -> Result<std::sync::Arc<wgpu::ComputePipeline>> {
    gpu.pipeline_for(Tiled {
        ty: geo.block_type(),
        entry: StaticName(entry),
        xvec,
        // a partial last float block is handled chunk by chunk: only misaligned rows go slow
        slow: geo.misaligned(),
        thin,
    })
}

/// Uniforms of a dense tiled product (the f32 and the int8 kernels) over one weight part of
/// `rows` rows starting at `row_start`; x rows at `x_off + t * x_stride` (in the int8 kernel:
/// blocks of the int8 scratch).
fn dense_params(
    geo: &Geometry,
    w: &GpuTensor,
    part: &super::TensorPart,
    (x_off, x_stride): (u32, u32),
    (y_off, y_stride): (u32, u32),
    n_tokens: u32,
    opts: &MatvecOpts,
) -> Result<matvec::Params> {
    let rows = part.n_rows as u32;
    if rows.div_ceil(BM) > MAX_GROUPS {
        return Err(Error::Invalid(format!(
            "{}: {rows} rows in one part",
            w.name
        )));
    }
    let mut prm = geo.params(rows, false);
    prm.x_off = x_off;
    prm.x_stride = x_stride;
    prm.y_off = y_off + part.row_start as u32;
    prm.y_stride = y_stride;
    prm.accumulate = opts.accumulate as u32;
    prm.n_tokens = n_tokens;
    Ok(prm)
}

/// The tiled kernel for any `n_tokens` >= 1 (what [`matmul`] uses above
/// [`DENSE_MATVEC_TOKENS`]).
pub fn matmul_tiled(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: Operand<'_>,
    y: Operand<'_>,
    n_tokens: u32,
    opts: &MatvecOpts,
) -> Result<()> {
    let gpu = pass.gpu();
    let geo = Geometry::of(w, false)?;
    if n_tokens == 0 || n_tokens.div_ceil(BN) > MAX_GROUPS {
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
    let pipe = pipeline(gpu, &geo, "matmul", xvec, false)?;
    for part in &w.parts {
        let rows = part.n_rows as u32;
        let prm = dense_params(
            &geo,
            w,
            part,
            (x_off, x_stride),
            (y_off, y_stride),
            n_tokens,
            opts,
        )?;
        pass.dispatch(
            &pipe,
            &w.name,
            &prm,
            &[
                (&part.buffer).into(),
                (&part.buffer).into(),
                x.into(),
                Binding::from(y),
            ],
            [rows.div_ceil(BM), n_tokens.div_ceil(BN), 1],
        );
    }
    gpu.note_matmul(MatmulPath::Tiled);
    Ok(())
}

/// Whether [`matmul_int8`] reads `dt`'s weights as integer codes: the types of the int8
/// matvec ([`matvec::int8_x_supported`]) and the two whose value tables are int8 in ggml
/// (IQ4_NL, MXFP4).
pub fn int8_supported(dt: DType) -> bool {
    matvec::int8_x_supported(dt) || matches!(dt, DType::IQ4_NL | DType::MXFP4)
}

/// How many int8 levels x takes in [`matmul_int8`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int8Levels {
    /// x̂ = d·q per block of 32 (ggml's q8_1): within max|x|/254 of x.
    One,
    /// x̂ = d·q + d₂·q₂, the residual quantized again: within max|x|/64516 of x.
    Two,
}

/// The int8 levels `gpu` runs `w`'s many-token products with (`--matmul int8|int8x2`): for
/// types with integer codes ([`int8_supported`]) and whole 32-value blocks per row.
pub fn int8_levels(gpu: &Gpu, w: &GpuTensor) -> Option<Int8Levels> {
    let levels = match gpu.matmul_path() {
        MatmulPath::Int8 => Int8Levels::One,
        MatmulPath::Int8x2 => Int8Levels::Two,
        _ => return None,
    };
    let fits = int8_supported(w.dtype)
        && Geometry::of(w, w.shape.len() > 2).is_ok_and(|g| g.cols % matvec::Q8X_BLOCK == 0);
    fits.then_some(levels)
}

/// Typed key of the int8-activation kernel (`matmul_q8`).
#[derive(PartialEq, Eq, Hash)]
struct Int8 {
    ty: BlockType,
    entry: StaticName,
    /// Two int8 levels.
    two: bool,
    thin: bool,
}

impl super::PipelineKey for Int8 {
    fn source(&self) -> &'static str {
        SRC_Q8
    }
    fn entry(&self) -> &'static str {
        self.entry.0
    }
    fn label(&self) -> String {
        format!(
            "{}{}{}_{}",
            self.entry.0,
            if self.two { "_x2" } else { "" },
            if self.thin { "_thin" } else { "" },
            self.ty.label(false, false)
        )
    }
    fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
        let spec = spec
            .define("Q8X", "true")
            .define("MMQ", "true")
            .define("X2", self.two)
            .define("THIN", self.thin);
        self.ty.defines(spec, false, false)
    }
}

fn pipeline_q8(
    gpu: &Gpu,
    geo: &Geometry,
    entry: &'static str,
    two: bool,
    thin: bool,
) -> Result<std::sync::Arc<wgpu::ComputePipeline>> {
    gpu.pipeline_for(Int8 {
        ty: geo.block_type(),
        entry: StaticName(entry),
        two,
        thin,
    })
}

/// `Y = X Wᵀ` with x quantized to int8 per block of 32 first ([`matvec::quantize_x`], ggml's
/// block_q8_1, in one or two levels) and the weights' integer codes multiplied four at a time
/// (`matmul_q8`); `w` of a type [`int8_supported`] lists, with a multiple of 32
/// columns. Shapes and `opts` (accumulate) as [`matmul_tiled`]. The error against f32 x is at
/// most Σ_blocks e · Σ|w| per output, e = d/2 (one level) or d₂/2 (two).
pub fn matmul_int8(
    pass: &mut Pass<'_>,
    levels: Int8Levels,
    w: &GpuTensor,
    x: Operand<'_>,
    y: Operand<'_>,
    n_tokens: u32,
    opts: &MatvecOpts,
) -> Result<()> {
    let gpu = pass.gpu();
    let geo = Geometry::of(w, false)?;
    if !int8_supported(geo.dtype) || geo.cols % matvec::Q8X_BLOCK != 0 {
        return Err(Error::Unsupported(format!(
            "{}: int8-x matmul of {} weights with {} columns",
            w.name, w.dtype, geo.cols
        )));
    }
    if n_tokens == 0 || n_tokens.div_ceil(BN_Q8) > MAX_GROUPS {
        return Err(Error::Invalid(format!(
            "{}: matmul of {n_tokens} tokens",
            w.name
        )));
    }
    let (x_stride, y_stride) = geo.strides(&x, &y);
    let (y, y_off) = (y.buf, y.off);
    check_span(&w.name, "x", x.buf, x.off, x_stride, n_tokens, geo.cols)?;
    check_span(&w.name, "y", y, y_off, y_stride, n_tokens, geo.rows)?;
    let two = levels == Int8Levels::Two;
    // two levels: twice the blocks (the cache sizes by rows × columns)
    let mut qx = matvec::QuantX::cached(gpu, n_tokens * (1 + two as u32), geo.cols)?;
    let xs = Operand::strided(x.buf, x.off, x_stride);
    matvec::quantize_x_levels(pass, xs, n_tokens, geo.cols, &mut qx, two)?;
    let pipe = pipeline_q8(gpu, &geo, "matmul_q8", two, false)?;
    for part in &w.parts {
        let rows = part.n_rows as u32;
        // blocks of token t's x start at block (0 + t * cols) / 32 of the scratch
        let prm = dense_params(
            &geo,
            w,
            part,
            (0, geo.cols),
            (y_off, y_stride),
            n_tokens,
            opts,
        )?;
        pass.dispatch(
            &pipe,
            &w.name,
            &prm,
            &[
                (&part.buffer).into(),
                (&part.buffer).into(),
                (&qx.qs).into(),
                y.into(),
                Binding::from(&qx.scales),
            ],
            [rows.div_ceil(BM_Q8), n_tokens.div_ceil(BN_Q8), 1],
        );
    }
    gpu.note_matmul(if two {
        MatmulPath::Int8x2
    } else {
        MatmulPath::Int8
    });
    Ok(())
}

/// Uniforms of `route` in matmul.wgsl.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct RouteParams {
    n_pairs: u32,
    n_expert: u32,
    ids_off: u32,   // elements
    bn: u32,        // pairs per tile
    tiles_off: u32, // words
    pairs_off: u32, // words
    pad: [u32; 2],
}
const _: () = assert!(std::mem::size_of::<RouteParams>() == 32);

/// Fill `r` from router output `ids` (u32 [n_tokens, n_used] at `ids_off`): one workgroup.
pub fn route(
    pass: &mut Pass<'_>,
    r: &MoeRoute,
    ids: &wgpu::Buffer,
    ids_off: u32,
    n_tokens: u32,
    n_used: u32,
) -> Result<()> {
    let n_pairs = n_tokens as u64 * n_used as u64;
    if n_pairs == 0 || n_pairs > r.max_pairs as u64 {
        return Err(Error::Invalid(format!(
            "moe route: {n_tokens} tokens x {n_used} slots, route made for {} pairs",
            r.max_pairs
        )));
    }
    if (ids_off as u64 + n_pairs) * 4 > ids.size() {
        return Err(Error::Invalid(format!(
            "moe route: ids need {n_pairs} u32 at offset {ids_off}, buffer holds {}",
            ids.size() / 4
        )));
    }
    let gpu = pass.gpu();
    /// One variant: no fields.
    #[derive(PartialEq, Eq, Hash)]
    struct Route;
    impl super::PipelineKey for Route {
        fn source(&self) -> &'static str {
            SRC
        }
        fn entry(&self) -> &'static str {
            "route"
        }
        fn label(&self) -> String {
            "matmul_route".into()
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec.define("ROUTE", "true")
        }
    }
    let pipe = gpu.pipeline_for(Route)?;
    let prm = RouteParams {
        n_pairs: n_pairs as u32,
        n_expert: r.n_expert,
        ids_off,
        bn: BN,
        tiles_off: r.tiles_off(),
        pairs_off: r.pairs_off(),
        pad: [0; 2],
    };
    pass.dispatch(
        &pipe,
        "moe_route",
        &prm,
        &[ids.into(), Binding::from(&r.buffer)],
        [1, 1, 1],
    );
    Ok(())
}

/// MoE prefill over the route of `pairs`: for each pair `q` with expert `e`:
/// `Y[y.off + q · y_stride ..][..rows] = W[e] · x_q`, `x_q` x's row `q` or the pair's token's.
/// `w` is [n_expert, rows, cols].
pub fn matmul_indexed(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: Operand<'_>,
    pairs: &RoutePairs<'_>,
    y: Operand<'_>,
    opts: &MatvecOpts,
) -> Result<()> {
    if let Some(prec) = coopmat::usable_indexed(pass.gpu(), w.dtype) {
        coopmat::matmul_coop_indexed(pass, prec, w, x, pairs, y, opts)
    } else if let Some(levels) = int8_levels(pass.gpu(), w) {
        matmul_int8_indexed(pass, levels, w, x, pairs, y, opts)
    } else {
        matmul_indexed_tiled(pass, w, x, pairs, y, opts)
    }
}

/// The checked shapes and the grid of an indexed product on the 64-row route tiles (the f32
/// and the int8 kernels).
struct IndexedRun {
    n_pairs: u32,
    x_rows: u32,
    x_stride: u32,
    y_off: u32,
    y_stride: u32,
    thin: bool,
    slots: u32,
    row_tiles: u32,
}

fn indexed_run(
    geo: &Geometry,
    w: &GpuTensor,
    x: &Operand<'_>,
    pairs: &RoutePairs<'_>,
    y: &Operand<'_>,
) -> Result<IndexedRun> {
    let r = pairs.route;
    let n_pairs = r.check(w, pairs.n_tokens, pairs.n_used)?;
    let (x_stride, y_stride) = geo.strides(x, y);
    let x_rows = if pairs.x_per_pair {
        n_pairs
    } else {
        pairs.n_tokens
    };
    check_span(&w.name, "x", x.buf, x.off, x_stride, x_rows, geo.cols)?;
    check_span(&w.name, "y", y.buf, y.off, y_stride, n_pairs, geo.rows)?;
    let thin = n_pairs < THIN_PAIRS * r.n_expert;
    let slots = r.max_tiles(n_pairs) * if thin { BN / BN_THIN } else { 1 };
    let row_tiles = geo.rows.div_ceil(BM);
    if slots > MAX_GROUPS || row_tiles > MAX_GROUPS {
        return Err(Error::Invalid(format!(
            "{}: grid of {row_tiles} x {slots} tiles",
            w.name
        )));
    }
    Ok(IndexedRun {
        n_pairs,
        x_rows,
        x_stride,
        y_off: y.off,
        y_stride,
        thin,
        slots,
        row_tiles,
    })
}

/// Uniforms of an indexed product over the experts of one weight part; x rows at
/// `x_off + q * x_stride` (in the int8 kernel: blocks of the int8 scratch).
fn indexed_params(
    geo: &Geometry,
    w: &GpuTensor,
    part: &super::TensorPart,
    pairs: &RoutePairs<'_>,
    run: &IndexedRun,
    (x_off, x_stride): (u32, u32),
    opts: &MatvecOpts,
) -> Result<matvec::Params> {
    let r = pairs.route;
    let (e_lo, e_n) = geo.part_experts(w, part, r.n_expert as u64)?;
    let mut prm = geo.params(geo.rows, false);
    prm.x_off = x_off;
    prm.x_stride = x_stride;
    prm.y_off = run.y_off;
    prm.y_stride = run.y_stride;
    prm.accumulate = opts.accumulate as u32;
    prm.n_used = pairs.n_used;
    prm.e_lo = e_lo as u32;
    prm.e_n = e_n as u32;
    prm.expert_bytes = (geo.rows as u64 * geo.row_bytes as u64) as u32;
    prm.x_per_pair = pairs.x_per_pair as u32;
    prm.n_tokens = run.n_pairs;
    prm.n_expert = r.n_expert;
    prm.tiles_off = r.tiles_off();
    prm.pairs_off = r.pairs_off();
    Ok(prm)
}

/// [`matmul_indexed`] with int8 activations ([`matmul_int8`]'s kernel over the route): the x
/// rows (one per pair when `x_per_pair`, else per token) are quantized first.
pub fn matmul_int8_indexed(
    pass: &mut Pass<'_>,
    levels: Int8Levels,
    w: &GpuTensor,
    x: Operand<'_>,
    pairs: &RoutePairs<'_>,
    y: Operand<'_>,
    opts: &MatvecOpts,
) -> Result<()> {
    let gpu = pass.gpu();
    let geo = Geometry::of(w, true)?;
    if !int8_supported(geo.dtype) || geo.cols % matvec::Q8X_BLOCK != 0 {
        return Err(Error::Unsupported(format!(
            "{}: int8-x matmul of {} weights with {} columns",
            w.name, w.dtype, geo.cols
        )));
    }
    let run = indexed_run(&geo, w, &x, pairs, &y)?;
    let two = levels == Int8Levels::Two;
    let mut qx = matvec::QuantX::cached(gpu, run.x_rows * (1 + two as u32), geo.cols)?;
    let xs = Operand::strided(x.buf, x.off, run.x_stride);
    matvec::quantize_x_levels(pass, xs, run.x_rows, geo.cols, &mut qx, two)?;
    let pipe = pipeline_q8(gpu, &geo, "matmul_q8_id", two, run.thin)?;
    let (y, r) = (y.buf, pairs.route);
    for part in &w.parts {
        let prm = indexed_params(&geo, w, part, pairs, &run, (0, geo.cols), opts)?;
        pass.dispatch(
            &pipe,
            &w.name,
            &prm,
            &[
                (&part.buffer).into(),
                (&part.buffer).into(),
                (&qx.qs).into(),
                y.into(),
                (&qx.scales).into(),
                Binding::from(&r.buffer),
            ],
            [run.row_tiles, run.slots, 1],
        );
    }
    gpu.note_matmul(if two {
        MatmulPath::Int8x2
    } else {
        MatmulPath::Int8
    });
    Ok(())
}

/// [`matmul_indexed`] on the tiled f32 kernel whatever the device offers.
pub fn matmul_indexed_tiled(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: Operand<'_>,
    pairs: &RoutePairs<'_>,
    y: Operand<'_>,
    opts: &MatvecOpts,
) -> Result<()> {
    let gpu = pass.gpu();
    let geo = Geometry::of(w, true)?;
    let run = indexed_run(&geo, w, &x, pairs, &y)?;
    let xvec = x_vec(&x, run.x_stride, run.x_rows);
    let pipe = pipeline(gpu, &geo, "matmul_id", xvec, run.thin)?;
    let (x_off, x, y, r) = (x.off, x.buf, y.buf, pairs.route);
    for part in &w.parts {
        let prm = indexed_params(&geo, w, part, pairs, &run, (x_off, run.x_stride), opts)?;
        pass.dispatch(
            &pipe,
            &w.name,
            &prm,
            &[
                (&part.buffer).into(),
                (&part.buffer).into(),
                x.into(),
                Binding::from(y),
                (&r.buffer).into(),
            ],
            [run.row_tiles, run.slots, 1],
        );
    }
    gpu.note_matmul(MatmulPath::Tiled);
    Ok(())
}
