//! [`VulkanBlock`]: GPU memory as a ferry [`MemoryBlock`].
//!
//! The engine's transports move bytes with raw pointers into host-addressable memory, then call
//! [`commit_written`](MemoryBlock::commit_written) before acknowledging a write and
//! [`prepare_read`](MemoryBlock::prepare_read) before sending a read. A block answers both according
//! to how its bytes reach the host:
//!
//! - **mapped** (path 2, and path 1 where the RDMA-capable type is host-visible): the pointer is the
//!   `vkMapMemory` mapping of the device memory itself, so a peer's bytes land in GPU memory with no
//!   extra copy; the hooks only flush or invalidate where the memory is not host-coherent;
//! - **staged** (path 3, and path 1 otherwise): the pointer is a host-visible staging buffer as long as
//!   the region; `commit_written` copies the written range to the device buffer and `prepare_read` copies
//!   the range to be read back from it, on the transfer queue (pipelined, see `staging`), and both return
//!   only when the device copy is complete.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use ash::vk;
use ferry_core::{DmaView, Durability, Error, MemoryBlock, Result};

use crate::buffer::DeviceBuffer;
use crate::context::VulkanContext;
use crate::memtype::AllocationPath;
use crate::staging::{GpuBuffer, private::Sealed};

/// GPU memory allocated by a [`VulkanRegistry`](crate::VulkanRegistry), registrable with a ferry engine.
pub struct VulkanBlock {
    path: AllocationPath,
    kind: &'static str,
    /// The buffer whose memory holds the region's bytes on the device.
    device: Arc<DeviceBuffer>,
    /// The staging buffer the host side reads and writes, for staged blocks.
    staging: Option<Arc<DeviceBuffer>>,
    host: *mut u8,
    len: usize,
    rdma_address: Option<u64>,
}

// SAFETY: the fields are handles (see `DeviceBuffer`'s `Send`), `Arc`s of `Send + Sync` types and a
// pointer into a process-wide mapping that is only accessed through raw pointers.
unsafe impl Send for VulkanBlock {}
// SAFETY: as above; shared access reads the fields and copies through the queue lock and per-command pools.
unsafe impl Sync for VulkanBlock {}

impl std::fmt::Debug for VulkanBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VulkanBlock")
            .field("kind", &self.kind)
            .field("len", &self.len)
            .field("rdma_address", &self.rdma_address)
            .finish_non_exhaustive()
    }
}

/// An opaque fd of a block's device memory, with what an importer must know to import it.
#[derive(Debug)]
pub struct ExportedMemory {
    /// The fd (`VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT`); CUDA imports it with
    /// `cudaExternalMemoryHandleTypeOpaqueFd` and `cudaExternalMemoryDedicated`.
    pub fd: OwnedFd,
    /// Bytes of the buffer (the region's length).
    pub size: u64,
    /// Bytes of the memory allocation (at least `size`; what an importer must allocate).
    pub allocation_size: u64,
    /// The memory type index the exporter allocated from; a Vulkan importer must use the same.
    pub memory_type_index: u32,
    /// The exporting device's UUID: opaque fds import only on the same device and driver.
    pub device_uuid: [u8; 16],
}

impl VulkanBlock {
    pub(crate) fn mapped(path: AllocationPath, kind: &'static str, device: DeviceBuffer, len: usize) -> Result<Self> {
        let host = device.mapped();
        if host.is_null() {
            return Err(Error::Unsupported(format!("{kind} memory could not be mapped")));
        }
        Ok(VulkanBlock {
            path,
            kind,
            device: Arc::new(device),
            staging: None,
            host,
            len,
            rdma_address: None,
        })
    }

    pub(crate) fn staged(
        path: AllocationPath,
        kind: &'static str,
        device: DeviceBuffer,
        staging: DeviceBuffer,
        len: usize,
    ) -> Result<Self> {
        let host = staging.mapped();
        if host.is_null() {
            return Err(Error::Unsupported("the staging buffer could not be mapped".into()));
        }
        Ok(VulkanBlock {
            path,
            kind,
            device: Arc::new(device),
            staging: Some(Arc::new(staging)),
            host,
            len,
            rdma_address: None,
        })
    }

    pub(crate) fn with_rdma_address(mut self, address: u64) -> Self {
        self.rdma_address = Some(address);
        self
    }

    /// The allocation path this block took.
    pub fn path(&self) -> AllocationPath {
        self.path
    }

    /// Whether the host side is a staging buffer (device copies in `commit_written`/`prepare_read`)
    /// rather than the device memory's own mapping.
    pub fn is_staged(&self) -> bool {
        self.staging.is_some()
    }

