//! Weight × activations at decode time (`shaders/matvec.wgsl`): `y = W x` for a few tokens (one
//! grid column each; each token re-reads the weights, from L2 when the others just did), and the
//! MoE form that picks one expert matrix per (token, slot) pair from a 3-D stack.
//!
//! Shapes (row-major, f32 activations, offsets in elements):
//! - `w`: [rows, cols] (or [n_expert, rows, cols] for [`matvec_indexed`]) in its stored type.
//! - `x`: an [`Operand`], n_tokens rows of `cols` from `x.off`, `x.stride` apart (packed:
//!   cols).
//! - `y`: an [`Operand`], n_tokens rows of `rows` from `y.off`, `y.stride` apart (packed:
//!   rows).
//!
//! Supported types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS,
//! MXFP4 (ggml block layouts), F8_E4M3_B128 (lathe's FP8 block, `quant::BlockF8B128`). CPU
//! reference: `quant::dequantize` + a dot product.
//! Weights split into parts (binding limit) take one dispatch per part.
//!
//! Speed (H200, `bench_kernels`, weight bytes per second against a plain f32 read of 4.41 TB/s):
//! 16384 x 16384: BF16/F16 91%, F32 86-99%, Q8_0 65%, Q6_K 50%, Q4_K/Q5_K 48%, Q4_0 44%,
//! MXFP4 37%; 4096 columns reach less (Q8_0 35-46%, Q4_K 21-33%). The quantized kernels are
//! bound by instruction issue (decode, int->float converts), not memory: see the bench.
//!
//! int8 activations ([`matvec_q8x`], [`matvec_indexed_q8x`], opt-in through
//! [`MatvecOpts::int8_x`], or `--activations int8`): x is quantized once per product (or once
//! for several products sharing it, [`quantize_x2`]) to blocks of 32 values in two int8 levels,
//! x̂ = d·q + d₂·q₂: ggml's `block_q8_1` numerics for the first, the same for its residual
//! (CPU reference `cpu::q8x::quantize_x2`); the Q4_0, Q8_0, Q4_K, Q5_K and Q6_K kernels then
//! multiply integer codes four at a time (`dot4I8Packed`, each weight word against both levels)
//! and convert once per block and level. The result carries x's quantization error,
//! |x - x̂| <= d₂/2 per element with d₂ <= max|x|/254/127 of its block. One level alone (d/2 =
//! max|x|/254) missed every quantized fixture bar (RMS 0.03-0.16 against 0.02), so the decode
//! kernels take two. (MXFP4 has none: its e2m1 codes need a table to become integers, which
//! costs about what the f32 path's conversion does.)

use super::operand::Operand;
use super::pipeline::{StaticDefines, StaticName};
use super::{grid, Binding, Gpu, GpuTensor, Pass, PipelineSpec, TensorPart, MAX_GROUPS};
use crate::{DType, Error, Result};

pub(crate) const SRC: &str = include_str!("../../shaders/matvec.wgsl");
/// The int8 quantize kernel of [`quantize_x`].
pub(crate) const QUANT_SRC: &str = include_str!("../../shaders/quantize_x.wgsl");

/// Up to this many tokens a dense product goes through matvec: one token through the
/// one-token kernel, 2 and more through the token-group kernel ([`matvec_multi`], each
/// weight slice decoded once per group of up to 8 tokens, each token's bits those of the
/// one-token kernel). Measured on the H200 (2026-12-03, `bench_kernels --batch`, µs for 24 /
/// 32 tokens): Q4_K 4096x12288 token-group ~210 / 283, matrix units 490 / 500 at any count up to
/// 32, tiled ~740; 12288x4096 ~200 / 268 against 234 / 238 (Q6_K 258 against 266, Q8_0 291
/// against 300 at 32). So the token-group kernel wins or ties up to 32 tokens on every type
/// and shape measured, more so where there are no matrix units (the tiled kernel). Batched
/// decode of several sequences and the speculative verify step land here.
pub const DENSE_MATVEC_TOKENS: u32 = 32;

/// Above this many tokens, indexed products whose every token uses every matrix (DeepSeek-V4's
/// grouped `wo_a`) switch from the per-pair matvec to the routed tiled kernel (matvec reads the
/// weights once per pair from L2 and decodes them once per pair), and a speculative verify
/// pass holds at most this many rows. Dense products have their own threshold,
/// [`DENSE_MATVEC_TOKENS`], routed experts theirs (`moe::EXPERT_MATVEC_ROWS`).
pub const MAX_TOKENS: u32 = 8;

/// Uniforms shared by `matvec.wgsl` and `matmul.wgsl` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct Params {
    pub rows: u32,         // rows of this dispatch
    pub cols: u32,         // elements per row
    pub row_bytes: u32,    // bytes per stored row
    pub n_chunks: u32,     // matmul: 32-weight chunks per row (unused by matvec)
    pub nb_full: u32,      // complete (virtual) blocks per row
    pub x_off: u32,        // elements
    pub x_stride: u32,     // elements
    pub y_off: u32,        // elements
    pub y_stride: u32,     // elements
    pub accumulate: u32,   // 0 / 1
    pub n_used: u32,       // slots per token
    pub ids_off: u32,      // elements
    pub e_lo: u32,         // first expert of the part
    pub e_n: u32,          // experts in the part
    pub expert_bytes: u32, // bytes per expert matrix
    pub x_per_pair: u32,   // 0 / 1
    pub pair_off: u32,     // first pair of a matvec_id dispatch
    pub n_tokens: u32,     // matmul: tokens; matmul_id: pairs
    pub n_expert: u32,     // matmul_id: experts of the stack
    pub tiles_off: u32,    // matmul_id: words
    pub pairs_off: u32,    // matmul_id: words
    pub pro: [u32; 3],     // matvec prologue words ([`Prologue`])
}
const _: () = assert!(std::mem::size_of::<Params>() == 96);

/// Options beyond the plain product. `Default` gives `y = W x` with packed rows.
#[derive(Clone, Copy, Debug, Default)]
pub struct MatvecOpts {
    /// `y += W x` instead of `y = W x` (saves an add pass after e.g. a residual projection).
    pub accumulate: bool,
    /// Reduce through workgroup memory even when the adapter has subgroups (tests, debugging).
    pub portable: bool,
    /// Work split override (benchmarks); `None` takes [`Tune::default`].
    pub tune: Option<Tune>,
    /// Extra shader defines `(NAME, value)` for `#if` variants tried in the kernel lab
    /// (`bench_kernels --variant`); the shipped shaders have none, normal use leaves this empty.
    pub defines: &'static [(&'static str, &'static str)],
    /// Quantize x to two-level int8 blocks ([`quantize_x2`]) and take the integer-dot kernels
    /// ([`matvec_q8x`], [`matvec_indexed_q8x`]) for the weight types that have one
    /// ([`int8_x_supported`]); other types and the tiled matmuls ignore it. Off by default: it
    /// adds x's int8 rounding error.
    /// One-token products also take it on a device that decodes with int8 activations
    /// (`--activations`, [`Gpu::int8_decode`]) unless `exact`.
    pub int8_x: bool,
    /// Many-token products stay in f32 (the tiled kernel, never the f16 matrix path): for
    /// products that feed a discrete choice (router top-k, DeepSeek's indexer and
    /// hyper-connection mixes), where f16 rounding flips near-ties and with them the output.
    pub exact: bool,
}

/// How matvec splits a row group over a workgroup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tune {
    /// Threads per workgroup (a multiple of the thread group size).
    pub wg: u32,
    /// Rows each thread group computes (x is loaded once per chunk and reused for them):
    /// 1..=4, or 8, 12, 16 (quads of 4 rows sharing the x loads; `matvec` and `matvec_id`).
    pub rows: u32,
    /// Lanes per row group instead of the default (about a quarter of the row's slices): a
    /// power of two in 4..=wg. It sets each row's summation order, so a one-token product
    /// and the multi-token kernel must be given the same.
    pub lanes: Option<u32>,
}

impl Default for Tune {
    /// 128-thread workgroups, 4 rows per thread group: x is loaded once for 4 rows and each lane
    /// has 4 independent weight streams in flight. Without an explicit tune, 2 rows are used
    /// when 4 would leave the GPU short of threads (see `MANY_LANES`).
    fn default() -> Tune {
        Tune {
            wg: 128,
            rows: 4,
            lanes: None,
        }
    }
}

/// Lanes a dispatch should have before it takes 4 rows per thread group: on the H200 (132 SMs)
/// 4096-column matrices of 4096-12288 rows ran 10-40% faster with 2 rows, 16384 x 16384 ones
/// faster with 4.
const MANY_LANES: u64 = 1 << 18;

/// Rows up to which a product without an explicit tune takes one slice per lane
/// ([`Plan::with_items`]).
const SMALL_ROWS: u32 = 2048;

/// True for the weight types the kernels decode.
pub fn supported(dt: DType) -> bool {
    layout(dt).is_some()
}

