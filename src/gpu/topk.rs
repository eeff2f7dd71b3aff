//! Top-k per row, argmax, the log-sum-exp of rows, the fused MoE router
//! (`shaders/topk.wgsl`), and [`LogitsTop`]: the sampler's top-k of a forward's logits rows
//! found in the forward's own pass, so a decode step reads back a few hundred bytes instead
//! of the vocabulary. CPU references: `cpu::ops::{topk, argmax, router_softmax_topk}`,
//! `sample::log_sum_exp`.
//!
//! Results are best first, ties to the lower index, NaNs never selected; a row with fewer
//! than k selectable elements pads with index `u32::MAX`, value −inf. Rows longer than
//! [`CHUNK`] run in stages through a [`TopkScratch`] (vocab rows: 248,320 logits → 61
//! chunks of k candidates → one final workgroup per row). A chunk's top k takes three
//! workgroup barriers whatever k (a threshold from the threads' best elements, then ranks by
//! counting among the few elements that pass it: `topk.wgsl`), so k = 64 costs about what
//! k = 1 does.

use super::operand::Operand;
use super::router::RouterRows;
use super::{grid, Binding, Gpu, Pass, PipelineSpec};
use crate::{Error, Result};

const SRC: &str = include_str!("../../shaders/topk.wgsl");

/// Elements one workgroup ranks (`topk.wgsl` `main`: 256 threads × 16 elements).
pub const CHUNK: u32 = 4096;
/// Most experts of [`router_softmax_topk`] (`topk.wgsl` `router`: 256 threads × 8).
pub const ROUTER_MAX_EXPERTS: u32 = 2048;
/// Largest k of [`topk`] (its [`TopkScratch`] is sized for it).
pub const MAX_K: u32 = 16;
/// Largest k of `gpu::topk::LogitsTop`: covers llama.cpp's default sampler top-k of 40 and the
/// OpenAI API's 20 `top_logprobs`.
pub const MAX_TOP_K: u32 = 64;

/// The best logits of one row as the GPU found them ([`crate::gpu::topk::LogitsTop`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TopLogits {
    /// (id, logit), best first: larger logit, then lower id; NaNs never. Shorter than asked
    /// when the row has fewer selectable logits.
    pub cands: Vec<(u32, f32)>,
    /// ln Σ exp(logit) over the whole row (NaNs skipped), when asked for.
    pub lse: Option<f32>,
}

/// Uniforms of `topk.wgsl` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    n_rows: u32,
    n_chunks: u32,
    /// Values: elements; candidate pairs: u32 words.
    in_off: u32,
    in_stride: u32,
    out_off: u32,
    out_stride: u32,
    val_off: u32,
    val_stride: u32,
    renorm: u32,
    _pad: [u32; 2],
}
const _: () = assert!(std::mem::size_of::<Params>() == 48);

/// Candidates per row after each stage: `n` → `ceil(n / CHUNK)·k` until one chunk is left.
fn stages(n: u32, k: u32) -> Vec<u32> {
    let mut v = vec![n];
    while *v.last().unwrap() > CHUNK {
        let c = v.last().unwrap().div_ceil(CHUNK);
        v.push(c * k);
    }
    v
}

/// Scratch for rows longer than [`CHUNK`]: candidate pairs of the intermediate stages,
/// ping-ponged between two buffers (a stage reads one and writes the other).
pub struct TopkScratch {
    bufs: [wgpu::Buffer; 2],
}

impl TopkScratch {
    /// Enough for `n_rows` rows of `n` elements at any k ≤ [`MAX_K`].
    pub fn new(gpu: &Gpu, n_rows: u32, n: u32) -> Result<TopkScratch> {
        TopkScratch::for_k(gpu, n_rows, n, MAX_K)
    }

