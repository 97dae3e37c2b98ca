"""One planner for a group on several nodes: its hierarchical plans
(:mod:`raycoll.algorithms.node_plans`: the node segment inside each node, sockets between
nodes, one call of the native executor) and the flat socket schedules
(:mod:`raycoll.algorithms.catalog`) priced by one cost model, the cheaper taken.

Both run on the native executor, so both are priced at its link classes
(:mod:`raycoll.algorithms.cost`): ``socket``, a native message between two ranks (``alpha``
a message, ``beta`` a byte at each end; a flat schedule's messages all go over sockets,
inside a node too), and ``segment``, the node segment (``alpha`` a step: every local rank
publishes and waits for the others; ``beta`` a byte written into or copied out of it), with
``gamma`` a reduced byte. The executor's waits spin or yield rather than sleep, so the
schedules' per-step ``wake`` (a Python step waiting to be scheduled) is not charged.

A plan is priced from its operations, rank by rank (:func:`plan_time`): each segment step
its ``alpha``, each byte through the segment its ``beta`` (a reduction out of the node's
halves reads every local rank's), each peer a rank sends to in a round one socket ``alpha``,
each byte sent or received a socket ``beta``, each reduced byte ``gamma``. A machine's ranks
share its cores (and its memory): the plan takes as long as its slowest rank, or its busiest
machine's ranks' work spread over ``min(its ranks, its cores)`` cores
(:func:`busiest_cores`), or its busiest node link (where ``nic`` is set), the longest. A
schedule is priced alike (:func:`flat_times`): its critical path as :meth:`CostModel.time`
prices it, every link a socket, or its busiest machine's work so spread
(:meth:`CostModel.work`). The caller says what the machines are (``hosts``: a rank's
machine, by default its node) and their ``cores`` (1 by default: a machine's ranks' work
added up): the cpu backend passes the Ray nodes' ``CPU`` resources where each node is a
machine, and one host of ``os.cpu_count()`` cores where Ray nodes share one
(:mod:`raycoll.backends.node_paths`). Each rank alone, a flat schedule of 3 + 1 ranks looked
cheaper than the plan past 64 KiB (the schedule spreads the work over the ranks, the plan
has one rail rank reduce and send the whole buffer), where the plan was measured 1.08-1.59x
faster than the flat schedule from 8 MiB (benchmarks/BENCHMARKS.md, "The planner"): the
three ranks of the big node do three ranks' work of the schedule on the cores they share,
and less than that in the plan (its bytes cross the node once). On a machine with a core
for each rank, the work spreads: each side costs its critical path.

One case runs serially, whatever the cores: a reduction of one chunk (one round between the
nodes: nothing pipelined) past ``SMALL_BYTES`` on a node whose rails are fewer than its
ranks (3 + 1 at 1 MiB): the node's ranks write, wait while its rail rank reduces the node's
halves and exchanges the whole chunk, and wait again for its result; the other node waits on
that rail. Such a plan costs every rank's work added up (:func:`_serial`). Without it, the
plan was priced below the flat schedule at 1 MiB, and measured 0.71-0.95x of it.

:data:`NODE_PLANS` is the catalog of hierarchical plans by collective. A broadcast below
``NODE_BROADCAST_BYTES`` is no candidate (on 3+ nodes broadcast's plan is the cheaper of
two, :func:`broadcast_tree`): the model prices one call, and back to back the
sockets' root runs ahead of its readers (its sends do not wait for them) while every segment
step waits for every rank of its node (2 + 2 ranks on a loaded machine: the node plan 0.18x
the sockets at 4 B, 0.67x at 256 KiB, 1.12x at 1 MiB: benchmarks/BENCHMARKS.md).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, Union

from raycoll.algorithms import node_plans
from raycoll.algorithms.catalog import build
from raycoll.algorithms.cost import CostModel
from raycoll.algorithms.native_plans import (FINAL, LOCAL, MREDUCE, RECV, SEND, XFER,
                                             NativePlan)
from raycoll.algorithms.schedule import ALGORITHMS
from raycoll.algorithms.segment_plans import COPY, REDUCE, SYNC, WRITE
from raycoll.algorithms.topology import Topology

__all__ = ["NODE_PLAN", "NODE_PLANS", "NODE_BROADCAST_BYTES", "Cores", "node_plan_time",
           "plan_time", "node_plan_wins", "flat_times", "broadcast_tree", "busiest_cores"]

#: The cores the ranks of a node share: one count for every node, or a count by node id
#: (a node missing from the mapping: 1). See :func:`busiest_cores`.
Cores = Union[int, Mapping[Hashable, int]]

#: The hierarchical plans' name (``last_route.algorithm``, ``group_status``).
NODE_PLAN = "node_hierarchical"
#: A broadcast smaller than this keeps the socket schedule (see the module docstring).
NODE_BROADCAST_BYTES = 1 << 20


def _all_reduce(node_ids: Tuple[str, ...], rank: int, nbytes: int, itemsize: int,
                half: int, root: int) -> NativePlan:
    return node_plans.all_reduce(nbytes // itemsize, itemsize, node_ids, rank, half, False)


def _reduce_scatter(node_ids: Tuple[str, ...], rank: int, nbytes: int, itemsize: int,
                    half: int, root: int) -> NativePlan:
    count = nbytes // itemsize // len(node_ids)  # ``nbytes``: the whole input
    return node_plans.reduce_scatter(count, itemsize, node_ids, rank, half, False)


def _broadcast(node_ids: Tuple[str, ...], rank: int, nbytes: int, itemsize: int,
               half: int, root: int) -> NativePlan:
    return node_plans.broadcast(nbytes, node_ids, rank, root, half)


def _broadcast_tree(node_ids: Tuple[str, ...], rank: int, nbytes: int, itemsize: int,
                    half: int, root: int) -> NativePlan:
    return node_plans.broadcast(nbytes, node_ids, rank, root, half, tree=True)


def _all_gather(node_ids: Tuple[str, ...], rank: int, nbytes: int, itemsize: int,
                half: int, root: int) -> NativePlan:
    return node_plans.all_gather(nbytes // len(node_ids), node_ids, rank, half, True)


#: The hierarchical plans by collective (reduce is the all_reduce plan): each builds rank
#: ``rank``'s plan from (node ids, rank, bytes as the collective's cost is asked for,
#: itemsize, the segment's half, root).
NODE_PLANS: Dict[str, Callable[[Tuple[str, ...], int, int, int, int, int], NativePlan]] = {
    "all_reduce": _all_reduce, "reduce": _all_reduce, "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast, "all_gather": _all_gather,
}


def busiest_cores(work: Sequence[float], hosts: Sequence[Hashable], cores: Cores) -> float:
    """The longest of the hosts' work spread over their cores: ``work[r]`` rank ``r``'s
    seconds, on host ``hosts[r]`` (a node; or the one machine that Ray nodes share), whose
    ranks' work added up spreads over ``min(its ranks, its cores)`` cores. ``cores`` 1: a
    host's ranks take turns on one core (their work added up)."""
    ranks = Counter(hosts)
    total: Dict[Hashable, float] = {}
    for host, seconds in zip(hosts, work):
        total[host] = total.get(host, 0.0) + seconds
    worst = 0.0
    for host, seconds in total.items():
        have = cores if isinstance(cores, int) else cores.get(host, 1)
        if isinstance(have, bool) or not isinstance(have, int) or have < 1:
            raise ValueError(f"cores: expected an int >= 1 for {host!r}, got {have!r}")
        worst = max(worst, seconds / min(ranks[host], have))
    return worst


