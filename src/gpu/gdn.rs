//! Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) on the GPU (`shaders/gdn.wgsl`).
//! CPU references: `cpu::gdn::{gates, recurrent, chunked}`; the math is in the shader header.
//!
//! Layouts (f32 unless said; offsets and strides in elements, so one activation buffer can
//! hold many tensors):
//! - batch table ([`SeqBatch`]): per sequence `(first row, tokens, state slot, first chunk
//!   slot)` as u32. Sequence b owns token rows `row .. row + n_tokens` of every activation.
//! - `qkv` [rows, qkv_stride]: the conv output (after SiLU), channels q [Hk, d_k] | k [Hk, d_k]
//!   | v [Hv, d_v] (cpu::gdn module doc).
//! - `a`, `b` [rows, stride]: Hv raw projection values per row (they may share one buffer).
//! - `a_neg` `[Hv]` = −exp(A_log) (GGUF `ssm_a` as stored), `dt_bias` `[Hv]` (GGUF `ssm_dt.bias`).
//! - `state` pool [slots, Hv, d_k, d_v]: `S[i][j]` pairs key dim i with value dim j (HF layout).
//! - `o` [rows, o_stride]: [Hv, d_v] per row, before the gated RMSNorm.
//!
//! Two paths, same results to f32 rounding: [`recurrent`] loops over tokens (the decode path;
//! any token count), [`chunked`] is the prefill path (HF `chunk_gated_delta_rule`, chunks of
//! [`CHUNK`] tokens in the WY form: every chunk's intra-chunk solve in parallel, then one
//! ordered pass over the chunks per (sequence, head, column block) carrying the state).
//! Any d_k, d_v ≥ 1 work (pipelines are specialised per size; tested: 12, 16, 40, 64, 128,
//! 256). Workgroup memory: the recurrent kernel (2·d_k + 1536)·4 bytes; the chunk prep
//! 17.8 KiB (13.7 KiB on 16 KiB adapters); the chunk scan ((d_k + 64)·CB + 128·TD)·4 bytes
//! with (CB, TD) picked to fit (`scan_tiles`), so d_k ≤ 256 runs on 16 KiB adapters and
//! larger d_k needs more.

use super::{grid, Binding, Gpu, Pass, PipelineSpec};
pub use crate::cpu::gdn::{GdnShape, KeyHeadMap, CHUNK};
use crate::{Error, Result};

const SRC: &str = include_str!("../../shaders/gdn.wgsl");
/// Recurrent kernel: CB columns × R row groups. 32 columns keep one row of a block in one
/// 128-byte line; 8 row groups hold 16 values of S per thread at d_k = 128.
const REC_CB: u32 = 32;
const REC_R: u32 = 8;
/// Threads per workgroup of the chunk kernels.
const CHUNK_WG: u32 = 256;

/// One sequence of a batch: its token rows and its state slot (GDN state and conv state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    /// First token row in the activation buffers.
    pub row: u32,
    pub n_tokens: u32,
    /// Index into the state pools.
    pub slot: u32,
}

/// The batch table on the GPU, `[n_seq][4]` u32: (row, n_tokens, slot, first chunk slot).
pub struct SeqBatch {
    pub table: wgpu::Buffer,
    pub n_seq: u32,
    pub max_tokens: u32,
    /// Σ ceil(n_tokens / CHUNK): chunk slots the chunked path's scratch must hold.
    pub total_chunks: u32,
}

impl SeqBatch {
    /// The table's u32 words: chunk slots are handed out in sequence order.
    pub fn words(spans: &[SeqSpan]) -> Vec<u32> {
        let mut chunk = 0u32;
        let mut v = Vec::with_capacity(spans.len() * 4);
        for s in spans {
            v.extend_from_slice(&[s.row, s.n_tokens, s.slot, chunk]);
            chunk += s.n_tokens.div_ceil(CHUNK as u32);
        }
        v
    }

    pub fn new(gpu: &Gpu, spans: &[SeqSpan]) -> Result<SeqBatch> {
        let words = Self::words(spans);
        let table = gpu.upload(bytemuck::cast_slice(&words), "gdn.seqs")?;
        Ok(Self::describe(table, spans))
    }

