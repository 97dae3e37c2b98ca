"""Point-to-point messages over a group's ``"p2p"`` direct connections (:class:`Mailbox`;
see :mod:`raycoll.transport.tcp` for the whole design)."""

from __future__ import annotations

import functools
import pickle
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from raycoll import errors
from raycoll.transport.base import may_spin
from raycoll.transport.frames import (
    GOODBYES,
    FrameError,
    PeerLeft,
    Reader,
    Writer,
    encode_raw,
    fresh_buffers,
)
from raycoll.transport.links import Links, Out, peer_failure, send_all

__all__ = ["Mailbox", "P2P_SPIN_S"]

#: How long a receive polls its sockets before it sleeps in select, where each rank has a
#: core (a wake-up from select costs about as long as a small reply takes to come).
P2P_SPIN_S = 0.001


class _Posted:
    """A receive waiting for its message."""

    __slots__ = ("src", "tag", "arr", "meta", "done", "claimed", "source", "error")

    def __init__(self, src: Optional[int], tag: int, arr: np.ndarray, meta: Any) -> None:
        self.src, self.tag, self.arr, self.meta = src, tag, arr, meta
        self.done = False
        self.claimed = False
        self.source: Optional[int] = None
        self.error: Optional[BaseException] = None


def _fmt_meta(meta: Any) -> str:
    dtype, shape = meta
    return f"dtype={dtype}, shape={tuple(shape)}"


