"""The cpu backend's collectives on a node segment: every rank on one node, run natively
(:mod:`raycoll.transport.segment`, plans in :mod:`raycoll.algorithms.segment_plans`).

Each method returns ``False`` (nothing done) when the group has no node segment (the same on
every rank: the group's first collective decides); the backend then takes its other paths.
They take the user's arrays as they come (numpy views of torch tensors too) and hand the
core flat, contiguous buffers, one for each array of a list (a non-contiguous one goes
through a temporary).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from raycoll.algorithms.flat import flat_in, flat_out
from raycoll.context import Call, GroupContext
from raycoll.reduce_op import ReduceOp

__all__ = ["SegmentPaths"]


class SegmentPaths:
    """The node-segment paths of :class:`~raycoll.backends.cpu.ObjstoreBackend` (a base class
    of it: they read its group context)."""

    ctx: GroupContext

    def _segment(self, call: Call) -> Any:
        """The group's node segment (set up in ``call`` if this is its first collective), or
        ``None`` where it has none (the same on every rank)."""
        return self.ctx.native_lane(call)

    def _seg_all_reduce(self, arr: np.ndarray, op: ReduceOp, call: Call,
                        root: int = -1) -> bool:
        lane = self._segment(call)
        if lane is None:
            return False
        with flat_out(arr) as flat:
            lane.run_all_reduce(call, flat, op, root)
        return True

    def _seg_reduce_scatter(self, whole: np.ndarray, out: np.ndarray, op: ReduceOp,
                            call: Call) -> bool:
        lane = self._segment(call)
        if lane is None:
            return False
        with flat_out(out) as flat:
            lane.run_reduce_scatter(call, whole, flat, op)
        return True

    def _seg_broadcast(self, arr: np.ndarray, src: int, call: Call) -> bool:
        lane = self._segment(call)
        if lane is None:
            return False
        with flat_out(arr) as flat:
            lane.run_broadcast(call, flat, src)
        return True

    def _seg_gather(self, mine: np.ndarray, outs: Sequence[np.ndarray], call: Call,
                    root: Optional[int]) -> bool:
        """all_gather (``root=None``) or gather of ``mine`` into the list ``outs``."""
        lane = self._segment(call)
        if lane is None:
            return False
        src = flat_in(mine)
        if root is not None and self.ctx.rank != root:
            lane.run_all_gather(call, src, None, root)
            return True
        with ExitStack() as stack:  # each output its own buffer
            flats = [stack.enter_context(flat_out(o)) for o in outs]
            lane.run_all_gather(call, src, None, -1 if root is None else root, flats)
        return True

    def _seg_gather_into(self, mine: np.ndarray, output: np.ndarray, call: Call) -> bool:
        lane = self._segment(call)
        if lane is None:
            return False
        with flat_out(output) as flat:
            lane.run_all_gather(call, flat_in(mine), flat, -1)
        return True

    def _seg_scatter(self, out: np.ndarray, inputs: Optional[List[Any]], src: int,
                     call: Call, view: Any) -> bool:
        lane = self._segment(call)
        if lane is None:
            return False
        pieces = [flat_in(view(t)) for t in inputs or []] if self.ctx.rank == src else []
        with flat_out(out) as flat:
            lane.run_scatter(call, pieces, flat, src)
        return True

    def _seg_all_to_all(self, outs: List[np.ndarray], ins: List[np.ndarray], call: Call) -> bool:
        """all_to_all of lists: each piece its own buffer (no copy but a non-contiguous
        output's temporary)."""
        lane = self._segment(call)
        if lane is None:
            return False
        size = self.ctx.size
        with ExitStack() as stack:
            flats = [stack.enter_context(flat_out(o)) for o in outs]
            bufs = [_bytes(flat_in(a)) for a in ins] + [_bytes(f) for f in flats]
            sends = [(1 + j, 0, bufs[j].nbytes) for j in range(size)]
            recvs = [(1 + size + s, 0, bufs[size + s].nbytes) for s in range(size)]
            lane.run_all_to_all(call, bufs, sends, recvs)
        return True

    def _seg_all_to_all_single(self, out: np.ndarray, src: np.ndarray, row_bytes: int,
                               output_splits: Sequence[int], input_splits: Sequence[int],
                               call: Call) -> bool:
        """all_to_all_single: the pieces are rows of the one input and output (no copy)."""
        lane = self._segment(call)
        if lane is None:
            return False
        with flat_out(out) as flat:
            sends = _pieces(1, input_splits, row_bytes)
            recvs = _pieces(2, output_splits, row_bytes)
            lane.run_all_to_all(call, [_bytes(flat_in(src)), _bytes(flat)], sends, recvs)
        return True

    def _seg_barrier(self, call: Call) -> bool:
        lane = self._segment(call)
        if lane is None:
            return False
        lane.run_barrier(call)
        return True


def _bytes(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a contiguous array."""
    return arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)


def _pieces(buf: int, splits: Sequence[int], row_bytes: int) -> List[Tuple[int, int, int]]:
    """(buffer, offset, bytes) of consecutive pieces of ``splits`` rows each."""
    out, at = [], 0
    for rows in splits:
        out.append((buf, at, int(rows) * row_bytes))
        at += int(rows) * row_bytes
    return out
