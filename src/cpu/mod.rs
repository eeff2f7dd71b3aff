//! CPU kernels and the plain references of the GPU ops, one module per family.

pub mod attention;
pub mod gdn;
pub mod ops;
