"""The shared-memory lane: small and mid-size collectives among ranks on one node, without
the coordinator.

A collective through the coordinator costs at least one Ray actor call per rank and an async
actor waking up for every arrival (several actor round trips: benchmarks/HISTORY.md).
When all ranks of a group are actors on one node,
each rank instead owns one Ray shared-memory channel (``ray.experimental.channel.Channel``,
the mutable plasma objects that Ray's compiled graphs use), written by it and read by every
peer. A collective is then one *round* or more: in each, every rank writes one message (at
most ``lane_bytes``, group option, 4 MiB by default) and reads each peer's. A small one-step
collective is one round: every rank gets every rank's contribution and computes its own
result locally (reductions in rank order, so every rank holds bitwise the same result). A
larger one streams through several rounds (the backend cuts them: see
raycoll.backends.cpu), reading the peers' parts in place (``views=True``) and dropping
them before its next round. A message of up to ``FRAME_MAX_BYTES`` (192 KiB) of arrays is
written as one frame of bytes in the direct transport's framing (raycoll.transport.frames),
which costs a fraction of Ray's serializer; a larger one through Ray's serializer, its arrays
read in place.

Each message is ``(kind, epoch, (seq, round), fingerprint, payload)``. ``kind`` is ``"msg"``
or, from a rank that rejected its own arguments, ``"reject"`` (its peers raise
``PeerArgumentError`` at once). What could go wrong through the coordinator is still detected
(a streamed collective's round 0 carries what the ranks must agree on, so a mismatch fails it
there, before any data moved; a call's timeout covers all its rounds):

- **mismatch**: every rank sees every rank's fingerprint and compares them (every rank
  raises the same ``CollectiveMismatchError``); a rank whose call went to the coordinator
  instead (another collective, or a large one) is found by the lane ranks' periodic check;
- **timeouts, dead ranks, broken groups**: while a read waits, the rank asks the coordinator
  every so often (``Coordinator.transport_check``, first after 0.1 s, then at most every
  second): a dead rank, an aborted group, a rejection end the wait with the coordinator's
  error; at the call's timeout, ``Coordinator.transport_timeout`` names the ranks whose
  messages never came, with their last completed collective (each check reports what this
  rank has seen of its peers);
  a rank whose lane call fails that way closes its channel, so a rank arriving late fails too
  instead of completing with the messages left behind;
- **group_status**: ranks tell the coordinator their lane progress at most every 0.1 s
  (``Coordinator.transport_progress``, one fire-and-forget call), and group_status waits that
  long.

Waiting: a read first spins for up to 1 ms when the group's ranks fit the node's cores
(a spin that runs its full length backs off: for a while the rank yield-polls instead, in
case the scheduler put its peer on its core, where spinning only delays it); otherwise (a
spinning rank would take a core from the peer it waits for) it polls yielding its core for
up to 2 ms (``sched_yield``: a peer still working on its part runs first). Then
it polls with a sleep that doubles up to 0.5 ms, so a rank waiting for a slow peer uses a few
percent of a core. An async collective nobody waits for yet (its caller computes beside it,
as torch's DDP backward does beside its bucket all_reduces) neither spins nor yields: it
sleep-polls from the start (``transport.base.overlapping``), leaving the core to the caller.

A channel's buffer is reused for the next message once every reader has dropped its view of
the current one, so readers copy what they keep and drop the rest at once. A message a rank
never read (its peer rejected or failed that call) is skipped by its sequence number; a
message for a later call (its writer skipped this one) is kept for that call, and this call
ends with the coordinator's error for it.

Memory: each rank's channel is allocated at ``lane_bytes`` plus room for the message around
it, once per process and set of readers: Ray frees a channel only when the actor that wrote
it exits (ray-project/ray#43836), so channels are pooled and reused by later groups of the
same actors (messages carry their group's epoch), never dropped. A 2-rank group with the
default costs ~8.5 MiB of object-store memory for the life of its actors.

Groups with more ranks than ``lane_max_ranks`` (default: twice the node's cores) stay on the
coordinator: there, W oversubscribed ranks each polling W - 1 channels lose to it (measured
with 8 and 16 ranks on 2 cores).

The lane is set up by the group's first collective that can use it, inside that collective:
the ranks exchange their channels through the coordinator (one extra round trip, once per
group) and all switch to the lane together, or all stay off it if any rank could not open its
channel. Group option ``transport="store"`` keeps every collective on
the coordinator; the object collectives always use it, and point-to-point goes over direct
connections (raycoll.transport.tcp).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import ray

from raycoll.options import GroupOptions, or_default
from raycoll.transport.base import RoundTransport, SpinBackoff
from raycoll.transport.frames import decode_frame, encode_round

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.context import GroupContext

logger = logging.getLogger("raycoll")

__all__ = ["LaneTransport", "open_channel", "release_channel", "lane_possible",
           "oversubscribed", "on_one_host", "host_ranks"]

#: How long a read or a write spins before it polls (Ray's channel timeouts are in ms).
SPIN_S = 0.001
#: Ranks that do not fit the node's cores do not spin: for up to ``YIELD_S`` they poll
#: yielding the core to any peer that can run (the one still working on its part), then
#: sleep (group option ``lane_yield_s``).
YIELD_S = 0.002
#: The polling sleep doubles from ``POLL_MIN_S`` up to ``POLL_MAX_S``.
POLL_MIN_S = 20e-6
POLL_MAX_S = 500e-6
_TIMEOUT = ray.exceptions.RayChannelTimeoutError
#: A message whose arrays hold at most this many bytes is written as one frame of bytes (the
#: direct transport's framing, raycoll.transport.frames): Ray's serializer costs 70-100 us
#: of Python per message, several times the frame's two extra copies up to here (measured:
#: benchmarks/HISTORY.md, "Frames on the lane"; a 256 KiB broadcast is faster through
#: Ray's serializer). Larger ones go through Ray's serializer, whose arrays peers read in
#: place in the writer's channel.
FRAME_MAX_BYTES = 192 << 10
#: ... and the rest of such a message (its pickled structure) at most this many bytes: a
#: message is framed or not from its arrays' bytes alone, so that one whose arrays are just
#: ``FRAME_MAX_BYTES`` is not encoded, found a few bytes too large and thrown away (that
#: cost the 64 KiB all_reduce 20-30 us: benchmarks/HISTORY.md, "Frames on the lane").
FRAME_META_MAX_BYTES = 64 << 10

#: The most one rank sends in one round of a collective on a round transport (group option
#: ``lane_bytes``). Each rank's lane channel is allocated at this size (plus room for the
#: message around it) for as long as the rank's process lives: a fixed cost, like NCCL's
#: buffers.
LANE_BYTES = 4 << 20


def lane_bytes(options: GroupOptions) -> int:
    """The group's ``lane_bytes`` option: the most a rank sends in one round."""
    return or_default(options.lane_bytes, LANE_BYTES)


