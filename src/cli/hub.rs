//! Models by name: `-m owner/repo[:QUANT]` on every command that takes a model, and
//! `lathe pull`, `lathe ls`, `lathe rm` over the Hugging Face cache (see `lathe::hub`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use lathe::error::escaped;
use lathe::hub::{self, cache, HubConfig, ModelRef};
use lathe::inspect::human_bytes;
use lathe::{Error, Result};

/// The path `-m` names: an existing file or directory as it is (a local path always wins),
/// else a Hub model (`owner/repo[:QUANT]`, `hf://...`) resolved through the cache, else the
/// argument unchanged, for the command to report as a missing path.
pub fn resolve_model(arg: PathBuf) -> Result<PathBuf> {
    if arg.exists() {
        return Ok(arg);
    }
    let Some(model) = arg.to_str().map(ModelRef::parse).transpose()?.flatten() else {
        if let Some(hint) = arg.to_str().and_then(ollama_hint) {
            return Err(Error::Invalid(hint));
        }
        return Ok(arg);
    };
    let path = hub::resolve(&HubConfig::from_env(), &model, &mut Bar::default())?;
    eprintln!("{model}: {}", path.display());
    Ok(path)
}

/// The hint for an ollama-style name (`qwen3.5:0.8b`: a model and a tag, no owner, not a
/// file): lathe names Hub repos as `owner/repo[:QUANT]`.
fn ollama_hint(arg: &str) -> Option<String> {
    let (name, tag) = arg.split_once(':')?;
    let plain = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
    };
    (plain(name) && plain(tag)).then(|| {
        format!(
            "{arg}: no such file, and an ollama-style name: lathe fetches Hugging Face models \
             by owner/repo[:QUANT], e.g. `-m unsloth/Qwen3.5-0.8B-GGUF:Q4_K_M`"
        )
    })
}

fn parse_name(arg: &str) -> Result<ModelRef> {
    ModelRef::parse(arg)?.ok_or_else(|| {
        Error::Invalid(format!(
            "{arg}: not a Hub model name; write owner/repo, owner/repo:QUANT or hf://owner/repo/file.gguf"
        ))
    })
}

#[derive(Args, Debug)]
pub struct PullArgs {
    /// `owner/repo[:QUANT]` (a GGUF repo: that quant, default Q4_K_M, else the smallest lathe
    /// runs; a safetensors repo: config, tokenizer and weights) or `hf://owner/repo/file.gguf`.
    #[arg(value_name = "MODEL")]
    pub model: String,
}

/// Downloads (or finds in the cache) a model and prints its local path on stdout.
pub fn pull(a: PullArgs) -> Result<()> {
    let model = parse_name(&a.model)?;
    let path = hub::resolve(&HubConfig::from_env(), &model, &mut Bar::default())?;
    println!("{}", escaped(&path.display().to_string()));
    Ok(())
}

/// One line per cached file: `owner/repo`, file, size, quant type (tab-separated).
pub fn ls() -> Result<()> {
    let cfg = HubConfig::from_env();
    let files = cache::list(&cfg.cache_dir)?;
    if files.is_empty() {
        eprintln!("no models in {}", cfg.cache_dir.display());
    }
    // Names come from the cache, which other tools write too: a tab or newline in one must
    // not break the tab-separated lines.
    for f in files {
        println!(
            "{}\t{}\t{}\t{}",
            f.repo,
            escaped(&f.file),
            human_bytes(f.size),
            f.quant.as_deref().unwrap_or("-")
        );
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct RmArgs {
    /// `owner/repo` (every cached file of it) or `owner/repo:QUANT` (its GGUF files of that
    /// quant type).
    #[arg(value_name = "MODEL")]
    pub model: String,
}

pub fn rm(a: RmArgs) -> Result<()> {
    let model = parse_name(&a.model)?;
    let cfg = HubConfig::from_env();
    let removed = cache::remove(&cfg.cache_dir, &model.repo, model.quant.as_deref())?;
    for (repo, file) in &removed.files {
        println!("removed {repo}\t{}", escaped(file));
    }
    eprintln!("freed {}", human_bytes(removed.bytes));
    Ok(())
}

/// A download bar on stderr: bytes, speed and time left.
#[derive(Default)]
struct Bar {
    bar: Option<ProgressBar>,
}

impl hub::Progress for Bar {
    fn start(&mut self, file: &str, total: u64, done: u64) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        let style = ProgressStyle::with_template(
            "{msg} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )
        .expect("a valid progress template")
        .progress_chars("=> ");
        let bar = ProgressBar::new(total).with_style(style);
        let resumed = if done > 0 {
            format!(" (resuming at {})", human_bytes(done))
        } else {
            String::new()
        };
        bar.set_message(format!("downloaded {}{resumed}", escaped(file)));
        // Speed and ETA count only this run's bytes.
        bar.set_position(done);
        bar.reset_eta();
        bar.enable_steady_tick(Duration::from_millis(200));
        self.bar = Some(bar);
    }

    fn advance(&mut self, done: u64) {
        if let Some(b) = &self.bar {
            b.set_position(done);
        }
    }

    fn finish(&mut self, done: bool) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
            if done {
                eprintln!(
                    "{} ({}) in {:.1} s",
                    b.message(),
                    human_bytes(b.position()),
                    b.elapsed().as_secs_f64()
                );
            }
        }
    }

    fn note(&mut self, msg: &str) {
        eprintln!("note: {msg}");
    }
}
