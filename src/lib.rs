//! lathe: a portable LLM inference engine on wgpu.
//!
//! Layout, lowest layer first (`tests/layers.rs` declares the order and keeps imports
//! pointing down): `forward` is the contract between a forward and its callers (`Want`,
//! `Logits`, `LoadOptions`); `quant` holds a CPU reference (dequantize, dot, quantize) per
//! stored type; `gguf` and `safetensors` read model files by mmap, `model_file` opens either,
//! `hub` fetches them by name from the Hugging Face Hub into its shared cache; `cpu` holds
//! rayon kernels and the plain references of every GPU op; `gpu` owns the device, buffers,
//! pipeline cache and one wrapper per kernel family (`shaders/*.wgsl`); `moe` the expert
//! planner and offload; `models` has one folder per architecture, each implementing
//! `models::Forward`; `engine` is the front door; `tokenizer`, `sample`, `server` the text
//! front end.

pub mod bench;
pub mod cpu;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod forward;
pub mod generate;
pub mod gguf;
pub mod gpu;
pub mod hub;
pub mod inspect;
pub mod model_file;
pub mod models;
pub mod moe;
pub mod npy;
pub mod quant;
pub mod safetensors;
pub mod sample;
pub mod selftest;
pub mod server;
pub mod spec;
pub mod synth;
pub mod tensor;
pub mod tokenizer;

pub use dtype::DType;
pub use error::{Error, Result};
