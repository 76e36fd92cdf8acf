//! The target's side of an RDMA link: the NIC serves one-sided READs and WRITEs by itself; this
//! answers the two-sided messages that arrive on the queue pair: notifications, and commit requests
//! (ranges written by the WRITEs before them: copied in from the bounce buffer, persisted if asked),
//! which are carried out inline, before the next message of the link is looked at, unless their work
//! may block (a staged block's device copy, an `msync`): that runs on a blocking thread, under a
//! permit of each region's access guard, and its reply goes out when it is done.
//!
//! Every notification gets exactly one reply. A reply goes out from one of the send buffers; one that
//! finds every buffer busy (their SENDs not yet acknowledged) waits in a queue and leaves as soon as a
//! buffer's completion returns it. The initiator keeps no more notifications unanswered than there are
//! buffers, so the queue stays short; [`MAX_BACKLOG`] bounds it against a peer that does not.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};

use ferry_core::codec::Segment;
use ferry_core::region::for_each_region;
use ferry_core::{Durability, EngineContext, Error, Notifier, Op, PeerView, WireError};
use sideway::ibverbs::completion::WorkCompletionStatus;
use tokio::task::AbortHandle;

use crate::RdmaShared;
use crate::completions::{self, Completions};
use crate::messages::{Message, MessageBuffers, TAG_MASK, TAG_RECV, TAG_SEND};
use crate::qp::Rc;

/// Replies waiting for a free send buffer, at most.
pub(crate) const MAX_BACKLOG: usize = 4096;

pub(crate) struct Responder {
    rc: Rc,
    // After `rc`: the queue pair is destroyed before the buffers it may write go away.
    buffers: MessageBuffers,
    /// Replies that found every send buffer busy, oldest first.
    backlog: Mutex<VecDeque<Message>>,
    notifier: Arc<dyn Notifier>,
    /// The region table commit requests are resolved in.
    context: Weak<EngineContext>,
    /// For the bounce buffers of regions the NIC cannot pin.
    shared: Weak<RdmaShared>,
    link: u64,
    peer_engine: u64,
    peer_addr: String,
    /// What the peer sees of this engine: its identity and the names it knows regions by.
    peer: Arc<PeerView>,
    busy_poll: bool,
    /// This responder, for the commits and prepares that run on a blocking thread.
    me: Weak<Responder>,
}

/// The responders of the links that set up an RDMA path, by link. An initiator sets up a new queue
/// pair when its old one failed (see `crate::link`); the new responder replaces the link's old one,
/// whose queue pair is destroyed then, so a link holds one queue pair however often it renews it.
#[derive(Default)]
pub(crate) struct Responders(Mutex<HashMap<Lane, (Arc<Responder>, AbortHandle)>>);

/// A link and one of its queue pairs (see [`ferry_proto::rdma::QpEndpoint::lane`]).
type Lane = (u64, u8);

impl Responders {
    fn insert(&self, link: Lane, responder: Arc<Responder>, task: AbortHandle) {
        let old = self.0.lock().ok().and_then(|mut m| m.insert(link, (responder, task)));
        if let Some((old, task)) = old {
            tracing::debug!(link = link.0, lane = link.1, peer = %old.peer_addr, "RDMA queue pair replaced by a new one");
            task.abort();
        }
    }

    fn remove(&self, link: Lane, responder: &Weak<Responder>) {
        let removed = self.0.lock().ok().and_then(|mut m| {
            let same = m
                .get(&link)
                .is_some_and(|(r, _)| std::ptr::eq(Arc::as_ptr(r), responder.as_ptr()));
            if same { m.remove(&link) } else { None }
        });
        if let Some((_, task)) = removed {
            task.abort();
        }
    }
}

/// What the link keeps while it lives; dropping it stops the completion task and destroys the queue
/// pair (unless a newer one of the same link replaced it already).
pub(crate) struct Accepted {
    shared: Arc<RdmaShared>,
    link: u64,
    lane: u8,
    responder: Weak<Responder>,
}

impl ferry_core::AcceptedPath for Accepted {
    fn kind(&self) -> ferry_core::TransportKind {
        ferry_core::TransportKind::Rdma
    }

    fn lane(&self) -> u8 {
        self.lane
    }
}

impl Drop for Accepted {
    fn drop(&mut self) {
        self.shared.responders.remove((self.link, self.lane), &self.responder);
    }
}

