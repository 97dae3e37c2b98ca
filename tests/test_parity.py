"""torch.distributed 2.13 parity: calls a ported torch script makes, behaving as torch's do."""

from __future__ import annotations

import numpy as np
import pytest

import raycoll


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
        return type(exc).__name__, str(exc)


def _object_p2p(rank):
    lst = [f"from-{rank}", rank] if rank == 0 else [None, None]
    raycoll.broadcast_object_list(lst)  # src defaults to 0, as in torch
    out = {"broadcast": lst}
    if rank == 0:
        got = {}
        for _ in range(2):  # any source
            slots = [None] * 3
            sender = raycoll.recv_object_list(slots)
            got[sender] = slots
        out["got"] = got
        raycoll.barrier()
        slots = [None]
        out["named"] = (raycoll.recv_object_list(slots, src=1), slots)
        out["short"] = _outcome(lambda: raycoll.recv_object_list([None], src=2))
        out["self"] = _outcome(lambda: raycoll.send_object_list([1], dst=0))
    elif rank == 1:
        raycoll.send_object_list(["foo", 12, {1: 2}], dst=0)
        raycoll.barrier()  # rank 0's any-source receives are done
        raycoll.send_object_list([np.arange(3)], dst=0)
        out["unpicklable"] = _outcome(
            lambda: raycoll.send_object_list([(x for x in [])], dst=0))
    else:
        raycoll.send_object_list([None, (rank,), lambda: 42], group_dst=0, use_batch=True)
        raycoll.barrier()
        raycoll.send_object_list(["one", "two"], dst=0)  # rank 0 offers one slot: refused
    x = np.ones(2)
    raycoll.all_reduce(x)  # the group is still usable
    out["after"] = x.tolist()
    return out


@pytest.mark.timeout(120)
def test_send_and_recv_object_list(ranks):
    r0, r1, r2 = ranks.run(_object_p2p, 3)
    for r in (r0, r1, r2):
        assert r["broadcast"] == ["from-0", 0]
        assert r["after"] == [3.0, 3.0]
    assert sorted(r0["got"]) == [1, 2]  # recv_object_list returns the sender's rank
    assert r0["got"][1] == ["foo", 12, {1: 2}]
    none, tup, fn = r0["got"][2]
    assert none is None and tup == (2,) and fn() == 42
    sender, slots = r0["named"]
    assert sender == 1 and slots[0].tolist() == [0, 1, 2]
    kind, message = r0["short"]
    assert kind == "ValueError" and "rank 2 sent 2 objects" in message and "1 slots" in message
    kind, message = r0["self"]
    assert kind == "ValueError" and "Invalid destination rank" in message
    kind, message = r1["unpicklable"]
    assert kind == "TypeError" and "cannot be pickled" in message


def _coalesced(rank, world_size):
    me = float(rank + 1)
    a, b = np.full((2, 3), me), np.arange(4.0)[::2] * me  # b: a strided view
    c = np.array(me)  # 0-d
    raycoll.all_reduce_coalesced([a, b, c], op=raycoll.ReduceOp.MAX)
    outs = [[np.zeros((2, 2), np.int32), np.zeros(3, np.int32)] for _ in range(world_size)]
    ins = [np.full((2, 2), rank, np.int32), np.arange(3, dtype=np.int32) + 10 * rank]
    fut = raycoll.all_gather_coalesced(outs, ins, async_op=True)
    waited = fut.wait()
    single = np.full(2, me)
    raycoll.all_reduce_coalesced(single)  # one tensor, not in a list, as torch takes it
    # two fused calls so far (the async one counted): the next collective is #4
    mismatch = _outcome(lambda: raycoll.all_reduce(np.ones(1 + rank)))
    bad = [[np.zeros(1)]] * (world_size - (rank == 1))  # rank 1 passes one list too few
    wrong_len = _outcome(lambda: raycoll.all_gather_coalesced(bad, [np.ones(1)]))
    shapes = [np.ones(2)] if rank else [np.ones(1), np.ones(1)]  # same total, other shapes
    shape_mismatch = _outcome(lambda: raycoll.all_reduce_coalesced(shapes))
    return a, b, c, outs, waited is not None and waited[0] is outs[0][0], single, mismatch, \
        wrong_len, shape_mismatch


@pytest.mark.timeout(120)
def test_coalesced_collectives(ranks):
    W = 3
    results = ranks.run(_coalesced, W, W)
    for rank, (a, b, c, outs, waited, single, mismatch, wrong_len, shape_mismatch) in \
            enumerate(results):
        assert a.tolist() == [[3.0] * 3] * 2 and b.tolist() == [0.0, 6.0] and c == 3.0
        for r in range(W):
            assert outs[r][0].tolist() == [[r, r], [r, r]]
            assert outs[r][1].tolist() == [10 * r, 10 * r + 1, 10 * r + 2]
        assert waited  # the future's value is the output tensors
        assert single.tolist() == [6.0, 6.0]
        assert mismatch[0] == "CollectiveMismatchError" and "all_reduce #4" in mismatch[1]
        if rank == 1:
            assert wrong_len[0] == "TensorSizeError" and "one list per rank" in wrong_len[1]
        else:
            assert wrong_len[0] == "PeerArgumentError"
        assert shape_mismatch[0] == "CollectiveMismatchError" and "shapes" in shape_mismatch[1]


def _coalesced_torch(rank):
    import torch

    t = [torch.full((2,), rank + 1.0), torch.tensor([1 + 1j * rank], dtype=torch.complex64)]
    fut = raycoll.all_reduce_coalesced(t, async_op=True)
    fut.wait()
    return t[0].tolist(), t[1].tolist()


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_coalesced_torch_tensors(ranks):
    for first, second in ranks.run(_coalesced_torch, 2):
        assert first == [3.0, 3.0]
        assert second == [2 + 1j]


