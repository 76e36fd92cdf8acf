//! A counting limit for the pool's in-flight bounds (in total, and per peer).
//!
//! It does what `tokio::sync::Semaphore` does for one permit at a time, but more cheaply on the path
//! every request takes: acquiring is one compare-and-swap and releasing one atomic subtraction, where
//! tokio's semaphore locks a mutex on every release. A request through the pool takes and returns
//! two such units, and at 4 KiB transfer rates that difference shows in the middleware's overhead
//! (see `examples/tower_overhead.rs`). Waiting, the slow path, goes through a `tokio::sync::Notify`,
//! touched only while someone waits.

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// Holders take units with [`Limit::try_take`] or [`Limit::take`] and give each back with
/// [`Limit::give_back`]. No handle is returned: the holder (the service's reservation, a request's
/// claim on a peer) already keeps the limit alive, so a unit needs no reference count of its own,
/// and every `Arc` clone saved is one less cache line moved between cores per request.
pub(crate) struct Limit {
    used: AtomicUsize,
    max: usize,
    /// Takers that found the limit reached and wait for a unit to come back.
    waiting: AtomicUsize,
    released: Notify,
}

/// Counts a waiter in [`Limit::take`] for as long as it waits, including when the wait is dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Limit {
    pub(crate) fn new(max: usize) -> Self {
        Limit {
            used: AtomicUsize::new(0),
            max,
            waiting: AtomicUsize::new(0),
            released: Notify::new(),
        }
    }

    /// Units held now.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Takes a unit if one is free; the caller then owes one [`give_back`](Self::give_back).
    pub(crate) fn try_take(&self) -> bool {
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < self.max).then_some(n + 1))
            .is_ok()
    }

    /// Returns a unit taken by [`try_take`](Self::try_take) or [`take`](Self::take).
    pub(crate) fn give_back(&self) {
        // SeqCst with the waiter's `waiting` increment and re-check: either the waiter sees this
        // release, or this release sees the waiter (Dekker's pattern).
        self.used.fetch_sub(1, Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) > 0 {
            // With nobody registered yet this stores a wakeup for the next waiter: a spurious wakeup
            // at worst, which the loop in `take` absorbs.
            self.released.notify_one();
        }
    }

    /// Waits for a free unit and takes it. Cancel-safe: a wait dropped before it returns holds
    /// nothing, since the unit is taken only in the step that returns.
    pub(crate) async fn take(&self) {
        loop {
            if self.try_take() {
                return;
            }
            let mut released = std::pin::pin!(self.released.notified());
            self.waiting.fetch_add(1, Ordering::SeqCst);
            let _waiting = Waiting(&self.waiting);
            // Registered before the re-check, so that a release between the two still wakes us.
            released.as_mut().enable();
            if self.try_take() {
                return;
            }
            released.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use futures::FutureExt;

    use super::*;

    #[test]
    fn counts_and_releases() {
        let limit = Limit::new(2);
        assert!(limit.try_take());
        assert!(limit.try_take());
        assert!(!limit.try_take());
        assert_eq!(limit.used(), 2);
        limit.give_back();
        assert_eq!(limit.used(), 1);
        assert!(limit.try_take());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiters_are_woken_by_releases() {
        let limit = Arc::new(Limit::new(1));
        assert!(limit.try_take());
        let waiters: Vec<_> = (0..8)
            .map(|_| {
                let limit = limit.clone();
                tokio::spawn(async move {
                    limit.take().await;
                    tokio::task::yield_now().await;
                    limit.give_back();
                })
            })
            .collect();
        tokio::task::yield_now().await;
        limit.give_back();
        for w in waiters {
            tokio::time::timeout(Duration::from_secs(10), w)
                .await
                .expect("a waiter was never woken")
                .unwrap();
        }
        assert_eq!(limit.used(), 0);
        assert_eq!(limit.waiting.load(Ordering::SeqCst), 0);
    }

    /// Takers racing on a small limit, some with `try_take` and falling back to `take`: never more
    /// holders than the limit, and every taker gets through.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn racing_takers_never_exceed_the_limit_and_none_is_stranded() {
        let limit = Arc::new(Limit::new(2));
        let holders = Arc::new(AtomicUsize::new(0));
        let takers: Vec<_> = (0..8)
            .map(|t| {
                let (limit, holders) = (limit.clone(), holders.clone());
                tokio::spawn(async move {
                    for i in 0..2000 {
                        if (t + i) % 3 == 0 || !limit.try_take() {
                            limit.take().await;
                        }
                        assert!(
                            holders.fetch_add(1, Ordering::SeqCst) < 2,
                            "more holders than the limit"
                        );
                        if i % 7 == 0 {
                            tokio::task::yield_now().await;
                        }
                        holders.fetch_sub(1, Ordering::SeqCst);
                        limit.give_back();
                    }
                })
            })
            .collect();
        for t in takers {
            tokio::time::timeout(Duration::from_secs(30), t)
                .await
                .expect("a taker was stranded")
                .unwrap();
        }
        assert_eq!(limit.used(), 0);
    }

    #[test]
    fn a_cancelled_acquire_leaves_no_trace() {
        let limit = Limit::new(1);
        assert!(limit.try_take());
        let mut waiting = Box::pin(limit.take());
        assert!(waiting.as_mut().now_or_never().is_none());
        assert_eq!(limit.waiting.load(Ordering::SeqCst), 1);
        drop(waiting);
        assert_eq!(limit.waiting.load(Ordering::SeqCst), 0);
        assert_eq!(limit.used(), 1, "a dropped wait took nothing");
        limit.give_back();
        assert!(limit.take().now_or_never().is_some());
        assert_eq!(limit.used(), 1);
    }
}
