//! DeepSeek-V4's own GPU kernels against their CPU references: hyper-connections
//! (`gpu::hc` vs `cpu::hc`), the score router (`gpu::router` vs `cpu::router`), the KV
//! compressor, indexer and attention key lists (`gpu::compress` vs `cpu::compress`).
//! Sizes: odd ones (hc 3, 257-wide rows, ratio 3, 13 entries) and the release's (hc 4 ×
//! 4096, 256 experts top-6 with bias, 384 hash-routed, 512-wide entries at ratios 4 and 128,
//! indexer 64 heads × 128 choosing 512 of 1000). Tolerance: |err| ≤ 1e-4·(1 + |ref|) for
//! f32 math against the f64 references unless stated; ids and index lists exactly.

use lathe::cpu;
use lathe::gpu::attention::{INVALID, SRC_B};
use lathe::gpu::compress::{self, CmpShape, IndexList, IndexerShape};
use lathe::gpu::hc::{self, HcInput, HcShape, HcWeights};
use lathe::gpu::operand::Operand;
use lathe::gpu::rope::RopeTable;
use lathe::gpu::router::{self, RouterRows, ScoreFn, Scoring, Select};
use lathe::gpu::{AdapterChoice, Gpu, GpuTensor, Pass};
use lathe::tensor::TensorRef;
use lathe::DType;
use std::path::Path;

fn gpu() -> Gpu {
    let gpu = Gpu::new(&AdapterChoice::Auto).expect("a wgpu adapter (lavapipe in CI)");
    eprintln!("{}", gpu.report());
    gpu
}

/// xorshift64*: deterministic test data.
struct Rng(u64);
impl Rng {
    fn u32(&mut self) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) as u32
    }
    fn uniform(&mut self) -> f32 {
        self.u32() as f32 / 4294967296.0 * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| (self.uniform() + self.uniform() + self.uniform()) * scale)
            .collect()
    }
}

fn tensor(gpu: &Gpu, shape: &[u64], data: &[f32]) -> GpuTensor {
    gpu.upload_tensor(&TensorRef {
        name: "w",
        dtype: DType::F32,
        shape,
        data: bytemuck::cast_slice(data),
        path: Path::new("test"),
    })
    .unwrap()
}

fn submit(gpu: &Gpu, f: impl FnOnce(&mut Pass<'_>)) {
    let mut pass = gpu.pass();
    f(&mut pass);
    pass.submit().unwrap();
}

#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = 0f32;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= tol * (1.0 + w.abs()),
            "{what}: element {i}: got {g}, want {w} (err {err:e})"
        );
        worst = worst.max(err);
    }
    eprintln!("{what}: max abs err {worst:.2e}");
}

// ---------------------------------------------------------------------------- hyper-connections

