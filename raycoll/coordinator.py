"""The coordinator: one async Ray actor per root group, and the client ranks use to reach it.

The coordinator is the control plane. It does rendezvous (world size, rank uniqueness, each
rank's node), keeps a small key-value store, matches every collective's arrivals (sequence
number, step, fingerprint), routes small payloads and object references between ranks,
reduces small payloads inline, matches point-to-point messages, and reports failures to
every rank involved: mismatched arguments, a rank that rejected its own arguments, ranks that
never arrived (by name, with their last completed collective), an aborted group. Subgroups
made with ``new_group`` share their root group's coordinator, keyed by group name.

It knows nothing of arrays beyond metadata and small inline payloads: large data travels as
object references that it only forwards.

Results travel back as plain tuples, ``("ok", value)`` or ``("err", kind, message, extra)``;
:class:`CoordinatorClient` turns the latter into raycoll's exceptions on the calling rank.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import re
import secrets
import time
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import ray

from raycoll import errors
from raycoll.reduce_op import ReduceOp, reduce_arrays

logger = logging.getLogger("raycoll")

__all__ = ["Coordinator", "CoordinatorClient", "coordinator_name", "GRACE_S",
           "fingerprint_mismatch", "meta_mismatch", "unwrap"]

#: What a mismatch in a join round adds to its message.
JOIN_OUT_OF_STEP = ("(the ranks of a Join are out of step: does every rank use the same joinables "
                    "and throw_on_early_termination, does the first joinable call "
                    "Join.notify_join_context before its collectives, and does each main_hook "
                    "shadow exactly one iteration's collectives?)")

#: Extra seconds a rank waits for the coordinator's answer beyond the collective's timeout.
GRACE_S = 10.0

Result = Tuple[Any, ...]


def coordinator_name(job_id: str, group_name: str) -> str:
    """The Ray actor name of a root group's coordinator (namespaced by the job)."""
    return f"raycoll:{job_id}:{group_name}"


def _ok(value: Any = None) -> Result:
    return ("ok", value)


def _err(kind: str, message: str, **extra: Any) -> Result:
    return ("err", kind, message, extra)


