//! Loom models of the access guard, the link slots, the access epochs a revoke waits on, the
//! write-through handoff of a TCP stream and the lending table of a same-host link: every
//! interleaving of a few threads.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p ferry-core --release --test loom_guard` (`cargo xtask
//! test` does, with its own target folder). Without `--cfg loom` this file is empty.
#![cfg(loom)]

use std::sync::Arc;

use ferry_core::sync::{Handoff, Lendings};
use ferry_core::{AccessEpochs, AccessGuard, LinkSlots};
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::{Mutex, RwLock};
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

/// One operation under a grant, as a target runs it: counted in its epoch first, then the grant
/// checked (under the lock a region's grants are kept behind); `inside` counts operations that
/// passed the check and have not ended.
fn operation(epochs: &Arc<AccessEpochs>, granted: &RwLock<bool>, inside: &AtomicUsize) {
    let ticket = epochs.begin();
    if *granted.read().unwrap() {
        inside.fetch_add(1, Ordering::SeqCst);
        // The access itself would be here.
        inside.fetch_sub(1, Ordering::SeqCst);
    }
    drop(ticket);
}

/// Runs `ops` operations on another thread while the grant is taken away and revoked, the first
/// revoke giving up at once when `first_gives_up`, the one after it waiting until settled: then no
/// operation that passed the old grant may still be under way.
fn revoke_during(ops: usize, first_gives_up: bool) {
    loom::model(move || {
        let epochs = Arc::new(AccessEpochs::default());
        let granted = Arc::new(RwLock::new(true));
        let inside = Arc::new(AtomicUsize::new(0));
        let worker = {
            let (epochs, granted, inside) = (epochs.clone(), granted.clone(), inside.clone());
            thread::spawn(move || {
                for _ in 0..ops {
                    operation(&epochs, &granted, &inside);
                }
            })
        };
        *granted.write().unwrap() = false;
        if first_gives_up {
            // Its deadline passed at once.
            drop(epochs.advance().expect("the first advance"));
        }
        let wait = epochs.advance().expect("one advance at a time");
        while !wait.settled() {
            thread::yield_now();
        }
        let left = inside.load(Ordering::SeqCst);
        assert_eq!(left, 0, "an operation of the old grant outlived the revoke");
        drop(wait);
        worker.join().unwrap();
    });
}

/// A revoke takes the grant away, advances the epoch and waits for it to settle, while another
/// thread runs operations: once settled, no operation that passed the old grant is still under way.
#[test]
fn a_settled_revoke_has_no_operation_of_the_old_grant_left() {
    revoke_during(2, false);
}

/// A revoke that gave up before its epoch settled leaves that epoch's operations sharing a counter
/// with newer ones: the next revoke still waits for them.
#[test]
fn a_revoke_after_one_that_gave_up_still_waits_for_the_old_operations() {
    revoke_during(1, true);
}

/// Advances are one at a time: a second while the first's wait lives gets `None`.
#[test]
fn one_advance_at_a_time() {
    loom::model(|| {
        let epochs = Arc::new(AccessEpochs::default());
        let other = {
            let epochs = epochs.clone();
            thread::spawn(move || epochs.advance().map(|w| w.settled()).is_some())
        };
        let mine = epochs.advance().is_some();
        let theirs = other.join().unwrap();
        assert!(mine || theirs, "one of two advances gets through");
    });
}

/// Two revokes in turn, each waiting until settled, while an operation runs: the operation is
/// counted under the epoch it will be waited in even when an advance overtakes its start, so the
/// second revoke also waits for an operation that passed the grants the first one left.
#[test]
fn each_of_two_revokes_waits_for_the_operations_of_the_grants_before_it() {
    loom::model(|| {
        let epochs = Arc::new(AccessEpochs::default());
        // The grants' generation: revoke k sets k.
        let generation = Arc::new(RwLock::new(0usize));
        // Operations inside, by the generation they passed under.
        let inside: Arc<[AtomicUsize; 3]> = Arc::new(Default::default());
        let worker = {
            let (epochs, generation, inside) = (epochs.clone(), generation.clone(), inside.clone());
            thread::spawn(move || {
                let ticket = epochs.begin();
                let g = *generation.read().unwrap();
                inside[g].fetch_add(1, Ordering::SeqCst);
                // The access itself would be here.
                inside[g].fetch_sub(1, Ordering::SeqCst);
                drop(ticket);
            })
        };
        for k in 1..=2 {
            *generation.write().unwrap() = k;
            let wait = epochs.advance().expect("one advance at a time");
            while !wait.settled() {
                thread::yield_now();
            }
            for (g, count) in inside.iter().enumerate().take(k) {
                assert_eq!(
                    count.load(Ordering::SeqCst),
                    0,
                    "revoke {k} settled with an operation of grants {g} inside"
                );
            }
        }
        worker.join().unwrap();
    });
}

