//! `lathe bench`: prefill and decode speed of a model, llama-bench style, with the adapter's
//! measured read bandwidth as the yardstick for decode.
//!
//! Prefill: `n_prompt` random token ids in one `forward`. Decode: `n_gen` single-token
//! forwards as greedy generation runs them (what a user waits for): the argmax found on the
//! GPU in the step's pass, 12 bytes read back instead of the vocabulary's logits. Each
//! test runs `reps` times on a fresh sequence, optionally after filling the context to
//! `depth` tokens (untimed); speeds are mean ± sample standard deviation of tokens/s over
//! the repetitions, as llama-bench reports them.
//!
//! Roofline: decode is bound by weight reads, so `tok/s × bytes read per token` over the
//! adapter's stream bandwidth says how close decode runs to the hardware's limit. The
//! bandwidth comes from [`stream_bandwidth`], a read-only kernel of 16-byte coalesced loads.

use crate::engine::{Engine, LoadOptions, Seq, GREEDY};
use crate::gpu::{grid, AdapterChoice, Binding, Gpu, PipelineKey, PipelineSpec};
use crate::inspect::human_bytes;
use crate::{Error, Result};
use serde_json::{json, Value as Json};
use std::fmt::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Prompt tokens per prefill test (0: skip prefill).
    pub n_prompt: usize,
    /// Tokens per decode test (0: skip decode).
    pub n_gen: usize,
    /// Repetitions of each test.
    pub reps: usize,
    /// Context filled (untimed) before each test.
    pub depth: usize,
    /// Seeds the random token ids.
    pub seed: u64,
    /// How to load the model (adapter, devices, expert placement, kernels). The bench sizes
    /// the context (`ctx`) and the sequences (`max_seqs`) itself, from the tests.
    pub load: LoadOptions,
    /// Decode with speculation (`--spec`): greedy from the model's own picks.
    pub spec: Option<crate::spec::SpecOptions>,
    /// The draft model of `--spec draft` (`--draft-model`), loaded on the model's adapter
    /// with its kernels as `lathe run` and `serve` load it.
    pub draft_model: Option<std::path::PathBuf>,
    /// Record one more decode step's per-MoE-layer timeline (`--moe-timeline`).
    pub timeline: bool,
    /// Sequences decoded together (`--parallel`): every decode step is one batched pass of
    /// one token of each, as `lathe serve --parallel N` runs its requests; the decode speed
    /// is then the aggregate over all of them.
    pub parallel: usize,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            n_prompt: 512,
            n_gen: 128,
            reps: 5,
            depth: 0,
            seed: 0,
            load: LoadOptions::default(),
            spec: None,
            draft_model: None,
            timeline: false,
            parallel: 1,
        }
    }
}

/// Tokens/s of one test over its repetitions.
#[derive(Clone, Debug)]
pub struct Stat {
    /// Tokens per repetition.
    pub tokens: usize,
    pub tok_s: f64,
    /// Sample standard deviation (0 for one repetition).
    pub sd: f64,
    /// Tokens/s of each repetition.
    pub runs: Vec<f64>,
}

