//! lathe's FP8 block type `F8_E4M3_B128` against the release layout it is made from:
//! `safetensors::scaled::repack_fp8_block_to_b128` followed by the CPU reference
//! (`quant::dequantize`, `quant::dot`) must give exactly `dequant_fp8_block`'s values (bit for
//! bit: both round e4m3 × scale once to f32) for every scale type a release may carry, with
//! rows that end in a partial 128-row scale block; columns not a multiple of 128 are refused
//! with an error naming the tensor.

use lathe::quant;
use lathe::safetensors::dequant_fp8_block;
use lathe::safetensors::scaled::repack_fp8_block_to_b128;
use lathe::tensor::TensorRef;
use lathe::DType;
use std::path::{Path, PathBuf};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn byte(&mut self) -> u8 {
        (self.next() >> 24) as u8
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Random e4m3 codes without NaN (S.1111.111), the special codes in row 0.
fn codes(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut c: Vec<u8> = (0..n)
        .map(|_| rng.byte())
        .map(|b| if b & 0x7f == 0x7f { 0x3c } else { b })
        .collect();
    // +0, -0, smallest subnormal, largest subnormal, smallest normal, 448, -448
    c[..7].copy_from_slice(&[0x00, 0x80, 0x01, 0x87, 0x08, 0x7e, 0xfe]);
    c
}

/// Scale bytes of `n` blocks in `dtype`: powers of two for E8M0, arbitrary positive values
/// for the float types.
fn scales(rng: &mut Rng, dtype: DType, n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|_| {
            let v = 2f32.powf(rng.uniform() * 30.0 - 25.0);
            match dtype {
                DType::F32 => v.to_le_bytes().to_vec(),
                DType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                DType::F16 => half::f16::from_f32(v.max(1e-4)).to_le_bytes().to_vec(),
                DType::F8_E8M0 | DType::U8 => vec![100 + rng.byte() % 40],
                _ => unreachable!(),
            }
        })
        .collect()
}

fn tref<'a>(name: &'a str, dtype: DType, shape: &'a [u64], data: &'a [u8]) -> TensorRef<'a> {
    TensorRef {
        name,
        dtype,
        shape,
        data,
        path: Path::new("(test)"),
    }
}

#[test]
fn repack_dequantizes_to_the_release_values_bit_for_bit() {
    let mut rng = Rng(0x5eed_00f8);
    for sdt in [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::F8_E8M0,
        DType::U8,
    ] {
        // rows: one block, a partial second row block, several; cols: 1..=3 blocks and V4's 7168
        for (rows, cols) in [(1usize, 128usize), (129, 256), (300, 384), (3, 7168)] {
            let (sr, sc) = (rows.div_ceil(128), cols / 128);
            let w = codes(&mut rng, rows * cols);
            let s = scales(&mut rng, sdt, sr * sc);
            let (ws, ss) = ([rows as u64, cols as u64], [sr as u64, sc as u64]);
            let wt = tref("layers.0.attn.wq_a.weight", DType::F8_E4M3, &ws, &w);
            let st = tref("layers.0.attn.wq_a.scale", sdt, &ss, &s);
            let mut want = vec![0f32; rows * cols];
            dequant_fp8_block(&wt, &st, &mut want).unwrap();

            let packed = repack_fp8_block_to_b128(&wt, &st).unwrap();
            let dt = DType::F8_E4M3_B128;
            assert_eq!(
                packed.len() as u64,
                dt.bytes_for((rows * cols) as u64).unwrap()
            );
            let got = quant::dequantize_to_vec(dt, &packed, rows * cols).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{sdt} scales, {rows}x{cols}: element {i} = {g}, release {w}"
                );
            }
            // the fused dot against the f64 reference dot of the same values
            let x: Vec<f32> = (0..cols).map(|_| rng.uniform() * 2.0 - 1.0).collect();
            let rb = packed.len() / rows;
            for r in [0, rows / 2, rows - 1] {
                let row = &packed[r * rb..(r + 1) * rb];
                let (d, d_ref) = (quant::dot(dt, row, &x), quant::dot_ref(dt, row, &x));
                let mag: f64 = want[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(&x)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                assert!(
                    ((d - d_ref) as f64).abs() <= 1e-5 * (1.0 + mag),
                    "{sdt} {rows}x{cols} row {r}: dot {d} vs reference {d_ref}"
                );
            }
        }
    }
}

