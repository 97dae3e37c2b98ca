"""The scheduled algorithms (raycoll.algorithms.scheduled) on real rank actors over direct
connections: every algorithm right against numpy, each rank's counted traffic exactly the
schedule's formula, connections only to the peers a schedule pairs, more ranks than the
lane takes on one node, descriptors past 1,024, and a mismatch that fails every rank."""

from __future__ import annotations

import math
import time
from typing import Any, Dict

import numpy as np
import pytest
import ray

from helpers import every_op

import raycoll
from raycoll.native import core, native_status
from raycoll.algorithms.catalog import build
from raycoll.algorithms.counters import expected
from raycoll.algorithms.schedule import ALGORITHMS
from raycoll.algorithms.topology import Topology
from raycoll.testing import RankPool

SCHEDULED = {c: [a for a in algos if a not in ("direct", "direct_rsag")]
             for c, algos in ALGORITHMS.items()}
OPTION = {"all_reduce": "all_reduce_algo", "reduce_scatter": "reduce_scatter_algo",
          "all_gather": "all_gather_algo", "broadcast": "broadcast_algo",
          "reduce": "reduce_algo"}


pytestmark = pytest.mark.skipif(core is None,
                                reason=f"schedules run on the native sockets: {native_status()}")



@pytest.fixture(scope="module")
def pool(ray_local):
    with RankPool(max_world_size=8) as p:
        yield p


def _forcing(i: int) -> Dict[str, Any]:
    """Group options forcing the ``i``-th scheduled algorithm of every collective (a
    40,003-element float64 buffer is pipelined in 5 segments of at most 64 KiB)."""
    opts: Dict[str, Any] = {"transport": "tcp", "stream_bytes": 65536}
    for collective, algos in SCHEDULED.items():
        opts[OPTION[collective]] = algos[i % len(algos)]
    return opts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [3, 5])
@pytest.mark.parametrize("i", range(max(len(a) for a in SCHEDULED.values())))
def test_every_forced_algorithm_matches_numpy(pool, world, i):
    for n in (1, 7, 40_003):
        for rank, (bad, transport) in enumerate(
                pool.run(every_op, world, world, n, options=_forcing(i), timeout=60)):
            assert transport == "tcp", (rank, transport)
            assert bad == [], (rank, n, _forcing(i), bad)


