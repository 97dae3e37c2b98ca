"""``group_status``: where every rank of a group is, from its coordinator (driver side).

For a notebook or a hung job: asks the group's coordinator what each rank did last, who
waits, who joined a ``Join``, and (on direct connections) each rank's counters. The
coordinator is the one this process formed the group with (:data:`raycoll.launch.DRIVER_GROUPS`,
of the Ray session connected now), the one of a group this process is a rank of, or, by
name, the one the ranks started themselves in this Ray job.
"""

from __future__ import annotations

import time
from typing import Any, Dict


from raycoll import errors, session
from raycoll.coordinator import CoordinatorClient, spare
from raycoll.launch import DRIVER_GROUPS
from raycoll.transport.base import REPORT_EVERY_S
from raycoll.world import world

__all__ = ["group_status"]

#: How long group_status waits for the coordinator's answer.
_ASK_S = 10.0
#: The longest group_status waits for late progress reports of a round transport.
_STATUS_WAIT_MAX_S = 5.0


def group_status(group_name: str = "default") -> Dict[str, Any]:
    """Where every rank of a group is, from its coordinator: for a notebook or a hung job.

    Works for groups made with :func:`create_group` or :func:`spawn` from this process, for
    groups this process is a rank of, and, by name, for groups the ranks formed themselves
    with ``init_process_group`` in this Ray job. A subgroup's name (``"dp/0-1#0"``) gives
    that subgroup's view. Returns::

        {
          "group": "dp", "world_size": 4, "generation": 0,
          "broken": None,            # or the error that broke the group
          "transport": "tcp",        # its round transport ("lane", "tcp"), None before one
          "algorithms": {"all_reduce": "hierarchical", ...},  # the last one each collective
                                     # ran with on direct connections (the cost model's pick)
          "ranks": {                 # by global rank
            0: {"last_collective": ("all_reduce", 12), "waiting": True, "joined": False,
                "counters": {...}},  # on direct connections: ProcessGroup.counters()
            3: {"last_collective": ("join", 12), "waiting": True, "joined": True},
            ...                      # last_collective is None before the first collective
          },
          "joined": [3],             # ranks that joined the Join in progress, in join order
          "last_join": None,         # or {"join_order", "last_joiners", "final_seq",
                                     #      "terminated_early"} of the last finished Join
          "subgroups": {name: {"ranks", "joined", "last_join", "broken"}},
          "summary": "rank 0: waiting in all_reduce #12\n...",
        }

    ``waiting`` means the rank has arrived at ``last_collective`` and it has not completed
    (others are missing); a joined rank shadows the others' collectives until all have
    joined.

    Raises :class:`~raycoll.errors.GroupNotFoundError` for a name with no group in this Ray
    session (also one of a session that has ended), :class:`~raycoll.errors.RaySessionError`
    when Ray is not initialized, :class:`~raycoll.errors.CoordinatorDiedError` when the
    group's coordinator is gone.
    """
    root = group_name.split("/", 1)[0]
    world().drop_ended()
    with world().lock:
        mine = [pg for name, pg in world().groups.items()
                if name == root or name.startswith(root + "/")]
    for pg in mine:  # this process is a rank: what its lane knows goes first
        pg.report_progress(wait_s=_ASK_S)
    client = _status_client(root)
    raw = client.status(_ASK_S, where={"op": "group_status", "group": root})
    periods = [g.get("report_period_s") or REPORT_EVERY_S for g in raw.get("groups",
                                                                              {}).values()
               if isinstance(g, dict) and g.get("transport")]
    if periods:
        # ranks report their round transport's collectives at most a period late (a node's
        # ranks share one period's worth of reports): ask again after the longest
        time.sleep(min(max(periods), _STATUS_WAIT_MAX_S) + 0.05)
        raw = client.status(_ASK_S, where={"op": "group_status", "group": root})
    groups = raw.get("groups", {})
    view = _group_view(group_name, groups.get(group_name, {}),
                       range(raw["world_size"]) if group_name == root else ())
    out: Dict[str, Any] = {"group": group_name, "world_size": len(view["ranks"]),
                           "generation": raw.get("generation"), **view}
    if group_name == root:
        out["subgroups"] = {k: _group_view(k, v, ()) for k, v in groups.items()
                            if k.startswith(root + "/")}
    out["summary"] = _summary(out)
    return out


