"""The scheduled algorithms on a live group: direct exchange, ring, recursive doubling,
halving-doubling, binomial trees and the two-level (node-aware) forms, each run as one plan
of the native executor over the group's direct connections
(:mod:`raycoll.transport.native_tcp`).

A group on direct connections knows its node map (a
:class:`~raycoll.algorithms.topology.Topology` of its ranks' Ray node ids: Unix sockets inside
a node, TCP across). For each all_reduce, reduce_scatter, all_gather, broadcast and reduce
the cost model (:mod:`raycoll.algorithms.cost`) picks the algorithm from values every rank
has (the op, the bytes, the node map, the group's options), so every rank runs the same
schedule; a group option (``all_reduce_algo``, ...) forces one. A rank opens connections
only to the peers its schedules pair it with, on first use. What the core cannot run (a
dtype and op it does not reduce, a group without the core on every rank) is left to the
object store (:mod:`raycoll.algorithms.store`), the same on every rank.

The direct connections count every message (``ProcessGroup.counters()``), and
:func:`raycoll.algorithms.counters.expected` says what a schedule should cost: a test
checks an algorithm's cost exactly.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Dict, Hashable, Optional, Tuple

import numpy as np

from raycoll.algorithms.catalog import PIPELINED, build
from raycoll.algorithms.cost import CostModel, choose
from raycoll.algorithms.native_plans import NativePlan, plan_schedule
from raycoll.algorithms.planner import Cores, flat_times
from raycoll.algorithms.schedule import ALGORITHMS
from raycoll.algorithms.topology import Topology
from raycoll.options import SCHEDULED
from raycoll.reduce_op import ReduceOp
from raycoll.transport.cores import group_machines, on_one_host, oversubscribed

__all__ = ["ScheduledAlgorithms"]

logger = logging.getLogger("raycoll")

#: How many (collective, bytes, root) choices and plans a rank keeps.
_CACHE = 64


class ScheduledAlgorithms:
    """The scheduled algorithms of :class:`~raycoll.backends.cpu.ObjstoreBackend` (a base
    class of it: they read its group context)."""

    ctx: Any
    #: the size of a pipelined segment (the backend's ``stream_bytes``)
    stream_bytes: int

    def _init_scheduled(self) -> None:
        opts = self.ctx.options
        self.topology = Topology(self.ctx.node_ids)
        # Only a group on one host knows its cores alike on every rank.
        self.oversubscribed = on_one_host(self.ctx) and oversubscribed(self.ctx.size)
        self.cost_model = CostModel.of(opts.cost_model)
        self.forced: Dict[str, Optional[str]] = {}
        for name, collective in SCHEDULED.items():
            algo = getattr(opts, name)
            self.forced[collective] = algo if algo in ALGORITHMS[collective] else None
        self._plans: "OrderedDict[Tuple[Any, ...], NativePlan]" = OrderedDict()
        self._choices: "OrderedDict[Tuple[Any, ...], str]" = OrderedDict()
        self._group_machines: Optional[Tuple[Tuple[Hashable, ...], Cores]] = None

    def _machines(self) -> Tuple[Tuple[Hashable, ...], Cores]:
        """The group's machines and their cores (:func:`raycoll.transport.cores.group_machines`,
        asked once)."""
        if self._group_machines is None:
            self._group_machines = group_machines(self.ctx)
        return self._group_machines

    def algorithm(self, collective: str, nbytes: int, itemsize: int, root: int = 0) -> str:
        """The algorithm this group runs ``collective`` of ``nbytes`` a rank with (the same
        on every rank): the forced one, else the cost model's minimum; on Ray nodes that share
        one host (loopback between them, every link alike), the planner's
        (:func:`raycoll.algorithms.planner.flat_times`: the native executor's costs, the
        host's cores), the one that priced the hierarchical plan against it. (Across hosts
        the cost model's link classes tell a network link from a node's own, which the
        planner's one ``socket`` class does not.)"""
        forced = self.forced.get(collective)
        if forced is not None:
            return forced
        key = (collective, nbytes, itemsize, root)
        algo = self._choices.get(key)
        if algo is None:
            if self.ctx.single_node or not on_one_host(self.ctx):
                algo = choose(collective, self.topology, nbytes, itemsize, self.cost_model,
                              root, oversubscribed=self.oversubscribed)
            else:
                hosts, cores = self._machines()
                times = flat_times(collective, tuple(self.ctx.node_ids), nbytes, itemsize,
                                   self.cost_model, root, cores, hosts)
                algo = min(times, key=lambda a: (times[a], list(times).index(a)))
            self._remember(self._choices, key, algo)
            logger.debug("group %r: %s of %d bytes on %s: %s", self.ctx.group_name, collective,
                         nbytes, self.topology.ranks_per_node, algo)
        return algo

    def _plan(self, collective: str, algo: str, n: int, itemsize: int, root: int,
              reducing: bool) -> NativePlan:
        """This rank's native plan of ``collective`` by ``algo`` over ``n`` elements
        (``reducing``: with AVG's or PREMUL_SUM's final step; cached)."""
        key = (collective, algo, n, itemsize, root, reducing)
        got = self._plans.get(key)
        if got is None:
            # a large buffer is pipelined in segments of about ``stream_bytes``: a round's
            # messages stay in the caches between their receipt and the reduction
            segments = (max(1, -(-n * itemsize // self.stream_bytes))
                        if collective in PIPELINED else 1)  # (an empty buffer: one)
            schedule = build(collective, algo, self.topology, n, root, segments=segments)
            got = plan_schedule(schedule, self.ctx.rank, itemsize, reducing)
            self._remember(self._plans, key, got)
        return got

    @staticmethod
    def _remember(cache: "OrderedDict[Any, Any]", key: Any, value: Any) -> None:
        cache[key] = value
        if len(cache) > _CACHE:
            cache.popitem(last=False)

    def _schedules(self, collective: str, nbytes: int, like: np.ndarray,
                   op: Optional[ReduceOp], call: Any, root: int = 0) -> bool:
        """Whether ``collective`` of ``nbytes`` a rank (arrays like ``like``, reduced with
        ``op``) runs a schedule here, the same on every rank: the group has native direct
        connections and the core reduces ``like``'s dtype with ``op``. Ask before building a
        buffer for :meth:`_scheduled`."""
        plane = self.ctx.native_sockets(call)
        if plane is None or plane.codes(like, op) is None:
            return False
        self.ctx.note_algorithm(collective, self.algorithm(collective, nbytes, like.itemsize,
                                                           root))
        return True

    def _scheduled(self, collective: str, flat: np.ndarray, op: Optional[ReduceOp], call: Any,
                   root: int = 0) -> bool:
        """Run ``collective`` on ``flat`` (this rank's whole buffer, in place, in the
        schedule's layout) natively if :meth:`_schedules` says so; ``False`` (nothing done)
        otherwise, the same on every rank."""
        if not self._schedules(collective, flat.nbytes, flat, op, call, root):
            return False
        algo = self.algorithm(collective, flat.nbytes, flat.itemsize, root)
        plane = self.ctx.native_sockets(call)
        reducing = op is not None and op.name in ("AVG", "PREMUL_SUM")
        codes = plane.codes(flat, op)
        nplan = self._plan(collective, algo, flat.size, flat.itemsize, root, reducing)
        plane.run(call, nplan, flat, codes, op)
        self.ctx.note_rounds(call, nplan.rounds, algo)
        if collective == "all_reduce" and op is not None:
            plane.remember(flat, op, nplan, codes, algo)
        return True
