//! Quantized matrix kernels (`gpu::matvec`, `gpu::matmul`) against the CPU reference
//! (`quant::quantize` to make weights from random normals, `quant::dequantize` + an f64 dot product
//! as the reference) on whatever adapter the machine has (lavapipe in CI).
//!
//! Tolerance for every output: |gpu − ref| ≤ 1e-4 · (1 + Σ_c |w_rc · x_c|). The kernels compute
//! in f32 from the exact dequantized weights, so the only difference from the reference is f32
//! rounding of products and partial sums (scales factored out of blocks, as ggml does).
//! Outputs are written into a buffer with guard elements before and after: those must keep
//! their sentinel value.

use lathe::gpu::matmul::{self, MoeRoute};
use lathe::gpu::matvec::{self, MatvecOpts};
use lathe::gpu::operand::Operand;
use lathe::gpu::{AdapterChoice, Gpu, GpuTensor, Pass, TensorPart};
use lathe::quant;
use lathe::tensor::TensorRef;
use lathe::DType;
use std::path::Path;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// One device for all tests (pipelines compile once).
fn gpu() -> &'static Gpu {
    static G: OnceLock<Gpu> = OnceLock::new();
    G.get_or_init(|| {
        let g = Gpu::new(&AdapterChoice::Auto).expect("a wgpu adapter (lavapipe in CI)");
        eprintln!("{}", g.report());
        g
    })
}

/// Passes of one `Gpu` share its uniform arena: record, submit and read back one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static L: Mutex<()> = Mutex::new(());
    L.lock().unwrap_or_else(|p| p.into_inner())
}

/// Every stored type the product kernels read.
const ALL: [DType; 17] = lathe::selftest::TYPES;

const SENTINEL: f32 = -12345.0;
const GUARD: usize = 5;

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }
    fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }
}

/// A weight made by quantizing random normals, with its dequantized values.
struct Weight {
    dtype: DType,
    shape: Vec<u64>,
    bytes: Vec<u8>,
    deq: Vec<f32>,
}

impl Weight {
    fn random(dtype: DType, shape: &[u64], seed: u64) -> Weight {
        let n: u64 = shape.iter().product();
        let mut rng = Rng::new(seed);
        // per-row scales vary so blocks see different ranges (and some rows have an offset,
        // which the min-carrying types must reproduce)
        let cols = *shape.last().unwrap() as usize;
        let mut x = rng.normals(n as usize, 1.0);
        for (r, row) in x.chunks_mut(cols).enumerate() {
            let s = 0.02 * (1.0 + (r % 5) as f32);
            let off = if r % 3 == 1 { 0.5 * s } else { 0.0 };
            row.iter_mut().for_each(|v| *v = *v * s + off);
        }
        let bytes = quant::quantize(dtype, &x).unwrap();
        let deq = quant::dequantize_to_vec(dtype, &bytes, n as usize).unwrap();
        Weight {
            dtype,
            shape: shape.to_vec(),
            bytes,
            deq,
        }
    }
    fn cols(&self) -> usize {
        *self.shape.last().unwrap() as usize
    }
    fn upload(&self, gpu: &Gpu) -> GpuTensor {
        gpu.upload_tensor(&TensorRef {
            name: "w",
            dtype: self.dtype,
            shape: &self.shape,
            data: &self.bytes,
            path: Path::new("test"),
        })
        .unwrap()
    }
    /// The same tensor split by hand into parts of `split` rows (whole units), as
    /// `upload_tensor` does past the binding limit.
    fn upload_parts(&self, gpu: &Gpu, split: &[u64]) -> GpuTensor {
        let row_bytes = self.bytes.len() as u64 / (self.deq.len() as u64 / self.cols() as u64);
        let mut parts = Vec::new();
        let mut r0 = 0;
        for &n in split {
            let b = &self.bytes[(r0 * row_bytes) as usize..((r0 + n) * row_bytes) as usize];
            parts.push(TensorPart {
                buffer: gpu.upload(b, "part").unwrap(),
                row_start: r0,
                n_rows: n,
            });
            r0 += n;
        }
        assert_eq!(r0 * row_bytes, self.bytes.len() as u64);
        GpuTensor {
            name: "w".into(),
            dtype: self.dtype,
            shape: self.shape.clone(),
            parts,
        }
    }
    /// (Σ w x, Σ |w x|) of row `r` (of the flattened tensor) with `x`, in f64.
    fn dot(&self, r: usize, x: &[f32]) -> (f64, f64) {
        let c = self.cols();
        let w = &self.deq[r * c..(r + 1) * c];
        w.iter().zip(x).fold((0.0, 0.0), |(s, a), (&w, &x)| {
            let p = w as f64 * x as f64;
            (s + p, a + p.abs())
        })
    }
}

/// An output buffer of `n` elements at offset GUARD, sentinels around.
fn out_buffer(gpu: &Gpu, n: usize) -> wgpu::Buffer {
    gpu.upload_f32(&vec![SENTINEL; n + 2 * GUARD], "y").unwrap()
}

/// Compare `got` (with guards) against the expected (value, Σ|terms|) list, `None` = untouched.
#[track_caller]
fn check(got: &[f32], want: &[Option<(f64, f64)>], what: &str) {
    assert_eq!(got.len(), want.len() + 2 * GUARD);
    let mut worst = 0f64;
    for (i, &g) in got.iter().enumerate() {
        let w = if i < GUARD || i >= GUARD + want.len() {
            None
        } else {
            want[i - GUARD]
        };
        match w {
            None => assert_eq!(
                g, SENTINEL,
                "{what}: element {i} outside the output was written"
            ),
            Some((v, a)) => {
                let err = (g as f64 - v).abs();
                let bound = 1e-4 * (1.0 + a);
                assert!(
                    err <= bound,
                    "{what}: element {} = {g}, want {v} (err {err:.3e} > {bound:.3e})",
                    i - GUARD
                );
                worst = worst.max(err / bound);
            }
        }
    }
    eprintln!("{what}: worst err / bound = {worst:.3}");
}

fn submit(pass: Pass<'_>) {
    pass.submit().unwrap();
}

/// Columns for a type: the smallest multiple of the block not a multiple of 64 (256 for K-quant
/// blocks, an odd number of 128-blocks for F8_E4M3_B128); for the float types an odd count (unaligned rows), a multiple of 4/8 that ends in a
/// partial 256-block, and whole 256-blocks (the vector path).
fn odd_cols(dt: DType) -> &'static [u64] {
    match dt {
        DType::F32 => &[161, 772, 768],
        DType::F16 | DType::BF16 => &[161, 776, 768],
        _ if dt.block_size() == 256 => &[768],
        DType::F8_E4M3_B128 => &[384],
        _ => &[160],
    }
}

/// y = W x for n_tokens tokens at offsets, plain strides.
fn run_matvec(
    dt: DType,
    rows: u64,
    cols: u64,
    n_tokens: usize,
    x_off: usize,
    opts: &MatvecOpts,
    seed: u64,
) {
    let g = gpu();
    let w = Weight::random(dt, &[rows, cols], seed);
    let c = cols as usize;
    let r = rows as usize;
    let x = Rng::new(seed ^ 77).normals(x_off + n_tokens * c, 1.0);
    let _l = serial();
    let wt = w.upload(g);
    let xb = g.upload_f32(&x, "x").unwrap();
    let yb = out_buffer(g, n_tokens * r);
    let mut pass = g.pass();
    matvec::matvec_opts(
        &mut pass,
        &wt,
        Operand::new(&xb, x_off as u32),
        Operand::new(&yb, GUARD as u32),
        n_tokens as u32,
        opts,
    )
    .unwrap();
    submit(pass);
    let got = g.read_f32(&yb, 0, n_tokens * r + 2 * GUARD).unwrap();
    let want: Vec<_> = (0..n_tokens * r)
        .map(|i| Some(w.dot(i % r, &x[x_off + (i / r) * c..][..c])))
        .collect();
    check(
        &got,
        &want,
        &format!("matvec {dt} {rows}x{cols} nt{n_tokens} x_off {x_off}"),
    );
}

#[test]
fn matvec_every_type_odd_sizes() {
    for (i, dt) in ALL.into_iter().enumerate() {
        for &cols in odd_cols(dt) {
            for (k, rows) in [1u64, 7, 33, 257].into_iter().enumerate() {
                let seed = (i * 100 + k) as u64 + cols;
                run_matvec(dt, rows, cols, 1, 4, &MatvecOpts::default(), seed);
            }
            run_matvec(dt, 33, cols, 3, 0, &MatvecOpts::default(), 7 + i as u64);
        }
    }
}

#[test]
fn matvec_options_and_paths() {
    // unaligned x (scalar loads), the portable reduction, other work splits, 8 tokens
    for dt in [
        DType::Q4_K,
        DType::Q8_0,
        DType::MXFP4,
        DType::F16,
        DType::Q6_K,
    ] {
        let cols = *odd_cols(dt).last().unwrap();
        run_matvec(dt, 33, cols, 2, 3, &MatvecOpts::default(), 1);
        let portable = MatvecOpts {
            portable: true,
            ..Default::default()
        };
        run_matvec(dt, 257, cols, 1, 0, &portable, 2);
        run_matvec(dt, 33, cols, 8, 0, &MatvecOpts::default(), 3);
        // with row quads (8, 12, 16 rows: 45 rows end in a partial quad and a partial group)
        for tune in [
            (64, 1, None),
            (256, 4, None),
            (16, 2, None),
            (128, 3, None),
            (64, 8, None),
            (128, 12, Some(16)),
            (256, 16, Some(64)),
        ] {
            let o = MatvecOpts {
                tune: Some(matvec::Tune {
                    wg: tune.0,
                    rows: tune.1,
                    lanes: tune.2,
                }),
                ..Default::default()
            };
            run_matvec(dt, 45, cols, 1, 0, &o, 4);
        }
    }
    // a long row: several chunks per thread
    run_matvec(DType::Q4_K, 9, 256 * 40, 1, 0, &MatvecOpts::default(), 5);
    run_matvec(DType::Q6_K, 9, 256 * 21, 2, 0, &MatvecOpts::default(), 6);
}

