//! Two-sided messages on the queue pair: notifications and commit requests (initiator to target) and
//! their replies.
//!
//! A notification is a SEND on the same RC queue pair as the WRITEs before it, so the target's NIC
//! completes its receive only after that data is in memory: a notification never overtakes the data
//! of transfers that completed before it was sent. The target answers every notification with a
//! SEND carrying its result (HIXL's limits: `ResourceExhausted` past 4096 undrained).
//!
//! A commit request (see `crate::link`) is a SEND for the same reason: it names ranges that WRITEs
//! before it on the queue pair filled, and asks the target's CPU to copy them in from where they were
//! bounced and, for persistent writes, to persist them; the target acts only once the receive
//! completed, so after those WRITEs are placed. At most [`MAX_COMMIT_SEGMENTS`] ranges per message.
//!
//! Both ends keep [`RECV_BUFFERS`] receive buffers posted and [`SEND_BUFFERS`] send buffers, in one memory
//! region registered with the NIC.

use std::sync::{Arc, Mutex};

use ferry_core::codec::Segment;
use ferry_core::error::{io_kind_from_wire, io_kind_to_wire};
use ferry_core::{Durability, Error, ErrorCode, Notification, RegionKey, Result, WireError};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{PostSendGuard, QueuePair, SetScatterGatherEntry, WorkRequestFlags};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::qp::Rc;

/// Receive buffers kept posted on each end.
pub const RECV_BUFFERS: usize = 16;
/// Send buffers on each end (notifications in flight).
pub const SEND_BUFFERS: usize = 16;
/// Bytes per buffer: a notification's two fields of 1024 characters of up to 4 bytes, and a header.
pub const BUFFER_BYTES: usize = (8 << 10) + 64;

