"""Every collective against a numpy reference, on real Ray actors, world sizes 1 to 4."""

from __future__ import annotations

import numpy as np
import pytest

import raycoll
from helpers import DTYPES, assert_close, cases, data, op_of, reference

WORLD_SIZES = [1, 2, 3, 4]
SIZES = (0, 1, 7, 50_001)  # empty, one, not divisible by any world size, beyond inline size


def _all_reduce_many(rank, todo):
    out = []
    for dtype, op, n in todo:
        x = data(rank, (n,), dtype)
        raycoll.all_reduce(x, op=op_of(op))
        out.append(x)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_every_dtype_op_and_size(ranks, world_size):
    todo = cases(SIZES)
    results = ranks.run(_all_reduce_many, world_size, todo)
    for i, (dtype, op, n) in enumerate(todo):
        want = reference(op, [data(r, (n,), dtype) for r in range(world_size)])
        for r in range(world_size):
            assert_close(results[r][i], want, f"all_reduce {op} {dtype} n={n} rank {r}")
            np.testing.assert_array_equal(results[r][i], results[0][i])  # identical everywhere


def _big(rank, shape):
    x = np.full(shape, rank + 1, dtype=np.float32)
    x.reshape(-1)[::1000] = rank  # not uniform
    raycoll.all_reduce(x)
    return float(x.sum(dtype=np.float64)), x.shape, x.reshape(-1)[:2000].copy()


@pytest.mark.timeout(120)
def test_all_reduce_16_mib_2d(ranks):
    shape = (2048, 2048)  # 16 MiB of float32
    results = ranks.run(_big, 3, shape)
    inputs = []
    for r in range(3):
        x = np.full(shape, r + 1, dtype=np.float32)
        x.reshape(-1)[::1000] = r
        inputs.append(x)
    want = sum(inputs)
    for total, got_shape, head in results:
        assert got_shape == shape
        assert total == pytest.approx(float(want.sum(dtype=np.float64)))
        np.testing.assert_array_equal(head, want.reshape(-1)[:2000])


def _movement(rank, world_size, dtype, n):
    me = data(rank, (n, 3), dtype)
    out = {}
    b = me.copy()
    raycoll.broadcast(b, src=world_size - 1)
    out["broadcast"] = b
    lst = [np.empty_like(me) for _ in range(world_size)]
    raycoll.all_gather(lst, me)
    out["all_gather"] = lst
    flat = np.empty((world_size * n, 3), dtype=dtype)
    raycoll.all_gather_into_tensor(flat, me)
    out["all_gather_into_tensor"] = flat
    gl = [np.empty_like(me) for _ in range(world_size)] if rank == 0 else None
    raycoll.gather(me, gl, dst=0)
    out["gather"] = gl
    sc = np.empty_like(me)
    raycoll.scatter(sc, [data(j, (n, 3), dtype, salt=7) for j in range(world_size)]
                    if rank == 1 % world_size else None, src=1 % world_size)
    out["scatter"] = sc
    red = me.copy()
    raycoll.reduce(red, dst=0, op=raycoll.ReduceOp.MAX if dtype != "complex64" else raycoll.ReduceOp.SUM)
    out["reduce"] = red
    return out


def _movement_all(rank, world_size, n):
    return [_movement(rank, world_size, dtype, n) for dtype in DTYPES]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("n", [0, 1, 20_000])
def test_data_movement(ranks, world_size, n):
    per_dtype = ranks.run(_movement_all, world_size, world_size, n)
    for i, dtype in enumerate(DTYPES):
        results = [per_rank[i] for per_rank in per_dtype]
        inputs = [data(r, (n, 3), dtype) for r in range(world_size)]
        for r, got in enumerate(results):
            what = f"{dtype} n={n} rank {r}"
            assert_close(got["broadcast"], inputs[-1], "broadcast " + what)
            for s in range(world_size):
                assert_close(got["all_gather"][s], inputs[s], f"all_gather[{s}] {what}")
            assert_close(got["all_gather_into_tensor"], np.concatenate(inputs), "agit " + what)
            assert_close(got["scatter"], data(r, (n, 3), dtype, salt=7), "scatter " + what)
            if r == 0:
                for s in range(world_size):
                    assert_close(got["gather"][s], inputs[s], f"gather[{s}] {what}")
                op = "MAX" if dtype != "complex64" else "SUM"
                assert_close(got["reduce"], reference(op, inputs), "reduce " + what)
            else:
                assert got["gather"] is None
                assert_close(got["reduce"], inputs[r], "reduce leaves non-dst input " + what)


def _reduce_scatter(rank, world_size, dtype, n, op):
    pieces = [data(rank, (n,), dtype, salt=j) for j in range(world_size)]
    out = np.empty((n,), dtype=dtype)
    raycoll.reduce_scatter(out, pieces, op=op_of(op))
    flat_in = np.concatenate(pieces)
    out2 = np.empty((n,), dtype=dtype)
    raycoll.reduce_scatter_tensor(out2, flat_in, op=op_of(op))
    out3 = np.empty((n,), dtype=dtype)
    raycoll.reduce_scatter_single(out3, flat_in, op=op_of(op))
    return out, out2, out3


