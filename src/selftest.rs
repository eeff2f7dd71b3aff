//! `lathe selftest`: the product kernels against their CPU reference on whatever adapter lathe
//! finds, for users with an unusual GPU or driver and for kernels that CI's lavapipe cannot run
//! (the cooperative-matrix path).
//!
//! Each check makes a weight by quantizing random normals (`quant::quantize`), uploads it, runs
//! one kernel path and compares every output (a sample of them for the real sizes of `--full`)
//! with `Σ_c deq(w)_rc x_c` in f64 from the dequantized weights (`quant::dequantize_to_vec`).
//! Outputs land between guard elements that must keep their sentinel.
//!
//! The fused decode kernels are checked the same way against a CPU reference of the steps they
//! fuse (`cpu::ops`, `cpu::gdn`): the matvec prologues (RMSNorm, SwiGLU, the sigmoid gates),
//! the GDN conv step in the qkv product's store, `qk_norm_rope`, the residual add + RMSNorm
//! at the model widths, the GDN step with its gated norm, and the int8-activation matvec (two levels, against the product of the
//! dequantized weights with x quantized by `cpu::q8x::quantize_x2`, the kernel's own rounding
//! of x, so the f32 bound applies); see [`fused`].
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
use crate::gpu::operand::Operand;
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
    /// Cooperative matrices with f16 weights and split activations (checked at the f16 bound).
    CoopSplitX,
    /// `--matmul coop-xsplit`: [`KernelPath::CoopSplit`] with dense products of split weights
    /// on the tile that stages them and x in workgroup memory, at the f32 bound (its MoE
    /// products are coop-split's, checked as those).
    CoopXSplit,
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
            KernelPath::CoopSplitX => "coop-splitx",
            KernelPath::CoopXSplit => "coop-xsplit",
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
            KernelPath::CoopXSplit => Some(coopmat::Precision::XSplit),
            KernelPath::CoopSplitX => Some(coopmat::Precision::SplitX),
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
        KernelPath::Matvec => matvec::matvec_opts(
            &mut pass,
            &wt,
            Operand::new(&xb, 0),
            Operand::new(&yb, y_off),
            n,
            &opts,
        )?,
        KernelPath::Tiled => matmul::matmul_tiled(
            &mut pass,
            &wt,
            Operand::new(&xb, 0),
            Operand::new(&yb, y_off),
            n,
            &opts,
        )?,
        KernelPath::Int8 | KernelPath::Int8x2 => {
            let levels = path.int8_levels().expect("int8 path");
            matmul::matmul_int8(
                &mut pass,
                levels,
                &wt,
                Operand::new(&xb, 0),
                Operand::new(&yb, y_off),
                n,
                &opts,
            )?
        }
        KernelPath::Coop
        | KernelPath::CoopSplit
        | KernelPath::CoopSplitX
        | KernelPath::CoopXSplit => {
            let prec = path.precision().expect("coop path");
            coopmat::matmul_coop(
                &mut pass,
                prec,
                &wt,
                Operand::new(&xb, 0),
                Operand::new(&yb, y_off),
                n,
                &opts,
            )?
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
        let q = last_level(levels, &x, c);
        return Ok(compare_with(name, &got, &want, n_out, false, |i, a| {
            let (t, row) = (i / r, i % r);
            q.error_bound(t, &w.deq[row * c..][..c]) * 1.01 + 1e-4 * (1.0 + a)
        }));
    }
    let f16 = matches!(path, KernelPath::Coop | KernelPath::CoopSplitX)
        && !matches!(dt, DType::F16 | DType::BF16);
    Ok(compare(name, &got, &want, n_out, f16))
}

