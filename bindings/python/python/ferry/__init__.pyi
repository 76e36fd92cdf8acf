import enum

from ._errors import (
    AlreadyConnected as AlreadyConnected,
    Error as Error,
    Integrity as Integrity,
    Internal as Internal,
    InvalidArgument as InvalidArgument,
    IoError as IoError,
    NotConnected as NotConnected,
    OutOfBounds as OutOfBounds,
    PeerClosed as PeerClosed,
    PermissionDenied as PermissionDenied,
    Protocol as Protocol,
    ResourceExhausted as ResourceExhausted,
    Timeout as Timeout,
    Unsupported as Unsupported,
)
from ._ferry import (
    Engine as Engine,
    Notification as Notification,
    NotificationStream as NotificationStream,
    Peer as Peer,
    PreparedTransfer as PreparedTransfer,
    Region as Region,
    RemoteRegion as RemoteRegion,
    TransferHandle as TransferHandle,
    TransferStatus as TransferStatus,
    __version__ as __version__,
    capabilities as capabilities,
)

class Access(enum.IntFlag):
    READ = 1
    WRITE = 2
    READ_WRITE = 3

READ: Access
WRITE: Access
READ_WRITE: Access

__all__ = [
    "Access",
    "READ",
    "WRITE",
    "READ_WRITE",
    "Engine",
    "Notification",
    "NotificationStream",
    "Peer",
    "PreparedTransfer",
    "Region",
    "RemoteRegion",
    "TransferHandle",
    "TransferStatus",
    "capabilities",
    "__version__",
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
