//! The wire protocol, as a sans-IO codec.
//!
//! Every frame starts with a fixed 16-byte little-endian header:
//!
//! ```text
//! magic u16 = 0xF5E7 | version u8 | kind u8 | body_len u32 | payload_len u64
//! ```
//!
//! then `body_len` bytes of structured body (the fields of the [`Frame`]), then `payload_len` bytes of raw
//! data for the kinds that carry data (WRITE, WRITE_BATCH, READ_DATA). The codec decodes the header and
//! the body and reports the payload's length: the I/O layer moves the payload itself, straight between
//! the socket and registered memory, after the region table has approved the operation.
//!
//! Decoding never panics and never allocates more than the [`Limits`] allow: lengths are checked against
//! the limits before anything is allocated, and element counts against the bytes actually present.

use bytes::{BufMut, BytesMut};

use crate::error::{Error, ErrorCode, Result, WireError, io_kind_from_wire, io_kind_to_wire};
use crate::types::{Access, DataProtection, Durability, Op, RegionAd, RegionKey, TransportKind};
use crate::wire::WireReader;

/// First two bytes of every frame.
pub const MAGIC: u16 = 0xF5E7;
/// The protocol version this build speaks (2: durability on writes and the `Commit` frame; 3: a
/// status byte ends every read's data, and errors carry their I/O kind; 4: `RegionTable`, the whole
/// table resent when a link's queue of region updates overflowed; 5: the join proof in `Hello`; 6:
/// the stream's data protection in `Hello`; 7: an RDMA key in a region advert starts with its kind;
/// 8: `Sum` and `Sums`, the checksums of a transfer with integrity; a region advert's flags say
/// whether it is staged device memory).
pub const VERSION: u8 = 8;
/// Size of the fixed header.
pub const HEADER_LEN: usize = 16;

/// Bounds the decoder enforces before allocating.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest structured body.
    pub max_body: u32,
    /// Largest payload of one frame.
    pub max_payload: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body: 1 << 20,
            max_payload: 1 << 30,
        }
    }
}

/// The last byte of every [`Frame::ReadData`] payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ReadStatus {
    /// Every byte before it is the region's.
    Intact = 0,
    /// The region was deregistered while its bytes were sent: some of them are zeros.
    RegionGone = 1,
    /// The region's memory lost its backing while it was read (a mapped file shrank): some bytes
    /// are zeros.
    Unbacked = 2,
}

impl ReadStatus {
    /// Its length at the end of the payload.
    pub const LEN: u64 = 1;

    /// Parses the status byte; an unknown value is a protocol error.
    pub fn from_u8(b: u8) -> Result<Self> {
        match b {
            0 => Ok(ReadStatus::Intact),
            1 => Ok(ReadStatus::RegionGone),
            2 => Ok(ReadStatus::Unbacked),
            other => Err(Error::Protocol(format!("unknown read status {other}"))),
        }
    }
}

/// One segment of a batched operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Region key at the target.
    pub key: RegionKey,
    /// Offset inside that region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

const SEGMENT_LEN: usize = 24;

/// The first frame on every stream, from the initiator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The initiator's engine id.
    pub engine_id: u64,
    /// Random token naming the link; later streams of the same link present it to join.
    pub link_token: u64,
    /// This stream's index within the link; 0 is the control stream.
    pub stream_index: u16,
    /// How many streams the link will have.
    pub stream_count: u16,
    /// Transports the initiator can use, best first.
    pub transports: Vec<TransportKind>,
    /// Identifies the initiator's host (same value means same host: shared memory is possible).
    pub host_id: u64,
    /// On a further stream of an authenticated link, the proof that its sender holds the link's
    /// session secret (a MAC over the token and index with a key derived from the control stream's
    /// TLS session); zeros otherwise.
    pub join_proof: [u8; 32],
    /// What protects this stream's bytes after the handshake; covered by the join proof, so that
    /// nobody on the way can lower it.
    pub protection: DataProtection,
}

/// The target's answer to [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloAck {
    /// The target's engine id.
    pub engine_id: u64,
    /// `None` when accepted; the refusal otherwise.
    pub refusal: Option<WireError>,
    /// Transports the target can use, best first.
    pub transports: Vec<TransportKind>,
    /// Identifies the target's host.
    pub host_id: u64,
    /// The target's regions (only on stream 0).
    pub regions: Vec<RegionAd>,
}

