"""The cpu backend (registered as ``"objstore"``): collectives on CPU arrays.

Plan, execute; else store. Each collective runs on the native executor where the group has
a native path for it, the same on every rank:

- the node segment (:class:`~raycoll.transport.segment.SegmentLane`: its plans, run here on
  the user's arrays, flat, each array of a list its own buffer), where every rank is on one
  node;
- else, on several nodes, the hierarchical plans of the node segments and sockets
  (:mod:`raycoll.backends.node_paths`) where the planner prices them cheapest;
- else the native sockets: the scheduled algorithms (:mod:`raycoll.algorithms.scheduled`,
  the cost model's choice) for all_reduce, reduce, reduce_scatter, all_gather, broadcast
  and barrier, one plan a call for gather, scatter and all_to_all
  (:mod:`raycoll.backends.socket_paths`);
- else steps through the coordinator and the Ray object store
  (:mod:`raycoll.algorithms.store`): the one fallback, where a rank of the group has no
  native core (not built, turned off by ``RAYCOLL_NATIVE=0``, another platform: a warning
  once per process names why), with ``transport="store"``, and for the few calls no native
  plan covers (a dtype and op the core does not reduce, reduce_scatter parts of several
  sizes, across direct connections).

Point-to-point goes over the group's pair pipes (shared memory on a node, socket pipes
across nodes) where every rank has the native core, else through the coordinator. The object collectives always go through the object store
(:mod:`raycoll.backends.objects`).

The design is written once in ``docs/transports.md``; the thresholds of the fallback's steps
are group options (:class:`raycoll.GroupOptions`).
"""

from __future__ import annotations

import warnings
from contextlib import ExitStack
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from raycoll.algorithms.flat import array_meta, copy_into, flat_in, flat_out
from raycoll.algorithms.scheduled import ScheduledAlgorithms
from raycoll.algorithms.store import Payload, StoreSteps
from raycoll.backends.node_paths import NodePaths
from raycoll.backends.socket_paths import SocketPaths
from raycoll.backends.base import Call, CollectiveBackend, Completion, GroupContext
from raycoll.native import core, native_status
from raycoll.options import or_default
from raycoll.reduce_op import ReduceOp, finalize
from raycoll.tensors import host_view
from raycoll.transport.pipes import PairPipes

__all__ = ["ObjstoreBackend", "INLINE_BYTES", "STREAM_BYTES", "DIRECT_BYTES",
           "DIRECT_MAX_RANKS", "SEGMENT_BYTES"]

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
#: A schedule over the native sockets pipelines a large buffer in pieces of about this size
#: (group option ``stream_bytes``).
STREAM_BYTES = 4 << 20

#: The all_reduce algorithms of the steps through the coordinator.
STORE_ALGOS = ("inline", "direct", "rs_ag")

_warned = False


def _warn_store_fallback(ctx: GroupContext) -> None:
    """Once per process: a group that could run natively goes through the object store,
    because a rank of it has no native core."""
    global _warned
    if _warned or ctx.native or ctx.size < 2 or ctx.transport == "store":
        return
    _warned = True
    why = (f"the native core is not in use in this process: {native_status()}" if core is None
           else "a rank of the group runs without the native core")
    warnings.warn(f"raycoll: group {ctx.group_name!r} sends its CPU collectives through the "
                  f"Ray object store, the fallback, far slower than the native plane ({why})",
                  RuntimeWarning, stacklevel=3)


