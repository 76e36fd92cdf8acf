"""``nixl_agent`` on a ferry engine: NIXL's synchronous agent API, so that a program written for
NIXL (vLLM's ``NixlConnector`` and the like) moves its bytes with ferry unchanged.

NIXL's calls return at once and are polled (``transfer`` then ``check_xfer_state``); ferry's are
coroutines. Each agent owns one event-loop thread for what only exists as a coroutine (connecting,
notifying, a prepared batch followed by its notification); a transfer without a notification is
started with ``Engine.transfer_async`` from the caller's thread and polled without crossing threads.

A transfer's notification is sent once its batch completed, on the same link: ferry never lets a
notification overtake the data of transfers that completed before it was sent, so the remote agent
sees it only once every byte is in place. ``check_xfer_state`` says ``"DONE"`` once both happened.
"""

import asyncio
import concurrent.futures
import itertools
import os
import socket
import threading
import time
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple, TypeVar, Union

import numpy as np

import ferry

from . import _wire
from ._bindings import (
    DEFAULT_COMM_PORT,
    nixl_mem_t,
    nixl_thread_sync_t,
    nixlBackendError,
    nixlInvalidParamError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlXferDList,
    nixlXferTelemetry,
)
from .logging import get_logger

logger = get_logger(__name__)

nixl_backend_handle = int

FERRY_PLUGIN = "FERRY"
"""The one plugin ``ferry.nixl`` has: ferry's engine, over whichever transport each link picked."""

SERVED_PLUGINS = ("UCX", "UCX_MO", "LIBFABRIC", "UCCL", "MOONCAKE")
"""NIXL's network plugins a program may name in ``backends``: each is served by ferry's engine, so
``nixl_agent_config(backends=["UCX"])`` and ``register_memory(..., backends=["UCX"])`` work as
written (``get_plugin_list`` still says ``["FERRY"]``)."""

_MEM_TYPES = ["DRAM_SEG", "VRAM_SEG"]
_NO_DEVICE_API = (
    "NIXL_ERR_NOT_SUPPORTED: ferry has no GPU device API: transfers are posted from the host, "
    "CUDA memory included"
)


def _no_storage(kind: str) -> str:
    return f"NIXL_ERR_NOT_SUPPORTED: ferry moves memory between processes; {kind} is storage, which it does not do"


class nixl_agent_config:
    """NIXL's agent configuration; ``ferry.nixl`` adds keyword-only options of its own.

    Args:
        enable_prog_thread, num_threads: accepted as NIXL takes them; ferry runs its own threads.
        enable_listen_thread: answer other agents' ``send_local_metadata``,
            ``fetch_remote_metadata`` and ``invalidate_local_metadata``; the agent's ferry engine
            then listens on ``listen_port`` (unless ``listen_addr`` names a port), and the
            exchange travels over ferry notifications, in a format of ferry.nixl's own.
        listen_port: the port of the listener above (NIXL's default 8888; 0 for any).
        capture_telemetry: keep per-transfer telemetry for ``get_xfer_telemetry``.
        backends: plugin names to start: ``"FERRY"`` or a network plugin of NIXL's that ferry
            serves (``SERVED_PLUGINS``); others are skipped with a warning, as NIXL skips a missing
            plugin.
        sync_mode: a ``nixl_thread_sync_t``; every agent here is thread-safe.
        listen_addr: where the agent's ferry engine listens, ``host`` or ``host:port`` (default
            ``$FERRY_NIXL_LISTEN``, else ``127.0.0.1``, any port).
        transports: ferry transports to offer (default ``$FERRY_NIXL_TRANSPORTS``, comma-separated,
            else all this build has).
        xfer_timeout: seconds after which a transfer (or notification) that has not completed
            fails (default ``$FERRY_NIXL_TIMEOUT``, else 60); NIXL has no such bound.
        engine_options: more keyword arguments for ``ferry.Engine`` (``buffer_pool``, ``streams``,
            TLS: ``tls_cert``/``tls_key``/``tls_ca`` or ``tls_psk``/``tls_name``...).
    """

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: Optional[List[str]] = None,
        sync_mode: Optional[nixl_thread_sync_t] = None,
        *,
        listen_addr: Optional[str] = None,
        transports: Optional[Sequence[str]] = None,
        xfer_timeout: Optional[float] = None,
        engine_options: Optional[Dict[str, Any]] = None,
    ) -> None:
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.backends: List[str] = ["UCX"] if backends is None else list(backends)
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode
        self.listen_addr = listen_addr
        self.transports = list(transports) if transports is not None else None
        self.xfer_timeout = xfer_timeout
        self.engine_options: Dict[str, Any] = dict(engine_options or {})


def _listen_addr(conf: nixl_agent_config) -> str:
    """``listen_addr`` (or ``$FERRY_NIXL_LISTEN``, or ``127.0.0.1``) with its port, else
    ``listen_port`` when the listener is enabled, else any port."""
    addr = conf.listen_addr or os.environ.get("FERRY_NIXL_LISTEN") or "127.0.0.1"
    port = int(conf.port) if conf.enable_listen else 0
    if not 0 <= port < 65536:
        raise ValueError(f"listen_port {port} is out of range")
    if addr.startswith("["):
        return addr if "]:" in addr else f"{addr}:{port}"
    return addr if ":" in addr else f"{addr}:{port}"


DEFAULT_ETCD_NAMESPACE = "/nixl/agents"
"""The key prefix of the agents' records in etcd when ``NIXL_ETCD_NAMESPACE`` is not set."""

DEFAULT_METADATA_LABEL = "metadata"
"""The label of an agent's whole metadata on the metadata server, as NIXL names it."""

ETCD_FETCH_WAIT = 5.0
"""How long ``fetch_remote_metadata`` through etcd waits for the agent to appear, as NIXL's does."""


def _etcd_url() -> Optional[str]:
    """``$NIXL_ETCD_ENDPOINTS`` (``http://h:2379[,http://h2:2379]``, as NIXL takes it) as the URL
    of ferry's etcd directory, or None when it is not set."""
    raw = os.environ.get("NIXL_ETCD_ENDPOINTS", "").strip()
    if not raw:
        return None
    hosts, schemes = [], set()
    for endpoint in raw.split(","):
        endpoint = endpoint.strip()
        if not endpoint:
            continue
        scheme, sep, rest = endpoint.partition("://")
        if not sep:
            scheme, rest = "http", endpoint
        rest = rest.rstrip("/")
        if scheme not in ("http", "https") or not rest or "/" in rest:
            raise nixlInvalidParamError(
                f"NIXL_ERR_INVALID_PARAM: NIXL_ETCD_ENDPOINTS: {endpoint!r} is not http://HOST:PORT or https://HOST:PORT"
            )
        schemes.add(scheme)
        hosts.append(rest)
    if not hosts or len(schemes) != 1:
        raise nixlInvalidParamError(
            "NIXL_ERR_INVALID_PARAM: NIXL_ETCD_ENDPOINTS must list endpoints of one scheme, http:// or https://"
        )
    return ("etcds://" if "https" in schemes else "etcd://") + ",".join(hosts)


def _peer_addr(ip_addr: Any, port: Any) -> str:
    """``ip:port`` of another agent's listener for the metadata exchange (a call without one goes
    to the metadata server instead: see ``nixl_agent._need_directory``)."""
    if not isinstance(ip_addr, str) or len(ip_addr) > _wire.MAX_ADDR_CHARS:
        raise nixlInvalidParamError("NIXL_ERR_INVALID_PARAM: ip_addr must be a host name or address")
    if type(port) is not int or not 0 < port < 65536:
        raise nixlInvalidParamError(f"NIXL_ERR_INVALID_PARAM: port {port!r} is out of range")
    if ":" in ip_addr and not ip_addr.startswith("["):
        ip_addr = f"[{ip_addr}]"
    return f"{ip_addr}:{port}"


_SEND_GRACE = 2.0
"""Seconds ``close`` waits for metadata-exchange messages still being sent before cancelling them."""

_MAX_INBOX = 1 << 16
"""NIXL notification frames the listener keeps for ``get_new_notifs``. When that many wait unread,
the listener stops taking notifications off the engine until some are read, so that the engine's
own bound on pending notifications holds senders back again: none is ever dropped."""


async def _pump(engine: ferry.Engine, ref: "weakref.ReferenceType[nixl_agent]") -> None:
    """The agent's listener: takes every ferry notification as it arrives, hands metadata-exchange
    frames to the agent and keeps NIXL notifications for ``get_new_notifs``. Holds the agent only
    weakly, so that an agent nobody holds is still collected."""
    stream = engine.notifications()
    while True:
        agent = ref()
        if agent is None:
            return
        full = agent._inbox_full()
        del agent
        if full:
            await asyncio.sleep(0.01)
            continue
        try:
            n = await stream.__anext__()
        except StopAsyncIteration:
            return
        except ferry.Error as e:
            logger.debug("the metadata listener stops: %s", e)
            return
        agent = ref()
        if agent is None:
            return
        try:
            agent._on_notification(n)
        except Exception:  # noqa: BLE001 - one bad frame must not stop the listener
            logger.exception("the metadata listener dropped a notification")
        del agent


_T = TypeVar("_T")


def _known(table: Dict[str, _T], backend: str, missing: str, empty: _T) -> _T:
    """``table[backend]``, or ``empty`` with NIXL's warning ``missing`` when it has no entry."""
    if backend not in table:
        logger.warning(missing, backend)
        return empty
    return table[backend]


