//! `elementwise::moe_combine` (all k expert slots in one dispatch) against k `axpy_row`
//! dispatches (what it replaces in the MoE forwards) and a CPU reference, with y inside a
//! larger buffer at an offset and row stride whose other elements must stay untouched.
//! Sizes: odd (3 rows × 33, k 1 / 3) and real (Qwen3.5-35B-A3B: 2048 wide, k 8; 7 rows).

use lathe::gpu::elementwise as ew;
use lathe::gpu::operand::Operand;
use lathe::gpu::{AdapterChoice, Gpu};

const GUARD: f32 = -7777.25;

struct Rng(u64);
impl Rng {
    fn f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

#[test]
fn moe_combine_matches_axpy_rows() {
    let gpu = Gpu::new(&AdapterChoice::Auto).expect("a wgpu adapter (lavapipe in CI)");
    let mut rng = Rng(0x5eed);
    for (n, e, k) in [(3u32, 33u32, 1u32), (3, 33, 3), (7, 2048, 8)] {
        let (nu, eu, ku) = (n as usize, e as usize, k as usize);
        // y: rows of e at offset 5, stride e + 3; guards everywhere else.
        let (y_off, y_stride) = (5usize, eu + 3);
        let mut y0 = vec![GUARD; y_off + nu * y_stride + 2];
        for r in 0..nu {
            for c in 0..eu {
                y0[y_off + r * y_stride + c] = rng.f32();
            }
        }
        let x: Vec<f32> = (0..nu * ku * eu).map(|_| rng.f32()).collect();
        let w: Vec<f32> = (0..nu * ku).map(|_| rng.f32()).collect();
        let xb = gpu.upload_f32(&x, "x").unwrap();
        let wb = gpu.upload_f32(&w, "w").unwrap();
        let run = |fused: bool| {
            let yb = gpu.upload_f32(&y0, "y").unwrap();
            let yv = Operand::strided(&yb, y_off as u32, y_stride as u32);
            let mut pass = gpu.pass();
            if fused {
                ew::moe_combine(
                    &mut pass,
                    n,
                    e,
                    k,
                    yv,
                    Operand::new(&wb, 0),
                    Operand::new(&xb, 0),
                )
                .unwrap();
            } else {
                for s in 0..k {
                    ew::axpy_row(
                        &mut pass,
                        n,
                        e,
                        yv,
                        Operand::strided(&wb, s, k),
                        Operand::strided(&xb, s * e, k * e),
                    )
                    .unwrap();
                }
            }
            pass.submit().unwrap();
            gpu.read_f32(&yb, 0, y0.len()).unwrap()
        };
        let (fused, slots) = (run(true), run(false));
        let what = format!("moe_combine {n} x {e}, k {k}");
        for (i, (&f, &a)) in fused.iter().zip(&slots).enumerate() {
            let (r, c) = (
                i.saturating_sub(y_off) / y_stride,
                i.saturating_sub(y_off) % y_stride,
            );
            if i < y_off || r >= nu || c >= eu {
                assert_eq!(f, GUARD, "{what}: element {i} outside y changed");
                continue;
            }
            let want: f64 = y0[i] as f64
                + (0..ku)
                    .map(|s| w[r * ku + s] as f64 * x[(r * ku + s) * eu + c] as f64)
                    .sum::<f64>();
            assert!(
                (f - a).abs() <= 1e-6 * (1.0 + a.abs()),
                "{what}: row {r} col {c}: fused {f}, slot by slot {a}"
            );
            assert!(
                (f as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "{what}: row {r} col {c}: {f}, reference {want}"
            );
        }
    }
}

#[test]
fn moe_combine_checks_bounds() {
    let gpu = Gpu::new(&AdapterChoice::Auto).expect("a wgpu adapter (lavapipe in CI)");
    let y = gpu.buffer(4 * 16, "y").unwrap();
    let w = gpu.buffer(4 * 4, "w").unwrap();
    let x = gpu.buffer(4 * 16 * 3, "x").unwrap(); // 3 of the 4 slots
    let mut pass = gpu.pass();
    let e = ew::moe_combine(
        &mut pass,
        1,
        16,
        4,
        Operand::new(&y, 0),
        Operand::new(&w, 0),
        Operand::new(&x, 0),
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(e.contains("moe_combine") && e.contains("x"), "{e:?}");
}
