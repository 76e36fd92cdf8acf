//! What two RDMA ends exchange over the control link, as the blobs of `TransportSetup` frames and
//! region adverts: the address of each queue pair, and the remote keys of registered memory (one per
//! region, or one per rail). A key in an advert starts with a kind byte ([`KEY_PLAIN`] or
//! [`KEY_RAILS`]), so that a reader tells the two apart by what they say they are, never by length.

use std::net::Ipv6Addr;

use ferry_core::wire::WireReader;
use ferry_core::{Error, Result};

/// One side's queue pair address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpEndpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number it will send.
    pub psn: u32,
    /// Its GID (RoCEv2: an IPv4-mapped IPv6 address).
    pub gid: Ipv6Addr,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Active path MTU, as the verbs enum value (1 = 256 … 5 = 4096).
    pub mtu: u8,
    /// What this side can do for persistent writes: [`CAN_POST_FLUSH`], [`FLUSH_TARGET`],
    /// [`ADR_WITHOUT_DDIO`].
    pub flags: u8,
    /// The target's rail (device) this queue pair connects to: the initiator names it, the target
    /// echoes it.
    pub rail: u8,
    /// How many rails the sender has.
    pub rails: u8,
    /// Which of the initiator's queue pairs to this peer it is (one per pair of rails): a new queue
    /// pair of the same lane replaces the old one at the target.
    pub lane: u8,
}

/// The initiator's queue pair can post the FLUSH verb (its user-space library and device have it).
pub const CAN_POST_FLUSH: u8 = 1;
/// The target's device executes persistent FLUSH (it reports FLUSH_PERSISTENT), for regions
/// registered for it.
pub const FLUSH_TARGET: u8 = 2;
/// The target declared its platform ADR with DDIO off: a READ after the writes makes them persistent.
pub const ADR_WITHOUT_DDIO: u8 = 4;

const LEN: usize = 4 + 4 + 16 + 2 + 1 + 1 + 1 + 1 + 1 + 1;
/// 4: a queue pair names the target's rail and its lane, and each side says how many rails it has.
const VERSION: u8 = 4;

impl QpEndpoint {
    /// The wire form: little-endian fixed fields, then a version byte.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(LEN);
        v.extend_from_slice(&self.qpn.to_le_bytes());
        v.extend_from_slice(&self.psn.to_le_bytes());
        v.extend_from_slice(&self.gid.octets());
        v.extend_from_slice(&self.lid.to_le_bytes());
        v.push(self.mtu);
        v.push(self.flags);
        v.push(self.rail);
        v.push(self.rails);
        v.push(self.lane);
        v.push(VERSION);
        v
    }

    /// Parses what `encode` wrote; anything else is a protocol error.
    pub fn decode(b: &[u8]) -> Result<Self> {
        if b.len() != LEN || b[LEN - 1] != VERSION {
            return Err(Error::Protocol(format!(
                "RDMA setup data of {} bytes is not version {VERSION}",
                b.len()
            )));
        }
        let mut r = WireReader::new(&b[..LEN - 1], "RDMA setup data");
        let qpn = r.u32()? & 0xff_ffff;
        let psn = r.u32()? & 0xff_ffff;
        let gid = Ipv6Addr::from(r.array::<16>()?);
        let lid = r.u16()?;
        let mtu = r.u8()?;
        if !(1..=5).contains(&mtu) {
            return Err(r.malformed(format_args!("path MTU code {mtu} is out of range")));
        }
        let endpoint = QpEndpoint {
            qpn,
            psn,
            gid,
            lid,
            mtu,
            flags: r.u8()?,
            rail: r.u8()?,
            rails: r.u8()?.max(1),
            lane: r.u8()?,
        };
        r.finish()?;
        Ok(endpoint)
    }
}

/// The kind byte of a plain [`RemoteKey`] in an advert.
pub const KEY_PLAIN: u8 = 1;
/// The kind byte of a [`RailKeys`] list in an advert.
pub const KEY_RAILS: u8 = 2;

/// A region's keys on every rail of a multi-rail target, as carried in its advert: one
/// [`RemoteKey`] encoding per rail, empty for a rail the region could not be registered on. A target
/// with one rail advertises its plain [`RemoteKey`] instead; the kind byte each starts with tells
/// them apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailKeys(pub Vec<Option<Vec<u8>>>);

/// Rails one advert may name.
pub const MAX_RAILS: usize = 16;

impl RailKeys {
    /// The advert form: [`KEY_RAILS`], the count, then each key's length and bytes (a key of no
    /// bytes for a rail without one).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![KEY_RAILS, self.0.len() as u8];
        for key in &self.0 {
            let key = key.as_deref().unwrap_or(&[]);
            v.push(key.len() as u8);
            v.extend_from_slice(key);
        }
        v
    }

    /// Parses a rail list: `Ok(None)` for a key of another kind (a plain key), a protocol error for
    /// a rail list that does not parse.
    pub fn decode(b: &[u8]) -> Result<Option<Self>> {
        let mut r = WireReader::new(b, "an RDMA rail key list");
        if r.u8()? != KEY_RAILS {
            return Ok(None);
        }
        let n = r.u8()? as usize;
        if n == 0 || n > MAX_RAILS {
            return Err(r.malformed(format_args!("{n} rails (1..={MAX_RAILS})")));
        }
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            let key = r.short_bytes()?;
            keys.push((!key.is_empty()).then(|| key.to_vec()));
        }
        r.finish()?;
        Ok(Some(RailKeys(keys)))
    }
}

