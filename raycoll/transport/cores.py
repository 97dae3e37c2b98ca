"""How a group's ranks sit on their machines' cores: whether a wait may spin.

Ranks that outnumber their node's cores must not spin while they wait (a spinning rank takes
the core of the peer it waits for). Every rank of a node decides alike from what it knows
alike: the node's CPU count and the group's ranks on it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.context import GroupContext

__all__ = ["node_cores", "oversubscribed", "on_one_host", "host_ranks"]


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
