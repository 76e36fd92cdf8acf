//! Lock helpers the transports share, and the atomics and mutex of the access guard and the link
//! slots (`shim`).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

/// Empties `map` and returns its values: the operations still waiting when a link fails, so that each
/// can be told why. A lock poisoned by a panic elsewhere is taken anyway: the waiters still need their
/// answer.
pub fn take_all<K, V>(map: &Mutex<HashMap<K, V>>) -> Vec<V> {
    map.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .drain()
        .map(|(_, v)| v)
        .collect()
}

/// A reader-writer lock for the tables every transfer reads and that change only when a region or a
/// peer comes or goes (the region table, a peer's advertised regions, the regions a peer lent). A
/// reader locks one of several shards, picked by its thread, each on a cache line of its own; a
/// writer locks them all. Through a mutex or a `std::sync::RwLock`, every transfer took and released
/// one shared lock word, and the runtime's worker threads passed its cache line between cores: 4 KiB
/// writes over shared memory from 16 tasks ran at 1.35 M/s on two workers against 3.5 M/s on one.
/// Sharded, two workers reach 2.4 M/s when both are busy (`examples/tower_overhead.rs` in
/// ferry-tower, direct rounds). Each lock costs about 1 KiB.
pub use crossbeam_utils::sync::{ShardedLock, ShardedLockReadGuard, ShardedLockWriteGuard};

/// The rule that keeps a stream's frames in submission order when both its callers and a writer task
/// put frames into the one writer: a caller whose frame is small writes it itself (no task woken,
/// which is most of a small operation's round trip), but only when nothing is queued for the task
/// before it; everything else is queued.
///
/// The count covers what is queued and not yet in the writer. A caller counts its frame
/// ([`queue`](Self::queue)) before it hands the frame to the task's queue; the task takes the count
/// back ([`placed`](Self::placed)) only under the writer's lock, once the frame is in the writer. So a
/// caller that finds the count at zero with the writer's lock held ([`nothing_queued`](
/// Self::nothing_queued), checked again after taking the lock) appends after every frame whose
/// submission finished before it began. The loom model `write_through_never_overtakes_a_queued_frame`
/// (`tests/loom_guard.rs`) explores every interleaving of one queued frame, the task and one caller
/// writing through.
#[derive(Debug, Default)]
pub struct Handoff {
    queued: shim::AtomicUsize,
}

impl Handoff {
    /// Nothing queued.
    pub fn new() -> Self {
        Handoff::default()
    }

    /// A frame is about to go to the task's queue: counted before it is there.
    pub fn queue(&self) {
        self.queued.fetch_add(1, shim::Ordering::AcqRel);
    }

    /// The task put a queued frame into the writer; called under the writer's lock, after the frame is
    /// in it.
    pub fn placed(&self) {
        self.queued.fetch_sub(1, shim::Ordering::AcqRel);
    }

    /// Whether a caller may write its frame itself: nothing queued before it. Checked before taking
    /// the writer's lock (not to contend with a busy task), and again with it held.
    pub fn nothing_queued(&self) -> bool {
        self.queued.load(shim::Ordering::Acquire) == 0
    }
}

/// The atomics and mutex that [`AccessGuard`](crate::AccessGuard), [`LinkSlots`](crate::LinkSlots),
/// [`AccessEpochs`](crate::AccessEpochs) and [`Handoff`] are built on: std's, or loom's when built with
/// `--cfg loom`, so that the loom models (`tests/loom_guard.rs`) explore their interleavings.
pub(crate) mod shim {
    #[cfg(loom)]
    pub(crate) use loom::sync::Mutex;
    #[cfg(loom)]
    pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    #[cfg(not(loom))]
    pub(crate) use std::sync::Mutex;
    #[cfg(not(loom))]
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

    /// What a `SeqCst` store (or read-modify-write) followed by a `SeqCst` load of another atomic
    /// already promises: no thread sees both older values (store buffering is ruled out by the
    /// single total order of `SeqCst` operations). Nothing to do in a normal build. Loom models
    /// `SeqCst` loads and stores as acquire/release only, and would report that order as broken:
    /// under `--cfg loom` this is the `SeqCst` fence loom does model, which restores it.
    #[inline(always)]
    pub(crate) fn seq_cst_order() {
        #[cfg(loom)]
        loom::sync::atomic::fence(Ordering::SeqCst);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn takes_everything_even_after_a_panic() {
        let map = std::sync::Arc::new(Mutex::new(HashMap::from([(1, "a"), (2, "b")])));
        let poisoner = map.clone();
        let _ = std::thread::spawn(move || {
            let _guard = poisoner.lock().unwrap();
            panic!("poison the lock");
        })
        .join();
        let mut got = take_all(&map);
        got.sort_unstable();
        assert_eq!(got, ["a", "b"]);
        assert!(take_all(&map).is_empty());
    }
}
