"""The node segment of a group on several nodes: one shared-memory segment per (group, node)
over the group's ranks on that node, used beside the group's sockets to other nodes in the
same native runs (``rc_exec(seg, net, ...)``: the plans are
:mod:`raycoll.algorithms.node_plans`; the sockets' side is
:class:`~raycoll.transport.native_tcp.NativeSockets`).

Its local ranks are the node's group ranks in group-rank order; a node with one rank of the
group has none. The segment's layout, waits and liveness are the one-node segment's
(``raycoll/native/segment.h``; :mod:`raycoll.transport.segment` says how a wait spins, sleeps
and checks its peers' processes and abort flags): nothing new lives in shared memory.

**Set-up**, inside the first collective that runs a hierarchical plan (the same call on
every rank: the choice is made from what every rank agrees on), two steps through the
coordinator, as the one-node segment's: each node's local rank 0 creates the segment (a
name carrying a hash of the group's secret, mode 0600, its memory reserved at once), every
rank learns its node's name in step 0 and maps it, and step 1 tells every rank whether every
node's ranks did, and each node's half size; the names are unlinked once step 1 is through
(nothing stays in /dev/shm). If any node failed, every rank goes without (the socket
schedules run instead), each saying why in the log. The plans stream through the smallest
half of the group's nodes, so that every rank cuts its chunks alike.

**Failures**: the executor raises this rank's abort flag and shuts the call's sockets on any
failure that breaks the group (``rc_exec``), so a local peer stops waiting at once and a
remote one reads the end of its stream; a local peer whose process is gone is named
(``RankFailedError``) from its pid at the next tick of a wait.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

import numpy as np

from raycoll.coordinator.logic import fingerprint_mismatch
from raycoll.native import core
from raycoll.transport.base import segment_failure
from raycoll.transport.fingerprints import Fingerprints
from raycoll.transport.segment import _half_bytes, agree_segment

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.context import Call, GroupContext

logger = logging.getLogger("raycoll")

__all__ = ["NodeSegment", "set_up_node_segment", "node_segment_possible"]


def segment_ranks(node_ids: Sequence[str], rank: int) -> Tuple[int, ...]:
    """The group ranks that share ``rank``'s node segment, by local rank (group-rank order:
    as :func:`raycoll.algorithms.node_plans.layout` numbers them)."""
    return tuple(r for r, n in enumerate(node_ids) if n == node_ids[rank])


def node_segment_possible(ctx: "GroupContext") -> bool:
    """Whether group ``ctx`` may run hierarchical plans: the native core is built and on (on
    every rank), the group spans several nodes, ``transport`` is ``"auto"``, and some node
    holds 2+ of its ranks (else there is nothing for a segment to do)."""
    if core is None or not ctx.native or ctx.size < 3 or ctx.single_node \
            or ctx.transport != "auto" or ctx.secret is None:
        return False
    return len(set(ctx.node_ids)) < ctx.size and ctx.size <= core.MAX_RANKS


class NodeSegment:
    """This rank's part of its group's node segments: its own node's segment (``seg``;
    ``None`` on a node with one rank of the group), the group ranks sharing it (by local
    rank), and the smallest half of the group's nodes (what the plans stream through)."""

    def __init__(self, seg: Any, ranks: Tuple[int, ...], half: int) -> None:
        self.seg = seg
        self.ranks = ranks
        #: each local rank's group rank, as the executor's waits name pending ranks by
        self.rank_map = np.array(ranks, dtype=np.int32).tobytes()
        self.half = half
        self._fps = Fingerprints()

    def encode(self, fp: Any) -> bytes:
        """The call's fingerprint as the segment compares it (none without a segment)."""
        return self._fps.encode(fp) if self.seg is not None else b""

    def close(self) -> None:
        """Unmap the segment (a run in flight in another thread ends first: ``CLOSED``)."""
        if self.seg is not None:
            self.seg.close()

    def mismatch(self, ctx: "GroupContext") -> Optional[str]:
        """What the node's ranks disagreed on at the call's first step (a ``MISMATCH`` of the
        segment), or ``None`` where they agree (the mismatch came over a socket)."""
        if self.seg is None:
            return None
        parity = self.seg.step & 1
        try:
            fps = {self.ranks[j]: Fingerprints.decode(self.seg.info(j, parity)["fp"])
                   for j in range(len(self.ranks))}
        except Exception:  # noqa: BLE001 - an undecodable info: the sockets' words then
            return None
        return fingerprint_mismatch(fps, ctx.global_ranks)

    def failed(self, ctx: "GroupContext", tcp: Any, call: "Call", status: int,
               peer: int) -> Optional[BaseException]:
        """The error of a run that ended with a status of the segment's (``peer``: a local
        rank), or ``None`` for the sockets' statuses; a failure that breaks the group shuts
        the sockets too (ranks that arrive later, on any node, fail too)."""
        return segment_failure(tcp, call, self.seg, status, peer, self.ranks, tcp.fail_broken)


def set_up_node_segment(ctx: "GroupContext", call: "Call") -> Optional[NodeSegment]:
    """Set up the group's node segments inside ``call`` (two steps through the coordinator,
    alike on every rank): this rank's :class:`NodeSegment`, or ``None`` on every rank where
    any node could not (each says why in the log)."""
    mates = segment_ranks(ctx.node_ids, ctx.rank)
    seg, ok = agree_segment(ctx, call, mates, "node segments", lambda seg: seg.half_bytes)
    ctx.skip_setup_step(call)  # the call's own coordinator steps (if any) move past these
    if seg is None and len(mates) > 1 or not all(good for good, _, _ in ok):
        return None
    halves = [h for _, _, h in ok if h]
    return NodeSegment(seg, mates, min(halves) if halves else _half_bytes(ctx))
