"""The shared-memory lane: small and mid-size collectives among ranks on one node, without
the coordinator.

A collective through the coordinator costs at least one Ray actor call per rank and an async
actor waking up for every arrival (measured ~2.5-3 ms for two ranks on the reference 2-core
machine, four times an actor round trip). When all ranks of a group are actors on one node,
each rank instead owns one Ray shared-memory channel (``ray.experimental.channel.Channel``,
the mutable plasma objects that Ray's compiled graphs use), written by it and read by every
peer. A collective is then one *round* or more: in each, every rank writes one message (at
most ``lane_bytes``, group option, 4 MiB by default) and reads each peer's. A small one-step
collective is one round: every rank gets every rank's contribution and computes its own
result locally (reductions in rank order, so every rank holds bitwise the same result). A
larger one streams through several rounds (the backend cuts them: see
raycoll.backends.objstore), reading the peers' parts in place (``views=True``) and dropping
them before its next round. Measured on the reference machine, 2 ranks: all_reduce of 4 B
~0.15 ms (an actor round trip costs ~0.7-1 ms), of 1 MiB ~0.3 ms, of 64 MiB ~10-14 ms in
1 MiB rounds (through the object store: 33-44 ms).

Each message is ``(kind, epoch, (seq, round), fingerprint, payload)``. ``kind`` is ``"msg"``
or, from a rank that rejected its own arguments, ``"reject"`` (its peers raise
``PeerArgumentError`` at once). What could go wrong through the coordinator is still detected
(a streamed collective's round 0 carries what the ranks must agree on, so a mismatch fails it
there, before any data moved; a call's timeout covers all its rounds):

- **mismatch**: every rank sees every rank's fingerprint and compares them (every rank
  raises the same ``CollectiveMismatchError``); a rank whose call went to the coordinator
  instead (another collective, or a large one) is found by the lane ranks' periodic check;
- **timeouts, dead ranks, broken groups**: while a read waits, the rank asks the coordinator
  every so often (``Coordinator.lane_check``, first after 0.1 s, then at most every second):
  a dead rank, an aborted group, a rejection end the wait with the coordinator's error; at the
  call's timeout, ``Coordinator.lane_timeout`` names the ranks whose messages never came, with
  their last completed collective (each check reports what this rank has seen of its peers);
  a rank whose lane call fails that way closes its channel, so a rank arriving late fails too
  instead of completing with the messages left behind;
- **group_status**: ranks tell the coordinator their lane progress at most every 0.1 s
  (``Coordinator.lane_progress``, one fire-and-forget call), and group_status waits that long.

Waiting: a read first spins for up to 1 ms when the group's ranks fit the node's cores;
otherwise (a spinning rank would take a core from the peer it waits for) it polls yielding
its core for up to 2 ms (``sched_yield``: a peer still working on its part runs first). Then
it polls with a sleep that doubles up to 0.5 ms, so a rank waiting for a slow peer uses a few
percent of a core.

A channel's buffer is reused for the next message once every reader has dropped its view of
the current one, so readers copy what they keep and drop the rest at once. A message a rank
never read (its peer rejected or failed that call) is skipped by its sequence number; a
message for a later call (its writer skipped this one) is kept for that call, and this call
ends with the coordinator's error for it.

Memory: each rank's channel is allocated at ``lane_bytes`` plus room for the message around
it, once per process and set of readers: Ray frees a channel only when the actor that wrote
it exits (ray-project/ray#43836), so channels are pooled and reused by later groups of the
same actors (messages carry their group's epoch), never dropped. A 2-rank group with the
default costs ~8.5 MiB of object-store memory for the life of its actors.

Groups with more ranks than ``lane_max_ranks`` (default: twice the node's cores) stay on the
coordinator: there, W oversubscribed ranks each polling W - 1 channels lose to it (measured
with 8 and 16 ranks on 2 cores).

The lane is set up by the group's first collective that can use it, inside that collective:
the ranks exchange their channels through the coordinator (one extra round trip, once per
group) and all switch to the lane together, or all stay off it if any rank could not open its
channel. Group option ``lane=False`` keeps every collective on the coordinator; the object
collectives and point-to-point always use it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import ray

from raycoll import errors
from raycoll.coordinator import fingerprint_mismatch

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.backends.base import Call, GroupContext

logger = logging.getLogger("raycoll")

__all__ = ["Lane", "open_channel", "release_channel", "lane_possible", "lane_report_s",
           "oversubscribed"]

#: How long a read or a write spins before it polls (Ray's channel timeouts are in ms).
SPIN_S = 0.001
#: Ranks that do not fit the node's cores do not spin: for up to ``YIELD_S`` they poll
#: yielding the core to any peer that can run (the one still working on its part), then
#: sleep (group option ``lane_yield_s``).
YIELD_S = 0.002
#: The polling sleep doubles from ``POLL_MIN_S`` up to ``POLL_MAX_S``.
POLL_MIN_S = 20e-6
POLL_MAX_S = 500e-6
#: A waiting rank asks the coordinator first after ``CHECK_FIRST_S``, then at intervals that
#: double up to ``CHECK_MAX_S``.
CHECK_FIRST_S = 0.1
CHECK_MAX_S = 1.0
#: A channel error (not a timeout) waits this long for the coordinator to explain it (a rank's
#: death reaches it within milliseconds) before it breaks the group by itself.
FAILURE_GRACE_S = 2.0
_TIMEOUT = ray.exceptions.RayChannelTimeoutError

#: A rank busy with lane collectives tells the coordinator their progress this often.
REPORT_EVERY_S = 0.1


def lane_report_s() -> float:
    """How far behind a rank's lane collectives the coordinator (group_status) may be."""
    return REPORT_EVERY_S


