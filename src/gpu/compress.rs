//! DeepSeek-V4 KV compressors, lightning indexer and attention key lists
//! (`shaders/compress.wgsl`). CPU reference: `cpu::compress`.
//!
//! A compressor of ratio m keeps its per-token rows in a store ring [cap][2·width] f32 per
//! sequence slot (kv | ape-biased score, `width` = coff·d, coff 2 when windows overlap); the
//! slots of all sequences are one pool buffer, so one dispatch serves every row of a pass:
//! [`store`] appends rows, [`pool`] turns each window the pass completes into an entry
//! (softmax pooling per channel, RMSNorm, RoPE at the window's first position). The ring
//! must span every row a pooled window reads: `cap ≥ coff·m + tokens per chunk`
//! ([`CmpShape::store_rows`]).
//!
//! Which sequence and position each row of a pass has is a [`Rows`] table; window rings and
//! compressed caches are pools too (slot s: ring rows `s·ring ..`, entries `s·cap_e ..`).
//! Attention reads window ∪ compressed keys through an index list per token
//! ([`attention::Keys::Index`], [`attention::Keys::Rows`]), laid out as a one-token decode
//! step's: [`index_list`] writes the window slots (ring rows, newest first) and, on layers
//! without an indexer, every visible compressed entry; on ratio-4 layers [`index_scores`]
//! and [`select_topk`] fill the compressed slots with the indexer's top-k.
//!
//! [`attention::Keys::Index`]: super::attention::Keys::Index
//! [`attention::Keys::Rows`]: super::attention::Keys::Rows

use super::attention::{INVALID, SRC_B};
use super::operand::Operand;
use super::rope::RopeTable;
use super::{check_f32, check_len, grid, Binding, GpuTensor, Pass, PipelineSpec};
use crate::{Error, Result};

const SRC: &str = include_str!("../../shaders/compress.wgsl");

// The index-list tags are the attention kernel's (compress.wgsl repeats them).
const _: () = assert!(INVALID == 0xffff_ffff && SRC_B == 0x8000_0000);

/// The family's pipeline keys ([`Gpu::pipeline_for`](super::Gpu::pipeline_for)), one variant
/// per kernel.
#[derive(PartialEq, Eq, Hash)]
enum Kernel {
    Store,
    /// Pooled rows of width `d`.
    Pool {
        d: u32,
    },
    /// Index scores over keys of width `d`, `hg` heads per workgroup-memory load.
    Score {
        d: u32,
        hg: u32,
    },
    Select,
    Index,
}

impl super::PipelineKey for Kernel {
    fn source(&self) -> &'static str {
        SRC
    }
    fn entry(&self) -> &'static str {
        match self {
            Kernel::Store => "store_rows",
            Kernel::Pool { .. } => "pool",
            Kernel::Score { .. } => "score",
            Kernel::Select => "select_topk",
            Kernel::Index => "index_list",
        }
    }
    fn label(&self) -> String {
        match self {
            Kernel::Store => "compress_store".into(),
            Kernel::Pool { d } => format!("compress_pool_d{d}"),
            Kernel::Score { d, hg } => format!("compress_score_d{d}_hg{hg}"),
            Kernel::Select => "compress_select".into(),
            Kernel::Index => "compress_index".into(),
        }
    }
    fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
        match *self {
            Kernel::Store => spec.define("STORE", true),
            Kernel::Pool { d } => spec.define("POOL", true).define("D", format!("{d}u")),
            Kernel::Score { d, hg } => spec
                .define("SCORE", true)
                .define("D", format!("{d}u"))
                .define("HG", format!("{hg}u")),
            Kernel::Select => spec.define("SELECT", true),
            Kernel::Index => spec.define("INDEX", true),
        }
    }
}

/// Uniforms of `store_rows` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct StoreParams {
    n_tok: u32,
    row0: u32,
    ratio: u32,
    cap: u32,
    width: u32,
    /// In elements.
    src_off: u32,
    src_stride: u32,
    tab_rows: u32,
}
const _: () = assert!(std::mem::size_of::<StoreParams>() == 32);