    /// Enough for `n_rows` rows of `n` elements at any k ≤ `max_k`.
    /// u32 words of the two ping-pong buffers.
    fn words(n_rows: u32, n: u32, max_k: u32) -> [u64; 2] {
        // Stage sizes grow with k, so the largest k bounds every smaller one.
        let st = stages(n, max_k);
        let mut words = [1u64, 1u64];
        for (s, &m) in st.iter().enumerate().take(st.len() - 1) {
            let c = m.div_ceil(CHUNK) as u64 * max_k as u64 * 2 * n_rows as u64;
            words[s % 2] = words[s % 2].max(c);
        }
        words
    }

    fn for_k(gpu: &Gpu, n_rows: u32, n: u32, max_k: u32) -> Result<TopkScratch> {
        let words = Self::words(n_rows, n, max_k);
        Ok(TopkScratch {
            bufs: [
                gpu.buffer(words[0] * 4, "topk.scratch0")?,
                gpu.buffer(words[1] * 4, "topk.scratch1")?,
            ],
        })
    }
}

/// True when rows of `n` need a [`TopkScratch`].
pub fn needs_scratch(n: u32) -> bool {
    n > CHUNK
}

fn check_k(op: &str, k: u32, max_k: u32) -> Result<()> {
    if k == 0 || k > max_k {
        return Err(Error::Invalid(format!(
            "{op}: k = {k}, supported 1..={max_k}"
        )));
    }
    Ok(())
}

/// Where the final stage puts the values: their own buffer (or nowhere), or the ids buffer
/// itself as f32 bits (`PACKED`), so that one readback brings ids and values.
#[derive(Clone, Copy)]
enum Vals<'a> {
    Own(Option<Operand<'a>>),
    Packed(Operand<'a>),
}

/// A top-k selection: the `k` largest of each of `n_rows` rows of `n`.
#[derive(Clone, Copy, Debug)]
pub struct TopkShape {
    pub n_rows: u32,
    pub n: u32,
    pub k: u32,
}

/// The `k` largest of each row of `x`: indices into `ids` (u32 rows of `k`), values into
/// `vals` (f32 rows of `k`) if given. `scratch` is required when [`needs_scratch`]`(n)`.
pub fn topk(
    pass: &mut Pass<'_>,
    shape: TopkShape,
    x: Operand<'_>,
    ids: Operand<'_>,
    vals: Option<Operand<'_>>,
    scratch: Option<&TopkScratch>,
) -> Result<()> {
    check_k("topk", shape.k, MAX_K)?;
    topk_stages(pass, shape, x, ids, Vals::Own(vals), scratch)
}

fn topk_stages(
    pass: &mut Pass<'_>,
    shape: TopkShape,
    x: Operand<'_>,
    ids: Operand<'_>,
    vals: Vals<'_>,
    scratch: Option<&TopkScratch>,
) -> Result<()> {
    let TopkShape { n_rows, n, k } = shape;
    if n_rows == 0 {
        return Ok(());
    }
    if n == 0 {
        return Err(Error::Invalid("topk: rows of 0 elements".into()));
    }
    x.check("topk", "x", n_rows, n)?;
    ids.check("topk", "ids", n_rows, k)?;
    let (own_vals, packed) = match vals {
        Vals::Own(v) => (v, None),
        Vals::Packed(v) => (None, Some(v)),
    };
    if let Some(v) = own_vals.as_ref().or(packed.as_ref()) {
        v.check("topk", "vals", n_rows, k)?;
    }
    let st = stages(n, k);
    let scratch = match (st.len() > 1, scratch) {
        (false, _) => None,
        (true, Some(s)) => Some(s),
        (true, None) => {
            return Err(Error::Invalid(format!(
                "topk: rows of {n} exceed one chunk of {CHUNK}: pass a TopkScratch"
            )))
        }
    };
    let gpu = pass.gpu();
    for (s, &m) in st.iter().enumerate() {
        let pairs = s > 0;
        let last = s + 1 == st.len();
        let n_chunks = m.div_ceil(CHUNK);
        let (vals, pack) = (last && own_vals.is_some(), last && packed.is_some());
        #[derive(PartialEq, Eq, Hash)]
        struct Topk {
            k: u32,
            /// The input is a previous stage's (value, index) pairs.
            pairs: bool,
            /// The last stage: writes the caller's outputs.
            last: bool,
            /// The last stage writes its own values.
            vals: bool,
            /// The last stage writes packed (value, index) words.
            pack: bool,
        }
        impl super::PipelineKey for Topk {
            fn source(&self) -> &'static str {
                SRC
            }
            fn entry(&self) -> &'static str {
                "main"
            }
            fn label(&self) -> String {
                format!(
                    "topk_k{}{}{}",
                    self.k,
                    if self.pairs { "_pairs" } else { "" },
                    match (self.last, self.vals, self.pack) {
                        (false, _, _) => "",
                        (true, true, _) => "_final_vals",
                        (true, _, true) => "_final_packed",
                        _ => "_final",
                    }
                )
            }
            fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
                spec.define("K", format!("{}u", self.k))
                    .define("PAIRS", self.pairs)
                    .define("FINAL", self.last)
                    .define("HAS_VALS", self.vals)
                    .define("PACKED", self.pack)
            }
        }
        let pl = gpu.pipeline_for(Topk {
            k,
            pairs,
            last,
            vals,
            pack,
        })?;
        let mut params = Params {
            n: m,
            n_rows,
            n_chunks,
            in_off: x.off,
            in_stride: x.stride_for(n),
            out_off: 0,
            out_stride: 0,
            val_off: 0,
            val_stride: 0,
            renorm: 0,
            _pad: [0; 2],
        };
        let mut bindings: Vec<Binding> = Vec::with_capacity(3);
        if pairs {
            // Stage s reads what stage s−1 wrote: packed rows of m candidates.
            params.in_off = 0;
            params.in_stride = 2 * m;
            bindings.push((&scratch.unwrap().bufs[(s - 1) % 2]).into());
        } else {
            bindings.push(x.buf.into());
        }
        if last {
            params.out_off = ids.off;
            params.out_stride = ids.stride_for(k);
            bindings.push(ids.buf.into());
            if let Some(v) = own_vals.as_ref().or(packed.as_ref()) {
                params.val_off = v.off;
                params.val_stride = v.stride_for(k);
            }
            if let Some(v) = &own_vals {
                bindings.push(v.buf.into());
            }
        } else {
            let buf = &scratch.unwrap().bufs[s % 2];
            let need = n_rows as u64 * n_chunks as u64 * k as u64 * 8;
            if need > buf.size() {
                return Err(Error::Invalid(format!(
                    "topk: scratch of {} bytes is too small for {n_rows} rows of {n} ({need} needed)",
                    buf.size()
                )));
            }
            bindings.push(buf.into());
        }
        let groups = n_rows as u64 * n_chunks as u64;
        if groups > u32::MAX as u64 {
            return Err(Error::Invalid(format!(
                "topk: {groups} workgroups is too many"
            )));
        }
        pass.dispatch(&pl, "topk", &params, &bindings, grid(groups as u32));
    }
    Ok(())
}

