//! [`RetryBudget`]: how many retries the whole client may spend, with a deposit that costs every
//! request almost nothing.
//!
//! A retry budget is funded by requests and spent by retries: each original request deposits, each
//! retry withdraws, and deposits older than the budget's time to live stop counting. tower's
//! `TpsBudget` does this with one mutex, one clock read and one shared counter on every deposit, so
//! every request of every caller meets every other on the same cache lines. The `--budgets` mode
//! of `examples/tower_overhead.rs` measures it (4 KiB writes over shared memory, 16 callers, on the
//! 2-core test machine): one more `TpsBudget` deposit per request took 12–13 % of the stack's
//! throughput, one more [`RetryBudget`] deposit 3–6 %.
//!
//! Here a deposit touches only its thread's own cache line, and tells the time from the kernel's
//! coarse monotonic clock: a read of the tick the kernel last stored (about 5 ns on the test
//! machine, against about 35 ns for `Instant::now`), whose resolution of a few milliseconds is far
//! below a window's. The time to live is cut into [`WINDOWS`] windows; each thread's stripe keeps
//! one counter per window, which holds the window's number and the deposits made in it. A deposit
//! increments the counter of the current window (taking it over from a window that has expired); a
//! withdrawal, which happens only when a request failed, sums the counters of the live windows over
//! every stripe, under a mutex that also makes its check and its record one step. Nothing needs
//! rolling over: a counter whose window is too old is simply not counted. The balance is the same as
//! `TpsBudget`'s: a reserve, plus `retry_ratio` per deposit of the last time to live, minus the
//! withdrawals of the last time to live.

use std::cell::Cell;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use ferry::{Error, Result};
use tower::retry::budget::Budget;

/// Windows per time to live: deposits expire one window at a time, so a deposit counts for between
/// `ttl × (WINDOWS - 1) / WINDOWS` and `ttl`.
pub const WINDOWS: usize = 10;

/// Stripes of deposit counters. Threads are spread over them round-robin; more threads than stripes
/// share, which costs speed, not correctness.
const STRIPES: usize = 16;

/// One thread's deposit counters, on cache lines of their own.
#[repr(align(128))]
#[derive(Default)]
struct Stripe([AtomicU64; WINDOWS]);

/// A counter: the window's number in the high 32 bits, its deposits in the low 32.
fn pack(window: u32, count: u32) -> u64 {
    (u64::from(window) << 32) | u64::from(count)
}

fn unpack(counter: u64) -> (u32, u32) {
    ((counter >> 32) as u32, counter as u32)
}

/// Whether a counter of window `window` counts at window `now`: the last [`WINDOWS`] windows, and
/// one ahead (a thread that read the clock just after the withdrawing one).
fn live(now: u32, window: u32) -> bool {
    now.wrapping_sub(window) < WINDOWS as u32 || window.wrapping_sub(now) == 1
}

/// A retry budget shared by every clone of a [`RetryPolicy`](crate::RetryPolicy); it implements
/// tower's [`Budget`], so tower's own policies can use it too.
///
/// Each [`deposit`](Budget::deposit) (one per original request) earns `retry_ratio` of a retry for
/// `ttl`; each [`withdraw`](Budget::withdraw) (one per retry) succeeds while the reserve
/// (`min_per_sec × ttl` retries) plus what the deposits of the last `ttl` earned covers the
/// withdrawals of the last `ttl` and this one.
///
/// Windows are numbered with 32 bits from the budget's creation: with the shortest time to live
/// (1 s, windows of 100 ms) they wrap after 13 years, and a wrap can only make a few deposits not
/// count (fewer retries, never more).
pub struct RetryBudget {
    /// The coarse clock at creation, in nanoseconds.
    epoch: u64,
    /// A window's length in nanoseconds.
    window: u64,
    reserve: f64,
    retry_ratio: f64,
    deposits: Box<[Stripe]>,
    /// Withdrawals per window, as (window, count) counters like the deposits'.
    withdrawals: Mutex<[u64; WINDOWS]>,
}

impl std::fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryBudget")
            .field("ttl", &Duration::from_nanos(self.window * WINDOWS as u64))
            .field("reserve", &self.reserve)
            .field("retry_ratio", &self.retry_ratio)
            .finish()
    }
}

