//! DeepSeek-V4 KV compressors, lightning indexer and attention key lists
//! (`shaders/compress.wgsl`). CPU reference: `cpu::compress`.
//!
//! A compressor of ratio m keeps its per-token rows in a per-sequence ring `store`
//! [cap][2·width] f32 (kv | ape-biased score, `width` = coff·d, coff 2 when windows overlap):
//! [`store`] appends a chunk's rows, [`pool`] turns each window completed by the chunk into an
//! entry (softmax pooling per channel, RMSNorm, RoPE at the window's first position). The
//! ring must span every row a pooled window reads: `cap ≥ coff·m + tokens per chunk`
//! ([`CmpShape::store_rows`]).
//!
//! Attention reads window ∪ compressed keys through an index list ([`attention::Keys::Index`]):
//! [`index_list`] writes the window slots (ring rows, newest first) and, on layers without
//! an indexer, every visible compressed entry; on ratio-4 layers [`index_scores`] and
//! [`select_topk`] fill the compressed slots with the indexer's top-k.
//!
//! [`attention::Keys::Index`]: super::attention::Keys::Index

use super::attention::{INVALID, SRC_B};
use super::rope::RopeTable;
use super::{check_f32, check_len, grid, Binding, GpuTensor, Pass, PipelineSpec};
use crate::{Error, Result};

const SRC: &str = include_str!("../../shaders/compress.wgsl");

// The index-list tags are the attention kernel's (compress.wgsl repeats them).
const _: () = assert!(INVALID == 0xffff_ffff && SRC_B == 0x8000_0000);

/// Uniforms of `store_rows` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct StoreParams {
    n_tok: u32,
    pos0: u32,
    ratio: u32,
    cap: u32,
    width: u32,
    /// In elements.
    src_off: u32,
    src_stride: u32,
    _pad: u32,
}
const _: () = assert!(std::mem::size_of::<StoreParams>() == 32);

/// Uniforms of `pool`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct PoolParams {
    w0: u32,
    n_win: u32,
    ratio: u32,
    cap: u32,
    d: u32,
    width: u32,
    overlap: u32,
    n_freq: u32,
    /// In elements.
    out_off: u32,
    eps: f32,
    _pad: [u32; 2],
}
const _: () = assert!(std::mem::size_of::<PoolParams>() == 48);

/// Uniforms of `score`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct ScoreParams {
    n_tok: u32,
    pos0: u32,
    ratio: u32,
    n_ent: u32,
    n_head: u32,
    d: u32,
    scale: f32,
    /// q / w row of token 0.
    row0: u32,
}
const _: () = assert!(std::mem::size_of::<ScoreParams>() == 32);

/// Uniforms of `select_topk`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct SelectParams {
    n_tok: u32,
    pos0: u32,
    ratio: u32,
    n_ent: u32,
    k: u32,
    idx_stride: u32,
    idx_off: u32,
    n_slots: u32,
}
const _: () = assert!(std::mem::size_of::<SelectParams>() == 32);

/// Uniforms of `index_list`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct IndexParams {
    n_tok: u32,
    pos0: u32,
    n_idx: u32,
    n_win: u32,
    window: u32,
    ring: u32,
    ratio: u32,
    fill_comp: u32,
}
const _: () = assert!(std::mem::size_of::<IndexParams>() == 32);

/// One compressor: ratio m, entries of `d` channels, overlapping windows (ratio-4 style,
/// 2·d-wide projections) or not, and a store ring of `cap` rows.
#[derive(Clone, Copy, Debug)]
pub struct CmpShape {
    pub ratio: u32,
    pub d: u32,
    pub overlap: bool,
    pub cap: u32,
}

