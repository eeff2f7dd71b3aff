//! How much memory an adapter has, asked of the backend underneath wgpu: WebGPU exposes no
//! memory sizes (`Limits::max_buffer_size` bounds one buffer, not the total), so lathe reads
//! it through wgpu-hal's `as_hal`.
//!
//! - Vulkan: the largest `DEVICE_LOCAL` heap of `vkGetPhysicalDeviceMemoryProperties2`, and
//!   with `VK_EXT_memory_budget` that heap's budget (what this process may allocate now: the
//!   driver's estimate after other processes' use) and this process's usage.
//! - DX12: DXGI's adapter description (`DedicatedVideoMemory`; on a UMA adapter all the
//!   memory it may use) and `IDXGIAdapter3::QueryVideoMemoryInfo` of the local segment group
//!   (the OS's budget for this process, and its usage).
//! - Metal: `MTLDevice.recommendedMaxWorkingSetSize` (Metal reports no heap size, and on
//!   Apple silicon the memory is unified, shared with the CPU) and `currentAllocatedSize`.
//! - GL: nothing is read; the planner falls back to its stated guesses
//!   (`moe::AdapterMemory`).
//!
//! Only the Vulkan path builds on the machines lathe is developed on; the Metal and DX12
//! paths are written against the sources of the crate versions in Cargo.lock (wgpu-hal
//! 30.0.2, objc2 0.6.5, objc2-metal 0.3.2, windows 0.62.2), cited where they are used.

/// What the backend reports of an adapter's device-local memory (bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Size of the device-local memory: Vulkan's largest device-local heap, DXGI's dedicated
    /// video memory (all the adapter's memory on UMA), Metal's recommended working set.
    pub heap: u64,
    /// What this process may use now, as the driver or OS estimates it after other
    /// processes' use: `VK_EXT_memory_budget`'s `heapBudget` of that heap, DXGI's `Budget`
    /// (`None` when not reported; Metal never reports one).
    pub budget: Option<u64>,
    /// This process's current use of that memory: `heapUsage`, DXGI's `CurrentUsage`,
    /// Metal's `currentAllocatedSize` of the device (`None` when not reported).
    pub usage: Option<u64>,
    /// Where the numbers come from, for reports: `vulkan memory properties`,
    /// `vulkan memory properties + VK_EXT_memory_budget`, `dxgi ...`, `metal ...`.
    pub source: &'static str,
}

impl DeviceMemory {
    /// Bytes this process may plan with: the budget when the driver gives one (it already
    /// discounts other processes), else the heap size.
    pub fn usable(&self) -> u64 {
        match self.budget {
            Some(b) if b > 0 => b.min(self.heap),
            _ => self.heap,
        }
    }

    /// One line for reports: `heap 139.8 GiB, budget 139.1 GiB (vulkan ...)`.
    pub fn describe(&self) -> String {
        let h = crate::inspect::human_bytes;
        match self.budget {
            Some(b) => format!("heap {}, budget {} ({})", h(self.heap), h(b), self.source),
            None => format!("heap {} ({})", h(self.heap), self.source),
        }
    }
}

/// The device-local memory of `adapter`, when its backend reports one.
pub fn device_memory(adapter: &wgpu::Adapter) -> Option<DeviceMemory> {
    let info = adapter.get_info();
    match info.backend {
        #[cfg(any(
            windows,
            target_os = "linux",
            target_os = "android",
            target_os = "freebsd"
        ))]
        wgpu::Backend::Vulkan => vulkan::device_memory(adapter),
        #[cfg(windows)]
        wgpu::Backend::Dx12 => dx12::device_memory(adapter, info.device_type),
        #[cfg(target_vendor = "apple")]
        wgpu::Backend::Metal => metal::device_memory(adapter),
        _ => None,
    }
}

#[cfg(any(
    windows,
    target_os = "linux",
    target_os = "android",
    target_os = "freebsd"
))]
mod vulkan {
    use super::DeviceMemory;
    use ash::vk;

    pub fn device_memory(adapter: &wgpu::Adapter) -> Option<DeviceMemory> {
        // SAFETY: only queries are made through the handles, no object is created or
        // destroyed; the guard keeps the adapter alive while they are used.
        let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }?;
        let shared = hal.shared_instance();
        let instance = shared.raw_instance();
        let phd = hal.raw_physical_device();
        // `vkGetPhysicalDeviceMemoryProperties2` is core from Vulkan 1.1; the budget
        // structure chains onto it only when the device offers the extension.
        let v11 = shared.instance_api_version() >= vk::API_VERSION_1_1
            && hal.physical_device_capabilities().properties().api_version >= vk::API_VERSION_1_1;
        let has_budget = v11
            && hal
                .physical_device_capabilities()
                .supports_extension(ash::ext::memory_budget::NAME);
        let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
        let props = if has_budget {
            let mut p2 = vk::PhysicalDeviceMemoryProperties2::default().push_next(&mut budget);
            // SAFETY: `phd` is the adapter's physical device of this instance (1.1+).
            unsafe { instance.get_physical_device_memory_properties2(phd, &mut p2) };
            p2.memory_properties
        } else {
            // SAFETY: as above; core 1.0.
            unsafe { instance.get_physical_device_memory_properties(phd) }
        };
        let n = (props.memory_heap_count as usize).min(vk::MAX_MEMORY_HEAPS);
        let (i, heap) = props.memory_heaps[..n]
            .iter()
            .enumerate()
            .filter(|(_, h)| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
            .max_by_key(|(_, h)| h.size)?;
        Some(DeviceMemory {
            heap: heap.size,
            budget: has_budget.then_some(budget.heap_budget[i]),
            usage: has_budget.then_some(budget.heap_usage[i]),
            source: if has_budget {
                "vulkan memory properties + VK_EXT_memory_budget"
            } else {
                "vulkan memory properties"
            },
        })
    }
}

