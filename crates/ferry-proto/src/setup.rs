//! How often a link may set up data paths at its target.
//!
//! A data-path setup (an RDMA queue pair, a same-host socket and the thread that serves it) costs the
//! target far more than the frame that asks for it, and an initiator asks again only when it opens a
//! link or replaces a path that failed. So each link gets a small budget: a burst large enough for
//! every path a link opens at once, refilled at a few setups a second. Past it a setup is refused with
//! `ResourceExhausted` (retryable), before the transport does any work; and a link keeps at most
//! [`MAX_PATHS_PER_LINK`] paths, however it names them.

use std::time::{Duration, Instant};

use ferry_core::{Error, Result};

/// Most data paths one link keeps at its target, all transports and lanes together: an RDMA link of
/// several rails and queue pairs per rail, and a same-host path.
pub const MAX_PATHS_PER_LINK: usize = 64;

/// The per-link budget of data-path setups: a token bucket.
#[derive(Debug, Clone)]
pub struct SetupBudget {
    burst: u32,
    every: Duration,
    tokens: u32,
    /// When the last token was added (or the budget was made).
    refilled: Instant,
}

impl SetupBudget {
    /// Setups a link may make at once.
    pub const BURST: u32 = MAX_PATHS_PER_LINK as u32 + 8;
    /// How often a spent setup comes back.
    pub const EVERY: Duration = Duration::from_millis(250);

    /// A full budget, as of `now`.
    pub fn new(now: Instant) -> Self {
        SetupBudget::with(Self::BURST, Self::EVERY, now)
    }

    /// A full budget of `burst` setups, one more every `every`.
    pub fn with(burst: u32, every: Duration, now: Instant) -> Self {
        SetupBudget {
            burst: burst.max(1),
            every: every.max(Duration::from_micros(1)),
            tokens: burst.max(1),
            refilled: now,
        }
    }

    /// Spends one setup at `now`, or says why it may not happen yet.
    pub fn spend(&mut self, now: Instant) -> Result<()> {
        let elapsed = now.saturating_duration_since(self.refilled);
        let earned = (elapsed.as_nanos() / self.every.as_nanos()).min(u128::from(self.burst)) as u32;
        if earned > 0 {
            self.tokens = (self.tokens + earned).min(self.burst);
            self.refilled = match self.tokens == self.burst {
                true => now,
                false => self.refilled + self.every * earned,
            };
        }
        if self.tokens == 0 {
            return Err(Error::ResourceExhausted(format!(
                "this link set up data paths faster than {} at once and one per {:?}: try again later",
                self.burst, self.every
            )));
        }
        self.tokens -= 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_burst_then_one_per_interval() {
        let t0 = Instant::now();
        let mut b = SetupBudget::with(3, Duration::from_millis(100), t0);
        for _ in 0..3 {
            b.spend(t0).unwrap();
        }
        assert!(matches!(b.spend(t0), Err(Error::ResourceExhausted(_))));
        assert!(b.spend(t0 + Duration::from_millis(99)).is_err());
        b.spend(t0 + Duration::from_millis(100)).unwrap();
        assert!(b.spend(t0 + Duration::from_millis(150)).is_err());
        // A long pause refills the burst, no more.
        let later = t0 + Duration::from_secs(60);
        for _ in 0..3 {
            b.spend(later).unwrap();
        }
        assert!(b.spend(later).is_err());
    }

    proptest! {
        /// However the setups are spread, no window of time lets more through than the burst plus one
        /// per interval elapsed.
        #[test]
        fn never_more_than_burst_plus_refills(
            burst in 1u32..20,
            gaps in proptest::collection::vec(0u64..300, 1..300),
        ) {
            let every = Duration::from_millis(100);
            let t0 = Instant::now();
            let mut b = SetupBudget::with(burst, every, t0);
            let mut now = t0;
            let mut granted = 0u64;
            for gap in gaps {
                now += Duration::from_millis(gap);
                if b.spend(now).is_ok() {
                    granted += 1;
                }
                let elapsed = now.duration_since(t0).as_millis() as u64;
                prop_assert!(granted <= u64::from(burst) + elapsed / 100);
            }
        }
    }
}
