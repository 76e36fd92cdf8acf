"""``nixl._api``: where NIXL programs import the agent from (``from nixl._api import nixl_agent,
nixl_agent_config``)."""

from ._agent import (
    FERRY_PLUGIN,
    SERVED_PLUGINS,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_xfer_handle,
)
from ._bindings import DEFAULT_COMM_PORT, nixl_thread_sync_t

__all__ = [
    "DEFAULT_COMM_PORT",
    "FERRY_PLUGIN",
    "SERVED_PLUGINS",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]
