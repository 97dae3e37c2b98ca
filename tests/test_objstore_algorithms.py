"""Every object-store algorithm and put layout gives the same results as numpy.

The backend picks inline / direct / reduce-scatter + all-gather and combined / per-peer puts
from the size and the topology; tests on one node with default options only ever see some of
them. Here each choice is forced through group options (``ranks.run(..., options=...)``)
and checked against numpy on real actors, with every reduce op, integer and float dtypes,
tiny segments (so that pieces span several segments with uneven boundaries) and
non-contiguous tensors.
"""

from __future__ import annotations

import uuid
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

import raycoll
from raycoll.native import core, native_status

OPS = ["SUM", "AVG", "MAX", "MIN", "PRODUCT", "PREMUL_SUM"]


def _data(rank: int, n: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    if np.dtype(dtype).kind == "f":
        return rng.uniform(0.5, 2.0, n).astype(dtype)
    return rng.integers(1, 5, n).astype(dtype)


def _expected(name: str, arrays: List[np.ndarray]) -> np.ndarray:
    stack = np.stack(arrays)
    if name in ("SUM", "AVG", "PREMUL_SUM"):
        total = stack.sum(axis=0, dtype=stack.dtype)
        if name == "AVG":
            return total / len(arrays) if stack.dtype.kind == "f" else np.trunc(total / len(arrays))
        return total * 0.5 if name == "PREMUL_SUM" else total
    return {"MAX": stack.max(axis=0), "MIN": stack.min(axis=0),
            "PRODUCT": stack.prod(axis=0, dtype=stack.dtype)}[name]


def _op(name: str) -> Any:
    return raycoll.ReduceOp.PREMUL_SUM(0.5) if name == "PREMUL_SUM" else getattr(raycoll.ReduceOp, name)


def world_group() -> Any:
    """This rank's default group (the pool's group while a test function runs)."""
    from raycoll.world import world

    return world().default


def _every_collective(rank: int, world: int, n: int, dtype: str) -> Dict[str, Any]:
    """Run the collectives on this rank; return what each produced (compared by the test)."""
    out: Dict[str, Any] = {}
    for name in OPS:
        if np.dtype(dtype).kind != "f" and name in ("AVG", "PREMUL_SUM"):
            continue
        x = _data(rank, n, dtype)
        raycoll.all_reduce(x, op=_op(name))
        out[f"all_reduce/{name}"] = x
        out[f"route:all_reduce/{name}"] = world_group().last_route
        y = _data(rank, n, dtype)
        raycoll.reduce(y, dst=world - 1, op=_op(name))
        out[f"reduce/{name}"] = y if rank == world - 1 else None
    # Non-contiguous: every other column of a (n, 2) array.
    base = np.zeros((n, 2), dtype=dtype)
    base[:, 0] = _data(rank, n, dtype)
    col = base[:, 0]
    raycoll.all_reduce(col)
    out["all_reduce/strided"] = col.copy()
    rs = np.zeros(n, dtype=dtype)
    raycoll.reduce_scatter(rs, [_data(rank * world + j, n, dtype) for j in range(world)])
    out["reduce_scatter"] = rs
    out["route:reduce_scatter"] = world_group().last_route
    gathered = [np.zeros(n, dtype=dtype) for _ in range(world)]
    raycoll.all_gather(gathered, _data(rank, n, dtype))
    out["all_gather"] = gathered
    b = _data(rank, n, dtype)
    raycoll.broadcast(b, src=1)
    out["broadcast"] = b
    a2a = [np.zeros(n, dtype=dtype) for _ in range(world)]
    raycoll.all_to_all(a2a, [_data(rank * world + j, n, dtype) for j in range(world)])
    out["all_to_all"] = a2a
    sc = np.zeros(n, dtype=dtype)
    raycoll.scatter(sc, [_data(100 + j, n, dtype) for j in range(world)] if rank == 0 else None,
                    src=0)
    out["scatter"] = sc
    return out


def _check(results: List[Dict[str, Any]], world: int, n: int, dtype: str) -> None:
    arrays = [_data(r, n, dtype) for r in range(world)]
    for key, _ in results[0].items():
        if key.startswith("route:"):
            continue
        kind, _, name = key.partition("/")
        for rank, res in enumerate(results):
            got = res[key]
            if kind == "all_reduce" and name == "strided":
                want = _expected("SUM", arrays)
            elif kind == "all_reduce":
                want = _expected(name, arrays)
            elif kind == "reduce":
                if rank != world - 1:
                    continue
                want = _expected(name, arrays)
            elif kind == "reduce_scatter":
                want = _expected("SUM", [_data(r * world + rank, n, dtype) for r in range(world)])
            elif kind == "all_gather":
                want = arrays
            elif kind == "broadcast":
                want = arrays[1]
            elif kind == "all_to_all":
                want = [_data(s * world + rank, n, dtype) for s in range(world)]
            else:  # scatter
                want = _data(100 + rank, n, dtype)
            np.testing.assert_allclose(np.asarray(got, dtype=np.float64),
                                       np.asarray(want, dtype=np.float64), rtol=1e-5,
                                       err_msg=f"{key} on rank {rank}")
    # all_reduce results must be bitwise identical on every rank
    for key in results[0]:
        if key.startswith("all_reduce/"):
            for res in results[1:]:
                assert np.array_equal(res[key], results[0][key]), key


@pytest.fixture(scope="module")
def actors(rank_actors: List[Any]) -> List[Any]:
    return rank_actors


def _expected_route(case: str, nbytes: int) -> Tuple[str, Any, Tuple[str, ...]]:
    """The transport, the lane rounds (a count, or "several") and the coordinator steps that
    a (not first) all_reduce of ``nbytes`` per rank on 3 ranks must take under each case's
    options, as the backend's docstring describes its choices."""
    return {
        # reduce-scatter then all-gather: two steps, one object each (combined on one node)
        "rs_ag-segments": ("store", 0, ("objects:1", "objects:1")),
        # one step: every rank puts its buffer once
        "direct-per_peer-segments": ("store", 0, ("objects:1",)),
        # per-peer puts: two objects (one per peer) in the reduce-scatter step
        "rs_ag-per_peer": ("store", 0, ("objects:2", "objects:1")),
        "inline-coordinator": ("store", 0, ("reduce",)),  # the coordinator reduces
        # the node segment: one step; without the native core, the object store (the
        # coordinator reduces what is this small)
        "lane": ("lane", 1, ()) if core is not None else ("store", 0, ("reduce",)),
        # more than 4 KiB takes several steps of the segment; less fits one
        "lane-4KiB-steps": (("lane", "several" if nbytes > 4096 else 1, ()) if core is not None
                            else ("store", 0, ("reduce",))),
    }[case]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("options", [
    {"all_reduce_algo": "rs_ag", "inline_bytes": 0, "segment_bytes": 1000, "transport": "store"},
    {"all_reduce_algo": "direct", "inline_bytes": 0, "segment_bytes": 1000, "put": "per_peer",
     "transport": "store"},
    {"all_reduce_algo": "rs_ag", "inline_bytes": 0, "put": "per_peer", "transport": "store"},
    {"all_reduce_algo": "inline", "transport": "store"},
    {},
    {"lane_bytes": 4096},
], ids=["rs_ag-segments", "direct-per_peer-segments", "rs_ag-per_peer", "inline-coordinator",
        "lane", "lane-4KiB-steps"])
@pytest.mark.parametrize("dtype", ["float64", "int32"])
def test_forced_algorithms_match_numpy(ranks: Any, request: Any, options: Dict[str, Any],
                                       dtype: str) -> None:
    world, n = 3, 1001  # chunks of 334/334/333 elements; 1000-byte segments split unevenly
    results = ranks.run(_every_collective, world, world, n, dtype, options=options, timeout=120)
    _check(results, world, n, dtype)
    # ... and the forced choice is what ran (on every rank)
    case = request.node.callspec.id.split("-", 1)[1]  # "<dtype>-<options id>"
    transport, rounds, steps = _expected_route(case, n * np.dtype(dtype).itemsize)
    for rank, res in enumerate(results):
        route = res["route:all_reduce/MAX"]
        assert (route.op, route.transport, route.steps) == ("all_reduce", transport, steps), \
            (rank, case, route)
        assert route.rounds > 1 if rounds == "several" else route.rounds == rounds, \
            (rank, case, route)
        if case == "direct-per_peer-segments":  # per-peer puts show in the reduce-scatter
            assert res["route:reduce_scatter"].steps == ("objects:2",), (rank, res)


@pytest.mark.timeout(240)
@pytest.mark.skipif(core is None, reason=f"the node segment's steps: {native_status()}")
@pytest.mark.parametrize("stream_bytes", [1000, 4096])
@pytest.mark.parametrize("dtype", ["float64", "int32"])
def test_node_segment_steps_of_any_size_match_numpy(ranks: Any, stream_bytes: int,
                                                    dtype: str) -> None:
    """Steps of the node segment capped at ``stream_bytes``: steps that cut chunks, pieces
    and segments unevenly, and a last step shorter than the others."""
    world, n = 2, 1001
    results = ranks.run(_every_collective, world, world, n, dtype, timeout=120,
                        options={"stream_bytes": stream_bytes})
    _check(results, world, n, dtype)
    streams = n * np.dtype(dtype).itemsize > stream_bytes  # else the all_reduce fits a round
    for rank, res in enumerate(results):
        route = res["route:all_reduce/MAX"]
        assert route.transport == "lane" and route.steps == (), (rank, route)
        assert route.rounds > 1 if streams else route.rounds == 1, (rank, stream_bytes, route)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad,needle", [({"all_reduce_algo": "binomial"}, "all_reduce_algo"),
                                        ({"put": "sometimes"}, "group option put"),
                                        ({"stream_bytes": 0}, "group option stream_bytes"),
                                        ({"lane_bytes": "4M"}, "group option lane_bytes")])
def test_bad_options_are_refused_with_the_option_named(actors: Any, bad: Dict[str, Any],
                                                       needle: str) -> None:
    """Refused by create_group itself, before anything starts: the name is free after."""
    name = f"bad-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ValueError, match=needle):
        raycoll.create_group(actors[:2], group_name=name, options=bad, timeout=60)
    raycoll.create_group(actors[:2], group_name=name, timeout=60)
    raycoll.destroy_group(name)
