//! The Vulkan device ferry allocates from: [`VulkanContext`].

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ash::vk;
use ferry_core::{Error, Result};

use crate::commands::CopyCommands;
use crate::error::vk_error;
use crate::ext::ExtFns;
use crate::loader::Loaded;
use crate::memtype::{BufferTypes, MemoryLayout, PathSupport, fits_budget};
use crate::probe::{DeviceFacts, Extensions, VulkanDeviceInfo, enumerate};
use crate::select::{DeviceSelector, choose};

/// Buffer usage of every buffer this crate creates: copies both ways, and shader access for the
/// application's own kernels on device buffers.
pub(crate) const BUFFER_USAGE: vk::BufferUsageFlags = vk::BufferUsageFlags::from_raw(
    vk::BufferUsageFlags::TRANSFER_SRC.as_raw()
        | vk::BufferUsageFlags::TRANSFER_DST.as_raw()
        | vk::BufferUsageFlags::STORAGE_BUFFER.as_raw(),
);

/// Counts of live Vulkan objects made through one context, for leak checks and logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocationStats {
    /// `VkBuffer`s alive.
    pub buffers: usize,
    /// `VkDeviceMemory` objects alive (allocated or imported).
    pub memories: usize,
    /// Bytes of device memory allocated (not imported) and alive.
    pub bytes: u64,
}

/// One Vulkan device opened for ferry: the instance, the logical device, a transfer queue, the
/// extension entry points, and the bookkeeping of what was allocated from which heap.
///
/// Creating an instance and a device costs tens of milliseconds, so a process opens a context once
/// and shares it (`Arc<VulkanContext>`) between its registries, blocks and imports; each of those holds
/// the `Arc`, so the device outlives every object made from it. The device is created with the
/// extensions the allocation paths need, where the device offers them: `VK_KHR_external_memory_fd`
/// (export), `VK_EXT_external_memory_host` (import), `VK_NV_external_memory_rdma` with its feature
/// (path 1), `VK_EXT_memory_budget` (the heap budget check before an RDMA-capable allocation) and
/// `VK_EXT_external_memory_dma_buf` (device-local memory a NIC registers by its dma-buf).
pub struct VulkanContext {
    facts: DeviceFacts,
    enabled: Extensions,
    rdma_enabled: bool,
    paths: PathSupport,
    /// The memory types this context's buffers may use, by handle types.
    buffer_types: BufferTypes,
    device: ash::Device,
    pub(crate) ext: ExtFns,
    queue: Mutex<vk::Queue>,
    queue_family: u32,
    pub(crate) commands: CopyCommands,
    /// Bytes this context allocated, per heap.
    heap_usage: Mutex<Vec<u64>>,
    live_buffers: AtomicUsize,
    live_memories: AtomicUsize,
    live_bytes: AtomicU64,
    /// Dropped last: destroys the instance after `Drop` destroyed the device.
    loaded: Loaded,
}

impl std::fmt::Debug for VulkanContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VulkanContext")
            .field("device", &self.facts.name)
            .field("paths", &self.paths)
            .field("queue_family", &self.queue_family)
            .finish_non_exhaustive()
    }
}

impl VulkanContext {
    /// Opens the device `selector` picks.
    ///
    /// Without a Vulkan loader or driver, or when the device cannot be used, this is
    /// [`Error::Unsupported`] with the reason; a selector that matches no device is
    /// [`Error::InvalidArgument`] listing the devices there are.
    pub fn new(selector: &DeviceSelector) -> Result<Arc<Self>> {
        let loaded = Loaded::new()?;
        let all = enumerate(&loaded)?;
        let candidates: Vec<_> = all.iter().map(DeviceFacts::candidate).collect();
        let facts = all[choose(&candidates, selector)?].clone();
        Self::open(loaded, facts)
    }

    /// Opens the device named by `FERRY_VULKAN_DEVICE` (see [`DeviceSelector::from_env`]), or the default.
    pub fn from_env() -> Result<Arc<Self>> {
        Self::new(&DeviceSelector::from_env()?)
    }

