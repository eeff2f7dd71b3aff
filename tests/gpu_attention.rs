//! Attention kernels against the f64 CPU reference (`cpu::attention`) on whatever adapter
//! the machine has (lavapipe in CI).
//!
//! Tolerances: with an f32 cache the GPU differs from the f64 reference only by f32
//! rounding of dot products and sums: max |gpu − ref| ≤ 1e-5 · max(1, max |ref|).
//! With an f16 cache the reference is computed on the f16-rounded K/V (what the cache
//! holds), same 1e-5 bound; against the unrounded K/V the error is the f16 rounding itself
//! (relative 2^-11 per element): ≤ 4e-3 · max(1, max |ref|) for these value ranges.

use lathe::cpu::attention::{self as cref, Dims, KvRef, Visible};
use lathe::gpu::attention::{
    self as ga, Attention, DstRows, Keys, KvShape, KvSource, KvType, OutView, QView, INVALID, SRC_B,
};
use lathe::gpu::{AdapterChoice, Gpu};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// One device for all tests (pipelines compile once). Each test holds `serial()` while it
/// records and submits: passes of one `Gpu` share its uniform arena, so two threads
/// submitting at once could see each other's uniforms.
fn gpu() -> &'static Gpu {
    static G: OnceLock<Gpu> = OnceLock::new();
    G.get_or_init(|| {
        let g = Gpu::new(&AdapterChoice::Auto).expect("a wgpu adapter (lavapipe in CI)");
        eprintln!("{}", g.report());
        g
    })
}

fn serial() -> MutexGuard<'static, ()> {
    static L: Mutex<()> = Mutex::new(());
    L.lock().unwrap_or_else(|p| p.into_inner())
}

/// Deterministic values in [-amp, amp).
fn rand_vec(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

#[track_caller]
fn assert_close(got: &[f32], want: &[f32], rel: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1f32, |m, &x| m.max(x.abs()));
    let (mut worst, mut at) = (0f32, 0);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let e = (g - w).abs();
        if e.is_nan() || e > worst {
            worst = if e.is_nan() { f32::INFINITY } else { e };
            at = i;
        }
    }
    eprintln!("{what}: max err {worst:.3e} (bound {:.1e})", rel * scale);
    assert!(
        worst <= rel * scale,
        "{what}: max err {worst:e} at {at} (got {} want {}), bound {:e}",
        got[at],
        want[at],
        rel * scale
    );
}

fn upload_u32(g: &Gpu, v: &[u32], label: &str) -> wgpu::Buffer {
    g.upload(bytemuck::cast_slice(v), label).unwrap()
}

/// An f32 cache buffer of `n_rows` rows holding `rows` at row 0.. (written by write_kv).
fn make_cache(g: &Gpu, kv: KvShape, src: &[f32], n_rows: u32, row0: u32) -> wgpu::Buffer {
    let n_tok = (src.len() as u64 / kv.row_elems()) as u32;
    let cache = g.buffer(kv.bytes(n_rows as u64), "cache").unwrap();
    let sb = g.upload_f32(src, "kv src").unwrap();
    let mut pass = g.pass();
    ga::write_kv(
        &mut pass,
        kv,
        &sb,
        0,
        kv.row_elems() as u32,
        n_tok,
        &cache,
        DstRows::Range { row0 },
    )
    .unwrap();
    pass.submit().unwrap();
    cache
}

struct Case {
    hd: u32,
    n_head: u32,
    n_kv: u32,
    n: u32,
    dtype: KvType,
}

/// Full causal prefill of `n` tokens in one call; returns (gpu, reference on the cached K/V).
fn causal_prefill(c: &Case, split: u32, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let g = gpu();
    let kv = KvShape {
        dtype: c.dtype,
        n_head_kv: c.n_kv,
        head_dim: c.hd,
    };
    let (n, nh, hd) = (c.n as usize, c.n_head as usize, c.hd as usize);
    let row = kv.row_elems() as usize;
    let q = rand_vec(n * nh * hd, seed, 1.0);
    let k = rand_vec(n * row, seed + 1, 1.0);
    let v = rand_vec(n * row, seed + 2, 1.0);
    let kc = make_cache(g, kv, &k, c.n, 0);
    let vc = make_cache(g, kv, &v, c.n, 0);
    let qb = g.upload_f32(&q, "q").unwrap();
    let out = g.buffer((n * nh * hd) as u64 * 4, "out").unwrap();
    let scratch = g
        .buffer(ga::scratch_elems(c.n, c.n_head, c.hd, split) * 4, "scratch")
        .unwrap();
    let mut pass = g.pass();
    ga::attention(
        &mut pass,
        &Attention {
            n_q: c.n,
            n_head: c.n_head,
            kv,
            scale: 1.0 / (c.hd as f32).sqrt(),
            q: QView {
                buf: &qb,
                off: 0,
                tok_stride: c.n_head * c.hd,
                head_stride: c.hd,
            },
            out: OutView {
                buf: &out,
                off: 0,
                tok_stride: c.n_head * c.hd,
            },
            a: KvSource {
                k: &kc,
                v: Some(&vc),
            },
            b: None,
            keys: Keys::Causal {
                row0: 0,
                pos0: 0,
                n_kv: c.n,
                window: 0,
            },
            sinks: None,
            split: (split > 1).then_some((&scratch, split)),
        },
    )
    .unwrap();
    pass.submit().unwrap();
    let got = g.read_f32(&out, 0, n * nh * hd).unwrap();
    let (kr, vr) = match c.dtype {
        KvType::F16 => (cref::round_f16(&k), cref::round_f16(&v)),
        KvType::F32 => (k, v),
    };
    let d = Dims {
        n_q: n,
        n_head: nh,
        n_head_kv: c.n_kv as usize,
        head_dim: hd,
    };
    let want = cref::attention(
        d,
        &q,
        KvRef { k: &kr, v: &vr },
        None,
        Visible::Causal { pos0: 0, window: 0 },
        None,
        1.0 / (hd as f32).sqrt(),
    );
    (got, want)
}

