"""Several root groups formed at once over the same actors (``raycoll.create_groups``): each
group works and fails on its own, with a coordinator of its own hosted in one process
(:mod:`raycoll.coordinator.hosting`); all or none form."""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from typing import Any, Iterator, List

import numpy as np
import pytest
import ray

import raycoll
from raycoll import errors, session
from raycoll.coordinator import spare
from raycoll.coordinator.hosting import Hosted
from raycoll.launch import DRIVER_GROUPS, RankWorker, _abort

from helpers import rank_actors


def _sum(rank: int, name: str, scale: float) -> float:
    x = np.full(3, (rank + 1.0) * scale)
    raycoll.all_reduce(x, group=name)
    return float(x[0])


def _sums(actors: List[Any], name: str, scale: float = 1.0) -> List[float]:
    return ray.get([a.run.remote(_sum, r, (name, scale), {}) for r, a in enumerate(actors)],
                   timeout=60)


def _names(count: int) -> List[str]:
    return [f"bk{i}-{uuid.uuid4().hex[:6]}" for i in range(count)]


@contextmanager
def _groups(actors: List[Any], count: int) -> Iterator[List[str]]:
    """``count`` groups formed over ``actors`` in one ``create_groups`` call, destroyed after."""
    names = _names(count)
    raycoll.create_groups(actors, names, timeout=60)
    try:
        yield names
    finally:
        for name in names:
            raycoll.destroy_group(name)


@pytest.fixture()
def team(ray_local):
    """Three zero-CPU sync actors (one method at a time: one join call each takes them all)."""
    with rank_actors(3) as actors:
        yield actors


@pytest.mark.timeout(120)
def test_groups_formed_at_once_each_work_with_a_coordinator_of_their_own(team):
    with _groups(team, 3) as names:
        coordinators = [DRIVER_GROUPS.get(n, session.current()).spec.coordinator for n in names]
        assert all(isinstance(c, Hosted) for c in coordinators)
        assert len({c.host._actor_id for c in coordinators}) == 1, "one process hosts them"
        assert sorted(c.index for c in coordinators) == [1, 2, 3], "a coordinator each"
        for i, name in enumerate(names):  # each group reduces its own values
            assert _sums(team, name, scale=i + 1.0) == [6.0 * (i + 1)] * 3
        raycoll.destroy_group(names[0])  # one destroyed: the others go on, its name reforms
        assert _sums(team, names[1]) == [6.0] * 3
        raycoll.create_group(team[:2], group_name=names[0])
        assert _sums(team[:2], names[0]) == [3.0, 3.0]


@pytest.mark.timeout(120)
def test_one_group_s_failure_does_not_touch_the_others(team):
    with _groups(team, 2) as names:
        _abort(names[0], "the test aborts it")
        with pytest.raises(errors.RaycollError):
            _sums(team, names[0])
        assert _sums(team, names[1], scale=2.0) == [12.0] * 3


@pytest.mark.timeout(120)
def test_all_or_none_a_taken_name_keeps_no_group(team):
    taken, *fresh = _names(3)
    raycoll.create_group(team[:1], group_name=taken)
    try:
        with pytest.raises(ValueError, match=taken):
            raycoll.create_groups(team, fresh + [taken], timeout=60)
        assert [DRIVER_GROUPS.get(n, session.current()) for n in fresh] == [None, None]
        raycoll.create_groups(team, fresh, timeout=60)  # the names were freed
        assert _sums(team, fresh[1]) == [6.0] * 3
    finally:
        for name in [taken] + fresh:
            try:
                raycoll.destroy_group(name)
            except errors.GroupNotFoundError:
                pass


@pytest.mark.timeout(120)
def test_a_dead_actor_fails_every_group_and_keeps_none(team):
    names = _names(2)
    ray.kill(team[2], no_restart=True)
    with pytest.raises(errors.RankFailedError) as info:
        raycoll.create_groups(team, names, timeout=30)
    assert list(info.value.failed_ranks) == [2]
    assert [DRIVER_GROUPS.get(n, session.current()) for n in names] == [None, None]


