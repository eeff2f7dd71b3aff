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
    /// Adapter memory the budget divides (`--gpu-mem`); `None`: detected
    /// (`moe::AdapterMemory::detect`). What the model needs beside its routed experts is
    /// taken first; the rest holds expert slots, so a model that fits runs all on the GPU.
    pub gpu_mem: Option<u64>,
    /// Share of each MoE layer's experts given arena slots (`--gpu-experts`, 0..=1);
    /// overrides the budget.
    pub gpu_experts: Option<f64>,
    /// Routing statistics (`--expert-stats`, written by `--save-expert-stats`) that choose
    /// the hot experts; without them the slots are spread evenly.
    pub expert_stats: Option<std::path::PathBuf>,
    /// Count every MoE layer's router picks ([`Engine::save_expert_stats`]), adding to the
    /// counts of `expert_stats` when given; costs one readback per MoE layer and token.
    pub collect_expert_stats: bool,
    /// Count them (as `collect_expert_stats`) and write them here by
    /// [`Engine::finish_expert_stats`], or when the model is dropped (`--save-expert-stats`).
    pub save_expert_stats: Option<std::path::PathBuf>,
    /// Residency policy while decoding; `None`: `moe::CacheConfig::default()`.
    pub expert_cache: Option<crate::moe::CacheConfig>,
    /// Kernels of many-token products (`--matmul`).
    pub matmul: crate::gpu::MatmulChoice,
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("adapter", &self.adapter)
            .field("kv_type", &self.kv_type)
            .field("ctx", &self.ctx)
            .field("max_seqs", &self.max_seqs)
            .field("gpu_mem", &self.gpu_mem)
            .field("gpu_experts", &self.gpu_experts)
            .field("expert_stats", &self.expert_stats)
            .field("collect_expert_stats", &self.collect_expert_stats)
            .field("save_expert_stats", &self.save_expert_stats)
            .field("expert_cache", &self.expert_cache)
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
            gpu_mem: None,
            gpu_experts: None,
            expert_stats: None,
            collect_expert_stats: false,
            save_expert_stats: None,
            expert_cache: None,
            matmul: Default::default(),
        }
    }
}

/// Which logits a batched forward returns for one sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    None,
    Last,
    All,
    /// The `k` (≤ `gpu::topk::MAX_TOP_K`) best logits of the last token, found on the GPU in
    /// the forward's pass, and with `lse` their row's log-sum-exp: only those come back
    /// ([`Logits::Top`]). What a sampler needs is [`crate::sample::SamplerConfig::gpu_want`].
    Top {
        k: u32,
        lse: bool,
    },
}

pub use crate::sample::TopLogits;

/// What a forward returned for one sequence.
#[derive(Clone, Debug, PartialEq)]
pub enum Logits {
    /// `[n, vocab]` row-major (empty for [`Want::None`]).
    Full(Vec<f32>),
    /// For [`Want::Top`].
    Top(TopLogits),
}

impl Logits {
    /// The full logits; a [`Logits::Top`] gives an empty vector.
    pub fn into_full(self) -> Vec<f32> {
        match self {
            Logits::Full(v) => v,
            Logits::Top(_) => Vec::new(),
        }
    }
}

/// What greedy decoding asks for: the argmax, found on the GPU.
pub const GREEDY: Want = Want::Top { k: 1, lse: false };

