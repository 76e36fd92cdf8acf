"""The engine contract from Python, two engines in this process."""

import array
import asyncio
import ctypes
import gc
import mmap
import os
import threading
import time
import weakref

import numpy as np
import pytest

import ferry
from conftest import descs_for

KIB = 1024


async def connect(initiator, target):
    return await initiator.connect(target.local_addr, timeout=5.0)


def test_register_numpy_array_and_raw_pointer(pair):
    target, initiator = pair
    # The target: memory Python cannot see, known only by its address (as a tensor's data_ptr()).
    raw = (ctypes.c_uint8 * (64 * KIB))()
    dst = target.register_ptr(ctypes.addressof(raw), len(raw), owner=raw)
    assert (dst.addr, dst.length) == (ctypes.addressof(raw), 64 * KIB)
    # The initiator: a 2-D float array, registered by the buffer protocol whatever its dtype.
    src_array = np.arange(16 * KIB, dtype=np.float32).reshape(128, 128)
    src = initiator.register(src_array)
    assert src.length == src_array.nbytes == 64 * KIB

    async def run():
        peer = await connect(initiator, target)
        await initiator.transfer(peer, "write", [(src.addr, dst.addr, src.length)], timeout=5.0)
        back = np.zeros_like(src_array)
        region = initiator.register(back)
        await initiator.transfer(peer, "read", descs_for(region.addr, dst.addr, 4 * KIB, 16), timeout=5.0)
        return back

    back = asyncio.run(run())
    assert bytes(raw) == src_array.tobytes()
    assert np.array_equal(back, src_array)


def test_other_buffers_register_too(pair):
    target, _ = pair
    regions = [
        target.register(bytearray(4 * KIB)),
        target.register(memoryview(bytearray(4 * KIB))),
        target.register(array.array("Q", [0] * 512)),
        target.register(mmap.mmap(-1, 8 * KIB)),
    ]
    assert [r.length for r in regions] == [4 * KIB, 4 * KIB, 4 * KIB, 8 * KIB]
    assert target.region_count == 4
    for bad in (b"read-only bytes", np.zeros((8, 8), dtype=np.uint8)[:, ::2], bytearray()):
        with pytest.raises(ferry.InvalidArgument):
            target.register(bad)
    with pytest.raises(ferry.InvalidArgument):
        target.register(object())
    assert target.region_count == 4


def test_registered_object_stays_alive_until_deregistered(pair):
    target, _ = pair
    buf = np.ones(4 * KIB, dtype=np.uint8)
    alive = weakref.ref(buf)
    region = target.register(buf)
    del buf
    gc.collect()
    assert alive() is not None, "the engine must keep the registered array alive"
    region.deregister()
    gc.collect()
    assert alive() is None, "deregistering must release the array"
    with pytest.raises(ferry.InvalidArgument):
        region.deregister()

    grow = bytearray(4 * KIB)
    region = target.register(grow)
    with pytest.raises(BufferError):
        grow.extend(b"x")  # resizing would move memory a peer may be writing
    region.deregister()
    grow.extend(b"x")


# Each bad batch names a real region for every descriptor but one, and that one is at the end:
# nothing may be written, not even the good descriptors before it.
BAD_BATCHES = {
    "remote out of bounds": (ferry.OutOfBounds, lambda l, r: [(l, r, 4 * KIB), (l, r + 60 * KIB, 8 * KIB)]),
    "remote in no region": (ferry.OutOfBounds, lambda l, r: [(l, r, 4 * KIB), (l, r + (1 << 40), 16)]),
    "local in no region": (ferry.OutOfBounds, lambda l, r: [(l, r, 4 * KIB), (l + (1 << 40), r, 16)]),
    "zero length": (ferry.InvalidArgument, lambda l, r: [(l, r, 4 * KIB), (l, r, 0)]),
    "not triples": (ferry.InvalidArgument, lambda l, r: [(l, r, 4 * KIB), (l, r)]),
    "wrong dtype": (ferry.InvalidArgument, lambda l, r: np.array([[l, r, 4 * KIB]], dtype=np.float64)),
    "wrong shape": (ferry.InvalidArgument, lambda l, r: np.array([[l, r, 4 * KIB, 0]], dtype=np.uint64)),
    "not an array": (ferry.InvalidArgument, lambda l, r: "descriptors"),
}


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_bad_descriptors_raise_and_write_nothing(pair, case):
    target, initiator = pair
    exc, make = BAD_BATCHES[case]
    dst_array = np.zeros(64 * KIB, dtype=np.uint8)
    dst = target.register(dst_array)
    src = initiator.register(np.full(64 * KIB, 0xAB, dtype=np.uint8))

    async def run():
        peer = await connect(initiator, target)
        with pytest.raises(exc):
            await initiator.transfer(peer, "write", make(src.addr, dst.addr), timeout=5.0)
        with pytest.raises(exc):
            initiator.transfer_async(peer, "write", make(src.addr, dst.addr), timeout=5.0)
        with pytest.raises(exc):
            initiator.transfer_blocking(peer, "write", make(src.addr, dst.addr), timeout=5.0)
        # The link still works, and a good write lands: the zeros above are not for want of trying.
        await initiator.transfer(peer, "write", [(src.addr, dst.addr + 32 * KIB, 16)], timeout=5.0)

    asyncio.run(run())
    assert not dst_array[: 32 * KIB].any(), "a rejected batch wrote bytes"
    assert (dst_array[32 * KIB : 32 * KIB + 16] == 0xAB).all()


