//! What the two ends of a same-host link exchange, as bytes: the setup over the control link (the
//! initiator's facts and probe, the target's socket and token, and whether the target may copy with
//! cross-memory attach), then requests and replies on the link's Unix socket. And whether two
//! processes' facts allow such a link at all ([`HostFacts::why_not`]).
//!
//! On the socket the initiator sends transfers (ranges for the target to copy), asks for a region's
//! memory file (`Map`), and confirms that it unmapped one (`Unmapped`). The target sends replies,
//! a region's memory file (`Mapped`, the descriptor attached to its bytes) or, for GPU memory, the
//! device's handle of it (`DeviceMapped`: a CUDA IPC handle and the device's PCI address), and asks
//! for a mapping back (`Unmap`).
//!
//! Every length is checked before anything is allocated: a request names at most [`MAX_ITEMS`] ranges.

use ferry_core::wire::WireReader;
use ferry_core::{Durability, Error, ErrorCode, Op, RegionKey, Result, WireError};

const VERSION: u8 = 3;
/// Ranges one request may name (a batch with more is split by the initiator).
pub const MAX_ITEMS: usize = 4096;
/// Bytes of the initiator's probe buffer.
pub const PROBE_LEN: usize = 32;
/// Bytes of the token the initiator presents on the Unix socket.
pub const TOKEN_LEN: usize = 32;

/// A namespace, as the kernel names it: the device and inode of `/proc/self/ns/<kind>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Namespace {
    /// Device of the nsfs entry.
    pub dev: u64,
    /// Inode of the nsfs entry.
    pub ino: u64,
}

/// This process's place on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFacts {
    /// `/proc/sys/kernel/random/boot_id`: one per boot of one kernel.
    pub boot_id: [u8; 36],
    /// The process id, in `pid_ns`.
    pub pid: u32,
    /// The real user id.
    pub uid: u32,
    /// PID namespace.
    pub pid_ns: Namespace,
    /// User namespace.
    pub user_ns: Namespace,
    /// Network namespace (the Unix socket the link uses is in the abstract namespace of one).
    pub net_ns: Namespace,
}

impl HostFacts {
    /// Why a peer with facts `peer` cannot use this transport with this process, or `None` when it
    /// can (as far as facts go: the kernel still has its say, through the probe of cross-memory attach).
    pub fn why_not(&self, peer: &HostFacts) -> Option<String> {
        if self.boot_id != peer.boot_id {
            return Some("the peer runs on another host (another kernel boot id)".into());
        }
        if self.pid_ns != peer.pid_ns {
            return Some("the peer is in another PID namespace (a container without a shared PID namespace)".into());
        }
        if self.user_ns != peer.user_ns {
            return Some("the peer is in another user namespace".into());
        }
        if self.net_ns != peer.net_ns {
            return Some("the peer is in another network namespace (the link's Unix socket is not reachable)".into());
        }
        None
    }
}

/// The error for a message of kind `what` that does not parse.
pub fn malformed(what: &str) -> Error {
    Error::Protocol(format!("shared-memory {what} is malformed"))
}

/// A namespace's device and inode, as [`put_ns`] wrote them.
fn ns(r: &mut WireReader<'_>) -> Result<Namespace> {
    Ok(Namespace {
        dev: r.u64()?,
        ino: r.u64()?,
    })
}

fn put_ns(v: &mut Vec<u8>, ns: Namespace) {
    v.extend_from_slice(&ns.dev.to_le_bytes());
    v.extend_from_slice(&ns.ino.to_le_bytes());
}

/// The initiator's setup: where it is, and a probe buffer the target must read through cross-memory
/// attach before it agrees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    /// The initiator's facts.
    pub facts: HostFacts,
    /// The address of the probe buffer in the initiator's process.
    pub probe_addr: u64,
    /// What the probe buffer holds (random).
    pub probe: [u8; PROBE_LEN],
}

