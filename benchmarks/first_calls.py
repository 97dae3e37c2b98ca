"""A fresh group's first calls, one by one: 2 ranks on one node (the shared-memory lane),
``--calls`` all_reduces timed per call on each of ``--groups`` fresh groups, printed as the
first five calls and the medians of calls 5-20, 20-40, 40-100 and the rest, with how often
each rank's lane spin ran out and where its spin back-off stands.

    python benchmarks/first_calls.py --groups 3 --sizes 4,65536
"""

from __future__ import annotations

import argparse
import time
from typing import Any, List, Tuple

import numpy as np
import ray

from raycoll.testing import RankPool


def _calls(rank: int, calls: int, nbytes: int) -> Tuple[List[float], Any]:
    import raycoll
    from raycoll.world import world

    x = np.ones(max(1, nbytes // 4), np.float32)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        raycoll.all_reduce(x)
        x[:] = 1.0
        times.append(time.perf_counter() - start)
    group = world().default
    lane = group.context._plane  # the lane's spin counters (diagnostics, not public)
    return times, (group.transport_name, getattr(lane, "spins_failed", None),
                   getattr(lane, "_resume_at", None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--sizes", default="4,65536", help="bytes")
    args = parser.parse_args()
    ray.init(num_cpus=4)
    with RankPool(max_world_size=2) as pool:
        for g in range(args.groups):
            for nbytes in (int(s) for s in args.sizes.split(",")):
                got = pool.run(_calls, 2, args.calls, nbytes)
                us = np.max([np.array(t) for t, _ in got], axis=0) * 1e6
                spans = [(5, 20), (20, 40), (40, 100), (100, args.calls)]
                medians = ", ".join(f"{a}-{b}: {np.median(us[a:b]):.0f}" for a, b in spans)
                print(f"group {g} {nbytes} B on {got[0][1][0]}: first five "
                      f"{[round(float(u)) for u in us[:5]]} us; medians {medians} us; "
                      f"spins run out / back-off until call: "
                      f"{[(i[1], i[2]) for _, i in got]}")
    ray.shutdown()


if __name__ == "__main__":
    main()
