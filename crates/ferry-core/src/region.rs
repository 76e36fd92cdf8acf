//! The region table: which memory a peer may reach, each region with the access guard that makes its
//! deregistration final.
//!
//! Every remote operation names a region by its [`RegionKey`] and an offset; [`RegionTable::resolve`]
//! checks the key, the bounds (overflow-safe) and the access before the first payload byte is read from
//! the network or written to memory. Local descriptors name addresses; [`RegionTable::find_local`] finds
//! the region that holds them wholly.
//!
//! Memory is touched only under a [`Permit`](crate::guard::Permit) of the region's [`AccessGuard`]:
//! CPU copies, system calls, NIC work requests and GPU copies alike. Deregistration closes the guard
//! and waits for the permits out, so that after it returns no byte of the region is touched again (see
//! [`crate::guard`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use crate::error::{Error, Result};
use crate::grants::Grants;
use crate::guard::AccessGuard;
use crate::memory::{DmaView, FileWriter, MemoryBlock};
use crate::types::{Access, Durability, PeerIdentity, RegionAd, RegionKey, TransportKind};

/// A registered region: its memory, key, access and access guard.
pub struct RegionEntry {
    key: RegionKey,
    access: Access,
    block: Arc<dyn MemoryBlock>,
    /// The block's pointer, length and address, read once: a block promises they never change
    /// ([`MemoryBlock`]'s contract), and every range of every transfer is checked and addressed by
    /// them, where a call through the block's vtable each time cost more than the check itself (a
    /// batch of 4 KiB copies over shared memory made six such calls a range).
    ptr: usize,
    len: u64,
    addr: u64,
    guard: Arc<AccessGuard>,
    transport_keys: Vec<(TransportKind, crate::TransportKey)>,
    /// Who may reach it, on an engine that authenticates its links (see [`crate::grants`]).
    grants: RwLock<Grants>,
}

impl std::fmt::Debug for RegionEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionEntry")
            .field("key", &self.key)
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("access", &self.access)
            .field("kind", &self.block.kind())
            .finish()
    }
}

impl RegionEntry {
    /// A region over `block`, not yet in any table.
    pub fn new(key: RegionKey, access: Access, block: Arc<dyn MemoryBlock>) -> Result<Self> {
        if block.is_empty() {
            return Err(Error::InvalidArgument("cannot register an empty region".into()));
        }
        Ok(RegionEntry {
            key,
            access,
            ptr: block.as_ptr() as usize,
            len: block.len() as u64,
            addr: block.address(),
            block,
            guard: Arc::new(AccessGuard::new()),
            transport_keys: Vec::new(),
            grants: RwLock::new(Grants::default()),
        })
    }

    /// What the authenticated peer `who` could do here under `grants` (the region's grants at some
    /// other time, such as before a change): its access then, to compare with [`access_for`](Self::access_for).
    pub fn access_under(&self, grants: &Grants, who: &PeerIdentity) -> Access {
        self.access.intersection(grants.for_identity(who))
    }

    /// What a peer may do here: `who` is its identity on an authenticated link, `None` on an engine
    /// open to anyone (which grants every peer the region's access).
    pub fn access_for(&self, who: Option<&PeerIdentity>) -> Access {
        match who {
            None => self.access,
            Some(who) => match self.grants.read() {
                Ok(g) => self.access.intersection(g.for_identity(who)),
                Err(_) => Access::NONE,
            },
        }
    }

    /// The grants, now.
    pub fn grants(&self) -> Grants {
        self.grants.read().map(|g| g.clone()).unwrap_or_default()
    }

    /// Changes the grants.
    pub fn update_grants(&self, change: impl FnOnce(&mut Grants)) -> Result<()> {
        let mut g = self
            .grants
            .write()
            .map_err(|_| Error::Internal("a region's grant lock was poisoned".into()))?;
        change(&mut g);
        Ok(())
    }

