//! Notifications received, as objects and as an async iterator.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use futures::stream::BoxStream;
use pyo3::prelude::*;

use crate::bridge::{self, Outcome};

/// A notification received from a peer.
#[pyclass(module = "ferry._ferry", frozen, get_all)]
pub struct Notification {
    /// Its name (at most 1024 characters).
    pub name: String,
    /// Its body (at most 1024 characters).
    pub msg: String,
    /// The sending engine's id, as the sender claimed it.
    pub from_engine: u64,
    /// The sender's address as this engine saw it.
    pub from_addr: String,
    /// Who the sender proved to be on an authenticated link (its certificate's names), else None.
    pub from_identity: Option<String>,
}

impl From<ferry::ReceivedNotification> for Notification {
    fn from(n: ferry::ReceivedNotification) -> Self {
        Notification {
            name: n.notification.name,
            msg: n.notification.msg,
            from_engine: n.from_engine,
            from_addr: n.from_addr,
            from_identity: n.from_identity.map(|id| id.to_string()),
        }
    }
}

impl From<&ferry::ReceivedNotification> for Notification {
    fn from(n: &ferry::ReceivedNotification) -> Self {
        Notification::from(n.clone())
    }
}

#[pymethods]
impl Notification {
    fn __repr__(&self) -> String {
        format!(
            "<ferry.Notification name={:?} msg={:?} from={}>",
            self.name, self.msg, self.from_addr
        )
    }
}

type Stream = BoxStream<'static, ferry::ReceivedNotification>;
type Returned = Arc<Mutex<VecDeque<ferry::ReceivedNotification>>>;

/// `async for n in engine.notifications()`: every notification, as it arrives.
///
/// A cancelled `__anext__` (`asyncio.wait_for` running out) loses nothing and reorders nothing: its
/// wait stops, and a notification it had already taken is handed to the next call, before any that
/// arrived after it.
#[pyclass(module = "ferry._ferry", frozen)]
pub struct NotificationStream {
    stream: Arc<tokio::sync::Mutex<Stream>>,
    returned: Returned,
}

/// A notification one `__anext__` took, on its way to that call's future.
///
/// It holds the stream until the event loop has handed it over: the future may have been
/// cancelled meanwhile, and only the loop's thread can tell. Were the stream free, the next
/// `__anext__` would take the notification after this one before this one is put back, and the two
/// would reach Python out of order. Dropped undelivered (a cancelled future, a loop that closed
/// first), it goes back to the front of the stream, before the stream is released.
pub struct TakenNotification {
    notification: Option<ferry::ReceivedNotification>,
    returned: Returned,
    _stream: tokio::sync::OwnedMutexGuard<Stream>,
}

impl TakenNotification {
    pub fn notification(&self) -> Option<&ferry::ReceivedNotification> {
        self.notification.as_ref()
    }

    /// Its future has it: nothing goes back.
    pub fn delivered(mut self) {
        self.notification = None;
    }
}

impl Drop for TakenNotification {
    fn drop(&mut self) {
        if let Some(n) = self.notification.take() {
            match self.returned.lock() {
                Ok(mut returned) => returned.push_front(n),
                Err(_) => tracing::error!("a notification stream's lock is poisoned; a notification is lost"),
            }
        }
    }
}

impl NotificationStream {
    pub fn new(stream: BoxStream<'static, ferry::ReceivedNotification>) -> Self {
        NotificationStream {
            stream: Arc::new(tokio::sync::Mutex::new(stream)),
            returned: Arc::new(Mutex::new(VecDeque::new())),
        }
    }
}

#[pymethods]
impl NotificationStream {
    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __anext__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let stream = self.stream.clone();
        let returned = self.returned.clone();
        bridge::spawn_cancellable(py, |cancelled| async move {
            let mut stream = tokio::select! {
                s = stream.lock_owned() => s,
                _ = cancelled.notified() => return Outcome::None,
            };
            let earlier = returned.lock().ok().and_then(|mut r| r.pop_front());
            let notification = match earlier {
                Some(n) => n,
                // The stream keeps a wait in progress inside itself, so stopping this one loses nothing.
                None => tokio::select! {
                    n = stream.next() => match n {
                        Some(n) => n,
                        None => return Outcome::StopIteration,
                    },
                    _ = cancelled.notified() => return Outcome::None,
                },
            };
            Outcome::Notification(TakenNotification {
                notification: Some(notification),
                returned,
                _stream: stream,
            })
        })
    }
}
