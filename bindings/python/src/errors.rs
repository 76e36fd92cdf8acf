//! ferry's errors as Python exceptions: one class per [`ferry::Error`] variant, all under
//! `ferry.Error`, defined in `ferry/_errors.py` so that a class can have a second, standard base
//! (`ferry.Timeout` is also a `TimeoutError`, `ferry.InvalidArgument` a `ValueError`).

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyModule;

static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// The Python class name of each variant.
fn class_name(e: &ferry::Error) -> &'static str {
    use ferry::Error::*;
    match e {
        InvalidArgument(_) => "InvalidArgument",
        Timeout(_) => "Timeout",
        NotConnected(_) => "NotConnected",
        AlreadyConnected(_) => "AlreadyConnected",
        ResourceExhausted(_) => "ResourceExhausted",
        Unsupported(_) => "Unsupported",
        PermissionDenied(_) => "PermissionDenied",
        OutOfBounds(_) => "OutOfBounds",
        PeerClosed(_) => "PeerClosed",
        Protocol(_) => "Protocol",
        Internal(_) => "Internal",
        Integrity(_) => "Integrity",
        Io { .. } => "IoError",
    }
}

/// An instance of `ferry.<class>` with `message`; a `RuntimeError` naming the problem if the
/// package's Python half cannot be imported (a broken install).
fn make(py: Python<'_>, class: &str, message: String) -> PyErr {
    let module = ERRORS.get_or_try_init(py, || py.import("ferry._errors").map(Bound::unbind));
    let made = module.and_then(|m| m.bind(py).getattr(class)?.call1((message.clone(),)));
    match made {
        Ok(exception) => PyErr::from_value(exception),
        Err(e) => PyRuntimeError::new_err(format!(
            "{message} (and ferry.{class} could not be raised: {e}; reinstall the ferry package)"
        )),
    }
}

/// The exception for `e`, with its message.
pub fn to_py(py: Python<'_>, e: ferry::Error) -> PyErr {
    make(py, class_name(&e), e.to_string())
}

/// `ferry.InvalidArgument` for a bad argument from Python.
pub fn invalid(py: Python<'_>, message: String) -> PyErr {
    to_py(py, ferry::Error::InvalidArgument(message))
}

/// `ferry.Internal`.
pub fn internal(py: Python<'_>, message: String) -> PyErr {
    to_py(py, ferry::Error::Internal(message))
}

/// Extension trait: `result.py(py)?` converts a ferry result.
pub trait IntoPyResult<T> {
    /// Converts the error, if any, into its Python exception.
    fn py(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for ferry::Result<T> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}
