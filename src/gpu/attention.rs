//! Attention kernels (`shaders/attention.wgsl`). CPU reference: `cpu::attention`.
//!
//! # KV cache layout
//! A cache buffer holds position-major rows `[n_rows][n_head_kv][head_dim]` of f16 or f32
//! ([`KvShape`]): one row per cached token with every KV head. A sequence owns a range of
//! rows (its position `p` is row `row0 + p`), so several sequences can share one buffer and
//! one decode dispatch ([`Keys::Ranges`]); a row of one head is `head_dim` contiguous
//! elements (512 bytes at 256 × f16), which a key tile loads as coalesced 8/16-byte
//! vectors, as well as a head-major layout would, while letting a cache grow by rows.
//!
//! # Kernels
//! - [`write_kv`]: f32 rows (K or V after RoPE) → cache rows (f16 rounds to nearest even).
//! - [`attention`]: one flash-attention kernel for prefill and decode. Query rows are
//!   (token, q head) pairs; a workgroup takes a tile of rows of one KV head (GQA: the
//!   group's q heads share each key tile) and walks key tiles held in workgroup memory
//!   with an online softmax. Which keys a query sees is [`Keys`]: causal over one
//!   sequence's rows (chunked prefill continuing a cache, optional sliding window), a
//!   per-query row range (batched decode over several sequences), or a per-query index
//!   list over two sources (DeepSeek-V4: window ring in A, compressed entries in B), each
//!   token's own list with its own length and split ([`Keys::Rows`]).
//!   Optional per-head sinks (softmax over `[scores…, sink]`), K = V (one shared tensor),
//!   and split-K: `n_split` workgroups per row tile each take a slice of the keys and write
//!   `(o, m, l)` partials, merged by a combine kernel with the log-sum-exp rule.

use super::{grid, Binding, Gpu, Pass, PipelineSpec};
use crate::{Error, Result};

const SRC: &str = include_str!("../../shaders/attention.wgsl");

/// Largest supported head size (DeepSeek-V4's 512).
pub const MAX_HEAD_DIM: u32 = 512;
/// Index-list entry that masks its slot.
pub const INVALID: u32 = 0xffff_ffff;
/// Index-list bit selecting source B (`row | SRC_B`).
pub const SRC_B: u32 = 0x8000_0000;

/// Element type of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvType {
    F16,
    F32,
}

impl KvType {
    pub fn bytes(self) -> u64 {
        match self {
            KvType::F16 => 2,
            KvType::F32 => 4,
        }
    }
    fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
        }
    }
}

/// Shape of a KV cache buffer: rows of `[n_head_kv][head_dim]` elements of `dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub dtype: KvType,
    pub n_head_kv: u32,
    pub head_dim: u32,
}

impl KvShape {
    /// Elements per row (`n_head_kv * head_dim`).
    pub fn row_elems(&self) -> u64 {
        self.n_head_kv as u64 * self.head_dim as u64
    }
    pub fn row_bytes(&self) -> u64 {
        self.row_elems() * self.dtype.bytes()
    }
    /// Bytes of a buffer holding `n_rows` rows.
    pub fn bytes(&self, n_rows: u64) -> u64 {
        self.row_bytes() * n_rows
    }

    /// Positions per sequence a pool of `slots` sequences can grow to on `gpu`: each layer's
    /// K (and V) is one buffer of `[slots, positions]` rows, bounded by the binding limit
    /// (in steps of 256 where that leaves any).
    pub fn max_positions(&self, gpu: &Gpu, slots: usize) -> usize {
        let per_seq = (gpu.max_binding() / self.row_bytes().max(1) / slots.max(1) as u64) as usize;
        if per_seq >= 256 {
            per_seq / 256 * 256
        } else {
            per_seq
        }
    }

