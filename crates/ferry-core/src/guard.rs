//! The one access guard on region memory, which makes deregistration final.
//!
//! After deregistration returns, no byte of the region is touched again by anything: no CPU copy, no
//! system call reading or writing it (`read(2)`, `send(2)`, `msync(2)`), no NIC work request, no GPU
//! copy to or from a staging buffer. Every one of those holds a [`Permit`] (or an [`OwnedPermit`]) of
//! the region's [`AccessGuard`] while it touches the memory, and deregistration
//!
//! 1. [`close`](AccessGuard::close)s the guard, so that no new access starts;
//! 2. ends what only it can end (the RDMA transport halts the queue pairs whose work requests use the
//!    region and drains their completions, which releases the permits those work requests hold);
//! 3. waits until the permits still held are released ([`drained`](AccessGuard::drained) for async
//!    callers, [`wait_drained`](AccessGuard::wait_drained) for sync ones, each with a bound).
//!
//! CPU copies and system calls hold a permit for one bounded copy or non-blocking call; a NIC work
//! request holds one from its post to its completion; a staged block's GPU copy or an `msync` holds one
//! for the copy, off the runtime's threads. So waiting is short, and the async wait never blocks a
//! runtime thread: the last release wakes it.
//!
//! The counter and the waker list use `sync::shim`, which is loom's under `--cfg loom`, so
//! that `tests/loom_guard.rs` checks the interleavings.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::sync::shim::{AtomicUsize, Mutex, Ordering};

/// In [`AccessGuard::state`]: the guard is closed; the other bits count the permits held.
const CLOSED: usize = 1 << (usize::BITS - 1);
/// How often [`AccessGuard::wait_drained`] checks before it parks the thread.
const SPINS: u32 = 64;

/// Counts the accesses to a region's memory in progress, and refuses new ones once closed.
#[derive(Debug)]
pub struct AccessGuard {
    state: AtomicUsize,
    waiters: Mutex<Waiters>,
}

/// The tasks (or parked threads) waiting for the guard to drain.
#[derive(Debug, Default)]
struct Waiters {
    next_id: u64,
    list: Vec<(u64, Waker)>,
}

impl Default for AccessGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl AccessGuard {
    /// An open guard with no permit held.
    pub fn new() -> Self {
        AccessGuard {
            state: AtomicUsize::new(0),
            waiters: Mutex::new(Waiters::default()),
        }
    }

    /// Takes a permit, unless the guard is closed.
    fn acquire(&self) -> bool {
        let mut cur = self.state.load(Ordering::Acquire);
        loop {
            // Closed, or (never in practice) the count would reach the closed bit.
            if cur & CLOSED != 0 || cur + 1 == CLOSED {
                return false;
            }
            match self
                .state
                .compare_exchange(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Gives a permit back; the last one after the guard closed wakes the waiters.
    fn release(&self) {
        let prev = self.state.fetch_sub(1, Ordering::AcqRel);
        if prev == CLOSED | 1 {
            self.wake_all();
        }
    }

    /// The waiter list. Every change to it is one push, replace or removal, so a panic elsewhere
    /// while it was held leaves it whole: a poisoned lock is used as it is.
    fn lock_waiters(&self) -> impl std::ops::DerefMut<Target = Waiters> + '_ {
        self.waiters.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn wake_all(&self) {
        let woken = std::mem::take(&mut self.lock_waiters().list);
        for (_, waker) in woken {
            waker.wake();
        }
    }

    /// Starts an access for as long as the returned permit lives; `None` once the guard is closed
    /// (the region is being deregistered).
    pub fn enter(&self) -> Option<Permit<'_>> {
        self.acquire().then(|| Permit { guard: self })
    }

    /// Like [`enter`](Self::enter), with a permit that owns a handle on the guard: for an access that
    /// is held across an `.await`, moved to a blocking thread, or held by a posted NIC work request
    /// until its completion.
    pub fn enter_owned(self: &Arc<Self>) -> Option<OwnedPermit> {
        self.acquire().then(|| OwnedPermit { guard: self.clone() })
    }

    /// Refuses new permits from now on and returns how many are still held.
    pub fn close(&self) -> usize {
        let prev = self.state.fetch_or(CLOSED, Ordering::AcqRel);
        let held = prev & !CLOSED;
        if held == 0 {
            // A `drained()` polled before the close waits for this.
            self.wake_all();
        }
        held
    }

    /// Whether the guard is closed.
    pub fn is_closed(&self) -> bool {
        self.state.load(Ordering::Acquire) & CLOSED != 0
    }

    /// Permits held now.
    pub fn held(&self) -> usize {
        self.state.load(Ordering::Acquire) & !CLOSED
    }

    /// Whether the guard is closed and no permit is held: no access happens any more.
    pub fn is_drained(&self) -> bool {
        self.state.load(Ordering::Acquire) == CLOSED
    }

    /// Completes once the guard is closed and the last permit is released; woken by that release (or by
    /// the close, if none was held), never by polling. Bound it with a timeout.
    pub fn drained(&self) -> Drained<'_> {
        Drained { guard: self, id: None }
    }

    /// Blocks the calling thread until the guard is closed and drained, or `limit` passed; true once
    /// drained. Checks a few times, then parks until the last release unparks it. For sync paths
    /// (`Drop`); async code awaits [`drained`](Self::drained) instead. A `limit` too long to add to
    /// now (`Duration::MAX`) waits without a bound.
    pub fn wait_drained(&self, limit: Duration) -> bool {
        for _ in 0..SPINS {
            if self.is_drained() {
                return true;
            }
            std::hint::spin_loop();
        }
        let deadline = Instant::now().checked_add(limit);
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        let mut drained = std::pin::pin!(self.drained());
        loop {
            if drained.as_mut().poll(&mut cx).is_ready() {
                return true;
            }
            match deadline {
                None => std::thread::park(),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return false;
                    }
                    std::thread::park_timeout(deadline - now);
                }
            }
        }
    }
}

