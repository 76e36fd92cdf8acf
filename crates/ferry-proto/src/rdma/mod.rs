//! The RDMA transport's part of the protocol, as bytes: what two ends exchange over the control link
//! to connect their queue pairs and to name registered memory ([`setup`]), and the two-sided messages
//! they send each other on a queue pair ([`messages`]). The verbs themselves live in `ferry-rdma`,
//! which encodes and decodes through here.

pub mod messages;
pub mod setup;

pub use messages::{MAX_COMMIT_SEGMENTS, MAX_MESSAGE_BYTES, Message};
pub use setup::{ADR_WITHOUT_DDIO, CAN_POST_FLUSH, FLUSH_TARGET, MAX_RAILS, QpEndpoint, RailKeys, RemoteKey};
