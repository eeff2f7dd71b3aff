//! The library's front door: load a model by path with typed options, run tokens.

use crate::gpu::{AdapterChoice, Gpu};
use crate::models::ModelFile;
use crate::{Error, Result};
use std::path::Path;
use std::sync::Arc;

/// Element type of the attention KV cache. `Auto` is the architecture's default: f16 for
/// Qwen3.5 (its fixtures meet the bar with it, at half the bytes), f32 for DeepSeek-V4, whose
/// one shared K=V head is small but whose indexer top-k flips on f16-rounded keys (measured:
/// dsv4-dims RMS 0.02-0.033 against the reference with f16, 4e-6 with f32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvType {
    #[default]
    Auto,
    F16,
    F32,
}

impl std::str::FromStr for KvType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(KvType::Auto),
            "f16" => Ok(KvType::F16),
            "f32" => Ok(KvType::F32),
            _ => Err(Error::Invalid(format!(
                "--kv-type {s}: expected auto, f16 or f32"
            ))),
        }
    }
}

/// Called while weights upload: `(bytes done, bytes total)`.
pub type Progress = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// How to load and run a model. Defaults are what most users want.
#[derive(Clone)]
pub struct LoadOptions {
    pub adapter: AdapterChoice,
    pub kv_type: KvType,
    /// Context length the caches are sized for (they grow beyond it when needed).
    pub ctx: usize,
    /// Sequences that can be live at once (each holds a slot of KV and recurrent state).
    pub max_seqs: usize,
    pub progress: Option<Progress>,
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("adapter", &self.adapter)
            .field("kv_type", &self.kv_type)
            .field("ctx", &self.ctx)
            .field("max_seqs", &self.max_seqs)
            .finish()
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            adapter: AdapterChoice::Auto,
            kv_type: KvType::Auto,
            ctx: 4096,
            max_seqs: 4,
            progress: None,
        }
    }
}

/// Which logits a batched forward returns for one sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    None,
    Last,
    All,
}

/// A loaded model of any supported architecture.
pub enum Model {
    Qwen35(Box<crate::models::qwen35::gpu::GpuModel>),
    DeepSeek4(Box<crate::models::deepseek4::gpu::GpuModel>),
}

/// One sequence's state (KV cache, recurrent state) for a [`Model`].
pub enum Seq {
    Qwen35(crate::models::qwen35::gpu::GpuSeq),
    DeepSeek4(crate::models::deepseek4::gpu::GpuSeq),
}

impl Seq {
    /// Tokens this sequence has consumed.
    pub fn pos(&self) -> usize {
        match self {
            Seq::Qwen35(s) => s.pos(),
            Seq::DeepSeek4(s) => s.pos(),
        }
    }
}

/// A model ready to run, with its tokenizer when the file carries one.
pub struct Engine {
    pub gpu: Arc<Gpu>,
    pub model: Model,
    pub tokenizer: Option<crate::tokenizer::Tokenizer>,
    /// Bytes of weights a decode step reads (for speed reports).
    pub decode_bytes: u64,
    pub model_bytes: u64,
    pub path: std::path::PathBuf,
}

fn is_qwen35(arch: &str) -> bool {
    matches!(
        arch,
        "qwen35"
            | "qwen35moe"
            | "qwen3next"
            | "Qwen3_5ForCausalLM"
            | "Qwen3_5MoeForCausalLM"
            | "Qwen3NextForCausalLM"
            | "Qwen3_5ForConditionalGeneration"
            | "Qwen3_5MoeForConditionalGeneration"
    )
}

/// The tokenizer a model file carries: GGUF `tokenizer.ggml.*` (none for `model = "none"`),
/// or `tokenizer.json` in a HF directory.
pub fn load_tokenizer(file: &ModelFile) -> Result<Option<crate::tokenizer::Tokenizer>> {
    match file {
        ModelFile::Gguf(g) => match g.opt_str("tokenizer.ggml.model")? {
            None | Some("none") => Ok(None),
            Some(_) => Ok(Some(crate::tokenizer::Tokenizer::from_gguf(g)?)),
        },
        ModelFile::Hf(h) => {
            if h.dir().join("tokenizer.json").exists() {
                Ok(Some(crate::tokenizer::Tokenizer::from_hf_dir(h.dir())?))
            } else {
                Ok(None)
            }
        }
    }
}

impl Engine {
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Engine> {
        let file = ModelFile::open(path)?;
        let arch = file.architecture()?;
        let tokenizer = load_tokenizer(&file)?;
        let decode_bytes = crate::inspect::decode_bytes(&file);
        let model_bytes = file.tensors().map(|t| t.data.len() as u64).sum();
        let gpu = Arc::new(Gpu::new(&opts.adapter)?);
        let model = if is_qwen35(&arch) {
            Model::Qwen35(Box::new(crate::models::qwen35::gpu::GpuModel::load(
                gpu.clone(),
                &file,
                opts,
            )?))
        } else if matches!(arch.as_str(), "deepseek4" | "DeepseekV4ForCausalLM") {
            Model::DeepSeek4(Box::new(crate::models::deepseek4::gpu::GpuModel::load(
                gpu.clone(),
                &file,
                opts,
            )?))
        } else {
            return Err(Error::Unsupported(format!(
                "{}: architecture {arch}",
                path.display()
            )));
        };
        Ok(Engine {
            gpu,
            model,
            tokenizer,
            decode_bytes,
            model_bytes,
            path: path.to_path_buf(),
        })
    }