def test_bad_arguments_are_refused_before_anything_starts(team):
    with pytest.raises(ValueError, match="group_names"):
        raycoll.create_groups(team, [])
    with pytest.raises(ValueError, match="distinct"):
        raycoll.create_groups(team, ["a", "a"])
    with pytest.raises(ValueError, match="group_name"):
        raycoll.create_groups(team, ["ok", "b/c"])
    with pytest.raises(TypeError, match=r"actors\[0\]"):
        raycoll.create_groups(["x"], ["a"])


@pytest.mark.timeout(120)
def test_a_rank_that_dies_after_forming_fails_every_hosted_group(team):
    with _groups(team[:2], 2) as names:
        assert _sums(team[:2], names[0]) == [3.0, 3.0]
        ray.kill(team[1], no_restart=True)  # its one lease on the host fails: both groups hear
        for name in names:
            with pytest.raises(errors.RankFailedError) as info:
                ray.get(team[0].run.remote(_sum, 0, (name, 1.0), {}), timeout=60)
            assert list(info.value.failed_ranks) == [1]


@pytest.mark.timeout(120)
def test_the_host_goes_back_to_the_pool_with_its_last_group_only(team):
    names = _names(2)
    raycoll.create_groups(team, names, timeout=60)
    host = DRIVER_GROUPS.get(names[0], session.current()).spec.coordinator.host
    raycoll.destroy_group(names[1])  # the other group keeps its coordinator, in the host
    assert _sums(team, names[0]) == [6.0] * 3
    recycled = spare.counts()["recycled"]
    raycoll.destroy_group(names[0])
    assert spare.counts()["recycled"] == recycled + 1, "the host was not recycled"
    assert spare.pending().handle._actor_id == host._actor_id
    name = _names(1)[0]  # the recycled host serves the next group as a coordinator of its own
    raycoll.create_group(team, group_name=name)
    try:
        assert _sums(team, name, scale=3.0) == [18.0] * 3
    finally:
        raycoll.destroy_group(name)


@pytest.mark.timeout(120)
def test_a_hosted_group_is_found_by_name_and_refuses_strangers(team):
    with _groups(team[:2], 2) as names:
        status = raycoll.group_status(names[1])  # from the driver, through the name's claim
        assert status["world_size"] == 2
        job = ray.get_runtime_context().get_job_id()
        assert isinstance(spare.claimed(job, names[1]), Hosted)

        def stranger(rank: int, name: str) -> None:
            raycoll.init_process_group(world_size=2, rank=1, group_name=name, timeout=5)

        with pytest.raises(ValueError, match="twice"):
            ray.get(team[2].run.remote(stranger, 0, (names[1],), {}), timeout=60)


def _shrink_sum(rank: int, name: str, excluded: List[int]) -> List[float]:
    pg = raycoll.shrink_group(excluded, group=raycoll.get_group(name))
    x = np.full(2, pg.rank() + 1.0)
    raycoll.all_reduce(x, group=pg)
    return [float(pg.size()), float(x[0])]


def _admit(rank: int, name: str) -> int:
    return raycoll.admit_new_ranks(group=raycoll.get_group(name), timeout=60).size()


@pytest.mark.timeout(120)
def test_after_a_death_one_hosted_group_shrinks_and_grows_the_other_stays_broken(team):
    names = _names(2)
    raycoll.create_groups(team, names, timeout=60)
    extra = ray.remote(RankWorker).options(num_cpus=0).remote()
    try:
        ray.kill(team[2], no_restart=True)
        survivors = team[:2]
        shrunk = ray.get([a.run.remote(_shrink_sum, r, (names[0], [2]), {})
                          for r, a in enumerate(survivors)], timeout=60)
        assert shrunk == [[2.0, 3.0]] * 2  # a new generation of its hosted coordinator
        with pytest.raises(errors.RankFailedError):
            ray.get(survivors[0].run.remote(_sum, 0, (names[1], 1.0), {}), timeout=60)
        refs = [a.run.remote(_admit, r, (names[0],), {}) for r, a in enumerate(survivors)]
        raycoll.grow_group(names[0], [extra], timeout=60)
        assert ray.get(refs, timeout=60) == [3, 3]
        assert _sums(survivors + [extra], names[0]) == [6.0] * 3
    finally:
        for name in names:
            raycoll.destroy_group(name)
        ray.kill(extra, no_restart=True)
