//! The initiator's side of a link: several TCP streams to one peer, carrying pipelined batches.
//!
//! A batch is cut into pieces: descriptors whose own frame would copy them anyway (writes up to 16 KiB,
//! reads under 64 KiB) are coalesced through the coalescing pool (HIXL's buffer pool) into one frame per piece, larger ones go
//! as one frame each and are split across the streams when they are
//! large enough to gain from it. Each piece takes its size from a per-link byte budget, goes to the
//! stream with the fewest bytes outstanding, and completes when the target acknowledges it (writes) or
//! its data has landed (reads). Stream 0 also carries notifications and the target's region updates.
//!
//! The protocol's decisions are `ferry-proto`'s: every frame of a batch and the commits after a
//! persistent write in several frames ([`BatchFrames`]); operation ids, which stream an operation
//! takes, matching each answer to its operation, the peer's region table and the keepalive
//! ([`Initiator`]). This module moves bytes and keeps the byte budget (how much may be in flight,
//! which needs waiting).
//!
//! A batch has no timer here: its caller bounds it by dropping its future, which takes back every
//! operation of the batch still waiting ([`BatchOps`]) and closes its hold on the local buffers
//! ([`CallerGuard`]). The one task per link that sleeps is the keepalive's
//! ([`Initiator::poll_timeout`]), which gives up a silent peer and with it every batch on the link.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferry_core::codec::{Frame, Hello, HelloAck, Limits, ReadStatus, Segment};
use ferry_core::integrity::RunningSums;
use ferry_core::sync::{Handoff, ShardedLock};
use ferry_core::{
    AccessGuard, DataLink, DataProtection, Declined, Error, Notification, Op, PeerIdentity, PersistMethod, RegionEntry,
    RemoteRegions, Resolved, Result, TransferRequest, TransportKind,
};
use ferry_proto::batch::Shape;
use ferry_proto::handshake::check_ack;
use ferry_proto::initiator::OpKind;
use ferry_proto::keepalive::{DEFAULT_DEAD, DEFAULT_IDLE};
use ferry_proto::outbound::{BatchFrames, Send};
use ferry_proto::{Event, Identity, Initiator, Keepalive, LinkLimits, LinkToken, OpId, RegionUpdate, StreamIndex};
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError, mpsc, oneshot};
use tokio::task::AbortHandle;

use crate::blocking::{
    Bounces, OVERLAP_PIECE, bytes_of, copied, from_device, pieces, staged_in_host_copy, through_device,
};
use crate::coalesce::{CoalesceBuf, CoalescePool};
use crate::io::{Conn, DIRECT_THRESHOLD, FrameReader, FrameWriter, Landed, access_error, unbacked};
use crate::tls::{Session, TlsConfig};

/// Payloads below this are copied into the frame buffer rather than sent from the region.
const INLINE_PAYLOAD: u64 = 16 << 10;
/// The in-flight byte budget counts in units of this size.
const BUDGET_UNIT: u64 = 4096;

/// How a link is set up.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// Number of TCP streams (at least 1).
    pub streams: usize,
    /// Most bytes in flight on the link at once.
    pub max_inflight_bytes: u64,
    /// Decoder limits.
    pub limits: Limits,
    /// The coalescing pool for small descriptors, if on.
    pub pool: Option<Arc<CoalescePool>>,
    /// The protocol's limits.
    pub link_limits: LinkLimits,
    /// How long sent data may wait unacknowledged before the link's connection is given up (see
    /// [`ServerConfig::send_timeout`](crate::ServerConfig::send_timeout)).
    pub send_timeout: Duration,
    /// Mutual TLS on the control stream (and on every stream, if it says so). A link whose data
    /// streams are plain keeps its control stream for control frames: it opens `streams` data
    /// streams besides it.
    pub tls: Option<TlsConfig>,
}

/// What the initiator says about itself in its hello.
pub type LocalIdentity = Identity;

/// Where a read's data goes, and the guard of the transfer that asked for it: the data lands only
/// while that guard is open (see [`CallerGuard`]).
enum ReadDest {
    Direct {
        part: Resolved,
        caller: Arc<AccessGuard>,
        /// Where a checked read's sums of what landed go.
        sums: Option<Arc<FrameSums>>,
    },
    Scatter {
        parts: Vec<Resolved>,
        buffer: Option<CoalesceBuf>,
        caller: Arc<AccessGuard>,
        sums: Option<Arc<FrameSums>>,
    },
    /// Parts of which some are memory whose device copies from any buffer (CUDA's): the data lands
    /// through the stream's bounce buffers ([`land_read_through_device`]).
    Device {
        parts: Vec<Resolved>,
        caller: Arc<AccessGuard>,
        sums: Option<Arc<FrameSums>>,
    },
}

/// A transfer's hold on its local buffers. Every copy of a read's data into them holds a permit of
/// this guard; when the transfer returns, fails, times out or is dropped, the guard closes and waits
/// out the permit in progress, so that no byte lands in the caller's memory afterwards. Data that
/// arrives later is discarded. A permit lasts one bounded copy or non-blocking `read(2)`
/// (microseconds), or, for a coalesced GPU block, its copy to the device (bounded by the block's own
/// wait limit).
struct CallerGuard(Arc<AccessGuard>);

impl Drop for CallerGuard {
    fn drop(&mut self) {
        self.0.close();
        self.0.wait_drained(Duration::MAX);
    }
}

/// The stream an operation went out on, its id there, and its completion.
type Submitted = (StreamIndex, OpId, oneshot::Receiver<Result<()>>);

/// The operations a batch (or a checksum request) still waits for. Dropped before [`finish`](
/// Self::finish) (the caller gave up: a timeout, a dropped future), it takes them back from the
/// protocol core, so that the link keeps nothing of a batch nobody waits for, and their answers,
/// should they still come, are stale. A batch that ends normally has every answer in hand and pays
/// nothing for it.
struct BatchOps<'a> {
    shared: &'a Shared,
    ops: Vec<(StreamIndex, OpId)>,
}

impl<'a> BatchOps<'a> {
    fn new(shared: &'a Shared) -> Self {
        BatchOps {
            shared,
            ops: Vec::new(),
        }
    }

    fn push(&mut self, stream: StreamIndex, id: OpId) {
        self.ops.push((stream, id));
    }

    /// Every operation was answered: nothing to take back.
    fn finish(mut self) {
        self.ops.clear();
    }
}

impl Drop for BatchOps<'_> {
    fn drop(&mut self) {
        if self.ops.is_empty() {
            return;
        }
        // An answered operation is no longer there: nothing taken. What is taken (a budget permit,
        // a pool buffer) is let go after the lock.
        let taken: Vec<Waiter> = match self.shared.proto() {
            Ok(mut proto) => self
                .ops
                .iter()
                .filter_map(|&(stream, id)| proto.take(stream, id))
                .collect(),
            Err(_) => Vec::new(),
        };
        drop(taken);
    }
}

