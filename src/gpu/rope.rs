//! Rotary position embedding in place (`shaders/rope.wgsl`). CPU references:
//! `cpu::ops::{rope_neox, rope_interleaved}`; frequency tables: `cpu::ops::{rope_inv_freq,
//! yarn_inv_freq}`.
//!
//! The inverse frequencies are computed on the CPU (f32, as the references do) and uploaded
//! once as a [`RopeTable`]; positions are u32 (a buffer, or `pos0 + t`), so the kernel can
//! reduce the angle exactly (see the shader's header) and stays accurate at any position.

use super::{grid, Binding, Gpu, Pass, PipelineSpec};
use crate::{Error, Result};

const SRC: &str = include_str!("../../shaders/rope.wgsl");
const WG: u32 = 256;

/// Uniforms of `rope.wgsl` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n_tokens: u32,
    n_heads: u32,
    n_freq: u32,
    /// In elements.
    x_off: u32,
    token_stride: u32,
    head_stride: u32,
    rot_off: u32,
    pos0: u32,
    pos_off: u32,
    inverse: u32,
    _pad: [u32; 2],
}
const _: () = assert!(std::mem::size_of::<Params>() == 48);

/// Which elements pair up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// `(i, i + n_rot/2)`: HF `rotate_half`, llama.cpp NEOX (Qwen3.5).
    Neox,
    /// `(2i, 2i+1)`: DeepSeek's complex pairs, llama.cpp NORM.
    Interleaved,
}

/// A frequency table on the GPU: per frequency, `inv_freq / 2π` as a 64-bit binary fraction
/// of a turn, `(hi, lo)` u32 pairs `[n_freq, 2]`.
pub struct RopeTable {
    pub buffer: wgpu::Buffer,
    /// `n_rot / 2`.
    pub n_freq: u32,
}

/// `inv_freq[i] / 2π` mod 1 as 64-bit fractions `(hi, lo)`: the rotation per position in
/// turns. f64 keeps 53 significant bits, so `pos · table` is off by < 2^-53·pos turns.
pub fn turn_table(inv_freq: &[f32]) -> Vec<u32> {
    inv_freq
        .iter()
        .flat_map(|&f| {
            let t = (f as f64 / std::f64::consts::TAU).rem_euclid(1.0);
            let fixed = (t * 18446744073709551616.0) as u64; // 2^64; saturates at t → 1
            [(fixed >> 32) as u32, fixed as u32]
        })
        .collect()
}

impl RopeTable {
    /// Upload `inv_freq` (`[n_rot/2]`, e.g. from `cpu::ops::rope_inv_freq`).
    pub fn new(gpu: &Gpu, inv_freq: &[f32], label: &str) -> Result<RopeTable> {
        if inv_freq.is_empty() || inv_freq.iter().any(|f| !f.is_finite()) {
            return Err(Error::Invalid(format!(
                "{label}: RoPE needs a non-empty table of finite frequencies"
            )));
        }
        let words = turn_table(inv_freq);
        Ok(RopeTable {
            buffer: gpu.upload(bytemuck::cast_slice(&words), label)?,
            n_freq: inv_freq.len() as u32,
        })
    }
}

/// Heads to rotate: token `t`, head `h` starts at element `off + t·token_stride + h·head_stride`.
#[derive(Clone, Copy, Debug)]
pub struct RopeView<'a> {
    pub buf: &'a wgpu::Buffer,
    /// In elements.
    pub off: u32,
    pub n_tokens: u32,
    pub n_heads: u32,
    pub head_dim: u32,
    pub token_stride: u32,
    pub head_stride: u32,
}

impl<'a> RopeView<'a> {
    /// Packed `[n_tokens, n_heads, head_dim]` at element `off`.
    pub fn packed(
        buf: &'a wgpu::Buffer,
        off: u32,
        n_tokens: u32,
        n_heads: u32,
        head_dim: u32,
    ) -> Self {
        RopeView {
            buf,
            off,
            n_tokens,
            n_heads,
            head_dim,
            token_stride: n_heads * head_dim,
            head_stride: head_dim,
        }
    }
}

/// Per-token positions.
#[derive(Clone, Copy, Debug)]
pub enum Positions<'a> {
    /// Token `t` is at `pos0 + t`.
    From(u32),
    /// Token `t` is at `buf[off + t]` (u32).
    Buffer { buf: &'a wgpu::Buffer, off: u32 },
}

