"""Which Ray session this process is connected to, and records that belong to one.

A driver keeps records of what it made: the groups it formed by name, their coordinators'
handles, the actors that are their ranks. Each is only meaningful inside the Ray session it
was made in: after ``ray.shutdown()``, or ``ray.init()`` of another cluster (or of the same
cluster again, as a new job), the actors and coordinators it names are gone or unreachable
and Ray refuses their handles. :class:`SessionRecords` keeps records by name, each tagged
with the session it was made in, and forgets (logging at debug) every record whose session is
not the one connected now, whenever it is read or written; so a notebook that restarts Ray
and re-runs its cells forms the same group names again at once.

A session is ``(cluster, job)``: the cluster's session name (unique per start of a Ray
cluster; its GCS address on a Ray without ``get_session_name``) and this process's job id
(a new ``ray.init()`` on a running cluster is a new job). ``None`` means Ray is not
initialized in this process: no record is current then.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, Generic, List, Optional, Tuple, TypeVar

import ray

from raycoll import errors

logger = logging.getLogger("raycoll")

__all__ = ["SessionKey", "current", "require", "SessionRecords", "ENDED", "ENDED_KEPT"]

#: ``(cluster session name, job id)``.
SessionKey = Tuple[str, str]

#: Why a record was forgotten (also the reason a rank's group reports as destroyed).
ENDED = "its Ray session ended: ray.shutdown() or a new ray.init() since it was formed"

V = TypeVar("V")

#: How many names of forgotten records :class:`SessionRecords` remembers.
ENDED_KEPT = 1024


def current() -> Optional[SessionKey]:
    """The Ray session this process is connected to, ``None`` when Ray is not initialized.

    Never starts Ray (``ray.get_runtime_context()`` alone would)."""
    if not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    try:
        cluster = str(ctx.get_session_name())
    except Exception:  # noqa: BLE001 - an older Ray, or a Ray Client connection
        cluster = str(ctx.gcs_address)
    return cluster, str(ctx.get_job_id())


def require(what: str) -> SessionKey:
    """The current session, or :class:`~raycoll.errors.RaySessionError` saying that ``what``
    (e.g. ``"create_group('dp')"``) needs Ray initialized."""
    now = current()
    if now is None:
        raise errors.RaySessionError(
            f"{what}: Ray is not initialized in this process (ray.shutdown() was called, or "
            "ray.init() never was): call ray.init(), then create the actors (and groups) "
            "again; handles made before ray.shutdown() belong to a session that has ended")
    return now


class SessionRecords(Generic[V]):
    """Records by name, each belonging to the Ray session it was added in.

    Every method takes the session connected now (``now``, from :func:`current`) and first
    forgets the records of every other session, remembering their names (the last
    :data:`ENDED_KEPT`) so that :meth:`ended` can say a name belonged to a session that is
    gone. ``what`` names the records in the debug log (``"group"``). Thread-safe.
    """

    def __init__(self, what: str) -> None:
        self._what = what
        self._lock = threading.Lock()
        self._items: Dict[str, Tuple[SessionKey, V]] = {}
        self._ended: Dict[str, SessionKey] = {}

    def _prune(self, now: Optional[SessionKey]) -> None:
        """Forget every record not of session ``now`` (the caller holds the lock)."""
        for name, (made_in, _value) in list(self._items.items()):
            if made_in != now:
                del self._items[name]
                self._ended[name] = made_in
                while len(self._ended) > ENDED_KEPT:
                    del self._ended[next(iter(self._ended))]
                logger.debug("raycoll: forgot %s %r of Ray session %s (job %s): %s", self._what,
                             name, made_in[0], made_in[1], ENDED)

    def add(self, name: str, value: V, now: SessionKey) -> bool:
        """Record ``value`` as ``name`` in session ``now``; False (and nothing recorded) if a
        record of that name exists in this session."""
        with self._lock:
            self._prune(now)
            if name in self._items:
                return False
            self._items[name] = (now, value)
            self._ended.pop(name, None)
            return True

    def replace(self, name: str, value: V, now: SessionKey) -> None:
        """Record ``value`` as ``name`` in session ``now``, replacing any record of it."""
        with self._lock:
            self._prune(now)
            self._items[name] = (now, value)
            self._ended.pop(name, None)

    def get(self, name: str, now: Optional[SessionKey]) -> Optional[V]:
        """The record ``name`` of session ``now``, or ``None``."""
        with self._lock:
            self._prune(now)
            item = self._items.get(name)
        return None if item is None else item[1]

    def pop(self, name: str, now: Optional[SessionKey]) -> Optional[V]:
        """Remove and return the record ``name`` of session ``now``, or ``None``."""
        with self._lock:
            self._prune(now)
            item = self._items.pop(name, None)
        return None if item is None else item[1]

    def names(self, now: Optional[SessionKey]) -> List[str]:
        """The names recorded in session ``now``, sorted."""
        with self._lock:
            self._prune(now)
            return sorted(self._items)

    def ended(self, name: str, now: Optional[SessionKey]) -> bool:
        """Whether ``name`` was recorded in a session that has ended (and not since)."""
        with self._lock:
            self._prune(now)
            return name in self._ended
