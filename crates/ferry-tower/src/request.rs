//! What a [`TransferService`](crate::TransferService) is asked to do, and what it answers.
//!
//! A request names its peer by socket address rather than by a [`Peer`] handle, because the
//! handle is exactly what the pool replaces when a link dies: the caller keeps one request value and
//! the service finds (or makes) a live link for it at every attempt.
//!
//! For the same reason the remote side of a descriptor can be named relative to the peer's regions
//! ([`RemoteAddr::Offset`], [`RemoteAddr::Region`]) instead of by absolute address. A restarted peer
//! process registers its memory again at a different address, so an absolute address from before the
//! restart names nothing (the engine answers `OutOfBounds`, which is never retried); an offset is
//! resolved against the regions the peer advertises on the link used by each attempt, so a retry after
//! a reconnect lands in the new region.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry::{Access, Durability, Error, Op, Peer, RegionKey, RemoteRegions, Result, TransferDesc, TransportKind};
use tokio::time::Instant;

/// Where the remote side of a [`Descriptor`] lies in the peer's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RemoteAddr {
    /// An address in the peer's address space, as its region adverts give it. It stays valid only
    /// as long as that registration: after the peer deregisters the region or restarts, it names
    /// nothing and the transfer fails with `OutOfBounds`.
    Absolute(u64),
    /// An offset into the peer's *primary region*: the largest region it advertises with read and
    /// write access (the largest region of any access if none has both; the lowest address among
    /// equals). Resolved at every attempt, so it follows the peer across restarts. This is how a
    /// `ferry serve` target, which registers one region, is addressed.
    Offset(u64),
    /// An offset into the region registered under `key`. Region keys are random per registration:
    /// this survives reconnects to a live peer but not its restart (the key is then unknown and the
    /// transfer fails with `PermissionDenied`).
    Region {
        /// The region's key, from the peer's adverts.
        key: RegionKey,
        /// Offset of the first byte inside that region.
        offset: u64,
    },
}

/// One contiguous range to move: `len` bytes between local memory at `local_addr` (inside a region
/// registered with the service's engine) and the peer's memory at `remote`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Descriptor {
    /// Address in this process, inside a region registered with the engine.
    pub local_addr: u64,
    /// Where the bytes go to (writes) or come from (reads) in the peer.
    pub remote: RemoteAddr,
    /// Number of bytes; must be non-zero.
    pub len: u64,
}

impl Descriptor {
    /// A descriptor with an explicit remote location.
    pub fn new(local_addr: u64, remote: RemoteAddr, len: u64) -> Self {
        Descriptor {
            local_addr,
            remote,
            len,
        }
    }

    /// A descriptor whose remote side is `offset` bytes into the peer's primary region
    /// ([`RemoteAddr::Offset`]).
    pub fn at_offset(local_addr: u64, offset: u64, len: u64) -> Self {
        Descriptor::new(local_addr, RemoteAddr::Offset(offset), len)
    }

    /// A descriptor naming an absolute remote address ([`RemoteAddr::Absolute`]).
    pub fn absolute(local_addr: u64, remote_addr: u64, len: u64) -> Self {
        Descriptor::new(local_addr, RemoteAddr::Absolute(remote_addr), len)
    }
}

impl From<TransferDesc> for Descriptor {
    fn from(d: TransferDesc) -> Self {
        Descriptor::absolute(d.local_addr, d.remote_addr, d.len)
    }
}

/// A batch of one-sided operations on one peer: the request type of
/// [`TransferService`](crate::TransferService).
///
/// Cloning is cheap (the descriptors are shared), which matters because `tower::retry` keeps a
/// clone of every request for a possible retry.
///
/// Retried writes are at-least-once: an attempt that timed out may still land at the target later.
/// Writing the same bytes again is harmless, but two different writes in flight to one range can
/// arrive in either order, so give concurrent writes their own ranges.
#[derive(Debug, Clone)]
pub struct TransferRequest {
    peer: SocketAddr,
    op: Op,
    descs: Arc<[Descriptor]>,
    durability: Durability,
    timeout: Option<Duration>,
    deadline: Option<Instant>,
    attempt_limit: Option<Duration>,
}

impl TransferRequest {
    /// A batch of `op` on `peer`.
    pub fn new(peer: SocketAddr, op: Op, descs: impl Into<Arc<[Descriptor]>>) -> Self {
        TransferRequest {
            peer,
            op,
            descs: descs.into(),
            durability: Durability::Completed,
            timeout: None,
            deadline: None,
            attempt_limit: None,
        }
    }

