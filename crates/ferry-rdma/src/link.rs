//! The initiator's RDMA data path to one peer: one-sided READ and WRITE on an RC queue pair.
//!
//! A batch becomes work requests: descriptors whose remote ranges follow each other are merged into
//! one request with a scatter-gather list, anything longer than the port's largest message is split,
//! and only the last request of every group of [`SIGNAL_EVERY`] asks for a completion (an RC send queue
//! completes in order, so one completion vouches for the requests before it). The send queue's depth
//! bounds the requests outstanding.
//!
//! Completions arrive through the completion channel's descriptor in tokio's `AsyncFd` (or by busy
//! polling, an option; see the crate's `completions` module). Pending work lives in the link, not in
//! the future that posted it, and each group takes its local regions into use when it is posted, so
//! that their memory stays registered with the NIC until the group's completion arrives.
//!
//! # When a call returns, its buffers are the caller's again
//!
//! A WRITE only reads its local buffers. A READ writes them, so a READ's future that is dropped (its
//! timeout fired, a `select!` chose another branch) while its work requests are outstanding does not
//! just walk away: its drop polls the completion queue on the dropping thread, and if the requests
//! have not finished, moves the queue pair to the error state (the NIC executes none of them further)
//! and polls until each of them has completed or been flushed, at most [`DRAIN_LIMIT`]. Deregistering
//! a region that posted work requests still use does the same to the queue pairs concerned (see
//! `RdmaTransport::deregister_region`). A drop cannot wait for the runtime, which may be the very
//! thread it runs on; stopping the queue pair is what it can do synchronously, within a bound.
//!
//! # A failed queue pair is replaced
//!
//! A queue pair in the error state (stopped as above, or because the target's NIC refused an access:
//! a READ racing the target's deregistration of its source fails with `PermissionDenied`) serves no
//! further request. The link sets up a new one over the control link when it is next used, as long as
//! the control link is up; only requests in flight on the old queue pair fail with it.
//!
//! # Notifications and commit requests
//!
//! Notifications are SENDs on the same queue pair (the crate's `messages` module), answered by the
//! target; no more are unanswered at once than the target has receive buffers and reply buffers.
//!
//! A persistent write is followed by what the link's persistence method asks for (see
//! `crate::persist`): FLUSH work requests, or one READ, in the same stream of work requests, or a
//! commit request. So is a write into a region the target stages (memory its NIC cannot pin: the
//! target's CPU must copy the bytes in) or whose block has access hooks (device-local GPU memory
//! behind a host staging buffer: the target's CPU must copy the bytes to the device,
//! `MemoryBlock::commit_written`). A READ of such a block is preceded by a prepare request, answered
//! once the target copied the ranges from the device (`MemoryBlock::prepare_read`), and only then
//! posted. Local blocks with hooks get the same calls here: `prepare_read` before a WRITE reads them,
//! `commit_written` after a READ filled them. Device memory the NIC reaches by itself (registered at its
//! device address, see `crate::mr`) needs neither, at either end. A WRITE's completion here says only that the target's NIC has
//! the bytes, not that they are in the target's memory, so whatever asks the target's CPU to act on
//! them must be ordered behind their placement. The commit request is therefore a SEND on the same
//! queue pair, posted right after the WRITEs: an RC responder executes requests in order and completes
//! a receive only after the WRITEs before it are placed, so the target's CPU, which acts when the
//! receive completes, finds the bytes in its memory. (A READ on the queue pair after the WRITEs would
//! order the request too, but costs a round trip more, and needs a readable range at the target; a
//! request over the control link is not ordered at all.) The SEND need not wait for the WRITEs'
//! completions either, which saves the round trip a request sent after them would cost.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_core::codec::Segment;
use ferry_core::region::by_region;
use ferry_core::sync::take_all;
use ferry_core::{
    Access, DataLink, Declined, Durability, Error, Notification, Op, PersistMethod, RegionEntry, Result, SetupExchange,
    TransferItem, TransferRequest, TransportKind,
};
use ferry_proto::rdma::{QpEndpoint, RemoteKey};
use ferry_proto::{OpId, OpTable};
use futures::future::BoxFuture;
use rdma_mummy_sys::ibv_sge;
use sideway::ibverbs::completion::WorkCompletionStatus;
use sideway::ibverbs::queue_pair::{PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, WorkRequestFlags};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::task::AbortHandle;

use crate::RdmaShared;
use crate::completions::{self, Completions};
use crate::messages::{
    MAX_COMMIT_SEGMENTS, Message, MessageBuffers, RECV_BUFFERS, SEND_BUFFERS, TAG_DATA, TAG_MASK, TAG_RECV, TAG_SEND,
};
use crate::mr::{InUse, Registered};
use crate::post::{DataWr, post_data};
use crate::qp::Rc;

/// Only every this many work requests asks for a completion.
pub const SIGNAL_EVERY: usize = 16;
/// No single work request moves more than this, whatever the port allows.
const MAX_WR_BYTES: u64 = 1 << 30;

/// How long a caller that must see work requests end (a deregistration, a dropped READ) waits for
/// the completions of a queue pair it moved to the error state. A NIC completes every outstanding
/// work request with a flush error promptly once its queue pair is in that state; this bound only
/// matters for a device that does not.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(2);

struct Pending {
    done: oneshot::Sender<Result<()>>,
    /// Regions the group's requests took into use (permits of their access guards); released when
    /// this completion arrives.
    touched: Vec<InUse>,
    _send_queue: OwnedSemaphorePermit,
}

/// A notification's waiter and its place in the window.
type Unanswered = (oneshot::Sender<Result<()>>, OwnedSemaphorePermit);

