"""ferry.nixl: NIXL's agent API on ferry. The connector pattern across two processes with every
byte checked, NIXL's exception types for what NIXL refuses, the formats that cross processes
refusing what they did not write, and an unmodified NIXL program run by `python -m ferry.nixl`."""

import base64
import hashlib
import importlib.util
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from ferry.nixl import _bindings as nb
from ferry.nixl import _wire, nixl_agent, nixl_agent_config

HERE = Path(__file__).parent
TRANSPORTS = [None, ["tcp"]]


def pattern(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8)


def wait_done(agent, handle, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return
        assert state == "PROC"
        assert time.monotonic() < deadline, "the transfer did not complete"
        time.sleep(0.0005)


def wait_notifs(agent, sender, count=1, timeout=10.0):
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        got.extend(agent.get_new_notifs().get(sender, []))
        assert time.monotonic() < deadline, f"got {len(got)} of {count} notifications"
        time.sleep(0.001)
    return got


class Prefill:
    """`nixl_peer.py` in a process of its own."""

    def __init__(self, transports=None, env_extra=None, memory="numpy"):
        env = dict(os.environ, NIXL_PEER_MEMORY=memory)
        if transports:
            env["NIXL_PEER_TRANSPORTS"] = ",".join(transports)
        env.update(env_extra or {})
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "nixl_peer.py")], stdout=subprocess.PIPE, env=env, text=True
        )
        hello = self.read_line()
        self.metadata = base64.b64decode(hello["metadata"])
        self.blocks = hello["blocks"]
        self.block_size = hello["block_size"]

    def read_line(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the prefill process exited (code {self.proc.poll()})")
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()


@pytest.fixture
def prefill():
    procs = []

    def start(transports=None, memory="numpy", **env_extra):
        p = Prefill(transports, env_extra, memory)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.close()


@pytest.fixture
def agents():
    """Two agents in this process; `decode` has loaded `prefill`'s metadata once each registered
    64 blocks of 4 KiB (prefill's filled with a pattern)."""
    made = []

    def make(name, **kw):
        a = nixl_agent(name, nixl_agent_config(backends=["UCX"], **kw))
        made.append(a)
        return a

    prefill, decode = make("prefill"), make("decode")
    src = pattern(64 * 4096, seed=3)
    dst = np.zeros(64 * 4096, dtype=np.uint8)
    prefill.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    decode.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    assert decode.add_remote_agent(prefill.get_agent_metadata()) == b"prefill"
    yield prefill, decode, src, dst
    for a in made:
        a.close()


def block_list(base, count, size=4096):
    return [(base + i * size, size, 0) for i in range(count)]


@pytest.mark.parametrize("memory", ["numpy", "torch"])
@pytest.mark.parametrize("transports", TRANSPORTS, ids=["default", "tcp"])
def test_connector_pattern_across_processes(prefill, transports, memory, request):
    """vLLM's NixlConnector, decode side: load the prefill agent, prepare both block lists once,
    READ chosen blocks with a notification, poll until DONE; then a WRITE (initialize_xfer) whose
    notification the prefill side must see only once the bytes are in its memory. With `torch`,
    both sides hold their blocks in PyTorch CPU tensors: the decode side registers its cache tensor
    itself and names blocks by `data_ptr()`, the prefill side registers `(data_ptr(), len, 0, "")`."""
    torch = request.getfixturevalue("torch") if memory == "torch" else None
    remote = prefill(transports, memory)
    size, count = remote.block_size, len(remote.blocks)
    expected = pattern(size * count, seed=7).reshape(count, size)

    agent = nixl_agent("decode", nixl_agent_config(backends=["UCX"], transports=transports))
    try:
        if torch is not None:
            cache = torch.zeros((count, size), dtype=torch.uint8)
            reg = agent.register_memory(cache)
            kv = cache.numpy()  # the tensor's own bytes, for the checks
            assert kv.ctypes.data == cache.data_ptr()
        else:
            kv = np.zeros((count, size), dtype=np.uint8)
            reg = agent.register_memory(agent.get_reg_descs([(kv.ctypes.data, kv.nbytes, 0, "")], "DRAM"))
        name = agent.add_remote_agent(remote.metadata)
        assert name == b"prefill"
        assert agent.check_remote_metadata("prefill")

        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_list(kv.ctypes.data, count, size), "DRAM")
        far = agent.prep_xfer_dlist(name, [(a, size, 0) for a in remote.blocks], "DRAM")

        remote_ids = np.array([3, 17, 42, 63, 0, 8], dtype=np.int32)
        local_ids = np.array([0, 1, 2, 3, 4, 5], dtype=np.int32)
        tag = b"req-7:read\x00\xff" + bytes(range(256))
        handle = agent.make_prepped_xfer("READ", local, local_ids, far, remote_ids, tag)
        assert agent.transfer(handle) in ("PROC", "DONE")
        wait_done(agent, handle)
        for lo, ro in zip(local_ids, remote_ids):
            assert np.array_equal(kv[lo], expected[ro]), f"block {ro} read into {lo} differs"
        assert not kv[6:].any(), "bytes landed outside the blocks read"
        seen = remote.read_line()
        assert seen["from"] == "decode" and bytes.fromhex(seen["msg"]) == tag
        agent.release_xfer_handle(handle)

        # A second read of other blocks through the same prepared lists, posted twice.
        handle = agent.make_prepped_xfer("READ", local, [10, 11], far, [20, 21], b"again")
        for _ in range(2):
            kv[10:12] = 0
            agent.transfer(handle)
            wait_done(agent, handle)
            assert np.array_equal(kv[10:12], expected[20:22])
            assert bytes.fromhex(remote.read_line()["msg"]) == b"again"
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(far)

        # WRITE fresh bytes over remote blocks 5 and 6; the notification must find them there.
        fresh = pattern(2 * size, seed=11).reshape(2, size)
        if torch is not None:
            fresh_tensor = torch.tensor(fresh)
            src = agent.register_memory([fresh_tensor])
            fresh_base = fresh_tensor.data_ptr()
        else:
            src = agent.register_memory([fresh])
            fresh_base = fresh.ctypes.data
        local_descs = agent.get_xfer_descs(block_list(fresh_base, 2, size), "DRAM")
        remote_descs = agent.get_xfer_descs([(remote.blocks[5], size, 0), (remote.blocks[6], size, 0)], "DRAM")
        handle = agent.initialize_xfer("WRITE", local_descs, remote_descs, "prefill", b"wrote 5,6")
        agent.transfer(handle)
        wait_done(agent, handle)
        after = expected.copy()
        after[5:7] = fresh
        seen = remote.read_line()
        assert bytes.fromhex(seen["msg"]) == b"wrote 5,6"
        assert seen["sha256"] == hashlib.sha256(after.tobytes()).hexdigest()

        agent.send_notif("prefill", b"exit")
        assert remote.proc.wait(timeout=10) == 0
        agent.deregister_memory(src)
        agent.deregister_memory(reg)
    finally:
        agent.close()


