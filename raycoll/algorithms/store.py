"""The cpu backend's fallback: collectives as *steps* through the coordinator and the Ray
object store, where a group has no native path (no native core on some rank, another
platform, ``transport="store"``) or a call has none (a dtype and op the core does not reduce,
parts of several sizes across direct connections).

A step is one round trip to the coordinator (:meth:`GroupContext.exchange`), which matches
the ranks' arrivals and routes what each rank sends to each other rank: inline in the call
when small, else references to objects in Ray's object store (one object per step on one
node, one per destination across nodes). Readers map the objects zero-copy and reduce or copy
straight from them into the output buffer. The design: ``docs/transports.md``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import ray

from raycoll.algorithms.flat import (
    Segments,
    array_meta,
    chunk_bounds,
    copy_into,
    flat_in,
    flat_out,
    reduce_into,
    reduce_received,
    spans,
    split,
)
from raycoll.context import Call, GroupContext
from raycoll.reduce_op import ReduceOp, finalize
from raycoll.reduce_op import combine_into as _combine_into

__all__ = ["StoreSteps", "Payload"]


#: What one rank sends another in a step: an inline array, or ``(ref, start, stop)``: the
#: segments ``start:stop`` of an object that holds a list of flat segments.
Payload = Any


class StoreSteps:
    """The coordinator steps of :class:`~raycoll.backends.cpu.ObjstoreBackend` (a base
    class of it: they read its group and its size thresholds)."""

    ctx: GroupContext
    #: what a rank sends in a step travels inline up to this many bytes in all
    inline_bytes: int
    #: arrays are put as flat segments of at most this size
    segment_bytes: int
    #: one object per step for all destinations (else one per destination)
    combined: bool
    #: the one-step ``all_reduce``'s reach on one node, and a forced algorithm (or ``None``)
    direct_bytes: int
    direct_max_ranks: int
    algo: Optional[str]

    def _put(self, arrays: Sequence[np.ndarray]) -> Tuple[Any, List[Tuple[int, int]]]:
        """One object holding ``arrays`` as flat segments; each array's segment range."""
        segs: Segments = []
        ranges = []
        for arr in arrays:
            start = len(segs)
            segs.extend(split(flat_in(arr), self.segment_bytes))
            ranges.append((start, len(segs)))
        return ray.put(segs), ranges

    def _publish(self, pieces: Dict[int, np.ndarray]) -> List[Payload]:
        """Per-destination payloads for ``pieces`` (group rank -> array); ``None`` elsewhere.

        Inline when their total is small; else one object holding all of them (one node), or
        one object per destination (several nodes: each peer pulls only its piece).
        """
        sent: List[Payload] = [None] * self.ctx.size
        if not pieces:
            return sent
        total = sum(a.nbytes for a in pieces.values())
        if total <= self.inline_bytes:
            for j, a in pieces.items():
                sent[j] = a
        elif self.combined:
            order = sorted(pieces)
            ref, ranges = self._put([pieces[j] for j in order])
            for j, (lo, hi) in zip(order, ranges):
                sent[j] = (ref, lo, hi)
        else:
            for j, a in pieces.items():
                ref, ((lo, hi),) = self._put([a])
                sent[j] = (ref, lo, hi)
        return sent

    def _publish_same(self, arr: np.ndarray, to: Sequence[int]) -> List[Payload]:
        """The same array for every rank in ``to``: inline, or one object read by all."""
        sent: List[Payload] = [None] * self.ctx.size
        if not to:
            return sent
        payload: Payload = arr
        if arr.nbytes > self.inline_bytes:
            ref, ((lo, hi),) = self._put([arr])
            payload = (ref, lo, hi)
        for j in to:
            sent[j] = payload
        return sent

    def _fetch(self, got: Sequence[Payload], call: Call) -> Dict[int, Segments]:
        """The segments behind the payloads received in a step, by source group rank.

        Objects are fetched in one ``ray.get`` (pulled in parallel across nodes; mapped
        zero-copy, read-only, on the same node).
        """
        out: Dict[int, Segments] = {}
        refs: List[Any] = []
        where: List[Tuple[int, int, int]] = []
        for s, payload in enumerate(got):
            if payload is None:
                continue
            if isinstance(payload, tuple):
                ref, lo, hi = payload
                refs.append(ref)
                where.append((s, int(lo), int(hi)))
            else:
                out[s] = [np.asarray(payload).reshape(-1)]
        if refs:
            values = self.ctx.get(refs, [s for s, _, _ in where], call)
            for (s, lo, hi), value in zip(where, values):
                out[s] = list(value[lo:hi])
        return out

    def _store_reduce_scatter(self, pieces: Sequence[np.ndarray], out: np.ndarray, op: ReduceOp,
                             call: Call, step: int) -> List[Payload]:
        """Step ``step`` of ``call``: send ``pieces[j]`` to rank j; reduce what every rank sent
        us, plus ours, into ``out`` (flat). Returns our payloads: keep them referenced until the
        peers are done.
        """
        me, size = self.ctx.rank, self.ctx.size
        sent = self._publish({j: pieces[j] for j in range(size) if j != me})
        received = self._fetch(self.ctx.exchange(call, step, sent), call)
        reduce_received(op, out, pieces[me], received, size)
        del received
        return sent

    def _store_gather(self, mine: np.ndarray, outs: Sequence[np.ndarray], call: Call,
                      step: int, root: Optional[int] = None) -> None:
        """Step ``step`` of ``call``: every rank's ``mine`` lands in ``outs[rank]`` (only on
        ``root``, when given)."""
        me, size = self.ctx.rank, self.ctx.size
        to = [j for j in range(size) if j != me and (root is None or j == root)]
        got = self.ctx.exchange(call, step, self._publish_same(mine, to))
        if root is not None and me != root:
            return
        received = self._fetch(got, call)
        copy_into(outs[me], [flat_in(mine)])
        for s, segs in received.items():
            copy_into(outs[s], segs)
        del received

    def _direct_all_reduce(self, flat: np.ndarray, op: ReduceOp, call: Call) -> None:
        """One step: each rank puts its buffer once and reduces all of them in rank order (so
        every rank computes bitwise the same result)."""
        me, size = self.ctx.rank, self.ctx.size
        sent = self._publish_same(flat, [j for j in range(size) if j != me])
        got = self.ctx.exchange(call, 0, sent)
        terms = self._fetch(got, call)
        if me == 0:
            reduce_into(op, flat, terms[1])
        elif me == 1:
            # x0 (op) x1, in that order: complex products (and future ops) do not commute
            # bit for bit, and every rank must hold bitwise the same result.
            for lo, hi, a in spans(terms[0]):
                _combine_into(op, flat[lo:hi], a, flat[lo:hi])
        else:
            # Our buffer is overwritten by x0 (op) x1 first: read our own term from our object.
            mine = sent[0]
            terms[me] = (self._fetch([mine], call)[0] if isinstance(mine, tuple)
                         else [np.array(flat)])
            for (lo, hi, a), (_, _, b) in zip(spans(terms[0]), spans(terms[1])):
                _combine_into(op, flat[lo:hi], a, b)
        for s in range(2, size):
            reduce_into(op, flat, terms[s])
        del terms
        finalize(op, flat, size)
        del sent

    # ------------------------------------------------------------------ whole collectives
    def _all_reduce_algo(self, nbytes: int) -> str:
        """The steps of an ``all_reduce`` (and ``reduce``) of ``nbytes``: ``"inline"`` (the
        coordinator reduces), ``"direct"`` (one step, every rank reduces all) or ``"rs_ag"``
        (reduce-scatter, then all-gather)."""
        size = self.ctx.size
        if size == 1 or (self.algo is None and nbytes <= self.inline_bytes):
            return "inline"
        if self.algo is not None:
            return self.algo
        if size == 2 or (self.ctx.single_node and (nbytes <= self.direct_bytes
                                                   or size <= self.direct_max_ranks)):
            return "direct"
        return "rs_ag"

    def _store_all_reduce(self, flat: np.ndarray, op: ReduceOp, call: Call) -> None:
        algo = self._all_reduce_algo(flat.nbytes)
        if algo == "inline":
            np.copyto(flat, self.ctx.exchange(call, 0, flat, mode="reduce"))
        elif algo == "direct":
            self._direct_all_reduce(flat, op, call)
        else:
            size, me = self.ctx.size, self.ctx.rank
            bounds = chunk_bounds(flat.size, size)
            chunks = [flat[bounds[j]:bounds[j + 1]] for j in range(size)]
            sent = self._store_reduce_scatter(chunks, chunks[me], op, call, 0)
            self._store_gather(chunks[me], chunks, call, 1)
            del sent

    def _store_reduce(self, arr: np.ndarray, dst: int, op: ReduceOp, call: Call) -> None:
        me, size = self.ctx.rank, self.ctx.size
        src = flat_in(arr)
        if self._all_reduce_algo(arr.nbytes) == "inline":
            result = self.ctx.exchange(call, 0, src, mode="reduce", root=dst)
            if me == dst:
                with flat_out(arr) as flat:
                    np.copyto(flat, result)
            return
        bounds = chunk_bounds(src.size, size)
        chunks = [src[bounds[j]:bounds[j + 1]] for j in range(size)]
        if me == dst:
            with flat_out(arr) as flat:
                outs = [flat[bounds[j]:bounds[j + 1]] for j in range(size)]
                sent = self._store_reduce_scatter(chunks, outs[me], op, call, 0)
                self._store_gather(outs[me], outs, call, 1, root=dst)
        else:
            mine = np.empty_like(chunks[me])
            sent = self._store_reduce_scatter(chunks, mine, op, call, 0)
            self._store_gather(mine, [], call, 1, root=dst)
        del sent

    def _store_broadcast(self, arr: np.ndarray, src: int, call: Call) -> None:
        me, size = self.ctx.rank, self.ctx.size
        if me == src:
            sent = self._publish_same(arr, [j for j in range(size) if j != me])
            self.ctx.exchange(call, 0, sent)
            return
        received = self._fetch(self.ctx.exchange(call, 0, None), call)
        copy_into(arr, received[src])
        del received

    def _store_scatter(self, out: np.ndarray, arrays: Sequence[np.ndarray], src: int,
                       call: Call) -> None:
        me, size = self.ctx.rank, self.ctx.size
        if me == src:
            sent = self._publish({j: arrays[j] for j in range(size) if j != me})
            self.ctx.exchange(call, 0, sent)
            copy_into(out, [flat_in(arrays[me])])
            return
        received = self._fetch(self.ctx.exchange(call, 0, None), call)
        copy_into(out, received[src])
        del received

    def _store_all_to_all(self, outs: Sequence[np.ndarray], ins: Sequence[np.ndarray],
                          call: Call) -> None:
        """Every rank's ``ins[j]`` into rank j's ``outs[me]``; the coordinator checks that
        every pair agrees on its piece's shape and dtype."""
        me, size = self.ctx.rank, self.ctx.size
        sent = self._publish({j: ins[j] for j in range(size) if j != me})
        got = self.ctx.exchange(call, 0, sent, send_meta=[array_meta(a) for a in ins],
                                recv_meta=[array_meta(a) for a in outs])
        copy_into(outs[me], [flat_in(ins[me])])
        received = self._fetch(got, call)
        for s, segs in received.items():
            copy_into(outs[s], segs)
        del received
