"""Type stubs of the extension module; the package re-exports everything here."""

import os
from typing import Any, AsyncIterator, Awaitable, Dict, Generator, List, Literal, Optional, Sequence, Tuple, Union, final

__all__ = [
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
]

_Descriptors = Union[Sequence[Tuple[int, int, int]], Any]
"""A list of ``(local_addr, remote_addr, length)`` tuples, or an N×3 numpy ``uint64`` array."""

__version__: str

def capabilities() -> Dict[str, Any]:
    """What this build can do on this host: version, protocol version, transports (compiled in,
    usable here, and why not), RDMA devices and rails, Vulkan devices, and the engine directories
    the package can publish in (``directories``: etcd, compiled in or not)."""

@final
class TransferStatus:
    WAITING: "TransferStatus"
    COMPLETED: "TransferStatus"
    TIMEOUT: "TransferStatus"
    FAILED: "TransferStatus"

@final
class TransferHandle:
    """A transfer started by :meth:`Engine.transfer_async`."""

    def status(self) -> TransferStatus:
        """Where it stands now; never blocks."""
    def __await__(self) -> Generator[Any, None, None]:
        """Waits until it is done; raises its error if it failed."""

@final
class PreparedTransfer:
    """A batch resolved once by :meth:`Engine.prepare`."""

    def __len__(self) -> int: ...

@final
class Notification:
    name: str
    msg: str
    from_engine: int
    from_addr: str
    from_identity: Optional[str]

@final
class NotificationStream:
    def __aiter__(self) -> "NotificationStream": ...
    def __anext__(self) -> Awaitable[Notification]: ...

@final
class RemoteRegion:
    """A region a peer advertised: what descriptors name on the remote side."""

    addr: int
    length: int
    access: int
    persistent: bool

@final
class Peer:
    """A link to a remote engine."""

    @property
    def addr(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def engine_id(self) -> int: ...
    @property
    def transport(self) -> str:
        """"shm", "rdma" or "tcp": the data path picked for this link."""
    @property
    def closed(self) -> bool: ...
    @property
    def passed_over(self) -> List[Tuple[str, str]]:
        """The better data paths this link could not take, as ``(transport, reason)`` pairs."""
    def regions(self) -> List[RemoteRegion]: ...
    def routes(self) -> List[Dict[str, Any]]:
        """How transfers to each advertised region travel: ``addr``, ``length``, ``transport``,
        ``how`` and ``passed_over`` (why the link's better path does not carry it, or None)."""

@final
class Region:
    """Memory registered with an engine; stays registered until :meth:`deregister`."""

    addr: int
    length: int
    kind: str
    persistent: bool
    @property
    def access(self) -> int: ...
    def __len__(self) -> int: ...
    def addr_at(self, offset: int) -> int: ...
    def addr_for(self, peer: str) -> int: ...
    def read(self, offset: int = 0, length: Optional[int] = None) -> bytes: ...
    def write(self, offset: int, data: Any) -> None: ...
    def persist(self, offset: int, length: int) -> None: ...
    async def grant(self, peer: str, access: int = 3) -> None: ...
    async def grant_all(self, access: int = 3) -> None: ...
    async def revoke(self, peer: str) -> None: ...
    async def revoke_all(self) -> None: ...
    def deregister(self) -> None: ...

@final
class Engine:
    """A transfer engine (HIXL ``Initialize``)."""

    def __new__(
        cls,
        listen: Optional[str] = None,
        *,
        buffer_pool: Optional[str] = None,
        transports: Optional[Sequence[str]] = None,
        streams: Optional[int] = None,
        max_links: Optional[int] = None,
        max_inflight_bytes: Optional[int] = None,
        max_pending_notifications: Optional[int] = None,
        name: Optional[str] = None,
        tls_cert: Optional[Union[str, "os.PathLike[str]"]] = None,
        tls_key: Optional[Union[str, "os.PathLike[str]"]] = None,
        tls_ca: Optional[Union[str, "os.PathLike[str]"]] = None,
        tls_psk: Optional[bytes] = None,
        tls_name: Optional[str] = None,
        tls_server_name: Optional[str] = None,
        encrypt: bool = False,
        data_protection: Optional[Literal["plain", "integrity", "encrypted"]] = None,
        directory: Optional[str] = None,
        directory_prefix: Optional[str] = None,
        directory_ttl: float = 10.0,
        path_policy: Optional[str] = None,
        integrity: bool = False,
        stage_gpu_memory: bool = True,
    ) -> "Engine": ...
    @property
    def id(self) -> int: ...
    @property
    def local_addr(self) -> Optional[str]: ...
    @property
    def transports(self) -> List[str]: ...
    @property
    def region_count(self) -> int: ...
    @property
    def link_count(self) -> int: ...
    def register(self, obj: Any, access: int = 3) -> Region:
        """Registers a writable C-contiguous buffer (bytearray, numpy array, mmap), or a
        C-contiguous CUDA array (``__cuda_array_interface__``: a CUDA tensor; or DLPack's
        ``__dlpack__`` on a CUDA device: a JAX or TensorFlow array) as CUDA device memory, kept
        alive until deregistered."""
    def register_ptr(self, addr: int, length: int, access: int = 3, owner: Any = None) -> Region:
        """Registers raw memory (``tensor.data_ptr()``) the caller keeps valid; ``owner`` is kept
        alive until deregistered. CUDA device memory (asked of the driver) is registered as such,
        staged (``Region.kind`` says so); an unmapped range is refused."""
    def alloc_host(self, length: int, access: int = 3) -> Region: ...
    def register_file(
        self, path: Union[str, "os.PathLike[str]"], length: int, offset: int = 0, access: int = 3
    ) -> Region: ...
    def deregister(self, region: Region) -> None: ...
    def regions(self) -> List[Region]: ...
    async def connect(
        self,
        addr: str,
        timeout: float = 1.0,
        *,
        path_policy: Optional[str] = None,
        stage_gpu_memory: Optional[bool] = None,
    ) -> Peer: ...
    async def connect_by_name(self, name: str, timeout: float = 1.0) -> Peer:
        """Connects to the engine published under ``name`` in this engine's directory."""
    async def lookup(self, name: str, timeout: float = 1.0) -> Dict[str, Any]:
        """The record the engine ``name`` published in this engine's directory."""
    async def disconnect(self, peer: Peer, timeout: float = 1.0) -> None: ...
    def peers(self) -> List[Peer]: ...
    async def transfer(
        self, peer: Peer, op: str, descs: _Descriptors, *, timeout: float = 10.0, durability: str = "completed"
    ) -> None: ...
    def transfer_blocking(
        self, peer: Peer, op: str, descs: _Descriptors, *, timeout: float = 10.0, durability: str = "completed"
    ) -> None: ...
    def transfer_async(
        self, peer: Peer, op: str, descs: _Descriptors, *, timeout: float = 10.0, durability: str = "completed"
    ) -> TransferHandle: ...
    def prepare(self, peer: Peer, op: str, descs: _Descriptors, *, durability: str = "completed") -> PreparedTransfer: ...
    async def transfer_prepared(self, prepared: PreparedTransfer, *, timeout: float = 10.0) -> None: ...
    async def notify(self, peer: Peer, name: str, msg: str, *, timeout: float = 1.0) -> None: ...
    def take_notifications(self) -> List[Notification]: ...
    def notifications(self) -> AsyncIterator[Notification]: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Engine": ...
    def __exit__(self, *exc: Any) -> None: ...
    async def __aenter__(self) -> "Engine": ...
    async def __aexit__(self, *exc: Any) -> None: ...
