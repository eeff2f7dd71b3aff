//! Adapter choice and the device: one `Gpu` per process, shared by every kernel wrapper.

use crate::{Error, Result};
use std::sync::{Arc, Mutex, OnceLock};

/// Which adapter to use. `Default` picks the first discrete GPU, then any GPU, then a CPU
/// adapter (lavapipe), so `lathe run` works unchanged on a laptop, a server and in CI.
#[derive(Clone, Debug, Default)]
pub enum AdapterChoice {
    #[default]
    Auto,
    /// Index into [`crate::gpu::list_adapters`].
    Index(usize),
    /// Case-insensitive substring of the adapter name.
    Name(String),
}

impl std::str::FromStr for AdapterChoice {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Ok(match s.parse::<usize>() {
            Ok(i) => AdapterChoice::Index(i),
            Err(_) if s.eq_ignore_ascii_case("auto") => AdapterChoice::Auto,
            Err(_) => AdapterChoice::Name(s.to_string()),
        })
    }
}

/// Which kernels run products of many tokens (`--matmul`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulChoice {
    /// The matrix units where the adapter has them, else the two-level int8 path (`Int8x2`);
    /// models that route on values (MoE routers, DeepSeek-V4's indexer) take f32-level
    /// products (`gpu::AutoProducts::F32`): `CoopXSplit` where the adapter has matrix units,
    /// else the tiled f32 kernel.
    #[default]
    Auto,
    /// Cooperative matrices (f16 16x16x16, f32 accumulation); an error where absent.
    Coop,
    /// Cooperative matrices with weights and activations each split into two f16 parts
    /// (f32-level products at three times the multiply-adds); an error where absent.
    CoopSplit,
    /// `CoopSplit` with its dense products of split weights on the tile of 128 rows x 128
    /// tokens that stages weights and x in workgroup memory (`gpu::coopmat::Precision::XSplit`:
    /// the same f32-level products, 2.4x faster on the H200); an error where absent.
    CoopXSplit,
    /// Cooperative matrices with f16 weights and activations split into two f16 parts (the
    /// weights' rounding alone, at twice the multiply-adds); an error where absent.
    CoopSplitX,
    /// The portable tiled f32 kernel.
    Tiled,
    /// The tiled kernel with activations quantized to int8 per block of 32 (ggml's q8_1) for
    /// weights with integer codes (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K); others run tiled. llama.cpp's
    /// numerics: the fixture bars do not all hold.
    Int8,
    /// As `Int8` with the residual of x quantized again (two int8 levels): f32-level products.
    Int8x2,
}

impl MatmulChoice {
    /// The `--matmul` spelling.
    pub fn name(self) -> &'static str {
        match self {
            MatmulChoice::Auto => "auto",
            MatmulChoice::Coop => "coop",
            MatmulChoice::CoopSplit => "coop-split",
            MatmulChoice::CoopXSplit => "coop-xsplit",
            MatmulChoice::CoopSplitX => "coop-splitx",
            MatmulChoice::Tiled => "tiled",
            MatmulChoice::Int8 => "int8",
            MatmulChoice::Int8x2 => "int8x2",
        }
    }
}

impl std::str::FromStr for MatmulChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(MatmulChoice::Auto),
            "coop" => Ok(MatmulChoice::Coop),
            "coop-split" => Ok(MatmulChoice::CoopSplit),
            "coop-xsplit" => Ok(MatmulChoice::CoopXSplit),
            "coop-splitx" => Ok(MatmulChoice::CoopSplitX),
            "tiled" | "f32" => Ok(MatmulChoice::Tiled),
            "int8" => Ok(MatmulChoice::Int8),
            "int8x2" => Ok(MatmulChoice::Int8x2),
            _ => Err(format!(
                "--matmul {s}: expected auto, coop, coop-split, coop-xsplit, coop-splitx, tiled, \
                 int8 or int8x2"
            )),
        }
    }
}

