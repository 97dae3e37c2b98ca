"""The node segment: a group's ranks on one node run every CPU collective through one
shared-memory segment, natively (raycoll's compiled core, :mod:`raycoll.native`).

A group on one node runs here where every rank has the native core (without it, through the
Ray object store: the one fallback); a group on several nodes gets one per node beside its
direct connections (:mod:`raycoll.transport.node_segment`). The segment's layout and protocol are
written once, in ``raycoll/native/segment.h``; the plans (which bytes each step moves) in
:mod:`raycoll.algorithms.segment_plans`. A collective is one native call: the GIL is
released while it copies, reduces and waits, and no Python runs between two steps.

- **Set-up**, inside the group's first collective, through the coordinator (two steps, once
  per group): the node's first rank creates the segment (a name that carries a hash of the
  group's secret, mode 0600, its memory reserved at once, so that a /dev/shm too small fails
  here with a clear message, and a smaller segment is tried, never a SIGBUS later), the
  others map it, and once every rank has, every rank unlinks its name: a crash or a kill -9
  leaves nothing in /dev/shm. Its size: ``node_segment_bytes`` (group option) a rank.
- **Waiting**: a rank spins for up to ``SPIN_S`` where the node's ranks fit its cores (never
  where they outnumber them, nor while its caller computes beside an async collective), then
  sleeps in the kernel (futex) until the peer it waits for publishes its step; every
  ``TICK_S`` (:mod:`raycoll.transport.base`) it checks that its peers' processes live (a
  dead one is named at once, before Ray reports it) and their abort flags; after 0.1 s, and then at intervals doubling to 1 s,
  it returns to Python for the coordinator's check and the call's deadline.
- **Mismatches** (shape, dtype, op, root, collective) are found on a call's first step from
  the fingerprints every rank publishes, before any data is read: that call fails with
  ``CollectiveMismatchError`` on every rank and the group goes on. A call a rank rejected
  (``PeerArgumentError`` on the others), or that took another path on some ranks (through
  the coordinator), fails alike: those ranks took no step for it, and the ranks stay on the
  same steps (``compare_info`` in ``raycoll/native/segment.c``).
- **Failures** (a timeout, a dead rank, an abort) break the group: this rank raises its
  error, raises its abort flag (its peers stop waiting at once) and the coordinator is told.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from raycoll import errors
from raycoll.algorithms import segment_plans as plans
from raycoll.coordinator.logic import fingerprint_mismatch
from raycoll.native import core, dtype_code, op_code
from raycoll.options import or_default
from raycoll.reduce_op import ReduceOp, reduce_arrays
from raycoll.context import Call
from raycoll.tensors import dtype_name
from raycoll.transport.base import (REPORT_EVERY_S, NativeTransport, SpinBackoff, may_spin,
                                    segment_failure, wait_policy)
from raycoll.transport.fingerprints import Fingerprints, all_reduce_fp
from raycoll.transport.cores import oversubscribed

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.context import GroupContext

logger = logging.getLogger("raycoll")

__all__ = ["SegmentLane", "set_up_segment", "segment_possible", "SEGMENT_BYTES", "SPIN_S"]

#: Each rank's share of the segment (two halves), group option ``node_segment_bytes``.
SEGMENT_BYTES = 4 << 20
#: A segment too large for /dev/shm is tried at half the size, down to this a rank.
MIN_SEGMENT_BYTES = 64 << 10
#: How long a wait spins before it sleeps (ranks that fit the node's cores only).
SPIN_S = 200e-6
#: How long a rank waits for every rank to map the segment before it probes whether it may
#: read their memory (else it says it may not: the group goes without cross-memory reads).
MAPPED_WAIT_S = 10.0
#: Collectives of at least this many bytes a rank read the peers' buffers across processes
#: (where every rank may: the segment's probe), not through the halves.
CMA_BYTES = 1 << 20
#: all_reduce and reduce up to this many bytes take one step (every rank reduces every
#: rank's buffer); larger ones reduce-scatter and all-gather through the halves.
ONE_STEP_BYTES = 64 << 10


def segment_possible(ctx: "GroupContext") -> bool:
    """Whether group ``ctx`` can run on a node segment: the native core is built and on
    (on every rank),  2+ ranks, all on this node, no more than the option ``lane_max_ranks`` (if set) nor
    the core's limit (1,024)."""
    if core is None or not ctx.native or ctx.size < 2 or not ctx.single_node \
            or ctx.size > core.MAX_RANKS:
        return False
    limit = ctx.options.lane_max_ranks
    return limit is None or ctx.size <= limit