/// A region's RDMA key as carried in its advert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteKey {
    /// The rkey.
    pub rkey: u32,
    /// Whether the region was registered for persistent FLUSH (it is persistent memory and the
    /// target's device executes FLUSH).
    pub flushable: bool,
    /// Where RDMA reaches the region when the target bounces it (memory its NIC cannot pin): the
    /// bounce buffer's address, which a region offset is added to. Writes there need a commit
    /// request, and reads go over TCP.
    pub bounce_addr: Option<u64>,
    /// Whether the target's CPU must act around each access that bypasses it (a staged block: device
    /// memory behind a host copy, memory that is not host-coherent): a commit request after writes, a
    /// prepare request before reads.
    pub hooked: bool,
}

const FLUSHABLE: u8 = 1;
const BOUNCED: u8 = 2;
const HOOKED: u8 = 4;

impl RemoteKey {
    /// The advert form: [`KEY_PLAIN`], the rkey little-endian, a flags byte, and the bounce
    /// buffer's address (little-endian) when bounced.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![KEY_PLAIN];
        v.extend_from_slice(&self.rkey.to_le_bytes());
        let flags = if self.flushable { FLUSHABLE } else { 0 }
            | if self.bounce_addr.is_some() { BOUNCED } else { 0 }
            | if self.hooked { HOOKED } else { 0 };
        v.push(flags);
        if let Some(addr) = self.bounce_addr {
            v.extend_from_slice(&addr.to_le_bytes());
        }
        v
    }

    /// Parses what `encode` wrote.
    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = WireReader::new(b, "an RDMA key");
        match r.u8()? {
            KEY_PLAIN => {}
            KEY_RAILS => return Err(r.malformed("a rail key list where one key belongs")),
            kind => return Err(r.malformed(format_args!("unknown key kind {kind}"))),
        }
        let rkey = r.u32()?;
        let flags = r.u8()?;
        if flags & !(FLUSHABLE | BOUNCED | HOOKED) != 0 {
            return Err(r.malformed(format_args!("unknown flags {flags:#x}")));
        }
        let bounce_addr = match flags & BOUNCED != 0 {
            true => Some(r.u64()?),
            false => None,
        };
        r.finish()?;
        Ok(RemoteKey {
            rkey,
            flushable: flags & FLUSHABLE != 0,
            bounce_addr,
            hooked: flags & HOOKED != 0,
        })
    }

    /// Whether the target stages the region.
    pub fn is_bounced(&self) -> bool {
        self.bounce_addr.is_some()
    }

    /// Whether writes to the region need a commit request after them.
    pub fn needs_commit(&self) -> bool {
        self.is_bounced() || self.hooked
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trip(qpn in 0u32..1 << 24, psn in 0u32..1 << 24, gid in any::<[u8; 16]>(), lid in any::<u16>(), mtu in 1u8..=5, flags in 0u8..8, rail in any::<u8>(), rails in 1u8.., lane in any::<u8>()) {
            let e = QpEndpoint { qpn, psn, gid: Ipv6Addr::from(gid), lid, mtu, flags, rail, rails, lane };
            prop_assert_eq!(QpEndpoint::decode(&e.encode()).unwrap(), e);
        }

        #[test]
        fn keys_round_trip(rkey in any::<u32>(), flushable in any::<bool>(), bounce_addr in any::<Option<u64>>(), hooked in any::<bool>()) {
            let k = RemoteKey { rkey, flushable, bounce_addr, hooked };
            prop_assert_eq!(RemoteKey::decode(&k.encode()).unwrap(), k);
        }

        #[test]
        fn rail_keys_round_trip_and_never_pass_for_a_plain_key(keys in proptest::collection::vec(proptest::option::of(any::<(u32, bool, Option<u64>)>()), 2..MAX_RAILS)) {
            let keys = RailKeys(keys.iter().map(|k| k.map(|(rkey, flushable, bounce_addr)| RemoteKey { rkey, flushable, bounce_addr, hooked: false }.encode())).collect());
            prop_assert_eq!(RailKeys::decode(&keys.encode()).unwrap(), Some(keys.clone()));
            for plain in keys.0.iter().flatten() {
                prop_assert_eq!(RailKeys::decode(plain).unwrap(), None);
                prop_assert!(RemoteKey::decode(plain).is_ok());
            }
            prop_assert!(matches!(RemoteKey::decode(&keys.encode()), Err(Error::Protocol(_))), "a rail list never passes for a key");
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = QpEndpoint::decode(&b);
            let _ = RemoteKey::decode(&b);
            let _ = RailKeys::decode(&b);
        }
    }
}