#[test]
fn write_kv_f32_exact_f16_round_to_nearest_even() {
    let _serial = serial();
    let g = gpu();
    for dtype in [KvType::F32, KvType::F16] {
        let kv = KvShape {
            dtype,
            n_head_kv: 2,
            head_dim: 12,
        };
        let row = kv.row_elems() as usize;
        // Source with a token stride larger than a row and an offset (as a fused projection).
        let stride = row + 5;
        let mut src = rand_vec(7 + 3 * stride, 9, 3.0);
        src[7] = 1.0 + 1.0 / 2048.0; // a tie: rounds to even (1.0) in f16
        src[8] = 65504.0 * 2.0; // overflow: inf in f16
        let sb = g.upload_f32(&src, "src").unwrap();
        let cache = g.buffer(kv.bytes(8), "cache").unwrap();
        let rows = upload_u32(g, &[0, 0, 6, 1, 4], "rows");
        let mut pass = g.pass();
        ga::write_kv(
            &mut pass,
            kv,
            &sb,
            7,
            stride as u32,
            2,
            &cache,
            DstRows::Range { row0: 2 },
        )
        .unwrap();
        let src_off = (7 + 2 * stride) as u32;
        ga::write_kv(
            &mut pass,
            kv,
            &sb,
            src_off,
            stride as u32,
            1,
            &cache,
            DstRows::List {
                rows: &rows,
                off: 2,
            },
        )
        .unwrap();
        pass.submit().unwrap();
        let bytes = g.read_bytes(&cache, 0, kv.bytes(8)).unwrap();
        let got: Vec<f32> = match dtype {
            KvType::F32 => bytemuck::pod_collect_to_vec(&bytes),
            KvType::F16 => bytemuck::pod_collect_to_vec::<u8, u16>(&bytes)
                .into_iter()
                .map(|b| half::f16::from_bits(b).to_f32())
                .collect(),
        };
        let conv = |x: f32| match dtype {
            KvType::F32 => x,
            KvType::F16 => half::f16::from_f32(x).to_f32(),
        };
        for r in 0..8 {
            let tok = match r {
                2 => Some(0),
                3 => Some(1),
                6 => Some(2),
                _ => None,
            };
            for e in 0..row {
                let want = tok.map_or(0.0, |t| conv(src[7 + t * stride + e]));
                assert_eq!(
                    got[r * row + e].to_bits(),
                    want.to_bits(),
                    "{dtype:?} row {r} elem {e}"
                );
            }
        }
    }
}

#[test]
fn prefill_causal_f32_odd_sizes() {
    let _serial = serial();
    let cases = [
        Case {
            hd: 16,
            n_head: 4,
            n_kv: 1,
            n: 7,
            dtype: KvType::F32,
        },
        Case {
            hd: 32,
            n_head: 2,
            n_kv: 1,
            n: 65,
            dtype: KvType::F32,
        },
        Case {
            hd: 64,
            n_head: 16,
            n_kv: 2,
            n: 7,
            dtype: KvType::F32,
        },
        Case {
            hd: 16,
            n_head: 16,
            n_kv: 2,
            n: 65,
            dtype: KvType::F32,
        },
        Case {
            hd: 256,
            n_head: 4,
            n_kv: 1,
            n: 7,
            dtype: KvType::F32,
        },
        Case {
            hd: 512,
            n_head: 2,
            n_kv: 1,
            n: 7,
            dtype: KvType::F32,
        },
        Case {
            hd: 32,
            n_head: 4,
            n_kv: 1,
            n: 1,
            dtype: KvType::F32,
        },
        Case {
            hd: 12,
            n_head: 3,
            n_kv: 3,
            n: 9,
            dtype: KvType::F32,
        },
    ];
    for (i, c) in cases.iter().enumerate() {
        let (got, want) = causal_prefill(c, 1, 100 + i as u64);
        assert_close(
            &got,
            &want,
            1e-5,
            &format!("hd {} {}/{} n {}", c.hd, c.n_head, c.n_kv, c.n),
        );
    }
}

#[test]
fn prefill_causal_split_k_matches_one_pass() {
    let _serial = serial();
    for (i, c) in [
        Case {
            hd: 32,
            n_head: 4,
            n_kv: 1,
            n: 65,
            dtype: KvType::F32,
        },
        Case {
            hd: 64,
            n_head: 2,
            n_kv: 1,
            n: 30,
            dtype: KvType::F16,
        },
    ]
    .iter()
    .enumerate()
    {
        for split in [2, 3, 7, 13] {
            let (got, want) = causal_prefill(c, split, 200 + i as u64);
            assert_close(
                &got,
                &want,
                1e-5,
                &format!("hd {} n {} split {split}", c.hd, c.n),
            );
        }
    }
}

#[test]
fn f16_cache_vs_rounded_and_unrounded_reference() {
    let _serial = serial();
    let c = Case {
        hd: 64,
        n_head: 16,
        n_kv: 2,
        n: 65,
        dtype: KvType::F16,
    };
    let (got, want) = causal_prefill(&c, 1, 300);
    assert_close(
        &got,
        &want,
        1e-5,
        "f16 cache vs reference on f16-rounded K/V",
    );
    let c32 = Case {
        dtype: KvType::F32,
        ..c
    };
    let (_, want32) = causal_prefill(&c32, 1, 300);
    assert_close(&got, &want32, 4e-3, "f16 cache vs reference on f32 K/V");
}

