//! What one peer sees of this engine: who it proved to be, and the names it knows regions by.
//!
//! On an engine that authenticates its links, each peer (each identity) has its own names for the
//! regions it may reach, derived from a secret the engine draws at start ([`PeerNames`]):
//!
//! - **Keys are per peer.** The key a peer is told is the region's key masked with a value derived
//!   from the secret and the peer's name; the target unmasks every key a request names with its link's
//!   mask (one XOR). A key learned by one peer names no region for another (it unmasks to a random
//!   key), so a key that leaks through a peer's logs, or is passed from one peer to another, is worth
//!   nothing; a peer's grants are still checked on every request.
//! - **Addresses are opaque.** A region's advert carries a base derived from the secret, the peer's
//!   name and the region's key, not the region's virtual address: a peer learns nothing of this
//!   process's address-space layout. The base is stable for that peer, so the application that owns
//!   the region can hand it to that peer out of band (`Region::addr_for` in `ferry`), as HIXL
//!   applications hand out addresses. Requests name a region by key and offset, so a TCP target never
//!   translates an address; where the NIC resolves addresses by itself (RDMA), the transport registers
//!   the region for the peer at exactly this base (see [`PeerScope`]). The base keeps the address's
//!   offset within a 2 MiB page, so that a NIC can still map the region with huge pages.
//! - **Transport keys are per peer** where the transport can make them so ([`PeerScope`]): an RDMA
//!   target registers a region in the link's own protection domain, with the access that peer was
//!   granted, and deregisters it there when the grant goes.
//!
//! An engine open to anyone (no authentication) shows every peer the regions' own keys and addresses:
//! anyone who can reach its port is told them anyway, and applications that pass addresses to their
//! peers out of band keep working unchanged.

use std::sync::Arc;

use ring::hmac;

use crate::error::{Error, Result};
use crate::grants::AccessEpochs;
use crate::region::{RegionEntry, RegionTable};
use crate::types::{Access, PeerIdentity, RegionAd, RegionKey, TransportKind};

/// Bits of a region's address its opaque base keeps: the offset within a 2 MiB page.
const KEPT_ADDRESS_BITS: u64 = (2 << 20) - 1;
/// Opaque bases lie below 2^62, so a base plus any region length stays far from overflowing.
const BASE_LIMIT: u64 = (1 << 62) - 1;

/// A transport's state for one accepted link's peer, where the transport can give each peer its own
/// keys (an RDMA protection domain of the link's own). Made by [`crate::Transport::peer_scope`] when
/// the link is admitted, dropped with the link.
pub trait PeerScope: Send + Sync {
    /// The transport.
    fn kind(&self) -> TransportKind;
    /// The transport key the peer names `region` by, with `access` (what it was granted) and `base`
    /// (the address the peer was told for the region's first byte). Called whenever the peer is told
    /// of the region, again after its grants change: an implementation that registers per peer
    /// re-registers when `access` changed and returns the new key. `Ok(None)`: this transport does not
    /// serve the region to this peer (the advert then carries no key for it).
    fn key_for(&self, region: &RegionEntry, access: Access, base: u64) -> Result<Option<Vec<u8>>>;
    /// The peer may no longer reach `key` (revoked, or deregistered): after this returns the transport
    /// refuses the peer every access to it.
    fn forget(&self, key: RegionKey);
}

/// The secret every authenticated peer's names are derived from (see the module documentation).
pub struct PeerNames {
    secret: hmac::Key,
}

impl std::fmt::Debug for PeerNames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerNames(..)")
    }
}

impl PeerNames {
    /// A fresh secret from the OS.
    pub fn random() -> Result<Self> {
        let mut b = [0u8; 32];
        getrandom::fill(&mut b).map_err(|e| Error::Io {
            kind: std::io::ErrorKind::Other,
            message: format!("drawing the engine's naming secret from the OS: {e}"),
        })?;
        Ok(PeerNames {
            secret: hmac::Key::new(hmac::HMAC_SHA256, &b),
        })
    }

