import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ferry

HERE = Path(__file__).parent


class PeerProcess:
    """`peer.py` in a process of its own."""

    def __init__(self, length: int, transports=None):
        env = dict(os.environ, PEER_LENGTH=str(length))
        if transports:
            env["PEER_TRANSPORTS"] = ",".join(transports)
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "peer.py")],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        hello = self.read_line()
        self.addr = hello["addr"]
        self.region = hello["region"]
        self.length = hello["length"]

    def read_line(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer process exited (code {self.proc.poll()})")
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()


@pytest.fixture
def peer_process(request):
    procs = []

    def start(length=1 << 20, transports=None):
        p = PeerProcess(length, transports)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.close()


@pytest.fixture
def pair():
    """Two engines in this process; the target listens."""
    target = ferry.Engine("127.0.0.1:0")
    initiator = ferry.Engine()
    yield target, initiator
    initiator.close()
    target.close()


def descs_for(local_addr: int, remote_addr: int, size: int, count: int) -> np.ndarray:
    d = np.empty((count, 3), dtype=np.uint64)
    offsets = np.arange(count, dtype=np.uint64) * np.uint64(size)
    d[:, 0] = np.uint64(local_addr) + offsets
    d[:, 1] = np.uint64(remote_addr) + offsets
    d[:, 2] = size
    return d
