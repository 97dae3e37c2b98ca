"""Group formation over live actors takes a coordinator started ahead (its spare), which
belongs to the driver's Ray session: counted, looked up by name, ended with the session; a
destroyed group's coordinator is recycled for the next group (its tables empty, a new
generation), unless the group failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import ray

import raycoll
from helpers import group_sums
from raycoll import session
from raycoll.coordinator import spare
from raycoll.launch import DRIVER_GROUPS


def _coordinator(name: str) -> Any:
    entry = DRIVER_GROUPS.get(name, session.current())
    assert entry is not None, name
    return entry.spec.coordinator


@pytest.mark.timeout(120)
def test_the_next_group_over_live_actors_takes_the_coordinator_started_ahead(rank_actors):
    first, second = f"f1-{uuid.uuid4().hex[:6]}", f"f2-{uuid.uuid4().hex[:6]}"
    job = ray.get_runtime_context().get_job_id()
    raycoll.create_group(rank_actors[:2], group_name=first)
    try:
        ahead = spare.pending()
        assert ahead is not None, "no coordinator was started ahead after a group formed"
        ray.get(ahead.handle.__ray_ready__.remote(), timeout=60)  # it is up before it is needed
        before = spare.counts()
        raycoll.create_group(rank_actors[1:][::-1], group_name=second)
        after = spare.counts()
        # the second group's coordinator is the one that was ready; one more was started ahead
        assert _coordinator(second)._actor_id == ahead.handle._actor_id
        assert after == dict(before, started=before["started"] + 1, taken=before["taken"] + 1)
        refill = spare.pending()
        assert refill is not None and refill.name != ahead.name
        assert group_sums(rank_actors[:2], first) == [3.0, 3.0]
        assert group_sums(rank_actors[1:][::-1], second) == [3.0, 3.0]
        # the group's name finds it from the job, and is taken: a second formation is refused
        # and consumes no coordinator
        assert spare.find(job, second)._actor_id == ahead.handle._actor_id
        assert raycoll.group_status(second)["world_size"] == 2
        with pytest.raises(ValueError, match="already exists"):
            raycoll.create_group(rank_actors[:2], group_name=second)
        assert spare.counts() == after and spare.pending() == refill
    finally:
        raycoll.destroy_group(first)
        raycoll.destroy_group(second)
    # destroyed: its name is free at once, its coordinator is kept idle with empty tables
    # (recycled), and the next group takes it: no process is started
    assert spare.find(job, second) is None
    kept = spare.pending()
    assert kept is not None and kept.handle._actor_id == ahead.handle._actor_id
    sizes = ray.get(kept.handle.state_sizes.remote(), timeout=60)[1]
    assert all(v == 0 for k, v in sizes.items() if k not in ("store", "probes_sent")), sizes
    before = spare.counts()
    raycoll.create_group(rank_actors[:2], group_name=second)
    try:
        assert _coordinator(second)._actor_id == ahead.handle._actor_id
        assert spare.counts() == dict(before, taken=before["taken"] + 1)
        assert raycoll.group_status(second)["generation"] > 0  # a new generation, own tables
        assert group_sums(rank_actors[:2], second) == [3.0, 3.0]
    finally:
        raycoll.destroy_group(second)


@pytest.mark.timeout(120)
def test_a_failed_group_s_coordinator_is_ended_not_recycled(ray_local):
    from raycoll.launch import RankWorker

    worker = ray.remote(num_cpus=0)(RankWorker)
    team = [worker.remote() for _ in range(2)]
    name = f"fx-{uuid.uuid4().hex[:6]}"
    raycoll.create_group(team, group_name=name)
    coordinator = _coordinator(name)
    other = f"fy-{uuid.uuid4().hex[:6]}"
    raycoll.create_group(team[:1], group_name=other)  # a group of its own, on rank 0 only
    try:
        ray.kill(team[1], no_restart=True)
        deadline = time.monotonic() + 60  # dead before the destroy (the kill lands later)
        while True:
            try:
                ray.get(team[1].__ray_ready__.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, "a killed rank still answers after 60 s"
            time.sleep(0.05)
        before = spare.counts()
        raycoll.destroy_group(name)  # a rank is gone: its coordinator must not serve again
        assert spare.counts()["recycled"] == before["recycled"]
        idle = [spare._SPARES.get(n, session.current()) for n in spare._idle(session.current())]
        assert coordinator._actor_id not in [s.handle._actor_id for s in idle if s is not None]
        deadline = time.monotonic() + 60  # ended (ray.kill lands asynchronously)
        while time.monotonic() < deadline:
            try:
                ray.get(coordinator.__ray_ready__.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the failed group's coordinator is still alive a minute after destroy")
        # the other group, whose coordinator is another process, is untouched
        assert group_sums(team[:1], other) == [1.0]
    finally:
        raycoll.destroy_group(other)
        ray.kill(team[0], no_restart=True)


# A driver of its own on the test session's Ray: it forms a group (and keeps it), prints its
# coordinator's and the spare's actor ids, shuts Ray down, and waits while the test looks.
# Then it starts Ray again: a group forms with a coordinator of the new session.
_DRIVER = textwrap.dedent('''
    import json, os, sys, time
    import ray
    import raycoll
    from raycoll.coordinator import spare
    from raycoll.launch import DRIVER_GROUPS, RankWorker
    from raycoll.session import current

    address, mark, go = sys.argv[1], sys.argv[2], sys.argv[3]
    ray.init(address=address, log_to_driver=False)
    W = ray.remote(num_cpus=0)(RankWorker)
    actors = [W.remote() for _ in range(2)]
    raycoll.create_group(actors, group_name="kept", timeout=120)
    ids = {"coordinator": DRIVER_GROUPS.get("kept", current()).spec.coordinator._actor_id.hex(),
           "spare": spare.pending().handle._actor_id.hex()}
    ray.shutdown()
    with open(mark, "w") as f:
        json.dump(ids, f)
    deadline = time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)
    ray.init(address=address, log_to_driver=False)
    assert spare.pending() is None, "a spare of the ended session is still recorded"
    before = spare.counts()
    actors = [W.remote() for _ in range(2)]
    raycoll.create_group(actors, group_name="kept", timeout=120)
    print("RESULT " + json.dumps({"before": before, "after": spare.counts()}))
    raycoll.destroy_group("kept")
    ray.shutdown()
''')


def _state(actor_id: str) -> str:
    import ray._private.state  # GCS's actor table: the state API needs the dashboard

    return str(ray._private.state.actors().get(actor_id, {}).get("State"))


@pytest.mark.timeout(180)
def test_a_spare_coordinator_ends_with_its_driver_session_and_is_never_reused(
        ray_local, tmp_path: Path):
    address = ray.get_runtime_context().gcs_address
    script, mark, go = tmp_path / "driver.py", tmp_path / "ids.json", tmp_path / "go"
    script.write_text(_DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), address, str(mark), str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, RAY_ADDRESS=address))
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mark.exists(), f"the driver did not get to ray.shutdown(): {proc.stderr.read()}"
        time.sleep(0.2)
        ids = json.loads(mark.read_text())
        # the driver process lives on: ray.shutdown() alone ended its coordinators
        deadline = time.monotonic() + 30
        while {_state(i) for i in ids.values()} != {"DEAD"} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None
        assert {k: _state(i) for k, i in ids.items()} == {"coordinator": "DEAD", "spare": "DEAD"}
        go.touch()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, f"driver failed:\n{stdout}\n{stderr[-3000:]}"
    out = json.loads([ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    # the new session's first group started its own coordinator (and the next one ahead)
    assert out["after"] == dict(out["before"], started=out["before"]["started"] + 2)
