//! Memory from elsewhere as Vulkan buffers: host regions the engine registered
//! (`VK_EXT_external_memory_host`), and opaque fds another device or process exported.
//!
//! Importing a registered host region lets the GPU copy straight from and to the bytes a peer reads or
//! writes, with no staging copy: a decode worker can receive a KV cache into host memory over TCP and
//! have the GPU pull it in, or push results there for a peer to read.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use ash::vk;
use ferry_core::{Error, MemoryBlock, Result};

use crate::block::ExportedMemory;
use crate::buffer::DeviceBuffer;
use crate::context::VulkanContext;
use crate::staging::{GpuBuffer, private::Sealed};

/// Host memory imported as a Vulkan buffer (`VK_EXT_external_memory_host`).
///
/// Address and length must be multiples of [`VulkanContext::host_import_alignment`] (4096 on
/// lavapipe); `Engine::alloc_host` memory is page-aligned, so a length in whole pages imports.
pub struct ImportedHostBuffer {
    buffer: Arc<DeviceBuffer>,
    /// Keeps the memory alive for [`from_block`](Self::from_block) imports.
    _owner: Option<Arc<dyn MemoryBlock>>,
}

impl std::fmt::Debug for ImportedHostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedHostBuffer")
            .field("size", &self.buffer.size())
            .finish_non_exhaustive()
    }
}

impl ImportedHostBuffer {
    /// Imports the whole of `block` (for example a `ferry::HostAllocation` that is also registered with
    /// an engine through `register_block`); the import keeps the block alive.
    pub fn from_block(ctx: &Arc<VulkanContext>, block: Arc<dyn MemoryBlock>) -> Result<Self> {
        // SAFETY: `MemoryBlock` promises `len` valid bytes at `as_ptr` for as long as the block lives, and
        // the import holds an `Arc` of it.
        let buffer = unsafe { DeviceBuffer::import_host(ctx, block.as_ptr(), block.len() as u64)? };
        Ok(ImportedHostBuffer {
            buffer: Arc::new(buffer),
            _owner: Some(block),
        })
    }

    /// Imports `len` bytes at `ptr`, such as `Region::as_ptr()` of a region from `Engine::alloc_host`.
    ///
    /// # Safety
    ///
    /// The memory must stay valid for reads and writes of `len` bytes until the returned buffer and
    /// every copy using it are gone (keep the region registered, or at least allocated, until then).
    pub unsafe fn from_raw(ctx: &Arc<VulkanContext>, ptr: *mut u8, len: usize) -> Result<Self> {
        if ptr.is_null() {
            return Err(Error::InvalidArgument("cannot import a null pointer".into()));
        }
        // SAFETY: forwarded to our caller.
        let buffer = unsafe { DeviceBuffer::import_host(ctx, ptr, len as u64)? };
        Ok(ImportedHostBuffer {
            buffer: Arc::new(buffer),
            _owner: None,
        })
    }
}

impl Sealed for ImportedHostBuffer {
    fn device_buffer(&self) -> &Arc<DeviceBuffer> {
        &self.buffer
    }
}

impl GpuBuffer for ImportedHostBuffer {
    fn vk_buffer(&self) -> vk::Buffer {
        self.buffer.handle()
    }
    fn size(&self) -> u64 {
        self.buffer.size()
    }
}

/// Device memory imported from an opaque fd (the other end of [`VulkanBlock::export`](crate::VulkanBlock::export)).
pub struct ImportedBuffer {
    buffer: Arc<DeviceBuffer>,
}

impl std::fmt::Debug for ImportedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedBuffer")
            .field("size", &self.buffer.size())
            .finish_non_exhaustive()
    }
}

impl ImportedBuffer {
    /// Imports `exported` on `ctx`, which must be the same device (same UUID) as the exporter's.
    /// Vulkan owns the fd once this succeeds; on failure it is closed.
    pub fn import(ctx: &Arc<VulkanContext>, exported: ExportedMemory) -> Result<Self> {
        if exported.device_uuid != ctx.device_uuid() {
            return Err(Error::InvalidArgument(format!(
                "memory exported by device {} cannot be imported on {} ({})",
                crate::select::format_uuid(&exported.device_uuid),
                ctx.name(),
                crate::select::format_uuid(&ctx.device_uuid())
            )));
        }
        Self::import_fd(
            ctx,
            exported.fd,
            exported.size,
            exported.allocation_size,
            exported.memory_type_index,
        )
    }

    /// Imports an opaque fd of `allocation_size` bytes of memory type `memory_type_index` as a buffer of
    /// `size` bytes.
    pub fn import_fd(
        ctx: &Arc<VulkanContext>,
        fd: OwnedFd,
        size: u64,
        allocation_size: u64,
        memory_type_index: u32,
    ) -> Result<Self> {
        let buffer = DeviceBuffer::import_opaque_fd(ctx, fd, size, allocation_size, memory_type_index)?;
        Ok(ImportedBuffer {
            buffer: Arc::new(buffer),
        })
    }
}

impl Sealed for ImportedBuffer {
    fn device_buffer(&self) -> &Arc<DeviceBuffer> {
        &self.buffer
    }
}

impl GpuBuffer for ImportedBuffer {
    fn vk_buffer(&self) -> vk::Buffer {
        self.buffer.handle()
    }
    fn size(&self) -> u64 {
        self.buffer.size()
    }
}