def node_cores() -> int:
    """The node's CPU count: the same on every rank of a node (unlike a process's affinity),
    so ranks that decide something from it decide alike."""
    return os.cpu_count() or 1


def oversubscribed(size: int) -> bool:
    """Whether ``size`` ranks on one node outnumber its cores: they must not spin while they
    wait (a spinning rank takes the core of the peer it waits for), and every lane round
    costs them a scheduler wake-up."""
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


def lane_possible(ctx: "GroupContext") -> bool:
    """Whether group ``ctx`` can use a lane: 2+ ranks, all actors, all on this node, this
    process being the rank's actor (the caller checks the group option ``transport``)."""
    if ctx.size < 2 or not ctx.single_node:
        return False
    if ctx.size > lane_max_ranks(ctx):
        return False  # polling W - 1 channels on each of W oversubscribed ranks loses
    if any(a is None for a in ctx.actors):
        return False
    return in_rank_actor(ctx)


def lane_max_ranks(ctx: "GroupContext") -> int:
    """The most ranks one lane takes (group option ``lane_max_ranks``; default twice the
    node's cores)."""
    return int(or_default(ctx.options.lane_max_ranks, 2 * node_cores()))


def in_rank_actor(ctx: "GroupContext") -> bool:
    """Whether this process is the actor of group ``ctx``'s rank, on the rank's node (only
    the rank's actor can write and read its channels)."""
    me = ctx.actors[ctx.rank]
    if me is None:
        return False
    try:
        runtime = ray.get_runtime_context()
        return (runtime.get_actor_id() is not None
                and runtime.get_actor_id() == me._actor_id.hex()
                and runtime.get_node_id() == ctx.node_ids[ctx.rank])
    except Exception:  # noqa: BLE001 - not connected, not in an actor
        return False


