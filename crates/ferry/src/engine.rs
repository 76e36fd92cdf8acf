//! The engine: registration, links, transfers and notifications, with HIXL/ADXL's contract.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_core::sync::ShardedLock;
use ferry_core::{
    Access, DataLink, Durability, EngineContext, Error, LinkSlots, MemoryBlock, MemoryRegistry, Notification, Op,
    OwnedBuffer, PeerNames, RawMemory, ReceivedNotification, RegionEntry, RegionKey, RegionTable, Result, TransferDesc,
    TransferItem, TransferRequest, Transport, TransportKind,
};
use ferry_tcp::{CoalescePool, LinkConfig, LocalIdentity, ServerConfig, TcpLink, TcpServer};
use futures::stream::BoxStream;

use crate::builder::EngineBuilder;
use crate::directory::{Directory, EngineRecord, MemberEvent};
use crate::host::HostAllocation;
use crate::notify::NotificationQueue;
use crate::peer::{Peer, PeerInner};
use crate::policy::{ConnectOptions, PathPolicy};
use crate::region::Region;
use crate::shared::{Inner, poisoned};
use crate::transfer::{Transfer, TransferHandle, TransferOptions};

impl EngineBuilder {
    /// Starts the engine: validates the options and, with a listen address, starts serving.
    pub async fn build(self) -> Result<Engine> {
        self.validate()?;
        self.validate_directory()?;
        if self
            .tls
            .as_ref()
            .is_some_and(|t| t.protection() == ferry_core::DataProtection::Plain)
        {
            tracing::warn!(
                "data protection is off: whoever can write to the network between engines can change or inject \
                 the bytes of this engine's TCP data streams; use it only where nobody else can reach that network"
            );
        }
        let mut transports: Vec<Arc<dyn Transport>> = Vec::new();
        let mut unavailable = Vec::new();
        for t in crate::capabilities::compiled_transports(&self.transport_options, self.tls.is_some()) {
            if !self.allowed.as_ref().is_none_or(|a| a.contains(&t.kind())) {
                unavailable.push((
                    t.kind(),
                    "left out of this engine's transports (EngineBuilder::transports)".into(),
                ));
                continue;
            }
            let a = t.availability();
            if !a.usable {
                tracing::info!(transport = %a.kind, reason = %a.detail, "transport unavailable");
                unavailable.push((t.kind(), a.detail));
                continue;
            }
            transports.push(t);
        }
        if transports.is_empty() {
            return Err(Error::Unsupported(format!(
                "no data transport is compiled in, usable here and allowed ({:?}); see `ferry info`",
                self.allowed
            )));
        }
        let notifications = NotificationQueue::new(
            self.max_pending_notifications,
            self.max_notification_bytes,
            self.max_notification_bytes_per_peer,
        );
        let ctx = Arc::new(EngineContext {
            engine_id: random_u64()?,
            host_id: host_id(),
            regions: ShardedLock::new(RegionTable::new()),
            notifier: notifications.clone(),
            incoming: Arc::new(LinkSlots::new(self.max_links)),
            outgoing: Arc::new(LinkSlots::new(self.max_links)),
            transports: transports.iter().map(|t| t.kind()).collect(),
            acceptors: transports.clone(),
            peer_names: Arc::new(PeerNames::random()?),
            served: Default::default(),
        });
        let server = match &self.listen {
            Some(addr) => {
                let addr = resolve(addr).await?;
                let config = ServerConfig {
                    limits: self.limits,
                    handshake_timeout: self.handshake_timeout,
                    first_bytes_timeout: self.first_bytes_timeout,
                    admission: self.admission,
                    link_limits: self.link_limits,
                    send_timeout: self.send_timeout,
                    tls: self.tls.clone(),
                };
                Some(TcpServer::bind(addr, ctx.clone(), config).await?)
            }
            None => None,
        };
        let pool = CoalescePool::new(self.buffer_pool);
        let inner = Arc::new(Inner {
            ctx,
            server,
            transports,
            unavailable,
            peers: Mutex::new(HashMap::new()),
            notifications,
            pool,
            revoking: tokio::sync::Mutex::new(()),
            options: self,
        });
        if let Some(metrics) = &inner.options.metrics {
            let source: std::sync::Weak<Inner> = Arc::downgrade(&inner);
            metrics.attach(source);
        }
        let engine = Engine { inner };
        engine.publish().await?;
        Ok(engine)
    }
}

/// A batch resolved once by [`Engine::prepare`], posted with [`Engine::transfer_prepared`].
#[derive(Clone)]
pub struct PreparedTransfer {
    peer: Peer,
    request: TransferRequest,
}

impl PreparedTransfer {
    /// The peer it goes to.
    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// READ or WRITE.
    pub fn op(&self) -> Op {
        self.request.op
    }

    /// How many descriptors it holds.
    pub fn len(&self) -> usize {
        self.request.items.len()
    }

    /// Whether it holds none (never true: `prepare` refuses an empty batch).
    pub fn is_empty(&self) -> bool {
        self.request.items.is_empty()
    }
}

impl std::fmt::Debug for PreparedTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedTransfer")
            .field("peer", &self.peer.addr())
            .field("op", &self.request.op)
            .field("descriptors", &self.request.items.len())
            .finish()
    }
}