/// y of `matvec_opts` (or of the indexed product over experts `ids` when given) for a tune.
fn tuned_bits(
    wt: &GpuTensor,
    xb: &wgpu::Buffer,
    ids: Option<&wgpu::Buffer>,
    n: usize,
    tune: matvec::Tune,
) -> Vec<u32> {
    let g = gpu();
    let yb = out_buffer(g, n);
    let o = MatvecOpts {
        tune: Some(tune),
        ..Default::default()
    };
    let mut pass = g.pass();
    match ids {
        None => matvec::matvec_opts(
            &mut pass,
            wt,
            Operand::new(xb, 0),
            Operand::new(&yb, 0),
            2,
            &o,
        )
        .unwrap(),
        Some(ids) => matvec::matvec_indexed(
            &mut pass,
            wt,
            Operand::new(xb, 0),
            &matvec::Pairs {
                ids: Operand::new(ids, 0),
                n_tokens: 2,
                n_used: 2,
                x_per_pair: false,
            },
            Operand::new(&yb, 0),
            &o,
        )
        .unwrap(),
    }
    submit(pass);
    g.read_f32(&yb, 0, n)
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn row_quads_keep_each_rows_bits() {
    // Rows per thread group only decide which lanes' registers hold a row: with the same lanes
    // per row, 8/12/16 rows (quads sharing the x loads) give the bits of 1, 2 or 4.
    let g = gpu();
    for dt in [DType::Q4_K, DType::Q6_K, DType::BF16] {
        let cols = *odd_cols(dt).last().unwrap();
        let rows = 37u64;
        let w = Weight::random(dt, &[rows, cols], 11);
        let we = Weight::random(dt, &[3, rows, cols], 12);
        let x = Rng::new(5).normals(2 * cols as usize, 1.0);
        let _l = serial();
        let (wt, wet) = (w.upload(g), we.upload(g));
        let xb = g.upload_f32(&x, "x").unwrap();
        let ids = g
            .upload(bytemuck::cast_slice(&[2u32, 0, 1, 2]), "ids")
            .unwrap();
        let t = |wg, rows| matvec::Tune {
            wg,
            rows,
            lanes: Some(16),
        };
        let n = 2 * rows as usize;
        let base = tuned_bits(&wt, &xb, None, n, t(64, 4));
        let base_id = tuned_bits(&wet, &xb, Some(&ids), 2 * n, t(64, 4));
        for (wg, r) in [(64, 8), (128, 12), (16, 16)] {
            assert_eq!(
                tuned_bits(&wt, &xb, None, n, t(wg, r)),
                base,
                "{dt} wg{wg} rows {r}"
            );
            assert_eq!(
                tuned_bits(&wet, &xb, Some(&ids), 2 * n, t(wg, r)),
                base_id,
                "{dt} indexed wg{wg} rows {r}"
            );
        }
    }
}

#[test]
fn matvec_accumulate_and_strides() {
    let g = gpu();
    let (rows, cols, nt) = (37usize, 256usize, 3usize);
    let w = Weight::random(DType::Q4_K, &[rows as u64, cols as u64], 11);
    // x rows 300 apart, y rows 50 apart, y starts from a known value
    let (xs, ys) = (300usize, 50usize);
    let x = Rng::new(12).normals(nt * xs, 1.0);
    let y0 = Rng::new(13).normals(nt * ys, 1.0);
    let _l = serial();
    let wt = w.upload(g);
    let xb = g.upload_f32(&x, "x").unwrap();
    let yb = g.upload_f32(&y0, "y").unwrap();
    let mut pass = g.pass();
    let o = MatvecOpts {
        accumulate: true,
        ..Default::default()
    };
    let (xo, yo) = (
        Operand::strided(&xb, 0, xs as u32),
        Operand::strided(&yb, 0, ys as u32),
    );
    matvec::matvec_opts(&mut pass, &wt, xo, yo, nt as u32, &o).unwrap();
    submit(pass);
    let got = g.read_f32(&yb, 0, nt * ys).unwrap();
    for t in 0..nt {
        for i in 0..ys {
            let want = if i < rows {
                let (s, a) = w.dot(i, &x[t * xs..t * xs + cols]);
                (y0[t * ys + i] as f64 + s, a + y0[t * ys + i].abs() as f64)
            } else {
                (y0[t * ys + i] as f64, 0.0)
            };
            let err = (got[t * ys + i] as f64 - want.0).abs();
            assert!(
                err <= 1e-4 * (1.0 + want.1),
                "token {t} row {i}: {} vs {}",
                got[t * ys + i],
                want.0
            );
        }
    }
}

/// Y = X Wᵀ through the tiled kernel (and through `matmul`'s choice).
fn run_matmul(dt: DType, rows: u64, cols: u64, n_tokens: usize, tiled: bool, seed: u64) {
    let g = gpu();
    let w = Weight::random(dt, &[rows, cols], seed);
    let (r, c) = (rows as usize, cols as usize);
    let x = Rng::new(seed ^ 5).normals(n_tokens * c, 1.0);
    let _l = serial();
    let wt = w.upload(g);
    let xb = g.upload_f32(&x, "x").unwrap();
    let yb = out_buffer(g, n_tokens * r);
    let mut pass = g.pass();
    if tiled {
        matmul::matmul_tiled(
            &mut pass,
            &wt,
            Operand::new(&xb, 0),
            Operand::new(&yb, GUARD as u32),
            n_tokens as u32,
            &MatvecOpts::default(),
        )
        .unwrap();
    } else {
        matmul::matmul(
            &mut pass,
            &wt,
            Operand::new(&xb, 0),
            Operand::new(&yb, GUARD as u32),
            n_tokens as u32,
        )
        .unwrap();
    }
    submit(pass);
    let got = g.read_f32(&yb, 0, n_tokens * r + 2 * GUARD).unwrap();
    let want: Vec<_> = (0..n_tokens * r)
        .map(|i| Some(w.dot(i % r, &x[(i / r) * c..][..c])))
        .collect();
    check(
        &got,
        &want,
        &format!("matmul {dt} {rows}x{cols} tokens {n_tokens} tiled {tiled}"),
    );
}

#[test]
fn matmul_every_type() {
    for (i, dt) in ALL.into_iter().enumerate() {
        for &cols in odd_cols(dt) {
            run_matmul(dt, 70, cols, 67, true, 40 + i as u64);
        }
    }
}

#[test]
fn matmul_token_counts() {
    for dt in [DType::Q4_K, DType::Q8_0, DType::F32] {
        let cols = *odd_cols(dt).last().unwrap();
        for nt in [1, 5] {
            run_matmul(dt, 33, cols, nt, true, nt as u64);
            run_matmul(dt, 33, cols, nt, false, nt as u64);
        }
        run_matmul(dt, 129, cols, 67, false, 9);
    }
}

#[test]
fn multi_part_weights() {
    let g = gpu();
    for dt in [DType::Q6_K, DType::Q8_0, DType::BF16, DType::F8_E4M3_B128] {
        let cols = *odd_cols(dt).last().unwrap() as usize;
        let rows = 257usize;
        let w = Weight::random(dt, &[rows as u64, cols as u64], 21);
        let x = Rng::new(22).normals(67 * cols, 1.0);
        let _l = serial();
        let wt = w.upload_parts(g, &[100, 1, 156]);
        let xb = g.upload_f32(&x, "x").unwrap();
        for nt in [2usize, 67] {
            let yb = out_buffer(g, nt * rows);
            let mut pass = g.pass();
            matmul::matmul(
                &mut pass,
                &wt,
                Operand::new(&xb, 0),
                Operand::new(&yb, GUARD as u32),
                nt as u32,
            )
            .unwrap();
            submit(pass);
            let got = g.read_f32(&yb, 0, nt * rows + 2 * GUARD).unwrap();
            let want: Vec<_> = (0..nt * rows)
                .map(|i| Some(w.dot(i % rows, &x[(i / rows) * cols..][..cols])))
                .collect();
            check(&got, &want, &format!("3-part {dt} tokens {nt}"));
        }
    }
}

/// MoE: expert stack [n_expert, rows, cols], ids [n_tokens, n_used], both decode and prefill
/// forms, x per token and per pair, the stack whole and split in parts of whole experts.
fn run_indexed(dt: DType, split: Option<&[u64]>, seed: u64) {
    let g = gpu();
    let (ne, rows, n_used) = (6usize, 45usize, 3usize);
    let cols = odd_cols(dt)[0] as usize;
    let w = Weight::random(dt, &[ne as u64, rows as u64, cols as u64], seed);
    let mut rng = Rng::new(seed ^ 3);
    for nt in [1usize, 2, 70] {
        let np = nt * n_used;
        // distinct experts per token, plus one invalid id (>= ne: its pair gets no output)
        let mut ids = Vec::new();
        for t in 0..nt {
            let first = (rng.uniform() * ne as f64) as usize;
            for s in 0..n_used {
                ids.push(((first + 2 * s) % ne) as u32);
            }
            if t == 1 {
                ids[t * n_used + 1] = 99;
            }
        }
        let _l = serial();
        let wt = match split {
            Some(s) => w.upload_parts(g, &s.iter().map(|e| e * rows as u64).collect::<Vec<_>>()),
            None => w.upload(g),
        };
        let idb = g
            .upload(
                bytemuck::cast_slice(&[[7u32, 7, 7].as_slice(), &ids].concat()),
                "ids",
            )
            .unwrap();
        for per_pair in [false, true] {
            let xr = if per_pair { np } else { nt };
            let x = rng.normals(xr * cols, 1.0);
            let xb = g.upload_f32(&x, "x").unwrap();
            let yb = out_buffer(g, np * rows);
            let mut pass = g.pass();
            if nt <= 2 {
                matvec::matvec_indexed(
                    &mut pass,
                    &wt,
                    Operand::new(&xb, 0),
                    &matvec::Pairs {
                        ids: Operand::new(&idb, 3),
                        n_tokens: nt as u32,
                        n_used: n_used as u32,
                        x_per_pair: per_pair,
                    },
                    Operand::new(&yb, GUARD as u32),
                    &MatvecOpts::default(),
                )
                .unwrap();
            } else {
                let route = MoeRoute::new(g, ne as u32, (np + 5) as u32).unwrap();
                matmul::route(&mut pass, &route, &idb, 3, nt as u32, n_used as u32).unwrap();
                matmul::matmul_indexed(
                    &mut pass,
                    &wt,
                    Operand::new(&xb, 0),
                    &matmul::RoutePairs {
                        route: &route,
                        n_tokens: nt as u32,
                        n_used: n_used as u32,
                        x_per_pair: per_pair,
                    },
                    Operand::new(&yb, GUARD as u32),
                    &MatvecOpts::default(),
                )
                .unwrap();
            }
            submit(pass);
            let got = g.read_f32(&yb, 0, np * rows + 2 * GUARD).unwrap();
            let want: Vec<_> = (0..np * rows)
                .map(|i| {
                    let (q, r) = (i / rows, i % rows);
                    let e = ids[q] as usize;
                    if e >= ne {
                        return None;
                    }
                    let xq = if per_pair { q } else { q / n_used };
                    Some(w.dot(e * rows + r, &x[xq * cols..][..cols]))
                })
                .collect();
            check(
                &got,
                &want,
                &format!("indexed {dt} tokens {nt} per_pair {per_pair} split {split:?}"),
            );
        }
    }
}

#[test]
fn indexed_moe() {
    for (i, dt) in [
        DType::Q4_K,
        DType::MXFP4,
        DType::Q8_0,
        DType::F16,
        DType::Q5_0,
        DType::F8_E4M3_B128,
    ]
    .into_iter()
    .enumerate()
    {
        run_indexed(dt, None, 60 + i as u64);
    }
    run_indexed(DType::Q6_K, Some(&[2, 1, 3]), 70);
}

#[test]
fn bad_input_is_an_error() {
    let g = gpu();
    let w = Weight::random(DType::Q4_0, &[4, 64], 1);
    let _l = serial();
    let wt = w.upload(g);
    let xb = g.upload_f32(&[0.0; 64], "x").unwrap();
    let yb = g.buffer(16, "y").unwrap();
    let mut pass = g.pass();
    // x too short for 2 tokens, y too short for an offset, 9 tokens, a 3-D weight
    assert!(matvec::matvec(
        &mut pass,
        &wt,
        Operand::new(&xb, 0),
        Operand::new(&yb, 0),
        2
    )
    .is_err());
    assert!(matvec::matvec(
        &mut pass,
        &wt,
        Operand::new(&xb, 0),
        Operand::new(&yb, 1),
        1
    )
    .is_err());
    assert!(matvec::matvec(
        &mut pass,
        &wt,
        Operand::new(&xb, 0),
        Operand::new(&yb, 0),
        9
    )
    .is_err());
    let mut w3 = wt.clone();
    w3.shape = vec![2, 2, 64];
    assert!(matvec::matvec(
        &mut pass,
        &w3,
        Operand::new(&xb, 0),
        Operand::new(&yb, 0),
        1
    )
    .is_err());
    let mut wi = wt.clone();
    wi.dtype = DType::I32;
    assert!(matvec::matvec(
        &mut pass,
        &wi,
        Operand::new(&xb, 0),
        Operand::new(&yb, 0),
        1
    )
    .is_err());
    assert!(pass.is_empty());
}

// ---- real sizes (slow on lavapipe: run with --ignored) ----

fn real(dt: DType, rows: u64, cols: u64, n_tokens: usize) {
    let g = gpu();
    let t0 = std::time::Instant::now();
    let w = Weight::random(dt, &[rows, cols], rows ^ cols);
    eprintln!("{dt} {rows}x{cols}: weights made in {:.1?}", t0.elapsed());
    let (r, c) = (rows as usize, cols as usize);
    let x = Rng::new(3).normals(n_tokens * c, 1.0);
    let _l = serial();
    let wt = w.upload(g);
    let xb = g.upload_f32(&x, "x").unwrap();
    let yb = out_buffer(g, n_tokens * r);
    let mut pass = g.pass();
    matmul::matmul(
        &mut pass,
        &wt,
        Operand::new(&xb, 0),
        Operand::new(&yb, GUARD as u32),
        n_tokens as u32,
    )
    .unwrap();
    submit(pass);
    let got = g.read_f32(&yb, 0, n_tokens * r + 2 * GUARD).unwrap();
    let want: Vec<_> = (0..n_tokens * r)
        .map(|i| Some(w.dot(i % r, &x[(i / r) * c..][..c])))
        .collect();
    check(
        &got,
        &want,
        &format!("real {dt} {rows}x{cols} tokens {n_tokens}"),
    );
}

#[test]
#[ignore]
fn real_q4_k_4096() {
    real(DType::Q4_K, 4096, 4096, 1);
    real(DType::Q4_K, 4096, 4096, 16);
}

#[test]
#[ignore]
fn real_q6_k_12288() {
    real(DType::Q6_K, 12288, 4096, 1);
}

#[test]
#[ignore]
fn real_q8_0_12288() {
    real(DType::Q8_0, 12288, 4096, 2);
}

#[test]
#[ignore]
fn real_mxfp4_bf16_f16() {
    real(DType::MXFP4, 2048, 4096, 1);
    real(DType::BF16, 4096, 2048, 1);
    real(DType::F16, 2048, 4096, 3);
    real(DType::Q5_K, 4096, 4096, 1);
}

/// FP8 blocks as DeepSeek's releases make them (power-of-two E8M0 scales, here 2^-20..2^3)
/// over every e4m3 code but NaN, subnormals included, at DeepSeek-V4's row width (7168 =
/// 56 blocks): matvec and the tiled matmul against the CPU reference.
#[test]
fn f8_every_code_and_scale() {
    let g = gpu();
    let (rows, cols) = (37usize, 7168usize);
    let codes: Vec<u8> = (0..=255u8).filter(|b| b & 0x7f != 0x7f).collect();
    let mut bytes = Vec::new();
    for r in 0..rows {
        for b in 0..cols / 128 {
            let e = (r * 7 + b * 3) % 24;
            bytes.extend(2f32.powi(e as i32 - 20).to_le_bytes());
            bytes.extend((0..128).map(|j| codes[(r * 31 + b * 128 + j) % codes.len()]));
        }
    }
    let dt = DType::F8_E4M3_B128;
    let deq = quant::dequantize_to_vec(dt, &bytes, rows * cols).unwrap();
    assert!(deq.iter().all(|v| v.is_finite()));
    let w = Weight {
        dtype: dt,
        shape: vec![rows as u64, cols as u64],
        bytes,
        deq,
    };
    let x = Rng::new(8).normals(67 * cols, 1.0);
    let _l = serial();
    let wt = w.upload(g);
    let xb = g.upload_f32(&x, "x").unwrap();
    for nt in [1usize, 3, 67] {
        let yb = out_buffer(g, nt * rows);
        let mut pass = g.pass();
        matmul::matmul(
            &mut pass,
            &wt,
            Operand::new(&xb, 0),
            Operand::new(&yb, GUARD as u32),
            nt as u32,
        )
        .unwrap();
        submit(pass);
        let got = g.read_f32(&yb, 0, nt * rows + 2 * GUARD).unwrap();
        let want: Vec<_> = (0..nt * rows)
            .map(|i| Some(w.dot(i % rows, &x[(i / rows) * cols..][..cols])))
            .collect();
        check(&got, &want, &format!("F8 every code, tokens {nt}"));
    }
}

#[test]
#[ignore]
fn real_f8_e4m3_b128() {
    // DeepSeek-V4-Flash: wq_a-like [1024, 4096], a [4096, 7168] projection, prefill width
    real(DType::F8_E4M3_B128, 1024, 4096, 1);
    real(DType::F8_E4M3_B128, 4096, 7168, 1);
    real(DType::F8_E4M3_B128, 4096, 7168, 16);
}

/// Every variant this family compiles must also translate to MSL and HLSL (Metal, DX12), as
/// `tests/shaders.rs` checks for a model's forward pass: compile all of them here on tiny inputs.
#[test]
fn variants_translate_to_every_backend() {
    let g = gpu();
    let _l = serial();
    for dt in ALL {
        // the vector path of every type (other tests cover the float element-by-element paths,
        // which share their code)
        for &cols in &odd_cols(dt)[odd_cols(dt).len() - 1..] {
            let w = Weight::random(dt, &[2, 8, cols], 3);
            let w2 = Weight::random(dt, &[8, cols], 3);
            let (wt, wt2) = (w.upload(g), w2.upload(g));
            let xb = g.upload_f32(&vec![0.5; 16 * cols as usize], "x").unwrap();
            let yb = g.buffer(16 * 16 * 4, "y").unwrap();
            let ids = g
                .upload(bytemuck::cast_slice(&[0u32, 1, 1, 0]), "ids")
                .unwrap();
            let route = MoeRoute::new(g, 2, 4).unwrap();
            let mut pass = g.pass();
            let portable = MatvecOpts {
                portable: true,
                ..Default::default()
            };
            let opts: &[&MatvecOpts] = if dt == DType::Q4_K {
                &[&MatvecOpts::default(), &portable]
            } else {
                &[&MatvecOpts::default()]
            };
            for o in opts {
                matvec::matvec_opts(
                    &mut pass,
                    &wt2,
                    Operand::new(&xb, 0),
                    Operand::new(&yb, 0),
                    2,
                    o,
                )
                .unwrap();
                matvec::matvec_indexed(
                    &mut pass,
                    &wt,
                    Operand::new(&xb, 0),
                    &matvec::Pairs {
                        ids: Operand::new(&ids, 0),
                        n_tokens: 2,
                        n_used: 2,
                        x_per_pair: true,
                    },
                    Operand::new(&yb, 0),
                    o,
                )
                .unwrap();
            }
            // the fused forms: RMSNorm prologue with the SwiGLU store, one token and a token
            // group
            let nwb = g.upload_f32(&vec![1.0; cols as usize], "nw").unwrap();
            let pro = matvec::Prologue::RmsNorm {
                w: &nwb,
                eps: 1e-6,
                keep: None,
            };
            let raw = matvec::Prologue::RmsNormRaw {
                raw: &xb,
                eps: 1e-6,
            };
            let nwr = g.upload_f32(&[1.0; 8], "nw rows").unwrap();
            let hn = g.buffer(16 * 16 * 4, "hn").unwrap();
            let normed = matvec::Epilogue::Normed { w: &nwr, out: &hn };
            for nt in [1, 2] {
                let (o, epi) = (&MatvecOpts::default(), matvec::Epilogue::SwiGlu);
                matvec::matvec_fused(
                    &mut pass,
                    &wt2,
                    Operand::new(&xb, 0),
                    Operand::new(&yb, 0),
                    nt,
                    o,
                    matvec::Fused {
                        pro: Some(&pro),
                        epi,
                    },
                )
                .unwrap();
                // the residual product's normed store, read by the next through RmsNormRaw
                matvec::matvec_fused(
                    &mut pass,
                    &wt2,
                    Operand::new(&xb, 0),
                    Operand::new(&yb, 0),
                    nt,
                    o,
                    matvec::Fused {
                        pro: Some(&raw),
                        epi: normed,
                    },
                )
                .unwrap();
            }
            matmul::matmul_tiled(
                &mut pass,
                &wt2,
                Operand::new(&xb, 0),
                Operand::new(&yb, 0),
                9,
                &MatvecOpts::default(),
            )
            .unwrap();
            matmul::route(&mut pass, &route, &ids, 0, 2, 2).unwrap();
            matmul::matmul_indexed(
                &mut pass,
                &wt,
                Operand::new(&xb, 0),
                &matmul::RoutePairs {
                    route: &route,
                    n_tokens: 2,
                    n_used: 2,
                    x_per_pair: false,
                },
                Operand::new(&yb, 0),
                &MatvecOpts::default(),
            )
            .unwrap();
            submit(pass);
        }
    }
    g.wait().unwrap();
    let mut n = 0;
    for spec in g.compiled_specs() {
        if !(spec.label.starts_with("matvec") || spec.label.starts_with("matmul")) {
            continue;
        }
        n += 1;
        let wgsl = spec.wgsl().unwrap();
        let module = naga::front::wgsl::parse_str(&wgsl).unwrap();
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}: {e:?}", spec.label));
        let mut msl = String::new();
        naga::back::msl::Writer::new(&mut msl)
            .write(&module, &info, &Default::default(), &Default::default())
            .unwrap_or_else(|e| panic!("{}: MSL: {e}", spec.label));
        let mut hlsl = String::new();
        let hopts = naga::back::hlsl::Options::default();
        naga::back::hlsl::Writer::new(&mut hlsl, &hopts, &Default::default())
            .write(&module, &info, None)
            .unwrap_or_else(|e| panic!("{}: HLSL: {e}", spec.label));
    }
    eprintln!("{n} matvec / matmul variants translated");
    assert!(n >= 16 * 4, "expected every type's variants, got {n}");
}