impl Stat {
    fn new(tokens: usize, seconds: &[f64]) -> Stat {
        let runs: Vec<f64> = seconds
            .iter()
            .map(|&s| tokens as f64 / s.max(1e-12))
            .collect();
        let n = runs.len() as f64;
        let mean = runs.iter().sum::<f64>() / n;
        let sd = if runs.len() > 1 {
            (runs.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        Stat {
            tokens,
            tok_s: mean,
            sd,
            runs,
        }
    }

    fn json(&self) -> Json {
        json!({"tokens": self.tokens, "tok_s": self.tok_s, "sd": self.sd, "runs": self.runs})
    }
}

/// The adapter's read bandwidth as [`stream_bandwidth`] measured it.
#[derive(Clone, Copy, Debug)]
pub struct Bandwidth {
    /// Bytes per second.
    pub bytes_per_s: f64,
    /// Size of the buffer streamed.
    pub buffer_bytes: u64,
}

/// Everything `lathe bench` reports.
#[derive(Clone, Debug)]
pub struct BenchReport {
    pub model: String,
    pub arch: String,
    pub adapter: String,
    pub backend: String,
    pub device_type: String,
    /// Bytes of all weights.
    pub bytes: u64,
    /// Weight bytes one decode step reads (routed experts counted at `n_used / n_expert`).
    pub bytes_per_token: u64,
    pub depth: usize,
    pub reps: usize,
    /// Sequences of each decode step ([`BenchOptions::parallel`]).
    pub parallel: usize,
    pub load_s: f64,
    pub prefill: Option<Stat>,
    pub decode: Option<Stat>,
    /// Host time per decode step (one token of each of [`BenchReport::parallel`] sequences)
    /// spent recording and encoding passes up to their submit
    /// ([`Gpu::host_ns`](crate::gpu::Gpu::host_ns) over the timed decode steps, in µs): what
    /// the GPU waits for when the host is slower than the kernels. `queue.submit` itself is
    /// left out (lavapipe runs compute inside it).
    pub host_us_per_token: Option<f64>,
    /// GPU busy time of one decode step in µs: the dispatches' timestamp pairs summed (the
    /// `kernels` breakdown), gaps between dispatches excluded; `None` without timestamp
    /// queries.
    pub gpu_us_per_token: Option<f64>,
    pub bandwidth: Bandwidth,
    /// GPU time of one decode step by kernel (summed over its dispatches, longest first),
    /// when the adapter has timestamp queries.
    pub kernels: Option<Vec<KernelTime>>,
    /// GPU time of one prefill of `n_prompt` tokens by kernel, as `kernels`.
    pub prefill_kernels: Option<Vec<KernelTime>>,
    /// Where a MoE model's routed experts were at the end (`None` for a dense model).
    pub placement: Option<crate::moe::PlacementReport>,
    /// The product path the timed prefills ran (`coop` when the matrix units took products,
    /// `tiled`, `none` without prefill or when every product took matvec).
    pub matmul: &'static str,
    /// Activations of the decode products: `int8` or `f32` (`--activations` resolved).
    pub activations: &'static str,
    /// Whether the decode products read x through fused prologues (`--fused-loads`).
    pub fused_loads: bool,
    /// What speculation did in the decode test, and what its pieces cost.
    pub spec: Option<(crate::spec::SpecStats, crate::spec::StepCosts)>,
    /// Pipelines compiled during the timed repetitions (on every device, a draft model's
    /// included): 0 when the warm-up compiled everything they use.
    pub compiled_while_timed: usize,
    /// One decode step's per-MoE-layer timeline (`BenchOptions::timeline`; empty without an
    /// expert offload).
    pub timeline: Option<Vec<crate::moe::LayerTimes>>,
    /// A model split over several devices: the boundary crossings of the timed prefills and
    /// decode steps.
    pub hops: Option<Hops>,
}

/// Device boundary crossings of the timed tests of a split model, per prefill and per
/// decode step.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Hops {
    pub devices: usize,
    pub prefill: Option<HopStep>,
    pub decode: Option<HopStep>,
}

/// Crossings of one prefill or one decode step, averaged over the repetitions.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct HopStep {
    pub hops: f64,
    pub bytes: f64,
    /// Host time of one crossing (read back on the sender, written on the receiver).
    pub us_per_hop: f64,
}

impl HopStep {
    fn new(r: &crate::models::chain::HopReport, steps: usize) -> HopStep {
        let steps = steps.max(1) as f64;
        HopStep {
            hops: r.hops as f64 / steps,
            bytes: r.bytes as f64 / steps,
            us_per_hop: r.us_per_hop(),
        }
    }
}

/// One kernel's share of a decode step.
#[derive(Clone, Debug)]
pub struct KernelTime {
    /// The dispatch label (pipeline variant).
    pub label: String,
    /// Dispatches with this label in the step.
    pub calls: usize,
    /// Summed GPU time in nanoseconds.
    pub ns: f64,
}

impl BenchReport {
    /// Decode's weight-read rate over the stream bandwidth.
    pub fn roofline_fraction(&self) -> Option<f64> {
        let d = self.decode.as_ref()?;
        // a batched step reads the weights once for all of its sequences
        let steps_s = d.tok_s / self.parallel.max(1) as f64;
        Some(steps_s * self.bytes_per_token as f64 / self.bandwidth.bytes_per_s)
    }

    /// One JSON object (the `--json` output).
    pub fn json(&self) -> Json {
        json!({
            "model": self.model,
            "arch": self.arch,
            "adapter": self.adapter,
            "backend": self.backend,
            "device_type": self.device_type,
            "bytes": self.bytes,
            "bytes_per_token": self.bytes_per_token,
            "depth": self.depth,
            "parallel": self.parallel,
            "reps": self.reps,
            "load_s": self.load_s,
            "prefill": self.prefill.as_ref().map(Stat::json),
            "decode": self.decode.as_ref().map(Stat::json),
            "host_us_per_token": self.host_us_per_token,
            "gpu_us_per_token": self.gpu_us_per_token,
            "bandwidth_gbs": self.bandwidth.bytes_per_s / 1e9,
            "bandwidth_buffer_bytes": self.bandwidth.buffer_bytes,
            "roofline_fraction": self.roofline_fraction(),
            "kernels": self.kernels.as_ref().map(|k| {
                k.iter()
                    .map(|k| json!({"label": k.label, "calls": k.calls, "ns": k.ns}))
                    .collect::<Vec<_>>()
            }),
            "prefill_kernels": self.prefill_kernels.as_ref().map(|k| {
                k.iter()
                    .map(|k| json!({"label": k.label, "calls": k.calls, "ns": k.ns}))
                    .collect::<Vec<_>>()
            }),
            "placement": self.placement.as_ref().and_then(|p| serde_json::to_value(p).ok()),
            "matmul": self.matmul,
            "activations": self.activations,
            "fused_loads": self.fused_loads,
            "spec": self.spec.as_ref().map(|(s, c)| json!({
                "acceptance": s.acceptance(),
                "tokens_per_forward": s.tokens_per_forward(),
                "drafted": s.drafted,
                "accepted": s.accepted,
                "verify_passes": s.verify_passes,
                "decode_step_ms": c.decode * 1e3,
                "mtp_draft_ms": c.mtp_draft.map(|t| t * 1e3),
                "draft_model_step_ms": c.draft_step.map(|t| t * 1e3),
                "verify_ms": c.verify.iter().map(|(k, t)| json!({"k": k, "ms": t * 1e3})).collect::<Vec<_>>(),
            })),
            "timeline": self.timeline,
            "compiled_while_timed": self.compiled_while_timed,
            "hops": self.hops.as_ref().and_then(|h| serde_json::to_value(h).ok()),
        })
    }

