//! The application's handle on a registered region.

use std::sync::{Arc, Weak};

use ferry_core::{Access, Durability, Error, RegionEntry, RegionKey, Result};

use crate::shared::{DEREGISTER_LIMIT, Inner, keep_until_drained, wait_for_dropped};

/// Memory registered with an engine. [`deregister`](Region::deregister)`.await` removes it without
/// blocking the runtime; dropping it (or
/// [`Engine::deregister_blocking`](crate::Engine::deregister_blocking)) removes it on the dropping
/// thread, which it blocks. Either way peers are told, the region's access guard closes, and once
/// that returns no byte of it is touched again (within [`DEREGISTER_LIMIT`]; see there).
///
/// A drop that must wait (for accesses in progress, or for a peer on this host to give back its
/// mapping of the region) waits on a worker of a multi-threaded tokio runtime under
/// `block_in_place`, so that the runtime's other tasks go on meanwhile, the peer's among them when it
/// lives in this process. A current-thread runtime has no other thread to run them while the drop
/// waits. There, a region whose memory nothing but the region holds (what
/// [`Engine::alloc_host`](crate::Engine::alloc_host) and [`Engine::register`](crate::Engine::register)
/// make: see [`MemoryBlock::owns_memory`](ferry_core::MemoryBlock::owns_memory)) is handed to a task of that runtime,
/// which frees the memory once the accesses end, and the drop returns at once: no one is left who
/// could see a byte change. Memory the caller can still reach (a block given to
/// [`Engine::register_block`](crate::Engine::register_block) and kept, or
/// [`RawMemory`](ferry_core::RawMemory)) must not change once the drop returns, so that drop waits
/// on the thread, at most [`DEREGISTER_LIMIT`]: await [`deregister`](Region::deregister) instead.
///
/// Peers may write into the region at any time, so it offers copies ([`write_at`](Region::write_at),
/// [`read_at`](Region::read_at)) and a raw pointer ([`as_ptr`](Region::as_ptr)), never a slice: no
/// caller can promise that no peer writes while a `&[u8]` lives, since a peer with write access may
/// write at any moment, and a slice over bytes that change is undefined behaviour.
///
/// ```compile_fail
/// fn view(region: &ferry::Region) -> &[u8] {
///     unsafe { region.as_slice() } // no such method: a slice cannot be made sound here
/// }
/// ```
pub struct Region {
    pub(crate) entry: Arc<RegionEntry>,
    pub(crate) engine: Weak<Inner>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.entry.fmt(f)
    }
}

impl Region {
    /// The first byte's address, as descriptors name it.
    pub fn addr(&self) -> u64 {
        self.entry.addr()
    }

    /// The address of the byte at `offset`, for building descriptors.
    pub fn addr_at(&self, offset: u64) -> u64 {
        self.entry.addr() + offset
    }

