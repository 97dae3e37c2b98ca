"""Elastic groups: the survivors of a failure go on (``shrink_group``), newcomers join a live
group (``grow_group`` from the driver, ``admit_new_ranks`` in every existing rank).

What is kept and what is not, when a root group changes its membership:

- **kept**: the group's coordinator actor (no new process: it moves the group to its next
  generation, :mod:`raycoll.coordinator.elastic`), its name, every member's record (node,
  listener address, actor handle: nothing is asked of Ray), the backend map, options and
  timeout, and each process's listener for direct connections;
- **made again**, lazily at the next generation's first collective: the links between ranks
  (direct connections, under a new secret: an excluded rank cannot connect any more), the
  node segment and the NCCL communicators (a new unique id through the coordinator).

Subgroups of a root group that shrinks or grows are destroyed on every rank that takes part
(their ranks were numbered in the old generation, as torch destroys every other group when
the default group shrinks); make them again with ``new_group`` on the new group. A subgroup
itself can be shrunk while its root group is healthy: that makes a subgroup of the kept
ranks, nothing more. Other root groups of the process are untouched.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Sequence

import ray
from ray.actor import ActorHandle

from raycoll import elastic_links, errors, session
from raycoll.backends import backend_config
from raycoll.coordinator import CoordinatorClient, coordinator_name, rank_info, spare
from raycoll.coordinator.client import GRACE_S, unpack_handle
from raycoll.launch import DRIVER_GROUPS
from raycoll.options import GroupOptions
from raycoll.process_group import GroupSpec, ProcessGroup
from raycoll.transport.links import listener
from raycoll.work import to_seconds
from raycoll.world import install_root_group, world

logger = logging.getLogger("raycoll")

__all__ = ["SHRINK_DEFAULT", "SHRINK_ABORT", "shrink_group", "admit_new_ranks", "grow_group"]

SHRINK_DEFAULT = 0x00
"""``shrink_group``'s default flag (torch's value): wait for this rank's calls queued on the
old group to end first (on a broken group they end at once)."""
SHRINK_ABORT = 0x01
"""``shrink_group``'s flag (torch's value) that aborts the old group first: every rank's calls
still waiting on it fail at once."""


def _target(group: Any, where: str) -> ProcessGroup:
    """The group ``group`` names, broken or not (a broken group is what one shrinks)."""
    w = world()
    with w.lock:
        if group is None:
            pg = w.default
        elif isinstance(group, str):
            pg = w.groups.get(group)
        else:
            pg = group if isinstance(group, ProcessGroup) else None
    if pg is None:
        w.resolve(group)  # raises the error that says why (destroyed, none, not a group)
        raise errors.GroupNotFoundError(f"{where}: this process is not a member of {group!r}")
    if pg._destroyed is not None:
        pg.check_usable()
    return pg


def _check_inputs(ranks_to_exclude: Any, shrink_flags: Any) -> None:
    """torch's first checks of ``shrink_group``'s arguments (before the group), with torch's
    messages."""
    if not isinstance(ranks_to_exclude, list):
        raise TypeError(f"ranks_to_exclude must be a list, but got "
                        f"{type(ranks_to_exclude).__name__}. Example: [1, 3, 5] to exclude "
                        "ranks 1, 3, and 5.")
    if not ranks_to_exclude:
        raise ValueError("ranks_to_exclude cannot be empty. To shrink a group, you must specify "
                         "at least one rank to exclude. Example: [failed_rank_id]")
    if not isinstance(shrink_flags, int) or shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
        raise ValueError(f"Invalid shrink_flags value: {shrink_flags}. Must be one of: "
                         f"SHRINK_DEFAULT ({SHRINK_DEFAULT}) or SHRINK_ABORT ({SHRINK_ABORT}). "
                         "Use SHRINK_ABORT to abort ongoing operations before shrinking.")


def _excluded(ranks_to_exclude: List[Any], size: int, me: int) -> List[int]:
    """torch's checks of ``ranks_to_exclude`` against the group, with torch's messages."""
    if size <= 1:
        raise ValueError(f"Cannot shrink a process group with size {size}. Group must have at "
                         "least 2 ranks to support shrinking.")
    seen: List[int] = []
    for i, rank in enumerate(ranks_to_exclude):
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError("All elements in ranks_to_exclude must be integers. Element at "
                            f"index {i} is {type(rank).__name__}: {rank}")
        if not 0 <= rank < size:
            raise ValueError(f"Rank {rank} at index {i} is out of bounds for group size {size}. "
                             f"Valid ranks are in range [0, {size - 1}].")
        if rank in seen:
            raise ValueError(f"Duplicate rank {rank} found in ranks_to_exclude at index {i}. "
                             "Each rank can only be excluded once.")
        seen.append(rank)
    if len(seen) >= size:
        raise ValueError(f"Cannot exclude all {size} ranks from process group. At least one "
                         f"rank must remain. Excluding {len(seen)} ranks.")
    if me in seen:
        raise RuntimeError(f"Current rank {me} is in the exclusion list and should not call "
                           "shrink_group(). Only non-excluded ranks should participate in the "
                           "shrinking operation. Excluded ranks should terminate their "
                           "processes instead.")
    return sorted(seen)


def shrink_group(ranks_to_exclude: List[int], group: Optional[ProcessGroup] = None,
                 shrink_flags: int = SHRINK_DEFAULT, pg_options: Optional[Any] = None
                 ) -> ProcessGroup:
    """torch's ``shrink_group``: a new group of ``group``'s ranks but ``ranks_to_exclude``
    (group ranks of ``group``, default: the default group), called by every rank kept and by
    no excluded one. The kept ranks are renumbered in order (``0 .. n-1``); the old group is
    destroyed on them, and the new one is the default group if the old one was.

    It works while every rank is alive and after a failure: a group broken because a rank
    died (every survivor got :class:`~raycoll.errors.RankFailedError`) shrinks without it.
    ``shrink_flags``: ``SHRINK_DEFAULT`` waits for this rank's calls queued on the old group
    to end (as they do at once on a broken group); ``SHRINK_ABORT`` fails them first, on every
    rank. ``pg_options`` must be ``None`` (raycoll's backends take no options).

    A root group keeps its name and its coordinator (see :mod:`raycoll.elastic` for what is
    kept and what is made again); its subgroups are destroyed. A subgroup (from
    ``new_group``) shrinks into a subgroup of the kept ranks of the same root group, while
    that root group is healthy (after a failure, shrink the root group). An excluded rank
    that is still alive must not use the old group any more (torch: it should exit); raycoll
    destroys the old group in that actor when it next runs a call. Blocks until every kept
    rank has called it, up to the group's timeout (then ``DistTimeoutError`` names the ranks
    that did not come; the old group stays destroyed on this rank)."""
    if pg_options is not None:
        raise ValueError(f"shrink_group: pg_options={pg_options!r} cannot be honoured: "
                         "raycoll's backends take no process-group options; pass None")
    _check_inputs(ranks_to_exclude, shrink_flags)
    pg = _target(group, "shrink_group")
    excluded = _excluded(ranks_to_exclude, pg.size(), pg.rank())
    kept = [r for r in range(pg.size()) if r not in excluded]
    _settle(pg, shrink_flags, f"shrink_group(ranks_to_exclude={excluded}) was called")
    if pg._parent is not None:
        return _shrink_subgroup(pg, kept)
    return _shrink_root(pg, excluded, kept)


def _settle(pg: ProcessGroup, flags: int, why: str) -> None:
    """End this rank's calls on ``pg`` before it changes: abort them (``SHRINK_ABORT``, on
    every rank) or wait for them, within the group's timeout."""
    if flags == SHRINK_ABORT:
        if pg._broken is None:
            pg._broken = errors.GroupBrokenError(f"group {pg.name!r} was aborted: {why}",
                                                 group=pg.name)
        pg.client.submit_abort(pg.name, "aborted", f"group {pg.name!r} was aborted: {why}", {},
                               pg._root.generation)
        return  # closing the group ends this rank's calls in flight
    deadline = time.monotonic() + pg.timeout_s
    while pg.outstanding() and time.monotonic() < deadline:
        time.sleep(0.001)


