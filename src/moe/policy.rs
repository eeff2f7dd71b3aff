//! How the planner keeps experts off the GPU and where a prompt's cold experts run: the
//! policies `--cold-layers` and `--expert-stream` choose.

use crate::{Error, Result};

/// How the planner keeps experts off the GPU (`--cold-layers`). Each MoE layer with cold
/// experts costs a GPU → CPU → GPU hop per decode step; whole cold layers (as llama.cpp's
/// `-ncmoe`) take fewer hops, a share of every layer lets the CPU's work overlap the GPU's
/// hot experts and the hottest experts of each layer stay on the GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ColdLayers {
    /// Whichever the planner's decode estimate (`moe::Placement::decode_seconds`) finds
    /// faster, for a budget (`--gpu-mem`); `spread` under `--gpu-experts`, whose share is
    /// per layer.
    #[default]
    Auto,
    /// Every layer keeps its share of slots.
    Spread,
    /// Whole layers hot from the last one down while the budget lasts (under
    /// `--gpu-experts F`: F of all expert bytes); at most one layer mixed.
    Whole,
}

impl std::str::FromStr for ColdLayers {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(ColdLayers::Auto),
            "spread" => Ok(ColdLayers::Spread),
            "whole" => Ok(ColdLayers::Whole),
            _ => Err(Error::Invalid(format!(
                "--cold-layers {s}: expected auto, spread or whole"
            ))),
        }
    }
}

/// Where a prefill batch's cold experts run (`--expert-stream`). Streaming copies the
/// experts the batch picks into a few GPU slots and runs them with the GPU's kernels; the
/// CPU path reads them from the mmap where they are. Decode steps (one row) always take
/// the CPU path: a token uses each expert once, which never repays a copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertStream {
    /// Stream when the batch is large enough that the copies cost less than the CPU's work
    /// (`moe::plan::stream_beats_cpu`).
    #[default]
    Auto,
    /// Every batch of more than one row streams (tests, measurements).
    Always,
    /// Never stream: cold experts run on the CPU.
    Never,
}

impl std::str::FromStr for ExpertStream {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(ExpertStream::Auto),
            "always" => Ok(ExpertStream::Always),
            "never" => Ok(ExpertStream::Never),
            _ => Err(Error::Invalid(format!(
                "--expert-stream {s}: expected auto, always or never"
            ))),
        }
    }
}
