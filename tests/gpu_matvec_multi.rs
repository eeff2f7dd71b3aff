//! The token-group matvec (`matvec::matvec_multi`; the fused prologues and int8 x through it;
//! `matmul_opts` for 2..=`DENSE_MATVEC_TOKENS` tokens) against the one-token kernel, bit for
//! bit: every token's outputs of a T-token product must equal `matvec_opts` (or `matvec_fused`)
//! run on that token alone, which speculative decoding's verify step and the server's batched
//! rows rely on to reproduce a lone decode exactly. Plus the CPU reference (`quant::dequantize`
//! and an f64 dot product) within 1e-4 · (1 + Σ|w x|), as tests/gpu_matvec.rs, and untouched
//! elements around and between the outputs.

use lathe::gpu::matvec::{self, MatvecOpts, Prologue, Tune};
use lathe::gpu::operand::Operand;
use lathe::gpu::{matmul, AdapterChoice, Gpu, GpuTensor};
use lathe::quant;
use lathe::tensor::TensorRef;
use lathe::DType;
use std::path::Path;
use std::sync::{Mutex, MutexGuard, OnceLock};

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

const ALL: [DType; 17] = lathe::selftest::TYPES;
/// Token counts of the products under test: below, at and above a group of 8, uneven splits.
const TS: [usize; 8] = [2, 3, 5, 8, 9, 13, 24, 32];
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
    fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let (u, v) = (self.uniform(), self.uniform());
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32 * scale
            })
            .collect()
    }
}

/// A [rows, cols] weight quantized from random normals (rows of different ranges, some with an
/// offset), with its dequantized values.
struct Weight {
    rows: usize,
    cols: usize,
    deq: Vec<f32>,
    t: GpuTensor,
}

impl Weight {
    fn random(g: &Gpu, dt: DType, rows: usize, cols: usize, seed: u64) -> Weight {
        let mut x = Rng::new(seed).normals(rows * cols, 1.0);
        for (r, row) in x.chunks_mut(cols).enumerate() {
            let s = 0.02 * (1.0 + (r % 5) as f32);
            let off = if r % 3 == 1 { 0.5 * s } else { 0.0 };
            row.iter_mut().for_each(|v| *v = *v * s + off);
        }
        let bytes = quant::quantize(dt, &x).unwrap();
        let deq = quant::dequantize_to_vec(dt, &bytes, rows * cols).unwrap();
        let shape = [rows as u64, cols as u64];
        let t = g
            .upload_tensor(&TensorRef {
                name: "w",
                dtype: dt,
                shape: &shape,
                data: &bytes,
                path: Path::new("test"),
            })
            .unwrap();
        Weight { rows, cols, deq, t }
    }
    /// (Σ w x, Σ |w x|) of row r, in f64.
    fn dot(&self, r: usize, x: &[f32]) -> (f64, f64) {
        let w = &self.deq[r * self.cols..][..self.cols];
        w.iter().zip(x).fold((0.0, 0.0), |(s, a), (&w, &x)| {
            let p = w as f64 * x as f64;
            (s + p, a + p.abs())
        })
    }
}

/// Where a product's rows go: x rows at `x_off + t * xs`, y rows at `y_off + t * ys` of a
/// buffer of `len` elements, initialised to `y0` (sentinels, or values to accumulate onto).
struct Layout {
    x_off: usize,
    xs: usize,
    y_off: usize,
    ys: usize,
    len: usize,
    y0: Vec<f32>,
}

impl Layout {
    fn new(w: &Weight, n: usize, (x_off, x_pad, y_pad): (usize, usize, usize), acc: bool) -> Self {
        let (xs, ys) = (w.cols + x_pad, w.rows + y_pad);
        let len = GUARD + n * ys + GUARD;
        let mut y0 = vec![SENTINEL; len];
        if acc {
            let v = Rng::new(n as u64).normals(n * ys, 1.0);
            y0[GUARD..GUARD + n * ys].copy_from_slice(&v);
        }
        Layout {
            x_off,
            xs,
            y_off: GUARD,
            ys,
            len,
            y0,
        }
    }
    /// x rows of `b` from element `off`, `xs` apart.
    fn x<'a>(&self, b: &'a wgpu::Buffer, off: usize) -> Operand<'a> {
        Operand::strided(b, off as u32, self.xs as u32)
    }
    /// y rows of `b` from element `off`, `ys` apart.
    fn y<'a>(&self, b: &'a wgpu::Buffer, off: usize) -> Operand<'a> {
        Operand::strided(b, off as u32, self.ys as u32)
    }
}

