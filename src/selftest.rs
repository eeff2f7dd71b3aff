//! `lathe selftest`: the product kernels against their CPU reference on whatever adapter lathe
//! finds, for users with an unusual GPU or driver and for kernels that CI's lavapipe cannot run
//! (the cooperative-matrix path).
//!
//! Each check makes a weight by quantizing random normals (`quant::quantize`), uploads it, runs
//! one kernel path and compares every output (a sample of them for the real sizes of `--full`)
//! with `Σ_c deq(w)_rc x_c` in f64 from the dequantized weights (`quant::dequantize_to_vec`).
//! Outputs land between guard elements that must keep their sentinel.
//!
//! Bounds, per output with `a = Σ_c |w_rc x_c|`:
//! - f32 paths (matvec, tiled, and the matrix path for F16/BF16 weights with split
//!   activations): `1e-4 · (1 + a)`, f32 rounding of products and partial sums;
//! - the matrix path otherwise: `1e-4 · (1 + a) + 2^-10 · a` (each weight and each activation
//!   rounds to f16 once: at most 2^-11 relative each), and a relative RMS error over all
//!   outputs ≤ 1e-3, which random rounding meets with a wide margin while a layout error
//!   cannot.

use crate::dtype::DType;
use crate::gpu::matmul::{self, MoeRoute};
use crate::gpu::matvec::{self, MatvecOpts};
use crate::gpu::{coopmat, Gpu, GpuTensor};
use crate::tensor::TensorRef;
use crate::{quant, Result};
use std::path::Path;

/// Every stored type the product kernels read.
pub const TYPES: [DType; 17] = [
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
    DType::F8_E4M3_B128,
];

const SENTINEL: f32 = -12345.0;
const GUARD: usize = 5;
/// Outputs compared per check at real sizes (all of them below this count).
const SAMPLE: usize = 4096;

/// The kernel path one check runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelPath {
    /// One-token (and few-token) matvec.
    Matvec,
    /// The tiled f32 matmul.
    Tiled,
    /// Cooperative matrices.
    Coop,
    /// Cooperative matrices with split operands (f32-level: checked at the f32 bound).
    CoopSplit,
    /// The tiled kernel with int8 activations (the types with integer codes; checked at the
    /// quantization bound of x).
    Int8,
    /// The same with two int8 levels of x.
    Int8x2,
}

impl KernelPath {
    pub fn name(self) -> &'static str {
        match self {
            KernelPath::Matvec => "matvec",
            KernelPath::Tiled => "tiled",
            KernelPath::Coop => "coop",
            KernelPath::CoopSplit => "coop-split",
            KernelPath::Int8 => "int8",
            KernelPath::Int8x2 => "int8x2",
        }
    }

    fn int8_levels(self) -> Option<matmul::Int8Levels> {
        match self {
            KernelPath::Int8 => Some(matmul::Int8Levels::One),
            KernelPath::Int8x2 => Some(matmul::Int8Levels::Two),
            _ => None,
        }
    }

    fn precision(self) -> Option<coopmat::Precision> {
        match self {
            KernelPath::Coop => Some(coopmat::Precision::F16),
            KernelPath::CoopSplit => Some(coopmat::Precision::Split),
            _ => None,
        }
    }
}

/// One check's outcome.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Check {
    pub name: String,
    pub passed: bool,
    /// Largest error over its bound (≤ 1 passes).
    pub worst: f64,
    /// Relative RMS error over all compared outputs.
    pub rel_rms: f64,
    /// What failed, if anything.
    pub detail: String,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Box-Muller normals times `scale`.
    fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u = self.uniform().max(1e-300);
                let v = self.uniform();
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32 * scale
            })
            .collect()
    }
}

/// A quantized random weight with its dequantized values.
struct Weight {
    dtype: DType,
    shape: Vec<u64>,
    bytes: Vec<u8>,
    deq: Vec<f32>,
}

impl Weight {
    fn random(dtype: DType, shape: &[u64], seed: u64) -> Result<Weight> {
        let n: u64 = shape.iter().product();
        let cols = *shape.last().unwrap_or(&1) as usize;
        let mut x = Rng(seed).normals(n as usize, 1.0);
        // rows of different ranges, some with an offset the min-carrying types must keep
        for (r, row) in x.chunks_mut(cols).enumerate() {
            let s = 0.02 * (1.0 + (r % 5) as f32);
            let off = if r % 3 == 1 { 0.5 * s } else { 0.0 };
            row.iter_mut().for_each(|v| *v = *v * s + off);
        }
        let bytes = quant::quantize(dtype, &x)?;
        let deq = quant::dequantize_to_vec(dtype, &bytes, n as usize)?;
        Ok(Weight {
            dtype,
            shape: shape.to_vec(),
            bytes,
            deq,
        })
    }

    fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1) as usize
    }

    fn upload(&self, gpu: &Gpu) -> Result<GpuTensor> {
        gpu.upload_tensor(&TensorRef {
            name: "selftest.w",
            dtype: self.dtype,
            shape: &self.shape,
            data: &self.bytes,
            path: Path::new("selftest"),
        })
    }

    /// (Σ w x, Σ |w x|) of flattened row `r`, in f64.
    fn dot(&self, r: usize, x: &[f32]) -> (f64, f64) {
        let c = self.cols();
        self.deq[r * c..(r + 1) * c]
            .iter()
            .zip(x)
            .fold((0.0, 0.0), |(s, a), (&w, &x)| {
                let p = w as f64 * x as f64;
                (s + p, a + p.abs())
            })
    }
}

/// Columns per type: odd for the float types (unaligned rows, partial virtual blocks), whole
/// blocks otherwise, not a multiple of 64 where the block allows.
pub fn odd_cols(dt: DType) -> u64 {
    match dt {
        DType::F32 | DType::F16 | DType::BF16 => 161,
        _ if dt.block_size() == 256 => 768,
        DType::F8_E4M3_B128 => 384,
        _ => 160,
    }
}

/// Compares `got` (guards included) with `want` (`None`: must stay the sentinel) at `idx`.
fn compare(
    name: String,
    got: &[f32],
    want: &[(usize, Option<(f64, f64)>)],
    n_out: usize,
    f16_inputs: bool,
) -> Check {
    compare_with(name, got, want, n_out, f16_inputs, |_, a| {
        1e-4 * (1.0 + a) + if f16_inputs { a / 1024.0 } else { 0.0 }
    })
}

/// [`compare`] with the bound of output `i` (of `a = Σ|w x|`) given by `bound`.
fn compare_with(
    name: String,
    got: &[f32],
    want: &[(usize, Option<(f64, f64)>)],
    n_out: usize,
    f16_inputs: bool,
    bound: impl Fn(usize, f64) -> f64,
) -> Check {
    let mut worst = 0f64;
    let mut detail = String::new();
    let (mut e2, mut v2) = (0f64, 0f64);
    for i in (0..GUARD).chain(GUARD + n_out..2 * GUARD + n_out) {
        if got[i] != SENTINEL {
            detail = format!("guard element {i} was written");
        }
    }
    for &(i, w) in want {
        let g = got[GUARD + i] as f64;
        match w {
            None => {
                if g != SENTINEL as f64 && detail.is_empty() {
                    detail = format!("output {i} should be untouched, is {g}");
                }
            }
            Some((v, a)) => {
                let err = (g - v).abs();
                let bound = bound(i, a);
                e2 += err * err;
                v2 += v * v;
                let ratio = if err.is_nan() {
                    f64::INFINITY
                } else {
                    err / bound
                };
                if ratio > worst {
                    worst = ratio;
                    if ratio > 1.0 {
                        detail =
                            format!("output {i} = {g}, want {v} (error {err:.3e} > {bound:.3e})");
                    }
                }
            }
        }
    }
    let rel_rms = (e2 / v2.max(1e-300)).sqrt();
    if f16_inputs && rel_rms > 1e-3 && detail.is_empty() {
        detail = format!("relative RMS error {rel_rms:.3e} > 1e-3");
    }
    Check {
        name,
        passed: detail.is_empty(),
        worst,
        rel_rms,
        detail,
    }
}

/// Which outputs of `n` to compare: all, or an even sample at real sizes.
fn picks(n: usize) -> Vec<usize> {
    if n <= SAMPLE {
        (0..n).collect()
    } else {
        (0..SAMPLE)
            .map(|k| k * n / SAMPLE + (k % 7))
            .filter(|&i| i < n)
            .collect()
    }
}

fn out_buffer(gpu: &Gpu, n: usize) -> Result<wgpu::Buffer> {
    gpu.upload_f32(&vec![SENTINEL; n + 2 * GUARD], "selftest.y")
}

