"""What a collective should cost a rank, in numbers a test can check exactly: bytes sent
and received (to ranks on the same node and on other nodes), messages, rounds and distinct
peers.

:func:`expected` reads them off a :class:`~raycoll.algorithms.schedule.Schedule` on a
:class:`~raycoll.algorithms.topology.Topology`; the direct connections tally what a rank
really sent and received (:class:`raycoll.transport.counters.Counters`,
``ProcessGroup.counters()``). The two agree for every algorithm, whatever the machine's
noise: that is how an algorithm's cost is proven here. A message is everything one rank
sends one peer in one step (a ring's chunks travel as one message); a rank's rounds are
the steps it sends or receives in.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from raycoll.algorithms.schedule import Schedule
from raycoll.algorithms.topology import Topology
from raycoll.transport.counters import COUNTER_NAMES, Counters

__all__ = ["COUNTER_NAMES", "Counters", "expected"]

def expected(schedule: Schedule, topology: Topology, itemsize: int) -> List[Dict[str, int]]:
    """Per rank, what running ``schedule`` on ``topology`` with elements of ``itemsize``
    bytes costs (:data:`COUNTER_NAMES`): one message per (sender, receiver) pair a step."""
    if topology.world_size != schedule.world_size:
        raise ValueError(f"topology: expected {schedule.world_size} ranks (the schedule's), "
                         f"got {topology.world_size}")
    tallies = [Counters() for _ in range(schedule.world_size)]
    for step in schedule.steps:
        pairs: Dict[Tuple[int, int], int] = {}
        for t in step:
            pairs[(t.src, t.dst)] = pairs.get((t.src, t.dst), 0) + t.size * itemsize
        for (src, dst), nbytes in pairs.items():
            same = topology.same(src, dst)
            tallies[src].sent(dst, nbytes, same)
            tallies[dst].received(src, nbytes, same)
        for rank in {r for pair in pairs for r in pair}:
            tallies[rank].rounds += 1
    return [t.as_dict() for t in tallies]