    /// Grow every `(K, V)` pool of `slots` sequences from `cap` to at least `need` positions
    /// per sequence (doubling, which amortizes the copies; near the binding limit what still
    /// fits), each slot's rows copied on the GPU; the new capacity.
    pub fn grow_pools<'a>(
        &self,
        pass: &mut Pass<'_>,
        pools: impl Iterator<Item = &'a mut (wgpu::Buffer, wgpu::Buffer)>,
        slots: usize,
        cap: usize,
        need: usize,
        label: &str,
    ) -> Result<usize> {
        let gpu = pass.gpu();
        let max_cap = self.max_positions(gpu, slots);
        if need > max_cap {
            return Err(Error::Invalid(format!(
                "a KV cache of {need} positions x {slots} sequences exceeds the adapter's binding \
                 limit ({max_cap} positions fit): use fewer sequences (`--parallel`) or a \
                 shorter context"
            )));
        }
        let new_cap = need.max(cap * 2).next_multiple_of(256).min(max_cap);
        let rows = (slots * new_cap) as u64;
        for kv in pools {
            let k = gpu.buffer(self.bytes(rows), &format!("{label}.k"))?;
            let v = gpu.buffer(self.bytes(rows), &format!("{label}.v"))?;
            for slot in 0..slots as u64 {
                let (from, to, len) = (
                    self.bytes(slot * cap as u64),
                    self.bytes(slot * new_cap as u64),
                    self.bytes(cap as u64),
                );
                pass.copy(&kv.0, from, &k, to, len);
                pass.copy(&kv.1, from, &v, to, len);
            }
            *kv = (k, v);
        }
        Ok(new_cap)
    }
    fn check(&self) -> Result<()> {
        let hd = self.head_dim;
        if hd == 0 || !hd.is_multiple_of(4) || hd > MAX_HEAD_DIM {
            return Err(Error::Invalid(format!(
                "attention: head_dim {hd} unsupported (a multiple of 4 up to {MAX_HEAD_DIM})"
            )));
        }
        if self.n_head_kv == 0 {
            return Err(Error::Invalid("attention: n_head_kv is 0".into()));
        }
        Ok(())
    }
}

/// Destination rows of [`write_kv`].
#[derive(Clone, Copy, Debug)]
pub enum DstRows<'a> {
    /// Token `t` goes to row `row0 + t` (one sequence: `row0` = its base row + `pos0`).
    Range { row0: u32 },
    /// Token `t` goes to row `rows[off + t]` (u32; a batch of sequences at their positions).
    List { rows: &'a wgpu::Buffer, off: u32 },
}

/// Uniforms of `write_kv` (same fields, same order as `WParams`).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct WParams {
    n_tok: u32,
    width: u32,      // elements per row
    src_off: u32,    // in elements
    src_stride: u32, // in elements between tokens
    row0: u32,
    rows_off: u32, // in u32 elements
    use_rows: u32,
    pad: u32,
}
const _: () = assert!(std::mem::size_of::<WParams>() == 32);

/// Write `n_tok` rows into a KV cache: `src` f32 `[n_tok][n_head_kv][head_dim]` starting at
/// element `src_off`, `src_stride` elements between tokens, into `cache` rows given by `dst`.
/// Call once for K and once for V (once only when K = V). `cache` must not be `src`.
#[allow(clippy::too_many_arguments)]
pub fn write_kv(
    pass: &mut Pass<'_>,
    kv: KvShape,
    src: &wgpu::Buffer,
    src_off: u32,
    src_stride: u32,
    n_tok: u32,
    cache: &wgpu::Buffer,
    dst: DstRows<'_>,
) -> Result<()> {
    kv.check()?;
    if n_tok == 0 {
        return Ok(());
    }
    let width = kv.row_elems() as u32;
    #[derive(PartialEq, Eq, Hash)]
    struct WriteKv {
        kv: KvType,
    }
    impl super::PipelineKey for WriteKv {
        fn source(&self) -> &'static str {
            SRC
        }
        fn entry(&self) -> &'static str {
            "write_kv"
        }
        fn label(&self) -> String {
            format!("attention_write_kv_{}", self.kv.name())
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec.define("WRITE", "true")
                .define("KV_F16", self.kv == KvType::F16)
        }
    }
    let pl = pass.gpu().pipeline_for(WriteKv { kv: kv.dtype })?;
    let (row0, rows_buf, rows_off, use_rows) = match dst {
        DstRows::Range { row0 } => (row0, src, 0, 0),
        DstRows::List { rows, off } => (0, rows, off, 1),
    };
    let params = WParams {
        n_tok,
        width,
        src_off,
        src_stride,
        row0,
        rows_off,
        use_rows,
        pad: 0,
    };
    let per_tok = if kv.dtype == KvType::F16 {
        width / 2
    } else {
        width
    };
    let threads = n_tok as u64 * per_tok as u64;
    pass.dispatch(
        &pl,
        "write_kv",
        &params,
        &[src.into(), rows_buf.into(), Binding::from(cache)],
        grid(threads.div_ceil(256) as u32),
    );
    Ok(())
}

