//! [`CudaBlock`]: CUDA device memory as a ferry [`MemoryBlock`].
//!
//! The engine's transports reach memory through host pointers, so the block has a host copy as long
//! as the region: an anonymous mapping that reserves nothing (`MAP_NORESERVE`), whose pages exist
//! only once something touches them. Two ways move the bytes, and the second leaves the host copy
//! untouched:
//!
//! - **Through the host copy**, as the staged contract asks of any device memory:
//!   [`commit_written_ranges`](MemoryBlock::commit_written_ranges) copies the written ranges to the
//!   device before the write is acknowledged, [`prepare_read_ranges`](MemoryBlock::prepare_read_ranges)
//!   copies the ranges to be read from the device before they are sent. Each batch is queued on the
//!   block's own stream as asynchronous copies and waited for once: a request of many ranges pays
//!   one synchronisation, not one per range.
//! - **Past it** ([`DeviceCopies`]): a transport that receives or sends payloads through buffers of
//!   its own copies between those and the device directly, a piece at a time, so that serving or
//!   sending a 40 GB KV cache costs a few pieces' worth of host memory, not 40 GB. Both ends of a
//!   TCP link do (and so a shared-memory link's control link), integrity sums included.
//!
//! Copies from and to pageable memory are the driver's to stage: it moves them through page-locked
//! buffers of its own, and an asynchronous copy of pageable memory has left the host buffer (or
//! filled it) by the time the stream is synchronised, which every copy here waits for.
//!
//! The memory is either ferry's ([`CudaRegistry`](crate::CudaRegistry)) or the caller's, borrowed
//! from a pointer the driver vouched for ([`CudaBlock::borrow`]): a PyTorch tensor's storage.

use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;
use ferry_core::{DeviceCopies, DmaView, Durability, Error, MemoryBlock, Result};

use crate::device::{Copies, CudaDevice, DeviceAllocation};
use crate::error::check;
use crate::pointer::{PointerKind, classify};

/// Where the device bytes come from.
enum DeviceMemory {
    /// Allocated by ferry, freed with the block.
    Owned(DeviceAllocation),
    /// The caller's, kept alive by `_owner` (if given) as long as the block.
    Borrowed {
        ptr: sys::CUdeviceptr,
        _owner: Option<Box<dyn Any + Send + Sync>>,
    },
}

impl DeviceMemory {
    fn ptr(&self) -> sys::CUdeviceptr {
        match self {
            DeviceMemory::Owned(a) => a.ptr,
            DeviceMemory::Borrowed { ptr, .. } => *ptr,
        }
    }
}

/// Which way a batch of copies goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    ToDevice,
    ToHost,
}

/// The host copy in front of a block's device memory: an anonymous private mapping of `len` bytes
/// that reserves no memory (`MAP_NORESERVE`), so that pages exist only where something touched them.
struct HostCopy {
    ptr: *mut u8,
    len: usize,
}

impl HostCopy {
    fn new(len: usize) -> Result<Self> {
        // SAFETY: a new anonymous mapping at an address the kernel picks: no existing memory is
        // affected, and the result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io(
                format_args!("mapping the {len}-byte host copy of a CUDA region"),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(HostCopy { ptr: ptr.cast(), len })
    }
}

impl Drop for HostCopy {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `len` are the mapping made in `new`, unmapped once, here; the block that
        // owns it drops only after its accesses ended.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// CUDA device memory behind a host copy (see the module's documentation).
pub struct CudaBlock {
    kind: &'static str,
    len: usize,
    memory: DeviceMemory,
    host: HostCopy,
    /// The block's copies, one batch at a time.
    copies: Copies,
    /// Dropped last: the fields above free driver objects in its context.
    device: Arc<CudaDevice>,
}

// SAFETY: the fields are driver handles (usable from any thread once the context is bound), an
// `Arc` of a `Send + Sync` device, an owner that is `Send + Sync`, and a pointer to the block's own
// host mapping, only reached through raw pointers.
unsafe impl Send for CudaBlock {}
// SAFETY: as above; copies are serialised by `copies`' lock.
unsafe impl Sync for CudaBlock {}

impl std::fmt::Debug for CudaBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBlock")
            .field("kind", &self.kind)
            .field("len", &self.len)
            .field("device", &self.device.ordinal())
            .field("device_ptr", &format_args!("{:#x}", self.memory.ptr()))
            .finish_non_exhaustive()
    }
}