/// (elements, bytes) of the block the kernels iterate over: ggml's block for quantized types,
/// a virtual block of 256 elements for float types.
pub(crate) fn layout(dt: DType) -> Option<(u32, u32)> {
    use DType as T;
    Some(match dt {
        T::F32 => (256, 1024),
        T::F16 | T::BF16 => (256, 512),
        T::Q4_0 | T::Q4_1 | T::Q5_0 | T::Q5_1 | T::Q8_0 | T::IQ4_NL | T::MXFP4 => {
            (32, dt.block_bytes() as u32)
        }
        T::Q2_K | T::Q3_K | T::Q4_K | T::Q5_K | T::Q6_K | T::IQ4_XS => {
            (256, dt.block_bytes() as u32)
        }
        T::F8_E4M3_B128 => (128, dt.block_bytes() as u32),
        _ => return None,
    })
}

/// Matvec lanes per block for the types with their own slicing in matvec.wgsl (`MV_CPB`);
/// `None`: one lane per 32-weight chunk of matmul's decoder (`MV32`).
fn mv_lanes(dt: DType) -> Option<u32> {
    use DType as T;
    match dt {
        T::Q4_0 | T::Q8_0 | T::MXFP4 => Some(2),
        T::Q4_K | T::Q5_K | T::Q6_K => Some(8),
        T::F8_E4M3_B128 => Some(4),
        _ => None,
    }
}

/// Matvec lanes per block of the int8-x kernels (`Q8X` in matvec.wgsl); `None`: no such kernel.
fn q8x_lanes(dt: DType) -> Option<u32> {
    use DType as T;
    match dt {
        T::Q4_0 | T::Q8_0 => Some(2),
        T::Q4_K | T::Q5_K | T::Q6_K => Some(4),
        _ => None,
    }
}

/// True for the weight types with an int8-activation kernel ([`matvec_q8x`]).
pub fn int8_x_supported(dt: DType) -> bool {
    q8x_lanes(dt).is_some()
}

/// Whether a product of `n_tokens` tokens over `geo` quantizes x to int8: asked for
/// ([`MatvecOpts::int8_x`]), or a one-token product on a device that decodes with int8
/// activations ([`Gpu::int8_decode`]) and not kept exact; only for the types with an int8
/// kernel.
fn takes_int8(gpu: &Gpu, geo: &Geometry, opts: &MatvecOpts, n_tokens: u32) -> bool {
    let decode = n_tokens == 1 && gpu.int8_decode() && !opts.exact;
    (opts.int8_x || decode) && int8_x_supported(geo.dtype)
}

/// What every kernel of the family needs to know about one weight.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub dtype: DType,
    pub rows: u32, // rows per matrix (per expert for stacks)
    pub cols: u32,
    pub row_bytes: u32,
    pub n_blocks: u32,
    pub nb_full: u32,
    bs: u32,
    bb: u32,
    float: bool,
    /// Float rows not 16-byte aligned: element-by-element paths.
    misaligned: bool,
}

impl Geometry {
    /// Elements between consecutive tokens' x rows and y rows (packed: cols, rows).
    pub fn strides(&self, x: &Operand<'_>, y: &Operand<'_>) -> (u32, u32) {
        (x.stride_for(self.cols), y.stride_for(self.rows))
    }

    /// The experts (first, count) that `part` of a stacked `[n_expert, rows, cols]` weight
    /// holds; an error when it does not hold whole ones.
    pub fn part_experts(
        &self,
        w: &GpuTensor,
        part: &TensorPart,
        n_expert: u64,
    ) -> Result<(u64, u64)> {
        let e_lo = part.row_start / self.rows as u64;
        let e_n = part.n_rows / self.rows as u64;
        let expert_bytes = self.rows as u64 * self.row_bytes as u64;
        if e_lo + e_n > n_expert || expert_bytes * e_n > part.buffer.size() {
            return Err(Error::Invalid(format!(
                "{}: part does not hold whole experts",
                w.name
            )));
        }
        Ok((e_lo, e_n))
    }

    /// Checks `w` (2-D, or 3-D when `stacked`) and derives the kernel geometry.
    pub fn of(w: &GpuTensor, stacked: bool) -> Result<Geometry> {
        let bad = |what: String| Error::Invalid(format!("{}: {what}", w.name));
        let (bs, bb) = layout(w.dtype).ok_or_else(|| {
            Error::Unsupported(format!("{}: matvec of {} weights", w.name, w.dtype))
        })?;
        let want = if stacked { 3 } else { 2 };
        if w.shape.len() != want {
            return Err(bad(format!(
                "expected a {want}-D weight, shape is {:?}",
                w.shape
            )));
        }
        let cols = w.row_len();
        let rows = w.shape[w.shape.len() - 2];
        if cols == 0 || rows == 0 || !cols.is_multiple_of(w.dtype.block_size() as u64) {
            return Err(bad(format!(
                "shape {:?} does not hold whole {} blocks",
                w.shape, w.dtype
            )));
        }
        let row_bytes = w.row_bytes();
        if rows > u32::MAX as u64 || cols > u32::MAX as u64 / 4 || row_bytes > u32::MAX as u64 {
            return Err(bad(format!("shape {:?} too large", w.shape)));
        }
        for part in &w.parts {
            if part.buffer.size() > u32::MAX as u64 {
                return Err(bad("a part larger than 4 GiB (byte offsets are u32)".into()));
            }
            // binding 2 views the part as 16-byte vectors: WebGPU needs at least one of them
            if part.buffer.size() < 16 {
                return Err(bad(format!(
                    "part of {} bytes: kernels need weights of at least 16 bytes",
                    part.buffer.size()
                )));
            }
        }
        let cols = cols as u32;
        let float = matches!(w.dtype, DType::F32 | DType::F16 | DType::BF16);
        Ok(Geometry {
            dtype: w.dtype,
            rows: rows as u32,
            cols,
            row_bytes: row_bytes as u32,
            n_blocks: cols.div_ceil(bs),
            nb_full: cols / bs,
            bs,
            bb,
            float,
            misaligned: float && !row_bytes.is_multiple_of(16),
        })
    }

    /// Float rows not 16-byte aligned.
    pub fn misaligned(&self) -> bool {
        self.misaligned
    }

    /// Whether matvec must take the element-by-element path (float rows not 16-byte aligned or
    /// not whole virtual blocks); matmul handles a partial last block chunk by chunk.
    pub fn mv_slow(&self) -> bool {
        self.misaligned || (self.float && !self.cols.is_multiple_of(self.bs))
    }

    /// Work items per row: matvec slices, or matmul's 32-weight chunks.
    pub fn n_items(&self, matvec: bool) -> u32 {
        if matvec && self.mv_slow() {
            0
        } else if matvec {
            self.n_blocks * mv_lanes(self.dtype).unwrap_or(self.bs / 32)
        } else {
            self.n_blocks * (self.bs / 32)
        }
    }

    /// The stored type's part of the geometry.
    pub fn block_type(&self) -> BlockType {
        BlockType {
            dtype: self.dtype,
            bs: self.bs,
            bb: self.bb,
            float: self.float,
        }
    }

    /// Base uniforms for one dispatch over `rows` rows.
    pub fn params(&self, rows: u32, matvec: bool) -> Params {
        Params {
            rows,
            cols: self.cols,
            row_bytes: self.row_bytes,
            n_chunks: self.n_items(matvec),
            nb_full: self.nb_full,
            ..Default::default()
        }
    }
}

/// What the family's defines and labels say about a weight: its stored type and (virtual)
/// block, for pipeline keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BlockType {
    pub dtype: DType,
    /// Elements and bytes per (virtual) block.
    bs: u32,
    bb: u32,
    float: bool,
}

impl BlockType {
    /// The family's common defines on `spec` (`slow`: the FSLOW element-by-element paths).
    pub fn defines(&self, spec: PipelineSpec, xvec: bool, slow: bool) -> PipelineSpec {
        let mut s = spec
            .define(&format!("TY_{}", self.dtype.name()), "true")
            .define("QT", format!("{}u", self.dtype.ggml_id().unwrap_or(0)))
            .define("BS", format!("{}u", self.bs))
            .define("BB", format!("{}u", self.bb));
        if mv_lanes(self.dtype).is_none() {
            s = s.define("MV32", "true");
        }
        if self.float {
            s = s.define("FLOAT", "true");
        }
        if slow {
            s = s.define("FSLOW", "true");
        }
        if xvec {
            s = s.define("XVEC", "true");
        }
        s
    }

    /// Label suffix naming the defines of [`BlockType::defines`].
    pub fn label(&self, xvec: bool, slow: bool) -> String {
        format!(
            "{}{}{}",
            self.dtype.name(),
            if xvec { "_xv" } else { "_xs" },
            if slow { "_fslow" } else { "" }
        )
    }
}

/// Whether x can be read as 16-byte vectors: every row start a multiple of 4 elements.
pub(crate) fn x_vec(x: &Operand<'_>, x_stride: u32, n_rows: u32) -> bool {
    x.off.is_multiple_of(4) && (x_stride.is_multiple_of(4) || n_rows <= 1) && x.buf.size() >= 16
}

pub(crate) use super::check_span;

fn use_subgroups(gpu: &Gpu, opts: &MatvecOpts) -> bool {
    !opts.portable
        && gpu.features.contains(wgpu::Features::SUBGROUP)
        && gpu.info.subgroup_min_size >= 4
}

struct Plan {
    wg: u32,
    /// rows per quad (1..=4)
    r: u32,
    /// quads per thread group (`RQ`: 1..=4, above 1 only with `r` 4)
    rq: u32,
    tpr: u32,
}

