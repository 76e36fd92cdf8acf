//! The initiator's side of a link: operations awaiting answers, and what the target tells it.
//!
//! Every operation the initiator sends that the target answers (a write's frame, a read, a commit, a
//! notification, a data-path setup) is started here: it gets an [`OpId`] and a stream (the given one,
//! or the one with the fewest bytes outstanding), and waits in that stream's table until its answer is
//! handled. An answer must come on the operation's stream and be of its kind: a read is answered by
//! its data or by an error, a setup by a setup reply, anything else by an acknowledgement. Which
//! answers break the link and which are stale is the rule of [`crate::ops`], the same on every
//! transport: an id this link never issued breaks it (`Error::Protocol`), as does an answer of the
//! wrong kind; an answer for an operation taken back locally ([`Initiator::take`]) is stale and
//! ignored (its payload discarded). Closing the link hands every waiting operation back with the error, and refuses new ones.
//!
//! Time here is the link's, not a transfer's: [`Initiator::poll_timeout`] is when the keepalive next
//! probes a silent peer or gives the link up. How long a transfer may take is its caller's bound
//! (the engine's `Transfer` holds the one timer, as a QUIC stack's application bounds its own
//! requests while the connection times only itself); a transfer that gives up takes its operations
//! back ([`Initiator::take`]), and their answers, should they still come, are stale.
//!
//! The per-operation state `P` is the transport's (a completion channel, where a read's data goes);
//! this module only keeps it.

use std::collections::HashMap;
use std::time::Instant;

use ferry_core::codec::{Decoded, Frame};
use ferry_core::{Error, RegionAd, RegionKey, RemoteRegions, Result};

use crate::ids::{OpId, StreamIndex};
use crate::keepalive::Keepalive;
use crate::limits::LinkLimits;

/// What an operation expects as its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// An acknowledgement (writes, commits, notifications).
    Ack,
    /// A read's data, or an acknowledgement carrying its error.
    Read,
    /// A data-path setup reply (control stream only).
    Setup,
    /// The checksums of a transfer with integrity.
    Sum,
}

/// A change to the peer's region table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionUpdate {
    /// A region was registered.
    Added(RegionAd),
    /// A region was deregistered.
    Removed(RegionKey),
    /// The whole table, replacing the old one.
    Replaced(Vec<RegionAd>),
}

impl RegionUpdate {
    /// The update a region frame carries; `None` for other frames.
    pub fn from_frame(frame: Frame) -> Option<Self> {
        match frame {
            Frame::RegionAdded(ad) => Some(RegionUpdate::Added(ad)),
            Frame::RegionRemoved { key } => Some(RegionUpdate::Removed(key)),
            Frame::RegionTable { regions } => Some(RegionUpdate::Replaced(regions)),
            _ => None,
        }
    }

    /// Applies the update to a copy of the peer's table; `ResourceExhausted` when the peer advertises
    /// more regions than a table holds.
    pub fn apply(self, table: &mut RemoteRegions) -> Result<()> {
        match self {
            RegionUpdate::Added(ad) => table.insert(ad)?,
            RegionUpdate::Removed(key) => table.remove(key),
            RegionUpdate::Replaced(regions) => *table = RemoteRegions::new(regions)?,
        }
        Ok(())
    }
}

/// What a frame from the target means to the transport.
#[derive(Debug)]
pub enum Event<P> {
    /// An operation is answered: complete it with `result`.
    Answered {
        /// The operation's state.
        op: P,
        /// Its outcome.
        result: Result<()>,
    },
    /// A read's data follows on the stream: `payload_len` bytes, the last of them its `ReadStatus`.
    Data {
        /// The read's state.
        op: P,
        /// Bytes that follow.
        payload_len: u64,
    },
    /// A data-path setup is answered.
    SetupAnswered {
        /// The setup's state.
        op: P,
        /// The target's setup data, or its refusal.
        result: Result<Vec<u8>>,
    },
    /// A checksum request is answered.
    SumsAnswered {
        /// The request's state.
        op: P,
        /// One CRC32C per range, or the target's refusal.
        result: Result<Vec<u32>>,
    },
    /// The answer of an operation taken back locally: discard `payload_len` bytes that follow.
    Stale {
        /// Bytes that follow.
        payload_len: u64,
    },
    /// The peer's region table changed by this update, already applied to
    /// [`Initiator::regions`]. An adapter that serves the table to other threads without the
    /// initiator's lock applies it to its own copy, in the order the events come.
    RegionsChanged(RegionUpdate),
    /// Nothing to do (a pong).
    Nothing,
}