def test_write_with_initialize_xfer_and_notification(agents):
    prefill, decode, src, dst = agents
    decode_src = pattern(8 * 4096, seed=5)
    decode.register_memory([decode_src])
    decode.add_remote_agent(prefill.get_agent_metadata())
    local = decode.get_xfer_descs(block_list(decode_src.ctypes.data, 8), "DRAM")
    far = decode.get_xfer_descs(np.array(block_list(src.ctypes.data + 8 * 4096, 8), dtype=np.uint64), "DRAM")
    handle = decode.initialize_xfer("WRITE", local, far, "prefill", b"blocks 8..15")
    decode.transfer(handle)
    wait_done(decode, handle)
    assert np.array_equal(src[8 * 4096 : 16 * 4096], decode_src)
    assert wait_notifs(prefill, "decode") == [b"blocks 8..15"]
    assert prefill.check_remote_xfer_done("decode", b"") is False

    # Reposting with a new message replaces the handle's.
    decode_src[:] = 0x5A
    decode.transfer(handle, b"again")
    wait_done(decode, handle)
    assert (src[8 * 4096 : 16 * 4096] == 0x5A).all()
    deadline = time.monotonic() + 10
    while not prefill.check_remote_xfer_done("decode", b"aga"):
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_loopback_read_with_the_agents_own_name(agents):
    prefill, _, src, _ = agents
    out = np.zeros(4096 * 2, dtype=np.uint8)
    prefill.register_memory([out])
    local = prefill.prep_xfer_dlist("", block_list(out.ctypes.data, 2), "DRAM")
    same = prefill.prep_xfer_dlist("prefill", block_list(src.ctypes.data, 64), "DRAM")
    handle = prefill.make_prepped_xfer("READ", local, [0, 1], same, [63, 1])
    prefill.transfer(handle)
    wait_done(prefill, handle)
    assert np.array_equal(out[:4096], src[63 * 4096 :]) and np.array_equal(out[4096:], src[4096:8192])


def test_unknown_agent_raises_not_found(agents):
    _, decode, src, dst = agents
    descs = block_list(src.ctypes.data, 1)
    with pytest.raises(nb.nixlNotFoundError):
        decode.prep_xfer_dlist("nobody", descs, "DRAM")
    with pytest.raises(nb.nixlNotFoundError):
        decode.initialize_xfer(
            "READ",
            decode.get_xfer_descs(block_list(dst.ctypes.data, 1), "DRAM"),
            decode.get_xfer_descs(descs, "DRAM"),
            "nobody",
        )
    with pytest.raises(nb.nixlNotFoundError):
        decode.send_notif("nobody", b"hi")
    with pytest.raises(nb.nixlNotFoundError):
        decode.make_connection("nobody")
    assert decode.check_remote_metadata("nobody") is False
    decode.remove_remote_agent("nobody")


def test_memory_not_registered_raises_not_found(agents):
    _, decode, src, dst = agents
    with pytest.raises(nb.nixlNotFoundError):
        decode.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst.ctypes.data + 63 * 4096, 8192, 0)], "DRAM")
    with pytest.raises(nb.nixlNotFoundError):
        decode.prep_xfer_dlist("prefill", [(src.ctypes.data - 4096, 4096, 0)], "DRAM")
    with pytest.raises(nb.nixlNotFoundError):
        decode.deregister_memory(decode.get_reg_descs([(dst.ctypes.data, 4096, 0, "")], "DRAM"))


def test_bad_indices_raise_invalid_param(agents):
    _, decode, src, dst = agents
    local = decode.prep_xfer_dlist("NIXL_INIT_AGENT", block_list(dst.ctypes.data, 64), "DRAM")
    far = decode.prep_xfer_dlist("prefill", block_list(src.ctypes.data, 64), "DRAM")
    for li, ri in [([64], [0]), ([0], [64]), ([-1], [0]), ([0, 1], [0]), ([], [])]:
        with pytest.raises(nb.nixlInvalidParamError):
            decode.make_prepped_xfer("READ", local, li, far, ri)
    half = decode.prep_xfer_dlist("prefill", [(src.ctypes.data, 2048, 0)], "DRAM")
    with pytest.raises(nb.nixlInvalidParamError, match="length mismatch"):
        decode.make_prepped_xfer("READ", local, [0], half, [0])
    with pytest.raises(nb.nixlInvalidParamError):
        decode.make_prepped_xfer("READ", far, [0], local, [0])
    with pytest.raises(KeyError):
        decode.make_prepped_xfer("RD", local, [0], far, [0])