    /// Rewrite the table for new spans, reusing the buffer when it is large enough.
    pub fn update(&mut self, gpu: &Gpu, spans: &[SeqSpan]) -> Result<()> {
        let words = Self::words(spans);
        if (words.len() as u64 * 4) > self.table.size() {
            *self = Self::new(gpu, spans)?;
        } else {
            gpu.write(&self.table, 0, bytemuck::cast_slice(&words));
            let table = self.table.clone();
            *self = Self::describe(table, spans);
        }
        Ok(())
    }

    fn describe(table: wgpu::Buffer, spans: &[SeqSpan]) -> SeqBatch {
        SeqBatch {
            table,
            n_seq: spans.len() as u32,
            max_tokens: spans.iter().map(|s| s.n_tokens).max().unwrap_or(0),
            total_chunks: spans
                .iter()
                .map(|s| s.n_tokens.div_ceil(CHUNK as u32))
                .sum(),
        }
    }
}

/// Uniforms of `gdn.wgsl` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n_seq: u32,
    max_chunks: u32,
    n_head_k: u32,
    n_head_v: u32,
    /// 0: key head h / (Hv/Hk); 1: h % Hk
    key_tile: u32,
    /// in elements
    qkv_off: u32,
    /// in elements, between token rows
    qkv_stride: u32,
    a_off: u32,
    a_stride: u32,
    b_off: u32,
    b_stride: u32,
    o_off: u32,
    o_stride: u32,
    /// in elements: slot 0 of the state pool
    state_off: u32,
    /// [`recurrent_normed`]: the gate z (in elements) and the norm's epsilon.
    z_off: u32,
    z_stride: u32,
    eps: f32,
    _pad: [u32; 3],
}
const _: () = assert!(std::mem::size_of::<Params>() == 80);

/// Buffers of one GDN call (layouts in the module doc).
pub struct GdnIo<'a> {
    pub qkv: &'a wgpu::Buffer,
    pub qkv_off: u32,
    pub qkv_stride: u32,
    pub a: &'a wgpu::Buffer,
    pub a_off: u32,
    pub a_stride: u32,
    pub b: &'a wgpu::Buffer,
    pub b_off: u32,
    pub b_stride: u32,
    /// `[Hv]` = −exp(A_log)
    pub a_neg: &'a wgpu::Buffer,
    /// `[Hv]`
    pub dt_bias: &'a wgpu::Buffer,
    /// pool [slots, Hv, d_k, d_v]
    pub state: &'a wgpu::Buffer,
    pub state_off: u32,
    pub o: &'a wgpu::Buffer,
    pub o_off: u32,
    pub o_stride: u32,
}

fn params(s: &GdnShape, batch: &SeqBatch, io: &GdnIo<'_>) -> Result<Params> {
    s.check()?;
    let cd = s.conv_dim() as u32;
    let hv = s.n_head_v as u32;
    let ov = hv * s.d_v as u32;
    if io.qkv_stride < cd || io.a_stride < hv || io.b_stride < hv || io.o_stride < ov {
        return Err(Error::Invalid(format!(
            "gdn: strides qkv {} (need {cd}), a {} / b {} (need {hv}), o {} (need {ov})",
            io.qkv_stride, io.a_stride, io.b_stride, io.o_stride
        )));
    }
    Ok(Params {
        n_seq: batch.n_seq,
        max_chunks: batch.max_tokens.div_ceil(CHUNK as u32),
        n_head_k: s.n_head_k as u32,
        n_head_v: hv,
        key_tile: (s.map == KeyHeadMap::Tile) as u32,
        qkv_off: io.qkv_off,
        qkv_stride: io.qkv_stride,
        a_off: io.a_off,
        a_stride: io.a_stride,
        b_off: io.b_off,
        b_stride: io.b_stride,
        o_off: io.o_off,
        o_stride: io.o_stride,
        state_off: io.state_off,
        z_off: 0,
        z_stride: 0,
        eps: 0.0,
        _pad: [0; 3],
    })
}

fn workgroups(n: u64, what: &str) -> Result<[u32; 3]> {
    if n > (super::MAX_GROUPS as u64).pow(2) {
        return Err(Error::Invalid(format!(
            "gdn {what}: {n} workgroups exceed one dispatch"
        )));
    }
    Ok(grid(n as u32))
}

/// Typed key of the family's kernels ([`Gpu::pipeline_for`](super::Gpu::pipeline_for)):
/// the heads' widths and the kernel.
#[derive(PartialEq, Eq, Hash)]
struct Key {
    d_k: usize,
    d_v: usize,
    kernel: Kernel,
}