    /// The advert a peer (`who`, as in [`access_for`](Self::access_for)) is told of: `None` if it may
    /// do nothing here.
    pub fn advert_for(&self, who: Option<&PeerIdentity>) -> Option<RegionAd> {
        let access = self.access_for(who);
        (!access.is_none()).then(|| RegionAd {
            access,
            ..self.advert()
        })
    }

    /// Adds a transport's remote key (an RDMA rkey, for example) to what peers are told.
    pub fn with_transport_key(mut self, kind: TransportKind, key: Vec<u8>) -> Self {
        self.transport_keys.push((kind, key.into()));
        self
    }

    /// The key peers name.
    pub fn key(&self) -> RegionKey {
        self.key
    }
    /// What peers may do.
    pub fn access(&self) -> Access {
        self.access
    }
    /// The address the first byte is named by in this process ([`MemoryBlock::address`]): its
    /// pointer, except for memory named apart from its host copy (CUDA device memory). Reach the
    /// bytes through [`ptr_at`](Self::ptr_at), never through this.
    #[inline]
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Whether the region is named by its pointer ([`MemoryBlock::address`] is the default): a NIC
    /// that registers the pointer may then be named the region's address.
    pub fn named_by_pointer(&self) -> bool {
        self.addr == self.ptr as u64
    }
    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Never true: empty regions are refused.
    pub fn is_empty(&self) -> bool {
        self.block.is_empty()
    }
    /// The memory.
    pub fn block(&self) -> &Arc<dyn MemoryBlock> {
        &self.block
    }
    /// The guard every access to the memory holds a permit of.
    pub fn guard(&self) -> &Arc<AccessGuard> {
        &self.guard
    }
    /// `work` on this region under an owned permit of its guard, taken now and released when `work`
    /// returns, as a closure to run where the caller chooses: on a blocking thread, for work that may
    /// block (a GPU copy and its fence, an `msync`), so that deregistration waits for it and no async
    /// runtime thread does. `PermissionDenied` once the region is being deregistered.
    pub fn with_owned_permit<T, F>(self: &Arc<Self>, work: F) -> Result<impl FnOnce() -> T + use<T, F>>
    where
        F: FnOnce(&RegionEntry) -> T,
    {
        let permit = self.guard.enter_owned().ok_or_else(|| self.gone())?;
        let region = self.clone();
        Ok(move || {
            let result = work(&region);
            drop(permit);
            result
        })
    }
    /// What peers are told about this region.
    pub fn advert(&self) -> RegionAd {
        RegionAd {
            key: self.key,
            addr: self.addr(),
            len: self.len(),
            access: self.access,
            persistent: self.block.persistent(),
            staged: self.block.dma_view() != crate::memory::DmaView::Host,
            transport_keys: self.transport_keys.clone(),
        }
    }