/// Query (f32) rows: `q[t][head][d]` at `off + t * tok_stride + head * head_stride + d`
/// (elements). `head_stride` lets Qwen3.5's interleaved `[q | gate]` projection be read
/// in place (`head_stride = 2 * head_dim`).
#[derive(Clone, Copy, Debug)]
pub struct QView<'a> {
    pub buf: &'a wgpu::Buffer,
    pub off: u32,
    pub tok_stride: u32,
    pub head_stride: u32,
}

/// Output (f32) rows: `out[t][head][d]` at `off + t * tok_stride + head * head_dim + d`.
#[derive(Clone, Copy, Debug)]
pub struct OutView<'a> {
    pub buf: &'a wgpu::Buffer,
    pub off: u32,
    pub tok_stride: u32,
}

/// A KV source: cache buffers of one [`KvShape`]. `v: None` means V is K (DeepSeek-V4).
#[derive(Clone, Copy, Debug)]
pub struct KvSource<'a> {
    pub k: &'a wgpu::Buffer,
    pub v: Option<&'a wgpu::Buffer>,
}

/// Which keys query token `t` sees.
#[derive(Clone, Copy, Debug)]
pub enum Keys<'a> {
    /// One sequence whose position `j` is cache row `row0 + j`, rows `0..n_kv` written.
    /// Token `t` is at position `pos0 + t` and sees `j <= pos0 + t`, and with `window > 0`
    /// only `pos0 + t - j < window`. Prefill: `pos0` = tokens already cached (chunked
    /// prefill), `n_kv = pos0 + n_q` after writing the chunk. Decode: `n_q = 1`.
    Causal {
        row0: u32,
        pos0: u32,
        n_kv: u32,
        window: u32,
    },
    /// Token `t` sees rows `first..first + n` of source A, `(first, n) = desc[off + 2t ..]`
    /// (u32 pairs); `max_keys` ≥ every `n` (sizes the split). Batched decode over sequences
    /// sharing one cache buffer: `first` = the sequence's base row, `n = pos + 1`.
    Ranges {
        desc: &'a wgpu::Buffer,
        off: u32,
        max_keys: u32,
    },
    /// Token `t` sees `idx[off + t * n_idx + i]`, `i < n_idx` (u32): a row of source A, a
    /// row of source B when [`SRC_B`] is set, masked when [`INVALID`]. No causal rule: the
    /// list is the visible set (order does not matter; a repeated row counts twice).
    Index {
        idx: &'a wgpu::Buffer,
        off: u32,
        n_idx: u32,
    },
    /// Token `t` sees its own list: `(n_idx, n_split, split_len, list) = aux[off + 4t ..]`
    /// (u32), keys `aux[list + i]`, `i < n_idx`, tagged as in [`Keys::Index`], split as
    /// [`row_split`] splits a one-token call of that length. Always split: [`Attention::split`]
    /// gives the scratch and the most splits of any token; each token's output has the bits
    /// of a one-token `Rows` call, whatever the other tokens (DeepSeek-V4's decode rows of
    /// many sequences, and its verify rows, in one call).
    Rows {
        aux: &'a wgpu::Buffer,
        off: u32,
        max_keys: u32,
    },
}

