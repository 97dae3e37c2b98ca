"""Faults across Ray nodes (``ray.cluster_utils.Cluster`` on this machine): a node that goes
away mid-collective fails the surviving ranks with RankFailedError naming every rank it
held; the group re-forms across the remaining nodes and mixed collectives spanning them
stay correct, with object-store memory back to its baseline on every node."""

from __future__ import annotations

import time
import uuid
from typing import Any, Dict

import numpy as np
import pytest
import ray

from helpers import soak_module, wait_in_collective

import raycoll
from raycoll.launch import RankWorker

pytestmark = pytest.mark.cluster

Worker = ray.remote(RankWorker)
STORE = 300 * 1024 ** 2


def _on(resource: str) -> Any:
    return Worker.options(num_cpus=0, resources={resource: 1}).remote()


def _all_reduce(rank: int, group: str, n: int) -> Dict[str, Any]:
    x = np.full(n, rank + 1.0)
    start = time.time()
    try:
        raycoll.all_reduce(x, group=group)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"ok": False, "type": type(exc).__name__, "msg": str(exc), "t": time.time(),
                "failed_ranks": list(getattr(exc, "failed_ranks", ())),
                "elapsed": time.time() - start}
    return {"ok": True, "value": float(x[0]), "node": ray.get_runtime_context().get_node_id()}


def _sleep(rank: int, seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("graceful", [True, False], ids=["terminated", "killed"])
def test_node_removed_mid_collective_fails_survivors_and_group_reforms(two_nodes, graceful):
    """Ranks 2 and 3 live on a third node, busy; ranks 0 and 1 wait in a large all_reduce
    (object references in flight); the third node is removed. terminated: its processes get
    SIGTERM (a drained or preempted node), detected at once; killed: SIGKILL (power loss),
    detected when Ray declares the node dead (its health check, ~10-15 s by default)."""
    cluster = two_nodes
    node = cluster.add_node(num_cpus=2, resources={"node2": 8}, object_store_memory=STORE)
    cluster.wait_for_nodes()
    team = [_on("node0"), _on("node1"), _on("node2"), _on("node2")]
    name = f"mn-{uuid.uuid4().hex[:6]}"
    raycoll.create_group(team, group_name=name, timeout=120)
    soak = soak_module()
    n = 1_000_000  # 8 MB: travels as object references between nodes
    try:
        warm = ray.get([a.run.remote(_all_reduce, r, (name, n), {}) for r, a in enumerate(team)],
                       timeout=120)
        assert [w["value"] for w in warm] == [10.0] * 4
        assert len({w["node"] for w in warm}) == 3
        busy = [team[r].run.remote(_sleep, r, (300.0,), {}) for r in (2, 3)]
        refs = [team[r].run.remote(_all_reduce, r, (name, n), {}) for r in (0, 1)]
        wait_in_collective(name, [0, 1], ("all_reduce", 2))  # waiting for ranks 2 and 3
        removed_at = time.time()
        cluster.remove_node(node, allow_graceful=graceful)
        results = ray.get(refs, timeout=120)
        limit = 5.0 if graceful else 60.0
        for res in results:
            assert not res["ok"] and res["type"] == "RankFailedError", res
            assert res["failed_ranks"] == [2, 3], res
            assert "rank 2" in res["msg"] and "rank 3" in res["msg"], res["msg"]
            assert res["t"] - removed_at < limit, (res["t"] - removed_at, res["msg"])
        print(f"\n[{'SIGTERM' if graceful else 'SIGKILL'}] survivors failed "
              f"{results[0]['t'] - removed_at:.2f}s after the node was removed: {results[0]['msg']}")
        del busy
    finally:
        raycoll.destroy_group(name)
        for actor in team[2:]:
            ray.kill(actor, no_restart=True)

    if not graceful:
        for actor in team[:2]:
            ray.kill(actor, no_restart=True)
        return  # re-forming is the same either way: checked once, below
    # the survivors plus replacements on the remaining nodes: correct again, across nodes
    baseline = soak.store_settled(1_000_000)
    team = team[:2] + [_on("node0"), _on("node1")]
    raycoll.create_group(team, group_name=name, timeout=120)
    cfg = {"small_elems": 32, "large_every": 4, "large_mb": 2.0}
    try:
        out = ray.get([a.run.remote(soak.soak_rank, r, (name, 8, 0, cfg), {})
                       for r, a in enumerate(team)], timeout=180)
    finally:
        raycoll.destroy_group(name)
        for actor in team:
            ray.kill(actor, no_restart=True)
    assert out[0]["counts"]["large_all_reduce"] == 2 and out[0]["counts"]["send_recv"] == 8
    final = soak.store_settled(baseline + 1_000_000)
    assert final <= baseline + 1_000_000, (baseline, final)
