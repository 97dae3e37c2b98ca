"""Group management as torch.distributed 2.13 has it: torchrun's environment under ``spawn``,
backend queries, backend names, arguments raycoll cannot honour, subgroup helpers."""

from __future__ import annotations

import os
from typing import Any, Dict

import numpy as np
import pytest

import raycoll


# ---------------------------------------------------------------------- torchrun's environment
def _env(rank: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {k: os.environ.get(k) for k in raycoll.launch.TORCHRUN_ENV}
    out["node_local_rank"] = raycoll.get_node_local_rank()
    out["file"] = raycoll.__file__
    return out


@pytest.mark.timeout(120)
def test_spawn_sets_torchruns_environment_before_fn(ray_local):
    got = raycoll.spawn(_env, 3, actor_options={"num_cpus": 0})
    port = got[0]["MASTER_PORT"]
    assert port is not None and 0 < int(port) < 65536
    for rank, env in enumerate(got):
        assert env["file"] == raycoll.__file__  # the code under test, in the ranks too
        assert env == dict(env, RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK=str(rank),
                           LOCAL_WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                           node_local_rank=rank)


def _torch_env_rendezvous(rank: int, backend: str, init_barrier: bool) -> Any:
    import datetime

    import torch
    import torch.distributed as dist

    os.environ["TORCH_DIST_INIT_BARRIER"] = "1" if init_barrier else "0"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))  # env://
    try:
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t)
        store = dist.distributed_c10d._get_default_store()
        # torch's store is the raycoll group's: what torch sets (under torch's prefixes),
        # raycoll.get_store() sees
        store.set(f"from-torch-{rank}", str(rank))
        raycoll.barrier()
        seen = sorted(k.rpartition("/")[2] for k in raycoll.get_store().list_keys()
                      if k.endswith(tuple(f"from-torch-{r}" for r in range(2))))
        kind = type(store._underlying_non_prefix_store).__name__
        return dist.get_rank(), dist.get_world_size(), t.tolist(), kind, seen
    finally:
        dist.destroy_process_group()


@pytest.mark.torch
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend,init_barrier",
                         [("gloo", False), ("raycoll", False), ("raycoll", True)])
def test_torch_env_rendezvous_works_under_spawn(ray_local, backend, init_barrier):
    got = raycoll.spawn(_torch_env_rendezvous, 2, args=(backend, init_barrier),
                        actor_options={"num_cpus": 0})
    # gloo exchanges its addresses through torch's store, and torch's store-based barrier
    # counts the ranks there: both on the raycoll group's store (no TCPStore, no port)
    seen = ["from-torch-0", "from-torch-1"]
    assert got == [(0, 2, [3.0, 3.0], "RaycollStore", seen),
                   (1, 2, [3.0, 3.0], "RaycollStore", seen)]


def _init_barrier_without_master(rank: int) -> Any:
    import torch
    import torch.distributed as dist

    del os.environ["MASTER_ADDR"]  # raycoll:// then, as env:// without torchrun's variables
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
    dist.init_process_group("raycoll")
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        return t.tolist()
    finally:
        dist.destroy_process_group()


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_store_based_barrier_meets_on_the_raycoll_groups_store(ray_local):
    got = raycoll.spawn(_init_barrier_without_master, 2, actor_options={"num_cpus": 0})
    assert got == [[2.0, 2.0], [2.0, 2.0]]