def test_access_is_enforced(pair):
    target, initiator = pair
    dst_array = np.zeros(4 * KIB, dtype=np.uint8)
    dst = target.register(dst_array, access=ferry.READ)
    src = initiator.register(np.full(4 * KIB, 1, dtype=np.uint8))

    async def run():
        peer = await connect(initiator, target)
        with pytest.raises(ferry.PermissionDenied):
            await initiator.transfer(peer, "write", [(src.addr, dst.addr, 4 * KIB)], timeout=5.0)
        await initiator.transfer(peer, "read", [(src.addr, dst.addr, 4 * KIB)], timeout=5.0)

    asyncio.run(run())
    assert not dst_array.any()
    with pytest.raises(ferry.InvalidArgument):
        target.register(bytearray(16), access=4)


def test_thousand_concurrent_asyncio_transfers(pair):
    target, initiator = pair
    n, size = 1000, 4 * KIB
    dst_array = np.zeros((n, size), dtype=np.uint8)
    dst = target.register(dst_array)
    src_array = np.random.default_rng(3).integers(0, 256, (n, size), dtype=np.uint8)
    src = initiator.register(src_array)

    async def run():
        peer = await connect(initiator, target)
        await asyncio.gather(
            *(
                initiator.transfer(peer, "write", [(src.addr_at(i * size), dst.addr_at(i * size), size)], timeout=30.0)
                for i in range(n)
            )
        )

    asyncio.run(run())
    assert np.array_equal(dst_array, src_array)


def test_awaited_transfers_run_on_the_callers_thread_only_while_the_loop_is_idle(pair):
    target, initiator = pair
    size = 32 << 20
    dst_array = np.zeros(size, dtype=np.uint8)
    dst = target.register(dst_array)
    src_array = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    src = initiator.register(src_array)

    async def run():
        loop = asyncio.get_running_loop()
        peer = await connect(initiator, target)
        # Another callback is ready to run: the write goes to the runtime at once, and its future can
        # resolve only on a later turn of the loop.
        loop.call_soon(lambda: None)
        busy = initiator.transfer(peer, "write", [(src.addr, dst.addr, 4 * KIB)], timeout=10.0)
        assert not busy.done()
        await busy
        # Small writes on an idle loop: each resolves, inline or (past the spin) from the runtime.
        for i in range(1, 200):
            at = i * 4 * KIB
            await initiator.transfer(peer, "write", [(src.addr_at(at), dst.addr_at(at), 4 * KIB)], timeout=10.0)
        # 32 MiB outlasts the spin: handed to the runtime part-way, it finishes there.
        large = initiator.transfer(peer, "write", [(src.addr, dst.addr, size)], timeout=30.0)
        assert not large.done()
        await large
        # Failing at its first poll on an idle loop: answered by a future already done.
        await initiator.disconnect(peer)
        gone = initiator.transfer(peer, "write", [(src.addr, dst.addr, 64)], timeout=5.0)
        assert gone.done()
        with pytest.raises(ferry.NotConnected):
            await gone

    asyncio.run(run())
    assert np.array_equal(dst_array, src_array)


