//! Block-scaled weights as released checkpoints store them, with CPU references.
//!
//! - FP8 with 128×128 block scales (DeepSeek-V3 / V4): weight `X.weight` F8_E4M3 `[out, in]`,
//!   scale `X.scale` (V4 inference naming) or `X.weight_scale_inv` (Hugging Face naming),
//!   F32 / BF16 / F16 or E8M0 `[ceil(out/128), ceil(in/128)]`; value = e4m3(w) · scale.
//!   The GPU reads them repacked into lathe's `F8_E4M3_B128` blocks
//!   ([`repack_fp8_block_to_b128`]), still one byte per weight.
//! - Packed MXFP4 (DeepSeek-V4 routed experts): weight I8 or U8 `[out, in/2]`, byte k of a
//!   row holding element 2k in its low nibble and 2k+1 in its high nibble (e2m1 codes), and
//!   an E8M0 scale `[out, in/32]` per 32 consecutive elements (OCP MX v1.0). E8M0 scales
//!   may be stored as F8_E8M0 or, by writers without that type, as U8 bytes.

use super::model::HfModel;
use crate::tensor::TensorRef;
use crate::{DType, Error, Result};
use rayon::prelude::*;

/// Side of the square weight blocks sharing one FP8 scale (`weight_block_size: [128, 128]`
/// in the DeepSeek configs' `quantization_config`).
pub const FP8_BLOCK: usize = 128;
/// Elements per MXFP4 scale (OCP MX v1.0 block size, ggml's `QK_MXFP4`).
pub const MXFP4_BLOCK: usize = 32;

/// The e2m1 (FP4) values of codes 0..8; bit 3 is the sign.
pub const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// e4m3fn (OCP FP8, "fn" = finite): sign, 4 exponent bits with bias 7, 3 mantissa bits;
/// no infinities, S.1111.111 is NaN; largest finite 448.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0x0f) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m / 8.0 * 2f32.powi(-6) // subnormal
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    sign * mag
}

/// E8M0: an exponent byte, `2^(b-127)`; 0xFF is NaN. `b = 0` gives 2^-127, a subnormal f32.
pub fn e8m0_to_f32(b: u8) -> f32 {
    match b {
        0xff => f32::NAN,
        0 => f32::from_bits(0x0040_0000),
        _ => f32::from_bits((b as u32) << 23),
    }
}

/// e2m1 code (low 4 bits of `c`) to f32.
pub fn e2m1_to_f32(c: u8) -> f32 {
    let v = E2M1[(c & 7) as usize];
    if c & 8 != 0 {
        -v
    } else {
        v
    }
}

/// The scale tensor stored beside `weight_name` (`X.weight` → `X.scale` or
/// `X.weight_scale_inv`), looked up in the normalised view.
pub fn find_block_scale<'a>(model: &'a HfModel, weight_name: &str) -> Option<TensorRef<'a>> {
    let base = weight_name.strip_suffix(".weight").unwrap_or(weight_name);
    model
        .tensor(&format!("{base}.scale"))
        .or_else(|| model.tensor(&format!("{base}.weight_scale_inv")))
}

fn tensor_err(t: &TensorRef, what: impl Into<String>) -> Error {
    Error::tensor(t.path, t.name, what)
}

/// Reads scale `i` of a scale tensor's bytes as f32.
type ScaleReader = fn(&[u8], usize) -> f32;

/// Per-element reader of a scale tensor, `None` for types that are not scales.
fn scale_reader(t: &TensorRef) -> Option<ScaleReader> {
    Some(match t.dtype {
        DType::F32 => {
            |d, i| f32::from_le_bytes([d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]])
        }
        DType::BF16 => |d, i| half::bf16::from_le_bytes([d[2 * i], d[2 * i + 1]]).to_f32(),
        DType::F16 => |d, i| half::f16::from_le_bytes([d[2 * i], d[2 * i + 1]]).to_f32(),
        DType::F8_E8M0 | DType::U8 => |d, i| e8m0_to_f32(d[i]),
        _ => return None,
    })
}

fn check_out_len(w: &TensorRef, want: usize, got: usize) -> Result<()> {
    if want != got {
        return Err(tensor_err(
            w,
            format!("output buffer has {got} elements, the tensor {want}"),
        ));
    }
    Ok(())
}

/// Checked `usize` element count (the tensor's bytes exist, so it fits unless it is 0-sized
/// with huge dimensions).
fn n_usize(t: &TensorRef, n: u64) -> Result<usize> {
    usize::try_from(n).map_err(|_| tensor_err(t, "too many elements for this platform"))
}

