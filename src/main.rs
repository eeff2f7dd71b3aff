//! The `lathe` command line. Front end only: every command calls the library.
//! Conventions: results on stdout; progress, logs and the adapter report on stderr; an
//! error prints one line and exits 1 (2 for an internal error, never Rust's 101).

mod cli;

use clap::{Parser, Subcommand};
use lathe::gpu::AdapterChoice;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "lathe",
    version,
    about = "A portable LLM inference engine on wgpu"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt: streams it to stdout, then speeds on stderr.
    Run(cli::run::RunArgs),
    /// Chat with a model on stdin/stdout (/reset, /exit; Ctrl-C stops a reply).
    Chat(cli::chat::ChatArgs),
    /// Serve the model over HTTP with an OpenAI-compatible API (chat, completions, SSE).
    Serve(cli::serve::ServeArgs),
    /// Print the token ids of a text as JSON (no model on the GPU: only its vocabulary).
    Tokenize(cli::text::TokenizeArgs),
    /// Render a chat template for a list of messages; prints exactly the rendering.
    Template(cli::text::TemplateArgs),
    /// Plan a MoE model's expert placement: slots per layer, bytes a decode step reads from
    /// VRAM and from host memory, and the speed limit that implies.
    Plan(cli::plan::PlanArgs),
    /// Write a random-weight GGUF with a released model's exact tensor names, shapes, types
    /// and metadata (for speed measurements without downloads).
    Synth(cli::synth::SynthArgs),
    /// Measure prefill and decode speed (llama-bench style) against the adapter's bandwidth.
    Bench(cli::bench::BenchArgs),
    /// Download a model from the Hugging Face Hub into the shared cache and print its path.
    ///
    /// The cache is huggingface_hub's (`$HF_HOME/hub`, default ~/.cache/huggingface/hub, or
    /// HF_HUB_CACHE), shared with Python tools. A download resumes where an interrupted one
    /// stopped, and a file enters the cache only after its sha256 matched the Hub's. `-m
    /// owner/repo[:QUANT]` on any command that takes a model does the same first. Environment:
    /// HF_ENDPOINT (another Hub or a mirror), HF_TOKEN or the token file of `hf auth login`
    /// (gated and private repos), HF_HUB_OFFLINE=1 (the cache only, no request).
    Pull(cli::hub::PullArgs),
    /// List the models in the Hugging Face cache: repo, file, size, quant type.
    Ls,
    /// Remove a model (`owner/repo`) or one quant of it (`owner/repo:QUANT`) from the cache.
    Rm(cli::hub::RmArgs),
    /// List the GPU adapters wgpu can use (index, name, backend, type, product paths).
    Devices,
    /// Check the product kernels against their CPU reference on this adapter: every path it
    /// runs (matvec, tiled, cooperative matrices) and every stored type. One line per check,
    /// then `N passed, M failed`; exit 1 on any failure.
    Selftest {
        /// Add the real sizes of released models (4096 x 12288 ... at 512 tokens).
        #[arg(long)]
        full: bool,
        /// One JSON object on stdout instead of the lines.
        #[arg(long)]
        json: bool,
        /// Adapter index or name substring (see `lathe devices`).
        #[arg(long, default_value = "auto")]
        device: AdapterChoice,
        /// Check each of these devices in turn (as `lathe run --devices`: `0,1`, `all`).
        #[arg(long, value_name = "LIST")]
        devices: Option<String>,
        /// Product paths to enable: auto (every path the adapter has), coop or tiled (the int8
        /// paths are checked on every adapter).
        #[arg(long, default_value = "auto")]
        matmul: lathe::gpu::MatmulChoice,
    },
    /// Describe a model file: architecture, hyper-parameters, tensors, bytes per decode step.
    Inspect {
        /// A GGUF file, a Hugging Face checkpoint directory, or a Hub model
        /// (`owner/repo[:QUANT]`, fetched into the cache); `-m PATH` works too.
        #[arg(value_name = "MODEL")]
        path: PathBuf,
    },
    /// Print lathe's version and where it keeps compiled pipelines.
    Version,
    /// Compute logits for a token sequence and write them as .npy (f32 [T, vocab]).
    Logits {
        /// A GGUF file, a Hugging Face checkpoint directory, or a Hub model
        /// (`owner/repo[:QUANT]`, fetched into the cache).
        #[arg(short, long)]
        model: PathBuf,
        /// int32 token ids [T] (.npy).
        #[arg(long)]
        tokens: PathBuf,
        /// Output .npy path.
        #[arg(long)]
        out: PathBuf,
        /// Feed the first N tokens as one batch, the rest one at a time (default: all at once).
        #[arg(long)]
        prefill: Option<usize>,
        #[command(flatten)]
        load: cli::load::LoadArgs,
    },
}