    fn open(loaded: Loaded, facts: DeviceFacts) -> Result<Arc<Self>> {
        let instance = &loaded.instance;
        let enabled = facts.extensions;
        let rdma_enabled = enabled.memory_rdma && facts.rdma_feature;
        let queue_family = pick_queue_family(instance, facts.handle)?;
        let priorities = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(queue_family)
            .queue_priorities(&priorities)];
        let names: Vec<*const std::ffi::c_char> = enabled.names().iter().map(|n| n.as_ptr()).collect();
        let mut rdma_features = vk::PhysicalDeviceExternalMemoryRDMAFeaturesNV::default().external_memory_rdma(true);
        let mut info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .enabled_extension_names(&names);
        if rdma_enabled {
            info = info.push_next(&mut rdma_features);
        }
        // SAFETY: `facts.handle` belongs to this instance; the extensions are ones the device lists, the
        // RDMA features structure is chained only with its extension and when the feature is supported;
        // every pointer in `info` refers to locals that outlive the call.
        let device = unsafe { instance.create_device(facts.handle, &info, None) }
            .map_err(|e| vk_error(&format!("vkCreateDevice on {}", facts.name), e))?;
        let ext = ExtFns::load(instance, &device, &enabled);
        // SAFETY: one queue of `queue_family` was requested at device creation.
        let queue = unsafe { device.get_device_queue(queue_family, 0) };
        let rdma_usable = rdma_enabled && ext.remote_address.is_some();
        let buffer_types = buffer_types(&loaded, &facts, &device, &enabled, rdma_usable);
        let paths = facts.layout.paths(rdma_usable, &buffer_types);
        tracing::info!(
            device = %facts.name,
            driver = %facts.driver,
            queue_family,
            ?paths,
            ?buffer_types,
            extensions = ?enabled.names(),
            "Vulkan device opened"
        );
        let heaps = facts.layout.heaps.len();
        Ok(Arc::new(VulkanContext {
            facts,
            enabled,
            rdma_enabled,
            paths,
            buffer_types,
            device,
            ext,
            queue: Mutex::new(queue),
            queue_family,
            commands: CopyCommands::new(),
            heap_usage: Mutex::new(vec![0; heaps]),
            live_buffers: AtomicUsize::new(0),
            live_memories: AtomicUsize::new(0),
            live_bytes: AtomicU64::new(0),
            loaded,
        }))
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.facts.name
    }

    /// What `ferry info` reports about this device.
    pub fn info(&self) -> VulkanDeviceInfo {
        let mut info = self.facts.info();
        info.paths = self.paths;
        info
    }

    /// The allocation paths this context can serve.
    pub fn paths(&self) -> PathSupport {
        self.paths
    }

    /// The device's PCI address, where the driver reports one (`VK_EXT_pci_bus_info`).
    pub fn pci_address(&self) -> Option<ferry_core::PciAddress> {
        self.facts.pci_address
    }

    /// Whether device-local memory of this device is the device's own, on the far side of PCIe (a
    /// discrete or virtual GPU), rather than host RAM (an integrated GPU, a CPU driver).
    pub(crate) fn has_own_memory(&self) -> bool {
        matches!(
            self.facts.device_type,
            ash::vk::PhysicalDeviceType::DISCRETE_GPU | ash::vk::PhysicalDeviceType::VIRTUAL_GPU
        )
    }

    /// Whether `VK_NV_external_memory_rdma` is enabled with its feature.
    pub fn nv_rdma(&self) -> bool {
        self.rdma_enabled && self.ext.remote_address.is_some()
    }

    /// The largest single allocation (`maxMemoryAllocationSize`).
    pub fn max_allocation_size(&self) -> u64 {
        self.facts.max_allocation_size
    }

    /// The alignment of host memory that [`ImportedHostBuffer`](crate::ImportedHostBuffer) accepts,
    /// where host import is available.
    pub fn host_import_alignment(&self) -> Option<u64> {
        self.ext.host_pointer_properties.and(self.facts.min_import_alignment)
    }

    /// The heap budget and usage in bytes, as [`allocate`](crate::VulkanRegistry::allocate_block) checks
    /// them: from `VK_EXT_memory_budget` where enabled, else the heap size and what this context
    /// allocated from it.
    pub fn heap_budget(&self, heap: u32) -> Result<(u64, u64)> {
        let size = self
            .facts
            .layout
            .heaps
            .get(heap as usize)
            .map(|h| h.size)
            .ok_or_else(|| Error::InvalidArgument(format!("{} has no memory heap {heap}", self.facts.name)))?;
        if self.enabled.memory_budget {
            let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
            let mut props = vk::PhysicalDeviceMemoryProperties2::default().push_next(&mut budget);
            // SAFETY: the budget structure is chained only because VK_EXT_memory_budget is enabled; the
            // physical device belongs to the live instance.
            unsafe {
                self.loaded
                    .instance
                    .get_physical_device_memory_properties2(self.facts.handle, &mut props)
            };
            let i = heap as usize;
            Ok((budget.heap_budget[i], budget.heap_usage[i]))
        } else {
            Ok((size, self.usage()[heap as usize]))
        }
    }

    /// Live objects made through this context.
    pub fn stats(&self) -> AllocationStats {
        AllocationStats {
            buffers: self.live_buffers.load(Ordering::Acquire),
            memories: self.live_memories.load(Ordering::Acquire),
            bytes: self.live_bytes.load(Ordering::Acquire),
        }
    }

    /// The logical device, for applications that record their own work on these buffers.
    pub fn device(&self) -> &ash::Device {
        &self.device
    }

    /// The instance.
    pub fn instance(&self) -> &ash::Instance {
        &self.loaded.instance
    }

    /// The physical device.
    pub fn physical_device(&self) -> vk::PhysicalDevice {
        self.facts.handle
    }

    /// The queue family of the queue this crate copies on.
    pub fn queue_family_index(&self) -> u32 {
        self.queue_family
    }

    /// The device UUID.
    pub fn device_uuid(&self) -> [u8; 16] {
        self.facts.uuid
    }

    // ---- crate-internal -----------------------------------------------------------------------------

    pub(crate) fn layout(&self) -> &MemoryLayout {
        &self.facts.layout
    }

    pub(crate) fn buffer_types(&self) -> &BufferTypes {
        &self.buffer_types
    }

    pub(crate) fn facts(&self) -> &DeviceFacts {
        &self.facts
    }

    pub(crate) fn non_coherent_atom(&self) -> u64 {
        self.facts.non_coherent_atom
    }

    /// The queue, locked: `vkQueueSubmit` needs external synchronisation of the queue.
    pub(crate) fn queue(&self) -> Result<MutexGuard<'_, vk::Queue>> {
        self.queue.lock().map_err(|_| Error::Io {
            kind: std::io::ErrorKind::Other,
            message: "the Vulkan queue lock was poisoned by a panic".into(),
        })
    }

    fn usage(&self) -> MutexGuard<'_, Vec<u64>> {
        // A panic while holding this lock cannot leave the counters half-updated (each update is one
        // addition), so a poisoned lock is still correct to use.
        self.heap_usage.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks `size` bytes against the allocation limit and `heap`'s budget and, if they fit, counts
    /// them as used until [`release`](Self::release).
    pub(crate) fn reserve(&self, heap: u32, size: u64, role: &str) -> Result<()> {
        if size > self.facts.max_allocation_size {
            return Err(Error::ResourceExhausted(format!(
                "{role} of {size} bytes exceeds maxMemoryAllocationSize ({}) of {}",
                self.facts.max_allocation_size, self.facts.name
            )));
        }
        let (budget, used) = if self.enabled.memory_budget {
            self.heap_budget(heap)?
        } else {
            (0, 0)
        };
        let mut usage = self.usage();
        let reserved = usage
            .get_mut(heap as usize)
            .ok_or_else(|| Error::InvalidArgument(format!("{} has no memory heap {heap}", self.facts.name)))?;
        let (budget, used) = if self.enabled.memory_budget {
            (budget, used)
        } else {
            (self.facts.layout.heaps[heap as usize].size, *reserved)
        };
        if !fits_budget(size, budget, used) {
            return Err(Error::ResourceExhausted(format!(
                "{role} of {size} bytes does not fit the budget of heap {heap} of {} ({used} of {budget} bytes in use)",
                self.facts.name
            )));
        }
        *reserved += size;
        self.live_bytes.fetch_add(size, Ordering::AcqRel);
        Ok(())
    }

    /// Undoes a [`reserve`](Self::reserve).
    pub(crate) fn release(&self, heap: u32, size: u64) {
        if let Some(reserved) = self.usage().get_mut(heap as usize) {
            *reserved = reserved.saturating_sub(size);
        }
        self.live_bytes.fetch_sub(size, Ordering::AcqRel);
    }

    pub(crate) fn count_buffer(&self, delta: isize) {
        bump(&self.live_buffers, delta);
    }

    pub(crate) fn count_memory(&self, delta: isize) {
        bump(&self.live_memories, delta);
    }

    /// Whether memory of this device may be exported as a dma-buf (`VK_EXT_external_memory_dma_buf`
    /// enabled, with `vkGetMemoryFdKHR` resolved).
    pub(crate) fn dma_buf_enabled(&self) -> bool {
        self.enabled.memory_dma_buf && self.ext.memory_fd.is_some()
    }

    /// External-memory features of buffers of [`BUFFER_USAGE`] for `handle_type`.
    pub(crate) fn external_features(
        &self,
        handle_type: vk::ExternalMemoryHandleTypeFlags,
    ) -> vk::ExternalMemoryProperties {
        external_features(&self.loaded, &self.facts, handle_type)
    }
}

