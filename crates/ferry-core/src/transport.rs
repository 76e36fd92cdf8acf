//! The contracts between the engine and its transports.
//!
//! The engine owns the region table and the notification queue; transports move bytes. A transport
//! is told about every region as it is registered (so that an RDMA transport can register it with its
//! NIC and return an rkey, which travels in the region's advert), says whether it is usable on this
//! host, and builds a [`DataLink`] per peer. The engine picks, per peer, the best transport both ends
//! offer and reports which one it picked.
//!
//! On the target side a transport serves remote operations against the [`EngineContext`]: it resolves
//! every operation in the region table before touching memory and delivers notifications to the
//! [`Notifier`].

use std::sync::Arc;

use crate::sync::ShardedLock;
use crate::sync::shim::{AtomicUsize, Ordering};

use futures::future::BoxFuture;

use crate::error::{Error, Result};
use crate::peer_view::{PeerNames, PeerScope, PeerView};
use crate::region::{RegionEntry, RegionTable, Resolved};
use crate::types::{Access, Durability, Notification, Op, PeerIdentity, PersistMethod, RegionKey, TransportKind};

/// Whether a transport can be used on this host, and why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Availability {
    /// Which transport.
    pub kind: TransportKind,
    /// Whether it is compiled in.
    pub compiled: bool,
    /// Whether it can be used here.
    pub usable: bool,
    /// Why it cannot be used, or what it uses.
    pub detail: String,
    /// Devices it found (RDMA devices, for example).
    pub devices: Vec<String>,
    /// The rails it opened and where each sits (RDMA; empty for the others).
    pub rails: Vec<RailPlace>,
}

/// Where one rail's device sits, and the memory it is preferred for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailPlace {
    /// Device name ("mlx5_0").
    pub device: String,
    /// Its NUMA node, where one is known.
    pub numa_node: Option<u32>,
    /// Where the node came from ("device", "network device", "override", "unknown").
    pub source: &'static str,
    /// The NUMA nodes whose memory prefers this rail (the others use it only as a fallback).
    pub preferred_for: Vec<u32>,
    /// The device's PCI function, where it has one (a software device's is its network device's).
    pub pci_address: Option<crate::PciAddress>,
    /// The GPUs of this host whose memory prefers this rail (nearest on the PCIe fabric, or named by
    /// an override).
    pub preferred_for_devices: Vec<crate::PciAddress>,
}

/// One rail of a multi-rail link, as it stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailStats {
    /// The local device and the peer's rail ("mlx5_0->1").
    pub name: String,
    /// Bytes of transfers completed on it.
    pub bytes: u64,
    /// Transfers that failed on it and were posted again on another rail.
    pub errors: u64,
    /// Whether new work goes to it (a failed rail rests, then is tried again).
    pub healthy: bool,
    /// Its measured throughput while busy, which spraying weighs it by; `None` until measured.
    pub bytes_per_second: Option<u64>,
}

