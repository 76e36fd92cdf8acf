//! The invariants of a run, checked on what the conductor recorded. Each broken one is a
//! [`Violation`], and any violation fails the run:
//!
//! - **No wrong byte reported done**: every pull that completed `Ok` had the source's bytes, block by
//!   block (the decode engine checks each one; a `Corrupt` event is a violation).
//! - **No call outlives its deadline** by more than [`DEADLINE_SLACK`].
//! - **A dead engine leaves**: a killed engine that stays down past its lease is gone from the
//!   directory within the lease plus two seconds, and no decode engine starts a pull to it later than
//!   [`ROUTING_SLACK`] after that (its list of sources is refreshed twice a second).
//! - **A restarted engine comes back at once**: restarted on its address right after a kill, it must
//!   start on the first try (its name, held by its dead predecessor's record, must not refuse it).
//! - **Resources stay bounded**: each engine that ran the whole run ends with at most
//!   [`FD_SLACK`] more file descriptors, [`THREAD_SLACK`] more threads and [`RSS_SLACK_KIB`] more
//!   resident memory than it had before the first fault.
//! - **Throughput comes back**: within [`RECOVERY`] after a fault heals, some three-second window
//!   averages at least 90 % of the median per-second throughput of the ten seconds before the fault.
//! - **Nobody crashes**: no engine exits unless the schedule killed it.

use std::time::Duration;

use crate::conduct::Log;
use crate::event::Event;
use crate::schedule::{Fault, Fleet, RECOVERY, Step};

pub const DEADLINE_SLACK: Duration = Duration::from_secs(1);
pub const ROUTING_SLACK: Duration = Duration::from_secs(1);
pub const FD_SLACK: u64 = 64;
pub const THREAD_SLACK: u64 = 16;
pub const RSS_SLACK_KIB: u64 = 128 << 10;
/// The share of the pre-fault throughput that counts as recovered.
pub const RECOVERED: f64 = 0.9;
/// The window recovery is judged on, in seconds.
const WINDOW: usize = 3;

/// A fault as it happened.
#[derive(Debug, Clone, Copy)]
pub struct Record {
    pub step: Step,
    pub at_ms: f64,
    pub heal_ms: f64,
    /// For a kill: the starts its restart took.
    pub restart_tries: u32,
}

/// One member's resources at one time.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Sample {
    pub t: f64,
    pub member: usize,
    pub generation: u32,
    pub rss_kib: u64,
    pub threads: u64,
    pub fds: u64,
}

pub struct Input<'a> {
    pub fleet: &'a Fleet,
    pub records: &'a [Record],
    pub log: &'a Log,
    pub t0: f64,
    pub end_ms: f64,
}

/// What each fault did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FaultOutcome {
    pub fault: String,
    pub at_s: f64,
    pub heal_s: f64,
    /// Median MB/s over the ten seconds before.
    pub before_mb_s: f64,
    /// Seconds from healing until throughput was back (`None`: not within the limit).
    pub recovery_s: Option<f64>,
    /// For a kill held past the lease: seconds until the directory dropped the engine.
    pub left_directory_s: Option<f64>,
    pub restart_tries: u32,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Verdict {
    pub faults: Vec<FaultOutcome>,
    /// MB/s of checked bytes, per second of the run.
    pub throughput: Vec<f64>,
    pub transfers_ok: u64,
    pub bytes_ok: u64,
    /// Failed pulls by error.
    pub failures: std::collections::BTreeMap<String, u64>,
    pub notifications_delivered: u64,
    pub corrupt: u64,
    pub late: u64,
    /// The largest overrun of a deadline, in ms (negative: every call ended before its deadline).
    pub worst_overrun_ms: f64,
    /// Each engine that ran the whole run: its resources before the first fault and at the end.
    pub resources: Vec<Growth>,
    pub violations: Vec<String>,
}

/// An engine's resources before the first fault and at the end.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Growth {
    pub name: String,
    pub fds: (u64, u64),
    pub threads: (u64, u64),
    pub rss_kib: (u64, u64),
}

