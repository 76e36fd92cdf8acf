"""ferry: move bytes between registered memory of processes on different hosts, from asyncio.

An :class:`Engine` registers memory, connects to peers and runs batched one-sided READ and WRITE
transfers into the memory they registered, over the best transport both sides have (same-host
shared memory, RDMA, TCP)::

    import asyncio, ferry, numpy as np

    async def main():
        with ferry.Engine(listen="127.0.0.1:0") as engine:
            kv = np.zeros((64, 4096), dtype=np.uint8)
            region = engine.register(kv)
            peer = await engine.connect("10.0.0.7:5000", timeout=1.0)
            remote = peer.regions()[0]
            descs = np.array([[region.addr, remote.addr, kv.nbytes]], dtype=np.uint64)
            await engine.transfer(peer, "write", descs, timeout=5.0)
            await engine.notify(peer, "kv", "layer 0 ready")

    asyncio.run(main())

Every coroutine runs on ferry's own threads without the GIL; errors are subclasses of
:class:`ferry.Error`, one per kind of failure.
"""

import enum as _enum

from . import _errors, _ferry
from ._errors import *  # noqa: F401,F403  (the exception classes)
from ._ferry import (
    Engine,
    Notification,
    NotificationStream,
    Peer,
    PreparedTransfer,
    Region,
    RemoteRegion,
    TransferHandle,
    TransferStatus,
    __version__,
    capabilities,
)


class Access(_enum.IntFlag):
    """What peers may do to a registered region."""

    READ = 1
    WRITE = 2
    READ_WRITE = 3


READ = Access.READ
WRITE = Access.WRITE
READ_WRITE = Access.READ_WRITE

__all__ = ["Access", "READ", "WRITE", "READ_WRITE"] + _ferry.__all__ + _errors.__all__