impl Offer {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![VERSION];
        v.extend_from_slice(&self.facts.boot_id);
        v.extend_from_slice(&self.facts.pid.to_le_bytes());
        v.extend_from_slice(&self.facts.uid.to_le_bytes());
        put_ns(&mut v, self.facts.pid_ns);
        put_ns(&mut v, self.facts.user_ns);
        put_ns(&mut v, self.facts.net_ns);
        v.extend_from_slice(&self.probe_addr.to_le_bytes());
        v.extend_from_slice(&self.probe);
        v
    }

    /// Parses what `encode` wrote.
    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = WireReader::new(b, "shared-memory setup");
        if r.u8()? != VERSION {
            return Err(Error::Protocol(format!(
                "shared-memory setup is not version {VERSION}: upgrade one of the engines"
            )));
        }
        let facts = HostFacts {
            boot_id: r.array()?,
            pid: r.u32()?,
            uid: r.u32()?,
            pid_ns: ns(&mut r)?,
            user_ns: ns(&mut r)?,
            net_ns: ns(&mut r)?,
        };
        let offer = Offer {
            facts,
            probe_addr: r.u64()?,
            probe: r.array()?,
        };
        r.finish()?;
        Ok(offer)
    }
}

/// The target's answer: the abstract Unix socket to connect to, the token to present there, and
/// whether the target can copy between the initiator's memory and its regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The socket's abstract name.
    pub socket: [u8; 24],
    /// The one-time token.
    pub token: [u8; TOKEN_LEN],
    /// Why the target cannot use cross-memory attach with the initiator (it then serves only the
    /// regions it lends as memory files); `None` when it can.
    pub copies_denied: Option<String>,
}

/// The longest reason an answer carries.
const MAX_REASON: usize = 512;

impl Answer {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![VERSION];
        v.extend_from_slice(&self.socket);
        v.extend_from_slice(&self.token);
        match &self.copies_denied {
            None => v.push(0),
            Some(why) => {
                let why = &why.as_bytes()[..why.len().min(MAX_REASON)];
                v.push(1);
                v.extend_from_slice(&(why.len() as u16).to_le_bytes());
                v.extend_from_slice(why);
            }
        }
        v
    }

    /// Parses what `encode` wrote.
    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = WireReader::new(b, "shared-memory setup answer");
        if r.u8()? != VERSION {
            return Err(malformed("setup answer"));
        }
        let socket = r.array()?;
        let token = r.array()?;
        let copies_denied = match r.u8()? {
            0 => None,
            1 => {
                let why = r.bytes()?;
                if why.len() > MAX_REASON {
                    return Err(malformed("setup answer"));
                }
                Some(String::from_utf8_lossy(why).into_owned())
            }
            _ => return Err(malformed("setup answer")),
        };
        r.finish()?;
        Ok(Answer {
            socket,
            token,
            copies_denied,
        })
    }
}

/// One range of a request: the target's region (by the key the peer knows it by) and offset, and the
/// initiator's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    /// The region's key, as the initiator was told it.
    pub key: RegionKey,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// The initiator's address of the first byte.
    pub addr: u64,
}

/// A request's fixed part: id, kind, durability, item count.
pub const REQUEST_HEAD: usize = 8 + 1 + 1 + 4;
/// One item's bytes.
pub const ITEM_LEN: usize = 32;

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    /// Copy the ranges.
    Transfer(Op),
    /// Lend the memory file of the region its one item names.
    Map,
    /// The initiator unmapped the region its one item names; the id is that of the target's `Unmap`.
    Unmapped,
}

/// A request's head, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHead {
    /// The id its reply carries.
    pub id: u64,
    /// What it asks for.
    pub kind: RequestKind,
    /// For a write: how durable it must be before the reply.
    pub durability: Durability,
    /// How many items follow.
    pub items: usize,
}