impl Plan {
    fn new(geo: &Geometry, opts: &MatvecOpts) -> Result<Plan> {
        let items = if geo.mv_slow() {
            geo.cols
        } else {
            geo.n_items(true)
        };
        Plan::with_items(geo, opts, items)
    }

    /// The split for rows of `items` work items (slices, or elements on the slow path).
    fn with_items(geo: &Geometry, opts: &MatvecOpts, items: u32) -> Result<Plan> {
        let t = opts.tune.unwrap_or_default();
        let rows_ok = (1..=4).contains(&t.rows) || matches!(t.rows, 8 | 12 | 16);
        let lanes_ok = t
            .lanes
            .is_none_or(|l| l.is_power_of_two() && (4..=t.wg).contains(&l));
        if !(t.wg.is_power_of_two() && (16..=256).contains(&t.wg) && rows_ok && lanes_ok) {
            return Err(Error::Invalid(format!(
                "matvec tune {t:?}: wg a power of two in 16..=256, rows 1..=4, 8, 12 or 16, \
                 lanes a power of two in 4..=wg"
            )));
        }
        // lanes per row group: about a quarter of the row's slices (elements on the slow path),
        // so each lane has several in flight and short rows (4096 columns) leave whole
        // workgroups of row groups reduced by subgroup shuffles alone
        let mut tpr = t
            .lanes
            .unwrap_or_else(|| (items / 4).next_power_of_two().clamp(4, t.wg));
        // small products (MoE experts and routers, shared experts): one slice per lane, so a
        // lane's loads are all in flight at once instead of one after another on the few
        // workgroups such a product has (the H200's 35B-A3B decode spent ~20 µs on a
        // 257 x 2048 router product and 12-15 on each 512-row expert product)
        if t.lanes.is_none() && opts.tune.is_none() && geo.rows <= SMALL_ROWS {
            tpr = items.next_power_of_two().clamp(4, t.wg);
        }
        let (mut r, mut rq) = (t.rows.min(4), (t.rows / 4).max(1));
        if opts.tune.is_none() && r == 4 && (geo.rows as u64) * (tpr as u64) / 4 < MANY_LANES {
            r = 2;
        }
        // the element-by-element loop (float rows off the 16-byte grid) has no quads
        if geo.mv_slow() {
            rq = 1;
        }
        Ok(Plan {
            wg: t.wg,
            r,
            rq,
            tpr,
        })
    }

    /// Workgroups for `rows` rows, as the (y, z) of the grid.
    fn groups(&self, rows: u32) -> (u32, u32) {
        let g = grid(rows.div_ceil(self.wg / self.tpr * self.r * self.rq));
        (g[0], g[1])
    }

    /// The pipeline of this split for `geo`, by a typed key ([`Gpu::pipeline_for`]): the
    /// label and defines ([`MvKey`]) are built the first time a variant is asked for, not per
    /// dispatch.
    fn pipeline_keyed(
        &self,
        gpu: &Gpu,
        geo: &Geometry,
        entry: &'static str,
        sg: bool,
        xvec: bool,
        v: Variant,
    ) -> Result<std::sync::Arc<wgpu::ComputePipeline>> {
        gpu.pipeline_for(MvKey {
            ty: geo.block_type(),
            entry: StaticName(entry),
            wg: self.wg,
            r: self.r,
            rq: self.rq,
            tpr: self.tpr,
            sg,
            xvec,
            slow: geo.mv_slow(),
            v,
        })
    }
}

/// What selects a matvec variant beside the weight's geometry and the split
/// ([`Plan::pipeline_keyed`]): the shader defines of the prologue, the caller's
/// ([`MatvecOpts::defines`]), the int8 kernels and the conv step's width (0: none).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Variant {
    pro: StaticDefines,
    user: StaticDefines,
    q8x: bool,
    conv_k: u32,
    /// Tokens per workgroup of `matvec_multi` (`TT`; 0 for the other entry points).
    tt: u32,
    /// SwiGLU of gate and up rows as the store (`EPI_GLU`).
    glu: bool,
    /// With `glu`, GeGLU (tanh) instead of SwiGLU (`EPI_GEGLU`).
    geglu: bool,
    /// The stored rows also written times a norm weight (`EPI_NW`).
    nw: bool,
}

impl Variant {
    fn plain(opts: &MatvecOpts) -> Variant {
        Variant {
            pro: StaticDefines(&[]),
            user: StaticDefines(opts.defines),
            q8x: false,
            conv_k: 0,
            tt: 0,
            glu: false,
            geglu: false,
            nw: false,
        }
    }
}

/// A matvec pipeline's typed key ([`Gpu::pipeline_for`]): the weight's type, the split
/// ([`Plan`]), the reduction, the x loads and the [`Variant`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct MvKey {
    ty: BlockType,
    entry: StaticName,
    wg: u32,
    r: u32,
    rq: u32,
    tpr: u32,
    /// Reduce through subgroups (`SUBGROUPS`), else workgroup memory.
    sg: bool,
    /// x read as 16-byte vectors (`XVEC`).
    xvec: bool,
    /// The element-by-element paths (`FSLOW`, [`Geometry::mv_slow`]).
    slow: bool,
    v: Variant,
}

impl MvKey {
    /// The [`Variant`]'s defines, in the order the label names them.
    fn extra(&self) -> Vec<(&'static str, String)> {
        let v = self.v;
        let flag = |n: &'static str| (n, "true".to_string());
        let mut extra = Vec::new();
        if v.q8x {
            extra.push(flag("Q8X"));
        }
        extra.extend(v.pro.0.iter().map(|&(n, x)| (n, x.to_string())));
        if v.conv_k > 0 {
            extra.push(flag("EPI_CONV"));
            extra.push(("CONV_K", format!("{}u", v.conv_k)));
        }
        if v.glu {
            extra.push(flag("EPI_GLU"));
        }
        if v.geglu {
            extra.push(flag("EPI_GEGLU"));
        }
        if v.nw {
            extra.push(flag("EPI_NW"));
        }
        if v.tt > 0 {
            extra.push(("TT", format!("{}u", v.tt)));
            // the types whose slice decode is split from the x dot (chunk_pre / chunk_fin)
            // and measured faster so: on the H200, 8 tokens of 12288 x 4096 took 81 against
            // 138 µs (Q6_K) and 139 against 166 (Q8_0); Q4_K gained nothing (117 against 123)
            // and lost at 2 tokens of 4096 x 12288 (111 against 38), so it keeps the
            // per-token calls
            let split = matches!(self.ty.dtype, DType::Q6_K | DType::Q8_0);
            if split && !v.q8x && !self.slow {
                extra.push(flag("MT_ONCE"));
            }
        }
        extra.extend(v.user.0.iter().map(|&(n, x)| (n, x.to_string())));
        extra
    }
}

impl super::PipelineKey for MvKey {
    fn source(&self) -> &'static str {
        SRC
    }
    fn entry(&self) -> &'static str {
        self.entry.0
    }
    fn label(&self) -> String {
        let mut label = format!(
            "{}_{}_r{}x{}_t{}_wg{}_{}",
            self.entry.0,
            self.ty.label(self.xvec, self.slow),
            self.r,
            self.rq,
            self.tpr,
            self.wg,
            if self.sg { "sg" } else { "wgmem" }
        );
        for (n, v) in self.extra() {
            label.push_str(&format!("_{n}={v}"));
        }
        label
    }
    fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
        let mut spec = self
            .ty
            .defines(spec, self.xvec, self.slow)
            .define("R", format!("{}u", self.r))
            .define("RQ", format!("{}u", self.rq))
            .define("TPR", format!("{}u", self.tpr))
            .define("WG", format!("{}u", self.wg));
        if self.sg {
            spec = spec.define("SUBGROUPS", "true");
        }
        for (n, v) in self.extra() {
            spec = spec.define(n, v);
        }
        spec
    }
}

/// `y[t] = W x[t]` for `n_tokens` tokens (any count; above
/// [`DENSE_MATVEC_TOKENS`] the tiled
/// [`matmul`](super::matmul::matmul_tiled) is cheaper); see the module doc for shapes.
pub fn matvec(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: Operand<'_>,
    y: Operand<'_>,
    n_tokens: u32,
) -> Result<()> {
    matvec_opts(pass, w, x, y, n_tokens, &MatvecOpts::default())
}

/// The x and y strides of a dense product of `n_tokens` tokens, with the token count and both
/// spans checked.
fn dense_spans(
    w: &GpuTensor,
    geo: &Geometry,
    x: &Operand<'_>,
    y: &Operand<'_>,
    n_tokens: u32,
) -> Result<(u32, u32)> {
    if !(1..=MAX_GROUPS).contains(&n_tokens) {
        return Err(Error::Invalid(format!(
            "{}: matvec of {n_tokens} tokens",
            w.name
        )));
    }
    let (x_stride, y_stride) = geo.strides(x, y);
    check_span(&w.name, "x", x.buf, x.off, x_stride, n_tokens, geo.cols)?;
    check_span(&w.name, "y", y.buf, y.off, y_stride, n_tokens, geo.rows)?;
    Ok((x_stride, y_stride))
}