fn run(cli: Cli) -> lathe::Result<()> {
    use cli::hub::resolve_model;
    match cli.cmd {
        Cmd::Run(mut a) => {
            a.model.model = resolve_model(a.model.model)?;
            cli::run::run(a)
        }
        Cmd::Chat(mut a) => {
            a.model.model = resolve_model(a.model.model)?;
            cli::chat::run(a)
        }
        Cmd::Serve(mut a) => {
            let named = a.model.to_string_lossy().into_owned();
            a.model = resolve_model(a.model)?;
            // A Hub model is served under its name, not its cache file's (or commit's).
            if a.alias.is_none() && a.model.as_os_str() != named.as_str() {
                a.alias = Some(named);
            }
            cli::serve::run(a)
        }
        Cmd::Tokenize(mut a) => {
            a.model = resolve_model(a.model)?;
            cli::text::tokenize(a)
        }
        Cmd::Template(a) => cli::text::template(a),
        Cmd::Plan(mut a) => {
            a.model = resolve_model(a.model)?;
            cli::plan::run(a)
        }
        Cmd::Synth(a) => cli::synth::run(a),
        Cmd::Bench(mut a) => {
            a.model = resolve_model(a.model)?;
            cli::bench::run(a)
        }
        Cmd::Pull(a) => cli::hub::pull(a),
        Cmd::Ls => cli::hub::ls(),
        Cmd::Rm(a) => cli::hub::rm(a),
        Cmd::Devices => {
            for (i, a) in lathe::gpu::list_adapters().iter().enumerate() {
                // the --matmul paths this adapter runs, and why the others are missing
                let paths: Vec<String> = lathe::gpu::matmul_paths(i)
                    .into_iter()
                    .map(|(p, ok)| match ok {
                        Ok(()) => p.name().to_string(),
                        Err(why) => format!("no {} ({why})", p.name()),
                    })
                    .collect();
                // the memory the planner budgets with, and where that number comes from
                let dm = lathe::gpu::adapter_memory(i);
                let mem = lathe::moe::AdapterMemory::detect(a, dm.as_ref(), None);
                println!(
                    "{i}\t{}\t{:?}\t{:?}\t{} {}\tmatmul: {}\tmemory: {}",
                    a.name,
                    a.backend,
                    a.device_type,
                    a.driver,
                    a.driver_info,
                    paths.join(", "),
                    mem.describe()
                );
            }
            Ok(())
        }
        Cmd::Selftest {
            full,
            json,
            device,
            devices,
            matmul,
        } => {
            // Each device of --devices in turn: mixed adapters differ in subgroups, limits
            // and matrix units, so each runs the paths it picks.
            let choices = match &devices {
                Some(list) => lathe::models::chain::parse_devices(list)?,
                None => vec![device],
            };
            let mut reports = Vec::new();
            let (mut passed, mut failed) = (0, 0);
            for (i, choice) in choices.iter().enumerate() {
                let gpu =
                    lathe::gpu::Gpu::with_matmul(choice, matmul, lathe::gpu::AutoProducts::Any)?;
                eprintln!("{}", gpu.report());
                if choices.len() > 1 && !json {
                    println!("device {i}: {}", gpu.info.name);
                }
                // A count on stderr where no terminal shows the stdout lines as they come
                // (a CI log, `--json`): the full run takes minutes on a CPU adapter.
                let log = json || !std::io::stderr().is_terminal();
                let mut done = 0;
                let checks = lathe::selftest::run(&gpu, full, |c| {
                    done += 1;
                    if log {
                        eprintln!("selftest: {done} checked ({})", c.name);
                    }
                    if !json {
                        let mark = if c.passed { "ok  " } else { "FAIL" };
                        let why = if c.passed {
                            String::new()
                        } else {
                            format!(": {}", c.detail)
                        };
                        println!(
                            "{mark} {} (worst err/bound {:.3}, rel rms {:.2e}){why}",
                            c.name, c.worst, c.rel_rms
                        );
                    }
                });
                let f = checks.iter().filter(|c| !c.passed).count();
                let p = checks.len() - f;
                passed += p;
                failed += f;
                reports.push(serde_json::json!({
                    "adapter": gpu.info.name,
                    "matmul": gpu.matmul_path().name(),
                    "checks": checks,
                    "passed": p,
                    "failed": f,
                }));
            }
            if json {
                let v = match &reports[..] {
                    [one] => one.clone(),
                    _ => serde_json::json!({
                        "devices": reports,
                        "passed": passed,
                        "failed": failed,
                    }),
                };
                println!("{v}");
            } else {
                println!("{passed} passed, {failed} failed");
            }
            if failed > 0 {
                return Err(lathe::Error::Invalid(format!(
                    "selftest: {failed} of {} checks failed",
                    passed + failed
                )));
            }
            Ok(())
        }
        Cmd::Version => {
            println!("lathe {}", env!("CARGO_PKG_VERSION"));
            match lathe::gpu::pipeline_cache_dir() {
                Some(d) => println!("pipeline cache: {}", d.display()),
                None => println!("pipeline cache: none (neither XDG_CACHE_HOME nor HOME is set)"),
            }
            Ok(())
        }
        Cmd::Inspect { path } => {
            let path = resolve_model(path)?;
            cli::run::check_model_path(&path)?;
            let f = lathe::model_file::ModelFile::open(&path)?;
            print!("{}", lathe::inspect::report(&f)?);
            Ok(())
        }
        Cmd::Logits {
            model,
            tokens,
            out,
            prefill,
            load,
        } => {
            // One row per pass: the prompt's rows as one batch, then single tokens.
            let opts = load.load_options(1)?;
            // Before the model loads and computes (seconds to minutes), not after.
            lathe::npy::check_writable(&out)?;
            let model = resolve_model(model)?;
            let toks = lathe::npy::read_i64(&tokens)?;
            if toks.shape.len() != 1 || toks.data.is_empty() {
                return Err(lathe::Error::Invalid(format!(
                    "{}: token ids must be a non-empty 1-D array, got shape {:?}",
                    tokens.display(),
                    toks.shape
                )));
            }
            let ids: Vec<u32> = toks
                .data
                .iter()
                .map(|&t| {
                    u32::try_from(t).map_err(|_| {
                        lathe::Error::Invalid(format!(
                            "{}: negative or huge token id {t}",
                            tokens.display()
                        ))
                    })
                })
                .collect::<lathe::Result<_>>()?;
            let mut e = lathe::engine::Engine::load(&model, &opts)?;
            eprintln!("{}", e.report());
            let vocab = e.vocab_size();
            let logits = lathe::engine::logits_on(&mut e, &ids, prefill.unwrap_or(ids.len()))?;
            lathe::npy::write_f32(&out, &[ids.len(), vocab], &logits)?;
            load.moe.save(&e)
        }
    }
}

