"""The scheduled algorithms on a live group: ring, recursive doubling, halving-doubling,
binomial trees and the two-level (node-aware) forms, run over the group's direct
connections, one step of the schedule a round between the ranks that step pairs.

A group on direct connections (:mod:`raycoll.transport.tcp`) knows its node map (a
:class:`~raycoll.algorithms.topology.Topology` of its ranks' Ray node ids: Unix sockets inside
a node, TCP across). For each all_reduce, reduce_scatter, all_gather, broadcast and reduce
the cost model (:mod:`raycoll.algorithms.cost`) picks the algorithm from values every rank
has (the op, the bytes, the node map, the group's options), so every rank runs the same
schedule; a group option (``all_reduce_algo``, ...) forces one. ``direct`` and
``direct_rsag`` are the direct exchange the backend already streams
(:mod:`raycoll.algorithms.direct`): they go back to it. A rank opens connections only to
the peers its schedules pair it with, on first use.

The direct connections count every message (``ProcessGroup.counters()``), and
:func:`raycoll.algorithms.counters.expected` says what a schedule should cost: a test
checks an algorithm's cost exactly.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from raycoll.algorithms.catalog import PIPELINED, build
from raycoll.algorithms.cost import CostModel, choose
from raycoll.algorithms.executor import combining_op, finish
from raycoll.algorithms.schedule import ALGORITHMS, Schedule, Transfer
from raycoll.algorithms.topology import Topology
from raycoll.options import SCHEDULED
from raycoll.reduce_op import ReduceOp, combine
from raycoll.transport.cores import on_one_host, oversubscribed

__all__ = ["ScheduledAlgorithms", "DIRECT"]

logger = logging.getLogger("raycoll")

#: The algorithms the backend's direct exchange runs (streamed) instead of a schedule.
DIRECT = ("direct", "direct_rsag")
#: How many (collective, bytes, root) choices and schedules a rank keeps.
_CACHE = 64

#: One rank's part of one schedule: per step, its sends by destination and its receives.
Plan = List[Tuple[Dict[int, List[Transfer]], List[Transfer]]]


def rank_plan(schedule: Schedule, rank: int) -> Plan:
    """Rank ``rank``'s steps of ``schedule``: ``(sends by destination, receives)`` each."""
    plan: Plan = []
    for sends, recvs in schedule.per_rank(rank):
        by_dst: Dict[int, List[Transfer]] = {}
        for t in sends:
            by_dst.setdefault(t.dst, []).append(t)
        plan.append((by_dst, recvs))
    return plan


