//! CUDA IPC: device memory of one process opened by another process of the same host, so that a
//! same-host transfer into a GPU region is one device-to-device copy (or one copy between the GPU
//! and the caller's host memory), never a bounce through host memory.
//!
//! The target exports an allocation (`cuIpcGetMemHandle`): 64 opaque bytes that open the *whole*
//! allocation, for reading and writing, in any process of the host that reaches the device. So a
//! region is lent this way only when it is a whole allocation of its own ([`lend_check`]): a region
//! borrowed from part of a larger allocation (a tensor carved out of PyTorch's caching allocator)
//! would open its neighbours too, and memory of the virtual memory API (`cuMemMap`) has no such
//! handle. Those regions keep the staged path, and the route says why.
//!
//! The initiator opens the handle once per region and link ([`IpcWindow::open`]), on the device
//! whose PCI address the target named (ordinals differ between processes under
//! `CUDA_VISIBLE_DEVICES`), and copies with `cuMemcpyAsync` on a stream of its own, one
//! synchronisation per batch: when [`IpcWindow::copy`] returns, a write's bytes are in the
//! target's device memory.

use std::sync::Arc;

use cudarc::driver::sys;
use ferry_core::{Error, Result};

use crate::device::{Copies, CudaDevice};
use crate::error::check;
use crate::pointer::{PointerKind, classify};

/// Bytes of a CUDA IPC memory handle.
pub const HANDLE_LEN: usize = 64;

/// What the target sends for a region it lends by CUDA IPC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcExport {
    /// `cuIpcGetMemHandle` of the region's allocation.
    pub handle: [u8; HANDLE_LEN],
    /// Where the region starts in that allocation.
    pub offset: u64,
    /// The PCI address of the device the memory is on, "0000:3b:00.0".
    pub pci_address: String,
}

/// Whether `[ptr, ptr + len)`, which the driver classified as `kind`, may be lent by CUDA IPC, and
/// at which offset of its allocation it starts (see the module's documentation).
pub fn lend_check(kind: &PointerKind, ptr: u64, len: u64) -> Result<u64> {
    let PointerKind::Device {
        context, start, size, ..
    } = *kind
    else {
        return Err(Error::InvalidArgument(format!(
            "{ptr:#x} is not CUDA device memory: nothing to lend by CUDA IPC"
        )));
    };
    if context == 0 {
        return Err(Error::Unsupported(format!(
            "{ptr:#x} is memory of CUDA's virtual memory API (cuMemMap), which has no CUDA IPC handle"
        )));
    }
    if ptr != start || len != size {
        return Err(Error::Unsupported(format!(
            "[{ptr:#x}, +{len}) is part of a larger CUDA allocation [{start:#x}, +{size}): a CUDA IPC handle \
             would open all of it to the peer; register the whole allocation to lend it"
        )));
    }
    Ok(ptr - start)
}

/// Exports the allocation of `[ptr, ptr + len)` for another process of this host, if
/// [`lend_check`] allows it.
pub fn export(ptr: u64, len: u64) -> Result<IpcExport> {
    // Without a driver nothing is device memory: the reason is the driver's absence.
    crate::driver::driver()?;
    let kind = classify(ptr, len)?;
    let offset = lend_check(&kind, ptr, len)?;
    let PointerKind::Device { ordinal, .. } = kind else {
        return Err(Error::Internal(
            "lend_check passed memory that is not device memory".into(),
        ));
    };
    let device = CudaDevice::open(u32::try_from(ordinal).unwrap_or(u32::MAX))?;
    device.bind()?;
    let mut handle = sys::CUipcMemHandle {
        reserved: [0; HANDLE_LEN],
    };
    // SAFETY: `handle` is valid for writes; `ptr` is the first address of a device allocation the
    // driver vouched for (above), in the context now current.
    check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut handle, ptr) })?;
    Ok(IpcExport {
        handle: handle.reserved.map(|b| b as u8),
        offset,
        pci_address: device.pci_address().to_string(),
    })
}

/// One copy between this process's memory and an [`IpcWindow`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowCopy {
    /// This process's address: device memory (a CUDA pointer) or host memory, which unified
    /// addressing tells apart.
    pub local: u64,
    /// The offset in the window.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Into the window (a write) or out of it (a read).
    pub into_window: bool,
}

/// A peer's device memory, opened in this process.
pub struct IpcWindow {
    /// What `cuIpcOpenMemHandle` returned: the allocation's first address here.
    base: sys::CUdeviceptr,
    /// The region's offset in the allocation, and its length.
    offset: u64,
    len: u64,
    copies: Copies,
    /// Dropped last: the fields above are driver objects of its context.
    device: Arc<CudaDevice>,
}

// SAFETY: driver handles, usable from any thread once the context is bound (every use binds it);
// copies are serialised by `copies`' lock.
unsafe impl Send for IpcWindow {}
// SAFETY: as above.
unsafe impl Sync for IpcWindow {}

