//! Plain CPU references of the small GPU ops (`shaders/{elementwise,norm,rope,softmax,embed,
//! topk}.wgsl`): norms, RoPE, softmax, activations, embedding gather, top-k.
//!
//! Written for clarity and accuracy, not speed: reductions (norms, softmax sums) accumulate in
//! f64, RoPE evaluates its angle `pos·inv_freq` exactly in f64 (the product of a u32 below 2^29
//! and an f32 fits f64's 53 bits) before `cos`/`sin`. Row-wise functions take the rows packed
//! back to back (`x.len()` a multiple of `dim`) and return new vectors; RoPE works in place.

use crate::{DType, Error, Result};

/// `x / (1 + e^-x)` (SiLU, a.k.a. swish), evaluated in f64.
pub fn silu(x: f32) -> f32 {
    let x = x as f64;
    (x / (1.0 + (-x).exp())) as f32
}

/// `1 / (1 + e^-x)`, evaluated in f64.
pub fn sigmoid(x: f32) -> f32 {
    (1.0 / (1.0 + (-(x as f64)).exp())) as f32
}

#[track_caller]
fn check_rows(what: &str, len: usize, dim: usize) -> usize {
    assert!(
        dim > 0 && len.is_multiple_of(dim),
        "cpu::ops::{what}: {len} elements are not rows of {dim}"
    );
    len / dim
}

/// RMSNorm per row of `dim`: `y = x · rsqrt(mean(x²) + eps) · w` (`w` of length `dim`, or 1).
///
/// This is the plain-`w` form: HF's Qwen3.5 `x̂·(1+w)` arrives here with `1+w` already folded in
/// by the loaders (GGUF stores it that way).
#[track_caller]
pub fn rms_norm(x: &[f32], dim: usize, w: Option<&[f32]>, eps: f32) -> Vec<f32> {
    check_rows("rms_norm", x.len(), dim);
    if let Some(w) = w {
        assert_eq!(w.len(), dim, "cpu::ops::rms_norm: weight length");
    }
    let mut y = vec![0f32; x.len()];
    for (xr, yr) in x.chunks_exact(dim).zip(y.chunks_exact_mut(dim)) {
        let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
        let r = 1.0 / (ms + eps as f64).sqrt();
        for (j, (yv, &xv)) in yr.iter_mut().zip(xr).enumerate() {
            let wv = w.map_or(1.0, |w| w[j] as f64);
            *yv = (xv as f64 * r * wv) as f32;
        }
    }
    y
}

/// How an L2 norm guards against a zero row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum L2Mode {
    /// Hugging Face's `x · rsqrt(Σx² + eps)` (Qwen3.5 GDN q/k, `l2norm` in the FLA kernels).
    #[default]
    Hf,
    /// ggml's `ggml_l2_norm`: `x / max(‖x‖, eps)`.
    Ggml,
}

/// L2 norm per row of `dim`, times `scale` (e.g. GDN's q gets `1/sqrt(d_k)`); see [`L2Mode`].
#[track_caller]
pub fn l2_norm(x: &[f32], dim: usize, eps: f32, mode: L2Mode, scale: f32) -> Vec<f32> {
    check_rows("l2_norm", x.len(), dim);
    let mut y = vec![0f32; x.len()];
    for (xr, yr) in x.chunks_exact(dim).zip(y.chunks_exact_mut(dim)) {
        let ss = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>();
        let r = match mode {
            L2Mode::Hf => 1.0 / (ss + eps as f64).sqrt(),
            L2Mode::Ggml => 1.0 / ss.sqrt().max(eps as f64),
        };
        for (yv, &xv) in yr.iter_mut().zip(xr) {
            *yv = (xv as f64 * r * scale as f64) as f32;
        }
    }
    y
}

/// Gated RMSNorm of Qwen3.5's Gated DeltaNet output: `w ⊙ rmsnorm(o) ⊙ silu(z)` per row of
/// `dim` (`o` and `z` the same shape; `w` plain, not `1+w`).
#[track_caller]
pub fn gated_rms_norm(o: &[f32], z: &[f32], dim: usize, w: Option<&[f32]>, eps: f32) -> Vec<f32> {
    assert_eq!(
        o.len(),
        z.len(),
        "cpu::ops::gated_rms_norm: o and z lengths"
    );
    let mut y = rms_norm(o, dim, w, eps);
    for (yv, &zv) in y.iter_mut().zip(z) {
        *yv = (*yv as f64 * silu(zv) as f64) as f32;
    }
    y
}

