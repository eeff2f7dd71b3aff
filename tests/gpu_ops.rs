//! The small GPU ops (elementwise, norms, RoPE, softmax, embedding gather, top-k, router)
//! against their CPU references in `lathe::cpu::ops`, on whatever adapter the machine has
//! (lavapipe in CI).
//!
//! Every output lives inside a larger buffer at an offset (and usually a row stride), the
//! rest of which is filled with guard values: a test fails if any element outside the op's
//! rows changes. Sizes: odd (1, 7, 33, 255, 1000) and real (2048, 4096, 16 heads × 256,
//! 64 heads × 512, vocab 248,320). Tolerances are stated per test.

use lathe::cpu::ops;
use lathe::gpu::elementwise as ew;
use lathe::gpu::operand::Operand;
use lathe::gpu::rope::{Positions, RopeTable, RopeView};
use lathe::gpu::router::RouterRows;
use lathe::gpu::{embed, norm, rope, softmax, topk, AdapterChoice, Gpu, GpuTensor, TensorPart};
use lathe::tensor::TensorRef;
use lathe::DType;
use std::path::Path;

const GUARD: f32 = -7777.25;

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
    /// Roughly normal (sum of four uniforms, variance 4/3 → scaled to 1).
    fn normal(&mut self) -> f32 {
        (self.uniform() + self.uniform() + self.uniform() + self.uniform()) * 0.866
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }
}

/// Where `rows × cols` live inside a guarded buffer.
#[derive(Clone, Copy, Debug)]
struct Layout {
    rows: usize,
    cols: usize,
    off: usize,
    stride: usize,
}

impl Layout {
    fn new(rows: usize, cols: usize, off: usize, stride: usize) -> Layout {
        Layout {
            rows,
            cols,
            off,
            stride,
        }
    }
    fn len(&self) -> usize {
        self.off + (self.rows - 1) * self.stride + self.cols + 5
    }
    fn idx(&self, r: usize, c: usize) -> usize {
        self.off + r * self.stride + c
    }
    /// The buffer: guards everywhere, `data` (packed rows) at the layout's positions.
    fn place(&self, data: &[f32]) -> Vec<f32> {
        let mut v = vec![GUARD; self.len()];
        for r in 0..self.rows {
            for c in 0..self.cols {
                v[self.idx(r, c)] = data[r * self.cols + c];
            }
        }
        v
    }
    fn gather(&self, full: &[f32]) -> Vec<f32> {
        let mut v = Vec::with_capacity(self.rows * self.cols);
        for r in 0..self.rows {
            for c in 0..self.cols {
                v.push(full[self.idx(r, c)]);
            }
        }
        v
    }
    fn view<'a>(&self, buf: &'a wgpu::Buffer) -> Operand<'a> {
        Operand::strided(buf, self.off as u32, self.stride as u32)
    }
}

/// `|got − want| ≤ abs + rel·|want|` elementwise (NaN only where NaN is expected).
#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f32], abs: f32, rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() && g.is_nan() {
            continue;
        }
        let err = (g - w).abs();
        assert!(
            err <= abs + rel * w.abs(),
            "{what}: element {i}: got {g}, want {w} (err {err:e})"
        );
    }
}

/// Everything outside `layout` must be bit-identical to `before`.
#[track_caller]
fn assert_guards(what: &str, layout: &Layout, full: &[f32], before: &[f32]) {
    let mut inside = vec![false; full.len()];
    for r in 0..layout.rows {
        for c in 0..layout.cols {
            inside[layout.idx(r, c)] = true;
        }
    }
    for i in 0..full.len() {
        if !inside[i] {
            assert_eq!(
                full[i].to_bits(),
                before[i].to_bits(),
                "{what}: element {i} outside the output changed"
            );
        }
    }
}

/// Run `f` on a fresh pass, submit, and read `buf` back whole.
fn run(gpu: &Gpu, buf: &wgpu::Buffer, f: impl FnOnce(&mut lathe::gpu::Pass<'_>)) -> Vec<f32> {
    let mut pass = gpu.pass();
    f(&mut pass);
    pass.submit().unwrap();
    gpu.read_f32(buf, 0, (buf.size() / 4) as usize).unwrap()
}

fn weight_tensor(gpu: &Gpu, dtype: DType, w: &[f32]) -> (GpuTensor, Vec<f32>) {
    let bytes = lathe::quant::quantize(dtype, w).unwrap();
    let shape = [w.len() as u64];
    let t = TensorRef {
        name: "w",
        dtype,
        shape: &shape,
        data: &bytes,
        path: Path::new("test"),
    };
    let deq = lathe::quant::dequantize_to_vec(dtype, &bytes, w.len()).unwrap();
    (gpu.upload_tensor(&t).unwrap(), deq)
}

// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Ew {
    Add,
    Mul,
    Scale,
    Copy,
    Silu,
    Sigmoid,
    Swiglu,
    SwigluLimit,
    SwigluActClamp,
    Geglu,
    Softcap,
    SigmoidMul,
    SigmoidMulRow,
    AddInplace,
    MulInplace,
    ScaleInplace,
    SigmoidMulInplace,
    SigmoidMulRowInplace,
    AxpyRow,
}

