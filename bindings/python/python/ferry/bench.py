"""``python -m ferry.bench``: ferry from Python beside ``ferry bench`` in Rust, in the same run.

Each case runs two engines in this process over TCP on 127.0.0.1, as ``ferry bench`` does without
``--peer``, keeps ``depth`` batches in flight for ``duration`` seconds after a warm-up of a tenth of
it, and reports GB/s (10^9 bytes per second) and the p50 latency of one batch. With the Rust
``ferry`` binary at hand (``--rust PATH``, or ``ferry`` on ``PATH``), it runs the same case in Rust
right before each Python round and prints Python/Rust ratios.

The cases are the ones the binding promises figures for: 1 MiB writes (bulk), batches of 256 × 4 KiB
writes (KV-cache blocks), and the round trip of one 64-byte write, awaited (``await
engine.transfer``) and from a plain thread (``engine.transfer_blocking``). The ``nixl-`` cases run
the same kind of load through ``ferry.nixl``, NIXL's synchronous API, as a program written for NIXL
drives it: ``depth`` transfer handles posted with ``transfer`` and polled with ``check_xfer_state``
(1 MiB writes made by ``initialize_xfer``; 256 × 64 KiB blocks picked by index from lists prepared
once, ``make_prepped_xfer``).

With ``--peer ADDR`` a case runs between two processes, as users deploy it: this process's engine
writes into the first region of a ``ferry serve`` listening at ADDR (``ferry bench --peer ADDR``
is the same case from Rust).
"""

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

import numpy as np

import ferry

# name: (size, batch, depth, TCP streams), each as `ferry bench` runs it by default, except that the
# latency case uses one stream as `cargo xtask bench` does.
CASES = {
    "write-1mib": (1 << 20, 1, 8, 2),
    "write-4kib-x256": (4 << 10, 256, 8, 2),
    "write-64b-p50": (64, 1, 1, 1),
}

# The same shape, through ferry.nixl; name: (size, batch, depth, TCP streams).
NIXL_CASES = {
    "nixl-write-1mib": (1 << 20, 1, 8, 2),
    "nixl-kv-64kib-x256": (64 << 10, 256, 8, 2),
}


def _pair(size: int, batch: int, streams: int, buffer_pool: str):
    target = ferry.Engine("127.0.0.1:0", transports=["tcp"], buffer_pool=buffer_pool, streams=streams)
    initiator = ferry.Engine(transports=["tcp"], buffer_pool=buffer_pool, streams=streams)
    src = np.random.default_rng(1).integers(0, 255, size * batch, dtype=np.uint8)
    dst = np.zeros(size * batch, dtype=np.uint8)
    local = initiator.register(src)
    remote = target.register(dst)
    return target, initiator, _descs(local.addr, remote.addr, size, batch)


def _descs(local: int, remote: int, size: int, batch: int) -> np.ndarray:
    descs = np.empty((batch, 3), dtype=np.uint64)
    offsets = np.arange(batch, dtype=np.uint64) * np.uint64(size)
    descs[:, 0] = np.uint64(local) + offsets
    descs[:, 1] = np.uint64(remote) + offsets
    descs[:, 2] = size
    return descs


async def _link(initiator, target, to: Optional[str], size: int, batch: int, local: int, descs):
    """The peer and the batch's descriptors: the in-process `target` and `descs` into it, or, when
    `to` names a `ferry serve`, that engine and descriptors into its first region."""
    if to is None:
        return await initiator.connect(target.local_addr, timeout=5.0), descs
    peer = await initiator.connect(to, timeout=5.0)
    regions = peer.regions()
    if not regions or regions[0].length < size * batch:
        raise SystemExit(f"{to} offers no region of {size * batch} bytes (start it with ferry serve)")
    return peer, _descs(local, regions[0].addr, size, batch)


def _ends(size: int, batch: int, streams: int, buffer_pool: str, to: Optional[str]):
    """The in-process target (nothing to hold when `to` names one elsewhere), the initiator, the
    local region's address, and the descriptors into the in-process target (None for a peer's)."""
    if to is None:
        target, initiator, descs = _pair(size, batch, streams, buffer_pool)
        return target, initiator, int(descs[0, 0]), descs
    initiator = ferry.Engine(transports=["tcp"], buffer_pool=buffer_pool, streams=streams)
    src = np.random.default_rng(1).integers(0, 255, size * batch, dtype=np.uint8)
    local = initiator.register(src)
    return contextlib.nullcontext(), initiator, local.addr, None