/// Uniforms of `pool`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct PoolParams {
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
    /// In u32 elements.
    win_off: u32,
    direct: u32,
    _pad: u32,
}
const _: () = assert!(std::mem::size_of::<PoolParams>() == 48);

/// Uniforms of `score`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct ScoreParams {
    n_tok: u32,
    /// Table row of token 0.
    row0: u32,
    ratio: u32,
    n_ent: u32,
    n_head: u32,
    d: u32,
    scale: f32,
    tab_rows: u32,
    cap_e: u32,
    /// q / w row of token 0.
    q_row0: u32,
    _pad: [u32; 2],
}
const _: () = assert!(std::mem::size_of::<ScoreParams>() == 48);

/// Uniforms of `select_topk`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct SelectParams {
    n_tok: u32,
    row0: u32,
    ratio: u32,
    n_ent: u32,
    k: u32,
    idx_stride: u32,
    /// In u32 elements.
    idx_off: u32,
    window: u32,
    tab_rows: u32,
    cap_e: u32,
    _pad: [u32; 2],
}
const _: () = assert!(std::mem::size_of::<SelectParams>() == 48);

/// Uniforms of `index_list`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct IndexParams {
    n_tok: u32,
    row0: u32,
    n_idx: u32,
    /// In u32 elements.
    idx_off: u32,
    window: u32,
    ring: u32,
    ratio: u32,
    fill_comp: u32,
    top_k: u32,
    tab_rows: u32,
    cap_e: u32,
    _pad: u32,
}
const _: () = assert!(std::mem::size_of::<IndexParams>() == 48);

/// The rows of a call in a pass's row table: `tab` (u32) gives row `r` the position `tab[r]`
/// and the sequence slot `tab[tab_rows + r]`; the call's `n_tok` tokens are rows `row0 + t`
/// (a table of `tab_rows` rows may start at an offset: `row0` counts from the buffer's
/// start).
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    pub tab: &'a wgpu::Buffer,
    pub tab_rows: u32,
    pub row0: u32,
    pub n_tok: u32,
}

impl Rows<'_> {
    /// The table's words for rows at `pos` in `slots`.
    pub fn words(pos: &[u32], slots: &[u32]) -> Vec<u32> {
        debug_assert_eq!(pos.len(), slots.len());
        pos.iter().chain(slots).copied().collect()
    }
    fn check(&self, what: &str) -> Result<()> {
        let end = self.row0 as u64 + self.tab_rows as u64 + self.n_tok as u64;
        check_len(what, "row table", self.tab, end)
    }
}

/// Windows a pass completes, for [`pool`]: u32 `[3·n_win]` from `off` in `buf`: the windows,
/// their sequence slots, their cache rows (`slot·cap_e + window`).
#[derive(Clone, Copy, Debug)]
pub struct Windows<'a> {
    pub buf: &'a wgpu::Buffer,
    pub off: u32,
    pub n_win: u32,
}

impl Windows<'_> {
    /// The table's words for `(window, slot)` pairs of a pool with `cap_e` entries per slot.
    pub fn words(wins: &[(u32, u32)], cap_e: u32) -> Vec<u32> {
        let w = wins.iter().map(|p| p.0);
        let s = wins.iter().map(|p| p.1);
        let r = wins.iter().map(|p| p.1 * cap_e + p.0);
        w.chain(s).chain(r).collect()
    }
}

/// Where [`pool`] writes window `k`'s entry (f32 rows of d).
#[derive(Clone, Copy, Debug)]
pub enum PoolOut<'a> {
    /// At `off + k·d` (elements): staging before a conversion.
    Packed { buf: &'a wgpu::Buffer, off: u32 },
    /// At its cache row of the [`Windows`] table.
    CacheRows { buf: &'a wgpu::Buffer },
}

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
    /// A store pool: whole slots, at least one.
    fn check_store(&self, what: &str, store: &wgpu::Buffer) -> Result<()> {
        let slot = self.store_bytes();
        if store.size() < slot || !store.size().is_multiple_of(slot) {
            return Err(Error::Invalid(format!(
                "{what}: a store pool of {} bytes is not whole slots of {slot}",
                store.size()
            )));
        }
        Ok(())
    }
}