/// An operation waiting for its answer, as the protocol core keeps it.
enum Waiter {
    Op(Pending),
    Setup(oneshot::Sender<Result<Vec<u8>>>),
    Sums(oneshot::Sender<Result<Vec<u32>>>),
    /// The check of a frame: the target's sums of its ranges, against this side's.
    Check(FrameCheck),
}

/// A frame's end-to-end check ([`TransferRequest::checked`]), waiting for the target's sums.
struct FrameCheck {
    done: oneshot::Sender<Result<()>>,
    /// What the frame did.
    op: Op,
    /// This side's sums: a write's source as the frame's bytes left, a read's destination as they
    /// landed.
    ours: Arc<FrameSums>,
    /// The target's ranges of the frame, in order.
    ranges: Vec<Segment>,
}

/// The CRC32C of each of this side's ranges of a frame, taken while the bytes are in cache: a
/// write's source by the stream's writer right before the bytes leave (the sum brings them into the
/// cache the send then copies from), a read's destination by the stream's reader right after they
/// landed. Unset where a range could not be read (its region went away): the frame itself then
/// fails.
#[derive(Default)]
struct FrameSums(std::sync::OnceLock<Vec<u32>>);

impl FrameSums {
    fn take(&self, parts: &[Resolved]) {
        let sums: Result<Vec<u32>> = parts.iter().map(ferry_core::integrity::sum).collect();
        if let Ok(sums) = sums {
            let _ = self.0.set(sums);
        }
    }
}

impl FrameCheck {
    /// The check's outcome, given the target's answer.
    fn finish(self, theirs: Result<Vec<u32>>, peer: &str) {
        let outcome = theirs.and_then(|theirs| match self.ours.0.get() {
            Some(ours) => ferry_core::integrity::compare(self.op, ours, &theirs, &self.ranges, &peer),
            None => Err(Error::Internal(format!(
                "a {:?} frame's checksums were answered before this side's were taken",
                self.op
            ))),
        });
        let _ = self.done.send(outcome);
    }
}

impl Waiter {
    fn fail(self, error: Error) {
        match self {
            Waiter::Op(p) => {
                let _ = p.done.send(Err(error));
            }
            Waiter::Setup(s) => {
                let _ = s.send(Err(error));
            }
            Waiter::Sums(s) => {
                let _ = s.send(Err(error));
            }
            Waiter::Check(c) => {
                let _ = c.done.send(Err(error));
            }
        }
    }
}

struct Pending {
    done: oneshot::Sender<Result<()>>,
    read: Option<ReadDest>,
    _budget: Option<OwnedSemaphorePermit>,
}

enum Outgoing {
    Frame(Frame),
    /// A write frame (operation `id`) whose payload is the region ranges `parts`, back to back;
    /// summed into `sums` as it leaves, where it is checked. `through_device` when some part's
    /// block copies from its device into any buffer: the payload then goes out through the stream's
    /// bounce buffers ([`write_through_device`]).
    Write {
        id: OpId,
        frame: Frame,
        parts: Vec<Resolved>,
        sums: Option<Arc<FrameSums>>,
        through_device: bool,
    },
    /// Send what the writer holds (left there by a caller's write that the socket did not take whole).
    Flush,
    Shutdown,
}

impl Outgoing {
    /// Whether it goes into the frame buffer whole, with no wait: what a caller may write itself.
    fn is_inline(&self) -> bool {
        match self {
            Outgoing::Frame(_) | Outgoing::Flush => true,
            Outgoing::Write {
                parts, through_device, ..
            } => !through_device && parts.iter().map(|p| p.len).sum::<u64>() <= INLINE_PAYLOAD,
            Outgoing::Shutdown => false,
        }
    }
}

/// One TCP stream of the link, as the initiator writes to it.
///
/// Frames reach the writer in submission order through one of two paths. A caller whose frame is
/// small, and who finds nothing queued for the write task and the writer free, puts its frame into
/// the writer and sends it itself, without waking another task (the round trip of a small operation
/// is most of its cost). Everything else goes through the write task's queue. `queued` keeps the
/// order between the two ([`Handoff`]).
struct Stream {
    tx: mpsc::UnboundedSender<Outgoing>,
    writer: Arc<tokio::sync::Mutex<FrameWriter>>,
    queued: Handoff,
}

struct Shared {
    peer: String,
    /// Who the target proved to be, on an authenticated link.
    remote_identity: Option<PeerIdentity>,
    remote_engine: u64,
    remote_host: u64,
    remote_transports: Vec<TransportKind>,
    proto: Mutex<Initiator<Waiter>>,
    /// The peer's region table, mirrored from `proto`'s by the updates its `RegionsChanged` events
    /// carry (all from the control stream's reader, in order): every transfer looks its remote
    /// side up here, under a sharded read lock that transfers on different cores take without
    /// touching each other's cache lines (see [`ShardedLock`]), instead of under `proto`'s lock,
    /// which every frame of the link takes.
    remote_regions: ShardedLock<RemoteRegions>,
    /// Told once `remote_regions` has taken an update.
    region_updates: tokio::sync::Notify,
    streams: Vec<Stream>,
    /// How many of them carry data (all but the control stream when it is kept for control frames):
    /// what a batch is spread over.
    data_streams: usize,
    /// Set once `proto` is closed, for checks that need no lock.
    closed: AtomicBool,
    budget: Arc<Semaphore>,
    budget_units: u32,
    pool: Option<Arc<CoalescePool>>,
    tasks: Mutex<Vec<AbortHandle>>,
}

/// A link to one peer over TCP.
#[derive(Clone)]
pub struct TcpLink {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for TcpLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpLink")
            .field("peer", &self.shared.peer)
            .field("streams", &self.shared.streams.len())
            .finish()
    }
}

/// A stream as [`open_stream`] leaves it: its reader and writer, the target's answer, and what its TLS
/// handshake established, if it had one.
type Opened = (FrameReader, FrameWriter, HelloAck, Option<Session>);

