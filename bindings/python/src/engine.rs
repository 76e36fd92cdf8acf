//! `ferry.Engine`: the engine contract with Python conventions. Coroutines for what waits on the
//! network, plain calls for what does not, blocking variants (`transfer_blocking`) for threads.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use pyo3::prelude::*;

use crate::bridge::{self, Outcome};
use crate::descs;
use crate::errors::{self, IntoPyResult};
use crate::notify::{Notification, NotificationStream};
use crate::peer::Peer;
use crate::region::{Owner, Region, Registered};
use crate::runtime::{durability, op, runtime, seconds};
use crate::transfer::{self, PreparedTransfer, TransferHandle};

/// A transfer engine (HIXL `Initialize`): it listens on `listen` ("host:port"; port 0 picks one)
/// when given, registers memory, connects to peers and moves bytes between its memory and theirs.
///
/// `buffer_pool` ("BUFFER_NUM:BUFFER_SIZE_MB", "0:0" for none) is the coalescing pool small
/// descriptors are coalesced through; `transports` ("tcp", "shm", "rdma") restricts the data paths
/// offered to peers, best first; `streams` is the TCP streams per link. With `name` and `directory`
/// ("etcd://HOST:PORT[,HOST:PORT...]", "etcds://" for TLS; in builds with the `etcd` feature) the
/// engine publishes itself under `name` in that directory, below `directory_prefix` ("/ferry", as
/// `ferry serve` uses, when not given), on a lease of
/// `directory_ttl` seconds, and `connect_by_name` finds others there. `path_policy` ("any", the
/// default, or transports such as "rdma" or "shm,rdma") is which data paths its links may take: a
/// link that can take none of them fails at `connect` instead of falling back. With `integrity=True`
/// every transfer checks its bytes end to end (CRC32C at the source, and at the destination after
/// they landed) and fails with `ferry.Integrity` (retryable) when they differ. With
/// `stage_gpu_memory=False` a transfer that would move GPU memory through a host copy fails with
/// `ferry.Unsupported` instead. Close it with `close()` or
/// use it as a context manager (plain or `async with`).
#[pyclass(module = "ferry._ferry", frozen)]
pub struct Engine {
    engine: RwLock<Option<ferry::Engine>>,
    regions: Mutex<HashMap<u64, Registered>>,
}

impl Engine {
    /// The engine, or `InvalidArgument` once closed.
    fn live(&self, py: Python<'_>) -> PyResult<ferry::Engine> {
        let guard = self
            .engine
            .read()
            .map_err(|_| errors::internal(py, "the engine's lock is poisoned".into()))?;
        guard
            .clone()
            .ok_or_else(|| errors::invalid(py, "the engine is closed".into()))
    }

