//! A `VkBuffer` bound to its own `VkDeviceMemory`: created, allocated, bound, mapped, and all of it
//! undone on drop, whichever step failed.
//!
//! Every allocation is dedicated (one memory object per buffer): exportable and RDMA memory must be
//! (gpu-allocator-style sub-allocation cannot add export structures), and regions are large enough that
//! drivers prefer it anyway. The object is built step by step inside the struct whose `Drop` frees what
//! exists, so an allocation that fails half-way (over budget after the buffer was created, say) leaks
//! nothing.

use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::Arc;

use ash::vk;
use ferry_core::{Error, Result};

use crate::context::{BUFFER_USAGE, VulkanContext};
use crate::error::{missing_extension, vk_error};
use crate::memtype::TypeWish;

/// Whether the memory is mapped for the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MapMode {
    /// Never.
    Never,
    /// Where the chosen memory type is host-visible.
    IfHostVisible,
    /// Always: a type that is not host-visible is an error.
    Required,
}

/// What to allocate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BufferSpec {
    /// Buffer size in bytes.
    pub size: u64,
    /// Which memory type.
    pub wish: TypeWish,
    /// Handle types the memory can be exported as (empty: not exportable).
    pub export: vk::ExternalMemoryHandleTypeFlags,
    /// Whether to map it.
    pub map: MapMode,
    /// What it is for, in errors and logs.
    pub role: &'static str,
}

/// A buffer and its dedicated memory.
pub struct DeviceBuffer {
    ctx: Arc<VulkanContext>,
    buffer: vk::Buffer,
    memory: vk::DeviceMemory,
    size: u64,
    alloc_size: u64,
    type_index: u32,
    flags: vk::MemoryPropertyFlags,
    mapped: *mut u8,
    export: vk::ExternalMemoryHandleTypeFlags,
    /// The heap and bytes reserved against the budget, released on drop.
    charged: Option<(u32, u64)>,
}

// SAFETY: the handles are plain identifiers that Vulkan lets any thread use (the operations this crate
// performs on them are externally synchronised where Vulkan asks for it: queue submission under the
// queue lock, command recording in per-command pools); `mapped` is a process-wide mapping only accessed
// through raw pointers.
unsafe impl Send for DeviceBuffer {}
// SAFETY: as above; `&DeviceBuffer` only reads the fields.
unsafe impl Sync for DeviceBuffer {}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("size", &self.size)
            .field("type_index", &self.type_index)
            .field("mapped", &!self.mapped.is_null())
            .finish_non_exhaustive()
    }
}

impl DeviceBuffer {
    /// A buffer handle with no memory yet, counted as live.
    fn create(
        ctx: &Arc<VulkanContext>,
        size: u64,
        handle_types: vk::ExternalMemoryHandleTypeFlags,
        role: &str,
    ) -> Result<Self> {
        if size == 0 {
            return Err(Error::InvalidArgument(format!("a {role} of zero bytes")));
        }
        if let Some(max) = ctx.facts().max_buffer_size
            && size > max
        {
            return Err(Error::ResourceExhausted(format!(
                "a {role} of {size} bytes exceeds maxBufferSize ({max}) of {}",
                ctx.name()
            )));
        }
        let mut external = vk::ExternalMemoryBufferCreateInfo::default().handle_types(handle_types);
        let mut info = vk::BufferCreateInfo::default()
            .size(size)
            .usage(BUFFER_USAGE)
            .sharing_mode(vk::SharingMode::EXCLUSIVE);
        if !handle_types.is_empty() {
            info = info.push_next(&mut external);
        }
        // SAFETY: a valid create info whose chain lives until the call returns; the external handle
        // types are those of extensions enabled on this device (checked by the callers).
        let buffer = unsafe { ctx.device().create_buffer(&info, None) }
            .map_err(|e| vk_error(&format!("creating a {role} of {size} bytes"), e))?;
        ctx.count_buffer(1);
        Ok(DeviceBuffer {
            ctx: ctx.clone(),
            buffer,
            memory: vk::DeviceMemory::null(),
            size,
            alloc_size: 0,
            type_index: 0,
            flags: vk::MemoryPropertyFlags::empty(),
            mapped: std::ptr::null_mut(),
            export: vk::ExternalMemoryHandleTypeFlags::empty(),
            charged: None,
        })
    }

