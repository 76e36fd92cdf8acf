//! A rail's measured throughput, for spraying slices by how soon each rail would finish them.
//!
//! The meter counts bytes completed over the time the rail was busy (at least one share in flight),
//! not over each share's own duration: shares on one queue pair overlap and wait for each other, so a
//! share's duration says how loaded the rail was, not how fast it is. Every [`WINDOW`] of busy time
//! becomes a sample, folded into an exponentially weighted average so that a rail that slows down
//! (congestion, a degraded port) is seen within a few windows.

use std::time::{Duration, Instant};

/// Busy time per sample.
pub const WINDOW: Duration = Duration::from_millis(20);
/// The weight of a new sample in the average.
const NEW_SAMPLE_WEIGHT: f64 = 0.3;

/// One rail's meter; the caller serialises access (a mutex per rail).
#[derive(Debug, Default)]
pub struct RateMeter {
    in_flight: u32,
    busy_since: Option<Instant>,
    window_bytes: u64,
    window_busy: Duration,
    rate: Option<f64>,
}

impl RateMeter {
    /// A share starts on the rail.
    pub fn start(&mut self, now: Instant) {
        if self.in_flight == 0 {
            self.busy_since = Some(now);
        }
        self.in_flight += 1;
    }

    /// A share ends, having moved `bytes` (0 if it failed).
    pub fn finish(&mut self, bytes: u64, now: Instant) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.window_bytes += bytes;
        if let Some(since) = self.busy_since {
            self.window_busy += now.saturating_duration_since(since);
            self.busy_since = (self.in_flight > 0).then_some(now);
        }
        if self.window_busy >= WINDOW {
            let sample = self.window_bytes as f64 / self.window_busy.as_secs_f64();
            self.rate = Some(match self.rate {
                None => sample,
                Some(rate) => rate + NEW_SAMPLE_WEIGHT * (sample - rate),
            });
            self.window_bytes = 0;
            self.window_busy = Duration::ZERO;
        }
    }

    /// Bytes per second while busy; `None` until a first window is complete.
    pub fn rate(&self) -> Option<f64> {
        self.rate
    }
}

/// The candidate that would finish `extra` more bytes first: its bytes in flight (`load`) plus
/// `extra`, over its rate. A rail not yet measured counts as fast as the fastest measured one (so
/// that it is tried and measured); with no rail measured, the least loaded wins, as by bytes alone.
/// Ties go to the first candidate.
pub fn soonest_finish(
    candidates: impl Iterator<Item = usize>,
    load: impl Fn(usize) -> u64,
    rates: &[Option<f64>],
    extra: u64,
) -> Option<usize> {
    let fastest = rates.iter().flatten().copied().fold(0.0f64, f64::max);
    let rate = |i: usize| match rates.get(i).copied().flatten() {
        Some(r) if r > 0.0 => r,
        _ if fastest > 0.0 => fastest,
        _ => 1.0,
    };
    candidates
        .map(|i| (i, (load(i) + extra) as f64 / rate(i)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_time_not_share_time_makes_the_rate() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut m = RateMeter::default();
        // Two shares of 1 MB overlap over 10 ms of busy time, then the rail idles 100 ms, then one
        // more share of 2 MB takes 10 ms: 4 MB in 20 ms busy, 200 MB/s, whatever the idle time.
        m.start(ms(0));
        m.start(ms(1));
        m.finish(1_000_000, ms(6));
        assert_eq!(m.rate(), None, "no window complete yet");
        m.finish(1_000_000, ms(10));
        m.start(ms(110));
        m.finish(2_000_000, ms(120));
        let rate = m.rate().expect("a window of 20 ms completed");
        assert!((rate - 200e6).abs() < 1e3, "{rate}");
    }

    #[test]
    fn a_rail_that_slows_down_is_seen_within_a_few_windows() {
        let mut now = Instant::now();
        let mut m = RateMeter::default();
        let mut run = |m: &mut RateMeter, bytes_per_window: u64| {
            m.start(now);
            now += WINDOW;
            m.finish(bytes_per_window, now);
        };
        for _ in 0..5 {
            run(&mut m, 20_000_000); // 1 GB/s
        }
        for _ in 0..8 {
            run(&mut m, 2_000_000); // 100 MB/s
        }
        let rate = m.rate().unwrap_or(0.0);
        assert!(rate < 200e6, "still {rate} B/s after 8 slow windows");
    }

    /// Plans `slices` equal slices one by one, as `MultiRailLink` does a batch, and returns each
    /// rail's count.
    fn plan(slices: usize, rates: &[Option<f64>]) -> Vec<usize> {
        let mut planned = vec![0u64; rates.len()];
        let mut counts = vec![0usize; rates.len()];
        for _ in 0..slices {
            let i = soonest_finish(0..rates.len(), |i| planned[i], rates, 1 << 18).unwrap_or(0);
            planned[i] += 1 << 18;
            counts[i] += 1;
        }
        counts
    }

    #[test]
    fn a_batch_is_split_in_proportion_to_measured_rates() {
        assert_eq!(plan(400, &[Some(3e9), Some(1e9)]), vec![300, 100]);
        assert_eq!(plan(400, &[Some(1e9), Some(1e9), Some(2e9)]), vec![100, 100, 200]);
    }

    #[test]
    fn unmeasured_rails_share_evenly_and_count_as_fast_as_the_fastest() {
        assert_eq!(plan(400, &[None, None]), vec![200, 200]);
        assert_eq!(plan(400, &[Some(2e9), None]), vec![200, 200]);
        assert_eq!(plan(3, &[None, None, None]), vec![1, 1, 1]);
    }
}