/// Connects one stream of a link and says hello on it (over TLS when `tls` is given).
async fn open_stream(
    addr: SocketAddr,
    hello: Hello,
    limits: Limits,
    tls: Option<&TlsConfig>,
    send_timeout: Duration,
) -> Result<Opened> {
    let peer = addr.to_string();
    let index = StreamIndex(hello.stream_index);
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| Error::io(format_args!("connecting to {addr}"), e))?;
    crate::io::configure(&stream, send_timeout)?;
    let (conn, session) = match tls {
        None => (Conn::Plain(stream), None),
        Some(tls) => {
            let (stream, session) = tls.connect(stream, addr).await?;
            (Conn::Tls(Box::new(stream)), Some(session))
        }
    };
    let (r, w) = conn.split();
    let mut reader = FrameReader::new(r, limits, peer.clone());
    let mut writer = FrameWriter::new(w, peer.clone());
    let answer = async {
        writer.push(&Frame::Hello(hello), 0)?;
        writer.flush().await?;
        reader.next().await
    };
    let answer = match (answer.await, session.is_some()) {
        // Under TLS 1.3 the target checks this engine's certificate after the client's side of the
        // handshake is done: a refusal shows up here, as an alert or a closed connection.
        (Ok(None), true) => return Err(tls_refused(&peer, "it closed the connection")),
        (Err(e @ (Error::Io { .. } | Error::PeerClosed(_))), true) => return Err(tls_refused(&peer, e.message())),
        (answer, _) => answer?,
    };
    match answer {
        Some(d) => match d.frame {
            Frame::HelloAck(ack) => Ok((reader, writer, check_ack(ack, index, &peer)?, session)),
            other => Err(Error::Protocol(format!("{peer} answered the hello with {other:?}"))),
        },
        None => Err(Error::PeerClosed(format!(
            "{peer} closed the connection during the handshake"
        ))),
    }
}

fn tls_refused(peer: &str, why: &str) -> Error {
    Error::PermissionDenied(format!(
        "{peer} ended the TLS session before answering the hello (it did not accept this engine's certificate, \
         or failed): {why}"
    ))
}

/// Opens a link's `streams` streams to `addr`: the control stream, whose answer brings the target's
/// identity, transports and regions, then the others at once, joined to it by a fresh link token
/// (and, under TLS, by the session's join key, and protected under its record keys from their
/// answer on).
async fn open_streams(
    addr: SocketAddr,
    me: &LocalIdentity,
    config: &LinkConfig,
    streams: usize,
) -> Result<(Vec<(FrameReader, FrameWriter)>, HelloAck, Option<Session>)> {
    let tls = config.tls.as_ref();
    let mut token = [0u8; 8];
    getrandom::fill(&mut token).map_err(|e| Error::Io {
        kind: std::io::ErrorKind::Other,
        message: format!("drawing a link token: {e}"),
    })?;
    let token = LinkToken(u64::from_le_bytes(token));
    let protection = tls.map_or(DataProtection::Plain, TlsConfig::protection);
    let (r0, w0, ack, session) = open_stream(
        addr,
        me.hello(token, StreamIndex(0), streams as u16, None, protection),
        config.limits,
        tls,
        config.send_timeout,
    )
    .await?;
    let key = session.as_ref().map(|s| &s.join_key);
    let rest = futures::future::try_join_all((1..streams).map(|i| async move {
        let index = StreamIndex(i as u16);
        let hello = me.hello(token, index, streams as u16, key, protection);
        let (r, w, _, _) = open_stream(addr, hello, config.limits, None, config.send_timeout).await?;
        match (key, protection) {
            (Some(key), DataProtection::Integrity | DataProtection::Encrypted) => {
                let (sealer, opener) = key.stream_keys(token, index)?.initiator(protection);
                Ok((r.sealed(opener)?, w.sealed(sealer)?))
            }
            _ => Ok((r, w)),
        }
    }))
    .await?;
    let mut halves = Vec::with_capacity(streams);
    halves.push((r0, w0));
    halves.extend(rest);
    Ok((halves, ack, session))
}

/// Spawns a link's tasks: its timer, and a reader and a writer per stream, in stream order. The link
/// aborts them when it is torn down.
fn start_tasks(shared: &Arc<Shared>, streams: impl Iterator<Item = (FrameReader, mpsc::UnboundedReceiver<Outgoing>)>) {
    let mut handles = vec![tokio::spawn(timer_loop(shared.clone())).abort_handle()];
    for (i, (reader, rx)) in streams.enumerate() {
        let index = StreamIndex(i as u16);
        handles.push(tokio::spawn(write_loop(shared.clone(), index, rx)).abort_handle());
        handles.push(tokio::spawn(read_loop(shared.clone(), index, reader)).abort_handle());
    }
    if let Ok(mut t) = shared.tasks.lock() {
        t.extend(handles);
    }
}

impl TcpLink {
    /// Connects to the engine listening at `addr`: the control stream first, then the others.
    /// The caller bounds the whole call with its connect timeout.
    pub async fn dial(addr: SocketAddr, me: &LocalIdentity, config: &LinkConfig) -> Result<TcpLink> {
        let tls = config.tls.as_ref();
        // Under TLS the control stream carries no data, so it comes on top of the configured streams,
        // which all carry data.
        let control_apart = tls.is_some();
        let streams = match control_apart {
            true => config.streams.clamp(1, 63) + 1,
            false => config.streams.clamp(1, 64),
        };
        let (halves, ack, session) = open_streams(addr, me, config, streams).await?;
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..streams).map(|_| mpsc::unbounded_channel()).unzip();
        let mut readers = Vec::with_capacity(streams);
        let mut stream_list = Vec::with_capacity(streams);
        for ((reader, writer), tx) in halves.into_iter().zip(txs) {
            readers.push(reader);
            stream_list.push(Stream {
                tx,
                writer: Arc::new(tokio::sync::Mutex::new(writer)),
                queued: Handoff::new(),
            });
        }
        let peer = addr.to_string();
        let keepalive = Keepalive::new(Instant::now(), DEFAULT_IDLE, DEFAULT_DEAD);
        let mut proto = Initiator::new(peer.clone(), streams, ack.regions, config.link_limits, keepalive)?;
        if control_apart {
            proto.reserve_control();
        }
        let budget_units = (config.max_inflight_bytes / BUDGET_UNIT).clamp(1, u32::MAX as u64 >> 4) as u32;
        let remote_regions = ShardedLock::new(proto.regions().clone());
        let shared = Arc::new(Shared {
            peer,
            remote_identity: session.map(|s| s.identity),
            remote_engine: ack.engine_id,
            remote_host: ack.host_id,
            remote_transports: ack.transports,
            proto: Mutex::new(proto),
            remote_regions,
            region_updates: tokio::sync::Notify::new(),
            streams: stream_list,
            data_streams: if control_apart { streams - 1 } else { streams },
            closed: AtomicBool::new(false),
            budget: Arc::new(Semaphore::new(budget_units as usize)),
            budget_units,
            pool: config.pool.clone(),
            tasks: Mutex::new(Vec::new()),
        });
        start_tasks(&shared, readers.into_iter().zip(rxs));
        let identity = shared
            .remote_identity
            .as_ref()
            .map(|i| i.name.as_str())
            .unwrap_or("unauthenticated");
        tracing::debug!(peer = %shared.peer, streams, identity, "tcp link up");
        Ok(TcpLink { shared })
    }

    /// Who the target proved to be, on an authenticated link.
    pub fn remote_identity(&self) -> Option<&PeerIdentity> {
        self.shared.remote_identity.as_ref()
    }

    /// The peer's address.
    pub fn peer(&self) -> &str {
        &self.shared.peer
    }

    /// The peer's engine id.
    pub fn remote_engine(&self) -> u64 {
        self.shared.remote_engine
    }

    /// The peer's host id.
    pub fn remote_host(&self) -> u64 {
        self.shared.remote_host
    }

    /// Transports the peer offered, best first.
    pub fn remote_transports(&self) -> &[TransportKind] {
        &self.shared.remote_transports
    }

    /// Number of TCP streams.
    pub fn stream_count(&self) -> usize {
        self.shared.streams.len()
    }

    /// A snapshot of the peer's regions.
    pub fn remote_regions(&self) -> RemoteRegions {
        self.with_remote_regions(|r| r.clone()).unwrap_or_default()
    }

    /// Operations sent on this link that still wait for the peer's answer: what it holds for the
    /// batches in flight. A batch its caller dropped (a timeout) holds none.
    pub fn waiting_operations(&self) -> usize {
        self.shared.proto().map_or(0, |p| p.waiting())
    }

    /// Runs `f` on the peer's region table.
    pub fn with_remote_regions<T>(&self, f: impl FnOnce(&RemoteRegions) -> T) -> Result<T> {
        let table = self
            .shared
            .remote_regions
            .read()
            .map_err(|_| Error::Internal("the peer's region table lock is poisoned".into()))?;
        Ok(f(&table))
    }

    /// Waits until the peer's region table changes, or `timeout` passes.
    pub async fn region_update(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.shared.region_updates.notified()).await;
    }

    /// Tears the link down at once, without telling the peer: outstanding operations fail with
    /// `PeerClosed`. For drop paths, where nothing can be awaited.
    pub fn abort(&self) {
        self.shared.fail_all(Error::PeerClosed(format!(
            "the link to {} was dropped",
            self.shared.peer
        )));
        if let Ok(tasks) = self.shared.tasks.lock() {
            for t in tasks.iter() {
                t.abort();
            }
        }
    }

    /// Sends a ping and waits for nothing: a cheap way to find out that the peer is gone.
    pub fn ping(&self) -> Result<()> {
        self.shared
            .send(StreamIndex::CONTROL, Outgoing::Frame(Frame::Ping { nonce: 0 }))
    }
}