#[test]
fn hc_pre_post_head_match_reference() {
    let gpu = gpu();
    let mut rng = Rng(7);
    for (hc_n, e, n, iters) in [
        (4usize, 64usize, 3usize, 20u32),
        (3, 257, 5, 7),
        (4, 4096, 2, 20),
    ] {
        let nm = (2 + hc_n) * hc_n;
        let x = rng.vec(n * hc_n * e, 1.0);
        let fn_mix = rng.vec(n * nm, 3.0);
        let base = rng.vec(nm, 0.5);
        let scale = rng.vec(3, 0.5);
        let norm = rng.vec(e, 1.0);
        let blk = rng.vec(n * e, 1.0);
        let (hb, hs) = (rng.vec(hc_n, 0.5), rng.vec(1, 0.5));
        let s = HcShape {
            n_embd: e as u32,
            hc: hc_n as u32,
            iters,
            eps: 1e-6,
            hc_eps: 1e-6,
        };
        let tb = tensor(&gpu, &[nm as u64], &base);
        let ts = tensor(&gpu, &[3], &scale);
        let tn = tensor(&gpu, &[e as u64], &norm);
        let thb = tensor(&gpu, &[hc_n as u64], &hb);
        let ths = tensor(&gpu, &[1], &hs);
        let xb = gpu.upload_f32(&x, "x").unwrap();
        let mb = gpu.upload_f32(&fn_mix, "mixes").unwrap();
        let hmb = gpu.upload_f32(&fn_mix[..n * hc_n], "head mixes").unwrap();
        let bb = gpu.upload_f32(&blk, "blk").unwrap();
        let h = gpu.buffer((n * e * 4) as u64, "h").unwrap();
        let hh = gpu.buffer((n * e * 4) as u64, "hh").unwrap();
        let pc = gpu
            .buffer((n * (hc_n + hc_n * hc_n) * 4) as u64, "pc")
            .unwrap();
        submit(&gpu, |p| {
            let w = HcWeights {
                base: &tb,
                scale: &ts,
                norm: &tn,
            };
            let inp = HcInput {
                n_tok: n as u32,
                x: &xb,
                mixes: &mb,
            };
            hc::pre(p, &s, inp, &w, &h, &pc).unwrap();
            let w = HcWeights {
                base: &thb,
                scale: &ths,
                norm: &tn,
            };
            let inp = HcInput {
                n_tok: n as u32,
                x: &xb,
                mixes: &hmb,
            };
            hc::head(p, &s, inp, &w, &hh).unwrap();
            hc::post(p, &s, n as u32, &xb, &bb, &pc).unwrap();
        });
        let cs = cpu::hc::HcShape {
            hc: hc_n,
            iters: iters as usize,
            eps: 1e-6,
            hc_eps: 1e-6,
        };
        let (want_h, want_pc) = cpu::hc::pre(&x, &fn_mix, &base, &scale, &norm, &cs);
        let what = format!("hc {hc_n}×{e}, {n} tokens");
        let got_pc = gpu.read_f32(&pc, 0, want_pc.len()).unwrap();
        assert_close(&format!("{what}: post/comb"), &got_pc, &want_pc, 1e-5);
        let got_h = gpu.read_f32(&h, 0, n * e).unwrap();
        assert_close(&format!("{what}: pre"), &got_h, &want_h, 1e-4);
        let want_hh = cpu::hc::head(&x, &fn_mix[..n * hc_n], &hb, hs[0], &norm, &cs);
        let got_hh = gpu.read_f32(&hh, 0, n * e).unwrap();
        assert_close(&format!("{what}: head"), &got_hh, &want_hh, 1e-4);
        // post from the GPU's own (post, comb), so the check is of the mixing alone.
        let mut want_x = x.clone();
        cpu::hc::post(&mut want_x, &blk, &got_pc, hc_n, e);
        let got_x = gpu.read_f32(&xb, 0, x.len()).unwrap();
        assert_close(&format!("{what}: post"), &got_x, &want_x, 1e-5);
        // Sinkhorn made comb doubly stochastic (up to eps and the last row pass).
        for t in 0..n {
            let c = &got_pc[t * (hc_n + hc_n * hc_n) + hc_n..][..hc_n * hc_n];
            for j in 0..hc_n {
                let col: f32 = (0..hc_n).map(|i| c[i * hc_n + j]).sum();
                assert!((col - 1.0).abs() < 1e-3, "{what}: column {j} sums to {col}");
            }
        }
    }
}

// ---------------------------------------------------------------------------- router

