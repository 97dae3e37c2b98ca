"""Group formation (driver, SPMD, inside actors), several groups, subgroups, non-members."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import ray

import raycoll


@ray.remote(num_cpus=0)
class Trainer:
    """A user's own actor class; raycoll needs nothing from it."""

    def __init__(self):
        self.x = None

    def allreduce(self, value, group=None):
        x = np.full(3, float(value))
        raycoll.all_reduce(x, group=group)
        return x.tolist()

    def info(self, group=None):
        return raycoll.get_rank(group), raycoll.get_world_size(group), raycoll.is_initialized()

    def join(self, world_size, rank, name, timeout=60):
        pg = raycoll.init_process_group("objstore", world_size=world_size, rank=rank,
                                        group_name=name, timeout=timeout)
        return pg.rank(), pg.size()

    def leave(self, group=None):
        raycoll.destroy_process_group(group)
        return raycoll.is_initialized()

    def try_allreduce(self, group):
        try:
            raycoll.all_reduce(np.ones(2), group=group)
        except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
            return type(exc).__name__, str(exc)
        return None


@pytest.fixture
def trainers(ray_local):
    actors = [Trainer.remote() for _ in range(3)]
    yield actors
    for a in actors:
        ray.kill(a)


@pytest.mark.timeout(120)
def test_create_group_from_driver_two_groups_in_one_actor(trainers):
    raycoll.create_group(trainers, group_name="dp")
    raycoll.create_group(trainers[:2][::-1], group_name="pair")  # ranks reversed
    try:
        assert ray.get([a.allreduce.remote(i + 1) for i, a in enumerate(trainers)], timeout=60) \
            == [[6.0] * 3] * 3  # group=None: the first group each actor joined
        assert ray.get([a.allreduce.remote(10 * (i + 1), "pair") for i, a in enumerate(trainers[:2])],
                       timeout=60) == [[30.0] * 3] * 2
        assert ray.get([a.info.remote("pair") for a in trainers[:2]], timeout=60) == \
            [(1, 2, True), (0, 2, True)]
        with pytest.raises(ValueError, match="already exists"):
            raycoll.create_group(trainers, group_name="dp")
    finally:
        raycoll.destroy_group("pair")
        raycoll.destroy_group("dp")
    kind, message = ray.get(trainers[0].try_allreduce.remote("dp"), timeout=60)
    assert kind == "GroupDestroyedError" and "'dp'" in message
    # the same name can be formed again, with a different membership
    raycoll.create_group(trainers[1:], group_name="dp")
    try:
        assert ray.get([a.allreduce.remote(2, "dp") for a in trainers[1:]], timeout=60) == [[4.0] * 3] * 2
    finally:
        raycoll.destroy_group("dp")


@pytest.mark.timeout(120)
def test_init_process_group_inside_actors_and_reform(trainers):
    assert ray.get([a.join.remote(3, r, "rdv") for r, a in enumerate(trainers)], timeout=90) == \
        [(0, 3), (1, 3), (2, 3)]
    assert ray.get([a.allreduce.remote(1, "rdv") for a in trainers], timeout=60) == [[3.0] * 3] * 3
    assert ray.get([a.leave.remote("rdv") for a in trainers], timeout=60) == [False] * 3
    # formed again after destroy, ranks shuffled
    assert ray.get([a.join.remote(3, 2 - r, "rdv") for r, a in enumerate(trainers)], timeout=90) == \
        [(2, 3), (1, 3), (0, 3)]
    assert ray.get([a.info.remote() for a in trainers], timeout=60) == [(2, 3, True), (1, 3, True), (0, 3, True)]
    ray.get([a.leave.remote() for a in trainers], timeout=60)


@pytest.mark.timeout(120)
def test_rendezvous_rejects_bad_ranks(trainers):
    with pytest.raises(ray.exceptions.RayTaskError, match="out of range"):
        ray.get(trainers[0].join.remote(2, 5, "bad"), timeout=60)
    # the second rank 0 is refused at once; the first, a rank 0 like any other, waits for a
    # rank 1 that never comes (its timeout: 5 s)
    refs = [trainers[0].join.remote(2, 0, "dup", 5), trainers[1].join.remote(2, 0, "dup", 5)]
    errors = 0
    for ref in refs:
        try:
            ray.get(ref, timeout=60)
        except ray.exceptions.RayTaskError as exc:
            assert "twice" in str(exc) or "never joined" in str(exc)
            errors += 1
    assert errors >= 1


