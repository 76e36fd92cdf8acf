//! # ferry-tcp
//!
//! The TCP transport: available everywhere, the fallback data path, and the control channel of every
//! link whatever carries its data.
//!
//! - [`TcpServer`] accepts links and serves remote operations against the engine's region table.
//! - [`TcpLink`] is the initiator's side: several streams per peer, pipelined batches with a bounded
//!   number of bytes in flight, small descriptors coalesced through the [`CoalescePool`], large ones
//!   split across streams.
//! - Payloads move straight between sockets and registered memory (`read(2)`/`send(2)` on region
//!   memory under its access guard), never through an intermediate copy.
//! - [`TlsConfig`] authenticates links with mutual TLS on the control stream; the other streams join
//!   with a proof derived from that session.
#![deny(missing_docs)]

mod blocking;
mod coalesce;
mod device;
mod io;
mod link;
mod sealed;
mod server;
mod tls;

pub use coalesce::{CoalesceBuf, CoalescePool};
pub use ferry_proto::{AdmissionLimits, LinkLimits};
pub use io::DEFAULT_SEND_TIMEOUT;
pub use link::{LinkConfig, LocalIdentity, TcpLink};
pub use server::{AdvertsSent, MAX_STREAMS_PER_LINK, NarrowedLink, ServerConfig, TcpServer};
pub use tls::{DevelopmentCa, IssuedPem, PSK_SERVER_NAME, TlsConfig};

use ferry_core::{Availability, Transport, TransportKind};

/// The TCP transport's registration hooks: TCP needs no per-region setup.
#[derive(Debug, Default, Clone, Copy)]
pub struct TcpTransport;

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn availability(&self) -> Availability {
        Availability {
            kind: TransportKind::Tcp,
            compiled: true,
            usable: true,
            detail: "always available: the fallback data path and the control channel".into(),
            devices: Vec::new(),
            rails: Vec::new(),
        }
    }
}