def plan_time(plans: Sequence[NativePlan], node_ids: Sequence[Hashable],
              model: CostModel, cores: Cores = 1,
              hosts: Optional[Sequence[Hashable]] = None) -> float:
    """The predicted seconds of a native plan, ``plans[r]`` rank ``r``'s, on a group whose
    rank ``r`` is on node ``node_ids[r]`` (and machine ``hosts[r]``: by default its node),
    each machine's ranks on ``cores`` cores (see the module docstring)."""
    seg, sock, gamma = model.links["segment"], model.links["socket"], model.gamma
    local = [sum(1 for n in node_ids if n == node_ids[r]) for r in range(len(node_ids))]
    worst = 0.0
    links: Dict[Tuple[int, Hashable], float] = {}  # (0 out / 1 in, node): bytes across
    work: List[float] = []  # each rank's seconds
    for rank, plan in enumerate(plans):
        t, peers = 0.0, set()
        for code, _buf, _off, n, peer, _a, nodes, _s in plan.ops.tolist():
            if code == SYNC:
                t += seg.alpha
            elif code in (WRITE, COPY, LOCAL):
                t += seg.beta * n
            elif code == REDUCE:  # every local rank's half read, all but one reduced in
                t += (seg.beta * local[rank] + gamma * (local[rank] - 1)) * n
            elif code == MREDUCE:  # the nodes' partials: the first copied, the others reduced
                t += gamma * n * (nodes - 1)
            elif code == FINAL:
                t += gamma * n
            elif code == SEND:
                t += sock.beta * n + (0.0 if peer in peers else sock.alpha)
                peers.add(peer)
                if node_ids[peer] != node_ids[rank]:
                    out = (0, node_ids[rank])
                    links[out] = links.get(out, 0.0) + n
                    into = (1, node_ids[peer])
                    links[into] = links.get(into, 0.0) + n
            elif code == RECV:
                t += sock.beta * n
            elif code == XFER:
                peers = set()
        worst = max(worst, t)
        work.append(t)
    if _serial(plans, node_ids):
        worst = max(worst, sum(work))
    return max(worst, busiest_cores(work, hosts or node_ids, cores),
               model.nic * max(links.values(), default=0.0))


