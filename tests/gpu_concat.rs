//! `Gpu::upload_concat`: weights concatenated by rows into one tensor (split into parts by
//! whole rows), bytes as stored, and a product over the concatenation equal to the members'
//! own products. Row lengths include stored rows that are not a multiple of 4 bytes (Q8_0
//! with 32 columns: 34 bytes), which the upload must still place byte-exactly.

use lathe::gpu::operand::Operand;
use lathe::gpu::{matvec, AdapterChoice, Gpu, GpuTensor};
use lathe::tensor::TensorRef;
use lathe::DType;
use std::path::Path;

fn gpu() -> Gpu {
    Gpu::new(&AdapterChoice::Auto).expect("a wgpu adapter (lavapipe in CI)")
}

/// xorshift64*: deterministic test data in [-1, 1).
struct Rng(u64);
impl Rng {
    fn f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

struct Member {
    name: String,
    shape: [u64; 2],
    bytes: Vec<u8>,
}

impl Member {
    fn tref(&self, dtype: DType) -> TensorRef<'_> {
        TensorRef {
            name: &self.name,
            dtype,
            shape: &self.shape,
            data: &self.bytes,
            path: Path::new("(test)"),
        }
    }
}

fn members(dtype: DType, cols: u64, rows: &[u64], rng: &mut Rng) -> Vec<Member> {
    rows.iter()
        .enumerate()
        .map(|(i, &r)| {
            let w: Vec<f32> = (0..r * cols).map(|_| rng.f32()).collect();
            Member {
                name: format!("blk.0.m{i}.weight"),
                shape: [r, cols],
                bytes: lathe::quant::quantize(dtype, &w).unwrap(),
            }
        })
        .collect()
}

/// y = W x for two tokens; returns [2, rows].
fn product(gpu: &Gpu, w: &GpuTensor, x: &[f32]) -> Vec<f32> {
    let rows = w.shape[0] as usize;
    let xb = gpu.upload_f32(x, "x").unwrap();
    let yb = gpu.buffer((2 * rows * 4) as u64, "y").unwrap();
    let mut pass = gpu.pass();
    matvec::matvec(&mut pass, w, Operand::new(&xb, 0), Operand::new(&yb, 0), 2).unwrap();
    pass.submit().unwrap();
    gpu.read_f32(&yb, 0, 2 * rows).unwrap()
}

#[test]
fn concat_bytes_parts_and_products() {
    let gpu = gpu();
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let rows = [3u64, 1, 7, 2];
    for (dtype, cols) in [
        (DType::F32, 33),
        (DType::F32, 256),
        (DType::Q8_0, 32),
        (DType::Q8_0, 96),
        (DType::Q4_K, 256),
    ] {
        let ms = members(dtype, cols, &rows, &mut rng);
        let refs: Vec<TensorRef<'_>> = ms.iter().map(|m| m.tref(dtype)).collect();
        let all: Vec<u8> = ms.iter().flat_map(|m| m.bytes.iter().copied()).collect();
        let row_bytes = refs[0].row_bytes() as u64;
        let n_rows: u64 = rows.iter().sum();
        // Whole, and split 3 rows a part (the 5 extra bytes must not split a row).
        for (what, t) in [
            ("one part", gpu.upload_concat(&refs, "cat").unwrap()),
            (
                "3-row parts",
                gpu.upload_concat_parts(&refs, "cat", 3 * row_bytes + 5)
                    .unwrap(),
            ),
        ] {
            let label = format!("{dtype} x {cols} {what}");
            assert_eq!(t.shape, vec![n_rows, cols], "{label}: shape");
            assert_eq!(t.dtype, dtype, "{label}: dtype");
            let mut next = 0;
            for p in &t.parts {
                assert_eq!(p.row_start, next, "{label}: parts not consecutive");
                assert!(what == "one part" || p.n_rows <= 3, "{label}: part too big");
                let (a, b) = (
                    p.row_start * row_bytes,
                    (p.row_start + p.n_rows) * row_bytes,
                );
                let got = gpu.read_bytes(&p.buffer, 0, b - a).unwrap();
                assert!(
                    got == all[a as usize..b as usize],
                    "{label}: bytes of rows {}..{} differ",
                    p.row_start,
                    p.row_start + p.n_rows
                );
                next += p.n_rows;
            }
            assert_eq!(next, n_rows, "{label}: parts cover {next} rows");
            // One product over the concatenation = each member's own product, and both
            // match the f64 reference on the dequantized weights.
            let x: Vec<f32> = (0..2 * cols).map(|_| rng.f32()).collect();
            let y = product(&gpu, &t, &x);
            let mut r0 = 0usize;
            for m in &ms {
                let own = gpu.upload_tensor(&m.tref(dtype)).unwrap();
                let ym = product(&gpu, &own, &x);
                let w =
                    lathe::quant::dequantize_to_vec(dtype, &m.bytes, (m.shape[0] * cols) as usize)
                        .unwrap();
                let nr = m.shape[0] as usize;
                for tok in 0..2 {
                    for r in 0..nr {
                        let c = cols as usize;
                        let want: f64 = (0..c)
                            .map(|j| w[r * c + j] as f64 * x[tok * c + j] as f64)
                            .sum();
                        let cat = y[tok * n_rows as usize + r0 + r];
                        let alone = ym[tok * nr + r];
                        assert!(
                            (cat - alone).abs() <= 1e-6 * (1.0 + alone.abs()),
                            "{label}: {} row {r} token {tok}: concatenated {cat}, alone {alone}",
                            m.name
                        );
                        assert!(
                            (cat as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{label}: {} row {r} token {tok}: {cat}, reference {want}",
                            m.name
                        );
                    }
                }
                r0 += nr;
            }
        }
    }
}

#[test]
fn concat_rejects_mismatches() {
    let gpu = gpu();
    let mut rng = Rng(7);
    let a = members(DType::F32, 64, &[2], &mut rng);
    let b = members(DType::Q8_0, 64, &[2], &mut rng);
    let c = members(DType::F32, 32, &[2], &mut rng);
    let err = |r: lathe::Result<GpuTensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
    let e = err(gpu.upload_concat(&[a[0].tref(DType::F32), b[0].tref(DType::Q8_0)], "x"));
    assert!(
        e.contains("blk.0.m0.weight") && e.contains("Q8_0"),
        "type mismatch: {e:?}"
    );
    let e = err(gpu.upload_concat(&[a[0].tref(DType::F32), c[0].tref(DType::F32)], "x"));
    assert!(e.contains("[2, 32]"), "width mismatch: {e:?}");
    assert!(!err(gpu.upload_concat(&[], "x")).is_empty(), "empty list");
}
