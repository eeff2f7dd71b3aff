//! `lathe plan`: where a MoE model's experts would live on this adapter (or a given memory
//! size), what a decode step then reads from VRAM and from host memory, and the decode
//! speed limit those bytes imply. Loads nothing onto the GPU.
//!
//! The limit is bandwidth arithmetic: `t_vram = vram bytes / --vram-bw`, `t_host = host bytes
//! / --host-bw`; "serial" is `1 / (t_vram + t_host)` (CPU and GPU take turns), "overlapped"
//! `1 / max(t_vram, t_host)` (the CPU's cold experts fully hidden behind the GPU, or the
//! reverse). The VRAM bandwidth is the adapter's (`bench::adapter_bandwidth`: measured host
//! memory on a CPU adapter, lathe's measurement for known GPUs such as the H200's 4000 GB/s,
//! else a short read kernel), and the report says which; host reads of cold experts default
//! to 20 GB/s (what llama.cpp's CPU experts reached with 16 threads on the H200's host: 20
//! Q4_K_M layers at 50.6 tok/s). Pass your own measurements for other machines.
//!
//! The budget is `models::model_budget`, the one the loaders place experts with (KV, recurrent
//! state and activation bytes from `models::needs`: Qwen3.5 family and DeepSeek-V4; other
//! architectures count only weights and the margin), so with the same `--gpu-mem`, `--ctx`,
//! KV type and sequences a load gives the arena this report shows.

use clap::Args;
use lathe::bench::SourcedBandwidth;
use lathe::engine::{KvType, LoadOptions};
use lathe::gpu::AdapterChoice;
use lathe::inspect::human_bytes;
use lathe::model_file::ModelFile;
use lathe::models::model_budget;
use lathe::moe::{AdapterMemory, ExpertStats, Fill, MoeInfo, RunShape};
use lathe::{Error, Result};
use std::fmt::Write;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Model: a GGUF file, a Hugging Face checkpoint directory, or a Hub model
    /// `owner/repo[:QUANT]` (downloaded into the Hugging Face cache).
    #[arg(short, long, value_name = "PATH")]
    pub model: PathBuf,
    // The load flags of `lathe run` (`--gpu-mem`, `--devices`, `--split`, `--gpu-experts`,
    // `--kv-type`, `--device`, `--cold-layers`, `--expert-stream`, ...), so one command
    // line plans and runs alike; those that leave the placement as it is (kernels,
    // micro-batches, the CPU's instruction set) change nothing here.
    #[command(flatten)]
    pub load: super::load::LoadArgs,
    /// Context length the KV cache is sized for.
    #[arg(long, value_name = "N", default_value_t = 4096)]
    pub ctx: u64,
    /// Routing statistics written by `--save-expert-stats` (default: uniform routing); as
    /// --expert-stats.
    #[arg(long, value_name = "FILE", conflicts_with = "expert_stats")]
    pub stats: Option<PathBuf>,
    /// Tokens per prefill pass the activations are sized for (default: the model's own
    /// loader's pass rows).
    #[arg(long, value_name = "N")]
    pub batch: Option<u64>,
    /// Sequences live at once, each with its own KV cache and state (`lathe run`: 1, `lathe
    /// chat`: 2, `lathe serve`: 2 per `--parallel` slot, its sequence and its checkpoint).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seqs: u64,
    /// VRAM bandwidth in GB/s. Default: the adapter's (on a CPU adapter such as lavapipe the
    /// host's measured memory bandwidth; for a GPU lathe has measured, such as the H200, that
    /// measurement; else a short read kernel on it); the report says where it came from.
    #[arg(long, value_name = "GBPS")]
    pub vram_bw: Option<f64>,
    /// Host memory bandwidth the CPU reaches on cold experts, in GB/s.
    #[arg(long, value_name = "GBPS", default_value_t = 20.0)]
    pub host_bw: f64,
    /// One MoE layer's GPU → CPU → GPU round trip in a decode step, in ms (`lathe bench
    /// --moe-timeline` measures it: wait + after per layer).
    #[arg(long, value_name = "MS", default_value_t = 0.25)]
    pub hop_ms: f64,
    /// Host → GPU copy speed for streamed prompt experts, in GB/s.
    #[arg(long, value_name = "GBPS", default_value_t = 20.0)]
    pub link_bw: f64,
}

