//! [`TransferService`]: ferry's engine as a `tower::Service`.
//!
//! The service is the innermost piece of a stack: it owns the connection pool and runs one attempt
//! of a request on a pooled link. Everything that decides *whether* and *when* to run an attempt
//! (retries, timeouts, concurrency limits, load shedding) is tower's own layers around it; see the
//! [crate documentation](crate) for the stack.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use ferry::{Engine, Error, Peer, Result};
use tokio::time::Instant;

use crate::pool::{Checkout, Lease, LeaseStart, Pool, PoolConfig, PoolStats, Shared, past_deadline};
use crate::request::{TransferRequest, TransferResponse, primary_region};

/// The future a [`TransferService`] returns.
///
/// In the common case (a live link with room on it) the service resolves the request and hands it
/// to the engine inside `call`, and this future holds the engine's own [`ferry::Transfer`]: nothing
/// is allocated for it. A request that must wait (for a connect, for room on the link) runs in a
/// boxed future instead. An error known in `call` is held as it is, with no future around it.
#[must_use = "a transfer does nothing unless it is awaited"]
pub struct TransferFuture(State);

// The large variant is the common case, held inline on purpose: boxing it is what this type avoids.
#[allow(clippy::large_enum_variant)]
enum State {
    Running(Running),
    /// Boxed: waiting is the rare path, and its future (a timer, a connect) is large.
    Waiting(Pin<Box<dyn Future<Output = Result<TransferResponse>> + Send + 'static>>),
    Failed(Option<Error>),
}

impl std::fmt::Debug for TransferFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.0 {
            State::Running(_) => "running",
            State::Waiting(_) => "waiting for a link",
            State::Failed(_) => "failed",
        };
        f.debug_tuple("TransferFuture").field(&state).finish()
    }
}

impl Future for TransferFuture {
    type Output = Result<TransferResponse>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().0 {
            State::Running(running) => Pin::new(running).poll(cx),
            State::Waiting(waiting) => waiting.as_mut().poll(cx),
            State::Failed(error) => Poll::Ready(Err(error
                .take()
                .unwrap_or_else(|| Error::Internal("a TransferFuture was polled after it completed".into())))),
        }
    }
}

/// A `tower::Service<TransferRequest>` over an [`Engine`], with a connection pool.
///
/// - `poll_ready` reserves one of the pool's [`max_in_flight`](PoolConfig::max_in_flight) units and
///   is `Pending` while all are taken: that is the backpressure `tower::load_shed` and
///   `tower::buffer` act on.
/// - `call` takes a pooled link to the request's peer (connecting on first use, or after the old link
///   died), resolves relative descriptors against the regions the peer advertises on that link, and
///   runs the transfer with the engine. Failures come back as [`ferry::Error`], unchanged. With a
///   live link and room on it, all of that but the transfer itself happens inside `call`, and the
///   returned [`TransferFuture`] holds the engine's own future: nothing moves until it is polled, and
///   one dropped unpolled counts as no attempt on the link.
/// - A request's [deadline](TransferRequest::deadline) is enforced here, and so is its
///   [attempt limit](TransferRequest::attempt_limit), from when `call` starts the attempt: a request
///   already past its deadline fails with `Timeout` at once, having sent nothing; waiting for a link
///   ends at the earlier of the two; the engine ends the transfer at it, taking the deadline as an
///   instant and the limit as the transfer's timeout, so that the clock is read once per attempt, by
///   the engine (see [`crate::deadline`]).
///
/// Clones share the pool (and so the links); each clone reserves its own unit in `poll_ready`, as
/// tower requires of cloned services.
pub struct TransferService {
    pool: Arc<Pool>,
    /// Whether `poll_ready` holds a unit of the pool's in-flight limit for the next `call`.
    reserved: bool,
    /// Waiting for a unit, when none was free at once; it holds the unit once it is ready.
    waiting: Option<Pin<Box<dyn Future<Output = ()> + Send + Sync>>>,
}

impl Clone for TransferService {
    fn clone(&self) -> Self {
        TransferService {
            pool: self.pool.clone(),
            reserved: false,
            waiting: None,
        }
    }
}

impl Drop for TransferService {
    fn drop(&mut self) {
        if self.reserved {
            self.pool.shared.in_flight.give_back();
        }
    }
}

impl std::fmt::Debug for TransferService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferService")
            .field("engine", &self.pool.shared.engine)
            .field("stats", &self.pool.stats())
            .finish()
    }
}