/// A data path a link can use.
pub trait Transport: Send + Sync + 'static {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;
    /// Whether it is usable on this host.
    fn availability(&self) -> Availability;
    /// Called for every region the engine registers, before peers learn of it. Returns the key peers
    /// need to reach the region through this transport (an RDMA rkey), if any.
    fn register_region(&self, region: &RegionEntry) -> Result<Option<Vec<u8>>> {
        let _ = region;
        Ok(None)
    }
    /// Called when a region is deregistered, after its access guard closed (no new permit is given)
    /// and before the engine waits for the permits still held. Returns once the transport will not
    /// touch the region again: permits its own pending accesses hold are released (an RDMA transport
    /// halts the queue pairs whose work requests use the region, drains them, and deregisters the
    /// region from the NIC here). May block for a bounded time; the engine's async deregistration
    /// calls it off the runtime's threads when [`deregister_blocks`](Self::deregister_blocks) says so.
    fn deregister_region(&self, key: RegionKey) {
        let _ = key;
    }
    /// Called after the grants of region `key` changed (a revoke), once new operations see the
    /// change. Resolves when every access the transport lets a peer hold outside the operations the
    /// engine counts (a mapping of the region lent to a peer of this host) is one the peer's grants
    /// still allow. The engine bounds the wait.
    fn access_changed(&self, key: RegionKey) -> BoxFuture<'static, ()> {
        let _ = key;
        Box::pin(async {})
    }
    /// Whether [`deregister_region`](Self::deregister_region) may block (halting and draining queue
    /// pairs), so that async callers run it on a blocking thread.
    fn deregister_blocks(&self) -> bool {
        false
    }
    /// Initiator side: builds a data link to a peer whose control link is `control`, exchanging
    /// setup data over it. Transports without a link of their own (TCP, which is the control link)
    /// answer `Unsupported`.
    fn connect<'a>(&'a self, control: &'a dyn SetupExchange) -> BoxFuture<'a, Result<Arc<dyn DataLink>>> {
        let _ = control;
        Box::pin(async move {
            Err(Error::Unsupported(format!(
                "{} builds no separate data link",
                self.kind()
            )))
        })
    }
    /// Target side, on an engine that authenticates its links: the transport's state for the peer of
    /// a link just admitted, where the transport gives each peer its own keys (see [`PeerScope`]).
    /// `None` (the default): the region's one transport key serves every peer.
    fn peer_scope(&self, link: u64) -> Result<Option<Arc<dyn PeerScope>>> {
        let _ = link;
        Ok(None)
    }
    /// Target side: answers an initiator's setup data with its own, and the data path it set up,
    /// which the control link keeps as long as it lives and drops when it closes.
    fn accept(&self, setup: AcceptSetup<'_>) -> Result<(Vec<u8>, Box<dyn AcceptedPath>)> {
        let _ = setup;
        Err(Error::Unsupported(format!(
            "{} accepts no separate data link",
            self.kind()
        )))
    }
}

/// A data path a target set up for one link (an RDMA queue pair and the task answering on it). The
/// link's control channel holds it for the link's life; dropping it tears the path down.
pub trait AcceptedPath: Send + Sync + 'static {
    /// The transport it belongs to.
    fn kind(&self) -> TransportKind;
    /// Which of the link's paths of that transport it is (an RDMA link has one queue pair per pair
    /// of rails): a new path of the same kind and lane replaces the old one.
    fn lane(&self) -> u8 {
        0
    }
}

/// What a target-side transport gets when a peer sets up a data link.
pub struct AcceptSetup<'a> {
    /// The link's id (the one notifications are counted under).
    pub link: u64,
    /// The initiator's setup data.
    pub blob: &'a [u8],
    /// Where notifications that arrive over the new data path go.
    pub notifier: Arc<dyn Notifier>,
    /// The initiator's engine id.
    pub peer_engine: u64,
    /// The initiator's address.
    pub peer_addr: &'a str,
    /// What the initiator sees of this engine: who it proved to be (on an authenticated link) and
    /// the names it knows regions by.
    pub peer: &'a Arc<PeerView>,
    /// The engine's region table, for requests that arrive over the new data path (an RDMA commit
    /// request, which must travel behind the data it commits). Weak: the transport is part of it.
    pub context: std::sync::Weak<EngineContext>,
}

/// A control link over which a transport exchanges its setup data with the peer.
pub trait SetupExchange: Send + Sync {
    /// Sends `blob` for transport `kind` and returns the peer's answer.
    fn exchange(&self, kind: TransportKind, blob: Vec<u8>) -> BoxFuture<'_, Result<Vec<u8>>>;
    /// A handle the data link may keep: notifications and liveness go over the control link.
    fn control_link(&self) -> Arc<dyn DataLink>;
    /// An owned handle on this exchange, for a data link that sets its path up again later (an RDMA
    /// link replacing a failed queue pair); `None` where the control link cannot lend one.
    fn handle(&self) -> Option<Arc<dyn SetupExchange>> {
        None
    }
}

