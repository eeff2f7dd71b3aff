//! How much GPU memory the expert arena gets: the adapter's memory minus what the model
//! needs beside its routed experts.
//!
//! WebGPU does not report memory sizes or free memory. `Limits::max_buffer_size` and
//! `max_storage_buffer_binding_size` bound ONE buffer (lavapipe offers 2 GiB buffers on any
//! machine; the H200 4 GiB of its 141 GB), so they say nothing about the total. lathe
//! therefore takes the size from, in order ([`AdapterMemory::detect`]):
//! 1. `--gpu-mem SIZE` (also lets a big GPU behave like a small one, for testing);
//! 2. what the backend reports under wgpu (`gpu::memory`: Vulkan's largest device-local
//!    heap, and its `VK_EXT_memory_budget` budget when the driver offers one; DXGI's
//!    dedicated video memory and `QueryVideoMemoryInfo` budget; Metal's recommended
//!    working set); for an
//!    integrated GPU at most half of the system RAM (`MemTotal` of /proc/meminfo): "VRAM"
//!    is host memory there, and the other half stays for the OS page cache that backs the
//!    mmap'd cold experts. A CPU adapter (lavapipe, llvmpipe, SwiftShader) gets half the
//!    RAM whatever its driver reports (lavapipe reports a 2 GiB heap on any machine);
//! 3. without a report (GL, or a backend query that failed), stated guesses: half the system RAM for a
//!    CPU or integrated adapter; a size in the adapter name (`NVIDIA A100-SXM4-80GB`,
//!    `... 48GB` → that many GiB), or a short table of data-centre GPUs whose names carry
//!    none ([`KNOWN_ADAPTERS`]);
//! 4. otherwise [`ASSUMED_MEMORY`] (4 GiB), conservative on purpose: a smaller arena only
//!    costs speed, an arena that does not fit fails. Callers say so and suggest `--gpu-mem`.
//!
//! The budget itself is plain arithmetic ([`Budget::new`]) on byte counts the caller
//! supplies, so it knows no architecture: non-expert weights (from [`super::MoeInfo`]), KV
//! bytes per position times the context, fixed per-sequence state (recurrent and conv state,
//! sliding windows), activation scratch, and a safety margin ([`default_margin`]).

use crate::gpu::DeviceMemory;
use crate::{Error, Result};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// Adapter memory assumed when nothing tells it (see the module doc).
pub const ASSUMED_MEMORY: u64 = 4 * GIB;

/// Data-centre adapters whose names carry no size: (name substring, usable bytes as
/// `nvidia-smi` reports the total: H200 143,771 MiB, H100 SXM 81,559 MiB).
pub const KNOWN_ADAPTERS: &[(&str, u64)] = &[("H200", 140 * GIB), ("H100", 79 * GIB)];

/// Parse a memory size: a number (decimals allowed) and an optional unit, case-insensitive.
/// `B`; SI `KB MB GB TB` (powers of 1000); IEC `KiB MiB GiB TiB` and the bare letters
/// `K M G T` (powers of 1024, as `ls -h` and most GPU spec sheets mean them). `24GiB`,
/// `512MiB`, `1.5GB`, `24G`, `4096` (bytes).
pub fn parse_size(s: &str) -> Result<u64> {
    let bad = |why: &str| Error::Invalid(format!("size `{s}`: {why} (e.g. 24GiB, 512MiB, 1.5GB)"));
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(bad("no number"));
    }
    let v: f64 = num.parse().map_err(|_| bad("not a number"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "k" | "kib" => 1024.0,
        "m" | "mib" => MIB as f64,
        "g" | "gib" => GIB as f64,
        "t" | "tib" => (GIB * 1024) as f64,
        _ => return Err(bad("unknown unit")),
    };
    let b = (v * mult).round();
    if !b.is_finite() || b < 0.0 || b >= u64::MAX as f64 {
        return Err(bad("out of range"));
    }
    Ok(b as u64)
}

/// Where an adapter memory size came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemSource {
    /// `--gpu-mem`.
    Flag,
    /// The backend's report ([`DeviceMemory::describe`]).
    Driver(String),
    /// Half the system RAM (CPU or integrated adapter).
    SystemRam,
    /// The adapter's name (a size in it, or [`KNOWN_ADAPTERS`]).
    Name,
    /// Nothing known: [`ASSUMED_MEMORY`].
    Assumed,
}

/// The memory the budget divides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterMemory {
    pub bytes: u64,
    pub source: MemSource,
}