/// [`matvec`] with options (accumulate, reduction path, work split).
pub fn matvec_opts(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: Operand<'_>,
    y: Operand<'_>,
    n_tokens: u32,
    opts: &MatvecOpts,
) -> Result<()> {
    let gpu = pass.gpu();
    let geo = Geometry::of(w, false)?;
    let (x_stride, y_stride) = dense_spans(w, &geo, &x, &y, n_tokens)?;
    if takes_int8(gpu, &geo, opts, n_tokens) {
        let mut qx = QuantX::cached(gpu, 2 * n_tokens, geo.cols)?;
        let xs = Operand::strided(x.buf, x.off, x_stride);
        quantize_x2(pass, xs, n_tokens, geo.cols, &mut qx)?;
        return matvec_q8x(pass, w, &qx, Operand::strided(y.buf, y.off, y_stride), opts);
    }
    let pl = Plan::new(&geo, opts)?;
    let sg = use_subgroups(gpu, opts);
    let xvec = x_vec(&x, x_stride, n_tokens);
    let pipe = pl.pipeline_keyed(gpu, &geo, "matvec", sg, xvec, Variant::plain(opts))?;
    for part in &w.parts {
        let rows = part.n_rows as u32;
        let (gy, gz) = pl.groups(rows);
        let mut prm = geo.params(rows, true);
        prm.x_off = x.off;
        prm.x_stride = x_stride;
        prm.y_off = y.off + part.row_start as u32;
        prm.y_stride = y_stride;
        prm.accumulate = opts.accumulate as u32;
        pass.dispatch(
            &pipe,
            &w.name,
            &prm,
            &[
                (&part.buffer).into(),
                (&part.buffer).into(),
                x.buf.into(),
                Binding::from(y.buf),
            ],
            [n_tokens, gy, gz],
        );
    }
    Ok(())
}

/// Most tokens one workgroup of [`matvec_multi`] computes (`TT` in matvec.wgsl, whose per-token
/// accumulators are unrolled by hand up to 8); more tokens take more grid columns.
pub const MULTI_GROUP: u32 = 8;

/// Rows per thread group of [`matvec_multi`] without an explicit [`Tune`]: 4, one quad. Each
/// token's x slice is loaded once for the quad's rows, and a fused prologue (RMSNorm, SwiGLU)
/// is computed once for them. H200, `bench_kernels --batch 2,4,8,16 --tune 128x2,128x4,...`,
/// 12288 x 4096: Q4_K 29 / 51 / 75 / 140 µs at 2 / 4 / 8 / 16 tokens against 35 / 71 / 117 /
/// 228 with 2 rows, Q8_0 29 / 47 / 80 / 152 against 40 / 69 / 138 / 246 (4096 x 12288 alike;
/// Q6_K within 5% at 2 tokens, 14% faster at 8-16). More quads per thread group (8 or 16 rows
/// sharing each x load) were 1.2-25x slower from 4 tokens on: a token group's accumulators for
/// every quad do not fit the registers.
const MULTI_ROWS: u32 = 4;

/// The token runs of a multi-token product: `(first token, tokens per group, groups)`, groups
/// of at most [`MULTI_GROUP`] tokens whose sizes differ by at most one (13 tokens: one group
/// of 7 and one of 6), so no group carries dead tokens and there are at most two pipelines.
fn token_groups(n_tokens: u32) -> Vec<(u32, u32, u32)> {
    let groups = n_tokens.div_ceil(MULTI_GROUP);
    let (base, big) = (n_tokens / groups, n_tokens % groups);
    let mut runs = Vec::with_capacity(2);
    if big > 0 {
        runs.push((0, base + 1, big));
    }
    runs.push((big * (base + 1), base, groups - big));
    runs
}

impl Plan {
    /// The one-token split of a product reading x through the RMSNorm prologue: from
    /// [`NORM_QUAD_ROWS`] rows on, 4 rows per quad and two quads per thread group.
    fn normed(mut self, geo: &Geometry, opts: &MatvecOpts) -> Plan {
        if opts.tune.is_none() && geo.rows >= NORM_QUAD_ROWS {
            self.r = 4;
            if !geo.mv_slow() {
                self.rq = 2;
            }
        }
        self
    }

    /// The multi-token kernel's split: matvec's lanes per row (what keeps each token's sums
    /// those of the one-token kernel), [`MULTI_ROWS`] rows unless tuned.
    fn multi(mut self, opts: &MatvecOpts) -> Plan {
        if opts.tune.is_none() {
            self.r = MULTI_ROWS;
        }
        // matvec_multi keeps one quad: its per-token accumulators already fill the registers
        self.rq = 1;
        self
    }
}

/// What selects a variant beside the weight's geometry and the split: the reduction
/// (subgroups or workgroup memory), the x loads (vectors or scalars) and the [`Variant`].
#[derive(Clone, Copy)]
struct Pick {
    sg: bool,
    xvec: bool,
    v: Variant,
}

/// `matvec_multi` dispatches for `n_tokens` tokens: per token run ([`token_groups`]) and weight
/// part. `prm` holds everything but the rows, y offset and first token; `slots` are the
/// bindings beyond the weight part's (1, 2).
fn dispatch_multi(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    (geo, pl): (&Geometry, &Plan),
    pick: Pick,
    prm: Params,
    slots: &[(u32, Binding)],
    n_tokens: u32,
) -> Result<()> {
    let gpu = pass.gpu();
    for (t0, tt, groups) in token_groups(n_tokens) {
        let v = Variant { tt, ..pick.v };
        let pipe = pl.pipeline_keyed(gpu, geo, "matvec_multi", pick.sg, pick.xvec, v)?;
        for part in &w.parts {
            let rows = part.n_rows as u32;
            let (gy, gz) = pl.groups(rows);
            let p = Params {
                rows,
                y_off: prm.y_off + part.row_start as u32,
                pair_off: t0,
                ..prm
            };
            let mut b: Vec<(u32, Binding)> =
                vec![(1, (&part.buffer).into()), (2, (&part.buffer).into())];
            b.extend(slots.iter().cloned());
            pass.dispatch_slots(&pipe, &w.name, &p, b, [groups, gy, gz]);
        }
    }
    Ok(())
}

/// [`matvec_opts`] for several tokens with each weight slice read and decoded once per group of
/// up to [`MULTI_GROUP`] tokens (`matvec_multi` in matvec.wgsl), where `matvec_opts` has every
/// token's workgroups read the weights again. Each token's outputs have exactly the bits of
/// [`matvec_opts`] run on that token alone (same lanes per row, slice order and reduction;
/// `opts.int8_x` included), so a batched row equals a lone decode: speculative decoding's
/// verify step and the server's batches rely on it.
pub fn matvec_multi(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: Operand<'_>,
    y: Operand<'_>,
    n_tokens: u32,
    opts: &MatvecOpts,
) -> Result<()> {
    let gpu = pass.gpu();
    let geo = Geometry::of(w, false)?;
    let (x_stride, y_stride) = dense_spans(w, &geo, &x, &y, n_tokens)?;
    // int8 x exactly when a lone decode of each token would take it: the bits must match
    if takes_int8(gpu, &geo, opts, 1) {
        let mut qx = QuantX::cached(gpu, 2 * n_tokens, geo.cols)?;
        let xs = Operand::strided(x.buf, x.off, x_stride);
        quantize_x2(pass, xs, n_tokens, geo.cols, &mut qx)?;
        let ys = Operand::strided(y.buf, y.off, y_stride);
        return matvec_q8x_multi(pass, w, &qx, ys, opts);
    }
    let pl = Plan::new(&geo, opts)?.multi(opts);
    let pick = Pick {
        sg: use_subgroups(gpu, opts),
        xvec: x_vec(&x, x_stride, n_tokens),
        v: Variant::plain(opts),
    };
    let prm = Params {
        x_off: x.off,
        x_stride,
        y_off: y.off,
        y_stride,
        accumulate: opts.accumulate as u32,
        ..geo.params(0, true)
    };
    let slots = [(3, x.buf.into()), (4, Binding::from(y.buf))];
    dispatch_multi(pass, w, (&geo, &pl), pick, prm, &slots, n_tokens)
}

/// Rows from which a one-token product reading x through the RMSNorm prologue takes 8 rows per
/// thread group (two quads sharing each x load and its norm-weight multiply) and 128-thread
/// workgroups: on the H200 the Qwen3.5-9B's fused gate+up (24576 x 4096 Q4_K) took 45.6 µs
/// against 63.4 µs with the plain split, while products of up to ~12k rows ran slower with it
/// (attn_qkv, 49 against 27 µs). Rows per thread group never change a row's bits.
const NORM_QUAD_ROWS: u32 = 16384;

