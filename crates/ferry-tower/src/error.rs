//! Turning the errors of a layered stack back into [`ferry::Error`], and deciding which are worth a
//! retry.
//!
//! tower's layers erase error types: `Timeout`, `LoadShed` and `Buffer` answer with
//! [`tower::BoxError`], wrapping either the inner service's error or one of their own
//! ([`Elapsed`], [`Overloaded`], a closed buffer). Callers of ferry act on the variants of one enum,
//! so [`into_ferry_error`] maps a boxed error back (put it outermost with `ServiceBuilder::map_err`),
//! and [`is_transient`] gives the retry policy one classification for both worlds.

use std::error::Error as StdError;
use std::io::ErrorKind;

use ferry::Error;
use tower::BoxError;
use tower::load_shed::error::Overloaded;
use tower::timeout::error::Elapsed;

/// Maps an error from a tower stack over [`TransferService`](crate::TransferService) to the
/// [`ferry::Error`] a caller acts on:
///
/// - a `ferry::Error` anywhere in the source chain is returned as it is;
/// - `tower::timeout`'s [`Elapsed`] becomes [`Error::Timeout`];
/// - `tower::load_shed`'s [`Overloaded`] becomes [`Error::ResourceExhausted`];
/// - anything else (a `Buffer` whose worker is gone, a layer of the caller's own) becomes
///   [`Error::Io`] of kind `Other`, carrying its message.
pub fn into_ferry_error(err: BoxError) -> Error {
    let err = match err.downcast::<Error>() {
        Ok(e) => return *e,
        Err(other) => other,
    };
    let mut cause: Option<&(dyn StdError + 'static)> = Some(&*err);
    while let Some(e) = cause {
        if let Some(e) = e.downcast_ref::<Error>() {
            return e.clone();
        }
        if e.is::<Elapsed>() {
            return Error::Timeout("no response within the limit of the tower timeout layer".into());
        }
        if e.is::<Overloaded>() {
            return Error::ResourceExhausted(
                "the service was at capacity and shed the request (tower load_shed)".into(),
            );
        }
        cause = e.source();
    }
    Error::Io {
        kind: ErrorKind::Other,
        message: format!("middleware: {err}"),
    }
}

/// Whether repeating a request that failed with `err` may succeed, for the retry policy.
///
/// It is [`Error::is_retryable`] (timeouts, closed peers, `NotConnected`, transient I/O), widened by
/// the I/O kinds a flapping route produces (`HostUnreachable`, `NetworkUnreachable`, `NetworkDown`):
/// while an interface is down, connecting fails at once with one of those, and the link comes back
/// with the route. [`Elapsed`] from `tower::timeout` is transient too. Everything else is not:
/// `PermissionDenied`, `OutOfBounds` and `InvalidArgument` fail the same way every time, and a shed
/// request ([`Overloaded`]) must not come back as extra load.
pub fn is_transient(err: &(dyn StdError + 'static)) -> bool {
    let mut cause = Some(err);
    while let Some(e) = cause {
        if let Some(e) = e.downcast_ref::<Error>() {
            return is_transient_ferry(e);
        }
        if e.is::<Elapsed>() {
            return true;
        }
        if e.is::<Overloaded>() {
            return false;
        }
        cause = e.source();
    }
    false
}

/// [`is_transient`] for a [`ferry::Error`]: the engine's own [`Error::is_retryable`].
pub fn is_transient_ferry(err: &Error) -> bool {
    err.is_retryable()
}

/// Whether `err` by itself says the link it happened on is unusable, so that the pool must replace
/// it. Only the variants that mean exactly that: an `Io` or `Protocol` error may be one operation's
/// (a range refused on a truncated file, a peer's refusal of a frame), and when such an error did
/// break the link, the engine has marked the link closed, which the pool checks as well.
pub(crate) fn breaks_link(err: &Error) -> bool {
    matches!(err, Error::PeerClosed(_) | Error::NotConnected(_))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxed_ferry_errors_come_back_unchanged() {
        let e = Error::OutOfBounds("x".into());
        assert_eq!(into_ferry_error(Box::new(e.clone())), e);
    }

    #[test]
    fn tower_errors_map_to_variants() {
        assert!(matches!(into_ferry_error(Box::new(Elapsed::new())), Error::Timeout(_)));
        assert!(matches!(
            into_ferry_error(Box::new(Overloaded::new())),
            Error::ResourceExhausted(_)
        ));
        let other: BoxError = "something else".into();
        assert!(matches!(
            into_ferry_error(other),
            Error::Io {
                kind: ErrorKind::Other,
                ..
            }
        ));
    }

    #[test]
    fn classification() {
        for e in [
            Error::Timeout("t".into()),
            Error::PeerClosed("c".into()),
            Error::NotConnected("n".into()),
            Error::io("x", std::io::Error::from(ErrorKind::ConnectionRefused)),
            Error::io("x", std::io::Error::from(ErrorKind::NetworkUnreachable)),
        ] {
            assert!(is_transient(&e), "{e:?}");
        }
        for e in [
            Error::PermissionDenied("p".into()),
            Error::OutOfBounds("o".into()),
            Error::InvalidArgument("i".into()),
            Error::ResourceExhausted("r".into()),
            Error::io("x", std::io::Error::from(ErrorKind::PermissionDenied)),
        ] {
            assert!(!is_transient(&e), "{e:?}");
        }
        assert!(is_transient(&Elapsed::new()));
        assert!(!is_transient(&Overloaded::new()));
    }

    #[test]
    fn only_link_errors_retire_links() {
        assert!(breaks_link(&Error::PeerClosed("c".into())));
        assert!(breaks_link(&Error::NotConnected("n".into())));
        let truncated = Error::Io {
            kind: ErrorKind::InvalidData,
            message: "peer reported: /data/f was truncated".into(),
        };
        for e in [
            truncated,
            Error::Protocol("peer reported: a frame it refused".into()),
            Error::PermissionDenied("p".into()),
            Error::Timeout("t".into()),
        ] {
            assert!(!breaks_link(&e), "{e:?}");
        }
    }
}