// ---- int8 activations (matvec::quantize_x2 + matvec_q8x) ----
//
// Two references per output: (1) the product with the two-level x̂ = d·q + d₂·q₂ the GPU
// quantized (read back, so a rounding tie decided differently by the GPU's 1/d cannot fail the
// test): the integer sums are exact and only f32 rounding of scales remains, tolerance
// 1e-4·(1 + Σ|w x̂|) as above; (2) the product with the f32 x: off by at most
// Σ_blocks d₂/2·Σ|w| (each |x − x̂| ≤ d₂/2, d₂ = max|x − d·q|/127 of the block) plus the same
// f32 tolerance, a bound one level (d/2) exceeds by ~250x.

const Q8X_TYPES: [DType; 5] = [
    DType::Q8_0,
    DType::Q4_K,
    DType::Q6_K,
    DType::Q4_0,
    DType::Q5_K,
];

/// The types the int8 matmul reads as integer codes (`matmul::int8_supported`).
const MM_Q8_TYPES: [DType; 7] = [
    DType::Q8_0,
    DType::Q4_K,
    DType::Q6_K,
    DType::Q4_0,
    DType::Q5_K,
    DType::IQ4_NL,
    DType::MXFP4,
];

/// x with a spread of block ranges: normals, every 5th block scaled by 30, one block of zeros.
fn q8x_input(n: usize, seed: u64) -> Vec<f32> {
    let mut x = Rng::new(seed).normals(n, 1.0);
    for (b, blk) in x.chunks_mut(32).enumerate() {
        match b % 7 {
            3 => blk.iter_mut().for_each(|v| *v *= 30.0),
            5 if b == 5 => blk.iter_mut().for_each(|v| *v = 0.0),
            _ => {}
        }
    }
    x
}

