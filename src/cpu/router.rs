//! CPU reference of the score-function MoE router (`gpu::router`), model.py `Gate`.

use super::ops::sigmoid;

/// Score function (model.py `score_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreFn {
    Softmax,
    Sigmoid,
    SqrtSoftplus,
}

/// One token's router: `(ids, weights)` of `k` experts from `logits` [n_exp]. `hash`: the
/// ids to use (table row), else the top `k` of score + `bias` (ties to the lower index).
pub fn route(
    logits: &[f32],
    k: usize,
    func: ScoreFn,
    bias: Option<&[f32]>,
    hash: Option<&[u32]>,
    renorm: bool,
    route_scale: f32,
) -> (Vec<u32>, Vec<f32>) {
    let scores: Vec<f32> = match func {
        ScoreFn::Sigmoid => logits.iter().map(|v| sigmoid(*v)).collect(),
        ScoreFn::SqrtSoftplus => logits
            .iter()
            .map(|&v| {
                let sp = if v > 20.0 {
                    v as f64
                } else {
                    (v as f64).exp().ln_1p()
                };
                sp.sqrt() as f32
            })
            .collect(),
        ScoreFn::Softmax => {
            let mx = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let ex: Vec<f64> = logits.iter().map(|v| ((v - mx) as f64).exp()).collect();
            let s: f64 = ex.iter().sum();
            ex.iter().map(|v| (v / s) as f32).collect()
        }
    };
    let ids: Vec<u32> = match hash {
        Some(h) => h[..k].to_vec(),
        None => {
            let sel: Vec<f32> = match bias {
                Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                None => scores.clone(),
            };
            let mut idx: Vec<u32> = (0..sel.len() as u32).collect();
            idx.sort_by(|a, b| sel[*b as usize].total_cmp(&sel[*a as usize]).then(a.cmp(b)));
            idx.truncate(k);
            idx
        }
    };
    let mut w: Vec<f32> = ids.iter().map(|&i| scores[i as usize]).collect();
    let s: f64 = w.iter().map(|v| *v as f64).sum();
    for v in &mut w {
        *v = if renorm {
            (*v as f64 / s) as f32 * route_scale
        } else {
            *v * route_scale
        };
    }
    (ids, w)
}

/// `y[t] += Σ_s w[t·k + s]·x[t·k + s]` (rows of `n_embd`), slots in order, in f32 as the GPU
/// adds them.
pub fn combine(y: &mut [f32], w: &[f32], x: &[f32], k: usize, n_embd: usize) {
    for (t, yt) in y.chunks_mut(n_embd).enumerate() {
        for (d, v) in yt.iter_mut().enumerate() {
            for s in 0..k {
                *v += w[t * k + s] * x[(t * k + s) * n_embd + d];
            }
        }
    }
}

/// `w[i] *= scale[ids[i]]` (ids past `scale` keep their weight), in f32 as the GPU's
/// `expert_scale` does: Gemma-4's per-expert output scales on a router's chosen weights.
pub fn expert_scale(w: &mut [f32], ids: &[u32], scale: &[f32]) {
    for (w, &e) in w.iter_mut().zip(ids) {
        if let Some(s) = scale.get(e as usize) {
            *w *= s;
        }
    }
}