def _serial(plans: Sequence[NativePlan], node_ids: Sequence[Hashable]) -> bool:
    """Whether a plan's stages run one after the other, every rank's work on its critical
    path: one chunk (one round between the nodes, nothing pipelined) of a reduction of more
    than ``SMALL_BYTES`` in the segment, on a node where fewer ranks than its own exchange
    with the other nodes (its rail ranks reduce and send the node's whole buffer while the
    others wait; see the module docstring)."""
    # (a node segment's own plan, as ``raycoll-bench --calibrate`` prices one: no rounds)
    if max((getattr(p, "rounds", 0) for p in plans), default=0) != 1:
        return False
    ops = [p.ops.tolist() for p in plans]
    if not any(op[0] == REDUCE and op[3] > node_plans.SMALL_BYTES for o in ops for op in o):
        return False
    sends = [any(op[0] == SEND for op in o) for o in ops]
    by_node: Dict[Hashable, List[bool]] = {}
    for node, sending in zip(node_ids, sends):
        by_node.setdefault(node, []).append(sending)
    return any(any(s) and not all(s) for s in by_node.values())



def node_plan_time(collective: str, node_ids: Tuple[str, ...], nbytes: int, itemsize: int,
                   half: int, model: CostModel, root: int = 0, cores: Cores = 1,
                   hosts: Optional[Sequence[Hashable]] = None) -> float:
    """The predicted seconds of ``collective``'s hierarchical plan of ``nbytes`` (a rank's
    buffer; reduce_scatter's and all_gather's: the whole) on ``node_ids``, the segment's
    halves ``half`` bytes (``cores``, ``hosts``: :func:`plan_time`'s)."""
    builds = [NODE_PLANS[collective]]
    if collective == "broadcast" and len(set(node_ids)) > 2:
        builds.append(_broadcast_tree)
    return min(plan_time([build(node_ids, r, nbytes, itemsize, half, root)
                          for r in range(len(node_ids))], node_ids, model, cores, hosts)
               for build in builds)


def broadcast_tree(node_ids: Tuple[str, ...], nbytes: int, half: int, model: CostModel,
                   root: int = 0, cores: Cores = 1,
                   hosts: Optional[Sequence[Hashable]] = None) -> bool:
    """Whether broadcast's plan sends between the nodes as a binomial tree over their
    leaders (:func:`raycoll.algorithms.node_plans.broadcast`), not a star: 3+ nodes, and
    the model prices the tree below the star (the same answer on every rank)."""
    if len(set(node_ids)) < 3:
        return False
    star, tree = ([build(node_ids, r, nbytes, 1, half, root) for r in range(len(node_ids))]
                  for build in (_broadcast, _broadcast_tree))
    return plan_time(tree, node_ids, model, cores, hosts) \
        < plan_time(star, node_ids, model, cores, hosts)


def _native(model: CostModel) -> CostModel:
    """``model`` as the native executor's flat schedules cost: every link a socket, no
    per-step wake-up."""
    sock = model.links["socket"]
    links = dict(model.links)
    links.update(unix=sock, tcp=sock)
    return CostModel(links, model.gamma, 0.0, model.nic)


def node_plan_wins(collective: str, node_ids: Tuple[str, ...], nbytes: int, itemsize: int,
                   half: int, model: CostModel, root: int = 0, cores: Cores = 1,
                   hosts: Optional[Sequence[Hashable]] = None) -> bool:
    """Whether ``collective`` of ``nbytes`` takes its hierarchical plan on ``node_ids``: the
    model prices it at most the cheapest flat socket schedule's time (the same answer on
    every rank: the same inputs; ``cores``, ``hosts``: :func:`plan_time`'s)."""
    if collective not in NODE_PLANS or nbytes == 0 \
            or collective == "broadcast" and nbytes < NODE_BROADCAST_BYTES:
        return False
    return node_plan_time(collective, node_ids, nbytes, itemsize, half, model, root, cores,
                          hosts) <= min(flat_times(collective, node_ids, nbytes, itemsize,
                                                   model, root, cores, hosts).values())


def flat_times(collective: str, node_ids: Tuple[str, ...], nbytes: int, itemsize: int,
               model: CostModel, root: int = 0, cores: Cores = 1,
               hosts: Optional[Sequence[Hashable]] = None) -> Dict[str, float]:
    """The predicted seconds of each flat socket schedule of ``collective`` (``nbytes`` as
    :func:`node_plan_time` takes it) on ``node_ids``: its critical path
    (:meth:`CostModel.time`, every link a socket) or its busiest machine's ranks' work
    spread over their cores (:func:`busiest_cores`), the longer."""
    topology = Topology(node_ids)
    native = _native(model)
    out = {}
    # the schedules price a rank's buffer: reduce_scatter's and all_gather's are the whole
    for algo in ALGORITHMS[collective]:
        schedule = build(collective, algo, topology, nbytes // itemsize, root)
        per_rank = native.work(schedule, topology, itemsize)
        work = [per_rank.get(r, 0.0) for r in range(len(node_ids))]
        out[algo] = max(native.time(schedule, topology, itemsize),
                        busiest_cores(work, hosts or node_ids, cores))
    return out
