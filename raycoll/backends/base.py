"""The backend boundary: what a backend implements, and the group context it is given.

A backend moves the data of one device kind ("cpu", "cuda") for one process group. It gets a
:class:`GroupContext` (its rank, the group's ranks and nodes, and the control-plane calls to
the coordinator) and implements one method per collective on tensors of its device. The
public layer has already validated arguments and computed the collective's fingerprint
(carried in :class:`Call`); a backend only moves and reduces data. Every blocking wait takes
the call's timeout.
"""

from __future__ import annotations

import contextlib
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple, Union

import ray

from raycoll import errors
from raycoll.coordinator import CoordinatorClient
from raycoll.reduce_op import ReduceOp, reduce_arrays
from raycoll.work import DevicePending

__all__ = ["Call", "GroupContext", "CollectiveBackend", "chunk_bounds", "Completion", "Outcome"]

#: Ray's ways of saying that a peer's object is gone with its owner.
_LOST = (
    ray.exceptions.OwnerDiedError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.ObjectFetchTimedOutError,
    ray.exceptions.ObjectReconstructionFailedError,
)

#: A posted point-to-point operation: call it to wait for completion (returns the source rank
#: for receives, ``None`` for sends; a stream-ordered backend returns a ``DevicePending``).
Completion = Callable[[], Union[Optional[int], DevicePending]]

#: What a collective returns: ``None`` once done, or (stream-ordered backends such as NCCL)
#: a ``DevicePending`` for the work it enqueued on a device stream.
Outcome = Optional[DevicePending]


#: Steps of a collective whose step 0 set the lane up (and it stayed off) are moved by this
#: much, so that they do not meet the set-up round at the coordinator.
_SETUP_STEPS = 1000


@dataclass(frozen=True)
class Call:
    """One collective as issued: its name, sequence number, fingerprint and timeout."""

    op: str
    seq: int
    timeout_s: float
    fp: Dict[str, Any] = field(default_factory=dict)


def chunk_bounds(n: int, parts: int) -> List[int]:
    """``parts + 1`` offsets splitting ``n`` elements into near-equal contiguous chunks.

    The first ``n % parts`` chunks get one element more, so sizes differ by at most one.
    """
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


