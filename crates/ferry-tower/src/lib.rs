//! # ferry-tower
//!
//! Retries, timeouts, connection pooling and limits for ferry transfers, as tower middleware.
//!
//! Code that awaits transfers should not have to write its own reconnect loops: a peer restarts, a
//! link drops, a route flaps, and every caller then needs the same answers — try again, but not
//! forever and not all at once; give up after a deadline; do not dial a dead peer a thousand times a
//! second; refuse work rather than queue it without bound. hyper and tonic users get those answers by
//! stacking tower layers around a service, and this crate makes a ferry engine such a service.
//!
//! ## The stack
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//!
//! use ferry::{Access, Engine};
//! use ferry_tower::{DeadlineLayer, Descriptor, PoolConfig, RetryPolicy, TransferRequest, TransferService, into_ferry_error};
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! let engine = Engine::builder().build().await?;
//! let transfers = TransferService::with_config(engine.clone(), PoolConfig::default())?;
//! let service = ServiceBuilder::new()
//!     .map_err(into_ferry_error) // one error type out: ferry::Error
//!     .load_shed() // refuse at once (ResourceExhausted) when saturated, ...
//!     .concurrency_limit(256) // ... that is, with 256 requests in flight
//!     .layer(DeadlineLayer::new(Duration::from_secs(10))) // the whole request, retries included
//!     .retry(RetryPolicy::default()) // transient failures, with backoff and a budget
//!     .layer(DeadlineLayer::per_attempt(Duration::from_secs(2))) // each attempt, connecting included
//!     .service(transfers);
//!
//! // Local memory is registered with the same engine; the remote side is named as an offset into
//! // the peer's region, so that it still means something after the peer restarts.
//! let src = engine.alloc_host(4096, Access::READ_WRITE)?;
//! src.write_at(0, b"hello")?;
//! let peer = "10.0.0.2:9955".parse()?;
//! let request = TransferRequest::write(peer, [Descriptor::at_offset(src.addr(), 0, 4096)]);
//! let response = service.clone().oneshot(request).await?;
//! println!("{} bytes over {}", response.bytes, response.transport);
//! # Ok(()) }
//! ```
//!
//! Order matters, outermost first: `load_shed` must see the `concurrency_limit` (and the pool's own
//! bound) say "not ready" to shed; the overall deadline bounds retries and their pauses, so it sits
//! outside `retry`. The per-attempt limit starts afresh with each attempt wherever it sits, so that an
//! attempt that hangs is cut short and repeated.
//!
//! The deadlines travel with the request and are enforced by the service, the pool, the engine's own
//! transfer timeout and the retry policy, with no timer of their own (see [`deadline`]); on a live
//! link the stack reads the clock once per request (for the overall deadline) beside the engine's own
//! read for the transfer's bound. To time requests, read the engine's
//! `transfer_duration_seconds` histogram ([`ferry::metrics`]) or wrap the stack in a layer that does.
//! `tower::timeout` works in the same places and also bounds layers that know nothing of deadlines,
//! at the cost of a tokio timer per request and layer: for the two in this stack, 4–10 % fewer 4 KiB
//! writes a second over TCP and 12–15 % fewer over shared memory, where a write costs less
//! (`examples/tower_overhead.rs`, with and without `-- --tcp`: `timeouts_ops_per_s` against
//! `tower_ops_per_s`).
//! The stack is `Clone` (each clone shares the pool, the limit and the retry budget), so concurrent
//! callers clone it; wrap it in `tower::buffer::Buffer` where a stack is not `Clone` (after
//! `.boxed()`, for example) or must be shared behind one handle.
//!
//! ## What is tower's and what is written here
//!
//! From tower, unchanged: [`tower::retry::Retry`] with [`ExponentialBackoffMaker`] (exponential
//! pauses with jitter), [`tower::timeout`],
//! [`tower::limit::ConcurrencyLimit`], [`tower::load_shed`], [`tower::buffer`], [`tower::ServiceBuilder`].
//!
//! Written here, because tower does not have it:
//!
//! - [`DeadlineLayer`]: gRPC-style deadlines carried by the request, which the pieces below enforce
//!   with the timer the engine already runs, where `tower::timeout` adds one per layer.
//! - [`TransferService`], the service itself: only ferry knows how to run a transfer.
//! - The connection pool inside it (see [`PoolConfig`]): tower's `reconnect` rebuilds one service
//!   and `balance` spreads load over interchangeable endpoints, but a transfer must reach the one peer
//!   it names, so links are kept per address, connected lazily, replaced when dead, reconnected with
//!   backoff, capped in total and per peer, and closed when idle.
//! - [`RetryPolicy`]: tower's `Retry` asks a policy what to repeat, and only the protocol knows that
//!   `Timeout` or `PeerClosed` may pass while `PermissionDenied` or `OutOfBounds` never will.
//! - [`RetryBudget`], tower's `Budget` with the balance of its `TpsBudget` but a deposit that
//!   touches only the calling thread's cache line: `TpsBudget` takes one mutex on every request,
//!   which cost a fifth of the stack's throughput on small writes.
//! - [`into_ferry_error`] and [`is_transient`]: tower's layers box errors; callers act on
//!   [`ferry::Error`] variants, so they are mapped back.
//!
//! ## Addressing across restarts
//!
//! A request names its peer by address and each descriptor's remote side as a [`RemoteAddr`]:
//! absolute, an offset into the peer's primary region, or an offset into a region by key. Offsets are
//! resolved against the regions the peer advertises on the link each attempt uses, so a retry after
//! the peer restarted (and registered its memory at a new address) lands in the new region, where an
//! absolute address would fail with `OutOfBounds`.
//!
//! [`ExponentialBackoffMaker`]: tower::retry::backoff::ExponentialBackoffMaker
#![deny(missing_docs)]

mod budget;
pub mod deadline;
mod error;
mod limit;
mod pool;
mod request;
mod retry;
mod service;

pub use budget::RetryBudget;
pub use deadline::{Deadline, DeadlineLayer};
pub use error::{into_ferry_error, is_transient, is_transient_ferry};
pub use pool::{PoolConfig, PoolStats};
pub use request::{Descriptor, RemoteAddr, TransferRequest, TransferResponse};
pub use retry::{RetryConfig, RetryPolicy};
pub use service::{TransferFuture, TransferService};

/// The tower version this crate is built against, for code that composes layers with it.
pub use tower;