    /// The buffer's memory requirements and whether the driver wants a dedicated allocation.
    fn requirements(&self) -> vk::MemoryRequirements {
        let info = vk::BufferMemoryRequirementsInfo2::default().buffer(self.buffer);
        let mut out = vk::MemoryRequirements2::default();
        // SAFETY: a live buffer of this device; Vulkan 1.1 core.
        unsafe { self.ctx.device().get_buffer_memory_requirements2(&info, &mut out) };
        out.memory_requirements
    }

    /// Allocates, binds and maybe maps a new buffer as `spec` says.
    pub(crate) fn allocate(ctx: &Arc<VulkanContext>, spec: &BufferSpec) -> Result<Self> {
        if spec.size > ctx.max_allocation_size() {
            return Err(Error::ResourceExhausted(format!(
                "a {} of {} bytes exceeds maxMemoryAllocationSize ({}) of {}",
                spec.role,
                spec.size,
                ctx.max_allocation_size(),
                ctx.name()
            )));
        }
        let mut b = Self::create(ctx, spec.size, spec.export, spec.role)?;
        let req = b.requirements();
        let type_index = ctx.layout().pick(req.memory_type_bits, &spec.wish).ok_or_else(|| {
            Error::Unsupported(format!(
                "{} has no memory type for a {} (wanted {:?}, allowed types {:#b})",
                ctx.name(),
                spec.role,
                spec.wish.required,
                req.memory_type_bits
            ))
        })?;
        let flags = ctx.layout().flags_of(type_index);
        if spec.map == MapMode::Required && !flags.contains(vk::MemoryPropertyFlags::HOST_VISIBLE) {
            return Err(Error::Unsupported(format!(
                "the memory type for a {} is not host-visible",
                spec.role
            )));
        }
        let heap = ctx.layout().heap_of(type_index).unwrap_or(0);
        ctx.reserve(heap, req.size, spec.role)?;
        b.charged = Some((heap, req.size));
        let mut export = vk::ExportMemoryAllocateInfo::default().handle_types(spec.export);
        let mut dedicated = vk::MemoryDedicatedAllocateInfo::default().buffer(b.buffer);
        let mut info = vk::MemoryAllocateInfo::default()
            .allocation_size(req.size)
            .memory_type_index(type_index)
            .push_next(&mut dedicated);
        if !spec.export.is_empty() {
            info = info.push_next(&mut export);
        }
        // SAFETY: the chain (dedicated allocation for this buffer, export info for handle types of
        // enabled extensions that the callers checked as exportable) lives until the call returns.
        b.memory = unsafe { ctx.device().allocate_memory(&info, None) }
            .map_err(|e| vk_error(&format!("allocating {} bytes for a {}", req.size, spec.role), e))?;
        ctx.count_memory(1);
        b.alloc_size = req.size;
        b.type_index = type_index;
        b.flags = flags;
        b.export = spec.export;
        b.bind_and_map(
            spec.map != MapMode::Never && flags.contains(vk::MemoryPropertyFlags::HOST_VISIBLE),
            spec.role,
        )?;
        tracing::debug!(
            role = spec.role,
            size = spec.size,
            type_index,
            heap,
            mapped = !b.mapped.is_null(),
            "Vulkan buffer allocated"
        );
        Ok(b)
    }

    fn bind_and_map(&mut self, map: bool, role: &str) -> Result<()> {
        // SAFETY: the buffer and the memory are live, unbound, and the memory was allocated for this
        // buffer's requirements (dedicated), so offset 0 satisfies the alignment.
        unsafe { self.ctx.device().bind_buffer_memory(self.buffer, self.memory, 0) }
            .map_err(|e| vk_error(&format!("binding a {role}"), e))?;
        if map {
            // SAFETY: host-visible memory, not mapped before, mapped whole; unmapped in `Drop`.
            let p = unsafe {
                self.ctx
                    .device()
                    .map_memory(self.memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty())
            }
            .map_err(|e| vk_error(&format!("mapping a {role}"), e))?;
            if p.is_null() {
                return Err(Error::Io {
                    kind: std::io::ErrorKind::Other,
                    message: format!("vkMapMemory returned a null pointer for a {role}"),
                });
            }
            self.mapped = p.cast();
        }
        Ok(())
    }

