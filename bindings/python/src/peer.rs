//! `ferry.Peer`: a link to a remote engine, and what it advertised.

use pyo3::prelude::*;

/// A link to a remote engine, from `Engine.connect` or `Engine.peers()`.
#[pyclass(module = "ferry._ferry", frozen)]
pub struct Peer {
    pub inner: ferry::Peer,
}

impl Peer {
    pub fn new(inner: ferry::Peer) -> Peer {
        Peer { inner }
    }
}

/// A region the peer registered and advertised to this engine: `addr` and `length` are what
/// descriptors name on the remote side.
#[pyclass(module = "ferry._ferry", frozen, get_all)]
pub struct RemoteRegion {
    pub addr: u64,
    pub length: u64,
    /// `ferry.Access` bits: what this engine may do to it.
    pub access: u8,
    pub persistent: bool,
}

#[pymethods]
impl RemoteRegion {
    fn __repr__(&self) -> String {
        format!(
            "<ferry.RemoteRegion addr={:#x} length={} access={}{}>",
            self.addr,
            self.length,
            self.access,
            if self.persistent { " persistent" } else { "" }
        )
    }
}

#[pymethods]
impl Peer {
    /// The remote engine's address, "host:port".
    #[getter]
    fn addr(&self) -> String {
        self.inner.addr().to_string()
    }

    /// The name the peer is known by (its certificate name on an authenticated link, else its
    /// address).
    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_string()
    }

    /// The remote engine's id.
    #[getter]
    fn engine_id(&self) -> u64 {
        self.inner.engine_id()
    }

    /// The data path picked for this link: "shm", "rdma" or "tcp".
    #[getter]
    fn transport(&self) -> &'static str {
        self.inner.transport().name()
    }

    /// The better data paths this link could not take, and why: `(transport, reason)` pairs, best
    /// first (empty when it took the best both ends offer). A same-host link that carries only some
    /// regions says so here too.
    #[getter]
    fn passed_over(&self) -> Vec<(&'static str, String)> {
        self.inner
            .passed_over()
            .iter()
            .map(|(kind, why)| (kind.name(), why.clone()))
            .collect()
    }

    /// Whether the link has closed.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// The regions the peer advertised to this engine.
    fn regions(&self) -> Vec<RemoteRegion> {
        self.inner
            .regions()
            .iter()
            .map(|ad| RemoteRegion {
                addr: ad.addr,
                length: ad.len,
                access: ad.access.bits(),
                persistent: ad.persistent,
            })
            .collect()
    }

    /// How transfers to each region the peer advertised travel: a dict per region with its `addr`,
    /// `length`, the `transport` that carries it, `how`, and `passed_over`: why the link's better
    /// path does not carry it, or None.
    fn routes<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, pyo3::types::PyDict>>> {
        self.inner
            .routes()
            .into_iter()
            .map(|(ad, route)| {
                let d = pyo3::types::PyDict::new(py);
                d.set_item("addr", ad.addr)?;
                d.set_item("length", ad.len)?;
                d.set_item("transport", route.transport.name())?;
                d.set_item("how", route.how)?;
                d.set_item("passed_over", route.passed_over)?;
                Ok(d)
            })
            .collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferry.Peer {} engine={:#x} transport={}{}>",
            self.inner.addr(),
            self.inner.engine_id(),
            self.inner.transport().name(),
            if self.inner.is_closed() { " closed" } else { "" }
        )
    }
}