/// Uniforms of `rope.wgsl`'s `qk_norm_rope` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct QParams {
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    n_freq: u32,
    /// In elements.
    q_off: u32,
    q_stride: u32,
    k_off: u32,
    v_off: u32,
    pos_off: u32,
    row_off: u32,
    eps: f32,
    _pad: u32,
}
const _: () = assert!(std::mem::size_of::<QParams>() == 48);

/// One token's q, k and v (f32 heads in `buf`, offsets in elements) and where they go: the
/// input of [`qk_norm_rope`].
pub struct QkvDecode<'a> {
    pub buf: &'a wgpu::Buffer,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    /// q head h at `q_off + h · q_stride` (normed and rotated in place).
    pub q_off: u32,
    pub q_stride: u32,
    /// k and v heads packed from `k_off` / `v_off`.
    pub k_off: u32,
    pub v_off: u32,
    /// `[head_dim]` f32 weights of the per-head RMSNorms.
    pub q_norm: &'a wgpu::Buffer,
    pub k_norm: &'a wgpu::Buffer,
    pub eps: f32,
    /// The token's position at `positions[pos_off]`, its cache row at `rows[row_off]`.
    pub positions: &'a wgpu::Buffer,
    pub pos_off: u32,
    pub rows: &'a wgpu::Buffer,
    pub row_off: u32,
    /// Cache rows of `n_head_kv · head_dim` values, f16 (`f16`) or f32.
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
    pub f16: bool,
}

/// The largest head [`qk_norm_rope`] takes (`rope.wgsl`'s `MAX_HD`; the attention's too).
pub const QKNR_MAX_HEAD: u32 = 2 * WG;

/// Whether [`qk_norm_rope`] takes heads of `head_dim` with `table`'s rotated pairs.
pub fn qk_norm_rope_fits(head_dim: u32, table: &RopeTable) -> bool {
    head_dim > 0
        && head_dim <= QKNR_MAX_HEAD
        && head_dim.is_multiple_of(2)
        && 2 * table.n_freq <= head_dim
}

/// Where [`qk_norm_rope_kv`] reads k and v heads (at `QkvDecode::k_off` and `v_off`) when
/// they are not in `QkvDecode::buf`, and V's norm.
pub struct KvHeads<'a> {
    pub k: &'a wgpu::Buffer,
    /// May be `k` (Gemma-4's global blocks without `attn_v`: V is K before its norm and RoPE).
    pub v: &'a wgpu::Buffer,
    /// V heads RMSNormed without a weight before their cache write (Gemma-4's `v_norm`).
    pub v_norm: bool,
}

/// Qwen3.5 attention's decode prologue for one token in one dispatch: per-head RMSNorm of q and
/// k, NEOX RoPE of their leading `2·table.n_freq` dims, k and v written to their cache rows:
/// the bits of `norm::rms_norm` (per head), [`rope`] and `attention::write_kv`. Heads of up to
/// [`QKNR_MAX_HEAD`] ([`qk_norm_rope_fits`]).
pub fn qk_norm_rope(pass: &mut Pass<'_>, a: &QkvDecode<'_>, table: &RopeTable) -> Result<()> {
    qknr(pass, a, None, table)
}

/// [`qk_norm_rope`] with k and v heads in their own buffers and V's weightless RMSNorm when
/// `kv.v_norm` (Gemma-4: HF `Gemma4TextAttention`'s `v_norm`, llama.cpp's `ggml_rms_norm` of
/// Vcur): the bits of `norm::rms_norm` of q, k (and v) per head, [`rope`] of q and k and
/// `attention::write_kv` of k and v.
pub fn qk_norm_rope_kv(
    pass: &mut Pass<'_>,
    a: &QkvDecode<'_>,
    kv: &KvHeads<'_>,
    table: &RopeTable,
) -> Result<()> {
    qknr(pass, a, Some(kv), table)
}

