//! The one error type of ferry.
//!
//! The variants follow the return codes of the HIXL/ADXL engine (PARAM_INVALID, TIMEOUT, NOT_CONNECTED,
//! ALREADY_CONNECTED, RESOURCE_EXHAUSTED, UNSUPPORTED, FAILED), split where a caller acts differently:
//! a range outside a region, a missing permission, a peer that went away, a peer that broke the protocol.
//! Every variant carries a message that names what failed and, where there is one, what to do about it.
//! Errors cross the wire as an [`ErrorCode`] plus the message, so a remote refusal arrives with the same
//! variant the target produced.

use std::fmt;

/// Result alias used throughout ferry.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in ferry, by what the caller can do about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// An argument or option is out of its documented range (HIXL `PARAM_INVALID`).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A bounded wait ran out (HIXL `TIMEOUT`). Retryable.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The operation names a peer this engine has no link to (HIXL `NOT_CONNECTED`).
    #[error("not connected: {0}")]
    NotConnected(String),
    /// `connect` was called for a peer that is already connected (HIXL `ALREADY_CONNECTED`).
    #[error("already connected: {0}")]
    AlreadyConnected(String),
    /// A configured limit was reached: links, pending notifications, coalescing buffers, memory
    /// (HIXL `RESOURCE_EXHAUSTED`).
    #[error("resource exhausted: {0}")]
    ResourceExhausted(String),
    /// The feature, transport or device is not available in this build or on this host
    /// (HIXL `UNSUPPORTED`).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The region key is unknown or the region lacks the access the operation needs.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// A range lies outside the region it names, or outside every registered region.
    #[error("out of bounds: {0}")]
    OutOfBounds(String),
    /// The peer closed the link, or died, while the operation was outstanding. Retryable.
    #[error("peer closed: {0}")]
    PeerClosed(String),
    /// The peer sent something the protocol does not allow (malformed frame, wrong version).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A fault inside this process, not the peer's doing: a lock poisoned by a panic, a task that
    /// panicked, a state the code should never reach. A bug to report; retrying does not help.
    #[error("internal error: {0}")]
    Internal(String),
    /// A transfer asked for integrity, and the bytes at the destination are not the ones that left
    /// the source (their checksums differ): corrupted on the way or after landing, or changed at
    /// either end while the transfer ran. For a READ, nothing is promised about the destination's
    /// bytes. Retryable.
    #[error("integrity check failed: {0}")]
    Integrity(String),
    /// An operating-system call failed.
    #[error("I/O error ({kind:?}): {message}")]
    Io {
        /// The kind of the underlying `std::io::Error`.
        kind: std::io::ErrorKind,
        /// What was being done, and the OS message.
        message: String,
    },
}

