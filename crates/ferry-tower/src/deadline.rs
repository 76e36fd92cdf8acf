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
//!   with [`Error::Timeout`](ferry::Error::Timeout), bounds waiting for a link (the per-peer limit,
//!   another request's connect, its own connect) by it, and hands the engine the time left, so the
//!   engine's own timer ends the transfer at the deadline;
//! - [`RetryPolicy`](crate::RetryPolicy) does not retry a request whose deadline would pass during the
//!   backoff pause.
//!
//! Placed outside `retry`, a deadline bounds the whole request; inside it, each attempt (the retry
//! layer keeps the request as it received it, so each attempt gets a fresh per-attempt deadline, never
//! later than the overall one). Layers between a `DeadlineLayer` and the service that only pass
//! requests through (`map_err`, `retry`, `concurrency_limit`) need nothing; a layer of your own that
//! may wait inside `call` is not bounded by it: put a `tower::timeout` around that one.

use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;
use tower::{Layer, Service};

use crate::request::TransferRequest;

/// A tower layer that gives each [`TransferRequest`] a deadline `limit` from when it passes, or keeps
/// the earlier one it already has. See the [module documentation](self) for what enforces it.
#[derive(Debug, Clone, Copy)]
pub struct DeadlineLayer {
    limit: Duration,
}

impl DeadlineLayer {
    /// Requests passing through must be done within `limit`.
    pub fn new(limit: Duration) -> Self {
        DeadlineLayer { limit }
    }
}

impl<S> Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Deadline<S> {
        Deadline {
            inner,
            limit: self.limit,
        }
    }
}

/// The service [`DeadlineLayer`] makes: sets the deadline and calls the inner service, with no
/// future or timer of its own.
#[derive(Debug, Clone)]
pub struct Deadline<S> {
    inner: S,
    limit: Duration,
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

    fn call(&mut self, request: TransferRequest) -> S::Future {
        // A limit too large to add to now (Duration::MAX, say) sets no deadline.
        let request = match Instant::now().checked_add(self.limit) {
            Some(at) => request.with_deadline(at),
            None => request,
        };
        self.inner.call(request)
    }
}
