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

use ferry::{Engine, Error, Result};
use tokio::time::Instant;

use crate::pool::{Pool, PoolConfig, PoolStats, past_deadline};
use crate::request::{TransferRequest, TransferResponse};

/// The future a [`TransferService`] returns.
pub type TransferFuture = Pin<Box<dyn Future<Output = Result<TransferResponse>> + Send + 'static>>;

/// A `tower::Service<TransferRequest>` over an [`Engine`], with a connection pool.
///
/// - `poll_ready` reserves one of the pool's [`max_in_flight`](PoolConfig::max_in_flight) slots and
///   is `Pending` while all are taken: that is the backpressure `tower::load_shed` and
///   `tower::buffer` act on.
/// - `call` takes a pooled link to the request's peer (connecting on first use, or after the old link
///   died), resolves relative descriptors against the regions the peer advertises on that link, and
///   runs the transfer with the engine. Failures come back as [`ferry::Error`], unchanged.
/// - A request's [deadline](TransferRequest::deadline) is enforced here: past it, `call` answers
///   `Timeout` at once; waiting for a link ends at it; the engine gets the time left as the transfer's
///   timeout (see [`crate::deadline`]).
///
/// Clones share the pool (and so the links); each clone reserves its own slot in `poll_ready`, as
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
            self.pool.in_flight.give_back();
        }
    }
}

/// A request's unit of the pool's in-flight limit, given back when the request ends, however it
/// ends (the future may be dropped at any await).
struct InFlight(Arc<Pool>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.give_back();
    }
}

impl std::fmt::Debug for TransferService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferService")
            .field("engine", &self.pool.engine)
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
        &self.pool.engine
    }

    /// The pool's settings.
    pub fn config(&self) -> &PoolConfig {
        &self.pool.config
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
            if !self.pool.in_flight.try_take() {
                let pool = &self.pool;
                let waiting = self.waiting.get_or_insert_with(|| {
                    let pool = pool.clone();
                    Box::pin(async move { pool.in_flight.take().await })
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
            return Box::pin(std::future::ready(Err(Error::InvalidArgument(
                "TransferService::call without a successful poll_ready first".into(),
            ))));
        }
        // The future owns the unit: it goes back when the request ends, or when the future is dropped.
        Box::pin(execute(InFlight(self.pool.clone()), request))
    }
}

async fn execute(held: InFlight, request: TransferRequest) -> Result<TransferResponse> {
    let pool = &held.0;
    let started = Instant::now();
    let deadline = request.deadline();
    if deadline.is_some_and(|at| at <= started) {
        return Err(past_deadline(request.peer(), "before an attempt started"));
    }
    let mut lease = pool.checkout(request.peer(), deadline).await?;
    let descs = match request.resolve(&lease.peer, lease.primary) {
        Ok(descs) => descs,
        Err(e) => {
            lease.settle_neutral();
            return Err(e);
        }
    };
    let mut timeout = request.timeout().unwrap_or(pool.config.transfer_timeout);
    if let Some(at) = deadline {
        // The engine's own timer ends the transfer at the deadline: no second one here. A lease
        // that waited for nothing was taken microseconds after `started`: no second clock read.
        let now = if lease.waited { Instant::now() } else { started };
        let left = at.saturating_duration_since(now);
        if left.is_zero() {
            lease.settle_neutral();
            return Err(past_deadline(request.peer(), "before the transfer started"));
        }
        timeout = timeout.min(left);
    }
    let result = pool
        .engine
        .transfer_durable(
            &lease.peer,
            request.op(),
            descs.as_slice(),
            request.durability(),
            timeout,
        )
        .await;
    lease.settle(&result);
    result?;
    Ok(TransferResponse {
        peer: request.peer(),
        op: request.op(),
        bytes: request.bytes(),
        duration: started.elapsed(),
        transport: lease.peer.transport(),
        new_link: lease.new_link,
    })
}