    /// The address the peer named `peer` knows this region's first byte by, for descriptors that peer
    /// builds. On an engine that authenticates its links each peer is told an opaque base of its own
    /// (see [`ferry_core::peer_view`]): hand it this, not [`addr`](Self::addr), out of band. On an
    /// engine open to anyone, the region's own address.
    pub fn addr_for(&self, peer: &str) -> u64 {
        match self.engine.upgrade() {
            Some(engine) if engine.authenticates() => engine.ctx.peer_names.base(peer, &self.entry),
            _ => self.entry.addr(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.entry.len()
    }

    /// Never true: empty regions cannot be registered.
    pub fn is_empty(&self) -> bool {
        self.entry.is_empty()
    }

    /// The key of this region in the engine's table. Peers of an engine open to anyone name it by this
    /// key; on an engine that authenticates its links each peer is told a key of its own.
    pub fn key(&self) -> RegionKey {
        self.entry.key()
    }

    /// The key the peer named `peer` knows this region by: on an engine that authenticates its links,
    /// a key of that peer's own (see [`ferry_core::peer_view`]); on an engine open to anyone,
    /// [`key`](Self::key).
    pub fn key_for(&self, peer: &str) -> RegionKey {
        match self.engine.upgrade() {
            Some(engine) if engine.authenticates() => {
                RegionKey(self.entry.key().0 ^ engine.ctx.peer_names.key_mask(peer))
            }
            _ => self.entry.key(),
        }
    }

    /// What peers may do.
    pub fn access(&self) -> Access {
        self.entry.access()
    }

    /// Where the memory comes from ("host (memfd)", "host (owned buffer)", …).
    pub fn kind(&self) -> &str {
        self.entry.block().kind()
    }

    /// Whether writes to it can be made persistent.
    pub fn is_persistent(&self) -> bool {
        self.entry.block().persistent()
    }

    /// Copies `src` into the region at `offset` (and on to the device, for staged GPU memory; straight
    /// onto it where the block copies from any buffer).
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<()> {
        // One permit across the copy and the hook (the staged block's device copy).
        let _permit = self.entry.guard().enter().ok_or_else(|| self.entry.gone())?;
        if let Some(copies) = self.entry.block().device_copies() {
            self.entry.check_range(offset, src.len() as u64)?;
            return copies.copy_to_device(offset as usize, src);
        }
        self.entry.copy_in(offset, src)?;
        // A mapped file that shrank meanwhile took the bytes into zero pages: say so.
        self.entry.block().check_backing()?;
        self.entry
            .block()
            .commit_written(offset as usize, src.len(), Durability::Completed)
    }

    /// Makes `[offset, offset + len)` persistent (persistent regions only; see
    /// [`Engine::register_file`](crate::Engine::register_file)).
    pub fn persist(&self, offset: u64, len: u64) -> Result<()> {
        self.entry.persist(&[(offset, len)])
    }

    /// What persisting writes to this region has cost so far (`None` for regions that do not persist).
    pub fn persist_stats(&self) -> Option<ferry_core::PersistStats> {
        self.entry.block().persist_stats()
    }

    /// Copies from the region at `offset` into `dst` (fetching from the device first, for staged GPU
    /// memory; straight from it where the block copies into any buffer).
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.entry.check_range(offset, dst.len() as u64)?;
        // One permit across the hook (the staged block's device copy) and the copy.
        let _permit = self.entry.guard().enter().ok_or_else(|| self.entry.gone())?;
        if let Some(copies) = self.entry.block().device_copies() {
            return copies.copy_from_device(offset as usize, dst);
        }
        self.entry.block().prepare_read(offset as usize, dst.len())?;
        self.entry.copy_out(offset, dst)?;
        self.entry.block().check_backing()
    }

    /// Copies the whole region out.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len() as usize];
        self.read_at(0, &mut v)?;
        Ok(v)
    }

    /// The first byte, for code that manages concurrency itself.
    pub fn as_ptr(&self) -> *mut u8 {
        self.entry.block().as_ptr()
    }

    /// Lets the peer named `peer` (the name in its certificate, or one of its DNS alternative names)
    /// reach this region with `access` (within the region's own access), on an engine that
    /// authenticates its links ([`EngineBuilder::tls`](crate::EngineBuilder::tls)); there regions are
    /// private until granted. The peer's links are told at once. A grant that widens returns then; one
    /// that narrows what the peer had (read-write to read) returns as [`revoke`](Self::revoke) does:
    /// once the peer can no longer do what was taken away (its same-host mapping given back, the
    /// operations begun under the old grant ended), within [`REVOKE_LIMIT`](crate::REVOKE_LIMIT).
    /// `InvalidArgument` on an open engine, where every peer reaches every region, and for a name
    /// that is an IP address: certificates share addresses (every one `ferry certs` makes carries
    /// 127.0.0.1), so an address names nobody.
    pub async fn grant(&self, peer: &str, access: Access) -> Result<()> {
        self.grant_handle().grant(peer, access).await
    }

    /// Lets every authenticated peer reach this region with `access`, as [`grant`](Self::grant) does
    /// for one.
    pub async fn grant_all(&self, access: Access) -> Result<()> {
        self.grant_handle().grant_all(access).await
    }

