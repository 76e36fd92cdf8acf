//! The small value types every layer shares.

use std::fmt;

use crate::error::{Error, Result};

/// What a peer may do to a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Access(u8);

impl Default for Access {
    /// Nothing.
    fn default() -> Self {
        Access::NONE
    }
}

impl Access {
    /// No access: what an ungranted peer has. Never sent on the wire.
    pub const NONE: Access = Access(0);
    /// Peers may read the region.
    pub const READ: Access = Access(0b01);
    /// Peers may write the region.
    pub const WRITE: Access = Access(0b10);
    /// Peers may read and write the region.
    pub const READ_WRITE: Access = Access(0b11);

    /// Whether every permission in `other` is also in `self`.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// The permissions in either.
    pub fn union(self, other: Access) -> Access {
        Access(self.0 | other.0)
    }

    /// The permissions in both.
    pub fn intersection(self, other: Access) -> Access {
        Access(self.0 & other.0)
    }

    /// Whether it permits nothing.
    pub fn is_none(self) -> bool {
        self.0 == 0
    }

    /// The wire byte.
    pub fn bits(self) -> u8 {
        self.0
    }

    /// Parses the wire byte; unknown bits are a protocol error.
    pub fn from_bits(bits: u8) -> Result<Access> {
        if bits & !0b11 != 0 || bits == 0 {
            return Err(Error::Protocol(format!("invalid access bits {bits:#04x}")));
        }
        Ok(Access(bits))
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = if self.contains(Access::READ) { "r" } else { "-" };
        let w = if self.contains(Access::WRITE) { "w" } else { "-" };
        write!(f, "{r}{w}")
    }
}

/// The direction of a one-sided transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Copy remote memory into local memory.
    Read,
    /// Copy local memory into remote memory.
    Write,
}

impl Op {
    /// The access the target region needs for this operation.
    pub fn required_access(self) -> Access {
        match self {
            Op::Read => Access::READ,
            Op::Write => Access::WRITE,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Read => "read",
            Op::Write => "write",
        })
    }
}

/// What protects the bytes of a link's data streams on the wire (its control stream runs TLS
/// whenever the engine authenticates).
///
/// Ordered from least to most: a target that requires one level admits that level and those above.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum DataProtection {
    /// Nothing: bytes as they are. The only choice on a link that does not authenticate (there is no
    /// session to key anything from), and on an authenticated one only when both ends opt out.
    #[default]
    Plain,
    /// Every record carries an AES-128-GCM tag under a key only the link's two ends hold, with a
    /// sequence number in its nonce: bytes changed, injected, replayed or reordered on the way are
    /// found before anything acts on them. The bytes themselves travel in the clear.
    Integrity,
    /// As [`Integrity`](Self::Integrity), and the records are encrypted (AES-128-GCM).
    Encrypted,
}

impl DataProtection {
    /// The stable lower-case name used by logs, flags and JSON.
    pub fn name(self) -> &'static str {
        match self {
            DataProtection::Plain => "plain",
            DataProtection::Integrity => "integrity",
            DataProtection::Encrypted => "encrypted",
        }
    }

    /// Its byte on the wire.
    pub fn to_wire(self) -> u8 {
        self as u8
    }

    /// Parses its byte on the wire; `None` for a value this build does not know.
    pub fn from_wire(b: u8) -> Option<Self> {
        match b {
            0 => Some(DataProtection::Plain),
            1 => Some(DataProtection::Integrity),
            2 => Some(DataProtection::Encrypted),
            _ => None,
        }
    }
}

impl std::fmt::Display for DataProtection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DataProtection {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "plain" => Ok(DataProtection::Plain),
            "integrity" => Ok(DataProtection::Integrity),
            "encrypted" => Ok(DataProtection::Encrypted),
            other => Err(format!(
                "unknown data protection {other:?}: say plain, integrity or encrypted"
            )),
        }
    }
}

/// What a completed WRITE promises about the bytes at the target: visible to its CPU, or also in its
/// persistence domain (they survive a power cut).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Durability {
    /// The bytes are in the target's memory and visible to its CPU. Not necessarily persistent.
    #[default]
    Completed,
    /// The bytes are in the target's persistence domain. Only for persistent regions.
    Persistent,
}

/// How a link makes a [`Durability::Persistent`] write persistent at the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PersistMethod {
    /// The target persists the written ranges before it acknowledges them (TCP: its CPU does the
    /// writing, so it can flush in the same step).
    FlushBeforeAck,
    /// The IBTA FLUSH verb (persistent type, range) after the writes: the target's NIC persists
    /// without its CPU. Needs a device that reports FLUSH_PERSISTENT and a region registered for it.
    FlushVerb,
    /// An RDMA READ after the writes, which drains the target's I/O buffers into its ADR domain: only
    /// where the target declared ADR with DDIO off.
    ReadAfterWrite,
    /// A request over the control channel naming the written ranges; the target's CPU persists them
    /// and answers. Works everywhere, at the cost of a round trip.
    FlushRequest,
}

