//! # ferry-core
//!
//! The vocabulary and the contracts of ferry, with no sockets and no runtime, so that everything here
//! is testable without I/O:
//!
//! - [`Error`], the one error type, with [`Error::is_retryable`];
//! - the value types: [`Access`], [`Op`], [`Durability`], [`TransportKind`], [`TransferDesc`],
//!   [`Notification`];
//! - [`memory`]: what can be registered ([`MemoryBlock`]) and where memory comes from ([`MemoryRegistry`]);
//! - [`guard`]: the [`AccessGuard`] every access to region memory holds a permit of (CPU copies,
//!   system calls, NIC work requests, GPU copies), which makes deregistration final;
//! - [`region`]: the region table (unguessable keys, overflow-safe bounds, access checks);
//! - [`peer_view`]: what one peer sees of the engine (per-link keys, opaque bases, per-peer transport
//!   keys);
//! - [`transport`]: the [`Transport`], [`DataLink`] and [`Notifier`] contracts;
//! - [`codec`]: the wire protocol as a sans-IO codec;
//! - [`options`]: HIXL-style option strings;
//! - [`pci`]: PCI addresses, by which device memory names the device it lives on.
#![deny(missing_docs)]

pub mod codec;
pub mod error;
pub mod grants;
pub mod guard;
pub mod integrity;
pub mod memory;
pub mod options;
pub mod pci;
pub mod peer_view;
pub mod region;
pub mod sync;
pub mod transport;
pub mod transport_key;
pub mod types;
pub mod wire;

pub use error::{Error, ErrorCode, Result, WireError};
pub use grants::{AccessEpochs, EpochTicket, Grants};
pub use guard::{AccessGuard, OwnedPermit, Permit};
pub use memory::{
    DeviceAddress, DeviceCopies, DmaBuf, DmaView, FileWriter, MemoryBlock, MemoryRegistry, OwnedBuffer, RawCopy,
    RawMemory,
};
pub use options::BufferPool;
pub use pci::PciAddress;
pub use peer_view::{PeerNames, PeerScope, PeerView};
pub use region::{RegionEntry, RegionTable, RemoteRegions, Resolved};
pub use transport::{
    AcceptSetup, AcceptedPath, Availability, DataLink, Declined, EngineContext, LinkSlot, LinkSlots, NoControlLink,
    Notifier, RailPlace, RailStats, RegionChange, Route, SetupExchange, TransferItem, TransferRequest, Transport,
};
pub use transport_key::TransportKey;
pub use types::*;
