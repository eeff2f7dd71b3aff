//! Causal depthwise conv1d + SiLU of the Gated DeltaNet (`shaders/conv.wgsl`).
//! CPU reference: `cpu::gdn::conv1d`.
//!
//! Layouts (f32, offsets and strides in elements):
//! - `x` [rows, x_stride]: the fused q|k|v projection, channels `0..conv_dim` of each row;
//!   sequence b owns rows `row .. row + n_tokens` of its [`SeqSpan`](super::gdn::SeqSpan).
//! - `w` [conv_dim, K]: GGUF `ssm_conv1d` as stored (HF `conv1d.weight` [conv_dim, 1, K]), f32.
//! - `state` pool [slots, K−1, conv_dim]: the last K−1 inputs of each sequence, oldest first
//!   (ggml keeps the same K−1 inputs; HF keeps K and uses the last K−1).
//! - `y` [rows, y_stride]: SiLU(conv) for the same rows; must be a different buffer than `x`.
//!
//! Two dispatches: outputs (all tokens in parallel, reading the old state), then the state
//! update. Decode (one token per sequence) takes one: each channel's thread is then the only
//! reader of its state, so it rolls the state after reading it.

use super::gdn::SeqBatch;
use super::{grid, Binding, Pass, PipelineSpec};
use crate::{Error, Result};

const SRC: &str = include_str!("../../shaders/conv.wgsl");
const WG: u32 = 256;

/// Uniforms of `conv.wgsl` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n_seq: u32,
    max_tokens: u32,
    conv_dim: u32,
    /// in elements
    x_off: u32,
    /// in elements, between token rows
    x_stride: u32,
    y_off: u32,
    y_stride: u32,
    /// in elements: slot 0 of the state pool
    state_off: u32,
}
const _: () = assert!(std::mem::size_of::<Params>() == 32);

/// Buffers of one conv call (see the module doc for layouts).
pub struct ConvIo<'a> {
    pub x: &'a wgpu::Buffer,
    pub x_off: u32,
    pub x_stride: u32,
    /// [conv_dim, K] f32
    pub w: &'a wgpu::Buffer,
    /// pool [slots, K−1, conv_dim]
    pub state: &'a wgpu::Buffer,
    pub state_off: u32,
    pub y: &'a wgpu::Buffer,
    pub y_off: u32,
    pub y_stride: u32,
}

/// `y = silu(causal_conv1d(x))` for every sequence of `batch`, continuing from and then
/// updating each sequence's conv state. `k` is the kernel width (4 in Qwen3.5).
pub fn conv1d_silu(
    pass: &mut Pass<'_>,
    conv_dim: u32,
    k: u32,
    batch: &SeqBatch,
    io: &ConvIo<'_>,
) -> Result<()> {
    if k == 0 || conv_dim == 0 || io.x_stride < conv_dim || io.y_stride < conv_dim {
        return Err(Error::Invalid(format!(
            "conv1d: conv_dim {conv_dim}, K {k}, strides x {} y {}",
            io.x_stride, io.y_stride
        )));
    }
    if batch.n_seq == 0 {
        return Ok(());
    }
    let gpu = pass.gpu();
    let params = Params {
        n_seq: batch.n_seq,
        max_tokens: batch.max_tokens,
        conv_dim,
        x_off: io.x_off,
        x_stride: io.x_stride,
        y_off: io.y_off,
        y_stride: io.y_stride,
        state_off: io.state_off,
    };
    // One token per sequence (decode): conv_out rolls the state in the same dispatch.
    let decode = batch.max_tokens == 1;
    #[derive(PartialEq, Eq, Hash)]
    struct ConvOut {
        /// Kernel width.
        k: u32,
        /// One token per sequence.
        decode: bool,
    }
    impl super::PipelineKey for ConvOut {
        fn source(&self) -> &'static str {
            SRC
        }
        fn entry(&self) -> &'static str {
            "conv_out"
        }
        fn label(&self) -> String {
            let decode = if self.decode { "_decode" } else { "" };
            format!("conv_out_k{}_wg{WG}{decode}", self.k)
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec.define("WG", format!("{WG}u"))
                .define("K", format!("{}u", self.k))
                .define("OUT", 1)
                .define("DECODE", self.decode)
        }
    }
    let out = gpu.pipeline_for(ConvOut { k, decode })?;
    let n_out = batch.n_seq as u64 * batch.max_tokens as u64 * conv_dim as u64;
    if n_out > u32::MAX as u64 {
        return Err(Error::Invalid(format!(
            "conv1d: {n_out} outputs exceed one dispatch"
        )));
    }
    let seqs = Binding::from(&batch.table);
    pass.dispatch(
        &out,
        "conv_out",
        &params,
        &[
            seqs.clone(),
            io.x.into(),
            io.state.into(),
            io.w.into(),
            io.y.into(),
        ],
        grid((n_out as u32).div_ceil(WG)),
    );
    if k > 1 && !decode {
        #[derive(PartialEq, Eq, Hash)]
        struct ConvState {
            /// Kernel width.
            k: u32,
        }
        impl super::PipelineKey for ConvState {
            fn source(&self) -> &'static str {
                SRC
            }
            fn entry(&self) -> &'static str {
                "conv_state"
            }
            fn label(&self) -> String {
                format!("conv_state_k{}_wg{WG}", self.k)
            }
            fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
                spec.define("WG", format!("{WG}u"))
                    .define("K", format!("{}u", self.k))
            }
        }
        let upd = gpu.pipeline_for(ConvState { k })?;
        pass.dispatch(
            &upd,
            "conv_state",
            &params,
            &[seqs, io.x.into(), io.state.into()],
            grid((batch.n_seq * conv_dim).div_ceil(WG)),
        );
    }
    Ok(())
}
