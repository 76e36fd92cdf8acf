"""``ferry.nixl``: NIXL's Python agent API (``nixl._api``) on ferry's engine, so that programs
written for NIXL run on ferry unchanged::

    python -m ferry.nixl your_program.py ARGS      # or: python -m ferry.nixl -m your.module ARGS

The runner makes ``nixl``, ``nixl._api``, ``nixl._bindings``, ``nixl._utils`` and ``nixl.logging``
resolve to this package's modules in that program (and in Python processes it starts); without it,
``import nixl`` still finds a real NIXL installation. Code written for ferry can use the agent
directly: ``from ferry.nixl import nixl_agent, nixl_agent_config``.

Host memory (``"DRAM"``) and CUDA device memory (``"VRAM"``, named by device pointers, staged
between the GPU and host buffers). Everything exchanged between processes
(agent metadata, serialized descriptor lists, notifications) is in ferry.nixl's own versioned,
bounds-checked formats, never pickled.
"""

from . import _api, _bindings, _utils, logging
from ._api import (
    DEFAULT_COMM_PORT,
    FERRY_PLUGIN,
    SERVED_PLUGINS,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)
from ._runner import install

__all__ = [
    "DEFAULT_COMM_PORT",
    "FERRY_PLUGIN",
    "SERVED_PLUGINS",
    "install",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]