def _reduce_scatter_all(rank, world_size, n, combos):
    return [_reduce_scatter(rank, world_size, dtype, n, op) for dtype, op in combos]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("n", [0, 5, 30_000])
def test_reduce_scatter(ranks, world_size, n):
    combos = [("float32", "SUM"), ("int64", "MAX"), ("complex64", "PRODUCT"),
              ("bool", "BOR"), ("float64", "AVG"), ("int32", "BXOR")]
    per_combo = ranks.run(_reduce_scatter_all, world_size, world_size, n, combos)
    for i, (dtype, op) in enumerate(combos):
        results = [per_rank[i] for per_rank in per_combo]
        for r, outs in enumerate(results):
            want = reference(op, [data(s, (n,), dtype, salt=r) for s in range(world_size)])
            for k, got in enumerate(outs):
                assert_close(got, want, f"reduce_scatter variant {k} {op} {dtype} rank {r}")


def _all_to_all(rank, world_size, dtype):
    # uneven: rank r sends (r + j + 1) rows to rank j
    ins = [data(rank, (rank + j + 1, 2), dtype, salt=j) for j in range(world_size)]
    outs = [np.empty((s + rank + 1, 2), dtype=dtype) for s in range(world_size)]
    raycoll.all_to_all(outs, ins)
    in_splits = [rank + j + 1 for j in range(world_size)]
    out_splits = [s + rank + 1 for s in range(world_size)]
    single_out = np.empty((sum(out_splits), 2), dtype=dtype)
    raycoll.all_to_all_single(single_out, np.concatenate(ins), out_splits, in_splits)
    even_in = (np.arange(world_size * 4).reshape(world_size * 2, 2) + rank * 100).astype(dtype)
    even_out = np.empty_like(even_in)
    raycoll.all_to_all_single(even_out, even_in)
    return outs, single_out, even_out


def _all_to_all_all(rank, world_size, dtypes):
    return [_all_to_all(rank, world_size, dtype) for dtype in dtypes]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all_uneven(ranks, world_size):
    dtypes = ("float32", "int64", "bool")
    per_dtype = ranks.run(_all_to_all_all, world_size, world_size, dtypes)
    for i, dtype in enumerate(dtypes):
        results = [per_rank[i] for per_rank in per_dtype]
        for r, (outs, single, even) in enumerate(results):
            want = [data(s, (s + r + 1, 2), dtype, salt=r) for s in range(world_size)]
            for s in range(world_size):
                assert_close(outs[s], want[s], f"all_to_all from {s} to {r} {dtype}")
            assert_close(single, np.concatenate(want), f"all_to_all_single rank {r} {dtype}")
            even_want = np.concatenate([
                (np.arange(world_size * 4).reshape(world_size * 2, 2) + s * 100).astype(dtype)[2 * r:2 * r + 2]
                for s in range(world_size)])
            assert_close(even, even_want, f"even all_to_all_single rank {r} {dtype}")


def _all_to_all_big(rank, world_size):
    n = 40_000
    ins = [np.full(n, rank * 10 + j, dtype=np.float32) for j in range(world_size)]
    outs = [np.empty(n, dtype=np.float32) for _ in range(world_size)]
    raycoll.all_to_all(outs, ins)
    return [float(o[0]) for o in outs] + [float(o[-1]) for o in outs]


@pytest.mark.timeout(120)
def test_all_to_all_large_payloads(ranks):
    results = ranks.run(_all_to_all_big, 3, 3)
    for r, got in enumerate(results):
        assert got == [float(s * 10 + r) for s in range(3)] * 2


def _async(rank, world_size):
    xs = [np.full(10, float(rank + i)) for i in range(5)]
    works = [raycoll.all_reduce(x, async_op=True) for x in xs]
    big = np.full(100_000, float(rank), dtype=np.float32)
    works.append(raycoll.broadcast(big, src=0, async_op=True))
    future = works[0].get_future()
    flags = []
    for w in works:
        assert w.wait(timeout=60) is True
        flags.append((w.is_completed(), w.is_success(), w.exception() is None))
    value = future.wait()
    sync = np.ones(3)
    raycoll.all_reduce(sync)  # after async ops: issue order kept
    return [x[0] for x in xs], float(big[-1]), flags, value[0][0], sync.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 3])
def test_async_ops_complete_in_issue_order(ranks, world_size):
    for xs, big_last, flags, fut_value, sync in ranks.run(_async, world_size, world_size):
        assert xs == [sum(r + i for r in range(world_size)) for i in range(5)]
        assert big_last == 0.0
        assert flags == [(True, True, True)] * 6
        assert fut_value == xs[0]
        assert sync == [float(world_size)] * 3