/// A dense product `Y = X Wᵀ` on `path` (accumulating into Y = 0.5 when `acc`).
fn dense(
    gpu: &Gpu,
    path: KernelPath,
    dt: DType,
    (rows, cols, nt): (u64, u64, usize),
    acc: bool,
    seed: u64,
) -> Result<Check> {
    let w = Weight::random(dt, &[rows, cols], seed)?;
    let (r, c) = (rows as usize, cols as usize);
    let x = Rng(seed ^ 0x5eed).normals(nt * c, 1.0);
    let wt = w.upload(gpu)?;
    let xb = gpu.upload_f32(&x, "selftest.x")?;
    let n_out = nt * r;
    let init = if acc { 0.5 } else { SENTINEL };
    let mut y0 = vec![SENTINEL; n_out + 2 * GUARD];
    y0[GUARD..GUARD + n_out].fill(init);
    let yb = if acc {
        gpu.upload_f32(&y0, "selftest.y")?
    } else {
        out_buffer(gpu, n_out)?
    };
    let opts = MatvecOpts {
        accumulate: acc,
        ..Default::default()
    };
    let mut pass = gpu.pass();
    let (y_off, n) = (GUARD as u32, nt as u32);
    match path {
        KernelPath::Matvec => matvec::matvec_opts(&mut pass, &wt, &xb, 0, &yb, y_off, n, &opts)?,
        KernelPath::Tiled => matmul::matmul_tiled(&mut pass, &wt, &xb, 0, &yb, y_off, n, &opts)?,
        KernelPath::Int8 | KernelPath::Int8x2 => {
            let levels = path.int8_levels().expect("int8 path");
            matmul::matmul_int8(&mut pass, levels, &wt, &xb, 0, &yb, y_off, n, &opts)?
        }
        KernelPath::Coop | KernelPath::CoopSplit => {
            let prec = path.precision().expect("coop path");
            coopmat::matmul_coop(&mut pass, prec, &wt, &xb, 0, &yb, y_off, n, &opts)?
        }
    }
    pass.submit()?;
    let got = gpu.read_f32(&yb, 0, n_out + 2 * GUARD)?;
    let base = if acc { 0.5 } else { 0.0 };
    let want: Vec<_> = picks(n_out)
        .into_iter()
        .map(|i| {
            let (v, a) = w.dot(i % r, &x[(i / r) * c..][..c]);
            (i, Some((v + base, a)))
        })
        .collect();
    let name = format!(
        "{} {dt} {rows}x{cols} tokens {nt}{}",
        path.name(),
        if acc { " accumulate" } else { "" }
    );
    if let Some(levels) = path.int8_levels() {
        // x̂ is within d/2 of x per element (d of the last level): the product moves by at
        // most Σ_blocks d/2 · Σ|w| (the GPU's own rounding of ties or of 1/d stays inside it)
        let q = match levels {
            matmul::Int8Levels::One => crate::cpu::q8x::quantize_x(&x, c),
            matmul::Int8Levels::Two => crate::cpu::q8x::quantize_x2(&x, c).1,
        };
        return Ok(compare_with(name, &got, &want, n_out, false, |i, a| {
            let (t, row) = (i / r, i % r);
            q.error_bound(t, &w.deq[row * c..][..c]) * 1.01 + 1e-4 * (1.0 + a)
        }));
    }
    let f16 = path == KernelPath::Coop && !matches!(dt, DType::F16 | DType::BF16);
    Ok(compare(name, &got, &want, n_out, f16))
}