    fn table(&self, py: Python<'_>) -> PyResult<MutexGuard<'_, HashMap<u64, Registered>>> {
        self.regions
            .lock()
            .map_err(|_| errors::internal(py, "the region table's lock is poisoned".into()))
    }

    /// Runs `f` on the region registered at `addr`.
    pub fn with_region<T>(
        &self,
        py: Python<'_>,
        addr: u64,
        f: impl FnOnce(&ferry::Region) -> PyResult<T>,
    ) -> PyResult<T> {
        let table = self.table(py)?;
        match table.get(&addr) {
            Some(registered) => f(&registered.region),
            None => Err(errors::to_py(
                py,
                ferry::Error::InvalidArgument(format!(
                    "no region is registered at {addr:#x} (deregistered, or the engine was closed)"
                )),
            )),
        }
    }

    /// Deregisters the region at `addr`: the region first, without the GIL (it waits for
    /// operations in flight on it), then whatever kept its memory alive.
    pub fn deregister_addr(&self, py: Python<'_>, addr: u64) -> PyResult<()> {
        let removed = self.table(py)?.remove(&addr);
        let Some(Registered { region, owner }) = removed else {
            return Err(errors::invalid(
                py,
                format!("no region is registered at {addr:#x} (already deregistered?)"),
            ));
        };
        let _rt = runtime().enter();
        py.detach(move || drop(region));
        drop(owner);
        Ok(())
    }

    fn insert(slf: &Bound<'_, Self>, region: ferry::Region, owner: Owner) -> PyResult<Region> {
        let py = slf.py();
        let handle = Region::new(slf.clone().unbind(), &region);
        slf.get().table(py)?.insert(region.addr(), Registered { region, owner });
        Ok(handle)
    }

    /// Deregisters everything and drops the engine: its links close and its listener stops.
    fn shutdown(&self, py: Python<'_>) {
        let engine = self.engine.write().ok().and_then(|mut e| e.take());
        let regions: Vec<Registered> = match self.regions.lock() {
            Ok(mut table) => table.drain().map(|(_, r)| r).collect(),
            Err(_) => Vec::new(),
        };
        let _rt = runtime().enter();
        let owners = py.detach(move || {
            let owners: Vec<Owner> = regions
                .into_iter()
                .map(|Registered { region, owner }| {
                    drop(region);
                    owner
                })
                .collect();
            drop(engine);
            owners
        });
        drop(owners);
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        Python::attach(|py| self.shutdown(py));
    }
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (
        listen = None, *, buffer_pool = None, transports = None, streams = None, max_links = None,
        max_inflight_bytes = None, max_pending_notifications = None, name = None,
        tls_cert = None, tls_key = None, tls_ca = None, tls_psk = None, tls_name = None,
        tls_server_name = None, encrypt = false, data_protection = None, directory = None,
        directory_prefix = None, directory_ttl = 10.0, path_policy = None, integrity = false,
        stage_gpu_memory = true,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: Option<String>,
        buffer_pool: Option<String>,
        transports: Option<Vec<String>>,
        streams: Option<usize>,
        max_links: Option<usize>,
        max_inflight_bytes: Option<u64>,
        max_pending_notifications: Option<usize>,
        name: Option<String>,
        tls_cert: Option<std::path::PathBuf>,
        tls_key: Option<std::path::PathBuf>,
        tls_ca: Option<std::path::PathBuf>,
        tls_psk: Option<Vec<u8>>,
        tls_name: Option<String>,
        tls_server_name: Option<String>,
        encrypt: bool,
        data_protection: Option<String>,
        directory: Option<String>,
        directory_prefix: Option<String>,
        directory_ttl: f64,
        path_policy: Option<String>,
        integrity: bool,
        stage_gpu_memory: bool,
    ) -> PyResult<Self> {
        let mut builder = ferry::Engine::builder()
            .integrity(integrity)
            .stage_gpu_memory(stage_gpu_memory);
        let protection = match (data_protection, encrypt) {
            (Some(_), true) => {
                return Err(errors::invalid(
                    py,
                    "give encrypt=True or data_protection, not both".into(),
                ));
            }
            (Some(p), false) => Some(p.parse::<ferry::DataProtection>().map_err(|e| errors::invalid(py, e))?),
            (None, true) => Some(ferry::DataProtection::Encrypted),
            (None, false) => None,
        };
        let tls = tls_config(
            py,
            (tls_cert, tls_key, tls_ca),
            (tls_psk, tls_name),
            tls_server_name,
            protection,
        )?;
        if let Some(addr) = &listen {
            if tls.is_none() {
                let warning = py.get_type::<pyo3::exceptions::PyUserWarning>();
                let message = std::ffi::CString::new(format!(
                    "ferry.Engine listening on {addr} without TLS is open: anyone who reaches the port \
                     learns its regions, reads and writes all of them, and sends notifications under any \
                     name; give tls_cert/tls_key/tls_ca or tls_psk/tls_name on a network not wholly trusted"
                ))
                .map_err(|e| errors::invalid(py, e.to_string()))?;
                PyErr::warn(py, &warning, &message, 1)?;
            }
            builder = builder.listen(addr.clone());
        }
        if let Some(config) = tls {
            builder = builder.tls(config);
        }
        if let Some(spec) = buffer_pool {
            builder = builder.buffer_pool(&spec);
        }
        if let Some(names) = transports {
            let kinds = names
                .iter()
                .map(|n| n.parse::<ferry::TransportKind>())
                .collect::<ferry::Result<Vec<_>>>()
                .py(py)?;
            builder = builder.transports(kinds);
        }
        if let Some(n) = streams {
            builder = builder.streams(n);
        }
        if let Some(n) = max_links {
            builder = builder.max_links(n);
        }
        if let Some(n) = max_inflight_bytes {
            builder = builder.max_inflight_bytes(n);
        }
        if let Some(n) = max_pending_notifications {
            builder = builder.max_pending_notifications(n);
        }
        if let Some(name) = name {
            builder = builder.name(name);
        }
        if let Some(policy) = path_policy {
            builder = builder.path_policy(policy.parse::<ferry::PathPolicy>().py(py)?);
        }
        if let Some(url) = directory {
            let ttl = seconds(py, "directory_ttl", directory_ttl)?;
            let directory = py
                .detach(|| {
                    let prefix = directory_prefix.as_deref().unwrap_or(crate::directory::DEFAULT_PREFIX);
                    runtime().block_on(crate::directory::connect(&url, prefix, ttl))
                })
                .py(py)?;
            builder = builder.directory(directory);
        }
        let engine = py.detach(|| runtime().block_on(builder.build())).py(py)?;
        Ok(Engine {
            engine: RwLock::new(Some(engine)),
            regions: Mutex::new(HashMap::new()),
        })
    }

    /// This engine's random id.
    #[getter]
    fn id(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.live(py)?.id())
    }