    /// Writes local memory into `peer`.
    pub fn write(peer: SocketAddr, descs: impl Into<Arc<[Descriptor]>>) -> Self {
        TransferRequest::new(peer, Op::Write, descs)
    }

    /// Reads `peer`'s memory into local memory.
    pub fn read(peer: SocketAddr, descs: impl Into<Arc<[Descriptor]>>) -> Self {
        TransferRequest::new(peer, Op::Read, descs)
    }

    /// When a write counts as done (default [`Durability::Completed`]).
    pub fn with_durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// The timeout handed to the engine for each attempt, instead of the pool's
    /// [`transfer_timeout`](crate::PoolConfig::transfer_timeout). A `tower::timeout` layer bounds the
    /// whole attempt (connect included) from outside; this one bounds the transfer itself.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The request must be done by `at`, or by its earlier deadline if it has one. Usually set by a
    /// [`DeadlineLayer`](crate::DeadlineLayer); the [`TransferService`](crate::TransferService)
    /// enforces it (see [`crate::deadline`]).
    pub fn with_deadline(mut self, at: Instant) -> Self {
        self.bound_by(at);
        self
    }

    /// [`with_deadline`](Self::with_deadline) in place, for layers that pass the request on.
    pub(crate) fn bound_by(&mut self, at: Instant) {
        self.deadline = Some(self.deadline.map_or(at, |earlier| earlier.min(at)));
    }

    /// When the request must be done, if anything set a deadline.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Each attempt must be done within `limit` of reaching the
    /// [`TransferService`](crate::TransferService) (waiting for a link, connecting and the transfer),
    /// or within the smaller limit the request already has; never past its
    /// [deadline](Self::deadline). Usually set by [`DeadlineLayer::per_attempt`](crate::DeadlineLayer::per_attempt).
    /// Unlike a deadline, the limit is not a point in time: each attempt starts it afresh, so a retry
    /// gets all of it.
    pub fn with_attempt_limit(mut self, limit: Duration) -> Self {
        self.limit_attempts(limit);
        self
    }

    /// [`with_attempt_limit`](Self::with_attempt_limit) in place, for layers that pass the request on.
    pub(crate) fn limit_attempts(&mut self, limit: Duration) {
        self.attempt_limit = Some(self.attempt_limit.map_or(limit, |smaller| smaller.min(limit)));
    }

    /// How long each attempt may take, if anything set a limit.
    pub fn attempt_limit(&self) -> Option<Duration> {
        self.attempt_limit
    }

    /// The peer's listen address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Read or write.
    pub fn op(&self) -> Op {
        self.op
    }

    /// The descriptors.
    pub fn descriptors(&self) -> &[Descriptor] {
        &self.descs
    }

    /// The requested durability.
    pub fn durability(&self) -> Durability {
        self.durability
    }

    /// The per-attempt engine timeout, if the request sets one.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// Bytes the batch moves (saturating).
    pub fn bytes(&self) -> u64 {
        self.descs.iter().fold(0u64, |n, d| n.saturating_add(d.len))
    }

    /// The engine's descriptors for this request, with relative remote addresses resolved against
    /// the regions `peer` advertises: `primary` is the pool's cached [`primary_region`] of the link
    /// when it keeps one (`None`: read the table now).
    pub(crate) fn resolve(&self, peer: &Peer, primary: Option<Option<(u64, u64)>>) -> Result<Resolved> {
        // The common case, in short: one descriptor at an offset into the primary region the pool
        // keeps for the link.
        if let ([d], Some(Some((base, len)))) = (&*self.descs, primary)
            && let RemoteAddr::Offset(offset) = d.remote
        {
            let remote_addr = offset_into(base, len, offset, d.len, 0)?;
            return Ok(Resolved::One(TransferDesc::new(d.local_addr, remote_addr, d.len)));
        }
        let needs_table = self.descs.iter().any(|d| match d.remote {
            RemoteAddr::Absolute(_) => false,
            RemoteAddr::Offset(_) => primary.is_none(),
            RemoteAddr::Region { .. } => true,
        });
        let mut resolver = Resolver {
            peer,
            primary,
            table: needs_table.then(|| peer.regions()),
        };
        match &*self.descs {
            [d] => Ok(Resolved::One(resolver.resolve(0, d)?)),
            descs if descs.len() <= INLINE => {
                let mut inline = [TransferDesc::new(0, 0, 0); INLINE];
                for (i, d) in descs.iter().enumerate() {
                    inline[i] = resolver.resolve(i, d)?;
                }
                Ok(Resolved::Inline(inline, descs.len()))
            }
            descs => {
                let descs = descs.iter().enumerate().map(|(i, d)| resolver.resolve(i, d));
                Ok(Resolved::Heap(descs.collect::<Result<_>>()?))
            }
        }
    }
}

