//! What this build can do on this host (HIXL `GetCapability`), callable before any engine exists.

use ferry_core::{Availability, Transport, TransportKind};
use serde::Serialize;

/// The answer of [`capabilities`].
#[derive(Debug, Clone, Serialize)]
pub struct Capabilities {
    /// ferry's version.
    pub version: &'static str,
    /// The wire protocol version.
    pub protocol_version: u8,
    /// Every transport ferry knows, compiled in or not, usable here or not, and why.
    pub transports: Vec<TransportInfo>,
    /// RDMA devices found (empty without the `rdma` feature).
    pub rdma_devices: Vec<String>,
    /// Vulkan devices found (empty without the `vulkan` feature).
    pub vulkan_devices: Vec<String>,
}

/// One transport's entry.
#[derive(Debug, Clone, Serialize)]
pub struct TransportInfo {
    /// "tcp", "rdma", "shm".
    pub name: &'static str,
    /// Whether this build contains it.
    pub compiled: bool,
    /// Whether it can be used on this host.
    pub usable: bool,
    /// Why not, or what it uses.
    pub detail: String,
}

impl From<Availability> for TransportInfo {
    fn from(a: Availability) -> Self {
        TransportInfo {
            name: a.kind.name(),
            compiled: a.compiled,
            usable: a.usable,
            detail: a.detail,
        }
    }
}

impl Capabilities {
    /// Whether `kind` is compiled in and usable here.
    pub fn usable(&self, kind: TransportKind) -> bool {
        self.transports.iter().any(|t| t.name == kind.name() && t.usable)
    }
}

/// The transports compiled into this build, best first.
pub(crate) fn compiled_transports() -> Vec<Box<dyn Transport>> {
    let mut v: Vec<Box<dyn Transport>> = Vec::with_capacity(3);
    if cfg!(feature = "tcp") {
        v.push(Box::new(ferry_tcp::TcpTransport));
    }
    v
}

fn not_compiled(kind: TransportKind, why: &str) -> Availability {
    Availability {
        kind,
        compiled: false,
        usable: false,
        detail: why.to_string(),
        devices: Vec::new(),
    }
}

/// What this build can do on this host.
pub fn capabilities() -> Capabilities {
    let mut transports: Vec<Availability> = compiled_transports().iter().map(|t| t.availability()).collect();
    for (kind, why) in [
        (
            TransportKind::Shm,
            "not in this build: ferry has no shared-memory transport yet",
        ),
        (
            TransportKind::Rdma,
            "not in this build: ferry has no RDMA transport yet",
        ),
        (TransportKind::Tcp, "not in this build: enable the `tcp` feature"),
    ] {
        if !transports.iter().any(|t| t.kind == kind) {
            transports.push(not_compiled(kind, why));
        }
    }
    transports.sort_by_key(|t| t.kind);
    let rdma_devices = transports
        .iter()
        .filter(|t| t.kind == TransportKind::Rdma)
        .flat_map(|t| t.devices.clone())
        .collect();
    Capabilities {
        version: env!("CARGO_PKG_VERSION"),
        protocol_version: ferry_core::codec::VERSION,
        transports: transports.into_iter().map(Into::into).collect(),
        rdma_devices,
        vulkan_devices: Vec::new(),
    }
}