/// Which activations the decode products take (`--activations`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActivationsChoice {
    /// f32 (as [`ActivationsChoice::F32`]). The two-level int8 path meets every fixture bar
    /// (tests/activations.rs; lavapipe, RMS against the reference: qwen35-dims Q4_K_M 3.5e-4
    /// with int8 against 1.9e-4 with f32, qwen35moe-dims Q4_K_M 4.7e-4, DeepSeek-V4 dims
    /// Q4_K_M 1.6e-4, every top-1 ≥ 0.997, against the 0.02 bar), but on the H200 it decodes
    /// slower: Qwen3.5-9B Q4_K_M 147.3 against 169.1 tok/s (GPU 7.6 against 6.3 ms per
    /// token: a quantize pass per product, and each weight word dotted with two levels of
    /// codes), so auto keeps f32 until an adapter where int8 wins is measured.
    #[default]
    Auto,
    /// f32 activations everywhere (exactness checks).
    F32,
    /// One-token products (decode matvec, the MoE indexed matvec) of the weight types with an
    /// integer-dot kernel (`gpu::matvec::int8_x_supported`) quantize x to blocks of 32 in two
    /// int8 levels (ggml's `block_q8_1` numerics, then its residual the same way: within
    /// max|x|/64516 of x; one level alone missed every quantized fixture bar). The cold
    /// experts of an offloaded MoE take the same two levels (`cpu::q8dot`). Float weights stay
    /// f32, as do products that feed a discrete choice (`MatvecOpts::exact`), prefill's
    /// many-token products (batched decode rows take int8 as a lone decode does, so their bits
    /// match) and products reading x through a fused prologue (`LoadOptions::fused_loads`).
    Int8,
}

impl ActivationsChoice {
    /// Whether one-token products take int8 activations (those reading x through a fused
    /// prologue stay f32 either way, see [`ActivationsChoice::Int8`]).
    pub fn int8(self) -> bool {
        match self {
            ActivationsChoice::F32 | ActivationsChoice::Auto => false,
            ActivationsChoice::Int8 => true,
        }
    }
}

impl std::str::FromStr for ActivationsChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(ActivationsChoice::Auto),
            "f32" => Ok(ActivationsChoice::F32),
            "int8" => Ok(ActivationsChoice::Int8),
            _ => Err(format!("--activations {s}: expected auto, f32 or int8")),
        }
    }
}

/// An instance of `backends`. The primary backends' instance is made on first use and kept,
/// so every adapter list and device of the process comes from it: an instance per call had
/// threads create and destroy Vulkan instances at once, which crashed NVIDIA's driver (580,
/// H200: SIGSEGV with two threads listing adapters, one of them also opening a device). GL
/// gets a fresh instance per call: the adapters of one GL instance share its EGL context, which
/// only one thread can hold (devices on two threads failed with EGL BadAccess).
fn instance(backends: wgpu::Backends) -> wgpu::Instance {
    let make = || {
        // No display handle: lathe is headless compute.
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = backends;
        wgpu::Instance::new(desc)
    };
    static PRIMARY: OnceLock<wgpu::Instance> = OnceLock::new();
    if backends == wgpu::Backends::PRIMARY {
        PRIMARY.get_or_init(make).clone()
    } else {
        make()
    }
}

/// The device-local memory of adapter `index` of [`list_adapters`].
pub fn adapter_memory(index: usize) -> Option<super::DeviceMemory> {
    all_adapters()
        .into_iter()
        .nth(index)
        .and_then(|a| super::memory::device_memory(&a))
}

