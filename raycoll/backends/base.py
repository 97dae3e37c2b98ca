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
from raycoll.options import GroupOptions, OptionsLike, or_default
from raycoll.reduce_op import ReduceOp, reduce_arrays
from raycoll.work import DevicePending

__all__ = ["Call", "GroupContext", "CollectiveBackend", "Completion", "Outcome", "Route"]

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
#: much, so that they do not meet the set-up step at the coordinator.
_SETUP_STEPS = 1000


@dataclass(frozen=True)
class Call:
    """One collective as issued: its name, sequence number, fingerprint and timeout."""

    op: str
    seq: int
    timeout_s: float
    fp: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Route:
    """How one collective's data moved on this rank (:attr:`GroupContext.last_route`): what a
    test or a debugging user reads to see which transport and algorithm ran.

    ``steps`` are its steps through the coordinator, in order: ``"reduce"`` (arrays inline,
    reduced by the coordinator), ``"inline"`` (arrays inline, routed), ``"objects:<k>"`` (``k``
    objects put in the object store for the peers), ``"none"`` (this rank sent nothing),
    ``"setup"`` (the step that set the lane up)."""

    op: str
    seq: int
    #: the group's round transport: "lane", "tcp" or "store" (none)
    transport: str
    #: rounds of that round transport the collective took on this rank
    rounds: int
    steps: Tuple[str, ...]


def _step_kind(mode: str, payload: Any) -> str:
    """What one coordinator step carried, for :class:`Route`."""
    if mode == "reduce":
        return "reduce"
    sent = [p for p in payload or () if p is not None]
    refs = {p[0] for p in sent if isinstance(p, tuple) and isinstance(p[0], ray.ObjectRef)}
    if refs:
        return f"objects:{len(refs)}"
    return "inline" if sent else "none"


