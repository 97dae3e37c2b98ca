"""The lane of a group on one node (its node segment, raycoll/transport/segment.py): collectives
among ranks on one node go through it instead of the coordinator, with the same results and
the same errors (mismatches, rejected arguments, ranks on the other path) on every rank, at
once. Without the native core a group has no lane (the object store carries its collectives:
tests/test_collectives.py covers that), so these tests skip there."""

from __future__ import annotations

import time
from typing import Any, Dict, List

import numpy as np
import pytest

import raycoll
from helpers import all_reduces_on_one_core
from raycoll.native import core, native_status
from raycoll.world import world

pytestmark = pytest.mark.skipif(core is None, reason=f"the lane is the native core's node "
                                                     f"segment: {native_status()}")


def _outcome(fn: Any) -> Any:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, "", time.monotonic() - start


def _works() -> bool:
    x = np.ones(3)
    raycoll.all_reduce(x)
    return x.tolist() == [float(raycoll.get_world_size())] * 3


def _small_collectives(rank: int) -> Dict[str, Any]:
    w = raycoll.get_world_size()
    out: Dict[str, Any] = {}
    x = np.arange(5, dtype=np.float64) * (rank + 1)
    raycoll.all_reduce(x)
    out["all_reduce"] = x.tolist()
    y = np.full(3, rank, dtype=np.int32)
    raycoll.broadcast(y, src=w - 1)
    out["broadcast"] = y.tolist()
    g = np.zeros(2 * w, dtype=np.int64)
    raycoll.all_gather_into_tensor(g, np.array([rank, 10 * rank]))
    out["all_gather"] = g.tolist()
    rs = np.zeros(2)
    raycoll.reduce_scatter_tensor(rs, np.arange(2.0 * w) + rank)
    out["reduce_scatter"] = rs.tolist()
    sc = np.zeros(2)
    raycoll.scatter(sc, [np.full(2, 7.0 + j) for j in range(w)] if rank == 0 else None, src=0)
    out["scatter"] = sc.tolist()
    red = np.full(2, rank + 1.0)
    raycoll.reduce(red, dst=1, op=raycoll.ReduceOp.MAX)
    out["reduce"] = red.tolist()
    raycoll.barrier()
    pg = world().default
    out["lane_calls"] = pg.context.transport_calls
    return out


@pytest.mark.timeout(120)
def test_small_collectives_go_through_the_lane_with_the_coordinators_results(ranks):
    w = 3
    on_lane = ranks.run(_small_collectives, 3)
    off_lane = ranks.run(_small_collectives, 3, options={"transport": "store"})
    for rank, (a, b) in enumerate(zip(on_lane, off_lane)):
        assert a["lane_calls"] == 7, a  # every collective but the first (which set it up)
        assert b["lane_calls"] == 0, b
        for key in a:
            if key != "lane_calls":
                assert a[key] == b[key], (rank, key, a[key], b[key])
        assert a["all_reduce"] == (np.arange(5.0) * 6).tolist()
        assert a["broadcast"] == [w - 1] * 3
        assert a["all_gather"] == [0, 0, 1, 10, 2, 20]
        assert a["scatter"] == [7.0 + rank] * 2
    assert on_lane[1]["reduce"] == [3.0, 3.0]
    assert on_lane[0]["reduce"] == [1.0, 1.0]  # not the root: its buffer is left as it was


def _mismatch_across_paths(rank: int) -> Any:
    _works()  # the lane is set up
    # rank 0: an all_reduce (the lane); rank 1: an object collective, which goes through the
    # coordinator and the object store
    if rank == 0:
        got = _outcome(lambda: raycoll.all_reduce(np.ones(4)))
    else:
        got = _outcome(lambda: raycoll.all_gather_object([None, None], {"rank": rank}))
    return got, _works(), _works()


@pytest.mark.timeout(120)
def test_lane_rank_and_coordinator_rank_in_one_call_both_get_the_mismatch(ranks):
    for (kind, message, took), ok, again in ranks.run(_mismatch_across_paths, 2):
        assert kind == "CollectiveMismatchError", message
        assert "all_reduce" in message and "all_gather_object" in message, message
        assert took < 5.0, took
        assert ok and again


def _large_mismatch(rank: int) -> Any:
    _works()
    # both larger than one step of the segment: the first step shows the mismatch
    n = 600_000 if rank == 0 else 500_000
    got = _outcome(lambda: raycoll.all_reduce(np.ones(n)))
    big = np.full(700_000, rank + 1.0)
    raycoll.all_reduce(big)  # the group goes on, in several steps
    return got, bool((big == 3.0).all()), _works()