impl CmpShape {
    /// Elements of the kv (and of the score) projection per token: coff·d.
    pub fn width(&self) -> u32 {
        if self.overlap {
            2 * self.d
        } else {
            self.d
        }
    }
    /// Rows a store needs so that chunks of `chunk` tokens never overwrite a row a window
    /// completed in the chunk still reads.
    pub fn store_rows(ratio: u32, overlap: bool, chunk: u32) -> u32 {
        ratio * if overlap { 2 } else { 1 } + chunk
    }
    /// Bytes of the store ring.
    pub fn store_bytes(&self) -> u64 {
        self.cap as u64 * 2 * self.width() as u64 * 4
    }
    fn check(&self) -> Result<()> {
        if self.ratio == 0 || self.d == 0 || self.cap < self.ratio * (1 + self.overlap as u32) {
            return Err(Error::Invalid(format!("compressor: {self:?}")));
        }
        Ok(())
    }
}

/// Append `n_tok` tokens at positions `pos0..` to the store: `src` rows of kv | score
/// (`width` each) at `src_off + t·src_stride`; the score half gets `ape` (F32 [m, width])
/// row `pos % m` added.
#[allow(clippy::too_many_arguments)]
pub fn store(
    pass: &mut Pass<'_>,
    s: &CmpShape,
    n_tok: u32,
    pos0: u32,
    src: &wgpu::Buffer,
    src_off: u32,
    src_stride: u32,
    ape: &GpuTensor,
    store: &wgpu::Buffer,
) -> Result<()> {
    s.check()?;
    let w = s.width();
    check_f32("compress_store", ape, s.ratio as u64 * w as u64)?;
    if n_tok == 0 {
        return Ok(());
    }
    if n_tok > s.cap || src_stride < 2 * w {
        return Err(Error::Invalid(format!(
            "compress_store: {n_tok} tokens into a ring of {}, src stride {src_stride}",
            s.cap
        )));
    }
    check_len(
        "compress_store",
        "src",
        src,
        src_off as u64 + (n_tok as u64 - 1) * src_stride as u64 + 2 * w as u64,
    )?;
    check_len(
        "compress_store",
        "store",
        store,
        s.cap as u64 * 2 * w as u64,
    )?;
    let threads = n_tok as u64 * 2 * w as u64;
    if threads > (u32::MAX - 256) as u64 {
        return Err(Error::Invalid("compress_store: too many elements".into()));
    }
    let pl = pass
        .gpu()
        .pipeline(&PipelineSpec::new("compress_store", SRC, "store_rows").define("STORE", true))?;
    let prm = StoreParams {
        n_tok,
        pos0,
        ratio: s.ratio,
        cap: s.cap,
        width: w,
        src_off,
        src_stride,
        _pad: 0,
    };
    pass.dispatch(
        &pl,
        "compress_store",
        &prm,
        &[
            Binding::from(src),
            (&ape.parts[0].buffer).into(),
            store.into(),
        ],
        grid((threads as u32).div_ceil(256)),
    );
    Ok(())
}

/// Pool windows `w0 .. w0 + n_win` (all complete in the store) into entries: f32 rows of `d`
/// at `out[out_off + k·d]`, RMSNorm with `norm` (F32 [d], epsilon `eps`) and RoPE from
/// `table` on the last `2·table.n_freq` channels at position `w·m`.
#[allow(clippy::too_many_arguments)]
pub fn pool(
    pass: &mut Pass<'_>,
    s: &CmpShape,
    w0: u32,
    n_win: u32,
    norm: &GpuTensor,
    table: &RopeTable,
    eps: f32,
    store: &wgpu::Buffer,
    out: &wgpu::Buffer,
    out_off: u32,
) -> Result<()> {
    s.check()?;
    check_f32("compress_pool", norm, s.d as u64)?;
    if 2 * table.n_freq > s.d {
        return Err(Error::Invalid(format!(
            "compress_pool: {} rotated dims exceed entries of {}",
            2 * table.n_freq,
            s.d
        )));
    }
    if n_win == 0 {
        return Ok(());
    }
    check_len(
        "compress_pool",
        "store",
        store,
        s.cap as u64 * 2 * s.width() as u64,
    )?;
    check_len(
        "compress_pool",
        "out",
        out,
        out_off as u64 + n_win as u64 * s.d as u64,
    )?;
    let pl = pass.gpu().pipeline(
        &PipelineSpec::new(format!("compress_pool_d{}", s.d), SRC, "pool")
            .define("POOL", true)
            .define("D", format!("{}u", s.d)),
    )?;
    let prm = PoolParams {
        w0,
        n_win,
        ratio: s.ratio,
        cap: s.cap,
        d: s.d,
        width: s.width(),
        overlap: s.overlap as u32,
        n_freq: table.n_freq,
        out_off,
        eps,
        _pad: [0; 2],
    };
    pass.dispatch(
        &pl,
        "compress_pool",
        &prm,
        &[
            Binding::from(store),
            (&norm.parts[0].buffer).into(),
            (&table.buffer).into(),
            out.into(),
        ],
        grid(n_win),
    );
    Ok(())
}