@pytest.mark.timeout(10)
def test_get_node_local_rank_reads_local_rank(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert raycoll.get_node_local_rank(fallback_rank=3) == 3
    with pytest.raises(RuntimeError, match="LOCAL_RANK is not in the environment"):
        raycoll.get_node_local_rank()
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert raycoll.get_node_local_rank(fallback_rank=5) == 2


# ---------------------------------------------------------------------- backend queries, WORLD
def _queries(rank: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {"available": raycoll.is_available()}
    world = raycoll.group.WORLD
    out["world_is_default"] = (world is raycoll.GroupMember.WORLD
                               and isinstance(world, raycoll.ProcessGroup)
                               and world.size() == raycoll.get_world_size())
    cuda = "nccl" if raycoll.is_nccl_available() else "objstore"
    out["backend"] = raycoll.get_backend(), raycoll.get_backend(world)
    out["config_ok"] = raycoll.get_backend_config() == f"cpu:objstore,cuda:{cuda}"
    sub = raycoll.new_group([0], backend="CPU:objstore")
    inherits = raycoll.new_group([0, 1])
    if rank == 0:
        out["sub"] = raycoll.get_backend(sub), raycoll.get_backend_config(sub)
        out["inherits"] = raycoll.get_backend(inherits)
    else:
        try:
            raycoll.get_backend(sub)
        except ValueError as exc:
            out["nonmember"] = str(exc)
        try:
            raycoll.get_backend_config(sub)
        except ValueError as exc:
            out["nonmember_config"] = str(exc)
    x = np.ones(2)
    raycoll.all_reduce(x, group=raycoll.group.WORLD)
    out["sum"] = x.tolist()
    return out


@pytest.mark.timeout(120)
def test_backend_queries_and_group_world(ranks):
    assert raycoll.group.WORLD is None and raycoll.GroupMember.WORLD is None  # the driver
    first, second = ranks.run(_queries, 2)
    for got in (first, second):
        assert got["available"] is True and got["world_is_default"] and got["config_ok"], got
        assert got["backend"] == ("undefined", "undefined")
        assert got["sum"] == [2.0, 2.0]
    assert first["sub"] == ("cpu:objstore", "cpu:objstore")
    assert first["inherits"] == "undefined"
    assert second["nonmember"] == second["nonmember_config"] == "Invalid process group specified"


# ---------------------------------------------------------------------- backend names, twice
def _gloo_names(rank: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {"world": (raycoll.get_backend(), raycoll.get_backend_config())}
    x = np.full(3, rank + 1.0)
    raycoll.all_reduce(x)
    out["sum"] = x.tolist()
    mixed = raycoll.new_group([0, 1], backend="cpu:gloo,cuda:nccl")
    out["mixed"] = (raycoll.get_backend(mixed), raycoll.get_backend_config(mixed))
    y = np.full(2, rank + 1.0)
    raycoll.all_reduce(y, group=mixed)
    out["mixed_sum"] = y.tolist()
    gpu_only = raycoll.new_group([0, 1], backend="nccl")
    out["nccl"] = raycoll.get_backend_config(gpu_only)
    try:  # as torch's nccl: CPU tensors are refused, on every rank
        raycoll.all_reduce(np.ones(2), group=gpu_only)
    except RuntimeError as exc:
        out["nccl_cpu"] = [type(exc).__name__, str(exc)]
    try:
        raycoll.init_process_group("gloo", world_size=2, rank=rank)
    except ValueError as exc:
        out["twice"] = str(exc)
    z = np.ones(1)
    raycoll.all_reduce(z)  # the default group is untouched
    out["after"] = z.tolist()
    return out


@pytest.mark.timeout(120)
def test_gloo_names_raycolls_cpu_path_and_a_second_init_raises(ranks):
    for got in ranks.run(_gloo_names, 2, backend="GLOO"):
        assert got["world"] == ("gloo", "cpu:objstore,cuda:objstore")
        assert got["sum"] == [3.0] * 3
        assert got["mixed"] == ("cpu:gloo,cuda:nccl", "cpu:objstore,cuda:nccl")
        assert got["mixed_sum"] == [3.0, 3.0]
        assert got["nccl"] == "cuda:nccl"
        assert got["nccl_cpu"][0] == "BackendUnavailableError" and "'cpu'" in got["nccl_cpu"][1]
        assert got["twice"].startswith("trying to initialize the default process group twice!")
        assert got["after"] == [2.0]


def _by_name(rank: int, name: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    raycoll.init_process_group("cpu:gloo", world_size=2, rank=rank, group_name=name, timeout=60)
    out["backend"] = raycoll.get_backend(), raycoll.get_backend_config()
    for label, kwargs in (("same_name", {"group_name": name}), ("no_name", {})):
        try:
            raycoll.init_process_group("gloo", world_size=2, rank=rank, timeout=5, **kwargs)
        except ValueError as exc:
            out[label] = str(exc)
    x = np.ones(2)
    raycoll.all_reduce(x)
    out["sum"] = x.tolist()
    raycoll.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_init_process_group_by_name_with_gloo_then_twice(rank_actors):
    import uuid

    import ray

    name = f"gloo-{uuid.uuid4().hex[:6]}"
    got = ray.get([a.run.remote(_by_name, r, (name,), {}) for r, a in enumerate(rank_actors[:2])],
                  timeout=90)
    for out in got:
        assert out["backend"] == ("cpu:gloo", "cpu:objstore")
        assert out["sum"] == [2.0, 2.0]
        for label in ("same_name", "no_name"):
            assert out[label].startswith("trying to initialize the default process group twice!")
            assert name in out[label]


@pytest.mark.timeout(10)
def test_the_gloo_alias_is_logged_once_and_bad_strings_name_what_was_given(caplog, monkeypatch):
    import importlib
    import logging

    backends_module = importlib.import_module("raycoll.backends")
    monkeypatch.setattr(backends_module, "_gloo_logged", False)
    with caplog.at_level(logging.INFO, logger="raycoll"):
        assert backends_module.backend_config("gloo").get_device_backend_map() == \
            {"cpu": "objstore", "cuda": "objstore"}
        assert backends_module.backend_config("cpu:gloo,cuda:nccl").get_device_backend_map() == \
            {"cpu": "objstore", "cuda": "nccl"}
    logged = [r.getMessage() for r in caplog.records if "gloo" in r.getMessage()]
    assert len(logged) == 1 and "objstore" in logged[0], logged
    with pytest.raises(ValueError, match="backend='cpu:gloo,cpu:nccl'.*given twice"):
        backends_module.backend_config("cpu:gloo,cpu:nccl")
    # torch's Backend.GLOO names it too
    assert raycoll.Backend.GLOO == raycoll.Backend("GLOO") == "gloo"
    assert backends_module.backend_config(raycoll.Backend.GLOO).get_device_backend_map()["cpu"] == \
        "objstore"
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        raycoll.Backend("mpi")


# ---------------------------------------------------------------------- arguments, honoured or refused
def _arguments(rank: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}

    def error(fn: Any) -> Any:
        try:
            fn()
        except (ValueError, TypeError) as exc:
            return [type(exc).__name__, str(exc)]
        return None

    out["init_pg_options"] = error(lambda: raycoll.init_process_group(
        world_size=2, rank=rank, group_name="other", pg_options=object()))
    out["init_device"] = error(lambda: raycoll.init_process_group(
        world_size=2, rank=rank, group_name="other", device_id=1))
    out["new_pg_options"] = error(lambda: raycoll.new_group([0, 1], pg_options={"x": 1}))
    out["subgroups_pg_options"] = error(lambda: raycoll.new_subgroups(1, pg_options=object()))
    out["no_index"] = error(lambda: raycoll.new_group([0, 1], device_id="cuda"))
    out["gpu"] = error(lambda: raycoll.new_group([0, 1], device_id="cuda:0"))
    cpu = raycoll.new_group([0, 1], device_id="cpu", group_desc="tp")
    out["desc"] = cpu.group_desc, raycoll.group.WORLD.group_desc
    # local synchronization: each rank asks only for its own group; non-members get None
    local = raycoll.new_group([rank], use_local_synchronization=True)
    other = raycoll.new_group([1 - rank], use_local_synchronization=True)
    out["local"] = (raycoll.get_process_group_ranks(local), other)
    # sort_ranks=False: the order given is the group-rank order
    reverse = raycoll.new_group([1, 0], sort_ranks=False)
    out["reverse"] = raycoll.get_process_group_ranks(reverse), raycoll.get_rank(reverse)
    b = np.full(1, float(rank))
    raycoll.broadcast(b, group_src=0, group=reverse)
    out["reverse_bcast"] = b.tolist()
    _, subs = raycoll.new_subgroups(1, group_desc="solo")
    out["sub_desc"] = [s.group_desc for s in subs if isinstance(s, raycoll.ProcessGroup)]
    x = np.ones(2)
    raycoll.all_reduce(x, group=cpu)
    out["sum"] = x.tolist()
    return out


@pytest.mark.timeout(120)
def test_arguments_raycoll_cannot_honour_raise_the_others_are_honoured(ranks):
    for rank, got in enumerate(ranks.run(_arguments, 2)):
        for key in ("init_pg_options", "new_pg_options", "subgroups_pg_options"):
            assert got[key][0] == "ValueError" and "pg_options" in got[key][1], got[key]
        assert got["init_device"][0] == "ValueError" and "device_id=1" in got["init_device"][1]
        assert "no GPU" in got["init_device"][1] and "num_gpus" in got["init_device"][1]
        assert "with index" in got["no_index"][1]
        assert got["gpu"][0] == "ValueError" and "cannot be honoured" in got["gpu"][1]
        assert got["desc"] == ("tp", "default_pg")
        assert got["local"] == ([rank], None)
        assert got["reverse"] == ([1, 0], 1 - rank)
        assert got["reverse_bcast"] == [1.0]
        assert got["sub_desc"] == ["solo"]
        assert got["sum"] == [2.0, 2.0]


# ---------------------------------------------------------------------- subgroup helpers
def _enumerate_and_split(rank: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}

    def error(fn: Any) -> Any:
        try:
            fn()
        except ValueError as exc:
            return str(exc)
        return None

    cur, subs = raycoll.new_subgroups_by_enumeration([[0, 2], [1]], group_desc="enum")
    out["enum"] = (None if cur is None else raycoll.get_process_group_ranks(cur),
                   [s is raycoll.GroupMember.NON_GROUP_MEMBER for s in subs],
                   None if cur is None else cur.group_desc)
    if cur is not None:
        x = np.full(1, float(rank))
        raycoll.all_reduce(x, group=cur)
        out["enum_sum"] = x.tolist()
    out["enum_empty"] = error(lambda: raycoll.new_subgroups_by_enumeration([]))
    out["enum_overlap"] = error(lambda: raycoll.new_subgroups_by_enumeration([[0, 1], [1, 2]]))
    # split_group: group ranks of the parent; here the parent is ranks [1, 2, 0] (sort_ranks=False)
    parent = raycoll.new_group([1, 2, 0], sort_ranks=False)
    child = raycoll.split_group(parent, [[2, 0]], backend="cpu:objstore")
    out["split"] = None if child is None else (raycoll.get_process_group_ranks(child),
                                                raycoll.get_backend(child))
    if child is not None:
        y = np.full(1, float(rank + 1))
        raycoll.all_reduce(y, group=child)
        out["split_sum"] = y.tolist()
    whole = raycoll.split_group(split_ranks=[[0], [1, 2]])
    out["whole"] = raycoll.get_process_group_ranks(whole)
    out["split_empty"] = error(lambda: raycoll.split_group(split_ranks=[]))
    out["split_dup"] = error(lambda: raycoll.split_group(split_ranks=[[0, 0]]))
    out["split_overlap"] = error(lambda: raycoll.split_group(split_ranks=[[0, 1], [1]]))
    out["split_range"] = error(lambda: raycoll.split_group(split_ranks=[[0, 3]]))
    cpu_only = raycoll.new_group(backend="cpu:gloo")
    out["split_backend"] = error(lambda: raycoll.split_group(cpu_only, [[0]],
                                                             backend="cuda:objstore"))
    out["sizes"] = [error(lambda k=k: raycoll.new_subgroups(k)) for k in (0, 4, 2)]
    z = np.ones(1)
    raycoll.all_reduce(z)
    out["after"] = z.tolist()
    return out


@pytest.mark.timeout(120)
def test_new_subgroups_by_enumeration_and_split_group(ranks):
    got = ranks.run(_enumerate_and_split, 3)
    assert [g["enum"] for g in got] == [([0, 2], [False, True], "enum"),
                                        ([1], [True, False], "enum"),
                                        ([0, 2], [False, True], "enum")]
    assert [g["enum_sum"] for g in got] == [[2.0], [1.0], [2.0]]
    # parent group ranks 2, 0 are global ranks 0, 1; sorted: [2, 0] -> group ranks [0, 2]
    assert [g["split"] for g in got] == [([1, 0], "cpu:objstore"), ([1, 0], "cpu:objstore"), None]
    assert [g.get("split_sum") for g in got] == [[3.0], [3.0], None]
    assert [g["whole"] for g in got] == [[0], [1, 2], [1, 2]]
    for g in got:
        assert g["enum_empty"] == "The arg 'ranks_per_subgroup_list' cannot be empty"
        assert g["enum_overlap"] == "Rank 1 has appeared in both subgroup [0, 1] and [1, 2]"
        assert g["split_empty"] == "split_ranks cannot be None or empty"
        assert g["split_dup"] == "the split group cannot have duplicate ranks"
        assert "must not overlap" in g["split_overlap"]
        assert "not a group rank" in g["split_range"]
        assert g["split_backend"].startswith("Requested backend for device 'cuda' is not present")
        assert g["sizes"] == ["The arg 'group_size' (0) must be positive",
                              "The arg 'group_size' (4) must not exceed the world size (3)",
                              "The world size (3) must be divisible by 'group_size=2'"]
        assert g["after"] == [3.0]
