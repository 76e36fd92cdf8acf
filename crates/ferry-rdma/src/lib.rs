//! # ferry-rdma
//!
//! ferry's RDMA verbs transport, on `sideway` (which loads libibverbs at run time, so this crate builds
//! on hosts without RDMA packages and reports the transport unavailable there).
//!
//! - Every active device (or those named) is a rail ([`multirail`]): one protection domain on each,
//!   every region the engine registers is registered on each, a link sets up a queue pair per pair of
//!   rails it uses and spreads each batch over them in slices, and a rail that fails rests while the
//!   others carry its work.
//! - Every region the engine registers is registered with the NIC. On an engine open to anyone its rkey travels in the region's advert; on one that
//!   authenticates its links each accepted link gets a protection domain of its own, with only the
//!   regions its peer was granted ([`scope`]), and the engine's own registrations grant no remote
//!   access.
//! - The target checks that the GID an initiator's queue pair sends from is the address of the TCP
//!   peer that set it up (RoCE), so that a queue pair cannot be set up on behalf of another host.
//! - One RC queue pair per link, connected over the engine's TCP control link (QPN, PSN, GID, MTU
//!   exchanged); the GID is chosen by type (RoCEv2 over IPv4 first), never by a fixed index; the traffic
//!   class and service level are HIXL's options.
//! - One-sided READ and WRITE with scatter-gather and selective signalling ([`link`]); completions in
//!   tokio through the completion channel, or busy polling.
//! - Persistent writes by the FLUSH verb, a READ after the writes, or a flush request that follows the
//!   writes on the queue pair, chosen per link (`persist`).
//! - Deregistration ends the NIC's access before it returns, without waiting for the runtime: it
//!   stops the queue pairs that still use the region and polls their completions itself (`link`).
#![deny(missing_docs)]

mod completions;
mod device;
pub mod link;
mod messages;
mod mr;
pub mod multirail;
mod persist;
mod post;
mod qp;
mod rate;
mod responder;
mod route;
pub mod scope;
pub mod topology;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use ferry_core::{
    AcceptSetup, Access, Availability, DataLink, DeviceAddress, DmaView, Durability, Error, PersistMethod, RegionEntry,
    RegionKey, Result, SetupExchange, Transport, TransportKind,
};
use futures::future::BoxFuture;
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::protection_domain::ProtectionDomain;

pub use device::{OpenDevice, device_names};
pub use link::RdmaLink;
pub use mr::Registered;

/// RDMA options, with HIXL's defaults and ranges.
#[derive(Debug, Clone)]
pub struct RdmaOptions {
    /// Device to use ("rxe0", "mlx5_0"), alone; see `devices`.
    pub device: Option<String>,
    /// Devices to use, each a rail ([`multirail`]); when empty (and `device` is `None`), every device
    /// with an active port.
    pub devices: Vec<String>,
    /// Bytes of the slices a batch is cut into and spread over the rails (at least 4 KiB).
    pub slice_bytes: u64,
    /// Queue pairs per pair of rails (1..=8): more let a NIC work on one peer's slices in parallel.
    pub queue_pairs_per_rail: u8,
    /// Register a large region on every rail at once, a thread per rail (see
    /// [`PARALLEL_REGISTRATION`]); in turn when `false`.
    pub parallel_registration: bool,
    /// NUMA nodes of devices, overriding what sysfs says (`None`: no node, so no memory prefers it
    /// over another rail); see [`topology`].
    pub numa_nodes: Vec<(String, Option<u32>)>,
    /// The rails preferred for the memory of a PCI device (a GPU), overriding the PCIe-fabric ranking;
    /// see [`topology`].
    pub device_rails: Vec<(ferry_core::PciAddress, Vec<String>)>,
    /// IP traffic class of the queue pairs: 0..=255, a multiple of 4 (the low two bits are ECN).
    pub traffic_class: u8,
    /// Service level: 0..=7.
    pub service_level: u8,
    /// Poll the completion queue in a loop instead of waiting on the completion channel.
    pub busy_poll: bool,
    /// Send queue depth (work requests outstanding per link).
    pub max_send_wr: u32,
    /// Initiator: make persistent writes persistent only this way (tests force the fallbacks with
    /// it); the best method both ends support when `None`. A forced method the peer cannot serve
    /// fails the data link's setup.
    pub persist_method: Option<PersistMethod>,
    /// Target: declare this platform ADR with DDIO off, so that initiators may make writes persistent
    /// with a READ after them (the READ completes only after the WRITEs before it reached memory).
    /// Never assumed: a wrong declaration loses data on power loss.
    pub adr_without_ddio: bool,
    /// Target: serve each accepted link in a protection domain of its own, holding only the regions
    /// its peer was granted (see [`scope`]); the engine's own registrations and initiator queue pairs
    /// then grant no remote access. Engines that authenticate their links set this.
    pub per_peer_domains: bool,
}