    /// Checks that `[offset, offset + len)` lies inside the region (overflow-safe, `len > 0`).
    #[inline]
    pub fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if len > 0 && end <= self.len => Ok(()),
            _ => Err(self.range_error(offset, len)),
        }
    }

    /// Why [`check_range`](Self::check_range) refused `[offset, offset + len)`.
    #[cold]
    fn range_error(&self, offset: u64, len: u64) -> Error {
        if len == 0 {
            return Error::InvalidArgument("zero-length range".into());
        }
        match offset.checked_add(len) {
            Some(end) => Error::OutOfBounds(format!(
                "range [{offset}, {end}) crosses the end of region {:?} ({} bytes)",
                self.key, self.len
            )),
            None => Error::OutOfBounds(format!("offset {offset} + length {len} overflows")),
        }
    }

    /// A raw pointer to `offset`, after [`check_range`](Self::check_range) passed for the range used.
    ///
    /// The pointer may be used only while a permit of this region's [`guard`](Self::guard) is held.
    #[inline]
    pub fn ptr_at(&self, offset: u64) -> *mut u8 {
        debug_assert!(offset <= self.len());
        // `offset <= len` and the block is `len` bytes long, so the result stays in (or one past) it.
        (self.ptr as *mut u8).wrapping_add(offset as usize)
    }

    /// Copies `src` into the region at `offset` under a permit. Fails if the region is being
    /// deregistered or the range is outside it.
    pub fn copy_in(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len() as u64)?;
        let _permit = self.guard.enter().ok_or_else(|| self.gone())?;
        // SAFETY: the range is inside the block (checked above), the block is valid while the entry
        // lives, the permit keeps deregistration from completing, and `src` cannot overlap region memory
        // handed out as a slice because the engine never hands out such slices.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr_at(offset), src.len()) };
        Ok(())
    }

    /// Copies from the region at `offset` into `dst` under a permit.
    pub fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len() as u64)?;
        let _permit = self.guard.enter().ok_or_else(|| self.gone())?;
        // SAFETY: as in `copy_in`, with source and destination swapped.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr_at(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// The CRC32C of the `len` bytes at `offset`, read in place under a permit.
    pub fn crc32c(&self, offset: u64, len: u64) -> Result<u32> {
        self.check_range(offset, len)?;
        let _permit = self.guard.enter().ok_or_else(|| self.gone())?;
        // SAFETY: the range is inside the block (checked above), the block is valid while the entry
        // lives and the permit keeps deregistration from completing. The bytes are only read; a peer
        // or the owner may write them meanwhile (the sum then differs, which is what it reports).
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr_at(offset), len as usize) };
        Ok(crate::integrity::crc32c(bytes))
    }

    /// Makes the written ranges `(offset, len)` persistent in one batch, under a permit: once the
    /// region is being deregistered this fails and leaves the memory alone.
    pub fn persist(&self, ranges: &[(u64, u64)]) -> Result<()> {
        let local = self.block_ranges(ranges)?;
        let _permit = self.guard.enter().ok_or_else(|| self.gone())?;
        self.block.persist(&local)
    }

    /// The block's [`commit_written_ranges`](MemoryBlock::commit_written_ranges) for the ranges
    /// `(offset, len)` that one operation wrote, checked against the region. The caller holds a
    /// permit of the region's guard (an owned one, where this runs on a blocking thread).
    pub fn commit_written_ranges(&self, ranges: &[(u64, u64)], durability: Durability) -> Result<()> {
        self.block
            .commit_written_ranges(&self.block_ranges(ranges)?, durability)
    }

    /// The block's [`prepare_read_ranges`](MemoryBlock::prepare_read_ranges) for the ranges
    /// `(offset, len)` that one operation reads, checked against the region; the caller holds a permit.
    pub fn prepare_read_ranges(&self, ranges: &[(u64, u64)]) -> Result<()> {
        self.block.prepare_read_ranges(&self.block_ranges(ranges)?)
    }

    /// Whether the block writes through a file ([`MemoryBlock::file_writer`]).
    pub fn writes_through_file(&self) -> bool {
        self.block.file_writer().is_some()
    }

    /// Whether a transport lands a range of `len` bytes written with `durability` through the
    /// block's file: the range is large ([`FILE_WRITE_MIN`]), the block writes through a file, and
    /// the write is persistent or the block was flushed before ([`FileWriter::flushed`]).
    pub fn writes_into_file(&self, len: u64, durability: Durability) -> bool {
        len >= FILE_WRITE_MIN
            && self
                .block
                .file_writer()
                .is_some_and(|w| durability == Durability::Persistent || w.flushed())
    }

    /// Writes `src` at `offset` through the block's file, checked against the region; the caller
    /// holds a permit.
    pub fn write_through_file(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len() as u64)?;
        self.file_writer()?.write_at(offset as usize, src)
    }

    /// Makes the ranges `(offset, len)` that one operation wrote persistent, checked against the
    /// region, under a permit. `by_cpu`: this host's CPU wrote them (a copy into the memory, a
    /// `process_vm_readv` into this process, or a write through the block's file), so every written
    /// page is dirty already and a block that writes through a file flushes them without dirtying
    /// each page first ([`FileWriter::persist_written`], which would otherwise fault in every page
    /// the write did not map). A NIC's writes into a page cache dirty no page: the block's own
    /// [`persist`](MemoryBlock::persist) handles them.
    pub fn persist_written(&self, ranges: &[(u64, u64)], by_cpu: bool) -> Result<()> {
        let local = self.block_ranges(ranges)?;
        let _permit = self.guard.enter().ok_or_else(|| self.gone())?;
        match self.block.file_writer() {
            Some(writer) if by_cpu => writer.persist_written(&local),
            _ => self.block.persist(&local),
        }
    }

    fn file_writer(&self) -> Result<&dyn FileWriter> {
        self.block
            .file_writer()
            .ok_or_else(|| Error::Internal(format!("region {:?} has no file to write through", self.key)))
    }

    /// `ranges`, each checked against the region, as the block's hooks take them.
    fn block_ranges(&self, ranges: &[(u64, u64)]) -> Result<Vec<(usize, usize)>> {
        ranges
            .iter()
            .map(|&(offset, len)| self.check_range(offset, len).map(|()| (offset as usize, len as usize)))
            .collect()
    }

    /// Whether the work around an access with `durability` may block the calling thread: the hooks of
    /// a block that is not [`DmaView::Host`] (a GPU copy, a cache flush), or a persist that is not a
    /// cache-line write-back to persistent memory (an `msync`). Transports then run it on a blocking
    /// thread, holding an [`OwnedPermit`](crate::guard::OwnedPermit) across it.
    pub fn staging_may_block(&self, durability: Durability) -> bool {
        self.block.dma_view() != DmaView::Host || (durability == Durability::Persistent && !self.block.is_pmem())
    }

    /// The error for an access to a region that is being deregistered.
    pub fn gone(&self) -> Error {
        Error::PermissionDenied(format!("region {:?} has been deregistered", self.key))
    }
}

