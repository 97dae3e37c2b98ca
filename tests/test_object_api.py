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
    opts.rootRank = -1  # taken, as torch's: the call checks the range (see _bad_calls)
    assert opts.rootRank == -1
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


def _bad_calls(rank: int) -> Dict[str, Any]:
    pg = raycoll.group.WORLD
    out: Dict[str, Any] = {"errors": []}
    root = raycoll.BroadcastOptions()
    root.rootRank = -1  # taken at assignment, refused by the call
    for call in (lambda: pg.allreduce([]),
                 lambda: pg.allreduce([np.ones(2), np.ones(2, np.float32)]),
                 lambda: pg.allreduce([np.ones(2), np.ones(3)]),
                 lambda: pg.allreduce([np.ones(2)], raycoll.BroadcastOptions()),
                 lambda: pg.broadcast([np.ones(2)], root),
                 lambda: pg.reduce([np.ones(2)], raycoll.ReduceOptions(rootTensor=1)),
                 lambda: pg.reduce([np.ones(2)] * 2, raycoll.ReduceOptions()),
                 lambda: pg.gather([[np.ones(2)] * 2], [np.ones(2)],
                                   raycoll.GatherOptions(rootRank=1 - rank)),
                 lambda: pg.scatter([np.ones(2)], [[np.ones(2)]],
                                    raycoll.ScatterOptions(rootRank=rank)),
                 lambda: pg.allgather([[np.ones(2)] * 3], [np.ones(2)])):
        try:
            call()
            out["errors"].append("no error")
        except (TypeError, ValueError) as exc:
            out["errors"].append((isinstance(exc, RuntimeError), type(exc).__name__, str(exc)))
    x = np.full(2, rank + 1.0)  # every refusal took its turn on every rank: the group works
    pg.allreduce([x]).wait()
    out["after"] = x.tolist()
    return out


@pytest.mark.timeout(60)
def test_object_api_refuses_bad_arguments_as_torch_at_the_call(ranks):
    want = [("InvalidArgumentError", "requires non-empty tensor list"),
            ("TensorTypeError", "invalid tensor type: tensors[1]"),
            ("TensorSizeError", "invalid tensor size: tensors[1] has shape (3,)"),
            ("TypeError", "allreduce: opts must be a raycoll.AllreduceOptions (or torch's), "
                          "got BroadcastOptions without reduceOp"),
            ("InvalidArgumentError", "invalid root rank: -1"),
            ("InvalidArgumentError", "invalid root tensor: 1"),
            ("InvalidArgumentError", "requires a single-element tensor list"),
            ("InvalidArgumentError", "requires empty output on non-root"),
            ("InvalidArgumentError", "Incorrect input list size 1. Input list size should be 2"),
            ("TensorSizeError", "invalid output tensor list at index 0")]
    for got in ranks.run(_bad_calls, 2):
        assert got["after"] == [3.0, 3.0]
        for (runtime, name, text), (want_name, start) in zip(got["errors"], want):
            assert name == want_name and text.startswith(start), (name, text)
            # torch raises RuntimeError for each but a wrong type of opts (pybind's TypeError)
            assert runtime == (name != "TypeError"), (name, text)


def _one_rank_refuses(rank: int) -> Any:
    pg = raycoll.group.WORLD
    opts = raycoll.BroadcastOptions()
    opts.rootRank = -1 if rank == 0 else 0  # only rank 0's call is refused
    try:
        pg.broadcast([np.ones(2)], opts).wait()
        got = "no error"
    except RuntimeError as exc:
        got = type(exc).__name__
    x = np.full(2, rank + 1.0)
    pg.allreduce([x]).wait()
    return got, x.tolist()


@pytest.mark.timeout(60)
def test_a_call_refused_on_one_rank_fails_its_peers_and_leaves_the_group_usable(ranks):
    # the group's timeout is 60 s: the peer learns of the refusal, it does not wait it out
    assert ranks.run(_one_rank_refuses, 2, timeout=60) == [
        ("InvalidArgumentError", [3.0, 3.0]), ("PeerArgumentError", [3.0, 3.0])]


