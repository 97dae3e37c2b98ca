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
from raycoll.transport.counters import Counters

__all__ = ["Layout", "layout", "all_reduce", "SMALL_BYTES"]

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


def _exchange(ops: List[Op], counts: Counters, peers: Sequence[Tuple[int, int]],
              mine: int, n: int, stride: int, step: int) -> None:
    """This rank's slot (node ``mine``, ``n`` bytes at ``mine * stride`` of the scratch) to
    each rail peer, and each peer's into its node's slot; one round (``step``)."""
    for node, peer in peers:
        ops.append((SEND, SCRATCH, mine * stride, n, peer, 0, 0, 0))
        counts.sent(peer, n, False)
    for node, peer in peers:
        ops.append((RECV, SCRATCH, node * stride, n, peer, 0, 0, 0))
        counts.received(peer, n, False)
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
    counts = Counters()
    if nbytes <= min(small_bytes, half):
        if k > 1:
            ops += [_write(FLAT, 0, nbytes, 0), _sync(first=True)]
            if rail:
                ops.append((REDUCE, SCRATCH, home * nbytes, nbytes, 0, 0, 0, 0))
        elif nbytes:
            ops.append((LOCAL, SCRATCH, home * nbytes, nbytes, FLAT, 0, 0, 0))
        if rail:
            _exchange(ops, counts, peers, home, nbytes, nbytes, 0)
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
        return _plan(ops, nnodes * nbytes, peers, counts)
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
            _exchange(ops, counts, peers, home, n, stride, c)
            ops.append((MREDUCE, FLAT, (lo + a) * itemsize, n, SCRATCH, 0, nnodes, stride))
            if finish:
                ops.append((FINAL, FLAT, (lo + a) * itemsize, n, 0, 0, 0, 0))
        previous, lo_prev = parts, lo
    if k > 1:
        ops += _publish_part(previous, lo_prev, li, itemsize, area)
        ops.append(_sync())
        ops += _gather(previous, lo_prev, li, itemsize, area)
    return _plan(ops, nnodes * stride, peers, counts)


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


def _plan(ops: Sequence[Op], scratch: int, peers: Sequence[Tuple[int, int]],
          counts: Counters) -> NativePlan:
    arr = np.array(ops, dtype=np.int64).reshape(-1, 8)
    arr.setflags(write=False)
    rounds = int((arr[:, 0] == XFER).sum())
    counts.rounds = rounds
    ranks = tuple(p for _, p in peers) if rounds else ()
    return NativePlan(arr, scratch, ranks, ranks, rounds, counts)