/// The CPU reference of x quantized in `levels`, as its last level (whose rounding bounds x̂'s
/// error).
fn last_level(levels: matmul::Int8Levels, x: &[f32], cols: usize) -> crate::cpu::q8x::QuantizedX {
    match levels {
        matmul::Int8Levels::One => crate::cpu::q8x::quantize_x(x, cols),
        matmul::Int8Levels::Two => crate::cpu::q8x::quantize_x2(x, cols).1,
    }
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
    matvec::matvec_multi(
        &mut pass,
        &wt,
        Operand::new(&xb, 0),
        Operand::new(&ym, g),
        nt as u32,
        &opts,
    )?;
    for t in 0..nt as u32 {
        let (xo, yo) = (t * cols as u32, g + t * rows as u32);
        matvec::matvec_opts(
            &mut pass,
            &wt,
            Operand::new(&xb, xo),
            Operand::new(&yl, yo),
            1,
            &opts,
        )?;
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
    matvec::matvec_pro(
        &mut pass,
        &wt,
        Operand::new(&xb, 0),
        Operand::new(&ym, g),
        nt as u32,
        &opts,
        &pro,
    )?;
    for t in 0..nt as u32 {
        let (xo, yo) = (t * cols as u32, g + t * rows as u32);
        matvec::matvec_pro(
            &mut pass,
            &wt,
            Operand::new(&xb, xo),
            Operand::new(&yl, yo),
            1,
            &opts,
            &pro,
        )?;
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

/// Experts and slots per token of the MoE checks ([`indexed`]).
const IDX_EXPERTS: usize = 6;
const IDX_USED: usize = 3;
/// Tokens of the few-pairs MoE checks: 10 pairs per expert on average, under
/// `coopmat::THIN_PAIRS`, so the matrix paths run their thin tiles (an expert picked by more
/// tokens than a thin tile's 16 takes two of them).
const FEW_PAIRS_TOKENS: usize = 20;
const _: () = assert!(FEW_PAIRS_TOKENS * IDX_USED < coopmat::THIN_PAIRS as usize * IDX_EXPERTS);

/// A MoE product over a route: 6 experts of 45 rows, 3 slots per token, one invalid id.
fn indexed(
    gpu: &Gpu,
    path: KernelPath,
    dt: DType,
    nt: usize,
    per_pair: bool,
    int8: bool,
    seed: u64,
) -> Result<Check> {
    let (ne, rows, n_used) = (IDX_EXPERTS, 45usize, IDX_USED);
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
    // int8 x: the reference takes x as the kernel rounds it (two levels)
    let x = if int8 { two_level(&x, cols) } else { x };
    let n_out = np * rows;
    let yb = out_buffer(gpu, n_out)?;
    let opts = MatvecOpts {
        int8_x: int8,
        ..Default::default()
    };
    let mut pass = gpu.pass();
    let (y_off, n, k) = (GUARD as u32, nt as u32, n_used as u32);
    match path {
        KernelPath::Matvec => matvec::matvec_indexed(
            &mut pass,
            &wt,
            Operand::new(&xb, 0),
            &matvec::Pairs {
                ids: Operand::new(&idb, 0),
                n_tokens: n,
                n_used: k,
                x_per_pair: per_pair,
            },
            Operand::new(&yb, y_off),
            &opts,
        )?,
        KernelPath::Tiled
        | KernelPath::Coop
        | KernelPath::CoopSplit
        | KernelPath::CoopSplitX
        | KernelPath::CoopXSplit
        | KernelPath::Int8
        | KernelPath::Int8x2 => {
            let route = MoeRoute::new(gpu, ne as u32, np as u32)?;
            matmul::route(&mut pass, &route, &idb, 0, n, k)?;
            if let Some(levels) = path.int8_levels() {
                matmul::matmul_int8_indexed(
                    &mut pass,
                    levels,
                    &wt,
                    Operand::new(&xb, 0),
                    &matmul::RoutePairs {
                        route: &route,
                        n_tokens: n,
                        n_used: k,
                        x_per_pair: per_pair,
                    },
                    Operand::new(&yb, y_off),
                    &opts,
                )?;
            } else if let Some(prec) = path.precision() {
                coopmat::matmul_coop_indexed(
                    &mut pass,
                    prec,
                    &wt,
                    Operand::new(&xb, 0),
                    &matmul::RoutePairs {
                        route: &route,
                        n_tokens: n,
                        n_used: k,
                        x_per_pair: per_pair,
                    },
                    Operand::new(&yb, y_off),
                    &opts,
                )?;
            } else {
                matmul::matmul_indexed_tiled(
                    &mut pass,
                    &wt,
                    Operand::new(&xb, 0),
                    &matmul::RoutePairs {
                        route: &route,
                        n_tokens: n,
                        n_used: k,
                        x_per_pair: per_pair,
                    },
                    Operand::new(&yb, y_off),
                    &opts,
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
        "{} indexed{} {dt} {ne}x{rows}x{cols} tokens {nt} x per {}",
        path.name(),
        if int8 { " int8-x" } else { "" },
        if per_pair { "pair" } else { "token" }
    );
    if let Some(levels) = path.int8_levels() {
        // as `dense`: within the quantization bound of x's last level
        let q = last_level(levels, &x, cols);
        return Ok(compare_with(name, &got, &want, n_out, false, |i, a| {
            let (pq, r) = (i / rows, i % rows);
            let xq = if per_pair { pq } else { pq / n_used };
            let e = ids[pq] as usize;
            q.error_bound(xq, &w.deq[(e * rows + r) * cols..][..cols]) * 1.01 + 1e-4 * (1.0 + a)
        }));
    }
    let f16 = matches!(path, KernelPath::Coop | KernelPath::CoopSplitX)
        && !matches!(dt, DType::F16 | DType::BF16);
    Ok(compare(name, &got, &want, n_out, f16))
}

/// A fused activation load of [`prologue`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProKind {
    /// RMSNorm (`keep`: the normed rows written too).
    Norm {
        keep: bool,
    },
    SwiGlu,
    /// SwiGLU, the product scaled by sigmoid(s) and added to y.
    SwiGluGated,
    /// Sigmoid gate per head (one token).
    SigmoidGate,
}

impl ProKind {
    fn name(self) -> &'static str {
        match self {
            ProKind::Norm { keep: false } => "rms_norm",
            ProKind::Norm { keep: true } => "rms_norm keep",
            ProKind::SwiGlu => "swiglu",
            ProKind::SwiGluGated => "swiglu gated",
            ProKind::SigmoidGate => "sigmoid gate",
        }
    }
}

/// A decode product reading x through a prologue (`matvec::matvec_pro`) against the CPU's
/// step (`cpu::ops`) followed by the product in f64. x rows start at element 4 with a stride
/// past the row; SwiGLU's up values sit `cols + 12` after the gate; the sigmoid gate's heads
/// of 32 (7 for odd widths) every two head widths from element 3.
pub fn prologue(
    gpu: &Gpu,
    dt: DType,
    kind: ProKind,
    (rows, cols, nt): (u64, u64, usize),
    seed: u64,
) -> Result<Check> {
    use crate::cpu::ops;
    use matvec::Prologue;
    let w = Weight::random(dt, &[rows, cols], seed)?;
    let (r, c) = (rows as usize, cols as usize);
    let mut rng = Rng(seed ^ 0x9e11);
    let nt = if kind == ProKind::SigmoidGate { 1 } else { nt };
    let glu = matches!(kind, ProKind::SwiGlu | ProKind::SwiGluGated);
    let up = c + 12;
    let stride = if glu { 2 * c + 20 } else { c + 8 };
    let x = rng.normals(4 + nt * stride, 1.5);
    let nw = rng.normals(c, 1.0);
    let hd = if c.is_multiple_of(32) { 32 } else { 7 };
    let gate = rng.normals(3 + c.div_ceil(hd) * 2 * hd + nt, 2.0);
    let eps = 1e-6;
    // the CPU's product input per token
    let h: Vec<Vec<f32>> = (0..nt)
        .map(|t| {
            let row = &x[4 + t * stride..];
            match kind {
                ProKind::Norm { .. } => ops::rms_norm(&row[..c], c, Some(&nw), eps),
                ProKind::SwiGlu | ProKind::SwiGluGated => {
                    ops::swiglu(&row[..c], &row[up..][..c], None)
                }
                ProKind::SigmoidGate => (0..c)
                    .map(|j| ops::sigmoid(gate[3 + (j / hd) * 2 * hd + j % hd]) * row[j])
                    .collect(),
            }
        })
        .collect();
    let wt = w.upload(gpu)?;
    let xb = gpu.upload_f32(&x, "selftest.x")?;
    let nwb = gpu.upload_f32(&nw, "selftest.nw")?;
    let gb = gpu.upload_f32(&gate, "selftest.gate")?;
    let keep = gpu.upload_f32(&vec![SENTINEL; nt * c], "selftest.h")?;
    let n_out = nt * r;
    let gated = kind == ProKind::SwiGluGated;
    let mut y0 = vec![SENTINEL; n_out + 2 * GUARD];
    if gated {
        y0[GUARD..GUARD + n_out].fill(0.5);
    }
    let yb = gpu.upload_f32(&y0, "selftest.y")?;
    let pro = match kind {
        ProKind::Norm { keep: k } => Prologue::RmsNorm {
            w: &nwb,
            eps,
            keep: k.then_some(&keep),
        },
        ProKind::SwiGlu => Prologue::SwiGlu { up: up as u32 },
        ProKind::SwiGluGated => Prologue::SwiGluGated {
            up: up as u32,
            gate: &gb,
            off: 1,
            stride: 1,
        },
        ProKind::SigmoidGate => Prologue::SigmoidGate {
            gate: &gb,
            off: 3,
            head_dim: hd as u32,
            head_stride: 2 * hd as u32,
        },
    };
    let opts = MatvecOpts::default();
    let mut pass = gpu.pass();
    let x = Operand::strided(&xb, 4, stride as u32);
    let y = Operand::new(&yb, GUARD as u32);
    matvec::matvec_pro(&mut pass, &wt, x, y, nt as u32, &opts, &pro)?;
    pass.submit()?;
    let got = gpu.read_f32(&yb, 0, n_out + 2 * GUARD)?;
    let want: Vec<_> = picks(n_out)
        .into_iter()
        .map(|i| {
            let (t, row) = (i / r, i % r);
            let (v, a) = w.dot(row, &h[t]);
            if gated {
                let sg = ops::sigmoid(gate[1 + t]) as f64;
                (i, Some((0.5 + sg * v, 0.5 + sg * a)))
            } else {
                (i, Some((v, a)))
            }
        })
        .collect();
    let name = format!("matvec {} {dt} {rows}x{cols} tokens {nt}", kind.name());
    let mut chk = compare(name, &got, &want, n_out, false);
    if kind == (ProKind::Norm { keep: true }) && chk.passed {
        let kept = gpu.read_f32(&keep, 0, nt * c)?;
        let want_h: Vec<f32> = h.concat();
        if let Some(j) =
            (0..kept.len()).find(|&j| (kept[j] - want_h[j]).abs() > 1e-5 * (1.0 + want_h[j].abs()))
        {
            chk.passed = false;
            chk.detail = format!("kept row element {j} = {}, want {}", kept[j], want_h[j]);
        }
    }
    Ok(chk)
}

/// SwiGLU (GeGLU with `geglu`) as the store of a gate+up product (`matvec::Epilogue::SwiGlu`,
/// `GeGlu`; rows `0..ff` the gate's and `ff..2ff` the up's), plain or through the RMSNorm
/// prologue, for `nt` tokens (2+: the token-group kernel), against the CPU: `cpu::ops::swiglu`
/// (`geglu`) of the products in f64, within the products' bound carried through silu or
/// gelu_tanh (slope ≤ 1.2) and the other factor.
pub fn swiglu_store(
    gpu: &Gpu,
    dt: DType,
    (ff, cols, nt): (u64, u64, usize),
    normed: bool,
    geglu: bool,
    seed: u64,
) -> Result<Check> {
    use crate::cpu::ops;
    let w = Weight::random(dt, &[2 * ff, cols], seed)?;
    let (f, c) = (ff as usize, cols as usize);
    let mut rng = Rng(seed ^ 0x61a);
    let x = rng.normals(nt * c, 1.5);
    let nw = rng.normals(c, 1.0);
    let eps = 1e-6;
    let wt = w.upload(gpu)?;
    let xb = gpu.upload_f32(&x, "selftest.x")?;
    let nwb = gpu.upload_f32(&nw, "selftest.nw")?;
    let n_out = nt * f;
    let yb = out_buffer(gpu, n_out)?;
    let pro = matvec::Prologue::RmsNorm {
        w: &nwb,
        eps,
        keep: None,
    };
    let mut pass = gpu.pass();
    matvec::matvec_fused(
        &mut pass,
        &wt,
        Operand::new(&xb, 0),
        Operand::new(&yb, GUARD as u32),
        nt as u32,
        &MatvecOpts::default(),
        matvec::Fused {
            pro: normed.then_some(&pro),
            epi: if geglu {
                matvec::Epilogue::GeGlu
            } else {
                matvec::Epilogue::SwiGlu
            },
        },
    )?;
    pass.submit()?;
    let got = gpu.read_f32(&yb, 0, n_out + 2 * GUARD)?;
    let h: Vec<Vec<f32>> = (0..nt)
        .map(|t| {
            let xt = &x[t * c..][..c];
            if normed {
                ops::rms_norm(xt, c, Some(&nw), eps)
            } else {
                xt.to_vec()
            }
        })
        .collect();
    // per output: the swiglu of the f64 products, and its bound as the `a` of compare_with
    let want: Vec<_> = picks(n_out)
        .into_iter()
        .map(|i| {
            let (t, o) = (i / f, i % f);
            let (g, ga) = w.dot(o, &h[t]);
            let (u, ua) = w.dot(f + o, &h[t]);
            let v = if geglu {
                ops::geglu(&[g as f32], &[u as f32])[0] as f64
            } else {
                ops::swiglu(&[g as f32], &[u as f32], None)[0] as f64
            };
            let (eg, eu) = (1e-4 * (1.0 + ga), 1e-4 * (1.0 + ua));
            let bound = 1.2 * eg * (u.abs() + eu) + eu * (g.abs() + eg) + 1e-6 * (1.0 + v.abs());
            (i, Some((v, bound)))
        })
        .collect();
    let name = format!(
        "matvec {} store{} {dt} {}x{cols} tokens {nt}",
        if geglu { "geglu" } else { "swiglu" },
        if normed { " normed" } else { "" },
        2 * ff
    );
    Ok(compare_with(name, &got, &want, n_out, false, |_, b| b))
}

/// A residual product storing x · w too (`matvec::Epilogue::Normed`: `x += P a` over `c`
/// rows) and a product reading that through `matvec::Prologue::RmsNormRaw`, for `nt` tokens
/// (2+: the token-group kernel): the residual and the consumer against the CPU
/// (`cpu::ops::rms_norm`, products in f64), the stored x · w against the read-back residual
/// times w (one f32 multiply: exact).
pub fn normed_store(
    gpu: &Gpu,
    dt: DType,
    (rows, c, k, nt): (u64, u64, u64, usize),
    seed: u64,
) -> Result<Check> {
    use crate::cpu::ops;
    use matvec::{Epilogue, Prologue};
    let pw = Weight::random(dt, &[c, k], seed)?;
    let cw = Weight::random(dt, &[rows, c], seed + 1)?;
    let (r, cu, ku) = (rows as usize, c as usize, k as usize);
    let mut rng = Rng(seed ^ 0x7e5);
    let a = rng.normals(nt * ku, 1.0);
    let x0 = rng.normals(nt * cu, 2.0);
    let nw = rng.normals(cu, 1.0);
    let (pt, ct) = (pw.upload(gpu)?, cw.upload(gpu)?);
    let ab = gpu.upload_f32(&a, "selftest.a")?;
    let xb = gpu.upload_f32(&x0, "selftest.x")?;
    let nwb = gpu.upload_f32(&nw, "selftest.nw")?;
    let hn = gpu.upload_f32(&vec![SENTINEL; nt * cu], "selftest.hn")?;
    let n_out = nt * r;
    let yb = out_buffer(gpu, n_out)?;
    let acc = MatvecOpts {
        accumulate: true,
        ..Default::default()
    };
    let raw = Prologue::RmsNormRaw {
        raw: &xb,
        eps: 1e-6,
    };
    let mut pass = gpu.pass();
    let epi = Epilogue::Normed { w: &nwb, out: &hn };
    matvec::matvec_fused(
        &mut pass,
        &pt,
        Operand::new(&ab, 0),
        Operand::new(&xb, 0),
        nt as u32,
        &acc,
        matvec::Fused { pro: None, epi },
    )?;
    let (o, st) = (MatvecOpts::default(), Epilogue::Store);
    let y0 = GUARD as u32;
    matvec::matvec_fused(
        &mut pass,
        &ct,
        Operand::new(&hn, 0),
        Operand::new(&yb, y0),
        nt as u32,
        &o,
        matvec::Fused {
            pro: Some(&raw),
            epi: st,
        },
    )?;
    pass.submit()?;
    let xs = gpu.read_f32(&xb, 0, nt * cu)?;
    let hv = gpu.read_f32(&hn, 0, nt * cu)?;
    let got = gpu.read_f32(&yb, 0, n_out + 2 * GUARD)?;
    let name = format!("matvec normed store {dt} {c}x{k} -> {rows}x{c} tokens {nt}");
    // the residual rows against the CPU, and x · w exactly
    for t in 0..nt {
        for j in 0..cu {
            let (v, s) = pw.dot(j, &a[t * ku..][..ku]);
            let want = x0[t * cu + j] as f64 + v;
            let got_x = xs[t * cu + j] as f64;
            if (got_x - want).abs() > 1e-4 * (1.0 + s + x0[t * cu + j].abs() as f64) {
                return Ok(fail(
                    name,
                    format!("residual {t}/{j} = {got_x}, want {want}"),
                ));
            }
            if hv[t * cu + j].to_bits() != (xs[t * cu + j] * nw[j]).to_bits() {
                return Ok(fail(name, format!("x · w {t}/{j} = {}", hv[t * cu + j])));
            }
        }
    }
    let h: Vec<Vec<f32>> = (0..nt)
        .map(|t| ops::rms_norm(&xs[t * cu..][..cu], cu, Some(&nw), 1e-6))
        .collect();
    let want: Vec<_> = picks(n_out)
        .into_iter()
        .map(|i| (i, Some(cw.dot(i % r, &h[i / r]))))
        .collect();
    Ok(compare(name, &got, &want, n_out, false))
}

fn fail(name: String, detail: String) -> Check {
    Check {
        name,
        passed: false,
        worst: f64::INFINITY,
        rel_rms: f64::NAN,
        detail,
    }
}

/// The GDN conv step in the store of a qkv product (`matvec::ConvStep`, width 4), normed
/// or plain (`matvec_fused` with and without the RMSNorm prologue), for three one-token sequences in slots 2, 0, 1:
/// the first `channels` rows become silu(Σ_j cw_j · state_j + cw_3 · y) and the states roll,
/// the rest are the product; against the CPU (`cpu::ops::rms_norm`, the product in f64, the
/// conv in f64).
pub fn conv_step(
    gpu: &Gpu,
    dt: DType,
    (rows, cols): (u64, u64),
    normed: bool,
    seed: u64,
) -> Result<Check> {
    use crate::cpu::ops;
    use crate::gpu::gdn::{SeqBatch, SeqSpan};
    let (k, nt) = (4usize, 3usize);
    let (r, c) = (rows as usize, cols as usize);
    let channels = r * 3 / 4;
    let w = Weight::random(dt, &[rows, cols], seed)?;
    let mut rng = Rng(seed ^ 0xc0);
    let x = rng.normals(nt * c, 1.0);
    let nw = rng.normals(c, 1.0);
    let cw = rng.normals(channels * k, 0.5);
    let st0 = rng.normals(nt * (k - 1) * channels, 1.0);
    let slots = [2usize, 0, 1];
    let spans: Vec<SeqSpan> = slots
        .iter()
        .enumerate()
        .map(|(t, &slot)| SeqSpan {
            row: t as u32,
            n_tokens: 1,
            slot: slot as u32,
        })
        .collect();
    let batch = SeqBatch::new(gpu, &spans)?;
    let wt = w.upload(gpu)?;
    let xb = gpu.upload_f32(&x, "selftest.x")?;
    let nwb = gpu.upload_f32(&nw, "selftest.nw")?;
    let cwb = gpu.upload_f32(&cw, "selftest.cw")?;
    let stb = gpu.upload_f32(&st0, "selftest.state")?;
    let n_out = nt * r;
    let yb = out_buffer(gpu, n_out)?;
    let step = matvec::ConvStep {
        channels: channels as u32,
        k: k as u32,
        w: &cwb,
        state: &stb,
        state_off: 0,
        batch: &batch,
    };
    let pro = matvec::Prologue::RmsNorm {
        w: &nwb,
        eps: 1e-6,
        keep: None,
    };
    if !matvec::conv_step_fits(gpu, &batch, nt as u32, wt.parts.len()) {
        return Err(crate::Error::Unsupported(
            "the conv step needs 8 storage bindings".into(),
        ));
    }
    let mut pass = gpu.pass();
    matvec::matvec_fused(
        &mut pass,
        &wt,
        Operand::new(&xb, 0),
        Operand::new(&yb, GUARD as u32),
        nt as u32,
        &MatvecOpts::default(),
        matvec::Fused {
            pro: normed.then_some(&pro),
            epi: matvec::Epilogue::Conv(&step),
        },
    )?;
    pass.submit()?;
    let got = gpu.read_f32(&yb, 0, n_out + 2 * GUARD)?;
    let st = gpu.read_f32(&stb, 0, st0.len())?;
    let mut want = Vec::with_capacity(n_out);
    let mut st_want: Vec<(f32, f64)> = st0.iter().map(|&v| (v, 0.0)).collect();
    for (t, &slot) in slots.iter().enumerate() {
        let xt = &x[t * c..][..c];
        let h = if normed {
            ops::rms_norm(xt, c, Some(&nw), 1e-6)
        } else {
            xt.to_vec()
        };
        let sb = slot * (k - 1) * channels;
        for row in 0..r {
            let (v, a) = w.dot(row, &h);
            if row >= channels {
                want.push((t * r + row, Some((v, a))));
                continue;
            }
            let tap = |j: usize| cw[row * k + j] as f64;
            let mut acc = tap(k - 1) * v;
            let mut mag = (tap(k - 1) * a).abs();
            for j in 0..k - 1 {
                let s = st0[sb + j * channels + row] as f64;
                acc += tap(j) * s;
                mag += (tap(j) * s).abs();
            }
            let silu = acc / (1.0 + (-acc).exp());
            // silu's slope is at most 1.1: the bound of acc carries over
            want.push((t * r + row, Some((silu, 1.1 * mag))));
            for j in 0..k - 2 {
                st_want[sb + j * channels + row] = (st0[sb + (j + 1) * channels + row], 0.0);
            }
            st_want[sb + (k - 2) * channels + row] = (v as f32, 1e-4 * (1.0 + a));
        }
    }
    let mut chk = compare(
        format!(
            "matvec conv step {dt} {rows}x{cols} channels {channels}{}",
            if normed { " normed" } else { "" }
        ),
        &got,
        &want,
        n_out,
        false,
    );
    if chk.passed {
        // rolled values move exactly; the new row carries the product's bound
        if let Some(j) =
            (0..st.len()).find(|&j| (st[j] as f64 - st_want[j].0 as f64).abs() > st_want[j].1)
        {
            chk.passed = false;
            chk.detail = format!("conv state element {j} = {}, want {}", st[j], st_want[j].0);
        }
    }
    Ok(chk)
}

/// x̂ = d·q + d₂·q₂ of `x` in rows of `cols`, as `matvec::quantize_x2` rounds it.
fn two_level(x: &[f32], cols: usize) -> Vec<f32> {
    let (a, b) = crate::cpu::q8x::quantize_x2(x, cols);
    crate::cpu::q8x::dequantize2(&a, &b)
}

/// The int8-activation matvec (`MatvecOpts::int8_x`: `quantize_x2`, then the integer-dot
/// kernel over both levels), dense or (`indexed`) the MoE form, against the product with x
/// quantized on the CPU (`cpu::q8x::quantize_x2`, the same rounding), at the f32 bound.
pub fn int8(
    gpu: &Gpu,
    dt: DType,
    (rows, cols, nt): (u64, u64, usize),
    acc: bool,
    seed: u64,
) -> Result<Check> {
    let w = Weight::random(dt, &[rows, cols], seed)?;
    let (r, c) = (rows as usize, cols as usize);
    let x = Rng(seed ^ 0x18).normals(nt * c, 1.0);
    let xq = two_level(&x, c);
    let wt = w.upload(gpu)?;
    let xb = gpu.upload_f32(&x, "selftest.x")?;
    let n_out = nt * r;
    let mut y0 = vec![SENTINEL; n_out + 2 * GUARD];
    if acc {
        y0[GUARD..GUARD + n_out].fill(0.5);
    }
    let yb = gpu.upload_f32(&y0, "selftest.y")?;
    let opts = MatvecOpts {
        accumulate: acc,
        int8_x: true,
        ..Default::default()
    };
    let mut pass = gpu.pass();
    matvec::matvec_opts(
        &mut pass,
        &wt,
        Operand::new(&xb, 0),
        Operand::new(&yb, GUARD as u32),
        nt as u32,
        &opts,
    )?;
    pass.submit()?;
    let got = gpu.read_f32(&yb, 0, n_out + 2 * GUARD)?;
    let base = if acc { 0.5 } else { 0.0 };
    let want: Vec<_> = picks(n_out)
        .into_iter()
        .map(|i| {
            let (v, a) = w.dot(i % r, &xq[(i / r) * c..][..c]);
            (i, Some((v + base, a)))
        })
        .collect();
    Ok(compare(
        format!(
            "matvec int8-x {dt} {rows}x{cols} tokens {nt}{}",
            if acc { " accumulate" } else { "" }
        ),
        &got,
        &want,
        n_out,
        false,
    ))
}

/// What the fused decode prologues' checks bind beside their q/k/v rows: random `[head_dim]`
/// q and k norm weights, one token at position 777 written to cache row 2, and f32 K and V
/// caches of 4 rows of `n_head_kv · head_dim` values, all `SENTINEL` (rows other than 2 must
/// stay so).
struct DecodeRig {
    qw: Vec<f32>,
    kw: Vec<f32>,
    pos: u32,
    row: usize,
    cache: Vec<f32>,
    qwb: wgpu::Buffer,
    kwb: wgpu::Buffer,
    pos_b: wgpu::Buffer,
    rows_b: wgpu::Buffer,
    kc: wgpu::Buffer,
    vc: wgpu::Buffer,
}

impl DecodeRig {
    fn new(gpu: &Gpu, rng: &mut Rng, h: usize, nkv: usize) -> Result<DecodeRig> {
        let qw = rng.normals(h, 1.0);
        let kw = rng.normals(h, 1.0);
        let (pos, row) = (777u32, 2usize);
        let cache = vec![SENTINEL; 4 * nkv * h];
        Ok(DecodeRig {
            qwb: gpu.upload_f32(&qw, "selftest.qw")?,
            kwb: gpu.upload_f32(&kw, "selftest.kw")?,
            pos_b: gpu.upload(bytemuck::cast_slice(&[pos]), "selftest.pos")?,
            rows_b: gpu.upload(bytemuck::cast_slice(&[row as u32]), "selftest.rows")?,
            kc: gpu.upload_f32(&cache, "selftest.kc")?,
            vc: gpu.upload_f32(&cache, "selftest.vc")?,
            qw,
            kw,
            pos,
            row,
            cache,
        })
    }

    /// The prologue's arguments over `buf`: q heads at `q_off + h · q_stride`, k and v heads
    /// packed from `k_off` / `v_off`; eps 1e-6.
    fn qkv<'a>(
        &'a self,
        buf: &'a wgpu::Buffer,
        (n_head, n_head_kv, head_dim): (u32, u32, u32),
        (q_off, q_stride): (u32, u32),
        (k_off, v_off): (u32, u32),
    ) -> crate::gpu::rope::QkvDecode<'a> {
        crate::gpu::rope::QkvDecode {
            buf,
            n_head,
            n_head_kv,
            head_dim,
            q_off,
            q_stride,
            k_off,
            v_off,
            q_norm: &self.qwb,
            k_norm: &self.kwb,
            eps: 1e-6,
            positions: &self.pos_b,
            pos_off: 0,
            rows: &self.rows_b,
            row_off: 0,
            k_cache: &self.kc,
            v_cache: &self.vc,
            f16: false,
        }
    }
}

/// Qwen3.5 attention's fused decode prologue (`rope::qk_norm_rope`) for one token at position
/// 777, cache row 2 of 4, against the CPU: per-head RMSNorm then NEOX RoPE of q (in place,
/// the gates between q heads untouched) and k (to the cache row), v copied to its row; f32
/// cache. Bound per value `1e-5 · (1 + |v|)` (a few f32 roundings of O(1) values).
pub fn qk_norm_rope(
    gpu: &Gpu,
    (nh, nkv, hd, n_rot): (u32, u32, u32, u32),
    seed: u64,
) -> Result<Check> {
    use crate::cpu::ops;
    use crate::gpu::rope::{self, RopeTable};
    let mut rng = Rng(seed);
    let (h, nhu, nkvu) = (hd as usize, nh as usize, nkv as usize);
    let (q_off, k_off) = (3usize, 3 + nhu * 2 * h + 5);
    let v_off = k_off + nkvu * h + 2;
    let len = v_off + nkvu * h + 4;
    let x = rng.normals(len, 2.0);
    let rig = DecodeRig::new(gpu, &mut rng, h, nkvu)?;
    let (qw, kw, pos, row, cache) = (&rig.qw, &rig.kw, rig.pos, rig.row, &rig.cache);
    let inv_freq = ops::rope_inv_freq(1e7, n_rot as usize);
    let table = RopeTable::new(gpu, &inv_freq, "selftest.rope")?;
    let xb = gpu.upload_f32(&x, "selftest.x")?;
    let mut pass = gpu.pass();
    let qkv = rig.qkv(
        &xb,
        (nh, nkv, hd),
        (q_off as u32, 2 * hd),
        (k_off as u32, v_off as u32),
    );
    rope::qk_norm_rope(&mut pass, &qkv, &table)?;
    pass.submit()?;
    let got_x = gpu.read_f32(&xb, 0, len)?;
    let got_k = gpu.read_f32(&rig.kc, 0, cache.len())?;
    let got_v = gpu.read_f32(&rig.vc, 0, cache.len())?;
    let normed = |src: &[f32], n: usize, w: &[f32]| -> Vec<f32> {
        let mut v: Vec<f32> = (0..n)
            .flat_map(|i| ops::rms_norm(&src[i * h..][..h], h, Some(w), 1e-6))
            .collect();
        ops::rope_neox(&mut v, n, h, n_rot as usize, &[pos], &inv_freq, false);
        v
    };
    let q_src: Vec<f32> = (0..nhu)
        .flat_map(|i| x[q_off + i * 2 * h..][..h].to_vec())
        .collect();
    let want_q = normed(&q_src, nhu, qw);
    let want_k = normed(&x[k_off..], nkvu, kw);
    // (got, want) of every checked value: q heads, the gates between them, the cache rows
    let mut pairs: Vec<(f32, f32)> = Vec::new();
    for i in 0..nhu {
        let at = q_off + i * 2 * h;
        pairs.extend((0..h).map(|j| (got_x[at + j], want_q[i * h + j])));
        pairs.extend((h..2 * h).map(|j| (got_x[at + j], x[at + j])));
    }
    let r0 = row * nkvu * h;
    pairs.extend((0..nkvu * h).map(|j| (got_k[r0 + j], want_k[j])));
    pairs.extend((0..nkvu * h).map(|j| (got_v[r0 + j], x[v_off + j])));
    let others = (0..cache.len()).filter(|&j| j / (nkvu * h) != row);
    pairs.extend(others.map(|j| (got_k[j], SENTINEL)));
    Ok(value_check(
        format!("qk_norm_rope {nh}x{nkv}x{hd} rot {n_rot}"),
        &pairs,
        String::new(),
    ))
}

/// Gemma-4's fused decode prologue (`rope::qk_norm_rope_kv`) for one token at position 777,
/// cache row 2 of 4, against the CPU: q, k and v in their own buffers (v the k buffer with
/// `v_is_k`), per-head RMSNorm of q and k with weights and of v without, NEOX RoPE of q (in
/// place) and k (to the cache row) with `pairs` rotated pairs of a `theta^(-2i/hd)` table
/// (zero past them: proportional RoPE), v to its row; f32 cache. Bound per value
/// `1e-5 · (1 + |v|)`.
pub fn qk_norm_rope_kv(
    gpu: &Gpu,
    (nh, nkv, hd, pairs): (u32, u32, u32, usize),
    v_is_k: bool,
    seed: u64,
) -> Result<Check> {
    use crate::cpu::ops;
    use crate::gpu::rope::{self, KvHeads, RopeTable};
    let mut rng = Rng(seed);
    let (h, nhu, nkvu) = (hd as usize, nh as usize, nkv as usize);
    let q = rng.normals(nhu * h, 2.0);
    let k = rng.normals(nkvu * h, 2.0);
    let v = if v_is_k {
        k.clone()
    } else {
        rng.normals(nkvu * h, 2.0)
    };
    let rig = DecodeRig::new(gpu, &mut rng, h, nkvu)?;
    let (qw, kw, pos, row, cache) = (&rig.qw, &rig.kw, rig.pos, rig.row, &rig.cache);
    let mut inv_freq = ops::rope_inv_freq(1e6, h);
    inv_freq.iter_mut().skip(pairs).for_each(|f| *f = 0.0);
    let table = RopeTable::new(gpu, &inv_freq, "selftest.rope")?;
    let qb = gpu.upload_f32(&q, "selftest.q")?;
    let kb = gpu.upload_f32(&k, "selftest.k")?;
    let vb = gpu.upload_f32(&v, "selftest.v")?;
    let mut pass = gpu.pass();
    let heads = KvHeads {
        k: &kb,
        v: if v_is_k { &kb } else { &vb },
        v_norm: true,
    };
    let qkv = rig.qkv(&qb, (nh, nkv, hd), (0, hd), (0, 0));
    rope::qk_norm_rope_kv(&mut pass, &qkv, &heads, &table)?;
    pass.submit()?;
    let got_q = gpu.read_f32(&qb, 0, q.len())?;
    let got_k = gpu.read_f32(&rig.kc, 0, cache.len())?;
    let got_v = gpu.read_f32(&rig.vc, 0, cache.len())?;
    let normed = |src: &[f32], n: usize, w: Option<&[f32]>| -> Vec<f32> {
        (0..n)
            .flat_map(|i| ops::rms_norm(&src[i * h..][..h], h, w, 1e-6))
            .collect()
    };
    let mut want_q = normed(&q, nhu, Some(qw));
    ops::rope_neox(&mut want_q, nhu, h, h, &[pos], &inv_freq, false);
    let mut want_k = normed(&k, nkvu, Some(kw));
    ops::rope_neox(&mut want_k, nkvu, h, h, &[pos], &inv_freq, false);
    let want_v = normed(&v, nkvu, None);
    let mut vals: Vec<(f32, f32)> = got_q.iter().copied().zip(want_q).collect();
    let r0 = row * nkvu * h;
    vals.extend((0..nkvu * h).map(|j| (got_k[r0 + j], want_k[j])));
    vals.extend((0..nkvu * h).map(|j| (got_v[r0 + j], want_v[j])));
    let others = (0..cache.len()).filter(|&j| j / (nkvu * h) != row);
    vals.extend(others.map(|j| (got_v[j], SENTINEL)));
    Ok(value_check(
        format!(
            "qk_norm_rope kv {nh}x{nkv}x{hd} rotated {pairs} of {}",
            inv_freq.len()
        ),
        &vals,
        String::new(),
    ))
}

/// Gemma's sandwich norms in one dispatch (`norm::sandwich`) over `rows` rows of `dim` with
/// `branches` branches (0: the stream only scaled; 1: `rms(z)·w`; 2: the MoE block's
/// `rms(rms(z)·w + rms(z2)·w2)·wb`, with two more norms of the new stream: a MoE block's),
/// scale 0.75, against the CPU: `cpu::ops::rms_norm` and the adds in f32. Bound per value
/// `1e-5 · (1 + |v|)`.
pub fn sandwich_norm(
    gpu: &Gpu,
    (rows, dim): (u32, u32),
    branches: u32,
    seed: u64,
) -> Result<Check> {
    use crate::cpu::ops;
    use crate::gpu::norm::{self, Branch, Sandwich};
    let mut rng = Rng(seed);
    let (r, d) = (rows as usize, dim as usize);
    let (eps, scale) = (1e-6, 0.75);
    let x = rng.normals(r * d, 3.0);
    let z = rng.normals(r * d, 2.0);
    let z2 = rng.normals(r * d, 0.5);
    let w: Vec<Vec<f32>> = (0..6).map(|_| rng.normals(d, 1.0)).collect();
    let wt = |i: usize| {
        gpu.upload_tensor(&TensorRef {
            name: "selftest.norm",
            dtype: DType::F32,
            shape: &[d as u64],
            data: bytemuck::cast_slice(&w[i]),
            path: Path::new("selftest"),
        })
    };
    let ws = [wt(0)?, wt(1)?, wt(2)?, wt(3)?, wt(4)?, wt(5)?];
    let xb = gpu.upload_f32(&x, "selftest.x")?;
    let yb = gpu.upload_f32(&vec![SENTINEL; r * d], "selftest.y")?;
    let zb = gpu.upload_f32(&z, "selftest.z")?;
    let z2b = gpu.upload_f32(&z2, "selftest.z2")?;
    let m1 = gpu.upload_f32(&vec![SENTINEL; r * d], "selftest.m1")?;
    let m2 = gpu.upload_f32(&vec![SENTINEL; r * d], "selftest.m2")?;
    let more_all = [(&m1, &ws[4]), (&m2, &ws[5])];
    let n_more = if branches == 2 { 2 } else { 0 };
    let branch = match branches {
        0 => Branch::None,
        1 => Branch::One { z: &zb, w: &ws[1] },
        _ => Branch::Two {
            z: &zb,
            w: &ws[1],
            z2: &z2b,
            w2: &ws[2],
            wb: &ws[3],
        },
    };
    let mut pass = gpu.pass();
    let s = Sandwich {
        n_rows: rows,
        dim,
        eps,
        x: &xb,
        branch,
        scale,
        y: &yb,
        wy: &ws[0],
        more: &more_all[..n_more],
    };
    norm::sandwich(&mut pass, &s)?;
    pass.submit()?;
    let got_x = gpu.read_f32(&xb, 0, r * d)?;
    let got_y = gpu.read_f32(&yb, 0, r * d)?;
    let got_m = [gpu.read_f32(&m1, 0, r * d)?, gpu.read_f32(&m2, 0, r * d)?];
    let mut pairs = Vec::with_capacity(4 * r * d);
    for i in 0..r {
        let at = |v: &[f32]| v[i * d..][..d].to_vec();
        let b = match branches {
            0 => vec![0.0; d],
            1 => ops::rms_norm(&at(&z), d, Some(&w[1]), eps),
            _ => {
                let a = ops::rms_norm(&at(&z), d, Some(&w[1]), eps);
                let c = ops::rms_norm(&at(&z2), d, Some(&w[2]), eps);
                let s: Vec<f32> = a.iter().zip(&c).map(|(a, c)| a + c).collect();
                ops::rms_norm(&s, d, Some(&w[3]), eps)
            }
        };
        let xr: Vec<f32> = at(&x)
            .iter()
            .zip(&b)
            .map(|(x, b)| (x + b) * scale)
            .collect();
        let yr = ops::rms_norm(&xr, d, Some(&w[0]), eps);
        pairs.extend((0..d).map(|j| (got_x[i * d + j], xr[j])));
        pairs.extend((0..d).map(|j| (got_y[i * d + j], yr[j])));
        for (m, got) in got_m.iter().enumerate().take(n_more) {
            let want = ops::rms_norm(&xr, d, Some(&w[4 + m]), eps);
            pairs.extend((0..d).map(|j| (got[i * d + j], want[j])));
        }
    }
    Ok(value_check(
        format!("sandwich norm {rows}x{dim} branches {branches}"),
        &pairs,
        String::new(),
    ))
}

/// A check of (got, want) value pairs at the bound `1e-5 · (1 + |want|)` (a few f32 roundings
/// of O(1) values); pairs wanting [`SENTINEL`] are left out of the RMS. `detail`: a failure
/// found before, kept unless a value fails.
fn value_check(name: String, pairs: &[(f32, f32)], mut detail: String) -> Check {
    let mut worst = 0f64;
    let (mut e2, mut v2) = (0f64, 0f64);
    for (i, &(g, w)) in pairs.iter().enumerate() {
        if w != SENTINEL {
            e2 += (g as f64 - w as f64).powi(2);
            v2 += (w as f64).powi(2);
        }
        let bound = 1e-5 * (1.0 + w.abs() as f64);
        let err = (g as f64 - w as f64).abs() / bound;
        let ratio = if err.is_nan() { f64::INFINITY } else { err };
        if ratio > worst {
            worst = ratio;
            if worst > 1.0 {
                detail = format!("value {i} = {g}, want {w}");
            }
        }
    }
    Check {
        name,
        passed: detail.is_empty(),
        worst,
        rel_rms: (e2 / v2.max(1e-300)).sqrt(),
        detail,
    }
}

/// The gated activations and scales the Gemma-4 and Step-3.7 forwards run, on `rows` rows of
/// `cols` whose operands start at odd offsets with a stride of `cols + 3`: GeGLU (tanh GELU),
/// Step's clamped SwiGLU (limit 3, so both clamps bite on normals of scale 4), the final
/// logit softcap (cap 5) and the router's per-expert scale (ids past the table keep their
/// weight). Against the CPU references (`cpu::ops`, `cpu::router::expert_scale`), bound per
/// value `1e-5 · (1 + |v|)`; elements outside the rows must stay untouched.
pub fn gated_activations(
    gpu: &Gpu,
    (rows, cols): (u32, u32),
    seed: u64,
) -> Vec<(String, Result<Check>)> {
    let mut out: Vec<(String, Result<Check>)> =
        [Gated::Geglu, Gated::SwigluActClamp, Gated::Softcap]
            .into_iter()
            .map(|op| (op.name().to_string(), gated(gpu, op, (rows, cols), seed)))
            .collect();
    out.push((
        "expert_scale".to_string(),
        expert_scale(gpu, rows * cols, seed),
    ));
    out
}

/// The elementwise kernels [`gated_activations`] checks.
#[derive(Clone, Copy)]
enum Gated {
    Geglu,
    /// Limit 3.
    SwigluActClamp,
    /// In place, cap 5.
    Softcap,
}

impl Gated {
    fn name(self) -> &'static str {
        match self {
            Gated::Geglu => "geglu",
            Gated::SwigluActClamp => "swiglu_act_clamp",
            Gated::Softcap => "softcap",
        }
    }
}

/// One [`Gated`] kernel on strided rows (see [`gated_activations`]).
fn gated(gpu: &Gpu, op: Gated, (rows, cols): (u32, u32), seed: u64) -> Result<Check> {
    use crate::cpu::ops;
    use crate::gpu::elementwise as ew;
    use crate::gpu::operand::Operand;
    let (r, c) = (rows as usize, cols as usize);
    let (off, stride) = (5, c + 3);
    let len = off + r * stride;
    let mut rng = Rng(seed);
    let g = rng.normals(len, 4.0);
    let u = rng.normals(len, 4.0);
    // softcap runs in place on logits; the GLUs write over sentinels
    let y0 = match op {
        Gated::Softcap => rng.normals(len, 20.0),
        _ => vec![SENTINEL; len],
    };
    let gb = gpu.upload_f32(&g, "selftest.g")?;
    let ub = gpu.upload_f32(&u, "selftest.u")?;
    let yb = gpu.upload_f32(&y0, "selftest.y")?;
    let view = |b| Operand::strided(b, off as u32, stride as u32);
    let mut pass = gpu.pass();
    let (y, gv, uv) = (view(&yb), view(&gb), view(&ub));
    match op {
        Gated::Geglu => ew::geglu(&mut pass, rows, cols, y, gv, uv)?,
        Gated::SwigluActClamp => ew::swiglu_act_clamp(&mut pass, rows, cols, y, gv, uv, 3.0)?,
        Gated::Softcap => ew::softcap_inplace(&mut pass, rows, cols, y, 5.0)?,
    }
    pass.submit()?;
    let got = gpu.read_f32(&yb, 0, len)?;
    let mut pairs = Vec::with_capacity(r * c);
    for i in 0..r {
        let at = off + i * stride;
        let (gr, ur) = (&g[at..at + c], &u[at..at + c]);
        let want = match op {
            Gated::Geglu => ops::geglu(gr, ur),
            Gated::SwigluActClamp => ops::swiglu_act_clamp(gr, ur, 3.0),
            Gated::Softcap => y0[at..at + c]
                .iter()
                .map(|&x| ops::softcap(x, 5.0))
                .collect(),
        };
        pairs.extend(got[at..at + c].iter().copied().zip(want));
    }
    let detail = (0..len)
        .filter(|&k| k < off || (k - off) % stride >= c)
        .find(|&k| got[k].to_bits() != y0[k].to_bits())
        .map(|k| format!("element {k} outside the rows was written"))
        .unwrap_or_default();
    Ok(value_check(
        format!("{} {rows}x{cols}", op.name()),
        &pairs,
        detail,
    ))
}

/// `router::expert_scale` on `n` (token, slot) pairs over 37 experts, some ids past the
/// table, against `cpu::router::expert_scale`: one f32 product each, so bit for bit.
fn expert_scale(gpu: &Gpu, n: u32, seed: u64) -> Result<Check> {
    use crate::gpu::router;
    let mut rng = Rng(seed);
    let n_exp = 37usize;
    let w = rng.normals(n as usize, 1.0);
    let scale = rng.normals(n_exp, 1.0);
    let ids: Vec<u32> = (0..n)
        .map(|_| (rng.next() % (n_exp as u64 + 3)) as u32)
        .collect();
    let wb = gpu.upload_f32(&w, "selftest.w")?;
    let ib = gpu.upload(bytemuck::cast_slice(&ids), "selftest.ids")?;
    let st = gpu.upload_tensor(&TensorRef {
        name: "selftest.expert_scale",
        dtype: DType::F32,
        shape: &[n_exp as u64],
        data: bytemuck::cast_slice(&scale),
        path: Path::new("selftest"),
    })?;
    let mut pass = gpu.pass();
    router::expert_scale(&mut pass, n, &wb, &ib, &st)?;
    pass.submit()?;
    let got = gpu.read_f32(&wb, 0, n as usize)?;
    let mut want = w.clone();
    crate::cpu::router::expert_scale(&mut want, &ids, &scale);
    let detail = match (0..n as usize).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        Some(i) => format!(
            "pair {i} (expert {}): {} , want {}",
            ids[i], got[i], want[i]
        ),
        None => String::new(),
    };
    let pairs: Vec<(f32, f32)> = got.iter().copied().zip(want.iter().copied()).collect();
    Ok(value_check(
        format!("expert_scale {n} pairs"),
        &pairs,
        detail,
    ))
}