#[test]
fn router_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng(11);
    let cases = [
        (8usize, 2usize, ScoreFn::SqrtSoftplus, false, false),
        (256, 6, ScoreFn::SqrtSoftplus, true, false),
        (384, 8, ScoreFn::SqrtSoftplus, false, true),
        (33, 5, ScoreFn::Sigmoid, true, false),
        (64, 4, ScoreFn::Softmax, false, false),
    ];
    for (ne, k, func, with_bias, hash) in cases {
        let n = 5usize;
        let vocab = 17usize;
        let logits = rng.vec(n * ne, 2.0);
        let bias = rng.vec(ne, 0.3);
        let table: Vec<f32> = (0..vocab * k)
            .map(|i| ((i * 7 + i / k * 3) % ne) as f32)
            .collect();
        let toks: Vec<u32> = (0..n as u32).map(|t| (t * 5 + 2) % vocab as u32).collect();
        let lb = gpu.upload_f32(&logits, "logits").unwrap();
        let tb = tensor(&gpu, &[ne as u64], &bias);
        let tt = tensor(&gpu, &[vocab as u64, k as u64], &table);
        let tokb = gpu.upload(bytemuck::cast_slice(&toks), "tokens").unwrap();
        let ids = gpu.buffer((n * k * 4) as u64, "ids").unwrap();
        let wts = gpu.buffer((n * k * 4) as u64, "weights").unwrap();
        let select = if hash {
            Select::Hash {
                table: &tt,
                tokens: &tokb,
                tok_off: 0,
            }
        } else {
            Select::TopK {
                bias: with_bias.then_some(&tb),
            }
        };
        submit(&gpu, |p| {
            let rows = RouterRows {
                n_tok: n as u32,
                n_exp: ne as u32,
                k: k as u32,
                logits: Operand::new(&lb, 0),
                ids: Operand::new(&ids, 0),
                weights: Operand::new(&wts, 0),
            };
            let how = Scoring {
                func,
                select,
                renorm: true,
                route_scale: 1.5,
            };
            router::route(p, &rows, &how).unwrap()
        });
        let got_ids = gpu.read_u32(&ids, 0, n * k).unwrap();
        let got_w = gpu.read_f32(&wts, 0, n * k).unwrap();
        let cf = match func {
            ScoreFn::Softmax => cpu::router::ScoreFn::Softmax,
            ScoreFn::Sigmoid => cpu::router::ScoreFn::Sigmoid,
            ScoreFn::SqrtSoftplus => cpu::router::ScoreFn::SqrtSoftplus,
        };
        for t in 0..n {
            let row: Vec<u32> = (0..k)
                .map(|s| table[toks[t] as usize * k + s] as u32)
                .collect();
            let (wi, ww) = cpu::router::route(
                &logits[t * ne..(t + 1) * ne],
                k,
                cf,
                with_bias.then_some(&bias[..]),
                hash.then_some(&row[..]),
                true,
                1.5,
            );
            let what = format!(
                "router {ne} experts top-{k} {func:?} bias {with_bias} hash {hash}, token {t}"
            );
            assert_eq!(&got_ids[t * k..(t + 1) * k], &wi[..], "{what}: ids");
            assert_close(&what, &got_w[t * k..(t + 1) * k], &ww, 1e-5);
        }
    }
}

// ---------------------------------------------------------------------------- compressor