/// Asserts that the first `n` token rows of `got` have the bits of `lone` and that every other
/// element kept its initial value.
#[track_caller]
fn assert_same_bits(got: &[f32], lone: &[f32], lay: &Layout, rows: usize, n: usize, what: &str) {
    for (i, (&g, &y0)) in got.iter().zip(&lay.y0).enumerate() {
        let rel = i.wrapping_sub(lay.y_off);
        let (t, r) = (rel / lay.ys, rel % lay.ys);
        let want = if i >= lay.y_off && t < n && r < rows {
            lone[i]
        } else {
            y0
        };
        assert_eq!(
            g.to_bits(),
            want.to_bits(),
            "{what}: element {i} (token {t}, row {r}) is {g}, want {want}"
        );
    }
}

/// Checks the first `n` token rows against the CPU reference.
#[track_caller]
fn assert_near_cpu(got: &[f32], w: &Weight, x: &[f32], lay: &Layout, n: usize, what: &str) {
    for t in 0..n {
        let xr = &x[lay.x_off + t * lay.xs..][..w.cols];
        for r in 0..w.rows {
            let i = lay.y_off + t * lay.ys + r;
            let base = if lay.y0[i] == SENTINEL {
                0.0
            } else {
                lay.y0[i] as f64
            };
            let (v, a) = w.dot(r, xr);
            let (g, want) = (got[i] as f64, v + base);
            let bound = 1e-4 * (1.0 + a + base.abs());
            assert!(
                (g - want).abs() <= bound,
                "{what}: token {t} row {r} = {g}, want {want} (bound {bound:.3e})"
            );
        }
    }
}

/// Runs `nmax` lone one-token products (one dispatch each) and, for each count in `ts`, the
/// token-group product of the first that many tokens; asserts the bits agree, and the CPU
/// reference for the largest count (f32 x only).
fn check_plain(
    w: &Weight,
    ts: &[usize],
    pads: (usize, usize, usize),
    base: &MatvecOpts,
    what: &str,
) {
    let g = gpu();
    let nmax = *ts.iter().max().unwrap();
    let lay = Layout::new(w, nmax, pads, base.accumulate);
    let opts = *base;
    let x = Rng::new(w.rows as u64 * 31 + w.cols as u64).normals(lay.x_off + nmax * lay.xs, 1.0);
    let xb = g.upload_f32(&x, "x").unwrap();
    let run = |n: usize, multi: bool| {
        let yb = g.upload_f32(&lay.y0, "y").unwrap();
        let mut pass = g.pass();
        if multi {
            matvec::matvec_multi(
                &mut pass,
                &w.t,
                lay.x(&xb, lay.x_off),
                lay.y(&yb, lay.y_off),
                n as u32,
                &opts,
            )
            .unwrap();
        } else {
            for t in 0..n {
                let (xo, yo) = (lay.x_off + t * lay.xs, lay.y_off + t * lay.ys);
                matvec::matvec_opts(&mut pass, &w.t, lay.x(&xb, xo), lay.y(&yb, yo), 1, &opts)
                    .unwrap();
            }
        }
        pass.submit().unwrap();
        g.read_f32(&yb, 0, lay.len).unwrap()
    };
    let lone = run(nmax, false);
    for &n in ts {
        let got = run(n, true);
        assert_same_bits(&got, &lone, &lay, w.rows, n, &format!("{what} T={n}"));
        if n == nmax && !opts.int8_x {
            assert_near_cpu(&got, w, &x, &lay, n, &format!("{what} T={n}"));
        }
    }
}

/// Columns per type: odd and unaligned float rows (the element path), a partial 256-block, whole
/// blocks; one and several blocks of the quantized types.
fn cols_of(dt: DType) -> &'static [usize] {
    match dt {
        DType::F32 => &[161, 772, 768],
        DType::F16 | DType::BF16 => &[161, 776, 768],
        _ if dt.block_size() == 256 => &[768, 256],
        DType::F8_E4M3_B128 => &[384, 128],
        _ => &[160, 32],
    }
}