def _fmt_ranks(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(str(r) for r in ranks) + "]"


@dataclass
class _Arrival:
    fp: Dict[str, Any]
    send_meta: Optional[List[Any]]
    recv_meta: Optional[List[Any]]
    payload: Any


@dataclass
class _Round:
    """One step of one collective on one group: who arrived, with what, and the outcome."""

    op: str
    seq: int
    size: int
    arrivals: Dict[int, _Arrival] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    results: Optional[Dict[int, Any]] = None
    error: Optional[Result] = None
    collected: set = field(default_factory=set)


@dataclass
class _Message:
    src: int
    tag: int
    meta: Any
    payload: Any
    future: "asyncio.Future[Result]"


@dataclass
class _Receiver:
    src: Optional[int]
    tag: int
    meta: Any
    future: "asyncio.Future[Result]"


class Coordinator:
    """The coordinator actor's class. Create it with :func:`start_coordinator`."""

    def __init__(self, group_name: str, world_size: int, owned_by_ranks: bool = False) -> None:
        self._group_name = group_name
        self._world_size = world_size
        # A coordinator started by ranks rendezvousing by name is detached (so that no rank's
        # exit can take it down mid-run): it goes away when every rank has left or died.
        self._owned_by_ranks = owned_by_ranks
        self._members: Dict[int, Dict[str, Any]] = {}
        self._formed = asyncio.Event()
        self._generation = 0
        self._secret = b""
        self._left: set = set()
        self._reset = asyncio.Event()
        self._kv: Dict[str, Any] = {}
        self._kv_events: Dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self._rounds: Dict[Tuple[str, int, int], _Round] = {}
        self._groups: Dict[str, Tuple[int, ...]] = {}
        self._broken: Dict[str, Result] = {}
        self._last: Dict[str, Dict[int, Tuple[str, int]]] = defaultdict(dict)
        self._current: Dict[str, Dict[int, Tuple[str, int]]] = defaultdict(dict)
        self._mail: Dict[Tuple[str, int], Deque[_Message]] = defaultdict(deque)
        self._waiting: Dict[Tuple[str, int], List[_Receiver]] = defaultdict(list)
        self._init_liveness()
        # Join state (see the "join" section): group rank -> seq of the round it joined in,
        # for the Join context in progress; and how the last finished one ended.
        self._joins: Dict[str, Dict[int, int]] = defaultdict(dict)
        self._join_done: Dict[str, Dict[str, Any]] = {}
        # groups whose ranks reported progress on a round transport, and its name
        self._lane_groups: Dict[str, str] = {}

    # ------------------------------------------------------------------ rendezvous
    async def rendezvous(self, rank: int, world_size: int, info: Dict[str, Any], timeout_s: float) -> Result:
        """Register ``rank``; return every rank's info once all ``world_size`` have arrived."""
        if world_size != self._world_size:
            return _err(
                "value",
                f"group {self._group_name!r} has world_size={self._world_size}, "
                f"but rank {rank} called with world_size={world_size}",
            )
        if not 0 <= rank < world_size:
            return _err("value", f"rank={rank} is out of range for world_size={world_size}")
        if self._formed.is_set() and rank in self._left:
            # This rank left and comes back: wait until every rank has left, then re-form.
            try:
                await asyncio.wait_for(self._reset.wait(), timeout_s)
            except asyncio.TimeoutError:
                return _err("timeout", f"rank {rank} re-joined group {self._group_name!r} but the "
                            f"previous generation never fully left within {timeout_s}s")
        if rank in self._members:
            holder = self._members[rank].get("actor_id") or "a non-actor process"
            state = "formed" if self._formed.is_set() else "forming"
            return _err("value", f"rank {rank} joined group {self._group_name!r} ({state}) twice: "
                        f"it is held by another process (actor {holder}); two processes called "
                        "with the same rank, or this process was not made part of the group")
        self._members[rank] = info
        if len(self._members) == self._world_size:
            self._secret = secrets.token_bytes(16)  # for direct connections (transport.tcp)
            self._formed.set()
            self._reset = asyncio.Event()
            self._left = set()
        try:
            await asyncio.wait_for(self._formed.wait(), timeout_s)
        except asyncio.TimeoutError:
            missing = sorted(set(range(self._world_size)) - set(self._members))
            self._members.pop(rank, None)
            return _err("timeout", f"rendezvous of group {self._group_name!r} timed out after "
                        f"{timeout_s:g}s: ranks {_fmt_ranks(missing)} never joined", missing=missing)
        return _ok({
            "members": [dict(self._members[r], rank=r) for r in range(self._world_size)],
            "generation": self._generation,
            "secret": self._secret,
        })

    def leave(self, rank: int) -> Result:
        """``rank`` destroyed its handle on the group; once all have, the group may re-form.

        Returns ``{"all_left": bool}``: the last rank to leave a by-name group stops this
        coordinator (a new one is started by the next rendezvous).
        """
        self._left.add(rank)
        self._liveness_left(rank)
        all_left = self._left >= set(range(self._world_size))
        if all_left:
            self._liveness_reset(self._generation)
            self._members.clear()
            self._formed = asyncio.Event()
            self._generation += 1
            self._rounds.clear()
            self._broken.clear()
            self._last.clear()
            self._current.clear()
            self._joins.clear()
            self._join_done.clear()
            self._kv.clear()  # per generation: e.g. an NCCL unique id must not be reused
            self._kv_events.clear()
            self._reset.set()
        return _ok({"all_left": all_left})

    def _self_destruct_if_orphaned(self) -> None:
        """A by-name coordinator whose ranks all died stops itself (nobody else will)."""
        if self._owned_by_ranks and not self._members:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # ------------------------------------------------------------------ key-value store
    def kv_set(self, key: str, value: Any) -> Result:
        self._kv[key] = value
        self._kv_events[key].set()
        return _ok()

    async def kv_get(self, key: str, timeout_s: float) -> Result:
        if key not in self._kv:
            try:
                await asyncio.wait_for(self._kv_events[key].wait(), timeout_s)
            except asyncio.TimeoutError:
                return _err("timeout", f"key {key!r} was not set within {timeout_s:g}s")
        return _ok(self._kv[key])

    # ------------------------------------------------------------------ collectives
    async def exchange(
        self,
        key: str,
        ranks: Tuple[int, ...],
        seq: int,
        step: int,
        rank: int,
        fp: Dict[str, Any],
        send_meta: Optional[List[Any]],
        recv_meta: Optional[List[Any]],
        payload: Any,
        mode: str,
        root: Optional[int],
        timeout_s: float,
    ) -> Result:
        """Arrive at step ``step`` of collective ``seq`` on group ``key``; wait for the others.

        ``mode="route"``: ``payload`` is a per-destination list; each rank gets the list of what
        every source sent it. ``mode="reduce"``: ``payload`` is an array; the coordinator reduces
        all of them with ``fp["reduce_op"]`` and returns the result to every rank (or only to
        ``root``, a group rank).
        """
        failed = self._unusable(key)
        if failed is not None:
            return failed
        self._groups[key] = tuple(ranks)
        size = len(ranks)
        rnd = self._round(key, seq, step, fp.get("op", "?"), size)
        if rank in rnd.arrivals:
            return _err("protocol", f"group rank {rank} arrived twice at {rnd.op} #{seq}")
        self._current[key][rank] = (rnd.op, seq)
        if not rnd.done.is_set():
            rnd.arrivals[rank] = _Arrival(fp, send_meta, recv_meta, payload)
            if len(rnd.arrivals) == size:
                self._complete(key, rnd, mode, root)
        if not rnd.done.is_set():
            try:
                with self._watching(ranks):
                    await asyncio.wait_for(rnd.done.wait(), timeout_s)
            except asyncio.TimeoutError:
                if not rnd.done.is_set():
                    self._time_out(key, rnd, timeout_s)
        return self._collect(key, step, rnd, rank)

    async def exchange_packed(self, request: Tuple[Any, ...]) -> Result:
        """:meth:`exchange` with its arguments in one tuple: the collectives' hot path.

        Ray serializes each argument of an actor call on its own; one tuple instead of twelve
        arguments saves a few hundred microseconds per call on both sides (object references
        nested in the tuple are tracked as with separate arguments).
        """
        return await self.exchange(*request)

    def reject(self, key: str, ranks: Tuple[int, ...], seq: int, rank: int, op: str, message: str) -> Result:
        """``rank`` rejected its own arguments for collective ``seq``: fail it on every rank."""
        self._groups[key] = tuple(ranks)
        rnd = self._round(key, seq, 0, op, len(ranks))
        if not rnd.done.is_set():
            rnd.error = _err("peer_arg", f"{op} #{seq} on group {key!r} cannot run: rank "
                             f"{ranks[rank]} rejected its arguments: {message}", source=ranks[rank])
            self._finish(rnd)
        rnd.collected.add(rank)
        self._maybe_drop(key, 0, rnd)
        return _ok()

    def abort(self, key: str, kind: str, message: str, extra: Optional[Dict[str, Any]] = None) -> Result:
        """Break group ``key`` (and the groups under it): every waiting and later call fails."""
        error = _err(kind, message, **(extra or {}))
        keys = {k for k in set(self._groups) | {key} if k == key or k.startswith(key + "/")}
        for k in keys:
            self._broken.setdefault(k, error)
        for (k, _seq, _step), rnd in list(self._rounds.items()):
            if k in keys and not rnd.done.is_set():
                rnd.error = self._broken[k]
                self._finish(rnd)
        for (k, _dst), items in list(self._mail.items()):
            if k in keys:
                for msg in items:
                    if not msg.future.done():
                        msg.future.set_result(self._broken[k])
                items.clear()
        for (k, _dst), receivers in list(self._waiting.items()):
            if k in keys:
                for rcv in receivers:
                    if not rcv.future.done():
                        rcv.future.set_result(self._broken[k])
                receivers.clear()
        return _ok()

    def pending(self, key: str, seq: int) -> Result:
        """Which global ranks have not yet arrived at collective ``seq`` of group ``key``."""
        ranks = self._groups.get(key, ())
        arrived = set()
        for (k, s, _step), rnd in self._rounds.items():
            if k == key and s == seq:
                arrived |= set(rnd.arrivals)
        missing = [ranks[r] for r in range(len(ranks)) if r not in arrived]
        return _ok({"missing": missing, "last": self._last_of(key, missing)})

    def status(self) -> Result:
        """Each group's ranks: last completed and current collective (name, seq)."""
        out: Dict[str, Any] = {}
        for key, ranks in self._groups.items():
            out[key] = {
                ranks[r]: {
                    "last_completed": self._last[key].get(r),
                    "current": self._current[key].get(r),
                }
                for r in range(len(ranks))
            }
            if key in self._broken:
                out[key]["broken"] = self._broken[key][2]
            if key in self._lane_groups:
                out[key]["transport"] = self._lane_groups[key]
                out[key]["lane"] = self._lane_groups[key] == "lane"
            self._join_status(key, out[key])
        return _ok({"world_size": self._world_size, "members": sorted(self._members),
                    "generation": self._generation, "groups": out})

    # ------------------------------------------------------------------ shared-memory lane
    # Small collectives of a group whose ranks share a node skip the coordinator: each rank
    # writes its message to its own Ray shared-memory channel and reads its peers' (see
    # raycoll.transport.lane). The coordinator only hears from such a rank when its wait lasts
    # (``lane_check``, a few times a second at most) or times out (``lane_timeout``); each
    # of those calls carries what the rank knows of its peers' progress, so timeouts and
    # group_status still name every rank's last completed collective.

    def lane_check(self, key: str, ranks: Tuple[int, ...], seq: int, rank: int,
                   fp: Dict[str, Any], progress: Dict[int, Tuple[str, int]],
                   waiting: Sequence[int] = (), waited_s: float = 0.0) -> Result:
        """A rank has waited ``waited_s`` in collective ``seq`` on the lane for group ranks
        ``waiting``: is anything wrong? (Past ``PROBE_AFTER_S`` those ranks are probed, as
        for waits here; ``waited_s`` infinite: they are suspected dead, probed at once.)

        Returns the error that ends its wait, if any: the group is broken or a rank died, a
        rank rejected its arguments for ``seq``, or ranks came to ``seq`` through the
        coordinator (they called a different collective, one not for the lane): then that
        round fails with the mismatch, for them too. Otherwise ``("ok", None)``.
        """
        self._groups[key] = tuple(ranks)
        self._note_progress(key, rank, seq, fp.get("op", "?"), progress)
        if waited_s >= PROBE_AFTER_S:
            now = time.monotonic()
            for r in waiting:
                self._probe_if_due(ranks[r], now, force=waited_s == math.inf)
        failed = self._unusable(key)
        if failed is not None:
            return failed
        rnd = self._rounds.get((key, seq, 0))
        if rnd is None or rnd.error is None and (rnd.done.is_set() or not rnd.arrivals):
            return _ok()  # nothing there, or the lane's own set-up round
        if not rnd.done.is_set():
            fps = {r: a.fp for r, a in rnd.arrivals.items()}
            fps[rank] = fp
            why = fingerprint_mismatch(fps, ranks) or (
                f"ranks {_fmt_ranks(sorted(ranks[r] for r in rnd.arrivals))} came to it "
                f"through the coordinator, rank {ranks[rank]} through the shared-memory lane")
            rnd.error = _err("mismatch", f"{rnd.op} #{seq} on group {key!r}: {why}")
            self._finish(rnd)
        return self._collect(key, 0, rnd, rank)

    def lane_timeout(self, key: str, ranks: Tuple[int, ...], seq: int, rank: int, op: str,
                     missing: List[int], progress: Dict[int, Tuple[str, int]],
                     timeout_s: float) -> Result:
        """Collective ``seq`` on the lane timed out on ``rank`` waiting for group ranks
        ``missing``: the error naming them and their last completed collective; the group is
        broken (as for a timeout through the coordinator)."""
        self._groups[key] = tuple(ranks)
        self._note_progress(key, rank, seq, op, progress)
        if key in self._broken:
            return self._broken[key]
        error = self._timeout_error(key, op, seq, missing, timeout_s)
        self._broken[key] = error
        return error

    def lane_progress(self, key: str, ranks: Tuple[int, ...],
                      progress: Dict[int, Tuple[str, int]], transport: str = "lane") -> Result:
        """What a rank knows of its lane collectives: ``progress[r]`` is the last collective
        group rank ``r`` completed (for group_status; sent now and then, and before
        group_status is asked from inside a rank)."""
        self._groups[key] = tuple(ranks)
        self._note_progress(key, None, 0, "", progress)
        self._lane_groups[key] = transport
        return _ok()

    def _note_progress(self, key: str, rank: Optional[int], seq: int, op: str,
                       progress: Dict[int, Tuple[str, int]]) -> None:
        self._lane_groups.setdefault(key, "lane")
        if rank is not None:
            self._current[key][rank] = (op, seq)
        last = self._last[key]
        for r, done in progress.items():
            if last.get(r) is None or last[r][1] < done[1]:
                last[r] = (done[0], done[1])

    # ------------------------------------------------------------------ join (uneven inputs)
    # raycoll.Join runs one "join round" per iteration on its group: ranks still processing
    # inputs arrive from Join.notify_join_context with join_seq=None; ranks that have joined
    # arrive from Join.__exit__ with the sequence number of the round in which they joined.
    # A join round is an ordinary exchange round (op "join"), so fingerprints, timeouts that
    # name the missing ranks, aborts and group_status work as for any collective. Each rank's
    # answer is computed from what every rank sent in that very round; the state kept here
    # (who has joined, in what order) only feeds group_status and can never make ranks disagree.

    async def join_round(self, key: str, ranks: Tuple[int, ...], seq: int, rank: int,
                         join_seq: Optional[int], throw_on_early_termination: bool,
                         timeout_s: float) -> Result:
        """One iteration of a Join context on group ``key``, arriving as group rank ``rank``.

        Returns ``{"nonjoined": [...], "join_order": [...], "all_joined": bool,
        "is_last_joiner": bool}`` (global ranks; ``join_order`` sorted by the round each
        joined in, then by rank). When no rank is left with inputs, the joined ranks run their
        post-hooks; otherwise they run one shadow round (their main hooks), or, with
        ``throw_on_early_termination``, every rank raises.
        """
        joined = self._joins[key]
        if join_seq is None:
            joined.pop(rank, None)
        else:
            joined[rank] = join_seq
        size = len(ranks)
        fp = {"op": "join", "throw_on_early_termination": bool(throw_on_early_termination)}
        result = await self.exchange(key, ranks, seq, 0, rank, fp, None, None, [join_seq] * size,
                                     "route", None, timeout_s)
        if result[0] != "ok":
            if result[1] == "mismatch":  # the ranks are out of step: nothing can go on
                message = f"{result[2]} {JOIN_OUT_OF_STEP}"
                self.abort(key, "mismatch", message)
                return self._broken.get(key, _err("mismatch", message))
            return result
        outcome, order, ended = join_outcome(ranks, result[1], join_seq,
                                             throw_on_early_termination)
        if ended:
            self._end_join(key, ranks, seq, order, terminated=not outcome["all_joined"])
        return _ok(outcome)

    def join_report(self, key: str, ranks: Tuple[int, ...], rank: int, join_seq: int) -> Result:
        """Group rank ``rank`` joined in round ``join_seq`` of a Join whose rounds run on the
        shared-memory lane (for group_status; the ranks compute each round's answer)."""
        self._groups[key] = tuple(ranks)
        self._joins[key][rank] = join_seq
        return _ok()

    def join_end(self, key: str, ranks: Tuple[int, ...], seq: int,
                 order: List[Tuple[int, int]], terminated: bool) -> Result:
        """The lane Join whose final round is ``seq`` is over (see :meth:`join_report`)."""
        self._groups[key] = tuple(ranks)
        self._end_join(key, tuple(ranks), seq, [tuple(o) for o in order], terminated)
        return _ok()

    async def join_round_packed(self, request: Tuple[Any, ...]) -> Result:
        """:meth:`join_round` with its arguments in one tuple (cheaper to serialize: this is
        called once per iteration by every rank inside a Join)."""
        return await self.join_round(*request)

    def _end_join(self, key: str, ranks: Tuple[int, ...], seq: int,
                  order: List[Tuple[int, int]], terminated: bool) -> None:
        """The Join context whose final round is ``seq`` is over: keep its summary."""
        last_seq = order[-1][0] if order else None
        self._join_done[key] = {
            "join_order": [ranks[r] for _s, r in order],
            "last_joiners": [ranks[r] for s, r in order if s == last_seq],
            "final_seq": seq,
            "terminated_early": terminated,
        }
        joined = self._joins[key]
        for r in [r for r, s in joined.items() if s <= seq]:  # never a later context's entry
            del joined[r]

    def _join_status(self, key: str, out: Dict[Any, Any]) -> None:
        """Add the Join state of group ``key`` to its entry of :meth:`status`."""
        ranks = self._groups.get(key, ())
        joined = self._joins.get(key, {})
        for r, g in enumerate(ranks):
            if isinstance(out.get(g), dict):
                out[g]["joined"] = r in joined
        out["join"] = {
            "joined": [ranks[r] for _s, r in sorted((s, r) for r, s in joined.items())],
            "last": self._join_done.get(key),
        }

    # ------------------------------------------------------------------ point to point
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
        msg = _Message(src, tag, meta, payload, loop.create_future())
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
        rcv = _Receiver(src, tag, meta, loop.create_future())
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
        return failed if failed is not None else _ok()

    # ------------------------------------------------------------------ internals
    def _round(self, key: str, seq: int, step: int, op: str, size: int) -> _Round:
        rk = (key, seq, step)
        rnd = self._rounds.get(rk)
        if rnd is None:
            rnd = self._rounds[rk] = _Round(op, seq, size)
        return rnd

    def _complete(self, key: str, rnd: _Round, mode: str, root: Optional[int]) -> None:
        ranks = self._groups[key]
        mismatch = _fingerprint_mismatch(rnd, ranks) or _meta_mismatch(rnd, ranks)
        if mismatch:
            rnd.error = _err("mismatch", f"{rnd.op} #{rnd.seq} on group {key!r}: {mismatch}")
        elif mode == "reduce":
            arrays = [rnd.arrivals[r].payload for r in range(rnd.size)]
            try:
                out = reduce_arrays(ReduceOp(*rnd.arrivals[0].fp["reduce_op"]), arrays)
            except Exception as exc:  # noqa: BLE001 - reported to every rank
                rnd.error = _err("value", f"{rnd.op} #{rnd.seq} on group {key!r}: {exc}")
            else:
                rnd.results = {r: out if root is None or r == root else None for r in range(rnd.size)}
        else:
            rnd.results = {
                r: [
                    (rnd.arrivals[s].payload[r] if rnd.arrivals[s].payload is not None else None)
                    for s in range(rnd.size)
                ]
                for r in range(rnd.size)
            }
        for arrival in rnd.arrivals.values():
            arrival.payload = None
        if rnd.error is None:
            for r in range(rnd.size):
                self._last[key][r] = (rnd.op, rnd.seq)
        self._finish(rnd)

    def _finish(self, rnd: _Round) -> None:
        for arrival in rnd.arrivals.values():  # release payload refs now, even on failure
            arrival.payload = None
        rnd.done.set()

    def _time_out(self, key: str, rnd: _Round, timeout_s: float) -> None:
        missing_local = [r for r in range(rnd.size) if r not in rnd.arrivals]
        rnd.error = self._timeout_error(key, rnd.op, rnd.seq, missing_local, timeout_s)
        if rnd.op != "monitored_barrier":  # a diagnostic: it reports, the group stays usable
            self._broken[key] = rnd.error
        self._finish(rnd)

    def _timeout_error(self, key: str, op: str, seq: int, missing_local: Sequence[int],
                       timeout_s: float) -> Result:
        """The error of collective ``seq`` timing out with group ranks ``missing_local``
        absent: names them and the last collective each completed."""
        ranks = self._groups[key]
        missing = [ranks[r] for r in missing_local]
        lasts = self._last_of(key, missing)
        detail = "; ".join(
            f"rank {g} last completed {lasts[g][0]} #{lasts[g][1]}" if lasts.get(g) else
            f"rank {g} completed nothing on this group" for g in missing
        )
        return _err(
            "timeout",
            f"{op} #{seq} on group {key!r} timed out after {timeout_s:g}s: ranks "
            f"{_fmt_ranks(missing)} never arrived ({detail})",
            missing=missing,
        )

    def _last_of(self, key: str, global_ranks: Sequence[int]) -> Dict[int, Optional[Tuple[str, int]]]:
        ranks = self._groups.get(key, ())
        return {g: self._last[key].get(ranks.index(g)) if g in ranks else None for g in global_ranks}

    def _collect(self, key: str, step: int, rnd: _Round, rank: int) -> Result:
        rnd.collected.add(rank)
        if rnd.error is not None:
            result = rnd.error
        else:
            result = _ok((rnd.results or {}).pop(rank, None))
        self._maybe_drop(key, step, rnd)
        return result

    def _maybe_drop(self, key: str, step: int, rnd: _Round) -> None:
        if rnd.done.is_set() and len(rnd.collected) >= rnd.size:
            self._rounds.pop((key, rnd.seq, step), None)

    def _match(self, key: str, src: int, dst: int, tag: int, send_meta: Any, payload: Any,
               recv_meta: Any, receiver: "asyncio.Future[Result]",
               sender: "Optional[asyncio.Future[Result]]" = None) -> Result:
        ranks = self._groups.get(key) or tuple(range(self._world_size))
        if send_meta != recv_meta:
            error = _err("mismatch", f"send from rank {ranks[src]} to rank {ranks[dst]} (tag {tag}) on "
                         f"group {key!r}: the sender sent {_fmt_meta(send_meta)} but the receiver "
                         f"expects {_fmt_meta(recv_meta)}")
            receiver.set_result(error)
            if sender is not None:
                sender.set_result(error)
            return error
        receiver.set_result(_ok((src, payload)))
        if sender is not None:
            sender.set_result(_ok())
        return _ok()

    async def _await_p2p(self, future: "asyncio.Future[Result]", timeout_s: float, drop: Any,
                         message: str) -> Result:
        try:
            with self._watching(None):
                return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            if future.done():
                return future.result()
            drop()
            return _err("timeout", message)

    def _drop_msg(self, key: str, dst: int, msg: _Message) -> None:
        try:
            self._mail[(key, dst)].remove(msg)
        except ValueError:
            pass

    def _drop_rcv(self, key: str, dst: int, rcv: _Receiver) -> None:
        try:
            self._waiting[(key, dst)].remove(rcv)
        except ValueError:
            pass

    # ================================================================== liveness
    # Owned by the reliability work (issue 6). Two event-driven signals tell the coordinator
    # that a rank's process is gone, so that every surviving rank fails about 0.2 s after Ray
    # reports the death (at once for a kill or a crash; for a node lost without warning, when
    # Ray's health check declares it dead) with RankFailedError naming it, instead of waiting
    # out the collective timeout:
    #
    # - a lease: after rendezvous each rank calls ``lease`` (a call that stays pending for as
    #   long as the rank is a member; the rank owns its result) and hands the reference back
    #   through ``watch``. When the rank's process dies, awaiting that reference fails with
    #   ``OwnerDiedError``. Nothing is ever sent to the rank. Covers ranks that are not actors.
    # - probes: while a collective or point-to-point wait has lasted ``PROBE_AFTER_S``, the
    #   coordinator keeps one ``actor.__ray_ready__`` call outstanding per rank of that wait.
    #   A rank busy in a method (a sync actor inside a collective, or computing) leaves the
    #   probe queued, a no-op that runs when the method returns; when the actor dies the
    #   pending probe fails within milliseconds (Ray's actor-death notification). An idle
    #   actor answers at once and is probed again at most every ``REPROBE_S`` while the wait
    #   lasts. No GCS polling; no probe at all while collectives complete quickly.
    #
    # A death breaks the root group and every subgroup (as an NCCL abort does in torch): the
    # waiting calls fail now, later calls fail at once, until the group is destroyed and
    # formed again. Deaths detected within ``DEATH_BATCH_S`` of each other (a node going down)
    # are reported together. The dead rank counts as having left, so that the survivors can
    # re-form the group by name with a replacement.

    def _init_liveness(self) -> None:
        self._dead: Dict[int, str] = {}  # global rank -> why it is considered dead
        self._death_report: Optional[asyncio.TimerHandle] = None
        self._waits: Dict[int, Tuple[float, Tuple[int, ...]]] = {}  # token -> (start, ranks)
        self._wait_tokens = itertools.count()
        self._waits_started = asyncio.Event()
        self._monitor: Optional["asyncio.Task[None]"] = None
        self._probes: Dict[int, "asyncio.Task[None]"] = {}
        self._answered: Dict[int, float] = {}  # global rank -> when a probe last returned
        self._probes_sent = 0
        self._leases: Dict[Tuple[int, int], "asyncio.Future[None]"] = {}
        self._lease_watchers: Dict[Tuple[int, int], "asyncio.Task[None]"] = {}

    async def lease(self, rank: int, generation: int) -> Result:
        """Held pending by ``rank`` for as long as it is a member (see ``watch``)."""
        await self._lease_future(rank, generation)
        return _ok()

    def watch(self, rank: int, generation: int, lease: List["ray.ObjectRef"]) -> Result:
        """Watch ``rank``'s lease (its ``lease`` call's reference, in a list so that it arrives
        unresolved): when the rank's process dies, the reference fails and the rank is dead."""
        if generation != self._generation or rank in self._left:
            return _ok()
        key = (generation, rank)
        if key not in self._lease_watchers:
            self._lease_watchers[key] = asyncio.get_running_loop().create_task(
                self._watch_lease(rank, generation, lease[0]))
        return _ok()

    def dead_ranks(self) -> Result:
        """The global ranks found dead in this generation, with the reason."""
        return _ok(dict(self._dead))

    def state_sizes(self) -> Result:
        """How many entries the coordinator holds per table (a leak check for soak runs)."""
        return _ok({
            "rounds": len(self._rounds), "groups": len(self._groups), "broken": len(self._broken),
            "mail": sum(len(q) for q in self._mail.values()),
            "receivers": sum(len(q) for q in self._waiting.values()),
            "kv": len(self._kv), "leases": len(self._leases),
            "lease_watchers": len(self._lease_watchers), "waits": len(self._waits),
            "probes": sum(1 for t in self._probes.values() if not t.done()),
            "probes_sent": self._probes_sent,
        })

    def _lease_future(self, rank: int, generation: int) -> "asyncio.Future[None]":
        key = (generation, rank)
        future = self._leases.get(key)
        if future is None:
            future = self._leases[key] = asyncio.get_running_loop().create_future()
            if generation != self._generation or rank in self._left:
                future.set_result(None)
        return future

    def _release_lease(self, rank: int, generation: int) -> None:
        future = self._leases.pop((generation, rank), None)
        if future is not None and not future.done():
            future.set_result(None)
        task = self._lease_watchers.pop((generation, rank), None)
        if task is not None and not task.done():
            task.cancel()

    async def _watch_lease(self, rank: int, generation: int, ref: "ray.ObjectRef") -> None:
        try:
            await ref
        except asyncio.CancelledError:
            raise
        except ray.exceptions.RayActorError:
            pass  # the lease call itself failed: this coordinator is going away, not the rank
        except ray.exceptions.RayError as exc:  # OwnerDiedError: the rank's process is gone
            self._rank_died(rank, generation, f"its process exited ({type(exc).__name__} on "
                            "the lease it held on the coordinator)")

    def _liveness_left(self, rank: int) -> None:
        """``rank`` left the group on purpose: release its lease (it is not dead)."""
        self._release_lease(rank, self._generation)

    def _liveness_reset(self, old_generation: int) -> None:
        """Every rank has left: a new generation starts with no dead ranks."""
        for gen, rank in list(self._leases):
            if gen <= old_generation:
                self._release_lease(rank, gen)
        self._dead.clear()
        self._answered.clear()
        if self._death_report is not None:
            self._death_report.cancel()
            self._death_report = None

    def _unusable(self, key: str) -> Optional[Result]:
        """Why group ``key`` cannot run a call now (a dead rank, a broken group), or None."""
        failed = self._dead_error(key)
        return failed if failed is not None else self._broken.get(key)

    def _dead_error(self, key: str) -> Optional[Result]:
        """The error for a call on ``key`` once a rank of the root group is dead, else None."""
        if not self._dead or self._death_report is not None:  # none, or a report is pending
            return None
        error = self._broken.get(key)
        if error is None:
            error = self._broken[key] = _err(
                "rank_failed", f"group {key!r} is broken: {self._dead_text()}; destroy the "
                "group and form it again", failed_ranks=sorted(self._dead))
        return error

    def _dead_text(self) -> str:
        root = self._group_name
        return "; ".join(f"rank {g} of group {root!r} died: {why}"
                         for g, why in sorted(self._dead.items()))

    @contextmanager
    def _watching(self, ranks: Optional[Sequence[int]]) -> Iterator[None]:
        """While the body waits, probe ``ranks`` (global; ``None``: every member) if it lasts."""
        token = next(self._wait_tokens)
        targets = tuple(ranks) if ranks is not None else tuple(sorted(self._members))
        self._waits[token] = (time.monotonic(), targets)
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.get_running_loop().create_task(self._monitor_waits())
        elif len(self._waits) == 1:
            self._waits_started.set()
        try:
            yield
        finally:
            self._waits.pop(token, None)

    async def _monitor_waits(self) -> None:
        """Start probes for the ranks of every wait older than ``PROBE_AFTER_S``."""
        while True:
            if not self._waits:
                self._waits_started.clear()
                await self._waits_started.wait()
                continue
            now = time.monotonic()
            wake = now + REPROBE_S
            due: set = set()
            for start, ranks in self._waits.values():
                if now - start >= PROBE_AFTER_S:
                    due.update(ranks)
                else:
                    wake = min(wake, start + PROBE_AFTER_S)
            for g in sorted(due):
                wake = min(wake, self._probe_if_due(g, now))
            await asyncio.sleep(max(0.01, wake - time.monotonic()))

    def _probe_if_due(self, g: int, now: float, force: bool = False) -> float:
        """Start a probe of global rank ``g`` unless one is out or it answered less than
        ``REPROBE_S`` ago (``force``: however recently; a rank suspected dead, whose
        connections closed, is probed at once); returns when it is due again (``inf``: no
        need)."""
        probe = self._probes.get(g)
        if g in self._dead or (probe is not None and not probe.done()):
            return float("inf")
        if (self._members.get(g) or {}).get("actor") is None:
            return float("inf")  # not an actor: only its lease watches it
        answered = self._answered.get(g)
        if answered is not None and now - answered < REPROBE_S and not force:
            return answered + REPROBE_S
        self._probes[g] = asyncio.get_running_loop().create_task(self._probe(g))
        return float("inf")

    async def _probe(self, g: int) -> None:
        member = self._members.get(g) or {}
        actor, actor_id, generation = member.get("actor"), member.get("actor_id"), self._generation
        if actor is None:  # not an actor: only its lease watches it
            return
        self._probes_sent += 1
        try:
            await actor.__ray_ready__.remote()
        except ray.exceptions.ActorUnavailableError:
            pass  # restarting or unreachable for now; its lease tells if its process died
        except ray.exceptions.RayActorError as exc:
            if (self._members.get(g) or {}).get("actor_id") == actor_id:
                self._rank_died(g, generation, _death_cause(exc))
            return
        except Exception:  # noqa: BLE001 - a failed probe must never take the coordinator down
            logger.exception("probing rank %d of group %r failed", g, self._group_name)
        self._answered[g] = time.monotonic()

    def _rank_died(self, g: int, generation: int, cause: str) -> None:
        """Record that global rank ``g`` is dead; fail everything (after a short batch window)."""
        if generation != self._generation or g in self._dead or g in self._left:
            return
        self._dead[g] = cause
        logger.warning("raycoll: rank %d of group %r died: %s", g, self._group_name, cause)
        if self._death_report is None:
            self._death_report = asyncio.get_running_loop().call_later(
                DEATH_BATCH_S, self._fail_dead)

    def _fail_dead(self) -> None:
        """Fail every waiting call of the root group and its subgroups; break them all."""
        self._death_report = None
        if not self._dead:
            return
        failed = sorted(self._dead)
        text = self._dead_text()
        for (key, _seq, _step), rnd in list(self._rounds.items()):
            if rnd.done.is_set():
                continue
            ranks = self._groups.get(key, ())
            waiting_for = [ranks[r] for r in range(rnd.size) if r not in rnd.arrivals]
            rnd.error = _err(
                "rank_failed",
                f"{rnd.op} #{rnd.seq} on group {key!r} cannot complete: {text} (the collective "
                f"was waiting for ranks {_fmt_ranks(waiting_for)})",
                failed_ranks=failed)
            self._broken[key] = rnd.error
            self._finish(rnd)
        self.abort(self._group_name, "rank_failed",
                   f"group {self._group_name!r} is broken: {text}; destroy the group and form it "
                   "again", {"failed_ranks": failed})
        for g in failed:  # counts as having left: the survivors can re-form the group by name
            if g not in self._left:
                self.leave(g)
        self._self_destruct_if_orphaned()


# ====================================================================== liveness (module level)
#: A wait must last this long before the coordinator probes the ranks it waits on.
PROBE_AFTER_S = 0.5
#: While a wait lasts, an actor that answered a probe is probed again after this long.
REPROBE_S = 1.0
#: Deaths detected within this window of the first one are reported together.
DEATH_BATCH_S = 0.2

def _death_cause(exc: BaseException) -> str:
    """A one-line reason from a Ray actor-death error (its message spans many lines)."""
    text = str(exc)
    fields = dict(re.findall(r"^\s*(class_name|pid|ip): (\S+)$", text, flags=re.MULTILINE))
    because = re.search(r"The actor (?:is dead|died) because (.+?)(?:\.\s|\.$|$)", text,
                        flags=re.DOTALL)
    reason = because.group(1).strip() if because else type(exc).__name__
    node = re.search(r"Node Id: ([0-9a-f]{8})", text)
    if node:
        fields["node"] = node.group(1)
    where = ", ".join(f"{k} {fields[k]}" for k in ("class_name", "pid", "ip", "node") if k in fields)
    return f"{reason}" + (f" (actor {where})" if where else "")


def join_outcome(ranks: Sequence[int], seqs: Sequence[Optional[int]], join_seq: Optional[int],
                 throw: bool) -> Tuple[Dict[str, Any], List[Tuple[int, int]], bool]:
    """One join round's answer for the rank that sent ``join_seq``, from every group rank's
    ``seqs`` (``None``: still has inputs): the answer, the join order ``(seq, group rank)``,
    and whether this Join is over (everyone joined, or a rank joined under ``throw``)."""
    nonjoined = [ranks[r] for r in range(len(seqs)) if seqs[r] is None]
    order = sorted((s, r) for r, s in enumerate(seqs) if s is not None)
    last_seq = order[-1][0] if order else None
    outcome = {
        "nonjoined": nonjoined,
        "join_order": [ranks[r] for _s, r in order],
        "all_joined": not nonjoined,
        "is_last_joiner": not nonjoined and join_seq is not None and join_seq == last_seq,
    }
    return outcome, order, not nonjoined or (throw and bool(order))


def _fmt_meta(meta: Any) -> str:
    if isinstance(meta, tuple) and len(meta) == 2:
        return f"dtype={meta[0]}, shape={tuple(meta[1])}"
    return repr(meta)


def _fingerprint_mismatch(rnd: _Round, ranks: Sequence[int]) -> Optional[str]:
    return fingerprint_mismatch({r: a.fp for r, a in rnd.arrivals.items()}, ranks)


def fingerprint_mismatch(fps: Dict[int, Dict[str, Any]], ranks: Sequence[int]) -> Optional[str]:
    """What the fingerprints ``fps`` (group rank -> fingerprint) disagree on, naming the
    ranks (global, from ``ranks``) on each side; ``None`` when they all agree."""
    first = next(iter(fps.values()), None)
    if all(fp == first for fp in fps.values()):  # the common case, at C speed
        return None
    keys = sorted({k for fp in fps.values() for k in fp})
    problems = []
    for k in keys:
        values: Dict[str, List[int]] = defaultdict(list)
        for r in sorted(fps):
            values[repr(fps[r].get(k))].append(ranks[r])
        if len(values) > 1:
            parts = ", ".join(f"ranks {_fmt_ranks(rs)} passed {v}" for v, rs in values.items())
            problems.append(f"ranks disagree on {k}: {parts}")
    return "; ".join(problems) or None


def _meta_mismatch(rnd: _Round, ranks: Sequence[int]) -> Optional[str]:
    return meta_mismatch({r: a.send_meta for r, a in rnd.arrivals.items()},
                         {r: a.recv_meta for r, a in rnd.arrivals.items()}, ranks)


def meta_mismatch(send: Dict[int, Optional[List[Any]]], recv: Dict[int, Optional[List[Any]]],
                  ranks: Sequence[int]) -> Optional[str]:
    """Which pairs disagree: ``send[s][r]`` is what group rank ``s`` sends ``r`` (its
    ``(dtype, shape)``), ``recv[r][s]`` what ``r`` expects from ``s``; ``None`` if all agree."""
    problems = []
    size = len(send)
    for r in sorted(recv):
        if recv[r] is None:
            continue
        for s in range(size):
            sender = send[s]
            sent = sender[r] if sender is not None else None
            expected = recv[r][s]
            if sent != expected:
                problems.append(
                    f"rank {ranks[s]} sends rank {ranks[r]} "
                    f"{'nothing' if sent is None else _fmt_meta(sent)} but rank {ranks[r]} expects "
                    f"{'nothing' if expected is None else _fmt_meta(expected)}"
                )
    if len(problems) > 4:
        problems = problems[:4] + [f"... and {len(problems) - 4} more"]
    return "; ".join(problems) or None


_RemoteCoordinator = ray.remote(num_cpus=0, max_concurrency=100_000, max_restarts=0)(Coordinator)


def start_coordinator(group_name: str, world_size: int, actor_name: str,
                      get_if_exists: bool = False) -> "ray.actor.ActorHandle":
    """Start (or, with ``get_if_exists``, find) the named coordinator of a root group.

    Ranks that rendezvous by name race to create it: the loser of the race may be handed a
    handle whose creation failed, so each candidate is checked alive, and looked up again
    by name if it is not.
    """
    if not get_if_exists:
        return _RemoteCoordinator.options(name=actor_name, scheduling_strategy=_here()).remote(
            group_name, world_size)
    last: Optional[BaseException] = None
    for _ in range(_START_ATTEMPTS):
        try:
            handle = ray.get_actor(actor_name)
        except ValueError:
            try:
                handle = _RemoteCoordinator.options(
                    name=actor_name, lifetime="detached", scheduling_strategy=_here(),
                ).remote(group_name, world_size, True)
            except ValueError as exc:  # another rank created it between our two calls
                last = exc
                continue
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=_START_TIMEOUT_S)
            return handle
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            last = exc
    raise errors.CoordinatorDiedError(
        f"could not start or find the coordinator {actor_name!r} of group {group_name!r} "
        f"after {_START_ATTEMPTS} attempts: {last}", group=group_name)


