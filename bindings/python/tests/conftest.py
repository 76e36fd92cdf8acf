import json
import os
import signal
import subprocess
import sys
import time
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

    def stop(self):
        """SIGSTOP, and wait until every thread of the process has stopped: the signal is delivered
        asynchronously, and a thread still running could answer one more request."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = []
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
                try:
                    # The state follows the command name, which is in parentheses.
                    states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
                except (FileNotFoundError, ProcessLookupError):
                    continue
            if states and all(s in ("T", "t") for s in states):
                return
            time.sleep(0.001)
        raise RuntimeError("the peer process did not stop within 10 s")

    def resume(self):
        os.kill(self.proc.pid, signal.SIGCONT)

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


def require(what: str) -> None:
    """Skips the test for want of `what`, unless FERRY_REQUIRE_ALL is set (as `cargo xtask test`
    sets it, having installed everything the tests need), where that is a failure."""
    if os.environ.get("FERRY_REQUIRE_ALL"):
        pytest.fail(what)
    pytest.skip(what)


@pytest.fixture
def torch():
    """PyTorch, for tests of CPU tensors as the programs that move KV caches hold them."""
    try:
        import torch
    except ImportError as e:
        require(f"PyTorch is not installed ({e}); `pip install torch`")
    return torch


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd(tmp_path):
    """A real etcd on loopback, in a temporary data folder, on free ports: its client URL as NIXL
    takes it ("http://127.0.0.1:PORT"). Skipped where there is no etcd binary or the package has
    no etcd directory, unless FERRY_REQUIRE_ALL is set (as `cargo xtask test` sets it), where
    either is a failure."""
    import shutil
    import urllib.request

    missing = []
    if shutil.which("etcd") is None:
        missing.append("no etcd binary (Debian package etcd-server)")
    if not any(d["name"] == "etcd" and d["compiled"] for d in ferry.capabilities()["directories"]):
        missing.append('the ferry package has no etcd directory (MATURIN_PEP517_ARGS="--features etcd")')
    if missing:
        require("; ".join(missing))
    client, peer = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    proc = subprocess.Popen(
        ["etcd", "--name", "t", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", client, "--advertise-client-urls", client,
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"t={peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        break
            except OSError:
                pass
            assert proc.poll() is None, "etcd exited"
            assert time.monotonic() < deadline, "etcd did not become healthy within 30 s"
            time.sleep(0.05)
        yield client
    finally:
        proc.kill()
        proc.wait(timeout=10)