/// A decoded frame (header and body; the payload follows on the stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Opens a stream.
    Hello(Hello),
    /// Accepts or refuses a stream.
    HelloAck(HelloAck),
    /// The sender registered a region.
    RegionAdded(RegionAd),
    /// The sender deregistered a region.
    RegionRemoved {
        /// Its key.
        key: RegionKey,
    },
    /// The sender's whole region table, replacing what the receiver knew: sent instead of the
    /// updates that did not fit the link's queue.
    RegionTable {
        /// Every region the sender has registered.
        regions: Vec<RegionAd>,
    },
    /// Write the payload at `key` + `offset`.
    Write {
        /// Operation id, echoed in the [`Frame::Ack`].
        id: u64,
        /// Target region.
        key: RegionKey,
        /// Offset inside it.
        offset: u64,
        /// What the acknowledgement promises.
        durability: Durability,
    },
    /// Write the payload, split into `segments` in order.
    WriteBatch {
        /// Operation id.
        id: u64,
        /// What the acknowledgement promises.
        durability: Durability,
        /// Where each part of the payload goes.
        segments: Vec<Segment>,
    },
    /// Read `len` bytes at `key` + `offset`; answered by [`Frame::ReadData`] or [`Frame::Ack`] with an error.
    Read {
        /// Operation id.
        id: u64,
        /// Source region.
        key: RegionKey,
        /// Offset inside it.
        offset: u64,
        /// Length in bytes.
        len: u64,
    },
    /// Read every segment; answered by one [`Frame::ReadData`] with the concatenation.
    ReadBatch {
        /// Operation id.
        id: u64,
        /// What to read.
        segments: Vec<Segment>,
    },
    /// The data of a read: the payload is the bytes read, then one [`ReadStatus`] byte that says whether
    /// they are the region's. The header goes out before the data, so a region deregistered (or a file
    /// truncated) while the data is sent can only be reported after it.
    ReadData {
        /// The read's id.
        id: u64,
    },
    /// Completion of a write, notification, or failed read.
    Ack {
        /// The operation's id.
        id: u64,
        /// `None` on success.
        error: Option<WireError>,
    },
    /// A notification for the target's queue.
    Notify {
        /// Operation id, acknowledged once queued.
        id: u64,
        /// Name field.
        name: String,
        /// Message field.
        msg: String,
    },
    /// Liveness probe.
    Ping {
        /// Echoed in the pong.
        nonce: u64,
    },
    /// Answer to a ping.
    Pong {
        /// The ping's nonce.
        nonce: u64,
    },
    /// Orderly close of the link.
    Goodbye,
    /// Asks the target to set up another data path (an RDMA queue pair, say) for this link.
    TransportSetup {
        /// Request id, echoed in the reply.
        id: u64,
        /// Which transport.
        kind: TransportKind,
        /// The transport's own setup data (queue pair number, GID…).
        blob: Vec<u8>,
    },
    /// Commit ranges that frames before it on the same stream wrote: for [`Durability::Persistent`],
    /// persist them (the one flush of a persistent TCP transfer spread over several frames). Only
    /// ranges written by frames ahead of it on its stream: a data path that bypasses the target's CPU
    /// (RDMA) orders its commits on its own queue pair instead. Answered by [`Frame::Ack`] once done.
    Commit {
        /// Operation id.
        id: u64,
        /// What the acknowledgement promises.
        durability: Durability,
        /// The written ranges.
        segments: Vec<Segment>,
    },
    /// Asks the target for the CRC32C of each range (as its memory holds them now), to check a
    /// transfer with integrity that `op` just did there: after a write, of what landed; after a read,
    /// of what was read. Sent once the transfer completed, on any stream; answered by
    /// [`Frame::Sums`] on the same stream.
    Sum {
        /// Request id, echoed in the answer.
        id: u64,
        /// The transfer it checks (the target checks the peer's access for it).
        op: Op,
        /// The ranges, in the transfer's order.
        segments: Vec<Segment>,
    },
    /// The answer to [`Frame::Sum`]: one CRC32C per range, in order, or why none.
    Sums {
        /// The request's id.
        id: u64,
        /// `None` when `sums` holds every range's.
        error: Option<WireError>,
        /// The checksums.
        sums: Vec<u32>,
    },
    /// The target's answer to [`Frame::TransportSetup`].
    TransportSetupReply {
        /// The request's id.
        id: u64,
        /// `None` when the data path is ready on the target's side.
        error: Option<WireError>,
        /// The target's setup data.
        blob: Vec<u8>,
    },
}

mod kind {
    pub const HELLO: u8 = 1;
    pub const HELLO_ACK: u8 = 2;
    pub const REGION_ADDED: u8 = 3;
    pub const REGION_REMOVED: u8 = 4;
    pub const WRITE: u8 = 5;
    pub const WRITE_BATCH: u8 = 6;
    pub const READ: u8 = 7;
    pub const READ_BATCH: u8 = 8;
    pub const READ_DATA: u8 = 9;
    pub const ACK: u8 = 10;
    pub const NOTIFY: u8 = 11;
    pub const PING: u8 = 12;
    pub const PONG: u8 = 13;
    pub const GOODBYE: u8 = 14;
    pub const TRANSPORT_SETUP: u8 = 15;
    pub const TRANSPORT_SETUP_REPLY: u8 = 16;
    pub const COMMIT: u8 = 17;
    pub const REGION_TABLE: u8 = 18;
    pub const SUM: u8 = 19;
    pub const SUMS: u8 = 20;

    /// Every kind this version speaks; a test checks that every [`super::Frame`] variant is here.
    pub const ALL: [u8; 20] = [
        HELLO,
        HELLO_ACK,
        REGION_ADDED,
        REGION_REMOVED,
        WRITE,
        WRITE_BATCH,
        READ,
        READ_BATCH,
        READ_DATA,
        ACK,
        NOTIFY,
        PING,
        PONG,
        GOODBYE,
        TRANSPORT_SETUP,
        TRANSPORT_SETUP_REPLY,
        COMMIT,
        REGION_TABLE,
        SUM,
        SUMS,
    ];
}

