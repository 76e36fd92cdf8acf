//! Persistent regions: a file mapped shared, so that a write can be made durable.
//!
//! Where the file system supports DAX, the mapping is made with `MAP_SHARED_VALIDATE | MAP_SYNC`: the
//! page tables then point at persistent memory, and a write is persistent once its cache lines are
//! written back (`clwb`, else `clflushopt`, else `clflush`) and a store fence has run. Elsewhere the
//! mapping is plain `MAP_SHARED` and a write is persistent once `msync(MS_SYNC)` over its pages has
//! returned. Either way only the written range is flushed, never the whole region.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Instant;

use ferry_core::memory::page_size;
use ferry_core::{DmaView, Error, MemoryBlock, PersistStats, Result};

use crate::sigbus;

/// How writes to a [`FileMapping`] reach the persistence domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushMethod {
    /// DAX mapping (`MAP_SYNC`): cache-line write-back and a store fence.
    CacheFlush,
    /// Page-cache mapping: `msync(MS_SYNC)` over the written pages.
    Msync,
}

/// A range of a file (or a device-DAX character device) mapped shared into this process.
pub struct FileMapping {
    ptr: *mut u8,
    len: usize,
    offset: u64,
    method: FlushMethod,
    kind: String,
    path: PathBuf,
    stats: [AtomicU64; 3],
    skip_persist: bool,
    // Dropped before the mapping is unmapped (see `Drop`).
    guard: Option<sigbus::Guard>,
    file: File,
}

// SAFETY: the mapping is process-wide and only accessed through raw pointers.
unsafe impl Send for FileMapping {}
// SAFETY: as above.
unsafe impl Sync for FileMapping {}

/// The size of what `file` holds: its length, or for a device-DAX character device the size its
/// sysfs entry reports.
fn backing_size(file: &File, path: &Path) -> Result<u64> {
    let meta = file
        .metadata()
        .map_err(|e| Error::io(format_args!("reading {}'s size", path.display()), e))?;
    if !meta.file_type().is_char_device() {
        return Ok(meta.len());
    }
    let rdev = meta.rdev();
    let sysfs = format!("/sys/dev/char/{}:{}/size", libc::major(rdev), libc::minor(rdev));
    std::fs::read_to_string(&sysfs)
        .map_err(|e| {
            Error::io(
                format_args!("reading {sysfs} (is {} a device-DAX device?)", path.display()),
                e,
            )
        })?
        .trim()
        .parse()
        .map_err(|_| Error::InvalidArgument(format!("{sysfs} holds no size")))
}

fn is_char_device(file: &File) -> bool {
    file.metadata().is_ok_and(|m| m.file_type().is_char_device())
}