/// Index (and value, if `vals`) of the largest element of each row: [`topk`] with k = 1.
pub fn argmax(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n: u32,
    x: Operand<'_>,
    ids: Operand<'_>,
    vals: Option<Operand<'_>>,
    scratch: Option<&TopkScratch>,
) -> Result<()> {
    let shape = TopkShape { n_rows, n, k: 1 };
    topk(pass, shape, x, ids, vals, scratch)
}

/// Qwen's MoE router in one kernel: per row of `n_exp` ≤ [`ROUTER_MAX_EXPERTS`] logits,
/// softmax over all experts, top-`k` (on the logits; ties to the lower index), the winners'
/// probabilities, renormalised to sum 1 when `renorm`. Writes `ids` (u32 rows of k) and
/// `weights` (f32 rows of k), best first.
pub fn router_softmax_topk(pass: &mut Pass<'_>, rows: &RouterRows<'_>, renorm: bool) -> Result<()> {
    let RouterRows {
        n_tok: n_rows,
        n_exp,
        k,
        logits,
        ids,
        weights,
    } = *rows;
    check_k("router_softmax_topk", k, MAX_K)?;
    if n_exp == 0 || n_exp > ROUTER_MAX_EXPERTS || k > n_exp {
        return Err(Error::Invalid(format!(
            "router_softmax_topk: {n_exp} experts, k = {k} (need k ≤ experts ≤ {ROUTER_MAX_EXPERTS})"
        )));
    }
    if n_rows == 0 {
        return Ok(());
    }
    logits.check("router_softmax_topk", "logits", n_rows, n_exp)?;
    ids.check("router_softmax_topk", "ids", n_rows, k)?;
    weights.check("router_softmax_topk", "weights", n_rows, k)?;
    #[derive(PartialEq, Eq, Hash)]
    struct Router {
        k: u32,
    }
    impl super::PipelineKey for Router {
        fn source(&self) -> &'static str {
            SRC
        }
        fn entry(&self) -> &'static str {
            "router"
        }
        fn label(&self) -> String {
            format!("topk_router_k{}", self.k)
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec.define("K", format!("{}u", self.k))
                .define("ROUTER", true)
        }
    }
    let pl = pass.gpu().pipeline_for(Router { k })?;
    let params = Params {
        n: n_exp,
        n_rows,
        n_chunks: 1,
        in_off: logits.off,
        in_stride: logits.stride_for(n_exp),
        out_off: ids.off,
        out_stride: ids.stride_for(k),
        val_off: weights.off,
        val_stride: weights.stride_for(k),
        renorm: renorm as u32,
        _pad: [0; 2],
    };
    let bindings = [
        Binding::from(logits.buf),
        ids.buf.into(),
        weights.buf.into(),
    ];
    pass.dispatch(&pl, "router", &params, &bindings, grid(n_rows));
    Ok(())
}

