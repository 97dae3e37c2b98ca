"""all_reduce (and broadcast, all_gather) on ranks spread over two Ray nodes, three ways in
the same actors and the same run (issue 43):

- **new**: the group's default (``transport="auto"``): a node segment per node, and one
  hierarchical plan a collective (the segment in the node, sockets between nodes, one call
  of the native executor);
- **old**: the same ranks in a second group with ``transport="tcp"``: the socket schedules the
  cost model picks (every step over Unix sockets inside a node and TCP between nodes), the
  path every multi-node group took before; with ``--old ALGO``, instead the group's default
  transport with the collective forced to the flat socket schedule ``ALGO`` (e.g.
  ``halving_doubling``: the native executor, every step over sockets), the planner's
  alternative to the plan; with ``--old '{...}'``, the default transport with that
  ``cost_model`` option (every cost 0: the plans, broadcast's star over the nodes, where the
  defaults take the tree from 4 nodes);
- **gloo**: torch.distributed's gloo in the same actors.

The three alternate in blocks of a few calls, size by size, so load on the machine falls on
all three alike. Reported: per size and pattern, the median over calls of the slowest
rank's time (us), and the ratios new/old and gloo/new (> 1: new is faster). Patterns: **back
to back** (call after call) and **after a barrier** (each call right after a barrier of the
same library, as in a loop that computes between collectives).

Usage: ``python benchmarks/node_segment.py [--layout 2+2] [--sizes 4,1M,64M]
[--op all_reduce|reduce|broadcast|all_gather|reduce_scatter] [--iters 200] [--old ALGO]
[--new-cost-model JSON]`` (reduce_scatter:
the size is each rank's output piece, list inputs). The Ray nodes are ``ray.cluster_utils.Cluster`` nodes on
this machine (loopback between them).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from typing import Any, Dict, List

import numpy as np
import ray

import raycoll
from raycoll.bench.tables import parse_sizes
from raycoll.launch import RankWorker

LIBS = ("old", "new", "gloo")
BLOCK = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bench(rank: int, world: int, port: int, op: str, sizes: List[int], iters: int,
           ) -> Dict[str, Any]:
    """In a rank: each library's per-call times, by (size, pattern, library)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    out: Dict[str, Any] = {}
    try:
        from raycoll.groups import get_group

        algos: List[str] = []
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            reps = iters if nbytes <= 1 << 16 else max(6, iters // (40 if nbytes > 1 << 22 else 8))
            bufs = {"old": np.ones(n, np.float32), "new": np.ones(n, np.float32),
                    "gloo": torch.ones(n)}
            outs = {"old": [np.empty(n, np.float32) for _ in range(world)],
                    "new": [np.empty(n, np.float32) for _ in range(world)],
                    "gloo": [torch.empty(n) for _ in range(world)]}

            def call(lib: str) -> None:
                x = bufs[lib]
                if lib == "gloo":
                    if op == "all_reduce":
                        dist.all_reduce(x)
                    elif op == "reduce":
                        dist.reduce(x, dst=0)
                    elif op == "broadcast":
                        dist.broadcast(x, src=0)
                    elif op == "reduce_scatter":
                        dist.reduce_scatter(x, outs[lib])
                    else:
                        dist.all_gather(outs[lib], x)
                    return
                group = "node-seg-bench-" + lib
                if op == "all_reduce":
                    raycoll.all_reduce(x, group=group)
                elif op == "reduce":
                    raycoll.reduce(x, dst=0, group=group)
                elif op == "broadcast":
                    raycoll.broadcast(x, src=0, group=group)
                elif op == "reduce_scatter":  # each rank's piece: the size; its inputs: outs
                    raycoll.reduce_scatter(x, outs[lib], group=group)
                else:
                    raycoll.all_gather(outs[lib], x, group=group)

            def barrier(lib: str) -> None:
                if lib == "gloo":
                    dist.barrier()
                else:
                    raycoll.barrier(group="node-seg-bench-" + lib)

            for lib in LIBS:  # warm up: connections, segments, plans
                for _ in range(3):
                    call(lib)
            for pattern in ("back to back", "after a barrier"):
                times: Dict[str, List[float]] = {lib: [] for lib in LIBS}
                for start in range(0, reps, BLOCK):
                    for lib in LIBS:
                        barrier(lib)
                        for _ in range(min(BLOCK, reps - start)):
                            if pattern == "after a barrier":
                                barrier(lib)
                            t0 = time.perf_counter()
                            call(lib)
                            times[lib].append(time.perf_counter() - t0)
                for lib in LIBS:
                    out[f"{nbytes}|{pattern}|{lib}"] = times[lib]
            # a check: each library reduces the ranks' values right
            for lib in LIBS:
                bufs[lib][:] = rank + 1
                for piece in outs[lib]:
                    piece[:] = rank + 1
                call(lib)
                got = outs[lib][world - 1] if op == "all_gather" else bufs[lib]
                want = {"all_reduce": world * (world + 1) / 2, "broadcast": 1.0,
                        "reduce": world * (world + 1) / 2,  # (the root's; gloo's others: scratch)
                        "all_gather": float(world), "reduce_scatter": world * (world + 1) / 2}[op]
                if float(got[-1]) != want and (op != "reduce" or rank == 0):
                    raise AssertionError(f"{lib} {op} of {nbytes} B: {float(got[-1])} != {want}")
                if lib == "new":  # what the group's planner took at this size
                    algos.append(f"{nbytes} B {get_group('node-seg-bench-new').last_route.algorithm}")
        out["algorithm"] = ", ".join(algos)
    finally:
        dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="2+2", help="ranks per node, e.g. 2+2 or 3+1")
    parser.add_argument("--sizes", default="4,1M,64M")
    parser.add_argument("--op", default="all_reduce",
                        choices=("all_reduce", "reduce", "broadcast", "all_gather",
                                 "reduce_scatter"))
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--old", default="tcp",
                        help="old: 'tcp' (transport='tcp'), a flat socket schedule of the "
                             "op to force on the default transport (e.g. halving_doubling), "
                             "or a cost_model option as JSON for the default transport (all "
                             "zeros: broadcast's star)")
    parser.add_argument("--new-cost-model", default=None,
                        help="new's cost_model option, as JSON (e.g. a free segment, to have "
                             "its planner take the plans)")
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    per_node = [int(k) for k in args.layout.split("+")]
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node0": 64}, "include_dashboard": False})
    for i in range(1, len(per_node)):
        cluster.add_node(num_cpus=2, resources={f"node{i}": 64})
    ray.init(address=cluster.address, log_to_driver=False)
    worker = ray.remote(RankWorker)
    placement = [i for i, k in enumerate(per_node) for _ in range(k)]
    actors = [worker.options(num_cpus=0, resources={f"node{n}": 1}).remote() for n in placement]
    world = len(actors)
    try:
        raycoll.create_group(actors, group_name="node-seg-bench-new", timeout=120,
                             options={"cost_model": json.loads(args.new_cost_model)}
                             if args.new_cost_model else None)
        old = ({"transport": "tcp"} if args.old == "tcp"
               else {"cost_model": json.loads(args.old)} if args.old.startswith("{")
               else {f"{args.op}_algo": args.old})
        raycoll.create_group(actors, group_name="node-seg-bench-old", timeout=120,
                             options=old)
        sizes = parse_sizes(args.sizes)
        port = _free_port()
        refs = [a.run.remote(_bench, r, (world, port, args.op, sizes, args.iters), {})
                for r, a in enumerate(actors)]
        results = ray.get(refs, timeout=3600)
    finally:
        for a in actors:
            ray.kill(a)
        ray.shutdown()
        cluster.shutdown()
    print(f"# node_segment: {args.op}, {args.layout} ranks on {len(per_node)} Ray nodes "
          f"(ray.cluster_utils, this machine), float32; median over calls of the slowest "
          f"rank (us); same actors, same run; old: {args.old}; new's algorithm: "
          f"{results[0]['algorithm']}")
    print(f"{'size':>9} {'pattern':>16} {'old us':>10} {'new us':>10} {'gloo us':>10} "
          f"{'new/old':>8} {'x gloo':>7}")
    for nbytes in sizes:
        for pattern in ("back to back", "after a barrier"):
            med = {}
            for lib in LIBS:
                per_rank = [r[f"{nbytes}|{pattern}|{lib}"] for r in results]
                med[lib] = statistics.median(max(ts) for ts in zip(*per_rank)) * 1e6
            print(f"{nbytes:>9} {pattern:>16} {med['old']:>10.1f} {med['new']:>10.1f} "
                  f"{med['gloo']:>10.1f} {med['old'] / med['new']:>8.2f} "
                  f"{med['gloo'] / med['new']:>7.2f}")


if __name__ == "__main__":
    main()
