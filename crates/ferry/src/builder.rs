//! What an engine is built with: [`EngineBuilder`], its options, their defaults and their checks.
//! The engine keeps the builder it was started from as its options; starting it is the engine's
//! ([`EngineBuilder::build`], in `engine.rs`).

use std::sync::Arc;
use std::time::Duration;

use ferry_core::codec::Limits;
use ferry_core::{BufferPool, Error, PciAddress, Result, TransportKind};
use ferry_tcp::{ServerConfig, TlsConfig};

use crate::capabilities::TransportOptions;
use crate::directory::Directory;
use crate::policy::PathPolicy;

/// Default number of TCP streams per link.
pub const DEFAULT_STREAMS: usize = 2;
/// Default bound on bytes in flight per link.
pub const DEFAULT_MAX_INFLIGHT_BYTES: u64 = 64 << 20;
/// HIXL's default connect timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_millis(1000);
/// Default bound on the bytes of undrained notifications ([`EngineBuilder::max_notification_bytes`]).
pub const DEFAULT_MAX_NOTIFICATION_BYTES: usize = 64 << 20;
/// Default share of them one authenticated peer may hold
/// ([`EngineBuilder::max_notification_bytes_per_peer`]).
pub const DEFAULT_MAX_NOTIFICATION_BYTES_PER_PEER: usize = 16 << 20;

/// Configures and starts an [`Engine`](crate::Engine) (HIXL `Initialize`).
#[derive(Debug, Clone)]
pub struct EngineBuilder {
    pub(crate) listen: Option<String>,
    pub(crate) buffer_pool: BufferPool,
    pub(crate) buffer_pool_error: Option<Error>,
    pub(crate) max_links: usize,
    pub(crate) max_pending_notifications: usize,
    pub(crate) max_notification_bytes: usize,
    pub(crate) max_notification_bytes_per_peer: usize,
    pub(crate) streams: usize,
    pub(crate) max_inflight_bytes: u64,
    pub(crate) limits: Limits,
    pub(crate) handshake_timeout: Duration,
    pub(crate) first_bytes_timeout: Duration,
    pub(crate) admission: ferry_tcp::AdmissionLimits,
    pub(crate) link_limits: ferry_tcp::LinkLimits,
    pub(crate) send_timeout: Duration,
    pub(crate) transport_options: TransportOptions,
    pub(crate) allowed: Option<Vec<TransportKind>>,
    pub(crate) tls: Option<TlsConfig>,
    pub(crate) metrics: Option<crate::metrics::Metrics>,
    pub(crate) name: Option<String>,
    pub(crate) directory: Option<DirectoryHandle>,
    pub(crate) path_policy: PathPolicy,
    pub(crate) integrity: bool,
    pub(crate) stage_gpu_memory: bool,
}

/// A directory as the builder keeps it (the trait object has no `Debug`).
#[derive(Clone)]
pub(crate) struct DirectoryHandle(pub(crate) Arc<dyn Directory>);

impl std::fmt::Debug for DirectoryHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Directory")
    }
}

impl Default for EngineBuilder {
    fn default() -> Self {
        EngineBuilder {
            listen: None,
            buffer_pool: BufferPool::DEFAULT,
            buffer_pool_error: None,
            max_links: ferry_core::DEFAULT_MAX_LINKS,
            max_pending_notifications: ferry_core::DEFAULT_MAX_PENDING_NOTIFICATIONS,
            max_notification_bytes: DEFAULT_MAX_NOTIFICATION_BYTES,
            max_notification_bytes_per_peer: DEFAULT_MAX_NOTIFICATION_BYTES_PER_PEER,
            streams: DEFAULT_STREAMS,
            max_inflight_bytes: DEFAULT_MAX_INFLIGHT_BYTES,
            limits: Limits::default(),
            handshake_timeout: Duration::from_secs(10),
            first_bytes_timeout: Duration::from_secs(2),
            admission: ferry_tcp::AdmissionLimits::default(),
            link_limits: ServerConfig::default().link_limits,
            send_timeout: ferry_tcp::DEFAULT_SEND_TIMEOUT,
            transport_options: TransportOptions::default(),
            allowed: None,
            tls: None,
            metrics: None,
            name: None,
            directory: None,
            path_policy: PathPolicy::Any,
            integrity: false,
            stage_gpu_memory: true,
        }
    }
}

impl EngineBuilder {
    /// Listens on `addr` ("ip:port"; port 0 lets the OS choose). Without it the engine is a client only.
    pub fn listen(mut self, addr: impl Into<String>) -> Self {
        self.listen = Some(addr.into());
        self
    }