    /// llama-bench's markdown table plus the roofline line.
    pub fn table(&self) -> String {
        let name = Path::new(&self.model)
            .file_name()
            .map_or(self.model.clone(), |n| n.to_string_lossy().into_owned());
        let backend = format!("{} {}", self.backend, self.adapter);
        let at = if self.depth > 0 {
            format!(" @ d{}", self.depth)
        } else {
            String::new()
        };
        let mut s = String::new();
        writeln!(s, "| model | size | backend | test | t/s |").ok();
        writeln!(s, "| --- | ---: | --- | ---: | ---: |").ok();
        let mut row = |test: String, st: &Stat| {
            writeln!(
                s,
                "| {name} ({}) | {} | {backend} | {test}{at} | {:.2} ± {:.2} |",
                self.arch,
                human_bytes(self.bytes),
                st.tok_s,
                st.sd
            )
            .ok();
        };
        if let Some(p) = &self.prefill {
            row(format!("pp{}", p.tokens), p);
        }
        if let Some(d) = &self.decode {
            match self.parallel {
                1 => row(format!("tg{}", d.tokens), d),
                n => row(format!("tg{} x{n}", d.tokens / n), d),
            }
        }
        writeln!(
            s,
            "\ndecode reads {} per token; stream bandwidth {:.1} GB/s",
            human_bytes(self.bytes_per_token),
            self.bandwidth.bytes_per_s / 1e9
        )
        .ok();
        if let Some(f) = self.roofline_fraction() {
            writeln!(
                s,
                "decode runs at {:.1}% of the bandwidth roofline ({:.1} tok/s possible)",
                100.0 * f,
                self.parallel as f64 * self.bandwidth.bytes_per_s
                    / self.bytes_per_token.max(1) as f64
            )
            .ok();
        }
        if let Some(h) = self.host_us_per_token {
            writeln!(s, "host time per decode step (record, encode): {h:.1} µs").ok();
        }
        match &self.kernels {
            Some(k) => {
                let total: f64 = k.iter().map(|k| k.ns).sum();
                writeln!(
                    s,
                    "\none decode step on the GPU: {:.1} µs in {} dispatches\n\n\
                     | kernel | calls | µs | share |\n| --- | ---: | ---: | ---: |",
                    total / 1e3,
                    k.iter().map(|k| k.calls).sum::<usize>()
                )
                .ok();
                for k in k.iter().take(KERNEL_ROWS) {
                    writeln!(
                        s,
                        "| {} | {} | {:.1} | {:.1}% |",
                        k.label,
                        k.calls,
                        k.ns / 1e3,
                        100.0 * k.ns / total.max(1e-9)
                    )
                    .ok();
                }
                if k.len() > KERNEL_ROWS {
                    let rest: f64 = k[KERNEL_ROWS..].iter().map(|k| k.ns).sum();
                    writeln!(
                        s,
                        "| ({} more) | | {:.1} | {:.1}% |",
                        k.len() - KERNEL_ROWS,
                        rest / 1e3,
                        100.0 * rest / total.max(1e-9)
                    )
                    .ok();
                }
            }
            None => {
                writeln!(
                    s,
                    "per-kernel breakdown: the adapter has no timestamp queries"
                )
                .ok();
            }
        }
        if let Some((st, c)) = &self.spec {
            writeln!(
                s,
                "\nspeculation: {:.1}% of {} drafts accepted, {:.2} tokens per verify pass; \
                 decode step {:.3} ms, MTP draft {}, draft model step {}",
                100.0 * st.acceptance(),
                st.drafted,
                st.tokens_per_forward(),
                c.decode * 1e3,
                c.mtp_draft
                    .map_or("-".to_string(), |t| format!("{:.3} ms", t * 1e3)),
                c.draft_step
                    .map_or("-".to_string(), |t| format!("{:.3} ms", t * 1e3))
            )
            .ok();
            for (k, t) in &c.verify {
                writeln!(
                    s,
                    "  verify {} tokens: {:.3} ms ({:.2}x a decode step)",
                    k + 1,
                    t * 1e3,
                    t / c.decode
                )
                .ok();
            }
        }
        if self.compiled_while_timed > 0 {
            writeln!(
                s,
                "\nnote: {} pipelines were compiled during the timed repetitions (their speeds \
                 include the compiles)",
                self.compiled_while_timed
            )
            .ok();
        }
        s
    }
}

/// Kernels listed in the table's breakdown (the rest are summed in one row).
const KERNEL_ROWS: usize = 15;

/// splitmix64: random token ids without a dependency.
struct Ids(u64);