impl CudaBlock {
    /// `len` bytes of new device memory on `device`, zeroed.
    pub(crate) fn allocate(device: &Arc<CudaDevice>, len: usize) -> Result<Self> {
        let memory = DeviceMemory::Owned(device.alloc(len)?);
        Self::staged(device, memory, len, "cuda device (staged)")
    }

    /// Borrows `len` bytes of device memory at `ptr`, which the driver must know as one
    /// allocation's (`cuPointerGetAttributes`) in its device's primary context; `owner` (a tensor)
    /// is kept alive as long as the block.
    ///
    /// # Safety
    ///
    /// The memory must stay allocated until the block drops (keeping `owner` alive must be enough
    /// for that, if it is given); peers may write into it at any time until then.
    pub unsafe fn borrow(ptr: u64, len: usize, owner: Option<Box<dyn Any + Send + Sync>>) -> Result<Arc<Self>> {
        let (ordinal, context) = match classify(ptr, len as u64)? {
            PointerKind::Device { ordinal, context, .. } => (ordinal, context),
            PointerKind::Host => {
                // Without a driver nothing is device memory: the reason is the driver's absence.
                crate::driver::driver()?;
                return Err(Error::InvalidArgument(format!(
                    "{ptr:#x} is not CUDA device memory: register host memory as host memory"
                )));
            }
        };
        let device = CudaDevice::open(u32::try_from(ordinal).map_err(|_| {
            Error::InvalidArgument(format!("{ptr:#x} belongs to no device the driver lists ({ordinal})"))
        })?)?;
        // Memory mapped through the virtual memory API (`cuMemMap`, PyTorch's expandable segments)
        // belongs to no context: the driver reports none.
        if context != 0 && context != device.context_handle() {
            return Err(Error::Unsupported(format!(
                "{ptr:#x} was allocated in a CUDA context other than device {ordinal}'s primary context (the one \
                 the CUDA runtime and PyTorch use), which ferry copies with; allocate it with the runtime API"
            )));
        }
        let memory = DeviceMemory::Borrowed { ptr, _owner: owner };
        Self::staged(&device, memory, len, "cuda device (borrowed, staged)").map(Arc::new)
    }

    fn staged(device: &Arc<CudaDevice>, memory: DeviceMemory, len: usize, kind: &'static str) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("a CUDA block needs at least one byte".into()));
        }
        Ok(CudaBlock {
            kind,
            len,
            host: HostCopy::new(len)?,
            copies: Copies::new(device)?,
            memory,
            device: device.clone(),
        })
    }

    /// The device the memory is on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// The device address of the first byte.
    pub fn device_ptr(&self) -> u64 {
        self.memory.ptr()
    }

    /// Copies `len(dst)` bytes at `offset` from the device itself into `dst`, past the host copy:
    /// what the GPU holds.
    pub fn read_device(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        let device = self.memory.ptr() + offset as u64;
        self.on_stream(|stream| {
            // SAFETY: the device range lies in the block (checked above); `dst` is caller memory
            // of that length, written only by this copy, which `on_stream` waits for.
            let code = unsafe { sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), device, dst.len(), stream) };
            check("cuMemcpyDtoHAsync", code)
        })
    }

    /// Copies `src` onto the device at `offset`, past the host copy, as a GPU kernel's writes
    /// would land: a later peer READ must see them.
    pub fn write_device(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        let device = self.memory.ptr() + offset as u64;
        self.on_stream(|stream| {
            // SAFETY: as in `read_device`, in the other direction; `src` is only read.
            let code = unsafe { sys::cuMemcpyHtoDAsync_v2(device, src.as_ptr().cast(), src.len(), stream) };
            check("cuMemcpyHtoDAsync", code)
        })
    }

    /// Queues one copy per range between the host copy and the device on the block's stream, and
    /// waits for all of them.
    fn copy(&self, ranges: &[(usize, usize)], direction: Direction) -> Result<()> {
        ranges.iter().try_for_each(|&(offset, len)| self.check(offset, len))?;
        self.on_stream(|stream| {
            for &(offset, len) in ranges.iter().filter(|&&(_, len)| len > 0) {
                let device = self.memory.ptr() + offset as u64;
                // SAFETY: `offset + len` lies in the block (checked above), so both the device range
                // and `len` bytes of the host copy at `offset` are valid; the host copy outlives the
                // copy, which `on_stream` waits for (the driver stages pageable memory itself).
                let host = unsafe { self.host.ptr.add(offset) }.cast::<c_void>();
                // SAFETY: as above.
                let code = unsafe {
                    match direction {
                        Direction::ToDevice => sys::cuMemcpyHtoDAsync_v2(device, host, len, stream),
                        Direction::ToHost => sys::cuMemcpyDtoHAsync_v2(host, device, len, stream),
                    }
                };
                check("queueing a copy between the host copy and the device", code)?;
            }
            Ok(())
        })
    }

    /// Runs `queue` on the block's stream and waits for it (see [`Copies::run`]).
    fn on_stream(&self, queue: impl FnOnce(sys::CUstream) -> Result<()>) -> Result<()> {
        self.copies.run(queue)
    }

    /// A dma-buf of the block's device memory (see [`crate::dmabuf`]).
    fn export_dma_buf(&self) -> Result<ferry_core::DmaBuf> {
        let ptr = self.memory.ptr();
        let PointerKind::Device { start, size, .. } = classify(ptr, self.len as u64)? else {
            return Err(Error::Internal(format!("{ptr:#x} is no longer CUDA device memory")));
        };
        crate::dmabuf::export(&self.device, ptr, self.len as u64, start, size)
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        ferry_core::memory::check_block_range(self, offset, len)
    }
}

