//! What the two ends exchange: the setup over the control link (the initiator's facts and probe, the
//! target's socket and token), then requests and replies on the link's Unix socket.
//!
//! Every length is checked before anything is allocated: a request names at most [`MAX_ITEMS`] ranges.

use ferry_core::{Durability, Error, ErrorCode, Op, RegionKey, Result, WireError};

use crate::host::{HostFacts, Namespace};

const VERSION: u8 = 1;
/// Ranges one request may name (a batch with more is split by the initiator).
pub const MAX_ITEMS: usize = 4096;
/// Bytes of the initiator's probe buffer.
pub const PROBE_LEN: usize = 32;
/// Bytes of the token the initiator presents on the Unix socket.
pub const TOKEN_LEN: usize = 32;

fn bad(what: &str) -> Error {
    Error::Protocol(format!("shared-memory {what} is malformed"))
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>().ok_or_else(|| bad("message"))?;
        self.0 = rest;
        Ok(*head)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn ns(&mut self) -> Result<Namespace> {
        Ok(Namespace {
            dev: self.u64()?,
            ino: self.u64()?,
        })
    }
    fn end(&self, what: &str) -> Result<()> {
        match self.0.is_empty() {
            true => Ok(()),
            false => Err(bad(what)),
        }
    }
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
        let mut r = Reader(b);
        if r.u8()? != VERSION {
            return Err(Error::Protocol(format!(
                "shared-memory setup is not version {VERSION}: upgrade one of the engines"
            )));
        }
        let facts = HostFacts {
            boot_id: r.take()?,
            pid: r.u32()?,
            uid: r.u32()?,
            pid_ns: r.ns()?,
            user_ns: r.ns()?,
            net_ns: r.ns()?,
        };
        let offer = Offer {
            facts,
            probe_addr: r.u64()?,
            probe: r.take()?,
        };
        r.end("setup")?;
        Ok(offer)
    }
}

/// The target's answer: the abstract Unix socket to connect to, and the token to present there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The socket's abstract name.
    pub socket: [u8; 24],
    /// The one-time token.
    pub token: [u8; TOKEN_LEN],
}

impl Answer {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![VERSION];
        v.extend_from_slice(&self.socket);
        v.extend_from_slice(&self.token);
        v
    }

    /// Parses what `encode` wrote.
    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = Reader(b);
        if r.u8()? != VERSION {
            return Err(bad("setup answer"));
        }
        let answer = Answer {
            socket: r.take()?,
            token: r.take()?,
        };
        r.end("setup answer")?;
        Ok(answer)
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

/// A request's fixed part: id, op, durability, item count.
pub const REQUEST_HEAD: usize = 8 + 1 + 1 + 4;
/// One item's bytes.
pub const ITEM_LEN: usize = 32;