/// The residual add + RMSNorm of decode and prefill (`norm::add_rms_norm`, f32 weight) on
/// `rows` rows of `dim` whose x, residual and y rows start at element `off` (and `off + 4`,
/// `off + 8`) with a stride of `dim + off`. Against the CPU (`ops::rms_norm` of x + r); the
/// sum written back to x must be the f32 sum exactly. Bound per value `1e-5 · (1 + |v|)`.
pub fn add_rms_norm(gpu: &Gpu, (rows, dim, off): (u32, u32, u32), seed: u64) -> Result<Check> {
    use crate::cpu::ops;
    use crate::gpu::norm;
    use crate::gpu::operand::Operand;
    let mut rng = Rng(seed);
    let (r, d, o) = (rows as usize, dim as usize, off as usize);
    let stride = d + o;
    let len = o + 8 + r * stride + 4;
    let x = rng.normals(len, 2.0);
    let z = rng.normals(len, 1.0);
    let w = rng.normals(d, 1.0);
    let xb = gpu.upload_f32(&x, "selftest.x")?;
    let zb = gpu.upload_f32(&z, "selftest.z")?;
    let yb = gpu.upload_f32(&vec![SENTINEL; len], "selftest.y")?;
    let wt = gpu.upload_tensor(&TensorRef {
        name: "selftest.norm",
        dtype: DType::F32,
        shape: &[d as u64],
        data: bytemuck::cast_slice(&w),
        path: Path::new("selftest"),
    })?;
    let (xo, zo, yo) = (o, o + 4, o + 8);
    let view = |b, at: usize| Operand::strided(b, at as u32, stride as u32);
    let mut pass = gpu.pass();
    let rms = norm::Rms {
        n_rows: rows,
        dim,
        eps: 1e-6,
    };
    let (xv, zv, yv) = (view(&xb, xo), view(&zb, zo), view(&yb, yo));
    norm::add_rms_norm(&mut pass, rms, xv, zv, yv, Some(&wt))?;
    pass.submit()?;
    let got_x = gpu.read_f32(&xb, 0, len)?;
    let got_y = gpu.read_f32(&yb, 0, len)?;
    let mut detail = String::new();
    let mut pairs = Vec::with_capacity(r * d);
    for i in 0..r {
        let h: Vec<f32> = (0..d)
            .map(|j| x[xo + i * stride + j] + z[zo + i * stride + j])
            .collect();
        if (0..d).any(|j| got_x[xo + i * stride + j] != h[j]) && detail.is_empty() {
            detail = format!("row {i}: residual sum written back differs");
        }
        let want = ops::rms_norm(&h, d, Some(&w), 1e-6);
        pairs.extend((0..d).map(|j| (got_y[yo + i * stride + j], want[j])));
    }
    let mut c = value_check(
        format!("add_rms_norm {rows}x{dim} offset {off}"),
        &pairs,
        detail,
    );
    let outside = (0..len).filter(|&k| k < yo || (k - yo) % stride >= d || (k - yo) / stride >= r);
    if let Some(k) = outside.into_iter().find(|&k| got_y[k] != SENTINEL) {
        c.detail = format!("y element {k} outside the rows was written");
        c.passed = false;
    }
    Ok(c)
}

