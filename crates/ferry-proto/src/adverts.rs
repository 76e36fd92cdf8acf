//! Region updates on their way to one link's initiator.
//!
//! A target tells each link's initiator about every region it registers or deregisters, on the
//! control stream. An initiator that does not read fast enough must not make the target buffer
//! without bound, nor may it miss an update for good: when more than [`LinkLimits::advert_queue`]
//! updates wait, they are all dropped and replaced by one resend of the whole table
//! ([`Frame::RegionTable`]), read from the region table when it is about to be sent, so that it
//! holds every change made before it. Updates queued after that point follow it, so the initiator's
//! copy ends equal to the target's table however the queue overflowed.
//!
//! [`LinkLimits::advert_queue`]: crate::LinkLimits::advert_queue

use std::collections::VecDeque;

use ferry_core::codec::Frame;
use ferry_core::{RegionAd, RegionChange};

/// One link's queue of region updates, bounded, with resynchronisation on overflow.
#[derive(Debug)]
pub struct AdvertQueue {
    queue: VecDeque<Frame>,
    cap: usize,
    resync: bool,
    resyncs: u64,
    pushed: u64,
}

impl AdvertQueue {
    /// An empty queue of at most `cap` updates (at least 1).
    pub fn new(cap: usize) -> Self {
        AdvertQueue {
            queue: VecDeque::new(),
            cap: cap.max(1),
            resync: false,
            resyncs: 0,
            pushed: 0,
        }
    }

    /// Changes pushed so far. Once [`poll_transmit`](Self::poll_transmit) returned `None`, what it
    /// returned reflects every one of them: a caller that waits for a link to have sent a change
    /// notes this count after pushing it.
    pub fn pushed(&self) -> u64 {
        self.pushed
    }

    /// Queues one change; past the bound, drops every queued update and asks for the whole table.
    pub fn push(&mut self, change: &RegionChange) {
        self.pushed += 1;
        if self.resync {
            // The table read at the next transmit includes this change.
            return;
        }
        if self.queue.len() >= self.cap {
            self.queue.clear();
            self.resync = true;
            self.resyncs += 1;
            tracing::debug!(
                cap = self.cap,
                "region updates overflowed a link's queue; the whole table follows"
            );
            return;
        }
        self.queue.push_back(match change {
            RegionChange::Added(ad) => Frame::RegionAdded(ad.clone()),
            RegionChange::Removed(key) => Frame::RegionRemoved { key: *key },
        });
    }

    /// The next frame to send, if any; `table` reads the current region table, and is called only
    /// when the whole table is due.
    pub fn poll_transmit(&mut self, table: impl FnOnce() -> Vec<RegionAd>) -> Option<Frame> {
        if std::mem::take(&mut self.resync) {
            return Some(Frame::RegionTable { regions: table() });
        }
        self.queue.pop_front()
    }

    /// Whether nothing is due.
    pub fn is_empty(&self) -> bool {
        !self.resync && self.queue.is_empty()
    }

    /// How often the queue overflowed.
    pub fn resyncs(&self) -> u64 {
        self.resyncs
    }
}

#[cfg(test)]
mod tests {
    use ferry_core::{Access, RegionKey, RemoteRegions};
    use proptest::prelude::*;

    use super::*;
    use crate::initiator::RegionUpdate;

    fn ad(key: u64) -> RegionAd {
        RegionAd {
            key: RegionKey(key),
            addr: key << 20,
            len: 4096,
            access: Access::READ_WRITE,
            persistent: false,
            staged: false,
            transport_keys: Vec::new(),
        }
    }

    proptest! {
        /// Whatever the bound and however sending interleaves with changes, the initiator's copy ends
        /// equal to the target's table.
        #[test]
        fn the_initiators_table_converges(
            cap in 1usize..6,
            steps in proptest::collection::vec((any::<bool>(), 0u64..12, 0u8..4), 0..120),
        ) {
            let mut target: std::collections::BTreeMap<u64, RegionAd> = Default::default();
            let mut initial = RemoteRegions::default();
            let mut q = AdvertQueue::new(cap);
            for (add, key, sends) in steps {
                let change = if add {
                    target.insert(key, ad(key));
                    RegionChange::Added(ad(key))
                } else {
                    target.remove(&key);
                    RegionChange::Removed(RegionKey(key))
                };
                q.push(&change);
                for _ in 0..sends {
                    let Some(frame) = q.poll_transmit(|| target.values().cloned().collect()) else { break };
                    RegionUpdate::from_frame(frame).expect("region frames only").apply(&mut initial).unwrap();
                }
            }
            while let Some(frame) = q.poll_transmit(|| target.values().cloned().collect()) {
                RegionUpdate::from_frame(frame).expect("region frames only").apply(&mut initial).unwrap();
            }
            let mut got: Vec<u64> = initial.iter().map(|a| a.key.0).collect();
            got.sort_unstable();
            prop_assert_eq!(got, target.keys().copied().collect::<Vec<_>>());
            prop_assert!(q.is_empty());
        }
    }

    #[test]
    fn an_overflow_is_one_table() {
        let mut q = AdvertQueue::new(2);
        for k in 0..5 {
            q.push(&RegionChange::Added(ad(k)));
        }
        assert_eq!(q.resyncs(), 1);
        let table: Vec<RegionAd> = (0..5).map(ad).collect();
        assert_eq!(
            q.poll_transmit(|| table.clone()),
            Some(Frame::RegionTable { regions: table })
        );
        assert_eq!(q.poll_transmit(Vec::new), None);
    }
}
