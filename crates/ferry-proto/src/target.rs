//! The target's side of one stream: which requests it accepts, and the answers it owes.
//!
//! A target serves each stream in order, one request at a time, and answers every request that asks
//! for an answer on the same stream: so an initiator's commit, sent on a stream after the writes it
//! persists, is served after them. The control stream additionally takes data-path setups (they
//! belong to the link, which ends with the control stream). Anything an initiator never sends (a
//! hello after the handshake, an acknowledgement, region updates) ends the stream with
//! `Error::Protocol`: the peer is broken or hostile, and what follows cannot be trusted to be framed.

use ferry_core::codec::{Decoded, Frame, Segment};
use ferry_core::{Durability, Error, Notification, Op, RegionKey, Result, TransportKind, WireError};

use crate::ids::{OpId, StreamIndex};

/// A request, as the target serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Write `payload_len` bytes that follow at `key` + `offset`.
    Write {
        /// Echoed in the answer.
        id: OpId,
        /// Target region.
        key: RegionKey,
        /// Offset inside it.
        offset: u64,
        /// What the answer promises.
        durability: Durability,
        /// Bytes that follow.
        payload_len: u64,
    },
    /// Write the payload that follows, split into `segments` in order.
    WriteBatch {
        /// Echoed in the answer.
        id: OpId,
        /// What the answer promises.
        durability: Durability,
        /// Where each part goes.
        segments: Vec<Segment>,
        /// Bytes that follow (the sum of the segments, checked by the codec).
        payload_len: u64,
    },
    /// Make what earlier frames on this stream wrote to `segments` as durable as asked.
    Commit {
        /// Echoed in the answer.
        id: OpId,
        /// What the answer promises.
        durability: Durability,
        /// The ranges.
        segments: Vec<Segment>,
    },
    /// Send the bytes of `segments`, concatenated.
    Read {
        /// Echoed in the answer.
        id: OpId,
        /// What to read.
        segments: Vec<Segment>,
    },
    /// Queue a notification.
    Notify {
        /// Echoed in the answer.
        id: OpId,
        /// The notification (not yet validated).
        notification: Notification,
    },
    /// Answer with a pong.
    Ping {
        /// Echoed.
        nonce: u64,
    },
    /// Set up another data path for this link (control stream only).
    Setup {
        /// Echoed in the reply.
        id: OpId,
        /// Which transport.
        kind: TransportKind,
        /// The transport's setup data.
        blob: Vec<u8>,
    },
    /// Answer with the CRC32C of each range as memory holds it now, to check a transfer with
    /// integrity that did `op` there (sent once the transfer completed, on any stream).
    Sum {
        /// Echoed in the answer.
        id: OpId,
        /// The transfer it checks: the peer needs the access this operation needs, and read access
        /// besides (a checksum tells something of the bytes).
        op: Op,
        /// The ranges.
        segments: Vec<Segment>,
    },
    /// The initiator closes the link.
    Goodbye,
}

/// The target's view of one stream of a link.
#[derive(Debug, Clone)]
pub struct TargetStream {
    index: StreamIndex,
    peer: String,
}

impl TargetStream {
    /// Stream `index` of a link with `peer`.
    pub fn new(index: StreamIndex, peer: String) -> Self {
        TargetStream { index, peer }
    }

    /// Whether this is the link's control stream.
    pub fn is_control(&self) -> bool {
        self.index.is_control()
    }