    fn derive(&self, label: &[u8], peer: &str, key: Option<RegionKey>) -> u64 {
        let mut ctx = hmac::Context::with_key(&self.secret);
        ctx.update(label);
        ctx.update(&(peer.len() as u64).to_le_bytes());
        ctx.update(peer.as_bytes());
        if let Some(key) = key {
            ctx.update(&key.0.to_le_bytes());
        }
        let tag = ctx.sign();
        let mut b = [0u8; 8];
        b.copy_from_slice(&tag.as_ref()[..8]);
        u64::from_le_bytes(b)
    }

    /// The mask of the keys the peer named `peer` is told.
    pub fn key_mask(&self, peer: &str) -> u64 {
        self.derive(b"ferry region key mask", peer, None)
    }

    /// The address the peer named `peer` is told for the first byte of `region`.
    pub fn base(&self, peer: &str, region: &RegionEntry) -> u64 {
        let drawn = self.derive(b"ferry region base", peer, Some(region.key()));
        (drawn & BASE_LIMIT & !KEPT_ADDRESS_BITS) | (region.addr() & KEPT_ADDRESS_BITS)
    }
}

/// The names one link's peer knows regions by; see the module documentation.
pub struct PeerView {
    identity: Option<PeerIdentity>,
    names: Option<(Arc<PeerNames>, u64)>,
    scopes: Vec<Arc<dyn PeerScope>>,
    /// This link's remote operations in progress, for a revoke that concerns its peer to wait out
    /// (see [`crate::grants`]): only those, not every peer's.
    accesses: Arc<AccessEpochs>,
}

impl std::fmt::Debug for PeerView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerView")
            .field("identity", &self.identity)
            .field("per_peer_names", &self.names.is_some())
            .field("scopes", &self.scopes.iter().map(|s| s.kind()).collect::<Vec<_>>())
            .finish()
    }
}

impl PeerView {
    /// The view of a peer of an engine open to anyone: the regions' own keys and addresses, and the
    /// access every region grants.
    pub fn open() -> Self {
        PeerView {
            identity: None,
            names: None,
            scopes: Vec::new(),
            accesses: Arc::default(),
        }
    }

    /// The view of the authenticated peer `identity`: its names from `names`, the transport keys of
    /// `scopes`.
    pub fn authenticated(identity: PeerIdentity, names: Arc<PeerNames>, scopes: Vec<Arc<dyn PeerScope>>) -> Self {
        let mask = names.key_mask(&identity.name);
        PeerView {
            identity: Some(identity),
            names: Some((names, mask)),
            scopes,
            accesses: Arc::default(),
        }
    }

    /// The link's remote operations in progress: each one counts itself from before its grant check
    /// until it is answered (`accesses().begin()`), and a revoke that concerns this peer waits them out.
    pub fn accesses(&self) -> &Arc<AccessEpochs> {
        &self.accesses
    }

    /// Who the peer proved to be; `None` on an open engine.
    pub fn identity(&self) -> Option<&PeerIdentity> {
        self.identity.as_ref()
    }

    /// The transport's state for this peer, if it keeps one.
    pub fn scope(&self, kind: TransportKind) -> Option<&Arc<dyn PeerScope>> {
        self.scopes.iter().find(|s| s.kind() == kind)
    }

    /// The key the peer knows region `real` by.
    pub fn key_for_peer(&self, real: RegionKey) -> RegionKey {
        match &self.names {
            Some((_, mask)) => RegionKey(real.0 ^ mask),
            None => real,
        }
    }

    /// The region a key named by the peer stands for (a key told to another peer stands for none).
    pub fn real_key(&self, named: RegionKey) -> RegionKey {
        // Masking is its own inverse.
        self.key_for_peer(named)
    }

    /// The address the peer was told for the first byte of `region`.
    pub fn base_for_peer(&self, region: &RegionEntry) -> u64 {
        match (&self.names, &self.identity) {
            (Some((names, _)), Some(who)) => names.base(&who.name, region),
            _ => region.addr(),
        }
    }

