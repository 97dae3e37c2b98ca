"""A Ray restart and Ray's failures as the driver-side functions meet them: records scoped to
the Ray session, no raw Ray error from create_group, destroy_group, group_status, spawn,
init_process_group, destroy_process_group or torch's entry points.

Tests that shut Ray down run ``tests/restart_driver.py`` in a process of their own (this
session's Ray must live on); the rest meet a dead actor or a dead coordinator on the
session's Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import ray

import raycoll
from raycoll.coordinator.spare import find as find_coordinator
from raycoll.launch import RankWorker
from raycoll.session import ENDED_KEPT, SessionRecords

from helpers import torch_init, wait_for

DRIVER = Path(__file__).resolve().parent / "restart_driver.py"
Worker = ray.remote(num_cpus=0)(RankWorker)


# ---------------------------------------------------------------------- pure
def test_records_of_another_session_are_forgotten_and_named_as_ended():
    records: SessionRecords[int] = SessionRecords("group")
    one, two = ("cluster-a", "01000000"), ("cluster-b", "01000000")  # same job id, new cluster
    assert records.add("dp", 1, one)
    assert not records.add("dp", 2, one), "a name is taken within its session"
    assert records.get("dp", one) == 1 and records.names(one) == ["dp"]
    assert records.get("dp", two) is None, "a record of another session"
    assert records.ended("dp", two) and records.names(two) == []
    assert records.get("dp", one) is None, "forgotten, not hidden: the old session is gone"
    assert records.add("dp", 3, two) and not records.ended("dp", two)
    assert records.pop("dp", None) is None and records.ended("dp", None)  # Ray shut down
    assert records.add("dp", 4, ("cluster-b", "02000000"))  # the same cluster, a new job
    for i in range(ENDED_KEPT + 5):  # what it remembers of ended names is bounded
        records.add(f"g{i}", i, one)
        records.names(two)
    assert records.ended(f"g{ENDED_KEPT + 4}", two) and not records.ended("g0", two)


# ---------------------------------------------------------------------- restarting Ray
def _run_driver(mode: str, timeout: float) -> Dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, str(DRIVER), mode], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _ok(step: Dict[str, Any], what: str) -> Any:
    assert step["ok"], f"{what}: {step['type']}: {step['msg']}"
    return step["value"]


def _raised(step: Dict[str, Any], kind: str, what: str, *words: str) -> str:
    assert not step["ok"], f"{what} did not raise"
    assert kind in step["is"] and "RaycollError" in step["is"], f"{what}: {step}"
    for word in words:
        assert word in step["msg"], f"{what}: {word!r} not in {step['msg']!r}"
    return step["msg"]


def _check(out: Dict[str, Any]) -> None:
    solo = 5.0  # raycoll's all_reduce in a group of one
    first = out["first"]
    assert first["totals"] == [6.0] * 3
    assert _ok(first["solo"], "init_process_group in the driver") == solo
    assert _ok(first["spawn"], "spawn") == [3.0, 3.0]
    assert _ok(first["pool"], "RankPool.run") == [3.0, 3.0]

    down = out["down"]
    assert _ok(down["destroy_group"], "destroy_group with Ray down") is None
    _raised(down["group_status"], "RaySessionError", "group_status with Ray down",
            "ray.init()")
    _raised(down["create_group"], "RaySessionError", "create_group with Ray down",
            "not initialized", "create the actors")
    assert not down["spawn_options"]["ok"] and "strem" in down["spawn_options"]["msg"]
    assert _ok(down["is_initialized"], "is_initialized with Ray down") is False
    assert _ok(down["destroy_process_group"], "destroy_process_group with Ray down") is None
    _raised(down["solo_status"], "RaySessionError", "group_status of the driver's group")
    _raised(down["pool"], "RaySessionError", "RankPool.run with Ray down", "ray.init()")
    assert down["ray_started"] is False, "a raycoll call started Ray"

    up = out["up"]
    assert _ok(up["destroy_group"], "destroy_group of the ended session's group") is None
    _raised(up["group_status"], "GroupNotFoundError", "group_status of an ended group",
            "session that has ended")
    msg = _raised(up["create_group_old_actors"], "RaySessionError",
                  "create_group with actors of the ended session", "rank 0",
                  "create the actors again")
    assert up["create_group_old_actors"]["cause"] == "Exception", msg  # Ray's, chained
    _ok(up["create_group"], "create_group of the same name after the restart")
    assert _ok(up["totals"], "all_reduce") == [6.0] * 3
    assert _ok(up["status_ranks"], "group_status") == 3
    assert _ok(up["solo"], "init_process_group of the same name after the restart") == solo
    assert _ok(up["spawn"], "spawn of the same group_name after the restart") == [3.0, 3.0]
    assert _ok(up["pool"], "RankPool.run after the restart") == [3.0, 3.0]

    again = out["again"]
    _ok(again["create_group"], "create_group after a restart without destroy_group")
    assert _ok(again["totals"], "all_reduce") == [6.0] * 3
    _ok(again["destroy_group"], "destroy_group")
    _raised(again["destroy_group_twice"], "GroupNotFoundError", "destroy_group twice", "'dp'")
    assert _ok(again["solo"], "init_process_group without destroy_process_group") == solo
    for step in ("destroy_process_group", "pool_close"):
        _ok(again[step], step)


@pytest.mark.timeout(300)
def test_a_driver_that_restarts_ray_forms_the_same_groups_again():
    out = _run_driver("local", timeout=280)
    _check(out)
    assert len({tuple(s) for s in out["sessions"]}) == 3


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_torch_on_a_driver_rank_across_ray_restarts():
    """torch's group on the driver's raycoll group: destroyed quietly once Ray is down or
    restarted, formed again on the new Ray (6 = raycoll's 5 + torch's 1)."""
    out = _run_driver("torch", timeout=280)
    assert _ok(out["first"], "torch init_process_group('raycoll') in the driver") == 6.0
    _ok(out["down"]["torch_destroy"], "torch's destroy_process_group with Ray down")
    assert _ok(out["down"]["is_initialized"], "is_initialized with Ray down") is False
    assert _ok(out["up"]["solo"], "both formed again after the restart") == 6.0
    _ok(out["again"]["torch_destroy_old"], "torch's destroy_process_group of an ended group")
    assert _ok(out["again"]["solo"], "both formed again") == 6.0
    _ok(out["again"]["torch_destroy"], "torch's destroy_process_group")
    _ok(out["again"]["destroy_process_group"], "destroy_process_group")


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_driver_that_restarts_a_two_node_cluster_forms_the_same_groups_again():
    out = _run_driver("cluster", timeout=280)
    assert out["nodes"] == 2
    _check(out)
    first, restarted, reconnected = out["sessions"]
    assert first[0] != restarted[0], "the cluster was restarted"
    assert restarted[0] == reconnected[0] and restarted[1] != reconnected[1], \
        "the second time, a new job on the same cluster"


# ---------------------------------------------------------------------- Ray's failures
@pytest.fixture
def team(ray_local) -> Any:
    actors = [Worker.remote() for _ in range(2)]
    ray.get([a.__ray_ready__.remote() for a in actors], timeout=60)
    yield actors
    for actor in actors:
        ray.kill(actor, no_restart=True)


def _coordinator(name: str) -> Any:
    return find_coordinator(ray.get_runtime_context().get_job_id(), name)


def _kill_and_wait(actor: Any) -> None:
    """Kill ``actor`` and wait (bounded) until Ray reports it dead."""
    ray.kill(actor, no_restart=True)
    _wait_dead(actor)


def _wait_dead(actor: Any) -> None:
    """Wait (bounded) until Ray reports ``actor`` dead."""
    def dead() -> bool:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return True
        return False

    wait_for(dead, timeout=60, every=0.2, what="the killed actor reported dead")


def _sum(rank: int, name: str) -> float:
    x = np.full(2, rank + 1.0)
    raycoll.all_reduce(x, group=name)
    return float(x[0])


@pytest.mark.timeout(180)
def test_a_dead_coordinator_or_actor_meets_the_driver_as_raycoll_errors(team: List[Any]):
    name = f"restart-{uuid.uuid4().hex[:6]}"
    raycoll.create_group(team, group_name=name, timeout=60)
    _kill_and_wait(_coordinator(name))
    with pytest.raises(raycoll.CoordinatorDiedError, match=name) as info:
        raycoll.group_status(name)
    assert isinstance(info.value.__cause__, ray.exceptions.RayActorError)
    _kill_and_wait(team[1])
    raycoll.destroy_group(name)  # a dead coordinator and a dead rank: quiet
    with pytest.raises(raycoll.GroupNotFoundError, match=name):
        raycoll.destroy_group(name)
    with pytest.raises(raycoll.RankFailedError, match="rank 1 is dead") as dead:
        raycoll.create_group(team, group_name=name, timeout=60)
    assert isinstance(dead.value.__cause__, ray.exceptions.RayActorError)
    team[1] = Worker.remote()  # the fixture kills it
    raycoll.create_group(team, group_name=name, timeout=60)  # the name was left free
    try:
        got = ray.get([a.run.remote(_sum, r, (name,), {}) for r, a in enumerate(team)],
                      timeout=60)
        assert got == [3.0, 3.0]
    finally:
        raycoll.destroy_group(name)


def _die(rank: int) -> None:
    if rank == 1:
        os._exit(1)
    x = np.ones(2)
    raycoll.all_reduce(x)  # rank 1 never comes: aborted once its death is seen


@pytest.mark.timeout(180)
def test_spawn_names_a_rank_whose_actor_died(ray_local):
    start = time.monotonic()
    with pytest.raises(raycoll.SpawnError, match=r"the actor of rank 1 died") as info:
        raycoll.spawn(_die, 2, actor_options={"num_cpus": 0}, timeout=120)
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, ray.exceptions.RayActorError)
    assert time.monotonic() - start < 60, "the dead rank was not seen before the timeout"


def _by_name(rank: int, name: str) -> Dict[str, Any]:
    """init_process_group by name; rank 0 kills the coordinator; each rank destroys the
    group (quietly) and forms it again by the same name, on a new coordinator."""
    raycoll.init_process_group(world_size=2, rank=rank, group_name=name, timeout=60)
    first = _sum(rank, name)
    coordinator = raycoll.get_group(name).client.handle
    if rank == 0:
        ray.kill(coordinator, no_restart=True)
    _wait_dead(coordinator)
    out: Dict[str, Any] = {"first": first}
    try:
        raycoll.destroy_process_group(name)
        out["destroyed"] = True
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["destroyed"] = f"{type(exc).__name__}: {exc}"
    raycoll.init_process_group(world_size=2, rank=rank, group_name=name, timeout=60)
    out["again"] = _sum(rank, name)
    raycoll.destroy_process_group(name)
    return out


@pytest.mark.timeout(180)
def test_ranks_whose_coordinator_died_leave_quietly_and_form_the_name_again(team: List[Any]):
    name = f"restart-{uuid.uuid4().hex[:6]}"
    got = ray.get([a.run.remote(_by_name, r, (name,), {}) for r, a in enumerate(team)],
                  timeout=150)
    for rank, out in enumerate(got):
        assert out == {"first": 3.0, "destroyed": True, "again": 3.0}, (rank, out)


def _torch_after_coordinator_died(rank: int) -> Dict[str, Any]:
    import torch

    dist = torch_init()
    name = raycoll.group.WORLD.name
    out: Dict[str, Any] = {}
    try:
        # On the store transport a barrier's answer comes from the coordinator: rank 0 can
        # leave the barrier and kill it before rank 1 has its answer, and then rank 1's
        # barrier is the call that meets the dead coordinator.
        dist.barrier()
        if rank == 0:
            _kill_and_wait(_coordinator(name))
        dist.all_reduce(torch.ones(2))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["raised"] = [c.__name__ for c in type(exc).__mro__]
    try:
        dist.destroy_process_group()
        out["destroyed"] = True
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["destroyed"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_torch_on_raycoll_whose_coordinator_died_raises_raycoll_errors(ranks):
    got = ranks.run(_torch_after_coordinator_died, 2, options={"transport": "store"})
    for rank, out in enumerate(got):
        assert "CoordinatorDiedError" in out.get("raised", []), (rank, out)
        assert out["destroyed"] is True, (rank, out)
