//! Two-sided messages on the queue pair: notifications and commit requests (initiator to target) and
//! their replies. Their encoding is `ferry_proto::rdma::Message`; this module owns the registered
//! buffers they travel through.
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

use ferry_core::{Error, Result};
pub use ferry_proto::rdma::{MAX_COMMIT_SEGMENTS, MAX_MESSAGE_BYTES, Message};
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
/// Bytes per buffer: the largest message.
pub const BUFFER_BYTES: usize = MAX_MESSAGE_BYTES;

/// Work request ids carry what they are in their top bits.
pub const TAG_MASK: u64 = 0b11 << 62;
/// A one-sided READ or WRITE.
pub const TAG_DATA: u64 = 0;
/// A SEND from a message buffer.
pub const TAG_SEND: u64 = 1 << 62;
/// A RECV into a message buffer.
pub const TAG_RECV: u64 = 2 << 62;

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
