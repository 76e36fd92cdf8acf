//! Waiting for an engine's future from a thread outside the runtime, as the C API's `TransferSync` and
//! Python's `transfer_blocking` do, or for a while before handing it to the runtime, as Python's
//! awaited `transfer` does.
//!
//! [`block_on`] runs the future on the calling thread as `Runtime::block_on` does, except that while
//! the future is pending the thread first watches for its wake-up, [`SPIN`] in all, and only then
//! parks.
//! A small transfer is a round trip of a few microseconds of work; a thread that parks at once is
//! woken by a futex from the runtime worker that completes it, and on a virtual machine that wake-up
//! (an inter-processor interrupt, a context switch each way) costs more than the transfer: with
//! the caller parked at once, 42 % of the samples of a 64-byte blocking round trip from Python were
//! thread wake-ups and switches. A thread still watching when the wake comes sees a flag, and no
//! system call is made on either side.
//!
//! [`poll_for`] is the watching part alone: it gives up after its budget and leaves the future
//! pending, to be spawned on the runtime, so that a caller with other work (an event loop) waits
//! for a small transfer at the price of a spin and for a large one no longer than the budget.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use tokio::runtime::{Runtime, RuntimeFlavor};

/// How long [`block_on`] watches for its future's wake-ups, in all, before it parks the thread at
/// each: about three round trips of a small transfer over loopback TCP on a small machine (15 µs
/// each). A budget per call, not per wait: a long transfer woken many times on its way costs the
/// caller's core at most this much, not this much per wake-up.
pub const SPIN: Duration = Duration::from_micros(50);

/// Runs `future` to completion on the calling thread, which must not be one of `runtime`'s workers
/// (as for `Runtime::block_on`). On a multi-thread runtime the future is polled here and its I/O is
/// driven by the workers, watching for wake-ups for [`SPIN`] in all before it parks; on a current-thread runtime,
/// whose I/O and timers only the blocked thread can drive, it is `Runtime::block_on`.
pub fn block_on<F: Future>(runtime: &Runtime, future: F) -> F::Output {
    if runtime.handle().runtime_flavor() != RuntimeFlavor::MultiThread {
        return runtime.block_on(future);
    }
    // Timers and spawns inside the future find the runtime.
    let _runtime = runtime.enter();
    let watch = Watch::new();
    let mut future = std::pin::pin!(future);
    let spin_until = Instant::now() + SPIN;
    loop {
        if let Poll::Ready(output) = watch.poll(future.as_mut()) {
            return output;
        }
        if !watch.woken_before(spin_until) {
            watch.park_until_woken();
        }
    }
}

/// Polls `future` on the calling thread (not one of `runtime`'s workers) for at most `budget`,
/// polling again each time it is woken meanwhile: its output if it finished within the budget, else
/// `Pending`, the future left as it stands, to be polled to its end elsewhere (a task of the
/// runtime: its next poll there moves its wake-ups to that task). On a current-thread runtime, whose
/// I/O only its own thread drives, it polls once and does not wait.
pub fn poll_for<F: Future + ?Sized>(runtime: &Runtime, mut future: Pin<&mut F>, budget: Duration) -> Poll<F::Output> {
    let _runtime = runtime.enter();
    let watch = Watch::new();
    let until = match runtime.handle().runtime_flavor() {
        RuntimeFlavor::MultiThread => Instant::now() + budget,
        _ => Instant::now(),
    };
    loop {
        if let Poll::Ready(output) = watch.poll(future.as_mut()) {
            return Poll::Ready(output);
        }
        if !watch.woken_before(until) {
            return Poll::Pending;
        }
    }
}

/// A waker for the calling thread, and the wait for it.
struct Watch {
    woken: Arc<Woken>,
    waker: Waker,
}

impl Watch {
    fn new() -> Self {
        let woken = Arc::new(Woken {
            flag: AtomicBool::new(false),
            thread: std::thread::current(),
        });
        let waker = Waker::from(woken.clone());
        Watch { woken, waker }
    }

    fn poll<F: Future + ?Sized>(&self, future: Pin<&mut F>) -> Poll<F::Output> {
        future.poll(&mut Context::from_waker(&self.waker))
    }