impl Ids {
    fn take(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n)
            .map(|_| {
                self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = self.0;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                ((z ^ (z >> 31)) % vocab as u64) as u32
            })
            .collect()
    }
}

/// Tokens per forward when filling the context before a test.
const FILL_CHUNK: usize = 512;

/// Most sequences `--parallel` decodes together.
const MAX_PARALLEL: usize = 256;

/// Loads `path` and measures it.
pub fn run(path: &Path, opts: &BenchOptions) -> Result<BenchReport> {
    check(opts)?;
    let file = crate::model_file::ModelFile::open(path)?;
    let arch = file.architecture()?;
    drop(file);
    let load_opts = LoadOptions {
        ctx: opts.depth + opts.n_prompt.max(opts.n_gen) + 16,
        max_seqs: opts.parallel.max(LoadOptions::default().max_seqs),
        ..opts.load.clone()
    };
    let t0 = Instant::now();
    let mut e = Engine::load(path, &load_opts)?;
    let load_s = t0.elapsed().as_secs_f64();
    let spec = spec_options(opts, &load_opts)?;
    let vocab = e.vocab_size();
    let mut ids = Ids(opts.seed ^ 0x006c_6174_6865);
    let mut seq = e.new_seq()?;
    // the other sequences of a batched decode test
    let mut others = (1..opts.parallel)
        .map(|_| e.new_seq())
        .collect::<Result<Vec<_>>>()?;

    // Warm-up: compile every pipeline the tests use and touch the buffers.
    if opts.n_prompt > 0 {
        let t = ids.take(opts.n_prompt, vocab);
        e.forward(&mut seq, &t, false)?;
    }
    for t in ids.take(2, vocab) {
        e.forward_batch_with(&mut [(&mut seq, &[t], GREEDY)])?;
    }
    // and the batched decode's variants (token-group products, batched attention)
    if opts.parallel > 1 && opts.n_gen > 0 {
        for step in ids.take(2 * opts.parallel, vocab).chunks(opts.parallel) {
            batch_step(&mut e, &mut seq, &mut others, step)?;
        }
    }
    // and speculation's verify passes, rollbacks and drafts
    if let (true, Some(so)) = (opts.n_gen > 0, &spec) {
        crate::spec::warm_up(&mut e, so)?;
    }
    // Every device the timed repetitions run on, to count their compiles.
    let gpus: Vec<Arc<Gpu>> = e
        .gpus
        .iter()
        .cloned()
        .chain(
            spec.as_ref()
                .and_then(|so| so.draft_model.as_ref())
                .map(|d| d.0.lock().unwrap_or_else(|p| p.into_inner()).gpu.clone()),
        )
        .collect();
    e.gpu.take_matmul();
    let mut t = Timed {
        opts,
        e,
        seq,
        others,
        ids,
        vocab,
        gpus,
        compiled: 0,
    };
    let mut hops = t.e.hops().map(|h| Hops {
        devices: h.devices,
        prefill: None,
        decode: None,
    });
    let prefill = match opts.n_prompt {
        0 => None,
        _ => {
            let (stat, crossed) = t.prefill()?;
            if let Some(h) = &mut hops {
                h.prefill = Some(HopStep::new(&crossed, opts.reps));
            }
            Some(stat)
        }
    };
    let matmul = t.e.gpu.take_matmul().name();
    let mut host_ns = 0u64;
    let mut spec_report = None;
    let decode = match (opts.n_gen, &spec) {
        (0, _) => None,
        (_, Some(so)) => {
            let (stat, report) = t.spec_decode(so)?;
            spec_report = Some(report);
            Some(stat)
        }
        (_, None) => {
            let (stat, crossed, ns) = t.decode()?;
            host_ns = ns;
            if let Some(h) = &mut hops {
                h.decode = Some(HopStep::new(&crossed, opts.reps * opts.n_gen));
            }
            Some(stat)
        }
    };
    // per decode step (a step decodes one token of each sequence)
    let host_us_per_token =
        (opts.n_gen > 0).then(|| host_ns as f64 / 1e3 / (opts.n_gen * opts.reps) as f64);
    let (kernels, timeline, prefill_kernels) = t.profiles()?;
    let Timed {
        e,
        seq,
        others,
        compiled: compiled_while_timed,
        ..
    } = t;
    drop(seq);
    drop(others);
    e.finish_expert_stats()?;
    let placement = e.placement_report();
    let bandwidth = stream_bandwidth(&e.gpu)?;
    let info = &e.gpu.info;
    Ok(BenchReport {
        model: path.display().to_string(),
        arch,
        adapter: info.name.clone(),
        backend: format!("{:?}", info.backend),
        device_type: format!("{:?}", info.device_type),
        bytes: e.model_bytes,
        bytes_per_token: e.decode_bytes,
        depth: opts.depth,
        reps: opts.reps,
        parallel: opts.parallel,
        load_s,
        prefill,
        decode,
        host_us_per_token,
        gpu_us_per_token: kernels
            .as_ref()
            .map(|k| k.iter().map(|k| k.ns).sum::<f64>() / 1e3),
        bandwidth,
        kernels,
        prefill_kernels,
        placement,
        matmul,
        activations: if e.gpu.int8_decode() { "int8" } else { "f32" },
        fused_loads: opts.load.fused_loads,
        spec: spec_report,
        compiled_while_timed,
        timeline,
        hops,
    })
}

