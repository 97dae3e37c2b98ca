"""The cpu backend's gather, scatter and all_to_all on the native executor over a group's
direct connections (a group on several nodes, or ``transport="tcp"``): one call of the core
a collective, each piece a message straight from its array into its destination
(:func:`raycoll.algorithms.native_plans.plan_exchange`), where these once ran as Python rounds.

- **gather**: every rank sends its tensor to the root, which receives each straight into its
  list's array; **scatter** the other way. Every rank's fingerprint holds the shape, dtype
  and root, so a disagreement fails the call as a mismatch (the message's header says so).
- **all_to_all** (lists, and ``all_to_all_single`` with any splits): sizes may differ per
  pair, so the call first exchanges every rank's send and receive shapes with every peer (a
  few bytes a peer, step 0): every rank then checks every pair alike and either all raise
  the same ``CollectiveMismatchError`` (the group goes on) or all move the pieces in step 1.

Each method returns ``False`` (nothing done) where the group has no native direct
connections, the same on every rank; the backend then takes the object store.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from raycoll import errors
from raycoll.algorithms.flat import flat_in, flat_out
from raycoll.tensors import dtype_name
from raycoll.algorithms.native_plans import NativePlan, Piece, plan_exchange
from raycoll.context import Call, GroupContext
from raycoll.coordinator.logic import meta_mismatch

__all__ = ["SocketPaths", "SHAPE_WORDS"]

#: Each piece's shape in the metadata step: its number of dimensions, then up to this many
#: less one dimensions (a piece of more dimensions is described by its element count).
SHAPE_WORDS = 8
#: The buffer ids of :meth:`NativeSockets.run <raycoll.transport.native_tcp.NativeSockets.run>`:
#: the first array, the scratch (what empty messages name), then the caller's others.
_FIRST, _SCRATCH, _MORE = 0, 1, 2
#: An empty message to or from every peer (:meth:`SocketPaths._dense`).
_EMPTY: List[Piece] = []


class SocketPaths:
    """The native direct-connection paths of :class:`~raycoll.backends.cpu.ObjstoreBackend`
    (a base class of it: they read its group context)."""

    ctx: GroupContext

    def _run_exchange(self, plane: Any, call: Call, plan: NativePlan, first: np.ndarray,
                      more: Sequence[np.ndarray]) -> None:
        plane.run(call, plan, first, (0, 0), None, more)
        self.ctx.note_rounds(call, plan.rounds, "direct")

    def _net_gather(self, mine: np.ndarray, outs: Sequence[np.ndarray], call: Call,
                    root: int) -> bool:
        """gather of ``mine`` into ``root``'s list ``outs``."""
        plane = self.ctx.native_sockets(call)
        if plane is None:
            return False
        me, size = self.ctx.rank, self.ctx.size
        src = flat_in(mine)
        n = src.nbytes
        if me != root:
            sends = [(j, _FIRST if j == root else _SCRATCH, 0, n if j == root else 0)
                     for j in range(size) if j != me]
            self._dense(plane, call, sends, _EMPTY, [], src, ())
            return True
        with ExitStack() as stack:  # each output its own buffer
            flats = [stack.enter_context(flat_out(o)) for o in outs]
            recvs = [(j, _MORE + j, 0, n) for j in range(size) if j != me]
            self._dense(plane, call, _EMPTY, recvs, [(_MORE + me, 0, _FIRST, 0, n)], src, flats)
        return True

    def _net_scatter(self, out: np.ndarray, pieces: Sequence[np.ndarray], src: int,
                     call: Call) -> bool:
        """scatter of ``src``'s ``pieces`` into every rank's ``out``."""
        size = self.ctx.size
        plane = self.ctx.native_sockets(call)
        if plane is None:
            return False
        me = self.ctx.rank
        with flat_out(out) as flat:
            n = flat.nbytes
            if me != src:
                recvs = [(j, _FIRST if j == src else _SCRATCH, 0, n if j == src else 0)
                         for j in range(size) if j != me]
                self._dense(plane, call, _EMPTY, recvs, [], flat, ())
                return True
            ins = [flat_in(p) for p in pieces]
            sends = [(j, _MORE + j, 0, n) for j in range(size) if j != me]
            self._dense(plane, call, sends, _EMPTY, [(_FIRST, 0, _MORE + me, 0, n)], flat, ins)
        return True

    def _dense(self, plane: Any, call: Call, sends: Sequence[Piece], recvs: Sequence[Piece],
               local: Sequence[Tuple[int, int, int, int, int]], first: np.ndarray,
               more: Sequence[np.ndarray]) -> None:
        """One step in which every rank sends every peer a message and reads every peer's
        (``_EMPTY`` for ``sends`` or ``recvs``: empty ones to or from every peer): every rank
        then meets every other's call, so a rank that rejected its arguments, or holds a
        different call, fails the call on every rank alike."""
        peers = [j for j in range(self.ctx.size) if j != self.ctx.rank]
        if sends is _EMPTY:
            sends = [(j, _SCRATCH, 0, 0) for j in peers]
        if recvs is _EMPTY:
            recvs = [(j, _SCRATCH, 0, 0) for j in peers]
        plan = plan_exchange(self.ctx.rank, sends, recvs, local)
        self._run_exchange(plane, call, plan, first, more)

    def _net_all_to_all(self, outs: List[np.ndarray], ins: List[np.ndarray],
                        call: Call) -> bool:
        """all_to_all of lists, and all_to_all_single's pieces (views of its rows): each
        piece its own buffer."""
        plane = self.ctx.native_sockets(call)
        if plane is None:
            return False
        self._check_pairs(plane, call, [a.shape for a in ins], [a.shape for a in outs],
                          outs[0].dtype)
        me, size = self.ctx.rank, self.ctx.size
        with ExitStack() as stack:
            flats = [stack.enter_context(flat_out(o)) for o in outs]
            srcs = [flat_in(a) for a in ins]
            sends = [(j, _MORE + j, 0, srcs[j].nbytes) for j in range(size) if j != me]
            recvs = [(s, _MORE + size + s, 0, flats[s].nbytes) for s in range(size) if s != me]
            own = [(_MORE + size + me, 0, _MORE + me, 0, srcs[me].nbytes)]
            plan = plan_exchange(me, sends, recvs, own, step=1)
            self._run_exchange(plane, call, plan, np.empty(0, np.uint8), srcs + flats)
        return True

    def _check_pairs(self, plane: Any, call: Call, send: Sequence[Tuple[int, ...]],
                     recv: Sequence[Tuple[int, ...]], dtype: np.dtype) -> None:
        """Step 0 of an all_to_all: every rank's send and receive shapes to every peer; raise
        ``CollectiveMismatchError`` (on every rank alike) where a pair disagrees."""
        me, size = self.ctx.rank, self.ctx.size
        mine = np.concatenate([_encode(send), _encode(recv)])
        theirs = np.zeros((size, mine.size), dtype=np.int64)
        theirs[me] = mine
        n = mine.nbytes
        peers = [j for j in range(size) if j != me]
        plan = plan_exchange(me, [(j, _FIRST, 0, n) for j in peers],
                             [(j, _MORE + j, 0, n) for j in peers], [])
        plane.run(call, plan, mine, (0, 0), None, list(theirs))
        half, name = size * SHAPE_WORDS, dtype_name(dtype)
        sends: Dict[int, Optional[List[Any]]] = {
            s: [(name, shape) for shape in _decode(theirs[s, :half])] for s in range(size)}
        recvs: Dict[int, Optional[List[Any]]] = {
            r: [(name, shape) for shape in _decode(theirs[r, half:])] for r in range(size)}
        problem = meta_mismatch(sends, recvs, self.ctx.global_ranks)
        if problem:
            raise errors.CollectiveMismatchError(
                f"{call.op} #{call.seq} on group {self.ctx.group_name!r}: {problem}",
                **self.ctx.ctx(call))


def _encode(shapes: Sequence[Tuple[int, ...]]) -> np.ndarray:
    """Shapes as ``SHAPE_WORDS`` int64 each: the dimensions' count, then the dimensions (one,
    the element count, where there are too many)."""
    out = np.zeros((len(shapes), SHAPE_WORDS), dtype=np.int64)
    for i, shape in enumerate(shapes):
        dims = tuple(shape) if len(shape) < SHAPE_WORDS else (int(np.prod(shape)),)
        out[i, 0] = len(dims)
        out[i, 1:1 + len(dims)] = dims
    return out.reshape(-1)


def _decode(words: np.ndarray) -> List[Tuple[int, ...]]:
    rows = words.reshape(-1, SHAPE_WORDS)
    return [tuple(int(d) for d in row[1:1 + int(row[0])]) for row in rows]