/// Checks an FP8 weight and its block scale; returns (rows, cols, the scale reader).
fn check_fp8_block(w: &TensorRef, scale: &TensorRef) -> Result<(usize, usize, ScaleReader)> {
    if w.dtype != DType::F8_E4M3 || w.shape.len() != 2 {
        return Err(tensor_err(
            w,
            format!(
                "expected a 2-D F8_E4M3 weight, found {} {:?}",
                w.dtype, w.shape
            ),
        ));
    }
    let rows = n_usize(w, w.shape[0])?;
    let cols = n_usize(w, w.shape[1])?;
    let (sr, sc) = (rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK));
    let read = scale_reader(scale).ok_or_else(|| {
        tensor_err(
            scale,
            format!(
                "{} is not a block-scale type (F32, BF16, F16, F8_E8M0)",
                scale.dtype
            ),
        )
    })?;
    if scale.shape != [sr as u64, sc as u64] {
        return Err(tensor_err(
            scale,
            format!(
                "scale shape {:?} does not fit weight `{}` {:?} (want [{sr}, {sc}])",
                scale.shape, w.name, w.shape
            ),
        ));
    }
    Ok((rows, cols, read))
}

/// Dequantize an FP8 e4m3fn weight `[out, in]` with 128×128 block scales
/// `[ceil(out/128), ceil(in/128)]` into `out` (`out·in` f32, row-major).
pub fn dequant_fp8_block(w: &TensorRef, scale: &TensorRef, out: &mut [f32]) -> Result<()> {
    let (rows, cols, read) = check_fp8_block(w, scale)?;
    let sc = cols.div_ceil(FP8_BLOCK);
    check_out_len(w, rows * cols, out.len())?;
    if cols == 0 {
        return Ok(());
    }
    let lut: [f32; 256] = std::array::from_fn(|b| e4m3_to_f32(b as u8));
    let (wd, sd) = (w.data, scale.data);
    out.par_chunks_mut(cols).enumerate().for_each(|(r, row)| {
        let src = &wd[r * cols..(r + 1) * cols];
        let s_row = (r / FP8_BLOCK) * sc;
        for (cb, (o, x)) in row
            .chunks_mut(FP8_BLOCK)
            .zip(src.chunks(FP8_BLOCK))
            .enumerate()
        {
            let s = read(sd, s_row + cb);
            for (o, &x) in o.iter_mut().zip(x) {
                *o = lut[x as usize] * s;
            }
        }
    });
    Ok(())
}

/// Repack an FP8 e4m3fn weight `[out, in]` with 128×128 block scales into lathe's
/// `F8_E4M3_B128` rows: per row, per 128 columns, the block's scale as f32 (4 bytes,
/// little-endian) then the 128 codes unchanged. A layout change, no rounding: every scale type
/// [`dequant_fp8_block`] reads (F32, BF16, F16, E8M0) converts to f32 exactly, and the
/// dequantized values equal [`dequant_fp8_block`]'s bit for bit. Returns
/// `out · in/128 · 132` bytes, row-major.
///
/// `in` must be a multiple of 128 (the type has no partial blocks): DeepSeek's releases are
/// (every dimension is a multiple of 128); a tensor that is not is refused, naming it.
pub fn repack_fp8_block_to_b128(w: &TensorRef, scale: &TensorRef) -> Result<Vec<u8>> {
    let (rows, cols, read) = check_fp8_block(w, scale)?;
    if !cols.is_multiple_of(FP8_BLOCK) {
        return Err(tensor_err(
            w,
            format!(
                "FP8 weight {:?}: {cols} columns is not a multiple of {FP8_BLOCK}; lathe keeps \
                 FP8 weights in 128-column blocks (F8_E4M3_B128)",
                w.shape
            ),
        ));
    }
    let nb = cols / FP8_BLOCK;
    let bb = DType::F8_E4M3_B128.block_bytes();
    let mut out = vec![0u8; rows * nb * bb];
    if nb == 0 {
        return Ok(out);
    }
    let (wd, sd) = (w.data, scale.data);
    // A NaN or infinite block scale (E8M0 0xFF, a broken F32) would only show as NaN logits
    // much later: refuse it here, as the MXFP4 repack does.
    if let Some(i) = (0..rows.div_ceil(FP8_BLOCK) * nb).find(|&i| !read(sd, i).is_finite()) {
        return Err(tensor_err(
            scale,
            format!(
                "block scale {} (rows {}.., columns {}..) is not finite",
                read(sd, i),
                (i / nb) * FP8_BLOCK,
                (i % nb) * FP8_BLOCK
            ),
        ));
    }
    out.par_chunks_mut(nb * bb)
        .enumerate()
        .for_each(|(r, row)| {
            let s_row = (r / FP8_BLOCK) * nb;
            for (cb, dst) in row.chunks_mut(bb).enumerate() {
                dst[..4].copy_from_slice(&read(sd, s_row + cb).to_le_bytes());
                dst[4..].copy_from_slice(&wd[r * cols + cb * FP8_BLOCK..][..FP8_BLOCK]);
            }
        });
    Ok(out)
}

