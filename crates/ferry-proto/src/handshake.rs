//! The handshake: the hello that opens every stream, and the target's decision on it.
//!
//! The first stream of a link (index 0, the control stream) opens the link: it declares how many
//! streams the link will have, and the target admits it if that number is within
//! [`LinkLimits::max_streams`], the engine has a free link slot (the caller's business: see
//! [`LinkRegistry::open`]) and the link token is new. Every further stream joins by presenting the
//! token, the same engine id and an index below the declared count that no stream of the link used
//! before; so a link has at most the streams it declared, whatever its peer sends.
//!
//! A registry made with [`LinkRegistry::authenticating`] opens links only from control streams that
//! completed mutual TLS, and admits a further stream only with the join proof of that link's session
//! (see [`crate::auth`]). What it answers a stream that has not authenticated names nothing about the
//! engine ([`refuse_anonymously`]).

use std::collections::HashMap;

use ferry_core::codec::{Hello, HelloAck, Limits};
use ferry_core::{DataProtection, Error, RegionAd, Result, TransportKind, WireError};

use crate::auth::JoinKey;
use crate::ids::{LinkToken, StreamIndex};
use crate::limits::LinkLimits;
use crate::seal::{Opener, Sealer};

/// What a target decodes before it admits a stream: one hello, whose body is under a hundred bytes
/// (ids, counts, a short list of transports, a 32-byte join proof), and nothing with a payload. A
/// stream that announces more is refused at its header, before the target holds its bytes.
pub const BEFORE_ADMISSION: Limits = Limits {
    max_body: 512,
    max_payload: 0,
};

/// What an engine says about itself in a handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Engine id.
    pub engine_id: u64,
    /// Host id (equal on two engines of the same host).
    pub host_id: u64,
    /// Usable transports, best first.
    pub transports: Vec<TransportKind>,
}

impl Identity {
    /// The hello for stream `index` of a link of `count` streams named `token`, asking for
    /// `protection` of its bytes; a further stream of an authenticated link carries the join proof
    /// made with the link's `key`.
    pub fn hello(
        &self,
        token: LinkToken,
        index: StreamIndex,
        count: u16,
        key: Option<&JoinKey>,
        protection: DataProtection,
    ) -> Hello {
        let join_proof = match key {
            Some(key) if !index.is_control() => key.proof(token, index, protection),
            _ => [0; 32],
        };
        Hello {
            engine_id: self.engine_id,
            link_token: token.0,
            stream_index: index.0,
            stream_count: count,
            transports: self.transports.clone(),
            host_id: self.host_id,
            join_proof,
            protection,
        }
    }

    /// A target's acceptance; `regions` go only to the control stream.
    pub fn accept(&self, regions: Vec<RegionAd>) -> HelloAck {
        HelloAck {
            engine_id: self.engine_id,
            refusal: None,
            transports: self.transports.clone(),
            host_id: self.host_id,
            regions,
        }
    }

    /// A target's refusal, carrying `error` to the initiator.
    pub fn refuse(&self, error: &Error) -> HelloAck {
        HelloAck {
            refusal: Some(WireError::from(error)),
            ..self.accept(Vec::new())
        }
    }
}

/// A refusal that says nothing about the engine (no id, host or transports): the answer to a stream
/// that has not authenticated, on an engine that requires it.
pub fn refuse_anonymously(error: &Error) -> HelloAck {
    HelloAck {
        engine_id: 0,
        refusal: Some(WireError::from(error)),
        transports: Vec::new(),
        host_id: 0,
        regions: Vec::new(),
    }
}

/// The initiator's check of a target's answer to the hello of stream `index`: a refusal becomes the
/// error it carries, and only the control stream's answer may carry the region table.
pub fn check_ack(ack: HelloAck, index: StreamIndex, peer: &str) -> Result<HelloAck> {
    if let Some(refusal) = ack.refusal {
        return Err(refusal.into_error());
    }
    if !index.is_control() && !ack.regions.is_empty() {
        return Err(Error::Protocol(format!(
            "{peer} sent a region table on {index}; only the control stream carries one"
        )));
    }
    Ok(ack)
}

