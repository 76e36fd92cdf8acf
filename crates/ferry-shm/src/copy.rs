//! Copies between a caller's memory and a mapped region, split over two threads when that pays.
//!
//! One thread's `memcpy` does not always reach the memory bandwidth of the machine: measured on one
//! 2-core development machine, 1 MiB copies ran at 21 GB/s on one thread and 36 GB/s split over
//! two, and 16 MiB copies at 13 and 26 GB/s. On another (2 cores of an AMD EPYC, 32 MiB of L3), one
//! thread copied 1 MiB at 50 GB/s and the split ran at 14: handing half a copy to another thread
//! pays only where that thread gets a core at once, and a wake-up across cores of a virtual machine
//! can cost more than the copy. So neither way is fixed. A copy of [`SPLIT_MIN`] bytes or more goes
//! the way that has been faster so far ([`Tuner`]): split, it hands its second half to a helper
//! thread (one per process, started on first use) and copies the first half itself, and returns
//! once both are done, so a copy never outlives the call that made it. A batch of many small copies
//! is split the same way, at half its bytes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// Copies of at least this many bytes may be split over two threads, where that has been faster
/// ([`Tuner`]).
pub(crate) const SPLIT_MIN: usize = 512 << 10;

/// Of every so many copies of [`SPLIT_MIN`] bytes or more ([`explore_every`], a power of two from
/// this up), [`EXPLORE_BURST`] in a row go the way that has been slower so far, to notice when that
/// changes (the other core's load comes and goes).
const EXPLORE_EVERY_MIN: u64 = 256;

/// The most bytes of large copies between two bursts of exploring: about 0.3 s of copying at
/// 50 GB/s, so that a way that became the faster one is found within that.
const EXPLORE_AT_LEAST_EVERY_BYTES: u64 = 16 << 30;

/// Exploring may cost up to one part in this many of the large copies' time. A fixed one burst in
/// 256 copies cost 4-8 % of 1 MiB copies where split ones were 3.5 times dearer: shared-memory
/// writes of 1 MiB, medians of 5 runs alternating in one session, ran at 48.6 GB/s with it, 51.5
/// with the wait grown to match the gap, and 52.5 with no exploring at all.
const EXPLORE_SHARE: u128 = 1000;

/// In a row, because the first split copy after a while of whole ones wakes a helper thread that has
/// slept, and costs more than split copies in a row do.
const EXPLORE_BURST: u64 = 4;

/// How many copies of `bytes` apart bursts of exploring are, given the smoothed costs of the cheaper
/// way and of the other: enough that a burst, [`EXPLORE_BURST`] copies that each cost
/// `other - cheaper` more, stays within [`EXPLORE_SHARE`] of the copies' time, but never more
/// than [`EXPLORE_AT_LEAST_EVERY_BYTES`] apart.
fn explore_every(cheaper: u64, other: u64, bytes: usize) -> u64 {
    let most = (EXPLORE_AT_LEAST_EVERY_BYTES / (bytes as u64).max(1)).max(EXPLORE_EVERY_MIN);
    let most = 1 << most.ilog2();
    let extra = u128::from(other.saturating_sub(cheaper));
    let every = u128::from(EXPLORE_BURST) * EXPLORE_SHARE * extra / u128::from(cheaper.max(1));
    let every = u64::try_from(every).unwrap_or(u64::MAX);
    every.clamp(EXPLORE_EVERY_MIN, most).next_power_of_two()
}

/// Learns from the large copies themselves whether splitting them pays: a smoothed cost per byte of
/// each way, the cheaper one taken, the other tried again for [`EXPLORE_BURST`] copies of every
/// [`explore_every`].
pub(crate) struct Tuner {
    copies: AtomicU64,
    /// Smoothed nanoseconds per MiB of split copies, and of whole ones; 0 until one was measured.
    split: AtomicU64,
    whole: AtomicU64,
}

impl Tuner {
    pub(crate) const fn new() -> Self {
        Tuner {
            copies: AtomicU64::new(0),
            split: AtomicU64::new(0),
            whole: AtomicU64::new(0),
        }
    }

