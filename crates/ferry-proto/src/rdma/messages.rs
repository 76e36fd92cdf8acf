//! The two-sided messages of an RDMA link, as bytes: notifications, commit and prepare requests
//! (initiator to target), and the target's replies.
//!
//! A notification is a SEND on the same RC queue pair as the WRITEs before it, so the target's NIC
//! completes its receive only after that data is in memory: a notification never overtakes the data
//! of transfers that completed before it was sent. A commit request is a SEND for the same reason: it
//! names ranges that WRITEs before it on the queue pair filled. Each message fits one receive buffer
//! of [`MAX_MESSAGE_BYTES`]; a commit or prepare names at most [`MAX_COMMIT_SEGMENTS`] ranges.

use ferry_core::codec::Segment;
use ferry_core::error::{io_kind_from_wire, io_kind_to_wire};
use ferry_core::wire::WireReader;
use ferry_core::{Durability, Error, ErrorCode, Notification, RegionKey, Result, WireError};

/// Bytes a message takes at most: a notification's two fields of 1024 characters of up to 4 bytes,
/// and a header.
pub const MAX_MESSAGE_BYTES: usize = (8 << 10) + 64;

const KIND_NOTIFY: u8 = 1;
const KIND_REPLY: u8 = 2;
const KIND_COMMIT: u8 = 3;
const KIND_PREPARE: u8 = 4;

/// Ranges one commit request names at most (each 24 bytes; the request fits a buffer).
pub const MAX_COMMIT_SEGMENTS: usize = 256;

/// A message, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// A notification for the target's queue.
    Notify { id: u64, notification: Notification },
    /// Ranges written by the WRITEs before it, to commit at the target.
    Commit {
        id: u64,
        durability: Durability,
        segments: Vec<Segment>,
    },
    /// Ranges the READs after it will read, to prepare at the target (copied from the device into
    /// the host copy of a staged block).
    Prepare { id: u64, segments: Vec<Segment> },
    /// The target's answer: its error keeps the variant and, for I/O errors, the kind.
    Reply { id: u64, error: Option<WireError> },
}

impl Message {
    /// Writes the message into `out`; fails when it does not fit a receive buffer.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<()> {
        out.clear();
        let put_str = |out: &mut Vec<u8>, s: &str| -> Result<()> {
            let n = u16::try_from(s.len()).map_err(|_| Error::InvalidArgument("message field too long".into()))?;
            out.extend_from_slice(&n.to_le_bytes());
            out.extend_from_slice(s.as_bytes());
            Ok(())
        };
        match self {
            Message::Notify { id, notification } => {
                out.push(KIND_NOTIFY);
                out.extend_from_slice(&id.to_le_bytes());
                put_str(out, &notification.name)?;
                put_str(out, &notification.msg)?;
            }
            Message::Commit {
                id,
                durability,
                segments,
            } => {
                out.push(KIND_COMMIT);
                out.extend_from_slice(&id.to_le_bytes());
                out.push(match durability {
                    Durability::Completed => 0,
                    Durability::Persistent => 1,
                });
                put_segments(out, segments)?;
            }
            Message::Prepare { id, segments } => {
                out.push(KIND_PREPARE);
                out.extend_from_slice(&id.to_le_bytes());
                put_segments(out, segments)?;
            }
            Message::Reply { id, error } => {
                out.push(KIND_REPLY);
                out.extend_from_slice(&id.to_le_bytes());
                let (code, io_kind, msg) = error.as_ref().map_or((0, 0, ""), |e| {
                    (e.code as u16, io_kind_to_wire(e.io_kind), e.message.as_str())
                });
                out.extend_from_slice(&code.to_le_bytes());
                out.push(io_kind);
                let mut end = msg.len().min(1024);
                while !msg.is_char_boundary(end) {
                    end -= 1;
                }
                put_str(out, &msg[..end])?;
            }
        }
        if out.len() > MAX_MESSAGE_BYTES {
            return Err(Error::InvalidArgument(format!(
                "a message of {} bytes does not fit a receive buffer",
                out.len()
            )));
        }
        Ok(())
    }

    /// Parses a received message; anything malformed is a protocol error.
    pub fn decode(b: &[u8]) -> Result<Message> {
        let mut r = WireReader::new(b, "RDMA message");
        let kind = r.u8()?;
        let id = r.u64()?;
        let segments = |r: &mut WireReader<'_>| -> Result<Vec<Segment>> {
            let n = r.u16()? as usize;
            if n > MAX_COMMIT_SEGMENTS {
                return Err(r.malformed(format_args!("{n} segments, over {MAX_COMMIT_SEGMENTS}")));
            }
            r.check_count(n, 24)?;
            let mut segments = Vec::with_capacity(n);
            for _ in 0..n {
                let key = RegionKey(r.u64()?);
                let offset = r.u64()?;
                let len = r.u64()?;
                segments.push(Segment { key, offset, len });
            }
            Ok(segments)
        };
        let m = match kind {
            KIND_NOTIFY => {
                let name = r.string()?;
                let msg = r.string()?;
                Message::Notify {
                    id,
                    notification: Notification { name, msg },
                }
            }
            KIND_COMMIT => {
                let durability = match r.u8()? {
                    0 => Durability::Completed,
                    1 => Durability::Persistent,
                    d => return Err(r.malformed(format_args!("unknown durability {d}"))),
                };
                let segments = segments(&mut r)?;
                Message::Commit {
                    id,
                    durability,
                    segments,
                }
            }
            KIND_PREPARE => Message::Prepare {
                id,
                segments: segments(&mut r)?,
            },
            KIND_REPLY => {
                let code = r.u16()?;
                let io_kind = io_kind_from_wire(r.u8()?);
                let message = r.string()?;
                let error = match code {
                    0 => None,
                    c => Some(WireError {
                        code: ErrorCode::from_u16(c)
                            .ok_or_else(|| r.malformed(format_args!("unknown error code {c}")))?,
                        io_kind,
                        message,
                    }),
                };
                Message::Reply { id, error }
            }
            other => return Err(r.malformed(format_args!("unknown kind {other}"))),
        };
        r.finish()?;
        Ok(m)
    }
}

