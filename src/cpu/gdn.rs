//! Gated DeltaNet (the linear attention of Qwen3.5 / Qwen3-Next): plain CPU references for
//! the causal conv1d, the gates, the recurrent rule and its chunked (WY) form. They
//! accumulate in f64, so the GPU kernels (`gpu::conv`, `gpu::gdn`) are checked against the
//! exact math, not against another f32 rounding.
//!
//! Buffer layouts (all f32, row-major, outermost first), shared with the GPU kernels:
//! - `qkv` [T, conv_dim], conv_dim = 2·Hk·d_k + Hv·d_v: per token q [Hk, d_k], then
//!   k [Hk, d_k], then v [Hv, d_v] (the channel order of the fused projection, GGUF
//!   `attn_qkv`); for the GDN rule this is the conv output (after SiLU).
//! - conv weight [conv_dim, K] (GGUF `ssm_conv1d` as stored; HF `conv1d.weight` [conv_dim, 1, K]);
//!   conv state [K−1, conv_dim]: the last K−1 inputs, oldest first.
//! - `a`, `b` [T, Hv]: raw projections; `a_neg` `[Hv]` = −exp(A_log) (GGUF `ssm_a`);
//!   `dt_bias` `[Hv]`. Gates `g`, `beta` [T, Hv].
//! - state [Hv, d_k, d_v]: `S[i][j]` pairs key dim i with value dim j (o = Sᵀq), as HF's
//!   `recurrent_state` [B, H, d_k, d_v].
//! - output `o` [T, Hv, d_v].

use crate::{Error, Result};

/// Tokens per chunk of the chunked form (HF `chunk_gated_delta_rule` default).
pub const CHUNK: usize = 64;
/// L2-norm epsilon of q and k: `x · rsqrt(Σx² + eps)` (HF `l2norm`).
pub const L2_EPS: f64 = 1e-6;

/// Which key head value head `h` reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyHeadMap {
    /// `h / (Hv/Hk)`: HF `repeat_interleave` (HF checkpoints, qwen3next GGUFs).
    Repeat,
    /// `h % Hk`: llama.cpp's qwen35 / qwen35moe GGUFs, whose converter reorders value heads.
    Tile,
}

/// Head counts and sizes of one GDN layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GdnShape {
    pub n_head_k: usize,
    pub n_head_v: usize,
    pub d_k: usize,
    pub d_v: usize,
    pub map: KeyHeadMap,
}

impl GdnShape {
    /// Channels of the fused q|k|v projection and of the conv.
    pub fn conv_dim(&self) -> usize {
        2 * self.n_head_k * self.d_k + self.n_head_v * self.d_v
    }
    /// Key head read by value head `h`.
    pub fn key_head(&self, h: usize) -> usize {
        match self.map {
            KeyHeadMap::Repeat => h / (self.n_head_v / self.n_head_k),
            KeyHeadMap::Tile => h % self.n_head_k,
        }
    }
    /// f32 elements of one sequence's state [Hv, d_k, d_v].
    pub fn state_len(&self) -> usize {
        self.n_head_v * self.d_k * self.d_v
    }
    /// Channel of q / k of key head `kh`, and of v of value head `h`, within a qkv row.
    pub fn q_col(&self, kh: usize) -> usize {
        kh * self.d_k
    }
    pub fn k_col(&self, kh: usize) -> usize {
        (self.n_head_k + kh) * self.d_k
    }
    pub fn v_col(&self, h: usize) -> usize {
        2 * self.n_head_k * self.d_k + h * self.d_v
    }
    pub fn check(&self) -> Result<()> {
        if self.n_head_k == 0 || self.n_head_v == 0 || self.d_k == 0 || self.d_v == 0 {
            return Err(Error::Invalid(format!("gdn: empty shape {self:?}")));
        }
        if !self.n_head_v.is_multiple_of(self.n_head_k) {
            return Err(Error::Invalid(format!(
                "gdn: {} value heads are not a multiple of {} key heads",
                self.n_head_v, self.n_head_k
            )));
        }
        Ok(())
    }
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Causal depthwise conv1d + SiLU over T tokens continuing from `state`.
/// `x`, `y` [T, C]; `w` [C, K]; `state` [K−1, C], updated to the last K−1 inputs.
/// `y[t][c] = silu(Σ_j w[c][j] · x̃[t+j][c])` where x̃ = state ++ x (`w[c][K−1]` takes the
/// current token, as PyTorch's conv1d with K−1 left padding).
pub fn conv1d(x: &[f32], w: &[f32], k: usize, state: &mut [f32], y: &mut [f32]) {
    let c = w.len() / k;
    let t = x.len() / c;
    assert!(k >= 1 && w.len() == c * k && x.len() == t * c && y.len() == t * c);
    assert_eq!(state.len(), (k - 1) * c);
    // x̃ row r: state row r for r < K−1, else input row r − (K−1).
    let row = |r: usize, ch: usize, st: &[f32]| -> f64 {
        if r < k - 1 {
            st[r * c + ch] as f64
        } else {
            x[(r - (k - 1)) * c + ch] as f64
        }
    };
    for ti in 0..t {
        for ch in 0..c {
            let mut acc = 0f64;
            for j in 0..k {
                acc += w[ch * k + j] as f64 * row(ti + j, ch, state);
            }
            y[ti * c + ch] = silu(acc) as f32;
        }
    }
    let old = state.to_vec();
    for r in 0..k - 1 {
        for ch in 0..c {
            state[r * c + ch] = row(t + r, ch, &old) as f32;
        }
    }
}

/// `softplus(x) = log(1 + eʸ)`, linear above 20 as `torch.nn.functional.softplus`.
pub fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.max(0.0) + (-x.abs()).exp().ln_1p()
    }
}

