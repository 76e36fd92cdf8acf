//! # ferry-shm
//!
//! ferry's same-host transport. Two engines on one host move bytes with one copy, instead of two
//! copies and the socket buffers of loopback TCP.
//!
//! - **Same host, decided safely** ([`host`]): the kernel's boot id and the PID, user and network
//!   namespaces of both processes must match; a peer in a container without a shared PID namespace
//!   is refused with that reason, and the engine falls back to its next transport.
//! - **Regions the engine allocated are lent** ([`mapping`]): `alloc_host` memory is a memory file
//!   (memfd) sealed against shrinking; the target passes it over the link's Unix socket
//!   (`SCM_RIGHTS`) to a peer that may read and write it, the peer maps it once, and READ and WRITE
//!   are then plain copies between the two processes' memory, with no system call and no round
//!   trip. Large copies are split over two threads (the `copy` module). Deregistration and revokes
//!   ask for the mapping back and wait until the peer unmapped it.
//! - **GPU memory is lent by its device's handle** (feature `cuda`): a region that is a whole CUDA
//!   allocation goes to such a peer as the allocation's CUDA IPC handle and its device's PCI
//!   address; the peer opens it and moves bytes with the device's own copies, GPU to GPU or GPU and
//!   host, never through the target's host copy. It is given back as a memory file is. A handle
//!   opens the whole allocation, so a region carved out of a larger one is not lent; it and any
//!   GPU memory a peer cannot open go over the control link, staged by the target.
//! - **Other regions are copied by the target** (the `target` module) with cross-memory attach
//!   (`process_vm_readv` / `process_vm_writev`), when the target could read a probe buffer the
//!   initiator described at setup, in the process the initiator says it is. Where the kernel refuses
//!   (another user, Yama's `ptrace_scope`, seccomp), those regions go over the next transport and the
//!   link says why ([`DataLink::fallback_note`]); lent regions still move over shared memory.
//! - **Trust**: a lent region's guarantees at deregistration and revoke rest on the peer's engine
//!   unmapping before it answers; a process that lies keeps writing the pages it mapped. So regions
//!   are lent only to peers that may already read and write them, and the target never reuses the
//!   pages of a dropped allocation for anything else (the memory file keeps them for as long as any
//!   mapping does). A peer that must not outlive its grant gets memory the target owns (`register`),
//!   which only the target's own copies reach.
//! - **Batches** ([`wire`]): one request and one system call for up to 1024 ranges.
//! - Notifications go over the control link, behind the transfers that completed before them.
#![deny(missing_docs)]

pub mod cma;
mod copy;
mod fdpass;
pub mod host;
mod link;
pub mod mapping;
pub mod pidfd;
mod target;

use std::sync::{Arc, Mutex, Weak};

use ferry_core::{
    AcceptSetup, AcceptedPath, Availability, DataLink, Error, RegionEntry, RegionKey, Result, SetupExchange, Transport,
    TransportKind,
};
use futures::future::BoxFuture;

pub use link::ShmLink;

use ferry_proto::shm::{self as wire, Answer, Offer};

/// The same-host transport.
#[derive(Default)]
pub struct ShmTransport {
    /// The links this engine serves as a target, to ask for lent regions back.
    served: Mutex<Vec<Weak<target::Served>>>,
}

impl std::fmt::Debug for ShmTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmTransport").finish_non_exhaustive()
    }
}

impl ShmTransport {
    fn served(&self) -> Vec<Arc<target::Served>> {
        self.served
            .lock()
            .map(|links| links.iter().filter_map(Weak::upgrade).collect())
            .unwrap_or_default()
    }
}

/// The key a region's advert carries for this transport: how the peer reaches it.
pub mod region_key {
    /// The target copies between the peer's memory and the region.
    pub const COPIED: u8 = 1;
    /// The region is a memory file the target may lend.
    pub const LENDABLE: u8 = 2;
    /// The region is GPU memory the target may lend by its device's handle (CUDA IPC); without it,
    /// only the control link reaches the region (its owner stages it).
    pub const DEVICE: u8 = 3;
}

/// What a target keeps of an accepted link: dropping it closes the link's socket, which ends its
/// thread once the peer gave back what was lent to it.
struct Accepted(Arc<target::Served>);

impl AcceptedPath for Accepted {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }
}

impl Drop for Accepted {
    fn drop(&mut self) {
        self.0.shut();
    }
}

/// Whether this build lends `block`'s device memory to peers of this host (CUDA memory, with the
/// `cuda` feature).
fn lends_device_memory(block: &dyn ferry_core::MemoryBlock) -> bool {
    cfg!(feature = "cuda") && matches!(block.device_address(), Some(ferry_core::DeviceAddress::Cuda(_)))
}

