//! Coroutines for asyncio whose work runs on tokio, without the GIL on tokio's side.
//!
//! A call returns an `asyncio.Future` of the caller's running loop and spawns the work on the
//! runtime. The tokio task never touches Python: it pushes `(token, outcome)` onto the loop's
//! completion queue and, if the queue was not already signalled, writes the loop's eventfd. The
//! loop watches that eventfd (`loop.add_reader`), and its callback, on the loop's own thread with
//! the GIL, drains every completion at once and resolves the futures. Under load one wake-up
//! resolves many transfers; no tokio worker ever waits for the GIL; no Python object is made or
//! dropped off the loop's thread.
//!
//! A transfer, awaited at once by its caller, first runs on the loop's thread while the loop has
//! nothing else to do ([`spawn_after_spin`]): a small one finishes there within the spin, and its
//! future is returned resolved, with neither a tokio worker nor the loop's thread woken for it.
//!
//! (pyo3-async-runtimes' `future_into_py` does the opposite: each completion takes the GIL on a
//! tokio worker to call `loop.call_soon_threadsafe`. On a 2-core machine that put the p50 of a
//! 64-byte write's awaited round trip at 143 µs, and 1 MiB writes, 8 in flight, at 0.58× the
//! throughput of the same writes from Rust; through this bridge, 84 µs and 0.94×.)

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyRuntimeError, PyStopAsyncIteration};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyWeakrefMethods, PyWeakrefReference};

use crate::errors;
use crate::notify::{Notification, TakenNotification};
use crate::peer::Peer;
use crate::runtime::runtime;

/// What a coroutine's work produced, converted to Python on the loop's thread.
pub enum Outcome {
    None,
    /// An object the caller already had (`async with engine`): moved through, never touched.
    Object(Py<PyAny>),
    Peer(ferry::Peer),
    /// A notification, which goes back to its stream if dropped undelivered.
    Notification(TakenNotification),
    /// A value given to Python as `json.loads` makes it (a directory record: a dict).
    Json(serde_json::Value),
    /// The end of an async iterator.
    StopIteration,
    Err(ferry::Error),
}

impl From<ferry::Result<()>> for Outcome {
    fn from(r: ferry::Result<()>) -> Self {
        match r {
            Ok(()) => Outcome::None,
            Err(e) => Outcome::Err(e),
        }
    }
}

impl Outcome {
    fn into_py(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match self {
            Outcome::None => Ok(py.None()),
            Outcome::Object(o) => Ok(o),
            Outcome::Peer(p) => Ok(Py::new(py, Peer::new(p))?.into_any()),
            Outcome::Notification(taken) => {
                let value = match taken.notification() {
                    Some(n) => Py::new(py, Notification::from(n))?.into_any(),
                    None => py.None(),
                };
                // Only `deliver` converts an outcome, for a future it has just seen pending, on the
                // loop's thread: `set_result` cannot then fail, so the notification is the future's.
                taken.delivered();
                Ok(value)
            }
            Outcome::Json(value) => Ok(py.import("json")?.call_method1("loads", (value.to_string(),))?.unbind()),
            Outcome::StopIteration => Err(PyStopAsyncIteration::new_err(())),
            Outcome::Err(e) => Err(errors::to_py(py, e)),
        }
    }
}

/// The part tokio's tasks share: the completion queue and the eventfd that signals it.
struct Completions {
    queue: Mutex<Vec<(u64, Outcome)>>,
    signalled: AtomicBool,
    eventfd: OwnedFd,
}

impl Completions {
    fn complete(&self, token: u64, outcome: Outcome) {
        match self.queue.lock() {
            Ok(mut queue) => queue.push((token, outcome)),
            // A panic while the queue was held: the future never resolves, and the log says why.
            Err(_) => {
                tracing::error!("the completion queue's lock is poisoned; a Python future is lost");
                return;
            }
        }
        // After the push: a drain that resets `signalled` before taking the queue sees this item,
        // or a later reset lets this write wake it again.
        if !self.signalled.swap(true, Ordering::AcqRel) {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to an eventfd this struct owns.
            let written = unsafe { libc::write(self.eventfd.as_raw_fd(), (&raw const one).cast(), 8) };
            if written != 8 {
                tracing::error!(
                    error = %std::io::Error::last_os_error(),
                    "cannot signal the event loop; awaiting coroutines may hang"
                );
            }
        }
    }
}

/// One event loop's end of the bridge: its futures by token, and the reader it registered.
#[pyclass(module = "ferry._ferry", frozen, weakref)]
pub struct LoopBridge {
    completions: Arc<Completions>,
    pending: Mutex<HashMap<u64, Py<PyAny>>>,
    next_token: AtomicU64,
}

