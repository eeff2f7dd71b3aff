//! Model architectures. One module per family; each has three parts: hyper-parameters
//! (from GGUF metadata or `config.json`), tensor loading (one name table per format, with
//! the value transforms that make both formats one layout), and the forward pass.
//!
//! This file holds what every family shares: the description of a weight as the loaders hand
//! it to a backend (GPU upload or CPU reference); the opened file is `crate::model_file`.

pub mod chain;
pub mod deepseek4;
pub mod gemma4;
pub mod llama;
pub mod qwen35;
pub mod registry;
pub mod runtime;
pub mod spec;
pub mod step37;

use crate::forward::{LoadOptions, Logits, Want};
use crate::gpu::operand::Operand;
use crate::gpu::{matmul, AutoProducts, Gpu};
pub use crate::model_file::ModelFile;
use crate::moe::{budget_for, Budget, MoeInfo, Needs, Offload, RunShape};
use crate::tensor::TensorRef;
use crate::{DType, Error, Result};
use std::any::Any;
use std::path::Path;
use std::sync::Arc;

/// Whether a family here runs `arch` (GGUF `general.architecture` or HF `architectures`),
/// so front ends can refuse a file before they start a GPU.
pub fn is_supported(arch: &str) -> bool {
    registry::FAMILIES.iter().any(|f| f.archs.contains(&arch))
}

/// Load the model in `file` onto `gpu` with its family's forward.
pub fn load(gpu: Arc<Gpu>, file: &ModelFile, opts: &LoadOptions) -> Result<Box<dyn Forward>> {
    Ok(load_part(gpu, file, opts)?)
}

/// [`load`], as a part of a chain (the layers of `opts.part`; the whole model without it).
pub fn load_part(
    gpu: Arc<Gpu>,
    file: &ModelFile,
    opts: &LoadOptions,
) -> Result<Box<dyn runtime::link::Part>> {
    let family = registry::family(file)?;
    if let (Some(mtp), false) = (&opts.mtp_model, family.mtp_file) {
        return Err(Error::Invalid(format!(
            "--mtp-model {}: {} is a {} model, whose family has no separate MTP file \
             (only Step-3.5/3.7's ships one)",
            mtp.display(),
            file.path().display(),
            family.name
        )));
    }
    (family.load)(gpu, file, opts)
}

/// What the engine asks of a loaded model, whatever its family: one implementation per
/// family (`qwen35::gpu::GpuModel`, `deepseek4::gpu::GpuModel`), so the engine holds one
/// `Box<dyn Forward>` and never matches on the family.
pub trait Forward: Send {
    fn vocab_size(&self) -> usize;
    /// A new sequence (at most `LoadOptions::max_seqs` live at once where the family pools
    /// its state).
    fn new_seq(&self) -> Result<Seq>;
    /// Forget the sequence's history.
    fn reset(&self, seq: &mut Seq) -> Result<()>;
    /// Make `dst` hold exactly what `src` holds, by copies on the GPU.
    fn copy_seq(&self, src: &Seq, dst: &mut Seq) -> Result<()>;
    /// Feed several sequences (their `Want`s checked by the caller); per item its logits.
    fn forward_batch(&mut self, items: &mut [(&mut Seq, &[u32], Want)]) -> Result<Vec<Logits>>;
    /// Feed `tokens`; logits of every token (`all`) or of the last one, `[n, vocab]`.
    fn forward(&mut self, seq: &mut Seq, tokens: &[u32], all: bool) -> Result<Vec<f32>>;
    /// One greedy pass over each item's tokens (a decode step or a prefill; several items:
    /// one batched pass as `forward_batch` runs it), timed per dispatch: `(label, ns)` in
    /// order.
    fn profile(&mut self, items: &mut [(&mut Seq, &[u32])]) -> Result<Vec<(String, f64)>>;
    /// The expert offload, when the model has one.
    fn offload(&self) -> Option<&Offload>;
    /// Routed experts over all MoE layers (0 for a dense model).
    fn routed_experts(&self) -> usize;
    /// Longest context the KV caches can grow to where a binding limit bounds it.
    fn max_context(&self) -> Option<usize>;
    /// Rows of one pass: a longer call runs in passes of this many tokens.
    fn pass_rows(&self) -> usize;
    /// Speculative decoding's passes, where the family has them.
    fn speculate(&mut self) -> Option<&mut dyn spec::Speculate> {
        None
    }
    /// While `on`, `forward_batch` hands back for the rows whose logits it would return
    /// (`Want::All`, `Want::Last`) their final-norm hidden states instead, `[n, n_embd]`
    /// row-major: the input of the head, what an embedding pools
    /// (`Engine::hidden_states`). A family that cannot says so.
    fn hidden_out(&mut self, on: bool) -> Result<()> {
        match on {
            true => Err(Error::Invalid(
                "this model does not hand back hidden states (embeddings): it runs on \
                 several devices"
                    .into(),
            )),
            false => Ok(()),
        }
    }
    /// Device boundary crossings of a model split over several devices.
    fn hops(&self) -> Option<chain::HopReport> {
        None
    }
    /// Every expert offload (one per device whose part has cold experts).
    fn offloads(&self) -> Vec<&Offload> {
        self.offload().into_iter().collect()
    }
}

