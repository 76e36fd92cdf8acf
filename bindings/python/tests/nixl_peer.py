"""The "prefill" process of the NIXL two-process tests, written against NIXL's API as vLLM's
connector uses it: an agent that registers block-sized descriptors filled with a known pattern and
publishes its metadata and block addresses on stdout (one JSON line), then reports every
notification it gets, with the digest of its blocks at that moment.

Each notification prints {"from", "msg" (hex), "sha256"}; the notification b"exit" ends it.
"""

import base64
import hashlib
import json
import os
import sys
import time

import numpy as np

from ferry.nixl import nixl_agent, nixl_agent_config

BLOCK = int(os.environ.get("NIXL_PEER_BLOCK", 4096))
BLOCKS = int(os.environ.get("NIXL_PEER_BLOCKS", 64))


def pattern(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8)


def main() -> None:
    transports = os.environ.get("NIXL_PEER_TRANSPORTS")
    agent = nixl_agent(
        "prefill",
        nixl_agent_config(backends=["UCX"], transports=transports.split(",") if transports else None),
    )
    kv = pattern(BLOCK * BLOCKS, seed=7)
    base = kv.ctypes.data
    descs = agent.get_reg_descs([(base, kv.nbytes, 0, "kv")], "DRAM")
    agent.register_memory(descs, backends=["UCX"])
    hello = {
        "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
        "blocks": [base + i * BLOCK for i in range(BLOCKS)],
        "block_size": BLOCK,
    }
    print(json.dumps(hello), flush=True)
    while True:
        for sender, msgs in agent.get_new_notifs().items():
            for msg in msgs:
                if msg == b"exit":
                    agent.deregister_memory(descs)
                    return
                digest = hashlib.sha256(kv.tobytes()).hexdigest()
                print(json.dumps({"from": sender, "msg": msg.hex(), "sha256": digest}), flush=True)
        time.sleep(0.001)


if __name__ == "__main__":
    main()
    sys.exit(0)
