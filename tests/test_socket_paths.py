"""gather, scatter and all_to_all on the native executor over direct connections
(raycoll/backends/socket_paths.py): a group with ``transport="tcp"`` on this node (the same
code runs between nodes). Each result against numpy, nothing through the coordinator
(no step in the last route), the messages each rank counts, and an all_to_all whose pairs disagree
failing on every rank with the pairs named, the group going on."""

from __future__ import annotations

import os
from typing import Any, Dict, List

import numpy as np
import pytest

import raycoll
from helpers import all_reduces_on_one_core
from raycoll.native import core, native_status
from raycoll.world import world

TCP = {"transport": "tcp"}


pytestmark = pytest.mark.skipif(core is None,
                                reason=f"the native executor's paths: {native_status()}")



def _coordinator_steps() -> Any:
    """The last collective's steps through the coordinator (none where it ran natively)."""
    return world().default.last_route.steps


def _gather_scatter(rank: int, n: int) -> Dict[str, Any]:
    w = raycoll.get_world_size()
    out: Dict[str, Any] = {}
    mine = np.arange(n, dtype=np.float64) + 100 * rank
    got = [np.zeros(n) for _ in range(w)] if rank == 1 else None
    raycoll.gather(mine, got, dst=1)
    if rank == 1:
        out["gather"] = all(np.array_equal(g, np.arange(n) + 100 * j) for j, g in enumerate(got))
    counts = world().default.counters()["collectives"]["gather"]
    out["gather_msgs"] = (counts["messages_sent"], counts["messages_recv"])
    out["gather_bytes"] = counts["bytes_recv_same_node"] + counts["bytes_recv_other_node"]
    piece = np.zeros(n, dtype=np.int32)
    pieces = [np.full(n, 7 * j, dtype=np.int32) for j in range(w)] if rank == 2 else None
    raycoll.scatter(piece, pieces, src=2)
    out["scatter"] = bool((piece == 7 * rank).all())
    out["steps"] = _coordinator_steps()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [1, 70_000], ids=["4B", "large"])
def test_gather_and_scatter_go_natively_with_one_message_each_way_per_pair(ranks, n):
    results = ranks.run(_gather_scatter, 3, n, options=TCP, timeout=120)
    assert results[1]["gather"], results
    for rank, res in enumerate(results):
        assert res["scatter"], (rank, res)
        assert res["steps"] == (), (rank, res)  # nothing through the coordinator
        # every rank meets every other (one message each way a pair: the data, or empty)
        assert res["gather_msgs"] == (2, 2), (rank, res)
    assert results[1]["gather_bytes"] == 2 * n * 8
    assert results[0]["gather_bytes"] == 0 and results[2]["gather_bytes"] == 0


def _all_to_all(rank: int) -> Dict[str, Any]:
    w = raycoll.get_world_size()
    # rank r sends rank j (r + j) % 3 + 1 rows of 2: sizes differ per pair
    rows = [(rank + j) % 3 + 1 for j in range(w)]
    ins = [np.full((rows[j], 2), 10 * rank + j, dtype=np.float32) for j in range(w)]
    outs = [np.zeros(((s + rank) % 3 + 1, 2), dtype=np.float32) for s in range(w)]
    raycoll.all_to_all(outs, ins)
    lists = all((o == 10 * s + rank).all() for s, o in enumerate(outs))
    src = np.concatenate(ins)
    out = np.zeros((sum(o.shape[0] for o in outs), 2), dtype=np.float32)
    raycoll.all_to_all_single(out, src, [o.shape[0] for o in outs], rows)
    single = np.array_equal(out, np.concatenate(outs))
    return {"lists": bool(lists), "single": bool(single), "steps": _coordinator_steps()}


@pytest.mark.timeout(180)
def test_all_to_all_with_sizes_that_differ_per_pair_goes_natively(ranks):
    results = ranks.run(_all_to_all, 3, options=TCP, timeout=120)
    for rank, res in enumerate(results):
        assert res == {"lists": True, "single": True, "steps": ()}, (rank, res)