    /// "host:port" it listens on, or None.
    #[getter]
    fn local_addr(&self, py: Python<'_>) -> PyResult<Option<String>> {
        Ok(self.live(py)?.local_addr().map(|a| a.to_string()))
    }

    /// Transports this engine offers, best first.
    #[getter]
    fn transports(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        Ok(self
            .live(py)?
            .transports()
            .into_iter()
            .map(|k| k.name().to_string())
            .collect())
    }

    /// Number of regions registered.
    #[getter]
    fn region_count(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.live(py)?.region_count())
    }

    /// Number of live links.
    #[getter]
    fn link_count(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.live(py)?.link_count())
    }

    // ---- memory ---------------------------------------------------------------------------------

    /// Registers the memory of `obj`, any writable C-contiguous object with the buffer protocol
    /// (bytearray, memoryview, numpy array, mmap), for peers to access as `access` says (HIXL
    /// `RegisterMem`). `obj` is kept alive, and its buffer exported, until the region is
    /// deregistered: a bytearray cannot be resized nor an mmap closed meanwhile. A C-contiguous
    /// CUDA array (`__cuda_array_interface__`: a CUDA tensor, a CuPy or Numba array; or DLPack's
    /// `__dlpack__` on a CUDA device: a JAX or TensorFlow array) is registered as CUDA device
    /// memory, named by its device pointer, `obj` (or its DLPack capsule) kept alive likewise.
    #[pyo3(signature = (obj, access = 3))]
    fn register(slf: &Bound<'_, Self>, obj: &Bound<'_, PyAny>, access: u8) -> PyResult<Region> {
        let py = slf.py();
        let engine = slf.get().live(py)?;
        let access = crate::runtime::access(py, access)?;
        if let Some((addr, len)) = cuda_array(obj, access)? {
            let _rt = runtime().enter();
            // SAFETY: `obj` owns the device memory and is kept alive by the engine until the region
            // is deregistered (`Owner::Object`).
            let block = unsafe { ferry::cuda::CudaBlock::borrow(addr, len, None) }.py(py)?;
            let region = py.detach(|| engine.register_block(block, access)).py(py)?;
            return Engine::insert(slf, region, Owner::Object(obj.clone().unbind()));
        }
        if let Some(array) = crate::dlpack::cuda_array(obj)? {
            let _rt = runtime().enter();
            // SAFETY: the capsule keeps the tensor, and so its device memory, alive; the engine
            // keeps the capsule alive until the region is deregistered (`Owner::Object`).
            let block = unsafe { ferry::cuda::CudaBlock::borrow(array.addr, array.len, None) }.py(py)?;
            let region = py.detach(|| engine.register_block(block, access)).py(py)?;
            return Engine::insert(slf, region, Owner::Object(array.capsule));
        }
        let export = BufferExport::of(obj)?;
        let _rt = runtime().enter();
        let (addr, len) = (export.addr, export.len);
        // SAFETY: the export (`export.holder`) keeps these `len` bytes alive and unmoved until it
        // is dropped, which `deregister_addr` and `shutdown` do only after the region is dropped,
        // when no peer touches it again.
        let region = py
            .detach(|| unsafe { engine.register_raw(addr as *mut u8, len, access) })
            .py(py)?;
        Engine::insert(slf, region, Owner::Object(export.holder))
    }

    /// Registers `length` bytes at the raw address `addr`, memory Python cannot see (a tensor's
    /// `data_ptr()`). The caller keeps it valid until the region is deregistered; pass the object
    /// that owns it as `owner` and the engine keeps that alive until then. CUDA device memory (a
    /// CUDA tensor's, asked of the driver) is registered as such, staged (`Region.kind` says so);
    /// an address that is neither mapped host memory nor one CUDA allocation is refused.
    #[pyo3(signature = (addr, length, access = 3, owner = None))]
    fn register_ptr(
        slf: &Bound<'_, Self>,
        addr: u64,
        length: u64,
        access: u8,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<Region> {
        let py = slf.py();
        let engine = slf.get().live(py)?;
        let access = crate::runtime::access(py, access)?;
        if addr == 0 || length == 0 {
            return Err(errors::invalid(
                py,
                format!("register_ptr needs a non-null address and a non-zero length, not {addr:#x}+{length}"),
            ));
        }
        let len = usize::try_from(length)
            .map_err(|_| errors::invalid(py, format!("{length} bytes do not fit this machine")))?;
        // Any integer can be passed here: a range this process does not own, or device memory taken
        // for host memory, would crash it at a peer's first READ. The CUDA driver (where there is
        // one) says whether it is device memory, and in which allocation; host memory must be
        // mapped with the access asked for.
        let kind = ferry::cuda::classify(addr, length).py(py)?;
        let _rt = runtime().enter();
        let region = match kind {
            ferry::cuda::PointerKind::Device { .. } => {
                // SAFETY: the caller promises, as `register_ptr`'s documentation asks, that the
                // memory stays allocated until the region is deregistered (the engine keeps `owner`
                // alive until then).
                let block = unsafe { ferry::cuda::CudaBlock::borrow(addr, len, None) }.py(py)?;
                py.detach(|| engine.register_block(block, access)).py(py)?
            }
            ferry::cuda::PointerKind::Host => {
                ferry::mapped::check_mapped(addr, length, access).py(py)?;
                // SAFETY: as above; the range is mapped with the access asked for (checked).
                py.detach(|| unsafe { engine.register_raw(addr as *mut u8, len, access) })
                    .py(py)?
            }
        };
        let owner = owner.map_or(Owner::Engine, Owner::Object);
        Engine::insert(slf, region, owner)
    }

    /// Allocates `length` bytes of page-aligned host memory and registers it (HIXL `MallocMem`);
    /// fill and inspect it with the region's `write` and `read`.
    #[pyo3(signature = (length, access = 3))]
    fn alloc_host(slf: &Bound<'_, Self>, length: usize, access: u8) -> PyResult<Region> {
        let py = slf.py();
        let engine = slf.get().live(py)?;
        let access = crate::runtime::access(py, access)?;
        let _rt = runtime().enter();
        let region = py.detach(|| engine.alloc_host(length, access)).py(py)?;
        Engine::insert(slf, region, Owner::Engine)
    }

    /// Registers `length` bytes of the file at `path` from `offset` (page-aligned) as persistent
    /// memory: writes into it may ask for `durability="persistent"`.
    #[pyo3(signature = (path, length, offset = 0, access = 3))]
    fn register_file(
        slf: &Bound<'_, Self>,
        path: std::path::PathBuf,
        length: usize,
        offset: u64,
        access: u8,
    ) -> PyResult<Region> {
        let py = slf.py();
        let engine = slf.get().live(py)?;
        let access = crate::runtime::access(py, access)?;
        let _rt = runtime().enter();
        let region = py
            .detach(|| engine.register_file(&path, offset, length, access))
            .py(py)?;
        Engine::insert(slf, region, Owner::Engine)
    }

    /// Deregisters `region` (HIXL `DeregisterMem`); the same as `region.deregister()`.
    fn deregister(&self, py: Python<'_>, region: &Bound<'_, Region>) -> PyResult<()> {
        self.deregister_addr(py, region.get().addr)
    }

    /// The regions registered now.
    fn regions(slf: &Bound<'_, Self>) -> PyResult<Vec<Region>> {
        let py = slf.py();
        let table = slf.get().table(py)?;
        Ok(table
            .values()
            .map(|r| Region::new(slf.clone().unbind(), &r.region))
            .collect())
    }

    // ---- links ----------------------------------------------------------------------------------

    /// Connects to the engine listening at `addr` ("host:port") within `timeout` seconds (HIXL
    /// `Connect`); a coroutine giving a `Peer`. `path_policy` ("any", or transports such as "rdma"
    /// or "shm,rdma") overrides the engine's for this link: a link that can take none of the
    /// transports named raises `Unsupported`, saying why for each. `stage_gpu_memory` overrides the
    /// engine's for this link: with `False`, a transfer that would move GPU memory through a host
    /// copy raises `Unsupported`.
    #[pyo3(signature = (addr, timeout = 1.0, *, path_policy = None, stage_gpu_memory = None))]
    fn connect<'py>(
        &self,
        py: Python<'py>,
        addr: String,
        timeout: f64,
        path_policy: Option<String>,
        stage_gpu_memory: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let engine = self.live(py)?;
        let timeout = seconds(py, "timeout", timeout)?;
        let mut options = ferry::ConnectOptions::new();
        if let Some(policy) = path_policy {
            options = options.paths(policy.parse::<ferry::PathPolicy>().py(py)?);
        }
        if let Some(allowed) = stage_gpu_memory {
            options = options.stage_gpu_memory(allowed);
        }
        bridge::spawn(py, async move {
            let connected = engine.connect_using(&addr, timeout, &options).await;
            match connected {
                Ok(peer) => Outcome::Peer(peer),
                Err(e) => Outcome::Err(e),
            }
        })
    }

    /// Connects to the engine published under `name` in the engine's directory (`directory=` when
    /// made), within `timeout` seconds; a coroutine giving a `Peer`. `NotConnected` when no engine
    /// of that name is published; on an engine with TLS, `PermissionDenied` when the engine at the
    /// published address proves another name.
    #[pyo3(signature = (name, timeout = 1.0))]
    fn connect_by_name<'py>(&self, py: Python<'py>, name: String, timeout: f64) -> PyResult<Bound<'py, PyAny>> {
        let engine = self.live(py)?;
        let timeout = seconds(py, "timeout", timeout)?;
        bridge::spawn(py, async move {
            match engine.connect_by_name(&name, timeout).await {
                Ok(peer) => Outcome::Peer(peer),
                Err(e) => Outcome::Err(e),
            }
        })
    }

    /// The record the engine `name` published in this engine's directory, a dict (`name`, `addrs`,
    /// `transports`, `host_id`, `protocol_version`, `engine_id` in hex, `authenticated`), within
    /// `timeout` seconds; a coroutine. `NotConnected` when no engine of that name is published.
    #[pyo3(signature = (name, timeout = 1.0))]
    fn lookup<'py>(&self, py: Python<'py>, name: String, timeout: f64) -> PyResult<Bound<'py, PyAny>> {
        let engine = self.live(py)?;
        let timeout = seconds(py, "timeout", timeout)?;
        bridge::spawn(py, async move {
            match engine.lookup(&name, timeout).await.and_then(|record| {
                serde_json::to_value(record)
                    .map_err(|e| ferry::Error::Internal(format!("cannot encode a directory record: {e}")))
            }) {
                Ok(value) => Outcome::Json(value),
                Err(e) => Outcome::Err(e),
            }
        })
    }

    /// Closes the link to `peer` (HIXL `Disconnect`); a coroutine.
    #[pyo3(signature = (peer, timeout = 1.0))]
    fn disconnect<'py>(&self, py: Python<'py>, peer: &Bound<'_, Peer>, timeout: f64) -> PyResult<Bound<'py, PyAny>> {
        let engine = self.live(py)?;
        let peer = peer.get().inner.clone();
        let timeout = seconds(py, "timeout", timeout)?;
        bridge::spawn(py, async move { engine.disconnect(&peer, timeout).await.into() })
    }

    /// The peers linked now, both ways.
    fn peers(&self, py: Python<'_>) -> PyResult<Vec<Peer>> {
        Ok(self.live(py)?.peers().into_iter().map(Peer::new).collect())
    }

    // ---- transfers ------------------------------------------------------------------------------

    /// Runs a batch of one-sided `op`s ("read" or "write") on `peer` and waits for all of them, at
    /// most `timeout` seconds (HIXL `TransferSync`); a coroutine. `descs` is a list of
    /// `(local_addr, remote_addr, length)` tuples or an N×3 uint64 array. Writes complete when the
    /// bytes are in the target's memory; with `durability="persistent"`, when they are in its
    /// persistence domain.
    #[pyo3(signature = (peer, op, descs, *, timeout = 10.0, durability = "completed"))]
    fn transfer<'py>(
        &self,
        py: Python<'py>,
        peer: &Bound<'_, Peer>,
        op: &str,
        descs: &Bound<'_, PyAny>,
        timeout: f64,
        durability: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let call = TransferCall::new(self, py, peer, op, descs, durability)?;
        let timeout = seconds(py, "timeout", timeout)?;
        bridge::spawn_after_spin(py, async move { call.run(timeout).await.into() })
    }

    /// `transfer` for code without an event loop: blocks the calling thread (not the others: the
    /// GIL is released) until the batch completes.
    #[pyo3(signature = (peer, op, descs, *, timeout = 10.0, durability = "completed"))]
    fn transfer_blocking(
        &self,
        py: Python<'_>,
        peer: &Bound<'_, Peer>,
        op: &str,
        descs: &Bound<'_, PyAny>,
        timeout: f64,
        durability: &str,
    ) -> PyResult<()> {
        let call = TransferCall::new(self, py, peer, op, descs, durability)?;
        let timeout = seconds(py, "timeout", timeout)?;
        py.detach(|| ferry::blocking::block_on(runtime(), call.run(timeout)))
            .py(py)
    }

    /// Starts a batch and returns at once (HIXL `TransferAsync`): a `TransferHandle` to poll with
    /// `status()` or to await. Descriptors are checked before this returns.
    #[pyo3(signature = (peer, op, descs, *, timeout = 10.0, durability = "completed"))]
    fn transfer_async(
        &self,
        py: Python<'_>,
        peer: &Bound<'_, Peer>,
        op: &str,
        descs: &Bound<'_, PyAny>,
        timeout: f64,
        durability: &str,
    ) -> PyResult<TransferHandle> {
        let call = TransferCall::new(self, py, peer, op, descs, durability)?;
        let timeout = seconds(py, "timeout", timeout)?;
        let prepared = call
            .engine
            .prepare_durable(&call.peer, call.op, &call.descs, call.durability)
            .py(py)?;
        Ok(transfer::start(call.engine, Arc::new(prepared), timeout))
    }

    /// Resolves a batch once, to post again and again with `transfer_prepared` without checking
    /// each descriptor every time (the blocks of a KV cache moved between the same buffers).
    #[pyo3(signature = (peer, op, descs, *, durability = "completed"))]
    fn prepare(
        &self,
        py: Python<'_>,
        peer: &Bound<'_, Peer>,
        op: &str,
        descs: &Bound<'_, PyAny>,
        durability: &str,
    ) -> PyResult<PreparedTransfer> {
        let call = TransferCall::new(self, py, peer, op, descs, durability)?;
        let prepared = py
            .detach(|| {
                call.engine
                    .prepare_durable(&call.peer, call.op, &call.descs, call.durability)
            })
            .py(py)?;
        Ok(PreparedTransfer {
            inner: Arc::new(prepared),
            len: call.descs.len(),
        })
    }

    /// Posts a prepared batch and waits for it, at most `timeout` seconds; a coroutine.
    #[pyo3(signature = (prepared, *, timeout = 10.0))]
    fn transfer_prepared<'py>(
        &self,
        py: Python<'py>,
        prepared: &Bound<'_, PreparedTransfer>,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let engine = self.live(py)?;
        let prepared = prepared.get().inner.clone();
        let timeout = seconds(py, "timeout", timeout)?;
        bridge::spawn_after_spin(
            py,
            async move { engine.transfer_prepared(&prepared, timeout).await.into() },
        )
    }

    // ---- notifications --------------------------------------------------------------------------

    /// Sends a notification to `peer` (HIXL `SendNotify`); a coroutine. It is never seen before the
    /// data of transfers that completed before it was sent.
    #[pyo3(signature = (peer, name, msg, *, timeout = 1.0))]
    fn notify<'py>(
        &self,
        py: Python<'py>,
        peer: &Bound<'_, Peer>,
        name: String,
        msg: String,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let engine = self.live(py)?;
        let peer = peer.get().inner.clone();
        let timeout = seconds(py, "timeout", timeout)?;
        bridge::spawn(py, async move {
            engine
                .notify(&peer, ferry::Notification::new(name, msg), timeout)
                .await
                .into()
        })
    }

    /// Takes every notification received so far (HIXL `GetNotifies`).
    fn take_notifications(&self, py: Python<'_>) -> PyResult<Vec<Notification>> {
        Ok(self
            .live(py)?
            .take_notifications()
            .into_iter()
            .map(Notification::from)
            .collect())
    }

    /// Notifications as they arrive: `async for n in engine.notifications()`. Each is delivered
    /// once, to one consumer, in the order received, also across cancelled waits.
    fn notifications(&self, py: Python<'_>) -> PyResult<NotificationStream> {
        let engine = self.live(py)?;
        let _rt = runtime().enter();
        Ok(NotificationStream::new(engine.notifications()))
    }

    // ---- lifetime -------------------------------------------------------------------------------

    /// Deregisters every region, closes every link and stops listening. Later calls raise
    /// `InvalidArgument`.
    fn close(&self, py: Python<'_>) {
        self.shutdown(py);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) {
        self.shutdown(py);
    }

    fn __aenter__<'py>(slf: Py<Self>, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let engine = slf.into_any();
        bridge::spawn(py, async move { Outcome::Object(engine) })
    }

    #[pyo3(signature = (*_exc))]
    fn __aexit__<'py>(&self, py: Python<'py>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<Bound<'py, PyAny>> {
        self.shutdown(py);
        bridge::spawn(py, async { Outcome::None })
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        match self.live(py) {
            Ok(e) => format!(
                "<ferry.Engine id={:#x} listen={} transports={:?}>",
                e.id(),
                e.local_addr().map_or_else(|| "-".to_string(), |a| a.to_string()),
                e.transports().iter().map(|k| k.name()).collect::<Vec<_>>()
            ),
            Err(_) => "<ferry.Engine closed>".into(),
        }
    }
}