def _config(pg: ProcessGroup) -> Dict[str, Any]:
    """What a root group's ranks use, handed to newcomers by the coordinator."""
    return {"backend": pg._backend_name, "timeout_s": pg.timeout_s,
            "options": pg._root.options, "by_name": pg._root.by_name}


def _spec(pg: ProcessGroup) -> GroupSpec:
    root = pg._root
    return GroupSpec(pg.name, pg.size(), pg._backend_name, pg.timeout_s, root.client.handle,
                     root.options, root.by_name)


def _shrink_root(pg: ProcessGroup, excluded: List[int], kept: List[int]) -> ProcessGroup:
    root, me = pg._root, pg.rank()
    was_default = pg.is_default
    old_members = list(root.members)  # (also keeps the handles unpacked: read from the cache)
    mine = elastic_links.offer(pg, kept, take=True)  # (out of the old links before they close)
    world().remove(pg.name, f"shrink_group: replaced by the group of ranks {kept}")
    client = CoordinatorClient(root.client.handle, pg.name)
    try:
        info = client.reconfigure("shrink", root.generation, me, kept.index(me), len(kept),
                                  tuple(excluded), None, _config(pg), pg.timeout_s,
                                  hand=mine.report)
    except BaseException:
        elastic_links.discard(mine)
        raise
    conns, seq = elastic_links.settle(mine, info)
    desc = "default:shrunken" if was_default else f"{pg.name}:shrunk"
    new = install_root_group(_spec(pg), kept.index(me), client, info, pg.backend_config,
                             make_default=was_default, group_desc=desc)
    elastic_links.adopt(new, conns, seq)
    if kept.index(me) == 0:  # the excluded ranks still alive drop the old generation
        for r in excluded:
            _tell_excluded(old_members[r].get("actor"), pg.name, root.generation)
    logger.debug("raycoll: group %r shrank to %d ranks (generation %d)", pg.name, len(kept),
                 new._root.generation)
    return new


