//! `transfer_async`'s handle, and prepared batches.

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use tokio::sync::watch;

use crate::bridge::{self, Outcome};
use crate::runtime::runtime;

/// Where an asynchronous transfer stands (HIXL `TransferStatus`).
#[pyclass(module = "ferry._ferry", frozen, eq, eq_int)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum TransferStatus {
    /// Still moving.
    #[pyo3(name = "WAITING")]
    Waiting,
    /// Every descriptor was applied at its destination.
    #[pyo3(name = "COMPLETED")]
    Completed,
    /// Its timeout passed first.
    #[pyo3(name = "TIMEOUT")]
    Timeout,
    /// It failed; awaiting the handle raises the error.
    #[pyo3(name = "FAILED")]
    Failed,
}

/// A batch resolved by `Engine.prepare`.
#[pyclass(module = "ferry._ferry", frozen)]
pub struct PreparedTransfer {
    pub inner: Arc<ferry::PreparedTransfer>,
    pub len: usize,
}

#[pymethods]
impl PreparedTransfer {
    fn __len__(&self) -> usize {
        self.len
    }
}

type Finished = Option<Result<(), ferry::Error>>;

/// A transfer started by `Engine.transfer_async`: `status()` never blocks; `await handle` returns
/// when it is done, or raises its error. Dropping the handle lets the transfer finish in the
/// background. Once the status leaves WAITING no byte lands in its local buffers again.
#[pyclass(module = "ferry._ferry", frozen)]
pub struct TransferHandle {
    outcome: watch::Receiver<Finished>,
}

/// Posts `prepared` on the runtime and returns its handle.
pub fn start(engine: ferry::Engine, prepared: Arc<ferry::PreparedTransfer>, timeout: Duration) -> TransferHandle {
    let (tx, rx) = watch::channel(None);
    runtime().spawn(async move {
        let result = engine.transfer_prepared(&prepared, timeout).await;
        // Nobody may be watching any more (the handle was dropped): the transfer still completed.
        let _ = tx.send(Some(result));
    });
    TransferHandle { outcome: rx }
}

#[pymethods]
impl TransferHandle {
    /// Where the transfer stands now.
    fn status(&self) -> TransferStatus {
        match &*self.outcome.borrow() {
            None => TransferStatus::Waiting,
            Some(Ok(())) => TransferStatus::Completed,
            Some(Err(ferry::Error::Timeout(_))) => TransferStatus::Timeout,
            Some(Err(_)) => TransferStatus::Failed,
        }
    }

    fn __await__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let mut outcome = self.outcome.clone();
        let future = bridge::spawn(py, async move {
            match outcome.wait_for(Option::is_some).await {
                Ok(done) => match &*done {
                    Some(Ok(())) | None => Outcome::None,
                    Some(Err(e)) => Outcome::Err(e.clone()),
                },
                Err(_) => Outcome::Err(ferry::Error::Internal(
                    "the transfer's task ended without a result".into(),
                )),
            }
        })?;
        future.call_method0("__await__")
    }
}
