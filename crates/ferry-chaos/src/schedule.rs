//! The fault schedule: which fault, on which engines, when, and for how long. It is a pure function of
//! the seed, the profile and the fleet's size, printed before a run, so that a failing run is replayed
//! with `--seed`.

use std::fmt;
use std::time::Duration;

use crate::rng::Rng;

/// One fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// SIGKILL, then the same engine (name, address) started again once the hold is over: at once, as
    /// a supervisor restarts a crashed process, or after its directory lease ran out.
    Kill { member: usize },
    /// SIGSTOP, SIGCONT when the hold is over: an engine that hangs, holding its sockets open.
    Hang { member: usize },
    /// `tc netem delay` on both directions of the engine's link.
    Delay { member: usize, ms: u32 },
    /// `tc netem loss` on both directions of the engine's link.
    Loss { member: usize, percent: u32 },
    /// Every packet between the two engines dropped (and no other).
    Partition { a: usize, b: usize },
    /// etcd killed, and started again when the hold is over: on its data, or on an empty data folder.
    EtcdRestart { keep_data: bool },
}

/// A fault, when it starts and when it heals.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Step {
    /// Since the run's start.
    #[serde(serialize_with = "seconds")]
    pub at: Duration,
    /// From the fault to its healing.
    #[serde(serialize_with = "seconds")]
    pub hold: Duration,
    pub fault: Fault,
}

impl Step {
    pub fn heals_at(&self) -> Duration {
        self.at + self.hold
    }
}

fn seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// Which faults, how many, for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Profile {
    /// Each kind of fault once (two kills: a restart at once and one after the lease ran out), about
    /// two and a half minutes.
    Short,
    /// Faults drawn at random, one after another, for the run's duration (15 minutes by default).
    Long,
}

/// The fleet a schedule is for.
#[derive(Debug, Clone, Copy)]
pub struct Fleet {
    /// Engines 0..prefill are prefill engines, the rest decode engines.
    pub prefill: usize,
    pub engines: usize,
    /// The directory lease of every engine.
    pub ttl: Duration,
}

impl Fleet {
    pub fn name(&self, member: usize) -> String {
        if member < self.prefill {
            format!("prefill-{member}")
        } else {
            format!("decode-{}", member - self.prefill)
        }
    }
}

/// The time each fault is given to heal fully before the next one starts; also the limit within which
/// throughput must be back (see the invariants).
pub const RECOVERY: Duration = Duration::from_secs(12);
/// Traffic before the first fault: the pre-fault level of the first fault is measured on it.
pub const WARMUP: Duration = Duration::from_secs(15);

/// The whole schedule.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Schedule {
    pub seed: u64,
    pub steps: Vec<Step>,
    /// When traffic stops.
    #[serde(serialize_with = "seconds")]
    pub end: Duration,
}

/// The faults of `profile` for `fleet`, drawn from `seed`; a long profile fills `duration`.
pub fn plan(seed: u64, profile: Profile, fleet: Fleet, duration: Duration) -> Schedule {
    let mut rng = Rng::new(seed);
    // A kill held past the lease and two seconds more, so that the record's leaving can be checked.
    let lease_kill = fleet.ttl + Duration::from_secs(3);
    let draw = |kind: usize, rng: &mut Rng| -> (Fault, Duration) {
        let any = rng.index(fleet.engines);
        let prefill = rng.index(fleet.prefill);
        let decode = fleet.prefill + rng.index(fleet.engines - fleet.prefill);
        match kind {
            0 => (Fault::Kill { member: any }, Duration::from_millis(500)),
            1 => (Fault::Kill { member: any }, lease_kill),
            // A hung decode engine's own calls are late because it is stopped, not because of ferry.
            2 => (Fault::Hang { member: prefill }, Duration::from_secs(6)),
            3 => (Fault::Delay { member: any, ms: 100 }, Duration::from_secs(6)),
            4 => (
                Fault::Loss {
                    member: any,
                    percent: 5,
                },
                Duration::from_secs(6),
            ),
            5 => (Fault::Partition { a: decode, b: prefill }, Duration::from_secs(6)),
            6 => (Fault::EtcdRestart { keep_data: true }, Duration::from_secs(3)),
            _ => (Fault::EtcdRestart { keep_data: false }, Duration::from_secs(3)),
        }
    };
    const KINDS: usize = 8;
    let mut kinds: Vec<usize> = match profile {
        Profile::Short => (0..KINDS).collect(),
        Profile::Long => Vec::new(),
    };
    // Shuffle (Fisher-Yates) the short profile's kinds.
    for i in (1..kinds.len()).rev() {
        kinds.swap(i, rng.index(i + 1));
    }
    let mut steps = Vec::new();
    let mut at = WARMUP;
    loop {
        let kind = match profile {
            Profile::Short if steps.len() == kinds.len() => break,
            Profile::Short => kinds[steps.len()],
            Profile::Long => rng.index(KINDS),
        };
        let (fault, hold) = draw(kind, &mut rng);
        if profile == Profile::Long && at + hold + RECOVERY > duration {
            break;
        }
        steps.push(Step { at, hold, fault });
        at += hold + RECOVERY;
    }
    Schedule { seed, steps, end: at }
}