class Mailbox:
    """Point-to-point messages of one group on this rank, over its ``"p2p"`` connections.

    A send is handed to the kernel at once when the connection is free (a small message
    completes then, as in torch); the rest of a large one is written by whoever waits for
    the send. Messages from one rank to another keep their order. Receives match messages in
    the order they were posted (by source and tag); a message that comes before its receive
    is kept. Whoever waits for a receive reads the sockets (one reader at a time), straight
    into a matched receive's array.
    """

    def __init__(self, links: Links, *, group: str, global_ranks: Sequence[int],
                 check: Callable[[Sequence[int], float], None],
                 explain: Callable[[Sequence[int]], Optional[BaseException]],
                 spin_s: float = 0.0) -> None:
        self.links = links
        self.group = group
        self.global_ranks = tuple(global_ranks)
        self._check = check
        self._explain = explain
        #: a receive polls its sockets this long before it sleeps in select (a wake-up from
        #: select costs more than a short reply takes to come); 0 where ranks share cores
        self.spin_s = spin_s
        self._cv = threading.Condition()
        self._posted: List[_Posted] = []
        self._stash: List[Tuple[int, int, Any, np.ndarray]] = []
        self._reading = False
        self._readers: Dict[int, Reader] = {}
        self._failed: Dict[int, BaseException] = {}
        #: per source: the message being read (its tag, meta and the receive it goes to)
        self._current: Dict[int, Tuple[int, Any, Optional[_Posted]]] = {}

    # -- sending
    def send(self, arr: np.ndarray, dst: int, tag: int, meta: Any,
             timeout_s: float) -> Callable[[], None]:
        data = np.ascontiguousarray(arr)
        out = self.links.outgoing(dst, "p2p", timeout_s)
        writer = Writer(encode_raw((tag, meta), data.data.cast("B")))
        with out.turn:
            ticket = out.next_ticket
            out.next_ticket += 1
            if out.serving == ticket and out.broken is None and writer.push(out.sock):
                out.serving += 1
                out.turn.notify_all()
                return lambda: None
        return lambda: self._finish_send(out, writer, ticket, dst, tag, timeout_s, data)

    def _finish_send(self, out: Out, writer: Writer, ticket: int, dst: int, tag: int,
                     timeout_s: float, _data: np.ndarray) -> None:
        deadline = time.monotonic() + timeout_s
        what = (f"send from rank {self.global_ranks[self.links.rank]} to rank "
                f"{self.global_ranks[dst]} (tag {tag}) on group {self.group!r}")
        with out.turn:
            while out.serving != ticket and out.broken is None:
                if not out.turn.wait(max(0.0, deadline - time.monotonic())):
                    break
            if out.broken is not None or out.serving != ticket:
                raise out.broken or self._timed_out(what, [dst], timeout_s)
        try:
            send_all(self.links, out, writer, deadline,
                     lambda: self._check([dst], time.monotonic() - deadline + timeout_s))
        except TimeoutError:
            error = self._timed_out(f"{what} was not received within {timeout_s:g}s", [dst],
                                    timeout_s)
            self._break_out(out, dst, error)
            raise error from None
        except errors.RaycollError as exc:
            self._break_out(out, dst, exc)
            raise
        except OSError as exc:
            error = self._explain(self.links.suspects(dst, exc)) or peer_failure(
                self.links, self.global_ranks, what, dst, exc, group=self.group, op="send")
            self._break_out(out, dst, error)
            raise error from exc
        with out.turn:
            out.serving += 1
            out.turn.notify_all()

    def _break_out(self, out: Out, dst: int, error: BaseException) -> None:
        """A message went out in part: the connection is no longer whole."""
        with out.turn:
            out.broken = error
            out.turn.notify_all()
        self.links.drop(dst, "p2p", out)

    def _timed_out(self, message: str, peers: Sequence[int], timeout_s: float) -> BaseException:
        who = [self.global_ranks[p] for p in peers]
        return errors.DistTimeoutError(message, missing=who, group=self.group,
                                       rank=self.global_ranks[self.links.rank])

    # -- receiving
    def recv(self, arr: np.ndarray, src: Optional[int], tag: int, meta: Any,
             timeout_s: float) -> Callable[[], int]:
        posted = _Posted(src, tag, arr, meta)
        with self._cv:
            for i, (s, t, m, data) in enumerate(self._stash):
                if (src is None or s == src) and t == tag:
                    del self._stash[i]
                    self._deliver(posted, s, m, data)
                    break
            else:
                self._posted.append(posted)
        return lambda: self._wait(posted, timeout_s)

    def _deliver(self, posted: _Posted, src: int, meta: Any, data: Optional[np.ndarray]) -> None:
        """Complete ``posted`` with a message from ``src`` (``data``: ``None`` when it was
        read straight into the posted array)."""
        posted.done, posted.source = True, src
        if meta != posted.meta:
            posted.error = errors.CollectiveMismatchError(
                f"send from rank {self.global_ranks[src]} to rank "
                f"{self.global_ranks[self.links.rank]} (tag {posted.tag}) on group "
                f"{self.group!r}: the sender sent {_fmt_meta(meta)} but the receiver expects "
                f"{_fmt_meta(posted.meta)}", group=self.group, op="recv",
                rank=self.global_ranks[self.links.rank])
        elif data is not None:
            flat = data.view(posted.arr.dtype).reshape(posted.arr.shape)
            np.copyto(posted.arr, flat)

    def _wait(self, posted: _Posted, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        begun = time.monotonic()
        next_check = begun + 0.1
        every = 0.1
        # read at once (the message is often there already), then poll until spin_until
        # unless the caller computes beside this wait (an async receive nobody waits for)
        spin_until = begun + self.spin_s if self.spin_s and may_spin() else begun
        while True:
            with self._cv:
                while not posted.done and self._reading:
                    self._cv.wait(0.05)
                    if time.monotonic() > deadline:
                        break
                if posted.done:
                    if posted.error is not None:
                        raise posted.error
                    return int(posted.source)  # type: ignore[arg-type]
                now = time.monotonic()
                if now > deadline:
                    self._posted = [p for p in self._posted if p is not posted]
                    who = ("any rank" if posted.src is None
                           else f"rank {self.global_ranks[posted.src]}")
                    raise self._timed_out(
                        f"recv at rank {self.global_ranks[self.links.rank]} from {who} "
                        f"(tag {posted.tag}) on group {self.group!r} got no message within "
                        f"{timeout_s:g}s", [] if posted.src is None else [posted.src],
                        timeout_s)
                self._reading = True
            try:
                self._pump(posted, min(0.05, deadline - now), wait=now > spin_until)
                if time.monotonic() >= next_check and not posted.done:
                    peers = [posted.src] if posted.src is not None else [
                        j for j in range(self.links.size) if j != self.links.rank]
                    self._check(peers, time.monotonic() - begun)
                    every = min(2 * every, 1.0)
                    next_check = time.monotonic() + every
            except BaseException:
                with self._cv:
                    self._posted = [p for p in self._posted if p is not posted]
                raise
            finally:
                with self._cv:
                    self._reading = False
                    self._cv.notify_all()

    def _pump(self, posted: _Posted, seconds: float, wait: bool = True) -> None:
        """Read what has come on the p2p connections (this thread is the reader); ``wait``:
        first wait up to ``seconds`` for something to come."""
        srcs = ([posted.src] if posted.src is not None
                else [j for j in range(self.links.size) if j != self.links.rank])
        socks = {}
        live = [s for s in srcs if s not in self._failed]
        if not live:  # every rank this receive can come from failed or left
            raise self._failed[srcs[0]]
        for s in live:
            sock = self.links.incoming(s, "p2p")
            if sock is not None:
                socks[s] = sock
        if wait:
            self.links.wait(list(socks.values()), [], seconds)
        for s, sock in socks.items():
            reader = self._readers.get(s)
            if reader is None:
                reader = self._readers[s] = Reader()
            try:
                while True:
                    got = reader.pull(sock, functools.partial(self._place, s))
                    if got is None:
                        break
                    self._arrived(s, got)
            except PeerLeft as exc:  # fails only the receives that wait for it
                self._failed[s] = peer_failure(
                    self.links, self.global_ranks, f"recv on group {self.group!r}", s, exc,
                    group=self.group, op="recv")
                if not posted.done and posted.src == s:
                    raise self._failed[s] from exc
            except (OSError, FrameError) as exc:
                error = self._explain(self.links.suspects(s, exc)) or peer_failure(
                    self.links, self.global_ranks, f"recv on group {self.group!r}", s, exc,
                    group=self.group, op="recv")
                self._failed[s] = error
                raise error from exc

    def _place(self, src: int, meta_bytes: bytes, lens: List[int]) -> List[memoryview]:
        """Where a message's data goes: a matching receive's array, or a new buffer."""
        message = pickle.loads(meta_bytes)
        if message in GOODBYES:
            raise PeerLeft(f"rank {self.global_ranks[src]} closed the connection", message)
        tag, meta = message
        with self._cv:
            for p in self._posted:
                if not p.claimed and (p.src is None or p.src == src) and p.tag == tag:
                    p.claimed = True
                    self._current[src] = (tag, meta, p)
                    if meta == p.meta and p.arr.flags.c_contiguous and p.arr.flags.writeable \
                            and len(lens) == 1 and lens[0] == p.arr.nbytes:
                        return [p.arr.data.cast("B")]
                    return fresh_buffers(meta_bytes, lens)
        self._current[src] = (tag, meta, None)
        return fresh_buffers(meta_bytes, lens)

    def _arrived(self, src: int, got: Tuple[bytes, List[Any]]) -> None:
        tag, meta, posted = self._current.pop(src)
        buf = got[1][0] if got[1] else memoryview(b"")
        direct = posted is not None and buf.obj is not None and posted.arr.flags.c_contiguous \
            and isinstance(buf.obj, np.ndarray) and np.shares_memory(buf.obj, posted.arr)
        data = None if direct else np.frombuffer(buf, dtype=np.uint8)
        with self._cv:
            if posted is None:  # a receive may have been posted while the message came in
                posted = next((p for p in self._posted if not p.claimed and p.tag == tag
                               and (p.src is None or p.src == src)), None)
            if posted is None:
                assert data is not None  # read straight into an array only for a posted receive
                self._stash.append((src, tag, meta, data))
            else:
                self._posted = [p for p in self._posted if p is not posted]
                self._deliver(posted, src, meta, data)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stash.clear()
            self._posted.clear()
            self._cv.notify_all()