/// `MemTotal` of /proc/meminfo, in bytes.
pub fn system_ram() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// A `NNGB` token in an adapter name (`A100-SXM4-80GB`, `RTX A6000 48GB`), taken as GiB
/// (GPU vendors' "GB" of memory are binary).
fn size_in_name(name: &str) -> Option<u64> {
    name.split([' ', '-', '_', '(', ')'])
        .filter_map(|tok| {
            tok.to_ascii_lowercase()
                .strip_suffix("gb")?
                .parse::<u64>()
                .ok()
        })
        .find(|n| (1..=4096).contains(n))
        .map(|n| n * GIB)
}

impl AdapterMemory {
    /// See the module doc for the order of sources; `device`: what the backend reported
    /// (`Gpu::memory`, `gpu::adapter_memory`).
    pub fn detect(
        info: &wgpu::AdapterInfo,
        device: Option<&DeviceMemory>,
        gpu_mem: Option<u64>,
    ) -> AdapterMemory {
        Self::detect_with(info, device, gpu_mem, system_ram())
    }

    /// [`detect`](Self::detect) with the system RAM given (tests).
    pub fn detect_with(
        info: &wgpu::AdapterInfo,
        device: Option<&DeviceMemory>,
        gpu_mem: Option<u64>,
        ram: Option<u64>,
    ) -> AdapterMemory {
        let mk = |bytes, source| AdapterMemory { bytes, source };
        if let Some(b) = gpu_mem {
            return mk(b, MemSource::Flag);
        }
        let shared = matches!(
            info.device_type,
            wgpu::DeviceType::Cpu | wgpu::DeviceType::IntegratedGpu
        );
        let half_ram = ram.filter(|_| shared).map(|r| r / 2);
        // A CPU adapter's heap is a number the driver makes up (lavapipe: 2 GiB on any
        // machine, allocations beyond it succeed): its memory is the host's.
        let cpu = info.device_type == wgpu::DeviceType::Cpu;
        if let Some(d) = device.filter(|d| d.usable() > 0 && !(cpu && half_ram.is_some())) {
            return match half_ram {
                Some(h) if h < d.usable() => mk(h, MemSource::SystemRam),
                _ => mk(d.usable(), MemSource::Driver(d.describe())),
            };
        }
        if let Some(h) = half_ram {
            return mk(h, MemSource::SystemRam);
        }
        if let Some(b) = size_in_name(&info.name) {
            return mk(b, MemSource::Name);
        }
        let up = info.name.to_ascii_uppercase();
        if let Some(&(_, b)) = KNOWN_ADAPTERS.iter().find(|(n, _)| up.contains(n)) {
            return mk(b, MemSource::Name);
        }
        mk(ASSUMED_MEMORY, MemSource::Assumed)
    }

    /// One line for reports: `24.00 GiB (--gpu-mem)`.
    pub fn describe(&self) -> String {
        let why = match &self.source {
            MemSource::Flag => "--gpu-mem".to_string(),
            MemSource::Driver(d) => format!("reported by the driver: {d}"),
            MemSource::SystemRam => {
                "half the system RAM: a CPU/integrated adapter shares it".to_string()
            }
            MemSource::Name => "guessed from the adapter's name".to_string(),
            MemSource::Assumed => "nothing reported, assumed: pass --gpu-mem".to_string(),
        };
        format!("{} ({why})", crate::inspect::human_bytes(self.bytes))
    }
}

/// The safety margin for `memory` bytes: 5% (driver reservations, allocation rounding, the
/// uniform arena and pipelines, buffers wgpu keeps for transfers), at least
/// min(256 MiB, memory/8) so small budgets keep room too.
pub fn default_margin(memory: u64) -> u64 {
    (memory / 20).max((256 * MIB).min(memory / 8))
}

/// What the caller knows about its model and run (bytes).
#[derive(Clone, Debug, Default)]
pub struct BudgetInputs {
    /// Adapter memory ([`AdapterMemory::bytes`]).
    pub memory: u64,
    /// Non-expert weights that live on the GPU ([`super::MoeInfo::other_bytes`]).
    pub weights: u64,
    /// KV cache bytes per position, summed over layers (attention K and V at the cache's
    /// element type; compressed entries per position for DeepSeek-V4's compressed layers).
    pub kv_bytes_per_token: u64,
    /// Context length the caches are sized for.
    pub ctx: u64,
    /// Per-sequence state independent of the context: recurrent (GDN) state, conv state,
    /// sliding-window caches.
    pub state_bytes: u64,
    /// Activation scratch of the largest pass (prefill chunk), logits included.
    pub activation_bytes: u64,
    /// `None`: [`default_margin`]`(memory)`.
    pub margin: Option<u64>,
}