/// Appends a request to `out`.
pub fn encode_request(out: &mut Vec<u8>, id: u64, kind: RequestKind, durability: Durability, items: &[Item]) {
    out.extend_from_slice(&id.to_le_bytes());
    out.push(match kind {
        RequestKind::Transfer(Op::Write) => 0,
        RequestKind::Transfer(Op::Read) => 1,
        RequestKind::Map => 2,
        RequestKind::Unmapped => 3,
    });
    out.push(match durability {
        Durability::Completed => 0,
        Durability::Persistent => 1,
    });
    out.extend_from_slice(&(items.len() as u32).to_le_bytes());
    for i in items {
        for v in [i.key.0, i.offset, i.len, i.addr] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// Appends a request about one region (`Map`, `Unmapped`) to `out`.
pub fn encode_region_request(out: &mut Vec<u8>, id: u64, kind: RequestKind, key: RegionKey) {
    let item = Item {
        key,
        offset: 0,
        len: 0,
        addr: 0,
    };
    encode_request(out, id, kind, Durability::Completed, &[item]);
}

/// A request's head, parsed.
pub fn decode_request_head(b: &[u8; REQUEST_HEAD]) -> Result<RequestHead> {
    let mut r = WireReader::new(b, "shared-memory request");
    let id = r.u64()?;
    let kind = match r.u8()? {
        0 => RequestKind::Transfer(Op::Write),
        1 => RequestKind::Transfer(Op::Read),
        2 => RequestKind::Map,
        3 => RequestKind::Unmapped,
        _ => return Err(malformed("request (kind)")),
    };
    let durability = match r.u8()? {
        0 => Durability::Completed,
        1 => Durability::Persistent,
        _ => return Err(malformed("request (durability)")),
    };
    let n = r.u32()? as usize;
    let most = match kind {
        RequestKind::Transfer(_) => MAX_ITEMS,
        RequestKind::Map | RequestKind::Unmapped => 1,
    };
    if n == 0 || n > most {
        return Err(Error::Protocol(format!(
            "a shared-memory request ({kind:?}) of {n} ranges (1..={most})"
        )));
    }
    Ok(RequestHead {
        id,
        kind,
        durability,
        items: n,
    })
}

/// The items of a request.
pub fn decode_items(b: &[u8]) -> Result<Vec<Item>> {
    if !b.len().is_multiple_of(ITEM_LEN) {
        return Err(malformed("request (items)"));
    }
    let mut r = WireReader::new(b, "shared-memory request items");
    let mut items = Vec::with_capacity(b.len() / ITEM_LEN);
    while !r.is_empty() {
        items.push(Item {
            key: RegionKey(r.u64()?),
            offset: r.u64()?,
            len: r.u64()?,
            addr: r.u64()?,
        });
    }
    Ok(items)
}

/// A reply's fixed part: id, kind, error code (0 = done), length of what follows.
pub const REPLY_HEAD: usize = 8 + 1 + 2 + 2;
/// The longest error message a reply carries (longer ones are cut).
pub const MAX_MESSAGE: usize = 1024;
/// The body of a `Mapped` reply: the region's length and whether it may be written.
pub const MAPPED_LEN: usize = 8 + 1;
/// The body of an `Unmap`: the region's key.
pub const UNMAP_LEN: usize = 8;
/// Bytes of the device handle a `DeviceMapped` reply carries (a CUDA IPC memory handle).
pub const DEVICE_HANDLE_LEN: usize = 64;
/// Bytes of the PCI address a `DeviceMapped` reply carries ("0000:3b:00.0", NUL-padded).
pub const PCI_ADDRESS_LEN: usize = 16;
/// The body of a `DeviceMapped` reply: region length, offset in the allocation, handle, PCI address.
pub const DEVICE_MAPPED_LEN: usize = 8 + 8 + DEVICE_HANDLE_LEN + PCI_ADDRESS_LEN;

/// A region of device memory the target lends: the handle that opens its allocation in another
/// process, where the region starts in it, and the device (by PCI address, which unlike an ordinal
/// is the same in every process).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceLend {
    /// The region's bytes.
    pub len: u64,
    /// Where the region starts in the allocation the handle opens.
    pub offset: u64,
    /// The handle (`cuIpcGetMemHandle`).
    pub handle: [u8; DEVICE_HANDLE_LEN],
    /// The device's PCI address, "0000:3b:00.0".
    pub pci_address: String,
}

/// What a message from the target is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyKind {
    /// The end of a request: done (`None`), or the error's code (its message follows).
    Done(Option<ErrorCode>),
    /// A `Map` request's answer: the region's memory file is attached, its length and access follow.
    Mapped,
    /// The target asks for the mapping of the region whose key follows (the id is the target's own).
    Unmap,
    /// A `Map` request's answer for device memory: a [`DeviceLend`] follows.
    DeviceMapped,
}

fn put_reply_head(out: &mut Vec<u8>, id: u64, kind: u8, code: u16, len: usize) {
    out.extend_from_slice(&id.to_le_bytes());
    out.push(kind);
    out.extend_from_slice(&code.to_le_bytes());
    out.extend_from_slice(&(len as u16).to_le_bytes());
}

/// Appends a reply to `out`.
pub fn encode_reply(out: &mut Vec<u8>, id: u64, result: &Result<()>) {
    match result {
        Ok(()) => put_reply_head(out, id, 0, 0, 0),
        Err(e) => {
            let message = e.message();
            let mut cut = message.len().min(MAX_MESSAGE);
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            put_reply_head(out, id, 0, e.code() as u16, cut);
            out.extend_from_slice(&message.as_bytes()[..cut]);
        }
    }
}