    /// Imports host memory (`VK_EXT_external_memory_host`) as a buffer.
    ///
    /// # Safety
    ///
    /// `ptr` must stay valid for reads and writes of `len` bytes until the returned buffer is dropped.
    pub(crate) unsafe fn import_host(ctx: &Arc<VulkanContext>, ptr: *mut u8, len: u64) -> Result<Self> {
        let ht = vk::ExternalMemoryHandleTypeFlags::HOST_ALLOCATION_EXT;
        let properties_fn = ctx
            .ext
            .host_pointer_properties
            .ok_or_else(|| missing_extension(ctx.name(), "VK_EXT_external_memory_host", "importing host memory"))?;
        let align = ctx.host_import_alignment().unwrap_or(4096);
        if !(ptr as u64).is_multiple_of(align) || !len.is_multiple_of(align) {
            return Err(Error::InvalidArgument(format!(
                "host memory imported into Vulkan must start and end on a multiple of {align} bytes \
                 (minImportedHostPointerAlignment); got address {ptr:p} and length {len}"
            )));
        }
        if !ctx
            .external_features(ht)
            .external_memory_features
            .contains(vk::ExternalMemoryFeatureFlags::IMPORTABLE)
        {
            return Err(Error::Unsupported(format!(
                "{} cannot import host allocations into buffers",
                ctx.name()
            )));
        }
        let mut props = vk::MemoryHostPointerPropertiesEXT::default();
        // SAFETY: the function was resolved on this device with its extension enabled; `ptr` is a host
        // pointer of the right alignment and `props` lives until the call returns.
        let r = unsafe { properties_fn(ctx.device().handle(), ht, ptr.cast_const().cast(), &mut props) };
        if r != vk::Result::SUCCESS {
            return Err(vk_error("vkGetMemoryHostPointerPropertiesEXT", r));
        }
        let mut b = Self::create(ctx, len, ht, "host import")?;
        let req = b.requirements();
        let type_index = ctx
            .layout()
            .pick(
                req.memory_type_bits & props.memory_type_bits,
                &crate::memtype::IMPORT_WISH,
            )
            .ok_or_else(|| {
                Error::Unsupported(format!(
                    "{} has no memory type that can import this host memory",
                    ctx.name()
                ))
            })?;
        let mut import = vk::ImportMemoryHostPointerInfoEXT::default()
            .handle_type(ht)
            .host_pointer(ptr.cast());
        let info = vk::MemoryAllocateInfo::default()
            .allocation_size(len)
            .memory_type_index(type_index)
            .push_next(&mut import);
        // SAFETY: the import structure names `len` bytes at `ptr`, aligned as the device requires, which
        // the caller keeps valid for the life of the returned buffer; the chain lives until the call.
        b.memory =
            unsafe { ctx.device().allocate_memory(&info, None) }.map_err(|e| vk_error("importing host memory", e))?;
        ctx.count_memory(1);
        b.alloc_size = len;
        b.type_index = type_index;
        b.flags = ctx.layout().flags_of(type_index);
        b.bind_and_map(false, "host import")?;
        Ok(b)
    }

    /// Imports an opaque fd exported by [`export_opaque_fd`](Self::export_opaque_fd) (here or in another
    /// process), taking ownership of it on success.
    pub(crate) fn import_opaque_fd(
        ctx: &Arc<VulkanContext>,
        fd: OwnedFd,
        size: u64,
        alloc_size: u64,
        type_index: u32,
    ) -> Result<Self> {
        let ht = vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD;
        if ctx.ext.memory_fd.is_none() {
            return Err(missing_extension(
                ctx.name(),
                "VK_KHR_external_memory_fd",
                "importing an fd",
            ));
        }
        if type_index as usize >= ctx.layout().types.len() {
            return Err(Error::InvalidArgument(format!(
                "memory type {type_index} does not exist on {}",
                ctx.name()
            )));
        }
        let mut b = Self::create(ctx, size, ht, "fd import")?;
        let req = b.requirements();
        if req.memory_type_bits & (1 << type_index) == 0 || req.size > alloc_size {
            return Err(Error::InvalidArgument(format!(
                "an imported allocation of {alloc_size} bytes of type {type_index} cannot back a buffer of {size} bytes"
            )));
        }
        let mut import = vk::ImportMemoryFdInfoKHR::default().handle_type(ht).fd(fd.as_raw_fd());
        let mut dedicated = vk::MemoryDedicatedAllocateInfo::default().buffer(b.buffer);
        let info = vk::MemoryAllocateInfo::default()
            .allocation_size(alloc_size)
            .memory_type_index(type_index)
            .push_next(&mut dedicated)
            .push_next(&mut import);
        // SAFETY: the fd is open and ours; the exporter allocated it dedicated with this size and type
        // (the caller passes what `export_opaque_fd` reported); the chain lives until the call.
        b.memory =
            unsafe { ctx.device().allocate_memory(&info, None) }.map_err(|e| vk_error("importing an opaque fd", e))?;
        // Vulkan owns the fd from here on.
        let _ = fd.into_raw_fd();
        ctx.count_memory(1);
        b.alloc_size = alloc_size;
        b.type_index = type_index;
        b.flags = ctx.layout().flags_of(type_index);
        b.bind_and_map(false, "fd import")?;
        Ok(b)
    }