pub(crate) struct Inner {
    rc: Rc,
    // After `rc`: the queue pair is destroyed before the buffers it may write go away.
    messages: MessageBuffers,
    /// Notifications (and commit requests) waiting for the target's reply, each with its place in
    /// the window, under the rule every transport answers by (`ferry_proto::ops`).
    notifications: Mutex<OpTable<Unanswered>>,
    /// Notifications unanswered at once: no more than the target has receive buffers and reply buffers.
    notify_window: Arc<Semaphore>,
    shared: Arc<RdmaShared>,
    control: Arc<dyn DataLink>,
    peer: String,
    pending: Mutex<HashMap<u64, Pending>>,
    /// Free places in the send queue: a group waits for as many as it has work requests.
    send_queue: Arc<Semaphore>,
    next_wr: AtomicU64,
    closed: AtomicBool,
    poller: Mutex<Option<AbortHandle>>,
    persist: PersistMethod,
    /// Where the READ of read-after-write lands.
    scratch: Scratch,
}

/// A few registered bytes the READ of read-after-write lands in (nothing reads them).
struct Scratch {
    // Declared (and so dropped) before `memory`: the NIC forgets the buffer before it is freed.
    mr: Arc<sideway::ibverbs::memory_region::MemoryRegion>,
    memory: Box<[u8]>,
}

impl Scratch {
    const LEN: usize = 64;

    fn new(pd: &Arc<sideway::ibverbs::protection_domain::ProtectionDomain>) -> Result<Self> {
        let mut memory = vec![0u8; Self::LEN].into_boxed_slice();
        // SAFETY: `memory` is heap memory owned by the returned value, which drops the registration
        // first (field order), and is only written by the NIC.
        let mr = unsafe {
            pd.reg_mr(
                memory.as_mut_ptr() as usize,
                memory.len(),
                sideway::ibverbs::AccessFlags::LocalWrite,
            )
        }
        .map_err(|e| Error::ResourceExhausted(format!("registering an RDMA scratch buffer: {e}")))?;
        Ok(Scratch { mr, memory })
    }

    fn sge(&self, len: u32) -> ibv_sge {
        ibv_sge {
            addr: self.memory.as_ptr() as u64,
            length: len.min(Self::LEN as u32),
            lkey: self.mr.lkey(),
        }
    }
}

/// A batch as work requests.
struct Plan {
    wrs: Vec<WorkRequest>,
    /// The items whose remote region the target stages (their writes need a commit request).
    bounced_remote: Vec<usize>,
    /// The items whose remote region needs the target's CPU around each access (device memory
    /// behind a staging buffer): a commit request after writes, a prepare request before reads.
    hooked_remote: Vec<usize>,
    /// Whether a local region is reached through a bounce buffer here (the NIC cannot pin its bytes).
    bounced_local: bool,
    /// The items whose local block has hooks that the NIC's access does not bypass (device memory
    /// behind a host copy that this NIC reaches through the copy): `prepare_read` before a WRITE,
    /// `commit_written` after a READ.
    hooked_local: Vec<usize>,
}

/// What a work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WrOp {
    Write,
    Read,
    /// A persistent FLUSH of `len` bytes at the request's remote address.
    Flush {
        len: u64,
    },
}

/// The RDMA data link to one peer.
#[derive(Clone)]
pub struct RdmaLink {
    state: Arc<LinkState>,
}

/// What outlives one queue pair: a link whose queue pair failed (an access the target's NIC refused,
/// a deregistration or an abandoned READ that stopped it) sets up a new one over the control link
/// when it is next used, as long as the control link is up.
struct LinkState {
    current: Mutex<Arc<Inner>>,
    /// One renewal at a time.
    renewing: tokio::sync::Mutex<()>,
    exchange: Option<Arc<dyn SetupExchange>>,
    shared: Arc<RdmaShared>,
    /// The target's rail the queue pairs connect to.
    remote_rail: u8,
    /// Which of this link's queue pairs to the peer it is.
    lane: u8,
    /// How many rails the target has.
    remote_rails: u8,
    control: Arc<dyn DataLink>,
    /// Closed by this side: never renewed.
    closed: AtomicBool,
}