/// Moves bytes between this process's registered memory and that of connected peers.
///
/// ```no_run
/// # async fn demo() -> ferry::Result<()> {
/// use std::time::Duration;
/// use ferry::{Access, Engine, Op, TransferDesc};
///
/// let target = Engine::builder().listen("127.0.0.1:0").build().await?;
/// let dst = target.alloc_host(1 << 20, Access::READ_WRITE)?;
///
/// let initiator = Engine::builder().build().await?;
/// let src = initiator.register(vec![7u8; 1 << 20], Access::READ_WRITE)?;
/// let peer = initiator.connect(&target.local_addr().unwrap().to_string(), Duration::from_secs(1)).await?;
/// initiator
///     .transfer(&peer, Op::Write, &[TransferDesc::new(src.addr(), dst.addr(), 1 << 20)], Duration::from_secs(5))
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("id", &format_args!("{:016x}", self.inner.ctx.engine_id))
            .field("listen", &self.local_addr())
            .finish()
    }
}

impl Engine {
    /// Starts configuring an engine.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }

    /// This engine's random id.
    pub fn id(&self) -> u64 {
        self.inner.ctx.engine_id
    }

    /// The address it listens on, if it listens.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.server.as_ref().map(|s| s.local_addr())
    }

    /// Transports usable by this engine, best first.
    pub fn transports(&self) -> Vec<TransportKind> {
        self.inner.ctx.transports.clone()
    }

    // ---- memory -------------------------------------------------------------------------------------

    /// Registers a buffer the engine takes ownership of.
    pub fn register(&self, buffer: impl Into<Box<[u8]>>, access: Access) -> Result<Region> {
        self.register_block(Arc::new(OwnedBuffer::new(buffer)), access)
    }

    /// Registers `len` bytes at `ptr`, which the caller keeps.
    ///
    /// # Safety
    ///
    /// The memory must stay valid for reads and writes until the returned region is dropped or
    /// deregistered and that has returned; peers may write into it at any time until then.
    pub unsafe fn register_raw(&self, ptr: *mut u8, len: usize, access: Access) -> Result<Region> {
        // SAFETY: forwarded to our caller.
        self.register_block(Arc::new(unsafe { RawMemory::new(ptr, len) }), access)
    }

    /// Allocates `len` bytes of page-aligned host memory and registers it (HIXL `MallocMem`).
    pub fn alloc_host(&self, len: usize, access: Access) -> Result<Region> {
        self.register_block(Arc::new(HostAllocation::new(len)?), access)
    }

    /// Registers `len` bytes of the file at `path` from `offset` (page-aligned) as a persistent region:
    /// writes to it may ask for [`Durability::Persistent`]. DAX file systems get a `MAP_SYNC` mapping
    /// flushed by cache-line write-back, others a shared mapping flushed with `msync`; `Region::kind`
    /// says which.
    pub fn register_file(
        &self,
        path: impl AsRef<std::path::Path>,
        offset: u64,
        len: usize,
        access: Access,
    ) -> Result<Region> {
        self.register_block(
            Arc::new(crate::file::FileMapping::open(path.as_ref(), offset, len)?),
            access,
        )
    }

    /// Allocates from `registry` (a GPU allocator, for example) and registers the result.
    pub fn alloc_from(&self, registry: &dyn MemoryRegistry, len: usize, access: Access) -> Result<Region> {
        self.register_block(registry.allocate(len)?, access)
    }

    /// Registers any memory block. Connected peers are told at once.
    pub fn register_block(&self, block: Arc<dyn MemoryBlock>, access: Access) -> Result<Region> {
        let inner = &self.inner;
        let entry = RegionEntry::new(RegionKey::random()?, access, block)?;
        let entry = register_entry(&inner.transports, &inner.ctx.regions, entry)?;
        if let Some(server) = &inner.server {
            server.announce(&entry, true);
        }
        tracing::debug!(region = ?entry, "registered");
        Ok(Region {
            entry,
            engine: Arc::downgrade(&self.inner),
        })
    }

    /// Deregisters a region (HIXL `DeregisterMem`), blocking the calling thread until no access to it
    /// is left (at most [`DEREGISTER_LIMIT`](crate::DEREGISTER_LIMIT)): the same as dropping it (see [`Region`]'s `Drop`). Once
    /// this returns, no byte of the region is touched again. Async code awaits
    /// [`Region::deregister`] instead, which never blocks the runtime.
    pub fn deregister_blocking(&self, region: Region) {
        drop(region);
    }

    // ---- links --------------------------------------------------------------------------------------

    /// Connects to the engine listening at `remote` ("host:port"), within `timeout`
    /// (HIXL `Connect`, default 1000 ms), on a data path the engine's
    /// [path policy](crate::EngineBuilder::path_policy) allows.
    pub async fn connect(&self, remote: &str, timeout: Duration) -> Result<Peer> {
        self.connect_using(remote, timeout, &ConnectOptions::new()).await
    }

    /// [`connect`](Self::connect) on a data path `policy` allows: with [`PathPolicy::Require`], a
    /// link that can take none of the transports named fails with `Unsupported`, saying for each why
    /// not and on which side.
    pub async fn connect_with(&self, remote: &str, timeout: Duration, policy: &PathPolicy) -> Result<Peer> {
        let options = ConnectOptions::new().paths(policy.clone());
        self.connect_using(remote, timeout, &options).await
    }

    /// [`connect`](Self::connect) with this link's own settings where `options` gives them (the data
    /// paths it may take, whether GPU memory may be staged on it), the engine's elsewhere.
    pub async fn connect_using(&self, remote: &str, timeout: Duration, options: &ConnectOptions) -> Result<Peer> {
        let policy = options.paths.as_ref().unwrap_or(&self.inner.options.path_policy);
        let stage_gpu_memory = options.stage_gpu_memory.unwrap_or(self.inner.options.stage_gpu_memory);
        let fut = async {
            let addr = resolve(remote).await?;
            if let Some(p) = self.peer_at(addr) {
                if !p.is_closed() {
                    return Err(Error::AlreadyConnected(format!(
                        "{remote} ({addr}) is already connected"
                    )));
                }
                self.forget(addr);
            }
            let slot = self.inner.ctx.outgoing.acquire()?;
            let me = LocalIdentity {
                engine_id: self.inner.ctx.engine_id,
                host_id: self.inner.ctx.host_id,
                transports: self.inner.ctx.transports.clone(),
            };
            let config = LinkConfig {
                streams: self.inner.options.streams,
                max_inflight_bytes: self.inner.options.max_inflight_bytes,
                limits: self.inner.options.limits,
                pool: self.inner.pool.clone(),
                link_limits: Default::default(),
                send_timeout: self.inner.options.send_timeout,
                tls: self.inner.options.tls.clone(),
            };
            let control = TcpLink::dial(addr, &me, &config).await?;
            let (data, mut passed_over) = match self.data_link(&control, policy).await {
                Ok(data) => data,
                Err(e) => {
                    control.abort();
                    return Err(e);
                }
            };
            if let Some(note) = data.fallback_note() {
                tracing::warn!(peer = %addr, transport = %data.kind(), %note, "a data path carries only some regions; the rest go over tcp");
                if let Some(metrics) = &self.inner.options.metrics {
                    metrics.passed_over(data.kind(), "partial");
                }
                passed_over.push((data.kind(), note));
            }
            let data_kind = data.kind();
            let peer = Peer {
                inner: Arc::new(PeerInner {
                    addr,
                    name: remote.to_string(),
                    control,
                    data,
                    passed_over,
                    owner: self.inner.ctx.engine_id,
                    listed: std::sync::atomic::AtomicBool::new(true),
                    metrics: self
                        .inner
                        .options
                        .metrics
                        .as_ref()
                        .map(|m| m.link(&addr.to_string(), data_kind)),
                    stage_gpu_memory,
                    _slot: slot,
                }),
            };
            let mut peers = self.inner.peers.lock().map_err(|_| poisoned())?;
            if peers.get(&addr).is_some_and(|p| !p.is_closed()) {
                peer.inner.control.abort();
                return Err(Error::AlreadyConnected(format!(
                    "{remote} ({addr}) is already connected"
                )));
            }
            if let Some(replaced) = peers.insert(addr, peer.clone()) {
                replaced.inner.listed.store(false, Ordering::Release);
            }
            tracing::info!(peer = %addr, transport = %peer.transport(), "connected");
            Ok(peer)
        };
        match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout(format!(
                "connecting to {remote} took longer than {timeout:?}"
            ))),
        }
    }

    /// Picks the best data path both ends offer; a transport that fails to set up falls back to the
    /// next one, and the log says why.
    async fn data_link(
        &self,
        control: &TcpLink,
        policy: &PathPolicy,
    ) -> Result<(Arc<dyn DataLink>, Vec<(TransportKind, String)>)> {
        let theirs = control.remote_transports();
        let mut refusals: Vec<(TransportKind, String)> = Vec::new();
        let candidates = self
            .inner
            .transports
            .iter()
            .filter(|t| theirs.contains(&t.kind()) && policy.allows(t.kind()));
        for t in candidates {
            let link = match t.kind() {
                TransportKind::Tcp => Ok(Arc::new(control.clone()) as Arc<dyn DataLink>),
                _ => t.connect(control).await,
            };
            let link = link.and_then(|link| match (policy, link.fallback_note()) {
                // A required same-host path that would hand some regions to TCP is no such path.
                (PathPolicy::Require(_), Some(note)) => Err(Error::Unsupported(note)),
                _ => Ok(link),
            });
            match link {
                Ok(link) => {
                    if !refusals.is_empty() {
                        let reasons: Vec<String> = refusals.iter().map(|(k, why)| format!("{k}: {why}")).collect();
                        tracing::warn!(peer = %control.peer(), transport = %t.kind(), ?reasons, "a better transport could not be used");
                    }
                    return Ok((link, refusals));
                }
                Err(e) => {
                    if let Some(metrics) = &self.inner.options.metrics {
                        metrics.passed_over(t.kind(), e.code().name());
                    }
                    refusals.push((t.kind(), e.to_string()));
                }
            }
        }
        if let PathPolicy::Require(kinds) = policy {
            return Err(self.refused_by_policy(control, kinds, &refusals));
        }
        let refusals: Vec<String> = refusals.iter().map(|(k, why)| format!("{k}: {why}")).collect();
        Err(Error::Unsupported(format!(
            "{} offers {theirs:?} and this engine {:?}: no transport in common{}",
            control.peer(),
            self.inner.ctx.transports,
            if refusals.is_empty() {
                String::new()
            } else {
                format!(" ({})", refusals.join("; "))
            }
        )))
    }

    /// The error of a link that can take none of the transports `required`: for each, why not, and
    /// on which side.
    fn refused_by_policy(
        &self,
        control: &TcpLink,
        required: &[TransportKind],
        refusals: &[(TransportKind, String)],
    ) -> Error {
        let theirs = control.remote_transports();
        let peer = control.peer();
        let why: Vec<String> = required
            .iter()
            .map(|k| {
                if let Some((_, why)) = refusals.iter().find(|(r, _)| r == k) {
                    format!("{k}: refused while setting it up: {why}")
                } else if let Some((_, why)) = self.inner.unavailable.iter().find(|(u, _)| u == k) {
                    format!("{k}: not usable on this engine: {why}")
                } else if !self.inner.ctx.transports.contains(k) {
                    format!("{k}: not in this build (cargo feature `{}`)", k.name())
                } else {
                    // Offered by both ends and allowed, it would have been tried: the peer lacks it.
                    format!("{k}: {peer} does not offer it (it offers {theirs:?}; see `ferry info` there)")
                }
            })
            .collect();
        Error::Unsupported(format!(
            "the path policy requires {} to {peer}, and none can be used: {}",
            PathPolicy::Require(required.to_vec()),
            why.join("; ")
        ))
    }

    /// The connected peer at `addr`, if any.
    pub fn peer_at(&self, addr: SocketAddr) -> Option<Peer> {
        self.inner.peers.lock().ok()?.get(&addr).cloned()
    }

    /// Every connected peer.
    pub fn peers(&self) -> Vec<Peer> {
        self.inner
            .peers
            .lock()
            .map(|p| p.values().cloned().collect())
            .unwrap_or_default()
    }

    fn forget(&self, addr: SocketAddr) -> Option<Peer> {
        let peer = self.inner.peers.lock().ok()?.remove(&addr)?;
        peer.inner.listed.store(false, Ordering::Release);
        Some(peer)
    }

    /// Closes the link to `peer` (HIXL `Disconnect`), waiting at most `timeout`.
    pub async fn disconnect(&self, peer: &Peer, timeout: Duration) -> Result<()> {
        let Some(p) = self.forget(peer.addr()).filter(|p| Arc::ptr_eq(&p.inner, &peer.inner)) else {
            return Err(Error::NotConnected(format!("{} is not connected", peer.addr())));
        };
        if tokio::time::timeout(timeout, p.inner.data.close()).await.is_err() {
            p.inner.control.abort();
        }
        let _ = tokio::time::timeout(timeout, p.inner.control.close()).await;
        p.inner.control.abort();
        tracing::info!(peer = %p.addr(), "disconnected");
        Ok(())
    }

    // ---- transfers ----------------------------------------------------------------------------------

    /// Whether `peer` is connected to this engine (not disconnected nor replaced), by the peer's own
    /// flags rather than the peer table: no lock shared by every transfer.
    fn check_listed(&self, peer: &Peer) -> Result<()> {
        if peer.inner.owner != self.inner.ctx.engine_id || !peer.inner.listed.load(Ordering::Acquire) {
            return Err(Error::NotConnected(format!(
                "{} is not connected to this engine",
                peer.addr()
            )));
        }
        Ok(())
    }

    /// Whether `peer` is a live link of this engine.
    fn check_peer(&self, peer: &Peer) -> Result<()> {
        self.check_listed(peer)?;
        if peer.is_closed() {
            return Err(Error::PeerClosed(format!(
                "the link to {} is down; connect again",
                peer.addr()
            )));
        }
        Ok(())
    }

    fn resolve_request(
        &self,
        peer: &Peer,
        op: Op,
        descs: &[TransferDesc],
        durability: Durability,
    ) -> Result<TransferRequest> {
        if descs.is_empty() {
            return Err(Error::InvalidArgument(
                "a transfer needs at least one descriptor".into(),
            ));
        }
        self.check_peer(peer)?;
        if op == Op::Read && durability == Durability::Persistent {
            return Err(Error::InvalidArgument("durability applies to writes, not reads".into()));
        }
        let transport = peer.transport();
        let refuse_staging = !peer.inner.stage_gpu_memory;
        let local = self.inner.ctx.regions.read().map_err(|_| poisoned())?;
        let items = peer.inner.control.with_remote_regions(|remote| {
            // A batch's descriptors mostly fall in the same local and remote regions as the one
            // before: those are checked against the previous item instead of looked up again, and
            // share its region and key (no reference counts taken and dropped for the lookup).
            let mut last_ad: Option<&ferry_core::RegionAd> = None;
            let mut items: Vec<TransferItem> = Vec::with_capacity(descs.len());
            for (i, d) in descs.iter().enumerate() {
                let at = |e: Error| prefix(e, &format!("descriptor {i}"));
                let previous = items.last();
                let local = match previous.map(|p| &p.local.region) {
                    Some(r) if d.len > 0 && d.local_addr >= r.addr() && d.local_addr - r.addr() < r.len() => {
                        let offset = d.local_addr - r.addr();
                        r.check_range(offset, d.len).map_err(at)?;
                        ferry_core::Resolved {
                            region: r.clone(),
                            offset,
                            len: d.len,
                        }
                    }
                    _ => local.find_local(d.local_addr, d.len).map_err(at)?,
                };
                let (ad, remote_transport_key) = match (last_ad, previous) {
                    (Some(ad), Some(p)) if d.len > 0 && ad.contains(d.remote_addr, d.len) => {
                        (ad, p.remote_transport_key.clone())
                    }
                    _ => {
                        let (ad, _) = remote.find(d.remote_addr, d.len, op.required_access()).map_err(at)?;
                        let key = ad
                            .transport_keys
                            .iter()
                            .find(|(k, _)| *k == transport)
                            .map(|(_, key)| key.clone());
                        (ad, key)
                    }
                };
                last_ad = Some(ad);
                if refuse_staging {
                    refuse_staged(peer, &local, ad).map_err(at)?;
                }
                if durability == Durability::Persistent && !ad.persistent {
                    return Err(at(Error::InvalidArgument(format!(
                        "a persistent write needs a persistent region; the peer's region at {:#x} is not",
                        ad.addr
                    ))));
                }
                items.push(TransferItem {
                    local,
                    remote_key: ad.key,
                    remote_offset: d.remote_addr - ad.addr,
                    remote_addr: d.remote_addr,
                    remote_transport_key,
                    remote_access: ad.access,
                });
            }
            Ok(items)
        })??;
        Ok(TransferRequest {
            op,
            durability,
            items,
            checked: false,
        })
    }

    /// Checks and resolves a batch of one-sided operations on `peer` now, and returns the future
    /// that runs it ([`Transfer`], a named type) under `options`: durability, timeout, deadline,
    /// integrity. Every transfer goes through here; the calls below are conveniences over it. Every
    /// error a descriptor can cause comes back here (`InvalidArgument`, `OutOfBounds`,
    /// `PermissionDenied` naming the descriptor); the future's own errors are the link's, the time
    /// bounds' and the check's (`Integrity`).
    pub fn start(&self, peer: &Peer, op: Op, descs: &[TransferDesc], options: TransferOptions) -> Result<Transfer> {
        let request = self.resolve_request(peer, op, descs, options.durability)?;
        let integrity = options.integrity.unwrap_or(self.inner.options.integrity);
        Transfer::new(peer, request, options.timeout, options.deadline, integrity)
    }

    /// Starts a batch [prepared](Self::prepare) before, under `options`' time bounds and integrity
    /// (its durability was fixed when it was prepared).
    pub fn start_prepared(&self, prepared: &PreparedTransfer, options: TransferOptions) -> Result<Transfer> {
        self.check_peer(&prepared.peer)?;
        Transfer::new(
            &prepared.peer,
            prepared.request.clone(),
            options.timeout,
            options.deadline,
            options.integrity.unwrap_or(self.inner.options.integrity),
        )
    }

    /// Runs a batch of one-sided operations on `peer` and waits for all of them, at most `timeout`
    /// (HIXL `TransferSync`). Writes complete when the bytes are in the target's memory.
    pub async fn transfer(&self, peer: &Peer, op: Op, descs: &[TransferDesc], timeout: Duration) -> Result<()> {
        self.start(peer, op, descs, TransferOptions::within(timeout))?.await
    }

    /// [`transfer`](Self::transfer) with an explicit durability for writes.
    pub async fn transfer_durable(
        &self,
        peer: &Peer,
        op: Op,
        descs: &[TransferDesc],
        durability: Durability,
        timeout: Duration,
    ) -> Result<()> {
        self.start(peer, op, descs, TransferOptions::within(timeout).durability(durability))?
            .await
    }

    /// [`start`](Self::start) with a durability and a timeout.
    pub fn transfer_future(
        &self,
        peer: &Peer,
        op: Op,
        descs: &[TransferDesc],
        durability: Durability,
        timeout: Duration,
    ) -> Result<Transfer> {
        self.start(peer, op, descs, TransferOptions::within(timeout).durability(durability))
    }

    /// [`start`](Self::start) with a durability, a timeout and a deadline: the transfer fails with
    /// `Timeout` at `timeout` from now or at `deadline`, whichever comes first, and at once, having
    /// sent nothing, when the deadline has already passed. The engine reads the clock once for both
    /// bounds, where turning the deadline into a timeout first would read it twice.
    pub fn transfer_future_until(
        &self,
        peer: &Peer,
        op: Op,
        descs: &[TransferDesc],
        durability: Durability,
        timeout: Duration,
        deadline: Option<Instant>,
    ) -> Result<Transfer> {
        let options = TransferOptions::within(timeout)
            .durability(durability)
            .deadline(deadline);
        self.start(peer, op, descs, options)
    }

    /// Resolves a batch once, for [`transfer_prepared`](Self::transfer_prepared) to post many times
    /// with no work per descriptor but posting: the same checks as [`transfer`](Self::transfer)
    /// (every descriptor inside a local region and a region the peer advertised, with the access
    /// `op` needs), done now. A KV cache moved block by block between the same buffers, step after
    /// step, is the case.
    ///
    /// The batch names the regions as they are now. Once one of them is deregistered (here or at
    /// the peer) or its grant revoked, posting fails with the error a transfer gets for it
    /// (`PermissionDenied` from the peer, for example): prepare again.
    pub fn prepare(&self, peer: &Peer, op: Op, descs: &[TransferDesc]) -> Result<PreparedTransfer> {
        self.prepare_durable(peer, op, descs, Durability::Completed)
    }

    /// [`prepare`](Self::prepare) with an explicit durability for writes.
    pub fn prepare_durable(
        &self,
        peer: &Peer,
        op: Op,
        descs: &[TransferDesc],
        durability: Durability,
    ) -> Result<PreparedTransfer> {
        Ok(PreparedTransfer {
            request: self.resolve_request(peer, op, descs, durability)?,
            peer: peer.clone(),
        })
    }

    /// Posts a prepared batch and waits for it, at most `timeout`, as [`transfer`](Self::transfer)
    /// does.
    pub async fn transfer_prepared(&self, prepared: &PreparedTransfer, timeout: Duration) -> Result<()> {
        self.start_prepared(prepared, TransferOptions::within(timeout))?.await
    }

    /// Starts a batch and returns at once (HIXL `TransferAsync`): poll the handle's
    /// [`status`](TransferHandle::status), or await it. Descriptors are checked before this returns.
    pub fn transfer_async(
        &self,
        peer: &Peer,
        op: Op,
        descs: &[TransferDesc],
        timeout: Duration,
    ) -> Result<TransferHandle> {
        self.transfer_async_durable(peer, op, descs, Durability::Completed, timeout)
    }

    /// [`transfer_async`](Self::transfer_async) with an explicit durability for writes: the handle
    /// reports completion only once the writes are in the target's persistence domain.
    pub fn transfer_async_durable(
        &self,
        peer: &Peer,
        op: Op,
        descs: &[TransferDesc],
        durability: Durability,
        timeout: Duration,
    ) -> Result<TransferHandle> {
        let transfer = self.start(peer, op, descs, TransferOptions::within(timeout).durability(durability))?;
        Ok(TransferHandle::spawn(transfer, peer.clone()))
    }

    // ---- notifications ------------------------------------------------------------------------------

    /// Sends a notification to `peer` (HIXL `SendNotify`): name and message at most 1024 characters
    /// each; refused with `ResourceExhausted` when 4096 wait undrained at the peer. It is never seen
    /// before the data of transfers that completed before it was sent.
    pub async fn notify(&self, peer: &Peer, notification: Notification, timeout: Duration) -> Result<()> {
        notification.validate()?;
        self.check_listed(peer)?;
        match tokio::time::timeout(timeout, peer.inner.data.notify(notification)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout(format!(
                "notifying {} took longer than {timeout:?}",
                peer.addr()
            ))),
        }
    }

    /// Takes every notification received so far (HIXL `GetNotifies`).
    pub fn take_notifications(&self) -> Vec<ReceivedNotification> {
        self.inner.notifications.take_all()
    }

    /// Notifications as they arrive. Each is delivered once, to one consumer.
    pub fn notifications(&self) -> BoxStream<'static, ReceivedNotification> {
        self.inner.notifications.stream()
    }

    /// Number of registered regions.
    pub fn region_count(&self) -> usize {
        self.inner.ctx.regions.read().map(|t| t.len()).unwrap_or(0)
    }

    /// Links in use, incoming and outgoing.
    pub fn link_count(&self) -> usize {
        self.inner.ctx.incoming.used() + self.inner.ctx.outgoing.used()
    }

    /// This engine's record, as it publishes it in a directory.
    pub fn record(&self) -> EngineRecord {
        EngineRecord {
            name: self.inner.options.name.clone().unwrap_or_default(),
            addrs: self
                .local_addr()
                .map(crate::interfaces::reachable)
                .unwrap_or_default()
                .iter()
                .map(SocketAddr::to_string)
                .collect(),
            transports: self.transports().iter().map(|t| t.name().to_string()).collect(),
            host_id: format!("{:016x}", self.inner.ctx.host_id),
            protocol_version: ferry_core::codec::VERSION,
            engine_id: format!("{:016x}", self.inner.ctx.engine_id),
            authenticated: self.inner.authenticates(),
        }
    }

    fn directory(&self) -> Result<&Arc<dyn Directory>> {
        self.inner
            .options
            .directory
            .as_ref()
            .map(|d| &d.0)
            .ok_or_else(|| Error::InvalidArgument("this engine has no directory (EngineBuilder::directory)".into()))
    }

    async fn publish(&self) -> Result<()> {
        if let (Some(_), Some(directory)) = (&self.inner.options.name, &self.inner.options.directory) {
            directory.0.publish(self.record()).await?;
        }
        Ok(())
    }

    /// Looks `name` up in the engine's directory and connects to the first of its addresses that
    /// answers, all within `timeout`. `NotConnected` when no engine of that name is published;
    /// `Timeout` when the directory or the engine does not answer in time.
    ///
    /// On an engine that authenticates its links, the engine reached must prove the name: its
    /// certificate's name or one of its DNS names is `name` (a directory record is only a claim, and
    /// anyone who can write the directory could point it at another engine of the same CA). One that
    /// proves another name is disconnected, and the next address tried; if none proves it, the
    /// answer is `PermissionDenied`.
    pub async fn connect_by_name(&self, name: &str, timeout: Duration) -> Result<Peer> {
        let deadline = tokio::time::Instant::now() + timeout;
        let record = self.lookup(name, timeout).await?;
        let mut last = Error::NotConnected(format!("engine {name} publishes no address"));
        for addr in &record.addrs {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.connect(addr, left).await {
                Ok(peer) => match peer.identity().filter(|who| !who.names().any(|n| n == name)) {
                    None => return Ok(peer),
                    Some(who) => {
                        last = Error::PermissionDenied(format!(
                            "the engine at {addr}, published as {name}, proved to be {who}: the directory \
                             record may be forged or stale"
                        ));
                        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                        if let Err(e) = self.disconnect(&peer, left).await {
                            tracing::debug!(%addr, error = %e, "disconnecting from an engine that is not {name}");
                        }
                    }
                },
                Err(e) => last = prefix(e, &format!("connecting to {name} at {addr}")),
            }
        }
        Err(last)
    }

    /// The record `name` published in the engine's directory, within `timeout`: `NotConnected` when
    /// no engine of that name is published, `Timeout` when the directory does not answer in time. A
    /// record is what its engine claims; [`connect_by_name`](Self::connect_by_name) checks the claim.
    pub async fn lookup(&self, name: &str, timeout: Duration) -> Result<EngineRecord> {
        tokio::time::timeout(timeout, self.directory()?.lookup(name))
            .await
            .map_err(|_| Error::Timeout(format!("looking {name} up in the directory took over {timeout:?}")))?
    }

    /// The engines published in the directory now.
    pub async fn list_members(&self) -> Result<Vec<EngineRecord>> {
        self.directory()?.list().await
    }

    /// Joins and leaves in the directory from now on: an engine that starts, stops, or dies (once
    /// its lease runs out).
    pub async fn members(&self) -> Result<BoxStream<'static, MemberEvent>> {
        self.directory()?.watch().await
    }
}