/// Calls `f` once per region of `parts`, in the order regions first appear, with that region's
/// `(offset, len)` ranges: commits and flushes work per region, on all of its ranges at once.
pub fn for_each_region(parts: &[Resolved], mut f: impl FnMut(&RegionEntry, &[(u64, u64)]) -> Result<()>) -> Result<()> {
    for (region, ranges) in by_region(parts) {
        f(&region, &ranges)?;
    }
    Ok(())
}

/// A region and the `(offset, len)` ranges of it that an operation touches.
pub type RegionRanges = (Arc<RegionEntry>, Vec<(u64, u64)>);

/// The least part of a write that a transport lands through its region's file (see
/// [`into_files`]): a smaller one would cost a system call of its own where a copy into the mapping
/// costs a page fault at most.
pub const FILE_WRITE_MIN: u64 = 64 << 10;

/// The most of a write that a transport passes through its own buffer at a time on the way into a
/// file.
pub const FILE_WRITE_CHUNK: usize = 1 << 20;

/// The pieces `(offset, len)` in which a transport passes a part of `len` bytes through its
/// buffer into a file: [`FILE_WRITE_CHUNK`] at a time, in order, the last one shorter.
pub fn file_pieces(len: u64) -> impl Iterator<Item = (u64, usize)> {
    (0..len)
        .step_by(FILE_WRITE_CHUNK)
        .map(move |at| (at, (len - at).min(FILE_WRITE_CHUNK as u64) as usize))
}