impl LinkState {
    fn current(&self) -> Arc<Inner> {
        match self.current.lock() {
            Ok(c) => c.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// The queue pair to use: the current one, or a new one in place of a failed one.
    async fn usable(&self) -> Result<Arc<Inner>> {
        let inner = self.current();
        if !inner.closed.load(Ordering::Acquire) {
            return Ok(inner);
        }
        let down = || Error::PeerClosed(format!("the link to {} is down; connect again", inner.peer));
        if self.closed.load(Ordering::Acquire) || self.control.is_closed() {
            return Err(down());
        }
        let Some(exchange) = &self.exchange else {
            return Err(down());
        };
        let _one = self.renewing.lock().await;
        let inner = self.current();
        if !inner.closed.load(Ordering::Acquire) {
            return Ok(inner);
        }
        let (fresh, _) = open(
            &self.shared,
            &**exchange,
            self.control.clone(),
            self.remote_rail,
            self.lane,
        )
        .await?;
        tracing::info!(old = %inner.peer, new = %fresh.peer, "RDMA link: a new queue pair replaces the failed one");
        if let Ok(mut c) = self.current.lock() {
            *c = fresh.clone();
        }
        Ok(fresh)
    }
}

/// Sets up a queue pair with the peer's rail `remote_rail` over `exchange` and starts its completion
/// task; returns it and how many rails the peer has.
pub(crate) async fn open(
    shared: &Arc<RdmaShared>,
    exchange: &dyn SetupExchange,
    control: Arc<dyn DataLink>,
    remote_rail: u8,
    lane: u8,
) -> Result<(Arc<Inner>, u8)> {
    // The initiator's queue pair serves no peer where each peer has a domain of its own.
    let mut rc = Rc::create(
        &shared.device,
        &shared.pd,
        &shared.options,
        !shared.options.per_peer_domains,
    )?;
    if rc.flush.is_some() {
        rc.local.flags |= ferry_proto::rdma::CAN_POST_FLUSH;
    }
    rc.local.rail = remote_rail;
    rc.local.lane = lane;
    let messages = MessageBuffers::new(&shared.pd)?;
    let answer = exchange.exchange(TransportKind::Rdma, rc.local.encode()).await?;
    let remote = QpEndpoint::decode(&answer)?;
    if remote.rail != remote_rail {
        return Err(Error::Protocol(format!(
            "the peer connected its rail {} where rail {remote_rail} was asked for",
            remote.rail
        )));
    }
    let method = crate::persist::choose(rc.local.flags, remote.flags, shared.options.persist_method)?;
    rc.connect(&shared.device, &remote, &shared.options)?;
    let peer = format!("RDMA peer (qpn {:#x}, gid {})", remote.qpn, remote.gid);
    tracing::info!(%peer, persist = %method, "RDMA link: persistent writes by {method}");
    Ok((
        Inner::start(rc, messages, shared.clone(), control, peer, method)?,
        remote.rails,
    ))
}

/// One work request: a remote range and the local pieces that fill or receive it.
struct WorkRequest {
    op: WrOp,
    rkey: u32,
    remote_addr: u64,
    sges: Vec<ibv_sge>,
    touched: Vec<Arc<Registered>>,
}

impl RdmaLink {
    /// Sets up the link over the control link's `exchange`, to the peer's rail `remote_rail`, as the
    /// link's queue pair `lane`.
    pub(crate) async fn connect(
        shared: &Arc<RdmaShared>,
        exchange: &dyn SetupExchange,
        remote_rail: u8,
        lane: u8,
    ) -> Result<Self> {
        let control = exchange.control_link();
        let (inner, remote_rails) = open(shared, exchange, control.clone(), remote_rail, lane).await?;
        Ok(RdmaLink {
            state: Arc::new(LinkState {
                current: Mutex::new(inner),
                renewing: tokio::sync::Mutex::new(()),
                exchange: exchange.handle(),
                shared: shared.clone(),
                remote_rail,
                lane,
                remote_rails,
                control,
                closed: AtomicBool::new(false),
            }),
        })
    }

    /// The peer's rail this link reaches.
    pub fn remote_rail(&self) -> u8 {
        self.state.remote_rail
    }

    /// How many rails the peer has.
    pub fn remote_rails(&self) -> u8 {
        self.state.remote_rails
    }

    /// The local device's name and the peer's rail, "rxe0->1".
    pub fn rail_name(&self) -> String {
        format!("{}->{}", self.state.shared.device.name, self.state.remote_rail)
    }

    /// Waits until every WRITE this link completed is placed in the target's memory: a request on
    /// the queue pair that the target answers once it received it, which an RC responder does only
    /// after the WRITEs before it are placed. A notification sent on another rail then cannot
    /// overtake them.
    pub async fn fence(&self) -> Result<()> {
        let inner = self.state.usable().await?;
        let reply = request_reply(&inner, |id| Message::Commit {
            id,
            durability: Durability::Completed,
            segments: Vec::new(),
        })
        .await?;
        answered(&inner, [reply]).await
    }

    /// This side's queue pair address (of the queue pair in use).
    pub fn local_endpoint(&self) -> QpEndpoint {
        self.state.current().rc.local
    }
}

impl Inner {
    /// Wraps a connected queue pair and starts its completion task.
    fn start(
        rc: Rc,
        messages: MessageBuffers,
        shared: Arc<RdmaShared>,
        control: Arc<dyn DataLink>,
        peer: String,
        persist: PersistMethod,
    ) -> Result<Arc<Self>> {
        messages.post_all_recvs(&rc)?;
        let scratch = Scratch::new(&shared.pd)?;
        let send_queue = Arc::new(Semaphore::new(rc.max_send_wr as usize));
        let inner = Arc::new(Inner {
            rc,
            messages,
            notifications: Mutex::new(OpTable::new()),
            notify_window: Arc::new(Semaphore::new(RECV_BUFFERS.min(SEND_BUFFERS))),
            shared,
            control,
            peer,
            pending: Mutex::new(HashMap::new()),
            send_queue,
            next_wr: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            poller: Mutex::new(None),
            persist,
            scratch,
        });
        inner.shared.add_link(&inner);
        let task = tokio::spawn(completions::run(Arc::downgrade(&inner)));
        if let Ok(mut p) = inner.poller.lock() {
            *p = Some(task.abort_handle());
        }
        Ok(inner)
    }
}

impl Inner {
    /// The link is done, and its completion loop too: every waiter gets `error`.
    fn fail_all(&self, error: Error) {
        self.closed.store(true, Ordering::Release);
        for mut p in take_all(&self.pending) {
            drop(std::mem::take(&mut p.touched));
            let _ = p.done.send(Err(error.clone()));
        }
        self.close_link(error);
    }

    /// The queue pair is in error: nothing more is posted, and notifications fail; posted groups wait
    /// for their own (flush) completions.
    fn close_link(&self, error: Error) {
        self.closed.store(true, Ordering::Release);
        let unanswered: Vec<Unanswered> = self
            .notifications
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain()
            .collect();
        for (w, _window) in unanswered {
            let _ = w.send(Err(error.clone()));
        }
        self.notify_window.close();
        self.messages.close();
    }

    fn complete(&self, wr_id: u64, result: Result<()>) {
        let p = self.pending.lock().ok().and_then(|mut m| m.remove(&wr_id));
        if let Some(mut p) = p {
            drop(std::mem::take(&mut p.touched));
            let _ = p.done.send(result);
        }
    }

    /// Turns a batch into work requests, merging remote-contiguous descriptors and splitting long ones,
    /// and notes which regions are reached through bounce buffers. `None` when a region at either end is not registered with
    /// its NIC (the registration was refused there, say): the control link moves such a batch.
    fn plan(&self, op: Op, items: &[TransferItem]) -> Result<Option<Plan>> {
        let wr_op = match op {
            Op::Write => WrOp::Write,
            Op::Read => WrOp::Read,
        };
        let max_msg = self.shared.device.max_msg.clamp(4096, MAX_WR_BYTES);
        let max_sge = self.rc.max_sge as usize;
        let mut wrs: Vec<WorkRequest> = Vec::new();
        let mut bounced_remote = Vec::new();
        let mut hooked_remote = Vec::new();
        let mut bounced_local = false;
        let mut hooked_local = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let Some(key) = item.remote_transport_key.as_deref() else {
                tracing::debug!(peer = %self.peer, addr = item.remote_addr, "no RDMA key advertised for this region; the batch goes over tcp");
                return Ok(None);
            };
            let remote = RemoteKey::decode(key)?;
            let rkey = remote.rkey;
            // A bounced region is reached at its bounce buffer, at the same offset.
            let remote_base = match remote.bounce_addr {
                Some(bounce) => bounce + item.remote_offset,
                None => item.remote_addr,
            };
            let Some(region) = self.shared.registered_if_any(item.local.region.key())? else {
                tracing::debug!(region = ?item.local.region.key(), "local region not registered with the NIC; the batch goes over tcp");
                return Ok(None);
            };
            if remote.is_bounced() {
                bounced_remote.push(i);
            } else if remote.hooked {
                hooked_remote.push(i);
            }
            bounced_local |= region.is_bounced();
            if !region.reaches_device() && item.local.region.block().has_access_hooks() {
                hooked_local.push(i);
            }
            let mut done = 0u64;
            while done < item.len() {
                let n = (item.len() - done).min(max_msg);
                let laddr = item.local.region.ptr_at(item.local.offset + done) as u64;
                let raddr = remote_base + done;
                let sge = ibv_sge {
                    addr: laddr,
                    length: n as u32,
                    lkey: region.lkey(),
                };
                let merged = wrs.last_mut().is_some_and(|w| {
                    let len: u64 = w.sges.iter().map(|s| u64::from(s.length)).sum();
                    let fits = w.rkey == rkey && w.remote_addr + len == raddr && len + n <= max_msg;
                    if fits && w.sges.len() < max_sge {
                        w.sges.push(sge);
                        w.touched.push(region.clone());
                        true
                    } else {
                        false
                    }
                });
                if !merged {
                    wrs.push(WorkRequest {
                        op: wr_op,
                        rkey,
                        remote_addr: raddr,
                        sges: vec![sge],
                        touched: vec![region.clone()],
                    });
                }
                done += n;
            }
        }
        Ok(Some(Plan {
            wrs,
            bounced_remote,
            hooked_remote,
            bounced_local,
            hooked_local,
        }))
    }

    /// Posts one signalled group of work requests and returns the id of its signalled request and its
    /// completion. Over 80 lines: taking the regions into use, recording the group and posting its
    /// data and FLUSH requests happen under one hold of the queue pair's lock, which the SAFETY
    /// arguments below rely on; split up, each part would need the lock passed in and the argument
    /// restated.
    async fn post_group(&self, group: Vec<WorkRequest>) -> Result<(u64, oneshot::Receiver<Result<()>>)> {
        if self.rc.flush.is_none() && group.iter().any(|w| matches!(w.op, WrOp::Flush { .. })) {
            return Err(Error::Unsupported(format!(
                "the RDMA link to {} cannot post FLUSH",
                self.peer
            )));
        }
        let send_queue = self
            .send_queue
            .clone()
            .acquire_many_owned(group.len() as u32)
            .await
            .map_err(|_| Error::PeerClosed(format!("the RDMA link to {} is closed", self.peer)))?;
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::PeerClosed(format!("the RDMA link to {} is closed", self.peer)));
        }
        let first = self.next_wr.fetch_add(group.len() as u64, Ordering::Relaxed);
        let signalled = first + group.len() as u64 - 1;
        let (done, rx) = oneshot::channel();
        let planned: Vec<Arc<Registered>> = group.iter().flat_map(|w| w.touched.iter().cloned()).collect();
        let posted = {
            let mut qp = self
                .rc
                .qp
                .lock()
                .map_err(|_| Error::Internal("queue pair lock poisoned".into()))?;
            // The regions are taken into use under the queue pair's lock: a deregistration that
            // closes one's guard after this point finds the group in the pending table when it takes the
            // lock, and stops the queue pair before it deregisters the memory.
            let touched = take_into_use(&planned, &self.peer)?;
            self.pending
                .lock()
                .map_err(|_| Error::Internal("pending table lock poisoned".into()))?
                .insert(
                    signalled,
                    Pending {
                        done,
                        touched,
                        _send_queue: send_queue,
                    },
                );
            // READs and WRITEs first (they precede any FLUSH in a group), then the FLUSHes.
            let data: Vec<DataWr<'_>> = group
                .iter()
                .enumerate()
                .filter(|(_, wr)| !matches!(wr.op, WrOp::Flush { .. }))
                .map(|(i, wr)| DataWr {
                    id: first + i as u64,
                    read: wr.op == WrOp::Read,
                    signalled: first + i as u64 == signalled,
                    rkey: wr.rkey,
                    remote_addr: wr.remote_addr,
                    sges: &wr.sges,
                })
                .collect();
            // SAFETY: the queue pair is live and its mutex held; every SGE names memory inside a region
            // registered with this NIC (lkey from its registration, or the link's scratch buffer), taken
            // into use above, so that its deregistration stops this queue pair and waits for the
            // group's completion before the NIC forgets the memory (the scratch buffer lives as long as
            // the link).
            let mut posted = unsafe { post_data(qp.qp(), &data) }.map_err(|e| e.to_string());
            let flushes = group
                .iter()
                .enumerate()
                .filter_map(|(i, wr)| match wr.op {
                    WrOp::Flush { len } => Some((first + i as u64, wr, len)),
                    _ => None,
                })
                .collect::<Vec<_>>();
            if let (Ok(()), Some(flush), false) = (&posted, self.rc.flush, flushes.is_empty()) {
                let mut guard = qp.start_post_send();
                for (id, wr, len) in flushes {
                    let flags = if id == signalled {
                        WorkRequestFlags::Signaled
                    } else {
                        WorkRequestFlags::none()
                    };
                    let _ = guard.construct_wr(id, flags);
                    // SAFETY: the queue pair's mutex is held and `construct_wr` just started this work
                    // request on a guard of the queue pair the handle belongs to.
                    unsafe { flush.setup_flush(wr.rkey, wr.remote_addr, len) };
                }
                posted = guard.post().map_err(|e| e.to_string());
            }
            posted
        };
        if let Err(e) = posted {
            let err = Error::Io {
                kind: std::io::ErrorKind::Other,
                message: format!("posting to {}: {e}", self.peer),
            };
            self.complete(signalled, Err(err.clone()));
            return Err(err);
        }
        Ok((signalled, rx))
    }

    /// Moves the queue pair to the error state if `stop` says so, judged under the queue pair's lock
    /// (no group is being posted meanwhile). Nothing is posted on this link afterwards; every
    /// outstanding work request completes with a flush error.
    pub(crate) fn halt_if(&self, stop: impl FnOnce(&Inner) -> bool, why: &str) -> bool {
        let stopping = {
            let Ok(mut qp) = self.rc.qp.lock() else { return false };
            if !stop(self) {
                return false;
            }
            self.closed.store(true, Ordering::Release);
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::Error);
            qp.modify(&attr)
        };
        tracing::info!(peer = %self.peer, why, "RDMA queue pair stopped");
        if let Err(e) = stopping {
            tracing::error!(peer = %self.peer, error = %e, "cannot move the RDMA queue pair to the error state");
        }
        true
    }

    /// Polls this queue pair's completions on the caller's thread until `done` holds or `deadline`
    /// passes; returns whether `done` held.
    pub(crate) fn drain_until(&self, deadline: Instant, done: impl Fn(&Inner) -> bool) -> bool {
        loop {
            completions::drain(self);
            if done(self) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Whether a posted group still uses `region`.
    pub(crate) fn uses(&self, region: &Arc<Registered>) -> bool {
        self.pending
            .lock()
            .map(|p| {
                p.values()
                    .any(|g| g.touched.iter().any(|r| Arc::ptr_eq(r.region(), region)))
            })
            .unwrap_or(false)
    }

    /// Whether any of the groups whose signalled requests are `ids` is still outstanding.
    fn outstanding(&self, ids: &[u64]) -> bool {
        self.pending
            .lock()
            .map(|p| ids.iter().any(|id| p.contains_key(id)))
            .unwrap_or(false)
    }
}

/// Takes every region of a group into use; a region deregistered since the group was planned fails
/// the group (and gives back what was taken).
fn take_into_use(planned: &[Arc<Registered>], peer: &str) -> Result<Vec<InUse>> {
    // On a failure the permits taken so far are released as `collect` drops them.
    planned
        .iter()
        .map(|r| {
            r.take().ok_or_else(|| {
                Error::PermissionDenied(format!(
                    "a local region of this transfer to {peer} was deregistered before its work requests were posted"
                ))
            })
        })
        .collect()
}

/// The work requests a READ posted into its local buffers, while it runs. Dropping it before the READ
/// finished (its future was dropped: a timeout, a `select!`) stops the queue pair and waits, on the
/// dropping thread and at most [`DRAIN_LIMIT`], until none of them can land any more: once the call
/// is gone its buffers are the caller's again.
struct Posted {
    inner: Arc<Inner>,
    ids: Vec<u64>,
}

impl Drop for Posted {
    fn drop(&mut self) {
        if self.ids.is_empty() {
            return;
        }
        let inner = &*self.inner;
        // Perhaps they finished and only the completion loop has not run yet.
        completions::drain(inner);
        let ids = &self.ids;
        if !inner.halt_if(
            |i| i.outstanding(ids),
            "a READ was abandoned with work requests outstanding",
        ) {
            return;
        }
        if !inner.drain_until(Instant::now() + DRAIN_LIMIT, |i| !i.outstanding(ids)) {
            tracing::error!(peer = %inner.peer, "an abandoned READ's work requests did not end within {DRAIN_LIMIT:?}");
        }
    }
}

fn completion_error(status: WorkCompletionStatus, peer: &str) -> Error {
    match status {
        WorkCompletionStatus::RemoteAccessError => Error::PermissionDenied(format!(
            "{peer}'s NIC refused the access (region deregistered or bad key)"
        )),
        WorkCompletionStatus::RetryCounterExceededError
        | WorkCompletionStatus::ResponderNotReadyRetryCounterExceededError => {
            Error::PeerClosed(format!("{peer} stopped answering on the RDMA link"))
        }
        WorkCompletionStatus::WorkRequestFlushedError => Error::PeerClosed(format!("the RDMA link to {peer} failed")),
        other => Error::Io {
            kind: std::io::ErrorKind::Other,
            message: format!("RDMA completion from {peer}: {other:?}"),
        },
    }
}

impl Completions for Inner {
    fn rc(&self) -> &Rc {
        &self.rc
    }

    fn busy_poll(&self) -> bool {
        self.shared.options.busy_poll
    }

    fn completed(&self, wr_id: u64, status: u32, byte_len: u32) {
        let buffer = (wr_id & !TAG_MASK) as usize;
        if status != WorkCompletionStatus::Success as u32 {
            let err = completion_error(WorkCompletionStatus::from(status), &self.peer);
            tracing::warn!(peer = %self.peer, error = %err, "RDMA work request failed; the link is down");
            if wr_id & TAG_MASK == TAG_DATA {
                self.complete(wr_id, Err(err.clone()));
            }
            // An RC queue pair in error completes everything after with a flush error, each group
            // with its own completion (which gives its regions back then, not before): the link is
            // done.
            self.close_link(err);
            return;
        }
        match wr_id & TAG_MASK {
            TAG_DATA => self.complete(wr_id, Ok(())),
            TAG_SEND => self.messages.send_done(buffer),
            TAG_RECV => {
                let reply = self.messages.received(buffer, byte_len as usize);
                if let Err(e) = self.messages.post_recv(&self.rc, buffer) {
                    self.fail_all(e);
                    return;
                }
                match reply {
                    Ok(Message::Reply { id, error }) => {
                        let waiter = self
                            .notifications
                            .lock()
                            .map_err(|_| Error::Internal("notification table lock poisoned".into()))
                            .and_then(|mut n| n.answer(OpId(id), &format_args!("the RDMA target {}", self.peer)));
                        match waiter {
                            Ok(Some((w, _window))) => {
                                let _ = w.send(error.map_or(Ok(()), |e| Err(e.into_error())));
                            }
                            Ok(None) => tracing::debug!(peer = %self.peer, id, "a stale reply"),
                            Err(e) => self.fail_all(e),
                        }
                    }
                    Ok(other) => {
                        self.fail_all(Error::Protocol(format!("{} sent {other:?} to an initiator", self.peer)))
                    }
                    Err(e) => self.fail_all(e),
                }
            }
            _ => self.fail_all(Error::Protocol(format!("a completion with unknown id {wr_id:#x}"))),
        }
    }

    fn failed(&self, error: Error) {
        self.fail_all(error);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self.poller.lock().ok().and_then(|mut p| p.take()) {
            task.abort();
        }
        // The queue pair is destroyed with `rc` right after this: the NIC is done with every region.
        drop(take_all(&self.pending));
    }
}

async fn notify(inner: Arc<Inner>, notification: Notification) -> Result<()> {
    notification.validate()?;
    let reply = request_reply(&inner, |id| Message::Notify { id, notification }).await?;
    answered(&inner, [reply]).await
}

/// Waits for every reply (or work-request completion) in `replies`; the first error wins.
async fn answered(inner: &Inner, replies: impl IntoIterator<Item = oneshot::Receiver<Result<()>>>) -> Result<()> {
    for rx in replies {
        rx.await
            .map_err(|_| Error::PeerClosed(format!("the RDMA link to {} closed", inner.peer)))??;
    }
    Ok(())
}

/// Sends a message the target answers (a notification, a commit request) and returns where its
/// reply will arrive.
async fn request_reply(inner: &Inner, message: impl FnOnce(u64) -> Message) -> Result<oneshot::Receiver<Result<()>>> {
    if inner.closed.load(Ordering::Acquire) {
        return Err(Error::PeerClosed(format!("the RDMA link to {} is closed", inner.peer)));
    }
    // The place in the window is given back when the reply arrives (or the link fails), not when the
    // SEND completes: the target answers from a bounded number of buffers.
    let window = inner
        .notify_window
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| Error::PeerClosed(format!("the RDMA link to {} is closed", inner.peer)))?;
    let (tx, rx) = oneshot::channel();
    let id = inner
        .notifications
        .lock()
        .map_err(|_| Error::Internal("notification table lock poisoned".into()))?
        .insert((tx, window));
    if inner.closed.load(Ordering::Acquire) {
        let _ = inner.notifications.lock().map(|mut n| n.take_back(id));
        return Err(Error::PeerClosed(format!("the RDMA link to {} is closed", inner.peer)));
    }
    if let Err(e) = inner.messages.send(&inner.rc, &message(id.0)).await {
        let _ = inner.notifications.lock().map(|mut n| n.take_back(id));
        return Err(e);
    }
    Ok(rx)
}