def test_released_handles_raise_invalid_param(agents):
    _, decode, src, dst = agents
    local = decode.prep_xfer_dlist("NIXL_INIT_AGENT", block_list(dst.ctypes.data, 4), "DRAM")
    far = decode.prep_xfer_dlist("prefill", block_list(src.ctypes.data, 4), "DRAM")
    handle = decode.make_prepped_xfer("READ", local, [0], far, [0])
    with pytest.raises(nb.nixlNotPostedError):
        decode.check_xfer_state(handle)
    decode.transfer(handle)
    wait_done(decode, handle)
    decode.release_xfer_handle(handle)
    decode.release_xfer_handle(handle)
    with pytest.raises(nb.nixlInvalidParamError):
        decode.transfer(handle)
    with pytest.raises(nb.nixlInvalidParamError):
        decode.check_xfer_state(handle)
    decode.release_dlist_handle(far)
    with pytest.raises(nb.nixlInvalidParamError):
        decode.make_prepped_xfer("READ", local, [0], far, [0])


def test_removed_agent_fails_its_handles_with_not_found(agents):
    prefill, decode, src, dst = agents
    local = decode.prep_xfer_dlist("NIXL_INIT_AGENT", block_list(dst.ctypes.data, 1), "DRAM")
    far = decode.prep_xfer_dlist("prefill", block_list(src.ctypes.data, 1), "DRAM")
    handle = decode.make_prepped_xfer("READ", local, [0], far, [0])
    decode.remove_remote_agent(b"prefill")
    assert not decode.check_remote_metadata("prefill")
    with pytest.raises(nb.nixlNotFoundError):
        decode.transfer(handle)
    decode.add_remote_agent(prefill.get_agent_metadata())
    with pytest.raises(nb.nixlNotFoundError):
        decode.make_prepped_xfer("READ", local, [0], far, [0])


def test_vram_lists_must_name_cuda_memory(agents):
    """"VRAM" descriptor lists are CUDA device memory: host memory registered as VRAM is refused
    (the driver does not know it as device memory; without a driver nothing is), and nothing stays
    registered. The GPU device API (remote descriptor lists, memory views) is not served."""
    _, decode, _, dst = agents
    for mem in ("VRAM", "cuda"):
        assert decode.get_reg_descs([(dst.ctypes.data, 4096, 0, "")], mem).getType() == nb.VRAM_SEG
        assert decode.get_xfer_descs([(dst.ctypes.data, 4096, 0)], mem).getType() == nb.VRAM_SEG
    host = np.zeros(8192, dtype=np.uint8)
    regions = decode._engine.region_count
    with pytest.raises(nb.nixlInvalidParamError, match="does not know them as device memory"):
        decode.register_memory([(host.ctypes.data, 4096, 0, ""), (host.ctypes.data + 4096, 4096, 0, "")], "VRAM")
    assert decode._engine.region_count == regions
    with pytest.raises(KeyError):
        decode.get_xfer_descs([(dst.ctypes.data, 4096, 0)], "V-RAM")
    with pytest.raises(nb.nixlNotSupportedError, match="no GPU device API"):
        decode.prep_mem_view(decode.get_xfer_descs([(dst.ctypes.data, 4096, 0)], "DRAM"))


def test_cuda_tensors_as_vram(agents, torch):
    """A CUDA tensor registered through NIXL's API is VRAM, named by its data_ptr(): a peer WRITEs
    host blocks into it and READs them back, every byte compared on the GPU. Needs a CUDA device;
    FERRY_REQUIRE_CUDA=1 makes its absence a failure."""
    if not torch.cuda.is_available():
        if os.environ.get("FERRY_REQUIRE_CUDA") == "1":
            pytest.fail("FERRY_REQUIRE_CUDA=1 and torch sees no CUDA device")
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
    prefill, decode, src, _ = agents
    kv = torch.zeros(16 * 4096, dtype=torch.uint8, device="cuda")
    reg = decode.register_memory([kv])
    assert reg.getType() == nb.VRAM_SEG
    prefill.add_remote_agent(decode.get_agent_metadata())
    local = prefill.get_xfer_descs(block_list(src.ctypes.data, 16), "DRAM")
    far = prefill.get_xfer_descs(block_list(kv.data_ptr(), 16), "VRAM")
    handle = prefill.initialize_xfer("WRITE", local, far, "decode", b"kv")
    prefill.transfer(handle)
    wait_done(prefill, handle)
    assert torch.equal(kv.cpu(), torch.from_numpy(src[: 16 * 4096].copy()))
    assert wait_notifs(decode, "prefill") == [b"kv"]
    decode.deregister_memory(reg)


def test_descriptor_lists_as_nixl_builds_them(agents):
    _, decode, _, dst = agents
    assert decode.get_xfer_descs([(1, 2, 3, 4)], "DRAM") is None
    assert decode.get_xfer_descs([(1, 2, 3)]) is None
    assert decode.get_reg_descs([(1, 2, 3)], "DRAM") is None
    assert decode.get_reg_descs([(1, 2, 3, "m")]) is None
    assert decode.get_xfer_descs(np.zeros((2, 4), dtype=np.uint64), "DRAM") is None
    assert decode.get_xfer_descs(decode.get_reg_descs([(1, 2, 0, "")], "DRAM")) is None

    reg = decode.get_reg_descs([(10, 20, 0, b"a"), (30, 40, 1, "b")], "cpu")
    assert len(reg) == reg.descCount() == 2 and reg.getType() == nb.DRAM_SEG
    assert reg[1] == (30, 40, 1, b"b") and reg[-1] == reg[1]
    with pytest.raises(IndexError):
        reg[2]
    xfer = reg.trim()
    assert isinstance(xfer, nb.nixlXferDList) and list(xfer) == [(10, 20, 0), (30, 40, 1)]
    assert decode.get_xfer_descs(np.array([[10, 20, 0], [30, 40, 1]], dtype=np.uint64), "DRAM") == xfer
    view = decode.get_xfer_descs(dst)
    assert view is None, "a numpy array is an N×3 descriptor array, as in NIXL"
    obj = decode.get_xfer_descs(bytearray(100))
    assert len(obj) == 1 and obj[0][1] == 100