/// Gates per token and value head: `g = a_neg · softplus(a + dt_bias)`, `beta = sigmoid(b)`.
/// `a`, `b`, `g`, `beta` [T, Hv]; `a_neg`, `dt_bias` `[Hv]`.
pub fn gates(
    a: &[f32],
    b: &[f32],
    a_neg: &[f32],
    dt_bias: &[f32],
    g: &mut [f32],
    beta: &mut [f32],
) {
    let hv = a_neg.len();
    assert!(dt_bias.len() == hv && a.len() == b.len() && a.len().is_multiple_of(hv));
    assert!(g.len() == a.len() && beta.len() == a.len());
    for i in 0..a.len() {
        let h = i % hv;
        g[i] = (a_neg[h] as f64 * softplus(a[i] as f64 + dt_bias[h] as f64)) as f32;
        beta[i] = (1.0 / (1.0 + (-(b[i] as f64)).exp())) as f32;
    }
}

/// q̂ (scaled by 1/sqrt(d_k)) and k̂ of token `t` for value head `h`, in f64.
fn qk_hat(s: &GdnShape, qkv: &[f32], t: usize, h: usize) -> (Vec<f64>, Vec<f64>) {
    let cd = s.conv_dim();
    let kh = s.key_head(h);
    let row = &qkv[t * cd..(t + 1) * cd];
    let q = &row[s.q_col(kh)..s.q_col(kh) + s.d_k];
    let k = &row[s.k_col(kh)..s.k_col(kh) + s.d_k];
    let norm = |x: &[f32], scale: f64| -> Vec<f64> {
        let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
        let r = scale / (ss + L2_EPS).sqrt();
        x.iter().map(|&v| v as f64 * r).collect()
    };
    (norm(q, 1.0 / (s.d_k as f64).sqrt()), norm(k, 1.0))
}

fn check_io(s: &GdnShape, qkv: &[f32], g: &[f32], beta: &[f32], state: &[f32], o: &[f32]) -> usize {
    s.check().expect("gdn shape");
    let t = qkv.len() / s.conv_dim();
    assert_eq!(qkv.len(), t * s.conv_dim());
    assert!(g.len() == t * s.n_head_v && beta.len() == t * s.n_head_v);
    assert_eq!(state.len(), s.state_len());
    assert_eq!(o.len(), t * s.n_head_v * s.d_v);
    t
}

