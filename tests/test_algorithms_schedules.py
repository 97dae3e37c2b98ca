"""Every algorithm's schedule against numpy, in the step simulator and on one thread a rank
(plain Python and numpy: no Ray)."""

from __future__ import annotations

from typing import List

import numpy as np
import pytest

from schedule_reference import run_threads, simulate
from raycoll.algorithms.catalog import build
from raycoll.algorithms.schedule import ALGORITHMS, Schedule, blocks, validate
from raycoll.algorithms.topology import Topology
from raycoll.reduce_op import ReduceOp

WORLDS = [1, 2, 3, 4, 5, 7, 8, 16]


def _topologies(world: int) -> List[Topology]:
    """One node, and a few uneven and even node maps of ``world`` ranks."""
    out = [Topology.flat(world)]
    if world >= 2:
        out.append(Topology.from_sizes([world - 1, 1]))
        out.append(Topology.from_sizes([world // 2, world - world // 2]))
    if world >= 4:
        out.append(Topology.from_sizes([2] * (world // 2) + [1] * (world % 2)))
        out.append(Topology.from_sizes([1] * world))
    return out


def _sizes(world: int) -> List[int]:
    return sorted({0, 1, world - 1, world, 2 * world + 3, 5 * world})


def _inputs(world: int, n: int, seed: int) -> List[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-50, 50, size=n).astype(np.int64) for _ in range(world)]


def _expected(schedule: Schedule, inputs: List[np.ndarray], op: ReduceOp) -> List[np.ndarray]:
    """What numpy says each rank holds after the collective (None: anything)."""
    world, n, root = schedule.world_size, schedule.n, schedule.root
    ufunc = {"SUM": np.add, "MAX": np.maximum, "MIN": np.minimum, "BXOR": np.bitwise_xor,
             "PRODUCT": np.multiply}[op.name]
    total = ufunc.reduce(np.stack(inputs), axis=0) if inputs else None
    if schedule.collective == "broadcast":
        return [inputs[root]] * world
    if schedule.collective == "all_gather":
        parts = blocks(0, n, world)
        return [np.concatenate([inputs[r][lo:hi] for r, (lo, hi) in enumerate(parts)])] * world
    assert total is not None
    return [total] * world


def _check(schedule: Schedule, got: List[np.ndarray], want: List[np.ndarray]) -> None:
    for r in range(schedule.world_size):
        lo, hi = schedule.results[r]
        np.testing.assert_array_equal(got[r][lo:hi], want[r][lo:hi],
                                      err_msg=f"{schedule.collective}/{schedule.algorithm} "
                                              f"W={schedule.world_size} n={schedule.n} rank {r}")


def _cases():
    for world in WORLDS:
        for topo in _topologies(world):
            sizes = "+".join(map(str, topo.ranks_per_node))
            for collective, algos in ALGORITHMS.items():
                for algo in algos:
                    yield pytest.param(collective, algo, topo, id=f"{collective}-{algo}-{sizes}")


@pytest.mark.parametrize("collective,algo,topo", list(_cases()))
def test_simulated_against_numpy(collective: str, algo: str, topo: Topology) -> None:
    world = topo.world_size
    for n in _sizes(world):
        for root in sorted({0, world - 1, world // 2}):
            sched = build(collective, algo, topo, n, root=root)
            validate(sched)
            for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BXOR):
                inputs = _inputs(world, n, seed=n * 31 + root)
                bufs = [x.copy() for x in inputs]
                simulate(sched, bufs, op)
                _check(sched, bufs, _expected(sched, inputs, op))
            if collective not in ("broadcast", "reduce"):
                break


@pytest.mark.parametrize("world", [2, 3, 5, 8])
@pytest.mark.parametrize("collective", list(ALGORITHMS))
def test_threads_match_numpy(world: int, collective: str) -> None:
    """The same schedules over a real (in-process) transport, one thread a rank."""
    topo = Topology.from_sizes([world - world // 2, world // 2]) if world > 2 else \
        Topology.flat(world)
    n = 3 * world + 1
    for algo in ALGORITHMS[collective]:
        sched = build(collective, algo, topo, n, root=world - 1)
        inputs = _inputs(world, n, seed=world)
        bufs = [x.copy() for x in inputs]
        ends = run_threads(sched, bufs, ReduceOp.SUM, timeout=10.0)
        _check(sched, bufs, _expected(sched, inputs, ReduceOp.SUM))
        # every message the schedule names was sent, and nothing else
        assert sum(len(e.sent) for e in ends) == sum(len(s) for s in sched.steps)


def test_avg_and_premul_sum_finalize_once() -> None:
    topo = Topology.from_sizes([3, 2])
    inputs = [np.full(11, float(r + 1)) for r in range(5)]
    for algo in ALGORITHMS["all_reduce"]:
        for op, want in ((ReduceOp.AVG, 3.0), (ReduceOp.PREMUL_SUM(0.5), 7.5)):
            bufs = [x.copy() for x in inputs]
            simulate(build("all_reduce", algo, topo, 11), bufs, op)
            for b in bufs:
                np.testing.assert_allclose(b, want)


def test_ring_chunks_same_result_more_messages() -> None:
    topo = Topology.flat(4)
    one = build("all_reduce", "ring", topo, 40)
    four = build("all_reduce", "ring", topo, 40, chunks=4)
    assert sum(map(len, four.steps)) == 4 * sum(map(len, one.steps))
    inputs = _inputs(4, 40, 1)
    bufs = [x.copy() for x in inputs]
    simulate(four, bufs, ReduceOp.SUM)
    _check(four, bufs, _expected(four, inputs, ReduceOp.SUM))


def test_bad_arguments_name_the_parameter() -> None:
    topo = Topology.flat(4)
    with pytest.raises(ValueError, match="all_reduce_algo: expected one of direct, "):
        build("all_reduce", "binomial", topo, 8)
    with pytest.raises(ValueError, match="collective: expected one of"):
        build("allreduce", "ring", topo, 8)
    with pytest.raises(ValueError, match=r"root: expected a group rank in \[0, 4\)"):
        build("broadcast", "binomial", topo, 8, root=4)
    with pytest.raises(ValueError, match="n: expected"):
        build("broadcast", "binomial", topo, -1)
    with pytest.raises(ValueError, match="chunks: only the ring"):
        build("all_reduce", "direct", topo, 8, chunks=2)
    with pytest.raises(ValueError, match="buffer: expected 8 elements"):
        simulate(build("all_reduce", "ring", topo, 8), [np.zeros(7)] * 4, ReduceOp.SUM)


def test_thread_transport_times_out_naming_the_pair() -> None:
    from schedule_reference import ThreadTransport

    end = ThreadTransport.group(2, timeout=0.05)[1]
    with pytest.raises(TimeoutError, match="rank 1: nothing from rank 0"):
        end.recv(0)


def test_validate_rejects_conflicting_copies() -> None:
    from raycoll.algorithms.schedule import Transfer

    bad = Schedule("broadcast", "x", 3, 4, 0,
                   ((Transfer(0, 2, 0, 4, False), Transfer(1, 2, 2, 3, False)),),
                   ((0, 4),) * 3)
    with pytest.raises(ValueError, match="overlapping"):
        validate(bad)


def test_topology() -> None:
    t = Topology(["b", "a", "b", "c"])
    assert t.node_of == (0, 1, 0, 2)
    assert t.node_ranks == ((0, 2), (1,), (3,))
    assert t.ranks_per_node == (2, 1, 1) and t.num_nodes == 3
    assert t.link(0, 2) == "unix" and t.link(0, 1) == "tcp"
    with pytest.raises(ValueError, match="Topology.link\\(b\\)"):
        t.link(0, 4)
    with pytest.raises(ValueError, match="node_ids"):
        Topology([])