/// Reads back what `qx` holds.
fn read_quant_x(g: &Gpu, qx: &matvec::QuantX) -> lathe::cpu::q8x::QuantizedX {
    let nb = (qx.n_tokens * qx.cols / 32) as usize;
    let words = g.read_u32(&qx.qs, 0, nb * 8).unwrap();
    let sc = g.read_f32(&qx.scales, 0, nb * 2).unwrap();
    lathe::cpu::q8x::QuantizedX::from_gpu(&words, &sc, qx.cols as usize)
}

/// Reads back both levels of what `qx` holds (`matvec::quantize_x2`).
fn read_quant_x2(
    g: &Gpu,
    qx: &matvec::QuantX,
) -> (lathe::cpu::q8x::QuantizedX, lathe::cpu::q8x::QuantizedX) {
    assert!(qx.two);
    let nb = (qx.n_tokens * qx.cols / 32) as usize;
    let words = g.read_u32(&qx.qs, 0, nb * 16).unwrap();
    let sc = g.read_f32(&qx.scales, 0, nb * 4).unwrap();
    lathe::cpu::q8x::QuantizedX::from_gpu2(&words, &sc, qx.cols as usize)
}

#[test]
fn int8_x_quantize_matches_cpu() {
    let g = gpu();
    let _l = serial();
    for (cols, nt, x_off, stride) in [
        (32usize, 1usize, 0usize, 0usize),
        (96, 3, 5, 101),
        (4096, 2, 4, 0),
    ] {
        let st = if stride == 0 { cols } else { stride };
        let x = q8x_input(x_off + nt * st, cols as u64);
        let xb = g.upload_f32(&x, "x").unwrap();
        let mut qx = matvec::QuantX::new(g, nt as u32, cols as u32).unwrap();
        let mut pass = g.pass();
        matvec::quantize_x(
            &mut pass,
            // stride 0: packed rows
            Operand {
                buf: &xb,
                off: x_off as u32,
                stride: (stride != 0).then_some(stride as u32),
            },
            nt as u32,
            cols as u32,
            &mut qx,
        )
        .unwrap();
        submit(pass);
        let got = read_quant_x(g, &qx);
        let rows: Vec<f32> = (0..nt)
            .flat_map(|t| x[x_off + t * st..][..cols].to_vec())
            .collect();
        let want = lathe::cpu::q8x::quantize_x(&rows, cols);
        let mut differ = 0;
        for (b, (gs, ws)) in got.scales.iter().zip(&want.scales).enumerate() {
            assert!(
                (gs[0] - ws[0]).abs() <= 2e-7 * ws[0],
                "cols {cols} block {b}: d {} want {}",
                gs[0],
                ws[0]
            );
            let codes = &got.qs[32 * b..32 * b + 32];
            let sum: i32 = codes.iter().map(|&c| c as i32).sum();
            assert!(
                (gs[1] - gs[0] * sum as f32).abs() <= 1e-6 * gs[1].abs(),
                "block {b}: s"
            );
            for (i, (&q, &v)) in codes.iter().zip(&rows[32 * b..32 * b + 32]).enumerate() {
                let wq = want.qs[32 * b + i];
                // the code rounds v / d: a different code only at a near tie
                let e = (v / ws[0].max(f32::MIN_POSITIVE)) - q as f32;
                assert!(
                    q == wq || ((q as i32 - wq as i32).abs() == 1 && (e.abs() - 0.5).abs() < 1e-4),
                    "cols {cols} block {b} element {i}: code {q}, want {wq} (x {v})"
                );
                assert!(q.unsigned_abs() <= 127);
                differ += (q != wq) as usize;
            }
        }
        assert!(
            differ * 1000 <= rows.len(),
            "{differ} codes differ from the CPU's"
        );
        eprintln!("int8 x {nt}x{cols}: {differ} near-tie codes differ");
    }
}

/// quantize_x2 + matvec_q8x of a [rows, cols] weight for n tokens, against both references.
fn run_q8x(dt: DType, rows: u64, cols: u64, n_tokens: usize, seed: u64) {
    let g = gpu();
    let w = Weight::random(dt, &[rows, cols], seed);
    let (r, c) = (rows as usize, cols as usize);
    let x = q8x_input(n_tokens * c, seed ^ 99);
    let _l = serial();
    let wt = w.upload(g);
    let xb = g.upload_f32(&x, "x").unwrap();
    let yb = out_buffer(g, n_tokens * r);
    let mut qx = matvec::QuantX::new(g, 2 * n_tokens as u32, cols as u32).unwrap();
    let mut pass = g.pass();
    matvec::quantize_x2(
        &mut pass,
        Operand::new(&xb, 0),
        n_tokens as u32,
        cols as u32,
        &mut qx,
    )
    .unwrap();
    matvec::matvec_q8x(
        &mut pass,
        &wt,
        &qx,
        Operand::new(&yb, GUARD as u32),
        &MatvecOpts::default(),
    )
    .unwrap();
    submit(pass);
    let got = g.read_f32(&yb, 0, n_tokens * r + 2 * GUARD).unwrap();
    let (q1, q) = read_quant_x2(g, &qx);
    let xh = lathe::cpu::q8x::dequantize2(&q1, &q);
    let what = format!("q8x {dt} {rows}x{cols} nt{n_tokens}");
    let want: Vec<_> = (0..n_tokens * r)
        .map(|i| Some(w.dot(i % r, &xh[(i / r) * c..][..c])))
        .collect();
    check(&got, &want, &what);
    let mut worst = 0f64;
    for i in 0..n_tokens * r {
        let (t, row) = (i / r, i % r);
        let (v, a) = w.dot(row, &x[t * c..][..c]);
        let bound = q.error_bound(t, &w.deq[row * c..][..c]) + 1e-4 * (1.0 + a);
        let err = (got[GUARD + i] as f64 - v).abs();
        assert!(
            err <= bound,
            "{what}: element {i} = {}, f32-x value {v} (err {err:.3e} > {bound:.3e})",
            got[GUARD + i]
        );
        worst = worst.max(err / bound);
    }
    eprintln!("{what}: against f32 x, worst err / quantization bound = {worst:.3}");
}

#[test]
fn int8_x_matvec_odd_sizes() {
    for (i, dt) in Q8X_TYPES.into_iter().enumerate() {
        let small = dt.block_size() as u64;
        for (k, rows) in [1u64, 7, 33, 257].into_iter().enumerate() {
            for (j, cols) in [small, 3 * small, 4096].into_iter().enumerate() {
                let nt = [1, 3, 8][(k + j) % 3];
                run_q8x(dt, rows, cols, nt, (i * 100 + k * 10 + j) as u64);
            }
        }
    }
}

#[test]
fn int8_x_one_step_options_and_parts() {
    let g = gpu();
    for dt in Q8X_TYPES {
        let (rows, cols, nt) = (40u64, 512u64, 2usize);
        let (r, c) = (rows as usize, cols as usize);
        let w = Weight::random(dt, &[rows, cols], 11);
        let (x_off, x_stride, y_stride) = (3usize, c + 7, r + 3);
        let x = q8x_input(x_off + nt * x_stride, 5);
        let _l = serial();
        // split rows: the product runs one dispatch per part
        let wt = w.upload_parts(g, &[16, 24]);
        let xb = g.upload_f32(&x, "x").unwrap();
        let n_out = (nt - 1) * y_stride + r;
        let init: Vec<f32> = (0..n_out + 2 * GUARD).map(|i| i as f32 * 0.25).collect();
        let yb = g.upload_f32(&init, "y").unwrap();
        let opts = MatvecOpts {
            int8_x: true,
            accumulate: true,
            ..Default::default()
        };
        let portable = MatvecOpts {
            portable: true,
            accumulate: false,
            ..opts
        };
        let y2 = g.buffer(4 * (n_out + 2 * GUARD) as u64, "y2").unwrap();
        let mut pass = g.pass();
        let xo = Operand::strided(&xb, x_off as u32, x_stride as u32);
        let yo = Operand::strided(&yb, GUARD as u32, y_stride as u32);
        let yp = Operand::strided(&y2, GUARD as u32, y_stride as u32);
        matmul::matmul_opts(&mut pass, &wt, xo, yo, nt as u32, &opts).unwrap();
        matvec::matvec_opts(&mut pass, &wt, xo, yp, nt as u32, &portable).unwrap();
        submit(pass);
        let got = g.read_f32(&yb, 0, n_out + 2 * GUARD).unwrap();
        let got2 = g.read_f32(&y2, 0, n_out + 2 * GUARD).unwrap();
        let rows_x: Vec<f32> = (0..nt)
            .flat_map(|t| x[x_off + t * x_stride..][..c].to_vec())
            .collect();
        let (q1, q) = lathe::cpu::q8x::quantize_x2(&rows_x, c);
        let xh = lathe::cpu::q8x::dequantize2(&q1, &q);
        for i in 0..n_out + 2 * GUARD {
            let o = i.wrapping_sub(GUARD);
            let (t, row) = (o / y_stride, o % y_stride);
            if i < GUARD || o >= n_out || row >= r {
                assert_eq!(
                    got[i], init[i],
                    "{dt}: element {i} outside the output was written"
                );
                assert_eq!(
                    got2[i], 0.0,
                    "{dt}: element {i} outside the output was written (portable)"
                );
                continue;
            }
            let (v, a) = w.dot(row, &xh[t * c..][..c]);
            // near-tie codes may round the other way on the GPU: both x̂ stay within their second
            // level's d₂/2 of x (the GPU's d₂ within rounding of the CPU's)
            let tie = q.error_bound(t, &w.deq[row * c..][..c]) * 2.01;
            let bound = 1e-4 * (1.0 + a) + tie;
            let e1 = (got[i] as f64 - init[i] as f64 - v).abs();
            let e2 = (got2[i] as f64 - v).abs();
            assert!(
                e1 <= bound && e2 <= bound,
                "{dt}: token {t} row {row}: {} / {} want {v}",
                got[i] - init[i],
                got2[i]
            );
        }
    }
}