class ScheduledAlgorithms:
    """The scheduled algorithms of :class:`~raycoll.backends.cpu.ObjstoreBackend` (a base
    class of it: they read its group context)."""

    ctx: Any
    #: the size of a pipelined segment (the backend's ``stream_bytes``)
    stream_bytes: int

    def _init_scheduled(self) -> None:
        opts = self.ctx.options
        self.topology = Topology(self.ctx.node_ids, same_node="unix")
        # Only a group on one host knows its cores alike on every rank.
        self.oversubscribed = on_one_host(self.ctx) and oversubscribed(self.ctx.size)
        self.cost_model = CostModel.of(opts.cost_model)
        self.forced: Dict[str, Optional[str]] = {}
        for name, collective in SCHEDULED.items():
            algo = getattr(opts, name)
            self.forced[collective] = algo if algo in ALGORITHMS[collective] else None
        self._plans: "OrderedDict[Tuple[Any, ...], Tuple[Schedule, Plan]]" = OrderedDict()
        self._choices: "OrderedDict[Tuple[Any, ...], str]" = OrderedDict()

    def algorithm(self, collective: str, nbytes: int, itemsize: int, root: int = 0) -> str:
        """The algorithm this group runs ``collective`` of ``nbytes`` a rank with (the same
        on every rank): the forced one, else the cost model's minimum."""
        forced = self.forced.get(collective)
        if forced is not None:
            return forced
        key = (collective, nbytes, itemsize, root)
        algo = self._choices.get(key)
        if algo is None:
            algo = choose(collective, self.topology, nbytes, itemsize, self.cost_model, root,
                          oversubscribed=self.oversubscribed)
            self._remember(self._choices, key, algo)
            logger.debug("group %r: %s of %d bytes on %s: %s", self.ctx.group_name, collective,
                         nbytes, self.topology.ranks_per_node, algo)
        return algo

    def _plan(self, collective: str, algo: str, n: int, itemsize: int,
              root: int) -> Tuple[Schedule, Plan]:
        """The schedule and this rank's plan."""
        key = (collective, algo, n, itemsize, root)
        got = self._plans.get(key)
        if got is None:
            # a large buffer is pipelined in segments of about ``stream_bytes``: a round's
            # messages stay in the caches between their receipt and the reduction
            segments = (max(1, -(-n * itemsize // self.stream_bytes))
                        if collective in PIPELINED else 1)  # (an empty buffer: one)
            schedule = build(collective, algo, self.topology, n, root, segments=segments)
            got = (schedule, rank_plan(schedule, self.ctx.rank))
            self._remember(self._plans, key, got)
        return got

    @staticmethod
    def _remember(cache: "OrderedDict[Any, Any]", key: Any, value: Any) -> None:
        cache[key] = value
        if len(cache) > _CACHE:
            cache.popitem(last=False)

    def _schedules(self, collective: str, nbytes: int, itemsize: int, call: Any,
                   root: int = 0) -> bool:
        """Whether ``collective`` of ``nbytes`` a rank runs a schedule here (the group has
        direct connections and its algorithm is not the direct exchange), the same on every
        rank: ask before building a buffer for :meth:`_scheduled`."""
        if self.ctx.size < 3 and not self.ctx.native:
            return False  # two ranks: every algorithm is the direct exchange
        plane = self.ctx.sparse_transport(call)
        if plane is None:
            return False
        algo = self.algorithm(collective, nbytes, itemsize, root)
        self.ctx.note_algorithm(collective, algo)
        # natively, the direct exchange is a schedule too (one step: its mesh)
        return algo not in DIRECT or getattr(plane, "native", None) is not None

    def _scheduled(self, collective: str, flat: np.ndarray, op: Optional[ReduceOp], call: Any,
                   root: int = 0) -> bool:
        """Run ``collective`` on ``flat`` (this rank's whole buffer, in place, in the
        schedule's layout) if :meth:`_schedules` says so; ``False`` (nothing done)
        otherwise, the same on every rank."""
        if not self._schedules(collective, flat.nbytes, flat.itemsize, call, root):
            return False
        algo = self.algorithm(collective, flat.nbytes, flat.itemsize, root)
        plane = self.ctx.sparse_transport(call)
        schedule, plan = self._plan(collective, algo, flat.size, flat.itemsize, root)
        native = getattr(plane, "native", None)  # alike on every rank
        codes = native.codes(flat, op) if native is not None else None
        if native is not None and codes is not None:
            reducing = op is not None and op.name in ("AVG", "PREMUL_SUM")
            key = (collective, algo, flat.size, flat.itemsize, root, reducing)
            nplan = native.plan(key, schedule, flat.itemsize, reducing)
            plane.run_native(call, nplan, flat, codes, op)
            self.ctx.note_rounds(call, nplan.rounds, schedule.algorithm)
            return True
        self._run(collective, schedule, plan, flat, op, call, plane)
        return True

    def _run(self, collective: str, schedule: Schedule, plan: Plan, flat: np.ndarray,
             op: Optional[ReduceOp], call: Any, plane: Any) -> None:
        combine_op = combining_op(op) if op is not None else None
        first, rounds = True, 0
        for i, (sends, recvs) in enumerate(plan):
            payloads = {dst: [flat[t.lo:t.hi] for t in ts] for dst, ts in sends.items()}
            sources = list(dict.fromkeys(t.src for t in recvs))
            got: Dict[int, Any] = {}
            if payloads or sources:
                got = plane.exchange(call, i, payloads, sources, views=True, first=first)
                first = False
            rounds += bool(sends or recvs)
            del payloads
            try:
                _apply(recvs, got, flat, combine_op, call)
            finally:
                got.clear()  # views of the transport's buffers: none may outlive the step
        self.ctx.note_rounds(call, rounds, schedule.algorithm)
        if op is not None:
            finish(schedule, flat, self.ctx.rank, op)


def _apply(recvs: List[Transfer], got: Dict[int, Any], flat: np.ndarray,
           combine_op: Optional[ReduceOp], call: Any) -> None:
    """Reduce or copy what one step brought (``got``: the arrays each source sent, in the
    schedule's order) into ``flat``."""
    at: Dict[int, int] = {}
    for t in recvs:
        k = at.get(t.src, 0)
        at[t.src] = k + 1
        data = got[t.src][k]
        if data.shape != (t.hi - t.lo,):
            raise ValueError(f"{call.op} #{call.seq}: expected {t.hi - t.lo} elements "
                             f"from group rank {t.src}, got {data.shape}")
        if t.reduce and combine_op is not None:
            combine(combine_op, flat[t.lo:t.hi], data)
        else:
            flat[t.lo:t.hi] = data