/// One attention call. Output `[n_q][n_head][head_dim]` f32; query token `t`'s q head `h`
/// uses KV head `h / (n_head / n_head_kv)`. The output buffer (and the split scratch) must
/// be a buffer no other field names: wgpu rejects a buffer bound both read-only and
/// read-write in one dispatch.
#[derive(Clone, Copy, Debug)]
pub struct Attention<'a> {
    pub n_q: u32,
    pub n_head: u32,
    pub kv: KvShape,
    /// Multiplies q·k (usually `1 / sqrt(head_dim)`); sinks are not scaled.
    pub scale: f32,
    pub q: QView<'a>,
    pub out: OutView<'a>,
    /// Source A: the cache every mode reads.
    pub a: KvSource<'a>,
    /// Source B: only for [`Keys::Index`] rows tagged [`SRC_B`]; same shape as A, and `v`
    /// must be `None` in both or in neither.
    pub b: Option<KvSource<'a>>,
    pub keys: Keys<'a>,
    /// f32 sink logits per q head at `sinks[off + h]`: softmax over `[scores…, sink]`.
    pub sinks: Option<(&'a wgpu::Buffer, u32)>,
    /// Split-K: `(scratch, n_split)` with `2 ≤ n_split ≤` [`MAX_SPLIT`] and a scratch of at least
    /// [`scratch_elems`] f32; `None` (or `n_split` 1) writes the output in one pass.
    pub split: Option<(&'a wgpu::Buffer, u32)>,
}

/// The split of one token's [`Keys::Rows`] list of `n_idx` keys: `(n_split, split_len)`, as
/// [`pick_n_split`] picks for a one-token call, split lengths a multiple of the key tile.
pub fn row_split(gpu: &Gpu, n_head: u32, kv: KvShape, n_idx: u32) -> Result<(u32, u32)> {
    kv.check()?;
    let g = (n_head / kv.n_head_kv.max(1)).max(1);
    let tiles = Tiles::choose(gpu, kv.head_dim, g)?;
    let n_split = pick_n_split(1, n_head, kv, n_idx, true);
    let split_len = n_idx.div_ceil(n_split).max(1).next_multiple_of(tiles.bk);
    Ok((n_split, split_len))
}

/// f32 elements of the split-K scratch: `[n_q * n_head][n_split][head_dim + 2]`.
pub fn scratch_elems(n_q: u32, n_head: u32, head_dim: u32, n_split: u32) -> u64 {
    n_q as u64 * n_head as u64 * n_split as u64 * (head_dim as u64 + 2)
}

/// Most splits an [`Attention`] call may use.
pub const MAX_SPLIT: u32 = 256;
/// Workgroups a split aims to reach: about one per multiprocessor of a large GPU (an H200
/// has 132). Measured on the H200 (Qwen3.5 16/2 × 256 f16 decode, contexts 1K–32K; V4
/// 64 × 512 over 640–2176 indices): more splits than this only added merge work.
const TARGET_GROUPS: u32 = 128;
/// Fewest keys per split worth a partial (its write and merge cost about 2 keys' rows).
const MIN_SPLIT_KEYS: u32 = 32;

/// A split count for a call of `n_q` queries over at most `max_keys` keys each
/// (`per_query`: [`Keys::Ranges`] / [`Keys::Index`], else [`Keys::Causal`]): 1 when the
/// queries alone make enough workgroups (prefill), else enough splits to reach about
/// 128 workgroups, each of at least 32 keys, at most [`MAX_SPLIT`].
pub fn pick_n_split(n_q: u32, n_head: u32, kv: KvShape, max_keys: u32, per_query: bool) -> u32 {
    let g = (n_head / kv.n_head_kv.max(1)).max(1);
    let rows = if per_query { g } else { n_q * g };
    let br = if rows <= 8 { 8 } else { 16 };
    let tiles = if per_query {
        n_q * g.div_ceil(br)
    } else {
        rows.div_ceil(br)
    };
    let groups = tiles.saturating_mul(kv.n_head_kv).max(1);
    TARGET_GROUPS
        .div_ceil(groups)
        .min(max_keys.div_ceil(MIN_SPLIT_KEYS))
        .clamp(1, MAX_SPLIT)
}

/// Uniforms of `attend` (same fields, same order as `Params` in the WGSL).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    mode: u32,
    n_q: u32,
    n_head: u32,
    n_head_kv: u32,
    q_off: u32,         // in elements
    q_tok_stride: u32,  // in elements
    q_head_stride: u32, // in elements
    o_off: u32,         // in elements
    o_tok_stride: u32,  // in elements
    row0: u32,
    pos0: u32,
    n_keys: u32,
    window: u32,
    aux_off: u32,  // in u32 elements
    sink_off: u32, // in elements
    flags: u32,
    n_split: u32,
    split_len: u32, // keys
    n_tiles: u32,
    tiles_per_tok: u32,
    n_groups: u32,
    scale: f32,
    pad0: u32,
    pad1: u32,
}
const _: () = assert!(std::mem::size_of::<Params>() == 96);