/// The options' ranges and combinations, before anything loads.
fn check(opts: &BenchOptions) -> Result<()> {
    if opts.reps == 0 {
        return Err(Error::Invalid("-r: at least one repetition".into()));
    }
    if opts.n_prompt == 0 && opts.n_gen == 0 {
        return Err(Error::Invalid(
            "nothing to measure: -p and -n are both 0".into(),
        ));
    }
    if opts.parallel == 0 || opts.parallel > MAX_PARALLEL {
        return Err(Error::Invalid(format!(
            "--parallel {}: 1..={MAX_PARALLEL} sequences",
            opts.parallel
        )));
    }
    if opts.draft_model.is_some() && opts.spec.is_none() {
        return Err(Error::Invalid(
            "--draft-model drafts for --spec draft".into(),
        ));
    }
    if opts.parallel > 1 && (opts.spec.is_some() || opts.timeline) {
        return Err(Error::Invalid(
            "--parallel decodes several sequences without speculation or a timeline".into(),
        ));
    }
    Ok(())
}

/// The speculation the options ask for, with the draft model loaded as `lathe run` loads
/// it: the model's adapter, kernels and context; a sequence for the timed generation and
/// one for its step's cost.
fn spec_options(
    opts: &BenchOptions,
    load_opts: &LoadOptions,
) -> Result<Option<crate::spec::SpecOptions>> {
    let (Some(so), Some(dp)) = (&opts.spec, &opts.draft_model) else {
        return Ok(opts.spec.clone());
    };
    let d = Engine::load(
        dp,
        &LoadOptions {
            max_seqs: 2,
            save_expert_stats: None,
            collect_expert_stats: false,
            progress: None,
            ..load_opts.clone()
        },
    )
    .map_err(|err| Error::Invalid(format!("--draft-model {}: {err}", dp.display())))?;
    Ok(Some(crate::spec::SpecOptions {
        draft_model: Some(crate::spec::DraftModel::new(d)),
        ..so.clone()
    }))
}

/// What [`Timed::profiles`] found: the decode step's kernels, the offload's timeline, the
/// prefill's kernels.
type Profiles = (
    Option<Vec<KernelTime>>,
    Option<Vec<crate::moe::LayerTimes>>,
    Option<Vec<KernelTime>>,
);

/// A loaded and warmed-up engine with the sequences the timed tests run on.
struct Timed<'o> {
    opts: &'o BenchOptions,
    e: Engine,
    seq: Seq,
    /// The other sequences of a batched decode test.
    others: Vec<Seq>,
    ids: Ids,
    vocab: usize,
    /// Every device the timed repetitions run on.
    gpus: Vec<Arc<Gpu>>,
    /// Pipelines compiled while timing (each one a stall the numbers include).
    compiled: usize,
}

