//! CPU references of the DeepSeek-V4 compression kernels (`gpu::compress`): the store ring,
//! window pooling, indexer scores, top-k selection and the attention key list. Layouts are
//! the GPU's (see `shaders/compress.wgsl`); sums in f64.

use super::ops;

/// Index-list tags of the attention kernels (`gpu::attention::{INVALID, SRC_B}`).
pub const INVALID: u32 = 0xffff_ffff;
pub const SRC_B: u32 = 0x8000_0000;

/// One compressor (`gpu::compress::CmpShape`): ratio, entries of `d` channels, overlapping
/// windows or not, a store ring of `cap` rows.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub ratio: usize,
    pub d: usize,
    pub overlap: bool,
    pub cap: usize,
}

impl Shape {
    /// Elements of the kv (and of the score) projection per token: 2·d when overlapping.
    pub fn width(&self) -> usize {
        if self.overlap {
            2 * self.d
        } else {
            self.d
        }
    }
}

/// Append tokens `pos0..pos0+n_tok` to a store ring `[cap][2·width]`: `src` rows (stride
/// `src_stride`) of kv | score, the score half plus `ape[(pos % ratio)·width ..]`.
pub fn store(
    store: &mut [f32],
    s: &Shape,
    pos0: usize,
    src: &[f32],
    src_stride: usize,
    n_tok: usize,
    ape: &[f32],
) {
    let (cap, ratio, width) = (s.cap, s.ratio, s.width());
    for t in 0..n_tok {
        let pos = pos0 + t;
        let row = &mut store[(pos % cap) * 2 * width..][..2 * width];
        let s = &src[t * src_stride..][..2 * width];
        let a = &ape[(pos % ratio) * width..][..width];
        row[..width].copy_from_slice(&s[..width]);
        for c in 0..width {
            row[width + c] = s[width + c] + a[c];
        }
    }
}

/// Entry of window `w` from a store ring (model.py `Compressor`): per channel a softmax over
/// the window's scores weighs its kv (overlapping: previous window's channels `..d` and this
/// window's `d..`, none before window 0), RMSNorm · `norm`, RoPE on the last
/// `2·inv_freq.len()` channels at position `w·ratio`.
pub fn pool(
    store: &[f32],
    s: &Shape,
    w: usize,
    norm: &[f32],
    inv_freq: &[f32],
    eps: f32,
) -> Vec<f32> {
    let Shape {
        ratio,
        d,
        overlap,
        cap,
    } = *s;
    let width = s.width();
    let at = |q: usize, c: usize| {
        let row = &store[(q % cap) * 2 * width..][..2 * width];
        (row[width + c], row[c])
    };
    let mut ent = vec![0f32; d];
    for (c, out) in ent.iter_mut().enumerate() {
        let mut rows: Vec<(f32, f32)> = Vec::new();
        if overlap && w > 0 {
            rows.extend((0..ratio).map(|r| at((w - 1) * ratio + r, c)));
        }
        let off = if overlap { d } else { 0 };
        rows.extend((0..ratio).map(|r| at(w * ratio + r, off + c)));
        let m = rows.iter().map(|r| r.0).fold(f32::NEG_INFINITY, f32::max) as f64;
        let (mut num, mut den) = (0f64, 0f64);
        for &(s, v) in &rows {
            let e = (s as f64 - m).exp();
            num += e * v as f64;
            den += e;
        }
        *out = (num / den) as f32;
    }
    let mut ent = ops::rms_norm(&ent, d, Some(norm), eps);
    let n_rot = 2 * inv_freq.len();
    ops::rope_interleaved(
        &mut ent,
        1,
        d,
        n_rot,
        &[(w * ratio) as u32],
        inv_freq,
        false,
    );
    ent
}

/// An indexer (`gpu::compress::IndexerShape` less top-k): heads of `d`, compressor ratio.
#[derive(Clone, Copy, Debug)]
pub struct Indexer {
    pub n_head: usize,
    pub d: usize,
    pub ratio: usize,
}

/// Indexer scores `[n_tok, n_ent]`: `Σ_h relu(q[t,h]·keys[i])·w[t,h] / sqrt(d·n_head)` for
/// `i < (pos0+t+1)/ratio`, −1e30 otherwise.
pub fn index_scores(
    q: &[f32],
    w: &[f32],
    keys: &[f32],
    ix: &Indexer,
    n_tok: usize,
    pos0: usize,
    n_ent: usize,
) -> Vec<f32> {
    let Indexer { n_head, d, ratio } = *ix;
    let scale = 1.0 / ((d * n_head) as f64).sqrt();
    let mut out = vec![-1.0e30f32; n_tok * n_ent];
    for t in 0..n_tok {
        let vis = ((pos0 + t + 1) / ratio).min(n_ent);
        for i in 0..vis {
            let k = &keys[i * d..(i + 1) * d];
            let s: f64 = (0..n_head)
                .map(|h| {
                    let qh = &q[(t * n_head + h) * d..][..d];
                    let dot: f64 = qh.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum();
                    dot.max(0.0) * w[t * n_head + h] as f64
                })
                .sum();
            out[t * n_ent + i] = (s * scale) as f32;
        }
    }
    out
}

/// Top `k` of the first `n_vis` scores, best first, ties to the lower index, as
/// `SRC_B | i`; padded with `INVALID` to `n_slots`.
pub fn select_topk(scores: &[f32], n_vis: usize, k: usize, n_slots: usize) -> Vec<u32> {
    let mut idx: Vec<usize> = (0..n_vis).collect();
    idx.sort_by(|a, b| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b)));
    idx.truncate(k.min(n_vis));
    let mut out: Vec<u32> = idx.iter().map(|&i| SRC_B | i as u32).collect();
    out.resize(n_slots, INVALID);
    out
}

/// One token's attention key list: `n_win` window slots (ring rows of positions `pos − i`,
/// `INVALID` below 0 or beyond `window`), then `n_idx − n_win` compressed slots: entries
/// `i < (pos+1)/ratio` when `fill_comp`, `None` (left to the indexer) otherwise.
pub fn index_list(
    pos: usize,
    n_idx: usize,
    n_win: usize,
    window: usize,
    ring: usize,
    ratio: usize,
    fill_comp: bool,
) -> Vec<Option<u32>> {
    (0..n_idx)
        .map(|i| {
            if i < n_win {
                Some(if i <= pos && i < window {
                    ((pos - i) % ring) as u32
                } else {
                    INVALID
                })
            } else if fill_comp {
                let c = i - n_win;
                Some(if ratio > 0 && c < (pos + 1) / ratio {
                    SRC_B | c as u32
                } else {
                    INVALID
                })
            } else {
                None
            }
        })
        .collect()
}
