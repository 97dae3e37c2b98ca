"""What the ranks of a root group keep of its old generation when it shrinks or grows: their
direct connections with each other, where their streams are whole.

A kept rank offers, with its arrival at the membership change
(:meth:`raycoll.coordinator.elastic.ElasticMixin.reconfigure`), the connections of its
native data plane (purpose ``"ncoll"``) whose streams it knows whole (not shut by the core
after a failure, nothing read ahead, no byte waiting) and its last sequence number; the
coordinator hands every rank all the offers. A connection is kept where both its ends
offered it (the same rule on both ends: they keep it or close it together), renumbered to
the ranks of the new generation; the others, and every connection with an excluded rank,
are closed. The new generation numbers its calls after the highest sequence number any rank
offered, so that a whole message of an old call still on its way when the offers were made
is skipped by its reader as an earlier call's (``raycoll/native/net.c``), never read as a
new one.

After a rank died in the middle of a collective on direct connections, every rank whose call
failed had its connections shut by the core (its peers must stop waiting at once): nothing
is whole, and the next generation connects again. What a change keeps is the connections of
a healthy group (a grow, a shrink of live ranks) and of ranks that found the failure
between calls.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from raycoll.transport.native_tcp import NativeSockets

__all__ = ["Offer", "offer", "settle", "adopt", "discard"]

#: The purpose of the connections kept: the native data plane's (the others are made again).
PURPOSE = "ncoll"


@dataclass
class Offer:
    """What this rank offers to keep (``report``, sent with its arrival) and, where already
    taken out of the old links (a shrink), the connections themselves."""

    report: Dict[str, Any]
    links: Any = None
    conns: Dict[Tuple[str, int], Any] = field(default_factory=dict)


def offer(pg: Any, peers: Sequence[int], take: bool) -> Offer:
    """This rank's offer for root group ``pg``'s next generation: its connections with the
    group ranks ``peers`` (those that stay) whose streams are whole, and its last sequence
    number; ``take``: take them out of the old links now (the old group is closed next)."""
    transports = pg.context._transports
    links = getattr(transports, "links", None)
    plane = pg.context._plane  # the native sockets (NativeSockets), where the group has them
    whole: List[Tuple[str, int]] = []
    if links is not None and isinstance(plane, NativeSockets) and not plane._poisoned:
        whole = links.whole(PURPOSE, peers, plane.whole)
    result = Offer({"old": pg.rank(), "seq": pg._seq, "whole": whole}, links)
    if take and whole and links is not None:
        result.conns = links.hand_over(PURPOSE, whole)
    return result


def settle(mine: Optional[Offer], answer: Mapping[str, Any]
           ) -> Tuple[Dict[Tuple[str, int], Any], int]:
    """What this rank keeps, once the change is made (``answer``: the coordinator's): the
    connections both ends offered, taken out of the old links (if ``mine`` has not yet) and
    keyed by the new generation's ranks, and the sequence number the new generation starts
    after (the highest offered). The rest of this rank's offer is closed."""
    hands: Dict[int, Dict[str, Any]] = {int(r): h for r, h in (answer.get("hands") or {}).items()}
    seq = max([int(h.get("seq", 0)) for h in hands.values()] + [0])
    if mine is None or not mine.report["whole"]:
        return {}, seq
    by_old = {int(h["old"]): (rank, {tuple(k) for k in h.get("whole", ())})
              for rank, h in hands.items()}
    me = mine.report["old"]
    keep: Dict[Tuple[str, int], Tuple[str, int]] = {}  # old key -> new key
    for direction, peer in mine.report["whole"]:
        other = by_old.get(peer)
        mirror = ("in" if direction == "out" else "out", me)
        if other is not None and mirror in other[1]:
            keep[(direction, peer)] = (direction, other[0])
    if not mine.conns and keep and mine.links is not None:  # a grow: the old links hold them
        mine.conns = mine.links.hand_over(PURPOSE, list(keep))
    kept = {keep[k]: conn for k, conn in mine.conns.items() if k in keep}
    for k, conn in mine.conns.items():
        if k not in keep:
            _close(conn)
    mine.conns = {}
    return kept, seq


def adopt(pg: Any, kept: Dict[Tuple[str, int], Any], seq: int) -> int:
    """Give the new generation's group ``pg`` (this rank's handle) the connections ``kept``
    (from :func:`settle`) and start its sequence numbers after ``seq``. Returns how many
    connections it took."""
    pg._seq = max(pg._seq, seq)
    links = getattr(pg.context._transports, "links", None)
    if links is None:
        for conn in kept.values():
            _close(conn)
        return 0
    if kept:
        links.adopt(PURPOSE, kept)
    return len(kept)


def discard(mine: Optional[Offer]) -> None:
    """Close the connections of an offer that was not taken up (the change failed)."""
    if mine is not None:
        for conn in mine.conns.values():
            _close(conn)
        mine.conns = {}


def _close(conn: Any) -> None:
    sock = getattr(conn, "sock", conn)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