/// Sends one request per `MAX_COMMIT_SEGMENTS` of `segments` (a commit or a prepare request, built by
/// `message` from its id and segments) and returns where the answers will arrive.
async fn request_per_chunk(
    inner: &Inner,
    segments: &[Segment],
    message: impl Fn(u64, Vec<Segment>) -> Message,
) -> Result<Vec<oneshot::Receiver<Result<()>>>> {
    let mut replies = Vec::new();
    for chunk in segments.chunks(MAX_COMMIT_SEGMENTS) {
        replies.push(request_reply(inner, |id| message(id, chunk.to_vec())).await?);
    }
    Ok(replies)
}

/// Asks the target to commit `segments` (copy in what its bounce buffers hold; persist them if `durability` says
/// so), by SENDs on the queue pair after the WRITEs that filled them: the target acts only once those
/// are placed in its memory. Returns where the answers will arrive.
async fn request_commit(
    inner: &Inner,
    segments: &[Segment],
    durability: Durability,
) -> Result<Vec<oneshot::Receiver<Result<()>>>> {
    request_per_chunk(inner, segments, |id, segments| Message::Commit {
        id,
        durability,
        segments,
    })
    .await
}

async fn run(inner: Arc<Inner>, request: TransferRequest) -> Result<Declined> {
    if inner.closed.load(Ordering::Acquire) || inner.control.is_closed() {
        return Err(Error::PeerClosed(format!("the link to {} is down", inner.peer)));
    }
    let Some(Plan {
        wrs,
        mut bounced_remote,
        hooked_remote,
        bounced_local,
        hooked_local,
    }) = inner.plan(request.op, &request.items)?
    else {
        // A region at either end that the NIC does not reach: TCP reaches every region.
        return Ok(Declined::items(request.items));
    };
    if bounced_local || (request.op == Op::Read && !bounced_remote.is_empty()) {
        // Memory the NIC reaches only through a bounce buffer (a page-cache file): the bytes that
        // count are in the region itself, which TCP reaches directly.
        return Ok(Declined::items(request.items));
    }
    if request.op == Op::Write {
        // Memory behind a staging buffer (device-local GPU memory) is brought to the host first.
        for (region, ranges) in by_region(hooked_local.iter().map(|&i| &request.items[i].local)) {
            off_runtime(region, move |region| region.prepare_read_ranges(&ranges)).await?;
        }
    }
    if request.op == Op::Read && !hooked_remote.is_empty() {
        // The target copies the ranges from the device into what its NIC reads, and answers before
        // the READs are posted.
        let segments: Vec<Segment> = hooked_remote.iter().map(|&i| segment(&request.items[i])).collect();
        let replies = request_per_chunk(&inner, &segments, |id, segments| Message::Prepare { id, segments }).await?;
        answered(&inner, replies).await?;
    }
    // Written ranges the target's CPU must act on (copy in from its bounce buffer, or to the device).
    bounced_remote.extend(hooked_remote.iter().copied().filter(|_| request.op == Op::Write));
    let Awaiting {
        completions,
        mut posted,
        commits,
    } = post_and_commit(&inner, &request, wrs, bounced_remote).await?;
    answered(&inner, completions.into_iter().chain(commits)).await?;
    posted.ids.clear();
    if request.op == Op::Read {
        request
            .items
            .iter()
            .for_each(|i| ferry_core::integrity::fault::landed(&i.local));
        // Local memory behind a staging buffer (device-local GPU memory) takes the bytes to the device.
        for (region, ranges) in by_region(hooked_local.iter().map(|&i| &request.items[i].local)) {
            off_runtime(region, move |region| {
                region.commit_written_ranges(&ranges, Durability::Completed)
            })
            .await?;
        }
    }
    Ok(Declined::none())
}

