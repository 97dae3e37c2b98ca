"""Errors, not hangs: bad arguments, cross-rank mismatches and timeouts, on every rank."""

from __future__ import annotations

import time

import numpy as np
import pytest

import raycoll


def _outcome(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
        return type(exc).__name__, str(exc)
    return None


def _then_works(size):
    x = np.ones(3)
    raycoll.all_reduce(x)
    return x.tolist() == [float(size)] * 3


def _shape_mismatch(rank):
    n = 4 if rank == 0 else 5
    got = _outcome(lambda: raycoll.all_reduce(np.ones(n)))
    return got, _then_works(raycoll.get_world_size())


@pytest.mark.timeout(60)
def test_shape_mismatch_reported_on_every_rank_and_group_survives(ranks):
    for (kind, message), ok in ranks.run(_shape_mismatch, 3):
        assert kind == "CollectiveMismatchError"
        assert "shape" in message and "(4,)" in message and "(5,)" in message
        assert "all_reduce #1" in message and "ranks [0]" in message
        assert ok


def _op_and_root_mismatch(rank):
    a = _outcome(lambda: raycoll.all_reduce(np.ones(2), op=raycoll.ReduceOp.MAX if rank else raycoll.ReduceOp.SUM))
    b = _outcome(lambda: raycoll.broadcast(np.ones(2), src=rank))
    c = _outcome(lambda: raycoll.all_reduce(np.ones(2, dtype=np.float32 if rank else np.float64)))
    d = _outcome(lambda: raycoll.barrier() if rank else raycoll.all_reduce(np.ones(1)))
    return a, b, c, d, _then_works(2)


@pytest.mark.timeout(60)
def test_op_root_dtype_and_collective_mismatches(ranks):
    for a, b, c, d, ok in ranks.run(_op_and_root_mismatch, 2):
        assert a[0] == "CollectiveMismatchError" and "reduce_op" in a[1]
        assert b[0] == "CollectiveMismatchError" and "root" in b[1]
        assert c[0] == "CollectiveMismatchError" and "dtype" in c[1]
        assert d[0] == "CollectiveMismatchError" and "op" in d[1]
        assert ok


def _bad_arguments(rank):
    size = raycoll.get_world_size()
    results = {}
    ro = np.ones(3)
    ro.setflags(write=False)
    bad = {
        "read_only": lambda: raycoll.all_reduce(ro),
        "src_out_of_range": lambda: raycoll.broadcast(np.ones(2), src=7),
        "list_length": lambda: raycoll.all_gather([np.ones(2)], np.ones(2)),
        "wrong_output_size": lambda: raycoll.all_gather_into_tensor(np.ones(5), np.ones(2)),
        "not_a_tensor": lambda: raycoll.all_reduce([1, 2, 3]),
        "complex_max": lambda: raycoll.all_reduce(np.ones(2, np.complex64), op=raycoll.ReduceOp.MAX),
        "float_band": lambda: raycoll.all_reduce(np.ones(2), op=raycoll.ReduceOp.BAND),
        "premul_without_factor": lambda: raycoll.all_reduce(np.ones(2), op=raycoll.ReduceOp.PREMUL_SUM),
        "splits_sum": lambda: raycoll.all_to_all_single(np.ones(3), np.ones(3), [1] * size, [2] * size),
        "both_src": lambda: raycoll.broadcast(np.ones(1), src=0, group_src=0),
    }
    for name, call in bad.items():
        # only rank 0 passes the bad argument; the others call the valid twin
        if rank == 0:
            results[name] = _outcome(call)
        else:
            good = {
                "read_only": lambda: raycoll.all_reduce(np.ones(3)),
                "src_out_of_range": lambda: raycoll.broadcast(np.ones(2), src=0),
                "list_length": lambda: raycoll.all_gather([np.ones(2)] * size, np.ones(2)),
                "wrong_output_size": lambda: raycoll.all_gather_into_tensor(np.ones(2 * size), np.ones(2)),
                "not_a_tensor": lambda: raycoll.all_reduce(np.ones(3)),
                "complex_max": lambda: raycoll.all_reduce(np.ones(2, np.complex64), op=raycoll.ReduceOp.MAX),
                "float_band": lambda: raycoll.all_reduce(np.ones(2), op=raycoll.ReduceOp.BAND),
                "premul_without_factor": lambda: raycoll.all_reduce(np.ones(2)),
                "splits_sum": lambda: raycoll.all_to_all_single(np.ones(3), np.ones(3), [1] * size, [1] * size),
                "both_src": lambda: raycoll.broadcast(np.ones(1), src=0),
            }[name]
            start = time.monotonic()
            got = _outcome(good)
            results[name] = None if got is None else (*got, time.monotonic() - start)
    results["after"] = _then_works(size)
    return results


@pytest.mark.timeout(120)
def test_bad_arguments_fail_the_caller_and_its_peers_fast(ranks):
    expected = {
        "read_only": ("ValueError", "tensor = tensor.copy() (or np.array(tensor))"),
        "src_out_of_range": ("ValueError", "src=7"),
        "list_length": ("TensorSizeError", "tensor_list must have one tensor per rank"),
        "wrong_output_size": ("TensorSizeError", "output_tensor must have"),
        "not_a_tensor": ("TypeError", "tensor must be"),
        "complex_max": ("UnsupportedOpError", "complex"),  # a ValueError and a TypeError
        "float_band": ("UnsupportedOpError", "integer or bool"),
        "premul_without_factor": ("ValueError", "PREMUL_SUM(factor)"),
        "splits_sum": ("ValueError", "must sum to"),
        "both_src": ("ValueError", "not both"),
    }
    results = ranks.run(_bad_arguments, 3)
    for name, (kind, text) in expected.items():
        got = results[0][name]
        assert got is not None and got[0] == kind and text in got[1], (name, got)
        for peer in results[1:]:
            if name in ("complex_max", "float_band"):  # every rank's op is bad: all fail locally
                assert peer[name][0] == "UnsupportedOpError"
                continue
            peer_kind, peer_msg, took = peer[name]
            assert peer_kind == "PeerArgumentError", (name, peer[name])
            assert "rank 0 rejected its arguments" in peer_msg and text in peer_msg
            assert took < 10.0
    assert all(r["after"] for r in results)


def _timeout(rank):
    if rank == 2:
        return None  # never arrives
    start = time.monotonic()
    got = _outcome(lambda: raycoll.all_reduce(np.ones(2)))
    again = _outcome(lambda: raycoll.all_reduce(np.ones(2)))
    return got, time.monotonic() - start, again


@pytest.mark.timeout(120)
def test_timeout_names_missing_ranks_and_the_collective(ranks):
    results = ranks.run(_timeout, 3, timeout=3.0)
    for (kind, message), took, again in results[:2]:
        assert kind == "DistTimeoutError" and "Timed out" in message  # torch's phrase
        assert "all_reduce #1" in message and "ranks [2] never arrived" in message
        assert "rank 2 completed nothing" in message
        assert 2.5 < took < 30
        assert again[0] in ("GroupBrokenError", "DistTimeoutError")


def _work_wait_timeout(rank):
    if rank == 1:
        raycoll.barrier()  # seq 1 only; never reaches seq 2
        return None
    raycoll.barrier()
    work = raycoll.all_reduce(np.ones(2), async_op=True)
    start = time.monotonic()
    got = _outcome(lambda: work.wait(timeout=1.5))
    return got, time.monotonic() - start


@pytest.mark.timeout(120)
def test_work_wait_timeout_names_missing_rank(ranks):
    (kind, message), took = ranks.run(_work_wait_timeout, 2)[0]
    assert kind == "DistTimeoutError" and "Timed out" in message
    assert "ranks [1] had not arrived" in message and "barrier #1" in message
    assert 1.0 < took < 20
