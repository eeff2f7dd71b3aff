//! Which instruction set the CPU kernels of the cold MoE path use: picked once at load
//! ([`SimdLevel::detect`]), forceable for measurements and tests (`--cpu-simd`). A level is a
//! value passed down to the kernels, never a global: tests run every level the machine has
//! side by side in one process.

use crate::{Error, Result};

/// An instruction set for the cold-expert kernels, from plain Rust to the widest integer dot
/// (`--cpu-simd`; detection and the checks in `cpu::simd`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SimdLevel {
    /// Plain Rust (what LLVM makes of it for the build's baseline): every CPU.
    Scalar,
    /// x86_64 AVX2 + FMA + F16C (Haswell, Zen 1 and later).
    Avx2,
    /// x86_64 AVX-512 VNNI on 256-bit vectors (`vpdpbusd`, with AVX-512VL and BW) on top of
    /// AVX2: Ice Lake, Sapphire Rapids, Zen 4 and later. The f32-activation kernels stay AVX2.
    Avx512Vnni,
}

impl SimdLevel {
    pub const ALL: [SimdLevel; 3] = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512Vnni];

    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512Vnni => "avx512vnni",
        }
    }
}

impl std::fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for SimdLevel {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        SimdLevel::ALL
            .into_iter()
            .find(|l| l.name() == s.to_ascii_lowercase())
            .ok_or_else(|| format!("--cpu-simd {s}: expected scalar, avx2 or avx512vnni"))
    }
}

impl SimdLevel {
    /// The widest level this CPU runs.
    pub fn detect() -> SimdLevel {
        *SimdLevel::ALL
            .iter()
            .rev()
            .find(|l| l.supported())
            .unwrap_or(&SimdLevel::Scalar)
    }

    /// Whether this CPU has the level's instructions (std's run-time detection).
    pub fn supported(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => has_avx2(),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Vnni => {
                has_avx2()
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every level this CPU runs, narrowest first.
    pub fn all_supported() -> Vec<SimdLevel> {
        SimdLevel::ALL
            .into_iter()
            .filter(|l| l.supported())
            .collect()
    }

    /// `level`, or an error naming it when this CPU lacks it (`--cpu-simd`).
    pub fn check(self) -> Result<SimdLevel> {
        if self.supported() {
            Ok(self)
        } else {
            Err(Error::Invalid(format!(
                "--cpu-simd {}: this CPU lacks it (it has {})",
                self.name(),
                SimdLevel::detect().name()
            )))
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}
