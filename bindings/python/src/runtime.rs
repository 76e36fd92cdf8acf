//! The process's tokio runtime, argument conversions every module shares, and logging.

use std::time::Duration;

use pyo3::prelude::*;

use crate::errors;

static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();

/// The runtime every engine of this process runs on, started on first use: one worker per core.
///
/// # Panics
///
/// If the operating system refuses the runtime's threads or its I/O driver at start-up, the one
/// failure nothing in the module can recover from.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("ferry-worker")
            .build()
            .unwrap_or_else(|e| panic!("ferry cannot start its async runtime: {e}"))
    })
}

/// A timeout in seconds from Python: finite and positive.
pub fn seconds(py: Python<'_>, what: &str, secs: f64) -> PyResult<Duration> {
    if !secs.is_finite() || secs <= 0.0 || secs > 1e9 {
        return Err(errors::invalid(
            py,
            format!("{what} must be a positive number of seconds, not {secs}"),
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Access flags from Python (`ferry.Access` or a plain int: 1 read, 2 write, 3 both).
pub fn access(py: Python<'_>, bits: u8) -> PyResult<ferry::Access> {
    ferry::Access::from_bits(bits).map_err(|_| {
        errors::invalid(
            py,
            format!("access must be ferry.Access.READ (1), WRITE (2) or READ | WRITE (3), not {bits}"),
        )
    })
}

/// `"read"` / `"write"` (any case) to an operation.
pub fn op(py: Python<'_>, op: &str) -> PyResult<ferry::Op> {
    named(py, "op", op, &[("read", ferry::Op::Read), ("write", ferry::Op::Write)])
}

/// `"completed"` / `"persistent"` (any case) to a durability.
pub fn durability(py: Python<'_>, durability: &str) -> PyResult<ferry::Durability> {
    named(
        py,
        "durability",
        durability,
        &[
            ("completed", ferry::Durability::Completed),
            ("persistent", ferry::Durability::Persistent),
        ],
    )
}

/// The value `choices` names `text` by (any case), else `InvalidArgument` listing the names.
fn named<T: Copy>(py: Python<'_>, what: &str, text: &str, choices: &[(&str, T)]) -> PyResult<T> {
    if let Some(&(_, value)) = choices.iter().find(|(name, _)| name.eq_ignore_ascii_case(text)) {
        return Ok(value);
    }
    let names: Vec<String> = choices.iter().map(|(name, _)| format!("{name:?}")).collect();
    Err(errors::invalid(
        py,
        format!("{what} must be {}, not {text:?}", names.join(" or ")),
    ))
}

/// `FERRY_LOG=debug` (an `EnvFilter` directive) prints the engine's `tracing` events to stderr.
pub fn init_logging() {
    if let Ok(filter) = std::env::var("FERRY_LOG") {
        // Another library of the process may have installed a subscriber first: then it gets them.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    }
}
