//! Adapter choice and the device: one `Gpu` per process, shared by every kernel wrapper.

use crate::{Error, Result};
use std::sync::{Arc, Mutex};

/// Which adapter to use. `Default` picks the first discrete GPU, then any GPU, then a CPU
/// adapter (lavapipe), so `lathe run` works unchanged on a laptop, a server and in CI.
#[derive(Clone, Debug, Default)]
pub enum AdapterChoice {
    #[default]
    Auto,
    /// Index into [`list_adapters`].
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

fn instance(backends: wgpu::Backends) -> wgpu::Instance {
    // No display handle: lathe is headless compute.
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = backends;
    wgpu::Instance::new(desc)
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
    /// First uncaptured validation / OOM error since the last check; wgpu's default
    /// handler would panic, lathe turns it into an `Error::Gpu` at the next sync point.
    errors: Arc<Mutex<Option<String>>>,
    pub(crate) pipelines: super::pipeline::PipelineCache,
}

impl Gpu {
    pub fn new(choice: &AdapterChoice) -> Result<Gpu> {
        let adapters = all_adapters();
        if adapters.is_empty() {
            return Err(Error::Gpu(
                "no GPU adapter found (on a machine without a GPU install Mesa's lavapipe: \
                 apt-get install mesa-vulkan-drivers)"
                    .into(),
            ));
        }
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
            Error::Gpu(format!(
                "adapter {choice:?} not found (see `lathe devices`)"
            ))
        })?;
        let info = adapter.get_info();
        let offered = adapter.features();
        // Optional features used when present; kernels keep a portable path without them.
        let wanted = wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS
            | wgpu::Features::SUBGROUP
            | wgpu::Features::SHADER_F16;
        let features = offered & wanted;
        // Ask for everything the adapter allows: weights need the largest bindings it has.
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("lathe"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
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
        Ok(Gpu {
            device,
            queue,
            info,
            limits,
            features,
            errors,
            pipelines: Default::default(),
        })
    }

    /// One line for stderr: adapter, backend, the limits that shape buffer splitting and the
    /// choice of kernel variants.
    pub fn report(&self) -> String {
        format!(
            "adapter: {} ({:?}, {:?}, driver {} {}); max binding {} MiB, max buffer {} MiB, workgroup memory {} KiB; subgroups {}, f16 {}, timestamps {}",
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
