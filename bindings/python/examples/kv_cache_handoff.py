"""KV-cache hand-off between two Python processes, as disaggregated inference does it.

A *prefill* process computes the KV cache of a prompt and writes its blocks straight into the
paged KV cache of a *decode* process, into the free slots the decode side's block table gives it,
then sends a notification naming the request. The decode process, woken by the notification,
finds every block already in place (a notification is never seen before the data of transfers that
completed before it was sent) and checks each one.

    python examples/kv_cache_handoff.py            # runs decode in a child process, prefill here

The decode process prints its address and the slots it offers on stdout; a real deployment would
publish them in a directory (ferry's etcd directory) instead.
"""

import asyncio
import json
import subprocess
import sys

import numpy as np

import ferry

LAYERS, BLOCKS_PER_LAYER, BLOCK_BYTES = 4, 64, 16 * 1024
CACHE_SLOTS = LAYERS * BLOCKS_PER_LAYER * 2  # room for two requests


def block_contents(request: str, n: int) -> np.ndarray:
    """What prefill computes for `request`: n blocks, reproducible on the decode side."""
    seed = sum(request.encode())
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK_BYTES), dtype=np.uint8)


async def decode() -> None:
    with ferry.Engine("127.0.0.1:0") as engine:
        cache = np.zeros((CACHE_SLOTS, BLOCK_BYTES), dtype=np.uint8)  # the paged KV cache
        region = engine.register(cache, access=ferry.WRITE)
        # The block table: this request's blocks go to scattered free slots.
        slots = np.random.default_rng(42).permutation(CACHE_SLOTS)[: LAYERS * BLOCKS_PER_LAYER]
        offer = {"addr": engine.local_addr, "cache": region.addr, "slots": slots.tolist()}
        print(json.dumps(offer), flush=True)
        async for note in engine.notifications():
            if note.name != "kv-ready":
                continue
            request = json.loads(note.msg)["request"]
            expected = block_contents(request, len(slots))
            good = int(sum(np.array_equal(cache[s], expected[i]) for i, s in enumerate(slots)))
            print(json.dumps({"request": request, "blocks": len(slots), "good": good}), flush=True)
            break


async def prefill(offer: dict, request: str) -> None:
    slots = np.array(offer["slots"], dtype=np.uint64)
    kv = block_contents(request, len(slots))  # "computed" here
    with ferry.Engine() as engine:
        local = engine.register(kv, access=ferry.READ)
        peer = await engine.connect(offer["addr"], timeout=5.0)
        descs = np.empty((len(slots), 3), dtype=np.uint64)
        descs[:, 0] = np.uint64(local.addr) + np.arange(len(slots), dtype=np.uint64) * np.uint64(BLOCK_BYTES)
        descs[:, 1] = np.uint64(offer["cache"]) + slots * np.uint64(BLOCK_BYTES)
        descs[:, 2] = BLOCK_BYTES
        # One batch per layer, all in flight at once, as layers finish.
        per_layer = np.split(descs, LAYERS)
        await asyncio.gather(*(engine.transfer(peer, "write", d, timeout=10.0) for d in per_layer))
        await engine.notify(peer, "kv-ready", json.dumps({"request": request}), timeout=5.0)
        print(f"prefill: {len(slots)} blocks of {BLOCK_BYTES} bytes over {peer.transport}", flush=True)


def main() -> int:
    if sys.argv[1:] == ["--role", "decode"]:
        asyncio.run(decode())
        return 0
    child = subprocess.Popen([sys.executable, __file__, "--role", "decode"], stdout=subprocess.PIPE, text=True)
    try:
        offer = json.loads(child.stdout.readline())
        asyncio.run(prefill(offer, request="req-1"))
        verdict = json.loads(child.stdout.readline())
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    print(f"decode: {verdict['good']} of {verdict['blocks']} blocks intact for {verdict['request']}")
    return 0 if verdict["good"] == verdict["blocks"] else 1


if __name__ == "__main__":
    sys.exit(main())
