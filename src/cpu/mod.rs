//! CPU kernels and the plain references of the GPU ops, one module per family.

pub mod attention;
pub mod compress;
pub mod gdn;
pub mod hc;
pub mod moe;
pub mod ops;
pub mod q8dot;
pub mod q8x;
pub mod router;
pub mod simd;