#[pymethods]
impl LoopBridge {
    /// The loop's reader callback: resolves every completed future.
    fn _drain(&self, py: Python<'_>) -> PyResult<()> {
        let mut counter = 0u64;
        // SAFETY: reads 8 bytes into a live u64 from an eventfd this bridge owns; the eventfd is
        // non-blocking, so a spurious wake-up returns EAGAIN.
        let _ = unsafe { libc::read(self.completions.eventfd.as_raw_fd(), (&raw mut counter).cast(), 8) };
        self.completions.signalled.store(false, Ordering::Release);
        let done = match self.completions.queue.lock() {
            Ok(mut queue) => std::mem::take(&mut *queue),
            Err(_) => return Err(errors::internal(py, "the completion queue's lock is poisoned".into())),
        };
        // Every completion of the batch is delivered even if one delivery fails (the loop closed
        // under a future, say): the first such error is raised after, to the loop's handler.
        let mut first_error = None;
        for (token, outcome) in done {
            let future = match self.pending.lock() {
                Ok(mut pending) => pending.remove(&token),
                Err(_) => None,
            };
            let Some(future) = future else { continue };
            if let Err(e) = deliver(future.bind(py), outcome) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// Resolves `future` with `outcome`, unless it is already done.
fn deliver(future: &Bound<'_, PyAny>, outcome: Outcome) -> PyResult<()> {
    let py = future.py();
    // Cancelled meanwhile (`asyncio.wait_for`, a cancelled task): the work finished anyway, and
    // dropping its outcome puts a notification taken for nobody back at the front of its stream.
    if future.call_method0(intern!(py, "done"))?.is_truthy()? {
        return Ok(());
    }
    match outcome.into_py(py) {
        Ok(value) => future.call_method1(intern!(py, "set_result"), (value,))?,
        Err(e) => future.call_method1(intern!(py, "set_exception"), (e.into_value(py),))?,
    };
    Ok(())
}

thread_local! {
    /// The loop this thread last ran ferry coroutines on (held, so that a new loop cannot take its
    /// address and be mistaken for it), and a weak reference to its bridge. The loop's reader
    /// callback is what keeps the bridge alive: closing the loop frees it, and with it the outcomes
    /// it never delivered (a notification among them goes back to its stream), whichever thread
    /// runs ferry coroutines next.
    static CURRENT: RefCell<Option<(Py<PyAny>, Py<PyWeakrefReference>)>> = const { RefCell::new(None) };
}

static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

fn bridge_for(py: Python<'_>, event_loop: &Bound<'_, PyAny>) -> PyResult<Py<LoopBridge>> {
    let cached = CURRENT.with(|c| {
        c.borrow()
            .as_ref()
            .filter(|(l, _)| l.bind(py).is(event_loop))
            .and_then(|(_, b)| b.bind(py).upgrade_as::<LoopBridge>().ok().flatten())
    });
    if let Some(bridge) = cached {
        return Ok(bridge.unbind());
    }
    // SAFETY: eventfd(2) with valid flags; the result is checked before use.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(errors::to_py(
            py,
            ferry::Error::Io {
                kind: std::io::Error::last_os_error().kind(),
                message: format!("creating the event loop's eventfd: {}", std::io::Error::last_os_error()),
            },
        ));
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    let eventfd = unsafe { OwnedFd::from_raw_fd(fd) };
    let bridge = Py::new(
        py,
        LoopBridge {
            completions: Arc::new(Completions {
                queue: Mutex::new(Vec::new()),
                signalled: AtomicBool::new(false),
                eventfd,
            }),
            pending: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(0),
        },
    )?;
    event_loop.call_method1("add_reader", (fd, bridge.getattr(py, "_drain")?))?;
    let weak = PyWeakrefReference::new(bridge.bind(py).as_any())?.unbind();
    CURRENT.with(|c| *c.borrow_mut() = Some((event_loop.clone().unbind(), weak)));
    Ok(bridge)
}

/// The future's done-callback that tells the work it was cancelled.
#[pyclass(module = "ferry._ferry", frozen)]
struct CancelOnDone {
    cancelled: Arc<tokio::sync::Notify>,
}

#[pymethods]
impl CancelOnDone {
    fn __call__(&self, future: &Bound<'_, PyAny>) -> PyResult<()> {
        if future.call_method0(intern!(future.py(), "cancelled"))?.is_truthy()? {
            // A stored permit: the work sees it even if it starts waiting only later.
            self.cancelled.notify_one();
        }
        Ok(())
    }
}

/// [`spawn`] for work that should stop when the Python future is cancelled: `work` gets a
/// [`Notify`](tokio::sync::Notify) that fires then, and should finish promptly with any outcome
/// (it is discarded) without losing what it holds.
pub fn spawn_cancellable<'py, W, F>(py: Python<'py>, work: W) -> PyResult<Bound<'py, PyAny>>
where
    W: FnOnce(Arc<tokio::sync::Notify>) -> F,
    F: Future<Output = Outcome> + Send + 'static,
{
    let cancelled = Arc::new(tokio::sync::Notify::new());
    let future = spawn(py, work(cancelled.clone()))?;
    future.call_method1(intern!(py, "add_done_callback"), (CancelOnDone { cancelled },))?;
    Ok(future)
}