@pytest.mark.timeout(120)
def test_a_mismatch_in_a_large_collective_fails_it_on_every_rank_and_the_group_goes_on(
        ranks):
    results = ranks.run(_large_mismatch, 2)
    for (kind, message, took), big_ok, ok in results:
        assert kind == "CollectiveMismatchError", message
        assert "(600000,)" in message and "(500000,)" in message, message
        assert took < 5.0, took
        assert big_ok and ok
    assert results[0][0][1] == results[1][0][1]


def _mismatch_kept(rank: int) -> Any:
    _works()
    out, inp = (np.zeros(4), np.ones(2)) if rank == 0 else (np.zeros(6), np.ones(3))
    work = raycoll.all_gather_into_tensor(out, inp, async_op=True)
    got = _outcome(work.wait)
    # the failed Work keeps its error (and the error its traceback) while the group goes on:
    # no view of a peer's buffer may stay with them, or that peer could never write again
    g = np.zeros(4)
    raycoll.all_gather_into_tensor(g, np.full(2, rank + 1.0))
    return got, g.tolist(), _works(), work is not None


@pytest.mark.timeout(120)
def test_a_failed_lane_collective_kept_by_its_work_does_not_block_the_peers(ranks):
    for got, gathered, ok, _ in ranks.run(_mismatch_kept, 2, timeout=10.0):
        assert got[0] == "CollectiveMismatchError", got
        assert gathered == [1.0, 1.0, 2.0, 2.0] and ok


def _large_stall(rank: int) -> Any:
    _works()
    if rank == 1:
        time.sleep(3.5)
        return None
    return _outcome(lambda: raycoll.all_gather_into_tensor(np.zeros(2_000_000),
                                                           np.ones(1_000_000)))


@pytest.mark.timeout(120)
def test_a_large_collective_times_out_naming_the_missing_rank(ranks):
    kind, message, took = ranks.run(_large_stall, 2, timeout=2.0)[0]
    assert kind == "DistTimeoutError", message
    assert "all_gather_into_tensor #2" in message and "ranks [1] never arrived" in message
    assert 1.9 < took < 8.0, took


def _mismatch_on_lane(rank: int) -> Any:
    _works()
    dtype = np.float32 if rank == 0 else np.int32  # same size: both on the lane
    got = _outcome(lambda: raycoll.all_reduce(np.ones(4, dtype=dtype)))
    root = _outcome(lambda: raycoll.broadcast(np.ones(2), src=rank))
    other = _outcome(lambda: raycoll.barrier() if rank == 2 else raycoll.all_reduce(np.ones(1)))
    return got, root, other, _works()


@pytest.mark.timeout(120)
def test_mismatches_on_the_lane_are_reported_alike_on_every_rank(ranks):
    results = ranks.run(_mismatch_on_lane, 3)
    for got, root, other, ok in results:
        assert got[0] == "CollectiveMismatchError" and "dtype" in got[1], got
        assert "ranks [0] passed 'float32'" in got[1] and "ranks [1, 2] passed 'int32'" in got[1]
        assert root[0] == "CollectiveMismatchError" and "root" in root[1], root
        assert other[0] == "CollectiveMismatchError" and "op" in other[1], other
        assert ok
    assert len({r[0][1] for r in results}) == 1, "every rank must report the same mismatch"


def _rejects(rank: int) -> Any:
    _works()
    bad = _outcome(lambda: raycoll.broadcast(np.ones(2), src=7 if rank == 0 else 0))
    return bad, _works()


@pytest.mark.timeout(120)
def test_a_rank_rejecting_its_arguments_fails_its_lane_peers_at_once(ranks):
    results = ranks.run(_rejects, 3)
    assert results[0][0][0] == "ValueError", results[0]
    for (kind, message, took), ok in results[1:]:
        assert kind == "PeerArgumentError", message
        assert "rank 0 rejected its arguments" in message
        assert took < 2.0, took
    assert all(ok for _, ok in results)


def _stalls(rank: int) -> Any:
    _works()
    if rank == 1:
        time.sleep(3.5)
        return None
    return _outcome(lambda: raycoll.all_reduce(np.ones(2)))