def _several_tensors(rank: int) -> Dict[str, Any]:
    pg, w = raycoll.group.WORLD, raycoll.get_world_size()
    out: Dict[str, Any] = {}
    a, b = np.array([2.0 * rank]), np.array([2.0 * rank + 1])
    pg.allreduce([a, b]).wait()  # all 2w tensors summed, the sum in each
    out["sum"] = (a.tolist(), b.tolist())
    opts = raycoll.AllreduceOptions()
    opts.reduceOp = raycoll.ReduceOp.MAX
    a, b = np.array([2.0 * rank]), np.array([2.0 * rank + 1])
    pg.allreduce([a, b], opts).wait()
    out["max"] = (a.tolist(), b.tolist())
    a, b = np.array([3.0 * rank]), np.array([3.0 * rank + 1])
    pg.allreduce([a, b], raycoll.ReduceOp.AVG).wait()  # torch's (tensors, op) overload
    out["avg"] = (a.tolist(), b.tolist())
    xs = [np.full(3, 10.0 * rank + i) for i in range(3)]
    bopts = raycoll.BroadcastOptions()
    bopts.rootRank, bopts.rootTensor = w - 1, 2
    work = pg.broadcast(xs, bopts)
    work.wait()
    out["broadcast"] = [x.tolist() for x in xs]
    ins = [np.array([2.0 * rank]), np.array([2.0 * rank + 1])]
    outs = [[np.zeros(1) for _ in range(2 * w)] for _ in range(2)]
    work = pg.allgather(outs, ins)
    work.wait()
    out["allgather"] = [[float(x[0]) for x in lst] for lst in outs]
    out["allgather_value"] = [[float(x[0]) for x in lst] for lst in work.get_future().value()]
    y = np.array([rank + 1.0])
    pg.broadcast(y, root=1).wait()  # the overloads of a bare tensor
    z = np.array([rank + 1.0])
    pg.reduce(z, root=0, op=raycoll.ReduceOp.MAX).wait()
    out["overloads"] = (y.tolist(), z.tolist())
    return out


@pytest.mark.timeout(90)
def test_several_tensors_per_list_as_gloo_takes_them(ranks):
    w = 3
    got = ranks.run(_several_tensors, w)
    total = float(sum(range(2 * w)))
    for rank, g in enumerate(got):
        assert g["sum"] == ([total], [total])
        assert g["max"] == ([2.0 * w - 1], [2.0 * w - 1])
        mean = float(np.mean([3 * r + i for r in range(w) for i in range(2)]))
        assert g["avg"] == ([mean], [mean])
        assert g["broadcast"] == [[10.0 * (w - 1) + 2] * 3] * 3
        assert g["allgather"] == [[float(k) for k in range(2 * w)]] * 2
        assert g["allgather_value"] == g["allgather"]  # the lists, as gloo's future gives
        assert g["overloads"][0] == [2.0]
        assert g["overloads"][1] == ([float(w)] if rank == 0 else [rank + 1.0])


def _coalesced_and_uneven(rank: int) -> Dict[str, Any]:
    pg, w = raycoll.group.WORLD, raycoll.get_world_size()
    out: Dict[str, Any] = {}
    ins = [np.full((2, 2), rank + 1.0), np.arange(3.0) + 10 * rank]
    outs = [np.zeros((2 * w, 2)), np.zeros(3 * w)]
    pg.allgather_into_tensor_coalesced(outs, ins).wait()
    out["allgather_into_tensor"] = [o.tolist() for o in outs]
    ins = [np.arange(2.0 * w) + rank, np.full(w, rank + 1.0)]
    outs = [np.zeros(2), np.zeros(1)]
    pg.reduce_scatter_tensor_coalesced(outs, ins).wait()
    out["reduce_scatter_tensor"] = [o.tolist() for o in outs]
    parts = [np.full(i, float(i + rank)) for i in range(w)]  # rank i's part has i elements
    mine = np.zeros(rank)
    raycoll.reduce_scatter(mine, parts)
    out["uneven"] = mine.tolist()
    pg.set_timeout(timedelta(seconds=23))
    out["timeout"] = (pg.options._timeout, pg.timeout_s)
    return out


@pytest.mark.timeout(90)
def test_coalesced_tensor_calls_uneven_reduce_scatter_and_set_timeout(ranks):
    w = 3
    got = ranks.run(_coalesced_and_uneven, w)
    for rank, g in enumerate(got):
        first, second = g["allgather_into_tensor"]
        assert first == [[r + 1.0] * 2 for r in range(w) for _ in range(2)]
        assert second == [float(i + 10 * r) for r in range(w) for i in range(3)]
        a, b = g["reduce_scatter_tensor"]
        assert a == [float(sum(2 * rank + j + r for r in range(w))) for j in range(2)]
        assert b == [float(sum(r + 1 for r in range(w)))]
        assert g["uneven"] == [float(sum(rank + r for r in range(w)))] * rank
        assert g["timeout"] == (timedelta(seconds=23), 23.0)


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
