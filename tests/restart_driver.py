"""A driver that restarts Ray the way a notebook user does, run by tests/test_restart.py.

``python tests/restart_driver.py local|cluster``: forms group "dp" among three actors, shuts
Ray down without destroying it, and calls raycoll's driver-side functions with Ray down, then
with a new Ray (new actors, the same group name), twice. ``local`` restarts a local Ray;
``cluster`` a two-node ``ray.cluster_utils.Cluster`` (the ranks spread over both nodes), and
the second time only reconnects to the same cluster (a new job: another session too);
``local`` also restarts Ray under a driver that is a rank itself (``init_process_group``,
and torch's ``init_process_group("raycoll")`` when torch is installed) and under ``spawn``.

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


def driver_groups(out: Dict[str, Any]) -> None:
    """Form "dp" from the driver, restart Ray twice, form it again each time."""
    cluster = start()
    old = workers()
    raycoll.create_group(old, group_name="dp")
    out["first"] = totals(old)
    out["sessions"] = [where()]
    out["nodes"] = len({n["NodeID"] for n in ray.nodes() if n["Alive"]})
    stop(cluster)  # the group is never destroyed: the notebook user restarts Ray
    out["down"] = {
        "destroy_group": outcome(lambda: raycoll.destroy_group("dp")),
        "group_status": outcome(lambda: raycoll.group_status("dp")),
        "create_group": outcome(lambda: raycoll.create_group(old, group_name="dp")),
        "spawn_options": outcome(lambda: raycoll.spawn(print, 1, options={"strem": 1})),
    }
    out["down"]["ray_started"] = ray.is_initialized()  # none of them started Ray
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
    out["sessions"].append(where())
    # again without destroying: re-running the cell forms "dp" at once
    stop(cluster, keep=MODE == "cluster")
    cluster = start(cluster)
    out["sessions"].append(where())
    again = workers()
    out["again"] = {
        "create_group": outcome(lambda: raycoll.create_group(again, group_name="dp")),
        "totals": outcome(lambda: totals(again)),
        "destroy_group": outcome(lambda: raycoll.destroy_group("dp")),
        "destroy_group_twice": outcome(lambda: raycoll.destroy_group("dp")),
    }
    stop(cluster)


def _torch_sum() -> float:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("raycoll")
    t = torch.ones(3)
    dist.all_reduce(t)
    return float(t[0])


def driver_rank(out: Dict[str, Any], with_torch: bool) -> None:
    """The driver is a rank (world size 1): form, restart Ray, form the same name again."""
    def form() -> float:
        raycoll.init_process_group(world_size=1, rank=0, group_name="solo")
        x = np.full(2, 5.0)
        raycoll.all_reduce(x)
        return float(x[0]) + (_torch_sum() if with_torch else 0.0)

    cluster = start()
    out["rank_first"] = outcome(form)
    stop(cluster)
    out["rank_down"] = {
        "is_initialized": outcome(raycoll.is_initialized),
        "destroy_process_group": outcome(lambda: raycoll.destroy_process_group("solo")),
        "group_status": outcome(lambda: raycoll.group_status("solo")),
    }
    if with_torch:
        import torch.distributed as dist

        out["rank_down"]["torch_destroy"] = outcome(dist.destroy_process_group)
    cluster = start()
    out["rank_up"] = {"form": outcome(form),
                      "destroy_process_group": outcome(raycoll.destroy_process_group)}
    if with_torch:
        import torch.distributed as dist

        out["rank_up"]["torch_destroy"] = outcome(dist.destroy_process_group)
    stop(cluster)


def _spawned(rank: int) -> float:
    x = np.full(2, rank + 1.0)
    raycoll.all_reduce(x)
    return float(x[0])


def spawns(out: Dict[str, Any]) -> None:
    """spawn with one group_name before and after a restart (spawn starts Ray itself)."""
    options = {"num_cpus": 0}
    out["spawn"] = [outcome(lambda: raycoll.spawn(_spawned, 2, group_name="sp",
                                                  actor_options=options))]
    ray.shutdown()
    out["spawn"].append(outcome(lambda: raycoll.spawn(_spawned, 2, group_name="sp",
                                                      actor_options=options)))
    ray.shutdown()


def main() -> None:
    out: Dict[str, Any] = {"mode": MODE}
    driver_groups(out)
    if MODE == "local":
        try:
            import torch.distributed  # noqa: F401

            with_torch = True
        except ImportError:
            with_torch = False
        out["torch"] = with_torch
        driver_rank(out, with_torch)
        spawns(out)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