/// Prefill in chunks continuing the cache, then decode tokens one at a time (split-K),
/// against one causal reference over the whole sequence.
fn chunked_then_decode(
    hd: u32,
    n_head: u32,
    n_kv: u32,
    chunks: &[u32],
    n_decode: u32,
    dtype: KvType,
) {
    let g = gpu();
    let kv = KvShape {
        dtype,
        n_head_kv: n_kv,
        head_dim: hd,
    };
    let n: u32 = chunks.iter().sum::<u32>() + n_decode;
    let (nu, nh, hdu) = (n as usize, n_head as usize, hd as usize);
    let row = kv.row_elems() as usize;
    let q = rand_vec(nu * nh * hdu, 41, 2.0);
    let k = rand_vec(nu * row, 42, 2.0);
    let v = rand_vec(nu * row, 43, 1.0);
    let qb = g.upload_f32(&q, "q").unwrap();
    let kb = g.upload_f32(&k, "k").unwrap();
    let vb = g.upload_f32(&v, "v").unwrap();
    // The sequence lives at rows 3.. of a shared buffer (rows before it belong to others).
    let base = 3u32;
    let kc = g.buffer(kv.bytes((base + n + 2) as u64), "kc").unwrap();
    let vc = g.buffer(kv.bytes((base + n + 2) as u64), "vc").unwrap();
    let out = g.buffer((nu * nh * hdu) as u64 * 4, "out").unwrap();
    let max_split = ga::pick_n_split(1, n_head, kv, n, false).max(4);
    let scratch = g
        .buffer(ga::scratch_elems(1, n_head, hd, max_split) * 4, "scratch")
        .unwrap();
    let tok = n_head * hd;
    let mut pos = 0u32;
    let mut steps: Vec<(u32, u32)> = chunks.iter().map(|&c| (c, 1)).collect();
    steps.extend((0..n_decode).map(|i| (1, [2, 3, max_split][i as usize % 3])));
    for (len, split) in steps {
        let mut pass = g.pass();
        for (src, cache) in [(&kb, &kc), (&vb, &vc)] {
            ga::write_kv(
                &mut pass,
                kv,
                src,
                pos * row as u32,
                row as u32,
                len,
                cache,
                DstRows::Range { row0: base + pos },
            )
            .unwrap();
        }
        ga::attention(
            &mut pass,
            &Attention {
                n_q: len,
                n_head,
                kv,
                scale: 1.0 / (hd as f32).sqrt(),
                q: QView {
                    buf: &qb,
                    off: pos * tok,
                    tok_stride: tok,
                    head_stride: hd,
                },
                out: OutView {
                    buf: &out,
                    off: pos * tok,
                    tok_stride: tok,
                },
                a: KvSource {
                    k: &kc,
                    v: Some(&vc),
                },
                b: None,
                keys: Keys::Causal {
                    row0: base,
                    pos0: pos,
                    n_kv: pos + len,
                    window: 0,
                },
                sinks: None,
                split: (split > 1).then_some((&scratch, split)),
            },
        )
        .unwrap();
        pass.submit().unwrap();
        pos += len;
    }
    let got = g.read_f32(&out, 0, nu * nh * hdu).unwrap();
    let (kr, vr) = match dtype {
        KvType::F16 => (cref::round_f16(&k), cref::round_f16(&v)),
        KvType::F32 => (k, v),
    };
    let want = cref::attention(
        Dims {
            n_q: nu,
            n_head: nh,
            n_head_kv: n_kv as usize,
            head_dim: hdu,
        },
        &q,
        KvRef { k: &kr, v: &vr },
        None,
        Visible::Causal { pos0: 0, window: 0 },
        None,
        1.0 / (hd as f32).sqrt(),
    );
    assert_close(
        &got,
        &want,
        1e-5,
        &format!("chunked {chunks:?} + {n_decode} decode, hd {hd} {n_head}/{n_kv} {dtype:?}"),
    );
}

#[test]
fn chunked_prefill_and_decode_f32() {
    let _serial = serial();
    chunked_then_decode(32, 4, 1, &[5, 17, 1], 12, KvType::F32);
    chunked_then_decode(64, 16, 2, &[3], 9, KvType::F32);
}

#[test]
fn chunked_prefill_and_decode_f16() {
    let _serial = serial();
    chunked_then_decode(256, 4, 1, &[6, 11], 7, KvType::F16);
    chunked_then_decode(16, 2, 1, &[], 20, KvType::F16);
}

#[test]
fn sliding_window_causal() {
    let _serial = serial();
    let g = gpu();
    let (hd, nh, nkv, n, w) = (32u32, 4u32, 2u32, 40u32, 9u32);
    let kv = KvShape {
        dtype: KvType::F32,
        n_head_kv: nkv,
        head_dim: hd,
    };
    let row = kv.row_elems() as usize;
    let q = rand_vec((n * nh * hd) as usize, 51, 1.0);
    let k = rand_vec(n as usize * row, 52, 1.0);
    let v = rand_vec(n as usize * row, 53, 1.0);
    let kc = make_cache(g, kv, &k, n, 0);
    let vc = make_cache(g, kv, &v, n, 0);
    let qb = g.upload_f32(&q, "q").unwrap();
    let out = g.buffer((n * nh * hd) as u64 * 4, "out").unwrap();
    let mut pass = g.pass();
    ga::attention(
        &mut pass,
        &Attention {
            n_q: n,
            n_head: nh,
            kv,
            scale: 0.3,
            q: QView {
                buf: &qb,
                off: 0,
                tok_stride: nh * hd,
                head_stride: hd,
            },
            out: OutView {
                buf: &out,
                off: 0,
                tok_stride: nh * hd,
            },
            a: KvSource {
                k: &kc,
                v: Some(&vc),
            },
            b: None,
            keys: Keys::Causal {
                row0: 0,
                pos0: 0,
                n_kv: n,
                window: w,
            },
            sinks: None,
            split: None,
        },
    )
    .unwrap();
    pass.submit().unwrap();
    let got = g.read_f32(&out, 0, (n * nh * hd) as usize).unwrap();
    let d = Dims {
        n_q: n as usize,
        n_head: nh as usize,
        n_head_kv: nkv as usize,
        head_dim: hd as usize,
    };
    let kvr = KvRef { k: &k, v: &v };
    let want = cref::attention(
        d,
        &q,
        kvr,
        None,
        Visible::Causal {
            pos0: 0,
            window: w as usize,
        },
        None,
        0.3,
    );
    assert_close(&got, &want, 1e-5, "window");
}

