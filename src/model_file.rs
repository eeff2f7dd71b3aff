//! An opened model file of either format, below everything that reads a model: the
//! planner (`moe`), `inspect` and the model families.

use crate::gguf::GgufFile;
use crate::safetensors::HfModel;
use crate::tensor::TensorRef;
use crate::{Error, Result};
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