#[cfg(windows)]
mod dx12 {
    use super::DeviceMemory;
    use windows::Win32::Graphics::Dxgi::{
        DXGI_MEMORY_SEGMENT_GROUP_LOCAL, DXGI_QUERY_VIDEO_MEMORY_INFO,
    };

    /// `device_type` is wgpu's (`IntegratedGpu` where D3D12 reports a UMA architecture,
    /// `Cpu` for a software adapter such as WARP: wgpu-hal 30 `src/dx12/adapter.rs`).
    pub fn device_memory(
        adapter: &wgpu::Adapter,
        device_type: wgpu::DeviceType,
    ) -> Option<DeviceMemory> {
        // SAFETY: only queries are made through the adapter, nothing is created or
        // released; the guard keeps the adapter alive while they are used.
        let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Dx12>() }?;
        // The adapter wgpu-hal enumerated, as the DXGI 1.4 interface it keeps (D3D12 needs
        // DXGI 1.4): wgpu-hal 30 `src/dx12/mod.rs`, `Adapter::as_raw`.
        let raw = hal.as_raw();
        // SAFETY: a plain query on a live adapter.
        let desc = unsafe { raw.GetDesc1() }.ok()?;
        // On a UMA adapter D3D12's only memory pool (L0) is what DXGI calls the local
        // segment group (Microsoft's `D3D12_MEMORY_POOL` remarks): system memory, of which
        // `DedicatedVideoMemory` is only the small carve-out, so the heap there is all the
        // memory the description says the adapter may use. Taking the carve-out alone would
        // clamp the budget (`usable`) to it. A software adapter has no video memory at all.
        // On a discrete adapter the local segment group is its video memory.
        let uma = matches!(
            device_type,
            wgpu::DeviceType::IntegratedGpu | wgpu::DeviceType::Cpu
        );
        let heap = if uma {
            (desc.DedicatedVideoMemory as u64)
                .saturating_add(desc.DedicatedSystemMemory as u64)
                .saturating_add(desc.SharedSystemMemory as u64)
        } else {
            desc.DedicatedVideoMemory as u64
        };
        // The OS's budget for this process in the local segment group, the one Microsoft's
        // DXGI docs say applications should size their working set by. Node 0: wgpu drives
        // one node of a linked adapter.
        let mut info = DXGI_QUERY_VIDEO_MEMORY_INFO::default();
        // SAFETY: node 0 exists on every adapter; `info` is a valid out-pointer.
        let queried =
            unsafe { raw.QueryVideoMemoryInfo(0, DXGI_MEMORY_SEGMENT_GROUP_LOCAL, &mut info) }
                .is_ok();
        Some(DeviceMemory {
            heap,
            budget: queried.then_some(info.Budget),
            usage: queried.then_some(info.CurrentUsage),
            source: match (uma, queried) {
                (false, true) => "dxgi DedicatedVideoMemory + QueryVideoMemoryInfo",
                (false, false) => "dxgi DedicatedVideoMemory",
                (true, true) => "dxgi UMA dedicated + shared memory + QueryVideoMemoryInfo",
                (true, false) => "dxgi UMA dedicated + shared memory",
            },
        })
    }
}

#[cfg(target_vendor = "apple")]
mod metal {
    use super::DeviceMemory;
    use objc2::runtime::{AnyObject, ProtocolObject, Sel};
    use objc2::sel;
    use objc2_metal::MTLDevice;

    /// Whether `device`'s class implements `sel`. A property newer than the OS
    /// (`recommendedMaxWorkingSetSize` is iOS 16+), or a proxy device that forwards it
    /// (Xcode's capture device), would otherwise end in an Objective-C exception or an
    /// objc2 panic; wgpu-hal 30 checks the same way (`src/metal/adapter.rs`,
    /// `device_class_responds_to`).
    fn implements(device: &ProtocolObject<dyn MTLDevice>, sel: Sel) -> bool {
        AnyObject::class(device.as_ref()).responds_to(sel)
    }

    pub fn device_memory(adapter: &wgpu::Adapter) -> Option<DeviceMemory> {
        // SAFETY: only properties of the device are read, nothing is created or released;
        // the guard keeps the adapter, and with it the device, alive meanwhile.
        let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Metal>() }?;
        // wgpu-hal 30 `src/metal/adapter.rs`, `Adapter::raw_device`.
        let device = hal.raw_device();
        if !implements(device, sel!(recommendedMaxWorkingSetSize)) {
            return None;
        }
        // Apple's MTLDevice documentation: "an approximation of how much memory, in bytes,
        // this GPU device can allocate without affecting its runtime performance". It is
        // the only size Metal gives, so it is the heap; it is a fixed recommendation, not a
        // budget that follows other processes' use, so `budget` stays `None` and `usable`
        // is this size.
        let working_set = device.recommendedMaxWorkingSetSize();
        let usage = implements(device, sel!(currentAllocatedSize))
            .then(|| device.currentAllocatedSize() as u64);
        let unified = implements(device, sel!(hasUnifiedMemory)) && device.hasUnifiedMemory();
        Some(DeviceMemory {
            heap: working_set,
            budget: None,
            usage,
            source: if unified {
                "metal recommendedMaxWorkingSetSize (unified memory)"
            } else {
                "metal recommendedMaxWorkingSetSize"
            },
        })
    }
}