def _transport_option(options: GroupOptions) -> str:
    """The group option ``transport`` (``None`` is ``"auto"``)."""
    return or_default(options.transport, "auto")


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
        options: OptionsLike = None,
        actors: Optional[Sequence[Any]] = None,
        addresses: Optional[Sequence[Any]] = None,
        secret: Optional[bytes] = None,
    ) -> None:
        self.group_name = group_name
        self.rank = rank
        self.global_ranks = tuple(global_ranks)
        self.size = len(self.global_ranks)
        self.node_ids = tuple(node_ids)
        self.actors = tuple(actors) if actors is not None else (None,) * self.size
        self.client = client
        self.timeout_s = timeout_s
        self.options = GroupOptions.of(options)
        self._on_failure = on_failure
        #: Each rank's direct-connection address (``None`` where it has none) and the
        #: group's secret (see raycoll.transport.tcp).
        self.addresses = tuple(addresses) if addresses is not None else (None,) * self.size
        self.secret = secret
        self.transport = _transport_option(self.options)
        # The round transport (see raycoll.transport): None until the first collective that
        # can use one decides; then a RoundTransport, or False (none, on every rank).
        self._plane: Any = None
        self._shifted_seq: Optional[int] = None
        self._links: Any = None
        self._mailbox: Any = None
        # the route of the last collective (see last_route): its (op, seq), rounds and steps
        self._route_of: Optional[Tuple[str, int]] = None
        self._route_rounds = 0
        self._route_steps: List[str] = []
        if self.transport != "store" and self.size > 1:
            from raycoll.transport import tcp

            if secret is not None and tcp.tcp_possible(self):
                self._links = tcp.Links(key=group_name, rank=rank, size=self.size,
                                        secret=secret, addresses=self.addresses,
                                        nodes=self.node_ids)

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
        self._note(call, 0, _step_kind(mode, payload))
        return self._exchange(call, step, payload, mode, send_meta, recv_meta, root)

    def _exchange(self, call: Call, step: int, payload: Any, mode: str = "route",
                  send_meta: Optional[List[Any]] = None, recv_meta: Optional[List[Any]] = None,
                  root: Optional[int] = None) -> Any:
        if call.seq == self._shifted_seq:
            step += _SETUP_STEPS  # this call's step 0 set up the lane (which stayed off)
        fp = call.fp if step == 0 else {"op": call.op}
        return self.client.exchange(self.group_name, self.global_ranks, call.seq, step,
                                    self.rank, fp, send_meta, recv_meta, payload, mode, root,
                                    call.timeout_s, where=self.ctx(call))

    # ------------------------------------------------------------------ the round transport
    def gather_round(self, call: Call, payload: Any, sub: int = 0,
                     views: bool = False) -> Optional[List[Any]]:
        """Every rank's ``payload`` for round ``sub`` of ``call`` (by group rank) through the
        group's round transport (:mod:`raycoll.transport`), or ``None`` when this group has
        none (then use :meth:`exchange`); ``views``: see
        :meth:`raycoll.transport.base.RoundTransport.all_gather`.

        Every rank must make the same calls here for the same collective: the backend calls
        it only for collectives whose every rank's payload is small, or that it streams in
        rounds of small payloads, as decided from the arguments the ranks must agree on
        (their fingerprint). Round 0 decides (and sets up) the transport; later rounds of a
        call whose round 0 used it always do.
        """
        plane = self._plane
        if plane is None:
            plane = self._set_up_plane(call)
        if plane is False:
            return None
        self._note(call, 1, None)
        return plane.all_gather(call, payload, sub, views)

    def _note(self, call: Call, rounds: int, step: Optional[str]) -> None:
        """Count a round or a step of ``call`` into the route of the last collective."""
        if self._route_of != (call.op, call.seq):
            self._route_of = (call.op, call.seq)
            self._route_rounds, self._route_steps = 0, []
        self._route_rounds += rounds
        if step is not None:
            self._route_steps.append(step)

    @property
    def last_route(self) -> Optional[Route]:
        """How the last collective that moved data on this rank went (its transport, rounds
        and coordinator steps), or ``None`` before the first one."""
        if self._route_of is None:
            return None
        return Route(self._route_of[0], self._route_of[1], self.transport_name,
                     self._route_rounds, tuple(self._route_steps))

    def _set_up_plane(self, call: Call) -> Any:
        """Decide, inside ``call`` and identically on every rank, which round transport the
        group uses: the shared-memory lane (all ranks on this node; set up by one exchange of
        the ranks' channels as step 0 of ``call``), direct connections (ranks on several
        nodes, or ``transport="tcp"``), or none."""
        planned = self.planned_transport()
        if planned == "lane":
            return self._set_up_lane(call)
        if planned == "tcp":
            from raycoll.transport.tcp import TcpTransport

            self._plane = TcpTransport(self, self._links)
            return self._plane
        self._plane = False
        return False

    def planned_transport(self) -> str:
        """The round transport this group will use (``"lane"``, ``"tcp"`` or ``"store"``),
        decided alike on every rank from what they all know: the option ``transport``, the
        ranks' nodes and addresses. (The lane may still turn out unavailable when it is set
        up: then every rank goes to the store together.)"""
        from raycoll.transport import lane as _lane_mod

        if self.transport in ("auto", "lane") and _lane_mod.lane_possible(self):
            return "lane"
        if self._links is not None and (self.transport == "tcp" or (
                self.transport == "auto" and not self.single_node)):
            return "tcp"
        return "store"

    def _set_up_lane(self, call: Call) -> Any:
        from raycoll.transport import lane as _lane_mod

        mine = _lane_mod.open_channel(self)
        epoch = uuid.uuid4().hex
        self._note(call, 0, "setup")
        try:
            got = self._exchange(call, 0, [(mine, epoch)] * self.size)
        except BaseException:
            _lane_mod.release_channel(self, mine)
            raise
        if any(c is None for c, _ in got) or mine is None:
            _lane_mod.release_channel(self, mine)
            self._plane = False
            self._shifted_seq = call.seq
            return False
        peers = {j: c for j, (c, _) in enumerate(got) if j != self.rank}
        self._plane = _lane_mod.LaneTransport(self, mine, peers, epoch=got[0][1])
        return self._plane

    def mailbox(self) -> Any:
        """The group's point-to-point mailbox on direct connections
        (:class:`raycoll.transport.tcp.Mailbox`), or ``None`` when the group has none (then
        point-to-point goes through the coordinator)."""
        if self._links is None:
            return None
        if self._mailbox is None:
            from raycoll.transport.lane import oversubscribed
            from raycoll.transport.tcp import P2P_SPIN_S, Mailbox

            self._mailbox = Mailbox(self._links, group=self.group_name,
                                    global_ranks=self.global_ranks, check=self._p2p_check,
                                    explain=self._p2p_explain,
                                    spin_s=0.0 if oversubscribed(self.size) else P2P_SPIN_S)
        return self._mailbox

    def _p2p_check(self, peers: Sequence[int], waited_s: float) -> None:
        """Raise the coordinator's error if a point-to-point wait for ``peers`` must end."""
        self.client.p2p_check(self.group_name, [self.global_ranks[p] for p in peers], waited_s,
                              where={"op": "p2p", "group": self.group_name,
                                     "rank": self.global_ranks[self.rank]})

    def _p2p_explain(self, suspects: Sequence[int] = ()) -> Optional[BaseException]:
        """The coordinator's error once it has one, or ``None`` after a short grace; group
        ranks ``suspects`` are probed at once (a dead actor's probe fails within
        milliseconds)."""
        from raycoll.transport.base import PROBE_NOW, await_explanation
        from raycoll.transport.tcp import CLOSED_GRACE_S

        return await_explanation(
            lambda: self._p2p_check(suspects, PROBE_NOW if suspects else 0.0), CLOSED_GRACE_S)

    @property
    def transport_name(self) -> str:
        """The round transport this group uses: ``"lane"``, ``"tcp"``, ``"store"``, or
        ``"undecided"`` before its first collective."""
        if self._plane is None:
            return "undecided"
        if self._plane is False:
            return "store"
        return str(self._plane.kind)

    def transport_reject(self, call: Call, message: str) -> None:
        """This rank rejected its arguments for ``call``: tell the transport's readers now."""
        if self._plane:
            self._plane.reject(call, message)

    def transport_report(self) -> None:
        """Send the coordinator what this rank's transport knows of every rank's progress."""
        if self._plane:
            self._plane.report(force=True)

    def transport_missing(
            self, seq: int) -> Optional[Tuple[List[int], Dict[int, Tuple[str, int]]]]:
        """If collective ``seq`` is waiting on the round transport: the group ranks it waits
        for, and each rank's last completed collective (``(op, seq)``, by group rank)."""
        return self._plane.missing(seq) if self._plane else None

    @property
    def transport_active(self) -> bool:
        """Whether this group's round transport is set up (the same on every rank between
        collectives)."""
        return bool(self._plane)

    @property
    def transport_calls(self) -> int:
        """How many collectives went through the round transport on this rank."""
        return self._plane.calls if self._plane else 0

    def close(self) -> None:
        """Release the transports (channels, sockets)."""
        if self._plane:
            self._plane.close()
        self._plane = False
        if self._mailbox is not None:
            self._mailbox.close()
        if self._links is not None:
            self._links.close()

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
        return self.client.submit_p2p_send(self.group_name, self.rank, dst, tag, meta, payload,
                                           timeout_s)

    def p2p_recv(self, src: Optional[int], tag: int, meta: Any, timeout_s: float) -> Any:
        """Post a receive from group rank ``src`` (``None``: any); a ref to ``(src, payload)``."""
        return self.client.submit_p2p_recv(self.group_name, src, self.rank, tag, meta, timeout_s)


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
