//! Registered memory, as Python sees it.
//!
//! The engine's table ([`Registered`]) owns each `ferry::Region` and, for memory that came from a
//! Python object, the buffer export that pins it: a `bytearray` cannot be resized, an `mmap` cannot
//! be closed and a numpy array's data cannot be freed while the export lives. The export is released
//! only after the region is deregistered, when no peer can touch the memory again. The Python
//! `Region` is a handle naming the entry by address: dropping it deregisters nothing, as in NIXL
//! and Mooncake, where memory stays registered until it is deregistered.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::engine::Engine;
use crate::errors::{self, IntoPyResult};

/// One entry of an engine's region table.
pub struct Registered {
    pub region: ferry::Region,
    /// What keeps the memory alive: a buffer export, an object passed to `register_ptr`, or
    /// nothing (memory the engine allocated).
    pub owner: Owner,
}

pub enum Owner {
    /// Memory the engine allocated or mapped.
    Engine,
    /// The object the memory belongs to (a buffer export, or what `register_ptr` was given),
    /// held only to keep it alive.
    Object(#[allow(dead_code)] Py<PyAny>),
}

/// Memory registered with an [`Engine`]: peers address it by [`addr`](Region::addr) (or, on an
/// engine that authenticates its links, by `addr_for(peer_name)`). It stays registered until
/// `deregister()` (or the engine's `close()`), whether or not this handle is kept.
#[pyclass(module = "ferry._ferry", frozen)]
pub struct Region {
    pub engine: Py<Engine>,
    #[pyo3(get)]
    pub addr: u64,
    #[pyo3(get)]
    pub length: u64,
    pub access: ferry::Access,
    #[pyo3(get)]
    pub kind: String,
    #[pyo3(get)]
    pub persistent: bool,
}

impl Region {
    pub fn new(engine: Py<Engine>, region: &ferry::Region) -> Region {
        Region {
            engine,
            addr: region.addr(),
            length: region.len(),
            access: region.access(),
            kind: region.kind().to_string(),
            persistent: region.is_persistent(),
        }
    }

    fn grant_handle(&self, py: Python<'_>) -> PyResult<ferry::GrantHandle> {
        self.engine.get().with_region(py, self.addr, |r| Ok(r.grant_handle()))
    }

    fn check_range(&self, py: Python<'_>, offset: u64, len: u64) -> PyResult<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.length) {
            return Err(errors::to_py(
                py,
                ferry::Error::OutOfBounds(format!(
                    "{len} bytes at offset {offset} do not fit the region of {} bytes",
                    self.length
                )),
            ));
        }
        Ok(())
    }
}

#[pymethods]
impl Region {
    /// What peers may do: a `ferry.Access` value (1 read, 2 write, 3 both).
    #[getter]
    fn access(&self) -> u8 {
        self.access.bits()
    }

    fn __len__(&self) -> usize {
        self.length as usize
    }

    /// The address of the byte at `offset`, for building descriptors.
    fn addr_at(&self, py: Python<'_>, offset: u64) -> PyResult<u64> {
        self.check_range(py, offset, 0)?;
        Ok(self.addr + offset)
    }

    /// The address the peer named `peer` (its certificate name) knows this region's first byte
    /// by: on an engine that authenticates its links each peer is told an opaque base of its own;
    /// otherwise `addr`.
    fn addr_for(&self, py: Python<'_>, peer: &str) -> PyResult<u64> {
        self.engine.get().with_region(py, self.addr, |r| Ok(r.addr_for(peer)))
    }

    /// Copies `length` bytes from `offset` (to the end when omitted) out of the region.
    #[pyo3(signature = (offset = 0, length = None))]
    fn read<'py>(&self, py: Python<'py>, offset: u64, length: Option<u64>) -> PyResult<Bound<'py, PyBytes>> {
        let length = length.unwrap_or(self.length.saturating_sub(offset));
        self.check_range(py, offset, length)?;
        let mut out = vec![0u8; length as usize];
        self.engine
            .get()
            .with_region(py, self.addr, |r| r.read_at(offset, &mut out).py(py))?;
        Ok(PyBytes::new(py, &out))
    }

    /// Copies `data` (bytes, bytearray, or anything `bytes()` accepts) into the region at
    /// `offset`.
    #[pyo3(signature = (offset, data))]
    fn write(&self, py: Python<'_>, offset: u64, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let owned;
        let bytes = match data.cast::<PyBytes>() {
            Ok(b) => b,
            Err(_) => {
                owned = py.import("builtins")?.getattr("bytes")?.call1((data,))?;
                owned.cast::<PyBytes>()?
            }
        };
        let src = bytes.as_bytes();
        self.check_range(py, offset, src.len() as u64)?;
        self.engine
            .get()
            .with_region(py, self.addr, |r| r.write_at(offset, src).py(py))
    }

    /// Makes `length` bytes from `offset` persistent (a region from `register_file`); what a
    /// persistent write does at the target, for local stores.
    fn persist(&self, py: Python<'_>, offset: u64, length: u64) -> PyResult<()> {
        self.check_range(py, offset, length)?;
        self.engine
            .get()
            .with_region(py, self.addr, |r| r.persist(offset, length).py(py))
    }

    /// Lets the peer named `peer` (its certificate's name) reach the region with `access`, on an
    /// engine made with TLS options (regions are private there until granted); a coroutine. A grant
    /// that narrows what the peer had returns, as `revoke` does, once the peer can no longer do it.
    /// `InvalidArgument` on an engine without TLS, where every peer reaches every region.
    #[pyo3(signature = (peer, access = 3))]
    fn grant<'py>(&self, py: Python<'py>, peer: String, access: u8) -> PyResult<Bound<'py, PyAny>> {
        let access = crate::runtime::access(py, access)?;
        let handle = self.grant_handle(py)?;
        crate::bridge::spawn(py, async move { handle.grant(&peer, access).await.into() })
    }

    /// Lets every authenticated peer reach the region with `access`; a coroutine.
    #[pyo3(signature = (access = 3))]
    fn grant_all<'py>(&self, py: Python<'py>, access: u8) -> PyResult<Bound<'py, PyAny>> {
        let access = crate::runtime::access(py, access)?;
        let handle = self.grant_handle(py)?;
        crate::bridge::spawn(py, async move { handle.grant_all(access).await.into() })
    }

    /// Takes back what `grant` gave `peer`; a coroutine that returns once the peer can no longer
    /// reach the region (at most 5 s, else `TimeoutError` with the revoke in force for new operations).
    fn revoke<'py>(&self, py: Python<'py>, peer: String) -> PyResult<Bound<'py, PyAny>> {
        let handle = self.grant_handle(py)?;
        crate::bridge::spawn(py, async move { handle.revoke(&peer).await.into() })
    }

    /// Takes back a `grant_all`, as `revoke` does for one peer; a coroutine.
    fn revoke_all<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let handle = self.grant_handle(py)?;
        crate::bridge::spawn(py, async move { handle.revoke_all().await.into() })
    }

    /// Deregisters the region (HIXL `DeregisterMem`): once this returns no peer touches its memory
    /// again, and the object it came from is released.
    fn deregister(&self, py: Python<'_>) -> PyResult<()> {
        self.engine.get().deregister_addr(py, self.addr)
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferry.Region addr={:#x} length={} access={} kind={:?}>",
            self.addr,
            self.length,
            self.access.bits(),
            self.kind
        )
    }
}