def test_serialized_descs_round_trip_and_refuse_what_they_did_not_write(agents):
    _, decode, _, _ = agents
    xfer = decode.get_xfer_descs([(0x1000, 4096, 0), (2**64 - 2, 1, 7)], "DRAM")
    reg = decode.get_reg_descs([(0x1000, 4096, 0, b"\x00meta\xff"), (0x9000, 1, 0, "")], "DRAM")
    for dl in (xfer, reg):
        blob = decode.get_serialized_descs(dl)
        assert isinstance(blob, bytes)
        back = decode.deserialize_descs(blob)
        assert type(back) is type(dl) and back == dl
    blob = decode.get_serialized_descs(reg)
    bad = [
        b"",
        blob[:10],
        blob[:-1],
        blob + b"\x00",
        b"X" + blob[1:],
        blob[:8] + struct.pack("<H", _wire.VERSION + 1) + blob[10:],
        blob[:12] + struct.pack("<Q", 2**40) + blob[20:],
        __import__("pickle").dumps([(1, 2, 3)]),
    ]
    for b in bad:
        with pytest.raises(nb.nixlInvalidParamError):
            decode.deserialize_descs(b)
    with pytest.raises(nb.nixlInvalidParamError):
        decode.deserialize_descs(b"x" * (_wire.MAX_SERIALIZED_DESCS_BYTES + 1))


def test_corrupted_or_oversized_metadata_is_refused(agents):
    prefill, decode, _, _ = agents
    md = prefill.get_agent_metadata()
    body = json.loads(md[14:])

    def blob(doc):
        raw = json.dumps(doc).encode()
        return _wire.METADATA_MAGIC + struct.pack("<HI", _wire.VERSION, len(raw)) + raw

    assert decode.add_remote_agent(blob(body)) == b"prefill", "the test's own blobs must be readable"

    bad = [
        b"",
        md[:13],
        md[:-1],
        md + b" ",
        b"FRYNXLMX" + md[8:],
        md[:8] + struct.pack("<H", 9) + md[10:],
        blob({**body, "extra": 1}),
        blob({k: v for k, v in body.items() if k != "regions"}),
        blob({**body, "engine_id": True}),
        blob({**body, "engine_id": -1}),
        blob({**body, "name": ""}),
        blob({**body, "name": "x" * 300}),
        blob({**body, "addr": "no-port"}),
        blob({**body, "regions": [[2**64 - 1, 2]]}),
        blob({**body, "regions": [[1, 0]]}),
        blob({**body, "regions": [["1", 2]]}),
        blob({**body, "addr": None}),
        blob({**body, "partial": 1}),
        blob({k: v for k, v in body.items() if k != "partial"}),
        _wire.METADATA_MAGIC + struct.pack("<HI", _wire.VERSION - 1, len(md) - 14) + md[14:],
        _wire.METADATA_MAGIC + struct.pack("<HI", _wire.VERSION, 3) + b"{{{",
        b"\x80\x04pickle",
        "not bytes",
    ]
    for b in bad:
        with pytest.raises(nb.nixlInvalidParamError):
            decode.add_remote_agent(b)
    with pytest.raises(nb.nixlInvalidParamError, match="exceeds"):
        decode.add_remote_agent(md + b" " * _wire.MAX_METADATA_BYTES)
    with pytest.raises(nb.nixlInvalidParamError):
        decode.add_remote_agent(decode.get_agent_metadata())


def test_metadata_of_another_engine_under_a_known_name_is_not_allowed(agents):
    _, decode, _, _ = agents
    impostor = nixl_agent("prefill")
    try:
        with pytest.raises(nb.nixlNotAllowedError):
            decode.add_remote_agent(impostor.get_agent_metadata())
    finally:
        impostor.close()


def test_notifications_keep_every_byte_and_are_bounded(agents):
    prefill, decode, _, _ = agents
    prefill.add_remote_agent(decode.get_agent_metadata())
    msgs = [b"", bytes(range(256)), os.urandom(5000), "héllo", b"\x00" * _wire.MAX_NOTIF_BYTES]
    for m in msgs:
        decode.send_notif("prefill", m)
    got = wait_notifs(prefill, "decode", len(msgs))
    assert got == [m.encode() if isinstance(m, str) else m for m in msgs]
    with pytest.raises(nb.nixlInvalidParamError):
        decode.send_notif("prefill", b"x" * (_wire.MAX_NOTIF_BYTES + 1))
    decode.send_notif(b"prefill", b"tag:42:done")
    deadline = time.monotonic() + 10
    while not prefill.check_remote_xfer_done("decode", b"42", tag_is_prefix=False):
        assert time.monotonic() < deadline
    assert prefill.check_remote_xfer_done("decode", b"tag") is False


