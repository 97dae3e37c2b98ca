"""The cpu backend (registered as ``"objstore"``): collectives on CPU arrays.

Each collective takes the first path that fits, the same on every rank: rounds of the
group's round transport (:mod:`raycoll.transport`: the shared-memory lane on one node,
direct connections across nodes), with the algorithms of :mod:`raycoll.algorithms.direct`;
else steps through the coordinator and the Ray object store
(:mod:`raycoll.algorithms.store`: the object collectives, ``transport="store"``, and what no
round transport carries). Point-to-point goes over the group's direct connections where it
has them, else through the coordinator.

The design (paths, thresholds, algorithms, object-store memory) is written once in
``docs/transports.md``; why the thresholds are what they are: benchmarks/HISTORY.md.
The thresholds are group options (:class:`raycoll.GroupOptions`).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, List, Optional, Sequence

import numpy as np

from raycoll import errors
from raycoll.algorithms.flat import array_meta, chunk_bounds, copy_into, flat_in, flat_out
from raycoll.algorithms.direct import DirectAlgorithms
from raycoll.algorithms.scheduled import ScheduledAlgorithms
from raycoll.algorithms.store import Payload, StoreSteps
from raycoll.backends.node_paths import NodePaths
from raycoll.backends.segment_paths import SegmentPaths
from raycoll.backends.socket_paths import SocketPaths
from raycoll.backends.base import Call, CollectiveBackend, Completion, GroupContext
from raycoll.coordinator.logic import meta_mismatch
from raycoll.options import or_default
from raycoll.reduce_op import ReduceOp, finalize
from raycoll.tensors import host_view
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
#: ... and, on a single node, at any size with at most this many ranks: one step (with
#: ``W - 1`` reads per rank) beat the two steps of reduce-scatter + all-gather up to 4 ranks
#: even at 64 MiB, because each step costs a coordinator round trip that carries object
#: references, which costs much more than one without (benchmarks/HISTORY.md).
DIRECT_MAX_RANKS = 4
#: Arrays are put as segments of at most this size. Ray copies a large buffer into the store
#: with several threads started per copy, which on a loaded or small machine is several times
#: slower than one ``memcpy`` per segment (benchmarks/HISTORY.md).
SEGMENT_BYTES = 8 << 20

#: A collective too large for one lane message streams through the lane in rounds, each
#: rank sending at most this much per destination in a round (and at most ``lane_bytes`` in
#: all): a round's data then stays in the caches between the writer's copy into its channel
#: and the readers' pass over it (benchmarks/HISTORY.md, "Streaming rounds").
STREAM_BYTES = 1 << 20

#: The all_reduce algorithms of the steps through the coordinator.
STORE_ALGOS = ("inline", "direct", "rs_ag")

#: The defaults of ``lane_bytes`` and ``stream_bytes`` for groups on direct connections.
TCP_ROUND_BYTES = 16 << 20
TCP_STREAM_BYTES = 4 << 20


class ObjstoreBackend(NodePaths, SegmentPaths, SocketPaths, ScheduledAlgorithms, DirectAlgorithms,
                     StoreSteps, CollectiveBackend):
    """CPU collectives in rounds of the group's round transport, else in steps through the
    coordinator and the Ray object store (see the module docstring)."""

    devices = ("cpu",)

    def __init__(self, ctx: GroupContext) -> None:
        super().__init__(ctx)
        opts = ctx.options  # validated when the group was formed (raycoll.options)
        self.inline_bytes = or_default(opts.inline_bytes, INLINE_BYTES)
        # Over direct connections rounds are not bounded by a channel or the caches but by
        # the cost of each round trip: larger rounds (benchmarks/HISTORY.md).
        tcp = ctx.planned_transport() == "tcp"
        self.lane_bytes = or_default(opts.lane_bytes, TCP_ROUND_BYTES if tcp else LANE_BYTES)
        self.stream = opts.stream and self.lane_bytes > 0
        self.stream_bytes = or_default(opts.stream_bytes, TCP_STREAM_BYTES if tcp
                                       else STREAM_BYTES)
        # The most a rank sends in one lane round. Ranks that fit the node's cores wait for
        # each other spinning, so rounds are cheap, and rounds of at most ``stream_bytes`` per
        # destination keep their data in the caches between the writer's copy and the
        # readers' pass. Oversubscribed ranks wait for the scheduler, so a collective that
        # sends every peer the same data (broadcast, the gathers) takes fewer, larger rounds;
        # the reductions and all_to_all keep ``stream_bytes`` pieces there (both measured:
        # benchmarks/HISTORY.md, "Streaming rounds"). The same on every rank: from the
        # group's options, its size and the node's cores.
        self.oversubscribed = oversubscribed(ctx.size)
        self.round_bytes = self.lane_bytes
        if self.stream and not self.oversubscribed:
            self.round_bytes = min(self.lane_bytes, self.stream_bytes * max(1, ctx.size - 1))
        # all_reduce and reduce in one round: every rank reads and reduces all W buffers;
        # streamed, each reduces only its 1/W chunk of them (faster from a few MiB on:
        # benchmarks/HISTORY.md, "Streaming rounds").
        self.reduce_round_bytes = (min(self.round_bytes, self.stream_bytes) if self.stream
                                   else self.round_bytes)
        self._scratch_buf: Optional[np.ndarray] = None
        self.direct_bytes = or_default(opts.direct_bytes, DIRECT_BYTES)
        self.direct_max_ranks = or_default(opts.direct_max_ranks, DIRECT_MAX_RANKS)
        self.segment_bytes = or_default(opts.segment_bytes, SEGMENT_BYTES)
        # the coordinator's all_reduce steps (the schedules' names: ScheduledAlgorithms)
        self.algo = opts.all_reduce_algo if opts.all_reduce_algo in STORE_ALGOS else None
        self._init_scheduled()
        self.combined = opts.put == "combined" or (opts.put == "auto" and ctx.single_node)

    # ------------------------------------------------------------------ one step, either way
    def _reduce_scatter_step(self, pieces: Sequence[np.ndarray], out: np.ndarray, op: ReduceOp,
                             call: Call, step: int) -> List[Payload]:
        """Send ``pieces[j]`` to rank j; reduce what every rank sent us, plus ours, into ``out``
        (flat): in one round when it is step 0 and the pieces fit one, else through the
        coordinator. Returns our payloads: keep them referenced until the peers are done.
        """
        me = self.ctx.rank
        to_peers = sum(p.nbytes for j, p in enumerate(pieces) if j != me)
        if step == 0 and to_peers <= self.round_bytes \
                and self._round_reduce_scatter(pieces, out, op, call):
            return []
        return self._store_reduce_scatter(pieces, out, op, call, step)

    def _gather_step(self, mine: np.ndarray, outs: Sequence[np.ndarray], call: Call, step: int,
                     root: Optional[int] = None) -> None:
        """Every rank's ``mine`` lands in ``outs[rank]`` (only on ``root``, when given): in one
        round when it is step 0 and ``mine`` fits one, else through the coordinator."""
        if step == 0 and mine.nbytes <= self.round_bytes \
                and self._round_gather(mine, outs, call, root=root):
            return
        self._store_gather(mine, outs, call, step, root=root)

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
        if self._seg_all_reduce(arr, op, call) or self._node_all_reduce(arr, op, call):
            return
        with flat_out(arr) as flat:
            if self._scheduled("all_reduce", flat, op, call):
                return
            if self._streams(flat.nbytes, self.reduce_round_bytes) \
                    and self._stream_reduce(flat, None, op, call, flat):
                return
            lane = (self.ctx.gather_round(call, flat) if flat.nbytes <= self.reduce_round_bytes
                    else None)
            if lane is not None:
                np.copyto(flat, self._round_reduce(op, lane, flat))
                del lane
                return
            algo = self._all_reduce_algo(flat.nbytes)
            if algo == "inline":
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

    def reduce(self, tensor: Any, dst: int, op: ReduceOp, call: Call) -> None:
        arr = host_view(tensor)
        me, size = self.ctx.rank, self.ctx.size
        if size > 1 and (self._seg_all_reduce(arr, op, call, root=dst)
                         or self._node_reduce(arr, dst, op, call)):
            return
        if me != dst:  # a schedule reduces in the buffer: not in the caller's
            if self._schedules("reduce", arr.nbytes, arr.itemsize, call, root=dst):
                self._scheduled("reduce", np.array(flat_in(arr)), op, call, root=dst)
                return
        else:
            with flat_out(arr) as flat:
                if self._scheduled("reduce", flat, op, call, root=dst):
                    return
        if self._streams(arr.nbytes, self.reduce_round_bytes):
            if me != dst:
                if self._stream_reduce(flat_in(arr), dst, op, call, None):
                    return
            else:
                with flat_out(arr) as flat:
                    if self._stream_reduce(flat_in(arr), dst, op, call, flat):
                        return
        lane = (self.ctx.gather_round(call, flat_in(arr))
                if arr.nbytes <= self.reduce_round_bytes else None)
        if lane is not None or self._all_reduce_algo(arr.nbytes) == "inline":
            if lane is not None:
                result = self._round_reduce(op, lane, arr) if me == dst else None
            else:
                result = self.ctx.exchange(call, 0, flat_in(arr), mode="reduce", root=dst)
            if me == dst:
                assert result is not None, "the root holds the reduction"
                with flat_out(arr) as flat:
                    np.copyto(flat, result)
            return
        src = flat_in(arr)
        bounds = chunk_bounds(src.size, size)
        chunks = [src[bounds[j]:bounds[j + 1]] for j in range(size)]
        if me == dst:
            with flat_out(arr) as flat:
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
        pieces = [flat_in(host_view(t)) for t in inputs]
        whole = np.concatenate(pieces)
        if self._seg_reduce_scatter(whole, out, op, call) \
                or (all(p.size == out.size for p in pieces)
                    and self._node_reduce_scatter(whole, out, op, call)):
            return
        with flat_out(out) as flat:
            self._reduce_scatter(pieces, flat, op, call)

    def reduce_scatter_tensor(self, output: Any, tensor: Any, op: ReduceOp, call: Call) -> None:
        src = flat_in(host_view(tensor))
        out = host_view(output)
        if self._seg_reduce_scatter(src, out, op, call) \
                or self._node_reduce_scatter(src, out, op, call):
            return
        n = out.size
        pieces = [src[j * n:(j + 1) * n] for j in range(self.ctx.size)]
        with flat_out(out) as flat:
            self._reduce_scatter(pieces, flat, op, call)

    def _reduce_scatter(self, pieces: Sequence[np.ndarray], flat: np.ndarray, op: ReduceOp,
                        call: Call) -> None:
        if all(p.size == flat.size and p.dtype == flat.dtype for p in pieces) \
                and self._schedules("reduce_scatter", flat.nbytes * len(pieces),
                                    flat.itemsize, call):
            whole = np.concatenate(pieces)  # the schedule reduces in place: a copy
            self._scheduled("reduce_scatter", whole, op, call)
            me, n = self.ctx.rank, flat.size
            np.copyto(flat, whole[me * n:(me + 1) * n])
            return
        if self._streams(flat.nbytes * (self.ctx.size - 1)) \
                and self._stream_reduce_scatter(pieces, flat, op, call):
            return
        self._reduce_scatter_step(pieces, flat, op, call, 0)

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensor: Any, src: int, call: Call) -> None:
        arr = host_view(tensor)
        me, size = self.ctx.rank, self.ctx.size
        if size > 1 and (self._seg_broadcast(arr, src, call)
                         or self._node_broadcast(arr, src, call)):
            return
        with flat_out(arr) as flat:
            if self._scheduled("broadcast", flat, None, call, root=src):
                return
        if self._streams(arr.nbytes):
            with flat_out(arr) as flat:
                if self._stream_broadcast(flat, src, call):
                    return
        if size > 1 and arr.nbytes <= self.round_bytes:
            lane = self.ctx.gather_round(call, arr if me == src else None)
            if lane is not None:
                if me != src:
                    copy_into(arr, [flat_in(lane[src])])
                return
        if me == src:
            sent = self._publish_same(arr, [j for j in range(size) if j != me])
            self.ctx.exchange(call, 0, sent)
            return
        got = self.ctx.exchange(call, 0, None)
        received = self._fetch(got, call)
        copy_into(arr, received[src])
        del received

    def all_gather(self, outputs: List[Any], tensor: Any, call: Call) -> None:
        mine = host_view(tensor)
        outs = [host_view(t) for t in outputs]
        self._gather(mine, outs, call)

    def all_gather_into_tensor(self, output: Any, tensor: Any, call: Call) -> None:
        mine = flat_in(host_view(tensor))
        n = mine.size
        if self.ctx.size > 1 and self._seg_gather_into(mine, host_view(output), call):
            return
        with flat_out(host_view(output)) as flat:
            outs = [flat[j * n:(j + 1) * n] for j in range(self.ctx.size)]
            self._gather(mine, outs, call)

    def gather(self, tensor: Any, outputs: Optional[List[Any]], dst: int, call: Call) -> None:
        mine = host_view(tensor)
        outs = [host_view(t) for t in outputs] if outputs is not None else []
        self._gather(mine, outs, call, root=dst)

    def _gather(self, mine: np.ndarray, outs: Sequence[np.ndarray], call: Call,
                root: Optional[int] = None) -> None:
        """all_gather (every rank's ``mine`` into ``outs``) or gather (into ``root``'s)."""
        if self.ctx.size > 1 and self._seg_gather(mine, outs, call, root):
            return
        if root is None and self._node_all_gather(mine, outs, call):
            return
        if root is not None and self._net_gather(mine, outs, call, root):
            return
        if root is None and len(outs) == self.ctx.size \
                and all(o.size == mine.size and o.dtype == mine.dtype for o in outs) \
                and self._schedules("all_gather", mine.nbytes * len(outs), mine.itemsize, call):
            me, n = self.ctx.rank, mine.size
            whole = np.empty(n * self.ctx.size, dtype=mine.dtype)
            whole[me * n:(me + 1) * n] = flat_in(mine)
            self._scheduled("all_gather", whole, None, call)
            for j, o in enumerate(outs):
                copy_into(o, [whole[j * n:(j + 1) * n]])
            return
        if self._streams(mine.nbytes):
            with ExitStack() as stack:
                flats = [stack.enter_context(flat_out(o)) for o in outs]
                if self._stream_gather(flat_in(mine), flats, call, root=root):
                    return
        self._gather_step(mine, outs, call, 0, root=root)

    def scatter(self, output: Any, inputs: Optional[List[Any]], src: int, call: Call) -> None:
        out = host_view(output)
        me, size = self.ctx.rank, self.ctx.size
        if size > 1 and self._seg_scatter(out, inputs, src, call, host_view):
            return
        if self._net_scatter(out, [host_view(t) for t in inputs or []] if me == src else [],
                             src, call):
            return
        if self._streams(out.nbytes * (size - 1)):
            ins = [flat_in(host_view(t)) for t in inputs or []] if me == src else []
            with flat_out(out) as flat:
                if self._stream_scatter(flat, ins, src, call):
                    return
        if size > 1 and out.nbytes * (size - 1) <= self.round_bytes:
            mine = (PerPeer(host_view(t) if j != me else None for j, t in enumerate(inputs or []))
                    if me == src else None)
            lane = self.ctx.gather_round(call, mine)
            if lane is not None:
                piece = host_view((inputs or [])[me]) if me == src else lane[src][me]
                copy_into(out, [flat_in(piece)])
                return
        if me == src:
            arrays = [host_view(t) for t in inputs or []]
            sent = self._publish({j: arrays[j] for j in range(size) if j != me})
            self.ctx.exchange(call, 0, sent)
            copy_into(out, [flat_in(arrays[me])])
            return
        got = self.ctx.exchange(call, 0, None)
        received = self._fetch(got, call)
        copy_into(out, received[src])
        del received

    def all_to_all(self, outputs: List[Any], inputs: List[Any], call: Call) -> None:
        ins = [host_view(t) for t in inputs]
        outs = [host_view(t) for t in outputs]
        self._all_to_all(outs, ins, [array_meta(a) for a in ins],
                         [array_meta(a) for a in outs], call)

    def all_to_all_single(self, output: Any, tensor: Any, output_splits: List[int],
                          input_splits: List[int], call: Call) -> None:
        src = np.ascontiguousarray(host_view(tensor))
        trailing = tuple(src.shape[1:])
        if self.ctx.size > 1 and self._seg_all_to_all_single(
                host_view(output), src, int(np.prod(trailing, dtype=np.int64)) * src.itemsize,
                output_splits, input_splits, call):
            return
        in_off = np.concatenate([[0], np.cumsum(input_splits)]).astype(int)
        ins = [src[in_off[j]:in_off[j + 1]] for j in range(self.ctx.size)]
        out = host_view(output)
        with flat_out(out) as flat:
            shaped = flat.reshape((-1,) + trailing) if out.ndim else flat
            out_off = np.concatenate([[0], np.cumsum(output_splits)]).astype(int)
            outs = [shaped[out_off[s]:out_off[s + 1]] for s in range(self.ctx.size)]
            self._all_to_all(outs, ins, [array_meta(a) for a in ins],
                             [array_meta(a) for a in outs], call)

    def _all_to_all(self, outs: List[np.ndarray], ins: List[np.ndarray], send_meta: List[Any],
                    recv_meta: List[Any], call: Call) -> None:
        me, size = self.ctx.rank, self.ctx.size
        step = 0
        if size > 1 and self._seg_all_to_all(outs, ins, call):
            return
        if self._net_all_to_all(outs, ins, call):
            return
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
                    copy_into(outs[me], [flat_in(ins[me])])
                    for s, m in enumerate(lane):
                        if s != me:
                            copy_into(outs[s], [flat_in(m[0][me])])
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
        copy_into(outs[me], [flat_in(ins[me])])
        received = self._fetch(got, call)
        for s, segs in received.items():
            copy_into(outs[s], segs)
        del received

    def barrier(self, call: Call) -> None:
        # monitored_barrier stays on the coordinator: it reports who is missing, and does not
        # break the group when it times out
        if call.op == "barrier" and self.ctx.size > 1 and self._seg_barrier(call):
            return
        if call.op == "barrier" and (
                self._scheduled("all_reduce", np.zeros(1, np.uint8), ReduceOp.SUM, call)
                or self.ctx.gather_round(call, None) is not None):
            return
        self.ctx.exchange(call, 0, None)

    # ------------------------------------------------------------------ point to point
    def send(self, tensor: Any, dst: int, tag: int, timeout_s: float) -> Completion:
        arr = host_view(tensor)
        mailbox = self.ctx.mailbox()
        if mailbox is not None:  # straight to the peer (raycoll.transport.tcp)
            done = mailbox.send(arr, dst, tag, array_meta(arr), timeout_s)

            def finish() -> Optional[int]:
                done()
                return None

            return finish
        # inline: snapshot now, the caller may reuse its buffer before the message is matched
        payload: Payload = (np.array(arr) if arr.nbytes <= self.inline_bytes
                            else self._publish_same(arr, [dst])[dst])
        ref = self.ctx.p2p_send(dst, tag, array_meta(arr), payload, timeout_s)
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
            return mailbox.recv(arr, src, tag, array_meta(arr), timeout_s)
        ref = self.ctx.p2p_recv(src, tag, array_meta(arr), timeout_s)
        call = Call("recv", -1, timeout_s)

        def wait() -> Optional[int]:
            sender, payload = self.ctx.client.wait(
                ref, timeout_s, op="recv", group=self.ctx.group_name,
                rank=self.ctx.global_ranks[self.ctx.rank])
            got: List[Payload] = [None] * self.ctx.size
            got[int(sender)] = payload
            received = self._fetch(got, call)
            copy_into(arr, received[int(sender)])
            del received
            return int(sender)

        return wait