def _barrier_timeout(rank):
    import time
    from datetime import timedelta

    if rank == 1:
        time.sleep(4.0)  # rank 0's barrier times out meanwhile
    start = time.monotonic()
    got = _outcome(lambda: raycoll.barrier(timeout=timedelta(seconds=1)))
    return got, time.monotonic() - start


@pytest.mark.timeout(120)
def test_barrier_timeout_is_honoured(ranks):
    (kind, message), took = ranks.run(_barrier_timeout, 2)[0]
    assert kind == "DistTimeoutError" and "[1]" in message, message
    # far below the group's 60 s timeout: the barrier's own 1 s bound ended it
    assert took < 30.0, took


def _work_wait_and_source(rank):
    from datetime import timedelta

    x = np.ones(2)
    work = raycoll.all_reduce(x, async_op=True)
    waited = work.wait(timedelta(0))  # torch's default: no bound of its own
    negative = _outcome(lambda: work.wait(timedelta(seconds=-1)))
    out = {"waited": waited, "x": x.tolist(), "negative": negative[0]}
    if rank == 0:
        buf = np.zeros(3)
        recv = raycoll.irecv(buf)  # any source
        recv.wait()
        out["source"] = recv._source_rank()
        out["not_recv"] = _outcome(work._source_rank)[0]
    elif rank == 2:
        raycoll.send(np.full(3, 2.0), dst=0)
    return out


@pytest.mark.timeout(60)
def test_work_wait_zero_and_source_rank(ranks):
    results = ranks.run(_work_wait_and_source, 3)
    for got in results:
        assert got["waited"] is True and got["x"] == [3.0, 3.0]
        assert got["negative"] == "ValueError"
    assert results[0]["source"] == 2
    assert results[0]["not_recv"] == "RuntimeError"


def _reduce_ops(rank):
    out = {}
    x = np.ones(2, np.complex64)
    for name, op in (("MAX", raycoll.ReduceOp.MAX), ("MIN", raycoll.ReduceOp.MIN)):
        try:
            raycoll.all_reduce(x, op=op)
        except ValueError as exc:  # torch's type
            out[name] = (isinstance(exc, TypeError), str(exc))  # and raycoll's former one
    y = np.full(2, rank + 1.0)
    raycoll.all_reduce(y, op=raycoll.ReduceOp(raycoll.ReduceOp.MAX))
    out["own_ctor"] = y.tolist()
    out["redoptype"] = raycoll.ReduceOp.RedOpType.SUM == raycoll.ReduceOp.SUM
    return out


@pytest.mark.timeout(60)
def test_complex_max_min_raise_value_error_and_reduce_op_forms(ranks):
    for got in ranks.run(_reduce_ops, 2):
        for name in ("MAX", "MIN"):
            also_type_error, message = got[name]
            assert also_type_error and "complex" in message and name in message
        assert got["own_ctor"] == [2.0, 2.0]
        assert got["redoptype"]


def _torch_ops(rank):
    import torch
    import torch.distributed as dist

    R = dist.ReduceOp
    out = {}
    for key, op in (("enum", R.MAX), ("member", R.RedOpType.PRODUCT), ("instance", R(R.SUM)),
                    ("premul", dist._make_nccl_premul_sum(2.0)),
                    ("premul_tensor", dist._make_nccl_premul_sum(torch.tensor([3.0])))):
        t = torch.full((2,), rank + 2.0)
        raycoll.all_reduce(t, op=op)
        out[key] = t.tolist()
    out["premul_plain"] = _outcome(lambda: raycoll.all_reduce(torch.ones(1), op=R.PREMUL_SUM))
    out["not_an_op"] = _outcome(lambda: raycoll.all_reduce(torch.ones(1), op=3))
    return out


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_torch_reduce_op_objects_map(ranks):
    for got in ranks.run(_torch_ops, 2):  # rank inputs 2 and 3
        assert got["enum"] == [3.0, 3.0]
        assert got["member"] == [6.0, 6.0]
        assert got["instance"] == [5.0, 5.0]
        assert got["premul"] == [10.0, 10.0]
        assert got["premul_tensor"] == [15.0, 15.0]
        assert got["premul_plain"][0] == "ValueError" and "needs a factor" in got["premul_plain"][1]
        assert got["not_an_op"][0] == "TypeError" and "torch.distributed.ReduceOp" in got["not_an_op"][1]


def _size_errors(rank, world_size):
    caught = {}
    for name, call in (
            ("length", lambda: raycoll.all_gather([np.zeros(2)] * (world_size + 1), np.ones(2))),
            ("shape", lambda: raycoll.all_gather([np.zeros(3)] * world_size, np.ones(2)))):
        try:
            call()
        except RuntimeError as exc:  # what torch's and ray.util.collective's raise
            caught[name] = (isinstance(exc, ValueError), type(exc).__name__, str(exc))
    ro = np.ones(2)
    ro.setflags(write=False)
    caught["read_only"] = _outcome(lambda: raycoll.all_reduce(ro))
    return caught


@pytest.mark.timeout(60)
def test_size_errors_are_value_and_runtime_errors(ranks):
    for caught in ranks.run(_size_errors, 2, 2):
        for name in ("length", "shape"):
            also_value_error, kind, message = caught[name]
            assert also_value_error and kind == "TensorSizeError", caught
        assert "one tensor per rank: expected 2, got 3" in caught["length"][2]
        assert "tensor_list[0] has shape (3,)" in caught["shape"][2]
        kind, message = caught["read_only"]
        assert kind == "ValueError" and "tensor.copy()" in message and "np.array(tensor)" in message