/// Appends a `Mapped` reply (whose bytes the memory file is sent with) to `out`.
pub fn encode_mapped(out: &mut Vec<u8>, id: u64, len: u64, writable: bool) {
    put_reply_head(out, id, 1, 0, MAPPED_LEN);
    out.extend_from_slice(&len.to_le_bytes());
    out.push(u8::from(writable));
}

/// Appends an `Unmap` of the region the peer knows as `key` to `out`.
pub fn encode_unmap(out: &mut Vec<u8>, id: u64, key: RegionKey) {
    put_reply_head(out, id, 2, 0, UNMAP_LEN);
    out.extend_from_slice(&key.0.to_le_bytes());
}

/// A reply's head, parsed: its id, kind and how many bytes follow.
pub fn decode_reply_head(b: &[u8; REPLY_HEAD]) -> Result<(u64, ReplyKind, usize)> {
    let mut r = WireReader::new(b, "shared-memory reply");
    let id = r.u64()?;
    let kind = r.u8()?;
    let code = r.u16()?;
    let len = r.u16()? as usize;
    let kind = match (kind, code, len) {
        (0, 0, 0) => ReplyKind::Done(None),
        (0, c, n) if c != 0 && n <= MAX_MESSAGE => {
            ReplyKind::Done(Some(ErrorCode::from_u16(c).unwrap_or(ErrorCode::Internal)))
        }
        (1, 0, MAPPED_LEN) => ReplyKind::Mapped,
        (2, 0, UNMAP_LEN) => ReplyKind::Unmap,
        (3, 0, DEVICE_MAPPED_LEN) => ReplyKind::DeviceMapped,
        _ => return Err(malformed("reply")),
    };
    Ok((id, kind, len))
}

/// A `Mapped` reply's body: the region's length and whether the peer may write it.
pub fn decode_mapped(b: &[u8; MAPPED_LEN]) -> Result<(u64, bool)> {
    let mut r = WireReader::new(b, "shared-memory mapped reply");
    let len = r.u64()?;
    let writable = match r.u8()? {
        0 => false,
        1 => true,
        _ => return Err(malformed("mapped reply")),
    };
    Ok((len, writable))
}

/// Appends a `DeviceMapped` reply to `out`. A PCI address longer than [`PCI_ADDRESS_LEN`] bytes is
/// no PCI address; the caller checked it (see [`pci_address_fits`]).
pub fn encode_device_mapped(out: &mut Vec<u8>, id: u64, lend: &DeviceLend) {
    put_reply_head(out, id, 3, 0, DEVICE_MAPPED_LEN);
    out.extend_from_slice(&lend.len.to_le_bytes());
    out.extend_from_slice(&lend.offset.to_le_bytes());
    out.extend_from_slice(&lend.handle);
    let mut pci = [0u8; PCI_ADDRESS_LEN];
    let n = lend.pci_address.len().min(PCI_ADDRESS_LEN);
    pci[..n].copy_from_slice(&lend.pci_address.as_bytes()[..n]);
    out.extend_from_slice(&pci);
}

/// Whether `pci_address` fits a `DeviceMapped` reply.
pub fn pci_address_fits(pci_address: &str) -> bool {
    pci_address.len() <= PCI_ADDRESS_LEN && pci_address.is_ascii() && !pci_address.contains('\0')
}

/// A `DeviceMapped` reply's body.
pub fn decode_device_mapped(b: &[u8; DEVICE_MAPPED_LEN]) -> Result<DeviceLend> {
    let mut r = WireReader::new(b, "shared-memory device mapped reply");
    let len = r.u64()?;
    let offset = r.u64()?;
    let handle = r.array()?;
    let pci: [u8; PCI_ADDRESS_LEN] = r.array()?;
    r.finish()?;
    let end = pci.iter().position(|&c| c == 0).unwrap_or(PCI_ADDRESS_LEN);
    let pci_address = std::str::from_utf8(&pci[..end])
        .ok()
        .filter(|a| !a.is_empty() && pci[end..].iter().all(|&c| c == 0))
        .ok_or_else(|| malformed("device mapped reply (PCI address)"))?;
    if len == 0 || offset.checked_add(len).is_none() {
        return Err(malformed("device mapped reply (range)"));
    }
    Ok(DeviceLend {
        len,
        offset,
        handle,
        pci_address: pci_address.to_string(),
    })
}

