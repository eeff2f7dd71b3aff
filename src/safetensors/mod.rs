//! Hugging Face safetensors checkpoints.
//!
//! - [`SafetensorsFile`]: one mmapped `.safetensors` file with a validated tensor table
//!   (every offset, size and overlap checked; errors name the file and tensor).
//! - [`HfModel`]: a checkpoint directory: `config.json` with typed accessors, and one tensor
//!   table over a single file, an indexed set of shards, or a directory of files, with the
//!   multimodal Qwen3.5 prefix `model.language_model.` normalised to `model.`.
//! - [`scaled`]: FP8 block-scaled and packed-MXFP4 weights of the DeepSeek releases, with CPU
//!   dequantization and a repack into ggml's MXFP4 blocks.
//!
//! Shapes are outermost first as the header writes them, which is [`TensorRef`]'s order.
//!
//! [`TensorRef`]: crate::tensor::TensorRef

mod file;
mod model;
pub mod scaled;

pub use file::{SafetensorsFile, HEADER_MAX_BYTES};
pub use model::{normalise_name, HfModel, TEXT_MODEL_PREFIX, VISION_PREFIXES};
pub use scaled::{dequant_fp8_block, dequant_mxfp4_packed, find_block_scale, repack_mxfp4_to_ggml};
