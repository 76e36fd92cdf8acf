//! Emulated device memory for the tests of `DmaView::Device`: a second buffer of host memory stands
//! for a GPU's memory, the block's pointer is its host copy, and its hooks copy between the two (the
//! GPU copies a real block makes).

use std::alloc::Layout;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ferry::{DmaView, Durability, MemoryBlock};

/// A page-aligned allocation holding a copy of some bytes, `skew` bytes into it; freed on drop. Or,
/// with `memfd`, an engine allocation (a memory file), which a dma-buf can be made of (udmabuf).
struct Buffer {
    first: *mut u8,
    layout: Layout,
    skew: usize,
    memfd: Option<ferry::HostAllocation>,
}

impl Buffer {
    fn new(bytes: &[u8], skew: usize) -> Self {
        let layout = Layout::from_size_align(bytes.len() + skew, PAGE).unwrap();
        // SAFETY: the layout's size is not zero (every test buffer has bytes).
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!base.is_null(), "allocating a test buffer");
        // SAFETY: `skew + bytes.len()` bytes were just allocated at `base`.
        let first = unsafe { base.add(skew) };
        // SAFETY: as above; the new allocation does not overlap `bytes`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), first, bytes.len()) };
        Buffer {
            first,
            layout,
            skew,
            memfd: None,
        }
    }

    /// An engine allocation (a memory file sealed against shrinking, as udmabuf asks) of
    /// `bytes.len()` bytes rounded up to a page, holding a copy of `bytes`.
    fn memfd(bytes: &[u8]) -> Self {
        let memory = ferry::HostAllocation::new(bytes.len().div_ceil(PAGE) * PAGE).unwrap();
        let first = memory.as_ptr();
        // SAFETY: the allocation holds at least `bytes.len()` writable bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), first, bytes.len()) };
        Buffer {
            first,
            layout: Layout::from_size_align(memory.len(), PAGE).unwrap(),
            skew: 0,
            memfd: Some(memory),
        }
    }

    /// A dma-buf of the whole memory file (`/dev/udmabuf`), as a GPU driver exports device memory.
    fn dma_buf(&self) -> ferry::Result<ferry::DmaBuf> {
        let Some(memfd) = self.memfd.as_ref().and_then(|m| m.shared_file()) else {
            return Err(ferry::Error::Unsupported("heap memory makes no dma-buf".into()));
        };
        let udmabuf = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/udmabuf")
            .map_err(|e| ferry::Error::Unsupported(format!("opening /dev/udmabuf: {e}")))?;
        #[repr(C)]
        struct UdmabufCreate {
            memfd: u32,
            flags: u32,
            offset: u64,
            size: u64,
        }
        const UDMABUF_FLAGS_CLOEXEC: u32 = 1;
        // _IOW('u', 0x42, struct udmabuf_create)
        const UDMABUF_CREATE: libc::c_ulong = (1 << 30) | (24 << 16) | ((b'u' as libc::c_ulong) << 8) | 0x42;
        let create = UdmabufCreate {
            memfd: memfd.as_raw_fd() as u32,
            flags: UDMABUF_FLAGS_CLOEXEC,
            offset: 0,
            size: self.layout.size() as u64,
        };
        // SAFETY: the argument is the kernel's `struct udmabuf_create`, alive for the call.
        let fd = unsafe { libc::ioctl(udmabuf.as_raw_fd(), UDMABUF_CREATE, &create) };
        if fd < 0 {
            return Err(ferry::Error::Unsupported(format!(
                "UDMABUF_CREATE: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(ferry::DmaBuf {
            // SAFETY: the kernel handed this process a new descriptor, owned by nothing else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            offset: 0,
        })
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // An engine allocation frees itself.
        if self.memfd.is_none() {
            // SAFETY: allocated in `new` with this layout, `skew` bytes before `first`.
            unsafe { std::alloc::dealloc(self.first.sub(self.skew), self.layout) };
        }
    }
}

const PAGE: usize = 4096;

/// Emulated device memory behind a host copy. Both buffers are owned here and freed on drop, after
/// the engine has dropped its last handle (which it does only once the region is deregistered).
pub struct EmulatedDevice {
    host: Buffer,
    device: Buffer,
    len: usize,
    /// What the block tells NICs to register; the device buffer unless a test says otherwise.
    nic_address: u64,
    /// Ranges the hooks copied.
    hook_calls: AtomicUsize,
    /// Calls of the batched hooks (`*_ranges`), each copying one or more ranges.
    batches: AtomicUsize,
    /// Named by the device buffer's address and staged, as CUDA device memory is: descriptors name
    /// the device address while the bytes move through the host copy.
    named_by_device: bool,
}

// SAFETY: the two buffers are owned by this value; their bytes are only reached through raw pointers
// (by the engine, the NIC and the helpers below).
unsafe impl Send for EmulatedDevice {}
// SAFETY: as above.
unsafe impl Sync for EmulatedDevice {}

impl EmulatedDevice {
    /// A block whose host copy holds `host` and whose device holds `device`, both page-aligned, as a
    /// staging buffer and device memory are.
    pub fn new(host: &[u8], device: &[u8]) -> Arc<Self> {
        EmulatedDevice::with_device_skew(host, device, 0)
    }

    /// [`new`](Self::new) with the device memory starting `skew` bytes into a page.
    pub fn with_device_skew(host: &[u8], device: &[u8], skew: usize) -> Arc<Self> {
        assert_eq!(host.len(), device.len());
        let (host, device) = (Buffer::new(host, 0), Buffer::new(device, skew));
        Arc::new(EmulatedDevice {
            nic_address: device.first as u64,
            len: device.layout.size() - skew,
            host,
            device,
            hook_calls: AtomicUsize::new(0),
            batches: AtomicUsize::new(0),
            named_by_device: false,
        })
    }

    /// Staged memory named by its device address, as a CUDA region is named by its device pointer
    /// (`MemoryBlock::address`): no NIC registration may answer that name with the host copy.
    pub fn named_by_device(host: &[u8], device: &[u8]) -> Arc<Self> {
        let mut block = Arc::into_inner(EmulatedDevice::new(host, device)).expect("just made");
        block.named_by_device = true;
        Arc::new(block)
    }

    /// Staged memory named by its device address (as [`named_by_device`](Self::named_by_device)),
    /// whose device memory is a memory file that the block exports as a dma-buf (udmabuf), as a GPU
    /// driver exports CUDA memory: a NIC that takes dma-bufs reaches it directly.
    pub fn behind_dma_buf(host: &[u8], device: &[u8]) -> Arc<Self> {
        assert_eq!(host.len(), device.len());
        let device = Buffer::memfd(device);
        Arc::new(EmulatedDevice {
            nic_address: device.first as u64,
            len: host.len(),
            host: Buffer::new(host, 0),
            device,
            hook_calls: AtomicUsize::new(0),
            batches: AtomicUsize::new(0),
            named_by_device: true,
        })
    }

    /// The device buffer's address.
    pub fn device_address(&self) -> u64 {
        self.device.first as u64
    }

    /// A block whose device memory no NIC can reach: it names an address where nothing is mapped, so
    /// registering it fails, as it does for a NIC without access to a GPU's memory. The device
    /// buffer is still reached through the hooks.
    pub fn unreachable_by_nics(host: &[u8], device: &[u8]) -> Arc<Self> {
        let mut block = Arc::into_inner(EmulatedDevice::new(host, device)).expect("just made");
        block.nic_address = 0;
        Arc::new(block)
    }

    pub fn device_bytes(&self) -> Vec<u8> {
        // SAFETY: the device buffer holds `len` bytes this value owns; no transfer is in flight when a
        // test looks.
        unsafe { std::slice::from_raw_parts(self.device.first, self.len) }.to_vec()
    }

    pub fn host_bytes(&self) -> Vec<u8> {
        // SAFETY: as for `device_bytes`.
        unsafe { std::slice::from_raw_parts(self.host.first, self.len) }.to_vec()
    }

    pub fn set_device(&self, bytes: &[u8]) {
        assert_eq!(bytes.len(), self.len);
        // SAFETY: the device buffer holds `len` bytes this value owns; nothing else touches them
        // meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.device.first, self.len) };
    }

    pub fn hook_calls(&self) -> usize {
        self.hook_calls.load(Ordering::SeqCst)
    }

    pub fn batches(&self) -> usize {
        self.batches.load(Ordering::SeqCst)
    }
}

// SAFETY: the host and device buffers hold `len` bytes each, owned by the block and valid while it
// lives; `nic_address` is the device buffer, or (`unreachable_by_nics`) an address no NIC can
// register, which is then never reached.
unsafe impl MemoryBlock for EmulatedDevice {
    fn as_ptr(&self) -> *mut u8 {
        self.host.first
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> &str {
        "test (emulated device memory)"
    }
    fn address(&self) -> u64 {
        match self.named_by_device {
            true => self.device.first as u64,
            false => self.host.first as u64,
        }
    }
    fn dma_buf(&self) -> Option<ferry::Result<ferry::DmaBuf>> {
        self.device.memfd.as_ref().map(|_| self.device.dma_buf())
    }
    fn dma_view(&self) -> DmaView {
        match self.named_by_device {
            true => DmaView::Staged,
            false => DmaView::Device {
                nic_address: self.nic_address,
            },
        }
    }
    fn commit_written(&self, offset: usize, len: usize, _durability: Durability) -> ferry::Result<()> {
        self.hook_calls.fetch_add(1, Ordering::SeqCst);
        assert!(offset + len <= self.len, "a hook past the block's end");
        // SAFETY: both ranges lie inside buffers of `len` bytes that this value owns.
        unsafe { std::ptr::copy_nonoverlapping(self.host.first.add(offset), self.device.first.add(offset), len) };
        Ok(())
    }
    fn prepare_read(&self, offset: usize, len: usize) -> ferry::Result<()> {
        self.hook_calls.fetch_add(1, Ordering::SeqCst);
        assert!(offset + len <= self.len, "a hook past the block's end");
        // SAFETY: as in `commit_written`.
        unsafe { std::ptr::copy_nonoverlapping(self.device.first.add(offset), self.host.first.add(offset), len) };
        Ok(())
    }
    fn commit_written_ranges(&self, ranges: &[(usize, usize)], durability: Durability) -> ferry::Result<()> {
        self.batches.fetch_add(1, Ordering::SeqCst);
        ranges
            .iter()
            .try_for_each(|&(offset, len)| self.commit_written(offset, len, durability))
    }
    fn prepare_read_ranges(&self, ranges: &[(usize, usize)]) -> ferry::Result<()> {
        self.batches.fetch_add(1, Ordering::SeqCst);
        ranges
            .iter()
            .try_for_each(|&(offset, len)| self.prepare_read(offset, len))
    }
}