/// Starts answering messages on a connected queue pair.
#[allow(clippy::too_many_arguments)]
pub(crate) fn start(
    shared: &Arc<RdmaShared>,
    context: Weak<EngineContext>,
    rc: Rc,
    buffers: MessageBuffers,
    notifier: Arc<dyn Notifier>,
    link: u64,
    lane: u8,
    peer_engine: u64,
    peer_addr: String,
    peer: Arc<PeerView>,
    busy_poll: bool,
) -> Accepted {
    let responder = Arc::new_cyclic(|me| Responder {
        rc,
        buffers,
        backlog: Mutex::new(VecDeque::new()),
        notifier,
        context,
        shared: Arc::downgrade(shared),
        link,
        peer_engine,
        peer_addr,
        peer,
        busy_poll,
        me: me.clone(),
    });
    let task = tokio::spawn(completions::run(Arc::downgrade(&responder))).abort_handle();
    let weak = Arc::downgrade(&responder);
    shared.responders.insert((link, lane), responder, task);
    Accepted {
        shared: shared.clone(),
        link,
        lane,
        responder: weak,
    }
}

impl Responder {
    /// Whether the work of a commit or prepare request on `segments` may block (see
    /// `RegionEntry::staging_may_block`). A segment that does not resolve answers no: the request
    /// then fails inline.
    fn may_block(&self, segments: &[Segment], durability: Durability) -> bool {
        let Some(context) = self.context.upgrade() else {
            return false;
        };
        let who = &*self.peer;
        segments.iter().any(|s| {
            context
                .resolve(who, s.key, s.offset, s.len, Op::Read)
                .or_else(|_| context.resolve(who, s.key, s.offset, s.len, Op::Write))
                .is_ok_and(|r| r.region.staging_may_block(durability))
        })
    }

    /// Answers request `id` with `work`'s result: inline, or on a blocking thread when `blocking`. The
    /// work takes a permit of each region it touches on the thread it runs on, for as long as it
    /// touches it.
    fn answer(
        &self,
        id: u64,
        blocking: bool,
        work: impl FnOnce(&Responder) -> ferry_core::Result<()> + Send + 'static,
    ) {
        if !blocking {
            let error = work(self).err().map(|e| WireError::from(&e));
            self.reply(Message::Reply { id, error });
            return;
        }
        let me = self.me.clone();
        tokio::task::spawn_blocking(move || {
            // A responder that is gone has no queue pair to answer on.
            let Some(me) = me.upgrade() else { return };
            let error = work(&me).err().map(|e| WireError::from(&e));
            me.reply(Message::Reply { id, error });
        });
    }

    /// Commits ranges that WRITEs before the request filled: resolved in the region table (write
    /// access, a persistent region for a persistent commit), copied in from the bounce buffer where
    /// the NIC reaches a region through one, then persisted if asked.
    fn commit(&self, segments: &[Segment], durability: Durability) -> ferry_core::Result<()> {
        // Counted from before the grant checks until the work ends, for revokes to wait out.
        let _in_progress = self.peer.accesses().begin();
        let gone = || ferry_core::Error::PeerClosed("the engine is shutting down".into());
        let context = self.context.upgrade().ok_or_else(gone)?;
        let shared = self.shared.upgrade().ok_or_else(gone)?;
        let parts = segments
            .iter()
            .map(|s| context.resolve_write(&self.peer, s.key, s.offset, s.len, durability))
            .collect::<ferry_core::Result<Vec<_>>>()?;
        for_each_region(&parts, |region, ranges| {
            // Whether this host's CPU copied the bytes in from the bounce buffer (or wrote them into
            // the file): then every written page is dirty already, where the NIC's would not be.
            let by_cpu = shared.commit_bounced(region, ranges, durability)?;
            // A staged block (device memory behind a host copy) takes the bytes to the device here,
            // all of this region's ranges as one batch.
            if region.block().has_access_hooks() {
                let _permit = region.guard().enter().ok_or_else(|| region.gone())?;
                region.commit_written_ranges(ranges, Durability::Completed)?;
            }
            if durability == Durability::Persistent {
                region.persist_written(ranges, by_cpu)?;
            }
            Ok(())
        })
    }