def test_a_frame_out_of_order_is_dropped_not_misassembled():
    asm = _wire.NotifAssembler()
    frames = _wire.notif_frames("a", 1, b"x" * 3000)
    assert len(frames) == 3
    assert asm.feed(1, "h", *frames[0]) is None
    assert asm.feed(1, "h", *frames[2]) is None
    assert asm.feed(1, "h", *frames[1]) is None
    for f in frames[:2]:
        assert asm.feed(1, "h", *f) is None
    assert asm.feed(1, "h", *frames[2]) == ("a", b"x" * 3000)
    assert asm.feed(1, "h", "not ours", "x") is None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def read_all_blocks(agent, remote, expected):
    """READs every block of the remote process into fresh memory and checks every byte."""
    size, count = remote.block_size, len(remote.blocks)
    kv = np.zeros((count, size), dtype=np.uint8)
    reg = agent.register_memory(agent.get_reg_descs([(kv.ctypes.data, kv.nbytes, 0, "")], "DRAM"))
    local = agent.get_xfer_descs(block_list(kv.ctypes.data, count, size), "DRAM")
    far = agent.get_xfer_descs([(a, size, 0) for a in remote.blocks], "DRAM")
    assert agent.check_remote_metadata("prefill", far)
    handle = agent.initialize_xfer("READ", local, far, "prefill")
    agent.transfer(handle)
    wait_done(agent, handle, timeout=30.0)
    assert np.array_equal(kv, expected), "a byte read differs from the remote pattern"
    agent.release_xfer_handle(handle)
    agent.deregister_memory(reg)


def test_send_local_metadata_across_processes_then_invalidate(prefill):
    """The prefill process pushes its metadata to this agent's listener (NIXL's
    send_local_metadata to ip:port); check_remote_metadata turns True, every block reads back
    exactly; then prefill invalidates its metadata here and check_remote_metadata turns False."""
    port = free_port()
    agent = nixl_agent("decode", nixl_agent_config(backends=["UCX"], enable_listen_thread=True, listen_port=port))
    try:
        assert agent.get_backend_params("UCX")["listen_addr"].endswith(f":{port}")
        assert not agent.check_remote_metadata("prefill")
        remote = prefill(NIXL_PEER_SEND_TO=f"127.0.0.1:{port}")
        expected = pattern(remote.block_size * len(remote.blocks), seed=7).reshape(len(remote.blocks), -1)
        wait_for(lambda: agent.check_remote_metadata("prefill"), "prefill's metadata to arrive")
        read_all_blocks(agent, remote, expected)

        agent.send_notif("prefill", b"invalidate")
        assert remote.read_line() == {"invalidated": True}
        wait_for(lambda: not agent.check_remote_metadata("prefill"), "prefill's metadata to be invalidated")
        with pytest.raises(nb.nixlNotFoundError):
            agent.send_notif("prefill", b"exit")
    finally:
        agent.close()


def test_fetch_remote_metadata_across_processes(prefill):
    """This agent asks the prefill process's listener for its metadata (NIXL's
    fetch_remote_metadata); it loads asynchronously, every block reads back exactly, and
    notifications still reach the listening process."""
    port = free_port()
    remote = prefill(NIXL_PEER_LISTEN_PORT=str(port))
    expected = pattern(remote.block_size * len(remote.blocks), seed=7).reshape(len(remote.blocks), -1)
    agent = nixl_agent("decode", nixl_agent_config(backends=["UCX"]))
    try:
        assert agent.fetch_remote_metadata("prefill", "127.0.0.1", port) is None
        wait_for(lambda: agent.check_remote_metadata("prefill"), "prefill's metadata to be fetched")
        read_all_blocks(agent, remote, expected)
        agent.send_notif("prefill", b"fetched")
        seen = remote.read_line()
        assert seen["from"] == "decode" and bytes.fromhex(seen["msg"]) == b"fetched"
        agent.send_notif("prefill", b"exit")
        assert remote.proc.wait(timeout=30) == 0
    finally:
        agent.close()


def test_metadata_exchange_in_one_process_and_what_it_refuses():
    """send, fetch and invalidate between two listening agents of this process; a fetch of a
    name the listener does not have loads nothing; what NIXL's callers get wrong raises."""
    a = nixl_agent("a", nixl_agent_config(enable_listen_thread=True, listen_port=0))
    b = nixl_agent("b", nixl_agent_config(enable_listen_thread=True, listen_port=0))
    try:
        buf = pattern(8192, seed=5)
        a.register_memory([buf])
        a_port = int(a.get_backend_params("UCX")["listen_addr"].rpartition(":")[2])
        b_port = int(b.get_backend_params("UCX")["listen_addr"].rpartition(":")[2])
        descs = b.get_xfer_descs([(buf.ctypes.data, 8192, 0)], "DRAM")
        too_far = b.get_xfer_descs([(buf.ctypes.data, 8193, 0)], "DRAM")

        b.fetch_remote_metadata("nobody", "127.0.0.1", a_port)
        b.fetch_remote_metadata("a", "127.0.0.1", a_port)
        wait_for(lambda: b.check_remote_metadata("a"), "a's metadata to be fetched")
        assert b.check_remote_metadata("a", descs) and not b.check_remote_metadata("a", too_far)
        assert not b.check_remote_metadata("nobody")
        got = np.zeros(8192, dtype=np.uint8)
        b.register_memory([got])
        h = b.initialize_xfer("READ", b.get_xfer_descs([got]), descs, "a")
        b.transfer(h)
        wait_done(b, h, timeout=30.0)
        assert np.array_equal(got, buf)
        b.release_xfer_handle(h)

        b.send_local_metadata("127.0.0.1", a_port)
        wait_for(lambda: a.check_remote_metadata("b"), "b's metadata to arrive at a")
        b.send_notif("a", b"hello")
        assert wait_notifs(a, "b", timeout=30.0) == [b"hello"]

        a.invalidate_local_metadata("127.0.0.1", b_port)
        wait_for(lambda: not b.check_remote_metadata("a"), "a's invalidation to reach b")
        assert a.check_remote_metadata("b")

        with pytest.raises(nb.nixlNotSupportedError, match="etcd"):
            a.send_local_metadata()
        with pytest.raises(nb.nixlNotSupportedError):
            a.invalidate_local_metadata()
        with pytest.raises(nb.nixlInvalidParamError):
            a.send_local_metadata("127.0.0.1", 0)
        with pytest.raises(nb.nixlInvalidParamError):
            a.fetch_remote_metadata("a", "127.0.0.1", b_port)
    finally:
        a.close()
        b.close()