/// One element of a transfer, resolved on both sides.
#[derive(Debug, Clone)]
pub struct TransferItem {
    /// Local memory.
    pub local: Resolved,
    /// The remote region's key.
    pub remote_key: RegionKey,
    /// Offset inside the remote region.
    pub remote_offset: u64,
    /// The remote address of the first byte (region address + offset), for transports that address
    /// remote memory directly.
    pub remote_addr: u64,
    /// The remote region's key for the link's transport (an RDMA rkey), if it advertised one.
    pub remote_transport_key: Option<crate::TransportKey>,
    /// What the remote region grants.
    pub remote_access: Access,
}

impl TransferItem {
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.local.len
    }
    /// Never true: zero-length descriptors are refused when resolved.
    pub fn is_empty(&self) -> bool {
        self.local.len == 0
    }
    /// The `len` bytes of this item from byte `from` on, both sides moved alike (the caller keeps
    /// `from + len` within [`len`](Self::len)).
    pub fn part(&self, from: u64, len: u64) -> TransferItem {
        debug_assert!(from + len <= self.local.len);
        let mut part = self.clone();
        part.local.offset += from;
        part.local.len = len;
        part.remote_offset += from;
        part.remote_addr += from;
        part
    }
}

/// A batch of one-sided operations towards one peer.
#[derive(Debug, Clone)]
pub struct TransferRequest {
    /// Read or write.
    pub op: Op,
    /// What a write's completion promises.
    pub durability: Durability,
    /// The descriptors, in the caller's order.
    pub items: Vec<TransferItem>,
    /// Whether the link checks the batch's bytes end to end itself, as it carries them: only asked
    /// of a link that [checks in band](DataLink::checks_in_band); the engine checks every other
    /// batch with integrity after its data moved.
    pub checked: bool,
}

/// The items of a batch that a data link left to the engine: regions its transport does not reach
/// (memory the NIC could not register, device memory staged by its owner, a peer that does not lend a
/// region to a same-host link), or items it could not carry because every path of it failed while the
/// control link still stands. The engine sends them over the peer's control link (TCP, which reaches
/// every region) as part of the same batch, under the same bound: the batch completes when they have.
///
/// So a transport never calls another one: it says what it did not do, and the engine, which owns
/// both links, routes it. The control link itself never declines anything.
#[derive(Debug, Default)]
#[must_use = "a batch is done only once what its link declined went over the control link"]
pub struct Declined(Vec<TransferItem>);

impl Declined {
    /// Nothing declined: the link carried the whole batch.
    pub fn none() -> Self {
        Declined(Vec::new())
    }

    /// These items declined (none when empty).
    pub fn items(items: Vec<TransferItem>) -> Self {
        Declined(items)
    }

    /// Whether the link carried the whole batch.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// How many items it declined.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The declined items.
    pub fn iter(&self) -> impl Iterator<Item = &TransferItem> {
        self.0.iter()
    }

    /// Adds what another part of the batch declined.
    pub fn extend(&mut self, other: Declined) {
        self.0.extend(other.0);
    }

    /// The declined items, to send elsewhere.
    pub fn into_items(self) -> Vec<TransferItem> {
        self.0
    }
}

/// How a link reaches one of its peer's regions ([`DataLink::route`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Route {
    /// The transport that carries transfers to it.
    pub transport: TransportKind,
    /// How, in words ("mapped into this process", "NIC to NIC on 2 rails").
    pub how: String,
    /// Why this link's better path does not carry it, where it does not.
    pub passed_over: Option<String>,
    /// Whether its bytes pass through a host copy in front of the peer's device memory (GPU memory
    /// staged by its owner) on this route.
    pub staged: bool,
}

impl Route {
    /// Carried by `transport`, `how`.
    pub fn by(transport: TransportKind, how: impl Into<String>) -> Self {
        Route {
            transport,
            how: how.into(),
            passed_over: None,
            staged: false,
        }
    }

    /// The same route, its bytes staged or not (see [`staged`](Self::staged)).
    pub fn staged(mut self, staged: bool) -> Self {
        self.staged = staged;
        self
    }