    /// An opaque fd of this buffer's memory, for another Vulkan device or CUDA
    /// (`cudaImportExternalMemory` with `cudaExternalMemoryHandleTypeOpaqueFd`).
    pub(crate) fn export_opaque_fd(&self) -> Result<OwnedFd> {
        if self.ctx.ext.memory_fd.is_none() {
            return Err(missing_extension(
                self.ctx.name(),
                "VK_KHR_external_memory_fd",
                "exporting an fd",
            ));
        }
        self.export_fd(
            vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD,
            "an opaque fd (the registry was made with `exportable(false)`, or this device lets exportable \
             buffers use no memory type its allocation path needs)",
        )
    }

    /// A dma-buf of this buffer's memory (`VK_EXT_external_memory_dma_buf`), for a NIC to register.
    pub(crate) fn export_dma_buf(&self) -> Result<OwnedFd> {
        if !self.ctx.dma_buf_enabled() {
            return Err(missing_extension(
                self.ctx.name(),
                "VK_EXT_external_memory_dma_buf",
                "exporting a dma-buf",
            ));
        }
        self.export_fd(vk::ExternalMemoryHandleTypeFlags::DMA_BUF_EXT, "a dma-buf")
    }

    /// `vkGetMemoryFdKHR` of this buffer's memory as handle type `ht`, which it was allocated
    /// exportable as (else `Unsupported`, saying it was not exportable as `what`).
    fn export_fd(&self, ht: vk::ExternalMemoryHandleTypeFlags, what: &str) -> Result<OwnedFd> {
        let fns = self
            .ctx
            .ext
            .memory_fd
            .as_ref()
            .ok_or_else(|| missing_extension(self.ctx.name(), "VK_KHR_external_memory_fd", "exporting an fd"))?;
        if !self.export.contains(ht) {
            return Err(Error::Unsupported(format!(
                "this memory was not allocated exportable as {what}"
            )));
        }
        let info = vk::MemoryGetFdInfoKHR::default().memory(self.memory).handle_type(ht);
        // SAFETY: the extension is enabled and its functions resolved (`memory_fd` is `Some`); the memory
        // was allocated with `ht` among its export handle types.
        let raw = unsafe { fns.get_memory_fd(&info) }.map_err(|e| vk_error("vkGetMemoryFdKHR", e))?;
        if raw < 0 {
            return Err(Error::Io {
                kind: std::io::ErrorKind::Other,
                message: format!("vkGetMemoryFdKHR returned fd {raw}"),
            });
        }
        // SAFETY: vkGetMemoryFdKHR returns a new descriptor that the caller owns.
        Ok(unsafe { OwnedFd::from_raw_fd(raw) })
    }

    /// Whether this buffer's memory may be exported as a dma-buf.
    pub(crate) fn exports_dma_buf(&self) -> bool {
        self.export.contains(vk::ExternalMemoryHandleTypeFlags::DMA_BUF_EXT)
    }

    /// The remote address of RDMA-capable memory (`vkGetMemoryRemoteAddressNV`).
    pub(crate) fn remote_address(&self) -> Result<u64> {
        let ht = vk::ExternalMemoryHandleTypeFlags::RDMA_ADDRESS_NV;
        let f = self
            .ctx
            .ext
            .remote_address
            .ok_or_else(|| missing_extension(self.ctx.name(), "VK_NV_external_memory_rdma", "an RDMA address"))?;
        if !self.export.contains(ht) {
            return Err(Error::Unsupported("this memory was not allocated for RDMA".into()));
        }
        let info = vk::MemoryGetRemoteAddressInfoNV::default()
            .memory(self.memory)
            .handle_type(ht);
        let mut address: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the function was resolved on this device with VK_NV_external_memory_rdma enabled; the
        // memory was allocated with RDMA_ADDRESS_NV export. `VkRemoteAddressNV` is `void*` and the call
        // writes one through `pAddress` (ash spells the parameter's type as `*mut c_void`, so the pointer
        // to our `void*` is cast to it).
        let r = unsafe { f(self.ctx.device().handle(), &info, (&raw mut address).cast()) };
        if r != vk::Result::SUCCESS {
            return Err(vk_error("vkGetMemoryRemoteAddressNV", r));
        }
        Ok(address as u64)
    }