/// Log-sum-exp of each of `n_rows` rows of `n` in `x` (NaNs skipped; −inf for a row with
/// nothing else) into `out` (f32 rows of 1). One workgroup per row.
pub fn log_sum_exp(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n: u32,
    x: Operand<'_>,
    out: Operand<'_>,
) -> Result<()> {
    if n_rows == 0 {
        return Ok(());
    }
    if n == 0 {
        return Err(Error::Invalid("log_sum_exp: rows of 0 elements".into()));
    }
    x.check("log_sum_exp", "x", n_rows, n)?;
    out.check("log_sum_exp", "out", n_rows, 1)?;
    /// One variant: no fields.
    #[derive(PartialEq, Eq, Hash)]
    struct Lse;
    impl super::PipelineKey for Lse {
        fn source(&self) -> &'static str {
            SRC
        }
        fn entry(&self) -> &'static str {
            "lse"
        }
        fn label(&self) -> String {
            "topk_lse".into()
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec.define("LSE", true)
        }
    }
    let pl = pass.gpu().pipeline_for(Lse)?;
    let params = Params {
        n,
        n_rows,
        n_chunks: 1,
        in_off: x.off,
        in_stride: x.stride_for(n),
        out_off: out.off,
        out_stride: out.stride_for(1),
        val_off: 0,
        val_stride: 0,
        renorm: 0,
        _pad: [0; 2],
    };
    let bindings = [Binding::from(x.buf), out.buf.into()];
    pass.dispatch(&pl, "lse", &params, &bindings, grid(n_rows));
    Ok(())
}

/// u32 words per result row of [`LogitsTop`] at top-`k`: ids `[k]`, values `[k]` (f32 bits),
/// log-sum-exp. Rows are packed for the k of the call, so a readback is `(2k + 1)·4` bytes a
/// row (12 for greedy).
fn top_row(k: u32) -> u32 {
    2 * k + 1
}

/// What a sampler needs from rows of logits, computed on the GPU in the forward's own pass
/// and read back in one copy: the k best (id, logit) pairs and, when asked, the
/// log-sum-exp over the whole row (for log-probabilities). A decode step then reads back
/// `8k + 4` bytes instead of the vocabulary (~1 MB for Qwen3.5's 248,320 logits).
pub struct LogitsTop {
    /// Elements per logits row (the vocabulary).
    n: u32,
    rows: u32,
    scratch: Option<TopkScratch>,
    /// [rows, top_row(k)] u32 for the k of the last records.
    out: wgpu::Buffer,
}