impl Frame {
    fn kind(&self) -> u8 {
        match self {
            Frame::Hello(_) => kind::HELLO,
            Frame::HelloAck(_) => kind::HELLO_ACK,
            Frame::RegionAdded(_) => kind::REGION_ADDED,
            Frame::RegionRemoved { .. } => kind::REGION_REMOVED,
            Frame::RegionTable { .. } => kind::REGION_TABLE,
            Frame::Write { .. } => kind::WRITE,
            Frame::WriteBatch { .. } => kind::WRITE_BATCH,
            Frame::Read { .. } => kind::READ,
            Frame::ReadBatch { .. } => kind::READ_BATCH,
            Frame::ReadData { .. } => kind::READ_DATA,
            Frame::Ack { .. } => kind::ACK,
            Frame::Notify { .. } => kind::NOTIFY,
            Frame::Ping { .. } => kind::PING,
            Frame::Pong { .. } => kind::PONG,
            Frame::Goodbye => kind::GOODBYE,
            Frame::TransportSetup { .. } => kind::TRANSPORT_SETUP,
            Frame::TransportSetupReply { .. } => kind::TRANSPORT_SETUP_REPLY,
            Frame::Commit { .. } => kind::COMMIT,
            Frame::Sum { .. } => kind::SUM,
            Frame::Sums { .. } => kind::SUMS,
        }
    }

    fn carries_payload(kind: u8) -> bool {
        matches!(kind, kind::WRITE | kind::WRITE_BATCH | kind::READ_DATA)
    }
}

/// A frame with the length of the payload that follows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    /// Header and body.
    pub frame: Frame,
    /// Payload bytes that follow on the stream.
    pub payload_len: u64,
}

/// Appends `frame`'s header and body to `out`; the caller then sends `payload_len` payload bytes.
///
/// Fails only for frames this codec could not decode again: a payload on a kind without one, a body
/// over the limit, a string over 65535 bytes.
pub fn encode(frame: &Frame, payload_len: u64, out: &mut BytesMut) -> Result<()> {
    let kind = frame.kind();
    if payload_len != 0 && !Frame::carries_payload(kind) {
        return Err(Error::InvalidArgument(format!("frame kind {kind} carries no payload")));
    }
    let start = out.len();
    out.reserve(HEADER_LEN + 64);
    out.put_u16_le(MAGIC);
    out.put_u8(VERSION);
    out.put_u8(kind);
    out.put_u32_le(0); // body length, patched below
    out.put_u64_le(payload_len);
    let body_start = out.len();
    match frame {
        Frame::Hello(h) => {
            out.put_u64_le(h.engine_id);
            out.put_u64_le(h.link_token);
            out.put_u16_le(h.stream_index);
            out.put_u16_le(h.stream_count);
            out.put_u64_le(h.host_id);
            put_transports(out, &h.transports)?;
            out.put_slice(&h.join_proof);
            out.put_u8(h.protection.to_wire());
        }
        Frame::HelloAck(a) => {
            out.put_u64_le(a.engine_id);
            put_error(out, &a.refusal)?;
            out.put_u64_le(a.host_id);
            put_transports(out, &a.transports)?;
            put_regions(out, &a.regions)?;
        }
        Frame::RegionAdded(r) => put_region(out, r)?,
        Frame::RegionRemoved { key } => out.put_u64_le(key.0),
        Frame::RegionTable { regions } => put_regions(out, regions)?,
        Frame::Write {
            id,
            key,
            offset,
            durability,
        } => {
            out.put_u64_le(*id);
            out.put_u64_le(key.0);
            out.put_u64_le(*offset);
            out.put_u8(durability_byte(*durability));
        }
        Frame::WriteBatch {
            id,
            durability,
            segments,
        } => {
            out.put_u64_le(*id);
            out.put_u8(durability_byte(*durability));
            put_segments(out, segments)?;
        }
        Frame::Read { id, key, offset, len } => {
            out.put_u64_le(*id);
            out.put_u64_le(key.0);
            out.put_u64_le(*offset);
            out.put_u64_le(*len);
        }
        Frame::ReadBatch { id, segments } => {
            out.put_u64_le(*id);
            put_segments(out, segments)?;
        }
        Frame::Commit {
            id,
            durability,
            segments,
        } => {
            out.put_u64_le(*id);
            out.put_u8(durability_byte(*durability));
            put_segments(out, segments)?;
        }
        Frame::ReadData { id } => out.put_u64_le(*id),
        Frame::Ack { id, error } => {
            out.put_u64_le(*id);
            put_error(out, error)?;
        }
        Frame::Notify { id, name, msg } => {
            out.put_u64_le(*id);
            put_str(out, name)?;
            put_str(out, msg)?;
        }
        Frame::Ping { nonce } | Frame::Pong { nonce } => out.put_u64_le(*nonce),
        Frame::Goodbye => {}
        Frame::TransportSetup { id, kind, blob } => {
            out.put_u64_le(*id);
            out.put_u8(kind.to_u8());
            put_bytes(out, blob)?;
        }
        Frame::TransportSetupReply { id, error, blob } => {
            out.put_u64_le(*id);
            put_error(out, error)?;
            put_bytes(out, blob)?;
        }
        Frame::Sum { id, op, segments } => {
            out.put_u64_le(*id);
            out.put_u8(op_byte(*op));
            put_segments(out, segments)?;
        }
        Frame::Sums { id, error, sums } => {
            out.put_u64_le(*id);
            put_error(out, error)?;
            out.put_u32_le(len_u32(sums.len())?);
            out.reserve(sums.len() * 4);
            for sum in sums {
                out.put_u32_le(*sum);
            }
        }
    }
    let body_len = out.len() - body_start;
    let body_len = u32::try_from(body_len)
        .map_err(|_| Error::InvalidArgument(format!("frame body of {body_len} bytes is too large")))?;
    out[start + 4..start + 8].copy_from_slice(&body_len.to_le_bytes());
    Ok(())
}

