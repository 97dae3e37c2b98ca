"""A driver that restarts Ray the way a notebook user does, run by tests/test_restart.py.

``python tests/restart_driver.py local|cluster|torch``: forms group "dp" among three actors,
is a rank itself (group "solo", ``init_process_group`` in the driver), runs ``spawn`` and a
``raycoll.testing.RankPool``; shuts Ray down without destroying anything; calls raycoll's
functions with Ray down; then does it all again on a new Ray (new actors, the same names),
twice. ``local`` restarts a local Ray; ``cluster`` a two-node ``ray.cluster_utils.Cluster``
(the ranks spread over both nodes), and the second time only reconnects to it (a new job:
another session too). ``torch`` (local) restarts Ray under the driver rank with torch's
``init_process_group("raycoll")`` on it.

Prints one line ``RESULT {json}``: each step's outcome, ``{"ok": true, "value": ...}`` or
``{"ok": false, "type": ..., "is": [its classes], "msg": ..., "cause": ...}``. Shutting Ray
down would end a test session's own Ray: that is why this runs in a process of its own.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import ray

import raycoll

MODE = sys.argv[1] if len(sys.argv) > 1 else "local"
WORLD = 3
#: ``torch``: only the driver rank, with torch's group on it (needs torch, an optional extra).
TORCH = MODE == "torch"


@ray.remote(num_cpus=0)
class Worker:
    """A user's own actor class: a rank of group "dp" once the driver forms it."""

    def total(self) -> float:
        x = np.full(4, raycoll.get_rank("dp") + 1.0)
        raycoll.all_reduce(x, group="dp")
        return float(x[0])


def start(cluster: Any = None) -> Any:
    """A fresh Ray: local, or a two-node cluster (returned, to shut down with Ray); or, given
    a ``cluster``, a new connection (a new job) to it."""
    if cluster is not None:
        ray.init(address=cluster.address)
        return cluster
    if MODE == "local":
        ray.init(address="local", num_cpus=4, include_dashboard=False)
        return None
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node0": 8}, "object_store_memory": 200 * 1024 ** 2})
    cluster.add_node(num_cpus=2, resources={"node1": 8}, object_store_memory=200 * 1024 ** 2)
    ray.init(address=cluster.address)
    return cluster


def stop(cluster: Any, keep: bool = False) -> None:
    ray.shutdown()
    if cluster is not None and not keep:
        cluster.shutdown()


def where() -> List[str]:
    """The Ray session this driver is in: the cluster's, and its job."""
    ctx = ray.get_runtime_context()
    return [ctx.get_session_name(), ctx.get_job_id()]


def workers() -> List[Any]:
    if MODE == "local":
        return [Worker.remote() for _ in range(WORLD)]
    return [Worker.options(resources={f"node{r % 2}": 1}).remote() for r in range(WORLD)]


def outcome(fn: Callable[[], Any]) -> Dict[str, Any]:
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        cause: Optional[BaseException] = exc.__cause__
        return {"ok": False, "type": type(exc).__name__, "msg": str(exc),
                "is": [c.__name__ for c in type(exc).__mro__],
                "cause": type(cause).__name__ if cause is not None else None}
    return {"ok": True, "value": value}


def totals(team: List[Any]) -> List[float]:
    return ray.get([w.total.remote() for w in team], timeout=120)


def _spawned(rank: int) -> float:
    x = np.full(2, rank + 1.0)
    raycoll.all_reduce(x)
    return float(x[0])


def _torch_sum() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("raycoll")
    t = torch.ones(3)
    dist.all_reduce(t)
    return float(t[0])


def form_solo() -> float:
    """The driver is a rank itself: group "solo" of world size 1 (and torch's on it)."""
    raycoll.init_process_group(world_size=1, rank=0, group_name="solo")
    x = np.full(2, 5.0)
    raycoll.all_reduce(x)
    return float(x[0]) + (_torch_sum() if TORCH else 0.0)


def torch_destroy() -> None:
    if TORCH:
        import torch.distributed as dist

        dist.destroy_process_group()


