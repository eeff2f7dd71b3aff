//! How much GPU memory the expert arena gets: the adapter's memory minus what the model
//! needs beside its routed experts.
//!
//! wgpu does not report memory sizes or free memory. `Limits::max_buffer_size` and
//! `max_storage_buffer_binding_size` bound ONE buffer (lavapipe offers 2 GiB buffers on any
//! machine; the H200 4 GiB of its 141 GB), so they say nothing about the total. lathe
//! therefore takes the size from, in order ([`AdapterMemory::detect`]):
//! 1. `--gpu-mem SIZE` (also lets a big GPU behave like a small one, for testing);
//! 2. a CPU adapter (lavapipe, llvmpipe, SwiftShader) or an integrated GPU: half of the
//!    system RAM (`MemTotal` of /proc/meminfo): "VRAM" is host memory there, and the other
//!    half stays for the OS page cache that backs the mmap'd cold experts;
//! 3. a size in the adapter name (`NVIDIA A100-SXM4-80GB`, `... 48GB` → that many GiB), or a
//!    short table of data-centre GPUs whose names carry none ([`KNOWN_ADAPTERS`]);
//! 4. otherwise [`ASSUMED_MEMORY`] (4 GiB), conservative on purpose: a smaller arena only
//!    costs speed, an arena that does not fit fails. Callers should say so and suggest
//!    `--gpu-mem`.
//!
//! The budget itself is plain arithmetic ([`Budget::new`]) on byte counts the caller
//! supplies, so it knows no architecture: non-expert weights (from [`super::MoeInfo`]), KV
//! bytes per position times the context, fixed per-sequence state (recurrent and conv state,
//! sliding windows), activation scratch, and a safety margin ([`default_margin`]).

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
    /// See the module doc for the order of sources.
    pub fn detect(info: &wgpu::AdapterInfo, gpu_mem: Option<u64>) -> AdapterMemory {
        Self::detect_with(info, gpu_mem, system_ram())
    }

    /// [`detect`](Self::detect) with the system RAM given (tests).
    pub fn detect_with(
        info: &wgpu::AdapterInfo,
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
        if shared {
            if let Some(r) = ram {
                return mk(r / 2, MemSource::SystemRam);
            }
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
        let why = match self.source {
            MemSource::Flag => "--gpu-mem",
            MemSource::SystemRam => "half the system RAM: a CPU/integrated adapter shares it",
            MemSource::Name => "from the adapter's name",
            MemSource::Assumed => "unknown adapter, assumed: pass --gpu-mem",
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
    /// KV cache bytes per position, all layers and sequences.
    pub kv_per_token: u64,
    /// Per-sequence state independent of the context, times the sequences.
    pub state: u64,
    /// Activation scratch of one pass of `batch` rows, logits included.
    pub activations: u64,
    /// Bytes of one KV cache element the estimate used (the cache type resolved: `Auto` is
    /// 2 for Qwen3.5, 4 for DeepSeek-V4); 0 when the architecture is unknown.
    pub kv_elem: u64,
    /// Why the estimate is partial, if it is.
    pub note: Option<String>,
}

/// The run a budget is for (the loaders take it from `LoadOptions`, `lathe plan` from its
/// flags).
#[derive(Clone, Copy, Debug)]
pub struct RunShape {
    pub kv: crate::engine::KvType,
    /// Context length the caches are sized for.
    pub ctx: u64,
    /// Rows of one pass (the loaders' `DEFAULT_BATCH`).
    pub batch: u64,
    /// Sequences live at once.
    pub seqs: u64,
}

/// The budget of `f` (whose experts `info` describes) on `memory` bytes: the one the loaders
/// place experts with (`gpu::moe::Plan::new`) and `lathe plan` prints, so the two agree.
pub fn model_budget(
    f: &crate::models::ModelFile,
    info: &super::MoeInfo,
    memory: u64,
    run: RunShape,
) -> (Budget, Needs) {
    let nd = needs(f, run.kv, run.batch.max(1), run.seqs);
    let b = Budget::new(&BudgetInputs {
        memory,
        weights: info.other_bytes,
        kv_bytes_per_token: nd.kv_per_token,
        ctx: run.ctx,
        state_bytes: nd.state,
        activation_bytes: nd.activations,
        margin: None,
    });
    (b, nd)
}

/// [`Needs`] of `f` for `seqs` live sequences, passes of `batch` rows and KV cache type `kv`
/// (`Auto`: f16 for Qwen3.5, f32 for DeepSeek-V4, as `engine::KvType` says). Qwen3.5 family
/// and DeepSeek-V4; other architectures count nothing (see `note`).
pub fn needs(
    f: &crate::models::ModelFile,
    kv: crate::engine::KvType,
    batch: u64,
    seqs: u64,
) -> Needs {
    use crate::engine::KvType;
    let seqs = seqs.max(1);
    if let Ok(hp) = crate::models::qwen35::Hparams::from_file(f) {
        let kv_elem: u64 = if kv == KvType::F32 { 4 } else { 2 };
        let n_attn = hp.recurrent.iter().filter(|r| !**r).count() as u64;
        let n_gdn = hp.recurrent.len() as u64 - n_attn;
        let kv_per_token = n_attn * 2 * (hp.n_head_kv * hp.head_dim) as u64 * kv_elem;
        // f32 recurrent state [Hv, dk, dv] and the conv's last K-1 inputs per GDN layer.
        let state = n_gdn
            * 4
            * ((hp.n_v_heads * hp.d_k * hp.d_v) as u64
                + (hp.conv_kernel.saturating_sub(1) * hp.conv_dim()) as u64);
        let (k, ff, ne) = match &hp.moe {
            Some(m) => (m.n_used, m.n_ff_exp.max(m.n_ff_shexp), m.n_expert),
            None => (1, hp.n_ff, 0),
        };
        let att = hp.n_head * hp.head_dim;
        // The forward's scratch rows (models/qwen35/gpu.rs `Scratch`), f32, plus logits.
        let per_row = 3 * hp.n_embd
            + 2 * hp.conv_dim()
            + 2 * hp.v_dim()
            + hp.v_dim().max(ff * k).max(att)
            + 2 * hp.n_v_heads
            + 4 * att
            + 2 * hp.n_head_kv * hp.head_dim
            + 2 * ff * k
            + k * hp.n_embd
            + ne
            + 2 * k
            + hp.n_vocab;
        return Needs {
            kv_per_token: kv_per_token * seqs,
            state: state * seqs,
            activations: batch * per_row as u64 * 4,
            kv_elem,
            note: None,
        };
    }
    if let Ok(hp) = crate::models::deepseek4::Hparams::from_file(f) {
        let kv_elem: u64 = if kv == KvType::F16 { 2 } else { 4 };
        let hd = hp.head_dim as u64;
        let mut kv_per_token = 0u64;
        let mut state = 0u64;
        for &r in &hp.compress_ratio {
            // Every layer keeps a ring of K=V rows (the window plus a pass's rows);
            // compressed layers add one entry per `r` positions (and the indexer's keys on
            // ratio-4 layers).
            state += (hp.window as u64 + batch) * hd * kv_elem;
            if r > 0 {
                let r = r as u64;
                kv_per_token += hd * kv_elem / r;
                if r == 4 {
                    kv_per_token += hp.ix_head_dim as u64 * kv_elem / r;
                }
            }
        }
        let per_row = 4 * hp.hc * hp.n_embd
            + 2 * hp.n_head * hp.head_dim
            + 2 * hp.n_used * hp.n_ff_exp.max(hp.n_ff_shexp)
            + hp.n_used * hp.n_embd
            + hp.n_expert
            + hp.n_vocab;
        return Needs {
            kv_per_token: kv_per_token * seqs,
            state: state * seqs,
            activations: batch * per_row as u64 * 4,
            kv_elem,
            note: None,
        };
    }
    Needs {
        note: Some("unknown architecture: KV, state and activations not counted".into()),
        ..Default::default()
    }
}
