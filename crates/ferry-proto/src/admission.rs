//! Who may wait to be admitted: the target's bounded table of connections that have not yet said
//! an accepted hello.
//!
//! Every connection a target accepts costs it a task, a socket and a little memory until it is
//! admitted or gone; an attacker who opens sockets and says nothing would otherwise hold every place
//! and lock real peers out for as long as he keeps reopening them. The table keeps at most
//! [`AdmissionLimits::places`] connections, at most [`AdmissionLimits::per_source`] of them from one
//! source address, and, when a newcomer finds no room, makes room by evicting the connection that
//! has shown the least and waited the longest:
//!
//! 1. a [`Stage::Silent`] connection (it has sent nothing yet), oldest first;
//! 2. else one in [`Stage::Handshaking`] (it sent its first bytes; TLS or the hello is under way),
//!    oldest first;
//! 3. never one that is [`Stage::Authenticated`]: it proved who it is, and only its hello is left.
//!
//! So a flood of silent or stalled connections is pushed out by whoever comes next, a peer that
//! completes its handshake promptly is evicted only by a newer arrival once every older and less
//! advanced connection is gone, and one source cannot take more than its share. The deadlines that
//! end connections which never progress are the I/O layer's (a short one for the first bytes, a
//! longer one for the whole handshake); this table needs no clock: arrival order is its age.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

/// How far a connection waiting for admission has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// Accepted; nothing received yet.
    Silent,
    /// Its first bytes arrived: a TLS handshake or a hello is under way.
    Handshaking,
    /// It completed mutual TLS; only its hello is left.
    Authenticated,
}

/// The table's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Most connections waiting at once.
    pub places: usize,
    /// Most of them from one source address.
    pub per_source: usize,
}

impl Default for AdmissionLimits {
    fn default() -> Self {
        AdmissionLimits {
            places: 256,
            per_source: 128,
        }
    }
}

/// A connection's place in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket(u64);

/// What became of an arrival.
#[derive(Debug)]
pub enum Arrival<H> {
    /// It has a place; `evicted` is the handle of the connection it took the place from, which the
    /// caller closes.
    Placed {
        /// The new connection's place.
        ticket: Ticket,
        /// The connection that made room, if one had to.
        evicted: Option<H>,
    },
    /// No place: every connection it could displace has authenticated. The caller closes it.
    Refused,
}

struct Waiting<H> {
    source: IpAddr,
    stage: Stage,
    handle: H,
}

/// The table of connections waiting for admission. `H` is whatever the caller needs to close an
/// evicted connection (a channel's sender, an abort handle).
pub struct AdmissionTable<H> {
    limits: AdmissionLimits,
    /// By arrival: a ticket's number is its age.
    waiting: BTreeMap<Ticket, Waiting<H>>,
    per_source: HashMap<IpAddr, usize>,
    next: u64,
}

impl<H> AdmissionTable<H> {
    /// An empty table; limits of zero are taken as one.
    pub fn new(limits: AdmissionLimits) -> Self {
        AdmissionTable {
            limits: AdmissionLimits {
                places: limits.places.max(1),
                per_source: limits.per_source.max(1),
            },
            waiting: BTreeMap::new(),
            per_source: HashMap::new(),
            next: 0,
        }
    }

    /// A connection from `source` arrived; `handle` closes it should it be evicted later.
    pub fn arrive(&mut self, source: IpAddr, handle: H) -> Arrival<H> {
        let source_full = self.from(source) >= self.limits.per_source;
        let evicted = if source_full {
            match self.victim(Some(source)) {
                Some(t) => self.remove(t),
                None => return Arrival::Refused,
            }
        } else if self.waiting.len() >= self.limits.places {
            match self.victim(None) {
                Some(t) => self.remove(t),
                None => return Arrival::Refused,
            }
        } else {
            None
        };
        let ticket = Ticket(self.next);
        self.next += 1;
        self.waiting.insert(
            ticket,
            Waiting {
                source,
                stage: Stage::Silent,
                handle,
            },
        );
        *self.per_source.entry(source).or_default() += 1;
        Arrival::Placed { ticket, evicted }
    }