impl PersistMethod {
    /// The stable lower-case name used by logs, `ferry info` and JSON.
    pub fn name(self) -> &'static str {
        match self {
            PersistMethod::FlushBeforeAck => "flush-before-ack",
            PersistMethod::FlushVerb => "flush-verb",
            PersistMethod::ReadAfterWrite => "read-after-write",
            PersistMethod::FlushRequest => "flush-request",
        }
    }
}

impl fmt::Display for PersistMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The cost of persisting so far, as a persistent region counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PersistStats {
    /// Batches persisted (one `msync` run or cache-line sweep per contiguous stretch and batch).
    pub batches: u64,
    /// Bytes asked to be persisted.
    pub bytes: u64,
    /// Time spent persisting, in nanoseconds.
    pub nanos: u64,
}

/// The data paths ferry knows, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TransportKind {
    /// Same-host shared memory.
    Shm,
    /// RDMA verbs (RC queue pairs, one-sided READ and WRITE).
    Rdma,
    /// TCP streams: available everywhere, and the control channel of every link.
    Tcp,
}

impl TransportKind {
    /// The stable lower-case name used by the CLI, logs and JSON.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Rdma => "rdma",
            TransportKind::Tcp => "tcp",
        }
    }

    /// The wire byte.
    pub fn to_u8(self) -> u8 {
        match self {
            TransportKind::Shm => 1,
            TransportKind::Rdma => 2,
            TransportKind::Tcp => 3,
        }
    }

    /// Parses the wire byte; `None` for kinds this version does not know (they are ignored, not fatal).
    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(TransportKind::Shm),
            2 => Some(TransportKind::Rdma),
            3 => Some(TransportKind::Tcp),
            _ => None,
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for TransportKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "shm" => Ok(TransportKind::Shm),
            "rdma" => Ok(TransportKind::Rdma),
            "tcp" => Ok(TransportKind::Tcp),
            other => Err(Error::InvalidArgument(format!(
                "unknown transport {other:?}: expected tcp, rdma or shm"
            ))),
        }
    }
}

/// The unguessable name of a registered region: 64 random bits drawn from the OS.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionKey(pub u64);

impl RegionKey {
    /// Draws a fresh random key.
    pub fn random() -> Result<Self> {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).map_err(|e| Error::Io {
            kind: std::io::ErrorKind::Other,
            message: format!("drawing a region key from the OS: {e}"),
        })?;
        Ok(RegionKey(u64::from_le_bytes(b)))
    }
}

impl fmt::Debug for RegionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RegionKey({:016x})", self.0)
    }
}

/// A region as a peer advertises it: where it is in the owner's address space, how long, with which
/// access, under which key, and any transport-specific keys (an RDMA rkey, for example).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionAd {
    /// The key operations must name.
    pub key: RegionKey,
    /// The region's first byte in the owner's address space (for address-based descriptors).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// What peers may do.
    pub access: Access,
    /// Whether writes to it can be made persistent.
    pub persistent: bool,
    /// Whether its owner keeps it in device memory behind a host copy (GPU memory a CPU transport
    /// reaches only through a staging buffer, which the owner copies to and from the device).
    pub staged: bool,
    /// Transport-specific remote keys, at most one per transport kind, each as cheap to clone as
    /// every transfer to the region needs ([`TransportKey`](crate::TransportKey)).
    pub transport_keys: Vec<(TransportKind, crate::TransportKey)>,
}

impl RegionAd {
    /// Whether `[addr, addr + len)` lies wholly inside this region (overflow-safe).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        match (
            addr.checked_sub(self.addr),
            addr.checked_add(len),
            self.addr.checked_add(self.len),
        ) {
            (Some(_), Some(end), Some(region_end)) => end <= region_end,
            _ => false,
        }
    }
}

/// One element of a batched transfer: `len` bytes between a local and a remote address, as in
/// HIXL's `TransferOpDesc{local_addr, remote_addr, len}`. Both addresses must lie, with `len`, inside
/// regions registered on their side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TransferDesc {
    /// Address in this process, inside a region registered with the local engine.
    pub local_addr: u64,
    /// Address in the peer's process, inside a region the peer registered and advertised.
    pub remote_addr: u64,
    /// Number of bytes; must be non-zero.
    pub len: u64,
}

impl TransferDesc {
    /// A descriptor moving `len` bytes between `local_addr` and `remote_addr`.
    pub fn new(local_addr: u64, remote_addr: u64, len: u64) -> Self {
        TransferDesc {
            local_addr,
            remote_addr,
            len,
        }
    }
}

