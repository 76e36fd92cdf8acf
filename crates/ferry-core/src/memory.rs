//! Memory that the engine can register, and where it comes from.
//!
//! The engine never hands out `&[u8]` or `&mut [u8]` over registered memory: remote peers write into
//! it concurrently with local code, so the bytes are reached through raw pointers, one bounded copy or
//! system call at a time, under a [`Permit`](crate::guard::Permit) of the region's access guard.
//!
//! A [`MemoryBlock`] is anything that owns (or borrows, `unsafe`ly) a contiguous range of host-addressable
//! bytes: a boxed buffer, an engine allocation backed by a memfd, a mapped Vulkan allocation, a mapped
//! persistent file. A [`MemoryRegistry`] hands out blocks the engine did not allocate itself; the Vulkan
//! crate is one.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::types::{Durability, PersistStats};

/// The size of a memory page on this host, in bytes: the unit of mappings, `msync` ranges and NIC
/// registrations at a chosen address. 4096 if the system will not say.
pub fn page_size() -> usize {
    // SAFETY: sysconf reads a system constant; it has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|s| s.is_power_of_two())
        .unwrap_or(4096)
}

/// Checks that `len` bytes at `offset` lie in `block` ([`Error::OutOfBounds`] naming the block's
/// size and kind otherwise): for a block's own methods that take ranges from callers.
pub fn check_block_range(block: &dyn MemoryBlock, offset: usize, len: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= block.len() => Ok(()),
        _ => Err(Error::OutOfBounds(format!(
            "{len} bytes at offset {offset} of a {}-byte {} block",
            block.len(),
            block.kind()
        ))),
    }
}

/// How the CPU and a NIC reach a block's bytes, and so what keeping them coherent costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DmaView {
    /// The CPU and the NIC reach the bytes directly at [`MemoryBlock::as_ptr`]: host memory, a mapped
    /// file (page cache or DAX), host-visible coherent GPU memory. No hook is needed around accesses
    /// (a persistent write still persists, see [`MemoryBlock::persist`]).
    Host,
    /// [`MemoryBlock::as_ptr`] is a host copy (or a non-coherent mapping) in front of memory that the
    /// NIC and the CPU cannot reach coherently by themselves; [`MemoryBlock::commit_written`] and
    /// [`MemoryBlock::prepare_read`] keep the two coherent and may block (a GPU copy and its fence,
    /// a cache flush or invalidate). Transports run them off the runtime's threads, under a permit.
    Staged,
    /// Device memory a NIC can reach directly at `nic_address` (`VK_NV_external_memory_rdma`), and
    /// the CPU cannot: [`MemoryBlock::as_ptr`] is then a host copy that only CPU transports use,
    /// kept coherent by the hooks as for [`Staged`](DmaView::Staged).
    ///
    /// The RDMA transport registers the device memory itself, at the region's host address, so that
    /// work requests and peers name the region as they would any other and the NIC moves the bytes
    /// to and from the device with no hook and no host copy. A NIC that refuses the address (no
    /// access to that device's memory) gets the host copy registered instead, and the region is then
    /// treated as [`Staged`](DmaView::Staged).
    Device {
        /// The address a NIC names the memory by.
        nic_address: u64,
    },
}

/// Device memory, by the API that allocated it (see [`MemoryBlock::device_address`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceAddress {
    /// A CUDA device pointer (`CUdeviceptr`) in the process's unified address space.
    Cuda(u64),
}

/// A dma-buf of a block's memory (see [`MemoryBlock::dma_buf`]).
#[derive(Debug)]
pub struct DmaBuf {
    /// The dma-buf.
    pub fd: std::os::fd::OwnedFd,
    /// Where the block's first byte lies in it.
    pub offset: u64,
}

/// Writes into a block through the file behind it (`pwrite(2)` into the page cache) and persists
/// what was so written. A page-cache file mapped shared gains twice: the write takes no page fault
/// for each page the last flush cleaned, and the flush write-protects no mapped page, so no other
/// core's TLB is shot down (1 MiB on ext4: 0.58 ms written and synced through the file, 1.0 ms
/// copied into the mapping and `msync`ed). See [`MemoryBlock::file_writer`].
pub trait FileWriter: Send + Sync {
    /// Writes `src` at `offset` of the block (not yet persistent); the caller holds a permit of the
    /// region's access guard and has checked the range.
    fn write_at(&self, offset: usize, src: &[u8]) -> Result<()>;
    /// Makes the ranges `(offset, len)` persistent, as one batch, that this host's CPU wrote:
    /// through [`write_at`](Self::write_at), or with stores into the block's memory, either of which
    /// left the pages dirty (a NIC's writes would not have). The caller holds a permit.
    fn persist_written(&self, ranges: &[(usize, usize)]) -> Result<()>;
    /// Whether a persist has run on this block: the pages it flushed are clean and write-protected
    /// in the mapping, so that a copy into them faults on each, where a block never flushed keeps
    /// its pages writable and a copy into them is cheaper than writing through the file.
    fn flushed(&self) -> bool;
}

