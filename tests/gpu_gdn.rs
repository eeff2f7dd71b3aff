//! Gated DeltaNet kernels (gpu::conv, gpu::gdn) against the f64 CPU references (cpu::gdn).
//!
//! Tolerances, as max |gpu − ref| / max |ref| over each output tensor and the final states:
//! the recurrent kernel ≤ 1e-5; the chunked kernel ≤ 1e-4 (its in-chunk decays come from
//! differences of cumulative gates, as in HF's chunk_gated_delta_rule); conv ≤ 1e-6.

use lathe::cpu::gdn as cpu;
use lathe::gpu::conv::{conv1d_silu, ConvIo};
use lathe::gpu::gdn::{self, GdnIo, GdnShape, KeyHeadMap, SeqBatch, SeqSpan};
use lathe::gpu::{AdapterChoice, Gpu};

fn gpu() -> Gpu {
    Gpu::new(&AdapterChoice::Auto).expect("a wgpu adapter (lavapipe in CI)")
}

struct Rng(u64);
impl Rng {
    /// Uniform in [lo, hi).
    fn uni(&mut self, lo: f32, hi: f32) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        lo + (hi - lo) * ((self.0 >> 40) as f32 / (1u64 << 24) as f32)
    }
    fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uni(lo, hi)).collect()
    }
}

/// max |x − r| / max |r|.
fn rel_err(x: &[f32], r: &[f32]) -> f64 {
    assert_eq!(x.len(), r.len());
    let scale = r
        .iter()
        .fold(0f64, |m, &v| m.max(v.abs() as f64))
        .max(1e-30);
    x.iter()
        .zip(r)
        .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()))
        / scale
}

#[derive(Clone, Copy, PartialEq)]
enum Path {
    Recurrent,
    /// `recurrent_normed`: o is the gated RMSNorm of the step's output with [`Case::gates`].
    RecurrentNormed,
    Chunked,
    /// The chunked kernels' variants for adapters with 16 KiB of workgroup memory.
    Chunked16K,
}

/// Inputs of one batched GDN call, laid out with offsets and padded strides so that both
/// are exercised: qkv rows of conv_dim + 3 from element 5; a and b interleaved in one
/// buffer; o rows of Hv·d_v + 1 from element 7 (guards must stay zero); one state slot
/// more than sequences, left untouched.
struct Case {
    s: GdnShape,
    spans: Vec<SeqSpan>,
    rows: usize,
    qkv: Vec<f32>, // [rows, conv_dim]
    a: Vec<f32>,   // [rows, Hv]
    b: Vec<f32>,   // [rows, Hv]
    a_neg: Vec<f32>,
    dt_bias: Vec<f32>,
    state: Vec<f32>, // [slots, Hv, d_k, d_v]
}

const QKV_OFF: usize = 5;
const O_OFF: usize = 7;

impl Case {
    /// Sequences of the given lengths, each in slot (n_seq − i) of n_seq + 1 slots; gates in
    /// a realistic range (g ∈ (−2.2, 0), β ∈ (0.1, 0.9)); a nonzero initial state.
    fn new(s: GdnShape, lens: &[usize], seed: u64) -> Case {
        let mut rng = Rng(seed);
        let rows: usize = lens.iter().sum::<usize>() + 2;
        let mut spans = Vec::new();
        let mut row = 1; // row 0 and the last row belong to nobody
        for (i, &n) in lens.iter().enumerate() {
            spans.push(SeqSpan {
                row: row as u32,
                n_tokens: n as u32,
                slot: (lens.len() - i) as u32,
            });
            row += n;
        }
        let hv = s.n_head_v;
        Case {
            spans,
            rows,
            qkv: rng.vec(rows * s.conv_dim(), -1.0, 1.0),
            a: rng.vec(rows * hv, -1.0, 1.0),
            b: rng.vec(rows * hv, -2.0, 2.0),
            a_neg: (0..hv).map(|_| -rng.uni(-1.0, 2.0).exp()).collect(),
            dt_bias: rng.vec(hv, -6.0, -2.0),
            state: rng.vec((lens.len() + 1) * s.state_len(), -0.5, 0.5),
            s,
        }
    }