/// Sequences in the slots of one store pool, fed in steps (`steps[i][s]`: tokens of slot s
/// in step i, 0 for none), every step's rows of all slots through one store and one pool
/// dispatch (row table at an offset); every entry matches the CPU reference run per
/// sequence, in the cache pool (entries written at their cache rows) and in packed staging.
fn compressor_case(
    gpu: &Gpu,
    rng: &mut Rng,
    ratio: usize,
    d: usize,
    overlap: bool,
    steps: &[&[usize]],
) {
    let n_rot = 8.min(d);
    let inv_freq: Vec<f32> = (0..n_rot / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / n_rot as f32))
        .collect();
    let table = RopeTable::new(gpu, &inv_freq, "rope").unwrap();
    let width = if overlap { 2 * d } else { d };
    let slots = steps[0].len();
    let max_chunk = steps.iter().flat_map(|s| s.iter()).copied().max().unwrap();
    let s = CmpShape {
        ratio: ratio as u32,
        d: d as u32,
        overlap,
        cap: CmpShape::store_rows(ratio as u32, overlap, max_chunk as u32),
    };
    let cap = s.cap as usize;
    let cs = cpu::compress::Shape {
        ratio,
        d,
        overlap,
        cap,
    };
    let ape = rng.vec(ratio * width, 0.5);
    let norm = rng.vec(d, 1.0);
    let tape = tensor(gpu, &[ratio as u64, width as u64], &ape);
    let tnorm = tensor(gpu, &[d as u64], &norm);
    let store = gpu.buffer(s.store_bytes() * slots as u64, "store").unwrap();
    let totals: Vec<usize> = (0..slots)
        .map(|k| steps.iter().map(|st| st[k]).sum())
        .collect();
    let cap_e = totals.iter().max().unwrap() / ratio + 3;
    let cache = gpu
        .buffer((slots * cap_e * d * 4) as u64, "entries")
        .unwrap();
    let mut cpu_store = vec![vec![0f32; cap * 2 * width]; slots];
    let mut want: Vec<Vec<f32>> = vec![Vec::new(); slots];
    let mut pos = vec![0usize; slots];
    for step in steps {
        // src rows of kv | score with a stride wider than 2·width (an offset view).
        let stride = 2 * width + 3;
        let n: usize = step.iter().sum();
        let src = rng.vec(n * stride + 1, 1.0);
        let sb = gpu.upload_f32(&src, "src").unwrap();
        let (mut rp, mut rs, mut wins) = (Vec::new(), Vec::new(), Vec::new());
        let mut step_want = Vec::new();
        let mut row = 0;
        for (k, &nk) in step.iter().enumerate() {
            rp.extend((0..nk).map(|j| (pos[k] + j) as u32));
            rs.extend((0..nk).map(|_| k as u32));
            cpu::compress::store(
                &mut cpu_store[k],
                &cs,
                pos[k],
                &src[1 + row * stride..],
                stride,
                nk,
                &ape,
            );
            for w in pos[k] / ratio..(pos[k] + nk) / ratio {
                wins.push((w as u32, k as u32));
                let e = cpu::compress::pool(&cpu_store[k], &cs, w, &norm, &inv_freq, 1e-6);
                want[k].extend_from_slice(&e);
                step_want.extend(e);
            }
            pos[k] += nk;
            row += nk;
        }
        let mut tab = vec![7u32; 5];
        tab.extend(compress::Rows::words(&rp, &rs));
        let win_off = tab.len() as u32;
        tab.extend(compress::Windows::words(&wins, cap_e as u32));
        let tb = gpu.upload(bytemuck::cast_slice(&tab), "tab").unwrap();
        let n_win = wins.len();
        let stage = gpu
            .buffer(((3 + n_win.max(1) * d) * 4) as u64, "stage")
            .unwrap();
        let wv = compress::Windows {
            buf: &tb,
            off: win_off,
            n_win: n_win as u32,
        };
        let rows = compress::Rows {
            tab: &tb,
            tab_rows: n as u32,
            row0: 5,
            n_tok: n as u32,
        };
        let en = compress::EntryNorm {
            w: &tnorm,
            eps: 1e-6,
        };
        submit(gpu, |p| {
            let src = Operand::strided(&sb, 1, stride as u32);
            compress::store(p, &s, rows, src, &tape, &store).unwrap();
            let out = compress::PoolOut::CacheRows { buf: &cache };
            compress::pool(p, &s, wv, en, &table, &store, out).unwrap();
            let out = compress::PoolOut::Packed {
                buf: &stage,
                off: 3,
            };
            compress::pool(p, &s, wv, en, &table, &store, out).unwrap();
        });
        let what = format!("compressor ratio {ratio} d {d} overlap {overlap} step {step:?}");
        let got = gpu.read_f32(&stage, 3, n_win * d).unwrap();
        assert_close(&format!("{what}: packed"), &got, &step_want, 1e-4);
    }
    for (k, wk) in want.iter().enumerate() {
        let got = gpu
            .read_f32(&cache, (k * cap_e * d) as u64, wk.len())
            .unwrap();
        let what = format!("compressor ratio {ratio} d {d} overlap {overlap} slot {k}");
        assert_close(&what, &got, wk, 1e-4);
    }
}