impl TransferService {
    /// A service over `engine` with the default [`PoolConfig`].
    pub fn new(engine: Engine) -> Self {
        // The default configuration is valid (a unit test checks it): no validation to fail.
        let pool = Pool::unchecked(engine, PoolConfig::default());
        TransferService::from_pool(pool)
    }

    /// A service over `engine` with `config`. `InvalidArgument` for settings out of range.
    pub fn with_config(engine: Engine, config: PoolConfig) -> Result<Self> {
        Ok(TransferService::from_pool(Pool::new(engine, config)?))
    }

    fn from_pool(pool: Pool) -> Self {
        TransferService {
            pool: Arc::new(pool),
            reserved: false,
            waiting: None,
        }
    }

    /// The engine the service transfers with (to register local memory on, for example).
    pub fn engine(&self) -> &Engine {
        &self.pool.shared.engine
    }

    /// The pool's settings.
    pub fn config(&self) -> &PoolConfig {
        &self.pool.shared.config
    }

    /// The pool's state and counters, now.
    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }
}

impl tower::Service<TransferRequest> for TransferService {
    type Response = TransferResponse;
    type Error = Error;
    type Future = TransferFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if !self.reserved {
            if !self.pool.shared.in_flight.try_take() {
                let pool = &self.pool;
                let waiting = self.waiting.get_or_insert_with(|| {
                    let pool = pool.clone();
                    Box::pin(async move { pool.shared.in_flight.take().await })
                });
                ready!(waiting.as_mut().poll(cx));
                self.waiting = None;
            }
            self.reserved = true;
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: TransferRequest) -> TransferFuture {
        if !std::mem::take(&mut self.reserved) {
            return TransferFuture(State::Failed(Some(Error::InvalidArgument(
                "TransferService::call without a successful poll_ready first".into(),
            ))));
        }
        // The lease, or the future, owns the unit: it goes back when the request ends, or when
        // the future is dropped. The lease holds the peer's entry, and through it the engine, so
        // that the link stays up while the request runs, even once the last clone of the service
        // is gone. The engine bounds the transfer by the request's deadline and reads the clock for
        // it: none read here.
        let deadline = request.deadline();
        match Pool::try_checkout(&self.pool, request.peer(), |peer, start| {
            Running::begin(&self.pool.shared, peer, start, &request, deadline)
        }) {
            Ok(Checkout::Ready(lease, begun)) => TransferFuture(Running::started(lease, begun, request, deadline)),
            Ok(Checkout::Wait(held, claim)) => {
                // Waiting needs the attempt's end as an instant: the clock is read on this path only.
                let now = Instant::now();
                let deadline = attempt_deadline(&request, now);
                if deadline.is_some_and(|at| at <= now) {
                    return TransferFuture(State::Failed(Some(past_deadline(
                        request.peer(),
                        "before an attempt started",
                    ))));
                }
                TransferFuture(State::Waiting(Box::pin(async move {
                    let (lease, link) = Pool::wait_for_link(held, claim, deadline).await?;
                    let begun = Running::begin(lease.shared(), &link.peer, link.start(), &request, deadline);
                    TransferFuture(Running::started(lease, begun, request, deadline)).await
                })))
            }
            Err(e) => TransferFuture(State::Failed(Some(e))),
        }
    }
}

/// When an attempt that starts at `now` must end: the earlier of the request's deadline and its
/// attempt limit from `now` (a limit too large to add to now bounds nothing).
fn attempt_deadline(request: &TransferRequest, now: Instant) -> Option<Instant> {
    let limit = request.attempt_limit().and_then(|limit| now.checked_add(limit));
    match (request.deadline(), limit) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// One attempt on a leased link: the engine's transfer, and what the response needs.
struct Running {
    transfer: ferry::Transfer,
    lease: Lease,
    op: ferry::Op,
    bytes: u64,
    /// A future dropped before it was ever polled sent nothing: not an abandoned attempt.
    polled: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.polled {
            self.lease.settle_neutral();
        }
    }
}

/// How handing a request to the engine went, on a link borrowed for the purpose: what the lease,
/// made afterwards, needs to settle.
enum Begun {
    Started(ferry::Transfer),
    /// The request was wrong (or late): no verdict on the link.
    Refused(Error),
    /// The engine refused it for a reason that may be the link's.
    Failed(Error),
    /// The peer advertises no region yet: wait for its first, on this link.
    AwaitAdvert(Peer, Error),
}