    /// HIXL's buffer pool option (the coalescing pool), `"BUFFER_NUM:BUFFER_SIZE_MB"`: `"4:8"` by default, `"0:0"` off.
    /// An invalid value makes [`build`](Self::build) fail with `InvalidArgument`.
    pub fn buffer_pool(mut self, spec: &str) -> Self {
        match spec.parse() {
            Ok(p) => {
                self.buffer_pool = p;
                self.buffer_pool_error = None;
            }
            Err(e) => self.buffer_pool_error = Some(e),
        }
        self
    }

    /// Most links in each direction (default 512, HIXL's limit): as many incoming as outgoing, counted
    /// apart, so that peers holding every incoming slot cannot stop this engine from connecting out.
    pub fn max_links(mut self, n: usize) -> Self {
        self.max_links = n;
        self
    }

    /// Most undrained notifications per link (default 4096).
    pub fn max_pending_notifications(mut self, n: usize) -> Self {
        self.max_pending_notifications = n;
        self
    }

    /// Most bytes all undrained notifications may hold together, whatever link they came on, closed
    /// links included (default 64 MiB): past it, `notify` is refused with `ResourceExhausted` until the
    /// application takes some.
    pub fn max_notification_bytes(mut self, n: usize) -> Self {
        self.max_notification_bytes = n;
        self
    }

    /// On an engine that authenticates its links, most bytes the undrained notifications of one peer
    /// identity may hold, over all its links (default 16 MiB): past it that peer's `notify` is refused
    /// with `ResourceExhausted`, and the others' still land. (An open engine cannot tell peers apart.)
    pub fn max_notification_bytes_per_peer(mut self, n: usize) -> Self {
        self.max_notification_bytes_per_peer = n;
        self
    }

    /// On an engine that authenticates its links, most incoming links one peer identity may hold at
    /// once (default 64): past it, its next link is refused with `ResourceExhausted` and other peers
    /// still get in.
    pub fn max_links_per_peer(mut self, n: usize) -> Self {
        self.link_limits.max_links_per_identity = n;
        self
    }

    /// On an engine that authenticates its links, most streams one peer identity's incoming links may
    /// declare together (default 1024).
    pub fn max_streams_per_peer(mut self, n: usize) -> Self {
        self.link_limits.max_streams_per_identity = n;
        self
    }

    /// TCP streams per outgoing link (default 2, at most 64).
    pub fn streams(mut self, n: usize) -> Self {
        self.streams = n;
        self
    }

    /// Most bytes in flight per link (default 64 MiB).
    pub fn max_inflight_bytes(mut self, n: u64) -> Self {
        self.max_inflight_bytes = n;
        self
    }

    /// Largest payload a peer may send in one frame (default 1 GiB).
    pub fn max_frame_payload(mut self, n: u64) -> Self {
        self.limits.max_payload = n;
        self
    }

    /// Authenticates every link with mutual TLS (see [`TlsConfig`]): this engine then admits only
    /// peers whose certificates chain to its CA roots, tells nothing to those that do not, and dials
    /// only targets that prove themselves the same way. There is no fallback to plaintext. Without
    /// it, the engine is open to anyone who can reach its port.
    pub fn tls(mut self, config: TlsConfig) -> Self {
        self.tls = Some(config);
        self
    }

    /// How long a new incoming connection may take to authenticate and say hello (default 10 s);
    /// past it the connection is closed.
    pub fn handshake_timeout(mut self, t: Duration) -> Self {
        self.handshake_timeout = t;
        self
    }

    /// How long data sent on a link may wait unacknowledged, because the peer died or stopped
    /// reading, before the link is given up (default 30 s; `TCP_USER_TIMEOUT`, with keepalive probes on
    /// idle connections, so no timer runs per send).
    pub fn send_timeout(mut self, t: Duration) -> Self {
        self.send_timeout = t;
        self
    }

    /// How long a new incoming connection may stay silent before its first byte (default 2 s, and
    /// never past [`handshake_timeout`](Self::handshake_timeout)); past it the connection is closed.
    pub fn first_bytes_timeout(mut self, t: Duration) -> Self {
        self.first_bytes_timeout = t;
        self
    }

    /// Most incoming connections at once that are not yet admitted (default 256). When they are all
    /// taken, a newcomer displaces the one that has shown least (silent before handshaking), oldest
    /// first, and never one that has authenticated; it is closed only when every waiting connection
    /// has. So connections that never authenticate cost a bounded amount, never hold a link slot, and
    /// cannot keep a peer that handshakes promptly out.
    pub fn max_pending_handshakes(mut self, n: usize) -> Self {
        self.admission.places = n;
        self
    }

