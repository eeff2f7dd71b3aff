//! Plain CPU reference forward in f32, one token at a time (the recurrent form of every
//! layer). It is the oracle the GPU forward is checked against layer by layer; it is not
//! meant to be fast.

use super::weights::{self, Ffn, Mixer, Weights};
use super::{Hparams, ModelFile};
use crate::cpu::ops;
use crate::Result;

/// A dequantized weight: `data` row-major with `shape` outermost first.
pub struct Mat {
    pub shape: Vec<u64>,
    pub data: Vec<f32>,
}

impl Mat {
    fn cols(&self) -> usize {
        *self.shape.last().unwrap() as usize
    }
    /// y = W x for a [rows, cols] matrix (or matrix `e` of a stack).
    fn mv_at(&self, e: usize, x: &[f32]) -> Vec<f32> {
        let c = self.cols();
        let rows = self.shape[self.shape.len() - 2] as usize;
        let base = e * rows * c;
        (0..rows)
            .map(|r| {
                let w = &self.data[base + r * c..base + (r + 1) * c];
                w.iter()
                    .zip(x)
                    .map(|(a, b)| (*a as f64) * (*b as f64))
                    .sum::<f64>() as f32
            })
            .collect()
    }
    fn mv(&self, x: &[f32]) -> Vec<f32> {
        self.mv_at(0, x)
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Per-layer recurrent state of one sequence.
enum LayerState {
    Gdn {
        /// Last K-1 conv inputs, [K-1][conv_dim], oldest first.
        conv: Vec<Vec<f32>>,
        /// [Hv][dk·dv], S[i][j] at i·dv + j.
        s: Vec<Vec<f32>>,
    },
    Attn {
        /// Per position: [n_head_kv·head_dim] keys (after norm + RoPE) and values.
        k: Vec<Vec<f32>>,
        v: Vec<Vec<f32>>,
    },
}

pub struct CpuModel {
    pub hp: Hparams,
    pub w: Weights<Mat>,
}

pub struct CpuSeq {
    layers: Vec<LayerState>,
    pos: usize,
}

impl CpuModel {
    pub fn load(file: &ModelFile) -> Result<CpuModel> {
        let hp = Hparams::from_file(file)?;
        let w = weights::load(file, &hp, |w| {
            Ok(Mat {
                shape: w.shape().to_vec(),
                data: w.to_f32()?,
            })
        })?;
        Ok(CpuModel { hp, w })
    }

    pub fn new_seq(&self) -> CpuSeq {
        let hp = &self.hp;
        let layers = (0..hp.n_layer)
            .map(|l| {
                if hp.recurrent[l] {
                    LayerState::Gdn {
                        conv: vec![vec![0.0; hp.conv_dim()]; hp.conv_kernel - 1],
                        s: vec![vec![0.0; hp.d_k * hp.d_v]; hp.n_v_heads],
                    }
                } else {
                    LayerState::Attn {
                        k: vec![],
                        v: vec![],
                    }
                }
            })
            .collect();
        CpuSeq { layers, pos: 0 }
    }

    /// Run one token; returns its logits [n_vocab].
    pub fn step(&self, seq: &mut CpuSeq, token: u32) -> Vec<f32> {
        self.step_traced(seq, token, &mut |_, _| {})
    }

    /// `step`, calling `trace(layer, residual)` after each layer (a debugging hook to diff
    /// against the GPU forward's `trace`).
    pub fn step_traced(
        &self,
        seq: &mut CpuSeq,
        token: u32,
        trace: &mut dyn FnMut(usize, &[f32]),
    ) -> Vec<f32> {
        let h = self.hidden_traced(seq, token, trace);
        self.w.output.as_ref().unwrap_or(&self.w.tok_embd).mv(&h)
    }

    /// Run one token; returns its final-norm hidden state [n_embd], the head's input (what
    /// the GPU forward's `Forward::hidden_out` hands back).
    pub fn hidden(&self, seq: &mut CpuSeq, token: u32) -> Vec<f32> {
        self.hidden_traced(seq, token, &mut |_, _| {})
    }

    fn hidden_traced(
        &self,
        seq: &mut CpuSeq,
        token: u32,
        trace: &mut dyn FnMut(usize, &[f32]),
    ) -> Vec<f32> {
        let hp = &self.hp;
        let e = hp.n_embd;
        let t = token as usize;
        let mut x = self.w.tok_embd.data[t * e..(t + 1) * e].to_vec();
        for (l, lw) in self.w.layers.iter().enumerate() {
            let h = ops::rms_norm(
                &x,
                lw.attn_norm.data.len(),
                Some(&lw.attn_norm.data),
                hp.eps,
            );
            let mix = match (&lw.mixer, &mut seq.layers[l]) {
                (Mixer::Gdn(g), LayerState::Gdn { conv, s }) => self.gdn(g, &h, conv, s),
                (Mixer::Attn(a), LayerState::Attn { k, v }) => self.attn(a, &h, k, v, seq.pos),
                _ => unreachable!("layer state kind matches the layer"),
            };
            for i in 0..e {
                x[i] += mix[i];
            }
            let h = ops::rms_norm(
                &x,
                lw.post_norm.data.len(),
                Some(&lw.post_norm.data),
                hp.eps,
            );
            let f = self.ffn(&lw.ffn, &h);
            for i in 0..e {
                x[i] += f[i];
            }
            trace(l, &x);
        }
        seq.pos += 1;
        ops::rms_norm(
            &x,
            self.w.output_norm.data.len(),
            Some(&self.w.output_norm.data),
            hp.eps,
        )
    }

    fn gdn(
        &self,
        g: &weights::Gdn<Mat>,
        x: &[f32],
        conv: &mut Vec<Vec<f32>>,
        s: &mut [Vec<f32>],
    ) -> Vec<f32> {
        let hp = &self.hp;
        let (hk, hv, dk, dv) = (hp.n_k_heads, hp.n_v_heads, hp.d_k, hp.d_v);
        let cd = hp.conv_dim();
        let kk = hp.conv_kernel;
        let qkv_in = g.qkv.mv(x);
        // Causal depthwise conv over [past K-1 inputs, this input], then SiLU.
        let mut qkv = vec![0f32; cd];
        for c in 0..cd {
            let mut acc = 0f64;
            for (j, past) in conv.iter().enumerate() {
                acc += g.conv.data[c * kk + j] as f64 * past[c] as f64;
            }
            acc += g.conv.data[c * kk + kk - 1] as f64 * qkv_in[c] as f64;
            qkv[c] = silu(acc as f32);
        }
        conv.remove(0);
        conv.push(qkv_in);
        let z = g.z.mv(x);
        let b = g.beta.mv(x);
        let a = g.alpha.mv(x);
        let l2 = |v: &[f32]| {
            let n = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>();
            let r = 1.0 / (n + 1e-6).sqrt();
            v.iter()
                .map(|x| (*x as f64 * r) as f32)
                .collect::<Vec<f32>>()
        };
        let mut o = vec![0f32; hv * dv];
        for h in 0..hv {
            let kh = hp.head_map.key_head(h, hk, hv);
            let q = l2(&qkv[kh * dk..(kh + 1) * dk]);
            let k = l2(&qkv[hk * dk + kh * dk..hk * dk + (kh + 1) * dk]);
            let v = &qkv[2 * hk * dk + h * dv..2 * hk * dk + (h + 1) * dv];
            let scale = 1.0 / (dk as f32).sqrt();
            let beta = sigmoid(b[h]);
            let gg = g.a.data[h] * softplus(a[h] + g.dt_bias.data[h]);
            let decay = gg.exp();
            let st = &mut s[h];
            for x in st.iter_mut() {
                *x *= decay;
            }
            for j in 0..dv {
                let mut kv = 0f32;
                for i in 0..dk {
                    kv += st[i * dv + j] * k[i];
                }
                let delta = beta * (v[j] - kv);
                for i in 0..dk {
                    st[i * dv + j] += k[i] * delta;
                }
            }
            for j in 0..dv {
                let mut acc = 0f32;
                for i in 0..dk {
                    acc += st[i * dv + j] * q[i] * scale;
                }
                o[h * dv + j] = acc;
            }
        }
        // Gated RMSNorm per value head: w ⊙ rmsnorm(o_h) ⊙ silu(z_h).
        for h in 0..hv {
            let n = ops::rms_norm(
                &o[h * dv..(h + 1) * dv],
                g.norm.data.len(),
                Some(&g.norm.data),
                hp.eps,
            );
            for j in 0..dv {
                o[h * dv + j] = n[j] * silu(z[h * dv + j]);
            }
        }
        g.out.mv(&o)
    }

    fn attn(
        &self,
        a: &weights::Attn<Mat>,
        x: &[f32],
        kc: &mut Vec<Vec<f32>>,
        vc: &mut Vec<Vec<f32>>,
        pos: usize,
    ) -> Vec<f32> {
        let hp = &self.hp;
        let (nh, nkv, hd) = (hp.n_head, hp.n_head_kv, hp.head_dim);
        let qg = a.q.mv(x);
        let mut k = a.k.mv(x);
        let v = a.v.mv(x);
        let mut q = vec![0f32; nh * hd];
        let mut gate = vec![0f32; nh * hd];
        for h in 0..nh {
            q[h * hd..(h + 1) * hd].copy_from_slice(&qg[h * 2 * hd..h * 2 * hd + hd]);
            gate[h * hd..(h + 1) * hd].copy_from_slice(&qg[h * 2 * hd + hd..(h + 1) * 2 * hd]);
        }
        let rope = |v: &mut [f32]| {
            // NEOX halves on the leading n_rot dims.
            let half = hp.n_rot / 2;
            for i in 0..half {
                let freq = (hp.rope_theta as f64).powf(-2.0 * i as f64 / hp.n_rot as f64);
                let ang = pos as f64 * freq;
                let (sn, cs) = (ang.sin() as f32, ang.cos() as f32);
                let (x0, x1) = (v[i], v[i + half]);
                v[i] = x0 * cs - x1 * sn;
                v[i + half] = x0 * sn + x1 * cs;
            }
        };
        for h in 0..nh {
            let n = ops::rms_norm(
                &q[h * hd..(h + 1) * hd],
                a.q_norm.data.len(),
                Some(&a.q_norm.data),
                hp.eps,
            );
            q[h * hd..(h + 1) * hd].copy_from_slice(&n);
            rope(&mut q[h * hd..(h + 1) * hd]);
        }
        for h in 0..nkv {
            let n = ops::rms_norm(
                &k[h * hd..(h + 1) * hd],
                a.k_norm.data.len(),
                Some(&a.k_norm.data),
                hp.eps,
            );
            k[h * hd..(h + 1) * hd].copy_from_slice(&n);
            rope(&mut k[h * hd..(h + 1) * hd]);
        }
        kc.push(k);
        vc.push(v);
        let mut out = vec![0f32; nh * hd];
        let scale = 1.0 / (hd as f64).sqrt();
        for h in 0..nh {
            let kvh = h / (nh / nkv);
            let qh = &q[h * hd..(h + 1) * hd];
            let scores: Vec<f64> = kc
                .iter()
                .map(|kk| {
                    qh.iter()
                        .zip(&kk[kvh * hd..(kvh + 1) * hd])
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let ex: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let sum: f64 = ex.iter().sum();
            for j in 0..hd {
                let acc: f64 = ex
                    .iter()
                    .zip(vc.iter())
                    .map(|(p, vv)| p * vv[kvh * hd + j] as f64)
                    .sum();
                out[h * hd + j] = (acc / sum) as f32 * sigmoid(gate[h * hd + j]);
            }
        }
        a.o.mv(&out)
    }

    fn ffn(&self, f: &Ffn<Mat>, x: &[f32]) -> Vec<f32> {
        match f {
            Ffn::Dense { gate, up, down } => {
                let g = gate.mv(x);
                let u = up.mv(x);
                let h: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
                down.mv(&h)
            }
            Ffn::Moe(m) => {
                let mp = self.hp.moe.as_ref().expect("MoE layer in a MoE model");
                let logits = m.router.mv(x);
                let mx = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let ex: Vec<f64> = logits.iter().map(|l| ((l - mx) as f64).exp()).collect();
                let sum: f64 = ex.iter().sum();
                let probs: Vec<f64> = ex.iter().map(|e| e / sum).collect();
                let mut idx: Vec<usize> = (0..probs.len()).collect();
                idx.sort_by(|a, b| probs[*b].partial_cmp(&probs[*a]).unwrap().then(a.cmp(b)));
                let top = &idx[..mp.n_used];
                let tsum: f64 = top.iter().map(|i| probs[*i]).sum();
                let mut y = vec![0f32; x.len()];
                for &ex_i in top {
                    let wgt = if mp.norm_topk {
                        probs[ex_i] / tsum
                    } else {
                        probs[ex_i]
                    } as f32;
                    let g = m.gate_exps.mv_at(ex_i, x);
                    let u = m.up_exps.mv_at(ex_i, x);
                    let h: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
                    let d = m.down_exps.mv_at(ex_i, &h);
                    for i in 0..y.len() {
                        y[i] += wgt * d[i];
                    }
                }
                if let Some((g, u, d, gi)) = &m.shared {
                    let gg = g.mv(x);
                    let uu = u.mv(x);
                    let h: Vec<f32> = gg.iter().zip(&uu).map(|(g, u)| silu(*g) * u).collect();
                    let dd = d.mv(&h);
                    let s = sigmoid(gi.mv(x)[0]);
                    for i in 0..y.len() {
                        y[i] += s * dd[i];
                    }
                }
                y
            }
        }
    }
}