/// Where a transfer item lands in the target, as a commit or prepare request names it.
fn segment(item: &TransferItem) -> Segment {
    Segment {
        key: item.remote_key,
        offset: item.remote_offset,
        len: item.len(),
    }
}

/// What a batch waits for once [`post_and_commit`] has sent it.
struct Awaiting {
    /// One completion per posted group.
    completions: Vec<oneshot::Receiver<Result<()>>>,
    /// The READs among them, stopped and drained if the batch is abandoned.
    posted: Posted,
    /// The target's answers to the commit requests.
    commits: Vec<oneshot::Receiver<Result<()>>>,
}

/// Posts a planned batch's work requests (with the persist work its durability asks for) in groups
/// of at most [`SIGNAL_EVERY`], each signalled once, then asks the target for what its CPU must do
/// after them: a commit of the `bounced_remote` items, or a flush of every item.
async fn post_and_commit(
    inner: &Arc<Inner>,
    request: &TransferRequest,
    mut wrs: Vec<WorkRequest>,
    bounced_remote: Vec<usize>,
) -> Result<Awaiting> {
    let persistent = request.op == Op::Write && request.durability == Durability::Persistent;
    let method = if persistent {
        inner.method_for(&request.items)?
    } else {
        None
    };
    inner.add_persist_work(&mut wrs, method);
    let depth = (inner.rc.max_send_wr as usize).max(1);
    let group_len = SIGNAL_EVERY.min(depth);
    let mut completions = Vec::new();
    let mut posted = Posted {
        inner: inner.clone(),
        ids: Vec::new(),
    };
    while !wrs.is_empty() {
        let rest = wrs.split_off(group_len.min(wrs.len()));
        let (id, rx) = inner.post_group(wrs).await?;
        // Only a READ writes local memory; a WRITE's buffers are only read, and its regions stay
        // registered until its completions arrive.
        if request.op == Op::Read {
            posted.ids.push(id);
        }
        completions.push(rx);
        wrs = rest;
    }
    // The commit request follows the WRITEs on the queue pair at once: the target's NIC completes its
    // receive only after their data is placed, so it need not wait for their completions here.
    let commits = if method == Some(PersistMethod::FlushRequest) {
        let segments: Vec<Segment> = request.items.iter().map(segment).collect();
        request_commit(inner, &segments, Durability::Persistent).await?
    } else if !bounced_remote.is_empty() {
        let segments: Vec<Segment> = bounced_remote.into_iter().map(|i| segment(&request.items[i])).collect();
        request_commit(inner, &segments, Durability::Completed).await?
    } else {
        Vec::new()
    };
    Ok(Awaiting {
        completions,
        posted,
        commits,
    })
}

