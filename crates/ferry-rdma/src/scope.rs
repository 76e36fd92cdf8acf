//! Grants the NIC enforces: on an engine that authenticates its links, each accepted link's queue pair
//! lives in a protection domain of its own (`PeerDomain`), and a region is registered there only
//! while that link's peer may reach it, with the remote access it was granted (READ alone registers
//! no remote write), at the opaque base the peer was told (see `ferry_core::peer_view`).
//!
//! A queue pair can reach only memory regions of its own protection domain, so the NIC itself refuses
//! a peer an rkey that was made for another peer, a region it was never granted, a write where it may
//! only read, and every access once its grant is revoked: a revoke deregisters the peer's
//! registration before it returns, and the rkey the peer may have kept names nothing from then on.
//! The engine's own registration of a region (in the device's shared domain, for the work requests
//! this engine posts as an initiator) grants no remote access at all.
//!
//! The price is a registration per region per peer that may reach it: pinning is counted per page, so
//! the memory is pinned once, but each registration builds its own translation table. Memory windows
//! bound to a queue pair would make a grant cheaper; they are not used because the verbs binding has
//! no way to post a bind.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use ferry_core::{Access, Error, PeerScope, RegionEntry, RegionKey, Result, TransportKind};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use crate::RdmaShared;
use crate::mr::IovaRegion;
use ferry_proto::rdma::RemoteKey;

/// One region as registered for one peer.
struct Granted {
    _registration: IovaRegion,
    access: Access,
    base: u64,
    key: RemoteKey,
}

/// One accepted link's protection domain and the regions registered in it for the link's peer; see
/// the module documentation.
pub(crate) struct PeerDomain {
    shared: Weak<RdmaShared>,
    link: u64,
    pub(crate) pd: Arc<ProtectionDomain>,
    granted: Mutex<HashMap<RegionKey, Granted>>,
}

impl PeerDomain {
    /// A fresh protection domain for the peer of `link`.
    pub(crate) fn new(shared: &Arc<RdmaShared>, link: u64) -> Result<Arc<Self>> {
        let pd = shared.device.context.alloc_pd().map_err(|e| {
            Error::ResourceExhausted(format!(
                "allocating a protection domain for link {link} on {}: {e}",
                shared.device.name
            ))
        })?;
        Ok(Arc::new(PeerDomain {
            shared: Arc::downgrade(shared),
            link,
            pd,
            granted: Mutex::new(HashMap::new()),
        }))
    }
}

fn remote_flags(access: Access) -> AccessFlags {
    // Remote write needs local write; a region the peer may only read is registered read-only.
    let mut flags = AccessFlags::LocalWrite;
    if access.contains(Access::READ) {
        flags |= AccessFlags::RemoteRead;
    }
    if access.contains(Access::WRITE) {
        flags |= AccessFlags::RemoteWrite;
    }
    flags
}

impl PeerScope for PeerDomain {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn key_for(&self, region: &RegionEntry, access: Access, base: u64) -> Result<Option<Vec<u8>>> {
        let Some(shared) = self.shared.upgrade() else {
            return Ok(None);
        };
        let Some(reg) = shared.registered_if_any(region.key())? else {
            return Ok(None);
        };
        let mut granted = self
            .granted
            .lock()
            .map_err(|_| Error::Internal("a peer's RDMA registrations lock was poisoned".into()))?;
        if let Some(g) = granted.get(&region.key())
            && g.access == access
            && g.base == base
        {
            return Ok(Some(g.key.encode()));
        }
        let own = reg.advertised();
        // A bounced region is reached at its bounce buffer, and device memory at the address the NIC
        // names it by (or through its dma-buf): that is what the peer is given at its base.
        let addr = reg.nic_first().unwrap_or_else(|| region.ptr_at(0));
        let flags = remote_flags(access);
        let flush = own.flushable && access.contains(Access::WRITE);
        // SAFETY: the region's memory (or its bounce buffer, owned by the shared registration, or the
        // device memory its dma-buf exports) stays mapped until the region is deregistered, and
        // deregistration forgets this registration first (`RdmaTransport::deregister_region` calls
        // `forget` on every peer domain before it returns).
        let registered = crate::register_for_flush(region, flags, flush, |flags| unsafe {
            match reg.registered_dma_buf() {
                Some(buf) => IovaRegion::register_dma_buf(&self.pd, buf, region.len() as usize, base, flags),
                None => IovaRegion::register(&self.pd, addr, region.len() as usize, base, flags),
            }
        });
        let (registered, flushable) = registered.map_err(|e| {
            Error::ResourceExhausted(format!(
                "registering {} bytes of region {:?} for the peer of link {} with {}: {e}",
                region.len(),
                region.key(),
                self.link,
                shared.device.name
            ))
        })?;
        let key = RemoteKey {
            rkey: registered.rkey(),
            flushable,
            bounce_addr: own.bounce_addr.map(|_| base),
            hooked: own.hooked,
        };
        // Inserting drops the previous registration (other access): the old rkey names nothing now.
        granted.insert(
            region.key(),
            Granted {
                _registration: registered,
                access,
                base,
                key,
            },
        );
        tracing::debug!(link = self.link, region = ?region.key(), %access, "region registered for the peer");
        Ok(Some(key.encode()))
    }

    fn forget(&self, key: RegionKey) {
        let gone = self.granted.lock().ok().and_then(|mut g| g.remove(&key));
        if gone.is_some() {
            tracing::debug!(link = self.link, region = ?key, "the peer's registration of the region is gone");
        }
        drop(gone);
    }
}

/// A peer's domains on every rail of a multi-rail engine: its key for a region lists the key of
/// each rail ([`ferry_proto::rdma::RailKeys`]), and forgetting forgets on every rail.
pub struct RailScopes(pub(crate) Vec<Arc<PeerDomain>>);

impl PeerScope for RailScopes {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn key_for(&self, region: &RegionEntry, access: Access, base: u64) -> Result<Option<Vec<u8>>> {
        let mut keys = Vec::with_capacity(self.0.len());
        for domain in &self.0 {
            keys.push(domain.key_for(region, access, base)?);
        }
        Ok((!keys.iter().all(Option::is_none)).then(|| ferry_proto::rdma::RailKeys(keys).encode()))
    }

    fn forget(&self, key: RegionKey) {
        for domain in &self.0 {
            domain.forget(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_follow_the_grant() {
        assert_eq!(
            remote_flags(Access::READ),
            AccessFlags::LocalWrite | AccessFlags::RemoteRead
        );
        assert_eq!(
            remote_flags(Access::WRITE),
            AccessFlags::LocalWrite | AccessFlags::RemoteWrite
        );
        assert_eq!(remote_flags(Access::NONE), AccessFlags::LocalWrite);
    }
}