/// The adapter `choice` names and its index, without creating a device.
fn adapter_info(choice: &AdapterChoice) -> Option<(usize, wgpu::AdapterInfo)> {
    let mut all = lathe::gpu::list_adapters().into_iter().enumerate();
    match choice {
        AdapterChoice::Auto => all.next(),
        AdapterChoice::Index(i) => all.nth(*i),
        AdapterChoice::Name(n) => {
            let n = n.to_lowercase();
            all.find(|(_, a)| a.name.to_lowercase().contains(&n))
        }
    }
}

pub fn run(a: PlanArgs) -> Result<()> {
    print!("{}", report(&a)?);
    Ok(())
}

fn gbps(bytes: f64, bw: f64) -> f64 {
    bytes / (bw * 1e9)
}

/// The whole report (stdout).
pub fn report(a: &PlanArgs) -> Result<String> {
    let o = &a.load.load_options(1)?;
    if !(a.vram_bw.unwrap_or(1.0) > 0.0 && a.host_bw > 0.0) {
        return Err(Error::Invalid(
            "--vram-bw and --host-bw must be positive (GB/s)".into(),
        ));
    }
    let file = ModelFile::open(&a.model)?;
    let info = MoeInfo::from_file(&file, lathe::models::registry::expert_names(&file))?;
    if !o.devices.is_empty() {
        return devices_report(a, o, &file, info);
    }
    let (adapter, mem, bw) = match (adapter_info(&o.adapter), o.gpu_mem_of(0)) {
        (Some((ix, i)), m) => {
            let dm = lathe::gpu::adapter_memory(ix);
            let bw = vram_bandwidth(a, Some((ix, &i)))?;
            (
                i.name.clone(),
                AdapterMemory::detect(&i, dm.as_ref(), m),
                bw,
            )
        }
        (None, Some(b)) => (
            "(none found)".to_string(),
            AdapterMemory {
                bytes: b,
                source: lathe::moe::MemSource::Flag,
            },
            vram_bandwidth(a, None)?,
        ),
        (None, None) => {
            return Err(Error::Gpu(
                "no GPU adapter found: pass --gpu-mem SIZE to plan for one".into(),
            ))
        }
    };
    let stats = load_stats(a, o, &info)?;
    let run = run_shape(a, o, &file);
    // The loaders' own budget (`models::model_budget`), for this run shape.
    let (budget, nd) = model_budget(&file, &info, mem.bytes, run, o)?;
    let mut s = String::new();
    writeln!(
        s,
        "model: {} ({}): {} layers, {} MoE layers, top-{}",
        info.path.display(),
        info.arch,
        info.n_layer,
        info.layers.len(),
        info.n_used
    )
    .ok();
    writeln!(s, "adapter: {adapter}: memory {}", mem.describe()).ok();
    writeln!(s, "bandwidth: {}", describe_bw(&bw)).ok();
    let dev = DeviceBudget {
        budget: &budget,
        needs: &nd,
        bw: &bw,
    };
    placement_report(&mut s, a, o, run, &info, stats.as_ref(), &dev)?;
    Ok(s)
}

/// `--vram-bw`, else the adapter's bandwidth (`bench::adapter_bandwidth`); without an
/// adapter and without the flag, the H200's measured figure, said to be assumed.
fn vram_bandwidth(
    a: &PlanArgs,
    adapter: Option<(usize, &wgpu::AdapterInfo)>,
) -> Result<SourcedBandwidth> {
    Ok(match (a.vram_bw, adapter) {
        (Some(gbps), _) => SourcedBandwidth {
            bytes_per_s: gbps * 1e9,
            source: "--vram-bw".into(),
        },
        (None, Some((ix, info))) => lathe::bench::adapter_bandwidth(ix, info)?,
        (None, None) => SourcedBandwidth {
            bytes_per_s: H200_VRAM_BW,
            source: "assumed: no adapter found, the H200's measured figure; pass --vram-bw".into(),
        },
    })
}

