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

const ALL: [DType; 16] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::IQ4_NL,
    DType::IQ4_XS,
    DType::MXFP4,
];

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
/// blocks); for the float types an odd count (unaligned rows), a multiple of 4/8 that ends in a
/// partial 256-block, and whole 256-blocks (the vector path).
fn odd_cols(dt: DType) -> &'static [u64] {
    match dt {
        DType::F32 => &[161, 772, 768],
        DType::F16 | DType::BF16 => &[161, 776, 768],
        _ if dt.block_size() == 256 => &[768],
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
        &xb,
        x_off as u32,
        &yb,
        GUARD as u32,
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
        for tune in [(64, 1), (256, 4), (16, 2), (128, 3)] {
            let o = MatvecOpts {
                tune: Some(matvec::Tune {
                    wg: tune.0,
                    rows: tune.1,
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
        x_stride: xs as u32,
        y_stride: ys as u32,
        ..Default::default()
    };
    matvec::matvec_opts(&mut pass, &wt, &xb, 0, &yb, 0, nt as u32, &o).unwrap();
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
            &xb,
            0,
            &yb,
            GUARD as u32,
            n_tokens as u32,
            &MatvecOpts::default(),
        )
        .unwrap();
    } else {
        matmul::matmul(&mut pass, &wt, &xb, 0, &yb, GUARD as u32, n_tokens as u32).unwrap();
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
    for dt in [DType::Q6_K, DType::Q8_0, DType::BF16] {
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
            matmul::matmul(&mut pass, &wt, &xb, 0, &yb, GUARD as u32, nt as u32).unwrap();
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
                    &xb,
                    0,
                    per_pair,
                    &idb,
                    3,
                    n_used as u32,
                    &yb,
                    GUARD as u32,
                    nt as u32,
                    &MatvecOpts::default(),
                )
                .unwrap();
            } else {
                let route = MoeRoute::new(g, ne as u32, (np + 5) as u32).unwrap();
                matmul::route(&mut pass, &route, &idb, 3, nt as u32, n_used as u32).unwrap();
                matmul::matmul_indexed(
                    &mut pass,
                    &wt,
                    &xb,
                    0,
                    per_pair,
                    &route,
                    nt as u32,
                    n_used as u32,
                    &yb,
                    GUARD as u32,
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
    assert!(matvec::matvec(&mut pass, &wt, &xb, 0, &yb, 0, 2).is_err());
    assert!(matvec::matvec(&mut pass, &wt, &xb, 0, &yb, 1, 1).is_err());
    assert!(matvec::matvec(&mut pass, &wt, &xb, 0, &yb, 0, 9).is_err());
    let mut w3 = wt.clone();
    w3.shape = vec![2, 2, 64];
    assert!(matvec::matvec(&mut pass, &w3, &xb, 0, &yb, 0, 1).is_err());
    let mut wi = wt.clone();
    wi.dtype = DType::I32;
    assert!(matvec::matvec(&mut pass, &wi, &xb, 0, &yb, 0, 1).is_err());
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
    matmul::matmul(&mut pass, &wt, &xb, 0, &yb, GUARD as u32, n_tokens as u32).unwrap();
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
                matvec::matvec_opts(&mut pass, &wt2, &xb, 0, &yb, 0, 2, o).unwrap();
                matvec::matvec_indexed(&mut pass, &wt, &xb, 0, true, &ids, 0, 2, &yb, 0, 2, o)
                    .unwrap();
            }
            matmul::matmul_tiled(&mut pass, &wt2, &xb, 0, &yb, 0, 9, &MatvecOpts::default())
                .unwrap();
            matmul::route(&mut pass, &route, &ids, 0, 2, 2).unwrap();
            matmul::matmul_indexed(
                &mut pass,
                &wt,
                &xb,
                0,
                false,
                &route,
                2,
                2,
                &yb,
                0,
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