impl RetryBudget {
    /// A budget where deposits count for `ttl` (1 to 60 s), `min_per_sec` retries per second are
    /// allowed whatever the traffic, and each deposit earns `retry_ratio` (0 to 1000) of a retry.
    /// `InvalidArgument` for values out of range.
    pub fn new(ttl: Duration, min_per_sec: u32, retry_ratio: f32) -> Result<Self> {
        if !(Duration::from_secs(1)..=Duration::from_secs(60)).contains(&ttl) {
            return Err(Error::InvalidArgument(format!(
                "budget_ttl must be 1 to 60 s, not {ttl:?}"
            )));
        }
        if !(0.0..=1000.0).contains(&retry_ratio) {
            return Err(Error::InvalidArgument(format!(
                "budget_retry_ratio must be 0 to 1000, not {retry_ratio}"
            )));
        }
        Ok(RetryBudget::unchecked(ttl, min_per_sec, retry_ratio))
    }

    /// [`new`](Self::new) for settings known to be in range.
    pub(crate) fn unchecked(ttl: Duration, min_per_sec: u32, retry_ratio: f32) -> Self {
        RetryBudget {
            epoch: coarse_now(),
            window: (ttl / WINDOWS as u32).as_nanos().max(1) as u64,
            reserve: f64::from(min_per_sec) * ttl.as_secs_f64(),
            retry_ratio: f64::from(retry_ratio),
            deposits: (0..STRIPES).map(|_| Stripe::default()).collect(),
            withdrawals: Mutex::new([0; WINDOWS]),
        }
    }

    /// Retries the budget would allow now.
    pub fn available(&self) -> f64 {
        let now = self.window_now();
        let withdrawn = match self.withdrawals.lock() {
            Ok(w) => live_sum(*w, now),
            Err(_) => return 0.0,
        };
        self.balance(now, withdrawn)
    }

    fn window_now(&self) -> u32 {
        (coarse_now().saturating_sub(self.epoch) / self.window) as u32
    }

    fn balance(&self, now: u32, withdrawn: u64) -> f64 {
        let deposited: u64 = self
            .deposits
            .iter()
            .map(|s| live_sum(s.0.iter().map(|counter| counter.load(Ordering::Relaxed)), now))
            .sum();
        self.reserve + self.retry_ratio * deposited as f64 - withdrawn as f64
    }

    fn deposit_at(&self, now: u32) {
        let counter = &self.deposits[stripe()].0[now as usize % WINDOWS];
        add_one(counter, now);
    }

    fn withdraw_at(&self, now: u32) -> bool {
        // A poisoned lock means a withdrawal panicked mid-record: refuse rather than guess.
        let Ok(mut withdrawals) = self.withdrawals.lock() else {
            return false;
        };
        if self.balance(now, live_sum(*withdrawals, now)) < 1.0 {
            return false;
        }
        let counter = &mut withdrawals[now as usize % WINDOWS];
        let (window, count) = unpack(*counter);
        *counter = match window == now {
            true => pack(now, count.saturating_add(1)),
            false => pack(now, 1),
        };
        true
    }
}

impl Budget for RetryBudget {
    fn deposit(&self) {
        self.deposit_at(self.window_now());
    }

    fn withdraw(&self) -> bool {
        self.withdraw_at(self.window_now())
    }
}

/// Counts one in `counter` for window `now`, taking the counter over if it holds an older window.
fn add_one(counter: &AtomicU64, now: u32) {
    let mut current = counter.load(Ordering::Relaxed);
    loop {
        let (window, count) = unpack(current);
        let next = match window == now {
            true => pack(now, count.saturating_add(1)),
            false => pack(now, 1),
        };
        match counter.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return,
            Err(seen) => current = seen,
        }
    }
}

/// The counts of the counters whose windows are live at `now`.
fn live_sum(counters: impl IntoIterator<Item = u64>, now: u32) -> u64 {
    counters
        .into_iter()
        .map(unpack)
        .filter(|&(window, _)| live(now, window))
        .map(|(_, count)| u64::from(count))
        .sum()
}

/// The kernel's coarse monotonic clock, in nanoseconds: the time as of the last scheduler tick.
fn coarse_now() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `now` is a valid, writable timespec for the call's duration, and
    // CLOCK_MONOTONIC_COARSE is a clock every Linux since 2.6.32 has; it cannot fail with those.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut now) };
    (now.tv_sec as u64).saturating_mul(1_000_000_000) + now.tv_nsec as u64
}