/// Qwen3.5 reads q in place from the interleaved `[q | gate]` projection; the output goes
/// to an offset with a token stride; elements around it stay untouched.
#[test]
fn strided_q_and_output_guards() {
    let _serial = serial();
    let g = gpu();
    let (hd, nh, nkv, n) = (16u32, 4u32, 2u32, 5u32);
    let kv = KvShape {
        dtype: KvType::F32,
        n_head_kv: nkv,
        head_dim: hd,
    };
    let row = kv.row_elems() as usize;
    let qg = rand_vec((7 + n * nh * 2 * hd) as usize, 61, 1.0);
    let k = rand_vec(n as usize * row, 62, 1.0);
    let v = rand_vec(n as usize * row, 63, 1.0);
    let kc = make_cache(g, kv, &k, n, 0);
    let vc = make_cache(g, kv, &v, n, 0);
    let qb = g.upload_f32(&qg, "qg").unwrap();
    let (o_off, o_stride) = (11u32, nh * hd + 3);
    let o_len = (o_off + n * o_stride) as usize;
    let out = g.upload_f32(&vec![7.0; o_len], "out").unwrap();
    let mut pass = g.pass();
    ga::attention(
        &mut pass,
        &Attention {
            n_q: n,
            n_head: nh,
            kv,
            scale: 0.25,
            q: QView {
                buf: &qb,
                off: 7,
                tok_stride: nh * 2 * hd,
                head_stride: 2 * hd,
            },
            out: OutView {
                buf: &out,
                off: o_off,
                tok_stride: o_stride,
            },
            a: KvSource {
                k: &kc,
                v: Some(&vc),
            },
            b: None,
            keys: Keys::Causal {
                row0: 0,
                pos0: 0,
                n_kv: n,
                window: 0,
            },
            sinks: None,
            split: None,
        },
    )
    .unwrap();
    pass.submit().unwrap();
    let got = g.read_f32(&out, 0, o_len).unwrap();
    let q: Vec<f32> = (0..(n * nh) as usize)
        .flat_map(|th| qg[7 + th * 2 * hd as usize..][..hd as usize].to_vec())
        .collect();
    let d = Dims {
        n_q: n as usize,
        n_head: nh as usize,
        n_head_kv: nkv as usize,
        head_dim: hd as usize,
    };
    let want = cref::attention(
        d,
        &q,
        KvRef { k: &k, v: &v },
        None,
        Visible::Causal { pos0: 0, window: 0 },
        None,
        0.25,
    );
    for (i, &x) in got.iter().enumerate() {
        let inside =
            i >= o_off as usize && (i - o_off as usize) % (o_stride as usize) < (nh * hd) as usize;
        if !inside {
            assert_eq!(x, 7.0, "guard element {i} overwritten");
        }
    }
    let packed: Vec<f32> = (0..n as usize)
        .flat_map(|t| got[o_off as usize + t * o_stride as usize..][..(nh * hd) as usize].to_vec())
        .collect();
    assert_close(&packed, &want, 1e-5, "strided");
}

/// Batched decode: three sequences share one cache buffer at different base rows, each
/// query sees its own row range; with and without split-K.
#[test]
fn batched_decode_ranges() {
    let _serial = serial();
    let g = gpu();
    let (hd, nh, nkv) = (64u32, 8u32, 2u32);
    let kv = KvShape {
        dtype: KvType::F16,
        n_head_kv: nkv,
        head_dim: hd,
    };
    let row = kv.row_elems() as usize;
    let n_rows = 200u32;
    let k = rand_vec(n_rows as usize * row, 71, 1.5);
    let v = rand_vec(n_rows as usize * row, 72, 1.0);
    let kc = make_cache(g, kv, &k, n_rows, 0);
    let vc = make_cache(g, kv, &v, n_rows, 0);
    let ranges: Vec<(u32, u32)> = vec![(0, 1), (10, 130), (150, 45), (7, 0)];
    let n_q = ranges.len() as u32;
    let desc: Vec<u32> = ranges.iter().flat_map(|&(a, b)| [a, b]).collect();
    let mut dd = vec![0u32; 3];
    dd.extend(&desc);
    let db = upload_u32(g, &dd, "desc");
    let q = rand_vec((n_q * nh * hd) as usize, 73, 1.0);
    let qb = g.upload_f32(&q, "q").unwrap();
    let d = Dims {
        n_q: n_q as usize,
        n_head: nh as usize,
        n_head_kv: nkv as usize,
        head_dim: hd as usize,
    };
    let (kr, vr) = (cref::round_f16(&k), cref::round_f16(&v));
    let want = cref::attention(
        d,
        &q,
        KvRef { k: &kr, v: &vr },
        None,
        Visible::Ranges(&ranges),
        None,
        0.125,
    );
    for split in [1u32, 4] {
        let out = g.buffer((n_q * nh * hd) as u64 * 4, "out").unwrap();
        let scratch = g
            .buffer(ga::scratch_elems(n_q, nh, hd, split) * 4, "scratch")
            .unwrap();
        let mut pass = g.pass();
        ga::attention(
            &mut pass,
            &Attention {
                n_q,
                n_head: nh,
                kv,
                scale: 0.125,
                q: QView {
                    buf: &qb,
                    off: 0,
                    tok_stride: nh * hd,
                    head_stride: hd,
                },
                out: OutView {
                    buf: &out,
                    off: 0,
                    tok_stride: nh * hd,
                },
                a: KvSource {
                    k: &kc,
                    v: Some(&vc),
                },
                b: None,
                keys: Keys::Ranges {
                    desc: &db,
                    off: 3,
                    max_keys: 130,
                },
                sinks: None,
                split: (split > 1).then_some((&scratch, split)),
            },
        )
        .unwrap();
        pass.submit().unwrap();
        let got = g.read_f32(&out, 0, (n_q * nh * hd) as usize).unwrap();
        assert_close(&got, &want, 1e-5, &format!("ranges split {split}"));
        // The empty range gives zeros, not NaN.
        assert!(got[(3 * nh * hd) as usize..].iter().all(|&x| x == 0.0));
    }
}