/// Elementwise ops on strided rows. Tolerance: 1e-6 abs + 2e-6 relative (exp-based ops;
/// the arithmetic ones are exact).
#[test]
fn elementwise_matches_cpu() {
    let gpu = gpu();
    let mut rng = Rng(0x1234_5678);
    for &(rows, cols) in &[(1, 1), (3, 7), (2, 33), (5, 255), (1, 1000), (3, 2048)] {
        let ly = Layout::new(rows, cols, 3, cols + 2);
        let la = Layout::new(rows, cols, 1, cols + 5);
        let lb = Layout::new(rows, cols, 0, cols);
        let ls = Layout::new(rows, 1, 2, 3);
        // Gates reach ±20 so SwiGLU's clamps at 10 (before SiLU) and 3 (after) bite; sigmoids
        // see both tails.
        let a = rng.vec(rows * cols, 8.0);
        let b = rng.vec(rows * cols, 8.0);
        let s = rng.vec(rows, 3.0);
        let y0 = rng.vec(rows * cols, 1.0);
        let abuf = gpu.upload_f32(&la.place(&a), "a").unwrap();
        let bbuf = gpu.upload_f32(&lb.place(&b), "b").unwrap();
        let sbuf = gpu.upload_f32(&ls.place(&s), "s").unwrap();
        let alpha = 0.37f32;
        use Ew::*;
        for op in [
            Add,
            Mul,
            Scale,
            Copy,
            Silu,
            Sigmoid,
            Swiglu,
            SwigluLimit,
            SwigluActClamp,
            Geglu,
            Softcap,
            SigmoidMul,
            SigmoidMulRow,
            AddInplace,
            MulInplace,
            ScaleInplace,
            SigmoidMulInplace,
            SigmoidMulRowInplace,
            AxpyRow,
        ] {
            let inplace = matches!(
                op,
                AddInplace
                    | Softcap
                    | MulInplace
                    | ScaleInplace
                    | SigmoidMulInplace
                    | SigmoidMulRowInplace
                    | AxpyRow
            );
            let before = if inplace {
                ly.place(&y0)
            } else {
                vec![GUARD; ly.len()]
            };
            let ybuf = gpu.upload_f32(&before, "y").unwrap();
            let (r, c) = (rows as u32, cols as u32);
            let (yv, av, bv, sv) = (
                ly.view(&ybuf),
                la.view(&abuf),
                lb.view(&bbuf),
                ls.view(&sbuf),
            );
            let full = run(&gpu, &ybuf, |p| {
                match op {
                    Add => ew::add_rows(p, r, c, yv, av, bv),
                    Mul => ew::mul(p, r, c, yv, av, bv),
                    Scale => ew::scale(p, r, c, yv, av, alpha),
                    Copy => ew::copy(p, r, c, yv, av),
                    Silu => ew::silu(p, r, c, yv, av),
                    Sigmoid => ew::sigmoid(p, r, c, yv, av),
                    Swiglu => ew::swiglu(p, r, c, yv, av, bv, None),
                    SwigluLimit => ew::swiglu(p, r, c, yv, av, bv, Some(10.0)),
                    SwigluActClamp => ew::swiglu_act_clamp(p, r, c, yv, av, bv, 3.0),
                    Geglu => ew::geglu(p, r, c, yv, av, bv),
                    Softcap => ew::softcap_inplace(p, r, c, yv, alpha),
                    SigmoidMul => ew::sigmoid_mul(p, r, c, yv, av, bv),
                    SigmoidMulRow => ew::sigmoid_mul_row(p, r, c, yv, sv, av),
                    AddInplace => ew::add_inplace(p, r, c, yv, av),
                    MulInplace => ew::mul_inplace(p, r, c, yv, av),
                    ScaleInplace => ew::scale_inplace(p, r, c, yv, alpha),
                    SigmoidMulInplace => ew::sigmoid_mul_inplace(p, r, c, yv, av),
                    SigmoidMulRowInplace => ew::sigmoid_mul_row_inplace(p, r, c, yv, sv),
                    AxpyRow => ew::axpy_row(p, r, c, yv, sv, av),
                }
                .unwrap()
            });
            let want: Vec<f32> = match op {
                Swiglu => ops::swiglu(&a, &b, None),
                SwigluLimit => ops::swiglu(&a, &b, Some(10.0)),
                SwigluActClamp => ops::swiglu_act_clamp(&a, &b, 3.0),
                Geglu => ops::geglu(&a, &b),
                _ => (0..rows * cols)
                    .map(|i| {
                        let (x, g, row_s, y) = (a[i], b[i], s[i / cols], y0[i]);
                        match op {
                            Add => x + g,
                            Mul => x * g,
                            Scale => alpha * x,
                            Copy => x,
                            Silu => ops::silu(x),
                            Sigmoid => ops::sigmoid(x),
                            SigmoidMul => ops::sigmoid(x) * g,
                            SigmoidMulRow => ops::sigmoid(row_s) * x,
                            AddInplace => y + x,
                            MulInplace => y * x,
                            ScaleInplace => alpha * y,
                            Softcap => ops::softcap(y, alpha),
                            SigmoidMulInplace => ops::sigmoid(x) * y,
                            SigmoidMulRowInplace => ops::sigmoid(row_s) * y,
                            AxpyRow => y + row_s * x,
                            Swiglu | SwigluLimit | SwigluActClamp | Geglu => unreachable!(),
                        }
                    })
                    .collect(),
            };
            let what = format!("{op:?} {rows}x{cols}");
            assert_guards(&what, &ly, &full, &before);
            assert_close(&what, &ly.gather(&full), &want, 1e-6, 2e-6);
        }
    }
}

#[test]
fn elementwise_rejects_out_of_bounds_views() {
    let gpu = gpu();
    let a = gpu.upload_f32(&[0.0; 10], "a").unwrap();
    let y = gpu.buffer(40, "y").unwrap();
    let mut pass = gpu.pass();
    let err = ew::copy(&mut pass, 2, 6, Operand::new(&y, 0), Operand::new(&a, 0)).unwrap_err();
    assert!(err.to_string().contains("copy"), "{err}");
}

// ---------------------------------------------------------------------------------------

/// RMSNorm (F32 / F16 / BF16 / no weight, out of place and in place, fused residual), L2
/// (both modes, scaled) and gated RMSNorm, with rows off the 4-element grid (the scalar
/// kernel) and on it (the vec4 kernel for ungated rows longer than 256); rows longer than
/// the vec4s the threads keep in registers (8192 elements) take the loop past them.
/// Tolerance: 1e-6 abs + 1e-5 relative against the f64 reference.
#[test]
fn norms_match_cpu() {
    let gpu = gpu();
    let mut rng = Rng(0xabcdef);
    let eps = 1e-6f32;
    let shapes = [
        (3, 1, false),
        (2, 7, false),
        (3, 33, false),
        (2, 255, false),
        (3, 1000, false),
        (2, 2048, false),
        (2, 4096, false),
        (3, 12, true),
        (2, 1000, true),
        (3, 4096, true),
        (2, 9216, true),
    ];
    for &(rows, dim, aligned) in &shapes {
        let (lx, ly, lz) = if aligned {
            (
                Layout::new(rows, dim, 4, dim + 4),
                Layout::new(rows, dim, 8, dim),
                Layout::new(rows, dim, 0, dim + 12),
            )
        } else {
            (
                Layout::new(rows, dim, 2, dim + 3),
                Layout::new(rows, dim, 5, dim + 1),
                Layout::new(rows, dim, 1, dim),
            )
        };
        let x: Vec<f32> = rng.vec(rows * dim, 2.0).iter().map(|v| v + 0.5).collect();
        let z = rng.vec(rows * dim, 3.0);
        let w = rng
            .vec(dim, 0.3)
            .iter()
            .map(|v| v + 1.0)
            .collect::<Vec<_>>();
        let xbuf = gpu.upload_f32(&lx.place(&x), "x").unwrap();
        let zbuf = gpu.upload_f32(&lz.place(&z), "z").unwrap();
        let (n, d) = (rows as u32, dim as u32);
        let rms = norm::Rms {
            n_rows: n,
            dim: d,
            eps,
        };
        for wt in [None, Some(DType::F32), Some(DType::F16), Some(DType::BF16)] {
            let (wtensor, wref) = match wt {
                Some(t) => {
                    let (g, r) = weight_tensor(&gpu, t, &w);
                    (Some(g), Some(r))
                }
                None => (None, None),
            };
            let what = format!("rms_norm {rows}x{dim} aligned {aligned} w {wt:?}");
            let want = ops::rms_norm(&x, dim, wref.as_deref(), eps);
            // Out of place.
            let before = vec![GUARD; ly.len()];
            let ybuf = gpu.upload_f32(&before, "y").unwrap();
            let full = run(&gpu, &ybuf, |p| {
                norm::rms_norm(
                    p,
                    n,
                    d,
                    lx.view(&xbuf),
                    Some(ly.view(&ybuf)),
                    wtensor.as_ref(),
                    eps,
                )
                .unwrap()
            });
            assert_guards(&what, &ly, &full, &before);
            assert_close(&what, &ly.gather(&full), &want, 1e-6, 1e-5);
            // In place.
            let before = lx.place(&x);
            let ibuf = gpu.upload_f32(&before, "x_inplace").unwrap();
            let full = run(&gpu, &ibuf, |p| {
                norm::rms_norm(p, n, d, lx.view(&ibuf), None, wtensor.as_ref(), eps).unwrap()
            });
            assert_guards(&what, &lx, &full, &before);
            assert_close(
                &format!("{what} in place"),
                &lx.gather(&full),
                &want,
                1e-6,
                1e-5,
            );
            // Gated (Qwen3.5 GDN output norm).
            let want = ops::gated_rms_norm(&x, &z, dim, wref.as_deref(), eps);
            let before = vec![GUARD; ly.len()];
            let ybuf = gpu.upload_f32(&before, "y").unwrap();
            let full = run(&gpu, &ybuf, |p| {
                let (o, z) = (lx.view(&xbuf), lz.view(&zbuf));
                norm::gated_rms_norm(p, rms, o, z, Some(ly.view(&ybuf)), wtensor.as_ref()).unwrap()
            });
            assert_guards(&format!("gated {what}"), &ly, &full, &before);
            assert_close(
                &format!("gated {what}"),
                &ly.gather(&full),
                &want,
                1e-6,
                1e-5,
            );
        }
        // Fused residual: x += r, y = rmsnorm(x)·w.
        let (wt, wref) = weight_tensor(&gpu, DType::BF16, &w);
        let before_x = lx.place(&x);
        let hbuf = gpu.upload_f32(&before_x, "h").unwrap();
        let before = vec![GUARD; ly.len()];
        let ybuf = gpu.upload_f32(&before, "y").unwrap();
        let full = run(&gpu, &ybuf, |p| {
            let (x, r) = (lx.view(&hbuf), lz.view(&zbuf));
            norm::add_rms_norm(p, rms, x, r, ly.view(&ybuf), Some(&wt)).unwrap()
        });
        let h: Vec<f32> = x.iter().zip(&z).map(|(a, b)| a + b).collect();
        let what = format!("add_rms_norm {rows}x{dim} aligned {aligned}");
        assert_guards(&what, &ly, &full, &before);
        assert_close(
            &what,
            &ly.gather(&full),
            &ops::rms_norm(&h, dim, Some(&wref), eps),
            1e-6,
            1e-5,
        );
        let hfull = gpu.read_f32(&hbuf, 0, lx.len()).unwrap();
        assert_guards(&what, &lx, &hfull, &before_x);
        assert_eq!(lx.gather(&hfull), h, "{what}: residual sum written back");
        // L2, both guards against zero, with GDN's 1/sqrt(d_k) scale.
        for mode in [ops::L2Mode::Hf, ops::L2Mode::Ggml] {
            let scale = 1.0 / (dim as f32).sqrt();
            let want = ops::l2_norm(&x, dim, eps, mode, scale);
            let before = vec![GUARD; ly.len()];
            let ybuf = gpu.upload_f32(&before, "y").unwrap();
            let full = run(&gpu, &ybuf, |p| {
                let l2 = norm::L2 {
                    n_rows: n,
                    dim: d,
                    eps,
                    mode,
                    scale,
                };
                norm::l2_norm(p, l2, lx.view(&xbuf), Some(ly.view(&ybuf))).unwrap()
            });
            let what = format!("l2_norm {mode:?} {rows}x{dim} aligned {aligned}");
            assert_guards(&what, &ly, &full, &before);
            assert_close(&what, &ly.gather(&full), &want, 1e-6, 1e-5);
        }
    }
}

