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

    /// Token ids the model must never emit, each below `n_vocab`: GGUF
    /// `tokenizer.ggml.suppress_tokens`, or `suppress_tokens` in a checkpoint's
    /// `generation_config.json` (what transformers' `SuppressTokensLogitsProcessor` masks).
    /// Empty where the file names none.
    pub fn suppress_tokens(&self, n_vocab: usize) -> Result<Vec<u32>> {
        let (ids, source) = match self {
            ModelFile::Gguf(g) => {
                let key = crate::gguf::keys::TOKENIZER_SUPPRESS_TOKENS;
                let ids = match g.get(key) {
                    None => Vec::new(),
                    Some(_) => g.get_i64_array(key)?,
                };
                (ids, format!("{}: {key}", g.path().display()))
            }
            ModelFile::Hf(h) => {
                let path = h.dir().join("generation_config.json");
                let ids = if path.is_file() {
                    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
                    let v: serde_json::Value = serde_json::from_str(&text)
                        .map_err(|e| Error::format(&path, format!("invalid JSON: {e}")))?;
                    match v.get("suppress_tokens") {
                        None | Some(serde_json::Value::Null) => Vec::new(),
                        Some(serde_json::Value::Array(a)) => a
                            .iter()
                            .map(|x| {
                                x.as_i64().ok_or_else(|| {
                                    Error::format(
                                        &path,
                                        format!("suppress_tokens holds {x}, not a token id"),
                                    )
                                })
                            })
                            .collect::<Result<_>>()?,
                        Some(x) => {
                            return Err(Error::format(
                                &path,
                                format!("suppress_tokens is {x}, not a list of token ids"),
                            ))
                        }
                    }
                } else {
                    Vec::new()
                };
                (ids, format!("{}: suppress_tokens", path.display()))
            }
        };
        ids.into_iter()
            .map(|id| {
                u32::try_from(id)
                    .ok()
                    .filter(|&i| (i as usize) < n_vocab)
                    .ok_or_else(|| {
                        Error::Invalid(format!(
                            "{source}: token id {id} is outside the vocabulary of {n_vocab}"
                        ))
                    })
            })
            .collect()
    }
}

/// One device's share of a model split over several (`models::chain`): a contiguous range
/// of layers; the first part also embeds the tokens, the last one holds the output head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartSpec {
    pub layers: std::ops::Range<usize>,
    pub first: bool,
    pub last: bool,
}

/// Which part of a model a weight belongs to, for [`PartSpec::holds`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightRole {
    /// A block's weight.
    Layer(usize),
    /// The token embedding (also the head of a model that ties them).
    Embedding { tied: bool },
    /// Everything after the blocks: output norm, head, extra blocks past `n_layer`.
    Head,
}

impl PartSpec {
    /// The whole model of `n_layer` blocks.
    pub fn whole(n_layer: usize) -> PartSpec {
        PartSpec {
            layers: 0..n_layer,
            first: true,
            last: true,
        }
    }

    /// Whether this part uploads a weight of `role`.
    pub fn holds(&self, role: WeightRole) -> bool {
        match role {
            WeightRole::Layer(l) => self.layers.contains(&l),
            WeightRole::Embedding { tied } => self.first || (self.last && tied),
            WeightRole::Head => self.last,
        }
    }

    /// The role of the tensor `name` of a model of `n_layer` blocks whose embedding is
    /// `embedding`: blocks by the layer number of the naming schemes lathe reads (GGUF
    /// `blk.N.`, Hugging Face `model.layers.N.` / `model.language_model.layers.N.`,
    /// DeepSeek `layers.N.`); numbers past the blocks (llama.cpp's next-token-prediction
    /// blocks) and other prefixes (`mtp.`) belong with the head.
    pub fn role(name: &str, n_layer: usize, embedding: &str, tied: bool) -> WeightRole {
        if name == embedding {
            return WeightRole::Embedding { tied };
        }
        let rest = [
            "blk.",
            "model.language_model.layers.",
            "model.layers.",
            "layers.",
        ]
        .iter()
        .find_map(|p| name.strip_prefix(p));
        match rest.and_then(|r| r.split('.').next()?.parse::<usize>().ok()) {
            Some(l) if l < n_layer => WeightRole::Layer(l),
            _ => WeightRole::Head,
        }
    }
}