pub fn judge(input: &Input<'_>) -> Verdict {
    let mut v = Verdict {
        faults: Vec::new(),
        throughput: throughput(input),
        transfers_ok: 0,
        bytes_ok: 0,
        failures: Default::default(),
        notifications_delivered: 0,
        corrupt: 0,
        late: 0,
        worst_overrun_ms: f64::NEG_INFINITY,
        resources: Vec::new(),
        violations: Vec::new(),
    };
    let slack_ms = DEADLINE_SLACK.as_secs_f64() * 1e3;
    for (_, member, event) in &input.log.events {
        match event {
            Event::Corrupt {
                from,
                block,
                offset,
                end_ms,
            } => {
                v.corrupt += 1;
                v.violations.push(format!(
                    "{} pulled block {block} of {from} with Ok at t={:.1}s, but its byte {offset} is not the source's",
                    input.fleet.name(*member),
                    (end_ms - input.t0) / 1e3
                ));
            }
            Event::Transfer {
                from,
                start_ms,
                end_ms,
                deadline_ms,
                bytes,
                outcome,
                error,
                notified,
            } => {
                let overrun = end_ms - start_ms - deadline_ms;
                v.worst_overrun_ms = v.worst_overrun_ms.max(overrun);
                if overrun > slack_ms {
                    v.late += 1;
                    v.violations.push(format!(
                        "{}'s pull from {from} at t={:.1}s took {:.0} ms against a deadline of {deadline_ms:.0} ms ({outcome}{})",
                        input.fleet.name(*member),
                        (start_ms - input.t0) / 1e3,
                        end_ms - start_ms,
                        error.as_deref().map(|e| format!(": {e}")).unwrap_or_default()
                    ));
                }
                if outcome == "ok" {
                    v.transfers_ok += 1;
                    v.bytes_ok += bytes;
                    v.notifications_delivered += u64::from(*notified);
                } else {
                    *v.failures.entry(outcome.clone()).or_default() += 1;
                }
            }
            _ => {}
        }
    }
    for r in input.records {
        v.faults.push(fault_outcome(input, r, &v.throughput, &mut v.violations));
    }
    v.resources = resources(input, &mut v.violations);
    for (t, member, status) in &input.log.exits {
        v.violations.push(format!(
            "{} exited by itself ({status}) by t={:.1}s",
            input.fleet.name(*member),
            (t - input.t0) / 1e3
        ));
    }
    v
}

/// MB/s of pulls completed `Ok`, by the second they completed in.
fn throughput(input: &Input<'_>) -> Vec<f64> {
    let seconds = ((input.end_ms - input.t0) / 1e3).ceil().max(0.0) as usize;
    let mut per = vec![0.0; seconds];
    for (_, _, event) in &input.log.events {
        if let Event::Transfer {
            end_ms, bytes, outcome, ..
        } = event
            && outcome == "ok"
            && let Some(slot) = per.get_mut(((end_ms - input.t0) / 1e3).max(0.0) as usize)
        {
            *slot += *bytes as f64 / 1e6;
        }
    }
    per
}

fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn fault_outcome(input: &Input<'_>, r: &Record, per_s: &[f64], violations: &mut Vec<String>) -> FaultOutcome {
    let sec = |ms: f64| ((ms - input.t0) / 1e3).max(0.0);
    let (at, heal) = (sec(r.at_ms), sec(r.heal_ms));
    let what = r.step.fault.describe(input.fleet);
    let before = median(per_s[(at as usize).saturating_sub(10)..(at as usize).min(per_s.len())].to_vec());
    // The first window starting at or after the healing second whose mean is back.
    let first = heal.ceil() as usize;
    let limit = heal + RECOVERY.as_secs_f64();
    let recovery_s = (first..per_s.len().saturating_sub(WINDOW - 1))
        .map(|w| (w, per_s[w..w + WINDOW].iter().sum::<f64>() / WINDOW as f64))
        .take_while(|(w, _)| (*w + WINDOW) as f64 <= limit + 1.0)
        .find(|(_, mean)| *mean >= RECOVERED * before)
        .map(|(w, _)| (w + WINDOW) as f64 - heal);
    if recovery_s.is_none() {
        violations.push(format!(
            "after `{what}` healed at t={heal:.1}s, throughput did not return to {:.0} % of {before:.1} MB/s within {RECOVERY:?}",
            RECOVERED * 100.0
        ));
    }
    let mut left_directory_s = None;
    if let Fault::Kill { member } = r.step.fault {
        let name = input.fleet.name(member);
        if r.restart_tries > 1 {
            violations.push(format!(
                "{name}, restarted on its address after `{what}`, was refused {} time(s) before it started",
                r.restart_tries - 1
            ));
        }
        let lease = input.fleet.ttl.as_secs_f64() * 1e3;
        if r.heal_ms - r.at_ms > lease + 2e3 {
            let gone_at = input
                .log
                .directory
                .iter()
                .filter(|(t, _)| *t >= r.at_ms && *t <= r.heal_ms)
                .find(|(_, names)| names.as_ref().is_some_and(|n| !n.contains(&name)))
                .map(|(t, _)| *t);
            left_directory_s = gone_at.map(|t| (t - r.at_ms) / 1e3);
            match gone_at {
                Some(t) if t - r.at_ms <= lease + 2e3 => {}
                _ => violations.push(format!(
                    "killed at t={at:.1}s, {name} was still in the directory {:.0} ms later (lease {lease:.0} ms + 2 s)",
                    gone_at.unwrap_or(r.heal_ms) - r.at_ms
                )),
            }
            // Until the restarted engine is published again (or, if the directory never shows it
            // again before the end, until it reported ready).
            let back_ms = gone_at
                .and_then(|gone| {
                    input
                        .log
                        .directory
                        .iter()
                        .find(|(t, names)| *t > gone && names.as_ref().is_some_and(|n| n.contains(&name)))
                        .map(|(t, _)| *t)
                })
                .unwrap_or(r.heal_ms);
            let cutoff = r.at_ms + lease + 2e3 + ROUTING_SLACK.as_secs_f64() * 1e3;
            let routed = input
                .log
                .events
                .iter()
                .filter(|(_, _, e)| {
                    // The poll that saw it back may come up to a quarter second after it was.
                    matches!(e, Event::Transfer { from, start_ms, .. }
                        if *from == name && *start_ms > cutoff && *start_ms < back_ms - 250.0)
                })
                .count();
            if routed > 0 {
                violations.push(format!(
                    "{routed} pull(s) started toward {name} more than the lease + 3 s after it was killed, before it was back"
                ));
            }
        }
    }
    FaultOutcome {
        fault: what,
        at_s: at,
        heal_s: heal,
        before_mb_s: before,
        recovery_s,
        left_directory_s,
        restart_tries: r.restart_tries,
    }
}