/// Append the `rows` (each at its position, into its slot's ring of the `store` pool) to the
/// store: `src` rows of kv | score (`width` each) at its stride (packed: 2·width); the score
/// half gets `ape` (F32 [m, width]) row `pos % m` added.
pub fn store(
    pass: &mut Pass<'_>,
    s: &CmpShape,
    rows: Rows<'_>,
    src: Operand<'_>,
    ape: &GpuTensor,
    store: &wgpu::Buffer,
) -> Result<()> {
    let n_tok = rows.n_tok;
    let (src_off, src_stride) = (src.off, src.stride_for(2 * s.width()));
    let src = src.buf;
    s.check()?;
    let w = s.width();
    check_f32("compress_store", ape, s.ratio as u64 * w as u64)?;
    if n_tok == 0 {
        return Ok(());
    }
    // (Each slot's rows of one call must fit its ring, `cap`: the caller's invariant, as
    // the rows of a slot are only known to the table.)
    if src_stride < 2 * w {
        return Err(Error::Invalid(format!(
            "compress_store: src stride {src_stride} below a row of {}",
            2 * w
        )));
    }
    check_len(
        "compress_store",
        "src",
        src,
        src_off as u64 + (n_tok as u64 - 1) * src_stride as u64 + 2 * w as u64,
    )?;
    rows.check("compress_store")?;
    s.check_store("compress_store", store)?;
    let threads = n_tok as u64 * 2 * w as u64;
    if threads > (u32::MAX - 256) as u64 {
        return Err(Error::Invalid("compress_store: too many elements".into()));
    }
    let pl = pass.gpu().pipeline_for(Kernel::Store)?;
    let prm = StoreParams {
        n_tok,
        row0: rows.row0,
        ratio: s.ratio,
        cap: s.cap,
        width: w,
        src_off,
        src_stride,
        tab_rows: rows.tab_rows,
    };
    pass.dispatch(
        &pl,
        "compress_store",
        &prm,
        &[
            Binding::from(src),
            (&ape.parts[0].buffer).into(),
            rows.tab.into(),
            store.into(),
        ],
        grid((threads as u32).div_ceil(256)),
    );
    Ok(())
}

/// The RMSNorm of a compressor's entries: weight `w` (F32 [d]) and epsilon.
#[derive(Clone, Copy)]
pub struct EntryNorm<'a> {
    pub w: &'a GpuTensor,
    pub eps: f32,
}