/// Uniforms of `combine` (same fields, same order as `CParams`).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct CParams {
    n_rows: u32,
    n_head: u32,
    n_split: u32,
    o_off: u32,        // in elements
    o_tok_stride: u32, // in elements
    sink_off: u32,     // in elements
    has_sink: u32,
    desc_off: u32, // in u32 elements
    use_desc: u32,
    pad: [u32; 3],
}
const _: () = assert!(std::mem::size_of::<CParams>() == 48);

const FLAG_SINK: u32 = 1;
const FLAG_SHARED_KV: u32 = 2;
const FLAG_SPLIT: u32 = 4;

/// Tile shape of one `attend` variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tiles {
    br: u32,  // query rows per tile
    tpr: u32, // threads per row
    bk: u32,  // keys per tile
}

impl Tiles {
    /// Workgroup memory of `attend` in bytes (kv tile, red, sc, pr, bounds).
    fn shared_bytes(&self, head_dim: u32) -> u32 {
        let (br, tpr, bk) = (self.br, self.tpr, self.bk);
        4 * (bk * head_dim + br * tpr * (bk + 1) + 2 * br * bk + 3)
    }

    /// Tile loads per thread (`LPT` in the WGSL); at most 32 (one bit each in `kbad`).
    fn loads_per_thread(&self, head_dim: u32) -> u32 {
        (self.bk * head_dim / 4).div_ceil(self.br * self.tpr)
    }

    /// Rows per tile: 8 when a tile cannot hold more than 8 useful rows (decode with a
    /// GQA group of ≤ 8 heads), else 16. Threads per row: up to 16, one vec4 column each
    /// at least. Keys per tile: the largest of 32/16/8/4 fitting the workgroup memory.
    fn choose(gpu: &Gpu, head_dim: u32, useful_rows: u32) -> Result<Tiles> {
        let br = if useful_rows <= 8 { 8 } else { 16 };
        let tpr = (head_dim / 4).clamp(1, 16);
        let limit = gpu.limits.max_compute_workgroup_storage_size;
        for bk in [32, 16, 8, 4] {
            let t = Tiles { br, tpr, bk };
            if t.shared_bytes(head_dim) <= limit && t.loads_per_thread(head_dim) <= 32 {
                return Ok(t);
            }
        }
        Err(Error::Gpu(format!(
            "attention: head_dim {head_dim} needs more workgroup memory than the adapter's {limit} bytes"
        )))
    }
}