/// The token-group matvec (`matvec::matvec_multi`, int8 x with `int8`) against the one-token
/// kernel run on each token alone: every output must have the same bits (what speculative
/// decoding's verify step and batched decode rely on); then, for f32 x, against the CPU
/// reference at the f32 bound.
fn multi(
    gpu: &Gpu,
    dt: DType,
    (rows, cols, nt): (u64, u64, usize),
    int8: bool,
    seed: u64,
) -> Result<Check> {
    let w = Weight::random(dt, &[rows, cols], seed)?;
    let (r, c) = (rows as usize, cols as usize);
    let x = Rng(seed ^ 0x5eed).normals(nt * c, 1.0);
    let wt = w.upload(gpu)?;
    let xb = gpu.upload_f32(&x, "selftest.x")?;
    let n_out = nt * r;
    let (ym, yl) = (out_buffer(gpu, n_out)?, out_buffer(gpu, n_out)?);
    let opts = MatvecOpts {
        int8_x: int8,
        ..Default::default()
    };
    let mut pass = gpu.pass();
    let g = GUARD as u32;
    matvec::matvec_multi(&mut pass, &wt, &xb, 0, &ym, g, nt as u32, &opts)?;
    for t in 0..nt as u32 {
        let (xo, yo) = (t * cols as u32, g + t * rows as u32);
        matvec::matvec_opts(&mut pass, &wt, &xb, xo, &yl, yo, 1, &opts)?;
    }
    pass.submit()?;
    let got = gpu.read_f32(&ym, 0, n_out + 2 * GUARD)?;
    let lone = gpu.read_f32(&yl, 0, n_out + 2 * GUARD)?;
    let name = format!(
        "multi {dt} {rows}x{cols} tokens {nt}{} bits of lone matvec",
        if int8 { " int8-x" } else { "" }
    );
    let differ = got
        .iter()
        .zip(&lone)
        .position(|(a, b)| a.to_bits() != b.to_bits());
    let want: Vec<_> = picks(n_out)
        .into_iter()
        .map(|i| (i, Some(w.dot(i % r, &x[(i / r) * c..][..c]))))
        .collect();
    let mut check = compare(name, &got, &want, n_out, false);
    if int8 {
        // x's int8 rounding is outside the f32 bound: the bits of the one-token kernel decide
        (check.worst, check.rel_rms, check.detail) = (0.0, 0.0, String::new());
    }
    if let Some(i) = differ {
        check.detail = format!(
            "element {i} = {} differs from the lone token's {}",
            got[i], lone[i]
        );
    }
    check.passed = check.detail.is_empty();
    Ok(check)
}

/// [`multi`] through the fused RMSNorm prologue (`matvec::matvec_pro`, as the models' batched
/// and verify steps run it): bits of the same call per token alone, and the CPU reference of
/// the normed product (x · rsqrt(mean x² + eps) · w in f64) at the f32 bound.
fn multi_norm(
    gpu: &Gpu,
    dt: DType,
    (rows, cols, nt): (u64, u64, usize),
    seed: u64,
) -> Result<Check> {
    let w = Weight::random(dt, &[rows, cols], seed)?;
    let (r, c) = (rows as usize, cols as usize);
    let mut rng = Rng(seed ^ 0x5eed);
    let x = rng.normals(nt * c, 1.0);
    let nw = rng.normals(c, 1.0);
    let wt = w.upload(gpu)?;
    let xb = gpu.upload_f32(&x, "selftest.x")?;
    let nwb = gpu.upload_f32(&nw, "selftest.norm")?;
    let n_out = nt * r;
    let (ym, yl) = (out_buffer(gpu, n_out)?, out_buffer(gpu, n_out)?);
    let eps = 1e-6f32;
    let pro = matvec::Prologue::RmsNorm {
        w: &nwb,
        eps,
        keep: None,
    };
    let opts = MatvecOpts::default();
    let mut pass = gpu.pass();
    let g = GUARD as u32;
    matvec::matvec_pro(&mut pass, &wt, &xb, 0, &ym, g, nt as u32, &opts, &pro)?;
    for t in 0..nt as u32 {
        let (xo, yo) = (t * cols as u32, g + t * rows as u32);
        matvec::matvec_pro(&mut pass, &wt, &xb, xo, &yl, yo, 1, &opts, &pro)?;
    }
    pass.submit()?;
    let got = gpu.read_f32(&ym, 0, n_out + 2 * GUARD)?;
    let lone = gpu.read_f32(&yl, 0, n_out + 2 * GUARD)?;
    let normed: Vec<f32> = x
        .chunks(c)
        .flat_map(|row| {
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / c as f64;
            let rs = 1.0 / (ms + eps as f64).sqrt();
            row.iter()
                .zip(&nw)
                .map(move |(&v, &k)| (v as f64 * rs * k as f64) as f32)
        })
        .collect();
    let want: Vec<_> = picks(n_out)
        .into_iter()
        .map(|i| (i, Some(w.dot(i % r, &normed[(i / r) * c..][..c]))))
        .collect();
    let name = format!("multi {dt} {rows}x{cols} tokens {nt} rmsnorm bits of lone matvec");
    let mut check = compare(name, &got, &want, n_out, false);
    if let Some(i) = got
        .iter()
        .zip(&lone)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        check.detail = format!(
            "element {i} = {} differs from the lone token's {}",
            got[i], lone[i]
        );
        check.passed = false;
    }
    Ok(check)
}

