"""The per-process "world" that holds a rank's groups, and torch's group markers.

The world (one per process, see :func:`world`) maps group names to groups and knows the
default group, so that ``group=None`` and ``group="dp"`` resolve inside any actor. Here too:
``group.WORLD`` / ``GroupMember.WORLD`` (torch's names for the default group),
``NON_GROUP_MEMBER``, and how a rank joins a root group or forms a subgroup.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from raycoll import errors, session
from raycoll.backends import backend_config
from raycoll.backends._cuda import select_device
from raycoll.coordinator import CoordinatorClient, rank_info
from raycoll.process_group import GroupSpec, ProcessGroup, _Root
from raycoll.transport.links import listener

logger = logging.getLogger("raycoll")

__all__ = [
    "GroupLike",
    "GroupMember",
    "group",
    "NON_GROUP_MEMBER",
    "world",
    "join_root_group",
    "install_root_group",
    "make_subgroup",
]


class _NonMember:
    """What ``new_group`` returns on a rank outside the group (torch's NON_GROUP_MEMBER)."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"

    def __reduce__(self) -> Any:
        return (_non_member, ())


def _non_member() -> "_NonMember":
    return NON_GROUP_MEMBER


NON_GROUP_MEMBER = _NonMember()


class _WorldMeta(type):
    """The metaclass of :class:`group` and :class:`GroupMember`: their ``WORLD``."""

    @property
    def WORLD(cls) -> Optional["ProcessGroup"]:
        """This process's default group, ``None`` before one is formed (torch's)."""
        return _WORLD.default


class group(metaclass=_WorldMeta):
    """torch's ``dist.group``: ``group.WORLD`` is the default group (``None`` if none)."""


class GroupMember(metaclass=_WorldMeta):
    """torch's ``GroupMember``: ``WORLD`` is the default group (``None`` if none),
    ``NON_GROUP_MEMBER`` marks groups this rank is not part of."""

    NON_GROUP_MEMBER = NON_GROUP_MEMBER




GroupLike = Union[None, str, ProcessGroup, _NonMember]


class _World:
    """This process's groups: by name, plus the default group (``group=None``)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.groups: Dict[str, ProcessGroup] = {}
        self.default: Optional[ProcessGroup] = None
        self.destroyed: Dict[str, str] = {}
        self.default_destroyed: Optional[Tuple[str, str]] = None  # (name, reason), until a new one
        # root group -> the Ray session it was formed in (see drop_ended)
        self.sessions: Dict[str, Optional[session.SessionKey]] = {}
        self._ended: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()

    def add(self, pg: ProcessGroup, make_default: bool) -> None:
        with self.lock:
            if pg.name in self.groups:
                raise ValueError(f"group {pg.name!r} already exists in this process; destroy it first")
            self.groups[pg.name] = pg
            self.destroyed.pop(pg.name, None)
            if make_default:
                if self.default is not None:
                    self.default.is_default = False
                self.default = pg
                pg.is_default = True
                self.default_destroyed = None

    def resolve(self, group: GroupLike) -> Union[ProcessGroup, _NonMember]:
        """The group a ``group=`` argument names, or raise a clear error."""
        if group is None:
            with self.lock:
                pg, gone = self.default, self.default_destroyed
            if pg is None and gone is not None:
                raise errors.GroupDestroyedError(
                    f"the default group {gone[0]!r} was destroyed ({gone[1]}); form a group again "
                    "(raycoll.init_process_group / create_group) or pass group= explicitly")
            if pg is None:
                raise errors.GroupNotFoundError(
                    "raycoll has no default group in this process: call "
                    "raycoll.init_process_group(...) here, or raycoll.create_group(actors, ...) "
                    "from the driver, first"
                )
            pg.check_usable()
            return pg
        if isinstance(group, _NonMember):
            return group
        if isinstance(group, ProcessGroup):
            group.check_usable()
            return group
        if isinstance(group, str):
            with self.lock:
                pg = self.groups.get(group)
                reason = self.destroyed.get(group)
                names = sorted(self.groups)
            if pg is None:
                if reason is not None:
                    raise errors.GroupDestroyedError(f"group {group!r} was destroyed ({reason})")
                raise errors.GroupNotFoundError(
                    f"no group named {group!r} in this process; groups here: {names}"
                )
            pg.check_usable()
            return pg
        raise TypeError(f"group must be a ProcessGroup, a group name or None, got {group!r}")

    def remove(self, name: str, reason: str) -> List[ProcessGroup]:
        """Remove ``name`` and its subgroups; return what was removed."""
        with self.lock:
            self.sessions.pop(name, None)
            gone = [pg for n, pg in self.groups.items() if n == name or n.startswith(name + "/")]
            for pg in gone:
                del self.groups[pg.name]
                self.destroyed[pg.name] = reason
                if self.default is pg:
                    pg.is_default = False
                    self.default = None
                    self.default_destroyed = (pg.name, reason)
        for pg in gone:
            pg.close(reason)
        return gone

    def drop_ended(self) -> List[str]:
        """Forget the root groups (with their subgroups) formed in a Ray session other than
        the one connected now (a driver that was a rank, then restarted Ray): their
        coordinators and peers are gone. They then report as destroyed (:data:`ENDED
        <raycoll.session.ENDED>`). Returns their names. Asks Ray nothing when this process
        has no root group."""
        with self.lock:
            if not self.sessions:
                return []
            now = session.current()
            gone = [name for name, made_in in self.sessions.items() if made_in != now]
        for name in gone:
            logger.debug("raycoll: forgot group %r: %s", name, session.ENDED)
            try:
                self._ended.update(self.remove(name, session.ENDED))
            except Exception:  # noqa: BLE001 - its transports belonged to a dead session
                logger.debug("raycoll: closing group %r of an ended Ray session failed", name,
                             exc_info=True)
        return gone

    def ended(self, group: Union[str, ProcessGroup]) -> bool:
        """Whether ``group`` (a name, or a group object) was forgotten because its Ray
        session ended (a name only until a group of that name is formed again)."""
        with self.lock:
            if isinstance(group, str):
                return self.destroyed.get(group) == session.ENDED
            return group in self._ended


_WORLD = _World()


def world() -> _World:
    """This process's world."""
    return _WORLD


def join_root_group(spec: GroupSpec, rank: int, make_default: Optional[bool] = None) -> ProcessGroup:
    """Rendezvous with the coordinator as ``rank`` and register the group in this process."""
    config = backend_config(spec.backend)
    client = CoordinatorClient(spec.coordinator, spec.name)
    where = listener()  # this rank's direct-connection address, if it can listen
    info = client.rendezvous(rank, spec.world_size, rank_info(where.address if where else None),
                             spec.timeout_s)
    # (the rank's lease was taken with its rendezvous call: CoordinatorClient.rendezvous)
    pg = install_root_group(spec, rank, client, info, config, make_default, lease=False)
    logger.debug("rank %d joined group %r (world_size=%d)", rank, spec.name, spec.world_size)
    return pg


def install_root_group(spec: GroupSpec, rank: int, client: CoordinatorClient,
                       info: Dict[str, Any], config: Any, make_default: Optional[bool] = None,
                       group_desc: Optional[str] = None, lease: bool = True) -> ProcessGroup:
    """Register root group ``spec.name`` in this process as ``rank`` of the roster ``info``
    (the coordinator's answer to a rendezvous, or to a membership change: its ``members``,
    ``generation`` and ``secret``); ``lease``: take this rank's lease on the coordinator
    for the roster's generation (a rendezvous took it with its call already)."""
    generation = int(info.get("generation", 0))
    if lease:
        client.hold_lease(rank, generation)
    select_device()  # a rank with a Ray-assigned GPU uses it (torch/cupy current device)
    # each peer's actor handle stays packed until something uses it (unpacking a handle costs
    # 0.5-5 ms, and a formation uses none: W^2 unpacks per group before)
    members = [dict(m) for m in info["members"]]
    root = _Root(spec.name, client, members, spec.options, info.get("secret"), spec.by_name,
                 generation)
    pg = ProcessGroup(name=spec.name, rank=rank, global_ranks=range(len(members)), root=root,
                      config=config, timeout_s=spec.timeout_s, backend_name=spec.backend,
                      group_desc=group_desc)
    w = world()
    with w.lock:
        default = w.default is None if make_default is None else make_default
        w.add(pg, make_default=default)
        w.sessions[spec.name] = session.current()
    return pg


def make_subgroup(parent: ProcessGroup, ranks: Sequence[int], timeout_s: Optional[float],
                  backend: Optional[str], group_desc: Optional[str] = None
                  ) -> Union[ProcessGroup, _NonMember]:
    """A subgroup of ``parent`` (global ``ranks``); ``NON_GROUP_MEMBER`` if we are not in it."""
    name = parent.next_subgroup_name(ranks)
    me = parent.global_ranks[parent.rank()]
    if me not in ranks:
        return NON_GROUP_MEMBER
    config = backend_config(backend) if backend is not None else parent.backend_config
    pg = ProcessGroup(name=name, rank=list(ranks).index(me), global_ranks=ranks, root=parent._root,
                      config=config, timeout_s=timeout_s or parent.timeout_s, parent=parent,
                      backend_name=backend if backend is not None else parent._backend_name,
                      group_desc=group_desc)
    world().add(pg, make_default=False)
    return pg
