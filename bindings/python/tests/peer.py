"""The other process of the two-process tests: an engine that registers a buffer filled with a
known pattern, says where it is on stdout (one JSON line), and answers notifications.

Notification "digest": prints {"name", "msg", "sha256"} of its buffer as it is now.
Notification "exit": exits.
"""

import asyncio
import hashlib
import json
import os
import sys

import numpy as np

import ferry


def pattern(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8)


async def main() -> None:
    length = int(os.environ.get("PEER_LENGTH", 1 << 20))
    transports = os.environ.get("PEER_TRANSPORTS")
    engine = ferry.Engine(
        "127.0.0.1:0", transports=transports.split(",") if transports else None
    )
    buf = pattern(length, seed=7)
    region = engine.register(buf)
    print(json.dumps({"addr": engine.local_addr, "region": region.addr, "length": length}), flush=True)
    async for n in engine.notifications():
        if n.name == "digest":
            digest = hashlib.sha256(buf.tobytes()).hexdigest()
            print(json.dumps({"name": n.name, "msg": n.msg, "sha256": digest}), flush=True)
        elif n.name == "exit":
            break
    engine.close()


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
