//! Engine-allocated host memory (HIXL `MallocMem`): page-aligned, backed by a memfd so that it can be
//! shared with another process on the same host (the shared-memory transport maps the same fd).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use ferry_core::{Error, MemoryBlock, Result};

/// Allocations from this size up ask for transparent huge pages.
const HUGE_PAGE: usize = 2 << 20;

/// Page-aligned host memory backed by an anonymous memory file.
pub struct HostAllocation {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is process-wide and only accessed through raw pointers.
unsafe impl Send for HostAllocation {}
// SAFETY: as above.
unsafe impl Sync for HostAllocation {}

impl HostAllocation {
    /// Allocates `len` zeroed bytes.
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("cannot allocate zero bytes".into()));
        }
        let name = c"ferry-host";
        // SAFETY: `name` is a valid NUL-terminated string; the call has no other preconditions.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(os_error("memfd_create"));
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len)
            .map_err(|_| Error::InvalidArgument(format!("{len} bytes is more than a file can hold")))?;
        // SAFETY: `fd` is a valid memfd we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(os_error("sizing the memfd"));
        }
        // A peer of this host may map the file (see `shared_file`): it must never shrink under that
        // mapping, nor take other seals from anyone the descriptor is passed to.
        // SAFETY: `fd` is a valid memfd created with sealing allowed.
        if unsafe {
            libc::fcntl(
                fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            )
        } != 0
        {
            return Err(os_error("sealing the memfd"));
        }
        // SAFETY: a fresh shared mapping of `len` bytes of our memfd; the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_error("mapping the memfd"));
        }
        if len >= HUGE_PAGE {
            // Fewer, larger pages for a NIC to pin and map, where the kernel backs shared memory with
            // huge pages on request (`/sys/kernel/mm/transparent_hugepage/shmem_enabled` is
            // `advise`). Advice only: without it the memory works the same.
            // SAFETY: advice on the mapping just made, of its own length.
            if unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) } != 0 {
                tracing::debug!(error = %std::io::Error::last_os_error(), "no huge pages for a host allocation");
            }
        }
        Ok(HostAllocation {
            ptr: ptr.cast(),
            len,
            fd,
        })
    }

    /// The memfd behind the allocation, for sharing with another process.
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }
}

fn os_error(what: &str) -> Error {
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ENOMEM) {
        Error::ResourceExhausted(format!("{what}: out of memory"))
    } else {
        Error::io(what, e)
    }
}

impl Drop for HostAllocation {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are the mapping made in `new`; the region's access guard guarantees no access is in
        // progress once the block is dropped.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

// SAFETY: the mapping is `len` bytes, readable and writable, and lives until drop.
unsafe impl MemoryBlock for HostAllocation {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> &str {
        "host (memfd)"
    }
    fn owns_memory(&self) -> bool {
        // An anonymous file made for this block: others reach it only through the block (its
        // descriptor, lent to peers under the region's access guard).
        true
    }
    fn shared_file(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        Some(self.fd.as_fd())
    }
}