#[test]
fn int8_x_errors_and_fallback() {
    let g = gpu();
    let _l = serial();
    let w = Weight::random(DType::Q4_K, &[8, 512], 1).upload(g);
    let f = Weight::random(DType::F16, &[8, 512], 1);
    let xb = g.upload_f32(&vec![0.5; 1024], "x").unwrap();
    let yb = g.buffer(64 * 4, "y").unwrap();
    let mut qx = matvec::QuantX::new(g, 1, 256).unwrap();
    let mut pass = g.pass();
    // cols not a multiple of 32, more than the scratch holds, x too short
    assert!(matvec::quantize_x(&mut pass, Operand::new(&xb, 0), 1, 48, &mut qx).is_err());
    assert!(matvec::quantize_x(&mut pass, Operand::new(&xb, 0), 1, 512, &mut qx).is_err());
    assert!(matvec::quantize_x(&mut pass, Operand::new(&xb, 900), 1, 256, &mut qx).is_err());
    // two levels need twice the blocks
    assert!(matvec::quantize_x2(&mut pass, Operand::new(&xb, 0), 1, 256, &mut qx).is_err());
    // nothing quantized yet, then columns that do not match the weight
    assert!(matvec::matvec_q8x(
        &mut pass,
        &w,
        &qx,
        Operand::new(&yb, 0),
        &MatvecOpts::default()
    )
    .is_err());
    matvec::quantize_x(&mut pass, Operand::new(&xb, 0), 1, 256, &mut qx).unwrap();
    assert!(matvec::matvec_q8x(
        &mut pass,
        &w,
        &qx,
        Operand::new(&yb, 0),
        &MatvecOpts::default()
    )
    .is_err());
    // one level where the kernels read two: refused
    let w256 = Weight::random(DType::Q4_K, &[8, 256], 1).upload(g);
    let err = matvec::matvec_q8x(
        &mut pass,
        &w256,
        &qx,
        Operand::new(&yb, 0),
        &MatvecOpts::default(),
    );
    assert!(format!("{}", err.unwrap_err()).contains("two"));
    let mut q2x = matvec::QuantX::new(g, 2, 256).unwrap();
    matvec::quantize_x2(&mut pass, Operand::new(&xb, 0), 1, 256, &mut q2x).unwrap();
    matvec::matvec_q8x(
        &mut pass,
        &w256,
        &q2x,
        Operand::new(&yb, 0),
        &MatvecOpts::default(),
    )
    .unwrap();
    // a type without an int8 kernel: an error from matvec_q8x, the f32 path under int8_x
    let ft = f.upload(g);
    let mut q2 = matvec::QuantX::new(g, 2, 512).unwrap();
    matvec::quantize_x2(&mut pass, Operand::new(&xb, 0), 1, 512, &mut q2).unwrap();
    assert!(!matvec::int8_x_supported(DType::F16));
    assert!(matvec::matvec_q8x(
        &mut pass,
        &ft,
        &q2,
        Operand::new(&yb, 0),
        &MatvecOpts::default()
    )
    .is_err());
    let o = MatvecOpts {
        int8_x: true,
        ..Default::default()
    };
    matvec::matvec_opts(
        &mut pass,
        &ft,
        Operand::new(&xb, 0),
        Operand::new(&yb, 0),
        1,
        &o,
    )
    .unwrap();
    submit(pass);
    let got = g.read_f32(&yb, 0, 8).unwrap();
    for (r, &v) in got.iter().enumerate() {
        let (want, a) = f.dot(r, &[0.5; 512]);
        assert!(
            (v as f64 - want).abs() <= 1e-4 * (1.0 + a),
            "f16 fallback row {r}: {v} want {want}"
        );
    }
}

#[test]
fn int8_x_variants_translate_to_every_backend() {
    let g = gpu();
    {
        let _l = serial();
        for dt in MM_Q8_TYPES {
            let cols = dt.block_size() as u32 * 2;
            let wt = Weight::random(dt, &[8, cols as u64], 3).upload(g);
            let xb = g.upload_f32(&vec![0.5; 2 * cols as usize], "x").unwrap();
            let yb = g.buffer(16 * 4, "y").unwrap();
            let mut qx = matvec::QuantX::new(g, 4, cols).unwrap();
            let mut pass = g.pass();
            matvec::quantize_x2(&mut pass, Operand::new(&xb, 0), 2, cols, &mut qx).unwrap();
            let w3 = Weight::random(dt, &[2, 4, cols as u64], 3).upload(g);
            let ids = g.upload(bytemuck::cast_slice(&[1u32, 0]), "ids").unwrap();
            for portable in [false, true]
                .into_iter()
                .filter(|_| matvec::int8_x_supported(dt))
            {
                let o = MatvecOpts {
                    portable,
                    ..Default::default()
                };
                matvec::matvec_q8x(&mut pass, &wt, &qx, Operand::new(&yb, 0), &o).unwrap();
                matvec::matvec_indexed_q8x(
                    &mut pass,
                    &w3,
                    &qx,
                    &matvec::Pairs {
                        ids: Operand::new(&ids, 0),
                        n_tokens: 2,
                        n_used: 1,
                        x_per_pair: false,
                    },
                    Operand::new(&yb, 0),
                    &o,
                )
                .unwrap();
            }
            let route = MoeRoute::new(g, 2, 2).unwrap();
            matmul::route(&mut pass, &route, &ids, 0, 2, 1).unwrap();
            for l in [matmul::Int8Levels::One, matmul::Int8Levels::Two] {
                let o = MatvecOpts::default();
                matmul::matmul_int8(
                    &mut pass,
                    l,
                    &wt,
                    Operand::new(&xb, 0),
                    Operand::new(&yb, 0),
                    2,
                    &o,
                )
                .unwrap();
                matmul::matmul_int8_indexed(
                    &mut pass,
                    l,
                    &w3,
                    Operand::new(&xb, 0),
                    &matmul::RoutePairs {
                        route: &route,
                        n_tokens: 2,
                        n_used: 1,
                        x_per_pair: false,
                    },
                    Operand::new(&yb, 0),
                    &o,
                )
                .unwrap();
            }
            submit(pass);
        }
        g.wait().unwrap();
    }
    let mut n = 0;
    for spec in g.compiled_specs() {
        if !["Q8X", "quantize_x", "matmul_q8"]
            .iter()
            .any(|k| spec.label.contains(k))
        {
            continue;
        }
        n += 1;
        let wgsl = spec.wgsl().unwrap();
        let module = naga::front::wgsl::parse_str(&wgsl).unwrap();
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}: {e:?}", spec.label));
        naga::back::spv::write_vec(&module, &info, &Default::default(), None)
            .unwrap_or_else(|e| panic!("{}: SPIR-V: {e}", spec.label));
        let mut msl = String::new();
        naga::back::msl::Writer::new(&mut msl)
            .write(&module, &info, &Default::default(), &Default::default())
            .unwrap_or_else(|e| panic!("{}: MSL: {e}", spec.label));
        let mut hlsl = String::new();
        let hopts = naga::back::hlsl::Options::default();
        naga::back::hlsl::Writer::new(&mut hlsl, &hopts, &Default::default())
            .write(&module, &info, None)
            .unwrap_or_else(|e| panic!("{}: HLSL: {e}", spec.label));
    }
    eprintln!("{n} int8-x variants translated");
    assert!(
        n > 6 * Q8X_TYPES.len(), // the quantizers plus matvec, matvec_id, two matmuls and two matmul_ids per type
        "expected the quantizer and every type's variants, got {n}"
    );
}

/// `matmul_int8` (quantize_x + matmul_q8, one or two levels) of a [rows, cols] weight split in
/// `parts` for n tokens at strided x / y rows, accumulating, against both references of
/// `run_q8x`: the product with the CPU's x̂ (integer sums exact: f32 tolerance plus a tie
/// allowance, as the one-step test) and the f32 x within the quantization bound of the last
/// level.
fn run_mm_q8(
    dt: DType,
    levels: matmul::Int8Levels,
    rows: u64,
    cols: u64,
    parts: &[u64],
    nt: usize,
    seed: u64,
) {
    let g = gpu();
    let w = Weight::random(dt, &[rows, cols], seed);
    let (r, c) = (rows as usize, cols as usize);
    let (x_off, x_stride, y_stride) = (5usize, c + 32, r + 3);
    let x = q8x_input(x_off + nt * x_stride, seed ^ 7);
    let _l = serial();
    let wt = w.upload_parts(g, parts);
    let xb = g.upload_f32(&x, "x").unwrap();
    let n_out = (nt - 1) * y_stride + r;
    let init: Vec<f32> = (0..n_out + 2 * GUARD)
        .map(|i| (i % 13) as f32 * 0.25)
        .collect();
    let yb = g.upload_f32(&init, "y").unwrap();
    let opts = MatvecOpts {
        accumulate: true,
        ..Default::default()
    };
    let mut pass = g.pass();
    let xo = Operand::strided(&xb, x_off as u32, x_stride as u32);
    let yo = Operand::strided(&yb, GUARD as u32, y_stride as u32);
    matmul::matmul_int8(&mut pass, levels, &wt, xo, yo, nt as u32, &opts).unwrap();
    submit(pass);
    let got = g.read_f32(&yb, 0, n_out + 2 * GUARD).unwrap();
    let rows_x: Vec<f32> = (0..nt)
        .flat_map(|t| x[x_off + t * x_stride..][..c].to_vec())
        .collect();
    let (q, xh) = match levels {
        matmul::Int8Levels::One => {
            let q = lathe::cpu::q8x::quantize_x(&rows_x, c);
            let xh = q.dequantize();
            (q, xh)
        }
        matmul::Int8Levels::Two => {
            let (a, b) = lathe::cpu::q8x::quantize_x2(&rows_x, c);
            let xh = a
                .dequantize()
                .iter()
                .zip(b.dequantize())
                .map(|(u, v)| u + v)
                .collect();
            (b, xh)
        }
    };
    let what = format!("matmul int8 {levels:?} {dt} {rows}x{cols} parts {parts:?} nt{nt}");
    let mut worst = 0f64;
    for i in 0..n_out + 2 * GUARD {
        let o = i.wrapping_sub(GUARD);
        let (t, row) = (o / y_stride, o % y_stride);
        if i < GUARD || o >= n_out || row >= r {
            assert_eq!(
                got[i], init[i],
                "{what}: element {i} outside the output was written"
            );
            continue;
        }
        let wr = &w.deq[row * c..][..c];
        let (v, a) = w.dot(row, &xh[t * c..][..c]);
        let tie = q.error_bound(t, wr) * 2.0 / 1000.0;
        let sum = got[i] as f64 - init[i] as f64;
        let err = (sum - v).abs();
        assert!(
            err <= 1e-4 * (1.0 + a) + tie,
            "{what}: token {t} row {row}: {sum} want {v} (x̂ reference)"
        );
        let (vf, af) = w.dot(row, &x[x_off + t * x_stride..][..c]);
        let bound = q.error_bound(t, wr) + 1e-4 * (1.0 + af);
        let ef = (sum - vf).abs();
        assert!(
            ef <= bound,
            "{what}: token {t} row {row}: {sum}, f32-x value {vf}"
        );
        worst = worst.max(ef / bound);
    }
    eprintln!("{what}: against f32 x, worst err / quantization bound = {worst:.3}");
}

