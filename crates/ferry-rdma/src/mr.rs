//! Regions registered with the NIC, and the work requests that still use each.
//!
//! A work request takes its regions into use when it is posted (under the queue pair's lock), not
//! when it is planned: planning keeps only a handle. Taking a region into use is taking an
//! [`OwnedPermit`] of the region's [`AccessGuard`], the same guard CPU copies and GPU copies hold, and
//! the permit is held until the work request's completion arrives. Deregistration first closes the
//! guard, so that no work request can take the region into use any more (a transfer planned before
//! then fails with `PermissionDenied` instead of posting), then ends the NIC's use of what was posted
//! already (see `RdmaTransport::deregister_region`), and only then deregisters the memory region,
//! explicitly: handles that planning still holds keep this bookkeeping alive, never the NIC's access.
//!
//! Memory the NIC cannot pin (a file in the page cache: since Linux 6.5 the kernel refuses long-term
//! writable pins of file pages that need dirty tracking) is reached through a bounce buffer: an
//! anonymous buffer of the region's size, registered in its place. RDMA WRITEs land there and the
//! target copies the written ranges into the region when the initiator's commit request names them
//! (`RdmaShared::commit_bounced`); reads of such a region go over TCP.

use std::sync::{Arc, Mutex};

use ferry_core::{AccessGuard, OwnedPermit};
use sideway::ibverbs::memory_region::MemoryRegion;

use ferry_proto::rdma::RemoteKey;

/// A region's registration with the NIC.
pub struct Registered {
    // Before `bounce`: the NIC forgets the buffer before it is freed. `None` once deregistered.
    mr: Mutex<Option<Arc<MemoryRegion>>>,
    lkey: u32,
    rkey: u32,
    /// The region's access guard: a posted work request holds a permit of it until its completion.
    guard: Arc<AccessGuard>,
    bounce: Option<Bounce>,
    /// What the region's advert carries for RDMA (on an engine that authenticates its links, the
    /// template of each peer's own key: see `crate::scope`).
    advertised: RemoteKey,
}

/// A region taken into use by a posted group of work requests: a permit of its access guard, released
/// when this is dropped (the group's completion arrived, or its queue pair is gone).
pub(crate) struct InUse {
    region: Arc<Registered>,
    _permit: OwnedPermit,
}

impl InUse {
    /// The registration in use.
    pub(crate) fn region(&self) -> &Arc<Registered> {
        &self.region
    }
}

/// The buffer a region that the NIC cannot pin is reached through.
pub(crate) struct Bounce {
    memory: Box<[u8]>,
    /// The first byte, taken once from a unique borrow: the NIC writes through it.
    first: *mut u8,
}

// SAFETY: `first` points into `memory`, which this value owns; the bytes are only copied out of under
// the region's guard (see `RdmaShared::commit_bounced`).
unsafe impl Send for Bounce {}
// SAFETY: as above; no `&self` method writes through `first`.
unsafe impl Sync for Bounce {}

impl Bounce {
    pub(crate) fn new(len: usize) -> Self {
        let mut memory = vec![0u8; len].into_boxed_slice();
        let first = memory.as_mut_ptr();
        Bounce { memory, first }
    }

    /// The first byte (for registering it, and for copying out of it under the NIC's feet).
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.first
    }

    pub(crate) fn len(&self) -> usize {
        self.memory.len()
    }
}

impl Registered {
    /// The registration of a region whose accesses `guard` counts.
    pub(crate) fn new(mr: Arc<MemoryRegion>, guard: Arc<AccessGuard>) -> Self {
        Registered {
            lkey: mr.lkey(),
            rkey: mr.rkey(),
            advertised: RemoteKey {
                rkey: mr.rkey(),
                flushable: false,
                bounce_addr: None,
                hooked: false,
            },
            mr: Mutex::new(Some(mr)),
            guard,
            bounce: None,
        }
    }

    /// The registration, with what its advert carries for RDMA.
    pub(crate) fn advertising(self, key: RemoteKey) -> Self {
        Registered {
            advertised: key,
            ..self
        }
    }

    /// What the region's advert carries for RDMA.
    pub(crate) fn advertised(&self) -> RemoteKey {
        self.advertised
    }

    /// The bounce buffer's first byte, for registering it for a peer (`None` for a region registered
    /// directly).
    pub(crate) fn bounce_first(&self) -> Option<*mut u8> {
        self.bounce.as_ref().map(Bounce::as_ptr)
    }

    /// A registration of `bounce` standing in for a region the NIC cannot pin.
    pub(crate) fn bounced(mr: Arc<MemoryRegion>, bounce: Bounce, guard: Arc<AccessGuard>) -> Self {
        Registered {
            bounce: Some(bounce),
            ..Registered::new(mr, guard)
        }
    }

    /// Whether RDMA reaches the region through a bounce buffer.
    pub fn is_bounced(&self) -> bool {
        self.bounce.is_some()
    }

    /// The bounce buffer's byte at `offset` (`None` for a region registered directly).
    pub(crate) fn bounce_ptr(&self, offset: u64) -> Option<*const u8> {
        let s = self.bounce.as_ref()?;
        (offset as usize <= s.len()).then(|| s.first.cast_const().wrapping_add(offset as usize))
    }

    /// The key local work requests name.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// The key peers name.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// Takes the region into use for a group of work requests; `None` once its guard is closed.
    pub(crate) fn take(self: &Arc<Self>) -> Option<InUse> {
        Some(InUse {
            _permit: self.guard.enter_owned()?,
            region: self.clone(),
        })
    }

    /// No work request (nor any other access) may take the region into use from now on; returns how
    /// many accesses still hold a permit (work requests, and CPU or GPU copies in progress).
    pub(crate) fn close(&self) -> usize {
        self.guard.close()
    }

    /// Accesses that still hold a permit of the region's guard.
    pub fn in_use(&self) -> usize {
        self.guard.held()
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