def _one(rank: int, collective: str, n: int) -> Dict[str, Any]:
    from raycoll.world import world as the_world

    w = raycoll.get_world_size()
    x = np.arange(n, dtype=np.float32) + rank
    if collective == "all_reduce":
        raycoll.all_reduce(x)
    elif collective == "broadcast":
        raycoll.broadcast(x, src=1)
    elif collective == "reduce":
        raycoll.reduce(x, dst=1)
    elif collective == "reduce_scatter":
        raycoll.reduce_scatter_tensor(np.empty(n // w, np.float32), x)
    else:
        raycoll.all_gather_into_tensor(np.empty(n, np.float32), x[: n // w].copy())
    group = the_world().default
    route = group.last_route
    return {"counters": group.counters(), "rounds": route.rounds if route else 0,
            "transport": route.transport if route else None}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("collective", list(SCHEDULED))
def test_each_ranks_counted_traffic_is_the_schedules_formula(pool, collective):
    world, n = 5, 5 * 64
    topo = Topology.flat(world)
    for algo in SCHEDULED[collective]:
        got = pool.run(_one, world, collective, n, options={"transport": "tcp",
                                                           OPTION[collective]: algo})
        want = expected(build(collective, algo, topo, n, root=1), topo, 4)
        for rank, (g, w) in enumerate(zip(got, want)):
            op = {"reduce_scatter": "reduce_scatter_tensor",
                  "all_gather": "all_gather_into_tensor"}.get(collective, collective)
            assert g["counters"]["collectives"][op] == w, (algo, rank)
            assert g["rounds"] == w["rounds"], (algo, rank)
            assert g["transport"] == "tcp"


def _sockets_after(rank: int, n: int) -> Dict[str, Any]:
    from raycoll.world import world as the_world

    for _ in range(3):
        x = np.ones(n, np.float32)
        raycoll.all_reduce(x)
        assert float(x[0]) == raycoll.get_world_size()
        raycoll.broadcast(x, src=0)
        raycoll.barrier()
    group = the_world().default
    return {"counters": group.counters(), "transport": group.transport_name}


@pytest.mark.timeout(420)
def test_sixteen_ranks_on_one_node_go_direct_and_connect_to_few_peers(ray_local):
    """16 ranks on one node on direct connections (``transport="tcp"``: with the native core
    they would take the node segment; without it, more than the lane takes here, twice the
    cores, take direct connections too), with the cost model's algorithms: a rank holds at
    most 4 log2(W) = 16 collective sockets (the full mesh would be 2 (W - 1) = 30)."""
    world = 16
    with RankPool(max_world_size=world) as big:
        for n in (1, 1 << 18):
            for rank, got in enumerate(big.run(_sockets_after, world, n, timeout=120,
                                               options={"transport": "tcp"})):
                assert got["transport"] == "tcp", rank
                assert 0 < got["counters"]["sockets"] <= 4 * int(math.log2(world)), (n, rank, got)
                assert got["counters"]["collectives"]["all_reduce"]["peers"] < world - 1


def _many_descriptors(rank: int) -> Any:
    import os

    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert max(held) > 1024
        return every_op(rank, raycoll.get_world_size(), 33)
    finally:
        for fd in held:
            os.close(fd)


@pytest.mark.timeout(300)
def test_direct_connections_wait_on_descriptors_past_1024(pool):
    for rank, (bad, transport) in enumerate(pool.run(_many_descriptors, 3, options={
            "transport": "tcp", "all_reduce_algo": "ring"})):
        assert transport == "tcp" and bad == [], (rank, bad)


def _mismatched(rank: int) -> str:
    x = np.ones(100 if rank != 2 else 101, np.float32)
    start = time.monotonic()
    try:
        raycoll.all_reduce(x)
    except raycoll.RaycollError as exc:
        return f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}"
    return "no error"


@pytest.mark.timeout(300)
def test_a_mismatch_in_a_scheduled_collective_fails_every_rank_fast(pool):
    got = pool.run(_mismatched, 4, options={"transport": "tcp", "all_reduce_algo": "ring"},
                   timeout=60)
    for rank, message in enumerate(got):
        assert message != "no error", rank
        seconds = float(message.split(" after ")[1].split("s:")[0])
        assert seconds < 20, (rank, message)  # far below the group's 60 s timeout
    assert any("CollectiveMismatchError" in m for m in got), got
    assert all("shape" in m or "mismatch" in m.lower() or "broken" in m for m in got), got



def _status_after_ring(rank: int) -> Any:
    x = np.ones(4096, np.float32)
    raycoll.all_reduce(x)
    assert float(x[0]) == raycoll.get_world_size()
    from raycoll.world import world as the_world

    name = the_world().default.group_name
    status = raycoll.group_status(name) if rank == 0 else None
    raycoll.barrier()  # every rank stays until rank 0 has its answer
    return status


@pytest.mark.timeout(120)
def test_group_status_shows_the_chosen_algorithm_and_each_ranks_counters(pool):
    world = 4
    status = pool.run(_status_after_ring, world,
                      options={"transport": "tcp", "all_reduce_algo": "ring"})[0]
    assert status["transport"] == "tcp", status
    assert status["algorithms"].get("all_reduce") == "ring", status["algorithms"]
    assert "all_reduce ring" in status["summary"], status["summary"]
    # a ring all_reduce of n bytes sends 2 (W - 1) / W n a rank, all to one node-mate
    n = 4096 * 4
    for g, info in status["ranks"].items():
        counts = info["counters"]["collectives"]["all_reduce"]
        assert counts["bytes_sent_same_node"] == 2 * (world - 1) * n // world, (g, counts)
        assert counts["peers"] == 2, (g, counts)
