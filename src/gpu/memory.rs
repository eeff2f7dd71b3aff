//! How much memory an adapter has, asked of the backend underneath wgpu: WebGPU exposes no
//! memory sizes (`Limits::max_buffer_size` bounds one buffer, not the total), so lathe reads
//! it through wgpu-hal's `as_hal`.
//!
//! - Vulkan: the largest `DEVICE_LOCAL` heap of `vkGetPhysicalDeviceMemoryProperties2`, and
//!   with `VK_EXT_memory_budget` that heap's budget (what this process may allocate now: the
//!   driver's estimate after other processes' use) and this process's usage.
//! - Metal, DX12, GL: nothing is read (no target here to build those paths against); the
//!   planner falls back to its stated guesses (`moe::AdapterMemory`).

/// What the backend reports of an adapter's device-local memory (bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Size of the largest device-local heap.
    pub heap: u64,
    /// `VK_EXT_memory_budget`'s `heapBudget` of that heap (`None` without the extension).
    pub budget: Option<u64>,
    /// `heapUsage` of that heap by this process (`None` without the extension).
    pub usage: Option<u64>,
    /// Where the numbers come from, for reports: `vulkan memory properties` or
    /// `vulkan memory properties + VK_EXT_memory_budget`.
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
    #[cfg(any(
        windows,
        target_os = "linux",
        target_os = "android",
        target_os = "freebsd"
    ))]
    if adapter.get_info().backend == wgpu::Backend::Vulkan {
        return vulkan::device_memory(adapter);
    }
    let _ = adapter;
    None
}

/// The device-local memory of adapter `index` of [`super::list_adapters`].
pub fn adapter_memory(index: usize) -> Option<DeviceMemory> {
    super::device::all_adapters()
        .into_iter()
        .nth(index)
        .and_then(|a| device_memory(&a))
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
