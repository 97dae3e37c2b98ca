"""Hierarchical plans for a group on several nodes: the node segment inside each node and
sockets between nodes, in one plan that one call of the native executor runs
(``rc_exec(seg, net, ...)``, ``raycoll/native/core.h``).

The group's ranks on a node share that node's segment (:mod:`raycoll.transport.node_segment`;
its local ranks are the node's group ranks in group-rank order; a node with one rank of the
group has none). Nodes are ordered by their first group rank. ``R``, the rails, is the fewest
ranks any node holds: local rank ``i < R`` of every node forms rail ``i``, and the rails carry
the inter-node step between them (2 + 2 ranks: 2 rails, each half of the buffer; 3 + 1: one
rail, the first rank of each node). Every rank ends with bitwise the same result: a node's
partial is reduced in local-rank order, the nodes' partials in node order.

all_reduce, in two forms (:func:`all_reduce`):

- **small** (at most ``SMALL_BYTES`` and a half): every local rank writes its buffer into its
  half, one step, every rail rank reduces the node's partial (the whole buffer), sends it to
  its rail's peers on the other nodes and reduces theirs with its own in node order. Where a
  node holds more ranks than there are rails, one more step hands local rank 0's result to
  the others. On a balanced layout (2 + 2, 4 + 4) that is one segment step and one socket
  round trip.
- **streamed**: chunks of half a half. A chunk's step: every local rank writes the chunk; rail
  rank ``i`` reduces part ``i`` of it out of the node's halves (a reduce-scatter in the node),
  exchanges that part with its rail's peers and reduces them in node order (the inter-node
  step, on its part only), and writes the result into its next half, where the next step's
  readers copy it (the all-gather in the node, riding on the next chunk's step).

Buffers: 0 the rank's flat buffer (in place), 1 a scratch (:attr:`NativePlan.scratch`
bytes: one slot per node for the inter-node reduction). Plans are pure functions of what
every rank agrees on (count, itemsize, node map, the group's half), cached.
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, NamedTuple, Sequence, Tuple

import numpy as np

from raycoll.algorithms.native_plans import (FINAL, FLAT, LOCAL, MREDUCE, RECV, SCRATCH, SEND,
                                             XFER, NativePlan)
from raycoll.algorithms.schedule import blocks
from raycoll.algorithms.segment_plans import ALIGN, COPY, REDUCE, SYNC, WRITE, FIRST

__all__ = ["Layout", "layout", "all_reduce", "broadcast", "all_gather", "reduce_scatter",
           "SMALL_BYTES"]

#: all_reduce up to this many bytes takes the small form (one segment step, one exchange).
SMALL_BYTES = 64 << 10

Op = Tuple[int, int, int, int, int, int, int, int]


class Layout(NamedTuple):
    """A group's ranks by node: ``nodes[m]`` the group ranks on node ``m`` (in rank order;
    nodes ordered by their first rank), each rank's node and local index, and the rails."""

    nodes: Tuple[Tuple[int, ...], ...]
    node_of: Tuple[int, ...]
    local: Tuple[int, ...]
    rails: int


@lru_cache(maxsize=64)
def layout(node_ids: Tuple[str, ...]) -> Layout:
    """The :class:`Layout` of a group whose rank ``r`` is on node ``node_ids[r]``."""
    order: List[str] = list(dict.fromkeys(node_ids))
    nodes = tuple(tuple(r for r, n in enumerate(node_ids) if n == node) for node in order)
    node_of = tuple(order.index(n) for n in node_ids)
    local = tuple(nodes[node_of[r]].index(r) for r in range(len(node_ids)))
    return Layout(nodes, node_of, local, min(len(m) for m in nodes))


def _write(buf: int, off: int, n: int, slot_off: int) -> Op:
    return (WRITE, buf, off, n, 0, slot_off, 0, 0)