    /// Most of the connections awaiting admission that may come from one source address (default
    /// 128): one host flooding the engine displaces only its own connections once it has this many.
    pub fn max_pending_handshakes_per_source(mut self, n: usize) -> Self {
        self.admission.per_source = n;
        self
    }

    /// Restricts the data paths this engine offers to `kinds` (all usable ones by default). TCP stays
    /// the control channel either way; without it in the list, a peer with no other path in common
    /// is refused with `Unsupported` instead of falling back.
    pub fn transports(mut self, kinds: impl IntoIterator<Item = TransportKind>) -> Self {
        self.allowed = Some(kinds.into_iter().collect());
        self
    }

    /// HIXL's RDMA traffic class, 0..=255 and a multiple of 4 (default 132).
    pub fn rdma_traffic_class(mut self, tc: u8) -> Self {
        self.transport_options.rdma_traffic_class = tc;
        self
    }

    /// HIXL's RDMA service level, 0..=7 (default 4).
    pub fn rdma_service_level(mut self, sl: u8) -> Self {
        self.transport_options.rdma_service_level = sl;
        self
    }

    /// The RDMA device to use ("rxe0", "mlx5_0"); the first with an active port by default.
    pub fn rdma_device(mut self, name: impl Into<String>) -> Self {
        self.transport_options.rdma_device = Some(name.into());
        self
    }