/// One batch's arguments (all but the timeout, which `prepare` has none of), converted while the
/// GIL is held.
struct TransferCall {
    engine: ferry::Engine,
    peer: ferry::Peer,
    op: ferry::Op,
    descs: Vec<ferry::TransferDesc>,
    durability: ferry::Durability,
}

impl TransferCall {
    fn new(
        engine: &Engine,
        py: Python<'_>,
        peer: &Bound<'_, Peer>,
        op_name: &str,
        descs: &Bound<'_, PyAny>,
        durability_name: &str,
    ) -> PyResult<Self> {
        Ok(TransferCall {
            engine: engine.live(py)?,
            peer: peer.get().inner.clone(),
            op: op(py, op_name)?,
            descs: descs::extract(descs)?,
            durability: durability(py, durability_name)?,
        })
    }

    async fn run(self, timeout: std::time::Duration) -> ferry::Result<()> {
        self.engine
            .transfer_durable(&self.peer, self.op, &self.descs, self.durability, timeout)
            .await
    }
}

/// A writable export of an object's buffer, pinned for as long as `holder` lives.
///
/// The stable ABI of Python 3.9 has no buffer protocol, so the export is made through ctypes:
/// `(c_ubyte * n).from_buffer(memoryview(obj).cast("B"))` refuses read-only and non-contiguous
/// buffers, and holds the export (and so `obj`) until it is garbage.
struct BufferExport {
    holder: Py<PyAny>,
    addr: u64,
    len: usize,
}

