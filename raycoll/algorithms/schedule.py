"""Collective algorithms as schedules: what each rank sends to whom, step by step.

A :class:`Schedule` works on one flat buffer of ``n`` elements per rank. It is a list of
steps; a step is a set of point-to-point :class:`Transfer` s that may run at the same time.
A transfer moves the elements ``[lo, hi)`` of the sender's buffer into the same range of the
receiver's buffer, either as a copy or combined with what is there (``reduce``). Within a
step every transfer reads the sender's buffer as it was when the step began (each rank sends
before it applies what it receives), so a rank may send a range and receive into it in one
step. Transfers between one pair in one step keep their list order (per-pair FIFO).

What a buffer holds before and after, per collective (``blocks(0, n, W)[r]`` is rank r's
block: the first ``n % W`` blocks have one element more):

- ``all_reduce``: each rank's input in, the reduction everywhere out.
- ``reduce_scatter``: each rank's input in; rank r's block holds the reduction of block r.
- ``all_gather``: rank r's block holds its input; everything everywhere out.
- ``broadcast``: the root's buffer in, everywhere out.
- ``reduce``: each rank's input in; the reduction at the root out.

:attr:`Schedule.results` says, per rank, which range holds a result (the executor applies an
op's final step, AVG's division, there). The families live in :mod:`.mesh` (direct),
:mod:`.ring`, :mod:`.doubling`, :mod:`.tree` and :mod:`.hierarchical`; :func:`raycoll.algorithms.catalog.build`
is the one entry point. This module is plain Python: no arrays move here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

__all__ = ["ALGORITHMS", "COLLECTIVES", "Schedule", "Step", "Transfer", "blocks",
           "check_algorithm", "in_parallel", "validate"]


class Transfer(NamedTuple):
    """Elements ``[lo, hi)`` from rank ``src``'s buffer into rank ``dst``'s, copied or reduced."""

    src: int
    dst: int
    lo: int
    hi: int
    reduce: bool

    @property
    def size(self) -> int:
        return self.hi - self.lo


#: the transfers of one step (they may run at the same time)
Step = List[Transfer]

COLLECTIVES: Tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                "reduce")

#: every algorithm of each collective, in the order that breaks a cost tie
ALGORITHMS: Dict[str, Tuple[str, ...]] = {
    "all_reduce": ("direct", "direct_rsag", "ring", "recursive_doubling", "halving_doubling",
                   "hierarchical", "hierarchical_doubling"),
    "reduce_scatter": ("direct", "ring", "halving"),
    "all_gather": ("direct", "ring", "recursive_doubling", "hierarchical"),
    "broadcast": ("direct", "binomial", "scatter_allgather", "hierarchical"),
    "reduce": ("direct", "binomial", "rsgather"),
}


@dataclass(frozen=True)
class Schedule:
    """One collective's steps for ``world_size`` ranks over ``n`` elements each."""

    collective: str
    algorithm: str
    world_size: int
    n: int
    root: int
    steps: Tuple[Tuple[Transfer, ...], ...]
    #: per rank, the range ``(lo, hi)`` that holds the result after the last step
    results: Tuple[Tuple[int, int], ...]

    def per_rank(self, rank: int) -> List[Tuple[List[Transfer], List[Transfer]]]:
        """Rank ``rank``'s ``(sends, receives)`` per step, in step and list order."""
        plan = []
        for step in self.steps:
            plan.append(([t for t in step if t.src == rank], [t for t in step if t.dst == rank]))
        return plan


def blocks(lo: int, hi: int, parts: int) -> List[Tuple[int, int]]:
    """``[lo, hi)`` cut into ``parts`` contiguous blocks, the first ``(hi - lo) % parts`` one
    element longer than the rest (blocks are empty where there are fewer elements than parts)."""
    size, extra = divmod(hi - lo, parts)
    out, start = [], lo
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def transfer(src: int, dst: int, lo: int, hi: int, reduce: bool) -> List[Transfer]:
    """A one-transfer list, or an empty one for an empty range (nothing is sent for it)."""
    return [Transfer(src, dst, lo, hi, reduce)] if hi > lo else []


def in_parallel(*phases: List[Step]) -> List[Step]:
    """Run step lists side by side: step i of the result is step i of every phase."""
    depth = max((len(p) for p in phases), default=0)
    return [[t for p in phases if i < len(p) for t in p[i]] for i in range(depth)]


def check_algorithm(collective: str, algorithm: str) -> None:
    """Raise a ``ValueError`` naming the valid choices if ``algorithm`` is not one of
    ``collective``'s (or ``collective`` is not a collective)."""
    if collective not in ALGORITHMS:
        raise ValueError(f"collective: expected one of {', '.join(COLLECTIVES)}, "
                         f"got {collective!r}")
    if algorithm not in ALGORITHMS[collective]:
        raise ValueError(f"{collective}_algo: expected one of "
                         f"{', '.join(ALGORITHMS[collective])}, got {algorithm!r}")


def validate(schedule: Schedule) -> None:
    """Raise a ``ValueError`` if a step is ill-formed: a rank sending to itself, a range
    outside the buffer, or a copy into a range that another transfer of the same step also
    writes (its result would depend on the order)."""
    for i, step in enumerate(schedule.steps):
        incoming: Dict[int, List[Transfer]] = {}
        for t in step:
            if t.src == t.dst or not (0 <= t.src < schedule.world_size
                                      and 0 <= t.dst < schedule.world_size):
                raise ValueError(f"step {i}: bad ranks in {t}")
            if not 0 <= t.lo < t.hi <= schedule.n:
                raise ValueError(f"step {i}: bad range in {t} (n={schedule.n})")
            incoming.setdefault(t.dst, []).append(t)
        for dst, ts in incoming.items():
            for a in range(len(ts)):
                for b in range(a + 1, len(ts)):
                    x, y = ts[a], ts[b]
                    if (not x.reduce or not y.reduce) and x.lo < y.hi and y.lo < x.hi:
                        raise ValueError(f"step {i}: {x} and {y} both write rank {dst}'s "
                                         f"overlapping range and one is a copy")


def sub_ranks(ranks: Sequence[int], root: Optional[int] = None) -> List[int]:
    """``ranks`` rotated so that ``root`` comes first (the order tree algorithms count in)."""
    if root is None:
        return list(ranks)
    i = list(ranks).index(root)
    return list(ranks[i:]) + list(ranks[:i])
