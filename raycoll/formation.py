"""Driver side: root groups formed by their driver, with no rendezvous.

:func:`raycoll.create_group` and :func:`raycoll.create_groups` know every rank of a group
before it forms (the actors, in rank order), and the coordinator is one the driver holds
(started ahead or recycled, :mod:`raycoll.coordinator.spare`): a rendezvous, in which each
rank calls the coordinator and waits for the others, only gathers what the driver can
gather itself. So the driver forms the group (:func:`form`):

1. every rank's info (:func:`raycoll.coordinator.rank_info`: its node, actor, listener
   address, process), fetched with one call per actor the first time and kept for the Ray
   session (by actor id: an actor's info changes only when Ray restarts its process);
2. the roster and the direct connections' secret sent to the coordinator
   (:meth:`Coordinator.form <raycoll.coordinator.actor.Coordinator.form>`) and to every
   actor at once (one call per actor for all the groups of a :func:`raycoll.create_groups`
   call); each rank installs its groups, and takes its lease on each coordinator
   (``lease`` + ``watch``, calls it does not wait for) from a thread of its own as its
   install call returns (:func:`_hand_over`), so no rank waits on a coordinator and the
   driver waits on no lease. The driver records the groups' names (``claim``, GCS calls)
   while the ranks install.

A formation is then one round of calls from the driver (two the first time an actor is
seen), against a rendezvous' driver call, rank call and coordinator answer, each rank
blocked in Ray's ``ray.get`` meanwhile. A rank whose info the driver kept is stale (Ray
restarted the actor: a new process) refuses its roster; the formation is undone
(:class:`Stale`) and the caller forms again with fresh infos.

A group's coordinator, its failures and its calls are its own as before: only who gathers
the roster changed.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ray
from ray.actor import ActorHandle

from raycoll import errors, session
from raycoll.backends import backend_config
from raycoll.coordinator import CoordinatorClient, rank_info
from raycoll.coordinator.client import pack_handle, unpack_handle
from raycoll.coordinator.hosting import Hosted
from raycoll.process_group import GroupSpec
from raycoll.transport.links import listener
from raycoll.world import install_root_group

__all__ = ["Stale", "form", "forget", "submit", "unschedulable"]

#: How long a driver call into a rank waits after the group's timeout for its answer.
_GRACE_S = 5.0
#: A rank info call unanswered this long has its actor looked up (never scheduled?).
_SCHEDULED_CHECK_S = 1.0
#: How long the driver waits for its calls' answers before it reads those that came.
_SLICE_S = 0.25
#: The fields of a rank's info that show it is the same process (an actor Ray restarted has
#: another ``proc``, and listens elsewhere).
_SAME = ("actor_id", "proc", "addr", "node_id")
_INFOS: Dict[Tuple[Any, bytes], Dict[str, Any]] = {}
_INFOS_MAX = 4096
_LOCK = threading.Lock()
#: The most coordinators' handles a process keeps packed (the driver) or read (a rank):
#: above the pool of idle coordinators a driver keeps (``spare.POOL_MAX``).
_HANDLES_MAX = 64
#: The driver's packed handles of its coordinators, by actor id (:func:`_packed`).
_PACKED: "OrderedDict[bytes, bytes]" = OrderedDict()
#: A rank's coordinators' handles, read from their packed bytes (:func:`_coordinator`).
_READ: "OrderedDict[bytes, Any]" = OrderedDict()
#: A rank's thread that hands its leases to their coordinators (:func:`_hand_over`).
_HANDS: Optional[ThreadPoolExecutor] = None

logger = logging.getLogger("raycoll")


class Stale(Exception):
    """The driver's copy of a rank's info is from before Ray restarted the actor: the
    formation was undone; form again (the copy is forgotten)."""


def _info(actor_self: Any) -> Dict[str, Any]:
    """Runs inside a rank: its info, as a rendezvous would send it."""
    where = listener()
    return rank_info(where.address if where else None)


def _install(actor_self: Any, items: List[Tuple[GroupSpec, int, List[Dict[str, Any]], int]],
             secret: bytes) -> List[Any]:
    """Runs inside a rank: install each group ``(spec, rank, roster, generation)``; this
    rank's lease on its coordinator (a call that stays pending while the rank is a member,
    handed to the coordinator: ``lease``, ``watch``; one for all the groups whose
    coordinators one process hosts, :mod:`raycoll.coordinator.hosting`) is taken from a
    thread of this process as the call returns (:func:`_hand_over`). Each group's outcome: ``None`` (installed), or
    the exception; :class:`Stale` for all if the rosters' entry of this rank is not this
    process's."""
    mine = _info(actor_self)
    items = [(replace(spec, coordinator=_coordinator(spec.coordinator)), rank, roster, g)
             for spec, rank, roster, g in items]
    spec, rank, roster, _ = items[0]
    entry = roster[rank]
    if any(entry.get(k) != mine.get(k) for k in _SAME):
        return [Stale(f"rank {rank}: the driver's info of this actor is stale (its process "
                      f"changed: {entry.get('proc')!r} -> {mine.get('proc')!r})")] * len(items)
    outcomes: List[Any] = []
    held: List[Tuple[CoordinatorClient, int, int]] = []
    for spec, rank, roster, generation in items:
        try:
            client = CoordinatorClient(spec.coordinator, spec.name)
            install_root_group(spec, rank, client, {"members": roster, "generation": generation,
                                                    "secret": secret},
                               backend_config(spec.backend), lease=False)
            held.append((client, rank, generation))
            outcomes.append(None)
        except Exception as exc:  # noqa: BLE001 - this group's failure, reported as its own
            outcomes.append(exc)
    _hand_over(held)
    return outcomes


