"""The object-store backend: CPU arrays through Ray's shared-memory object store.

Every collective is one or two *steps*; a step is one round trip to the coordinator
(:meth:`GroupContext.exchange`), which matches the ranks' arrivals and routes what each rank
sends to each other rank. What travels depends on the size and the topology:

- **a round transport** (:mod:`raycoll.transport`): the shared-memory lane
  (:mod:`raycoll.transport.lane`) whenever all ranks are actors
  on one node (at most ``lane_max_ranks`` of them): each rank owns a Ray shared-memory
  channel, writes its part there and reads its peers' parts: no coordinator call at all. A
  collective whose every rank's message fits one *round* (``round_bytes``: 1 MiB per
  destination when the ranks fit the node's cores, else ``lane_bytes``, 4 MiB) takes one
  round; a larger one *streams* through rounds of that size (``stream``, on by default),
  reading each peer's part in place from its channel, so the data of a round stays in the
  caches between the writer's copy and the readers' pass, and nothing is put in the object
  store. Used by all_reduce and reduce (per block of ``W`` chunks, reduce-scatter then
  all-gather: a round carries a block's pieces and the reduced chunk of the block before),
  broadcast, all_gather(_into_tensor), gather, scatter,
  reduce_scatter(_tensor), barrier and all_to_all(_single) (there the ranks' parts may differ
  in size: in round 0 each sends its pieces if they fit and everyone's sizes, and every rank
  derives the same schedule from them). The same rounds run over **direct connections**
  (:mod:`raycoll.transport.tcp`) when the ranks span several nodes (``transport="tcp"``
  forces it), in larger rounds (``TCP_ROUND_BYTES``, ``TCP_STREAM_BYTES``), each rank
  sending each peer only its part (:class:`~raycoll.transport.base.PerPeer`). Point-to-point
  goes over direct connections; the object collectives stay on the coordinator, and so does
  everything with ``transport="store"`` (or ``lane=False``);
- **inline**: otherwise, when everything a rank sends in a step is at most ``inline_bytes``,
  the arrays ride in the coordinator call itself (small ``all_reduce``/``reduce`` are reduced
  by the coordinator: one round trip, no object store at all);
- **one object per step** (all ranks on one node): the pieces a rank sends to its peers are
  put together in one ``ray.put`` of a list of arrays; each peer maps the object zero-copy and
  takes its piece, so a step costs one put of exactly the bytes the peers need;
- **one object per destination** (ranks on several nodes): a peer pulls only the piece meant
  for it; an object that several ranks of one node read (all-gather phases, broadcast) is
  pulled once per node and then shared from that node's store (Ray's per-node caching makes
  the inter-node part hierarchical).

Readers reduce or copy straight from the mapped objects into the output buffer; no rank ever
materialises more than its inputs and outputs.

Algorithms through the object store (across nodes, beyond ``lane_max_ranks``, or with
``stream=False``; ``W`` ranks, ``N`` bytes per rank's buffer):

- ``all_reduce``: inline (the coordinator reduces) up to ``inline_bytes``; *direct* for two
  ranks, and on one node up to ``direct_bytes`` or ``direct_max_ranks`` ranks (one step:
  every rank puts its buffer once and reduces all of them in rank order, so every rank gets
  bitwise the same result); otherwise reduce-scatter then all-gather (two steps; rank ``j``
  reduces chunk ``j`` straight into its buffer; each rank puts ``(W-1)/W N`` then ``N/W`` and
  reads as much: bandwidth-optimal, and across nodes no rank pulls a chunk it does not need);
- ``reduce``: reduce-scatter, then the reduced chunks go to the root only;
- ``reduce_scatter``: one step (peers' pieces in, own chunk reduced in one pass);
- ``broadcast``, ``scatter``, ``gather``, ``all_gather``, ``all_to_all``: one step, each
  byte put once by its owner and copied once by each reader that needs it.

Arrays are put as flat segments of at most ``segment_bytes`` (8 MiB) inside one object.

Object-store memory: a collective on the lane uses none beyond the ranks' channels (a fixed
``lane_bytes`` per rank, see :mod:`raycoll.transport.lane`). Otherwise every object is owned by
the rank that put it, and referenced only while a step needs it: a step's objects are dropped
by their owner once the next step has been matched (every reader arrived there, so it is done
reading); objects of a collective's last step are dropped by the owner when the step is
matched and by each reader once it has copied or reduced them (the coordinator keeps no
reference once it has routed them). So the live data of one collective is at most what the
ranks send in two consecutive steps: ``N`` per rank for ``all_reduce`` (direct: ``N``;
reduce-scatter + all-gather: ``(W-1)/W N`` then ``N/W``), ``N`` for the root of ``broadcast``
and of ``scatter`` (``(W-1)/W N``), ``N/W`` per rank for ``all_gather``, ``(W-1)/W`` of each
rank's input for ``reduce_scatter`` and ``all_to_all`` — plus, across nodes, a secondary copy
of each object pulled onto another node. Ray frees objects that went out of scope in batches
(``RAY_free_objects_period_milliseconds``, by default every second), so back-to-back
collectives keep up to a second's worth of their objects in the store until Ray's next batch;
use is back at its baseline then. Measured peaks are in benchmarks/BENCHMARKS.md.

Thresholds are group options (``create_group(..., options={...})``): ``lane`` (``False``:
no shared-memory lane), ``lane_bytes``, ``lane_max_ranks``, ``stream`` (``False``: large
collectives through the object store even where the group has a lane), ``stream_bytes``,
``inline_bytes``,
``direct_bytes``, ``direct_max_ranks``, ``segment_bytes``, and ``all_reduce_algo``
(``"inline"``, ``"direct"``, ``"rs_ag"``) or ``put`` (``"auto"``, ``"combined"``,
``"per_peer"``) to force a choice when measuring.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import ray

from raycoll import errors
from raycoll.backends.base import Call, CollectiveBackend, Completion, GroupContext, chunk_bounds
from raycoll.coordinator import meta_mismatch
from raycoll.options import or_default
from raycoll.reduce_op import ReduceOp, combine, finalize
from raycoll.reduce_op import combine_into as _combine_into
from raycoll.tensors import dtype_name, host_view
from raycoll.transport.base import PerPeer
from raycoll.transport.lane import LANE_BYTES, lane_bytes, oversubscribed

__all__ = ["ObjstoreBackend", "INLINE_BYTES", "LANE_BYTES", "lane_bytes", "STREAM_BYTES",
           "DIRECT_BYTES", "DIRECT_MAX_RANKS", "SEGMENT_BYTES"]

#: Everything a rank sends in one step travels inline in the coordinator call up to this size:
#: just under Ray's limit for arguments passed by value (100 KiB, ``max_direct_call_object_size``)
#: above which Ray itself puts them into the object store (measured slower than our own put).
INLINE_BYTES = 96 * 1024
#: ``all_reduce`` of at most this many bytes (and more than ``INLINE_BYTES``) uses the one-step
#: direct algorithm on a single node; larger ones reduce-scatter then all-gather.
DIRECT_BYTES = 1 << 20
#: ... and, on a single node, at any size with at most this many ranks: measured on the
#: reference machine, one step (with ``W - 1`` reads per rank) beats the two steps of
#: reduce-scatter + all-gather up to 4 ranks even at 64 MiB, because each step costs a
#: coordinator round trip that carries object references (~1.7 ms more than one without).
DIRECT_MAX_RANKS = 4
#: Arrays are put as segments of at most this size. Ray copies a large buffer into the store
#: with several threads started per copy, which on a loaded or small machine is several times
#: slower than one ``memcpy`` per segment (measured: 32 MiB in ~40 ms vs ~8 ms; see
#: benchmarks/BENCHMARKS.md).
SEGMENT_BYTES = 8 << 20

#: A collective too large for one lane message streams through the lane in rounds, each
#: rank sending at most this much per destination in a round (and at most ``lane_bytes`` in
#: all): a round's data then stays in the caches between the writer's copy into its channel
#: and the readers' pass over it (measured on the reference machine, 64 MiB all_reduce of 2
#: ranks: 9 ms with 1 MiB rounds, 21-30 ms with 4 MiB rounds, 33-44 ms through the object
#: store).
STREAM_BYTES = 1 << 20

#: The defaults of ``lane_bytes`` and ``stream_bytes`` for groups on direct connections.
TCP_ROUND_BYTES = 16 << 20
TCP_STREAM_BYTES = 4 << 20

#: What one rank sends another in a step: an inline array, or ``(ref, start, stop)``: the
#: segments ``start:stop`` of an object that holds a list of flat segments.
Payload = Any
#: A received piece: flat segments that, concatenated, are the sender's array.
Segments = List[np.ndarray]


def _meta(arr: np.ndarray) -> Any:
    return (dtype_name(arr.dtype), tuple(arr.shape))


@contextmanager
def _flat_out(arr: np.ndarray) -> Iterator[np.ndarray]:
    """A flat, writable, contiguous view of ``arr`` (via a temporary copied back if needed)."""
    if arr.flags.c_contiguous:
        yield arr.reshape(-1)
        return
    tmp = np.ascontiguousarray(arr)
    yield tmp.reshape(-1)
    np.copyto(arr, tmp.reshape(arr.shape))


def _flat_in(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr).reshape(-1)


def _split(flat: np.ndarray, segment_bytes: int) -> Segments:
    """Views of ``flat`` of at most ``segment_bytes`` each (at least one)."""
    step = max(1, segment_bytes // max(1, flat.itemsize))
    if flat.size <= step:
        return [flat]
    return [flat[i:i + step] for i in range(0, flat.size, step)]


def _spans(segs: Segments) -> Iterator[Tuple[int, int, np.ndarray]]:
    offset = 0
    for seg in segs:
        yield offset, offset + seg.size, seg
        offset += seg.size


def _copy_into(dst: np.ndarray, segs: Segments) -> None:
    """Copy the concatenated ``segs`` into ``dst`` (any shape, contiguous or not)."""
    if len(segs) == 1 and np.shares_memory(dst, segs[0]):
        return
    with _flat_out(dst) as flat:
        for lo, hi, seg in _spans(segs):
            np.copyto(flat[lo:hi], seg)


def _reduce_into(op: ReduceOp, out: np.ndarray, segs: Segments,
                 first: Optional[np.ndarray] = None) -> None:
    """``out = out (op) segs``; or, with ``first``, ``out = first (op) segs`` in one pass."""
    for lo, hi, seg in _spans(segs):
        if first is None:
            combine(op, out[lo:hi], seg)
        else:
            _combine_into(op, out[lo:hi], first[lo:hi], seg)


class ObjstoreBackend(CollectiveBackend):
    """CPU collectives through the Ray object store, driven by the coordinator."""

    devices = ("cpu",)

    def __init__(self, ctx: GroupContext) -> None:
        super().__init__(ctx)
        opts = ctx.options  # validated when the group was formed (raycoll.options)
        self.inline_bytes = or_default(opts.inline_bytes, INLINE_BYTES)
        # Over direct connections rounds are not bounded by a channel or the caches but by
        # the cost of each round trip: larger rounds (measured, BENCHMARKS.md).
        tcp = ctx.planned_transport() == "tcp"
        self.lane_bytes = or_default(opts.lane_bytes, TCP_ROUND_BYTES if tcp else LANE_BYTES)
        self.stream = opts.stream and self.lane_bytes > 0
        self.stream_bytes = or_default(opts.stream_bytes, TCP_STREAM_BYTES if tcp
                                       else STREAM_BYTES)
        # The most a rank sends in one lane round. Ranks that fit the node's cores wait for
        # each other spinning, so rounds are cheap, and rounds of at most ``stream_bytes`` per
        # destination keep their data in the caches between the writer's copy and the
        # readers' pass. Oversubscribed ranks wait for the scheduler, so a collective that
        # sends every peer the same data (broadcast, the gathers) takes fewer, larger rounds
        # (measured, 4 ranks on 2 cores, 64 MiB broadcast: 21 ms in 4 MiB rounds, 56 ms in
        # 1 MiB rounds); the reductions and all_to_all keep ``stream_bytes`` pieces there
        # (reduce_scatter: 1.33 MiB pieces 1.5-2.4x slower than 1 MiB ones). The same on every
        # rank: from the group's options, its size and the node's cores.
        self.oversubscribed = oversubscribed(ctx.size)
        self.round_bytes = self.lane_bytes
        if self.stream and not self.oversubscribed:
            self.round_bytes = min(self.lane_bytes, self.stream_bytes * max(1, ctx.size - 1))
        # all_reduce and reduce in one round: every rank reads and reduces all W buffers;
        # streamed, each reduces only its 1/W chunk of them (measured, 4 ranks on 2 cores,
        # 4 MiB: 11-12 ms in one round, 5 ms streamed).
        self.reduce_round_bytes = (min(self.round_bytes, self.stream_bytes) if self.stream
                                   else self.round_bytes)
        self._scratch_buf: Optional[np.ndarray] = None
        self.direct_bytes = or_default(opts.direct_bytes, DIRECT_BYTES)
        self.direct_max_ranks = or_default(opts.direct_max_ranks, DIRECT_MAX_RANKS)
        self.segment_bytes = or_default(opts.segment_bytes, SEGMENT_BYTES)
        self.algo: Optional[str] = opts.all_reduce_algo
        self.combined = opts.put == "combined" or (opts.put == "auto" and ctx.single_node)

    def _lane_reduce(self, op: ReduceOp, terms: List[Any], like: np.ndarray) -> np.ndarray:
        """``terms[0] (op) terms[1] (op) ...`` (every rank's part, in rank order) in a kept
        scratch buffer shaped as ``like`` flat. The same operations on every rank, into a
        buffer that aliases no input: numpy's complex kernels round differently when the
        output aliases an input, and every rank must hold bitwise the same result. The buffer
        is kept (a fresh one per call costs page faults: 2.4x slower at 4 MiB)."""
        out = self._scratch(like)
        _combine_into(op, out, _flat_in(terms[0]), _flat_in(terms[1]))
        for term in terms[2:]:
            combine(op, out, _flat_in(term))
        finalize(op, out, len(terms))
        return out

    def _scratch(self, like: np.ndarray) -> np.ndarray:
        """A kept flat buffer of ``like``'s dtype and size (grown as needed, up to the lane's
        largest part)."""
        need = like.nbytes
        if self._scratch_buf is None or self._scratch_buf.nbytes < need:
            self._scratch_buf = np.empty(max(need, 4096), dtype=np.uint8)
        return self._scratch_buf[:need].view(like.dtype)

    # ------------------------------------------------------------------ publishing
    def _put(self, arrays: Sequence[np.ndarray]) -> Tuple[Any, List[Tuple[int, int]]]:
        """One object holding ``arrays`` as flat segments; each array's segment range."""
        segs: Segments = []
        ranges = []
        for arr in arrays:
            start = len(segs)
            segs.extend(_split(_flat_in(arr), self.segment_bytes))
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

    # ------------------------------------------------------------------ reading
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

    # ------------------------------------------------------------------ steps
    def _reduce_scatter_step(self, pieces: Sequence[np.ndarray], out: np.ndarray, op: ReduceOp,
                             call: Call, step: int) -> List[Payload]:
        """Send ``pieces[j]`` to rank j; reduce what every rank sent us, plus ours, into ``out``
        (flat). Returns our payloads: keep them referenced until the peers are done.
        """
        me, size = self.ctx.rank, self.ctx.size
        to_peers = sum(p.nbytes for j, p in enumerate(pieces) if j != me)
        if step == 0 and to_peers <= self.round_bytes \
                and self._lane_reduce_scatter(pieces, out, op, call):
            return []
        sent = self._publish({j: pieces[j] for j in range(size) if j != me})
        received = self._fetch(self.ctx.exchange(call, step, sent), call)
        self._reduce_received(op, out, pieces[me], received)
        del received
        return sent

    def _lane_reduce_scatter(self, pieces: Sequence[np.ndarray], out: np.ndarray, op: ReduceOp,
                             call: Call, sub: int = 0) -> bool:
        """Round ``sub`` of ``call`` on the lane: :meth:`_reduce_scatter_step`'s exchange,
        reading the peers' pieces in place; ``False`` if the group has no lane."""
        me = self.ctx.rank
        got = self.ctx.gather_round(call, PerPeer(p if j != me else None for j, p in enumerate(pieces)),
                                   sub, views=True)
        if got is None:
            return False
        self._reduce_received(op, out, pieces[me],
                              {s: [_flat_in(g[me])] for s, g in enumerate(got) if s != me})
        return True

    def _reduce_received(self, op: ReduceOp, out: np.ndarray, own: np.ndarray,
                         received: Dict[int, Segments]) -> None:
        """``out = own (op) received[s] ...`` (sources in rank order), in one pass per term."""
        own = _flat_in(own)
        first: Optional[np.ndarray] = None if np.shares_memory(out, own) else own
        for s in sorted(received):
            _reduce_into(op, out, received[s], first)
            first = None
        if first is not None:
            np.copyto(out, first)
        finalize(op, out, self.ctx.size)

    def _gather_step(self, mine: np.ndarray, outs: Sequence[np.ndarray], call: Call, step: int,
                     root: Optional[int] = None) -> None:
        """Every rank's ``mine`` lands in ``outs[rank]`` (only on ``root``, when given)."""
        me, size = self.ctx.rank, self.ctx.size
        if step == 0 and mine.nbytes <= self.round_bytes \
                and self._gather_round_round(mine, outs, call, root=root):
            return
        to = [j for j in range(size) if j != me and (root is None or j == root)]
        got = self.ctx.exchange(call, step, self._publish_same(mine, to))
        if root is not None and me != root:
            return
        received = self._fetch(got, call)
        _copy_into(outs[me], [_flat_in(mine)])
        for s, segs in received.items():
            _copy_into(outs[s], segs)
        del received

    def _gather_round_round(self, mine: np.ndarray, outs: Sequence[np.ndarray], call: Call,
                           sub: int = 0, root: Optional[int] = None) -> bool:
        """Round ``sub`` of ``call`` on the lane: :meth:`_gather_step`'s exchange, copying
        straight from the peers' channels; ``False`` if the group has no lane."""
        got = self.ctx.gather_round(call, mine, sub, views=True)
        if got is None:
            return False
        if root is None or self.ctx.rank == root:
            for s, part in enumerate(got):
                _copy_into(outs[s], [_flat_in(part if s != self.ctx.rank else mine)])
        return True

    # ------------------------------------------------------------------ streaming
    def _streams(self, nbytes: int, limit: Optional[int] = None) -> bool:
        """Whether a collective that would send ``nbytes`` in one lane message (more than
        ``limit``, by default ``round_bytes``) streams through the lane in rounds instead (if
        the group has one: round 0 tells)."""
        limit = self.round_bytes if limit is None else limit
        return self.stream and self.ctx.size > 1 and nbytes > limit

    def _round_elems(self, itemsize: int, pieces: int) -> int:
        """Elements per destination and round, when a rank sends ``pieces`` of them."""
        per = self.round_bytes // max(1, pieces)
        if pieces > 1 or not self.oversubscribed:
            per = min(per, self.stream_bytes)
        return max(1, per // max(1, itemsize))

    def _rounds(self, n: int, itemsize: int, pieces: int) -> Iterator[Tuple[int, int, int]]:
        """``(sub, lo, hi)``: the rounds streaming ``n`` elements per destination."""
        step = self._round_elems(itemsize, pieces)
        for sub, lo in enumerate(range(0, n, step)):
            yield sub, lo, min(lo + step, n)

    def _stream_reduce(self, src: np.ndarray, dst: Optional[int], op: ReduceOp, call: Call,
                       result: Optional[np.ndarray]) -> bool:
        """all_reduce (``dst`` None) or reduce of flat ``src`` into flat ``result`` (on every
        rank, or on ``dst``; it may be ``src``): reduce-scatter then all-gather, block by
        block. Each rank reduces its chunk of a block (so every rank holds bitwise the same
        result) and sends it on in the next round, with its pieces of the next block: one
        round per block, plus one. ``False`` (nothing done) if the group has no lane."""
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
                self._reduce_received(op, cur[2], cur[0][me],
                                      {s: [_flat_in(m[0][me])] for s, m in enumerate(got)
                                       if s != me})
            got = m = None
            prev = (cur[1], cur[2]) if cur is not None else None
        return True

    def _stream_reduce_scatter(self, pieces: Sequence[np.ndarray], out: np.ndarray,
                               op: ReduceOp, call: Call) -> bool:
        for sub, lo, hi in self._rounds(out.size, out.itemsize, self.ctx.size - 1):
            if not self._lane_reduce_scatter([p[lo:hi] for p in pieces], out[lo:hi], op, call,
                                             sub):
                return False
        return True

    def _stream_gather(self, mine: np.ndarray, outs: Sequence[np.ndarray], call: Call,
                       root: Optional[int] = None) -> bool:
        """all_gather / gather of flat ``mine`` into flat ``outs``, round by round."""
        for sub, lo, hi in self._rounds(mine.size, mine.itemsize, 1):
            if not self._gather_round_round(mine[lo:hi], [o[lo:hi] for o in outs], call, sub,
                                           root=root):
                return False
        return True

    # ------------------------------------------------------------------ reductions
    def _all_reduce_algo(self, nbytes: int) -> str:
        if self.ctx.size == 1:
            return "inline"
        if self.algo is not None:
            return self.algo
        if nbytes <= self.inline_bytes:
            return "inline"
        size = self.ctx.size
        if size == 2 or (self.ctx.single_node and (nbytes <= self.direct_bytes
                                                   or size <= self.direct_max_ranks)):
            return "direct"
        return "rs_ag"

    def all_reduce(self, tensor: Any, op: ReduceOp, call: Call) -> None:
        arr = host_view(tensor)
        if self.ctx.size == 1:
            finalize(op, arr, 1)  # PREMUL_SUM still scales, as in torch
            return
        with _flat_out(arr) as flat:
            if self._streams(flat.nbytes, self.reduce_round_bytes) \
                    and self._stream_reduce(flat, None, op, call, flat):
                return
            lane = (self.ctx.gather_round(call, flat) if flat.nbytes <= self.reduce_round_bytes
                    else None)
            algo = "lane" if lane is not None else self._all_reduce_algo(flat.nbytes)
            if algo == "lane":
                np.copyto(flat, self._lane_reduce(op, lane, flat))
                del lane
            elif algo == "inline":
                np.copyto(flat, self.ctx.exchange(call, 0, flat, mode="reduce"))
            elif algo == "direct":
                self._direct_all_reduce(flat, op, call)
            else:
                size, me = self.ctx.size, self.ctx.rank
                bounds = chunk_bounds(flat.size, size)
                chunks = [flat[bounds[j]:bounds[j + 1]] for j in range(size)]
                sent = self._reduce_scatter_step(chunks, chunks[me], op, call, 0)
                self._gather_step(chunks[me], chunks, call, 1)
                del sent

    def _direct_all_reduce(self, flat: np.ndarray, op: ReduceOp, call: Call) -> None:
        """One step: each rank puts its buffer once and reduces all of them in rank order (so
        every rank computes bitwise the same result)."""
        me, size = self.ctx.rank, self.ctx.size
        sent = self._publish_same(flat, [j for j in range(size) if j != me])
        got = self.ctx.exchange(call, 0, sent)
        terms = self._fetch(got, call)
        if me == 0:
            _reduce_into(op, flat, terms[1])
        elif me == 1:
            # x0 (op) x1, in that order: complex products (and future ops) do not commute
            # bit for bit, and every rank must hold bitwise the same result.
            for lo, hi, a in _spans(terms[0]):
                _combine_into(op, flat[lo:hi], a, flat[lo:hi])
        else:
            # Our buffer is overwritten by x0 (op) x1 first: read our own term from our object.
            mine = sent[0]
            terms[me] = (self._fetch([mine], call)[0] if isinstance(mine, tuple)
                         else [np.array(flat)])
            for (lo, hi, a), (_, _, b) in zip(_spans(terms[0]), _spans(terms[1])):
                _combine_into(op, flat[lo:hi], a, b)
        for s in range(2, size):
            _reduce_into(op, flat, terms[s])
        del terms
        finalize(op, flat, size)
        del sent

    def reduce(self, tensor: Any, dst: int, op: ReduceOp, call: Call) -> None:
        arr = host_view(tensor)
        me, size = self.ctx.rank, self.ctx.size
        if self._streams(arr.nbytes, self.reduce_round_bytes):
            if me != dst:
                if self._stream_reduce(_flat_in(arr), dst, op, call, None):
                    return
            else:
                with _flat_out(arr) as flat:
                    if self._stream_reduce(_flat_in(arr), dst, op, call, flat):
                        return
        lane = (self.ctx.gather_round(call, _flat_in(arr))
                if arr.nbytes <= self.reduce_round_bytes else None)
        if lane is not None or self._all_reduce_algo(arr.nbytes) == "inline":
            if lane is not None:
                result = self._lane_reduce(op, lane, arr) if me == dst else None
            else:
                result = self.ctx.exchange(call, 0, _flat_in(arr), mode="reduce", root=dst)
            if me == dst:
                with _flat_out(arr) as flat:
                    np.copyto(flat, result)
            return
        src = _flat_in(arr)
        bounds = chunk_bounds(src.size, size)
        chunks = [src[bounds[j]:bounds[j + 1]] for j in range(size)]
        if me == dst:
            with _flat_out(arr) as flat:
                outs = [flat[bounds[j]:bounds[j + 1]] for j in range(size)]
                sent = self._reduce_scatter_step(chunks, outs[me], op, call, 0)
                self._gather_step(outs[me], outs, call, 1, root=dst)
        else:
            mine = np.empty_like(chunks[me])
            sent = self._reduce_scatter_step(chunks, mine, op, call, 0)
            self._gather_step(mine, [], call, 1, root=dst)
        del sent

    def reduce_scatter(self, output: Any, inputs: List[Any], op: ReduceOp, call: Call) -> None:
        out = host_view(output)
        pieces = [_flat_in(host_view(t)) for t in inputs]
        with _flat_out(out) as flat:
            self._reduce_scatter(pieces, flat, op, call)

    def reduce_scatter_tensor(self, output: Any, tensor: Any, op: ReduceOp, call: Call) -> None:
        src = _flat_in(host_view(tensor))
        out = host_view(output)
        n = out.size
        pieces = [src[j * n:(j + 1) * n] for j in range(self.ctx.size)]
        with _flat_out(out) as flat:
            self._reduce_scatter(pieces, flat, op, call)

    def _reduce_scatter(self, pieces: Sequence[np.ndarray], flat: np.ndarray, op: ReduceOp,
                        call: Call) -> None:
        if self._streams(flat.nbytes * (self.ctx.size - 1)) \
                and self._stream_reduce_scatter(pieces, flat, op, call):
            return
        self._reduce_scatter_step(pieces, flat, op, call, 0)

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensor: Any, src: int, call: Call) -> None:
        arr = host_view(tensor)
        me, size = self.ctx.rank, self.ctx.size
        if self._streams(arr.nbytes):
            with _flat_out(arr) as flat:
                if self._stream_broadcast(flat, src, call):
                    return
        if size > 1 and arr.nbytes <= self.round_bytes:
            lane = self.ctx.gather_round(call, arr if me == src else None)
            if lane is not None:
                if me != src:
                    _copy_into(arr, [_flat_in(lane[src])])
                return
        if me == src:
            sent = self._publish_same(arr, [j for j in range(size) if j != me])
            self.ctx.exchange(call, 0, sent)
            return
        got = self.ctx.exchange(call, 0, None)
        received = self._fetch(got, call)
        _copy_into(arr, received[src])
        del received

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

    def all_gather(self, outputs: List[Any], tensor: Any, call: Call) -> None:
        mine = host_view(tensor)
        outs = [host_view(t) for t in outputs]
        self._gather(mine, outs, call)

    def all_gather_into_tensor(self, output: Any, tensor: Any, call: Call) -> None:
        mine = _flat_in(host_view(tensor))
        n = mine.size
        with _flat_out(host_view(output)) as flat:
            outs = [flat[j * n:(j + 1) * n] for j in range(self.ctx.size)]
            self._gather(mine, outs, call)

    def gather(self, tensor: Any, outputs: Optional[List[Any]], dst: int, call: Call) -> None:
        mine = host_view(tensor)
        outs = [host_view(t) for t in outputs] if outputs is not None else []
        self._gather(mine, outs, call, root=dst)

    def _gather(self, mine: np.ndarray, outs: Sequence[np.ndarray], call: Call,
                root: Optional[int] = None) -> None:
        """all_gather (every rank's ``mine`` into ``outs``) or gather (into ``root``'s)."""
        if self._streams(mine.nbytes):
            with ExitStack() as stack:
                flats = [stack.enter_context(_flat_out(o)) for o in outs]
                if self._stream_gather(_flat_in(mine), flats, call, root=root):
                    return
        self._gather_step(mine, outs, call, 0, root=root)

    def scatter(self, output: Any, inputs: Optional[List[Any]], src: int, call: Call) -> None:
        out = host_view(output)
        me, size = self.ctx.rank, self.ctx.size
        if self._streams(out.nbytes * (size - 1)):
            ins = [_flat_in(host_view(t)) for t in inputs or []] if me == src else []
            with _flat_out(out) as flat:
                if self._stream_scatter(flat, ins, src, call):
                    return
        if size > 1 and out.nbytes * (size - 1) <= self.round_bytes:
            mine = (PerPeer(host_view(t) if j != me else None for j, t in enumerate(inputs or []))
                    if me == src else None)
            lane = self.ctx.gather_round(call, mine)
            if lane is not None:
                piece = host_view((inputs or [])[me]) if me == src else lane[src][me]
                _copy_into(out, [_flat_in(piece)])
                return
        if me == src:
            arrays = [host_view(t) for t in inputs or []]
            sent = self._publish({j: arrays[j] for j in range(size) if j != me})
            self.ctx.exchange(call, 0, sent)
            _copy_into(out, [_flat_in(arrays[me])])
            return
        got = self.ctx.exchange(call, 0, None)
        received = self._fetch(got, call)
        _copy_into(out, received[src])
        del received

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

    def all_to_all(self, outputs: List[Any], inputs: List[Any], call: Call) -> None:
        ins = [host_view(t) for t in inputs]
        outs = [host_view(t) for t in outputs]
        self._all_to_all(outs, ins, [_meta(a) for a in ins], [_meta(a) for a in outs], call)

    def all_to_all_single(self, output: Any, tensor: Any, output_splits: List[int],
                          input_splits: List[int], call: Call) -> None:
        src = np.ascontiguousarray(host_view(tensor))
        trailing = tuple(src.shape[1:])
        in_off = np.concatenate([[0], np.cumsum(input_splits)]).astype(int)
        ins = [src[in_off[j]:in_off[j + 1]] for j in range(self.ctx.size)]
        out = host_view(output)
        with _flat_out(out) as flat:
            shaped = flat.reshape((-1,) + trailing) if out.ndim else flat
            out_off = np.concatenate([[0], np.cumsum(output_splits)]).astype(int)
            outs = [shaped[out_off[s]:out_off[s + 1]] for s in range(self.ctx.size)]
            self._all_to_all(outs, ins, [_meta(a) for a in ins], [_meta(a) for a in outs], call)

    def _all_to_all(self, outs: List[np.ndarray], ins: List[np.ndarray], send_meta: List[Any],
                    recv_meta: List[Any], call: Call) -> None:
        me, size = self.ctx.rank, self.ctx.size
        step = 0
        if size > 1:
            # Per-peer sizes may differ between ranks, so no rank can tell alone that every
            # rank's part is small: each sends its pieces if they fit the lane, or says it does
            # not; all see all, and either all finish here or all stream the pieces in later
            # rounds (or, with ``stream=False``, go on to the coordinator together).
            fits = sum(ins[j].nbytes for j in range(size) if j != me) <= self.round_bytes
            pieces = PerPeer(ins[j] if j != me else None for j in range(size)) if fits else None
            lane = self.ctx.gather_round(call, (pieces, send_meta, recv_meta))
            if lane is not None:
                problem = meta_mismatch({s: m[1] for s, m in enumerate(lane)},
                                        {s: m[2] for s, m in enumerate(lane)},
                                        self.ctx.global_ranks)
                if problem:
                    raise errors.CollectiveMismatchError(
                        f"{call.op} #{call.seq} on group {self.ctx.group_name!r}: {problem}",
                        **self.ctx.ctx(call))
                if all(m[0] is not None for m in lane):
                    _copy_into(outs[me], [_flat_in(ins[me])])
                    for s, m in enumerate(lane):
                        if s != me:
                            _copy_into(outs[s], [_flat_in(m[0][me])])
                    return
                if self.stream:
                    longest = max(int(np.prod(shape)) for s, m in enumerate(lane)
                                  for j, (_, shape) in enumerate(m[1]) if j != s)
                    del lane
                    self._stream_all_to_all(outs, ins, longest, call)
                    return
                step = 1  # step 0 was the lane's
            del lane
        sent = self._publish({j: ins[j] for j in range(size) if j != me})
        got = self.ctx.exchange(call, step, sent, send_meta=send_meta, recv_meta=recv_meta)
        _copy_into(outs[me], [_flat_in(ins[me])])
        received = self._fetch(got, call)
        for s, segs in received.items():
            _copy_into(outs[s], segs)
        del received

    def _stream_all_to_all(self, outs: List[np.ndarray], ins: List[np.ndarray], longest: int,
                           call: Call) -> None:
        """Rounds 1, 2, ... of an all_to_all on the lane: in each, every rank sends the next
        slice of each of its pieces (``longest``: the largest piece of any rank, in
        elements, which every rank knows from round 0)."""
        me = self.ctx.rank
        src = [_flat_in(a) for a in ins]
        with ExitStack() as stack:
            flats = [stack.enter_context(_flat_out(o)) for o in outs]
            np.copyto(flats[me], src[me])
            for sub, lo, hi in self._rounds(longest, src[me].itemsize, self.ctx.size - 1):
                got = self.ctx.gather_round(
                    call, PerPeer(a[lo:hi] if j != me else None for j, a in enumerate(src)), sub + 1,
                    views=True)
                for s, pieces in enumerate(got):
                    if s != me:
                        piece = pieces[me]
                        np.copyto(flats[s][lo:lo + piece.size], piece)
                piece = pieces = got = None

    def barrier(self, call: Call) -> None:
        # monitored_barrier stays on the coordinator: it reports who is missing, and does not
        # break the group when it times out
        if call.op == "barrier" and self.ctx.gather_round(call, None) is not None:
            return
        self.ctx.exchange(call, 0, None)

    # ------------------------------------------------------------------ point to point
    def send(self, tensor: Any, dst: int, tag: int, timeout_s: float) -> Completion:
        arr = host_view(tensor)
        mailbox = self.ctx.mailbox()
        if mailbox is not None:  # straight to the peer (raycoll.transport.tcp)
            done = mailbox.send(arr, dst, tag, _meta(arr), timeout_s)

            def finish() -> Optional[int]:
                done()
                return None

            return finish
        # inline: snapshot now, the caller may reuse its buffer before the message is matched
        payload: Payload = (np.array(arr) if arr.nbytes <= self.inline_bytes
                            else self._publish_same(arr, [dst])[dst])
        ref = self.ctx.p2p_send(dst, tag, _meta(arr), payload, timeout_s)
        group = self.ctx

        def wait() -> Optional[int]:
            group.client.wait(ref, timeout_s, op="send", group=group.group_name,
                              rank=group.global_ranks[group.rank])
            return None

        return wait

    def recv(self, tensor: Any, src: Optional[int], tag: int, timeout_s: float) -> Completion:
        arr = host_view(tensor)
        mailbox = self.ctx.mailbox()
        if mailbox is not None:
            return mailbox.recv(arr, src, tag, _meta(arr), timeout_s)
        ref = self.ctx.p2p_recv(src, tag, _meta(arr), timeout_s)
        call = Call("recv", -1, timeout_s)

        def wait() -> Optional[int]:
            sender, payload = self.ctx.client.wait(
                ref, timeout_s, op="recv", group=self.ctx.group_name,
                rank=self.ctx.global_ranks[self.ctx.rank])
            got: List[Payload] = [None] * self.ctx.size
            got[int(sender)] = payload
            received = self._fetch(got, call)
            _copy_into(arr, received[int(sender)])
            del received
            return int(sender)

        return wait