/// Adapters of the primary backends (Vulkan, Metal, DX12); GL only when none has one:
/// even creating a GL instance probes EGL, which prints noise on a headless server, and GL
/// compute is the weakest backend.
fn all_adapters() -> Vec<wgpu::Adapter> {
    let mut v = pollster::block_on(
        instance(wgpu::Backends::PRIMARY).enumerate_adapters(wgpu::Backends::PRIMARY),
    );
    if v.is_empty() {
        v = pollster::block_on(instance(wgpu::Backends::GL).enumerate_adapters(wgpu::Backends::GL));
        // Said once per process: without it a GL-only machine just looked slow (compiles of
        // minutes before the first line).
        static WARNED: std::sync::Once = std::sync::Once::new();
        if !v.is_empty() {
            WARNED.call_once(|| eprintln!("{NO_VULKAN}"));
        }
    }
    // Stable order: Vulkan/Metal/DX12 before GL, discrete before integrated before CPU.
    let rank = |a: &wgpu::Adapter| {
        let i = a.get_info();
        let dev = match i.device_type {
            wgpu::DeviceType::DiscreteGpu => 0,
            wgpu::DeviceType::IntegratedGpu => 1,
            wgpu::DeviceType::VirtualGpu => 2,
            wgpu::DeviceType::Other => 3,
            wgpu::DeviceType::Cpu => 4,
        };
        let be = match i.backend {
            wgpu::Backend::Vulkan | wgpu::Backend::Metal | wgpu::Backend::Dx12 => 0,
            _ => 1,
        };
        (be, dev)
    };
    v.sort_by_key(rank);
    v
}

/// The warning for a machine whose only adapters are OpenGL ones.
const NO_VULKAN: &str =
    "warning: no Vulkan driver found, only OpenGL: kernels compile for minutes and run slowly \
     there; install the Vulkan loader and a driver (Debian/Ubuntu: apt-get install libvulkan1 \
     mesa-vulkan-drivers; Mesa's lavapipe runs on any CPU)";

/// Every adapter wgpu offers, in the order `AdapterChoice::Index` counts them.
pub fn list_adapters() -> Vec<wgpu::AdapterInfo> {
    all_adapters().iter().map(|a| a.get_info()).collect()
}

/// The device, its queue and what it can do.
pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    pub features: wgpu::Features,
    /// Device-local memory as the backend reports it (`gpu::memory`); `None` where it does
    /// not.
    pub memory: Option<super::memory::DeviceMemory>,
    /// First uncaptured validation / OOM error since the last check; wgpu's default
    /// handler would panic, lathe turns it into an `Error::Gpu` at the next sync point.
    errors: Arc<Mutex<Option<String>>>,
    pub(crate) pipelines: super::pipeline::PipelineCache,
    /// The driver's compiled pipelines kept between runs (Vulkan; `None` elsewhere).
    pub(crate) disk_cache: Option<super::disk_cache::DiskCache>,
    pub(crate) recorder: super::recorder::Recorder,
    matmul: MatmulPath,
    /// One-token products take int8 activations (`--activations`, [`Gpu::with_int8_decode`]).
    int8_decode: bool,
    /// Bit `1 << path` for each path a many-token product took since `take_matmul`.
    last_matmul: std::sync::atomic::AtomicU8,
    scratch: Mutex<std::collections::HashMap<&'static str, wgpu::Buffer>>,
}

/// The product path a device runs (see [`MatmulChoice`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulPath {
    /// No many-token product has run yet.
    None = 0,
    Tiled = 1,
    Coop = 2,
    /// Cooperative matrices with every operand split into two f16 parts.
    CoopSplit = 3,
    /// The tiled kernel with int8 activations (`matmul_q8`) for the types with integer codes.
    Int8 = 4,
    /// As `Int8` with a second int8 level for the residual of x (f32-level products).
    Int8x2 = 5,
    /// Cooperative matrices with f16 weights and activations split into two f16 parts.
    CoopSplitX = 6,
    /// `CoopSplit` with dense products of split weights on the tile that stages them and x
    /// in workgroup memory.
    CoopXSplit = 7,
}