#[test]
fn every_type_every_count_matches_lone_matvec() {
    let g = gpu();
    for (i, dt) in ALL.into_iter().enumerate() {
        for (k, &cols) in cols_of(dt).iter().enumerate() {
            let _l = serial();
            // 37 rows: not a multiple of any row group
            let w = Weight::random(g, dt, 37, cols, 10 * i as u64 + k as u64);
            let ts: &[usize] = if k == 0 { &TS } else { &[2, 13] };
            let what = format!("{dt} 37x{cols}");
            check_plain(&w, ts, (0, 0, 0), &MatvecOpts::default(), &what);
        }
    }
}

/// Offsets, padded strides (x rows not 16-byte aligned too), accumulation, work splits and the
/// workgroup-memory reduction.
#[test]
fn options_match_lone_matvec() {
    let g = gpu();
    let tunes = [
        None,
        Some(Tune {
            wg: 64,
            rows: 1,
            lanes: None,
        }),
        Some(Tune {
            wg: 256,
            rows: 4,
            lanes: None,
        }),
        Some(Tune {
            wg: 16,
            rows: 3,
            lanes: None,
        }),
    ];
    for (i, dt) in [
        DType::Q4_K,
        DType::Q8_0,
        DType::F16,
        DType::Q6_K,
        DType::MXFP4,
        DType::IQ4_XS,
    ]
    .into_iter()
    .enumerate()
    {
        let _l = serial();
        let cols = cols_of(dt)[0];
        let w = Weight::random(g, dt, 45, cols, 100 + i as u64);
        for (k, tune) in tunes.iter().enumerate() {
            let opts = MatvecOpts {
                accumulate: k % 2 == 1,
                portable: k == 2,
                tune: *tune,
                ..Default::default()
            };
            let pads = if k % 2 == 0 { (4, 8, 3) } else { (3, 7, 1) };
            let what = format!("{dt} 45x{cols} {opts:?} pads {pads:?}");
            check_plain(&w, &[3, 9], pads, &opts, &what);
        }
    }
}

/// Real row lengths (lanes per row and slice counts of the model shapes).
#[test]
fn real_row_length_matches_lone_matvec() {
    let g = gpu();
    for (i, dt) in [DType::Q4_K, DType::Q6_K, DType::Q8_0]
        .into_iter()
        .enumerate()
    {
        let _l = serial();
        let w = Weight::random(g, dt, 256, 4096, 500 + i as u64);
        check_plain(
            &w,
            &[8, 13],
            (0, 0, 0),
            &MatvecOpts::default(),
            &format!("{dt} 256x4096"),
        );
    }
}

/// int8 activations (`MatvecOpts::int8_x`): the token-group kernel over the quantized rows has
/// the bits of the one-token int8 kernel.
#[test]
fn int8_x_matches_lone_matvec() {
    let g = gpu();
    for (i, dt) in ALL
        .into_iter()
        .filter(|d| matvec::int8_x_supported(*d))
        .enumerate()
    {
        let _l = serial();
        let cols = if dt.block_size() == 256 { 512 } else { 160 };
        let w = Weight::random(g, dt, 37, cols, 600 + i as u64);
        let opts = MatvecOpts {
            int8_x: true,
            ..Default::default()
        };
        check_plain(&w, &TS, (0, 0, 0), &opts, &format!("{dt} int8 x 37x{cols}"));
        let opts = MatvecOpts {
            accumulate: true,
            ..opts
        };
        check_plain(
            &w,
            &[5],
            (4, 4, 2),
            &opts,
            &format!("{dt} int8 x accumulate"),
        );
    }
}

/// `matmul_opts` sends 2..=DENSE_MATVEC_TOKENS tokens to the token-group kernel: bits of lone
/// one-token products.
#[test]
fn matmul_small_batches_match_lone_matvec() {
    let g = gpu();
    let _l = serial();
    let w = Weight::random(g, DType::Q4_K, 37, 512, 700);
    let most = matmul::DENSE_MATVEC_TOKENS as usize;
    let x = Rng::new(701).normals(most * 512, 1.0);
    let xb = g.upload_f32(&x, "x").unwrap();
    let opts = MatvecOpts::default();
    for n in [2usize, 7, most] {
        let yb = g.upload_f32(&vec![0.0; n * 37], "y").unwrap();
        let yl = g.upload_f32(&vec![0.0; n * 37], "y").unwrap();
        let mut pass = g.pass();
        matmul::matmul_opts(
            &mut pass,
            &w.t,
            Operand::new(&xb, 0),
            Operand::new(&yb, 0),
            n as u32,
            &opts,
        )
        .unwrap();
        for t in 0..n as u32 {
            matvec::matvec_opts(
                &mut pass,
                &w.t,
                Operand::new(&xb, t * 512),
                Operand::new(&yl, t * 37),
                1,
                &opts,
            )
            .unwrap();
        }
        pass.submit().unwrap();
        let (a, b) = (
            g.read_f32(&yb, 0, n * 37).unwrap(),
            g.read_f32(&yl, 0, n * 37).unwrap(),
        );
        assert!(
            a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()),
            "matmul_opts of {n} tokens differs from lone matvec"
        );
    }
}