    /// Prepares ranges that READs after the request will read (device memory behind a staging buffer
    /// copies them in from the device).
    fn prepare(&self, segments: &[Segment]) -> ferry_core::Result<()> {
        // Counted from before the grant checks until the work ends, for revokes to wait out.
        let _in_progress = self.peer.accesses().begin();
        let context = self
            .context
            .upgrade()
            .ok_or_else(|| ferry_core::Error::PeerClosed("the engine is shutting down".into()))?;
        let parts = segments
            .iter()
            .map(|s| context.resolve(&self.peer, s.key, s.offset, s.len, Op::Read))
            .collect::<ferry_core::Result<Vec<_>>>()?;
        // Each region's ranges as one batch (one device submission for a staged GPU block).
        for_each_region(&parts, |region, ranges| {
            let _permit = region.guard().enter().ok_or_else(|| region.gone())?;
            region.prepare_read_ranges(ranges)
        })
    }

    /// Sends `reply` now, or queues it behind the replies already waiting for a buffer.
    fn reply(&self, reply: Message) {
        let Ok(mut backlog) = self.backlog.lock() else { return };
        if backlog.len() >= MAX_BACKLOG {
            tracing::warn!(peer = %self.peer_addr, "{MAX_BACKLOG} RDMA replies wait for a buffer; one is dropped");
            return;
        }
        backlog.push_back(reply);
        drop(backlog);
        self.send_backlog();
    }

    /// Sends queued replies, oldest first, while send buffers are free.
    fn send_backlog(&self) {
        let Ok(mut backlog) = self.backlog.lock() else { return };
        while let Some(reply) = backlog.front() {
            match self.buffers.try_send(&self.rc, reply) {
                Ok(()) => {
                    backlog.pop_front();
                }
                // Every buffer is busy: the next send completion comes back here.
                Err(ferry_core::Error::ResourceExhausted(_)) => return,
                Err(e) => {
                    tracing::warn!(peer = %self.peer_addr, error = %e, "cannot answer an RDMA notification");
                    backlog.pop_front();
                }
            }
        }
    }
}

impl Completions for Responder {
    fn rc(&self) -> &Rc {
        &self.rc
    }

    fn busy_poll(&self) -> bool {
        self.busy_poll
    }

    fn completed(&self, wr_id: u64, status: u32, byte_len: u32) {
        let buffer = (wr_id & !TAG_MASK) as usize;
        if status != WorkCompletionStatus::Success as u32 {
            // Flushed receives after the initiator went away: nothing to answer.
            tracing::debug!(peer = %self.peer_addr, status, "RDMA message work request ended");
            return;
        }
        match wr_id & TAG_MASK {
            TAG_SEND => {
                self.buffers.send_done(buffer);
                self.send_backlog();
            }
            TAG_RECV => {
                let message = self.buffers.received(buffer, byte_len as usize);
                if let Err(e) = self.buffers.post_recv(&self.rc, buffer) {
                    tracing::warn!(peer = %self.peer_addr, error = %e, "cannot repost an RDMA receive");
                }
                let reply = match message {
                    Ok(Message::Commit {
                        id,
                        durability,
                        segments,
                    }) => {
                        let blocking = self.may_block(&segments, durability);
                        self.answer(id, blocking, move |me| me.commit(&segments, durability));
                        return;
                    }
                    Ok(Message::Prepare { id, segments }) => {
                        let blocking = self.may_block(&segments, Durability::Completed);
                        self.answer(id, blocking, move |me| me.prepare(&segments));
                        return;
                    }
                    Ok(Message::Notify { id, notification }) => {
                        let result = notification.validate().and_then(|()| {
                            self.notifier.deliver(
                                self.link,
                                self.peer_engine,
                                &self.peer_addr,
                                self.peer.identity(),
                                notification,
                            )
                        });
                        Message::Reply {
                            id,
                            error: result.err().map(|e| WireError::from(&e)),
                        }
                    }
                    Ok(other) => {
                        tracing::warn!(peer = %self.peer_addr, message = ?other, "unexpected RDMA message");
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(peer = %self.peer_addr, error = %e, "malformed RDMA message");
                        return;
                    }
                };
                self.reply(reply);
            }
            _ => {}
        }
    }

    fn failed(&self, error: Error) {
        tracing::warn!(peer = %self.peer_addr, %error, "RDMA responder stopped");
    }
}
