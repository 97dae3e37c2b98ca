"""The ProcessGroup object API (``pg.allreduce([t], opts)`` and kin) and its Options types:
each call against the module function on the same inputs, on real ranks (a subgroup too, so
that group ranks differ from global ones); the Options as torch's (defaults, set attribute by
attribute, unknown fields refused); a per-call timeout; torch's own Options objects."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Dict, List

import numpy as np
import pytest

import raycoll

OPTIONS = ["AllreduceOptions", "AllreduceCoalescedOptions", "AllToAllOptions",
           "BarrierOptions", "BroadcastOptions", "GatherOptions", "ReduceOptions",
           "ReduceScatterOptions", "ScatterOptions"]


# ---------------------------------------------------------------------- the Options types
@pytest.mark.parametrize("name", OPTIONS)
def test_options_are_set_attribute_by_attribute_and_refuse_unknown_fields(name):
    cls = getattr(raycoll, name)
    opts = cls()
    assert opts.timeout == timedelta(milliseconds=-1) and opts.asyncOp is True
    opts.timeout = timedelta(seconds=3)
    opts.asyncOp = False
    assert (opts.timeout, opts.asyncOp) == (timedelta(seconds=3), False)
    with pytest.raises(AttributeError, match=f"{name} has no field 'reduce_op'; its fields: "):
        opts.reduce_op = raycoll.ReduceOp.MAX
    with pytest.raises(TypeError, match=f"{name}.asyncOp must be a bool, got str"):
        opts.asyncOp = "yes"
    with pytest.raises(ValueError, match=f"{name}.timeout must be positive"):
        opts.timeout = timedelta(seconds=-5)
    with pytest.raises(TypeError, match=f"{name}.timeout must be a datetime.timedelta"):
        cls(timeout="soon")


def test_options_fields_convert_and_check_their_values():
    opts = raycoll.ReduceOptions()
    opts.reduceOp = "max"
    opts.rootRank = 2
    assert opts == raycoll.ReduceOptions(reduceOp=raycoll.ReduceOp.MAX, rootRank=2)
    with pytest.raises(ValueError, match="ReduceOptions.rootRank must be >= 0, got -1"):
        opts.rootRank = -1
    with pytest.raises(TypeError, match="ReduceOptions.reduceOp: op must be"):
        opts.reduceOp = 3.5
    barrier = raycoll.BarrierOptions()
    barrier.device_ids = [0, 1]
    assert barrier.device_ids == [0, 1] and raycoll.BarrierOptions().device_ids == []
    with pytest.raises(TypeError, match=r"BarrierOptions.device_ids\[1\] must be an int"):
        barrier.device_ids = [0, "1"]


@pytest.mark.torch
@pytest.mark.parametrize("name", OPTIONS)
def test_options_have_torchs_fields_and_defaults(name):
    import torch.distributed as dist

    theirs = getattr(dist, name)()
    ours = getattr(raycoll, name)()
    torch_fields = {a for a in dir(theirs) if not a.startswith("_")}
    assert torch_fields == set(vars(ours)), name
    for field in torch_fields:
        want = getattr(theirs, field)
        if field == "reduceOp":
            want = raycoll.reduce_op.as_reduce_op(want)
        assert getattr(ours, field) == want, (name, field)


# ---------------------------------------------------------------------- against the functions
def _ab(rank: int, salt: int, shape: Any = (4,)) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) * (rank + 1) + salt


def _object_vs_functions(rank: int) -> Dict[str, Any]:
    """Every object-API call and the module function it stands for, on the same inputs, on
    the subgroup of global ranks [1, 2] (group ranks 0, 1) and on the whole group."""
    sub = raycoll.new_group([1, 2])
    out: Dict[str, Any] = {}
    pg = raycoll.group.WORLD
    world = raycoll.get_world_size()

    # allreduce, MAX set attribute by attribute
    opts = raycoll.AllreduceOptions()
    opts.reduceOp = raycoll.ReduceOp.MAX
    a, b = _ab(rank, 1), _ab(rank, 1)
    w = pg.allreduce([a], opts)
    w.wait()
    raycoll.all_reduce(b, op=raycoll.ReduceOp.MAX)
    out["allreduce"] = (a.tolist(), b.tolist(), isinstance(w, raycoll.Work))
    # allreduce_coalesced
    xs, ys = [_ab(rank, 2), _ab(rank, 3, (2, 3))], [_ab(rank, 2), _ab(rank, 3, (2, 3))]
    pg.allreduce_coalesced(xs, raycoll.AllreduceCoalescedOptions()).wait()
    raycoll.all_reduce_coalesced(ys)
    out["allreduce_coalesced"] = ([x.tolist() for x in xs], [y.tolist() for y in ys])
    # broadcast from group rank 2, reduce into group rank 1
    a, b = _ab(rank, 4), _ab(rank, 4)
    pg.broadcast([a], raycoll.BroadcastOptions(rootRank=2)).wait()
    raycoll.broadcast(b, src=2)
    out["broadcast"] = (a.tolist(), b.tolist())
    a, b = _ab(rank, 5), _ab(rank, 5)
    pg.reduce([a], raycoll.ReduceOptions(rootRank=1, reduceOp=raycoll.ReduceOp.PRODUCT)).wait()
    raycoll.reduce(b, dst=1, op=raycoll.ReduceOp.PRODUCT)
    out["reduce"] = (a.tolist(), b.tolist())
    # allgather, gather (root 1), scatter (root 0), reduce_scatter
    la, lb = [np.zeros(4) for _ in range(world)], [np.zeros(4) for _ in range(world)]
    pg.allgather([la], [_ab(rank, 6)]).wait()
    raycoll.all_gather(lb, _ab(rank, 6))
    out["allgather"] = ([x.tolist() for x in la], [x.tolist() for x in lb])
    la = [np.zeros(4) for _ in range(world)] if rank == 1 else None
    lb = [np.zeros(4) for _ in range(world)] if rank == 1 else None
    pg.gather([la] if la is not None else [], [_ab(rank, 7)],
              raycoll.GatherOptions(rootRank=1)).wait()
    raycoll.gather(_ab(rank, 7), lb, dst=1)
    out["gather"] = (None if la is None else [x.tolist() for x in la],
                     None if lb is None else [x.tolist() for x in lb])
    parts = [_ab(r, 8) for r in range(world)]
    a, b = np.zeros(4), np.zeros(4)
    pg.scatter([a], [parts] if rank == 0 else [], raycoll.ScatterOptions()).wait()
    raycoll.scatter(b, parts if rank == 0 else None, src=0)
    out["scatter"] = (a.tolist(), b.tolist())
    ins = [_ab(rank, 9 + r) for r in range(world)]
    a, b = np.zeros(4), np.zeros(4)
    pg.reduce_scatter([a], [ins], raycoll.ReduceScatterOptions()).wait()
    raycoll.reduce_scatter(b, ins)
    out["reduce_scatter"] = (a.tolist(), b.tolist())
    # alltoall_base with uneven splits (rank r sends r + 1 rows to each), and even ones
    send_sizes = [rank + 1] * world
    recv_sizes = [r + 1 for r in range(world)]
    src = np.arange(sum(send_sizes), dtype=np.float64) + 100 * rank
    a, b = np.zeros(sum(recv_sizes)), np.zeros(sum(recv_sizes))
    pg.alltoall_base(a, src, recv_sizes, send_sizes, raycoll.AllToAllOptions()).wait()
    raycoll.all_to_all_single(b, src, recv_sizes, send_sizes)
    even_a, even_b = np.zeros(world * 2), np.zeros(world * 2)
    pg.alltoall_base(even_a, np.full(world * 2, float(rank)), [], []).wait()
    raycoll.all_to_all_single(even_b, np.full(world * 2, float(rank)))
    out["alltoall_base"] = (a.tolist(), b.tolist(), even_a.tolist(), even_b.tolist())
    barrier = pg.barrier(raycoll.BarrierOptions())
    out["barrier"] = (isinstance(barrier, raycoll.Work), barrier.wait())
    # point to point on the subgroup: group ranks, not global ones
    if rank in (1, 2):
        me = sub.rank()
        if me == 0:
            sub.send([np.full(3, 7.0)], 1, 5).wait()
            sub.send([np.full(3, 8.0)], 1, 6).wait()
        else:
            x, y = np.zeros(3), np.zeros(3)
            w1 = sub.recv([x], 0, 5)
            w1.wait()
            w2 = sub.recv_anysource([y], 6)
            w2.wait()
            out["p2p"] = (x.tolist(), y.tolist(), w1.source_rank(), w2.source_rank(),
                          w2._source_rank())
        # the subgroup's allreduce: the object API on a group that is not the default
        a = np.full(2, float(rank))
        sub.allreduce(a).wait()  # a bare tensor, as torch's overload takes it
        out["sub_allreduce"] = a.tolist()
    return out


@pytest.mark.timeout(120)
def test_object_api_gives_what_the_module_functions_give(ranks):
    got = ranks.run(_object_vs_functions, 3)
    for rank, g in enumerate(got):
        ours, theirs, is_work = g["allreduce"]
        assert is_work and ours == theirs
        assert ours == (np.arange(4) * 3 + 1).tolist()  # MAX: rank 2's
        for name in ("allreduce_coalesced", "broadcast", "reduce", "allgather", "gather",
                     "scatter", "reduce_scatter"):
            assert g[name][0] == g[name][1], (rank, name, g[name])
        assert g["broadcast"][0] == _ab(2, 4).tolist()
        assert g["scatter"][0] == _ab(rank, 8).tolist()
        a, b, even_a, even_b = g["alltoall_base"]
        assert a == b and even_a == even_b
        assert g["barrier"] == (True, True)
    assert got[1]["gather"][0] == [_ab(r, 7).tolist() for r in range(3)]
    assert got[0]["gather"] == (None, None)
    assert got[2]["p2p"] == ([7.0] * 3, [8.0] * 3, 0, 0, 0)  # group rank 0 is global rank 1
    assert got[1]["sub_allreduce"] == got[2]["sub_allreduce"] == [3.0, 3.0]


def _bad_calls(rank: int) -> List[str]:
    pg = raycoll.group.WORLD
    out = []
    for call in (lambda: pg.allreduce([np.ones(2), np.ones(2)]),
                 lambda: pg.allreduce([np.ones(2)], raycoll.BroadcastOptions()),
                 lambda: pg.broadcast([np.ones(2)], raycoll.BroadcastOptions(rootRank=5)),
                 lambda: pg.reduce([np.ones(2)], raycoll.ReduceOptions(rootTensor=1)),
                 lambda: pg.gather([[np.ones(2)] * 2], [np.ones(2)],
                                   raycoll.GatherOptions(rootRank=1 - rank))):
        try:
            call()
            out.append("no error")
        except (TypeError, ValueError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


@pytest.mark.timeout(60)
def test_object_api_refuses_bad_arguments_naming_them(ranks):
    for got in ranks.run(_bad_calls, 2):
        assert got[0] == ("ValueError: allreduce: tensors must hold one tensor (raycoll takes "
                          "one tensor per call, as torch's backends do), got 2")
        assert got[1].startswith("TypeError: allreduce: opts must be a raycoll.AllreduceOptions"
                                 " (or torch's), got BroadcastOptions without reduceOp")
        assert got[2].startswith("ValueError: broadcast: opts.rootRank=5 is out of range")
        assert got[3].startswith("ValueError: reduce: opts.rootTensor must be 0")
        assert got[4].startswith("ValueError: gather: output_tensors must be empty on a rank "
                                 "that is not the root")


def _per_call_timeout(rank: int) -> Any:
    if rank == 1:
        return None  # never calls: rank 0's allreduce can only time out
    opts = raycoll.AllreduceOptions()
    opts.timeout = timedelta(seconds=1)
    start = time.monotonic()
    try:
        raycoll.group.WORLD.allreduce([np.ones(3)], opts).wait()
    except raycoll.DistTimeoutError as exc:
        return str(exc), list(exc.missing), time.monotonic() - start
    return "no error"


@pytest.mark.timeout(90)
def test_an_options_timeout_bounds_that_one_call(ranks):
    # the group's timeout is 60 s: only the Options' 1 s can end the wait this soon
    text, missing, took = ranks.run(_per_call_timeout, 2, timeout=60)[0]
    assert missing == [1] and "all_reduce" in text
    assert took < 20, took


def _torch_options(rank: int) -> Any:
    import torch
    import torch.distributed as dist

    pg = raycoll.group.WORLD
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    t = torch.full((2,), float(rank))
    pg.allreduce([t], opts).wait()
    b = dist.BroadcastOptions()
    b.rootRank = 1
    u = torch.full((2,), float(rank + 10))
    pg.broadcast([u], b).wait()
    return t.tolist(), u.tolist()


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_torchs_own_options_objects_are_read_field_by_field(ranks):
    assert ranks.run(_torch_options, 2) == [([1.0, 1.0], [11.0, 11.0])] * 2