/// Softmax per row of `dim` of `scale·x`, max-subtracted, summed in f64.
#[track_caller]
pub fn softmax(x: &[f32], dim: usize, scale: f32) -> Vec<f32> {
    check_rows("softmax", x.len(), dim);
    let mut y = vec![0f32; x.len()];
    for (xr, yr) in x.chunks_exact(dim).zip(y.chunks_exact_mut(dim)) {
        let s = scale as f64;
        let m = xr
            .iter()
            .map(|&v| v as f64 * s)
            .fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = xr.iter().map(|&v| (v as f64 * s - m).exp()).sum();
        for (yv, &xv) in yr.iter_mut().zip(xr) {
            *yv = ((xv as f64 * s - m).exp() / sum) as f32;
        }
    }
    y
}

/// SwiGLU `silu(g) · u`, with DeepSeek-V4's clamps when `limit` is set:
/// `g ← min(g, limit)`, `u ← clamp(u, −limit, limit)` (model.py `Expert.forward`).
#[track_caller]
pub fn swiglu(g: &[f32], u: &[f32], limit: Option<f32>) -> Vec<f32> {
    assert_eq!(g.len(), u.len(), "cpu::ops::swiglu: g and u lengths");
    g.iter()
        .zip(u)
        .map(|(&g, &u)| {
            let (g, u) = match limit {
                Some(l) => (g.min(l), u.clamp(-l, l)),
                None => (g, u),
            };
            (silu(g) as f64 * u as f64) as f32
        })
        .collect()
}

/// Step-3.5/3.7's clamped SwiGLU `min(silu(g), limit) · clamp(u, −limit, limit)`
/// (transformers' `Step3p7MLP.forward` / `Step3p7Experts._apply_gate`, llama.cpp's
/// `build_ffn` for step35): the clamp follows SiLU.
#[track_caller]
pub fn swiglu_act_clamp(g: &[f32], u: &[f32], limit: f32) -> Vec<f32> {
    assert_eq!(
        g.len(),
        u.len(),
        "cpu::ops::swiglu_act_clamp: g and u lengths"
    );
    g.iter()
        .zip(u)
        .map(|(&g, &u)| (silu(g).min(limit) as f64 * u.clamp(-limit, limit) as f64) as f32)
        .collect()
}

/// GELU with PyTorch's tanh approximation (`gelu(approximate="tanh")`, HF
/// `gelu_pytorch_tanh`): `x/2 · (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
pub fn gelu_tanh(x: f32) -> f32 {
    let x = x as f64;
    (0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh()))
        as f32
}

/// GeGLU `gelu_tanh(g) · u` (Gemma's gated FFN, HF `Gemma4TextMLP`).
#[track_caller]
pub fn geglu(g: &[f32], u: &[f32]) -> Vec<f32> {
    assert_eq!(g.len(), u.len(), "cpu::ops::geglu: g and u lengths");
    g.iter()
        .zip(u)
        .map(|(&g, &u)| (gelu_tanh(g) as f64 * u as f64) as f32)
        .collect()
}

/// Logit softcapping `cap · tanh(x / cap)` (Gemma's `final_logit_softcapping`).
pub fn softcap(x: f32, cap: f32) -> f32 {
    (cap as f64 * (x as f64 / cap as f64).tanh()) as f32
}

// ---------------------------------------------------------------------------------------
// RoPE

/// `theta^(−2i/n_rot)` for `i < n_rot/2`, computed as transformers does (`1.0 / (base **
/// (arange(0, dim, 2).float() / dim))`: f32 exponent, pow rounded to f32, f32 reciprocal), so
/// the table equals the reference's.
pub fn rope_inv_freq(theta: f32, n_rot: usize) -> Vec<f32> {
    (0..n_rot / 2)
        .map(|i| 1.0 / pos_freq(theta, i, n_rot))
        .collect()
}

