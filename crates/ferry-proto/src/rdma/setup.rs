//! What two RDMA ends exchange over the control link, as the blobs of `TransportSetup` frames and
//! region adverts: the address of each queue pair, and the remote keys of registered memory (one per
//! region, or one per rail).

use std::net::Ipv6Addr;

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
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[8..24]);
        let mtu = b[26];
        if !(1..=5).contains(&mtu) {
            return Err(Error::Protocol(format!("RDMA path MTU code {mtu} is out of range")));
        }
        Ok(QpEndpoint {
            qpn: u32_at(0) & 0xff_ffff,
            psn: u32_at(4) & 0xff_ffff,
            gid: Ipv6Addr::from(gid),
            lid: u16::from_le_bytes([b[24], b[25]]),
            mtu,
            flags: b[27],
            rail: b[28],
            rails: b[29].max(1),
            lane: b[30],
        })
    }
}

/// A region's keys on every rail of a multi-rail target, as carried in its advert: one
/// [`RemoteKey`] encoding per rail, empty for a rail the region could not be registered on. A target
/// with one rail advertises its plain [`RemoteKey`] instead; the two are told apart by length (a
/// plain key is 5 or 13 bytes, a rail list at least 16).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailKeys(pub Vec<Option<Vec<u8>>>);

const RAIL_KEYS_MAGIC: [u8; 3] = *b"RLK";
/// Rails one advert may name.
pub const MAX_RAILS: usize = 16;

impl RailKeys {
    /// The advert form: the magic, the count, then each key's length and bytes, padded with zeros to
    /// at least 16 bytes (longer than any plain key).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = RAIL_KEYS_MAGIC.to_vec();
        v.push(self.0.len() as u8);
        for key in &self.0 {
            let key = key.as_deref().unwrap_or(&[]);
            v.push(key.len() as u8);
            v.extend_from_slice(key);
        }
        if v.len() < 16 {
            v.resize(16, 0);
        }
        v
    }

    /// Parses a rail list; `None` for a plain key (or anything that is not a rail list).
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < 16 || b[..3] != RAIL_KEYS_MAGIC {
            return None;
        }
        let n = b[3] as usize;
        if n == 0 || n > MAX_RAILS {
            return None;
        }
        let mut at = 4;
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            let len = *b.get(at)? as usize;
            let key = b.get(at + 1..at + 1 + len)?;
            keys.push((!key.is_empty()).then(|| key.to_vec()));
            at += 1 + len;
        }
        b[at..].iter().all(|&z| z == 0).then_some(RailKeys(keys))
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
    /// The advert form: the rkey little-endian, a flags byte, and the bounce buffer's address (little-endian)
    /// when bounced.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = self.rkey.to_le_bytes().to_vec();
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
        let bad = || Error::Protocol(format!("an RDMA key of {} bytes ({b:02x?})", b.len()));
        let (head, rest) = b.split_first_chunk::<5>().ok_or_else(bad)?;
        let [a, b0, c, d, flags] = *head;
        if flags & !(FLUSHABLE | BOUNCED | HOOKED) != 0 {
            return Err(bad());
        }
        let bounce_addr = match (flags & BOUNCED != 0, rest) {
            (false, []) => None,
            (true, rest) => Some(u64::from_le_bytes(<[u8; 8]>::try_from(rest).map_err(|_| bad())?)),
            (false, _) => return Err(bad()),
        };
        Ok(RemoteKey {
            rkey: u32::from_le_bytes([a, b0, c, d]),
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
            prop_assert_eq!(RailKeys::decode(&keys.encode()), Some(keys.clone()));
            for plain in keys.0.iter().flatten() {
                prop_assert_eq!(RailKeys::decode(plain), None);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = QpEndpoint::decode(&b);
            let _ = RemoteKey::decode(&b);
            let _ = RailKeys::decode(&b);
        }
    }
}
