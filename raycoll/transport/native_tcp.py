"""A schedule's steps over the group's direct connections, run natively: one call of the
compiled core for a whole collective (``raycoll/native/net.h`` has the protocol; the plan is
made by :mod:`raycoll.algorithms.native_plans` and handed in), with the GIL released and no Python between two
messages: vectored sends of header and data, receives straight into the destination, the
reductions in place.

A group's transport on direct connections (:class:`NativeSockets`) where every rank of the
group has the native core (rendezvous tells). Its messages go over connections of their own (purpose
``"ncoll"``, made on first use like the others), so that they never meet point-to-point's
frames. The counters (``ProcessGroup.counters()``) gain exactly what moved, brought up to date once per run of calls of one kind (and when read), not per call.
``raycoll.all_reduce``'s short path replays what the full path ran for an array of the same
dtype and size (:meth:`NativeSockets.fast_plan`): tens of microseconds of Python fewer a
call.

A message's header carries the call's sequence number, step and fingerprint hash, read
before its bytes: a message of an earlier (failed) call is skipped; one of a later call is
kept for it and fails this one (its sender left this call out, say rejected its arguments);
one that does not match this rank's call fails the call, here, and, through the coordinator,
on every rank (``CollectiveMismatchError``). Either way the streams stay whole and the group
goes on. A connection that closes, a timeout or a dead rank breaks the group.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple

import numpy as np

from raycoll import errors
from raycoll.context import Call
from raycoll.native import CONN_DTYPE, core, dtype_code, op_code
from raycoll.transport.base import NativeTransport, SpinBackoff, may_spin, wait_policy
from raycoll.transport.cores import host_ranks, oversubscribed
from raycoll.tensors import dtype_name
from raycoll.transport.fingerprints import Fingerprints, all_reduce_fp
from raycoll.transport.links import CLOSED_GRACE_S, Links, PeerClosed, PeerLeft, peer_failure

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.algorithms.native_plans import NativePlan  # (plans are handed in)
    from raycoll.context import GroupContext
    from raycoll.reduce_op import ReduceOp

__all__ = ["NativeSockets", "SPIN_S"]

#: How long a wait on the sockets spins (non-blocking reads) before it polls, where the
#: group's ranks on this machine fit its cores: as long as the segment's and the pipes', so
#: that a rank leaving a barrier a little after its peer is still met spinning (the waits
#: back off where spins keep running out: :class:`~raycoll.transport.base.SpinBackoff`).
SPIN_S = 200e-6
#: The most plans a rank keeps.
_CACHE = 64


class NativeSockets(NativeTransport):
    """A group's collectives over its direct connections on this rank: each a plan of the
    native executor, checked with the coordinator while it waits. Made only where every
    rank of the group has the native core."""

    name = "direct connection"
    kind = "tcp"

    def __init__(self, ctx: "GroupContext", links: Links) -> None:
        super().__init__(ctx)
        self.links = links
        self.failure_grace_s = CLOSED_GRACE_S
        size = ctx.size
        #: each peer's sockets (-1 until connected), and what each incoming connection kept
        #: between calls (a header read ahead)
        self.out_fd = np.full(size, -1, dtype=np.int64)
        self.in_fd = np.full(size, -1, dtype=np.int64)
        self.conns = np.zeros(size, dtype=CONN_DTYPE)
        #: what had moved (net.h's counts: bytes and messages each way, by peer) when the
        #: last run ended, and whether each peer is on this rank's node
        self._moved = self._counts(self.conns)
        #: the kind of the calls run since the counters were last brought up to date, and
        #: their rounds (:meth:`_tally`)
        self._window: Tuple[Optional[str], int] = (None, 0)
        nodes = ctx.node_ids
        self._same_node = np.array([n == nodes[ctx.rank] for n in nodes])
        #: all_reduces the full path ran here, by (dtype, elements, op), and the short
        #: path's entries made of them, by (dtype, shape, op): :meth:`fast_plan`
        self._replays: Dict[Any, Tuple[NativePlan, Tuple[int, int], str]] = {}
        self._fast: Dict[Any, Any] = {}
        self._scratch = np.empty(0, dtype=np.uint8)
        self._fps = Fingerprints()
        spin = 0 if oversubscribed(host_ranks(ctx)) else int(SPIN_S * 1e9)
        self._spinning, self._no_spin = wait_policy(spin), wait_policy(0)
        #: runs' waits stop spinning a while where spins keep running out (a loaded machine,
        #: a loop that computes between calls), counted by the core per peer (``spin_fails``)
        self._backoff = SpinBackoff(bool(spin))
        self._runs = 0
        #: The descriptors above are this object's own (dups of the links' sockets): closing
        #: the group closes them only once no run uses them (a run in flight ends first: the
        #: links' close shuts the sockets under it), so a number the core holds is never one
        #: the process reused meanwhile.
        self._lock = threading.Lock()
        self._busy = 0
        self._fds_closed = False

    @property
    def fast(self) -> "NativeSockets":
        """What runs ``raycoll.all_reduce``'s short path here: these sockets
        (:meth:`fast_plan`)."""
        return self

    def codes(self, flat: np.ndarray, op: Optional["ReduceOp"]) -> Optional[Tuple[int, int]]:
        """(dtype code, op code) when the core can run ``flat``'s collective with ``op``
        (copies: any dtype), else ``None``."""
        if op is None:
            return 0, 0
        code = dtype_code(flat.dtype)
        if code is None or (flat.dtype.kind == "c" and op.name != "SUM"):
            return None
        opc = op_code(op.name)
        return (code, opc) if core.supported(code, opc) else None

    # ------------------------------------------------------------------ the short path
    def remember(self, flat: np.ndarray, op: "ReduceOp", plan: NativePlan,
                 codes: Tuple[int, int], algorithm: str) -> None:
        """The full path ran an all_reduce of ``flat`` with ``op`` as ``plan`` (by
        ``algorithm``): the same path the short one may replay for arrays of its dtype and
        size (the choice depends on nothing else, alike on every rank)."""
        if len(self._replays) >= _CACHE:
            self._replays.clear()
            self._fast.clear()
        self._replays[(flat.dtype, flat.size, op)] = (plan, codes, algorithm)

    def fast_plan(self, arr: np.ndarray, op: "ReduceOp") -> Any:
        """For ``raycoll.all_reduce``'s short path (``ProcessGroup.fast_all_reduce``): what
        the full path ran for an all_reduce like this one (:meth:`remember`), with its
        fingerprint; ``False`` until the full path ran one."""
        key = (arr.dtype, arr.shape, op)
        entry = self._fast.get(key)
        if entry is None:
            got = self._replays.get((arr.dtype, arr.size, op))
            if got is None:
                return False
            plan, codes, algorithm = got
            fp = all_reduce_fp(dtype_name(arr.dtype), arr.shape, op.key)
            entry = self._fast[key] = (plan, codes, op, fp, algorithm)
        return entry

    def run_fast(self, entry: Any, seq: int, timeout_s: float, arr: np.ndarray) -> None:
        """Run an all_reduce of :meth:`fast_plan` as collective ``seq``: what the full path
        runs, without its probes."""
        plan, codes, op, fp, algorithm = entry
        call = Call("all_reduce", seq, timeout_s, fp)
        self.run(call, plan, arr.reshape(-1), codes, op)
        self.ctx.note_rounds(call, plan.rounds, algorithm)

    @property
    def spins_failed(self) -> int:
        """Runs whose wait spun its whole length without the peer."""
        return self._backoff.failed

    # ------------------------------------------------------------------ connections
    def _connect(self, call: "Call", plan: NativePlan) -> None:
        """Make the connections ``plan`` uses (the first time only): this rank's outgoing
        ones first, then it waits for its peers' (they connect as this rank does, so none
        waits on another in a cycle)."""
        links = self.links
        for dst in plan.sends_to:
            if self.out_fd[dst] < 0:
                self._own(self.out_fd, dst, links.outgoing(dst, "ncoll", call.timeout_s).sock)
        missing = [s for s in plan.recvs_from if self.in_fd[s] < 0]
        next_check = time.monotonic() + 0.1
        while missing:
            for s in list(missing):
                sock = links.incoming(s, "ncoll")
                if sock is not None:
                    self._own(self.in_fd, s, sock)
                    missing.remove(s)
            if not missing:
                return
            now = time.monotonic()
            if now - self._call_began > call.timeout_s:
                raise self.time_out(call, missing)
            if now >= next_check:
                self.check(call, missing, now - self._call_began)
                next_check = now + 0.5
            links.wait(0.01)

    def _own(self, table: np.ndarray, slot: int, sock: socket.socket) -> None:
        """Keep a descriptor of ``sock``'s connection of this object's own (a dup)."""
        with self._lock:
            if self._fds_closed:
                raise PeerClosed("the group is closed on this rank")
            table[slot] = os.dup(sock.fileno())

    def whole(self, direction: str, peer: int) -> bool:
        """Whether this rank's stream with group rank ``peer`` (``direction``: ``"out"``
        or ``"in"``) is whole between calls: no run in flight, not shut by the core, no
        header read ahead (what a later generation of the group may take over)."""
        with self._lock:
            if self._busy:
                return False
            conn = self.conns[peer]
            if direction == "out":
                return not conn["out_cut"]
            return not conn["in_cut"] and not conn["held"]

    def _idle(self) -> None:
        """A run ended: the last one out after a close closes the descriptors."""
        with self._lock:
            self._busy -= 1
            last = self._fds_closed and self._busy == 0
        if last:
            self._close_fds()

    def fail_broken(self) -> None:
        """A run broke the group: close the connections (telling the peers), so that a rank
        arriving late fails too."""
        self._poisoned = True
        try:
            self._shut()
        except Exception:  # noqa: BLE001 - best effort: the coordinator knows
            pass

    def _shut(self) -> None:
        self.links.close()  # broken: the peers must fail too

    def close(self) -> None:
        """The group is closing on this rank: the descriptors are closed now, or by the run
        still using them when it ends (the links' close shut the connections under it)."""
        with self._lock:
            idle = not self._fds_closed and self._busy == 0
            self._fds_closed = True
        if idle:
            self._close_fds()
        super().close()

    def _close_fds(self) -> None:
        for table in (self.out_fd, self.in_fd):
            for slot in np.flatnonzero(table >= 0):
                try:
                    os.close(int(table[slot]))
                except OSError:  # pragma: no cover - ours: open until here
                    pass
                table[slot] = -1

    # ------------------------------------------------------------------ running
    def run(self, call: "Call", plan: NativePlan, flat: np.ndarray,
            codes: Tuple[int, int], op: Optional["ReduceOp"],
            more: Sequence[np.ndarray] = (), node: Any = None) -> None:
        """Run ``plan`` for ``call`` on ``flat`` (in place; buffer 0, the scratch is 1, and
        ``more``, contiguous arrays, are 2, 3, ...); raise the call's error. ``node``: the
        group's :class:`~raycoll.transport.node_segment.NodeSegment`, whose segment the
        plan's segment operations run on in the same call (hierarchical plans). Reports this
        rank's progress to the coordinator at most once a period."""
        self._call_began = time.monotonic()
        self._call = call
        with self._lock:
            if self._fds_closed:
                raise errors.GroupDestroyedError(
                    f"{call.op} #{call.seq} on group {self.ctx.group_name!r}: the group "
                    "was destroyed on this rank")
            self._busy += 1
            if call.op != self._window[0]:
                self._tally(self.conns)
                self._window = (call.op, 0)
        before = self.conns.copy()
        try:
            self._execute(call, plan, flat, codes, op, more, node)
        except BaseException:
            with self._lock:  # the calls before count; this failed one's traffic for none
                self._tally(before)
                self._moved = self._counts(self.conns)
            raise
        finally:
            self._idle()
        self._window = (call.op, self._window[1] + plan.rounds)
        self._done = (call.op, call.seq)
        self.calls += 1
        if self._report_timer is None:  # (else the timer's report is on its way)
            self.report()

    def flush(self) -> None:
        """Bring the counters up to date (before they are read): the traffic of the calls
        run since the last flush, unless a run is in flight (then at its end)."""
        with self._lock:
            if self._busy == 0:
                self._tally(self.conns)

    @staticmethod
    def _counts(conns: np.ndarray) -> np.ndarray:
        """(bytes sent, bytes received, messages sent, messages received) by peer, as the
        core counted them in ``conns``."""
        return np.stack([conns["sent"], conns["received"], conns["msgs_sent"].astype(np.uint64),
                         conns["msgs_received"].astype(np.uint64)], axis=1)

    def _tally(self, conns: np.ndarray) -> None:
        """The counters of the calls since the last tally (a run of calls of one kind: they
        count alike, so the Python of the counting is paid once per run, not per call) gain
        what the core moved (``conns``: its counts at the run's end; counted where the bytes
        move, not taken from the plans); the rounds are the plans' steps with traffic.
        Holds ``_lock``."""
        kind, rounds = self._window
        self._window = (kind, 0)
        now = self._counts(conns)
        moved = (now - self._moved) & np.uint64(0xFFFFFFFF_FFFFFFFF)
        moved[:, 2:] &= np.uint64(0xFFFFFFFF)  # the message counts are 32-bit and wrap
        self._moved = now
        if kind is None:
            return
        same = self._same_node
        tally = self.tally(kind)
        tally.bytes_sent_same_node += int(moved[same, 0].sum())
        tally.bytes_sent_other_node += int(moved[~same, 0].sum())
        tally.bytes_recv_same_node += int(moved[same, 1].sum())
        tally.bytes_recv_other_node += int(moved[~same, 1].sum())
        tally.messages_sent += int(moved[:, 2].sum())
        tally.messages_recv += int(moved[:, 3].sum())
        tally.rounds += rounds
        tally.add_peers(np.flatnonzero(moved[:, 2] + moved[:, 3]).tolist())

    def _execute(self, call: "Call", plan: NativePlan, flat: np.ndarray,
                 codes: Tuple[int, int], op: Optional["ReduceOp"],
                 more: Sequence[np.ndarray], node: Any = None) -> None:
        self._connect(call, plan)
        if self._scratch.nbytes < plan.scratch:
            self._scratch = np.empty(plan.scratch, dtype=np.uint8)
        size = self.ctx.size
        factor = float(op.factor or 1.0) if op is not None else 1.0
        divisor = size if op is not None and op.name == "AVG" else 0
        fp = self._fps.hash(call.fp)
        spinning = may_spin() and self._backoff.spinning(self._runs)
        wait = self._spinning if spinning else self._no_spin
        try:
            status, peer, err, broke, exc = core.execute(
                node.seg if node is not None else None, plan.ops,
                (_bytes(flat), self._scratch, *map(_bytes, more)), codes[0], codes[1], factor,
                divisor, call.seq, node.encode(call.fp) if node is not None else b"", wait,
                self._check, (self.out_fd, self.in_fd, self.conns, fp),
                node.rank_map if node is not None else b"")
        finally:
            self._waiting = None
            self._runs += 1
        if spinning:
            self._backoff.counted(self._runs, int(self.conns["spin_fails"].sum()))
        if status:
            got = (node.failed(self.ctx, self, call, status, peer)
                   if node is not None and node.seg is not None and not self._fds_closed else None)
            raise got if got is not None else self._failed(call, status, peer, err, broke, exc,
                                                           node)

    def _tell_others(self, call: "Call", message: str) -> None:
        """The ranks that do not hear from this one (their schedule never reads it, or the
        rank that left the call out) learn of the mismatch from the coordinator, at their
        wait's next check."""
        ctx = self.ctx
        try:
            ctx.client.submit_reject(ctx.group_name, ctx.global_ranks, call.seq, ctx.rank,
                                     call.op, message, kind="mismatch")
        except Exception:  # noqa: BLE001 - their wait still ends: the call's timeout
            pass

    def _failed(self, call: "Call", status: int, peer: int, err: int, broke: bool,
                exc: Optional[BaseException], node: Any = None) -> BaseException:
        """The error of a run that ended with ``status``. ``broke``: the core shut the call's
        sockets itself (the failure breaks the group); ``exc``: what the check raised."""
        ctx = self.ctx
        where = f"{call.op} #{call.seq} on group {ctx.group_name!r}"
        ranks = ctx.global_ranks
        if self._fds_closed:  # destroyed on this rank while the call ran: its sockets were shut
            return errors.GroupDestroyedError(
                f"{where}: the group was destroyed on this rank while the call ran")
        if status == core.CHECK:
            assert exc is not None, "the core hands back the check's exception"
            if broke:
                self.fail_broken()
                ctx.fail(exc if isinstance(exc, errors.RaycollError) else
                         errors.GroupBrokenError(
                             f"{where}: rank {ranks[ctx.rank]} left the call mid-way "
                             f"({type(exc).__name__}: {exc}); the group is broken",
                             **ctx.ctx(call)))
            return exc
        if broke and status in (core.MISMATCH, core.SEQ):  # found while a message of this
            # rank's was left mid-way: the core shut that connection, the group is broken
            self.fail_broken()
            ctx.fail(errors.GroupBrokenError(
                f"{where}: the ranks' calls differ, and rank {ranks[ctx.rank]} had to leave a "
                "message mid-way; the group is broken", **ctx.ctx(call)))
        problem = node.mismatch(ctx) if status == core.MISMATCH and node is not None else None
        if problem:  # the node's ranks disagreed at the segment's first step
            self._tell_others(call, f"{where}: {problem}")
            return errors.CollectiveMismatchError(f"{where}: {problem}", **ctx.ctx(call))
        if status == core.MISMATCH:
            message = (f"{where}: rank {ranks[peer]} sent rank {ranks[ctx.rank]} a message of "
                       "another call (a different collective, or different shapes, dtype, op "
                       "or root)")
            self._tell_others(call, message)
            return errors.CollectiveMismatchError(message, **ctx.ctx(call))
        if status == core.SEQ:
            explained = self._explained(call)
            if explained is not None:
                return explained
            message = (f"{where}: rank {ranks[peer]} left it out (it is at a later "
                       "collective): the ranks are out of step")
            self._tell_others(call, message)
            return errors.CollectiveMismatchError(message, **ctx.ctx(call))
        if status in (core.PEER_CLOSED, core.FOREIGN):
            closed: BaseException = (
                PeerLeft(f"rank {ranks[peer]} closed the connection")
                if status == core.FOREIGN
                else PeerClosed(f"rank {ranks[peer]} closed the connection"))
            suspects = self.links.suspects(peer, closed)
            self.fail_broken()
            explained = self._explained(call, suspects)
            if explained is not None:
                return explained
            failure = peer_failure(self.links, ranks, where, peer, closed, **ctx.ctx(call))
            ctx.fail(failure)
            return failure
        self.fail_broken()
        if status == core.IOERR:  # a socket the kernel gave up on (ETIMEDOUT on a link that
            explained = self._explained(call)  # crawls, say): the group's first error,
            if explained is not None:  # where it has one (a timeout elsewhere), is the cause
                return explained
        detail = {core.GARBLED: f"a garbled frame from rank {ranks[peer]} (its stream does "
                                "not parse)",
                  core.IOERR: f"a socket call failed (errno {err})",
                  core.BADPLAN: f"the core refused the plan (operation {peer}): a bug"}
        failure = errors.GroupBrokenError(
            f"{where}: {detail.get(status, f'status {status}')}; the group is broken",
            **ctx.ctx(call))
        ctx.fail(failure)
        return failure


def _bytes(arr: np.ndarray) -> np.ndarray:
    return arr.reshape(-1).view(np.uint8)