/// Runs `work` on the runtime and returns an `asyncio.Future` of the running loop that resolves
/// with its outcome. Fails with `RuntimeError` outside a running loop, as asyncio's own calls do.
/// Cancelling the future does not stop the work: it completes, and its outcome is dropped.
pub fn spawn<'py, F>(py: Python<'py>, work: F) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = Outcome> + Send + 'static,
{
    let event_loop = running_loop(py)?;
    let bridge = bridge_for(py, &event_loop)?;
    spawn_on(&event_loop, bridge.get(), work)
}

/// [`spawn`] for a short piece of work its caller awaits at once (a transfer): while the loop has
/// nothing else to run and no other work of this bridge is out, the work first runs here, the GIL
/// released, for up to [`SPIN`](ferry::blocking::SPIN), and a transfer done by then returns a future
/// already resolved: no tokio worker is woken to start it and the loop's thread is not woken to end
/// it, the two thread wake-ups that made most of a small awaited transfer's round trip. Work still
/// pending after that (a large transfer), or started while the loop is busy, goes on as [`spawn`]'s.
pub fn spawn_after_spin<'py, F>(py: Python<'py>, work: F) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = Outcome> + Send + 'static,
{
    let event_loop = running_loop(py)?;
    let bridge = bridge_for(py, &event_loop)?;
    let mut work = Box::pin(work);
    if loop_is_idle(&event_loop, bridge.get())? {
        let polled = py.detach(|| ferry::blocking::poll_for(runtime(), work.as_mut(), ferry::blocking::SPIN));
        if let std::task::Poll::Ready(outcome) = polled {
            let future = event_loop.call_method0(intern!(py, "create_future"))?;
            deliver(&future, outcome)?;
            return Ok(future);
        }
    }
    spawn_on(&event_loop, bridge.get(), work)
}

/// True when nothing but this call waits on the loop: no other work of `bridge` is out, and the
/// loop has no callback ready to run (asyncio's own loops keep them in `_ready`; a loop without it,
/// such as uvloop, is taken as busy, and its work is spawned at once).
fn loop_is_idle(event_loop: &Bound<'_, PyAny>, bridge: &LoopBridge) -> PyResult<bool> {
    let py = event_loop.py();
    let nothing_out = bridge
        .pending
        .lock()
        .map_err(|_| errors::internal(py, "the pending futures' lock is poisoned".into()))?
        .is_empty();
    if !nothing_out {
        return Ok(false);
    }
    match event_loop.getattr_opt(intern!(py, "_ready"))? {
        Some(ready) => Ok(ready.len()? == 0),
        None => Ok(false),
    }
}

/// The caller's running loop, or asyncio's own `RuntimeError` outside one.
fn running_loop(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let get_running_loop = GET_RUNNING_LOOP.get_or_try_init(py, || {
        py.import("asyncio")?.getattr("get_running_loop").map(Bound::unbind)
    })?;
    get_running_loop
        .bind(py)
        .call0()
        .map_err(|_| PyRuntimeError::new_err("ferry's coroutines need a running asyncio event loop (use asyncio.run)"))
}

/// [`spawn`] on a loop and bridge at hand.
fn spawn_on<'py, F>(event_loop: &Bound<'py, PyAny>, bridge: &LoopBridge, work: F) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = Outcome> + Send + 'static,
{
    let py = event_loop.py();
    let future = event_loop.call_method0(intern!(py, "create_future"))?;
    let token = bridge.next_token.fetch_add(1, Ordering::Relaxed);
    bridge
        .pending
        .lock()
        .map_err(|_| errors::internal(py, "the pending futures' lock is poisoned".into()))?
        .insert(token, future.clone().unbind());
    let completions = bridge.completions.clone();
    runtime().spawn(async move {
        let outcome = work.await;
        completions.complete(token, outcome);
    });
    Ok(future)
}