/// This thread's stripe, given out round-robin on first use.
fn stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    STRIPE.with(|s| {
        if s.get() == usize::MAX {
            s.set(NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES);
        }
        s.get()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn budget(min_per_sec: u32, ratio: f32) -> RetryBudget {
        RetryBudget::new(Duration::from_secs(10), min_per_sec, ratio).unwrap()
    }

    #[test]
    fn out_of_range_settings_are_errors() {
        for (ttl, ratio) in [
            (100, 0.2),
            (61_000, 0.2),
            (1000, -0.1),
            (1000, 1000.5),
            (1000, f32::NAN),
        ] {
            let made = RetryBudget::new(Duration::from_millis(ttl), 1, ratio);
            assert!(matches!(made, Err(Error::InvalidArgument(_))), "{ttl} ms, {ratio}");
        }
    }

    #[test]
    fn deposits_earn_retries_and_withdrawals_spend_them() {
        let b = budget(0, 0.5);
        assert!(!b.withdraw_at(0), "nothing deposited, no reserve");
        for _ in 0..4 {
            b.deposit_at(0);
        }
        assert!(b.withdraw_at(0));
        assert!(b.withdraw_at(3));
        assert!(!b.withdraw_at(3), "4 deposits at 0.5 earn 2 retries");
    }

    #[test]
    fn deposits_expire_after_the_ttl() {
        let b = budget(0, 1.0);
        b.deposit_at(5);
        assert!(b.balance(14, 0) == 1.0, "still live in the 10th window");
        assert!(b.balance(15, 0) == 0.0, "gone in the 11th");
        // The counter is taken over by the later window, not added to.
        b.deposit_at(15);
        assert!(b.balance(15, 0) == 1.0);
    }

    #[test]
    fn concurrent_deposits_are_all_counted() {
        let b = std::sync::Arc::new(budget(0, 1.0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let b = b.clone();
                std::thread::spawn(move || (0..10_000).for_each(|_| b.deposit_at(7)))
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert!(b.balance(7, 0) == 80_000.0);
    }

    #[test]
    fn the_budget_follows_the_clock() {
        let b = RetryBudget::new(Duration::from_secs(1), 0, 1.0).unwrap();
        b.deposit();
        assert!(b.available() == 1.0);
        // The 1 s time to live, plus a window and the coarse clock's tick.
        std::thread::sleep(Duration::from_millis(1200));
        assert!(b.available() == 0.0);
        assert!(!b.withdraw());
        b.deposit();
        assert!(b.withdraw());
    }

    #[derive(Debug, Clone)]
    enum Step {
        Advance(u32),
        Deposit(u8),
        Withdraw,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u32..14).prop_map(Step::Advance),
            (1u8..20).prop_map(Step::Deposit),
            Just(Step::Withdraw),
        ]
    }

    proptest! {
        /// Against a model that keeps every deposit and withdrawal with its window.
        #[test]
        fn matches_a_model(reserve in 0u32..3, ratio in prop_oneof![Just(0.0f32), Just(0.25), Just(1.0), Just(3.0)],
                           steps in prop::collection::vec(step(), 1..200)) {
            let b = RetryBudget::new(Duration::from_secs(1), reserve, ratio).unwrap();
            let (mut now, mut deposits, mut withdrawals) = (0u32, Vec::new(), Vec::new());
            let live_count = |v: &Vec<u32>, now: u32| v.iter().filter(|&&w| now - w < WINDOWS as u32).count() as f64;
            for s in steps {
                match s {
                    Step::Advance(n) => now += n,
                    Step::Deposit(n) => (0..n).for_each(|_| { b.deposit_at(now); deposits.push(now) }),
                    Step::Withdraw => {
                        let balance = f64::from(reserve) + f64::from(ratio) * live_count(&deposits, now)
                            - live_count(&withdrawals, now);
                        let allowed = balance >= 1.0;
                        prop_assert_eq!(b.withdraw_at(now), allowed, "at window {}", now);
                        if allowed {
                            withdrawals.push(now);
                        }
                    }
                }
            }
        }
    }
}