    /// Makes host writes to `[offset, offset + len)` visible to the device (non-coherent memory only).
    pub(crate) fn flush(&self, offset: u64, len: u64) -> Result<()> {
        if self.is_coherent() || self.mapped.is_null() {
            return Ok(());
        }
        let range = self.atom_range(offset, len);
        // SAFETY: the memory is mapped whole and the range lies inside the allocation.
        unsafe { self.ctx.device().flush_mapped_memory_ranges(&[range]) }
            .map_err(|e| vk_error("vkFlushMappedMemoryRanges", e))
    }

    /// Makes device writes to `[offset, offset + len)` visible to the host (non-coherent memory only).
    pub(crate) fn invalidate(&self, offset: u64, len: u64) -> Result<()> {
        if self.is_coherent() || self.mapped.is_null() {
            return Ok(());
        }
        let range = self.atom_range(offset, len);
        // SAFETY: as in `flush`.
        unsafe { self.ctx.device().invalidate_mapped_memory_ranges(&[range]) }
            .map_err(|e| vk_error("vkInvalidateMappedMemoryRanges", e))
    }

    /// `[offset, offset + len)` as a mapped range Vulkan accepts for flush and invalidate.
    fn atom_range(&self, offset: u64, len: u64) -> vk::MappedMemoryRange<'static> {
        let (start, size) = widen_to_atoms(offset, len, self.ctx.non_coherent_atom(), self.alloc_size);
        vk::MappedMemoryRange::default()
            .memory(self.memory)
            .offset(start)
            .size(size)
    }

    pub(crate) fn is_coherent(&self) -> bool {
        self.flags.contains(vk::MemoryPropertyFlags::HOST_COHERENT)
    }

    pub(crate) fn context(&self) -> &Arc<VulkanContext> {
        &self.ctx
    }

    pub(crate) fn handle(&self) -> vk::Buffer {
        self.buffer
    }

    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    pub(crate) fn alloc_size(&self) -> u64 {
        self.alloc_size
    }

    pub(crate) fn type_index(&self) -> u32 {
        self.type_index
    }

    pub(crate) fn flags(&self) -> vk::MemoryPropertyFlags {
        self.flags
    }

    /// The host mapping, null when not mapped.
    pub(crate) fn mapped(&self) -> *mut u8 {
        self.mapped
    }
}

/// `[offset, offset + len)` widened to whole `atom`s (`nonCoherentAtomSize`): the start rounded down,
/// the end rounded up, or `VK_WHOLE_SIZE` where the rounded end reaches the end of an allocation of
/// `alloc_size` bytes (whose size need not be a multiple of the atom).
fn widen_to_atoms(offset: u64, len: u64, atom: u64, alloc_size: u64) -> (u64, u64) {
    let atom = atom.max(1);
    let start = offset / atom * atom;
    let end = offset.saturating_add(len).div_ceil(atom).saturating_mul(atom);
    if end >= alloc_size {
        (start, vk::WHOLE_SIZE)
    } else {
        (start, end - start)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let device = self.ctx.device();
        // SAFETY: no copy uses this buffer any more: copies hold an `Arc` of the buffers they use until
        // their fence has signalled (or park them forever). Freeing memory unmaps it; destroying or
        // freeing a null handle is a no-op, which covers a buffer whose construction stopped half-way.
        unsafe {
            device.destroy_buffer(self.buffer, None);
            device.free_memory(self.memory, None);
        }
        self.ctx.count_buffer(-1);
        if self.memory != vk::DeviceMemory::null() {
            self.ctx.count_memory(-1);
        }
        if let Some((heap, bytes)) = self.charged {
            self.ctx.release(heap, bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flush_ranges_cover_whole_atoms_inside_the_allocation() {
        assert_eq!(widen_to_atoms(0, 1, 64, 4096), (0, 64));
        assert_eq!(widen_to_atoms(65, 10, 64, 4096), (64, 64));
        assert_eq!(widen_to_atoms(63, 2, 64, 4096), (0, 128));
        assert_eq!(widen_to_atoms(128, 128, 64, 4096), (128, 128));
        // Reaching the end of the allocation: the rest of it, whatever its size.
        assert_eq!(widen_to_atoms(4000, 96, 64, 4096), (3968, vk::WHOLE_SIZE));
        assert_eq!(widen_to_atoms(4000, 50, 256, 4050), (3840, vk::WHOLE_SIZE));
        assert_eq!(widen_to_atoms(5, 5, 0, 100), (5, 5), "an atom of 0 counts as 1");
    }
}