/// Per-head RMSNorm in place on Qwen3.5's q layout `[tokens, heads, q(256) | gate(256)]`:
/// only the q halves change. Tolerance as `norms_match_cpu`.
#[test]
fn per_head_norm_leaves_gates_alone() {
    let gpu = gpu();
    let mut rng = Rng(42);
    let (n_tok, n_head, hd) = (3usize, 16usize, 256usize);
    let rows = n_tok * n_head;
    let lq = Layout::new(rows, hd, 7, 2 * hd);
    let all = rng.vec(lq.len(), 1.5);
    let q = lq.gather(&all);
    let w = rng.vec(hd, 0.2).iter().map(|v| v + 1.0).collect::<Vec<_>>();
    let (wt, wref) = weight_tensor(&gpu, DType::F32, &w);
    let buf = gpu.upload_f32(&all, "q").unwrap();
    let full = run(&gpu, &buf, |p| {
        norm::rms_norm(
            p,
            rows as u32,
            hd as u32,
            lq.view(&buf),
            None,
            Some(&wt),
            1e-6,
        )
        .unwrap()
    });
    assert_guards("per-head q norm", &lq, &full, &all);
    assert_close(
        "per-head q norm",
        &lq.gather(&full),
        &ops::rms_norm(&q, hd, Some(&wref), 1e-6),
        1e-6,
        1e-5,
    );
}

#[test]
fn norm_rejects_bad_weights() {
    let gpu = gpu();
    let x = gpu.upload_f32(&[1.0; 64], "x").unwrap();
    let (w, _) = weight_tensor(&gpu, DType::Q8_0, &[1.0; 32]);
    let mut pass = gpu.pass();
    let err =
        norm::rms_norm(&mut pass, 2, 32, Operand::new(&x, 0), None, Some(&w), 1e-6).unwrap_err();
    assert!(err.to_string().contains("Q8_0"), "{err}");
    let (w, _) = weight_tensor(&gpu, DType::F32, &[1.0; 16]);
    let err =
        norm::rms_norm(&mut pass, 2, 32, Operand::new(&x, 0), None, Some(&w), 1e-6).unwrap_err();
    assert!(err.to_string().contains("[32]"), "{err}");
}

// ---------------------------------------------------------------------------------------

struct RopeCase {
    name: &'static str,
    n_tok: usize,
    n_head: usize,
    head_dim: usize,
    n_rot: usize,
    interleaved: bool,
    inv_freq: Vec<f32>,
    /// Extra elements between heads (a `[q | gate]` layout leaves the gate untouched).
    head_gap: usize,
}