/// An elementwise step fused into a matvec's activation load (`PRO_*` in matvec.wgsl): the
/// product reads x through it instead of a separate kernel writing its result first. SwiGLU and
/// the sigmoid gates are the same f32 arithmetic as the kernels they replace, so those fused
/// products equal that kernel followed by the plain product; RMSNorm is computed as
/// r · (W (x · w)), r from one pass of each workgroup over the row after the product (a fixed
/// summation order, whatever the split), equal to the separate norm and product to rounding.
#[derive(Clone, Copy, Debug)]
pub enum Prologue<'a> {
    /// x' = RMSNorm(x) · w (`norm::rms_norm` of each token's row to rounding; `w` f32
    /// `[cols]`); with `keep`, x' is also written there as packed `[n_tokens, cols]` rows (for
    /// the products that read it later).
    RmsNorm {
        w: &'a wgpu::Buffer,
        eps: f32,
        keep: Option<&'a wgpu::Buffer>,
    },
    /// [`Prologue::RmsNorm`] over the rows of `raw` (x's layout) when x already holds
    /// `raw · w` (a product's [`Epilogue::Normed`] store): x is read as stored and r comes
    /// from `raw`; the bits of `RmsNorm` over `raw` without its weight loads.
    RmsNormRaw { raw: &'a wgpu::Buffer, eps: f32 },
    /// x' = silu(x[c]) · x[c + up] (`elementwise::swiglu` without a limit: the up values sit
    /// `up` elements after the gate values of the same row, e.g. two columns of one product).
    SwiGlu { up: u32 },
    /// [`Prologue::SwiGlu`], and the product scaled by sigmoid(s) and added to y (`opts`'
    /// accumulate is implied): `elementwise::sigmoid_mul_row_inplace` then `add_inplace`, with
    /// token t's s at element `off + t · stride` of `gate` (Qwen's shared-expert gate).
    SwiGluGated {
        up: u32,
        gate: &'a wgpu::Buffer,
        off: u32,
        stride: u32,
    },
    /// x' = sigmoid(g) · x (`elementwise::sigmoid_mul`), with column c's gate at element
    /// `off + (c / head_dim) · head_stride + c % head_dim` of `gate` (Qwen3.5's attention
    /// output gate, interleaved with q). One token only.
    SigmoidGate {
        gate: &'a wgpu::Buffer,
        off: u32,
        head_dim: u32,
        head_stride: u32,
    },
}

impl Prologue<'_> {
    fn defines(&self) -> &'static [(&'static str, &'static str)] {
        match self {
            Prologue::RmsNorm { keep: None, .. } => {
                &[("PRO", "true"), ("PRO_NORM", "true"), ("NORM_R", "true")]
            }
            Prologue::RmsNorm { keep: Some(_), .. } => &[
                ("PRO", "true"),
                ("PRO_NORM", "true"),
                ("NORM_R", "true"),
                ("NORM_OUT", "true"),
            ],
            Prologue::RmsNormRaw { .. } => &[("NORM_R", "true"), ("NORM_RAW", "true")],
            Prologue::SwiGlu { .. } => &[("PRO", "true"), ("PRO_SWIGLU", "true")],
            Prologue::SwiGluGated { .. } => &[
                ("PRO", "true"),
                ("PRO_SWIGLU", "true"),
                ("EPI_SIGROW", "true"),
            ],
            Prologue::SigmoidGate { .. } => &[("PRO", "true"), ("PRO_SIGMUL", "true")],
        }
    }

    /// [`Prologue::defines`] with `PVEC` (the prologue's operands loaded as vectors, where
    /// they are 16-byte aligned: x read as vectors, `cols` and SwiGLU's `up` multiples of 4,
    /// the norm weight a whole number of vectors); `None` where the prologue has no such form.
    fn vec_defines(&self, cols: u32) -> Option<&'static [(&'static str, &'static str)]> {
        const P: (&str, &str) = ("PRO", "true");
        const V: (&str, &str) = ("PVEC", "true");
        const R: (&str, &str) = ("NORM_R", "true");
        if !cols.is_multiple_of(4) {
            return None;
        }
        match *self {
            Prologue::RmsNorm { w, keep: None, .. } if w.size().is_multiple_of(16) => {
                Some(&[P, ("PRO_NORM", "true"), R, V])
            }
            Prologue::RmsNorm {
                w, keep: Some(_), ..
            } if w.size().is_multiple_of(16) => {
                Some(&[P, ("PRO_NORM", "true"), R, ("NORM_OUT", "true"), V])
            }
            Prologue::SwiGlu { up } if up.is_multiple_of(4) => {
                Some(&[P, ("PRO_SWIGLU", "true"), V])
            }
            Prologue::SwiGluGated { up, .. } if up.is_multiple_of(4) => {
                Some(&[P, ("PRO_SWIGLU", "true"), ("EPI_SIGROW", "true"), V])
            }
            _ => None,
        }
    }
}

/// Whether [`matvec_pro`] takes `n_tokens` tokens: the products that
/// [`matmul`](super::matmul::matmul_opts) runs as matvec ([`DENSE_MATVEC_TOKENS`]).
pub fn prologue_fits(n_tokens: u32) -> bool {
    n_tokens <= DENSE_MATVEC_TOKENS
}

/// Qwen3.5's GDN conv step fused into the product that makes its input (`EPI_CONV` in
/// matvec.wgsl): rows `0..channels` of the product are conv channels; each is replaced by
/// `conv::conv1d_silu`'s output for it and its conv state rolled, as that kernel does at
/// decode (one token per sequence, token t being sequence t of `batch`).
pub struct ConvStep<'a> {
    pub channels: u32,
    /// Kernel width (≥ 2).
    pub k: u32,
    /// `[channels, k]` f32.
    pub w: &'a wgpu::Buffer,
    /// Pool `[slots, k − 1, channels]` f32 from element `state_off`.
    pub state: &'a wgpu::Buffer,
    pub state_off: u32,
    pub batch: &'a super::gdn::SeqBatch,
}

/// Whether a [`ConvStep`] can follow a product of `n_tokens` tokens over `batch` with `parts`
/// weight parts: one token per sequence, the tokens being the sequences, one part, and the
/// storage bindings it takes.
pub fn conv_step_fits(
    gpu: &Gpu,
    batch: &super::gdn::SeqBatch,
    n_tokens: u32,
    parts: usize,
) -> bool {
    batch.max_tokens == 1
        && batch.n_seq == n_tokens
        && parts == 1
        && gpu.limits.max_storage_buffers_per_shader_stage >= 8
}

/// [`matvec_opts`] reading x through `pro` (f32 activations; `opts.int8_x` is not taken). A
/// weight split into parts recomputes the prologue per part.
pub fn matvec_pro(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: Operand<'_>,
    y: Operand<'_>,
    n_tokens: u32,
    opts: &MatvecOpts,
    pro: &Prologue<'_>,
) -> Result<()> {
    let fused = Fused {
        pro: Some(pro),
        epi: Epilogue::Store,
    };
    matvec_fused(pass, w, x, y, n_tokens, opts, fused)
}

/// The elementwise steps fused into a product ([`matvec_fused`]): what x is read through
/// (`None`: x as stored) and what the product writes.
#[derive(Clone, Copy)]
pub struct Fused<'a> {
    pub pro: Option<&'a Prologue<'a>>,
    pub epi: Epilogue<'a>,
}

impl<'a> Fused<'a> {
    /// x as stored, written through `epi`.
    pub fn epi(epi: Epilogue<'a>) -> Self {
        Fused { pro: None, epi }
    }
}

/// What a fused product ([`matvec_fused`]) writes.
#[derive(Clone, Copy)]
pub enum Epilogue<'a> {
    /// The product, stored or added (`opts.accumulate`).
    Store,
    /// The GDN conv step on the first rows ([`ConvStep`]).
    Conv(&'a ConvStep<'a>),
    /// The product stored (or added, `opts.accumulate`) as [`Epilogue::Store`], and each
    /// value v of row c also written as `v · w[c]` to `out` at the same element (`EPI_NW` in
    /// matvec.wgsl; `w` f32 `[rows]`, one weight part): the input of a next product that
    /// reads it through [`Prologue::RmsNormRaw`] with the stored rows as `raw` (a residual
    /// stream's next RMSNorm weight).
    Normed {
        w: &'a wgpu::Buffer,
        out: &'a wgpu::Buffer,
    },
    /// SwiGLU of a gate+up product (`EPI_GLU` in matvec.wgsl): rows `0..ff` of the weight are
    /// the gate's, `ff..2ff` the up's (one part), and token t's `y[t][o] = silu(g_o) · u_o`
    /// (`elementwise::swiglu` without a limit: its bits), `ff` values per token (y's stride
    /// defaults to ff). Not with `opts.accumulate`.
    SwiGlu,
    /// [`Epilogue::SwiGlu`] with GeGLU (tanh): `y[t][o] = gelu_tanh(g_o) · u_o`
    /// (`EPI_GEGLU`; `elementwise::geglu`'s bits: Gemma's FFN, HF `gelu_pytorch_tanh`).
    GeGlu,
}

/// Whether a gate+up weight of `rows` rows in `parts` parts takes [`Epilogue::SwiGlu`] (or
/// [`Epilogue::GeGlu`]).
pub fn glu_fits(rows: u64, parts: usize) -> bool {
    rows > 0 && rows.is_multiple_of(2) && parts == 1
}

