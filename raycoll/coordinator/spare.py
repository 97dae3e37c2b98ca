"""Coordinators started ahead, so that a group formed from a driver does not wait for one.

A coordinator is a Ray actor, so a process of its own: Ray takes 0.3-0.7 s to start one,
which was most of :func:`raycoll.create_group`'s time over live actors (and of a Ray Train
restart). So the process that forms groups keeps one coordinator started ahead, its *spare*:
:func:`take` hands it to the next group (whose first rank to rendezvous makes it that
group's, :meth:`Coordinator.rendezvous <raycoll.coordinator.actor.Coordinator.rendezvous>`),
and :func:`refill` starts the next one,
which Ray brings up in the background while the caller goes on. A process's first group
starts its coordinator then (there is no spare yet), unless :func:`refill` ran earlier (the
Ray Train backend calls it as soon as it reaches its controller). Each coordinator still
serves one root group at a time: its state, and its failures, are that group's alone; or
it hosts the coordinators of one :func:`raycoll.create_groups` call's groups, each with
tables of its own (:mod:`.hosting`), and is idle again once the last of them is destroyed.

**Recycling.** Groups formed back to back (a notebook's cells, a test suite, a "dp" and a "tp"
group in a row) would each wait for the coordinator the last one started. So when a group
formed here is destroyed and every rank left it, :func:`recycle` asks its coordinator to
empty its tables (:meth:`Coordinator.recycle <raycoll.coordinator.actor.Coordinator.recycle>`:
a new generation, every lease released) and keeps it idle for the next group, up to
:data:`POOL_MAX`; :func:`take` hands out the one made idle last. A coordinator that saw a
failure (a dead rank, a broken group), that has anything pending, or whose group's ranks did
not all leave, is ended instead: it never serves another group.

**Lifetime.** A spare is an ordinary actor (not detached) of the process that started it,
so Ray ends it with that process, or with its job (``ray.shutdown()``, the end of a
``ray job submit`` job, a Ray Train controller's exit); :func:`release` ends it at once.
This process's record of it belongs to the Ray session it was started in
(:class:`raycoll.session.SessionRecords`): after ``ray.shutdown()`` or a new ``ray.init()``
it is forgotten, never handed to a group of another session. ``RAYCOLL_SPARE_COORDINATOR=0``
turns spares off: every group then starts its coordinator when it forms.

**Names.** A group's coordinator is found by name from any process of the job
(:func:`find`: ``raycoll.group_status``, tests), and a name is taken once per job. A spare's
Ray actor name is its own (``raycoll:<job>:~spare-<id>``), so :func:`claim` records the
group's name (:func:`raycoll.coordinator.coordinator_name`) in Ray's key-value store (the
GCS's, namespace ``raycoll``), pointing at it, and :func:`unclaim` removes it when the group
is destroyed (before the coordinator is recycled or ended). An entry whose coordinator is dead (its driver exited without destroying the
group) counts as free. Coordinators that ranks start by name (``init_process_group`` in
actors) keep their Ray name, as before; they are not pooled here but linger
(:data:`raycoll.coordinator.actor.LINGER_S`) after their ranks all left, for the same name
formed again, then stop themselves.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional

import ray

from raycoll import errors, session
from raycoll.coordinator.actor import _RemoteCoordinator, _here
from raycoll.coordinator.client import CoordinatorClient
from raycoll.coordinator.hosting import Hosted
from raycoll.coordinator.logic import coordinator_name

logger = logging.getLogger("raycoll")

__all__ = ["Spare", "ENV", "POOL_MAX", "enabled", "pending", "take", "refill",
           "recycle", "release", "claim", "unclaim", "find", "claimed", "counts"]

#: The environment variable that turns spares off (``0``).
ENV = "RAYCOLL_SPARE_COORDINATOR"

#: The key-value store's namespace for group names.
_NAMESPACE = "raycoll"
_HOSTED = "#"  # a claim's value: the coordinator's Ray name, and "#<index>" for a hosted one
_PREFIX = "idle-"  # the idle coordinators of a session, in _SPARES, in the order made idle
_SEQ = itertools.count()
#: The most idle coordinators a process keeps: those recycled by destroyed groups beyond it
#: are ended (a coordinator is a process: ~60 MB). Above the 8 groups a driver commonly forms
#: at once from as many threads (one :func:`raycoll.create_groups` call takes one process for
#: all its groups), so that forming them again starts no process: a pool of exactly the
#: groups' number ended one at every destroy and started one at every formation (a Ray
#: worker's start, 0.5-1 s of the 2 cores, under the next formation).
POOL_MAX = 16


@dataclass(frozen=True)
class Spare:
    """A coordinator: its handle, its Ray actor name, whether it was started ahead, and the
    generation it waits at for its next group (0 for one started here; a recycled one's next,
    as it answered :meth:`Coordinator.recycle
    <raycoll.coordinator.actor.Coordinator.recycle>`), which its driver forms the group at
    (:mod:`raycoll.formation`)."""

    handle: Any
    name: str
    ahead: bool = True
    generation: int = 0


_SPARES: session.SessionRecords[Spare] = session.SessionRecords("spare coordinator")
_LOCK = threading.RLock()
_COUNTS: Dict[str, int] = {"started": 0, "taken": 0, "recycled": 0}


def counts() -> Dict[str, int]:
    """How many coordinators this process started here (``started``), how many groups took
    one that was ready (``taken``: started ahead or recycled), and how many destroyed groups
    gave theirs back for the next (``recycled``)."""
    with _LOCK:
        return dict(_COUNTS)


def enabled() -> bool:
    """Whether spares are on (``RAYCOLL_SPARE_COORDINATOR`` is not ``0``)."""
    return os.environ.get(ENV, "1").strip() != "0"


def _start(job: str) -> Spare:
    name = coordinator_name(job, f"~spare-{uuid.uuid4().hex[:12]}")
    handle = _RemoteCoordinator.options(name=name, scheduling_strategy=_here()).remote("", 0)
    with _LOCK:
        _COUNTS["started"] += 1
    return Spare(handle, name)


def _key() -> str:
    return f"{_PREFIX}{next(_SEQ):010d}"


def _idle(now: Optional[session.SessionKey]) -> List[str]:
    return [n for n in _SPARES.names(now) if n.startswith(_PREFIX)]


def refill(now: Optional[session.SessionKey] = None) -> None:
    """Start a coordinator ahead if this process has none idle (in session ``now``, default:
    the one connected); returns at once, Ray starts the actor in the background. Nothing
    when spares are off or Ray is not initialized."""
    now = now or session.current()
    if now is None or not enabled():
        return
    with _LOCK:
        if _idle(now):
            return
        spare = _start(now[1])
        _SPARES.add(_key(), spare, now)


def pending(now: Optional[session.SessionKey] = None) -> Optional[Spare]:
    """One of this process's idle coordinators of session ``now`` (default: the one
    connected), the next :func:`take` hands out; ``None`` if it has none."""
    now = now or session.current()
    with _LOCK:
        names = _idle(now)
        return _SPARES.get(names[-1], now) if names else None


def take(now: session.SessionKey) -> Spare:
    """An idle coordinator of session ``now`` (the one made idle last: recycled or started
    ahead), or one started now if there is none."""
    with _LOCK:
        names = _idle(now)
        spare = _SPARES.pop(names[-1], now) if names else None
        if spare is not None:
            _COUNTS["taken"] += 1
    return spare if spare is not None else replace(_start(now[1]), ahead=False)


def recycle(handle: Any, name: str, now: Optional[session.SessionKey],
            timeout_s: float = 5.0) -> bool:
    """Keep the coordinator of a destroyed group (``handle``, Ray actor ``name``) for the next
    group of this process, if it empties its tables (:meth:`Coordinator.recycle
    <raycoll.coordinator.actor.Coordinator.recycle>`: refused after a failure or with
    anything pending) and the pool has room; else end it. True if kept. Forming the next
    group then starts no process: groups formed back to back take milliseconds."""
    kept = False
    if now is not None and enabled():
        generation: Optional[int] = None
        try:
            generation = CoordinatorClient(handle, name).recycle(timeout_s)
        except Exception as exc:  # noqa: BLE001 - dead, busy or gone: end it
            logger.debug("raycoll: recycling a coordinator failed: %s", exc)
        if generation is not None:
            with _LOCK:
                kept = len(_idle(now)) < POOL_MAX and _SPARES.add(
                    _key(), Spare(handle, name, generation=generation), now)
                if kept:
                    _COUNTS["recycled"] += 1
    if not kept:
        _kill(handle)
    return kept


def release() -> None:
    """End this process's idle coordinators now (of the session connected)."""
    now = session.current()
    with _LOCK:
        spares = [_SPARES.pop(n, now) for n in _idle(now)]
    for spare in spares:
        if spare is not None:
            _kill(spare.handle)