def _advertised(local_addr: str) -> str:
    """The address other processes dial: the listening one, unless it is a wildcard."""
    host, _, port = local_addr.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::"):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    return f"{host}:{port}"


def _name(agent: Union[str, bytes]) -> str:
    if isinstance(agent, bytes):
        return agent.decode()
    if not isinstance(agent, str):
        raise TypeError(f"an agent name is str (or the bytes add_remote_agent returns), not {type(agent).__name__}")
    return agent


def _as_bytes(msg: Union[bytes, str, bytearray, memoryview]) -> bytes:
    if isinstance(msg, bytes):
        return msg
    if isinstance(msg, str):
        return msg.encode()
    if isinstance(msg, (bytearray, memoryview)):
        return bytes(msg)
    raise TypeError(f"a notification is bytes (or str), not {type(msg).__name__}")


def _as_nixl_error(e: BaseException, what: str) -> Exception:
    if isinstance(e, (ferry.PeerClosed, ferry.NotConnected)):
        return nixlRemoteDisconnectError(f"NIXL_ERR_REMOTE_DISCONNECT: {what}: {e}")
    if isinstance(e, ferry.Unsupported):
        return nixlNotSupportedError(f"NIXL_ERR_NOT_SUPPORTED: {what}: {e}")
    if isinstance(e, ferry.InvalidArgument):
        return nixlInvalidParamError(f"NIXL_ERR_INVALID_PARAM: {what}: {e}")
    return nixlBackendError(f"NIXL_ERR_BACKEND: {what}: {e}")


async def _send_frames(engine: ferry.Engine, peer: ferry.Peer, frames: List[Tuple[str, str]], timeout: float) -> None:
    """Sends one ferry.nixl message, frame after frame, as notifications to ``peer``."""
    for name, body in frames:
        await engine.notify(peer, name, body, timeout=timeout)


def _linked(engine: ferry.Engine, engine_id: int) -> Optional[ferry.Peer]:
    """The open link of ``engine`` to the engine ``engine_id``, if it has one (a link made for the
    metadata exchange serves transfers too)."""
    for p in engine.peers():
        if p.engine_id == engine_id and not p.closed:
            return p
    return None


class _Coverage:
    """Which address ranges a set of registered regions covers, checked for N descriptors at once:
    a descriptor is covered when one region holds all of it."""

    _TOP = (1 << 64) - 1

    def __init__(self, regions: Iterable[Tuple[int, int]]) -> None:
        pairs = sorted((int(a), int(n)) for a, n in regions)
        self.regions = tuple(pairs)
        self.starts = np.array([a for a, _ in pairs], dtype=np.uint64)
        ends = np.array([min(a + n, self._TOP) for a, n in pairs], dtype=np.uint64)
        self.max_ends = np.maximum.accumulate(ends) if len(pairs) else ends

    def uncovered(self, rows: np.ndarray) -> Optional[int]:
        """The index of the first row of ``rows`` (N×3: addr, len, dev) no region holds, or None."""
        if rows.shape[0] == 0:
            return None
        if self.starts.size == 0:
            return 0
        addrs = rows[:, 0]
        ends = addrs + rows[:, 1]
        slot = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        reach = self.max_ends[np.maximum(slot, 0)]
        bad = np.flatnonzero((slot < 0) | (ends < addrs) | (ends > reach))
        return int(bad[0]) if bad.size else None


class _Remote:
    """An agent this one loaded metadata of: the link to its engine and the memory it registered."""

    def __init__(self, md: _wire.AgentMetadata, peer: ferry.Peer, generation: int) -> None:
        self.md = md
        self.peer = peer
        self.generation = generation
        self.coverage = _Coverage(md.regions)