def _drop_generation(actor_self: Any, name: str, generation: int) -> None:
    """Runs in an excluded rank that is still alive: destroy its handle on ``name``'s
    ``generation``."""
    w = world()
    with w.lock:
        pg = w.groups.get(name)
    if pg is not None and pg._root.generation == generation:
        w.remove(name, f"this rank was excluded from group {name!r} by shrink_group on the "
                 "other ranks")


def _tell_excluded(actor: Any, name: str, generation: int) -> None:
    if actor is None:
        return
    try:  # (the roster keeps handles packed: raycoll.world.install_root_group)
        unpack_handle(actor).__ray_call__.remote(_drop_generation, name, generation)
    except Exception:  # noqa: BLE001 - a dead actor's handle may refuse the call
        logger.debug("raycoll: could not tell an excluded rank of %r", name, exc_info=True)


def _shrink_subgroup(pg: ProcessGroup, kept: List[int]) -> ProcessGroup:
    members = [pg.global_ranks[r] for r in kept]
    name = f"{pg.name}~{'-'.join(map(str, members))}"
    parent, me = pg._parent, kept.index(pg.rank())
    world().remove(pg.name, f"shrink_group: replaced by subgroup {name!r}")
    new = ProcessGroup(name=name, rank=me, global_ranks=members, root=pg._root,
                       config=pg.backend_config, timeout_s=pg.timeout_s, parent=parent,
                       backend_name=pg._backend_name, group_desc=f"{pg.name}:shrunk")
    world().add(new, make_default=False)
    return new


# ---------------------------------------------------------------------------- grow
def admit_new_ranks(group: Any = None, timeout: Any = None) -> ProcessGroup:
    """The existing ranks' side of :func:`grow_group`: every rank of root group ``group``
    (default: the default group) calls it, at a call boundary of its own choice, while the
    driver's ``grow_group`` brings the newcomers in. Returns the grown group (same name, same
    rank, the new world size; the default group if the old one was); the old handle and its
    subgroups are destroyed. Blocks until every existing rank and every newcomer has arrived,
    up to ``timeout`` (default: the group's); on a timeout the old group stays usable here
    (``DistTimeoutError`` names who did not come). A broken group must shrink first."""
    pg = _target(group, "admit_new_ranks")
    pg.check_usable()
    if pg._parent is not None:
        raise ValueError(f"admit_new_ranks: group {pg.name!r} is a subgroup; grow its root "
                         f"group {pg.root_name!r} and make the subgroup again")
    seconds = float(to_seconds(timeout, pg.timeout_s) or pg.timeout_s)
    _settle(pg, SHRINK_DEFAULT, "admit_new_ranks")
    root, me = pg._root, pg.rank()
    held = list(root.members)  # the peers' actor handles, unpacked: read again from the cache
    links = getattr(pg.context._transports, "links", None)
    if links is not None and links._listener is not None:  # no peer may reach the old
        links._listener.unregister(links)  # generation while the new one's links form
    mine = elastic_links.offer(pg, range(pg.size()), take=False)
    try:
        info = root.client.reconfigure("grow", root.generation, me, me, None, None, None,
                                       _config(pg), seconds, hand=mine.report)
    except BaseException:
        if links is not None and links._listener is not None:
            links._listener.register(links)
        raise
    conns, seq = elastic_links.settle(mine, info)  # (out of the old links before they close)
    was_default = pg.is_default
    world().remove(pg.name, "admit_new_ranks: replaced by the grown group")
    client = CoordinatorClient(root.client.handle, pg.name)
    grown = install_root_group(_spec(pg), me, client, info, pg.backend_config,
                               make_default=was_default, group_desc=pg._group_desc)
    elastic_links.adopt(grown, conns, seq)
    del held
    return grown


