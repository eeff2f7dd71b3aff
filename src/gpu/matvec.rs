//! Weight × activations at decode time (`shaders/matvec.wgsl`): `y = W x` for a few tokens (one
//! grid column each; each token re-reads the weights, from L2 when the others just did), and the
//! MoE form that picks one expert matrix per (token, slot) pair from a 3-D stack.
//!
//! Shapes (row-major, f32 activations, offsets in elements):
//! - `w`: [rows, cols] (or [n_expert, rows, cols] for [`matvec_indexed`]) in its stored type.
//! - `x`: n_tokens rows of `cols` at `x_off + t * x_stride` (stride defaults to cols).
//! - `y`: n_tokens rows of `rows` at `y_off + t * y_stride` (stride defaults to rows).
//!
//! Supported types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS,
//! MXFP4 (ggml block layouts). CPU reference: `quant::dequantize` + a dot product.
//! Weights split into parts (binding limit) take one dispatch per part.
//!
//! Speed (H200, `bench_kernels`, weight bytes per second against a plain f32 read of 4.41 TB/s):
//! 16384 x 16384: BF16/F16 91%, F32 86-99%, Q8_0 65%, Q6_K 50%, Q4_K/Q5_K 48%, Q4_0 44%,
//! MXFP4 37%; 4096 columns reach less (Q8_0 35-46%, Q4_K 21-33%). The quantized kernels are
//! bound by instruction issue (decode, int->float converts), not memory: see the bench.

use super::{grid, Binding, Gpu, GpuTensor, Pass, PipelineSpec, MAX_GROUPS};
use crate::{DType, Error, Result};

pub(crate) const SRC: &str = include_str!("../../shaders/matvec.wgsl");

/// Above this many tokens [`matmul`](super::matmul::matmul) switches to the tiled kernel
/// (matvec reads the weights once per token from L2 and decodes them once per token).
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
    pub pad: [u32; 3],
}
const _: () = assert!(std::mem::size_of::<Params>() == 96);

/// Options beyond the plain product. `Default` gives `y = W x` with packed rows.
#[derive(Clone, Copy, Debug, Default)]
pub struct MatvecOpts {
    /// `y += W x` instead of `y = W x` (saves an add pass after e.g. a residual projection).
    pub accumulate: bool,
    /// Elements between consecutive tokens' x rows; 0 means cols.
    pub x_stride: u32,
    /// Elements between consecutive tokens' y rows; 0 means rows.
    pub y_stride: u32,
    /// Reduce through workgroup memory even when the adapter has subgroups (tests, debugging).
    pub portable: bool,
    /// Work split override (benchmarks); `None` takes [`Tune::default`].
    pub tune: Option<Tune>,
    /// Extra shader defines `(NAME, value)` for `#if` variants tried in the kernel lab
    /// (`bench_kernels --variant`); the shipped shaders have none, normal use leaves this empty.
    pub defines: &'static [(&'static str, &'static str)],
}

/// How matvec splits a row group over a workgroup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tune {
    /// Threads per workgroup (a multiple of the thread group size).
    pub wg: u32,
    /// Rows each thread group computes (x is loaded once per chunk and reused for them).
    pub rows: u32,
}

impl Default for Tune {
    /// 128-thread workgroups, 4 rows per thread group: x is loaded once for 4 rows and each lane
    /// has 4 independent weight streams in flight. Without an explicit tune, 2 rows are used
    /// when 4 would leave the GPU short of threads (see `MANY_LANES`).
    fn default() -> Tune {
        Tune { wg: 128, rows: 4 }
    }
}

