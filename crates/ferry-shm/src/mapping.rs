//! The initiator's mapping of a region the target lent it: a memory file mapped here, or (with the
//! `cuda` feature) GPU memory opened here by its CUDA IPC handle, which only the device's copies reach.
//!
//! A mapping is made once per region and link; READ and WRITE are then plain copies between the
//! caller's memory and the mapping, with no system call. Before mapping, the initiator checks that
//! the file is sealed against shrinking and is as long as the target says: a target that could cut
//! the file short would make the initiator fault on the missing pages.
//!
//! Every copy holds a permit of the mapping's own access guard. Giving the mapping back (the target
//! asks for it when the region is deregistered or the peer's grant on it is revoked, and the link's
//! end gives back all of them) closes the guard, waits for the copies in progress, and unmaps; only
//! then is the target told, so that once the target has the answer no copy of this process touches
//! the region again.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

#[cfg(feature = "cuda")]
use std::sync::Arc;

use ferry_core::{AccessGuard, Error, Permit, RegionKey, Result};

/// A region of the target, mapped into this process.
pub(crate) struct Mapping {
    /// The key the target named the region by, to this peer.
    pub key: RegionKey,
    /// The mapping's first byte; null for device memory.
    ptr: *mut u8,
    len: usize,
    /// The peer's GPU memory, opened here; `None` for a memory file, and once given back.
    #[cfg(feature = "cuda")]
    device: std::sync::Mutex<Option<Arc<ferry_cuda::ipc::IpcWindow>>>,
    writable: bool,
    users: AccessGuard,
    unmapped: AtomicBool,
}

// SAFETY: the mapping is process-wide memory reached only through raw pointers, by copies that hold a
// permit of `users`; it is unmapped once, after `users` is closed and drained.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of the memory file `fd`, writable if the target lent it so.
    pub fn new(key: RegionKey, fd: OwnedFd, len: u64, writable: bool) -> Result<Self> {
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l > 0)
            .ok_or_else(|| Error::Protocol(format!("the target lent a region of {len} bytes")))?;
        // SAFETY: F_GET_SEALS on an open descriptor only reads its seals.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(Error::Protocol(
                "the target lent a memory file that may shrink under the mapping; refusing to map it".into(),
            ));
        }
        // SAFETY: an all-zero stat is a valid buffer for fstat to fill.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `stat` is valid for writes; the descriptor is open.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) } != 0 {
            return Err(Error::io(
                "reading the lent memory file's size",
                std::io::Error::last_os_error(),
            ));
        }
        if (stat.st_size as u64) < len as u64 {
            return Err(Error::Protocol(format!(
                "the target lent a memory file of {} bytes for a region of {len}",
                stat.st_size
            )));
        }
        let prot = match writable {
            true => libc::PROT_READ | libc::PROT_WRITE,
            false => libc::PROT_READ,
        };
        // SAFETY: a fresh shared mapping of `len` bytes of the file, which is at least that long and
        // cannot shrink (checked above); the kernel picks the address.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io(
                "mapping a region the target lent",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(Mapping {
            key,
            ptr: ptr.cast(),
            len,
            #[cfg(feature = "cuda")]
            device: std::sync::Mutex::new(None),
            writable,
            users: AccessGuard::new(),
            unmapped: AtomicBool::new(false),
        })
    }

    /// The peer's GPU memory, opened here by its handle (always writable: the target lends device
    /// memory only to peers that may read and write it).
    #[cfg(feature = "cuda")]
    pub fn device(key: RegionKey, window: ferry_cuda::ipc::IpcWindow) -> Result<Self> {
        let len = usize::try_from(window.len())
            .map_err(|_| Error::Protocol(format!("the target lent a region of {} bytes", window.len())))?;
        Ok(Mapping {
            key,
            ptr: std::ptr::null_mut(),
            len,
            device: std::sync::Mutex::new(Some(Arc::new(window))),
            writable: true,
            users: AccessGuard::new(),
            unmapped: AtomicBool::new(false),
        })
    }

    /// Whether this is device memory, which [`at`](Self::at) cannot reach.
    pub fn is_device(&self) -> bool {
        self.ptr.is_null()
    }

    /// The opened device memory, until it is given back.
    #[cfg(feature = "cuda")]
    pub fn window(&self) -> Option<Arc<ferry_cuda::ipc::IpcWindow>> {
        self.device.lock().ok().and_then(|w| w.clone())
    }

    /// A permit to copy, while the mapping is not being given back.
    pub fn enter(&self) -> Option<Permit<'_>> {
        self.users.enter()
    }

    /// Checks that `[offset, offset + len)` lies in the mapping (and that it may be written).
    pub fn check(&self, offset: u64, len: u64, write: bool) -> Result<()> {
        if write && !self.writable {
            return Err(Error::PermissionDenied(format!(
                "region {:?} was lent to this peer for reading only",
                self.key
            )));
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "[{offset}, +{len}) is outside region {:?} ({} bytes)",
                self.key, self.len
            ))),
        }
    }

    /// The address of `offset` in this process, for a copy under a permit ([`enter`](Self::enter))
    /// of a range [`check`](Self::check) passed, of a memory file's mapping (not device memory).
    pub fn at(&self, offset: u64) -> *mut u8 {
        self.ptr.wrapping_add(offset as usize)
    }

    /// Refuses new copies, waits for those in progress, and unmaps.
    pub async fn give_back(&self) {
        self.users.close();
        self.users.drained().await;
        self.unmap();
    }

    fn unmap(&self) {
        if self.is_device() {
            // The window closes when the last copy holding it ends (each holds it under a permit,
            // so none does once `users` is drained).
            #[cfg(feature = "cuda")]
            if let Ok(mut window) = self.device.lock() {
                window.take();
            }
            return;
        }
        if !self.unmapped.swap(true, Ordering::AcqRel) {
            // SAFETY: `ptr`/`len` are the mapping made in `new`, unmapped only here, once; every copy
            // holds a permit of `users`, which is closed and drained (or the last reference is gone).
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        self.users.close();
        self.unmap();
    }
}