    /// `region` left to the control link (TCP), because `why`. Staged as the region is: over the
    /// control link the owner's process copies staged memory through its host buffer.
    pub fn declined(region: &crate::RegionAd, why: impl Into<String>) -> Self {
        Route {
            transport: TransportKind::Tcp,
            how: "over the control link".into(),
            passed_over: Some(why.into()),
            staged: region.staged,
        }
    }
}

/// The data path to one peer.
pub trait DataLink: Send + Sync + 'static {
    /// Which transport carries it.
    fn kind(&self) -> TransportKind;
    /// Runs a batch; completes when every descriptor it carried has been applied at its destination,
    /// with the items it left to the control link ([`Declined`]), which the caller must still send.
    /// The future owns what it needs: dropping it abandons the result, not the memory safety.
    ///
    /// A link does not bound a batch in time: its caller does, by dropping the future (the engine's
    /// `Transfer` holds the one timer of a batch). Once the drop returns no byte lands in the batch's
    /// local memory; what the link still holds for it (an operation awaiting the peer's answer) it
    /// takes back at once where it can (TCP), else releases when the answer comes or the link ends.
    /// What a link times is itself: a silent peer, which fails every batch on the link.
    fn transfer(&self, request: TransferRequest) -> BoxFuture<'static, Result<Declined>>;
    /// Runs `request` at once, on the calling thread, if it needs no waiting at all (ranges of
    /// regions this process has mapped, copied with no system call), and says how it ended; `None`,
    /// with nothing done, when it must go through [`transfer`](Self::transfer) (so also whenever it
    /// would decline any of it). It is called from a
    /// future's `poll`, so it must never block. The default runs nothing inline.
    ///
    /// Why it exists: a batch done in a few hundred nanoseconds would otherwise spend a good part of
    /// them allocating, polling and freeing the future that [`transfer`](Self::transfer) boxes.
    fn transfer_now(&self, request: &TransferRequest) -> Option<Result<()>> {
        let _ = request;
        None
    }
    /// Waits until every WRITE this link completed is in the target's memory as the target's CPU
    /// sees it. Where a completion already means that (TCP, whose target acknowledges after its own
    /// copy; shared memory), it is done at once, the default. An RDMA WRITE's completion means the
    /// target's NIC acknowledged it, not that its bytes are placed: an RDMA link asks, on each queue
    /// pair that carried WRITEs, for an answer the target gives only after them. What reads the
    /// target's memory on its CPU after a transfer (an integrity check's sums) waits for this first.
    fn fence_writes(&self) -> BoxFuture<'static, Result<()>> {
        Box::pin(async { Ok(()) })
    }
    /// Whether this link can check a batch's bytes end to end as it carries them (a request with
    /// [`checked`](TransferRequest::checked) set): the CRC32C of each frame's bytes at the source,
    /// against the destination's of what landed, taken right after it landed, while both are in
    /// cache. A batch checked so needs no second pass over its ranges after it completed. The
    /// default: no, the engine checks.
    fn checks_in_band(&self) -> bool {
        false
    }
    /// Sends a notification; completes when the peer queued it. Ordered after every transfer that
    /// completed before it was called.
    fn notify(&self, notification: Notification) -> BoxFuture<'static, Result<()>>;
    /// How this link makes a [`Durability::Persistent`] write persistent (for regions that allow it;
    /// a transfer may fall back to [`PersistMethod::FlushRequest`] for regions that do not).
    fn persist_method(&self) -> PersistMethod;
    /// Closes the link; outstanding operations fail with `PeerClosed`.
    fn close(&self) -> BoxFuture<'static, ()>;
    /// Whether the link is closed (by either side, or by a failure).
    fn is_closed(&self) -> bool;
    /// What this link hands to the control link instead of carrying it, and why (a same-host link
    /// the kernel denies cross-memory attach carries only the regions lent to it). `None` when it
    /// carries every region itself.
    fn fallback_note(&self) -> Option<String> {
        None
    }
    /// How transfers to the peer's region `region` travel over this link, and why a better path of
    /// the link does not carry them where it does not. The default: this link's transport, as is.
    fn route(&self, region: &crate::types::RegionAd) -> Route {
        match region.staged {
            true => Route::by(
                self.kind(),
                format!(
                    "over {}, through the peer's staging buffer (device memory it copies to and from)",
                    self.kind()
                ),
            )
            .staged(true),
            false => Route::by(self.kind(), format!("over {}", self.kind())),
        }
    }
    /// Each rail of a link that spreads its batches over several (RDMA on several NICs), with what
    /// it carried; empty for a link of one path.
    fn rails(&self) -> Vec<RailStats> {
        Vec::new()
    }
}

