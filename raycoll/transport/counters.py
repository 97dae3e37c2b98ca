"""Counters of a rank's traffic on its direct connections, exact and cheap: bytes sent and
received to ranks on the same node and on other nodes, messages, rounds and distinct peers,
per collective kind (``ProcessGroup.counters()``). :mod:`raycoll.algorithms.counters` says
what each algorithm should cost, so a test compares the two."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Sequence, Set

__all__ = ["COUNTER_NAMES", "Counters"]


#: The per-rank counters, in the order :meth:`Counters.as_dict` lists them.
COUNTER_NAMES = ("bytes_sent_same_node", "bytes_sent_other_node", "bytes_recv_same_node",
                 "bytes_recv_other_node", "messages_sent", "messages_recv", "rounds", "peers")


@dataclass
class Counters:
    """One rank's tally, for one collective kind (summed over its calls)."""

    bytes_sent_same_node: int = 0
    bytes_sent_other_node: int = 0
    bytes_recv_same_node: int = 0
    bytes_recv_other_node: int = 0
    messages_sent: int = 0
    messages_recv: int = 0
    #: rounds this rank sent or received in
    rounds: int = 0
    _peers: Set[int] = field(default_factory=set, repr=False)

    @property
    def peers(self) -> int:
        """How many distinct group ranks this rank sent to or received from."""
        return len(self._peers)

    def sent(self, dst: int, nbytes: int, same_node: bool) -> None:
        """Count one message of ``nbytes`` to group rank ``dst``."""
        self.messages_sent += 1
        if same_node:
            self.bytes_sent_same_node += nbytes
        else:
            self.bytes_sent_other_node += nbytes
        self._peers.add(dst)

    def received(self, src: int, nbytes: int, same_node: bool) -> None:
        """Count one message of ``nbytes`` from group rank ``src``."""
        self.messages_recv += 1
        if same_node:
            self.bytes_recv_same_node += nbytes
        else:
            self.bytes_recv_other_node += nbytes
        self._peers.add(src)

    def add_peers(self, peers: Sequence[int]) -> None:
        """Group ranks this rank sent to or received from (counted elsewhere)."""
        self._peers.update(peers)

    def as_dict(self) -> Dict[str, int]:
        return {name: int(getattr(self, name)) for name in COUNTER_NAMES}
