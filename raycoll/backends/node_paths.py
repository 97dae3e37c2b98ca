"""The cpu backend's hierarchical paths for a group on several nodes: the node segment
inside each node and sockets between nodes, in one plan run by one call of the native
executor (:mod:`raycoll.algorithms.node_plans`, :mod:`raycoll.transport.node_segment`):
all_reduce, reduce, reduce_scatter, broadcast and all_gather.

**The rule** (the same on every rank, from what they all agree on): a collective takes its
hierarchical plan where the group may have node segments (``node_segment_possible``: the
native core on every rank, several nodes, ``transport="auto"``, a node with 2+ of its
ranks), the buffer is not empty (a broadcast: at least ``NODE_BROADCAST_BYTES``), the core
reduces the op and dtype, and no algorithm is forced for the collective (a forced one runs
as the socket schedule it names). Measured (benchmarks/BENCHMARKS.md, "Node segments on
several nodes": the plan against the socket schedule the cost model picks, same actors,
same run, 2 + 2 and 3 + 1 ranks): 1.04-1.12x at 4 B, even at 1 MiB (0.97-1.25x), 1.5-2.2x
at 64 MiB for all_reduce; all_gather 1.0-7.4x. It is a measured rule rather than the cost
model's choice because the model's defaults price a message as the Python transports'
(tens of microseconds) and every step a wake-up on this machine, which puts the one-step
direct exchange below the plan's two steps at 4 B, against the measurement; once the model
is recalibrated for the native executor (issue 43, item 4) the plan becomes a catalog entry
it prices.

The node segments are set up inside the first collective that takes the path. Each method
returns ``False`` (nothing done, the same on every rank) where the path is not taken; the
backend then takes its other paths.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np

from raycoll.algorithms import node_plans
from raycoll.algorithms.flat import flat_in, flat_out
from raycoll.context import Call, GroupContext
from raycoll.native import core, dtype_code, op_code
from raycoll.reduce_op import ReduceOp
from raycoll.transport.node_segment import (NodeSegment, node_segment_possible,
                                            set_up_node_segment)

__all__ = ["NodePaths", "NODE_ALGORITHM", "NODE_BROADCAST_BYTES"]

#: The algorithm's name in ``last_route`` and ``group_status``.
NODE_ALGORITHM = "node_hierarchical"
#: A broadcast smaller than this keeps the socket schedule: the root's sends do not wait for
#: their readers there, while every segment step waits for every rank of its node (2 + 2
#: ranks, back to back, on a loaded machine: node-aware 0.18x the sockets at 4 B, 0.21x at
#: 64 KiB, 0.67x at 256 KiB; 1.12x at 1 MiB, 1.6-4.1x at 64 MiB: BENCHMARKS.md).
NODE_BROADCAST_BYTES = 1 << 20


class NodePaths:
    """The hierarchical paths of :class:`~raycoll.backends.cpu.ObjstoreBackend` (a base class
    of it: they read its group context, its cost model and its forced algorithms)."""

    ctx: GroupContext
    forced: Dict[str, Optional[str]]

    #: the group's node segments: ``None`` until set up, ``False`` where it has none
    _node: Any = None

    if TYPE_CHECKING:  # (ScheduledAlgorithms's, later in the backend's bases)
        def algorithm(self, collective: str, nbytes: int, itemsize: int,
                      root: int = 0) -> str: ...

    def _node_plane(self, call: Call, collective: str, nbytes: int, itemsize: int) -> Any:
        """The group's sockets and node segments if ``collective`` of ``nbytes`` takes the
        hierarchical path (set up in ``call`` the first time), else ``None``."""
        ctx = self.ctx
        if self._node is False or nbytes == 0 or self.forced.get(collective) is not None \
                or not node_segment_possible(ctx):
            return None
        plane = ctx.sparse_transport(call)
        if plane is None or getattr(plane, "native", None) is None:
            return None
        if self._node is None:
            self._node = set_up_node_segment(ctx, call) or False
            if self._node is False:
                return None
        return plane

    def _reduce_plane(self, call: Call, collective: str, out: np.ndarray, nbytes: int,
                      op: ReduceOp) -> Any:
        """:meth:`_node_plane` for a reducing ``collective`` into ``out`` (``nbytes`` a
        rank): ``None`` also on fewer than 3 ranks or where the core does not reduce
        ``out``'s dtype with ``op``."""
        if self.ctx.size < 3 or not _reduces(out, op):
            return None
        return self._node_plane(call, collective, nbytes, out.itemsize)

    def _node_all_reduce(self, arr: np.ndarray, op: ReduceOp, call: Call,
                         dst: Optional[int] = None) -> bool:
        """all_reduce of ``arr`` with ``op`` as one hierarchical plan; a reduce into ``dst``
        is the same plan (on a copy on the other ranks: their buffers stay as they were)."""
        plane = self._reduce_plane(call, "all_reduce" if dst is None else "reduce", arr,
                                   arr.nbytes, op)
        if plane is None:
            return False
        node: NodeSegment = self._node
        with flat_out(arr) if dst is None or self.ctx.rank == dst else _copy(arr) as flat:
            plan = node_plans.all_reduce(flat.size, flat.itemsize, self.ctx.node_ids,
                                         self.ctx.rank, node.half, _finishes(op))
            self._node_run(plane, call, plan, flat, (), plane.native.codes(flat, op), op)
        return True

    def _node_reduce(self, arr: np.ndarray, dst: int, op: ReduceOp, call: Call) -> bool:
        """reduce of ``arr`` into ``dst`` as the hierarchical all_reduce plan."""
        return self._node_all_reduce(arr, op, call, dst)

    def _node_reduce_scatter(self, whole: np.ndarray, out: np.ndarray, op: ReduceOp,
                             call: Call) -> bool:
        """reduce_scatter of ``whole`` (one piece a rank) into ``out`` as one node-aware
        plan."""
        if whole.size != out.size * self.ctx.size or whole.dtype != out.dtype:
            return False
        plane = self._reduce_plane(call, "reduce_scatter", out, whole.nbytes, op)
        if plane is None:
            return False
        node: NodeSegment = self._node
        src = flat_in(whole)
        with flat_out(out) as flat:
            plan = node_plans.reduce_scatter(flat.size, flat.itemsize, self.ctx.node_ids,
                                             self.ctx.rank, node.half, _finishes(op))
            self._node_run(plane, call, plan, src, (flat,), plane.native.codes(flat, op), op)
        return True

    def _node_broadcast(self, arr: np.ndarray, src: int, call: Call) -> bool:
        """broadcast of ``arr`` from ``src`` as one node-aware plan."""
        if arr.nbytes < NODE_BROADCAST_BYTES:
            return False
        plane = self._node_plane(call, "broadcast", arr.nbytes, arr.itemsize)
        if plane is None:
            return False
        node: NodeSegment = self._node
        plan = node_plans.broadcast(arr.nbytes, self.ctx.node_ids, self.ctx.rank, src,
                                    node.half)
        with flat_out(arr) as flat:
            self._node_run(plane, call, plan, flat, ())
        return True

    def _node_all_gather(self, mine: np.ndarray, outs: Sequence[np.ndarray],
                         call: Call) -> bool:
        """all_gather of ``mine`` into the list ``outs`` (each its own buffer) as one
        node-aware plan."""
        if len(outs) != self.ctx.size or any(o.size != mine.size or o.dtype != mine.dtype
                                             for o in outs):
            return False
        plane = self._node_plane(call, "all_gather", mine.nbytes * len(outs), mine.itemsize)
        if plane is None:
            return False
        node: NodeSegment = self._node
        plan = node_plans.all_gather(mine.nbytes, self.ctx.node_ids, self.ctx.rank, node.half,
                                     True)
        with ExitStack() as stack:
            flats = [stack.enter_context(flat_out(o)) for o in outs]
            self._node_run(plane, call, plan, flat_in(mine), flats)
        return True

    def _node_run(self, plane: Any, call: Call, plan: Any, flat: np.ndarray,
                  more: Sequence[np.ndarray], codes: Tuple[int, int] = (0, 0),
                  op: Optional[ReduceOp] = None) -> None:
        """Run a hierarchical ``plan`` on the group's sockets and node segment."""
        plane.native.run(call, plan, flat, codes, op, more, node=self._node)
        plane._done = (call.op, call.seq)
        plane.calls += 1
        plane.report()
        self.ctx.note_algorithm(call.op, NODE_ALGORITHM)
        self.ctx.note_rounds(call, plan.rounds, NODE_ALGORITHM)

    def close(self) -> None:
        """Unmap this rank's node segment, then release the rest."""
        if self._node:
            self._node.close()
        self._node = False
        super().close()  # type: ignore[misc]


def _finishes(op: ReduceOp) -> bool:
    """Whether ``op`` has a final step after the sums (AVG's division, PREMUL_SUM's factor)."""
    return op.name in ("AVG", "PREMUL_SUM")


def _reduces(arr: np.ndarray, op: ReduceOp) -> bool:
    """Whether the core reduces ``arr``'s dtype with ``op`` (as the sockets' runs check it;
    alike on every rank: dtype and op are in the fingerprint)."""
    if core is None:
        return False
    code = dtype_code(arr.dtype)
    if code is None or (arr.dtype.kind == "c" and op.name != "SUM"):
        return False
    return bool(core.supported(code, op_code(op.name)))


@contextmanager
def _copy(arr: np.ndarray) -> Iterator[np.ndarray]:
    """A flat copy of ``arr`` (what a rank other than a reduce's root reduces in)."""
    yield np.array(flat_in(arr)).reshape(-1)
