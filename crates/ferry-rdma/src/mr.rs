//! Regions registered with the NIC, and the count of work requests that still use each.
//!
//! Deregistration waits for that count to reach zero before it deregisters the memory region, so a
//! request posted before `deregister` was called finishes against valid memory, and once the memory
//! region is gone the NIC refuses every further access, remote or local.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use sideway::ibverbs::memory_region::MemoryRegion;

/// A region's registration with the NIC.
pub struct Registered {
    mr: Arc<MemoryRegion>,
    in_use: AtomicUsize,
}

impl Registered {
    pub(crate) fn new(mr: Arc<MemoryRegion>) -> Self {
        Registered {
            mr,
            in_use: AtomicUsize::new(0),
        }
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
