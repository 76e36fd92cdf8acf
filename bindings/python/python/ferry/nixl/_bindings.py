"""What NIXL's compiled module ``nixl._bindings`` gives Python, for programs that import it directly:
its exception classes (one per failing status, raised by name, so that ``except nixlNotFoundError``
in a program written for NIXL means the same here), its enumerations and constants, and its
descriptor lists.

A descriptor list holds its ``(addr, len, dev)`` triples in an N×3 ``uint64`` numpy array, the form
ferry's transfers take without a Python object per descriptor; registration lists add one ``bytes``
of metadata per descriptor, as NIXL's do.
"""

import enum
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np


class nixlNotPostedError(Exception):
    """NIXL_ERR_NOT_POSTED."""


class nixlInvalidParamError(Exception):
    """NIXL_ERR_INVALID_PARAM: an argument is out of range (an index, a length, a handle)."""


class nixlBackendError(Exception):
    """NIXL_ERR_BACKEND: ferry failed the operation; the message and ``__cause__`` say why."""


class nixlNotFoundError(Exception):
    """NIXL_ERR_NOT_FOUND: an unknown agent, or memory that is not registered."""


class nixlMismatchError(Exception):
    """NIXL_ERR_MISMATCH."""


class nixlNotAllowedError(Exception):
    """NIXL_ERR_NOT_ALLOWED: metadata that contradicts what was loaded for the same agent."""


class nixlRepostActiveError(Exception):
    """NIXL_ERR_REPOST_ACTIVE: the transfer is still in flight."""


class nixlUnknownError(Exception):
    """NIXL_ERR_UNKNOWN."""


class nixlNotSupportedError(Exception):
    """NIXL_ERR_NOT_SUPPORTED: something ferry does not do (GPU memory, storage, a metadata server)."""


class nixlRemoteDisconnectError(Exception):
    """NIXL_ERR_REMOTE_DISCONNECT: the link to the remote agent closed."""


class nixlCancelledError(Exception):
    """NIXL_ERR_CANCELED."""


class nixlNoTelemetryError(Exception):
    """NIXL_ERR_NO_TELEMETRY: the agent was made without ``capture_telemetry``."""


class nixl_mem_t(enum.IntEnum):
    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


class nixl_xfer_op_t(enum.IntEnum):
    NIXL_READ = 0
    NIXL_WRITE = 1


class nixl_status_t(enum.IntEnum):
    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9
    NIXL_ERR_REMOTE_DISCONNECT = -10
    NIXL_ERR_CANCELED = -11
    NIXL_ERR_NO_TELEMETRY = -12


class nixl_thread_sync_t(enum.IntEnum):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0


class nixl_cost_t(enum.IntEnum):
    NIXL_COST_ANALYTICAL_BACKEND = 0


DRAM_SEG = nixl_mem_t.DRAM_SEG
VRAM_SEG = nixl_mem_t.VRAM_SEG
BLK_SEG = nixl_mem_t.BLK_SEG
OBJ_SEG = nixl_mem_t.OBJ_SEG
FILE_SEG = nixl_mem_t.FILE_SEG
NIXL_READ = nixl_xfer_op_t.NIXL_READ
NIXL_WRITE = nixl_xfer_op_t.NIXL_WRITE
NIXL_IN_PROG = nixl_status_t.NIXL_IN_PROG
NIXL_SUCCESS = nixl_status_t.NIXL_SUCCESS
NIXL_ERR_NOT_POSTED = nixl_status_t.NIXL_ERR_NOT_POSTED
NIXL_ERR_INVALID_PARAM = nixl_status_t.NIXL_ERR_INVALID_PARAM
NIXL_ERR_BACKEND = nixl_status_t.NIXL_ERR_BACKEND
NIXL_ERR_NOT_FOUND = nixl_status_t.NIXL_ERR_NOT_FOUND
NIXL_ERR_MISMATCH = nixl_status_t.NIXL_ERR_MISMATCH
NIXL_ERR_NOT_ALLOWED = nixl_status_t.NIXL_ERR_NOT_ALLOWED
NIXL_ERR_REPOST_ACTIVE = nixl_status_t.NIXL_ERR_REPOST_ACTIVE
NIXL_ERR_UNKNOWN = nixl_status_t.NIXL_ERR_UNKNOWN
NIXL_ERR_NOT_SUPPORTED = nixl_status_t.NIXL_ERR_NOT_SUPPORTED
NIXL_ERR_REMOTE_DISCONNECT = nixl_status_t.NIXL_ERR_REMOTE_DISCONNECT
NIXL_ERR_CANCELED = nixl_status_t.NIXL_ERR_CANCELED
NIXL_ERR_NO_TELEMETRY = nixl_status_t.NIXL_ERR_NO_TELEMETRY
NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT
NIXL_COST_ANALYTICAL_BACKEND = nixl_cost_t.NIXL_COST_ANALYTICAL_BACKEND