impl BufferExport {
    fn of(obj: &Bound<'_, PyAny>) -> PyResult<BufferExport> {
        let py = obj.py();
        let view = py
            .import("builtins")?
            .getattr("memoryview")?
            .call1((obj,))
            .map_err(|e| {
                errors::invalid(
                    py,
                    format!("register needs an object with the buffer protocol (bytearray, numpy array, mmap): {e}"),
                )
            })?;
        if view.getattr("readonly")?.is_truthy()? {
            return Err(errors::invalid(
                py,
                "the buffer is read-only (bytes?): register a bytearray, a numpy array or an mmap opened for writing"
                    .into(),
            ));
        }
        if !view.getattr("c_contiguous")?.is_truthy()? {
            return Err(errors::invalid(
                py,
                "the buffer is not C-contiguous: register a contiguous copy (numpy.ascontiguousarray)".into(),
            ));
        }
        let len: usize = view.getattr("nbytes")?.extract()?;
        if len == 0 {
            return Err(errors::invalid(py, "cannot register an empty buffer".into()));
        }
        let bytes = view.call_method1("cast", ("B",))?;
        let ctypes = py.import("ctypes")?;
        let array_type = ctypes.getattr("c_ubyte")?.call_method1("__mul__", (len,))?;
        let holder = array_type.call_method1("from_buffer", (bytes,))?;
        let addr: u64 = ctypes.call_method1("addressof", (&holder,))?.extract()?;
        Ok(BufferExport {
            holder: holder.unbind(),
            addr,
            len,
        })
    }
}