    /// The connection holding `ticket` came as far as `stage` (a stage never goes back). Returns
    /// false if it no longer has a place (it was evicted).
    pub fn progress(&mut self, ticket: Ticket, stage: Stage) -> bool {
        match self.waiting.get_mut(&ticket) {
            Some(w) => {
                w.stage = w.stage.max(stage);
                true
            }
            None => false,
        }
    }

    /// The connection holding `ticket` is done waiting (admitted, refused or closed): its place is
    /// free. Returns false if it had no place any more (it was evicted first).
    pub fn leave(&mut self, ticket: Ticket) -> bool {
        self.remove(ticket).is_some()
    }

    /// Connections waiting.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether none is waiting.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Connections waiting from `source`.
    pub fn from(&self, source: IpAddr) -> usize {
        self.per_source.get(&source).copied().unwrap_or(0)
    }

    /// The connection to evict (among `source`'s, when given): the least advanced, then the oldest;
    /// never an authenticated one.
    fn victim(&self, source: Option<IpAddr>) -> Option<Ticket> {
        let candidates = || {
            self.waiting
                .iter()
                .filter(move |(_, w)| source.is_none_or(|s| w.source == s))
        };
        [Stage::Silent, Stage::Handshaking]
            .into_iter()
            .find_map(|stage| candidates().find(|(_, w)| w.stage == stage).map(|(t, _)| *t))
    }