/// [`matvec_opts`] (f32 x) reading x through `pro` (`None`: x as stored) and writing through
/// `epi`: with [`Epilogue::Conv`] (only without a prologue or with a norm prologue without
/// `keep`) the bits of the product followed by `conv::conv1d_silu` at decode, with
/// [`Epilogue::SwiGlu`] those of the product followed by `elementwise::swiglu`, one dispatch
/// fewer; [`Epilogue::Normed`] adds the next norm's input. Two or more tokens take the
/// token-group kernel ([`matvec_multi`]): each token's outputs have the bits of the same call
/// for that token alone.
pub fn matvec_fused(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: Operand<'_>,
    y: Operand<'_>,
    n_tokens: u32,
    opts: &MatvecOpts,
    Fused { pro, epi }: Fused<'_>,
) -> Result<()> {
    let (xo, yo) = (x, y);
    let (x, x_off, y, y_off) = (x.buf, x.off, y.buf, y.off);
    let gpu = pass.gpu();
    let geo = Geometry::of(w, false)?;
    if !(1..=MAX_GROUPS).contains(&n_tokens) || !opts.defines.is_empty() {
        return Err(Error::Invalid(format!(
            "{}: fused matvec of {n_tokens} tokens",
            w.name
        )));
    }
    let glu = matches!(epi, Epilogue::SwiGlu | Epilogue::GeGlu);
    if glu && (!glu_fits(geo.rows as u64, w.parts.len()) || opts.accumulate) {
        return Err(Error::Invalid(format!(
            "{}: GLU store of {} rows in {} parts{}",
            w.name,
            geo.rows,
            w.parts.len(),
            if opts.accumulate {
                ", accumulating"
            } else {
                ""
            }
        )));
    }
    // SwiGLU writes one value per row pair
    let y_len = if glu { geo.rows / 2 } else { geo.rows };
    let x_stride = xo.stride_for(geo.cols);
    let y_stride = yo.stride_for(y_len);
    check_span(&w.name, "x", x, x_off, x_stride, n_tokens, geo.cols)?;
    check_span(&w.name, "y", y, y_off, y_stride, n_tokens, y_len)?;
    let xvec = x_vec(&xo, x_stride, n_tokens);
    // (binding number, buffer) beyond the plain product's, and the prologue words
    let mut extra: Vec<(u32, Binding)> = Vec::new();
    let mut word = match pro {
        None => [0, 0, 0],
        Some(&Prologue::RmsNorm { w: nw, eps, keep }) => {
            check_span(&w.name, "norm weight", nw, 0u32, 0u32, 1u32, geo.cols)?;
            extra.push((6, nw.into()));
            if let Some(h) = keep {
                check_span(
                    &w.name,
                    "normed rows",
                    h,
                    0u32,
                    geo.cols,
                    n_tokens,
                    geo.cols,
                )?;
                extra.push((7, h.into()));
            }
            [eps.to_bits(), 0, 0]
        }
        Some(&Prologue::RmsNormRaw { raw, eps }) => {
            check_span(
                &w.name, "raw rows", raw, x_off, x_stride, n_tokens, geo.cols,
            )?;
            extra.push((12, raw.into()));
            [eps.to_bits(), 0, 0]
        }
        Some(&Prologue::SwiGlu { up }) => {
            check_span(&w.name, "up", x, x_off + up, x_stride, n_tokens, geo.cols)?;
            [up, 0, 0]
        }
        Some(&Prologue::SwiGluGated {
            up,
            gate,
            off,
            stride,
        }) => {
            check_span(&w.name, "up", x, x_off + up, x_stride, n_tokens, geo.cols)?;
            check_span(&w.name, "gate", gate, off, stride, n_tokens, 1u32)?;
            extra.push((8, gate.into()));
            [up, off, stride]
        }
        Some(&Prologue::SigmoidGate {
            gate,
            off,
            head_dim,
            head_stride,
        }) => {
            if n_tokens != 1 || head_dim == 0 || !geo.cols.is_multiple_of(head_dim) {
                return Err(Error::Invalid(format!(
                    "{}: gated matvec of {n_tokens} tokens, head_dim {head_dim}",
                    w.name
                )));
            }
            let heads = geo.cols / head_dim;
            check_span(&w.name, "gate", gate, off, head_stride, heads, head_dim)?;
            extra.push((6, gate.into()));
            [off, head_dim, head_stride]
        }
    };
    let pro_defs = match pro {
        None => &[],
        Some(pro) => match pro.vec_defines(geo.cols) {
            Some(d) if xvec => d,
            _ => pro.defines(),
        },
    };
    let mut variant = Variant {
        pro: StaticDefines(pro_defs),
        ..Variant::plain(opts)
    };
    match epi {
        Epilogue::Store => {}
        Epilogue::SwiGlu => variant.glu = true,
        Epilogue::GeGlu => {
            variant.glu = true;
            variant.geglu = true;
        }
        Epilogue::Normed { w: nw, out } => {
            if w.parts.len() != 1 {
                return Err(Error::Invalid(format!(
                    "{}: normed store of a weight in {} parts",
                    w.name,
                    w.parts.len()
                )));
            }
            check_span(&w.name, "next norm weight", nw, 0u32, 0u32, 1u32, geo.rows)?;
            check_span(
                &w.name,
                "normed out",
                out,
                y_off,
                y_stride,
                n_tokens,
                geo.rows,
            )?;
            extra.push((13, nw.into()));
            extra.push((14, out.into()));
            variant.nw = true;
        }
        Epilogue::Conv(c) => {
            check_conv(gpu, w, &geo, pro, c, n_tokens, opts)?;
            word[1] = c.channels;
            word[2] = c.state_off;
            extra.push((9, c.w.into()));
            extra.push((10, c.state.into()));
            extra.push((11, (&c.batch.table).into()));
            variant.conv_k = c.k;
        }
    }
    let mut pl = Plan::new(&geo, opts)?;
    if matches!(pro, Some(Prologue::RmsNorm { .. })) {
        pl = pl.normed(&geo, opts);
    }
    let pl = if n_tokens > 1 { pl.multi(opts) } else { pl };
    if variant.glu && pl.r % 2 != 0 {
        return Err(Error::Invalid(format!(
            "{}: GLU store needs an even number of rows per quad, not {}",
            w.name, pl.r
        )));
    }
    let sg = use_subgroups(gpu, opts);
    if n_tokens > 1 {
        // the token-group kernel: each token's bits are those of its one-token product
        let prm = Params {
            x_off,
            x_stride,
            y_off,
            y_stride,
            accumulate: opts.accumulate as u32,
            pro: word,
            ..geo.params(0, true)
        };
        let mut slots = vec![(3, x.into()), (4, Binding::from(y))];
        slots.extend(extra.iter().cloned());
        let pick = Pick {
            sg,
            xvec,
            v: variant,
        };
        return dispatch_multi(pass, w, (&geo, &pl), pick, prm, &slots, n_tokens);
    }
    let pipe = pl.pipeline_keyed(gpu, &geo, "matvec", sg, xvec, variant)?;
    for part in &w.parts {
        let rows = part.n_rows as u32;
        let (gy, gz) = pl.groups(rows);
        let mut prm = geo.params(rows, true);
        prm.x_off = x_off;
        prm.x_stride = x_stride;
        prm.y_off = y_off + part.row_start as u32;
        prm.y_stride = y_stride;
        prm.accumulate = opts.accumulate as u32;
        prm.pro = word;
        let mut b: Vec<(u32, Binding)> = vec![
            (1, (&part.buffer).into()),
            (2, (&part.buffer).into()),
            (3, x.into()),
            (4, Binding::from(y)),
        ];
        b.extend(extra.iter().cloned());
        pass.dispatch_slots(&pipe, &w.name, &prm, b, [n_tokens, gy, gz]);
    }
    Ok(())
}

/// Whether a GDN conv step can follow a fused product of `w` read through `pro` (see
/// [`ConvStep`]): an error naming what does not fit.
fn check_conv(
    gpu: &Gpu,
    w: &GpuTensor,
    geo: &Geometry,
    pro: Option<&Prologue<'_>>,
    c: &ConvStep<'_>,
    n_tokens: u32,
    opts: &MatvecOpts,
) -> Result<()> {
    let plain_norm = matches!(
        pro,
        None | Some(Prologue::RmsNorm { keep: None, .. } | Prologue::RmsNormRaw { .. })
    );
    if !plain_norm || c.k < 2 || c.channels > geo.rows || opts.accumulate {
        return Err(Error::Invalid(format!(
            "{}: conv step after this product ({} channels, K {})",
            w.name, c.channels, c.k
        )));
    }
    if !conv_step_fits(gpu, c.batch, n_tokens, w.parts.len()) {
        return Err(Error::Invalid(format!(
            "{}: conv step needs one token per sequence and one weight part",
            w.name
        )));
    }
    check_span(
        &w.name,
        "conv weight",
        c.w,
        0u32,
        0u32,
        1u32,
        c.channels * c.k,
    )?;
    let st_len = (c.k - 1) * c.channels;
    check_span(
        &w.name,
        "conv state",
        c.state,
        c.state_off,
        st_len,
        1u32,
        st_len,
    )
}

/// Activations quantized to int8 blocks of 32 values (ggml's `block_q8_1` numerics, in one
/// level or two): the x of [`matvec_q8x`] (two levels) and of the int8 matmul. A scratch made
/// once ([`QuantX::new`]) and filled by [`quantize_x`] or [`quantize_x2`]; clones share the
/// buffers.
#[derive(Clone, Debug)]
pub struct QuantX {
    /// [tokens, cols / 32, levels, 8] u32: each block's 32 codes per level, 4 per word (i8,
    /// little-endian).
    pub qs: wgpu::Buffer,
    /// [tokens, cols / 32, levels] f32 pairs (d, d · Σq): x̂ = d · q (+ d₂ · q₂).
    pub scales: wgpu::Buffer,
    /// Blocks of 32 the buffers hold.
    capacity: u64,
    /// Columns of the x last quantized into it.
    pub cols: u32,
    /// Tokens of the x last quantized into it (0: none yet).
    pub n_tokens: u32,
    /// Whether that x has the second level ([`quantize_x2`]).
    pub two: bool,
}