/// Runs a staged block's hooks (GPU copies, which wait for their fence) on `region`: on a blocking
/// thread, under an owned permit of the region's guard held across it. [`Plan::hooked_local`] says
/// which parts need them; the caller groups them by region, so that each region's ranges are one trip
/// to the blocking thread and one batch of device copies (`MemoryBlock::prepare_read_ranges`,
/// `commit_written_ranges`), not one per range.
async fn off_runtime(
    region: Arc<RegionEntry>,
    hooks: impl FnOnce(&RegionEntry) -> Result<()> + Send + 'static,
) -> Result<()> {
    tokio::task::spawn_blocking(region.with_owned_permit(hooks)?)
        .await
        .map_err(|e| Error::Internal(format!("a staged block's copy on a blocking thread panicked: {e}")))?
}

impl Inner {
    /// Adds what `method` needs after the WRITEs of a persistent transfer: a FLUSH per written range,
    /// or one small READ that the NIC answers only after the WRITEs before it are placed.
    fn add_persist_work(&self, wrs: &mut Vec<WorkRequest>, method: Option<PersistMethod>) {
        match method {
            Some(PersistMethod::FlushVerb) => {
                let flushes = flush_requests(wrs);
                wrs.extend(flushes);
            }
            Some(PersistMethod::ReadAfterWrite) => {
                if let Some(last) = wrs.last() {
                    let read_back = WorkRequest {
                        op: WrOp::Read,
                        rkey: last.rkey,
                        remote_addr: last.remote_addr,
                        sges: vec![self.scratch.sge(last.sges.iter().map(|s| s.length).sum::<u32>().min(8))],
                        touched: Vec::new(),
                    };
                    wrs.push(read_back);
                }
            }
            _ => {}
        }
    }