struct Waiting<P> {
    op: P,
    kind: OpKind,
    bytes: u64,
}

struct StreamOps<P> {
    waiting: HashMap<OpId, Waiting<P>>,
    bytes: u64,
}

/// The initiator's state of one link.
pub struct Initiator<P> {
    peer: String,
    limits: LinkLimits,
    streams: Vec<StreamOps<P>>,
    next_id: u64,
    closed: Option<Error>,
    regions: RemoteRegions,
    keepalive: Keepalive,
    /// Whether operations that name no stream stay off the control stream.
    control_reserved: bool,
}

impl<P> Initiator<P> {
    /// A link to `peer` of `streams` streams (at least 1), whose handshake brought `regions`;
    /// `ResourceExhausted` when those are more than a table holds.
    pub fn new(
        peer: String,
        streams: usize,
        regions: Vec<RegionAd>,
        limits: LinkLimits,
        keepalive: Keepalive,
    ) -> Result<Self> {
        Ok(Initiator {
            peer,
            limits,
            streams: (0..streams.max(1))
                .map(|_| StreamOps {
                    waiting: HashMap::new(),
                    bytes: 0,
                })
                .collect(),
            next_id: 1,
            closed: None,
            regions: RemoteRegions::new(regions)?,
            keepalive,
            control_reserved: false,
        })
    }

    /// Keeps data off the control stream when the link has other streams: an operation that names no
    /// stream takes one of those. For links whose control stream is encrypted and the others are not,
    /// so that bulk data does not pay for encryption.
    pub fn reserve_control(&mut self) {
        self.control_reserved = self.streams.len() > 1;
    }

    /// The peer, for messages.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Number of streams.
    pub fn stream_count(&self) -> usize {
        self.streams.len()
    }

    /// The peer's region table as last heard.
    pub fn regions(&self) -> &RemoteRegions {
        &self.regions
    }

    fn regions_change(&mut self, update: RegionUpdate) -> Result<Event<P>> {
        update.clone().apply(&mut self.regions)?;
        Ok(Event::RegionsChanged(update))
    }

    /// The error the link was closed with, if it was.
    pub fn closed(&self) -> Option<&Error> {
        self.closed.as_ref()
    }

    /// The error for an operation on this closed link.
    pub fn closed_error(&self) -> Error {
        self.closed
            .clone()
            .unwrap_or_else(|| Error::PeerClosed(format!("the link to {} is closed", self.peer)))
    }

    /// The stream with the fewest bytes outstanding (not the control stream, when it is reserved).
    pub fn least_loaded(&self) -> StreamIndex {
        let first = usize::from(self.control_reserved);
        let i = (first..self.streams.len())
            .min_by_key(|&i| self.streams[i].bytes)
            .unwrap_or(first);
        StreamIndex(i as u16)
    }

    /// Operations waiting for an answer on the whole link.
    pub fn waiting(&self) -> usize {
        self.streams.iter().map(|s| s.waiting.len()).sum()
    }

    /// Operations waiting for an answer on `stream`.
    pub fn outstanding(&self, stream: StreamIndex) -> usize {
        self.streams.get(stream.get()).map_or(0, |s| s.waiting.len())
    }

    /// Starts an operation of `bytes` on `stream` (or the least loaded one): it waits for its answer
    /// from now on, until answered or taken back ([`Initiator::take`]). Fails once the link is
    /// closed, or when the stream has [`LinkLimits::max_outstanding_per_stream`] operations waiting.
    pub fn start(
        &mut self,
        stream: Option<StreamIndex>,
        kind: OpKind,
        bytes: u64,
        op: P,
    ) -> Result<(StreamIndex, OpId)> {
        if self.closed.is_some() {
            return Err(self.closed_error());
        }
        let stream = stream.unwrap_or_else(|| self.least_loaded());
        if kind == OpKind::Setup && !stream.is_control() {
            return Err(Error::InvalidArgument(
                "data-path setup goes on the control stream".into(),
            ));
        }
        let max = self.limits.max_outstanding_per_stream;
        let Some(s) = self.streams.get_mut(stream.get()) else {
            return Err(Error::InvalidArgument(format!("{stream} does not exist on this link")));
        };
        if s.waiting.len() >= max {
            return Err(Error::ResourceExhausted(format!(
                "{max} operations already wait for answers on {stream} of the link to {}; wait for some to finish",
                self.peer
            )));
        }
        let id = OpId(self.next_id);
        self.next_id += 1;
        s.bytes += bytes;
        s.waiting.insert(id, Waiting { op, kind, bytes });
        Ok((stream, id))
    }

