//! Waiting for an engine's future from a thread outside the runtime, as the C API's `TransferSync` and
//! Python's `transfer_blocking` do.
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

use std::future::Future;
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
    let woken = Arc::new(Woken {
        flag: AtomicBool::new(false),
        thread: std::thread::current(),
    });
    let waker = Waker::from(woken.clone());
    let mut cx = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    let spin_until = Instant::now() + SPIN;
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        while !woken.flag.swap(false, Ordering::AcqRel) {
            match Instant::now() < spin_until {
                // Not `yield_now`: with it the Python round trip's p50 was 42-45 µs in three runs of
                // four, against 24-27 µs spinning.
                true => std::hint::spin_loop(),
                // Returns at once if an unpark came since; a spurious return re-checks the flag.
                false => std::thread::park(),
            }
        }
    }
}

/// The waker of [`block_on`]'s thread.
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