def run_spawn() -> List[float]:
    return raycoll.spawn(_spawned, 2, group_name="sp", actor_options={"num_cpus": 0})


def torch_main() -> None:
    """The driver is a rank with torch's group on raycoll's: restart Ray under both."""
    out: Dict[str, Any] = {"mode": MODE}
    start()
    out["first"] = outcome(form_solo)
    stop(None)
    out["down"] = {"torch_destroy": outcome(torch_destroy),
                   "is_initialized": outcome(raycoll.is_initialized)}
    start()
    out["up"] = {"solo": outcome(form_solo)}
    stop(None)  # without destroying either group
    start()
    out["again"] = {"torch_destroy_old": outcome(torch_destroy), "solo": outcome(form_solo),
                    "torch_destroy": outcome(torch_destroy),
                    "destroy_process_group": outcome(raycoll.destroy_process_group)}
    stop(None)
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    from raycoll.testing import RankPool

    if TORCH:
        torch_main()
        return
    out: Dict[str, Any] = {"mode": MODE}
    # the first session: everything formed, nothing destroyed
    cluster = start()
    old = workers()
    raycoll.create_group(old, group_name="dp")
    out["first"] = {"totals": totals(old), "solo": outcome(form_solo),
                    "spawn": outcome(run_spawn)}
    pool = RankPool(max_world_size=2)
    out["first"]["pool"] = outcome(lambda: pool.run(_spawned, 2))
    out["nodes"] = len({n["NodeID"] for n in ray.nodes() if n["Alive"]})
    out["sessions"] = [where()]
    stop(cluster)  # the notebook user restarts Ray
    out["down"] = {
        "destroy_group": outcome(lambda: raycoll.destroy_group("dp")),
        "group_status": outcome(lambda: raycoll.group_status("dp")),
        "create_group": outcome(lambda: raycoll.create_group(old, group_name="dp")),
        "spawn_options": outcome(lambda: raycoll.spawn(print, 1, options={"strem": 1})),
        "is_initialized": outcome(raycoll.is_initialized),
        "destroy_process_group": outcome(lambda: raycoll.destroy_process_group("solo")),
        "solo_status": outcome(lambda: raycoll.group_status("solo")),
        "pool": outcome(lambda: pool.run(_spawned, 2)),
    }
    out["down"]["ray_started"] = ray.is_initialized()  # none of them started Ray
    # the second session: the same cells again
    cluster = start()
    out["up"] = {
        "destroy_group": outcome(lambda: raycoll.destroy_group("dp")),
        "group_status": outcome(lambda: raycoll.group_status("dp")),
        "create_group_old_actors": outcome(lambda: raycoll.create_group(old, group_name="dp")),
    }
    new = workers()
    out["up"]["create_group"] = outcome(lambda: raycoll.create_group(new, group_name="dp"))
    out["up"]["totals"] = outcome(lambda: totals(new))
    out["up"]["status_ranks"] = outcome(lambda: raycoll.group_status("dp")["world_size"])
    out["up"]["solo"] = outcome(form_solo)
    out["up"]["spawn"] = outcome(run_spawn)
    out["up"]["pool"] = outcome(lambda: pool.run(_spawned, 2))  # new actors
    out["sessions"].append(where())
    # again without destroying anything: the cells form "dp" and "solo" at once
    stop(cluster, keep=MODE == "cluster")
    cluster = start(cluster)
    out["sessions"].append(where())
    again = workers()
    out["again"] = {
        "create_group": outcome(lambda: raycoll.create_group(again, group_name="dp")),
        "totals": outcome(lambda: totals(again)),
        "destroy_group": outcome(lambda: raycoll.destroy_group("dp")),
        "destroy_group_twice": outcome(lambda: raycoll.destroy_group("dp")),
        "solo": outcome(form_solo),
        "destroy_process_group": outcome(raycoll.destroy_process_group),
        "pool_close": outcome(pool.close),
    }
    stop(cluster)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