/// DeepSeek-V4 shape of attention: one K = V head, per-head sinks, per-query index lists
/// over a window ring (source A) and compressed entries (source B), masked slots.
fn index_sink_case(
    hd: u32,
    nh: u32,
    n_q: u32,
    n_idx: u32,
    dtype: KvType,
    split: u32,
    shared: bool,
) {
    let g = gpu();
    let kv = KvShape {
        dtype,
        n_head_kv: 1,
        head_dim: hd,
    };
    let (n_a, n_b) = (13u32, 29u32);
    let row = hd as usize;
    let ka = rand_vec(n_a as usize * row, 81, 2.0);
    let kb = rand_vec(n_b as usize * row, 82, 2.0);
    let va = if shared {
        ka.clone()
    } else {
        rand_vec(n_a as usize * row, 83, 1.0)
    };
    let vb = if shared {
        kb.clone()
    } else {
        rand_vec(n_b as usize * row, 84, 1.0)
    };
    let sinks = rand_vec(nh as usize + 2, 85, 3.0);
    let q = rand_vec((n_q * nh * hd) as usize, 86, 1.0);
    // Index lists: some of A, some of B (tagged), masked slots; query 1 fully masked.
    let mut idx = Vec::new();
    let mut s = 7u32;
    for t in 0..n_q {
        for _ in 0..n_idx {
            s = s.wrapping_mul(1_103_515_245).wrapping_add(12345);
            let r = (s >> 16) % 5;
            idx.push(if t == 1 || r == 0 {
                INVALID
            } else if r <= 2 {
                (s >> 8) % n_a
            } else {
                SRC_B | ((s >> 8) % n_b)
            });
        }
    }
    let kca = make_cache(g, kv, &ka, n_a, 0);
    let kcb = make_cache(g, kv, &kb, n_b, 0);
    let vca = make_cache(g, kv, &va, n_a, 0);
    let vcb = make_cache(g, kv, &vb, n_b, 0);
    let qb = g.upload_f32(&q, "q").unwrap();
    let mut ip = vec![INVALID; 5];
    ip.extend(&idx);
    let ib = upload_u32(g, &ip, "idx");
    let sb = g.upload_f32(&sinks, "sinks").unwrap();
    let out = g.buffer((n_q * nh * hd) as u64 * 4, "out").unwrap();
    let scratch = g
        .buffer(ga::scratch_elems(n_q, nh, hd, split) * 4, "scratch")
        .unwrap();
    let scale = 1.0 / (hd as f32).sqrt();
    let mut pass = g.pass();
    ga::attention(
        &mut pass,
        &Attention {
            n_q,
            n_head: nh,
            kv,
            scale,
            q: QView {
                buf: &qb,
                off: 0,
                tok_stride: nh * hd,
                head_stride: hd,
            },
            out: OutView {
                buf: &out,
                off: 0,
                tok_stride: nh * hd,
            },
            a: KvSource {
                k: &kca,
                v: (!shared).then_some(&vca),
            },
            b: Some(KvSource {
                k: &kcb,
                v: (!shared).then_some(&vcb),
            }),
            keys: Keys::Index {
                idx: &ib,
                off: 5,
                n_idx,
            },
            sinks: Some((&sb, 2)),
            split: (split > 1).then_some((&scratch, split)),
        },
    )
    .unwrap();
    pass.submit().unwrap();
    let got = g.read_f32(&out, 0, (n_q * nh * hd) as usize).unwrap();
    let r = |x: &[f32]| match dtype {
        KvType::F16 => cref::round_f16(x),
        KvType::F32 => x.to_vec(),
    };
    let (ka, va, kb, vb) = (r(&ka), r(&va), r(&kb), r(&vb));
    let d = Dims {
        n_q: n_q as usize,
        n_head: nh as usize,
        n_head_kv: 1,
        head_dim: hd as usize,
    };
    let want = cref::attention(
        d,
        &q,
        KvRef { k: &ka, v: &va },
        Some(KvRef { k: &kb, v: &vb }),
        Visible::Index {
            idx: &idx,
            n_idx: n_idx as usize,
        },
        Some(&sinks[2..]),
        scale,
    );
    let what = format!(
        "index hd {hd} heads {nh} n_q {n_q} n_idx {n_idx} {dtype:?} split {split} shared {shared}"
    );
    assert_close(&got, &want, 1e-5, &what);
    // A fully masked query with a sink attends to nothing: zeros.
    assert!(
        got[(nh * hd) as usize..(2 * nh * hd) as usize]
            .iter()
            .all(|&x| x == 0.0),
        "{what}"
    );
}

#[test]
fn index_lists_with_sinks() {
    let _serial = serial();
    index_sink_case(32, 4, 3, 21, KvType::F32, 1, true);
    index_sink_case(32, 4, 3, 21, KvType::F32, 3, false);
    index_sink_case(512, 2, 2, 40, KvType::F16, 1, true);
    index_sink_case(64, 20, 4, 37, KvType::F16, 2, true);
}

