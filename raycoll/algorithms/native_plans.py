"""One rank's part of a :class:`~raycoll.algorithms.schedule.Schedule` as operations of the
native executor over sockets (``raycoll/native/core.h``; made by
:mod:`raycoll.algorithms.scheduled`, run by :mod:`raycoll.transport.native_tcp`).

Buffers: 0 is the rank's flat buffer (in place, the schedule's layout), 1 a scratch buffer of
:attr:`NativePlan.scratch` bytes. Peers are group ranks. Each step of the schedule becomes:

- the step's messages: a ``SEND`` per transfer this rank sends (those to one peer, in the
  schedule's order, form one message), a ``RECV`` per transfer it receives: a copy straight
  into the buffer, unless the range is one this rank also sends in the step (then into the
  scratch, copied after), a reduction into the scratch; then one ``XFER`` that moves them;
- then what came is applied, in the schedule's order: staged copies (``LOCAL``), and each
  range's reductions: one source as ``range = range op source`` (``RED2``), several (the
  direct exchange, where every peer's buffer reduces into every rank's) as one reduction of
  the range's own value and every source in rank order (``MREDUCE``), so that every rank
  holds bitwise the same result;
- after the last step, AVG's division or PREMUL_SUM's factor over the rank's result range
  (``FINAL``).

The rank's counters (``ProcessGroup.counters()``) count what the core moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from raycoll.algorithms.schedule import Schedule, Transfer

__all__ = ["NativePlan", "plan_schedule", "plan_exchange", "Piece", "SEND", "RECV", "XFER",
           "RED2", "MREDUCE", "LOCAL", "FINAL"]

LOCAL, FINAL, SEND, RECV, XFER, RED2, MREDUCE = 5, 6, 7, 8, 9, 10, 11
FLAT, SCRATCH = 0, 1

Op = Tuple[int, int, int, int, int, int, int, int]


@dataclass(frozen=True)
class NativePlan:
    """A rank's operations (``ops``: n x 8 int64, read-only), the scratch bytes they need,
    the peers they send to and receive from, and the steps."""

    ops: np.ndarray
    scratch: int
    sends_to: Tuple[int, ...]
    recvs_from: Tuple[int, ...]
    rounds: int


def _overlaps(lo: int, hi: int, ranges: Sequence[Tuple[int, int]]) -> bool:
    return any(lo < b and a < hi for a, b in ranges)


def plan_schedule(schedule: Schedule, rank: int, itemsize: int, reducing: bool) -> NativePlan:
    """Rank ``rank``'s operations for ``schedule`` over a buffer of ``itemsize``-byte elements
    (``reducing``: the op needs its final step, AVG's or PREMUL_SUM's)."""
    ops: List[Op] = []
    scratch = 0
    sends_to: Dict[int, None] = {}
    recvs_from: Dict[int, None] = {}
    rounds = 0
    for step_no, (sends, recvs) in enumerate(schedule.per_rank(rank)):
        by_dst: Dict[int, List[Transfer]] = {}
        for t in sends:
            by_dst.setdefault(t.dst, []).append(t)
        sent_ranges = [(t.lo, t.hi) for t in sends]
        for dst in sorted(by_dst):
            for t in by_dst[dst]:
                ops.append((SEND, FLAT, t.lo * itemsize, (t.hi - t.lo) * itemsize, dst, 0, 0, 0))
            sends_to[dst] = None
        by_src: Dict[int, List[Transfer]] = {}
        for t in recvs:
            by_src.setdefault(t.src, []).append(t)
        at = 0  # the step's scratch
        staged: Dict[Transfer, int] = {}
        for src in sorted(by_src):
            for t in by_src[src]:
                n = (t.hi - t.lo) * itemsize
                if t.reduce or _overlaps(t.lo, t.hi, sent_ranges):
                    ops.append((RECV, SCRATCH, at, n, src, 0, 0, 0))
                    staged[t] = at
                    at += n
                else:
                    ops.append((RECV, FLAT, t.lo * itemsize, n, src, 0, 0, 0))
            recvs_from[src] = None
        if sends or recvs:
            ops.append((XFER, 0, 0, 0, 0, 0, 0, step_no))
            rounds += 1
        at = _apply(ops, recvs, staged, rank, itemsize, at)
        scratch = max(scratch, at)
    if reducing and schedule.collective in ("all_reduce", "reduce_scatter", "reduce"):
        lo, hi = schedule.results[rank]
        if hi > lo:
            ops.append((FINAL, FLAT, lo * itemsize, (hi - lo) * itemsize, 0, 0, 0, 0))
    arr = np.array(ops, dtype=np.int64).reshape(-1, 8)
    arr.setflags(write=False)
    return NativePlan(arr, scratch, tuple(sends_to), tuple(recvs_from), rounds)


def _apply(ops: List[Op], recvs: Sequence[Transfer], staged: Dict[Transfer, int], rank: int,
           itemsize: int, at: int) -> int:
    """Append what applies a step's staged receives, in the schedule's order (a range's
    reductions at its first one); returns the scratch used."""
    by_range: Dict[Tuple[int, int], List[Transfer]] = {}
    for t in recvs:
        if t.reduce:
            by_range.setdefault((t.lo, t.hi), []).append(t)
    done: Dict[Tuple[int, int], None] = {}
    for t in recvs:
        n = (t.hi - t.lo) * itemsize
        if not t.reduce:
            if t in staged:
                ops.append((LOCAL, FLAT, t.lo * itemsize, n, SCRATCH, staged[t], 0, 0))
            continue
        key = (t.lo, t.hi)
        if key in done:
            continue
        done[key] = None
        group = by_range[key]
        partial = any(t.lo < b and a < t.hi and (a, b) != key for a, b in by_range)
        if len(group) == 1 or partial:  # one source (or ranges that cross): in order
            for g in group:
                ops.append((RED2, FLAT, g.lo * itemsize, n, SCRATCH, staged[g], 0, 0))
            continue
        # several sources into one range: its own value and theirs, reduced in rank order,
        # from consecutive slots of the scratch
        order = sorted([rank] + [g.src for g in group])
        base = at
        slot: Dict[int, int] = {r: base + i * n for i, r in enumerate(order)}
        ops.append((LOCAL, SCRATCH, slot[rank], n, FLAT, t.lo * itemsize, 0, 0))
        for g in group:
            ops.append((LOCAL, SCRATCH, slot[g.src], n, SCRATCH, staged[g], 0, 0))
        ops.append((MREDUCE, FLAT, t.lo * itemsize, n, SCRATCH, base, len(order), n))
        at = base + len(order) * n
    return at


#: One message of a one-step exchange: (peer, buffer id, offset, bytes).
Piece = Tuple[int, int, int, int]


def plan_exchange(rank: int, sends: Sequence[Piece], recvs: Sequence[Piece],
                  local: Sequence[Tuple[int, int, int, int, int]],
                  step: int = 0) -> NativePlan:
    """One step of point-to-point messages (gather, scatter, all_to_all and their
    metadata): this rank sends each of ``sends`` to its peer and receives each of ``recvs``
    straight into its buffer (at most one message each way per peer, empty ones included:
    the receiver's count is checked against the sender's, and a difference fails the call on
    the receiver as a mismatch), then ``local`` copies ``(dst buffer, dst offset, src
    buffer, src offset, bytes)`` run (this rank's own piece). Buffer ids are the caller's
    (:data:`FLAT` and :data:`SCRATCH` are 0 and 1); the step's messages carry ``step``."""
    ops: List[Op] = []
    for peer, buf, off, n in sends:
        if peer == rank:
            raise ValueError(f"plan_exchange: rank {rank} cannot send itself a message")
        ops.append((SEND, buf, off, n, peer, 0, 0, 0))
    for peer, buf, off, n in recvs:
        if peer == rank:
            raise ValueError(f"plan_exchange: rank {rank} cannot receive from itself")
        ops.append((RECV, buf, off, n, peer, 0, 0, 0))
    rounds = 0
    if sends or recvs:
        ops.append((XFER, 0, 0, 0, 0, 0, 0, step))
        rounds = 1
    for dst, dst_off, src, src_off, n in local:
        if n:
            ops.append((LOCAL, dst, dst_off, n, src, src_off, 0, 0))
    arr = np.array(ops, dtype=np.int64).reshape(-1, 8)
    arr.setflags(write=False)
    return NativePlan(arr, 0, tuple(dict.fromkeys(p for p, *_ in sends)),
                      tuple(dict.fromkeys(p for p, *_ in recvs)), rounds)