/// Resolves one request's descriptors: reads the peer's region table at most once, and finds the
/// primary region in it at most once.
struct Resolver<'a> {
    peer: &'a Peer,
    primary: Option<Option<(u64, u64)>>,
    /// The peer's table, where some descriptor needs it.
    table: Option<RemoteRegions>,
}

impl Resolver<'_> {
    /// Descriptor `i` of the request, `d`, as the engine takes it.
    fn resolve(&mut self, i: usize, d: &Descriptor) -> Result<TransferDesc> {
        let remote_addr = match d.remote {
            RemoteAddr::Absolute(addr) => addr,
            RemoteAddr::Offset(offset) => {
                let primary = match (self.primary, &self.table) {
                    (Some(cached), _) => cached,
                    (None, Some(table)) => *self.primary.insert(primary_region(table)),
                    (None, None) => None,
                };
                let Some((base, len)) = primary else {
                    return Err(Error::OutOfBounds(format!(
                        "descriptor {i}: {} advertises no region to resolve an offset against",
                        self.peer.addr()
                    )));
                };
                offset_into(base, len, offset, d.len, i)?
            }
            RemoteAddr::Region { key, offset } => {
                let Some(table) = &self.table else {
                    return Err(Error::Internal("relative descriptor without a region table".into()));
                };
                let ad = table.iter().find(|a| a.key == key).ok_or_else(|| {
                    Error::PermissionDenied(format!(
                        "descriptor {i}: {} advertises no region with key {key:?} (keys change when a peer \
                             restarts)",
                        self.peer.addr()
                    ))
                })?;
                offset_into(ad.addr, ad.len, offset, d.len, i)?
            }
        };
        Ok(TransferDesc::new(d.local_addr, remote_addr, d.len))
    }
}

/// Batches up to this many descriptors are resolved without a heap allocation.
const INLINE: usize = 4;

/// A request's descriptors as the engine takes them. Most requests carry one or a few, which stay
/// inline: one allocation less per attempt.
pub(crate) enum Resolved {
    One(TransferDesc),
    Inline([TransferDesc; INLINE], usize),
    Heap(Vec<TransferDesc>),
}

impl Resolved {
    pub(crate) fn as_slice(&self) -> &[TransferDesc] {
        match self {
            Resolved::One(desc) => std::slice::from_ref(desc),
            Resolved::Inline(descs, n) => &descs[..*n],
            Resolved::Heap(descs) => descs,
        }
    }
}

/// `base + offset`, checked against the region's length so that the message names the offset the
/// caller used rather than an address it never saw.
fn offset_into(base: u64, region_len: u64, offset: u64, len: u64, i: usize) -> Result<u64> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(base + offset),
        _ => Err(Error::OutOfBounds(format!(
            "descriptor {i}: [{offset}, +{len}) does not fit in the peer's region of {region_len} bytes"
        ))),
    }
}

/// The region [`RemoteAddr::Offset`] resolves against, as `(address, length)`: the largest read-write
/// region, else the largest region; the lowest address among equals. Reads and writes pick the same
/// region, so a write and a later read at one offset meet.
pub(crate) fn primary_region(regions: &RemoteRegions) -> Option<(u64, u64)> {
    let best = |want: Option<Access>| {
        regions
            .iter()
            .filter(|a| want.is_none_or(|w| a.access.contains(w)))
            // `iter` is in address order and `max_by_key` keeps the last maximum: compare on
            // (length, reversed address) to keep the lowest address among equals.
            .max_by_key(|a| (a.len, std::cmp::Reverse(a.addr)))
            .map(|a| (a.addr, a.len))
    };
    best(Some(Access::READ_WRITE)).or_else(|| best(None))
}

/// What a [`TransferService`](crate::TransferService) reports for a request that succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransferResponse {
    /// The peer's address.
    pub peer: SocketAddr,
    /// Read or write.
    pub op: Op,
    /// Bytes moved.
    pub bytes: u64,
    /// The data path the engine used.
    pub transport: TransportKind,
    /// Whether this attempt had to establish the link (first use, or a reconnect).
    pub new_link: bool,
}