/// `theta^(2i/n_rot)` rounded to f32 (see [`rope_inv_freq`]).
fn pos_freq(theta: f32, i: usize, n_rot: usize) -> f32 {
    let e = (2 * i) as f32 / n_rot as f32;
    (theta as f64).powf(e as f64) as f32
}

/// YaRN frequency correction parameters (no magnitude scaling: DeepSeek-V4's compressed
/// layers use the frequencies only, as DeepSeek's `inference/model.py` `precompute_freqs_cis`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// Context extension factor (`rope_factor`, DeepSeek-V4: 16).
    pub factor: f32,
    /// Context length the frequencies were trained for (`original_seq_len`, 65536).
    pub original_max_position: u32,
    /// Rotation counts bounding the ramp (`beta_fast` 32, `beta_slow` 1).
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// YaRN inverse frequencies: per frequency `i < n_rot/2`, mix the interpolated
/// `1/(factor·theta^(2i/n_rot))` and the extrapolated `1/theta^(2i/n_rot)` with the linear ramp
/// between the correction dimensions of `beta_fast` and `beta_slow` (floored / ceiled, clamped
/// to `[0, n_rot−1]`), as transformers' `_compute_yarn_parameters` (truncate = true) and
/// DeepSeek's `precompute_freqs_cis` (which differs only in f32 rounding order). The ramp and
/// mix are f32 like theirs; the correction range in f64 like Python's `math`.
pub fn yarn_inv_freq(theta: f32, n_rot: usize, yarn: &Yarn) -> Vec<f32> {
    let corr_dim = |rot: f64| {
        n_rot as f64 * (yarn.original_max_position as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * (theta as f64).ln())
    };
    let low = corr_dim(yarn.beta_fast as f64).floor().max(0.0);
    let high = corr_dim(yarn.beta_slow as f64)
        .ceil()
        .min(n_rot as f64 - 1.0);
    let (low, mut high) = (low as f32, high as f32);
    if low == high {
        high += 0.001;
    }
    (0..n_rot / 2)
        .map(|i| {
            let p = pos_freq(theta, i, n_rot);
            let extrapolated = 1.0 / p;
            let interpolated = 1.0 / (yarn.factor * p);
            let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
            let extra_factor = 1.0 - ramp;
            interpolated * (1.0 - extra_factor) + extrapolated * extra_factor
        })
        .collect()
}

/// `(cos, sin)` of `pos·inv_freq`, exact angle in f64; negated sine for the inverse rotation.
fn cos_sin(pos: u32, inv_freq: f32, inverse: bool) -> (f64, f64) {
    let a = pos as f64 * inv_freq as f64;
    let (s, c) = a.sin_cos();
    (c, if inverse { -s } else { s })
}

#[track_caller]
fn check_rope(
    what: &str,
    x: &[f32],
    n_heads: usize,
    head_dim: usize,
    n_rot: usize,
    pos: &[u32],
    f: &[f32],
) {
    assert!(
        n_rot.is_multiple_of(2) && n_rot <= head_dim && f.len() == n_rot / 2,
        "cpu::ops::{what}: n_rot {n_rot}, head_dim {head_dim}, {} frequencies",
        f.len()
    );
    assert_eq!(
        x.len(),
        pos.len() * n_heads * head_dim,
        "cpu::ops::{what}: x is not [n_tokens, n_heads, head_dim]"
    );
}

/// NEOX-style RoPE in place on `x` `[n_tokens, n_heads, head_dim]`: the LEADING `n_rot` dims
/// of each head rotate as pairs `(i, i + n_rot/2)` by `positions[t]·inv_freq[i]` (HF
/// `rotate_half`; Qwen3.5 rotates 64 of 256). `inverse` rotates by −θ.
#[track_caller]
pub fn rope_neox(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    n_rot: usize,
    positions: &[u32],
    inv_freq: &[f32],
    inverse: bool,
) {
    check_rope(
        "rope_neox",
        x,
        n_heads,
        head_dim,
        n_rot,
        positions,
        inv_freq,
    );
    let half = n_rot / 2;
    for (t, tok) in x.chunks_exact_mut(n_heads * head_dim).enumerate() {
        for head in tok.chunks_exact_mut(head_dim) {
            for (i, &f) in inv_freq.iter().enumerate() {
                let (c, s) = cos_sin(positions[t], f, inverse);
                let (a, b) = (head[i] as f64, head[i + half] as f64);
                head[i] = (a * c - b * s) as f32;
                head[i + half] = (b * c + a * s) as f32;
            }
        }
    }
}

