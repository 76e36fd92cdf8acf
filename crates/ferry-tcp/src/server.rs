//! The target's side: accepts links, checks every operation against the region table, and moves
//! payloads between the socket and registered memory.
//!
//! The protocol's decisions are `ferry-proto`'s: which hellos open or join a link
//! ([`LinkRegistry`]), what a frame asks for on which stream ([`TargetStream`]), what each request
//! may touch and what a write or commit leaves to persist ([`serve`]), and the bounded queue of region
//! updates per link ([`AdvertQueue`]). This module only does the I/O around them.
//!
//! Each accepted stream is served by one task that reads a request, applies it and writes the answer
//! itself: no hand-off between tasks on the request path, and a peer that sends requests without
//! reading the answers stalls only its own stream (its answers wait in the kernel, not in memory).
//! Answers are flushed when no further complete request is buffered, so pipelined requests share a
//! system call. The control stream's task also sends the link's region updates.
//! A frame that fails to decode ends that stream (and, for stream 0, its link); every other link keeps
//! being served. A refused operation's payload is read and dropped, so the stream stays usable.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::codec::{Frame, Hello, Limits, ReadStatus, Segment};
use ferry_core::region::{bounce_piece, file_pieces, into_files};
use ferry_core::{
    AcceptedPath, Durability, EngineContext, Error, LinkSlot, Op, PeerIdentity, PeerView, RegionChange, RegionEntry,
    RegionKey, Resolved, Result,
};
use ferry_proto::handshake::{BEFORE_ADMISSION, refuse_anonymously};
use ferry_proto::serve::{self, Landing, Persist};
use ferry_proto::setup::MAX_PATHS_PER_LINK;
use ferry_proto::target::{ack, setup_reply, sums_reply};
use ferry_proto::{
    Admission, AdmissionLimits, AdmissionTable, AdvertQueue, Arrival, Identity, LinkLimits, LinkRegistry, LinkToken,
    OpId, Opener, Proven, Request, Sealer, SetupBudget, Stage, StreamIndex, TargetStream, Ticket, WrittenRanges,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, oneshot, watch};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::blocking::{
    Bounces, OVERLAP_PIECE, Writer, bytes_of, copied, from_device, overlap_pieces, staged_in_host_copy, through_device,
};
use crate::io::{Conn, FrameReader, FrameWriter, Landed, access_error};
use crate::tls::{Session, TLS_HANDSHAKE_RECORD, TlsConfig};

/// Most streams one link may open.
pub const MAX_STREAMS_PER_LINK: u16 = 64;

/// How the server behaves.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Decoder limits.
    pub limits: Limits,
    /// How long a new connection may take to authenticate (when TLS is on) and say hello; past it
    /// the connection is closed.
    pub handshake_timeout: Duration,
    /// How long a new connection may stay silent before it sends its first byte (bounded by
    /// `handshake_timeout` too); past it the connection is closed. A peer sends its first bytes as
    /// soon as it connects, so this can be short.
    pub first_bytes_timeout: Duration,
    /// How many connections may wait to be admitted (authenticating, or yet to say hello), and how
    /// many of them from one source address. A newcomer that finds no room displaces the waiting
    /// connection that has shown least, oldest first, never one that has authenticated (see
    /// [`ferry_proto::admission`]): a flood of idle connections costs a bounded amount, cannot hold the
    /// engine's link slots, and cannot keep a peer that handshakes promptly out.
    pub admission: AdmissionLimits,
    /// The protocol's limits per link.
    pub link_limits: LinkLimits,
    /// Mutual TLS: when set, only authenticated links are admitted (see [`TlsConfig`]).
    pub tls: Option<TlsConfig>,
    /// A connection whose sent data waits this long unacknowledged (a dead peer, or one that stopped
    /// reading) is closed by the kernel; idle connections are probed so that dead ones end too.
    pub send_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            limits: Limits::default(),
            handshake_timeout: Duration::from_secs(10),
            first_bytes_timeout: Duration::from_secs(2),
            admission: AdmissionLimits::default(),
            link_limits: LinkLimits {
                max_streams: MAX_STREAMS_PER_LINK,
                ..LinkLimits::default()
            },
            tls: None,
            send_timeout: crate::io::DEFAULT_SEND_TIMEOUT,
        }
    }
}

struct AcceptedLink {
    id: u64,
    peer_engine: u64,
    /// Who the peer proved to be (on an authenticated link), and the names it knows regions by.
    view: Arc<PeerView>,
    adverts: Mutex<AdvertQueue>,
    adverts_due: Notify,
    /// How many of the changes pushed to `adverts` the control stream has sent (see
    /// [`AdvertQueue::pushed`]).
    adverts_sent: watch::Sender<u64>,
    streams: Mutex<Vec<AbortHandle>>,
    /// Other data paths set up for this link (an RDMA queue pair), dropped with it.
    data_paths: Mutex<Vec<Box<dyn AcceptedPath>>>,
    /// How many more data paths the link may set up now.
    setups: Mutex<SetupBudget>,
    _slot: LinkSlot,
}

impl AcceptedLink {
    fn identity(&self) -> Option<&PeerIdentity> {
        self.view.identity()
    }

    /// The update that tells the peer what it may now do in `region` (its advert, or its removal
    /// where it may do nothing, which also ends the peer's per-transport access to it).
    fn change_for(&self, region: &RegionEntry) -> RegionChange {
        match self.view.advert(region) {
            Some(ad) => RegionChange::Added(ad),
            None => RegionChange::Removed(self.view.forget(region.key())),
        }
    }

