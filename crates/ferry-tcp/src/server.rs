//! The target's side: accepts links, checks every operation against the region table, and moves
//! payloads between the socket and registered memory.
//!
//! Each accepted stream is served by one task that reads a request, applies it and writes the answer
//! itself: no hand-off between tasks on the request path, and a peer that sends requests without
//! reading the answers stalls only its own stream (its answers wait in the kernel, not in memory).
//! Answers are flushed when no further complete request is buffered, so pipelined requests share a
//! system call. Region updates for stream 0 arrive through a small queue the task also watches.
//! A frame that fails to decode ends that stream (and, for stream 0, its link); every other link keeps
//! being served. A refused operation's payload is read and dropped, so the stream stays usable.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::codec::{Frame, HelloAck, Limits, ReadStatus, Segment};
use ferry_core::{
    Durability, EngineContext, Error, LinkSlot, Notification, Op, RegionChange, Resolved, Result, WireError,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use crate::io::{FrameReader, FrameWriter, Landed};

/// Most streams one link may open.
pub const MAX_STREAMS_PER_LINK: u16 = 64;
/// Region updates queued per link; a peer that does not read its control stream loses the excess
/// and learns of the change from the target's refusal instead.
const ANNOUNCE_QUEUE: usize = 1024;

/// How the server behaves.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Decoder limits.
    pub limits: Limits,
    /// How long a new connection may take to say hello.
    pub handshake_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            limits: Limits::default(),
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

struct AcceptedLink {
    id: u64,
    peer_engine: u64,
    announcements: mpsc::Sender<Frame>,
    streams: Mutex<Vec<AbortHandle>>,
    /// State of other data paths set up for this link (an RDMA queue pair), dropped with it.
    transport_state: Mutex<Vec<Box<dyn std::any::Any + Send + Sync>>>,
    _slot: LinkSlot,
}

struct Shared {
    ctx: Arc<EngineContext>,
    config: ServerConfig,
    links: Mutex<HashMap<u64, Arc<AcceptedLink>>>,
    next_link: AtomicU64,
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
        let shared = Arc::new(Shared {
            ctx,
            config,
            links: Mutex::new(HashMap::new()),
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

    /// Tells every accepted link about a change to the region table.
    pub fn announce(&self, change: &RegionChange) {
        let frame = match change {
            RegionChange::Added(ad) => Frame::RegionAdded(ad.clone()),
            RegionChange::Removed(key) => Frame::RegionRemoved { key: *key },
        };
        let links: Vec<_> = self
            .shared
            .links
            .lock()
            .map(|l| l.values().cloned().collect())
            .unwrap_or_default();
        for link in links {
            let _ = link.announcements.try_send(frame.clone());
        }
    }

    /// Stops accepting and closes every accepted link.
    pub fn shutdown(&self) {
        self.accept.abort();
        for link in ferry_core::sync::take_all(&self.shared.links) {
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
    if let Ok(mut state) = link.transport_state.lock() {
        state.clear();
    }
    shared.ctx.notifier.link_closed(link.id);
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let shared = shared.clone();
                tokio::spawn(async move {
                    if let Err(e) = serve_stream(stream, peer, shared).await {
                        tracing::debug!(%peer, error = %e, "stream ended");
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

async fn serve_stream(stream: TcpStream, peer: SocketAddr, shared: Arc<Shared>) -> Result<()> {
    stream
        .set_nodelay(true)
        .map_err(|e| Error::io("setting TCP_NODELAY", e))?;
    let (r, w) = stream.into_split();
    let mut reader = FrameReader::new(r, shared.config.limits, peer.to_string());
    let mut writer = FrameWriter::new(w, peer.to_string());
    let hello = match tokio::time::timeout(shared.config.handshake_timeout, reader.next()).await {
        Err(_) => return Err(Error::Timeout(format!("{peer} did not say hello in time"))),
        Ok(Ok(Some(d))) => match d.frame {
            Frame::Hello(h) => h,
            other => {
                return Err(Error::Protocol(format!(
                    "{peer} opened with {other:?} instead of a hello"
                )));
            }
        },
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => return Err(e),
    };
    let ctx = &shared.ctx;
    let refuse = |e: Error| HelloAck {
        engine_id: ctx.engine_id,
        refusal: Some(WireError::from(&e)),
        transports: ctx.transports.clone(),
        host_id: ctx.host_id,
        regions: Vec::new(),
    };
    let (announce_tx, announcements) = mpsc::channel(ANNOUNCE_QUEUE);
    let (link, is_control) = if hello.stream_index == 0 {
        let admitted = if hello.stream_count == 0 || hello.stream_count > MAX_STREAMS_PER_LINK {
            Err(Error::InvalidArgument(format!(
                "{} streams asked for; 1 to {MAX_STREAMS_PER_LINK} are allowed",
                hello.stream_count
            )))
        } else {
            ctx.links.acquire()
        };
        let slot = match admitted {
            Ok(slot) => slot,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "link refused");
                writer.push(&Frame::HelloAck(refuse(e)), 0)?;
                writer.flush().await?;
                return Ok(());
            }
        };
        let link = Arc::new(AcceptedLink {
            id: shared.next_link.fetch_add(1, Ordering::Relaxed),
            peer_engine: hello.engine_id,
            announcements: announce_tx,
            streams: Mutex::new(Vec::new()),
            transport_state: Mutex::new(Vec::new()),
            _slot: slot,
        });
        let regions = ctx.regions.read().map(|t| t.adverts()).unwrap_or_default();
        let inserted = match shared.links.lock() {
            Ok(mut links) if !links.contains_key(&hello.link_token) => {
                links.insert(hello.link_token, link.clone());
                true
            }
            _ => false,
        };
        if !inserted {
            writer.push(&Frame::HelloAck(refuse(Error::Protocol("link token reused".into()))), 0)?;
            writer.flush().await?;
            return Ok(());
        }
        let ack = HelloAck {
            engine_id: ctx.engine_id,
            refusal: None,
            transports: ctx.transports.clone(),
            host_id: ctx.host_id,
            regions,
        };
        writer.push(&Frame::HelloAck(ack), 0)?;
        tracing::info!(%peer, engine = format_args!("{:016x}", hello.engine_id), streams = hello.stream_count, "link accepted");
        (link, true)
    } else {
        let link = shared.links.lock().ok().and_then(|l| l.get(&hello.link_token).cloned());
        let Some(link) = link.filter(|l| l.peer_engine == hello.engine_id) else {
            writer.push(
                &Frame::HelloAck(refuse(Error::Protocol("unknown link token".into()))),
                0,
            )?;
            writer.flush().await?;
            return Ok(());
        };
        writer.push(
            &Frame::HelloAck(HelloAck {
                engine_id: ctx.engine_id,
                refusal: None,
                transports: ctx.transports.clone(),
                host_id: ctx.host_id,
                regions: Vec::new(),
            }),
            0,
        )?;
        (link, false)
    };
    writer.flush().await?;
    let peer_name = peer.to_string();
    let serving = serve_requests(
        shared.clone(),
        link.clone(),
        peer_name,
        reader,
        writer,
        is_control.then_some(announcements),
    );
    // Closing the link aborts every stream's task through these handles.
    let task = tokio::spawn(serving);
    if let Ok(mut s) = link.streams.lock() {
        s.push(task.abort_handle());
    }
    let result = task
        .await
        .unwrap_or_else(|e| Err(Error::PeerClosed(format!("{peer}: stream task ended: {e}"))));
    if is_control {
        let token = hello.link_token;
        let removed = shared.links.lock().ok().and_then(|mut l| l.remove(&token));
        if let Some(link) = removed {
            close_link(&shared, &link);
        }
        tracing::info!(%peer, "link closed");
    }
    result
}

async fn serve_requests(
    shared: Arc<Shared>,
    link: Arc<AcceptedLink>,
    peer: String,
    mut reader: FrameReader,
    mut writer: FrameWriter,
    mut announcements: Option<mpsc::Receiver<Frame>>,
) -> Result<()> {
    let ctx = &shared.ctx;
    let ack = |id: u64, r: Result<()>| Frame::Ack {
        id,
        error: r.err().map(|e| WireError::from(&e)),
    };
    loop {
        // Answer what is already in hand before waiting for more.
        if !reader.has_frame() {
            writer.flush().await?;
        }
        let next = match announcements.as_mut() {
            Some(changes) => tokio::select! {
                biased;
                change = changes.recv() => {
                    match change {
                        Some(frame) => writer.push(&frame, 0)?,
                        None => announcements = None,
                    }
                    continue;
                }
                next = reader.next() => next?,
            },
            None => reader.next().await?,
        };
        let Some(decoded) = next else { return Ok(()) };
        let payload = decoded.payload_len;
        match decoded.frame {
            Frame::Write {
                id,
                key,
                offset,
                durability,
            } => {
                let result = match ctx.resolve_write(key, offset, payload, durability) {
                    Ok(r) => {
                        let landed = land(&mut reader, &r).await?;
                        match landed {
                            Ok(()) => persist(&[r], durability).await,
                            Err(e) => Err(e),
                        }
                    }
                    Err(e) => {
                        reader.discard(payload).await?;
                        Err(e)
                    }
                };
                writer.push(&ack(id, result), 0)?;
            }
            Frame::WriteBatch {
                id,
                durability,
                segments,
            } => {
                let resolved: Result<Vec<Resolved>> = segments
                    .iter()
                    .map(|s| ctx.resolve_write(s.key, s.offset, s.len, durability))
                    .collect();
                let result = match resolved {
                    Ok(parts) => {
                        let mut result = Ok(());
                        for r in &parts {
                            let landed = land(&mut reader, r).await?;
                            if result.is_ok() {
                                result = landed;
                            }
                        }
                        match result {
                            Ok(()) => persist(&parts, durability).await,
                            Err(e) => Err(e),
                        }
                    }
                    Err(e) => {
                        reader.discard(payload).await?;
                        Err(e)
                    }
                };
                writer.push(&ack(id, result), 0)?;
            }
            Frame::Commit {
                id,
                durability,
                segments,
            } => {
                // Ranges this stream's frames wrote before it: persist them if asked.
                let result = match segments
                    .iter()
                    .map(|s| ctx.resolve_write(s.key, s.offset, s.len, durability))
                    .collect::<Result<Vec<_>>>()
                {
                    Ok(parts) => persist(&parts, durability).await,
                    Err(e) => Err(e),
                };
                writer.push(&ack(id, result), 0)?;
            }
            Frame::Read { id, key, offset, len } => {
                let seg = [Segment { key, offset, len }];
                match resolve_reads(ctx, &seg, shared.config.limits.max_payload).await {
                    Ok(parts) => send_read_data(&mut writer, id, &parts).await?,
                    Err(e) => writer.push(&ack(id, Err(e)), 0)?,
                }
            }
            Frame::ReadBatch { id, segments } => {
                match resolve_reads(ctx, &segments, shared.config.limits.max_payload).await {
                    Ok(parts) => send_read_data(&mut writer, id, &parts).await?,
                    Err(e) => writer.push(&ack(id, Err(e)), 0)?,
                }
            }
            Frame::Notify { id, name, msg } => {
                let n = Notification { name, msg };
                let result = n
                    .validate()
                    .and_then(|()| ctx.notifier.deliver(link.id, link.peer_engine, &peer, n));
                writer.push(&ack(id, result), 0)?;
            }
            Frame::Ping { nonce } => writer.push(&Frame::Pong { nonce }, 0)?,
            Frame::TransportSetup { id, kind, blob } if announcements.is_some() => {
                let answer = ctx
                    .acceptors
                    .iter()
                    .find(|t| t.kind() == kind)
                    .ok_or_else(|| Error::Unsupported(format!("this engine has no usable {kind} transport")))
                    .and_then(|t| {
                        t.accept(ferry_core::AcceptSetup {
                            link: link.id,
                            blob: &blob,
                            notifier: ctx.notifier.clone(),
                            peer_engine: link.peer_engine,
                            peer_addr: &peer,
                            context: Arc::downgrade(&shared.ctx),
                        })
                    });
                let reply = match answer {
                    Ok((blob, state)) => {
                        if let Ok(mut s) = link.transport_state.lock() {
                            s.push(state);
                        }
                        tracing::info!(%peer, transport = %kind, "data path set up");
                        Frame::TransportSetupReply { id, error: None, blob }
                    }
                    Err(e) => Frame::TransportSetupReply {
                        id,
                        error: Some(WireError::from(&e)),
                        blob: Vec::new(),
                    },
                };
                writer.push(&reply, 0)?;
            }
            Frame::Goodbye => {
                writer.shutdown().await;
                return Ok(());
            }
            other => {
                return Err(Error::Protocol(format!(
                    "{peer} sent {other:?}, which a target does not accept"
                )));
            }
        }
        if writer.queued() >= 256 << 10 {
            writer.flush().await?;
        }
    }
}

/// Answers a read: the header, then each part straight from its region, then the status byte that
/// says whether those bytes are the regions' (see [`ReadStatus`]).
async fn send_read_data(writer: &mut FrameWriter, id: u64, parts: &[Resolved]) -> Result<()> {
    let total: u64 = parts.iter().map(|p| p.len).sum();
    writer.push(&Frame::ReadData { id }, total + ReadStatus::LEN)?;
    let mut copied = true;
    for p in parts {
        copied &= if p.len <= 16 << 10 {
            writer.push_region(&p.region, p.offset, p.len as usize)
        } else {
            writer.write_region(&p.region, p.offset, p.len).await?
        };
    }
    let status = read_status(parts, copied);
    if status != ReadStatus::Intact {
        tracing::warn!(
            ?status,
            "a region changed while it was read: the read is reported as failed"
        );
    }
    writer.push_bytes(&[status as u8]);
    Ok(())
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

async fn resolve_reads(ctx: &EngineContext, segments: &[Segment], max_payload: u64) -> Result<Vec<Resolved>> {
    let mut total = 0u64;
    let mut parts = Vec::with_capacity(segments.len());
    for s in segments {
        let r = ctx.resolve(s.key, s.offset, s.len, Op::Read)?;
        total = total.saturating_add(s.len);
        if total > max_payload {
            return Err(Error::InvalidArgument(format!(
                "a read of over {max_payload} bytes in one request"
            )));
        }
        parts.push(r);
    }
    for r in &parts {
        // A staged block's device copy: off the runtime, under a permit.
        crate::blocking::prepare_read(r).await?;
    }
    Ok(parts)
}

/// Reads one resolved payload part into its region and commits it (a staged device copy). The outer
/// error breaks the stream; the inner result is the operation's.
async fn land(reader: &mut FrameReader, r: &Resolved) -> Result<Result<()>> {
    Ok(match reader.read_into(&r.region, r.offset, r.len, None).await? {
        // A copy into a file that shrank meanwhile landed in zero pages without failing.
        Landed::Written => match r.region.block().check_intact() {
            // A staged block's device copy: off the runtime, under a permit.
            Ok(()) => crate::blocking::commit_written(r).await,
            Err(e) => Err(e),
        },
        // A target's copies have no caller guard, so `Abandoned` cannot happen here.
        Landed::RegionGone | Landed::Abandoned => Err(r.region.gone()),
        Landed::Unbacked => Err(crate::link::unbacked(&r.region)),
    })
}

/// Makes the written `parts` persistent when asked, one batch per region: a page written by several
/// parts of the request is flushed once; an `msync` runs off the runtime.
async fn persist(parts: &[Resolved], durability: Durability) -> Result<()> {
    crate::blocking::persist(parts, durability).await
}