/// The fixed header, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: u8,
    /// Body bytes after the header.
    pub body_len: u32,
    /// Payload bytes after the body.
    pub payload_len: u64,
}

/// Decodes and checks the fixed header at the start of `buf`; `Ok(None)` if fewer than
/// [`HEADER_LEN`] bytes are present.
pub fn decode_header(buf: &[u8], limits: &Limits) -> Result<Option<Header>> {
    let Some(h) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let magic = u16::from_le_bytes([h[0], h[1]]);
    if magic != MAGIC {
        return Err(Error::Protocol(format!(
            "bad magic {magic:#06x}: the peer does not speak ferry"
        )));
    }
    if h[2] != VERSION {
        return Err(Error::Protocol(format!(
            "protocol version {} is not supported; this engine speaks version {VERSION}",
            h[2]
        )));
    }
    let kind = h[3];
    if !kind::ALL.contains(&kind) {
        return Err(Error::Protocol(format!("unknown frame kind {kind}")));
    }
    let body_len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    let payload_len = u64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]);
    if body_len > limits.max_body {
        return Err(Error::Protocol(format!(
            "frame body of {body_len} bytes exceeds the limit of {}",
            limits.max_body
        )));
    }
    if payload_len > limits.max_payload {
        return Err(Error::Protocol(format!(
            "frame payload of {payload_len} bytes exceeds the limit of {}",
            limits.max_payload
        )));
    }
    if payload_len != 0 && !Frame::carries_payload(kind) {
        return Err(Error::Protocol(format!("frame kind {kind} may not carry a payload")));
    }
    Ok(Some(Header {
        kind,
        body_len,
        payload_len,
    }))
}

/// Decodes one frame from the start of `buf`.
///
/// Returns `Ok(None)` when more bytes are needed, or the frame and the number of bytes it used (header
/// and body; the payload is not part of `buf`'s consumption).
pub fn decode(buf: &[u8], limits: &Limits) -> Result<Option<(Decoded, usize)>> {
    let Some(header) = decode_header(buf, limits)? else {
        return Ok(None);
    };
    let total = HEADER_LEN + header.body_len as usize;
    let Some(body) = buf.get(HEADER_LEN..total) else {
        return Ok(None);
    };
    let mut r = WireReader::new(body, "frame body");
    let frame = match header.kind {
        kind::HELLO => Frame::Hello(Hello {
            engine_id: r.u64()?,
            link_token: r.u64()?,
            stream_index: r.u16()?,
            stream_count: r.u16()?,
            host_id: r.u64()?,
            transports: r.transports()?,
            join_proof: r.array()?,
            protection: {
                let b = r.u8()?;
                DataProtection::from_wire(b)
                    .ok_or_else(|| Error::Protocol(format!("unknown data protection {b} in a hello")))?
            },
        }),
        kind::HELLO_ACK => {
            let engine_id = r.u64()?;
            let refusal = r.error()?;
            let host_id = r.u64()?;
            let transports = r.transports()?;
            let regions = r.regions()?;
            Frame::HelloAck(HelloAck {
                engine_id,
                refusal,
                transports,
                host_id,
                regions,
            })
        }
        kind::REGION_ADDED => Frame::RegionAdded(r.region()?),
        kind::REGION_REMOVED => Frame::RegionRemoved {
            key: RegionKey(r.u64()?),
        },
        kind::REGION_TABLE => Frame::RegionTable { regions: r.regions()? },
        kind::WRITE => Frame::Write {
            id: r.u64()?,
            key: RegionKey(r.u64()?),
            offset: r.u64()?,
            durability: r.durability()?,
        },
        kind::WRITE_BATCH => {
            let id = r.u64()?;
            let durability = r.durability()?;
            let segments = r.segments()?;
            check_batch_payload(&segments, header.payload_len)?;
            Frame::WriteBatch {
                id,
                durability,
                segments,
            }
        }
        kind::READ => Frame::Read {
            id: r.u64()?,
            key: RegionKey(r.u64()?),
            offset: r.u64()?,
            len: r.u64()?,
        },
        kind::READ_BATCH => Frame::ReadBatch {
            id: r.u64()?,
            segments: r.segments()?,
        },
        kind::COMMIT => Frame::Commit {
            id: r.u64()?,
            durability: r.durability()?,
            segments: r.segments()?,
        },
        kind::READ_DATA => Frame::ReadData { id: r.u64()? },
        kind::ACK => Frame::Ack {
            id: r.u64()?,
            error: r.error()?,
        },
        kind::NOTIFY => Frame::Notify {
            id: r.u64()?,
            name: r.string()?,
            msg: r.string()?,
        },
        kind::PING => Frame::Ping { nonce: r.u64()? },
        kind::PONG => Frame::Pong { nonce: r.u64()? },
        kind::GOODBYE => Frame::Goodbye,
        kind::TRANSPORT_SETUP => {
            let id = r.u64()?;
            let kind = r.u8()?;
            let kind =
                TransportKind::from_u8(kind).ok_or_else(|| Error::Protocol(format!("unknown transport {kind}")))?;
            Frame::TransportSetup {
                id,
                kind,
                blob: r.bytes()?.to_vec(),
            }
        }
        kind::TRANSPORT_SETUP_REPLY => Frame::TransportSetupReply {
            id: r.u64()?,
            error: r.error()?,
            blob: r.bytes()?.to_vec(),
        },
        kind::SUM => Frame::Sum {
            id: r.u64()?,
            op: match r.u8()? {
                0 => Op::Read,
                1 => Op::Write,
                other => return Err(r.malformed(format_args!("unknown operation {other} in a sum request"))),
            },
            segments: r.segments()?,
        },
        kind::SUMS => {
            let id = r.u64()?;
            let error = r.error()?;
            let n = r.count(4)?;
            let sums = (0..n).map(|_| r.u32()).collect::<Result<Vec<_>>>()?;
            Frame::Sums { id, error, sums }
        }
        other => return Err(Error::Protocol(format!("unknown frame kind {other}"))),
    };
    if !r.is_empty() {
        return Err(r.malformed(format_args!("trailing bytes in frame kind {}", header.kind)));
    }
    if matches!(frame, Frame::Write { .. }) && header.payload_len == 0 {
        return Err(Error::Protocol("a write frame must carry a payload".into()));
    }
    Ok(Some((
        Decoded {
            frame,
            payload_len: header.payload_len,
        },
        total,
    )))
}