impl FileMapping {
    /// Maps `len` bytes of `path` from `offset` (a multiple of the page size; of the device's
    /// alignment for device DAX). The file must already be at least `offset + len` bytes long: a
    /// mapping past its end would fault on access.
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
        let size = backing_size(&file, path)?;
        let end = offset
            .checked_add(len as u64)
            .ok_or_else(|| Error::InvalidArgument("offset + length overflows".into()))?;
        if end > size {
            return Err(Error::OutOfBounds(format!(
                "{} has {size} bytes; mapping [{offset}, {end}) would reach past its end (extend the file first)",
                path.display()
            )));
        }
        let off = libc::off_t::try_from(offset).map_err(|_| Error::InvalidArgument("offset too large".into()))?;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // MAP_SYNC only where this code can write cache lines back itself (x86_64); elsewhere msync,
        // which on a DAX mapping has the kernel write them back.
        let dax = if cfg!(target_arch = "x86_64") {
            // SAFETY: a fresh shared mapping of a range of our open file that lies inside it; the
            // kernel chooses the address.
            unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    prot,
                    libc::MAP_SHARED_VALIDATE | libc::MAP_SYNC,
                    file.as_raw_fd(),
                    off,
                )
            }
        } else {
            libc::MAP_FAILED
        };
        let (ptr, method) = if dax != libc::MAP_FAILED {
            (dax, FlushMethod::CacheFlush)
        } else {
            // No DAX here (EOPNOTSUPP): the page cache, flushed with msync.
            // SAFETY: as above, without MAP_SYNC.
            let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, file.as_raw_fd(), off) };
            if p == libc::MAP_FAILED {
                let hint = if is_char_device(&file) {
                    " (device DAX maps whole pages of its alignment, usually 2 MiB: check offset and length)"
                } else {
                    ""
                };
                return Err(Error::io(
                    format_args!("mapping {}{hint}", path.display()),
                    std::io::Error::last_os_error(),
                ));
            }
            (p, FlushMethod::Msync)
        };
        let ptr: *mut u8 = ptr.cast();
        let guard = match sigbus::Guard::new(ptr, len) {
            Ok(g) => g,
            Err(e) => {
                // SAFETY: the mapping made just above, not yet shared with anything.
                unsafe { libc::munmap(ptr.cast(), len) };
                return Err(e);
            }
        };
        let kind = match method {
            FlushMethod::CacheFlush => format!("file (MAP_SYNC, {})", flush_instruction()),
            FlushMethod::Msync => "file (msync)".to_string(),
        };
        tracing::debug!(path = %path.display(), offset, len, kind, "file mapped");
        Ok(FileMapping {
            ptr,
            len,
            offset,
            method,
            kind,
            path: path.to_path_buf(),
            stats: Default::default(),
            skip_persist: skip_persist_switch(),
            guard: Some(guard),
            file,
        })
    }

    /// How writes become persistent.
    pub fn method(&self) -> FlushMethod {
        self.method
    }

    /// The write-back instruction a DAX mapping uses (`clwb`, `clflushopt` or `clflush`), or `msync`.
    pub fn flush_instruction(&self) -> &'static str {
        match self.method {
            FlushMethod::CacheFlush => flush_instruction(),
            FlushMethod::Msync => "msync",
        }
    }

    fn lost(&self, what: &str) -> Error {
        Error::Io {
            kind: std::io::ErrorKind::InvalidData,
            message: format!(
                "{} {what}: the region's bytes are no longer the file's; deregister it (and register the file again)",
                self.path.display()
            ),
        }
    }

    /// Whether a fault already swapped the mapping for zero pages (no system call).
    fn check_guard(&self) -> Result<()> {
        match &self.guard {
            Some(guard) if guard.is_lost() => Err(self.lost("shrank while mapped (a page past its end was touched)")),
            _ => Ok(()),
        }
    }

    fn persist_batch(&self, ranges: &[(usize, usize)]) -> Result<()> {
        let unit = match self.method {
            FlushMethod::Msync => page_size(),
            FlushMethod::CacheFlush => CACHE_LINE,
        };
        for (start, end) in merged(ranges, unit, self.len) {
            match self.method {
                FlushMethod::Msync => self.msync(start, end)?,
                FlushMethod::CacheFlush => flush_cache_lines(self.ptr.wrapping_add(start), end - start),
            }
        }
        Ok(())
    }

    /// Counts one persisted batch of `ranges`, begun at `began`, in the stats.
    fn count_persisted(&self, ranges: &[(usize, usize)], began: Instant) {
        let [batches, bytes, nanos] = &self.stats;
        batches.fetch_add(1, Ordering::Relaxed);
        bytes.fetch_add(ranges.iter().map(|r| r.1 as u64).sum(), Ordering::Relaxed);
        nanos.fetch_add(began.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    fn msync(&self, start: usize, end: usize) -> Result<()> {
        // A NIC that wrote these pages (RDMA into the page cache) did so through the kernel, without
        // marking them dirty, and msync writes back dirty pages only. An atomic OR of zero into each
        // page is a CPU write that changes no byte, even racing another writer, and dirties the page.
        let mut page = start;
        while page < end {
            // SAFETY: `page` lies inside the mapping (`merged` clamps to its length); an AtomicU8 has no
            // alignment requirement; the caller holds a permit of the region's access guard.
            unsafe { AtomicU8::from_ptr(self.ptr.add(page)) }.fetch_or(0, Ordering::Relaxed);
            page += page_size();
        }
        self.msync_dirty(start, end)
    }

    /// `msync(MS_SYNC)` of `[start, end)`, whose written pages are already dirty in the page cache.
    fn msync_dirty(&self, start: usize, end: usize) -> Result<()> {
        // SAFETY: [start, end) is page-aligned and inside our mapping; msync only writes back.
        let r = unsafe { libc::msync(self.ptr.add(start).cast(), end - start, libc::MS_SYNC) };
        if r != 0 {
            return Err(Error::io(
                format_args!("msync of {} for a persistent write", self.path.display()),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

/// The line size the cache write-back instructions work in.
const CACHE_LINE: usize = 64;

/// `ranges` widened to whole `unit`s, clamped to `limit`, sorted and merged where they touch: each
/// page (or line) is flushed once per batch, and each stretch with one call.
fn merged(ranges: &[(usize, usize)], unit: usize, limit: usize) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize)> = ranges
        .iter()
        .filter(|&&(offset, len)| len > 0 && offset < limit)
        .map(|&(offset, len)| {
            let end = offset.saturating_add(len).min(limit);
            (offset / unit * unit, end.div_ceil(unit).saturating_mul(unit).min(limit))
        })
        .collect();
    spans.sort_unstable();
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(spans.len());
    for (start, end) in spans {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// The test-only switch that turns persisting into a no-op, so that the power-cut rig can show that
/// its check catches a target that does not persist. Compiled in only with the `fault-injection`
/// feature, and read once per mapping.
fn skip_persist_switch() -> bool {
    #[cfg(feature = "fault-injection")]
    {
        let on = std::env::var_os("FERRY_FAULT_SKIP_PERSIST").is_some_and(|v| v == "1");
        if on {
            tracing::warn!("FERRY_FAULT_SKIP_PERSIST=1: persistent writes to file regions will NOT be persisted");
        }
        on
    }
    #[cfg(not(feature = "fault-injection"))]
    false
}

/// The cache-line write-back instructions, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriteBack {
    Clwb,
    Clflushopt,
    Clflush,
}

impl WriteBack {
    fn name(self) -> &'static str {
        match self {
            WriteBack::Clwb => "clwb",
            WriteBack::Clflushopt => "clflushopt",
            WriteBack::Clflush => "clflush",
        }
    }

    /// The best this CPU has; CPUID runs once per process (under a hypervisor it traps, so it stays
    /// off the flush path).
    fn detect() -> WriteBack {
        static CHOSEN: std::sync::OnceLock<WriteBack> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                // CPUID leaf 7 (where the CPU has it): EBX bit 24 is CLWB, bit 23 CLFLUSHOPT.
                let ebx = if std::arch::x86_64::__get_cpuid_max(0).0 >= 7 {
                    std::arch::x86_64::__cpuid_count(7, 0).ebx
                } else {
                    0
                };
                if ebx & (1 << 24) != 0 {
                    WriteBack::Clwb
                } else if ebx & (1 << 23) != 0 {
                    WriteBack::Clflushopt
                } else {
                    WriteBack::Clflush
                }
            }
            // Never used: other architectures map without MAP_SYNC and persist with msync.
            #[cfg(not(target_arch = "x86_64"))]
            WriteBack::Clflush
        })
    }
}

/// The write-back instruction's name, for `Region::kind` and logs.
fn flush_instruction() -> &'static str {
    WriteBack::detect().name()
}

