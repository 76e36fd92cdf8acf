//! A counting limit for the pool's in-flight bounds (in total, and per peer).
//!
//! It does what `tokio::sync::Semaphore` does for one permit at a time, but more cheaply on the path
//! every request takes: acquiring is one compare-and-swap and releasing one atomic subtraction, where
//! tokio's semaphore locks a mutex on every release. A request through the pool takes and returns
//! two such permits, and at 4 KiB transfer rates that difference shows in the middleware's overhead
//! (see `examples/tower_overhead.rs`). Waiting, the slow path, goes through a `tokio::sync::Notify`,
//! touched only while someone waits.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

pub(crate) struct Limit {
    used: AtomicUsize,
    max: usize,
    /// Acquirers that found the limit reached and wait for a release.
    waiting: AtomicUsize,
    released: Notify,
}

/// One unit of a [`Limit`], returned when dropped.
pub(crate) struct Permit {
    limit: Arc<Limit>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        // SeqCst with the waiter's `waiting` increment and re-check: either the waiter sees this
        // release, or this release sees the waiter (Dekker's pattern).
        self.limit.used.fetch_sub(1, Ordering::SeqCst);
        if self.limit.waiting.load(Ordering::SeqCst) > 0 {
            // With nobody registered yet this stores a wakeup for the next waiter: a spurious wakeup
            // at worst, which the acquire loop absorbs.
            self.limit.released.notify_one();
        }
    }
}

/// Counts a waiter while it lives, so that a cancelled acquire does not leave the count raised.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Limit {
    /// A limit of `max` units; `max` is at least 1 (the pool's configuration checks it).
    pub(crate) fn new(max: usize) -> Arc<Self> {
        Arc::new(Limit {
            used: AtomicUsize::new(0),
            max,
            waiting: AtomicUsize::new(0),
            released: Notify::new(),
        })
    }

    /// Units taken now.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// A unit if one is free now.
    pub(crate) fn try_acquire(self: &Arc<Self>) -> Option<Permit> {
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < self.max).then_some(n + 1))
            .ok()
            .map(|_| Permit { limit: self.clone() })
    }

    /// A unit, waiting for one to be released if none is free. Cancel-safe.
    pub(crate) async fn acquire(self: Arc<Self>) -> Permit {
        loop {
            if let Some(permit) = self.try_acquire() {
                return permit;
            }
            let mut released = std::pin::pin!(self.released.notified());
            self.waiting.fetch_add(1, Ordering::SeqCst);
            let _waiting = Waiting(&self.waiting);
            // Registered before the re-check, so that a release between the two is not missed.
            released.as_mut().enable();
            if let Some(permit) = self.try_acquire() {
                return permit;
            }
            released.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::FutureExt;

    use super::*;

    #[test]
    fn counts_and_releases() {
        let limit = Limit::new(2);
        let a = limit.try_acquire().unwrap();
        let _b = limit.try_acquire().unwrap();
        assert!(limit.try_acquire().is_none());
        assert_eq!(limit.used(), 2);
        drop(a);
        assert_eq!(limit.used(), 1);
        assert!(limit.try_acquire().is_some());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiters_are_woken_by_releases() {
        let limit = Limit::new(1);
        let held = limit.try_acquire().unwrap();
        let waiters: Vec<_> = (0..8)
            .map(|_| {
                let limit = limit.clone();
                tokio::spawn(async move {
                    let permit = limit.acquire().await;
                    tokio::task::yield_now().await;
                    drop(permit);
                })
            })
            .collect();
        tokio::task::yield_now().await;
        drop(held);
        for w in waiters {
            tokio::time::timeout(Duration::from_secs(10), w)
                .await
                .expect("a waiter was never woken")
                .unwrap();
        }
        assert_eq!(limit.used(), 0);
        assert_eq!(limit.waiting.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_cancelled_acquire_leaves_no_trace() {
        let limit = Limit::new(1);
        let held = limit.try_acquire().unwrap();
        let mut waiting = Box::pin(limit.clone().acquire());
        assert!(waiting.as_mut().now_or_never().is_none());
        assert_eq!(limit.waiting.load(Ordering::SeqCst), 1);
        drop(waiting);
        assert_eq!(limit.waiting.load(Ordering::SeqCst), 0);
        drop(held);
        assert!(limit.clone().acquire().now_or_never().is_some());
    }
}
