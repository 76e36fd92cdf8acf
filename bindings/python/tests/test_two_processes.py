"""Two Python processes: every byte written, read and notified is checked."""

import asyncio
import hashlib
import time

import numpy as np
import pytest

import ferry
from conftest import descs_for
from peer import pattern

# Same host: shared memory when both sides offer it; TCP when the peer offers only TCP.
TRANSPORTS = [None, ["tcp"]]


@pytest.mark.parametrize("transports", TRANSPORTS, ids=["default", "tcp"])
def test_write_read_notify_every_byte(peer_process, transports):
    remote = peer_process(length=1 << 20, transports=transports)

    async def run():
        with ferry.Engine(transports=transports) as engine:
            peer = await engine.connect(remote.addr, timeout=5.0)
            assert peer.transport == ("tcp" if transports else "shm")
            [ad] = peer.regions()
            assert (ad.addr, ad.length) == (remote.region, remote.length)

            # Read the whole region and compare with the pattern the peer filled it with.
            got = np.zeros(remote.length, dtype=np.uint8)
            local = engine.register(got)
            await engine.transfer(peer, "read", descs_for(local.addr, ad.addr, 4096, 256), timeout=10.0)
            assert np.array_equal(got, pattern(remote.length, seed=7))

            # Write new bytes over its second half, in 64 KiB pieces, then ask for its digest.
            fresh = pattern(remote.length // 2, seed=11)
            src = engine.register(fresh)
            half = remote.length // 2
            await engine.transfer(
                peer, "write", descs_for(src.addr, ad.addr + half, 65536, half // 65536), timeout=10.0
            )
            await engine.notify(peer, "digest", "after write", timeout=5.0)
            expected = np.concatenate([pattern(remote.length, seed=7)[:half], fresh])
            return expected

    expected = asyncio.run(run())
    answer = remote.read_line()
    assert answer["name"] == "digest" and answer["msg"] == "after write"
    assert answer["sha256"] == hashlib.sha256(expected.tobytes()).hexdigest()


def test_dead_peer_raises_within_the_timeout(peer_process):
    remote = peer_process(length=1 << 16)

    async def run():
        with ferry.Engine() as engine:
            peer = await engine.connect(remote.addr, timeout=5.0)
            buf = np.zeros(1 << 16, dtype=np.uint8)
            local = engine.register(buf)
            await engine.transfer(peer, "read", [(local.addr, remote.region, 4096)], timeout=5.0)
            remote.proc.kill()
            remote.proc.wait(timeout=10)
            started = time.monotonic()
            with pytest.raises(ferry.Error) as raised:
                for _ in range(50):  # the first may race the kernel noticing the death
                    await engine.transfer(peer, "read", [(local.addr, remote.region, 4096)], timeout=2.0)
            elapsed = time.monotonic() - started
            assert type(raised.value) in (ferry.PeerClosed, ferry.NotConnected, ferry.Timeout)
            assert raised.value.retryable
            assert elapsed < 2.0 + 1.5, f"took {elapsed:.2f} s with a 2 s timeout"

    asyncio.run(run())


@pytest.mark.parametrize("transports", TRANSPORTS, ids=["default", "tcp"])
def test_stopped_peer_times_out_as_timeout_error(peer_process, transports):
    """A peer that stops answering (SIGSTOP) fails a transfer with ferry.Timeout, a TimeoutError,
    within its timeout; meanwhile `transfer_blocking` on another thread leaves the GIL to others."""
    remote = peer_process(length=1 << 16, transports=transports)

    async def run():
        with ferry.Engine(transports=transports) as engine:
            peer = await engine.connect(remote.addr, timeout=5.0)
            local = engine.register(np.zeros(1 << 16, dtype=np.uint8))
            remote.stop()
            try:
                started = time.monotonic()
                with pytest.raises(TimeoutError) as raised:
                    await engine.transfer(peer, "write", [(local.addr, remote.region, 1 << 16)], timeout=1.0)
                elapsed = time.monotonic() - started
                assert isinstance(raised.value, ferry.Timeout)
                assert 0.9 <= elapsed < 1.0 + 1.5, f"took {elapsed:.2f} s with a 1 s timeout"
            finally:
                remote.resume()

    asyncio.run(run())


def test_blocking_transfer_releases_the_gil(peer_process):
    """While one thread waits in `transfer_blocking` (on a stopped peer, for its 1 s timeout), this
    thread keeps running Python: were the GIL held, it would not run a single iteration."""
    import threading

    remote = peer_process(length=1 << 16)
    with ferry.Engine() as engine:
        async def connect():
            return await engine.connect(remote.addr, timeout=5.0)

        peer = asyncio.run(connect())
        local = engine.register(np.zeros(1 << 16, dtype=np.uint8))
        raised = []

        def wait_in_ferry():
            try:
                engine.transfer_blocking(peer, "write", [(local.addr, remote.region, 1 << 16)], timeout=1.0)
            except ferry.Error as e:
                raised.append(e)

        remote.stop()
        try:
            waiter = threading.Thread(target=wait_in_ferry)
            waiter.start()
            time.sleep(0.1)  # let it enter the call
            iterations = 0
            while waiter.is_alive():
                iterations += 1
            waiter.join()
        finally:
            remote.resume()
    assert [type(e) for e in raised] == [ferry.Timeout]
    assert iterations > 10_000, f"only {iterations} iterations ran while the other thread waited"
