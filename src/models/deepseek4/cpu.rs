//! Plain CPU reference forward in f32 (f64 sums), one token at a time. It reproduces
//! DeepSeek's `inference/model.py` without its optional low-precision simulations (FP8 KV
//! rounding, FP4 indexer q/k, FP8 activations): the exact math the fixtures' reference
//! computes. It is the oracle the GPU forward is checked against; it is not meant to be fast.
//!
//! Per token and layer (model.py `Block.forward`):
//!   hc_pre → attn_norm → attention → hc_post → hc_pre → ffn_norm → MoE → hc_post,
//! with the hidden state kept as `hc` copies, folded to one vector by the head's own gate.

use super::weights::{self, Attn, Compressor, Hc, Moe, Weights};
use super::{Hparams, ModelFile, ScoreFunc};
use crate::cpu::ops;
use crate::{Error, Result};
use rayon::prelude::*;

/// A dequantized weight: `data` row-major with `shape` outermost first.
pub struct Mat {
    pub shape: Vec<u64>,
    pub data: Vec<f32>,
}

/// Matvecs with at least this many weights split their rows over rayon's threads.
const PAR_MIN_WEIGHTS: usize = 1 << 16;

impl Mat {
    fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1) as usize
    }
    fn rows(&self) -> usize {
        if self.shape.len() < 2 {
            1
        } else {
            self.shape[self.shape.len() - 2] as usize
        }
    }
    /// y = W x for a [rows, cols] matrix, or matrix `e` of a [n, rows, cols] stack.
    fn mv_at(&self, e: usize, x: &[f32]) -> Vec<f32> {
        let (rows, c) = (self.rows(), self.cols());
        debug_assert_eq!(x.len(), c);
        let w = &self.data[e * rows * c..(e + 1) * rows * c];
        let dot = |r: &[f32]| {
            r.iter()
                .zip(x)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32
        };
        if rows * c >= PAR_MIN_WEIGHTS {
            w.par_chunks(c).map(dot).collect()
        } else {
            w.chunks(c).map(dot).collect()
        }
    }
    fn mv(&self, x: &[f32]) -> Vec<f32> {
        self.mv_at(0, x)
    }
    fn row(&self, r: usize) -> &[f32] {
        let c = self.cols();
        &self.data[r * c..(r + 1) * c]
    }
}

fn rms_scale(x: &[f32], eps: f32) -> f64 {
    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    1.0 / (ms + eps as f64).sqrt()
}

fn sigmoid(x: f32) -> f32 {
    (1.0 / (1.0 + (-(x as f64)).exp())) as f32
}
fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}
/// torch's `F.softplus` (linear above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (x as f64).exp().ln_1p() as f32
    }
}

/// Interleaved RoPE on the LAST `2·freqs.len()` dims of `v`: pairs (2i, 2i+1) rotate by
/// `pos·freqs[i]` (model.py `apply_rotary_emb` views adjacent pairs as complex numbers);
/// `inverse` rotates back (the conjugate). The angle is an f32 product, as the references
/// compute it.
fn rope_tail(v: &mut [f32], freqs: &[f32], pos: usize, inverse: bool) {
    let base = v.len() - 2 * freqs.len();
    for (i, f) in freqs.iter().enumerate() {
        let ang = (pos as f32 * f) as f64;
        let (s, c) = (ang.sin() as f32, ang.cos() as f32);
        let s = if inverse { -s } else { s };
        let (a, b) = (v[base + 2 * i], v[base + 2 * i + 1]);
        v[base + 2 * i] = a * c - b * s;
        v[base + 2 * i + 1] = a * s + b * c;
    }
}

