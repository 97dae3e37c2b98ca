"""Rooted algorithms: binomial trees, and scatter + all-gather (van de Geijn) broadcast.

Ranks are counted relative to the root (``v = (r - root) mod W``). A binomial broadcast takes
``ceil(log2 W)`` steps: in step ``k`` each ``v < 2^k`` that has the data sends it to
``v + 2^k``. A binomial reduce runs the same tree upwards. The scatter + all-gather broadcast
(for large buffers) scatters the blocks down a binomial tree (block ``v`` to relative rank
``v``), then all-gathers them around a ring: about ``2 n`` elements through the root instead
of ``n log2 W``. ``rsgather`` reduces by a ring reduce-scatter, then every rank sends its
reduced block to the root.
"""

from __future__ import annotations

from typing import List, Sequence

from raycoll.algorithms import ring
from raycoll.algorithms.schedule import Step, blocks, sub_ranks, transfer
from raycoll.algorithms.topology import Topology

__all__ = ["broadcast_binomial", "broadcast_scatter_allgather", "broadcast_steps",
           "reduce_binomial", "reduce_rsgather", "reduce_steps"]


def broadcast_steps(q: Sequence[int], lo: int, hi: int) -> List[Step]:
    """Binomial broadcast of ``[lo, hi)`` from ``q[0]`` to every rank of ``q``."""
    steps: List[Step] = []
    mask = 1
    while mask < len(q):
        steps.append([t for v in range(mask) if v + mask < len(q)
                      for t in transfer(q[v], q[v + mask], lo, hi, False)])
        mask *= 2
    return steps


def reduce_steps(q: Sequence[int], lo: int, hi: int) -> List[Step]:
    """Binomial reduce of ``[lo, hi)`` over the ranks of ``q`` into ``q[0]``."""
    steps: List[Step] = []
    mask = 1
    while mask < len(q):
        steps.append([t for v in range(mask, len(q), 2 * mask)
                      for t in transfer(q[v], q[v - mask], lo, hi, True)])
        mask *= 2
    return steps


def scatter_steps(q: Sequence[int], lo: int, hi: int) -> List[Step]:
    """Binomial scatter from ``q[0]``: ``q[v]`` ends with block ``v`` of ``[lo, hi)``."""
    k = len(q)
    parts = blocks(lo, hi, k)
    mask = 1
    while mask < k:
        mask *= 2
    steps: List[Step] = []
    mask //= 2
    while mask >= 1:
        step: Step = []
        for v in range(0, k, 2 * mask):
            if v + mask < k:
                last = min(v + 2 * mask, k) - 1
                step += transfer(q[v], q[v + mask], parts[v + mask][0], parts[last][1], False)
        steps.append(step)
        mask //= 2
    return steps


def broadcast_binomial(topology: Topology, n: int, root: int = 0) -> List[Step]:
    return broadcast_steps(sub_ranks(range(topology.world_size), root), 0, n)


def reduce_binomial(topology: Topology, n: int, root: int = 0) -> List[Step]:
    return reduce_steps(sub_ranks(range(topology.world_size), root), 0, n)


def broadcast_scatter_allgather(topology: Topology, n: int, root: int = 0) -> List[Step]:
    q = sub_ranks(range(topology.world_size), root)
    return scatter_steps(q, 0, n) + ring.all_gather_steps(q, 0, n)


def reduce_rsgather(topology: Topology, n: int, root: int = 0) -> List[Step]:
    world = topology.world_size
    parts = blocks(0, n, world)
    gather = [t for r in range(world) if r != root
              for t in transfer(r, root, parts[r][0], parts[r][1], False)]
    return ring.reduce_scatter_steps(range(world), 0, n) + [gather]