    /// The RDMA devices to use, one rail each: batches are spread over them (see `ferry_rdma`'s
    /// `multirail`). By default every device with an active port (or those `FERRY_RDMA_DEVICES`
    /// names, comma-separated).
    pub fn rdma_devices<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.transport_options.rdma_devices = names.into_iter().map(Into::into).collect();
        self
    }

    /// Says that RDMA device `device` sits on NUMA node `node` (`None`: on none), whatever sysfs says.
    /// A region's slices go to the rails on its memory's node first; see `ferry_rdma`'s `topology`.
    /// Without any, `FERRY_RDMA_NUMA` (`rxe0=0,rxe1=1`, `any` for no node) is read.
    pub fn rdma_numa_node(mut self, device: impl Into<String>, node: Option<u32>) -> Self {
        self.transport_options.rdma_numa_nodes.push((device.into(), node));
        self
    }

    /// Says that the memory of PCI device `device` (a GPU) prefers RDMA rails `rails`, whatever the
    /// PCIe fabric in sysfs says (see `ferry_rdma`'s `topology`). Without any, `FERRY_RDMA_DEVICE_RAILS`
    /// (`0000:3b:00.0=mlx5_0+mlx5_1,0000:86:00.0=mlx5_2`) is read.
    pub fn rdma_device_rails<I, S>(mut self, device: PciAddress, rails: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let rails = rails.into_iter().map(Into::into).collect();
        self.transport_options.rdma_device_rails.push((device, rails));
        self
    }

    /// The engine's name in its [`directory`](Self::directory) ("decode-7").
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Which data paths this engine's links may take (see [`PathPolicy`]); the best both ends offer
    /// by default. [`Engine::connect_with`](crate::Engine::connect_with) sets it for one link.
    pub fn path_policy(mut self, policy: PathPolicy) -> Self {
        self.path_policy = policy;
        self
    }

    /// Whether transfers check their bytes end to end unless one says otherwise
    /// ([`TransferOptions::integrity`](crate::TransferOptions::integrity)); off by default. A transfer
    /// with integrity completes `Ok` only if the CRC32C of every range at the destination, after it
    /// landed, is the one it had at the source; else [`Error::Integrity`](crate::Error::Integrity)
    /// (retryable). It costs a round trip over the link (over RDMA, a fence of the queue pairs that
    /// carried WRITEs first) and a checksum pass over the bytes at each end.
    pub fn integrity(mut self, on: bool) -> Self {
        self.integrity = on;
        self
    }

    /// Whether GPU memory may move through a host copy (a staging buffer its owner copies to and from
    /// the device) where no path reaches the device memory itself: allowed by default. Refused, a
    /// transfer that would stage GPU memory at either end fails at [`Engine::start`](
    /// crate::Engine::start) with `Unsupported` naming the descriptor, the side and why (the local
    /// region is staged memory, or `Peer::routes` says the peer's is reached through its staging
    /// buffer on this link), instead of running at host-copy speed unnoticed. One link may say
    /// otherwise ([`ConnectOptions::stage_gpu_memory`](crate::ConnectOptions::stage_gpu_memory)).
    pub fn stage_gpu_memory(mut self, allowed: bool) -> Self {
        self.stage_gpu_memory = allowed;
        self
    }

    /// Publishes the engine in `directory` under its [`name`](Self::name) when it starts (it must
    /// listen), withdraws it when the engine is dropped, and lets
    /// [`Engine::connect_by_name`](crate::Engine::connect_by_name) and [`Engine::members`](crate::Engine::members) use it. See [`crate::directory`].
    pub fn directory(mut self, directory: Arc<dyn Directory>) -> Self {
        self.directory = Some(DirectoryHandle(directory));
        self
    }

    /// Registers the engine's metrics in `registry`, under `ferry_` (see [`crate::metrics`]): transfers
    /// this engine posts, by peer, transport and operation, and its links, regions and notifications,
    /// read at each scrape. Without it the engine keeps no metrics.
    pub fn metrics(mut self, registry: &mut prometheus_client::registry::Registry) -> Self {
        self.metrics = Some(crate::metrics::Metrics::register(registry));
        self
    }

    /// Bytes of the slices an RDMA batch is cut into and spread over the rails (at least 4 KiB;
    /// default 256 KiB, or `FERRY_RDMA_SLICE`): smaller slices spread a batch more evenly and cost
    /// more work requests.
    pub fn rdma_slice_bytes(mut self, bytes: u64) -> Self {
        self.transport_options.rdma_slice_bytes = Some(bytes);
        self
    }

    /// RDMA queue pairs per pair of rails (1..=8, default 1, or `FERRY_RDMA_QUEUE_PAIRS`): a batch's
    /// slices are spread over all of them, so that a NIC works on several at once.
    pub fn rdma_queue_pairs_per_rail(mut self, n: u8) -> Self {
        self.transport_options.rdma_queue_pairs_per_rail = Some(n);
        self
    }

    /// Busy-poll RDMA completions (lower latency, one core spinning) instead of sleeping on the
    /// completion channel.
    pub fn rdma_busy_poll(mut self, on: bool) -> Self {
        self.transport_options.rdma_busy_poll = on;
        self
    }

    /// Makes persistent RDMA writes persistent only by `method` (the FLUSH verb, a READ after the
    /// writes, or a flush request); a peer that cannot serve it gets no RDMA link. By default the best
    /// method both ends support is used (see [`Peer::persist_method`](crate::Peer::persist_method)).
    pub fn rdma_persist_method(mut self, method: crate::PersistMethod) -> Self {
        self.transport_options.rdma_persist_method = Some(method);
        self
    }

    /// Declares this host's platform ADR with DDIO off (a write that reached the memory controller is
    /// persistent, and the NIC writes to memory, not into the CPU's cache): RDMA initiators may then
    /// make their writes persistent with a READ after them. Off by default and never assumed: on a
    /// platform without ADR, or with DDIO on, such writes are lost on power failure.
    pub fn adr_without_ddio(mut self, declared: bool) -> Self {
        self.transport_options.adr_without_ddio = declared;
        self
    }

    pub(crate) fn validate(&self) -> Result<()> {
        self.transport_options.validate()?;
        if let Some(e) = &self.buffer_pool_error {
            return Err(e.clone());
        }
        if self.max_links == 0 {
            return Err(Error::InvalidArgument("max_links must be at least 1".into()));
        }
        if self.max_pending_notifications == 0 {
            return Err(Error::InvalidArgument(
                "max_pending_notifications must be at least 1".into(),
            ));
        }
        if !(1..=ferry_tcp::MAX_STREAMS_PER_LINK as usize).contains(&self.streams) {
            return Err(Error::InvalidArgument(format!(
                "streams must be 1 to {}, not {}",
                ferry_tcp::MAX_STREAMS_PER_LINK,
                self.streams
            )));
        }
        if self.max_inflight_bytes < 1 << 20 {
            return Err(Error::InvalidArgument(
                "max_inflight_bytes must be at least 1 MiB".into(),
            ));
        }
        Ok(())
    }

    pub(crate) fn validate_directory(&self) -> Result<()> {
        match (&self.name, &self.directory, &self.listen) {
            (Some(_), Some(_), Some(_)) | (None, None, _) => Ok(()),
            (Some(name), Some(_), None) => Err(Error::InvalidArgument(format!(
                "engine {name} is published in a directory but does not listen: give it a listen address"
            ))),
            (None, Some(_), _) => Err(Error::InvalidArgument(
                "an engine published in a directory needs a name (EngineBuilder::name)".into(),
            )),
            (Some(name), None, _) => Err(Error::InvalidArgument(format!(
                "engine {name} has a name but no directory to publish it in (EngineBuilder::directory)"
            ))),
        }
    }
}