impl MatmulPath {
    pub fn name(self) -> &'static str {
        match self {
            MatmulPath::None => "none",
            MatmulPath::Tiled => "tiled",
            MatmulPath::Coop => "coop",
            MatmulPath::CoopSplit => "coop-split",
            MatmulPath::Int8 => "int8",
            MatmulPath::Int8x2 => "int8x2",
            MatmulPath::CoopSplitX => "coop-splitx",
            MatmulPath::CoopXSplit => "coop-xsplit",
        }
    }

    /// Whether products run on the matrix units.
    pub fn is_coop(self) -> bool {
        matches!(
            self,
            MatmulPath::Coop
                | MatmulPath::CoopSplit
                | MatmulPath::CoopSplitX
                | MatmulPath::CoopXSplit
        )
    }
}

/// What `--matmul auto` may run a model's many-token products with ([`Gpu::with_matmul`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AutoProducts {
    /// Any path: the matrix units with f16 operands where the adapter has them.
    Any,
    /// f32-level products only (models that pick a top-k from computed values: MoE routers,
    /// DeepSeek-V4's indexer): `coop-xsplit` on matrix units (split operands, f32-level), else
    /// the tiled f32 kernel. H200, 2026-12-03, 12288x4096 x 512 tokens (TFLOP/s): coop-xsplit
    /// Q4_K 63.2, Q6_K 56.9, Q8_0 52.2 against tiled 23.2 / - / 21.1 and coop-split 26.2 /
    /// 23.3 / 22.0; pp512 before it: Qwen3.5-35B-A3B Q4_K_M tiled 2927 tok/s, coop-split 2585
    /// (the inexact coop-splitx 3265, which missed the 0.02 bar on a Q8_0 file);
    /// DeepSeek-V4-Flash 8 layers tiled 2412, coop-split 2383.
    F32,
}

/// The path many-token products take for `--matmul matmul` on an adapter whose matrix units
/// are `coop` (`Err`: why there are none), within what `auto` allows for the model; `Err`
/// (the reason) for a matrix path the adapter lacks.
fn product_path(
    matmul: MatmulChoice,
    auto: AutoProducts,
    coop: std::result::Result<(), String>,
) -> std::result::Result<MatmulPath, String> {
    Ok(match (matmul, coop) {
        (MatmulChoice::Tiled, _) => MatmulPath::Tiled,
        (MatmulChoice::Int8, _) => MatmulPath::Int8,
        (MatmulChoice::Int8x2, _) => MatmulPath::Int8x2,
        // models that route on values: f32-level products, not f16 or int8 rounding
        (MatmulChoice::Auto, Ok(())) if auto == AutoProducts::F32 => MatmulPath::CoopXSplit,
        (MatmulChoice::Auto, Err(_)) if auto == AutoProducts::F32 => MatmulPath::Tiled,
        (MatmulChoice::Auto | MatmulChoice::Coop, Ok(())) => MatmulPath::Coop,
        (MatmulChoice::CoopSplit, Ok(())) => MatmulPath::CoopSplit,
        (MatmulChoice::CoopXSplit, Ok(())) => MatmulPath::CoopXSplit,
        (MatmulChoice::CoopSplitX, Ok(())) => MatmulPath::CoopSplitX,
        (MatmulChoice::Auto, Err(_)) => MatmulPath::Int8x2,
        (
            MatmulChoice::Coop
            | MatmulChoice::CoopSplit
            | MatmulChoice::CoopXSplit
            | MatmulChoice::CoopSplitX,
            Err(why),
        ) => return Err(why),
    })
}

/// Workgroup memory the cooperative-matrix kernels declare (matmul_coop.wgsl).
const COOP_WG_MEMORY: u32 = 48 * 1024;

