//! lathe: a portable LLM inference engine on wgpu.
//!
//! Layout: `gguf` and `safetensors` read model files by mmap; `quant` holds a CPU reference
//! (dequantize, dot, quantize) per stored type; `gpu` owns the device, buffers, pipeline cache
//! and one wrapper per kernel family (`shaders/*.wgsl`); `cpu` holds rayon kernels and the
//! plain references of every GPU op; `models` has one file per architecture; `moe` the expert
//! planner; `tokenizer`, `sample`, `server` the text front end; `hub` fetches models by name
//! from the Hugging Face Hub into its shared cache.

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
pub mod synth;
pub mod tensor;
pub mod tokenizer;

pub use dtype::DType;
pub use error::{Error, Result};
