"""Every schedule by (collective, algorithm): :func:`build` checks the arguments and asks the
family's module (mesh, ring, doubling, tree, hierarchical) for the steps. It sits above the
families, which share only :mod:`raycoll.algorithms.schedule`'s step primitives."""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

from raycoll.algorithms import doubling, hierarchical, mesh, ring, tree
from raycoll.algorithms.schedule import Schedule, Step, blocks, check_algorithm, in_parallel
from raycoll.algorithms.topology import Topology

__all__ = ["PIPELINED", "build"]


def _builders() -> Dict[Tuple[str, str], Callable[[Topology, int, int], List[Step]]]:
    return {
        ("all_reduce", "direct"): mesh.all_reduce,
        ("all_reduce", "direct_rsag"): mesh.all_reduce_rsag,
        ("all_reduce", "ring"): ring.all_reduce,
        ("all_reduce", "recursive_doubling"): doubling.all_reduce_doubling,
        ("all_reduce", "halving_doubling"): doubling.all_reduce_halving_doubling,
        ("all_reduce", "hierarchical"): hierarchical.all_reduce,
        ("all_reduce", "hierarchical_doubling"): hierarchical.all_reduce_doubling,
        ("reduce_scatter", "direct"): mesh.reduce_scatter,
        ("reduce_scatter", "ring"): ring.reduce_scatter,
        ("reduce_scatter", "halving"): doubling.reduce_scatter_halving,
        ("all_gather", "direct"): mesh.all_gather,
        ("all_gather", "ring"): ring.all_gather,
        ("all_gather", "recursive_doubling"): doubling.all_gather_doubling,
        ("all_gather", "hierarchical"): hierarchical.all_gather,
        ("broadcast", "direct"): mesh.broadcast,
        ("broadcast", "binomial"): tree.broadcast_binomial,
        ("broadcast", "scatter_allgather"): tree.broadcast_scatter_allgather,
        ("broadcast", "hierarchical"): hierarchical.broadcast,
        ("reduce", "direct"): mesh.reduce,
        ("reduce", "binomial"): tree.reduce_binomial,
        ("reduce", "rsgather"): tree.reduce_rsgather,
    }


def _results(collective: str, world: int, n: int, root: int) -> Tuple[Tuple[int, int], ...]:
    if collective == "reduce_scatter":
        return tuple(blocks(0, n, world))
    if collective == "reduce":
        return tuple((0, n) if r == root else (0, 0) for r in range(world))
    return tuple((0, n) for _ in range(world))


#: The collectives whose result is the whole buffer (or nothing): they can be pipelined in
#: segments (a reduce_scatter's or all_gather's blocks are laid out over the whole buffer).
PIPELINED = ("all_reduce", "broadcast", "reduce")


def _pipelined(builder: Callable[[int], List[Step]], n: int, segments: int) -> List[Step]:
    """``builder``'s steps over each of ``segments`` contiguous segments of ``[0, n)``,
    segment ``k`` starting ``k`` steps late: a round carries step ``s`` of segment ``k`` with
    step ``s - 1`` of segment ``k + 1``, ..., so each message stays small (in the caches
    between its copy into the receiver's buffer and the reduction) while every step of one
    segment still follows the one before."""
    phases: List[List[Step]] = []
    for k, (lo, hi) in enumerate(blocks(0, n, segments)):
        shifted = [[t._replace(lo=t.lo + lo, hi=t.hi + lo) for t in step]
                   for step in builder(hi - lo)]
        phases.append([[] for _ in range(k)] + shifted)
    return in_parallel(*phases)


def build(collective: str, algorithm: str, topology: Topology, n: int,
          root: int = 0, chunks: int = 1, segments: int = 1) -> Schedule:
    """The schedule of ``algorithm`` for ``collective`` over ``n`` elements on ``topology``.

    ``root`` is the group rank of broadcast's source and reduce's destination (ignored
    elsewhere). ``chunks`` (ring only) cuts each ring block into that many messages, so that a
    receiver can reduce one while the next arrives. ``segments`` (all_reduce, broadcast and
    reduce) pipelines the schedule over that many segments of the buffer."""
    check_algorithm(collective, algorithm)
    world = topology.world_size
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n: expected a number of elements >= 0, got {n!r}")
    if not isinstance(root, int) or not 0 <= root < world:
        raise ValueError(f"root: expected a group rank in [0, {world}), got {root!r}")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks: expected an int >= 1, got {chunks!r}")
    if chunks > 1 and algorithm != "ring":
        raise ValueError(f"chunks: only the ring algorithm is chunked, got chunks={chunks} "
                         f"with {collective}_algo={algorithm!r}")
    if not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments: expected an int >= 1, got {segments!r}")
    if segments > 1 and collective not in PIPELINED:
        raise ValueError(f"segments: only {', '.join(PIPELINED)} are pipelined, got "
                         f"segments={segments} for {collective}")

    def one(size: int) -> List[Step]:
        if algorithm == "ring":
            return ring.build(collective, world, size, chunks)
        return _builders()[(collective, algorithm)](topology, size, root)

    if world == 1:
        steps: List[Step] = []
    elif segments > 1:
        steps = _pipelined(one, n, min(segments, max(n, 1)))
    else:
        steps = one(n)
    frozen = tuple(tuple(s) for s in steps if s)
    return Schedule(collective, algorithm, world, n, root, frozen,
                    _results(collective, world, n, root))
