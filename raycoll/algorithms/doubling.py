"""Recursive doubling and halving (Rabenseifner): ``log2 W`` steps, one partner a step.

For a number of ranks ``k`` that is not a power of two, MPICH's fold: with ``p`` the largest
power of two <= ``k`` and ``rem = k - p``, among the first ``2 rem`` participants each even one
hands its data to the odd one after it and sits out; the ``p`` survivors (new index ``j``: the
odd ``2j + 1`` for ``j < rem``, then ``j + rem``) run the power-of-two algorithm; then each odd
survivor hands the result back (the unfold). The butterfly partner of survivor ``j`` at
distance ``d`` is ``j ^ d``.

- recursive doubling all_reduce: ``log2 p`` steps, the whole buffer each (small buffers);
- halving-doubling all_reduce (Rabenseifner): a recursive-halving reduce-scatter over ``p``
  parts, then a recursive-doubling all-gather: ``2 (p - 1) / p * n`` elements a survivor;
- halving reduce_scatter and doubling all_gather: over the survivors' "super-blocks" (a
  folded pair's two blocks side by side), so every rank ends with its own block.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from raycoll.algorithms.schedule import Step, blocks, transfer
from raycoll.algorithms.topology import Topology

__all__ = ["all_gather_doubling", "all_reduce_doubling", "all_reduce_halving_doubling",
           "fold", "reduce_scatter_halving"]

Range = Tuple[int, int]


def fold(k: int) -> Tuple[int, int, List[int]]:
    """``(p, rem, survivors)``: the power of two, the folded pairs, each survivor's position."""
    p = 1
    while p * 2 <= k:
        p *= 2
    rem = k - p
    return p, rem, [2 * j + 1 if j < rem else j + rem for j in range(p)]


def _super_blocks(lo: int, hi: int, k: int) -> List[Range]:
    """Each survivor's blocks of ``[lo, hi)`` cut into ``k``: a folded pair's two side by side."""
    parts = blocks(lo, hi, k)
    p, rem, _ = fold(k)
    return [(parts[2 * j][0], parts[2 * j + 1][1]) if j < rem else parts[j + rem]
            for j in range(p)]


def _span(parts: Sequence[Range], a: int, b: int) -> Range:
    return parts[a][0], parts[b - 1][1]


def _halving(ranks: Sequence[int], surv: Sequence[int], parts: Sequence[Range]) -> List[Step]:
    """Recursive halving over ``p`` survivors: survivor ``j`` ends with ``parts[j]`` reduced."""
    p = len(surv)
    own = [(0, p) for _ in range(p)]
    steps: List[Step] = []
    d = p // 2
    while d >= 1:
        step: Step = []
        for j in range(p):
            a, b = own[j]
            mid = (a + b) // 2
            keep, give = ((mid, b), (a, mid)) if j & d else ((a, mid), (mid, b))
            step += transfer(ranks[surv[j]], ranks[surv[j ^ d]], *_span(parts, *give), True)
            own[j] = keep
        steps.append(step)
        d //= 2
    return steps


def _doubling(ranks: Sequence[int], surv: Sequence[int], parts: Sequence[Range]) -> List[Step]:
    """Recursive doubling all-gather: survivor ``j`` starts with ``parts[j]``, ends with all."""
    p = len(surv)
    steps: List[Step] = []
    d = 1
    while d < p:
        step: Step = []
        for j in range(p):
            a = j & ~(d - 1)
            step += transfer(ranks[surv[j]], ranks[surv[j ^ d]], *_span(parts, a, a + d), False)
        steps.append(step)
        d *= 2
    return steps


def _fold_step(ranks: Sequence[int], rem: int, ranges: Sequence[Range],
               reduce: bool) -> List[Step]:
    """Each even ``2j`` (``j < rem``) sends ``ranges[j]`` to ``2j + 1``."""
    if not rem:
        return []
    return [[t for j in range(rem)
             for t in transfer(ranks[2 * j], ranks[2 * j + 1], *ranges[j], reduce)]]


def _unfold_step(ranks: Sequence[int], rem: int, ranges: Sequence[Range]) -> List[Step]:
    """Each odd survivor ``2j + 1`` (``j < rem``) copies ``ranges[j]`` back to ``2j``."""
    if not rem:
        return []
    return [[t for j in range(rem)
             for t in transfer(ranks[2 * j + 1], ranks[2 * j], *ranges[j], False)]]


def all_reduce_doubling_steps(ranks: Sequence[int], lo: int, hi: int) -> List[Step]:
    p, rem, surv = fold(len(ranks))
    whole = [(lo, hi)] * max(rem, 1)
    steps = _fold_step(ranks, rem, whole, True)
    d = 1
    while d < p:
        steps.append([t for j in range(p)
                      for t in transfer(ranks[surv[j]], ranks[surv[j ^ d]], lo, hi, True)])
        d *= 2
    return steps + _unfold_step(ranks, rem, whole)


def all_reduce_halving_doubling_steps(ranks: Sequence[int], lo: int, hi: int) -> List[Step]:
    p, rem, surv = fold(len(ranks))
    whole = [(lo, hi)] * max(rem, 1)
    parts = blocks(lo, hi, p)
    return (_fold_step(ranks, rem, whole, True) + _halving(ranks, surv, parts)
            + _doubling(ranks, surv, parts) + _unfold_step(ranks, rem, whole))


def all_reduce_doubling(topology: Topology, n: int, root: int = 0) -> List[Step]:
    return all_reduce_doubling_steps(range(topology.world_size), 0, n)


def all_reduce_halving_doubling(topology: Topology, n: int, root: int = 0) -> List[Step]:
    return all_reduce_halving_doubling_steps(range(topology.world_size), 0, n)


def reduce_scatter_halving(topology: Topology, n: int, root: int = 0) -> List[Step]:
    ranks = range(topology.world_size)
    k = topology.world_size
    p, rem, surv = fold(k)
    own = blocks(0, n, k)
    steps = _fold_step(ranks, rem, [(0, n)] * max(rem, 1), True)
    steps += _halving(ranks, surv, _super_blocks(0, n, k))
    return steps + _unfold_step(ranks, rem, [own[2 * j] for j in range(rem)])


def all_gather_doubling(topology: Topology, n: int, root: int = 0) -> List[Step]:
    ranks = range(topology.world_size)
    k = topology.world_size
    p, rem, surv = fold(k)
    own = blocks(0, n, k)
    steps = _fold_step(ranks, rem, [own[2 * j] for j in range(rem)], False)
    steps += _doubling(ranks, surv, _super_blocks(0, n, k))
    return steps + _unfold_step(ranks, rem, [(0, n)] * max(rem, 1))
