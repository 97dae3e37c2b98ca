"""A group's context: what a backend, an algorithm and a round transport know of the group.

:class:`GroupContext` is a backend's view of its process group on this rank: its rank, the
group's ranks, nodes and actors, the options, the control-plane calls to the coordinator
(steps of a collective, point to point, checks), and the group's round transport once it is
chosen. :class:`Call` is one collective as issued (name, sequence number, fingerprint,
timeout); :class:`Route` how its data moved.

This module sits below :mod:`raycoll.transport` (whose modules take a :class:`GroupContext`)
and never imports it: which round transport a group uses, and setting it up, is
:mod:`raycoll.transport.selection`, handed to the context as a :class:`Transports` factory
by the layer that forms the group (:class:`raycoll.process_group.ProcessGroup`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import ray

from raycoll import errors
from raycoll.coordinator.client import CoordinatorClient, unpack_handle
from raycoll.options import GroupOptions, OptionsLike, or_default
from raycoll.reduce_op import ReduceOp, reduce_arrays

__all__ = ["Call", "GroupContext", "Route", "Transports"]

#: Ray's ways of saying that a peer's object is gone with its owner.
_LOST = (
    ray.exceptions.OwnerDiedError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.ObjectFetchTimedOutError,
    ray.exceptions.ObjectReconstructionFailedError,
)

#: Steps of a collective whose step 0 set the lane up (and it stayed off) are moved by this
#: much, so that they do not meet the set-up step at the coordinator.
_SETUP_STEPS = 1000


class Call:
    """One collective as issued: its name, sequence number, fingerprint and timeout (not to
    be changed once made; a plain class, not a frozen dataclass: made on every collective's
    hot path, where a frozen dataclass costs three times as much)."""

    __slots__ = ("op", "seq", "timeout_s", "fp")

    def __init__(self, op: str, seq: int, timeout_s: float,
                 fp: Optional[Dict[str, Any]] = None) -> None:
        self.op = op
        self.seq = seq
        self.timeout_s = timeout_s
        self.fp: Dict[str, Any] = {} if fp is None else fp

    def __repr__(self) -> str:
        return f"Call(op={self.op!r}, seq={self.seq}, timeout_s={self.timeout_s}, fp={self.fp!r})"


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
    #: the scheduled algorithm that ran (:mod:`raycoll.algorithms.scheduled`), or ``None``
    #: (the direct exchange, or steps through the coordinator)
    algorithm: Optional[str] = None


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


class Transports(Protocol):
    """A group's round transports and direct connections on this rank, as its context uses
    them (:class:`raycoll.transport.selection.GroupTransports`)."""

    def planned(self) -> str:
        """The round transport the group will use: ``"lane"``, ``"tcp"`` or ``"store"``."""
        ...

    def set_up(self, call: Call) -> Any:
        """Choose and set up the round transport inside ``call``, alike on every rank: a
        ``NativeTransport``, or ``False`` for none."""
        ...

    def pair_pipes(self) -> Any:
        """The group's point-to-point pair pipes, or ``None`` without them."""
        ...

    def close(self) -> None:
        """Release the direct connections and the pair pipes."""
        ...

    def sockets(self, purpose: str) -> int:
        """How many direct connections this rank holds for ``purpose`` (both directions)."""
        ...