#[derive(PartialEq, Eq, Hash)]
/// The pipeline of [`attention`]'s main dispatch.
struct Attend {
    kv: KvType,
    /// Head width.
    hd: u32,
    br: u32,
    tpr: u32,
    bk: u32,
}
impl super::PipelineKey for Attend {
    fn source(&self) -> &'static str {
        SRC
    }
    fn entry(&self) -> &'static str {
        "attend"
    }
    fn label(&self) -> String {
        let Attend {
            kv,
            hd,
            br,
            tpr,
            bk,
        } = self;
        format!(
            "attention_attend_{}_hd{hd}_br{br}_tpr{tpr}_bk{bk}",
            kv.name()
        )
    }
    fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
        spec.define("ATTEND", "true")
            .define("KV_F16", self.kv == KvType::F16)
            .define("HD", self.hd)
            .define("BR", self.br)
            .define("TPR", self.tpr)
            .define("BK", self.bk)
    }
}
#[derive(PartialEq, Eq, Hash)]
/// The pipeline of [`attention`]'s split-K combine.
struct Combine {
    /// Head width.
    hd: u32,
}
impl super::PipelineKey for Combine {
    fn source(&self) -> &'static str {
        SRC
    }
    fn entry(&self) -> &'static str {
        "combine"
    }
    fn label(&self) -> String {
        format!("attention_combine_hd{}", self.hd)
    }
    fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
        spec.define("COMBINE", "true")
            .define("HD", self.hd)
            .define("MAX_SPLIT", MAX_SPLIT)
    }
}
/// The call's head counts and its sources against its key selection.
fn check(at: &Attention<'_>) -> Result<()> {
    let kv = at.kv;
    kv.check()?;
    if at.n_head == 0 || !at.n_head.is_multiple_of(kv.n_head_kv) {
        return Err(Error::Invalid(format!(
            "attention: n_head {} is not a multiple of n_head_kv {}",
            at.n_head, kv.n_head_kv
        )));
    }
    let shared_kv = at.a.v.is_none();
    if let Some(b) = &at.b {
        if b.v.is_none() != shared_kv {
            return Err(Error::Invalid(
                "attention: sources A and B must both have V or both share K as V".into(),
            ));
        }
        if !matches!(at.keys, Keys::Index { .. } | Keys::Rows { .. }) {
            return Err(Error::Invalid(
                "attention: source B is only read by Keys::Index and Keys::Rows".into(),
            ));
        }
    }
    Ok(())
}

