//! What the two ends of a same-host link exchange, as bytes: the setup over the control link (the
//! initiator's facts and probe, the target's socket and token, and whether the target may copy with
//! cross-memory attach), then requests and replies on the link's Unix socket. And whether two
//! processes' facts allow such a link at all ([`HostFacts::why_not`]).
//!
//! On the socket the initiator sends transfers (ranges for the target to copy), asks for a region's
//! memory file (`Map`), and confirms that it unmapped one (`Unmapped`). The target sends replies,
//! a region's memory file (`Mapped`, the descriptor attached to its bytes), and asks for a mapping
//! back (`Unmap`).
//!
//! Every length is checked before anything is allocated: a request names at most [`MAX_ITEMS`] ranges.

use ferry_core::wire::WireReader;
use ferry_core::{Durability, Error, ErrorCode, Op, RegionKey, Result, WireError};

const VERSION: u8 = 2;
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

/// What a message from the target is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyKind {
    /// The end of a request: done (`None`), or the error's code (its message follows).
    Done(Option<ErrorCode>),
    /// A `Map` request's answer: the region's memory file is attached, its length and access follow.
    Mapped,
    /// The target asks for the mapping of the region whose key follows (the id is the target's own).
    Unmap,
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
