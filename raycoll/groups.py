"""Rank-side group management: ``init_process_group``, ``new_group``, rank queries.

These run inside the ranks (Ray actors, or any Ray worker or driver that is a rank), as in
``torch.distributed``. Ranks rendezvous by name through the group's coordinator, which the
first rank to arrive starts; no driver help is needed. Groups formed from the driver with
:func:`raycoll.create_group` appear here too, by name.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Dict, List, NewType, Optional, Sequence, Tuple, Union

import ray

from raycoll import errors
from raycoll.backends import backend_config
from raycoll.coordinator import coordinator_name, spare, start_coordinator
from raycoll.elastic import shrink_group
from raycoll.process_group import DEFAULT_TIMEOUT_S, GroupSpec, ProcessGroup
from raycoll.session import ENDED
from raycoll.world import (
    NON_GROUP_MEMBER,
    GroupLike,
    _NonMember,
    join_root_group,
    make_subgroup,
    world,
)
from raycoll.work import to_seconds

logger = logging.getLogger("raycoll")

__all__ = [
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank",
    "get_world_size", "new_group", "new_subgroups", "get_group_rank", "get_global_rank",
    "get_process_group_ranks", "get_group", "get_node_local_rank", "is_available",
    "get_backend", "get_backend_config", "new_subgroups_by_enumeration", "split_group",
    "shrink_group", "get_pg_count", "GroupName", "default_pg_timeout",
]

default_pg_timeout = timedelta(seconds=DEFAULT_TIMEOUT_S)
"""The default timeout of a group's collectives (and of its store's waits): 30 minutes, as
torch's ``default_pg_timeout``."""

GroupName = NewType("GroupName", str)
"""torch's type of group names (a ``str``), for annotations."""


def _int_arg(value: Any, name: str, env: str) -> int:
    if value is None or value == -1:
        text = os.environ.get(env)
        if text is None:
            raise ValueError(f"{name} is required (or set the {env} environment variable)")
        try:
            value = int(text)
        except ValueError as exc:
            raise ValueError(f"environment variable {env}={text!r} is not an int") from exc
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value