class ObjstoreBackend(NodePaths, SocketPaths, ScheduledAlgorithms, StoreSteps,
                     CollectiveBackend):
    """CPU collectives on the native executor, else in steps through the coordinator and the
    Ray object store (see the module docstring)."""

    devices = ("cpu",)

    def __init__(self, ctx: GroupContext) -> None:
        super().__init__(ctx)
        opts = ctx.options  # validated when the group was formed (raycoll.options)
        self.inline_bytes = or_default(opts.inline_bytes, INLINE_BYTES)
        self.stream_bytes = or_default(opts.stream_bytes, STREAM_BYTES)
        self.direct_bytes = or_default(opts.direct_bytes, DIRECT_BYTES)
        self.direct_max_ranks = or_default(opts.direct_max_ranks, DIRECT_MAX_RANKS)
        self.segment_bytes = or_default(opts.segment_bytes, SEGMENT_BYTES)
        # the coordinator's all_reduce steps (the schedules' names: ScheduledAlgorithms)
        self.algo = opts.all_reduce_algo if opts.all_reduce_algo in STORE_ALGOS else None
        self._init_scheduled()
        self.combined = opts.put == "combined" or (opts.put == "auto" and ctx.single_node)
        _warn_store_fallback(ctx)

    def _lane(self, call: Call) -> Any:
        """The group's node segment (set up in ``call`` if this is its first collective), or
        ``None`` where it has none (the same on every rank)."""
        return self.ctx.native_lane(call) if self.ctx.size > 1 else None

    # ------------------------------------------------------------------ reductions
    def all_reduce(self, tensor: Any, op: ReduceOp, call: Call) -> None:
        arr = host_view(tensor)
        if self.ctx.size == 1:
            finalize(op, arr, 1)  # PREMUL_SUM still scales, as in torch
            return
        if self._reduce_natively(arr, op, call):
            return
        with flat_out(arr) as flat:
            if not self._scheduled("all_reduce", flat, op, call):
                self._store_all_reduce(flat, op, call)

    def reduce(self, tensor: Any, dst: int, op: ReduceOp, call: Call) -> None:
        arr = host_view(tensor)
        if self.ctx.size > 1 and self._reduce_natively(arr, op, call, dst):
            return
        if self.ctx.rank != dst:  # a schedule reduces in the buffer: not in the caller's
            if self._schedules("reduce", arr.nbytes, arr, op, call, root=dst):
                self._scheduled("reduce", np.array(flat_in(arr)), op, call, root=dst)
                return
        else:
            with flat_out(arr) as flat:
                if self._scheduled("reduce", flat, op, call, root=dst):
                    return
        self._store_reduce(arr, dst, op, call)

    def _reduce_natively(self, arr: np.ndarray, op: ReduceOp, call: Call,
                         root: Optional[int] = None) -> bool:
        """all_reduce of ``arr`` (reduce into ``root``) on the node segment, or as the
        hierarchical plan; ``False`` (nothing done) where neither runs it."""
        lane = self._lane(call)
        if lane is None:
            return self._node_all_reduce(arr, op, call, root)
        with flat_out(arr) as flat:
            lane.run_all_reduce(call, flat, op, -1 if root is None else root)
        return True

    def reduce_scatter(self, output: Any, inputs: List[Any], op: ReduceOp, call: Call) -> None:
        pieces = [flat_in(host_view(t)) for t in inputs]
        self._reduce_scatter(host_view(output), pieces, np.concatenate(pieces), op, call)

    def reduce_scatter_tensor(self, output: Any, tensor: Any, op: ReduceOp, call: Call) -> None:
        src = flat_in(host_view(tensor))
        out = host_view(output)
        n = out.size
        pieces = [src[j * n:(j + 1) * n] for j in range(self.ctx.size)]
        self._reduce_scatter(out, pieces, src, op, call)

    def _reduce_scatter(self, out: np.ndarray, pieces: Sequence[np.ndarray], whole: np.ndarray,
                        op: ReduceOp, call: Call) -> None:
        """``out`` = the reduction of every rank's ``pieces[me]`` (``whole``: the pieces
        back to back, read only)."""
        lane = self._lane(call)
        if lane is not None:
            with flat_out(out) as flat:
                lane.run_reduce_scatter(call, whole, flat, op)
            return
        if all(p.size == out.size for p in pieces) \
                and self._node_reduce_scatter(whole, out, op, call):
            return
        with flat_out(out) as flat:
            self._scheduled_reduce_scatter(pieces, flat, op, call)

    def _scheduled_reduce_scatter(self, pieces: Sequence[np.ndarray], flat: np.ndarray,
                                  op: ReduceOp, call: Call) -> None:
        # parts of one size (every rank knows all sizes alike) run a schedule
        if all(p.size == flat.size and p.dtype == flat.dtype for p in pieces) \
                and self._schedules("reduce_scatter", flat.nbytes * len(pieces), flat, op, call):
            whole = np.concatenate(pieces)  # the schedule reduces in place: a copy
            self._scheduled("reduce_scatter", whole, op, call)
            me, n = self.ctx.rank, flat.size
            np.copyto(flat, whole[me * n:(me + 1) * n])
            return
        self._store_reduce_scatter(pieces, flat, op, call, 0)

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensor: Any, src: int, call: Call) -> None:
        arr = host_view(tensor)
        lane = self._lane(call)
        if lane is not None:
            with flat_out(arr) as flat:
                lane.run_broadcast(call, flat, src)
            return
        if self._node_broadcast(arr, src, call):
            return
        with flat_out(arr) as flat:
            if self._scheduled("broadcast", flat, None, call, root=src):
                return
        self._store_broadcast(arr, src, call)

    def all_gather(self, outputs: List[Any], tensor: Any, call: Call) -> None:
        self._gather(host_view(tensor), [host_view(t) for t in outputs], call)

    def all_gather_into_tensor(self, output: Any, tensor: Any, call: Call) -> None:
        mine = flat_in(host_view(tensor))
        n = mine.size
        lane = self._lane(call)
        with flat_out(host_view(output)) as flat:
            if lane is not None:
                lane.run_all_gather(call, mine, flat, -1)
                return
            outs = [flat[j * n:(j + 1) * n] for j in range(self.ctx.size)]
            self._gather(mine, outs, call)

    def gather(self, tensor: Any, outputs: Optional[List[Any]], dst: int, call: Call) -> None:
        outs = [host_view(t) for t in outputs] if outputs is not None else []
        self._gather(host_view(tensor), outs, call, root=dst)

    def _gather(self, mine: np.ndarray, outs: Sequence[np.ndarray], call: Call,
                root: Optional[int] = None) -> None:
        """all_gather (every rank's ``mine`` into ``outs``) or gather (into ``root``'s)."""
        lane = self._lane(call)
        if lane is not None:
            with ExitStack() as stack:  # each output its own buffer (none off the root)
                flats = ([] if root is not None and self.ctx.rank != root else
                         [stack.enter_context(flat_out(o)) for o in outs])
                lane.run_all_gather(call, flat_in(mine), None, -1 if root is None else root,
                                    flats)
            return
        if root is None and self._node_all_gather(mine, outs, call):
            return
        if root is not None and self._net_gather(mine, outs, call, root):
            return
        if root is None and len(outs) == self.ctx.size \
                and all(o.size == mine.size and o.dtype == mine.dtype for o in outs) \
                and self._schedules("all_gather", mine.nbytes * len(outs), mine, None, call):
            me, n = self.ctx.rank, mine.size
            whole = np.empty(n * self.ctx.size, dtype=mine.dtype)
            whole[me * n:(me + 1) * n] = flat_in(mine)
            self._scheduled("all_gather", whole, None, call)
            for j, o in enumerate(outs):
                copy_into(o, [whole[j * n:(j + 1) * n]])
            return
        self._store_gather(mine, outs, call, 0, root=root)

    def scatter(self, output: Any, inputs: Optional[List[Any]], src: int, call: Call) -> None:
        out = host_view(output)
        arrays = [host_view(t) for t in inputs or []] if self.ctx.rank == src else []
        lane = self._lane(call)
        if lane is not None:
            with flat_out(out) as flat:
                lane.run_scatter(call, [flat_in(a) for a in arrays], flat, src)
            return
        if self._net_scatter(out, arrays, src, call):
            return
        self._store_scatter(out, arrays, src, call)

    def all_to_all(self, outputs: List[Any], inputs: List[Any], call: Call) -> None:
        self._all_to_all([host_view(t) for t in outputs], [host_view(t) for t in inputs], call)

    def all_to_all_single(self, output: Any, tensor: Any, output_splits: List[int],
                          input_splits: List[int], call: Call) -> None:
        src = np.ascontiguousarray(host_view(tensor))
        trailing = tuple(src.shape[1:])
        out = host_view(output)
        lane = self._lane(call)
        if lane is not None:  # the pieces are rows of the one input and output (no copy)
            row = int(np.prod(trailing, dtype=np.int64)) * src.itemsize
            with flat_out(out) as flat:
                lane.run_all_to_all(call, [flat_in(src), flat], _pieces(1, input_splits, row),
                                    _pieces(2, output_splits, row))
            return
        in_off = np.concatenate([[0], np.cumsum(input_splits)]).astype(int)
        ins = [src[in_off[j]:in_off[j + 1]] for j in range(self.ctx.size)]
        with flat_out(out) as flat:
            shaped = flat.reshape((-1,) + trailing) if out.ndim else flat
            out_off = np.concatenate([[0], np.cumsum(output_splits)]).astype(int)
            outs = [shaped[out_off[s]:out_off[s + 1]] for s in range(self.ctx.size)]
            self._all_to_all(outs, ins, call)

    def _all_to_all(self, outs: List[np.ndarray], ins: List[np.ndarray], call: Call) -> None:
        lane = self._lane(call)
        if lane is not None:  # each piece its own buffer
            size = self.ctx.size
            with ExitStack() as stack:
                bufs = [flat_in(a) for a in ins] + [stack.enter_context(flat_out(o))
                                                     for o in outs]
                pieces = [(1 + j, 0, b.nbytes) for j, b in enumerate(bufs)]
                lane.run_all_to_all(call, bufs, pieces[:size], pieces[size:])
            return
        if self._net_all_to_all(outs, ins, call):
            return
        self._store_all_to_all(outs, ins, call)

    def barrier(self, call: Call) -> None:
        # monitored_barrier stays on the coordinator: it reports who is missing, and does not
        # break the group when it times out
        lane = self._lane(call) if call.op == "barrier" else None
        if lane is not None:
            lane.run_barrier(call)
            return
        if call.op == "barrier" and self.ctx.size > 1 \
                and self._scheduled("all_reduce", np.zeros(1, np.uint8), ReduceOp.SUM, call):
            return
        self.ctx.exchange(call, 0, None)

    # ------------------------------------------------------------------ point to point
    #: the group's :class:`~raycoll.transport.pipes.PairPipes` once its point-to-point is on
    #: them (:meth:`ProcessGroup.pair_pipes <raycoll.process_group.ProcessGroup.pair_pipes>`)
    pair_pipes: Optional[PairPipes] = None

    def send(self, tensor: Any, dst: int, tag: int, timeout_s: float) -> Completion:
        arr = host_view(tensor)
        pipes = self.pair_pipes = self.ctx.pair_pipes()
        if pipes is not None:  # straight to the peer
            done = pipes.send(arr, dst, tag, array_meta(arr), timeout_s)

            def finish() -> Optional[int]:
                done()
                return None

            return finish
        # inline: snapshot now, the caller may reuse its buffer before the message is matched
        payload: Payload = (np.array(arr) if arr.nbytes <= self.inline_bytes
                            else self._publish_same(arr, [dst])[dst])
        ref = self.ctx.p2p_send(dst, tag, array_meta(arr), payload, timeout_s)
        group = self.ctx
        if arr.nbytes <= self.inline_bytes:  # a small send completes once posted (as torch's:
            return _posted                   # a send/send exchange does not deadlock)

        def wait() -> Optional[int]:
            group.client.wait(ref, timeout_s, op="send", group=group.group_name,
                              rank=group.global_ranks[group.rank])
            return None

        return wait

    def recv(self, tensor: Any, src: Optional[int], tag: int, timeout_s: float) -> Completion:
        arr = host_view(tensor)
        pipes = self.pair_pipes = self.ctx.pair_pipes()
        if pipes is not None:
            return pipes.recv(arr, src, tag, array_meta(arr), timeout_s)
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


def _posted() -> Optional[int]:
    """A small send through the coordinator: complete once posted (the coordinator keeps the
    message for its receive, which sees any mismatch)."""
    return None


def _pieces(buf: int, splits: Sequence[int], row_bytes: int) -> List[Tuple[int, int, int]]:
    """(buffer, offset, bytes) of consecutive pieces of ``splits`` rows each."""
    out, at = [], 0
    for rows in splits:
        out.append((buf, at, int(rows) * row_bytes))
        at += int(rows) * row_bytes
    return out