#[test]
fn int8_matmul_odd_sizes() {
    for (i, dt) in MM_Q8_TYPES.into_iter().enumerate() {
        let small = dt.block_size() as u64;
        let wide = if small == 256 { 512 } else { 640 };
        // one sub-block past a whole step, several row and token tiles with partial last ones
        for (k, &(rows, cols, nt)) in [(1u64, small, 1usize), (7, 3 * small, 25), (130, wide, 67)]
            .iter()
            .enumerate()
        {
            let split = [rows / 3 + 1, rows - rows / 3 - 1];
            let parts: &[u64] = if rows > 2 { &split } else { &[rows] };
            for l in [matmul::Int8Levels::One, matmul::Int8Levels::Two] {
                run_mm_q8(dt, l, rows, cols, parts, nt, (i * 10 + k) as u64);
            }
        }
    }
}

/// MoE prefill with int8 x (`matmul_int8_indexed`, both levels) over a route: wide and thin
/// tiles, x per token and per pair, experts split over parts, an invalid id; each output
/// within the quantization bound of the last level (plus f32 rounding) of the f32-x product.
#[test]
fn int8_matmul_indexed() {
    let g = gpu();
    let (ne, rows, n_used) = (6usize, 45usize, 3usize);
    for (i, dt) in MM_Q8_TYPES.into_iter().enumerate() {
        let cols = 2 * dt.block_size();
        let w = Weight::random(dt, &[ne as u64, rows as u64, cols as u64], 80 + i as u64);
        let mut rng = Rng::new(90 + i as u64);
        // 70 tokens: 210 pairs, wide tiles; 20 tokens: 60 pairs, thin ones
        for nt in [70usize, 20] {
            let np = nt * n_used;
            let mut ids = Vec::new();
            for t in 0..nt {
                let first = (rng.uniform() * ne as f64) as usize;
                for s in 0..n_used {
                    ids.push(((first + 2 * s) % ne) as u32);
                }
                if t == 1 {
                    ids[t * n_used + 1] = 99;
                }
            }
            let _l = serial();
            let wt = w.upload_parts(g, &[2 * rows as u64, 4 * rows as u64]);
            let idb = g.upload(bytemuck::cast_slice(&ids), "ids").unwrap();
            for (per_pair, levels) in [
                (false, matmul::Int8Levels::Two),
                (true, matmul::Int8Levels::One),
            ] {
                let xr = if per_pair { np } else { nt };
                let x = q8x_input(xr * cols, (nt + i) as u64);
                let xb = g.upload_f32(&x, "x").unwrap();
                let yb = out_buffer(g, np * rows);
                let route = MoeRoute::new(g, ne as u32, np as u32).unwrap();
                let mut pass = g.pass();
                matmul::route(&mut pass, &route, &idb, 0, nt as u32, n_used as u32).unwrap();
                matmul::matmul_int8_indexed(
                    &mut pass,
                    levels,
                    &wt,
                    Operand::new(&xb, 0),
                    &matmul::RoutePairs {
                        route: &route,
                        n_tokens: nt as u32,
                        n_used: n_used as u32,
                        x_per_pair: per_pair,
                    },
                    Operand::new(&yb, GUARD as u32),
                    &MatvecOpts::default(),
                )
                .unwrap();
                submit(pass);
                let got = g.read_f32(&yb, 0, np * rows + 2 * GUARD).unwrap();
                let q = match levels {
                    matmul::Int8Levels::One => lathe::cpu::q8x::quantize_x(&x, cols),
                    matmul::Int8Levels::Two => lathe::cpu::q8x::quantize_x2(&x, cols).1,
                };
                let what = format!("int8 indexed {levels:?} {dt} tokens {nt} per_pair {per_pair}");
                for k in 0..2 * GUARD {
                    let j = if k < GUARD { k } else { np * rows + k };
                    assert_eq!(got[j], SENTINEL, "{what}: guard {j} written");
                }
                for o in 0..np * rows {
                    let (pq, r) = (o / rows, o % rows);
                    let e = ids[pq] as usize;
                    let v = got[GUARD + o];
                    if e >= ne {
                        assert_eq!(v, SENTINEL, "{what}: output {o} of an invalid id written");
                        continue;
                    }
                    let xq = if per_pair { pq } else { pq / n_used };
                    let wr = &w.deq[(e * rows + r) * cols..][..cols];
                    let (want, a) = w.dot(e * rows + r, &x[xq * cols..][..cols]);
                    let bound = q.error_bound(xq, wr) + 1e-4 * (1.0 + a);
                    assert!(
                        (v as f64 - want).abs() <= bound,
                        "{what}: pair {pq} row {r}: {v} want {want} (bound {bound:.3e})"
                    );
                }
            }
        }
    }
}

#[test]
fn int8_matmul_errors() {
    let g = gpu();
    let _l = serial();
    let f = Weight::random(DType::F16, &[8, 512], 1).upload(g);
    let w = Weight::random(DType::Q4_K, &[8, 512], 1).upload(g);
    let xb = g.upload_f32(&vec![0.5; 1024], "x").unwrap();
    let yb = g.buffer(64 * 4, "y").unwrap();
    let mut pass = g.pass();
    let o = MatvecOpts::default();
    let l = matmul::Int8Levels::Two;
    // no integer codes, no tokens, x or y too short
    assert!(matmul::matmul_int8(
        &mut pass,
        l,
        &f,
        Operand::new(&xb, 0),
        Operand::new(&yb, 0),
        1,
        &o
    )
    .is_err());
    assert!(matmul::matmul_int8(
        &mut pass,
        l,
        &w,
        Operand::new(&xb, 0),
        Operand::new(&yb, 0),
        0,
        &o
    )
    .is_err());
    assert!(matmul::matmul_int8(
        &mut pass,
        l,
        &w,
        Operand::new(&xb, 0),
        Operand::new(&yb, 0),
        3,
        &o
    )
    .is_err());
    assert!(matmul::matmul_int8(
        &mut pass,
        l,
        &w,
        Operand::new(&xb, 0),
        Operand::new(&yb, 60),
        2,
        &o
    )
    .is_err());
    drop(pass);
}

#[test]
#[ignore]
fn real_int8_x() {
    run_q8x(DType::Q4_K, 12288, 4096, 1, 1);
    run_q8x(DType::Q6_K, 4096, 12288, 2, 2);
    run_q8x(DType::Q8_0, 4096, 4096, 8, 3);
    run_q8x(DType::Q4_0, 4096, 4096, 1, 4);
    run_q8x(DType::Q5_K, 4096, 4096, 3, 5);
}

/// MoE decode with int8 x: the two-step form (x quantized per token or per pair, then
/// matvec_indexed_q8x) and the one-step `int8_x` option, split experts, an invalid id.
#[test]
fn int8_x_indexed_moe() {
    let g = gpu();
    let (ne, rows, n_used, nt) = (6usize, 45usize, 3usize, 2usize);
    let np = nt * n_used;
    for (i, dt) in Q8X_TYPES.into_iter().enumerate() {
        let cols = 2 * dt.block_size();
        let w = Weight::random(dt, &[ne as u64, rows as u64, cols as u64], 40 + i as u64);
        let ids: Vec<u32> = vec![0, 2, 4, 5, 99, 1];
        let _l = serial();
        let wt = w.upload_parts(g, &[2 * rows as u64, 4 * rows as u64]);
        let idb = g
            .upload(
                bytemuck::cast_slice(&[[7u32].as_slice(), &ids].concat()),
                "ids",
            )
            .unwrap();
        for per_pair in [false, true] {
            let xr = if per_pair { np } else { nt };
            let x = q8x_input(xr * cols, 7 + i as u64);
            let xb = g.upload_f32(&x, "x").unwrap();
            let (y1, y2) = (out_buffer(g, np * rows), out_buffer(g, np * rows));
            let mut qx = matvec::QuantX::new(g, 2 * xr as u32, cols as u32).unwrap();
            let mut pass = g.pass();
            matvec::quantize_x2(
                &mut pass,
                Operand::new(&xb, 0),
                xr as u32,
                cols as u32,
                &mut qx,
            )
            .unwrap();
            let o = MatvecOpts::default();
            let (nu, n) = (n_used as u32, nt as u32);
            matvec::matvec_indexed_q8x(
                &mut pass,
                &wt,
                &qx,
                &matvec::Pairs {
                    ids: Operand::new(&idb, 1),
                    n_tokens: n,
                    n_used: nu,
                    x_per_pair: per_pair,
                },
                Operand::new(&y1, GUARD as u32),
                &o,
            )
            .unwrap();
            let o8 = MatvecOpts { int8_x: true, ..o };
            matvec::matvec_indexed(
                &mut pass,
                &wt,
                Operand::new(&xb, 0),
                &matvec::Pairs {
                    ids: Operand::new(&idb, 1),
                    n_tokens: n,
                    n_used: nu,
                    x_per_pair: per_pair,
                },
                Operand::new(&y2, GUARD as u32),
                &o8,
            )
            .unwrap();
            submit(pass);
            let (q1, q2) = read_quant_x2(g, &qx);
            let xh = lathe::cpu::q8x::dequantize2(&q1, &q2);
            let want: Vec<_> = (0..np * rows)
                .map(|k| {
                    let (p, r) = (k / rows, k % rows);
                    let e = ids[p] as usize;
                    let xq = if per_pair { p } else { p / n_used };
                    (e < ne).then(|| w.dot(e * rows + r, &xh[xq * cols..][..cols]))
                })
                .collect();
            let what = format!("q8x indexed {dt} per_pair {per_pair}");
            check(
                &g.read_f32(&y1, 0, np * rows + 2 * GUARD).unwrap(),
                &want,
                &what,
            );
            // the one-step path quantizes the same x with the same kernel: identical results
            assert_eq!(
                g.read_f32(&y1, 0, np * rows + 2 * GUARD).unwrap(),
                g.read_f32(&y2, 0, np * rows + 2 * GUARD).unwrap(),
                "{what}: one-step int8_x"
            );
        }
    }
}

