//! `lathe bench`: prefill and decode speed, llama-bench style (table or one JSON object on
//! stdout; the adapter report and notes on stderr).

use std::path::PathBuf;

use clap::Args;
use lathe::bench::{self, BenchOptions};
use lathe::Result;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model: a GGUF file, a Hugging Face checkpoint directory, or a Hub model
    /// `owner/repo[:QUANT]` (downloaded into the Hugging Face cache).
    #[arg(short, long, value_name = "PATH")]
    pub model: PathBuf,
    /// Prompt tokens of the prefill test (0: skip it).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_name = "N",
        default_value_t = 512
    )]
    pub n_prompt: usize,
    /// Tokens of the decode test, one forward each with the logits read back (0: skip it).
    #[arg(short = 'n', long = "n-gen", value_name = "N", default_value_t = 128)]
    pub n_gen: usize,
    /// Repetitions of each test (mean ± standard deviation).
    #[arg(
        short = 'r',
        long = "repetitions",
        value_name = "N",
        default_value_t = 5
    )]
    pub reps: usize,
    /// Fill the context with this many tokens (untimed) before each test.
    #[arg(short = 'd', long, value_name = "N", default_value_t = 0)]
    pub depth: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub load: super::load::LoadArgs,
    /// Print one more decode step's timeline of the MoE layers whose experts are partly on
    /// the CPU (stderr; `"timeline"` in --json): host waits, CPU time, GPU busy per layer.
    #[arg(long)]
    pub moe_timeline: bool,
    /// Decode this many sequences together, one token of each per batched step (as `lathe
    /// serve --parallel N` runs its requests); the decode speed is their aggregate.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub parallel: usize,
    /// Seed of the random token ids.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Decode with speculative decoding (mtp: the model's MTP block; draft: --draft-model),
    /// greedily from the model's own picks, as `lathe run` and `serve` run it; also times
    /// verify passes of 2..8 tokens, an MTP draft and a draft model's step.
    #[arg(long, value_name = "MODE")]
    pub spec: Option<lathe::spec::SpecMode>,
    /// With --spec draft: the draft model (same vocabulary), loaded on the model's adapter
    /// with its kernels, as `lathe run --draft-model` loads it.
    #[arg(long, value_name = "FILE", requires = "spec")]
    pub draft_model: Option<PathBuf>,
    /// Tokens drafted per verify pass (with --spec).
    #[arg(long, value_name = "N", default_value_t = lathe::spec::DEFAULT_DRAFT)]
    pub draft: usize,
    /// With --spec: take every draft as accepted (the output is then the drafts'), which
    /// measures the mechanism's ceiling on random weights.
    #[arg(long, requires = "spec")]
    pub accept_all: bool,
    /// With --spec: MTP drafts pick among the first N tokens only (a smaller draft head).
    #[arg(long, value_name = "N", requires = "spec")]
    pub draft_vocab: Option<usize>,
}

pub fn run(a: BenchArgs) -> Result<()> {
    if let Some(p) = &a.draft_model {
        super::run::check_model_path(p)?;
    }
    let opts = BenchOptions {
        n_prompt: a.n_prompt,
        n_gen: a.n_gen,
        reps: a.reps,
        depth: a.depth,
        seed: a.seed,
        // as `lathe run` and `serve` decide for the same sequences and drafts
        load: a
            .load
            .load_options(a.parallel * a.spec.map_or(1, |_| a.draft + 1))?,
        spec: a.spec.map(|mode| lathe::spec::SpecOptions {
            mode,
            draft: a.draft,
            accept_all: a.accept_all,
            draft_model: None,
            draft_vocab: a.draft_vocab,
        }),
        draft_model: a.draft_model,
        timeline: a.moe_timeline,
        parallel: a.parallel,
    };
    let r = bench::run(&a.model, &opts)?;
    eprintln!(
        "adapter: {} ({}, {}); loaded in {:.2} s",
        r.adapter, r.backend, r.device_type, r.load_s
    );
    if let Some(p) = &r.placement {
        eprintln!(
            "experts: {}/{} on the GPU ({:.1}%), cache hit rate {:.1}%, {} uploads ({:.0} \
             bytes/token), {} pairs on the CPU, {} streamed ({} pairs){}",
            p.hot_experts,
            p.total_experts,
            100.0 * p.hot_share,
            100.0 * p.hit_rate,
            p.uploads,
            p.uploaded_bytes_per_token,
            p.cold_pairs,
            lathe::inspect::human_bytes(p.streamed_bytes),
            p.streamed_pairs,
            p.memory
                .as_ref()
                .map_or(String::new(), |m| format!("; memory {m}"))
        );
    }
    if let Some(t) = &r.timeline {
        eprintln!(
            "MoE layers of one decode step (ms):\n{}",
            lathe::moe::timeline::table(t)
        );
    }
    if let Some(h) = &r.hops {
        for (test, st) in [("prefill", &h.prefill), ("decode step", &h.decode)] {
            if let Some(st) = st {
                eprintln!(
                    "{} devices, per {test}: {:.1} hops, {:.0} bytes, {:.1} µs per hop",
                    h.devices, st.hops, st.bytes, st.us_per_hop
                );
            }
        }
    }
    if a.json {
        println!("{}", r.json());
    } else {
        print!("{}", r.table());
    }
    Ok(())
}