    /// How this persistent transfer is made persistent: the link's method where every remote region
    /// qualifies for it, else the flush request.
    fn method_for(&self, items: &[TransferItem]) -> Result<Option<PersistMethod>> {
        let qualifies = |item: &TransferItem| -> Result<bool> {
            let key = match item.remote_transport_key.as_deref() {
                Some(key) => RemoteKey::decode(key)?,
                None => return Ok(false),
            };
            Ok(match self.persist {
                PersistMethod::FlushVerb => key.flushable,
                // Bounced bytes reach the region only by a commit request.
                PersistMethod::ReadAfterWrite => item.remote_access.contains(Access::READ) && !key.is_bounced(),
                _ => true,
            })
        };
        let mut all = true;
        for item in items {
            all &= qualifies(item)?;
        }
        Ok(Some(if all { self.persist } else { PersistMethod::FlushRequest }))
    }
}

/// One FLUSH per remote stretch the writes covered (writes to adjacent ranges of a region share one).
fn flush_requests(writes: &[WorkRequest]) -> Vec<WorkRequest> {
    let mut flushes: Vec<WorkRequest> = Vec::new();
    for w in writes {
        let len: u64 = w.sges.iter().map(|s| u64::from(s.length)).sum();
        let extended = flushes.last_mut().is_some_and(|f| match &mut f.op {
            WrOp::Flush { len: flen } if f.rkey == w.rkey && f.remote_addr + *flen == w.remote_addr => {
                *flen += len;
                true
            }
            _ => false,
        });
        if !extended {
            flushes.push(WorkRequest {
                op: WrOp::Flush { len },
                rkey: w.rkey,
                remote_addr: w.remote_addr,
                sges: Vec::new(),
                touched: Vec::new(),
            });
        }
    }
    flushes
}

