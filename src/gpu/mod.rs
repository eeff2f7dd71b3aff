//! The GPU runtime: device ([`Gpu`]), buffers and weight tensors, the pipeline cache and
//! command recording ([`Pass`]), plus one wrapper module per kernel family (`shaders/`).

mod buffer;
mod device;
mod pass;
mod pipeline;

pub mod elementwise;

pub use buffer::{GpuTensor, TensorPart};
pub use device::{list_adapters, AdapterChoice, Gpu};
pub use pass::{grid, Binding, Pass, MAX_GROUPS};
pub use pipeline::{preprocess, PipelineSpec};

/// Every WGSL file, for the naga translation test (`tests/shaders.rs`) and `include_str!`.
pub const SHADERS: &[(&str, &str)] = &[("elementwise", include_str!("../../shaders/elementwise.wgsl"))];