/// Whether the adapter can run lathe's cooperative-matrix kernels: they need f16 16x16x16
/// with f32 accumulation at subgroup scope (wgpu-hal's Vulkan adapter lists what
/// VK_KHR_cooperative_matrix reports), subgroups of exactly 32 lanes (the kernels lay 8
/// subgroups over a 256-thread workgroup), f16 shaders and 48 KiB of workgroup memory.
pub fn coop_supported(
    adapter: &wgpu::Adapter,
    limits: &wgpu::Limits,
) -> std::result::Result<(), String> {
    let f = adapter.features();
    for (feature, name) in [
        (
            wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
            "cooperative matrices",
        ),
        (wgpu::Features::SUBGROUP, "subgroups"),
        (wgpu::Features::SHADER_F16, "f16 shaders"),
    ] {
        if !f.contains(feature) {
            return Err(format!("the adapter offers no {name}"));
        }
    }
    let has_16 = adapter.cooperative_matrix_properties().iter().any(|p| {
        p.m_size == 16
            && p.n_size == 16
            && p.k_size == 16
            && p.ab_type == wgpu::CooperativeScalarType::F16
            && p.cr_type == wgpu::CooperativeScalarType::F32
    });
    if !has_16 {
        return Err("no 16x16x16 f16 -> f32 configuration".into());
    }
    let info = adapter.get_info();
    if info.subgroup_min_size != 32 || info.subgroup_max_size != 32 {
        return Err(format!(
            "subgroups of {}..{} lanes (the kernels need exactly 32)",
            info.subgroup_min_size, info.subgroup_max_size
        ));
    }
    if limits.max_compute_workgroup_storage_size < COOP_WG_MEMORY
        || limits.max_compute_invocations_per_workgroup < 256
    {
        return Err("workgroup limits too small".into());
    }
    Ok(())
}

/// The product paths an adapter offers, for `lathe devices`.
pub fn matmul_paths(index: usize) -> Vec<(MatmulPath, std::result::Result<(), String>)> {
    let Some(a) = all_adapters().into_iter().nth(index) else {
        return Vec::new();
    };
    let limits = a.limits();
    vec![
        (MatmulPath::Tiled, Ok(())),
        (MatmulPath::Coop, coop_supported(&a, &limits)),
        (MatmulPath::CoopSplit, coop_supported(&a, &limits)),
        (MatmulPath::CoopXSplit, coop_supported(&a, &limits)),
        (MatmulPath::CoopSplitX, coop_supported(&a, &limits)),
        (MatmulPath::Int8, Ok(())),
        (MatmulPath::Int8x2, Ok(())),
    ]
}

impl Gpu {
    /// The device of `choice` with the automatic product path.
    pub fn new(choice: &AdapterChoice) -> Result<Gpu> {
        Gpu::with_matmul(choice, MatmulChoice::Auto, AutoProducts::Any)
    }

    /// The device of `choice`, running many-token products on `matmul`. `auto` takes the
    /// matrix units where the adapter has them, else the two-level int8 path (`Int8x2`; types
    /// without integer codes run tiled beside it), within what `auto` allows for the model
    /// (models that route on values, whose top-k choices rounding upstream can flip at a
    /// near-tie, take less): on DeepSeek-V4's dims fixture (300 tokens) int8x2 (error
    /// ≤ max|x|/64516 per block) moves the logits by RMS 2.9e-2, past the 0.02 bar, where the
    /// tiled kernel is at 4e-6; on the H200 `coop-splitx` holds the committed Qwen3.5 fixture
    /// bars (qwen35moe-dims Q4_K_M 1.75e-3 where plain coop is at 3.45e-2) but missed the 0.02
    /// bar on a Q8_0 35B-A3B-shaped file (3.4e-2, top-1 0.98) and not dsv4-tiny Q4_0's (8.3e-3
    /// against 1e-3), so such models take f32-level products ([`AutoProducts::F32`]: split
    /// operands on the matrix units, `coop-xsplit`, else the tiled kernel). Measured
    /// on the H200, 12288x4096 Q4_K x 512 tokens: coop
    /// 0.45 ms, int8 0.95, int8x2 1.68, tiled 2.22, coop-split 2.24; 35B-A3B pp512 coop 5131
    /// tok/s, coop-splitx 3132, tiled 2916; on lavapipe int8x2 runs at 1.4x the tiled kernel.
    pub fn with_matmul(
        choice: &AdapterChoice,
        matmul: MatmulChoice,
        auto: AutoProducts,
    ) -> Result<Gpu> {
        Gpu::with_limits(choice, matmul, auto, None)
    }

