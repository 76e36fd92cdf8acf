//! A CUDA device opened for ferry: its primary context (the one the CUDA runtime, and so PyTorch,
//! allocates in), and the driver objects that live in it.

use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys;
use ferry_core::{Error, Result};

use crate::error::{check, cu_error};

/// One device and its retained primary context. Share it: every block on the device holds it.
pub struct CudaDevice {
    ordinal: i32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    name: String,
    pci_address: String,
}

// SAFETY: `dev` and `ctx` are driver handles; the driver API may be called with them from any
// thread (a thread binds the context before use, see `bind`).
unsafe impl Send for CudaDevice {}
// SAFETY: as above; nothing here is mutated after `open`.
unsafe impl Sync for CudaDevice {}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("pci_address", &self.pci_address)
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Opens device `ordinal`, retaining its primary context.
    pub fn open(ordinal: u32) -> Result<Arc<Self>> {
        let driver = crate::driver::driver()?;
        if ordinal as usize >= driver.devices {
            return Err(Error::InvalidArgument(format!(
                "no CUDA device {ordinal}: the driver sees {} (CUDA_VISIBLE_DEVICES applies)",
                driver.devices
            )));
        }
        let ordinal = ordinal as i32;
        let dev = result::device::get(ordinal).map_err(|e| cu_error("cuDeviceGet", e))?;
        let name = result::device::get_name(dev).map_err(|e| cu_error("cuDeviceGetName", e))?;
        let pci_address = crate::driver::pci_address(dev)?;
        // SAFETY: `dev` is a handle the driver just returned; the retain is released once, when the
        // device built from it drops (nothing below can fail).
        let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(|e| cu_error("cuDevicePrimaryCtxRetain", e))?;
        Ok(Arc::new(CudaDevice {
            ordinal,
            dev,
            ctx,
            name,
            pci_address,
        }))
    }

    /// Opens the device at PCI address `pci_address` ("0000:3b:00.0"), as another process names it:
    /// ordinals differ between processes that see different devices (`CUDA_VISIBLE_DEVICES`).
    pub fn by_pci_address(pci_address: &str) -> Result<Arc<Self>> {
        let driver = crate::driver::driver()?;
        for ordinal in 0..driver.devices {
            let dev = result::device::get(ordinal as i32).map_err(|e| cu_error("cuDeviceGet", e))?;
            if crate::driver::pci_address(dev)?.eq_ignore_ascii_case(pci_address) {
                return Self::open(ordinal as u32);
            }
        }
        Err(Error::Unsupported(format!(
            "the CUDA device at PCI address {pci_address} is not visible to this process (CUDA_VISIBLE_DEVICES              applies; it sees {} device(s))",
            driver.devices
        )))
    }

    /// Whether the device exports dma-bufs of its memory (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`).
    pub fn offers_dma_buf(&self) -> Result<bool> {
        crate::driver::attribute_of(self.dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
            .map(|v| v != 0)
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal as u32
    }

    /// "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its PCI function, "0000:3b:00.0".
    pub fn pci_address(&self) -> &str {
        &self.pci_address
    }

    /// The primary context's handle, as [`PointerKind::Device`](crate::PointerKind::Device) reports
    /// an allocation's: memory allocated in another context is not this device's to copy with.
    pub fn context_handle(&self) -> usize {
        self.ctx as usize
    }

    /// Makes the primary context current on the calling thread (a thread-local setting; cheap).
    pub(crate) fn bind(&self) -> Result<()> {
        // SAFETY: `ctx` is retained until `self` drops.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(|e| cu_error("cuCtxSetCurrent", e))
    }

    /// A stream for this device's copies, which does not wait for work on the legacy default
    /// stream (a PyTorch kernel running meanwhile does not hold ferry's copies back).
    pub(crate) fn stream(self: &Arc<Self>) -> Result<Stream> {
        self.bind()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| cu_error("cuStreamCreate", e))?;
        Ok(Stream {
            stream,
            device: self.clone(),
        })
    }

    /// `len` bytes of device memory, zeroed (a peer must not read what the memory held before).
    pub(crate) fn alloc(self: &Arc<Self>, len: usize) -> Result<DeviceAllocation> {
        self.bind()?;
        // SAFETY: the context is current; the allocation is freed in `DeviceAllocation::drop`.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(|e| cu_error(&format!("cuMemAlloc({len})"), e))?;
        let allocation = DeviceAllocation {
            ptr,
            device: self.clone(),
        };
        // SAFETY: `ptr` is `len` bytes of device memory just allocated in the current context.
        unsafe { result::memset_d8_sync(ptr, 0, len) }.map_err(|e| cu_error("cuMemsetD8", e))?;
        Ok(allocation)
    }
}