/// Copies between a block's device memory and any host buffer, past the host copy at the block's
/// pointer (see [`MemoryBlock::device_copies`]).
pub trait DeviceCopies: Send + Sync {
    /// Copies `src` onto the device at `offset` of the block, and returns once the bytes are there.
    /// The caller holds a permit of the region's access guard and has checked the range.
    fn copy_to_device(&self, offset: usize, src: &[u8]) -> Result<()>;
    /// Copies `dst.len()` bytes at `offset` of the block from the device into `dst`. The caller holds
    /// a permit of the region's access guard and has checked the range.
    fn copy_from_device(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// Makes `copies` between the device and host memory that no Rust reference may cover (a
    /// mapping another process writes), as one batch, and returns once all of them are done. The
    /// caller holds a permit of the region's access guard and has checked the block's ranges.
    ///
    /// # Safety
    ///
    /// Each copy's `host` range must be memory of this process, readable (and, for a copy from the
    /// device, writable) for `len` bytes until this returns.
    unsafe fn copy_raw(&self, copies: &[RawCopy]) -> Result<()>;
}

/// One copy of [`DeviceCopies::copy_raw`]: `len` bytes between `offset` of the block's device
/// memory and `host`.
#[derive(Debug, Clone, Copy)]
pub struct RawCopy {
    /// Where in the block.
    pub offset: usize,
    /// Where in host memory.
    pub host: *mut u8,
    /// How many bytes.
    pub len: usize,
    /// From `host` onto the device (else from the device into `host`).
    pub to_device: bool,
}

// SAFETY: a `RawCopy` only names memory; whoever dereferences `host` answers for it
// (`DeviceCopies::copy_raw`'s contract).
unsafe impl Send for RawCopy {}
// SAFETY: as above.
unsafe impl Sync for RawCopy {}

/// A contiguous range of memory the engine may register.
///
/// # Safety
///
/// Implementors promise that [`as_ptr`](MemoryBlock::as_ptr) points to [`len`](MemoryBlock::len) bytes that
/// stay valid for reads and writes through raw pointers, from any thread, for as long as the block is
/// alive, and that the pointer never changes. A block whose [`dma_view`](MemoryBlock::dma_view) is
/// [`DmaView::Device`] promises the same of its `nic_address`: `len` bytes there that a NIC may
/// register and read and write for as long as the block is alive, at an address that never changes.
/// A block that says it [owns its memory](MemoryBlock::owns_memory) promises that no one reaches
/// those bytes but through the block.
pub unsafe trait MemoryBlock: Send + Sync + 'static {
    /// The first byte.
    fn as_ptr(&self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// The address callers name the block's first byte by, in transfer descriptors and
    /// `Region::addr`: by default its pointer. Memory that has an address of its own in this
    /// process, which the program that allocated it uses, keeps that name while its pointer is a
    /// host copy: CUDA device memory is named by its device pointer (`tensor.data_ptr()`). The
    /// address never changes, and the `len` bytes from it overlap no other block's names (device
    /// and host addresses share one space under CUDA's unified addressing).
    fn address(&self) -> u64 {
        self.as_ptr() as u64
    }
    /// Whether the block is empty (never true for a registered block).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A short description for logs and `Region::kind`: "host", "host (memfd)", "vulkan host-visible"…
    fn kind(&self) -> &str;
    /// Whether writes to this block can be made persistent (see [`Durability`]).
    fn persistent(&self) -> bool {
        false
    }
    /// Called after a peer wrote `[offset, offset + len)`, before the write is acknowledged. Device
    /// memory behind a staging buffer copies to the device here; persistent memory flushes here when
    /// `durability` is [`Durability::Persistent`].
    fn commit_written(&self, offset: usize, len: usize, durability: Durability) -> Result<()> {
        match durability {
            Durability::Completed => Ok(()),
            Durability::Persistent => self.persist(&[(offset, len)]),
        }
    }
    /// [`commit_written`](Self::commit_written) for the ranges `(offset, len)` that one operation
    /// wrote, as one batch: a block whose hook has a cost per call (a GPU submission and its fence)
    /// pays it once. By default, one `commit_written` per range; on an error the remaining ranges
    /// are still committed and the first error is returned.
    fn commit_written_ranges(&self, ranges: &[(usize, usize)], durability: Durability) -> Result<()> {
        let mut result = Ok(());
        for &(offset, len) in ranges {
            let committed = self.commit_written(offset, len, durability);
            if result.is_ok() {
                result = committed;
            }
        }
        result
    }
    /// Makes the written ranges `(offset, len)` persistent, as one batch: a page or cache line that
    /// several ranges share is flushed once. Only persistent blocks can; the others refuse with
    /// `InvalidArgument`. The caller holds a permit of the region's access guard.
    fn persist(&self, ranges: &[(usize, usize)]) -> Result<()> {
        if ranges.is_empty() {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "a persistent write needs a persistent region; this one is {}",
            self.kind()
        )))
    }
    /// Whether the block is byte-addressable persistent memory (a DAX mapping): a write there is
    /// persistent once out of the CPU caches, so a NIC can persist it by itself (the RDMA FLUSH verb).
    fn is_pmem(&self) -> bool {
        false
    }
    /// Checks that the memory is still backed as it was registered (a mapped file may have been
    /// truncated or removed since); the error says what happened. Called once per remote operation.
    fn check_backing(&self) -> Result<()> {
        Ok(())
    }
    /// Whether the memory is still what was registered, without a system call: an error once a fault
    /// swapped a mapped file's pages for zeros. Checked after each remote copy, so that a copy that
    /// raced a truncation is reported as failed, never acknowledged.
    fn check_intact(&self) -> Result<()> {
        Ok(())
    }
    /// What persisting has cost so far, for blocks that persist.
    fn persist_stats(&self) -> Option<PersistStats> {
        None
    }
    /// How to write into this block through a file that holds its bytes rather than through its
    /// memory, for a transport whose payload arrives in a buffer of its own (see
    /// [`region::into_files`](crate::region::into_files)). `None` (the default) for memory that has
    /// no such file.
    fn file_writer(&self) -> Option<&dyn FileWriter> {
        None
    }
    /// Called before a peer reads `[offset, offset + len)`. Device memory behind a staging buffer copies
    /// from the device here.
    fn prepare_read(&self, offset: usize, len: usize) -> Result<()> {
        let _ = (offset, len);
        Ok(())
    }
    /// [`prepare_read`](Self::prepare_read) for the ranges `(offset, len)` that one operation reads,
    /// as one batch (see [`commit_written_ranges`](Self::commit_written_ranges)). By default, one
    /// `prepare_read` per range, stopping at the first error.
    fn prepare_read_ranges(&self, ranges: &[(usize, usize)]) -> Result<()> {
        ranges
            .iter()
            .try_for_each(|&(offset, len)| self.prepare_read(offset, len))
    }
    /// A memory file whose bytes `[0, len)` are this block, sealed so that nobody can shrink it (a
    /// process that maps it can never fault on a page that was cut off), for another process of this
    /// host to map: the shared-memory transport lends it to peers instead of copying for them. `None`
    /// (the default) for memory that is no such file.
    fn shared_file(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }
    /// Device memory the block stands for, named by the API that allocated it, for a transport that
    /// can move it device to device (another process on the same GPU, through that API's sharing
    /// handles) instead of through the host copy at [`as_ptr`](Self::as_ptr). `None` (the default)
    /// for memory the CPU reaches.
    fn device_address(&self) -> Option<DeviceAddress> {
        None
    }
    /// Copies between the device memory a [`Staged`](DmaView::Staged) block stands for and a
    /// transport's own buffers, past the host copy at [`as_ptr`](Self::as_ptr): a transport whose
    /// payloads pass through buffers of its own anyway (TCP) moves them through a bounded buffer
    /// instead of the host copy, whose pages are then never touched and cost no memory. `None` (the
    /// default): the block copies only between the host copy and the device, in its hooks.
    fn device_copies(&self) -> Option<&dyn DeviceCopies> {
        None
    }
    /// A dma-buf of the block's memory, for a NIC that registers it directly (`ibv_reg_dmabuf_mr`):
    /// device memory that no host address reaches, on drivers that export it (CUDA's
    /// `cuMemGetHandleForAddressRange`). The RDMA transport then reaches the device with no host
    /// copy and no hook. `None` (the default): the block has none to offer; `Some(Err(_))`: it
    /// has, and the export failed, saying why.
    fn dma_buf(&self) -> Option<Result<DmaBuf>> {
        None
    }
    /// The PCI device whose memory a NIC's DMA reaches when it accesses this block: a GPU, for device
    /// memory registered directly or mapped through the GPU's BAR. The RDMA transport then prefers the
    /// NICs nearest to that device on the PCIe fabric over the NUMA rule for host memory. `None` (the
    /// default) for memory in host RAM, including a host staging buffer in front of device memory.
    fn pci_device(&self) -> Option<crate::PciAddress> {
        None
    }
    /// Whether the bytes are the block's own: made by the block (a heap buffer, an anonymous mapping),
    /// reached by no one but through it, and released when it drops. `false` (the default) for
    /// memory someone else also reaches: a raw pointer the caller keeps, a file others may read.
    ///
    /// A region dropped on a current-thread runtime, whose block owns its memory and is held by
    /// nothing else, is freed by a task once its accesses end, instead of holding the runtime's only
    /// thread until they do: those accesses may then still change the bytes after the drop returned,
    /// which only memory no one else reaches can allow.
    fn owns_memory(&self) -> bool {
        false
    }
    /// How the CPU and a NIC reach the bytes; [`DmaView::Host`] unless the block says otherwise.
    fn dma_view(&self) -> DmaView {
        DmaView::Host
    }
    /// Whether [`commit_written`](Self::commit_written) (for a completed write) or
    /// [`prepare_read`](Self::prepare_read) do anything: every view but [`DmaView::Host`] (device
    /// memory behind a staging buffer, memory that is not host-coherent). A transport whose peers
    /// reach the memory without this host's CPU (RDMA) then has the peer ask for them around its
    /// accesses.
    fn has_access_hooks(&self) -> bool {
        self.dma_view() != DmaView::Host
    }
}