#[test]
fn compressor_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng(3);
    let one = |v: &[usize]| v.iter().map(|&n| vec![n]).collect::<Vec<_>>();
    let run = |rng: &mut Rng, ratio, d, overlap, steps: Vec<Vec<usize>>| {
        let st: Vec<&[usize]> = steps.iter().map(|v| &v[..]).collect();
        compressor_case(&gpu, rng, ratio, d, overlap, &st);
    };
    run(&mut rng, 4, 16, true, one(&[5, 1, 1, 1, 9, 2, 4]));
    run(&mut rng, 3, 20, true, one(&[1, 1, 1, 1, 7, 11]));
    run(&mut rng, 5, 12, false, one(&[13, 1, 1, 6]));
    run(&mut rng, 4, 512, true, one(&[37, 1, 1, 1, 1]));
    run(&mut rng, 128, 512, false, one(&[200, 1, 55, 1, 1]));
    // Three sequences in one pool: prefill chunks beside decode rows, idle slots.
    let steps = vec![
        vec![5, 9, 0],
        vec![1, 2, 7],
        vec![1, 1, 1],
        vec![0, 1, 1],
        vec![3, 1, 1],
        vec![1, 1, 6],
    ];
    run(&mut rng, 4, 16, true, steps.clone());
    run(&mut rng, 3, 20, false, steps);
}

// ---------------------------------------------------------------------------- indexer, key lists