/// External-memory features of buffers of [`BUFFER_USAGE`] for `handle_type` on `facts`' device.
fn external_features(
    loaded: &Loaded,
    facts: &DeviceFacts,
    handle_type: vk::ExternalMemoryHandleTypeFlags,
) -> vk::ExternalMemoryProperties {
    let info = vk::PhysicalDeviceExternalBufferInfo::default()
        .usage(BUFFER_USAGE)
        .handle_type(handle_type);
    let mut out = vk::ExternalBufferProperties::default();
    // SAFETY: a Vulkan 1.1 query (the device supports 1.1) on a physical device of the live instance;
    // only handle types of enabled extensions are asked for.
    unsafe {
        loaded
            .instance
            .get_physical_device_external_buffer_properties(facts.handle, &info, &mut out)
    };
    out.external_memory_properties
}

/// The memory types buffers of [`BUFFER_USAGE`] may use on `device`, plain and with each external
/// handle type the crate exports (see [`BufferTypes`]), from a 4 KiB probe buffer per set. A handle
/// type the device cannot export buffers as, or whose probe fails, allows no type.
fn buffer_types(
    loaded: &Loaded,
    facts: &DeviceFacts,
    device: &ash::Device,
    enabled: &Extensions,
    rdma: bool,
) -> BufferTypes {
    let exportable = |handle_type| {
        external_features(loaded, facts, handle_type)
            .external_memory_features
            .contains(vk::ExternalMemoryFeatureFlags::EXPORTABLE)
    };
    let probe = |handle_types: vk::ExternalMemoryHandleTypeFlags| -> u32 {
        let mut external = vk::ExternalMemoryBufferCreateInfo::default().handle_types(handle_types);
        let mut info = vk::BufferCreateInfo::default()
            .size(4096)
            .usage(BUFFER_USAGE)
            .sharing_mode(vk::SharingMode::EXCLUSIVE);
        if !handle_types.is_empty() {
            info = info.push_next(&mut external);
        }
        // SAFETY: a valid create info whose chain lives until the call returns, with handle types the
        // device said it can export buffers of this usage as; the buffer is destroyed below, unbound.
        let buffer = match unsafe { device.create_buffer(&info, None) } {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(?handle_types, error = %e, "probe buffer refused: these buffers get no memory type");
                return 0;
            }
        };
        // SAFETY: `buffer` is a live buffer of `device`, destroyed right after and never used again.
        unsafe {
            let bits = device.get_buffer_memory_requirements(buffer).memory_type_bits;
            device.destroy_buffer(buffer, None);
            bits
        }
    };
    let fd = vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD;
    let address = vk::ExternalMemoryHandleTypeFlags::RDMA_ADDRESS_NV;
    let dma_buf = vk::ExternalMemoryHandleTypeFlags::DMA_BUF_EXT;
    BufferTypes {
        plain: probe(vk::ExternalMemoryHandleTypeFlags::empty()),
        opaque_fd: if enabled.memory_fd && exportable(fd) {
            probe(fd)
        } else {
            0
        },
        rdma: if rdma && exportable(address) { probe(address) } else { 0 },
        dma_buf: if enabled.memory_dma_buf && exportable(dma_buf) {
            probe(dma_buf)
        } else {
            0
        },
    }
}