    /// Takes back what [`grant`](Self::grant) gave `peer`. When this returns `Ok`, every link of that
    /// peer has sent it the region's removal (or its narrower access, if a grant to every peer
    /// remains), every later operation of it on the region is refused, and no operation it began
    /// before has a byte left to move. The wait is bounded by [`REVOKE_LIMIT`](crate::REVOKE_LIMIT):
    /// past it this fails with `Timeout`, the revoke in force for new operations.
    pub async fn revoke(&self, peer: &str) -> Result<()> {
        self.grant_handle().revoke(peer).await
    }

    /// Takes back a [`grant_all`](Self::grant_all), as [`revoke`](Self::revoke) does for one peer.
    pub async fn revoke_all(&self) -> Result<()> {
        self.grant_handle().revoke_all().await
    }

    /// A handle that changes this region's grants apart from the `Region` (in a spawned task, or from
    /// another language's binding): see [`GrantHandle`].
    pub fn grant_handle(&self) -> GrantHandle {
        GrantHandle {
            entry: self.entry.clone(),
            engine: self.engine.clone(),
        }
    }

    /// What this region grants, by peer.
    pub fn grants(&self) -> ferry_core::Grants {
        self.entry.grants()
    }

    /// Deregisters the region without blocking the runtime's threads: takes it out of the region
    /// table (new remote operations on it fail with `PermissionDenied`), closes its access guard (no
    /// new access starts), tells peers, has every transport end its own accesses (the RDMA transport
    /// halts and drains the queue pairs whose work requests use the region, on a blocking thread), and
    /// awaits the end of the accesses still in progress: a copy, a system call, a GPU copy or an
    /// `msync`, each woken by the last release, never polled.
    ///
    /// Once this returns `Ok`, no byte of the region is touched again. The wait is bounded by
    /// [`DEREGISTER_LIMIT`]: past it this fails with `Timeout`, naming the region and how many
    /// accesses were still held; the region is deregistered all the same, but memory the caller owns
    /// ([`RawMemory`](ferry_core::RawMemory)) may still be in use by those accesses, so it must not be
    /// freed then. If this future is dropped before it completes, the region is deregistered all the
    /// same; only the wait is cut short. In both cases memory the region's block owns
    /// ([`MemoryBlock::owns_memory`](ferry_core::MemoryBlock::owns_memory)) is kept until the accesses
    /// end, by a task that then frees it (at most [`DEREGISTER_LIMIT`] more; past that it is leaked,
    /// never freed under them).
    pub async fn deregister(self) -> Result<()> {
        let result = match self.engine.upgrade() {
            Some(engine) => engine.remove_region_async(&self.entry).await,
            None => {
                self.entry.guard().close();
                match tokio::time::timeout(DEREGISTER_LIMIT, self.entry.guard().drained()).await {
                    Ok(()) => Ok(()),
                    Err(_) => Err(Error::Timeout(format!(
                        "region {:?}: {} accesses still held {DEREGISTER_LIMIT:?} after its deregistration began",
                        self.entry.key(),
                        self.entry.guard().held()
                    ))),
                }
            }
        };
        // `Drop` finds the guard closed and has nothing left to do.
        drop(self);
        result
    }
}

impl Drop for Region {
    /// Deregisters on the dropping thread, for callers that do not await
    /// [`deregister`](Region::deregister): the same steps, with the RDMA transport's queue-pair drain
    /// run here and the wait for the accesses in progress a bounded blocking wait
    /// ([`AccessGuard::wait_drained`](ferry_core::AccessGuard::wait_drained), [`DEREGISTER_LIMIT`]),
    /// off the runtime's workers where it can be, or left to a task (see the type's documentation),
    /// after which an error is logged and the drop returns.
    fn drop(&mut self) {
        if self.entry.guard().is_closed() {
            // Deregistered already: `deregister` ran to its end, or to its limit, or its future was
            // dropped during the wait. In the last two, accesses may still hold the memory.
            if !self.entry.guard().is_drained() && self.entry.block().owns_memory() {
                keep_until_drained(self.entry.clone());
            }
            return;
        }
        match self.engine.upgrade() {
            Some(engine) => engine.remove_region(self.entry.key()),
            None => {
                self.entry.guard().close();
                wait_for_dropped(self.entry.clone());
            }
        }
    }
}

