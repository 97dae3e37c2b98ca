"""A group name formed again over other processes while its previous ranks are on their way
out, as Ray's tests and notebooks do (Ray's gloo group forms afresh under a name at each
``init_collective_group``): through Ray's module with ``backend="raycoll"``, through the
drop-in and through raycoll's own ``init_process_group``, the new ranks take over the names
of the ones let go (killed, or out of scope, never destroyed) instead of being refused as
"joined twice"; a previous rank still alive holds its name until it destroys the group (the
new ranks wait for it); and a rank of a group still forming is still refused when another
live process holds it."""

from __future__ import annotations

import importlib
import time
from datetime import timedelta
import uuid
from typing import Any, List, Sequence

import numpy as np
import pytest
import ray

import raycoll

RAY = "ray.util.collective"
DROPIN = "raycoll.util.collective"
ROUTES = [(RAY, "raycoll"), (DROPIN, "gloo"), ("raycoll", "objstore")]
IDS = ["ray-module", "drop-in", "raycoll"]


@ray.remote(num_cpus=0)
class Member:
    """A user's actor: it joins a group by name and sums over it."""

    def form_and_sum(self, lib: str, backend: str, world_size: int, rank: int,
                     name: str, timeout_s: float = 120.0) -> List[float]:
        import raycoll  # noqa: F401 - registers backend "raycoll" in Ray's module

        x = np.full(2, rank + 1.0)
        if lib == "raycoll":
            raycoll.init_process_group(backend, world_size=world_size, rank=rank,
                                       group_name=name, timeout=timedelta(seconds=timeout_s))
            raycoll.all_reduce(x, group=name)
        else:
            col = importlib.import_module(lib)
            col.init_collective_group(world_size, rank, backend=backend, group_name=name)
            col.allreduce(x, group_name=name)
        return x.tolist()

    def destroy(self, lib: str, name: str) -> bool:
        if lib == "raycoll":
            raycoll.destroy_process_group(name)
        else:
            importlib.import_module(lib).destroy_collective_group(name)
        return True


def _form(actors: Sequence[Any], lib: str, backend: str, name: str) -> List[Any]:
    return [a.form_and_sum.remote(lib, backend, len(actors), r, name)
            for r, a in enumerate(actors)]


def _sum(world_size: int) -> List[List[float]]:
    total = float(sum(range(1, world_size + 1)))
    return [[total, total]] * world_size


@pytest.mark.torch  # Ray's module imports torch
@pytest.mark.timeout(180)
@pytest.mark.parametrize("lib,backend", ROUTES, ids=IDS)
def test_a_name_formed_again_takes_over_from_ranks_let_go(ray_local, lib, backend):
    name = f"again-{uuid.uuid4().hex[:6]}"
    old = [Member.remote() for _ in range(2)]
    assert ray.get(_form(old, lib, backend, name), timeout=120) == _sum(2)
    new = [Member.remote() for _ in range(2)]
    ray.get([a.__ray_ready__.remote() for a in new], timeout=60)
    # the old ranks go as a finished test's actors go: one killed, one out of scope, neither
    # destroying the group; the new ones form it at once, while the old are still dying
    ray.kill(old[0], no_restart=True)
    del old
    assert ray.get(_form(new, lib, backend, name), timeout=120) == _sum(2)
    # and once more over the same actors, after they destroyed it
    ray.get([a.destroy.remote(lib, name) for a in new], timeout=60)
    assert ray.get(_form(new, lib, backend, name), timeout=120) == _sum(2)
    ray.get([a.destroy.remote(lib, name) for a in new], timeout=60)
    for actor in new:
        ray.kill(actor, no_restart=True)


@pytest.mark.torch
@pytest.mark.timeout(180)
@pytest.mark.parametrize("lib,backend", ROUTES[1:], ids=IDS[1:])
def test_a_live_previous_rank_holds_its_name_until_it_destroys_the_group(ray_local, lib,
                                                                         backend):
    name = f"held-{uuid.uuid4().hex[:6]}"
    old = [Member.remote() for _ in range(2)]
    assert ray.get(_form(old, lib, backend, name), timeout=120) == _sum(2)
    new = [Member.remote() for _ in range(2)]
    pending = _form(new, lib, backend, name)
    ready, _ = ray.wait(pending, num_returns=2, timeout=3)
    assert ready == []  # neither refused nor formed: rank 0 and 1 are held by live actors
    ray.get([a.destroy.remote(lib, name) for a in old], timeout=60)
    assert ray.get(pending, timeout=120) == _sum(2)
    ray.get([a.destroy.remote(lib, name) for a in new], timeout=60)
    for actor in old + new:
        ray.kill(actor, no_restart=True)


@pytest.mark.timeout(120)
def test_a_rank_of_a_forming_group_held_by_a_live_process_is_still_refused(ray_local):
    name = f"dup-{uuid.uuid4().hex[:6]}"
    pair = [Member.remote(), Member.remote()]
    ray.get([a.__ray_ready__.remote() for a in pair], timeout=60)
    # both as rank 0 of 3 (rank 1 and 2 never come: the group stays forming)
    refs = [a.form_and_sum.remote("raycoll", "objstore", 3, 0, name, 15.0) for a in pair]
    ready, waiting = ray.wait(refs, timeout=60)
    with pytest.raises(ray.exceptions.RayTaskError, match=r"forming\) twice.*live process"):
        ray.get(ready[0])  # the second to arrive, at once
    with pytest.raises(ray.exceptions.RayTaskError, match=r"ranks \[1, 2\] never joined"):
        ray.get(waiting[0], timeout=60)  # the first holds rank 0 until its own timeout
    for actor in pair:
        ray.kill(actor, no_restart=True)


def _coordinator_id(name: str) -> Any:
    """The Ray actor id of the by-name coordinator of group ``name`` (None: there is none)."""
    from raycoll.coordinator.logic import coordinator_name

    try:
        actor = ray.get_actor(coordinator_name(ray.get_runtime_context().get_job_id(), name))
    except ValueError:
        return None
    return actor._actor_id


@pytest.mark.timeout(180)
def test_a_name_formed_again_in_actors_reuses_its_coordinator_then_it_stops(ray_local):
    from raycoll.coordinator.actor import LINGER_S

    name = f"linger-{uuid.uuid4().hex[:6]}"
    team = [Member.remote() for _ in range(3)]
    assert ray.get(_form(team[:2], "raycoll", "objstore", name), timeout=120) == _sum(2)
    first = _coordinator_id(name)
    assert first is not None
    ray.get([a.destroy.remote("raycoll", name) for a in team[:2]], timeout=60)
    # formed again at once, with another world size: the same coordinator serves it
    assert ray.get(_form(team, "raycoll", "objstore", name), timeout=120) == _sum(3)
    assert _coordinator_id(name) == first
    ray.get([a.destroy.remote("raycoll", name) for a in team], timeout=60)
    # idle, it stops itself LINGER_S after its ranks left (it is detached: nothing else would)
    deadline = time.monotonic() + LINGER_S + 45
    while _coordinator_id(name) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _coordinator_id(name) is None
    for actor in team:
        ray.kill(actor, no_restart=True)
