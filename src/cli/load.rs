//! How a model loads: the flags every command that loads one shares (run, chat, serve,
//! bench, plan, logits) and their one conversion to [`LoadOptions`].

use std::path::{Path, PathBuf};

use clap::Args;
use lathe::engine::{Engine, KvType, LoadOptions};
use lathe::gpu::AdapterChoice;
use lathe::{Error, Result};

/// Where the model runs and how: the adapter, the KV cache type, expert placement, devices
/// and kernels.
#[derive(Args, Debug, Clone)]
pub struct LoadArgs {
    /// GPU adapter: `auto`, an index or a name substring (see `lathe devices`).
    #[arg(long, value_name = "I", default_value = "auto")]
    pub device: AdapterChoice,
    /// KV cache element type: auto (the model's default: f16 for Qwen3.5, f32 for
    /// DeepSeek-V4), f16 or f32.
    #[arg(long, value_name = "TYPE", default_value = "auto")]
    pub kv_type: KvType,
    /// The model's multi-token prediction block in a file of its own (Step-3.5/3.7 ship it
    /// apart from the trunk: llama.cpp's converter writes it with --mtp), for --spec mtp.
    #[arg(long, value_name = "FILE")]
    pub mtp_model: Option<PathBuf>,
    #[command(flatten)]
    pub moe: MoeArgs,
}

impl LoadArgs {
    /// The options these flags give, checked (`MoeArgs::checked_gpu_mem`), for a command
    /// whose decode passes carry up to `decode_rows` rows (sequences decoded together times
    /// the rows of a verify pass: `--fused-loads auto` is
    /// [`LoadOptions::fused_loads_auto`] of it); the command sets what is its own (context,
    /// sequences, progress).
    pub fn load_options(&self, decode_rows: usize) -> Result<LoadOptions> {
        let m = &self.moe;
        let gpu_mem = m.checked_gpu_mem()?;
        let d = LoadOptions::default();
        Ok(LoadOptions {
            adapter: self.device.clone(),
            kv_type: self.kv_type,
            gpu_mem,
            devices: m.devices.as_ref().map_or(d.devices, |l| l.0.clone()),
            split: m.split.as_ref().map(|r| r.0.clone()),
            micro_batches: m.micro_batches,
            gpu_experts: m.gpu_experts,
            expert_stats: m.expert_stats.clone(),
            save_expert_stats: m.save_expert_stats.clone(),
            matmul: m.matmul,
            activations: m.activations,
            fused_loads: m
                .fused_loads
                .get()
                .unwrap_or(LoadOptions::fused_loads_auto(decode_rows)),
            expert_stream: m.expert_stream,
            cold_layers: m.cold_layers,
            cpu_simd: m.cpu_simd,
            mtp_model: self.mtp_model.clone(),
            ..d
        })
    }
}

/// Where a MoE model's routed experts go (GPU arena slots or the CPU) and which kernels run
/// the products; shared by every command that runs a model.
#[derive(Args, Debug, Clone, Default)]
pub struct MoeArgs {
    /// Kernels of products over many tokens (prefill, batches): auto (the GPU's matrix
    /// units where it has them, else int8x2; f32-level for models that route on values, MoE
    /// models and DeepSeek-V4: coop-xsplit on matrix units, else tiled), coop
    /// (cooperative matrices, f16 operands; an error where absent), coop-split (f32-level
    /// matrix units), coop-xsplit (coop-split on the tile that stages weights and x in
    /// workgroup memory), coop-splitx (f16 weights, split activations), int8x2 (two-level int8
    /// activations, f32-level), int8 (one level, as llama.cpp) or tiled (the f32 kernel, exact
    /// f32 activations).
    #[arg(long, value_name = "PATH", default_value = "auto")]
    pub matmul: lathe::gpu::MatmulChoice,
    /// Activations of one-token (decode) products: auto (f32: the int8 path meets the fixture
    /// bars but decodes slower on the GPUs measured), f32, or int8 (x quantized per 32 values in two int8 levels, within max|x|/64516, for
    /// the Q4_0, Q8_0, Q4_K, Q5_K and Q6_K products; not for products with --fused-loads on).
    #[arg(long, value_name = "TYPE", default_value = "auto")]
    pub activations: lathe::engine::ActivationsChoice,
    /// Decode folds the RMSNorms and the output gates into the products (fewer dispatches):
    /// on, off, or auto (on where every decode pass has one row; off for several sequences
    /// at once, --parallel above 1, and for speculative decoding's verify passes, --spec mtp
    /// or draft or a --draft-model: their rows pay the norm's pass over each token's row in
    /// every product's workgroups).
    #[arg(long, value_name = "ON|OFF|AUTO", default_value = "auto")]
    pub fused_loads: OnOffAuto,
    /// GPU memory to plan for (24GiB, 512MiB, 1.5GB): what the model needs beside its routed
    /// experts comes first, the rest holds expert slots, the other experts run on the CPU.
    /// With --devices one size per device (24GiB,16GiB) or one for each. Default: detected
    /// from the adapter.
    #[arg(long, value_name = "SIZE")]
    pub gpu_mem: Option<String>,
    /// Split the model's layers over several GPUs: indices or name substrings from `lathe
    /// devices`, separated by commas (`0,1`; the same one twice makes two devices on one
    /// adapter), or `all`. Replaces --device.
    #[arg(long, value_name = "LIST", value_parser = devices_arg)]
    pub devices: Option<DeviceList>,
    /// Shares of the layers per device of --devices (`1,3`: a quarter on the first).
    /// Default: by each adapter's memory (--gpu-mem or detected), equal where unknown.
    #[arg(long, value_name = "RATIOS", value_parser = split_arg)]
    pub split: Option<Ratios>,
    /// With --devices: run a batch of several sequences as N micro-batches, one after
    /// another through the devices, so each device works while the next runs the micro-batch
    /// before (1: the whole batch at once).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub micro_batches: usize,
    /// Share of each MoE layer's experts kept on the GPU (0..1); overrides --gpu-mem.
    #[arg(long, value_name = "FRACTION", value_parser = fraction_arg)]
    pub gpu_experts: Option<f64>,
    /// Routing statistics (from --save-expert-stats) that choose which experts stay on
    /// the GPU; without them the slots are spread evenly.
    #[arg(long, value_name = "FILE")]
    pub expert_stats: Option<PathBuf>,
    /// Count the router's picks while running and write them here at the end (JSON, for
    /// --expert-stats and `lathe plan`); costs one readback per MoE layer and token.
    #[arg(long, value_name = "FILE")]
    pub save_expert_stats: Option<PathBuf>,
    /// Cold experts of prompt batches: auto (copied to the GPU when that beats the CPU),
    /// always (every batch of more than one token) or never (always on the CPU).
    #[arg(long, value_name = "MODE", default_value = "auto")]
    pub expert_stream: lathe::engine::ExpertStream,
    /// Which layers hold the cold experts: auto (the planner's decode estimate decides,
    /// under a --gpu-mem budget), spread (a share of every layer) or whole (whole layers
    /// cold, as llama.cpp's -ncmoe; with --gpu-experts F, F of all expert bytes stay hot).
    #[arg(long, value_name = "MODE", default_value = "auto")]
    pub cold_layers: lathe::engine::ColdLayers,
    /// Instruction set of the CPU's cold-expert kernels: scalar, avx2 or avx512vnni
    /// (default: the widest this CPU has; for measurements and tests).
    #[arg(long, value_name = "LEVEL")]
    pub cpu_simd: Option<lathe::cpu::simd::SimdLevel>,
}