impl Timed<'_> {
    /// `seq` emptied and filled to `--depth` positions.
    fn fill(
        e: &mut Engine,
        seq: &mut Seq,
        ids: &mut Ids,
        depth: usize,
        vocab: usize,
    ) -> Result<()> {
        e.reset(seq)?;
        let mut left = depth;
        while left > 0 {
            let n = left.min(FILL_CHUNK);
            e.forward(seq, &ids.take(n, vocab), false)?;
            left -= n;
        }
        Ok(())
    }

    fn fill_main(&mut self) -> Result<()> {
        Timed::fill(
            &mut self.e,
            &mut self.seq,
            &mut self.ids,
            self.opts.depth,
            self.vocab,
        )
    }

    /// `--reps` prefills of `-p` tokens at `--depth`, and the device crossings they made.
    fn prefill(&mut self) -> Result<(Stat, crate::models::chain::HopReport)> {
        let opts = self.opts;
        let mut secs = Vec::with_capacity(opts.reps);
        let mut crossed = crate::models::chain::HopReport::default();
        for _ in 0..opts.reps {
            self.fill_main()?;
            let t = self.ids.take(opts.n_prompt, self.vocab);
            let before = self.e.hops();
            let c0 = compiled(&self.gpus);
            let s = Instant::now();
            self.e.forward(&mut self.seq, &t, false)?;
            secs.push(s.elapsed().as_secs_f64());
            self.compiled += compiled(&self.gpus) - c0;
            if let (Some(a), Some(b)) = (self.e.hops(), before) {
                crossed = crossed.plus(&a.since(&b));
            }
        }
        Ok((Stat::new(opts.n_prompt, &secs), crossed))
    }

    /// `--reps` greedy speculative generations of `-n` tokens, and one step's costs.
    fn spec_decode(
        &mut self,
        so: &crate::spec::SpecOptions,
    ) -> Result<(Stat, (crate::spec::SpecStats, crate::spec::StepCosts))> {
        let opts = self.opts;
        let mut secs = Vec::with_capacity(opts.reps);
        let mut total = crate::spec::SpecStats::default();
        for _ in 0..opts.reps {
            self.fill_main()?;
            let first = self.ids.take(1, self.vocab)[0];
            let c0 = compiled(&self.gpus);
            let s = Instant::now();
            let (st, _) =
                crate::spec::greedy_run(&mut self.e, &mut self.seq, first, opts.n_gen, so)?;
            secs.push(s.elapsed().as_secs_f64());
            self.compiled += compiled(&self.gpus) - c0;
            total.drafted += st.drafted;
            total.accepted += st.accepted;
            total.verify_passes += st.verify_passes;
            total.tokens += st.tokens;
        }
        let tok = self.ids.take(1, self.vocab)[0];
        let costs = crate::spec::step_costs(
            &mut self.e,
            &mut self.seq,
            tok,
            opts.reps * 4,
            so.draft_model.as_ref(),
        )?;
        Ok((Stat::new(opts.n_gen, &secs), (total, costs)))
    }

    /// `--reps` decodes of `-n` steps of every sequence: the tokens, the device crossings
    /// and the host time (ns) of the steps.
    fn decode(&mut self) -> Result<(Stat, crate::models::chain::HopReport, u64)> {
        let opts = self.opts;
        let mut secs = Vec::with_capacity(opts.reps);
        let mut crossed = crate::models::chain::HopReport::default();
        let mut host_ns = 0;
        for _ in 0..opts.reps {
            self.fill_main()?;
            for o in &mut self.others {
                Timed::fill(&mut self.e, o, &mut self.ids, opts.depth, self.vocab)?;
            }
            let t = self.ids.take(opts.n_gen * opts.parallel, self.vocab);
            let h0 = self.e.gpu.host_ns();
            let before = self.e.hops();
            let c0 = compiled(&self.gpus);
            let s = Instant::now();
            for step in t.chunks(opts.parallel) {
                batch_step(&mut self.e, &mut self.seq, &mut self.others, step)?;
            }
            secs.push(s.elapsed().as_secs_f64());
            self.compiled += compiled(&self.gpus) - c0;
            host_ns += self.e.gpu.host_ns() - h0;
            if let (Some(a), Some(b)) = (self.e.hops(), before) {
                crossed = crossed.plus(&a.since(&b));
            }
        }
        Ok((
            Stat::new(opts.n_gen * opts.parallel, &secs),
            crossed,
            host_ns,
        ))
    }

    /// After the timed tests: one decode step with a timestamp pair around every dispatch,
    /// one with the offload's per-layer timeline (`--timeline`), one prefill with every
    /// dispatch timed; each only where the tests ran and the adapter can.
    fn profiles(&mut self) -> Result<Profiles> {
        let opts = self.opts;
        let stamps = self
            .e
            .gpu
            .features
            .contains(wgpu::Features::TIMESTAMP_QUERY);
        let kernels = if opts.n_gen > 0 && stamps {
            let t = self.ids.take(opts.parallel, self.vocab);
            match self
                .e
                .profile_batch(&mut batch(&mut self.seq, &mut self.others, &t))
            {
                Ok(k) => Some(aggregate(&k)),
                Err(err) => {
                    eprintln!("note: no per-kernel breakdown: {err}");
                    None
                }
            }
        } else {
            None
        };
        let timeline = if opts.timeline && opts.n_gen > 0 {
            let tok = self.ids.take(1, self.vocab)[0];
            Some(self.e.timeline_step(&mut self.seq, tok)?)
        } else {
            None
        };
        let prefill_kernels = if opts.n_prompt > 0 && stamps {
            self.fill_main()?;
            let t = self.ids.take(opts.n_prompt, self.vocab);
            match self.e.profile_prefill(&mut self.seq, &t) {
                Ok(k) => Some(aggregate(&k)),
                Err(err) => {
                    eprintln!("note: no per-kernel prefill breakdown: {err}");
                    None
                }
            }
        } else {
            None
        };
        Ok((kernels, timeline, prefill_kernels))
    }
}

/// Pipelines compiled so far on `gpus`.
fn compiled(gpus: &[Arc<Gpu>]) -> usize {
    gpus.iter().map(|g| g.compiled_specs().len()).sum()
}

/// One token of each of `seq` and `others`: `step[i]` for sequence i.
fn batch<'a>(
    seq: &'a mut Seq,
    others: &'a mut [Seq],
    step: &'a [u32],
) -> Vec<(&'a mut Seq, &'a [u32])> {
    std::iter::once(seq)
        .chain(others)
        .zip(step.chunks(1))
        .collect()
}

/// One decode step of `seq` and `others` together ([`batch`]), as greedy generation runs it:
/// the argmax found on the GPU, 12 bytes read back per sequence.
fn batch_step(e: &mut Engine, seq: &mut Seq, others: &mut [Seq], step: &[u32]) -> Result<()> {
    let mut items: Vec<_> = batch(seq, others, step)
        .into_iter()
        .map(|(s, t)| (s, t, GREEDY))
        .collect();
    e.forward_batch_with(&mut items)?;
    Ok(())
}