/// Sinkhorn split of the hyper-connection mixes (model.py `hc_split_sinkhorn`):
/// `pre = σ(m·s0 + b) + eps`, `post = 2σ(m·s1 + b)`, `comb = softmax_rows(m·s2 + b) + eps`,
/// normalised over columns once, then `iters−1` rounds of rows then columns (sums + eps).
/// `comb[i·hc + j]` sends copy i to new copy j.
fn hc_split_sinkhorn(
    mixes: &[f32],
    scale: &[f32],
    base: &[f32],
    hc: usize,
    iters: usize,
    eps: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let pre = (0..hc)
        .map(|j| sigmoid(mixes[j] * scale[0] + base[j]) + eps)
        .collect();
    let post = (0..hc)
        .map(|j| 2.0 * sigmoid(mixes[hc + j] * scale[1] + base[hc + j]))
        .collect();
    let mut comb: Vec<f32> = (0..hc * hc)
        .map(|k| mixes[2 * hc + k] * scale[2] + base[2 * hc + k])
        .collect();
    for row in comb.chunks_mut(hc) {
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let ex: Vec<f64> = row.iter().map(|v| ((*v - m) as f64).exp()).collect();
        let sum: f64 = ex.iter().sum();
        for (v, e) in row.iter_mut().zip(&ex) {
            *v = (e / sum) as f32 + eps;
        }
    }
    let norm_cols = |c: &mut [f32]| {
        for j in 0..hc {
            let s: f32 = (0..hc).map(|i| c[i * hc + j]).sum::<f32>() + eps;
            for i in 0..hc {
                c[i * hc + j] /= s;
            }
        }
    };
    let norm_rows = |c: &mut [f32]| {
        for row in c.chunks_mut(hc) {
            let s: f32 = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|v| *v /= s);
        }
    };
    norm_cols(&mut comb);
    for _ in 1..iters {
        norm_rows(&mut comb);
        norm_cols(&mut comb);
    }
    (pre, post, comb)
}

/// One compressor's running state.
#[derive(Clone, Default)]
struct CmpState {
    /// Pooled entries so far, normed and rotated: entry i covers window i, [d] each.
    entries: Vec<Vec<f32>>,
    /// The window being filled: kv and ape-biased scores per token, [coff·d] each.
    cur_kv: Vec<Vec<f32>>,
    cur_score: Vec<Vec<f32>>,
    /// Overlapping compressors: the previous complete window (empty before the first).
    prev_kv: Vec<Vec<f32>>,
    prev_score: Vec<Vec<f32>>,
}

/// Per-layer attention state of one sequence.
#[derive(Clone)]
struct LayerState {
    /// Ring of the last `window` K=V rows (normed, rotated): position p in slot p % window.
    window: Vec<Vec<f32>>,
    cmp: Option<CmpState>,
    ix: Option<CmpState>,
}

/// One sequence: everything decode needs to continue exactly from any prefix. Clone it to
/// fork a prefix.
#[derive(Clone)]
pub struct CpuSeq {
    layers: Vec<LayerState>,
    pos: usize,
}

impl CpuSeq {
    /// Tokens consumed so far.
    pub fn pos(&self) -> usize {
        self.pos
    }
}

