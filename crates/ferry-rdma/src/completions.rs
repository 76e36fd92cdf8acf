//! The completion loop every queue pair runs: wait on the completion channel (tokio's `AsyncFd`) or
//! busy-poll, drain the completion queue, and hand each completion to its owner.
//!
//! [`drain`] may also be called outside the loop, by code that must see certain work requests end
//! before it returns and cannot wait for the loop's task (a deregistration or a dropped transfer on a
//! runtime whose only thread it is running on). The queue pair's poll lock keeps the two from polling
//! the completion queue at once.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Weak};

use ferry_core::Error;
use sideway::ibverbs::completion::{CompletionChannel, CompletionQueue, PollCompletionQueueError};
use tokio::io::unix::AsyncFd;

use crate::qp::Rc;

/// What a completion loop reports to.
pub(crate) trait Completions: Send + Sync + 'static {
    /// The queue pair whose completions these are.
    fn rc(&self) -> &Rc;
    /// Whether to spin instead of sleeping on the channel.
    fn busy_poll(&self) -> bool;
    /// One completion: its work request id, status (`IBV_WC_*`), byte count (receives).
    fn completed(&self, wr_id: u64, status: u32, byte_len: u32);
    /// The loop cannot go on.
    fn failed(&self, error: Error);
}

/// Keeps the completion channel (and so its descriptor) open for as long as tokio watches it.
struct ChannelFd(Arc<CompletionChannel>);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Polls every completion present and hands it to `owner`; returns how many there were.
pub(crate) fn drain<C: Completions + ?Sized>(owner: &C) -> usize {
    let _polling = owner.rc().poll.lock().unwrap_or_else(|p| p.into_inner());
    let mut n = 0;
    loop {
        let poller = match owner.rc().cq.start_poll() {
            Ok(p) => p,
            Err(PollCompletionQueueError::CompletionQueueEmpty) => return n,
            Err(e) => {
                owner.failed(Error::Io {
                    kind: std::io::ErrorKind::Other,
                    message: format!("polling completions: {e}"),
                });
                return n;
            }
        };
        for wc in poller {
            n += 1;
            owner.completed(wc.wr_id(), wc.status(), wc.byte_len());
        }
    }
}

/// Runs until the owner is dropped.
pub(crate) async fn run<C: Completions>(owner: Weak<C>) {
    let Some(strong) = owner.upgrade() else { return };
    let busy = strong.busy_poll();
    // SAFETY: `ChannelFd` owns an `Arc` of the channel, so the descriptor stays open and the same for
    // the whole life of the `AsyncFd`.
    let registered = unsafe {
        AsyncFd::register_with_interest(ChannelFd(strong.rc().channel.clone()), tokio::io::Interest::READABLE)
    };
    let fd = match registered {
        Ok(fd) => fd,
        Err(e) => {
            strong.failed(Error::io("watching the completion channel", e.into_parts().1));
            return;
        }
    };
    drop(strong);
    loop {
        let Some(strong) = owner.upgrade() else { return };
        drain(&*strong);
        if busy {
            drop(strong);
            tokio::task::yield_now().await;
            continue;
        }
        // SAFETY: the CQ is alive (owned through `strong`); arming it has no other precondition.
        unsafe { rdma_mummy_sys::ibv_req_notify_cq(strong.rc().cq.cq().as_ptr(), 0) };
        // A completion between the drain and the arming raised no event: drain once more.
        if drain(&*strong) > 0 {
            continue;
        }
        drop(strong);
        let mut ready = match fd.readable().await {
            Ok(r) => r,
            Err(e) => {
                if let Some(strong) = owner.upgrade() {
                    strong.failed(Error::io("waiting on the completion channel", e));
                }
                return;
            }
        };
        let Some(strong) = owner.upgrade() else { return };
        let mut cq = std::ptr::null_mut();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the channel is alive and non-blocking; an event taken is acknowledged below.
        let got =
            unsafe { rdma_mummy_sys::ibv_get_cq_event(strong.rc().channel.comp_channel().as_ptr(), &mut cq, &mut ctx) };
        if got == 0 {
            // SAFETY: `cq` is the queue the event was for (ours); one event is acknowledged.
            unsafe { rdma_mummy_sys::ibv_ack_cq_events(cq, 1) };
        } else {
            ready.clear_ready();
        }
    }
}