/// `Unsupported` where a transfer between `local` and the peer's region `remote` would stage GPU
/// memory on `peer`'s link: the local region is device memory behind a host copy for this link's
/// transport, or the peer's region is reached through its staging buffer
/// ([`EngineBuilder::stage_gpu_memory`](crate::EngineBuilder::stage_gpu_memory)).
fn refuse_staged(peer: &Peer, local: &ferry_core::Resolved, remote: &ferry_core::RegionAd) -> Result<()> {
    let transport = peer.transport();
    let here = match local.region.block().dma_view() {
        ferry_core::DmaView::Host => false,
        ferry_core::DmaView::Staged => true,
        // A NIC reaches such memory itself; CPU transports only through the host copy.
        ferry_core::DmaView::Device { .. } => transport != TransportKind::Rdma,
    };
    if here {
        return Err(Error::Unsupported(format!(
            "the local region is {} memory that {transport} reaches only through its host copy, and this \
             link does not stage GPU memory (stage_gpu_memory(false) on the engine or the connect)",
            local.region.block().kind()
        )));
    }
    let route = peer.inner.data.route(remote);
    if route.staged {
        let why = route.passed_over.map(|why| format!(" ({why})")).unwrap_or_default();
        return Err(Error::Unsupported(format!(
            "the peer's region at {:#x} is GPU memory that this link reaches {}{why}, and this link does not stage \
             GPU memory (stage_gpu_memory(false) on the engine or the connect)",
            remote.addr, route.how
        )));
    }
    Ok(())
}