impl Running {
    /// Resolves `request` against `peer`'s regions and hands it to the engine.
    ///
    /// Inlined so that the transfer's state is built where the caller's future lives: a transfer's
    /// state is some 260 bytes, and each move of it costs a `memcpy` on every request.
    #[inline(always)]
    fn begin(
        shared: &Shared,
        peer: &Peer,
        start: LeaseStart,
        request: &TransferRequest,
        deadline: Option<Instant>,
    ) -> Begun {
        let descs = match request.resolve(peer, start.primary) {
            Ok(descs) => descs,
            Err(e) if awaits_first_advert(peer, request) => return Begun::AwaitAdvert(peer.clone(), e),
            Err(e) => return Begun::Refused(e),
        };
        let mut timeout = request.timeout().unwrap_or(shared.config.transfer_timeout);
        if let Some(limit) = request.attempt_limit() {
            timeout = timeout.min(limit);
        }
        // The engine's own timer ends the transfer at the deadline: no second one here.
        let options = ferry::TransferOptions::within(timeout)
            .durability(request.durability())
            .deadline(deadline.map(Instant::into_std));
        match shared.engine.start(peer, request.op(), descs.as_slice(), options) {
            Ok(transfer) => Begun::Started(transfer),
            // Before sending anything the engine answers `Timeout` only for a deadline already
            // passed: the request was late, which says nothing of the link.
            Err(e @ Error::Timeout(_)) => Begun::Refused(e),
            Err(e) => Begun::Failed(e),
        }
    }

    /// The future's state once `begun` is known, the lease settled where it already can be.
    #[inline(always)]
    fn started(mut lease: Lease, begun: Begun, request: TransferRequest, deadline: Option<Instant>) -> State {
        match begun {
            Begun::Started(transfer) => State::Running(Running {
                transfer,
                lease,
                op: request.op(),
                bytes: request.bytes(),
                polled: false,
            }),
            Begun::Refused(e) => {
                lease.settle_neutral();
                State::Failed(Some(e))
            }
            Begun::Failed(e) => {
                lease.settle_failed(&e);
                State::Failed(Some(e))
            }
            Begun::AwaitAdvert(peer, e) => {
                State::Waiting(Box::pin(Self::after_first_advert(lease, peer, request, deadline, e)))
            }
        }
    }

    /// A peer that advertises no region at all has just started (or restarted) and not registered
    /// its memory yet, or is going away: waits, within the attempt, for its first region and starts
    /// the transfer then. `PeerClosed` (retried on a new link) if the link ends first, `Timeout` if
    /// the attempt's time runs out first; `refused` says what resolving found.
    async fn after_first_advert(
        mut lease: Lease,
        peer: Peer,
        request: TransferRequest,
        deadline: Option<Instant>,
        refused: Error,
    ) -> Result<TransferResponse> {
        let limit = request.timeout().unwrap_or(lease.shared().config.transfer_timeout);
        let until = deadline.unwrap_or_else(|| Instant::now() + limit);
        // In short slices: an update that lands between the check and the wait is not lost for long,
        // and a link that ends meanwhile is seen.
        const SLICE: std::time::Duration = std::time::Duration::from_millis(100);
        while peer.with_regions(primary_region).ok().flatten().is_none() {
            if peer.is_closed() {
                let e = Error::PeerClosed(format!("{refused}; the link ended before it advertised one"));
                lease.settle_failed(&e);
                return Err(e);
            }
            let now = Instant::now();
            if now >= until {
                lease.settle_neutral();
                return Err(Error::Timeout(format!(
                    "{refused}, and advertised none before the attempt's deadline"
                )));
            }
            peer.regions_changed((until - now).min(SLICE)).await;
        }
        let begun = Self::begin(lease.shared(), &peer, LeaseStart { primary: None }, &request, deadline);
        TransferFuture(Self::started(lease, begun, request, deadline)).await
    }
}

/// Whether resolving `request` failed because `peer` advertises no region yet, which its relative
/// descriptors need.
fn awaits_first_advert(peer: &ferry::Peer, request: &TransferRequest) -> bool {
    request
        .descriptors()
        .iter()
        .any(|d| matches!(d.remote, crate::RemoteAddr::Offset(_)))
        && peer.with_regions(primary_region).ok().flatten().is_none()
}

impl Future for Running {
    type Output = Result<TransferResponse>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        this.polled = true;
        let result = ready!(Pin::new(&mut this.transfer).poll(cx));
        this.lease.settle(&result);
        Poll::Ready(result.map(|()| TransferResponse {
            peer: this.lease.addr(),
            op: this.op,
            bytes: this.bytes,
            transport: this.lease.transport,
            new_link: this.lease.new_link,
        }))
    }
}