/// Pool the windows of `wins` (each complete in its slot's store ring) into entries: f32
/// rows of `d` where `out` says, RMSNorm with `norm` and RoPE from `table` on the last
/// `2·table.n_freq` channels at position `w·m`.
pub fn pool(
    pass: &mut Pass<'_>,
    s: &CmpShape,
    wins: Windows<'_>,
    norm: EntryNorm<'_>,
    table: &RopeTable,
    store: &wgpu::Buffer,
    out: PoolOut<'_>,
) -> Result<()> {
    let n_win = wins.n_win;
    let EntryNorm { w: norm, eps } = norm;
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
    s.check_store("compress_pool", store)?;
    check_len(
        "compress_pool",
        "windows",
        wins.buf,
        wins.off as u64 + 3 * n_win as u64,
    )?;
    let (out, out_off, direct) = match out {
        PoolOut::Packed { buf, off } => {
            check_len(
                "compress_pool",
                "out",
                buf,
                off as u64 + n_win as u64 * s.d as u64,
            )?;
            (buf, off, 0)
        }
        PoolOut::CacheRows { buf } => {
            check_len("compress_pool", "out", buf, s.d as u64)?;
            (buf, 0, 1)
        }
    };
    let pl = pass.gpu().pipeline_for(Kernel::Pool { d: s.d })?;
    let prm = PoolParams {
        n_win,
        ratio: s.ratio,
        cap: s.cap,
        d: s.d,
        width: s.width(),
        overlap: s.overlap as u32,
        n_freq: table.n_freq,
        out_off,
        eps,
        win_off: wins.off,
        direct,
        _pad: 0,
    };
    pass.dispatch(
        &pl,
        "compress_pool",
        &prm,
        &[
            Binding::from(store),
            (&norm.parts[0].buffer).into(),
            (&table.buffer).into(),
            wins.buf.into(),
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

/// The indexer's queries of a call: `q` [rows, n_head, d] and head weights `w` [rows, n_head],
/// packed f32; the call's token `t` reads row `row0 + t`.
#[derive(Clone, Copy, Debug)]
pub struct Queries<'a> {
    pub q: &'a wgpu::Buffer,
    pub w: &'a wgpu::Buffer,
    pub row0: u32,
}

/// The compressed entries a call's tokens look at: the first `n_ent` of their sequence slot
/// in a pool of `cap_e` entries per slot.
#[derive(Clone, Copy, Debug)]
pub struct SlotEntries {
    pub n_ent: u32,
    pub cap_e: u32,
}

/// Indexer scores of the `rows` (each at its position, in its slot) against the first
/// `n_ent` entries of their slot in `keys` (a pool of f32 rows of d, `cap_e` per slot):
/// `scores[t·n_ent + i] = scale·Σ_h relu(q[r,h]·keys[slot·cap_e + i])·w[r,h]` with
/// `r = queries.row0 + t`, for the entries the token sees (`i < (pos+1)/m`), −1e30 for the
/// rest; `scale` = d^-½·n_head^-½ (model.py's weights scaling).
pub fn index_scores(
    pass: &mut Pass<'_>,
    s: &IndexerShape,
    rows: Rows<'_>,
    queries: Queries<'_>,
    keys: &wgpu::Buffer,
    ents: SlotEntries,
    scores: &wgpu::Buffer,
) -> Result<()> {
    let n_tok = rows.n_tok;
    let Queries { q, w, row0: q_row0 } = queries;
    let SlotEntries { n_ent, cap_e } = ents;
    if s.ratio == 0 || s.d == 0 || s.n_head == 0 {
        return Err(Error::Invalid(format!("index_scores: {s:?}")));
    }
    if n_tok == 0 || n_ent == 0 {
        return Ok(());
    }
    if n_ent > cap_e {
        return Err(Error::Invalid(format!(
            "index_scores: {n_ent} entries in slots of {cap_e}"
        )));
    }
    rows.check("index_scores")?;
    let n = n_tok as u64;
    let end = n + q_row0 as u64;
    check_len("index_scores", "q", q, end * (s.n_head * s.d) as u64)?;
    check_len("index_scores", "w", w, end * s.n_head as u64)?;
    check_len("index_scores", "keys", keys, cap_e as u64 * s.d as u64)?;
    check_len("index_scores", "scores", scores, n * n_ent as u64)?;
    let tiles = n_ent.div_ceil(64) as u64 * n;
    if tiles > u32::MAX as u64 / 2 {
        return Err(Error::Invalid("index_scores: too many workgroups".into()));
    }
    // Heads per workgroup-memory load: HG·d floats ≤ 8 KiB.
    let hg = (2048 / s.d).clamp(1, 16);
    let pl = pass.gpu().pipeline_for(Kernel::Score { d: s.d, hg })?;
    let prm = ScoreParams {
        n_tok,
        row0: rows.row0,
        ratio: s.ratio,
        n_ent,
        n_head: s.n_head,
        d: s.d,
        scale: 1.0 / ((s.d as f64) * (s.n_head as f64)).sqrt() as f32,
        tab_rows: rows.tab_rows,
        cap_e,
        q_row0,
        _pad: [0; 2],
    };
    pass.dispatch(
        &pl,
        "index_scores",
        &prm,
        &[
            Binding::from(q),
            w.into(),
            keys.into(),
            rows.tab.into(),
            scores.into(),
        ],
        grid(tiles as u32),
    );
    Ok(())
}

/// Per token, the top `k` of its visible scores (rows of `n_ent` from [`index_scores`]) into
/// its index list (`idx[list.off + t·list.n_idx ..]`) after its `min(window, pos+1)` window
/// slots, as `SRC_B | (slot·cap_e + entry)` in entry order, ties to the lower entry:
/// `min(k, visible)` slots, the rest of the list is [`index_list`]'s. `list.n_idx` must
/// hold every token's window and picks.
pub fn select_topk(
    pass: &mut Pass<'_>,
    s: &IndexerShape,
    rows: Rows<'_>,
    ents: SlotEntries,
    window: u32,
    scores: &wgpu::Buffer,
    list: ListView<'_>,
) -> Result<()> {
    let n_tok = rows.n_tok;
    let SlotEntries { n_ent, cap_e } = ents;
    if n_tok == 0 || s.top_k == 0 {
        return Ok(());
    }
    if s.ratio == 0 || s.top_k.min(n_ent) > list.n_idx {
        return Err(Error::Invalid(format!(
            "select_topk: {} picks in lists of {}, {s:?}",
            s.top_k.min(n_ent),
            list.n_idx
        )));
    }
    rows.check("select_topk")?;
    let n = n_tok as u64;
    check_len("select_topk", "scores", scores, n * n_ent.max(1) as u64)?;
    let idx = list.buf;
    check_len(
        "select_topk",
        "idx",
        idx,
        list.off as u64 + n * list.n_idx as u64,
    )?;
    let pl = pass.gpu().pipeline_for(Kernel::Select)?;
    let prm = SelectParams {
        n_tok,
        row0: rows.row0,
        ratio: s.ratio,
        n_ent,
        k: s.top_k,
        idx_stride: list.n_idx,
        idx_off: list.off,
        window,
        tab_rows: rows.tab_rows,
        cap_e,
        _pad: [0; 2],
    };
    pass.dispatch(
        &pl,
        "select_topk",
        &prm,
        &[Binding::from(scores), rows.tab.into(), idx.into()],
        grid(n_tok),
    );
    Ok(())
}

/// Index lists: token `t`'s `n_idx` u32 slots at `buf[off + t·n_idx ..]`.
#[derive(Clone, Copy, Debug)]
pub struct ListView<'a> {
    pub buf: &'a wgpu::Buffer,
    pub off: u32,
    pub n_idx: u32,
}

/// The attention key list of a token at `pos` in sequence slot `s` (the list of a one-token
/// decode step there): `n_win = min(window, pos+1)` window slots, newest first (ring row
/// `s·ring + (pos − i) % ring`), then its compressed slots: with `fill_comp` the entries
/// `c < (pos+1)/ratio` as `SRC_B | (s·cap_e + c)`, else `min(top_k, (pos+1)/ratio)` slots
/// [`select_topk`] fills; `INVALID` after them.
#[derive(Clone, Copy, Debug)]
pub struct IndexList {
    pub window: u32,
    pub ring: u32,
    pub ratio: u32,
    pub fill_comp: bool,
    pub top_k: u32,
    /// Compressed entries per slot.
    pub cap_e: u32,
}

/// Write the slots [`IndexList`] describes for the `rows` into `list` (the indexer's picks
/// are left alone unless `fill_comp`).
pub fn index_list(
    pass: &mut Pass<'_>,
    l: &IndexList,
    rows: Rows<'_>,
    list: ListView<'_>,
) -> Result<()> {
    let n_tok = rows.n_tok;
    if l.ring < l.window || l.window == 0 {
        return Err(Error::Invalid(format!("index_list: {l:?}")));
    }
    let threads = n_tok as u64 * list.n_idx as u64;
    if threads == 0 {
        return Ok(());
    }
    if threads > (u32::MAX - 256) as u64 {
        return Err(Error::Invalid("index_list: too many slots".into()));
    }
    rows.check("index_list")?;
    let idx = list.buf;
    check_len("index_list", "idx", idx, list.off as u64 + threads)?;
    let pl = pass.gpu().pipeline_for(Kernel::Index)?;
    let prm = IndexParams {
        n_tok,
        row0: rows.row0,
        n_idx: list.n_idx,
        idx_off: list.off,
        window: l.window,
        ring: l.ring,
        ratio: l.ratio,
        fill_comp: l.fill_comp as u32,
        top_k: l.top_k,
        tab_rows: rows.tab_rows,
        cap_e: l.cap_e,
        _pad: 0,
    };
    pass.dispatch(
        &pl,
        "index_list",
        &prm,
        &[Binding::from(rows.tab), idx.into()],
        grid((threads as u32).div_ceil(256)),
    );
    Ok(())
}