    fn remove(&mut self, ticket: Ticket) -> Option<H> {
        let w = self.waiting.remove(&ticket)?;
        if let Some(n) = self.per_source.get_mut(&w.source) {
            *n -= 1;
            if *n == 0 {
                self.per_source.remove(&w.source);
            }
        }
        Some(w.handle)
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use proptest::prelude::*;

    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, n))
    }

    fn placed<H: std::fmt::Debug>(a: Arrival<H>) -> (Ticket, Option<H>) {
        match a {
            Arrival::Placed { ticket, evicted } => (ticket, evicted),
            Arrival::Refused => panic!("refused"),
        }
    }

    #[test]
    fn a_full_table_evicts_the_oldest_silent_connection_first() {
        let mut t = AdmissionTable::new(AdmissionLimits {
            places: 3,
            per_source: 3,
        });
        let (a, _) = placed(t.arrive(ip(1), "a"));
        let (b, _) = placed(t.arrive(ip(2), "b"));
        let (_c, _) = placed(t.arrive(ip(3), "c"));
        // a has sent its first bytes; b and c are silent: b, the oldest silent one, goes.
        assert!(t.progress(a, Stage::Handshaking));
        let (_d, evicted) = placed(t.arrive(ip(4), "d"));
        assert_eq!(evicted, Some("b"));
        assert!(!t.progress(b, Stage::Handshaking), "an evicted connection has no place");
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn authenticated_connections_are_never_evicted() {
        let mut t = AdmissionTable::new(AdmissionLimits {
            places: 2,
            per_source: 2,
        });
        let (a, _) = placed(t.arrive(ip(1), 1));
        let (b, _) = placed(t.arrive(ip(1), 2));
        t.progress(a, Stage::Authenticated);
        t.progress(b, Stage::Handshaking);
        let (_, evicted) = placed(t.arrive(ip(2), 3));
        assert_eq!(evicted, Some(2), "the one still handshaking goes");
        let (c, _) = placed(t.arrive(ip(3), 4));
        t.progress(c, Stage::Authenticated);
        assert!(matches!(t.arrive(ip(4), 5), Arrival::Refused));
        t.leave(a);
        assert!(matches!(t.arrive(ip(4), 6), Arrival::Placed { evicted: None, .. }));
    }

    #[test]
    fn one_source_takes_at_most_its_share() {
        let mut t = AdmissionTable::new(AdmissionLimits {
            places: 10,
            per_source: 2,
        });
        let (x, _) = placed(t.arrive(ip(9), "peer"));
        t.progress(x, Stage::Handshaking);
        for i in 0..100 {
            placed(t.arrive(ip(1), "flood"));
            assert!(t.from(ip(1)) <= 2, "after {i} arrivals");
        }
        // The flood evicted only its own connections.
        assert_eq!(t.len(), 3);
        assert!(t.progress(x, Stage::Authenticated));
    }

    #[derive(Debug, Clone)]
    enum Step {
        Arrive(u8),
        Progress(usize, Stage),
        Leave(usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        let stage = prop_oneof![
            Just(Stage::Silent),
            Just(Stage::Handshaking),
            Just(Stage::Authenticated)
        ];
        prop_oneof![
            4 => (0u8..5).prop_map(Step::Arrive),
            2 => (0usize..64, stage).prop_map(|(i, s)| Step::Progress(i, s)),
            1 => (0usize..64).prop_map(Step::Leave),
        ]
    }

    proptest! {
        /// Against a model: the bounds always hold, a place is taken only from a less advanced or as
        /// advanced but older connection (never an authenticated one), and a refusal happens only
        /// when every candidate has authenticated.
        #[test]
        fn bounds_hold_and_evictions_follow_the_rule(
            places in 1usize..8,
            per_source in 1usize..8,
            steps in proptest::collection::vec(step(), 1..200),
        ) {
            let mut t = AdmissionTable::new(AdmissionLimits { places, per_source });
            // The model: ticket -> (source, stage), for connections still placed.
            let mut model: BTreeMap<Ticket, (IpAddr, Stage)> = BTreeMap::new();
            let mut issued: Vec<Ticket> = Vec::new();
            for s in steps {
                match s {
                    Step::Arrive(n) => {
                        let source = ip(n);
                        let own = model.values().filter(|(src, _)| *src == source).count();
                        let pool: Vec<_> = model
                            .iter()
                            .filter(|(_, (src, _))| own < per_source || *src == source)
                            .map(|(t, v)| (*t, *v))
                            .collect();
                        let needs_room = own >= per_source || model.len() >= places;
                        match t.arrive(source, ()) {
                            Arrival::Placed { ticket, evicted } => {
                                prop_assert_eq!(evicted.is_some(), needs_room);
                                if needs_room {
                                    // The model's choice: least advanced, then oldest.
                                    let (victim, _) = *pool
                                        .iter()
                                        .filter(|(_, (_, st))| *st != Stage::Authenticated)
                                        .min_by_key(|(t, (_, st))| (*st, *t))
                                        .expect("a victim");
                                    model.remove(&victim);
                                }
                                model.insert(ticket, (source, Stage::Silent));
                                issued.push(ticket);
                            }
                            Arrival::Refused => {
                                prop_assert!(needs_room);
                                prop_assert!(pool.iter().all(|(_, (_, st))| *st == Stage::Authenticated));
                            }
                        }
                    }
                    Step::Progress(i, stage) => {
                        if let Some(ticket) = issued.get(i).copied() {
                            let known = model.get_mut(&ticket);
                            let expected = known.is_some();
                            if let Some(entry) = known {
                                entry.1 = entry.1.max(stage);
                            }
                            prop_assert_eq!(t.progress(ticket, stage), expected);
                        }
                    }
                    Step::Leave(i) => {
                        if let Some(ticket) = issued.get(i).copied() {
                            model.remove(&ticket);
                            t.leave(ticket);
                        }
                    }
                }
                prop_assert_eq!(t.len(), model.len());
                prop_assert!(t.len() <= places);
                for n in 0..5 {
                    let own = model.values().filter(|(src, _)| *src == ip(n)).count();
                    prop_assert_eq!(t.from(ip(n)), own);
                    prop_assert!(own <= per_source);
                }
            }
        }
    }
}