/// Changes one region's grants, as [`Region::grant`], [`Region::grant_all`], [`Region::revoke`] and
/// [`Region::revoke_all`] do (which see), for code that cannot borrow the `Region` across an await.
/// Cheap to clone; holding one keeps neither the region registered nor its engine alive (both fail
/// with `InvalidArgument` once gone).
#[derive(Clone, Debug)]
pub struct GrantHandle {
    entry: Arc<RegionEntry>,
    engine: Weak<Inner>,
}

impl GrantHandle {
    fn engine(&self) -> Result<Arc<Inner>> {
        self.engine
            .upgrade()
            .ok_or_else(|| Error::InvalidArgument("the engine of this region is gone".into()))
    }

    /// See [`Region::grant`].
    pub async fn grant(&self, peer: &str, access: Access) -> Result<()> {
        ferry_core::Grants::check_name(peer)?;
        let engine = self.engine()?;
        let name = peer.to_string();
        engine
            .regrant(
                &self.entry,
                |g| {
                    g.named.insert(name, access);
                },
                false,
            )
            .await
    }

    /// See [`Region::grant_all`].
    pub async fn grant_all(&self, access: Access) -> Result<()> {
        self.engine()?
            .regrant(&self.entry, |g| g.everyone = access, false)
            .await
    }

    /// See [`Region::revoke`].
    pub async fn revoke(&self, peer: &str) -> Result<()> {
        self.engine()?
            .regrant(
                &self.entry,
                |g| {
                    g.named.remove(peer);
                },
                true,
            )
            .await
    }

    /// See [`Region::revoke_all`].
    pub async fn revoke_all(&self) -> Result<()> {
        self.engine()?
            .regrant(&self.entry, |g| g.everyone = Access::NONE, true)
            .await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use ferry_core::{MemoryBlock, OwnedBuffer};

    use super::*;
    use crate::Engine;

    /// An owned buffer that records when it is freed.
    struct Tracked {
        buffer: OwnedBuffer,
        freed: Arc<AtomicBool>,
    }

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.freed.store(true, Ordering::SeqCst);
        }
    }

    // SAFETY: the buffer's own promise: its bytes live as long as it, and so as long as `self`.
    unsafe impl MemoryBlock for Tracked {
        fn as_ptr(&self) -> *mut u8 {
            self.buffer.as_ptr()
        }
        fn len(&self) -> usize {
            self.buffer.len()
        }
        fn kind(&self) -> &str {
            "test (tracked)"
        }
        fn owns_memory(&self) -> bool {
            true
        }
    }

    /// An access that holds only a permit (a peer's copy into the memory, say) outlives a
    /// `deregister` whose future was dropped mid-wait: the memory the region owns is freed only once
    /// that access ended, not when the region went.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn owned_memory_outlives_a_cut_short_deregister_until_its_accesses_end() {
        let engine = Engine::builder().build().await.unwrap();
        let freed = Arc::new(AtomicBool::new(false));
        let block = Tracked {
            buffer: OwnedBuffer::new(vec![0u8; 4096]),
            freed: freed.clone(),
        };
        let region = engine.register_block(Arc::new(block), Access::READ_WRITE).unwrap();
        let access = region.entry.guard().enter_owned().unwrap();
        let cut_short = tokio::time::timeout(Duration::from_millis(20), region.deregister()).await;
        assert!(cut_short.is_err(), "deregister finished with an access held");
        assert!(!freed.load(Ordering::SeqCst), "the memory was freed under an access");
        drop(access);
        tokio::time::timeout(Duration::from_secs(10), async {
            while !freed.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the memory is freed once the access ended");
    }
}