/// DeepSeek-V4's decode rows in one attention call (`attention::Keys::Rows`): tokens with
/// their own index lists (window ring rows in source A, compressed entries in B, masked
/// slots) of the given lengths, each with its own split, one K = V head, sinks; f32 cache.
/// Against the CPU reference over each token's list (bound `1e-5 · (1 + max |ref|)`), and
/// each token's output bit for bit against a call of that token alone (what a one-token
/// decode step computes).
pub fn attention_rows(gpu: &Gpu, (nh, hd): (u32, u32), lens: &[u32], seed: u64) -> Result<Check> {
    use crate::cpu::attention::{self as cref, Dims, KvRef, Visible};
    use crate::gpu::attention::{
        self as ga, Attention, Keys, KvShape, KvSource, KvType, OutView, QView, INVALID, SRC_B,
    };
    let mut rng = Rng(seed);
    let kv = KvShape {
        dtype: KvType::F32,
        n_head_kv: 1,
        head_dim: hd,
    };
    let (n_a, n_b, w) = (11u32, 23u32, (nh * hd) as usize);
    let ka = rng.normals(n_a as usize * hd as usize, 1.0);
    let kb = rng.normals(n_b as usize * hd as usize, 1.0);
    let sinks = rng.normals(nh as usize, 1.0);
    let q = rng.normals(lens.len() * w, 1.0);
    let lists: Vec<Vec<u32>> = lens
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| match rng.next() % 6 {
                    0 => INVALID,
                    1 | 2 => (rng.next() % n_a as u64) as u32,
                    _ => SRC_B | (rng.next() % n_b as u64) as u32,
                })
                .collect()
        })
        .collect();
    let ab = gpu.upload_f32(&ka, "selftest.ring")?;
    let bb = gpu.upload_f32(&kb, "selftest.entries")?;
    let sb = gpu.upload_f32(&sinks, "selftest.sinks")?;
    // One call over tokens `ts`: aux = [descriptors][lists], the outputs come back.
    let run = |ts: &[usize]| -> Result<Vec<f32>> {
        let mut aux = Vec::new();
        let mut at = 4 * ts.len() as u32;
        let mut max_split = 1;
        for &t in ts {
            let (ns, sl) = ga::row_split(gpu, nh, kv, lens[t])?;
            aux.extend([lens[t], ns, sl, at]);
            at += lens[t];
            max_split = max_split.max(ns);
        }
        for &t in ts {
            aux.extend(&lists[t]);
        }
        let nq = ts.len() as u32;
        let qs: Vec<f32> = ts.iter().flat_map(|&t| q[t * w..][..w].to_vec()).collect();
        let auxb = gpu.upload(bytemuck::cast_slice(&aux), "selftest.aux")?;
        let qb = gpu.upload_f32(&qs, "selftest.q")?;
        let out = gpu.buffer(qs.len() as u64 * 4, "selftest.out")?;
        let scratch = gpu.buffer(
            ga::scratch_elems(nq, nh, hd, max_split) * 4,
            "selftest.split",
        )?;
        let mut pass = gpu.pass();
        ga::attention(
            &mut pass,
            &Attention {
                n_q: nq,
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
                a: KvSource { k: &ab, v: None },
                b: Some(KvSource { k: &bb, v: None }),
                keys: Keys::Rows {
                    aux: &auxb,
                    off: 0,
                    max_keys: lens.iter().copied().max().unwrap_or(0),
                },
                sinks: Some((&sb, 0)),
                split: Some((&scratch, max_split)),
            },
        )?;
        pass.submit()?;
        gpu.read_f32(&out, 0, qs.len())
    };
    let all: Vec<usize> = (0..lens.len()).collect();
    let got = run(&all)?;
    let (mut worst, mut e2, mut v2) = (0f64, 0f64, 0f64);
    let mut detail = String::new();
    for (t, list) in lists.iter().enumerate() {
        let d = Dims {
            n_q: 1,
            n_head: nh as usize,
            n_head_kv: 1,
            head_dim: hd as usize,
        };
        let vis = Visible::Index {
            idx: list,
            n_idx: list.len(),
        };
        let (a, b) = (KvRef { k: &ka, v: &ka }, KvRef { k: &kb, v: &kb });
        let scale = 1.0 / (hd as f32).sqrt();
        let want = cref::attention(d, &q[t * w..][..w], a, Some(b), vis, Some(&sinks), scale);
        let g = &got[t * w..][..w];
        let top = want.iter().fold(0f64, |m, &x| m.max(x.abs() as f64));
        for (i, (&gv, &wv)) in g.iter().zip(&want).enumerate() {
            let err = (gv as f64 - wv as f64).abs() / (1e-5 * (1.0 + top));
            let err = if err.is_nan() { f64::INFINITY } else { err };
            e2 += (gv as f64 - wv as f64).powi(2);
            v2 += (wv as f64).powi(2);
            if err > worst {
                worst = err;
                if worst > 1.0 {
                    detail = format!("token {t} value {i} = {gv}, want {wv}");
                }
            }
        }
        let alone = run(&[t])?;
        if g.iter()
            .zip(&alone)
            .any(|(a, b)| a.to_bits() != b.to_bits())
            && detail.is_empty()
        {
            detail = format!("token {t}: not the bits of the token alone");
        }
    }
    Ok(Check {
        name: format!("attention rows {nh}x{hd} lists {lens:?}"),
        passed: detail.is_empty(),
        worst,
        rel_rms: (e2 / v2.max(1e-300)).sqrt(),
        detail,
    })
}