/// `--devices` parsed.
#[derive(Clone, Debug)]
pub struct DeviceList(pub Vec<AdapterChoice>);

/// `--split` parsed.
#[derive(Clone, Debug)]
pub struct Ratios(pub Vec<f64>);

fn devices_arg(s: &str) -> std::result::Result<DeviceList, String> {
    lathe::models::chain::parse_devices(s)
        .map(DeviceList)
        .map_err(|e| e.to_string())
}

fn split_arg(s: &str) -> std::result::Result<Ratios, String> {
    lathe::models::chain::parse_split(s)
        .map(Ratios)
        .map_err(|e| e.to_string())
}

/// A switch whose `auto` leaves the choice to the command.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOffAuto {
    On,
    Off,
    #[default]
    Auto,
}

impl OnOffAuto {
    /// `Some(on)`, or `None` for auto.
    pub fn get(self) -> Option<bool> {
        match self {
            OnOffAuto::On => Some(true),
            OnOffAuto::Off => Some(false),
            OnOffAuto::Auto => None,
        }
    }
}

fn fraction_arg(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("`{s}`: a share between 0 and 1")),
    }
}

impl MoeArgs {
    /// `--gpu-mem`: one size, or one per device separated by commas, each as
    /// `moe::parse_size` reads it; checked against the devices. Also fails when the
    /// --save-expert-stats file cannot be written: before the model loads and runs, not
    /// after.
    fn checked_gpu_mem(&self) -> Result<Vec<u64>> {
        let n_dev = self.devices.as_ref().map_or(1, |d| d.0.len());
        if self.split.is_some() && n_dev < 2 {
            return Err(Error::Invalid(
                "--split needs --devices with two devices or more".into(),
            ));
        }
        let sizes = match &self.gpu_mem {
            Some(s) => s
                .split(',')
                .map(|p| {
                    lathe::moe::parse_size(p.trim())
                        .map_err(|e| Error::Invalid(format!("--gpu-mem {s}: {e}")))
                })
                .collect::<Result<Vec<u64>>>()?,
            None => Vec::new(),
        };
        if sizes.len() > 1 && sizes.len() != n_dev {
            return Err(Error::Invalid(format!(
                "--gpu-mem: {} sizes for {n_dev} device(s) (one, or one per device of --devices)",
                sizes.len()
            )));
        }
        if let Some(p) = &self.save_expert_stats {
            check_writable(p)?;
        }
        Ok(sizes)
    }

    /// Write the statistics `engine` counted, when --save-expert-stats asked for them (a
    /// model dropped without this writes them too, reporting errors only on stderr).
    pub fn save(&self, engine: &Engine) -> Result<()> {
        if self.save_expert_stats.is_some() {
            match engine.finish_expert_stats()? {
                Some(p) => eprintln!("expert statistics written to {}", p.display()),
                None => eprintln!("note: the model has no routed experts: no statistics"),
            }
        }
        Ok(())
    }
}

/// Fails when `path` cannot be opened for writing; leaves no file behind that was not
/// there.
fn check_writable(path: &Path) -> Result<()> {
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}