def test_python_threads_transfer_concurrently(pair):
    """Threads with blocking calls and threads with event loops of their own, all at once."""
    target, initiator = pair
    threads, per_thread, size = 4, 50, 4 * KIB
    dst_array = np.zeros((threads, per_thread, size), dtype=np.uint8)
    dst = target.register(dst_array)
    src_array = np.random.default_rng(5).integers(0, 256, dst_array.shape, dtype=np.uint8)
    src = initiator.register(src_array)
    peer = asyncio.run(connect(initiator, target))
    errors = []

    def slot(t, i):
        off = (t * per_thread + i) * size
        return [(src.addr_at(off), dst.addr_at(off), size)]

    def blocking(t):
        try:
            for i in range(per_thread):
                initiator.transfer_blocking(peer, "write", slot(t, i), timeout=30.0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def with_loop(t):
        async def run():
            await asyncio.gather(*(initiator.transfer(peer, "write", slot(t, i), timeout=30.0) for i in range(per_thread)))

        try:
            asyncio.run(run())
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    workers = [threading.Thread(target=blocking if t % 2 else with_loop, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not errors
    assert np.array_equal(dst_array, src_array)


def test_transfer_async_status_then_await(pair):
    target, initiator = pair
    dst_array = np.zeros(1 << 20, dtype=np.uint8)
    dst = target.register(dst_array)
    src = initiator.register(np.full(1 << 20, 9, dtype=np.uint8))

    async def run():
        peer = await connect(initiator, target)
        handle = initiator.transfer_async(peer, "write", descs_for(src.addr, dst.addr, 4 * KIB, 256), timeout=10.0)
        assert handle.status() in (ferry.TransferStatus.WAITING, ferry.TransferStatus.COMPLETED)
        await handle
        assert handle.status() == ferry.TransferStatus.COMPLETED
        await handle  # awaiting again returns at once

        prepared = initiator.prepare(peer, "write", descs_for(src.addr, dst.addr, 64 * KIB, 16))
        assert len(prepared) == 16
        for _ in range(3):
            await initiator.transfer_prepared(prepared, timeout=10.0)

    asyncio.run(run())
    assert (dst_array == 9).all()


def test_cancelled_await_leaves_the_loop_working(pair):
    target, initiator = pair
    dst = target.register(np.zeros(1 << 20, dtype=np.uint8))
    src = initiator.register(np.ones(1 << 20, dtype=np.uint8))

    async def run():
        peer = await connect(initiator, target)
        tasks = [
            asyncio.ensure_future(initiator.transfer(peer, "write", [(src.addr, dst.addr, 1 << 20)], timeout=10.0))
            for _ in range(20)
        ]
        await asyncio.sleep(0)
        for t in tasks[::2]:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results)
        await initiator.transfer(peer, "write", [(src.addr, dst.addr, 16)], timeout=10.0)

    asyncio.run(run())


def test_a_failed_delivery_does_not_strand_the_rest_of_its_batch(pair):
    """Completions reach the loop in batches; one future that refuses its result (a broken Future
    subclass here) must not leave the futures after it in the batch unresolved."""
    target, initiator = pair
    landed = np.zeros(64 * KIB, dtype=np.uint8)
    dst = target.register(landed)
    src = initiator.register(np.ones(64 * KIB, dtype=np.uint8))

    class Refusing(asyncio.Future):
        def set_result(self, result):
            raise RuntimeError("this future refuses its result")

    class Loop(asyncio.SelectorEventLoop):
        refuse_next = False

        def create_future(self):
            if self.refuse_next:
                self.refuse_next = False
                return Refusing(loop=self)
            return super().create_future()

    handled = []
    loop = Loop()
    loop.set_exception_handler(lambda _loop, context: handled.append(context.get("exception")))

    async def run():
        peer = await connect(initiator, target)
        loop.refuse_next = True
        # A callback ready makes the loop busy: the transfer goes to the runtime at once rather than
        # finishing on this thread first (where its future would be resolved before it is returned),
        # so its completion comes through the batch this test is about.
        loop.call_soon(lambda: None)
        first = initiator.transfer(peer, "write", [(src.addr, dst.addr, 4 * KIB)], timeout=5.0)
        # Block the loop's thread (no await) while both transfers complete, so that their
        # completions are drained together, the refused one first.
        time.sleep(0.3)
        second = initiator.transfer(peer, "write", [(src.addr + 4 * KIB, dst.addr + 4 * KIB, 4 * KIB)], timeout=5.0)
        time.sleep(0.3)
        await asyncio.wait_for(second, timeout=5.0)
        assert not first.done()
        first.cancel()

    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
    assert any(isinstance(e, RuntimeError) and "refuses" in str(e) for e in handled), handled
    assert landed[: 8 * KIB].tobytes() == b"\x01" * (8 * KIB)


def test_notifications_take_and_iterate(pair):
    target, initiator = pair

    async def run():
        peer = await connect(initiator, target)
        for i in range(3):
            await initiator.notify(peer, "kv", f"block {i}", timeout=5.0)
        got = []
        async for n in target.notifications():
            got.append((n.name, n.msg))
            if len(got) == 3:
                break
        assert got == [("kv", "block 0"), ("kv", "block 1"), ("kv", "block 2")]
        await initiator.notify(peer, "done", "", timeout=5.0)
        for _ in range(100):
            taken = target.take_notifications()
            if taken:
                break
            await asyncio.sleep(0.01)
        assert [(n.name, n.from_engine) for n in taken] == [("done", initiator.id)]
        with pytest.raises(ferry.InvalidArgument):
            await initiator.notify(peer, "x" * 1025, "", timeout=5.0)

    asyncio.run(run())


def test_cancelled_notification_waits_lose_nothing(pair):
    """Waits cancelled before, while and after notifications arrive: every one is delivered, once,
    in order (a cancelled wait must neither keep waiting and swallow the next one, nor drop the one
    it had taken)."""
    target, initiator = pair

    async def run():
        peer = await connect(initiator, target)
        it = target.notifications()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(it.__anext__(), 0.1)
        got = []
        for i in range(30):
            waiter = asyncio.ensure_future(it.__anext__())
            await initiator.notify(peer, "n", str(i), timeout=5.0)
            for _ in range(i % 3):
                await asyncio.sleep(0)
            if not waiter.cancel():
                got.append(waiter.result().msg)
        while len(got) < 30:
            got.append((await asyncio.wait_for(it.__anext__(), 5.0)).msg)
        assert got == [str(i) for i in range(30)]
        assert target.take_notifications() == []

    asyncio.run(run())


def test_a_notification_taken_for_a_cancelled_wait_comes_before_the_next(pair):
    """A wait that had taken a notification, cancelled before the loop could hand it over: the next
    wait, started at once, gets that notification, not the one after it. The loop is held (a blocking
    sleep) so that both waits finish their tokio side before it runs again."""
    target, initiator = pair

    async def run():
        peer = await connect(initiator, target)
        it = target.notifications()
        for i in range(2):
            await initiator.notify(peer, "n", str(i), timeout=5.0)
        first = it.__anext__()
        time.sleep(0.5)  # its task takes "0" and queues the outcome; the loop cannot deliver it
        assert first.cancel()
        second = it.__anext__()
        time.sleep(0.5)  # a task that did not wait for the first's outcome would take "1" now
        assert (await asyncio.wait_for(second, 5.0)).msg == "0"
        assert (await asyncio.wait_for(it.__anext__(), 5.0)).msg == "1"

    asyncio.run(run())


def test_a_notification_taken_for_a_loop_that_closed_goes_to_the_next_loop(pair):
    """A wait whose loop closed before it could hand its notification over: a wait on another
    thread's loop gets that notification, neither losing it nor waiting for the first thread."""
    target, initiator = pair
    it = target.notifications()

    async def start_waiting():
        return it.__anext__()

    async def send():
        peer = await connect(initiator, target)
        await initiator.notify(peer, "n", "0", timeout=5.0)

    def in_a_thread(work):
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()

    first_loop = asyncio.new_event_loop()
    first = first_loop.run_until_complete(start_waiting())  # stopped with the wait in progress
    in_a_thread(lambda: asyncio.run(send()))
    time.sleep(0.5)  # the wait takes "0" and queues it for a loop that will not run again
    first_loop.close()
    assert not first.done()

    async def next_msg():
        return (await asyncio.wait_for(it.__anext__(), 5.0)).msg

    got = []
    in_a_thread(lambda: got.append(asyncio.run(next_msg())))
    assert got == ["0"]


def test_persistent_writes(pair, tmp_path):
    target, initiator = pair
    path = tmp_path / "pmem"
    path.write_bytes(bytes(64 * KIB))
    durable = target.register_file(str(path), 64 * KIB)
    assert durable.persistent
    volatile = target.register(np.zeros(4 * KIB, dtype=np.uint8))
    src = initiator.register(np.full(4 * KIB, 0x5A, dtype=np.uint8))

    async def run():
        peer = await connect(initiator, target)
        await initiator.transfer(
            peer, "write", [(src.addr, durable.addr_at(8 * KIB), 4 * KIB)], timeout=10.0, durability="persistent"
        )
        with pytest.raises(ferry.InvalidArgument):
            await initiator.transfer(
                peer, "write", [(src.addr, volatile.addr, 4 * KIB)], timeout=10.0, durability="persistent"
            )
        with pytest.raises(ferry.InvalidArgument):
            await initiator.transfer(peer, "write", [(src.addr, durable.addr, 16)], durability="eventually")

    asyncio.run(run())
    data = path.read_bytes()
    assert data[8 * KIB : 12 * KIB] == b"\x5a" * (4 * KIB)
    assert data[: 8 * KIB] == bytes(8 * KIB)


def test_host_allocation_and_region_copies(pair):
    target, _ = pair
    region = target.alloc_host(8 * KIB)
    assert region.kind.startswith("host")
    region.write(100, b"hello")
    assert region.read(100, 5) == b"hello"
    assert len(region.read()) == 8 * KIB
    with pytest.raises(ferry.OutOfBounds):
        region.write(8 * KIB - 2, b"hello")
    with pytest.raises(ferry.OutOfBounds):
        region.addr_at(8 * KIB + 1)


def test_errors_and_capabilities():
    assert issubclass(ferry.Timeout, ferry.Error) and issubclass(ferry.Timeout, TimeoutError)
    assert issubclass(ferry.InvalidArgument, ValueError)
    assert {ferry.PeerClosed.code, ferry.Timeout.code} == {"peer_closed", "timeout"}
    caps = ferry.capabilities()
    tcp = [t for t in caps["transports"] if t["name"] == "tcp"]
    assert tcp and tcp[0]["usable"], caps
    with pytest.raises(ferry.InvalidArgument):
        ferry.Engine(transports=["carrier-pigeon"])
    with pytest.raises(ferry.InvalidArgument):
        ferry.Engine(buffer_pool="lots")


def test_connect_errors_and_closed_engine(pair):
    target, initiator = pair

    async def run():
        peer = await connect(initiator, target)
        with pytest.raises(ferry.AlreadyConnected):
            await connect(initiator, target)
        with pytest.raises(ferry.InvalidArgument):
            await initiator.connect(target.local_addr, timeout=-1)
        return peer

    peer = asyncio.run(run())
    with pytest.raises(RuntimeError):
        initiator.transfer(peer, "write", [(1, 2, 3)])  # a coroutine needs a running loop
    initiator.close()
    with pytest.raises(ferry.InvalidArgument):
        initiator.register(bytearray(16))


def test_register_ptr_refuses_memory_this_process_does_not_own(pair):
    target, _ = pair
    # A page mapped and unmapped again: its address names nothing now.
    page = mmap.mmap(-1, mmap.PAGESIZE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
    del page
    gc.collect()
    with pytest.raises(ferry.InvalidArgument, match="not mapped"):
        target.register_ptr(addr, 4096)
    # An address no process maps, as a GPU pointer would look to the host.
    with pytest.raises(ferry.InvalidArgument):
        target.register_ptr(0x10, 4096)
    assert target.region_count == 0


def test_a_listening_engine_without_tls_says_it_is_open():
    with pytest.warns(UserWarning, match="without TLS is open"):
        engine = ferry.Engine("127.0.0.1:0")
    engine.close()


def test_tls_options_authenticate_and_grants_decide_who_reaches_what():
    key = bytes(range(32))
    with pytest.raises(ferry.InvalidArgument):
        ferry.Engine(tls_psk=key)  # a key without a name
    with pytest.raises(ferry.InvalidArgument):
        ferry.Engine(tls_psk=key[:16], tls_name="short")
    target = ferry.Engine("127.0.0.1:0", tls_psk=key, tls_name="target")
    allowed = ferry.Engine(tls_psk=key, tls_name="decode-1")
    other = ferry.Engine(tls_psk=key, tls_name="decode-2")
    outsider = ferry.Engine(tls_psk=bytes(32), tls_name="decode-1")
    dst = target.alloc_host(64 * KIB)

    async def run():
        await dst.grant("decode-1", ferry.Access.READ | ferry.Access.WRITE)
        peer = await allowed.connect(target.local_addr, timeout=5.0)
        (remote,) = peer.regions()
        assert remote.addr == dst.addr_for("decode-1")
        src = allowed.alloc_host(64 * KIB)
        src.write(0, b"\x5a" * (64 * KIB))
        await allowed.transfer(peer, "write", [(src.addr, remote.addr, 64 * KIB)], timeout=5.0)
        assert dst.read() == b"\x5a" * (64 * KIB)
        # Another authenticated peer is told of nothing; a peer with another key gets no link.
        assert (await other.connect(target.local_addr, timeout=5.0)).regions() == []
        with pytest.raises(ferry.PermissionDenied):
            await outsider.connect(target.local_addr, timeout=5.0)
        # Revoked: the peer's next write is refused and writes nothing.
        await dst.revoke("decode-1")
        dst.write(0, b"\x00" * (64 * KIB))
        with pytest.raises((ferry.PermissionDenied, ferry.OutOfBounds)):
            await allowed.transfer(peer, "write", [(src.addr, remote.addr, 64 * KIB)], timeout=5.0)
        assert dst.read() == b"\x00" * (64 * KIB)

    try:
        asyncio.run(run())
    finally:
        for e in (target, allowed, other, outsider):
            e.close()


def test_data_protection_is_chosen_and_held_to():
    key = bytes(range(32))
    with pytest.raises(ferry.InvalidArgument):
        ferry.Engine(tls_psk=key, tls_name="x", data_protection="secret")
    with pytest.raises(ferry.InvalidArgument):
        ferry.Engine(tls_psk=key, tls_name="x", data_protection="plain", encrypt=True)
    with pytest.raises(ferry.InvalidArgument):
        ferry.Engine(data_protection="integrity")  # nothing to key it from without TLS
    target = ferry.Engine("127.0.0.1:0", tls_psk=key, tls_name="target", transports=["tcp"])
    plain = ferry.Engine(tls_psk=key, tls_name="plain", transports=["tcp"], data_protection="plain")
    sealed = ferry.Engine(tls_psk=key, tls_name="sealed", transports=["tcp"], encrypt=True)
    dst = target.alloc_host(64 * KIB)

    async def run():
        await dst.grant_all(ferry.Access.READ | ferry.Access.WRITE)
        # The target wants integrity at least (the default): a plain data stream is refused.
        with pytest.raises(ferry.PermissionDenied):
            await plain.connect(target.local_addr, timeout=5.0)
        peer = await sealed.connect(target.local_addr, timeout=5.0)
        (remote,) = peer.regions()
        src = sealed.alloc_host(64 * KIB)
        src.write(0, b"\x3c" * (64 * KIB))
        await sealed.transfer(peer, "write", [(src.addr, remote.addr, 64 * KIB)], timeout=5.0)
        assert dst.read() == b"\x3c" * (64 * KIB)

    try:
        asyncio.run(run())
    finally:
        for e in (target, plain, sealed):
            e.close()


def test_engines_find_each_other_by_name_in_an_etcd_directory(etcd):
    """Engine(name=..., directory=...) publishes the engine; another finds its record and
    connects by name; a name nobody holds is NotConnected."""
    url = etcd.replace("http://", "etcd://")
    target = ferry.Engine("127.0.0.1:0", name="target-0", directory=url, directory_prefix="/t")
    initiator = ferry.Engine("127.0.0.1:0", name="initiator-0", directory=url, directory_prefix="/t")
    try:
        buf = bytearray(b"\x5a" * 4096)
        region = target.register(buf)

        async def main():
            record = await initiator.lookup("target-0")
            assert record["name"] == "target-0" and int(record["engine_id"], 16) == target.id
            assert record["addrs"] == [target.local_addr]
            peer = await initiator.connect_by_name("target-0", timeout=5.0)
            assert peer.engine_id == target.id
            got = bytearray(4096)
            local = initiator.register(got)
            await initiator.transfer(peer, "read", [(local.addr, region.addr, 4096)])
            assert got == buf
            with pytest.raises(ferry.NotConnected):
                await initiator.connect_by_name("nobody", timeout=5.0)

        asyncio.run(main())
        with pytest.raises(ferry.AlreadyConnected):
            ferry.Engine("127.0.0.1:0", name="target-0", directory=url, directory_prefix="/t")
    finally:
        initiator.close()
        target.close()


def test_a_path_policy_refuses_a_link_it_does_not_allow():
    """`path_policy` on the engine and per connect: a link that can take none of the transports named
    raises Unsupported naming why; "tcp" between engines of one host gets TCP, not shared memory."""
    target = ferry.Engine("127.0.0.1:0", transports=["tcp"])
    strict = ferry.Engine(path_policy="shm")
    relaxed = ferry.Engine()
    unstaged = ferry.Engine()
    try:

        async def main():
            with pytest.raises(ferry.Unsupported, match="shm: .*does not offer it"):
                await strict.connect(target.local_addr, timeout=5.0)
            assert strict.peers() == []
            peer = await strict.connect(target.local_addr, timeout=5.0, path_policy="any")
            # The target offers TCP alone: nothing better was there to pass over.
            assert peer.transport == "tcp" and peer.passed_over == []
            peer = await relaxed.connect(target.local_addr, timeout=5.0, path_policy="tcp")
            assert peer.transport == "tcp"
            # A link that refuses to stage GPU memory still moves host memory.
            dst = target.register(bytearray(4096))
            peer = await unstaged.connect(target.local_addr, timeout=5.0, path_policy="tcp", stage_gpu_memory=False)
            src = unstaged.register(bytearray(b"x" * 4096))
            await unstaged.transfer(peer, "write", [(src.addr, dst.addr, 4096)], timeout=5.0)
            assert dst.read() == b"x" * 4096

        asyncio.run(main())
        with pytest.raises(ferry.InvalidArgument):
            ferry.Engine(path_policy="carrier-pigeon")
    finally:
        for e in (strict, relaxed, unstaged, target):
            e.close()


def test_integrity_checks_every_transfer_when_asked():
    """`integrity=True`: every transfer is checked end to end (CRC32C at both ends) over TCP and
    shared memory, and completes with the right bytes; a difference would raise ferry.Integrity,
    which is retryable. (The faults that make the check fail are in the Rust tests, whose builds have
    the hooks that flip bytes after they landed.)"""
    assert issubclass(ferry.Integrity, ferry.Error)
    assert ferry.Integrity.code == "integrity" and ferry.Integrity.retryable
    for transport in ("tcp", "shm"):
        target = ferry.Engine("127.0.0.1:0", transports=[transport])
        initiator = ferry.Engine(transports=[transport], integrity=True)
        try:
            dst = target.alloc_host(256 * KIB)
            src_array = np.arange(256 * KIB, dtype=np.uint8) * 7
            src = initiator.register(src_array)
            back = np.zeros_like(src_array)
            region = initiator.register(back)

            async def main():
                peer = await connect(initiator, target)
                assert peer.transport == transport
                # Region by region: an allocation of the target is mapped over shared memory.
                [route] = [r for r in peer.routes() if r["addr"] == dst.addr]
                assert route["transport"] == transport and route["passed_over"] is None, route
                assert route["how"].startswith("mapped" if transport == "shm" else "over tcp"), route
                await initiator.transfer(peer, "write", descs_for(src.addr, dst.addr, 4 * KIB, 64), timeout=5.0)
                await initiator.transfer(peer, "read", [(region.addr, dst.addr, region.length)], timeout=5.0)

            asyncio.run(main())
            assert np.array_equal(back, src_array), transport
        finally:
            initiator.close()
            target.close()


def test_cpu_tensors_move_by_data_ptr(pair, torch):
    """PyTorch CPU tensors, registered by `data_ptr()` as the README says (the tensor kept alive as
    the region's owner): a float16 tensor written into a byte tensor at the target and read back
    into a third, every byte compared."""
    target, initiator = pair
    src = torch.randn(256, 128, dtype=torch.float16)
    dst = torch.zeros(256 * 128 * 2, dtype=torch.uint8)
    back = torch.empty_like(src)

    def register(engine, tensor):
        return engine.register_ptr(tensor.data_ptr(), tensor.numel() * tensor.element_size(), owner=tensor)

    remote, source, landing = register(target, dst), register(initiator, src), register(initiator, back)
    assert remote.length == source.length == 64 * KIB

    async def run():
        peer = await connect(initiator, target)
        await initiator.transfer(peer, "write", descs_for(source.addr, remote.addr, 4 * KIB, 16), timeout=5.0)
        await initiator.transfer(peer, "read", [(landing.addr, remote.addr, landing.length)], timeout=5.0)

    asyncio.run(run())
    assert torch.equal(dst, src.view(torch.uint8).flatten())
    assert torch.equal(back.view(torch.uint8), src.view(torch.uint8))


def test_cuda_tensors_move_by_data_ptr(pair, torch):
    """A CUDA tensor registered by `data_ptr()` is device memory (the driver says so), staged:
    a peer's write is on the GPU when it completes, and a peer's read
    returns what the GPU holds. Needs a CUDA device; FERRY_REQUIRE_CUDA=1 makes its absence a
    failure (the GPU machine's script sets it)."""
    if not torch.cuda.is_available():
        if os.environ.get("FERRY_REQUIRE_CUDA") == "1":
            pytest.fail("FERRY_REQUIRE_CUDA=1 and torch sees no CUDA device")
        pytest.skip("no CUDA device (torch.cuda.is_available() is False): nothing to register")
    target, initiator = pair
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    back = torch.zeros_like(src)
    remote = target.register_ptr(dst.data_ptr(), dst.numel(), owner=dst)
    assert remote.kind.startswith("cuda device"), remote.kind
    assert remote.addr == dst.data_ptr(), "a CUDA region is named by its device pointer"
    # The same memory described by the tensor itself (`__cuda_array_interface__`).
    other = torch.zeros(4096, dtype=torch.float32, device="cuda")
    by_interface = target.register(other)
    assert by_interface.kind.startswith("cuda device") and by_interface.length == 4096 * 4
    target.deregister(by_interface)
    source = initiator.register_ptr(src.data_ptr(), src.numel(), owner=src)
    landing = initiator.register_ptr(back.data_ptr(), back.numel(), owner=back)

    async def run():
        peer = await connect(initiator, target)
        await initiator.transfer(peer, "write", descs_for(source.addr, remote.addr, 64 * KIB, 16), timeout=10.0)
        assert torch.equal(dst.cpu(), src), "the peer's write is not on the GPU"
        dst.copy_(torch.flip(src, [0]).cuda())
        torch.cuda.synchronize()
        await initiator.transfer(peer, "read", [(landing.addr, remote.addr, landing.length)], timeout=10.0)

    asyncio.run(run())
    assert torch.equal(back, torch.flip(src, [0])), "the peer's read did not return what the GPU holds"
    # A range past the tensor's allocation is refused, not registered.
    with pytest.raises(ferry.InvalidArgument):
        target.register_ptr(dst.data_ptr() + 4096, dst.numel() + (64 << 20))


class FakeCudaArray:
    """An object that describes memory as a CUDA array does (`__cuda_array_interface__`, v3)."""

    def __init__(self, addr, shape, typestr="|u1", strides=None, readonly=False):
        self.__cuda_array_interface__ = {
            "data": (addr, readonly),
            "shape": shape,
            "typestr": typestr,
            "strides": strides,
            "version": 3,
        }


def test_cuda_array_interface_is_checked_before_anything_is_registered(pair):
    """`register` takes CUDA arrays by `__cuda_array_interface__`: the layout must be one
    C-contiguous range, a read-only array is registered for reading only, and the pointer must be
    CUDA device memory, as the driver says; host memory described so is refused (`Unsupported`,
    naming the missing driver, where there is none)."""
    target, _ = pair
    host = np.zeros(4096, dtype=np.uint8)
    addr = host.ctypes.data
    with pytest.raises(ferry.InvalidArgument, match="not C-contiguous"):
        target.register(FakeCudaArray(addr, (32, 32), "<f4", strides=(4, 128)))
    with pytest.raises(ferry.InvalidArgument, match="no array element type"):
        target.register(FakeCudaArray(addr, (16,), "f4"))
    with pytest.raises(ferry.InvalidArgument, match="no bytes"):
        target.register(FakeCudaArray(addr, (0, 4)))
    with pytest.raises(ferry.InvalidArgument, match="read-only"):
        target.register(FakeCudaArray(addr, (4096,), readonly=True))
    # Well described, but host memory: refused by the driver's answer, or for want of a driver.
    if ferry.capabilities()["cuda"]["unavailable"]:
        refusal, why = ferry.Unsupported, "no CUDA driver"
    else:
        refusal, why = ferry.InvalidArgument, "not CUDA device memory"
    with pytest.raises(refusal, match=why):
        target.register(FakeCudaArray(addr, (4096,)))
    with pytest.raises(refusal, match=why):
        target.register(FakeCudaArray(addr, (1024,), "<f4", strides=(4,)), access=ferry.READ)
    assert target.region_count == 0


class _DlDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DlDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DlManagedTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DlDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DlDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeDlpack:
    """An object that describes memory as a DLPack producer does (`__dlpack_device__`,
    `__dlpack__`), as JAX and TensorFlow arrays do on a GPU. The capsule points into this object,
    which outlives it in these tests."""

    def __init__(self, addr, shape, bits=8, strides=None, device_type=2, name=b"dltensor"):
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = (ctypes.c_int64 * len(strides))(*strides) if strides else None
        self._tensor = _DlManagedTensor(
            data=addr,
            device=_DlDevice(device_type, 0),
            ndim=len(shape),
            dtype=_DlDataType(2, bits, 1),
            shape=ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64)),
            strides=ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64)) if strides else None,
        )
        self._device_type = device_type
        self._name = name

    def __dlpack_device__(self):
        return (self._device_type, 0)

    def __dlpack__(self, stream=None):
        return _capsule_new(ctypes.addressof(self._tensor), self._name, None)