    /// Takes an operation back before its answer (it failed locally, or the transfer it served gave
    /// up); its answer will be stale. `None` when it no longer waits (answered, or taken already).
    pub fn take(&mut self, stream: StreamIndex, id: OpId) -> Option<P> {
        let s = self.streams.get_mut(stream.get())?;
        let w = s.waiting.remove(&id)?;
        s.bytes -= w.bytes;
        Some(w.op)
    }

    /// Handles a frame the target sent on `stream` at `now`. An error breaks the link: close it with
    /// the error.
    pub fn handle(&mut self, stream: StreamIndex, decoded: Decoded, now: Instant) -> Result<Event<P>> {
        self.keepalive.heard(now);
        let payload_len = decoded.payload_len;
        match decoded.frame {
            Frame::Ack { id, error } => {
                let result = error.map_or(Ok(()), |e| Err(e.into_error()));
                Ok(
                    match self.answer(stream, OpId(id), &[OpKind::Ack, OpKind::Read], result.is_ok())? {
                        Some(op) => Event::Answered { op, result },
                        None => Event::Stale { payload_len },
                    },
                )
            }
            Frame::ReadData { id } => Ok(match self.answer(stream, OpId(id), &[OpKind::Read], true)? {
                Some(op) => Event::Data { op, payload_len },
                None => Event::Stale { payload_len },
            }),
            Frame::TransportSetupReply { id, error, blob } if stream.is_control() => {
                let result = error.map_or(Ok(blob), |e| Err(e.into_error()));
                Ok(match self.answer(stream, OpId(id), &[OpKind::Setup], true)? {
                    Some(op) => Event::SetupAnswered { op, result },
                    None => Event::Stale { payload_len },
                })
            }
            Frame::Sums { id, error, sums } => {
                let result = error.map_or(Ok(sums), |e| Err(e.into_error()));
                Ok(match self.answer(stream, OpId(id), &[OpKind::Sum], true)? {
                    Some(op) => Event::SumsAnswered { op, result },
                    None => Event::Stale { payload_len },
                })
            }
            Frame::RegionAdded(ad) if stream.is_control() => self.regions_change(RegionUpdate::Added(ad)),
            Frame::RegionRemoved { key } if stream.is_control() => self.regions_change(RegionUpdate::Removed(key)),
            Frame::RegionTable { regions } if stream.is_control() => {
                self.regions_change(RegionUpdate::Replaced(regions))
            }
            Frame::Pong { .. } => Ok(Event::Nothing),
            Frame::Goodbye => Err(Error::PeerClosed(format!("{} closed the link", self.peer))),
            other => Err(Error::Protocol(format!(
                "{} sent an unexpected {other:?} on {stream}",
                self.peer
            ))),
        }
    }

    /// Removes the operation `id` answered on `stream`, checking the answer fits it. `success` says
    /// whether an acknowledgement reports success (a read may only be acknowledged with an error).
    fn answer(&mut self, stream: StreamIndex, id: OpId, kinds: &[OpKind], success: bool) -> Result<Option<P>> {
        crate::ops::check_issued(id, self.next_id, &self.peer)?;
        let Some(s) = self.streams.get_mut(stream.get()) else {
            return Err(Error::Protocol(format!("{} answered on unknown {stream}", self.peer)));
        };
        let Some(w) = s.waiting.get(&id) else {
            return Ok(None);
        };
        let fits = kinds.contains(&w.kind) && !(w.kind == OpKind::Read && kinds.contains(&OpKind::Ack) && success);
        if !fits {
            return Err(Error::Protocol(format!(
                "{} answered {id} (a {:?} operation) with the wrong kind of frame",
                self.peer, w.kind
            )));
        }
        let w = s
            .waiting
            .remove(&id)
            .ok_or_else(|| Error::Internal("answered operation vanished".into()))?;
        s.bytes -= w.bytes;
        Ok(Some(w.op))
    }

