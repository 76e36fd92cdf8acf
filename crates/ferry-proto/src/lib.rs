//! ferry's link protocol, without sockets, tasks or clocks of its own.
//!
//! A link joins an initiator (the engine that dials) and a target (the engine that accepts) over one
//! control stream and zero or more further streams, each an ordered byte stream carrying the frames of
//! `ferry_core::codec`. This crate holds every decision the protocol makes, as plain state machines in
//! the manner of `quinn-proto`: they take frames, time (as an [`std::time::Instant`] argument) and local
//! requests, and they answer with frames to send and events to act on. Transports (TCP today; the
//! same-host and RDMA paths use the same control link) only move bytes between sockets and memory and
//! feed what they read in here.
//!
//! | module | side | decides |
//! |---|---|---|
//! | [`admission`] | target | which connections may wait to be admitted: places, a share per source address, and whom a newcomer displaces |
//! | [`handshake`] | both | what a hello says; which hellos open a link or join one, and how many streams a link may have |
//! | [`auth`] | both | how a further stream proves it belongs to an authenticated link, and its record keys |
//! | [`seal`] | both | the records a protected data stream's bytes travel in: tags, sequence numbers, encryption |
//! | [`initiator`] | initiator | operation ids, which stream an operation takes, matching answers to operations, the limit on outstanding operations, the peer's region table |
//! | [`outbound`] | initiator | every frame of a batch: its pieces' `Write`, `WriteBatch` and `Read` frames, and the `Commit`s after a persistent write in several frames |
//! | [`target`] | target | which frames a target accepts on which stream, and the answers it owes |
//! | [`serve`] | target | what each accepted request may touch for its peer, what a refused write's payload becomes, what a landed write or a commit persists, the read size limit |
//! | [`written`] | target | which part of a `Commit` a stream may persist: what its earlier writes covered |
//! | [`adverts`] | target | the bounded queue of region updates per link, and the full table resent when it overflowed |
//! | [`keepalive`] | initiator | when to probe a silent peer, and when to give it up |
//! | [`setup`] | target | how often a link may set up data paths, and how many it keeps |
//! | [`rdma`] | both | the RDMA transport's bytes: queue pair addresses, remote keys, and its two-sided messages |
//! | [`shm`] | both | the same-host transport's bytes: its setup offer and answer, its requests and replies, and whether two processes' facts allow it |
//!
//! Everything here is deterministic, so the tests drive both sides in memory (`tests/pair.rs`), with
//! random interleavings of the streams and broken streams, and check the outcome against a model.

pub mod admission;
pub mod adverts;
pub mod auth;
pub mod batch;
pub mod handshake;
pub mod ids;
pub mod initiator;
pub mod keepalive;
pub mod limits;
pub mod ops;
pub mod outbound;
pub mod rdma;
pub mod seal;
pub mod serve;
pub mod setup;
pub mod shm;
pub mod target;
pub mod written;

pub use admission::{AdmissionLimits, AdmissionTable, Arrival, Stage, Ticket};
pub use adverts::AdvertQueue;
pub use auth::{JoinKey, StreamKeys};
pub use handshake::{Admission, Identity, LinkRegistry, Proven};
pub use ids::{LinkToken, OpId, StreamIndex};
pub use initiator::{Event, Initiator, RegionUpdate};
pub use keepalive::Keepalive;
pub use limits::LinkLimits;
pub use ops::OpTable;
pub use outbound::BatchFrames;
pub use seal::{Opener, Sealer};
pub use setup::SetupBudget;
pub use target::{Request, TargetStream};
pub use written::WrittenRanges;