/// Record one attention call (one dispatch, plus the combine when split).
pub fn attention(pass: &mut Pass<'_>, at: &Attention<'_>) -> Result<()> {
    check(at)?;
    let kv = at.kv;
    let hd = kv.head_dim;
    let shared_kv = at.a.v.is_none();
    if at.n_q == 0 {
        return Ok(());
    }
    let g = at.n_head / kv.n_head_kv;
    let (mode, per_tok, max_keys) = match at.keys {
        Keys::Causal { n_kv, .. } => (0, false, n_kv),
        Keys::Ranges { max_keys, .. } => (1, true, max_keys),
        Keys::Index { n_idx, .. } => (2, true, n_idx),
        Keys::Rows { max_keys, .. } => (3, true, max_keys),
    };
    let rows = matches!(at.keys, Keys::Rows { .. });
    if rows && at.split.is_none() {
        return Err(Error::Invalid(
            "attention: Keys::Rows needs the split scratch".into(),
        ));
    }
    let useful_rows = if per_tok { g } else { at.n_q * g };
    let tiles = Tiles::choose(pass.gpu(), hd, useful_rows)?;
    let (tiles_per_tok, n_tiles) = if per_tok {
        let tpt = g.div_ceil(tiles.br);
        (tpt, at.n_q * tpt)
    } else {
        (1, (at.n_q * g).div_ceil(tiles.br))
    };
    let n_split = at.split.map_or(1, |(_, n)| n.max(1));
    if n_split > MAX_SPLIT {
        return Err(Error::Invalid(format!(
            "attention: n_split {n_split} exceeds {MAX_SPLIT}"
        )));
    }
    let split_len = max_keys.div_ceil(n_split).max(1).next_multiple_of(tiles.bk);
    let n_groups = n_tiles as u64 * kv.n_head_kv as u64 * n_split as u64;
    if n_groups > u32::MAX as u64 / 2 {
        return Err(Error::Invalid(format!(
            "attention: {n_groups} workgroups is too many"
        )));
    }

    let mut flags = 0;
    if at.sinks.is_some() {
        flags |= FLAG_SINK;
    }
    if shared_kv {
        flags |= FLAG_SHARED_KV;
    }
    if n_split > 1 || rows {
        flags |= FLAG_SPLIT;
    }
    let (row0, pos0, window) = match at.keys {
        Keys::Causal {
            row0, pos0, window, ..
        } => (row0, pos0, window),
        _ => (0, 0, 0),
    };
    // Bindings the mode does not read are bound to a read-only buffer it already has: the
    // auto layout keeps every binding (the kernel branches on the mode at run time).
    let dummy = at.a.k;
    let (aux, aux_off) = match at.keys {
        Keys::Causal { .. } => (dummy, 0),
        Keys::Ranges { desc, off, .. } => (desc, off),
        Keys::Index { idx, off, .. } => (idx, off),
        Keys::Rows { aux, off, .. } => (aux, off),
    };
    let (sinks, sink_off) = at.sinks.unwrap_or((dummy, 0));
    let b = at.b.unwrap_or(at.a);
    let dst = if n_split > 1 || rows {
        let (scratch, _) = at.split.expect("checked: split is set");
        let need = scratch_elems(at.n_q, at.n_head, hd, n_split) * 4;
        if scratch.size() < need {
            return Err(Error::Invalid(format!(
                "attention: split scratch of {} bytes, {need} needed",
                scratch.size()
            )));
        }
        scratch
    } else {
        at.out.buf
    };

    let params = Params {
        mode,
        n_q: at.n_q,
        n_head: at.n_head,
        n_head_kv: kv.n_head_kv,
        q_off: at.q.off,
        q_tok_stride: at.q.tok_stride,
        q_head_stride: at.q.head_stride,
        o_off: at.out.off,
        o_tok_stride: at.out.tok_stride,
        row0,
        pos0,
        n_keys: max_keys,
        window,
        aux_off,
        sink_off,
        flags,
        n_split,
        split_len,
        n_tiles,
        tiles_per_tok,
        n_groups: n_groups as u32,
        scale: at.scale,
        pad0: 0,
        pad1: 0,
    };
    let pl = pass.gpu().pipeline_for(Attend {
        kv: kv.dtype,
        hd,
        br: tiles.br,
        tpr: tiles.tpr,
        bk: tiles.bk,
    })?;
    let v_a = at.a.v.unwrap_or(at.a.k);
    let v_b = b.v.unwrap_or(b.k);
    pass.dispatch(
        &pl,
        "attend",
        &params,
        &[
            at.q.buf.into(),
            at.a.k.into(),
            v_a.into(),
            b.k.into(),
            v_b.into(),
            aux.into(),
            sinks.into(),
            dst.into(),
        ],
        grid(n_groups as u32),
    );
    if n_split > 1 || rows {
        let cp = CParams {
            n_rows: at.n_q * at.n_head,
            n_head: at.n_head,
            n_split,
            o_off: at.out.off,
            o_tok_stride: at.out.tok_stride,
            sink_off,
            has_sink: at.sinks.is_some() as u32,
            desc_off: aux_off,
            use_desc: rows as u32,
            pad: [0; 3],
        };
        let pl = pass.gpu().pipeline_for(Combine { hd })?;
        pass.dispatch(
            &pl,
            "combine",
            &cp,
            &[dst.into(), sinks.into(), aux.into(), at.out.buf.into()],
            grid(at.n_q * at.n_head * hd.div_ceil(64)),
        );
    }
    Ok(())
}
