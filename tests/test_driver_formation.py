"""Root groups formed by their driver (raycoll/formation.py): the roster gathered by the driver
(rank infos kept per actor), the ranks' leases taken and handed to the coordinator by each
rank's lease thread, a restarted actor's stale info, actors that can never be scheduled."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import ray

import raycoll
from helpers import group_sums, join_by_name, leave_by_name
from raycoll import errors, formation, session
from raycoll.launch import DRIVER_GROUPS, RankWorker


def _name() -> str:
    return f"df-{uuid.uuid4().hex[:6]}"


def _pid(rank: int) -> int:
    return os.getpid()


def _barrier_error(rank: int, name: str) -> str:
    try:
        raycoll.barrier(group=name)
        return "returned"
    except errors.RaycollError as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.timeout(120)
def test_a_rank_killed_after_a_driver_formed_group_fails_its_peer_at_once(ray_local):
    """The lease each rank takes as its install returns, handed to the coordinator by the
    rank's lease thread (lease, watch), is watched: the coordinator holds both ranks'
    leases, and the survivor's barrier fails with RankFailedError naming the dead rank, long before the group's 60 s
    timeout."""
    pair = [ray.remote(RankWorker).options(num_cpus=0).remote() for _ in range(2)]
    name = _name()
    raycoll.create_group(pair, group_name=name, timeout=60)
    assert group_sums(pair, name) == [3.0, 3.0]
    coordinator = DRIVER_GROUPS.get(name, session.current()).spec.coordinator
    deadline = time.monotonic() + 30
    while True:  # the ranks' lease and watch calls reach the coordinator (not waited for)
        sizes = ray.get(coordinator.state_sizes.remote(), timeout=30)[1]
        if sizes["lease_watchers"] == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (sizes["leases"], sizes["lease_watchers"]) == (2, 2), sizes
    ray.kill(pair[1], no_restart=True)
    start = time.monotonic()
    outcome = ray.get(pair[0].run.remote(_barrier_error, 0, (name,), {}), timeout=90)
    assert outcome.startswith("RankFailedError"), outcome
    assert "rank 1" in outcome, outcome
    assert time.monotonic() - start < 45  # the death is reported, not the timeout waited out
    raycoll.destroy_group(name)
    ray.kill(pair[0], no_restart=True)


@pytest.mark.timeout(180)
def test_an_actor_restarted_by_ray_forms_its_next_group_with_fresh_info(ray_local):
    """The driver keeps each actor's info; Ray restarting the actor (a new process, another
    listener) makes the kept copy stale: the rank refuses it, and the formation is done
    again with fresh infos, transparently."""
    actors = [ray.remote(RankWorker).options(num_cpus=0, max_restarts=1).remote()
              for _ in range(2)]
    try:
        first = _name()
        raycoll.create_group(actors, group_name=first, timeout=60)
        assert group_sums(actors, first) == [3.0, 3.0]
        raycoll.destroy_group(first)
        old = ray.get(actors[1].run.remote(_pid, 1, (), {}), timeout=60)
        ray.kill(actors[1], no_restart=False)  # Ray restarts it: a new process
        deadline = time.monotonic() + 60
        new = old
        while new == old:  # (the kill lands a moment later; then Ray restarts the actor)
            assert time.monotonic() < deadline, "the actor was not restarted"
            try:
                new = ray.get(actors[1].run.remote(_pid, 1, (), {}), timeout=60)
            except ray.exceptions.RayActorError:
                time.sleep(0.5)
        second = _name()
        raycoll.create_group(actors, group_name=second, timeout=60)
        assert group_sums(actors, second) == [3.0, 3.0]
        raycoll.destroy_group(second)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)


@pytest.mark.timeout(120)
def test_create_groups_over_actors_that_can_never_be_scheduled_fails_clearly(ray_local):
    """An actor asking for more CPUs than any node has never starts: create_groups says so
    after its first second of waiting, names the rank, keeps no group, and does not wait
    out its timeout."""
    ok = ray.remote(RankWorker).options(num_cpus=0).remote()
    never = ray.remote(RankWorker).options(num_cpus=64).remote()
    names = [_name(), _name()]
    start = time.monotonic()
    try:
        with pytest.raises(ValueError, match=r"ranks \[1\] can never be scheduled") as info:
            raycoll.create_groups([ok, never], names, timeout=100)
        assert "CPU" in str(info.value)
        assert time.monotonic() - start < 60  # not the 100 s timeout
        assert [DRIVER_GROUPS.get(n, session.current()) for n in names] == [None, None]
        raycoll.create_group([ok], group_name=names[0])  # the names were freed
        raycoll.destroy_group(names[0])
    finally:
        ray.kill(ok, no_restart=True)
        ray.kill(never, no_restart=True)


@pytest.mark.timeout(120)
def test_a_coordinator_refuses_a_roster_while_it_serves_a_group(rank_actors):
    """Coordinator.form takes a roster only as a coordinator serving no group, at the
    generation its driver was told: a second roster for a formed group is refused."""
    pair = rank_actors[:2]
    name = _name()
    raycoll.create_group(pair, group_name=name, timeout=60)
    try:
        entry = DRIVER_GROUPS.get(name, session.current())
        assert entry is not None and entry.coordinator is not None
        roster = [{"rank": 0, "actor": None}, {"rank": 1, "actor": None}]
        answer = ray.get(entry.spec.coordinator.form.remote(
            "another", roster, b"0" * 16, entry.coordinator.generation), timeout=30)
        assert answer[0] != "ok" and "cannot form group 'another'" in str(answer), answer
        assert group_sums(pair, name) == [3.0, 3.0]  # the group it serves is untouched
    finally:
        raycoll.destroy_group(name)


def test_the_driver_forgets_an_actor_s_kept_info_when_asked(rank_actors):
    name = _name()
    raycoll.create_group(rank_actors[:1], group_name=name, timeout=60)
    raycoll.destroy_group(name)
    key = (session.current(), rank_actors[0]._actor_id.binary())
    assert key in formation._INFOS
    formation.forget(rank_actors[:1])
    assert key not in formation._INFOS


@pytest.mark.timeout(120)
def test_a_name_its_ranks_formed_by_name_is_refused_and_their_group_kept(ray_local):
    """The driver records a group's name while the ranks install it: a name the same actors
    formed by name (init_process_group) is refused with ValueError, and undoing the
    formation leaves the actors' own group of that name working (only the group installed
    with the formation's coordinator is removed); the actors then form other groups."""
    pair = [ray.remote(RankWorker).options(num_cpus=0).remote() for _ in range(2)]
    name = _name()
    try:
        ray.get([a.run.remote(join_by_name, r, (name,), {}) for r, a in enumerate(pair)],
                timeout=90)
        with pytest.raises(ValueError, match=f"group '{name}' already exists in this job"):
            raycoll.create_group(pair, group_name=name, timeout=60)
        assert DRIVER_GROUPS.get(name, session.current()) is None
        assert group_sums(pair, name) == [3.0, 3.0]  # the by-name group is untouched
        other = _name()
        raycoll.create_group(pair, group_name=other, timeout=60)
        assert group_sums(pair, other) == [3.0, 3.0]
        raycoll.destroy_group(other)
        ray.get([a.run.remote(leave_by_name, r, (name,), {}) for r, a in enumerate(pair)],
                timeout=60)
    finally:
        for actor in pair:
            ray.kill(actor, no_restart=True)
