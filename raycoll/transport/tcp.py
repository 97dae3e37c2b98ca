"""Direct sockets between ranks: collectives across nodes, and point-to-point everywhere.

Ray stays the launcher, the discovery service and the failure detector; the bytes go
straight between the ranks' processes, as gloo's and NCCL's do: a socket has a far shorter
round trip and more bandwidth across nodes than a compiled-graph channel or a cross-node
``ray.get`` (the figures are in benchmarks/HISTORY.md).

- **Addresses.** Every process that joins a group listens on one TCP port (one listening
  socket per process, shared by all its groups) and reports it at rendezvous. It listens on
  the interface named by ``RAYCOLL_SOCKET_IFNAME`` (as ``GLOO_SOCKET_IFNAME``; ``lo`` keeps
  everything on 127.0.0.1), else on Ray's node address when the cluster has several nodes,
  else on 127.0.0.1.
- **Security.** The coordinator hands each generation of a group a random 16-byte secret
  over Ray's channels. A connection opens with a fixed-size hello (magic, group name,
  sender rank, purpose, secret); one that does not present the group's secret is closed
  before anything it sends reaches a buffer of the group.
- **Connections.** Lazily, one per (sender, receiver, purpose), over a Unix socket between
  ranks of one node (cheaper per message than TCP over loopback; ``RAYCOLL_UNIX_SOCKETS=0``
  turns it off), TCP between nodes: the sender connects; the
  receiver's listener hands the accepted socket to the group. ``"coll"`` connections carry
  collective rounds (:class:`TcpTransport`, strictly in the group's collective order);
  ``"p2p"`` connections carry point-to-point messages (:class:`Mailbox`). TCP_NODELAY on
  all; non-blocking, waited on with ``select``.
- **Frames.** ``header (magic, meta length, buffer count) | meta | buffer lengths |
  buffers``. The meta is a small pickle whose arrays travel as raw buffers: a sender
  hands the kernel its arrays' memory (``sendmsg``, no copy), a receiver reads them straight
  into their destination (``recv_into``): for rounds a per-peer buffer the algorithm reads
  in place, for a matched ``recv`` the user's array itself. A garbled frame (bad magic,
  absurd sizes) breaks the group with a clear error.
- **Failures.** A peer's process that dies closes its sockets: the survivors' reads end,
  and the coordinator (which learns of the death from the rank's lease) names the rank
  (``RankFailedError``). Destroying a group closes its sockets.

The modules: :mod:`raycoll.transport.frames` (the wire format), :mod:`raycoll.transport.links`
(addresses, the listener, the hello, a group's connections), :mod:`raycoll.transport.mailbox`
(point to point) and this one (:class:`TcpTransport`, collective rounds); the names other
modules use are importable from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from raycoll import errors
from raycoll.transport.base import Message, RoundTransport, project
from raycoll.transport.frames import (
    ABORT,
    GOODBYES,
    PeerLeft,
    Reader,
    Scratch,
    Writer,
    decode_round,
    encode_round,
)
from raycoll.transport.links import (
    CLOSED_GRACE_S,
    IFNAME_ENV,
    Links,
    Out,
    listen_address,
    listener,
    peer_failure,
    tcp_possible,
)
from raycoll.transport.cores import host_ranks, oversubscribed
from raycoll.transport.mailbox import P2P_SPIN_S, Mailbox
from raycoll.transport.native_tcp import NativeSockets, native_sockets_possible

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.context import Call, GroupContext

__all__ = ["listen_address", "listener", "tcp_possible", "Links", "TcpTransport", "Mailbox",
           "IFNAME_ENV", "CLOSED_GRACE_S", "P2P_SPIN_S"]


class TcpTransport(RoundTransport):
    """Collective rounds over direct connections (every rank sends every peer its
    projection of its payload each round, and reads each peer's)."""

    name = "direct connection"
    kind = "tcp"
    sparse = True

    def __init__(self, ctx: "GroupContext", links: Links) -> None:
        super().__init__(ctx, "tcp", [j for j in range(ctx.size) if j != ctx.rank])
        self.links = links
        self._writers: Dict[int, Writer] = {}
        self._message: Optional[Message] = None
        self._readers = {s: Reader() for s in self._peers}
        self._scratch = {s: Scratch() for s in self._peers}
        self._outs: Dict[int, Out] = {}
        self._reading: Optional[int] = None  # the peer read last (whose failure is named)
        #: the receive buffers' bytes now, and at most so far
        self._held = 0
        self.peak_recv_bytes = 0
        self.poll_min_s, self.poll_max_s = 0.002, 0.05
        self.failure_grace_s = CLOSED_GRACE_S
        #: the schedules' native runs, where every rank has the native core
        self.native: Optional[NativeSockets] = (
            NativeSockets(self, oversubscribed(host_ranks(ctx)))
            if native_sockets_possible(ctx, self._peers) else None)

    def run_native(self, call: "Call", plan: Any, flat: Any, codes: Any, op: Any,
                   more: Sequence[Any] = ()) -> None:
        """Run a native ``plan`` for ``call`` (see :mod:`.native_tcp`)."""
        assert self.native is not None, "run_native needs the native core on every rank"
        self.native.run(call, plan, flat, codes, op, more)
        self._done = (call.op, call.seq)
        self.calls += 1
        self.report()

    def fail_broken(self) -> None:
        """A native run broke the group: close, so that a rank arriving late fails too."""
        self._poisoned = True
        try:
            self._shut()
        except Exception:  # noqa: BLE001 - best effort: the coordinator knows
            pass

    def _out(self, dst: int) -> Out:
        out = self._outs.get(dst)
        if out is None:
            out = self._outs[dst] = self.links.outgoing(dst, "coll", self.ctx.timeout_s)
        return out

    def _write(self, message: Message, spin: bool) -> bool:
        if self._message is not message:
            kind, _epoch, key, fp, payload = message
            self._message = message
            self._writers = {}
            same: Optional[List[memoryview]] = None  # one encoding for every peer alike
            for j in self._dests:
                mine = project(payload, j)
                if mine is payload:
                    same = same if same is not None else encode_round((kind, key, fp, payload))
                    self._writers[j] = Writer(list(same))
                else:
                    self._writers[j] = Writer(encode_round((kind, key, fp, mine)))
        for j, writer in list(self._writers.items()):
            if writer.push(self._out(j).sock):
                del self._writers[j]
        if self._writers:
            return False
        self._message = None
        return True

    def _read(self, s: int, spin: bool) -> Optional[Message]:
        sock = self.links.incoming(s, "coll")
        if sock is None:
            return None
        self._reading = s
        scratch = self._scratch[s]
        before = scratch.nbytes
        got = self._readers[s].pull(sock, scratch.place)
        if scratch.nbytes != before:
            self._held += scratch.nbytes - before
            self.peak_recv_bytes = max(self.peak_recv_bytes, self._held)
        if got is None:
            return None
        meta, bufs = got
        message = decode_round(meta, bufs)
        if message in GOODBYES:
            raise PeerLeft(f"rank {self.ctx.global_ranks[s]} closed the connection", message)
        kind, key, fp, payload = message
        return kind, self.epoch, tuple(key), fp, payload

    def _suspects(self, exc: BaseException) -> Sequence[int]:
        return self.links.suspects(self._reading, exc)

    def _unexplained(self, call: Any, exc: BaseException) -> errors.RaycollError:
        return peer_failure(self.links, self.ctx.global_ranks,
                            f"{call.op} #{call.seq} on group {self.ctx.group_name!r}",
                            self._reading, exc, **self.ctx.ctx(call))

    def _idle(self, seconds: float, pending: Sequence[int]) -> None:
        read = [sock for s in pending if (sock := self.links.incoming(s, "coll")) is not None]
        write = [self._outs[j].sock for j in self._writers if j in self._outs]
        self.links.wait(read, write, seconds)

    def _write_reject(self, message: Message) -> None:
        kind, _epoch, key, fp, payload = message
        for j in self._peers:
            Writer(encode_round((kind, key, fp, payload))).push(self._out(j).sock)

    def _shut(self) -> None:
        self.links.close(ABORT)  # broken: the peers must fail too

    def close(self) -> None:
        if self.native is not None:
            self.native.close()
        super().close()