    /// The advert the peer is told of `region`, in its names; `None` if it may do nothing there.
    pub fn advert(&self, region: &RegionEntry) -> Option<RegionAd> {
        let ad = region.advert_for(self.identity())?;
        if self.names.is_none() {
            return Some(ad);
        }
        let base = self.base_for_peer(region);
        let mut transport_keys = Vec::new();
        for (kind, key) in ad.transport_keys {
            let Some(scope) = self.scope(kind) else {
                transport_keys.push((kind, key));
                continue;
            };
            // A transport that cannot serve the region to this peer leaves it to the next one.
            match scope.key_for(region, ad.access, base) {
                Ok(Some(key)) => transport_keys.push((kind, key.into())),
                Ok(None) => {}
                Err(e) => tracing::warn!(
                    region = ?region.key(),
                    transport = %kind,
                    error = %e,
                    "the region is served to this peer without this transport"
                ),
            }
        }
        Some(RegionAd {
            key: self.key_for_peer(ad.key),
            addr: base,
            transport_keys,
            ..ad
        })
    }

    /// What the peer is told of every region it may reach.
    pub fn adverts(&self, table: &RegionTable) -> Vec<RegionAd> {
        table.entries().filter_map(|r| self.advert(r)).collect()
    }

    /// The peer may no longer reach `real` (revoked or deregistered): every transport that keeps
    /// per-peer state refuses it from now on. Returns the key the peer knows it by.
    pub fn forget(&self, real: RegionKey) -> RegionKey {
        for scope in &self.scopes {
            scope.forget(real);
        }
        self.key_for_peer(real)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::memory::{MemoryBlock, OwnedBuffer};

    fn who(name: &str) -> PeerIdentity {
        PeerIdentity {
            name: name.into(),
            subject: format!("CN={name}"),
            alt_names: vec![name.into()],
        }
    }

    fn region(len: usize) -> RegionEntry {
        let block: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(vec![0u8; len]));
        let r = RegionEntry::new(RegionKey::random().unwrap(), Access::READ_WRITE, block).unwrap();
        r.update_grants(|g| g.everyone = Access::READ_WRITE).unwrap();
        r
    }

    #[test]
    fn open_engines_show_real_names() {
        let r = region(4096);
        let ad = PeerView::open().advert(&r).unwrap();
        assert_eq!((ad.key, ad.addr), (r.key(), r.addr()));
    }

    #[test]
    fn each_peer_gets_its_own_keys_and_bases() {
        let names = Arc::new(PeerNames::random().unwrap());
        let r = region(4096);
        let a = PeerView::authenticated(who("a"), names.clone(), vec![]);
        let a2 = PeerView::authenticated(who("a"), names.clone(), vec![]);
        let b = PeerView::authenticated(who("b"), names.clone(), vec![]);
        let (ad_a, ad_b) = (a.advert(&r).unwrap(), b.advert(&r).unwrap());
        assert_ne!(ad_a.key, r.key());
        assert_ne!(ad_a.key, ad_b.key);
        assert_eq!(a.real_key(ad_a.key), r.key());
        // A key told to one peer names nothing for another.
        assert_ne!(b.real_key(ad_a.key), r.key());
        assert_ne!(ad_a.addr, r.addr());
        assert_ne!(ad_a.addr, ad_b.addr);
        assert_eq!(ad_a.addr & KEPT_ADDRESS_BITS, r.addr() & KEPT_ADDRESS_BITS);
        assert!(ad_a.addr.checked_add(u64::MAX >> 2).is_some());
        // Stable for the peer: another link of the same peer is told the same, and so is the
        // application that asks for the peer's address.
        let ad_a2 = a2.advert(&r).unwrap();
        assert_eq!((ad_a2.key, ad_a2.addr), (ad_a.key, ad_a.addr));
        assert_eq!(names.base("a", &r), ad_a.addr);
        // Another engine's secret gives other names.
        let other = PeerView::authenticated(who("a"), Arc::new(PeerNames::random().unwrap()), vec![]);
        assert_ne!(other.advert(&r).unwrap().addr, ad_a.addr);
    }

    #[test]
    fn ungranted_regions_have_no_advert() {
        let block: Arc<dyn MemoryBlock> = Arc::new(OwnedBuffer::new(vec![0u8; 64]));
        let r = RegionEntry::new(RegionKey::random().unwrap(), Access::READ_WRITE, block).unwrap();
        let a = PeerView::authenticated(who("a"), Arc::new(PeerNames::random().unwrap()), vec![]);
        assert!(a.advert(&r).is_none());
    }
}