fn prefix(e: Error, what: &str) -> Error {
    let msg = format!("{what}: {}", e.message());
    match e {
        Error::InvalidArgument(_) => Error::InvalidArgument(msg),
        Error::OutOfBounds(_) => Error::OutOfBounds(msg),
        Error::PermissionDenied(_) => Error::PermissionDenied(msg),
        Error::Unsupported(_) => Error::Unsupported(msg),
        other => other,
    }
}

/// Registers `entry` with every transport, then enters it in the region table. All or nothing: when
/// a transport or the table refuses it (an overlap, a limit), the transports that took it already
/// forget it again, so no NIC registration of memory the engine does not know outlives the call.
fn register_entry(
    transports: &[Arc<dyn Transport>],
    table: &ShardedLock<RegionTable>,
    mut entry: RegionEntry,
) -> Result<Arc<RegionEntry>> {
    let key = entry.key();
    let mut taken: Vec<&Arc<dyn Transport>> = Vec::with_capacity(transports.len());
    let mut transport_keys = Vec::new();
    let mut registered = Ok(());
    for t in transports {
        match t.register_region(&entry) {
            Ok(transport_key) => {
                taken.push(t);
                transport_keys.extend(transport_key.map(|k| (t.kind(), k)));
            }
            // A data path that cannot reach this region leaves it to the control link, which moves
            // every region: peers find no key of that transport in its advert and use TCP for it.
            Err(e) if t.kind() != TransportKind::Tcp => {
                tracing::warn!(region = ?key, transport = %t.kind(), error = %e, "not reachable through this transport; peers reach it over tcp");
            }
            Err(e) => {
                registered = Err(e);
                break;
            }
        }
    }
    for (kind, transport_key) in transport_keys {
        entry = entry.with_transport_key(kind, transport_key);
    }
    let entry = Arc::new(entry);
    let inserted = registered.and_then(|()| table.write().map_err(|_| poisoned())?.insert(entry.clone()));
    if let Err(e) = inserted {
        for t in taken {
            t.deregister_region(key);
        }
        return Err(e);
    }
    Ok(entry)
}

