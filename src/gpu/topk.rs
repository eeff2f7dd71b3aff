//! Top-k per row, argmax, and the fused MoE router (`shaders/topk.wgsl`). CPU references:
//! `cpu::ops::{topk, argmax, router_softmax_topk}`.
//!
//! Results are best first, ties to the lower index, NaNs never selected; a row with fewer
//! than k selectable elements pads with index `u32::MAX`, value −inf. Rows longer than
//! [`CHUNK`] run in stages through a [`TopkScratch`] (vocab rows: 248,320 logits → 122
//! chunks of 16 candidates → one final workgroup per row).

use super::elementwise::View;
use super::{grid, Binding, Gpu, Pass, PipelineSpec};
use crate::{Error, Result};

const SRC: &str = include_str!("../../shaders/topk.wgsl");

/// Elements one workgroup ranks (`topk.wgsl`: 256 threads × 8 registers).
pub const CHUNK: u32 = 2048;
/// Largest k.
pub const MAX_K: u32 = 16;

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
        let st = stages(n, MAX_K);
        let mut words = [1u64, 1u64];
        for (s, &m) in st.iter().enumerate().take(st.len() - 1) {
            let c = m.div_ceil(CHUNK) as u64 * MAX_K as u64 * 2 * n_rows as u64;
            words[s % 2] = words[s % 2].max(c);
        }
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

fn check_k(op: &str, k: u32) -> Result<()> {
    if k == 0 || k > MAX_K {
        return Err(Error::Invalid(format!(
            "{op}: k = {k}, supported 1..={MAX_K}"
        )));
    }
    Ok(())
}

/// The `k` largest of each of `n_rows` rows of `n` in `x`: indices into `ids` (u32 rows of
/// `k`), values into `vals` (f32 rows of `k`) if given. `scratch` is required when
/// [`needs_scratch`]`(n)`.
#[allow(clippy::too_many_arguments)]
pub fn topk(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n: u32,
    k: u32,
    x: View<'_>,
    ids: View<'_>,
    vals: Option<View<'_>>,
    scratch: Option<&TopkScratch>,
) -> Result<()> {
    check_k("topk", k)?;
    if n_rows == 0 {
        return Ok(());
    }
    if n == 0 {
        return Err(Error::Invalid("topk: rows of 0 elements".into()));
    }
    x.check("topk", "x", n_rows, n)?;
    ids.check("topk", "ids", n_rows, k)?;
    if let Some(v) = &vals {
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
        let label = format!(
            "topk_k{k}{}{}",
            if pairs { "_pairs" } else { "" },
            if last {
                if vals.is_some() {
                    "_final_vals"
                } else {
                    "_final"
                }
            } else {
                ""
            }
        );
        let pl = gpu.pipeline(
            &PipelineSpec::new(label, SRC, "main")
                .define("K", format!("{k}u"))
                .define("PAIRS", pairs)
                .define("FINAL", last)
                .define("HAS_VALS", vals.is_some()),
        )?;
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
            if let Some(v) = &vals {
                params.val_off = v.off;
                params.val_stride = v.stride_for(k);
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
    x: View<'_>,
    ids: View<'_>,
    vals: Option<View<'_>>,
    scratch: Option<&TopkScratch>,
) -> Result<()> {
    topk(pass, n_rows, n, 1, x, ids, vals, scratch)
}

/// Qwen's MoE router in one kernel: per row of `n_exp` ≤ [`CHUNK`] logits, softmax over all
/// experts, top-`k` (on the logits; ties to the lower index), the winners' probabilities,
/// renormalised to sum 1 when `renorm`. Writes `ids` (u32 rows of k) and `weights` (f32 rows
/// of k), best first.
#[allow(clippy::too_many_arguments)]
pub fn router_softmax_topk(
    pass: &mut Pass<'_>,
    n_rows: u32,
    n_exp: u32,
    k: u32,
    renorm: bool,
    logits: View<'_>,
    ids: View<'_>,
    weights: View<'_>,
) -> Result<()> {
    check_k("router_softmax_topk", k)?;
    if n_exp == 0 || n_exp > CHUNK || k > n_exp {
        return Err(Error::Invalid(format!(
            "router_softmax_topk: {n_exp} experts, k = {k} (need k ≤ experts ≤ {CHUNK})"
        )));
    }
    if n_rows == 0 {
        return Ok(());
    }
    logits.check("router_softmax_topk", "logits", n_rows, n_exp)?;
    ids.check("router_softmax_topk", "ids", n_rows, k)?;
    weights.check("router_softmax_topk", "weights", n_rows, k)?;
    let pl = pass.gpu().pipeline(
        &PipelineSpec::new(format!("topk_router_k{k}"), SRC, "router")
            .define("K", format!("{k}u"))
            .define("ROUTER", true),
    )?;
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
