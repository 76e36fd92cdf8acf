"""What ``python -m ferry.nixl`` does before it runs a program: point the ``nixl`` modules at
ferry's, in that process and in the Python processes it starts, and nowhere else.

In the process itself, ``sys.modules`` gets ``nixl``, ``nixl._api``, ``nixl._bindings``,
``nixl._utils`` and ``nixl.logging`` (an import finds ``sys.modules`` before any path entry, so an
installed NIXL is not looked at). Processes it starts (``multiprocessing`` workers, as vLLM spawns)
do not inherit ``sys.modules``: ``PYTHONPATH`` gets a directory, made for this run and removed at
its exit, whose ``nixl`` package does the same when imported. Nothing is installed anywhere, so
without the runner ``import nixl`` means what it meant before.
"""

import atexit
import importlib
import os
import shutil
import sys
import tempfile
from typing import Dict

ALIASES: Dict[str, str] = {
    "nixl": "ferry.nixl",
    "nixl._api": "ferry.nixl._api",
    "nixl._bindings": "ferry.nixl._bindings",
    "nixl._utils": "ferry.nixl._utils",
    "nixl.logging": "ferry.nixl.logging",
}

_SHIM = '''"""Made by `python -m ferry.nixl` for the processes its program starts: NIXL is ferry.nixl here."""
from ferry.nixl._runner import install

install()
'''


def install() -> None:
    """Makes ``import nixl`` (and its submodules) give ``ferry.nixl``'s in this process."""
    for alias, target in ALIASES.items():
        sys.modules[alias] = importlib.import_module(target)


def export_to_children() -> str:
    """Puts a ``nixl`` package that installs the aliases first on ``PYTHONPATH`` for processes
    started from now on; returns its directory (removed at exit)."""
    root = tempfile.mkdtemp(prefix="ferry-nixl-")
    os.mkdir(os.path.join(root, "nixl"))
    with open(os.path.join(root, "nixl", "__init__.py"), "w") as f:
        f.write(_SHIM)
    atexit.register(shutil.rmtree, root, True)
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = root if not previous else root + os.pathsep + previous
    return root