def test_exchange_messages_are_bounded_and_checked():
    with pytest.raises(nb.nixlInvalidParamError, match="exceeds the limit"):
        _wire.notif_frames("a", 1, b"x" * (_wire.MAX_EXCHANGE_BYTES + 1), _wire.EXCHANGE_PREFIX)
    frames = _wire.notif_frames("a", 1, b"x" * 3000, _wire.EXCHANGE_PREFIX)
    assert _wire.parse_notif(*frames[0]) is None, "an exchange frame must not pass for a notification"
    asm = _wire.NotifAssembler(prefix=_wire.EXCHANGE_PREFIX)
    got = [asm.feed(1, "h", *f) for f in frames]
    assert got[-1] == ("a", b"x" * 3000)
    md = _wire.AgentMetadata("a", "127.0.0.1:5", 9, ((4096, 10),))
    for kind in (_wire.EX_SEND, _wire.EX_ANSWER):
        assert _wire.decode_exchange(_wire.encode_exchange(kind, _wire.encode_metadata(md))) == (kind, md)
    assert _wire.decode_exchange(_wire.encode_fetch("b", md)) == (_wire.EX_FETCH, ("b", "", md))
    assert _wire.decode_exchange(_wire.encode_fetch("b", md, "conn")) == (_wire.EX_FETCH, ("b", "conn", md))
    with pytest.raises(nb.nixlInvalidParamError):
        _wire.encode_fetch("b", md, "bad\nlabel")
    assert _wire.decode_exchange(_wire.encode_exchange(_wire.EX_INVALIDATE)) == (_wire.EX_INVALIDATE, None)
    good = _wire.encode_fetch("b", md)
    for bad in (b"", b"FRYNXLEX", b"XXXXXXXX" + good[8:], good[:8] + struct.pack("<H", _wire.VERSION + 1) + good[10:], good[:-1],
                good[:10] + b"\x09", _wire.encode_exchange(_wire.EX_INVALIDATE) + b"x",
                _wire.encode_exchange(_wire.EX_SEND, b"pickle")):
        with pytest.raises(nb.nixlInvalidParamError):
            _wire.decode_exchange(bad)


def test_introspection_answers_about_ferry(agents):
    _, decode, _, _ = agents
    assert decode.get_plugin_list() == ["FERRY"]
    assert decode.get_plugin_mem_types("FERRY") == ["DRAM_SEG", "VRAM_SEG"]
    assert decode.get_plugin_mem_types("UVX") == [] and decode.get_plugin_params("UVX") == {}
    assert decode.get_backend_mem_types("UCX") == ["DRAM_SEG", "VRAM_SEG"]
    params = decode.get_backend_params("UCX")
    assert params["engine"] == "ferry" and params["transports"]
    assert decode.get_backend_mem_types("LIBFABRIC") == []
    with pytest.raises(nb.nixlNotFoundError):
        decode.create_backend("UVX")
    with pytest.raises(KeyError):
        decode.register_memory([bytearray(16)], backends=["LIBFABRIC"])
    with pytest.raises(nb.nixlNotSupportedError):
        decode.fetch_remote_metadata("prefill")  # no address: NIXL's etcd
    with pytest.raises(ValueError):
        nixl_agent("")
    with pytest.raises(TypeError):
        nixl_agent_config(sync_mode=1)


def test_telemetry(agents):
    prefill, decode, src, dst = agents
    local = decode.get_xfer_descs(block_list(dst.ctypes.data, 2), "DRAM")
    far = decode.get_xfer_descs(block_list(src.ctypes.data, 2), "DRAM")
    handle = decode.initialize_xfer("READ", local, far, "prefill")
    decode.transfer(handle)
    wait_done(decode, handle)
    with pytest.raises(nb.nixlNoTelemetryError):
        decode.get_xfer_telemetry(handle)
    timed = nixl_agent("timed", nixl_agent_config(capture_telemetry=True))
    try:
        buf = bytearray(8192)
        timed.register_memory([buf])
        timed.add_remote_agent(prefill.get_agent_metadata())
        whole = timed.get_xfer_descs([(src.ctypes.data, 8192, 0)], "DRAM")
        h = timed.initialize_xfer("READ", timed.get_xfer_descs([buf]), whole, "prefill")
        timed.transfer(h)
        wait_done(timed, h)
        t = timed.get_xfer_telemetry(h)
        assert (t.totalBytes, t.descCount) == (8192, 1) and t.xferDuration >= t.postDuration >= 0
        assert bytes(buf) == src[:8192].tobytes()
    finally:
        timed.close()