    /// CPU reference: (o [rows, Hv, d_v] with zeros outside the spans, final state pool).
    fn reference(&self) -> (Vec<f32>, Vec<f32>) {
        let (s, hv, cd) = (&self.s, self.s.n_head_v, self.s.conv_dim());
        let ov = hv * s.d_v;
        let mut o = vec![0f32; self.rows * ov];
        let mut state = self.state.clone();
        for sp in &self.spans {
            let (r0, n) = (sp.row as usize, sp.n_tokens as usize);
            let (mut g, mut beta) = (vec![0f32; n * hv], vec![0f32; n * hv]);
            cpu::gates(
                &self.a[r0 * hv..][..n * hv],
                &self.b[r0 * hv..][..n * hv],
                &self.a_neg,
                &self.dt_bias,
                &mut g,
                &mut beta,
            );
            let st = &mut state[sp.slot as usize * s.state_len()..][..s.state_len()];
            cpu::recurrent(
                s,
                &self.qkv[r0 * cd..][..n * cd],
                &g,
                &beta,
                st,
                &mut o[r0 * ov..][..n * ov],
            );
        }
        (o, state)
    }

    /// The gated norm's inputs: z [rows, Hv, d_v] and the weight [d_v].
    fn gates(&self) -> (Vec<f32>, Vec<f32>) {
        let mut rng = Rng(99);
        let ov = self.s.n_head_v * self.s.d_v;
        (
            rng.vec(self.rows * ov, -3.0, 3.0),
            rng.vec(self.s.d_v, -1.5, 1.5),
        )
    }

    /// Run on the GPU: (o [rows, Hv, d_v], guards intact, final state pool).
    fn run(&self, gpu: &Gpu, path: Path) -> (Vec<f32>, bool, Vec<f32>) {
        let (s, hv, cd) = (&self.s, self.s.n_head_v, self.s.conv_dim());
        let (qs, os) = (cd + 3, hv * s.d_v + 1);
        let mut qkv = vec![0f32; QKV_OFF + self.rows * qs];
        for r in 0..self.rows {
            qkv[QKV_OFF + r * qs..][..cd].copy_from_slice(&self.qkv[r * cd..][..cd]);
        }
        let mut ab = vec![0f32; self.rows * 2 * hv];
        for r in 0..self.rows {
            ab[r * 2 * hv..][..hv].copy_from_slice(&self.a[r * hv..][..hv]);
            ab[r * 2 * hv + hv..][..hv].copy_from_slice(&self.b[r * hv..][..hv]);
        }
        let qkv_b = gpu.upload_f32(&qkv, "qkv").unwrap();
        let ab_b = gpu.upload_f32(&ab, "ab").unwrap();
        let a_neg = gpu.upload_f32(&self.a_neg, "a_neg").unwrap();
        let dt = gpu.upload_f32(&self.dt_bias, "dt_bias").unwrap();
        let state = gpu.upload_f32(&self.state, "state").unwrap();
        let o_len = O_OFF + self.rows * os;
        let o = gpu.buffer(o_len as u64 * 4, "o").unwrap();
        let batch = SeqBatch::new(gpu, &self.spans).unwrap();
        let io = GdnIo {
            qkv: &qkv_b,
            qkv_off: QKV_OFF as u32,
            qkv_stride: qs as u32,
            a: &ab_b,
            a_off: 0,
            a_stride: 2 * hv as u32,
            b: &ab_b,
            b_off: hv as u32,
            b_stride: 2 * hv as u32,
            a_neg: &a_neg,
            dt_bias: &dt,
            state: &state,
            state_off: 0,
            o: &o,
            o_off: O_OFF as u32,
            o_stride: os as u32,
        };
        let mut pass = gpu.pass();
        match path {
            Path::Recurrent => gdn::recurrent(&mut pass, s, &batch, &io).unwrap(),
            Path::RecurrentNormed => {
                // z rows of Hv·d_v + 2 from element 1.
                let (z, w) = self.gates();
                let ov = hv * s.d_v;
                let mut zp = vec![0f32; 1 + self.rows * (ov + 2)];
                for r in 0..self.rows {
                    zp[1 + r * (ov + 2)..][..ov].copy_from_slice(&z[r * ov..][..ov]);
                }
                let zb = gpu.upload_f32(&zp, "z").unwrap();
                let wb = gpu.upload_f32(&w, "norm").unwrap();
                let gn = gdn::GatedNorm {
                    z: &zb,
                    z_off: 1,
                    z_stride: ov as u32 + 2,
                    w: &wb,
                    eps: NORM_EPS,
                };
                gdn::recurrent_normed(&mut pass, s, &batch, &io, &gn).unwrap();
            }
            Path::Chunked | Path::Chunked16K => {
                let scratch = gpu
                    .buffer(gdn::scratch_bytes(s, batch.total_chunks), "scratch")
                    .unwrap();
                let wg_mem = if path == Path::Chunked16K {
                    16384
                } else {
                    gpu.limits.max_compute_workgroup_storage_size as u64
                };
                let opts = gdn::ChunkOpts {
                    wg_mem,
                    prep: true,
                    scan: true,
                };
                gdn::chunked_with(&mut pass, s, &batch, &io, &scratch, &opts).unwrap();
            }
        }
        pass.submit().unwrap();
        let out = gpu.read_f32(&o, 0, o_len).unwrap();
        let st = gpu.read_f32(&state, 0, self.state.len()).unwrap();
        let mut guards = out[..O_OFF].iter().all(|&v| v == 0.0);
        let mut packed = vec![0f32; self.rows * (os - 1)];
        for r in 0..self.rows {
            packed[r * (os - 1)..][..os - 1].copy_from_slice(&out[O_OFF + r * os..][..os - 1]);
            guards &= out[O_OFF + r * os + os - 1] == 0.0;
        }
        (packed, guards, st)
    }