    /// Queues a region update for the control stream; returns the queue's count of pushed changes.
    fn push_advert(&self, change: &RegionChange) -> u64 {
        let pushed = match self.adverts.lock() {
            Ok(mut q) => {
                q.push(change);
                q.pushed()
            }
            Err(_) => 0,
        };
        self.adverts_due.notify_one();
        pushed
    }
}

/// An accepted link whose peer lost some access to a region (see [`TcpServer::narrowed_links`]).
pub struct NarrowedLink {
    link: Arc<AcceptedLink>,
    shared: Arc<Shared>,
}

impl NarrowedLink {
    /// The link's remote operations in progress.
    pub fn accesses(&self) -> &Arc<ferry_core::AccessEpochs> {
        self.link.view.accesses()
    }

    /// Closes the link: its streams' tasks are aborted (an operation in the middle of its payload
    /// moves no further byte) and its other data paths dropped.
    pub fn close(&self) {
        tracing::warn!(
            link = self.link.id,
            peer = self.link.identity().map_or("", |i| i.name.as_str()),
            "closing a link whose operations under a revoked grant did not end in time"
        );
        close_link(&self.shared, &self.link);
    }
}

/// Region updates queued on some links, until their control streams have sent them.
pub struct AdvertsSent(Vec<(watch::Receiver<u64>, u64)>);

impl AdvertsSent {
    /// Waits until every link has sent its update (a link that closed meanwhile counts as done).
    pub async fn wait(mut self) {
        for (sent, pushed) in &mut self.0 {
            let _ = sent.wait_for(|n| *n >= *pushed).await;
        }
    }
}

struct Shared {
    ctx: Arc<EngineContext>,
    config: ServerConfig,
    links: Mutex<LinkRegistry<Arc<AcceptedLink>>>,
    next_link: AtomicU64,
    /// Connections not yet admitted (see [`ServerConfig::admission`]); each entry's sender closes
    /// its connection when it is evicted.
    admission: Mutex<AdmissionTable<oneshot::Sender<()>>>,
}

/// A listening TCP endpoint serving remote operations on the engine's regions.
pub struct TcpServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    accept: AbortHandle,
}

impl std::fmt::Debug for TcpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpServer")
            .field("local_addr", &self.local_addr)
            .finish()
    }
}