def node_cores() -> int:
    """The node's CPU count: the same on every rank of a node (unlike a process's affinity),
    so ranks that decide something from it decide alike."""
    return os.cpu_count() or 1


def oversubscribed(size: int) -> bool:
    """Whether ``size`` ranks on one node outnumber its cores: they must not spin while they
    wait (a spinning rank takes the core of the peer it waits for), and every lane round
    costs them a scheduler wake-up."""
    return size > node_cores()


def lane_possible(ctx: "GroupContext") -> bool:
    """Whether group ``ctx`` can use a lane: 2+ ranks, all actors, all on this node, this
    process being the rank's actor, and the group option ``lane`` not switched off."""
    if ctx.size < 2 or not ctx.options.get("lane", True) or not ctx.single_node:
        return False
    if ctx.size > int(ctx.options.get("lane_max_ranks", 2 * node_cores())):
        return False  # polling W - 1 channels on each of W oversubscribed ranks loses
    if any(a is None for a in ctx.actors):
        return False
    try:
        runtime = ray.get_runtime_context()
        return (runtime.get_actor_id() is not None
                and runtime.get_actor_id() == ctx.actors[ctx.rank]._actor_id.hex()
                and runtime.get_node_id() == ctx.node_ids[ctx.rank])
    except Exception:  # noqa: BLE001 - not connected, not in an actor
        return False


# Ray frees a channel's shared memory only when the actor that wrote it exits (mutable
# objects are not reference-counted: ray-project/ray#43836), so a channel is never dropped
# while this process lives: when its group is destroyed it goes back to this pool and serves
# the next group with the same readers (an actor that re-forms its groups would otherwise
# leak ~100 KiB of the store per peer and formation). Key: (reader actor ids, buffer size).
_POOL_LOCK = threading.Lock()
_POOL: Dict[Tuple[Tuple[str, ...], int], List[Any]] = {}


def _pool_key(ctx: "GroupContext") -> Tuple[Tuple[str, ...], int]:
    readers = tuple(sorted(ctx.actors[j]._actor_id.hex() for j in range(ctx.size) if j != ctx.rank))
    return readers, _buffer_bytes(ctx)


def _buffer_bytes(ctx: "GroupContext") -> int:
    """Room for the largest lane message of the group: ``lane_bytes`` of arrays and the
    message around them (a channel never has to grow: Ray would keep the old buffer, and a
    growth interrupted by a timeout would lose the readers)."""
    from raycoll.backends.objstore import lane_bytes

    return lane_bytes(ctx.options) + 512 * ctx.size + 16384


def open_channel(ctx: "GroupContext") -> Any:
    """This rank's channel (written here, read by every peer), or ``None`` if Ray cannot
    make one here (the group then stays off the lane on every rank)."""
    key = _pool_key(ctx)
    with _POOL_LOCK:
        free = _POOL.get(key)
        if free:
            return free.pop()
    try:
        from ray.experimental.channel.shared_memory_channel import Channel

        me = ray.get_runtime_context().current_actor
        readers = [(ctx.actors[j], ctx.node_ids[j]) for j in range(ctx.size) if j != ctx.rank]
        return Channel(me, readers, typ=key[1])
    except Exception as exc:  # noqa: BLE001 - any failure means: no lane for this group
        logger.warning("raycoll: group %r stays off the shared-memory lane: cannot open a "
                       "channel on rank %d (%s: %s)", ctx.group_name, ctx.rank,
                       type(exc).__name__, exc)
        return None


