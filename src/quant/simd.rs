//! Building blocks of the portable fused row dots (the loops of the type files, used where
//! the CPU lacks AVX2 + FMA; `avx2.rs` holds the x86_64 kernels): 8-lane f32 accumulators
//! written as plain arrays so LLVM can vectorize them for the build's baseline, and the
//! run-time feature check. Both paths differ from `dot_ref` only by f32 rounding.

#![allow(clippy::needless_range_loop)]

/// Eight f32 lanes.
pub(super) type V8 = [f32; 8];

/// `a·b + c` as a separate multiply and add (a fused `mul_add` is a libm call without FMA).
#[inline(always)]
pub(super) fn madd(a: f32, b: f32, c: f32) -> f32 {
    a * b + c
}

/// `a·b + c`, fused when `F` (only inside the `fma` target-feature functions, where it is
/// one instruction).
#[inline(always)]
pub(super) fn fma_if<const F: bool>(a: f32, b: f32, c: f32) -> f32 {
    if F {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `acc[i] += s · v[i]`: folds a block's lane sums into the row's lanes with its scale.
#[inline(always)]
pub(super) fn axpy8(acc: &mut V8, s: f32, v: &V8) {
    for i in 0..8 {
        acc[i] = madd(s, v[i], acc[i]);
    }
}

/// A little-endian f16 block scale → f32, exactly.
#[inline(always)]
pub(super) fn h16(b: [u8; 2]) -> f32 {
    super::float::f16_to_f32(u16::from_le_bytes(b))
}

/// True when the AVX2 + FMA + F16C kernels may run (checked once by std, then cached
/// loads). Every x86_64 CPU with AVX2 since Haswell / Zen 1 has all three.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(super) fn has_avx2_fma() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// The 32 values of a block of 16 nibble bytes through a 16-entry i8 table: element j is
/// `table[qs[j] & 15]`, element j + 16 `table[qs[j] >> 4]` (the IQ4_NL / MXFP4 layout).
#[inline(always)]
pub(super) fn lut_nibbles(table: &[i8; 16], qs: &[u8; 16]) -> [f32; 32] {
    let mut out = [0f32; 32];
    for j in 0..16 {
        out[j] = table[(qs[j] & 15) as usize] as f32;
        out[j + 16] = table[(qs[j] >> 4) as usize] as f32;
    }
    out
}

/// `Σ w·x` over 32 values in 8 lanes, added into `s`.
#[inline(always)]
pub(super) fn dot32_into(s: &mut V8, w: &[f32; 32], x: &[f32; 32]) {
    for c in 0..4 {
        for i in 0..8 {
            s[i] = madd(w[8 * c + i], x[8 * c + i], s[i]);
        }
    }
}