async fn resolve(addr: &str) -> Result<SocketAddr> {
    if let Ok(a) = addr.parse() {
        return Ok(a);
    }
    let mut addrs = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| Error::io(format_args!("resolving {addr:?} (expected host:port)"), e))?;
    addrs
        .next()
        .ok_or_else(|| Error::InvalidArgument(format!("{addr:?} resolves to no address")))
}

fn random_u64() -> Result<u64> {
    Ok(RegionKey::random()?.0)
}

/// Identifies this host: the kernel's boot id, so that two engines on one host agree.
fn host_id() -> u64 {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    // FNV-1a: stable across processes, unlike std's randomly keyed hasher.
    text.trim()
        .bytes()
        .fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use ferry_core::Availability;

    use super::*;

    /// A transport that records which regions it holds, and can refuse every registration.
    struct Recording {
        kind: TransportKind,
        refuse: bool,
        held: Mutex<HashSet<RegionKey>>,
    }

    impl Recording {
        fn new(kind: TransportKind, refuse: bool) -> Arc<Self> {
            Arc::new(Recording {
                kind,
                refuse,
                held: Mutex::new(HashSet::new()),
            })
        }
        fn holds(&self, key: RegionKey) -> bool {
            self.held.lock().unwrap().contains(&key)
        }
    }

    impl Transport for Recording {
        fn kind(&self) -> TransportKind {
            self.kind
        }
        fn availability(&self) -> Availability {
            Availability {
                kind: self.kind,
                compiled: true,
                usable: true,
                detail: "recording".into(),
                devices: Vec::new(),
                rails: Vec::new(),
            }
        }
        fn register_region(&self, region: &RegionEntry) -> Result<Option<Vec<u8>>> {
            if self.refuse {
                return Err(Error::ResourceExhausted("the device has no room".into()));
            }
            self.held.lock().unwrap().insert(region.key());
            Ok(Some(vec![7]))
        }
        fn deregister_region(&self, key: RegionKey) {
            self.held.lock().unwrap().remove(&key);
        }
    }

    fn entry(block: &Arc<dyn MemoryBlock>) -> RegionEntry {
        RegionEntry::new(RegionKey::random().unwrap(), Access::READ_WRITE, block.clone()).unwrap()
    }

    #[test]
    fn a_region_the_table_refuses_is_taken_back_from_every_transport() {
        let rdma = Recording::new(TransportKind::Rdma, false);
        let transports: Vec<Arc<dyn Transport>> = vec![rdma.clone()];
        let table = ShardedLock::new(RegionTable::new());
        let block: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(vec![0u8; 4096]));
        let first = register_entry(&transports, &table, entry(&block)).unwrap();
        assert!(rdma.holds(first.key()));
        let overlapping = entry(&block);
        let key = overlapping.key();
        let refused = register_entry(&transports, &table, overlapping);
        assert!(refused.is_err(), "the table refuses an overlap");
        assert!(
            !rdma.holds(key),
            "the refused region is still registered with the transport"
        );
        assert!(rdma.holds(first.key()), "the first region is untouched");
    }

    #[test]
    fn a_region_a_data_path_refuses_stays_reachable_over_the_control_link() {
        let tcp = Recording::new(TransportKind::Tcp, false);
        let rdma = Recording::new(TransportKind::Rdma, true);
        let transports: Vec<Arc<dyn Transport>> = vec![tcp.clone(), rdma.clone()];
        let table = ShardedLock::new(RegionTable::new());
        let block: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(vec![0u8; 4096]));
        let e = entry(&block);
        let key = e.key();
        let registered = register_entry(&transports, &table, e).expect("tcp reaches it");
        assert!(tcp.holds(key));
        assert!(!rdma.holds(key));
        let kinds: Vec<TransportKind> = registered.advert().transport_keys.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            kinds,
            [TransportKind::Tcp],
            "the advert carries no key of the refusing transport, so peers do not try it"
        );
        assert_eq!(table.read().unwrap().len(), 1);
    }

    #[test]
    fn a_region_the_control_link_refuses_is_taken_back_from_the_others() {
        let rdma = Recording::new(TransportKind::Rdma, false);
        let tcp = Recording::new(TransportKind::Tcp, true);
        let transports: Vec<Arc<dyn Transport>> = vec![rdma.clone(), tcp];
        let table = ShardedLock::new(RegionTable::new());
        let block: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(vec![0u8; 4096]));
        let e = entry(&block);
        let key = e.key();
        let refused = register_entry(&transports, &table, e);
        assert!(matches!(refused, Err(Error::ResourceExhausted(_))), "{refused:?}");
        assert!(!rdma.holds(key));
        assert_eq!(table.read().unwrap().len(), 0);
    }
}
