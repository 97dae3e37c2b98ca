"""How a group's ranks sit on their machines' cores: whether a wait may spin.

Ranks that outnumber their node's cores must not spin while they wait (a spinning rank takes
the core of the peer it waits for). Every rank of a node decides alike from what it knows
alike: the node's CPU count and the group's ranks on it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, AbstractSet, Dict, Hashable, Tuple, Union

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.context import GroupContext

__all__ = ["node_cores", "oversubscribed", "on_one_host", "host_ranks", "group_machines"]


def node_cores() -> int:
    """The node's CPU count: the same on every rank of a node (unlike a process's affinity),
    so ranks that decide something from it decide alike."""
    return os.cpu_count() or 1


def oversubscribed(size: int) -> bool:
    """Whether ``size`` ranks on one node outnumber its cores: then they must not spin while
    they wait (a spinning rank takes the core of the peer it waits for)."""
    return size > node_cores()


def on_one_host(ctx: "GroupContext") -> bool:
    """Whether all of group ``ctx``'s ranks run on one machine: one Ray node, or Ray nodes
    whose ranks' addresses are all one host. Only then does every rank know the same core
    count (see :func:`oversubscribed`)."""
    if ctx.single_node:
        return True
    hosts = {a[0] if a else None for a in ctx.addresses}
    return len(hosts) == 1 and None not in hosts


def host_ranks(ctx: "GroupContext") -> int:
    """The group's ranks on this rank's machine (Ray nodes may share one), the same on every
    rank of a node."""
    mine = ctx.addresses[ctx.rank]
    if not mine:
        here = ctx.node_ids[ctx.rank]
        return sum(1 for n in ctx.node_ids if n == here)
    return sum(1 for a in ctx.addresses if a and a[0] == mine[0])


def group_machines(ctx: "GroupContext"
                   ) -> Tuple[Tuple[Hashable, ...], Union[int, Dict[Hashable, int]]]:
    """Each of group ``ctx``'s ranks' machine and the machines' cores, as every rank sees
    them alike (the planner's ``hosts`` and ``cores``, :mod:`raycoll.algorithms.planner`):
    Ray nodes on one host share its CPUs (:func:`node_cores`); nodes on machines of their
    own have their Ray ``CPU`` resource (1 where Ray does not say). Asks Ray's GCS."""
    if on_one_host(ctx):
        return ("host",) * ctx.size, node_cores()
    return tuple(ctx.node_ids), _ray_cpus(set(ctx.node_ids))


def _ray_cpus(nodes: AbstractSet[str]) -> Dict[Hashable, int]:
    """The ``CPU`` resource of each of Ray's ``nodes`` (by node id; 1 where unknown)."""
    import ray

    try:
        listed = {n["NodeID"]: n.get("Resources", {}).get("CPU", 1)
                  for n in ray.nodes() if n["NodeID"] in nodes}
    except Exception:  # noqa: BLE001 - no GCS to ask: the former rule (one core a node)
        listed = {}
    return {node: max(1, int(listed.get(node, 1))) for node in nodes}
