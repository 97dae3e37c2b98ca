"""Two-level (node-aware) algorithms on a :class:`Topology`.

all_reduce, as in Horovod's hierarchical all_reduce and MPICH's node-aware variants: cut the
buffer into ``L`` slices (``L`` the most ranks on one node); on node ``m`` slice ``j`` belongs
to local rank ``j mod L_m`` (so a node with fewer ranks gives some ranks several slices);

1. inside each node, a direct reduce-scatter: every local rank sends slice ``j`` to its owner;
2. across nodes, for each slice, its ``M`` owners (one a node) all_reduce it, all slices at
   once: a ring (``hierarchical``) or halving-doubling (``hierarchical_doubling``);
3. inside each node, a direct all-gather: each owner sends its slices to its node's ranks.

Over a ring, a node sends ``2 (M - 1) / M * n`` elements to other nodes (when the slices divide
evenly), against ``2 (W - 1) / W * n`` a rank for a flat ring. broadcast: a binomial tree over
one head a node (the root on its node, the leader elsewhere), then a binomial tree inside
each node from its head.

all_gather, in two steps whatever the layout: each rank sends its block to one rank of every
other node (local rank ``i`` of a node to local rank ``i mod L_m`` of node ``m``), then every
rank sends its node-mates what it holds (its block and those it received). Each block enters
every other node once, as over a ring, but in 2 steps where a ring takes ``W - 1``; the flat
direct exchange sends a block into a node once per rank of it.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence

from raycoll.algorithms import doubling, ring, tree
from raycoll.algorithms.schedule import Step, blocks, in_parallel, sub_ranks, transfer
from raycoll.algorithms.topology import Topology

__all__ = ["all_reduce", "all_reduce_doubling", "all_gather", "broadcast", "slice_owners"]


def slice_owners(topology: Topology) -> List[List[int]]:
    """``owners[j][m]``: the rank of node ``m`` that owns slice ``j``."""
    width = max(topology.ranks_per_node)
    return [[g[j % len(g)] for g in topology.node_ranks] for j in range(width)]


def _two_level(topology: Topology, n: int,
               inter: Callable[[Sequence[int], int, int], List[Step]]) -> List[Step]:
    owners = slice_owners(topology)
    slices = blocks(0, n, len(owners))
    node_of = topology.node_of
    rs: Step = []
    ag: Step = []
    for j, (lo, hi) in enumerate(slices):
        for owner in owners[j]:
            for r in topology.node_ranks[node_of[owner]]:
                if r != owner:
                    rs += transfer(r, owner, lo, hi, True)
                    ag += transfer(owner, r, lo, hi, False)
    across = in_parallel(*[inter(owners[j], lo, hi) for j, (lo, hi) in enumerate(slices)])
    return [rs] + across + [ag]


def all_reduce(topology: Topology, n: int, root: int = 0) -> List[Step]:
    def inter(ranks: Sequence[int], lo: int, hi: int) -> List[Step]:
        return (ring.reduce_scatter_steps(ranks, lo, hi)
                + ring.all_gather_steps(ranks, lo, hi))

    return _two_level(topology, n, inter)


def all_reduce_doubling(topology: Topology, n: int, root: int = 0) -> List[Step]:
    return _two_level(topology, n, doubling.all_reduce_halving_doubling_steps)


def broadcast(topology: Topology, n: int, root: int = 0) -> List[Step]:
    rnode = topology.node_of[root]
    heads: Dict[int, int] = {m: (root if m == rnode else g[0])
                             for m, g in enumerate(topology.node_ranks)}
    order = [heads[m] for m in range(topology.num_nodes)]
    inter = tree.broadcast_steps(sub_ranks(order, root), 0, n)
    intra = in_parallel(*[tree.broadcast_steps(sub_ranks(g, heads[m]), 0, n)
                          for m, g in enumerate(topology.node_ranks)])
    return inter + intra


def all_gather(topology: Topology, n: int, root: int = 0) -> List[Step]:
    world = topology.world_size
    owned = blocks(0, n, world)
    held: List[List[int]] = [[r] for r in range(world)]  # the blocks each rank holds
    across: Step = []
    for r in range(world):
        local = topology.node_ranks[topology.node_of[r]].index(r)
        for m, group in enumerate(topology.node_ranks):
            if m != topology.node_of[r]:
                dst = group[local % len(group)]
                across += transfer(r, dst, *owned[r], False)
                held[dst].append(r)
    inside: Step = []
    for q in range(world):
        for mate in topology.node_ranks[topology.node_of[q]]:
            if mate != q:
                for b in held[q]:
                    inside += transfer(q, mate, *owned[b], False)
    return [across, inside]