    /// The address RDMA NICs use to reach this memory (`vkGetMemoryRemoteAddressNV`), for path 1.
    pub fn rdma_address(&self) -> Option<u64> {
        self.rdma_address
    }

    /// The context the block was allocated on.
    pub fn context(&self) -> &Arc<VulkanContext> {
        self.device.context()
    }

    /// The memory type index of the device memory.
    pub fn memory_type_index(&self) -> u32 {
        self.device.type_index()
    }

    /// The property flags of the device memory's type.
    pub fn memory_flags(&self) -> vk::MemoryPropertyFlags {
        self.device.flags()
    }

    /// Exports the device memory as an opaque fd for another Vulkan device or CUDA.
    ///
    /// Needs `VK_KHR_external_memory_fd` and a registry that allocates exportable memory (the default
    /// where the device can export); [`Error::Unsupported`] otherwise.
    pub fn export(&self) -> Result<ExportedMemory> {
        Ok(ExportedMemory {
            fd: self.device.export_opaque_fd()?,
            size: self.device.size(),
            allocation_size: self.device.alloc_size(),
            memory_type_index: self.device.type_index(),
            device_uuid: self.context().device_uuid(),
        })
    }

    /// Copies `src` into the block at `offset` and onto the device (for staged blocks), the way a
    /// peer's write lands. Like `Region::write_at`, this races with peers writing the same bytes.
    pub fn upload(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        // SAFETY: the range lies inside the `len` host-addressable bytes at `host` (checked above), which
        // live as long as `self`; `src` is caller memory, so the two cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.host.add(offset), src.len()) };
        self.commit_written(offset, src.len(), Durability::Completed)
    }

    /// Copies the block's bytes at `offset` (from the device, for staged blocks) into `dst`.
    pub fn download(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        self.prepare_read(offset, dst.len())?;
        // SAFETY: as in `upload`, in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(self.host.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// A test fault (`ferry_core::integrity::fault::flip_next_device_copy`): the byte at `offset`
    /// flipped on the device of a staged block, its host buffer left as it was.
    fn flip_on_device(&self, offset: usize) -> Result<()> {
        let Some(staging) = &self.staging else {
            return Ok(());
        };
        // SAFETY: `offset` is inside the block (the range it starts was checked), whose `len` bytes
        // at `host` are the staging buffer's mapping; nothing else holds a reference to them.
        let byte = unsafe { self.host.add(offset) };
        // SAFETY: as above.
        unsafe { *byte ^= 0x5a };
        staging.flush(offset as u64, 1)?;
        self.context()
            .copy_ranges(staging, &self.device, &[(offset as u64, 1)])?;
        // SAFETY: as above.
        unsafe { *byte ^= 0x5a };
        staging.flush(offset as u64, 1)?;
        tracing::warn!(offset, "fault hook: flipped a byte on the device after its copy");
        Ok(())
    }

    /// `ranges` as device offsets, each checked against the block.
    fn checked(&self, ranges: &[(usize, usize)]) -> Result<Vec<(u64, u64)>> {
        ranges
            .iter()
            .map(|&(offset, len)| self.check(offset, len).map(|()| (offset as u64, len as u64)))
            .collect()
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        ferry_core::memory::check_block_range(self, offset, len)
    }
}

// SAFETY: `host` is the mapping of the device memory or of the staging buffer, `len` bytes long,
// readable and writable, valid and unmoved until the `DeviceBuffer` that owns it drops with `self`.
unsafe impl MemoryBlock for VulkanBlock {
    fn as_ptr(&self) -> *mut u8 {
        self.host
    }

    fn len(&self) -> usize {
        self.len
    }

    fn kind(&self) -> &str {
        self.kind
    }

    fn commit_written(&self, offset: usize, len: usize, durability: Durability) -> Result<()> {
        self.commit_written_ranges(&[(offset, len)], durability)
    }

    /// The ranges' device copies recorded together: one submission per 4 MiB of them, not one per
    /// range, and one wait for the whole batch.
    fn commit_written_ranges(&self, ranges: &[(usize, usize)], durability: Durability) -> Result<()> {
        if durability == Durability::Persistent {
            // GPU memory has no persistence domain: the trait's refusal.
            self.persist(ranges)?;
        }
        let ranges = self.checked(ranges)?;
        match &self.staging {
            None => ranges.iter().try_for_each(|&(off, n)| self.device.flush(off, n)),
            Some(staging) => {
                ranges.iter().try_for_each(|&(off, n)| staging.flush(off, n))?;
                self.context().copy_ranges(staging, &self.device, &ranges)?;
                match ranges.iter().find(|&&(_, n)| n > 0) {
                    Some(&(off, _)) if ferry_core::integrity::fault::device_copy_done() => {
                        self.flip_on_device(off as usize)
                    }
                    _ => Ok(()),
                }
            }
        }
    }

