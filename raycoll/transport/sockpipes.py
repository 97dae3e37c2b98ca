"""Pair pipes to ranks on other nodes: the native core's socket pipes
(``raycoll/native/sockpipe.h``) over the group's ``"p2p"`` direct connections, with the
shared-memory pipes' interface, so that :class:`raycoll.transport.pipes.PairPipes` matches
messages the same way for every peer.

A socket pipe sends on this rank's connection to the peer (made on the pipe's first use)
and receives on the peer's connection to this rank, which comes when the peer first sends
(:func:`attach_in` attaches it once the listener accepted it)."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

from raycoll import errors
from raycoll.native import core

__all__ = ["open_sock_pipe", "attach_in", "await_in", "sock_failure"]

#: A receive waiting for the peer's connection checks the group's health this often.
_CHECK_S = 0.05


def open_sock_pipe(links: Any, peer: int, timeout_s: float) -> Any:
    """A socket pipe to group rank ``peer``: this rank's connection to it (connecting), and
    the peer's connection to this rank if it came already. Raises ``OSError`` where the
    peer cannot be reached."""
    out = links.outgoing(peer, "p2p", timeout_s)
    pipe = core.SockPipe(out.sock.fileno(), -1)
    attach_in(links, peer, pipe)
    return pipe


def attach_in(links: Any, peer: int, pipe: Any, wait_s: float = 0.0) -> bool:
    """Attach the peer's connection to ``pipe`` if it came (waiting up to ``wait_s`` for it):
    whether it is attached."""
    if pipe.attached:
        return True
    sock = links.incoming(peer, "p2p", wait_s)
    if sock is None:
        return False
    pipe.attach_in(sock.fileno())
    return True


def await_in(links: Any, peer: int, pipe: Any, deadline: float,
             check: Callable[[float], None], timed_out: Callable[[], BaseException]) -> None:
    """Wait until the peer's connection came (it connects with its first send; the listener
    wakes this wait), calling ``check(waited_s)`` at least every ``_CHECK_S`` and raising
    ``timed_out()`` past ``deadline``."""
    begun = time.monotonic()
    while True:
        now = time.monotonic()
        if attach_in(links, peer, pipe, max(0.0, min(_CHECK_S, deadline - now))):
            return
        if pipe.closed:
            return  # the next native call says CLOSED
        now = time.monotonic()
        if now > deadline:
            raise timed_out()
        check(now - begun)


def sock_failure(status: int, what: str, me: int, them: int, group: str,
                 explain: Callable[[Sequence[int]], Optional[BaseException]],
                 peer: int) -> Optional[BaseException]:
    """The error of a socket pipe's failed call with group rank ``peer`` (global ``them``),
    or ``None`` for a status a shared-memory pipe also returns."""
    if status == core.PEER_CLOSED:
        return explain([peer]) or errors.RankFailedError(
            f"{what}: rank {them}'s connection closed (its process died); the group is broken",
            failed_ranks=[them], group=group, rank=me)
    if status == core.FOREIGN:
        return errors.GroupBrokenError(
            f"{what}: rank {them} left the group (destroyed it) while rank {me} still needed "
            "it; the group is broken", group=group, rank=me)
    if status in (core.GARBLED, core.IOERR):
        return explain([peer]) or errors.GroupBrokenError(
            f"{what}: the connection between rank {me} and rank {them} failed (status "
            f"{status}); the group is broken", group=group, rank=me)
    return None