impl Error {
    /// Whether repeating the same operation later may succeed: timeouts, closed peers and transient
    /// I/O failures are; wrong arguments, missing permissions and bounds violations never are.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Timeout(_) | Error::PeerClosed(_) | Error::NotConnected(_) | Error::Integrity(_) => true,
            Error::Io { kind, .. } => matches!(
                kind,
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::TimedOut
                    | std::io::ErrorKind::Interrupted
                    | std::io::ErrorKind::WouldBlock
                    | std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::HostUnreachable
                    | std::io::ErrorKind::NetworkUnreachable
                    | std::io::ErrorKind::NetworkDown
            ),
            _ => false,
        }
    }

    /// A batch of `descriptors` to `peer` that did not complete within `timeout`: what the engine and
    /// the transports that bound transfers themselves answer alike.
    pub fn transfer_timeout(descriptors: usize, peer: impl fmt::Display, timeout: std::time::Duration) -> Self {
        Error::Timeout(format!(
            "a batch of {descriptors} descriptors to {peer} did not complete within {timeout:?}"
        ))
    }

    /// Wraps an `std::io::Error` with what was being done when it happened.
    pub fn io(context: impl fmt::Display, err: std::io::Error) -> Self {
        Error::Io {
            kind: err.kind(),
            message: format!("{context}: {err}"),
        }
    }

    /// The code that carries this error's variant over the wire.
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::InvalidArgument(_) => ErrorCode::InvalidArgument,
            Error::Timeout(_) => ErrorCode::Timeout,
            Error::NotConnected(_) => ErrorCode::NotConnected,
            Error::AlreadyConnected(_) => ErrorCode::AlreadyConnected,
            Error::ResourceExhausted(_) => ErrorCode::ResourceExhausted,
            Error::Unsupported(_) => ErrorCode::Unsupported,
            Error::PermissionDenied(_) => ErrorCode::PermissionDenied,
            Error::OutOfBounds(_) => ErrorCode::OutOfBounds,
            Error::PeerClosed(_) => ErrorCode::PeerClosed,
            Error::Protocol(_) => ErrorCode::Protocol,
            Error::Io { .. } => ErrorCode::Io,
            Error::Internal(_) => ErrorCode::Internal,
            Error::Integrity(_) => ErrorCode::Integrity,
        }
    }

    /// The message without the variant's prefix.
    pub fn message(&self) -> &str {
        match self {
            Error::InvalidArgument(m)
            | Error::Timeout(m)
            | Error::NotConnected(m)
            | Error::AlreadyConnected(m)
            | Error::ResourceExhausted(m)
            | Error::Unsupported(m)
            | Error::PermissionDenied(m)
            | Error::OutOfBounds(m)
            | Error::PeerClosed(m)
            | Error::Protocol(m)
            | Error::Internal(m)
            | Error::Integrity(m) => m,
            Error::Io { message, .. } => message,
        }
    }

    /// The same error with its message rewritten by `f`.
    pub fn map_message(self, f: impl FnOnce(&str) -> String) -> Error {
        match self {
            Error::Io { kind, message } => Error::Io {
                kind,
                message: f(&message),
            },
            other => Error::from_code(other.code(), f(other.message())),
        }
    }

    fn from_code(code: ErrorCode, message: String) -> Self {
        match code {
            ErrorCode::InvalidArgument => Error::InvalidArgument(message),
            ErrorCode::Timeout => Error::Timeout(message),
            ErrorCode::NotConnected => Error::NotConnected(message),
            ErrorCode::AlreadyConnected => Error::AlreadyConnected(message),
            ErrorCode::ResourceExhausted => Error::ResourceExhausted(message),
            ErrorCode::Unsupported => Error::Unsupported(message),
            ErrorCode::PermissionDenied => Error::PermissionDenied(message),
            ErrorCode::OutOfBounds => Error::OutOfBounds(message),
            ErrorCode::PeerClosed => Error::PeerClosed(message),
            ErrorCode::Protocol => Error::Protocol(message),
            ErrorCode::Io => Error::Io {
                kind: std::io::ErrorKind::Other,
                message,
            },
            ErrorCode::Internal => Error::Internal(message),
            ErrorCode::Integrity => Error::Integrity(message),
        }
    }

    /// Rebuilds an error that a peer reported with `code` and `message`.
    pub fn from_wire(code: ErrorCode, message: String) -> Self {
        Error::from_code(code, format!("peer reported: {message}"))
    }
}

/// An [`Error`] as it crosses the wire: its variant, the kind of an I/O error (so that a remote
/// transient failure stays retryable), and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError {
    /// The variant.
    pub code: ErrorCode,
    /// For [`ErrorCode::Io`], the `std::io::ErrorKind`; `Other` for the rest.
    pub io_kind: std::io::ErrorKind,
    /// What failed, as the peer said it.
    pub message: String,
}

impl From<&Error> for WireError {
    fn from(e: &Error) -> Self {
        WireError {
            code: e.code(),
            io_kind: match e {
                Error::Io { kind, .. } => *kind,
                _ => std::io::ErrorKind::Other,
            },
            message: e.message().to_owned(),
        }
    }
}

impl WireError {
    /// The error the peer reported, with the same variant (and I/O kind) it produced.
    pub fn into_error(self) -> Error {
        match Error::from_wire(self.code, self.message) {
            Error::Io { message, .. } => Error::Io {
                kind: self.io_kind,
                message,
            },
            other => other,
        }
    }
}

/// The I/O error kinds that keep their identity on the wire, by wire number (index + 1). Others
/// travel as `Other` (0): what a caller decides on (retry or not) is among these.
const WIRE_IO_KINDS: [std::io::ErrorKind; 20] = {
    use std::io::ErrorKind::*;
    [
        NotFound,
        PermissionDenied,
        ConnectionRefused,
        ConnectionReset,
        HostUnreachable,
        NetworkUnreachable,
        ConnectionAborted,
        NotConnected,
        AddrInUse,
        AddrNotAvailable,
        NetworkDown,
        BrokenPipe,
        AlreadyExists,
        WouldBlock,
        InvalidInput,
        InvalidData,
        TimedOut,
        Interrupted,
        UnexpectedEof,
        OutOfMemory,
    ]
};

