//! # ferry
//!
//! Moves bytes between registered memory of processes on different hosts, over pluggable transports,
//! with the contract of the HIXL/ADXL transfer engine:
//!
//! | HIXL/ADXL | ferry |
//! |---|---|
//! | `Initialize(ip:port, options)` | [`Engine::builder`]`().listen(..).build().await` |
//! | `RegisterMem` / `DeregisterMem` | [`Engine::register`], [`Engine::alloc_host`], [`Engine::register_raw`]; drop the [`Region`] |
//! | `Connect` / `Disconnect` | [`Engine::connect`] / [`Engine::disconnect`] |
//! | `TransferSync` | [`Engine::transfer`]; [`Engine::start`] with [`TransferOptions`] (durability, timeout, deadline) for its future as a named [`Transfer`] |
//! | `TransferAsync` / `GetTransferStatus` | [`Engine::transfer_async`] → [`TransferHandle::status`], or await it |
//! | `SendNotify` / `GetNotifies` | [`Engine::notify`] / [`Engine::take_notifications`], [`Engine::notifications`] |
//! | `MallocMem` / `FreeMem` | [`Engine::alloc_host`] / drop |
//! | `GetCapability` | [`capabilities()`] |
//!
//! Every wait has a timeout, every failure is an [`Error`] variant that says what to do, and a peer
//! reaches only memory registered for it: descriptors are checked against the region table on both
//! sides before a byte moves.
//!
//! Transports are cargo features: `tcp` (default). TCP is also every link's control channel.
#![deny(missing_docs)]

pub mod blocking;
mod builder;
mod capabilities;
pub mod directory;
mod engine;
mod file;
mod host;
mod interfaces;
pub mod mapped;
pub mod metrics;
mod notify;
mod verify;
/// The text forms of the RDMA overrides (`FERRY_RDMA_NUMA`, `FERRY_RDMA_DEVICE_RAILS`), parsed, for
/// command lines that take them as options.
#[cfg(feature = "rdma")]
pub mod rdma {
    pub use ferry_rdma::topology::{parse_device_rails, parse_overrides as parse_numa_nodes};
}
mod peer;
mod policy;
mod region;
mod shared;
mod sigbus;
mod transfer;

pub use builder::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_INFLIGHT_BYTES, DEFAULT_MAX_NOTIFICATION_BYTES, DEFAULT_STREAMS, EngineBuilder,
};
pub use capabilities::{Capabilities, CudaReport, RdmaRail, TransportInfo, TransportOptions, capabilities};
pub use directory::{Directory, EngineRecord, MemberEvent};
pub use engine::{Engine, PreparedTransfer};
pub use ferry_core::integrity;
pub use ferry_core::{
    Access, BufferPool, DataProtection, DeviceAddress, DeviceCopies, DmaBuf, DmaView, Durability, Error, ErrorCode,
    Grants, MemoryBlock, MemoryRegistry, Notification, Op, PciAddress, PeerIdentity, PersistMethod, PersistStats,
    RailStats, RawCopy, ReceivedNotification, RegionAd, RegionKey, RemoteRegions, Result, Route, TransferDesc,
    TransportKind,
};
/// CUDA device memory: [`cuda::CudaRegistry`] for `alloc_from`, [`cuda::CudaBlock::borrow`] for a
/// pointer the caller holds (a PyTorch tensor's), [`cuda::classify`] for what an address is.
#[cfg(feature = "cuda")]
pub use ferry_cuda as cuda;
pub use ferry_tcp::{DevelopmentCa, IssuedPem, TlsConfig};
pub use file::{FileMapping, FlushMethod};
pub use host::HostAllocation;
pub use peer::Peer;
pub use policy::{ConnectOptions, PathPolicy};
/// The metrics library [`EngineBuilder::metrics`] registers into, re-exported so that an application
/// uses the same version.
pub use prometheus_client;
pub use region::{GrantHandle, Region};
pub use shared::{DEREGISTER_LIMIT, REVOKE_GRACE, REVOKE_LIMIT};
pub use transfer::{Transfer, TransferHandle, TransferOptions, TransferStatus};

/// The wire protocol, for tools and tests that speak it directly.
pub mod codec {
    pub use ferry_core::codec::*;
}