/// Uniforms of `quantize_x` (matvec.wgsl `QParams`).
#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct QParams {
    n_blocks: u32, // blocks per token row
    n_tokens: u32,
    x_off: u32,    // elements
    x_stride: u32, // elements
}
const _: () = assert!(std::mem::size_of::<QParams>() == 16);

/// Codes per int8 block of [`QuantX`].
pub const Q8X_BLOCK: u32 = 32;

impl QuantX {
    /// A scratch for up to `max_tokens` rows of `max_cols` values in one level (half as many
    /// in two).
    pub fn new(gpu: &Gpu, max_tokens: u32, max_cols: u32) -> Result<QuantX> {
        let blocks = max_tokens as u64 * max_cols.div_ceil(Q8X_BLOCK) as u64;
        QuantX::with_blocks(gpu, blocks.max(1))
    }

    fn with_blocks(gpu: &Gpu, blocks: u64) -> Result<QuantX> {
        let bytes = blocks * Q8X_BLOCK as u64;
        if bytes > gpu.max_binding() {
            return Err(Error::Invalid(format!(
                "int8 x scratch of {bytes} bytes exceeds the binding limit {}",
                gpu.max_binding()
            )));
        }
        Ok(QuantX {
            qs: gpu.buffer(bytes, "lathe.quant_x.qs")?,
            scales: gpu.buffer(blocks * 8, "lathe.quant_x.scales")?,
            capacity: blocks,
            cols: 0,
            n_tokens: 0,
            two: false,
        })
    }

    /// Blocks of 32 values the scratch holds.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The scratch behind [`MatvecOpts::int8_x`] and the int8 matmul: the device's scratch
    /// buffers (`Gpu::scratch`), grown to the largest x seen. Each use quantizes into it right
    /// before its product in the same pass, so products in sequence may share it; a grown
    /// replacement leaves the old buffers to the passes that recorded them.
    pub(crate) fn cached(gpu: &Gpu, n_tokens: u32, cols: u32) -> Result<QuantX> {
        let blocks = (n_tokens as u64 * cols.div_ceil(Q8X_BLOCK) as u64).max(1);
        let bytes = blocks * Q8X_BLOCK as u64;
        if bytes > gpu.max_binding() {
            return Err(Error::Invalid(format!(
                "int8 x scratch of {bytes} bytes exceeds the binding limit {}",
                gpu.max_binding()
            )));
        }
        let qs = gpu.scratch("lathe.quant_x.qs", bytes)?;
        let scales = gpu.scratch("lathe.quant_x.scales", blocks * 8)?;
        // what both buffers hold (each may have grown past the request on its own)
        let capacity = (qs.size() / Q8X_BLOCK as u64).min(scales.size() / 8);
        Ok(QuantX {
            qs,
            scales,
            capacity,
            cols: 0,
            n_tokens: 0,
            two: false,
        })
    }
}

/// Records the quantization of `n_tokens` rows of `cols` f32 values of `x` (packed: cols
/// apart) into `qx`, per block of 32 as ggml's `quantize_row_q8_1`: d = max|x| / 127,
/// q = round(x · (1/d)) with ties to even (ggml rounds them away from zero), s = d · Σq.
/// `cols` must be a multiple of 32. CPU reference: `cpu::q8x::quantize_x`.
pub fn quantize_x(
    pass: &mut Pass<'_>,
    x: Operand<'_>,
    n_tokens: u32,
    cols: u32,
    qx: &mut QuantX,
) -> Result<()> {
    quantize_x_levels(pass, x, n_tokens, cols, qx, false)
}

/// [`quantize_x`] in two levels, the x of [`matvec_q8x`]: each block also holds its residual
/// `x − d·q` quantized the same way (d₂, q₂), so x̂ = d·q + d₂·q₂. `qx` needs room for
/// `2 · n_tokens` rows. CPU reference: `cpu::q8x::quantize_x2`.
pub fn quantize_x2(
    pass: &mut Pass<'_>,
    x: Operand<'_>,
    n_tokens: u32,
    cols: u32,
    qx: &mut QuantX,
) -> Result<()> {
    quantize_x_levels(pass, x, n_tokens, cols, qx, true)
}

/// [`quantize_x`], with `two`: each block also holds its residual `x − d·q` quantized the same
/// way (d₂, q₂; shader define X2), interleaved per block (codes of block o at 4o and 4o + 2 in
/// vec4 units, scales at 2o and 2o + 1), so the scratch needs twice the blocks.
pub(crate) fn quantize_x_levels(
    pass: &mut Pass<'_>,
    x: Operand<'_>,
    n_tokens: u32,
    cols: u32,
    qx: &mut QuantX,
    two: bool,
) -> Result<()> {
    let gpu = pass.gpu();
    let (x, x_off, x_stride) = (x.buf, x.off, x.stride_for(cols));
    if cols == 0 || !cols.is_multiple_of(Q8X_BLOCK) || !(1..=MAX_GROUPS).contains(&n_tokens) {
        return Err(Error::Invalid(format!(
            "int8 x: {n_tokens} rows of {cols} values (need 1..={MAX_GROUPS} rows of a multiple of {Q8X_BLOCK})"
        )));
    }
    let n_blocks = cols / Q8X_BLOCK;
    let levels = if two { 2 } else { 1 };
    if levels * n_tokens as u64 * n_blocks as u64 > qx.capacity {
        return Err(Error::Invalid(format!(
            "int8 x: {n_tokens} rows of {cols} values exceed the scratch of {} blocks",
            qx.capacity
        )));
    }
    check_span("int8 x", "x", x, x_off, x_stride, n_tokens, cols)?;
    #[derive(PartialEq, Eq, Hash)]
    struct QuantizeX {
        /// With the second level (X2).
        two: bool,
    }
    impl super::PipelineKey for QuantizeX {
        fn source(&self) -> &'static str {
            QUANT_SRC
        }
        fn entry(&self) -> &'static str {
            "quantize_x"
        }
        fn label(&self) -> String {
            let two = if self.two { "2" } else { "" };
            format!("matvec_quantize_x{two}")
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec.define("X2", self.two)
        }
    }
    let pipe = gpu.pipeline_for(QuantizeX { two })?;
    let prm = QParams {
        n_blocks,
        n_tokens,
        x_off,
        x_stride,
    };
    pass.dispatch(
        &pipe,
        "quantize_x",
        &prm,
        &[x.into(), (&qx.qs).into(), Binding::from(&qx.scales)],
        [n_blocks.div_ceil(64), n_tokens, 1],
    );
    qx.cols = cols;
    qx.n_tokens = n_tokens;
    qx.two = two;
    Ok(())
}

/// `y[t] = W x̂[t]` for the `qx.n_tokens` rows quantized into `qx` in two levels
/// ([`quantize_x2`]); `w` of a type with an int8 kernel ([`int8_x_supported`]) and `qx.cols`
/// columns; y as [`matvec`].
/// Of `opts`, accumulate, portable, tune and defines apply.
pub fn matvec_q8x(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    qx: &QuantX,
    y: Operand<'_>,
    opts: &MatvecOpts,
) -> Result<()> {
    q8x_product(pass, w, qx, y, opts, false)
}

/// [`matvec_q8x`] through the token-group kernel (as [`matvec_multi`]): each token's outputs
/// have the bits of [`matvec_q8x`] on that token alone.
pub fn matvec_q8x_multi(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    qx: &QuantX,
    y: Operand<'_>,
    opts: &MatvecOpts,
) -> Result<()> {
    q8x_product(pass, w, qx, y, opts, true)
}

fn q8x_product(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    qx: &QuantX,
    y: Operand<'_>,
    opts: &MatvecOpts,
    multi: bool,
) -> Result<()> {
    let gpu = pass.gpu();
    let geo = Geometry::of(w, false)?;
    let lanes = q8x_lanes(geo.dtype).ok_or_else(|| {
        Error::Unsupported(format!("{}: int8-x matvec of {} weights", w.name, w.dtype))
    })?;
    let n_tokens = qx.n_tokens;
    if qx.cols != geo.cols || n_tokens == 0 || !qx.two {
        return Err(Error::Invalid(format!(
            "{}: int8 x holds {n_tokens} rows of {} values in {} level(s), the weight needs two \
             levels of {} columns",
            w.name,
            qx.cols,
            1 + qx.two as u32,
            geo.cols
        )));
    }
    let (y, y_off, y_stride) = (y.buf, y.off, y.stride_for(geo.rows));
    check_span(&w.name, "y", y, y_off, y_stride, n_tokens, geo.rows)?;
    let pl = Plan::with_items(&geo, opts, geo.n_blocks * lanes)?;
    let sg = use_subgroups(gpu, opts);
    let v = Variant {
        q8x: true,
        ..Variant::plain(opts)
    };
    if multi && n_tokens > 1 {
        let prm = Params {
            x_stride: geo.cols, // elements, as below
            y_off,
            y_stride,
            accumulate: opts.accumulate as u32,
            ..geo.params(0, true)
        };
        let slots = [
            (3, (&qx.qs).into()),
            (4, y.into()),
            (5, Binding::from(&qx.scales)),
        ];
        let pl = pl.multi(opts);
        let pick = Pick { sg, xvec: false, v };
        return dispatch_multi(pass, w, (&geo, &pl), pick, prm, &slots, n_tokens);
    }
    let pipe = pl.pipeline_keyed(gpu, &geo, "matvec", sg, false, v)?;
    for part in &w.parts {
        let rows = part.n_rows as u32;
        let (gy, gz) = pl.groups(rows);
        let mut prm = geo.params(rows, true);
        prm.x_off = 0;
        prm.x_stride = geo.cols; // elements: the kernel reads block (x_off + t * x_stride) / 32
        prm.y_off = y_off + part.row_start as u32;
        prm.y_stride = y_stride;
        prm.accumulate = opts.accumulate as u32;
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
            [n_tokens, gy, gz],
        );
    }
    Ok(())
}