pub struct CpuModel {
    pub hp: Hparams,
    pub w: Weights<Mat>,
    /// Per layer RoPE frequencies (`n_rot / 2`).
    freqs: Vec<Vec<f32>>,
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
        let freqs = (0..hp.n_layer).map(|l| hp.rope_freqs(l)).collect();
        Ok(CpuModel { hp, w, freqs })
    }

    pub fn new_seq(&self) -> CpuSeq {
        let layers = (0..self.hp.n_layer)
            .map(|l| LayerState {
                window: vec![Vec::new(); self.hp.window],
                cmp: (self.hp.compress_ratio[l] > 0).then(CmpState::default),
                ix: self.hp.has_indexer(l).then(CmpState::default),
            })
            .collect();
        CpuSeq { layers, pos: 0 }
    }

    /// Run one token; returns its logits [n_vocab].
    pub fn step(&self, seq: &mut CpuSeq, token: u32) -> Result<Vec<f32>> {
        self.step_traced(seq, token, &mut |_, _, _| {})
    }

    /// [`step`](Self::step), handing every named intermediate to `trace(name, layer, data)`
    /// (layer `usize::MAX` outside the blocks): `attn_in` (the folded, normed input),
    /// `attn_out`, `ffn_in`, `moe_out`, `layer_out` ([hc·n_embd]), `head_in`, `logits`.
    pub fn step_traced(
        &self,
        seq: &mut CpuSeq,
        token: u32,
        trace: &mut dyn FnMut(&str, usize, &[f32]),
    ) -> Result<Vec<f32>> {
        let hp = &self.hp;
        let (e, hc) = (hp.n_embd, hp.hc);
        let t = token as usize;
        if t >= hp.n_vocab {
            return Err(Error::Invalid(format!(
                "token {token} is outside the vocabulary of {}",
                hp.n_vocab
            )));
        }
        let emb = self.w.tok_embd.row(t);
        // [hc][n_embd]: the embedding copied into every stream.
        let mut x: Vec<f32> = (0..hc).flat_map(|_| emb.iter().copied()).collect();
        let pos = seq.pos;
        for (l, lw) in self.w.layers.iter().enumerate() {
            let (y, post, comb) = self.hc_pre(&x, &lw.hc_attn);
            let h = ops::rms_norm(
                &y,
                lw.attn_norm.data.len(),
                Some(&lw.attn_norm.data),
                hp.eps,
            );
            trace("attn_in", l, &h);
            let a = self.attn(l, &lw.attn, &h, &mut seq.layers[l], pos);
            trace("attn_out", l, &a);
            x = hc_post(&a, &x, &post, &comb, hc);
            let (y, post, comb) = self.hc_pre(&x, &lw.hc_ffn);
            let h = ops::rms_norm(&y, lw.ffn_norm.data.len(), Some(&lw.ffn_norm.data), hp.eps);
            trace("ffn_in", l, &h);
            let f = self.moe(l, &lw.moe, &h, t);
            trace("moe_out", l, &f);
            x = hc_post(&f, &x, &post, &comb, hc);
            trace("layer_out", l, &x);
        }
        seq.pos += 1;
        // Head fold (model.py `ParallelHead.hc_head`): a sigmoid gate per copy, no Sinkhorn.
        let hh = &self.w.hc_head;
        let rs = rms_scale(&x, hp.eps);
        let mixes = hh.fn_.mv(&x);
        let mut y = vec![0f32; e];
        for j in 0..hc {
            let pre = sigmoid((mixes[j] as f64 * rs) as f32 * hh.scale.data[0] + hh.base.data[j])
                + hp.hc_eps;
            for (o, v) in y.iter_mut().zip(&x[j * e..(j + 1) * e]) {
                *o += pre * v;
            }
        }
        let h = ops::rms_norm(
            &y,
            self.w.output_norm.data.len(),
            Some(&self.w.output_norm.data),
            hp.eps,
        );
        trace("head_in", usize::MAX, &h);
        let logits = self.w.output.mv(&h);
        trace("logits", usize::MAX, &logits);
        Ok(logits)
    }

    /// model.py `Block.hc_pre`: RMS over the flattened copies (no weight) scales the mixes;
    /// returns the folded vector `Σ pre[j]·x[j]` and the `post`, `comb` weights of `hc_post`.
    fn hc_pre(&self, x: &[f32], w: &Hc<Mat>) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let hp = &self.hp;
        let e = hp.n_embd;
        let rs = rms_scale(x, hp.eps);
        let mixes: Vec<f32> = w
            .fn_
            .mv(x)
            .iter()
            .map(|m| (*m as f64 * rs) as f32)
            .collect();
        let (pre, post, comb) = hc_split_sinkhorn(
            &mixes,
            &w.scale.data,
            &w.base.data,
            hp.hc,
            hp.hc_iters,
            hp.hc_eps,
        );
        let mut y = vec![0f32; e];
        for (j, p) in pre.iter().enumerate() {
            for (o, v) in y.iter_mut().zip(&x[j * e..(j + 1) * e]) {
                *o += p * v;
            }
        }
        (y, post, comb)
    }

    fn attn(
        &self,
        l: usize,
        a: &Attn<Mat>,
        x: &[f32],
        st: &mut LayerState,
        pos: usize,
    ) -> Vec<f32> {
        let hp = &self.hp;
        let (nh, hd) = (hp.n_head, hp.head_dim);
        let freqs = &self.freqs[l];
        // q: low rank, weighted norm, up-projection, then an unweighted RMSNorm per head.
        let qr = ops::rms_norm(
            &a.wq_a.mv(x),
            a.q_norm.data.len(),
            Some(&a.q_norm.data),
            hp.eps,
        );
        let mut q = a.wq_b.mv(&qr);
        for qh in q.chunks_mut(hd) {
            let s = rms_scale(qh, hp.eps);
            qh.iter_mut().for_each(|v| *v = (*v as f64 * s) as f32);
            rope_tail(qh, freqs, pos, false);
        }
        // The one K=V head.
        let mut kv = ops::rms_norm(
            &a.wkv.mv(x),
            a.kv_norm.data.len(),
            Some(&a.kv_norm.data),
            hp.eps,
        );
        rope_tail(&mut kv, freqs, pos, false);
        st.window[pos % hp.window] = kv;

        // Compressed entries: entry i exists once window i closes, i.e. i < (pos+1)/ratio.
        if let (Some(c), Some(cs)) = (&a.cmp, st.cmp.as_mut()) {
            self.compress_step(l, c, cs, x, pos, hd);
        }
        let mut picked: Vec<usize> = Vec::new();
        if let (Some(ix), Some(is)) = (&a.ix, st.ix.as_mut()) {
            self.compress_step(l, &ix.cmp, is, x, pos, hp.ix_head_dim);
            picked = self.index_topk(ix, is, x, &qr, pos, freqs);
        } else if let Some(cs) = &st.cmp {
            picked = (0..cs.entries.len()).collect();
        }
        let comp: &[Vec<f32>] = st.cmp.as_ref().map_or(&[], |c| &c.entries);

        // Keys = values: the window (positions pos-window+1 ..= pos) and the picked entries.
        let first = (pos + 1).saturating_sub(hp.window);
        let keys: Vec<&[f32]> = (first..=pos)
            .map(|p| st.window[p % hp.window].as_slice())
            .chain(picked.iter().map(|&i| comp[i].as_slice()))
            .collect();
        let scale = 1.0 / (hd as f64).sqrt();
        let mut o = vec![0f32; nh * hd];
        for h in 0..nh {
            let qh = &q[h * hd..(h + 1) * hd];
            let scores: Vec<f64> = keys
                .iter()
                .map(|k| {
                    qh.iter()
                        .zip(*k)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            // The sink is one more logit with no value: it only enlarges the denominator.
            let sink = a.sink.data[h] as f64;
            let m = scores.iter().cloned().fold(sink, f64::max);
            let ex: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let denom = ex.iter().sum::<f64>() + (sink - m).exp();
            let oh = &mut o[h * hd..(h + 1) * hd];
            for (j, out) in oh.iter_mut().enumerate() {
                *out = (ex
                    .iter()
                    .zip(&keys)
                    .map(|(p, k)| p * k[j] as f64)
                    .sum::<f64>()
                    / denom) as f32;
            }
            // The values carry the keys' rotation: undo it at the query position.
            rope_tail(oh, freqs, pos, true);
        }
        // Grouped low-rank output: group g's heads through rows g·o_lora.. of wo_a, then wo_b.
        let per_group = nh * hd / hp.o_groups;
        let mid: Vec<f32> = (0..hp.o_groups * hp.o_lora)
            .map(|r| {
                let g = r / hp.o_lora;
                let og = &o[g * per_group..(g + 1) * per_group];
                a.wo_a
                    .row(r)
                    .iter()
                    .zip(og)
                    .map(|(w, v)| *w as f64 * *v as f64)
                    .sum::<f64>() as f32
            })
            .collect();
        a.wo_b.mv(&mid)
    }

    /// Advance one of layer `l`'s compressors (entries of `d`) by the token at `pos`
    /// (model.py `Compressor.forward`, decode branch). When the window closes, pool it per
    /// channel with a softmax over its tokens' scores (overlapping: the previous window's
    /// channels `..d` and this window's `d..`, 2m rows; before the first window the missing
    /// half is kv 0 with score −∞), then weighted RMSNorm and RoPE at the window's first
    /// position.
    fn compress_step(
        &self,
        l: usize,
        c: &Compressor<Mat>,
        s: &mut CmpState,
        x: &[f32],
        pos: usize,
        d: usize,
    ) {
        let hp = &self.hp;
        let (ratio, overlap) = (hp.compress_ratio[l], hp.overlap(l));
        let (freqs, eps) = (&self.freqs[l], hp.eps);
        let kv = c.wkv.mv(x);
        let ape = c.ape.row(pos % ratio);
        let score: Vec<f32> = c.wgate.mv(x).iter().zip(ape).map(|(s, a)| s + a).collect();
        s.cur_kv.push(kv);
        s.cur_score.push(score);
        if s.cur_kv.len() < ratio {
            return;
        }
        let mut entry = vec![0f32; d];
        let mut rows: Vec<(f32, f32)> = Vec::with_capacity(2 * ratio);
        for (ch, out) in entry.iter_mut().enumerate() {
            rows.clear();
            if overlap {
                for r in 0..ratio {
                    rows.push(match (s.prev_score.get(r), s.prev_kv.get(r)) {
                        (Some(sc), Some(kv)) => (sc[ch], kv[ch]),
                        _ => (f32::NEG_INFINITY, 0.0),
                    });
                }
                rows.extend((0..ratio).map(|r| (s.cur_score[r][d + ch], s.cur_kv[r][d + ch])));
            } else {
                rows.extend((0..ratio).map(|r| (s.cur_score[r][ch], s.cur_kv[r][ch])));
            }
            let m = rows.iter().map(|r| r.0).fold(f32::NEG_INFINITY, f32::max) as f64;
            let (mut num, mut den) = (0f64, 0f64);
            for &(sc, v) in &rows {
                let p = (sc as f64 - m).exp();
                num += p * v as f64;
                den += p;
            }
            *out = (num / den) as f32;
        }
        let mut entry = ops::rms_norm(&entry, c.norm.data.len(), Some(&c.norm.data), eps);
        rope_tail(&mut entry, freqs, pos + 1 - ratio, false);
        s.entries.push(entry);
        if overlap {
            s.prev_kv = std::mem::take(&mut s.cur_kv);
            s.prev_score = std::mem::take(&mut s.cur_score);
        } else {
            s.cur_kv.clear();
            s.cur_score.clear();
        }
    }

    /// Lightning indexer (model.py `Indexer.forward`): per entry i, `Σ_h relu(q_h·k_i)·w_h`
    /// with `w = proj(x)·ix_head_dim^-½·n_ix_head^-½`; the top `ix_topk` entries (all when
    /// fewer exist), ties to the lower index. The official Hadamard rotation of q and k
    /// cancels in the dot product and is left out.
    fn index_topk(
        &self,
        ix: &weights::Indexer<Mat>,
        is: &CmpState,
        x: &[f32],
        qr: &[f32],
        pos: usize,
        freqs: &[f32],
    ) -> Vec<usize> {
        let hp = &self.hp;
        let d = hp.ix_head_dim;
        let n = is.entries.len();
        if n == 0 {
            return Vec::new();
        }
        let mut q = ix.wq_b.mv(qr);
        for qh in q.chunks_mut(d) {
            rope_tail(qh, freqs, pos, false);
        }
        let wscale = 1.0 / ((d * hp.n_ix_head) as f64).sqrt();
        let w: Vec<f64> = ix.proj.mv(x).iter().map(|v| *v as f64 * wscale).collect();
        let scores: Vec<f64> = is
            .entries
            .iter()
            .map(|k| {
                q.chunks(d)
                    .zip(&w)
                    .map(|(qh, wh)| {
                        qh.iter()
                            .zip(k)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            .max(0.0)
                            * wh
                    })
                    .sum()
            })
            .collect();
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by(|a, b| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b)));
        idx.truncate(hp.ix_topk.min(n));
        idx.sort_unstable();
        idx
    }

    fn moe(&self, l: usize, m: &Moe<Mat>, x: &[f32], token: usize) -> Vec<f32> {
        let hp = &self.hp;
        let logits = m.router.mv(x);
        let scores: Vec<f32> = match hp.score_func {
            ScoreFunc::SqrtSoftplus => logits.iter().map(|v| softplus(*v).sqrt()).collect(),
            ScoreFunc::Sigmoid => logits.iter().map(|v| sigmoid(*v)).collect(),
            ScoreFunc::Softmax => {
                let mx = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let ex: Vec<f64> = logits.iter().map(|v| ((v - mx) as f64).exp()).collect();
                let s: f64 = ex.iter().sum();
                ex.iter().map(|v| (v / s) as f32).collect()
            }
        };
        let chosen: Vec<usize> = match (&m.tid2eid, &m.bias) {
            (Some(tab), _) => tab.row(token).iter().map(|v| *v as usize).collect(),
            (None, bias) => {
                // The bias steers which experts win, never their weights.
                let sel: Vec<f32> = match bias {
                    Some(b) => scores.iter().zip(&b.data).map(|(s, b)| s + b).collect(),
                    None => scores.clone(),
                };
                let mut idx: Vec<usize> = (0..sel.len()).collect();
                idx.sort_by(|a, b| sel[*b].total_cmp(&sel[*a]).then(a.cmp(b)));
                idx.truncate(hp.n_used);
                idx
            }
        };
        let mut wts: Vec<f32> = chosen.iter().map(|&i| scores[i]).collect();
        if hp.norm_topk {
            let s: f32 = wts.iter().sum();
            wts.iter_mut().for_each(|w| *w /= s);
        }
        wts.iter_mut().for_each(|w| *w *= hp.route_scale);
        let mut y = vec![0f64; x.len()];
        let lim = hp.swiglu_limit[l];
        for (&ex, &wt) in chosen.iter().zip(&wts) {
            let d = swiglu(&m.gate_exps, &m.up_exps, &m.down_exps, ex, x, lim);
            for (o, v) in y.iter_mut().zip(&d) {
                *o += wt as f64 * *v as f64;
            }
        }
        let sh = swiglu(
            &m.sh_gate,
            &m.sh_up,
            &m.sh_down,
            0,
            x,
            hp.swiglu_limit_shexp[l],
        );
        y.iter()
            .zip(&sh)
            .map(|(a, b)| (*a + *b as f64) as f32)
            .collect()
    }
}

