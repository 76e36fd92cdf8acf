//! The engine's shared state ([`Inner`]) and what acts on it below the facade: removing and
//! regranting regions, the state a metrics scrape reads, and the bounds on deregistration and
//! revokes. `engine`, `region` and `metrics` reach it from above; it reaches none of them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::{EngineContext, Error, RegionEntry, RegionKey, Result, Transport, TransportKind};
use ferry_tcp::{CoalescePool, TcpServer};

use crate::builder::EngineBuilder;
use crate::metrics::{EngineState, StateSource};
use crate::notify::NotificationQueue;
use crate::peer::Peer;

/// The engine's state, shared by its handles ([`Engine`](crate::Engine) clones), its regions (which
/// reach back to deregister themselves) and its metrics collector (which reads it at each scrape).
pub(crate) struct Inner {
    pub(crate) ctx: Arc<EngineContext>,
    pub(crate) server: Option<TcpServer>,
    pub(crate) transports: Vec<Arc<dyn Transport>>,
    /// Transports compiled in that this engine does not use, and why (not usable here, or left out
    /// by its options): what a path policy that requires one of them reports.
    pub(crate) unavailable: Vec<(TransportKind, String)>,
    pub(crate) peers: Mutex<HashMap<SocketAddr, Peer>>,
    pub(crate) notifications: Arc<NotificationQueue>,
    pub(crate) pool: Option<Arc<CoalescePool>>,
    pub(crate) options: EngineBuilder,
    /// Serializes revokes (see [`Inner::regrant`]).
    pub(crate) revoking: tokio::sync::Mutex<()>,
}

/// How long deregistration waits for the accesses to a region still in progress once its access
/// guard closed: CPU copies and non-blocking system calls (microseconds), staged GPU copies and
/// `msync`s (milliseconds to seconds), NIC work requests (ended by the RDMA transport within its drain
/// bound before this wait starts). Past it, [`Region::deregister`](crate::Region::deregister) fails with `Timeout` and `Drop`
/// logs an error and returns.
pub const DEREGISTER_LIMIT: Duration = Duration::from_secs(5);

/// Runs `wait`, a blocking step of the sync deregistration (`Region`'s `Drop`), without holding up
/// the other tasks of the runtime whose worker calls it: on a worker of a multi-threaded tokio runtime
/// it runs under [`tokio::task::block_in_place`], which first hands the worker's tasks to another
/// thread. Those tasks may be what the wait is for: a peer in this process that must give back its
/// mapping of the region runs on the same runtime, and on a runtime of one worker (a container
/// limited to one CPU) a wait that held the worker would last all of [`DEREGISTER_LIMIT`] and end
/// with the mapping still in place. A current-thread runtime has no other thread to hand its tasks
/// to: [`wait_for_dropped`] says what happens there.
pub(crate) fn off_the_workers<R>(wait: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        // Also fine on a thread of the runtime that is not a worker (`block_on`, a blocking thread):
        // `block_in_place` then runs `wait` as it is.
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(wait),
        _ => wait(),
    }
}

/// How long [`Region::revoke`](crate::Region::revoke) waits for the peers' links to have sent the
/// removal and for the operations that passed the old grant to end.
pub const REVOKE_LIMIT: Duration = Duration::from_secs(5);

/// How long a revoke lets an operation that passed the old grant end by itself before it closes the
/// link that carries it (a peer that sends a write's payload slowly would otherwise keep landing
/// bytes after the revoke).
pub const REVOKE_GRACE: Duration = Duration::from_secs(1);

impl Inner {
    /// Whether links are authenticated, and so whether regions have grants.
    pub(crate) fn authenticates(&self) -> bool {
        self.options.tls.is_some()
    }