/// A [`DataLink`] that carries nothing: every transfer and notification fails with `Unsupported`,
/// and it is never closed. What a transport's own tests give its link as the control link (the
/// same-host link sends notifications over it, the RDMA link watches it for liveness), where nothing
/// should go that way.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoControlLink;

impl DataLink for NoControlLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }
    fn transfer(&self, _: TransferRequest) -> BoxFuture<'static, Result<Declined>> {
        Box::pin(async {
            Err(Error::Unsupported(
                "no control link here: nothing may go over it".into(),
            ))
        })
    }
    fn notify(&self, _: Notification) -> BoxFuture<'static, Result<()>> {
        Box::pin(async {
            Err(Error::Unsupported(
                "no control link here: nothing may go over it".into(),
            ))
        })
    }
    fn persist_method(&self) -> PersistMethod {
        PersistMethod::FlushRequest
    }
    fn close(&self) -> BoxFuture<'static, ()> {
        Box::pin(async {})
    }
    fn is_closed(&self) -> bool {
        false
    }
}

/// A change to the region table that connected peers are told about (over each link's control stream).
#[derive(Debug, Clone)]
pub enum RegionChange {
    /// A region was registered.
    Added(crate::types::RegionAd),
    /// A region was deregistered.
    Removed(RegionKey),
}

/// Where transports deliver notifications that arrive for this engine.
pub trait Notifier: Send + Sync + 'static {
    /// Queues a notification from the link `link`; `ResourceExhausted` when that link already has the
    /// maximum pending. `from_identity` is who the link's peer proved to be, on an authenticated link.
    fn deliver(
        &self,
        link: u64,
        from_engine: u64,
        from_addr: &str,
        from_identity: Option<&PeerIdentity>,
        notification: Notification,
    ) -> Result<()>;
    /// The link is gone: its pending notifications stay, but no longer count against a live link.
    fn link_closed(&self, link: u64);
}

/// Counts links against the engine's maximum (HIXL: 512).
#[derive(Debug)]
pub struct LinkSlots {
    used: AtomicUsize,
    max: usize,
}

impl LinkSlots {
    /// A counter allowing `max` links.
    pub fn new(max: usize) -> Self {
        LinkSlots {
            used: AtomicUsize::new(0),
            max,
        }
    }

    /// Takes a slot, or fails with `ResourceExhausted`.
    pub fn acquire(self: &Arc<Self>) -> Result<LinkSlot> {
        let mut cur = self.used.load(Ordering::Acquire);
        loop {
            if cur >= self.max {
                return Err(Error::ResourceExhausted(format!(
                    "the engine already has {cur} links, its maximum (raise max_links or disconnect a peer)"
                )));
            }
            match self
                .used
                .compare_exchange(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(LinkSlot { slots: self.clone() }),
                Err(actual) => cur = actual,
            }
        }
    }

    /// Links in use.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// The most links it allows.
    pub fn limit(&self) -> usize {
        self.max
    }
}

/// One link's slot; released on drop.
#[derive(Debug)]
pub struct LinkSlot {
    slots: Arc<LinkSlots>,
}