/// Sizes of one indexer scoring call.
#[derive(Clone, Copy, Debug)]
pub struct IndexerShape {
    pub n_head: u32,
    /// Indexer head size.
    pub d: u32,
    pub ratio: u32,
    pub top_k: u32,
}

/// Indexer scores of `n_tok` tokens at `pos0..` against the first `n_ent` entries of `keys`
/// (f32 rows of d): `scores[t·n_ent + i] = scale·Σ_h relu(q[r,h]·keys[i])·w[r,h]` with
/// `r = row0 + t`, for the entries the token sees (`i < (pos+1)/m`), −1e30 for the rest.
/// `q` [rows, n_head, d] and `w` [rows, n_head] packed (`row0`: one sequence's rows inside a
/// batch); `scale` = d^-½·n_head^-½ (model.py's weights scaling).
#[allow(clippy::too_many_arguments)]
pub fn index_scores(
    pass: &mut Pass<'_>,
    s: &IndexerShape,
    n_tok: u32,
    pos0: u32,
    n_ent: u32,
    q: &wgpu::Buffer,
    w: &wgpu::Buffer,
    row0: u32,
    keys: &wgpu::Buffer,
    scores: &wgpu::Buffer,
) -> Result<()> {
    if s.ratio == 0 || s.d == 0 || s.n_head == 0 {
        return Err(Error::Invalid(format!("index_scores: {s:?}")));
    }
    if n_tok == 0 || n_ent == 0 {
        return Ok(());
    }
    let n = n_tok as u64;
    let rows = n + row0 as u64;
    check_len("index_scores", "q", q, rows * (s.n_head * s.d) as u64)?;
    check_len("index_scores", "w", w, rows * s.n_head as u64)?;
    check_len("index_scores", "keys", keys, n_ent as u64 * s.d as u64)?;
    check_len("index_scores", "scores", scores, n * n_ent as u64)?;
    let tiles = n_ent.div_ceil(64) as u64 * n;
    if tiles > u32::MAX as u64 / 2 {
        return Err(Error::Invalid("index_scores: too many workgroups".into()));
    }
    // Heads per workgroup-memory load: HG·d floats ≤ 8 KiB.
    let hg = (2048 / s.d).clamp(1, 16);
    let pl = pass.gpu().pipeline(
        &PipelineSpec::new(format!("compress_score_d{}_hg{hg}", s.d), SRC, "score")
            .define("SCORE", true)
            .define("D", format!("{}u", s.d))
            .define("HG", format!("{hg}u")),
    )?;
    let prm = ScoreParams {
        n_tok,
        pos0,
        ratio: s.ratio,
        n_ent,
        n_head: s.n_head,
        d: s.d,
        scale: 1.0 / ((s.d as f64) * (s.n_head as f64)).sqrt() as f32,
        row0,
    };
    pass.dispatch(
        &pl,
        "index_scores",
        &prm,
        &[Binding::from(q), w.into(), keys.into(), scores.into()],
        grid(tiles as u32),
    );
    Ok(())
}