/// The fused activation loads (`matvec::Prologue`) against the CPU (the step's reference,
/// then the product in f64) for every stored type at odd sizes and 1 and 3 tokens; RMSNorm
/// also against the two GPU kernels it replaces (`norm::rms_norm`, then `matvec`), which it
/// matches to rounding: it computes r · (W (x · w)) with its own fixed-order Σx², where they
/// compute W ((x · r) · w) with the norm kernel's sum.
#[test]
fn matvec_prologues() {
    use lathe::cpu::ops;
    use lathe::gpu::operand::Operand;
    use matvec::Prologue;
    let g = gpu();
    for (i, dt) in ALL.into_iter().enumerate() {
        let cols = *odd_cols(dt).last().unwrap();
        let (c, rows) = (cols as usize, 37usize);
        let seed = 900 + i as u64;
        let w = Weight::random(dt, &[rows as u64, cols], seed);
        let mut rng = Rng::new(seed ^ 5);
        for n in [1usize, 3] {
            // RMSNorm of x rows (stride c + 8, offset 4), weight nw.
            let stride = c + 8;
            let x = rng.normals(4 + n * stride, 1.5);
            let nw = rng.normals(c, 1.0);
            let eps = 1e-6;
            let _l = serial();
            let wt = w.upload(g);
            let xb = g.upload_f32(&x, "x").unwrap();
            let nwb = g.upload_f32(&nw, "nw").unwrap();
            let yb = out_buffer(g, n * rows);
            let opts = MatvecOpts::default();
            let mut pass = g.pass();
            let pro = Prologue::RmsNorm {
                w: &nwb,
                eps,
                keep: None,
            };
            matvec::matvec_pro(
                &mut pass,
                &wt,
                Operand::strided(&xb, 4, stride as u32),
                Operand::new(&yb, GUARD as u32),
                n as u32,
                &opts,
                &pro,
            )
            .unwrap();
            submit(pass);
            let got = g.read_f32(&yb, 0, n * rows + 2 * GUARD).unwrap();
            let mut want = Vec::new();
            for t in 0..n {
                let h = ops::rms_norm(&x[4 + t * stride..][..c], c, Some(&nw), eps);
                want.extend((0..rows).map(|r| Some(w.dot(r, &h))));
            }
            check(
                &got,
                &want,
                &format!("rms_norm matvec {dt} {rows}x{cols} nt{n}"),
            );
            // The unfused pair on the GPU: the same values to rounding (ten times tighter
            // than the CPU bound).
            let nwt = g
                .upload_tensor(&TensorRef {
                    name: "nw",
                    dtype: DType::F32,
                    shape: &[c as u64],
                    data: bytemuck::cast_slice(&nw),
                    path: Path::new("test"),
                })
                .unwrap();
            let hb = out_buffer(g, n * c);
            let y2 = out_buffer(g, n * rows);
            let mut pass = g.pass();
            lathe::gpu::norm::rms_norm(
                &mut pass,
                n as u32,
                c as u32,
                Operand::strided(&xb, 4, stride as u32),
                Some(Operand::new(&hb, 0)),
                Some(&nwt),
                eps,
            )
            .unwrap();
            matvec::matvec_opts(
                &mut pass,
                &wt,
                Operand::new(&hb, 0),
                Operand::new(&y2, GUARD as u32),
                n as u32,
                &Default::default(),
            )
            .unwrap();
            submit(pass);
            let unfused = g.read_f32(&y2, 0, n * rows + 2 * GUARD).unwrap();
            for (i, w) in want.iter().enumerate() {
                let (a, b) = (got[GUARD + i] as f64, unfused[GUARD + i] as f64);
                let bound = 1e-5 * (1.0 + w.map_or(0.0, |w| w.1));
                assert!(
                    (a - b).abs() <= bound,
                    "{dt} nt{n} row {i}: fused norm {a} against rms_norm + matvec {b}"
                );
            }

            // SwiGLU: gate at offset 4 of each row, up `up` elements later.
            let up = c as u32 + 12;
            let stride = 2 * c + 20;
            let x = rng.normals(4 + n * stride, 2.0);
            let xb = g.upload_f32(&x, "x").unwrap();
            let yb = out_buffer(g, n * rows);
            let opts = MatvecOpts::default();
            let mut pass = g.pass();
            let pro = Prologue::SwiGlu { up };
            matvec::matvec_pro(
                &mut pass,
                &wt,
                Operand::strided(&xb, 4, stride as u32),
                Operand::new(&yb, GUARD as u32),
                n as u32,
                &opts,
                &pro,
            )
            .unwrap();
            submit(pass);
            let got = g.read_f32(&yb, 0, n * rows + 2 * GUARD).unwrap();
            let mut want = Vec::new();
            for t in 0..n {
                let row = &x[4 + t * stride..];
                let h = ops::swiglu(&row[..c], &row[up as usize..][..c], None);
                want.extend((0..rows).map(|r| Some(w.dot(r, &h))));
            }
            check(
                &got,
                &want,
                &format!("swiglu matvec {dt} {rows}x{cols} nt{n}"),
            );
        }
        // Sigmoid gate (one token): heads of 32 (else 7), gate heads every 2·head_dim from
        // offset 3.
        let hd: u32 = if cols.is_multiple_of(32) { 32 } else { 7 };
        if !cols.is_multiple_of(hd as u64) {
            continue;
        }
        let heads = c / hd as usize;
        let x = rng.normals(c, 1.0);
        let gate = rng.normals(3 + heads * 2 * hd as usize, 2.0);
        let _l = serial();
        let wt = w.upload(g);
        let xb = g.upload_f32(&x, "x").unwrap();
        let gb = g.upload_f32(&gate, "gate").unwrap();
        let yb = out_buffer(g, rows);
        let mut pass = g.pass();
        let pro = Prologue::SigmoidGate {
            gate: &gb,
            off: 3,
            head_dim: hd,
            head_stride: 2 * hd,
        };
        matvec::matvec_pro(
            &mut pass,
            &wt,
            Operand::new(&xb, 0),
            Operand::new(&yb, GUARD as u32),
            1,
            &Default::default(),
            &pro,
        )
        .unwrap();
        submit(pass);
        let got = g.read_f32(&yb, 0, rows + 2 * GUARD).unwrap();
        let h: Vec<f32> = (0..c)
            .map(|j| {
                let gv = gate[3 + (j / hd as usize) * 2 * hd as usize + j % hd as usize];
                ops::sigmoid(gv) * x[j]
            })
            .collect();
        let want: Vec<_> = (0..rows).map(|r| Some(w.dot(r, &h))).collect();
        check(&got, &want, &format!("gated matvec {dt} {rows}x{cols}"));
    }
}

/// A residual product's normed store (`matvec::Epilogue::Normed`) and the product reading
/// it through `Prologue::RmsNormRaw`: the residual rows are the plain accumulating product's
/// bits, the extra rows are those times the norm weight (one f32 multiply), and the next
/// product has the bits of `Prologue::RmsNorm` over the residual rows; one token and a
/// token group, every type as the producer and the consumer.
#[test]
fn normed_store_feeds_raw_norm() {
    use matvec::{Epilogue, Prologue};
    let g = gpu();
    for (i, dt) in ALL.into_iter().enumerate() {
        let k = *odd_cols(dt).last().unwrap();
        let c = *odd_cols(dt).first().unwrap();
        let seed = 2100 + i as u64;
        let pw = Weight::random(dt, &[c, k], seed);
        let cw = Weight::random(dt, &[23, c], seed + 1);
        let mut rng = Rng::new(seed ^ 3);
        for n in [1usize, 3] {
            let (k, c) = (k as usize, c as usize);
            let a = rng.normals(n * k, 1.0);
            let x0 = rng.normals(n * c, 2.0);
            let nw = rng.normals(c, 1.0);
            let _l = serial();
            let (pt, ct) = (pw.upload(g), cw.upload(g));
            let ab = g.upload_f32(&a, "a").unwrap();
            let nwb = g.upload_f32(&nw, "nw").unwrap();
            let (xf, xp) = (
                g.upload_f32(&x0, "x").unwrap(),
                g.upload_f32(&x0, "x").unwrap(),
            );
            // x · w lands at the residual's elements (offset 0 here, no guard)
            let hn = g.upload_f32(&vec![SENTINEL; n * c], "hn").unwrap();
            let acc = MatvecOpts {
                accumulate: true,
                ..Default::default()
            };
            let nt = n as u32;
            let mut pass = g.pass();
            let epi = Epilogue::Normed { w: &nwb, out: &hn };
            matvec::matvec_fused(
                &mut pass,
                &pt,
                Operand::new(&ab, 0),
                Operand::new(&xf, 0),
                nt,
                &acc,
                matvec::Fused { pro: None, epi },
            )
            .unwrap();
            matvec::matvec_opts(
                &mut pass,
                &pt,
                Operand::new(&ab, 0),
                Operand::new(&xp, 0),
                nt,
                &acc,
            )
            .unwrap();
            submit(pass);
            let (xs, xr) = (
                g.read_f32(&xf, 0, n * c).unwrap(),
                g.read_f32(&xp, 0, n * c).unwrap(),
            );
            let hv = g.read_f32(&hn, 0, n * c).unwrap();
            for j in 0..n * c {
                assert_eq!(xs[j].to_bits(), xr[j].to_bits(), "{dt} nt{n}: residual {j}");
                let w = (xs[j] * nw[j % c]).to_bits();
                assert_eq!(hv[j].to_bits(), w, "{dt} nt{n}: normed value {j}");
            }
            // the consumer: RmsNorm over the residual rows against RmsNormRaw over hn
            let (y1, y2) = (out_buffer(g, n * 23), out_buffer(g, n * 23));
            let mut pass = g.pass();
            let pro = Prologue::RmsNorm {
                w: &nwb,
                eps: 1e-6,
                keep: None,
            };
            let raw = Prologue::RmsNormRaw {
                raw: &xf,
                eps: 1e-6,
            };
            let o = MatvecOpts::default();
            let st = Epilogue::Store;
            let y0 = GUARD as u32;
            matvec::matvec_fused(
                &mut pass,
                &ct,
                Operand::new(&xf, 0),
                Operand::new(&y1, y0),
                nt,
                &o,
                matvec::Fused {
                    pro: Some(&pro),
                    epi: st,
                },
            )
            .unwrap();
            matvec::matvec_fused(
                &mut pass,
                &ct,
                Operand::new(&hn, 0),
                Operand::new(&y2, y0),
                nt,
                &o,
                matvec::Fused {
                    pro: Some(&raw),
                    epi: st,
                },
            )
            .unwrap();
            submit(pass);
            let (v1, v2) = (
                g.read_f32(&y1, 0, n * 23 + 2 * GUARD).unwrap(),
                g.read_f32(&y2, 0, n * 23 + 2 * GUARD).unwrap(),
            );
            for j in 0..v1.len() {
                assert_eq!(
                    v1[j].to_bits(),
                    v2[j].to_bits(),
                    "{dt} nt{n}: consumer output {j}: {} / {}",
                    v1[j],
                    v2[j]
                );
            }
            assert_ne!(v1[GUARD], SENTINEL, "{dt} nt{n}: nothing written");
        }
    }
}