impl CudaDevice {
    /// The device's own device-to-device copy rate, in GB/s (10^9 B/s): copies of `size` bytes
    /// between two allocations, queued 16 at a time on one stream and waited for, for `duration`.
    /// What a copy between two processes' GPU memory on this device is measured against.
    pub fn copy_bandwidth(self: &Arc<Self>, size: usize, duration: std::time::Duration) -> Result<f64> {
        const QUEUED: usize = 16;
        let (src, dst) = (self.alloc(size)?, self.alloc(size)?);
        let stream = self.stream()?;
        let round = || -> Result<()> {
            for _ in 0..QUEUED {
                // SAFETY: both are `size` bytes of device memory of this context, alive until the
                // stream is waited for (below, before they drop).
                check("cuMemcpyDtoDAsync", unsafe {
                    sys::cuMemcpyDtoDAsync_v2(dst.ptr, src.ptr, size, stream.stream)
                })?;
            }
            stream.synchronize()
        };
        round()?;
        let started = std::time::Instant::now();
        let mut rounds = 0u64;
        while started.elapsed() < duration || rounds == 0 {
            round()?;
            rounds += 1;
        }
        let bytes = (rounds * QUEUED as u64 * size as u64) as f64;
        Ok(bytes / started.elapsed().as_secs_f64() / 1e9)
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // SAFETY: the retain in `open` is released once, here.
        if let Err(e) = unsafe { result::primary_ctx::release(self.dev) } {
            tracing::warn!(ordinal = self.ordinal, error = %e, "releasing a CUDA primary context failed");
        }
    }
}

/// A stream for one owner's copies (a block's, a peer window's), one batch at a time.
pub(crate) struct Copies(std::sync::Mutex<Stream>);

impl Copies {
    /// A new stream of `device` for copies.
    pub(crate) fn new(device: &Arc<CudaDevice>) -> Result<Self> {
        Ok(Copies(std::sync::Mutex::new(device.stream()?)))
    }

    /// Runs `queue` with the stream, under its lock and with its context bound, then waits for the
    /// stream: every copy queued is waited for even when a later one failed to queue, so that none
    /// still reads or writes memory once this returns. The first error wins.
    pub(crate) fn run(&self, queue: impl FnOnce(sys::CUstream) -> Result<()>) -> Result<()> {
        let stream = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        stream.device.bind()?;
        let queued = queue(stream.stream);
        let done = stream.synchronize();
        queued.and(done)
    }
}

/// A CUDA stream, destroyed on drop.
pub(crate) struct Stream {
    pub(crate) stream: sys::CUstream,
    device: Arc<CudaDevice>,
}

impl Stream {
    /// Waits for everything queued on the stream.
    pub(crate) fn synchronize(&self) -> Result<()> {
        // SAFETY: the stream lives until `self` drops.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.stream) })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: the stream was created by `CudaDevice::stream` and is destroyed once.
        if let Err(e) = unsafe { result::stream::destroy(self.stream) } {
            tracing::warn!(error = %e, "destroying a CUDA stream failed");
        }
    }
}

/// Device memory ferry allocated, freed on drop.
pub(crate) struct DeviceAllocation {
    pub(crate) ptr: sys::CUdeviceptr,
    device: Arc<CudaDevice>,
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: `ptr` came from `cuMemAlloc` and is freed once; no copy is in flight (the block
        // that owns the allocation synchronises every copy before its hooks return).
        if let Err(e) = unsafe { result::free_sync(self.ptr) } {
            tracing::warn!(error = %e, "freeing CUDA device memory failed");
        }
    }
}