/// Checks the `k` of a [`Want::Top`].
pub(crate) fn check_want(w: Want) -> Result<()> {
    let max = crate::gpu::topk::MAX_TOP_K;
    match w {
        Want::Top { k, .. } if k == 0 || k > max => Err(Error::Invalid(format!(
            "top-{k} logits requested: supported 1..={max}"
        ))),
        _ => Ok(()),
    }
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

/// `p` that never steps back: the loaders count bytes uploaded (FP8 weights grow by 132/128,
/// vectors go up as f32) and the expert arena continues from the file's non-expert bytes, so
/// the two positions can disagree a little.
fn monotone(p: &Progress) -> Progress {
    let p = p.clone();
    let furthest = std::sync::atomic::AtomicU64::new(0);
    Arc::new(move |done, total| {
        let prev = furthest.fetch_max(done, std::sync::atomic::Ordering::Relaxed);
        p(prev.max(done), total)
    })
}

impl Engine {
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Engine> {
        let file = ModelFile::open(path)?;
        let arch = file.architecture()?;
        let tokenizer = load_tokenizer(&file)?;
        let decode_bytes = crate::inspect::decode_bytes(&file);
        let model_bytes = file.tensors().map(|t| t.data.len() as u64).sum();
        let gpu = Arc::new(Gpu::with_matmul(&opts.adapter, opts.matmul)?);
        let opts = &LoadOptions {
            progress: opts.progress.as_ref().map(monotone),
            ..opts.clone()
        };
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
        if let Some(p) = &opts.progress {
            // Everything is on the device (the loaders' total is the file's tensor bytes).
            p(model_bytes, model_bytes);
        }
        Ok(Engine {
            gpu,
            model,
            tokenizer,
            decode_bytes,
            model_bytes,
            path: path.to_path_buf(),
        })
    }

    /// The expert offload of a MoE model whose experts do not all have GPU slots (or whose
    /// routing is counted); `None` when every expert sits in its layer's stack.
    pub fn offload(&self) -> Option<&crate::gpu::moe::Offload> {
        match &self.model {
            Model::Qwen35(m) => m.offload.as_ref(),
            Model::DeepSeek4(m) => m.offload.as_ref(),
        }
    }

    /// Where the routed experts are: `None` for a model without them; all on the GPU
    /// (`hot_share` 1) when no offload was needed.
    pub fn placement_report(&self) -> Option<crate::gpu::moe::PlacementReport> {
        if let Some(o) = self.offload() {
            return Some(o.report());
        }
        let (n_moe, ne) = match &self.model {
            Model::Qwen35(m) => (
                m.hp.moe.as_ref().map_or(0, |_| m.n_moe_layers()),
                m.hp.moe.as_ref().map_or(0, |p| p.n_expert),
            ),
            Model::DeepSeek4(m) => (m.hp.n_layer, m.hp.n_expert),
        };
        (n_moe * ne > 0).then(|| crate::gpu::moe::PlacementReport {
            hot_experts: n_moe * ne,
            total_experts: n_moe * ne,
            hot_share: 1.0,
            hit_rate: 1.0,
            ..Default::default()
        })
    }

    /// Write the routing statistics counted since load (`LoadOptions::collect_expert_stats`,
    /// `--save-expert-stats`) for `--expert-stats` / `lathe plan`.
    pub fn save_expert_stats(&self, path: &Path) -> Result<()> {
        let stats = self.offload().and_then(|o| o.stats()).ok_or_else(|| {
            Error::Invalid(format!(
                "{}: no expert statistics were collected (a MoE model loaded with \
                 collect_expert_stats / --save-expert-stats)",
                path.display()
            ))
        })?;
        stats.save(path)
    }

    /// Write the statistics to `LoadOptions::save_expert_stats` now (nothing when unset);
    /// dropping the model afterwards writes nothing more. Returns the path written.
    pub fn finish_expert_stats(&self) -> Result<Option<std::path::PathBuf>> {
        match self.offload() {
            Some(o) => o.finish_stats(),
            None => Ok(None),
        }
    }

    /// Longest context (positions per sequence) the KV caches can grow to with
    /// `LoadOptions::max_seqs` sequences, where a binding limit bounds it; `None`: no such
    /// bound below what memory allows.
    pub fn max_context(&self) -> Option<usize> {
        match &self.model {
            Model::Qwen35(m) => Some(m.max_positions()),
            Model::DeepSeek4(_) => None,
        }
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

    /// Make `dst` hold exactly what `src` holds (KV rows, recurrent and compressor state,
    /// position), by copies on the GPU: a checkpoint to come back to, since recurrent state
    /// cannot be rolled back. `dst`'s earlier content is replaced; its caches grow if needed.
    pub fn copy_seq(&self, src: &Seq, dst: &mut Seq) -> Result<()> {
        match (&self.model, src, dst) {
            (Model::Qwen35(m), Seq::Qwen35(s), Seq::Qwen35(d)) => m.copy_seq(s, d),
            (Model::DeepSeek4(m), Seq::DeepSeek4(s), Seq::DeepSeek4(d)) => m.copy_seq(s, d),
            _ => Err(Error::Invalid("sequence from another model".into())),
        }
    }

    /// Feed several sequences in shared passes (continuous batching): per item its new
    /// tokens and which logits it wants; returns those logits per item ([`Logits::Top`]
    /// for [`Want::Top`], else [`Logits::Full`]).
    pub fn forward_batch_with(
        &mut self,
        items: &mut [(&mut Seq, &[u32], Want)],
    ) -> Result<Vec<Logits>> {
        for (_, _, w) in items.iter() {
            check_want(*w)?;
        }
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
                    Seq::DeepSeek4(q) => m.forward_want(q, t, *w),
                    _ => Err(Error::Invalid("sequence from another model".into())),
                })
                .collect(),
        }
    }

    /// [`Engine::forward_batch_with`] for full logits only: per item `[n, vocab]` row-major
    /// (empty for [`Want::None`]); a [`Want::Top`] item is an error.
    pub fn forward_batch(
        &mut self,
        items: &mut [(&mut Seq, &[u32], Want)],
    ) -> Result<Vec<Vec<f32>>> {
        if items.iter().any(|i| matches!(i.2, Want::Top { .. })) {
            return Err(Error::Invalid(
                "forward_batch returns full logits: use forward_batch_with for Want::Top".into(),
            ));
        }
        Ok(self
            .forward_batch_with(items)?
            .into_iter()
            .map(Logits::into_full)
            .collect())
    }

    /// Feed `tokens` to `seq`; the `k` best logits of the last token (and their row's
    /// log-sum-exp when `lse`), found on the GPU: a decode step reads back `8k + 4` bytes.
    pub fn forward_top(
        &mut self,
        seq: &mut Seq,
        tokens: &[u32],
        k: u32,
        lse: bool,
    ) -> Result<TopLogits> {
        if tokens.is_empty() {
            return Err(Error::Invalid("no tokens to run".into()));
        }
        match self
            .forward_batch_with(&mut [(seq, tokens, Want::Top { k, lse })])?
            .pop()
        {
            Some(Logits::Top(t)) => Ok(t),
            _ => Err(Error::Gpu("the forward returned no top logits".into())),
        }
    }

    /// One decode step of `token` timed per kernel with GPU timestamps: `(label, ns)` per
    /// dispatch, in order (a breakdown for `lathe bench`; slower than a normal step).
    pub fn profile_step(&mut self, seq: &mut Seq, token: u32) -> Result<Vec<(String, f64)>> {
        // The expert offload submits inside the layer loop: its passes are timed too.
        if let Some(o) = self.offload() {
            o.start_profile();
        }
        let mut prof = self.profile_pass(seq, &[token])?;
        if let Some(o) = self.offload() {
            prof.extend(o.take_profile());
        }
        Ok(prof)
    }

    /// GPU time of every dispatch of one prefill of `tokens` (as [`Engine::profile_step`]).
    pub fn profile_prefill(&mut self, seq: &mut Seq, tokens: &[u32]) -> Result<Vec<(String, f64)>> {
        if let Some(o) = self.offload() {
            o.start_profile();
        }
        let mut prof = self.profile_pass(seq, tokens)?;
        if let Some(o) = self.offload() {
            prof.extend(o.take_profile());
        }
        Ok(prof)
    }

    fn profile_pass(&mut self, seq: &mut Seq, tokens: &[u32]) -> Result<Vec<(String, f64)>> {
        match (&mut self.model, seq) {
            // The step a greedy generation takes: argmax on the GPU, a few bytes back.
            (Model::Qwen35(m), Seq::Qwen35(s)) => {
                m.profile = Some(Vec::new());
                let r = m.forward_batch(&mut [(s, tokens, GREEDY)]);
                let prof = m.profile.take().unwrap_or_default();
                r.map(|_| prof)
            }
            (Model::DeepSeek4(m), Seq::DeepSeek4(s)) => {
                m.profile = Some(Vec::new());
                let r = m.forward_want(s, tokens, GREEDY);
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
    Ok((logits_on(&mut e, tokens, prefill)?, v))
}

/// [`logits`] on a loaded engine (a fresh sequence).
pub fn logits_on(e: &mut Engine, tokens: &[u32], prefill: usize) -> Result<Vec<f32>> {
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
    Ok(out)
}