/// Per-row lists (`Keys::Rows`): tokens with their own list lengths (short ones in one
/// split, long ones in several) and lists placed anywhere in the aux buffer, in one call;
/// each row against the reference over its own list, and bit for bit against a one-row call.
fn rows_case(hd: u32, nh: u32, lens: &[u32], dtype: KvType) {
    let g = gpu();
    let kv = KvShape {
        dtype,
        n_head_kv: 1,
        head_dim: hd,
    };
    let n_q = lens.len() as u32;
    let (n_a, n_b) = (13u32, 29u32);
    let row = hd as usize;
    let ka = rand_vec(n_a as usize * row, 91, 2.0);
    let kb = rand_vec(n_b as usize * row, 92, 2.0);
    let sinks = rand_vec(nh as usize, 95, 3.0);
    let q = rand_vec((n_q * nh * hd) as usize, 96, 1.0);
    let mut lists: Vec<Vec<u32>> = Vec::new();
    let mut s = 11u32;
    for &n in lens {
        lists.push(
            (0..n)
                .map(|_| {
                    s = s.wrapping_mul(1_103_515_245).wrapping_add(12345);
                    match (s >> 16) % 7 {
                        0 => INVALID,
                        1..=3 => (s >> 8) % n_a,
                        _ => SRC_B | ((s >> 8) % n_b),
                    }
                })
                .collect(),
        );
    }
    // aux: [3 unused][descriptors of the call][lists, last token's first]
    let desc = |t: usize, list: u32| -> Result<[u32; 4], lathe::Error> {
        let (ns, sl) = ga::row_split(g, nh, kv, lens[t])?;
        Ok([lens[t], ns, sl, list])
    };
    let build = |ts: &[usize]| -> (Vec<u32>, u32) {
        let mut aux = vec![7u32; 3];
        let mut at = 3 + 4 * ts.len() as u32;
        let mut max_split = 1;
        let mut words = Vec::new();
        let mut body = Vec::new();
        for &t in ts.iter().rev() {
            let d = desc(t, at).unwrap();
            max_split = max_split.max(d[1]);
            words.push(d);
            body.extend(&lists[t]);
            at += lens[t] + 1;
            body.push(0xdead);
        }
        words.reverse();
        aux.extend(words.iter().flatten());
        aux.extend(body);
        (aux, max_split)
    };
    let kca = make_cache(g, kv, &ka, n_a, 0);
    let kcb = make_cache(g, kv, &kb, n_b, 0);
    let sb = g.upload_f32(&sinks, "sinks").unwrap();
    let scale = 1.0 / (hd as f32).sqrt();
    let run = |ts: &[usize]| -> Vec<f32> {
        let (aux, max_split) = build(ts);
        let ab = upload_u32(g, &aux, "aux");
        let nq = ts.len() as u32;
        let qs: Vec<f32> = ts
            .iter()
            .flat_map(|&t| q[t * (nh * hd) as usize..][..(nh * hd) as usize].to_vec())
            .collect();
        let qb = g.upload_f32(&qs, "q").unwrap();
        let out = g.buffer((nq * nh * hd) as u64 * 4, "out").unwrap();
        let scratch = g
            .buffer(ga::scratch_elems(nq, nh, hd, max_split) * 4, "scratch")
            .unwrap();
        let mut pass = g.pass();
        ga::attention(
            &mut pass,
            &Attention {
                n_q: nq,
                n_head: nh,
                kv,
                scale,
                q: QView {
                    buf: &qb,
                    off: 0,
                    tok_stride: nh * hd,
                    head_stride: hd,
                },
                out: OutView {
                    buf: &out,
                    off: 0,
                    tok_stride: nh * hd,
                },
                a: KvSource { k: &kca, v: None },
                b: Some(KvSource { k: &kcb, v: None }),
                keys: Keys::Rows {
                    aux: &ab,
                    off: 3,
                    max_keys: *lens.iter().max().unwrap(),
                },
                sinks: Some((&sb, 0)),
                split: Some((&scratch, max_split)),
            },
        )
        .unwrap();
        pass.submit().unwrap();
        g.read_f32(&out, 0, (nq * nh * hd) as usize).unwrap()
    };
    let all: Vec<usize> = (0..lens.len()).collect();
    let got = run(&all);
    let r = |x: &[f32]| match dtype {
        KvType::F16 => cref::round_f16(x),
        KvType::F32 => x.to_vec(),
    };
    let (ka, kb) = (r(&ka), r(&kb));
    let w = (nh * hd) as usize;
    for (t, list) in lists.iter().enumerate() {
        let d = Dims {
            n_q: 1,
            n_head: nh as usize,
            n_head_kv: 1,
            head_dim: hd as usize,
        };
        let want = cref::attention(
            d,
            &q[t * w..][..w],
            KvRef { k: &ka, v: &ka },
            Some(KvRef { k: &kb, v: &kb }),
            Visible::Index {
                idx: list,
                n_idx: list.len(),
            },
            Some(&sinks),
            scale,
        );
        let what = format!("rows hd {hd} heads {nh} {dtype:?}: token {t} of {lens:?}");
        assert_close(&got[t * w..][..w], &want, 1e-5, &what);
        let alone = run(&[t]);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got[t * w..][..w]), bits(&alone), "{what}: alone");
    }
}

#[test]
fn row_lists_match_reference_and_lone_rows() {
    let _serial = serial();
    rows_case(32, 4, &[21, 1, 300, 64, 33], KvType::F32);
    rows_case(512, 3, &[40, 700, 7], KvType::F16);
    rows_case(64, 20, &[129, 2, 90], KvType::F32);
}