impl Fault {
    /// In words, with the engines' names.
    pub fn describe(&self, fleet: &Fleet) -> String {
        match *self {
            Fault::Kill { member } => format!("kill {}", fleet.name(member)),
            Fault::Hang { member } => format!("hang {}", fleet.name(member)),
            Fault::Delay { member, ms } => format!("delay {} by {ms} ms", fleet.name(member)),
            Fault::Loss { member, percent } => format!("lose {percent}% of {}'s packets", fleet.name(member)),
            Fault::Partition { a, b } => format!("partition {} from {}", fleet.name(a), fleet.name(b)),
            Fault::EtcdRestart { keep_data: true } => "restart etcd on its data".into(),
            Fault::EtcdRestart { keep_data: false } => "restart etcd empty".into(),
        }
    }
}

/// The schedule as lines for the log.
pub struct Shown<'a>(pub &'a Schedule, pub &'a Fleet);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "schedule (seed {}):", self.0.seed)?;
        for s in &self.0.steps {
            writeln!(
                f,
                "  t={:>6.1}s  {:<40} heals at t={:.1}s",
                s.at.as_secs_f64(),
                s.fault.describe(self.1),
                s.heals_at().as_secs_f64()
            )?;
        }
        write!(f, "  t={:>6.1}s  end", self.0.end.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const FLEET: Fleet = Fleet {
        prefill: 4,
        engines: 8,
        ttl: Duration::from_secs(5),
    };

    #[test]
    fn the_short_profile_has_every_kind_once_and_two_kills() {
        let s = plan(7, Profile::Short, FLEET, Duration::ZERO);
        assert_eq!(s.steps.len(), 8);
        let kills: Vec<_> = s
            .steps
            .iter()
            .filter(|s| matches!(s.fault, Fault::Kill { .. }))
            .collect();
        assert_eq!(kills.len(), 2);
        assert!(kills.iter().any(|k| k.hold > FLEET.ttl + Duration::from_secs(2)));
        assert!(kills.iter().any(|k| k.hold < Duration::from_secs(1)));
        for keep_data in [true, false] {
            assert!(s.steps.iter().any(|s| s.fault == Fault::EtcdRestart { keep_data }));
        }
        assert!(s.end < Duration::from_secs(180), "{:?}", s.end);
    }

    proptest! {
        #[test]
        fn a_seed_replays_the_same_schedule_and_faults_never_overlap(seed: u64, long in any::<bool>()) {
            let profile = if long { Profile::Long } else { Profile::Short };
            let duration = Duration::from_secs(600);
            let a = plan(seed, profile, FLEET, duration);
            let b = plan(seed, profile, FLEET, duration);
            prop_assert_eq!(&a.steps, &b.steps);
            let mut free_from = WARMUP;
            for s in &a.steps {
                prop_assert!(s.at >= free_from);
                free_from = s.heals_at() + RECOVERY;
                match s.fault {
                    Fault::Kill { member } | Fault::Delay { member, .. } | Fault::Loss { member, .. } => {
                        prop_assert!(member < FLEET.engines)
                    }
                    Fault::Hang { member } => prop_assert!(member < FLEET.prefill),
                    Fault::Partition { a, b } => prop_assert!(a >= FLEET.prefill && b < FLEET.prefill),
                    Fault::EtcdRestart { .. } => {}
                }
            }
            if long {
                prop_assert!(a.end <= duration);
            }
        }
    }
}