/// `items` in order, cut into batches of at most `most` bytes (`len` of each; one batch at least):
/// an item larger than what is left of a batch is split across batches, `part(item, skip, take)`
/// being its bytes `[skip, skip + take)`. What bounds a device copy, a chunk of a shared-memory copy
/// or a piece of a payload overlapped with the network.
pub fn cut<T>(items: &[T], most: u64, len: impl Fn(&T) -> u64, part: impl Fn(&T, u64, u64) -> T) -> Vec<Vec<T>> {
    let mut batches = vec![Vec::new()];
    let mut room = most;
    for item in items {
        let mut done = 0;
        while done < len(item) {
            if room == 0 {
                batches.push(Vec::new());
                room = most;
            }
            let n = (len(item) - done).min(room);
            if let Some(batch) = batches.last_mut() {
                batch.push(part(item, done, n));
            }
            done += n;
            room -= n;
        }
    }
    batches
}

/// The first `n` bytes of `bounce`, grown to hold them.
pub fn bounce_piece(bounce: &mut Vec<u8>, n: usize) -> &mut [u8] {
    if bounce.len() < n {
        bounce.resize(n, 0);
    }
    &mut bounce[..n]
}

/// Whether a write of `parts` with `durability` lands through the regions' files rather than their
/// memory: every part does ([`RegionEntry::writes_into_file`]). A page-cache file then takes no page
/// fault for each page the last flush cleaned, and its flush write-protects no mapped page. 1 MiB
/// persistent writes over TCP on one stream, depth 1, into such a file on ext4 (`ferry bench
/// --durability persistent`): 0.58-0.70 GB/s copied into the mapping, 1.09-1.16 through the file,
/// where `dd bs=1M oflag=dsync` writes 1.1. A completed write into a file never flushed stays in
/// the mapping, whose pages are still writable: through the file it ran at 1.58-2.55 GB/s, into the
/// mapping at 2.32-3.19.
pub fn into_files<'a>(parts: impl IntoIterator<Item = &'a Resolved>, durability: Durability) -> bool {
    let mut parts = parts.into_iter().peekable();
    parts.peek().is_some() && parts.all(|p| p.region.writes_into_file(p.len, durability))
}

/// `parts` grouped by region, in the order regions first appear.
pub fn by_region<'a>(parts: impl IntoIterator<Item = &'a Resolved>) -> Vec<RegionRanges> {
    let mut groups: Vec<RegionRanges> = Vec::new();
    for p in parts {
        match groups.iter_mut().find(|(r, _)| r.key() == p.region.key()) {
            Some((_, ranges)) => ranges.push((p.offset, p.len)),
            None => groups.push((p.region.clone(), vec![(p.offset, p.len)])),
        }
    }
    groups
}

/// A range resolved against the table: the region and the offset inside it.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The region.
    pub region: Arc<RegionEntry>,
    /// Offset of the first byte inside the region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// The regions registered with one engine, by key and by address.
#[derive(Debug, Default)]
pub struct RegionTable {
    by_key: HashMap<RegionKey, Arc<RegionEntry>>,
    /// The same entries by first address: a local lookup is one search of this tree.
    by_addr: BTreeMap<u64, Arc<RegionEntry>>,
    total_bytes: u64,
}