class GroupContext:
    """A backend's view of its process group, and its line to the coordinator.

    ``transports`` makes the group's :class:`Transports` from the context (the layer that
    forms the group passes :class:`raycoll.transport.selection.GroupTransports`); without it
    the group has no round transport and no direct connections: everything goes through the
    coordinator and the object store.
    """

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
        transports: Optional[Callable[["GroupContext"], Transports]] = None,
        native: bool = False,
    ) -> None:
        self.group_name = group_name
        self.rank = rank
        self.global_ranks = tuple(global_ranks)
        self.size = len(self.global_ranks)
        self.node_ids = tuple(node_ids)
        #: each rank's actor handle as the roster has it: packed (bytes, read on first use
        #: by :attr:`actors`: a formation reads none), a handle, or ``None``
        self._actors: Tuple[Any, ...] = (tuple(actors) if actors is not None
                                         else (None,) * self.size)
        self.client = client
        self.timeout_s = timeout_s
        self.options = GroupOptions.of(options)
        self._on_failure = on_failure
        #: Each rank's direct-connection address (``None`` where it has none) and the
        #: group's secret (see raycoll.transport.links).
        self.addresses = tuple(addresses) if addresses is not None else (None,) * self.size
        self.secret = secret
        #: whether every rank of the group runs raycoll's native core (raycoll.native), so
        #: that its transports may use it
        self.native = native
        self.transport = _transport_option(self.options)
        # The round transport (see raycoll.transport): None until the first collective that
        # can use one decides; then a NativeTransport, or False (none, on every rank).
        self._plane: Any = None
        self._shifted_seq: Optional[int] = None
        # the route of the last collective (see last_route): its (op, seq), rounds and steps
        self._route_of: Optional[Tuple[str, int]] = None
        self._route_rounds = 0
        self._route_steps: List[str] = []
        self._route_algorithm: Optional[str] = None
        #: the algorithm each collective last ran with (``ScheduledAlgorithms``): collective
        #: name -> algorithm, for ``group_status``
        self.algorithms: Dict[str, str] = {}
        self._transports = transports(self) if transports is not None else None

    @property
    def actors(self) -> Tuple[Any, ...]:
        """Each rank's actor handle (``None`` for a rank that is no actor), unpacked here on
        first use (:func:`raycoll.coordinator.client.unpack_handle`)."""
        if any(isinstance(a, bytes) for a in self._actors):
            self._actors = tuple(unpack_handle(a) for a in self._actors)
        return self._actors

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
    def gather_round(self, call: Call, seq: Optional[int]) -> Optional[List[Optional[int]]]:
        """Every rank's join sequence number ``seq`` for ``call`` (by group rank) through the
        group's node segment, or ``None`` when this group has none (then use
        :meth:`exchange`). Decides (and sets up) the transport if ``call`` is the first."""
        plane = self._set_up(call)
        if not getattr(plane, "is_segment", False):
            return None
        seqs: List[Optional[int]] = plane.gather_seqs(call, seq)
        return seqs

    def _set_up(self, call: Call) -> Any:
        """The group's round transport, set up inside ``call`` if this is its first use."""
        plane = self._plane
        if plane is None:
            plane = self._plane = (self._transports.set_up(call)
                                   if self._transports is not None else False)
        return plane

    def native_lane(self, call: Call) -> Any:
        """The group's node segment (:mod:`raycoll.transport.segment`), set up in ``call`` if
        this is the group's first collective, or ``None`` when it has none (the same on
        every rank)."""
        plane = self._plane
        if plane is None:
            plane = self._set_up(call)
        if plane and getattr(plane, "is_segment", False):
            return plane
        return None

    def note_native(self, call: Call, steps: int) -> None:
        """``call`` takes ``steps`` steps on the node segment (:attr:`last_route`)."""
        self._note(call, steps, None)

    def native_sockets(self, call: Call) -> Any:
        """The group's native sockets (direct connections: a step of a schedule goes only
        between the ranks it pairs), else ``None``; the same on every rank. Set up here if
        this is the group's first collective on it."""
        if self.planned_transport() != "tcp":
            return None
        plane = self._set_up(call)
        return plane if plane and plane.kind == "tcp" else None

    def note_algorithm(self, collective: str, algorithm: str) -> None:
        """Remember that this group's last ``collective`` ran ``algorithm`` (for
        ``group_status``)."""
        self.algorithms[collective] = algorithm

    def report_detail(self) -> Dict[str, Any]:
        """What this rank tells the coordinator of itself with its progress reports, for
        ``group_status``: the algorithm each collective last ran with, and its counters."""
        return {"rank": self.rank, "algorithms": dict(self.algorithms),
                "counters": self.counters()}

    def note_rounds(self, call: Call, rounds: int, algorithm: str) -> None:
        """Count ``rounds`` rounds of ``call`` by scheduled ``algorithm`` on the round
        transport into the last route."""
        self._note(call, rounds, None)
        self._route_algorithm = algorithm

    def counters(self) -> Dict[str, Any]:
        """This rank's traffic on the group's direct connections (see
        ``ProcessGroup.counters``)."""
        plane = self._plane
        if plane and plane.kind == "tcp":
            plane.flush()  # its counters are brought up to date when read
        per_op = getattr(plane, "counters", {}) if plane else {}
        sockets = self._transports.sockets if self._transports is not None else None
        return {
            "collectives": {op: c.as_dict() for op, c in sorted(per_op.items())},
            "sockets": sockets("ncoll") if sockets else 0,
            "p2p_sockets": sockets("p2p") if sockets else 0,
            "peak_recv_buffer_bytes": getattr(plane, "peak_recv_bytes", 0) if plane else 0,
        }

    def _note(self, call: Call, rounds: int, step: Optional[str]) -> None:
        """Count a round or a step of ``call`` into the route of the last collective."""
        if self._route_of != (call.op, call.seq):
            self._route_of = (call.op, call.seq)
            self._route_rounds, self._route_steps = 0, []
            self._route_algorithm = None
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
                     self._route_rounds, tuple(self._route_steps), self._route_algorithm)

    def planned_transport(self) -> str:
        """The round transport this group will use (``"lane"``, ``"tcp"`` or ``"store"``),
        decided alike on every rank from what they all know (see
        :mod:`raycoll.transport.selection`)."""
        return self._transports.planned() if self._transports is not None else "store"

    def setup_exchange(self, call: Call, payload: Any, step: int = 0) -> Any:
        """Step ``step`` (0 or 1) of ``call`` through the coordinator, spent setting up the
        round transport (``payload`` per destination, as :meth:`exchange` routes it)."""
        self._note(call, 0, "setup")
        return self._exchange(call, step, payload)

    def skip_setup_step(self, call: Call) -> None:
        """The round transport stayed off after step 0 of ``call`` set it up: the call's own
        steps through the coordinator move past that step."""
        self._shifted_seq = call.seq

    def pair_pipes(self) -> Any:
        """The group's point-to-point pair pipes (:class:`raycoll.transport.pipes.PairPipes`),
        or ``None`` when the group has none (then point-to-point goes through the
        coordinator)."""
        return self._transports.pair_pipes() if self._transports is not None else None

    def p2p_check(self, peers: Sequence[int], waited_s: float) -> None:
        """Raise the coordinator's error if a point-to-point wait for ``peers`` must end."""
        self.client.p2p_check(self.group_name, [self.global_ranks[p] for p in peers], waited_s,
                              where={"op": "p2p", "group": self.group_name,
                                     "rank": self.global_ranks[self.rank]})

    @property
    def transport_name(self) -> str:
        """The round transport this group uses: ``"lane"``, ``"tcp"``, ``"store"``, or
        ``"undecided"`` before its first collective."""
        if self._plane is None:
            return "undecided"
        if self._plane is False:
            return "store"
        return str(self._plane.kind)

    def transport_report(self, wait_s: float = 0.0) -> None:
        """Send the coordinator what this rank's transport knows of every rank's progress
        (waiting up to ``wait_s`` for it to be taken)."""
        if self._plane:
            self._plane.report(force=True, wait_s=wait_s)

    def transport_missing(
            self, seq: int) -> Optional[Tuple[List[int], Dict[int, Tuple[str, int]]]]:
        """If collective ``seq`` is waiting on the round transport: the group ranks it waits
        for, and each rank's last completed collective (``(op, seq)``, by group rank)."""
        return self._plane.missing(seq) if self._plane else None

    @property
    def transport_active(self) -> bool:
        """Whether this group's node segment is set up, which carries the join rounds
        (:meth:`gather_round`; the same on every rank between collectives)."""
        return bool(getattr(self._plane, "is_segment", False))

    @property
    def transport_calls(self) -> int:
        """How many collectives went through the round transport on this rank."""
        return self._plane.calls if self._plane else 0

    def close(self) -> None:
        """Release the transports (channels, sockets)."""
        if self._plane:
            self._plane.close()
        self._plane = False
        if self._transports is not None:
            self._transports.close()

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


