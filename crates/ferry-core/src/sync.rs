//! Lock helpers the transports share, and the atomics and mutex of the access guard and the link
//! slots (`shim`).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::{Arc, Mutex, PoisonError};

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

/// What a peer lent this process, by the key it names each by: asked for, lent, or declined; and,
/// once the link ends ([`close`](Self::close)), nothing more. A same-host link keeps the regions
/// its target lent it (mapped into this process) here.
///
/// The rule it keeps: whatever is lent is given back once. [`close`](Self::close) hands back
/// everything lent so far and closes the table under the same lock, so an answer that arrives after
/// it (a `lent` reply already on its way when the link was closed) is refused and handed straight back
/// to its caller to give back, instead of staying lent to a link nobody closes again. Reads (every
/// transfer looks its regions up) take a shard of a [`ShardedLock`]. The loom model
/// `a_late_lending_is_given_back_after_close` (`tests/loom_guard.rs`) explores a lending, a close
/// and a transfer using the lent thing.
pub struct Lendings<K, M, S = std::collections::hash_map::RandomState> {
    table: shim::RwLock<LendingTable<K, M, S>>,
}

struct LendingTable<K, M, S> {
    by_key: HashMap<K, Lending<M>, S>,
    closed: bool,
}

/// What a [`Lendings`] table knows of one key.
#[derive(Debug)]
pub enum Lending<M> {
    /// Asked for; no answer yet.
    Asking,
    /// Lent, and in use here.
    Lent(Arc<M>),
    /// The peer does not lend it.
    Declined,
}

/// A read view of a [`Lendings`] table (see [`Lendings::read`]).
pub struct LendingsRead<'a, K, M, S> {
    table: shim::RwLockReadGuard<'a, LendingTable<K, M, S>>,
}

impl<K: Hash + Eq, M, S: BuildHasher> LendingsRead<'_, K, M, S> {
    /// What is known of `key`.
    pub fn get(&self, key: &K) -> Option<&Lending<M>> {
        self.table.by_key.get(key)
    }

    /// Whether `key` was asked for (answered or not).
    pub fn contains(&self, key: &K) -> bool {
        self.table.by_key.contains_key(key)
    }
}

impl<K: Hash + Eq + Copy, M, S: BuildHasher + Default> Default for Lendings<K, M, S> {
    fn default() -> Self {
        Lendings {
            table: shim::RwLock::new(LendingTable {
                by_key: HashMap::default(),
                closed: false,
            }),
        }
    }
}

impl<K: Hash + Eq + Copy, M, S: BuildHasher + Default> Lendings<K, M, S> {
    /// Nothing asked for.
    pub fn new() -> Self {
        Self::default()
    }

    fn write(&self) -> shim::RwLockWriteGuard<'_, LendingTable<K, M, S>> {
        self.table.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// The table as it is now, for looking up many keys under one read lock.
    pub fn read(&self) -> LendingsRead<'_, K, M, S> {
        LendingsRead {
            table: self.table.read().unwrap_or_else(PoisonError::into_inner),
        }
    }

    /// The lent thing of `key`, if it is lent.
    pub fn lent_of(&self, key: &K) -> Option<Arc<M>> {
        match self.read().get(key) {
            Some(Lending::Lent(m)) => Some(m.clone()),
            _ => None,
        }
    }

    /// Notes `keys` (those not asked for yet) as asked for, and returns them, to be asked: none
    /// once closed.
    pub fn ask(&self, keys: impl IntoIterator<Item = K>) -> Vec<K> {
        let mut table = self.write();
        if table.closed {
            return Vec::new();
        }
        let mut asked = Vec::new();
        for key in keys {
            if let std::collections::hash_map::Entry::Vacant(entry) = table.by_key.entry(key) {
                entry.insert(Lending::Asking);
                asked.push(key);
            }
        }
        asked
    }

    /// The peer lent `key`: kept, or, once closed, handed back (`Err`) to be given back now.
    pub fn lent(&self, key: K, lent: Arc<M>) -> Result<(), Arc<M>> {
        let mut table = self.write();
        if table.closed {
            return Err(lent);
        }
        table.by_key.insert(key, Lending::Lent(lent));
        Ok(())
    }

    /// The peer does not lend `key` (or what it lent could not be used).
    pub fn declined(&self, key: K) {
        let mut table = self.write();
        if !table.closed {
            table.by_key.insert(key, Lending::Declined);
        }
    }

    /// The peer asks for `key` back: what was lent, to give back (the key may be asked for again).
    pub fn take_back(&self, key: &K) -> Option<Arc<M>> {
        match self.write().by_key.remove(key) {
            Some(Lending::Lent(m)) => Some(m),
            _ => None,
        }
    }

    /// Closes the table for good: everything lent, to give back; nothing is lent after this.
    pub fn close(&self) -> Vec<Arc<M>> {
        let mut table = self.write();
        table.closed = true;
        table
            .by_key
            .drain()
            .filter_map(|(_, l)| match l {
                Lending::Lent(m) => Some(m),
                _ => None,
            })
            .collect()
    }
}

/// The atomics and locks that [`AccessGuard`](crate::AccessGuard), [`LinkSlots`](crate::LinkSlots),
/// [`AccessEpochs`](crate::AccessEpochs), [`Handoff`] and [`Lendings`] are built on: std's (and a
/// [`ShardedLock`] for reads), or loom's when built with `--cfg loom`, so that the loom models
/// (`tests/loom_guard.rs`) explore their interleavings.
pub(crate) mod shim {
    #[cfg(not(loom))]
    pub(crate) use super::{
        ShardedLock as RwLock, ShardedLockReadGuard as RwLockReadGuard, ShardedLockWriteGuard as RwLockWriteGuard,
    };
    #[cfg(loom)]
    pub(crate) use loom::sync::Mutex;
    #[cfg(loom)]
    pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    #[cfg(loom)]
    pub(crate) use loom::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
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
    fn lendings_ask_once_and_lend_nothing_after_close() {
        let table: Lendings<u64, &str> = Lendings::new();
        assert_eq!(table.ask([1, 2, 1]), [1, 2]);
        assert_eq!(table.ask([2, 3]), [3], "a key is asked for once");
        assert!(table.lent(1, Arc::new("one")).is_ok());
        table.declined(2);
        assert_eq!(table.lent_of(&1).as_deref(), Some(&"one"));
        assert!(matches!(table.read().get(&2), Some(Lending::Declined)));
        assert!(matches!(table.read().get(&3), Some(Lending::Asking)));
        assert_eq!(table.take_back(&1).as_deref(), Some(&"one"));
        assert!(table.lent_of(&1).is_none() && !table.read().contains(&1));
        assert!(table.lent(1, Arc::new("again")).is_ok());
        let given_back = table.close();
        assert_eq!(given_back.iter().map(|m| **m).collect::<Vec<_>>(), ["again"]);
        // Closed: an answer that comes now is handed back, and nothing is asked for.
        assert_eq!(table.lent(4, Arc::new("late")).map_err(|m| *m), Err("late"));
        assert!(table.ask([5]).is_empty());
        assert!(table.lent_of(&4).is_none());
    }

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