def _packed(handle: Any) -> Any:
    """Driver side: a coordinator's handle packed (:func:`pack_handle`) for the ranks' install
    calls, packed once per coordinator (a recycled one serves group after group)."""
    if isinstance(handle, Hosted):  # the host's handle packed, the index as it is
        return Hosted(_packed(handle.host), handle.index)
    return _kept(_PACKED, handle._actor_id.binary(), lambda: pack_handle(handle))


def _coordinator(packed: Any) -> Any:
    """Rank side: the coordinator's handle that :func:`_packed` packed, read once per
    coordinator and kept (``_HANDLES_MAX``, the last used). A handle in a Ray call's
    arguments is read again at every call, 0.5-1 ms in each rank: with a recycled
    coordinator, that was most of a back-to-back formation's argument cost. A handle (not
    packed) is returned as it is. Keeping it does not keep the coordinator alive beyond its
    driver's ``ray.kill`` or its driver's exit."""
    if isinstance(packed, Hosted):
        return Hosted(_coordinator(packed.host), packed.index)
    if not isinstance(packed, bytes):
        return packed
    return _kept(_READ, packed, lambda: unpack_handle(packed))


def _kept(cache: "OrderedDict[bytes, Any]", key: bytes, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made by ``make()`` the first time; the cache keeps the
    ``_HANDLES_MAX`` used last."""
    with _LOCK:
        value = cache.get(key)
        if value is not None:
            cache.move_to_end(key)
            return value
    value = make()  # (outside the lock: reading a handle may import its class)
    with _LOCK:
        cache[key] = value
        while len(cache) > _HANDLES_MAX:
            cache.popitem(last=False)
    return value


def _hand_over(held: List[Tuple[CoordinatorClient, int, int]]) -> None:
    """Runs inside a rank: take each group's lease on its coordinator and hand it over
    (:meth:`CoordinatorClient.hold_lease`: ``lease``, then ``watch`` with the reference)
    from this process's lease thread, not waited for. A rank's first calls on a coordinator's
    handle cost it 1-2 ms each, and handing a reference over 1.5-2 ms more (Ray's borrowing
    protocol): in the install call, or in its answer to the driver, that was most of the
    rank's part of a formation. A lease or a hand-over that comes after the rank left (or
    after the coordinator moved to another generation) is released or ignored by the
    coordinator; until it comes, a collective's wait probes the ranks
    (:mod:`raycoll.coordinator.liveness`)."""
    global _HANDS
    if not held:
        return
    with _LOCK:
        if _HANDS is None:
            _HANDS = ThreadPoolExecutor(1, thread_name_prefix="raycoll-lease")
        hands = _HANDS
    hands.submit(_hold, held)


def _hold(held: List[Tuple[CoordinatorClient, int, int]]) -> None:
    hosted = [(c, r, g) for c, r, g in held if isinstance(c.handle, Hosted)]
    for client, rank, generation in [h for h in held if h not in hosted] + hosted[:1]:
        try:
            if isinstance(client.handle, Hosted):  # one lease for every group on its host
                lease = client.hold_hosted_lease(rank, generation)
                for other, _, _ in hosted:
                    other.lease = lease
            else:
                client.hold_lease(rank, generation)
        except Exception as exc:  # noqa: BLE001 - the coordinator is gone: nothing to hold
            logger.debug("raycoll: rank %d's lease on the coordinator of %r failed: %s", rank,
                         client.group_name, exc)


def forget(actors: Sequence[ActorHandle]) -> None:
    """Drop the driver's copies of these actors' infos (their next group fetches them)."""
    now = session.current()
    with _LOCK:
        for actor in actors:
            _INFOS.pop((now, actor._actor_id.binary()), None)


def _infos(actors: Sequence[ActorHandle], now: Any, label: str, group: str,
           deadline: float) -> List[Dict[str, Any]]:
    """Every actor's info: the kept copy, or fetched (one call each, all at once)."""
    with _LOCK:
        infos = [_INFOS.get((now, a._actor_id.binary())) for a in actors]
    missing = [r for r, info in enumerate(infos) if info is None]
    if missing:
        refs = [submit(actors[r], r, group, _info) for r in missing]
        for r, info in zip(missing, _gather(refs, missing, actors, label, group, deadline)):
            infos[r] = info
        with _LOCK:
            if len(_INFOS) > _INFOS_MAX:
                _INFOS.clear()
            for r in missing:
                _INFOS[(now, actors[r]._actor_id.binary())] = infos[r]  # type: ignore[assignment]
    return [info for info in infos if info is not None]