    fn check(&self, gpu: &Gpu, path: Path, tol: f64) {
        let (mut o_ref, st_ref) = self.reference();
        if path == Path::RecurrentNormed {
            let (z, w) = self.gates();
            let dv = self.s.d_v;
            let normed = lathe::cpu::ops::gated_rms_norm(&o_ref, &z, dv, Some(&w), NORM_EPS);
            // Rows of no sequence stay zero.
            let ov = self.s.n_head_v * dv;
            for sp in &self.spans {
                let r = sp.row as usize * ov..(sp.row + sp.n_tokens) as usize * ov;
                o_ref[r.clone()].copy_from_slice(&normed[r]);
            }
        }
        let (o, guards, st) = self.run(gpu, path);
        let (eo, es) = (rel_err(&o, &o_ref), rel_err(&st, &st_ref));
        let what = format!(
            "{:?} {} lens {:?}",
            self.s,
            match path {
                Path::Recurrent => "recurrent",
                Path::RecurrentNormed => "recurrent + gated norm",
                Path::Chunked => "chunked",
                Path::Chunked16K => "chunked (16 KiB variants)",
            },
            self.spans.iter().map(|s| s.n_tokens).collect::<Vec<_>>()
        );
        eprintln!("{what}: o err {eo:.2e}, state err {es:.2e}");
        assert!(guards, "{what}: wrote outside its output rows");
        assert!(
            eo <= tol && es <= tol,
            "{what}: o err {eo:.2e}, state err {es:.2e} > {tol:.0e}"
        );
        // The slot no sequence uses (slot 0) is unchanged.
        let n = self.s.state_len();
        assert_eq!(&st[..n], &self.state[..n], "{what}: unused slot changed");
    }
}

fn shape(n_head_k: usize, n_head_v: usize, d: usize, map: KeyHeadMap) -> GdnShape {
    GdnShape {
        n_head_k,
        n_head_v,
        d_k: d,
        d_v: d,
        map,
    }
}