/// One sequence's state (KV cache, recurrent state, position) for a model of any family:
/// the family's own type, which the model checks when it gets the sequence back.
pub struct Seq(Box<dyn SeqState>);

/// A family's per-sequence state.
pub trait SeqState: Any + Send {
    /// Tokens consumed so far.
    fn pos(&self) -> usize;
}

fn other_model() -> Error {
    Error::Invalid("sequence from another model".into())
}

impl Seq {
    pub fn new(state: impl SeqState) -> Seq {
        Seq(Box::new(state))
    }

    /// Tokens this sequence has consumed.
    pub fn pos(&self) -> usize {
        self.0.pos()
    }

    /// The family's state; an error for a sequence of another model.
    pub fn get<T: SeqState>(&self) -> Result<&T> {
        let any: &dyn Any = &*self.0;
        any.downcast_ref().ok_or_else(other_model)
    }

    /// [`Seq::get`], mutable.
    pub fn get_mut<T: SeqState>(&mut self) -> Result<&mut T> {
        let any: &mut dyn Any = &mut *self.0;
        any.downcast_mut().ok_or_else(other_model)
    }
}

/// Runs of consecutive indices in `rows` (a pass's top rows: a batch's decode rows, a
/// verify pass): `(position in rows, first row, length)`.
pub(crate) fn row_runs(rows: &[usize]) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let mut j = 0;
    std::iter::from_fn(move || {
        let r = *rows.get(j)?;
        let m = 1 + rows[j + 1..]
            .iter()
            .zip(1..)
            .take_while(|&(&x, k)| x == r + k)
            .count();
        let run = (j, r, m);
        j += m;
        Some(run)
    })
}

/// The head's logits of `n` consecutive rows of `x` (`[rows, cols]` from row `row`) into `y`
/// (`[n, vocab]` at row `j`) in one product ([`matmul::matmul`]): up to
/// [`matmul::DENSE_MATVEC_TOKENS`] rows through matvec, so each row has the bits of a lone
/// decode's (the token-group kernel reads each weight slice once per 8 rows), more through
/// the many-token kernels, as the layers' products of such a pass.
pub(crate) fn head_rows(
    pass: &mut crate::gpu::Pass<'_>,
    head: &crate::gpu::GpuTensor,
    x: &wgpu::Buffer,
    (row, cols): (usize, usize),
    y: &wgpu::Buffer,
    (j, vocab): (usize, usize),
    n: usize,
) -> Result<()> {
    let (x_off, y_off) = ((row * cols) as u32, (j * vocab) as u32);
    matmul::matmul(
        pass,
        head,
        Operand::new(x, x_off),
        Operand::new(y, y_off),
        n as u32,
    )
}

/// The rows `wants` (`(first row, rows)` runs) of `buf` (`[rows, width]` f32), read back in
/// order: the hidden states [`Forward::hidden_out`] hands back.
pub(crate) fn read_rows(
    gpu: &Gpu,
    buf: &wgpu::Buffer,
    wants: &[(usize, usize)],
    width: usize,
) -> Result<Vec<f32>> {
    let mut out = Vec::with_capacity(wants.iter().map(|w| w.1).sum::<usize>() * width);
    for &(r, n) in wants {
        out.extend(gpu.read_f32(buf, (r * width) as u64, n * width)?);
    }
    Ok(out)
}

/// The wanted row ranges `(first row, rows)` of a batch cut into runs of at most `cap` rows,
/// in order: the output head of the GPU forwards takes one run per product.
pub(crate) fn head_runs(wants: &[(usize, usize)], cap: usize) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    for &(r0, nr) in wants {
        let mut r = r0;
        while r < r0 + nr {
            let take = (r0 + nr - r).min(cap);
            runs.push((r, take));
            r += take;
        }
    }
    runs
}

/// What `--matmul auto` may run the model in `f` with. Models that make top-k choices on
/// computed values (MoE routers, DeepSeek-V4's indexer) take less rounding: f16 rounding
/// upstream can move such a value across a near-tie and change the output: they take
/// f32-level products (a Qwen3.5 MoE file missed its bar with f16 weights and split
/// activations).
pub fn auto_products(f: &ModelFile) -> AutoProducts {
    registry::family_of(f)
        .and_then(|fam| (fam.products)(f).ok())
        .unwrap_or(AutoProducts::Any)
}

