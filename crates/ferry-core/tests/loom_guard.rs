//! Loom models of the access guard and the link slots: every interleaving of a few threads.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p ferry-core --release --test loom_guard` (`cargo xtask
//! test` does, with its own target folder). Without `--cfg loom` this file is empty.
#![cfg(loom)]

use std::sync::Arc;

use ferry_core::{AccessGuard, LinkSlots};
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;

/// A thread enters (twice, one access after the other) while the main thread closes and waits for the
/// drain: once the drain is observed, no thread is inside an access and no later `enter` succeeds.
/// (Two entering threads as well as the closer take minutes to explore; one thread with two accesses
/// covers the same orders of enter, release and close.)
#[test]
fn enter_races_close() {
    loom::model(|| {
        let guard = Arc::new(AccessGuard::new());
        let inside = Arc::new(AtomicUsize::new(0));
        let entering = {
            let (guard, inside) = (guard.clone(), inside.clone());
            thread::spawn(move || {
                for _ in 0..2 {
                    if let Some(permit) = guard.enter() {
                        inside.fetch_add(1, Ordering::SeqCst);
                        // The access itself would be here.
                        inside.fetch_sub(1, Ordering::SeqCst);
                        drop(permit);
                    }
                }
            })
        };
        assert!(guard.close() <= 1);
        loom::future::block_on(guard.drained());
        assert_eq!(inside.load(Ordering::SeqCst), 0);
        assert_eq!(guard.held(), 0);
        assert!(guard.enter().is_none());
        entering.join().unwrap();
        assert!(guard.enter_owned().is_none());
        assert!(guard.is_drained());
    });
}

/// A `drained()` future awaited on one thread is woken by the last release on another (a lost wakeup
/// would leave `block_on` parked forever, which loom reports as a deadlock).
#[test]
fn last_release_wakes_drained() {
    loom::model(|| {
        let guard = Arc::new(AccessGuard::new());
        let a = guard.enter_owned().expect("open guard");
        let b = guard.enter_owned().expect("open guard");
        let releaser = thread::spawn(move || {
            drop(a);
            drop(b);
        });
        assert!(guard.close() <= 2);
        loom::future::block_on(guard.drained());
        assert!(guard.is_drained());
        releaser.join().unwrap();
    });
}

/// The close itself wakes a waiter when nothing is held: the future is polled before the close on
/// another thread.
#[test]
fn close_wakes_drained() {
    loom::model(|| {
        let guard = Arc::new(AccessGuard::new());
        let permit = guard.enter_owned().expect("open guard");
        let closer = {
            let guard = guard.clone();
            thread::spawn(move || {
                drop(permit);
                guard.close();
            })
        };
        loom::future::block_on(guard.drained());
        assert!(guard.is_drained());
        closer.join().unwrap();
    });
}

/// Two threads race for the engine's last link slot: at most `max` are ever held at once, and every
/// slot is given back.
#[test]
fn link_slots_race_for_the_last_slot() {
    loom::model(|| {
        const MAX: usize = 2;
        let slots = Arc::new(LinkSlots::new(MAX));
        let first = slots.acquire().expect("a free slot");
        let held = Arc::new(AtomicUsize::new(1));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (slots, held) = (slots.clone(), held.clone());
                thread::spawn(move || match slots.acquire() {
                    Ok(slot) => {
                        let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                        assert!(now <= MAX, "{now} slots held, at most {MAX} allowed");
                        held.fetch_sub(1, Ordering::SeqCst);
                        drop(slot);
                        true
                    }
                    Err(_) => false,
                })
            })
            .collect();
        let won: usize = threads.into_iter().map(|t| usize::from(t.join().unwrap())).sum();
        assert!(won >= 1, "one slot was free, so at least one racer gets it");
        assert_eq!(slots.used(), 1);
        drop(first);
        assert_eq!(slots.used(), 0);
    });
}
