"""Ring algorithms: each rank talks to its two neighbours only (bandwidth-optimal).

Over participants ``p_0 .. p_{k-1}`` and a range cut into ``k`` blocks (block ``i`` belongs to
``p_i``): the reduce-scatter takes ``k - 1`` steps, in step ``s`` participant ``i`` sends block
``(i - s - 1) mod k`` to ``p_{i+1}``, which reduces it into its own; the all-gather takes ``k - 1``
steps, in step ``s`` participant ``i`` sends block ``(i - s) mod k`` on as a copy. A rank sends
``n - |block i|`` elements in the reduce-scatter and ``n - |block i+1|`` in the all-gather, so
``2 (k - 1) / k * n`` in an all_reduce when ``k`` divides ``n``. ``chunks`` cuts every block
into that many messages (the same bytes, more messages: a receiver reduces one while the next
arrives).
"""

from __future__ import annotations

from typing import List, Sequence

from raycoll.algorithms.schedule import Step, Transfer, blocks
from raycoll.algorithms.topology import Topology

__all__ = ["all_gather", "all_gather_steps", "all_reduce", "build", "reduce_scatter",
           "reduce_scatter_steps"]


def _send(src: int, dst: int, lo: int, hi: int, reduce: bool, chunks: int) -> List[Transfer]:
    return [Transfer(src, dst, a, b, reduce) for a, b in blocks(lo, hi, chunks) if b > a]


def _ring_steps(ranks: Sequence[int], lo: int, hi: int, chunks: int, lag: int,
                reduce: bool) -> List[Step]:
    """W-1 ring steps over ``[lo, hi)``: at step ``s`` each ``ranks[i]`` sends block
    ``i - s - lag`` to its right neighbour, reducing it there or copying it."""
    k = len(ranks)
    parts = blocks(lo, hi, k)
    steps: List[Step] = []
    for s in range(k - 1):
        step: Step = []
        for i in range(k):
            a, b = parts[(i - s - lag) % k]
            step += _send(ranks[i], ranks[(i + 1) % k], a, b, reduce, chunks)
        steps.append(step)
    return steps


def reduce_scatter_steps(ranks: Sequence[int], lo: int, hi: int,
                         chunks: int = 1) -> List[Step]:
    """Ring reduce-scatter of ``[lo, hi)`` over ``ranks``: ``ranks[i]`` ends with block ``i``."""
    return _ring_steps(ranks, lo, hi, chunks, lag=1, reduce=True)


def all_gather_steps(ranks: Sequence[int], lo: int, hi: int, chunks: int = 1) -> List[Step]:
    """Ring all-gather of ``[lo, hi)`` over ``ranks``: ``ranks[i]`` starts with block ``i``."""
    return _ring_steps(ranks, lo, hi, chunks, lag=0, reduce=False)


def build(collective: str, world: int, n: int, chunks: int = 1) -> List[Step]:
    """The flat ring over ranks ``0 .. world-1`` for ``collective``."""
    ranks = list(range(world))
    if collective == "all_reduce":
        return reduce_scatter_steps(ranks, 0, n, chunks) + all_gather_steps(ranks, 0, n, chunks)
    if collective == "reduce_scatter":
        return reduce_scatter_steps(ranks, 0, n, chunks)
    if collective == "all_gather":
        return all_gather_steps(ranks, 0, n, chunks)
    raise ValueError(f"{collective}_algo: 'ring' is an algorithm of all_reduce, "
                     f"reduce_scatter and all_gather, not of {collective}")


def all_reduce(topology: Topology, n: int, root: int = 0) -> List[Step]:
    return build("all_reduce", topology.world_size, n)


def reduce_scatter(topology: Topology, n: int, root: int = 0) -> List[Step]:
    return build("reduce_scatter", topology.world_size, n)


def all_gather(topology: Topology, n: int, root: int = 0) -> List[Step]:
    return build("all_gather", topology.world_size, n)