/// The H200's measured read bandwidth (FACTS.md), for plans without an adapter.
const H200_VRAM_BW: f64 = 4000e9;

fn describe_bw(bw: &SourcedBandwidth) -> String {
    format!("{:.1} GB/s ({})", bw.bytes_per_s / 1e9, bw.source)
}

fn load_stats(a: &PlanArgs, o: &LoadOptions, info: &MoeInfo) -> Result<Option<ExpertStats>> {
    match a.stats.as_ref().or(o.expert_stats.as_ref()) {
        Some(p) => {
            let s = ExpertStats::load(p)?;
            s.check(info, p)?;
            Ok(Some(s))
        }
        None => Ok(None),
    }
}

fn run_shape(a: &PlanArgs, o: &LoadOptions, file: &ModelFile) -> RunShape {
    RunShape {
        kv: o.kv_type,
        ctx: a.ctx,
        batch: a
            .batch
            .unwrap_or_else(|| lathe::models::pass_rows(file) as u64)
            .max(1),
        seqs: a.seqs.max(1),
    }
}

/// `lathe plan --devices`: the split (as `models::chain` makes it), then per device the
/// budget and placement of the layers it holds.
fn devices_report(
    a: &PlanArgs,
    o: &LoadOptions,
    file: &ModelFile,
    info: MoeInfo,
) -> Result<String> {
    use lathe::models::chain::LayerBytes;
    use lathe::models::chain::{balanced_split, split_layers};
    // `--gpu-mem` sizes were checked against the devices by `LoadArgs::load_options`.
    let choices = &o.devices;
    let mut mems = Vec::with_capacity(choices.len());
    let mut names = Vec::with_capacity(choices.len());
    let mut bws = Vec::with_capacity(choices.len());
    for (i, c) in choices.iter().enumerate() {
        let size = o.gpu_mem_of(i);
        match (adapter_info(c), size) {
            (Some((ix, ai)), m) => {
                names.push(ai.name.clone());
                let dm = lathe::gpu::adapter_memory(ix);
                mems.push(AdapterMemory::detect(&ai, dm.as_ref(), m));
                bws.push(vram_bandwidth(a, Some((ix, &ai)))?);
            }
            (None, Some(b)) => {
                names.push("(none found)".to_string());
                bws.push(vram_bandwidth(a, None)?);
                mems.push(AdapterMemory {
                    bytes: b,
                    source: lathe::moe::MemSource::Flag,
                });
            }
            (None, None) => {
                return Err(Error::Gpu(format!(
                    "device {c:?} not found: pass --gpu-mem SIZE to plan for it"
                )))
            }
        }
    }
    // As `models::chain::plan_split`.
    let ranges = match &o.split {
        Some(ratios) => {
            if ratios.len() != choices.len() {
                return Err(Error::Invalid(format!(
                    "--split: {} ratios for {} devices",
                    ratios.len(),
                    choices.len()
                )));
            }
            split_layers(info.n_layer, ratios)?
        }
        None => {
            split_layers(info.n_layer, &vec![1.0; choices.len()])?;
            balanced_split(&LayerBytes::of(file, info.n_layer), &mems)
        }
    };
    let stats = load_stats(a, o, &info)?;
    let run = run_shape(a, o, file);
    let mut s = String::new();
    writeln!(
        s,
        "model: {} ({}): {} layers, {} MoE layers, top-{}; split over {} devices",
        info.path.display(),
        info.arch,
        info.n_layer,
        info.layers.len(),
        info.n_used,
        ranges.len()
    )
    .ok();
    let n = ranges.len();
    let mut cold = 0usize;
    for (i, layers) in ranges.into_iter().enumerate() {
        let part = lathe::model_file::PartSpec {
            layers: layers.clone(),
            first: i == 0,
            last: i + 1 == n,
        };
        let mut pi = info.clone();
        pi.restrict(file, &part);
        let nd = lathe::models::needs_part(file, run, &part);
        let budget = lathe::moe::budget_for(&pi, mems[i].bytes, run.ctx, &nd);
        writeln!(
            s,
            "\ndevice {i}: layers {}..{}{}{} on {}: memory {}",
            layers.start,
            layers.end,
            if part.first { ", embedding" } else { "" },
            if part.last { ", output head" } else { "" },
            names[i],
            mems[i].describe()
        )
        .ok();
        writeln!(s, "bandwidth: {}", describe_bw(&bws[i])).ok();
        let dev = DeviceBudget {
            budget: &budget,
            needs: &nd,
            bw: &bws[i],
        };
        cold += placement_report(&mut s, a, o, run, &pi, stats.as_ref(), &dev)?;
    }
    writeln!(
        s,
        "\nexperts on the CPU over all devices: {cold}{}",
        if cold == 0 {
            " (the GPUs together hold every expert)"
        } else {
            ""
        }
    )
    .ok();
    Ok(s)
}