impl Shared {
    fn proto(&self) -> Result<MutexGuard<'_, Initiator<Waiter>>> {
        self.proto
            .lock()
            .map_err(|_| Error::Internal("link state lock poisoned".into()))
    }

    /// Applies a region update `proto` has taken to `remote_regions`, and tells who waits for one.
    /// It cannot fail where `proto`'s table took it; if it did, the link would close with the error.
    fn mirror_regions(&self, update: RegionUpdate) -> Result<()> {
        let mut table = self
            .remote_regions
            .write()
            .map_err(|_| Error::Internal("the peer's region table lock is poisoned".into()))?;
        update.apply(&mut table)?;
        drop(table);
        self.region_updates.notify_waiters();
        Ok(())
    }

    fn closed_error(&self) -> Error {
        match self.proto() {
            Ok(p) => p.closed_error(),
            Err(e) => e,
        }
    }

    /// Queues `out` for `stream`'s write task.
    fn send(&self, stream: StreamIndex, out: Outgoing) -> Result<()> {
        self.send_as(stream, out, false)
    }

    /// Puts `out` on `stream`: written by the caller when `idle` (no other operation waits on the
    /// link) and it can be (see [`Stream`]), else queued for the stream's write task. While other
    /// operations are in flight, queued frames share system calls at both ends (the target reads
    /// several requests per wake-up and answers them in one write), which beats a call per caller
    /// (4 KiB writes, 16 in flight: 0.93 GB/s queued, 0.58 GB/s written by each caller, 0.72 when only
    /// callers finding their stream idle write); an idle link would wake the task for one frame (64 B
    /// round trip: 30 µs queued, 22 µs written by the caller).
    fn send_as(&self, stream: StreamIndex, out: Outgoing, idle: bool) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(self.closed_error());
        }
        let s = &self.streams[stream.get()];
        let out = match idle {
            true => match self.write_through(stream, s, out) {
                None => return Ok(()),
                Some(out) => out,
            },
            false => out,
        };
        s.queued.queue();
        s.tx.send(out).map_err(|_| self.closed_error())
    }

    /// Writes a small frame on the caller's task when nothing is queued before it and the writer is
    /// free (`None`); hands it back otherwise. What the socket does not take at once is left in the
    /// writer for the write task to send.
    fn write_through(&self, index: StreamIndex, s: &Stream, out: Outgoing) -> Option<Outgoing> {
        if !out.is_inline() || !s.queued.nothing_queued() {
            return Some(out);
        }
        let Ok(mut writer) = s.writer.try_lock() else {
            return Some(out);
        };
        if !s.queued.nothing_queued() {
            return Some(out);
        }
        let sent = push_inline(self, index, &mut writer, out).and_then(|()| writer.try_flush());
        drop(writer);
        match sent {
            Ok(true) => {}
            Ok(false) => {
                s.queued.queue();
                if s.tx.send(Outgoing::Flush).is_err() {
                    self.fail_all(self.closed_error());
                }
            }
            Err(e) => {
                tracing::debug!(peer = %self.peer, stream = %index, error = %e, "tcp link write failed");
                self.fail_all(e);
            }
        }
        None
    }

    /// Starts an operation on `stream` (or the least loaded one) and queues the frame `out` builds
    /// for its id. Returns the stream it took and the completion.
    fn submit(
        &self,
        stream: Option<StreamIndex>,
        bytes: u64,
        read: Option<ReadDest>,
        budget: Option<OwnedSemaphorePermit>,
        out: impl FnOnce(OpId) -> Outgoing,
    ) -> Result<Submitted> {
        let (done, rx) = oneshot::channel();
        let kind = if read.is_some() { OpKind::Read } else { OpKind::Ack };
        let pending = Waiter::Op(Pending {
            done,
            read,
            _budget: budget,
        });
        let (stream, id, idle) = {
            let mut proto = self.proto()?;
            let (stream, id) = proto.start(stream, kind, bytes, pending)?;
            (stream, id, proto.waiting() == 1)
        };
        if let Err(e) = self.send_as(stream, out(id), idle) {
            self.complete(stream, id, Err(e.clone()));
            return Err(e);
        }
        Ok((stream, id, rx))
    }

    fn complete(&self, stream: StreamIndex, id: OpId, result: Result<()>) {
        let waiter = self.proto().ok().and_then(|mut p| p.take(stream, id));
        match waiter {
            Some(Waiter::Op(p)) => {
                let _ = p.done.send(result);
            }
            Some(Waiter::Check(c)) => {
                let _ = c.done.send(result);
            }
            _ => {}
        }
    }

    fn fail_all(&self, error: Error) {
        let (waiters, error) = match self.proto() {
            Ok(mut p) => {
                let waiters = p.close(error);
                (waiters, p.closed_error())
            }
            Err(e) => (Vec::new(), e),
        };
        self.closed.store(true, Ordering::Release);
        for w in waiters {
            w.fail(error.clone());
        }
        self.region_updates.notify_waiters();
    }

    /// `bytes`' share of the link's byte budget, waiting for it if it must.
    async fn budget(&self, bytes: u64) -> Result<OwnedSemaphorePermit> {
        let units = bytes.div_ceil(BUDGET_UNIT).clamp(1, self.budget_units as u64) as u32;
        match self.budget.clone().try_acquire_many_owned(units) {
            Ok(permit) => return Ok(permit),
            Err(TryAcquireError::Closed) => return Err(self.closed_error()),
            Err(TryAcquireError::NoPermits) => {}
        }
        self.budget
            .clone()
            .acquire_many_owned(units)
            .await
            .map_err(|_| self.closed_error())
    }
}