/// What a stream's own TLS session proved.
#[derive(Debug, Clone)]
pub struct Proven {
    /// The session's key for the join proofs of the link's further streams.
    pub join_key: JoinKey,
    /// The peer identity's name (its certificate's), which the identity's quotas are counted by.
    pub identity: String,
}

/// The target's decision on a hello.
#[derive(Debug)]
pub enum Admission<L> {
    /// A control stream whose link may open: acquire a link slot, then call [`LinkRegistry::open`].
    Open,
    /// A further stream of a known link, with the target's ends of its record layer when its bytes
    /// are protected ([`crate::seal`]): everything after the hello's answer goes through them.
    Join(L, Option<Box<(Sealer, Opener)>>),
}

struct Entry<L> {
    peer_engine: u64,
    stream_count: u16,
    joined: Vec<bool>,
    /// The key join proofs are checked with, on an authenticated link.
    join_key: Option<JoinKey>,
    /// Who opened it, on an authenticated link.
    identity: Option<String>,
    link: L,
}

/// What one peer identity holds: links, and the streams they declared.
#[derive(Debug, Default, Clone, Copy)]
struct Held {
    links: usize,
    streams: usize,
}

/// The target's table of open links, by token, and of the streams each has.
pub struct LinkRegistry<L> {
    limits: LinkLimits,
    authenticating: bool,
    /// The least protection a further stream must ask for.
    required: DataProtection,
    links: HashMap<LinkToken, Entry<L>>,
    /// Per authenticated identity: what its open links hold (see [`LinkLimits::max_links_per_identity`]).
    held: HashMap<String, Held>,
}

impl<L: Clone> LinkRegistry<L> {
    /// An empty table of an engine open to anyone who reaches it.
    pub fn new(limits: LinkLimits) -> Self {
        LinkRegistry {
            limits,
            authenticating: false,
            required: DataProtection::Plain,
            links: HashMap::new(),
            held: HashMap::new(),
        }
    }

    /// An empty table of an engine that admits authenticated links only. Their further streams must
    /// be integrity-protected at least (see [`requiring`](Self::requiring)).
    pub fn authenticating(limits: LinkLimits) -> Self {
        LinkRegistry {
            authenticating: true,
            required: DataProtection::Integrity,
            ..LinkRegistry::new(limits)
        }
    }

    /// This registry (of an authenticating engine) admits a further stream only if it asks for
    /// `protection` or more: with [`DataProtection::Encrypted`], streams that are integrity-protected
    /// only are refused; with [`DataProtection::Plain`], streams may go unprotected.
    pub fn requiring(mut self, protection: DataProtection) -> Self {
        self.required = protection;
        self
    }

    /// Whether only authenticated links are admitted.
    pub fn is_authenticating(&self) -> bool {
        self.authenticating
    }

