//! The retry policy for `tower::retry::RetryLayer`: which failures to repeat, how long to wait, and how
//! many repeats the whole client may spend.
//!
//! tower provides the machinery (the `Retry` service, [`ExponentialBackoffMaker`], the `Budget`
//! trait that [`RetryBudget`] implements) but no policy, because only the protocol knows which errors
//! are worth repeating. This one repeats what [`is_transient`] says may succeed later (timeouts,
//! closed peers, refused or reset connections, unreachable routes) and never `PermissionDenied`,
//! `OutOfBounds` or `InvalidArgument`.
//!
//! How it limits retries is documented on [`RetryPolicy`].

use std::sync::Arc;
use std::time::Duration;

use ferry::{Error, Result};
use tokio::time::Instant;
use tower::BoxError;
use tower::retry::Policy;
use tower::retry::backoff::{Backoff, ExponentialBackoff, ExponentialBackoffMaker, MakeBackoff};
use tower::retry::budget::Budget;
use tower::util::rng::HasherRng;

use crate::budget::RetryBudget;
use crate::error::{is_transient, is_transient_ferry};
use crate::request::TransferRequest;

/// Settings of a [`RetryPolicy`].
#[derive(Debug, Clone)]
pub struct RetryConfig {
    /// Most repeats of one request (default 5).
    pub max_retries: u32,
    /// Pause before the first repeat (default 20 ms); doubles with each further one.
    pub backoff_min: Duration,
    /// Longest pause (default 1 s).
    pub backoff_max: Duration,
    /// Random extra pause, as a fraction of the current one, 0 to 100 (default 1.0: up to twice the
    /// base pause, never past `backoff_max`).
    pub jitter: f64,
    /// How long a deposit counts in the budget, 1 to 60 s (default 10 s).
    pub budget_ttl: Duration,
    /// Repeats per second allowed whatever the traffic, so that a quiet client may still retry
    /// (default 10).
    pub budget_min_per_sec: u32,
    /// Repeats allowed per request made, 0 to 1000 (default 0.2: one repeat for five requests).
    pub budget_retry_ratio: f32,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_retries: 5,
            backoff_min: Duration::from_millis(20),
            backoff_max: Duration::from_secs(1),
            jitter: 1.0,
            budget_ttl: Duration::from_secs(10),
            budget_min_per_sec: 10,
            budget_retry_ratio: 0.2,
        }
    }
}

/// A `tower::retry::Policy` for ferry transfers. It repeats what [`is_transient`] says may succeed
/// later (timeouts, closed peers, refused or reset connections, unreachable routes) and never
/// `PermissionDenied`, `OutOfBounds` or `InvalidArgument`.
///
/// Two limits apply together. Per request, at most [`RetryConfig::max_retries`] repeats, each after an
/// exponentially growing, jittered pause (so that callers that failed together do not come back
/// together). Across the client, a [`RetryBudget`] shared by every clone of the policy: each original
/// request deposits, each retry withdraws, and when the budget is spent failures are returned at once.
/// With the defaults a dead peer sees at most 20 % more attempts than there are requests, plus a small
/// reserve, instead of `1 + max_retries` times as many.
///
/// Clones share the budget. `tower::retry::Retry` clones the policy for every request, which gives
/// each request its own count of repeats and its own backoff sequence.
///
/// It works with either error type a stack produces: [`ferry::Error`] (directly over
/// [`TransferService`](crate::TransferService)) or [`tower::BoxError`] (over layers such as
/// `tower::timeout`, whose `Elapsed` counts as transient). A request whose
/// [deadline](TransferRequest::deadline) would pass during the pause is not retried.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// The settings and the budget, which every clone shares: `Retry` clones the policy for each
    /// request, so that a clone is one reference count and a few words to copy.
    shared: Arc<Shared>,
    retries: u32,
    /// Made at the first retry: most requests never need one.
    backoff: Option<Box<ExponentialBackoff<HasherRng>>>,
}

/// Aligned to two cache lines, so that the `Arc`'s reference count, which every request writes
/// (`Retry` clones the policy per request), is apart from the settings every request reads.
#[derive(Debug)]
#[repr(align(128))]
struct Shared {
    max_retries: u32,
    backoff_min: Duration,
    backoff_max: Duration,
    jitter: f64,
    budget: Arc<RetryBudget>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        // The default settings are valid (a unit test checks it): nothing to check that could fail.
        let config = RetryConfig::default();
        let budget = RetryBudget::unchecked(config.budget_ttl, config.budget_min_per_sec, config.budget_retry_ratio);
        RetryPolicy::from_parts(config, Arc::new(budget))
    }
}

