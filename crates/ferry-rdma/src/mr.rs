//! Regions registered with the NIC, and the count of work requests that still use each.
//!
//! A work request takes its regions into use when it is posted (under the queue pair's lock), not
//! when it is planned: planning keeps only a handle. Deregistration first revokes the region, so
//! that no work request can take it into use any more (a transfer planned before then fails with
//! `PermissionDenied` instead of posting), then ends the NIC's use of what was posted already (see
//! `RdmaTransport::deregister_region`), and only then deregisters the memory region, explicitly:
//! handles that planning still holds keep this bookkeeping alive, never the NIC's access.
//!
//! Memory the NIC cannot pin (a file in the page cache: since Linux 6.5 the kernel refuses long-term
//! writable pins of file pages that need dirty tracking) is reached through a staging buffer: an
//! anonymous buffer of the region's size, registered in its place. RDMA WRITEs land there and the
//! target copies the written ranges into the region when the initiator's commit request names them
//! (`RdmaTransport::commit_staged`); reads of such a region go over TCP.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use sideway::ibverbs::memory_region::MemoryRegion;

/// A region's registration with the NIC.
pub struct Registered {
    // Before `staging`: the NIC forgets the buffer before it is freed. `None` once deregistered.
    mr: Mutex<Option<Arc<MemoryRegion>>>,
    lkey: u32,
    rkey: u32,
    /// Work requests posted that use the region, and [`REVOKED`].
    state: AtomicUsize,
    staging: Option<Staging>,
}

/// In [`Registered::state`]: the region is being deregistered; nothing may take it into use.
const REVOKED: usize = 1 << (usize::BITS - 1);

/// The buffer a region that the NIC cannot pin is reached through.
pub(crate) struct Staging {
    memory: Box<[u8]>,
}

impl Staging {
    pub(crate) fn new(len: usize) -> Self {
        Staging {
            memory: vec![0u8; len].into_boxed_slice(),
        }
    }

    /// The first byte (for registering it, and for copying out of it under the NIC's feet).
    pub(crate) fn as_ptr(&mut self) -> *mut u8 {
        self.memory.as_mut_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.memory.len()
    }
}

impl Registered {
    pub(crate) fn new(mr: Arc<MemoryRegion>) -> Self {
        Registered {
            lkey: mr.lkey(),
            rkey: mr.rkey(),
            mr: Mutex::new(Some(mr)),
            state: AtomicUsize::new(0),
            staging: None,
        }
    }

    /// A registration of `staging` standing in for a region the NIC cannot pin.
    pub(crate) fn staged(mr: Arc<MemoryRegion>, staging: Staging) -> Self {
        Registered {
            lkey: mr.lkey(),
            rkey: mr.rkey(),
            mr: Mutex::new(Some(mr)),
            state: AtomicUsize::new(0),
            staging: Some(staging),
        }
    }

    /// Whether RDMA reaches the region through a staging buffer.
    pub fn is_staged(&self) -> bool {
        self.staging.is_some()
    }

    /// The staging buffer's byte at `offset` (`None` for a region registered directly).
    pub(crate) fn staged_ptr(&self, offset: u64) -> Option<*const u8> {
        let s = self.staging.as_ref()?;
        (offset as usize <= s.len()).then(|| s.memory.as_ptr().wrapping_add(offset as usize))
    }

    /// The key local work requests name.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// The key peers name.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// Takes the region into use for one work request; false once it is revoked.
    pub(crate) fn try_acquire(&self) -> bool {
        self.state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                (s & REVOKED == 0).then_some(s + 1)
            })
            .is_ok()
    }

    /// A work request that used the region is done with it.
    pub(crate) fn release(&self) {
        self.state.fetch_sub(1, Ordering::AcqRel);
    }

    /// No work request may take the region into use from now on; returns how many still use it.
    pub(crate) fn revoke(&self) -> usize {
        self.state.fetch_or(REVOKED, Ordering::AcqRel) & !REVOKED
    }

    /// Work requests that still use the region.
    pub fn in_use(&self) -> usize {
        self.state.load(Ordering::Acquire) & !REVOKED
    }

    /// Deregisters the memory region: the NIC refuses every access to it from now on.
    pub(crate) fn forget(&self) {
        let mr = self
            .mr
            .lock()
            .map(|mut m| m.take())
            .unwrap_or_else(|p| p.into_inner().take());
        drop(mr);
    }
}