/// Appends a request to `out`.
pub fn encode_request(out: &mut Vec<u8>, id: u64, op: Op, durability: Durability, items: &[Item]) {
    out.extend_from_slice(&id.to_le_bytes());
    out.push(match op {
        Op::Write => 0,
        Op::Read => 1,
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

/// A request's head, parsed: its id, op, durability and how many items follow.
pub fn decode_request_head(b: &[u8; REQUEST_HEAD]) -> Result<(u64, Op, Durability, usize)> {
    let mut r = Reader(b);
    let id = r.u64()?;
    let op = match r.u8()? {
        0 => Op::Write,
        1 => Op::Read,
        _ => return Err(bad("request (op)")),
    };
    let durability = match r.u8()? {
        0 => Durability::Completed,
        1 => Durability::Persistent,
        _ => return Err(bad("request (durability)")),
    };
    let n = r.u32()? as usize;
    if n == 0 || n > MAX_ITEMS {
        return Err(Error::Protocol(format!(
            "a shared-memory request of {n} ranges (1..={MAX_ITEMS})"
        )));
    }
    Ok((id, op, durability, n))
}

/// The items of a request.
pub fn decode_items(b: &[u8]) -> Result<Vec<Item>> {
    if !b.len().is_multiple_of(ITEM_LEN) {
        return Err(bad("request (items)"));
    }
    let mut r = Reader(b);
    let mut items = Vec::with_capacity(b.len() / ITEM_LEN);
    while !r.0.is_empty() {
        items.push(Item {
            key: RegionKey(r.u64()?),
            offset: r.u64()?,
            len: r.u64()?,
            addr: r.u64()?,
        });
    }
    Ok(items)
}

/// A reply's fixed part: id, error code (0 = done), message length.
pub const REPLY_HEAD: usize = 8 + 2 + 2;
/// The longest error message a reply carries (longer ones are cut).
pub const MAX_MESSAGE: usize = 1024;

/// Appends a reply to `out`.
pub fn encode_reply(out: &mut Vec<u8>, id: u64, result: &Result<()>) {
    out.extend_from_slice(&id.to_le_bytes());
    match result {
        Ok(()) => out.extend_from_slice(&[0, 0, 0, 0]),
        Err(e) => {
            let message = e.message();
            let mut cut = message.len().min(MAX_MESSAGE);
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            out.extend_from_slice(&(e.code() as u16).to_le_bytes());
            out.extend_from_slice(&(cut as u16).to_le_bytes());
            out.extend_from_slice(&message.as_bytes()[..cut]);
        }
    }
}

/// A reply's head, parsed: its id, error code (`None`: done) and message length.
pub fn decode_reply_head(b: &[u8; REPLY_HEAD]) -> Result<(u64, Option<ErrorCode>, usize)> {
    let mut r = Reader(b);
    let id = r.u64()?;
    let code = u16::from_le_bytes(r.take()?);
    let len = u16::from_le_bytes(r.take()?) as usize;
    if len > MAX_MESSAGE {
        return Err(bad("reply"));
    }
    match code {
        0 if len == 0 => Ok((id, None, 0)),
        0 => Err(bad("reply")),
        c => Ok((id, Some(ErrorCode::from_u16(c).unwrap_or(ErrorCode::Internal)), len)),
    }
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
            let answer = Answer { socket, token };
            prop_assert_eq!(Answer::decode(&answer.encode()).unwrap(), answer);
        }

        #[test]
        fn requests_round_trip(id in any::<u64>(), raw in proptest::collection::vec(any::<(u64, u64, u64, u64)>(), 1..64), read in any::<bool>()) {
            let items: Vec<Item> = raw.iter().map(|&(k, o, l, a)| Item { key: RegionKey(k), offset: o, len: l, addr: a }).collect();
            let op = if read { Op::Read } else { Op::Write };
            let mut out = Vec::new();
            encode_request(&mut out, id, op, Durability::Persistent, &items);
            let head: [u8; REQUEST_HEAD] = out[..REQUEST_HEAD].try_into().unwrap();
            prop_assert_eq!(decode_request_head(&head).unwrap(), (id, op, Durability::Persistent, items.len()));
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
        encode_request(&mut out, 1, Op::Write, Durability::Completed, &[]);
        out[10..14].copy_from_slice(&(MAX_ITEMS as u32 + 1).to_le_bytes());
        let head: [u8; REQUEST_HEAD] = out[..REQUEST_HEAD].try_into().unwrap();
        assert!(matches!(decode_request_head(&head), Err(Error::Protocol(_))));
    }

    #[test]
    fn replies_carry_the_error() {
        let mut out = Vec::new();
        encode_reply(&mut out, 9, &Err(Error::PermissionDenied("no".into())));
        let head: [u8; REPLY_HEAD] = out[..REPLY_HEAD].try_into().unwrap();
        let (id, code, len) = decode_reply_head(&head).unwrap();
        assert_eq!((id, code, len), (9, Some(ErrorCode::PermissionDenied), 2));
        let e = reply_error(code.unwrap(), &out[REPLY_HEAD..]);
        assert!(matches!(&e, Error::PermissionDenied(m) if m.ends_with("no")), "{e:?}");
    }
}