@pytest.mark.timeout(120)
def test_lane_timeout_names_the_missing_rank_and_its_last_collective(ranks):
    results = ranks.run(_stalls, 3, timeout=2.0)
    for res in (results[0], results[2]):
        kind, message, took = res
        assert kind == "DistTimeoutError", res
        assert "all_reduce #2" in message and "ranks [1] never arrived" in message, message
        assert "rank 1 last completed all_reduce #1" in message, message
        assert 1.9 < took < 8.0, took


def _two_all_reduces(rank: int) -> int:
    _works()
    _works()
    return world().default.context.transport_calls


@pytest.mark.timeout(180)
def test_re_forming_groups_leaves_nothing_in_the_object_store(ranks):
    """Groups formed again and again over the same actors leave nothing behind in the
    object store (no channel, no object per formation)."""
    from helpers import store_used, wait_for

    assert ranks.run(_two_all_reduces, 3) == [2, 2, 2]
    assert ranks.run(_two_all_reduces, 2) == [2, 2]
    time.sleep(0.5)
    before = store_used()[0]
    for world_size in (3, 2, 3, 2, 3):
        assert ranks.run(_two_all_reduces, world_size) == [2] * world_size
    # Ray frees out-of-scope objects in batches: poll for it rather than sleep
    wait_for(lambda: store_used()[0] <= before + 50_000, timeout=30,
             what=f"store back near {before} bytes")


def _uneven_all_to_all(rank: int) -> Any:
    """all_to_all_single where only rank 0's part to rank 1 is large (5 MB, several steps of
    the segment) and the rest 3 elements; then a small one, and one whose pairs disagree."""
    w = raycoll.get_world_size()
    big = 5_000_000 // 8
    send = [big if (rank == 0 and j == 1) else 3 for j in range(w)]
    recv = [big if (j == 0 and rank == 1) else 3 for j in range(w)]
    x = np.concatenate([np.full(n, 100.0 * rank + j) for j, n in enumerate(send)])
    out = np.zeros(sum(recv))
    raycoll.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send)
    firsts = [float(out[sum(recv[:s])]) for s in range(w)]
    small = np.zeros(w)
    raycoll.all_to_all_single(small, np.arange(w, dtype=np.float64) + 10 * rank)
    bad = _outcome(lambda: raycoll.all_to_all_single(
        np.zeros(w + (1 if rank == 1 else 0)), np.zeros(w),
        output_split_sizes=[1] * (w - 1) + [1 + (1 if rank == 1 else 0)],
        input_split_sizes=[1] * w))
    return firsts, small.tolist(), bad, world().default.context.transport_calls


@pytest.mark.timeout(120)
def test_all_to_all_of_uneven_parts_runs_on_the_lane_and_a_disagreement_fails_alike(ranks):
    results = ranks.run(_uneven_all_to_all, 3)
    for rank, (firsts, small, bad, lane_calls) in enumerate(results):
        assert firsts == [100.0 * s + rank for s in range(3)], (rank, firsts)
        assert small == [float(rank + 10 * s) for s in range(3)], (rank, small)
        assert bad[0] == "CollectiveMismatchError", bad
        assert "rank 2 sends rank 1" in bad[1] and "but rank 1 expects" in bad[1], bad
        assert lane_calls == 3, lane_calls  # both all_to_alls and the failed one went there
    assert len({r[2][1] for r in results}) == 1, "every rank reports the same mismatch"


def _reject_behind_async(rank: int) -> Any:
    _works()
    x = np.full(1000, rank + 1.0)
    work = raycoll.all_reduce(x, async_op=True)
    bad = _outcome(lambda: raycoll.broadcast(np.ones(2), src=9 if rank == 0 else 0))
    work.wait()
    return x[:3].tolist(), bad, _works()


@pytest.mark.timeout(120)
def test_a_rejection_behind_an_async_collective_keeps_the_order(ranks):
    """The rejection must not overtake the async all_reduce queued before it on the lane."""
    for rank, (x, (kind, message, took), ok) in enumerate(ranks.run(_reject_behind_async, 3)):
        assert x == [6.0] * 3, (rank, x)
        assert kind == ("ValueError" if rank == 0 else "PeerArgumentError"), (rank, message)
        assert took < 2.0, took
        assert ok


