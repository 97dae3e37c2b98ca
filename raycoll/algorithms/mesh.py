"""Direct exchange (full mesh): every rank sends to every peer it needs in one step.

What raycoll's CPU rounds did before the other families: fewest steps, ``W - 1`` messages a
rank a step. It wins at 2 ranks and for small buffers on one node. ``direct_rsag`` is the
bandwidth-optimal direct form of all_reduce: a direct reduce-scatter, then a direct
all-gather (``2 (W - 1) / W * n`` elements a rank, ``W - 1`` messages a step).
"""

from __future__ import annotations

from typing import List, Sequence

from raycoll.algorithms.schedule import Step, blocks, transfer
from raycoll.algorithms.topology import Topology

__all__ = ["all_gather", "all_gather_steps", "all_reduce", "all_reduce_rsag", "broadcast",
           "reduce", "reduce_scatter", "reduce_scatter_steps"]


def reduce_scatter_steps(ranks: Sequence[int], lo: int, hi: int) -> List[Step]:
    """``ranks[j]`` ends with the reduction of block ``j`` of ``[lo, hi)``: one step."""
    parts = blocks(lo, hi, len(ranks))
    return [[t for i, src in enumerate(ranks) for j, dst in enumerate(ranks) if i != j
             for t in transfer(src, dst, parts[j][0], parts[j][1], True)]]


def all_gather_steps(ranks: Sequence[int], lo: int, hi: int) -> List[Step]:
    """``ranks[i]`` starts with block ``i`` of ``[lo, hi)`` and sends it to all: one step."""
    parts = blocks(lo, hi, len(ranks))
    return [[t for i, src in enumerate(ranks) for dst in ranks if dst != src
             for t in transfer(src, dst, parts[i][0], parts[i][1], False)]]


def all_reduce(topology: Topology, n: int, root: int = 0) -> List[Step]:
    """Every rank sends its whole buffer to every peer and reduces what it receives."""
    world = topology.world_size
    return [[t for s in range(world) for d in range(world) if s != d
             for t in transfer(s, d, 0, n, True)]]


def all_reduce_rsag(topology: Topology, n: int, root: int = 0) -> List[Step]:
    ranks = range(topology.world_size)
    return reduce_scatter_steps(ranks, 0, n) + all_gather_steps(ranks, 0, n)


def reduce_scatter(topology: Topology, n: int, root: int = 0) -> List[Step]:
    return reduce_scatter_steps(range(topology.world_size), 0, n)


def all_gather(topology: Topology, n: int, root: int = 0) -> List[Step]:
    return all_gather_steps(range(topology.world_size), 0, n)


def broadcast(topology: Topology, n: int, root: int = 0) -> List[Step]:
    """A star: the root sends its buffer to every rank in one step."""
    return [[t for d in range(topology.world_size) if d != root
             for t in transfer(root, d, 0, n, False)]]


def reduce(topology: Topology, n: int, root: int = 0) -> List[Step]:
    """A star: every rank sends its buffer to the root, which reduces them."""
    return [[t for s in range(topology.world_size) if s != root
             for t in transfer(s, root, 0, n, True)]]