/// Prologue `kind` (RMSNorm, RMSNorm keeping its rows, SwiGLU, gated SwiGLU) for token `t` run
/// alone (or a group starting at token 0).
fn pro_of<'a>(
    kind: usize,
    t: usize,
    keep: &'a wgpu::Buffer,
    nw: &'a wgpu::Buffer,
    gate: &'a wgpu::Buffer,
    cols: u32,
) -> Prologue<'a> {
    match kind {
        0 => Prologue::RmsNorm {
            w: nw,
            eps: 1e-6,
            keep: None,
        },
        1 => Prologue::RmsNorm {
            w: nw,
            eps: 1e-6,
            keep: Some(keep),
        },
        2 => Prologue::SwiGlu { up: cols },
        _ => Prologue::SwiGluGated {
            up: cols,
            gate,
            off: (1 + 3 * t) as u32,
            stride: 3,
        },
    }
}

/// The fused prologues (`matvec_fused` with 2+ tokens takes the token-group kernel): RMSNorm
/// (and the normed rows it keeps), SwiGLU and the gated SwiGLU epilogue, against the same call
/// per token alone.
#[test]
fn prologues_match_lone_tokens() {
    let g = gpu();
    for (i, (dt, cols)) in [
        (DType::Q4_K, 512),
        (DType::F16, 161),
        (DType::F32, 768),
        (DType::Q8_0, 160),
    ]
    .into_iter()
    .enumerate()
    {
        let _l = serial();
        let rows = 37usize;
        let w = Weight::random(g, dt, rows, cols, 800 + i as u64);
        let nmax = 13usize;
        let mut rng = Rng::new(801 + i as u64);
        // x rows: gate values then up values (SwiGLU), 2 cols apart per token
        let xs = 2 * cols;
        let x = rng.normals(nmax * xs, 1.0);
        let xb = g.upload_f32(&x, "x").unwrap();
        let nwb = g.upload_f32(&rng.normals(cols, 1.0), "nw").unwrap();
        let gate = g.upload_f32(&rng.normals(3 * nmax, 2.0), "gate").unwrap();
        let y0 = rng.normals(nmax * rows, 1.0);
        for kind in 0..4 {
            let keep_m = g.upload_f32(&vec![0.0; nmax * cols], "keep").unwrap();

            let opts = MatvecOpts {
                accumulate: kind == 2,
                ..Default::default()
            };
            for n in [2usize, 5, 9, 13] {
                let ym = g.upload_f32(&y0, "y").unwrap();
                let yl = g.upload_f32(&y0, "y").unwrap();
                let mut pass = g.pass();
                let pro = pro_of(kind, 0, &keep_m, &nwb, &gate, cols as u32);
                let x = Operand::strided(&xb, 0, xs as u32);
                matvec::matvec_pro(
                    &mut pass,
                    &w.t,
                    x,
                    Operand::new(&ym, 0),
                    n as u32,
                    &opts,
                    &pro,
                )
                .unwrap();
                pass.submit().unwrap();
                for t in 0..n {
                    // a lone token keeps its normed row at row 0 of its own buffer
                    let kl = g.upload_f32(&vec![0.0; cols], "keep").unwrap();
                    let mut pass = g.pass();
                    let pro = pro_of(kind, t, &kl, &nwb, &gate, cols as u32);
                    let (xo, yo) = ((t * xs) as u32, (t * rows) as u32);
                    let x = Operand::strided(&xb, xo, xs as u32);
                    matvec::matvec_pro(&mut pass, &w.t, x, Operand::new(&yl, yo), 1, &opts, &pro)
                        .unwrap();
                    pass.submit().unwrap();
                    if kind == 1 {
                        let row = g.read_f32(&kl, 0, cols).unwrap();
                        let got = g.read_f32(&keep_m, (t * cols) as u64, cols).unwrap();
                        assert!(
                            got.iter()
                                .zip(&row)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{dt} kept normed row of token {t} of {n} differs"
                        );
                    }
                }
                let (a, b) = (
                    g.read_f32(&ym, 0, nmax * rows).unwrap(),
                    g.read_f32(&yl, 0, nmax * rows).unwrap(),
                );
                for (j, (p, q)) in a.iter().zip(&b).enumerate() {
                    let want = if j < n * rows { *q } else { y0[j] };
                    assert_eq!(
                        p.to_bits(),
                        want.to_bits(),
                        "{dt} prologue {kind}: T={n} token {} row {} is {p}, lone {want}",
                        j / rows,
                        j % rows
                    );
                }
            }
        }
    }
}

