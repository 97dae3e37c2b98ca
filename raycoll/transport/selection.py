"""Which round transport a group uses, and setting it up.

A group picks its round transport once, inside its first collective that can use one, the
same on every rank from what they all know (the group option ``transport``, the ranks' nodes
and addresses): the node segment (all ranks on this node and the native core on every rank;
set up through the coordinator in that collective), direct connections (ranks on several
nodes, more ranks on one node than the segment takes, or ``transport="tcp"``), or none (then
collectives go through the coordinator and the object store). The group's direct connections
also carry its point-to-point messages to other nodes (socket pipes).

:class:`GroupTransports` is what a group's :class:`~raycoll.context.GroupContext` is given
(as its ``transports``) by the layer that forms the group, so that the context, below every
transport, never imports one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from raycoll.native import core
from raycoll.transport import segment
from raycoll.transport.base import PROBE_NOW, NativeTransport, await_explanation
from raycoll.transport.cores import oversubscribed
from raycoll.transport.links import CLOSED_GRACE_S, Links, tcp_possible
from raycoll.transport.native_tcp import NativeSockets
from raycoll.transport.pipes import PairPipes

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.context import Call, GroupContext

__all__ = ["GroupTransports", "pipes_possible"]


def pipes_possible(ctx: "GroupContext", links: Optional[Links] = None) -> bool:
    """Whether group ``ctx``'s point-to-point runs on the native core's pair pipes: the core
    is built and on (on every rank), 2+ ranks, not ``transport="store"``, the group has a
    secret (the pipes' names carry it), and its ranks are all on this node or it has direct
    connections (``links``: socket pipes to the ranks on other nodes)."""
    return (core is not None and ctx.native and ctx.size > 1 and ctx.transport != "store"
            and ctx.secret is not None and (ctx.single_node or links is not None))


class GroupTransports:
    """One group's round transports and direct connections on this rank (see
    :class:`raycoll.context.Transports`). The direct connections (:class:`Links`) are made
    with it, when the group may use them; the rest when first needed."""

    def __init__(self, ctx: "GroupContext") -> None:
        self.ctx = ctx
        #: the group's direct connections, or ``None`` when it has none
        self.links: Optional[Links] = None
        self._pipes: Optional[PairPipes] = None
        self._planned: Optional[str] = None
        if ctx.transport != "store" and ctx.size > 1:
            if ctx.secret is not None and tcp_possible(ctx):
                self.links = Links(key=ctx.group_name, rank=ctx.rank, size=ctx.size,
                                   secret=ctx.secret, addresses=ctx.addresses,
                                   nodes=ctx.node_ids)

    def planned(self) -> str:
        """The round transport this group will use (``"lane"``, ``"tcp"`` or ``"store"``),
        decided alike on every rank from what they all know: the option ``transport``, the
        ranks' nodes and addresses. (The lane may still turn out unavailable when it is set
        up: then every rank goes to the store together.)"""
        if self._planned is None:  # what decides it does not change: once per group
            ctx = self.ctx
            if ctx.transport in ("auto", "lane") and segment.segment_possible(ctx):
                self._planned = "lane"
            elif self.links is not None and ctx.transport in ("tcp", "auto") \
                    and core is not None and ctx.native:
                # native sockets: across nodes, or too many ranks on one node for the segment
                self._planned = "tcp"
            else:
                self._planned = "store"
        return self._planned

    def set_up(self, call: "Call") -> Any:
        """Decide, inside ``call`` and identically on every rank, which round transport the
        group uses, and set it up: a :class:`NativeTransport`, or ``False`` for none."""
        planned = self.planned()
        if planned == "lane":
            return self._set_up_lane(call)
        if planned == "tcp" and self.links is not None:  # "tcp" is planned only with links
            return NativeSockets(self.ctx, self.links)
        return False

    def _set_up_lane(self, call: "Call") -> Union[NativeTransport, bool]:
        ctx = self.ctx
        seg = segment.set_up_segment(ctx, call)
        if seg is not None:
            return seg
        ctx.skip_setup_step(call)
        return NativeSockets(ctx, self.links) if self.links is not None else False

    def pair_pipes(self) -> Optional[PairPipes]:
        """The group's point-to-point: the native core's pair pipes where every rank
        runs the core (:mod:`raycoll.transport.pipes`: shared memory on this node, socket
        pipes on the direct connections to other nodes), or ``None`` (no native core, or
        ``transport="store"``: then point-to-point goes through the coordinator)."""
        if self._pipes is None and pipes_possible(self.ctx, self.links):
            ctx = self.ctx
            assert ctx.secret is not None  # (pipes_possible)
            mine = ctx.node_ids[ctx.rank]
            self._pipes = PairPipes(group=ctx.group_name, rank=ctx.rank,
                                      global_ranks=ctx.global_ranks, secret=ctx.secret,
                                      check=ctx.p2p_check, explain=self._p2p_explain,
                                      crowded=oversubscribed(ctx.size), links=self.links,
                                      remote=[j for j, node in enumerate(ctx.node_ids)
                                              if node != mine])
        return self._pipes

    def _p2p_explain(self, suspects: Sequence[int] = ()) -> Optional[BaseException]:
        """The coordinator's error once it has one, or ``None`` after a short grace; group
        ranks ``suspects`` are probed at once (a dead actor's probe fails within
        milliseconds)."""
        return await_explanation(
            lambda: self.ctx.p2p_check(suspects, PROBE_NOW if suspects else 0.0),
            CLOSED_GRACE_S)

    def sockets(self, purpose: str) -> int:
        """How many direct connections this rank holds for ``purpose`` (both directions)."""
        return self.links.sockets(purpose) if self.links is not None else 0

    def close(self) -> None:
        """Release the pair pipes and the direct connections."""
        if self._pipes is not None:
            self._pipes.close()
        if self.links is not None:
            self.links.close()