/// The wire number of an I/O error kind (0 for `Other` and kinds without one).
pub fn io_kind_to_wire(kind: std::io::ErrorKind) -> u8 {
    WIRE_IO_KINDS.iter().position(|k| *k == kind).map_or(0, |i| i as u8 + 1)
}

/// The I/O error kind of a wire number; unknown numbers (a newer peer) read as `Other`.
pub fn io_kind_from_wire(n: u8) -> std::io::ErrorKind {
    match n {
        1..=20 => WIRE_IO_KINDS[n as usize - 1],
        _ => std::io::ErrorKind::Other,
    }
}

/// The wire form of an [`Error`] variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
#[allow(missing_docs)]
pub enum ErrorCode {
    InvalidArgument = 1,
    Timeout = 2,
    NotConnected = 3,
    AlreadyConnected = 4,
    ResourceExhausted = 5,
    Unsupported = 6,
    PermissionDenied = 7,
    OutOfBounds = 8,
    PeerClosed = 9,
    Protocol = 10,
    Io = 11,
    Internal = 12,
    Integrity = 13,
}

impl ErrorCode {
    /// The code's name in snake case ("timeout", "peer_closed"), for logs and metric labels.
    pub fn name(self) -> &'static str {
        use ErrorCode::*;
        match self {
            InvalidArgument => "invalid_argument",
            Timeout => "timeout",
            NotConnected => "not_connected",
            AlreadyConnected => "already_connected",
            ResourceExhausted => "resource_exhausted",
            Unsupported => "unsupported",
            PermissionDenied => "permission_denied",
            OutOfBounds => "out_of_bounds",
            PeerClosed => "peer_closed",
            Protocol => "protocol",
            Io => "io",
            Internal => "internal",
            Integrity => "integrity",
        }
    }

    /// Parses a wire code; `None` for codes this version does not know.
    pub fn from_u16(v: u16) -> Option<Self> {
        use ErrorCode::*;
        Some(match v {
            1 => InvalidArgument,
            2 => Timeout,
            3 => NotConnected,
            4 => AlreadyConnected,
            5 => ResourceExhausted,
            6 => Unsupported,
            7 => PermissionDenied,
            8 => OutOfBounds,
            9 => PeerClosed,
            10 => Protocol,
            11 => Io,
            12 => Internal,
            13 => Integrity,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_split() {
        assert!(Error::Timeout("x".into()).is_retryable());
        assert!(Error::PeerClosed("x".into()).is_retryable());
        assert!(!Error::PermissionDenied("x".into()).is_retryable());
        assert!(!Error::OutOfBounds("x".into()).is_retryable());
        assert!(!Error::InvalidArgument("x".into()).is_retryable());
        let reset = Error::io("send", std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(reset.is_retryable());
        let flap = Error::io("send", std::io::Error::from(std::io::ErrorKind::NetworkUnreachable));
        assert!(flap.is_retryable(), "a route that flaps comes back");
        let denied = Error::io("open", std::io::Error::from(std::io::ErrorKind::PermissionDenied));
        assert!(!denied.is_retryable());
    }

    #[test]
    fn wire_round_trip_keeps_variant() {
        for code in 1..=13u16 {
            let code = ErrorCode::from_u16(code).unwrap();
            assert_eq!(Error::from_wire(code, "m".into()).code(), code);
        }
        assert_eq!(ErrorCode::from_u16(0), None);
        assert_eq!(ErrorCode::from_u16(14), None);
        assert!(Error::Integrity("a checksum differs".into()).is_retryable());
        assert!(!Error::Internal("a lock was poisoned".into()).is_retryable());
    }

    #[test]
    fn io_kind_survives_the_wire() {
        let reset = Error::io("send", std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        let back = WireError::from(&reset).into_error();
        assert!(
            back.is_retryable(),
            "a remote transient I/O error stays retryable: {back:?}"
        );
        assert!(matches!(
            back,
            Error::Io {
                kind: std::io::ErrorKind::ConnectionReset,
                ..
            }
        ));
        for n in 0..=u8::MAX {
            let kind = io_kind_from_wire(n);
            if kind != std::io::ErrorKind::Other {
                assert_eq!(io_kind_to_wire(kind), n);
            }
        }
        assert_eq!(io_kind_to_wire(std::io::ErrorKind::Other), 0);
        let denied = WireError::from(&Error::PermissionDenied("k".into())).into_error();
        assert_eq!(denied, Error::PermissionDenied("peer reported: k".into()));
    }
}
