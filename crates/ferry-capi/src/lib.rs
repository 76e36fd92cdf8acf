//! ferry's C ABI: `libferry` (shared and static) and its header `include/ferry.h`, generated from this
//! crate by cbindgen (a test checks the committed header is current). `include/ferry/hixl.h` puts
//! the HIXL/ADXL engine API (`hixl::Hixl`, `adxl::AdxlEngine`) on top of it, header-only.
//!
//! Why handles are numbers, not pointers: every engine, registration and transfer request is a
//! `uint64_t` naming an entry of a table this library keeps. A handle used after it was destroyed,
//! destroyed twice, or never issued finds no entry and is refused with `FERRY_INVALID_HANDLE`; it
//! cannot reach freed memory. Handles are never reused within a process.
//!
//! Every function returns a [`ferry_status`]; on failure [`ferry_last_error`] gives the message, per
//! thread. No panic crosses the boundary: one is caught and returned as `FERRY_INTERNAL`. Every
//! pointer argument is checked for null, and every length against what it describes.

#![allow(non_camel_case_types)]

mod api;
mod state;

pub use api::*;

use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

/// What a call returned. The values of ferry's error codes 1 to 12, then `FERRY_INVALID_HANDLE`,
/// then `FERRY_INTEGRITY` (ferry's code 13, which came after the handle code).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ferry_status {
    /// Done.
    FERRY_OK = 0,
    /// An argument was wrong: null, out of range, malformed.
    FERRY_INVALID_ARGUMENT = 1,
    /// The operation did not finish in time.
    FERRY_TIMEOUT = 2,
    /// No link to that remote engine: connect first.
    FERRY_NOT_CONNECTED = 3,
    /// A link to that remote engine exists already.
    FERRY_ALREADY_CONNECTED = 4,
    /// A limit was reached (links, pending notifications, memory).
    FERRY_RESOURCE_EXHAUSTED = 5,
    /// Not supported by this build or this peer.
    FERRY_UNSUPPORTED = 6,
    /// The peer may not do that (an authenticated engine's grants).
    FERRY_PERMISSION_DENIED = 7,
    /// An address range outside every registered region.
    FERRY_OUT_OF_BOUNDS = 8,
    /// The peer closed the link.
    FERRY_PEER_CLOSED = 9,
    /// The peer broke the protocol.
    FERRY_PROTOCOL = 10,
    /// An operating-system error.
    FERRY_IO = 11,
    /// A bug in ferry (a caught panic among them).
    FERRY_INTERNAL = 12,
    /// A handle that was never issued, or was destroyed already.
    FERRY_INVALID_HANDLE = 13,
    /// A transfer that asked for integrity found the destination's bytes differ from the source's;
    /// retry it.
    FERRY_INTEGRITY = 14,
}

impl From<&ferry::Error> for ferry_status {
    fn from(e: &ferry::Error) -> Self {
        use ferry::ErrorCode as C;
        match e.code() {
            C::InvalidArgument => ferry_status::FERRY_INVALID_ARGUMENT,
            C::Timeout => ferry_status::FERRY_TIMEOUT,
            C::NotConnected => ferry_status::FERRY_NOT_CONNECTED,
            C::AlreadyConnected => ferry_status::FERRY_ALREADY_CONNECTED,
            C::ResourceExhausted => ferry_status::FERRY_RESOURCE_EXHAUSTED,
            C::Unsupported => ferry_status::FERRY_UNSUPPORTED,
            C::PermissionDenied => ferry_status::FERRY_PERMISSION_DENIED,
            C::OutOfBounds => ferry_status::FERRY_OUT_OF_BOUNDS,
            C::PeerClosed => ferry_status::FERRY_PEER_CLOSED,
            C::Protocol => ferry_status::FERRY_PROTOCOL,
            C::Io => ferry_status::FERRY_IO,
            C::Internal => ferry_status::FERRY_INTERNAL,
            C::Integrity => ferry_status::FERRY_INTEGRITY,
        }
    }
}

/// A failed call: its status and what to tell the caller.
pub(crate) struct Failure(pub ferry_status, pub String);

impl From<ferry::Error> for Failure {
    fn from(e: ferry::Error) -> Self {
        Failure(ferry_status::from(&e), e.to_string())
    }
}

pub(crate) type Outcome = Result<(), Failure>;

pub(crate) fn invalid(what: impl Into<String>) -> Failure {
    Failure(ferry_status::FERRY_INVALID_ARGUMENT, what.into())
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub(crate) fn set_last_error(message: &str) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Runs one call's body: its failure becomes the status returned and this thread's last error, and
/// a panic is caught here instead of unwinding into C.
pub(crate) fn call(body: impl FnOnce() -> Outcome) -> ferry_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => ferry_status::FERRY_OK,
        Ok(Err(Failure(status, message))) => {
            set_last_error(&message);
            status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            set_last_error(&format!("ferry hit a bug (please report it): {what}"));
            ferry_status::FERRY_INTERNAL
        }
    }
}

/// The message of the last call on this thread that did not return `FERRY_OK`: a NUL-terminated
/// string owned by the library, valid until the next failing call on this thread. Never null.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}