/// The recurrent rule, one token at a time (HF `torch_recurrent_gated_delta_rule`):
/// `S ← e^g S; δ = β(v − Sᵀk̂); S ← S + k̂ δᵀ; o = Sᵀq̂`. `state` [Hv, d_k, d_v] is read
/// and updated; `o` [T, Hv, d_v]. Accumulates in f64.
pub fn recurrent(
    s: &GdnShape,
    qkv: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    o: &mut [f32],
) {
    let t_len = check_io(s, qkv, g, beta, state, o);
    let (dk, dv, hv, cd) = (s.d_k, s.d_v, s.n_head_v, s.conv_dim());
    for h in 0..hv {
        let mut st: Vec<f64> = state[h * dk * dv..(h + 1) * dk * dv]
            .iter()
            .map(|&x| x as f64)
            .collect();
        for t in 0..t_len {
            let (q, k) = qk_hat(s, qkv, t, h);
            let v = &qkv[t * cd + s.v_col(h)..][..dv];
            let decay = (g[t * hv + h] as f64).exp();
            let b = beta[t * hv + h] as f64;
            st.iter_mut().for_each(|x| *x *= decay);
            for j in 0..dv {
                let sk: f64 = (0..dk).map(|i| st[i * dv + j] * k[i]).sum();
                let delta = b * (v[j] as f64 - sk);
                for i in 0..dk {
                    st[i * dv + j] += k[i] * delta;
                }
                o[(t * hv + h) * dv + j] =
                    (0..dk).map(|i| st[i * dv + j] * q[i]).sum::<f64>() as f32;
            }
        }
        for (d, &x) in state[h * dk * dv..(h + 1) * dk * dv].iter_mut().zip(&st) {
            *d = x as f32;
        }
    }
}

