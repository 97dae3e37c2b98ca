"""The cpu backend's hierarchical paths for a group on several nodes: the node segment
inside each node and sockets between nodes, in one plan run by one call of the native
executor (:mod:`raycoll.algorithms.node_plans`, :mod:`raycoll.transport.node_segment`):
all_reduce, reduce, reduce_scatter, broadcast and all_gather.

**The choice** (the same on every rank, from what they all agree on): a collective may take
its hierarchical plan where the group may have node segments (``node_segment_possible``:
the native core on every rank, several nodes, ``transport="auto"``, a node with 2+ of its
ranks), the core reduces the op and dtype, and no algorithm is forced for the collective (a
forced one runs as the socket schedule it names); it takes it where the planner
(:func:`raycoll.algorithms.planner.node_plan_wins`) prices the plan at most the cheapest
flat socket schedule, with the group's cost model (option ``cost_model``: its ``segment``
and ``socket`` link classes). With the defaults it picks what was measured
(benchmarks/BENCHMARKS.md, "Node segments on several nodes", 2 + 2 ranks: the plan for
all_reduce at 4 B, 1 MiB and 64 MiB, for all_gather, and for a broadcast from 1 MiB; "The
planner": 3 + 1 all_reduce from 8 MiB). A broadcast's plan on 3+ nodes is a star or a tree
over the nodes, as :func:`raycoll.algorithms.planner.broadcast_tree` prices them.

The node segments are set up inside the first collective that takes the path. Each method
returns ``False`` (nothing done, the same on every rank) where the path is not taken; the
backend then takes its other paths.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Dict, Hashable, Iterator, Optional, Sequence, Tuple

import numpy as np

from raycoll.algorithms import node_plans
from raycoll.algorithms.cost import CostModel
from raycoll.algorithms.planner import (NODE_BROADCAST_BYTES, NODE_PLAN, Cores,
                                        broadcast_tree, node_plan_wins)
from raycoll.algorithms.flat import flat_in, flat_out
from raycoll.context import Call, GroupContext
from raycoll.native import core, dtype_code, op_code
from raycoll.reduce_op import ReduceOp
from raycoll.transport.node_segment import (NodeSegment, node_segment_possible,
                                            set_up_node_segment)
from raycoll.transport.segment import _half_bytes

__all__ = ["NodePaths", "NODE_ALGORITHM", "NODE_BROADCAST_BYTES"]

#: The algorithm's name in ``last_route`` and ``group_status`` (``NODE_BROADCAST_BYTES``:
#: the planner's, :mod:`raycoll.algorithms.planner` says why).
NODE_ALGORITHM = NODE_PLAN


class NodePaths:
    """The hierarchical paths of :class:`~raycoll.backends.cpu.ObjstoreBackend` (a base class
    of it: they read its group context, its cost model and its forced algorithms)."""

    ctx: GroupContext
    forced: Dict[str, Optional[str]]
    cost_model: CostModel

    #: the group's node segments: ``None`` until set up, ``False`` where it has none
    _node: Any = None
    #: the planner's answers: (collective, bytes, itemsize, root, half) -> the plan wins
    _node_wins: Optional[Dict[Tuple[str, int, int, int, int], bool]] = None

    if TYPE_CHECKING:  # (ScheduledAlgorithms's, later in the backend's bases)
        def algorithm(self, collective: str, nbytes: int, itemsize: int,
                      root: int = 0) -> str: ...

        def _machines(self) -> Tuple[Tuple[Hashable, ...], Cores]: ...

    def _node_plane(self, call: Call, collective: str, nbytes: int, itemsize: int,
                    root: int = 0) -> Any:
        """The group's sockets and node segments if ``collective`` of ``nbytes`` takes the
        hierarchical path (set up in ``call`` the first time), else ``None``."""
        ctx = self.ctx
        if self._node is False or nbytes == 0 or self.forced.get(collective) is not None \
                or not node_segment_possible(ctx) \
                or not self._planned(collective, nbytes, itemsize, root):
            return None
        plane = ctx.native_sockets(call)
        if plane is None:
            return None
        if self._node is None:
            self._node = set_up_node_segment(ctx, call) or False
            if self._node is False:
                return None
        return plane

    def _planned(self, collective: str, nbytes: int, itemsize: int, root: int) -> bool:
        """The planner's answer: ``collective`` of ``nbytes`` takes its hierarchical plan
        (priced with the segments' half once set up, the option's before: the same on every
        rank)."""
        half = self._node.half if self._node else _half_bytes(self.ctx)
        if self._node_wins is None:
            self._node_wins = {}
        key = (collective, nbytes, itemsize, root, half)
        wins = self._node_wins.get(key)
        if wins is None:
            if len(self._node_wins) > 256:
                self._node_wins.clear()
            hosts, cores = self._machines()
            wins = self._node_wins[key] = node_plan_wins(
                collective, tuple(self.ctx.node_ids), nbytes, itemsize, half,
                self.cost_model, root, cores, hosts)
        return wins

    def _reduce_plane(self, call: Call, collective: str, out: np.ndarray, nbytes: int,
                      op: ReduceOp, root: int = 0) -> Any:
        """:meth:`_node_plane` for a reducing ``collective`` into ``out`` (``nbytes`` a
        rank): ``None`` also on fewer than 3 ranks or where the core does not reduce
        ``out``'s dtype with ``op``."""
        if self.ctx.size < 3 or not _reduces(out, op):
            return None
        return self._node_plane(call, collective, nbytes, out.itemsize, root)

    def _node_all_reduce(self, arr: np.ndarray, op: ReduceOp, call: Call,
                         dst: Optional[int] = None) -> bool:
        """all_reduce of ``arr`` with ``op`` as one hierarchical plan; a reduce into ``dst``
        is the same plan (on a copy on the other ranks: their buffers stay as they were)."""
        plane = self._reduce_plane(call, "all_reduce" if dst is None else "reduce", arr,
                                   arr.nbytes, op, dst or 0)
        if plane is None:
            return False
        node: NodeSegment = self._node
        with flat_out(arr) if dst is None or self.ctx.rank == dst else _copy(arr) as flat:
            plan = node_plans.all_reduce(flat.size, flat.itemsize, self.ctx.node_ids,
                                         self.ctx.rank, node.half, _finishes(op))
            self._node_run(plane, call, plan, flat, (), plane.codes(flat, op), op)
        return True

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
            self._node_run(plane, call, plan, src, (flat,), plane.codes(flat, op), op)
        return True

    def _node_broadcast(self, arr: np.ndarray, src: int, call: Call) -> bool:
        """broadcast of ``arr`` from ``src`` as one node-aware plan."""
        plane = self._node_plane(call, "broadcast", arr.nbytes, arr.itemsize, src)
        if plane is None:
            return False
        node: NodeSegment = self._node
        key = ("broadcast_tree", arr.nbytes, 1, src, node.half)
        tree = self._node_wins.get(key) if self._node_wins is not None else None
        if tree is None:
            hosts, cores = self._machines()
            tree = broadcast_tree(tuple(self.ctx.node_ids), arr.nbytes, node.half,
                                  self.cost_model, src, cores, hosts)
            if self._node_wins is not None:
                self._node_wins[key] = tree
        plan = node_plans.broadcast(arr.nbytes, self.ctx.node_ids, self.ctx.rank, src,
                                    node.half, tree)
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
        plane.run(call, plan, flat, codes, op, more, node=self._node)
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