/// Rows of one prefill pass the loader of the model in `f` sizes its activations for (its
/// family's `DEFAULT_BATCH`; an offload streaming cold experts may take longer ones).
pub fn pass_rows(f: &ModelFile) -> usize {
    registry::family_of(f).map_or(registry::DEFAULT_PASS_ROWS, |fam| fam.pass_rows)
}

/// What the model in `f` needs beside its weights for `run`: its family's `needs` (the one
/// its loader budgets with). Architectures without one count nothing (see `Needs::note`).
pub fn needs(f: &ModelFile, run: RunShape) -> Needs {
    let whole = registry::family_of(f).and_then(|fam| {
        let n = (fam.n_layer)(f).ok()?;
        (fam.needs_part)(f, run, &crate::model_file::PartSpec::whole(n)).ok()
    });
    whole.unwrap_or_else(|| Needs {
        note: Some("unknown architecture: KV, state and activations not counted".into()),
        ..Default::default()
    })
}

/// [`needs`] of the layers one device's `part` holds (`chain`).
pub fn needs_part(f: &ModelFile, run: RunShape, part: &crate::model_file::PartSpec) -> Needs {
    registry::family_of(f)
        .and_then(|fam| (fam.needs_part)(f, run, part).ok())
        .unwrap_or_else(|| needs(f, run))
}

/// The budget of `f` (whose experts `info` describes) on `memory` bytes for `run`: [`needs`],
/// with what a draft block `opts` names needs (Step's `--mtp-model`), into
/// `moe::budget_for`, as the loaders place experts with, so `lathe plan` agrees.
pub fn model_budget(
    f: &ModelFile,
    info: &MoeInfo,
    memory: u64,
    run: RunShape,
    opts: &LoadOptions,
) -> Result<(Budget, Needs)> {
    let mut nd = needs(f, run);
    if let Some(draft) = registry::family_of(f).and_then(|fam| fam.draft_needs) {
        nd.add(draft(f, opts, run)?);
    }
    Ok((budget_for(info, memory, run.ctx, &nd), nd))
}

/// A weight as a loader hands it to a backend: stored bytes straight from the mmap, a
/// selection of whole rows of a stored tensor (a layout fix that keeps the stored type),
/// or a small f32 vector computed at load (norm weights `1+w`, `-exp(A_log)`).
pub enum Weight<'a> {
    Stored(TensorRef<'a>),
    /// Rows `rows` of `src` (flattened to 2-D), in that order, reshaped to `shape`.
    Rows {
        src: TensorRef<'a>,
        rows: Vec<u64>,
        shape: Vec<u64>,
    },
    F32 {
        name: String,
        shape: Vec<u64>,
        data: Vec<f32>,
    },
    /// Bytes made at load in a stored type (e.g. DeepSeek's packed MXFP4 experts repacked
    /// into ggml's MXFP4 blocks: a layout change, not a widening).
    Owned {
        name: String,
        dtype: DType,
        shape: Vec<u64>,
        bytes: Vec<u8>,
    },
    /// Several stored tensors of one type concatenated along a new outer axis (HF keeps
    /// each expert's matrix apart; lathe wants one `[n_expert, rows, cols]` stack).
    Stack {
        parts: Vec<TensorRef<'a>>,
        shape: Vec<u64>,
    },
}