fn resources(input: &Input<'_>, violations: &mut Vec<String>) -> Vec<Growth> {
    let mut growth = Vec::new();
    let first_fault = input.records.first().map_or(input.end_ms, |r| r.at_ms);
    for member in 0..input.fleet.engines {
        let samples: Vec<&Sample> = input.log.samples.iter().filter(|s| s.member == member).collect();
        // Only an engine that ran from start to end: a restarted one starts from scratch.
        if samples.iter().any(|s| s.generation != 1) {
            continue;
        }
        let (Some(base), Some(last)) = (samples.iter().rev().find(|s| s.t < first_fault), samples.last()) else {
            continue;
        };
        let name = input.fleet.name(member);
        growth.push(Growth {
            name: name.clone(),
            fds: (base.fds, last.fds),
            threads: (base.threads, last.threads),
            rss_kib: (base.rss_kib, last.rss_kib),
        });
        for (what, b, l, slack) in [
            ("file descriptors", base.fds, last.fds, FD_SLACK),
            ("threads", base.threads, last.threads, THREAD_SLACK),
            ("KiB resident", base.rss_kib, last.rss_kib, RSS_SLACK_KIB),
        ] {
            if l > b + slack {
                violations.push(format!(
                    "{name} grew from {b} to {l} {what} (at most {slack} more allowed)"
                ));
            }
        }
    }
    growth
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::schedule::Fleet;

    const FLEET: Fleet = Fleet {
        prefill: 1,
        engines: 2,
        ttl: Duration::from_secs(5),
    };
    const T0: f64 = 1_000_000.0;

    /// A pull by decode-0 from prefill-0 of 10 MB that ended at `end_s` after `took_s`.
    fn pull(end_s: f64, took_s: f64, outcome: &str) -> (f64, usize, Event) {
        let end_ms = T0 + end_s * 1e3;
        (
            end_ms,
            1,
            Event::Transfer {
                from: "prefill-0".into(),
                start_ms: end_ms - took_s * 1e3,
                end_ms,
                deadline_ms: 4000.0,
                bytes: 10_000_000,
                outcome: outcome.into(),
                error: None,
                notified: true,
            },
        )
    }

    /// Ten pulls a second, every second of `seconds` but the `gap` (a fault, and the restarted engine
    /// not yet found again).
    fn steady(seconds: u32, gap: std::ops::Range<u32>) -> Vec<(f64, usize, Event)> {
        (0..seconds * 10)
            .map(|i| f64::from(i) / 10.0)
            .filter(|t| !gap.contains(&(*t as u32)))
            .map(|t| pull(t + 0.05, 0.2, "ok"))
            .collect()
    }

    fn kill(at_s: f64, heal_s: f64) -> Record {
        Record {
            step: crate::schedule::Step {
                at: Duration::from_secs_f64(at_s),
                hold: Duration::from_secs_f64(heal_s - at_s),
                fault: Fault::Kill { member: 0 },
            },
            at_ms: T0 + at_s * 1e3,
            heal_ms: T0 + heal_s * 1e3,
            restart_tries: 1,
        }
    }

    fn judge_log(log: &Log, records: &[Record], seconds: f64) -> Verdict {
        judge(&Input {
            fleet: &FLEET,
            records,
            log,
            t0: T0,
            end_ms: T0 + seconds * 1e3,
        })
    }

    /// The directory lists prefill-0 except in `[gone, back)`, every quarter second.
    fn directory(seconds: f64, gone: f64, back: f64) -> Vec<(f64, Option<BTreeSet<String>>)> {
        (0..(seconds * 4.0) as u32)
            .map(|i| f64::from(i) / 4.0)
            .map(|t| {
                let mut names: BTreeSet<String> = ["decode-0".to_string()].into();
                if !(gone..back).contains(&t) {
                    names.insert("prefill-0".into());
                }
                (T0 + t * 1e3, Some(names))
            })
            .collect()
    }

    #[test]
    fn a_clean_run_passes() {
        let log = Log {
            events: steady(60, 20..31),
            directory: directory(60.0, 26.0, 30.5),
            ..Default::default()
        };
        let v = judge_log(&log, &[kill(20.0, 30.0)], 60.0);
        assert!(v.violations.is_empty(), "{:?}", v.violations);
        assert_eq!(v.faults[0].recovery_s, Some(4.0));
        assert_eq!(v.faults[0].left_directory_s, Some(6.0));
        assert!((v.faults[0].before_mb_s - 100.0).abs() < 1e-9);
    }

    #[test]
    fn each_broken_invariant_is_a_violation() {
        // A corrupt pull, a late one, and a record that stays 8 s (lease 5 s + 2 s allowed).
        let mut events = steady(60, 20..31);
        events.push((
            T0 + 40e3,
            1,
            Event::Corrupt {
                from: "prefill-0".into(),
                block: 3,
                offset: 17,
                end_ms: T0 + 40e3,
            },
        ));
        events.push(pull(45.0, 5.5, "timeout"));
        let log = Log {
            events,
            directory: directory(60.0, 28.0, 30.5),
            exits: vec![(T0 + 50e3, 1, "exit status: 1".into())],
            ..Default::default()
        };
        let v = judge_log(&log, &[kill(20.0, 30.0)], 60.0);
        let all = v.violations.join("\n");
        assert!(all.contains("block 3 of prefill-0"), "{all}");
        assert!(all.contains("took 5500 ms against a deadline of 4000 ms"), "{all}");
        assert!(all.contains("still in the directory"), "{all}");
        assert!(all.contains("decode-0 exited by itself"), "{all}");
        assert_eq!((v.corrupt, v.late), (1, 1));
    }

    #[test]
    fn throughput_that_stays_low_and_pulls_to_a_dead_engine_are_violations() {
        // After healing at 30 s, half the pulls a second: never back to 90 %.
        let mut events: Vec<_> = steady(60, 20..31)
            .into_iter()
            .enumerate()
            .filter(|(i, e)| e.0 < T0 + 30e3 || i % 2 == 0)
            .map(|(_, e)| e)
            .collect();
        // A pull that started toward prefill-0 at 29 s, when the directory had dropped it at 26 s.
        events.push(pull(29.5, 0.5, "io"));
        let log = Log {
            events,
            directory: directory(60.0, 26.0, 30.5),
            ..Default::default()
        };
        let v = judge_log(&log, &[kill(20.0, 30.0)], 60.0);
        let all = v.violations.join("\n");
        assert!(all.contains("did not return to 90 %"), "{all}");
        assert!(all.contains("1 pull(s) started toward prefill-0"), "{all}");
        assert_eq!(v.faults[0].recovery_s, None);
    }

    #[test]
    fn an_engine_that_grows_is_a_violation_and_a_restarted_one_is_not_judged() {
        let sample = |t: f64, member: usize, generation: u32, fds: u64| Sample {
            t: T0 + t * 1e3,
            member,
            generation,
            rss_kib: 100_000,
            threads: 10,
            fds,
        };
        let log = Log {
            events: steady(60, 20..31),
            directory: directory(60.0, 26.0, 30.5),
            samples: vec![
                sample(10.0, 1, 1, 40),
                sample(59.0, 1, 1, 40 + FD_SLACK + 1),
                sample(10.0, 0, 1, 40),
                sample(59.0, 0, 2, 400),
            ],
            ..Default::default()
        };
        let v = judge_log(&log, &[kill(20.0, 30.0)], 60.0);
        assert_eq!(
            v.violations,
            vec![format!(
                "decode-0 grew from 40 to {} file descriptors (at most 64 more allowed)",
                40 + FD_SLACK + 1
            )]
        );
    }
}