#[test]
fn conv_prefill_matches_cpu_and_steps() {
    let gpu = gpu();
    let (c, k) = (37usize, 4usize);
    let lens = [7usize, 1, 2];
    let rows = 12;
    let mut rng = Rng(3);
    let x = rng.vec(rows * c, -2.0, 2.0);
    let w = rng.vec(c * k, -1.0, 1.0);
    let state0 = rng.vec(4 * (k - 1) * c, -1.0, 1.0);
    let mut spans = Vec::new();
    let mut row = 1;
    for (i, &n) in lens.iter().enumerate() {
        spans.push(SeqSpan {
            row,
            n_tokens: n as u32,
            slot: 3 - i as u32,
        });
        row += n as u32;
    }
    // CPU reference.
    let mut y_ref = vec![0f32; rows * c];
    let mut st_ref = state0.clone();
    for sp in &spans {
        let (r0, n) = (sp.row as usize, sp.n_tokens as usize);
        let st = &mut st_ref[sp.slot as usize * (k - 1) * c..][..(k - 1) * c];
        cpu::conv1d(
            &x[r0 * c..][..n * c],
            &w,
            k,
            st,
            &mut y_ref[r0 * c..][..n * c],
        );
    }
    let xb = gpu.upload_f32(&x, "x").unwrap();
    let wb = gpu.upload_f32(&w, "w").unwrap();
    let run = |steps: bool| {
        let state = gpu.upload_f32(&state0, "conv_state").unwrap();
        // y rows of c + 2 from element 3.
        let y = gpu.buffer((3 + rows * (c + 2)) as u64 * 4, "y").unwrap();
        let io = ConvIo {
            x: &xb,
            x_off: 0,
            x_stride: c as u32,
            w: &wb,
            state: &state,
            state_off: 0,
            y: &y,
            y_off: 3,
            y_stride: c as u32 + 2,
        };
        if steps {
            // Token by token, each step its own one-token batch (as decode runs).
            for t in 0..7u32 {
                let sub: Vec<SeqSpan> = spans
                    .iter()
                    .filter(|s| t < s.n_tokens)
                    .map(|s| SeqSpan {
                        row: s.row + t,
                        n_tokens: 1,
                        slot: s.slot,
                    })
                    .collect();
                let batch = SeqBatch::new(&gpu, &sub).unwrap();
                let mut pass = gpu.pass();
                conv1d_silu(&mut pass, c as u32, k as u32, &batch, &io).unwrap();
                pass.submit().unwrap();
            }
        } else {
            let batch = SeqBatch::new(&gpu, &spans).unwrap();
            let mut pass = gpu.pass();
            conv1d_silu(&mut pass, c as u32, k as u32, &batch, &io).unwrap();
            pass.submit().unwrap();
        }
        let yv = gpu.read_f32(&y, 0, 3 + rows * (c + 2)).unwrap();
        let mut packed = vec![0f32; rows * c];
        let mut guards = yv[..3].iter().all(|&v| v == 0.0);
        for r in 0..rows {
            packed[r * c..][..c].copy_from_slice(&yv[3 + r * (c + 2)..][..c]);
            guards &= yv[3 + r * (c + 2) + c..][..2].iter().all(|&v| v == 0.0);
        }
        (
            packed,
            guards,
            gpu.read_f32(&state, 0, state0.len()).unwrap(),
        )
    };
    let (y_pre, g1, st_pre) = run(false);
    let (y_step, g2, st_step) = run(true);
    assert!(g1 && g2, "conv wrote outside its rows");
    let e = rel_err(&y_pre, &y_ref);
    assert!(e <= 1e-6, "conv prefill vs cpu: {e:.2e}");
    assert!(rel_err(&y_step, &y_pre) <= 1e-6, "conv steps vs prefill");
    assert_eq!(st_pre, st_ref, "conv state after prefill");
    assert_eq!(st_step, st_ref, "conv state after steps");
}

#[test]
fn recurrent_matches_cpu() {
    let gpu = gpu();
    for (s, lens) in [
        (shape(2, 4, 128, KeyHeadMap::Repeat), vec![3, 1]),
        (shape(2, 4, 128, KeyHeadMap::Tile), vec![3, 1]),
        (shape(1, 2, 16, KeyHeadMap::Repeat), vec![9, 0, 2]),
        (shape(1, 2, 16, KeyHeadMap::Tile), vec![1]),
        // Sizes that are no multiple of the column block or of 4.
        (
            GdnShape {
                n_head_k: 3,
                n_head_v: 6,
                d_k: 12,
                d_v: 40,
                map: KeyHeadMap::Repeat,
            },
            vec![5, 2],
        ),
    ] {
        Case::new(s, &lens, 11).check(&gpu, Path::Recurrent, 1e-5);
    }
}

const NORM_EPS: f32 = 1e-6;