/// RoPE against the exact-angle f64 reference at positions up to 3·10^6. Tolerance: 2e-5 abs
/// (values ~N(0, 1.5²)).
#[test]
fn rope_matches_cpu() {
    let gpu = gpu();
    let mut rng = Rng(7);
    let yarn = ops::Yarn {
        factor: 16.0,
        original_max_position: 65536,
        beta_fast: 32.0,
        beta_slow: 1.0,
    };
    let cases = [
        RopeCase {
            name: "qwen35 16x256 rot 64 neox, q|gate layout",
            n_tok: 6,
            n_head: 16,
            head_dim: 256,
            n_rot: 64,
            interleaved: false,
            inv_freq: ops::rope_inv_freq(1e7, 64),
            head_gap: 256,
        },
        RopeCase {
            name: "dsv4 64x512 rot 64 trailing interleaved, yarn",
            n_tok: 6,
            n_head: 64,
            head_dim: 512,
            n_rot: 64,
            interleaved: true,
            inv_freq: ops::yarn_inv_freq(160000.0, 64, &yarn),
            head_gap: 0,
        },
        RopeCase {
            name: "dsv4 1x512 kv rot 64 trailing, theta 1e4",
            n_tok: 6,
            n_head: 1,
            head_dim: 512,
            n_rot: 64,
            interleaved: true,
            inv_freq: ops::rope_inv_freq(10000.0, 64),
            head_gap: 0,
        },
        RopeCase {
            name: "odd 3x33 rot 32 trailing interleaved",
            n_tok: 6,
            n_head: 3,
            head_dim: 33,
            n_rot: 32,
            interleaved: true,
            inv_freq: ops::rope_inv_freq(10000.0, 32),
            head_gap: 1,
        },
        RopeCase {
            name: "odd 7x7 rot 2 neox",
            n_tok: 6,
            n_head: 7,
            head_dim: 7,
            n_rot: 2,
            interleaved: false,
            inv_freq: ops::rope_inv_freq(10000.0, 2),
            head_gap: 0,
        },
    ];
    let positions: [u32; 6] = [0, 1, 77, 4095, 100_000, 3_000_000];
    for case in &cases {
        let hs = case.head_dim + case.head_gap;
        let ts = case.n_head * hs;
        let off = 3usize;
        // The buffer: guards, then tokens of heads of head_dim (+ gap) elements.
        let lrows = Layout::new(case.n_tok * case.n_head, case.head_dim, off, hs);
        let all = {
            let mut v = rng.vec(lrows.len(), 1.5);
            v[..off].fill(GUARD);
            v
        };
        let x = lrows.gather(&all);
        let table = RopeTable::new(&gpu, &case.inv_freq, "inv_freq").unwrap();
        let pos_all: Vec<u32> = [9u32, 9].iter().chain(&positions).copied().collect();
        let pbuf = gpu
            .upload(bytemuck::cast_slice(&pos_all), "positions")
            .unwrap();
        for inverse in [false, true] {
            for from_buffer in [true, false] {
                if !from_buffer && inverse {
                    continue;
                }
                let (pos, posv): (Positions, Vec<u32>) = if from_buffer {
                    (Positions::Buffer { buf: &pbuf, off: 2 }, positions.to_vec())
                } else {
                    (
                        Positions::From(99_990),
                        (0..case.n_tok as u32).map(|t| 99_990 + t).collect(),
                    )
                };
                let mut want = x.clone();
                let f = if case.interleaved {
                    ops::rope_interleaved
                } else {
                    ops::rope_neox
                };
                f(
                    &mut want,
                    case.n_head,
                    case.head_dim,
                    case.n_rot,
                    &posv,
                    &case.inv_freq,
                    inverse,
                );
                let buf = gpu.upload_f32(&all, "x").unwrap();
                let view = RopeView {
                    buf: &buf,
                    off: off as u32,
                    n_tokens: case.n_tok as u32,
                    n_heads: case.n_head as u32,
                    head_dim: case.head_dim as u32,
                    token_stride: ts as u32,
                    head_stride: hs as u32,
                };
                let full = run(&gpu, &buf, |p| {
                    if case.interleaved {
                        rope::rope_interleaved(p, &view, &table, pos, inverse).unwrap()
                    } else {
                        rope::rope_neox(p, &view, &table, pos, inverse).unwrap()
                    }
                });
                let what = format!("{} inverse {inverse} posbuf {from_buffer}", case.name);
                assert_guards(&what, &lrows, &full, &all);
                assert_close(&what, &lrows.gather(&full), &want, 2e-5, 0.0);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------

/// Row softmax, scaled, out of place and in place, up to a vocab-sized row. Tolerance:
/// 1e-9 abs + 1e-5 relative.
#[test]
fn softmax_matches_cpu() {
    let gpu = gpu();
    let mut rng = Rng(99);
    for &(rows, dim) in &[
        (2, 1),
        (3, 7),
        (2, 33),
        (3, 255),
        (2, 1000),
        (2, 2048),
        (2, 4096),
        (1, 248_320),
    ] {
        let lx = Layout::new(rows, dim, 4, dim + 2);
        let ly = Layout::new(rows, dim, 1, dim);
        let x = rng.vec(rows * dim, 5.0);
        for scale in [1.0f32, 0.0625] {
            let want = ops::softmax(&x, dim, scale);
            let xbuf = gpu.upload_f32(&lx.place(&x), "x").unwrap();
            let before = vec![GUARD; ly.len()];
            let ybuf = gpu.upload_f32(&before, "y").unwrap();
            let full = run(&gpu, &ybuf, |p| {
                softmax::softmax(
                    p,
                    rows as u32,
                    dim as u32,
                    lx.view(&xbuf),
                    Some(ly.view(&ybuf)),
                    scale,
                )
                .unwrap()
            });
            let what = format!("softmax {rows}x{dim} scale {scale}");
            assert_guards(&what, &ly, &full, &before);
            assert_close(&what, &ly.gather(&full), &want, 1e-9, 1e-5);
            let before = lx.place(&x);
            let full = run(&gpu, &xbuf, |p| {
                softmax::softmax(p, rows as u32, dim as u32, lx.view(&xbuf), None, scale).unwrap()
            });
            assert_guards(&what, &lx, &full, &before);
            assert_close(
                &format!("{what} in place"),
                &lx.gather(&full),
                &want,
                1e-9,
                1e-5,
            );
        }
    }
}

// ---------------------------------------------------------------------------------------

const EMBED_TYPES: [DType; 16] = [
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

/// Embedding gather for every stored type, one part and three parts, rows at unaligned byte
/// offsets (e.g. 3 Q8_0 blocks = 102 bytes), an out-of-range id. Tolerance: 1e-6 relative
/// to the row's largest magnitude (the decoders do ggml's f32 operations in ggml's order; only
/// FMA contraction may differ).
#[test]
fn embed_matches_dequantize() {
    let gpu = gpu();
    let mut rng = Rng(2024);
    let n_rows = 37usize;
    let ids: Vec<u32> = vec![0, 36, 5, 5, 17, 1000, 12, 30];
    let idbuf = gpu
        .upload(
            bytemuck::cast_slice(&[[7u32].as_slice(), &ids].concat()),
            "ids",
        )
        .unwrap();
    for dt in EMBED_TYPES {
        let row_len = if dt.block_size() == 256 { 512 } else { 96 };
        let table: Vec<f32> = rng.vec(n_rows * row_len, 1.0);
        let bytes = lathe::quant::quantize(dt, &table).unwrap();
        let shape = [n_rows as u64, row_len as u64];
        let tref = TensorRef {
            name: "token_embd.weight",
            dtype: dt,
            shape: &shape,
            data: &bytes,
            path: Path::new("test.gguf"),
        };
        let valid: Vec<u32> = ids
            .iter()
            .map(|&i| if i as usize >= n_rows { 0 } else { i })
            .collect();
        let mut want = ops::embed(dt, &bytes, row_len, &valid).unwrap();
        for (t, &i) in ids.iter().enumerate() {
            if i as usize >= n_rows {
                want[t * row_len..(t + 1) * row_len].fill(0.0);
            }
        }
        let amax = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Three parts (rows 0..10, 10..11, 11..37) as upload_tensor makes for big tables.
        let row_bytes = dt.bytes_for(row_len as u64).unwrap() as usize;
        let split = GpuTensor {
            name: "token_embd.weight".into(),
            dtype: dt,
            shape: shape.to_vec(),
            parts: [(0usize, 10usize), (10, 1), (11, 26)]
                .iter()
                .map(|&(r0, nr)| TensorPart {
                    buffer: gpu
                        .upload(&bytes[r0 * row_bytes..(r0 + nr) * row_bytes], "part")
                        .unwrap(),
                    row_start: r0 as u64,
                    n_rows: nr as u64,
                })
                .collect(),
        };
        for (name, t) in [
            ("one part", gpu.upload_tensor(&tref).unwrap()),
            ("three parts", split),
        ] {
            let ly = Layout::new(ids.len(), row_len, 3, row_len + 1);
            let before = vec![GUARD; ly.len()];
            let ybuf = gpu.upload_f32(&before, "y").unwrap();
            let full = run(&gpu, &ybuf, |p| {
                embed::embed(p, &t, &idbuf, 1, ids.len() as u32, ly.view(&ybuf)).unwrap()
            });
            let what = format!("embed {dt} {name}");
            assert_guards(&what, &ly, &full, &before);
            assert_close(&what, &ly.gather(&full), &want, 1e-6 * amax, 0.0);
        }
    }
}

// ---------------------------------------------------------------------------------------

/// Top-k values drawn from few levels (many ties), with NaNs and −inf sprinkled in.
fn tie_heavy(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| match rng.u32() % 64 {
            0 => f32::NAN,
            1 => f32::NEG_INFINITY,
            r => (r % 23) as f32 - 11.0 + (rng.u32() % 4) as f32 * 0.25,
        })
        .collect()
}

/// Top-k and argmax: indices and values exact (bit for bit), ties to the lower index,
/// one-chunk rows (up to 4,096), two stages (vocab 248,320; 300,000) and three (1,100,000
/// at k = 16: 269 chunks of 16 candidates).
#[test]
fn topk_matches_cpu() {
    let gpu = gpu();
    let mut rng = Rng(5);
    let sizes: &[(usize, usize)] = &[
        (3, 1),
        (3, 7),
        (2, 8),
        (3, 33),
        (2, 255),
        (4, 256),
        (3, 512),
        (2, 1000),
        (2, 2048),
        (2, 2049),
        (2, 4095),
        (2, 4096),
        (3, 4097),
        (2, 50_000),
        (2, 248_320),
        (1, 300_000),
        (1, 1_100_000),
    ];
    for &(rows, n) in sizes {
        let lx = Layout::new(rows, n, 3, n + 1);
        let x = if n >= 50_000 {
            // Vocab-like logits with ties planted at the top.
            let mut v = rng.vec(rows * n, 2.0);
            for r in 0..rows {
                for j in [n / 2, n / 3, n - 1, 5] {
                    v[r * n + j.min(n - 1)] = 20.0;
                }
                v[r * n + 7] = f32::NAN;
            }
            v
        } else {
            tie_heavy(&mut rng, rows * n)
        };
        let xbuf = gpu.upload_f32(&lx.place(&x), "x").unwrap();
        let scratch = if topk::needs_scratch(n as u32) {
            Some(topk::TopkScratch::new(&gpu, rows as u32, n as u32).unwrap())
        } else {
            None
        };
        for k in [1usize, 4, 8, 16] {
            let li = Layout::new(rows, k, 2, k + 1);
            let lv = Layout::new(rows, k, 1, k);
            let ibuf = gpu.upload_f32(&vec![GUARD; li.len()], "ids").unwrap();
            let vbuf = gpu.upload_f32(&vec![GUARD; lv.len()], "vals").unwrap();
            let mut pass = gpu.pass();
            if k == 1 {
                topk::argmax(
                    &mut pass,
                    rows as u32,
                    n as u32,
                    lx.view(&xbuf),
                    li.view(&ibuf),
                    Some(lv.view(&vbuf)),
                    scratch.as_ref(),
                )
                .unwrap();
            } else {
                let shape = topk::TopkShape {
                    n_rows: rows as u32,
                    n: n as u32,
                    k: k as u32,
                };
                let (xv, iv, vv) = (lx.view(&xbuf), li.view(&ibuf), lv.view(&vbuf));
                topk::topk(&mut pass, shape, xv, iv, Some(vv), scratch.as_ref()).unwrap();
            }
            pass.submit().unwrap();
            let ifull = gpu.read_f32(&ibuf, 0, li.len()).unwrap();
            let vfull = gpu.read_f32(&vbuf, 0, lv.len()).unwrap();
            let what = format!("topk {rows}x{n} k {k}");
            assert_guards(&what, &li, &ifull, &vec![GUARD; li.len()]);
            assert_guards(&what, &lv, &vfull, &vec![GUARD; lv.len()]);
            let got_i: Vec<u32> = li.gather(&ifull).iter().map(|v| v.to_bits()).collect();
            let got_v: Vec<u32> = lv.gather(&vfull).iter().map(|v| v.to_bits()).collect();
            for r in 0..rows {
                let (wi, wv) = ops::topk(&x[r * n..(r + 1) * n], k);
                assert_eq!(
                    &got_i[r * k..(r + 1) * k],
                    &wi[..],
                    "{what} row {r} indices"
                );
                let wv: Vec<u32> = wv.iter().map(|v| v.to_bits()).collect();
                assert_eq!(&got_v[r * k..(r + 1) * k], &wv[..], "{what} row {r} values");
            }
        }
    }
}

#[test]
fn topk_needs_scratch_for_long_rows() {
    let gpu = gpu();
    let x = gpu.buffer(4 * 5000, "x").unwrap();
    let ids = gpu.buffer(64, "ids").unwrap();
    let mut pass = gpu.pass();
    let shape = topk::TopkShape {
        n_rows: 1,
        n: 5000,
        k: 4,
    };
    let (xv, iv) = (Operand::new(&x, 0), Operand::new(&ids, 0));
    let err = topk::topk(&mut pass, shape, xv, iv, None, None).unwrap_err();
    assert!(err.to_string().contains("TopkScratch"), "{err}");
    let shape = topk::TopkShape {
        n_rows: 1,
        n: 50,
        k: 17,
    };
    let (xv, iv) = (Operand::new(&x, 0), Operand::new(&ids, 0));
    let err = topk::topk(&mut pass, shape, xv, iv, None, None).unwrap_err();
    assert!(err.to_string().contains("k = 17"), "{err}");
}

/// Fused MoE router (softmax → top-k → renormalise) against the CPU reference: ids exact,
/// weights 1e-7 abs + 1e-5 relative. Expert counts of Qwen3.5 (256, top-8), DeepSeek-V4 Pro
/// (384, top-6) and odd ones, and rows of logits on a coarse grid (many ties: the lower
/// index must win).
#[test]
fn router_matches_cpu() {
    let gpu = gpu();
    let mut rng = Rng(11);
    let n_tok = 5usize;
    for &(n_exp, k, ties) in &[
        (8usize, 2usize, false),
        (60, 4, false),
        (128, 8, false),
        (256, 8, false),
        (256, 8, true),
        (384, 6, false),
        (512, 10, false),
        (1024, 8, true),
        (1025, 8, true),
        (2048, 16, false),
        (16, 16, false),
    ] {
        let lx = Layout::new(n_tok, n_exp, 1, n_exp + 2);
        let mut logits = rng.vec(n_tok * n_exp, 3.0);
        if ties {
            logits.iter_mut().for_each(|v| *v = (*v * 0.5).round());
        }
        let xbuf = gpu.upload_f32(&lx.place(&logits), "logits").unwrap();
        for renorm in [true, false] {
            let li = Layout::new(n_tok, k, 2, k);
            let lw = Layout::new(n_tok, k, 0, k + 3);
            let ibuf = gpu.upload_f32(&vec![GUARD; li.len()], "ids").unwrap();
            let wbuf = gpu.upload_f32(&vec![GUARD; lw.len()], "w").unwrap();
            let mut pass = gpu.pass();
            let rows = RouterRows {
                n_tok: n_tok as u32,
                n_exp: n_exp as u32,
                k: k as u32,
                logits: lx.view(&xbuf),
                ids: li.view(&ibuf),
                weights: lw.view(&wbuf),
            };
            topk::router_softmax_topk(&mut pass, &rows, renorm).unwrap();
            pass.submit().unwrap();
            let ifull = gpu.read_f32(&ibuf, 0, li.len()).unwrap();
            let wfull = gpu.read_f32(&wbuf, 0, lw.len()).unwrap();
            let what = format!("router {n_exp} experts top-{k} renorm {renorm} ties {ties}");
            assert_guards(&what, &li, &ifull, &vec![GUARD; li.len()]);
            assert_guards(&what, &lw, &wfull, &vec![GUARD; lw.len()]);
            let (wi, ww) = ops::router_softmax_topk(&logits, n_exp, k, renorm);
            let got_i: Vec<u32> = li.gather(&ifull).iter().map(|v| v.to_bits()).collect();
            assert_eq!(got_i, wi, "{what}: ids");
            assert_close(&what, &lw.gather(&wfull), &ww, 1e-7, 1e-5);
        }
    }
}

/// What both fused decode prologues' checks bind beside their q/k/v rows: the RoPE table,
/// three tokens (positions 0, 777, 12345 to cache rows 2, 0, 5), f32 q/k norm weights and 7
/// cache rows' bytes of 0x5a (rows the token does not write must keep them).
struct PrologueRig {
    table: RopeTable,
    pos_b: wgpu::Buffer,
    rows_b: wgpu::Buffer,
    qwt: GpuTensor,
    kwt: GpuTensor,
    kv: lathe::gpu::attention::KvShape,
    cache_bytes: u64,
    fill: Vec<u8>,
}

impl PrologueRig {
    fn new(
        gpu: &Gpu,
        qw: &[f32],
        kw: &[f32],
        inv_freq: &[f32],
        (dtype, n_head_kv, head_dim): (lathe::gpu::attention::KvType, u32, u32),
    ) -> PrologueRig {
        let (pos, rows) = ([0u32, 777, 12345], [2u32, 0, 5]);
        let kv = lathe::gpu::attention::KvShape {
            dtype,
            n_head_kv,
            head_dim,
        };
        let cache_bytes = kv.bytes(7);
        PrologueRig {
            table: RopeTable::new(gpu, inv_freq, "rope").unwrap(),
            pos_b: gpu.upload(bytemuck::cast_slice(&pos), "pos").unwrap(),
            rows_b: gpu.upload(bytemuck::cast_slice(&rows), "rows").unwrap(),
            qwt: weight_tensor(gpu, DType::F32, qw).0,
            kwt: weight_tensor(gpu, DType::F32, kw).0,
            kv,
            cache_bytes,
            fill: vec![0x5au8; cache_bytes as usize],
        }
    }

    /// Two caches of `cache_bytes` bytes of 0x5a (K and V).
    fn caches(&self, gpu: &Gpu) -> (wgpu::Buffer, wgpu::Buffer) {
        let up = |l| gpu.upload(&self.fill, l).unwrap();
        (up("kc"), up("vc"))
    }

    /// The fused prologue's arguments for token `token` of the lists over `buf`: q heads at
    /// `q_off + h · q_stride`, k and v heads packed from `k_off` / `v_off`; eps 1e-6.
    fn qkv<'a>(
        &'a self,
        buf: &'a wgpu::Buffer,
        (n_head, q_off, q_stride): (u32, u32, u32),
        (k_off, v_off): (u32, u32),
        token: u32,
        (k_cache, v_cache): (&'a wgpu::Buffer, &'a wgpu::Buffer),
    ) -> rope::QkvDecode<'a> {
        rope::QkvDecode {
            buf,
            n_head,
            n_head_kv: self.kv.n_head_kv,
            head_dim: self.kv.head_dim,
            q_off,
            q_stride,
            k_off,
            v_off,
            q_norm: &self.qwt.parts[0].buffer,
            k_norm: &self.kwt.parts[0].buffer,
            eps: 1e-6,
            positions: &self.pos_b,
            pos_off: token,
            rows: &self.rows_b,
            row_off: token,
            k_cache,
            v_cache,
            f16: self.kv.dtype == lathe::gpu::attention::KvType::F16,
        }
    }
}

/// Qwen3.5 attention's fused decode prologue (`rope::qk_norm_rope`): bit for bit the per-head
/// RMSNorms, RoPE and KV writes it replaces (each checked against the CPU above), for f16 and
/// f32 caches at the real head size and odd ones; q also against the CPU, and the gates
/// between q heads and the cache rows of other tokens untouched.
#[test]
fn qk_norm_rope_matches_unfused() {
    use lathe::gpu::attention::{self as ga, DstRows, KvType};
    let gpu = gpu();
    let mut rng = Rng(31);
    for (nh, nkv, hd, n_rot) in [(4u32, 1u32, 256u32, 64u32), (4, 2, 16, 4), (3, 1, 40, 8)] {
        for dtype in [KvType::F16, KvType::F32] {
            let (q_off, k_off) = (3u32, 3 + nh * 2 * hd + 5);
            let v_off = k_off + nkv * hd + 2;
            let len = (v_off + nkv * hd + 4) as usize;
            let x: Vec<f32> = (0..len).map(|_| rng.normal() * 2.0).collect();
            let qw: Vec<f32> = (0..hd).map(|_| rng.normal()).collect();
            let kw: Vec<f32> = (0..hd).map(|_| rng.normal()).collect();
            let inv_freq = ops::rope_inv_freq(1e7, n_rot as usize);
            let rig = PrologueRig::new(&gpu, &qw, &kw, &inv_freq, (dtype, nkv, hd));
            // Token 1 of the lists: position 777, cache row 0.
            let fused = {
                let xb = gpu.upload_f32(&x, "x").unwrap();
                let (kc, vc) = rig.caches(&gpu);
                let mut pass = gpu.pass();
                rope::qk_norm_rope(
                    &mut pass,
                    &rig.qkv(&xb, (nh, q_off, 2 * hd), (k_off, v_off), 1, (&kc, &vc)),
                    &rig.table,
                )
                .unwrap();
                pass.submit().unwrap();
                (
                    gpu.read_f32(&xb, 0, len).unwrap(),
                    gpu.read_bytes(&kc, 0, rig.cache_bytes).unwrap(),
                    gpu.read_bytes(&vc, 0, rig.cache_bytes).unwrap(),
                )
            };
            let unfused = {
                let xb = gpu.upload_f32(&x, "x").unwrap();
                let (kc, vc) = rig.caches(&gpu);
                let mut pass = gpu.pass();
                let q = Operand::strided(&xb, q_off, 2 * hd);
                norm::rms_norm(&mut pass, nh, hd, q, None, Some(&rig.qwt), 1e-6).unwrap();
                let k = Operand::new(&xb, k_off);
                norm::rms_norm(&mut pass, nkv, hd, k, None, Some(&rig.kwt), 1e-6).unwrap();
                let at = Positions::Buffer {
                    buf: &rig.pos_b,
                    off: 1,
                };
                let qv = RopeView {
                    buf: &xb,
                    off: q_off,
                    n_tokens: 1,
                    n_heads: nh,
                    head_dim: hd,
                    token_stride: nh * 2 * hd,
                    head_stride: 2 * hd,
                };
                let style = rope::RopeStyle::Neox;
                rope::rope(&mut pass, &qv, style, 0, &rig.table, at, false).unwrap();
                let kv_view = RopeView::packed(&xb, k_off, 1, nkv, hd);
                rope::rope(&mut pass, &kv_view, style, 0, &rig.table, at, false).unwrap();
                let dst = DstRows::List {
                    rows: &rig.rows_b,
                    off: 1,
                };
                ga::write_kv(&mut pass, rig.kv, &xb, k_off, nkv * hd, 1, &kc, dst).unwrap();
                ga::write_kv(&mut pass, rig.kv, &xb, v_off, nkv * hd, 1, &vc, dst).unwrap();
                pass.submit().unwrap();
                (
                    gpu.read_f32(&xb, 0, len).unwrap(),
                    gpu.read_bytes(&kc, 0, rig.cache_bytes).unwrap(),
                    gpu.read_bytes(&vc, 0, rig.cache_bytes).unwrap(),
                )
            };
            let what = format!("qk_norm_rope {nh}x{nkv}x{hd} rot {n_rot} {dtype:?}");
            // q heads (and the gates between them) as the unfused kernels left them; k is
            // not written back by the fused kernel, only to the cache.
            let q_end = (q_off + nh * 2 * hd) as usize;
            let same =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same(&fused.0[..q_end], &unfused.0[..q_end]),
                "{what}: q differs"
            );
            assert!(same(
                &fused.0[q_end..k_off as usize],
                &x[q_end..k_off as usize]
            ));
            assert_eq!(fused.1, unfused.1, "{what}: K cache differs");
            assert_eq!(fused.2, unfused.2, "{what}: V cache differs");
            // q against the CPU.
            let mut want = Vec::new();
            for h in 0..nh as usize {
                let head = &x[q_off as usize + h * 2 * hd as usize..][..hd as usize];
                want.extend(ops::rms_norm(head, hd as usize, Some(&qw), 1e-6));
            }
            ops::rope_neox(
                &mut want,
                nh as usize,
                hd as usize,
                n_rot as usize,
                &[777],
                &inv_freq,
                false,
            );
            let got: Vec<f32> = (0..nh as usize)
                .flat_map(|h| {
                    fused.0[q_off as usize + h * 2 * hd as usize..][..hd as usize].to_vec()
                })
                .collect();
            assert_close(&what, &got, &want, 1e-5, 1e-5);
        }
    }
}

/// Gemma-4's form of the fused decode prologue (`rope::qk_norm_rope_kv`): q, k and v in their
/// own buffers (v also K's buffer: the global blocks without V), v RMSNormed without a weight,
/// the real heads (256 sliding, 512 global with proportional RoPE: zero frequencies past the
/// rotated quarter) and odd ones (40; 300 at views 2 elements in: past a workgroup, not
/// vec4 items), f16 and f32 caches: bit for bit the per-head RMSNorms, RoPE and KV writes it
/// replaces; q also against the CPU.
#[test]
fn qk_norm_rope_kv_matches_unfused() {
    use lathe::gpu::attention::{self as ga, DstRows, KvType};
    let gpu = gpu();
    let mut rng = Rng(37);
    let cases = [
        (4u32, 2u32, 256u32, 256usize, false, 0u32),
        (2, 1, 512, 128, true, 0),
        (3, 1, 40, 8, false, 0),
        (2, 1, 300, 150, true, 2),
    ];
    for (nh, nkv, hd, pairs, v_is_k, off) in cases {
        for dtype in [KvType::F16, KvType::F32] {
            let (h, nhu, nkvu) = (hd as usize, nh as usize, nkv as usize);
            // each buffer: `off` guards, then the heads
            let o = off as usize;
            let q: Vec<f32> = rng.vec(o + nhu * h, 2.0);
            let k: Vec<f32> = rng.vec(o + nkvu * h, 2.0);
            let v: Vec<f32> = rng.vec(o + nkvu * h, 2.0);
            let qw: Vec<f32> = rng.vec(h, 1.0);
            let kw: Vec<f32> = rng.vec(h, 1.0);
            let mut inv_freq = ops::rope_inv_freq(1e6, h);
            inv_freq.iter_mut().skip(pairs).for_each(|f| *f = 0.0);
            let rig = PrologueRig::new(&gpu, &qw, &kw, &inv_freq, (dtype, nkv, hd));
            // Token 2 of the lists: position 12345, cache row 5.
            let fused = {
                let (qb, kb) = (
                    gpu.upload_f32(&q, "q").unwrap(),
                    gpu.upload_f32(&k, "k").unwrap(),
                );
                let vb = gpu.upload_f32(&v, "v").unwrap();
                let (kc, vc) = rig.caches(&gpu);
                let mut pass = gpu.pass();
                rope::qk_norm_rope_kv(
                    &mut pass,
                    &rig.qkv(&qb, (nh, off, hd), (off, off), 2, (&kc, &vc)),
                    &rope::KvHeads {
                        k: &kb,
                        v: if v_is_k { &kb } else { &vb },
                        v_norm: true,
                    },
                    &rig.table,
                )
                .unwrap();
                pass.submit().unwrap();
                (
                    gpu.read_f32(&qb, 0, q.len()).unwrap(),
                    gpu.read_f32(&kb, 0, k.len()).unwrap(),
                    gpu.read_bytes(&kc, 0, rig.cache_bytes).unwrap(),
                    gpu.read_bytes(&vc, 0, rig.cache_bytes).unwrap(),
                )
            };
            let unfused = {
                let (qb, kb) = (
                    gpu.upload_f32(&q, "q").unwrap(),
                    gpu.upload_f32(&k, "k").unwrap(),
                );
                let vb = gpu.upload_f32(if v_is_k { &k } else { &v }, "v").unwrap();
                let (kc, vc) = rig.caches(&gpu);
                let mut pass = gpu.pass();
                let p = &mut pass;
                let (qo, ko, vo) = (
                    Operand::new(&qb, off),
                    Operand::new(&kb, off),
                    Operand::new(&vb, off),
                );
                norm::rms_norm(p, nh, hd, qo, None, Some(&rig.qwt), 1e-6).unwrap();
                norm::rms_norm(p, nkv, hd, ko, None, Some(&rig.kwt), 1e-6).unwrap();
                norm::rms_norm(p, nkv, hd, vo, None, None, 1e-6).unwrap();
                let at = Positions::Buffer {
                    buf: &rig.pos_b,
                    off: 2,
                };
                let style = rope::RopeStyle::Neox;
                let qv = RopeView::packed(&qb, off, 1, nh, hd);
                rope::rope(p, &qv, style, 0, &rig.table, at, false).unwrap();
                let kv_view = RopeView::packed(&kb, off, 1, nkv, hd);
                rope::rope(p, &kv_view, style, 0, &rig.table, at, false).unwrap();
                let dst = DstRows::List {
                    rows: &rig.rows_b,
                    off: 2,
                };
                ga::write_kv(p, rig.kv, &kb, off, nkv * hd, 1, &kc, dst).unwrap();
                ga::write_kv(p, rig.kv, &vb, off, nkv * hd, 1, &vc, dst).unwrap();
                pass.submit().unwrap();
                (
                    gpu.read_f32(&qb, 0, q.len()).unwrap(),
                    gpu.read_bytes(&kc, 0, rig.cache_bytes).unwrap(),
                    gpu.read_bytes(&vc, 0, rig.cache_bytes).unwrap(),
                )
            };
            let what = format!(
                "qk_norm_rope_kv {nh}x{nkv}x{hd} pairs {pairs} v=k {v_is_k} off {off} {dtype:?}"
            );
            let bits = |a: &[f32]| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fused.0), bits(&unfused.0), "{what}: q differs");
            // k is read, never written back
            assert_eq!(bits(&fused.1), bits(&k), "{what}: k changed");
            assert_eq!(fused.2, unfused.1, "{what}: K cache differs");
            assert_eq!(fused.3, unfused.2, "{what}: V cache differs");
            // q against the CPU.
            let mut want: Vec<f32> = (0..nhu)
                .flat_map(|i| ops::rms_norm(&q[o + i * h..][..h], h, Some(&qw), 1e-6))
                .collect();
            ops::rope_neox(&mut want, nhu, h, h, &[12345], &inv_freq, false);
            assert_close(&what, &fused.0[o..], &want, 1e-5, 1e-5);
        }
    }
}

