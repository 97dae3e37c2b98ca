"""The point-to-point mailbox: sends and receives matched at the coordinator.

Used when a pair of ranks has no direct connection: a send is posted for its destination and
resolves once a receive matched it; a receive takes the first posted send from its source
(``None``: any) with its tag, or waits for one. Mismatched metadata fails both sides; an
abort fails every posted send and receive of the broken groups (see ``StepsMixin.abort``).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Callable, Optional, Sequence

from raycoll.coordinator.liveness import PROBE_AFTER_S
from raycoll.coordinator.logic import Result, err, ok, p2p_mismatch
from raycoll.coordinator.state import CoordinatorState, Message, Receiver


class MailboxMixin(CoordinatorState):
    """Point-to-point RPCs: ``p2p_send``, ``p2p_recv``, ``p2p_check``."""

    async def p2p_send(self, key: str, src: int, dst: int, tag: int, meta: Any, payload: Any,
                       timeout_s: float) -> Result:
        """Post a message from group rank ``src`` to ``dst``; resolves once a recv matched it."""
        failed = self._unusable(key)
        if failed is not None:
            return failed
        loop = asyncio.get_running_loop()
        receivers = self._waiting[(key, dst)]
        for i, rcv in enumerate(receivers):
            if (rcv.src is None or rcv.src == src) and rcv.tag == tag:
                del receivers[i]
                return self._match(key, src, dst, tag, meta, payload, rcv.meta, rcv.future)
        msg = Message(src, tag, meta, payload, loop.create_future())
        self._mail[(key, dst)].append(msg)
        return await self._await_p2p(msg.future, timeout_s, lambda: self._drop_msg(key, dst, msg),
                                     f"send from rank {src} to rank {dst} (tag {tag}) on group "
                                     f"{key!r} was not received within {timeout_s:g}s")

    async def p2p_recv(self, key: str, src: Optional[int], dst: int, tag: int, meta: Any,
                       timeout_s: float) -> Result:
        """Receive at group rank ``dst`` from ``src`` (``None``: any); returns ``(src, payload)``."""
        failed = self._unusable(key)
        if failed is not None:
            return failed
        loop = asyncio.get_running_loop()
        mailbox = self._mail[(key, dst)]
        for i, msg in enumerate(mailbox):
            if (src is None or msg.src == src) and msg.tag == tag:
                del mailbox[i]
                here: "asyncio.Future[Result]" = loop.create_future()
                result = self._match(key, msg.src, dst, tag, msg.meta, msg.payload, meta, here,
                                     sender=msg.future)
                return here.result() if here.done() else result
        rcv = Receiver(src, tag, meta, loop.create_future())
        self._waiting[(key, dst)].append(rcv)
        who = "any rank" if src is None else f"rank {src}"
        return await self._await_p2p(rcv.future, timeout_s, lambda: self._drop_rcv(key, dst, rcv),
                                     f"recv at rank {dst} from {who} (tag {tag}) on group {key!r} "
                                     f"got no message within {timeout_s:g}s")

    def p2p_check(self, key: str, waiting: Sequence[int], waited_s: float) -> Result:
        """A point-to-point wait on direct connections has lasted ``waited_s`` for global
        ranks ``waiting``: the error that ends it (a dead rank, a broken group), if any. Past
        ``PROBE_AFTER_S`` those ranks are probed, as for waits here (``waited_s`` infinite:
        at once, however recently they answered)."""
        if waited_s >= PROBE_AFTER_S:
            now = time.monotonic()
            for g in waiting:
                self._probe_if_due(g, now, force=waited_s == math.inf)
        failed = self._unusable(key)
        return failed if failed is not None else ok()

    # ------------------------------------------------------------------ internals
    def _match(self, key: str, src: int, dst: int, tag: int, send_meta: Any, payload: Any,
               recv_meta: Any, receiver: "asyncio.Future[Result]",
               sender: "Optional[asyncio.Future[Result]]" = None) -> Result:
        ranks = self._groups.get(key) or tuple(range(self._world_size))
        error = p2p_mismatch(key, ranks, src, dst, tag, send_meta, recv_meta)
        if error is not None:
            receiver.set_result(error)
            if sender is not None:
                sender.set_result(error)
            return error
        receiver.set_result(ok((src, payload)))
        if sender is not None:
            sender.set_result(ok())
        return ok()

    async def _await_p2p(self, future: "asyncio.Future[Result]", timeout_s: float,
                         drop: Callable[[], None], message: str) -> Result:
        try:
            with self._watching(None):
                return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            if future.done():
                return future.result()
            drop()
            return err("timeout", message)

    def _drop_msg(self, key: str, dst: int, msg: Message) -> None:
        try:
            self._mail[(key, dst)].remove(msg)
        except ValueError:
            pass

    def _drop_rcv(self, key: str, dst: int, rcv: Receiver) -> None:
        try:
            self._waiting[(key, dst)].remove(rcv)
        except ValueError:
            pass
