//! Element and block types of stored tensors, shared by both file formats, the CPU
//! reference kernels and the GPU kernels.
//!
//! Ids are ggml's `enum ggml_type` (ggml.h); types that only safetensors has (FP8) and
//! lathe's own load-time layout (`F8_E4M3_B128`) have no ggml id (`ggml_id() == None`), so
//! the GGUF writer refuses them and the reader can never produce them.

use std::fmt;

/// A stored element type. Quantized types are stored as blocks of `block_size()` elements
/// taking `block_bytes()` bytes each, laid out as in ggml (`ggml-common.h`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum DType {
    F32,
    F16,
    BF16,
    F64,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
    /// ggml's MXFP4 block: one E8M0 scale byte then 16 bytes of e2m1 nibbles (elements
    /// 0..16 in the low nibbles, 16..32 in the high nibbles, as Q4_0).
    MXFP4,
    I8,
    I16,
    I32,
    I64,
    /// safetensors only: FP8 e4m3fn, one byte per element (block scales live in a
    /// separate tensor).
    F8_E4M3,
    /// safetensors only: E8M0 exponent-only scale byte (value `2^(b-127)`).
    F8_E8M0,
    /// safetensors only: raw bytes (packed MXFP4 pairs are stored as U8 or I8).
    U8,
    /// lathe only (never in a file): FP8 e4m3fn weights with 128-wide block scales, made at
    /// load from a release's `X.weight` F8_E4M3 + `X.scale` (DeepSeek-V3/V4 layout). One
    /// block = 128 consecutive elements of a row: the scale of their 128×128 block as f32
    /// (4 bytes, E8M0 converted exactly) then the 128 e4m3 bytes unchanged; 132 bytes, so
    /// blocks stay 4-byte aligned. See `quant::BlockF8B128`.
    F8_E4M3_B128,
}

impl DType {
    /// All types, in ggml id order, then the safetensors-only ones, then lathe's own.
    pub const ALL: [DType; 25] = [
        DType::F32,
        DType::F16,
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
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F64,
        DType::BF16,
        DType::MXFP4,
        DType::F8_E4M3,
        DType::F8_E8M0,
        DType::U8,
        DType::F8_E4M3_B128,
    ];

    /// ggml type id (`enum ggml_type`), `None` for safetensors-only types.
    pub fn ggml_id(self) -> Option<u32> {
        Some(match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::Q8_0 => 8,
            DType::Q2_K => 10,
            DType::Q3_K => 11,
            DType::Q4_K => 12,
            DType::Q5_K => 13,
            DType::Q6_K => 14,
            DType::IQ4_NL => 20,
            DType::IQ4_XS => 23,
            DType::I8 => 24,
            DType::I16 => 25,
            DType::I32 => 26,
            DType::I64 => 27,
            DType::F64 => 28,
            DType::BF16 => 30,
            DType::MXFP4 => 39,
            DType::F8_E4M3 | DType::F8_E8M0 | DType::U8 | DType::F8_E4M3_B128 => return None,
        })
    }

    /// The type with this ggml id, if lathe supports it.
    pub fn from_ggml_id(id: u32) -> Option<DType> {
        DType::ALL.iter().copied().find(|t| t.ggml_id() == Some(id))
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> usize {
        match self {
            DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q8_0
            | DType::IQ4_NL
            | DType::MXFP4 => 32,
            DType::F8_E4M3_B128 => 128,
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::IQ4_XS => {
                256
            }
            _ => 1,
        }
    }

    /// Bytes per block (bytes per element for plain types).
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::F64 | DType::I64 => 8,
            DType::I8 | DType::U8 | DType::F8_E4M3 | DType::F8_E8M0 => 1,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q8_0 => 34,
            DType::Q2_K => 84,
            DType::Q3_K => 110,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
            DType::IQ4_NL => 18,
            DType::IQ4_XS => 136,
            DType::MXFP4 => 17,
            DType::F8_E4M3_B128 => 132,
        }
    }

    /// Bytes needed for `n` elements, or `None` when `n` is not a whole number of blocks.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.block_bytes() as u64)
    }

    /// True for the block-quantized types (everything a matvec dequantizes on the fly).
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// True for types that hold real numbers a kernel can multiply by (floats and quants).
    pub fn is_float_like(self) -> bool {
        !matches!(
            self,
            DType::I8 | DType::I16 | DType::I32 | DType::I64 | DType::U8 | DType::F8_E8M0
        )
    }

    /// Name as llama.cpp prints it (`Q4_K`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F64 => "F64",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q8_0 => "Q8_0",
            DType::Q2_K => "Q2_K",
            DType::Q3_K => "Q3_K",
            DType::Q4_K => "Q4_K",
            DType::Q5_K => "Q5_K",
            DType::Q6_K => "Q6_K",
            DType::IQ4_NL => "IQ4_NL",
            DType::IQ4_XS => "IQ4_XS",
            DType::MXFP4 => "MXFP4",
            DType::I8 => "I8",
            DType::I16 => "I16",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::F8_E4M3 => "F8_E4M3",
            DType::F8_E8M0 => "F8_E8M0",
            DType::U8 => "U8",
            DType::F8_E4M3_B128 => "F8_E4M3_B128",
        }
    }

    /// Parse a name as `name()` prints it (case-insensitive).
    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(s))
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_sizes_match_ggml() {
        for t in DType::ALL {
            if let Some(id) = t.ggml_id() {
                assert_eq!(DType::from_ggml_id(id), Some(t));
            }
            assert_eq!(DType::from_name(t.name()), Some(t));
        }
        // ggml-common.h static asserts: sizeof(block_q4_K) == 2*2 + 12 + 128, etc.
        assert_eq!(DType::Q4_K.block_bytes(), 2 * 2 + 12 + 128);
        assert_eq!(DType::Q6_K.block_bytes(), 2 + 256 / 16 + 3 * 256 / 4);
        assert_eq!(DType::Q3_K.block_bytes(), 2 + 256 / 4 + 256 / 8 + 12);
        assert_eq!(DType::Q2_K.block_bytes(), 2 * 2 + 256 / 16 + 256 / 4);
        assert_eq!(DType::IQ4_XS.block_bytes(), 2 + 2 + 256 / 64 + 256 / 2);
        assert_eq!(DType::Q4_0.bytes_for(33), None);
        assert_eq!(DType::Q4_0.bytes_for(64), Some(36));
        // lathe's FP8 block: f32 scale + 128 e4m3 bytes, never a ggml type.
        assert_eq!(DType::F8_E4M3_B128.bytes_for(256), Some(264));
        assert_eq!(DType::F8_E4M3_B128.bytes_for(64), None);
        assert_eq!(DType::F8_E4M3_B128.ggml_id(), None);
        assert!(DType::F8_E4M3_B128.is_quantized() && DType::F8_E4M3_B128.is_float_like());
    }
}
