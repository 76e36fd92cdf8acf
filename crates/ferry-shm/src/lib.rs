//! # ferry-shm
//!
//! ferry's same-host transport. Two engines on one host move bytes with one copy, by the kernel's
//! cross-memory attach (`process_vm_readv` / `process_vm_writev`), instead of two copies and the
//! socket buffers of loopback TCP.
//!
//! - **Same host, decided safely** ([`host`]): the kernel's boot id and the PID, user and network
//!   namespaces of both processes must match, and the target must be able to read a probe buffer the
//!   initiator describes at setup, in the process the initiator says it is: a peer in a container
//!   without a shared PID namespace, another user's process, or a process Yama's `ptrace_scope` or
//!   seccomp protects is refused with that reason, and the engine falls back to its next transport.
//! - **The target copies** ([`target`]): the initiator sends the ranges of a batch (the target's
//!   region key and offset, its own address) over a Unix socket; the target resolves them against its
//!   region table with the peer's grants, copies under each region's access guard, persists if asked,
//!   and replies. So a write is complete when its bytes are in the target's memory, deregistration
//!   waits out copies in progress and refuses later ones, and a peer never holds a mapping of the
//!   target's memory. The peer's process id comes from the kernel (`SO_PEERCRED`).
//! - **Batches** ([`wire`]): one request and one system call for up to 1024 ranges.
//! - Notifications go over the control link, behind the transfers that completed before them.
#![deny(missing_docs)]

pub mod cma;
pub mod host;
mod link;
mod target;
pub mod wire;

use std::sync::Arc;

use ferry_core::{
    AcceptSetup, AcceptedPath, Availability, DataLink, Error, RegionEntry, Result, SetupExchange, Transport,
    TransportKind,
};
use futures::future::BoxFuture;

pub use link::ShmLink;

use crate::host::HostFacts;
use crate::wire::{Answer, Offer};

/// The same-host transport.
#[derive(Debug, Default)]
pub struct ShmTransport;

/// What a target keeps of an accepted link: dropping it closes the link's socket, which ends its
/// thread.
struct Accepted(Arc<target::Shutdown>);

impl AcceptedPath for Accepted {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }
}

impl Drop for Accepted {
    fn drop(&mut self) {
        self.0.now();
    }
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
        let (usable, detail) = match HostFacts::here() {
            Ok(_) => (
                true,
                "cross-memory attach (process_vm_readv/writev) with engines of this host".to_string(),
            ),
            Err(e) => (false, e.message().to_string()),
        };
        Availability {
            kind: TransportKind::Shm,
            compiled: true,
            usable,
            detail,
            devices: Vec::new(),
        }
    }

    fn register_region(&self, region: &RegionEntry) -> Result<Option<Vec<u8>>> {
        // Memory its owner stages (device memory behind a host copy) moves over the control link.
        Ok((!region.block().has_access_hooks()).then(|| vec![1]))
    }

    fn connect<'a>(&'a self, control: &'a dyn SetupExchange) -> BoxFuture<'a, Result<Arc<dyn DataLink>>> {
        Box::pin(async move {
            let facts = HostFacts::here()?;
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
            Ok(Arc::new(ShmLink::start(stream, control_link, peer)) as Arc<dyn DataLink>)
        })
    }

    fn accept(&self, setup: AcceptSetup<'_>) -> Result<(Vec<u8>, Box<dyn AcceptedPath>)> {
        let offer = Offer::decode(setup.blob)?;
        let here = HostFacts::here()?;
        if let Some(why) = here.why_not(&offer.facts) {
            return Err(Error::Unsupported(format!("shared memory: {why}")));
        }
        cma::probe(offer.facts.pid, offer.probe_addr, &offer.probe).map_err(|e| match e {
            Error::PermissionDenied(m) | Error::Unsupported(m) => Error::Unsupported(format!("shared memory: {m}")),
            other => other,
        })?;
        let (socket, listener) = target::listen()?;
        let token = random("a link token")?;
        let shutdown = Arc::new(target::Shutdown::default());
        target::spawn(
            listener,
            target::Served {
                ctx: setup.context.clone(),
                peer: setup.peer.clone(),
                pid: offer.facts.pid,
                token,
                link: setup.link,
            },
            shutdown.clone(),
        )?;
        tracing::debug!(link = setup.link, pid = offer.facts.pid, "shared-memory link accepted");
        Ok((Answer { socket, token }.encode(), Box::new(Accepted(shutdown))))
    }
}