/// The decode step with Qwen3.5's gated output norm fused (one token per sequence, an empty
/// sequence, odd sizes): against the CPU, and bit for bit against `recurrent` followed by
/// `norm::gated_rms_norm` on the GPU.
#[test]
fn recurrent_normed_matches_cpu_and_unfused() {
    use lathe::gpu::operand::Operand;
    let gpu = gpu();
    for (s, lens) in [
        (shape(2, 4, 128, KeyHeadMap::Repeat), vec![1, 1]),
        (shape(1, 2, 16, KeyHeadMap::Tile), vec![1, 0, 1]),
        (
            GdnShape {
                n_head_k: 3,
                n_head_v: 6,
                d_k: 12,
                d_v: 40,
                map: KeyHeadMap::Repeat,
            },
            vec![1, 1, 1],
        ),
    ] {
        let c = Case::new(s, &lens, 17);
        c.check(&gpu, Path::RecurrentNormed, 1e-5);
        // The unfused pair on the GPU: the same bits.
        let (fused, _, st_fused) = c.run(&gpu, Path::RecurrentNormed);
        let (plain, _, st_plain) = c.run(&gpu, Path::Recurrent);
        assert_eq!(st_fused, st_plain, "{s:?}: states differ");
        let (z, w) = c.gates();
        let ov = s.n_head_v * s.d_v;
        let ob = gpu.upload_f32(&plain, "o").unwrap();
        let zb = gpu.upload_f32(&z, "z").unwrap();
        let wt = gpu
            .upload_tensor(&lathe::tensor::TensorRef {
                name: "norm",
                dtype: lathe::DType::F32,
                shape: &[s.d_v as u64],
                data: bytemuck::cast_slice(&w),
                path: std::path::Path::new("test"),
            })
            .unwrap();
        let mut pass = gpu.pass();
        let rms = lathe::gpu::norm::Rms {
            n_rows: (c.rows * s.n_head_v) as u32,
            dim: s.d_v as u32,
            eps: NORM_EPS,
        };
        let (o, z) = (Operand::new(&ob, 0), Operand::new(&zb, 0));
        lathe::gpu::norm::gated_rms_norm(&mut pass, rms, o, z, None, Some(&wt)).unwrap();
        pass.submit().unwrap();
        let unfused = gpu.read_f32(&ob, 0, c.rows * ov).unwrap();
        for sp in &c.spans {
            let r = sp.row as usize * ov..(sp.row + sp.n_tokens) as usize * ov;
            let same = fused[r.clone()]
                .iter()
                .zip(&unfused[r])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{s:?}: fused norm differs from recurrent + gated_rms_norm"
            );
        }
    }
}

#[test]
fn chunked_matches_recurrent_over_chunk_boundaries() {
    let gpu = gpu();
    for (i, &t) in [1usize, 5, 63, 64, 65, 200, 300].iter().enumerate() {
        // Two sequences batched: t tokens and a short one, from nonzero states.
        let map = if i % 2 == 0 {
            KeyHeadMap::Tile
        } else {
            KeyHeadMap::Repeat
        };
        Case::new(shape(2, 4, 128, map), &[t, 37], 100 + t as u64).check(&gpu, Path::Chunked, 1e-4);
    }
    for map in [KeyHeadMap::Repeat, KeyHeadMap::Tile] {
        Case::new(shape(1, 2, 16, map), &[300, 64, 1], 7).check(&gpu, Path::Chunked, 1e-4);
    }
    let odd = GdnShape {
        n_head_k: 3,
        n_head_v: 6,
        d_k: 12,
        d_v: 40,
        map: KeyHeadMap::Tile,
    };
    Case::new(odd, &[130, 3], 5).check(&gpu, Path::Chunked, 1e-4);
    Case::new(odd, &[130, 3], 5).check(&gpu, Path::Chunked16K, 1e-4);
    Case::new(shape(2, 4, 128, KeyHeadMap::Repeat), &[70, 9], 6).check(
        &gpu,
        Path::Chunked16K,
        1e-4,
    );
}

#[test]
fn chunked_strong_and_weak_decay() {
    // Gates far outside the usual range: g down to about −35 per token (state forgotten at
    // once, cumulative gates near −1000 within a chunk) and g ≈ −1e-4 (no forgetting).
    let gpu = gpu();
    let s = shape(2, 4, 64, KeyHeadMap::Tile);
    let mut strong = Case::new(s, &[150, 20], 41);
    let mut rng = Rng(42);
    strong.a_neg = (0..4).map(|_| -rng.uni(1.0, 16.0)).collect();
    strong.dt_bias = rng.vec(4, 0.0, 1.0);
    strong.check(&gpu, Path::Chunked, 1e-4);
    let mut weak = Case::new(s, &[150, 20], 43);
    weak.a_neg = vec![-1e-2; 4];
    weak.dt_bias = vec![-5.0; 4];
    weak.check(&gpu, Path::Chunked, 1e-4);
}

