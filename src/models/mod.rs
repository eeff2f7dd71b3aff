//! Model architectures. One module per family; each has three parts: hyper-parameters
//! (from GGUF metadata or `config.json`), tensor loading (one name table per format, with
//! the value transforms that make both formats one layout), and the forward pass.
//!
//! This file holds what every family shares: the opened model file and the description of
//! a weight as the loaders hand it to a backend (GPU upload or CPU reference).

pub mod deepseek4;
pub mod qwen35;

use crate::gguf::GgufFile;
use crate::safetensors::HfModel;
use crate::tensor::TensorRef;
use crate::{DType, Error, Result};
use std::path::{Path, PathBuf};

/// A model file: a GGUF (possibly split) or a Hugging Face checkpoint directory.
pub enum ModelFile {
    Gguf(GgufFile),
    Hf(HfModel),
}

impl ModelFile {
    /// Open `path`: a directory is a HF checkpoint, anything else a GGUF file.
    pub fn open(path: impl AsRef<Path>) -> Result<ModelFile> {
        let path = path.as_ref();
        if !path.exists() {
            return Err(Error::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
            ));
        }
        if path.is_dir() {
            Ok(ModelFile::Hf(HfModel::open(path)?))
        } else {
            Ok(ModelFile::Gguf(GgufFile::open(path)?))
        }
    }

    pub fn path(&self) -> PathBuf {
        match self {
            ModelFile::Gguf(g) => g.path().to_path_buf(),
            ModelFile::Hf(h) => h.dir().to_path_buf(),
        }
    }

    /// The architecture name: GGUF `general.architecture` (`qwen35`, `deepseek4`, ...) or
    /// the first of HF `architectures` (`Qwen3_5ForCausalLM`, ...).
    pub fn architecture(&self) -> Result<String> {
        match self {
            ModelFile::Gguf(g) => Ok(g.architecture()?.to_string()),
            ModelFile::Hf(h) => h.architecture(),
        }
    }

    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        match self {
            ModelFile::Gguf(g) => g.tensor(name),
            ModelFile::Hf(h) => h.tensor(name),
        }
    }

    pub fn require(&self, name: &str) -> Result<TensorRef<'_>> {
        match self {
            ModelFile::Gguf(g) => g.require(name),
            ModelFile::Hf(h) => h.require(name),
        }
    }

    pub fn tensors(&self) -> Box<dyn Iterator<Item = TensorRef<'_>> + '_> {
        match self {
            ModelFile::Gguf(g) => Box::new(g.tensors()),
            ModelFile::Hf(h) => Box::new(h.tensors()),
        }
    }
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