/// The GDN decode step with Qwen3.5's gated output norm (`gdn::recurrent_normed`) for three
/// one-token sequences in slots 2, 0, 1 of a pool of four, from a nonzero state, against the
/// CPU (`cpu::gdn::gates`, `cpu::gdn::recurrent` in f64, `cpu::ops::gated_rms_norm`): output
/// and final states within `1e-5` of the largest reference value (f32 rounding over the d_k
/// sums of the step).
pub fn gdn_normed(gpu: &Gpu, s: crate::gpu::gdn::GdnShape, seed: u64) -> Result<Check> {
    use crate::cpu::{gdn as cgdn, ops};
    use crate::gpu::gdn::{self, GatedNorm, GdnIo, SeqBatch, SeqSpan};
    let mut rng = Rng(seed);
    let (hv, cd, ov) = (s.n_head_v, s.conv_dim(), s.n_head_v * s.d_v);
    let slots = [2usize, 0, 1];
    let nt = slots.len();
    let uni = |r: &mut Rng, n: usize, lo: f64, hi: f64| -> Vec<f32> {
        (0..n)
            .map(|_| (lo + (hi - lo) * r.uniform()) as f32)
            .collect()
    };
    let qkv = uni(&mut rng, nt * cd, -1.0, 1.0);
    let a = uni(&mut rng, nt * hv, -1.0, 1.0);
    let b = uni(&mut rng, nt * hv, -2.0, 2.0);
    let a_neg: Vec<f32> = (0..hv)
        .map(|_| -(-1.0 + 3.0 * rng.uniform()).exp() as f32)
        .collect();
    let dt_bias = uni(&mut rng, hv, -6.0, -2.0);
    let state0 = uni(&mut rng, 4 * s.state_len(), -0.5, 0.5);
    let z = uni(&mut rng, nt * ov, -3.0, 3.0);
    let nw = uni(&mut rng, s.d_v, -1.5, 1.5);
    let spans: Vec<SeqSpan> = slots
        .iter()
        .enumerate()
        .map(|(t, &slot)| SeqSpan {
            row: t as u32,
            n_tokens: 1,
            slot: slot as u32,
        })
        .collect();
    let batch = SeqBatch::new(gpu, &spans)?;
    let qkv_b = gpu.upload_f32(&qkv, "selftest.qkv")?;
    let a_b = gpu.upload_f32(&a, "selftest.a")?;
    let b_b = gpu.upload_f32(&b, "selftest.b")?;
    let an_b = gpu.upload_f32(&a_neg, "selftest.a_neg")?;
    let dt_b = gpu.upload_f32(&dt_bias, "selftest.dt_bias")?;
    let st_b = gpu.upload_f32(&state0, "selftest.state")?;
    let z_b = gpu.upload_f32(&z, "selftest.z")?;
    let nw_b = gpu.upload_f32(&nw, "selftest.nw")?;
    let o_b = gpu.upload_f32(&vec![SENTINEL; nt * ov], "selftest.o")?;
    let io = GdnIo {
        qkv: &qkv_b,
        qkv_off: 0,
        qkv_stride: cd as u32,
        a: &a_b,
        a_off: 0,
        a_stride: hv as u32,
        b: &b_b,
        b_off: 0,
        b_stride: hv as u32,
        a_neg: &an_b,
        dt_bias: &dt_b,
        state: &st_b,
        state_off: 0,
        o: &o_b,
        o_off: 0,
        o_stride: ov as u32,
    };
    let gn = GatedNorm {
        z: &z_b,
        z_off: 0,
        z_stride: ov as u32,
        w: &nw_b,
        eps: 1e-6,
    };
    let mut pass = gpu.pass();
    gdn::recurrent_normed(&mut pass, &s, &batch, &io, &gn)?;
    pass.submit()?;
    let o = gpu.read_f32(&o_b, 0, nt * ov)?;
    let st = gpu.read_f32(&st_b, 0, state0.len())?;
    let mut o_ref = vec![0f32; nt * ov];
    let mut st_ref = state0.clone();
    for (t, &slot) in slots.iter().enumerate() {
        let (mut g, mut beta) = (vec![0f32; hv], vec![0f32; hv]);
        let ab = t * hv..(t + 1) * hv;
        cgdn::gates(&a[ab.clone()], &b[ab], &a_neg, &dt_bias, &mut g, &mut beta);
        let sl = &mut st_ref[slot * s.state_len()..][..s.state_len()];
        let out = &mut o_ref[t * ov..][..ov];
        cgdn::recurrent(&s, &qkv[t * cd..][..cd], &g, &beta, sl, out);
    }
    let o_ref = ops::gated_rms_norm(&o_ref, &z, s.d_v, Some(&nw), 1e-6);
    let rel = |x: &[f32], r: &[f32]| -> (f64, usize) {
        let scale = r.iter().fold(1e-30f64, |m, &v| m.max(v.abs() as f64));
        x.iter()
            .zip(r)
            .enumerate()
            .map(|(i, (&a, &b))| ((a as f64 - b as f64).abs() / scale, i))
            .fold(
                (0.0, 0),
                |m, e| if e.0 > m.0 || e.0.is_nan() { e } else { m },
            )
    };
    let ((eo, io_), (es, is)) = (rel(&o, &o_ref), rel(&st, &st_ref));
    let worst = eo.max(es) / 1e-5;
    // NaN compares as a failure
    let detail = if eo.is_nan() || eo > 1e-5 {
        format!("output {io_} = {}, want {}", o[io_], o_ref[io_])
    } else if es.is_nan() || es > 1e-5 {
        format!("state {is} = {}, want {}", st[is], st_ref[is])
    } else {
        String::new()
    };
    Ok(Check {
        name: format!(
            "gdn recurrent + gated norm {}x{} heads, d_k {} d_v {} {:?}",
            s.n_head_k, s.n_head_v, s.d_k, s.d_v, s.map
        ),
        passed: detail.is_empty(),
        worst,
        rel_rms: eo,
        detail,
    })
}

