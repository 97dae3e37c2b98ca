"""The coordinator actor's tables, shared by the concerns that make up the actor.

:class:`CoordinatorState` creates every table once; the mixins (:mod:`.steps`,
:mod:`.transports`, :mod:`.join_state`, :mod:`.mailbox`, :mod:`.liveness`) hold the behaviour,
and :class:`raycoll.coordinator.actor.Coordinator` combines them. The methods one concern
calls on another are declared here for the type checker.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict, deque
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Sequence, Set, Tuple

from raycoll.coordinator.logic import Result


@dataclass
class Arrival:
    """What one rank brought to a step."""

    fp: Dict[str, Any]
    send_meta: Optional[List[Any]]
    recv_meta: Optional[List[Any]]
    payload: Any


@dataclass
class Step:
    """One step of one collective through the coordinator on one group: who arrived, with
    what, and the outcome."""

    op: str
    seq: int
    size: int
    arrivals: Dict[int, Arrival] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    results: Optional[Dict[int, Any]] = None
    error: Optional[Result] = None
    collected: Set[int] = field(default_factory=set)


@dataclass
class Message:
    """A posted send waiting for its receive."""

    src: int
    tag: int
    meta: Any
    payload: Any
    future: "asyncio.Future[Result]"


@dataclass
class Receiver:
    """A posted receive waiting for its send (``src`` ``None``: from any rank)."""

    src: Optional[int]
    tag: int
    meta: Any
    future: "asyncio.Future[Result]"


class CoordinatorState:
    """Every table of one root group's coordinator (and its subgroups', keyed by name)."""

    def __init__(self, group_name: str, world_size: int, owned_by_ranks: bool = False) -> None:
        self._group_name = group_name
        self._world_size = world_size
        # A coordinator started by ranks rendezvousing by name is detached (so that no rank's
        # exit can take it down mid-run): it goes away when every rank has left or died.
        self._owned_by_ranks = owned_by_ranks
        # membership (rendezvous)
        self._members: Dict[int, Dict[str, Any]] = {}
        self._roster: List[Dict[str, Any]] = []  # rendezvous' answer, once formed
        self._formed = asyncio.Event()
        self._generation = 0
        self._secret = b""
        self._left: Set[int] = set()
        self._reset = asyncio.Event()
        self._joiners = 0  # ranks of the next generation waiting for this one to leave
        self._linger_timer: Optional[asyncio.TimerHandle] = None  # a by-name one's, idle
        # key-value store
        self._kv: Dict[str, Any] = {}
        self._kv_events: Dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        # the groups' stores (c10d's Store, see .store): group -> key -> value, group -> key
        # -> queue, and the waiters woken when (group, key) changes
        self._store: Dict[str, Dict[str, bytes]] = defaultdict(dict)
        self._store_queues: Dict[str, Dict[str, List[bytes]]] = defaultdict(dict)
        self._store_waiters: Dict[Tuple[str, str], List["asyncio.Future[None]"]] = {}
        # steps: (group, seq, step) -> step; each group's global ranks; why a group broke;
        # by group rank, the last completed and the current collective (name, seq)
        self._steps: Dict[Tuple[str, int, int], Step] = {}
        # (group, seq) -> the fingerprint of the first rank whose round-transport wait in
        # that collective was checked, and the mismatch a later one made, if any (.transports)
        self._check_fps: Dict[Tuple[str, int], Dict[str, Any]] = {}
        self._groups: Dict[str, Tuple[int, ...]] = {}
        self._broken: Dict[str, Result] = {}
        self._last: Dict[str, Dict[int, Tuple[str, int]]] = defaultdict(dict)
        # ... and what every rank of a group completed at least (reports of EVERY_RANK)
        self._floor: Dict[str, Tuple[str, int]] = {}
        self._current: Dict[str, Dict[int, Tuple[str, int]]] = defaultdict(dict)
        # point to point: (group, destination group rank) -> posted sends, posted receives
        self._mail: Dict[Tuple[str, int], Deque[Message]] = defaultdict(deque)
        self._waiting: Dict[Tuple[str, int], List[Receiver]] = defaultdict(list)
        # Join: group rank -> seq of the round it joined in, for the Join context in
        # progress; and how the last finished one ended
        self._joins: Dict[str, Dict[int, int]] = defaultdict(dict)
        self._join_done: Dict[str, Dict[str, Any]] = {}
        # the last join round's answer per group, shared by its ranks: (every rank's join
        # seq, the answer, the last join seq)
        self._join_answers: Dict[str, Tuple[List[Any], Dict[str, Any], Optional[int]]] = {}
        # groups whose ranks reported progress on a round transport, and its name
        self._transports: Dict[str, str] = {}
        # ... and the longest period between two progress reports of one of its ranks
        self._report_period: Dict[str, float] = {}
        # ... and what each of its ranks last said of itself: the algorithms it chose, its
        # counters (global rank -> detail)
        self._details: Dict[str, Dict[int, Dict[str, Any]]] = {}
        # liveness (see raycoll.coordinator.liveness)
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
        # leases taken with a rendezvous, by token, until the lease call returns; and each
        # forming member's (token, reference) until the group forms
        self._token_leases: Dict[str, "asyncio.Future[None]"] = {}
        self._pending_leases: Dict[int, Tuple[str, Any]] = {}
        # the groups' coordinators this one hosts, by index (.hosting: a create_groups call's)
        self._hosted: Dict[int, Any] = {}
        self._hosting = asyncio.Event()  # set once form_hosted made them

    if TYPE_CHECKING:  # provided by one concern, called by another
        def leave(self, rank: int) -> Result: ...
        def abort(self, key: str, kind: str, message: str,
                  extra: Optional[Dict[str, Any]] = None,
                  generation: Optional[int] = None) -> Result: ...
        async def exchange(self, key: str, ranks: Tuple[int, ...], seq: int, step: int,
                           rank: int, fp: Dict[str, Any], send_meta: Optional[List[Any]],
                           recv_meta: Optional[List[Any]], payload: Any, mode: str,
                           root: Optional[int], timeout_s: float) -> Result: ...
        def _finish(self, st: Step) -> None: ...
        def _collect(self, key: str, step: int, st: Step, rank: int) -> Result: ...
        def _timeout_error(self, key: str, op: str, seq: int, missing_local: Sequence[int],
                           timeout_s: float) -> Result: ...
        def _unusable(self, key: str) -> Optional[Result]: ...
        def _watching(self, ranks: Optional[Sequence[int]]) -> AbstractContextManager[None]: ...
        def _probe_if_due(self, g: int, now: float, force: bool = False) -> float: ...
        def _liveness_left(self, rank: int) -> None: ...
        def _liveness_reset(self, old_generation: int) -> None: ...
        def _adopt_lease(self, rank: int, generation: int, token: str, ref: Any) -> None: ...
        def _end_token_lease(self, token: str) -> None: ...
        def _self_destruct_if_orphaned(self) -> None: ...
        def _join_status(self, key: str, out: Dict[Any, Any]) -> None: ...
        def _store_reset(self) -> None: ...