/// A MoE product over a route: 6 experts of 45 rows, 3 slots per token, one invalid id.
fn indexed(
    gpu: &Gpu,
    path: KernelPath,
    dt: DType,
    nt: usize,
    per_pair: bool,
    seed: u64,
) -> Result<Check> {
    let (ne, rows, n_used) = (6usize, 45usize, 3usize);
    let cols = odd_cols(dt) as usize;
    let w = Weight::random(dt, &[ne as u64, rows as u64, cols as u64], seed)?;
    let mut rng = Rng(seed ^ 3);
    let np = nt * n_used;
    let mut ids = Vec::with_capacity(np);
    for t in 0..nt {
        let first = (rng.uniform() * ne as f64) as usize;
        for s in 0..n_used {
            ids.push(((first + 2 * s) % ne) as u32);
        }
        if t == 1 {
            ids[t * n_used + 1] = 99;
        }
    }
    let wt = w.upload(gpu)?;
    let idb = gpu.upload(bytemuck::cast_slice(&ids), "selftest.ids")?;
    let xr = if per_pair { np } else { nt };
    let x = rng.normals(xr * cols, 1.0);
    let xb = gpu.upload_f32(&x, "selftest.x")?;
    let n_out = np * rows;
    let yb = out_buffer(gpu, n_out)?;
    let opts = MatvecOpts::default();
    let mut pass = gpu.pass();
    let (y_off, n, k) = (GUARD as u32, nt as u32, n_used as u32);
    match path {
        KernelPath::Matvec => matvec::matvec_indexed(
            &mut pass, &wt, &xb, 0, per_pair, &idb, 0, k, &yb, y_off, n, &opts,
        )?,
        KernelPath::Tiled
        | KernelPath::Coop
        | KernelPath::CoopSplit
        | KernelPath::Int8
        | KernelPath::Int8x2 => {
            let route = MoeRoute::new(gpu, ne as u32, np as u32)?;
            matmul::route(&mut pass, &route, &idb, 0, n, k)?;
            if let Some(levels) = path.int8_levels() {
                matmul::matmul_int8_indexed(
                    &mut pass, levels, &wt, &xb, 0, per_pair, &route, n, k, &yb, y_off, &opts,
                )?;
            } else if let Some(prec) = path.precision() {
                coopmat::matmul_coop_indexed(
                    &mut pass, prec, &wt, &xb, 0, per_pair, &route, n, k, &yb, y_off, &opts,
                )?;
            } else {
                matmul::matmul_indexed_tiled(
                    &mut pass, &wt, &xb, 0, per_pair, &route, n, k, &yb, y_off, &opts,
                )?;
            }
        }
    }
    pass.submit()?;
    let got = gpu.read_f32(&yb, 0, n_out + 2 * GUARD)?;
    let want: Vec<_> = (0..n_out)
        .map(|i| {
            let (q, r) = (i / rows, i % rows);
            let e = ids[q] as usize;
            if e >= ne {
                return (i, None);
            }
            let xq = if per_pair { q } else { q / n_used };
            (i, Some(w.dot(e * rows + r, &x[xq * cols..][..cols])))
        })
        .collect();
    let name = format!(
        "{} indexed {dt} {ne}x{rows}x{cols} tokens {nt} x per {}",
        path.name(),
        if per_pair { "pair" } else { "token" }
    );
    if let Some(levels) = path.int8_levels() {
        // as `dense`: within the quantization bound of x's last level
        let q = match levels {
            matmul::Int8Levels::One => crate::cpu::q8x::quantize_x(&x, cols),
            matmul::Int8Levels::Two => crate::cpu::q8x::quantize_x2(&x, cols).1,
        };
        return Ok(compare_with(name, &got, &want, n_out, false, |i, a| {
            let (pq, r) = (i / rows, i % rows);
            let xq = if per_pair { pq } else { pq / n_used };
            let e = ids[pq] as usize;
            q.error_bound(xq, &w.deq[(e * rows + r) * cols..][..cols]) * 1.01 + 1e-4 * (1.0 + a)
        }));
    }
    let f16 = path == KernelPath::Coop && !matches!(dt, DType::F16 | DType::BF16);
    Ok(compare(name, &got, &want, n_out, f16))
}

/// Real decode and prefill shapes of the released models (rows, cols).
const REAL: [(u64, u64); 3] = [(12288, 4096), (4096, 12288), (2048, 7168)];
const REAL_TYPES: [DType; 8] = [
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::Q8_0,
    DType::MXFP4,
    DType::F8_E4M3_B128,
    DType::BF16,
    DType::F16,
];