def test_dlpack_arrays_are_checked_before_anything_is_registered(pair):
    """`register` takes CUDA arrays by DLPack too: the capsule must be an unused `dltensor`, the
    layout one C-contiguous range of whole bytes, and the pointer CUDA device memory, as the driver
    says (`Unsupported`, naming the missing driver, where there is none). An array on another
    device goes by the buffer protocol, as numpy's (which also speaks DLPack) does."""
    target, _ = pair
    host = np.zeros(4096, dtype=np.uint8)
    addr = host.ctypes.data
    with pytest.raises(ferry.InvalidArgument, match="not C-contiguous"):
        target.register(FakeDlpack(addr, (32, 32), bits=32, strides=(1, 32)))
    with pytest.raises(ferry.InvalidArgument, match="no whole number of bytes"):
        target.register(FakeDlpack(addr, (16,), bits=12))
    with pytest.raises(ferry.InvalidArgument, match="no bytes"):
        target.register(FakeDlpack(addr, (0, 4)))
    with pytest.raises(ferry.InvalidArgument, match="not an unused"):
        target.register(FakeDlpack(addr, (4096,), name=b"used_dltensor"))
    if ferry.capabilities()["cuda"]["unavailable"]:
        refusal, why = ferry.Unsupported, "no CUDA driver"
    else:
        refusal, why = ferry.InvalidArgument, "not CUDA device memory"
    with pytest.raises(refusal, match=why):
        target.register(FakeDlpack(addr, (4096,)))
    with pytest.raises(refusal, match=why):
        target.register(FakeDlpack(addr, (1024,), bits=32, strides=(1,)), access=ferry.READ)
    # Not a GPU's: the buffer protocol decides (this object has none).
    with pytest.raises(ferry.InvalidArgument, match="buffer protocol"):
        target.register(FakeDlpack(addr, (4096,), device_type=1))
    assert target.region_count == 0
    assert np.asarray(host).__dlpack_device__()[0] == 1
    region = target.register(host)
    assert not region.kind.startswith("cuda"), region.kind
    target.deregister(region)