fn check_batch_payload(segments: &[Segment], payload_len: u64) -> Result<()> {
    let sum = segments.iter().try_fold(0u64, |acc, s| acc.checked_add(s.len));
    if sum != Some(payload_len) {
        return Err(Error::Protocol(format!(
            "batch segments add up to {sum:?} bytes but the payload has {payload_len}"
        )));
    }
    Ok(())
}

/// Smallest encoding of a region advert: key, addr, len, access, persistent, transport-key count.
const MIN_REGION_LEN: usize = 8 + 8 + 8 + 1 + 1 + 1;

fn durability_byte(d: Durability) -> u8 {
    match d {
        Durability::Completed => 0,
        Durability::Persistent => 1,
    }
}

fn len_u32(n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::InvalidArgument(format!("{n} elements do not fit a frame")))
}

fn put_str(out: &mut BytesMut, s: &str) -> Result<()> {
    let n = u16::try_from(s.len())
        .map_err(|_| Error::InvalidArgument(format!("a string of {} bytes does not fit a frame", s.len())))?;
    out.put_u16_le(n);
    out.put_slice(s.as_bytes());
    Ok(())
}

fn op_byte(op: Op) -> u8 {
    match op {
        Op::Read => 0,
        Op::Write => 1,
    }
}

fn put_bytes(out: &mut BytesMut, b: &[u8]) -> Result<()> {
    let n = u16::try_from(b.len())
        .map_err(|_| Error::InvalidArgument(format!("a key of {} bytes does not fit a frame", b.len())))?;
    out.put_u16_le(n);
    out.put_slice(b);
    Ok(())
}

fn put_error(out: &mut BytesMut, e: &Option<WireError>) -> Result<()> {
    match e {
        None => out.put_u16_le(0),
        Some(e) => {
            out.put_u16_le(e.code as u16);
            out.put_u8(io_kind_to_wire(e.io_kind));
            // Messages are for people: cut long ones at a character boundary rather than fail.
            let mut end = e.message.len().min(4096);
            while !e.message.is_char_boundary(end) {
                end -= 1;
            }
            put_str(out, &e.message[..end])?;
        }
    }
    Ok(())
}

fn put_transports(out: &mut BytesMut, t: &[TransportKind]) -> Result<()> {
    let n = u8::try_from(t.len()).map_err(|_| Error::InvalidArgument("too many transports".into()))?;
    out.put_u8(n);
    for k in t {
        out.put_u8(k.to_u8());
    }
    Ok(())
}

fn put_segments(out: &mut BytesMut, segments: &[Segment]) -> Result<()> {
    out.put_u32_le(len_u32(segments.len())?);
    out.reserve(segments.len() * SEGMENT_LEN);
    for s in segments {
        out.put_u64_le(s.key.0);
        out.put_u64_le(s.offset);
        out.put_u64_le(s.len);
    }
    Ok(())
}