async def _python_case(
    size: int, batch: int, depth: int, streams: int, duration: float, buffer_pool: str, to: Optional[str] = None
) -> Dict:
    target, initiator, local, descs = _ends(size, batch, streams, buffer_pool, to)
    with target, initiator:
        peer, descs = await _link(initiator, target, to, size, batch, local, descs)
        latencies: List[float] = []
        warmup = duration / 10
        begin = time.perf_counter()
        measure_from = begin + warmup
        end = measure_from + duration

        async def worker():
            while True:
                t0 = time.perf_counter()
                if t0 >= end:
                    return
                await initiator.transfer(peer, "write", descs, timeout=30.0)
                if t0 >= measure_from:
                    latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(depth)))
        elapsed = time.perf_counter() - measure_from
    return _result(size, batch, depth, latencies, elapsed)


def _blocking_case(size: int, streams: int, duration: float, buffer_pool: str, to: Optional[str] = None) -> Dict:
    target, initiator, local, descs = _ends(size, 1, streams, buffer_pool, to)
    with target, initiator:
        peer, descs = asyncio.run(_link(initiator, target, to, size, 1, local, descs))
        latencies: List[float] = []
        begin = time.perf_counter()
        measure_from = begin + duration / 10
        end = measure_from + duration
        while True:
            t0 = time.perf_counter()
            if t0 >= end:
                break
            initiator.transfer_blocking(peer, "write", descs, timeout=30.0)
            if t0 >= measure_from:
                latencies.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - measure_from
    return _result(size, 1, 1, latencies, elapsed)


_POLL_PAUSE = 50e-6
"""How long the nixl cases' polling loop sleeps after a pass found nothing done, as a program with
other work between polls would: a loop that never sleeps competes for a core with the engine's
threads, which on a small machine measures the polling rather than the transfers."""


def _nixl_case(size: int, batch: int, depth: int, streams: int, duration: float, buffer_pool: str) -> Dict:
    from ferry.nixl import nixl_agent, nixl_agent_config

    def config() -> "nixl_agent_config":
        return nixl_agent_config(
            backends=["UCX"], transports=["tcp"], engine_options={"buffer_pool": buffer_pool, "streams": streams}
        )

    target = nixl_agent("bench-target", config())
    initiator = nixl_agent("bench-initiator", config())
    try:
        src = np.random.default_rng(1).integers(0, 255, size * batch, dtype=np.uint8)
        dst = np.zeros(size * batch, dtype=np.uint8)
        initiator.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
        target.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
        name = initiator.add_remote_agent(target.get_agent_metadata())
        blocks = np.empty((batch, 3), dtype=np.uint64)
        blocks[:, 1] = size
        blocks[:, 2] = 0
        offsets = np.arange(batch, dtype=np.uint64) * np.uint64(size)
        blocks[:, 0] = np.uint64(src.ctypes.data) + offsets
        local_blocks = blocks.copy()
        blocks[:, 0] = np.uint64(dst.ctypes.data) + offsets
        remote_blocks = blocks.copy()
        if batch == 1:
            local = initiator.get_xfer_descs(local_blocks, "DRAM")
            remote = initiator.get_xfer_descs(remote_blocks, "DRAM")
            assert local is not None and remote is not None
            handles = [initiator.initialize_xfer("WRITE", local, remote, name) for _ in range(depth)]
        else:
            local_side = initiator.prep_xfer_dlist("NIXL_INIT_AGENT", local_blocks, "DRAM")
            remote_side = initiator.prep_xfer_dlist(name, remote_blocks, "DRAM")
            ids = np.arange(batch, dtype=np.int32)
            handles = [
                initiator.make_prepped_xfer("WRITE", local_side, ids, remote_side, ids) for _ in range(depth)
            ]
        latencies: List[float] = []
        begin = time.perf_counter()
        measure_from = begin + duration / 10
        end = measure_from + duration
        started = [0.0] * depth
        running = list(range(depth))
        for i in running:
            started[i] = time.perf_counter()
            initiator.transfer(handles[i])
        while running:
            still = []
            for i in running:
                if initiator.check_xfer_state(handles[i]) != "DONE":
                    still.append(i)
                    continue
                now = time.perf_counter()
                if started[i] >= measure_from:
                    latencies.append(now - started[i])
                if now < end:
                    started[i] = now
                    initiator.transfer(handles[i])
                    still.append(i)
            if len(still) == len(running) and still:
                time.sleep(_POLL_PAUSE)
            running = still
        elapsed = time.perf_counter() - measure_from
        for h in handles:
            initiator.release_xfer_handle(h)
    finally:
        initiator.close()
        target.close()
    return _result(size, batch, depth, latencies, elapsed)


def _result(size: int, batch: int, depth: int, latencies: List[float], elapsed: float) -> Dict:
    n = len(latencies)
    return {
        "size": size,
        "batch": batch,
        "depth": depth,
        "transfers": n,
        "gb_per_s": n * size * batch / elapsed / 1e9,
        "p50_us": statistics.median(latencies) * 1e6 if n else float("nan"),
    }


