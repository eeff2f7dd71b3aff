//! The f32 GGUFs of the fixtures equal their HF checkpoints after lathe's own name mapping and
//! the converter's value transforms: copies and `1+w` norms bit for bit, `ssm_a = -exp(A_log)`
//! to the last bit (≤ 1 ulp: torch's and Rust's `exp` may round the last bit differently),
//! and qwen35's value-head reordering (llama.cpp's converter permutes value heads so that
//! value head `h` reads key head `h % Hk`; HF repeats key heads, `h / (Hv/Hk)`).

use lathe::models::qwen35::cpu::{CpuModel, Mat};
use lathe::models::qwen35::weights::{Ffn, Mixer};
use lathe::models::qwen35::HeadMap;
use lathe::models::ModelFile;
use std::path::Path;

fn load(p: &Path) -> CpuModel {
    CpuModel::load(&ModelFile::open(p).unwrap()).unwrap()
}

fn ulps(a: f32, b: f32) -> u32 {
    (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
}

fn same(what: &str, g: &Mat, h: &[f32], max_ulp: u32) {
    assert_eq!(g.data.len(), h.len(), "{what}: sizes differ");
    for (i, (a, b)) in g.data.iter().zip(h).enumerate() {
        assert!(ulps(*a, *b) <= max_ulp, "{what}[{i}]: gguf {a} vs hf {b}");
    }
}

/// HF value head for lathe-GGUF value head `j` (qwen35 reorder): j = a·Hk + g ↔ g·r + a.
fn hf_head(j: usize, hk: usize, hv: usize) -> usize {
    let r = hv / hk;
    let (a, g) = (j / hk, j % hk);
    g * r + a
}

/// Rows of `m` ([rows, cols]) in blocks of `blk` rows, block j taken from block perm(j).
fn permute_rows(
    m: &Mat,
    blk: usize,
    first: usize,
    n_blocks: usize,
    perm: &dyn Fn(usize) -> usize,
) -> Vec<f32> {
    let cols = *m.shape.last().unwrap() as usize;
    let mut out = m.data.clone();
    for j in 0..n_blocks {
        let src = first + perm(j) * blk;
        let dst = first + j * blk;
        out[dst * cols..(dst + blk) * cols]
            .copy_from_slice(&m.data[src * cols..(src + blk) * cols]);
    }
    out
}

/// Columns of `m` in blocks of `blk` columns, block j taken from block perm(j).
fn permute_cols(m: &Mat, blk: usize, n_blocks: usize, perm: &dyn Fn(usize) -> usize) -> Vec<f32> {
    let cols = *m.shape.last().unwrap() as usize;
    let rows = m.data.len() / cols;
    let mut out = m.data.clone();
    for r in 0..rows {
        for j in 0..n_blocks {
            let (s, d) = (perm(j) * blk, j * blk);
            out[r * cols + d..r * cols + d + blk]
                .copy_from_slice(&m.data[r * cols + s..r * cols + s + blk]);
        }
    }
    out
}

fn check(name: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name);
    let g = load(&dir.join("model-f32.gguf"));
    let h = load(&dir);
    let hp = &g.hp;
    let reorder = hp.head_map == HeadMap::Mod;
    assert_eq!(h.hp.head_map, HeadMap::Div);
    let (hk, hv, dk, dv) = (hp.n_k_heads, hp.n_v_heads, hp.d_k, hp.d_v);
    let perm = move |j: usize| if reorder { hf_head(j, hk, hv) } else { j };
    same("token_embd", &g.w.tok_embd, &h.w.tok_embd.data, 0);
    same(
        "output_norm (1+w)",
        &g.w.output_norm,
        &h.w.output_norm.data,
        0,
    );
    match (&g.w.output, &h.w.output) {
        (Some(a), Some(b)) => same("output", a, &b.data, 0),
        (None, None) => {}
        _ => panic!("{name}: one format ties the head, the other does not"),
    }
    for (l, (gl, hl)) in g.w.layers.iter().zip(&h.w.layers).enumerate() {
        let t = |s: &str| format!("{name} layer {l} {s}");
        same(&t("attn_norm"), &gl.attn_norm, &hl.attn_norm.data, 0);
        same(&t("post_norm"), &gl.post_norm, &hl.post_norm.data, 0);
        match (&gl.mixer, &hl.mixer) {
            (Mixer::Gdn(a), Mixer::Gdn(b)) => {
                let v0 = 2 * hk * dk;
                same(
                    &t("qkv"),
                    &a.qkv,
                    &permute_rows(&b.qkv, dv, v0, hv, &perm),
                    0,
                );
                same(
                    &t("conv"),
                    &a.conv,
                    &permute_rows(&b.conv, dv, v0, hv, &perm),
                    0,
                );
                same(&t("z"), &a.z, &permute_rows(&b.z, dv, 0, hv, &perm), 0);
                same(
                    &t("beta"),
                    &a.beta,
                    &permute_rows(&b.beta, 1, 0, hv, &perm),
                    0,
                );
                same(
                    &t("alpha"),
                    &a.alpha,
                    &permute_rows(&b.alpha, 1, 0, hv, &perm),
                    0,
                );
                let pv = |m: &Mat| (0..hv).map(|j| m.data[perm(j)]).collect::<Vec<f32>>();
                same(&t("ssm_a = -exp(A_log)"), &a.a, &pv(&b.a), 1);
                same(&t("dt_bias"), &a.dt_bias, &pv(&b.dt_bias), 0);
                same(&t("ssm_norm"), &a.norm, &b.norm.data, 0);
                same(
                    &t("ssm_out"),
                    &a.out,
                    &permute_cols(&b.out, dv, hv, &perm),
                    0,
                );
            }
            (Mixer::Attn(a), Mixer::Attn(b)) => {
                for (s, x, y) in [
                    ("q", &a.q, &b.q),
                    ("k", &a.k, &b.k),
                    ("v", &a.v, &b.v),
                    ("o", &a.o, &b.o),
                ] {
                    same(&t(s), x, &y.data, 0);
                }
                same(&t("q_norm (1+w)"), &a.q_norm, &b.q_norm.data, 0);
                same(&t("k_norm (1+w)"), &a.k_norm, &b.k_norm.data, 0);
            }
            _ => panic!("{name} layer {l}: layer kinds differ"),
        }
        match (&gl.ffn, &hl.ffn) {
            (
                Ffn::Dense { gate, up, down },
                Ffn::Dense {
                    gate: g2,
                    up: u2,
                    down: d2,
                },
            ) => {
                same(&t("ffn_gate"), gate, &g2.data, 0);
                same(&t("ffn_up"), up, &u2.data, 0);
                same(&t("ffn_down"), down, &d2.data, 0);
            }
            (Ffn::Moe(a), Ffn::Moe(b)) => {
                same(&t("router"), &a.router, &b.router.data, 0);
                same(&t("gate_exps"), &a.gate_exps, &b.gate_exps.data, 0);
                same(&t("up_exps"), &a.up_exps, &b.up_exps.data, 0);
                same(&t("down_exps"), &a.down_exps, &b.down_exps.data, 0);
                let ((g1, u1, d1, i1), (g2, u2, d2, i2)) =
                    (a.shared.as_ref().unwrap(), b.shared.as_ref().unwrap());
                same(&t("shexp gate"), g1, &g2.data, 0);
                same(&t("shexp up"), u1, &u2.data, 0);
                same(&t("shexp down"), d1, &d2.data, 0);
                same(&t("shexp gate_inp"), i1, &i2.data, 0);
            }
            _ => panic!("{name} layer {l}: FFN kinds differ"),
        }
    }
}

#[test]
fn qwen35_gguf_equals_hf() {
    check("qwen35-tiny");
}

#[test]
fn qwen35moe_gguf_equals_hf() {
    check("qwen35moe-tiny");
}

#[test]
fn qwen3next_gguf_equals_hf() {
    check("qwen3next-tiny");
}