/// Writes a count and the segments (key, offset, length: little-endian u64s).
fn put_segments(out: &mut Vec<u8>, segments: &[Segment]) -> Result<()> {
    if segments.len() > MAX_COMMIT_SEGMENTS {
        return Err(Error::InvalidArgument(format!(
            "a request of {} ranges (at most {MAX_COMMIT_SEGMENTS})",
            segments.len()
        )));
    }
    out.extend_from_slice(&(segments.len() as u16).to_le_bytes());
    for s in segments {
        out.extend_from_slice(&s.key.0.to_le_bytes());
        out.extend_from_slice(&s.offset.to_le_bytes());
        out.extend_from_slice(&s.len.to_le_bytes());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn messages_round_trip(id in any::<u64>(), name in ".{0,100}", msg in ".{0,100}", code in 0u16..=12, kind in 0u8..=20) {
            let m = Message::Notify { id, notification: Notification::new(name, msg.clone()) };
            let mut b = Vec::new();
            m.encode(&mut b).unwrap();
            prop_assert_eq!(Message::decode(&b).unwrap(), m);
            let error = ErrorCode::from_u16(code).map(|code| WireError { code, io_kind: io_kind_from_wire(kind), message: msg });
            let r = Message::Reply { id, error };
            r.encode(&mut b).unwrap();
            prop_assert_eq!(Message::decode(&b).unwrap(), r);
        }

        #[test]
        fn commits_round_trip(id in any::<u64>(), persistent in any::<bool>(), segs in proptest::collection::vec(any::<(u64, u64, u64)>(), 0..=MAX_COMMIT_SEGMENTS)) {
            let segments: Vec<Segment> = segs.into_iter().map(|(k, offset, len)| Segment { key: RegionKey(k), offset, len }).collect();
            let durability = if persistent { Durability::Persistent } else { Durability::Completed };
            let m = Message::Commit { id, durability, segments: segments.clone() };
            let mut b = Vec::new();
            m.encode(&mut b).unwrap();
            prop_assert!(b.len() <= MAX_MESSAGE_BYTES);
            prop_assert_eq!(Message::decode(&b).unwrap(), m);
            let m = Message::Prepare { id, segments };
            m.encode(&mut b).unwrap();
            prop_assert!(b.len() <= MAX_MESSAGE_BYTES);
            prop_assert_eq!(Message::decode(&b).unwrap(), m);
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Message::decode(&b);
        }
    }

    #[test]
    fn the_largest_notification_fits_a_message_buffer() {
        let n = Notification::new("\u{10348}".repeat(1024), "\u{10348}".repeat(1024));
        let mut b = Vec::new();
        Message::Notify { id: 1, notification: n }.encode(&mut b).unwrap();
        assert!(b.len() <= MAX_MESSAGE_BYTES);
    }
}