/// Mesa's Vulkan device-select layer (an implicit layer, on by default) asks the Wayland
/// compositor which GPU is the default whenever an instance enables VK_KHR_wayland_surface,
/// which wgpu does wherever the driver offers it; with no XDG_RUNTIME_DIR libwayland prints
/// "error: XDG_RUNTIME_DIR is invalid or not set" at every adapter listing (six lines before
/// anything else on a headless server). lathe draws nothing and orders adapters itself, so
/// without a Wayland session the layer has nothing to tell it: turn it off for this process
/// through the switch its manifest declares (`disable_environment: NODEVICE_SELECT=1`).
/// Called first in `main`, before any thread exists (setting the environment is not
/// thread-safe).
fn quiet_headless_vulkan() {
    let runtime_dir =
        std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|d| std::path::Path::new(&d).is_dir());
    let wayland = std::env::var_os("WAYLAND_DISPLAY").is_some();
    if !runtime_dir && !wayland && std::env::var_os("NODEVICE_SELECT").is_none() {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
}

/// The spellings users of llama.cpp and of other commands type, made lathe's before clap
/// reads them (clap has no multi-letter short flags, nor positional-or-flag arguments):
/// `-np N` is `--parallel N` (llama-server); a model given positionally right after the
/// command (`lathe run model.gguf -p Hi`) is `-m model.gguf`, and `-m X` / `--model X` on
/// `inspect`, which takes it positionally, is `X`.
fn normalize_args(mut args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    const TAKES_M: &[&str] = &[
        "run", "chat", "serve", "tokenize", "plan", "bench", "logits",
    ];
    for a in args.iter_mut() {
        if a == "-np" {
            *a = "--parallel".into();
        }
    }
    let cmd = args
        .get(1)
        .and_then(|c| c.to_str())
        .unwrap_or("")
        .to_string();
    if TAKES_M.contains(&cmd.as_str()) {
        let first_is_positional = args
            .get(2)
            .and_then(|a| a.to_str())
            .is_some_and(|a| !a.starts_with('-'));
        if first_is_positional {
            args.insert(2, "-m".into());
        }
    } else if cmd == "inspect" {
        if let Some(i) = args.iter().position(|a| a == "-m" || a == "--model") {
            args.remove(i);
        } else if let Some(a) = args.iter_mut().find(|a| {
            a.to_str()
                .is_some_and(|s| s.starts_with("--model=") || s.starts_with("-m="))
        }) {
            let s = a.to_str().unwrap_or_default();
            *a = s[s.find('=').map_or(0, |i| i + 1)..].to_string().into();
        }
    }
    args
}

fn main() -> ExitCode {
    quiet_headless_vulkan();
    let cli = Cli::parse_from(normalize_args(std::env::args_os().collect()));
    // A bug must not surface as exit 101 with a backtrace: report it as an internal error.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("lathe: internal error: {info}");
    }));
    match std::panic::catch_unwind(|| run(cli)) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => {
            eprintln!("lathe: error: {e}");
            ExitCode::from(1)
        }
        Err(_) => ExitCode::from(2),
    }
}