impl RetryPolicy {
    /// A policy with its own budget. `InvalidArgument` for settings out of range.
    pub fn new(config: RetryConfig) -> Result<Self> {
        let budget = Arc::new(RetryBudget::new(
            config.budget_ttl,
            config.budget_min_per_sec,
            config.budget_retry_ratio,
        )?);
        RetryPolicy::with_budget(config, budget)
    }

    /// A policy that draws on `budget`, for several stacks that should share one.
    pub fn with_budget(config: RetryConfig, budget: Arc<RetryBudget>) -> Result<Self> {
        // Checks the backoff settings; each request makes its own backoff later (see `backoff`).
        ExponentialBackoffMaker::new(config.backoff_min, config.backoff_max, config.jitter, HasherRng::new())
            .map_err(|e| Error::InvalidArgument(format!("retry backoff: {e}")))?;
        Ok(RetryPolicy::from_parts(config, budget))
    }

    fn from_parts(config: RetryConfig, budget: Arc<RetryBudget>) -> Self {
        RetryPolicy {
            shared: Arc::new(Shared {
                max_retries: config.max_retries,
                backoff_min: config.backoff_min,
                backoff_max: config.backoff_max,
                jitter: config.jitter,
                budget,
            }),
            retries: 0,
            backoff: None,
        }
    }

    /// The budget this policy draws on.
    pub fn budget(&self) -> &Arc<RetryBudget> {
        &self.shared.budget
    }

    /// Whether to repeat a request that failed with an error that is `transient` or not, and after
    /// what pause.
    fn decide(&mut self, transient: bool, deadline: Option<Instant>) -> Option<tokio::time::Sleep> {
        if !transient {
            tracing::debug!("not retrying: the error is not transient");
            return None;
        }
        let shared = &*self.shared;
        if self.retries >= shared.max_retries {
            tracing::debug!(retries = self.retries, "not retrying: the request used all its retries");
            return None;
        }
        if self.backoff.is_none() {
            // A fresh random source per request: a maker clones its generator into every backoff
            // it makes, which would give concurrent requests the same "random" pauses.
            let maker =
                ExponentialBackoffMaker::new(shared.backoff_min, shared.backoff_max, shared.jitter, HasherRng::new());
            self.backoff = maker.ok().map(|mut m| Box::new(m.make_backoff()));
        }
        let pause = self.backoff.as_mut()?.next_backoff();
        if deadline.is_some_and(|at| pause.deadline() >= at) {
            tracing::debug!("not retrying: the request's deadline passes before the pause ends");
            return None;
        }
        // Last, so that only a retry that happens draws on the budget.
        if !shared.budget.withdraw() {
            tracing::debug!("not retrying: the retry budget is spent");
            return None;
        }
        self.retries += 1;
        tracing::debug!(retry = self.retries, "retrying after a transient failure");
        Some(pause)
    }

    fn clone_and_deposit(&mut self, req: &TransferRequest) -> Option<TransferRequest> {
        // `Retry` calls this on its prototype policy for each new request (which has never retried)
        // and on the request's own clone after each retry: deposit once per original request.
        if self.retries == 0 {
            self.shared.budget.deposit();
        }
        Some(req.clone())
    }
}

impl<Res> Policy<TransferRequest, Res, Error> for RetryPolicy {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        req: &mut TransferRequest,
        result: &mut std::result::Result<Res, Error>,
    ) -> Option<Self::Future> {
        // A success ends here, without a call: it is every request's last step.
        let error = result.as_ref().err()?;
        self.decide(is_transient_ferry(error), req.deadline())
    }

    fn clone_request(&mut self, req: &TransferRequest) -> Option<TransferRequest> {
        self.clone_and_deposit(req)
    }
}

impl<Res> Policy<TransferRequest, Res, BoxError> for RetryPolicy {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        req: &mut TransferRequest,
        result: &mut std::result::Result<Res, BoxError>,
    ) -> Option<Self::Future> {
        let error = result.as_ref().err()?;
        self.decide(is_transient(&**error), req.deadline())
    }

    fn clone_request(&mut self, req: &TransferRequest) -> Option<TransferRequest> {
        self.clone_and_deposit(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_settings_are_errors() {
        let bad = [
            RetryConfig {
                budget_ttl: Duration::from_millis(10),
                ..RetryConfig::default()
            },
            RetryConfig {
                budget_retry_ratio: -1.0,
                ..RetryConfig::default()
            },
            RetryConfig {
                backoff_min: Duration::from_secs(2),
                backoff_max: Duration::from_secs(1),
                ..RetryConfig::default()
            },
            RetryConfig {
                jitter: f64::NAN,
                ..RetryConfig::default()
            },
        ];
        for config in bad {
            assert!(
                matches!(RetryPolicy::new(config.clone()), Err(Error::InvalidArgument(_))),
                "{config:?}"
            );
        }
        assert!(
            RetryPolicy::new(RetryConfig::default()).is_ok(),
            "Default skips these checks"
        );
    }
}