NIXL_INIT_AGENT = ""
"""The agent name that marks the local side of a prepared list (the C++ value; ``nixl_agent`` also
takes the string ``"NIXL_INIT_AGENT"``)."""

DEFAULT_COMM_PORT = 8888
HAVE_UCX_GPU_DEVICE_API = False

_U64 = (1 << 64) - 1
_Desc3 = Tuple[int, int, int]


def _triple(desc: Any, width: int) -> _Desc3:
    if not isinstance(desc, tuple):
        raise TypeError("each descriptor must be a tuple")
    if len(desc) != width:
        raise ValueError(f"each descriptor tuple must have exactly {width} elements")
    values = tuple(int(v) for v in desc[:3])
    for v in values:
        if not 0 <= v <= _U64:
            raise ValueError(f"descriptor field {v} does not fit in 64 bits unsigned")
    return values[0], values[1], values[2]


def _meta(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"descriptor metadata must be bytes or str, not {type(value).__name__}")


def _array(descs: Any) -> np.ndarray:
    if not isinstance(descs, np.ndarray) or descs.ndim != 2 or descs.shape[1] != 3:
        raise ValueError("descs must be a Nx3 numpy array")
    if descs.dtype not in (np.dtype(np.uint64), np.dtype(np.int64)):
        raise ValueError("descs must be a Nx3 numpy array of uint64 or int64")
    if descs.dtype == np.int64 and descs.size and int(descs.min()) < 0:
        raise ValueError("descriptor fields must not be negative")
    return np.array(descs, dtype=np.uint64, order="C", copy=True)


class _DescList:
    """The part both list kinds share: the N×3 array, its memory type, and list behaviour."""

    _rows: np.ndarray
    _type: nixl_mem_t

    def getType(self) -> nixl_mem_t:
        return self._type

    def descCount(self) -> int:
        return int(self._rows.shape[0])

    def isEmpty(self) -> bool:
        return int(self._rows.shape[0]) == 0

    def __len__(self) -> int:
        return int(self._rows.shape[0])

    def __bool__(self) -> bool:
        return True

    def _position(self, i: int) -> int:
        n = self._rows.shape[0]
        j = int(i)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"descriptor index {i} out of range for a list of {n}")
        return j

    def _remove_row(self, i: int) -> None:
        self._rows = np.delete(self._rows, self._position(i), axis=0)

    def _append_row(self, row: _Desc3) -> None:
        self._rows = np.vstack([self._rows, np.array([row], dtype=np.uint64)])

    def addr_len(self) -> np.ndarray:
        """The N×3 ``uint64`` array of ``(addr, len, dev)`` rows (a copy)."""
        return self._rows.copy()


class nixlXferDList(_DescList):
    """Descriptors of a transfer: ``(addr, len, dev)``."""

    def __init__(self, type: nixl_mem_t, descs: Union[int, Sequence[Any], np.ndarray, None] = None) -> None:
        self._type = nixl_mem_t(type)
        if descs is None or isinstance(descs, int):
            self._rows = np.zeros((int(descs or 0), 3), dtype=np.uint64)
        elif isinstance(descs, np.ndarray):
            self._rows = _array(descs)
        else:
            rows = [_triple(d, 3) for d in descs]
            self._rows = np.array(rows, dtype=np.uint64).reshape(len(rows), 3)

    def __getitem__(self, i: int) -> _Desc3:
        r = self._rows[self._position(i)]
        return int(r[0]), int(r[1]), int(r[2])

    def __setitem__(self, i: int, desc: Tuple[int, int, int]) -> None:
        self._rows[self._position(i)] = _triple(desc, 3)

    def __iter__(self) -> Iterator[_Desc3]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, nixlXferDList):
            return NotImplemented
        return self._type == other._type and np.array_equal(self._rows, other._rows)

    __hash__ = None  # type: ignore[assignment]

    def addDesc(self, desc: Tuple[int, int, int]) -> None:
        self._append_row(_triple(desc, 3))

    def append(self, desc: Tuple[int, int, int]) -> None:
        self._append_row(_triple(desc, 3))

    def index(self, desc: Tuple[int, int, int]) -> int:
        hits = np.flatnonzero((self._rows == np.array(_triple(desc, 3), dtype=np.uint64)).all(axis=1))
        if hits.size == 0:
            raise nixlNotFoundError("NIXL_ERR_NOT_FOUND: no such descriptor in the list")
        return int(hits[0])

    def remDesc(self, i: int) -> None:
        self._remove_row(i)

    def clear(self) -> None:
        self._rows = np.zeros((0, 3), dtype=np.uint64)

    def print(self) -> None:
        print(repr(self))

    def __repr__(self) -> str:
        return f"nixlXferDList({self._type.name}, {[self[i] for i in range(len(self))]})"