/// Lanes a dispatch should have before it takes 4 rows per thread group: on the H200 (132 SMs)
/// 4096-column matrices of 4096-12288 rows ran 10-40% faster with 2 rows, 16384 x 16384 ones
/// faster with 4.
const MANY_LANES: u64 = 1 << 18;

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
        _ => None,
    }
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

    /// Label suffix naming the defines of [`Geometry::defines`].
    pub fn label(&self, xvec: bool, slow: bool) -> String {
        format!(
            "{}{}{}",
            self.dtype.name(),
            if xvec { "_xv" } else { "_xs" },
            if slow { "_fslow" } else { "" }
        )
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

/// Whether x can be read as 16-byte vectors: every row start a multiple of 4 elements.
pub(crate) fn x_vec(x: &wgpu::Buffer, x_off: u32, x_stride: u32, n_rows: u32) -> bool {
    x_off.is_multiple_of(4) && (x_stride.is_multiple_of(4) || n_rows <= 1) && x.size() >= 16
}

/// Checks that rows `off + i * stride + [0, len)`, i < n, lie in `buf` (f32 elements).
pub(crate) fn check_span(
    name: &str,
    what: &str,
    buf: &wgpu::Buffer,
    off: u32,
    stride: u32,
    n: u32,
    len: u32,
) -> Result<()> {
    let end = off as u64 + (n.max(1) as u64 - 1) * stride as u64 + len as u64;
    if end * 4 > buf.size() || end > u32::MAX as u64 {
        return Err(Error::Invalid(format!(
            "{name}: {what} needs {end} f32 elements (offset {off}, stride {stride}, {n} rows of {len}), buffer holds {}",
            buf.size() / 4
        )));
    }
    Ok(())
}

fn use_subgroups(gpu: &Gpu, opts: &MatvecOpts) -> bool {
    !opts.portable
        && gpu.features.contains(wgpu::Features::SUBGROUP)
        && gpu.info.subgroup_min_size >= 4
}

struct Plan {
    wg: u32,
    r: u32,
    tpr: u32,
}

impl Plan {
    fn new(geo: &Geometry, opts: &MatvecOpts) -> Result<Plan> {
        let t = opts.tune.unwrap_or_default();
        if !(t.wg.is_power_of_two() && (16..=256).contains(&t.wg) && (1..=4).contains(&t.rows)) {
            return Err(Error::Invalid(format!(
                "matvec tune {t:?}: wg a power of two in 16..=256, rows 1..=4"
            )));
        }
        // lanes per row group: about a quarter of the row's slices (elements on the slow path),
        // so each lane has several in flight and short rows (4096 columns) leave whole
        // workgroups of row groups reduced by subgroup shuffles alone
        let items = if geo.mv_slow() {
            geo.cols
        } else {
            geo.n_items(true)
        };
        let tpr = (items / 4).next_power_of_two().clamp(4, t.wg);
        let mut r = t.rows;
        if opts.tune.is_none() && r == 4 && (geo.rows as u64) * (tpr as u64) / 4 < MANY_LANES {
            r = 2;
        }
        Ok(Plan { wg: t.wg, r, tpr })
    }

    /// Workgroups for `rows` rows, as the (y, z) of the grid.
    fn groups(&self, rows: u32) -> (u32, u32) {
        let g = grid(rows.div_ceil(self.wg / self.tpr * self.r));
        (g[0], g[1])
    }

    fn pipeline(
        &self,
        gpu: &Gpu,
        geo: &Geometry,
        entry: &'static str,
        sg: bool,
        xvec: bool,
        extra: &[(&str, &str)],
    ) -> Result<std::sync::Arc<wgpu::ComputePipeline>> {
        let slow = geo.mv_slow();
        let mut label = format!(
            "{entry}_{}_r{}_t{}_wg{}_{}",
            geo.label(xvec, slow),
            self.r,
            self.tpr,
            self.wg,
            if sg { "sg" } else { "wgmem" }
        );
        for (n, v) in extra {
            label.push_str(&format!("_{n}={v}"));
        }
        let mut spec = geo
            .defines(PipelineSpec::new(label, SRC, entry), xvec, slow)
            .define("R", format!("{}u", self.r))
            .define("TPR", format!("{}u", self.tpr))
            .define("WG", format!("{}u", self.wg));
        if sg {
            spec = spec.define("SUBGROUPS", "true");
        }
        for (n, v) in extra {
            spec = spec.define(n, v);
        }
        gpu.pipeline(&spec)
    }
}

/// `y[t] = W x[t]` for `n_tokens` tokens (any count; above [`MAX_TOKENS`] the tiled
/// [`matmul`](super::matmul::matmul_tiled) is cheaper); see the module doc for shapes.
#[allow(clippy::too_many_arguments)]
pub fn matvec(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: &wgpu::Buffer,
    x_off: u32,
    y: &wgpu::Buffer,
    y_off: u32,
    n_tokens: u32,
) -> Result<()> {
    matvec_opts(
        pass,
        w,
        x,
        x_off,
        y,
        y_off,
        n_tokens,
        &MatvecOpts::default(),
    )
}

/// [`matvec`] with options (accumulate, strides, reduction path, work split).
#[allow(clippy::too_many_arguments)]
pub fn matvec_opts(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: &wgpu::Buffer,
    x_off: u32,
    y: &wgpu::Buffer,
    y_off: u32,
    n_tokens: u32,
    opts: &MatvecOpts,
) -> Result<()> {
    let gpu = pass.gpu();
    let geo = Geometry::of(w, false)?;
    if !(1..=MAX_GROUPS).contains(&n_tokens) {
        return Err(Error::Invalid(format!(
            "{}: matvec of {n_tokens} tokens",
            w.name
        )));
    }
    let x_stride = if opts.x_stride == 0 {
        geo.cols
    } else {
        opts.x_stride
    };
    let y_stride = if opts.y_stride == 0 {
        geo.rows
    } else {
        opts.y_stride
    };
    check_span(&w.name, "x", x, x_off, x_stride, n_tokens, geo.cols)?;
    check_span(&w.name, "y", y, y_off, y_stride, n_tokens, geo.rows)?;
    let pl = Plan::new(&geo, opts)?;
    let sg = use_subgroups(gpu, opts);
    let xvec = x_vec(x, x_off, x_stride, n_tokens);
    let pipe = pl.pipeline(gpu, &geo, "matvec", sg, xvec, opts.defines)?;
    for part in &w.parts {
        let rows = part.n_rows as u32;
        let (gy, gz) = pl.groups(rows);
        let mut prm = geo.params(rows, true);
        prm.x_off = x_off;
        prm.x_stride = x_stride;
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
                x.into(),
                Binding::from(y),
            ],
            [n_tokens, gy, gz],
        );
    }
    Ok(())
}