impl RegionTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of regions.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Whether no region is registered.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Bytes registered in all.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Adds a region. Regions may not overlap: an address must name one region.
    pub fn insert(&mut self, entry: Arc<RegionEntry>) -> Result<()> {
        let (start, len) = (entry.addr(), entry.len());
        let end = start
            .checked_add(len)
            .ok_or_else(|| Error::InvalidArgument("region end overflows the address space".into()))?;
        if self.by_key.contains_key(&entry.key()) {
            return Err(Error::InvalidArgument(format!(
                "key {:?} is already registered",
                entry.key()
            )));
        }
        if let Some((_, other)) = self.by_addr.range(..end).next_back()
            && other.addr() + other.len() > start
        {
            return Err(Error::InvalidArgument(format!(
                "[{start:#x}, {end:#x}) overlaps the registered region at {:#x} ({} bytes); deregister it first",
                other.addr(),
                other.len()
            )));
        }
        self.by_addr.insert(start, entry.clone());
        self.total_bytes += len;
        self.by_key.insert(entry.key(), entry);
        Ok(())
    }

    /// Removes a region; the caller then closes its guard.
    pub fn remove(&mut self, key: RegionKey) -> Option<Arc<RegionEntry>> {
        let entry = self.by_key.remove(&key)?;
        self.by_addr.remove(&entry.addr());
        self.total_bytes -= entry.len();
        Some(entry)
    }

    /// The region under `key`.
    pub fn get(&self, key: RegionKey) -> Option<&Arc<RegionEntry>> {
        self.by_key.get(&key)
    }

    /// Every region, in address order.
    pub fn entries(&self) -> impl Iterator<Item = &Arc<RegionEntry>> {
        self.by_addr.values()
    }

    /// All regions, as peers see them.
    pub fn adverts(&self) -> Vec<RegionAd> {
        self.by_addr.values().map(|e| e.advert()).collect()
    }

    /// The regions the peer `who` may reach, with what it may do (see [`RegionEntry::access_for`]).
    pub fn adverts_for(&self, who: Option<&PeerIdentity>) -> Vec<RegionAd> {
        self.by_addr.values().filter_map(|e| e.advert_for(who)).collect()
    }

    /// [`resolve`](Self::resolve) for the peer `who`: a region it was not granted is as unknown to it
    /// as a key never registered.
    pub fn resolve_for(
        &self,
        who: Option<&PeerIdentity>,
        key: RegionKey,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<Resolved> {
        if let (Some(who), Some(region)) = (who, self.by_key.get(&key)) {
            let granted = region.access_for(Some(who));
            if granted.is_none() {
                return Err(Error::PermissionDenied(format!(
                    "no region is registered under key {key:?}"
                )));
            }
            if !granted.contains(access) {
                return Err(Error::PermissionDenied(format!(
                    "region {key:?} grants {who} {granted} but the operation needs {access}"
                )));
            }
        }
        self.resolve(key, offset, len, access)
    }

    /// The target-side check of a remote operation: the key exists, `[offset, offset + len)` lies in
    /// the region, and the region grants `access`.
    pub fn resolve(&self, key: RegionKey, offset: u64, len: u64, access: Access) -> Result<Resolved> {
        let region = self
            .by_key
            .get(&key)
            .ok_or_else(|| Error::PermissionDenied(format!("no region is registered under key {key:?}")))?;
        if !region.access().contains(access) {
            return Err(Error::PermissionDenied(format!(
                "region {key:?} grants {} but the operation needs {access}",
                region.access()
            )));
        }
        region.check_range(offset, len)?;
        region.block().check_backing()?;
        Ok(Resolved {
            region: region.clone(),
            offset,
            len,
        })
    }

    /// The initiator-side lookup of a local address range: the region that holds it wholly.
    pub fn find_local(&self, addr: u64, len: u64) -> Result<Resolved> {
        if len == 0 {
            return Err(Error::InvalidArgument("zero-length descriptor".into()));
        }
        let region = self
            .by_addr
            .range(..=addr)
            .next_back()
            .map(|(_, e)| e)
            .ok_or_else(|| Error::OutOfBounds(format!("local address {addr:#x} is in no registered region")))?;
        let offset = addr - region.addr();
        if offset >= region.len() {
            return Err(Error::OutOfBounds(format!(
                "local address {addr:#x} is in no registered region"
            )));
        }
        region.check_range(offset, len)?;
        Ok(Resolved {
            region: region.clone(),
            offset,
            len,
        })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::memory::OwnedBuffer;
    use proptest::prelude::*;

    fn entry(len: usize, access: Access) -> Arc<RegionEntry> {
        let block: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(vec![0u8; len]));
        Arc::new(RegionEntry::new(RegionKey::random().unwrap(), access, block).unwrap())
    }

    #[test]
    fn work_under_an_owned_permit_holds_it_until_it_returns() {
        let r = entry(4096, Access::READ_WRITE);
        let work = r.with_owned_permit(|region| region.guard().held()).unwrap();
        assert_eq!(r.guard().held(), 1, "taken when the work is packaged");
        assert_eq!(work(), 1, "held while the work runs");
        assert_eq!(r.guard().held(), 0, "released when it returns");
        r.guard().close();
        assert!(matches!(
            r.with_owned_permit(|_| ()).map(|_| ()),
            Err(Error::PermissionDenied(_))
        ));
    }

    #[test]
    fn resolve_checks_key_access_and_bounds() {
        let mut t = RegionTable::new();
        let r = entry(4096, Access::READ);
        let key = r.key();
        t.insert(r).unwrap();
        assert!(t.resolve(key, 0, 4096, Access::READ).is_ok());
        assert!(matches!(
            t.resolve(key, 0, 4096, Access::WRITE),
            Err(Error::PermissionDenied(_))
        ));
        assert!(matches!(
            t.resolve(RegionKey(key.0 ^ 1), 0, 1, Access::READ),
            Err(Error::PermissionDenied(_))
        ));
        assert!(matches!(
            t.resolve(key, 4000, 97, Access::READ),
            Err(Error::OutOfBounds(_))
        ));
        assert!(matches!(
            t.resolve(key, 4096, 1, Access::READ),
            Err(Error::OutOfBounds(_))
        ));
        assert!(matches!(
            t.resolve(key, 1, u64::MAX, Access::READ),
            Err(Error::OutOfBounds(_))
        ));
        assert!(matches!(
            t.resolve(key, 0, 0, Access::READ),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn copy_after_deregistration_fails() {
        let r = entry(16, Access::READ_WRITE);
        r.copy_in(0, &[1, 2, 3]).unwrap();
        let mut out = [0u8; 3];
        r.copy_out(0, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3]);
        r.guard().close();
        assert!(r.guard().is_drained());
        assert!(matches!(r.copy_in(0, &[9]), Err(Error::PermissionDenied(_))));
    }

    proptest! {
        #[test]
        fn resolve_accepts_exactly_the_ranges_inside(
            lens in proptest::collection::vec(1usize..5000, 1..8),
            pick in any::<usize>(),
            offset in any::<u64>(),
            len in any::<u64>(),
            small in any::<bool>(),
        ) {
            let mut t = RegionTable::new();
            let entries: Vec<_> = lens.iter().map(|&l| entry(l, Access::READ_WRITE)).collect();
            for e in &entries { t.insert(e.clone()).unwrap(); }
            let e = &entries[pick % entries.len()];
            let (offset, len) = if small { (offset % 6000, len % 6000) } else { (offset, len) };
            let inside = len > 0 && offset.checked_add(len).is_some_and(|end| end <= e.len());
            prop_assert_eq!(t.resolve(e.key(), offset, len, Access::WRITE).is_ok(), inside);
            // The same range by address finds the same region iff inside.
            if offset < e.len() {
                let found = t.find_local(e.addr() + offset, len);
                prop_assert_eq!(found.is_ok(), inside);
                if let Ok(r) = found { prop_assert_eq!(r.region.key(), e.key()); prop_assert_eq!(r.offset, offset); }
            }
        }

        #[test]
        fn remove_keeps_indexes_consistent(n in 1usize..10, remove_mask in any::<u16>()) {
            let mut t = RegionTable::new();
            let entries: Vec<_> = (0..n).map(|i| entry(64 + i, Access::READ)).collect();
            for e in &entries { t.insert(e.clone()).unwrap(); }
            let mut expect_bytes = 0;
            for (i, e) in entries.iter().enumerate() {
                if remove_mask & (1 << i) != 0 {
                    prop_assert!(t.remove(e.key()).is_some());
                    prop_assert!(t.find_local(e.addr(), 1).is_err());
                } else {
                    expect_bytes += e.len();
                }
            }
            prop_assert_eq!(t.total_bytes(), expect_bytes);
            prop_assert_eq!(t.adverts().len(), t.len());
        }

        #[test]
        fn file_pieces_tile_the_part_in_order(len in 0u64..(5 * FILE_WRITE_CHUNK as u64)) {
            let mut next = 0u64;
            for (at, n) in file_pieces(len) {
                prop_assert_eq!(at, next);
                prop_assert!(n > 0 && n <= FILE_WRITE_CHUNK);
                next += n as u64;
            }
            prop_assert_eq!(next, len);
        }
    }
}

/// Most regions a peer's table may hold (see [`RemoteRegions`]).
pub const MAX_REMOTE_REGIONS: usize = 1 << 17;

/// A peer's regions as it advertised them, by address: the initiator-side lookup of remote
/// descriptors. The target checks again; this table only lets the initiator refuse early and find keys.
///
/// A peer chooses what it advertises, so the table is bounded ([`MAX_REMOTE_REGIONS`]) and each update
/// costs O(log n), whatever it sends.
#[derive(Debug, Default, Clone)]
pub struct RemoteRegions {
    by_addr: BTreeMap<u64, RegionAd>,
    /// The address each key's region is filed under.
    addr_of: HashMap<RegionKey, u64>,
}

impl RemoteRegions {
    /// A table of `ads`; `ResourceExhausted` past [`MAX_REMOTE_REGIONS`].
    pub fn new(ads: impl IntoIterator<Item = RegionAd>) -> Result<Self> {
        let mut t = RemoteRegions::default();
        for ad in ads {
            t.insert(ad)?;
        }
        Ok(t)
    }

    /// Adds or replaces a region (one region per key, and per address: a region advertised at the
    /// address of another replaces it); `ResourceExhausted` when the table is full.
    pub fn insert(&mut self, ad: RegionAd) -> Result<()> {
        self.remove(ad.key);
        if let Some(old) = self.by_addr.get(&ad.addr) {
            self.addr_of.remove(&old.key);
        } else if self.by_addr.len() >= MAX_REMOTE_REGIONS {
            return Err(Error::ResourceExhausted(format!(
                "the peer advertised more than {MAX_REMOTE_REGIONS} regions"
            )));
        }
        self.addr_of.insert(ad.key, ad.addr);
        self.by_addr.insert(ad.addr, ad);
        Ok(())
    }

    /// Removes the region under `key`.
    pub fn remove(&mut self, key: RegionKey) {
        if let Some(addr) = self.addr_of.remove(&key) {
            self.by_addr.remove(&addr);
        }
    }

    /// All regions, by address.
    pub fn iter(&self) -> impl Iterator<Item = &RegionAd> {
        self.by_addr.values()
    }

    /// Number of regions.
    pub fn len(&self) -> usize {
        self.by_addr.len()
    }

    /// Whether the peer advertised no region.
    pub fn is_empty(&self) -> bool {
        self.by_addr.is_empty()
    }

    /// The region holding `[addr, addr + len)` wholly, and the offset of `addr` in it.
    pub fn find(&self, addr: u64, len: u64, access: Access) -> Result<(&RegionAd, u64)> {
        if len == 0 {
            return Err(Error::InvalidArgument("zero-length descriptor".into()));
        }
        let ad = self
            .by_addr
            .range(..=addr)
            .next_back()
            .map(|(_, a)| a)
            .filter(|a| addr - a.addr < a.len)
            .ok_or_else(|| {
                Error::OutOfBounds(format!("remote address {addr:#x} is in no region the peer registered"))
            })?;
        if !ad.contains(addr, len) {
            return Err(Error::OutOfBounds(format!(
                "remote range [{addr:#x}, +{len}) crosses the end of the peer's region at {:#x} ({} bytes)",
                ad.addr, ad.len
            )));
        }
        if !ad.access.contains(access) {
            return Err(Error::PermissionDenied(format!(
                "the peer's region at {:#x} grants {} but the operation needs {access}",
                ad.addr, ad.access
            )));
        }
        Ok((ad, addr - ad.addr))
    }
}
