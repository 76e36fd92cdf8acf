//! The notification queue: what peers sent with `notify`, until the application drains it.
//!
//! HIXL's limits hold per link: at most 4096 notifications wait undrained; the next one is refused with
//! `ResourceExhausted`, which the sender receives as the result of its `notify`. A per-link count alone
//! does not bound memory (a peer connects, fills its link's share, disconnects and starts again), so
//! the queue also holds at most a number of bytes in all, and a closed link's notifications count
//! against it until they are taken. On an authenticated engine each peer identity may hold only a share
//! of those bytes, so that one peer filling the queue does not refuse everyone else's notifications.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use ferry_core::{Error, Notification, Notifier, PeerIdentity, ReceivedNotification, Result};
use futures::StreamExt;
use futures::stream::BoxStream;

#[derive(Default)]
struct State {
    items: VecDeque<(u64, ReceivedNotification)>,
    per_link: HashMap<u64, usize>,
    /// What the queued notifications weigh in all (see [`weight`]).
    bytes: usize,
    /// What those of each authenticated peer identity weigh.
    per_identity: HashMap<String, usize>,
}

impl State {
    /// Takes `n`'s weight off the totals.
    fn forget(&mut self, n: &ReceivedNotification) {
        let w = weight(n);
        self.bytes -= w;
        if let Some(who) = &n.from_identity
            && let Some(held) = self.per_identity.get_mut(&who.name)
        {
            *held -= w;
            if *held == 0 {
                self.per_identity.remove(&who.name);
            }
        }
    }
}

/// Notifications received and not yet taken.
pub(crate) struct NotificationQueue {
    state: Mutex<State>,
    /// Notifications queued since the engine started.
    received: std::sync::atomic::AtomicU64,
    wake: tokio::sync::Notify,
    max_per_link: usize,
    max_bytes: usize,
    max_bytes_per_identity: usize,
}

/// What a queued notification costs: its text and the sender's names, and the queue entry around
/// them.
fn weight(n: &ReceivedNotification) -> usize {
    let identity = n.from_identity.as_ref().map_or(0, |i| {
        i.name.len() + i.subject.len() + i.alt_names.iter().map(String::len).sum::<usize>()
    });
    std::mem::size_of::<(u64, ReceivedNotification)>()
        + n.notification.name.len()
        + n.notification.msg.len()
        + n.from_addr.len()
        + identity
}

impl NotificationQueue {
    pub(crate) fn new(max_per_link: usize, max_bytes: usize, max_bytes_per_identity: usize) -> Arc<Self> {
        Arc::new(NotificationQueue {
            state: Mutex::default(),
            received: Default::default(),
            wake: tokio::sync::Notify::new(),
            max_per_link,
            max_bytes,
            max_bytes_per_identity,
        })
    }

    fn pop(&self) -> Option<ReceivedNotification> {
        let mut s = self.state.lock().ok()?;
        let (link, n) = s.items.pop_front()?;
        if let Some(c) = s.per_link.get_mut(&link) {
            *c -= 1;
        }
        s.forget(&n);
        Some(n)
    }

    /// Notifications queued since the start, waiting now, and what the waiting ones weigh.
    pub(crate) fn counts(&self) -> (u64, usize, usize) {
        let (queued, bytes) = self.state.lock().map(|s| (s.items.len(), s.bytes)).unwrap_or((0, 0));
        (self.received.load(std::sync::atomic::Ordering::Relaxed), queued, bytes)
    }

    /// The byte budget of waiting notifications.
    pub(crate) fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    fn has_items(&self) -> bool {
        self.state.lock().map(|s| !s.items.is_empty()).unwrap_or(false)
    }

    pub(crate) fn take_all(&self) -> Vec<ReceivedNotification> {
        match self.state.lock() {
            Ok(mut s) => {
                s.per_link.values_mut().for_each(|c| *c = 0);
                s.bytes = 0;
                s.per_identity.clear();
                s.items.drain(..).map(|(_, n)| n).collect()
            }
            Err(_) => Vec::new(),
        }
    }

    pub(crate) fn stream(self: &Arc<Self>) -> BoxStream<'static, ReceivedNotification> {
        futures::stream::unfold(self.clone(), |q| async move {
            loop {
                {
                    let notified = q.wake.notified();
                    tokio::pin!(notified);
                    notified.as_mut().enable();
                    if !q.has_items() {
                        notified.await;
                        continue;
                    }
                }
                if let Some(n) = q.pop() {
                    return Some((n, q));
                }
            }
        })
        .boxed()
    }
}

impl Notifier for NotificationQueue {
    fn deliver(
        &self,
        link: u64,
        from_engine: u64,
        from_addr: &str,
        from_identity: Option<&PeerIdentity>,
        notification: Notification,
    ) -> Result<()> {
        let mut s = self
            .state
            .lock()
            .map_err(|_| Error::Internal("notification queue lock poisoned".into()))?;
        let received = ReceivedNotification {
            from_engine,
            from_addr: from_addr.to_string(),
            from_identity: from_identity.cloned(),
            notification,
        };
        let weight = weight(&received);
        if s.bytes + weight > self.max_bytes {
            return Err(Error::ResourceExhausted(format!(
                "notifications waiting undrained hold {} bytes, the engine's limit \
                 (EngineBuilder::max_notification_bytes); the receiver must take them first",
                s.bytes
            )));
        }
        let sender = received.from_identity.as_ref().map(|who| who.name.as_str());
        let held = sender.map_or(0, |who| s.per_identity.get(who).copied().unwrap_or(0));
        if let Some(who) = sender
            && held + weight > self.max_bytes_per_identity
        {
            return Err(Error::ResourceExhausted(format!(
                "notifications from {who} waiting undrained hold {held} bytes, the most one peer may \
                 (EngineBuilder::max_notification_bytes_per_peer); the receiver must take them first"
            )));
        }
        let pending = s.per_link.entry(link).or_default();
        if *pending >= self.max_per_link {
            return Err(Error::ResourceExhausted(format!(
                "{} notifications from this link wait undrained, the maximum; the receiver must take them first",
                self.max_per_link
            )));
        }
        *pending += 1;
        s.bytes += weight;
        if let Some(who) = sender {
            *s.per_identity.entry(who.to_string()).or_default() += weight;
        }
        s.items.push_back((link, received));
        drop(s);
        self.received.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.wake.notify_waiters();
        Ok(())
    }

    fn link_closed(&self, link: u64) {
        if let Ok(mut s) = self.state.lock() {
            s.per_link.remove(&link);
        }
    }
}
