"""GPU all_reduce bandwidth: ``cuda:objstore`` with actors sharing one GPU, NCCL's one-rank
figure, and the host<->device copy rate that bounds the staged path.

Run by ``benchmarks/gpu_check.sh`` on the GPU machine; by hand::

    python benchmarks/gpu_bandwidth.py --mib 256 --iters 5 --json out.json

Prints one line per measurement (size, world size, median time, algbw, busbw as nccl-tests
define them: busbw = algbw * 2(W-1)/W for all_reduce) and writes them as JSON. The NCCL
one-rank figure needs no Ray (a one-rank communicator in this process); the staged figures
use Ray actors with ``num_gpus=1/W``. A failing part is reported and the others still run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from typing import Any, Dict, List

import numpy as np


def _row(kind: str, world_size: int, nbytes: int, times: List[float], check: bool) -> Dict[str, Any]:
    t = statistics.median(times)
    algbw = nbytes / t / 1e9
    busbw = algbw * (2 * (world_size - 1) / world_size if world_size > 1 else 1.0)
    row = {"kind": kind, "world_size": world_size, "bytes": nbytes, "median_s": t,
           "min_s": min(times), "algbw_GBps": algbw, "busbw_GBps": busbw, "correct": check,
           "iters": len(times)}
    print(f"{kind:<28} W={world_size} {nbytes / 2**20:8.0f} MiB  median {t * 1e3:9.2f} ms  "
          f"algbw {algbw:7.2f} GB/s  busbw {busbw:7.2f} GB/s  correct={check}", flush=True)
    return row


def nccl_one_rank(nbytes: int, iters: int) -> List[Dict[str, Any]]:
    """A real one-rank NCCL communicator in this process (no Ray)."""
    import cupy as cp

    from raycoll.backends.base import Call, GroupContext
    from raycoll.backends.nccl import NcclBackend
    from raycoll.reduce_op import ReduceOp

    ctx = GroupContext(group_name="bench", rank=0, global_ranks=[0], node_ids=["here"],
                       client=None, timeout_s=300.0, on_failure=lambda exc: None)  # type: ignore[arg-type]
    backend = NcclBackend(ctx)
    rows = []
    try:
        x = cp.ones(nbytes // 4, dtype=cp.float32)
        call = Call("all_reduce", 1, 300.0, {"reduce_op": ReduceOp.SUM.key})
        for name, op in (("nccl all_reduce SUM", ReduceOp.SUM),
                         ("nccl all_reduce PREMUL_SUM", ReduceOp.PREMUL_SUM(1.0))):
            backend.all_reduce(x, op, call).wait(timeout_s=300)  # warm-up, communicator
            times = []
            for _ in range(iters):
                cp.cuda.get_current_stream().synchronize()
                start = time.perf_counter()
                backend.all_reduce(x, op, call).wait(timeout_s=300)  # host waits for the event
                times.append(time.perf_counter() - start)
            rows.append(_row(name, 1, nbytes, times, bool((x == 1).all())))
        host = np.empty(nbytes // 4, dtype=np.float32)
        import cupyx

        pinned = cupyx.empty_pinned(nbytes // 4, dtype=np.float32)
        for name, out in (("copy D2H pageable", host), ("copy D2H pinned", pinned)):
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                x.get(out=out)
                times.append(time.perf_counter() - start)
            rows.append(_row(name, 1, nbytes, times, bool(out[0] == 1)))
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            x.set(pinned)
            cp.cuda.get_current_stream().synchronize()
            times.append(time.perf_counter() - start)
        rows.append(_row("copy H2D pinned", 1, nbytes, times, True))
    finally:
        backend.close()
    return rows


def _staged_rank(rank: int, nbytes: int, iters: int) -> List[float]:
    import cupy as cp

    import raycoll

    x = cp.full(nbytes // 4, rank + 1, dtype=cp.float32)
    raycoll.all_reduce(x)  # warm-up
    times = []
    for _ in range(iters):
        x.fill(rank + 1)
        raycoll.barrier()
        start = time.perf_counter()
        raycoll.all_reduce(x)
        times.append(time.perf_counter() - start)
    world = raycoll.get_world_size()
    if not bool((x == world * (world + 1) / 2).all()):
        raise AssertionError(f"rank {rank}: wrong all_reduce result {float(x[0])}")
    return times


def staged(nbytes: int, iters: int, world_sizes: List[int]) -> List[Dict[str, Any]]:
    """``cuda:objstore`` with ``W`` actors sharing the GPU."""
    import ray

    import raycoll

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=True)
    rows = []
    for world in world_sizes:
        per_rank = raycoll.spawn(_staged_rank, world_size=world, args=(nbytes, iters),
                                 backend="cpu:objstore,cuda:objstore",
                                 actor_options={"num_gpus": 1.0 / world, "num_cpus": 0},
                                 timeout=600)
        times = [max(ts[i] for ts in per_rank) for i in range(iters)]  # the slowest rank
        rows.append(_row("cuda:objstore all_reduce", world, nbytes, times, True))
    return rows


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="message size in MiB")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    nbytes = args.mib * 2**20
    rows: List[Dict[str, Any]] = []
    failed = False
    for part, run in (("nccl one rank", lambda: nccl_one_rank(nbytes, args.iters)),
                      ("cuda:objstore", lambda: staged(nbytes, args.iters, args.world_sizes))):
        try:
            rows.extend(run())
        except Exception:  # noqa: BLE001 - report and go on with the other part
            failed = True
            print(f"{part}: FAILED", flush=True)
            traceback.print_exc()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
