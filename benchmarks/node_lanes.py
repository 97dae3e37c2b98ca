"""Node lanes on and off, in the same run: the steps of an all_reduce between ranks of one
node over the node's shared-memory lane (group option ``node_lanes=True``) or over Unix
sockets (``node_lanes=False``), on Ray nodes from ``ray.cluster_utils.Cluster`` on this
machine. Each row is the slowest rank's median time (a barrier before every call), the two
settings interleaved, each measured ``--reps`` times; the ratio is off / on (above 1 the lane
wins).

    python benchmarks/node_lanes.py --ranks-per-node 2,2 --algos auto,hierarchical
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import ray
from ray.cluster_utils import Cluster

from raycoll.launch import RankWorker, run_on


def _bench(rank: int, sizes: List[int], iters: int) -> Dict[int, Tuple[float, Any, List[int]]]:
    import raycoll
    from raycoll.world import world

    group = world().default
    out = {}
    for nbytes in sizes:
        x = np.ones(max(1, nbytes // 4), np.float32)
        runs = iters if nbytes < (8 << 20) else max(3, iters // 4)
        times = []
        for _ in range(runs + 2):  # two warm-ups
            raycoll.barrier()
            start = time.perf_counter()
            raycoll.all_reduce(x)
            times.append(time.perf_counter() - start)
        out[nbytes] = (statistics.median(times[2:]) * 1e6, group.last_route.algorithm,
                       group.counters()["node_lane"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks-per-node", default="2,2")
    parser.add_argument("--algos", default="auto,hierarchical",
                        help="all_reduce_algo values; auto: the cost model's choice")
    parser.add_argument("--sizes", default="4,1048576,67108864", help="bytes")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    per_node = [int(k) for k in args.ranks_per_node.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node0": 64}, "object_store_memory": 1500 << 20})
    for m in range(1, len(per_node)):
        cluster.add_node(num_cpus=2, resources={f"node{m}": 64},
                         object_store_memory=1500 << 20)
    ray.init(address=cluster.address)
    worker = ray.remote(RankWorker)
    actors = [worker.options(num_cpus=0, resources={f"node{m}": 1}).remote()
              for m, k in enumerate(per_node) for _ in range(k)]
    times: Dict[Tuple[str, bool, int], List[float]] = {}
    algo_ran: Dict[Tuple[str, bool, int], Any] = {}
    lanes: Dict[bool, Any] = {}
    try:
        for rep in range(args.reps):
            for algo in args.algos.split(","):
                for on in (False, True):
                    opts: Dict[str, Any] = {"node_lanes": on}
                    if algo != "auto":
                        opts["all_reduce_algo"] = algo
                    got = run_on(actors, _bench, (sizes, args.iters),
                                 group_name=f"nl-{rep}-{algo}-{on}", timeout=600, options=opts)
                    for nbytes in sizes:
                        key = (algo, on, nbytes)
                        times.setdefault(key, []).append(max(g[nbytes][0] for g in got))
                        algo_ran[key] = got[0][nbytes][1]
                    lanes[on] = got[0][sizes[0]][2]
    finally:
        for a in actors:
            ray.kill(a)
        ray.shutdown()
        cluster.shutdown()
    print(f"ranks per node {per_node}; rank 0's node lane: off {lanes.get(False)}, "
          f"on {lanes.get(True)}; {args.reps} runs each, interleaved")
    print("| all_reduce_algo | ran | bytes | sockets (us) | node lane (us) | sockets / lane |")
    print("|---|---|---|---|---|---|")
    for algo in args.algos.split(","):
        for nbytes in sizes:
            off = statistics.median(times[(algo, False, nbytes)])
            on_ = statistics.median(times[(algo, True, nbytes)])
            print(f"| {algo} | {algo_ran[(algo, True, nbytes)] or 'direct'} | {nbytes} | "
                  f"{off:.0f} | {on_:.0f} | {off / on_:.2f}x |")


if __name__ == "__main__":
    main()