/// The (token, slot) pairs of a routed product: pair `q = t · n_used + s` for token
/// `t < n_tokens` and slot `s < n_used`, its expert `ids[ids.off + q]` (u32
/// `[n_tokens, n_used]`, packed), its x row the token's or its own (`x_per_pair`: per pair
/// for a down projection, per token for gate and up).
#[derive(Clone, Copy, Debug)]
pub struct Pairs<'a> {
    pub ids: Operand<'a>,
    pub n_tokens: u32,
    pub n_used: u32,
    pub x_per_pair: bool,
}

impl Pairs<'_> {
    /// Rows of x the pairs read: one per pair or one per token.
    fn x_rows(&self, n_pairs: u32) -> u32 {
        if self.x_per_pair {
            n_pairs
        } else {
            self.n_tokens
        }
    }
}

/// MoE decode: for each pair `q` of `pairs` with expert `e`:
/// `y[y.off + q · y_stride ..][..rows] = W[e] · x_q`, where `x_q` is x's row `q` or the pair's
/// token's ([`Pairs::x_per_pair`]). `w` is [n_expert, rows, cols]; strides default to
/// cols / rows. Ids >= n_expert write nothing.
/// With `opts.int8_x` and a type that has an int8 kernel, x is quantized first
/// ([`matvec_indexed_q8x`]).
pub fn matvec_indexed(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: Operand<'_>,
    pairs: &Pairs<'_>,
    y: Operand<'_>,
    opts: &MatvecOpts,
) -> Result<()> {
    let geo = Geometry::of(w, true)?;
    let n_pairs = check_pairs(w, pairs)?;
    let x_stride = x.stride_for(geo.cols);
    let x_rows = pairs.x_rows(n_pairs);
    check_span(&w.name, "x", x.buf, x.off, x_stride, x_rows, geo.cols)?;
    // each pair is a one-token product: int8 x exactly when a lone decode's pairs take it (a
    // speculative verify step's rows must have a lone decode's bits)
    if takes_int8(pass.gpu(), &geo, opts, 1) {
        let mut qx = QuantX::cached(pass.gpu(), 2 * x_rows, geo.cols)?;
        let xs = Operand::strided(x.buf, x.off, x_stride);
        quantize_x2(pass, xs, x_rows, geo.cols, &mut qx)?;
        return matvec_indexed_q8x(pass, w, &qx, pairs, y, opts);
    }
    let gpu = pass.gpu();
    let pl = Plan::new(&geo, opts)?;
    let sg = use_subgroups(gpu, opts);
    let xvec = x_vec(&x, x_stride, x_rows);
    let pipe = pl.pipeline_keyed(gpu, &geo, "matvec_id", sg, xvec, Variant::plain(opts))?;
    let ind = Indexed {
        x: Binding::from(x.buf),
        scales: None,
        x_off: x.off,
        x_stride,
        pairs,
        n_pairs,
        y,
    };
    dispatch_indexed(pass, w, &geo, &pl, &pipe, &ind, opts)
}

/// [`matvec_indexed`] with x already quantized in two levels ([`quantize_x2`]): `qx` holds the
/// x rows (one per pair when `x_per_pair`, else one per token) of `w`'s columns; `w` of a type with an int8
/// kernel ([`int8_x_supported`]). Of `opts`, accumulate, portable, tune and defines apply.
pub fn matvec_indexed_q8x(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    qx: &QuantX,
    pairs: &Pairs<'_>,
    y: Operand<'_>,
    opts: &MatvecOpts,
) -> Result<()> {
    let gpu = pass.gpu();
    let geo = Geometry::of(w, true)?;
    let lanes = q8x_lanes(geo.dtype).ok_or_else(|| {
        Error::Unsupported(format!("{}: int8-x matvec of {} weights", w.name, w.dtype))
    })?;
    let n_pairs = check_pairs(w, pairs)?;
    let x_rows = pairs.x_rows(n_pairs);
    if qx.cols != geo.cols || qx.n_tokens < x_rows || !qx.two {
        return Err(Error::Invalid(format!(
            "{}: int8 x holds {} rows of {} values in {} level(s), the product needs {x_rows} \
             of {} in two",
            w.name,
            qx.n_tokens,
            qx.cols,
            1 + qx.two as u32,
            geo.cols
        )));
    }
    let pl = Plan::with_items(&geo, opts, geo.n_blocks * lanes)?;
    let sg = use_subgroups(gpu, opts);
    let v = Variant {
        q8x: true,
        ..Variant::plain(opts)
    };
    let pipe = pl.pipeline_keyed(gpu, &geo, "matvec_id", sg, false, v)?;
    // bindings: W, W4, QX, Y, XS, IDX
    let ind = Indexed {
        x: Binding::from(&qx.qs),
        scales: Some(Binding::from(&qx.scales)),
        x_off: 0,
        x_stride: geo.cols, // elements: the kernel reads block (x_off + row * x_stride) / 32
        pairs,
        n_pairs,
        y,
    };
    dispatch_indexed(pass, w, &geo, &pl, &pipe, &ind, opts)
}

/// Pairs of an indexed product, checked (the ids packed).
fn check_pairs(w: &GpuTensor, pairs: &Pairs<'_>) -> Result<u32> {
    let (n_tokens, n_used) = (pairs.n_tokens, pairs.n_used);
    let n_pairs = n_tokens as u64 * n_used as u64;
    if n_used == 0 || n_tokens == 0 || n_pairs > u32::MAX as u64 / 2 {
        return Err(Error::Invalid(format!(
            "{}: {n_tokens} tokens x {n_used} slots",
            w.name
        )));
    }
    if pairs.ids.stride.is_some_and(|s| s != n_used) {
        return Err(Error::Invalid(format!(
            "{}: ids rows {:?} apart, the kernel reads them packed ({n_used})",
            w.name, pairs.ids.stride
        )));
    }
    Ok(n_pairs as u32)
}

/// The operands of an indexed product: x's binding (with the int8 kernels' scales, bound
/// before the ids) and rows, the pairs and y.
struct Indexed<'a> {
    x: Binding,
    scales: Option<Binding>,
    x_off: u32,
    x_stride: u32,
    pairs: &'a Pairs<'a>,
    n_pairs: u32,
    y: Operand<'a>,
}

/// One `matvec_id` dispatch per part and run of at most 65535 pairs.
fn dispatch_indexed(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    geo: &Geometry,
    pl: &Plan,
    pipe: &std::sync::Arc<wgpu::ComputePipeline>,
    ind: &Indexed<'_>,
    opts: &MatvecOpts,
) -> Result<()> {
    let n_expert = w.shape[0];
    let n_pairs = ind.n_pairs;
    let (y, y_off, y_stride) = (ind.y.buf, ind.y.off, ind.y.stride_for(geo.rows));
    let (ids, ids_off) = (ind.pairs.ids.buf, ind.pairs.ids.off);
    check_span(&w.name, "y", y, y_off, y_stride, n_pairs, geo.rows)?;
    if (ids_off as u64 + n_pairs as u64) * 4 > ids.size() {
        return Err(Error::Invalid(format!(
            "{}: ids need {} u32 at offset {}, buffer holds {}",
            w.name,
            n_pairs,
            ids_off,
            ids.size() / 4
        )));
    }
    let (gy, gz) = pl.groups(geo.rows);
    let expert_bytes = geo.rows as u64 * geo.row_bytes as u64;
    for part in &w.parts {
        let (e_lo, e_n) = geo.part_experts(w, part, n_expert)?;
        let mut prm = geo.params(geo.rows, true);
        prm.x_off = ind.x_off;
        prm.x_stride = ind.x_stride;
        prm.y_off = y_off;
        prm.y_stride = y_stride;
        prm.accumulate = opts.accumulate as u32;
        prm.n_used = ind.pairs.n_used;
        prm.ids_off = ids_off;
        prm.e_lo = e_lo as u32;
        prm.e_n = e_n as u32;
        prm.expert_bytes = expert_bytes as u32;
        prm.x_per_pair = ind.pairs.x_per_pair as u32;
        let mut bindings: Vec<Binding> = vec![
            (&part.buffer).into(),
            (&part.buffer).into(),
            ind.x.clone(),
            y.into(),
        ];
        bindings.extend(ind.scales.clone());
        bindings.push(ids.into());
        let mut q0 = 0;
        while q0 < n_pairs {
            let n = (n_pairs - q0).min(MAX_GROUPS);
            prm.pair_off = q0;
            pass.dispatch(pipe, &w.name, &prm, &bindings, [n, gy, gz]);
            q0 += n;
        }
    }
    Ok(())
}