    /// Whether the next large copy, of `bytes`, is split.
    pub(crate) fn split_next(&self, bytes: usize) -> bool {
        let n = self.copies.fetch_add(1, Ordering::Relaxed);
        match (self.split.load(Ordering::Relaxed), self.whole.load(Ordering::Relaxed)) {
            (0, _) => true,
            (_, 0) => false,
            (split, whole) => {
                let every = explore_every(split.min(whole), split.max(whole), bytes);
                (split <= whole) != (n % every < EXPLORE_BURST)
            }
        }
    }

    /// Counts a copy of `bytes` that took `nanos`, split or not. An average falls halfway to a
    /// cheaper copy and rises an eighth of the way to a dearer one: a slow copy is often one that
    /// met something else (first-touch page faults, a preempted thread), a fast one shows what the
    /// way can do. Two copies recorded at once may lose one of the updates, which only delays
    /// what the averages learn.
    pub(crate) fn record(&self, split: bool, bytes: usize, nanos: u64) {
        let cost = (u128::from(nanos) << 20) / (bytes.max(1) as u128);
        let cost = u64::try_from(cost).unwrap_or(u64::MAX).max(1);
        let average = if split { &self.split } else { &self.whole };
        let old = average.load(Ordering::Relaxed);
        let new = match old {
            0 => cost,
            old if cost < old => old / 2 + cost / 2,
            old => old - old / 8 + cost / 8,
        };
        average.store(new.max(1), Ordering::Relaxed);
    }
}

/// Size classes of large copies, each with its own [`Tuner`]: whether splitting pays depends on the
/// size (a fixed cost to wake the helper against a copy time that grows with it). Class `k` holds
/// copies of `SPLIT_MIN << k` bytes up to twice that; the last, everything larger.
const SIZE_CLASSES: usize = 8;

static TUNERS: [Tuner; SIZE_CLASSES] = [const { Tuner::new() }; SIZE_CLASSES];

/// The tuner for copies of `total` bytes (at least [`SPLIT_MIN`]).
fn tuner(total: usize) -> &'static Tuner {
    let class = (total / SPLIT_MIN).max(1).ilog2() as usize;
    &TUNERS[class.min(SIZE_CLASSES - 1)]
}

/// One contiguous copy.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Piece {
    pub src: *const u8,
    pub dst: *mut u8,
    pub len: usize,
}

// SAFETY: a piece only describes two ranges; nothing reads or writes through its pointers but
// `copy_all`, whose contract makes its caller vouch that they are valid where and while it runs. So
// a piece may be moved to, and shared with, another thread (a transfer's future that copies in chunks
// across yields) like any other pair of addresses.
unsafe impl Send for Piece {}
// SAFETY: as above; a shared piece gives access to no memory.
unsafe impl Sync for Piece {}

struct Job {
    pieces: Vec<Piece>,
    done: SyncSender<()>,
}

// SAFETY: the pointers are valid for the job's copies until `done` is signalled, which the submitting
// thread waits for before it returns (see `copy_all`).
unsafe impl Send for Job {}

fn helper() -> Option<&'static Mutex<SyncSender<Job>>> {
    static HELPER: OnceLock<Option<Mutex<SyncSender<Job>>>> = OnceLock::new();
    HELPER
        .get_or_init(|| {
            let (jobs, incoming) = sync_channel::<Job>(4);
            std::thread::Builder::new()
                .name("ferry-shm-copy".into())
                .spawn(move || serve(incoming))
                .ok()
                .map(|_| Mutex::new(jobs))
        })
        .as_ref()
}

fn serve(incoming: Receiver<Job>) {
    for job in incoming {
        // SAFETY: the submitter keeps every range valid until `done` is signalled (`copy_all`).
        unsafe { copy_here(&job.pieces) };
        let _ = job.done.send(());
    }
}

/// # Safety
/// As for [`copy_all`].
unsafe fn copy_here(pieces: &[Piece]) {
    for p in pieces {
        // SAFETY: valid and disjoint per the contract.
        unsafe { std::ptr::copy_nonoverlapping(p.src, p.dst, p.len) };
    }
}