/// The error a reply carries.
pub fn reply_error(code: ErrorCode, message: &[u8]) -> Error {
    WireError {
        code,
        io_kind: std::io::ErrorKind::Other,
        message: String::from_utf8_lossy(message).into_owned(),
    }
    .into_error()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn facts() -> HostFacts {
        HostFacts {
            boot_id: [b'a'; 36],
            pid: 42,
            uid: 1000,
            pid_ns: Namespace { dev: 4, ino: 5 },
            user_ns: Namespace { dev: 4, ino: 6 },
            net_ns: Namespace { dev: 4, ino: 7 },
        }
    }

    proptest! {
        #[test]
        fn offers_and_answers_round_trip(addr in any::<u64>(), probe in any::<[u8; PROBE_LEN]>(), token in any::<[u8; TOKEN_LEN]>(), socket in any::<[u8; 24]>()) {
            let offer = Offer { facts: facts(), probe_addr: addr, probe };
            prop_assert_eq!(Offer::decode(&offer.encode()).unwrap(), offer);
            for copies_denied in [None, Some("ptrace denied".to_string())] {
                let answer = Answer { socket, token, copies_denied };
                prop_assert_eq!(Answer::decode(&answer.encode()).unwrap(), answer);
            }
        }

        #[test]
        fn requests_round_trip(id in any::<u64>(), raw in proptest::collection::vec(any::<(u64, u64, u64, u64)>(), 1..64), read in any::<bool>()) {
            let items: Vec<Item> = raw.iter().map(|&(k, o, l, a)| Item { key: RegionKey(k), offset: o, len: l, addr: a }).collect();
            let kind = RequestKind::Transfer(if read { Op::Read } else { Op::Write });
            let mut out = Vec::new();
            encode_request(&mut out, id, kind, Durability::Persistent, &items);
            let head: [u8; REQUEST_HEAD] = out[..REQUEST_HEAD].try_into().unwrap();
            let want = RequestHead { id, kind, durability: Durability::Persistent, items: items.len() };
            prop_assert_eq!(decode_request_head(&head).unwrap(), want);
            prop_assert_eq!(decode_items(&out[REQUEST_HEAD..]).unwrap(), items);
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Offer::decode(&b);
            let _ = Answer::decode(&b);
            let _ = decode_items(&b);
            if let Ok(head) = <[u8; REQUEST_HEAD]>::try_from(&b[..b.len().min(REQUEST_HEAD)]) {
                let _ = decode_request_head(&head);
            }
            if let Ok(head) = <[u8; REPLY_HEAD]>::try_from(&b[..b.len().min(REPLY_HEAD)]) {
                let _ = decode_reply_head(&head);
            }
        }
    }

    proptest! {
        #[test]
        fn device_lends_round_trip(id in any::<u64>(), len in 1u64..(1 << 50), offset in 0u64..(1 << 50), handle in any::<[u8; DEVICE_HANDLE_LEN]>(), pci in "[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\\.[0-7]") {
            let lend = DeviceLend { len, offset, handle, pci_address: pci };
            let mut out = Vec::new();
            encode_device_mapped(&mut out, id, &lend);
            let head: [u8; REPLY_HEAD] = out[..REPLY_HEAD].try_into().unwrap();
            prop_assert_eq!(decode_reply_head(&head).unwrap(), (id, ReplyKind::DeviceMapped, DEVICE_MAPPED_LEN));
            let body: [u8; DEVICE_MAPPED_LEN] = out[REPLY_HEAD..].try_into().unwrap();
            prop_assert_eq!(decode_device_mapped(&body).unwrap(), lend);
        }

        #[test]
        fn device_lend_bodies_never_panic(b in any::<[u8; DEVICE_MAPPED_LEN]>()) {
            let _ = decode_device_mapped(&b);
        }
    }

    #[test]
    fn a_device_lend_without_a_device_or_a_range_is_refused() {
        let lend = DeviceLend {
            len: 4096,
            offset: 0,
            handle: [1; DEVICE_HANDLE_LEN],
            pci_address: "0000:3b:00.0".into(),
        };
        let body = |lend: &DeviceLend| -> [u8; DEVICE_MAPPED_LEN] {
            let mut out = Vec::new();
            encode_device_mapped(&mut out, 1, lend);
            out[REPLY_HEAD..].try_into().unwrap()
        };
        assert!(pci_address_fits(&lend.pci_address));
        assert!(!pci_address_fits("0000:3b:00.0-and-more"));
        let empty = DeviceLend { len: 0, ..lend.clone() };
        assert!(matches!(decode_device_mapped(&body(&empty)), Err(Error::Protocol(_))));
        let wraps = DeviceLend {
            offset: u64::MAX,
            ..lend.clone()
        };
        assert!(matches!(decode_device_mapped(&body(&wraps)), Err(Error::Protocol(_))));
        let nameless = DeviceLend {
            pci_address: String::new(),
            ..lend.clone()
        };
        assert!(matches!(
            decode_device_mapped(&body(&nameless)),
            Err(Error::Protocol(_))
        ));
        // Bytes after the address's end must be padding.
        let mut b = body(&lend);
        b[DEVICE_MAPPED_LEN - 1] = b'x';
        assert!(matches!(decode_device_mapped(&b), Err(Error::Protocol(_))));
        let full = DeviceLend {
            pci_address: "00000000:3b:00.0".into(),
            ..lend.clone()
        };
        assert_eq!(
            decode_device_mapped(&body(&full)).unwrap(),
            full,
            "16 bytes of address, no padding"
        );
    }

    #[test]
    fn oversized_requests_are_refused_before_allocating() {
        let mut out = Vec::new();
        encode_request(
            &mut out,
            1,
            RequestKind::Transfer(Op::Write),
            Durability::Completed,
            &[],
        );
        out[10..14].copy_from_slice(&(MAX_ITEMS as u32 + 1).to_le_bytes());
        let head: [u8; REQUEST_HEAD] = out[..REQUEST_HEAD].try_into().unwrap();
        assert!(matches!(decode_request_head(&head), Err(Error::Protocol(_))));
    }

    #[test]
    fn region_requests_name_exactly_one_region() {
        let mut out = Vec::new();
        encode_region_request(&mut out, 3, RequestKind::Map, RegionKey(77));
        let head: [u8; REQUEST_HEAD] = out[..REQUEST_HEAD].try_into().unwrap();
        let parsed = decode_request_head(&head).unwrap();
        assert_eq!((parsed.id, parsed.kind, parsed.items), (3, RequestKind::Map, 1));
        assert_eq!(decode_items(&out[REQUEST_HEAD..]).unwrap()[0].key, RegionKey(77));
        out[10..14].copy_from_slice(&2u32.to_le_bytes());
        let head: [u8; REQUEST_HEAD] = out[..REQUEST_HEAD].try_into().unwrap();
        assert!(matches!(decode_request_head(&head), Err(Error::Protocol(_))));
    }

    #[test]
    fn mapped_and_unmap_round_trip() {
        let mut out = Vec::new();
        encode_mapped(&mut out, 5, 1 << 30, true);
        let head: [u8; REPLY_HEAD] = out[..REPLY_HEAD].try_into().unwrap();
        assert_eq!(decode_reply_head(&head).unwrap(), (5, ReplyKind::Mapped, MAPPED_LEN));
        let body: [u8; MAPPED_LEN] = out[REPLY_HEAD..].try_into().unwrap();
        assert_eq!(decode_mapped(&body).unwrap(), (1 << 30, true));
        out.clear();
        encode_unmap(&mut out, 6, RegionKey(9));
        let head: [u8; REPLY_HEAD] = out[..REPLY_HEAD].try_into().unwrap();
        assert_eq!(decode_reply_head(&head).unwrap(), (6, ReplyKind::Unmap, UNMAP_LEN));
        assert_eq!(out[REPLY_HEAD..], 9u64.to_le_bytes());
    }

    #[test]
    fn replies_carry_the_error() {
        let mut out = Vec::new();
        encode_reply(&mut out, 9, &Err(Error::PermissionDenied("no".into())));
        let head: [u8; REPLY_HEAD] = out[..REPLY_HEAD].try_into().unwrap();
        let (id, kind, len) = decode_reply_head(&head).unwrap();
        assert_eq!(
            (id, kind, len),
            (9, ReplyKind::Done(Some(ErrorCode::PermissionDenied)), 2)
        );
        let ReplyKind::Done(Some(code)) = kind else {
            unreachable!()
        };
        let e = reply_error(code, &out[REPLY_HEAD..]);
        assert!(matches!(&e, Error::PermissionDenied(m) if m.ends_with("no")), "{e:?}");
    }
}
