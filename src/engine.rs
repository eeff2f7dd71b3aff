//! The library's front door: load a model by path with typed options, run tokens.

use crate::gpu::Gpu;
use crate::model_file::ModelFile;
use crate::{Error, Result};
use std::path::Path;
use std::sync::Arc;

pub use crate::forward::{KvType, LoadOptions, Logits, Progress, Want, GREEDY};
pub use crate::gpu::topk::TopLogits;
pub use crate::gpu::ActivationsChoice;
pub use crate::models::{Forward, Seq};
pub use crate::moe::{ColdLayers, ExpertStream};

/// A model ready to run, with its tokenizer when the file carries one.
pub struct Engine {
    /// The device (the first of `gpus` for a model split over several).
    pub gpu: Arc<Gpu>,
    /// Every device the model runs on, in layer order.
    pub gpus: Vec<Arc<Gpu>>,
    pub model: Box<dyn Forward>,
    pub tokenizer: Option<crate::tokenizer::Tokenizer>,
    /// Bytes of weights a decode step reads (for speed reports).
    pub decode_bytes: u64,
    pub model_bytes: u64,
    pub path: std::path::PathBuf,
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
        let tokenizer = load_tokenizer(&file)?;
        let decode_bytes = crate::inspect::decode_bytes(&file);
        let model_bytes = file.tensors().map(|t| t.data.len() as u64).sum();
        let exact = crate::models::auto_products(&file);
        let opts = &LoadOptions {
            progress: opts.progress.as_ref().map(monotone),
            ..opts.clone()
        };
        let (gpus, model): (Vec<Arc<Gpu>>, Box<dyn Forward>) = if opts.devices.len() > 1 {
            let (gpus, chain) = crate::models::chain::Chain::load(&file, opts, exact)?;
            (gpus, Box::new(chain))
        } else {
            let adapter = opts.devices.first().unwrap_or(&opts.adapter);
            let gpu = Arc::new(
                Gpu::with_matmul(adapter, opts.matmul, exact)?
                    .with_int8_decode(opts.activations.int8()),
            );
            (vec![gpu.clone()], crate::models::load(gpu, &file, opts)?)
        };
        if let Some(p) = &opts.progress {
            // Everything is on the device (the loaders' total is the file's tensor bytes).
            p(model_bytes, model_bytes);
        }
        Ok(Engine {
            gpu: gpus[0].clone(),
            gpus,
            model,
            tokenizer,
            decode_bytes,
            model_bytes,
            path: path.to_path_buf(),
        })
    }

    /// The expert offload of a MoE model whose experts do not all have GPU slots (or whose
    /// routing is counted); `None` when every expert sits in its layer's stack.
    pub fn offload(&self) -> Option<&crate::moe::Offload> {
        self.model.offload()
    }

    /// Where the routed experts are: `None` for a model without them; all on the GPU
    /// (`hot_share` 1) when no offload was needed.
    /// A model split over several devices adds its parts' offloads up (experts without one
    /// are all hot; the hit rate is the parts' weighted by their experts).
    pub fn placement_report(&self) -> Option<crate::moe::PlacementReport> {
        let n = self.model.routed_experts();
        let offs = self.model.offloads();
        if !offs.is_empty() {
            let reps: Vec<_> = offs.iter().map(|o| o.report()).collect();
            let cold: usize = reps.iter().map(|r| r.total_experts - r.hot_experts).sum();
            let hot = n.saturating_sub(cold);
            let weight: usize = reps.iter().map(|r| r.total_experts).sum();
            let memory: Vec<String> = reps.iter().filter_map(|r| r.memory.clone()).collect();
            return Some(crate::moe::PlacementReport {
                hot_experts: hot,
                total_experts: n,
                hot_share: hot as f64 / n.max(1) as f64,
                arena_bytes: reps.iter().map(|r| r.arena_bytes).sum(),
                hit_rate: reps
                    .iter()
                    .map(|r| r.hit_rate * r.total_experts as f64)
                    .sum::<f64>()
                    / weight.max(1) as f64,
                uploads: reps.iter().map(|r| r.uploads).sum(),
                cold_pairs: reps.iter().map(|r| r.cold_pairs).sum(),
                uploaded_bytes_per_token: reps.iter().map(|r| r.uploaded_bytes_per_token).sum(),
                streamed_bytes: reps.iter().map(|r| r.streamed_bytes).sum(),
                streamed_pairs: reps.iter().map(|r| r.streamed_pairs).sum(),
                memory: (!memory.is_empty()).then(|| memory.join(" | ")),
            });
        }
        (n > 0).then(|| crate::moe::PlacementReport {
            hot_experts: n,
            total_experts: n,
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

    /// Device boundary crossings since load, for a model split over several devices.
    pub fn hops(&self) -> Option<crate::models::chain::HopReport> {
        self.model.hops()
    }

    /// One line per device for stderr ([`Gpu::report`]).
    pub fn report(&self) -> String {
        let lines: Vec<String> = self.gpus.iter().map(|g| g.report()).collect();
        lines.join("\n")
    }

    /// Longest context (positions per sequence) the KV caches can grow to with
    /// `LoadOptions::max_seqs` sequences, where a binding limit bounds it; `None`: no such
    /// bound below what memory allows.
    pub fn max_context(&self) -> Option<usize> {
        self.model.max_context()
    }

    /// Rows of one pass: a longer prompt runs in passes of this many tokens (longer for a
    /// MoE model whose prompts stream cold experts: `moe::offload::STREAM_ROWS`).
    pub fn pass_rows(&self) -> usize {
        self.model.pass_rows()
    }

    /// Runs, on scratch sequences, the passes whose pipelines a session would otherwise
    /// compile on first use (hundreds of ms each on a GPU, seconds on a CPU adapter), so that
    /// neither the speeds reported afterwards nor a server's first requests pay for them
    /// (llama.cpp warms up the same way). Passes of the row counts whose products take
    /// different kernels: the token-group matvec's group sizes (2..=8 rows) and the MoE
    /// products' first many-token one (9), the first dense many-token product
    /// (`DENSE_MATVEC_TOKENS + 1`) and the largest; as prompt passes up to `prompt_rows`
    /// (capped by [`Engine::pass_rows`]), then as batched decode steps of up to `max_batch`
    /// sequences, one of them holding the longest prompt (a long enough context splits the
    /// attention); and the GPU samplers (greedy; top-k with log-sum-exp). Not warmed:
    /// passes mixing a prompt chunk with decode rows past those counts, speculative
    /// decoding's passes (full-logits rows in a batched step compile nothing of their own:
    /// tests/sample_gpu.rs). An expert offload's statistics and counters forget these
    /// passes.
    pub fn warm_up(&mut self, max_batch: usize, prompt_rows: usize) -> Result<()> {
        let counts: Vec<_> = self.model.offloads().iter().map(|o| o.counts()).collect();
        self.warm_passes(max_batch, prompt_rows)?;
        for (o, c) in self.model.offloads().into_iter().zip(counts) {
            o.restore_counts(c);
        }
        Ok(())
    }

    fn warm_passes(&mut self, max_batch: usize, prompt_rows: usize) -> Result<()> {
        let rows = prompt_rows.min(self.pass_rows()).max(2);
        let many = crate::gpu::matmul::DENSE_MATVEC_TOKENS as usize + 1;
        let sizes = |top: usize| -> Vec<usize> {
            let mut v: Vec<usize> = (2..=9).chain([many, top]).filter(|&n| n <= top).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        let mut seqs = (0..max_batch.max(1))
            .map(|_| self.new_seq())
            .collect::<Result<Vec<_>>>()?;
        for n in sizes(rows) {
            self.reset(&mut seqs[0])?;
            self.forward(&mut seqs[0], &vec![0; n], false)?;
        }
        self.forward(&mut seqs[0], &[0], false)?;
        self.forward_top(&mut seqs[0], &[0], 1, false)?;
        self.forward_top(&mut seqs[0], &[0], 40, true)?;
        let top = Want::Top { k: 40, lse: true };
        for n in sizes(max_batch) {
            let mut items: Vec<(&mut Seq, &[u32], Want)> = seqs
                .iter_mut()
                .take(n)
                .map(|s| (s, &[0u32][..], top))
                .collect();
            self.forward_batch_with(&mut items)?;
        }
        Ok(())
    }

    pub fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    pub fn new_seq(&self) -> Result<Seq> {
        self.model.new_seq()
    }

    /// Forget the sequence's history.
    pub fn reset(&self, seq: &mut Seq) -> Result<()> {
        self.model.reset(seq)
    }

    /// Make `dst` hold exactly what `src` holds (KV rows, recurrent and compressor state,
    /// position), by copies on the GPU: a checkpoint to come back to, since recurrent state
    /// cannot be rolled back. `dst`'s earlier content is replaced; its caches grow if needed.
    pub fn copy_seq(&self, src: &Seq, dst: &mut Seq) -> Result<()> {
        self.model.copy_seq(src, dst)
    }

    /// Feed several sequences in shared passes (continuous batching): per item its new
    /// tokens and which logits it wants; returns those logits per item ([`Logits::Top`]
    /// for [`Want::Top`], else [`Logits::Full`]).
    pub fn forward_batch_with(
        &mut self,
        items: &mut [(&mut Seq, &[u32], Want)],
    ) -> Result<Vec<Logits>> {
        for (_, _, w) in items.iter() {
            crate::forward::check_want(*w)?;
        }
        self.model.forward_batch(items)
    }

    /// Feed `tokens` to `seq`; the final-norm hidden state of every token, `[n, n_embd]`
    /// row-major (what the head reads: an embedding pools it), through
    /// [`Forward::hidden_out`]. A model split over several devices refuses.
    pub fn hidden_states(&mut self, seq: &mut Seq, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::Invalid("no tokens to run".into()));
        }
        self.model.hidden_out(true)?;
        let r = self.model.forward_batch(&mut [(seq, tokens, Want::All)]);
        self.model.hidden_out(false)?;
        Ok(r?.pop().map(Logits::into_full).unwrap_or_default())
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
        self.profile_batch(&mut [(seq, &[token])])
    }

    /// One greedy decode step of `token` with the expert offload's per-layer timeline (host
    /// waits, CPU and GPU busy per MoE layer; `lathe bench --moe-timeline`). Empty for a
    /// model without an offload.
    pub fn timeline_step(
        &mut self,
        seq: &mut Seq,
        token: u32,
    ) -> Result<Vec<crate::moe::LayerTimes>> {
        match self.offload() {
            Some(o) => o.start_timeline(&self.gpu),
            None => return Ok(Vec::new()),
        }
        self.forward_batch_with(&mut [(seq, &[token], GREEDY)])?;
        match self.offload() {
            Some(o) => o.take_timeline(&self.gpu),
            None => Ok(Vec::new()),
        }
    }

    /// GPU time of every dispatch of one prefill of `tokens` (as [`Engine::profile_step`]).
    pub fn profile_prefill(&mut self, seq: &mut Seq, tokens: &[u32]) -> Result<Vec<(String, f64)>> {
        self.profile_batch(&mut [(seq, tokens)])
    }

    /// One greedy pass over several sequences' tokens together (a batched decode step, as
    /// `lathe serve` runs them), timed per dispatch as [`Engine::profile_step`].
    pub fn profile_batch(
        &mut self,
        items: &mut [(&mut Seq, &[u32])],
    ) -> Result<Vec<(String, f64)>> {
        if items.is_empty() || items.iter().any(|i| i.1.is_empty()) {
            return Err(Error::Invalid("no tokens to run".into()));
        }
        // The expert offload submits inside the layer loop: its passes are timed too.
        if let Some(o) = self.offload() {
            o.start_profile();
        }
        let mut prof = self.model.profile(items)?;
        if let Some(o) = self.offload() {
            prof.extend(o.take_profile());
        }
        Ok(prof)
    }

    /// Feed `tokens` to `seq`; logits of every token (`all`) or of the last one,
    /// `[n, vocab]` row-major.
    pub fn forward(&mut self, seq: &mut Seq, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::Invalid("no tokens to run".into()));
        }
        self.model.forward(seq, tokens, all)
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
    eprintln!("{}", e.report());
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