/// Interleaved RoPE in place on `x` `[n_tokens, n_heads, head_dim]`: the TRAILING `n_rot` dims
/// of each head rotate as pairs `(2i, 2i+1)` by `positions[t]·inv_freq[i]` (DeepSeek's
/// `apply_rotary_emb`, complex pairs; V4 rotates the last 64 of 512). `inverse` rotates by −θ
/// (the conjugate, V4's attention output).
#[track_caller]
pub fn rope_interleaved(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    n_rot: usize,
    positions: &[u32],
    inv_freq: &[f32],
    inverse: bool,
) {
    check_rope(
        "rope_interleaved",
        x,
        n_heads,
        head_dim,
        n_rot,
        positions,
        inv_freq,
    );
    let base = head_dim - n_rot;
    for (t, tok) in x.chunks_exact_mut(n_heads * head_dim).enumerate() {
        for head in tok.chunks_exact_mut(head_dim) {
            for (i, &f) in inv_freq.iter().enumerate() {
                let (c, s) = cos_sin(positions[t], f, inverse);
                let (a, b) = (head[base + 2 * i] as f64, head[base + 2 * i + 1] as f64);
                head[base + 2 * i] = (a * c - b * s) as f32;
                head[base + 2 * i + 1] = (b * c + a * s) as f32;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Selection

/// True when `(a, ia)` ranks before `(b, ib)`: larger value, ties to the lower index.
fn ranks_before(a: f32, ia: u32, b: f32, ib: u32) -> bool {
    a > b || (a == b && ia < ib)
}

/// The `k` largest elements of one row, best first: `(indices, values)`, ties broken by the
/// lower index. NaNs are never selected; when fewer than `k` elements qualify, the tail holds
/// `(u32::MAX, −inf)`, as the GPU kernel writes.
pub fn topk(x: &[f32], k: usize) -> (Vec<u32>, Vec<f32>) {
    let mut best: Vec<(f32, u32)> = vec![(f32::NEG_INFINITY, u32::MAX); k];
    for (i, &v) in x.iter().enumerate() {
        let i = i as u32;
        if k == 0 || !ranks_before(v, i, best[k - 1].0, best[k - 1].1) {
            continue;
        }
        let mut j = k - 1;
        while j > 0 && ranks_before(v, i, best[j - 1].0, best[j - 1].1) {
            best[j] = best[j - 1];
            j -= 1;
        }
        best[j] = (v, i);
    }
    (
        best.iter().map(|b| b.1).collect(),
        best.iter().map(|b| b.0).collect(),
    )
}

/// Index and value of the largest element (the first one on ties; NaNs skipped;
/// `(u32::MAX, −inf)` for a row without a selectable element).
pub fn argmax(x: &[f32]) -> (u32, f32) {
    let (i, v) = topk(x, 1);
    (i[0], v[0])
}

/// MoE routing as Qwen3.5 / Qwen3-Next: per row of `n_exp` logits, softmax over all experts,
/// the top `k` (chosen on the logits: softmax is monotonic; ties to the lower index), then
/// the winners' probabilities, renormalised to sum 1 when `renorm`. Returns
/// `(ids [n_rows·k], weights [n_rows·k])`, best first.
#[track_caller]
pub fn router_softmax_topk(
    logits: &[f32],
    n_exp: usize,
    k: usize,
    renorm: bool,
) -> (Vec<u32>, Vec<f32>) {
    check_rows("router_softmax_topk", logits.len(), n_exp);
    assert!(
        k <= n_exp,
        "cpu::ops::router_softmax_topk: k {k} > {n_exp} experts"
    );
    let mut ids = Vec::new();
    let mut ws = Vec::new();
    for row in logits.chunks_exact(n_exp) {
        let (idx, vals) = topk(row, k);
        let m = vals[0] as f64;
        let sum: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
        let p: Vec<f64> = vals.iter().map(|&v| (v as f64 - m).exp() / sum).collect();
        let norm = if renorm { p.iter().sum::<f64>() } else { 1.0 };
        ids.extend_from_slice(&idx);
        ws.extend(p.iter().map(|&v| (v / norm) as f32));
    }
    (ids, ws)
}

// ---------------------------------------------------------------------------------------
// Embedding

/// Embedding gather: `out[t] = dequantize(E[ids[t]])` for `E` the raw bytes of a `[n_rows,
/// row_len]` tensor of `dtype` (any type `quant::dequantize` reads). Ids out of range are an
/// error naming the token position.
pub fn embed(dtype: DType, data: &[u8], row_len: usize, ids: &[u32]) -> Result<Vec<f32>> {
    let row_bytes = dtype.bytes_for(row_len as u64).ok_or_else(|| {
        Error::Invalid(format!(
            "embed: rows of {row_len} are not whole {dtype} blocks"
        ))
    })? as usize;
    let n_rows = data.len().checked_div(row_bytes).unwrap_or(0);
    let mut out = vec![0f32; ids.len() * row_len];
    for (t, (&id, y)) in ids
        .iter()
        .zip(out.chunks_exact_mut(row_len.max(1)))
        .enumerate()
    {
        let id = id as usize;
        if id >= n_rows {
            return Err(Error::Invalid(format!(
                "embed: token {t} has id {id}, the table has {n_rows} rows"
            )));
        }
        crate::quant::dequantize(dtype, &data[id * row_bytes..(id + 1) * row_bytes], y)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topk_ties_and_nan() {
        let x = [1.0, 3.0, f32::NAN, 3.0, -1.0, 2.0];
        assert_eq!(topk(&x, 3), (vec![1, 3, 5], vec![3.0, 3.0, 2.0]));
        let (i, v) = topk(&[f32::NAN, 0.5], 3);
        assert_eq!(i, vec![1, u32::MAX, u32::MAX]);
        assert_eq!(v[0], 0.5);
        assert_eq!(argmax(&[0.0, -0.0, 0.0]), (0, 0.0));
    }

    #[test]
    fn norms_and_softmax_by_hand() {
        let y = rms_norm(&[3.0, 4.0], 2, Some(&[1.0, 2.0]), 0.0);
        let r = (12.5f64).sqrt();
        assert!((y[0] as f64 - 3.0 / r).abs() < 1e-6 && (y[1] as f64 - 8.0 / r).abs() < 1e-6);
        let y = l2_norm(&[3.0, 4.0], 2, 0.0, L2Mode::Ggml, 2.0);
        assert_eq!(y, vec![1.2, 1.6]);
        let y = l2_norm(&[0.0, 0.0], 2, 1e-6, L2Mode::Ggml, 1.0);
        assert_eq!(y, vec![0.0, 0.0]);
        let s = softmax(&[1.0, 1.0, 1000.0, 1000.0], 2, 1.0);
        assert_eq!(s, vec![0.5; 4]);
    }

    #[test]
    fn rope_inverse_undoes_forward() {
        let f = rope_inv_freq(10000.0, 4);
        let x0: Vec<f32> = (0..16).map(|i| i as f32 * 0.25 - 1.0).collect();
        for interleaved in [false, true] {
            let mut x = x0.clone();
            let rope = if interleaved {
                rope_interleaved
            } else {
                rope_neox
            };
            rope(&mut x, 2, 4, 4, &[7, 100_000], &f, false);
            assert!(x.iter().zip(&x0).any(|(a, b)| (a - b).abs() > 0.1));
            rope(&mut x, 2, 4, 4, &[7, 100_000], &f, true);
            for (a, b) in x.iter().zip(&x0) {
                assert!((a - b).abs() < 1e-6, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn yarn_ramp_ends() {
        // DeepSeek-V4 compressed layers: theta 160000, 64 rotated dims, factor 16.
        let y = Yarn {
            factor: 16.0,
            original_max_position: 65536,
            beta_fast: 32.0,
            beta_slow: 1.0,
        };
        let plain = rope_inv_freq(160000.0, 64);
        let f = yarn_inv_freq(160000.0, 64, &y);
        // High frequencies (short wavelengths) extrapolate, low ones interpolate by `factor`.
        assert_eq!(f[0], plain[0]);
        assert!((f[31] * 16.0 / plain[31] - 1.0).abs() < 1e-6);
        assert!(f.windows(2).all(|w| w[1] < w[0]));
    }
}