/// Splits `pieces` at half their bytes (cutting the piece that straddles the middle).
fn halves(pieces: &[Piece], total: usize) -> (Vec<Piece>, Vec<Piece>) {
    let half = total / 2;
    let (mut mine, mut theirs) = (Vec::new(), Vec::new());
    let mut at = 0usize;
    for p in pieces {
        if at >= half {
            theirs.push(*p);
        } else if at + p.len <= half {
            mine.push(*p);
        } else {
            let k = half - at;
            mine.push(Piece { len: k, ..*p });
            theirs.push(Piece {
                src: p.src.wrapping_add(k),
                dst: p.dst.wrapping_add(k),
                len: p.len - k,
            });
        }
        at += p.len;
    }
    (mine, theirs)
}

/// Copies every piece; from [`SPLIT_MIN`] bytes in all, half of them on the helper thread where
/// that has been the faster way (see [`Tuner`]).
///
/// # Safety
/// Every piece's `src` is valid for reads and `dst` for writes of its `len` bytes until this returns,
/// and no destination overlaps another piece's source or destination.
pub(crate) unsafe fn copy_all(pieces: &[Piece]) {
    let total: usize = pieces.iter().map(|p| p.len).sum();
    if total < SPLIT_MIN {
        // SAFETY: valid per the contract.
        return unsafe { copy_here(pieces) };
    }
    let tuner = tuner(total);
    let started = Instant::now();
    // SAFETY: valid per the contract.
    let split = unsafe { copy_large(pieces, total, tuner.split_next(total)) };
    let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
    tuner.record(split, total, nanos);
}