/// Every check for `gpu` in order: paths the device runs × stored types × shapes (`full`: the
/// real sizes too). `each` sees every check as it finishes.
pub fn run(gpu: &Gpu, full: bool, mut each: impl FnMut(&Check)) -> Vec<Check> {
    let mut paths = vec![KernelPath::Tiled, KernelPath::Int8, KernelPath::Int8x2];
    if gpu.matmul_path().is_coop() {
        paths.push(KernelPath::Coop);
        paths.push(KernelPath::CoopSplit);
    }
    // the int8 path only for the types with integer codes, and no MoE form
    let runs = |p: KernelPath, dt: DType| {
        !(p.precision().is_some() && dt == DType::F32)
            && (p.int8_levels().is_none() || matmul::int8_supported(dt))
    };
    let mut out = Vec::new();
    let mut push = |name: &str, r: Result<Check>| {
        let c = r.unwrap_or_else(|e| Check {
            name: name.to_string(),
            passed: false,
            worst: f64::INFINITY,
            rel_rms: f64::INFINITY,
            detail: format!("error: {e}"),
        });
        each(&c);
        out.push(c);
    };
    for (i, dt) in TYPES.into_iter().enumerate() {
        let cols = odd_cols(dt);
        let seed = 100 + i as u64;
        push(
            &format!("matvec {dt}"),
            dense(gpu, KernelPath::Matvec, dt, (33, cols, 3), false, seed),
        );
        // groups of 5 and 4 tokens
        push(
            &format!("multi {dt}"),
            multi(gpu, dt, (33, cols, 9), false, seed),
        );
        if matches!(dt, DType::Q4_K | DType::F16 | DType::Q8_0) {
            push(
                &format!("multi {dt} rmsnorm"),
                multi_norm(gpu, dt, (33, cols, 5), seed),
            );
        }
        if matvec::int8_x_supported(dt) {
            push(
                &format!("multi {dt} int8-x"),
                multi(gpu, dt, (33, cols, 13), true, seed),
            );
        }
        for &p in &paths {
            if !runs(p, dt) {
                continue;
            }
            push(
                &format!("{} {dt}", p.name()),
                dense(gpu, p, dt, (150, cols, 67), false, seed),
            );
        }
    }
    for (i, dt) in [
        DType::Q4_K,
        DType::MXFP4,
        DType::Q8_0,
        DType::BF16,
        DType::Q5_0,
        DType::F8_E4M3_B128,
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 200 + i as u64;
        push(
            &format!("matvec indexed {dt}"),
            indexed(gpu, KernelPath::Matvec, dt, 2, i % 2 == 1, seed),
        );
        for &p in paths.iter().filter(|&&p| runs(p, dt)) {
            push(
                &format!("{} indexed {dt}", p.name()),
                indexed(gpu, p, dt, 70, i % 2 == 1, seed),
            );
            // few pairs per expert: thin tiles
            push(
                &format!("{} indexed {dt} few pairs", p.name()),
                indexed(gpu, p, dt, 40, i % 2 == 0, seed + 50),
            );
        }
    }
    // many row and token tiles (the last ones partial)
    for &p in &paths {
        for dt in [DType::Q4_K, DType::F16, DType::Q8_0] {
            if !runs(p, dt) {
                continue;
            }
            push(
                &format!("{} {dt} many tiles", p.name()),
                dense(gpu, p, dt, (12288, odd_cols(dt), 300), false, 310),
            );
        }
    }
    for &p in &paths {
        for dt in [DType::Q6_K, DType::F16] {
            if !runs(p, dt) {
                continue;
            }
            push(
                &format!("{} {dt} accumulate", p.name()),
                dense(gpu, p, dt, (129, odd_cols(dt), 300), true, 300),
            );
        }
    }
    if full {
        for (i, dt) in REAL_TYPES.into_iter().enumerate() {
            for (k, &(rows, cols)) in REAL.iter().enumerate() {
                if dt.block_size() > 0 && cols % dt.block_size() as u64 != 0 {
                    continue;
                }
                let seed = 400 + (i * 10 + k) as u64;
                push(
                    &format!("matvec {dt} {rows}x{cols}"),
                    dense(gpu, KernelPath::Matvec, dt, (rows, cols, 1), false, seed),
                );
                push(
                    &format!("multi {dt} {rows}x{cols}"),
                    multi(gpu, dt, (rows, cols, 8), false, seed),
                );
                for &p in paths.iter().filter(|&&p| runs(p, dt)) {
                    push(
                        &format!("{} {dt} {rows}x{cols}", p.name()),
                        dense(gpu, p, dt, (rows, cols, 512), false, seed),
                    );
                }
            }
        }
    }
    out
}
