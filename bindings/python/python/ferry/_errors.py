"""ferry's exceptions: one class per kind of failure, all under :class:`ferry.Error`.

The extension raises these by name. Where a standard exception means the same thing, the class
derives from it as well, so that ``except TimeoutError`` and ``except ConnectionError`` work.
"""


class Error(Exception):
    """Any failure ferry reports. ``code`` names the kind; ``retryable`` says whether repeating
    the same operation later may succeed."""

    code = "error"
    retryable = False


class InvalidArgument(Error, ValueError):
    """An argument or option is out of its documented range (HIXL ``PARAM_INVALID``)."""

    code = "invalid_argument"


class Timeout(Error, TimeoutError):
    """A bounded wait ran out (HIXL ``TIMEOUT``). Retryable."""

    code = "timeout"
    retryable = True


class NotConnected(Error, ConnectionError):
    """The operation names a peer this engine has no link to (HIXL ``NOT_CONNECTED``)."""

    code = "not_connected"
    retryable = True


class AlreadyConnected(Error):
    """``connect`` was called for a peer that is already connected (HIXL ``ALREADY_CONNECTED``)."""

    code = "already_connected"


class ResourceExhausted(Error):
    """A configured limit was reached: links, pending notifications, staging buffers, memory."""

    code = "resource_exhausted"


class Unsupported(Error):
    """The feature, transport or device is not available in this build or on this host."""

    code = "unsupported"


class PermissionDenied(Error):
    """The region is unknown to the peer, or lacks the access the operation needs."""

    code = "permission_denied"


class OutOfBounds(Error, IndexError):
    """A range lies outside the region it names, or outside every registered region."""

    code = "out_of_bounds"


class PeerClosed(Error, ConnectionError):
    """The peer closed the link, or died, while the operation was outstanding. Retryable."""

    code = "peer_closed"
    retryable = True


class Protocol(Error):
    """The peer sent something the protocol does not allow."""

    code = "protocol"


class Internal(Error):
    """A fault inside this process, not the peer's doing: a bug to report."""

    code = "internal"


class Integrity(Error):
    """A transfer that asked for integrity found the destination's bytes differ from the source's
    (their checksums): corrupted on the way or after landing, or changed at either end while it ran.
    For a read, nothing is promised about the destination's bytes. Retryable."""

    code = "integrity"
    retryable = True


class IoError(Error, OSError):
    """An operating-system call failed."""

    code = "io"


__all__ = [
    "Error",
    "InvalidArgument",
    "Timeout",
    "NotConnected",
    "AlreadyConnected",
    "ResourceExhausted",
    "Unsupported",
    "PermissionDenied",
    "OutOfBounds",
    "PeerClosed",
    "Protocol",
    "Internal",
    "Integrity",
    "IoError",
]