/// Checks a packed MXFP4 pair of tensors; returns (rows, elements per row).
fn check_mxfp4(w: &TensorRef, scale: &TensorRef) -> Result<(usize, usize)> {
    if !matches!(w.dtype, DType::I8 | DType::U8) || w.shape.is_empty() {
        return Err(tensor_err(
            w,
            format!(
                "expected packed MXFP4 (I8 or U8 [.., in/2]), found {} {:?}",
                w.dtype, w.shape
            ),
        ));
    }
    if !matches!(scale.dtype, DType::F8_E8M0 | DType::U8) {
        return Err(tensor_err(
            scale,
            format!(
                "expected an E8M0 scale (F8_E8M0 or U8), found {}",
                scale.dtype
            ),
        ));
    }
    let cols = n_usize(w, w.row_len())?
        .checked_mul(2)
        .ok_or_else(|| tensor_err(w, "row too long"))?;
    let rows = n_usize(w, w.n_rows())?;
    let lead = &w.shape[..w.shape.len() - 1];
    if !cols.is_multiple_of(MXFP4_BLOCK)
        || scale.shape.len() != w.shape.len()
        || &scale.shape[..lead.len()] != lead
        || scale.row_len() as usize != cols / MXFP4_BLOCK
    {
        return Err(tensor_err(
            scale,
            format!(
                "scale shape {:?} does not fit packed MXFP4 weight `{}` {:?} ({cols} elements per row, one scale per {MXFP4_BLOCK})",
                scale.shape, w.name, w.shape
            ),
        ));
    }
    Ok((rows, cols))
}

/// Dequantize packed MXFP4 (`[.., in/2]` bytes, E8M0 `[.., in/32]`) into `out`
/// (`rows·in` f32, row-major).
pub fn dequant_mxfp4_packed(w: &TensorRef, scale: &TensorRef, out: &mut [f32]) -> Result<()> {
    let (rows, cols) = check_mxfp4(w, scale)?;
    check_out_len(w, rows * cols, out.len())?;
    if cols == 0 {
        return Ok(());
    }
    let nb = cols / MXFP4_BLOCK;
    let (wd, sd) = (w.data, scale.data);
    out.par_chunks_mut(cols).enumerate().for_each(|(r, row)| {
        for (b, blk) in row.chunks_mut(MXFP4_BLOCK).enumerate() {
            let s = e8m0_to_f32(sd[r * nb + b]);
            let src = &wd[r * cols / 2 + b * MXFP4_BLOCK / 2..][..MXFP4_BLOCK / 2];
            for (pair, &x) in blk.chunks_mut(2).zip(src) {
                pair[0] = e2m1_to_f32(x) * s;
                pair[1] = e2m1_to_f32(x >> 4) * s;
            }
        }
    });
    Ok(())
}

/// Repack packed MXFP4 into ggml's `block_mxfp4` rows, so one GPU MXFP4 kernel serves both
/// GGUF files and safetensors releases. Returns `rows · in/32` blocks of 17 bytes, row-major.
///
/// ggml's convention (ggml-common.h `block_mxfp4 { uint8_t e; uint8_t qs[16]; }`,
/// ggml-quants.c `dequantize_row_mxfp4`): element j of a block (j < 16) is the low nibble of
/// `qs[j]`, element j+16 the high nibble; the value is `kvalues_mxfp4[code] · d` with
/// `kvalues_mxfp4 = {0,1,2,3,4,6,8,12}` (the e2m1 values doubled, sign in bit 3) and
/// `d = GGML_E8M0_TO_FP32_HALF(e) = 2^(e-128)` (half the E8M0 value). The doubling and the
/// halving cancel, so the scale byte and the 4-bit codes copy over unchanged; only the
/// nibble order moves (pairs 2k/2k+1 here, j/j+16 there). One exception: E8M0 0xFF is NaN
/// in the MX spec but 2^127 for ggml, so a NaN scale is refused rather than changed.
pub fn repack_mxfp4_to_ggml(w: &TensorRef, scale: &TensorRef) -> Result<Vec<u8>> {
    const HALF: usize = MXFP4_BLOCK / 2;
    let (rows, cols) = check_mxfp4(w, scale)?;
    let nb = cols / MXFP4_BLOCK;
    let n_blocks = rows * nb;
    if let Some(i) = scale.data[..n_blocks].iter().position(|&e| e == 0xff) {
        return Err(tensor_err(
            scale,
            format!(
                "E8M0 scale 0xFF (NaN) at row {}, block {}: ggml's MXFP4 has no NaN scale",
                i / nb.max(1),
                i % nb.max(1)
            ),
        ));
    }
    let mut out = vec![0u8; n_blocks * DType::MXFP4.block_bytes()];
    out.par_chunks_mut(DType::MXFP4.block_bytes())
        .zip(w.data.par_chunks(HALF))
        .zip(scale.data[..n_blocks].par_iter())
        .for_each(|((dst, src), &e)| {
            // src: 16 bytes = 32 codes, code 2k in the low nibble of byte k.
            let code = |j: usize| (src[j / 2] >> (4 * (j % 2))) & 0x0f;
            dst[0] = e;
            for j in 0..HALF {
                dst[1 + j] = code(j) | (code(j + HALF) << 4);
            }
        });
    Ok(out)
}