impl LogitsTop {
    /// Room for `rows` result rows over logits rows of `n`, at any k ≤ [`MAX_TOP_K`].
    pub fn new(gpu: &Gpu, rows: u32, n: u32) -> Result<LogitsTop> {
        let rows = rows.max(1);
        let scratch = if needs_scratch(n) {
            Some(TopkScratch::for_k(gpu, rows, n, MAX_TOP_K)?)
        } else {
            None
        };
        let out = gpu.buffer(rows as u64 * top_row(MAX_TOP_K) as u64 * 4, "logits_top")?;
        Ok(LogitsTop {
            n,
            rows,
            scratch,
            out,
        })
    }

    /// Bytes [`LogitsTop::new`] allocates for `rows` rows of `n` (for memory budgets).
    pub fn bytes(rows: u32, n: u32) -> u64 {
        let rows = rows.max(1);
        let scratch = if needs_scratch(n) {
            TopkScratch::words(rows, n, MAX_TOP_K).iter().sum::<u64>() * 4
        } else {
            0
        };
        scratch + rows as u64 * top_row(MAX_TOP_K) as u64 * 4
    }

    /// Result rows it holds.
    pub fn rows(&self) -> u32 {
        self.rows
    }

    /// Records the top `k` of `n_rows` rows of `logits` (rows of `n`), and their log-sum-exp
    /// when `lse`, into result rows `row0 ..` (rows laid out for this `k`: every record of a
    /// pass and its [`LogitsTop::read`] use one k). The scratch is shared by all calls of a
    /// pass; the GPU runs them in order.
    pub fn record(
        &self,
        pass: &mut Pass<'_>,
        logits: Operand<'_>,
        n_rows: u32,
        row0: u32,
        k: u32,
        lse: bool,
    ) -> Result<()> {
        check_k("logits top", k, MAX_TOP_K)?;
        if row0 + n_rows > self.rows {
            return Err(Error::Invalid(format!(
                "logits top: rows {row0}..{} of {}",
                row0 + n_rows,
                self.rows
            )));
        }
        let w = top_row(k);
        let base = row0 * w;
        let ids = Operand::strided(&self.out, base, w);
        let vals = Operand::strided(&self.out, base + k, w);
        let shape = TopkShape {
            n_rows,
            n: self.n,
            k,
        };
        let vals = Vals::Packed(vals);
        topk_stages(pass, shape, logits, ids, vals, self.scratch.as_ref())?;
        if lse {
            let out = Operand::strided(&self.out, base + 2 * k, w);
            log_sum_exp(pass, n_rows, self.n, logits, out)?;
        }
        Ok(())
    }

    /// The result buffer and the byte offset of result row `row`'s best id for records of
    /// `k` (a pass can copy a pick into the next step's input without a readback).
    pub fn id_at(&self, row: u32, k: u32) -> (&wgpu::Buffer, u64) {
        (&self.out, (row * top_row(k)) as u64 * 4)
    }

    /// Reads result rows `0 .. n_rows` as recorded with `k` and `lse` (waits for the
    /// submitted work). Slots the kernel padded (rows with fewer than k selectable logits)
    /// are left out.
    pub fn read(&self, gpu: &Gpu, n_rows: u32, k: u32, lse: bool) -> Result<Vec<TopLogits>> {
        if n_rows == 0 {
            return Ok(Vec::new());
        }
        check_k("logits top", k, MAX_TOP_K)?;
        let words = gpu.read_u32(&self.out, 0, (n_rows * top_row(k)) as usize)?;
        let k = k as usize;
        Ok(words
            .chunks_exact(top_row(k as u32) as usize)
            .map(|w| {
                let cands = (0..k)
                    .map(|j| (w[j], f32::from_bits(w[k + j])))
                    .filter(|c| c.0 != u32::MAX)
                    .collect();
                TopLogits {
                    cands,
                    lse: lse.then(|| f32::from_bits(w[2 * k])),
                }
            })
            .collect())
    }
}