/// Gemma's sandwich norms in one dispatch (`norm::sandwich`): bit for bit the kernels it
/// replaces (`rms_norm` of the branch(es), `add_inplace`, `scale_inplace`, `rms_norm` of the
/// new stream, and with `more` further norms of it: as many as branches) for no branch, one
/// and two (MoE), scaled and not, at odd widths (scalar items,
/// also past a workgroup), Gemma-4's (2816, 5376: vec4 items) and several rows, f32 and bf16
/// weights; and both against the CPU's composition of `ops::rms_norm` and the adds (1e-5
/// abs + 1e-5 relative: a few f32 roundings of O(1) values).
#[test]
fn sandwich_norm_matches_unfused() {
    use norm::{Branch, Sandwich};
    let gpu = gpu();
    let mut rng = Rng(77);
    let eps = 1e-6;
    for (rows, dim) in [
        (3u32, 1u32),
        (2, 7),
        (3, 64),
        (2, 1001),
        (3, 2816),
        (2, 5376),
    ] {
        for branches in 0..3 {
            for (scale, dtype) in [(1.0f32, DType::F32), (0.37, DType::F32), (0.5, DType::BF16)] {
                let (r, d) = (rows as usize, dim as usize);
                let x: Vec<f32> = rng.vec(r * d, 3.0);
                let z: Vec<f32> = rng.vec(r * d, 2.0);
                let z2: Vec<f32> = rng.vec(r * d, 0.5);
                let ws: Vec<(GpuTensor, Vec<f32>)> = (0..6)
                    .map(|_| weight_tensor(&gpu, dtype, &rng.vec(d, 1.0)))
                    .collect();
                let up = |v: &[f32]| gpu.upload_f32(v, "rows").unwrap();
                // (x, y, z, z2, the more norms) after the fused kernel and after the unfused
                // ones
                let outs: Vec<[Vec<f32>; 6]> = [true, false]
                    .into_iter()
                    .map(|fused| {
                        let (xb, yb, zb, z2b) = (up(&x), up(&vec![GUARD; r * d]), up(&z), up(&z2));
                        let (m1, m2) = (up(&vec![GUARD; r * d]), up(&vec![GUARD; r * d]));
                        let more_all = [(&m1, &ws[4].0), (&m2, &ws[5].0)];
                        let more = &more_all[..branches];
                        let branch = match branches {
                            0 => Branch::None,
                            1 => Branch::One {
                                z: &zb,
                                w: &ws[1].0,
                            },
                            _ => Branch::Two {
                                z: &zb,
                                w: &ws[1].0,
                                z2: &z2b,
                                w2: &ws[2].0,
                                wb: &ws[3].0,
                            },
                        };
                        let s = Sandwich {
                            n_rows: rows,
                            dim,
                            eps,
                            x: &xb,
                            branch,
                            scale,
                            y: &yb,
                            wy: &ws[0].0,
                            more,
                        };
                        assert!(s.fits());
                        let mut pass = gpu.pass();
                        let p = &mut pass;
                        if fused {
                            norm::sandwich(p, &s).unwrap();
                        } else {
                            let (xo, yo) = (Operand::new(&xb, 0), Operand::new(&yb, 0));
                            let (zo, z2o) = (Operand::new(&zb, 0), Operand::new(&z2b, 0));
                            if branches == 2 {
                                norm::rms_norm(p, rows, dim, zo, None, Some(&ws[1].0), eps)
                                    .unwrap();
                                norm::rms_norm(p, rows, dim, z2o, None, Some(&ws[2].0), eps)
                                    .unwrap();
                                ew::add_inplace(p, rows, dim, zo, z2o).unwrap();
                                norm::rms_norm(p, rows, dim, zo, Some(yo), Some(&ws[3].0), eps)
                                    .unwrap();
                            } else if branches == 1 {
                                norm::rms_norm(p, rows, dim, zo, Some(yo), Some(&ws[1].0), eps)
                                    .unwrap();
                            }
                            if branches > 0 {
                                ew::add_inplace(p, rows, dim, xo, yo).unwrap();
                            }
                            if scale != 1.0 {
                                ew::scale_inplace(p, rows, dim, xo, scale).unwrap();
                            }
                            norm::rms_norm(p, rows, dim, xo, Some(yo), Some(&ws[0].0), eps)
                                .unwrap();
                            for &(b, w) in more {
                                let bo = Some(Operand::new(b, 0));
                                norm::rms_norm(p, rows, dim, xo, bo, Some(w), eps).unwrap();
                            }
                        }
                        pass.submit().unwrap();
                        let read = |b: &wgpu::Buffer| gpu.read_f32(b, 0, r * d).unwrap();
                        [
                            read(&xb),
                            read(&yb),
                            read(&zb),
                            read(&z2b),
                            read(&m1),
                            read(&m2),
                        ]
                    })
                    .collect();
                let what =
                    format!("sandwich {rows}x{dim} branches {branches} scale {scale} {dtype}");
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&outs[0][0]), bits(&outs[1][0]), "{what}: x differs");
                assert_eq!(bits(&outs[0][1]), bits(&outs[1][1]), "{what}: y differs");
                for (f, u) in outs[0][4..].iter().zip(&outs[1][4..]) {
                    assert_eq!(bits(f), bits(u), "{what}: more differs");
                }
                // the fused kernel leaves its branches alone
                assert_eq!(bits(&outs[0][2]), bits(&z), "{what}: z changed");
                assert_eq!(bits(&outs[0][3]), bits(&z2), "{what}: z2 changed");
                // against the CPU
                let w = |i: usize| &ws[i].1[..];
                let (mut want_x, mut want_y) = (Vec::new(), Vec::new());
                let mut want_more = [Vec::new(), Vec::new()];
                for row in 0..r {
                    let at = |v: &[f32]| v[row * d..][..d].to_vec();
                    let b: Vec<f32> = match branches {
                        0 => vec![0.0; d],
                        1 => ops::rms_norm(&at(&z), d, Some(w(1)), eps),
                        _ => {
                            let a = ops::rms_norm(&at(&z), d, Some(w(1)), eps);
                            let c = ops::rms_norm(&at(&z2), d, Some(w(2)), eps);
                            let s: Vec<f32> = a.iter().zip(&c).map(|(a, c)| a + c).collect();
                            ops::rms_norm(&s, d, Some(w(3)), eps)
                        }
                    };
                    let xr: Vec<f32> = at(&x)
                        .iter()
                        .zip(&b)
                        .map(|(x, b)| (x + b) * scale)
                        .collect();
                    want_y.extend(ops::rms_norm(&xr, d, Some(w(0)), eps));
                    for (m, want) in want_more.iter_mut().enumerate().take(branches) {
                        want.extend(ops::rms_norm(&xr, d, Some(w(4 + m)), eps));
                    }
                    want_x.extend(xr);
                }
                assert_close(&what, &outs[0][0], &want_x, 1e-5, 1e-5);
                assert_close(&what, &outs[0][1], &want_y, 1e-5, 1e-5);
                for m in 0..branches {
                    assert_close(&what, &outs[0][4 + m], &want_more[m], 1e-5, 1e-5);
                }
            }
        }
    }
}
