//! Asynchronous transfers (HIXL `TransferAsync` and `GetTransferStatus`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll};

use ferry_core::{Error, Result};
use tokio::task::JoinHandle;

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