#[test]
fn real_size_one_step() {
    let gpu = gpu();
    for map in [KeyHeadMap::Repeat, KeyHeadMap::Tile] {
        let c = Case::new(shape(16, 32, 128, map), &[1, 1], 21);
        c.check(&gpu, Path::Recurrent, 1e-5);
        c.check(&gpu, Path::Chunked, 1e-4);
    }
}

#[test]
#[ignore = "slow on lavapipe: real head sizes over 4 chunks and d = 256"]
fn chunked_real_size_long() {
    let gpu = gpu();
    Case::new(shape(16, 32, 128, KeyHeadMap::Tile), &[256, 17], 31).check(
        &gpu,
        Path::Chunked,
        1e-4,
    );
    Case::new(shape(1, 2, 256, KeyHeadMap::Repeat), &[300], 32).check(&gpu, Path::Chunked, 1e-4);
    Case::new(shape(1, 2, 256, KeyHeadMap::Repeat), &[100], 34).check(&gpu, Path::Chunked16K, 1e-4);
    Case::new(shape(1, 2, 256, KeyHeadMap::Repeat), &[20], 33).check(&gpu, Path::Recurrent, 1e-5);
}

/// Timing on whatever adapter runs it (`cargo test --test gpu_gdn bench -- --ignored
/// --nocapture`): real head sizes (Hk 16, Hv 32, d 128), one layer.
#[test]
#[ignore = "a timing, not a check"]
fn bench_real_size() {
    use std::time::Instant;
    let gpu = gpu();
    eprintln!("{}", gpu.report());
    let s = shape(16, 32, 128, KeyHeadMap::Tile);
    let (hv, cd) = (s.n_head_v, s.conv_dim());
    // GPU time ≈ from the submit to the end of the wait (one round trip amortised over the
    // reps); CPU time = recording and encoding the reps.
    let time = |label: &str, reps: usize, bytes: f64, f: &dyn Fn(&mut lathe::gpu::Pass<'_>)| {
        let mut pass = gpu.pass();
        f(&mut pass);
        pass.submit().unwrap();
        gpu.wait().unwrap();
        let t0 = Instant::now();
        let mut pass = gpu.pass();
        for _ in 0..reps {
            f(&mut pass);
        }
        pass.submit().unwrap();
        let t1 = Instant::now();
        gpu.wait().unwrap();
        let gpu_us = t1.elapsed().as_secs_f64() * 1e6 / reps as f64;
        let cpu_us = (t1 - t0).as_secs_f64() * 1e6 / reps as f64;
        eprintln!(
            "{label}: gpu {gpu_us:.1} us, cpu {cpu_us:.1} us per call; {:.0} GB/s",
            bytes / gpu_us * 1e-3
        );
    };
    for (n_seq, t) in [(1usize, 1usize), (8, 1), (1, 512), (1, 4096)] {
        let rows = n_seq * t;
        let mut rng = Rng(1);
        let qkv = gpu
            .upload_f32(&rng.vec(rows * cd, -1.0, 1.0), "qkv")
            .unwrap();
        let x = gpu.upload_f32(&rng.vec(rows * cd, -1.0, 1.0), "x").unwrap();
        let w = gpu.upload_f32(&rng.vec(cd * 4, -1.0, 1.0), "w").unwrap();
        let conv_state = gpu
            .buffer((n_seq * 3 * cd * 4) as u64, "conv_state")
            .unwrap();
        let ab = gpu
            .upload_f32(&rng.vec(rows * hv, -1.0, 1.0), "ab")
            .unwrap();
        let a_neg = gpu.upload_f32(&vec![-1.0; hv], "a_neg").unwrap();
        let dt = gpu.upload_f32(&vec![-4.0; hv], "dt").unwrap();
        let state = gpu
            .upload_f32(&rng.vec(n_seq * s.state_len(), -0.5, 0.5), "state")
            .unwrap();
        let o = gpu.buffer((rows * hv * s.d_v * 4) as u64, "o").unwrap();
        let spans: Vec<SeqSpan> = (0..n_seq)
            .map(|i| SeqSpan {
                row: (i * t) as u32,
                n_tokens: t as u32,
                slot: i as u32,
            })
            .collect();
        let batch = SeqBatch::new(&gpu, &spans).unwrap();
        let scratch_len = gdn::scratch_bytes(&s, batch.total_chunks).min(gpu.max_binding());
        let scratch = gpu.buffer(scratch_len, "scratch").unwrap();
        let io = GdnIo {
            qkv: &qkv,
            qkv_off: 0,
            qkv_stride: cd as u32,
            a: &ab,
            a_off: 0,
            a_stride: hv as u32,
            b: &ab,
            b_off: 0,
            b_stride: hv as u32,
            a_neg: &a_neg,
            dt_bias: &dt,
            state: &state,
            state_off: 0,
            o: &o,
            o_off: 0,
            o_stride: (hv * s.d_v) as u32,
        };
        let cio = ConvIo {
            x: &x,
            x_off: 0,
            x_stride: cd as u32,
            w: &w,
            state: &conv_state,
            state_off: 0,
            y: &qkv,
            y_off: 0,
            y_stride: cd as u32,
        };
        // State read + written, plus the activations once.
        let bytes = (n_seq * s.state_len() * 8 + rows * (cd + hv * s.d_v) * 4) as f64;
        let reps = if t > 1000 {
            5
        } else if t > 1 {
            20
        } else {
            200
        };
        let what = format!("n_seq {n_seq} T {t}");
        time(
            &format!("{what} conv"),
            reps,
            (rows * cd * 8) as f64,
            &|p| conv1d_silu(p, cd as u32, 4, &batch, &cio).unwrap(),
        );
        if t <= 512 {
            time(&format!("{what} recurrent"), reps, bytes, &|p| {
                gdn::recurrent(p, &s, &batch, &io).unwrap()
            });
        }
        if gdn::scratch_bytes(&s, batch.total_chunks) <= gpu.max_binding() {
            time(&format!("{what} chunked"), reps, bytes, &|p| {
                gdn::chunked(p, &s, &batch, &io, &scratch).unwrap()
            });
            let wg_mem = gpu.limits.max_compute_workgroup_storage_size as u64;
            for (part, prep) in [("prep", true), ("scan", false)] {
                let opts = gdn::ChunkOpts {
                    wg_mem,
                    prep,
                    scan: !prep,
                };
                time(&format!("{what} chunked, {part} only"), reps, bytes, &|p| {
                    gdn::chunked_with(p, &s, &batch, &io, &scratch, &opts).unwrap()
                });
            }
        }
    }
}