#[test]
fn causal_with_sinks_split_and_not() {
    let _serial = serial();
    // Sinks also work in the causal mode (gpt-oss-style models), split or not.
    let g = gpu();
    let (hd, nh, nkv, n) = (32u32, 4u32, 1u32, 20u32);
    let kv = KvShape {
        dtype: KvType::F32,
        n_head_kv: nkv,
        head_dim: hd,
    };
    let k = rand_vec((n * hd) as usize, 91, 1.0);
    let v = rand_vec((n * hd) as usize, 92, 1.0);
    let q = rand_vec((n * nh * hd) as usize, 93, 1.0);
    let sinks = rand_vec(nh as usize, 94, 4.0);
    let kc = make_cache(g, kv, &k, n, 0);
    let vc = make_cache(g, kv, &v, n, 0);
    let qb = g.upload_f32(&q, "q").unwrap();
    let sb = g.upload_f32(&sinks, "sinks").unwrap();
    let d = Dims {
        n_q: n as usize,
        n_head: nh as usize,
        n_head_kv: 1,
        head_dim: hd as usize,
    };
    let want = cref::attention(
        d,
        &q,
        KvRef { k: &k, v: &v },
        None,
        Visible::Causal { pos0: 0, window: 0 },
        Some(&sinks),
        0.2,
    );
    for split in [1u32, 3] {
        let out = g.buffer((n * nh * hd) as u64 * 4, "out").unwrap();
        let scratch = g
            .buffer(ga::scratch_elems(n, nh, hd, split) * 4, "scratch")
            .unwrap();
        let mut pass = g.pass();
        ga::attention(
            &mut pass,
            &Attention {
                n_q: n,
                n_head: nh,
                kv,
                scale: 0.2,
                q: QView {
                    buf: &qb,
                    off: 0,
                    tok_stride: nh * hd,
                    head_stride: hd,
                },
                out: OutView {
                    buf: &out,
                    off: 0,
                    tok_stride: nh * hd,
                },
                a: KvSource {
                    k: &kc,
                    v: Some(&vc),
                },
                b: None,
                keys: Keys::Causal {
                    row0: 0,
                    pos0: 0,
                    n_kv: n,
                    window: 0,
                },
                sinks: Some((&sb, 0)),
                split: (split > 1).then_some((&scratch, split)),
            },
        )
        .unwrap();
        pass.submit().unwrap();
        let got = g.read_f32(&out, 0, (n * nh * hd) as usize).unwrap();
        assert_close(&got, &want, 1e-5, &format!("causal sinks split {split}"));
    }
}

#[test]
fn bad_arguments_are_errors() {
    let _serial = serial();
    let g = gpu();
    let b = g.buffer(64, "b").unwrap();
    let mut pass = g.pass();
    let kv = KvShape {
        dtype: KvType::F32,
        n_head_kv: 1,
        head_dim: 6,
    };
    assert!(ga::write_kv(&mut pass, kv, &b, 0, 6, 1, &b, DstRows::Range { row0: 0 }).is_err());
    let kv = KvShape {
        dtype: KvType::F32,
        n_head_kv: 3,
        head_dim: 16,
    };
    let at = Attention {
        n_q: 1,
        n_head: 4,
        kv,
        scale: 1.0,
        q: QView {
            buf: &b,
            off: 0,
            tok_stride: 64,
            head_stride: 16,
        },
        out: OutView {
            buf: &b,
            off: 0,
            tok_stride: 64,
        },
        a: KvSource { k: &b, v: None },
        b: None,
        keys: Keys::Causal {
            row0: 0,
            pos0: 0,
            n_kv: 1,
            window: 0,
        },
        sinks: None,
        split: None,
    };
    assert!(
        ga::attention(&mut pass, &at).is_err(),
        "4 heads over 3 kv heads"
    );
    let small = g.buffer(16, "small").unwrap();
    let at = Attention {
        kv: KvShape { n_head_kv: 1, ..kv },
        split: Some((&small, 4)),
        ..at
    };
    assert!(ga::attention(&mut pass, &at).is_err(), "scratch too small");
}

/// Real sizes: Qwen3.5 (16 q / 2 kv × 256, f16 cache) prefill of 300 tokens and decode at
/// long context, DeepSeek-V4 (64 heads × 512, K = V, sinks, 128 + 256 indices).
#[test]
#[ignore = "real sizes: run once per kernel change (about 5 s on lavapipe)"]
fn real_sizes() {
    let _serial = serial();
    let c = Case {
        hd: 256,
        n_head: 16,
        n_kv: 2,
        n: 300,
        dtype: KvType::F16,
    };
    let (got, want) = causal_prefill(&c, 1, 500);
    assert_close(&got, &want, 1e-5, "qwen prefill 300");
    let (got, want) = causal_prefill(
        &Case {
            dtype: KvType::F32,
            ..c
        },
        5,
        501,
    );
    assert_close(&got, &want, 1e-5, "qwen prefill 300 f32 split 5");
    chunked_then_decode(256, 16, 2, &[100, 150], 6, KvType::F16);
    index_sink_case(512, 64, 2, 384, KvType::F16, 1, true);
    index_sink_case(512, 64, 2, 384, KvType::F16, 4, true);
}