class _LoopThread:
    """An asyncio event loop on a daemon thread of its own, for ferry's coroutines."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name=f"ferry.nixl {name}", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Any) -> "concurrent.futures.Future[Any]":
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        """Cancels what still runs on the loop (and lets it unwind), then stops the loop."""
        if self.loop.is_closed():
            return

        async def cancel_the_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            self.submit(cancel_the_rest()).result(timeout=5.0)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10.0)
        if not self.thread.is_alive():
            self.loop.close()


def _shutdown(
    loop: _LoopThread,
    engine: ferry.Engine,
    inflight: "weakref.WeakSet[nixl_xfer_handle]",
    pump: "List[asyncio.Task[None]]",
    pool: concurrent.futures.ThreadPoolExecutor,
    closing: threading.Event,
    sends: "Set[concurrent.futures.Future[None]]",
) -> None:
    closing.set()
    for task in pump:

        async def cancel(t: "asyncio.Task[None]" = task) -> None:
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)

        try:
            loop.submit(cancel()).result(timeout=5.0)
        except Exception:
            pass
    # The exchange thread runs coroutines on the loop: let what it is doing end first (bounded).
    try:
        drained = pool.submit(lambda: None)
        pool.shutdown(wait=False)
        drained.result(timeout=15.0)
    except Exception:
        pass
    # Metadata-exchange messages sent just before closing (an invalidation) get a moment to leave.
    concurrent.futures.wait(list(sends), timeout=_SEND_GRACE)
    for x in list(inflight):
        state = x._state
        if isinstance(state, concurrent.futures.Future):
            try:
                state.result(timeout=10.0)
            except Exception:
                pass
    loop.stop()
    engine.close()


class nixl_prepped_dlist_handle:
    """A descriptor list prepared by ``prep_xfer_dlist``, local or for one remote agent; transfers
    pick descriptors from it by index."""

    __slots__ = ("_handle", "_agent", "_released", "_remote", "_generation", "_rows", "__weakref__")

    def __init__(
        self, agent: "nixl_agent", value: int, remote: Optional[str], generation: int, rows: np.ndarray
    ) -> None:
        self._handle = value
        self._agent = agent
        self._released = False
        self._remote = remote
        self._generation = generation
        self._rows = rows

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        self._released = True


class nixl_xfer_handle:
    """A transfer request from ``initialize_xfer`` or ``make_prepped_xfer``: post it with
    ``transfer`` (again once it is done), poll it with ``check_xfer_state``."""

    __slots__ = (
        "_handle",
        "_agent",
        "_released",
        "_op",
        "_remote",
        "_generation",
        "_descs",
        "_prepared",
        "_notif",
        "_state",
        "_posted_ns",
        "_post_ns",
        "_done_ns",
        "__weakref__",
    )

    def __init__(
        self,
        agent: "nixl_agent",
        value: int,
        op: str,
        remote: str,
        generation: int,
        descs: np.ndarray,
        prepared: ferry.PreparedTransfer,
        notif: bytes,
    ) -> None:
        self._handle = value
        self._agent = agent
        self._released = False
        self._op = op
        self._remote = remote
        self._generation = generation
        self._descs = descs
        self._prepared = prepared
        self._notif = notif
        self._state: Union[None, ferry.TransferHandle, "concurrent.futures.Future[None]"] = None
        self._posted_ns = 0
        self._post_ns = 0
        self._done_ns = 0

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._handle:x}, released={self._released})"

    def _in_flight(self) -> bool:
        state = self._state
        if state is None:
            return False
        if isinstance(state, concurrent.futures.Future):
            return not state.done()
        return state.status() == ferry.TransferStatus.WAITING

    def release(self) -> None:
        if self._released:
            return
        if self._in_flight():
            raise nixlRepostActiveError(
                "NIXL_ERR_REPOST_ACTIVE: the transfer is in flight and ferry cannot cancel it; "
                "release the handle once check_xfer_state says DONE"
            )
        self._released = True


class nixl_agent:
    """A NIXL agent on a ferry engine: registers memory, exchanges metadata with other agents,
    reads and writes their registered memory, and sends and receives notifications.

    Args:
        agent_name: the agent's name, unique among the agents that talk to each other.
        nixl_conf: a ``nixl_agent_config``; NIXL's defaults when omitted.
        instantiate_all: start every plugin (here: ``"FERRY"``) when no config is given.
    """

    def __init__(
        self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None, instantiate_all: bool = False
    ) -> None:
        self.name = _wire.check_agent_name(agent_name)
        if nixl_conf and instantiate_all:
            instantiate_all = False
            logger.warning("Ignoring instantiate_all based on the provided config in agent creation.")
        conf = nixl_conf or nixl_agent_config()
        transports = conf.transports
        if transports is None and os.environ.get("FERRY_NIXL_TRANSPORTS"):
            transports = [t for t in os.environ["FERRY_NIXL_TRANSPORTS"].split(",") if t]
        timeout = conf.xfer_timeout
        if timeout is None:
            timeout = float(os.environ.get("FERRY_NIXL_TIMEOUT", "60"))
        if not timeout > 0:
            raise ValueError("xfer_timeout must be positive")
        self._timeout = float(timeout)
        self._telemetry = conf.capture_telemetry
        engine_options = dict(conf.engine_options)
        self._etcd = _etcd_url()
        if self._etcd is not None:
            # NIXL's metadata server, through ferry's directory: the engine publishes itself under
            # the agent's name (on a lease, so a dead agent leaves); metadata is fetched from the
            # agent itself over its ferry link, never stored in etcd.
            engine_options.setdefault("name", self.name)
            engine_options.setdefault("directory", self._etcd)
            engine_options.setdefault(
                "directory_prefix", os.environ.get("NIXL_ETCD_NAMESPACE") or DEFAULT_ETCD_NAMESPACE
            )
        try:
            self._engine = ferry.Engine(_listen_addr(conf), transports=transports, **engine_options)
        except ferry.Error as e:
            raise _as_nixl_error(e, f"starting agent {self.name!r}'s engine") from e
        self._loop = _LoopThread(self.name)
        self._inflight: "weakref.WeakSet[nixl_xfer_handle]" = weakref.WeakSet()
        self._pump_task: "List[asyncio.Task[None]]" = []
        self._exchange_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ferry.nixl md {self.name}")
        self._closing = threading.Event()
        self._sends: "Set[concurrent.futures.Future[None]]" = set()
        self._finalizer = weakref.finalize(
            self, _shutdown, self._loop, self._engine, self._inflight, self._pump_task, self._exchange_pool,
            self._closing, self._sends,
        )

        self._lock = threading.RLock()
        self._connect_lock = threading.Lock()
        self._notif_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._msg_ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._regions: Dict[Tuple[int, int], Tuple[ferry.Region, int]] = {}
        self._local = _Coverage(())
        self._remotes: Dict[str, _Remote] = {}
        self._self_peer: Optional[ferry.Peer] = None
        self._assembler = _wire.NotifAssembler()
        self._listening = bool(conf.enable_listen)
        self._pumping = False
        self._inbox: List[Any] = []
        self._exchange_assembler = _wire.NotifAssembler(prefix=_wire.EXCHANGE_PREFIX)
        self._fetching: Dict[str, int] = {}
        self._published: Dict[str, bytes] = {}
        """Label → the answer (an encoded exchange message) to a fetch of it through the directory."""
        self._fetchers: Dict[int, _wire.AgentMetadata] = {}
        """Agents (by engine id) that fetched this agent's metadata through the directory: told
        when ``invalidate_local_metadata`` withdraws it."""

        self.notifs: Dict[str, List[bytes]] = {}
        self.backends: Dict[str, int] = {}
        self.backend_mems: Dict[str, List[str]] = {}
        self.backend_options: Dict[str, Dict[str, str]] = {}
        self.plugin_list: List[str] = [FERRY_PLUGIN]
        self.plugin_b_options: Dict[str, Dict[str, str]] = {FERRY_PLUGIN: {}}
        self.plugin_mem_types: Dict[str, List[str]] = {FERRY_PLUGIN: list(_MEM_TYPES)}
        self.nixl_mems: Dict[str, nixl_mem_t] = {
            "DRAM": nixl_mem_t.DRAM_SEG,
            "VRAM": nixl_mem_t.VRAM_SEG,
            "FILE": nixl_mem_t.FILE_SEG,
            "BLOCK": nixl_mem_t.BLK_SEG,
            "OBJ": nixl_mem_t.OBJ_SEG,
            "cpu": nixl_mem_t.DRAM_SEG,
            "cuda": nixl_mem_t.VRAM_SEG,
        }
        self.nixl_ops: Dict[str, str] = {"WRITE": "write", "READ": "read"}

        for backend in self.plugin_list if instantiate_all else conf.backends:
            if backend == FERRY_PLUGIN or backend in SERVED_PLUGINS:
                self.create_backend(backend)
            else:
                logger.warning("Skipping backend registration %s due to the missing plugin.", backend)
        if self._listening or self._etcd is not None:
            self._start_listener()
        logger.info("Initialized NIXL agent %s on ferry engine %s", self.name, self._engine.local_addr)

    # ---- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for transfers with notifications still being sent, stops the agent's thread and
        closes its engine (deregistering its memory, closing its links). Not part of NIXL's API,
        whose agents end with the process; it runs at exit or when the agent is collected."""
        self._finalizer()

    def _run(self, coro: Any, timeout: float) -> Any:
        fut = self._loop.submit(coro)
        try:
            return fut.result(timeout=timeout + 5.0)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise ferry.Timeout("the agent's event loop did not answer in time") from None

    # ---- plugins and backends -----------------------------------------------------------------

    def get_plugin_list(self) -> List[str]:
        """``["FERRY"]``: the one engine every backend name here is served by."""
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> List[str]:
        return _known(self.plugin_mem_types, backend, "Plugin %s is not available to get its supported mem types.", [])

    def get_plugin_params(self, backend: str) -> Dict[str, str]:
        return _known(self.plugin_b_options, backend, "Plugin %s is not available to get its parameters.", {})

    def get_backend_mem_types(self, backend: str) -> List[str]:
        return _known(self.backend_mems, backend, "Backend %s not instantiated to get its supported mem types.", [])

    def get_backend_params(self, backend: str) -> Dict[str, str]:
        return _known(self.backend_options, backend, "Backend %s not instantiated to get its parameters.", {})

    def create_backend(self, backend: str, initParams: Optional[Dict[str, str]] = None) -> None:
        """Starts ``backend``: ``"FERRY"``, or a NIXL network plugin name, served by the agent's
        ferry engine (``initParams`` are NIXL plugin options: ignored, with a warning)."""
        if backend != FERRY_PLUGIN and backend not in SERVED_PLUGINS:
            raise nixlNotFoundError(
                f"NIXL_ERR_NOT_FOUND: no plugin {backend!r} in ferry.nixl; it has {FERRY_PLUGIN!r}, "
                f"which also serves {', '.join(SERVED_PLUGINS)}"
            )
        if initParams:
            logger.warning("ferry.nixl ignores the %s options %s", backend, sorted(initParams))
        self.backends[backend] = len(self.backends) + 1
        self.backend_mems[backend] = list(_MEM_TYPES)
        self.backend_options[backend] = {
            "engine": "ferry",
            "ferry_version": ferry.__version__,
            "transports": ",".join(self._engine.transports),
            "listen_addr": self._engine.local_addr or "",
            "serves": backend,
        }
        logger.info("Backend %s was instantiated (ferry engine)", backend)

    def _check_backends(self, backends: Optional[Sequence[str]]) -> None:
        for b in backends or ():
            self.backends[b]

    # ---- descriptor lists ---------------------------------------------------------------------

    def _mem(self, mem_type: str) -> nixl_mem_t:
        mem = self.nixl_mems[mem_type]
        self._check_mem(mem)
        return mem

    @staticmethod
    def _check_mem(mem: nixl_mem_t) -> None:
        if mem not in (nixl_mem_t.DRAM_SEG, nixl_mem_t.VRAM_SEG):
            raise nixlNotSupportedError(_no_storage(nixl_mem_t(mem).name))

    @staticmethod
    def _object_desc(obj: Any) -> Tuple[int, int, Any]:
        """``(addr, len, owner)`` of a tensor (``data_ptr()``) or a buffer-protocol object."""
        data_ptr = getattr(obj, "data_ptr", None)
        if callable(data_ptr):
            if callable(getattr(obj, "is_contiguous", None)) and not obj.is_contiguous():
                raise ValueError("Please use a list of contiguous Tensors")
            if callable(getattr(obj, "numel", None)) and callable(getattr(obj, "element_size", None)):
                length = int(obj.numel()) * int(obj.element_size())
            else:
                length = int(obj.nbytes)
            return int(data_ptr()), length, obj
        view = memoryview(obj)
        if not view.c_contiguous:
            raise ValueError("a buffer must be C-contiguous")
        flat = np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view, dtype=np.uint8)
        return int(flat.ctypes.data), int(flat.nbytes), obj

    @staticmethod
    def _is_memory_object(obj: Any) -> bool:
        if isinstance(obj, (tuple, list, str)):
            return False
        if callable(getattr(obj, "data_ptr", None)):
            return True
        try:
            memoryview(obj)
        except TypeError:
            return False
        return True

    @staticmethod
    def _objects_mem(objs: Sequence[Any]) -> nixl_mem_t:
        """VRAM for tensors on a CUDA device (``get_device()`` is not -1), DRAM for the rest, as
        NIXL types a list of tensors; a list that mixes the two is a ``ValueError``."""
        on_gpu = {callable(getattr(o, "get_device", None)) and o.get_device() != -1 for o in objs}
        if len(on_gpu) > 1:
            raise ValueError("a descriptor list's tensors must all be on the GPU or all on the host")
        return nixl_mem_t.VRAM_SEG if on_gpu == {True} else nixl_mem_t.DRAM_SEG

    def _objects(self, objs: Sequence[Any]) -> Optional[Tuple[np.ndarray, List[Any]]]:
        rows = np.zeros((len(objs), 3), dtype=np.uint64)
        owners = []
        for i, obj in enumerate(objs):
            if not self._is_memory_object(obj):
                logger.error("Cannot make a descriptor of %s", type(obj).__name__)
                return None
            try:
                addr, length, owner = self._object_desc(obj)
            except ValueError as e:
                logger.error("%s", e)
                return None
            rows[i] = (addr, length, 0)
            owners.append(owner)
        return rows, owners

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None) -> Optional[nixlXferDList]:
        """A ``nixlXferDList`` from (a) a list of ``(addr, len, dev)`` tuples with ``mem_type``,
        (b) an N×3 numpy array with ``mem_type``, (c) a tensor (``data_ptr()``) or a buffer-protocol
        object, (d) a list of those, or (e) a ``nixlXferDList`` (returned as is). None, with an
        error logged, for anything else, as NIXL does. ``"VRAM"``/``"cuda"`` name CUDA device memory,
        addressed by its device pointer (``tensor.data_ptr()``)."""
        if isinstance(descs, nixlRegDList):
            logger.error("RegList type detected for transfer, please use XferList")
            return None
        got = self._dlist(nixlXferDList, descs, mem_type, 3, "3-tuple list needed for transfer")
        return got if got is None or isinstance(got, nixlXferDList) else None

    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None) -> Optional[nixlRegDList]:
        """A ``nixlRegDList`` from (a) a list of ``(addr, len, dev, meta)`` tuples with
        ``mem_type``, (b) an N×3 numpy array with ``mem_type``, (c) a tensor or a buffer-protocol
        object (kept alive while registered), (d) a list of those, or (e) a ``nixlRegDList``."""
        if isinstance(descs, nixlXferDList):
            logger.error("XferList type detected for registration, please use RegList")
            return None
        got = self._dlist(nixlRegDList, descs, mem_type, 4, "4-tuple list needed for registration")
        return got if got is None or isinstance(got, nixlRegDList) else None

    def _dlist(
        self, cls: Any, descs: Any, mem_type: Optional[str], tuple_len: int, wrong_tuples: str
    ) -> Optional[Union[nixlXferDList, nixlRegDList]]:
        """What ``get_xfer_descs`` and ``get_reg_descs`` share: a list of class ``cls`` from the
        forms they accept, tuples being ``tuple_len`` long."""
        if isinstance(descs, cls):
            return descs  # type: ignore[no-any-return]
        if isinstance(descs, np.ndarray):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            mem = self._mem(mem_type)
            if descs.ndim != 2 or descs.shape[1] != 3:
                logger.error("Nx3 shape required for transfer descriptor list from numpy array")
                return None
            return cls(mem, descs)  # type: ignore[no-any-return]
        if self._is_memory_object(descs):
            descs = [descs]
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            mem = self._mem(mem_type)
            if len(descs[0]) != tuple_len:
                logger.error(wrong_tuples)
                return None
            return cls(mem, list(descs))  # type: ignore[no-any-return]
        if isinstance(descs, (list, tuple)) and descs:
            got = self._objects(descs)
            if got is None:
                return None
            try:
                mem = self._objects_mem(descs)
            except ValueError as e:
                logger.error("%s", e)
                return None
            made = cls(mem, got[0])
            if cls is nixlRegDList:
                made._owners = got[1]
            return made  # type: ignore[no-any-return]
        if isinstance(descs, (list, tuple)) and mem_type is not None:
            return cls(self._mem(mem_type))  # type: ignore[no-any-return]
        return None

    def get_serialized_descs(self, descs: Union[nixlXferDList, nixlRegDList]) -> bytes:
        """``descs`` in ferry.nixl's versioned binary format (not a pickle: see ``_wire``)."""
        if isinstance(descs, nixlRegDList):
            return _wire.encode_descs(True, descs.getType(), descs._rows, descs._metas)
        if isinstance(descs, nixlXferDList):
            return _wire.encode_descs(False, descs.getType(), descs._rows, None)
        raise TypeError(f"can serialize a nixlXferDList or a nixlRegDList, not {type(descs).__name__}")

    def deserialize_descs(self, serialized_descs: bytes) -> Union[nixlXferDList, nixlRegDList]:
        """The list ``get_serialized_descs`` made; ``nixlInvalidParamError`` for anything else."""
        is_reg, mem, rows, metas = _wire.decode_descs(serialized_descs)
        if is_reg:
            reg = nixlRegDList(mem, rows)
            assert metas is not None
            reg._metas = metas
            return reg
        return nixlXferDList(mem, rows)

    # ---- memory -------------------------------------------------------------------------------

    def register_memory(
        self, reg_list: Any, mem_type: Optional[str] = None, backends: Optional[List[str]] = None
    ) -> nixlRegDList:
        """Registers every descriptor's memory with the agent's engine (``Engine.register`` for a
        buffer object, which it keeps alive; ``Engine.register_ptr`` for an address, which the
        CUDA driver, where there is one, classifies as device memory, or which is checked to be
        mapped memory of this process); returns the list, for ``deregister_memory``. A ``"VRAM"``
        list must name CUDA device memory (``nixlInvalidParamError`` otherwise, and nothing stays
        registered). Registering the same range twice counts twice."""
        descs = self.get_reg_descs(reg_list, mem_type)
        if descs is None:
            raise TypeError("register_memory: cannot make a registration list of the given descriptors")
        self._check_backends(backends)
        self._check_mem(descs.getType())
        done: List[Tuple[int, int]] = []
        with self._lock:
            try:
                for i in range(len(descs)):
                    addr, length = int(descs._rows[i, 0]), int(descs._rows[i, 1])
                    key = (addr, length)
                    if key in self._regions:
                        region, count = self._regions[key]
                        self._regions[key] = (region, count + 1)
                    else:
                        owner = descs._owners[i]
                        if owner is not None and not callable(getattr(owner, "data_ptr", None)):
                            region = self._engine.register(owner)
                        else:
                            region = self._engine.register_ptr(addr, length, owner=owner)
                        if descs.getType() == nixl_mem_t.VRAM_SEG and not region.kind.startswith("cuda"):
                            region.deregister()
                            raise nixlInvalidParamError(
                                f"NIXL_ERR_INVALID_PARAM: {length} bytes at 0x{addr:x} were registered as VRAM, "
                                f"but the CUDA driver does not know them as device memory ({region.kind})"
                            )
                        self._regions[key] = (region, 1)
                    done.append(key)
            except ferry.Error as e:
                self._release_keys(done)
                raise _as_nixl_error(e, f"registering {length} bytes at 0x{addr:x}") from e
            except nixlInvalidParamError:
                self._release_keys(done)
                raise
            finally:
                self._local = _Coverage(self._regions)
        return descs

    def _release_keys(self, keys: Iterable[Tuple[int, int]]) -> None:
        for key in keys:
            region, count = self._regions[key]
            if count > 1:
                self._regions[key] = (region, count - 1)
            else:
                del self._regions[key]
                region.deregister()

    def deregister_memory(self, dereg_list: nixlRegDList, backends: Optional[List[str]] = None) -> None:
        """Deregisters what ``register_memory`` registered; ``nixlNotFoundError`` (and nothing
        deregistered) if a descriptor is not registered."""
        if not isinstance(dereg_list, nixlRegDList):
            raise TypeError(f"deregister_memory takes a nixlRegDList, not {type(dereg_list).__name__}")
        self._check_backends(backends)
        keys = [(int(r[0]), int(r[1])) for r in dereg_list._rows]
        with self._lock:
            want: Dict[Tuple[int, int], int] = {}
            for key in keys:
                want[key] = want.get(key, 0) + 1
                if key not in self._regions or self._regions[key][1] < want[key]:
                    raise nixlNotFoundError(
                        f"NIXL_ERR_NOT_FOUND: {key[1]} bytes at 0x{key[0]:x} are not registered with this agent"
                    )
            try:
                self._release_keys(keys)
            finally:
                self._local = _Coverage(self._regions)

    def query_memory(self, reg_list: Any, backend: str, mem_type: Optional[str] = None) -> List[Optional[Dict[str, str]]]:
        raise nixlNotSupportedError(_no_storage("query_memory"))

    # ---- metadata -----------------------------------------------------------------------------

    def _advertised_addr(self) -> str:
        addr = self._engine.local_addr
        if addr is None:
            raise nixlBackendError("NIXL_ERR_BACKEND: the agent's engine does not listen")
        return _advertised(addr)

    def _metadata(self) -> _wire.AgentMetadata:
        with self._lock:
            regions = tuple(sorted(self._regions))
        return _wire.AgentMetadata(self.name, self._advertised_addr(), self._engine.id, regions)

    def get_agent_metadata(self) -> bytes:
        """This agent for another process: its name, its engine's address and id, and the memory
        it registered, in ferry.nixl's versioned format. Call it after ``register_memory``."""
        return _wire.encode_metadata(self._metadata())

    def _partial_metadata(
        self, descs: nixlRegDList, inc_conn_info: bool, backends: Optional[List[str]]
    ) -> _wire.AgentMetadata:
        if not isinstance(descs, nixlRegDList):
            raise TypeError(f"partial metadata takes a nixlRegDList, not {type(descs).__name__}")
        self._check_backends(backends)
        rows = descs._rows
        if rows.shape[0]:
            self._check_mem(descs.getType())
        with self._lock:
            missing = self._local.uncovered(rows)
        if missing is not None:
            a, n = int(rows[missing, 0]), int(rows[missing, 1])
            raise nixlNotFoundError(f"NIXL_ERR_NOT_FOUND: {n} bytes at 0x{a:x} are not registered with this agent")
        regions = tuple(sorted({(int(r[0]), int(r[1])) for r in rows}))
        # As in NIXL, metadata of no descriptors is the connection info alone.
        addr = self._advertised_addr() if inc_conn_info or not regions else None
        return _wire.AgentMetadata(self.name, addr, self._engine.id, regions, partial=True)

    def get_partial_agent_metadata(
        self, descs: nixlRegDList, inc_conn_info: bool = False, backends: Optional[List[str]] = None
    ) -> bytes:
        """Metadata of the registered memory ``descs`` names (each descriptor must lie in memory
        registered with this agent, else ``nixlNotFoundError``), with the engine's address when
        ``inc_conn_info`` (or when ``descs`` is empty: the connection info alone). Loading it
        (``add_remote_agent``) adds those ranges to what the loader knows of this agent; without
        connection info the loader must have loaded this agent before."""
        return _wire.encode_metadata(self._partial_metadata(descs, inc_conn_info, backends))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Loads another agent's metadata and connects to its engine; returns its name as bytes,
        as NIXL's binding does. Loading newer metadata of a known agent (more memory registered)
        updates it; metadata naming another engine under a known name raises
        ``nixlNotAllowedError`` (``remove_remote_agent`` it first)."""
        return self._add_remote(_wire.decode_metadata(metadata))

    def _add_remote(self, md: _wire.AgentMetadata) -> bytes:
        """Loads ``md``: whole metadata replaces what is known of the agent, partial metadata adds
        its regions to it (and, without connection info, needs the agent loaded already)."""
        if md.name == self.name:
            raise nixlInvalidParamError(
                "NIXL_ERR_INVALID_PARAM: that is this agent's own metadata (loopback needs none: "
                "prep_xfer_dlist with the agent's own name)"
            )
        with self._connect_lock:
            with self._lock:
                known = self._remotes.get(md.name)
            live = known if known is not None and not known.peer.closed else None
            if live is not None and (
                live.md.engine_id != md.engine_id or (md.addr is not None and md.addr != live.md.addr)
            ):
                raise nixlNotAllowedError(
                    f"NIXL_ERR_NOT_ALLOWED: agent {md.name!r} is loaded with engine {live.md.addr}; "
                    f"remove_remote_agent it before loading {md.addr or 'another engine'}"
                )
            if live is None and md.addr is None:
                raise nixlNotFoundError(
                    f"NIXL_ERR_NOT_FOUND: partial metadata of agent {md.name!r} carries no connection info "
                    "and the agent is not loaded: load metadata with connection info first "
                    "(get_partial_agent_metadata(..., inc_conn_info=True), or the whole metadata)"
                )
            peer = live.peer if live is not None else self._connect(md)
            self._await_regions(peer, md)
            if md.partial and live is not None:
                regions = tuple(sorted(set(live.md.regions) | set(md.regions)))
                md = _wire.AgentMetadata(md.name, live.md.addr, md.engine_id, regions, partial=True)
            with self._lock:
                generation = known.generation if known is not None and known.peer is peer else next(self._generations)
                self._remotes[md.name] = _Remote(md, peer, generation)
        if known is not None and known.peer is not peer:
            self._disconnect(known.peer)
        return md.name.encode()

    def _connect(self, md: _wire.AgentMetadata) -> ferry.Peer:
        addr = md.addr
        if addr is None:
            raise nixlNotFoundError(f"NIXL_ERR_NOT_FOUND: no connection info of agent {md.name!r}")
        engine = self._engine
        timeout = min(self._timeout, 10.0)

        async def connect() -> ferry.Peer:
            linked = _linked(engine, md.engine_id)
            if linked is not None:
                return linked
            try:
                return await engine.connect(addr, timeout=timeout)
            except ferry.AlreadyConnected:
                linked = _linked(engine, md.engine_id)
                if linked is None:
                    raise
                return linked

        try:
            peer: ferry.Peer = self._run(connect(), timeout)
        except ferry.Error as e:
            raise _as_nixl_error(e, f"connecting to agent {md.name!r} at {md.addr}") from e
        if peer.engine_id != md.engine_id:
            self._disconnect(peer)
            raise nixlBackendError(
                f"NIXL_ERR_BACKEND: {md.addr} is not the engine agent {md.name!r} runs (its id differs)"
            )
        return peer

    def _await_regions(self, peer: ferry.Peer, md: _wire.AgentMetadata) -> None:
        """Waits (briefly) until the link has heard of every region the metadata lists: metadata
        can overtake the region announcement of memory registered just before it was made."""
        rows = np.array([[a, n, 0] for a, n in md.regions], dtype=np.uint64).reshape(-1, 3)
        deadline = time.monotonic() + min(self._timeout, 10.0)
        while True:
            missing = _Coverage((r.addr, r.length) for r in peer.regions()).uncovered(rows)
            if missing is None:
                return
            if time.monotonic() >= deadline or peer.closed:
                a, n = md.regions[missing]
                raise nixlBackendError(
                    f"NIXL_ERR_BACKEND: agent {md.name!r}'s engine does not offer the region of {n} bytes "
                    f"at 0x{a:x} its metadata lists"
                )
            time.sleep(0.002)

    def _disconnect(self, peer: ferry.Peer) -> None:
        engine = self._engine

        async def disconnect() -> None:
            await engine.disconnect(peer, timeout=1.0)

        try:
            self._run(disconnect(), 1.0)
        except Exception as e:
            logger.debug("disconnecting %s: %s", peer.addr, e)

    def remove_remote_agent(self, agent: Union[str, bytes]) -> None:
        """Forgets a remote agent and closes the link to it; its prepared lists and transfer
        handles then raise ``nixlNotFoundError``. An unknown name does nothing, as in NIXL."""
        name = _name(agent)
        with self._lock:
            remote = self._remotes.pop(name, None)
        if remote is None:
            logger.info("remove_remote_agent: remote metadata for agent '%s' not found.", name)
            return
        self._disconnect(remote.peer)

    def check_remote_metadata(self, agent: Union[str, bytes], descs: Optional[nixlXferDList] = None) -> bool:
        """Whether metadata of ``agent`` is loaded (and, given ``descs``, covers all of them)."""
        name = _name(agent)
        with self._lock:
            remote = self._remotes.get(name)
        if remote is None:
            return False
        return descs is None or remote.coverage.uncovered(descs._rows) is None

    def make_connection(self, remote_agent: Union[str, bytes], backends: Optional[List[str]] = None) -> None:
        """The link is made by ``add_remote_agent``; this checks the agent is loaded."""
        self._check_backends(backends)
        self._remote(_name(remote_agent))

    # ---- metadata exchange over ferry (NIXL's listener) ----------------------------------------

    def _start_listener(self) -> None:
        """Starts taking notifications as they arrive (see ``_pump``); from then on
        ``get_new_notifs`` reads what the listener kept."""
        with self._notif_lock:
            if self._pump_task:
                return
            self._pumping = True
            engine, ref = self._engine, weakref.ref(self)

            async def start() -> "asyncio.Task[None]":
                return asyncio.ensure_future(_pump(engine, ref))

            self._pump_task.append(self._loop.submit(start()).result(timeout=10.0))

    def _on_notification(self, n: Any) -> None:
        """On the event-loop thread: one notification the listener took."""
        if _wire.frame_prefix(n.name) == _wire.EXCHANGE_PREFIX:
            got = self._exchange_assembler.feed(n.from_engine, n.from_addr, n.name, n.msg)
            if got is not None:
                self._exchange_pool.submit(self._on_exchange, n.from_engine, got[0], got[1])
            return
        with self._notif_lock:
            self._inbox.append(n)

    def _inbox_full(self) -> bool:
        """Whether the listener should stop taking notifications until ``get_new_notifs`` reads.
        Read without the lock (a list's length is one read under the GIL): the listener runs on the
        event-loop thread, which must never wait for a lock that a thread waiting on the loop holds."""
        return len(self._inbox) >= _MAX_INBOX

    def _on_exchange(self, from_engine: int, sender: str, data: bytes) -> None:
        """On the exchange thread: one metadata-exchange message from agent ``sender`` (so its
        frames said) on the engine ``from_engine`` (so ferry's link said)."""
        if self._closing.is_set():
            return
        try:
            kind, value = _wire.decode_exchange(data)
        except nixlInvalidParamError as e:
            logger.warning("refusing a metadata-exchange message from %r: %s", sender, e)
            return
        # A listener takes what peers push and answers whole-metadata fetches; an agent on the
        # metadata server answers fetches of what it published, and hears invalidations of what
        # it fetched. Answers are taken only for fetches this agent made (see EX_ANSWER).
        through_directory = self._etcd is not None and (
            kind == _wire.EX_INVALIDATE or (kind == _wire.EX_FETCH and value[1])
        )
        if kind in (_wire.EX_SEND, _wire.EX_FETCH, _wire.EX_INVALIDATE) and not (self._listening or through_directory):
            logger.warning(
                "ignoring a metadata-exchange request from %r: the agent was made without enable_listen_thread",
                sender,
            )
            return
        try:
            if kind in (_wire.EX_SEND, _wire.EX_ANSWER):
                md = value
                if md.name != sender or md.engine_id != from_engine:
                    logger.warning("refusing metadata of %r sent by agent %r of another engine", md.name, sender)
                    return
                if kind == _wire.EX_ANSWER:
                    with self._lock:
                        if md.name not in self._fetching:
                            logger.warning("ignoring metadata of %r: this agent did not fetch it", md.name)
                            return
                try:
                    self._add_remote(md)
                    logger.info("loaded metadata of agent %r from its %s", md.name,
                                "answer" if kind == _wire.EX_ANSWER else "send_local_metadata")
                finally:
                    if kind == _wire.EX_ANSWER:
                        with self._lock:
                            self._fetching.pop(md.name, None)
            elif kind == _wire.EX_FETCH:
                self._answer_fetch(from_engine, sender, *value)
            elif kind == _wire.EX_NOT_FOUND:
                with self._lock:
                    self._fetching.pop(value, None)
                logger.warning("agent %r has no metadata of %r to answer a fetch with", sender, value)
            elif kind == _wire.EX_INVALIDATE:
                with self._lock:
                    remote = self._remotes.get(sender)
                if remote is not None and remote.md.engine_id == from_engine:
                    self.remove_remote_agent(sender)
                    logger.info("agent %r invalidated its metadata", sender)
                else:
                    logger.info("ignoring an invalidation from %r: not loaded from that engine", sender)
        except Exception as e:  # noqa: BLE001 - NIXL's listener logs what it cannot do
            logger.error("metadata exchange with agent %r failed: %s", sender, e)

    def _answer_fetch(self, from_engine: int, sender: str, wanted: str, label: str, asker: _wire.AgentMetadata) -> None:
        """Answers agent ``sender``'s fetch of ``wanted`` (this agent, or not): with the metadata
        published under ``label`` when the fetch came through the metadata server, else (between
        peers) with the whole metadata as it is now."""
        if asker.name != sender or asker.engine_id != from_engine or asker.addr is None:
            logger.warning("refusing a fetch from agent %r of another engine", sender)
            return
        reply: Optional[bytes] = None
        if wanted != self.name:
            logger.warning("agent %r fetched metadata of %r, which is not this agent", sender, wanted)
        elif label:
            with self._lock:
                reply = self._published.get(label)
                if reply is not None:
                    self._fetchers[from_engine] = asker
            if reply is None:
                logger.warning("agent %r fetched metadata labelled %r, which this agent has not sent", sender, label)
        else:
            reply = _wire.encode_exchange(_wire.EX_ANSWER, self.get_agent_metadata())
        if reply is None:
            reply = _wire.encode_exchange(_wire.EX_NOT_FOUND, wanted.encode())
        frames = _wire.notif_frames(self.name, next(self._msg_ids), reply, _wire.EXCHANGE_PREFIX)
        peer = self._connect(asker)
        engine, timeout = self._engine, self._timeout

        async def answer() -> None:
            await _send_frames(engine, peer, frames, timeout)

        self._run(answer(), timeout)

    def _need_directory(self, what: str) -> None:
        """Calls without ``ip_addr`` go to NIXL's metadata server: ferry's etcd directory, where
        ``NIXL_ETCD_ENDPOINTS`` named one when the agent was made."""
        if self._etcd is None:
            raise nixlNotSupportedError(
                f"NIXL_ERR_NOT_SUPPORTED: {what} without ip_addr goes to the metadata server (etcd), and "
                "NIXL_ETCD_ENDPOINTS was not set when the agent was made: set it, or give the peer's ip_addr "
                "and port (its listen_port), or exchange get_agent_metadata() out of band"
            )

    def _frames(self, message: bytes) -> List[Tuple[str, str]]:
        return _wire.notif_frames(self.name, next(self._msg_ids), message, _wire.EXCHANGE_PREFIX)

    def _send_exchange(self, addr: str, message: bytes, what: str) -> None:
        """Connects (or reuses the link) to the engine at ``addr`` and sends ``message`` in the
        background: returns at once, as NIXL's calls do; failures are logged."""
        frames = self._frames(message)
        self._start_listener()
        engine, timeout = self._engine, self._timeout

        async def send() -> None:
            try:
                try:
                    peer = await engine.connect(addr, timeout=min(timeout, 10.0))
                except ferry.AlreadyConnected:
                    found = [p for p in engine.peers() if not p.closed and addr in (p.name, p.addr)]
                    if not found:
                        raise
                    peer = found[0]
                await _send_frames(engine, peer, frames, timeout)
            except Exception as e:  # noqa: BLE001
                logger.error("%s to %s failed: %s", what, addr, e)

        self._background(send())

    def _send_by_name(self, agent: str, message: bytes, what: str) -> None:
        """Finds agent ``agent`` in the directory (waiting up to ``ETCD_FETCH_WAIT`` for it to
        appear, as NIXL waits for its key) and sends ``message`` to its engine in the background;
        failures are logged."""
        frames = self._frames(message)
        engine, timeout = self._engine, self._timeout

        async def send() -> None:
            deadline = time.monotonic() + ETCD_FETCH_WAIT
            try:
                while True:
                    try:
                        record = await engine.lookup(agent, timeout=max(deadline - time.monotonic(), 0.001))
                        break
                    except ferry.NotConnected:
                        if time.monotonic() >= deadline:
                            raise
                        await asyncio.sleep(0.05)
                engine_id = int(record["engine_id"], 16)
                peer = _linked(engine, engine_id)
                if peer is None:
                    try:
                        peer = await engine.connect_by_name(agent, timeout=min(timeout, 10.0))
                    except ferry.AlreadyConnected:
                        peer = _linked(engine, engine_id)
                        if peer is None:
                            raise
                if peer.engine_id != engine_id:
                    raise ferry.NotConnected(f"the engine published as {agent!r} changed while connecting")
                await _send_frames(engine, peer, frames, timeout)
            except Exception as e:  # noqa: BLE001
                logger.error("%s through the directory failed: %s", what, e)

        self._background(send())

    def _background(self, coro: Any) -> None:
        """Runs a metadata-exchange send on the loop without waiting for it; ``close`` gives
        those still running a moment to finish."""
        fut = self._loop.submit(coro)
        self._sends.add(fut)
        fut.add_done_callback(self._sends.discard)

    def _publish(self, label: str, md: _wire.AgentMetadata) -> None:
        """Keeps ``md`` as the answer to fetches of ``label`` through the metadata server."""
        answer = _wire.encode_exchange(_wire.EX_ANSWER, _wire.encode_metadata(md))
        if len(answer) > _wire.MAX_EXCHANGE_BYTES:
            raise nixlInvalidParamError(
                f"NIXL_ERR_INVALID_PARAM: metadata of {len(answer)} bytes exceeds the exchange limit of "
                f"{_wire.MAX_EXCHANGE_BYTES}"
            )
        with self._lock:
            self._published[label] = answer

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Sends this agent's metadata to the agent listening at ``ip_addr:port`` (made with
        ``enable_listen_thread=True, listen_port=port``), which loads it as ``add_remote_agent``
        would; returns at once (the peer's ``check_remote_metadata`` says when it is loaded).
        Without ``ip_addr``, publishes it on the metadata server (``NIXL_ETCD_ENDPOINTS``, else
        ``nixlNotSupportedError``) for ``fetch_remote_metadata``. Metadata over 1 MiB raises
        ``nixlInvalidParamError``."""
        if not ip_addr:
            self._need_directory("send_local_metadata")
            self._publish(DEFAULT_METADATA_LABEL, self._metadata())
            return
        addr = _peer_addr(ip_addr, port)
        self._send_exchange(addr, _wire.encode_exchange(_wire.EX_SEND, self.get_agent_metadata()),
                            f"send_local_metadata of {self.name!r} to {addr}")

    def send_partial_agent_metadata(
        self,
        descs: nixlRegDList,
        inc_conn_info: bool = False,
        backends: Optional[List[str]] = None,
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ) -> None:
        """Sends ``get_partial_agent_metadata(descs, inc_conn_info, backends)`` to the agent
        listening at ``ip_addr:port``, or, without ``ip_addr``, publishes it on the metadata
        server under ``label`` (required there, else ``nixlInvalidParamError``) for
        ``fetch_remote_metadata(name, label=label)``. Returns at once."""
        md = self._partial_metadata(descs, inc_conn_info, backends)
        if not ip_addr:
            self._need_directory("send_partial_agent_metadata")
            if not _wire.check_label(label):
                raise nixlInvalidParamError(
                    "NIXL_ERR_INVALID_PARAM: partial metadata on the metadata server needs a label"
                )
            self._publish(label, md)
            return
        addr = _peer_addr(ip_addr, port)
        self._send_exchange(addr, _wire.encode_exchange(_wire.EX_SEND, _wire.encode_metadata(md)),
                            f"send_partial_agent_metadata of {self.name!r} to {addr}")

    def fetch_remote_metadata(
        self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = ""
    ) -> None:
        """Asks agent ``remote_agent`` for its metadata, loaded when it answers: returns at once;
        poll ``check_remote_metadata(remote_agent)``. With ``ip_addr``, the agent listening there
        answers with its whole metadata (``label`` is ignored, as in NIXL). Without, the agent is
        found on the metadata server (waiting up to 5 s for it) and answers with what it
        published under ``label`` (its whole metadata by default); nothing loads if it published
        nothing under that label."""
        name = _wire.check_agent_name(_name(remote_agent))
        if name == self.name:
            raise nixlInvalidParamError("NIXL_ERR_INVALID_PARAM: an agent cannot fetch its own metadata")
        if not ip_addr:
            self._need_directory("fetch_remote_metadata")
        label = (_wire.check_label(label) or DEFAULT_METADATA_LABEL) if not ip_addr else ""
        me = _wire.AgentMetadata(self.name, self._advertised_addr(), self._engine.id, ())
        message = _wire.encode_fetch(name, me, label)
        with self._lock:
            self._fetching[name] = self._fetching.get(name, 0) + 1
        if not ip_addr:
            self._send_by_name(name, message, f"fetch_remote_metadata of {name!r} (label {label!r})")
            return
        addr = _peer_addr(ip_addr, port)
        self._send_exchange(addr, message, f"fetch_remote_metadata of {name!r} from {addr}")

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Tells the agent listening at ``ip_addr:port`` to forget this agent (as
        ``remove_remote_agent``); without ``ip_addr``, withdraws what this agent published on the
        metadata server and tells every agent that fetched it to forget this agent. Returns at
        once."""
        message = _wire.encode_exchange(_wire.EX_INVALIDATE)
        if ip_addr:
            addr = _peer_addr(ip_addr, port)
            self._send_exchange(addr, message, f"invalidate_local_metadata of {self.name!r} at {addr}")
            return
        self._need_directory("invalidate_local_metadata")
        with self._lock:
            self._published.clear()
            fetchers = list(self._fetchers.values())
            self._fetchers.clear()
        for asker in fetchers:
            assert asker.addr is not None
            self._send_exchange(asker.addr, message, f"invalidate_local_metadata of {self.name!r} at {asker.name!r}")

    def _remote(self, name: str) -> _Remote:
        """The remote agent ``name``, or this agent itself for loopback (linked to its own engine
        on first use)."""
        with self._lock:
            remote = self._remotes.get(name)
            if remote is not None:
                return remote
        if name != self.name:
            raise nixlNotFoundError(f"NIXL_ERR_NOT_FOUND: metadata for remote agent {name!r} not found")
        with self._connect_lock:
            if self._self_peer is None or self._self_peer.closed:
                md = _wire.AgentMetadata(self.name, _advertised(self._engine.local_addr or ""), self._engine.id, ())
                self._self_peer = self._connect(md)
            with self._lock:
                return _Remote(
                    _wire.AgentMetadata(self.name, "", self._engine.id, self._local.regions), self._self_peer, 0
                )

    # ---- transfers ----------------------------------------------------------------------------

    def prep_xfer_dlist(
        self,
        agent_name: Union[str, bytes],
        xfer_list: Any,
        mem_type: Optional[str] = None,
        backends: Optional[List[str]] = None,
    ) -> nixl_prepped_dlist_handle:
        """Checks a descriptor list once, for ``make_prepped_xfer`` to pick from by index: the
        local side (``"NIXL_INIT_AGENT"``: memory this agent registered), a remote agent's (memory
        its metadata lists), or this agent's own name for loopback. ``nixlNotFoundError`` for an
        unknown agent or memory that is not registered."""
        descs = self.get_xfer_descs(xfer_list, mem_type)
        if descs is None:
            raise TypeError("prep_xfer_dlist: cannot make a transfer list of the given descriptors")
        self._check_backends(backends)
        self._check_mem(descs.getType())
        name = _name(agent_name)
        rows = descs._rows[:, :2].copy()
        if name in ("NIXL_INIT_AGENT", ""):
            with self._lock:
                bad = self._local.uncovered(descs._rows)
            if bad is not None:
                raise nixlNotFoundError(
                    f"NIXL_ERR_NOT_FOUND: local descriptor {bad} ({int(rows[bad, 1])} bytes at "
                    f"0x{int(rows[bad, 0]):x}) is not in memory this agent registered"
                )
            return nixl_prepped_dlist_handle(self, next(self._ids), None, 0, rows)
        remote = self._remote(name)
        bad = remote.coverage.uncovered(descs._rows)
        if bad is not None:
            raise nixlNotFoundError(
                f"NIXL_ERR_NOT_FOUND: remote descriptor {bad} ({int(rows[bad, 1])} bytes at "
                f"0x{int(rows[bad, 0]):x}) is not in memory agent {name!r} registered"
            )
        return nixl_prepped_dlist_handle(self, next(self._ids), name, remote.generation, rows)

    def _live_dlist(self, handle: Any, side: str) -> nixl_prepped_dlist_handle:
        if not isinstance(handle, nixl_prepped_dlist_handle) or handle._agent is not self:
            raise nixlInvalidParamError(f"NIXL_ERR_INVALID_PARAM: the {side} side is not a list this agent prepared")
        if handle._released:
            raise nixlInvalidParamError(f"NIXL_ERR_INVALID_PARAM: the {side} side's prepared list was released")
        return handle

    @staticmethod
    def _indices(indices: Any, side: str) -> np.ndarray:
        arr = np.asarray(indices)
        if arr.ndim != 1:
            raise ValueError(f"{side} indices must be one-dimensional")
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"{side} indices must be integers")
        return arr.astype(np.int64, copy=False)

    def _remote_for(self, name: str, generation: int) -> _Remote:
        remote = self._remote(name)
        if generation and remote.generation != generation:
            raise nixlNotFoundError(
                f"NIXL_ERR_NOT_FOUND: agent {name!r} was removed (or reloaded) after this was prepared"
            )
        return remote

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices: Union[List[int], np.ndarray],
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices: Union[List[int], np.ndarray],
        notif_msg: Union[bytes, str] = b"",
        backends: Optional[List[str]] = None,
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        """A transfer of the descriptors at ``local_indices`` of the local side to or from those
        at ``remote_indices`` of the remote side, pairwise; resolved by ferry once
        (``Engine.prepare``), posted by ``transfer`` as often as wanted. ``nixlInvalidParamError``
        for an index out of range, lengths that differ, or a released list."""
        op = self.nixl_ops[operation]
        self._check_backends(backends)
        local = self._live_dlist(local_xfer_side, "local")
        remote_side = self._live_dlist(remote_xfer_side, "remote")
        if local._remote is not None or remote_side._remote is None:
            raise nixlInvalidParamError(
                "NIXL_ERR_INVALID_PARAM: invalid sides (local must be prepared with NIXL_INIT_AGENT, "
                "remote with an agent's name)"
            )
        li = self._indices(local_indices, "local")
        ri = self._indices(remote_indices, "remote")
        if li.size == 0 or li.size != ri.size:
            raise nixlInvalidParamError(
                f"NIXL_ERR_INVALID_PARAM: different or no indices for local ({li.size}) and remote ({ri.size})"
            )
        for side, idx, rows in (("local", li, local._rows), ("remote", ri, remote_side._rows)):
            bad = np.flatnonzero((idx < 0) | (idx >= rows.shape[0]))
            if bad.size:
                raise nixlInvalidParamError(
                    f"NIXL_ERR_INVALID_PARAM: {side} index out of range at position {int(bad[0])} with value "
                    f"{int(idx[bad[0]])} (the list has {rows.shape[0]})"
                )
        lrows, rrows = local._rows[li], remote_side._rows[ri]
        bad = np.flatnonzero(lrows[:, 1] != rrows[:, 1])
        if bad.size:
            raise nixlInvalidParamError(
                f"NIXL_ERR_INVALID_PARAM: length mismatch at position {int(bad[0])}: local "
                f"{int(lrows[bad[0], 1])} bytes, remote {int(rrows[bad[0], 1])}"
            )
        assert remote_side._remote is not None
        remote = self._remote_for(remote_side._remote, remote_side._generation)
        descs = np.empty((li.size, 3), dtype=np.uint64)
        descs[:, 0] = lrows[:, 0]
        descs[:, 1] = rrows[:, 0]
        descs[:, 2] = lrows[:, 1]
        return self._new_xfer(op, remote, descs, _as_bytes(notif_msg))

    def initialize_xfer(
        self,
        operation: str,
        local_descs: nixlXferDList,
        remote_descs: nixlXferDList,
        remote_agent: Union[str, bytes],
        notif_msg: Union[bytes, str] = b"",
        backends: Optional[List[str]] = None,
    ) -> nixl_xfer_handle:
        """A transfer between two lists, pairwise (``local_descs[i]`` with ``remote_descs[i]``);
        ``nixlNotFoundError`` for an unknown agent or memory not registered on either side."""
        op = self.nixl_ops[operation]
        self._check_backends(backends)
        for what, d in (("local_descs", local_descs), ("remote_descs", remote_descs)):
            if not isinstance(d, nixlXferDList):
                raise TypeError(f"{what} must be a nixlXferDList (from get_xfer_descs), not {type(d).__name__}")
            self._check_mem(d.getType())
        if len(local_descs) != len(remote_descs) or len(local_descs) == 0:
            raise nixlInvalidParamError(
                f"NIXL_ERR_INVALID_PARAM: different or no descriptors (local={len(local_descs)}, "
                f"remote={len(remote_descs)})"
            )
        lrows, rrows = local_descs._rows, remote_descs._rows
        bad = np.flatnonzero(lrows[:, 1] != rrows[:, 1])
        if bad.size:
            raise nixlInvalidParamError(f"NIXL_ERR_INVALID_PARAM: length mismatch at index {int(bad[0])}")
        name = _name(remote_agent)
        remote = self._remote(name)
        with self._lock:
            bad_local = self._local.uncovered(lrows)
        if bad_local is not None:
            raise nixlNotFoundError(
                f"NIXL_ERR_NOT_FOUND: local descriptor {bad_local} is not in memory this agent registered"
            )
        bad_remote = remote.coverage.uncovered(rrows)
        if bad_remote is not None:
            raise nixlNotFoundError(
                f"NIXL_ERR_NOT_FOUND: remote descriptor {bad_remote} is not in memory agent {name!r} registered"
            )
        descs = np.empty((len(lrows), 3), dtype=np.uint64)
        descs[:, 0] = lrows[:, 0]
        descs[:, 1] = rrows[:, 0]
        descs[:, 2] = lrows[:, 1]
        return self._new_xfer(op, remote, descs, _as_bytes(notif_msg))

    def _new_xfer(self, op: str, remote: _Remote, descs: np.ndarray, notif: bytes) -> nixl_xfer_handle:
        if len(notif) > _wire.MAX_NOTIF_BYTES:
            raise nixlInvalidParamError(
                f"NIXL_ERR_INVALID_PARAM: a notification of {len(notif)} bytes exceeds the limit of "
                f"{_wire.MAX_NOTIF_BYTES}"
            )
        try:
            prepared = self._engine.prepare(remote.peer, op, descs)
        except ferry.Error as e:
            raise _as_nixl_error(e, f"preparing a {op} of {len(descs)} descriptors with {remote.md.name!r}") from e
        return nixl_xfer_handle(
            self, next(self._ids), op, remote.md.name, remote.generation, descs, prepared, notif
        )

    def _live_xfer(self, handle: Any) -> nixl_xfer_handle:
        if not isinstance(handle, nixl_xfer_handle) or handle._agent is not self:
            raise nixlInvalidParamError("NIXL_ERR_INVALID_PARAM: not a transfer handle of this agent")
        if handle._released:
            raise nixlInvalidParamError("NIXL_ERR_INVALID_PARAM: the transfer handle was released")
        return handle

    def transfer(self, handle: nixl_xfer_handle, notif_msg: Union[bytes, str] = b"") -> str:
        """Posts the transfer (again, once the previous post is done); ``"PROC"`` while it runs,
        ``"DONE"`` if it already completed. A non-empty ``notif_msg`` replaces the handle's
        notification; the notification reaches the remote agent after the transfer's bytes.
        ``nixlRepostActiveError`` while the previous post is in flight."""
        x = self._live_xfer(handle)
        remote = self._remote_for(x._remote, x._generation)
        if x._in_flight():
            raise nixlRepostActiveError("NIXL_ERR_REPOST_ACTIVE: the transfer is still in flight")
        if notif_msg:
            notif = _as_bytes(notif_msg)
            if len(notif) > _wire.MAX_NOTIF_BYTES:
                raise nixlInvalidParamError(
                    f"NIXL_ERR_INVALID_PARAM: a notification of {len(notif)} bytes exceeds the limit of "
                    f"{_wire.MAX_NOTIF_BYTES}"
                )
            x._notif = notif
        if self._telemetry:
            x._posted_ns = time.monotonic_ns()
            x._done_ns = 0
        try:
            if x._notif:
                frames = _wire.notif_frames(self.name, next(self._msg_ids), x._notif)
                x._state = self._loop.submit(self._post_then_notify(remote.peer, x._prepared, frames))
            else:
                x._state = self._engine.transfer_async(remote.peer, x._op, x._descs, timeout=self._timeout)
        except ferry.Error as e:
            x._state = None
            raise _as_nixl_error(e, f"posting a {x._op} to {x._remote!r}") from e
        if self._telemetry:
            x._post_ns = time.monotonic_ns()
        self._inflight.add(x)
        return self.check_xfer_state(x)

    async def _post_then_notify(
        self, peer: ferry.Peer, prepared: ferry.PreparedTransfer, frames: List[Tuple[str, str]]
    ) -> None:
        await self._engine.transfer_prepared(prepared, timeout=self._timeout)
        await _send_frames(self._engine, peer, frames, self._timeout)

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """``"PROC"`` while the transfer (and its notification) is under way, ``"DONE"`` once
        complete. A failed transfer raises, as NIXL's binding does: ``nixlRemoteDisconnectError``
        when the link closed, ``nixlBackendError`` otherwise (a timeout included);
        ``nixlNotPostedError`` before the first ``transfer``."""
        x = self._live_xfer(handle)
        state = x._state
        if state is None:
            raise nixlNotPostedError("NIXL_ERR_NOT_POSTED: the transfer was not posted")
        if isinstance(state, concurrent.futures.Future):
            if not state.done():
                return "PROC"
            error = state.exception()
            if error is not None:
                if isinstance(error, ferry.Error):
                    raise _as_nixl_error(error, f"the {x._op} with {x._remote!r}") from error
                raise nixlBackendError(f"NIXL_ERR_BACKEND: the {x._op} with {x._remote!r}: {error}") from error
        else:
            status = state.status()
            if status == ferry.TransferStatus.WAITING:
                return "PROC"
            if status != ferry.TransferStatus.COMPLETED:
                with self._lock:
                    remote = self._remotes.get(x._remote)
                if remote is None or remote.peer.closed:
                    raise nixlRemoteDisconnectError(
                        f"NIXL_ERR_REMOTE_DISCONNECT: the {x._op} with {x._remote!r} failed: the link closed"
                    )
                why = "timed out" if status == ferry.TransferStatus.TIMEOUT else "failed"
                raise nixlBackendError(f"NIXL_ERR_BACKEND: the {x._op} with {x._remote!r} {why}")
        if self._telemetry and not x._done_ns:
            x._done_ns = time.monotonic_ns()
        return "DONE"

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        """Times (µs) and sizes of the last post, once done; ``nixlNoTelemetryError`` unless the
        agent was made with ``capture_telemetry=True``."""
        x = self._live_xfer(handle)
        if not self._telemetry:
            raise nixlNoTelemetryError("NIXL_ERR_NO_TELEMETRY: the agent was made without capture_telemetry")
        if self.check_xfer_state(x) != "DONE":
            raise nixlRepostActiveError("NIXL_ERR_REPOST_ACTIVE: the transfer is not complete yet")
        return nixlXferTelemetry(
            startTime=x._posted_ns // 1000,
            postDuration=(x._post_ns - x._posted_ns) // 1000,
            xferDuration=(x._done_ns - x._posted_ns) // 1000,
            totalBytes=int(x._descs[:, 2].sum()),
            descCount=int(x._descs.shape[0]),
        )

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        """The backend name the transfer goes through: the first one the agent started (every
        one is ferry's engine)."""
        self._live_xfer(handle)
        return next(iter(self.backends), FERRY_PLUGIN)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> Tuple[int, int, str]:
        raise nixlNotSupportedError("NIXL_ERR_NOT_SUPPORTED: ferry has no transfer cost model")

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        """Frees the handle; ``nixlRepostActiveError`` while it is in flight (ferry cannot cancel
        a posted batch, and NIXL refuses to free what it cannot cancel)."""
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def get_remote_descs(self, descs: Any, mem_type: Optional[str] = None) -> Any:
        raise nixlNotSupportedError(_NO_DEVICE_API + " (remote descriptor lists serve it)")

    def prep_mem_view(self, dlist: Any, *, backends: Optional[List[str]] = None) -> int:
        raise nixlNotSupportedError(_NO_DEVICE_API + " (memory views are part of it)")

    def release_mem_view(self, mvh: int) -> None:
        raise nixlNotSupportedError(_NO_DEVICE_API + " (memory views are part of it)")

    # ---- notifications ------------------------------------------------------------------------

    def send_notif(
        self, remote_agent_name: Union[str, bytes], notif_msg: Union[bytes, str], backend: Optional[str] = None
    ) -> None:
        """Sends ``notif_msg`` (bytes, up to 64 KiB; str is UTF-8 encoded) to a loaded agent (or
        this one); it arrives after the data of every transfer to it that completed before."""
        if backend is not None:
            self.backends[backend]
        remote = self._remote(_name(remote_agent_name))
        frames = _wire.notif_frames(self.name, next(self._msg_ids), _as_bytes(notif_msg))
        engine, peer, timeout = self._engine, remote.peer, self._timeout

        async def send() -> None:
            await _send_frames(engine, peer, frames, timeout)

        try:
            self._run(send(), timeout)
        except ferry.Error as e:
            raise _as_nixl_error(e, f"notifying {remote.md.name!r}") from e

    def _take_notifs(self) -> Dict[str, List[bytes]]:
        new: Dict[str, List[bytes]] = {}
        with self._notif_lock:
            if self._pumping:
                taken, self._inbox = self._inbox, []
            else:
                taken = self._engine.take_notifications()
            for n in taken:
                got = self._assembler.feed(n.from_engine, n.from_addr, n.name, n.msg)
                if got is None:
                    if _wire.frame_prefix(n.name) == _wire.EXCHANGE_PREFIX:
                        logger.debug("ignoring a metadata-exchange frame: the agent does not listen")
                    elif not n.name.startswith(_wire.NOTIF_PREFIX):
                        logger.debug("ignoring a ferry notification %r not sent by ferry.nixl", n.name)
                    continue
                new.setdefault(got[0], []).append(got[1])
        return new

    def get_new_notifs(self, backends: Optional[List[str]] = None) -> Dict[str, List[bytes]]:
        """Notifications received since the last call: agent name -> messages, in arrival order."""
        self._check_backends(backends)
        return self._take_notifs()

    def update_notifs(self, backends: Optional[List[str]] = None) -> Dict[str, List[bytes]]:
        """Adds the new notifications to ``self.notifs`` and returns it."""
        self._check_backends(backends)
        for agent, msgs in self._take_notifs().items():
            self.notifs.setdefault(agent, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(
        self,
        remote_agent_name: Union[str, bytes],
        lookup_tag: Union[bytes, str],
        backends: Optional[List[str]] = None,
        tag_is_prefix: bool = True,
    ) -> bool:
        """Whether a notification from ``remote_agent_name`` starting with ``lookup_tag`` (or
        containing it, with ``tag_is_prefix=False``) arrived; removes the one found."""
        self.update_notifs(backends)
        name, tag = _name(remote_agent_name), _as_bytes(lookup_tag)
        msgs = self.notifs.get(name, [])
        for i, msg in enumerate(msgs):
            if (msg.startswith(tag) if tag_is_prefix else tag in msg):
                del msgs[i]
                return True
        return False

