"""How a rank talks to its coordinator: one method per RPC, every wait bounded.

Each RPC of :class:`raycoll.coordinator.actor.Coordinator` has a method here, with typed
parameters. A method named after the RPC waits for the answer and returns its value, or
raises the raycoll exception it stands for (:func:`raycoll.coordinator.logic.unwrap`); a
``submit_*`` method sends the call and returns its object reference at once, for a caller
that waits later (:meth:`CoordinatorClient.wait`) or never (a notification).

Timeouts: a wait lasts the given bound plus :data:`GRACE_S` (the coordinator answers a call
that timed out on its side within its own bound: the grace covers the trip back). RPCs that
wait at the coordinator (``rendezvous``, ``kv_get``, ``exchange``, ``join_round``,
``store_wait``) are bounded by their own ``timeout_s``; the checks (and ``store_op``) a waiting rank makes by
:data:`CHECK_TIMEOUT_S`; ``where`` is the error context (``op``, ``seq``, ``group``,
``rank``) a failure names.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import ray

from raycoll import errors
from raycoll.coordinator.logic import first_line, unwrap
from raycoll.native import native_available

__all__ = ["CoordinatorClient", "CoordinatorUnreachableError", "GRACE_S", "CHECK_TIMEOUT_S", "LEAVE_TIMEOUT_S",
           "PENDING_TIMEOUT_S", "rank_info", "pack_handle", "unpack_handle"]

#: Extra seconds a rank waits for the coordinator's answer beyond the collective's timeout.
GRACE_S = 10.0
#: Bound on a waiting rank's checks (transport_check, transport_timeout, p2p_check).
CHECK_TIMEOUT_S = 30.0
#: Bound on leaving a group (destroy_process_group).
LEAVE_TIMEOUT_S = 10.0
#: Bound on asking which ranks a timed-out collective waits for.
PENDING_TIMEOUT_S = 5.0

Where = Optional[Mapping[str, Any]]


class CoordinatorUnreachableError(errors.CoordinatorDiedError):
    """Ray could not reach the coordinator for this call (``ActorUnavailableError``: a slow
    or cut link, a node that does not answer): it may be alive. A caller that can go on
    without this answer (a waiting rank's check: its own timeout bounds it) catches this;
    anywhere else it is the coordinator lost, as ``CoordinatorDiedError``."""
Progress = Dict[int, Tuple[str, int]]


class CoordinatorClient:
    """How a rank talks to its coordinator: every wait bounded, every failure translated."""

    def __init__(self, handle: "ray.actor.ActorHandle", group_name: str) -> None:
        self.handle = handle
        self.group_name = group_name
        self.lease: Optional["ray.ObjectRef"] = None

    # ------------------------------------------------------------------ waiting
    def wait(self, ref: "ray.ObjectRef", timeout_s: float, *, op: Optional[str] = None,
             seq: Optional[int] = None, group: Optional[str] = None,
             rank: Optional[int] = None) -> Any:
        """The value of a coordinator call, or the raycoll exception it stands for."""
        ctx: Dict[str, Any] = {"op": op, "seq": seq, "group": group or self.group_name,
                               "rank": rank}
        where = f"group {ctx['group']!r}"
        if op:
            where = f"{op} #{seq} on {where}" if seq is not None else f"{op} on {where}"
        try:
            result = ray.get(ref, timeout=timeout_s + GRACE_S)
        except ray.exceptions.GetTimeoutError as exc:
            raise errors.DistTimeoutError(
                f"{where}: the coordinator did not answer within {timeout_s + GRACE_S:g}s", **ctx
            ) from exc
        except ray.exceptions.ActorUnavailableError as exc:
            raise CoordinatorUnreachableError(
                f"{where}: the coordinator of group {self.group_name!r} could not be reached "
                f"(alive, as far as Ray knows, but its node or the network did not answer): "
                f"{first_line(exc)}", **ctx
            ) from exc
        except ray.exceptions.RayActorError as exc:
            raise errors.CoordinatorDiedError(
                f"{where}: the coordinator of group {self.group_name!r} is gone (the group was "
                f"destroyed, or the process that created it exited): {first_line(exc)}", **ctx
            ) from exc
        return unwrap(result, ctx)

    def _wait(self, ref: "ray.ObjectRef", timeout_s: float, where: Where) -> Any:
        return self.wait(ref, timeout_s, **(where or {}))

    # ------------------------------------------------------------------ membership
    def rendezvous(self, rank: int, world_size: int, info: Dict[str, Any],
                   timeout_s: float) -> Dict[str, Any]:
        """Join the group as ``rank`` (``info``: see :func:`rank_info`); waits up to
        ``timeout_s`` for every rank. Returns ``{"members", "generation", "secret"}``. The
        rank's lease (see :meth:`hold_lease`) is taken with the call: held once formed."""
        return self.wait(self.start_rendezvous(rank, world_size, info, timeout_s), timeout_s,
                         group=self.group_name, rank=rank, op="rendezvous")

    def start_rendezvous(self, rank: int, world_size: int, info: Dict[str, Any],
                         timeout_s: float) -> "ray.ObjectRef":
        """:meth:`rendezvous` without the wait: the reference of its answer (a rank joining
        several groups at once sends every group's call, then waits for them)."""
        token = os.urandom(12).hex()  # this join's lease, taken now, handed over with the call
        self.lease = self.handle.lease.remote(rank, -1, token)
        ref: "ray.ObjectRef" = self.handle.rendezvous.remote(rank, world_size, info, timeout_s,
                                                             self.group_name, [self.lease], token)
        return ref

    def hold_lease(self, rank: int, generation: int) -> None:
        """Hold this rank's lease on the coordinator (see :mod:`raycoll.coordinator.liveness`):
        if this process dies, the coordinator learns it at once and fails the rank's peers.
        Does not wait."""
        self.lease = self.handle.lease.remote(rank, generation)
        self.handle.watch.remote(rank, generation, [self.lease])

    def submit_form(self, roster: List[Dict[str, Any]], secret: bytes,
                    generation: int) -> "ray.ObjectRef":
        """The driver forms the group with ``roster`` (``Coordinator.form``); the answer's
        reference (a result tuple)."""
        ref: "ray.ObjectRef" = self.handle.form.remote(self.group_name, roster, secret,
                                                       generation)
        return ref

    def submit_form_hosted(self, names: List[str], roster: List[Dict[str, Any]], secret: bytes,
                           generation: int) -> "ray.ObjectRef":
        """The driver forms groups ``names`` with ``roster``, each with a coordinator hosted
        in this one's process (``Coordinator.form_hosted``, :mod:`.hosting`); the answer's
        reference (a result tuple)."""
        ref: "ray.ObjectRef" = self.handle.form_hosted.remote(names, roster, secret, generation)
        return ref

    def hold_hosted_lease(self, rank: int, generation: int) -> "ray.ObjectRef":
        """:meth:`hold_lease` for every group whose coordinator this (hosted) one's host holds:
        one lease (``lease_hosted``), handed to all of them (``watch_hosted``). Does not
        wait; the lease's reference."""
        host = self.handle.host
        self.lease = host.lease_hosted.remote(rank, generation)
        host.watch_hosted.remote(rank, generation, [self.lease])
        return self.lease

    def end_hosted(self, index: int, timeout_s: float) -> Dict[str, Any]:
        """End the hosted coordinator ``index`` of this host (its group was destroyed):
        ``{"clean": bool, "hosted": how many are left}`` (``Coordinator.end_hosted``)."""
        answer: Dict[str, Any] = self.wait(self.handle.end_hosted.remote(index), timeout_s,
                                           op="destroy_group")
        return answer

    def leave(self, rank: int, timeout_s: float = LEAVE_TIMEOUT_S) -> Dict[str, Any]:
        """``rank`` leaves the group; returns ``{"all_left": bool}``."""
        return self.wait(self.handle.leave.remote(rank), timeout_s, op="leave")

    def recycle(self, timeout_s: float) -> Optional[int]:
        """Empty this coordinator's tables for the next group (``Coordinator.recycle``): the
        generation it then waits at; ``None`` where it refuses (something of its group
        pending, or it saw a failure)."""
        answer = self.wait(self.handle.recycle.remote(), timeout_s, op="recycle")
        return int(answer["generation"]) if answer.get("recycled") else None

    def reconfigure(self, kind: str, generation: Optional[int], old_rank: Optional[int],
                    new_rank: int, new_size: Optional[int], plan: Any,
                    info: Optional[Dict[str, Any]], config: Any,
                    timeout_s: float, hand: Optional[Dict[str, Any]] = None,
                    joining: Optional[Tuple[int, int]] = None) -> Dict[str, Any]:
        """Take part in a membership change (shrink or grow, see
        :mod:`raycoll.coordinator.elastic`); waits up to ``timeout_s`` for every rank of the
        next generation. Returns ``{"members", "generation", "secret", "config", "hands"}``."""
        ref: "ray.ObjectRef" = self.handle.reconfigure.remote(
            kind, generation, old_rank, new_rank, new_size, plan, info, config, timeout_s, hand,
            joining)
        return self.wait(ref, timeout_s, group=self.group_name, op=f"{kind}_group")

    def membership(self, timeout_s: float, where: Where = None) -> Dict[str, Any]:
        """The group as it is now: ``{"generation", "world_size", "actor_ids", "dead"}``."""
        return self._wait(self.handle.membership.remote(), timeout_s, where)

    def status(self, timeout_s: float, where: Where = None) -> Dict[str, Any]:
        """Every group's ranks: last completed and current collective, Join state, breaks."""
        return self._wait(self.handle.status.remote(), timeout_s, where)

    def dead_ranks(self, timeout_s: float, where: Where = None) -> Dict[int, str]:
        """The global ranks found dead in this generation, with the reason."""
        return self._wait(self.handle.dead_ranks.remote(), timeout_s, where)

    def state_sizes(self, timeout_s: float, where: Where = None) -> Dict[str, int]:
        """How many entries the coordinator holds per table (a leak check)."""
        return self._wait(self.handle.state_sizes.remote(), timeout_s, where)

    # ------------------------------------------------------------------ key-value store
    def kv_set(self, key: str, value: Any, timeout_s: float, where: Where = None) -> None:
        """Set ``key`` for this generation of the group; waits until it is recorded."""
        self._wait(self.handle.kv_set.remote(key, value), timeout_s, where)

    def submit_kv_get(self, key: str, timeout_s: float) -> "ray.ObjectRef":
        """Ask for ``key``, which the coordinator awaits up to ``timeout_s``; does not wait."""
        return self.handle.kv_get.remote(key, timeout_s)

    def kv_get(self, key: str, timeout_s: float, where: Where = None) -> Any:
        """The value of ``key``, waiting up to ``timeout_s`` for it to be set."""
        return self._wait(self.submit_kv_get(key, timeout_s), timeout_s, where)

    # ------------------------------------------------------------------ the groups' stores
    def store_op(self, ns: str, op: str, args: Tuple[Any, ...], where: Where = None,
                 timeout_s: float = CHECK_TIMEOUT_S) -> Any:
        """Run store operation ``op`` (one that never waits: ``set``, ``add``, ...) on group
        ``ns``'s store (:mod:`raycoll.coordinator.store`); returns its value."""
        return self._wait(self.handle.store_op.remote(ns, op, args), timeout_s, where)

    def store_wait(self, ns: str, op: str, args: Tuple[Any, ...], timeout_s: float,
                   where: Where = None) -> Any:
        """Run store operation ``op`` (``get``, ``wait``, ...) once its keys are there,
        waiting up to ``timeout_s`` (then ``DistTimeoutError`` names the keys)."""
        ref: "ray.ObjectRef" = self.handle.store_wait.remote(ns, op, args, timeout_s)
        return self._wait(ref, timeout_s, where)

    # ------------------------------------------------------------------ collectives
    def submit_exchange(self, key: str, ranks: Sequence[int], seq: int, step: int, rank: int,
                        fp: Dict[str, Any], send_meta: Optional[List[Any]],
                        recv_meta: Optional[List[Any]], payload: Any, mode: str,
                        root: Optional[int], timeout_s: float) -> "ray.ObjectRef":
        """Arrive at step ``step`` of collective ``seq`` (see ``Coordinator.exchange``; sent
        packed in one tuple, the collectives' hot path); does not wait."""
        return self.handle.exchange_packed.remote((
            key, ranks, seq, step, rank, fp, send_meta, recv_meta, payload, mode, root,
            timeout_s,
        ))

    def exchange(self, key: str, ranks: Sequence[int], seq: int, step: int, rank: int,
                 fp: Dict[str, Any], send_meta: Optional[List[Any]],
                 recv_meta: Optional[List[Any]], payload: Any, mode: str,
                 root: Optional[int], timeout_s: float, where: Where = None) -> Any:
        """:meth:`submit_exchange`, waiting up to ``timeout_s`` for this rank's share."""
        # sent here rather than through submit_exchange: the collectives' hot path
        ref: "ray.ObjectRef" = self.handle.exchange_packed.remote((
            key, ranks, seq, step, rank, fp, send_meta, recv_meta, payload, mode, root,
            timeout_s,
        ))
        return self.wait(ref, timeout_s, **(where or {}))

    def submit_reject(self, key: str, ranks: Sequence[int], seq: int, rank: int, op: str,
                      message: str, kind: str = "peer_arg") -> "ray.ObjectRef":
        """Group rank ``rank`` rejected its arguments for collective ``seq`` (or, ``kind=
        "mismatch"``, found the ranks' calls do not match): fail it on every rank. Does not
        wait."""
        return self.handle.reject.remote(key, ranks, seq, rank, op, message, kind)

    def submit_abort(self, key: str, kind: str, message: str,
                     extra: Optional[Dict[str, Any]] = None,
                     generation: Optional[int] = None) -> "ray.ObjectRef":
        """Break group ``key`` and its subgroups with error ``kind``/``message``, if the group
        is still at ``generation`` (its membership the caller knows; ``None``: whichever it
        is); does not wait."""
        return self.handle.abort.remote(key, kind, message, extra if extra is not None else {},
                                        generation)

    def abort(self, key: str, kind: str, message: str, extra: Optional[Dict[str, Any]] = None,
              *, timeout_s: float, where: Where = None,
              generation: Optional[int] = None) -> None:
        """:meth:`submit_abort`, waiting up to ``timeout_s`` until the break is recorded."""
        self._wait(self.submit_abort(key, kind, message, extra, generation), timeout_s, where)

    def pending(self, key: str, seq: int, timeout_s: float = PENDING_TIMEOUT_S,
                where: Where = None) -> Dict[str, Any]:
        """Which global ranks have not arrived at collective ``seq`` of group ``key``:
        ``{"missing": [...], "last": {rank: (op, seq) or None}}``."""
        return self._wait(self.handle.pending.remote(key, seq), timeout_s, where)

    # ------------------------------------------------------------------ round transports
    def transport_check(self, key: str, ranks: Sequence[int], seq: int, rank: int,
                        fp: Dict[str, Any], progress: Progress, waiting: Sequence[int],
                        waited_s: float, transport: str = "lane", *, where: Where = None,
                        timeout_s: float = CHECK_TIMEOUT_S) -> None:
        """A wait on round transport ``transport`` for group ranks ``waiting`` has lasted
        ``waited_s``: raises the error that ends it, if the coordinator has one (see
        ``Coordinator.transport_check``)."""
        ref: "ray.ObjectRef" = self.handle.transport_check.remote(
            key, ranks, seq, rank, fp, progress, list(waiting), waited_s, transport)
        self._wait(ref, timeout_s, where)

    def transport_timeout(self, key: str, ranks: Sequence[int], seq: int, rank: int, op: str,
                          missing: Sequence[int], progress: Progress, timeout_s: float,
                          transport: str = "lane", *, where: Where = None,
                          wait_s: float = CHECK_TIMEOUT_S) -> None:
        """Collective ``seq`` timed out (after ``timeout_s``) on round transport
        ``transport`` waiting for group ranks ``missing``: raises the error naming them (the
        coordinator breaks the group); waits ``wait_s`` for it."""
        ref: "ray.ObjectRef" = self.handle.transport_timeout.remote(
            key, ranks, seq, rank, op, list(missing), progress, timeout_s, transport)
        self._wait(ref, wait_s, where)

    def submit_transport_progress(self, key: str, ranks: Sequence[int], progress: Progress,
                                  transport: str = "lane",
                                  period_s: float = 0.0,
                                  detail: Optional[Dict[str, Any]] = None) -> "ray.ObjectRef":
        """Tell the coordinator each group rank's last completed collective on round
        transport ``transport`` (for group_status), how often this rank reports
        (``period_s``) and ``detail``, what this rank says of itself (see
        ``Coordinator.transport_progress``); does not wait."""
        return self.handle.transport_progress.remote(key, ranks, progress, transport, period_s,
                                                     detail)

    # ------------------------------------------------------------------ join
    def submit_join_round(self, key: str, ranks: Sequence[int], seq: int, rank: int,
                          join_seq: Optional[int], throw_on_early_termination: bool,
                          timeout_s: float) -> "ray.ObjectRef":
        """Arrive at join round ``seq`` (packed in one tuple); does not wait."""
        return self.handle.join_round_packed.remote((
            key, ranks, seq, rank, join_seq, throw_on_early_termination, timeout_s))

    def submit_join_report(self, key: str, ranks: Sequence[int], rank: int,
                           join_seq: int) -> "ray.ObjectRef":
        """Group rank ``rank`` joined in lane round ``join_seq`` (for group_status); does not
        wait."""
        return self.handle.join_report.remote(key, ranks, rank, join_seq)

    def submit_join_end(self, key: str, ranks: Sequence[int], seq: int,
                        order: List[Tuple[int, int]], terminated: bool) -> "ray.ObjectRef":
        """The lane Join whose final round is ``seq`` is over; does not wait."""
        return self.handle.join_end.remote(key, ranks, seq, order, terminated)

    # ------------------------------------------------------------------ point to point
    def submit_p2p_send(self, key: str, src: int, dst: int, tag: int, meta: Any, payload: Any,
                        timeout_s: float) -> "ray.ObjectRef":
        """Post a message from group rank ``src`` to ``dst``; the reference resolves once a
        receive matched it (the coordinator waits up to ``timeout_s``). Does not wait."""
        return self.handle.p2p_send.remote(key, src, dst, tag, meta, payload, timeout_s)

    def submit_p2p_recv(self, key: str, src: Optional[int], dst: int, tag: int, meta: Any,
                        timeout_s: float) -> "ray.ObjectRef":
        """Post a receive at group rank ``dst`` from ``src`` (``None``: any); the reference
        resolves to ``(src, payload)``. Does not wait."""
        return self.handle.p2p_recv.remote(key, src, dst, tag, meta, timeout_s)

    def p2p_check(self, key: str, waiting: Sequence[int], waited_s: float, *,
                  where: Where = None, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        """A point-to-point wait for global ranks ``waiting`` has lasted ``waited_s``:
        raises the error that ends it, if the coordinator has one."""
        self._wait(self.handle.p2p_check.remote(key, waiting, waited_s), timeout_s, where)


def rank_info(address: Any = None) -> Dict[str, Any]:
    """What a rank tells the coordinator about itself at rendezvous; ``address``: where its
    peers reach it directly (its listener's, :func:`raycoll.transport.links.listener`), or
    ``None``; its actor handle packed (:func:`pack_handle`). (The coordinator imports no
    transport.)"""
    ctx = ray.get_runtime_context()
    info: Dict[str, Any] = {"node_id": ctx.get_node_id(), "actor_id": None, "actor": None,
                            "time": time.time(), "addr": address,
                            "native": native_available(), "proc": PROCESS_TOKEN}
    try:
        info["actor_id"] = ctx.get_actor_id()
        if info["actor_id"]:  # packed once per process (5-50 ms): a rank joins many groups
            key = (ctx.get_job_id(), info["actor_id"])
            packed = _PACKED_SELF.get(key)
            info["actor"] = packed if packed is not None else _PACKED_SELF.setdefault(
                key, pack_handle(ctx.current_actor))
    except Exception:  # noqa: BLE001 - not inside an actor (a driver or a task)
        info["actor"] = None
    return info


#: This process's token in its rank info: a restarted actor (a new process, the same actor id)
#: has another, so a driver's copy of its info from before the restart is seen stale
#: (:mod:`raycoll.formation`).
PROCESS_TOKEN = os.urandom(8).hex()
#: This process's own actor handle, packed, by (job, actor id).
_PACKED_SELF: Dict[Tuple[str, str], bytes] = {}
#: Handles unpacked here, by their bytes, while something (a group's roster) holds them:
#: weak, so that the cache never keeps an actor alive that its owner let go.
_UNPACKED: "weakref.WeakValueDictionary[bytes, Any]" = weakref.WeakValueDictionary()


def pack_handle(handle: "ray.actor.ActorHandle") -> bytes:
    """A rank's actor handle as bytes, for the roster: the coordinator passes it on without
    reading it. Ray loads an actor's class where its handle is read, and a rank's class may
    be heavy to import (Ray Train's worker: 0.4 s), so only the ranks (which have it) and a
    liveness probe (:mod:`.liveness`, rarely) read it (:func:`unpack_handle`). The rank's
    owner (the driver, Ray Train's controller) holds the real handle while the group lives."""
    return ray.cloudpickle.dumps(handle)


def unpack_handle(packed: Any) -> Any:
    """The actor handle :func:`pack_handle` packed (``None`` stays ``None``); the one this
    process unpacked before while a group of it still holds it (groups formed at once over the
    same actors read each handle once: 5-10 ms each)."""
    if not isinstance(packed, bytes):
        return packed
    try:
        return _UNPACKED[packed]
    except KeyError:
        handle = ray.cloudpickle.loads(packed)
    try:
        _UNPACKED[packed] = handle
    except TypeError:  # a handle that takes no weak reference: not cached
        pass
    return handle