#[derive(PartialEq, Eq, Hash)]
enum Kernel {
    /// The recurrent (decode) rule, with the gated norm when `gnorm`.
    Recurrent { gnorm: bool },
    /// The chunked rule's prep (`td`: `TD` of gdn.wgsl).
    Prep { td: u32 },
    /// The chunked rule's scan over column blocks of `cb` (`NE`, `TD`: gdn.wgsl's).
    Scan { cb: u32, ne: u32, td: u32 },
}

impl Key {
    /// The kernel's name in the label (upper case: its flag), its workgroup size and its
    /// other u32 consts, in the order the label names them.
    fn parts(&self) -> (&'static str, u32, Vec<(&'static str, u32)>) {
        match self.kernel {
            Kernel::Recurrent { .. } => (
                "recurrent",
                REC_CB * REC_R,
                vec![("CB", REC_CB), ("R", REC_R)],
            ),
            Kernel::Prep { td } => ("prep", CHUNK_WG, vec![("TD", td)]),
            Kernel::Scan { cb, ne, td } => {
                ("scan", CHUNK_WG, vec![("CB", cb), ("NE", ne), ("TD", td)])
            }
        }
    }
}

impl super::PipelineKey for Key {
    fn source(&self) -> &'static str {
        SRC
    }
    fn entry(&self) -> &'static str {
        match self.kernel {
            Kernel::Recurrent { .. } => "recurrent",
            Kernel::Prep { .. } => "chunk_prep",
            Kernel::Scan { .. } => "chunk_scan",
        }
    }
    fn label(&self) -> String {
        let (kind, wg, extra) = self.parts();
        let mut label = format!("gdn_{kind}_dk{}_dv{}_wg{wg}", self.d_k, self.d_v);
        for (n, v) in extra {
            label.push_str(&format!("_{}{v}", n.to_lowercase()));
        }
        if self.kernel == (Kernel::Recurrent { gnorm: true }) {
            label.push_str("_gnorm");
        }
        label
    }
    fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
        let (kind, wg, extra) = self.parts();
        let mut sp = spec
            .define("DK", format!("{}u", self.d_k))
            .define("DV", format!("{}u", self.d_v))
            .define("WG", format!("{wg}u"))
            .define("CHUNK", format!("{CHUNK}u"))
            .define(&kind.to_uppercase(), "true");
        for (n, v) in extra {
            sp = sp.define(n, format!("{v}u"));
        }
        if self.kernel == (Kernel::Recurrent { gnorm: true }) {
            sp = sp.define("GNORM", "true");
        }
        sp
    }
}

/// The recurrent rule over every token of every sequence in `batch`, in token order:
/// reads and updates each sequence's state slot, writes `o`. One dispatch; the decode path.
pub fn recurrent(
    pass: &mut Pass<'_>,
    s: &GdnShape,
    batch: &SeqBatch,
    io: &GdnIo<'_>,
) -> Result<()> {
    let p = params(s, batch, io)?;
    if batch.n_seq == 0 {
        return Ok(());
    }
    let pl = pass.gpu().pipeline_for(Key {
        d_k: s.d_k,
        d_v: s.d_v,
        kernel: Kernel::Recurrent { gnorm: false },
    })?;
    let n_cb = (s.d_v as u64).div_ceil(REC_CB as u64);
    let n = batch.n_seq as u64 * s.n_head_v as u64 * n_cb;
    pass.dispatch(
        &pl,
        "gdn_recurrent",
        &p,
        &[
            Binding::from(&batch.table),
            io.qkv.into(),
            io.a.into(),
            io.b.into(),
            io.a_neg.into(),
            io.dt_bias.into(),
            io.state.into(),
            io.o.into(),
        ],
        workgroups(n, "recurrent")?,
    );
    Ok(())
}

/// The gated RMSNorm that follows the GDN step in Qwen3.5 (`norm::gated_rms_norm` of each
/// head's output row): y = o · rsqrt(Σo²/d_v + eps) · w · silu(z).
pub struct GatedNorm<'a> {
    /// Gates, `[Hv, d_v]` per token row at `z_off + row · z_stride`.
    pub z: &'a wgpu::Buffer,
    pub z_off: u32,
    pub z_stride: u32,
    /// `[d_v]` f32 weight.
    pub w: &'a wgpu::Buffer,
    pub eps: f32,
}

