//! Asynchronous transfers (HIXL `TransferAsync` and `GetTransferStatus`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use ferry_core::{DataLink, Declined, Durability, Error, Op, Result, TransferRequest};
use futures::future::BoxFuture;
use tokio::task::JoinHandle;

use crate::peer::Peer;
use crate::verify::Check;

/// Where a transfer stands (HIXL `TransferStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferStatus {
    /// Still moving.
    Waiting,
    /// Every descriptor was applied at its destination.
    Completed,
    /// Its timeout passed first.
    Timeout,
    /// It failed; awaiting the handle gives the error.
    Failed,
}

impl TransferStatus {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => TransferStatus::Completed,
            2 => TransferStatus::Timeout,
            3 => TransferStatus::Failed,
            _ => TransferStatus::Waiting,
        }
    }

    pub(crate) fn of(result: &Result<()>) -> u8 {
        match result {
            Ok(()) => 1,
            Err(Error::Timeout(_)) => 2,
            Err(_) => 3,
        }
    }
}

/// A transfer in progress. [`status`](TransferHandle::status) never blocks; awaiting the handle gives the
/// result. Dropping it lets the transfer finish in the background (its memory stays safe either way).
/// Once the status leaves `Waiting` (the handle resolves, or the timeout passed), no byte lands in the
/// transfer's local buffers again.
#[derive(Debug)]
pub struct TransferHandle {
    pub(crate) status: Arc<AtomicU8>,
    pub(crate) task: JoinHandle<Result<()>>,
}

impl TransferHandle {
    /// Runs `transfer` on a task of its own. The link to `peer` (and its place among the engine's
    /// links) is held until the batch ends, as a caller awaiting the transfer holds it.
    pub(crate) fn spawn(transfer: Transfer, peer: Peer) -> Self {
        let status = Arc::new(AtomicU8::new(0));
        let st = status.clone();
        let task = tokio::spawn(async move {
            let result = transfer.await;
            drop(peer);
            st.store(TransferStatus::of(&result), Ordering::Release);
            result
        });
        TransferHandle { status, task }
    }

    /// Where the transfer stands now.
    pub fn status(&self) -> TransferStatus {
        TransferStatus::from_u8(self.status.load(Ordering::Acquire))
    }
}

impl Future for TransferHandle {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.task).poll(cx).map(|joined| {
            joined.unwrap_or_else(|e| Err(Error::Internal(format!("the transfer task ended abnormally: {e}"))))
        })
    }
}

/// How a batch runs: when its writes complete, and how long it may take. Given to
/// [`Engine::start`](crate::Engine::start), the one call every transfer goes through (the others are
/// conveniences over it).
///
/// ```
/// # use std::time::{Duration, Instant};
/// use ferry::{Durability, TransferOptions};
/// let opts = TransferOptions::within(Duration::from_secs(5))
///     .durability(Durability::Persistent)
///     .deadline(Some(Instant::now() + Duration::from_secs(2)));
/// assert_eq!(opts.timeout, Duration::from_secs(5));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransferOptions {
    /// When a write completes: once its bytes are in the target's memory (`Completed`, the default)
    /// or in its persistence domain (`Persistent`, for persistent regions). Reads ignore it only as
    /// `Completed`: a persistent read is refused.
    pub durability: Durability,
    /// The longest the batch may take: it fails with `Timeout` past it (see [`Transfer`] for when it
    /// starts counting).
    pub timeout: Duration,
    /// An instant the batch must also end by, whichever bound comes first; one already passed fails
    /// it at once, with nothing sent. For callers that carry a deadline across calls (retries).
    pub deadline: Option<Instant>,
    /// Whether the batch checks its bytes end to end (see [`EngineBuilder::integrity`](
    /// crate::EngineBuilder::integrity)); `None`: as the engine was built.
    pub integrity: Option<bool>,
}

impl TransferOptions {
    /// A batch that completes as writes land (`Durability::Completed`) and may take `timeout`.
    pub const fn within(timeout: Duration) -> Self {
        TransferOptions {
            durability: Durability::Completed,
            timeout,
            deadline: None,
            integrity: None,
        }
    }