/// SwiGLU and GeGLU as a gate+up product's store (`matvec::Epilogue::{SwiGlu, GeGlu}`), on
/// every type with odd and real sizes, plain and through the RMSNorm prologue, for one token
/// and token groups: each token's values are the bits of the same product stored plainly
/// followed by `elementwise::{swiglu, geglu}` (the unfused decode), the token groups' those of
/// each token alone, and both match the CPU's swiglu / geglu of the CPU products.
#[test]
fn matvec_swiglu_store() {
    use lathe::cpu::ops;
    use lathe::gpu::elementwise as ew;
    use lathe::gpu::operand::Operand;
    use matvec::{Epilogue, Prologue};
    let g = gpu();
    for (i, dt) in ALL.into_iter().enumerate() {
        let cols = *odd_cols(dt).last().unwrap();
        let c = cols as usize;
        // an odd ff; one real width (Qwen3.5-9B's ffn at 4096 columns) for Q4_K
        let ffs: &[usize] = if dt == DType::Q4_K {
            &[19, 12288]
        } else {
            &[19]
        };
        for &ff in ffs {
            let cols = if ff > 19 { 4096 } else { cols };
            let c = if ff > 19 { 4096 } else { c };
            let seed = 1700 + i as u64 + ff as u64;
            let w = Weight::random(dt, &[2 * ff as u64, cols], seed);
            let mut rng = Rng::new(seed ^ 9);
            let n = 9usize;
            let x = rng.normals(n * c, 1.5);
            let nw = rng.normals(c, 1.0);
            let _l = serial();
            let wt = w.upload(g);
            let xb = g.upload_f32(&x, "x").unwrap();
            let nwb = g.upload_f32(&nw, "nw").unwrap();
            let pro = Prologue::RmsNorm {
                w: &nwb,
                eps: 1e-6,
                keep: None,
            };
            let opts = MatvecOpts::default();
            let cases = [false, true]
                .into_iter()
                .flat_map(|n| [(n, false), (n, true)]);
            for (normed, geglu) in cases {
                let pro = normed.then_some(&pro);
                // fused: all n tokens (token groups of 5 and 4), then each alone
                let ym = out_buffer(g, n * ff);
                let yl = out_buffer(g, n * ff);
                let mut pass = g.pass();
                let nt = n as u32;
                let epi = if geglu {
                    Epilogue::GeGlu
                } else {
                    Epilogue::SwiGlu
                };
                matvec::matvec_fused(
                    &mut pass,
                    &wt,
                    Operand::new(&xb, 0),
                    Operand::new(&ym, 5),
                    nt,
                    &opts,
                    matvec::Fused { pro, epi },
                )
                .unwrap();
                for t in 0..n as u32 {
                    let (xo, yo) = (t * cols as u32, 5 + t * ff as u32);
                    matvec::matvec_fused(
                        &mut pass,
                        &wt,
                        Operand::new(&xb, xo),
                        Operand::new(&yl, yo),
                        1,
                        &opts,
                        matvec::Fused { pro, epi },
                    )
                    .unwrap();
                }
                // unfused: the product stored plainly, then swiglu
                let yp = out_buffer(g, n * 2 * ff);
                let yu = out_buffer(g, n * ff);
                let (st, f) = (Epilogue::Store, ff as u32);
                for t in 0..n as u32 {
                    let (xo, yo) = (t * cols as u32, t * 2 * f);
                    matvec::matvec_fused(
                        &mut pass,
                        &wt,
                        Operand::new(&xb, xo),
                        Operand::new(&yp, yo),
                        1,
                        &opts,
                        matvec::Fused { pro, epi: st },
                    )
                    .unwrap();
                }
                let (gv, uv) = (
                    Operand::strided(&yp, 0, 2 * f),
                    Operand::strided(&yp, f, 2 * f),
                );
                let yo = Operand::new(&yu, 5);
                if geglu {
                    ew::geglu(&mut pass, nt, f, yo, gv, uv).unwrap();
                } else {
                    ew::swiglu(&mut pass, nt, f, yo, gv, uv, None).unwrap();
                }
                submit(pass);
                let multi = g.read_f32(&ym, 5, n * ff).unwrap();
                let lone = g.read_f32(&yl, 5, n * ff).unwrap();
                let unfused = g.read_f32(&yu, 5, n * ff).unwrap();
                let what = format!("{dt} {}x{cols} normed {normed} geglu {geglu}", 2 * ff);
                for j in 0..n * ff {
                    assert_eq!(
                        (multi[j].to_bits(), lone[j].to_bits()),
                        (unfused[j].to_bits(), unfused[j].to_bits()),
                        "{what}: token {} value {}: group {} / lone {} / unfused {}",
                        j / ff,
                        j % ff,
                        multi[j],
                        lone[j],
                        unfused[j]
                    );
                }
                // against the CPU: swiglu / geglu of the CPU products (the bound of the
                // product's rounding, through silu's or gelu_tanh's slope ≤ 1.2 and the other
                // factor)
                for t in 0..n {
                    let xt = &x[t * c..][..c];
                    let h = if normed {
                        ops::rms_norm(xt, c, Some(&nw), 1e-6)
                    } else {
                        xt.to_vec()
                    };
                    for o in 0..ff {
                        let (gd, ud) = (w.dot(o, &h), w.dot(ff + o, &h));
                        let (gw, uw) = (gd.0 as f32, ud.0 as f32);
                        let want = if geglu {
                            ops::geglu(&[gw], &[uw])[0] as f64
                        } else {
                            ops::swiglu(&[gw], &[uw], None)[0] as f64
                        };
                        let got = lone[t * ff + o] as f64;
                        let tol = 1e-4 * (1.0 + gd.1) * (1.0 + ud.0.abs() + ud.1) * 1.2
                            + 1e-4 * (1.0 + ud.1) * (1.0 + gd.0.abs());
                        assert!(
                            (got - want).abs() <= tol,
                            "{what}: token {t} value {o}: {got} against {want} (±{tol})"
                        );
                    }
                }
            }
        }
    }
}

/// The GDN conv step fused into the qkv product's store (`matvec::ConvStep`): the outputs of
/// the conv channels and the rolled conv states are the bits of the product followed by
/// `conv::conv1d_silu` at decode; the rows past the channels are the product itself. With the
/// RMSNorm prologue and without (the default decode), both through `matvec_fused`. Three
/// sequences of one token each, in slots 2, 0, 1; Q4_K and F32 weights.
#[test]
fn matvec_conv_step_matches_unfused() {
    use lathe::gpu::conv::{conv1d_silu, ConvIo};
    use lathe::gpu::gdn::{SeqBatch, SeqSpan};
    use matvec::Prologue;
    let g = gpu();
    let (channels, extra_rows, cols, k) = (40u32, 9u32, 256u64, 4u32);
    let rows = (channels + extra_rows) as usize;
    let cases = [DType::Q4_K, DType::F32]
        .into_iter()
        .flat_map(|dt| [(dt, true), (dt, false)]);
    for (i, (dt, normed)) in cases.enumerate() {
        let w = Weight::random(dt, &[rows as u64, cols], 70 + i as u64);
        let mut rng = Rng::new(71 + i as u64);
        let n = 3usize;
        let c = cols as usize;
        let x = rng.normals(n * c, 1.0);
        let nw = rng.normals(c, 1.0);
        let cw = rng.normals((channels * k) as usize, 0.5);
        let st0 = rng.normals(3 * ((k - 1) * channels) as usize, 1.0);
        let spans: Vec<SeqSpan> = [2u32, 0, 1]
            .iter()
            .enumerate()
            .map(|(t, &slot)| SeqSpan {
                row: t as u32,
                n_tokens: 1,
                slot,
            })
            .collect();
        let _l = serial();
        let batch = SeqBatch::new(g, &spans).unwrap();
        let wt = w.upload(g);
        let xb = g.upload_f32(&x, "x").unwrap();
        let nwb = g.upload_f32(&nw, "nw").unwrap();
        let cwb = g.upload_f32(&cw, "cw").unwrap();
        let pro = Prologue::RmsNorm {
            w: &nwb,
            eps: 1e-6,
            keep: None,
        };
        let opts = MatvecOpts::default();
        // fused
        let st_f = g.upload_f32(&st0, "state").unwrap();
        let y_f = g.upload_f32(&vec![0.0; n * rows], "y").unwrap();
        let step = matvec::ConvStep {
            channels,
            k,
            w: &cwb,
            state: &st_f,
            state_off: 0,
            batch: &batch,
        };
        let mut pass = g.pass();
        matvec::matvec_fused(
            &mut pass,
            &wt,
            Operand::new(&xb, 0),
            Operand::new(&y_f, 0),
            n as u32,
            &opts,
            matvec::Fused {
                pro: normed.then_some(&pro),
                epi: matvec::Epilogue::Conv(&step),
            },
        )
        .unwrap();
        submit(pass);
        // unfused: the product, then the conv kernel into its own rows
        let st_u = g.upload_f32(&st0, "state").unwrap();
        let y_u = g.upload_f32(&vec![0.0; n * rows], "y").unwrap();
        let conv_y = g
            .upload_f32(&vec![0.0; n * channels as usize], "conv")
            .unwrap();
        let mut pass = g.pass();
        if normed {
            matvec::matvec_pro(
                &mut pass,
                &wt,
                Operand::new(&xb, 0),
                Operand::new(&y_u, 0),
                n as u32,
                &opts,
                &pro,
            )
            .unwrap();
        } else {
            matvec::matvec_opts(
                &mut pass,
                &wt,
                Operand::new(&xb, 0),
                Operand::new(&y_u, 0),
                n as u32,
                &opts,
            )
            .unwrap();
        }
        let io = ConvIo {
            x: &y_u,
            x_off: 0,
            x_stride: rows as u32,
            w: &cwb,
            state: &st_u,
            state_off: 0,
            y: &conv_y,
            y_off: 0,
            y_stride: channels,
        };
        conv1d_silu(&mut pass, channels, k, &batch, &io).unwrap();
        submit(pass);
        let (yf, yu) = (
            g.read_f32(&y_f, 0, n * rows).unwrap(),
            g.read_f32(&y_u, 0, n * rows).unwrap(),
        );
        let cy = g.read_f32(&conv_y, 0, n * channels as usize).unwrap();
        for t in 0..n {
            for r in 0..rows {
                let want = if r < channels as usize {
                    cy[t * channels as usize + r]
                } else {
                    yu[t * rows + r]
                };
                assert_eq!(
                    yf[t * rows + r].to_bits(),
                    want.to_bits(),
                    "{dt} normed {normed} token {t} row {r}"
                );
            }
        }
        let (sf, su) = (
            g.read_f32(&st_f, 0, st0.len()).unwrap(),
            g.read_f32(&st_u, 0, st0.len()).unwrap(),
        );
        assert_eq!(sf, su, "{dt}: conv states differ");
        assert_ne!(sf, st0, "{dt}: conv states not rolled");
    }
}

/// A token's row of a several-token matvec has the bits of that token's product alone (every
/// stored type; plain and with the fused RMSNorm): what batched decode and a speculative
/// verify step rely on to reproduce a lone decode step exactly.
#[test]
fn batched_rows_equal_lone_tokens() {
    use matvec::Prologue;
    let g = gpu();
    for (i, dt) in ALL.into_iter().enumerate() {
        let cols = *odd_cols(dt).last().unwrap();
        let (c, rows, n) = (cols as usize, 29usize, 5usize);
        let w = Weight::random(dt, &[rows as u64, cols], 300 + i as u64);
        let x = Rng::new(301 + i as u64).normals(n * c, 1.0);
        let nw = Rng::new(302).normals(c, 1.0);
        let _l = serial();
        let wt = w.upload(g);
        let xb = g.upload_f32(&x, "x").unwrap();
        let nwb = g.upload_f32(&nw, "nw").unwrap();
        let norm = Prologue::RmsNorm {
            w: &nwb,
            eps: 1e-6,
            keep: None,
        };
        for fused in [false, true] {
            let run = |x_off: usize, nt: usize| {
                let yb = g.upload_f32(&vec![0.0; nt * rows], "y").unwrap();
                let mut pass = g.pass();
                let opts = MatvecOpts::default();
                let (xo, n32) = (x_off as u32, nt as u32);
                if fused {
                    matvec::matvec_pro(
                        &mut pass,
                        &wt,
                        Operand::new(&xb, xo),
                        Operand::new(&yb, 0),
                        n32,
                        &opts,
                        &norm,
                    )
                } else {
                    matvec::matvec_opts(
                        &mut pass,
                        &wt,
                        Operand::new(&xb, xo),
                        Operand::new(&yb, 0),
                        n32,
                        &opts,
                    )
                }
                .unwrap();
                submit(pass);
                g.read_f32(&yb, 0, nt * rows).unwrap()
            };
            let batched = run(0, n);
            for t in 0..n {
                let lone = run(t * c, 1);
                let same = lone
                    .iter()
                    .zip(&batched[t * rows..][..rows])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{dt} fused {fused}: token {t} of {n} differs from it alone"
                );
            }
        }
    }
}
