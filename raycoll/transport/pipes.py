"""Point-to-point messages between ranks over the native core's pair pipes
(:class:`PairPipes`; the layout and protocol are in ``raycoll/native/pipe.h`` and
``raycoll/native/sockpipe.h``).

A group where every rank runs the native core sends and receives through one pipe per pair
of ranks, made by the pair's first message: a shared-memory pipe between two ranks on one
node (both ranks derive its name from the group's secret; whichever comes first creates it),
a socket pipe over the group's ``"p2p"`` direct connections between ranks on two nodes
(:mod:`raycoll.transport.sockpipes`). Both have one interface, so the matching below is the
same for every peer. The native core moves the bytes and waits (spinning briefly where ranks
fit the cores, then on a futex or in poll), with the GIL released; Python matches messages to
receives.

- **Sends** keep their order per destination (a ticket each, taken when the send is posted).
  A message of at most ``EAGER_BYTES`` that fits the pipe's free space goes at once: the
  send completes without the receiver, as torch's does. A larger one streams through the
  ring while the receiver reads, and completes once the receiver took it whole (so a
  receiver that rejects it, a dtype or shape that differ, fails the sender too).
- **Receives** match messages by source and tag, in the order they were posted; a message
  that comes before its receive is kept (copied out of the pipe). The common case (the next
  message is the receive's) is one native call: the wait and the copy into the receive's
  array. A receive from any source (``src=None``) polls every peer's pipe.
- **Failures**: a peer's process gone ends a wait with ``RankFailedError`` (the pipe's
  liveness tick, or the coordinator); a timeout or the coordinator's error ends it through
  the check the wait calls; a message left mid-way breaks that pair's pipe (both sides fail
  with ``GroupBrokenError``); a dtype or shape mismatch is ``CollectiveMismatchError``.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from raycoll import errors
from raycoll.native import core
from raycoll.transport import sockpipes
from raycoll.transport.base import CHECK_FIRST_S, CHECK_MAX_S, SpinBackoff, may_spin, wait_policy

__all__ = ["PairPipes", "EAGER_BYTES", "RING_BYTES", "SPIN_S"]

#: Each direction's ring of a pair pipe.
RING_BYTES = 512 << 10
#: Sends of at most this many bytes complete without the receiver (when the ring has room).
EAGER_BYTES = 64 << 10
#: How long a wait spins before it sleeps (ranks that fit the node's cores only).
SPIN_S = 200e-6
#: How long a rank waits for its peer to finish making the pair's pipe.
OPEN_WAIT_S = 10.0
#: Any-source receives poll the pipes, sleeping from this up to ``POLL_MAX_S`` between polls.
POLL_MIN_S = 20e-6
POLL_MAX_S = 1e-3

Meta = Tuple[str, Tuple[int, ...]]


@functools.lru_cache(maxsize=256)
def encode_meta(meta: Meta) -> bytes:
    """A message's dtype and shape as the pipe carries them (compared whole by the
    receiver); a shape too long for the header travels as a hash."""
    dtype, shape = meta
    text = f"{dtype}|{','.join(str(int(d)) for d in shape)}".encode()
    if len(text) <= core.PIPE_META_BYTES:
        return text
    digest = hashlib.blake2b(text, digest_size=16).hexdigest()
    return f"{dtype}|#{digest}".encode()[:core.PIPE_META_BYTES]


def describe_meta(meta: bytes) -> str:
    """``dtype=..., shape=(...)`` of an encoded meta (as the errors say it)."""
    dtype, _, shape = meta.decode(errors="replace").partition("|")
    if shape.startswith("#"):
        return f"dtype={dtype}, shape=<a shape of hash {shape[1:9]}>"
    dims = tuple(int(d) for d in shape.split(",") if d)
    return f"dtype={dtype}, shape={dims}"


class _Posted:
    """A receive waiting for its message."""

    __slots__ = ("src", "tag", "arr", "meta", "done", "claimed", "source", "error")

    def __init__(self, src: Optional[int], tag: int, arr: np.ndarray, meta: bytes) -> None:
        self.src, self.tag, self.arr, self.meta = src, tag, arr, meta
        self.done = False
        self.claimed = False
        self.source: Optional[int] = None
        self.error: Optional[BaseException] = None


class _Out:
    """The send side of one pair: sends go in ticket order."""

    __slots__ = ("turn", "next_ticket", "serving")

    def __init__(self) -> None:
        self.turn = threading.Condition()
        self.next_ticket = 0
        self.serving = 0


class PairPipes:
    """Point-to-point messages of one group on this rank over pair pipes (module
    docstring)."""

    def __init__(self, *, group: str, rank: int, global_ranks: Sequence[int], secret: bytes,
                 check: Callable[[Sequence[int], float], None],
                 explain: Callable[[Sequence[int]], Optional[BaseException]],
                 crowded: bool, links: Any = None, remote: Sequence[int] = ()) -> None:
        self.group = group
        #: the group's direct connections, and the group ranks on other nodes (socket pipes)
        self._links = links
        self._remote = frozenset(remote)
        self.rank = rank
        self.global_ranks = tuple(global_ranks)
        self._secret = secret
        self._check = check
        self._explain = explain
        #: where ranks outnumber the cores a wait never spins
        self.spin_ns = 0 if crowded else int(SPIN_S * 1e9)
        #: spins that keep running out (the peer descheduled: a loaded node) stop for a while
        self._backoff = SpinBackoff(bool(self.spin_ns))
        self._waits = 0
        self._lock = threading.Lock()
        self._pipes: Dict[int, Any] = {}
        self._outs: Dict[int, _Out] = {}
        self._cv = threading.Condition()
        self._posted: List[_Posted] = []
        self._stash: List[Tuple[int, int, bytes, np.ndarray]] = []
        self._reading: Dict[int, bool] = {}
        self._failed: Dict[int, BaseException] = {}
        self._closed = False

    # -- the pipes
    def _name(self, peer: int) -> str:
        lo, hi = sorted((self.global_ranks[self.rank], self.global_ranks[peer]))
        digest = hashlib.blake2b(self._secret + self.group.encode() + f"|{lo}|{hi}".encode(),
                                 digest_size=12).hexdigest()
        return f"/rcp{digest}"

    def _pipe(self, peer: int) -> Any:
        """The pipe to group rank ``peer``, made or mapped on first use."""
        pipe = self._pipes.get(peer)
        if pipe is not None:
            return pipe
        with self._lock:
            if self._closed:
                raise errors.GroupBrokenError(
                    f"point-to-point on group {self.group!r}: the group was destroyed on rank "
                    f"{self.global_ranks[self.rank]}", group=self.group)
            pipe = self._pipes.get(peer)
            if pipe is None:
                side = 0 if self.rank < peer else 1
                try:
                    if peer in self._remote:
                        pipe = sockpipes.open_sock_pipe(self._links, peer, OPEN_WAIT_S)
                    else:
                        pipe = core.Pipe(self._name(peer), side, RING_BYTES, OPEN_WAIT_S)
                except OSError as exc:
                    if peer in self._remote:
                        raise self._explain([peer]) or errors.GroupBrokenError(
                            f"point-to-point on group {self.group!r}: rank "
                            f"{self.global_ranks[self.rank]} could not connect to rank "
                            f"{self.global_ranks[peer]}: {exc}", group=self.group) from exc
                    raise errors.GroupBrokenError(
                        f"point-to-point on group {self.group!r}: rank "
                        f"{self.global_ranks[self.rank]} could not open its shared-memory pipe "
                        f"to rank {self.global_ranks[peer]}: {exc}", group=self.group) from exc
                self._pipes[peer] = pipe
                self._outs[peer] = _Out()
        return pipe

    def _wait(self, deadline: float, timeout_s: float, peers: Sequence[int],
              what: Union[str, Callable[[], str]],
              ) -> Tuple[Tuple[int, int, int, int], Callable[[float, Any], None]]:
        """A native wait's policy and its check: the call's deadline, then the coordinator
        (``what``, or what it returns, names the call in a timeout's message)."""
        self._waits += 1
        spin = self.spin_ns if may_spin() and self._backoff.spinning(self._waits) else 0
        first = min(CHECK_FIRST_S, max(timeout_s, 1e-3))
        policy = wait_policy(spin, first)

        def check(waited_s: float, _pending: Any) -> None:
            if time.monotonic() > deadline:
                said = what if isinstance(what, str) else what()
                raise self._timed_out(f"{said} within {timeout_s:g}s", peers)
            self._check(peers, waited_s)

        return policy, check

    def _spun(self, peer: int, pipe: Any) -> None:
        """After a native wait on ``pipe``: a spin that ran its whole length counts toward
        backing off (:class:`raycoll.transport.base.SpinBackoff`)."""
        self._backoff.counted(self._waits, pipe.spin_fails, peer)

    def _timed_out(self, message: str, peers: Sequence[int]) -> BaseException:
        return errors.DistTimeoutError(message, missing=[self.global_ranks[p] for p in peers],
                                       group=self.group, rank=self.global_ranks[self.rank])

    def _failure(self, status: int, peer: int, what: str, exc: Optional[BaseException],
                 broke: int) -> BaseException:
        """The error of a failed native call with ``peer``; one that breaks the pair's pipe
        fails every later call with it."""
        me, them = self.global_ranks[self.rank], self.global_ranks[peer]
        ctx: Dict[str, Any] = {"group": self.group, "rank": me}
        error: BaseException
        sock = sockpipes.sock_failure(status, what, me, them, self.group, self._explain, peer)
        if status == core.CHECK and exc is not None:
            error = exc
        elif sock is not None:
            error = sock
        elif status == core.DEAD:
            error = self._explain([peer]) or errors.RankFailedError(
                f"{what}: rank {them}'s process died; the group is broken",
                failed_ranks=[them], **ctx)
        elif status == core.ABORTED:
            pipe = self._pipes.get(peer)
            state = pipe.state if pipe is not None and not pipe.closed else {}
            if state.get("abort"):
                error = self._failed.get(peer) or errors.GroupBrokenError(
                    f"{what}: this rank's pipe to rank {them} broke earlier", **ctx)
            elif state.get("peer_abort") == core.ABORT_CLOSED:
                error = errors.GroupBrokenError(
                    f"{what}: rank {them} left the group (destroyed it) while rank {me} "
                    "still needed it; the group is broken", **ctx)
            else:
                error = self._explain([peer]) or errors.GroupBrokenError(
                    f"{what}: rank {them} failed in the middle of a message; the pipe "
                    "between them is broken", **ctx)
        elif status == core.CLOSED:
            error = errors.GroupBrokenError(f"{what}: the group was destroyed on rank {me}",
                                            **ctx)
        else:
            error = errors.GroupBrokenError(
                f"{what}: the shared-memory pipe between rank {me} and rank {them} failed "
                f"(status {status}); the group is broken", **ctx)
        if broke or status in (core.DEAD, core.ABORTED, core.CLOSED, core.GARBLED,
                               core.PEER_CLOSED, core.FOREIGN, core.IOERR):
            self._failed.setdefault(peer, error)
            with self._cv:
                self._cv.notify_all()
        return error

    # -- sending
    def send(self, arr: np.ndarray, dst: int, tag: int, meta: Meta,
             timeout_s: float) -> Callable[[], None]:
        data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        code = encode_meta(meta)
        if dst in self._failed:
            raise self._failed[dst]
        pipe = self._pipe(dst)
        if self.send_now(data, dst, tag, code):  # small, nothing before it, room: sent
            return _done
        out = self._outs[dst]
        with out.turn:
            ticket = out.next_ticket
            out.next_ticket += 1
        return lambda: self._finish_send(pipe, out, ticket, data, dst, tag, code, timeout_s)

    def _finish_send(self, pipe: Any, out: _Out, ticket: int, data: np.ndarray, dst: int,
                     tag: int, code: bytes, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        what = (f"send from rank {self.global_ranks[self.rank]} to rank "
                f"{self.global_ranks[dst]} (tag {tag}) on group {self.group!r}")
        with out.turn:
            while out.serving != ticket and dst not in self._failed:
                if not out.turn.wait(max(0.0, deadline - time.monotonic())):
                    break
            if dst in self._failed:
                raise self._failed[dst]
            if out.serving != ticket:
                raise self._timed_out(f"{what}: earlier sends to that rank were not taken "
                                      f"within {timeout_s:g}s", [dst])
        try:
            policy, check = self._wait(deadline, timeout_s, [dst], f"{what} was not received")
            big = data.nbytes > EAGER_BYTES
            status, broke, exc = pipe.send(data, tag, code, True, big, big, policy, check)
            self._spun(dst, pipe)
            if status == core.MISMATCH:
                raise errors.CollectiveMismatchError(
                    f"{what}: the receiver rejected the message ({describe_meta(code)}): its "
                    "receive expects another dtype or shape", group=self.group, op="send",
                    rank=self.global_ranks[self.rank])
            if status != core.OK:
                raise self._failure(status, dst, what, exc, broke)
        finally:
            with out.turn:
                out.serving += 1
                out.turn.notify_all()

    # -- the short path of a blocking send or receive
    def send_now(self, data: np.ndarray, dst: int, tag: int, code: bytes) -> bool:
        """``raycoll.send``'s short path: ``data`` (flat bytes of at most ``EAGER_BYTES``) into
        the open pipe to ``dst`` at once, when no earlier send to it is pending and the ring
        has room. ``False``: nothing was sent (the caller takes :meth:`send`)."""
        pipe = self._pipes.get(dst)
        out = self._outs.get(dst)
        if pipe is None or out is None or dst in self._failed or data.nbytes > EAGER_BYTES:
            return False
        with out.turn:
            if out.serving != out.next_ticket:
                return False
            status, _, _ = pipe.send(data, tag, code, False, False, False, (0, 0, 0, 0), None)
            if status != core.OK:
                return False
            out.next_ticket += 1
            out.serving += 1
        return True

    def recv_now(self, arr: np.ndarray, src: int, tag: int, code: bytes,
                 timeout_s: float) -> bool:
        """``raycoll.recv``'s short path from ``src`` into ``arr`` (C-contiguous, writable):
        where no other receive is posted, no message is kept and nobody reads ``src``'s open
        pipe, one native call waits for the next message and copies it in (matched as
        :meth:`recv` matches it). ``False``: nothing was taken (the next message has another
        tag, say); the caller takes :meth:`recv`."""
        pipe = self._pipes.get(src)
        with self._cv:
            if (pipe is None or self._posted or self._stash or self._reading.get(src)
                    or src in self._failed
                    or (src in self._remote and not sockpipes.attach_in(self._links, src, pipe))):
                return False
            self._reading[src] = True
        try:
            def what() -> str:
                return (f"recv at rank {self.global_ranks[self.rank]} from rank "
                        f"{self.global_ranks[src]} (tag {tag}) on group {self.group!r} got "
                        "no message")

            policy, check = self._wait(time.monotonic() + timeout_s, timeout_s, [src], what)
            status, _, _, meta, broke, exc = pipe.recv(arr.reshape(-1).view(np.uint8), tag,
                                                       code, policy, check)
            self._spun(src, pipe)
            if status == core.OK:
                return True
            if status == core.MISMATCH:
                raise self._mismatch(_Posted(src, tag, arr, code), src,
                                     meta if meta != code else b"")
            if status == core.PIPE_OTHER:
                return False
            raise self._failure(status, src, what(), exc, broke)
        finally:
            with self._cv:
                self._reading[src] = False
                self._cv.notify_all()

    # -- receiving
    def recv(self, arr: np.ndarray, src: Optional[int], tag: int, meta: Meta,
             timeout_s: float) -> Callable[[], int]:
        posted = _Posted(src, tag, arr, encode_meta(meta))
        with self._cv:
            for i, (s, t, m, data) in enumerate(self._stash):
                if (src is None or s == src) and t == tag:
                    del self._stash[i]
                    self._deliver(posted, s, m, data)
                    break
            else:
                self._posted.append(posted)
        return lambda: self._wait_recv(posted, timeout_s)

    def _deliver(self, posted: _Posted, src: int, meta: bytes, data: Optional[np.ndarray]) -> None:
        """Complete ``posted`` with a message from ``src`` (``data``: ``None`` when it was
        read straight into the posted array); holds ``_cv``."""
        posted.done, posted.source = True, src
        if meta != posted.meta:
            posted.error = self._mismatch(posted, src, meta)
        elif data is not None:
            np.copyto(posted.arr, data.view(posted.arr.dtype).reshape(posted.arr.shape))
        self._cv.notify_all()

    def _mismatch(self, posted: _Posted, src: int, meta: bytes) -> BaseException:
        return errors.CollectiveMismatchError(
            f"send from rank {self.global_ranks[src]} to rank "
            f"{self.global_ranks[self.rank]} (tag {posted.tag}) on group {self.group!r}: the "
            f"sender sent {describe_meta(meta)} but the receiver expects "
            f"{describe_meta(posted.meta)}", group=self.group, op="recv",
            rank=self.global_ranks[self.rank])

    def _wait_recv(self, posted: _Posted, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        who = "any rank" if posted.src is None else f"rank {self.global_ranks[posted.src]}"
        what = (f"recv at rank {self.global_ranks[self.rank]} from {who} (tag {posted.tag}) on "
                f"group {self.group!r} got no message")
        try:
            if posted.src is None:
                self._poll_any(posted, deadline, timeout_s, what)
            else:
                self._read_from(posted, posted.src, deadline, timeout_s, what)
        except BaseException:
            with self._cv:
                self._posted = [p for p in self._posted if p is not posted]
            raise
        if posted.error is not None:
            raise posted.error
        return int(posted.source)  # type: ignore[arg-type]

    def _take_turn(self, src: int, posted: _Posted, deadline: float, timeout_s: float,
                   what: str) -> bool:
        """Become the reader of ``src``'s pipe (True), or find ``posted`` done (False)."""
        with self._cv:
            while not posted.done and self._reading.get(src):
                if src in self._failed:
                    raise self._failed[src]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timed_out(f"{what} within {timeout_s:g}s", [src])
                self._cv.wait(min(left, 0.05))
            if posted.done:
                return False
            if src in self._failed:
                raise self._failed[src]
            self._reading[src] = True
            return True

    def _read_from(self, posted: _Posted, src: int, deadline: float, timeout_s: float,
                   what: str) -> None:
        """Read ``src``'s pipe until ``posted`` is done (messages for other receives go to
        them, or are kept)."""
        pipe = self._pipe(src)
        if src in self._remote:  # the peer's connection comes with its first send
            sockpipes.await_in(self._links, src, pipe, deadline,
                               lambda waited: self._check([src], waited),
                               lambda: self._timed_out(f"{what} within {timeout_s:g}s", [src]))
        while self._take_turn(src, posted, deadline, timeout_s, what):
            try:
                policy, check = self._wait(deadline, timeout_s, [src], what)
                with self._cv:  # the common case: the next message of src with this tag is
                    fast = not posted.claimed and posted.arr.flags.c_contiguous and not any(
                        p is not posted and not p.claimed and p.tag == posted.tag
                        and p.src in (src, None) for p in self._earlier(posted))
                    if fast:  # ... this receive's: one native call waits and copies
                        posted.claimed = True
                if fast:
                    got = pipe.recv(posted.arr.reshape(-1).view(np.uint8), posted.tag,
                                    posted.meta, policy, check)
                    self._spun(src, pipe)
                    status, tag, nbytes, meta, broke, exc = got
                    with self._cv:
                        if status in (core.OK, core.MISMATCH):
                            self._posted = [p for p in self._posted if p is not posted]
                            if status == core.OK:
                                self._deliver(posted, src, posted.meta, None)
                            else:
                                self._deliver(posted, src, meta if meta != posted.meta
                                              else b"", None)
                            continue
                        posted.claimed = False
                else:
                    got = pipe.peek(True, policy, check)
                    self._spun(src, pipe)
                    status, tag, nbytes, meta, broke, exc = got
                if status == core.OK or status == core.PIPE_OTHER:
                    self._route(pipe, src, tag, nbytes, meta, policy, check, what)
                else:
                    raise self._failure(status, src, what, exc, broke)
            finally:
                with self._cv:
                    self._reading[src] = False
                    self._cv.notify_all()

    def _earlier(self, posted: _Posted) -> List[_Posted]:
        """The receives posted before ``posted`` still waiting; holds ``_cv``."""
        for i, p in enumerate(self._posted):
            if p is posted:
                return self._posted[:i]
        return []

    def _route(self, pipe: Any, src: int, tag: int, nbytes: int, meta: bytes, policy: Any,
               check: Any, what: str) -> None:
        """The peeked message of ``src`` into the first receive posted for it, or kept."""
        with self._cv:
            target = next((p for p in self._posted if not p.claimed and p.tag == tag
                           and p.src in (src, None)), None)
            if target is not None:
                target.claimed = True
        fits = (target is not None and meta == target.meta and target.arr.flags.c_contiguous
                and target.arr.nbytes == nbytes)
        into: Optional[np.ndarray]
        if target is None or not fits:
            into = np.empty(nbytes, np.uint8) if target is None or meta == target.meta else None
        else:
            into = target.arr.reshape(-1).view(np.uint8)
        status, broke, exc = pipe.take(into, target is not None and into is None, policy, check)
        if status != core.OK:
            raise self._failure(status, src, what, exc, broke)
        with self._cv:
            if target is None:  # a receive may have been posted while it was read
                target = next((p for p in self._posted if not p.claimed and p.tag == tag
                               and p.src in (src, None)), None)
                if target is None:
                    self._stash.append((src, tag, meta, into))  # type: ignore[arg-type]
                    self._cv.notify_all()
                    return
            self._posted = [p for p in self._posted if p is not target]
            self._deliver(target, src, meta, None if fits else into)

    def _poll_any(self, posted: _Posted, deadline: float, timeout_s: float, what: str) -> None:
        """A receive from any source: poll every peer's pipe until ``posted`` is done."""
        peers = [j for j in range(len(self.global_ranks)) if j != self.rank]
        sleep = POLL_MIN_S
        begun = time.monotonic()
        next_check, every = begun + CHECK_FIRST_S, CHECK_FIRST_S
        while True:
            with self._cv:
                if posted.done:
                    return
            live = [s for s in peers if s not in self._failed]
            if not live:
                raise self._failed[peers[0]]
            found = False
            for s in live:
                with self._cv:
                    if posted.done:
                        return
                    if self._reading.get(s):
                        continue
                    self._reading[s] = True
                try:
                    if s in self._remote and s not in self._pipes \
                            and self._links.incoming(s, "p2p") is None:
                        continue  # nothing came from it yet (no connection made for nothing)
                    pipe = self._pipe(s)
                    if s in self._remote and not sockpipes.attach_in(self._links, s, pipe):
                        continue  # nothing came from it yet
                    status, tag, nbytes, meta, broke, exc = pipe.peek(False, (0, 0, 0, 0), None)
                    if status == core.OK:
                        found = True
                        policy, check = self._wait(deadline, timeout_s, [s], what)
                        self._route(pipe, s, tag, nbytes, meta, policy, check, what)
                    elif status != core.PIPE_AGAIN:
                        self._failure(status, s, what, exc, broke)
                finally:
                    with self._cv:
                        self._reading[s] = False
                        self._cv.notify_all()
            now = time.monotonic()
            if now > deadline:
                raise self._timed_out(f"{what} within {timeout_s:g}s", [])
            if now >= next_check:
                self._check(live, now - begun)
                every = min(2 * every, CHECK_MAX_S)
                next_check = now + every
            if not found:
                time.sleep(sleep)
                sleep = min(2 * sleep, POLL_MAX_S)
            else:
                sleep = POLL_MIN_S

    def close(self) -> None:
        """Give up on every pipe (a peer still waiting on one fails at once) and unmap them."""
        with self._lock:
            self._closed = True
            pipes, self._pipes = list(self._pipes.values()), {}
        for pipe in pipes:
            pipe.close()
        with self._cv:
            self._stash.clear()
            self._posted.clear()
            self._cv.notify_all()


def _done() -> None:
    """A send that completed when it was posted."""