def _rust_case(
    ferry_bin: str, size: int, batch: int, depth: int, streams: int, duration: float, buffer_pool: str
) -> Dict:
    cmd = [
        ferry_bin, "bench", "--transport", "tcp", "--op", "write", "--size", str(size), "--batch",
        str(batch), "--depth", str(depth), "--streams", str(streams), "--duration", f"{duration}s",
        "--buffer-pool", buffer_pool, "--json",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ferry.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per case and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per case; the best of each side counts")
    parser.add_argument("--rust", help="the `ferry` binary to compare with (default: `ferry` on PATH)")
    parser.add_argument("--buffer-pool", default="4:8", help="coalescing pool, as `ferry bench --buffer-pool`")
    parser.add_argument("--json", action="store_true", help="one JSON object per case, instead of a table")
    parser.add_argument(
        "--case",
        choices=sorted(CASES) + sorted(NIXL_CASES),
        help="run only this case, once, from Python only, and print its JSON (what `cargo xtask bench` runs)",
    )
    parser.add_argument("--blocking", action="store_true", help="with --case: use transfer_blocking, not await")
    parser.add_argument(
        "--peer",
        metavar="ADDR",
        help="with --case: write into the first region of a `ferry serve` at ADDR (two processes), not an engine of this one",
    )
    args = parser.parse_args(argv)
    if args.peer and args.case not in CASES:
        parser.error("--peer applies to one asyncio case: give --case " + " | ".join(sorted(CASES)))

    if args.case in NIXL_CASES:
        if args.blocking:
            parser.error("--blocking applies to the asyncio cases; ferry.nixl is synchronous already")
        size, batch, depth, streams = NIXL_CASES[args.case]
        print(json.dumps(_nixl_case(size, batch, depth, streams, args.duration, args.buffer_pool)), flush=True)
        return 0
    if args.case:
        size, batch, depth, streams = CASES[args.case]
        if args.blocking:
            if depth != 1:
                parser.error("--blocking measures one transfer at a time: use it with write-64b-p50")
            result = _blocking_case(size, streams, args.duration, args.buffer_pool, args.peer)
        else:
            result = asyncio.run(
                _python_case(size, batch, depth, streams, args.duration, args.buffer_pool, args.peer)
            )
        print(json.dumps(result), flush=True)
        return 0

    ferry_bin = args.rust or shutil.which("ferry")
    for name, (size, batch, depth, streams) in [*CASES.items(), *NIXL_CASES.items()]:
        through_nixl = name in NIXL_CASES
        py_best: Optional[Dict] = None
        rust_best: Optional[Dict] = None
        blocking_best: Optional[Dict] = None
        latency_case = depth == 1
        for _ in range(args.rounds):
            if ferry_bin:
                r = _rust_case(ferry_bin, size, batch, depth, streams, args.duration, args.buffer_pool)
                rust_best = _better(rust_best, r, latency_case)
            if through_nixl:
                p = _nixl_case(size, batch, depth, streams, args.duration, args.buffer_pool)
            else:
                p = asyncio.run(_python_case(size, batch, depth, streams, args.duration, args.buffer_pool))
            py_best = _better(py_best, p, latency_case)
            if latency_case:
                b = _blocking_case(size, streams, args.duration, args.buffer_pool)
                blocking_best = _better(blocking_best, b, latency_case)
        row = {"case": name, "python": py_best, "rust": rust_best}
        if blocking_best:
            row["python_blocking"] = blocking_best
        if rust_best and py_best:
            if latency_case:
                row["python_over_rust_p50"] = py_best["p50_us"] / rust_best["p50_us"]
                if blocking_best:
                    row["python_blocking_over_rust_p50"] = blocking_best["p50_us"] / rust_best["p50_us"]
            else:
                row["python_over_rust_gbps"] = py_best["gb_per_s"] / rust_best["gb_per_s"]
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            _print_row(row)
    return 0


def _better(best: Optional[Dict], new: Dict, by_latency: bool) -> Dict:
    if best is None:
        return new
    if by_latency:
        return new if new["p50_us"] < best["p50_us"] else best
    return new if new["gb_per_s"] > best["gb_per_s"] else best


def _print_row(row: Dict) -> None:
    py, rust = row["python"], row.get("rust")
    line = f"{row['case']:<18} python {py['gb_per_s']:7.3f} GB/s p50 {py['p50_us']:9.1f} us"
    if rust:
        line += f" | rust {rust['gb_per_s']:7.3f} GB/s p50 {rust['p50_us']:9.1f} us"
    if "python_over_rust_gbps" in row:
        line += f" | python/rust {row['python_over_rust_gbps']:.2f}"
    if "python_blocking" in row:
        line += f" | blocking p50 {row['python_blocking']['p50_us']:.1f} us"
    if "python_over_rust_p50" in row:
        line += f" | p50 python/rust {row['python_over_rust_p50']:.2f}"
    if "python_blocking_over_rust_p50" in row:
        line += f", blocking/rust {row['python_blocking_over_rust_p50']:.2f}"
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