/// The engine's TLS configuration from the constructor's options: certificate files (all three), or
/// a pre-shared key and a name, or none.
fn tls_config(
    py: Python<'_>,
    (cert, key, ca): (
        Option<std::path::PathBuf>,
        Option<std::path::PathBuf>,
        Option<std::path::PathBuf>,
    ),
    (psk, name): (Option<Vec<u8>>, Option<String>),
    server_name: Option<String>,
    protection: Option<ferry::DataProtection>,
) -> PyResult<Option<ferry::TlsConfig>> {
    let config = match ((cert, key, ca), (psk, name)) {
        ((None, None, None), (None, None)) => {
            if protection.is_some() || server_name.is_some() {
                return Err(errors::invalid(
                    py,
                    "encrypt, data_protection and tls_server_name need TLS: give tls_cert, tls_key and tls_ca, \
                     or tls_psk and tls_name"
                        .into(),
                ));
            }
            return Ok(None);
        }
        ((Some(cert), Some(key), Some(ca)), (None, None)) => {
            let config = ferry::TlsConfig::from_pem_files(&cert, &key, &ca).py(py)?;
            match server_name {
                Some(name) => config.with_server_name(&name).py(py)?,
                None => config,
            }
        }
        ((None, None, None), (Some(psk), Some(name))) => {
            if server_name.is_some() {
                return Err(errors::invalid(
                    py,
                    "tls_server_name is for certificates, not tls_psk".into(),
                ));
            }
            ferry::TlsConfig::from_psk(&psk, &name).py(py)?
        }
        _ => {
            return Err(errors::invalid(
                py,
                "TLS needs tls_cert, tls_key and tls_ca together, or tls_psk and tls_name together, not a mix".into(),
            ));
        }
    };
    Ok(Some(match protection {
        Some(p) => config.data_protection(p),
        None => config,
    }))
}