impl Default for RdmaOptions {
    fn default() -> Self {
        RdmaOptions {
            device: None,
            devices: Vec::new(),
            slice_bytes: multirail::DEFAULT_SLICE,
            queue_pairs_per_rail: 1,
            parallel_registration: true,
            numa_nodes: Vec::new(),
            device_rails: Vec::new(),
            traffic_class: 132,
            service_level: 4,
            busy_poll: false,
            max_send_wr: 256,
            persist_method: None,
            adr_without_ddio: false,
            per_peer_domains: false,
        }
    }
}

impl RdmaOptions {
    /// Checks HIXL's ranges.
    pub fn validate(&self) -> Result<()> {
        if !self.traffic_class.is_multiple_of(4) {
            return Err(Error::InvalidArgument(format!(
                "RDMA traffic class {} is not a multiple of 4 (0..=255)",
                self.traffic_class
            )));
        }
        if self.service_level > 7 {
            return Err(Error::InvalidArgument(format!(
                "RDMA service level {} is not in 0..=7",
                self.service_level
            )));
        }
        if self.persist_method == Some(PersistMethod::FlushBeforeAck) {
            return Err(Error::InvalidArgument(
                "RDMA writes bypass the target's CPU: flush-before-ack is a TCP method (use flush-verb, \
                 read-after-write or flush-request)"
                    .into(),
            ));
        }
        if self.slice_bytes < 4096 {
            return Err(Error::InvalidArgument(format!(
                "RDMA slices of {} bytes: at least 4096",
                self.slice_bytes
            )));
        }
        if !(1..=8).contains(&self.queue_pairs_per_rail) {
            return Err(Error::InvalidArgument(format!(
                "{} RDMA queue pairs per pair of rails: 1 to 8",
                self.queue_pairs_per_rail
            )));
        }
        if self.max_send_wr == 0 {
            return Err(Error::InvalidArgument(
                "RDMA send queue depth must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// What every link on the device shares: one rail.
pub(crate) struct RdmaShared {
    pub device: OpenDevice,
    /// The rail's index among this engine's rails.
    pub rail: u8,
    pub pd: Arc<ProtectionDomain>,
    pub options: RdmaOptions,
    regions: Mutex<HashMap<RegionKey, Arc<Registered>>>,
    /// The initiator links on the device, for deregistration to stop those that use a region.
    links: Mutex<Vec<Weak<link::Inner>>>,
    /// The target side's queue pairs, by link.
    responders: responder::Responders,
    /// The protection domain of each authenticated link's peer, by link (see [`scope`]).
    domains: Mutex<HashMap<u64, Weak<scope::PeerDomain>>>,
}

impl RdmaShared {
    pub(crate) fn add_link(&self, link: &Arc<link::Inner>) {
        if let Ok(mut links) = self.links.lock() {
            links.retain(|l| l.strong_count() > 0);
            links.push(Arc::downgrade(link));
        }
    }

    /// Copies `ranges` of `region`, written with `durability`, in from its bounce buffer, if the NIC
    /// reaches it through one (a large range of a page-cache file goes into the file, as
    /// `RegionEntry::writes_into_file` says); whether it did.
    pub(crate) fn commit_bounced(
        &self,
        region: &RegionEntry,
        ranges: &[(u64, u64)],
        durability: Durability,
    ) -> Result<bool> {
        let Ok(reg) = self.registered(region.key()) else {
            return Ok(false);
        };
        if !reg.is_bounced() {
            return Ok(false);
        }
        let _permit = region.guard().enter().ok_or_else(|| region.gone())?;
        for &(offset, len) in ranges {
            region.check_range(offset, len)?;
            let from = reg
                .bounce_ptr(offset)
                .ok_or_else(|| Error::OutOfBounds(format!("bounced range at {offset} of region {:?}", region.key())))?;
            if region.writes_into_file(len, durability) {
                // SAFETY: the range lies inside the bounce buffer (the region's size; the range was
                // checked against the region); the initiator's writes to these bytes were placed
                // before it asked for this commit (the request travelled behind them on the queue
                // pair), and nothing in this process writes the bounce buffer.
                let bytes = unsafe { std::slice::from_raw_parts(from, len as usize) };
                region.write_through_file(offset, bytes)?;
                continue;
            }
            // SAFETY: both ranges lie inside their buffers (the bounce buffer is the region's size and
            // the range was checked against the region); the permit keeps the region's memory mapped;
            // the initiator's writes to these bytes were placed before it asked for this commit (the
            // request travelled behind them on the queue pair), and no reference to either buffer
            // exists.
            unsafe { std::ptr::copy_nonoverlapping(from, region.ptr_at(offset), len as usize) };
        }
        // A mapped file that shrank meanwhile took the bytes into zero pages: say so.
        region.block().check_backing()?;
        Ok(true)
    }

    fn live_domains(&self) -> Vec<Arc<scope::PeerDomain>> {
        self.domains
            .lock()
            .map(|d| d.values().filter_map(Weak::upgrade).collect())
            .unwrap_or_default()
    }

    /// The protection domain of the link's peer; `PermissionDenied` when the link has none.
    fn domain(&self, link: u64) -> Result<Arc<scope::PeerDomain>> {
        self.domains
            .lock()
            .map_err(|_| Error::Internal("RDMA peer domain table lock poisoned".into()))?
            .get(&link)
            .and_then(Weak::upgrade)
            .ok_or_else(|| Error::PermissionDenied(format!("link {link} has no RDMA protection domain: refused")))
    }

    fn live_links(&self) -> Vec<Arc<link::Inner>> {
        self.links
            .lock()
            .map(|l| l.iter().filter_map(Weak::upgrade).collect())
            .unwrap_or_default()
    }

    /// The NIC registration of region `key`, if it has one.
    pub fn registered_if_any(&self, key: RegionKey) -> Result<Option<Arc<Registered>>> {
        Ok(self
            .regions
            .lock()
            .map_err(|_| Error::Internal("RDMA region table lock poisoned".into()))?
            .get(&key)
            .cloned())
    }

    /// The NIC registration of region `key`; `PermissionDenied` when it has none.
    pub fn registered(&self, key: RegionKey) -> Result<Arc<Registered>> {
        self.regions
            .lock()
            .map_err(|_| Error::Internal("RDMA region table lock poisoned".into()))?
            .get(&key)
            .cloned()
            .ok_or_else(|| Error::PermissionDenied(format!("region {key:?} is not registered with the NIC")))
    }
}

/// A registration of a bounce buffer of `region`'s size standing in for a region the NIC cannot pin
/// (`reason` says why), with `flags`; returns it and the buffer's address.
fn register_bounced(
    shared: &RdmaShared,
    region: &RegionEntry,
    flags: AccessFlags,
    reason: &dyn std::fmt::Display,
) -> Result<(Registered, u64)> {
    let bounce = mr::Bounce::new(region.len() as usize);
    let addr = bounce.as_ptr() as u64;
    // SAFETY: the bounce buffer is owned by the `Registered` built from this registration, which drops
    // the memory region before the buffer.
    let mr =
        unsafe { shared.pd.reg_mr(addr as usize, bounce.len(), flags) }.map_err(|e| reg_error(shared, region, e))?;
    tracing::info!(
        region = ?region.key(),
        kind = region.block().kind(),
        %reason,
        "the NIC cannot pin this region; RDMA writes land in a bounce buffer and are committed by request"
    );
    Ok((Registered::bounced(mr, bounce, region.guard().clone()), addr))
}

/// The registration of a [`DmaView::Device`] region's device memory, at the address the NIC names it
/// by, reached at the region's own address (which work requests and adverts name), with `flags`.
/// `None` for any other region, and when the device memory cannot be registered that way: the region's
/// host copy is registered then, and its accesses go through the block's hooks, as for staged memory.
///
/// Two cases refuse it: a NIC without access to that device's memory, and addresses at different
/// offsets within a page (the kernel maps an address reached to the memory registered page by page,
/// so the two must share their offset; device memory and a staging buffer both start on a page).
fn register_device(shared: &RdmaShared, region: &RegionEntry, flags: AccessFlags) -> Option<mr::Registered> {
    let DmaView::Device { nic_address } = region.block().dma_view() else {
        return register_gpu(shared, region, flags);
    };
    let refused = |why: &dyn std::fmt::Display| {
        tracing::warn!(
            region = ?region.key(),
            kind = region.block().kind(),
            device = %shared.device.name,
            nic_address,
            why = %why,
            "the NIC cannot reach this region's device memory; RDMA goes through its host copy"
        );
        None
    };
    let page = ferry_core::memory::page_size() as u64;
    if nic_address % page != region.addr() % page {
        return refused(&format_args!(
            "the device address and the host copy ({:#x}) lie at different offsets within a {page}-byte page",
            region.addr()
        ));
    }
    // SAFETY: a block that declares `DmaView::Device` keeps its `len` bytes at `nic_address`
    // reachable for as long as it lives (a `MemoryBlock` promise), and the engine keeps the block
    // alive until `deregister_region` returns, which deregisters this registration first.
    let registered = unsafe {
        mr::IovaRegion::register(
            &shared.pd,
            nic_address as usize as *mut u8,
            region.len() as usize,
            region.addr(),
            flags,
        )
    };
    match registered {
        Ok(mr) => Some(mr::Registered::device(mr, nic_address, region.guard().clone())),
        Err(e) => refused(&e),
    }
}

/// The registration of GPU memory that no host address reaches (CUDA), at the region's own address,
/// with `flags`: through the dma-buf the block exports (`ibv_reg_dmabuf_mr`: GPUDirect RDMA through
/// the kernel, with no module of the vendor's), else at its device address where a peer-memory
/// module (`nvidia_peermem`) lets the NIC pin it. `None` for memory that offers neither, and when both
/// fail, with the reasons logged: the region's host copy is registered then, where peers name the
/// region by it, and otherwise nothing is (the region goes over TCP, staged, and its route says so).
fn register_gpu(shared: &RdmaShared, region: &RegionEntry, flags: AccessFlags) -> Option<mr::Registered> {
    let block = region.block();
    let device = block.device_address();
    let offered = block.dma_buf();
    if device.is_none() && offered.is_none() {
        return None;
    }
    let len = region.len() as usize;
    let guard = region.guard().clone();
    let dma_buf = match offered {
        None => "the memory offers no dma-buf".to_string(),
        Some(Err(e)) => format!("no dma-buf: {}", e.message()),
        // SAFETY: the block keeps its memory, which the dma-buf exports, allocated until it drops, and
        // the engine keeps the block alive until `deregister_region` returns, which deregisters this
        // registration first.
        Some(Ok(buf)) => match unsafe { mr::IovaRegion::register_dma_buf(&shared.pd, &buf, len, region.addr(), flags) }
        {
            Ok(mr) => {
                tracing::info!(region = ?region.key(), kind = block.kind(), device = %shared.device.name, "registered GPU memory with the NIC by its dma-buf");
                return Some(mr::Registered::dma_buf(mr, buf, region.addr(), guard));
            }
            Err(e) => format!("{} refused its dma-buf: {e}", shared.device.name),
        },
    };
    let peer_memory = match (device, peer_memory_module()) {
        (Some(DeviceAddress::Cuda(ptr)), Some(module)) => {
            // SAFETY: as above: the block keeps `len` bytes of device memory at `ptr` until it drops.
            match unsafe { mr::IovaRegion::register(&shared.pd, ptr as usize as *mut u8, len, region.addr(), flags) } {
                Ok(mr) => {
                    tracing::info!(region = ?region.key(), kind = block.kind(), device = %shared.device.name, module, "registered GPU memory with the NIC through the peer-memory module");
                    return Some(mr::Registered::device(mr, ptr, guard));
                }
                Err(e) => format!(
                    "{} refused its device address with {module} loaded: {e}",
                    shared.device.name
                ),
            }
        }
        (Some(DeviceAddress::Cuda(_)), None) => "no peer-memory module (nvidia_peermem) is loaded".to_string(),
        _ => "not CUDA memory, which a peer-memory module pins".to_string(),
    };
    tracing::warn!(
        region = ?region.key(),
        kind = block.kind(),
        device = %shared.device.name,
        %dma_buf,
        %peer_memory,
        "the NIC cannot reach this region's GPU memory directly"
    );
    None
}

/// The peer-memory module that lets a NIC pin CUDA memory by its device address, if one is loaded.
fn peer_memory_module() -> Option<&'static str> {
    ["nvidia_peermem", "nv_peer_mem"]
        .into_iter()
        .find(|m| std::path::Path::new("/sys/module").join(m).exists())
}

/// Keeps `reg` as the NIC registration of `region`, advertised as `key`; returns the key's wire form.
fn keep_registered(
    shared: &RdmaShared,
    region: &RegionEntry,
    reg: Registered,
    key: ferry_proto::rdma::RemoteKey,
) -> Result<Option<Vec<u8>>> {
    shared
        .regions
        .lock()
        .map_err(|_| Error::Internal("RDMA region table lock poisoned".into()))?
        .insert(region.key(), Arc::new(reg.advertising(key)));
    Ok(Some(key.encode()))
}

/// The engine's own registration of a region on an engine whose peers each have a domain of their
/// own (see [`scope`]): for the work requests this engine posts, with no remote access; peers get
/// theirs as they are granted the region.
fn register_local(shared: &Arc<RdmaShared>, region: &RegionEntry) -> Result<Option<Vec<u8>>> {
    if let Some(reg) = register_device(shared, region, AccessFlags::LocalWrite) {
        // The region's advert names the transport; each peer's own key replaces this one.
        let key = ferry_proto::rdma::RemoteKey {
            rkey: 0,
            ..reg.advertised()
        };
        return keep_registered(shared, region, reg, key);
    }
    if !region.named_by_pointer() {
        return Ok(None);
    }
    let flushable = region.block().is_pmem() && region.access().contains(Access::WRITE) && shared.device.flush_capable;
    // SAFETY: the engine keeps the region's memory alive until `deregister_region` returns, which
    // deregisters the memory region first.
    let registered = unsafe {
        shared.pd.reg_mr(
            region.ptr_at(0) as usize,
            region.len() as usize,
            AccessFlags::LocalWrite,
        )
    };
    let (reg, bounce_addr) = match registered {
        Ok(mr) => (Registered::new(mr, region.guard().clone()), None),
        // A file in the page cache: peers' writes land in a bounce buffer, which each peer's own
        // registration reaches; the engine's own work requests on the region go over TCP.
        Err(e) if region.block().persistent() => {
            let (reg, addr) = register_bounced(shared, region, AccessFlags::LocalWrite, &e)?;
            (reg, Some(addr))
        }
        Err(e) => return Err(reg_error(shared, region, e)),
    };
    let key = ferry_proto::rdma::RemoteKey {
        rkey: 0,
        flushable,
        bounce_addr,
        hooked: region.block().has_access_hooks(),
    };
    // The region's advert names the transport; each peer's own key replaces this one.
    keep_registered(shared, region, reg, key)
}

/// Refuses a queue pair whose GID is not the address of the TCP peer that set it up (RoCE, where a
/// GID is an IP address): without this, an authenticated peer could connect this engine's queue pair
/// to a third host. A peer on this host (TCP over loopback) must send from this device's own GID.
/// InfiniBand GIDs are not IP addresses and are not checked.
///
/// A peer with several NICs sends from one address per rail: on an authenticated link, an address its
/// certificate names (an IP address among its alternative names) is the peer's too.
fn check_gid(
    rails: &[Arc<RdmaShared>],
    shared: &RdmaShared,
    remote: &ferry_proto::rdma::QpEndpoint,
    peer_addr: &str,
    peer: &ferry_core::PeerView,
) -> Result<()> {
    if !shared.device.roce_v2 {
        return Ok(());
    }
    let own: Vec<std::net::Ipv6Addr> = rails.iter().map(|r| r.device.gid).collect();
    let certified = peer.identity().is_some_and(|who| {
        who.alt_names
            .iter()
            .filter_map(|n| n.parse::<std::net::IpAddr>().ok())
            .any(|ip| ip.to_canonical() == std::net::IpAddr::V6(remote.gid).to_canonical())
    });
    match certified {
        true => Ok(()),
        false => gid_matches_peer(&own, remote.gid, peer_addr),
    }
}

/// Whether `remote_gid` is the address of the TCP peer at `peer_addr` ("ip:port"), or, for a peer on
/// this host (loopback), the GID of one of this engine's own devices (`own`: a peer on this host
/// reaches each rail from the device of its own rail).
fn gid_matches_peer(own: &[std::net::Ipv6Addr], remote_gid: std::net::Ipv6Addr, peer_addr: &str) -> Result<()> {
    let Ok(peer) = peer_addr.parse::<std::net::SocketAddr>() else {
        return Err(Error::PermissionDenied(format!(
            "RDMA setup from {peer_addr}: the TCP peer's address cannot be checked against its GID"
        )));
    };
    let ip = peer.ip().to_canonical();
    let matches = match ip.is_loopback() {
        true => own.contains(&remote_gid),
        false => std::net::IpAddr::V6(remote_gid).to_canonical() == ip,
    };
    match matches {
        true => Ok(()),
        false => Err(Error::PermissionDenied(format!(
            "RDMA setup from {peer_addr} names GID {remote_gid}, which is not that peer's address: refused"
        ))),
    }
}

fn reg_error(shared: &RdmaShared, region: &RegionEntry, e: impl std::fmt::Display) -> Error {
    Error::ResourceExhausted(format!(
        "registering {} bytes with {}: {e}",
        region.len(),
        shared.device.name
    ))
}

/// The RDMA transport; unusable (with the reason) where no device could be opened.
pub struct RdmaTransport {
    /// Every rail (device) it opened.
    state: std::result::Result<Vec<Arc<RdmaShared>>, Error>,
    /// Where each rail sits, and the rails each region prefers.
    topology: Arc<topology::Topology>,
}

impl RdmaTransport {
    /// Opens the devices the options name (or every usable one), one rail each. Never fails: a host
    /// without RDMA gets a transport that says why it is unavailable.
    pub fn new(options: RdmaOptions) -> Self {
        let state = options.validate().and_then(|()| {
            let wanted = match (&options.devices, &options.device) {
                (d, _) if !d.is_empty() => d.clone(),
                (_, Some(one)) => vec![one.clone()],
                _ => Vec::new(),
            };
            let devices = device::open_all(&wanted)?;
            devices
                .into_iter()
                .enumerate()
                .map(|(rail, device)| {
                    let pd = device.context.alloc_pd().map_err(|e| {
                        Error::Unsupported(format!("RDMA: allocating a protection domain on {}: {e}", device.name))
                    })?;
                    tracing::info!(device = %device.name, rail, port = device.port, gid_index = device.gid_index, gid = %device.gid, "RDMA device open");
                    Ok(Arc::new(RdmaShared {
                        device,
                        rail: rail as u8,
                        pd,
                        options: options.clone(),
                        regions: Mutex::new(HashMap::new()),
                        links: Mutex::new(Vec::new()),
                        responders: Default::default(),
                        domains: Mutex::new(HashMap::new()),
                    }))
                })
                .collect::<Result<Vec<_>>>()
        });
        let names: Vec<String> = match &state {
            Ok(rails) => rails.iter().map(|s| s.device.name.clone()).collect(),
            Err(_) => Vec::new(),
        };
        let topology = Arc::new(topology::Topology::new(
            &names,
            &topology::Overrides {
                nodes: options.numa_nodes.clone(),
                device_rails: options.device_rails.clone(),
            },
        ));
        RdmaTransport { state, topology }
    }

    fn rails(&self) -> Result<&[Arc<RdmaShared>]> {
        self.state.as_deref().map_err(Clone::clone)
    }
}

/// Regions from this size up are registered on every rail at once, a thread per rail: pinning and
/// building the translation tables costs time per page, and each device builds its own. Smaller ones
/// are registered in turn, where a thread would cost more than it saves.
pub const PARALLEL_REGISTRATION: u64 = 16 << 20;

/// Registers `region` on every rail: at once for a large region (see [`PARALLEL_REGISTRATION`]), in
/// turn otherwise. One result per rail, in rail order.
fn register_on_each(rails: &[Arc<RdmaShared>], region: &RegionEntry) -> Vec<Result<Option<Vec<u8>>>> {
    let parallel = rails.first().is_some_and(|s| s.options.parallel_registration);
    if region.len() < PARALLEL_REGISTRATION || !parallel {
        return rails.iter().map(|shared| register_on(shared, region)).collect();
    }
    std::thread::scope(|scope| {
        let running: Vec<_> = rails
            .iter()
            .map(|shared| {
                std::thread::Builder::new()
                    .name(format!("ferry-reg-{}", shared.device.name))
                    .spawn_scoped(scope, || register_on(shared, region))
            })
            .collect();
        running
            .into_iter()
            .zip(rails)
            .map(|(thread, shared)| match thread {
                Ok(handle) => handle.join().unwrap_or_else(|_| {
                    Err(Error::Internal(format!(
                        "registering on {} panicked",
                        shared.device.name
                    )))
                }),
                // No thread to spare: register from this one.
                Err(_) => register_on(shared, region),
            })
            .collect()
    })
}

/// Registers `region` on one rail; returns its key there.
fn register_on(shared: &Arc<RdmaShared>, region: &RegionEntry) -> Result<Option<Vec<u8>>> {
    if shared.options.per_peer_domains {
        return register_local(shared, region);
    }
    let mut flags = AccessFlags::LocalWrite;
    if region.access().contains(Access::READ) {
        flags |= AccessFlags::RemoteRead;
    }
    if region.access().contains(Access::WRITE) {
        flags |= AccessFlags::RemoteWrite;
    }
    if let Some(reg) = register_device(shared, region, flags) {
        let key = reg.advertised();
        return keep_registered(shared, region, reg, key);
    }
    // Peers name the region by an address that is not its host copy's (CUDA device memory the NIC
    // could not reach above): a registration of the host copy would answer them at the wrong one.
    if !region.named_by_pointer() {
        return Ok(None);
    }
    // Persistent memory on a device that executes FLUSH is registered for it, so that initiators
    // can persist their writes with the verb. (DRAM refuses these flags.)
    let flushable = region.block().is_pmem() && region.access().contains(Access::WRITE) && shared.device.flush_capable;
    let registered = register_for_flush(region, flags, flushable, |flags| {
        // SAFETY: the engine keeps the region's memory alive until `deregister_region` returns,
        // which deregisters the memory region first.
        unsafe {
            shared
                .pd
                .reg_mr(region.ptr_at(0) as usize, region.len() as usize, flags)
        }
    });
    let (reg, flushable, bounce_addr) = match registered {
        Ok((mr, flushable)) => (Registered::new(mr, region.guard().clone()), flushable, None),
        // A file in the page cache: the kernel will not pin its pages for the NIC. Stage instead.
        Err(e) if region.block().persistent() => {
            let (reg, addr) = register_bounced(shared, region, flags, &e)?;
            (reg, false, Some(addr))
        }
        Err(e) => return Err(reg_error(shared, region, e)),
    };
    let key = ferry_proto::rdma::RemoteKey {
        rkey: reg.rkey(),
        flushable,
        bounce_addr,
        hooked: region.block().has_access_hooks(),
    };
    keep_registered(shared, region, reg, key)
}

/// Registers with `register`, for the FLUSH verb as well when `flush` (persistent memory on a device
/// that executes it); a registration the device refuses with FLUSH is made without it, and
/// persistent writes to the region then use the flush request. Returns the registration and whether
/// it takes FLUSH.
pub(crate) fn register_for_flush<T, E: std::fmt::Display>(
    region: &RegionEntry,
    flags: AccessFlags,
    flush: bool,
    register: impl Fn(AccessFlags) -> std::result::Result<T, E>,
) -> std::result::Result<(T, bool), E> {
    if !flush {
        return register(flags).map(|r| (r, false));
    }
    match register(flags | AccessFlags::FlushGlobal | AccessFlags::FlushPersistent) {
        Ok(r) => Ok((r, true)),
        Err(e) => {
            tracing::warn!(region = ?region.key(), error = %e, "registering for FLUSH failed; persistent writes to it use the flush request");
            register(flags).map(|r| (r, false))
        }
    }
}

/// Ends the NIC's access to region `key` on one rail (see `deregister_region`).
fn deregister_on(shared: &RdmaShared, key: RegionKey) {
    let Some(reg) = shared.regions.lock().ok().and_then(|mut r| r.remove(&key)) else {
        return;
    };
    // From here on no work request takes the region into use (the engine closed the region's guard
    // already; closing is idempotent). Those posted already end now: their queue pairs move to the
    // error state, and their completions (flush errors, or the success of those done meanwhile)
    // are polled on this thread, which never waits for a runtime (this runs inside `Region::drop`,
    // often on the runtime's only thread, or on a blocking thread for `Region::deregister`). Those
    // links are down afterwards. Permits held by CPU or GPU copies are the engine's to wait for.
    if reg.close() > 0 {
        let halted: Vec<_> = shared
            .live_links()
            .into_iter()
            .filter(|l| l.halt_if(|l| l.uses(&reg), "a region its work requests use is being deregistered"))
            .collect();
        let deadline = Instant::now() + link::DRAIN_LIMIT;
        for l in &halted {
            l.drain_until(deadline, |l| !l.uses(&reg));
        }
        if halted.iter().any(|l| l.uses(&reg)) {
            tracing::error!(region = ?key, "RDMA work requests still use a region being deregistered after {:?}; the NIC forgets it now", link::DRAIN_LIMIT);
        }
    }
    // Before this returns, not when the last handle goes: the NIC refuses every access from now on,
    // through every peer's registration and the engine's own.
    for domain in shared.live_domains() {
        ferry_core::PeerScope::forget(&*domain, key);
    }
    reg.forget();
}

impl Transport for RdmaTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn availability(&self) -> Availability {
        let devices = device_names().unwrap_or_default();
        match &self.state {
            Ok(rails) => Availability {
                kind: TransportKind::Rdma,
                compiled: true,
                usable: true,
                detail: rails
                    .iter()
                    .map(|s| {
                        format!(
                            "{} port {} GID {} (index {}, {})",
                            s.device.name,
                            s.device.port,
                            s.device.gid,
                            s.device.gid_index,
                            if s.device.roce_v2 { "RoCEv2" } else { "IB/RoCEv1" }
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; "),
                devices,
                rails: self.topology.report(),
            },
            Err(e) => Availability {
                kind: TransportKind::Rdma,
                compiled: true,
                usable: false,
                detail: e.message().to_string(),
                devices,
                rails: Vec::new(),
            },
        }
    }

    fn register_region(&self, region: &RegionEntry) -> Result<Option<Vec<u8>>> {
        let rails = self.rails()?;
        if let [one] = rails {
            return register_on(one, region);
        }
        // Every rail that can: a rail that cannot leaves an empty key, and initiators spread the
        // region's slices over the others.
        let results = register_on_each(rails, region);
        let mut keys = Vec::with_capacity(rails.len());
        for (shared, result) in rails.iter().zip(results) {
            match result {
                Ok(key) => keys.push(key),
                Err(e) => {
                    tracing::warn!(region = ?region.key(), device = %shared.device.name, error = %e, "not registered on this rail");
                    keys.push(None);
                }
            }
        }
        // GPU memory that no rail's NIC reaches (each said why): no key, and the region goes over TCP.
        if keys.iter().all(Option::is_none) && !region.named_by_pointer() {
            return Ok(None);
        }
        if keys.iter().all(Option::is_none) {
            return Err(Error::ResourceExhausted(format!(
                "registering {} bytes failed on every RDMA rail",
                region.len()
            )));
        }
        // Registered: its first page is in memory now, on the node it will stay on.
        self.topology
            .place(region.key(), region.ptr_at(0).cast_const(), region.block().pci_device());
        Ok(Some(ferry_proto::rdma::RailKeys(keys).encode()))
    }

    /// Halting and draining the queue pairs that use the region waits up to `link::DRAIN_LIMIT`.
    fn deregister_blocks(&self) -> bool {
        true
    }

    fn deregister_region(&self, key: RegionKey) {
        let Ok(rails) = self.rails() else { return };
        for shared in rails {
            deregister_on(shared, key);
        }
        self.topology.forget(key);
    }

    fn peer_scope(&self, link: u64) -> Result<Option<Arc<dyn ferry_core::PeerScope>>> {
        let Ok(rails) = self.rails() else { return Ok(None) };
        if !rails.first().is_some_and(|s| s.options.per_peer_domains) {
            return Ok(None);
        }
        let mut domains = Vec::with_capacity(rails.len());
        for shared in rails {
            let domain = scope::PeerDomain::new(shared, link)?;
            let mut table = shared
                .domains
                .lock()
                .map_err(|_| Error::Internal("RDMA peer domain table lock poisoned".into()))?;
            table.retain(|_, d| d.strong_count() > 0);
            table.insert(link, Arc::downgrade(&domain));
            domains.push(domain);
        }
        match <[_; 1]>::try_from(domains) {
            Ok([one]) => Ok(Some(one)),
            Err(domains) => Ok(Some(Arc::new(scope::RailScopes(domains)))),
        }
    }

    fn connect<'a>(&'a self, control: &'a dyn SetupExchange) -> BoxFuture<'a, Result<Arc<dyn DataLink>>> {
        Box::pin(async move { multirail::connect(self.rails()?, &self.topology, control).await })
    }

    fn accept(&self, setup: AcceptSetup<'_>) -> Result<(Vec<u8>, Box<dyn ferry_core::AcceptedPath>)> {
        let rails = self.rails()?;
        let remote = ferry_proto::rdma::QpEndpoint::decode(setup.blob)?;
        let shared = rails.get(remote.rail as usize).ok_or_else(|| {
            Error::Protocol(format!(
                "RDMA setup names rail {} of this engine, which has {}",
                remote.rail,
                rails.len()
            ))
        })?;
        check_gid(rails, shared, &remote, setup.peer_addr, setup.peer)?;
        // Where each peer has a domain of its own, the queue pair and its buffers live in it.
        let domain = match shared.options.per_peer_domains {
            true => Some(shared.domain(setup.link)?),
            false => None,
        };
        let pd = domain.as_ref().map_or(&shared.pd, |d| &d.pd);
        let mut rc = qp::Rc::create(&shared.device, pd, &shared.options, true)?;
        rc.local.rail = shared.rail;
        rc.local.rails = rails.len() as u8;
        if shared.device.flush_capable {
            rc.local.flags |= ferry_proto::rdma::FLUSH_TARGET;
        }
        if shared.options.adr_without_ddio {
            rc.local.flags |= ferry_proto::rdma::ADR_WITHOUT_DDIO;
        }
        let messages = messages::MessageBuffers::new(pd)?;
        // Receives go up before the initiator learns our address, so its first message finds one.
        messages.post_all_recvs(&rc)?;
        rc.connect(&shared.device, &remote, &shared.options)?;
        tracing::debug!(
            link = setup.link,
            local_qpn = rc.local.qpn,
            remote_qpn = remote.qpn,
            "RDMA queue pair accepted"
        );
        let local = rc.local.encode();
        let accepted = responder::start(
            shared,
            setup.context,
            rc,
            messages,
            setup.notifier,
            setup.link,
            remote.lane,
            setup.peer_engine,
            setup.peer_addr.to_string(),
            setup.peer.clone(),
            shared.options.busy_poll,
        );
        Ok((local, Box::new(accepted)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_follow_hixl_ranges() {
        assert!(RdmaOptions::default().validate().is_ok());
        for tc in [1u8, 2, 3, 133, 255] {
            let o = RdmaOptions {
                traffic_class: tc,
                ..Default::default()
            };
            assert!(matches!(o.validate(), Err(Error::InvalidArgument(_))), "{tc}");
        }
        assert!(
            RdmaOptions {
                traffic_class: 252,
                ..Default::default()
            }
            .validate()
            .is_ok()
        );
        assert!(matches!(
            RdmaOptions {
                service_level: 8,
                ..Default::default()
            }
            .validate(),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn a_gid_must_be_the_tcp_peers_address() {
        let own: std::net::Ipv6Addr = "::ffff:10.0.2.15".parse().unwrap();
        let other: std::net::Ipv6Addr = "::ffff:10.0.2.16".parse().unwrap();
        let v6: std::net::Ipv6Addr = "fd00::7".parse().unwrap();
        let second: std::net::Ipv6Addr = "::ffff:10.0.3.15".parse().unwrap();
        let rails = [own, second];
        assert!(gid_matches_peer(&rails, other, "10.0.2.16:4000").is_ok());
        assert!(gid_matches_peer(&rails, v6, "[fd00::7]:4000").is_ok());
        // A peer on this host sends from one of this host's devices.
        assert!(gid_matches_peer(&rails, own, "127.0.0.1:4000").is_ok());
        assert!(gid_matches_peer(&rails, second, "127.0.0.1:4000").is_ok());
        assert!(gid_matches_peer(&rails, own, "[::ffff:127.0.0.1]:4000").is_ok());
        for (gid, peer) in [
            (other, "10.0.2.17:4000"),
            (other, "127.0.0.1:4000"),
            (own, "[fd00::7]:4000"),
            (own, "not an address"),
        ] {
            assert!(
                matches!(gid_matches_peer(&rails, gid, peer), Err(Error::PermissionDenied(_))),
                "{gid} from {peer}"
            );
        }
    }

    #[test]
    fn no_device_is_unsupported_not_a_panic() {
        let t = RdmaTransport::new(RdmaOptions {
            device: Some("no-such-device".into()),
            ..Default::default()
        });
        let a = t.availability();
        assert!(!a.usable);
        assert!(a.compiled);
        assert!(!a.detail.is_empty());
    }
}