/// Drives the link's one timer, the keepalive's: probes a silent peer and gives the link up when it
/// stays silent, failing every operation on it. Its instant only ever moves later (as frames are
/// heard), so nothing needs to wake the task early.
async fn timer_loop(shared: Arc<Shared>) {
    loop {
        let Some(due) = shared.proto().ok().and_then(|p| p.poll_timeout()) else {
            return;
        };
        tokio::time::sleep_until(due.into()).await;
        let step = shared.proto().and_then(|mut p| {
            p.handle_timeout(Instant::now())?;
            Ok(p.poll_transmit())
        });
        match step {
            Ok(Some((stream, probe))) => {
                let _ = shared.send(stream, Outgoing::Frame(probe));
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(peer = %shared.peer, error = %e, "link given up");
                shared.fail_all(e);
                return;
            }
        }
    }
}

/// Runs one batch: every frame `ferry-proto` makes of it, each under its share of the byte budget.
/// Dropped before it returns, it takes back what it still waits for ([`BatchOps`]) and lets no more
/// of a read's data land ([`CallerGuard`]).
async fn run_batch(shared: Arc<Shared>, request: TransferRequest) -> Result<()> {
    let shared = &shared;
    if shared.closed.load(Ordering::Acquire) {
        return Err(shared.closed_error());
    }
    // Whether any frame may move memory whose device copies into any buffer (CUDA's) through the
    // streams' bounce buffers ([`crate::device`]): decided once here, so that a request of host
    // memory asks no block of any frame again.
    let device = through_device(request.items.iter().map(|i| &i.local));
    if request.op == Op::Write {
        // A staged block without device copies of its own (Vulkan's) is brought to its host copy
        // first, off the runtime, each region's ranges as one batch.
        let staged = staged_in_host_copy(request.items.iter().map(|i| &i.local));
        if !staged.is_empty() {
            crate::blocking::prepare_read(&staged).await?;
        }
    }
    let caller = CallerGuard(Arc::new(AccessGuard::new()));
    let shape = Shape {
        streams: shared.data_streams,
        coalesce_buffer: shared.pool.as_ref().map(|p| p.buffer_bytes() as u64),
        direct_read: DIRECT_THRESHOLD as u64,
    };
    let streams = shared.streams.len();
    let checked = request.checked;
    let mut frames = BatchFrames::new(request.op, request.durability, request.items, &shape, streams, checked);
    let mut ops = BatchOps::new(shared);
    let mut completions = Vec::new();
    let mut first_error = None;
    // The source's sums of the write frame last sent, for the check that follows it.
    let mut frame_sums = None;
    while let Some(send) = frames.next() {
        let submitted = match send.kind() {
            OpKind::Read => {
                frame_sums = checked.then(Arc::default);
                submit_read(shared, send, device, &caller.0, frame_sums.clone()).await
            }
            OpKind::Sum => submit_check(shared, request.op, send, frame_sums.take()),
            _ => {
                frame_sums = (checked && send.bytes() > 0).then(Arc::default);
                submit_write(shared, send, device, frame_sums.clone()).await
            }
        };
        match submitted {
            Ok((stream, id, rx)) => {
                frames.sent(stream);
                ops.push(stream, id);
                completions.push(rx);
            }
            Err(e) => {
                first_error = Some(e);
                break;
            }
        }
    }
    // Every frame sent is answered before the batch returns, failed or not (a dropped batch aside):
    // a retry never meets the frames of the attempt before it still landing.
    for rx in completions {
        let result = rx.await.map_err(|_| shared.closed_error()).and_then(|r| r);
        if let (Err(e), None) = (result, &first_error) {
            first_error = Some(e);
        }
    }
    ops.finish();
    first_error.map_or(Ok(()), Err)
}

/// Sends one write frame (or a commit, which moves no payload) under its share of the byte budget,
/// its payload straight from the regions, or through the stream's bounce buffers where `device`
/// (the request's memory may go through them) and the frame's memory does.
async fn submit_write(shared: &Shared, send: Send, device: bool, sums: Option<Arc<FrameSums>>) -> Result<Submitted> {
    let bytes = send.bytes();
    let budget = match bytes {
        0 => None,
        _ => Some(shared.budget(bytes).await?),
    };
    shared.submit(send.stream(), bytes, None, budget, |id| {
        let (frame, parts) = send.into_frame(id);
        match parts.is_empty() {
            true => Outgoing::Frame(frame),
            false => Outgoing::Write {
                through_device: device && through_device(&parts),
                id,
                frame,
                parts,
                sums,
            },
        }
    })
}

/// Asks, on the stream of the write frame before it, for the target's sums of what that frame
/// wrote; its completion compares them with the source's, `sent`.
fn submit_check(shared: &Shared, op: Op, send: Send, ours: Option<Arc<FrameSums>>) -> Result<Submitted> {
    let ours = ours.ok_or_else(|| Error::Internal("a checksum request with no frame before it".into()))?;
    let (done, rx) = oneshot::channel();
    let check = Waiter::Check(FrameCheck {
        done,
        op,
        ours,
        ranges: send.checked_ranges().to_vec(),
    });
    let stream = send.stream();
    let (_, frame) = send.split();
    let (stream, id) = start_request(shared, stream, check, |id| frame.frame(id))?;
    Ok((stream, id, rx))
}