/// Whether [`recurrent_normed`] can run `batch` on this adapter: one token per sequence, and
/// the ten storage bindings it takes.
pub fn normed_fits(gpu: &Gpu, batch: &SeqBatch) -> bool {
    batch.max_tokens == 1 && gpu.limits.max_storage_buffers_per_shader_stage >= 10
}

/// [`recurrent`] followed by the gated RMSNorm of every head's output, in one dispatch (one
/// workgroup per (sequence, head) walks the head's column blocks, then norms the row): the
/// same bits as [`recurrent`] then `norm::gated_rms_norm`. Decode only ([`normed_fits`]).
pub fn recurrent_normed(
    pass: &mut Pass<'_>,
    s: &GdnShape,
    batch: &SeqBatch,
    io: &GdnIo<'_>,
    gn: &GatedNorm<'_>,
) -> Result<()> {
    let mut p = params(s, batch, io)?;
    if batch.n_seq == 0 {
        return Ok(());
    }
    if !normed_fits(pass.gpu(), batch) {
        return Err(Error::Invalid(format!(
            "gdn recurrent_normed: {} tokens per sequence (one only), or too few storage \
             bindings on this adapter",
            batch.max_tokens
        )));
    }
    let ov = s.n_head_v as u32 * s.d_v as u32;
    super::check_span("gdn", "z", gn.z, gn.z_off, gn.z_stride, 1u32, ov)?;
    super::check_span("gdn", "norm weight", gn.w, 0u32, 0u32, 1u32, s.d_v as u32)?;
    p.z_off = gn.z_off;
    p.z_stride = gn.z_stride;
    p.eps = gn.eps;
    let pl = pass.gpu().pipeline_for(Key {
        d_k: s.d_k,
        d_v: s.d_v,
        kernel: Kernel::Recurrent { gnorm: true },
    })?;
    let n = batch.n_seq as u64 * s.n_head_v as u64;
    let b: Vec<Binding> = vec![
        Binding::from(&batch.table),
        io.qkv.into(),
        io.a.into(),
        io.b.into(),
        io.a_neg.into(),
        io.dt_bias.into(),
        io.state.into(),
        io.o.into(),
        gn.z.into(),
        gn.w.into(),
    ];
    pass.dispatch(
        &pl,
        "gdn_recurrent_gnorm",
        &p,
        &b,
        workgroups(n, "recurrent")?,
    );
    Ok(())
}

/// f32 elements of one (chunk slot, value head) scratch record (see `gdn.wgsl`).
fn slot_len(s: &GdnShape) -> u64 {
    let c = CHUNK as u64;
    c * (3 * s.d_k as u64 + s.d_v as u64) + c * c + 4
}

/// Bytes of scratch [`chunked`] needs for `total_chunks` chunk slots ([`SeqBatch::total_chunks`]).
/// About 147 KiB per chunk and value head at d_k = d_v = 128: split very long prefills so
/// that it stays within [`Gpu::max_binding`].
pub fn scratch_bytes(s: &GdnShape, total_chunks: u32) -> u64 {
    slot_len(s) * s.n_head_v as u64 * total_chunks as u64 * 4
}

/// (CB, TD) of the chunk scan: 16 columns per workgroup (d_v / 16 workgroups per head keep
/// a single long prefill spread over the GPU), fewer when workgroup memory is short, and
/// staging tiles of 16 rows. Measured on the H200 (d 128, one 4096-token sequence, one
/// layer): scan 2.6 ms with 16-row tiles (one load in flight per thread), 3.2 ms with
/// 64-row tiles (four loads in flight, but 45 KiB of workgroup memory per workgroup). The
/// shader also takes TD = 32 or 64.
fn scan_tiles(limit: u64, s: &GdnShape) -> Result<(u32, u32)> {
    let bytes = |cb: u32, td: u32| {
        ((s.d_k as u64 + CHUNK as u64) * cb as u64 + 2 * CHUNK as u64 * td as u64) * 4
    };
    for (cb, td) in [(16, 16), (8, 16), (4, 16)] {
        if bytes(cb, td) <= limit {
            return Ok((cb, td));
        }
    }
    Err(Error::Unsupported(format!(
        "gdn: d_k {} needs {} bytes of workgroup memory, the adapter has {limit}",
        s.d_k,
        bytes(4, 16)
    )))
}

