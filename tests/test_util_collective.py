"""``raycoll.util.collective``, the drop-in for ``ray.util.collective``: code written for Ray's
library runs through it unchanged (the same script, only the module name differs) and gives
the results Ray's own gives (real ``ray.util.collective`` with its torch gloo backend, in the
same test); the declarative ``create_collective_group``, two named groups in one actor, -1
outside a group, destroy; bad input and mismatches as raycoll's named errors on every rank."""

from __future__ import annotations

import importlib
import inspect
import uuid
from typing import Any, Dict, Iterator, List, Sequence

import numpy as np
import pytest
import ray

import raycoll
import raycoll.util.collective as col

DROP_IN = "raycoll.util.collective"
RAY = "ray.util.collective"


@ray.remote(num_cpus=0)
class Rank:
    """A plain actor: runs whatever function it is given (the user's code)."""

    def run(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


@pytest.fixture(scope="module")
def actors(ray_local: None) -> Iterator[List[Any]]:
    pool = [Rank.remote() for _ in range(3)]
    yield pool
    for actor in pool:
        ray.kill(actor, no_restart=True)


def _on(actors: Sequence[Any], fn: Any, *args: Any, timeout: float = 60) -> List[Any]:
    """``fn(rank, *args)`` on each actor, results in rank order."""
    return ray.get([a.run.remote(fn, r, *args) for r, a in enumerate(actors)], timeout=timeout)


def _name() -> str:
    # fresh: Ray's gloo rendezvous key (internal_kv) is not scoped by job
    return f"uc-{uuid.uuid4().hex[:8]}"


# ------------------------------------------------------------ the user's code, written for Ray
def script(rank: int, lib: str, world_size: int, group: str, kinds: Sequence[str],
           backend: str = "gloo") -> Dict[str, Any]:
    """Code written for ``ray.util.collective``; ``lib`` names the module it imports."""
    col = importlib.import_module(lib)
    ReduceOp = importlib.import_module(lib + ".types").ReduceOp
    col.init_collective_group(world_size, rank, backend=backend, group_name=group)
    out: Dict[str, Any] = {"rank": col.get_rank(group), "size": col.get_collective_group_size(group),
                           "outside": (col.get_rank("never-formed"),
                                       col.get_collective_group_size("never-formed"))}
    last = world_size - 1
    for kind in kinds:
        if kind == "torch":
            import torch

            def make(values: Any, dtype: str = "float32") -> Any:
                return torch.tensor(np.asarray(values, dtype=dtype))
        else:
            def make(values: Any, dtype: str = "float32") -> Any:
                return np.asarray(values, dtype=dtype)

        def got(t: Any) -> list:
            return np.asarray(t).tolist()

        x = make([rank + 1, 2 * (rank + 1), 3])
        col.allreduce(x, group)
        m = make([rank, -rank, 5], "int64")
        col.allreduce(m, group_name=group, op=ReduceOp.MIN)
        gathered = [make([0, 0]) for _ in range(world_size)]
        col.allgather(gathered, make([rank, 10 * rank]), group)
        out_rs = make([0, 0])
        col.reducescatter(out_rs, [make([rank + i, i]) for i in range(world_size)], group)
        b = make([7 * rank, 1])
        col.broadcast(b, last, group)
        r = make([rank + 1, 2])
        col.reduce(r, 0, group, ReduceOp.PRODUCT)
        col.barrier(group)
        if rank == 0:
            col.send(make([42, 43]), last, group)
        p = make([0, 0])
        if rank == last:
            col.recv(p, 0, group)
        out[kind] = {"allreduce": got(x), "min": got(m), "allgather": [got(t) for t in gathered],
                     "reducescatter": got(out_rs), "broadcast": got(b),
                     "reduce": got(r),
                     "recv": got(p) if rank == last else None}
    col.destroy_collective_group(group)
    out["after"] = (col.is_group_initialized(group), col.get_rank(group))
    return out


def expected(rank: int, world_size: int, kinds: Sequence[str]) -> Dict[str, Any]:
    ranks = range(world_size)
    last = world_size - 1
    each = {"allreduce": [float(sum(r + 1 for r in ranks)), float(sum(2 * (r + 1) for r in ranks)),
                          3.0 * world_size],
            "min": [0, -last, 5],
            "allgather": [[float(r), 10.0 * r] for r in ranks],
            "reducescatter": [float(sum(r + rank for r in ranks)), float(rank * world_size)],
            "broadcast": [7.0 * last, 1.0],
            "reduce": ([float(np.prod([r + 1 for r in ranks])), 2.0 ** world_size] if rank == 0
                       else [rank + 1.0, 2.0]),  # the other ranks' tensors left as they were
            "recv": [42.0, 43.0] if rank == last else None}
    out: Dict[str, Any] = {"rank": rank, "size": world_size, "outside": (-1, -1),
                           "after": (False, -1)}
    out.update({kind: each for kind in kinds})
    return out


def test_code_written_for_ray_util_collective_runs_unchanged(actors):
    got = _on(actors, script, DROP_IN, 3, _name(), ("numpy",))
    assert got == [expected(r, 3, ("numpy",)) for r in range(3)]


@pytest.mark.torch
@pytest.mark.timeout(90)
def test_same_results_as_ray_util_collective_itself(actors):
    """The same script on real ray.util.collective (Ray 2.60's torch gloo backend) and on the
    drop-in: equal results, numpy arrays and torch tensors."""
    kinds = ("numpy", "torch")
    ray_actors = [Rank.remote() for _ in range(2)]  # fresh: Ray's gloo takes torch's world
    try:
        ray_side = _on(ray_actors, script, RAY, 2, _name(), kinds, timeout=80)
    finally:
        for actor in ray_actors:
            ray.kill(actor, no_restart=True)
    ours = _on(actors[:2], script, DROP_IN, 2, _name(), kinds)
    assert ours == ray_side
    assert ours == [expected(r, 2, kinds) for r in range(2)]


def test_the_names_and_signatures_are_ray_s():
    ray_col = importlib.import_module(RAY)
    ray_types = importlib.import_module(RAY + ".types")

    def shape(fn: Any) -> list:
        return [(p.name, getattr(p.default, "name", p.default)) for p in
                inspect.signature(fn).parameters.values()]

    assert set(ray_col.__all__) <= set(col.__all__)
    for name in ray_col.__all__:
        assert shape(getattr(col, name)) == shape(getattr(ray_col, name)), name
    assert [(m.name, m.value) for m in col.types.ReduceOp] == \
        [(m.name, m.value) for m in ray_types.ReduceOp]
    assert col.types.Backend("torch_gloo") == ray_types.Backend("torch_gloo") == "GLOO"
    assert col.is_backend_available("gloo") and col.gloo_available()
    # Ray's own ReduceOp members are taken too (code that imports them from Ray's types)
    assert [col.collective._op(m) for m in ray_types.ReduceOp] == \
        [raycoll.ReduceOp.SUM, raycoll.ReduceOp.PRODUCT, raycoll.ReduceOp.MIN, raycoll.ReduceOp.MAX]


def _two_groups(rank: int, first: str) -> Dict[str, Any]:
    """Inside actors that the driver put in group ``first`` (ranks permuted): a second group,
    Ray's "default", formed here; collectives on both (raycoll's ReduceOp taken too); one
    destroyed."""
    mine = col.get_rank(first)
    col.init_collective_group(3, rank)  # Ray's defaults: NCCL's group, which takes CPU arrays too
    x = np.full(2, float(mine))
    col.allreduce(x, first, op=raycoll.ReduceOp.MAX)
    y = np.full(2, float(rank))
    col.allreduce(y)  # group_name="default"
    col.destroy_collective_group("default")
    z = np.ones(1)
    col.allreduce(z, group_name=first)
    return {"first": mine, "size": col.get_collective_group_size(first), "max": x.tolist(),
            "sum": y.tolist(), "default": (col.is_group_initialized("default"),
                                          col.get_rank("default")), "still": z.tolist()}


@pytest.mark.timeout(60)
def test_create_collective_group_from_the_driver_and_two_named_groups(actors):
    first = _name()
    with pytest.raises(ValueError, match="permutation"):
        col.create_collective_group(actors, 3, [0, 1, 1], backend="gloo", group_name=first)
    with pytest.raises(ValueError, match="neither"):
        col.create_collective_group(actors, 3, [0, 1, 2], backend="mpi", group_name=first)
    col.create_collective_group(actors, 3, [2, 0, 1], backend="gloo", group_name=first)
    try:
        got = _on(actors, _two_groups, first)
    finally:
        col.destroy_collective_group(first)  # from the driver: every actor leaves
    assert [g["first"] for g in got] == [2, 0, 1]
    for g in got:
        assert g == {"first": g["first"], "size": 3, "max": [2.0, 2.0], "sum": [3.0, 3.0],
                     "default": (False, -1), "still": [3.0]}
    left = _on(actors, lambda rank: (col.is_group_initialized(first), col.get_rank(first)))
    assert left == [(False, -1)] * 3
    col.destroy_collective_group(first)  # unknown now: a warning, as in Ray
    assert col.get_rank(first) == -1  # the driver, outside every group


def _bad_calls(rank: int, group: str) -> Dict[str, str]:
    col.init_collective_group(2, rank, backend="gloo", group_name=group, gloo_timeout=20000)
    out: Dict[str, str] = {}

    def attempt(key: str, fn: Any) -> None:
        try:
            fn()
            out[key] = "ok"
        except Exception as exc:  # noqa: BLE001 - the test reads which error each rank got
            out[key] = type(exc).__name__

    attempt("mismatch", lambda: col.allreduce(np.zeros(3 + rank), group))
    frozen = np.ones(2)
    frozen.flags.writeable = rank != 0  # written into, as Ray does (test_ray_backend.py)
    attempt("read_only", lambda: col.allreduce(frozen, group))
    out["read_only_value"] = str(frozen.tolist())
    attempt("short_list", lambda: col.allgather([np.zeros(1)] * (1 + rank), np.zeros(1), group))
    attempt("bad_root", lambda: col.broadcast(np.zeros(1), 2, group))
    attempt("no_group", lambda: col.allreduce(np.zeros(1), "never-formed"))
    attempt("two_gpus", lambda: col.allreduce_multigpu([np.zeros(1)] * (2 - rank), group))
    one = np.ones(2)
    attempt("one_gpu", lambda: col.allreduce_multigpu([one], group))
    out["one_gpu_value"] = str(one.tolist())
    attempt("twice", lambda: col.init_collective_group(2, rank, backend="gloo", group_name=group))
    attempt("register", lambda: col.register_collective_backend("mine", object))  # Ray's check
    col.destroy_collective_group(group)
    col.init_collective_group(2, rank, backend="gloo", group_name=group)  # the name again
    again = np.ones(1)
    col.allreduce(again, group)
    out["again"] = str(again.tolist())
    col.destroy_collective_group(group)
    return out


@pytest.mark.timeout(60)
def test_bad_input_gives_named_errors_on_every_rank(actors):
    got = _on(actors[:2], _bad_calls, _name())
    assert got[0] == {"mismatch": "CollectiveMismatchError", "read_only": "ok",
                      "read_only_value": "[2.0, 2.0]",
                      "short_list": "TensorSizeError", "bad_root": "ValueError",
                      "no_group": "GroupNotFoundError", "two_gpus": "NotImplementedError",
                      "one_gpu": "ok", "one_gpu_value": "[2.0, 2.0]", "twice": "ValueError",
                      "register": "TypeError", "again": "[2.0]"}
    assert got[1] == dict(got[0], short_list="PeerArgumentError", two_gpus="PeerArgumentError")
    assert issubclass(raycoll.GroupNotFoundError, RuntimeError)  # what Ray raises there