/// Tokens of `slots` sequences (token t in slot t % slots) in one scoring and one selection
/// call: scores against each slot's keys in a pool of `cap_e` entries per slot, picks after
/// each token's window slots in lists of one stride (row table and q rows at offsets).
#[allow(clippy::too_many_arguments)]
fn indexer_case(
    gpu: &Gpu,
    rng: &mut Rng,
    nh: usize,
    d: usize,
    k: usize,
    n_ent: usize,
    n: usize,
    slots: usize,
) {
    let ratio = 4usize;
    let window = 3usize;
    let cap_e = n_ent + 2;
    // Tokens whose visible entry counts run up to n_ent.
    let pos: Vec<usize> = (0..n).map(|t| n_ent * ratio - n + t).collect();
    let slot: Vec<usize> = (0..n).map(|t| t % slots).collect();
    let q = rng.vec((n + 1) * nh * d, 1.0);
    let w = rng.vec((n + 1) * nh, 1.0);
    let keys = rng.vec(slots * cap_e * d, 1.0);
    let (qb, wb, kb) = (
        gpu.upload_f32(&q, "q").unwrap(),
        gpu.upload_f32(&w, "w").unwrap(),
        gpu.upload_f32(&keys, "keys").unwrap(),
    );
    let scores = gpu.buffer((n * n_ent * 4) as u64, "scores").unwrap();
    let s = IndexerShape {
        n_head: nh as u32,
        d: d as u32,
        ratio: ratio as u32,
        top_k: k as u32,
    };
    let mut tab = vec![0u32; 2];
    let pu: Vec<u32> = pos.iter().map(|&p| p as u32).collect();
    let su: Vec<u32> = slot.iter().map(|&p| p as u32).collect();
    tab.extend(compress::Rows::words(&pu, &su));
    let tb = gpu.upload(bytemuck::cast_slice(&tab), "tab").unwrap();
    let rows = compress::Rows {
        tab: &tb,
        tab_rows: n as u32,
        row0: 2,
        n_tok: n as u32,
    };
    // Lists: window slots owned by someone else (guards), the picks, guards after them.
    let n_win = |t: usize| window.min(pos[t] + 1);
    let vis = |t: usize| ((pos[t] + 1) / ratio).min(n_ent);
    let stride = (0..n).map(|t| n_win(t) + k.min(vis(t))).max().unwrap() + 1;
    let guard = 0x1234_5678u32;
    let idx = gpu
        .upload(bytemuck::cast_slice(&vec![guard; 4 + n * stride]), "idx")
        .unwrap();
    let list = compress::ListView {
        buf: &idx,
        off: 4,
        n_idx: stride as u32,
    };
    submit(gpu, |p| {
        let queries = compress::Queries {
            q: &qb,
            w: &wb,
            row0: 1,
        };
        let ents = compress::SlotEntries {
            n_ent: n_ent as u32,
            cap_e: cap_e as u32,
        };
        compress::index_scores(p, &s, rows, queries, &kb, ents, &scores).unwrap();
        compress::select_topk(p, &s, rows, ents, window as u32, &scores, list).unwrap();
    });
    let got = gpu.read_f32(&scores, 0, n * n_ent).unwrap();
    let mut want = Vec::new();
    for t in 0..n {
        let kk = &keys[slot[t] * cap_e * d..][..n_ent * d];
        let (qt, wt) = (&q[(1 + t) * nh * d..][..nh * d], &w[(1 + t) * nh..][..nh]);
        let ix = cpu::compress::Indexer {
            n_head: nh,
            d,
            ratio,
        };
        want.extend(cpu::compress::index_scores(
            qt, wt, kk, &ix, 1, pos[t], n_ent,
        ));
    }
    let what = format!("indexer {nh}×{d} top-{k} of {n_ent}, {slots} slots");
    // Masked entries are -1e30 on both sides: compare them exactly, scores with the tolerance.
    for (i, (&g, &wv)) in got.iter().zip(&want).enumerate() {
        if wv <= -1e29 {
            assert_eq!(g, wv, "{what}: score {i} should be masked");
        }
    }
    assert_close(&format!("{what}: scores"), &got, &want, 1e-4);
    let got_idx = gpu.read_u32(&idx, 4, n * stride).unwrap();
    for t in 0..n {
        let row = &got_idx[t * stride..(t + 1) * stride];
        let (nw, np) = (n_win(t), k.min(vis(t)));
        assert!(
            row[..nw].iter().chain(&row[nw + np..]).all(|&v| v == guard),
            "{what}: token {t}: slots outside its picks touched"
        );
        // Selection from the GPU's own scores (a near-tie of f32 vs f64 sums must not decide).
        let base = (slot[t] * cap_e) as u32;
        let mut sel: Vec<u32> =
            cpu::compress::select_topk(&got[t * n_ent..(t + 1) * n_ent], vis(t), k, np)
                .into_iter()
                .map(|v| v + base)
                .collect();
        let mut g = row[nw..nw + np].to_vec();
        sel.sort_unstable();
        g.sort_unstable();
        assert_eq!(g, sel, "{what}: token {t} selection");
    }
}

#[test]
fn indexer_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng(5);
    indexer_case(&gpu, &mut rng, 4, 16, 2, 13, 6, 1);
    indexer_case(&gpu, &mut rng, 3, 40, 5, 3, 9, 2);
    indexer_case(&gpu, &mut rng, 5, 24, 7, 11, 10, 3);
    indexer_case(&gpu, &mut rng, 64, 128, 512, 1000, 2, 2);
}