# Ray frees a channel's shared memory only when the actor that wrote it exits (mutable
# objects are not reference-counted: ray-project/ray#43836), so a channel is never dropped
# while this process lives: when its group is destroyed it goes back to this pool and serves
# the next group with the same readers (an actor that re-forms its groups would otherwise
# leak ~100 KiB of the store per peer and formation). Key: (reader actor ids, buffer size).
_POOL_LOCK = threading.Lock()
_POOL: Dict[Tuple[Tuple[str, ...], int], List[Any]] = {}


def _peer_actors(ctx: "GroupContext",
                 readers: Optional[Sequence[int]] = None) -> List[Tuple[Any, str]]:
    """The actor and node of every other rank (or of group ranks ``readers``), in rank order
    (a group on the lane has an actor on every rank: see lane_possible)."""
    peers = []
    for j in (range(ctx.size) if readers is None else readers):
        actor = ctx.actors[j]
        assert actor is not None, "a lane group has an actor on every rank"
        if j != ctx.rank:
            peers.append((actor, ctx.node_ids[j]))
    return peers


def _pool_key(ctx: "GroupContext",
              readers: Optional[Sequence[int]] = None) -> Tuple[Tuple[str, ...], int]:
    ids = tuple(sorted(actor._actor_id.hex() for actor, _node in _peer_actors(ctx, readers)))
    return ids, _buffer_bytes(ctx)


def _buffer_bytes(ctx: "GroupContext") -> int:
    """Room for the largest lane message of the group: ``lane_bytes`` of arrays and the
    message around them (a channel never has to grow: Ray would keep the old buffer, and a
    growth interrupted by a timeout would lose the readers)."""
    return lane_bytes(ctx.options) + 512 * ctx.size + 16384


def open_channel(ctx: "GroupContext", readers: Optional[Sequence[int]] = None) -> Any:
    """This rank's channel (written here, read by every peer, or by group ranks
    ``readers``), or ``None`` if Ray cannot make one here (the group then stays off the lane
    on every rank)."""
    key = _pool_key(ctx, readers)
    with _POOL_LOCK:
        free = _POOL.get(key)
        if free:
            return free.pop()
    try:
        from ray.experimental.channel.shared_memory_channel import Channel

        me = ray.get_runtime_context().current_actor
        return Channel(me, _peer_actors(ctx, readers), typ=key[1])
    except Exception as exc:  # noqa: BLE001 - any failure means: no lane for this group
        logger.warning("raycoll: group %r stays off the shared-memory lane: cannot open a "
                       "channel on rank %d (%s: %s)", ctx.group_name, ctx.rank,
                       type(exc).__name__, exc)
        return None


def release_channel(ctx: "GroupContext", channel: Any,
                    readers: Optional[Sequence[int]] = None) -> None:
    """Give back a channel :func:`open_channel` returned (it was not used)."""
    _give_back(_pool_key(ctx, readers), channel)


