//! Deadlines that travel with the request, as gRPC's do, instead of a timer per layer.
//!
//! `tower::timeout` arms a tokio timer for every request that passes through it and races the inner
//! future against it. That is the right tool around services that know nothing of time, but a
//! transfer already runs under a timer: the engine bounds each batch. A stack with an overall and a
//! per-attempt `tower::timeout` therefore keeps three timers per 4 KiB write, and on this project's
//! 2-core test machine each tokio timer costs 5–9 % of such a write (registration and removal in the
//! shared timer wheel, under its lock). [`DeadlineLayer`] arms none: it writes the earlier of the
//! request's deadline and `now + limit` into the [`TransferRequest`], and the pieces under it read it:
//!
//! - [`TransferService`](crate::TransferService) fails a request whose deadline has passed at once
//!   with [`Error::Timeout`](ferry::Error::Timeout), having sent nothing, bounds waiting for a link
//!   (the per-peer limit, another request's connect, its own connect) by it, and hands it to the
//!   engine ([`Engine::start`](ferry::Engine::start) with a [`TransferOptions::deadline`](ferry::TransferOptions::deadline)), whose own timer
//!   ends the transfer at the deadline;
//! - [`RetryPolicy`](crate::RetryPolicy) does not retry a request whose deadline would pass during the
//!   backoff pause.
//!
//! Two kinds, for the two bounds a client wants:
//!
//! - [`DeadlineLayer::new`] bounds the whole request, retries and their pauses included: placed
//!   outside `retry`, it fixes the deadline once, when the request passes.
//! - [`DeadlineLayer::per_attempt`] bounds each attempt: it writes only the limit into the request
//!   ([`TransferRequest::with_attempt_limit`]), and the service starts that clock when an attempt
//!   reaches it, so every attempt gets the whole limit (never past the overall deadline), wherever the
//!   layer sits. It reads no clock, and neither does the service on a live link: the engine takes the
//!   limit as the transfer's timeout and the deadline as an instant, and reads the clock once for both
//!   (waiting for a link reads it once more). The time a request spends in layers between it and the service (a `tower::buffer`
//!   queue) is not part of an attempt.
//!
//! (A `DeadlineLayer::new` placed inside `retry` also bounds each attempt, since the retry layer
//! keeps the request as it received it: at the cost of one more clock read per request.) Layers
//! between a `DeadlineLayer` and the service that only pass requests through (`map_err`, `retry`,
//! `concurrency_limit`) need nothing; a layer of your own that may wait inside `call` is not bounded
//! by them: put a `tower::timeout` around that one.

use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;
use tower::{Layer, Service};

use crate::request::TransferRequest;

/// A tower layer that gives each [`TransferRequest`] a deadline `limit` from when it passes, or keeps
/// the earlier one it already has; or, made with [`per_attempt`](Self::per_attempt), a limit on each
/// attempt. See the [module documentation](self) for what enforces them.
#[derive(Debug, Clone, Copy)]
pub struct DeadlineLayer {
    limit: Duration,
    per_attempt: bool,
}

impl DeadlineLayer {
    /// Requests passing through must be done within `limit`, retries included.
    pub fn new(limit: Duration) -> Self {
        DeadlineLayer {
            limit,
            per_attempt: false,
        }
    }

    /// Each attempt of a request passing through must be done within `limit` of reaching the
    /// service, waiting for a link included (see [`TransferRequest::with_attempt_limit`]).
    pub fn per_attempt(limit: Duration) -> Self {
        DeadlineLayer {
            limit,
            per_attempt: true,
        }
    }
}

impl<S> Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Deadline<S> {
        Deadline {
            inner,
            limit: self.limit,
            per_attempt: self.per_attempt,
        }
    }
}

/// The service [`DeadlineLayer`] makes: sets the deadline (or the attempt limit) and calls the inner
/// service, with no future or timer of its own.
#[derive(Debug, Clone)]
pub struct Deadline<S> {
    inner: S,
    limit: Duration,
    per_attempt: bool,
}

impl<S> Service<TransferRequest> for Deadline<S>
where
    S: Service<TransferRequest>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: TransferRequest) -> S::Future {
        if self.per_attempt {
            request.limit_attempts(self.limit);
        } else if let Some(at) = Instant::now().checked_add(self.limit) {
            // A limit too large to add to now (Duration::MAX, say) sets no deadline.
            request.bound_by(at);
        }
        self.inner.call(request)
    }
}