fn random<const N: usize>(what: &str) -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| Error::Internal(format!("drawing {what}: {e}")))?;
    Ok(b)
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn availability(&self) -> Availability {
        let (usable, detail) = match host::here() {
            Ok(_) => (
                true,
                format!(
                    "engine allocations lent as memory files{}, other memory by cross-memory attach \
                     (process_vm_readv/writev), with engines of this host",
                    if cfg!(feature = "cuda") {
                        ", whole CUDA allocations by CUDA IPC"
                    } else {
                        ""
                    }
                ),
            ),
            Err(e) => (false, e.message().to_string()),
        };
        Availability {
            kind: TransportKind::Shm,
            compiled: true,
            usable,
            detail,
            devices: Vec::new(),
            rails: Vec::new(),
        }
    }

    fn register_region(&self, region: &RegionEntry) -> Result<Option<Vec<u8>>> {
        // Memory its owner stages (device memory behind a host copy) moves over the control link,
        // unless it is CUDA memory this build can lend by its IPC handle.
        let block = region.block();
        Ok(match (block.has_access_hooks(), block.shared_file().is_some()) {
            (true, _) if lends_device_memory(block.as_ref()) => Some(vec![region_key::DEVICE]),
            (true, _) => None,
            (false, true) => Some(vec![region_key::LENDABLE]),
            (false, false) => Some(vec![region_key::COPIED]),
        })
    }

    fn deregister_region(&self, key: RegionKey) {
        // The deregistration then waits for the permits the lent regions hold: until each peer
        // answers that it unmapped.
        for link in self.served() {
            link.ask_back(key);
        }
    }

    fn access_changed(&self, key: RegionKey) -> BoxFuture<'static, ()> {
        let waits: Vec<_> = self
            .served()
            .into_iter()
            .filter(|link| link.ask_back_if_revoked(key))
            .map(|link| link.returned(key))
            .collect();
        Box::pin(async move {
            futures::future::join_all(waits).await;
        })
    }

    fn connect<'a>(&'a self, control: &'a dyn SetupExchange) -> BoxFuture<'a, Result<Arc<dyn DataLink>>> {
        Box::pin(async move {
            let facts = host::here()?;
            // The target reads this buffer back from this process before it agrees.
            let probe: Box<[u8; wire::PROBE_LEN]> = Box::new(random("a probe")?);
            let offer = Offer {
                facts,
                probe_addr: probe.as_ptr() as u64,
                probe: *probe,
            };
            let answer = control.exchange(TransportKind::Shm, offer.encode()).await?;
            drop(probe);
            let answer = Answer::decode(&answer)?;
            let addr = target::address(&answer.socket)?;
            let stream = std::os::unix::net::UnixStream::connect_addr(&addr)
                .map_err(|e| Error::io("connecting to the target's shared-memory socket", e))?;
            stream
                .set_nonblocking(true)
                .map_err(|e| Error::io("configuring the shared-memory socket", e))?;
            let mut stream = tokio::net::UnixStream::from_std(stream)
                .map_err(|e| Error::io("configuring the shared-memory socket", e))?;
            use tokio::io::AsyncWriteExt;
            stream
                .write_all(&answer.token)
                .await
                .map_err(|e| Error::io("presenting the shared-memory token", e))?;
            let control_link = control.control_link();
            let peer = "a process on this host".to_string();
            Ok(Arc::new(ShmLink::start(stream, control_link, peer, answer.copies_denied)) as Arc<dyn DataLink>)
        })
    }

    fn accept(&self, setup: AcceptSetup<'_>) -> Result<(Vec<u8>, Box<dyn AcceptedPath>)> {
        let offer = Offer::decode(setup.blob)?;
        let here = host::here()?;
        if let Some(why) = here.why_not(&offer.facts) {
            return Err(Error::Unsupported(format!("shared memory: {why}")));
        }
        // Held from before the probe: a probe that ends with the process alive reached it (see
        // `pidfd`), and so will every copy checked the same way.
        let process = pidfd::PidFd::open(offer.facts.pid)?;
        // Without cross-memory attach the link still carries the regions the target lends.
        let copies_denied = match cma::probe(offer.facts.pid, offer.probe_addr, &offer.probe) {
            Ok(()) => None,
            Err(Error::PermissionDenied(m) | Error::Unsupported(m)) => Some(m),
            Err(other) => return Err(other),
        };
        process.check("while the target probed it")?;
        let (socket, listener) = target::listen()?;
        let token = random("a link token")?;
        let served = target::Served::new(setup.context.clone(), setup.peer.clone(), process, token, setup.link);
        target::spawn(listener, served.clone())?;
        if let Ok(mut links) = self.served.lock() {
            links.retain(|l| l.strong_count() > 0);
            links.push(Arc::downgrade(&served));
        }
        tracing::debug!(link = setup.link, pid = offer.facts.pid, copies_denied = ?copies_denied, "shared-memory link accepted");
        let answer = Answer {
            socket,
            token,
            copies_denied,
        };
        Ok((answer.encode(), Box::new(Accepted(served))))
    }
}