/// A source of memory the engine did not allocate itself (a GPU allocator, a persistent-memory pool).
pub trait MemoryRegistry: Send + Sync {
    /// A name for logs and errors.
    fn name(&self) -> &str;
    /// Allocates `len` bytes.
    fn allocate(&self, len: usize) -> Result<Arc<dyn MemoryBlock>>;
}

/// A buffer the caller hands over: a `Vec<u8>` or boxed slice, owned by the region from then on.
///
/// The allocation is held as a raw pointer from [`Box::into_raw`], never as a `Box`: a `Box` asserts
/// unique access to its bytes whenever it is moved, which would invalidate the pointer that peers and
/// copies write through.
pub struct OwnedBuffer {
    ptr: *mut u8,
    len: usize,
}

impl OwnedBuffer {
    /// Takes ownership of `storage`.
    pub fn new(storage: impl Into<Box<[u8]>>) -> Self {
        let storage: Box<[u8]> = storage.into();
        let len = storage.len();
        let ptr = Box::into_raw(storage).cast::<u8>();
        OwnedBuffer { ptr, len }
    }
}

impl Drop for OwnedBuffer {
    fn drop(&mut self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.ptr, self.len);
        // SAFETY: `slice` is exactly the pointer and length that `Box::into_raw` returned in `new`, and
        // it is turned back into a Box once, here; no other pointer to it outlives `self`.
        drop(unsafe { Box::from_raw(slice) });
    }
}

