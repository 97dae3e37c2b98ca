"""Driver side: several root groups over the same actors, formed at once.

:func:`create_groups` is :func:`raycoll.create_group` for many names in one call (a "dp" and a
"tp" group, or one group per pipeline stage, over the same actors). Each group is a root
group of its own, with its own coordinator (so its own failures: a rank that dies fails the
calls of every group it is in, a group's error never touches another group's calls), but
the actors join them all in one call each (:func:`raycoll.world.join_root_groups`: every
group's rendezvous sent, then waited for together) instead of one call per actor and group.
Ray's per-call cost is what bulk formation spends its time on (a 2-core machine's
scheduler, the actors' and the coordinators' event loops), so eight groups at once cost
about what two formed one after another do.
"""

from __future__ import annotations

import time
from typing import Any, List, Optional, Sequence, Tuple

import ray
from ray.actor import ActorHandle

from raycoll import errors, session
from raycoll.backends import backend_config
from raycoll.coordinator import spare
from raycoll.launch import (DRIVER_GROUPS, _TEARDOWN_S, _DriverGroup, _check_actors, _check_name,
                            _kill, _submit)
from raycoll.options import GroupOptions, OptionsLike
from raycoll.process_group import DEFAULT_TIMEOUT_S, GroupSpec
from raycoll.work import to_seconds
from raycoll.world import join_root_groups

__all__ = ["create_groups"]


def _join_many(actor_self: Any, items: List[Tuple[GroupSpec, int]]
               ) -> List[Optional[BaseException]]:
    """Runs inside each actor (through ``__ray_call__``): join every group of ``items``."""
    return join_root_groups(items)


def create_groups(actors: Sequence[ActorHandle], group_names: Sequence[str],
                  backend: Optional[str] = None, timeout: Any = None,
                  options: OptionsLike = None) -> None:
    """Form root groups ``group_names`` at once, each among all of ``actors`` (rank = position
    in the list), as many :func:`~raycoll.create_group` calls would, in about the time of two.

    All or none: if any group cannot form (a dead actor, a timeout, a name taken), none is
    kept and the first failure is raised, as ``create_group`` raises it. Once formed, every
    group is independent: destroy them one by one with :func:`~raycoll.destroy_group`; a
    group's collectives, errors and coordinator are its own. ``backend``, ``timeout`` and
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
    taken: List[Tuple[str, spare.Spare]] = []
    try:
        for name in group_names:
            placeholder = _DriverGroup(GroupSpec(name, 0, backend, seconds, None), [])
            if not DRIVER_GROUPS.add(name, placeholder, now):
                raise ValueError(f"group {name!r} already exists; destroy_group({name!r}) "
                                 "first or pick another name")
            added.append(name)
        for name in group_names:
            coordinator = spare.take(now)
            if not spare.claim(now[1], name, coordinator):
                spare.put_back(coordinator, now)
                raise ValueError(f"group {name!r} already exists in this job")
            taken.append((name, coordinator))
        specs = [GroupSpec(name, len(actors), backend, seconds, c.handle, group_options)
                 for name, c in taken]
        refs = [_submit(a, rank, specs[0].name, _join_many, [(s, rank) for s in specs])
                for rank, a in enumerate(actors)]
        _wait_all(refs, [s.name for s in specs], seconds)
    except BaseException:
        for name in added:
            DRIVER_GROUPS.pop(name, now)
        for name, coordinator in taken:
            spare.unclaim(now[1], name)
            _kill(coordinator.handle)
        raise
    for spec, (name, coordinator) in zip(specs, taken):
        DRIVER_GROUPS.replace(name, _DriverGroup(spec, list(actors), coordinator), now)
    spare.refill(now)


def _wait_all(refs: List[Any], names: List[str], timeout_s: float) -> None:
    """Wait for every actor's joins; raise at the first failure of any group (a dead actor
    fails them all), or ``DistTimeoutError`` naming the actors that did not answer."""
    deadline = time.monotonic() + timeout_s + 5.0  # each rendezvous times out on its own
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1,
                                  timeout=max(deadline - time.monotonic(), 0.0))
        if not ready:
            break
        rank = refs.index(ready[0])
        try:
            outcomes = ray.get(ready[0], timeout=_TEARDOWN_S)
        except ray.exceptions.RayActorError as exc:
            raise errors.RankFailedError(
                f"create_groups({names!r}): the actor of rank {rank} is dead",
                failed_ranks=[rank], group=names[0]) from exc
        except ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None
        for outcome in outcomes:
            if outcome is not None:
                raise outcome
    if pending:
        missing = [rank for rank, ref in enumerate(refs) if ref in pending]
        raise errors.DistTimeoutError(
            f"create_groups({names!r}): ranks {missing} did not join within {timeout_s:g}s (a "
            "sync actor busy in another method cannot join until it returns)",
            missing=missing, group=names[0], op="create_groups")
