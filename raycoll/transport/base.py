"""The transport boundary: how one *round* of a collective moves between a group's ranks.

A round is the unit every CPU algorithm in :mod:`raycoll.backends.cpu` is written
against: each rank hands over one payload and gets every rank's payload back, by group rank
(:meth:`RoundTransport.all_gather`). A payload is any picklable structure of numpy arrays; a
:class:`PerPeer` inside it holds one element per destination, and a transport may deliver
each destination only its own element (the others arrive as ``None``), so algorithms read
``got[s][me]`` wherever they sent ``PerPeer``. A collective too large for one round streams
through rounds ``0, 1, ...``, the same on every rank.

This module holds what every transport shares: the round loop (write, read each peer,
skip what an earlier failed call left, keep what a later call sent early), the
fingerprint check (every rank sees every rank's fingerprint, so a mismatch raises the same
``CollectiveMismatchError`` everywhere), rejections, and the waiting policy with its
control-plane checks (a dead rank, an abort or a timeout ends the wait with the
coordinator's error; see ``Coordinator.transport_check``). A collective that runs while its caller
goes on computing (``async_op=True``, on the group's worker thread, until someone waits for
its ``Work``: see :func:`overlapping`) never spins or yields-polls: it sleeps between polls,
leaving the core to the caller (measured with torch's DDP, whose bucket all_reduces overlap
the backward pass: benchmarks/HISTORY.md). A transport implements four hooks:

- ``_write(message, spin)``: hand this rank's message for the round over; ``True`` once
  all of it went (called again with the same message until then);
- ``_read(s, spin)``: the next message from group rank ``s``, or ``None`` if none yet;
- ``_idle(seconds, pending)``: wait until something may have come from ``pending`` (or
  at most ``seconds``);
- ``_shut()`` / ``_release()``: close after a failure (so that late peers fail too) /
  release at the end of the group.

Transports: :mod:`raycoll.transport.segment` (ranks on one node: the native node segment)
and :mod:`raycoll.transport.tcp` (any ranks: direct sockets, also point-to-point). What has
neither goes through the coordinator and the object store (raycoll.backends.cpu).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from raycoll import errors
from raycoll.coordinator.client import CHECK_TIMEOUT_S, PENDING_TIMEOUT_S, CoordinatorUnreachableError
from raycoll.coordinator.logic import EVERY_RANK, fingerprint_mismatch
from raycoll.transport.counters import Counters, payload_bytes

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.context import Call, GroupContext

__all__ = ["PerPeer", "ToEach", "RoundTransport", "SpinBackoff", "Message", "project", "own", "overlapping", "may_spin"]

#: ``(kind, epoch, (seq, round), fingerprint, payload)``; kind ``"msg"`` or ``"reject"``.
Message = Tuple[str, str, Tuple[int, int], Any, Any]

#: A waiting rank asks the coordinator first after ``CHECK_FIRST_S``, then at intervals that
#: double up to ``CHECK_MAX_S``.
CHECK_FIRST_S = 0.1
CHECK_MAX_S = 1.0
#: ``waited_s`` that has the coordinator probe the ranks named at once (see ``check``).
PROBE_NOW = float("inf")
#: A transport error (not a timeout) waits this long for the coordinator to explain it (a
#: rank's death reaches it within milliseconds) before it breaks the group by itself.
FAILURE_GRACE_S = 2.0
#: A rank busy with collectives on a transport tells the coordinator their progress this often.
REPORT_EVERY_S = 0.1


_OVERLAP = threading.local()


@contextlib.contextmanager
def overlapping(waited: threading.Event) -> Iterator[None]:
    """Run the body as a collective that overlaps its caller's work: until ``waited`` is set
    (someone waits for the operation), waits on a transport in this thread sleep between
    polls instead of spinning or yield-polling, which would take the core from the caller."""
    before = getattr(_OVERLAP, "waited", None)
    _OVERLAP.waited = waited
    try:
        yield
    finally:
        _OVERLAP.waited = before


def may_spin() -> bool:
    """Whether a wait in this thread may spin: not inside :func:`overlapping`, or someone
    waits for the operation by now."""
    waited: Optional[threading.Event] = getattr(_OVERLAP, "waited", None)
    return waited is None or waited.is_set()


#: Spins that run their full length without the peer in ``SPIN_FAILS`` collectives in a row or
#: every other one (the scheduler may have put the peer on this rank's core, where spinning only delays it)
#: stop spinning for ``SPIN_BACKOFF_CALLS`` collectives, doubling while spins keep failing,
#: up to ``SPIN_BACKOFF_MAX_CALLS``.
SPIN_FAILS = 3
SPIN_BACKOFF_CALLS = 16
SPIN_BACKOFF_MAX_CALLS = 4096


class SpinBackoff:
    """Whether a transport's waits spin, backing off where spins run out.

    Where the scheduler put the peer on this rank's core, spinning only delays it by the
    whole spin each collective: once spins ran out in ``SPIN_FAILS`` collectives in a row, or
    every other one (two ranks on one core fail in turns; one late peer is not that), waits stop spinning for the next ``SPIN_BACKOFF_CALLS``
    collectives, the back-off doubling while spins keep failing (starting over once spins
    held for ``SPIN_BACKOFF_MAX_CALLS``)."""

    def __init__(self, enabled: bool) -> None:
        #: whether spinning is allowed at all (the node's ranks fit its cores)
        self.enabled = enabled
        #: whether waits spin now
        self.on = enabled
        #: spins that ran their whole length
        self.failed = 0
        self._resume_at = 0  # the collective at which spinning resumes
        self._backoff = SPIN_BACKOFF_CALLS
        self._failed_at = -SPIN_BACKOFF_MAX_CALLS
        self._run = 0  # collectives in a row whose spin ran out

    def spun_out(self, calls: int) -> None:
        """A spin of collective number ``calls`` ran its whole length."""
        self.failed += 1
        if calls == self._failed_at:
            return  # this collective's spin ran out already
        # in a row, or every other one (two ranks on one core fail in turns)
        self._run = self._run + 1 if calls - self._failed_at <= 2 else 1
        if calls - self._failed_at > SPIN_BACKOFF_MAX_CALLS:
            self._backoff = SPIN_BACKOFF_CALLS  # spins held for long: start over
        self._failed_at = calls
        if self._run >= SPIN_FAILS:
            self._resume_at = calls + self._backoff
            self._backoff = min(self._backoff * 2, SPIN_BACKOFF_MAX_CALLS)
            self.on = False

    def spinning(self, calls: int) -> bool:
        """Whether collective number ``calls`` spins (spinning resumes after a back-off)."""
        if not self.on and self.enabled and calls >= self._resume_at:
            self.on = True
        return self.on


class PerPeer(list):
    """A list with one element per destination (group rank) inside a round's payload: a
    transport may deliver destination ``j`` only element ``j`` (the rest as ``None``)."""

    __slots__ = ()


class ToEach(dict):
    """A round's payload between some ranks only (:meth:`RoundTransport.exchange`): group
    rank -> what it is sent; destination ``j`` receives element ``j`` alone, not a list as
    long as the group."""

    __slots__ = ()


def project(payload: Any, dst: int) -> Any:
    """``payload`` as destination ``dst`` needs it: each :class:`PerPeer` (at the top or
    inside a top-level tuple) keeps only element ``dst``; a :class:`ToEach` becomes its
    element ``dst``."""
    if isinstance(payload, ToEach):
        return payload.get(dst)
    if isinstance(payload, PerPeer):
        out = PerPeer([None] * len(payload))
        out[dst] = payload[dst]
        return out
    if isinstance(payload, tuple) and any(isinstance(p, PerPeer) for p in payload):
        return tuple(project(p, dst) for p in payload)
    return payload


def own(value: Any) -> Any:
    """A copy of a received payload that pins no transport buffer."""
    if isinstance(value, np.ndarray):
        return np.array(value)
    if isinstance(value, (list, tuple)):
        copied = [own(v) for v in value]
        return type(value)(copied) if isinstance(value, list) else tuple(copied)
    return value


def report_period_s() -> float:
    """How far behind a rank's transport collectives the coordinator (group_status) may be."""
    return REPORT_EVERY_S


