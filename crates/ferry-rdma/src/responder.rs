//! The target's side of an RDMA link: the NIC serves one-sided READs and WRITEs by itself; this
//! answers the two-sided messages (notifications) that arrive on the queue pair.

use std::sync::Arc;

use ferry_core::{Error, Notifier};
use sideway::ibverbs::completion::WorkCompletionStatus;
use tokio::task::AbortHandle;

use crate::completions::{self, Completions};
use crate::messages::{Message, MessageSlots, TAG_MASK, TAG_RECV, TAG_SEND};
use crate::qp::Rc;

struct Responder {
    rc: Rc,
    // After `rc`: the queue pair is destroyed before the buffers it may write go away.
    slots: MessageSlots,
    notifier: Arc<dyn Notifier>,
    link: u64,
    peer_engine: u64,
    peer_addr: String,
    busy_poll: bool,
}

/// What the link keeps while it lives; dropping it stops the completion task and destroys the queue
/// pair.
pub(crate) struct Accepted {
    _responder: Arc<Responder>,
    task: AbortHandle,
}

impl Drop for Accepted {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts answering messages on a connected queue pair.
pub(crate) fn start(
    rc: Rc,
    slots: MessageSlots,
    notifier: Arc<dyn Notifier>,
    link: u64,
    peer_engine: u64,
    peer_addr: String,
    busy_poll: bool,
) -> Accepted {
    let responder = Arc::new(Responder {
        rc,
        slots,
        notifier,
        link,
        peer_engine,
        peer_addr,
        busy_poll,
    });
    let task = tokio::spawn(completions::run(Arc::downgrade(&responder))).abort_handle();
    Accepted {
        _responder: responder,
        task,
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
        let slot = (wr_id & !TAG_MASK) as usize;
        if status != WorkCompletionStatus::Success as u32 {
            // Flushed receives after the initiator went away: nothing to answer.
            tracing::debug!(peer = %self.peer_addr, status, "RDMA message work request ended");
            return;
        }
        match wr_id & TAG_MASK {
            TAG_SEND => self.slots.send_done(slot),
            TAG_RECV => {
                let message = self.slots.received(slot, byte_len as usize);
                if let Err(e) = self.slots.post_recv(&self.rc, slot) {
                    tracing::warn!(peer = %self.peer_addr, error = %e, "cannot repost an RDMA receive");
                }
                let reply = match message {
                    Ok(Message::Notify { id, notification }) => {
                        let result = notification.validate().and_then(|()| {
                            self.notifier
                                .deliver(self.link, self.peer_engine, &self.peer_addr, notification)
                        });
                        Message::Reply {
                            id,
                            error: result.err().map(|e| (e.code(), e.message().to_string())),
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
                // One reply per notification, and the initiator has at most as many notifications in
                // flight as there are send slots here, so a slot is free.
                if let Err(e) = self.slots.try_send(&self.rc, &reply) {
                    tracing::warn!(peer = %self.peer_addr, error = %e, "cannot answer an RDMA notification");
                }
            }
            _ => {}
        }
    }

    fn failed(&self, error: Error) {
        tracing::warn!(peer = %self.peer_addr, %error, "RDMA responder stopped");
    }
}