    /// What the frame asks for; an error ends the stream.
    pub fn request(&self, decoded: Decoded) -> Result<Request> {
        let payload_len = decoded.payload_len;
        Ok(match decoded.frame {
            Frame::Write {
                id,
                key,
                offset,
                durability,
            } => Request::Write {
                id: OpId(id),
                key,
                offset,
                durability,
                payload_len,
            },
            Frame::WriteBatch {
                id,
                durability,
                segments,
            } => Request::WriteBatch {
                id: OpId(id),
                durability,
                segments,
                payload_len,
            },
            Frame::Commit {
                id,
                durability,
                segments,
            } => Request::Commit {
                id: OpId(id),
                durability,
                segments,
            },
            Frame::Read { id, key, offset, len } => Request::Read {
                id: OpId(id),
                segments: vec![Segment { key, offset, len }],
            },
            Frame::ReadBatch { id, segments } => Request::Read { id: OpId(id), segments },
            // Notifications are the control stream's alone (initiators send them nowhere else): on an
            // authenticated link the data streams are not integrity-protected, and a notification is
            // reported as sent by the link's proven identity.
            Frame::Notify { id, name, msg } if self.is_control() => Request::Notify {
                id: OpId(id),
                notification: Notification { name, msg },
            },
            Frame::Ping { nonce } => Request::Ping { nonce },
            Frame::TransportSetup { id, kind, blob } if self.is_control() => Request::Setup {
                id: OpId(id),
                kind,
                blob,
            },
            Frame::Sum { id, op, segments } => Request::Sum {
                id: OpId(id),
                op,
                segments,
            },
            Frame::Goodbye => Request::Goodbye,
            other => {
                return Err(Error::Protocol(format!(
                    "{} sent {other:?} on {}, which a target does not accept there",
                    self.peer, self.index
                )));
            }
        })
    }
}

/// The acknowledgement of operation `id` with its outcome.
pub fn ack(id: OpId, result: &Result<()>) -> Frame {
    Frame::Ack {
        id: id.0,
        error: result.as_ref().err().map(WireError::from),
    }
}

/// The answer to a data-path setup.
pub fn setup_reply(id: OpId, result: Result<Vec<u8>>) -> Frame {
    match result {
        Ok(blob) => Frame::TransportSetupReply {
            id: id.0,
            error: None,
            blob,
        },
        Err(e) => Frame::TransportSetupReply {
            id: id.0,
            error: Some(WireError::from(&e)),
            blob: Vec::new(),
        },
    }
}

/// The answer to a checksum request.
pub fn sums_reply(id: OpId, result: Result<Vec<u32>>) -> Frame {
    match result {
        Ok(sums) => Frame::Sums {
            id: id.0,
            error: None,
            sums,
        },
        Err(e) => Frame::Sums {
            id: id.0,
            error: Some(WireError::from(&e)),
            sums: Vec::new(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setups_and_notifications_only_on_the_control_stream_and_no_answers_accepted() {
        let setup = || Decoded {
            frame: Frame::TransportSetup {
                id: 1,
                kind: TransportKind::Rdma,
                blob: vec![1],
            },
            payload_len: 0,
        };
        let control = TargetStream::new(StreamIndex(0), "p".into());
        let other = TargetStream::new(StreamIndex(1), "p".into());
        assert!(matches!(control.request(setup()), Ok(Request::Setup { .. })));
        assert!(matches!(other.request(setup()), Err(Error::Protocol(_))));
        let notify = || Decoded {
            frame: Frame::Notify {
                id: 2,
                name: "kv".into(),
                msg: "ready".into(),
            },
            payload_len: 0,
        };
        assert!(matches!(control.request(notify()), Ok(Request::Notify { .. })));
        assert!(matches!(other.request(notify()), Err(Error::Protocol(_))));
        let sum = || Decoded {
            frame: Frame::Sum {
                id: 3,
                op: Op::Write,
                segments: vec![Segment {
                    key: RegionKey(1),
                    offset: 0,
                    len: 8,
                }],
            },
            payload_len: 0,
        };
        assert!(matches!(control.request(sum()), Ok(Request::Sum { op: Op::Write, .. })));
        assert!(matches!(other.request(sum()), Ok(Request::Sum { .. })));
        for frame in [
            Frame::Sums {
                id: 1,
                error: None,
                sums: vec![1],
            },
            Frame::Ack { id: 1, error: None },
            Frame::ReadData { id: 1 },
            Frame::RegionTable { regions: Vec::new() },
            Frame::Pong { nonce: 1 },
        ] {
            assert!(matches!(
                control.request(Decoded { frame, payload_len: 0 }),
                Err(Error::Protocol(_))
            ));
        }
    }
}