    /// With the bytes checked end to end, or not, whatever the engine's default: the batch completes
    /// `Ok` only if every range's CRC32C at the destination, after it landed, is the source's; else
    /// `Error::Integrity` (retryable), and for a READ nothing is promised about the destination's
    /// bytes.
    pub const fn integrity(mut self, on: bool) -> Self {
        self.integrity = Some(on);
        self
    }

    /// With writes complete at `durability`.
    pub const fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// Ending by `deadline` as well (`None`: the timeout alone).
    pub const fn deadline(mut self, deadline: Option<Instant>) -> Self {
        self.deadline = deadline;
        self
    }
}

/// A resolved batch on its way: the future [`Engine::transfer`](crate::Engine::transfer) awaits, as a
/// type with a name, from [`Engine::start`](crate::Engine::start).
///
/// Code that stores a transfer in a struct of its own (a `tower::Service`'s response future, a
/// hand-written state machine) can hold this one instead of boxing an `async fn`'s future: one
/// allocation and one large move less per batch. It does nothing until polled; dropping it before
/// it completes abandons the batch, with the same guarantees as dropping `transfer`'s future.
///
/// It is the one place a batch is bounded in time, whatever the link: its timeout counts from the
/// first poll that finds the batch unfinished (so that a batch done at once arms no timer; await it
/// soon after making it), and a deadline ([`TransferOptions::deadline`]) ends it at that instant.
/// Past either it completes with `Timeout` and drops the batch at once: the link takes back what the
/// batch still waited for, and no byte lands in its local buffers afterwards.
#[must_use = "a transfer does nothing unless it is awaited"]
pub struct Transfer {
    /// Its links, and its metrics where the engine keeps them.
    peer: Peer,
    /// When it started, where the engine keeps metrics.
    metered: Option<Instant>,
    run: Run,
    descriptors: usize,
    span: tracing::Span,
}

/// What a transfer's polls advance.
struct Run {
    work: Work,
    timeout: Duration,
    /// Armed at the first `Pending`.
    timer: Timer,
    op: Op,
    durability: Durability,
    /// Whether its links check its bytes as they carry them ([`TransferRequest::checked`]).
    checked: bool,
    /// The end-to-end check still to run, for a batch with integrity.
    check: Option<Box<Check>>,
    /// What the metrics, the span and the coop budget ([`charge_copy`]) count.
    bytes: u64,
}