    pub fn vocab_size(&self) -> usize {
        match &self.model {
            Model::Qwen35(m) => m.hp.n_vocab,
            Model::DeepSeek4(m) => m.hp.n_vocab,
        }
    }

    pub fn new_seq(&self) -> Result<Seq> {
        match &self.model {
            Model::Qwen35(m) => Ok(Seq::Qwen35(m.new_seq()?)),
            Model::DeepSeek4(m) => Ok(Seq::DeepSeek4(m.new_seq()?)),
        }
    }

    /// Forget the sequence's history.
    pub fn reset(&self, seq: &mut Seq) -> Result<()> {
        match (&self.model, seq) {
            (Model::Qwen35(m), Seq::Qwen35(s)) => m.reset(s),
            (Model::DeepSeek4(m), Seq::DeepSeek4(s)) => m.reset(s),
            _ => Err(Error::Invalid("sequence from another model".into())),
        }
    }

    /// Feed several sequences in shared passes (continuous batching): per item its new
    /// tokens and which logits it wants; returns those logits per item.
    pub fn forward_batch(
        &mut self,
        items: &mut [(&mut Seq, &[u32], Want)],
    ) -> Result<Vec<Vec<f32>>> {
        match &mut self.model {
            Model::Qwen35(m) => {
                let mut v: Vec<(&mut crate::models::qwen35::gpu::GpuSeq, &[u32], Want)> =
                    Vec::with_capacity(items.len());
                for (s, t, w) in items.iter_mut() {
                    match s {
                        Seq::Qwen35(q) => v.push((q, t, *w)),
                        #[allow(unreachable_patterns)]
                        _ => return Err(Error::Invalid("sequence from another model".into())),
                    }
                }
                m.forward_batch(&mut v)
            }
            // One sequence after another (no shared passes yet).
            Model::DeepSeek4(m) => items
                .iter_mut()
                .map(|(s, t, w)| match s {
                    Seq::DeepSeek4(q) => {
                        let out = m.forward(q, t, *w == Want::All)?;
                        Ok(if *w == Want::None { Vec::new() } else { out })
                    }
                    _ => Err(Error::Invalid("sequence from another model".into())),
                })
                .collect(),
        }
    }

    /// One decode step of `token` timed per kernel with GPU timestamps: `(label, ns)` per
    /// dispatch, in order (a breakdown for `lathe bench`; slower than a normal step).
    pub fn profile_step(&mut self, seq: &mut Seq, token: u32) -> Result<Vec<(String, f64)>> {
        match (&mut self.model, seq) {
            (Model::Qwen35(m), Seq::Qwen35(s)) => {
                m.profile = Some(Vec::new());
                let r = m.forward(s, &[token], false);
                let prof = m.profile.take().unwrap_or_default();
                r.map(|_| prof)
            }
            (Model::DeepSeek4(m), Seq::DeepSeek4(s)) => {
                m.profile = Some(Vec::new());
                let r = m.forward(s, &[token], false);
                let prof = m.profile.take().unwrap_or_default();
                r.map(|_| prof)
            }
            _ => Err(Error::Invalid("sequence from another model".into())),
        }
    }

    /// Feed `tokens` to `seq`; logits of every token (`all`) or of the last one,
    /// `[n, vocab]` row-major.
    pub fn forward(&mut self, seq: &mut Seq, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::Invalid("no tokens to run".into()));
        }
        match (&mut self.model, seq) {
            (Model::Qwen35(m), Seq::Qwen35(s)) => m.forward(s, tokens, all),
            (Model::DeepSeek4(m), Seq::DeepSeek4(s)) => m.forward(s, tokens, all),
            _ => Err(Error::Invalid("sequence from another model".into())),
        }
    }
}

/// Logits for every position of `tokens`: the first `prefill` tokens as one batch, the rest
/// one per step through the decode path. Returns `(logits [T·vocab], vocab)`.
pub fn logits(
    path: &Path,
    tokens: &[u32],
    prefill: usize,
    opts: &LoadOptions,
) -> Result<(Vec<f32>, usize)> {
    let mut e = Engine::load(path, opts)?;
    eprintln!("{}", e.gpu.report());
    let v = e.vocab_size();
    let mut seq = e.new_seq()?;
    let prefill = prefill.min(tokens.len());
    let mut out = Vec::with_capacity(tokens.len() * v);
    if prefill > 0 {
        out.extend(e.forward(&mut seq, &tokens[..prefill], true)?);
    }
    for t in &tokens[prefill..] {
        out.extend(e.forward(&mut seq, std::slice::from_ref(t), true)?);
    }
    Ok((out, v))
}