/// Wakes a thread parked in [`AccessGuard::wait_drained`].
struct Unpark(std::thread::Thread);

impl std::task::Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// The future of [`AccessGuard::drained`].
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub struct Drained<'a> {
    guard: &'a AccessGuard,
    /// Its entry in the waker list, once it registered one.
    id: Option<u64>,
}

impl Future for Drained<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let guard = self.guard;
        if guard.is_drained() {
            return Poll::Ready(());
        }
        let mut waiters = guard.lock_waiters();
        // Checked again under the lock: a release that drains the guard takes the lock after its
        // decrement, so either it sees the waker stored below or this sees its decrement.
        if guard.is_drained() {
            return Poll::Ready(());
        }
        let waiter = self.id.and_then(|id| waiters.list.iter_mut().find(|(i, _)| *i == id));
        match waiter {
            Some((_, w)) => {
                if !w.will_wake(cx.waker()) {
                    *w = cx.waker().clone();
                }
            }
            None => {
                let id = waiters.next_id;
                waiters.next_id += 1;
                waiters.list.push((id, cx.waker().clone()));
                drop(waiters);
                self.id = Some(id);
            }
        }
        Poll::Pending
    }
}

impl Drop for Drained<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.guard.lock_waiters().list.retain(|(i, _)| *i != id);
        }
    }
}

/// Permission to touch a region's memory until dropped.
#[derive(Debug)]
#[must_use = "the access ends when the permit is dropped"]
pub struct Permit<'a> {
    guard: &'a AccessGuard,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.guard.release();
    }
}

/// Permission to touch a region's memory until dropped, independent of a borrow: held across awaits,
/// by a blocking task, or by a posted NIC work request.
#[derive(Debug)]
#[must_use = "the access ends when the permit is dropped"]
pub struct OwnedPermit {
    guard: Arc<AccessGuard>,
}

impl OwnedPermit {
    /// The guard this permit is of.
    pub fn guard(&self) -> &Arc<AccessGuard> {
        &self.guard
    }
}

impl Drop for OwnedPermit {
    fn drop(&mut self) {
        self.guard.release();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::task::Wake;

    struct Flag(std::sync::atomic::AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn refuses_after_close_and_counts_held() {
        let g = Arc::new(AccessGuard::new());
        let a = g.enter().unwrap();
        let b = g.enter_owned().unwrap();
        assert_eq!(g.held(), 2);
        assert_eq!(g.close(), 2);
        assert!(g.is_closed());
        assert!(g.enter().is_none());
        assert!(g.enter_owned().is_none());
        drop(a);
        assert!(!g.is_drained());
        drop(b);
        assert!(g.is_drained());
        assert!(g.wait_drained(Duration::ZERO));
    }

    #[test]
    fn drained_is_woken_by_the_last_release() {
        let g = Arc::new(AccessGuard::new());
        let permit = g.enter_owned().unwrap();
        let flag = Arc::new(Flag(Default::default()));
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        let mut fut = std::pin::pin!(g.drained());
        // Open: pending even with nothing held.
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        assert_eq!(g.close(), 1);
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        assert!(!flag.0.load(std::sync::atomic::Ordering::SeqCst));
        // Polled again with the same waker: still one entry.
        assert_eq!(g.waiters.lock().unwrap().list.len(), 1);
        drop(permit);
        assert!(flag.0.load(std::sync::atomic::Ordering::SeqCst));
        assert!(fut.as_mut().poll(&mut cx).is_ready());
    }

    #[test]
    fn close_with_nothing_held_wakes_a_waiter() {
        let g = AccessGuard::new();
        let flag = Arc::new(Flag(Default::default()));
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        let mut fut = std::pin::pin!(g.drained());
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        assert_eq!(g.close(), 0);
        assert!(flag.0.load(std::sync::atomic::Ordering::SeqCst));
        assert!(fut.as_mut().poll(&mut cx).is_ready());
    }

    #[test]
    fn dropped_waiter_leaves_the_list() {
        let g = AccessGuard::new();
        let flag = Arc::new(Flag(Default::default()));
        let waker = Waker::from(flag);
        let mut cx = Context::from_waker(&waker);
        {
            let mut fut = std::pin::pin!(g.drained());
            assert!(fut.as_mut().poll(&mut cx).is_pending());
            assert_eq!(g.waiters.lock().unwrap().list.len(), 1);
        }
        assert!(g.waiters.lock().unwrap().list.is_empty());
    }

    #[test]
    fn wait_drained_parks_until_release_or_limit() {
        let g = Arc::new(AccessGuard::new());
        let permit = g.enter_owned().unwrap();
        g.close();
        assert!(!g.wait_drained(Duration::from_millis(20)));
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            drop(permit);
        });
        assert!(g.wait_drained(Duration::from_secs(10)));
        releaser.join().unwrap();
    }
}
