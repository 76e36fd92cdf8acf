//! `ferry._ferry`: the extension module under the Python package `ferry`.
//!
//! Every call that waits runs on one tokio runtime per process, never holding the GIL: coroutines
//! (`connect`, `transfer`, `notify`…) are tokio tasks whose outcomes reach the caller's event loop
//! through a completion queue and an eventfd (see `bridge`), and the blocking calls (`Engine(...)`,
//! `transfer_blocking`, `deregister`) detach from the interpreter while they wait. So asyncio tasks
//! and Python threads transfer concurrently, and no tokio worker ever waits for the GIL.
//!
//! The package's Python half (`python/ferry`) defines the exception classes (so that `ferry.Timeout`
//! can also be a `TimeoutError`), the `Access` flags and the benchmark.

use pyo3::prelude::*;

mod bridge;
mod descs;
mod directory;
mod dlpack;
mod engine;
mod errors;
mod notify;
mod peer;
mod region;
mod runtime;
mod transfer;

/// What this build of ferry can do on this host, as a dict: version, protocol version, every
/// transport with whether it is compiled in and usable here (and why not), RDMA devices and rails,
/// Vulkan devices (HIXL `GetCapability`), and which engine directories the package can publish in.
#[pyfunction]
fn capabilities(py: Python<'_>) -> PyResult<Py<PyAny>> {
    let caps = py.detach(ferry::capabilities);
    let mut value = serde_json::to_value(&caps)
        .map_err(|e| errors::internal(py, format!("cannot encode the capabilities: {e}")))?;
    if let Some(map) = value.as_object_mut() {
        map.insert(
            "directories".into(),
            serde_json::json!([{ "name": "etcd", "compiled": directory::COMPILED }]),
        );
    }
    let json = value.to_string();
    Ok(py.import("json")?.call_method1("loads", (json,))?.unbind())
}

#[pymodule]
fn _ferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    runtime::init_logging();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(capabilities, m)?)?;
    m.add_class::<engine::Engine>()?;
    m.add_class::<region::Region>()?;
    m.add_class::<peer::Peer>()?;
    m.add_class::<peer::RemoteRegion>()?;
    m.add_class::<transfer::TransferHandle>()?;
    m.add_class::<transfer::TransferStatus>()?;
    m.add_class::<transfer::PreparedTransfer>()?;
    m.add_class::<notify::Notification>()?;
    m.add_class::<notify::NotificationStream>()?;
    Ok(())
}