def _newcomer(actor_self: Any, name: str, coordinator: Any, index: int, count: int,
              timeout_s: float) -> List[Optional[str]]:
    """Runs in each new actor (through ``__ray_call__``): join group ``name`` as newcomer
    ``index`` of ``count`` (the coordinator gives it the next free rank). Returns the grown
    group's actor ids by rank."""
    client = CoordinatorClient(coordinator, name)
    where = listener()
    info = client.reconfigure("grow", None, None, 0, None, None,
                              rank_info(where.address if where else None), None, timeout_s,
                              joining=(index, count))
    size = len(info["members"])
    rank = size - count + index
    config = info.get("config") or {}
    spec = GroupSpec(name, size, config.get("backend"), float(config.get("timeout_s", timeout_s)),
                     coordinator, config.get("options") or GroupOptions(),
                     bool(config.get("by_name", False)))
    pg = install_root_group(spec, rank, client, info, backend_config(spec.backend))
    elastic_links.adopt(pg, {}, elastic_links.settle(None, info)[1])
    return [m.get("actor_id") for m in info["members"]]


def grow_group(group_name: str, new_actors: Sequence[ActorHandle], timeout: Any = None) -> None:
    """Driver side of growing a live group: ``new_actors`` join root group ``group_name``
    (formed with :func:`raycoll.create_group`, or by name with ``init_process_group``), taking
    the next ranks in list order, while every existing rank calls
    :func:`admit_new_ranks`. Returns once they are all in the grown group (then the new actors
    hold it as their default group if they had none, and as ``group=group_name``). Raises
    ``DistTimeoutError`` after ``timeout`` (default 5 minutes) naming who did not come, and
    ``GroupBrokenError`` at once where a rank of the group is dead (shrink it first). A
    shrink that starts while newcomers are coming goes first: the grow then fails on every
    rank, which stays in its group, and can be made again on the shrunk group."""
    if not isinstance(new_actors, (list, tuple)) or not new_actors:
        raise ValueError(f"new_actors must be a non-empty list of Ray actor handles, got "
                         f"{new_actors!r}")
    for i, actor in enumerate(new_actors):
        if not isinstance(actor, ActorHandle):
            raise TypeError(f"new_actors[{i}] must be a Ray actor handle, got "
                            f"{type(actor).__name__}")
    if len({a._actor_id.hex() for a in new_actors}) != len(new_actors):
        raise ValueError(f"grow_group({group_name!r}): new_actors must be distinct actors, got "
                         f"{len(new_actors)} handles of fewer actors")
    seconds = float(to_seconds(timeout, _GROW_TIMEOUT_S) or _GROW_TIMEOUT_S)
    now = session.require(f"grow_group(group_name={group_name!r})")
    entry = DRIVER_GROUPS.get(group_name, now)
    handle = entry.spec.coordinator if entry is not None else _by_name(now[1], group_name)
    # (one call into each newcomer, nothing asked first: the coordinator numbers them)
    refs = [a.__ray_call__.remote(_newcomer, group_name, handle, i, len(new_actors), seconds)
            for i, a in enumerate(new_actors)]
    after = _wait_newcomers(refs, group_name, seconds)
    if entry is not None:  # the driver's record: the actors in rank order, as they are now
        known = {a._actor_id.hex(): a for a in list(entry.actors) + list(new_actors)}
        entry.actors[:] = [known[i] for i in after if i in known]  # (members keep their ranks)


def _wait_newcomers(refs: List[Any], group_name: str, seconds: float) -> List[Optional[str]]:
    """Wait for the newcomers' joins (the coordinator bounds them by ``seconds``); a failed
    one raises its error (a dead actor: RankFailedError). Returns the grown group's actor ids
    by rank."""
    after: List[Optional[str]] = []
    for i, ref in enumerate(refs):
        try:
            after = ray.get(ref, timeout=seconds + GRACE_S)
        except ray.exceptions.GetTimeoutError as exc:
            raise errors.DistTimeoutError(
                f"grow_group({group_name!r}): new_actors[{i}] did not join within "
                f"{seconds + GRACE_S:g}s (a sync actor busy in another method cannot join until "
                "it returns)", group=group_name, op="grow_group") from exc
        except ray.exceptions.RayActorError as exc:
            raise errors.RankFailedError(
                f"grow_group({group_name!r}): the actor of new_actors[{i}] is dead",
                group=group_name) from exc
        except ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None
    return after


def _by_name(job: str, group_name: str) -> Any:
    handle = spare.claimed(job, group_name)
    if handle is not None:
        return handle
    try:
        return ray.get_actor(coordinator_name(job, group_name))
    except ValueError as exc:
        raise errors.GroupNotFoundError(
            f"grow_group: no live group {group_name!r} in this job (neither formed by "
            "create_group here nor by name with init_process_group)") from exc


_GROW_TIMEOUT_S = 300.0