    /// Closes the link with `error` (the first error wins): returns every waiting operation, to be
    /// failed with [`Initiator::closed_error`]; new operations are refused from now on.
    pub fn close(&mut self, error: Error) -> Vec<P> {
        if self.closed.is_none() {
            self.closed = Some(error);
        }
        let mut ops = Vec::new();
        for s in &mut self.streams {
            s.bytes = 0;
            ops.extend(s.waiting.drain().map(|(_, w)| w.op));
        }
        ops
    }

    /// When [`Initiator::handle_timeout`] is next due: the keepalive's next step. It only ever moves
    /// later, as frames are heard; `None` once the link is closed.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.closed.is_none().then(|| self.keepalive.poll_timeout())
    }

    /// Time has come to `now`. An error means the peer is silent past the keepalive's bound: close
    /// the link with it.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<()> {
        if self.closed.is_some() {
            return Ok(());
        }
        self.keepalive.handle_timeout(now, &self.peer)
    }

    /// A frame the protocol itself wants sent (a keepalive probe), with its stream.
    pub fn poll_transmit(&mut self) -> Option<(StreamIndex, Frame)> {
        if self.closed.is_some() {
            return None;
        }
        self.keepalive.poll_transmit().map(|f| (StreamIndex::CONTROL, f))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use ferry_core::WireError;
    use proptest::prelude::*;

    use super::*;

    fn link(streams: usize, max: usize) -> Initiator<&'static str> {
        let limits = LinkLimits {
            max_outstanding_per_stream: max,
            ..LinkLimits::default()
        };
        let now = Instant::now();
        Initiator::new(
            "peer".into(),
            streams,
            Vec::new(),
            limits,
            Keepalive::new(now, Duration::from_secs(5), Duration::from_secs(60)),
        )
        .unwrap()
    }

    fn d(frame: Frame, payload_len: u64) -> Decoded {
        Decoded { frame, payload_len }
    }

    /// An acknowledgement of `id`, with `error` if any.
    fn ack(id: u64, error: Option<Error>) -> Decoded {
        let error = error.as_ref().map(WireError::from);
        d(Frame::Ack { id, error }, 0)
    }

    #[test]
    fn answers_must_fit_their_operation() {
        let mut l = link(2, 8);
        let now = Instant::now();
        let (s, read) = l.start(Some(StreamIndex(1)), OpKind::Read, 10, "read").unwrap();
        let (_, write) = l.start(Some(StreamIndex(1)), OpKind::Ack, 10, "write").unwrap();
        // Read data for a write, a success ack for a read, an id never sent.
        let wrong = [d(Frame::ReadData { id: write.0 }, 11), ack(read.0, None), ack(99, None)];
        for frame in wrong {
            assert!(matches!(l.handle(s, frame, now), Err(Error::Protocol(_))));
        }
        // On the wrong stream, an answer finds no operation: stale.
        assert!(matches!(
            l.handle(StreamIndex(0), ack(write.0, None), now),
            Ok(Event::Stale { .. })
        ));
        let refused = ack(read.0, Some(Error::OutOfBounds("x".into())));
        assert!(matches!(
            l.handle(s, refused, now),
            Ok(Event::Answered {
                op: "read",
                result: Err(Error::OutOfBounds(_))
            })
        ));
        assert!(matches!(
            l.handle(s, ack(write.0, None), now),
            Ok(Event::Answered {
                op: "write",
                result: Ok(())
            })
        ));
        // Answered once: the second answer is stale.
        assert!(matches!(l.handle(s, ack(write.0, None), now), Ok(Event::Stale { .. })));
    }

    #[test]
    fn region_frames_only_on_the_control_stream() {
        let mut l = link(2, 8);
        let now = Instant::now();
        let key = RegionKey(3);
        assert!(matches!(
            l.handle(StreamIndex(1), d(Frame::RegionRemoved { key }, 0), now),
            Err(Error::Protocol(_))
        ));
        assert!(matches!(
            l.handle(StreamIndex(0), d(Frame::RegionTable { regions: Vec::new() }, 0), now),
            Ok(Event::RegionsChanged(RegionUpdate::Replaced(v))) if v.is_empty()
        ));
    }

    #[test]
    fn outstanding_operations_are_bounded_per_stream() {
        let mut l = link(1, 2);
        l.start(None, OpKind::Ack, 1, "a").unwrap();
        l.start(None, OpKind::Ack, 1, "b").unwrap();
        assert!(matches!(
            l.start(None, OpKind::Ack, 1, "c"),
            Err(Error::ResourceExhausted(_))
        ));
        assert!(matches!(
            l.start(Some(StreamIndex(1)), OpKind::Ack, 1, "d"),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn close_returns_every_waiting_operation_and_refuses_new_ones() {
        let mut l = link(3, 8);
        for name in ["a", "b", "c", "d"] {
            l.start(None, OpKind::Ack, 100, name).unwrap();
        }
        let mut failed = l.close(Error::PeerClosed("gone".into()));
        failed.sort_unstable();
        assert_eq!(failed, ["a", "b", "c", "d"]);
        assert!(matches!(l.start(None, OpKind::Ack, 1, "e"), Err(Error::PeerClosed(m)) if m == "gone"));
        assert!(l.close(Error::Timeout("later".into())).is_empty());
        assert!(matches!(l.closed(), Some(Error::PeerClosed(_))));
    }

    #[test]
    fn least_loaded_counts_bytes() {
        let mut l = link(3, 8);
        let (a, _) = l.start(None, OpKind::Ack, 100, "a").unwrap();
        let (b, _) = l.start(None, OpKind::Ack, 10, "b").unwrap();
        let (c, _) = l.start(None, OpKind::Ack, 50, "c").unwrap();
        assert_eq!((a, b, c), (StreamIndex(0), StreamIndex(1), StreamIndex(2)));
        assert_eq!(l.least_loaded(), StreamIndex(1));
    }

    #[test]
    fn a_peer_that_advertises_without_end_breaks_the_link() {
        let mut l = link(1, 8);
        let now = Instant::now();
        let ad = |i: u64| ferry_core::RegionAd {
            key: ferry_core::RegionKey(i),
            addr: i << 20,
            len: 1 << 20,
            access: ferry_core::Access::READ_WRITE,
            persistent: false,
            staged: false,
            transport_keys: Vec::new(),
        };
        let max = ferry_core::region::MAX_REMOTE_REGIONS as u64;
        for i in 0..max {
            l.handle(StreamIndex::CONTROL, d(Frame::RegionAdded(ad(i)), 0), now)
                .unwrap();
        }
        // Re-advertising a known key or address replaces it and stays within the bound.
        l.handle(StreamIndex::CONTROL, d(Frame::RegionAdded(ad(7)), 0), now)
            .unwrap();
        assert_eq!(l.regions().len(), max as usize);
        let err = l
            .handle(StreamIndex::CONTROL, d(Frame::RegionAdded(ad(max)), 0), now)
            .unwrap_err();
        assert!(matches!(err, Error::ResourceExhausted(_)), "{err:?}");
    }

    #[test]
    fn a_reserved_control_stream_carries_only_what_names_it() {
        let mut l = link(3, 8);
        l.reserve_control();
        let picked: Vec<_> = (0..6)
            .map(|_| l.start(None, OpKind::Ack, 10, "op").unwrap().0)
            .collect();
        assert!(picked.iter().all(|s| !s.is_control()), "{picked:?}");
        let (s, _) = l.start(Some(StreamIndex::CONTROL), OpKind::Ack, 0, "notify").unwrap();
        assert!(s.is_control());
        // A link of one stream has nothing else to use.
        let mut one = link(1, 8);
        one.reserve_control();
        assert_eq!(one.start(None, OpKind::Ack, 1, "op").unwrap().0, StreamIndex::CONTROL);
    }

    #[test]
    fn operations_taken_back_have_stale_answers_and_time_is_the_keepalives() {
        let t0 = Instant::now();
        let idle = Duration::from_secs(5);
        let keepalive = Keepalive::new(t0, idle, Duration::from_secs(60));
        let mut l = Initiator::new("peer".into(), 2, Vec::new(), LinkLimits::default(), keepalive).unwrap();
        let one = Some(StreamIndex(1));
        let (s, read) = l.start(one, OpKind::Read, 10, "read").unwrap();
        let (_, write) = l.start(one, OpKind::Ack, 10, "write").unwrap();
        l.start(one, OpKind::Ack, 10, "kept").unwrap();
        // No operation moves the link's timer: it is the keepalive's alone.
        assert_eq!(l.poll_timeout(), Some(t0 + idle));
        assert_eq!(l.take(s, read), Some("read"));
        assert_eq!(l.take(s, read), None, "taken once");
        assert_eq!(l.take(s, write), Some("write"));
        // The taken read's data, should it still come, is discarded; so is the write's answer.
        assert!(matches!(
            l.handle(s, d(Frame::ReadData { id: read.0 }, 11), t0),
            Ok(Event::Stale { payload_len: 11 })
        ));
        assert!(matches!(l.handle(s, ack(write.0, None), t0), Ok(Event::Stale { .. })));
        assert_eq!(l.waiting(), 1);
        assert_eq!(l.close(Error::PeerClosed("gone".into())), vec!["kept"]);
        assert_eq!(l.poll_timeout(), None);
    }

    /// One step of [`the_table_matches_a_model`].
    #[derive(Debug, Clone)]
    enum Step {
        /// Start an operation of this many bytes on the least loaded stream.
        Start(u64),
        /// Answer the waiting operation at this place (modulo how many wait).
        Answer(usize),
        /// Take back the waiting operation at this place.
        Take(usize),
        /// Answer again an operation no longer waiting (answered or taken), at this place.
        Late(usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u64..1000).prop_map(Step::Start),
            any::<usize>().prop_map(Step::Answer),
            any::<usize>().prop_map(Step::Take),
            any::<usize>().prop_map(Step::Late),
        ]
    }

    proptest! {
        /// Whatever the order of starts, answers, take-backs and late answers: an operation is
        /// handed back once (answered or taken), a late answer is stale and never breaks the link,
        /// the table holds exactly what waits, and the least loaded stream is the one with the fewest
        /// bytes waiting.
        #[test]
        fn the_table_matches_a_model(steps in proptest::collection::vec(step(), 0..200)) {
            let limits = LinkLimits { max_outstanding_per_stream: 1000, ..LinkLimits::default() };
            let t0 = Instant::now();
            let keepalive = Keepalive::new(t0, Duration::from_secs(3600), Duration::from_secs(7200));
            let mut l: Initiator<u32> = Initiator::new("peer".into(), 3, Vec::new(), limits, keepalive).unwrap();
            let mut model: BTreeMap<u32, (StreamIndex, OpId, u64)> = BTreeMap::new();
            let mut gone: Vec<(StreamIndex, OpId)> = Vec::new();
            let mut n = 0u32;
            for step in steps {
                match step {
                    Step::Start(bytes) => {
                        let (s, id) = l.start(None, OpKind::Ack, bytes, n).unwrap();
                        model.insert(n, (s, id, bytes));
                        n += 1;
                    }
                    Step::Answer(i) | Step::Take(i) if model.is_empty() => { let _ = i; }
                    Step::Answer(i) => {
                        let (&name, &(s, id, _)) = model.iter().nth(i % model.len()).unwrap();
                        let answered = match l.handle(s, ack(id.0, None), t0).unwrap() {
                            Event::Answered { op, .. } => Some(op),
                            _ => None,
                        };
                        prop_assert_eq!(answered, Some(name));
                        model.remove(&name);
                        gone.push((s, id));
                    }
                    Step::Take(i) => {
                        let (&name, &(s, id, _)) = model.iter().nth(i % model.len()).unwrap();
                        prop_assert_eq!(l.take(s, id), Some(name));
                        model.remove(&name);
                        gone.push((s, id));
                    }
                    Step::Late(i) if gone.is_empty() => { let _ = i; }
                    Step::Late(i) => {
                        let (s, id) = gone[i % gone.len()];
                        let late = l.handle(s, ack(id.0, None), t0);
                        let stale = matches!(late, Ok(Event::Stale { .. }));
                        prop_assert!(stale, "a late answer was not stale");
                        prop_assert_eq!(l.take(s, id), None);
                    }
                }
                prop_assert_eq!(l.waiting(), model.len());
                let mut bytes = [0u64; 3];
                for (s, _, b) in model.values() {
                    bytes[s.get()] += b;
                }
                let fewest = bytes.iter().min().copied().unwrap_or(0);
                prop_assert_eq!(bytes[l.least_loaded().get()], fewest);
            }
        }
    }
}