fn qknr(
    pass: &mut Pass<'_>,
    a: &QkvDecode<'_>,
    kv: Option<&KvHeads<'_>>,
    table: &RopeTable,
) -> Result<()> {
    let hd = a.head_dim;
    if !qk_norm_rope_fits(hd, table) {
        return Err(Error::Invalid(format!(
            "qk_norm_rope: head_dim {hd} (even, at most {QKNR_MAX_HEAD}) with {} rotated pairs",
            table.n_freq
        )));
    }
    let op = "qk_norm_rope";
    let (kb, vb) = kv.map_or((a.buf, a.buf), |kv| (kv.k, kv.v));
    super::check_span(op, "q", a.buf, a.q_off, a.q_stride, a.n_head, hd)?;
    super::check_span(op, "k", kb, a.k_off, 0u32, 1u32, a.n_head_kv * hd)?;
    super::check_span(op, "v", vb, a.v_off, 0u32, 1u32, a.n_head_kv * hd)?;
    super::check_span(op, "q norm", a.q_norm, 0u32, 0u32, 1u32, hd)?;
    super::check_span(op, "k norm", a.k_norm, 0u32, 0u32, 1u32, hd)?;
    super::check_span(op, "positions", a.positions, a.pos_off, 0u32, 1u32, 1u32)?;
    super::check_span(op, "rows", a.rows, a.row_off, 0u32, 1u32, 1u32)?;
    // norm.rs's vec4 items (`V4` of norm.wgsl) for heads longer than a workgroup whose views
    // (q's, k's and v's) start on a multiple of 4 elements and step by one; the per-head norms
    // are replayed in one order, so a mix of aligned and unaligned views has no fused form
    let aligned = [(a.q_off, a.q_stride), (a.k_off, hd), (a.v_off, hd)]
        .map(|(off, stride)| off.is_multiple_of(4) && stride.is_multiple_of(4));
    let v4 = hd > WG && aligned.iter().all(|&b| b);
    if hd > WG && !v4 && aligned.iter().any(|&b| b) {
        return Err(Error::Invalid(format!(
            "qk_norm_rope: heads of {hd} with views aligned to 4 elements and not"
        )));
    }
    let v_norm = kv.is_some_and(|kv| kv.v_norm);
    #[derive(PartialEq, Eq, Hash)]
    struct QkNormRope {
        /// The KV cache is f16.
        f16: bool,
        /// V heads RMSNormed (`V_NORM`).
        v_norm: bool,
        /// k and v in their own buffers (`KV3`).
        kv3: bool,
        /// norm.wgsl's vec4 items (`V4`).
        v4: bool,
    }
    impl super::PipelineKey for QkNormRope {
        fn source(&self) -> &'static str {
            SRC
        }
        fn entry(&self) -> &'static str {
            "qk_norm_rope"
        }
        fn label(&self) -> String {
            format!(
                "qk_norm_rope_{}{}{}{}",
                if self.f16 { "f16" } else { "f32" },
                if self.v_norm { "_vnorm" } else { "" },
                if self.kv3 { "_kv3" } else { "" },
                if self.v4 { "_v4" } else { "" },
            )
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec.define("QKNR", true)
                .define("KV_F16", self.f16)
                .define("V_NORM", self.v_norm)
                .define("KV3", self.kv3)
                .define("V4", self.v4)
        }
    }
    let pl = pass.gpu().pipeline_for(QkNormRope {
        f16: a.f16,
        v_norm,
        kv3: kv.is_some(),
        v4,
    })?;
    let params = QParams {
        n_head: a.n_head,
        n_head_kv: a.n_head_kv,
        head_dim: hd,
        n_freq: table.n_freq,
        q_off: a.q_off,
        q_stride: a.q_stride,
        k_off: a.k_off,
        v_off: a.v_off,
        pos_off: a.pos_off,
        row_off: a.row_off,
        eps: a.eps,
        _pad: 0,
    };
    let mut bindings = vec![
        Binding::from(a.buf),
        Binding::from(&table.buffer),
        Binding::from(a.positions),
        Binding::from(a.q_norm),
        Binding::from(a.k_norm),
        Binding::from(a.rows),
        Binding::from(a.k_cache),
        Binding::from(a.v_cache),
    ];
    if let Some(kv) = kv {
        bindings.extend([Binding::from(kv.k), Binding::from(kv.v)]);
    }
    pass.dispatch(
        &pl,
        op,
        &params,
        &bindings,
        grid(a.n_head + 2 * a.n_head_kv),
    );
    Ok(())
}

