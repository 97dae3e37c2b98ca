"""Plans for the node segment: each collective as the steps the native executor runs.

The node segment (``raycoll/native/segment.h``, run by :mod:`raycoll.transport.segment`) gives
every local rank a slot of two halves; a *step* is: write into one's own half, publish, wait
for every rank, read the peers' halves. A plan is the list of a rank's operations, 8 int64
words each (``kind, a, a_off, n, b, b_off, flags, 0``):

- ``WRITE a a_off n -> b_off``: this rank's buffer ``a`` into its own half of the coming step;
- ``SYNC``: publish the step and wait for every rank (``flags``: ``STEP_FIRST`` on a call's
  first step, where the ranks' fingerprints are compared before anything is read);
- ``COPY rank b's half [b_off, +n) -> a a_off`` (``a`` may be ``NEXT``: this rank's half of
  the next step);
- ``REDUCE every rank's half [b_off, +n) -> a a_off``, in rank order (``FINAL``: then AVG's
  division or PREMUL_SUM's factor);
- ``LOCAL b b_off -> a a_off`` (a copy between this rank's buffers), ``FINAL a a_off n``.

Buffer ids are per collective (documented on each function). Small collectives are one step;
larger ones stream through steps of at most a half each, the reductions as a reduce-scatter
into the next half and an all-gather out of it in the step after (one copy in, each byte
reduced once, one copy out), so that a 64 MiB all_reduce costs each rank about what a memory
copy of it does. Plans are pure functions of their arguments (cached): every rank computes
its own from what all ranks agree on, so their steps line up.
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, NamedTuple, Sequence, Tuple

import numpy as np

from raycoll.algorithms.schedule import blocks

__all__ = ["Plan", "Piece", "WRITE", "SYNC", "COPY", "REDUCE", "LOCAL", "FINAL", "NEXT",
           "FIRST", "FINISH", "all_reduce", "reduce", "broadcast", "all_gather",
           "reduce_scatter", "scatter", "barrier", "exchange", "A2A_META_ALIGN", "a2a_layout",
           "all_to_all_first", "all_to_all_rest", "describe"]

WRITE, SYNC, COPY, REDUCE, LOCAL, FINAL = 1, 2, 3, 4, 5, 6
CREAD, CREDUCE = 12, 13
#: CREDUCE's flag: apply the op's final step
CFINAL = 0x100
#: the buffer id of this rank's own half of the next step
NEXT = -2
#: SYNC's flag: a call's first step (fingerprints compared)
FIRST = 1
#: SYNC's flag: the step publishes the call's buffers in the rank's half, for the peers to
#: read across processes (CREAD, CREDUCE)
PUBLISH = 2
#: REDUCE's flag: apply the op's final step to the result
FINISH = 1
#: Slot offsets are kept on cache lines.
ALIGN = 64

Op = Tuple[int, int, int, int, int, int, int, int]


def _down(n: int, to: int) -> int:
    return n // to * to


class Plan(NamedTuple):
    """A rank's operations (``ops``: n x 8 int64, read-only) and how many steps they take."""

    ops: np.ndarray
    steps: int


def _plan(ops: Sequence[Op]) -> Plan:
    out = np.array(ops, dtype=np.int64).reshape(-1, 8)
    out.setflags(write=False)
    return Plan(out, int((out[:, 0] == SYNC).sum()))


def write(buf: int, off: int, n: int, slot_off: int) -> Op:
    return (WRITE, buf, off, n, 0, slot_off, 0, 0)


def sync(first: bool = False, publish: bool = False) -> Op:
    return (SYNC, 0, 0, 0, 0, 0, (FIRST if first else 0) | (PUBLISH if publish else 0), 0)


def copy(dst: int, off: int, n: int, rank: int, slot_off: int) -> Op:
    return (COPY, dst, off, n, rank, slot_off, 0, 0)


def reduce_op(dst: int, off: int, n: int, slot_off: int, finish: bool) -> Op:
    return (REDUCE, dst, off, n, 0, slot_off, FINISH if finish else 0, 0)


def local(dst: int, off: int, n: int, src: int, src_off: int) -> Op:
    return (LOCAL, dst, off, n, src, src_off, 0, 0)


def describe(plan: Plan) -> List[str]:
    """A plan in words, one operation a line (for tests and debugging)."""
    names = {WRITE: "WRITE", SYNC: "SYNC", COPY: "COPY", REDUCE: "REDUCE", LOCAL: "LOCAL",
             FINAL: "FINAL"}
    return [f"{names.get(int(o[0]), o[0])} " + " ".join(str(int(v)) for v in o[1:7])
            for o in plan.ops]