/// A region advert's flags byte: writes can be made persistent.
const REGION_PERSISTENT: u8 = 1;
/// A region advert's flags byte: device memory behind a host copy.
const REGION_STAGED: u8 = 2;

fn put_regions(out: &mut BytesMut, regions: &[RegionAd]) -> Result<()> {
    out.put_u32_le(len_u32(regions.len())?);
    for r in regions {
        put_region(out, r)?;
    }
    Ok(())
}

fn put_region(out: &mut BytesMut, r: &RegionAd) -> Result<()> {
    out.put_u64_le(r.key.0);
    out.put_u64_le(r.addr);
    out.put_u64_le(r.len);
    out.put_u8(r.access.bits());
    out.put_u8(u8::from(r.persistent) | if r.staged { REGION_STAGED } else { 0 });
    let n =
        u8::try_from(r.transport_keys.len()).map_err(|_| Error::InvalidArgument("too many transport keys".into()))?;
    out.put_u8(n);
    for (kind, key) in &r.transport_keys {
        out.put_u8(kind.to_u8());
        put_bytes(out, key)?;
    }
    Ok(())
}

/// What the frame codec reads beyond [`WireReader`]'s plain fields.
trait CodecReads {
    fn error(&mut self) -> Result<Option<WireError>>;
    fn durability(&mut self) -> Result<Durability>;
    fn transports(&mut self) -> Result<Vec<TransportKind>>;
    fn segments(&mut self) -> Result<Vec<Segment>>;
    fn regions(&mut self) -> Result<Vec<RegionAd>>;
    fn region(&mut self) -> Result<RegionAd>;
}