impl std::fmt::Debug for IpcWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcWindow")
            .field("device", &self.device.pci_address())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl IpcWindow {
    /// Opens a peer's export of a region of `len` bytes on the device it names.
    pub fn open(export: &IpcExport, len: u64) -> Result<Self> {
        let device = CudaDevice::by_pci_address(&export.pci_address)?;
        // Made before the handle is opened: nothing may fail between opening it and the window that
        // closes it on drop.
        let copies = Copies::new(&device)?;
        device.bind()?;
        let handle = sys::CUipcMemHandle {
            reserved: export.handle.map(|b| b as std::ffi::c_char),
        };
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `base` is valid for writes; the handle is 64 bytes the driver parses and checks
        // (an invalid one is an error, not undefined behaviour); the context is current.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                handle,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
            )
        })?;
        let window = IpcWindow {
            base,
            offset: export.offset,
            len,
            copies,
            device,
        };
        let (mut start, mut size) = (0, 0usize);
        // SAFETY: both outputs are valid for writes; `base` was just mapped in this context.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut start, &mut size, base)
        })?;
        match export.offset.checked_add(len) {
            Some(end) if len > 0 && end <= size as u64 => Ok(window),
            _ => Err(Error::Protocol(format!(
                "the peer lent a CUDA allocation of {size} bytes for a region of {len} at offset {}",
                export.offset
            ))),
        }
    }

    /// The region's bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty (never: `open` refuses that).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Queues every copy on the window's stream and waits for all of them.
    ///
    /// # Safety
    ///
    /// Each `local` range must be memory of this process that stays valid (and, for a read, is
    /// written by nothing else) until this returns.
    pub unsafe fn copy(&self, copies: &[WindowCopy]) -> Result<()> {
        for c in copies {
            if c.offset.checked_add(c.len).is_none_or(|end| end > self.len) {
                return Err(Error::InvalidArgument(format!(
                    "[{}, +{}) is outside the peer's region of {} bytes",
                    c.offset, c.len, self.len
                )));
            }
        }
        self.copies.run(|stream| {
            for c in copies.iter().filter(|c| c.len > 0) {
                let remote = self.base + self.offset + c.offset;
                let (dst, src) = match c.into_window {
                    true => (remote, c.local),
                    false => (c.local, remote),
                };
                // SAFETY: the remote range lies in the opened allocation (checked above and in
                // `open`), the local one is valid for the copy's length (the caller's promise);
                // unified addressing lets the driver tell device from host memory; `run` waits for
                // the stream before anything can be freed.
                check("cuMemcpyAsync", unsafe {
                    sys::cuMemcpyAsync(dst, src, c.len as usize, stream)
                })?;
            }
            Ok(())
        })
    }
}

impl Drop for IpcWindow {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: `base` came from `cuIpcOpenMemHandle` and is closed once; no copy is in flight
        // (`copy` waits for its stream before it returns).
        if let Err(e) = check("cuIpcCloseMemHandle", unsafe { sys::cuIpcCloseMemHandle(self.base) }) {
            tracing::warn!(error = %e, "closing a peer's CUDA memory failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(start: u64, size: u64, context: usize) -> PointerKind {
        PointerKind::Device {
            ordinal: 0,
            context,
            start,
            size,
        }
    }

    #[test]
    fn a_whole_allocation_is_lent_and_nothing_less() {
        assert_eq!(lend_check(&device(0x7000_0000, 4096, 1), 0x7000_0000, 4096).unwrap(), 0);
        // Part of a larger allocation: the handle would open the neighbours.
        let tail = lend_check(&device(0x7000_0000, 8192, 1), 0x7000_1000, 4096).unwrap_err();
        assert!(
            matches!(tail, Error::Unsupported(ref m) if m.contains("larger CUDA allocation")),
            "{tail}"
        );
        let head = lend_check(&device(0x7000_0000, 8192, 1), 0x7000_0000, 4096).unwrap_err();
        assert!(matches!(head, Error::Unsupported(_)), "{head}");
        // The virtual memory API's memory belongs to no context and has no IPC handle.
        let vmm = lend_check(&device(0x7000_0000, 4096, 0), 0x7000_0000, 4096).unwrap_err();
        assert!(
            matches!(vmm, Error::Unsupported(ref m) if m.contains("cuMemMap")),
            "{vmm}"
        );
        let host = lend_check(&PointerKind::Host, 0x1000, 4096).unwrap_err();
        assert!(matches!(host, Error::InvalidArgument(_)), "{host}");
    }

    #[test]
    fn without_a_driver_nothing_is_exported_or_opened() {
        if crate::driver().is_ok() {
            return;
        }
        assert!(matches!(export(0x7000_0000, 4096), Err(Error::Unsupported(_))));
        let export = IpcExport {
            handle: [7; HANDLE_LEN],
            offset: 0,
            pci_address: "0000:3b:00.0".into(),
        };
        assert!(matches!(IpcWindow::open(&export, 4096), Err(Error::Unsupported(_))));
    }
}