    /// Changes `entry`'s grants and tells the peers whose view of it changed. A revoke (`waits`), or a
    /// grant that narrows, then waits, at most [`REVOKE_LIMIT`], until those peers' links sent the
    /// change, the operations they began before it ended, and same-host peers gave back their
    /// mappings. Only the links whose peer lost access count: a revoke waits for nobody else's
    /// operations. An operation under the old grant that has not ended after [`REVOKE_GRACE`] has its
    /// link closed, so that no byte of it lands after the revoke returns.
    pub(crate) async fn regrant(
        &self,
        entry: &RegionEntry,
        change: impl FnOnce(&mut ferry_core::Grants),
        waits: bool,
    ) -> Result<()> {
        if !self.authenticates() {
            return Err(Error::InvalidArgument(
                "this engine does not authenticate its links, so every peer reaches every region: grants \
                 need EngineBuilder::tls"
                    .into(),
            ));
        }
        // Changes are made one at a time, so that whether one narrows is judged against the last.
        let _one_at_a_time = self.revoking.lock().await;
        let mut before = ferry_core::Grants::default();
        let mut narrows = false;
        entry.update_grants(|grants| {
            before = grants.clone();
            change(grants);
            narrows = before.narrowed_by(grants);
        })?;
        if !waits && !narrows {
            if let Some(server) = &self.server {
                server.regranted(entry.key(), &before);
            }
            return Ok(());
        }
        let narrowed = self
            .server
            .as_ref()
            .map(|s| s.narrowed_links(entry, &before))
            .unwrap_or_default();
        let epochs = narrowed
            .iter()
            .map(|link| {
                link.accesses()
                    .advance()
                    .ok_or_else(|| Error::Internal("two revokes advanced a link's access epoch at once".into()))
            })
            .collect::<Result<Vec<_>>>()?;
        let sent = self.server.as_ref().map(|s| s.regranted(entry.key(), &before));
        let lent_back = futures::future::join_all(self.transports.iter().map(|t| t.access_changed(entry.key())));
        let settled = async {
            // First what runs under the old grant (a link busy with it could not send the change
            // before it ends), then the change sent, then mappings given back.
            let grace = tokio::time::Instant::now() + REVOKE_GRACE;
            let mut closed = vec![false; narrowed.len()];
            while !epochs.iter().all(|e| e.settled()) {
                if tokio::time::Instant::now() >= grace {
                    for (i, link) in narrowed.iter().enumerate() {
                        if !closed[i] && !epochs[i].settled() {
                            link.close();
                            closed[i] = true;
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            if let Some(sent) = sent {
                sent.wait().await;
            }
            lent_back.await;
        };
        tokio::time::timeout(REVOKE_LIMIT, settled).await.map_err(|_| {
            Error::Timeout(format!(
                "region {:?}: the revoke holds for every new operation, but after {REVOKE_LIMIT:?} a peer's link \
                 had not yet sent the change, an operation begun before it had not ended though its link was \
                 closed, or a peer of this host had not given back its mapping of the region",
                entry.key()
            ))
        })
    }

    /// Takes the region out of the table, closes its access guard so that no new access starts, and
    /// tells the peers.
    fn unlist_region(&self, key: RegionKey) -> Option<Arc<RegionEntry>> {
        let entry = self.ctx.regions.write().ok().and_then(|mut t| t.remove(key))?;
        entry.guard().close();
        if let Some(server) = &self.server {
            server.announce(&entry, false);
        }
        Some(entry)
    }

    /// Deregisters on the calling thread (`Region::drop`): closes the guard, has every transport end
    /// its accesses (the RDMA transport halts and drains the queue pairs that use the region, within
    /// its drain bound, under [`off_the_workers`]), then waits for the permits still held
    /// ([`wait_for_dropped`]).
    pub(crate) fn remove_region(&self, key: RegionKey) {
        let Some(entry) = self.unlist_region(key) else { return };
        let deregister = || {
            for t in &self.transports {
                t.deregister_region(key);
            }
        };
        if self.transports.iter().any(|t| t.deregister_blocks()) {
            off_the_workers(deregister);
        } else {
            deregister();
        }
        wait_for_dropped(entry);
    }

    /// Deregisters without blocking the runtime: what the sync path does, with the transports whose
    /// deregistration blocks ([`Transport::deregister_blocks`]) run on a blocking thread and the wait
    /// for the permits an await of [`AccessGuard::drained`](ferry_core::AccessGuard::drained).
    ///
    /// Everything before the first await happens when the future is first polled (the table, the
    /// guard, the announcement, and the start of the blocking deregistrations, which run to their end
    /// even if this future is dropped), so a dropped future still leaves the region deregistered.
    pub(crate) async fn remove_region_async(&self, entry: &Arc<RegionEntry>) -> Result<()> {
        let key = entry.key();
        if self.unlist_region(key).is_none() {
            // Gone already (or never listed): only the wait for its accesses is left.
            entry.guard().close();
        }
        let (blocking, inline): (Vec<_>, Vec<_>) = self.transports.iter().cloned().partition(|t| t.deregister_blocks());
        for t in &inline {
            t.deregister_region(key);
        }
        if !blocking.is_empty() {
            tokio::task::spawn_blocking(move || {
                for t in &blocking {
                    t.deregister_region(key);
                }
            })
            .await
            .map_err(|e| Error::Internal(format!("deregistering region {key:?} from a transport panicked: {e}")))?;
        }
        match tokio::time::timeout(DEREGISTER_LIMIT, entry.guard().drained()).await {
            Ok(()) => {
                tracing::debug!(region = ?entry, "deregistered");
                Ok(())
            }
            Err(_) => Err(Error::Timeout(format!(
                "region {key:?}: {} accesses still held {DEREGISTER_LIMIT:?} after its deregistration began",
                entry.guard().held()
            ))),
        }
    }
}

/// The engine's state, for a metrics scrape.
impl StateSource for Inner {
    fn state(&self) -> EngineState {
        let (notifications_received, notifications_queued, notifications_queued_bytes) = self.notifications.counts();
        use std::sync::atomic::Ordering::Relaxed;
        let served = &self.ctx.served;
        let mut state = EngineState {
            served_writes: served.writes.load(Relaxed),
            served_write_bytes: served.write_bytes.load(Relaxed),
            served_reads: served.reads.load(Relaxed),
            served_read_bytes: served.read_bytes.load(Relaxed),
            coalesce_buffers: self.pool.as_ref().map_or(0, |p| p.buffers()),
            coalesce_in_use: self.pool.as_ref().map_or(0, |p| p.in_use()),
            incoming_links: self.ctx.incoming.used(),
            outgoing_links: self.ctx.outgoing.used(),
            max_links: self.ctx.incoming.limit(),
            max_notification_bytes: self.notifications.max_bytes(),
            notifications_received,
            notifications_queued,
            notifications_queued_bytes,
            ..Default::default()
        };
        if let Ok(peers) = self.peers.lock() {
            for kind in [TransportKind::Shm, TransportKind::Rdma, TransportKind::Tcp] {
                let n = peers
                    .values()
                    .filter(|p| !p.is_closed() && p.transport() == kind)
                    .count();
                state.links_by_transport.push((kind.name(), n));
            }
        }
        if let Ok(table) = self.ctx.regions.read() {
            state.regions = table.len();
            state.registered_bytes = table.total_bytes();
            for stats in table.entries().filter_map(|e| e.block().persist_stats()) {
                state.persisted_bytes += stats.bytes;
                state.persist_seconds += stats.nanos as f64 / 1e9;
            }
        }
        state
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let (Some(_), Some(directory)) = (&self.options.name, &self.options.directory) {
            // Withdrawn at once where a runtime runs; otherwise its lease runs out.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let directory = directory.0.clone();
                runtime.spawn(async move {
                    if let Err(e) = directory.withdraw().await {
                        tracing::warn!(error = %e, "withdrawing the engine from its directory");
                    }
                });
            }
        }
        if let Ok(peers) = self.peers.lock() {
            for p in peers.values() {
                p.inner.control.abort();
            }
        }
        if let Some(server) = &self.server {
            server.shutdown();
        }
    }
}

pub(crate) fn poisoned() -> Error {
    Error::Internal("an engine lock was poisoned by a panic".into())
}

/// The last step of a sync deregistration (the guard closed, the transports told): waits for the
/// accesses that still hold `entry`, at most [`DEREGISTER_LIMIT`], under [`off_the_workers`]. On a
/// current-thread runtime, where the accesses' own tasks cannot run while the thread waits, memory
/// that only `entry` holds is instead left to [`keep_until_drained`] at once. Memory the block owns
/// that is still held past the limit is left to it too; the caller's own memory is the caller's.
pub(crate) fn wait_for_dropped(entry: Arc<RegionEntry>) {
    if entry.guard().is_drained() {
        tracing::debug!(region = ?entry, "deregistered");
        return;
    }
    let left_to_a_task = tokio::runtime::Handle::try_current().is_ok_and(|runtime| {
        runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread
            && only_the_region_holds_its_memory(&entry)
    });
    if !left_to_a_task && off_the_workers(|| entry.guard().wait_drained(DEREGISTER_LIMIT)) {
        tracing::debug!(region = ?entry, "deregistered");
        return;
    }
    if left_to_a_task {
        tracing::debug!(region = ?entry, held = entry.guard().held(), "deregistered; its memory is freed once the accesses in progress end");
    } else {
        tracing::error!(
            region = ?entry,
            held = entry.guard().held(),
            "accesses still hold the region {DEREGISTER_LIMIT:?} after its deregistration began; it is dropped \
             anyway. {STUCK_DROP_HINT}"
        );
    }
    if entry.block().owns_memory() {
        keep_until_drained(entry);
    }
}

/// What a log of accesses that outlived [`DEREGISTER_LIMIT`] tells the reader to do.
const STUCK_DROP_HINT: &str = "An access outlived the limit: a GPU copy, an msync, or a peer of this host that kept its \
    mapping of the region. A peer in this process on a current-thread runtime cannot give a mapping back while a drop \
    holds that thread: there, await `Region::deregister` instead of dropping a region whose memory you keep.";

/// Whether no one but `entry` can reach its memory: the block [owns it](ferry_core::MemoryBlock::owns_memory)
/// and is held by the entry alone (no caller kept the `Arc` given to `register_block`; the engine
/// never hands a block out).
fn only_the_region_holds_its_memory(entry: &RegionEntry) -> bool {
    let block = entry.block();
    block.owns_memory() && Arc::strong_count(block) == 1 && Arc::weak_count(block) == 0
}

/// Keeps memory that `entry`'s block owns from being freed while accesses still hold it (a peer's
/// copy into it, a staged copy): a task of the current runtime frees it once they end, waiting at
/// most [`DEREGISTER_LIMIT`]. Memory still held past that, or when no runtime runs (or it ends
/// first), is leaked, never freed under them ([`FreedOnlyDrained`]).
pub(crate) fn keep_until_drained(entry: Arc<RegionEntry>) {
    let kept = FreedOnlyDrained(entry);
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            let _ = tokio::time::timeout(DEREGISTER_LIMIT, kept.0.guard().drained()).await;
            drop(kept);
        });
    }
}

/// A deregistered region's entry whose memory is freed when this drops only if no access holds it
/// any more, and leaked otherwise.
struct FreedOnlyDrained(Arc<RegionEntry>);

impl Drop for FreedOnlyDrained {
    fn drop(&mut self) {
        if self.0.guard().is_drained() {
            tracing::debug!(region = ?self.0, "the accesses to a deregistered region ended; its memory is freed");
            return;
        }
        tracing::error!(
            region = ?self.0,
            held = self.0.guard().held(),
            "accesses still hold a deregistered region; its memory is leaked rather than freed under them. \
             {STUCK_DROP_HINT}"
        );
        std::mem::forget(self.0.clone());
    }
}