/// The device pointer and byte length of `obj`'s `__cuda_array_interface__`, if it has one: a
/// C-contiguous, non-empty array, writable if peers may write (`access`).
fn cuda_array(obj: &Bound<'_, PyAny>, access: ferry::Access) -> PyResult<Option<(u64, usize)>> {
    let py = obj.py();
    let Some(interface) = obj.getattr_opt("__cuda_array_interface__")? else {
        return Ok(None);
    };
    let invalid = |what: String| errors::invalid(py, format!("__cuda_array_interface__: {what}"));
    let field = |name: &str| -> PyResult<Bound<'_, PyAny>> {
        interface
            .get_item(name)
            .map_err(|_| invalid(format!("no {name:?} in {interface}")))
    };
    let (addr, readonly): (u64, bool) = field("data")?
        .extract()
        .map_err(|_| invalid("data is not (pointer, readonly)".into()))?;
    let shape: Vec<u64> = field("shape")?
        .extract()
        .map_err(|_| invalid("shape is not a tuple of sizes".into()))?;
    let typestr: String = field("typestr")?
        .extract()
        .map_err(|_| invalid("typestr is not a string".into()))?;
    let strides: Option<Vec<i64>> = match interface.get_item("strides") {
        Ok(s) if !s.is_none() => Some(
            s.extract()
                .map_err(|_| invalid("strides is not a tuple of ints".into()))?,
        ),
        _ => None,
    };
    let itemsize = ferry::cuda::array::itemsize(&typestr).py(py)?;
    let bytes = ferry::cuda::array::contiguous_bytes(&shape, itemsize, strides.as_deref()).py(py)?;
    if readonly && access.contains(ferry::Access::WRITE) {
        return Err(invalid(
            "the array is read-only; register it with access=ferry.READ".into(),
        ));
    }
    let len = usize::try_from(bytes).map_err(|_| invalid(format!("{bytes} bytes do not fit this machine")))?;
    Ok(Some((addr, len)))
}