    /// Watches for a wake-up until `until`: true if one came (and is consumed).
    fn woken_before(&self, until: Instant) -> bool {
        loop {
            if self.woken.flag.swap(false, Ordering::AcqRel) {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            // Not `yield_now`: with it the Python round trip's p50 was 42-45 µs in three runs of
            // four, against 24-27 µs spinning.
            std::hint::spin_loop();
        }
    }

    /// Parks the thread until a wake-up comes, and consumes it.
    fn park_until_woken(&self) {
        while !self.woken.flag.swap(false, Ordering::AcqRel) {
            // Returns at once if an unpark came since; a spurious return re-checks the flag.
            std::thread::park();
        }
    }
}

/// The waker of a [`Watch`]'s thread.
struct Woken {
    flag: AtomicBool,
    thread: std::thread::Thread,
}

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.flag.store(true, Ordering::Release);
        // A futex wake only if the thread is parked; an atomic store while it watches.
        self.thread.unpark();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_future_woken_late_from_a_worker_completes_and_timers_work() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        // Completed by a worker after the caller has parked (well past SPIN).
        let (tx, rx) = tokio::sync::oneshot::channel();
        runtime.spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            let _ = tx.send(7u32);
        });
        let started = Instant::now();
        assert_eq!(block_on(&runtime, rx).ok(), Some(7));
        assert!(started.elapsed() >= Duration::from_millis(25));
        // A timer made inside the future, on this thread, needs the runtime's context.
        let slept = block_on(&runtime, async {
            let t = Instant::now();
            tokio::time::sleep(Duration::from_millis(5)).await;
            t.elapsed()
        });
        assert!(slept >= Duration::from_millis(5));
        // Many quick completions, some found while watching, some after parking.
        for i in 0..200u32 {
            let (tx, rx) = tokio::sync::oneshot::channel();
            runtime.spawn(async move {
                if i % 7 == 0 {
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
                let _ = tx.send(i);
            });
            assert_eq!(block_on(&runtime, rx).ok(), Some(i));
        }
    }

    #[test]
    fn poll_for_returns_what_finishes_within_its_budget_and_hands_on_the_rest() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        // Finished by a worker while the caller watches: found, with no parking.
        for i in 0..100u32 {
            let (tx, rx) = tokio::sync::oneshot::channel();
            runtime.spawn(async move {
                let _ = tx.send(i);
            });
            let mut rx = std::pin::pin!(rx);
            match poll_for(&runtime, rx.as_mut(), Duration::from_secs(5)) {
                Poll::Ready(got) => assert_eq!(got.ok(), Some(i)),
                Poll::Pending => panic!("a value sent at once was not seen within 5 s"),
            }
        }
        // Not finished within the budget: pending after about the budget, and the same future,
        // spawned on the runtime, finishes there when its value comes.
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let mut rx = Box::pin(rx);
        let started = Instant::now();
        assert!(poll_for(&runtime, rx.as_mut(), Duration::from_millis(2)).is_pending());
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(2), "gave up after {waited:?}");
        let handed_on = runtime.spawn(rx);
        tx.send(9).unwrap();
        let got = block_on(&runtime, async {
            tokio::time::timeout(Duration::from_secs(5), handed_on).await
        });
        assert_eq!(got.ok().and_then(|joined| joined.ok()).and_then(|r| r.ok()), Some(9));
        // A timer started during the watch belongs to the runtime, and fires after the handover.
        let mut nap = {
            let _runtime = runtime.enter();
            Box::pin(tokio::time::sleep(Duration::from_millis(20)))
        };
        assert!(poll_for(&runtime, nap.as_mut(), Duration::from_micros(100)).is_pending());
        let napped = block_on(&runtime, async {
            tokio::time::timeout(Duration::from_secs(5), runtime.spawn(nap)).await
        });
        assert!(matches!(napped, Ok(Ok(()))));
    }

    #[test]
    fn poll_for_on_a_current_thread_runtime_polls_once() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let started = Instant::now();
        let mut never = std::pin::pin!(std::future::pending::<()>());
        assert!(poll_for(&runtime, never.as_mut(), Duration::from_secs(5)).is_pending());
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(
            poll_for(&runtime, std::pin::pin!(async { 3 }), Duration::ZERO),
            Poll::Ready(3)
        );
    }

    #[test]
    fn a_current_thread_runtime_is_driven_by_the_caller() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let out = block_on(&runtime, async {
            tokio::time::sleep(Duration::from_millis(2)).await;
            5
        });
        assert_eq!(out, 5);
    }
}