def form(actors: Sequence[ActorHandle], specs: Sequence[GroupSpec], generations: Sequence[int],
         label: str, claim: Optional[Callable[[], None]] = None) -> None:
    """Form root groups ``specs`` (each over all of ``actors``, rank = position; each spec's
    coordinator one this driver holds, serving no group yet at its ``generations`` entry).
    ``claim``: called once the ranks' calls are sent, while they run (the groups' names
    recorded: a name taken raises there, and the ranks' installs are undone as any
    failure's). Raises the first failure (``RankFailedError`` for a dead actor,
    ``DistTimeoutError`` for ranks that did not answer, ``ValueError`` for actors that can
    never be scheduled, a group's own error), or :class:`Stale`; the caller then undoes
    every group (ranks that installed one leave it when told, as ``destroy_group`` tells
    them)."""
    now = session.current()
    group = specs[0].name
    deadline = time.monotonic() + max(s.timeout_s for s in specs)
    infos = _infos(actors, now, label, group, deadline)
    roster = [dict(info, rank=r) for r, info in enumerate(infos)]
    secret = secrets.token_bytes(16)  # for direct connections (transport.links)
    sent = [replace(s, coordinator=_packed(s.coordinator)) for s in specs]  # read once a rank
    refs = [submit(a, rank, group, _install, [(s, rank, roster, g)
                                               for s, g in zip(sent, generations)], secret)
            for rank, a in enumerate(actors)]
    first = specs[0].coordinator
    if isinstance(first, Hosted):  # one process hosts every group's coordinator: one call
        formed = [CoordinatorClient(first.host, group).submit_form_hosted(
            [s.name for s in specs], roster, secret, generations[0])]
    else:
        formed = [CoordinatorClient(s.coordinator, s.name).submit_form(roster, secret, g)
                  for s, g in zip(specs, generations)]
    if claim is not None:
        claim()  # (GCS calls: under the ranks' install, not before it)
    outcomes = _gather(refs, list(range(len(actors))), actors, label, group, deadline)
    stale = [r for r, out in enumerate(outcomes) if out and isinstance(out[0], Stale)]
    if stale:
        forget([actors[r] for r in stale])
        raise Stale(f"{label}: ranks {stale} were restarted by Ray since their info was kept")
    for out in outcomes:
        for outcome in out:
            if isinstance(outcome, BaseException):
                raise outcome
    _check_formed(specs[:len(formed)], formed, label, deadline)


def _check_formed(specs: Sequence[GroupSpec], formed: List[Any], label: str,
                  deadline: float) -> None:
    """Every coordinator's answer to its roster (``Coordinator.form``), read at once; raises
    ``CoordinatorDiedError`` for one that refused it or did not answer (a coordinator started
    now may still be starting)."""
    answers: List[Any] = [None] * len(formed)
    try:
        answers = ray.get(formed, timeout=max(deadline - time.monotonic(), _GRACE_S))
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        # which one: each read alone below, once all came or the time is up
        ray.wait(formed, num_returns=len(formed), timeout=max(deadline - time.monotonic(), 0))
    for spec, ref, answer in zip(specs, formed, answers):
        if answer is None:
            try:
                answer = ray.get(ref, timeout=0)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                raise errors.CoordinatorDiedError(
                    f"{label}: the coordinator of group {spec.name!r} did not take the group: "
                    f"{type(exc).__name__}", group=spec.name) from exc
        if answer[0] != "ok":
            raise errors.CoordinatorDiedError(
                f"{label}: the coordinator of group {spec.name!r} refused the group: "
                f"{answer[2]}", group=spec.name)