/// Each token's list (rows of several sequences in one call) is the one-token decode step's
/// list at its position in its slot's rows, `INVALID` after it, the indexer's slots left.
#[test]
fn index_list_matches_reference() {
    let gpu = gpu();
    let guard = 0x0bad_f00du32;
    let cap_e = 300usize;
    // (rows as (pos, slot), window, ring, ratio, fill, top_k)
    type Case = (Vec<(usize, usize)>, usize, usize, usize, bool, usize);
    let cases: [Case; 5] = [
        ((0..5).map(|p| (p, 0)).collect(), 8, 12, 4, true, 0),
        (vec![(3, 1), (9, 0), (10, 0), (0, 2)], 8, 8, 4, false, 2),
        ((126..135).map(|p| (p, 1)).collect(), 128, 383, 128, true, 0),
        (vec![(1000, 0), (2, 1)], 128, 383, 0, false, 0),
        (
            (500..517).map(|p| (p, p % 3)).collect(),
            128,
            383,
            4,
            false,
            16,
        ),
    ];
    for (rows, window, ring, ratio, fill, top_k) in cases {
        let n = rows.len();
        let n_win = |p: usize| window.min(p + 1);
        let comp = |p: usize| match ratio {
            0 => 0,
            r if fill => (p + 1) / r,
            r => top_k.min((p + 1) / r),
        };
        let stride = rows.iter().map(|r| n_win(r.0) + comp(r.0)).max().unwrap() + 2;
        let buf = gpu
            .upload(bytemuck::cast_slice(&vec![guard; 1 + n * stride]), "idx")
            .unwrap();
        let pu: Vec<u32> = rows.iter().map(|r| r.0 as u32).collect();
        let su: Vec<u32> = rows.iter().map(|r| r.1 as u32).collect();
        let tb = gpu
            .upload(
                bytemuck::cast_slice(&compress::Rows::words(&pu, &su)),
                "tab",
            )
            .unwrap();
        let l = IndexList {
            window: window as u32,
            ring: ring as u32,
            ratio: ratio as u32,
            fill_comp: fill,
            top_k: top_k as u32,
            cap_e: cap_e as u32,
        };
        let rv = compress::Rows {
            tab: &tb,
            tab_rows: n as u32,
            row0: 0,
            n_tok: n as u32,
        };
        let list = compress::ListView {
            buf: &buf,
            off: 1,
            n_idx: stride as u32,
        };
        submit(&gpu, |p| compress::index_list(p, &l, rv, list).unwrap());
        let got = gpu.read_u32(&buf, 1, n * stride).unwrap();
        for (t, &(pos, slot)) in rows.iter().enumerate() {
            let (nw, n_idx) = (n_win(pos), n_win(pos) + comp(pos));
            let one = cpu::compress::index_list(pos, n_idx, nw, window, ring, ratio, fill);
            for i in 0..stride {
                let want = match one.get(i) {
                    Some(Some(v)) if i < nw => slot as u32 * ring as u32 + v,
                    Some(Some(v)) => SRC_B | ((slot * cap_e) as u32 + (v & !SRC_B)),
                    Some(None) => guard,
                    None => INVALID,
                };
                assert_eq!(
                    got[t * stride + i],
                    want,
                    "{l:?}: token {t} (pos {pos}, slot {slot}) slot {i}"
                );
            }
        }
    }
}

