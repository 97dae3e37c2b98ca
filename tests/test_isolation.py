"""Isolation: two jobs never see each other's groups; outsiders cannot join; destroyed
groups refuse calls with a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List

import numpy as np
import pytest
import ray

import raycoll
from raycoll.launch import RankWorker

Worker = ray.remote(num_cpus=0)(RankWorker)

# A driver of its own (its own Ray job) on the test session's Ray: it forms group "shared"
# from the driver and group "byname" inside its ranks, waits until the other driver has done
# the same (so both exist at once), runs collectives on both, and prints what it got.
_DRIVER = textwrap.dedent('''
    import json, os, sys, time
    import numpy as np
    import ray
    import raycoll
    from raycoll.launch import RankWorker

    address, me, other, value = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    ray.init(address=address, log_to_driver=False)
    W = ray.remote(num_cpus=0)(RankWorker)
    actors = [W.remote() for _ in range(2)]
    raycoll.create_group(actors, group_name="shared", timeout=120)

    def join_by_name(rank):
        raycoll.init_process_group(world_size=2, rank=rank, group_name="byname", timeout=120)

    ray.get([a.run.remote(join_by_name, r, (), {}) for r, a in enumerate(actors)], timeout=120)
    open(me, "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(other) and time.monotonic() < deadline:
        time.sleep(0.05)  # both jobs' groups exist from here on

    def work(rank, value, rounds):
        got = []
        for _ in range(rounds):
            x = np.full(8, value + rank)
            raycoll.all_reduce(x, group="shared")
            y = np.full(3, value * (rank + 1))
            raycoll.all_reduce(y, group="byname")
            got.append((float(x.min()), float(x.max()), float(y.min()), float(y.max())))
        return got

    results = ray.get([a.run.remote(work, r, (value, 100), {}) for r, a in enumerate(actors)],
                      timeout=120)
    raycoll.destroy_group("shared")
    print("RESULT " + json.dumps({"job": ray.get_runtime_context().get_job_id(),
                                  "other_seen": os.path.exists(other), "results": results}))
''')


@pytest.mark.timeout(240)
def test_two_jobs_with_the_same_group_names_never_meet(ray_local, tmp_path: Path):
    address = ray.get_runtime_context().gcs_address
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    marks = [str(tmp_path / "a.ready"), str(tmp_path / "b.ready")]
    values = [10.0, 1000.0]
    env = dict(os.environ, RAY_ADDRESS=address)
    procs = [subprocess.Popen([sys.executable, str(script), address, marks[i], marks[1 - i],
                               str(values[i])], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for i in range(2)]
    outs = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=200)
        finally:
            proc.kill()
        assert proc.returncode == 0, f"driver failed:\n{stdout}\n{stderr[-3000:]}"
        line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1]
        outs.append(json.loads(line[len("RESULT "):]))
    assert outs[0]["job"] != outs[1]["job"]
    for out, value in zip(outs, values):
        assert out["other_seen"], "the two drivers' groups did not exist at the same time"
        want = (2 * value + 1, 2 * value + 1, 3 * value, 3 * value)
        for rank_results in out["results"]:
            assert len(rank_results) == 100
            assert all(tuple(r) == want for r in rank_results), (value, rank_results[:3])


# ---------------------------------------------------------------------- outsiders
@pytest.fixture(scope="module")
def trio(ray_local) -> Iterator[List[Any]]:
    actors = [Worker.remote() for _ in range(3)]
    ray.get([a.__ray_ready__.remote() for a in actors], timeout=120)
    yield actors
    for actor in actors:
        ray.kill(actor, no_restart=True)


def _run(actor: Any, fn: Any, rank: int, *args: Any) -> Any:
    return actor.run.remote(fn, rank, args, {})


def _try(fn: Any) -> Dict[str, Any]:
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"ok": False, "type": type(exc).__name__, "msg": str(exc),
                "is": [c.__name__ for c in type(exc).__mro__]}
    return {"ok": True, "value": value}


def _outsider(rank: int, name: str) -> Dict[str, Dict[str, Any]]:
    x = np.ones(2)
    return {
        "by_name": _try(lambda: raycoll.all_reduce(x, group=name)),
        "default": _try(lambda: raycoll.all_reduce(x)),
        "join_as_member": _try(lambda: raycoll.init_process_group(
            world_size=2, rank=0, group_name=name, timeout=5)),
        "join_bigger": _try(lambda: raycoll.init_process_group(
            world_size=3, rank=2, group_name=name, timeout=5)),
    }


def _member_sum(rank: int, name: str) -> float:
    x = np.full(2, rank + 1.0)
    raycoll.all_reduce(x, group=name)
    return float(x[0])


@pytest.mark.timeout(120)
def test_a_rank_cannot_join_a_group_it_was_not_made_part_of(trio):
    name = f"iso-{uuid.uuid4().hex[:6]}"
    raycoll.create_group(trio[:2], group_name=name, timeout=60)
    try:
        start = time.time()
        out = ray.get(_run(trio[2], _outsider, 0, name), timeout=60)
        print(f"\noutsider errors: {json.dumps({k: v.get('msg') for k, v in out.items()}, indent=1)}")
        assert out["by_name"]["type"] == "GroupNotFoundError" and name in out["by_name"]["msg"]
        assert out["default"]["type"] == "GroupNotFoundError"
        assert not out["join_as_member"]["ok"] and "ValueError" in out["join_as_member"]["is"]
        assert "rank 0" in out["join_as_member"]["msg"], out["join_as_member"]
        assert not out["join_bigger"]["ok"] and "world_size=2" in out["join_bigger"]["msg"]
        assert time.time() - start < 30  # refused at once, not after a rendezvous timeout
        # the members were not disturbed
        assert ray.get([_run(a, _member_sum, r, name) for r, a in enumerate(trio[:2])],
                       timeout=60) == [3.0, 3.0]
    finally:
        raycoll.destroy_group(name)


# ---------------------------------------------------------------------- destroyed groups
def _held() -> Any:
    """Per-process state that survives between remote calls (test functions are shipped by
    value, each call with its own copy of this module's globals)."""
    import types

    return sys.modules.setdefault("_raycoll_isolation_state", types.ModuleType("state"))


def _keep_handle(rank: int, name: str) -> None:
    _held().pg = raycoll.get_group(name)


def _after_destroy(rank: int, name: str) -> Dict[str, Dict[str, Any]]:
    x = np.ones(2)
    return {
        "by_name": _try(lambda: raycoll.all_reduce(x, group=name)),
        "default": _try(lambda: raycoll.all_reduce(x)),
        "handle": _try(lambda: raycoll.all_reduce(x, group=_held().pg)),
        "async": _try(lambda: raycoll.broadcast(x, src=0, group=name, async_op=True)),
        "barrier": _try(lambda: raycoll.barrier(group=name)),
        "send": _try(lambda: raycoll.send(x, dst=1 - rank, group=name)),
        "object": _try(lambda: raycoll.all_gather_object([None, None], rank, group=name)),
    }


@pytest.mark.timeout(120)
def test_destroyed_group_rejects_every_call_with_a_clear_error(trio):
    name = f"iso-{uuid.uuid4().hex[:6]}"
    team = trio[:2]
    raycoll.create_group(team, group_name=name, timeout=60)
    ray.get([_run(a, _keep_handle, r, name) for r, a in enumerate(team)], timeout=60)
    assert ray.get([_run(a, _member_sum, r, name) for r, a in enumerate(team)], timeout=60) == [3.0, 3.0]
    raycoll.destroy_group(name)
    for out in ray.get([_run(a, _after_destroy, r, name) for r, a in enumerate(team)], timeout=60):
        for what, res in out.items():
            assert res["type"] == "GroupDestroyedError", (what, res)
            assert name in res["msg"] and "destroyed" in res["msg"], (what, res)
    with pytest.raises(ValueError, match=name):
        raycoll.destroy_group(name)
    with pytest.raises(ValueError, match=name):
        raycoll.group_status(name)
    # the name can be formed again, and works
    raycoll.create_group(team, group_name=name, timeout=60)
    try:
        assert ray.get([_run(a, _member_sum, r, name) for r, a in enumerate(team)],
                       timeout=60) == [3.0, 3.0]
    finally:
        raycoll.destroy_group(name)