    /// [`DmaView::Device`] for path 1 where the RDMA-capable memory is not host-visible: the NIC
    /// reaches the device memory at its [`rdma_address`](VulkanBlock::rdma_address), and the pointer is
    /// a staging buffer that CPU transports use, coherent with the device only through GPU copies.
    /// [`DmaView::Staged`] for the other staged blocks (path 3) and for a mapping that is not
    /// host-coherent (the hooks flush and invalidate it); [`DmaView::Host`] for a coherent mapping
    /// (path 2, and path 1 where the RDMA-capable memory is host-visible), which the CPU and the NIC
    /// reach directly.
    fn dma_view(&self) -> DmaView {
        dma_view(self.staging.is_some(), self.rdma_address, self.device.is_coherent())
    }

    /// A dma-buf of the device memory behind a staging buffer (path 3), where the device exports one (`VK_EXT_external_memory_dma_buf`): a NIC
    /// that registers it reaches the device with no staging copy. `None` for memory the NIC reaches
    /// through a mapping, and where the device exports no dma-buf.
    fn dma_buf(&self) -> Option<Result<ferry_core::DmaBuf>> {
        (self.staging.is_some() && self.device.exports_dma_buf()).then(|| {
            self.device
                .export_dma_buf()
                .map(|fd| ferry_core::DmaBuf { fd, offset: 0 })
        })
    }

    /// The GPU's PCI address when a NIC's DMA through this block's pointer reaches the GPU's own
    /// memory: a mapping (not a staging buffer) of device-local memory of a GPU with memory of its own,
    /// where the driver reports the address. Host-side memory (a staging buffer, host-visible system
    /// memory, any memory of an integrated GPU or a CPU driver) is placed by its NUMA node instead.
    fn pci_device(&self) -> Option<ferry_core::PciAddress> {
        let on_the_gpu = self.staging.is_none()
            && self.device.flags().contains(vk::MemoryPropertyFlags::DEVICE_LOCAL)
            && self.context().has_own_memory();
        on_the_gpu.then(|| self.context().pci_address()).flatten()
    }

    fn prepare_read(&self, offset: usize, len: usize) -> Result<()> {
        self.prepare_read_ranges(&[(offset, len)])
    }

    fn prepare_read_ranges(&self, ranges: &[(usize, usize)]) -> Result<()> {
        let ranges = self.checked(ranges)?;
        match &self.staging {
            None => ranges.iter().try_for_each(|&(off, n)| self.device.invalidate(off, n)),
            Some(staging) => {
                self.context().copy_ranges(&self.device, staging, &ranges)?;
                ranges.iter().try_for_each(|&(off, n)| staging.invalidate(off, n))
            }
        }
    }
}

impl Sealed for VulkanBlock {
    fn device_buffer(&self) -> &Arc<DeviceBuffer> {
        &self.device
    }
}

impl GpuBuffer for VulkanBlock {
    /// The device-side buffer (for staged blocks, not the staging buffer).
    fn vk_buffer(&self) -> vk::Buffer {
        self.device.handle()
    }
    fn size(&self) -> u64 {
        self.device.size()
    }
}

/// How the CPU and a NIC reach a block: behind a staging buffer or through a mapping (coherent or
/// not), with the remote address `VK_NV_external_memory_rdma` gave, if any (see
/// [`MemoryBlock::dma_view`] on [`VulkanBlock`]).
fn dma_view(staged: bool, rdma_address: Option<u64>, coherent: bool) -> DmaView {
    match (staged, rdma_address) {
        (true, Some(nic_address)) => DmaView::Device { nic_address },
        (true, None) => DmaView::Staged,
        (false, _) if !coherent => DmaView::Staged,
        (false, _) => DmaView::Host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lavapipe has no `VK_NV_external_memory_rdma`, so the tests on a device never see a remote
    /// address: the rule is checked here, on every combination.
    #[test]
    fn only_staged_memory_with_a_remote_address_is_device_memory() {
        let address = Some(0x7f00_0000_0000);
        for coherent in [true, false] {
            assert_eq!(
                dma_view(true, address, coherent),
                DmaView::Device {
                    nic_address: 0x7f00_0000_0000
                },
                "the NIC reaches it directly, the CPU through the staging buffer"
            );
            assert_eq!(dma_view(true, None, coherent), DmaView::Staged);
        }
        // A mapping: the NIC registers the mapping, whatever the remote address.
        for rdma_address in [address, None] {
            assert_eq!(dma_view(false, rdma_address, true), DmaView::Host);
            assert_eq!(dma_view(false, rdma_address, false), DmaView::Staged);
        }
    }
}
