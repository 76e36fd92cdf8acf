//! Both sides of a link in memory: an [`Initiator`] and a target made of [`TargetStream`]s, an
//! [`AdvertQueue`] and a model of region memory, joined by one byte stream per stream and direction
//! that carries the frames as the codec encodes them (and decodes them at the other end), under a
//! virtual clock. Every link opens with the handshake: each stream's hello and its answer go
//! through the codec, and the target's registry admits the control stream and joins the others.
//!
//! Property tests run random sequences of operations (each with a deadline, which the harness holds
//! as the engine's transfer timer does: past it, the operation is taken back), deliveries in random
//! stream order and after random delays, time passing, region changes, local give-ups, hostile
//! answers and broken streams, and check the protocol's promises against a model: every operation
//! ends exactly once; nothing succeeds on a closed link; an operation past its deadline fails and its
//! late answer changes nothing; a commit is served after every write started before it on its
//! stream; without breaks or expiries, every operation succeeds and the initiator's region table
//! ends equal to the target's.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use ferry_core::codec::{self, Decoded, Frame, Limits, ReadStatus, Segment};
use ferry_core::{
    Access, DataProtection, Durability, Error, RegionAd, RegionChange, RegionKey, RemoteRegions, TransportKind,
};
use ferry_proto::handshake::check_ack;
use ferry_proto::initiator::OpKind;
use ferry_proto::target::{Request, ack};
use ferry_proto::{
    Admission, AdvertQueue, Event, Identity, Initiator, Keepalive, LinkLimits, LinkRegistry, LinkToken, OpId,
    StreamIndex, TargetStream,
};
use proptest::prelude::*;

const CELL: u64 = 8;
/// How long each operation may take, in virtual time.
const DEADLINE: Duration = Duration::from_millis(100);

/// What the harness remembers of an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Op {
    n: usize,
    kind: OpKind,
}

/// One stream's bytes in each direction: whole encoded frames, each followed by its payload.
struct Wire {
    to_target: VecDeque<u8>,
    to_initiator: VecDeque<u8>,
}

/// `frame` and its payload as they go on the wire.
fn encoded(frame: &Frame, payload: &[u8]) -> Vec<u8> {
    let mut out = BytesMut::new();
    codec::encode(frame, payload.len() as u64, &mut out).expect("the harness sends only valid frames");
    out.extend_from_slice(payload);
    out.to_vec()
}

/// The next frame on `wire` and its payload, decoded as a reader would (frames are only ever put
/// on a wire whole).
fn next_frame(wire: &mut VecDeque<u8>) -> Option<(Decoded, Vec<u8>)> {
    if wire.is_empty() {
        return None;
    }
    let bytes = wire.make_contiguous();
    let (decoded, used) = codec::decode(bytes, &Limits::default())
        .expect("a frame the codec encoded decodes")
        .expect("frames are on the wire whole");
    let end = used + decoded.payload_len as usize;
    let payload = bytes[used..end].to_vec();
    wire.drain(..end);
    Some((decoded, payload))
}

struct Pair {
    initiator: Initiator<Op>,
    targets: Vec<TargetStream>,
    wires: Vec<Wire>,
    memory: Vec<u8>,
    table: BTreeMap<u64, RegionAd>,
    adverts: AdvertQueue,
    /// The initiator's table as an adapter mirrors it from the `RegionsChanged` updates alone.
    mirror: RemoteRegions,
    /// Per operation: how it ended (`Some(true)` success), at most once.
    ended: HashMap<usize, bool>,
    started: usize,
    /// Operation ids in the order the target served them, per stream.
    served: Vec<Vec<OpId>>,
    ids: HashMap<usize, (StreamIndex, OpId)>,
    /// Operations that may fail on an open link: given up locally, or reading a region that is not there.
    may_fail: HashSet<usize>,
    broken: bool,
    /// The virtual clock.
    now: Instant,
    /// When each operation's caller gives up on it: the protocol keeps no deadlines, its caller does.
    deadlines: BTreeMap<usize, Instant>,
}

fn ad(key: u64) -> RegionAd {
    RegionAd {
        key: RegionKey(key),
        addr: key << 20,
        len: 64 * CELL,
        access: Access::READ_WRITE,
        persistent: false,
        staged: false,
        transport_keys: Vec::new(),
    }
}

const INITIATOR: u64 = 0x1a;
const TARGET: u64 = 0x7a;

fn identity(engine_id: u64) -> Identity {
    Identity {
        engine_id,
        host_id: engine_id,
        transports: vec![TransportKind::Tcp],
    }
}

