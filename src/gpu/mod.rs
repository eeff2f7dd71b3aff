//! The GPU runtime: device ([`Gpu`]), buffers and weight tensors, the pipeline cache and
//! command recording ([`Pass`]), plus one wrapper module per kernel family (`shaders/`).

mod buffer;
mod compile;
mod device;
mod disk_cache;
mod memory;
mod pass;
mod pipeline;
mod recorder;

pub mod attention;
pub mod compress;
pub mod conv;
pub mod coopmat;
pub mod elementwise;
pub mod embed;
pub mod gdn;
pub mod hc;
pub mod limits;
pub mod matmul;
pub mod matvec;
pub mod moe;
mod moe_route;
pub mod norm;
pub mod operand;
pub mod rope;
pub mod router;
pub mod softmax;
pub mod topk;

pub use buffer::{check_f32, check_len, check_span, GpuTensor, TensorPart};
pub use device::{
    adapter_memory, coop_supported, list_adapters, matmul_paths, ActivationsChoice, AdapterChoice,
    AutoProducts, Gpu, MatmulChoice, MatmulPath,
};
pub use disk_cache::cache_dir as pipeline_cache_dir;
pub use limits::{fit_rows, BufferLimits, PassBuffer};
pub use memory::{device_memory, DeviceMemory};
pub use pass::{grid, Encoded, Pass, FLUSH_OPS, MAX_GROUPS};
pub use pipeline::{
    expand_includes, preprocess, PipelineKey, PipelineSpec, StaticDefines, StaticName, PIECES,
};
pub use recorder::Binding;

/// Every entry WGSL file by the wrapper (`src/gpu/<name>.rs`) that owns its uniforms, for the
/// naga translation test (`tests/shaders.rs`) and `include_str!`; the pieces they include are
/// [`PIECES`].
pub const SHADERS: &[(&str, &str)] = &[
    ("attention", include_str!("../../shaders/attention.wgsl")),
    ("compress", include_str!("../../shaders/compress.wgsl")),
    ("hc", include_str!("../../shaders/hc.wgsl")),
    ("moe", include_str!("../../shaders/moe.wgsl")),
    ("router", include_str!("../../shaders/router.wgsl")),
    ("conv", include_str!("../../shaders/conv.wgsl")),
    (
        "elementwise",
        include_str!("../../shaders/elementwise.wgsl"),
    ),
    ("gdn", include_str!("../../shaders/gdn.wgsl")),
    ("embed", include_str!("../../shaders/embed.wgsl")),
    ("norm", include_str!("../../shaders/norm.wgsl")),
    ("rope", include_str!("../../shaders/rope.wgsl")),
    ("softmax", include_str!("../../shaders/softmax.wgsl")),
    ("topk", include_str!("../../shaders/topk.wgsl")),
    ("matmul", matmul::SRC),
    ("matmul", matmul::SRC_Q8),
    ("matmul_coop", coopmat::SRC),
    ("matvec", matvec::SRC),
    ("matvec", matvec::QUANT_SRC),
];