def _kill(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception as exc:  # noqa: BLE001 - a handle of a session that has ended
        logger.debug("raycoll: ending a spare coordinator failed: %s", exc)


# ---------------------------------------------------------------------- group names
def _kv() -> Any:
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        raise errors.RaySessionError("Ray's key-value store is not reachable from this process "
                                     "(Ray is not initialized, or this is a Ray Client "
                                     "connection)")
    return internal_kv


def _alive(actor_name: str) -> bool:
    try:
        ray.get_actor(actor_name)
        return True
    except ValueError:  # no live actor of that name
        return False


def claim(job: str, group_name: str, spare: Spare, index: int = 0) -> bool:
    """Record ``spare`` as the coordinator of ``group_name`` in job ``job`` (``index``: the
    group's coordinator hosted in it, :mod:`.hosting`; 0: the coordinator itself); False if
    the name is taken (a live coordinator of that name, from any process of the job)."""
    key = coordinator_name(job, group_name)
    if _alive(key):  # a coordinator started by name (init_process_group in actors)
        return False
    kv = _kv()
    value = f"{spare.name}{_HOSTED}{index}" if index else spare.name
    if not kv._internal_kv_put(key, value, overwrite=False, namespace=_NAMESPACE):
        return True
    held = kv._internal_kv_get(key, namespace=_NAMESPACE)
    if held is not None and _alive(held.decode().partition(_HOSTED)[0]):
        return False
    kv._internal_kv_put(key, value, overwrite=True, namespace=_NAMESPACE)  # stale: free
    return True


def unclaim(job: str, group_name: str) -> None:
    """Forget the coordinator of ``group_name`` :func:`claim` recorded, before it is ended."""
    try:  # the entry is ours while our coordinator lives (claim() keeps a live one's)
        _kv()._internal_kv_del(coordinator_name(job, group_name), namespace=_NAMESPACE)
    except Exception as exc:  # noqa: BLE001 - Ray is down: the entry went with its job
        logger.debug("raycoll: forgetting the coordinator of %r failed: %s", group_name, exc)


def find(job: str, group_name: str) -> Optional[Any]:
    """The handle of the live coordinator of root group ``group_name`` in job ``job``,
    formed by any process of the job; ``None`` if there is none."""
    try:
        return ray.get_actor(coordinator_name(job, group_name))
    except ValueError:
        return claimed(job, group_name)


def claimed(job: str, group_name: str) -> Optional[Any]:
    """The handle of the live coordinator that :func:`claim` recorded for ``group_name`` in
    job ``job`` (a group formed with ``create_group``); ``None`` if there is none."""
    key = coordinator_name(job, group_name)
    try:
        held = _kv()._internal_kv_get(key, namespace=_NAMESPACE)
    except errors.RaySessionError:  # no key-value store here: no group claimed a name
        return None
    if held is None:
        return None
    name, _, index = held.decode().partition(_HOSTED)
    try:
        handle = ray.get_actor(name)
    except ValueError:
        return None
    return Hosted(handle, int(index)) if index else handle
