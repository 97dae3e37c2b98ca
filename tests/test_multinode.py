"""Collectives spanning two Ray nodes (``ray.cluster_utils.Cluster`` on this machine)."""

from __future__ import annotations

import numpy as np
import pytest
import ray

import raycoll
from raycoll.launch import RankWorker, run_on

pytestmark = pytest.mark.cluster


def _spanning(rank, world_size):
    out = {"node": ray.get_runtime_context().get_node_id()}
    small = np.full(3, float(rank + 1))
    raycoll.all_reduce(small)
    out["small"] = small.tolist()
    big = np.arange(300_000, dtype=np.float32) * (rank + 1)  # beyond inline: object refs
    raycoll.all_reduce(big)
    out["big"] = (float(big[1]), float(big[-1]))
    lst = [np.empty(100_000, dtype=np.float64) for _ in range(world_size)]
    raycoll.all_gather(lst, np.full(100_000, float(rank)))
    out["gather"] = [float(x[0]) for x in lst]
    b = np.full(200_000, float(rank))
    raycoll.broadcast(b, src=world_size - 1)
    out["bcast"] = float(b[-1])
    rs = np.empty(50_000, dtype=np.float32)
    raycoll.reduce_scatter_tensor(rs, np.full(50_000 * world_size, float(rank), dtype=np.float32))
    out["rs"] = float(rs[0])
    outs = [np.empty(40_000) for _ in range(world_size)]
    raycoll.all_to_all(outs, [np.full(40_000, float(10 * rank + j)) for j in range(world_size)])
    out["a2a"] = [float(o[0]) for o in outs]
    return out


@pytest.mark.timeout(300)
def test_collectives_across_two_nodes(two_nodes):
    worker = ray.remote(RankWorker)
    actors = [worker.options(num_cpus=0, resources={f"node{r % 2}": 1}).remote() for r in range(4)]
    try:
        results = run_on(actors, _spanning, (4,), group_name="two-nodes", timeout=120)
    finally:
        for a in actors:
            ray.kill(a)
    assert len({r["node"] for r in results}) == 2  # really spread over both nodes
    for rank, got in enumerate(results):
        assert got["small"] == [10.0] * 3
        assert got["big"] == (10.0, 299_999.0 * 10)
        assert got["gather"] == [0.0, 1.0, 2.0, 3.0]
        assert got["bcast"] == 3.0
        assert got["rs"] == 6.0
        assert got["a2a"] == [float(10 * s + rank) for s in range(4)]
