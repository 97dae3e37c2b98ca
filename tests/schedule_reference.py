"""The tests' reference for schedules: run a :class:`~raycoll.algorithms.schedule.Schedule`
on arrays in Python (the library runs schedules only on its native executor; this is what
the tests compare schedules and native plans with).

:func:`execute` runs one rank's part of a schedule over a :class:`PeerTransport` (``send`` an
array to a peer, ``recv`` one from a peer), so any transport that keeps per-pair order can
carry it. :class:`ThreadTransport` is an in-process one (a queue per ordered pair, one thread
per rank, every wait bounded by a timeout), and :func:`run_threads` runs a whole group on it.
:func:`simulate` runs every rank in one loop, step by step, with no transport: the reference
the tests compare the others to.

Within a step a rank first sends (copies of its buffer as the step found it), then receives
and applies in the schedule's order. Reductions combine with ``ReduceOp`` 's ufunc; an op's
final step (AVG's division, PREMUL_SUM's factor) is applied once, on each rank's result range.
"""

from __future__ import annotations

import queue
import threading
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from raycoll.algorithms.schedule import Schedule
from raycoll.reduce_op import ReduceOp, combine, finalize

__all__ = ["PeerTransport", "ThreadTransport", "combining_op", "execute", "finish", "run_threads",
           "simulate"]

_REDUCING = ("all_reduce", "reduce_scatter", "reduce")


class PeerTransport(Protocol):
    """What :func:`execute` needs from a transport: ordered point-to-point arrays."""

    def send(self, dst: int, array: np.ndarray) -> None: ...

    def recv(self, src: int) -> np.ndarray: ...


def _check(schedule: Schedule, buffer: np.ndarray, rank: int) -> np.ndarray:
    if not isinstance(buffer, np.ndarray):
        raise TypeError(f"buffer: expected a numpy array, got {type(buffer).__name__} "
                        f"(rank {rank})")
    if buffer.size != schedule.n:
        raise ValueError(f"buffer: expected {schedule.n} elements for this schedule, got "
                         f"{buffer.size} (rank {rank})")
    if not buffer.flags.c_contiguous:
        raise ValueError(f"buffer: expected a C-contiguous array (rank {rank})")
    return buffer.reshape(-1)


def combining_op(op: ReduceOp) -> ReduceOp:
    """The op each transfer reduces with: AVG and PREMUL_SUM reduce as SUM (the rest goes on
    in :func:`finish`)."""
    return ReduceOp.SUM if op.name in ("AVG", "PREMUL_SUM") else op


def finish(schedule: Schedule, flat: np.ndarray, rank: int, op: ReduceOp) -> None:
    """Apply ``op``'s final step (AVG's division, PREMUL_SUM's factor) to rank ``rank``'s
    result range."""
    if schedule.collective in _REDUCING:
        lo, hi = schedule.results[rank]
        if hi > lo:
            finalize(op, flat[lo:hi], schedule.world_size)


def execute(schedule: Schedule, rank: int, buffer: np.ndarray, op: ReduceOp,
            transport: PeerTransport) -> None:
    """Run rank ``rank``'s part of ``schedule`` on ``buffer`` (in place) over ``transport``."""
    if not 0 <= rank < schedule.world_size:
        raise ValueError(f"rank: expected a rank in [0, {schedule.world_size}), got {rank!r}")
    flat = _check(schedule, buffer, rank)
    combine_op = combining_op(op)
    for sends, recvs in schedule.per_rank(rank):
        for t in sends:
            transport.send(t.dst, flat[t.lo:t.hi].copy())
        for t in recvs:
            data = transport.recv(t.src)
            if data.shape != (t.hi - t.lo,):
                raise ValueError(f"rank {rank}: expected {t.hi - t.lo} elements from rank "
                                 f"{t.src} for {t}, got shape {data.shape}")
            if t.reduce:
                combine(combine_op, flat[t.lo:t.hi], data)
            else:
                flat[t.lo:t.hi] = data
    finish(schedule, flat, rank, op)


def simulate(schedule: Schedule, buffers: Sequence[np.ndarray], op: ReduceOp) -> None:
    """Run ``schedule`` on every rank's buffer (in place), one step at a time, in one thread."""
    if len(buffers) != schedule.world_size:
        raise ValueError(f"buffers: expected {schedule.world_size} (one a rank), "
                         f"got {len(buffers)}")
    flats = [_check(schedule, b, r) for r, b in enumerate(buffers)]
    combine_op = combining_op(op)
    for step in schedule.steps:
        payloads = [flats[t.src][t.lo:t.hi].copy() for t in step]
        for t, data in zip(step, payloads):
            if t.reduce:
                combine(combine_op, flats[t.dst][t.lo:t.hi], data)
            else:
                flats[t.dst][t.lo:t.hi] = data
    for r, flat in enumerate(flats):
        finish(schedule, flat, r, op)


class ThreadTransport:
    """One rank's end of an in-process group: a queue per ordered pair of ranks.

    Make the group's ends with :meth:`group`; ``recv`` waits at most ``timeout`` seconds and
    then raises ``TimeoutError`` naming the pair."""

    def __init__(self, rank: int, queues: Dict[Tuple[int, int], "queue.Queue[np.ndarray]"],
                 timeout: float) -> None:
        self.rank = rank
        self._queues = queues
        self._timeout = timeout
        self.sent: List[Tuple[int, int]] = []  # (dst, nbytes) per message, for tests

    @classmethod
    def group(cls, world_size: int, timeout: float = 30.0) -> List["ThreadTransport"]:
        queues: Dict[Tuple[int, int], "queue.Queue[np.ndarray]"] = {
            (s, d): queue.Queue() for s in range(world_size) for d in range(world_size)}
        return [cls(r, queues, timeout) for r in range(world_size)]

    def send(self, dst: int, array: np.ndarray) -> None:
        self._queues[(self.rank, dst)].put(array)
        self.sent.append((dst, array.nbytes))

    def recv(self, src: int) -> np.ndarray:
        try:
            return self._queues[(src, self.rank)].get(timeout=self._timeout)
        except queue.Empty:
            raise TimeoutError(f"rank {self.rank}: nothing from rank {src} within "
                               f"{self._timeout} s") from None


def run_threads(schedule: Schedule, buffers: Sequence[np.ndarray], op: ReduceOp,
                timeout: float = 30.0) -> List[ThreadTransport]:
    """Run ``schedule`` with one thread a rank over :class:`ThreadTransport`; re-raise the
    first rank's error. Returns the transports (their ``sent`` logs)."""
    ends = ThreadTransport.group(schedule.world_size, timeout)
    errors: List[Optional[BaseException]] = [None] * schedule.world_size

    def body(r: int) -> None:
        try:
            execute(schedule, r, buffers[r], op, ends[r])
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True)
               for r in range(schedule.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5.0)
        if t.is_alive():
            raise TimeoutError(f"run_threads: a rank did not finish within {timeout + 5.0} s")
    for r, exc in enumerate(errors):
        if exc is not None:
            raise RuntimeError(f"rank {r} failed: {exc}") from exc
    return ends