    /// Decides on `hello`: open a link, join one, or refuse (the error to send back). `session` is
    /// what the stream's own TLS session proved, when it has one: a control stream opens a link only
    /// within that identity's quotas ([`LinkLimits::max_links_per_identity`],
    /// [`LinkLimits::max_streams_per_identity`]).
    pub fn admit(&mut self, hello: &Hello, session: Option<&Proven>) -> Result<Admission<L>> {
        let token = LinkToken(hello.link_token);
        let index = StreamIndex(hello.stream_index);
        if index.is_control() {
            if self.authenticating && session.is_none() {
                return Err(Error::PermissionDenied(
                    "this engine admits only links whose control stream authenticates with mutual TLS".into(),
                ));
            }
            let max = self.limits.max_streams;
            if hello.stream_count == 0 || hello.stream_count > max {
                return Err(Error::InvalidArgument(format!(
                    "{} streams asked for; 1 to {max} are allowed",
                    hello.stream_count
                )));
            }
            if self.links.contains_key(&token) {
                return Err(Error::Protocol("link token reused".into()));
            }
            if let Some(proven) = session {
                self.check_quota(&proven.identity, hello.stream_count)?;
            }
            return Ok(Admission::Open);
        }
        let Some(entry) = self.links.get_mut(&token).filter(|e| e.peer_engine == hello.engine_id) else {
            return Err(Error::Protocol("unknown link token".into()));
        };
        let proven = match &entry.join_key {
            Some(key) => key.verify(token, index, hello.protection, &hello.join_proof),
            None => !self.authenticating,
        };
        if !proven {
            return Err(Error::PermissionDenied(format!(
                "{index} did not prove it belongs to the authenticated link it names"
            )));
        }
        // A stream that ran TLS of its own is encrypted by it, and needs no records on top.
        let protection = match session {
            Some(_) => DataProtection::Encrypted,
            None => hello.protection,
        };
        if protection < self.required {
            return Err(Error::PermissionDenied(format!(
                "{index} asked for {protection} data, and this engine requires {} at least: dial it with \
                 data protection {} or more (--data-protection)",
                self.required, self.required
            )));
        }
        let sealing = match (session, hello.protection, &entry.join_key) {
            (Some(_), _, _) | (None, DataProtection::Plain, _) => None,
            (None, protection, Some(key)) => Some(Box::new(key.stream_keys(token, index)?.target(protection))),
            (None, protection, None) => {
                return Err(Error::Unsupported(format!(
                    "{index} asked for {protection} data on a link that did not authenticate: there is no \
                     session to key it from; dial this engine without data protection, or configure TLS on both"
                )));
            }
        };
        if hello.stream_index >= entry.stream_count {
            return Err(Error::InvalidArgument(format!(
                "{index} asked to join a link of {} streams",
                entry.stream_count
            )));
        }
        let joined = &mut entry.joined[index.get()];
        if *joined {
            return Err(Error::Protocol(format!("{index} of this link joined already")));
        }
        *joined = true;
        Ok(Admission::Join(entry.link.clone(), sealing))
    }

    /// Whether `who` may open one more link of `streams` streams.
    fn check_quota(&self, who: &str, streams: u16) -> Result<()> {
        let held = self.held.get(who).copied().unwrap_or_default();
        if held.links >= self.limits.max_links_per_identity {
            return Err(Error::ResourceExhausted(format!(
                "{who} holds {} links to this engine, the most one peer may; close one first",
                held.links
            )));
        }
        if held.streams + usize::from(streams) > self.limits.max_streams_per_identity {
            return Err(Error::ResourceExhausted(format!(
                "{who} holds {} streams to this engine and asks for {streams} more; one peer may hold {}",
                held.streams, self.limits.max_streams_per_identity
            )));
        }
        Ok(())
    }

    /// Records the link that `hello` (admitted with [`Admission::Open`]) opened; `session` is what
    /// its control stream's TLS session proved, on an authenticated link: its join key checks the
    /// link's further streams, and the link counts against its identity's quotas until it closes.
    pub fn open(&mut self, hello: &Hello, link: L, session: Option<&Proven>) -> Result<()> {
        let token = LinkToken(hello.link_token);
        if self.links.contains_key(&token) {
            return Err(Error::Protocol("link token reused".into()));
        }
        if let Some(proven) = session {
            self.check_quota(&proven.identity, hello.stream_count)?;
            let held = self.held.entry(proven.identity.clone()).or_default();
            held.links += 1;
            held.streams += usize::from(hello.stream_count);
        }
        let mut joined = vec![false; hello.stream_count as usize];
        if let Some(first) = joined.first_mut() {
            *first = true;
        }
        self.links.insert(
            token,
            Entry {
                peer_engine: hello.engine_id,
                stream_count: hello.stream_count,
                joined,
                join_key: session.map(|p| p.join_key.clone()),
                identity: session.map(|p| p.identity.clone()),
                link,
            },
        );
        Ok(())
    }

    /// Forgets a link (its control stream ended); its token cannot be joined any more.
    pub fn close(&mut self, token: LinkToken) -> Option<L> {
        let entry = self.links.remove(&token)?;
        self.release(&entry);
        Some(entry.link)
    }