class GroupContext:
    """A backend's view of its process group, and its line to the coordinator."""

    def __init__(
        self,
        *,
        group_name: str,
        rank: int,
        global_ranks: Sequence[int],
        node_ids: Sequence[str],
        client: CoordinatorClient,
        timeout_s: float,
        on_failure: Callable[[BaseException], None],
        options: Optional[Dict[str, Any]] = None,
        actors: Optional[Sequence[Any]] = None,
    ) -> None:
        self.group_name = group_name
        self.rank = rank
        self.global_ranks = tuple(global_ranks)
        self.size = len(self.global_ranks)
        self.node_ids = tuple(node_ids)
        self.actors = tuple(actors) if actors is not None else (None,) * self.size
        self.client = client
        self.timeout_s = timeout_s
        self.options = dict(options or {})
        self._on_failure = on_failure
        # The shared-memory lane (see raycoll.backends.lane): None until the first collective
        # that can use it decides; then a Lane, or False (off on every rank).
        self._lane: Any = None
        self._shifted_seq: Optional[int] = None

    @property
    def single_node(self) -> bool:
        return len(set(self.node_ids)) <= 1

    def ctx(self, call: Call) -> Dict[str, Any]:
        """Error context for a call on this rank."""
        return {"op": call.op, "seq": call.seq, "group": self.group_name,
                "rank": self.global_ranks[self.rank]}

    def exchange(
        self,
        call: Call,
        step: int,
        payload: Any,
        *,
        mode: str = "route",
        send_meta: Optional[List[Any]] = None,
        recv_meta: Optional[List[Any]] = None,
        root: Optional[int] = None,
    ) -> Any:
        """One step of a collective through the coordinator (see ``Coordinator.exchange``).

        ``mode="route"``: ``payload`` is a per-destination list (group ranks); returns the
        per-source list of what this rank was sent. ``mode="reduce"``: returns the reduced
        array (``None`` on ranks other than ``root`` when a root is given).
        """
        if self.size == 1:
            if mode == "reduce":
                return reduce_arrays(ReduceOp(*call.fp["reduce_op"]), [payload])
            return [payload[0] if payload is not None else None]
        if call.seq == self._shifted_seq:
            step += _SETUP_STEPS  # this call's step 0 set up the lane (which stayed off)
        fp = call.fp if step == 0 else {"op": call.op}
        ref = self.client.submit("exchange_packed", (
            self.group_name, self.global_ranks, call.seq, step, self.rank, fp,
            send_meta, recv_meta, payload, mode, root, call.timeout_s,
        ))
        return self.client.wait(ref, call.timeout_s, **self.ctx(call))

    # ------------------------------------------------------------------ the lane
    def lane_gather(self, call: Call, payload: Any, sub: int = 0,
                    views: bool = False) -> Optional[List[Any]]:
        """Every rank's ``payload`` for round ``sub`` of ``call`` (by group rank) through the
        shared-memory lane, or ``None`` when this group does not use the lane (then use
        :meth:`exchange`); ``views``: see :meth:`raycoll.backends.lane.Lane.all_gather`.

        Every rank must make the same calls here for the same collective: the backend calls
        it only for collectives whose every rank's payload is small, or that it streams in
        rounds of small payloads, as decided from the arguments the ranks must agree on
        (their fingerprint). Round 0 decides (and sets up) the lane; later rounds of a call
        whose round 0 used it always do.
        """
        lane = self._lane
        if lane is None:
            lane = self._set_up_lane(call)
        if lane is False:
            return None
        return lane.all_gather(call, payload, sub, views)

    def _set_up_lane(self, call: Call) -> Any:
        """Decide, inside ``call`` and identically on every rank, whether the group uses the
        lane; set it up if so (one exchange of the ranks' channels as step 0 of ``call``)."""
        from raycoll.backends import lane as _lane_mod

        if not _lane_mod.lane_possible(self):
            self._lane = False
            return False
        mine = _lane_mod.open_channel(self)
        epoch = uuid.uuid4().hex
        try:
            got = self.exchange(call, 0, [(mine, epoch)] * self.size)
        except BaseException:
            _lane_mod.release_channel(self, mine)
            raise
        if any(c is None for c, _ in got) or mine is None:
            _lane_mod.release_channel(self, mine)
            self._lane = False
            self._shifted_seq = call.seq
            return False
        peers = {j: c for j, (c, _) in enumerate(got) if j != self.rank}
        self._lane = _lane_mod.Lane(self, mine, peers, epoch=got[0][1])
        return self._lane

    def lane_reject(self, call: Call, message: str) -> None:
        """This rank rejected its arguments for ``call``: tell lane readers now."""
        if self._lane:
            self._lane.reject(call, message)

    def lane_report(self) -> None:
        """Send the coordinator what this rank's lane knows of every rank's progress."""
        if self._lane:
            self._lane.report(force=True)

    def lane_missing(self, seq: int) -> Optional[Tuple[List[int], Dict[int, Tuple[str, int]]]]:
        """If collective ``seq`` is waiting on the lane: the group ranks it waits for, and
        each rank's last completed collective (``(op, seq)``, by group rank)."""
        return self._lane.missing(seq) if self._lane else None

    @property
    def lane_active(self) -> bool:
        """Whether this group's lane is set up (the same on every rank between collectives)."""
        return bool(self._lane)

    @property
    def lane_calls(self) -> int:
        """How many collectives went through the shared-memory lane on this rank."""
        return self._lane.calls if self._lane else 0

    def close(self) -> None:
        """Release the lane's channels."""
        if self._lane:
            self._lane.close()
        self._lane = False

    def fail(self, exc: BaseException) -> None:
        """Report a failure that breaks the group (e.g. a peer's object was lost)."""
        self._on_failure(exc)

    def get(self, refs: List[Any], sources: List[int], call: Call) -> List[Any]:
        """``ray.get`` of peers' objects (``sources[i]``: the group rank that put ``refs[i]``),
        with Ray's errors translated: a timeout names the ranks whose data did not come, a
        lost object breaks the group with ``RankFailedError`` naming its owners."""
        try:
            return list(ray.get(refs, timeout=call.timeout_s))
        except ray.exceptions.GetTimeoutError as exc:
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            who = sorted({self.global_ranks[s] for r, s in zip(refs, sources) if r in pending})
            raise errors.DistTimeoutError(
                f"{call.op} #{call.seq} on group {self.group_name!r}: reading the data of ranks "
                f"{who} took longer than {call.timeout_s:g}s", missing=who, **self.ctx(call)
            ) from exc
        except _LOST as exc:
            who = sorted({self.global_ranks[s] for s in sources})
            err = errors.RankFailedError(
                f"{call.op} #{call.seq} on group {self.group_name!r}: data from ranks {who} is "
                f"lost (a rank's actor died: {type(exc).__name__})", failed_ranks=who,
                **self.ctx(call)
            )
            self.fail(err)
            raise err from exc

    def p2p_send(self, dst: int, tag: int, meta: Any, payload: Any, timeout_s: float) -> Any:
        """Post a message to group rank ``dst``; returns a ref that resolves once it matched."""
        return self.client.submit("p2p_send", self.group_name, self.rank, dst, tag, meta,
                                  payload, timeout_s)

    def p2p_recv(self, src: Optional[int], tag: int, meta: Any, timeout_s: float) -> Any:
        """Post a receive from group rank ``src`` (``None``: any); a ref to ``(src, payload)``."""
        return self.client.submit("p2p_recv", self.group_name, src, self.rank, tag, meta,
                                  timeout_s)


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