def _sync(first: bool = False) -> Op:
    return (SYNC, 0, 0, 0, 0, 0, FIRST if first else 0, 0)


def _exchange(ops: List[Op], peers: Sequence[Tuple[int, int]], mine: int, n: int, stride: int, step: int) -> None:
    """This rank's slot (node ``mine``, ``n`` bytes at ``mine * stride`` of the scratch) to
    each rail peer, and each peer's into its node's slot; one round (``step``)."""
    for node, peer in peers:
        ops.append((SEND, SCRATCH, mine * stride, n, peer, 0, 0, 0))
    for node, peer in peers:
        ops.append((RECV, SCRATCH, node * stride, n, peer, 0, 0, 0))
    ops.append((XFER, 0, 0, 0, 0, 0, 0, step))


def _down(n: int, to: int) -> int:
    return n // to * to


@lru_cache(maxsize=256)
def all_reduce(count: int, itemsize: int, node_ids: Tuple[str, ...], rank: int, half: int,
               finish: bool, small_bytes: int = SMALL_BYTES) -> NativePlan:
    """Rank ``rank``'s hierarchical all_reduce of ``count`` elements of ``itemsize`` bytes
    (buffer 0, in place) on the group whose ranks are on ``node_ids``; ``half``: the smallest
    segment half of the group's nodes; ``finish``: the op has a final step (AVG, PREMUL_SUM).
    See the module docstring."""
    lay = layout(node_ids)
    home = lay.node_of[rank]
    li = lay.local[rank]
    k = len(lay.nodes[home])
    nnodes, rails = len(lay.nodes), lay.rails
    rail = li < rails
    peers = [(m, lay.nodes[m][li]) for m in range(nnodes) if m != home] if rail else []
    nbytes = count * itemsize
    ops: List[Op] = []
    if nbytes <= min(small_bytes, half):
        if k > 1:
            ops += [_write(FLAT, 0, nbytes, 0), _sync(first=True)]
            if rail:
                ops.append((REDUCE, SCRATCH, home * nbytes, nbytes, 0, 0, 0, 0))
        elif nbytes:
            ops.append((LOCAL, SCRATCH, home * nbytes, nbytes, FLAT, 0, 0, 0))
        if rail:
            _exchange(ops, peers, home, nbytes, nbytes, 0)
            if nbytes:
                ops.append((MREDUCE, FLAT, 0, nbytes, SCRATCH, 0, nnodes, nbytes))
                if finish:
                    ops.append((FINAL, FLAT, 0, nbytes, 0, 0, 0, 0))
        if k > rails:  # local rank 0's result to the node's ranks beyond the rails
            if li == 0 and nbytes:
                ops.append(_write(FLAT, 0, nbytes, 0))
            ops.append(_sync())
            if not rail and nbytes:
                ops.append((COPY, FLAT, 0, nbytes, 0, 0, 0, 0))
        return _plan(ops, nnodes * nbytes, peers)
    area = _down(half // 2, ALIGN)  # where a rail rank's reduced part goes in its next half
    chunk = max(1, area // itemsize)
    stride = -(-chunk // rails) * itemsize  # a scratch slot: the longest part of a chunk
    previous: List[Tuple[int, int]] = []
    lo_prev = 0
    steps = list(range(0, count, chunk))
    for c, lo in enumerate(steps):
        hi = min(lo + chunk, count)
        parts = blocks(0, hi - lo, rails)
        a, b = parts[li] if rail else (0, 0)
        if k > 1:
            ops.append(_write(FLAT, lo * itemsize, (hi - lo) * itemsize, 0))
            ops += _publish_part(previous, lo_prev, li, itemsize, area)
            ops.append(_sync(first=c == 0))
            ops += _gather(previous, lo_prev, li, itemsize, area)
            if b > a:
                ops.append((REDUCE, SCRATCH, home * stride, (b - a) * itemsize, 0,
                            a * itemsize, 0, 0))
        elif b > a:
            ops.append((LOCAL, SCRATCH, home * stride, (b - a) * itemsize, FLAT,
                        (lo + a) * itemsize, 0, 0))
        if b > a:
            n = (b - a) * itemsize
            _exchange(ops, peers, home, n, stride, c)
            ops.append((MREDUCE, FLAT, (lo + a) * itemsize, n, SCRATCH, 0, nnodes, stride))
            if finish:
                ops.append((FINAL, FLAT, (lo + a) * itemsize, n, 0, 0, 0, 0))
        previous, lo_prev = parts, lo
    if k > 1:
        ops += _publish_part(previous, lo_prev, li, itemsize, area)
        ops.append(_sync())
        ops += _gather(previous, lo_prev, li, itemsize, area)
    return _plan(ops, nnodes * stride, peers)


#: A range of a buffer: (buffer id, offset, bytes).
Range = Tuple[int, int, int]


def _seg_broadcast(ops: List[Op], ranges: Sequence[Range], src: int, li: int, half: int,
                   first: bool) -> None:
    """Local rank ``src``'s ``ranges`` to the node's other local ranks over the segment, a
    half a step (the same ranges on every local rank: each copies them into its own)."""
    step = _down(half, ALIGN)
    chunk: List[Tuple[int, int, int, int]] = []  # (buffer, offset, bytes, slot offset)
    used = 0

    def flush() -> None:
        nonlocal used, first
        if src == li:
            ops.extend(_write(b, off, n, at) for b, off, n, at in chunk)
        ops.append(_sync(first=first))
        if src != li:
            ops.extend((COPY, b, off, n, src, at, 0, 0) for b, off, n, at in chunk)
        chunk.clear()
        used, first = 0, False

    for buf, off, n in ranges:
        while n:
            take = min(n, step - used)
            chunk.append((buf, off, take, used))
            used += take
            off += take
            n -= take
            if used == step:
                flush()
    if chunk or first:
        flush()


@lru_cache(maxsize=256)
def broadcast(nbytes: int, node_ids: Tuple[str, ...], rank: int, root: int,
              half: int, tree: bool = False) -> NativePlan:
    """Rank ``rank``'s node-aware broadcast of buffer 0 (``nbytes``) from ``root`` (each byte
    enters a node once): between the nodes' leaders (the root on its node, local rank 0 on
    the others) a star (``tree`` false: the root sends it to every other leader in one step)
    or a binomial tree (``tree``: in step ``s`` every leader that has it sends it to the
    leader ``2 ** s`` nodes on, counted from the root's node: the root's node sends it
    ceil(log2 nodes) times, not nodes - 1); then each leader hands it to its node's ranks
    over the segment."""
    lay = layout(node_ids)
    home, li = lay.node_of[rank], lay.local[rank]
    k, nnodes, top = len(lay.nodes[home]), len(lay.nodes), lay.node_of[root]

    def leader(v: int) -> int:
        """The leader of the node ``v`` nodes after the root's."""
        m = (top + v) % nnodes
        return root if m == top else lay.nodes[m][0]

    v = (home - top) % nnodes
    ops: List[Op] = []
    sends: List[int] = []
    recvs: List[int] = []
    if rank == leader(v):
        # the step this node receives in (its highest bit), -1: the root's; the star: 0
        got = (v.bit_length() - 1 if tree else 0) if v else -1
        steps = (nnodes - 1).bit_length() if tree else min(1, nnodes - 1)
        for step in range(steps):
            if step == got:
                recvs.append(leader(v - (1 << step) if tree else 0))
                ops.append((RECV, FLAT, 0, nbytes, recvs[-1], 0, 0, 0))
            elif step > got:
                children = [v + (1 << step)] if tree else list(range(1, nnodes))
                for child in (leader(c) for c in children if c < nnodes):
                    ops.append((SEND, FLAT, 0, nbytes, child, 0, 0, 0))
                    sends.append(child)
            if ops and ops[-1][0] in (SEND, RECV):
                ops.append((XFER, 0, 0, 0, 0, 0, 0, step))
    if k > 1:
        src = lay.local[root] if home == top else 0
        _seg_broadcast(ops, [(FLAT, 0, nbytes)], src, li, half, True)
    arr = np.array(ops, dtype=np.int64).reshape(-1, 8)
    arr.setflags(write=False)
    rounds = int((arr[:, 0] == XFER).sum())
    return NativePlan(arr, 0, tuple(sends), tuple(recvs), rounds)


def _piece(pieces: bool, j: int, nbytes: int) -> Tuple[int, int]:
    """Where rank ``j``'s piece of an all_gather's output is: buffer ``2 + j`` (``pieces``:
    one buffer each), else buffer 2 at ``j * nbytes``."""
    return (2 + j, 0) if pieces else (2, j * nbytes)


@lru_cache(maxsize=256)
def all_gather(nbytes: int, node_ids: Tuple[str, ...], rank: int, half: int,
               pieces: bool) -> NativePlan:
    """Rank ``rank``'s node-aware all_gather: buffer 0 its input (``nbytes``), the output's
    pieces in buffer 2 (or buffers 2, 3, ...: ``pieces``). The node's ranks gather their
    pieces over the segment; local rank 0 of each node sends its node's pieces to local
    rank 0 of every other node (each byte enters a node once) and hands what it received
    to its node's ranks over the segment."""
    lay = layout(node_ids)
    home, li = lay.node_of[rank], lay.local[rank]
    mates = lay.nodes[home]
    k = len(mates)
    ops: List[Op] = []
    buf, off = _piece(pieces, rank, nbytes)
    if nbytes:
        ops.append((LOCAL, buf, off, nbytes, FLAT, 0, 0, 0))
    if k > 1:  # the node's pieces, every local rank's, over the segment
        step = _down(half, ALIGN)
        for c, lo in enumerate(range(0, max(nbytes, 1), step)):
            n = min(step, nbytes - lo)
            if n:
                ops.append(_write(FLAT, lo, n, 0))
            ops.append(_sync(first=c == 0))
            for j, r in enumerate(mates):
                if r != rank and n:
                    b, o = _piece(pieces, r, nbytes)
                    ops.append((COPY, b, o + lo, n, j, 0, 0, 0))
    peers: List[Tuple[int, int]] = []
    others = [m for m in range(len(lay.nodes)) if m != home]
    if li == 0:
        for m in others:
            peer = lay.nodes[m][0]
            for r in mates:
                b, o = _piece(pieces, r, nbytes)
                ops.append((SEND, b, o, nbytes, peer, 0, 0, 0))
            peers.append((m, peer))
        for m in others:
            peer = lay.nodes[m][0]
            for r in lay.nodes[m]:
                b, o = _piece(pieces, r, nbytes)
                ops.append((RECV, b, o, nbytes, peer, 0, 0, 0))
        ops.append((XFER, 0, 0, 0, 0, 0, 0, 1))
    if k > 1:
        remote = [(*_piece(pieces, r, nbytes), nbytes) for m in others for r in lay.nodes[m]]
        _seg_broadcast(ops, [x for x in remote if x[2]], 0, li, half, False)
    return _plan(ops, 0, peers)


@lru_cache(maxsize=256)
def reduce_scatter(count: int, itemsize: int, node_ids: Tuple[str, ...], rank: int, half: int,
                   finish: bool) -> NativePlan:
    """Rank ``rank``'s node-aware reduce_scatter: buffer 0 holds one piece of ``count``
    elements per group rank (piece ``j`` for rank ``j``), buffer 2 this rank's result. In
    chunks of the pieces: every local rank writes its chunk of every piece into its half; the
    node's partial of a piece for a rank on another node is reduced by one local rank (the
    one whose local index is the destination's, modulo the node's ranks) and sent straight
    to it (each byte leaves its node once); each rank reduces its own piece's node partial
    and the other nodes' in node order."""
    lay = layout(node_ids)
    home, li = lay.node_of[rank], lay.local[rank]
    mates = lay.nodes[home]
    k, size, nnodes = len(mates), len(node_ids), len(lay.nodes)
    chunk = max(1, (_down(half // size, ALIGN) or half // size) // itemsize)
    cb = chunk * itemsize  # a scratch slot
    mine = [j for j in range(size) if lay.node_of[j] != home
            and mates[lay.local[j] % k] == rank]  # the remote ranks this rank reduces for
    senders = [(m, lay.nodes[m][li % len(lay.nodes[m])]) for m in range(nnodes) if m != home]
    ops: List[Op] = []
    for c, lo in enumerate(range(0, count, chunk)):
        hi = min(lo + chunk, count)
        n = (hi - lo) * itemsize

        def partial(j: int, at: int) -> Op:
            """Piece ``j``'s node partial of this chunk into the scratch at ``at``."""
            if k > 1:
                return (REDUCE, SCRATCH, at, n, 0, j * cb, 0, 0)
            return (LOCAL, SCRATCH, at, n, FLAT, (j * count + lo) * itemsize, 0, 0)

        if k > 1:
            ops += [_write(FLAT, (j * count + lo) * itemsize, n, j * cb) for j in range(size)]
            ops.append(_sync(first=c == 0))
        out_at = nnodes * cb
        for i, j in enumerate(mine):
            ops.append(partial(j, out_at + i * cb))
        ops.append(partial(rank, home * cb))
        for i, j in enumerate(mine):
            ops.append((SEND, SCRATCH, out_at + i * cb, n, j, 0, 0, 0))
        for m, src in senders:
            ops.append((RECV, SCRATCH, m * cb, n, src, 0, 0, 0))
        ops.append((XFER, 0, 0, 0, 0, 0, 0, c))
        ops.append((MREDUCE, 2, lo * itemsize, n, SCRATCH, 0, nnodes, cb))
        if finish:
            ops.append((FINAL, 2, lo * itemsize, n, 0, 0, 0, 0))
    arr = np.array(ops, dtype=np.int64).reshape(-1, 8)
    arr.setflags(write=False)
    rounds = int((arr[:, 0] == XFER).sum())
    return NativePlan(arr, (nnodes + len(mine)) * cb, tuple(mine),
                      tuple(src for _, src in senders), rounds)


def _publish_part(parts: Sequence[Tuple[int, int]], lo: int, li: int, itemsize: int,
                  area: int) -> List[Op]:
    """A rail rank's reduced part of the last chunk into its coming half, at ``area``."""
    if li >= len(parts) or parts[li][1] <= parts[li][0]:
        return []
    a, b = parts[li]
    return [_write(FLAT, (lo + a) * itemsize, (b - a) * itemsize, area + a * itemsize)]


def _gather(parts: Sequence[Tuple[int, int]], lo: int, li: int, itemsize: int,
            area: int) -> List[Op]:
    """Every other rail rank's reduced part of the last chunk out of its half into buffer 0."""
    return [(COPY, FLAT, (lo + a) * itemsize, (b - a) * itemsize, j, area + a * itemsize, 0, 0)
            for j, (a, b) in enumerate(parts) if j != li and b > a]


def _plan(ops: Sequence[Op], scratch: int, peers: Sequence[Tuple[int, int]]) -> NativePlan:
    """The plan of ``ops``; ``peers`` (node, group rank) are sent to and received from."""
    arr = np.array(ops, dtype=np.int64).reshape(-1, 8)
    arr.setflags(write=False)
    rounds = int((arr[:, 0] == XFER).sum())
    ranks = tuple(p for _, p in peers) if rounds else ()
    return NativePlan(arr, scratch, ranks, ranks, rounds)