/// `y[j] = post[j]·out + Σ_i comb[i][j]·x[i]` (model.py `Block.hc_post`).
fn hc_post(out: &[f32], x: &[f32], post: &[f32], comb: &[f32], hc: usize) -> Vec<f32> {
    let e = out.len();
    let mut y = vec![0f32; hc * e];
    for j in 0..hc {
        let yj = &mut y[j * e..(j + 1) * e];
        for (d, o) in yj.iter_mut().enumerate() {
            let mut acc = post[j] as f64 * out[d] as f64;
            for i in 0..hc {
                acc += comb[i * hc + j] as f64 * x[i * e + d] as f64;
            }
            *o = acc as f32;
        }
    }
    y
}

/// Clamped SwiGLU expert `e` of a stack (model.py `Expert`): `gate = min(w1x, lim)`,
/// `up = clamp(w3x, ±lim)` (lim 0: no clamp), `w2(silu(gate)·up)`.
fn swiglu(gate: &Mat, up: &Mat, down: &Mat, e: usize, x: &[f32], lim: f32) -> Vec<f32> {
    let g = gate.mv_at(e, x);
    let u = up.mv_at(e, x);
    let h: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| {
            let (g, u) = if lim > 0.0 {
                (g.min(lim), u.clamp(-lim, lim))
            } else {
                (g, u)
            };
            silu(g) * u
        })
        .collect();
    down.mv_at(e, &h)
}