// SAFETY: `as_ptr` is the host copy, a mapping of `len` bytes, readable and writable from any
// thread, unmapped only when the block drops, never moved.
unsafe impl MemoryBlock for CudaBlock {
    fn as_ptr(&self) -> *mut u8 {
        self.host.ptr
    }

    fn len(&self) -> usize {
        self.len
    }

    /// The device pointer: the program that allocated the memory names it so (a tensor's
    /// `data_ptr()`), and so do transfer descriptors; the host copy is only how some bytes move.
    fn address(&self) -> u64 {
        self.memory.ptr()
    }

    /// A dma-buf of the device memory, for a NIC that registers it directly (where the device
    /// exports one: see [`crate::dmabuf`]).
    fn dma_buf(&self) -> Option<Result<ferry_core::DmaBuf>> {
        Some(self.export_dma_buf())
    }

    fn device_address(&self) -> Option<ferry_core::DeviceAddress> {
        Some(ferry_core::DeviceAddress::Cuda(self.memory.ptr()))
    }

    fn kind(&self) -> &str {
        self.kind
    }

    fn dma_view(&self) -> DmaView {
        DmaView::Staged
    }

    fn commit_written(&self, offset: usize, len: usize, durability: Durability) -> Result<()> {
        self.commit_written_ranges(&[(offset, len)], durability)
    }

    /// The written ranges, copied to the device as one batch. GPU memory has no persistence domain:
    /// a persistent write is the trait's refusal, before anything is copied.
    fn commit_written_ranges(&self, ranges: &[(usize, usize)], durability: Durability) -> Result<()> {
        if durability == Durability::Persistent {
            self.persist(ranges)?;
        }
        self.copy(ranges, Direction::ToDevice)
    }

    fn prepare_read(&self, offset: usize, len: usize) -> Result<()> {
        self.prepare_read_ranges(&[(offset, len)])
    }

    fn prepare_read_ranges(&self, ranges: &[(usize, usize)]) -> Result<()> {
        self.copy(ranges, Direction::ToHost)
    }

    fn device_copies(&self) -> Option<&dyn DeviceCopies> {
        Some(self)
    }
}

/// Copies between the device and a transport's buffers, past the host copy.
impl DeviceCopies for CudaBlock {
    fn copy_to_device(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.write_device(offset, src)
    }

    fn copy_from_device(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.read_device(offset, dst)
    }

    unsafe fn copy_raw(&self, copies: &[ferry_core::RawCopy]) -> Result<()> {
        copies.iter().try_for_each(|c| self.check(c.offset, c.len))?;
        self.on_stream(|stream| {
            for c in copies.iter().filter(|c| c.len > 0) {
                let device = self.memory.ptr() + c.offset as u64;
                // SAFETY: the device range lies in the block (checked above); the host range is
                // memory of this process valid for `len` bytes until this returns (the caller's
                // promise), and `on_stream` waits for every copy queued here before it returns.
                let code = unsafe {
                    match c.to_device {
                        true => sys::cuMemcpyHtoDAsync_v2(device, c.host.cast_const().cast(), c.len, stream),
                        false => sys::cuMemcpyDtoHAsync_v2(c.host.cast(), device, c.len, stream),
                    }
                };
                check("cuMemcpyAsync between the device and a peer's mapping", code)?;
            }
            Ok(())
        })
    }
}