NIXL_PROGRAM = '''
"""Written for NIXL: nothing here knows about ferry."""
import subprocess
import sys

import numpy as np

import nixl._utils as nixl_utils
from nixl._api import nixl_agent, nixl_agent_config
from nixl._bindings import nixlNotFoundError
from nixl.logging import get_logger

logger = get_logger(__name__)

target = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
initiator = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
size = 1 << 16
t_addr = nixl_utils.malloc_passthru(size)
i_addr = nixl_utils.malloc_passthru(size)
nixl_utils.ba_buf(i_addr, size)
t_reg = target.register_memory(target.get_reg_descs([(t_addr, size, 0, "t")], "DRAM"))
i_reg = initiator.register_memory(initiator.get_reg_descs([(i_addr, size, 0, "i")], "DRAM"))
name = initiator.add_remote_agent(target.get_agent_metadata())
target_descs = target.deserialize_descs(target.get_serialized_descs(t_reg.trim()))
handle = initiator.initialize_xfer("WRITE", i_reg.trim(), target_descs, name, b"UUID1")
state = initiator.transfer(handle)
assert state != "ERR"
while initiator.check_xfer_state(handle) != "DONE":
    pass
while not target.check_remote_xfer_done("initiator", b"UUID"):
    pass
nixl_utils.verify_transfer(t_addr, i_addr, size)
try:
    initiator.prep_xfer_dlist("ghost", [(t_addr, size, 0)], "DRAM")
    raise SystemExit("no error for an unknown agent")
except nixlNotFoundError:
    pass
initiator.release_xfer_handle(handle)
initiator.remove_remote_agent("target")
child = subprocess.run(
    [sys.executable, "-c", "import nixl, nixl._api; print(nixl.__name__, nixl._api.nixl_agent.__module__)"],
    capture_output=True, text=True, check=True,
)
print("child", child.stdout.strip())
print("args", sys.argv[1:])
print("OK", bytes(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 4).from_address(t_addr))).hex())
'''


def test_runner_runs_an_unmodified_nixl_program(tmp_path):
    script = tmp_path / "nixl_program.py"
    script.write_text(textwrap.dedent(NIXL_PROGRAM))
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "ferry.nixl", str(script), "--flag", "x"],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "child ferry.nixl ferry.nixl._agent" in lines
    assert "args ['--flag', 'x']" in lines
    assert "OK babababa" in lines

    (tmp_path / "nixl_module.py").write_text(textwrap.dedent(NIXL_PROGRAM))
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "ferry.nixl", "-m", "nixl_module", "y"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert "args ['y']" in run.stdout.splitlines()


def test_without_the_runner_nixl_is_not_ferry(tmp_path):
    """ferry installs nothing under the name `nixl`: a real NIXL stays what `import nixl` finds."""
    probe = "import importlib.util as u; s = u.find_spec('nixl'); print(s.origin if s else None)"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, check=True)
    origin = run.stdout.strip()
    assert origin == "None" or "ferry" not in origin
    assert importlib.util.find_spec("nixl") is None or "ferry" not in str(importlib.util.find_spec("nixl").origin)
    run = subprocess.run([sys.executable, "-m", "ferry.nixl"], capture_output=True, text=True)
    assert run.returncode == 2 and "usage" in run.stderr


def read_blocks(agent, remote_name, addrs, size):
    """READs the blocks at ``addrs`` of agent ``remote_name`` into fresh memory and returns them."""
    got = np.zeros((len(addrs), size), dtype=np.uint8)
    reg = agent.register_memory(agent.get_reg_descs([(got.ctypes.data, got.nbytes, 0, "")], "DRAM"))
    local = agent.get_xfer_descs(block_list(got.ctypes.data, len(addrs), size), "DRAM")
    far = agent.get_xfer_descs([(a, size, 0) for a in addrs], "DRAM")
    handle = agent.initialize_xfer("READ", local, far, remote_name)
    agent.transfer(handle)
    wait_done(agent, handle, timeout=30.0)
    agent.release_xfer_handle(handle)
    agent.deregister_memory(reg)
    return got


