"""The direct exchange: the cpu backend's collectives as rounds of the group's round
transport (the shared-memory lane on one node, direct connections across nodes;
:mod:`raycoll.transport`, design in ``docs/transports.md``):
one round when every rank's message fits ``round_bytes``, else *streamed* through rounds of
at most ``stream_bytes`` per destination, the peers' parts read in place.

Every method returns ``False`` (nothing done) when the group has no round transport (round 0
tells, the same on every rank); the backend then takes the coordinator's steps
(:mod:`raycoll.algorithms.store`).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from raycoll.algorithms.flat import chunk_bounds, copy_into, flat_in, flat_out, reduce_received
from raycoll.context import Call, GroupContext
from raycoll.reduce_op import ReduceOp, combine, finalize
from raycoll.reduce_op import combine_into as _combine_into
from raycoll.transport.base import PerPeer

__all__ = ["DirectAlgorithms", "round_elems", "stream_rounds"]


def round_elems(round_bytes: int, stream_bytes: int, itemsize: int, pieces: int,
                oversubscribed: bool) -> int:
    """Elements per destination and round when a rank sends ``pieces`` parts in a round of at
    most ``round_bytes``: each part at most ``stream_bytes`` too (unless one part goes to
    every peer alike on an oversubscribed node), and at least one element."""
    per = round_bytes // max(1, pieces)
    if pieces > 1 or not oversubscribed:
        per = min(per, stream_bytes)
    return max(1, per // max(1, itemsize))


def stream_rounds(n: int, step: int) -> Iterator[Tuple[int, int, int]]:
    """``(sub, lo, hi)``: the rounds that stream ``n`` elements, ``step`` per round."""
    for sub, lo in enumerate(range(0, n, step)):
        yield sub, lo, min(lo + step, n)


class DirectAlgorithms:
    """The round algorithms of :class:`~raycoll.backends.cpu.ObjstoreBackend` (a base
    class of it: they read its group and its round sizes)."""

    ctx: GroupContext
    #: streaming on (``stream`` option, and a lane that can hold a message)
    stream: bool
    lane_bytes: int
    stream_bytes: int
    #: the most a rank sends in one round; for all_reduce and reduce: ``reduce_round_bytes``
    round_bytes: int
    reduce_round_bytes: int
    #: more ranks than the node's cores (rounds then cost a scheduler wake-up each)
    oversubscribed: bool
    _scratch_buf: Optional[np.ndarray]

    def _round_reduce(self, op: ReduceOp, terms: List[Any], like: np.ndarray) -> np.ndarray:
        """``terms[0] (op) terms[1] (op) ...`` (every rank's part, in rank order) in a kept
        scratch buffer shaped as ``like`` flat. The same operations on every rank, into a
        buffer that aliases no input: numpy's complex kernels round differently when the
        output aliases an input, and every rank must hold bitwise the same result. The buffer
        is kept: a fresh one per call costs page faults (benchmarks/HISTORY.md)."""
        out = self._scratch(like)
        _combine_into(op, out, flat_in(terms[0]), flat_in(terms[1]))
        for term in terms[2:]:
            combine(op, out, flat_in(term))
        finalize(op, out, len(terms))
        return out

    def _scratch(self, like: np.ndarray) -> np.ndarray:
        """A kept flat buffer of ``like``'s dtype and size (grown as needed, up to the largest
        part of a round)."""
        need = like.nbytes
        if self._scratch_buf is None or self._scratch_buf.nbytes < need:
            self._scratch_buf = np.empty(max(need, 4096), dtype=np.uint8)
        return self._scratch_buf[:need].view(like.dtype)

    def _round_reduce_scatter(self, pieces: Sequence[np.ndarray], out: np.ndarray,
                              op: ReduceOp, call: Call, sub: int = 0) -> bool:
        """Round ``sub`` of ``call``: send ``pieces[j]`` to rank j, reduce the peers' pieces
        for us (read in place) and ours into ``out``; ``False`` if the group has no round
        transport."""
        me = self.ctx.rank
        got = self.ctx.gather_round(call, PerPeer(p if j != me else None for j, p in enumerate(pieces)),
                                   sub, views=True)
        if got is None:
            return False
        reduce_received(op, out, pieces[me],
                        {s: [flat_in(g[me])] for s, g in enumerate(got) if s != me}, self.ctx.size)
        return True

    def _round_gather(self, mine: np.ndarray, outs: Sequence[np.ndarray], call: Call,
                      sub: int = 0, root: Optional[int] = None) -> bool:
        """Round ``sub`` of ``call``: every rank's ``mine`` lands in ``outs[rank]`` (only on
        ``root``, when given), copied straight from what the peers sent; ``False`` if the
        group has no round transport."""
        got = self.ctx.gather_round(call, mine, sub, views=True)
        if got is None:
            return False
        if root is None or self.ctx.rank == root:
            for s, part in enumerate(got):
                copy_into(outs[s], [flat_in(part if s != self.ctx.rank else mine)])
        return True

    def _streams(self, nbytes: int, limit: Optional[int] = None) -> bool:
        """Whether a collective that would send ``nbytes`` in one round (more than ``limit``,
        by default ``round_bytes``) streams in rounds instead (if the group has a round
        transport: round 0 tells)."""
        limit = self.round_bytes if limit is None else limit
        return self.stream and self.ctx.size > 1 and nbytes > limit

    def _round_elems(self, itemsize: int, pieces: int) -> int:
        """Elements per destination and round, when a rank sends ``pieces`` of them."""
        return round_elems(self.round_bytes, self.stream_bytes, itemsize, pieces,
                           self.oversubscribed)

    def _rounds(self, n: int, itemsize: int, pieces: int) -> Iterator[Tuple[int, int, int]]:
        """``(sub, lo, hi)``: the rounds streaming ``n`` elements per destination."""
        return stream_rounds(n, self._round_elems(itemsize, pieces))

    def _stream_reduce(self, src: np.ndarray, dst: Optional[int], op: ReduceOp, call: Call,
                       result: Optional[np.ndarray]) -> bool:
        """all_reduce (``dst`` None) or reduce of flat ``src`` into flat ``result`` (on every
        rank, or on ``dst``; it may be ``src``): reduce-scatter then all-gather, block by
        block. Each rank reduces its chunk of a block (so every rank holds bitwise the same
        result) and sends it on in the next round, with its pieces of the next block: one
        round per block, plus one. ``False`` (nothing done) if the group has no round
        transport."""
        size, me = self.ctx.size, self.ctx.rank
        # a message holds W pieces: W - 1 of this block and our reduced chunk of the last one
        block = max(1, min(self.stream_bytes, self.lane_bytes // size) // src.itemsize) * size
        starts = range(0, src.size, block)
        prev: Optional[Tuple[List[np.ndarray], np.ndarray]] = None  # its reduced chunk goes now
        for k in range(len(starts) + 1):
            cur = None
            if k < len(starts):
                lo = starts[k]
                bounds = [lo + b for b in chunk_bounds(min(block, src.size - lo), size)]
                chunks = [src[bounds[j]:bounds[j + 1]] for j in range(size)]
                outs = ([result[bounds[j]:bounds[j + 1]] for j in range(size)]
                        if result is not None else [])
                # not on dst: a scratch chunk (sent in the next round's write, before the
                # next block is reduced into it)
                cur = chunks, outs, outs[me] if outs else self._scratch(chunks[me])
            got = self.ctx.gather_round(
                call, (PerPeer(c if j != me else None for j, c in enumerate(cur[0])) if cur else None,
                       prev[1] if prev else None), k, views=True)
            if got is None:
                return False
            if prev is not None and prev[0]:
                for s, m in enumerate(got):
                    if s != me:
                        np.copyto(prev[0][s], m[1])
            if cur is not None:
                reduce_received(op, cur[2], cur[0][me],
                                {s: [flat_in(m[0][me])] for s, m in enumerate(got) if s != me},
                                size)
            got = m = None
            prev = (cur[1], cur[2]) if cur is not None else None
        return True

    def _stream_reduce_scatter(self, pieces: Sequence[np.ndarray], out: np.ndarray,
                               op: ReduceOp, call: Call) -> bool:
        for sub, lo, hi in self._rounds(out.size, out.itemsize, self.ctx.size - 1):
            if not self._round_reduce_scatter([p[lo:hi] for p in pieces], out[lo:hi], op,
                                              call, sub):
                return False
        return True

    def _stream_gather(self, mine: np.ndarray, outs: Sequence[np.ndarray], call: Call,
                       root: Optional[int] = None) -> bool:
        """all_gather / gather of flat ``mine`` into flat ``outs``, round by round."""
        for sub, lo, hi in self._rounds(mine.size, mine.itemsize, 1):
            if not self._round_gather(mine[lo:hi], [o[lo:hi] for o in outs], call, sub,
                                      root=root):
                return False
        return True

    def _stream_broadcast(self, flat: np.ndarray, src: int, call: Call) -> bool:
        me = self.ctx.rank
        for sub, lo, hi in self._rounds(flat.size, flat.itemsize, 1):
            got = self.ctx.gather_round(call, flat[lo:hi] if me == src else None, sub, views=True)
            if got is None:
                return False
            if me != src:
                np.copyto(flat[lo:hi], got[src])
            del got
        return True

    def _stream_scatter(self, flat: np.ndarray, ins: Sequence[np.ndarray], src: int,
                        call: Call) -> bool:
        me = self.ctx.rank
        for sub, lo, hi in self._rounds(flat.size, flat.itemsize, self.ctx.size - 1):
            got = self.ctx.gather_round(
                call, PerPeer(p[lo:hi] if j != me else None for j, p in enumerate(ins)) if ins else None,
                sub, views=True)
            if got is None:
                return False
            np.copyto(flat[lo:hi], ins[me][lo:hi] if me == src else got[src][me])
            del got
        return True

    def _stream_all_to_all(self, outs: List[np.ndarray], ins: List[np.ndarray], longest: int,
                           call: Call) -> None:
        """Rounds 1, 2, ... of an all_to_all: in each, every rank sends the next
        slice of each of its pieces (``longest``: the largest piece of any rank, in
        elements, which every rank knows from round 0)."""
        me = self.ctx.rank
        src = [flat_in(a) for a in ins]
        with ExitStack() as stack:
            flats = [stack.enter_context(flat_out(o)) for o in outs]
            np.copyto(flats[me], src[me])
            for sub, lo, hi in self._rounds(longest, src[me].itemsize, self.ctx.size - 1):
                got = self.ctx.gather_round(
                    call, PerPeer(a[lo:hi] if j != me else None for j, a in enumerate(src)), sub + 1,
                    views=True)
                assert got is not None, "round 0 of this call went through the round transport"
                for s, pieces in enumerate(got):
                    if s != me:
                        piece = pieces[me]
                        np.copyto(flats[s][lo:lo + piece.size], piece)
                piece = pieces = got = None