_START_ATTEMPTS = 5
_START_TIMEOUT_S = 60.0


def _here() -> Any:
    """Place the coordinator on the node of the process that starts it (the driver, for
    create_group), not on any node: a zero-CPU actor could otherwise land on a worker node,
    and losing that node would take the whole group's control plane with it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # hard affinity: soft=True lets Ray 2.60 place it elsewhere even when this node is free;
    # this node is alive (we run on it) and the actor needs no CPU.
    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(),
                                          soft=False)


_ERRORS = {
    "mismatch": errors.CollectiveMismatchError,
    "peer_arg": errors.PeerArgumentError,
    "timeout": errors.DistTimeoutError,
    "rank_failed": errors.RankFailedError,
    "aborted": errors.GroupBrokenError,
    "destroyed": errors.GroupDestroyedError,
    "coordinator_died": errors.CoordinatorDiedError,
    "protocol": errors.CollectiveError,
}


class CoordinatorClient:
    """How a rank talks to its coordinator: every wait bounded, every failure translated."""

    def __init__(self, handle: "ray.actor.ActorHandle", group_name: str) -> None:
        self.handle = handle
        self.group_name = group_name
        self.lease: Optional["ray.ObjectRef"] = None

    def hold_lease(self, rank: int, generation: int) -> None:
        """Hold this rank's lease on the coordinator (see the liveness section): if this
        process dies, the coordinator learns it at once and fails the rank's peers."""
        self.lease = self.handle.lease.remote(rank, generation)
        self.handle.watch.remote(rank, generation, [self.lease])

    def submit(self, method: str, *args: Any) -> "ray.ObjectRef":
        return getattr(self.handle, method).remote(*args)

    def wait(self, ref: "ray.ObjectRef", timeout_s: float, *, op: Optional[str] = None,
             seq: Optional[int] = None, group: Optional[str] = None,
             rank: Optional[int] = None) -> Any:
        """The value of a coordinator call, or the raycoll exception it stands for."""
        ctx = {"op": op, "seq": seq, "group": group or self.group_name, "rank": rank}
        where = f"group {ctx['group']!r}"
        if op:
            where = f"{op} #{seq} on {where}" if seq is not None else f"{op} on {where}"
        try:
            result = ray.get(ref, timeout=timeout_s + GRACE_S)
        except ray.exceptions.GetTimeoutError as exc:
            raise errors.DistTimeoutError(
                f"{where}: the coordinator did not answer within {timeout_s + GRACE_S:g}s", **ctx
            ) from exc
        except ray.exceptions.RayActorError as exc:
            raise errors.CoordinatorDiedError(
                f"{where}: the coordinator of group {self.group_name!r} is gone (the group was "
                f"destroyed, or the process that created it exited): {_first_line(exc)}", **ctx
            ) from exc
        return unwrap(result, ctx)

    def call(self, method: str, *args: Any, timeout_s: float, **ctx: Any) -> Any:
        return self.wait(self.submit(method, *args), timeout_s, **ctx)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1][:300] if text else type(exc).__name__