    /// [`Gpu::with_matmul`] on a device created with at most `cap`'s buffer and binding
    /// sizes where the adapter offers more: the device then enforces them as a smaller
    /// GPU's own (WebGPU lets a device ask for limits below its adapter's), for tests of
    /// what a small binding limit does to a model's passes.
    pub fn with_limits(
        choice: &AdapterChoice,
        matmul: MatmulChoice,
        auto: AutoProducts,
        cap: Option<super::BufferLimits>,
    ) -> Result<Gpu> {
        let adapters = all_adapters();
        if adapters.is_empty() {
            return Err(Error::Gpu(
                "no GPU adapter found: no Vulkan driver (on a machine without a GPU install \
                 the Vulkan loader and Mesa's lavapipe: apt-get install libvulkan1 \
                 mesa-vulkan-drivers)"
                    .into(),
            ));
        }
        let n_adapters = adapters.len();
        let adapter = match choice {
            AdapterChoice::Auto => adapters.into_iter().next(),
            AdapterChoice::Index(i) => adapters.into_iter().nth(*i),
            AdapterChoice::Name(n) => {
                let n = n.to_lowercase();
                adapters
                    .into_iter()
                    .find(|a| a.get_info().name.to_lowercase().contains(&n))
            }
        }
        .ok_or_else(|| {
            let which = match choice {
                AdapterChoice::Auto => "no GPU adapter".to_string(),
                AdapterChoice::Index(i) => format!("no adapter number {i}"),
                AdapterChoice::Name(n) => format!("no adapter whose name contains \"{n}\""),
            };
            Error::Gpu(format!(
                "{which}: this machine has {n} (`lathe devices` lists them)",
                n = match n_adapters {
                    1 => "one, number 0".to_string(),
                    n => format!("{n}, numbers 0 to {}", n - 1),
                }
            ))
        })?;
        let info = adapter.get_info();
        let memory = super::memory::device_memory(&adapter);
        let offered = adapter.features();
        // Optional features used when present; kernels keep a portable path without them.
        let mut wanted = wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS
            | wgpu::Features::SUBGROUP
            | wgpu::Features::SHADER_F16
            | wgpu::Features::PIPELINE_CACHE;
        // Ask for everything the adapter allows: weights need the largest bindings it has.
        let mut limits = adapter.limits();
        if let Some(c) = cap {
            limits.max_storage_buffer_binding_size =
                limits.max_storage_buffer_binding_size.min(c.max_binding);
            limits.max_buffer_size = limits.max_buffer_size.min(c.max_buffer);
        }
        let coop_ok = coop_supported(&adapter, &limits);
        let matmul = product_path(matmul, auto, coop_ok).map_err(|why| {
            Error::Gpu(format!(
                "{}: --matmul {}: no cooperative-matrix path ({why})",
                info.name,
                matmul.name()
            ))
        })?;
        if matmul.is_coop() {
            wanted |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        }
        let features = offered & wanted;
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("lathe"),
            required_features: features,
            required_limits: limits.clone(),
            // SAFETY: the only experimental feature lathe requests is cooperative matrices,
            // and only for the f16 16x16x16 configuration the adapter lists
            // (`coop_supported`); its kernels are checked against the CPU by `lathe selftest`.
            experimental_features: if matmul.is_coop() {
                unsafe { wgpu::ExperimentalFeatures::enabled() }
            } else {
                wgpu::ExperimentalFeatures::disabled()
            },
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| Error::Gpu(format!("{}: request_device failed: {e}", info.name)))?;
        let errors = Arc::new(Mutex::new(None));
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut g = sink.lock().unwrap_or_else(|p| p.into_inner());
            if g.is_none() {
                *g = Some(e.to_string());
            }
        }));
        let lost = errors.clone();
        device.set_device_lost_callback(move |reason, msg| {
            let mut g = lost.lock().unwrap_or_else(|p| p.into_inner());
            if g.is_none() {
                *g = Some(format!("device lost ({reason:?}): {msg}"));
            }
        });
        let disk_cache = super::disk_cache::DiskCache::open(&device, &info, features);
        Ok(Gpu {
            disk_cache,
            device,
            queue,
            info,
            limits,
            features,
            memory,
            errors,
            pipelines: Default::default(),
            recorder: Default::default(),
            matmul,
            int8_decode: false,
            last_matmul: std::sync::atomic::AtomicU8::new(0),
            scratch: Default::default(),
        })
    }

    /// Writes the pipelines compiled so far to the pipeline cache file (after a warm-up, so
    /// a run cut short still leaves them for the next; dropping the device saves the rest).
    pub fn save_pipeline_cache(&self) -> Result<()> {
        match &self.disk_cache {
            Some(c) => c.save().map_err(|e| Error::io(c.path(), e)),
            None => Ok(()),
        }
    }

    /// A buffer of at least `bytes` kept by the device under `name` and reused by every call
    /// (grown when too small). For kernel-private staging whose contents live within one
    /// recorded sequence of dispatches: wgpu orders the dispatches of a submission that share
    /// it, and passes recorded earlier keep the old buffer alive when it is replaced.
    pub fn scratch(&self, name: &'static str, bytes: u64) -> Result<wgpu::Buffer> {
        let mut map = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = map.get(name) {
            if b.size() >= bytes {
                return Ok(b.clone());
            }
        }
        // grow by half again so a growing prompt does not reallocate per chunk
        let size = (bytes + bytes / 2)
            .next_multiple_of(256)
            .min(self.max_binding());
        let b = self.buffer(size.max(bytes), name)?;
        map.insert(name, b.clone());
        Ok(b)
    }

    /// This device with one-token products (decode matvec and the MoE indexed matvec) of the
    /// types with an integer-dot kernel taking int8 activations when `on`
    /// (`ActivationsChoice::int8`); see `matvec::MatvecOpts::int8_x`.
    pub fn with_int8_decode(mut self, on: bool) -> Gpu {
        self.int8_decode = on;
        self
    }

    /// Whether one-token products take int8 activations ([`Gpu::with_int8_decode`]).
    pub fn int8_decode(&self) -> bool {
        self.int8_decode
    }

    /// The product path prefill uses on this device (`--matmul`).
    pub fn matmul_path(&self) -> MatmulPath {
        self.matmul
    }

    /// The paths many-token products ran on since the last call (`lathe bench --json`
    /// `"matmul"`): `Coop` when any product took the matrix units (products kept in f32 on
    /// purpose, `MatvecOpts::exact`, run tiled beside them), else `Int8` when any took int8
    /// activations (weights without integer codes run tiled beside them), else `Tiled`, else
    /// `None`.
    pub fn take_matmul(&self) -> MatmulPath {
        let used = self
            .last_matmul
            .swap(0, std::sync::atomic::Ordering::Relaxed);
        if used & (1 << MatmulPath::Coop as u8) != 0 {
            MatmulPath::Coop
        } else if used & (1 << MatmulPath::CoopSplit as u8) != 0 {
            MatmulPath::CoopSplit
        } else if used & (1 << MatmulPath::CoopXSplit as u8) != 0 {
            MatmulPath::CoopXSplit
        } else if used & (1 << MatmulPath::CoopSplitX as u8) != 0 {
            MatmulPath::CoopSplitX
        } else if used & (1 << MatmulPath::Int8 as u8) != 0 {
            MatmulPath::Int8
        } else if used & (1 << MatmulPath::Int8x2 as u8) != 0 {
            MatmulPath::Int8x2
        } else if used & (1 << MatmulPath::Tiled as u8) != 0 {
            MatmulPath::Tiled
        } else {
            MatmulPath::None
        }
    }

    pub(crate) fn note_matmul(&self, path: MatmulPath) {
        self.last_matmul
            .fetch_or(1 << path as u8, std::sync::atomic::Ordering::Relaxed);
    }

    /// One line for stderr: adapter, backend, the limits that shape buffer splitting and the
    /// choice of kernel variants.
    pub fn report(&self) -> String {
        format!(
            "adapter: {} ({:?}, {:?}, driver {} {}); max binding {} MiB, max buffer {} MiB, workgroup memory {} KiB; subgroups {}, f16 {}, timestamps {}; matmul {}; decode activations {}",
            self.info.name,
            self.info.backend,
            self.info.device_type,
            self.info.driver,
            self.info.driver_info,
            self.limits.max_storage_buffer_binding_size >> 20,
            self.limits.max_buffer_size >> 20,
            self.limits.max_compute_workgroup_storage_size >> 10,
            self.features.contains(wgpu::Features::SUBGROUP),
            self.features.contains(wgpu::Features::SHADER_F16),
            self.features.contains(wgpu::Features::TIMESTAMP_QUERY),
            self.matmul.name(),
            if self.int8_decode { "int8" } else { "f32" },
        )
    }

    /// Largest byte range one kernel binding may cover (and one buffer may hold).
    pub fn max_binding(&self) -> u64 {
        self.limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
    }

    /// Return (and clear) the first asynchronous GPU error since the last call.
    pub fn check(&self) -> Result<()> {
        let mut g = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        match g.take() {
            Some(e) => Err(Error::Gpu(e)),
            None => Ok(()),
        }
    }

    /// Block until all submitted work is done.
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::Gpu(format!("poll: {e}")))?;
        self.check()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `auto` never rounds the products of a model that routes on values, with or without
    /// matrix units (split operands on them, the f32 kernel without); a named path is taken
    /// as named, or refused where the adapter lacks it.
    #[test]
    fn auto_keeps_value_routing_models_exact() {
        let none = || Err("no matrix units".to_string());
        assert_eq!(
            product_path(MatmulChoice::Auto, AutoProducts::F32, Ok(())),
            Ok(MatmulPath::CoopXSplit)
        );
        assert_eq!(
            product_path(MatmulChoice::Auto, AutoProducts::F32, none()),
            Ok(MatmulPath::Tiled)
        );
        for choice in [MatmulChoice::CoopSplit, MatmulChoice::CoopXSplit] {
            assert_eq!(
                product_path(choice, AutoProducts::Any, none()),
                Err("no matrix units".to_string())
            );
        }
        assert_eq!(
            product_path(MatmulChoice::CoopXSplit, AutoProducts::Any, Ok(())),
            Ok(MatmulPath::CoopXSplit)
        );
        for path in [MatmulPath::CoopXSplit, MatmulPath::CoopSplit] {
            assert_eq!(
                path.name().parse::<MatmulChoice>().map(|c| c.name()),
                Ok(path.name())
            );
        }
        assert_eq!(
            product_path(MatmulChoice::Auto, AutoProducts::Any, Ok(())),
            Ok(MatmulPath::Coop)
        );
        assert_eq!(
            product_path(MatmulChoice::Auto, AutoProducts::Any, none()),
            Ok(MatmulPath::Int8x2)
        );
        assert_eq!(
            product_path(MatmulChoice::CoopSplitX, AutoProducts::F32, Ok(())),
            Ok(MatmulPath::CoopSplitX)
        );
        assert_eq!(
            product_path(MatmulChoice::CoopSplit, AutoProducts::Any, none()),
            Err("no matrix units".to_string())
        );
    }
}
