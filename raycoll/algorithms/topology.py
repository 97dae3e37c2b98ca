"""A group's node map: which ranks share a node, and the link class between two ranks.

Built from one node id per group rank (Ray node ids in a real group; any hashable label in a
test). Nodes are numbered in the order they first appear in the rank list, so every rank that
holds the same list builds the same ``Topology``. Nodes of different sizes (3+1, 2+1+1) are
first-class: nothing here assumes the same number of ranks on every node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Sequence, Tuple

__all__ = ["LINK_CLASSES", "Topology"]

#: The link classes the cost model knows: ``unix`` (same node, a Unix socket) and ``tcp``
#: (across nodes), as the socket schedules move messages; and the native executor's
#: (:mod:`raycoll.algorithms.planner`): ``segment`` (a node segment's step and bytes) and
#: ``socket`` (a native message, on a node or across).
LINK_CLASSES: Tuple[str, ...] = ("unix", "tcp", "segment", "socket")


@dataclass(frozen=True)
class Topology:
    """The node map of a group of ``world_size`` ranks.

    ``node_ids[r]`` is the node of group rank ``r``. Two ranks on one node talk over
    ``"unix"``, ranks on different nodes over ``"tcp"``.
    """

    node_ids: Tuple[Hashable, ...]
    #: node index of each rank (nodes in first-appearance order)
    node_of: Tuple[int, ...] = field(init=False)
    #: the ranks of each node, in rank order
    node_ranks: Tuple[Tuple[int, ...], ...] = field(init=False)

    def __init__(self, node_ids: Sequence[Hashable]) -> None:
        ids = tuple(node_ids)
        if not ids:
            raise ValueError("Topology(node_ids): expected one node id per rank (at least one), "
                             "got an empty sequence")
        index: Dict[Hashable, int] = {}
        members: List[List[int]] = []
        node_of: List[int] = []
        for rank, node in enumerate(ids):
            try:
                m = index.setdefault(node, len(index))
            except TypeError as exc:
                raise TypeError(f"Topology(node_ids): node id of rank {rank} must be hashable, "
                                f"got {node!r}") from exc
            if m == len(members):
                members.append([])
            members[m].append(rank)
            node_of.append(m)
        object.__setattr__(self, "node_ids", ids)
        object.__setattr__(self, "node_of", tuple(node_of))
        object.__setattr__(self, "node_ranks", tuple(tuple(g) for g in members))

    @classmethod
    def from_sizes(cls, sizes: Sequence[int]) -> "Topology":
        """A topology of nodes with ``sizes[i]`` ranks each, ranks filled node by node
        (``from_sizes([3, 1])``: ranks 0-2 on node 0, rank 3 on node 1)."""
        if not sizes or any(int(s) < 1 for s in sizes):
            raise ValueError(f"Topology.from_sizes(sizes): expected positive node sizes, "
                             f"got {list(sizes)!r}")
        return cls([i for i, s in enumerate(sizes) for _ in range(int(s))])

    @classmethod
    def flat(cls, world_size: int) -> "Topology":
        """All ``world_size`` ranks on one node."""
        return cls.from_sizes([world_size])

    @property
    def world_size(self) -> int:
        return len(self.node_ids)

    @property
    def num_nodes(self) -> int:
        return len(self.node_ranks)

    @property
    def ranks_per_node(self) -> Tuple[int, ...]:
        return tuple(len(g) for g in self.node_ranks)

    def same(self, a: int, b: int) -> bool:
        """Whether ranks ``a`` and ``b`` share a node."""
        return self.node_of[a] == self.node_of[b]

    def link(self, a: int, b: int) -> str:
        """The link class between ranks ``a`` and ``b``."""
        for name, r in (("a", a), ("b", b)):
            if not 0 <= r < self.world_size:
                raise ValueError(f"Topology.link({name}): expected a rank in "
                                 f"[0, {self.world_size}), got {r!r}")
        return "unix" if self.node_of[a] == self.node_of[b] else "tcp"