def await_explanation(check: Callable[[], None], grace_s: float) -> Optional[BaseException]:
    """The coordinator's error once ``check`` (which asks it) raises one, or ``None`` when it
    has none within ``grace_s``: after a transport failure this rank sees the sign a moment
    before the coordinator learns its cause (a dead rank, a rejection, a failed round)."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            check()
        except errors.RaycollError as exc:
            return exc
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


class RoundTransport:
    """One group's round transport on this rank (see the module docstring)."""

    #: What the transport is called in errors, and its short name (``group_status``).
    name = "transport"
    kind = "?"

    def __init__(self, ctx: "GroupContext", epoch: str, peers: Sequence[int]) -> None:
        self.ctx = ctx
        # A message from an earlier group on the same medium carries another epoch: skipped.
        self.epoch = epoch
        self._peers = sorted(peers)
        self._dests: List[int] = self._peers  # the peers this round's message goes to
        self._sources: List[int] = self._peers  # ... and the peers it reads from
        #: per collective kind, what this rank sent and received (transports that send
        #: each peer its own message count: ``sparse`` ones)
        self.counters: Dict[str, Counters] = {}
        self._poisoned = False
        self._closed = False
        # The last collective this rank completed here: every rank had written its message
        # for it, so each completes it too (see ``_progress``).
        self._done: Optional[Tuple[str, int]] = None
        self.calls = 0
        self._waiting: Optional[Tuple[int, List[int]]] = None
        self._call_began = 0.0  # when round 0 of the current collective began
        # A peer's message read while waiting for an earlier collective (see ``_skipped``).
        self._early: Dict[int, Message] = {}
        self._reported_at = float("-inf")
        self._report_lock = threading.Lock()
        self._report_timer: Optional[threading.Timer] = None
        #: Waiting policy (set by subclasses): spin this long before polling, yield the core
        #: this long when oversubscribed, then poll with a sleep doubling up to ``poll_max_s``.
        self.spin_s = 0.0
        self.yield_s = 0.0
        self.poll_min_s = 20e-6
        self.poll_max_s = 500e-6
        #: How long a transport error waits for the coordinator to explain it.
        self.failure_grace_s = FAILURE_GRACE_S

    # ------------------------------------------------------------------ hooks
    def _write(self, message: Message, spin: bool) -> bool:
        raise NotImplementedError  # pragma: no cover - every transport implements it

    def _read(self, s: int, spin: bool) -> Optional[Message]:
        raise NotImplementedError  # pragma: no cover - every transport implements it

    def _idle(self, seconds: float, pending: Sequence[int]) -> None:
        time.sleep(seconds)

    def _write_reject(self, message: Message) -> None:
        """Best effort: hand a rejection over now, without waiting."""

    def _shut(self) -> None:
        """Close after a failure, so that a rank arriving late fails too."""

    def _release(self) -> None:
        """Release what the transport holds at the end of the group."""

    # ------------------------------------------------------------------ the collective
    def all_gather(self, call: "Call", payload: Any, sub: int = 0, views: bool = False,
                   dests: Optional[Sequence[int]] = None,
                   sources: Optional[Sequence[int]] = None) -> List[Any]:
        """Every rank's ``payload`` for round ``sub`` of ``call``, by group rank (ours as
        given). ``views=True``: peers' arrays may be read-only views of the transport's
        buffers, valid until this rank's next round on it (drop every reference by then).
        ``dests``/``sources``: only these group ranks (see :meth:`exchange`)."""
        try:
            return self._all_gather(call, payload, sub, views, dests, sources)
        except (errors.CollectiveMismatchError, errors.PeerArgumentError):
            raise  # the call failed on every rank alike; the group goes on
        except BaseException:
            # The group is broken (timeout, dead rank, abort): close, so that a rank arriving
            # late fails instead of completing with the messages we left.
            self._poisoned = True
            try:
                self._shut()
            except Exception:  # noqa: BLE001 - best effort: the coordinator knows
                pass
            raise

    def exchange(self, call: "Call", sub: int, sends: Dict[int, Any], sources: Sequence[int],
                 views: bool = False, first: bool = False) -> Dict[int, Any]:
        """Round ``sub`` of ``call`` between some ranks only (a step of an algorithm's
        schedule, :mod:`raycoll.algorithms`): send ``sends[j]`` to group rank ``j``, receive
        one payload from each group rank in ``sources``; returns them by source. Only
        transports that can reach one peer alone have it (:attr:`sparse`). The fingerprints
        of the sources are checked against this rank's: a mismatch breaks the group (ranks
        that exchange nothing with this one cannot learn of it otherwise). ``first``: this
        rank's first round of ``call`` (the call's timeout counts from it)."""
        if not self.sparse:
            raise TypeError(f"the {self.name} has no rounds between some ranks only")
        if first:
            self._call_began = time.monotonic()
        got = self.all_gather(call, ToEach(sends), sub, views, dests=sorted(sends),
                              sources=sources)
        return {s: got[s] for s in sources}

    #: Whether this transport can send a round's message to some peers only (``exchange``).
    sparse = False

    def _all_gather(self, call: "Call", payload: Any, sub: int, views: bool,
                    dests: Optional[Sequence[int]] = None,
                    sources: Optional[Sequence[int]] = None) -> List[Any]:
        me = self.ctx.rank
        if sub == 0:  # later rounds follow round 0 of the same call
            self._call_began = time.monotonic()
        waiter = _Waiter(self, call, self._call_began)  # the timeout is the whole call's
        key = (call.seq, sub)
        self._dests = self._peers if dests is None else list(dests)
        message: Optional[Message] = (("msg", self.epoch, key, call.fp, payload)
                                      if self._dests else None)
        out: List[Any] = [None] * self.ctx.size
        out[me] = payload
        fps: Dict[int, Dict[str, Any]] = {me: call.fp}
        pending = list(self._peers if sources is None else sources)
        self._sources = list(pending)
        self._waiting = (call.seq, pending)
        # Write and read in one loop: a write may wait until the peers have taken our
        # previous message (or room in their buffers), which they do while reading for this
        # call. No view of a peer's buffer may outlive a failed call in its traceback (which
        # keeps this frame): ``out`` is emptied then.
        try:
            while message is not None or pending:
                if message is not None and self._guard(call, self._write, message,
                                                       waiter.first):
                    message = None
                for s in list(pending):
                    got = self._guard(call, self._take, s, call, key, views,
                                      waiter.first and message is None and s == pending[0])
                    if got is not None:
                        fps[s], out[s] = got
                        pending.remove(s)
                    got = None
                if message is not None or pending:
                    waiter.pause(pending or self._peers)
        except BaseException:
            out.clear()
            raise
        if self.sparse:
            self._count(call.op, payload, out)
        self._done = (call.op, call.seq)
        self.calls += sub == 0
        self.report()
        self._waiting = None
        problem = fingerprint_mismatch(fps, self.ctx.global_ranks)
        if problem:
            out.clear()
            err = errors.CollectiveMismatchError(
                f"{call.op} #{call.seq} on group {self.ctx.group_name!r}: {problem}",
                **self.ctx.ctx(call))
            if sources is not None:
                self.ctx.fail(err)  # the ranks this one does not hear from wait on: break
            raise err
        return out

    def tally(self, op: str) -> Counters:
        """The counters of collective kind ``op`` (made on first use)."""
        tally = self.counters.get(op)
        if tally is None:
            tally = self.counters[op] = Counters()
        return tally

    def _count(self, op: str, payload: Any, got: List[Any]) -> None:
        """Count this round's messages (to ``self._dests``, from the ranks in ``got``)."""
        tally = self.tally(op)
        me, nodes = self.ctx.rank, self.ctx.node_ids
        for j in self._dests:
            tally.sent(j, payload_bytes(project(payload, j)), nodes[j] == nodes[me])
        for s in self._sources:
            tally.received(s, payload_bytes(got[s]), nodes[s] == nodes[me])
        tally.rounds += bool(self._dests or self._sources)

    def reject(self, call: "Call", message: str) -> None:
        """Tell the peers at once that this rank rejected its arguments for ``call`` (if the
        transport can take it now; otherwise they learn it from the coordinator)."""
        try:
            self._write_reject(("reject", self.epoch, (call.seq, 0), None, message))
        except Exception:  # noqa: BLE001 - best effort, the coordinator has it too
            pass

    def _take(self, s: int, call: "Call", key: Tuple[int, int], views: bool,
              spin: bool) -> Optional[Tuple[Dict[str, Any], Any]]:
        """Peer ``s``'s message for round ``key`` (``(seq, sub)``) of ``call`` as
        ``(fingerprint, payload)``, or ``None`` if it has not come yet. Older messages (calls
        this rank did not read) are skipped."""
        while True:
            message = self._early.pop(s, None)
            if message is None:
                message = self._read(s, spin)
                if message is None:
                    return None
            kind, epoch, at, fp, payload = message
            del message
            if epoch != self.epoch or at < key:
                del payload
                spin = False
                continue
            if at > key:  # it left this call out: kept for the call it belongs to
                self._early[s] = (kind, epoch, at, fp, own(payload))
                del payload
                raise self._skipped(call, s, at[0])
            if kind == "reject":
                raise errors.PeerArgumentError(
                    f"{call.op} #{call.seq} on group {self.ctx.group_name!r} cannot run: rank "
                    f"{self.ctx.global_ranks[s]} rejected its arguments: {payload}",
                    **self.ctx.ctx(call))
            return fp, (payload if views else own(payload))

    def _skipped(self, call: "Call", s: int, seq: int) -> BaseException:
        """Peer ``s`` wrote for collective ``seq`` while this rank waits in an earlier one:
        its part of this call failed on its side before it reached the transport (it
        rejected its arguments, or it came through the coordinator and failed there). The
        coordinator knows which, a moment later; that is the error of this call here too."""
        explained = self._explained(call)
        return explained if explained is not None else errors.CollectiveMismatchError(
            f"{call.op} #{call.seq} on group {self.ctx.group_name!r}: rank "
            f"{self.ctx.global_ranks[s]} left it out and is already at collective #{seq}: "
            "the ranks are out of step", **self.ctx.ctx(call))

    def _explained(self, call: "Call", suspects: Sequence[int] = ()) -> Optional[BaseException]:
        """The coordinator's error for ``call`` once it has one (it learns of a rejection, a
        dead rank or a failed round a moment after this rank sees the sign), or ``None`` if it
        has none within ``failure_grace_s``. Group ranks ``suspects`` (whose connections
        closed, say) are probed at once: a dead actor's probe fails within milliseconds, so
        the coordinator names the rank that died, not the survivors that closed after it."""
        return await_explanation(
            lambda: self.check(call, suspects, PROBE_NOW if suspects else 0.0),
            self.failure_grace_s)

    def _guard(self, call: "Call", fn: Any, *args: Any) -> Any:
        """``fn(*args)``; a transport failure (not a timeout) ends the call with the
        coordinator's error (a dead rank, a broken group) once it has one, or, if it has none
        within ``FAILURE_GRACE_S``, breaks the group with the transport's error."""
        try:
            return fn(*args)
        except errors.RaycollError:
            raise
        except Exception as exc:  # noqa: BLE001 - translated below
            explained = self._explained(call, self._suspects(exc))
            if explained is not None:
                raise explained from exc
            err = self._unexplained(call, exc)
            self.ctx.fail(err)
            raise err from exc

    def _suspects(self, exc: BaseException) -> Sequence[int]:
        """Group ranks that transport failure ``exc`` suggests are dead."""
        return ()

    def _unexplained(self, call: "Call", exc: BaseException) -> errors.RaycollError:
        """The error for a transport failure the coordinator could not explain."""
        return errors.GroupBrokenError(
            f"{call.op} #{call.seq} on group {self.ctx.group_name!r}: the {self.name} "
            f"failed on rank {self.ctx.global_ranks[self.ctx.rank]} "
            f"({type(exc).__name__}: {exc}); the group is broken", **self.ctx.ctx(call))

    # ------------------------------------------------------------------ progress reports
    @property
    def report_every_s(self) -> float:
        """How often this rank reports: ``REPORT_EVERY_S`` times the group's ranks on its
        node, so that a node's ranks together send the coordinator about one report per
        ``REPORT_EVERY_S`` (O(1) calls a second per group and node, however many ranks)."""
        nodes = self.ctx.node_ids
        return REPORT_EVERY_S * sum(1 for n in nodes if n == nodes[self.ctx.rank])

    def report(self, force: bool = False, wait_s: float = 0.0) -> None:
        """Tell the coordinator every rank's progress (for group_status), in one
        fire-and-forget call: now when ``force``d or when the last report is older than
        :attr:`report_every_s`; else once that much time has passed since it (so the
        coordinator is at most that far behind, at one call per period however busy).
        ``wait_s``: wait up to that long for the coordinator to have taken it (group_status
        from inside a rank, which asks the coordinator right after)."""
        with self._report_lock:
            if self._closed:
                return
            now = time.monotonic()
            period = self.report_every_s
            due = self._reported_at + period
            if not force and now < due:
                if self._report_timer is None:
                    self._report_timer = threading.Timer(due - now, self._trailing_report)
                    self._report_timer.daemon = True
                    self._report_timer.start()
                return
            self._reported_at = now
            progress = self._progress()
        try:
            ref = self.ctx.client.submit_transport_progress(
                self.ctx.group_name, self.ctx.global_ranks, progress, self.kind, period,
                self.ctx.report_detail())
            if wait_s > 0:
                import ray

                ray.get(ref, timeout=wait_s)
        except Exception:  # noqa: BLE001 - diagnostics only (the coordinator may be gone)
            pass

    def _trailing_report(self) -> None:
        with self._report_lock:
            self._report_timer = None
        self.report(force=True)

    def missing(self, seq: int) -> Optional[Tuple[List[int], Dict[int, Tuple[str, int]]]]:
        """While collective ``seq`` waits here: the group ranks whose messages have not come,
        and the last collective each rank completed as far as this rank knows."""
        waiting = self._waiting
        if waiting is None or waiting[0] != seq:
            return None
        done = {r: self._done for r in range(self.ctx.size)} if self._done else {}
        return list(waiting[1]), done

    def _progress(self) -> Dict[int, Tuple[str, int]]:
        """What this rank tells the coordinator of the group's progress: every rank completed
        the last collective this rank completed (it had every rank's part), in one entry
        (``EVERY_RANK``), so that a report costs O(1), not O(W)."""
        return {EVERY_RANK: self._done} if self._done else {}

    # ------------------------------------------------------------------ the coordinator
    def check(self, call: "Call", waiting: Sequence[int] = (), waited_s: float = 0.0) -> None:
        """Ask the coordinator whether this wait (for ``waiting``, ``waited_s`` long) should
        end; raises its error if so. An unreachable coordinator (a slow or cut link) ends
        nothing: the call's own timeout bounds the wait, and the check's."""
        try:
            self.ctx.client.transport_check(
                self.ctx.group_name, self.ctx.global_ranks, call.seq, self.ctx.rank, call.fp,
                self._progress(), waiting, waited_s, self.kind, where=self.ctx.ctx(call),
                timeout_s=min(CHECK_TIMEOUT_S, max(call.timeout_s - waited_s, 1.0)))
        except CoordinatorUnreachableError:
            pass

    def time_out(self, call: "Call", missing: Sequence[int]) -> BaseException:
        """The error for ``call`` timing out waiting for group ranks ``missing``: the
        coordinator's (it breaks the group), or this rank's if it cannot be reached."""
        who, note = [self.ctx.global_ranks[s] for s in missing], ""
        try:
            self.ctx.client.transport_timeout(
                self.ctx.group_name, self.ctx.global_ranks, call.seq, self.ctx.rank, call.op,
                missing, self._progress(), call.timeout_s, self.kind, where=self.ctx.ctx(call),
                wait_s=PENDING_TIMEOUT_S)
        except CoordinatorUnreachableError as exc:
            note = f" (the coordinator could not be reached to break the group: {exc})"
        except errors.RaycollError as exc:
            return exc
        return errors.DistTimeoutError(
            f"{call.op} #{call.seq} on group {self.ctx.group_name!r} timed out after "
            f"{call.timeout_s:g}s: ranks {who} never arrived{note}", missing=who,
            **self.ctx.ctx(call))

    def close(self) -> None:
        with self._report_lock:
            if self._report_timer is not None:
                self._report_timer.cancel()
                self._report_timer = None
            if self._closed:
                return
            self._closed = True
        self._early.clear()
        if self._poisoned:
            return
        self._release()