impl DataLink for RdmaLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn transfer(&self, request: TransferRequest) -> BoxFuture<'static, Result<Declined>> {
        let state = self.state.clone();
        Box::pin(async move { run(state.usable().await?, request).await })
    }

    fn notify(&self, notification: Notification) -> BoxFuture<'static, Result<()>> {
        let state = self.state.clone();
        Box::pin(async move { notify(state.usable().await?, notification).await })
    }

    fn fence_writes(&self) -> BoxFuture<'static, Result<()>> {
        let link = self.clone();
        Box::pin(async move { link.fence().await })
    }

    fn route(&self, region: &ferry_core::RegionAd) -> ferry_core::Route {
        crate::route::of(region, &[self.state.remote_rail as usize])
    }

    fn close(&self) -> BoxFuture<'static, ()> {
        let state = self.state.clone();
        Box::pin(async move {
            state.closed.store(true, Ordering::Release);
            let inner = state.current();
            // The NIC executes nothing of this link any more: the regions its work requests used are
            // given back below without waiting for their completions.
            inner.halt_if(|_| true, "the link was closed locally");
            inner.fail_all(Error::PeerClosed(format!(
                "the link to {} was closed locally",
                inner.peer
            )));
            if let Some(task) = inner.poller.lock().ok().and_then(|mut p| p.take()) {
                task.abort();
            }
        })
    }

    fn is_closed(&self) -> bool {
        // A failed queue pair is replaced on next use while the control link is up.
        self.state.closed.load(Ordering::Acquire) || self.state.control.is_closed()
    }

    fn persist_method(&self) -> PersistMethod {
        self.state.current().persist
    }
}