/// Opens a link of `streams` streams as the two ends do, every hello and answer through the codec:
/// the control stream opens it in the target's registry and brings back the region table, each
/// further stream joins it. The table the initiator starts from.
fn handshake(streams: usize, registry: &mut LinkRegistry<u64>, table: Vec<RegionAd>) -> Result<Vec<RegionAd>, Error> {
    let token = LinkToken(0x5eed);
    let mut regions = None;
    for i in 0..streams {
        let index = StreamIndex(i as u16);
        let hello = identity(INITIATOR).hello(token, index, streams as u16, None, DataProtection::Plain);
        let mut wire: VecDeque<u8> = encoded(&Frame::Hello(hello), &[]).into();
        let Some((
            Decoded {
                frame: Frame::Hello(hello),
                ..
            },
            _,
        )) = next_frame(&mut wire)
        else {
            panic!("a hello decodes as a hello");
        };
        let ack = match registry.admit(&hello, None) {
            Ok(Admission::Open) => {
                registry.open(&hello, 1, None)?;
                identity(TARGET).accept(table.clone())
            }
            Ok(Admission::Join(link, sealing)) => {
                assert_eq!(link, 1);
                assert!(sealing.is_none(), "a plain link has no record layer");
                identity(TARGET).accept(Vec::new())
            }
            Err(e) => identity(TARGET).refuse(&e),
        };
        let mut wire: VecDeque<u8> = encoded(&Frame::HelloAck(ack), &[]).into();
        let Some((
            Decoded {
                frame: Frame::HelloAck(ack),
                ..
            },
            _,
        )) = next_frame(&mut wire)
        else {
            panic!("an answer decodes as an answer");
        };
        let ack = check_ack(ack, index, "target")?;
        assert_eq!(ack.engine_id, TARGET);
        if index.is_control() {
            regions = Some(ack.regions);
        }
    }
    Ok(regions.unwrap_or_default())
}

impl Pair {
    fn new(streams: usize, advert_queue: usize) -> Pair {
        let limits = LinkLimits {
            advert_queue,
            ..LinkLimits::default()
        };
        let now = Instant::now();
        let keepalive = Keepalive::new(now, Duration::from_secs(5), Duration::from_secs(60));
        let mut registry = LinkRegistry::new(limits);
        let regions = handshake(streams, &mut registry, vec![ad(0)]).expect("the link opens");
        assert_eq!(registry.streams(LinkToken(0x5eed)), streams, "every stream joined");
        Pair {
            initiator: Initiator::new("target".into(), streams, regions, limits, keepalive).unwrap(),
            targets: (0..streams)
                .map(|i| TargetStream::new(StreamIndex(i as u16), "initiator".into()))
                .collect(),
            wires: (0..streams)
                .map(|_| Wire {
                    to_target: VecDeque::new(),
                    to_initiator: VecDeque::new(),
                })
                .collect(),
            memory: vec![0; 64 * CELL as usize],
            table: BTreeMap::from([(0, ad(0))]),
            adverts: AdvertQueue::new(advert_queue),
            mirror: RemoteRegions::new([ad(0)]).unwrap(),
            ended: HashMap::new(),
            started: 0,
            served: vec![Vec::new(); streams],
            ids: HashMap::new(),
            may_fail: HashSet::new(),
            broken: false,
            now,
            deadlines: BTreeMap::new(),
        }
    }

    fn end(&mut self, n: usize, ok: bool) {
        assert!(self.ended.insert(n, ok).is_none(), "operation {n} ended twice");
        assert!(!(ok && self.broken), "operation {n} succeeded on a closed link");
    }

    fn send(&mut self, stream: StreamIndex, frame: Frame, payload: Vec<u8>) {
        self.wires[stream.get()].to_target.extend(encoded(&frame, &payload));
    }

    /// Starts a write of one cell, or a commit on `stream` after it.
    fn write(&mut self, cell: u64, byte: u8, stream: Option<StreamIndex>, commit: bool) {
        let n = self.started;
        self.started += 1;
        let kind = OpKind::Ack;
        let bytes = if commit { 0 } else { CELL };
        self.deadlines.insert(n, self.now + DEADLINE);
        let Ok((s, id)) = self.initiator.start(stream, kind, bytes, Op { n, kind }) else {
            assert!(self.broken, "a start refused on an open link");
            self.end(n, false);
            return;
        };
        if let Some(asked) = stream {
            assert_eq!(s, asked, "an operation went to another stream than asked");
        }
        self.ids.insert(n, (s, id));
        let seg = Segment {
            key: RegionKey(0),
            offset: cell * CELL,
            len: CELL,
        };
        match commit {
            false => self.send(
                s,
                Frame::WriteBatch {
                    id: id.0,
                    durability: Durability::Completed,
                    segments: vec![seg],
                },
                vec![byte; CELL as usize],
            ),
            true => self.send(
                s,
                Frame::Commit {
                    id: id.0,
                    durability: Durability::Persistent,
                    segments: vec![seg],
                },
                Vec::new(),
            ),
        }
    }

