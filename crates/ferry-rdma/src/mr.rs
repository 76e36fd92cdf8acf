//! Regions registered with the NIC, and the count of work requests that still use each.
//!
//! Deregistration waits for that count to reach zero before it deregisters the memory region, so a
//! request posted before `deregister` was called finishes against valid memory, and once the memory
//! region is gone the NIC refuses every further access, remote or local.
//!
//! Memory the NIC cannot pin (a file in the page cache: since Linux 6.5 the kernel refuses long-term
//! writable pins of file pages that need dirty tracking) is reached through a staging buffer: an
//! anonymous buffer of the region's size, registered in its place. RDMA WRITEs land there and the
//! target copies the written ranges into the region when the initiator's commit request names them
//! (`RdmaTransport::commit_staged`); reads of such a region go over TCP.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use sideway::ibverbs::memory_region::MemoryRegion;

/// A region's registration with the NIC.
pub struct Registered {
    // Before `staging`: the NIC forgets the buffer before it is freed.
    mr: Arc<MemoryRegion>,
    in_use: AtomicUsize,
    staging: Option<Staging>,
}

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
            mr,
            in_use: AtomicUsize::new(0),
            staging: None,
        }
    }

    /// A registration of `staging` standing in for a region the NIC cannot pin.
    pub(crate) fn staged(mr: Arc<MemoryRegion>, staging: Staging) -> Self {
        Registered {
            mr,
            in_use: AtomicUsize::new(0),
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
        self.mr.lkey()
    }

    /// The key peers name.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    pub(crate) fn acquire(&self) {
        self.in_use.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn release(&self) {
        self.in_use.fetch_sub(1, Ordering::AcqRel);
    }

    /// Work requests that still use the region.
    pub fn in_use(&self) -> usize {
        self.in_use.load(Ordering::Acquire)
    }
}
