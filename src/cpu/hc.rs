//! CPU references of the hyper-connection kernels (`gpu::hc`), DeepSeek's model.py
//! `hc_pre` / `hc_post` / `hc_head` on flat rows. Sums in f64.
//!
//! Shapes per token: copies `x` [hc·n_embd]; mixes [(2+hc)·hc] (block) or [hc] (head), the
//! product `fn · x` before the RMS scale; `pc` [hc + hc·hc] = (post, comb), comb[i·hc + j]
//! sending copy i to copy j.

use super::ops::sigmoid;

fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    (1.0 / (ms + eps as f64).sqrt()) as f32
}

/// `pre`, `post`, `comb` of one token from its scaled mixes `m` (model.py
/// `hc_split_sinkhorn`): comb rows softmaxed + eps, columns normalised once, then
/// `iters − 1` rounds of rows then columns (each sum + eps).
pub fn split_sinkhorn(
    m: &[f32],
    scale: &[f32],
    base: &[f32],
    hc: usize,
    iters: usize,
    hc_eps: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let pre = (0..hc)
        .map(|j| sigmoid(m[j] * scale[0] + base[j]) + hc_eps)
        .collect();
    let post = (0..hc)
        .map(|j| 2.0 * sigmoid(m[hc + j] * scale[1] + base[hc + j]))
        .collect();
    let mut c: Vec<f32> = (0..hc * hc)
        .map(|k| m[2 * hc + k] * scale[2] + base[2 * hc + k])
        .collect();
    for row in c.chunks_mut(hc) {
        let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let ex: Vec<f64> = row.iter().map(|v| ((*v - mx) as f64).exp()).collect();
        let s: f64 = ex.iter().sum();
        for (v, e) in row.iter_mut().zip(&ex) {
            *v = (e / s) as f32 + hc_eps;
        }
    }
    let cols = |c: &mut [f32]| {
        for j in 0..hc {
            let s = (0..hc).map(|i| c[i * hc + j] as f64).sum::<f64>() + hc_eps as f64;
            (0..hc).for_each(|i| c[i * hc + j] = (c[i * hc + j] as f64 / s) as f32);
        }
    };
    let rows = |c: &mut [f32]| {
        for row in c.chunks_mut(hc) {
            let s = row.iter().map(|v| *v as f64).sum::<f64>() + hc_eps as f64;
            row.iter_mut().for_each(|v| *v = (*v as f64 / s) as f32);
        }
    };
    cols(&mut c);
    for _ in 1..iters {
        rows(&mut c);
        cols(&mut c);
    }
    (pre, post, c)
}

/// `rmsnorm(Σ_j g[j]·x[j]) · w` for one token.
fn fold_norm(x: &[f32], g: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let e = w.len();
    let y: Vec<f32> = (0..e)
        .map(|d| {
            g.iter()
                .enumerate()
                .map(|(j, gj)| *gj as f64 * x[j * e + d] as f64)
                .sum::<f64>() as f32
        })
        .collect();
    let r = rms_scale(&y, eps);
    y.iter().zip(w).map(|(v, w)| v * r * w).collect()
}

/// Copies and constants of the hyper-connections (`gpu::hc::HcShape`; n_embd is the norm's
/// length).
#[derive(Clone, Copy, Debug)]
pub struct HcShape {
    pub hc: usize,
    /// Sinkhorn iterations (block sites).
    pub iters: usize,
    /// RMSNorm epsilon (the copies' RMS and the fold's norm).
    pub eps: f32,
    pub hc_eps: f32,
}

/// Block site for `n` tokens: returns `h` [n, n_embd] and `pc` [n, hc + hc·hc].
pub fn pre(
    x: &[f32],
    mixes: &[f32],
    base: &[f32],
    scale: &[f32],
    norm: &[f32],
    s: &HcShape,
) -> (Vec<f32>, Vec<f32>) {
    let HcShape {
        hc,
        iters,
        eps,
        hc_eps,
    } = *s;
    let e = norm.len();
    let nm = (2 + hc) * hc;
    let (mut h, mut pc) = (Vec::new(), Vec::new());
    for (xt, mt) in x.chunks(hc * e).zip(mixes.chunks(nm)) {
        let r = rms_scale(xt, eps);
        let m: Vec<f32> = mt.iter().map(|v| v * r).collect();
        let (pre, post, comb) = split_sinkhorn(&m, scale, base, hc, iters, hc_eps);
        h.extend(fold_norm(xt, &pre, norm, eps));
        pc.extend(post);
        pc.extend(comb);
    }
    (h, pc)
}

/// Head fold for `n` tokens: `h` [n, n_embd] (`s.iters` unused).
pub fn head(
    x: &[f32],
    mixes: &[f32],
    base: &[f32],
    scale: f32,
    norm: &[f32],
    s: &HcShape,
) -> Vec<f32> {
    let HcShape {
        hc, eps, hc_eps, ..
    } = *s;
    let e = norm.len();
    let mut h = Vec::new();
    for (xt, mt) in x.chunks(hc * e).zip(mixes.chunks(hc)) {
        let r = rms_scale(xt, eps);
        let g: Vec<f32> = (0..hc)
            .map(|j| sigmoid(mt[j] * r * scale + base[j]) + hc_eps)
            .collect();
        h.extend(fold_norm(xt, &g, norm, eps));
    }
    h
}

/// `x[j] = post[j]·blk + Σ_i comb[i][j]·x[i]` for the tokens of `blk` [n, n_embd], in place.
pub fn post(x: &mut [f32], blk: &[f32], pc: &[f32], hc: usize, n_embd: usize) {
    let e = n_embd;
    for (t, bt) in blk.chunks(e).enumerate() {
        let xt = &mut x[t * hc * e..(t + 1) * hc * e];
        let old = xt.to_vec();
        let p = &pc[t * (hc + hc * hc)..(t + 1) * (hc + hc * hc)];
        for j in 0..hc {
            for d in 0..e {
                let mut acc = p[j] as f64 * bt[d] as f64;
                for i in 0..hc {
                    acc += p[hc + i * hc + j] as f64 * old[i * e + d] as f64;
                }
                xt[j * e + d] = acc as f32;
            }
        }
    }
}
