"""The backend boundary: what a backend implements, and the group context it is given.

A backend moves the data of one device kind ("cpu", "cuda") for one process group. It gets a
:class:`~raycoll.context.GroupContext` (its rank, the group's ranks and nodes, and the
control-plane calls to the coordinator; defined in :mod:`raycoll.context`, below the
transports, and importable from here) and implements one method per collective on tensors of
its device. The public layer has already validated arguments and computed the collective's
fingerprint (carried in :class:`~raycoll.context.Call`); a backend only moves and reduces
data. Every blocking wait takes the call's timeout.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Callable, ContextManager, List, Optional, Tuple, Union

from raycoll.context import Call, GroupContext, Route
from raycoll.reduce_op import ReduceOp
from raycoll.work import DevicePending

__all__ = ["Call", "GroupContext", "CollectiveBackend", "Completion", "Outcome", "Route"]

#: A posted point-to-point operation: call it to wait for completion (returns the source rank
#: for receives, ``None`` for sends; a stream-ordered backend returns a ``DevicePending``).
Completion = Callable[[], Union[Optional[int], DevicePending]]

#: What a collective returns: ``None`` once done, or (stream-ordered backends such as NCCL)
#: a ``DevicePending`` for the work it enqueued on a device stream.
Outcome = Optional[DevicePending]


class CollectiveBackend(ABC):
    """One backend instance serves one device kind of one process group."""

    #: Device kinds this backend can serve ("cpu", "cuda").
    devices: Tuple[str, ...] = ()

    #: True when operations only enqueue work on a device stream and return a
    #: ``DevicePending`` (NCCL): the group then runs them in the caller's thread even with
    #: ``async_op=True``, so that they reach the stream in issue order.
    stream_ordered: bool = False

    def __init__(self, ctx: GroupContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def all_reduce(self, tensor: Any, op: ReduceOp, call: Call) -> Outcome: ...

    @abstractmethod
    def reduce(self, tensor: Any, dst: int, op: ReduceOp, call: Call) -> Outcome: ...

    @abstractmethod
    def broadcast(self, tensor: Any, src: int, call: Call) -> Outcome: ...

    @abstractmethod
    def all_gather(self, outputs: List[Any], tensor: Any, call: Call) -> Outcome: ...

    @abstractmethod
    def all_gather_into_tensor(self, output: Any, tensor: Any, call: Call) -> Outcome: ...

    @abstractmethod
    def gather(self, tensor: Any, outputs: Optional[List[Any]], dst: int, call: Call) -> Outcome: ...

    @abstractmethod
    def scatter(self, output: Any, inputs: Optional[List[Any]], src: int, call: Call) -> Outcome: ...

    @abstractmethod
    def reduce_scatter(self, output: Any, inputs: List[Any], op: ReduceOp, call: Call) -> Outcome: ...

    @abstractmethod
    def reduce_scatter_tensor(self, output: Any, tensor: Any, op: ReduceOp, call: Call) -> Outcome: ...

    @abstractmethod
    def all_to_all(self, outputs: List[Any], inputs: List[Any], call: Call) -> Outcome: ...

    @abstractmethod
    def all_to_all_single(self, output: Any, tensor: Any, output_splits: List[int],
                          input_splits: List[int], call: Call) -> Outcome: ...

    @abstractmethod
    def barrier(self, call: Call) -> Outcome: ...

    @abstractmethod
    def send(self, tensor: Any, dst: int, tag: int, timeout_s: float) -> Completion: ...

    @abstractmethod
    def recv(self, tensor: Any, src: Optional[int], tag: int, timeout_s: float) -> Completion: ...

    def batch_p2p(self) -> ContextManager[None]:
        """Inside this context, sends and receives posted by this thread are issued together
        (NCCL: one group call, so that a ring of sends and receives cannot deadlock)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Release what the backend holds (communicators, streams). Idempotent."""