/// The division of adapter memory; every field in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Budget {
    pub memory: u64,
    pub weights: u64,
    /// `kv_bytes_per_token · ctx`.
    pub kv: u64,
    pub state: u64,
    pub activations: u64,
    pub margin: u64,
    /// What is left for expert slots (0 when nothing is).
    pub experts: u64,
    /// How much the needs beside the experts exceed the memory (0 when they fit).
    pub shortfall: u64,
}

impl Budget {
    pub fn new(inp: &BudgetInputs) -> Budget {
        let kv = inp.kv_bytes_per_token.saturating_mul(inp.ctx);
        let margin = inp.margin.unwrap_or_else(|| default_margin(inp.memory));
        let b = Budget {
            memory: inp.memory,
            weights: inp.weights,
            kv,
            state: inp.state_bytes,
            activations: inp.activation_bytes,
            margin,
            experts: 0,
            shortfall: 0,
        };
        let need = b.beside_experts();
        Budget {
            experts: inp.memory.saturating_sub(need),
            shortfall: need.saturating_sub(inp.memory),
            ..b
        }
    }

    /// Everything the model needs beside its experts, margin included.
    pub fn beside_experts(&self) -> u64 {
        self.weights
            .saturating_add(self.kv)
            .saturating_add(self.state)
            .saturating_add(self.activations)
            .saturating_add(self.margin)
    }

    /// True when the non-expert part fits (the experts may still all be cold).
    pub fn fits(&self) -> bool {
        self.shortfall == 0
    }
}

/// What a model needs beside its weights (bytes), estimated from its hyper-parameters: the
/// inputs of [`BudgetInputs`] that the loaders and `lathe plan` budget with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// Weights on the GPU from files other than the model's own (so not in
    /// [`super::MoeInfo::other_bytes`]): Step-3.5/3.7's MTP block from `--mtp-model`.
    pub weights: u64,
    /// KV cache bytes per position, all layers and sequences.
    pub kv_per_token: u64,
    /// Per-sequence state independent of the context, times the sequences.
    pub state: u64,
    /// Activation scratch of one pass of `batch` rows, logits included.
    pub activations: u64,
    /// Every buffer the run allocates whose size follows it (pass rows, sequences,
    /// context), logits at one row (their rows follow the binding limit): each must fit the
    /// device's limits (`gpu::fit_rows` picks the pass length by them). Empty when unknown.
    pub buffers: Vec<crate::gpu::PassBuffer>,
    /// Bytes of one KV cache element the estimate used (the cache type resolved: `Auto` is
    /// 2 for Qwen3.5, 4 for DeepSeek-V4); 0 when the architecture is unknown.
    pub kv_elem: u64,
    /// Why the estimate is partial, if it is.
    pub note: Option<String>,
}

impl Needs {
    /// `self` and `more` together (a draft block's needs beside its trunk's).
    pub fn add(&mut self, more: Needs) {
        self.weights += more.weights;
        self.kv_per_token += more.kv_per_token;
        self.state += more.state;
        self.activations += more.activations;
        self.buffers.extend(more.buffers);
        self.note = self.note.take().or(more.note);
    }
}

/// The run a budget is for (the loaders take it from `LoadOptions` by [`RunShape::new`],
/// `lathe plan` from its flags).
#[derive(Clone, Copy, Debug)]
pub struct RunShape {
    pub kv: crate::forward::KvType,
    /// Context length the caches are sized for.
    pub ctx: u64,
    /// Rows of one pass (the loaders' `DEFAULT_BATCH`).
    pub batch: u64,
    /// Sequences live at once.
    pub seqs: u64,
}

impl RunShape {
    /// The run `opts` loads for, with passes of `batch` rows.
    pub fn new(opts: &crate::forward::LoadOptions, batch: usize) -> RunShape {
        RunShape {
            kv: opts.kv_type,
            ctx: opts.ctx as u64,
            batch: batch as u64,
            seqs: opts.max_seqs as u64,
        }
    }
}

/// The budget of a model whose experts `info` describes, on `memory` bytes, for caches of
/// `ctx` positions and the needs `nd` its family reports for the run (`needs` of
/// `models::qwen35::gpu` / `models::deepseek4::gpu`): the one the loaders place experts with
/// (`moe::Plan::new`) and `lathe plan` prints (`models::model_budget`), so the two agree.
pub fn budget_for(info: &super::MoeInfo, memory: u64, ctx: u64, nd: &Needs) -> Budget {
    Budget::new(&BudgetInputs {
        memory,
        weights: info.other_bytes.saturating_add(nd.weights),
        kv_bytes_per_token: nd.kv_per_token,
        ctx,
        state_bytes: nd.state,
        activation_bytes: nd.activations,
        margin: None,
    })
}