impl Weight<'_> {
    /// The weight's name, type and shape without GPU buffers: what a forward keeps for a
    /// weight uploaded elsewhere (into a concatenation, or the expert arena).
    pub fn stand_in(&self) -> crate::gpu::GpuTensor {
        crate::gpu::GpuTensor {
            name: self.name().to_string(),
            dtype: self.dtype(),
            shape: self.shape().to_vec(),
            parts: Vec::new(),
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Weight::Stored(t) | Weight::Rows { src: t, .. } => t.name,
            Weight::F32 { name, .. } => name,
            Weight::Stack { parts, .. } => parts[0].name,
            Weight::Owned { name, .. } => name,
        }
    }
    pub fn shape(&self) -> &[u64] {
        match self {
            Weight::Stored(t) => t.shape,
            Weight::Rows { shape, .. }
            | Weight::F32 { shape, .. }
            | Weight::Stack { shape, .. }
            | Weight::Owned { shape, .. } => shape,
        }
    }
    pub fn dtype(&self) -> DType {
        match self {
            Weight::Stored(t) | Weight::Rows { src: t, .. } => t.dtype,
            Weight::F32 { .. } => DType::F32,
            Weight::Stack { parts, .. } => parts[0].dtype,
            Weight::Owned { dtype, .. } => *dtype,
        }
    }

    /// The bytes in the stored type (a copy only for `Rows` and `F32`), then `f(TensorRef)`.
    pub fn with_tensor<R>(&self, f: impl FnOnce(&TensorRef<'_>) -> Result<R>) -> Result<R> {
        match self {
            Weight::Stored(t) => f(t),
            Weight::Rows { src, rows, shape } => {
                let rb = src.row_bytes();
                let mut bytes = Vec::with_capacity(rb * rows.len());
                for &r in rows {
                    if r >= src.n_rows() {
                        return Err(Error::tensor(
                            src.path,
                            src.name,
                            format!("row {r} out of range"),
                        ));
                    }
                    bytes.extend_from_slice(&src.data[r as usize * rb..(r as usize + 1) * rb]);
                }
                f(&TensorRef {
                    name: src.name,
                    dtype: src.dtype,
                    shape,
                    data: &bytes,
                    path: src.path,
                })
            }
            Weight::Stack { parts, shape } => {
                let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
                for p in parts {
                    if p.dtype != parts[0].dtype || p.shape != parts[0].shape {
                        return Err(Error::tensor(
                            p.path,
                            p.name,
                            format!(
                                "{} {:?} differs from {} {:?} of the same stack",
                                p.dtype, p.shape, parts[0].dtype, parts[0].shape
                            ),
                        ));
                    }
                    bytes.extend_from_slice(p.data);
                }
                f(&TensorRef {
                    name: parts[0].name,
                    dtype: parts[0].dtype,
                    shape,
                    data: &bytes,
                    path: parts[0].path,
                })
            }
            Weight::Owned {
                name,
                dtype,
                shape,
                bytes,
            } => f(&TensorRef {
                name,
                dtype: *dtype,
                shape,
                data: bytes,
                path: Path::new("(made at load)"),
            }),
            Weight::F32 { name, shape, data } => f(&TensorRef {
                name,
                dtype: DType::F32,
                shape,
                data: bytemuck::cast_slice(data),
                path: Path::new("(computed at load)"),
            }),
        }
    }

    /// Dequantized to f32 (CPU reference path).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        self.with_tensor(|t| {
            let n = t.n_elements() as usize;
            crate::quant::dequantize_to_vec(t.dtype, t.data, n)
                .map_err(|e| Error::tensor(t.path, t.name, e.to_string()))
        })
    }
}

/// Read a small float tensor (norms, biases) as f32.
pub fn read_f32(t: &TensorRef<'_>) -> Result<Vec<f32>> {
    crate::quant::dequantize_to_vec(t.dtype, t.data, t.n_elements() as usize)
        .map_err(|e| Error::tensor(t.path, t.name, e.to_string()))
}

/// Check a tensor's shape, naming it on mismatch.
pub fn expect_shape(t: &TensorRef<'_>, shape: &[u64]) -> Result<()> {
    if t.shape != shape {
        return Err(Error::tensor(
            t.path,
            t.name,
            format!("shape {:?}, expected {:?}", t.shape, shape),
        ));
    }
    Ok(())
}

/// A family's tensor-role enum: the name of a role in each format (one table per format).
pub trait TensorNames: Copy {
    /// llama.cpp's GGUF name.
    fn gguf_name(self) -> String;
    /// The name in the family's other format (HF checkpoint or the vendor's release layout).
    fn other_name(self) -> String;
}

/// Looks tensors up by role in whichever format `file` is, checking shapes. Families add
/// their own value transforms (norm folding, FP8 dequantization) in inherent impls.
pub struct Loader<'a, W> {
    pub file: &'a ModelFile,
    pub gguf: bool,
    _roles: std::marker::PhantomData<W>,
}

impl<'a, W: TensorNames> Loader<'a, W> {
    pub fn new(file: &'a ModelFile) -> Self {
        Loader {
            file,
            gguf: matches!(file, ModelFile::Gguf(_)),
            _roles: std::marker::PhantomData,
        }
    }
    pub fn name(&self, w: W) -> String {
        if self.gguf {
            w.gguf_name()
        } else {
            w.other_name()
        }
    }
    pub fn get(&self, w: W) -> Option<TensorRef<'a>> {
        self.file.tensor(&self.name(w))
    }
    pub fn req(&self, w: W) -> Result<TensorRef<'a>> {
        self.file.require(&self.name(w))
    }
    pub fn shaped(&self, w: W, shape: &[u64]) -> Result<TensorRef<'a>> {
        let t = self.req(w)?;
        expect_shape(&t, shape)?;
        Ok(t)
    }
}