/// A normed product tall enough that the one-token kernel shares each x load over two row
/// quads (`NORM_QUAD_ROWS` in src/gpu/matvec.rs) while the token-group kernel keeps one: every
/// token's rows still have the lone product's bits (the verify step relies on it).
#[test]
fn tall_normed_product_matches_lone_tokens() {
    let g = gpu();
    let _l = serial();
    let (rows, cols, n) = (16384 + 37, 64usize, 3usize);
    let w = Weight::random(g, DType::Q8_0, rows, cols, 901);
    let mut rng = Rng::new(902);
    let xb = g.upload_f32(&rng.normals(n * cols, 1.0), "x").unwrap();
    let nwb = g.upload_f32(&rng.normals(cols, 1.0), "nw").unwrap();
    let pro = Prologue::RmsNorm {
        w: &nwb,
        eps: 1e-6,
        keep: None,
    };
    let opts = MatvecOpts::default();
    let ym = g.buffer((n * rows * 4) as u64, "ym").unwrap();
    let yl = g.buffer((n * rows * 4) as u64, "yl").unwrap();
    let mut pass = g.pass();
    matvec::matvec_pro(
        &mut pass,
        &w.t,
        Operand::new(&xb, 0),
        Operand::new(&ym, 0),
        n as u32,
        &opts,
        &pro,
    )
    .unwrap();
    for t in 0..n {
        let (xo, yo) = ((t * cols) as u32, (t * rows) as u32);
        matvec::matvec_pro(
            &mut pass,
            &w.t,
            Operand::new(&xb, xo),
            Operand::new(&yl, yo),
            1,
            &opts,
            &pro,
        )
        .unwrap();
    }
    pass.submit().unwrap();
    let (a, b) = (
        g.read_f32(&ym, 0, n * rows).unwrap(),
        g.read_f32(&yl, 0, n * rows).unwrap(),
    );
    for (j, (p, q)) in a.iter().zip(&b).enumerate() {
        assert_eq!(
            p.to_bits(),
            q.to_bits(),
            "token {} row {}: {p} against lone {q}",
            j / rows,
            j % rows
        );
    }
}