/// The device a placement is planned for (the only one, or one of `--devices`): its memory
/// budget, what the budget was computed from, its bandwidth.
struct DeviceBudget<'a> {
    budget: &'a lathe::moe::Budget,
    needs: &'a lathe::moe::Needs,
    bw: &'a SourcedBandwidth,
}

/// The budget, placement and decode-step bytes of `info`'s experts (a whole model, or one
/// device's part) on `dev`. Returns the experts left on the CPU.
fn placement_report(
    s: &mut String,
    a: &PlanArgs,
    o: &LoadOptions,
    run: RunShape,
    info: &MoeInfo,
    stats: Option<&ExpertStats>,
    dev: &DeviceBudget<'_>,
) -> Result<usize> {
    let DeviceBudget {
        budget,
        needs: nd,
        bw,
    } = *dev;
    let vram_bw = bw.bytes_per_s / 1e9;
    let fill = match o.gpu_experts {
        Some(f) => Fill::Fraction(f),
        None => Fill::Budget(budget.experts),
    };
    let placement =
        lathe::moe::offload::place_streaming(info, fill, stats, o.cold_layers, o.expert_stream)?;
    let hb = human_bytes;
    if let Some(n) = &nd.note {
        writeln!(s, "note: {n}").ok();
    }
    // The cache type the estimate used: `auto` resolves per architecture (f16 for
    // Qwen3.5, f32 for DeepSeek-V4, `engine::KvType`).
    let kv = match nd.kv_elem {
        4 => "f32",
        2 => "f16",
        _ => "?",
    };
    writeln!(
        s,
        "budget (ctx {}, KV {kv}{}, batch {}, {} seq):",
        a.ctx,
        if o.kv_type == KvType::Auto {
            " (auto)"
        } else {
            ""
        },
        run.batch,
        run.seqs
    )
    .ok();
    for (what, b) in [
        ("non-expert weights", budget.weights),
        ("KV cache", budget.kv),
        ("state, windows", budget.state),
        ("activations", budget.activations),
        ("safety margin", budget.margin),
        ("left for experts", budget.experts),
    ] {
        writeln!(s, "  {what:<20} {:>12}", hb(b)).ok();
    }
    if !budget.fits() {
        writeln!(
            s,
            "  DOES NOT FIT: {} short beside the experts",
            hb(budget.shortfall)
        )
        .ok();
    }
    if info.layers.is_empty() {
        writeln!(s, "no routed experts: nothing to place").ok();
        return Ok(0);
    }
    writeln!(
        s,
        "routed experts: {} in all; placement by {}{}:",
        hb(info.expert_bytes()),
        match fill {
            Fill::Fraction(f) => format!("--gpu-experts {f}"),
            Fill::Budget(_) => "budget".into(),
        },
        if stats.is_some() {
            " and routing statistics"
        } else {
            ""
        }
    )
    .ok();
    for (g, grp) in placement.groups.iter().enumerate() {
        let sh: Vec<String> = grp
            .shapes
            .iter()
            .zip(["gate", "up", "down"])
            .map(|(m, k)| format!("{k} {} {}x{}", m.dtype, m.rows, m.cols))
            .collect();
        writeln!(
            s,
            "  arena group {g}: {}; {} per slot, {} slots, {}",
            sh.join(", "),
            hb(grp.slot_bytes()),
            grp.n_slots,
            hb(grp.bytes())
        )
        .ok();
    }
    let traffic = placement.traffic(info, stats);
    writeln!(
        s,
        "  {:>5} {:>7} {:>6} {:>6} {:>12} {:>12} {:>9}",
        "layer", "experts", "slots", "group", "slot bytes", "arena bytes", "hot picks"
    )
    .ok();
    for ((lp, m), t) in placement.layers.iter().zip(&info.layers).zip(&traffic) {
        writeln!(
            s,
            "  {:>5} {:>7} {:>6} {:>6} {:>12} {:>12} {:>9.3}",
            lp.layer,
            lp.n_expert,
            lp.n_slots(),
            lp.group,
            m.expert_bytes(),
            m.expert_bytes() * lp.n_slots() as u64,
            t.hot_picks + 0.0 // -0 prints as "-0.000"
        )
        .ok();
    }
    let arena = placement.arena_bytes();
    writeln!(s, "  arena total: {}", hb(arena)).ok();
    let all_hot = placement.layers.iter().all(|l| l.n_slots() == l.n_expert);
    if matches!(fill, Fill::Budget(_))
        && !all_hot
        && o.expert_stream != lathe::engine::ExpertStream::Never
    {
        writeln!(
            s,
            "  streaming slots: {} set aside for prompt batches (--expert-stream never frees them)",
            hb(lathe::moe::offload::stream_bytes(&placement))
        )
        .ok();
    }
    if arena > budget.experts {
        writeln!(
            s,
            "  warning: the arena exceeds the budget by {}",
            hb(arena - budget.experts)
        )
        .ok();
    }
    let hot: f64 = traffic.iter().map(|t| t.vram_bytes).sum();
    let cold: f64 = traffic.iter().map(|t| t.host_bytes).sum();
    let kv_read = (nd.kv_per_token * a.ctx + nd.state) as f64;
    let vram = info.other_decode_bytes as f64 + hot + kv_read;
    writeln!(
        s,
        "decode step ({} routing):",
        if stats.is_some() {
            "measured"
        } else {
            "uniform"
        }
    )
    .ok();
    writeln!(
        s,
        "  VRAM reads: {} (weights {}, hot experts {}, KV + state at ctx {} {})",
        hb(vram as u64),
        hb(info.other_decode_bytes),
        hb(hot as u64),
        a.ctx,
        hb(kv_read as u64)
    )
    .ok();
    writeln!(s, "  host reads: {} (cold experts)", hb(cold as u64)).ok();
    let (tv, th) = (gbps(vram, vram_bw), gbps(cold, a.host_bw));
    writeln!(
        s,
        "limit (VRAM {vram_bw:.1} GB/s, host {} GB/s): {:.1} tok/s serial, {:.1} tok/s overlapped \
         (VRAM alone {:.1}, host alone {})",
        a.host_bw,
        1.0 / (tv + th),
        1.0 / tv.max(th),
        1.0 / tv,
        if th > 0.0 {
            format!("{:.1}", 1.0 / th)
        } else {
            "-".into()
        }
    )
    .ok();
    let experts = Experts { info, fill, stats };
    expected_speed(s, a, o, run.batch, &experts, vram - hot, vram_bw)?;
    Ok(placement
        .layers
        .iter()
        .map(|l| l.n_expert - l.n_slots())
        .sum())
}