/// MoE decode: for each token `t < n_tokens` and slot `s < n_used`, with pair `q = t * n_used +
/// s` and expert `e = ids[ids_off + q]` (u32 [n_tokens, n_used]):
/// `y[y_off + q * y_stride ..][..rows] = W[e] · x_q`, where `x_q` is the row at
/// `x_off + (x_per_pair ? q : t) * x_stride` (per token for gate/up, per pair for down).
/// `w` is [n_expert, rows, cols]; strides default to cols / rows. Ids >= n_expert write nothing.
#[allow(clippy::too_many_arguments)]
pub fn matvec_indexed(
    pass: &mut Pass<'_>,
    w: &GpuTensor,
    x: &wgpu::Buffer,
    x_off: u32,
    x_per_pair: bool,
    ids: &wgpu::Buffer,
    ids_off: u32,
    n_used: u32,
    y: &wgpu::Buffer,
    y_off: u32,
    n_tokens: u32,
    opts: &MatvecOpts,
) -> Result<()> {
    let gpu = pass.gpu();
    let geo = Geometry::of(w, true)?;
    let n_expert = w.shape[0];
    let n_pairs = n_tokens as u64 * n_used as u64;
    if n_used == 0 || n_tokens == 0 || n_pairs > u32::MAX as u64 / 2 {
        return Err(Error::Invalid(format!(
            "{}: {n_tokens} tokens x {n_used} slots",
            w.name
        )));
    }
    let n_pairs = n_pairs as u32;
    let x_stride = if opts.x_stride == 0 {
        geo.cols
    } else {
        opts.x_stride
    };
    let y_stride = if opts.y_stride == 0 {
        geo.rows
    } else {
        opts.y_stride
    };
    let x_rows = if x_per_pair { n_pairs } else { n_tokens };
    check_span(&w.name, "x", x, x_off, x_stride, x_rows, geo.cols)?;
    check_span(&w.name, "y", y, y_off, y_stride, n_pairs, geo.rows)?;
    if (ids_off as u64 + n_pairs as u64) * 4 > ids.size() {
        return Err(Error::Invalid(format!(
            "{}: ids need {} u32 at offset {ids_off}, buffer holds {}",
            w.name,
            n_pairs,
            ids.size() / 4
        )));
    }
    let pl = Plan::new(&geo, opts)?;
    let sg = use_subgroups(gpu, opts);
    let xvec = x_vec(x, x_off, x_stride, x_rows);
    let pipe = pl.pipeline(gpu, &geo, "matvec_id", sg, xvec, opts.defines)?;
    let (gy, gz) = pl.groups(geo.rows);
    let expert_bytes = geo.rows as u64 * geo.row_bytes as u64;
    for part in &w.parts {
        let e_lo = part.row_start / geo.rows as u64;
        let e_n = part.n_rows / geo.rows as u64;
        if e_lo + e_n > n_expert || expert_bytes * e_n > part.buffer.size() {
            return Err(Error::Invalid(format!(
                "{}: part does not hold whole experts",
                w.name
            )));
        }
        let mut prm = geo.params(geo.rows, true);
        prm.x_off = x_off;
        prm.x_stride = x_stride;
        prm.y_off = y_off;
        prm.y_stride = y_stride;
        prm.accumulate = opts.accumulate as u32;
        prm.n_used = n_used;
        prm.ids_off = ids_off;
        prm.e_lo = e_lo as u32;
        prm.e_n = e_n as u32;
        prm.expert_bytes = expert_bytes as u32;
        prm.x_per_pair = x_per_pair as u32;
        let mut q0 = 0;
        while q0 < n_pairs {
            let n = (n_pairs - q0).min(MAX_GROUPS);
            prm.pair_off = q0;
            pass.dispatch(
                &pipe,
                &w.name,
                &prm,
                &[
                    (&part.buffer).into(),
                    (&part.buffer).into(),
                    x.into(),
                    Binding::from(y),
                    ids.into(),
                ],
                [n, gy, gz],
            );
            q0 += n;
        }
    }
    Ok(())
}