    fn read(&mut self, cell: u64) {
        let n = self.started;
        self.started += 1;
        let kind = OpKind::Read;
        self.deadlines.insert(n, self.now + DEADLINE);
        let Ok((s, id)) = self.initiator.start(None, kind, CELL, Op { n, kind }) else {
            assert!(self.broken);
            self.end(n, false);
            return;
        };
        self.ids.insert(n, (s, id));
        if cell % 7 == 6 {
            self.may_fail.insert(n);
        }
        let frame = Frame::Read {
            id: id.0,
            key: RegionKey(if cell % 7 == 6 { 99 } else { 0 }),
            offset: cell * CELL,
            len: CELL,
        };
        self.send(s, frame, Vec::new());
    }

    /// The target serves the next frame on `stream`.
    fn serve(&mut self, stream: usize) {
        let Some((decoded, payload)) = next_frame(&mut self.wires[stream].to_target) else {
            return;
        };
        let request = self.targets[stream]
            .request(decoded)
            .expect("an initiator sends only requests");
        let answer = match request {
            Request::WriteBatch { id, segments, .. } => {
                for s in &segments {
                    let at = s.offset as usize;
                    self.memory[at..at + s.len as usize].copy_from_slice(&payload);
                }
                self.served[stream].push(id);
                (ack(id, &Ok(())), Vec::new())
            }
            Request::Commit { id, .. } => {
                self.served[stream].push(id);
                (ack(id, &Ok(())), Vec::new())
            }
            Request::Read { id, segments } => {
                self.served[stream].push(id);
                let s = segments[0];
                if !self.table.contains_key(&s.key.0) {
                    (ack(id, &Err(Error::OutOfBounds("no such region".into()))), Vec::new())
                } else {
                    let at = s.offset as usize;
                    let mut data = self.memory[at..at + s.len as usize].to_vec();
                    data.push(ReadStatus::Intact as u8);
                    (Frame::ReadData { id: id.0 }, data)
                }
            }
            other => panic!("unexpected request {other:?}"),
        };
        let (frame, payload) = answer;
        self.wires[stream].to_initiator.extend(encoded(&frame, &payload));
    }

    /// The initiator handles the next frame on `stream`.
    fn receive(&mut self, stream: usize) {
        let Some((decoded, payload)) = next_frame(&mut self.wires[stream].to_initiator) else {
            return;
        };
        match self.initiator.handle(StreamIndex(stream as u16), decoded, self.now) {
            Ok(Event::Answered { op, result }) => self.end(op.n, result.is_ok()),
            Ok(Event::Data { op, payload_len }) => {
                assert_eq!(op.kind, OpKind::Read);
                assert_eq!(payload_len, CELL + ReadStatus::LEN);
                assert_eq!(payload.len() as u64, payload_len);
                self.end(op.n, true);
            }
            Ok(Event::RegionsChanged(update)) => update.apply(&mut self.mirror).unwrap(),
            Ok(Event::Stale { .. } | Event::Nothing) => {}
            Ok(Event::SetupAnswered { .. } | Event::SumsAnswered { .. }) => {
                panic!("no setups or checksum requests in this harness")
            }
            Err(e) => self.close(e),
        }
    }

    fn close(&mut self, e: Error) {
        self.broken = true;
        for op in self.initiator.close(e) {
            self.end(op.n, false);
        }
        for w in &mut self.wires {
            w.to_target.clear();
            w.to_initiator.clear();
        }
    }

    fn change_region(&mut self, key: u64, add: bool) {
        let change = match add {
            true => {
                self.table.insert(key, ad(key));
                RegionChange::Added(ad(key))
            }
            false => {
                self.table.remove(&key);
                RegionChange::Removed(RegionKey(key))
            }
        };
        self.adverts.push(&change);
    }

    fn transmit_adverts(&mut self) {
        let table = &self.table;
        if let Some(frame) = self.adverts.poll_transmit(|| table.values().cloned().collect())
            && !self.broken
        {
            self.wires[0].to_initiator.extend(encoded(&frame, &[]));
        }
    }

    fn give_up(&mut self, n: usize) {
        if self.ended.contains_key(&n) {
            return;
        }
        if let Some(&(s, id)) = self.ids.get(&n)
            && self.initiator.take(s, id).is_some()
        {
            self.may_fail.insert(n);
            self.end(n, false);
        }
    }

