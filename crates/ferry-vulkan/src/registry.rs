//! [`VulkanRegistry`]: where the engine gets GPU memory from.

use std::sync::Arc;

use ash::vk;
use ferry_core::{Error, MemoryBlock, MemoryRegistry, Result};

use crate::block::VulkanBlock;
use crate::buffer::{BufferSpec, DeviceBuffer, MapMode};
use crate::context::VulkanContext;
use crate::memtype::{
    AllocationPath, DEVICE_ONLY_WISH, HOST_VISIBLE_WISH, RDMA_WISH, STAGING_WISH, TypeWish, auto_order, fits_budget,
};

/// Allocates Vulkan memory for ferry regions, by one of three paths.
///
/// Without an override the registry tries the paths best first and falls through when one is not
/// offered or does not fit:
///
/// 1. RDMA-capable memory (`VK_NV_external_memory_rdma`): an RDMA-capable memory type, a check of its
///    heap's budget, a check that the type can be exported, an exportable allocation, and its remote
///    address for the NIC;
/// 2. host-visible device memory;
/// 3. device-local memory behind a staging buffer.
///
/// Paths 3 and 2 trade places where the host-visible memory is not host-cached (a discrete GPU's
/// VRAM behind its BAR): the CPU's reads of such a mapping are uncached, and a peer's READ of the
/// region would crawl (0.06 GB/s on an NVIDIA H200, against 5 GB/s staged). Force path 2 with
/// [`with_path`](Self::with_path) for regions that peers only write.
///
/// A forced path that the device cannot serve is [`Error::Unsupported`], never a silent substitute.
#[derive(Debug, Clone)]
pub struct VulkanRegistry {
    ctx: Arc<VulkanContext>,
    path: Option<AllocationPath>,
    exportable: bool,
    name: String,
}

impl VulkanRegistry {
    /// A registry on `ctx` that picks the path itself and makes memory exportable where it can.
    pub fn new(ctx: Arc<VulkanContext>) -> Self {
        let name = format!("vulkan ({})", ctx.name());
        VulkanRegistry {
            ctx,
            path: None,
            exportable: true,
            name,
        }
    }

    /// Uses only `path`, or chooses automatically with `None`.
    pub fn with_path(mut self, path: Option<AllocationPath>) -> Self {
        self.path = path;
        self
    }

    /// Whether device memory is allocated exportable as an opaque fd (default: yes, where the device
    /// can export buffers of the memory type the path needs; exportable memory is always a dedicated
    /// allocation).
    pub fn exportable(mut self, on: bool) -> Self {
        self.exportable = on;
        self
    }

    /// The context.
    pub fn context(&self) -> &Arc<VulkanContext> {
        &self.ctx
    }

