"""A node's shared-memory lane inside a group on direct connections: the steps of a
scheduled algorithm between ranks of one node go through Ray's shared-memory channels, the
steps between nodes over the direct connections.

A group whose ranks span several Ray nodes runs its collectives over direct connections
(:mod:`raycoll.transport.tcp`): TCP between nodes, Unix sockets inside one. A Unix socket
copies every byte twice (into the kernel and out of it); a lane channel once (the writer's
copy into shared memory; readers reduce straight out of it, as the one-node lane does). So
where a node holds 2 to ``lane_max_ranks`` ranks of the group, all of them actors (and, unless
the group option ``node_lanes`` is ``True``, the group's ranks on that machine fit its cores:
crowded ranks wait on a lane by polling, on a socket in the kernel, and measured no faster on
a lane: benchmarks/HISTORY.md, "Node lanes"), the group's
first collective on direct connections also sets up one lane a node (its ranks' channels
exchanged through the coordinator, as the one-node lane is set up: one extra step, once per
group; a node where any rank cannot open its channel keeps its Unix sockets). The scheduled
algorithms (:mod:`raycoll.algorithms.scheduled`) then run each step in two parts: the
transfers between ranks of this node in one lane round, the rest over the direct
connections, in that order on every rank (a lane round waits only on node-mates, which do
their lane round of a step before its direct part, so nothing waits in a cycle).

A lane round is dense: every rank of the node writes one message (what it sends each
node-mate, an empty one if nothing) and reads each node-mate's, because a channel takes its
next message only once every reader has read the last. Every rank of a node knows from the
schedule alone which steps move data inside its node, so its ranks hold the same rounds;
a step whose largest message inside the node would not fit a channel (``lane_bytes``) stays
on the Unix sockets. The node-aware algorithms (:mod:`raycoll.algorithms.hierarchical`) move
most of their bytes inside nodes, and the cost model prices those steps at the ``lane`` link
class once every node with several ranks has its lane.

Counting, failures and timeouts are the direct connections': a lane round counts into the
group's counters (``ProcessGroup.counters()``) as the messages the schedule sends, the lane
checks with the coordinator while it waits as any round transport does, and a mismatch
found in a lane round breaks the group (ranks on other nodes cannot learn of it otherwise).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, List, Sequence

from raycoll import errors
from raycoll.transport.counters import Counters, payload_bytes
from raycoll.transport.lane import (LaneTransport, in_rank_actor, lane_bytes, lane_max_ranks,
                                    on_one_host, oversubscribed)

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.context import Call, GroupContext

__all__ = ["NodeLane", "host_ranks", "node_lanes_possible", "node_mates", "wants_node_lane"]


def node_mates(ctx: "GroupContext") -> List[int]:
    """The group ranks on this rank's node, itself left out."""
    me = ctx.rank
    return [j for j in range(ctx.size) if ctx.node_ids[j] == ctx.node_ids[me] and j != me]


def node_lanes_possible(ctx: "GroupContext") -> bool:
    """Whether a group on direct connections sets up node lanes (the same on every rank, from
    what all know, not from a node's cores, which differ between nodes): the option
    ``transport="auto"``, an actor on every rank, and a node with 2 or more of the group's
    ranks. (Whether a node takes a lane, each of its ranks decides from its node's cores:
    :func:`wants_node_lane`.)"""
    if ctx.transport != "auto" or ctx.options.node_lanes is False:
        return False
    if ctx.single_node or any(a is None for a in ctx.actors):
        return False  # (a group on one node on direct connections outnumbers a lane)
    if ctx.options.node_lanes is None and on_one_host(ctx) and oversubscribed(ctx.size):
        return False  # one crowded machine: no rank would offer a channel (wants_node_lane)
    return len(set(ctx.node_ids)) < ctx.size


def host_ranks(ctx: "GroupContext") -> int:
    """The group's ranks on this rank's machine (Ray nodes may share one), the same on every
    rank of a node."""
    addresses = ctx.addresses
    mine = addresses[ctx.rank]
    if not mine:
        return len(node_mates(ctx)) + 1
    return sum(1 for a in addresses if a and a[0] == mine[0])


def wants_node_lane(ctx: "GroupContext") -> bool:
    """Whether this rank offers its node a lane channel (the same on every rank of a node):
    its node holds 2 to ``lane_max_ranks`` of the group's ranks, this process is the rank's
    actor, and, unless the option ``node_lanes`` is ``True``, the group's ranks on this
    machine fit its cores (crowded ranks wait on a lane by polling: slower than on sockets,
    benchmarks/HISTORY.md)."""
    if not 2 <= len(node_mates(ctx)) + 1 <= lane_max_ranks(ctx):
        return False
    if ctx.options.node_lanes is not True and oversubscribed(host_ranks(ctx)):
        return False
    return in_rank_actor(ctx)


class NodeLane(LaneTransport):
    """One node's lane on this rank, beside the group's direct connections (see the module
    docstring): a round per step of a schedule that moves data inside the node."""

    name = "shared-memory lane of its node"
    kind = "tcp"  # the group's round transport, as the coordinator knows it

    def __init__(self, ctx: "GroupContext", out: Any, peers: Dict[int, Any], epoch: str,
                 counters: Dict[str, Counters]) -> None:
        super().__init__(ctx, out, peers, epoch)
        #: the group ranks that share this lane (this rank left out)
        self.mates = frozenset(peers)
        # one tally a group: the direct connections' (ProcessGroup.counters)
        self.counters = counters
        #: the most one rank sends its node-mates in one round (its channel's size)
        self.capacity = lane_bytes(ctx.options)

    def _host_ranks(self) -> int:
        return host_ranks(self.ctx)

    def report(self, force: bool = False, wait_s: float = 0.0) -> None:
        """Nothing: the group's direct connections report its progress."""

    def exchange(self, call: "Call", sub: int, sends: Dict[int, List[Any]],
                 sources: Sequence[int], views: bool = False, first: bool = False,
                 count_round: bool = True) -> Dict[int, Any]:
        """Step ``sub`` of ``call`` inside the node: send ``sends[j]`` (a list of arrays) to
        node-mate ``j``, and return what each node-mate in ``sources`` sent this rank (a list
        of arrays each). Every node-mate takes part, sending or not. ``count_round``: count
        the round in the counters (not when the step's direct part counts it)."""
        if first:
            self._call_began = time.monotonic()
            self.calls += sub != 0  # (round 0 counts itself)
        dsts = tuple(sorted(sends))
        # one message for the node: its arrays at the top level, where the framing and Ray's
        # serializer carry them as raw buffers
        payload = (dsts, tuple(len(sends[d]) for d in dsts),
                   [a for d in dsts for a in sends[d]])
        try:
            got = self.all_gather(call, payload, sub, views)
        except errors.CollectiveMismatchError as exc:
            self.ctx.fail(exc)  # ranks on other nodes wait on this one: break the group
            raise
        me = self.ctx.rank
        out: Dict[int, Any] = {}
        for s in sources:
            their_dsts, counts, arrays = got[s]
            if me not in their_dsts:
                raise ValueError(f"{call.op} #{call.seq}: group rank {s} sent nothing to "
                                 f"group rank {me} in step {sub}")
            at = their_dsts.index(me)
            start = sum(counts[:at])
            out[s] = arrays[start:start + counts[at]]
        del got
        tally = self.tally(call.op)
        for d in dsts:
            tally.sent(d, payload_bytes(sends[d]), True)
        for s in sources:
            tally.received(s, payload_bytes(out[s]), True)
        tally.rounds += bool(count_round and (dsts or sources))
        return out