/// Work request ids carry what they are in their top bits.
pub const TAG_MASK: u64 = 0b11 << 62;
/// A one-sided READ or WRITE.
pub const TAG_DATA: u64 = 0;
/// A SEND from a message buffer.
pub const TAG_SEND: u64 = 1 << 62;
/// A RECV into a message buffer.
pub const TAG_RECV: u64 = 2 << 62;

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
    /// Writes the message into `out`; fails when it does not fit a buffer.
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
        if out.len() > BUFFER_BYTES {
            return Err(Error::InvalidArgument(format!(
                "a message of {} bytes does not fit a buffer",
                out.len()
            )));
        }
        Ok(())
    }

    /// Parses a received message; anything malformed is a protocol error.
    pub fn decode(b: &[u8]) -> Result<Message> {
        let bad = || Error::Protocol("malformed RDMA message".into());
        let take = |b: &mut &[u8], n: usize| -> Result<Vec<u8>> {
            if b.len() < n {
                return Err(bad());
            }
            let (h, t) = b.split_at(n);
            *b = t;
            Ok(h.to_vec())
        };
        let mut r = b;
        let kind = take(&mut r, 1)?[0];
        let id = u64::from_le_bytes(take(&mut r, 8)?.try_into().map_err(|_| bad())?);
        let string = |r: &mut &[u8]| -> Result<String> {
            let n = u16::from_le_bytes(take(r, 2)?.try_into().map_err(|_| bad())?) as usize;
            String::from_utf8(take(r, n)?).map_err(|_| bad())
        };
        let segments = |r: &mut &[u8]| -> Result<Vec<Segment>> {
            let n = u16::from_le_bytes(take(r, 2)?.try_into().map_err(|_| bad())?) as usize;
            if n > MAX_COMMIT_SEGMENTS {
                return Err(bad());
            }
            let mut segments = Vec::with_capacity(n);
            for _ in 0..n {
                let mut u64_at =
                    || -> Result<u64> { Ok(u64::from_le_bytes(take(r, 8)?.try_into().map_err(|_| bad())?)) };
                let key = RegionKey(u64_at()?);
                let offset = u64_at()?;
                let len = u64_at()?;
                segments.push(Segment { key, offset, len });
            }
            Ok(segments)
        };
        let m = match kind {
            KIND_NOTIFY => {
                let name = string(&mut r)?;
                let msg = string(&mut r)?;
                Message::Notify {
                    id,
                    notification: Notification { name, msg },
                }
            }
            KIND_COMMIT => {
                let durability = match take(&mut r, 1)?[0] {
                    0 => Durability::Completed,
                    1 => Durability::Persistent,
                    _ => return Err(bad()),
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
                let code = u16::from_le_bytes(take(&mut r, 2)?.try_into().map_err(|_| bad())?);
                let io_kind = io_kind_from_wire(take(&mut r, 1)?[0]);
                let message = string(&mut r)?;
                let error = match code {
                    0 => None,
                    c => Some(WireError {
                        code: ErrorCode::from_u16(c).ok_or_else(bad)?,
                        io_kind,
                        message,
                    }),
                };
                Message::Reply { id, error }
            }
            _ => return Err(bad()),
        };
        if !r.is_empty() {
            return Err(bad());
        }
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

/// The message buffers of one queue pair, registered with the NIC.
pub struct MessageBuffers {
    // Declared (and so dropped) before `memory`: the NIC forgets the buffer before it is freed.
    mr: Arc<MemoryRegion>,
    memory: Box<[u8]>,
    free_sends: Mutex<Vec<usize>>,
    send_permits: Arc<Semaphore>,
}

impl MessageBuffers {
    /// Allocates and registers the buffers.
    pub fn new(pd: &Arc<ProtectionDomain>) -> Result<Self> {
        let mut memory = vec![0u8; (RECV_BUFFERS + SEND_BUFFERS) * BUFFER_BYTES].into_boxed_slice();
        // SAFETY: `memory` is owned by the returned value next to its registration, which is dropped
        // first (field order); the heap buffer never moves.
        let mr = unsafe { pd.reg_mr(memory.as_mut_ptr() as usize, memory.len(), AccessFlags::LocalWrite) }
            .map_err(|e| Error::ResourceExhausted(format!("registering RDMA message buffers: {e}")))?;
        Ok(MessageBuffers {
            mr,
            memory,
            free_sends: Mutex::new((0..SEND_BUFFERS).collect()),
            send_permits: Arc::new(Semaphore::new(SEND_BUFFERS)),
        })
    }

    fn buffer_addr(&self, buffer: usize) -> u64 {
        self.memory.as_ptr() as u64 + (buffer * BUFFER_BYTES) as u64
    }

    /// Posts the receive buffer `buffer` (0..RECV_BUFFERS).
    pub fn post_recv(&self, rc: &Rc, buffer: usize) -> Result<()> {
        let mut qp = rc
            .qp
            .lock()
            .map_err(|_| Error::Internal("queue pair lock poisoned".into()))?;
        let mut guard = qp.start_post_recv();
        let wr = guard.construct_wr(TAG_RECV | buffer as u64);
        // SAFETY: the buffer lies inside `memory`, registered with `mr` for local writes, alive as long
        // as `self`, which outlives the queue pair's use of it (the owner drops the queue pair first).
        unsafe { wr.setup_sge(self.mr.lkey(), self.buffer_addr(buffer), BUFFER_BYTES as u32) };
        guard.post().map_err(|e| Error::Io {
            kind: std::io::ErrorKind::Other,
            message: format!("posting a receive: {e}"),
        })
    }

    /// Posts every receive buffer.
    pub fn post_all_recvs(&self, rc: &Rc) -> Result<()> {
        (0..RECV_BUFFERS).try_for_each(|s| self.post_recv(rc, s))
    }

    /// The message that arrived in receive buffer `buffer`, `len` bytes long.
    pub fn received(&self, buffer: usize, len: usize) -> Result<Message> {
        let start = buffer
            .checked_mul(BUFFER_BYTES)
            .filter(|_| buffer < RECV_BUFFERS && len <= BUFFER_BYTES);
        let start = start.ok_or_else(|| Error::Protocol("RDMA receive completion for no buffer".into()))?;
        // SAFETY: the NIC finished writing this buffer (its completion was polled) and it is not reposted
        // until the caller is done with the copy this makes.
        let bytes = unsafe { std::slice::from_raw_parts(self.memory.as_ptr().add(start), len) }.to_vec();
        Message::decode(&bytes)
    }

    /// Sends `message` from a free send buffer; the buffer returns when its completion arrives.
    pub async fn send(&self, rc: &Rc, message: &Message) -> Result<()> {
        let permit = self
            .send_permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Error::PeerClosed("RDMA message buffers closed".into()))?;
        self.send_with(rc, message, permit)
    }

    /// Like [`send`](Self::send), without waiting: `ResourceExhausted` when every buffer is busy.
    pub fn try_send(&self, rc: &Rc, message: &Message) -> Result<()> {
        let permit = self
            .send_permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| Error::ResourceExhausted("every RDMA send buffer is busy".into()))?;
        self.send_with(rc, message, permit)
    }

    fn send_with(&self, rc: &Rc, message: &Message, permit: OwnedSemaphorePermit) -> Result<()> {
        let mut bytes = Vec::with_capacity(256);
        message.encode(&mut bytes)?;
        let buffer = self
            .free_sends
            .lock()
            .ok()
            .and_then(|mut f| f.pop())
            .ok_or_else(|| Error::ResourceExhausted("no free RDMA send buffer".into()))?;
        let index = RECV_BUFFERS + buffer;
        let addr = self.buffer_addr(index);
        // SAFETY: the send buffer is ours until its completion returns it; nothing else writes it.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len()) };
        // The permit is released when the send completes (`send_done`).
        permit.forget();
        let posted = {
            let mut qp = rc
                .qp
                .lock()
                .map_err(|_| Error::Internal("queue pair lock poisoned".into()))?;
            let mut guard = qp.start_post_send();
            let wr = guard
                .construct_wr(TAG_SEND | buffer as u64, WorkRequestFlags::Signaled)
                .setup_send();
            // SAFETY: the buffer is inside `memory`, registered with `mr`, and stays untouched until the
            // send's completion.
            unsafe { wr.setup_sge(self.mr.lkey(), addr, bytes.len() as u32) };
            guard.post()
        };
        posted.map_err(|e| {
            self.send_done(buffer);
            Error::Io {
                kind: std::io::ErrorKind::Other,
                message: format!("posting a message: {e}"),
            }
        })
    }

    /// A send from `buffer` completed: the buffer is free again.
    pub fn send_done(&self, buffer: usize) {
        if buffer < SEND_BUFFERS {
            if let Ok(mut f) = self.free_sends.lock() {
                f.push(buffer);
            }
            self.send_permits.add_permits(1);
        }
    }

    /// Wakes every waiting sender with an error: the link is gone.
    pub fn close(&self) {
        self.send_permits.close();
    }
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
            prop_assert!(b.len() <= BUFFER_BYTES);
            prop_assert_eq!(Message::decode(&b).unwrap(), m);
            let m = Message::Prepare { id, segments };
            m.encode(&mut b).unwrap();
            prop_assert!(b.len() <= BUFFER_BYTES);
            prop_assert_eq!(Message::decode(&b).unwrap(), m);
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Message::decode(&b);
        }
    }

    #[test]
    fn the_largest_notification_fits_a_slot() {
        let n = Notification::new("\u{10348}".repeat(1024), "\u{10348}".repeat(1024));
        let mut b = Vec::new();
        Message::Notify { id: 1, notification: n }.encode(&mut b).unwrap();
        assert!(b.len() <= BUFFER_BYTES);
    }
}