def _spawned(rank, scale, *, offset=0):
    x = np.full(2, float(rank * scale + offset))
    raycoll.all_reduce(x)
    return rank, raycoll.get_world_size(), x.tolist()


@pytest.mark.timeout(120)
def test_spawn_returns_rank_ordered_results(ray_local):
    got = raycoll.spawn(_spawned, 3, args=(2,), kwargs={"offset": 1}, actor_options={"num_cpus": 0})
    assert got == [(r, 3, [9.0, 9.0]) for r in range(3)]


def _fails_on_rank_one(rank):
    if rank == 1:
        raise KeyError("boom on one")
    raycoll.barrier()  # the others would wait forever without the abort
    return rank


@pytest.mark.timeout(120)
def test_spawn_reraises_with_rank_and_releases_others(ray_local):
    with pytest.raises(raycoll.SpawnError, match="rank 1") as info:
        raycoll.spawn(_fails_on_rank_one, 3, actor_options={"num_cpus": 0}, timeout=600)
    assert info.value.rank == 1
    assert "boom on one" in str(info.value)


@pytest.mark.timeout(60)
def test_spawn_refuses_unschedulable_group(ray_local):
    with pytest.raises(ValueError, match="can never be scheduled"):
        raycoll.spawn(_spawned, 64, args=(1,))  # 64 CPUs on a 4-CPU Ray


def _subgroups(rank):
    out = {}
    evens = raycoll.new_group([0, 2])
    odds = raycoll.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    other = odds if rank % 2 == 0 else evens
    x = np.full(2, float(rank))
    raycoll.all_reduce(x, group=mine)
    out["sum"] = x.tolist()
    out["ranks"] = raycoll.get_process_group_ranks(mine)
    out["group_rank"] = raycoll.get_rank(mine)
    out["global_of_0"] = raycoll.get_global_rank(mine, 0)
    out["group_rank_of_me"] = raycoll.get_group_rank(mine, rank)
    out["nonmember"] = (other is raycoll.GroupMember.NON_GROUP_MEMBER, raycoll.get_rank(other),
                        raycoll.get_world_size(other))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["nonmember_call"] = raycoll.all_reduce(np.ones(1), group=other)
    out["warned"] = any("does not belong" in str(w.message) for w in caught)
    # broadcast inside a subgroup: src is a global rank
    b = np.full(1, float(rank))
    raycoll.broadcast(b, src=3 if rank % 2 else 2, group=mine)
    out["bcast"] = b.tolist()
    b2 = np.full(1, float(rank))
    raycoll.broadcast(b2, group_src=0, group=mine)
    out["bcast_group_src"] = b2.tolist()
    cur, all_sub = raycoll.new_subgroups(2)
    y = np.full(1, float(rank))
    raycoll.all_reduce(y, group=cur)
    out["consecutive"] = y.tolist()
    out["n_sub"] = len(all_sub)
    # concurrent use of the parent and subgroups, async
    w1 = raycoll.all_reduce(np.ones(1), group=mine, async_op=True)
    z = np.ones(1)
    raycoll.all_reduce(z)
    w1.wait(timeout=60)
    out["world"] = z.tolist()
    out["by_name"] = raycoll.get_group(mine.group_name).size()
    return out


@pytest.mark.timeout(120)
def test_new_group_and_new_subgroups(ranks):
    results = ranks.run(_subgroups, 4)
    for r, got in enumerate(results):
        evens = r % 2 == 0
        assert got["sum"] == ([2.0, 2.0] if evens else [4.0, 4.0])
        assert got["ranks"] == ([0, 2] if evens else [1, 3])
        assert got["group_rank"] == r // 2
        assert got["global_of_0"] == (0 if evens else 1)
        assert got["group_rank_of_me"] == r // 2
        assert got["nonmember"] == (True, -1, -1)
        assert got["nonmember_call"] is None and got["warned"]
        assert got["bcast"] == ([2.0] if evens else [3.0])
        assert got["bcast_group_src"] == ([0.0] if evens else [1.0])
        assert got["consecutive"] == ([1.0] if r < 2 else [5.0])
        assert got["n_sub"] == 2
        assert got["world"] == [4.0]
        assert got["by_name"] == 2


@ray.remote(num_cpus=0)
class Lonely:
    def call(self):
        try:
            raycoll.all_reduce(np.ones(1))
        except raycoll.GroupNotFoundError as exc:
            return str(exc)
        return "no error"


@pytest.mark.timeout(60)
def test_call_before_any_group_is_a_clear_error(ray_local):
    actor = Lonely.remote()
    assert "init_process_group" in ray.get(actor.call.remote(), timeout=60)
    ray.kill(actor)