/// Writes back every cache line of `[ptr, ptr + len)` and fences.
fn flush_cache_lines(ptr: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let start = (ptr as usize) & !(CACHE_LINE - 1);
        let end = ptr as usize + len;
        // `clflush` is in every x86_64 CPU; the newer instructions only where detected. They take an
        // address and never fault on mapped memory.
        let insn = WriteBack::detect();
        let mut line = start;
        while line < end {
            let p = line as *const u8;
            // SAFETY: `p` lies in a cache line of our mapping; write-back instructions only move the
            // line's contents towards memory.
            unsafe {
                match insn {
                    WriteBack::Clwb => std::arch::asm!("clwb [{0}]", in(reg) p, options(nostack, preserves_flags)),
                    WriteBack::Clflushopt => {
                        std::arch::asm!("clflushopt [{0}]", in(reg) p, options(nostack, preserves_flags))
                    }
                    WriteBack::Clflush => std::arch::x86_64::_mm_clflush(p),
                }
            }
            line += CACHE_LINE;
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
        // The guard's table entry is cleared first, so that the SIGBUS handler never remaps an address range
        // that has gone back to the kernel.
        drop(self.guard.take());
        // SAFETY: the mapping made in `open`; the region's access guard guarantees no access is in progress.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

// SAFETY: the mapping is `len` bytes, readable and writable, valid until drop (if the file shrinks, the
// SIGBUS guard swaps its pages for zero pages at the same address, so it stays valid).
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
    fn is_pmem(&self) -> bool {
        self.method == FlushMethod::CacheFlush
    }
    /// [`DmaView::Host`], for both kinds of file: the CPU reaches the bytes directly through the
    /// mapping (the page cache itself, or DAX persistent memory), with no copy in front to keep
    /// coherent, so a completed write needs no hook. A NIC that cannot pin page-cache pages reaches
    /// them through the RDMA transport's own staging buffer, which that transport owns and commits;
    /// nothing here. Persisting a page-cache file is an `msync` that may block: transports run it off
    /// the runtime when a write asks for persistence (`RegionEntry::staging_may_block`), whatever the
    /// view.
    fn dma_view(&self) -> DmaView {
        DmaView::Host
    }
    /// Through the file for a page-cache mapping; a DAX mapping's stores reach persistent memory
    /// directly, and its flush is a cache-line write-back that costs no fault.
    fn file_writer(&self) -> Option<&dyn ferry_core::FileWriter> {
        match self.method {
            FlushMethod::Msync => Some(self),
            FlushMethod::CacheFlush => None,
        }
    }
    fn persist(&self, ranges: &[(usize, usize)]) -> Result<()> {
        self.check_backing()?;
        if self.skip_persist {
            return Ok(());
        }
        let began = Instant::now();
        self.persist_batch(ranges)?;
        self.count_persisted(ranges, began);
        // A fault while dirtying the pages means the file shrank meanwhile.
        self.check_guard()
    }
    fn persist_stats(&self) -> Option<PersistStats> {
        let [batches, bytes, nanos] = &self.stats;
        Some(PersistStats {
            batches: batches.load(Ordering::Relaxed),
            bytes: bytes.load(Ordering::Relaxed),
            nanos: nanos.load(Ordering::Relaxed),
        })
    }
    fn check_intact(&self) -> Result<()> {
        self.check_guard()
    }
    fn check_backing(&self) -> Result<()> {
        self.check_guard()?;
        let Some(guard) = &self.guard else {
            return Ok(());
        };
        let meta = self
            .file
            .metadata()
            .map_err(|e| Error::io(format_args!("checking {}", self.path.display()), e))?;
        if meta.nlink() == 0 {
            return Err(self.lost("was removed"));
        }
        if meta.file_type().is_file() && meta.len() < self.offset + self.len as u64 {
            // Swap the pages out now, before anything touches one past the new end.
            guard.abandon();
            return Err(self.lost(&format!("was truncated to {} bytes", meta.len())));
        }
        Ok(())
    }
}

impl ferry_core::FileWriter for FileMapping {
    /// `pwrite(2)` at the block's place in the file. The file is checked whole before (a write past
    /// a shrunken file's end would grow it back) and after (a truncation racing the write): either
    /// way the region is reported lost, as a copy into the mapping would have found it.
    fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_backing()?;
        self.file
            .write_all_at(src, self.offset + offset as u64)
            .map_err(|e| Error::io(format_args!("writing into {}", self.path.display()), e))?;
        self.check_backing()
    }

    fn flushed(&self) -> bool {
        self.stats[0].load(Ordering::Relaxed) > 0
    }

    /// `msync(MS_SYNC)` over the written pages, without dirtying them first: the CPU did.
    fn persist_written(&self, ranges: &[(usize, usize)]) -> Result<()> {
        self.check_backing()?;
        if self.skip_persist {
            return Ok(());
        }
        let began = Instant::now();
        for (start, end) in merged(ranges, page_size(), self.len) {
            self.msync_dirty(start, end)?;
        }
        self.count_persisted(ranges, began);
        self.check_guard()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_rounds_to_units_and_joins_neighbours() {
        assert_eq!(merged(&[(10, 5)], 4096, 1 << 20), vec![(0, 4096)]);
        assert_eq!(merged(&[(8192, 1), (0, 1), (4095, 2)], 4096, 1 << 20), vec![(0, 12288)]);
        assert_eq!(merged(&[(0, 64), (128, 64)], 64, 4096), vec![(0, 64), (128, 192)]);
        assert_eq!(merged(&[(4000, 1000)], 4096, 4500), vec![(0, 4500)]);
        assert!(merged(&[(5000, 10), (0, 0)], 4096, 4500).is_empty());
    }

    proptest::proptest! {
        #[test]
        fn merged_spans_cover_every_range_once(
            ranges in proptest::collection::vec((0usize..100_000, 1usize..20_000), 0..20),
            unit in proptest::sample::select(vec![64usize, 4096]),
        ) {
            let limit = 110_000;
            let spans = merged(&ranges, unit, limit);
            for w in spans.windows(2) {
                proptest::prop_assert!(w[0].1 < w[1].0, "spans overlap or touch: {:?}", w);
            }
            for &(offset, len) in &ranges {
                let end = (offset + len).min(limit);
                proptest::prop_assert!(
                    spans.iter().any(|&(s, e)| s <= offset && end <= e),
                    "[{}, {}) not covered by {:?}", offset, end, spans
                );
            }
            for &(s, e) in &spans {
                proptest::prop_assert!(s % unit == 0 && (e % unit == 0 || e == limit));
            }
        }
    }
}
