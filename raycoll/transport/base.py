"""What a group's transports share: the coordinator's checks while a call waits, progress
reports for ``group_status``, the spin policy, and the failure path.

:class:`NativeTransport` is the base of the two native transports, the node segment
(:mod:`raycoll.transport.segment`) and the native sockets
(:mod:`raycoll.transport.native_tcp`): the waiting policy's control-plane checks (a
dead rank, an abort or a timeout ends the wait with the coordinator's error; see
``Coordinator.transport_check``), the timeout naming the ranks that never arrived, and a
rank's progress told to the coordinator at most once a period.

A collective that runs while its caller goes on computing (``async_op=True``, on the group's
worker thread, until someone waits for its ``Work``: see :func:`overlapping`) never spins:
it sleeps between polls, leaving the core to the caller (measured with torch's DDP, whose
bucket all_reduces overlap the backward pass: benchmarks/HISTORY.md).

What has no native transport goes through the coordinator and the object store
(raycoll.algorithms.store).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple


from raycoll import errors
from raycoll.coordinator.client import CHECK_TIMEOUT_S, PENDING_TIMEOUT_S, CoordinatorUnreachableError
from raycoll.coordinator.logic import EVERY_RANK
from raycoll.transport.counters import Counters

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.context import Call, GroupContext

__all__ = ["NativeTransport", "SpinBackoff", "overlapping", "may_spin", "await_explanation",
           "REPORT_EVERY_S", "segment_failure"]


#: A waiting rank asks the coordinator first after ``CHECK_FIRST_S``, then at intervals that
#: double up to ``CHECK_MAX_S``; a wait asleep in the native core wakes every ``TICK_S`` to
#: check its peers' processes (and abort flags).
CHECK_FIRST_S = 0.1
CHECK_MAX_S = 1.0
TICK_S = 0.01
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


def wait_policy(spin_ns: int,
                first_check_s: float = CHECK_FIRST_S) -> Tuple[int, int, int, int]:
    """A native wait's policy: how long it spins, its tick, its first check with the
    coordinator and the most between two (nanoseconds each, as the core takes them)."""
    return spin_ns, int(TICK_S * 1e9), int(first_check_s * 1e9), int(CHECK_MAX_S * 1e9)


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
        self._seen: Dict[Any, int] = {}  # the core's counts of spins run out, as last read

    def counted(self, calls: int, fails: int, key: Any = None) -> bool:
        """After a native wait: ``fails`` is the core's count of waits whose spin ran out
        (``key``: whose count, e.g. a pipe's peer); a change since the last look is a spin of
        collective number ``calls`` that ran out (:meth:`spun_out`). Whether it changed."""
        if fails == self._seen.get(key, 0):
            return False
        self._seen[key] = fails
        self.spun_out(calls)
        return True

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


def segment_failure(transport: "NativeTransport", call: "Call", seg: Any, status: int,
                    peer: int, ranks: Sequence[int],
                    broken: Callable[[], None]) -> Optional[BaseException]:
    """The error of a run on segment ``seg`` (the one-node segment or a node segment) that
    ended with one of its statuses ``CLOSED``, ``DEAD`` or ``ABORTED`` naming local rank
    ``peer``, or ``None`` for any other status. ``ranks``: each local rank's group rank;
    ``broken``: breaks this rank's side of the group first (its peers stop waiting: the
    segment's abort flag, the sockets), for ``DEAD`` and ``ABORTED``; ``transport``: whose
    coordinator explains the failure first (a dead rank's probe fails within
    milliseconds)."""
    from raycoll.native import core  # (the native core: built where a segment exists)

    ctx = transport.ctx
    where = f"{call.op} #{call.seq} on group {ctx.group_name!r}"
    if status == core.CLOSED:
        return errors.GroupDestroyedError(
            f"{where}: the group was destroyed while the call waited")
    if status not in (core.DEAD, core.ABORTED):
        return None
    broken()
    who = ranks[peer] if 0 <= peer < len(ranks) else ctx.rank
    explained = transport._explained(call, [who])
    if explained is not None:
        return explained
    g = ctx.global_ranks[who]
    if status == core.DEAD:
        err: errors.RaycollError = errors.RankFailedError(
            f"{where}: rank {g} died (its process {seg.info(peer, 0)['pid']} is gone)",
            failed_ranks=[g], **ctx.ctx(call))
    else:
        err = errors.GroupBrokenError(
            f"{where}: rank {g} gave up on the group (its call failed); the group is broken",
            **ctx.ctx(call))
    ctx.fail(err)
    return err


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


class NativeTransport:
    """One group's native transport on this rank (see the module docstring)."""

    #: What the transport is called in errors, and its short name (``group_status``).
    name = "transport"
    kind = "?"

    def __init__(self, ctx: "GroupContext") -> None:
        self.ctx = ctx
        #: per collective kind, what this rank sent and received (the native sockets count)
        self.counters: Dict[str, Counters] = {}
        self._poisoned = False
        self._closed = False
        # The last collective this rank completed here: every rank had written its message
        # for it, so each completes it too (see ``_progress``).
        self._done: Optional[Tuple[str, int]] = None
        self.calls = 0
        self._waiting: Optional[Tuple[int, List[int]]] = None
        self._call: Optional["Call"] = None  # the collective running (set by ``run``)
        self._call_began = 0.0  # when the current collective began
        self._reported_at = float("-inf")
        self._report_lock = threading.Lock()
        self._report_timer: Optional[threading.Timer] = None
        #: How long a transport error waits for the coordinator to explain it.
        self.failure_grace_s = FAILURE_GRACE_S

    # ------------------------------------------------------------------ hooks
    def _shut(self) -> None:
        """Close after a failure, so that a rank arriving late fails too."""

    def _release(self) -> None:
        """Release what the transport holds at the end of the group."""

    # ------------------------------------------------------------------ the collective
    def tally(self, op: str) -> Counters:
        """The counters of collective kind ``op`` (made on first use)."""
        tally = self.counters.get(op)
        if tally is None:
            tally = self.counters[op] = Counters()
        return tally

    def _explained(self, call: "Call", suspects: Sequence[int] = ()) -> Optional[BaseException]:
        """The coordinator's error for ``call`` once it has one (it learns of a rejection, a
        dead rank or a failed round a moment after this rank sees the sign), or ``None`` if it
        has none within ``failure_grace_s``. Group ranks ``suspects`` (whose connections
        closed, say) are probed at once: a dead actor's probe fails within milliseconds, so
        the coordinator names the rank that died, not the survivors that closed after it."""
        return await_explanation(
            lambda: self.check(call, suspects, PROBE_NOW if suspects else 0.0),
            self.failure_grace_s)

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
    def _check(self, waited_s: float, pending: Tuple[int, ...]) -> None:
        """While a run waits (called by the native core every so often): the call's
        deadline, then the coordinator's check (a dead rank, an abort, a mismatch on another
        path)."""
        call = self._call
        if call is None:  # pragma: no cover - run() sets it before the core can call this
            return
        self._waiting = (call.seq, list(pending))
        elapsed = time.monotonic() - self._call_began
        if elapsed > call.timeout_s:
            raise self.time_out(call, list(pending))
        self.check(call, list(pending), elapsed)

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
        if self._poisoned:
            return
        self._release()