/// The GDN conv step fused into the qkv product (`matvec::ConvStep`), nine sequences of one
/// token each in scattered slots: outputs and rolled conv states have the bits of nine lone
/// one-sequence steps.
#[test]
fn conv_step_matches_lone_sequences() {
    use lathe::gpu::gdn::{SeqBatch, SeqSpan};
    let g = gpu();
    let (channels, k, cols, n) = (40u32, 4u32, 256usize, 9usize);
    let rows = channels as usize + 9;
    let slots = [4u32, 0, 7, 2, 8, 1, 6, 3, 5];
    for (i, dt) in [DType::Q4_K, DType::F32].into_iter().enumerate() {
        let _l = serial();
        let w = Weight::random(g, dt, rows, cols, 900 + i as u64);
        let mut rng = Rng::new(901 + i as u64);
        let xb = g.upload_f32(&rng.normals(n * cols, 1.0), "x").unwrap();
        let nwb = g.upload_f32(&rng.normals(cols, 1.0), "nw").unwrap();
        let cwb = g
            .upload_f32(&rng.normals((channels * k) as usize, 0.5), "cw")
            .unwrap();
        let st0 = rng.normals(n * ((k - 1) * channels) as usize, 1.0);
        let pro = Prologue::RmsNorm {
            w: &nwb,
            eps: 1e-6,
            keep: None,
        };
        let opts = MatvecOpts::default();
        let run = |spans: &[SeqSpan], x_off: usize, y: &wgpu::Buffer, st: &wgpu::Buffer| {
            let batch = SeqBatch::new(g, spans).unwrap();
            let step = matvec::ConvStep {
                channels,
                k,
                w: &cwb,
                state: st,
                state_off: 0,
                batch: &batch,
            };
            let (xo, yo, nt) = (
                x_off as u32,
                (x_off / cols * rows) as u32,
                spans.len() as u32,
            );
            let mut pass = g.pass();
            matvec::matvec_fused(
                &mut pass,
                &w.t,
                Operand::new(&xb, xo),
                Operand::new(y, yo),
                nt,
                &opts,
                matvec::Fused {
                    pro: Some(&pro),
                    epi: matvec::Epilogue::Conv(&step),
                },
            )
            .unwrap();
            pass.submit().unwrap();
        };
        let span = |row: usize, t: usize| SeqSpan {
            row: row as u32,
            n_tokens: 1,
            slot: slots[t],
        };
        let (ym, stm) = (
            g.upload_f32(&vec![0.0; n * rows], "y").unwrap(),
            g.upload_f32(&st0, "state").unwrap(),
        );
        let all: Vec<SeqSpan> = (0..n).map(|t| span(t, t)).collect();
        run(&all, 0, &ym, &stm);
        let (yl, stl) = (
            g.upload_f32(&vec![0.0; n * rows], "y").unwrap(),
            g.upload_f32(&st0, "state").unwrap(),
        );
        for t in 0..n {
            run(&[span(0, t)], t * cols, &yl, &stl);
        }
        let (a, b) = (
            g.read_f32(&ym, 0, n * rows).unwrap(),
            g.read_f32(&yl, 0, n * rows).unwrap(),
        );
        for (j, (p, q)) in a.iter().zip(&b).enumerate() {
            assert_eq!(
                p.to_bits(),
                q.to_bits(),
                "{dt} sequence {} row {}",
                j / rows,
                j % rows
            );
        }
        let (sa, sb) = (
            g.read_f32(&stm, 0, st0.len()).unwrap(),
            g.read_f32(&stl, 0, st0.len()).unwrap(),
        );
        assert_eq!(sa, sb, "{dt}: conv states differ");
        assert_ne!(sa, st0, "{dt}: conv states not rolled");
    }
}

/// On a device that decodes with int8 activations (`--activations int8`), a batched product of
/// default options takes int8 x for its rows as a lone one-token product does: the bits match.
#[test]
fn int8_decode_device_rows_match_lone_decode() {
    let g8 = Gpu::new(&AdapterChoice::Auto)
        .unwrap()
        .with_int8_decode(true);
    for (i, dt) in [DType::Q4_K, DType::Q8_0].into_iter().enumerate() {
        let w = Weight::random(&g8, dt, 37, 512, 950 + i as u64);
        let x = Rng::new(951).normals(9 * 512, 1.0);
        let xb = g8.upload_f32(&x, "x").unwrap();
        let opts = MatvecOpts::default();
        for n in [2usize, 9] {
            let yb = g8.upload_f32(&vec![0.0; n * 37], "y").unwrap();
            let yl = g8.upload_f32(&vec![0.0; n * 37], "y").unwrap();
            let mut pass = g8.pass();
            matmul::matmul_opts(
                &mut pass,
                &w.t,
                Operand::new(&xb, 0),
                Operand::new(&yb, 0),
                n as u32,
                &opts,
            )
            .unwrap();
            for t in 0..n as u32 {
                matmul::matmul_opts(
                    &mut pass,
                    &w.t,
                    Operand::new(&xb, t * 512),
                    Operand::new(&yl, t * 37),
                    1,
                    &opts,
                )
                .unwrap();
            }
            pass.submit().unwrap();
            let (a, b) = (
                g8.read_f32(&yb, 0, n * 37).unwrap(),
                g8.read_f32(&yl, 0, n * 37).unwrap(),
            );
            assert!(
                a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dt}: {n} tokens on an int8-decode device differ from lone decode"
            );
            // and the rows are int8 ones: not the f32 product's bits
            let yf = g8.upload_f32(&[0.0; 37], "y").unwrap();
            let mut pass = g8.pass();
            let exact = MatvecOpts {
                exact: true,
                ..Default::default()
            };
            matmul::matmul_opts(
                &mut pass,
                &w.t,
                Operand::new(&xb, 0),
                Operand::new(&yf, 0),
                1,
                &exact,
            )
            .unwrap();
            pass.submit().unwrap();
            let f = g8.read_f32(&yf, 0, 37).unwrap();
            assert!(
                f.iter().zip(&a).any(|(p, q)| p.to_bits() != q.to_bits()),
                "{dt}: int8 x not taken"
            );
        }
    }
}
