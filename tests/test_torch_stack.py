"""torch's training stack beyond DDP on the raycoll backend: functional collectives, DTensor
over a ``DeviceMesh`` of the raycoll group (and its tensor parallelism), FSDP2
``fully_shard`` and ``torch.distributed.checkpoint``. Each is checked against the same
computation in one process, DTensor and FSDP2 mixed precision also against gloo in the same
kind of ranks. Real Ray, real torch, no mocks."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import pytest

import raycoll

from helpers import TORCH_MISSING
from helpers import mse as _loss
from helpers import one_process
from helpers import torch_init as _init
from helpers import toy_data as _data
from helpers import toy_model as _model

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch", reason=TORCH_MISSING)


# ---------------------------------------------------------------------- rank-side helpers
def _full(model: Any) -> List[List[float]]:
    """Every parameter in full (an FSDP2 parameter is a DTensor: gathered)."""
    out = []
    for p in model.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(p.detach().float().reshape(-1).tolist())
    return out


def _assert_params(got: List[List[float]], want: List[List[float]], atol: float) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol)


def _spawn(fn: Any, world: int, *args: Any) -> List[Any]:
    """Fresh ranks under raycoll.spawn (torchrun's MASTER_ADDR/PORT set: gloo can start)."""
    return raycoll.spawn(fn, world, args=args, actor_options={"num_cpus": 0}, timeout=50)


# ---------------------------------------------------------------------- functional collectives
def _functional(rank: int) -> Dict[str, Any]:
    import torch
    import torch.distributed._functional_collectives as fcol
    from torch.distributed.distributed_c10d import _resolve_process_group

    dist = _init()
    try:
        world = dist.group.WORLD
        sub = dist.new_group([0, 1])
        out: Dict[str, Any] = {
            "names": [world.group_name, world.group_desc, sub.group_name != world.group_name,
                      _resolve_process_group(world.group_name) is world,
                      _resolve_process_group(sub.group_name) is sub]}
        t = torch.full((2,), float(rank + 1))
        for key, group in (("world", world), ("sub", sub)):
            out[key] = [fcol.all_reduce(t, "sum", group).tolist(),
                        fcol.all_gather_tensor(t, 0, group).tolist(),
                        fcol.reduce_scatter_tensor(torch.arange(4.0) * (rank + 1), "sum", 0,
                                                   group).tolist(),
                        fcol.all_reduce(t, "max", group.group_name).tolist()]
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_functional_collectives_find_the_raycoll_group_by_its_name(ranks):
    """torch's functional collectives name a group and find it in c10d's registry: the name
    torch set is the raycoll group's, on the default group and on a new_group."""
    results = ranks.run(_functional, 2, timeout=40)
    for rank, got in enumerate(results):
        assert got["names"] == ["0", "default_pg", True, True, True]
        for key in ("world", "sub"):
            assert got[key] == [[3.0, 3.0], [1.0, 1.0, 2.0, 2.0],
                                [[0.0, 3.0], [6.0, 9.0]][rank], [2.0, 2.0]], key


# ---------------------------------------------------------------------- DTensor
def _dtensor(rank: int, backend: str) -> Dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist = _init(backend)
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        x = torch.arange(15.0).reshape(5, 3)  # 5 rows over 2 ranks: uneven shards
        y = torch.arange(12.0).reshape(3, 4)
        d = distribute_tensor(x, mesh, [Shard(0)])
        prod = torch.mm(distribute_tensor(x, mesh, [Shard(1)]),
                        distribute_tensor(y, mesh, [Shard(0)]))  # a Partial(sum) result
        sub_mesh = DeviceMesh.from_group(dist.new_group([0, 1]), "cpu")
        s = distribute_tensor(y, sub_mesh, [Shard(1)])
        return {
            "shard0": d.to_local().tolist(),
            "replicate": d.redistribute(mesh, [Replicate()]).to_local().tolist(),
            "shard1": d.redistribute(mesh, [Shard(1)]).to_local().tolist(),  # all_to_all
            "partial": [prod.placements[0].is_partial(), prod.placements[0].reduce_op],
            "partial_full": prod.full_tensor().tolist(),
            "partial_shard0": prod.redistribute(mesh, [Shard(0)]).to_local().tolist(),
            "sub_mesh": [s.to_local().tolist(), s.full_tensor().tolist()],
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_dtensor_redistribute_on_raycoll_equals_gloo_and_one_process(ray_local):
    raycolls = _spawn(_dtensor, 2, "raycoll")
    assert raycolls == _spawn(_dtensor, 2, "gloo")
    x = torch.arange(15.0).reshape(5, 3)
    y = torch.arange(12.0).reshape(3, 4)
    for rank, got in enumerate(raycolls):
        rows = torch.chunk(x, 2, dim=0)[rank]
        assert got["shard0"] == rows.tolist()
        assert got["replicate"] == x.tolist()
        assert got["shard1"] == torch.chunk(x, 2, dim=1)[rank].tolist()
        assert got["partial"] == [True, "sum"]
        assert got["partial_full"] == (x @ y).tolist()
        assert got["partial_shard0"] == torch.chunk(x @ y, 2, dim=0)[rank].tolist()
        assert got["sub_mesh"] == [torch.chunk(y, 2, dim=1)[rank].tolist(), y.tolist()]


def _tensor_parallel(rank: int, steps: int) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    dist = _init()
    try:
        model = _model()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _data()
        for _ in range(steps):  # every rank the whole batch: the layers are what is split
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        return {"params": _full(model),
                "local": [list(p.to_local().shape) for p in model.parameters()]}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_tensor_parallel_equals_single_process_training(ranks):
    """DTensor's tensor parallelism (the first Linear split by columns, the second by rows)
    on 2 raycoll ranks trains as one process does."""
    steps = 3
    results = ranks.run(_tensor_parallel, 2, steps, timeout=40)
    model = one_process(steps, "sgd", 0.1)
    for got in results:
        _assert_params(got["params"], _full(model), 1e-5)
        assert got["local"] == [[8, 6], [8], [3, 8], [3]]  # the bias of a row split: whole


# ---------------------------------------------------------------------- FSDP2
def _fsdp_train(rank: int, world: int, steps: int, backend: str, bf16: bool,
                divide: Any = None) -> Any:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist = _init(backend)
    try:
        model = _model()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                      reduce_dtype=torch.float32 if bf16 else None)
        for layer in (model[0], model[2]):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        if divide is not None:  # a factor other than the world size: a PREMUL_SUM reduction
            for layer in (model[0], model[2], model):  # each sharded module's own setting
                layer.set_gradient_divide_factor(divide)
        local = [p.to_local().shape[0] for p in model.parameters()]
        opt = (torch.optim.Adam(model.parameters(), lr=0.01) if divide is None
               else torch.optim.SGD(model.parameters(), lr=0.05))  # SGD: the scale shows
        x, y = _data()
        per = len(x) // world
        for _ in range(steps):
            mine = slice(rank * per, (rank + 1) * per)
            _loss(model, x[mine], y[mine].to(torch.bfloat16) if bf16 else y[mine]).backward()
            opt.step()
            opt.zero_grad()
        return {"params": _full(model), "local_rows": local}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_fsdp2_fully_shard_equals_single_process_training(ranks):
    """FSDP2 over 2 raycoll ranks (each layer and the root sharded, each rank half of the
    batch): after 3 Adam steps every parameter equals one process training on the whole
    batch, and each rank held only its half of every parameter's rows."""
    steps, world = 3, 2
    results = ranks.run(_fsdp_train, world, world, steps, "raycoll", False, timeout=60)
    model = one_process(steps, "adam", 0.01)
    want = _full(model)
    for got in results:
        _assert_params(got["params"], want, 1e-5)
    # 16 and 3 rows, split as torch.chunk does
    assert [got["local_rows"] for got in results] == [[8, 8, 2, 2], [8, 8, 1, 1]]
    assert results[0]["params"] == results[1]["params"]


@pytest.mark.timeout(90)
def test_fsdp2_gradient_divide_factor_reduces_with_premul_sum(ranks):
    """set_gradient_divide_factor(1.0): gradients summed, not averaged, over the 2 ranks (a
    PREMUL_SUM, which gloo refuses): as one process whose loss is 2x the whole batch's."""
    steps, world = 2, 2
    results = ranks.run(_fsdp_train, world, world, steps, "raycoll", False, 1.0, timeout=60)
    model = one_process(steps, "sgd", 0.05, loss_scale=world)
    for got in results:
        _assert_params(got["params"], _full(model), 1e-5)


@pytest.mark.timeout(90)
def test_fsdp2_bf16_mixed_precision_on_raycoll_equals_gloo(ray_local):
    """bf16 parameters, gradients reduced in float32: raycoll's ranks end where gloo's do."""
    got = _spawn(_fsdp_train, 2, 2, 2, "raycoll", True)
    want = _spawn(_fsdp_train, 2, 2, 2, "gloo", True)
    for g, w in zip(got, want):
        _assert_params(g["params"], w["params"], 1e-6)


# ---------------------------------------------------------------------- distributed checkpoint
def _dcp(rank: int, path: str, save: bool) -> Dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    dist = _init()
    try:
        model = _model()
        fully_shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        if save:
            x, y = _data()
            for _ in range(2):
                _loss(model, x, y).backward()
                opt.step()
                opt.zero_grad()
        else:  # nothing of the saved state is left: zeros, no optimizer state yet
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().zero_()
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        if save:
            dcp.save(state, checkpoint_id=path)
        else:
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        model_sd, optim_sd = get_state_dict(model, opt)
        moments = [[v.full_tensor().reshape(-1).tolist() for k, v in sorted(s.items())
                    if k in ("exp_avg", "exp_avg_sq")]
                   for _, s in sorted(optim_sd["state"].items())]
        return {"params": _full(model), "moments": moments,
                "local_rows": [p.to_local().shape[0] for p in model.parameters()]}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_dcp_save_on_raycoll_loads_back_at_any_world_size(ranks, tmp_path):
    """dcp.save of FSDP2's sharded model and Adam state on 2 raycoll ranks; dcp.load into a
    fresh FSDP2 model on 2 ranks, resharded onto 3 ranks and onto 1, and in the driver
    without a process group: the same parameters and optimizer moments everywhere."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    saved = ranks.run(_dcp, 2, path, True, timeout=60)
    assert saved[0]["params"] == saved[1]["params"] and saved[0]["moments"]
    for world in (2, 3, 1):
        loaded = ranks.run(_dcp, world, path, False, timeout=60)
        for got in loaded:
            _assert_params(got["params"], saved[0]["params"], 0.0)
            assert got["moments"] == saved[0]["moments"], world
        assert loaded[0]["local_rows"] == [-(-16 // world), -(-16 // world), -(-3 // world),
                                           -(-3 // world)]
    plain = {"model": {k: torch.zeros_like(v) for k, v in _model().state_dict().items()}}
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    _assert_params([v.reshape(-1).tolist() for v in plain["model"].values()],
                   saved[0]["params"], 0.0)
