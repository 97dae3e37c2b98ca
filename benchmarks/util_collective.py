"""The same ``ray.util.collective`` code through Ray's library (its torch gloo backend) and
through raycoll's drop-in (``raycoll.util.collective``), in the same run, row by row: 2 ranks
(zero-CPU actors) on one node, float32, each iteration timed alone on every rank, the slowest
rank's time, the median over ``--iters``. Also raycoll's own ``raycoll.all_reduce`` on the
drop-in's group, to show what the drop-in adds. ``ratio`` = Ray's time / the drop-in's.

    python benchmarks/util_collective.py --sizes 4,64K,1M,16M --iters 200 --warmup 20
"""

from __future__ import annotations

import argparse
import importlib
import os
import uuid
from typing import Any, List

import numpy as np
import ray

from raycoll.bench.peers import timed_calls

OPS = ("allreduce", "allgather", "broadcast", "reducescatter")


@ray.remote(num_cpus=0)
class Rank:
    """One rank: joins a group of ``lib`` and times its calls."""

    def setup(self, lib: str, rank: int, world_size: int, group: str) -> None:
        self.col = importlib.import_module(lib)
        self.rank, self.world_size, self.group = rank, world_size, group
        self.col.init_collective_group(world_size, rank, backend="gloo", group_name=group,
                                       gloo_timeout=600_000)

    def time(self, op: str, nbytes: int, iters: int, warmup: int) -> List[float]:
        col, group, n = self.col, self.group, max(1, nbytes // 4)
        x = np.ones(n, np.float32)
        parts = [np.zeros(n, np.float32) for _ in range(self.world_size)]
        if op == "allreduce":
            def step() -> None:
                col.allreduce(x, group)
        elif op == "raycoll.all_reduce":
            import raycoll

            def step() -> None:
                raycoll.all_reduce(x, group=group)
        elif op == "allgather":
            def step() -> None:
                col.allgather(parts, x, group)
        elif op == "broadcast":
            def step() -> None:
                col.broadcast(x, 0, group)
        else:  # reducescatter: each rank's buffer is one part; the input is world_size parts
            def step() -> None:
                col.reducescatter(x, parts, group)
        for _ in range(warmup):
            step()
        col.barrier(group)
        return timed_calls(step, iters)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _median_us(actors: List[Any], op: str, nbytes: int, iters: int, warmup: int) -> float:
    got = ray.get([a.time.remote(op, nbytes, iters, warmup) for a in actors], timeout=600)
    return float(np.median(np.max(np.array(got), axis=0)) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,64K,1M,16M", help="each rank's buffer, bytes")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    print(f"load average before: {os.getloadavg()[0]:.2f}; 2 ranks, one node, float32")
    groups = {}
    for lib in ("ray.util.collective", "raycoll.util.collective"):
        actors = [Rank.remote() for _ in range(2)]
        name = f"bench-{uuid.uuid4().hex[:8]}"
        ray.get([a.setup.remote(lib, r, 2, name) for r, a in enumerate(actors)], timeout=300)
        groups[lib] = actors
    print(f"{'op':<14}{'bytes':>10}{'ray (us)':>12}{'drop-in (us)':>14}{'ratio':>8}"
          f"{'raycoll API (us)':>18}")
    for op in OPS:
        for nbytes in (_size(s) for s in args.sizes.split(",")):
            iters = args.iters if nbytes < (1 << 20) else max(5, args.iters // 10)
            warmup = args.warmup if nbytes < (1 << 20) else max(2, args.warmup // 10)
            ray_us = _median_us(groups["ray.util.collective"], op, nbytes, iters, warmup)
            ours = _median_us(groups["raycoll.util.collective"], op, nbytes, iters, warmup)
            api = (f"{_median_us(groups['raycoll.util.collective'], 'raycoll.all_reduce', nbytes, iters, warmup):>18.1f}"
                   if op == "allreduce" else f"{'':>18}")
            print(f"{op:<14}{nbytes:>10}{ray_us:>12.1f}{ours:>14.1f}{ray_us / ours:>8.2f}{api}",
                  flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