/// Every variant these kernels compile also translates to SPIR-V, MSL and HLSL (the Metal
/// and DX12 back ends), as `tests/shaders.rs` checks for the variants a model run uses.
#[test]
fn variants_translate_to_every_backend() {
    let gpu = gpu();
    let s = shape(1, 2, 128, KeyHeadMap::Tile);
    for path in [Path::Recurrent, Path::Chunked, Path::Chunked16K] {
        Case::new(s, &[3], 1).run(&gpu, path);
    }
    let specs: Vec<_> = gpu
        .compiled_specs()
        .into_iter()
        .filter(|sp| sp.label.starts_with("gdn_"))
        .collect();
    assert_eq!(specs.len(), 5, "recurrent, prep and scan in two variants");
    for spec in specs {
        let wgsl = spec.wgsl().unwrap();
        let module = naga::front::wgsl::parse_str(&wgsl).unwrap();
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap();
        naga::back::spv::write_vec(&module, &info, &Default::default(), None)
            .unwrap_or_else(|e| panic!("{}: SPIR-V: {e}", spec.label));
        let mut msl = String::new();
        naga::back::msl::Writer::new(&mut msl)
            .write(&module, &info, &Default::default(), &Default::default())
            .unwrap_or_else(|e| panic!("{}: MSL: {e}", spec.label));
        let mut hlsl = String::new();
        naga::back::hlsl::Writer::new(&mut hlsl, &Default::default(), &Default::default())
            .write(&module, &info, None)
            .unwrap_or_else(|e| panic!("{}: HLSL: {e}", spec.label));
    }
}