/// A TCP stream's two ways into its writer (see `Handoff`), as `ferry-tcp`'s link takes them: a
/// caller queues frame 1 for the write task; once that submission has returned, another caller
/// submits frame 2 and writes it itself if it may, else queues it too. The task takes queued frames
/// one at a time, puts each into the writer under its lock and only then takes its count back.
/// Whatever the interleaving, the writer holds 1 before 2. (Taking the count back before the frame
/// is in the writer, or checking it only before the lock, lets 2 overtake: this model then fails.)
#[test]
fn write_through_never_overtakes_a_queued_frame() {
    loom::model(|| {
        let handoff = Arc::new(Handoff::new());
        // The task's queue (an unbounded channel in the link) and the writer.
        let queue = Arc::new(Mutex::new(std::collections::VecDeque::new()));
        let writer = Arc::new(Mutex::new(Vec::new()));
        let first_submitted = Arc::new(loom::sync::atomic::AtomicBool::new(false));

        let task = {
            let (handoff, queue, writer) = (handoff.clone(), queue.clone(), writer.clone());
            thread::spawn(move || {
                let mut placed = 0;
                while placed < 2 {
                    let next = queue.lock().unwrap().pop_front();
                    let Some(frame) = next else {
                        // Frame 2 may have gone straight into the writer.
                        if writer.lock().unwrap().len() == 2 {
                            return;
                        }
                        thread::yield_now();
                        continue;
                    };
                    let mut w = writer.lock().unwrap();
                    w.push(frame);
                    handoff.placed();
                    placed = w.len();
                }
            })
        };
        let second = {
            let (handoff, queue, writer, first_submitted) =
                (handoff.clone(), queue.clone(), writer.clone(), first_submitted.clone());
            thread::spawn(move || {
                while !first_submitted.load(Ordering::Acquire) {
                    thread::yield_now();
                }
                if handoff.nothing_queued()
                    && let Ok(mut w) = writer.try_lock()
                    && handoff.nothing_queued()
                {
                    w.push(2);
                    return;
                }
                handoff.queue();
                queue.lock().unwrap().push_back(2);
            })
        };
        handoff.queue();
        queue.lock().unwrap().push_back(1);
        first_submitted.store(true, Ordering::Release);

        second.join().unwrap();
        task.join().unwrap();
        assert_eq!(*writer.lock().unwrap(), vec![1, 2]);
    });
}

/// What a same-host link keeps of a region its peer lent (a mapping): the copies that use it hold a
/// permit of its guard, and giving it back closes the guard, waits for them, and unmaps.
#[derive(Default)]
struct Lent {
    users: AccessGuard,
    given_back: AtomicUsize,
}

fn give_back(lent: &Lent) {
    lent.users.close();
    loom::future::block_on(lent.users.drained());
    lent.given_back.fetch_add(1, Ordering::SeqCst);
}

/// The shared-memory link's lending table: the peer's answer lends a region (on the reader's thread)
/// while the link closes (on another) and a transfer uses whatever is lent. Whatever the order, the
/// region is given back exactly once, by the close or, arriving after it, by the answer's handler, and
/// no copy runs on it once it was given back. (Without the table's `closed` mark, a lending that
/// came after the close stayed lent to a closed link: this model finds that order.)
#[test]
fn a_late_lending_is_given_back_after_close() {
    loom::model(|| {
        let table: Arc<Lendings<u64, Lent>> = Arc::new(Lendings::new());
        let lent = Arc::new(Lent::default());
        let reader = {
            let (table, lent) = (table.clone(), lent.clone());
            thread::spawn(move || {
                if let Err(late) = table.lent(1, lent) {
                    give_back(&late);
                }
            })
        };
        let transfer = {
            let table = table.clone();
            thread::spawn(move || {
                if let Some(lent) = table.lent_of(&1)
                    && let Some(_copying) = lent.users.enter()
                {
                    assert_eq!(
                        lent.given_back.load(Ordering::SeqCst),
                        0,
                        "a copy on a region given back"
                    );
                }
            })
        };
        for closed in table.close() {
            give_back(&closed);
        }
        reader.join().unwrap();
        transfer.join().unwrap();
        assert_eq!(lent.given_back.load(Ordering::SeqCst), 1, "given back exactly once");
        assert!(table.lent_of(&1).is_none(), "nothing stays lent to a closed link");
    });
}