/// Copies `pieces` (`total` bytes), split over two threads if `split` and the helper thread runs;
/// returns whether it was split.
///
/// # Safety
/// As for [`copy_all`].
unsafe fn copy_large(pieces: &[Piece], total: usize, split: bool) -> bool {
    if split && let Some(helper) = helper() {
        let (mine, theirs) = halves(pieces, total);
        let (done, finished) = sync_channel(1);
        let job = Job { pieces: theirs, done };
        if let Some(Ok(())) = helper.lock().ok().map(|jobs| jobs.send(job)) {
            // SAFETY: the first half of the caller's ranges, valid per the contract.
            unsafe { copy_here(&mine) };
            // The ranges stay valid until the helper is done. It never panics, so `recv` fails only
            // if the job was dropped unrun: copy its half here then.
            if finished.recv().is_err() {
                let (_, theirs) = halves(pieces, total);
                // SAFETY: valid per the contract; the helper never touched them.
                unsafe { copy_here(&theirs) };
            }
            return true;
        }
    }
    // SAFETY: valid per the contract.
    unsafe { copy_here(pieces) };
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_and_whole_copies_move_every_byte() {
        for len in [1usize, 4096, SPLIT_MIN - 1, SPLIT_MIN, SPLIT_MIN + 3, 3 << 20] {
            for piece in [len, 4096, 4093] {
                let src: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
                let mut dst = vec![0u8; len];
                let pieces: Vec<Piece> = (0..len)
                    .step_by(piece)
                    .map(|at| Piece {
                        src: src[at..].as_ptr(),
                        dst: dst[at..].as_mut_ptr(),
                        len: piece.min(len - at),
                    })
                    .collect();
                // SAFETY: the pieces cover the two distinct vectors, each byte once.
                unsafe { copy_all(&pieces) };
                assert!(src == dst, "{len} bytes in pieces of {piece}");
                for split in [true, false] {
                    dst.fill(0);
                    // SAFETY: as above.
                    let was_split = unsafe { copy_large(&pieces, len, split) };
                    assert_eq!(was_split, split, "the helper thread did not run");
                    assert!(src == dst, "{len} bytes in pieces of {piece}, split {split}");
                }
            }
        }
    }

    /// Measures each way first, then takes the cheaper one, and tries the other for exactly
    /// `EXPLORE_BURST` copies of every `explore_every`, so that it notices when the other becomes the
    /// cheaper.
    #[test]
    fn the_tuner_takes_the_cheaper_way_and_keeps_trying_the_other() {
        const MIB: usize = 1 << 20;
        let tuner = Tuner::new();
        assert!(tuner.split_next(MIB), "split copies are measured first");
        tuner.record(true, MIB, 80_000);
        assert!(!tuner.split_next(MIB), "then whole ones");
        tuner.record(false, MIB, 20_000);
        // Split copies four times dearer: a burst every 16384 copies of 1 MiB (16 GiB).
        let splits = (0..10 * 16384).filter(|_| tuner.split_next(MIB)).count();
        assert_eq!(
            splits as u64,
            10 * EXPLORE_BURST,
            "whole copies are cheaper: split only to explore"
        );

        // Whole copies become 1.2 times as dear as split ones (the other core fell idle, say): the
        // averages follow within a few dozen copies, and split copies take over, trying whole ones
        // every 1024 copies.
        for _ in 0..40 {
            tuner.record(false, MIB, 96_000);
        }
        let splits = (0..10 * 1024).filter(|_| tuner.split_next(MIB)).count();
        assert_eq!(
            splits as u64,
            10 * (1024 - EXPLORE_BURST),
            "split copies are now cheaper"
        );
    }

    #[test]
    fn the_dearer_the_other_way_the_rarer_the_bursts() {
        const MIB: usize = 1 << 20;
        assert_eq!(explore_every(100, 100, MIB), EXPLORE_EVERY_MIN);
        assert_eq!(explore_every(100, 105, MIB), EXPLORE_EVERY_MIN);
        assert_eq!(explore_every(100, 120, MIB), 1024);
        assert_eq!(explore_every(20_000, 80_000, MIB), 16384, "at most every 16 GiB");
        assert_eq!(
            explore_every(20_000, 80_000, 64 * MIB),
            EXPLORE_EVERY_MIN,
            "at most every 16 GiB"
        );
        assert_eq!(explore_every(1, u64::MAX, SPLIT_MIN), 32768);
        assert_eq!(explore_every(1, u64::MAX, usize::MAX), EXPLORE_EVERY_MIN);
    }

    proptest::proptest! {
        /// Bursts stay within their share of the time, unless the wait is at its longest; and a wait
        /// is a power of two within bounds.
        #[test]
        fn exploring_costs_at_most_its_share(
            cheaper in 1u64..1_000_000,
            extra in 0u64..10_000_000,
            bytes in SPLIT_MIN..(1usize << 40),
        ) {
            let every = explore_every(cheaper, cheaper + extra, bytes);
            proptest::prop_assert!(every.is_power_of_two());
            proptest::prop_assert!(every >= EXPLORE_EVERY_MIN);
            let most = (EXPLORE_AT_LEAST_EVERY_BYTES / bytes as u64).max(EXPLORE_EVERY_MIN);
            proptest::prop_assert!(every <= most, "a burst at least every 16 GiB");
            let burst_cost = u128::from(EXPLORE_BURST) * u128::from(extra);
            let budget = u128::from(every) * u128::from(cheaper) / EXPLORE_SHARE;
            proptest::prop_assert!(every * 2 > most || burst_cost <= budget + u128::from(cheaper));
        }

        #[test]
        fn halves_cover_every_byte_once(lens in proptest::collection::vec(1usize..5000, 1..40)) {
            let total: usize = lens.iter().sum();
            let mut at = 0usize;
            let pieces: Vec<Piece> = lens.iter().map(|&len| {
                let p = Piece { src: at as *const u8, dst: (at + (1 << 40)) as *mut u8, len };
                at += len;
                p
            }).collect();
            let (mine, theirs) = halves(&pieces, total);
            let mut next = 0usize;
            for p in mine.iter().chain(&theirs) {
                proptest::prop_assert_eq!(p.src as usize, next);
                proptest::prop_assert_eq!(p.dst as usize, next + (1 << 40));
                next += p.len;
            }
            proptest::prop_assert_eq!(next, total);
            let first: usize = mine.iter().map(|p| p.len).sum();
            proptest::prop_assert_eq!(first, total / 2);
        }
    }
}