    /// Allocates `len` bytes, keeping the typed block (for [`VulkanBlock::path`], device copies,
    /// export); register it with `Engine::register_block(block.clone(), access)`.
    pub fn allocate_block(&self, len: usize) -> Result<Arc<VulkanBlock>> {
        if len == 0 {
            return Err(Error::InvalidArgument("cannot allocate zero bytes".into()));
        }
        let size = len as u64;
        if size > self.ctx.max_allocation_size() {
            return Err(Error::ResourceExhausted(format!(
                "{len} bytes exceed maxMemoryAllocationSize ({}) of {}",
                self.ctx.max_allocation_size(),
                self.ctx.name()
            )));
        }
        let offered = self.ctx.paths();
        if let Some(path) = self.path {
            if !offered.offers(path) {
                return Err(Error::Unsupported(format!(
                    "the {path} allocation path is not available on {}{}",
                    self.ctx.name(),
                    if path == AllocationPath::RdmaCapable && !self.ctx.nv_rdma() {
                        " (VK_NV_external_memory_rdma and its feature are not offered)"
                    } else {
                        ""
                    }
                )));
            }
            return self.allocate_path(path, len).map(Arc::new);
        }
        let mut last = Error::Unsupported(format!("{} offers no allocation path", self.ctx.name()));
        let cached = self.ctx.buffer_types().mapped_reads_cached(self.ctx.layout());
        for path in auto_order(cached.unwrap_or(true)) {
            if !offered.offers(path) {
                continue;
            }
            match self.allocate_path(path, len) {
                Ok(block) => return Ok(Arc::new(block)),
                Err(e @ (Error::ResourceExhausted(_) | Error::Unsupported(_))) => {
                    tracing::debug!(%path, error = %e, "Vulkan allocation path not taken");
                    last = e;
                }
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    fn allocate_path(&self, path: AllocationPath, len: usize) -> Result<VulkanBlock> {
        let size = len as u64;
        let block = match path {
            AllocationPath::RdmaCapable => self.allocate_rdma(len)?,
            AllocationPath::HostVisible => {
                let device = DeviceBuffer::allocate(
                    &self.ctx,
                    &BufferSpec {
                        size,
                        wish: HOST_VISIBLE_WISH,
                        export: self.export_for(&HOST_VISIBLE_WISH, self.opaque_fd()),
                        map: MapMode::Required,
                        role: "host-visible region",
                    },
                )?;
                VulkanBlock::mapped(path, "vulkan host-visible", device, len)?
            }
            AllocationPath::Staged => {
                let device = DeviceBuffer::allocate(
                    &self.ctx,
                    &BufferSpec {
                        size,
                        wish: DEVICE_ONLY_WISH,
                        export: self.export_for(&DEVICE_ONLY_WISH, self.opaque_fd() | self.dma_buf()),
                        map: MapMode::Never,
                        role: "device-local region",
                    },
                )?;
                let staging = self.staging(size)?;
                VulkanBlock::staged(path, "vulkan device-local (staged)", device, staging, len)?
            }
        };
        tracing::debug!(kind = block_kind(&block), len, "Vulkan region allocated");
        Ok(block)
    }

    /// Path 1, step by step as in the `VK_NV_external_memory_rdma` example.
    fn allocate_rdma(&self, len: usize) -> Result<VulkanBlock> {
        let size = len as u64;
        let rdma = vk::ExternalMemoryHandleTypeFlags::RDMA_ADDRESS_NV;
        // The heap of the first RDMA-capable type, and its budget.
        let heap = self
            .ctx
            .layout()
            .rdma_heap()
            .ok_or_else(|| Error::Unsupported(format!("{} has no RDMA-capable memory type", self.ctx.name())))?;
        let (budget, usage) = self.ctx.heap_budget(heap)?;
        if !fits_budget(size, budget, usage) {
            return Err(Error::ResourceExhausted(format!(
                "{size} bytes of RDMA-capable memory do not fit the budget of heap {heap} ({usage} of {budget} bytes in use)"
            )));
        }
        // The exportable check.
        let props = self.ctx.external_features(rdma);
        if !props
            .external_memory_features
            .contains(vk::ExternalMemoryFeatureFlags::EXPORTABLE)
        {
            return Err(Error::Unsupported(format!(
                "{} cannot export buffers as RDMA addresses",
                self.ctx.name()
            )));
        }
        // Also exportable as an opaque fd where the two handle types may be combined.
        let mut export = rdma;
        let fd = self.opaque_fd();
        if !fd.is_empty() && props.compatible_handle_types.contains(fd) {
            export |= fd;
        }
        let device = DeviceBuffer::allocate(
            &self.ctx,
            &BufferSpec {
                size,
                wish: RDMA_WISH,
                export: self.export_for(&RDMA_WISH, export),
                map: MapMode::IfHostVisible,
                role: "RDMA-capable region",
            },
        )?;
        let address = device.remote_address()?;
        tracing::info!(
            address = format_args!("{address:#x}"),
            len,
            "RDMA-capable Vulkan memory"
        );
        let block = if device.mapped().is_null() {
            let staging = self.staging(size)?;
            VulkanBlock::staged(
                AllocationPath::RdmaCapable,
                "vulkan rdma-capable (staged)",
                device,
                staging,
                len,
            )?
        } else {
            VulkanBlock::mapped(AllocationPath::RdmaCapable, "vulkan rdma-capable (mapped)", device, len)?
        };
        Ok(block.with_rdma_address(address))
    }

    fn staging(&self, size: u64) -> Result<DeviceBuffer> {
        DeviceBuffer::allocate(
            &self.ctx,
            &BufferSpec {
                size,
                wish: STAGING_WISH,
                export: vk::ExternalMemoryHandleTypeFlags::empty(),
                map: MapMode::Required,
                role: "staging buffer",
            },
        )
    }

    /// The handle types to create a buffer for `wish` with: `wanted`, or `wanted` less the opaque fd
    /// where a buffer exportable that way may use no memory type that suits `wish` (the region is then
    /// served, not exportable: [`VulkanBlock::export`] says so). Where no buffer may,
    /// `wanted`, and the allocation's error names the types it was allowed.
    fn export_for(
        &self,
        wish: &TypeWish,
        wanted: vk::ExternalMemoryHandleTypeFlags,
    ) -> vk::ExternalMemoryHandleTypeFlags {
        match self.ctx.buffer_types().export_for(self.ctx.layout(), wish, wanted) {
            Some(handles) if handles != wanted => {
                tracing::debug!(
                    device = %self.ctx.name(),
                    wanted = ?wanted,
                    "exportable buffers may not use the memory this allocation needs: allocated without an opaque fd"
                );
                handles
            }
            Some(handles) => handles,
            None => wanted,
        }
    }

    /// DMA_BUF where export is on, `VK_EXT_external_memory_dma_buf` enabled, and the device can export
    /// such buffers, also with an opaque fd where it exports those: device-local memory behind staging
    /// that a NIC then registers directly (GPUDirect RDMA where `VK_NV_external_memory_rdma` is not
    /// offered).
    fn dma_buf(&self) -> vk::ExternalMemoryHandleTypeFlags {
        let dma_buf = vk::ExternalMemoryHandleTypeFlags::DMA_BUF_EXT;
        let props = self.ctx.external_features(dma_buf);
        let fd = self.opaque_fd();
        let usable = self.exportable
            && self.ctx.dma_buf_enabled()
            && props
                .external_memory_features
                .contains(vk::ExternalMemoryFeatureFlags::EXPORTABLE)
            && (fd.is_empty() || props.compatible_handle_types.contains(fd));
        if usable {
            dma_buf
        } else {
            vk::ExternalMemoryHandleTypeFlags::empty()
        }
    }

    /// OPAQUE_FD where export is on, the extension enabled, and the device can export such buffers.
    fn opaque_fd(&self) -> vk::ExternalMemoryHandleTypeFlags {
        let fd = vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD;
        let exportable = self.exportable
            && self.ctx.ext.memory_fd.is_some()
            && self
                .ctx
                .external_features(fd)
                .external_memory_features
                .contains(vk::ExternalMemoryFeatureFlags::EXPORTABLE);
        if exportable {
            fd
        } else {
            vk::ExternalMemoryHandleTypeFlags::empty()
        }
    }
}

fn block_kind(b: &VulkanBlock) -> &str {
    b.kind()
}

impl MemoryRegistry for VulkanRegistry {
    fn name(&self) -> &str {
        &self.name
    }

    fn allocate(&self, len: usize) -> Result<Arc<dyn MemoryBlock>> {
        Ok(self.allocate_block(len)?)
    }
}