/// Gram tile width of the chunk prep: 16 dims, 8 when workgroup memory is 16 KiB.
fn prep_td(limit: u64) -> u32 {
    let bytes = |td: u64| {
        (2 * CHUNK as u64 * (td + 1) + 4 * CHUNK as u64 + (CHUNK * (CHUNK - 1) / 2) as u64) * 4
    };
    if bytes(16) <= limit {
        16
    } else {
        8
    }
}

/// The chunked form over every sequence of `batch` (the prefill path): same inputs,
/// outputs and state updates as [`recurrent`]. `scratch` holds at least
/// [`scratch_bytes`]`(s, batch.total_chunks)` bytes. Two dispatches.
pub fn chunked(
    pass: &mut Pass<'_>,
    s: &GdnShape,
    batch: &SeqBatch,
    io: &GdnIo<'_>,
    scratch: &wgpu::Buffer,
) -> Result<()> {
    let opts = ChunkOpts {
        wg_mem: pass.gpu().limits.max_compute_workgroup_storage_size as u64,
        prep: true,
        scan: true,
    };
    chunked_with(pass, s, batch, io, scratch, &opts)
}

/// Knobs of [`chunked_with`], for tests and timing.
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct ChunkOpts {
    /// Choose kernel variants for this much workgroup memory (at most the adapter's), so
    /// tests can run the variants of 16 KiB adapters anywhere.
    pub wg_mem: u64,
    /// Record the prep dispatch / the scan dispatch (both for a real run).
    pub prep: bool,
    pub scan: bool,
}

/// [`chunked`] with explicit [`ChunkOpts`].
#[doc(hidden)]
pub fn chunked_with(
    pass: &mut Pass<'_>,
    s: &GdnShape,
    batch: &SeqBatch,
    io: &GdnIo<'_>,
    scratch: &wgpu::Buffer,
    opts: &ChunkOpts,
) -> Result<()> {
    let wg_mem = opts.wg_mem;
    let p = params(s, batch, io)?;
    if batch.n_seq == 0 {
        return Ok(());
    }
    let gpu = pass.gpu();
    let need = scratch_bytes(s, batch.total_chunks);
    if scratch.size() < need || need > gpu.max_binding() {
        return Err(Error::Invalid(format!(
            "gdn chunked: scratch of {} bytes, need {need} (binding limit {})",
            scratch.size(),
            gpu.max_binding()
        )));
    }
    // Element offsets into the scratch are u32.
    if need / 4 > u32::MAX as u64 {
        return Err(Error::Invalid(format!(
            "gdn chunked: scratch of {need} bytes is too large"
        )));
    }
    let prep = gpu.pipeline_for(Key {
        d_k: s.d_k,
        d_v: s.d_v,
        kernel: Kernel::Prep {
            td: prep_td(wg_mem),
        },
    })?;
    let (cb, td) = scan_tiles(wg_mem, s)?;
    // CB ≥ 4 makes the CHUNK × CB tiles a whole number of entries per thread.
    let ne = CHUNK as u32 * cb / CHUNK_WG;
    let scan = gpu.pipeline_for(Key {
        d_k: s.d_k,
        d_v: s.d_v,
        kernel: Kernel::Scan { cb, ne, td },
    })?;
    let seqs = Binding::from(&batch.table);
    let n_prep = batch.n_seq as u64 * p.max_chunks as u64 * s.n_head_v as u64;
    if opts.prep {
        pass.dispatch(
            &prep,
            "gdn_chunk_prep",
            &p,
            &[
                seqs.clone(),
                io.qkv.into(),
                io.a.into(),
                io.b.into(),
                io.a_neg.into(),
                io.dt_bias.into(),
                scratch.into(),
            ],
            workgroups(n_prep, "chunk_prep")?,
        );
    }
    let n_scan = batch.n_seq as u64 * s.n_head_v as u64 * (s.d_v as u64).div_ceil(cb as u64);
    if opts.scan {
        pass.dispatch(
            &scan,
            "gdn_chunk_scan",
            &p,
            &[seqs, scratch.into(), io.state.into(), io.o.into()],
            workgroups(n_scan, "chunk_scan")?,
        );
    }
    Ok(())
}
