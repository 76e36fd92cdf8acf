"""The "prefill" process of the NIXL two-process tests, written against NIXL's API as vLLM's
connector uses it: an agent that registers block-sized descriptors filled with a known pattern and
publishes its metadata and block addresses on stdout (one JSON line), then reports every
notification it gets, with the digest of its blocks at that moment.

Each notification prints {"from", "msg" (hex), "sha256"}; the notification b"exit" ends it.

With NIXL_PEER_MEMORY=torch the blocks are a PyTorch CPU tensor, registered by its ``data_ptr()``
as vLLM's connector registers its caches; by default a numpy array.

With NIXL_PEER_LISTEN_PORT the agent listens for NIXL's metadata exchange on that port
(``enable_listen_thread``), so that another agent can ``fetch_remote_metadata`` it. With
NIXL_PEER_SEND_TO=ip:port it pushes its metadata there (``send_local_metadata``) once its memory
is registered, and the notification b"invalidate" makes it ``invalidate_local_metadata`` there
(printing {"invalidated": true}).

With NIXL_PEER_PUBLISH (and NIXL_ETCD_ENDPOINTS) it publishes on the metadata server: its whole
metadata (``send_local_metadata()``), its connection info alone under the label "conn_info", and
the first half of its blocks, without connection info, under "first_half"; the notification
b"invalidate" then withdraws all of it (``invalidate_local_metadata()``).
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
    listen_port = os.environ.get("NIXL_PEER_LISTEN_PORT")
    send_to = os.environ.get("NIXL_PEER_SEND_TO")
    publish = bool(os.environ.get("NIXL_PEER_PUBLISH"))
    agent = nixl_agent(
        "prefill",
        nixl_agent_config(
            backends=["UCX"],
            transports=transports.split(",") if transports else None,
            enable_listen_thread=listen_port is not None,
            listen_port=int(listen_port or 0),
        ),
    )
    kv = pattern(BLOCK * BLOCKS, seed=7)
    if os.environ.get("NIXL_PEER_MEMORY") == "torch":
        import torch

        # A tensor with storage of its own (not a view of the array), as a model's KV cache is.
        tensor = torch.tensor(kv)
        base, length = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        kv = tensor.numpy()  # the tensor's own bytes, for the digests below
        assert kv.ctypes.data == base
    else:
        base, length = kv.ctypes.data, kv.nbytes
    descs = agent.get_reg_descs([(base, length, 0, "kv")], "DRAM")
    agent.register_memory(descs, backends=["UCX"])
    hello = {
        "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
        "blocks": [base + i * BLOCK for i in range(BLOCKS)],
        "block_size": BLOCK,
    }
    if publish:
        agent.send_local_metadata()
        agent.send_partial_agent_metadata(agent.get_reg_descs([], "DRAM"), label="conn_info")
        half = agent.get_reg_descs([(base, BLOCK * (BLOCKS // 2), 0, "")], "DRAM")
        agent.send_partial_agent_metadata(half, inc_conn_info=False, label="first_half")
    print(json.dumps(hello), flush=True)
    if send_to:
        ip, _, port = send_to.rpartition(":")
        agent.send_local_metadata(ip, int(port))
    while True:
        for sender, msgs in agent.get_new_notifs().items():
            for msg in msgs:
                if msg == b"exit":
                    agent.deregister_memory(descs)
                    return
                if msg == b"invalidate" and (send_to or publish):
                    if publish:
                        agent.invalidate_local_metadata()
                    else:
                        ip, _, port = send_to.rpartition(":")
                        agent.invalidate_local_metadata(ip, int(port))
                    print(json.dumps({"invalidated": True}), flush=True)
                    continue
                digest = hashlib.sha256(kv.tobytes()).hexdigest()
                print(json.dumps({"from": sender, "msg": msg.hex(), "sha256": digest}), flush=True)
        time.sleep(0.001)


if __name__ == "__main__":
    main()
    sys.exit(0)