def _status_client(root: str) -> CoordinatorClient:
    """The coordinator of root group ``root``: created here, joined here, or found by name."""
    now = session.current()
    entry = DRIVER_GROUPS.get(root, now)
    if entry is not None and entry.spec.coordinator is not None:
        return CoordinatorClient(entry.spec.coordinator, root)
    with world().lock:
        pg = world().groups.get(root)
    if pg is not None:
        return pg.client
    ended = DRIVER_GROUPS.ended(root, now) or world().ended(root)
    if now is None:
        raise errors.RaySessionError(
            f"group_status({root!r}): Ray is not initialized in this process"
            + (" (the group's Ray session has ended)" if ended else "")
            + "; call ray.init() and form the group again")
    found = spare.find(now[1], root)
    if found is not None:
        return CoordinatorClient(found, root)
    if ended:
        raise errors.GroupNotFoundError(
            f"group_status({root!r}): the group was formed in a Ray session that has ended "
            "(ray.shutdown() or a new ray.init() since); form it again in this session")
    raise errors.GroupNotFoundError(
        f"group_name={root!r}: no such group in this Ray job (none was created from this "
        "process under that name, this process is not one of its ranks, and no coordinator "
        f"of that name is running); groups created here: {DRIVER_GROUPS.names(now)}")


def _group_view(name: str, raw: Dict[Any, Any], all_ranks: Any) -> Dict[str, Any]:
    """The friendly per-rank view of one group's entry of ``Coordinator.status``."""
    ranks: Dict[int, Dict[str, Any]] = {}
    for g in sorted(set(all_ranks) | {k for k in raw if isinstance(k, int)}):
        info = raw.get(g, {})
        current, done = info.get("current"), info.get("last_completed")
        # the newer of the two (a rank's lane collectives update only last_completed)
        waiting = current is not None and (done is None or tuple(current) != tuple(done)
                                           and current[1] >= done[1])
        last = current if waiting else done
        ranks[g] = {"last_collective": tuple(last) if last else None,
                    "waiting": waiting,
                    "joined": bool(info.get("joined", False))}
        if "counters" in info:  # reported with its progress on direct connections
            ranks[g]["counters"] = info["counters"]
    join = raw.get("join") or {}
    # every rank chooses alike: the lowest reporting rank speaks for the group
    algorithms = next((dict(raw[g]["algorithms"]) for g in sorted(ranks)
                       if isinstance(raw.get(g), dict) and raw[g].get("algorithms")), {})
    return {"ranks": ranks, "joined": list(join.get("joined", [])),
            "last_join": join.get("last"), "broken": raw.get("broken"),
            "transport": raw.get("transport"), "algorithms": algorithms}


def _summary(status: Dict[str, Any]) -> str:
    lines = [f"group {status['group']!r}: {status['world_size']} ranks"
             + (f" on {status['transport']}" if status.get("transport") else "")
             + (f", BROKEN: {status['broken']}" if status.get("broken") else "")]
    if status.get("algorithms"):
        lines.append("algorithms: " + ", ".join(f"{c} {a}" for c, a in
                                                sorted(status["algorithms"].items())))
    for g, info in status["ranks"].items():
        last = info["last_collective"]
        if last is None:
            where = "no collective yet"
        else:
            where = f"{'waiting in' if info['waiting'] else 'done with'} {last[0]} #{last[1]}"
        lines.append(f"rank {g}: {where}" + (" (joined: shadowing the others)"
                                             if info["joined"] else ""))
    return "\n".join(lines)