/// Asks for one read frame's data, under its share of the byte budget; its data lands straight in
/// the region, through a pool buffer that is scattered over its parts, or through the stream's
/// bounce buffers where `device` (the request's memory may go through them) and the frame's memory
/// does. A checked read's sums of what landed go to `sums`.
async fn submit_read(
    shared: &Shared,
    send: Send,
    device: bool,
    caller: &Arc<AccessGuard>,
    sums: Option<Arc<FrameSums>>,
) -> Result<Submitted> {
    let bytes = send.bytes();
    let budget = Some(shared.budget(bytes).await?);
    let coalesced = send.is_coalesced();
    let (mut parts, frame) = send.split();
    if device && through_device(&parts) {
        let dest = ReadDest::Device {
            parts,
            caller: caller.clone(),
            sums,
        };
        return shared.submit(None, bytes, Some(dest), budget, |id| Outgoing::Frame(frame.frame(id)));
    }
    let buffer = match (coalesced, shared.pool.as_ref()) {
        (true, Some(pool)) => Some(pool.acquire().await),
        _ => None,
    };
    let dest = match (coalesced, parts.pop()) {
        (false, Some(part)) if parts.is_empty() => ReadDest::Direct {
            part,
            caller: caller.clone(),
            sums,
        },
        (_, last) => {
            parts.extend(last);
            ReadDest::Scatter {
                parts,
                buffer,
                caller: caller.clone(),
                sums,
            }
        }
    };
    shared.submit(None, bytes, Some(dest), budget, |id| Outgoing::Frame(frame.frame(id)))
}

/// Puts a frame whose payload is in hand into the writer. A write whose region was deregistered
/// meanwhile is sent with zeros (the stream stays framed) and fails at once.
fn push_inline(shared: &Shared, stream: StreamIndex, writer: &mut FrameWriter, out: Outgoing) -> Result<()> {
    match out {
        Outgoing::Frame(f) => writer.push(&f, 0)?,
        Outgoing::Write {
            id, frame, parts, sums, ..
        } => {
            if let Some(sums) = sums {
                sums.take(&parts);
            }
            writer.push(&frame, parts.iter().map(|p| p.len).sum())?;
            let mut intact = true;
            for p in &parts {
                intact &= writer.push_region(&p.region, p.offset, p.len as usize);
            }
            if !intact {
                shared.complete(stream, id, Err(access_error(&parts)));
            }
        }
        Outgoing::Flush | Outgoing::Shutdown => {}
    }
    Ok(())
}

/// Puts one queued item into the writer, sending large payloads straight from their memory (or
/// through `bounces`, from a device).
async fn write_one(
    shared: &Shared,
    stream: StreamIndex,
    writer: &mut FrameWriter,
    bounces: &mut Bounces,
    out: Outgoing,
) -> Result<()> {
    if out.is_inline() {
        return push_inline(shared, stream, writer, out);
    }
    match out {
        Outgoing::Write {
            id,
            frame,
            parts,
            sums,
            through_device: true,
        } => {
            let sent = write_through_device(writer, bounces, &frame, &parts, sums.as_deref()).await?;
            if let Err(e) = sent {
                shared.complete(stream, id, Err(e));
            }
        }
        Outgoing::Write {
            id, frame, parts, sums, ..
        } => {
            if let Some(sums) = sums {
                sums.take(&parts);
            }
            writer.push(&frame, parts.iter().map(|p| p.len).sum())?;
            if !writer.write_parts(&parts).await? {
                shared.complete(stream, id, Err(access_error(&parts)));
            }
        }
        Outgoing::Frame(_) | Outgoing::Flush | Outgoing::Shutdown => {}
    }
    Ok(())
}

/// Sends a write frame whose payload comes, in part at least, from memory whose device copies into
/// any buffer (CUDA's), through the stream's bounce buffers ([`crate::device`]); where the frame is
/// checked, its sums are taken of the bytes as they leave. The outer error breaks the stream; the
/// inner result is the operation's: a first piece that cannot be copied fails it before any of the
/// frame goes out, a later one after the rest of the payload went out as zeros.
async fn write_through_device(
    writer: &mut FrameWriter,
    bounces: &mut Bounces,
    frame: &Frame,
    parts: &[Resolved],
    sums: Option<&FrameSums>,
) -> Result<Result<()>> {
    let pieces = pieces(parts, OVERLAP_PIECE);
    let Some(first) = pieces.first() else {
        return Ok(Ok(()));
    };
    let (first, result) = copied(from_device(first.clone(), bounces.take(bytes_of(first))).await);
    if let Err(e) = result {
        bounces.give(first);
        return Ok(Err(e));
    }
    let mut summed = sums.map(|_| RunningSums::new(parts.iter().map(|p| p.len)));
    writer.push(frame, parts.iter().map(|p| p.len).sum())?;
    let sent = crate::device::send_pieces(writer, &pieces, first, bounces, summed.as_mut()).await?;
    if let (Ok(()), Some(sums), Some(summed)) = (&sent, sums, summed) {
        let _ = sums.0.set(summed.finish());
    }
    Ok(sent)
}

/// Sends what callers queued on one stream, in order, several frames to a system call.
async fn write_loop(shared: Arc<Shared>, stream: StreamIndex, mut rx: mpsc::UnboundedReceiver<Outgoing>) {
    let s = &shared.streams[stream.get()];
    let mut bounces = Bounces::default();
    let result: Result<()> = async {
        while let Some(first) = rx.recv().await {
            let mut writer = s.writer.lock().await;
            let mut next = Some(first);
            while let Some(out) = next.take() {
                let shutdown = matches!(out, Outgoing::Shutdown);
                let written = write_one(&shared, stream, &mut writer, &mut bounces, out).await;
                s.queued.placed();
                written?;
                if shutdown {
                    writer.flush().await?;
                    return Ok(());
                }
                if writer.queued() >= 256 << 10 {
                    writer.flush().await?;
                }
                next = rx.try_recv().ok();
            }
            writer.flush().await?;
        }
        Ok(())
    }
    .await;
    if let Err(e) = result {
        tracing::debug!(peer = %shared.peer, %stream, error = %e, "tcp link writer stopped");
        shared.fail_all(e);
    }
    s.writer.lock().await.shutdown().await;
}

async fn read_loop(shared: Arc<Shared>, stream: StreamIndex, mut reader: FrameReader) {
    let mut bounces = Bounces::default();
    let error = loop {
        let decoded = match reader.next().await {
            Ok(Some(d)) => d,
            Ok(None) => break Error::PeerClosed(format!("{} closed the connection", shared.peer)),
            Err(e) => break e,
        };
        let event = shared
            .proto()
            .and_then(|mut p| p.handle(stream, decoded, Instant::now()));
        let handled = match event {
            Ok(Event::Answered { op, result }) => {
                if let Waiter::Op(p) = op {
                    let _ = p.done.send(result);
                }
                Ok(())
            }
            Ok(Event::Data { op, payload_len }) => land_read(&shared, op, payload_len, &mut reader, &mut bounces).await,
            Ok(Event::SetupAnswered { op, result }) => {
                if let Waiter::Setup(s) = op {
                    let _ = s.send(result);
                }
                Ok(())
            }
            Ok(Event::SumsAnswered { op, result }) => {
                match op {
                    Waiter::Sums(s) => {
                        let _ = s.send(result);
                    }
                    Waiter::Check(c) => c.finish(result, &shared.peer),
                    _ => {}
                }
                Ok(())
            }
            Ok(Event::Stale { payload_len }) => reader.discard(payload_len).await,
            Ok(Event::RegionsChanged(update)) => shared.mirror_regions(update),
            Ok(Event::Nothing) => Ok(()),
            Err(e) => Err(e),
        };
        if let Err(e) = handled {
            break e;
        }
    };
    tracing::debug!(peer = %shared.peer, %stream, %error, "tcp link reader stopped");
    shared.fail_all(error);
}