impl TcpServer {
    /// Binds `addr` and starts accepting.
    pub async fn bind(addr: SocketAddr, ctx: Arc<EngineContext>, config: ServerConfig) -> Result<TcpServer> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::io(format_args!("listening on {addr}"), e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the bound address", e))?;
        let links = match &config.tls {
            Some(tls) => LinkRegistry::authenticating(config.link_limits).requiring(tls.protection()),
            None => LinkRegistry::new(config.link_limits),
        };
        let shared = Arc::new(Shared {
            ctx,
            links: Mutex::new(links),
            admission: Mutex::new(AdmissionTable::new(config.admission)),
            config,
            next_link: AtomicU64::new(1),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone())).abort_handle();
        tracing::info!(%local_addr, "listening");
        Ok(TcpServer {
            local_addr,
            shared,
            accept,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Number of accepted links.
    pub fn link_count(&self) -> usize {
        self.shared.links.lock().map(|l| l.len()).unwrap_or(0)
    }

    /// Tells every accepted link whose peer may reach `region` (every link, on an open engine) that it
    /// was registered (`added`) or deregistered. A peer never granted it hears of it neither way.
    pub fn announce(&self, region: &RegionEntry, added: bool) {
        for link in self.links() {
            if region.access_for(link.identity()).is_none() {
                continue;
            }
            let change = match added {
                true => link.change_for(region),
                false => RegionChange::Removed(link.view.forget(region.key())),
            };
            link.push_advert(&change);
        }
    }

    /// Tells the links of the peers whose access to `key` changed from what `before` (the region's
    /// grants before the change) gave them what they may now do there (the region, with their access;
    /// or its removal). Returns a wait that ends once every one of them has sent it (or closed).
    pub fn regranted(&self, key: RegionKey, before: &ferry_core::Grants) -> AdvertsSent {
        let Some(entry) = self.shared.ctx.regions.read().ok().and_then(|t| t.get(key).cloned()) else {
            return AdvertsSent(Vec::new());
        };
        let mut waits = Vec::new();
        for link in self.links() {
            let Some(who) = link.identity() else { continue };
            if entry.access_under(before, who) == entry.access_for(Some(who)) {
                continue;
            }
            let change = link.change_for(&entry);
            let pushed = link.push_advert(&change);
            waits.push((link.adverts_sent.subscribe(), pushed));
        }
        AdvertsSent(waits)
    }

    /// The accepted links whose peer may now do less in `region` than `before` (its grants before a
    /// change) let it: what a revoke waits for, and closes if what runs under the old grant does not
    /// end by itself.
    pub fn narrowed_links(&self, region: &RegionEntry, before: &ferry_core::Grants) -> Vec<NarrowedLink> {
        self.links()
            .into_iter()
            .filter(|link| {
                link.identity()
                    .is_some_and(|who| !region.access_for(Some(who)).contains(region.access_under(before, who)))
            })
            .map(|link| NarrowedLink {
                link,
                shared: self.shared.clone(),
            })
            .collect()
    }

    fn links(&self) -> Vec<Arc<AcceptedLink>> {
        self.shared
            .links
            .lock()
            .map(|l| l.links().cloned().collect())
            .unwrap_or_default()
    }

    /// Stops accepting and closes every accepted link.
    pub fn shutdown(&self) {
        self.accept.abort();
        let links = self.shared.links.lock().map(|mut l| l.drain()).unwrap_or_default();
        for link in links {
            close_link(&self.shared, &link);
        }
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn close_link(shared: &Shared, link: &AcceptedLink) {
    if let Ok(streams) = link.streams.lock() {
        for s in streams.iter() {
            s.abort();
        }
    }
    // Region updates still queued go nowhere now: whoever waits for them to be sent stops waiting.
    link.adverts_sent.send_replace(u64::MAX);
    if let Ok(mut paths) = link.data_paths.lock() {
        for p in paths.drain(..) {
            tracing::debug!(link = link.id, transport = %p.kind(), "data path closed with its link");
        }
    }
    shared.ctx.notifier.link_closed(link.id);
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let (evict, evicted) = oneshot::channel();
                let Some(place) = Place::take(&shared, peer, evict) else {
                    tracing::debug!(%peer, "every connection awaiting admission has authenticated; closing this one");
                    continue;
                };
                let shared = shared.clone();
                tokio::spawn(async move {
                    // Only an eviction sends; a place left normally drops the sender, which must
                    // not end the (by then admitted) stream.
                    let evicted = async {
                        if evicted.await.is_err() {
                            std::future::pending::<()>().await;
                        }
                    };
                    tokio::select! {
                        result = serve_stream(stream, peer, shared, place) => {
                            if let Err(e) = result {
                                tracing::debug!(%peer, error = %e, "stream ended");
                            }
                        }
                        () = evicted => tracing::debug!(%peer, "closed unadmitted to make room for a newer connection"),
                    }
                });
            }
            Err(e) => {
                // Out of descriptors or similar: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// What the peer of the link `id` sees: on an authenticated link, its identity, per-link names and the
/// per-peer state of each transport that keeps one (see [`PeerView`]).
fn peer_view(ctx: &EngineContext, id: u64, session: Option<&Session>) -> Result<PeerView> {
    let Some(session) = session else {
        return Ok(PeerView::open());
    };
    let mut scopes = Vec::new();
    for transport in &ctx.acceptors {
        scopes.extend(transport.peer_scope(id)?);
    }
    Ok(PeerView::authenticated(
        session.identity.clone(),
        ctx.peer_names.clone(),
        scopes,
    ))
}

fn identity(ctx: &EngineContext) -> Identity {
    Identity {
        engine_id: ctx.engine_id,
        host_id: ctx.host_id,
        transports: ctx.transports.clone(),
    }
}

/// A connection's place among those awaiting admission (see [`ServerConfig::admission`]), given
/// up when it is dropped.
struct Place {
    shared: Arc<Shared>,
    /// `None` once given up.
    ticket: Option<Ticket>,
}

impl Place {
    /// A place for the connection from `peer`, displacing another if need be (whose sender is told);
    /// `None` if there is no room.
    fn take(shared: &Arc<Shared>, peer: SocketAddr, evict: oneshot::Sender<()>) -> Option<Place> {
        let mut table = shared.admission.lock().ok()?;
        match table.arrive(peer.ip(), evict) {
            Arrival::Placed { ticket, evicted } => {
                if let Some(evicted) = evicted {
                    let _ = evicted.send(());
                }
                Some(Place {
                    shared: shared.clone(),
                    ticket: Some(ticket),
                })
            }
            Arrival::Refused => None,
        }
    }

    fn progress(&self, stage: Stage) {
        if let (Some(ticket), Ok(mut table)) = (self.ticket, self.shared.admission.lock()) {
            table.progress(ticket, stage);
        }
    }

    /// Gives the place up before admission; false if it had been taken away (the connection was
    /// evicted, and is about to be closed).
    fn leave(mut self) -> bool {
        self.give_up()
    }

    fn give_up(&mut self) -> bool {
        let Some(ticket) = self.ticket.take() else { return false };
        self.shared.admission.lock().is_ok_and(|mut table| table.leave(ticket))
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.give_up();
    }
}

/// Waits for the connection's first bytes by `first_deadline`, then authenticates it when the engine
/// requires it and the peer opens with TLS (a stream that opens with a plain hello stays plain and
/// must prove itself by its join proof). Tells `place` how far it came.
async fn open_conn(
    stream: TcpStream,
    peer: SocketAddr,
    tls: Option<&TlsConfig>,
    place: &Place,
    first_deadline: Instant,
) -> Result<(Conn, Option<Session>)> {
    let mut first = [0u8; 1];
    let n = tokio::time::timeout_at(first_deadline, stream.peek(&mut first))
        .await
        .map_err(|_| Error::Timeout(format!("{peer} sent nothing in time")))?
        .map_err(|e| Error::io(format_args!("reading from {peer}"), e))?;
    place.progress(Stage::Handshaking);
    let Some(tls) = tls.filter(|_| n > 0 && first[0] == TLS_HANDSHAKE_RECORD) else {
        return Ok((Conn::Plain(stream), None));
    };
    let (tls, session) = tls.accept(stream, peer).await?;
    place.progress(Stage::Authenticated);
    Ok((Conn::Tls(Box::new(tls)), Some(session)))
}

/// Reads the hello by `deadline`; `None` if the peer closed first.
async fn read_hello(reader: &mut FrameReader, peer: SocketAddr, deadline: Instant) -> Result<Option<Hello>> {
    match tokio::time::timeout_at(deadline, reader.next()).await {
        Err(_) => Err(Error::Timeout(format!("{peer} did not say hello in time"))),
        Ok(Ok(Some(d))) => match d.frame {
            Frame::Hello(h) => Ok(Some(h)),
            other => Err(Error::Protocol(format!(
                "{peer} opened with {other:?} instead of a hello"
            ))),
        },
        Ok(Ok(None)) => Ok(None),
        Ok(Err(e)) => Err(e),
    }
}

/// A stream's link, and the target's ends of its record layer when its bytes are protected.
type Admitted = (Arc<AcceptedLink>, Option<Box<(Sealer, Opener)>>);

/// Decides on `hello` and answers it: the link the stream belongs to, or the refusal that was sent.
/// `session` is what the stream's own TLS handshake established, if it had one.
fn admit(
    shared: &Shared,
    hello: &Hello,
    session: Option<&Session>,
    writer: &mut FrameWriter,
) -> Result<std::result::Result<Admitted, Error>> {
    let ctx = &shared.ctx;
    let me = identity(ctx);
    let mut links = shared
        .links
        .lock()
        .map_err(|_| Error::Internal("link table lock poisoned".into()))?;
    let proven = session.map(|s| Proven {
        join_key: s.join_key.clone(),
        identity: s.identity.name.clone(),
    });
    let admitted = match links.admit(hello, proven.as_ref()) {
        Ok(Admission::Join(link, sealing)) => Ok((link, Vec::new(), sealing)),
        Ok(Admission::Open) => ctx.incoming.acquire().and_then(|slot| {
            let id = shared.next_link.fetch_add(1, Ordering::Relaxed);
            let link = Arc::new(AcceptedLink {
                id,
                peer_engine: hello.engine_id,
                view: Arc::new(peer_view(ctx, id, session)?),
                adverts: Mutex::new(AdvertQueue::new(shared.config.link_limits.advert_queue)),
                adverts_due: Notify::new(),
                adverts_sent: watch::Sender::new(0),
                streams: Mutex::new(Vec::new()),
                data_paths: Mutex::new(Vec::new()),
                setups: Mutex::new(SetupBudget::new(std::time::Instant::now())),
                _slot: slot,
            });
            // Under the registry's lock, so no update announced meanwhile is missed: it is either
            // in this table or queued for the link.
            let regions = ctx.regions.read().map(|t| link.view.adverts(&t)).unwrap_or_default();
            links.open(hello, link.clone(), proven.as_ref())?;
            Ok((link, regions, None))
        }),
        Err(e) => Err(e),
    };
    Ok(match admitted {
        Ok((link, regions, sealing)) => {
            writer.push(&Frame::HelloAck(me.accept(regions)), 0)?;
            Ok((link, sealing))
        }
        Err(e) => {
            // On an engine that authenticates, a refused stream learns nothing about it.
            let refusal = match links.is_authenticating() {
                true => refuse_anonymously(&e),
                false => me.refuse(&e),
            };
            writer.push(&Frame::HelloAck(refusal), 0)?;
            Err(e)
        }
    })
}

/// Serves one accepted connection: its first bytes by the first-bytes deadline, authentication and
/// hello by the handshake deadline (holding `place` among the connections awaiting admission), then
/// its requests.
async fn serve_stream(stream: TcpStream, peer: SocketAddr, shared: Arc<Shared>, place: Place) -> Result<()> {
    crate::io::configure(&stream, shared.config.send_timeout)?;
    let now = Instant::now();
    let deadline = now + shared.config.handshake_timeout;
    let first_deadline = deadline.min(now + shared.config.first_bytes_timeout);
    let opening = open_conn(stream, peer, shared.config.tls.as_ref(), &place, first_deadline);
    let (conn, session) = tokio::time::timeout_at(deadline, opening)
        .await
        .map_err(|_| Error::Timeout(format!("{peer} did not authenticate in time")))??;
    let (r, w) = conn.split();
    let mut reader = FrameReader::before_admission(r, BEFORE_ADMISSION, peer.to_string());
    let mut writer = FrameWriter::new(w, peer.to_string());
    let Some(hello) = read_hello(&mut reader, peer, deadline).await? else {
        return Ok(());
    };
    // Leaving under the table's lock decides a race with an eviction: an evicted stream is not
    // admitted, and one that left is no longer evicted.
    if !place.leave() {
        return Ok(());
    }
    let admitted = admit(&shared, &hello, session.as_ref(), &mut writer)?;
    let (link, sealing) = match admitted {
        Ok(admitted) => admitted,
        Err(e) => {
            // Anyone can make an engine refuse an unauthenticated stream: at a rate worth no warning.
            match session {
                None if shared.config.tls.is_some() => tracing::debug!(%peer, error = %e, "stream refused"),
                _ => tracing::warn!(%peer, error = %e, "stream refused"),
            }
            writer.flush().await?;
            return Ok(());
        }
    };
    writer.flush().await?;
    reader.admitted(shared.config.limits);
    // Everything after the answer to the hello goes in records, when the stream is protected.
    let (reader, writer) = match sealing {
        Some(sealing) => {
            let (sealer, opener) = *sealing;
            (reader.sealed(opener)?, writer.sealed(sealer)?)
        }
        None => (reader, writer),
    };
    let index = StreamIndex(hello.stream_index);
    if index.is_control() {
        let identity = link.identity().map(|i| i.name.as_str()).unwrap_or("unauthenticated");
        tracing::info!(%peer, engine = format_args!("{:016x}", hello.engine_id), streams = hello.stream_count, identity, "link accepted");
    }
    let stream = TargetStream::new(index, peer.to_string());
    let serving = serve_requests(shared.clone(), link.clone(), stream, reader, writer);
    // Closing the link aborts every stream's task through these handles.
    let task = tokio::spawn(serving);
    if let Ok(mut s) = link.streams.lock() {
        s.push(task.abort_handle());
    }
    let result = task
        .await
        .unwrap_or_else(|e| Err(Error::PeerClosed(format!("{peer}: stream task ended: {e}"))));
    if index.is_control() {
        let removed = shared
            .links
            .lock()
            .ok()
            .and_then(|mut l| l.close(LinkToken(hello.link_token)));
        if let Some(link) = removed {
            close_link(&shared, &link);
        }
        tracing::info!(%peer, "link closed");
    }
    result
}

/// Moves the link's due region updates into the control stream's writer; returns how many changes
/// that covers (see [`AdvertQueue::pushed`]).
fn push_adverts(ctx: &EngineContext, link: &AcceptedLink, writer: &mut FrameWriter) -> Result<u64> {
    let mut q = link
        .adverts
        .lock()
        .map_err(|_| Error::Internal("region update queue lock poisoned".into()))?;
    let view = &link.view;
    while let Some(frame) = q.poll_transmit(|| ctx.regions.read().map(|t| view.adverts(&t)).unwrap_or_default()) {
        writer.push(&frame, 0)?;
    }
    Ok(q.pushed())
}

/// Serves one stream until it ends: reads a request, applies it, queues the answer. Over 80 lines:
/// one arm per request kind, each a call or two; splitting the match would only hide it.
async fn serve_requests(
    shared: Arc<Shared>,
    link: Arc<AcceptedLink>,
    stream: TargetStream,
    mut reader: FrameReader,
    mut writer: FrameWriter,
) -> Result<()> {
    let ctx = &shared.ctx;
    let control = stream.is_control();
    let max_unsent = shared.config.link_limits.max_unsent_answers;
    // What this stream wrote into persistent regions and no commit has persisted yet.
    let mut written = WrittenRanges::default();
    // What writes into files pass through (see `land_in_files`), kept for the stream.
    let mut bounces = Bounces::default();
    loop {
        // Answer what is already in hand before waiting for more.
        if !reader.has_frame() {
            writer.flush().await?;
        }
        let next = match control {
            true => tokio::select! {
                biased;
                () = link.adverts_due.notified() => {
                    let pushed = push_adverts(ctx, &link, &mut writer)?;
                    writer.flush().await?;
                    link.adverts_sent.send_replace(pushed);
                    continue;
                }
                next = reader.next() => next?,
            },
            false => reader.next().await?,
        };
        let Some(decoded) = next else { return Ok(()) };
        // Counted from before its grant check until it is answered, for revokes to wait out.
        let _in_progress = link.view.accesses().begin();
        let who = &*link.view;
        let answer = match stream.request(decoded)? {
            Request::Write {
                id,
                key,
                offset,
                durability,
                payload_len,
            } => {
                let seg = Segment {
                    key,
                    offset,
                    len: payload_len,
                };
                let write = (id, &[seg][..], payload_len, durability);
                serve_write(ctx, who, &mut reader, &mut written, &mut bounces, write).await?
            }
            Request::WriteBatch {
                id,
                durability,
                segments,
                payload_len,
            } => {
                let write = (id, &segments[..], payload_len, durability);
                serve_write(ctx, who, &mut reader, &mut written, &mut bounces, write).await?
            }
            Request::Commit {
                id,
                durability,
                segments,
            } => {
                // A link with another data path (RDMA) also commits what that path wrote, which this
                // stream never saw: its commits are taken as they come.
                let bypassed = link.data_paths.lock().map_or(true, |p| !p.is_empty());
                let writer = match bypassed {
                    true => Writer::Any,
                    false => Writer::Cpu,
                };
                let result = match serve::commit(ctx, who, &mut written, bypassed, &segments, durability) {
                    Ok(parts) => persist(&parts, durability, writer).await,
                    Err(e) => Err(e),
                };
                ack(id, &result)
            }
            Request::Read { id, segments } => {
                match resolve_reads(ctx, who, &segments, shared.config.limits.max_payload, &mut bounces).await {
                    Ok(read) => {
                        let sent = send_read(&mut writer, id, read, &mut bounces).await?;
                        ctx.served.count(ferry_core::Op::Read, sent);
                        flush_past(&mut writer, max_unsent).await?;
                        continue;
                    }
                    Err(e) => ack(id, &Err(e)),
                }
            }
            Request::Notify { id, notification } => {
                let result = notification.validate().and_then(|()| {
                    ctx.notifier
                        .deliver(link.id, link.peer_engine, reader.peer(), link.identity(), notification)
                });
                ack(id, &result)
            }
            Request::Ping { nonce } => Frame::Pong { nonce },
            Request::Setup { id, kind, blob } => {
                setup_reply(id, serve_setup(&shared, &link, reader.peer(), kind, &blob))
            }
            Request::Sum { id, op, segments } => sums_reply(id, serve_sums(ctx, who, op, &segments).await),
            Request::Goodbye => {
                writer.shutdown().await;
                return Ok(());
            }
        };
        writer.push(&answer, 0)?;
        flush_past(&mut writer, max_unsent).await?;
    }
}

/// Sends the queued answers once they reach `max_unsent` bytes, waiting for the peer to take them:
/// how a stream's answers stay bounded when its peer pipelines requests and reads nothing.
async fn flush_past(writer: &mut FrameWriter, max_unsent: usize) -> Result<()> {
    if writer.queued() >= max_unsent {
        writer.flush().await?;
    }
    Ok(())
}

/// Lands a write's payload (operation `id` on `segments`, `payload_len` bytes, with `durability`) in
/// the regions its segments name, persisting it if asked; notes what a completed write put in a
/// persistent region in `written`, for a later commit. Returns the answer to send; an error breaks the
/// stream.
async fn serve_write(
    ctx: &EngineContext,
    who: &PeerView,
    reader: &mut FrameReader,
    written: &mut WrittenRanges,
    bounces: &mut Bounces,
    (id, segments, payload_len, durability): (OpId, &[Segment], u64, Durability),
) -> Result<Frame> {
    let result = match serve::write(ctx, who, segments, payload_len, durability) {
        Landing::Land(parts) => {
            let landed = match (into_files(&parts, durability), through_device(&parts)) {
                (true, _) => land_in_files(reader, &parts, bounces.first()).await?,
                (false, true) => land_through_device(reader, &parts, bounces).await?,
                (false, false) => land(reader, &parts).await?,
            };
            match landed {
                // The stream's own copies wrote every byte.
                Ok(()) => match serve::landed(ctx, who, written, segments, &parts, durability) {
                    Persist::Parts => persist(&parts, durability, Writer::Cpu).await,
                    Persist::Spilled(spilled) => persist(&spilled, Durability::Persistent, Writer::Cpu).await,
                },
                Err(e) => Err(e),
            }
        }
        Landing::Refuse { error, discard } => {
            reader.discard(discard).await?;
            Err(error)
        }
    };
    if result.is_ok() {
        ctx.served.count(ferry_core::Op::Write, payload_len);
    }
    Ok(ack(id, &result))
}

/// Sets up another data path for the link: the transport's answer to send back.
fn serve_setup(
    shared: &Arc<Shared>,
    link: &AcceptedLink,
    peer: &str,
    kind: ferry_core::TransportKind,
    blob: &[u8],
) -> Result<Vec<u8>> {
    let ctx = &shared.ctx;
    let transport = ctx
        .acceptors
        .iter()
        .find(|t| t.kind() == kind)
        .ok_or_else(|| Error::Unsupported(format!("this engine has no usable {kind} transport")))?;
    link.setups
        .lock()
        .map_err(|_| Error::Internal("setup budget lock poisoned".into()))?
        .spend(std::time::Instant::now())?;
    let (blob, path) = transport.accept(ferry_core::AcceptSetup {
        link: link.id,
        blob,
        notifier: ctx.notifier.clone(),
        peer_engine: link.peer_engine,
        peer_addr: peer,
        peer: &link.view,
        context: Arc::downgrade(&shared.ctx),
    })?;
    let mut paths = link
        .data_paths
        .lock()
        .map_err(|_| Error::Internal("data path table lock poisoned".into()))?;
    keep_one_per_kind(&mut paths, path)?;
    tracing::info!(%peer, transport = %kind, "data path set up");
    Ok(blob)
}

/// Adds a link's new data path, dropping (and so closing) an older one of the same kind and lane: an
/// initiator sets a path up again when its old one failed, and however often a peer asks, a link
/// holds at most one path per transport and lane, and at most [`MAX_PATHS_PER_LINK`] in all (a path
/// past that is dropped, and the setup refused).
fn keep_one_per_kind(paths: &mut Vec<Box<dyn AcceptedPath>>, path: Box<dyn AcceptedPath>) -> Result<()> {
    paths.retain(|p| p.kind() != path.kind() || p.lane() != path.lane());
    if paths.len() >= MAX_PATHS_PER_LINK {
        return Err(Error::ResourceExhausted(format!(
            "this link has {MAX_PATHS_PER_LINK} data paths already; a link keeps no more"
        )));
    }
    paths.push(path);
    Ok(())
}

/// Answers a read: the header, then each part straight from its region, then the status byte that
/// says whether those bytes are the regions' (see [`ReadStatus`]).
async fn send_read_data(writer: &mut FrameWriter, id: OpId, parts: &[Resolved]) -> Result<()> {
    let total: u64 = parts.iter().map(|p| p.len).sum();
    writer.push(&Frame::ReadData { id: id.0 }, total + ReadStatus::LEN)?;
    let copied = if total <= 16 << 10 {
        let mut copied = true;
        for p in parts {
            copied &= writer.push_region(&p.region, p.offset, p.len as usize);
        }
        copied
    } else {
        writer.write_parts(parts).await?
    };
    end_read(writer, read_status(parts, copied));
    Ok(())
}

/// Ends a read's payload with its status byte, saying in the log why a read failed.
fn end_read(writer: &mut FrameWriter, status: ReadStatus) {
    if status != ReadStatus::Intact {
        tracing::warn!(
            ?status,
            "the bytes a read sent are not all the region's: the read is reported as failed"
        );
    }
    writer.push_bytes(&[status as u8]);
}

/// Whether the bytes just sent for `parts` are the regions': `copied` is false when a copy was cut
/// short (the region's access guard closed, or the kernel could not read its memory).
fn read_status(parts: &[Resolved], copied: bool) -> ReadStatus {
    if !copied {
        return match parts.iter().any(|p| p.region.guard().is_closed()) {
            true => ReadStatus::RegionGone,
            false => ReadStatus::Unbacked,
        };
    }
    // A copy out of a file that shrank meanwhile read zero pages without failing.
    match parts.iter().all(|p| p.region.block().check_intact().is_ok()) {
        true => ReadStatus::Intact,
        false => ReadStatus::Unbacked,
    }
}

/// The memory a read sends, and how its staged memory is brought from the device.
enum ReadParts {
    /// Every device copy made: the parts are sent as they are.
    Prepared(Vec<Resolved>),
    /// A large read of staged memory, in [`overlap_pieces`]: the first piece's device copies made,
    /// each later piece's to be made while the piece before it is sent.
    Overlapped(Vec<Resolved>, Vec<Vec<Resolved>>),
    /// A read some of whose memory its device copies into any buffer ([`through_device`]), in pieces: the
    /// first piece's bytes copied into the buffer given, each later piece's to be copied into a
    /// stream's bounce buffer while the piece before it is sent.
    Device(Vec<Resolved>, Vec<Vec<Resolved>>, Vec<u8>),
}

/// Answers a read the way its memory is brought from the device; the bytes it sent.
async fn send_read(writer: &mut FrameWriter, id: OpId, read: ReadParts, bounces: &mut Bounces) -> Result<u64> {
    let parts = match read {
        ReadParts::Prepared(parts) => {
            send_read_data(writer, id, &parts).await?;
            parts
        }
        ReadParts::Overlapped(parts, pieces) => {
            send_read_overlapped(writer, id, &parts, &pieces).await?;
            parts
        }
        ReadParts::Device(parts, pieces, first) => {
            send_read_through_device(writer, id, &parts, &pieces, first, bounces).await?;
            parts
        }
    };
    Ok(parts.iter().map(|p| p.len).sum())
}

/// The memory a read sends (see [`serve::read`]), a staged block's device copies made first (of
/// the first piece only, for a read whose copies overlap its sending). A failed copy here is the
/// read's error, answered before any byte is sent.
async fn resolve_reads(
    ctx: &EngineContext,
    who: &PeerView,
    segments: &[Segment],
    max_payload: u64,
    bounces: &mut Bounces,
) -> Result<ReadParts> {
    let parts = serve::read(ctx, who, segments, max_payload)?;
    if through_device(&parts) {
        // Staged parts without device copies of their own are read from their host copies.
        crate::blocking::prepare_read(&staged_in_host_copy(&parts)).await?;
        let pieces = crate::blocking::pieces(&parts, OVERLAP_PIECE);
        let (buf, first) = copied(from_device(pieces[0].clone(), bounces.take(bytes_of(&pieces[0]))).await);
        if let Err(e) = first {
            bounces.give(buf);
            return Err(e);
        }
        return Ok(ReadParts::Device(parts, pieces, buf));
    }
    // A staged block's device copies: off the runtime, under a permit.
    match overlap_pieces(&parts, OVERLAP_PIECE) {
        None => {
            crate::blocking::prepare_read(&parts).await?;
            Ok(ReadParts::Prepared(parts))
        }
        Some(pieces) => {
            crate::blocking::prepare_read(&pieces[0]).await?;
            Ok(ReadParts::Overlapped(parts, pieces))
        }
    }
}

/// Answers a read of staged memory piece by piece, as [`send_read_data`] answers any read, each
/// piece's copies from the device made while the piece before it is sent (the first piece's were
/// made already). A copy that fails once the header is out cannot be the read's error any more: the
/// rest of the payload goes out as zeros and the status says that the bytes are not the region's
/// ([`ReadStatus::Unbacked`]), which fails the read at the initiator.
async fn send_read_overlapped(
    writer: &mut FrameWriter,
    id: OpId,
    parts: &[Resolved],
    pieces: &[Vec<Resolved>],
) -> Result<()> {
    let total: u64 = parts.iter().map(|p| p.len).sum();
    writer.push(&Frame::ReadData { id: id.0 }, total + ReadStatus::LEN)?;
    let mut copied = true;
    let mut failed = None;
    for (k, piece) in pieces.iter().enumerate() {
        if failed.is_some() {
            writer.send_zeros(piece.iter().map(|p| p.len).sum()).await?;
            continue;
        }
        let sent = match pieces.get(k + 1) {
            Some(next) => {
                let (sent, prepared) = tokio::join!(writer.write_parts(piece), crate::blocking::prepare_read(next));
                failed = prepared.err();
                sent?
            }
            None => writer.write_parts(piece).await?,
        };
        copied &= sent;
    }
    let status = match failed {
        Some(e) => {
            tracing::warn!(error = %e, "a copy from the device failed while a read was sent");
            ReadStatus::Unbacked
        }
        None => read_status(parts, copied),
    };
    end_read(writer, status);
    Ok(())
}

/// Answers a read of memory whose devices copy into any buffer ([`ReadParts::Device`]) through
/// the stream's bounce buffers ([`crate::device`]). A copy that fails once the header is out fails
/// the read by its status, as in [`send_read_overlapped`].
async fn send_read_through_device(
    writer: &mut FrameWriter,
    id: OpId,
    parts: &[Resolved],
    pieces: &[Vec<Resolved>],
    first: Vec<u8>,
    bounces: &mut Bounces,
) -> Result<()> {
    let total: u64 = parts.iter().map(|p| p.len).sum();
    writer.push(&Frame::ReadData { id: id.0 }, total + ReadStatus::LEN)?;
    let status = match crate::device::send_pieces(writer, pieces, first, bounces, None).await? {
        Ok(()) => read_status(parts, true),
        Err(_) => ReadStatus::Unbacked,
    };
    end_read(writer, status);
    Ok(())
}

/// The CRC32C of each range a transfer with integrity wrote or read here, as memory holds it now (for
/// memory staged in front of a device, after a copy from the device); see [`serve::sums`].
async fn serve_sums(ctx: &EngineContext, who: &PeerView, op: Op, segments: &[Segment]) -> Result<Vec<u32>> {
    let parts = serve::sums(ctx, who, op, segments)?;
    if op == Op::Write {
        // A path that bypasses this engine's CPU (RDMA) landed the bytes without a hook of its own.
        parts.iter().for_each(ferry_core::integrity::fault::landed);
    }
    // Blocks with device copies of their own are summed past their host copies.
    crate::blocking::prepare_read(&staged_in_host_copy(&parts)).await?;
    crate::blocking::sums(parts).await
}

/// Reads a write's payload into the resolved `parts` and commits them (a staged block's device
/// copy). The outer error breaks the stream; the inner result is the operation's.
async fn land(reader: &mut FrameReader, parts: &[Resolved]) -> Result<Result<()>> {
    if let Some(pieces) = overlap_pieces(parts, OVERLAP_PIECE) {
        return land_overlapped(reader, &pieces).await;
    }
    // A target's copies have no caller guard, so only `Written` means the bytes are in.
    if reader.read_parts(parts, None).await? != Landed::Written {
        return Ok(Err(access_error(parts)));
    }
    parts.iter().for_each(ferry_core::integrity::fault::landed);
    // A staged block's device copies: off the runtime, under a permit.
    Ok(crate::blocking::commit_written(parts).await)
}

/// [`land`] for a large write into staged memory, in [`overlap_pieces`]: each piece's copies to
/// the device run while the next piece arrives, so that the device's copies and the network's
/// overlap instead of following each other. Every piece that landed is committed, whatever happens
/// to the others, before this returns: the write is acknowledged only after the last copy. Once a
/// piece does not land (its region deregistered, its memory unbacked), the rest of the payload is
/// read and dropped.
async fn land_overlapped(reader: &mut FrameReader, pieces: &[Vec<Resolved>]) -> Result<Result<()>> {
    let mut result = Ok(());
    let mut committing: Option<&[Resolved]> = None;
    for (k, piece) in pieces.iter().enumerate() {
        let (landed, committed) = match committing.take() {
            Some(before) => tokio::join!(reader.read_parts(piece, None), crate::blocking::commit_written(before)),
            None => (reader.read_parts(piece, None).await, Ok(())),
        };
        if result.is_ok() {
            result = committed;
        }
        // A target's copies have no caller guard, so only `Written` means the bytes are in.
        if landed? != Landed::Written {
            let rest: u64 = pieces[k + 1..].iter().flatten().map(|p| p.len).sum();
            reader.discard(rest).await?;
            return Ok(Err(access_error(piece)));
        }
        piece.iter().for_each(ferry_core::integrity::fault::landed);
        committing = Some(piece);
    }
    if let Some(last) = committing {
        let committed = crate::blocking::commit_written(last).await;
        if result.is_ok() {
            result = committed;
        }
    }
    Ok(result)
}

/// [`land`] for a payload some of whose memory its device copies from any buffer
/// ([`through_device`]), through the stream's bounce buffers ([`crate::device`]); staged parts
/// without device copies of their own landed in their host copies and are committed after. The
/// first failed copy is the write's error.
async fn land_through_device(
    reader: &mut FrameReader,
    parts: &[Resolved],
    bounces: &mut Bounces,
) -> Result<Result<()>> {
    let landed = crate::device::land_pieces(reader, parts, bounces, || Ok(()), None).await?;
    if landed.is_err() {
        return Ok(landed);
    }
    Ok(crate::blocking::commit_written(&staged_in_host_copy(parts)).await)
}

/// Reads a write's payload into `bounce`, in pieces ([`file_pieces`]), and writes each piece into
/// its part's file, under a permit of the part's region. The outer error breaks the stream; the
/// inner result is the operation's: once a part refuses (its region deregistered, its file shrunk),
/// the rest of the payload is read and dropped.
async fn land_in_files(reader: &mut FrameReader, parts: &[Resolved], bounce: &mut Vec<u8>) -> Result<Result<()>> {
    let mut left: u64 = parts.iter().map(|p| p.len).sum();
    for part in parts {
        for (at, n) in file_pieces(part.len) {
            let piece = bounce_piece(bounce, n);
            reader.read_exact(piece).await?;
            left -= n as u64;
            let written = match part.region.guard().enter() {
                Some(_permit) => part.region.write_through_file(part.offset + at, piece),
                None => Err(part.region.gone()),
            };
            if let Err(e) = written {
                reader.discard(left).await?;
                return Ok(Err(e));
            }
        }
        ferry_core::integrity::fault::landed(part);
    }
    Ok(Ok(()))
}

/// Makes the written `parts` persistent when asked, one batch per region: a page written by several
/// parts of the request is flushed once; an `msync` runs off the runtime.
async fn persist(parts: &[Resolved], durability: Durability, writer: Writer) -> Result<()> {
    crate::blocking::persist(parts, durability, writer).await
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use ferry_core::TransportKind;

    use super::*;

    struct Path(TransportKind, u8, Arc<AtomicUsize>);

    impl AcceptedPath for Path {
        fn kind(&self) -> TransportKind {
            self.0
        }

        fn lane(&self) -> u8 {
            self.1
        }
    }

    impl Drop for Path {
        fn drop(&mut self) {
            self.2.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn repeated_setups_keep_one_path_per_transport() {
        let closed = Arc::new(AtomicUsize::new(0));
        let mut paths: Vec<Box<dyn AcceptedPath>> = Vec::new();
        for _ in 0..1000 {
            keep_one_per_kind(&mut paths, Box::new(Path(TransportKind::Rdma, 0, closed.clone()))).unwrap();
        }
        keep_one_per_kind(&mut paths, Box::new(Path(TransportKind::Tcp, 0, closed.clone()))).unwrap();
        assert_eq!(paths.len(), 2);
        assert_eq!(closed.load(Ordering::SeqCst), 999, "each replaced path was dropped");
    }

    #[test]
    fn a_link_keeps_a_bounded_number_of_paths_whatever_lanes_it_names() {
        let closed = Arc::new(AtomicUsize::new(0));
        let mut paths: Vec<Box<dyn AcceptedPath>> = Vec::new();
        let mut refused = 0;
        for lane in 0..=255u8 {
            let path = Box::new(Path(TransportKind::Rdma, lane, closed.clone()));
            if let Err(e) = keep_one_per_kind(&mut paths, path) {
                assert!(matches!(e, Error::ResourceExhausted(_)), "{e:?}");
                refused += 1;
            }
        }
        assert_eq!(paths.len(), MAX_PATHS_PER_LINK);
        assert_eq!(refused, 256 - MAX_PATHS_PER_LINK);
        assert_eq!(closed.load(Ordering::SeqCst), refused, "each refused path was dropped");
        // Replacing a kept lane still works.
        keep_one_per_kind(&mut paths, Box::new(Path(TransportKind::Rdma, 3, closed.clone()))).unwrap();
    }
}