/// A message delivered to the peer's notification queue (HIXL `NotifyDesc{name, msg}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// Short name, at most [`MAX_NOTIFY_FIELD_CHARS`] characters.
    pub name: String,
    /// Body, at most [`MAX_NOTIFY_FIELD_CHARS`] characters.
    pub msg: String,
}

impl Notification {
    /// Builds a notification; the limits are checked when it is sent.
    pub fn new(name: impl Into<String>, msg: impl Into<String>) -> Self {
        Notification {
            name: name.into(),
            msg: msg.into(),
        }
    }

    /// Checks HIXL's limits: each field at most 1024 characters.
    pub fn validate(&self) -> Result<()> {
        for (field, value) in [("name", &self.name), ("msg", &self.msg)] {
            let chars = value.chars().count();
            if chars > MAX_NOTIFY_FIELD_CHARS {
                return Err(Error::InvalidArgument(format!(
                    "notification {field} has {chars} characters; the limit is {MAX_NOTIFY_FIELD_CHARS}"
                )));
            }
        }
        Ok(())
    }
}

/// A notification as received, with the engine it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedNotification {
    /// The sending engine's id, as the sender's hello claimed it (any peer can claim any id: on an
    /// engine that authenticates its links, [`from_identity`](Self::from_identity) is what to trust).
    pub from_engine: u64,
    /// The sender's address as this engine saw it.
    pub from_addr: String,
    /// Who the sender proved to be on an authenticated link; `None` on an open engine.
    pub from_identity: Option<PeerIdentity>,
    /// What was sent.
    pub notification: Notification,
}

/// Who a peer proved to be: the names in the certificate it presented when its link was authenticated
/// (mutual TLS).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerIdentity {
    /// The name to show and to grant access by: the certificate's first subject alternative name, else
    /// its subject's common name, else the whole subject.
    pub name: String,
    /// The certificate's subject, as a distinguished name (`CN=decode-7, O=cluster`).
    pub subject: String,
    /// Every subject alternative name: DNS names, URIs, IP addresses, e-mail addresses, as text.
    pub alt_names: Vec<String>,
}

impl PeerIdentity {
    /// The names it proved that name it: its name and its alternative names, except IP addresses (an
    /// address says where an engine may be dialled, and certificates share them: every one
    /// `ferry certs` makes carries 127.0.0.1). Grants and `connect_by_name` match these.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(&self.name)
            .chain(&self.alt_names)
            .map(String::as_str)
            .filter(|n| !is_address(n))
    }
}

/// Whether `name` is an IP address.
pub(crate) fn is_address(name: &str) -> bool {
    name.parse::<std::net::IpAddr>().is_ok()
}

impl std::fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

/// HIXL: a notification's name and message each hold at most this many characters.
pub const MAX_NOTIFY_FIELD_CHARS: usize = 1024;
/// HIXL: at most this many notifications wait undrained per link.
pub const DEFAULT_MAX_PENDING_NOTIFICATIONS: usize = 4096;
/// HIXL: at most this many links per engine.
pub const DEFAULT_MAX_LINKS: usize = 512;
/// HIXL copies every descriptor smaller than this through its buffer pool. ferry coalesces only those
/// for which it pays (see the TCP transport's batch planning): copying a 64 KiB descriptor through a
/// pool buffer costs more than the frame it saves.
pub const SMALL_TRANSFER_THRESHOLD: u64 = 256 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_bits() {
        assert!(Access::READ_WRITE.contains(Access::READ));
        assert!(!Access::READ.contains(Access::WRITE));
        assert!(Access::from_bits(0).is_err());
        assert!(Access::from_bits(4).is_err());
        assert_eq!(Access::from_bits(3).unwrap(), Access::READ_WRITE);
    }

    #[test]
    fn region_contains_is_overflow_safe() {
        let ad = RegionAd {
            key: RegionKey(1),
            addr: u64::MAX - 10,
            len: 10,
            access: Access::READ,
            persistent: false,
            staged: false,
            transport_keys: vec![],
        };
        assert!(ad.contains(u64::MAX - 10, 10));
        assert!(!ad.contains(u64::MAX - 10, 11));
        assert!(!ad.contains(u64::MAX, u64::MAX));
        assert!(!ad.contains(0, 1));
    }

    #[test]
    fn notification_limits_count_chars() {
        assert!(Notification::new("é".repeat(1024), "").validate().is_ok());
        assert!(matches!(
            Notification::new("a".repeat(1025), "").validate(),
            Err(Error::InvalidArgument(_))
        ));
        assert!(Notification::new("", "b".repeat(1025)).validate().is_err());
    }
}