/// The routed experts to place: the model's (or a device part's), how many stay on the GPU,
/// and the routing statistics that pick which.
struct Experts<'a> {
    info: &'a MoeInfo,
    fill: Fill,
    stats: Option<&'a ExpertStats>,
}

/// Expected decode and prefill speed of the routed experts for each way of keeping experts
/// off the GPU, from the measured link, CPU and GPU speeds (`--hop-ms`, `--host-bw`,
/// `--vram-bw`, `--link-bw`), and the flag that picks each. `other_vram`: the bytes a decode
/// step reads besides the hot experts.
fn expected_speed(
    s: &mut String,
    a: &PlanArgs,
    o: &LoadOptions,
    batch: u64,
    experts: &Experts<'_>,
    other_vram: f64,
    vram_bw: f64,
) -> Result<()> {
    let Experts { info, fill, stats } = *experts;
    let c = lathe::moe::Costs {
        hop_s: a.hop_ms / 1e3,
        host_bytes_per_s: a.host_bw * 1e9,
        vram_bytes_per_s: vram_bw * 1e9,
    };
    let rest = other_vram / c.vram_bytes_per_s;
    writeln!(
        s,
        "expected decode ({} ms per hop, host {} GB/s, VRAM {:.1} GB/s; non-expert reads {:.3} ms):",
        a.hop_ms,
        a.host_bw,
        vram_bw,
        rest * 1e3
    )
    .ok();
    for (mode, flag) in [
        (lathe::engine::ColdLayers::Spread, "--cold-layers spread"),
        (lathe::engine::ColdLayers::Whole, "--cold-layers whole"),
    ] {
        let p = lathe::moe::offload::place_streaming(info, fill, stats, mode, o.expert_stream)?;
        let t = p.decode_seconds(info, stats, &c);
        let hops = p.layers.iter().filter(|l| l.n_slots() < l.n_expert).count();
        writeln!(
            s,
            "  {flag:<22} {:>8.1} tok/s ({hops} layers with cold experts, experts {:.3} ms)",
            1.0 / (t + rest),
            t * 1e3
        )
        .ok();
    }
    // A prefill batch of `batch` rows, uniform routing: each cold expert's pairs computed
    // on the CPU (this machine's cores at `offload::CPU_PARAMS_PER_CORE_S`) against one copy
    // of each picked cold expert over the link.
    let p =
        lathe::moe::offload::place_streaming(info, fill, stats, o.cold_layers, o.expert_stream)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let rate = lathe::moe::offload::CPU_PARAMS_PER_CORE_S * cores;
    let (mut cpu, mut link) = (0f64, 0f64);
    for (lp, m) in p.layers.iter().zip(&info.layers) {
        let cold = (lp.n_expert - lp.n_slots()) as f64;
        let pairs = batch as f64 * info.n_used as f64 * cold / lp.n_expert.max(1) as f64;
        // Distinct cold experts that `pairs` uniform picks among `cold` reach.
        let picked = if cold > 0.0 {
            cold * (1.0 - (1.0 - 1.0 / cold).powf(pairs))
        } else {
            0.0
        };
        cpu += pairs * (3 * m.n_ff() * m.n_embd()) as f64 / rate;
        link += picked * m.expert_bytes() as f64 / (a.link_bw * 1e9);
    }
    if cpu == 0.0 {
        writeln!(s, "expected prefill: no cold experts to compute or stream").ok();
        return Ok(());
    }
    writeln!(
        s,
        "expected prefill, cold experts of a {}-token batch: {:.1} tok/s on {cores} CPU cores \
         (--expert-stream never), {:.1} tok/s streamed at {} GB/s (--expert-stream always); \
         auto takes the faster per layer",
        batch,
        batch as f64 / cpu,
        batch as f64 / link.max(1e-12),
        a.link_bw
    )
    .ok();
    Ok(())
}