/// Per token, the top `k` of its visible scores (rows of `n_ent` from [`index_scores`]) into
/// `idx[t·idx_stride + idx_off ..][..n_slots]` as `SRC_B | entry` in entry order, ties to
/// the lower entry; slots beyond `min(k, visible)` get `INVALID`. `n_slots ≥ min(k, entries
/// the last token sees)`.
#[allow(clippy::too_many_arguments)]
pub fn select_topk(
    pass: &mut Pass<'_>,
    s: &IndexerShape,
    n_tok: u32,
    pos0: u32,
    n_ent: u32,
    scores: &wgpu::Buffer,
    idx: &wgpu::Buffer,
    idx_stride: u32,
    idx_off: u32,
    n_slots: u32,
) -> Result<()> {
    if n_tok == 0 || n_slots == 0 {
        return Ok(());
    }
    if s.ratio == 0 || idx_off + n_slots > idx_stride || n_slots > s.top_k {
        return Err(Error::Invalid(format!(
            "select_topk: slots {idx_off}+{n_slots} of {idx_stride}, {s:?}"
        )));
    }
    let n = n_tok as u64;
    check_len("select_topk", "scores", scores, n * n_ent.max(1) as u64)?;
    check_len("select_topk", "idx", idx, n * idx_stride as u64)?;
    let pl = pass.gpu().pipeline(
        &PipelineSpec::new("compress_select", SRC, "select_topk").define("SELECT", true),
    )?;
    let prm = SelectParams {
        n_tok,
        pos0,
        ratio: s.ratio,
        n_ent,
        k: s.top_k,
        idx_stride,
        idx_off,
        n_slots,
    };
    pass.dispatch(
        &pl,
        "select_topk",
        &prm,
        &[Binding::from(scores), idx.into()],
        grid(n_tok),
    );
    Ok(())
}

/// The attention key list of a chunk: per token `n_idx` u32 slots, the first `n_win` the
/// window (newest first: ring row `(pos − i) % ring` for `i ≤ pos`, `i < window`), then
/// (with `fill_comp`) the compressed entries `i < (pos+1)/ratio` as `SRC_B | i`.
#[derive(Clone, Copy, Debug)]
pub struct IndexList {
    pub n_idx: u32,
    pub n_win: u32,
    pub window: u32,
    pub ring: u32,
    pub ratio: u32,
    pub fill_comp: bool,
}

/// Write the slots [`IndexList`] describes for `n_tok` tokens at `pos0..` into `idx`
/// (rows of `n_idx`); compressed slots are left alone unless `fill_comp`.
pub fn index_list(
    pass: &mut Pass<'_>,
    l: &IndexList,
    n_tok: u32,
    pos0: u32,
    idx: &wgpu::Buffer,
) -> Result<()> {
    if l.n_win > l.window || l.ring < l.window || l.n_win > l.n_idx {
        return Err(Error::Invalid(format!("index_list: {l:?}")));
    }
    let threads = n_tok as u64 * l.n_idx as u64;
    if threads == 0 {
        return Ok(());
    }
    if threads > (u32::MAX - 256) as u64 {
        return Err(Error::Invalid("index_list: too many slots".into()));
    }
    check_len("index_list", "idx", idx, threads)?;
    let pl = pass
        .gpu()
        .pipeline(&PipelineSpec::new("compress_index", SRC, "index_list").define("INDEX", true))?;
    let prm = IndexParams {
        n_tok,
        pos0,
        n_idx: l.n_idx,
        n_win: l.n_win,
        window: l.window,
        ring: l.ring,
        ratio: l.ratio,
        fill_comp: l.fill_comp as u32,
    };
    pass.dispatch(
        &pl,
        "index_list",
        &prm,
        &[Binding::from(idx)],
        grid((threads as u32).div_ceil(256)),
    );
    Ok(())
}