class _Waiter:
    """The waiting policy of one collective: spin, poll, check, time out."""

    def __init__(self, plane: RoundTransport, call: "Call", start: float) -> None:
        self.plane = plane
        self.call = call
        self.start = start
        # the first pass of a round may spin (and a crowded node yield-poll), unless the
        # caller is still computing beside this wait (see ``overlapping``)
        self.spin = may_spin()
        self.first = self.spin
        self.sleep = plane.poll_min_s
        self.begun = time.monotonic()
        self.check_at = self.begun + CHECK_FIRST_S
        self.check_every = CHECK_FIRST_S

    def pause(self, pending: Sequence[int]) -> None:
        """Nothing came this pass: wait a little; check with the coordinator or time out
        when it is time to."""
        self.first = False
        if self.spin and time.monotonic() - self.begun < self.plane.yield_s:
            os.sched_yield()  # oversubscribed: let a peer that is still working run first
        else:
            self.plane._idle(self.sleep, pending)
            self.sleep = min(self.sleep * 2, self.plane.poll_max_s)
        now = time.monotonic()
        if now - self.start > self.call.timeout_s:
            raise self.plane.time_out(self.call, pending)
        if now >= self.check_at:
            self.plane.check(self.call, pending, now - self.start)
            self.check_every = min(self.check_every * 2, CHECK_MAX_S)
            self.check_at = time.monotonic() + self.check_every