#[test]
fn repack_refuses_partial_column_blocks_naming_the_tensor() {
    let w = vec![0x38u8; 4 * 130];
    let s = [127u8, 127];
    let wt = tref("layers.3.attn.wo_b.weight", DType::F8_E4M3, &[4, 130], &w);
    let st = tref("layers.3.attn.wo_b.scale", DType::F8_E8M0, &[1, 2], &s);
    // the release dequantization handles it; lathe's block type does not
    let mut out = vec![0f32; 4 * 130];
    dequant_fp8_block(&wt, &st, &mut out).unwrap();
    let err = repack_fp8_block_to_b128(&wt, &st).unwrap_err().to_string();
    assert!(
        err.contains("layers.3.attn.wo_b.weight") && err.contains("multiple of 128"),
        "{err}"
    );
    // a scale of the wrong shape is refused as by the release dequantization
    let bad = tref("layers.3.attn.wo_b.scale", DType::F8_E8M0, &[2, 1], &s);
    let w2 = vec![0x38u8; 4 * 128];
    let wt2 = tref("layers.3.attn.wo_b.weight", DType::F8_E4M3, &[4, 128], &w2);
    let err = repack_fp8_block_to_b128(&wt2, &bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("scale shape"), "{err}");
}

#[test]
fn repack_refuses_non_finite_scales_naming_the_block() {
    // rows 0..200 (two 128-row bands) x 256 columns (two blocks); block (1, 1) is E8M0 0xFF
    let w = vec![0x38u8; 200 * 256];
    let s = [127u8, 127, 127, 0xff];
    let wt = tref("layers.0.ffn.w1.weight", DType::F8_E4M3, &[200, 256], &w);
    let st = tref("layers.0.ffn.w1.scale", DType::F8_E8M0, &[2, 2], &s);
    let err = repack_fp8_block_to_b128(&wt, &st).unwrap_err().to_string();
    assert!(
        err.contains("layers.0.ffn.w1.scale")
            && err.contains("rows 128")
            && err.contains("columns 128"),
        "{err}"
    );
    let ok = [127u8, 127, 127, 126];
    let st = tref("layers.0.ffn.w1.scale", DType::F8_E8M0, &[2, 2], &ok);
    assert!(repack_fp8_block_to_b128(&wt, &st).is_ok());
}

/// The committed release-layout fixture (tests/fixtures/safetensors/fp8_block: 129×130 and
/// 40×200, neither a multiple of 128 columns) is refused by the repack, tensor named.
#[test]
fn fixture_with_partial_column_blocks_is_refused() {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/safetensors/fp8_block");
    let f = lathe::safetensors::SafetensorsFile::open(dir.join("model.safetensors")).unwrap();
    let w = f.tensor("layers.0.attn.wq.weight").unwrap();
    let s = f.tensor("layers.0.attn.wq.scale").unwrap();
    let err = repack_fp8_block_to_b128(&w, &s).unwrap_err().to_string();
    assert!(err.contains("layers.0.attn.wq.weight"), "{err}");
}

/// The block type lives only in memory: the GGUF writer refuses it by name (no ggml id), and
/// no ggml id maps to it.
#[test]
fn gguf_refuses_the_block_type() {
    let mut w = lathe::gguf::GgufWriter::new();
    let err = w
        .add_tensor_info("blk.0.attn_q_a.weight", DType::F8_E4M3_B128, &[4, 128])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("F8_E4M3_B128") && err.contains("blk.0.attn_q_a.weight"),
        "{err}"
    );
    assert!((0..=255).all(|id| DType::from_ggml_id(id) != Some(DType::F8_E4M3_B128)));
}
