"""Ray Direct Transport: one tensor from one actor to another, end to end, with
``tensor_transport="raycoll"``, Ray's ``"gloo"`` transport (``ray.util.collective``'s gloo
group over torch, formed with ``ray.experimental.collective.create_collective_group``) and
the plain object store, printed side by side as ratios (interleaved rounds, medians).

Each transfer is what a user times: ``ray.get(consumer.take.remote(producer.make.remote()))``
where ``make`` returns a tensor the producer already holds (the same one each time: no
allocation is timed) and ``take`` returns its element count. ``--nodes 2`` puts the producer
and the consumer on two Ray nodes of this machine (``ray.cluster_utils.Cluster``), where
raycoll pulls over TCP.

    python benchmarks/rdt.py                          # one node
    python benchmarks/rdt.py --nodes 2 --sizes 4,1048576,67108864
    python benchmarks/rdt.py --paths                  # raycoll's data paths alone, no Ray

``--paths`` times raycoll's pull paths without Ray, in one process (a Keeper and a Puller,
raycoll/transport/pull.py): the cross-memory read against the pull server's socket, into a
buffer already mapped and into a fresh one, beside a plain memcpy: why the same node reads
by CMA and why large objects land in the receive pool.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Dict, List

import ray
import torch

import raycoll.rdt

raycoll.rdt.register()  # before the classes: ray.method checks the transport's name


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Producer:
    def __init__(self) -> None:
        import raycoll.transport.pull  # noqa: F401 - before Ray's transfer thread imports it

        self.t: Dict[int, Any] = {}

    def alloc(self, nbytes: int) -> int:
        self.t = {nbytes: torch.ones(max(1, nbytes // 4), dtype=torch.float32)}
        return nbytes

    @ray.method(tensor_transport="raycoll")
    def make_raycoll(self, nbytes: int) -> Any:
        return self.t[nbytes]

    @ray.method(tensor_transport="gloo")
    def make_gloo(self, nbytes: int) -> Any:
        return self.t[nbytes]

    def make_store(self, nbytes: int) -> Any:
        return self.t[nbytes]

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Consumer:
    def __init__(self) -> None:
        import raycoll.transport.pull  # noqa: F401 - before Ray's transfer thread imports it

    def take(self, t: Any) -> int:
        return int(t.numel())

    def paths(self) -> Dict[str, int]:
        from raycoll.transport.pull import puller

        return dict(puller().by_path)


def _once(p: Any, c: Any, how: str, nbytes: int) -> float:
    make = getattr(p, f"make_{how}")
    start = time.perf_counter()
    got = ray.get(c.take.remote(make.remote(nbytes)), timeout=300)
    took = time.perf_counter() - start
    assert got == max(1, nbytes // 4), (how, got)
    return took


def _fmt(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def paths(sizes: List[int]) -> None:
    """raycoll's pull paths alone (no Ray), medians of 9 in ms."""
    import numpy as np

    from raycoll.transport.pull import Keeper, Puller

    keeper, puller = Keeper(), Puller()
    print(f"{'size':>8} {'memcpy':>8} {'cma':>8} {'cma+alloc':>10} {'socket':>8}")
    for nbytes in sizes:
        data = np.ones(nbytes, np.uint8)
        kept = keeper.keep(f"bench-{nbytes}", [data], node_id="here", host="127.0.0.1")
        out = np.empty_like(data)
        out[:] = 0

        def med(fn: Any) -> float:
            ts = []
            for _ in range(9):
                start = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - start)
            return statistics.median(ts) * 1e3

        copy = med(lambda: np.copyto(out, data))
        cma = med(lambda: puller.pull(kept, [out], "here", 30))
        fresh = med(lambda: puller.pull(kept, [np.empty_like(data)], "here", 30))
        sock = med(lambda: puller.pull(kept, [out], "elsewhere", 30))
        print(f"{_fmt(nbytes):>8} {copy:>8.3f} {cma:>8.3f} {fresh:>10.3f} {sock:>8.3f}  "
              f"({'inline' if kept.inline is not None else 'pulled'})", flush=True)
        keeper.drop(kept.obj_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1, choices=(1, 2))
    parser.add_argument("--sizes", default="4,1048576,67108864,268435456", help="bytes")
    parser.add_argument("--rounds", type=int, default=0,
                        help="rounds a size (default: 40 to 4 by size)")
    parser.add_argument("--paths", action="store_true",
                        help="raycoll's pull paths alone, no Ray (see above)")
    args = parser.parse_args()
    if args.paths:
        paths([int(x) for x in args.sizes.split(",")])
        return
    cluster = None
    if args.nodes == 1:
        ray.init(address="local", num_cpus=4, include_dashboard=False)
        p_opts: Dict[str, Any] = {}
        c_opts: Dict[str, Any] = {}
    else:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "resources": {"node0": 4}, "object_store_memory": 1200 << 20})
        cluster.add_node(num_cpus=2, resources={"node1": 4}, object_store_memory=1200 << 20)
        ray.init(address=cluster.address)
        p_opts, c_opts = {"resources": {"node0": 1}}, {"resources": {"node1": 1}}
    from ray.experimental.collective import create_collective_group

    p = Producer.options(**p_opts).remote()
    c = Consumer.options(**c_opts).remote()
    ray.get([p.pid.remote(), c.paths.remote()])
    create_collective_group([p, c], backend="torch_gloo")
    hows = ["raycoll", "gloo", "store"]
    rows: List[str] = []
    print(f"Ray {ray.__version__}, torch {torch.__version__}, {args.nodes} node(s), "
          f"{os.cpu_count()} cores; medians of interleaved rounds (ms)")
    head = (f"{'size':>8} {'raycoll':>9} {'gloo':>9} {'store':>9}  "
            f"{'gloo/raycoll':>12} {'store/raycoll':>13}")
    print(head)
    rows.append(head)
    for nbytes in (int(s) for s in args.sizes.split(",")):
        ray.get(p.alloc.remote(nbytes))
        rounds = args.rounds or (40 if nbytes <= 1 << 20 else 10 if nbytes <= 64 << 20 else 5)
        times: Dict[str, List[float]] = {h: [] for h in hows}
        for h in hows:  # warm up each path (connections, groups, pools)
            _once(p, c, h, nbytes)
        for r in range(rounds):
            for h in (hows[r % 3:] + hows[:r % 3]):  # rotate who goes first
                times[h].append(_once(p, c, h, nbytes))
        med = {h: statistics.median(times[h]) * 1e3 for h in hows}
        row = (f"{_fmt(nbytes):>8} {med['raycoll']:>9.2f} {med['gloo']:>9.2f} "
               f"{med['store']:>9.2f}  {med['gloo'] / med['raycoll']:>11.2f}x "
               f"{med['store'] / med['raycoll']:>12.2f}x")
        print(row, flush=True)
        rows.append(row)
    print(f"raycoll's paths taken: {ray.get(c.paths.remote())}")
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()


if __name__ == "__main__":
    main()