class nixlRegDList(_DescList):
    """Descriptors of a registration: ``(addr, len, dev, meta)``; ``trim()`` drops the metadata."""

    def __init__(self, type: nixl_mem_t, descs: Union[int, Sequence[Any], np.ndarray, None] = None) -> None:
        self._type = nixl_mem_t(type)
        self._owners: List[Optional[object]] = []
        if descs is None or isinstance(descs, int):
            n = int(descs or 0)
            self._rows = np.zeros((n, 3), dtype=np.uint64)
            self._metas: List[bytes] = [b""] * n
        elif isinstance(descs, np.ndarray):
            self._rows = _array(descs)
            self._metas = [b""] * self._rows.shape[0]
        else:
            rows = []
            metas = []
            for d in descs:
                rows.append(_triple(d, 4))
                metas.append(_meta(d[3]))
            self._rows = np.array(rows, dtype=np.uint64).reshape(len(rows), 3)
            self._metas = metas
        self._owners = [None] * len(self._metas)

    def __getitem__(self, i: int) -> Tuple[int, int, int, bytes]:
        j = self._position(i)
        r = self._rows[j]
        return int(r[0]), int(r[1]), int(r[2]), self._metas[j]

    def __setitem__(self, i: int, desc: Tuple[int, int, int, Any]) -> None:
        j = self._position(i)
        self._rows[j] = _triple(desc, 4)
        self._metas[j] = _meta(desc[3])
        self._owners[j] = None

    def __iter__(self) -> Iterator[Tuple[int, int, int, bytes]]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, nixlRegDList):
            return NotImplemented
        return (
            self._type == other._type and np.array_equal(self._rows, other._rows) and self._metas == other._metas
        )

    __hash__ = None  # type: ignore[assignment]

    def addDesc(self, desc: Tuple[int, int, int, Any]) -> None:
        self._append_row(_triple(desc, 4))
        self._metas.append(_meta(desc[3]))
        self._owners.append(None)

    def append(self, desc: Tuple[int, int, int, Any]) -> None:
        self.addDesc(desc)

    def index(self, desc: Tuple[int, int, int, Any]) -> int:
        want = _triple(desc, 4)
        meta = _meta(desc[3])
        for j in range(len(self)):
            if tuple(int(v) for v in self._rows[j]) == want and self._metas[j] == meta:
                return j
        raise nixlNotFoundError("NIXL_ERR_NOT_FOUND: no such descriptor in the list")

    def trim(self) -> nixlXferDList:
        return nixlXferDList(self._type, self._rows)

    def remDesc(self, i: int) -> None:
        j = self._position(i)
        self._remove_row(j)
        del self._metas[j]
        del self._owners[j]

    def clear(self) -> None:
        self._rows = np.zeros((0, 3), dtype=np.uint64)
        self._metas = []
        self._owners = []

    def print(self) -> None:
        print(repr(self))

    def __repr__(self) -> str:
        return f"nixlRegDList({self._type.name}, {[self[i] for i in range(len(self))]})"


class nixlXferTelemetry:
    """What a finished transfer cost: times in microseconds, bytes, descriptors."""

    def __init__(self, startTime: int, postDuration: int, xferDuration: int, totalBytes: int, descCount: int) -> None:
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self) -> str:
        return (
            f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
            f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, descCount={self.descCount})"
        )