/// Top-k selection where ties straddle the k-th place (few distinct values, negatives,
/// −0.0 and +0.0 apart): the set is the lowest-index ones among the tied, as a sort would give.
#[test]
fn select_topk_breaks_ties_like_a_sort() {
    let gpu = gpu();
    let mut rng = Rng(9);
    let (n_ent, ratio) = (700usize, 4usize);
    for k in [1usize, 5, 100, 512, 699] {
        let n = 3usize;
        let pos0 = n_ent * ratio - n;
        let vals = [-2.0f32, -0.0, 0.0, 0.5, 0.5, 1.0, 3.0];
        let scores: Vec<f32> = (0..n * n_ent)
            .map(|_| vals[(rng.u32() % vals.len() as u32) as usize])
            .collect();
        let sb = gpu.upload_f32(&scores, "scores").unwrap();
        let n_slots = k.min(n_ent);
        let idx = gpu.buffer((n * n_slots * 4) as u64, "idx").unwrap();
        let s = IndexerShape {
            n_head: 1,
            d: 1,
            ratio: ratio as u32,
            top_k: k as u32,
        };
        let pos: Vec<u32> = (0..n).map(|t| (pos0 + t) as u32).collect();
        let tb = gpu
            .upload(
                bytemuck::cast_slice(&compress::Rows::words(&pos, &[0; 3])),
                "tab",
            )
            .unwrap();
        let rows = compress::Rows {
            tab: &tb,
            tab_rows: n as u32,
            row0: 0,
            n_tok: n as u32,
        };
        let list = compress::ListView {
            buf: &idx,
            off: 0,
            n_idx: n_slots as u32,
        };
        submit(&gpu, |p| {
            let ents = compress::SlotEntries {
                n_ent: n_ent as u32,
                cap_e: n_ent as u32,
            };
            compress::select_topk(p, &s, rows, ents, 0, &sb, list).unwrap()
        });
        let got = gpu.read_u32(&idx, 0, n * n_slots).unwrap();
        for t in 0..n {
            let vis = ((pos0 + t + 1) / ratio).min(n_ent);
            let mut want =
                cpu::compress::select_topk(&scores[t * n_ent..(t + 1) * n_ent], vis, k, n_slots);
            let mut g = got[t * n_slots..(t + 1) * n_slots].to_vec();
            // Entry order on the GPU: already sorted.
            want.sort_unstable();
            g.sort_unstable();
            assert_eq!(g, want, "top-{k} of {vis}, token {t}");
        }
    }
}

#[test]
fn moe_combine_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng(13);
    for (n, e, k) in [(1usize, 64usize, 2usize), (7, 257, 6), (3, 4096, 6)] {
        let y = rng.vec(n * e, 1.0);
        let w = rng.vec(n * k, 1.0);
        let x = rng.vec(n * k * e, 1.0);
        let (yb, wb, xb) = (
            gpu.upload_f32(&y, "y").unwrap(),
            gpu.upload_f32(&w, "w").unwrap(),
            gpu.upload_f32(&x, "x").unwrap(),
        );
        submit(&gpu, |p| {
            router::combine(p, n as u32, e as u32, k as u32, &yb, &wb, &xb).unwrap()
        });
        let mut want = y.clone();
        cpu::router::combine(&mut want, &w, &x, k, e);
        let got = gpu.read_f32(&yb, 0, n * e).unwrap();
        assert_close(&format!("moe combine {n}×{e}, k {k}"), &got, &want, 1e-6);
    }
}

#[test]
fn expert_scale_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng(17);
    // Odd pair counts past one workgroup, and Gemma-4 26B-A4B's 128 experts, top-8.
    for (n, ne) in [(1usize, 4usize), (7 * 6, 37), (300 * 8, 128)] {
        let w = rng.vec(n, 1.0);
        let scale = rng.vec(ne, 2.0);
        // Every expert and one id past the table (kept as it is).
        let ids: Vec<u32> = (0..n as u32)
            .map(|i| {
                if i == 3 {
                    ne as u32
                } else {
                    (i * 11 + 5) % ne as u32
                }
            })
            .collect();
        let wb = gpu.upload_f32(&w, "w").unwrap();
        let ib = gpu.upload(bytemuck::cast_slice(&ids), "ids").unwrap();
        let sb = tensor(&gpu, &[ne as u64], &scale);
        submit(&gpu, |p| {
            router::expert_scale(p, n as u32, &wb, &ib, &sb).unwrap()
        });
        let mut want = w.clone();
        cpu::router::expert_scale(&mut want, &ids, &scale);
        assert_ne!(want, w, "the scales change the weights");
        let got = gpu.read_f32(&wb, 0, n).unwrap();
        assert_close(&format!("expert scale {n} pairs of {ne}"), &got, &want, 0.0);
    }
}
