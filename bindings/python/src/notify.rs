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

#[pymethods]
impl Notification {
    fn __repr__(&self) -> String {
        format!(
            "<ferry.Notification name={:?} msg={:?} from={}>",
            self.name, self.msg, self.from_addr
        )
    }
}

/// `async for n in engine.notifications()`: every notification, as it arrives.
///
/// A cancelled `__anext__` (`asyncio.wait_for` running out) loses nothing: its wait stops, and a
/// notification it had already taken is handed to the next call.
#[pyclass(module = "ferry._ferry", frozen)]
pub struct NotificationStream {
    stream: Arc<tokio::sync::Mutex<BoxStream<'static, ferry::ReceivedNotification>>>,
    returned: Arc<Mutex<VecDeque<ferry::ReceivedNotification>>>,
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
                s = stream.lock() => s,
                _ = cancelled.notified() => return Outcome::None,
            };
            let earlier = returned.lock().ok().and_then(|mut r| r.pop_front());
            if let Some(n) = earlier {
                return Outcome::Notification(n, returned);
            }
            // The stream keeps a wait in progress inside itself, so stopping this one loses nothing.
            tokio::select! {
                n = stream.next() => match n {
                    Some(n) => Outcome::Notification(n, returned),
                    None => Outcome::StopIteration,
                },
                _ = cancelled.notified() => Outcome::None,
            }
        })
    }
}