def init_process_group(
    backend: Optional[str] = None,
    init_method: Optional[str] = None,
    timeout: Any = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> ProcessGroup:
    """Join (and, if first, create) the group ``group_name`` (``""``, torch's default: the
    group named ``"default"``) as ``rank`` of ``world_size``.

    Called by every rank, inside Ray actors (or tasks, or drivers) of one Ray job. Blocks until
    all ``world_size`` ranks have joined or ``timeout`` (default 30 minutes) passes. The first
    root group of a process becomes its default group (``group=None``). ``init_method`` may be
    ``None`` or ``"env://"`` (then ``RANK`` and ``WORLD_SIZE`` come from the environment);
    rendezvous itself always goes through Ray. ``backend="gloo"`` (or ``"cpu:gloo,..."``)
    names raycoll's own CPU path, ``"objstore"`` (logged once). As in torch, a process that
    has a default group gets ValueError("trying to initialize the default process group
    twice!") unless ``group_name`` names another, additional root group. ``device_id``: a CPU
    device, or the GPU Ray assigned this rank (to which raycoll binds it anyway); another
    device, or any ``pg_options``, raises ValueError instead of being ignored.
    """
    if init_method not in (None, "env://"):
        raise ValueError(f"init_method={init_method!r} is not supported: raycoll rendezvous "
                         "through Ray; pass None (or 'env://' to read RANK/WORLD_SIZE)")
    if store is not None:
        raise ValueError("store= is not supported: raycoll's coordinator actor is the store")
    _refuse_pg_options(pg_options, "init_process_group")
    _check_device_id(device_id, "init_process_group")
    if group_name == "":  # torch's default: the default group's name
        group_name = _DEFAULT_NAME
    if not isinstance(group_name, str) or not group_name or "/" in group_name:
        raise ValueError(f"group_name must be a str without '/', got {group_name!r}")
    size = _int_arg(world_size, "world_size", "WORLD_SIZE")
    me = _int_arg(rank, "rank", "RANK")
    if size < 1:
        raise ValueError(f"world_size must be >= 1, got {size}")
    if not 0 <= me < size:
        raise ValueError(f"rank={me} is out of range for world_size={size}")
    seconds = float(to_seconds(timeout, DEFAULT_TIMEOUT_S) or DEFAULT_TIMEOUT_S)
    backend_config(backend)  # reject a bad backend string before anything is sent
    w = world()
    w.drop_ended()  # groups of a Ray session that has ended (this process restarted Ray)
    with w.lock:
        default = w.default
        if default is not None and group_name in (_DEFAULT_NAME, default.name):
            raise ValueError(
                "trying to initialize the default process group twice! (this process's default "
                f"group is {default.name!r}, formed by raycoll.spawn, create_group or an earlier "
                "init_process_group: use it as it is, destroy_process_group() it first, or pass "
                "another group_name= to form one more named group)")
        if group_name in w.groups:
            raise ValueError(f"group {group_name!r} is already initialized in this process; "
                             "destroy_process_group() it first")
    return join_named_group(group_name, size, me, backend, seconds)


def join_named_group(group_name: str, size: int, rank: int, backend: Optional[str],
                     seconds: float, make_default: Optional[bool] = None) -> ProcessGroup:
    """Rendezvous by name as ``rank`` of ``size`` in root group ``group_name`` (its coordinator
    started by the first rank to arrive), with arguments already checked. The group becomes
    this process's default group if it has none (``make_default=None``). What
    :func:`init_process_group` and :func:`raycoll.util.collective.init_collective_group` do
    once they have checked their arguments."""
    w = world()
    if not ray.is_initialized():
        from raycoll.launch import start_ray

        start_ray()
    job = ray.get_runtime_context().get_job_id()
    if make_default is None:
        with w.lock:
            make_default = w.default is None
    attempts = _RENDEZVOUS_ATTEMPTS
    while True:
        # a group the driver formed under this name (then this rank is refused, as one
        # that was not made part of it), else the group's own coordinator, by name
        handle = spare.claimed(job, group_name) or start_coordinator(
            group_name, size, coordinator_name(job, group_name), get_if_exists=True)
        spec = GroupSpec(group_name, size, backend, seconds, handle, by_name=True)
        try:
            return join_root_group(spec, rank, make_default=make_default)
        except errors.CoordinatorDiedError:
            # The previous generation's last rank stopped this coordinator as we arrived:
            # nothing was joined yet, so rendezvous again with a fresh one.
            attempts -= 1
            if attempts == 0:
                raise


_RENDEZVOUS_ATTEMPTS = 3
_DEFAULT_NAME = "default"  # init_process_group's group_name when none is given


def destroy_process_group(group: GroupLike = None) -> None:
    """Destroy ``group`` (and its subgroups) in this process; ``None``: every group here.

    A group formed in a Ray session that has since ended (``ray.shutdown()``, or a new
    ``ray.init()``, in this process) was already forgotten: destroying it does nothing."""
    w = world()
    w.drop_ended()
    if group is None:
        with w.lock:
            roots = [pg for pg in w.groups.values() if "/" not in pg.name]
        for pg in roots:
            _leave(pg)
        return
    if isinstance(group, _NonMember):
        return
    target: Union[ProcessGroup, _NonMember]
    if isinstance(group, (str, ProcessGroup)) and w.ended(group):
        logger.debug("raycoll: destroy_process_group(%r): %s; nothing to do", group, ENDED)
        return
    if isinstance(group, str):  # by name, without the usability check: broken groups too
        with w.lock:
            found = w.groups.get(group)
        target = found if found is not None else w.resolve(group)  # raises: no such group
    else:
        target = group if isinstance(group, ProcessGroup) else w.resolve(group)
    if isinstance(target, ProcessGroup):
        _leave(target)


def _leave(pg: ProcessGroup) -> None:
    world().remove(pg.name, "destroy_process_group() was called")
    if "/" in pg.name:
        return
    client = pg.client
    try:  # a by-name group's coordinator, once every rank left, lingers then stops itself
        client.leave(pg.rank())
    except Exception as exc:  # noqa: BLE001 - Ray refused the handle: nothing left to leave
        # a RaycollError (the coordinator is gone), or Ray's own when the coordinator's
        # handle is not valid any more
        logger.debug("raycoll: leaving group %r: the coordinator is gone (%s: %s)", pg.name,
                     type(exc).__name__, exc)



def is_initialized() -> bool:
    """True when this process has a default group (of the Ray session connected now)."""
    w = world()
    w.drop_ended()
    return w.default is not None


def get_group(name: str) -> ProcessGroup:
    """The ``ProcessGroup`` named ``name`` in this process."""
    pg = world().resolve(name)
    if isinstance(pg, _NonMember):  # pragma: no cover - names never resolve to non-members
        raise errors.GroupNotFoundError(f"this process is not a member of group {name!r}")
    return pg


def is_available() -> bool:
    """True: raycoll's collectives are available wherever it imports (torch's
    ``is_available``)."""
    return True


def _member_or_invalid(group: GroupLike) -> ProcessGroup:
    pg = _default() if group is None else _member(group)
    if isinstance(pg, _NonMember):
        raise ValueError("Invalid process group specified")
    return pg


def get_backend(group: GroupLike = None) -> str:
    """The backend string ``group`` (default: the default group) was formed with, lower case,
    ``"undefined"`` when none was given, as torch's ``get_backend``; a subgroup formed without
    ``backend=`` reports its parent's. ValueError on a non-member."""
    return _member_or_invalid(group).backend_name


def get_backend_config(group: GroupLike = None) -> str:
    """The device -> backend map ``group`` uses, as ``"cpu:objstore,cuda:nccl"`` (torch's
    ``get_backend_config``; raycoll's real backends, also for a group asked for as
    ``"gloo"``). ValueError on a non-member."""
    mapping = _member_or_invalid(group).backend_config.get_device_backend_map()
    return ",".join(f"{device}:{name}" for device, name in mapping.items())


def get_node_local_rank(fallback_rank: Optional[int] = None) -> int:
    """This process's rank among the ranks on its node, from ``LOCAL_RANK`` (which
    :func:`raycoll.spawn` sets, as torchrun does), else ``fallback_rank``, else RuntimeError
    (torch's ``get_node_local_rank``)."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "LOCAL_RANK is not in the environment. Consider passing fallback_rank to allow "
        "`get_node_local_rank` to work, assuming you are not running in a multi-device "
        "context and want the code to run locally instead.")


def _member(group: GroupLike) -> Union[ProcessGroup, _NonMember]:
    return world().resolve(group)


def get_rank(group: GroupLike = None) -> int:
    """This process's rank in ``group`` (-1 if it is not a member, as in torch)."""
    pg = _member(group)
    return -1 if isinstance(pg, _NonMember) else pg.rank()


def get_world_size(group: GroupLike = None) -> int:
    """The number of ranks in ``group`` (-1 if this process is not a member, as in torch)."""
    pg = _member(group)
    return -1 if isinstance(pg, _NonMember) else pg.size()


def get_process_group_ranks(group: GroupLike) -> List[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    pg = _member(group)
    if isinstance(pg, _NonMember):
        raise ValueError("this process is not a member of the group")
    return list(pg.global_ranks)


def get_group_rank(group: GroupLike, global_rank: int) -> int:
    """The group rank of ``global_rank`` in ``group``."""
    pg = _member(group)
    if isinstance(pg, _NonMember):
        raise ValueError("this process is not a member of the group")
    if global_rank not in pg.global_ranks:
        raise ValueError(f"global rank {global_rank} is not part of group {pg.name!r} "
                         f"(its global ranks: {list(pg.global_ranks)})")
    return pg.global_ranks.index(global_rank)


def get_global_rank(group: GroupLike, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group``."""
    pg = _member(group)
    if isinstance(pg, _NonMember):
        raise ValueError("this process is not a member of the group")
    if not isinstance(group_rank, int) or not 0 <= group_rank < pg.size():
        raise ValueError(f"group_rank={group_rank!r} is out of range for group {pg.name!r} of "
                         f"size {pg.size()}")
    return pg.global_ranks[group_rank]


def _default() -> ProcessGroup:
    pg = world().resolve(None)
    if not isinstance(pg, ProcessGroup):  # pragma: no cover - the default is always a member
        raise errors.GroupNotFoundError("no default group")
    return pg


def new_group(ranks: Optional[Sequence[int]] = None, timeout: Any = None, backend: Optional[str] = None,
              pg_options: Any = None, use_local_synchronization: bool = False,
              group_desc: Optional[str] = None, device_id: Any = None, sort_ranks: bool = True,
              group: GroupLike = None) -> Union[ProcessGroup, _NonMember, None]:
    """A subgroup of the default group (or of ``group``) with the given global ``ranks``.

    As in torch, every rank of the parent should call it, in the same order as the other
    ranks; ranks outside the subgroup get ``GroupMember.NON_GROUP_MEMBER``, or ``None`` with
    ``use_local_synchronization=True`` (then, as in torch, non-members need not call it). No
    communication is needed: members derive the same name and share the parent's
    coordinator. ``sort_ranks=False`` keeps the order of ``ranks`` as the group ranks;
    ``group_desc`` is kept as the group's ``group_desc``; ``device_id`` may be a CPU device
    or this rank's GPU (see :func:`init_process_group`); ``pg_options`` raises ValueError:
    raycoll's backends take no process-group options.
    """
    _refuse_pg_options(pg_options, "new_group")
    _check_device_id(device_id, "new_group")
    parent = _default() if group is None else _member(group)
    if isinstance(parent, _NonMember):
        raise ValueError("new_group: this process is not a member of the parent group")
    me = parent.global_ranks[parent.rank()]
    if use_local_synchronization and ranks is not None and me not in ranks:
        return None  # torch's answer to a non-member under local synchronization
    if ranks is None or len(ranks) == 0:
        members = list(parent.global_ranks)
    else:
        members = []
        for r in ranks:
            if not isinstance(r, int) or isinstance(r, bool):
                raise TypeError(f"ranks must be ints, got {r!r}")
            if r not in parent.global_ranks:
                raise ValueError(f"rank {r} is not in the parent group {parent.name!r} "
                                 f"(its ranks: {list(parent.global_ranks)})")
            members.append(r)
        if len(set(members)) != len(members):
            raise ValueError(f"ranks must be unique, got {list(ranks)}")
        if sort_ranks:
            members.sort()
    if group_desc is not None and not isinstance(group_desc, str):
        raise TypeError(f"group_desc must be a str or None, got {group_desc!r}")
    seconds = to_seconds(timeout, None)
    if backend is not None:
        backend_config(backend)
    return make_subgroup(parent, members, seconds, backend, group_desc=group_desc)


def _refuse_pg_options(pg_options: Any, where: str) -> None:
    if pg_options is not None:
        raise ValueError(f"{where}: pg_options={pg_options!r} cannot be honoured: raycoll's "
                         "backends take no process-group options (torch's gloo/NCCL Options); "
                         "pass None")


def _check_device_id(device_id: Any, where: str) -> None:
    """torch's ``device_id`` binds the process to one device. raycoll binds each rank to the
    GPU Ray assigned it (``actor_options={"num_gpus": 1}``), so a CPU device, or that GPU, is
    accepted (nothing more to bind) and any other device refused."""
    if device_id is None:
        return
    index: Optional[int]
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        kind, index = "cuda", device_id  # torch: an int is an accelerator index
    elif isinstance(device_id, str) or hasattr(device_id, "type"):
        text = str(device_id)
        kind, _, tail = text.partition(":")
        index = int(tail) if tail.isdigit() else None
        if tail and index is None:
            raise ValueError(f"{where}: device_id={device_id!r} is not a device")
    else:
        raise TypeError(f"{where}: device_id must be a torch.device, a device string, an int or "
                        f"None, got {device_id!r}")
    if kind == "cpu":
        return
    if kind != "cuda":
        raise ValueError(f"{where}: device_id={device_id!r}: raycoll serves cpu and cuda devices")
    if index is None:
        raise ValueError(f"{where}: Please use a device_id with index (got {device_id!r}).")
    from raycoll.backends._cuda import ray_assigned_device

    assigned = ray_assigned_device()
    if assigned != index:
        mine = "no GPU" if assigned is None else f"cuda:{assigned}"
        raise ValueError(
            f"{where}: device_id={device_id!r} cannot be honoured: raycoll binds each rank to "
            f"the GPU Ray assigned it, and this rank has {mine} (start the ranks with "
            "actor_options={'num_gpus': 1}, and pass that device or no device_id)")


def new_subgroups(group_size: Optional[int] = None, group: GroupLike = None, timeout: Any = None,
                  backend: Optional[str] = None, pg_options: Any = None,
                  group_desc: Optional[str] = None
                  ) -> Tuple[Union[ProcessGroup, _NonMember], List[Union[ProcessGroup, _NonMember]]]:
    """Split the parent group into equal subgroups of ``group_size`` consecutive ranks.

    ``group_size=None`` groups the ranks that share this rank's node (count taken from the
    coordinator's view). Returns ``(this rank's subgroup, all subgroups)``.
    """
    _refuse_pg_options(pg_options, "new_subgroups")
    parent = _default() if group is None else _member(group)
    if isinstance(parent, _NonMember):
        raise ValueError("new_subgroups: this process is not a member of the parent group")
    size = parent.size()
    if group_size is None:
        nodes = parent.node_ids
        group_size = nodes.count(nodes[parent.rank()])
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise TypeError(f"group_size must be an int or None, got {group_size!r}")
    if group_size <= 0:  # torch's messages
        raise ValueError(f"The arg 'group_size' ({group_size}) must be positive")
    if size < group_size:
        raise ValueError(f"The arg 'group_size' ({group_size}) must not exceed the world size "
                         f"({size})")
    if size % group_size:
        raise ValueError(f"The world size ({size}) must be divisible by '{group_size=}'")
    ranks = list(parent.global_ranks)
    lists = [ranks[start:start + group_size] for start in range(0, size, group_size)]
    mine, subgroups = _by_enumeration(parent, lists, timeout, backend, group_desc)
    return (NON_GROUP_MEMBER if mine is None else mine), subgroups


Subgroups = Tuple[Optional[Union[ProcessGroup, _NonMember]], List[Union[ProcessGroup, _NonMember]]]


def new_subgroups_by_enumeration(ranks_per_subgroup_list: Sequence[Sequence[int]],
                                 timeout: Any = None, backend: Optional[str] = None,
                                 pg_options: Any = None,
                                 group_desc: Optional[str] = None) -> Subgroups:
    """Subgroups of the default group with the given global ranks, which must not overlap
    (torch's). Every rank calls it alike; returns ``(this rank's subgroup, or None if it is in
    none, all subgroups)`` (``NON_GROUP_MEMBER`` where this rank is not a member). Overlapping
    lists raise ValueError before any group is made."""
    _refuse_pg_options(pg_options, "new_subgroups_by_enumeration")
    return _by_enumeration(_default(), ranks_per_subgroup_list, timeout, backend, group_desc)


def _by_enumeration(parent: ProcessGroup, lists: Sequence[Sequence[int]], timeout: Any,
                    backend: Optional[str], group_desc: Optional[str]) -> Subgroups:
    if lists is None or len(lists) == 0:
        raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty")
    seen: Dict[int, List[int]] = {}
    for ranks in lists:  # checked before any group is made
        for r in ranks:
            if not isinstance(r, int) or isinstance(r, bool) or r not in parent.global_ranks:
                raise ValueError(f"ranks_per_subgroup_list: {r!r} is not a rank of group "
                                 f"{parent.name!r} (its ranks: {list(parent.global_ranks)})")
            if r in seen:
                raise ValueError(f"Rank {r} has appeared in both subgroup {seen[r]} and "
                                 f"{list(ranks)}")
            seen[r] = list(ranks)
    me = parent.global_ranks[parent.rank()]
    mine: Optional[Union[ProcessGroup, _NonMember]] = None
    subgroups: List[Union[ProcessGroup, _NonMember]] = []
    for ranks in lists:
        sub = new_group(ranks, timeout=timeout, backend=backend, group_desc=group_desc,
                        group=parent)
        assert sub is not None  # None only under use_local_synchronization
        subgroups.append(sub)
        if me in ranks:
            mine = sub
    return mine, subgroups


def split_group(parent_pg: GroupLike = None, split_ranks: Optional[Sequence[Sequence[int]]] = None,
                timeout: Any = None, pg_options: Any = None, group_desc: Optional[str] = None,
                backend: Optional[str] = None) -> Optional[ProcessGroup]:
    """torch's ``split_group``: ``split_ranks`` lists disjoint sets of *group* ranks of
    ``parent_pg`` (default: the default group); this rank gets the subgroup of the set it is
    in (group ranks in sorted order), or ``None`` if it is in none. Every rank of the parent
    calls it alike. torch needs a device-bound NCCL parent; raycoll's subgroups need no
    communicator to split, so any raycoll group splits, CPU and GPU alike. ``backend`` keeps a
    subset of the parent's per-device backends (each named device with the parent's name for
    it); ``pg_options`` raises ValueError."""
    _refuse_pg_options(pg_options, "split_group")
    if split_ranks is None or len(split_ranks) == 0:
        raise ValueError("split_ranks cannot be None or empty")
    parent = _default() if parent_pg is None else _member(parent_pg)
    if isinstance(parent, _NonMember):
        me = world().default
        raise ValueError(f"Global rank {me.global_ranks[me.rank()] if me else '?'} is not part "
                         "of the parent group")
    size = parent.size()
    mine: Optional[List[int]] = None
    seen: Dict[int, List[int]] = {}
    for ranks in split_ranks:
        if len(ranks) == 0:
            raise ValueError("the split group cannot be empty")
        if len(ranks) > size:
            raise ValueError("the split group's size should be less or equal to the world_size "
                             "set by init_process_group")
        if len(ranks) != len(set(ranks)):
            raise ValueError("the split group cannot have duplicate ranks")
        for r in ranks:
            if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < size:
                raise ValueError(f"split_ranks: {r!r} is not a group rank of the parent group "
                                 f"{parent.name!r} (0..{size - 1})")
            if r in seen:
                raise ValueError(f"split_ranks: group rank {r} is in both {seen[r]} and "
                                 f"{list(ranks)}; the splits must not overlap")
            seen[r] = list(ranks)
        if parent.rank() in ranks and mine is None:
            mine = sorted(ranks)
    child = _split_backend(parent, backend)
    if mine is None:
        return None
    members = [parent.global_ranks[r] for r in mine]
    sub = make_subgroup(parent, members, to_seconds(timeout, None), child, group_desc=group_desc)
    return sub if isinstance(sub, ProcessGroup) else None


def _split_backend(parent: ProcessGroup, backend: Optional[str]) -> Optional[str]:
    """``split_group``'s ``backend``: a subset of the parent's device map, checked."""
    if backend is None:
        return None
    have = parent.backend_config.get_device_backend_map()
    for device, name in backend_config(backend).get_device_backend_map().items():
        if device not in have:
            raise ValueError(f"Requested backend for device '{device}' is not present in the "
                             f"parent process group (parent backends: {have})")
        if have[device] != name:
            raise ValueError(f"Backend mismatch for device '{device}': parent has "
                             f"'{have[device]}', requested '{name}'. Backend names must match "
                             "exactly when filtering split_group backends.")
    return backend


def get_pg_count() -> int:
    """How many process groups this process holds now (its default group and the others it
    formed or joined, subgroups included)."""
    w = world()
    with w.lock:
        return len(w.groups)