impl CodecReads for WireReader<'_> {
    fn error(&mut self) -> Result<Option<WireError>> {
        let code = self.u16()?;
        if code == 0 {
            return Ok(None);
        }
        let code = ErrorCode::from_u16(code).ok_or_else(|| Error::Protocol(format!("unknown error code {code}")))?;
        let io_kind = io_kind_from_wire(self.u8()?);
        Ok(Some(WireError {
            code,
            io_kind,
            message: self.string()?,
        }))
    }
    fn durability(&mut self) -> Result<Durability> {
        match self.u8()? {
            0 => Ok(Durability::Completed),
            1 => Ok(Durability::Persistent),
            d => Err(Error::Protocol(format!("unknown durability {d}"))),
        }
    }
    fn transports(&mut self) -> Result<Vec<TransportKind>> {
        let n = self.u8()? as usize;
        // Unknown kinds come from newer peers: skip them rather than refuse the link.
        Ok(self
            .take(n)?
            .iter()
            .filter_map(|&b| TransportKind::from_u8(b))
            .collect())
    }
    fn segments(&mut self) -> Result<Vec<Segment>> {
        let n = self.count(SEGMENT_LEN)?;
        if n == 0 {
            return Err(Error::Protocol("a batch needs at least one segment".into()));
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let key = RegionKey(self.u64()?);
            let offset = self.u64()?;
            let len = self.u64()?;
            if len == 0 {
                return Err(Error::Protocol("zero-length batch segment".into()));
            }
            v.push(Segment { key, offset, len });
        }
        Ok(v)
    }
    fn regions(&mut self) -> Result<Vec<RegionAd>> {
        let n = self.count(MIN_REGION_LEN)?;
        let mut regions = Vec::with_capacity(n);
        for _ in 0..n {
            regions.push(self.region()?);
        }
        Ok(regions)
    }

    fn region(&mut self) -> Result<RegionAd> {
        let key = RegionKey(self.u64()?);
        let addr = self.u64()?;
        let len = self.u64()?;
        let access = Access::from_bits(self.u8()?)?;
        let flags = self.u8()?;
        if flags & !(REGION_PERSISTENT | REGION_STAGED) != 0 {
            return Err(Error::Protocol(format!("invalid region flags {flags:#x}")));
        }
        let (persistent, staged) = (flags & REGION_PERSISTENT != 0, flags & REGION_STAGED != 0);
        let n = self.u8()? as usize;
        let mut transport_keys = Vec::with_capacity(n);
        for _ in 0..n {
            let kind = self.u8()?;
            let key = crate::TransportKey::from(self.bytes()?);
            if let Some(kind) = TransportKind::from_u8(kind) {
                transport_keys.push((kind, key));
            }
        }
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(Error::Protocol(format!(
                "region advert with invalid range {addr:#x}+{len}"
            )));
        }
        Ok(RegionAd {
            key,
            addr,
            len,
            access,
            persistent,
            staged,
            transport_keys,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_key() -> impl Strategy<Value = RegionKey> {
        any::<u64>().prop_map(RegionKey)
    }

    fn arb_transports() -> impl Strategy<Value = Vec<TransportKind>> {
        proptest::collection::vec(
            prop_oneof![
                Just(TransportKind::Tcp),
                Just(TransportKind::Rdma),
                Just(TransportKind::Shm)
            ],
            0..4,
        )
    }

    fn arb_error() -> impl Strategy<Value = Option<WireError>> {
        proptest::option::of((1u16..=12, 0u8..=20, ".{0,40}").prop_map(|(c, k, message)| WireError {
            code: ErrorCode::from_u16(c).unwrap(),
            io_kind: io_kind_from_wire(k),
            message,
        }))
    }

    fn arb_region() -> impl Strategy<Value = RegionAd> {
        (
            arb_key(),
            0u64..1 << 48,
            1u64..1 << 40,
            1u8..=3,
            (any::<bool>(), any::<bool>()),
            proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..16), 0..2),
        )
            .prop_map(|(key, addr, len, access, (persistent, staged), keys)| RegionAd {
                key,
                addr,
                len,
                access: Access::from_bits(access).unwrap(),
                persistent,
                staged,
                transport_keys: keys.into_iter().map(|k| (TransportKind::Rdma, k.into())).collect(),
            })
    }

    fn arb_segments() -> impl Strategy<Value = Vec<Segment>> {
        proptest::collection::vec(
            (arb_key(), any::<u64>(), 1u64..1 << 20).prop_map(|(key, offset, len)| Segment { key, offset, len }),
            1..20,
        )
    }

    fn arb_durability() -> impl Strategy<Value = Durability> {
        prop_oneof![Just(Durability::Completed), Just(Durability::Persistent)]
    }

    /// Frames with the payload length they must be encoded with.
    fn arb_frame() -> impl Strategy<Value = (Frame, u64)> {
        prop_oneof![
            (
                any::<u64>(),
                any::<u64>(),
                any::<u16>(),
                any::<u16>(),
                arb_transports(),
                any::<u64>(),
                any::<[u8; 32]>(),
                0u8..3,
            )
                .prop_map(
                    |(engine_id, link_token, stream_index, stream_count, transports, host_id, join_proof, p)| (
                        Frame::Hello(Hello {
                            engine_id,
                            link_token,
                            stream_index,
                            stream_count,
                            transports,
                            host_id,
                            join_proof,
                            protection: DataProtection::from_wire(p).unwrap_or_default(),
                        }),
                        0
                    )
                ),
            (
                any::<u64>(),
                arb_error(),
                arb_transports(),
                any::<u64>(),
                proptest::collection::vec(arb_region(), 0..5)
            )
                .prop_map(|(engine_id, refusal, transports, host_id, regions)| (
                    Frame::HelloAck(HelloAck {
                        engine_id,
                        refusal,
                        transports,
                        host_id,
                        regions
                    }),
                    0
                )),
            arb_region().prop_map(|r| (Frame::RegionAdded(r), 0)),
            arb_key().prop_map(|key| (Frame::RegionRemoved { key }, 0)),
            proptest::collection::vec(arb_region(), 0..5).prop_map(|regions| (Frame::RegionTable { regions }, 0)),
            (any::<u64>(), arb_key(), any::<u64>(), arb_durability(), 1u64..1 << 30).prop_map(
                |(id, key, offset, durability, len)| (
                    Frame::Write {
                        id,
                        key,
                        offset,
                        durability
                    },
                    len
                )
            ),
            (any::<u64>(), arb_durability(), arb_segments()).prop_map(|(id, durability, segments)| {
                let len = segments.iter().map(|s| s.len).sum();
                (
                    Frame::WriteBatch {
                        id,
                        durability,
                        segments,
                    },
                    len,
                )
            }),
            (any::<u64>(), arb_key(), any::<u64>(), any::<u64>())
                .prop_map(|(id, key, offset, len)| (Frame::Read { id, key, offset, len }, 0)),
            (any::<u64>(), arb_segments()).prop_map(|(id, segments)| (Frame::ReadBatch { id, segments }, 0)),
            (any::<u64>(), arb_durability(), arb_segments()).prop_map(|(id, durability, segments)| (
                Frame::Commit {
                    id,
                    durability,
                    segments
                },
                0
            )),
            (any::<u64>(), 0u64..1 << 30).prop_map(|(id, len)| (Frame::ReadData { id }, len)),
            (any::<u64>(), arb_error()).prop_map(|(id, error)| (Frame::Ack { id, error }, 0)),
            (any::<u64>(), ".{0,64}", ".{0,64}").prop_map(|(id, name, msg)| (Frame::Notify { id, name, msg }, 0)),
            any::<u64>().prop_map(|nonce| (Frame::Ping { nonce }, 0)),
            any::<u64>().prop_map(|nonce| (Frame::Pong { nonce }, 0)),
            Just((Frame::Goodbye, 0)),
            (
                any::<u64>(),
                arb_transports(),
                proptest::collection::vec(any::<u8>(), 0..64)
            )
                .prop_filter_map("one transport", |(id, kinds, blob)| kinds
                    .first()
                    .map(|&kind| (Frame::TransportSetup { id, kind, blob }, 0))),
            (any::<u64>(), arb_error(), proptest::collection::vec(any::<u8>(), 0..64))
                .prop_map(|(id, error, blob)| (Frame::TransportSetupReply { id, error, blob }, 0)),
            (any::<u64>(), any::<bool>(), arb_segments()).prop_map(|(id, write, segments)| (
                Frame::Sum {
                    id,
                    op: if write { Op::Write } else { Op::Read },
                    segments
                },
                0
            )),
            (
                any::<u64>(),
                arb_error(),
                proptest::collection::vec(any::<u32>(), 0..64)
            )
                .prop_map(|(id, error, sums)| (Frame::Sums { id, error, sums }, 0)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn encode_decode_round_trips((frame, payload_len) in arb_frame()) {
            prop_assert!(kind::ALL.contains(&frame.kind()), "{:?} is missing from kind::ALL", frame);
            let mut buf = BytesMut::new();
            encode(&frame, payload_len, &mut buf).unwrap();
            let limits = Limits::default();
            let (decoded, used) = decode(&buf, &limits).unwrap().unwrap();
            prop_assert_eq!(used, buf.len());
            prop_assert_eq!(decoded.payload_len, payload_len);
            prop_assert_eq!(decoded.frame, frame);
            // Every strict prefix asks for more bytes, never errors or misdecodes.
            for cut in 0..buf.len() {
                prop_assert_eq!(decode(&buf[..cut], &limits).unwrap(), None);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes, &Limits::default());
        }

        #[test]
        fn arbitrary_bodies_behind_a_valid_header_never_panic(
            kind in proptest::sample::select(kind::ALL.to_vec()),
            body in proptest::collection::vec(any::<u8>(), 0..512),
            payload_len in prop_oneof![Just(0u64), any::<u64>(), 0u64..4096],
        ) {
            let mut buf = BytesMut::new();
            buf.put_u16_le(MAGIC);
            buf.put_u8(VERSION);
            buf.put_u8(kind);
            buf.put_u32_le(body.len() as u32);
            buf.put_u64_le(payload_len);
            buf.put_slice(&body);
            match decode(&buf, &Limits::default()) {
                Ok(Some((d, used))) => {
                    prop_assert_eq!(used, buf.len());
                    prop_assert!(d.payload_len <= Limits::default().max_payload);
                }
                Ok(None) => prop_assert!(false, "a complete frame must decode or fail"),
                Err(e) => prop_assert!(matches!(e, Error::Protocol(_))),
            }
        }

        #[test]
        fn large_counts_do_not_allocate(count in any::<u32>()) {
            // A read batch claiming `count` segments with an 8-byte body: refused before allocating.
            let mut buf = BytesMut::new();
            buf.put_u16_le(MAGIC);
            buf.put_u8(VERSION);
            buf.put_u8(kind::READ_BATCH);
            buf.put_u32_le(12);
            buf.put_u64_le(0);
            buf.put_u64_le(7);
            buf.put_u32_le(count);
            let r = decode(&buf, &Limits::default());
            prop_assert!(matches!(r, Err(Error::Protocol(_))));
        }
    }

    /// Every kind in the list decodes something or refuses it with `Protocol`, and kinds outside it
    /// are refused: the fuzz test above draws from the same list, so a new kind is fuzzed by adding it.
    #[test]
    fn kind_list_is_complete_and_unknown_kinds_are_refused() {
        let mut sorted = kind::ALL.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), kind::ALL.len(), "duplicate kind numbers");
        for k in 0..=u8::MAX {
            let mut buf = BytesMut::new();
            buf.put_u16_le(MAGIC);
            buf.put_u8(VERSION);
            buf.put_u8(k);
            buf.put_u32_le(0);
            buf.put_u64_le(0);
            let result = decode(&buf, &Limits::default());
            if !kind::ALL.contains(&k) {
                assert!(matches!(result, Err(Error::Protocol(_))), "kind {k}: {result:?}");
            }
        }
    }

    #[test]
    fn header_limits_and_versions() {
        let limits = Limits {
            max_body: 64,
            max_payload: 1024,
        };
        let mut ok = BytesMut::new();
        encode(&Frame::ReadData { id: 1 }, 1024, &mut ok).unwrap();
        assert!(decode(&ok, &limits).unwrap().is_some());

        let mut big = BytesMut::new();
        encode(&Frame::ReadData { id: 1 }, 1025, &mut big).unwrap();
        assert!(matches!(decode(&big, &limits), Err(Error::Protocol(_))));

        for other in [VERSION - 1, VERSION + 1] {
            let mut wrong = ok.clone();
            wrong[2] = other;
            let err = decode(&wrong, &limits).unwrap_err();
            assert!(err.to_string().contains(&format!("version {other}")), "{err}");
        }

        let mut bad_magic = ok.clone();
        bad_magic[0] ^= 0xff;
        assert!(matches!(decode(&bad_magic, &limits), Err(Error::Protocol(_))));

        let mut payload_on_ping = BytesMut::new();
        encode(&Frame::Ping { nonce: 1 }, 0, &mut payload_on_ping).unwrap();
        payload_on_ping[8] = 1;
        assert!(matches!(decode(&payload_on_ping, &limits), Err(Error::Protocol(_))));
    }

    #[test]
    fn batch_payload_must_match_segments() {
        let mut buf = BytesMut::new();
        let segments = vec![Segment {
            key: RegionKey(1),
            offset: 0,
            len: 10,
        }];
        encode(
            &Frame::WriteBatch {
                id: 1,
                durability: Durability::Completed,
                segments,
            },
            11,
            &mut buf,
        )
        .unwrap();
        assert!(matches!(decode(&buf, &Limits::default()), Err(Error::Protocol(_))));
    }
}
