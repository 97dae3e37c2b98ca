"""What two Ray nodes on one machine can move: one 64 MiB ``ray.get`` from the other node
alone, against two such gets in opposite directions at the same time.

A 2-rank all_reduce across two nodes must move each rank's N bytes to the other side (any
algorithm: reduce-scatter + all-gather moves N/2 each way twice), so its busbw (N / time) is
at most one get's bandwidth times (time of one get) / (time of both directions): this script
measures that bound (issue 5's target was 0.8x one get).

    python benchmarks/cross_node_bound.py [--mb 64] [--iters 6]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("RAY_free_objects_period_milliseconds", "10")

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402


@ray.remote(num_cpus=0)
class _Holder:
    def put(self, nbytes: int) -> list:
        self.ref = ray.put(np.ones(nbytes // 8))
        return [self.ref]

    def get(self, refs: list) -> float:
        start = time.perf_counter()
        value = ray.get(refs[0])
        float(value[0])
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=64.0)
    parser.add_argument("--iters", type=int, default=6)
    args = parser.parse_args()
    nbytes = int(args.mb * (1 << 20))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"n0": 1}})
    cluster.add_node(num_cpus=1, resources={"n1": 1})
    ray.init(address=cluster.address)
    try:
        a = _Holder.options(resources={"n0": 0.01}).remote()
        b = _Holder.options(resources={"n1": 0.01}).remote()
        alone, both = [], []
        for _ in range(args.iters):
            ref_b = ray.get(b.put.remote(nbytes))
            alone.append(ray.get(a.get.remote(ref_b)))
            ref_a, ref_b = ray.get([a.put.remote(nbytes), b.put.remote(nbytes)])
            start = time.perf_counter()
            ray.get([a.get.remote(ref_b), b.get.remote(ref_a)])
            both.append(time.perf_counter() - start)
        one, two = float(np.median(alone)), float(np.median(both))
        print(f"# load: {os.getloadavg()}")
        print(f"one {args.mb:g} MiB get from the other node: median {one * 1e3:.1f} ms "
              f"({nbytes / one / 1e9:.2f} GB/s)")
        print(f"two gets in opposite directions at once: median {two * 1e3:.1f} ms "
              f"({nbytes / two / 1e9:.2f} GB/s each)")
        print(f"-> a 2-rank all_reduce across the nodes: busbw at most {one / two:.2f}x one get "
              f"(both directions at once), {one / (2 * one):.2f}x (one after the other)")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
