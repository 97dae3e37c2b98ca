"""raycoll as a torch.distributed backend: ``init_process_group("raycoll")`` in raycoll ranks,
torch's own collectives, DDP (equal to one process on the same data, ``no_sync``, a comm
hook), torch's Join over uneven inputs, ZeroRedundancyOptimizer, and a rank dying in the
middle of DDP's backward. Real Ray, real torch, no mocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any, Dict, List

import numpy as np
import pytest
import ray

import raycoll
from raycoll.launch import RankWorker

import helpers
from helpers import TORCH_MISSING
from helpers import mse as _loss
from helpers import one_process
from helpers import torch_init as _init
from helpers import toy_data as _data
from helpers import toy_model as _model

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch", reason=TORCH_MISSING)

W = 3  # world size of the collectives test


# ---------------------------------------------------------------------- rank-side helpers
def _params(model: Any) -> List[List[float]]:
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


# ---------------------------------------------------------------------- collectives
def _collectives(rank: int, world: int) -> Dict[str, Any]:
    import torch

    dist = _init()
    out: Dict[str, Any] = {}
    try:
        out["who"] = [dist.get_rank(), dist.get_world_size(), dist.get_backend()]
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        out["sum"] = t.tolist()
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out["max"] = t.tolist()
        t = torch.full((4,), float(rank))
        work = dist.all_reduce(t, async_op=True)
        fut = work.get_future()
        out["future"] = [isinstance(fut, torch._C.Future),  # as gloo's get_future() gives
                         fut.then(lambda f: f.value()[0] * 2).wait().tolist()]
        work.wait()
        out["work_done"] = [work.is_completed(), work.is_success()]
        bf = torch.full((5,), 1.5 + rank, dtype=torch.bfloat16)
        dist.all_reduce(bf)
        out["bf16"] = [str(bf.dtype), bf.float().tolist()]
        h = torch.full((5,), 0.25 * (rank + 1), dtype=torch.float16)
        dist.all_reduce(h, op=dist.ReduceOp.AVG)
        out["fp16_avg"] = [str(h.dtype), h.float().tolist()]
        nc = torch.full((4, 2), float(rank + 1)).t()  # not contiguous
        dist.all_reduce(nc)
        out["noncontig"] = nc.tolist()
        b = torch.arange(4.0) if rank == 1 else torch.zeros(4)
        dist.broadcast(b, src=1)
        out["broadcast"] = b.tolist()
        bb = torch.full((2,), 0.5 + rank, dtype=torch.bfloat16)
        dist.broadcast(bb, src=2)
        out["broadcast_bf16"] = bb.float().tolist()
        lst = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(lst, torch.tensor([rank, 10 * rank]))
        out["all_gather"] = [x.tolist() for x in lst]
        flat = torch.zeros(world * 2)
        dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
        out["all_gather_into_tensor"] = flat.tolist()
        outs = [[torch.zeros(2), torch.zeros(3)] for _ in range(world)]
        dist.all_gather_coalesced(outs, [torch.full((2,), float(rank)), torch.full((3,), -1.0 * rank)])
        out["all_gather_coalesced"] = [[x.tolist() for x in lst_] for lst_ in outs]
        a, c = torch.full((2,), float(rank)), torch.full((3,), 1.0)
        dist.all_reduce_coalesced([a, c])
        out["all_reduce_coalesced"] = [a.tolist(), c.tolist()]
        r = torch.full((2,), float(rank + 1))
        dist.reduce(r, dst=0)
        out["reduce"] = r.tolist()
        rs = torch.zeros(2)
        dist.reduce_scatter(rs, [torch.full((2,), float(rank + j)) for j in range(world)])
        out["reduce_scatter"] = rs.tolist()
        rst = torch.zeros(2)
        dist.reduce_scatter_tensor(rst, torch.arange(2.0 * world) * (rank + 1))
        out["reduce_scatter_tensor"] = rst.tolist()
        ins = [torch.full((2,), float(10 * rank + j)) for j in range(world)]
        got = [torch.zeros(2) for _ in range(world)]
        dist.all_to_all(got, ins)
        out["all_to_all"] = [x.tolist() for x in got]
        in_splits = [j + 1 for j in range(world)]  # rank r sends j+1 values to rank j
        inp = torch.arange(float(sum(in_splits))) + 100 * rank
        single = torch.zeros((rank + 1) * world)
        dist.all_to_all_single(single, inp, [rank + 1] * world, in_splits)
        out["all_to_all_single"] = single.tolist()
        gl = [torch.zeros(2) for _ in range(world)] if rank == 2 else None
        dist.gather(torch.full((2,), float(rank)), gl, dst=2)
        out["gather"] = [x.tolist() for x in gl] if gl is not None else None
        sc = torch.zeros(2)
        dist.scatter(sc, [torch.full((2,), float(j * j)) for j in range(world)] if rank == 0 else None,
                     src=0)
        out["scatter"] = sc.tolist()
        if rank == 0:
            dist.send(torch.arange(3.0), dst=1)
            dist.send(torch.full((3,), 7.0), dst=2, tag=5)
        elif rank == 1:
            got1 = torch.zeros(3)
            dist.recv(got1, src=0)
            out["recv"] = got1.tolist()
        else:
            got2 = torch.zeros(3)
            out["recv_any_src"] = dist.recv(got2, tag=5)  # any source: returns the sender
            out["recv_any"] = got2.tolist()
        dist.barrier()
        objs: List[Any] = [None] * world
        dist.all_gather_object(objs, {"rank": rank})
        out["all_gather_object"] = objs
        sub = dist.new_group([0, 2])
        if rank in (0, 2):
            s = torch.full((2,), float(rank + 1))
            dist.all_reduce(s, group=sub)
            out["subgroup"] = [s.tolist(), dist.get_rank(sub), dist.get_world_size(sub)]
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.timeout(180)
def test_torch_collectives_on_raycoll(ranks):
    results = ranks.run(_collectives, W, W)
    in_splits = [j + 1 for j in range(W)]
    for rank, got in enumerate(results):
        assert got["who"] == [rank, W, "raycoll"]
        assert got["sum"] == [6.0] * 3 and got["max"] == [3.0] * 3
        assert got["future"] == [True, [6.0] * 4] and got["work_done"] == [True, True]
        assert got["bf16"] == ["torch.bfloat16", [7.5] * 5]
        assert got["fp16_avg"] == ["torch.float16", [0.5] * 5]
        assert got["noncontig"] == [[6.0] * 4] * 2
        assert got["broadcast"] == [0.0, 1.0, 2.0, 3.0]
        assert got["broadcast_bf16"] == [2.5, 2.5]
        assert got["all_gather"] == [[r, 10 * r] for r in range(W)]
        assert got["all_gather_into_tensor"] == [float(r) for r in range(W) for _ in range(2)]
        assert got["all_gather_coalesced"] == [[[float(r)] * 2, [-1.0 * r] * 3] for r in range(W)]
        assert got["all_reduce_coalesced"] == [[3.0, 3.0], [3.0] * 3]
        if rank == 0:
            assert got["reduce"] == [6.0, 6.0]
        assert got["reduce_scatter"] == [float(sum(r + rank for r in range(W)))] * 2
        full = np.arange(2.0 * W) * sum(r + 1 for r in range(W))
        assert got["reduce_scatter_tensor"] == full[2 * rank:2 * rank + 2].tolist()
        assert got["all_to_all"] == [[float(10 * i + rank)] * 2 for i in range(W)]
        start = sum(in_splits[:rank])
        want = [100.0 * i + v for i in range(W) for v in range(start, start + rank + 1)]
        assert got["all_to_all_single"] == want
        if rank == 2:
            assert got["gather"] == [[float(r)] * 2 for r in range(W)]
        assert got["scatter"] == [float(rank * rank)] * 2
        assert got["all_gather_object"] == [{"rank": r} for r in range(W)]
    assert results[1]["recv"] == [0.0, 1.0, 2.0]
    assert results[2]["recv_any"] == [7.0] * 3 and results[2]["recv_any_src"] == 0
    assert results[0]["subgroup"] == [[4.0, 4.0], 0, 2]
    assert results[2]["subgroup"] == [[4.0, 4.0], 1, 2]


def _bad_rank(rank: int) -> str:
    import torch.distributed as dist

    try:
        dist.init_process_group("raycoll", rank=1 - rank, world_size=2)
    except ValueError as exc:
        return str(exc)
    dist.destroy_process_group()
    return "no error"


@pytest.mark.timeout(60)
def test_rank_that_disagrees_with_the_raycoll_group_is_refused(ranks):
    for msg in ranks.run(_bad_rank, 2):
        assert "does not match this rank's raycoll group" in msg


def _mismatch_and_gloo(rank: int) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    out: Dict[str, Any] = {}
    # gloo without MASTER_ADDR inside a raycoll rank: it meets on the raycoll group's store
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    try:
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t)
        out["gloo"] = [dist.get_backend(), t.tolist()]
    finally:
        dist.destroy_process_group()
    dist = _init()
    try:
        try:
            dist.all_reduce(torch.zeros(3 + rank))  # shapes differ across ranks
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["mismatch"] = [type(exc).__name__, str(exc)]
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_mismatch_is_named_and_gloo_without_master_addr_meets_on_raycolls_store(ranks):
    for got in ranks.run(_mismatch_and_gloo, 2):
        kind, msg = got["mismatch"]
        assert kind == "CollectiveMismatchError" and "shape" in msg, got
        assert got["gloo"] == ["gloo", [3.0, 3.0]], got


def _raise_with_torch_initialized(rank: int) -> None:
    _init()
    raise RuntimeError(f"rank {rank} fails before destroy_process_group")


def _initialized_before_init(rank: int) -> bool:
    import torch.distributed as dist

    before = dist.is_initialized()
    _init().destroy_process_group()
    return before


@pytest.mark.timeout(120)
def test_a_run_that_raises_with_torch_initialized_leaves_the_actor_clean(ranks):
    with pytest.raises(raycoll.SpawnError, match="fails before destroy_process_group"):
        ranks.run(_raise_with_torch_initialized, 2)
    # the same pooled actors: torch's default group went with the failed run
    assert ranks.run(_initialized_before_init, 2) == [False, False]


def _bf16_on_raycolls_own_api(rank: int) -> Dict[str, Any]:
    import torch

    bf16 = torch.bfloat16
    out: Dict[str, Any] = {}
    # 1 + 1/256 is not a bfloat16: each rank's value rounds, the float32 sum rounds once
    t = torch.full((3,), 1.0 + rank / 128, dtype=bf16)
    ptr = t.data_ptr()
    raycoll.all_reduce(t)
    out["sum"], out["in_place"] = t.float().tolist(), t.data_ptr() == ptr
    avg = torch.full((2,), float(rank + 1), dtype=bf16)
    raycoll.all_reduce(avg, op=raycoll.ReduceOp.AVG, async_op=True).wait()
    out["avg"] = avg.float().tolist()
    b = torch.full((2,), 0.1 * (rank + 1), dtype=bf16)
    raycoll.broadcast(b, src=1)
    out["bcast"] = b.view(torch.int16).tolist()  # the bits, unchanged
    outs = [torch.empty(2, dtype=bf16) for _ in range(2)]
    raycoll.all_gather(outs, torch.full((2,), 3.3 * rank, dtype=bf16))
    out["gather"] = [o.view(torch.int16).tolist() for o in outs]
    rs = torch.empty(2, dtype=bf16)
    raycoll.reduce_scatter_tensor(rs, torch.arange(4, dtype=bf16) * (rank + 1))
    out["rs"] = rs.float().tolist()
    if rank == 0:
        raycoll.send(torch.tensor([7.5, -2.25], dtype=bf16), dst=1)
    else:
        got = torch.zeros(2, dtype=bf16)
        raycoll.recv(got, src=0)
        out["recv"] = got.float().tolist()
    try:  # bfloat16 on one rank, float32 on the other: named, not reinterpreted
        raycoll.all_reduce(torch.ones(4, dtype=bf16 if rank == 0 else torch.float32))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["mixed"] = [type(exc).__name__, str(exc)]
    ok = torch.ones(2)
    raycoll.all_reduce(ok)  # the group survives the mismatch
    out["after"] = ok.tolist()
    return out


@pytest.mark.timeout(60)
def test_bfloat16_cpu_tensors_on_raycolls_own_api(ranks):
    """raycoll's own collectives take bfloat16 CPU tensors: reductions in float32, rounded
    once; data movement bit for bit; bfloat16 against float32 is a named mismatch."""
    got = ranks.run(_bf16_on_raycolls_own_api, 2)
    bits = lambda x: torch.tensor(x, dtype=torch.bfloat16).view(torch.int16).tolist()  # noqa
    one = torch.tensor(1.0 + 1 / 128, dtype=torch.bfloat16).float().item()
    for rank, g in enumerate(got):
        assert g["sum"] == [torch.tensor(1.0 + one).bfloat16().item()] * 3 and g["in_place"]
        assert g["avg"] == [1.5, 1.5]
        assert g["bcast"] == bits([0.2, 0.2])
        assert g["gather"] == [bits([0.0, 0.0]), bits([3.3, 3.3])]
        assert g["rs"] == [[0.0, 3.0], [6.0, 9.0]][rank]
        assert g["mixed"][0] == "CollectiveMismatchError" and "bfloat16" in g["mixed"][1], g
        assert g["after"] == [2.0, 2.0]
    assert got[1]["recv"] == [7.5, -2.25]


# ---------------------------------------------------------------------- DDP
def _ddp_train(rank: int, world: int, steps: int, hook: str, accumulate: bool) -> Any:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = _init()
    try:
        model = _model()
        ddp = DDP(model)
        if hook == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x, y = _data()
        per = len(x) // world
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        for _ in range(steps):
            if accumulate:  # two micro-batches, the first without communication
                half = per // 2
                with ddp.no_sync():
                    _loss(ddp, xs[:half], ys[:half]).backward()
                _loss(ddp, xs[half:], ys[half:]).backward()
            else:
                _loss(ddp, xs, ys).backward()
            opt.step()
            opt.zero_grad()
        return _params(model)
    finally:
        dist.destroy_process_group()


def _single_process(steps: int, world: int, accumulate: bool) -> List[List[float]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    per = len(x) // world
    for _ in range(steps):
        if accumulate:  # micro-batch m of every rank, averaged over ranks, summed over m
            half = per // 2
            for lo, hi in ((0, half), (half, per)):
                idx = torch.cat([torch.arange(r * per + lo, r * per + hi) for r in range(world)])
                _loss(model, x[idx], y[idx]).backward()
        else:
            _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def _assert_params(got: List[List[float]], want: List[List[float]], atol: float) -> None:
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("hook,accumulate", [("none", False), ("none", True), ("fp16", False)],
                         ids=["plain", "no_sync", "fp16_compress_hook"])
def test_ddp_equals_single_process_training(ranks, hook, accumulate):
    steps, world = 5, 2
    results = ranks.run(_ddp_train, world, world, steps, hook, accumulate)
    want = _single_process(steps, world, accumulate)
    atol = 2e-3 if hook == "fp16" else 1e-5
    for got in results:
        _assert_params(got, want, atol)
    _assert_params(results[1], results[0], 0.0)  # DDP keeps the replicas identical


def _ddp_join(rank: int, world: int, batches: List[int]) -> Any:
    import torch
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = _init()
    try:
        model = _model()
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x, y = _data()
        with Join([ddp]):
            for i in range(batches[rank]):
                lo = (i * world + rank) * 4
                _loss(ddp, x[lo:lo + 4], y[lo:lo + 4]).backward()
                opt.step()
                opt.zero_grad()
        return _params(model)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_ddp_uneven_inputs_under_torch_join(ranks):
    """Rank 0 runs out of data first: torch's Join shadows its all_reduces; the gradient of
    each step is the sum over the ranks still training / world size (DDP's default)."""
    world, batches = 2, [2, 5]
    results = ranks.run(_ddp_join, world, world, batches)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    for i in range(max(batches)):
        grads = None
        for r in (r for r in range(world) if i < batches[r]):
            model.zero_grad()
            lo = (i * world + r) * 4
            _loss(model, x[lo:lo + 4], y[lo:lo + 4]).backward()
            g = [p.grad.clone() for p in model.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(model.parameters(), grads):
            p.grad = g / world
        opt.step()
    want = _params(model)
    for got in results:
        _assert_params(got, want, 1e-5)


def _zero(rank: int, world: int, steps: int) -> Any:
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = _init()
    try:
        model = _model()
        ddp = DDP(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
        x, y = _data()
        per = len(x) // world
        for _ in range(steps):
            _loss(ddp, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
            opt.step()
            opt.zero_grad()
        opt.consolidate_state_dict(to=0)
        steps_seen = None
        if rank == 0:
            state = opt.state_dict()["state"]
            steps_seen = sorted(float(s["step"]) for s in state.values())
        return {"params": _params(model), "steps": steps_seen}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_zero_redundancy_optimizer(ranks):
    steps, world = 4, 2
    results = ranks.run(_zero, world, world, steps)
    model = one_process(steps, "adam", 0.01)
    want = _params(model)
    for got in results:
        _assert_params(got["params"], want, 1e-4)  # Adam: float rounding, normalized
    assert results[0]["steps"] == [float(steps)] * len(want)  # consolidated on rank 0


# ---------------------------------------------------------------------- a rank dies
def _ddp_dies(rank: int, victim: int) -> Dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = _init()
    model = _model()
    ddp = DDP(model)
    x, y = _data()
    _loss(ddp, x[:8], y[:8]).backward()  # one healthy step
    if rank == victim:  # dies in the middle of its backward pass
        next(model.parameters()).register_hook(lambda g: os._exit(1))
    start = time.time()
    try:
        _loss(ddp, x[8:16], y[8:16]).backward()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"ok": False, "type": type(exc).__name__, "msg": str(exc),
                "elapsed": time.time() - start}
    finally:
        dist.destroy_process_group()
    return {"ok": True, "elapsed": time.time() - start}


@pytest.mark.timeout(120)
def test_rank_dying_during_ddp_backward_fails_the_others_naming_it(ray_local):
    worker = ray.remote(num_cpus=0)(RankWorker)
    team = [worker.remote() for _ in range(2)]
    name = f"torch-dies-{uuid.uuid4().hex[:6]}"
    try:
        raycoll.create_group(team, group_name=name, timeout=120)
        refs = [a.run.remote(_ddp_dies, r, (1,), {}) for r, a in enumerate(team)]
        survivor = ray.get(refs[0], timeout=90)
        print(f"\nsurvivor's error after {survivor.get('elapsed', 0):.2f}s: {survivor.get('msg')}")
        assert not survivor["ok"], survivor
        assert "rank 1" in survivor["msg"], survivor
        assert survivor["elapsed"] < 10.0, survivor  # seconds, not the 120 s timeout
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(refs[1], timeout=30)
    finally:
        try:
            raycoll.destroy_group(name)
        except Exception:  # noqa: BLE001 - the group may be gone with its rank
            pass
        for actor in team:
            ray.kill(actor, no_restart=True)


# ---------------------------------------------------------------------- registration
_PROBE = """
import json, sys
import raycoll
out = {"torch_after_import_raycoll": "torch" in sys.modules}
import torch.distributed as dist
out["registered"] = "raycoll" in dist.Backend.backend_list
print(json.dumps(out))
"""

_PROBE_TORCH_FIRST = """
import json
import torch.distributed as dist
import raycoll
print(json.dumps({"registered": "raycoll" in dist.Backend.backend_list}))
"""


@pytest.mark.timeout(120)
def test_import_raycoll_does_not_import_torch_and_registers_once_torch_is():
    for script in (_PROBE, _PROBE_TORCH_FIRST):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=100, check=True)
        got = json.loads(done.stdout.strip().splitlines()[-1])
        assert got.pop("torch_after_import_raycoll", False) is False
        assert got == {"registered": True}, done.stderr


# Other ways into the backend: register() by hand before torch is imported (it imports torch,
# whose import runs the hook, which calls register() again), and one of the package's modules
# that import torch first (its own ``import torch`` runs the hook while it is half-defined).
_IMPORT_ORDERS = {
    "register_before_torch": "import raycoll.torch_backend as tb\nassert tb.register()",
    "process_group_first": "import raycoll.torch_backend.process_group",
    "torch_then_process_group": "import torch\nimport raycoll.torch_backend.process_group",
    "rendezvous_first": "import raycoll.torch_backend.rendezvous",
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("order", sorted(_IMPORT_ORDERS))
def test_the_backend_registers_in_every_import_order(order):
    script = _IMPORT_ORDERS[order] + (
        "\nimport torch.distributed as dist\n"
        "print('registered', 'raycoll' in dist.Backend.backend_list)")
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "registered True", done.stderr
    assert "could not register" not in done.stderr


@pytest.mark.timeout(30)
def test_outside_a_raycoll_rank_the_error_says_what_to_do():
    import torch.distributed as dist

    with pytest.raises(ValueError, match="runs inside a raycoll rank"):
        dist.init_process_group("raycoll", init_method="raycoll://")


# ---------------------------------------------------------------------- the example
@pytest.fixture(scope="module")
def example():
    with helpers.example_module("ddp_train.py") as module:
        yield module


@pytest.mark.timeout(180)
def test_example_ddp_train_under_join_matches_single_process(ranks, example):
    cfg = example.Config(world_size=2, base=3, extra=3)
    results = ranks.run(example.train_rank, 2, cfg)
    assert example.check(results, cfg) == []