def _p2p(rank, world_size):
    out = {}
    if rank == 0:
        raycoll.send(np.arange(5.0), dst=1)
        big = np.arange(100_000, dtype=np.float64)
        raycoll.send(big, dst=1, tag=3)
        buf = np.empty(4, dtype=np.int64)
        out["src"] = raycoll.recv(buf, tag=5)  # from any rank
        out["buf"] = buf
    elif rank == 1:
        a = np.empty(5)
        out["src_a"] = raycoll.recv(a, src=0)
        b = np.empty(100_000)
        out["src_b"] = raycoll.recv(b, src=0, tag=3)
        out["a"], out["b_sum"] = a, float(b.sum())
        raycoll.send(np.array([7, 8, 9, 10]), dst=0, tag=5)
    # a ring with isend/irecv and batch_isend_irecv
    send_buf = np.full(3, float(rank))
    recv_buf = np.empty(3)
    ops = [raycoll.P2POp(raycoll.isend, send_buf, (rank + 1) % world_size),
           raycoll.P2POp(raycoll.irecv, recv_buf, (rank - 1) % world_size)]
    for work in raycoll.batch_isend_irecv(ops):
        work.wait(timeout=60)
    out["ring"] = recv_buf
    w = raycoll.isend(np.full(2, rank), dst=(rank + 1) % world_size, tag=9)
    r2 = np.empty(2, dtype=np.int64)
    wr = raycoll.irecv(r2, src=(rank - 1) % world_size, tag=9)
    w.wait(timeout=60)
    wr.wait(timeout=60)
    out["irecv"], out["irecv_src"] = r2, wr.source_rank()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_point_to_point(ranks, world_size):
    results = ranks.run(_p2p, world_size, world_size)
    assert results[0]["src"] == 1
    assert results[0]["buf"].tolist() == [7, 8, 9, 10]
    assert results[1]["src_a"] == 0 and results[1]["src_b"] == 0
    assert results[1]["a"].tolist() == list(np.arange(5.0))
    assert results[1]["b_sum"] == float(np.arange(100_000).sum())
    for r, got in enumerate(results):
        prev = (r - 1) % world_size
        assert got["ring"].tolist() == [float(prev)] * 3
        assert got["irecv"].tolist() == [prev] * 2 and got["irecv_src"] == prev


def _objects(rank, world_size):
    gathered = [None] * world_size
    raycoll.all_gather_object(gathered, {"rank": rank, "payload": list(range(rank))})
    lst = [f"from-{rank}", rank] if rank == 0 else [None, None]
    raycoll.broadcast_object_list(lst, src=0)
    got = [None] * world_size if rank == 0 else None
    raycoll.gather_object(("x", rank), got, dst=0)
    out = [None]
    raycoll.scatter_object_list(out, [{"to": j} for j in range(world_size)] if rank == 0 else None, src=0)
    return gathered, lst, got, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 3])
def test_object_collectives(ranks, world_size):
    for r, (gathered, lst, got, out) in enumerate(ranks.run(_objects, world_size, world_size)):
        assert gathered == [{"rank": s, "payload": list(range(s))} for s in range(world_size)]
        assert lst == ["from-0", 0]
        assert got == ([("x", s) for s in range(world_size)] if r == 0 else None)
        assert out == [{"to": r}]


#: The rank that comes late to each barrier of _barrier, in turn.
_LATE = {"barrier": 3, "monitored_barrier": 0, "async barrier": 2}


def _barrier(rank, markers):
    """Each barrier has one late rank: it 'computes' a while (the scenario), leaves a marker
    file, then enters. A barrier that did not wait for it returns before the marker exists.
    Returns, per barrier, whether this rank found the late rank's marker once it returned."""
    import os
    import time

    def late(kind):
        if rank == _LATE[kind]:
            time.sleep(0.5)
            with open(os.path.join(markers, kind), "w"):
                pass

    def saw(kind):
        return os.path.exists(os.path.join(markers, kind))

    seen = {}
    late("barrier")
    raycoll.barrier()
    seen["barrier"] = saw("barrier")
    late("monitored_barrier")
    raycoll.monitored_barrier(timeout=30)
    seen["monitored_barrier"] = saw("monitored_barrier")
    late("async barrier")
    work = raycoll.barrier(async_op=True)
    seen["waited"] = work.wait(timeout=30)
    seen["async barrier"] = saw("async barrier")
    return seen


@pytest.mark.timeout(60)
def test_barriers(ranks, tmp_path):
    """No rank leaves a barrier before the last one entered it (the ranks share this
    machine's file system: the late rank's marker is there for all of them)."""
    want = {"barrier": True, "monitored_barrier": True, "async barrier": True, "waited": True}
    assert ranks.run(_barrier, 4, str(tmp_path)) == [want] * 4


def _non_contiguous(rank):
    base = np.arange(20.0).reshape(4, 5) * (rank + 1)
    view = base[:, ::2]  # non-contiguous output, written in place
    raycoll.all_reduce(view)
    return base


@pytest.mark.timeout(60)
def test_non_contiguous_output_written_in_place(ranks):
    results = ranks.run(_non_contiguous, 2)
    for rank, got in enumerate(results):
        want = np.arange(20.0).reshape(4, 5) * (rank + 1)
        want[:, ::2] = np.arange(20.0).reshape(4, 5)[:, ::2] * 3
        np.testing.assert_array_equal(got, want)
