"""``nixl.logging`` for programs written for NIXL: ``get_logger(__name__)`` gives a logger under
``nixl``, whose level ``NIXL_LOG_LEVEL`` sets (TRACE, DEBUG, INFO, WARN, ERROR, FATAL), printing to
stderr as ferry's own log does."""

import logging as _logging
import os
import threading

_LEVELS = {
    "TRACE": _logging.DEBUG,
    "DEBUG": _logging.DEBUG,
    "INFO": _logging.INFO,
    "WARN": _logging.WARNING,
    "WARNING": _logging.WARNING,
    "ERROR": _logging.ERROR,
    "FATAL": _logging.CRITICAL,
}
_configured = False
_lock = threading.Lock()


def _configure() -> None:
    global _configured
    with _lock:
        if _configured:
            return
        root = _logging.getLogger("nixl")
        if not root.handlers:
            handler = _logging.StreamHandler()
            handler.setFormatter(
                _logging.Formatter("%(asctime)s NIXL(ferry) %(levelname)-7s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")
            )
            root.addHandler(handler)
            root.propagate = False
        wanted = os.environ.get("NIXL_LOG_LEVEL", "").upper()
        root.setLevel(_LEVELS.get(wanted, _logging.WARNING))
        _configured = True


def get_logger(name: str) -> _logging.Logger:
    """The logger ``nixl.<name>`` (leading underscores dropped; ``ferry.nixl._agent`` gives
    ``nixl.agent``)."""
    _configure()
    short = name.rsplit(".", 1)[-1].lstrip("_") if name.startswith("ferry.nixl") else name.lstrip("_")
    return _logging.getLogger(f"nixl.{short}" if short and short != "nixl" else "nixl")