/// Timing on the machine's adapter (meant for a real GPU): decode and prefill at model
/// sizes. Prints µs per call and the bandwidth / arithmetic rate it implies.
#[test]
#[ignore = "benchmark: run with --ignored --nocapture on a real GPU"]
fn bench_attention() {
    let _serial = serial();
    let g = gpu();
    let iters = |us_hint: f64| ((20_000.0 / us_hint.max(1.0)) as u32).clamp(3, 200);
    // Times `iters` calls recorded in one pass (after a warm-up pass).
    let time = |at: &Attention<'_>, n: u32| -> f64 {
        let run = |reps: u32| {
            let mut pass = g.pass();
            for _ in 0..reps {
                ga::attention(&mut pass, at).unwrap();
            }
            // GPU time: the queue starts at the end of submit (after encoding).
            let t0 = std::time::Instant::now();
            pass.submit().unwrap();
            let enc = t0.elapsed();
            g.wait().unwrap();
            (t0.elapsed() - enc).as_secs_f64() * 1e6 / reps as f64
        };
        run(1);
        let est = run(1);
        run(n.min(iters(est)))
    };
    let big = |bytes: u64, label: &str| g.buffer(bytes, label).unwrap();
    // Qwen3.5-35B-A3B full attention: 16 q / 2 kv heads × 256, f16 cache.
    {
        let kv = KvShape {
            dtype: KvType::F16,
            n_head_kv: 2,
            head_dim: 256,
        };
        let (nh, hd) = (16u32, 256u32);
        let ctx_max = 32768u32;
        let kc = big(kv.bytes(ctx_max as u64 * 16), "kc");
        let vc = big(kv.bytes(ctx_max as u64 * 16), "vc");
        let qb = big(4096 * 16 * 256 * 4, "q");
        let out = big(4096 * 16 * 256 * 4, "out");
        let scratch = big(ga::scratch_elems(16, nh, hd, 256) * 4, "scratch");
        for ctx in [1024u32, 4096, 32768] {
            let pick = ga::pick_n_split(1, nh, kv, ctx, false);
            for split in [16u32, 64, 128, 256, pick] {
                let at = Attention {
                    n_q: 1,
                    n_head: nh,
                    kv,
                    scale: 0.0625,
                    q: QView {
                        buf: &qb,
                        off: 0,
                        tok_stride: nh * hd,
                        head_stride: hd,
                    },
                    out: OutView {
                        buf: &out,
                        off: 0,
                        tok_stride: nh * hd,
                    },
                    a: KvSource {
                        k: &kc,
                        v: Some(&vc),
                    },
                    b: None,
                    keys: Keys::Causal {
                        row0: 0,
                        pos0: ctx - 1,
                        n_kv: ctx,
                        window: 0,
                    },
                    sinks: None,
                    split: (split > 1).then_some((&scratch, split)),
                };
                let us = time(&at, 100);
                let gb = kv.bytes(ctx as u64) as f64 * 2.0 / us / 1e3;
                eprintln!("qwen decode ctx {ctx:>6} split {split:>3}: {us:8.1} us  {gb:7.1} GB/s");
            }
        }
        // Batched decode: 16 sequences × 4096 keys each.
        let desc: Vec<u32> = (0..16u32).flat_map(|s| [s * ctx_max, 4096]).collect();
        let db = upload_u32(g, &desc, "desc");
        for split in [1u32, 4, 16, ga::pick_n_split(16, nh, kv, 4096, true)] {
            let at = Attention {
                n_q: 16,
                n_head: nh,
                kv,
                scale: 0.0625,
                q: QView {
                    buf: &qb,
                    off: 0,
                    tok_stride: nh * hd,
                    head_stride: hd,
                },
                out: OutView {
                    buf: &out,
                    off: 0,
                    tok_stride: nh * hd,
                },
                a: KvSource {
                    k: &kc,
                    v: Some(&vc),
                },
                b: None,
                keys: Keys::Ranges {
                    desc: &db,
                    off: 0,
                    max_keys: 4096,
                },
                sinks: None,
                split: (split > 1).then_some((&scratch, split)),
            };
            let us = time(&at, 100);
            let gb = kv.bytes(16 * 4096) as f64 * 2.0 / us / 1e3;
            eprintln!("qwen batch-16 decode ctx 4096 split {split:>3}: {us:8.1} us  {gb:7.1} GB/s");
        }
        for n in [512u32, 4096] {
            let at = Attention {
                n_q: n,
                n_head: nh,
                kv,
                scale: 0.0625,
                q: QView {
                    buf: &qb,
                    off: 0,
                    tok_stride: nh * hd,
                    head_stride: hd,
                },
                out: OutView {
                    buf: &out,
                    off: 0,
                    tok_stride: nh * hd,
                },
                a: KvSource {
                    k: &kc,
                    v: Some(&vc),
                },
                b: None,
                keys: Keys::Causal {
                    row0: 0,
                    pos0: 0,
                    n_kv: n,
                    window: 0,
                },
                sinks: None,
                split: None,
            };
            let us = time(&at, 20);
            let flop = 4.0 * hd as f64 * nh as f64 * (n as f64 * n as f64 / 2.0);
            eprintln!(
                "qwen prefill n {n:>5}: {us:10.1} us  {:7.2} TFLOP/s",
                flop / us / 1e6
            );
        }
    }
    // DeepSeek-V4-Flash: 64 heads × 512, one K = V head, sinks, window 128 + top-k entries.
    {
        let kv = KvShape {
            dtype: KvType::F16,
            n_head_kv: 1,
            head_dim: 512,
        };
        let (nh, hd) = (64u32, 512u32);
        let n_b = 65536u32;
        let ka = big(kv.bytes(128), "ring");
        let kb = big(kv.bytes(n_b as u64), "compressed");
        let qb = big(512 * 64 * 512 * 4, "q");
        let out = big(512 * 64 * 512 * 4, "out");
        let sinks = big(64 * 4, "sinks");
        let scratch = big(ga::scratch_elems(4, nh, hd, 256) * 4, "scratch");
        for (n_q, n_idx) in [(1u32, 640u32), (1, 2176), (4, 640), (512, 640)] {
            let mut idx = Vec::with_capacity((n_q * n_idx) as usize);
            for t in 0..n_q {
                idx.extend(0..128u32);
                idx.extend((0..n_idx - 128).map(|i| SRC_B | ((i * 97 + t * 13) % n_b)));
            }
            let ib = upload_u32(g, &idx, "idx");
            for split in [1u32, 16, 32, 64, ga::pick_n_split(n_q, nh, kv, n_idx, true)] {
                if n_q > 4 && split > 1 {
                    continue;
                }
                let at = Attention {
                    n_q,
                    n_head: nh,
                    kv,
                    scale: 1.0 / (hd as f32).sqrt(),
                    q: QView {
                        buf: &qb,
                        off: 0,
                        tok_stride: nh * hd,
                        head_stride: hd,
                    },
                    out: OutView {
                        buf: &out,
                        off: 0,
                        tok_stride: nh * hd,
                    },
                    a: KvSource { k: &ka, v: None },
                    b: Some(KvSource { k: &kb, v: None }),
                    keys: Keys::Index {
                        idx: &ib,
                        off: 0,
                        n_idx,
                    },
                    sinks: Some((&sinks, 0)),
                    split: (split > 1).then_some((&scratch, split)),
                };
                let us = time(&at, 100);
                let flop = 4.0 * hd as f64 * nh as f64 * n_idx as f64 * n_q as f64;
                eprintln!(
                    "dsv4 n_q {n_q:>3} n_idx {n_idx:>5} split {split:>2}: {us:9.1} us  {:6.2} TFLOP/s",
                    flop / us / 1e6
                );
            }
        }
    }
}