enum Work {
    /// Not started: the first poll offers it to the data link to run inline
    /// ([`DataLink::transfer_now`]), and starts the link's future only if the link does not.
    Unstarted(TransferRequest),
    /// On the data link.
    Started(BoxFuture<'static, Result<Declined>>),
    /// What the data link left to the control link ([`Declined`]), on its way there.
    Declined(BoxFuture<'static, Result<Declined>>),
    /// The end-to-end check of a batch with integrity, once its data moved.
    Checking(BoxFuture<'static, Result<()>>),
    /// Between taking an unstarted request out and starting its future; never seen by a poll.
    Taken,
}

enum Timer {
    /// Armed at the first `Pending`: for the transfer's timeout from then, or until the instant given
    /// (a caller's deadline, already folded with the timeout).
    Unarmed(Option<Instant>),
    /// Boxed: a timer is large, and inline it would grow every transfer's future, the many that
    /// never need it included.
    Armed(Pin<Box<tokio::time::Sleep>>),
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("peer", &self.peer.addr())
            .field("op", &self.run.op)
            .field("descriptors", &self.descriptors)
            .field("timeout", &self.run.timeout)
            .field("integrity", &self.run.check.is_some())
            .finish_non_exhaustive()
    }
}

impl Transfer {
    /// Hands `request`, already resolved and checked, to `peer`'s data link, to be done within
    /// `timeout` and, with a `deadline`, by then. `Timeout` at once, with nothing sent, when the
    /// deadline has already passed.
    ///
    /// The clock is read here only where something needs it (a deadline, or metrics); a transfer
    /// without a deadline reads none for its bound until its first poll finds it unfinished (see
    /// [`Run::poll_bounded`]).
    pub(crate) fn new(
        peer: &Peer,
        mut request: TransferRequest,
        timeout: Duration,
        deadline: Option<Instant>,
        integrity: bool,
    ) -> Result<Self> {
        let data = &peer.inner.data;
        // A batch over links that check as they carry (TCP's, the control link's too, which takes
        // what the data link declines) is checked there, frame by frame, while its bytes are in
        // cache at both ends; everything else by a second pass once its data moved. So is a read
        // into memory staged in front of a device, whose sum must be of the device's bytes, after
        // its copy there.
        let staged_destination = |request: &TransferRequest| {
            request.op == Op::Read && request.items.iter().any(|i| i.local.region.block().has_access_hooks())
        };
        request.checked =
            integrity && data.checks_in_band() && peer.inner.control.checks_in_band() && !staged_destination(&request);
        let check = (integrity && !request.checked)
            .then(|| Check::of(&request))
            .transpose()?;
        let (op, durability, descriptors) = (request.op, request.durability, request.items.len());
        let checked = request.checked;
        let metered = peer.inner.metrics.is_some();
        let now = (deadline.is_some() || metered).then(Instant::now);
        // With a deadline the timer ends at the instant both bounds make; without, it counts the
        // timeout from the first `Pending`.
        let (until, timeout) = match (now, deadline) {
            (Some(now), Some(deadline)) => {
                let at = end(now, timeout, deadline).ok_or_else(|| {
                    Error::Timeout(format!(
                        "a batch of {descriptors} descriptors to {}: its deadline passed before it started; \
                         nothing was sent",
                        peer.addr()
                    ))
                })?;
                (Some(at), at.saturating_duration_since(now))
            }
            _ => (None, timeout),
        };
        let span = tracing::debug_span!(
            "transfer",
            op = ?op,
            peer = %peer.addr(),
            transport = %peer.transport(),
            descriptors,
            bytes = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let bytes = request.items.iter().map(|i| i.len()).sum();
        span.record("bytes", bytes);
        Ok(Transfer {
            peer: peer.clone(),
            metered: now.filter(|_| metered),
            run: Run {
                work: Work::Unstarted(request),
                timeout,
                timer: Timer::Unarmed(until),
                op,
                durability,
                checked,
                check,
                bytes,
            },
            descriptors,
            span,
        })
    }
}

/// When a batch started at `now` with `timeout` must end, given its caller's `deadline`: whichever
/// comes first (the deadline, when `now + timeout` is past what an instant holds). `None` when the
/// deadline is not after `now`: the batch may not start.
fn end(now: Instant, timeout: Duration, deadline: Instant) -> Option<Instant> {
    if deadline <= now {
        return None;
    }
    Some(now.checked_add(timeout).map_or(deadline, |at| at.min(deadline)))
}

/// Bytes a transfer may move on the caller's thread per unit of the task's coop budget. tokio counts
/// a unit per operation, meant to be microseconds of work; a same-host copy of 64 MiB takes
/// milliseconds, and a loop of them would hold its worker for a whole budget of 128 such copies
/// (8 GiB, a fifth of a second at 40 GB/s) before other tasks there ran. Charged per MiB, such a loop
/// yields after at most about 128 MiB copied (a few milliseconds), while a transfer of up to 2 MiB
/// still takes one unit, as any other operation does.
const BYTES_PER_BUDGET_UNIT: u64 = 1 << 20;

/// tokio's budget for one poll of a task: no transfer needs to be charged more.
const MOST_BUDGET_UNITS: u64 = 128;

/// Takes from the task's coop budget what a transfer of `bytes` that this thread moved in this poll
/// costs beyond the one unit the poll took ([`BYTES_PER_BUDGET_UNIT`]), or what is left of the budget:
/// once it is spent, the task's next operation yields.
fn charge_copy(cx: &mut Context<'_>, bytes: u64) {
    for _ in 1..(bytes / BYTES_PER_BUDGET_UNIT).min(MOST_BUDGET_UNITS) {
        // Checked first: `poll_proceed` on a spent budget would wake the task, which is not waiting.
        if !tokio::task::coop::has_budget_remaining() {
            return;
        }
        match tokio::task::coop::poll_proceed(cx) {
            Poll::Ready(unit) => unit.made_progress(),
            Poll::Pending => return,
        }
    }
}

/// Polls `work`, arming `timer` at its first `Pending`; `Err(None)` when the timer ran out first.
///
/// A batch that finishes on its first poll (a shared-memory copy, a batch refused at once) never
/// starts a timer: arming and cancelling one costs a clock read, a clone of the runtime's handle and
/// a lock on the timer wheel, as much as a small same-host copy itself. So the bound counts from the
/// end of that first poll. A batch the link runs inline ([`DataLink::transfer_now`]) has no future
/// either: no allocation for it at all.
///
/// A batch that finished on its first poll was moved by this thread in it (a same-host copy): beyond
/// the unit of budget every poll takes, it is charged by its size ([`charge_copy`]).
impl Run {
    fn poll_bounded(&mut self, peer: &Peer, cx: &mut Context<'_>) -> Poll<std::result::Result<(), Option<Error>>> {
        // Whether the link's future is polled for the first time, in the poll that started it.
        let mut fresh = false;
        if let Work::Unstarted(request) = &mut self.work {
            // Running inline never waits, so it takes a unit of the task's budget, as a future that
            // completes at once should: a caller transferring in a loop still yields to other tasks.
            // Out of budget, nothing has started yet and nothing needs bounding. A batch with a check
            // to run is never done inline.
            let budget = ready!(tokio::task::coop::poll_proceed(cx));
            if self.check.is_none()
                && let Some(done) = peer.inner.data.transfer_now(request)
            {
                budget.made_progress();
                if done.is_ok() {
                    charge_copy(cx, self.bytes);
                }
                return Poll::Ready(done.map_err(Some));
            }
            if let Work::Unstarted(request) = std::mem::replace(&mut self.work, Work::Taken) {
                self.work = Work::Started(peer.inner.data.transfer(request));
                fresh = true;
            }
        }
        loop {
            let (future, on_data_link) = match &mut self.work {
                Work::Started(future) => (future, true),
                Work::Declined(future) => (future, false),
                Work::Checking(check) => match check.as_mut().poll(cx) {
                    Poll::Pending => break,
                    Poll::Ready(done) => return Poll::Ready(done.map_err(Some)),
                },
                // Only a link that panicked in `transfer` leaves it taken.
                _ => {
                    return Poll::Ready(Err(Some(Error::Internal(
                        "the link failed to start the transfer".into(),
                    ))));
                }
            };
            let declined = match future.as_mut().poll(cx) {
                Poll::Pending => break,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(Some(e))),
                Poll::Ready(Ok(declined)) => declined,
            };
            if declined.is_empty() {
                // The data moved: check it where asked, within what is left of the batch's bound.
                if let Some(check) = self.check.take() {
                    self.work = Work::Checking((*check).run(peer));
                    continue;
                }
                if fresh {
                    charge_copy(cx, self.bytes);
                }
                return Poll::Ready(Ok(()));
            }
            if !on_data_link {
                return Poll::Ready(Err(Some(Error::Internal(format!(
                    "the control link declined {} items of a batch; it reaches every region",
                    declined.len()
                )))));
            }
            // The rest goes over the control link, within what is left of the batch's bound.
            fresh = false;
            let request = TransferRequest {
                op: self.op,
                durability: self.durability,
                items: declined.into_items(),
                checked: self.checked,
            };
            self.work = Work::Declined(peer.inner.control.transfer(request));
        }
        if let Timer::Unarmed(until) = self.timer {
            let sleep = match until {
                Some(at) => tokio::time::sleep_until(at.into()),
                None => tokio::time::sleep(self.timeout),
            };
            self.timer = Timer::Armed(Box::pin(sleep));
        }
        let Timer::Armed(sleep) = &mut self.timer else {
            return Poll::Pending;
        };
        ready!(sleep.as_mut().poll(cx));
        // Out of time: the batch is dropped now, not whenever its caller drops this future, so that
        // the link lets go of it and nothing lands in its buffers once `Timeout` is seen.
        self.work = Work::Taken;
        self.check = None;
        Poll::Ready(Err(None))
    }
}

impl Future for Transfer {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        let entered = this.span.enter();
        let run = &mut this.run;
        let result = ready!(run.poll_bounded(&this.peer, cx))
            .map_err(|e| e.unwrap_or_else(|| Error::transfer_timeout(this.descriptors, this.peer.addr(), run.timeout)));
        if let Some(started) = &this.metered
            && let Some(metrics) = &this.peer.inner.metrics
        {
            metrics.record(run.op, this.descriptors, run.bytes, started.elapsed(), &result);
        }
        if !this.span.is_disabled() {
            match &result {
                Ok(()) => this.span.record("outcome", "ok"),
                Err(e) => this.span.record("outcome", e.code().name()),
            };
        }
        drop(entered);
        Poll::Ready(result)
    }
}