// SAFETY: the pointer is to a heap allocation owned by `self` (released only in `Drop`), never
// reallocated, and only accessed through raw pointers, which is sound from any thread.
unsafe impl Send for OwnedBuffer {}
// SAFETY: as above; shared access goes through raw pointers only.
unsafe impl Sync for OwnedBuffer {}

// SAFETY: `ptr` points to the `len` bytes leaked from the Box in `new`, freed only when `self` drops.
unsafe impl MemoryBlock for OwnedBuffer {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> &str {
        "host (owned buffer)"
    }
    fn owns_memory(&self) -> bool {
        // The Box's bytes, reached only through `ptr`.
        true
    }
}

/// Memory the caller owns and promises to keep alive while it is registered.
pub struct RawMemory {
    ptr: *mut u8,
    len: usize,
}

impl RawMemory {
    /// Describes `len` bytes at `ptr`.
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for reads and writes of `len` bytes until the region made from this block is
    /// deregistered (or dropped) and that call has returned, and nothing may free or unmap it before.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        RawMemory { ptr, len }
    }
}

// SAFETY: the caller of `RawMemory::new` promised validity from any thread for the registration's life.
unsafe impl Send for RawMemory {}
// SAFETY: as above.
unsafe impl Sync for RawMemory {}

// SAFETY: validity is the promise made to `RawMemory::new`.
unsafe impl MemoryBlock for RawMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> &str {
        "host (caller-owned)"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under Miri (`cargo miri test -p ferry-core owned_buffer`) this fails when the buffer holds its
    /// storage as a `Box` that moves: the move retags the allocation and the kept pointer is invalid.
    #[test]
    fn owned_buffer_pointer_survives_moves() {
        let block = OwnedBuffer::new(vec![7u8; 64]);
        let moved = Box::new(block);
        let ptr = moved.as_ptr();
        let moved_again: Arc<dyn MemoryBlock> = Arc::new(*moved);
        assert_eq!(moved_again.as_ptr(), ptr);
        // SAFETY: `ptr` points to 64 live bytes owned by `moved_again`; no reference to them exists.
        unsafe {
            ptr.add(63).write(9);
            assert_eq!(ptr.read(), 7);
            assert_eq!(ptr.add(63).read(), 9);
        }
        let empty = OwnedBuffer::new(Vec::new());
        assert_eq!(empty.len(), 0);
    }
}