impl Drop for LinkSlot {
    fn drop(&mut self) {
        self.slots.used.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What the target side of every transport serves from.
pub struct EngineContext {
    /// This engine's random id.
    pub engine_id: u64,
    /// Identifies this host (for choosing shared memory).
    pub host_id: u64,
    /// The registered regions.
    pub regions: ShardedLock<RegionTable>,
    /// The notification queue.
    pub notifier: Arc<dyn Notifier>,
    /// Links other engines opened to this one. Counted apart from [`outgoing`](Self::outgoing), so that
    /// peers that fill every incoming slot cannot stop this engine from connecting out.
    pub incoming: Arc<LinkSlots>,
    /// Links this engine opened.
    pub outgoing: Arc<LinkSlots>,
    /// Transports usable here, best first.
    pub transports: Vec<TransportKind>,
    /// The transports themselves, for answering a peer's setup of a data link.
    pub acceptors: Vec<Arc<dyn Transport>>,
    /// The secret authenticated peers' names for regions are derived from (see [`crate::peer_view`]).
    pub peer_names: Arc<PeerNames>,
    /// What this engine served to peers over the control link's streams (see [`Served`]).
    pub served: Served,
}

/// Remote operations this engine's CPU served over TCP streams, counted when answered: what a
/// target sees of the traffic to it. One-sided RDMA operations and copies into memory a same-host
/// peer mapped never reach it; the initiator counts those.
#[derive(Debug, Default)]
pub struct Served {
    /// WRITE requests completed.
    pub writes: std::sync::atomic::AtomicU64,
    /// Their bytes.
    pub write_bytes: std::sync::atomic::AtomicU64,
    /// READ requests answered with their data.
    pub reads: std::sync::atomic::AtomicU64,
    /// Their bytes.
    pub read_bytes: std::sync::atomic::AtomicU64,
}

impl Served {
    /// Counts a request of `op` that moved `bytes`.
    pub fn count(&self, op: Op, bytes: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let (ops, total) = match op {
            Op::Write => (&self.writes, &self.write_bytes),
            Op::Read => (&self.reads, &self.read_bytes),
        };
        ops.fetch_add(1, Relaxed);
        total.fetch_add(bytes, Relaxed);
    }
}

impl EngineContext {
    /// Resolves a remote operation of `peer` on the region it names `key` (see [`PeerView::real_key`])
    /// against the region table and the region's grants (see [`RegionTable::resolve_for`]).
    /// A refusal names the region by `key`, the peer's name for it: from the real key a peer would
    /// recover the mask its keys are derived with.
    pub fn resolve(&self, peer: &PeerView, key: RegionKey, offset: u64, len: u64, op: Op) -> Result<Resolved> {
        let real = peer.real_key(key);
        let resolved = self
            .regions
            .read()
            .map_err(|_| Error::Internal("region table lock poisoned".into()))?
            .resolve_for(peer.identity(), real, offset, len, op.required_access());
        match real == key {
            true => resolved,
            false => resolved.map_err(|e| e.map_message(|m| m.replace(&format!("{real:?}"), &format!("{key:?}")))),
        }
    }

    /// Resolves a remote write that promises `durability`: a persistent write needs a persistent
    /// region, refused with `InvalidArgument` before a byte is written.
    pub fn resolve_write(
        &self,
        peer: &PeerView,
        key: RegionKey,
        offset: u64,
        len: u64,
        durability: Durability,
    ) -> Result<Resolved> {
        let r = self.resolve(peer, key, offset, len, Op::Write)?;
        if durability == Durability::Persistent && !r.region.block().persistent() {
            return Err(Error::InvalidArgument(format!(
                "a persistent write needs a persistent region; region {key:?} is {}",
                r.region.block().kind()
            )));
        }
        Ok(r)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn link_slots_cap_and_release() {
        let slots = Arc::new(LinkSlots::new(2));
        let a = slots.acquire().unwrap();
        let _b = slots.acquire().unwrap();
        assert!(matches!(slots.acquire(), Err(Error::ResourceExhausted(_))));
        drop(a);
        assert!(slots.acquire().is_ok());
    }
}