    fn release(&mut self, entry: &Entry<L>) {
        let Some(who) = &entry.identity else { return };
        if let Some(held) = self.held.get_mut(who) {
            held.links -= 1;
            held.streams -= usize::from(entry.stream_count);
            if held.links == 0 {
                self.held.remove(who);
            }
        }
    }

    /// Every open link.
    pub fn links(&self) -> impl Iterator<Item = &L> {
        self.links.values().map(|e| &e.link)
    }

    /// Removes and returns every link.
    pub fn drain(&mut self) -> Vec<L> {
        self.held.clear();
        self.links.drain().map(|(_, e)| e.link).collect()
    }

    /// Number of open links.
    pub fn len(&self) -> usize {
        self.links.len()
    }

    /// Whether no link is open.
    pub fn is_empty(&self) -> bool {
        self.links.is_empty()
    }

    /// Streams of `token`'s link that have joined, the control stream included.
    pub fn streams(&self, token: LinkToken) -> usize {
        self.links
            .get(&token)
            .map_or(0, |e| e.joined.iter().filter(|j| **j).count())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(token: u64, engine: u64, index: u16, count: u16) -> Hello {
        Identity {
            engine_id: engine,
            host_id: 1,
            transports: vec![TransportKind::Tcp],
        }
        .hello(LinkToken(token), StreamIndex(index), count, None, DataProtection::Plain)
    }

    #[test]
    fn a_link_has_at_most_the_streams_it_declared() {
        let mut reg = LinkRegistry::new(LinkLimits::default());
        let h0 = hello(7, 1, 0, 3);
        assert!(matches!(reg.admit(&h0, None), Ok(Admission::Open)));
        reg.open(&h0, "link", None).unwrap();
        assert!(matches!(
            reg.admit(&hello(7, 1, 1, 3), None),
            Ok(Admission::Join("link", None))
        ));
        assert!(matches!(
            reg.admit(&hello(7, 1, 2, 3), None),
            Ok(Admission::Join("link", None))
        ));
        // The same index twice, an index past the count, the control index again, another engine.
        assert!(matches!(reg.admit(&hello(7, 1, 1, 3), None), Err(Error::Protocol(_))));
        assert!(matches!(
            reg.admit(&hello(7, 1, 3, 3), None),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(reg.admit(&hello(7, 1, 0, 3), None), Err(Error::Protocol(_))));
        assert!(matches!(reg.admit(&hello(7, 2, 2, 3), None), Err(Error::Protocol(_))));
        assert_eq!(reg.streams(LinkToken(7)), 3);
        assert_eq!(reg.close(LinkToken(7)), Some("link"));
        assert!(matches!(reg.admit(&hello(7, 1, 2, 3), None), Err(Error::Protocol(_))));
    }

    #[test]
    fn an_authenticating_registry_needs_a_session_and_join_proofs() {
        let me = Identity {
            engine_id: 1,
            host_id: 1,
            transports: vec![TransportKind::Tcp],
        };
        let key = JoinKey::from_exported(&[5; 32]);
        let stolen = JoinKey::from_exported(&[6; 32]);
        let proven = Proven {
            join_key: key.clone(),
            identity: "p".into(),
        };
        let mut reg = LinkRegistry::authenticating(LinkLimits::default());
        let h0 = me.hello(LinkToken(9), StreamIndex(0), 3, Some(&key), DataProtection::Integrity);
        // A control stream without a TLS session opens nothing.
        assert!(matches!(reg.admit(&h0, None), Err(Error::PermissionDenied(_))));
        assert!(matches!(reg.admit(&h0, Some(&proven)), Ok(Admission::Open)));
        reg.open(&h0, "link", Some(&proven)).unwrap();
        // A join with the token but no proof, or another session's proof, is refused and uses no index.
        let bare = me.hello(LinkToken(9), StreamIndex(1), 3, None, DataProtection::Integrity);
        assert!(matches!(reg.admit(&bare, None), Err(Error::PermissionDenied(_))));
        let forged = me.hello(
            LinkToken(9),
            StreamIndex(1),
            3,
            Some(&stolen),
            DataProtection::Integrity,
        );
        assert!(matches!(reg.admit(&forged, None), Err(Error::PermissionDenied(_))));
        // A proof for one index does not open another.
        let mut moved = me.hello(LinkToken(9), StreamIndex(2), 3, None, DataProtection::Integrity);
        moved.join_proof = key.proof(LinkToken(9), StreamIndex(1), DataProtection::Integrity);
        assert!(matches!(reg.admit(&moved, None), Err(Error::PermissionDenied(_))));
        let good = me.hello(LinkToken(9), StreamIndex(1), 3, Some(&key), DataProtection::Integrity);
        assert!(matches!(reg.admit(&good, None), Ok(Admission::Join("link", Some(_)))));
        // Replayed after it joined: refused.
        assert!(matches!(reg.admit(&good, None), Err(Error::Protocol(_))));
        assert_eq!(reg.streams(LinkToken(9)), 2);
    }

    #[test]
    fn one_identity_holds_at_most_its_quota_of_links_and_streams() {
        let limits = LinkLimits {
            max_links_per_identity: 2,
            max_streams_per_identity: 10,
            ..LinkLimits::default()
        };
        let mut reg = LinkRegistry::authenticating(limits);
        let open = |reg: &mut LinkRegistry<u64>, token: u64, count: u16, who: &str| {
            let h = hello(token, token, 0, count);
            let proven = Proven {
                join_key: JoinKey::from_exported(&[1; 32]),
                identity: who.into(),
            };
            reg.admit(&h, Some(&proven))?;
            reg.open(&h, token, Some(&proven))
        };
        open(&mut reg, 1, 4, "flood").unwrap();
        open(&mut reg, 2, 4, "flood").unwrap();
        // A third link, and more streams than are left: refused, named.
        assert!(matches!(open(&mut reg, 3, 1, "flood"), Err(Error::ResourceExhausted(m)) if m.contains("flood")));
        reg.close(LinkToken(2));
        assert!(matches!(open(&mut reg, 4, 7, "flood"), Err(Error::ResourceExhausted(m)) if m.contains("streams")));
        open(&mut reg, 5, 6, "flood").unwrap();
        // Another identity is not held back by the first.
        open(&mut reg, 6, 10, "decode-1").unwrap();
        // Closing everything gives the quota back.
        for t in [1, 5, 6] {
            reg.close(LinkToken(t));
        }
        open(&mut reg, 7, 4, "flood").unwrap();
        open(&mut reg, 8, 6, "flood").unwrap();
    }

    #[test]
    fn further_streams_are_held_to_the_engines_least_protection() {
        let me = Identity {
            engine_id: 1,
            host_id: 1,
            transports: vec![TransportKind::Tcp],
        };
        let key = JoinKey::from_exported(&[5; 32]);
        let proven = Proven {
            join_key: key.clone(),
            identity: "p".into(),
        };
        let join = |reg: &mut LinkRegistry<&'static str>, index: u16, protection| {
            reg.admit(
                &me.hello(LinkToken(3), StreamIndex(index), 4, Some(&key), protection),
                None,
            )
        };
        let h0 = me.hello(LinkToken(3), StreamIndex(0), 4, Some(&key), DataProtection::Encrypted);
        // By default an authenticated engine wants integrity at least: a plain stream, however well
        // it proves its link, is refused, and its index stays free.
        let mut reg = LinkRegistry::authenticating(LinkLimits::default());
        assert!(matches!(reg.admit(&h0, Some(&proven)), Ok(Admission::Open)));
        reg.open(&h0, "link", Some(&proven)).unwrap();
        assert!(
            matches!(join(&mut reg, 1, DataProtection::Plain), Err(Error::PermissionDenied(m)) if m.contains("integrity"))
        );
        let Ok(Admission::Join("link", Some(sealing))) = join(&mut reg, 1, DataProtection::Integrity) else {
            panic!("an integrity-protected stream joins, with its record layer");
        };
        assert_eq!(sealing.0.protection(), DataProtection::Integrity);
        // A hello whose protection was lowered on the way no longer matches its proof.
        let mut lowered = me.hello(LinkToken(3), StreamIndex(2), 4, Some(&key), DataProtection::Integrity);
        lowered.protection = DataProtection::Plain;
        let mut lax = LinkRegistry::authenticating(LinkLimits::default()).requiring(DataProtection::Plain);
        lax.admit(&h0, Some(&proven)).unwrap();
        lax.open(&h0, "link", Some(&proven)).unwrap();
        assert!(matches!(lax.admit(&lowered, None), Err(Error::PermissionDenied(_))));
        // An engine that opted out admits a plain stream, with no record layer.
        assert!(matches!(
            join(&mut lax, 2, DataProtection::Plain),
            Ok(Admission::Join("link", None))
        ));

        // One that requires encryption refuses integrity only; a stream with TLS of its own passes.
        let mut strict = LinkRegistry::authenticating(LinkLimits::default()).requiring(DataProtection::Encrypted);
        strict.admit(&h0, Some(&proven)).unwrap();
        strict.open(&h0, "link", Some(&proven)).unwrap();
        assert!(
            matches!(join(&mut strict, 1, DataProtection::Integrity), Err(Error::PermissionDenied(m)) if m.contains("encrypted"))
        );
        assert!(matches!(
            join(&mut strict, 1, DataProtection::Encrypted),
            Ok(Admission::Join("link", Some(_)))
        ));
        let stream_session = Proven {
            join_key: JoinKey::from_exported(&[8; 32]),
            identity: "p".into(),
        };
        let tls_join = me.hello(LinkToken(3), StreamIndex(2), 4, Some(&key), DataProtection::Plain);
        assert!(matches!(
            strict.admit(&tls_join, Some(&stream_session)),
            Ok(Admission::Join("link", None))
        ));
    }

    #[test]
    fn an_unauthenticated_link_cannot_protect_its_streams() {
        let mut reg = LinkRegistry::new(LinkLimits::default());
        let h0 = hello(4, 1, 0, 2);
        reg.admit(&h0, None).unwrap();
        reg.open(&h0, "link", None).unwrap();
        let mut asks = hello(4, 1, 1, 2);
        asks.protection = DataProtection::Integrity;
        assert!(matches!(reg.admit(&asks, None), Err(Error::Unsupported(_))));
    }

    #[test]
    fn an_anonymous_refusal_names_nothing() {
        let ack = refuse_anonymously(&Error::PermissionDenied("authenticate first".into()));
        assert_eq!((ack.engine_id, ack.host_id), (0, 0));
        assert!(ack.transports.is_empty() && ack.regions.is_empty());
        assert!(matches!(
            check_ack(ack, StreamIndex(0), "p"),
            Err(Error::PermissionDenied(_))
        ));
    }

    #[test]
    fn stream_counts_out_of_range_are_refused() {
        let limits = LinkLimits {
            max_streams: 4,
            ..LinkLimits::default()
        };
        let mut reg: LinkRegistry<()> = LinkRegistry::new(limits);
        assert!(matches!(
            reg.admit(&hello(1, 1, 0, 0), None),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            reg.admit(&hello(1, 1, 0, 5), None),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(reg.admit(&hello(1, 1, 0, 4), None), Ok(Admission::Open)));
    }

    #[test]
    fn a_refusal_becomes_its_error_and_only_stream_0_gets_regions() {
        let me = Identity {
            engine_id: 9,
            host_id: 2,
            transports: vec![TransportKind::Tcp],
        };
        let refused = me.refuse(&Error::ResourceExhausted("all link slots are in use".into()));
        assert!(matches!(
            check_ack(refused, StreamIndex(0), "peer"),
            Err(Error::ResourceExhausted(m)) if m.contains("slots")
        ));
        let ad = RegionAd {
            key: ferry_core::RegionKey(1),
            addr: 0,
            len: 1,
            access: ferry_core::Access::READ,
            persistent: false,
            staged: false,
            transport_keys: Vec::new(),
        };
        assert!(check_ack(me.accept(vec![ad.clone()]), StreamIndex(0), "peer").is_ok());
        assert!(matches!(
            check_ack(me.accept(vec![ad]), StreamIndex(1), "peer"),
            Err(Error::Protocol(_))
        ));
    }
}