/// The types the fused loads and the int8 kernels meet in released models.
const FUSED_TYPES: [DType; 8] = [
    DType::F32,
    DType::BF16,
    DType::Q4_0,
    DType::Q8_0,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::MXFP4,
];

/// The fused decode kernels: every prologue over [`FUSED_TYPES`] at odd sizes (1 and 3
/// tokens), the conv step, the int8-activation matvec (dense, accumulating and indexed) for
/// every type that has one, `qk_norm_rope`, `add_rms_norm` and the GDN step with its gated norm at
/// Qwen3.5's head sizes and odd ones; with `full` the 9B's product shapes (norm into
/// 12288x4096, SwiGLU into 4096x12288, int8 at both).
pub fn fused(gpu: &Gpu, full: bool, push: &mut dyn FnMut(&str, Result<Check>)) {
    let kinds = [
        ProKind::Norm { keep: false },
        ProKind::Norm { keep: true },
        ProKind::SwiGlu,
        ProKind::SwiGluGated,
        ProKind::SigmoidGate,
    ];
    for (i, dt) in FUSED_TYPES.into_iter().enumerate() {
        let cols = odd_cols(dt);
        for (k, &kind) in kinds.iter().enumerate() {
            for nt in [1, 3] {
                if nt > 1 && kind == ProKind::SigmoidGate {
                    continue;
                }
                let seed = 500 + (i * 10 + k) as u64;
                push(
                    &format!("matvec {} {dt}", kind.name()),
                    prologue(gpu, dt, kind, (37, cols, nt), seed),
                );
            }
        }
    }
    for (i, dt) in FUSED_TYPES.into_iter().enumerate() {
        for (nt, normed) in [(1, true), (1, false), (3, true)] {
            push(
                &format!("matvec swiglu store {dt}"),
                swiglu_store(
                    gpu,
                    dt,
                    (19, odd_cols(dt), nt),
                    normed,
                    false,
                    560 + i as u64,
                ),
            );
        }
        // Gemma's GeGLU store (its products read plain x)
        for nt in [1, 3] {
            push(
                &format!("matvec geglu store {dt}"),
                swiglu_store(gpu, dt, (19, odd_cols(dt), nt), false, true, 580 + i as u64),
            );
        }
    }
    for (i, dt) in FUSED_TYPES.into_iter().enumerate() {
        for nt in [1, 3] {
            let (k, c) = (odd_cols(dt), odd_cols(dt) + dt.block_size() as u64);
            push(
                &format!("matvec normed store {dt}"),
                normed_store(gpu, dt, (29, c, k, nt), 620 + i as u64),
            );
        }
    }
    // Qwen3.5-9B's ffn_down feeding the next layer's qkv at decode
    push(
        "matvec normed store Q4_K 9B",
        normed_store(gpu, DType::Q4_K, (12352, 4096, 12288, 1), 595),
    );
    // Qwen3.5-9B's gate+up at decode (the normed split of the big products)
    push(
        "matvec swiglu store Q4_K 9B",
        swiglu_store(gpu, DType::Q4_K, (12288, 4096, 1), true, false, 590),
    );
    for (i, dt) in [DType::Q4_K, DType::F32, DType::Q8_0]
        .into_iter()
        .enumerate()
    {
        for normed in [true, false] {
            push(
                &format!("matvec conv step {dt}"),
                conv_step(gpu, dt, (49, odd_cols(dt)), normed, 600 + i as u64),
            );
        }
    }
    for (i, dt) in FUSED_TYPES.into_iter().enumerate() {
        if !matvec::int8_x_supported(dt) {
            continue;
        }
        let seed = 700 + i as u64;
        push(
            &format!("matvec int8-x {dt}"),
            int8(gpu, dt, (37, odd_cols(dt), 1), false, seed),
        );
        push(
            &format!("matvec int8-x {dt} accumulate"),
            int8(gpu, dt, (45, odd_cols(dt), 3), true, seed + 50),
        );
        push(
            &format!("matvec int8-x indexed {dt}"),
            indexed(gpu, KernelPath::Matvec, dt, 2, i % 2 == 1, true, seed + 80),
        );
    }
    // Qwen3.5's attention head (256, 64 rotated) and odd heads
    for (i, shape) in [(16, 4, 256, 64), (3, 1, 40, 8), (4, 2, 16, 4)]
        .into_iter()
        .enumerate()
    {
        push(
            &format!("qk_norm_rope {shape:?}"),
            qk_norm_rope(gpu, shape, 650 + i as u64),
        );
    }
    // Gemma-4's heads (256 sliding; 512 global, proportional RoPE on a quarter, V = K) and odd
    // ones
    for (i, (shape, v_is_k)) in [
        ((16, 8, 256, 128), false),
        ((16, 4, 512, 64), true),
        ((3, 1, 302, 75), false),
    ]
    .into_iter()
    .enumerate()
    {
        push(
            &format!("qk_norm_rope kv {shape:?}"),
            qk_norm_rope_kv(gpu, shape, v_is_k, 655 + i as u64),
        );
    }
    // Gemma's sandwich norms at Gemma-4's widths (31B, 26B-A4B) and odd ones
    for (i, (shape, branches)) in [
        ((1, 5376), 1),
        ((1, 2816), 2),
        ((3, 5376), 0),
        ((2, 1001), 2),
        ((3, 7), 1),
    ]
    .into_iter()
    .enumerate()
    {
        push(
            &format!("sandwich norm {shape:?} branches {branches}"),
            sandwich_norm(gpu, shape, branches, 660 + i as u64),
        );
    }
    // the model widths (Qwen3.5-9B, 35B-A3B, DeepSeek-V4-Flash; 9216: past the elements
    // the threads keep in registers), and odd rows
    for (i, shape) in [
        (1, 4096, 0),
        (3, 2048, 4),
        (2, 7168, 8),
        (2, 9216, 4),
        (3, 1001, 3),
    ]
    .into_iter()
    .enumerate()
    {
        push(
            &format!("add_rms_norm {shape:?}"),
            add_rms_norm(gpu, shape, 640 + i as u64),
        );
    }
    // DeepSeek-V4's decode rows: head 512 (Flash's), lists of one and of many splits; odd heads
    for (i, (shape, lens)) in [
        ((8, 512), &[1u32, 640, 37][..]),
        ((3, 40), &[5, 300, 66, 2][..]),
    ]
    .into_iter()
    .enumerate()
    {
        push(
            &format!("attention rows {shape:?}"),
            attention_rows(gpu, shape, lens, 670 + i as u64),
        );
    }
    {
        use crate::gpu::gdn::{GdnShape, KeyHeadMap};
        // Qwen3.5-9B's GDN heads, and odd ones
        for (i, (n_head_k, n_head_v, d_k, d_v, map)) in [
            (16, 32, 128, 128, KeyHeadMap::Tile),
            (3, 6, 12, 40, KeyHeadMap::Repeat),
            (1, 2, 16, 16, KeyHeadMap::Tile),
        ]
        .into_iter()
        .enumerate()
        {
            let s = GdnShape {
                n_head_k,
                n_head_v,
                d_k,
                d_v,
                map,
            };
            push(
                &format!("gdn recurrent + gated norm {s:?}"),
                gdn_normed(gpu, s, 660 + i as u64),
            );
        }
    }
    if full {
        for (i, dt) in [DType::Q4_K, DType::Q6_K, DType::Q8_0, DType::BF16]
            .into_iter()
            .enumerate()
        {
            let seed = 800 + 10 * i as u64;
            push(
                &format!("matvec rms_norm {dt} 12288x4096"),
                prologue(
                    gpu,
                    dt,
                    ProKind::Norm { keep: false },
                    (12288, 4096, 1),
                    seed,
                ),
            );
            push(
                &format!("matvec swiglu {dt} 4096x12288"),
                prologue(gpu, dt, ProKind::SwiGlu, (4096, 12288, 1), seed + 1),
            );
            push(
                &format!("matvec swiglu store normed {dt} 24576x4096"),
                swiglu_store(gpu, dt, (12288, 4096, 1), true, false, seed + 5),
            );
            // Gemma-4-31B's gate+up at decode
            push(
                &format!("matvec geglu store {dt} 43008x5376"),
                swiglu_store(gpu, dt, (21504, 5376, 1), false, true, seed + 6),
            );
            if matvec::int8_x_supported(dt) {
                for (k, &(rows, cols)) in REAL[..2].iter().enumerate() {
                    push(
                        &format!("matvec int8-x {dt} {rows}x{cols}"),
                        int8(gpu, dt, (rows, cols, 1), false, seed + 2 + k as u64),
                    );
                }
            }
        }
    }
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
        paths.push(KernelPath::CoopSplitX);
        paths.push(KernelPath::CoopXSplit);
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
            indexed(gpu, KernelPath::Matvec, dt, 2, i % 2 == 1, false, seed),
        );
        // the XSPLIT tile is dense only: its MoE products are coop-split's
        for &p in paths
            .iter()
            .filter(|&&p| runs(p, dt) && p != KernelPath::CoopXSplit)
        {
            push(
                &format!("{} indexed {dt}", p.name()),
                indexed(gpu, p, dt, 70, i % 2 == 1, false, seed),
            );
            // few pairs per expert: thin tiles
            push(
                &format!("{} indexed {dt} few pairs", p.name()),
                indexed(gpu, p, dt, FEW_PAIRS_TOKENS, i % 2 == 0, false, seed + 50),
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
    for (i, shape) in [(3, 1001), (64, 4096)].into_iter().enumerate() {
        for (name, c) in gated_activations(gpu, shape, 900 + i as u64) {
            push(&name, c);
        }
    }
    fused(gpu, full, &mut push);
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
