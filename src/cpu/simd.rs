//! Which instruction set the CPU kernels of the cold MoE path use: picked once at load
//! ([`SimdLevel::detect`]), forceable for measurements and tests (`--cpu-simd`). A level is a
//! value passed down to the kernels, never a global: tests run every level the machine has
//! side by side in one process.

pub use crate::forward::SimdLevel;
use crate::{Error, Result};

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