/// A dispatch label without its layer (`blk.7.ffn_up.weight` → `blk.*.ffn_up.weight`), so
/// a kernel's calls in every layer add up.
fn kernel_key(label: &str) -> String {
    match label.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
        Some((n, rest)) if n.bytes().all(|b| b.is_ascii_digit()) => format!("blk.*.{rest}"),
        _ => label.to_string(),
    }
}

/// Per-dispatch times summed by kernel (labels without their layer), longest first.
fn aggregate(dispatches: &[(String, f64)]) -> Vec<KernelTime> {
    let mut by: Vec<KernelTime> = Vec::new();
    for (label, ns) in dispatches {
        let label = kernel_key(label);
        match by.iter_mut().find(|k| k.label == label) {
            Some(k) => {
                k.calls += 1;
                k.ns += ns;
            }
            None => by.push(KernelTime {
                label,
                calls: 1,
                ns: *ns,
            }),
        }
    }
    by.sort_by(|a, b| b.ns.total_cmp(&a.ns));
    by
}

/// A read-only streaming kernel: each thread XORs 16-byte words at a grid stride (adjacent
/// threads read adjacent words: coalesced), and writes only if the result matches a value
/// it never takes, so no load can be optimised away.
const STREAM_WGSL: &str = r#"
struct Params {
    n_words: u32,   // vec4<u32> words in `src`
    stride: u32,    // threads in the grid
    never: u32,     // a value the XOR never equals for the uploaded pattern
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

const WG = 256u;

@compute @workgroup_size(WG)
fn stream_read(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let t = (wid.x + wid.y * nwg.x) * WG + lid;
    var acc = vec4<u32>(0u);
    for (var i = t; i < p.n_words; i += p.stride) {
        acc ^= src[i];
    }
    let s = acc.x ^ acc.y ^ acc.z ^ acc.w;
    if (s == p.never) {
        dst[t & 255u] = s;
    }
}
"#;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct StreamParams {
    /// 16-byte words in the buffer.
    n_words: u32,
    /// Threads in the grid.
    stride: u32,
    never: u32,
    _pad: u32,
}
const _: () = assert!(std::mem::size_of::<StreamParams>() == 16);

/// Buffer streamed on a GPU: 1 GiB, far beyond any cache.
const STREAM_BYTES_GPU: u64 = 1 << 30;
/// On a CPU adapter (lavapipe: ~1 GB/s) 64 MiB keeps the probe short.
const STREAM_BYTES_CPU: u64 = 64 << 20;
/// Workgroups of 256 threads: enough to fill any GPU, few enough that each thread loops.
const STREAM_GROUPS_GPU: u32 = 4096;
const STREAM_GROUPS_CPU: u32 = 64;
/// Wall time one timed submission aims for.
const STREAM_TARGET_S: f64 = 0.1;

/// Measures the adapter's read bandwidth: the best of three timed submissions, each
/// streaming the buffer several times.
pub fn stream_bandwidth(gpu: &Gpu) -> Result<Bandwidth> {
    let cpu = gpu.info.device_type == wgpu::DeviceType::Cpu;
    let cap = gpu.max_binding().min(u32::MAX as u64 * 16);
    let bytes = (if cpu {
        STREAM_BYTES_CPU
    } else {
        STREAM_BYTES_GPU
    })
    .min(cap)
        / 16
        * 16;
    if bytes == 0 {
        return Err(Error::Gpu("no room for the bandwidth probe buffer".into()));
    }
    let src = gpu.buffer(bytes, "bench.stream")?;
    // A non-zero pattern (zero pages could in principle be compressed).
    let piece: Vec<u8> = (0..(16u64 << 20).min(bytes))
        .map(|i| (i.wrapping_mul(0x9e37_79b9) >> 7) as u8 | 1)
        .collect();
    let mut off = 0;
    while off < bytes {
        let n = (bytes - off).min(piece.len() as u64);
        gpu.write(&src, off, &piece[..n as usize]);
        off += n;
    }
    let dst = gpu.buffer(256 * 4, "bench.stream.out")?;
    /// The probe's one variant: no fields.
    #[derive(PartialEq, Eq, Hash)]
    struct StreamRead;
    impl PipelineKey for StreamRead {
        fn source(&self) -> &'static str {
            STREAM_WGSL
        }
        fn entry(&self) -> &'static str {
            "stream_read"
        }
        fn label(&self) -> String {
            "bench_stream_read_wg256".into()
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec
        }
    }
    let pipeline = gpu.pipeline_for(StreamRead)?;
    let n_words = (bytes / 16) as u32;
    let groups = if cpu {
        STREAM_GROUPS_CPU
    } else {
        STREAM_GROUPS_GPU
    };
    let groups = groups.min(n_words.div_ceil(256));
    let params = StreamParams {
        n_words,
        stride: groups * 256,
        never: 0xdead_beef,
        _pad: 0,
    };
    let bindings = [Binding::from(&src), Binding::from(&dst)];
    let timed = |reps: u32| -> Result<f64> {
        let mut pass = gpu.pass();
        for _ in 0..reps {
            pass.dispatch(&pipeline, "bench_stream", &params, &bindings, grid(groups));
        }
        let t = Instant::now();
        pass.submit()?;
        gpu.wait()?;
        Ok(t.elapsed().as_secs_f64())
    };
    // The first submission also compiles and warms up; it sizes the timed ones.
    let once = timed(1)?;
    let reps = ((STREAM_TARGET_S / once.max(1e-6)).ceil() as u32).clamp(1, 64);
    let best = (0..3)
        .map(|_| timed(reps))
        .collect::<Result<Vec<f64>>>()?
        .into_iter()
        .fold(f64::INFINITY, f64::min);
    Ok(Bandwidth {
        bytes_per_s: reps as f64 * bytes as f64 / best,
        buffer_bytes: bytes,
    })
}

