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


def _torch_env_rendezvous(rank: int, backend: str) -> Any:
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))  # env://
    try:
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t)
        return dist.get_rank(), dist.get_world_size(), t.tolist()
    finally:
        dist.destroy_process_group()


@pytest.mark.torch
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["gloo", "raycoll"])
def test_torch_env_rendezvous_works_under_spawn(ray_local, backend):
    got = raycoll.spawn(_torch_env_rendezvous, 2, args=(backend,), actor_options={"num_cpus": 0})
    assert got == [(0, 2, [3.0, 3.0]), (1, 2, [3.0, 3.0])]


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