def unwrap(result: Result, ctx: Dict[str, Any]) -> Any:
    """``("ok", v)`` -> ``v``; ``("err", kind, msg, extra)`` -> raise the matching exception."""
    if result[0] == "ok":
        return result[1]
    _, kind, message, extra = result
    if kind == "value":
        raise ValueError(message)
    cls = _ERRORS.get(kind, errors.CollectiveError)
    kwargs = dict(ctx)
    if cls is errors.DistTimeoutError:
        kwargs["missing"] = extra.get("missing", ())
    if cls is errors.RankFailedError:
        kwargs["failed_ranks"] = extra.get("failed_ranks", ())
    if cls is errors.GroupDestroyedError:
        raise cls(message)
    raise cls(message, **kwargs)


def rank_info() -> Dict[str, Any]:
    """What a rank tells the coordinator about itself at rendezvous."""
    from raycoll.transport.tcp import listener

    ctx = ray.get_runtime_context()
    where = listener()
    info: Dict[str, Any] = {"node_id": ctx.get_node_id(), "actor_id": None, "actor": None,
                            "time": time.time(), "addr": where.address if where else None}
    try:
        info["actor_id"] = ctx.get_actor_id()
        info["actor"] = ctx.current_actor if info["actor_id"] else None
    except Exception:  # noqa: BLE001 - not inside an actor (a driver or a task)
        info["actor"] = None
    return info
