//! Plain softmax attention, accumulated in f64: the reference of `gpu::attention` and of
//! the models' CPU reference paths.
//!
//! Shapes (row-major, outermost first): queries `q [n_q][n_head][head_dim]`; a KV source
//! is `k, v [n_rows][n_head_kv][head_dim]` (the GPU cache layout, in f32); the output is
//! `[n_q][n_head][head_dim]`. GQA: q head `h` reads KV head `h / (n_head / n_head_kv)`
//! (HF `repeat_kv`, llama.cpp). Sinks (DeepSeek-V4, gpt-oss): softmax over
//! `[scores…, sink]`, the sink adds to the denominator and contributes no value.

/// One KV source: `k` and `v` are `[n_rows][n_head_kv][head_dim]`; `v` may be `k`.
#[derive(Clone, Copy, Debug)]
pub struct KvRef<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
}

/// Which keys query token `t` sees (same meaning as `gpu::attention::Keys`).
#[derive(Clone, Copy, Debug)]
pub enum Visible<'a> {
    /// Key `j` (row `j` of source A, `j < n_rows`) iff `j <= pos0 + t`, and with
    /// `window > 0` also `pos0 + t - j < window`.
    Causal { pos0: usize, window: usize },
    /// Rows `first..first + n` of source A, `(first, n) = ranges[t]`.
    Ranges(&'a [(u32, u32)]),
    /// `idx[t * n_idx + i]`: a row of A, of B when bit 31 is set, none when `0xFFFFFFFF`.
    Index { idx: &'a [u32], n_idx: usize },
}

/// Sizes of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub n_q: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

/// Reference attention. `scale` multiplies q·k (not the sinks); `sinks[h]` per q head.
/// Panics on inconsistent slice sizes (a test/reference helper, not user input).
#[track_caller]
pub fn attention(
    d: Dims,
    q: &[f32],
    a: KvRef<'_>,
    b: Option<KvRef<'_>>,
    vis: Visible<'_>,
    sinks: Option<&[f32]>,
    scale: f32,
) -> Vec<f32> {
    let Dims {
        n_q,
        n_head,
        n_head_kv,
        head_dim: hd,
    } = d;
    assert!(
        n_head.is_multiple_of(n_head_kv),
        "n_head {n_head} not a multiple of n_head_kv {n_head_kv}"
    );
    assert_eq!(q.len(), n_q * n_head * hd, "q length");
    let row = n_head_kv * hd;
    assert!(
        a.k.len().is_multiple_of(row) && a.k.len() == a.v.len(),
        "source A length"
    );
    let n_a = a.k.len() / row;
    let g = n_head / n_head_kv;
    let mut out = vec![0f32; n_q * n_head * hd];
    // The visible (source, row) pairs of each token, shared by its heads.
    let keys_of = |t: usize| -> Vec<(bool, usize)> {
        match vis {
            Visible::Causal { pos0, window } => {
                let pos = pos0 + t;
                let lo = if window > 0 {
                    (pos + 1).saturating_sub(window)
                } else {
                    0
                };
                (lo..=pos)
                    .filter(|&j| j < n_a)
                    .map(|j| (false, j))
                    .collect()
            }
            Visible::Ranges(r) => {
                let (first, n) = r[t];
                (first as usize..first as usize + n as usize)
                    .map(|j| (false, j))
                    .collect()
            }
            Visible::Index { idx, n_idx } => idx[t * n_idx..(t + 1) * n_idx]
                .iter()
                .filter(|&&i| i != u32::MAX)
                .map(|&i| (i & 0x8000_0000 != 0, (i & 0x7fff_ffff) as usize))
                .collect(),
        }
    };
    let mut scores = Vec::new();
    for t in 0..n_q {
        let keys = keys_of(t);
        for h in 0..n_head {
            let kvh = h / g;
            let qr = &q[(t * n_head + h) * hd..][..hd];
            let src = |from_b: bool| -> KvRef<'_> {
                if from_b {
                    b.expect("index list names source B but none was given")
                } else {
                    a
                }
            };
            scores.clear();
            for &(from_b, j) in &keys {
                let kr = &src(from_b).k[j * row + kvh * hd..][..hd];
                let dot: f64 = qr.iter().zip(kr).map(|(&x, &y)| x as f64 * y as f64).sum();
                scores.push(dot * scale as f64);
            }
            let sink = sinks.map(|s| s[h] as f64);
            let mx = scores
                .iter()
                .copied()
                .chain(sink)
                .fold(f64::NEG_INFINITY, f64::max);
            if mx == f64::NEG_INFINITY {
                continue; // nothing visible: output zeros
            }
            let mut den = sink.map_or(0.0, |s| (s - mx).exp());
            let mut acc = vec![0f64; hd];
            for (&(from_b, j), &s) in keys.iter().zip(&scores) {
                let w = (s - mx).exp();
                den += w;
                let vr = &src(from_b).v[j * row + kvh * hd..][..hd];
                for (a, &x) in acc.iter_mut().zip(vr) {
                    *a += w * x as f64;
                }
            }
            let o = &mut out[(t * n_head + h) * hd..][..hd];
            for (y, a) in o.iter_mut().zip(&acc) {
                *y = (a / den) as f32;
            }
        }
    }
    out
}

/// `x` rounded to f16 and back (round to nearest even): what an f16 KV cache holds.
pub fn round_f16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
}