fn bump(counter: &AtomicUsize, delta: isize) {
    if delta >= 0 {
        counter.fetch_add(delta.unsigned_abs(), Ordering::AcqRel);
    } else {
        counter.fetch_sub(delta.unsigned_abs(), Ordering::AcqRel);
    }
}

/// A dedicated transfer family (the DMA engines of a discrete GPU) where there is one, else the first
/// family that can copy (graphics and compute families can).
fn pick_queue_family(instance: &ash::Instance, physical: vk::PhysicalDevice) -> Result<u32> {
    // SAFETY: `physical` belongs to the live instance.
    let families = unsafe { instance.get_physical_device_queue_family_properties(physical) };
    let copy = vk::QueueFlags::TRANSFER | vk::QueueFlags::GRAPHICS | vk::QueueFlags::COMPUTE;
    let dedicated = families.iter().position(|f| {
        f.queue_count > 0
            && f.queue_flags.contains(vk::QueueFlags::TRANSFER)
            && !f
                .queue_flags
                .intersects(vk::QueueFlags::GRAPHICS | vk::QueueFlags::COMPUTE)
    });
    let any = || {
        families
            .iter()
            .position(|f| f.queue_count > 0 && f.queue_flags.intersects(copy))
    };
    dedicated
        .or_else(any)
        .map(|i| i as u32)
        .ok_or_else(|| Error::Unsupported("the device has no queue that can copy buffers".into()))
}

impl Drop for VulkanContext {
    fn drop(&mut self) {
        // SAFETY: every block, import and copy holds an `Arc` of this context, so none is alive now; the
        // wait makes sure the queue is idle before the command pools and the device go.
        unsafe {
            let _ = self.device.device_wait_idle();
            self.commands.destroy(&self.device);
            self.device.destroy_device(None);
        }
        tracing::debug!(device = %self.facts.name, "Vulkan device closed");
    }
}