/// Puts a read's data where it belongs, then reads the status byte that says whether the data is the
/// source region's. Errors returned here break the stream; errors of the read itself (a region
/// deregistered meanwhile, at either end) complete the read.
async fn land_read(
    shared: &Shared,
    op: Waiter,
    payload_len: u64,
    reader: &mut FrameReader,
    bounces: &mut Bounces,
) -> Result<()> {
    let Waiter::Op(pending) = op else {
        return Err(Error::Internal("read data matched a data-path setup".into()));
    };
    let data_len = payload_len.checked_sub(ReadStatus::LEN);
    let landed = match pending.read {
        Some(ReadDest::Direct { part, caller, sums }) if Some(part.len) == data_len => {
            let part = std::slice::from_ref(&part);
            let landed = reader.read_parts(part, Some(&caller)).await?;
            let status = read_status_byte(reader).await?;
            match source_intact(shared, status).and_then(|()| landed_in(&part[0].region, landed)) {
                Ok(()) => {
                    ferry_core::integrity::fault::landed_for(&part[0], &caller);
                    if let Some(sums) = sums {
                        sums.take(part);
                    }
                    commit_for_caller(&caller, part).await
                }
                Err(e) => Err(e),
            }
        }
        Some(ReadDest::Scatter {
            parts,
            buffer,
            caller,
            sums,
        }) if Some(parts.iter().map(|p| p.len).sum::<u64>()) == data_len => {
            let mut buffer = buffer;
            let mut scratch = Vec::new();
            let buf = match buffer.as_mut() {
                Some(s) => &mut s.data,
                None => &mut scratch,
            };
            buf.resize(payload_len as usize - ReadStatus::LEN as usize, 0);
            reader.read_exact(buf).await?;
            let status = read_status_byte(reader).await?;
            // Data the source could not vouch for is not copied into the destination at all, nor is
            // data whose transfer has returned.
            let copied = source_intact(shared, status).and_then(|()| match caller.enter() {
                Some(_held) => {
                    scatter(&parts, buf)?;
                    // Within the permit: the test hook's flip is a landing too.
                    parts.iter().for_each(ferry_core::integrity::fault::landed);
                    Ok(())
                }
                None => Err(abandoned()),
            });
            match copied {
                Ok(()) => {
                    if let Some(sums) = sums {
                        sums.take(&parts);
                    }
                    commit_for_caller(&caller, &parts).await
                }
                Err(e) => Err(e),
            }
        }
        Some(ReadDest::Device { parts, caller, sums })
            if Some(parts.iter().map(|p| p.len).sum::<u64>()) == data_len =>
        {
            land_read_through_device(shared, reader, bounces, &parts, &caller, sums.as_deref()).await?
        }
        _ => {
            return Err(Error::Protocol(format!(
                "{} sent {payload_len} bytes for a read of another size",
                shared.peer
            )));
        }
    };
    let _ = pending.done.send(landed);
    Ok(())
}

/// Lands a read's data where some parts are memory whose device copies from any buffer (CUDA's)
/// through the stream's bounce buffers ([`crate::device`]), each piece's copy holding a permit of
/// the transfer's guard: none starts once it returned. As with a direct read, bytes land before the
/// status byte that vouches for them, which then decides the read's result. Errors returned break
/// the stream; the inner result is the read's.
async fn land_read_through_device(
    shared: &Shared,
    reader: &mut FrameReader,
    bounces: &mut Bounces,
    parts: &[Resolved],
    caller: &Arc<AccessGuard>,
    sums: Option<&FrameSums>,
) -> Result<Result<()>> {
    let mut summed = sums.map(|_| RunningSums::new(parts.iter().map(|p| p.len)));
    let hold = || caller.enter_owned().ok_or_else(abandoned);
    let landed = crate::device::land_pieces(reader, parts, bounces, hold, summed.as_mut()).await?;
    let status = read_status_byte(reader).await?;
    let result = source_intact(shared, status).and(landed);
    if result.is_err() {
        return Ok(result);
    }
    if let (Some(sums), Some(summed)) = (sums, summed) {
        let _ = sums.0.set(summed.finish());
    }
    // Parts of staged memory without device copies landed in their host copies.
    Ok(commit_for_caller(caller, parts).await)
}

/// Whether a direct read's data is in its region.
fn landed_in(region: &RegionEntry, landed: Landed) -> Result<()> {
    match landed {
        // A copy into a file that shrank meanwhile landed in zero pages without failing.
        Landed::Written => region.block().check_intact(),
        Landed::RegionGone => Err(region.gone()),
        Landed::Unbacked => Err(unbacked(region)),
        Landed::Abandoned => Err(abandoned()),
    }
}

/// A staged block's copy to the device of the read data that landed in `parts` (off the runtime),
/// while the transfer that asked for it still waits: none once it returned. Blocks with device
/// copies of their own took their bytes already ([`land_read_through_device`]).
async fn commit_for_caller(caller: &Arc<AccessGuard>, parts: &[Resolved]) -> Result<()> {
    let hooked = staged_in_host_copy(parts);
    if hooked.is_empty() {
        return Ok(());
    }
    let Some(held) = caller.enter_owned() else {
        return Err(abandoned());
    };
    let result = crate::blocking::commit_written(&hooked).await;
    drop(held);
    result
}

/// The result of a read whose transfer returned before the data arrived (nobody receives it).
fn abandoned() -> Error {
    Error::Timeout("the transfer returned before this read's data arrived; the data was discarded".into())
}

async fn read_status_byte(reader: &mut FrameReader) -> Result<ReadStatus> {
    let mut status = [0u8; ReadStatus::LEN as usize];
    reader.read_exact(&mut status).await?;
    ReadStatus::from_u8(status[0])
}