def _name(ctx: "GroupContext") -> str:
    """A fresh segment name carrying a hash of the group's secret (at most 31 characters,
    macOS's limit)."""
    digest = hashlib.blake2b((ctx.secret or b"") + uuid.uuid4().bytes + ctx.group_name.encode(),
                             digest_size=12).hexdigest()
    return f"/rc{digest}"


def _half_bytes(ctx: "GroupContext") -> int:
    per_rank = int(or_default(ctx.options.node_segment_bytes, SEGMENT_BYTES))
    return max(core.PAGE, per_rank // 2 // core.PAGE * core.PAGE)


def _create(ctx: "GroupContext", name: str, nranks: int) -> Tuple[Any, str]:
    """The segment of ``nranks`` local ranks, created here, or ``None`` and why not: a
    /dev/shm too small for it gets a smaller one (down to ``MIN_SEGMENT_BYTES`` a rank),
    with a warning naming the option."""
    half = _half_bytes(ctx)
    wanted = half
    while True:
        try:
            seg = core.Segment(name, nranks, 0, half, True)
        except core.SegmentError as exc:
            if exc.errno == 28 and 2 * half > MIN_SEGMENT_BYTES:  # ENOSPC
                half = max(core.PAGE, half // 2 // core.PAGE * core.PAGE)
                continue
            return None, str(exc)
        if half != wanted:
            logger.warning(
                "raycoll: group %r: /dev/shm has no room for a node segment of %d bytes a "
                "rank (group option node_segment_bytes); using %d bytes a rank. Enlarge "
                "/dev/shm (docker run --shm-size=...) or set node_segment_bytes lower",
                ctx.group_name, 2 * wanted, 2 * half)
        return seg, ""


def agree_segment(ctx: "GroupContext", call: "Call", mates: Sequence[int], what: str,
                  extra: Callable[[Any], Any]) -> Tuple[Any, List[Tuple[bool, str, Any]]]:
    """Make the segment of group ranks ``mates`` (this rank among them; the first creates it,
    the others map it) inside ``call``, in two steps through the coordinator alike on every
    rank of the group: the segment, or ``None`` on every rank if any rank of any node could
    not (each says why in the log, naming ``what`` it goes without), and every rank's
    ``(fine, why, extra(segment))`` of the second step. A lone rank (``mates`` of one) has
    none and is fine."""
    me = mates.index(ctx.rank)
    seg: Any = None
    why = ""
    name = _name(ctx) if me == 0 and len(mates) > 1 else ""
    if name:
        seg, why = _create(ctx, name, len(mates))
    offer = (name, seg.half_bytes if seg is not None else 0, why)
    try:
        got = ctx.setup_exchange(call, [offer] * ctx.size)
        leader, half, why = got[mates[0]]
        if me != 0 and half:
            try:
                seg = core.Segment(leader, len(mates), me, half, False)
            except core.SegmentError as exc:
                why = str(exc)
        fine = len(mates) == 1 or seg is not None
        mine = (fine, why, extra(seg) if seg is not None else None)
        ok: List[Tuple[bool, str, Any]] = ctx.setup_exchange(call, [mine] * ctx.size, step=1)
    finally:
        if name:
            core.unlink(name)  # every local rank mapped it (or gave up): nothing stays behind
    failed = {j: w for j, (good, w, _) in enumerate(ok) if not good}
    if failed:
        if seg is not None:
            seg.close()
        logger.warning("raycoll: group %r runs without %s: %s", ctx.group_name, what,
                       "; ".join(f"rank {ctx.global_ranks[j]}: {w}" for j, w in failed.items()))
        return None, ok
    return seg, ok


def set_up_segment(ctx: "GroupContext", call: "Call") -> Optional["SegmentLane"]:
    """Set up the group's node segment inside ``call`` (two steps through the coordinator,
    alike on every rank): the :class:`SegmentLane`, or ``None`` on every rank if any rank
    could not map it (each says why in the log)."""
    seg, ok = agree_segment(ctx, call, range(ctx.size), "a node segment",
                            lambda seg: _all_mapped(seg, ctx.size) and seg.probe_cma())
    if seg is None:
        return None
    return SegmentLane(ctx, seg, cma=all(c for _, _, c in ok))


def _all_mapped(seg: Any, size: int) -> bool:
    """Whether every rank has mapped ``seg`` within ``MAPPED_WAIT_S`` (they do so right after
    the set-up's first step; the cross-memory probe needs them all)."""
    deadline = time.monotonic() + MAPPED_WAIT_S
    while seg.attached < size:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


class SegmentLane(NativeTransport):
    """A group's node segment on this rank: the native collectives."""

    name = "node segment"
    kind = "lane"
    #: (what the backend asks to take the node segment's paths)
    is_segment = True

    @property
    def fast(self) -> "SegmentLane":
        """What runs ``raycoll.all_reduce``'s short path here: this segment (:meth:`fast_plan`)."""
        return self

    def __init__(self, ctx: "GroupContext", seg: Any, cma: bool = False) -> None:
        super().__init__(ctx)
        self.seg = seg
        #: whether large collectives read the peers' buffers across processes (every rank
        #: may read every other's memory: the set-up's probe), from ``cma_bytes`` on
        self.cma = cma
        self.cma_bytes = CMA_BYTES
        self.half = int(seg.half_bytes)
        self.crowded = oversubscribed(ctx.size)
        spin = float(or_default(ctx.options.segment_spin_s, SPIN_S))
        self._spin_ns = 0 if self.crowded else int(spin * 1e9)
        self._fps = Fingerprints()
        self._mem = memoryview(seg)
        self.one_step_bytes = ONE_STEP_BYTES
        #: the most a step carries: the half, or less where the options lane_bytes or
        #: stream_bytes were set lower (at least 64 bytes a rank)
        cap = self.half
        for explicit in (ctx.options.lane_bytes, ctx.options.stream_bytes):
            if explicit:
                cap = min(cap, explicit)
        self.step_bytes = min(self.half, max(cap // 64 * 64, 64 * ctx.size))
        self._spinning, self._no_spin = wait_policy(self._spin_ns), wait_policy(0)
        self._policy = self._spinning if self._spin_ns else self._no_spin
        self._backoff = SpinBackoff(bool(self._spin_ns))
        self._report_every = REPORT_EVERY_S * ctx.size  # the node's ranks together: one a period
        self._report_due = 0.0
        #: the all_reduce short path's plans and fingerprints, by (dtype, shape, op)
        self._fast: Dict[Any, Any] = {}
        #: all_to_all's plans, by pieces (and longest piece)
        self._a2a_first: Dict[Any, Tuple[plans.Plan, np.ndarray]] = {}
        self._a2a_rest: Dict[Any, plans.Plan] = {}
        self._off_diagonal = ~np.eye(ctx.size, dtype=bool)

    # ------------------------------------------------------------------ running a plan
    def run(self, call: "Call", plan: plans.Plan, bufs: Sequence[Any], dtype: int = 0,
            op: int = 0, factor: float = 1.0, divisor: int = 0, first: bool = True,
            fp: Optional[bytes] = None) -> None:
        """Run ``plan`` for ``call`` over ``bufs``; raise the call's error if it fails.
        ``first``: this run holds the call's first step (its timeout counts from here);
        ``fp``: the call's fingerprint as the segment compares it, if known."""
        if first:
            self._call_began = time.monotonic()
        self._call = call
        self.ctx.note_native(call, plan.steps)
        try:
            status, peer, _, broke, exc = self.seg.run(
                plan.ops, bufs, dtype, op, factor, divisor, call.seq,
                self._fps.encode(call.fp) if fp is None else fp,
                self._policy if may_spin() else self._no_spin, self._check)
        finally:
            self._waiting = None
        if status:
            raise self._failed(call, status, peer, broke, exc)
        self._done = (call.op, call.seq)
        if first:
            self.calls += 1
        if self._backoff.counted(self.calls, self.seg.spin_fails):
            if not self._backoff.on:
                self._policy = self._no_spin
        elif self._policy is self._no_spin and self._backoff.enabled \
                and self._backoff.spinning(self.calls):
            self._policy = self._spinning
        if self._report_timer is None or time.monotonic() >= self._report_due:
            self.report()

    @property
    def spins_failed(self) -> int:
        """Waits whose spin ran its whole length without the peer."""
        return self._backoff.failed

    @property
    def report_every_s(self) -> float:
        return self._report_every

    def report(self, force: bool = False, wait_s: float = 0.0) -> None:
        super().report(force, wait_s)
        self._report_due = self._reported_at + self._report_every

    def fast_plan(self, arr: np.ndarray, op: ReduceOp) -> Any:
        """For ``raycoll.all_reduce``'s short path (``ProcessGroup.fast_all_reduce``): the
        plan, codes and fingerprint of an all_reduce of ``arr`` with ``op`` (cached by
        dtype, shape and op), or ``False`` when the core has no plan for it."""
        key = (arr.dtype, arr.shape, op)
        entry = self._fast.get(key)
        if entry is None:
            if len(self._fast) > 256:
                self._fast.clear()
            entry = self._fast[key] = self._fast_entry(arr, op)
        return entry

    def run_fast(self, entry: Any, seq: int, timeout_s: float, arr: np.ndarray) -> None:
        """Run an all_reduce planned by :meth:`fast_plan` as collective ``seq``."""
        plan, dtype, opc, factor, divisor, fp, blob = entry
        self.run(Call("all_reduce", seq, timeout_s, fp), plan, (arr,), dtype, opc, factor, divisor, True, blob)

    def _fast_entry(self, arr: np.ndarray, op: ReduceOp) -> Any:
        codes = self._op(arr, op)
        if codes is None:
            return False
        fp = all_reduce_fp(dtype_name(arr.dtype), arr.shape, op.key)
        plan = self._all_reduce_plan(arr.size, arr.itemsize, -1)
        return (plan, codes[0], codes[1], float(op.factor or 1.0),
                self.ctx.size if op.name == "AVG" else 0, fp, self._fps.encode(fp))

    def _broken(self) -> None:
        """This rank's call failed in a way that breaks the group: its peers stop waiting."""
        self._poisoned = True
        try:
            self.seg.abort(core.ABORT_FAILED)
        except ValueError:  # already closed
            pass

    def _failed(self, call: "Call", status: int, peer: int, broke: bool = False,
                exc: Optional[BaseException] = None) -> BaseException:
        """The error for a run that ended with ``status`` (naming group rank ``peer``).
        ``broke``: the core raised this rank's abort flag itself (the failure came after the
        call's first step, or was not one that leaves the group usable); ``exc``: what the
        check raised (status ``CHECK``)."""
        where = f"{call.op} #{call.seq} on group {self.ctx.group_name!r}"
        ranks = self.ctx.global_ranks
        if status == core.CHECK:
            if broke:
                self._poisoned = True
                self.ctx.fail(exc if isinstance(exc, errors.RaycollError) else
                              errors.GroupBrokenError(
                                  f"{where}: rank {ranks[self.ctx.rank]} left the node "
                                  f"segment mid-call ({type(exc).__name__}: {exc}); the group "
                                  "is broken", **self.ctx.ctx(call)))
            assert exc is not None, "the core hands back the check's exception"
            return exc
        if status == core.MISMATCH:
            parity = self.seg.step & 1
            fps = {r: Fingerprints.decode(self.seg.info(r, parity)["fp"])
                   for r in range(self.ctx.size)}
            problem = fingerprint_mismatch(fps, ranks) or "the ranks' fingerprints differ"
            return errors.CollectiveMismatchError(f"{where}: {problem}", **self.ctx.ctx(call))
        if status == core.SEQ:  # the peer left this call out (it rejected its arguments,
            # or its call took another path): the coordinator knows which, a moment later
            theirs = self.seg.info(peer, self.seg.step & 1)["call_seq"]
            explained = self._explained(call)
            return explained if explained is not None else errors.CollectiveMismatchError(
                f"{where}: rank {ranks[peer]} left it out and is already at collective "
                f"#{theirs}: the ranks are out of step", **self.ctx.ctx(call))
        known = segment_failure(self, call, self.seg, status, peer, range(self.ctx.size),
                                self._broken)
        if known is not None:
            return known
        self._broken()
        err = errors.GroupBrokenError(f"{where}: the node segment refused a plan "
                                      f"(status {status}, operation {peer}): a bug",
                                      **self.ctx.ctx(call))
        self.ctx.fail(err)
        return err

    def _shut(self) -> None:
        self._broken()

    def _release(self) -> None:
        self._mem.release()
        self.seg.close()

    # ------------------------------------------------------------------ the collectives
    def _all_reduce_plan(self, count: int, itemsize: int, root: int) -> plans.Plan:
        """all_reduce's plan (reduce's, with a root): across processes when it is large."""
        if self._across(count * itemsize):
            return plans.cma_all_reduce(count, itemsize, self.ctx.size, self.ctx.rank, root)
        return plans.all_reduce(count, itemsize, self.ctx.size, self.ctx.rank, self.step_bytes,
                                self.one_step_bytes, root)

    def _across(self, nbytes: int) -> bool:
        """Whether a collective of ``nbytes`` reads the peers' buffers across processes."""
        return self.cma and nbytes >= self.cma_bytes

    def _op(self, arr: np.ndarray, op: ReduceOp) -> Optional[Tuple[int, int]]:
        """(dtype code, op code) when the core reduces ``arr``'s dtype with ``op``."""
        code = dtype_code(arr.dtype)
        if code is None:
            return None
        name = op.name
        if arr.dtype.kind == "c" and name != "SUM":
            return None  # numpy's complex products and divisions: not bit-reproduced natively
        opc = op_code(name)
        return (code, opc) if core.supported(code, opc) else None

    def run_all_reduce(self, call: "Call", flat: np.ndarray, op: ReduceOp,
                   root: int = -1) -> None:
        """all_reduce (or reduce, into ``root``) of ``flat`` in place."""
        codes = self._op(flat, op)
        if codes is None:
            return self._reduce_in_numpy(call, flat, op, root)
        plan = self._all_reduce_plan(flat.size, flat.itemsize, root)
        self.run(call, plan, (flat,), codes[0], codes[1], float(op.factor or 1.0),
                 self.ctx.size if op.name == "AVG" else 0)

    def _reduce_in_numpy(self, call: "Call", flat: np.ndarray, op: ReduceOp,
                         root: int) -> None:
        """A reduction the core does not do (complex PRODUCT, AVG, PREMUL_SUM; a dtype in
        the other byte order): gather every rank's buffer, reduce with numpy in rank order."""
        whole = np.empty(flat.size * self.ctx.size, dtype=flat.dtype)
        self.run_all_gather(call, flat, whole, -1)
        if root < 0 or root == self.ctx.rank:
            parts = [whole[r * flat.size:(r + 1) * flat.size] for r in range(self.ctx.size)]
            np.copyto(flat, reduce_arrays(op, parts))

    def run_reduce_scatter(self, call: "Call", whole: np.ndarray, out: np.ndarray,
                       op: ReduceOp) -> None:
        """``out`` = the reduction of every rank's piece ``me`` of ``whole`` (W pieces)."""
        codes = self._op(out, op)
        if codes is None:  # reduced in numpy: a whole all_reduce, on a copy of the input
            mine = np.array(whole)
            self._reduce_in_numpy(call, mine, op, -1)
            np.copyto(out, mine[self.ctx.rank * out.size:(self.ctx.rank + 1) * out.size])
            return
        if self._across(whole.nbytes):
            plan = plans.cma_reduce_scatter(out.size, out.itemsize, self.ctx.size, self.ctx.rank)
        else:
            plan = plans.reduce_scatter(out.size, out.itemsize, self.ctx.size, self.ctx.rank,
                                        self.step_bytes)
        self.run(call, plan, (whole, out), codes[0], codes[1], float(op.factor or 1.0),
                 self.ctx.size if op.name == "AVG" else 0)

    def run_broadcast(self, call: "Call", flat: np.ndarray, root: int) -> None:
        plan = (plans.cma_broadcast(flat.nbytes, self.ctx.size, self.ctx.rank, root)
                if self._across(flat.nbytes) else
                plans.broadcast(flat.nbytes, self.ctx.size, self.ctx.rank, self.step_bytes, root))
        self.run(call, plan, (_bytes(flat),))

    def run_all_gather(self, call: "Call", mine: np.ndarray, out: Optional[np.ndarray],
                       root: int, pieces: Sequence[np.ndarray] = ()) -> None:
        """Every rank's ``mine`` into ``out`` (W pieces) or into ``pieces`` (one array each);
        only on ``root`` when it is >= 0 (the others pass neither)."""
        size, me = self.ctx.size, self.ctx.rank
        each = bool(pieces)
        plan = (plans.cma_all_gather(mine.nbytes, size, me, root, each)
                if self._across(mine.nbytes * size) else
                plans.all_gather(mine.nbytes, size, me, self.step_bytes, root, each))
        outs = (_EMPTY,) + tuple(_bytes(p) for p in pieces) if each else (
            _bytes(out) if out is not None else _EMPTY,)
        self.run(call, plan, (_bytes(mine),) + outs)

    def run_scatter(self, call: "Call", pieces: Sequence[np.ndarray], out: np.ndarray,
                    root: int) -> None:
        """The root's ``pieces[j]`` (one array each; the others pass none) into rank j's
        ``out``."""
        size, me = self.ctx.size, self.ctx.rank
        plan = (plans.cma_scatter(out.nbytes, size, me, root, True)
                if self._across(out.nbytes * size) else
                plans.scatter(out.nbytes, size, me, self.step_bytes, root, True))
        self.run(call, plan, (_EMPTY, _bytes(out)) + tuple(_bytes(p) for p in pieces))

    def run_barrier(self, call: "Call") -> None:
        self.run(call, plans.barrier(), ())

    def gather_seqs(self, call: "Call", seq: Optional[int]) -> List[Optional[int]]:
        """Every rank's ``seq`` (a join round's sequence number, ``None`` for a rank still
        with inputs), by group rank: one all_gather of a word a rank."""
        out = np.empty(self.ctx.size, dtype=np.int64)
        self.run_all_gather(call, np.array([-1 if seq is None else seq], np.int64), out, -1)
        return [None if s < 0 else int(s) for s in out.tolist()]

    def run_all_to_all(self, call: "Call", bufs: Sequence[np.ndarray],
                       sends: Sequence[plans.Piece], recvs: Sequence[plans.Piece]) -> None:
        """all_to_all: ``sends[j]`` (buffer id, offset, bytes; ids from 1, indexing
        ``bufs``, flat contiguous arrays) goes to rank j, which puts it where its
        ``recvs[me]`` says. Sizes may
        differ per pair: the first step carries every rank's, checked on every rank (all see
        the same table) before any data is read."""
        size, me = self.ctx.size, self.ctx.rank
        sends, recvs = tuple(sends), tuple(recvs)
        first, sizes = self._a2a_first.get((sends, recvs)) or self._a2a_plan(sends, recvs)
        allbufs = (sizes,) + tuple(_bytes(b) for b in bufs)
        self.run(call, first, allbufs)
        # every rank's sizes, a strided view of the halves of this step (no copy)
        table = np.ndarray((size, 2 * size), dtype=np.int64, buffer=self._mem,
                           offset=self.seg.half_offset(0, self.seg.step & 1),
                           strides=(2 * self.half, 8))
        sent, expected = table[:, :size], table[:, size:].T
        if not np.array_equal(sent, expected):
            ranks = self.ctx.global_ranks
            bad = np.argwhere(sent != expected)
            pairs = "; ".join(f"rank {ranks[s]} sends rank {ranks[r]} {int(sent[s, r])} bytes but "
                              f"rank {ranks[r]} expects {int(expected[s, r])}" for s, r in bad[:4])
            more = f"; ... and {len(bad) - 4} more" if len(bad) > 4 else ""
            raise errors.CollectiveMismatchError(
                f"{call.op} #{call.seq} on group {self.ctx.group_name!r}: {pairs}{more}",
                **self.ctx.ctx(call))
        longest = int((sent * self._off_diagonal).max())
        plan = self._a2a_rest.get((sends, recvs, longest))
        if plan is None:
            plan = plans.all_to_all_rest(longest, sends, recvs, size, me, self.half)
            self._a2a_rest = _bounded(self._a2a_rest)
            self._a2a_rest[(sends, recvs, longest)] = plan
        self.run(call, plan, allbufs, first=False)

    def _a2a_plan(self, sends: Tuple[plans.Piece, ...],
                  recvs: Tuple[plans.Piece, ...]) -> Tuple[plans.Plan, np.ndarray]:
        """An all_to_all's first step and this rank's sizes (cached by its pieces)."""
        sizes = np.array([n for _, _, n in sends] + [n for _, _, n in recvs], dtype=np.int64)
        got = (plans.all_to_all_first(sends, self.ctx.size, self.ctx.rank, self.half), sizes)
        self._a2a_first = _bounded(self._a2a_first)
        self._a2a_first[(sends, recvs)] = got
        return got


_EMPTY = np.empty(0, dtype=np.uint8)


def _bounded(cache: Dict[Any, Any], most: int = 256) -> Dict[Any, Any]:
    """``cache``, emptied once it holds ``most`` entries."""
    if len(cache) >= most:
        cache.clear()
    return cache


def _bytes(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a contiguous array (any dtype: the plans count bytes)."""
    return arr.reshape(-1).view(np.uint8) if arr.size else _EMPTY