# ---------------------------------------------------------------------- reductions
@lru_cache(maxsize=256)
def all_reduce(count: int, itemsize: int, nranks: int, me: int, half: int,
               one_step_bytes: int, root: int = -1) -> Plan:
    """all_reduce of ``count`` elements (buffer 0, in place); with ``root >= 0``, reduce:
    only ``root`` writes the result (the others' buffers are left as they were).

    Up to ``one_step_bytes`` (and a half): one step, every rank reduces every rank's buffer.
    Larger: chunks of half a half, each reduce-scattered into the next half (rank r reduces
    the r-th part of the chunk) and gathered out of it in the next step."""
    nbytes = count * itemsize
    mine = root < 0 or root == me
    if nbytes <= min(one_step_bytes, half):
        ops: List[Op] = [write(0, 0, nbytes, 0), sync(first=True)]
        if mine:
            ops.append(reduce_op(0, 0, nbytes, 0, finish=True))
        return _plan(ops)
    chunk = max(1, _down(half // 2, ALIGN) // itemsize)
    area = _down(half // 2, ALIGN)  # where a rank's reduced parts go in its next half
    ops = []
    previous: List[Tuple[int, int]] = []
    lo_prev = 0
    for k, lo in enumerate(range(0, count, chunk)):
        hi = min(lo + chunk, count)
        ops.append(write(0, lo * itemsize, (hi - lo) * itemsize, 0))
        ops.append(sync(first=k == 0))
        if mine:
            ops += _gather_parts(previous, lo_prev, itemsize, area)
        parts = blocks(0, hi - lo, nranks)
        a, b = parts[me]
        if b > a:
            ops.append(reduce_op(NEXT, area + a * itemsize, (b - a) * itemsize, a * itemsize,
                                 finish=True))
        previous, lo_prev = parts, lo
    ops.append(sync())
    if mine:
        ops += _gather_parts(previous, lo_prev, itemsize, area)
    return _plan(ops)


def _gather_parts(parts: Sequence[Tuple[int, int]], lo: int, itemsize: int,
                  area: int) -> List[Op]:
    """Copy every rank's reduced part of a chunk (at ``area`` in its half) into buffer 0."""
    return [copy(0, (lo + a) * itemsize, (b - a) * itemsize, r, area + a * itemsize)
            for r, (a, b) in enumerate(parts) if b > a]


def reduce(count: int, itemsize: int, nranks: int, me: int, half: int, one_step_bytes: int,
           root: int) -> Plan:
    """reduce into ``root``'s buffer 0 (see :func:`all_reduce`)."""
    return all_reduce(count, itemsize, nranks, me, half, one_step_bytes, root)


@lru_cache(maxsize=256)
def reduce_scatter(count: int, itemsize: int, nranks: int, me: int, half: int) -> Plan:
    """reduce_scatter: buffer 0 holds ``nranks`` pieces of ``count`` elements (piece j for
    rank j), buffer 1 this rank's result (``count`` elements). Each step carries a chunk of
    every piece (in rank order in the half); rank r reduces piece r's chunk."""
    per = max(1, (_down(half // nranks, ALIGN) or half // nranks) // itemsize)
    chunk = min(per, max(count, 1))
    stride = chunk * itemsize
    ops: List[Op] = []
    for k, lo in enumerate(range(0, max(count, 1), chunk)):
        hi = min(lo + chunk, count)
        n = (hi - lo) * itemsize
        for j in range(nranks):
            if n:
                ops.append(write(0, (j * count + lo) * itemsize, n, j * stride))
        ops.append(sync(first=k == 0))
        if n:
            ops.append(reduce_op(1, lo * itemsize, n, me * stride, finish=True))
    return _plan(ops)


# ---------------------------------------------------------------------- data movement
@lru_cache(maxsize=256)
def broadcast(nbytes: int, nranks: int, me: int, half: int, root: int) -> Plan:
    """broadcast of buffer 0 (``nbytes``) from ``root``, a half a step."""
    step = _down(half, ALIGN)
    ops: List[Op] = []
    for k, lo in enumerate(range(0, max(nbytes, 1), step)):
        n = min(step, nbytes - lo)
        if me == root and n:
            ops.append(write(0, lo, n, 0))
        ops.append(sync(first=k == 0))
        if me != root and n:
            ops.append(copy(0, lo, n, root, 0))
    return _plan(ops)


def _piece(pieces: bool, j: int, nbytes: int) -> Tuple[int, int]:
    """Where piece ``j`` of ``nbytes`` is: buffer ``2 + j`` (``pieces``: one buffer each),
    else buffer 1 at ``j * nbytes``."""
    return (2 + j, 0) if pieces else (1, j * nbytes)


@lru_cache(maxsize=256)
def all_gather(nbytes: int, nranks: int, me: int, half: int, root: int = -1,
               pieces: bool = False) -> Plan:
    """all_gather: buffer 0 this rank's input (``nbytes``), the output's pieces in buffer 1
    (or buffers 2, 3, ...: ``pieces``); with ``root >= 0``, gather: only ``root`` has an
    output."""
    step = _down(half, ALIGN)
    mine = root < 0 or root == me
    ops: List[Op] = [local(*_piece(pieces, me, nbytes), nbytes, 0, 0)] if mine and nbytes else []
    for k, lo in enumerate(range(0, max(nbytes, 1), step)):
        n = min(step, nbytes - lo)
        if n:
            ops.append(write(0, lo, n, 0))
        ops.append(sync(first=k == 0))
        if mine and n:
            for r in range(nranks):
                if r != me:
                    buf, off = _piece(pieces, r, nbytes)
                    ops.append(copy(buf, off + lo, n, r, 0))
    return _plan(ops)


@lru_cache(maxsize=256)
def scatter(nbytes: int, nranks: int, me: int, half: int, root: int, pieces: bool = False) -> Plan:
    """scatter: the root's ``nranks`` pieces of ``nbytes`` in buffer 0 (or buffers 2, 3,
    ...: ``pieces``), buffer 1 this rank's output."""
    per = _down(half // nranks, ALIGN) or max(1, half // nranks)
    chunk = min(per, max(nbytes, 1))

    def source(j: int) -> Tuple[int, int]:
        return (2 + j, 0) if pieces else (0, j * nbytes)

    ops: List[Op] = [local(1, 0, nbytes, *source(root))] if me == root and nbytes else []
    for k, lo in enumerate(range(0, max(nbytes, 1), chunk)):
        n = min(chunk, nbytes - lo)
        if me == root and n:
            for j in range(nranks):
                if j != me:
                    buf, off = source(j)
                    ops.append(write(buf, off + lo, n, j * chunk))
        ops.append(sync(first=k == 0))
        if me != root and n:
            ops.append(copy(1, lo, n, root, me * chunk))
    return _plan(ops)


@lru_cache(maxsize=16)
def barrier() -> Plan:
    """A step with no data."""
    return _plan([sync(first=True)])


def exchange(nbytes: int) -> Plan:
    """One step: buffer 0 (``nbytes``) into the own half at 0 (Python reads the peers')."""
    return _plan([write(0, 0, nbytes, 0), sync(first=True)] if nbytes else [sync(first=True)])


# ---------------------------------------------------------------------- all_to_all
#: all_to_all's first step carries each rank's sizes (what it sends each rank, what it
#: expects from each) before the data: ``2 * nranks`` int64, this many bytes rounded up.
A2A_META_ALIGN = ALIGN

#: A piece of an all_to_all: (buffer id, offset, bytes).
Piece = Tuple[int, int, int]


def a2a_layout(nranks: int, half: int) -> Tuple[int, int]:
    """(where the data starts in a half, bytes a destination gets a step)."""
    meta = -(-2 * nranks * 8 // A2A_META_ALIGN) * A2A_META_ALIGN
    return meta, max(0, _down((half - meta) // nranks, ALIGN))


def all_to_all_first(sends: Tuple[Piece, ...], nranks: int, me: int, half: int) -> Plan:
    """all_to_all's first step: buffer 0 the sizes (``2 * nranks`` int64); ``sends[j]`` the
    piece for rank j. Writes the sizes and the first part of every piece for another rank,
    then syncs."""
    meta, region = a2a_layout(nranks, half)
    ops: List[Op] = [write(0, 0, 2 * nranks * 8, 0)]
    for j, (buf, off, n) in enumerate(sends):
        if j != me and n and region:
            ops.append(write(buf, off, min(n, region), meta + j * region))
    ops.append(sync(first=True))
    return _plan(ops)


def all_to_all_rest(longest: int, sends: Tuple[Piece, ...], recvs: Tuple[Piece, ...],
                    nranks: int, me: int, half: int) -> Plan:
    """The rest of an all_to_all once every rank's sizes are known (``longest``: the most
    bytes any rank sends another): copy what came in the first step, then stream the rest,
    a region a destination a step; ``recvs[s]`` is where the piece from rank s goes; this
    rank's own piece is copied locally."""
    meta, region = a2a_layout(nranks, half)
    ops: List[Op] = []
    if recvs[me][2]:
        ops.append(local(recvs[me][0], recvs[me][1], recvs[me][2], sends[me][0], sends[me][1]))
    steps = -(-longest // region) if region else 0
    for k in range(steps):
        lo = k * region
        if k:
            for j, (buf, off, n) in enumerate(sends):
                if j != me and n > lo:
                    ops.append(write(buf, off + lo, min(region, n - lo), meta + j * region))
            ops.append(sync())
        for s, (buf, off, n) in enumerate(recvs):
            if s != me and n > lo:
                ops.append(copy(buf, off + lo, min(region, n - lo), s, meta + me * region))
    return _plan(ops)


# ---------------------------------------------------------------------- across processes
# Where every rank may read the others' memory (process_vm_readv: the segment's probe), large
# collectives read the peers' own buffers, published by the call's first step, instead of
# going through the halves: the data is copied once (a reduction reads each byte once and
# writes its part once). The last step makes sure no rank still reads a buffer its owner
# has got back.


def cread(dst: int, off: int, n: int, rank: int, peer_off: int, buf: int = 0) -> Op:
    return (CREAD, dst, off, n, rank, peer_off, buf, 0)


def creduce(dst: int, off: int, n: int, peer_off: int, buf: int, finish: bool) -> Op:
    return (CREDUCE, dst, off, n, 0, peer_off, buf | (CFINAL if finish else 0), 0)


@lru_cache(maxsize=256)
def cma_all_reduce(count: int, itemsize: int, nranks: int, me: int, root: int = -1) -> Plan:
    """all_reduce (buffer 0, in place): rank r reduces part r out of every rank's buffer into
    its own, then each reads the others' reduced parts. With ``root >= 0``, reduce: the root
    reduces the whole buffer out of the others' (theirs stay as they were)."""
    if root >= 0:
        ops: List[Op] = [sync(first=True, publish=True)]
        if me == root and count:
            ops.append(creduce(0, 0, count * itemsize, 0, 0, finish=True))
        return _plan(ops + [sync()])
    parts = blocks(0, count, nranks)
    a, b = parts[me]
    ops = [sync(first=True, publish=True)]
    if b > a:
        ops.append(creduce(0, a * itemsize, (b - a) * itemsize, a * itemsize, 0, finish=True))
    ops.append(sync())
    ops += [cread(0, lo * itemsize, (hi - lo) * itemsize, r, lo * itemsize)
            for r, (lo, hi) in enumerate(parts) if r != me and hi > lo]
    return _plan(ops + [sync()])


@lru_cache(maxsize=256)
def cma_reduce_scatter(count: int, itemsize: int, nranks: int, me: int) -> Plan:
    """reduce_scatter: buffer 0 every rank's ``nranks`` pieces, buffer 1 this rank's result:
    piece ``me`` reduced out of every rank's buffer 0."""
    n = count * itemsize
    ops: List[Op] = [sync(first=True, publish=True)]
    if n:
        ops.append((CREDUCE, 1, 0, n, 0, me * n, 0 | CFINAL, 0))
    return _plan(ops + [sync()])


@lru_cache(maxsize=256)
def cma_broadcast(nbytes: int, nranks: int, me: int, root: int) -> Plan:
    """broadcast of buffer 0: every rank reads the root's."""
    ops: List[Op] = [sync(first=True, publish=True)]
    if me != root and nbytes:
        ops.append(cread(0, 0, nbytes, root, 0))
    return _plan(ops + [sync()])


@lru_cache(maxsize=256)
def cma_all_gather(nbytes: int, nranks: int, me: int, root: int = -1,
                   pieces: bool = False) -> Plan:
    """all_gather (buffer 0 the input; the output as in :func:`all_gather`; gather with
    ``root >= 0``): every rank (or the root) reads every peer's input."""
    mine = root < 0 or root == me
    ops: List[Op] = [local(*_piece(pieces, me, nbytes), nbytes, 0, 0)] if mine and nbytes else []
    ops.append(sync(first=True, publish=True))
    if mine and nbytes:
        for r in range(nranks):
            if r != me:
                buf, off = _piece(pieces, r, nbytes)
                ops.append(cread(buf, off, nbytes, r, 0))
    return _plan(ops + [sync()])


@lru_cache(maxsize=256)
def cma_scatter(nbytes: int, nranks: int, me: int, root: int, pieces: bool = False) -> Plan:
    """scatter (as :func:`scatter`): every rank reads its piece from the root's."""
    source = (2 + root, 0) if pieces else (0, root * nbytes)
    ops: List[Op] = [local(1, 0, nbytes, *source)] if me == root and nbytes else []
    ops.append(sync(first=True, publish=True))
    if me != root and nbytes:
        ops.append(cread(1, 0, nbytes, root, 0, 2 + me) if pieces
                   else cread(1, 0, nbytes, root, me * nbytes, 0))
    return _plan(ops + [sync()])