/// The read's error when the target says the bytes it sent are not its region's.
fn source_intact(shared: &Shared, status: ReadStatus) -> Result<()> {
    match status {
        ReadStatus::Intact => Ok(()),
        ReadStatus::RegionGone => Err(Error::PermissionDenied(format!(
            "{} deregistered the source region while this read was answered; the destination does not hold its bytes",
            shared.peer
        ))),
        ReadStatus::Unbacked => Err(Error::Io {
            kind: std::io::ErrorKind::InvalidData,
            message: format!(
                "{}'s source region lost its backing (a mapped file shrank) while this read was answered; the destination does not hold its bytes",
                shared.peer
            ),
        }),
    }
}

/// Copies a coalesced read's bytes to the local regions they belong to.
fn scatter(parts: &[Resolved], buf: &[u8]) -> Result<()> {
    let mut at = 0usize;
    let mut result = Ok(());
    for p in parts {
        let n = p.len as usize;
        if let Err(e) = p.region.copy_in(p.offset, &buf[at..at + n]) {
            result = Err(e);
        }
        at += n;
    }
    result
}

/// Ranges per checksum request: a request's body stays well inside a frame's (24 bytes a range).
const SUM_SEGMENTS_PER_FRAME: usize = 4096;

impl TcpLink {
    /// The CRC32C of each of `segments` (the peer's names of its regions) as the peer's memory holds
    /// it now, to check a transfer with integrity that did `op` there (its caller bounds it in time,
    /// by dropping the future, which takes the requests back). In requests of at most 4,096 ranges, all in flight at once, each
    /// on the least loaded stream (the target sums on each stream's task, so checks of batches in
    /// flight together are summed side by side).
    pub fn sums(&self, op: ferry_core::Op, segments: Vec<Segment>) -> BoxFuture<'static, Result<Vec<u32>>> {
        let shared = self.shared.clone();
        Box::pin(async move {
            let shared = &shared;
            let mut ops = BatchOps::new(shared);
            let mut answers = Vec::new();
            for chunk in segments.chunks(SUM_SEGMENTS_PER_FRAME) {
                let (stream, id, answer) = request_sums(shared, op, chunk.to_vec())?;
                ops.push(stream, id);
                answers.push(answer);
            }
            let mut sums = Vec::with_capacity(segments.len());
            for (answer, chunk) in answers.into_iter().zip(segments.chunks(SUM_SEGMENTS_PER_FRAME)) {
                let got = answer.await.map_err(|_| shared.closed_error())??;
                if got.len() != chunk.len() {
                    return Err(Error::Protocol(format!(
                        "{} answered a request for {} checksums with {}",
                        shared.peer,
                        chunk.len(),
                        got.len()
                    )));
                }
                sums.extend(got);
            }
            ops.finish();
            Ok(sums)
        })
    }
}

/// A checksum request on its way: the stream and id it took, and where its answer comes.
type SumsRequested = (StreamIndex, OpId, oneshot::Receiver<Result<Vec<u32>>>);

/// Sends one checksum request.
fn request_sums(shared: &Shared, op: ferry_core::Op, segments: Vec<Segment>) -> Result<SumsRequested> {
    let (tx, rx) = oneshot::channel();
    let (stream, id) = start_request(shared, None, Waiter::Sums(tx), |id| Frame::Sum {
        id: id.0,
        op,
        segments,
    })?;
    Ok((stream, id, rx))
}

/// Starts a checksum request (`waiter` keeps it) on `stream`, or the least loaded one, and queues
/// its frame. Returns the stream it took.
fn start_request(
    shared: &Shared,
    stream: Option<StreamIndex>,
    waiter: Waiter,
    frame: impl FnOnce(OpId) -> Frame,
) -> Result<(StreamIndex, OpId)> {
    let (stream, id) = shared.proto()?.start(stream, OpKind::Sum, 0, waiter)?;
    if let Err(e) = shared.send(stream, Outgoing::Frame(frame(id))) {
        let _ = shared.proto().map(|mut p| p.take(stream, id));
        return Err(e);
    }
    Ok((stream, id))
}

impl ferry_core::SetupExchange for TcpLink {
    fn exchange(&self, kind: TransportKind, blob: Vec<u8>) -> BoxFuture<'_, Result<Vec<u8>>> {
        Box::pin(async move {
            let shared = &self.shared;
            let (tx, rx) = oneshot::channel();
            let control = Some(StreamIndex::CONTROL);
            let (stream, id) = shared.proto()?.start(control, OpKind::Setup, 0, Waiter::Setup(tx))?;
            let frame = Frame::TransportSetup { id: id.0, kind, blob };
            if let Err(e) = shared.send(stream, Outgoing::Frame(frame)) {
                let _ = shared.proto().map(|mut p| p.take(stream, id));
                return Err(e);
            }
            rx.await.map_err(|_| shared.closed_error())?
        })
    }

    fn control_link(&self) -> Arc<dyn DataLink> {
        Arc::new(self.clone())
    }

    fn handle(&self) -> Option<Arc<dyn ferry_core::SetupExchange>> {
        Some(Arc::new(self.clone()))
    }
}

/// TCP reaches every region: as the control link, it declines nothing.
fn carried_whole(done: Result<()>) -> Result<Declined> {
    done.map(|()| Declined::none())
}

impl DataLink for TcpLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn transfer(&self, request: TransferRequest) -> BoxFuture<'static, Result<Declined>> {
        Box::pin(run_batch(self.shared.clone(), request).map(carried_whole))
    }

    fn checks_in_band(&self) -> bool {
        true
    }

    fn notify(&self, notification: Notification) -> BoxFuture<'static, Result<()>> {
        let shared = self.shared.clone();
        Box::pin(async move {
            notification.validate()?;
            let frame = |id: OpId| {
                Outgoing::Frame(Frame::Notify {
                    id: id.0,
                    name: notification.name,
                    msg: notification.msg,
                })
            };
            let (stream, id, rx) = shared.submit(Some(StreamIndex::CONTROL), 0, None, None, frame)?;
            let mut ops = BatchOps::new(&shared);
            ops.push(stream, id);
            let answer = rx.await.map_err(|_| shared.closed_error());
            ops.finish();
            answer?
        })
    }

    fn persist_method(&self) -> PersistMethod {
        PersistMethod::FlushBeforeAck
    }

    fn close(&self) -> BoxFuture<'static, ()> {
        let shared = self.shared.clone();
        Box::pin(async move {
            let _ = shared.send(StreamIndex::CONTROL, Outgoing::Frame(Frame::Goodbye));
            for s in &shared.streams {
                s.queued.queue();
                let _ = s.tx.send(Outgoing::Shutdown);
            }
            shared.fail_all(Error::PeerClosed(format!(
                "the link to {} was closed locally",
                shared.peer
            )));
            // Writers flush and shut down on their own; readers end when the peer closes. Give them a
            // moment, then make sure nothing lingers.
            tokio::time::sleep(Duration::from_millis(20)).await;
            if let Ok(tasks) = shared.tasks.lock() {
                for t in tasks.iter() {
                    t.abort();
                }
            }
        })
    }

    fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }
}