    /// Virtual time passes: operations past their deadline are given up by their callers, which
    /// take them back (their answers, should they still come, are stale).
    fn tick(&mut self, by: Duration) {
        self.now += by;
        let due: Vec<usize> = self
            .deadlines
            .iter()
            .filter(|&(_, &at)| at <= self.now)
            .map(|(&n, _)| n)
            .collect();
        for n in due {
            self.deadlines.remove(&n);
            self.give_up(n);
        }
    }

    fn settle(&mut self) {
        loop {
            let busy = self
                .wires
                .iter()
                .any(|w| !w.to_target.is_empty() || !w.to_initiator.is_empty());
            if !busy && self.adverts.is_empty() {
                break;
            }
            self.transmit_adverts();
            for s in 0..self.wires.len() {
                self.serve(s);
                self.receive(s);
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Step {
    Write { cell: u64, byte: u8, stream: Option<u16> },
    CommitAfter { cell: u64, stream: u16 },
    Read { cell: u64 },
    Serve(usize),
    Receive(usize),
    Region { key: u64, add: bool },
    Adverts,
    GiveUp(usize),
    Tick(u64),
    Hostile { stream: usize, id: u64, data: bool },
    Break,
}

fn step(streams: usize) -> impl Strategy<Value = Step> {
    let s = streams as u16;
    prop_oneof![
        4 => (0..64u64, any::<u8>(), proptest::option::of(0..s)).prop_map(|(cell, byte, stream)| Step::Write { cell, byte, stream }),
        1 => (0..64u64, 0..s).prop_map(|(cell, stream)| Step::CommitAfter { cell, stream }),
        2 => (0..64u64).prop_map(|cell| Step::Read { cell }),
        5 => (0..streams).prop_map(Step::Serve),
        5 => (0..streams).prop_map(Step::Receive),
        2 => (1..10u64, any::<bool>()).prop_map(|(key, add)| Step::Region { key, add }),
        1 => Just(Step::Adverts),
        1 => (0..40usize).prop_map(Step::GiveUp),
        1 => (0..60u64).prop_map(Step::Tick),
    ]
}

fn run(streams: usize, advert_queue: usize, steps: &[Step], hostile: &[Step]) -> Pair {
    let mut p = Pair::new(streams, advert_queue);
    for st in steps.iter().chain(hostile) {
        match *st {
            Step::Write { cell, byte, stream } => p.write(cell, byte, stream.map(StreamIndex), false),
            Step::CommitAfter { cell, stream } => {
                p.write(cell, 1, Some(StreamIndex(stream)), false);
                p.write(cell, 0, Some(StreamIndex(stream)), true);
            }
            Step::Read { cell } => p.read(cell),
            Step::Serve(s) => p.serve(s),
            Step::Receive(s) => p.receive(s),
            Step::Region { key, add } => p.change_region(key, add),
            Step::Adverts => p.transmit_adverts(),
            Step::GiveUp(n) => p.give_up(n),
            Step::Tick(ms) => p.tick(Duration::from_millis(ms)),
            Step::Hostile { stream, id, data } => {
                let frame = match data {
                    true => Frame::ReadData { id },
                    false => Frame::Ack { id, error: None },
                };
                let payload_len = if data { CELL + 1 } else { 0 };
                // Ahead of everything queued: at a frame boundary, as frames go on whole.
                let bytes = encoded(&frame, &vec![0; payload_len as usize]);
                let wire = &mut p.wires[stream].to_initiator;
                for b in bytes.into_iter().rev() {
                    wire.push_front(b);
                }
                p.receive(stream);
            }
            Step::Break => p.close(Error::PeerClosed("a stream broke".into())),
        }
    }
    p.settle();
    p
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Without breaks: every operation ends once and succeeds unless given up or refused by the
    /// target; commits are served after the writes before them on their stream; the region tables agree.
    #[test]
    fn every_operation_ends_once_and_tables_agree(
        advert_queue in 1usize..4,
        (streams, steps) in (1usize..4).prop_flat_map(|s| (Just(s), proptest::collection::vec(step(s), 0..80))),
    ) {
        let p = run(streams, advert_queue, &steps, &[]);
        prop_assert_eq!(p.ended.len(), p.started, "an operation never ended");
        for (n, ok) in &p.ended {
            prop_assert!(*ok || p.may_fail.contains(n), "operation {} failed on an open link", n);
        }
        for s in 0..streams {
            prop_assert_eq!(p.initiator.outstanding(StreamIndex(s as u16)), 0);
        }
        let mut got: Vec<u64> = p.initiator.regions().iter().map(|a| a.key.0).collect();
        got.sort_unstable();
        prop_assert_eq!(&got, &p.table.keys().copied().collect::<Vec<_>>());
        let mut mirrored: Vec<u64> = p.mirror.iter().map(|a| a.key.0).collect();
        mirrored.sort_unstable();
        prop_assert_eq!(mirrored, got, "the updates the events carry rebuild the same table");
        check_commit_order(&p);
    }

    /// A hostile or broken peer: the link closes, every waiting operation fails exactly once, and
    /// nothing succeeds afterwards.
    #[test]
    fn a_broken_link_fails_everything_once(
        steps in proptest::collection::vec(step(2), 0..60),
        bad in (0usize..2, 0u64..200, any::<bool>()),
        after in proptest::collection::vec(step(2), 0..20),
        hostile in any::<bool>(),
    ) {
        let (stream, id, data) = bad;
        let trouble = match hostile {
            true => Step::Hostile { stream, id, data },
            false => Step::Break,
        };
        let mut tail = vec![trouble];
        tail.extend(after);
        let p = run(2, 4, &steps, &tail);
        prop_assert_eq!(p.ended.len(), p.started);
        if p.broken {
            prop_assert!(p.initiator.closed().is_some());
        }
    }
}

/// Each stream's target served its operations in the order they were started on it, so a commit
/// ran after every write started before it on its stream.
fn check_commit_order(p: &Pair) {
    for served in &p.served {
        assert!(
            served.windows(2).all(|w| w[0] < w[1]),
            "a stream served out of order: {served:?}"
        );
    }
}

#[test]
fn a_hostile_answer_for_an_unsent_id_breaks_the_link() {
    let p = run(
        1,
        4,
        &[Step::Write {
            cell: 1,
            byte: 7,
            stream: None,
        }],
        &[Step::Hostile {
            stream: 0,
            id: 1000,
            data: false,
        }],
    );
    assert!(p.broken);
    assert!(matches!(p.initiator.closed(), Some(Error::Protocol(_))));
    assert_eq!(p.ended.get(&0), Some(&false));
    assert_eq!(p.memory[8..16], [0; 8], "the write was dropped with the broken link");
}

#[test]
fn writes_land_and_reads_see_them() {
    let p = run(
        2,
        4,
        &[
            Step::Write {
                cell: 3,
                byte: 9,
                stream: Some(1),
            },
            Step::Serve(1),
            Step::Read { cell: 3 },
        ],
        &[],
    );
    assert!(!p.broken);
    assert_eq!(p.ended, HashMap::from([(0, true), (1, true)]));
    assert_eq!(p.memory[24..32], [9; 8]);
}

#[test]
fn an_operation_past_its_deadline_fails_once_and_its_late_answer_is_stale() {
    let p = run(
        1,
        4,
        &[
            Step::Write {
                cell: 2,
                byte: 5,
                stream: None,
            },
            Step::Read { cell: 2 },
            Step::Tick(150),
            Step::Serve(0),
            Step::Serve(0),
            Step::Receive(0),
            Step::Receive(0),
            // Operations started after the expiry run normally.
            Step::Read { cell: 2 },
        ],
        &[],
    );
    assert!(!p.broken, "a late answer does not break the link");
    assert_eq!(p.ended, HashMap::from([(0, false), (1, false), (2, true)]));
    assert_eq!(p.memory[16..24], [5; 8], "the target still served the late write");
}

#[test]
fn the_handshake_opens_the_link_once_and_refuses_what_does_not_belong() {
    let mut registry = LinkRegistry::new(LinkLimits::default());
    let table = vec![ad(0), ad(3)];
    assert_eq!(handshake(3, &mut registry, table.clone()).unwrap(), table);
    // The same token again: its control stream is refused, and the answer says why.
    let again = handshake(3, &mut registry, table.clone()).unwrap_err();
    assert!(
        matches!(&again, Error::Protocol(m) if m.contains("token reused")),
        "{again:?}"
    );
    // A further stream of a link nobody opened.
    let stranger = identity(INITIATOR).hello(LinkToken(9), StreamIndex(1), 2, None, DataProtection::Plain);
    assert!(matches!(registry.admit(&stranger, None), Err(Error::Protocol(_))));
    // More streams than the link declared.
    let extra = identity(INITIATOR).hello(LinkToken(0x5eed), StreamIndex(3), 3, None, DataProtection::Plain);
    assert!(matches!(registry.admit(&extra, None), Err(Error::InvalidArgument(_))));
}