/// The chunked (WY) form, the same math the GPU prefill runs (HF `torch_chunk_gated_delta_rule`).
/// Per chunk of n ≤ `chunk` tokens with in-chunk cumulative gates G and state S₀:
/// `A[i][j] = β_i e^{G_i−G_j} k̂_i·k̂_j` (j < i); solve `(I + A) U = βV` and
/// `(I + A) W = β e^G K̂` by forward substitution; then `Δ = U − W S₀`,
/// `o_i = e^{G_i} q̂_iᵀS₀ + Σ_{j≤i} e^{G_i−G_j} (q̂_i·k̂_j) Δ_j`,
/// `S = e^{G_n} S₀ + Σ_j e^{G_n−G_j} k̂_j Δ_jᵀ`. Same arguments as [`recurrent`].
pub fn chunked(
    s: &GdnShape,
    qkv: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    o: &mut [f32],
    chunk: usize,
) {
    assert!(chunk >= 1);
    let t_len = check_io(s, qkv, g, beta, state, o);
    let (dk, dv, hv, cd) = (s.d_k, s.d_v, s.n_head_v, s.conv_dim());
    for h in 0..hv {
        let mut st: Vec<f64> = state[h * dk * dv..(h + 1) * dk * dv]
            .iter()
            .map(|&x| x as f64)
            .collect();
        for c0 in (0..t_len).step_by(chunk) {
            let n = chunk.min(t_len - c0);
            let qk: Vec<_> = (c0..c0 + n).map(|t| qk_hat(s, qkv, t, h)).collect();
            let bt: Vec<f64> = (c0..c0 + n).map(|t| beta[t * hv + h] as f64).collect();
            let mut gc = vec![0f64; n];
            let mut acc = 0f64;
            for i in 0..n {
                acc += g[(c0 + i) * hv + h] as f64;
                gc[i] = acc;
            }
            let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
            // Right-hand sides [βV | β e^G K̂] (n × (d_v + d_k)), solved in place.
            let w = dv + dk;
            let mut x = vec![0f64; n * w];
            for i in 0..n {
                let v = &qkv[(c0 + i) * cd + s.v_col(h)..][..dv];
                for j in 0..dv {
                    x[i * w + j] = bt[i] * v[j] as f64;
                }
                for d in 0..dk {
                    x[i * w + dv + d] = bt[i] * gc[i].exp() * qk[i].1[d];
                }
            }
            for i in 0..n {
                for m in 0..i {
                    let a = bt[i] * (gc[i] - gc[m]).exp() * dot(&qk[i].1, &qk[m].1);
                    for c in 0..w {
                        x[i * w + c] -= a * x[m * w + c];
                    }
                }
            }
            // Δ = U − W S₀ (n × d_v).
            let mut delta = vec![0f64; n * dv];
            for i in 0..n {
                for j in 0..dv {
                    let ws: f64 = (0..dk).map(|d| x[i * w + dv + d] * st[d * dv + j]).sum();
                    delta[i * dv + j] = x[i * w + j] - ws;
                }
            }
            for i in 0..n {
                let e = gc[i].exp();
                let p: Vec<f64> = (0..=i)
                    .map(|j| (gc[i] - gc[j]).exp() * dot(&qk[i].0, &qk[j].1))
                    .collect();
                for jv in 0..dv {
                    let inter: f64 = (0..dk).map(|d| qk[i].0[d] * st[d * dv + jv]).sum();
                    let intra: f64 = (0..=i).map(|j| p[j] * delta[j * dv + jv]).sum();
                    o[((c0 + i) * hv + h) * dv + jv] = (e * inter + intra) as f32;
                }
            }
            let gl = gc[n - 1];
            for d in 0..dk {
                for jv in 0..dv {
                    let add: f64 = (0..n)
                        .map(|j| (gl - gc[j]).exp() * qk[j].1[d] * delta[j * dv + jv])
                        .sum();
                    st[d * dv + jv] = gl.exp() * st[d * dv + jv] + add;
                }
            }
        }
        for (d, &x) in state[h * dk * dv..(h + 1) * dk * dv].iter_mut().zip(&st) {
            *d = x as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn conv_prefill_equals_steps() {
        let (c, k, t) = (7, 4, 9);
        let mut sd = 1;
        let x: Vec<f32> = (0..t * c).map(|_| lcg(&mut sd)).collect();
        let w: Vec<f32> = (0..c * k).map(|_| lcg(&mut sd)).collect();
        let st0: Vec<f32> = (0..(k - 1) * c).map(|_| lcg(&mut sd)).collect();
        let (mut s1, mut s2) = (st0.clone(), st0);
        let mut y1 = vec![0f32; t * c];
        conv1d(&x, &w, k, &mut s1, &mut y1);
        let mut y2 = vec![0f32; t * c];
        for ti in 0..t {
            conv1d(&x[ti * c..][..c], &w, k, &mut s2, &mut y2[ti * c..][..c]);
        }
        assert_eq!(y1, y2);
        assert_eq!(s1, s2);
        assert_eq!(&s1[..], &x[(t - 3) * c..]);
    }

    #[test]
    fn chunked_equals_recurrent() {
        for map in [KeyHeadMap::Repeat, KeyHeadMap::Tile] {
            let s = GdnShape {
                n_head_k: 2,
                n_head_v: 4,
                d_k: 8,
                d_v: 6,
                map,
            };
            let t = 23;
            let mut sd = 7;
            let qkv: Vec<f32> = (0..t * s.conv_dim()).map(|_| lcg(&mut sd)).collect();
            let g: Vec<f32> = (0..t * 4).map(|_| -0.3 * (lcg(&mut sd) + 1.0)).collect();
            let beta: Vec<f32> = (0..t * 4).map(|_| 0.5 * (lcg(&mut sd) + 1.0)).collect();
            let st0: Vec<f32> = (0..s.state_len()).map(|_| lcg(&mut sd)).collect();
            let (mut s1, mut s2) = (st0.clone(), st0);
            let (mut o1, mut o2) = (vec![0f32; t * 24], vec![0f32; t * 24]);
            recurrent(&s, &qkv, &g, &beta, &mut s1, &mut o1);
            chunked(&s, &qkv, &g, &beta, &mut s2, &mut o2, 5);
            for (a, b) in o1.iter().zip(&o2).chain(s1.iter().zip(&s2)) {
                assert!((a - b).abs() <= 1e-6 * (1.0 + a.abs()), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn softplus_matches_definition() {
        for x in [-30.0, -5.0, -0.1, 0.0, 0.7, 19.9, 25.0] {
            let want = if x > 20.0 {
                x
            } else {
                (1.0 + f64::exp(x)).ln()
            };
            assert!(
                (softplus(x) - want).abs() <= 1e-12 * (1.0 + want.abs()) + 1e-14,
                "{x}"
            );
        }
    }
}
