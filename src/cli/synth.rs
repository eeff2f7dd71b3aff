//! `lathe synth`: write a random-weight GGUF with a released model's exact layout.

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::Args;
use lathe::inspect::human_bytes;
use lathe::synth::{self, FileType, PlanOptions, Vocab};
use lathe::{Error, Result};

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Model shape: a released model's, or the small demos.
    #[arg(long, value_name = "NAME",
          value_parser = clap::builder::PossibleValuesParser::new(synth::PRESET_NAMES))]
    pub preset: String,
    /// File type as llama-quantize names it: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1,
    /// q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k, mxfp4_moe (default: q4_k_m; q8_0 with MXFP4
    /// experts for deepseek-v4-flash).
    #[arg(long = "type", value_name = "TYPE")]
    pub ftype: Option<FileType>,
    /// Keep only the first N layers (a shortened model of the same width).
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
    /// Expert popularity skew: 0 routes uniformly; S > 0 scales the router rows of a few
    /// experts per layer by up to 1 + S so they are picked far more often.
    #[arg(long, value_name = "S", default_value_t = 0.0)]
    pub skew: f32,
    /// A tokenizer.json (or .json.gz), or a GGUF to copy `tokenizer.ggml.*` from: makes the
    /// model a chat model (the vocabulary size follows the tokenizer).
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    // The chat template to store (default: the tokenizer's own, else the built-in one of
    // its vocabulary, `Vocab::builtin_template`).
    #[command(flatten)]
    pub template: super::text::ChatTemplateArgs,
    /// Vocabulary size of a model without tokenizer (default: the preset's).
    #[arg(long, value_name = "N")]
    pub vocab: Option<usize>,
    /// Seed of the random weights (the same seed gives the same file).
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Add the multi-token prediction (MTP) block the releases ship, with their shapes
    /// (Qwen3.5: llama.cpp's `blk.N.nextn.*`; DeepSeek-V4: `mtp.0.*`, as the release): what
    /// `--spec mtp` drafts with.
    #[arg(long)]
    pub mtp: bool,
    /// Print a JSON summary on stdout.
    #[arg(long)]
    pub json: bool,
    /// Plan only: print the summary (sizes included) and write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Output file.
    #[arg(short, long, value_name = "FILE.gguf")]
    pub out: PathBuf,
}

pub fn run(a: SynthArgs) -> Result<()> {
    let preset = synth::preset(&a.preset)?;
    let template = a.template.choice()?;
    let vocab = match &a.tokenizer {
        None => {
            if let Some(t) = &template {
                return Err(Error::Invalid(format!(
                    "{}: needs --tokenizer (a model without vocabulary has no chat)",
                    t.origin
                )));
            }
            None
        }
        Some(path) => {
            let mut v = Vocab::load(path)?;
            match template {
                Some(t) => v.chat_template = Some(t.source),
                None if v.chat_template.is_none() => {
                    v.chat_template = Some(v.builtin_template().source.to_string())
                }
                None => {}
            }
            Some(v)
        }
    };
    if a.tokenizer.is_some() && a.vocab.is_some() {
        return Err(Error::Invalid(
            "--vocab: the vocabulary size follows --tokenizer".into(),
        ));
    }
    let opts = PlanOptions {
        ftype: a.ftype,
        n_layer: a.layers,
        skew: a.skew,
        n_vocab: a.vocab,
        mtp: a.mtp,
        ..Default::default()
    };
    let plan = synth::plan(&preset, &opts, vocab.as_ref())?;
    let total = plan.data_bytes();
    let summary = |bytes: u64, seconds: f64| {
        serde_json::json!({
            "path": a.out.display().to_string(),
            "preset": preset.name,
            "arch": plan.arch,
            "type": plan.ftype.name(),
            "layers": plan.n_layer,
            "vocab": plan.n_vocab,
            "tensors": plan.tensors.len(),
            "bytes": bytes,
            "data_bytes": total,
            "expert_bytes": plan.expert_bytes(),
            "seconds": seconds,
            "mb_s": bytes as f64 / 1e6 / seconds.max(1e-9),
        })
    };
    if a.dry_run {
        eprintln!(
            "would write {}: {} {} layers, {} tensors, {}, {} of tensor data",
            a.out.display(),
            plan.arch,
            plan.n_layer,
            plan.tensors.len(),
            plan.ftype,
            human_bytes(total)
        );
        if a.json {
            println!("{}", summary(total, 0.0));
        }
        return Ok(());
    }
    let bar = if std::io::stderr().is_terminal() {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.set_message(format!("writing {}", a.out.display()));
        Some(b)
    } else {
        None
    };
    let progress = |done: u64, _total: u64| {
        if let Some(b) = &bar {
            b.set_position(done);
        }
    };
    let stats = plan.write(&a.out, a.seed, Some(&progress))?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    eprintln!(
        "wrote {}: {} {} layers, {} tensors, {}, {} in {:.1} s ({:.0} MB/s)",
        a.out.display(),
        plan.arch,
        plan.n_layer,
        plan.tensors.len(),
        plan.ftype,
        human_bytes(stats.bytes),
        stats.seconds,
        stats.mb_per_s()
    );
    // Said where the file is made: nothing in the text a model prints says so.
    eprintln!(
        "note: the weights of {} are random: whatever it generates is noise (for speed and plumbing, not answers)",
        a.out.display()
    );
    if a.json {
        println!("{}", summary(stats.bytes, stats.seconds));
    }
    Ok(())
}
