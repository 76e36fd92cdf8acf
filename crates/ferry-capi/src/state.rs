//! The tables behind the handles: engines, and per engine its links (by the remote's name as the
//! caller gave it), registrations and transfer requests.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use ferry::{Engine, Peer, ReceivedNotification, Region, TransferHandle};

use crate::{Failure, ferry_status};

/// One engine and what it owns. Its runtime runs the engine's tasks; calls from C block on it.
pub(crate) struct EngineState {
    pub runtime: tokio::runtime::Runtime,
    pub engine: Engine,
    pub peers: Mutex<HashMap<String, Peer>>,
    pub regions: Mutex<HashMap<u64, Registration>>,
    pub requests: Mutex<HashMap<u64, TransferHandle>>,
    /// Notifications taken from the engine that did not fit the caller's array yet.
    pub notifications: Mutex<VecDeque<ReceivedNotification>>,
}

/// A registration, and whether the library allocated its memory (`ferry_alloc_host`).
pub(crate) struct Registration {
    pub region: Region,
    pub allocated: bool,
}

static NEXT_HANDLE: AtomicU64 = AtomicU64::new(1);
static ENGINES: LazyLock<Mutex<HashMap<u64, Arc<EngineState>>>> = LazyLock::new(Default::default);

/// A handle never issued before in this process (0 is never one).
pub(crate) fn new_handle() -> u64 {
    NEXT_HANDLE.fetch_add(1, Ordering::Relaxed)
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>, Failure> {
    m.lock().map_err(|_| {
        Failure(
            ferry_status::FERRY_INTERNAL,
            "a table lock was poisoned by an earlier panic".into(),
        )
    })
}

pub(crate) fn insert_engine(state: EngineState) -> Result<u64, Failure> {
    let handle = new_handle();
    lock(&ENGINES)?.insert(handle, Arc::new(state));
    Ok(handle)
}

/// The engine `handle` names.
pub(crate) fn engine(handle: u64) -> Result<Arc<EngineState>, Failure> {
    lock(&ENGINES)?.get(&handle).cloned().ok_or_else(|| no_engine(handle))
}

/// Takes the engine `handle` names out of the table: later calls with it are refused.
pub(crate) fn remove_engine(handle: u64) -> Result<Arc<EngineState>, Failure> {
    lock(&ENGINES)?.remove(&handle).ok_or_else(|| no_engine(handle))
}

fn no_engine(handle: u64) -> Failure {
    Failure(
        ferry_status::FERRY_INVALID_HANDLE,
        format!("engine handle {handle} names no engine (never created, or destroyed already)"),
    )
}

impl EngineState {
    /// The link to `remote`, by the name it was connected under.
    pub fn peer(&self, remote: &str) -> Result<Peer, Failure> {
        lock(&self.peers)?.get(remote).cloned().ok_or_else(|| {
            Failure(
                ferry_status::FERRY_NOT_CONNECTED,
                format!("no link to {remote}: call ferry_connect first"),
            )
        })
    }
}
