//! A connected peer.

use std::net::SocketAddr;
use std::sync::Arc;

use ferry_core::{DataLink, PeerIdentity, RemoteRegions, Result, TransportKind};
use ferry_tcp::TcpLink;

/// A link to a remote engine, made by [`Engine::connect`](crate::Engine::connect). Cheap to clone.
#[derive(Clone)]
pub struct Peer {
    pub(crate) inner: Arc<PeerInner>,
}

pub(crate) struct PeerInner {
    pub(crate) addr: SocketAddr,
    pub(crate) name: String,
    pub(crate) control: TcpLink,
    pub(crate) data: Arc<dyn DataLink>,
    /// The better transports both ends offered that could not be set up, with why.
    pub(crate) passed_over: Vec<(TransportKind, String)>,
    /// The id of the engine that connected it.
    pub(crate) owner: u64,
    /// Whether it is in its engine's peer table (false once disconnected or replaced).
    pub(crate) listed: std::sync::atomic::AtomicBool,
    /// Its transfer counters, on an engine that keeps metrics.
    pub(crate) metrics: Option<crate::metrics::LinkMetrics>,
    /// Whether transfers on it may move GPU memory through a host copy ([`ConnectOptions`](
    /// crate::ConnectOptions), else the engine's setting).
    pub(crate) stage_gpu_memory: bool,
    pub(crate) _slot: ferry_core::LinkSlot,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("addr", &self.inner.addr)
            .field("transport", &self.transport())
            .finish()
    }
}

impl Peer {
    /// The address the peer listens on.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// The name it was connected by.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Who the peer proved to be (the names in its certificate), on an engine that authenticates its
    /// links with mutual TLS; `None` on an open engine.
    pub fn identity(&self) -> Option<&PeerIdentity> {
        self.inner.control.remote_identity()
    }

    /// The data path the engine picked for this peer.
    pub fn transport(&self) -> TransportKind {
        self.inner.data.kind()
    }

    /// The transports better than [`transport`](Self::transport) that both ends offer but that could
    /// not be used for this peer, each with the reason (shared memory with a peer in another PID
    /// namespace, for example), and what the chosen transport hands to the control link with why
    /// (shared memory where the kernel denies cross-memory attach: memory the peer did not allocate
    /// with `alloc_host` moves over TCP). Empty when the engine got the best transport both ends
    /// have, for every region.
    pub fn passed_over(&self) -> &[(TransportKind, String)] {
        &self.inner.passed_over
    }

    /// How transfers to each region the peer advertises travel now (`Route`: the transport, how it
    /// reaches the region, and why this link's better path does not carry it where it does not: a
    /// region the peer's NIC could not register, memory the peer stages in front of a device, a region
    /// a same-host peer does not lend where the kernel denies cross-memory attach). What
    /// [`passed_over`](Self::passed_over) says of the link as a whole, region by region.
    pub fn routes(&self) -> Vec<(ferry_core::RegionAd, ferry_core::Route)> {
        let data = &self.inner.data;
        self.regions().iter().map(|ad| (ad.clone(), data.route(ad))).collect()
    }

    /// The rails of an RDMA link that spreads its batches over several NICs, each with the bytes it
    /// carried, its errors and whether it takes work now; empty for a link of one path.
    pub fn rails(&self) -> Vec<ferry_core::RailStats> {
        self.inner.data.rails()
    }

    /// How a [`Durability::Persistent`](crate::Durability) write to this peer is made persistent:
    /// `flush-before-ack` over TCP; over RDMA the FLUSH verb, a READ after the writes, or a flush
    /// request (a transfer to a region that does not qualify for the link's method falls back to the
    /// flush request).
    pub fn persist_method(&self) -> ferry_core::PersistMethod {
        self.inner.data.persist_method()
    }

    /// The peer's engine id.
    pub fn engine_id(&self) -> u64 {
        self.inner.control.remote_engine()
    }

    /// The regions the peer has advertised, as of now. Registrations it makes later arrive by
    /// themselves.
    pub fn regions(&self) -> RemoteRegions {
        self.inner.control.remote_regions()
    }

    /// Runs `f` on the regions the peer has advertised, as of now, without copying the table (which
    /// [`regions`](Self::regions) does: with thousands of regions, the copy is what a look costs).
    /// `f` runs under the table's read lock: keep it short. `Internal` if the lock is poisoned.
    pub fn with_regions<T>(&self, f: impl FnOnce(&RemoteRegions) -> T) -> Result<T> {
        self.inner.control.with_remote_regions(f)
    }

    /// Waits until the peer's advertised regions change, or `timeout` passes.
    pub async fn regions_changed(&self, timeout: std::time::Duration) {
        self.inner.control.region_update(timeout).await
    }

    /// Whether the link is down (closed by either side, or the peer died).
    pub fn is_closed(&self) -> bool {
        self.inner.data.is_closed() || ferry_core::DataLink::is_closed(&self.inner.control)
    }

    /// Number of TCP streams of the control link.
    pub fn tcp_streams(&self) -> usize {
        self.inner.control.stream_count()
    }
}
