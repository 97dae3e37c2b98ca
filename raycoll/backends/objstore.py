"""The object-store backend: CPU arrays through Ray's shared-memory object store.

Small payloads travel inline in the coordinator call (one round trip; the coordinator reduces
small ``all_reduce`` payloads itself). Large payloads are ``ray.put`` once and exchanged as
object references; peers read them with ``ray.get`` (zero-copy on the same node) and reduce
straight into the output buffer. Reductions are bandwidth-optimal: reduce-scatter (each rank
reduces one chunk, reading only that chunk of every peer) then all-gather of the reduced
chunks, so each rank moves about 2(W-1)/W of the data and no rank pulls a chunk it does not
need. Objects are owned by the rank that put them and released as soon as the readers are
done (Ray's reference counting), so object-store memory returns to its baseline after every
collective; peak use is about one input's size per rank.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Sequence

import numpy as np
import ray

from raycoll import errors
from raycoll.backends.base import Call, CollectiveBackend, Completion, GroupContext, chunk_bounds
from raycoll.reduce_op import ReduceOp, combine, finalize
from raycoll.tensors import host_view

__all__ = ["ObjstoreBackend", "INLINE_BYTES"]

#: Payloads up to this size travel inline in the coordinator call instead of ``ray.put``.
INLINE_BYTES = 64 * 1024

_LOST = (
    ray.exceptions.OwnerDiedError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.ObjectFetchTimedOutError,
    ray.exceptions.ObjectReconstructionFailedError,
)


def _meta(arr: np.ndarray) -> Any:
    return (arr.dtype.name, tuple(arr.shape))


@contextmanager
def _flat_out(arr: np.ndarray) -> Iterator[np.ndarray]:
    """A flat, writable, contiguous view of ``arr`` (via a temporary copied back if needed)."""
    if arr.flags.c_contiguous:
        yield arr.reshape(-1)
        return
    tmp = np.ascontiguousarray(arr)
    yield tmp.reshape(-1)
    np.copyto(arr, tmp)


def _flat_in(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr).reshape(-1)


class ObjstoreBackend(CollectiveBackend):
    """CPU collectives through the Ray object store, driven by the coordinator."""

    devices = ("cpu",)

    def __init__(self, ctx: GroupContext) -> None:
        super().__init__(ctx)
        self.inline_bytes = int(ctx.options.get("inline_bytes", INLINE_BYTES))

    # ------------------------------------------------------------------ data plane helpers
    def _pub(self, arr: np.ndarray) -> Any:
        """A payload for ``arr``: the array itself when small, else an object reference."""
        if arr.nbytes <= self.inline_bytes:
            return arr
        return ray.put(arr)

    def _get(self, payload: Any, call: Call, src: int) -> np.ndarray:
        """The array behind a payload from group rank ``src`` (read-only when from the store)."""
        if not isinstance(payload, ray.ObjectRef):
            return payload
        ctx = self.ctx
        who = ctx.global_ranks[src]
        try:
            return ray.get(payload, timeout=call.timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise errors.DistTimeoutError(
                f"{call.op} #{call.seq} on group {ctx.group_name!r}: reading rank {who}'s data "
                f"took longer than {call.timeout_s:g}s", missing=[who], **ctx.ctx(call)
            ) from exc
        except _LOST as exc:
            err = errors.RankFailedError(
                f"{call.op} #{call.seq} on group {ctx.group_name!r}: rank {who}'s data is lost "
                f"(its actor died: {type(exc).__name__})", failed_ranks=[who], **ctx.ctx(call)
            )
            ctx.fail(err)
            raise err from exc

    def _reduce_scatter_step(self, pieces: Sequence[np.ndarray], out: np.ndarray, op: ReduceOp,
                             call: Call, step: int) -> List[Any]:
        """Send ``pieces[j]`` to rank j; reduce what every rank sent us, plus ours, into ``out``.

        Returns our published payloads: keep them referenced until the peers are done.
        """
        me, size = self.ctx.rank, self.ctx.size
        sent = [None if j == me else self._pub(pieces[j]) for j in range(size)]
        got = self.ctx.exchange(call, step, sent)
        if not np.shares_memory(out, pieces[me]):
            np.copyto(out, pieces[me])
        for s in range(size):
            if s != me:
                combine(op, out, self._get(got[s], call, s))
        finalize(op, out, size)
        return sent

    def _all_gather_step(self, mine: np.ndarray, outs: Sequence[np.ndarray], call: Call,
                         step: int, root: Optional[int] = None) -> None:
        """Every rank's ``mine`` lands in ``outs[rank]`` (only on ``root``, when given)."""
        me, size = self.ctx.rank, self.ctx.size
        payload = self._pub(mine)
        sent = [None if j == me or (root is not None and j != root) else payload
                for j in range(size)]
        got = self.ctx.exchange(call, step, sent)
        if root is not None and me != root:
            return
        for s in range(size):
            if s == me:
                if not np.shares_memory(outs[s], mine):
                    np.copyto(outs[s], mine.reshape(outs[s].shape))
            else:
                np.copyto(outs[s], self._get(got[s], call, s).reshape(outs[s].shape))

    # ------------------------------------------------------------------ reductions
    def all_reduce(self, tensor: Any, op: ReduceOp, call: Call) -> None:
        arr = host_view(tensor)
        with _flat_out(arr) as flat:
            if flat.nbytes <= self.inline_bytes or self.ctx.size == 1:
                np.copyto(flat, self.ctx.exchange(call, 0, flat, mode="reduce"))
                return
            bounds = chunk_bounds(flat.size, self.ctx.size)
            chunks = [flat[bounds[j]:bounds[j + 1]] for j in range(self.ctx.size)]
            me = self.ctx.rank
            sent = self._reduce_scatter_step(chunks, chunks[me], op, call, 0)
            self._all_gather_step(chunks[me], chunks, call, 1)
            del sent

    def reduce(self, tensor: Any, dst: int, op: ReduceOp, call: Call) -> None:
        arr = host_view(tensor)
        me = self.ctx.rank
        if arr.nbytes <= self.inline_bytes or self.ctx.size == 1:
            result = self.ctx.exchange(call, 0, _flat_in(arr), mode="reduce", root=dst)
            if me == dst:
                with _flat_out(arr) as flat:
                    np.copyto(flat, result)
            return
        src = _flat_in(arr)
        bounds = chunk_bounds(src.size, self.ctx.size)
        chunks = [src[bounds[j]:bounds[j + 1]] for j in range(self.ctx.size)]
        if me == dst:
            with _flat_out(arr) as flat:
                outs = [flat[bounds[j]:bounds[j + 1]] for j in range(self.ctx.size)]
                sent = self._reduce_scatter_step(chunks, outs[me], op, call, 0)
                self._all_gather_step(outs[me], outs, call, 1, root=dst)
        else:
            mine = np.empty_like(chunks[me])
            sent = self._reduce_scatter_step(chunks, mine, op, call, 0)
            self._all_gather_step(mine, [], call, 1, root=dst)
        del sent

    def reduce_scatter(self, output: Any, inputs: List[Any], op: ReduceOp, call: Call) -> None:
        out = host_view(output)
        pieces = [_flat_in(host_view(t)) for t in inputs]
        with _flat_out(out) as flat:
            sent = self._reduce_scatter_step(pieces, flat, op, call, 0)
        del sent

    def reduce_scatter_tensor(self, output: Any, tensor: Any, op: ReduceOp, call: Call) -> None:
        src = _flat_in(host_view(tensor))
        out = host_view(output)
        n = out.size
        pieces = [src[j * n:(j + 1) * n] for j in range(self.ctx.size)]
        with _flat_out(out) as flat:
            sent = self._reduce_scatter_step(pieces, flat, op, call, 0)
        del sent

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensor: Any, src: int, call: Call) -> None:
        arr = host_view(tensor)
        me = self.ctx.rank
        if me == src:
            payload = self._pub(_flat_in(arr))
            self.ctx.exchange(call, 0, [None if j == me else payload for j in range(self.ctx.size)])
            return
        got = self.ctx.exchange(call, 0, None)
        with _flat_out(arr) as flat:
            np.copyto(flat, self._get(got[src], call, src).reshape(-1))

    def all_gather(self, outputs: List[Any], tensor: Any, call: Call) -> None:
        mine = host_view(tensor)
        outs = [host_view(t) for t in outputs]
        self._all_gather_step(mine, outs, call, 0)

    def all_gather_into_tensor(self, output: Any, tensor: Any, call: Call) -> None:
        mine = _flat_in(host_view(tensor))
        n = mine.size
        with _flat_out(host_view(output)) as flat:
            outs = [flat[j * n:(j + 1) * n] for j in range(self.ctx.size)]
            self._all_gather_step(mine, outs, call, 0)

    def gather(self, tensor: Any, outputs: Optional[List[Any]], dst: int, call: Call) -> None:
        mine = host_view(tensor)
        outs = [host_view(t) for t in outputs] if outputs is not None else []
        self._all_gather_step(mine, outs, call, 0, root=dst)

    def scatter(self, output: Any, inputs: Optional[List[Any]], src: int, call: Call) -> None:
        out = host_view(output)
        me = self.ctx.rank
        if me == src:
            arrays = [host_view(t) for t in inputs or []]
            sent = [None if j == me else self._pub(arrays[j]) for j in range(self.ctx.size)]
            self.ctx.exchange(call, 0, sent)
            np.copyto(out, arrays[me].reshape(out.shape))
            return
        got = self.ctx.exchange(call, 0, None)
        np.copyto(out, self._get(got[src], call, src).reshape(out.shape))

    def all_to_all(self, outputs: List[Any], inputs: List[Any], call: Call) -> None:
        ins = [host_view(t) for t in inputs]
        outs = [host_view(t) for t in outputs]
        self._all_to_all(outs, ins, [_meta(a) for a in ins], [_meta(a) for a in outs], call)

    def all_to_all_single(self, output: Any, tensor: Any, output_splits: List[int],
                          input_splits: List[int], call: Call) -> None:
        src = host_view(tensor)
        src = np.ascontiguousarray(src)
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
        me = self.ctx.rank
        sent = [None if j == me else self._pub(ins[j]) for j in range(self.ctx.size)]
        got = self.ctx.exchange(call, 0, sent, send_meta=send_meta, recv_meta=recv_meta)
        np.copyto(outs[me], ins[me].reshape(outs[me].shape))
        for s in range(self.ctx.size):
            if s != me:
                np.copyto(outs[s], self._get(got[s], call, s).reshape(outs[s].shape))

    def barrier(self, call: Call) -> None:
        self.ctx.exchange(call, 0, None)

    # ------------------------------------------------------------------ point to point
    def send(self, tensor: Any, dst: int, tag: int, timeout_s: float) -> Completion:
        arr = host_view(tensor)
        payload = self._pub(np.ascontiguousarray(arr))
        if payload is arr:  # inline: snapshot now, the caller may reuse its buffer
            payload = arr.copy()
        ref = self.ctx.p2p_send(dst, tag, _meta(arr), payload, timeout_s)
        group = self.ctx

        def wait() -> Optional[int]:
            group.client.wait(ref, timeout_s, op="send", group=group.group_name,
                              rank=group.global_ranks[group.rank])
            return None

        return wait

    def recv(self, tensor: Any, src: Optional[int], tag: int, timeout_s: float) -> Completion:
        arr = host_view(tensor)
        ref = self.ctx.p2p_recv(src, tag, _meta(arr), timeout_s)
        call = Call("recv", -1, timeout_s)

        def wait() -> Optional[int]:
            sender, payload = self.ctx.client.wait(
                ref, timeout_s, op="recv", group=self.ctx.group_name,
                rank=self.ctx.global_ranks[self.ctx.rank])
            np.copyto(arr, self._get(payload, call, sender).reshape(arr.shape))
            return int(sender)

        return wait