/// Read bandwidths measured on GPUs lathe has run on (FACTS.md), matched by a substring of
/// the adapter's name: the H200's is what lathe's f32 matvec streams through wgpu (4.34 TB/s,
/// rounded down).
const KNOWN_VRAM_BW: &[(&str, f64)] = &[("H200", 4000e9)];

/// A read bandwidth and where the number came from (for reports).
#[derive(Clone, Debug)]
pub struct SourcedBandwidth {
    pub bytes_per_s: f64,
    pub source: String,
}

/// The memory bandwidth a decode step on adapter `index` (`info`) reads its bytes at,
/// without loading a model: on a CPU adapter (lavapipe) the host's memory read bandwidth
/// ([`host_read_bandwidth`]: the kernels run on the host's cores and memory), on a GPU of
/// [`KNOWN_VRAM_BW`] its measured figure, on another GPU [`stream_bandwidth`] on a device
/// opened for it (a second or so).
pub fn adapter_bandwidth(index: usize, info: &wgpu::AdapterInfo) -> Result<SourcedBandwidth> {
    if info.device_type == wgpu::DeviceType::Cpu {
        let (bw, threads) = host_read_bandwidth();
        return Ok(SourcedBandwidth {
            bytes_per_s: bw.bytes_per_s,
            source: format!(
                "measured: a CPU adapter, host memory read by {threads} threads over {}",
                human_bytes(bw.buffer_bytes)
            ),
        });
    }
    if let Some((name, bw)) = KNOWN_VRAM_BW.iter().find(|(n, _)| info.name.contains(n)) {
        return Ok(SourcedBandwidth {
            bytes_per_s: *bw,
            source: format!("lathe's measurement on the {name}"),
        });
    }
    let gpu = Gpu::new(&AdapterChoice::Index(index))?;
    let bw = stream_bandwidth(&gpu)?;
    Ok(SourcedBandwidth {
        bytes_per_s: bw.bytes_per_s,
        source: format!(
            "measured: a read kernel over {}",
            human_bytes(bw.buffer_bytes)
        ),
    })
}

/// Host buffer the memory probe reads: far beyond the last-level caches of the machines
/// lathe runs on, small enough to allocate anywhere.
const HOST_PROBE_BYTES: usize = 256 << 20;
/// Timed passes over it; the fastest counts (the others met page faults or other work).
const HOST_PROBE_PASSES: usize = 4;

/// The host's memory read bandwidth: every core sums its share of a buffer of
/// [`HOST_PROBE_BYTES`] (u64 loads the compiler vectorises), the fastest of
/// [`HOST_PROBE_PASSES`] passes; and how many threads read. About 0.2 s.
pub fn host_read_bandwidth() -> (Bandwidth, usize) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let words = HOST_PROBE_BYTES / 8;
    // Non-zero words written once, so every page is real memory before the timed passes.
    let buf: Vec<u64> = (0..words as u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
        .collect();
    let chunk = words.div_ceil(threads);
    let mut best = f64::INFINITY;
    for _ in 0..HOST_PROBE_PASSES {
        let t = Instant::now();
        let sum = std::thread::scope(|scope| {
            let parts: Vec<_> = buf
                .chunks(chunk)
                .map(|c| scope.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            parts
                .into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(sum);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (
        Bandwidth {
            // A clock too coarse to see the pass still gives a finite figure.
            bytes_per_s: HOST_PROBE_BYTES as f64 / best.max(1e-9),
            buffer_bytes: HOST_PROBE_BYTES as u64,
        },
        threads,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_are_mean_and_sample_sd() {
        let s = Stat::new(100, &[1.0, 0.5]);
        assert_eq!(s.runs, [100.0, 200.0]);
        assert!((s.tok_s - 150.0).abs() < 1e-9);
        assert!((s.sd - 70.710_678).abs() < 1e-5);
        assert_eq!(Stat::new(10, &[2.0]).sd, 0.0);
    }

    #[test]
    fn kernel_times_sum_by_label() {
        let k = aggregate(&[("a".into(), 1.0), ("b".into(), 5.0), ("a".into(), 2.0)]);
        assert_eq!(k.len(), 2);
        assert_eq!((k[0].label.as_str(), k[0].calls, k[0].ns), ("b", 1, 5.0));
        assert_eq!((k[1].label.as_str(), k[1].calls, k[1].ns), ("a", 2, 3.0));
    }

    #[test]
    fn ids_stay_inside_the_vocabulary() {
        let v = Ids(1).take(1000, 7);
        assert!(v.iter().all(|&t| t < 7));
        assert!((0..7).all(|t| v.contains(&t)));
    }
}
