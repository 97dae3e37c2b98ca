"""The native core's own figures, in the same Ray actors (issue 33): what raycoll-bench's
tables do not show.

- **CPU per call**: a rank's CPU time (``time.thread_time``) for one small all_reduce, next to
  its wall time, on the node segment (``transport="auto"``) and on direct connections
  (``transport="tcp"``), against gloo's in the same kind of actors;
- **the memory floor**: the 64 MiB all_reduce of 2 ranks on one node against the time both
  ranks take to copy their buffer once, at the same time, in the same actors (the least any
  all_reduce that writes its result must spend: every byte read once and written once);
- **the layers**: where a rank's 4 B all_reduce goes: the public function, the native call
  alone (the segment's ``run`` with a cached plan), and the plain numpy work of a memcpy.

Usage: ``python benchmarks/native_core.py [--iters 2000] [--sizes 4,64K,1M,64M]``. Prints a
table; medians over iterations of the slowest rank (as raycoll-bench reports them).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import ray

import raycoll
from raycoll.bench.peers import GlooPeer
from raycoll.testing import RankPool


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _label(n: int) -> str:
    for unit, k in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k}{unit}"
    return str(n)


def _time_all_reduce(rank: int, nbytes: int, iters: int, warmup: int) -> Dict[str, Any]:
    """In a rank: wall and CPU time of each all_reduce, and of a memcpy of the buffer."""
    x = np.zeros(max(1, nbytes // 4), dtype=np.float32)
    for _ in range(warmup):
        raycoll.all_reduce(x)
    raycoll.barrier()
    wall, cpu = [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.thread_time()
        raycoll.all_reduce(x)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    copy = []
    if nbytes >= 1 << 20:
        y = np.empty_like(x)
        raycoll.barrier()
        for _ in range(max(5, iters // 4)):
            t0 = time.perf_counter()
            np.copyto(y, x)
            copy.append(time.perf_counter() - t0)
    return {"wall": wall, "cpu": cpu, "copy": copy}


def _layers(rank: int, iters: int) -> Dict[str, float]:
    """In a rank: the public all_reduce of 4 B against the native call alone."""
    from raycoll.algorithms import segment_plans as plans
    from raycoll.native import DTYPE_CODES, OP_CODES
    from raycoll.world import world

    x = np.ones(1, np.float32)
    raycoll.all_reduce(x)
    lane = world().default.context._plane
    out: Dict[str, float] = {}
    raycoll.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        raycoll.all_reduce(x)
    out["raycoll.all_reduce"] = (time.perf_counter() - t0) / iters
    if getattr(lane, "is_segment", False):
        plan = plans.all_reduce(1, 4, lane.ctx.size, rank, lane.step_bytes, lane.one_step_bytes)
        policy = lane._policy
        raycoll.barrier()
        t0 = time.perf_counter()
        for i in range(iters):
            lane.seg.run(plan.ops, (x,), DTYPE_CODES["float32"], OP_CODES["SUM"], 1.0, 0,
                         1 << 40, b"bench", policy, None)
        out["segment run alone"] = (time.perf_counter() - t0) / iters
    return out


def _slowest_median(per_rank: List[List[float]]) -> float:
    return statistics.median(max(column) for column in zip(*per_rank)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--sizes", default="4,64K,1M,64M")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    sizes = [_size(s) for s in args.sizes.split(",")]
    world = args.world_size
    ray.init(address="local", num_cpus=max(4, world), include_dashboard=False,
             log_to_driver=False)
    rows: List[Tuple[str, ...]] = []
    with RankPool(max_world_size=world) as pool, GlooPeer() as gloo:
        gloo.setup(world, {"num_cpus": 0})
        for nbytes in sizes:
            iters = max(10, args.iters if nbytes <= 1 << 16 else args.iters // 40)
            warmup = max(3, iters // 10)
            for transport in ("auto", "tcp"):
                got = pool.run(_time_all_reduce, world, nbytes, iters, warmup,
                               options={"transport": transport}, timeout=600)
                wall = _slowest_median([g["wall"] for g in got])
                cpu = statistics.median(statistics.median(g["cpu"]) for g in got) * 1e6
                floor = (_slowest_median([g["copy"] for g in got]) if got[0]["copy"] else None)
                peer = statistics.median(gloo.run("all_reduce", nbytes, "float32", iters,
                                                  warmup)) * 1e6
                rows.append((_label(nbytes), "segment" if transport == "auto" else "sockets",
                             f"{wall:.1f}", f"{cpu:.1f}", f"{peer:.1f}", f"{peer / wall:.2f}",
                             f"{floor:.0f}" if floor else "-",
                             f"{wall / floor:.2f}" if floor else "-"))
        layers = pool.run(_layers, world, args.iters, timeout=600)
    print(f"# native_core: {world} ranks on one node, all_reduce float32; medians of the "
          f"slowest rank; gloo in the same kind of actors, same run")
    print(f"{'size':>6} {'path':>8} {'time us':>9} {'cpu us':>8} {'gloo us':>9} "
          f"{'x gloo':>7} {'memcpy us':>10} {'x memcpy':>9}")
    for row in rows:
        print(f"{row[0]:>6} {row[1]:>8} {row[2]:>9} {row[3]:>8} {row[4]:>9} {row[5]:>7} "
              f"{row[6]:>10} {row[7]:>9}")
    print("# a 4 B all_reduce, layer by layer (us, rank 0):")
    for name, seconds in layers[0].items():
        print(f"#   {name}: {seconds * 1e6:.2f}")


if __name__ == "__main__":
    main()
