"""Driver side: several root groups over the same actors, formed at once.

:func:`create_groups` is :func:`raycoll.create_group` for many names in one call (a "dp" and a
"tp" group, or one group per pipeline stage, over the same actors). Each group is a root
group of its own, with a coordinator of its own (so its own failures: a rank that dies fails
the calls of every group it is in, a group's error never touches another group's calls). The
groups' coordinators live in one process (:mod:`raycoll.coordinator.hosting`), and the driver
forms them all in one round (:mod:`raycoll.formation`): one call per actor installs every
group and takes one lease for all of them, one call gives the process every group's roster.
Eight groups over eight actors cost under twice one group's time (benchmarks/BENCHMARKS.md,
"Groups formed by their driver")."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from ray.actor import ActorHandle

from raycoll import session
from raycoll.backends import backend_config
from raycoll.coordinator import spare
from raycoll.launch import DRIVER_GROUPS, _DriverGroup, _check_actors, _check_name, form_groups
from raycoll.options import GroupOptions, OptionsLike
from raycoll.process_group import DEFAULT_TIMEOUT_S, GroupSpec
from raycoll.work import to_seconds

__all__ = ["create_groups"]


def create_groups(actors: Sequence[ActorHandle], group_names: Sequence[str],
                  backend: Optional[str] = None, timeout: Any = None,
                  options: OptionsLike = None) -> None:
    """Form root groups ``group_names`` at once, each among all of ``actors`` (rank = position
    in the list), as many :func:`~raycoll.create_group` calls would, in one round of calls.

    All or none: if any group cannot form (a dead actor, a timeout, a name taken), none is
    kept and the first failure is raised, as ``create_group`` raises it. Once formed, every
    group is independent: destroy them one by one with :func:`~raycoll.destroy_group`; a
    group's collectives, errors and coordinator are its own (the coordinators share one
    process, which goes when the last group is destroyed). ``backend``, ``timeout`` and
    ``options`` apply to every group, as ``create_group``'s.
    """
    _check_actors(actors)
    if not isinstance(group_names, (list, tuple)) or not group_names:
        raise ValueError("group_names must be a non-empty list of group names, got "
                         f"{group_names!r}")
    for name in group_names:
        _check_name(name)
    if len(set(group_names)) != len(group_names):
        raise ValueError(f"group_names must be distinct, got {list(group_names)!r}")
    backend_config(backend)
    group_options = GroupOptions.of(options)
    seconds = float(to_seconds(timeout, DEFAULT_TIMEOUT_S) or DEFAULT_TIMEOUT_S)
    now = session.require(f"create_groups(group_names={list(group_names)!r})")
    added: List[str] = []
    try:
        for name in group_names:
            placeholder = _DriverGroup(GroupSpec(name, 0, backend, seconds, None), [])
            if not DRIVER_GROUPS.add(name, placeholder, now):
                raise ValueError(f"group {name!r} already exists; destroy_group({name!r}) "
                                 "first or pick another name")
            added.append(name)
        formed = form_groups(actors, list(group_names), backend, seconds, group_options, now,
                             f"create_groups({list(group_names)!r})")
    except BaseException:
        for name in added:
            DRIVER_GROUPS.pop(name, now)
        raise
    for name, entry in zip(group_names, formed):
        DRIVER_GROUPS.replace(name, entry, now)
    spare.refill(now)