def test_partial_metadata_adds_ranges_as_nixl_does():
    """NIXL's partial metadata: the connection info alone, then ranges without it, then more
    ranges; each load adds to what the loader knows, and only what was loaded can be read."""
    src = nixl_agent("src", nixl_agent_config(enable_listen_thread=True, listen_port=0))
    dst = nixl_agent("dst", nixl_agent_config(enable_listen_thread=True, listen_port=0))
    other = nixl_agent("other")
    try:
        bufs = [pattern(4096, seed=20 + i) for i in range(4)]
        src.register_memory(src.get_reg_descs(bufs))
        addrs = [b.ctypes.data for b in bufs]
        valid = src.get_reg_descs([(a, 4096, 0, "") for a in addrs[:3]], "DRAM")
        last = src.get_reg_descs([(addrs[3], 4096, 0, "")], "DRAM")
        far_valid = dst.get_xfer_descs([(a, 4096, 0) for a in addrs[:3]], "DRAM")
        far_last = dst.get_xfer_descs([(addrs[3], 4096, 0)], "DRAM")

        # Without connection info, an agent not loaded cannot be loaded.
        with pytest.raises(nb.nixlNotFoundError, match="connection info"):
            dst.add_remote_agent(src.get_partial_agent_metadata(valid))
        assert not dst.check_remote_metadata("src")

        # Step 1: the connection info alone (an empty list), as NIXL's getLocalPartialMD({DRAM_SEG}).
        assert dst.add_remote_agent(src.get_partial_agent_metadata(src.get_reg_descs([], "DRAM"))) == b"src"
        assert dst.check_remote_metadata("src") and not dst.check_remote_metadata("src", far_valid)
        with pytest.raises(nb.nixlNotFoundError):
            dst.prep_xfer_dlist("src", far_valid, "DRAM")

        # Step 2: three of the four buffers, without connection info: those three and no more.
        assert dst.add_remote_agent(src.get_partial_agent_metadata(valid)) == b"src"
        assert dst.check_remote_metadata("src", far_valid) and not dst.check_remote_metadata("src", far_last)
        got = read_blocks(dst, "src", addrs[:3], 4096)
        assert all(np.array_equal(got[i], bufs[i]) for i in range(3)), "a byte read differs"
        with pytest.raises(nb.nixlNotFoundError):
            dst.prep_xfer_dlist("src", far_last, "DRAM")

        # Step 3: forgotten, then loaded again with connection info included.
        dst.remove_remote_agent("src")
        assert not dst.check_remote_metadata("src")
        dst.add_remote_agent(src.get_partial_agent_metadata(valid, inc_conn_info=True))
        assert dst.check_remote_metadata("src", far_valid) and not dst.check_remote_metadata("src", far_last)

        # Step 4: the last buffer added; now all four read back.
        dst.add_remote_agent(src.get_partial_agent_metadata(last))
        assert dst.check_remote_metadata("src", far_valid) and dst.check_remote_metadata("src", far_last)
        got = read_blocks(dst, "src", addrs, 4096)
        assert all(np.array_equal(got[i], bufs[i]) for i in range(4)), "a byte read differs"

        # Memory not registered with the agent has no metadata.
        unregistered = np.zeros(4096, dtype=np.uint8)
        with pytest.raises(nb.nixlNotFoundError):
            src.get_partial_agent_metadata(src.get_reg_descs([unregistered]))
        # Partial metadata of another engine under a loaded name is refused, as whole metadata is.
        impostor = nixl_agent("src")
        try:
            with pytest.raises(nb.nixlNotAllowedError):
                dst.add_remote_agent(impostor.get_partial_agent_metadata(impostor.get_reg_descs([], "DRAM")))
        finally:
            impostor.close()

        # Sent to a listener (NIXL's sendLocalPartialMD to ip:port): loaded there the same way.
        other_port = int(other.get_backend_params("UCX")["listen_addr"].rpartition(":")[2])
        dst_port = int(dst.get_backend_params("UCX")["listen_addr"].rpartition(":")[2])
        assert other_port != dst_port
        dst.remove_remote_agent("src")
        src.send_partial_agent_metadata(src.get_reg_descs([], "DRAM"), ip_addr="127.0.0.1", port=dst_port)
        wait_for(lambda: dst.check_remote_metadata("src"), "src's connection info to arrive")
        src.send_partial_agent_metadata(valid, ip_addr="127.0.0.1", port=dst_port)
        wait_for(lambda: dst.check_remote_metadata("src", far_valid), "src's partial metadata to arrive")
        assert not dst.check_remote_metadata("src", far_last)

        # Without ip_addr and without NIXL_ETCD_ENDPOINTS there is no metadata server.
        with pytest.raises(nb.nixlNotSupportedError, match="NIXL_ETCD_ENDPOINTS"):
            src.send_partial_agent_metadata(valid, label="x")
    finally:
        for a in (src, dst, other):
            a.close()


def test_etcd_metadata_server_across_processes(prefill, etcd, monkeypatch):
    """NIXL's metadata server (NIXL_ETCD_ENDPOINTS) through ferry's etcd directory, as NIXL's etcd
    tests use it: the prefill process publishes its whole metadata, its connection info alone
    ("conn_info") and half its blocks without connection info ("first_half"); this agent fetches
    each by name, reads every byte back, and loses it all when prefill invalidates."""
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", etcd)
    monkeypatch.setenv("NIXL_ETCD_NAMESPACE", "/nixl/test")
    remote = prefill(NIXL_PEER_PUBLISH="1")
    size, n = remote.block_size, len(remote.blocks)
    expected = pattern(size * n, seed=7).reshape(n, -1)
    agent = nixl_agent("decode", nixl_agent_config(backends=["UCX"]))

    def fetched(label=""):
        """Fetches prefill's metadata under ``label`` and waits until the answer was handled."""
        agent.fetch_remote_metadata("prefill", label=label)
        wait_for(lambda: "prefill" not in agent._fetching, f"prefill's answer to a fetch of {label!r}")

    try:
        first = agent.get_xfer_descs([(a, size, 0) for a in remote.blocks[: n // 2]], "DRAM")
        second = agent.get_xfer_descs([(a, size, 0) for a in remote.blocks[n // 2 :]], "DRAM")

        # Ranges without connection info, of an agent not loaded: nothing loads.
        fetched("first_half")
        assert not agent.check_remote_metadata("prefill")
        fetched("conn_info")
        assert agent.check_remote_metadata("prefill") and not agent.check_remote_metadata("prefill", first)
        fetched("first_half")
        assert agent.check_remote_metadata("prefill", first) and not agent.check_remote_metadata("prefill", second)
        got = read_blocks(agent, "prefill", remote.blocks[: n // 2], size)
        assert np.array_equal(got, expected[: n // 2]), "a byte read differs from the remote pattern"
        fetched()
        assert agent.check_remote_metadata("prefill", second)
        read_all_blocks(agent, remote, expected)

        # A label prefill never published loads nothing; an agent that does not exist does not block.
        agent.remove_remote_agent("prefill")
        fetched("no_such_label")
        assert not agent.check_remote_metadata("prefill")
        started = time.monotonic()
        agent.fetch_remote_metadata("nobody")
        assert time.monotonic() - started < 1.0
        fetched()
        assert agent.check_remote_metadata("prefill")

        # The agent's name is held in the directory while it lives.
        with pytest.raises(nb.nixlBackendError):
            nixl_agent("decode")
        # What NIXL refuses on the metadata server.
        with pytest.raises(nb.nixlInvalidParamError, match="label"):
            agent.send_partial_agent_metadata(agent.get_reg_descs([], "DRAM"))

        # prefill withdraws everything: this agent forgets it, and fetches find nothing.
        agent.send_notif("prefill", b"invalidate")
        assert remote.read_line() == {"invalidated": True}
        wait_for(lambda: not agent.check_remote_metadata("prefill"), "prefill's invalidation")
        fetched()
        assert not agent.check_remote_metadata("prefill")
    finally:
        agent.close()