def _join_on_lane(rank: int, notify: bool) -> Any:
    from raycoll.join import Join

    _works()  # the lane is set up: join rounds ride it

    class Reducer(raycoll.Joinable):
        def __init__(self) -> None:
            super().__init__()
            self.total = 0.0

        def join_hook(self, **kwargs: Any) -> raycoll.JoinHook:
            owner = self

            class Hook(raycoll.JoinHook):
                def main_hook(self) -> None:
                    raycoll.all_reduce(np.zeros(1))

                def post_hook(self, is_last_joiner: bool) -> None:
                    owner.last = is_last_joiner

            return Hook()

        @property
        def join_device(self) -> Any:
            return "cpu"

        @property
        def join_process_group(self) -> Any:
            return None

        def step(self) -> None:
            if notify:
                Join.notify_join_context(self)
            x = np.ones(1)
            raycoll.all_reduce(x)
            self.total += float(x[0])

    joinable = Reducer()
    try:
        with Join([joinable]):
            for _ in range(2 * rank):
                joinable.step()
    except raycoll.CollectiveMismatchError as exc:
        return "mismatch", str(exc)
    return joinable.total, joinable.last, world().default.context.transport_calls


@pytest.mark.timeout(120)
def test_join_rounds_ride_the_lane(ranks):
    results = ranks.run(_join_on_lane, 2, True)
    assert results[0][:2] == (0.0, False) and results[1][:2] == (2.0, True), results  # 1 + 0 (shadow)
    assert results[1][2] >= 1 + 2 * 2, results  # warm-up, then per step a round and an all_reduce
    messages = ranks.run(_join_on_lane, 2, False)
    for kind, message in messages:
        assert kind == "mismatch" and "join" in message and "all_reduce" in message, message
    assert "notify_join_context" in messages[0][1], messages[0]


def _overlapped_wait_cpu(rank: int) -> Any:
    """Rank 0 issues an async all_reduce its peers join 0.5 s late and 'computes' (sleeps)
    meanwhile: the CPU this process burns while the collective waits, and the result."""
    _works()  # the lane is set up
    x = np.full(4, float(rank + 1))
    if rank != 0:
        time.sleep(0.5)
        raycoll.all_reduce(x)
        return x.tolist(), None
    cpu = time.process_time()
    work = raycoll.all_reduce(x, async_op=True)
    time.sleep(0.45)  # the caller's own work, beside the collective
    burnt = time.process_time() - cpu
    work.wait()
    return x.tolist(), burnt


@pytest.mark.timeout(120)
def test_an_async_collective_waits_without_spinning_while_its_caller_computes(ranks):
    """An async collective nobody waits for yet sleeps between polls (never spins), leaving
    the core to its caller: the process burns far less than the 0.45 s it waited."""
    out = ranks.run(_overlapped_wait_cpu, 3)
    assert [x for x, _ in out] == [[6.0] * 4] * 3
    burnt = out[0][1]
    assert burnt < 0.15, f"the waiting async all_reduce burnt {burnt:.3f}s of CPU in 0.45s"


@pytest.mark.timeout(30)
def test_only_waits_inside_an_unwaited_overlapping_operation_are_kept_from_spinning():
    import threading

    from raycoll.transport.base import may_spin, overlapping

    waited = threading.Event()
    assert may_spin()
    with overlapping(waited):
        assert not may_spin()
        waited.set()
        assert may_spin()
    with overlapping(threading.Event()):
        seen: List[bool] = []
        other = threading.Thread(target=lambda: seen.append(may_spin()))
        other.start()
        other.join()
        assert seen == [True]  # per thread: only the worker running the operation
    assert may_spin()


def _on_one_core(rank: int, calls: int) -> Dict[str, Any]:
    def stats(total: float) -> Dict[str, Any]:
        plane = world().resolve(None).context._plane
        return {"sum": total, "calls": plane.calls, "spun_out": plane.spins_failed}

    return all_reduces_on_one_core(calls, stats)


@pytest.mark.timeout(120)
def test_ranks_sharing_a_core_stop_spinning_for_each_other(ranks):
    """Two lane ranks the scheduler put on one core: a spinning rank only delays its peer by
    the whole spin. Spinning backs off after a spin runs out, so only a handful of the 300
    collectives spin in vain (without the back-off, nearly every one would: ~280)."""
    for res in ranks.run(_on_one_core, 2, 300):
        assert res["sum"] == 2.0 and res["calls"] >= 300, res
        # a few back-off periods (16, 32, 64, ... collectives), each entered after spins ran
        # out in 3 collectives in a row
        assert res["spun_out"] <= 40, res
