"""``python -m ferry.nixl program.py ARGS`` or ``python -m ferry.nixl -m module ARGS``: runs a
program written for NIXL on ferry, with ``nixl`` and its submodules resolving to ``ferry.nixl``
(for that program and the Python processes it starts only)."""

import os
import runpy
import sys
from typing import List, Optional

from ._runner import export_to_children, install

USAGE = """usage: python -m ferry.nixl program.py [ARGS...]
       python -m ferry.nixl -m module [ARGS...]

Runs a program written for NIXL (`from nixl._api import nixl_agent, nixl_agent_config`) on ferry:
`nixl`, `nixl._api`, `nixl._bindings`, `nixl._utils` and `nixl.logging` are ferry.nixl's modules
in it. FERRY_NIXL_LISTEN (host or host:port), FERRY_NIXL_TRANSPORTS (e.g. tcp,shm) and
FERRY_NIXL_TIMEOUT (seconds) configure the agents it makes."""


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "-m" and len(args) < 2:
        print("python -m ferry.nixl: -m needs a module name\n\n" + USAGE, file=sys.stderr)
        return 2
    install()
    export_to_children()
    if args[0] == "-m":
        sys.argv = [args[1]] + args[2:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        path = args[0]
        if not os.path.exists(path):
            print(f"python -m ferry.nixl: can't open file {path!r}", file=sys.stderr)
            return 2
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(path))
        runpy.run_path(path, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