def _disagree(rank: int) -> List[Any]:
    w = raycoll.get_world_size()
    # rank 0 sends rank 1 three rows; rank 1 expects two from it
    send = [2] * w
    recv = [2] * w
    if rank == 0:
        send[1] = 3
    src = np.ones((sum(send), 4), dtype=np.float32)
    out = np.zeros((sum(recv), 4), dtype=np.float32)
    try:
        raycoll.all_to_all_single(out, src, recv, send)
        first: Any = None
    except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
        first = (type(exc).__name__, str(exc))
    x = np.full(3, float(rank))
    raycoll.all_reduce(x)
    return [first, x.tolist(), _coordinator_steps()]


@pytest.mark.timeout(180)
def test_an_all_to_all_whose_pairs_disagree_fails_on_every_rank_and_the_group_goes_on(ranks):
    results = ranks.run(_disagree, 3, options=TCP, timeout=120)
    for rank, (first, after, steps) in enumerate(results):
        assert first is not None and first[0] == "CollectiveMismatchError", (rank, first)
        assert "rank 0 sends rank 1 dtype=float32, shape=(3, 4) but rank 1 expects " \
               "dtype=float32, shape=(2, 4)" in first[1], (rank, first)
        assert after == [3.0] * 3, (rank, after)
        assert steps == (), (rank, steps)


def _short_path(rank: int, calls: int) -> Dict[str, Any]:
    """all_reduce's short path on native sockets replays what the full path ran for an
    array of the same dtype and size; rank 1 takes the full path (async) throughout."""
    pg = world().default
    out: Dict[str, Any] = {"sums": []}

    def all_reduce(x: np.ndarray) -> None:
        if rank == 1:
            raycoll.all_reduce(x, async_op=True).wait(timeout=60)
        else:
            raycoll.all_reduce(x)

    for i in range(calls):
        x = np.full(4, float(rank + i))
        all_reduce(x)
        out["sums"].append(x.tolist())
    out["fast"] = len(pg.context._plane._fast)
    counts = pg.counters()["collectives"]
    out["all_reduce_msgs"] = counts["all_reduce"]["messages_sent"]
    raycoll.broadcast(np.zeros(3), src=0)  # another kind: counted apart
    out["broadcast_msgs"] = pg.counters()["collectives"]["broadcast"]["messages_sent"]
    # the same dtype and size in another shape: its fingerprint differs, on every rank
    y = np.ones((2, 2)) if rank == 0 else np.ones(4)
    try:
        all_reduce(y)
        out["mismatch"] = None
    except raycoll.CollectiveMismatchError as exc:
        out["mismatch"] = str(exc)
    z = np.full(4, float(rank))
    all_reduce(z)  # the group goes on
    out["after"] = z.tolist()
    return out


@pytest.mark.timeout(180)
def test_all_reduces_short_path_on_sockets_meets_the_full_path_and_counts_alike(ranks):
    calls = 30
    results = ranks.run(_short_path, 2, calls, options=TCP, timeout=120)
    for rank, res in enumerate(results):
        assert res["sums"] == [[2.0 * i + 1] * 4 for i in range(calls)], (rank, res)
        assert res["all_reduce_msgs"] == calls, (rank, res)  # one message a call, each counted
        assert res["broadcast_msgs"] == (1 if rank == 0 else 0), (rank, res)
        assert res["mismatch"] is not None and "shape" in res["mismatch"], (rank, res)
        assert res["after"] == [1.0] * 4, (rank, res)
    assert results[0]["fast"] >= 1  # rank 0 ran the short path


def _sockets_on_one_core(rank: int, calls: int) -> Dict[str, Any]:
    def stats(total: float) -> Dict[str, Any]:
        native = world().default.context._plane
        return {"sum": total, "runs": native._runs, "spun_out": native.spins_failed}

    return all_reduces_on_one_core(calls, stats)


@pytest.mark.timeout(180)
def test_socket_waits_stop_spinning_where_spins_keep_running_out(ranks):
    """Two ranks on native sockets that the scheduler put on one core: a spin only delays
    the peer it waits for. The core counts waits whose spin ran out, and spinning backs off,
    so only a handful of the 300 collectives spin in vain (without the back-off, nearly
    every one would)."""
    if os.cpu_count() is not None and os.cpu_count() < 2:  # pragma: no cover - 1-core hosts
        pytest.skip("the ranks spin only where they fit the host's cores (needs 2)")
    for res in ranks.run(_sockets_on_one_core, 2, 300, options=TCP, timeout=150):
        assert res["sum"] == 2.0 and res["runs"] >= 300, res
        assert 1 <= res["spun_out"] <= 40, res
