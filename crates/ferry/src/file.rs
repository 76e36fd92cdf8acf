//! Persistent regions: a file mapped shared, so that a write can be made durable (seed 002).
//!
//! Where the file system supports DAX, the mapping is made with `MAP_SHARED_VALIDATE | MAP_SYNC`: the
//! page tables then point at persistent memory, and a write is persistent once its cache lines are
//! written back (`clwb`, else `clflushopt`, else `clflush`) and a store fence has run. Elsewhere the
//! mapping is plain `MAP_SHARED` and a write is persistent once `msync(MS_SYNC)` over its pages has
//! returned. Either way only the written range is flushed, never the whole region.

use std::fs::OpenOptions;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use ferry_core::{Durability, Error, MemoryBlock, Result};

/// How writes to a [`FileMapping`] reach the persistence domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PersistMethod {
    /// DAX mapping (`MAP_SYNC`): cache-line write-back and a store fence.
    CacheFlush,
    /// Page-cache mapping: `msync(MS_SYNC)` over the written pages.
    Msync,
}

/// A range of a file mapped shared into this process.
pub struct FileMapping {
    ptr: *mut u8,
    len: usize,
    method: PersistMethod,
    kind: String,
    _file: OwnedFd,
}

// SAFETY: the mapping is process-wide and only accessed through raw pointers.
unsafe impl Send for FileMapping {}
// SAFETY: as above.
unsafe impl Sync for FileMapping {}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).unwrap_or(4096).max(4096)
}

impl FileMapping {
    /// Maps `len` bytes of `path` from `offset` (a multiple of the page size). The file must already
    /// be at least `offset + len` bytes long: a mapping past its end would fault on access.
    pub fn open(path: &Path, offset: u64, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("cannot map zero bytes".into()));
        }
        if !offset.is_multiple_of(page_size() as u64) {
            return Err(Error::InvalidArgument(format!(
                "file offset {offset} is not a multiple of the page size"
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(format_args!("opening {}", path.display()), e))?;
        let size = file
            .metadata()
            .map_err(|e| Error::io(format_args!("reading {}'s size", path.display()), e))?
            .len();
        let end = offset
            .checked_add(len as u64)
            .ok_or_else(|| Error::InvalidArgument("offset + length overflows".into()))?;
        if end > size {
            return Err(Error::OutOfBounds(format!(
                "{} has {size} bytes; mapping [{offset}, {end}) would reach past its end (extend the file first)",
                path.display()
            )));
        }
        let file: OwnedFd = file.into();
        let off = libc::off_t::try_from(offset).map_err(|_| Error::InvalidArgument("offset too large".into()))?;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: a fresh shared mapping of a range of our open file that lies inside it; the kernel
        // chooses the address.
        let dax = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED_VALIDATE | libc::MAP_SYNC,
                file.as_raw_fd(),
                off,
            )
        };
        let (ptr, method) = if dax != libc::MAP_FAILED {
            (dax, PersistMethod::CacheFlush)
        } else {
            // No DAX here (EOPNOTSUPP): the page cache, flushed with msync.
            // SAFETY: as above, without MAP_SYNC.
            let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, file.as_raw_fd(), off) };
            if p == libc::MAP_FAILED {
                return Err(Error::io(
                    format_args!("mapping {}", path.display()),
                    std::io::Error::last_os_error(),
                ));
            }
            (p, PersistMethod::Msync)
        };
        let kind = match method {
            PersistMethod::CacheFlush => format!("file (MAP_SYNC, {})", flush_instruction()),
            PersistMethod::Msync => "file (msync)".to_string(),
        };
        Ok(FileMapping {
            ptr: ptr.cast(),
            len,
            method,
            kind,
            _file: file,
        })
    }

    /// How writes become persistent.
    pub fn method(&self) -> PersistMethod {
        self.method
    }

    fn persist(&self, offset: usize, len: usize) -> Result<()> {
        match self.method {
            PersistMethod::Msync => {
                let page = page_size();
                let start = offset / page * page;
                let end = offset.saturating_add(len).min(self.len);
                // SAFETY: [start, end) lies inside our mapping (start is rounded down to the mapping's
                // page-aligned base at worst); msync only flushes.
                let r = unsafe { libc::msync(self.ptr.add(start).cast(), end - start, libc::MS_SYNC) };
                if r != 0 {
                    return Err(Error::io(
                        "msync of a persistent write",
                        std::io::Error::last_os_error(),
                    ));
                }
                Ok(())
            }
            PersistMethod::CacheFlush => {
                flush_cache_lines(self.ptr.wrapping_add(offset), len.min(self.len.saturating_sub(offset)));
                Ok(())
            }
        }
    }
}

fn flush_instruction() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        // CPUID leaf 7 (where the CPU has it): EBX bit 24 is CLWB, bit 23 CLFLUSHOPT.
        let ebx = if std::arch::x86_64::__get_cpuid_max(0).0 >= 7 {
            std::arch::x86_64::__cpuid_count(7, 0).ebx
        } else {
            0
        };
        if ebx & (1 << 24) != 0 {
            "clwb"
        } else if ebx & (1 << 23) != 0 {
            "clflushopt"
        } else {
            "clflush"
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        "msync"
    }
}

/// Writes back every cache line of `[ptr, ptr + len)` and fences.
fn flush_cache_lines(ptr: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        const LINE: usize = 64;
        let start = (ptr as usize) & !(LINE - 1);
        let end = ptr as usize + len;
        // `clflush` is in every x86_64 CPU; the newer instructions only where detected. They take an
        // address and never fault on mapped memory.
        let insn = flush_instruction();
        let mut line = start;
        while line < end {
            let p = line as *const u8;
            // SAFETY: `p` lies in a cache line of our mapping; write-back instructions only move the
            // line's contents towards memory.
            unsafe {
                match insn {
                    "clwb" => std::arch::asm!("clwb [{0}]", in(reg) p, options(nostack, preserves_flags)),
                    "clflushopt" => std::arch::asm!("clflushopt [{0}]", in(reg) p, options(nostack, preserves_flags)),
                    _ => std::arch::x86_64::_mm_clflush(p),
                }
            }
            line += LINE;
        }
        // SAFETY: a store fence has no preconditions.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ptr, len);
    }
}

impl Drop for FileMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `open`; the region's fence guarantees no access is in progress.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

// SAFETY: the mapping is `len` bytes, readable and writable, valid until drop.
unsafe impl MemoryBlock for FileMapping {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> &str {
        &self.kind
    }
    fn persistent(&self) -> bool {
        true
    }
    fn commit_written(&self, offset: usize, len: usize, durability: Durability) -> Result<()> {
        match durability {
            Durability::Completed => Ok(()),
            Durability::Persistent => self.persist(offset, len),
        }
    }
}