def release_channel(ctx: "GroupContext", channel: Any) -> None:
    """Give back a channel :func:`open_channel` returned (it was not used)."""
    _give_back(_pool_key(ctx), channel)


def _give_back(key: Tuple[Tuple[str, ...], int], channel: Any) -> None:
    if channel is not None:
        with _POOL_LOCK:
            _POOL.setdefault(key, []).append(channel)


def _own(value: Any) -> Any:
    """A copy of a received payload that does not pin the channel's buffer."""
    if isinstance(value, np.ndarray):
        return np.array(value)
    if isinstance(value, list):
        return [_own(v) for v in value]
    return value


class Lane:
    """One group's lane on this rank: its own channel and its peers' (by group rank)."""

    def __init__(self, ctx: "GroupContext", out: Any, peers: Dict[int, Any], epoch: str) -> None:
        self.ctx = ctx
        # Channels outlive groups (see _POOL): a message from an earlier group on the same
        # channels carries another epoch and is skipped.
        self.epoch = epoch
        self._key = _pool_key(ctx)
        self._poisoned = False
        self._out = out
        self._in = peers
        for channel in peers.values():
            channel.ensure_registered_as_reader()
        crowded = oversubscribed(ctx.size)
        self._spin = 0.0 if crowded else SPIN_S
        self.yield_s = float(ctx.options.get("lane_yield_s", YIELD_S)) if crowded else 0.0
        # The last collective this rank completed on the lane: every rank had written its
        # message for it, so each completes it too (see ``_progress``).
        self._done: Optional[Tuple[str, int]] = None
        self.calls = 0
        self._waiting: Optional[Tuple[int, List[int]]] = None
        self._call_began = 0.0  # when round 0 of the current collective began
        # A peer's message read while waiting for an earlier collective (see ``_skipped``).
        self._early: Dict[int, Any] = {}
        self._reported_at = float("-inf")
        self._report_lock = threading.Lock()
        self._report_timer: Optional[threading.Timer] = None

    # ------------------------------------------------------------------ the collective
    def all_gather(self, call: "Call", payload: Any, sub: int = 0,
                   views: bool = False) -> List[Any]:
        """Every rank's ``payload`` for round ``sub`` of ``call``, by group rank (ours as
        given). A collective too large for one message streams through rounds 0, 1, ...
        (the same on every rank: derived from arguments the fingerprint covers).

        ``views=True``: peers' arrays are returned as read-only views of their channels,
        not copies; the caller must drop every reference to them before this rank's next
        lane call (until then the peer cannot write its next message)."""
        try:
            return self._all_gather(call, payload, sub, views)
        except (errors.CollectiveMismatchError, errors.PeerArgumentError):
            raise  # the call failed on every rank alike; the group goes on
        except BaseException:
            # The group is broken (timeout, dead rank, abort): close our channel, so that a
            # rank arriving late fails instead of completing with the messages we left.
            self._poison()
            raise

    def _poison(self) -> None:
        self._poisoned = True  # never reused
        try:
            if self._out is not None:
                self._out.close()
        except Exception:  # noqa: BLE001 - best effort: the coordinator knows the group is broken
            pass

    def _all_gather(self, call: "Call", payload: Any, sub: int, views: bool) -> List[Any]:
        me = self.ctx.rank
        if sub == 0:  # later rounds follow round 0 of the same call on this lane
            self._call_began = time.monotonic()
        waiter = _Waiter(self, call, self._call_began)  # the timeout is the whole call's
        key = (call.seq, sub)
        message: Any = ("msg", self.epoch, key, call.fp, payload)
        out: List[Any] = [None] * self.ctx.size
        out[me] = payload
        fps: Dict[int, Dict[str, Any]] = {me: call.fp}
        peers = sorted(self._in)
        pending = list(peers)
        self._waiting = (call.seq, pending)
        # Write and read in one loop: our write waits until every reader has dropped our
        # previous message, and a reader that skipped it (its call failed) drops it while
        # reading for this call, so reads must go on while the write waits. A peer cannot
        # write again while this rank holds a view of its message, so no view may outlive a
        # failed call in its traceback (which keeps this frame): ``out`` is emptied then.
        try:
            while message is not None or pending:
                if message is not None and self._guard(call, waiter, self._try_write, message,
                                                       waiter.first):
                    message = None
                for s in list(pending):
                    got = self._guard(call, waiter, self._try_read, s, call, key, views,
                                      waiter.first and message is None and s == pending[0])
                    if got is not None:
                        fps[s], out[s] = got
                        pending.remove(s)
                    got = None
                if message is not None or pending:
                    waiter.pause(pending or peers)
        except BaseException:
            out.clear()
            raise
        # Every rank wrote its message for this call, so each completes it once it reads
        # them: what the coordinator is told (see ``check``) if a later call hangs.
        self._done = (call.op, call.seq)
        self.calls += sub == 0
        self.report()
        self._waiting = None
        problem = fingerprint_mismatch(fps, self.ctx.global_ranks)
        if problem:
            out.clear()
            raise errors.CollectiveMismatchError(
                f"{call.op} #{call.seq} on group {self.ctx.group_name!r}: {problem}",
                **self.ctx.ctx(call))
        return out

    def reject(self, call: "Call", message: str) -> None:
        """Tell lane readers at once that this rank rejected its arguments for ``call`` (if
        the channel is free now; otherwise they learn it from the coordinator)."""
        try:
            self._out.write(("reject", self.epoch, (call.seq, 0), None, message), timeout=0)
        except Exception:  # noqa: BLE001 - best effort, the coordinator has it too
            pass

    # ------------------------------------------------------------------ channel access
    def _try_write(self, message: Any, spin: bool) -> bool:
        try:
            self._out.write(message, timeout=self._spin if spin else 0)
            return True
        except _TIMEOUT:
            return False

    def _try_read(self, s: int, call: "Call", key: Tuple[int, int], views: bool,
                  spin: bool) -> Optional[Tuple[Dict[str, Any], Any]]:
        """Peer ``s``'s message for round ``key`` (``(seq, sub)``) of ``call`` as
        ``(fingerprint, payload)``, or ``None`` if it has not come yet. Older messages (calls
        this rank did not read) are skipped."""
        channel = self._in[s]
        while True:
            message = self._early.pop(s, None)
            if message is None:
                try:
                    message = channel.read(timeout=self._spin if spin else 0)
                except _TIMEOUT:
                    return None
                if isinstance(message, BaseException):  # the channel's error bit (closed)
                    raise message
            kind, epoch, at, fp, payload = message
            del message
            if epoch != self.epoch or at < key:
                del payload
                spin = False
                continue
            if at > key:  # it left this call out: kept for the call it belongs to
                self._early[s] = (kind, epoch, at, fp, _own(payload))
                del payload
                raise self._skipped(call, s, at[0])
            g = self.ctx.global_ranks[s]
            if kind == "reject":
                raise errors.PeerArgumentError(
                    f"{call.op} #{call.seq} on group {self.ctx.group_name!r} cannot run: rank "
                    f"{g} rejected its arguments: {payload}", **self.ctx.ctx(call))
            return fp, (payload if views else _own(payload))

    def _skipped(self, call: "Call", s: int, seq: int) -> BaseException:
        """Peer ``s`` wrote for collective ``seq`` while this rank waits in an earlier one:
        its part of this call failed on its side before it reached the lane (it rejected its
        arguments, or it came through the coordinator and failed there). The coordinator
        knows which, a moment later; that is the error of this call here too."""
        explained = self._explained(call)
        return explained if explained is not None else errors.CollectiveMismatchError(
            f"{call.op} #{call.seq} on group {self.ctx.group_name!r}: rank "
            f"{self.ctx.global_ranks[s]} left it out and is already at collective #{seq}: "
            "the ranks are out of step", **self.ctx.ctx(call))

    def _explained(self, call: "Call") -> Optional[BaseException]:
        """The coordinator's error for ``call`` once it has one (it learns of a rejection, a
        dead rank or a failed round a moment after this rank sees the sign), or ``None`` if it
        has none within ``FAILURE_GRACE_S``."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        while True:
            try:
                self.check(call)
            except errors.RaycollError as exc:
                return exc
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def _guard(self, call: "Call", waiter: "_Waiter", fn: Any, *args: Any) -> Any:
        """``fn(*args)``; a channel failure (not a timeout) ends the call with the
        coordinator's error (a dead rank, a broken group) once it has one, or, if it has none
        within ``FAILURE_GRACE_S``, breaks the group with the channel's error."""
        try:
            return fn(*args)
        except errors.RaycollError:
            raise
        except Exception as exc:  # noqa: BLE001 - translated below
            explained = self._explained(call)
            if explained is not None:
                raise explained from exc
            err = errors.GroupBrokenError(
                f"{call.op} #{call.seq} on group {self.ctx.group_name!r}: the shared-memory "
                f"lane failed on rank {self.ctx.global_ranks[self.ctx.rank]} "
                f"({type(exc).__name__}: {exc}); the group is broken", **self.ctx.ctx(call))
            self.ctx.fail(err)
            raise err from exc

    def report(self, force: bool = False) -> None:
        """Tell the coordinator every rank's progress (for group_status), in one
        fire-and-forget call: now when ``force``d or when the last report is older than
        ``REPORT_EVERY_S``; else once that much time has passed since it (so the coordinator
        is at most ``REPORT_EVERY_S`` behind, at one call per period however busy the lane)."""
        with self._report_lock:
            if self._out is None:
                return
            now = time.monotonic()
            due = self._reported_at + REPORT_EVERY_S
            if not force and now < due:
                if self._report_timer is None:
                    self._report_timer = threading.Timer(due - now, self._trailing_report)
                    self._report_timer.daemon = True
                    self._report_timer.start()
                return
            self._reported_at = now
            progress = self._progress()
        try:
            self.ctx.client.submit("lane_progress", self.ctx.group_name, self.ctx.global_ranks,
                                   progress)
        except Exception:  # noqa: BLE001 - diagnostics only (the coordinator may be gone)
            pass

    def _trailing_report(self) -> None:
        with self._report_lock:
            self._report_timer = None
        self.report(force=True)

    def missing(self, seq: int) -> Optional[Tuple[List[int], Dict[int, Tuple[str, int]]]]:
        """While collective ``seq`` waits on the lane: the group ranks whose messages have
        not come, and the last collective each rank completed as far as this rank knows."""
        waiting = self._waiting
        if waiting is None or waiting[0] != seq:
            return None
        return list(waiting[1]), self._progress()

    def _progress(self) -> Dict[int, Tuple[str, int]]:
        """By group rank, the last collective each rank completed as far as this rank knows:
        what the coordinator is told (group_status, timeouts) and Work timeouts name."""
        return {r: self._done for r in range(self.ctx.size)} if self._done else {}

    # ------------------------------------------------------------------ the coordinator
    def check(self, call: "Call", waiting: Sequence[int] = (), waited_s: float = 0.0) -> None:
        """Ask the coordinator whether this wait (for group ranks ``waiting``, for
        ``waited_s``) should end; raises its error if so."""
        self.ctx.client.call(
            "lane_check", self.ctx.group_name, self.ctx.global_ranks, call.seq, self.ctx.rank,
            call.fp, self._progress(), list(waiting), waited_s, timeout_s=30.0,
            **self.ctx.ctx(call))

    def time_out(self, call: "Call", missing: Sequence[int]) -> BaseException:
        """The error for ``call`` timing out waiting for group ranks ``missing``."""
        result = self.ctx.client.submit(
            "lane_timeout", self.ctx.group_name, self.ctx.global_ranks, call.seq, self.ctx.rank,
            call.op, list(missing), self._progress(), call.timeout_s)
        try:
            self.ctx.client.wait(result, 30.0, **self.ctx.ctx(call))
        except errors.RaycollError as exc:
            return exc
        who = [self.ctx.global_ranks[s] for s in missing]
        return errors.DistTimeoutError(  # the coordinator answered "ok": cannot happen
            f"{call.op} #{call.seq} on group {self.ctx.group_name!r} timed out after "
            f"{call.timeout_s:g}s: ranks {who} never arrived", missing=who, **self.ctx.ctx(call))

    def close(self) -> None:
        with self._report_lock:
            if self._report_timer is not None:
                self._report_timer.cancel()
                self._report_timer = None
            out, self._out = self._out, None
        self._in.clear()
        if not self._poisoned:
            _give_back(self._key, out)


class _Waiter:
    """The waiting policy of one lane collective: spin, poll, check, time out."""

    def __init__(self, lane: Lane, call: "Call", start: float) -> None:
        self.lane = lane
        self.call = call
        self.start = start
        self.first = True
        self.sleep = POLL_MIN_S
        self.begun = time.monotonic()
        self.check_at = self.begun + CHECK_FIRST_S
        self.check_every = CHECK_FIRST_S

    def pause(self, pending: Sequence[int]) -> None:
        """Nothing came this pass: sleep a little; check with the coordinator or time out
        when it is time to."""
        self.first = False
        if time.monotonic() - self.begun < self.lane.yield_s:
            os.sched_yield()  # oversubscribed: let a peer that is still working run first
        else:
            time.sleep(self.sleep)
            self.sleep = min(self.sleep * 2, POLL_MAX_S)
        now = time.monotonic()
        if now - self.start > self.call.timeout_s:
            raise self.lane.time_out(self.call, pending)
        if now >= self.check_at:
            self.lane.check(self.call, pending, now - self.start)
            self.check_every = min(self.check_every * 2, CHECK_MAX_S)
            self.check_at = time.monotonic() + self.check_every