def submit(actor: ActorHandle, rank: int, group: str, fn: Any, *args: Any) -> Any:
    """``actor.__ray_call__.remote(fn, *args)``, or RaySessionError where Ray refuses the
    handle (it is from a Ray session that has ended, or from another cluster)."""
    try:
        return actor.__ray_call__.remote(fn, *args)
    except Exception as exc:  # Ray raises a bare Exception ("Can't find actor ...")
        raise errors.RaySessionError(
            f"group {group!r}: Ray cannot reach the actor of rank {rank}: its handle is from a "
            "Ray session that has ended (ray.shutdown() or ray.init() since the actor was "
            "created) or from another cluster; create the actors again in this session "
            f"(Ray said: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc})"
        ) from exc


def _gather(refs: List[Any], ranks: List[int], actors: Sequence[ActorHandle], label: str,
            group: str, deadline: float) -> List[Any]:
    """Every call's answer, in order; raises at the first that failed (a dead actor: its
    rank's ``RankFailedError``), or ``DistTimeoutError`` naming the ranks that did not answer
    by ``deadline``; ``ValueError`` at once for actors that can never be scheduled."""
    answers: Dict[int, Any] = {}
    pending = list(refs)
    checked = False
    start = time.monotonic()
    while pending:
        now = time.monotonic()
        if now >= deadline:
            break
        if not checked and now >= start + _SCHEDULED_CHECK_S:
            checked = True
            waiting = [ranks[refs.index(p)] for p in pending]
            never = [(r, why) for r, why in zip(waiting, unschedulable(
                [actors[r] for r in waiting])) if why]
            if never:
                raise ValueError(
                    f"{label}: the actors of ranks {[r for r, _ in never]} can never be "
                    f"scheduled: rank {never[0][0]}'s {never[0][1]}; create them with "
                    "resources the cluster has")
        # every answer at once (a wake-up each costs on a loaded machine), in slices so that
        # a failed call (a dead actor) is seen within _SLICE_S
        ready, pending = ray.wait(pending, num_returns=len(pending),
                                  timeout=min(deadline - now, _SLICE_S))
        try:  # every answer read at once (each ray.get costs); a failure: read one by one
            answers.update(zip([refs.index(ref) for ref in ready],
                               ray.get(ready, timeout=_GRACE_S)))
            ready = []
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
            pass
        for ref in ready:
            i = refs.index(ref)
            try:
                answers[i] = ray.get(ref, timeout=_GRACE_S)
            except ray.exceptions.RayActorError as exc:
                raise errors.RankFailedError(f"{label}: the actor of rank {ranks[i]} is dead",
                                             failed_ranks=[ranks[i]], group=group) from exc
            except ray.exceptions.RayTaskError as exc:
                raise exc.as_instanceof_cause() from None
    if pending:
        missing = [ranks[refs.index(p)] for p in pending]
        raise errors.DistTimeoutError(
            f"{label}: ranks {missing} did not answer in time (a sync actor busy in another "
            "method cannot join until it returns; an actor whose resources cannot be "
            "scheduled never starts)", missing=missing, group=group, op="create_group")
    return [answers[i] for i in range(len(refs))]


def unschedulable(actors: Sequence[ActorHandle]) -> List[Optional[str]]:
    """For each actor still waiting to be created, why no node of the cluster can ever hold
    it (its resources above every live node's total, and above what an autoscaling
    cluster's configuration allows); ``None`` for an actor that can be (or is) scheduled, or
    where Ray cannot tell."""
    try:
        from ray._private import state
        from ray.core.generated import gcs_pb2

        nodes = list(state.state.total_resources_per_node().values())
        ceiling = state.state.get_max_resources_from_cluster_config() or {}
    except Exception:  # noqa: BLE001 - Ray's internals moved: tell nothing
        return [None] * len(actors)
    out: List[Optional[str]] = []
    for actor in actors:
        try:
            data = gcs_pb2.ActorTableData.FromString(state.state.get_actor_info(actor._actor_id))
        except Exception:  # noqa: BLE001 - not found (yet): tell nothing
            out.append(None)
            continue
        need = dict(data.required_resources)
        pending = data.state == gcs_pb2.ActorTableData.PENDING_CREATION
        fits = any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in nodes)
        could = all(ceiling.get(k, 0.0) >= v for k, v in need.items()) if ceiling else False
        out.append(f"actor needs {need} and no node has that (nodes' resources: {nodes})"
                   if pending and need and not fits and not could else None)
    return out