/// Rotate the `2·table.n_freq` dims starting at `rot_off` of every head of `x` in place.
pub fn rope(
    pass: &mut Pass<'_>,
    x: &RopeView<'_>,
    style: RopeStyle,
    rot_off: u32,
    table: &RopeTable,
    pos: Positions<'_>,
    inverse: bool,
) -> Result<()> {
    let n_rot = 2 * table.n_freq;
    if rot_off as u64 + n_rot as u64 > x.head_dim as u64 {
        return Err(Error::Invalid(format!(
            "rope: {n_rot} rotated dims at {rot_off} do not fit a head of {}",
            x.head_dim
        )));
    }
    let n = x.n_tokens as u64 * x.n_heads as u64 * table.n_freq as u64;
    if n == 0 {
        return Ok(());
    }
    if n > u32::MAX as u64 - WG as u64 {
        return Err(Error::Invalid(format!(
            "rope: {n} pairs is too many for one dispatch"
        )));
    }
    let end = x.off as u64
        + (x.n_tokens as u64 - 1) * x.token_stride as u64
        + (x.n_heads as u64 - 1) * x.head_stride as u64
        + x.head_dim as u64;
    if end * 4 > x.buf.size() {
        return Err(Error::Invalid(format!(
            "rope: heads reach element {end}, the buffer holds {}",
            x.buf.size() / 4
        )));
    }
    let (pos0, pos_off, pos_buf) = match pos {
        Positions::From(p0) => {
            if p0 as u64 + x.n_tokens as u64 > u32::MAX as u64 + 1 {
                return Err(Error::Invalid(format!(
                    "rope: positions from {p0} overflow u32"
                )));
            }
            (p0, 0, None)
        }
        Positions::Buffer { buf, off } => {
            if (off as u64 + x.n_tokens as u64) * 4 > buf.size() {
                return Err(Error::Invalid(format!(
                    "rope: {} positions from {off} run past the positions buffer ({} entries)",
                    x.n_tokens,
                    buf.size() / 4
                )));
            }
            (0, off, Some(buf))
        }
    };
    let interleaved = style == RopeStyle::Interleaved;
    let has_pos = pos_buf.is_some();
    #[derive(PartialEq, Eq, Hash)]
    struct Rope {
        interleaved: bool,
        /// Positions from a buffer.
        has_pos: bool,
    }
    impl super::PipelineKey for Rope {
        fn source(&self) -> &'static str {
            SRC
        }
        fn entry(&self) -> &'static str {
            "main"
        }
        fn label(&self) -> String {
            format!(
                "rope_{}{}",
                if self.interleaved {
                    "interleaved"
                } else {
                    "neox"
                },
                if self.has_pos { "_posbuf" } else { "" }
            )
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec.define("INTERLEAVED", self.interleaved)
                .define("POS_BUF", self.has_pos)
        }
    }
    let pl = pass.gpu().pipeline_for(Rope {
        interleaved,
        has_pos,
    })?;
    let params = Params {
        n_tokens: x.n_tokens,
        n_heads: x.n_heads,
        n_freq: table.n_freq,
        x_off: x.off,
        token_stride: x.token_stride,
        head_stride: x.head_stride,
        rot_off,
        pos0,
        pos_off,
        inverse: inverse as u32,
        _pad: [0; 2],
    };
    let mut bindings = vec![Binding::from(x.buf), Binding::from(&table.buffer)];
    if let Some(b) = pos_buf {
        bindings.push(b.into());
    }
    pass.dispatch(
        &pl,
        "rope",
        &params,
        &bindings,
        grid((n as u32).div_ceil(WG)),
    );
    Ok(())
}

/// NEOX halves on the LEADING `2·table.n_freq` dims of each head (Qwen3.5: 64 of 256).
pub fn rope_neox(
    pass: &mut Pass<'_>,
    x: &RopeView<'_>,
    table: &RopeTable,
    pos: Positions<'_>,
    inverse: bool,
) -> Result<()> {
    rope(pass, x, RopeStyle::Neox, 0, table, pos, inverse)
}

/// Interleaved pairs on the TRAILING `2·table.n_freq` dims of each head (DeepSeek-V4: the
/// last 64 of 512).
pub fn rope_interleaved(
    pass: &mut Pass<'_>,
    x: &RopeView<'_>,
    table: &RopeTable,
    pos: Positions<'_>,
    inverse: bool,
) -> Result<()> {
    let rot_off = x.head_dim.checked_sub(2 * table.n_freq).ok_or_else(|| {
        Error::Invalid(format!(
            "rope: {} rotated dims exceed a head of {}",
            2 * table.n_freq,
            x.head_dim
        ))
    })?;
    rope(
        pass,
        x,
        RopeStyle::Interleaved,
        rot_off,
        table,
        pos,
        inverse,
    )
}