def _give_back(key: Tuple[Tuple[str, ...], int], channel: Any) -> None:
    if channel is not None:
        with _POOL_LOCK:
            _POOL.setdefault(key, []).append(channel)


def _array_bytes(obj: Any, depth: int = 0) -> int:
    """The bytes of the arrays in ``obj`` (up to three levels of tuples and lists, as the
    framing looks): a message with more than a frame's worth is not framed at all."""
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if depth < 3 and isinstance(obj, (tuple, list)):
        return sum(_array_bytes(v, depth + 1) for v in obj)
    return 0


class LaneTransport(RoundTransport):
    """One group's lane on this rank: its own channel and its peers' (by group rank)."""

    name = "shared-memory lane"
    kind = "lane"

    def __init__(self, ctx: "GroupContext", out: Any, peers: Dict[int, Any], epoch: str) -> None:
        super().__init__(ctx, epoch, list(peers))
        # Channels outlive groups (see _POOL): a message from an earlier group on the same
        # channels carries another epoch and is skipped.
        self._key = _pool_key(ctx, list(peers))
        self._out = out
        self._in = peers
        for channel in peers.values():
            channel.ensure_registered_as_reader()
        crowded = oversubscribed(self.ctx.size)
        self._yield = float(or_default(ctx.options.lane_yield_s, YIELD_S))
        self.spin_s = 0.0 if crowded else SPIN_S
        self.yield_s = self._yield if crowded else 0.0
        self.poll_min_s, self.poll_max_s = POLL_MIN_S, POLL_MAX_S
        self._framed: Optional[Tuple[Any, Any]] = None  # (message, what is written for it)
        # Spinning backs off when a spin runs its full length (see ``SpinBackoff``).
        self._backoff = SpinBackoff(not crowded)

    @property
    def spins_failed(self) -> int:
        """Spins that ran their whole length without the peer's message."""
        return self._backoff.failed

    def _spun_out(self) -> None:
        self._backoff.spun_out(self.calls)
        if not self._backoff.on:
            self.spin_s, self.yield_s = 0.0, self._yield

    def _spin_timeout(self, spin: bool) -> float:
        if not self.spin_s and self._backoff.spinning(self.calls):
            self.spin_s, self.yield_s = SPIN_S, 0.0
        return self.spin_s if spin else 0.0

    def _write(self, message: Any, spin: bool) -> bool:
        if self._framed is None or self._framed[0] is not message:
            frame: Any = None
            if _array_bytes(message) <= FRAME_MAX_BYTES:
                parts = encode_round(message)
                if sum(p.nbytes for p in parts) <= FRAME_MAX_BYTES + FRAME_META_MAX_BYTES:
                    frame = b"".join(parts)
            if frame is None:  # a large one goes through Ray's serializer, once: a write
                # that must wait is tried again with it
                frame = self._out._worker.get_serialization_context().serialize(message)
            self._framed = (message, frame)
        timeout = self._spin_timeout(spin)
        try:
            self._out.write(self._framed[1], timeout=timeout)
            self._framed = None
            return True
        except _TIMEOUT:
            if timeout:
                self._spun_out()
            return False

    def _read(self, s: int, spin: bool) -> Any:
        timeout = self._spin_timeout(spin)
        try:
            message = self._in[s].read(timeout=timeout)
        except _TIMEOUT:
            if timeout:
                self._spun_out()
            return None
        if isinstance(message, BaseException):  # the channel's error bit (closed)
            raise message
        return decode_frame(message) if isinstance(message, bytes) else message

    def _write_reject(self, message: Any) -> None:
        self._out.write(message, timeout=0)

    def _shut(self) -> None:
        if self._out is not None:
            self._out.close()  # never reused

    def _release(self) -> None:
        out, self._out = self._out, None
        self._in.clear()
        _give_back(self._key, out)
