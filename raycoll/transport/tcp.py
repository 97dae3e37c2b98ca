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
  turns it off), TCP between nodes: the sender connects; the receiver's listener hands the
  accepted socket to the group. ``"ncoll"`` connections carry the native executor's
  collective messages (:mod:`raycoll.transport.native_tcp`, strictly in the group's
  collective order); ``"p2p"`` connections carry point-to-point messages to ranks on other nodes (the native
  socket pipes of :mod:`raycoll.transport.sockpipes`).
  TCP_NODELAY on all.
- **Failures.** A peer's process that dies closes its sockets: the survivors' reads end,
  and the coordinator (which learns of the death from the rank's lease) names the rank
  (``RankFailedError``). Destroying a group closes its sockets.

The modules: :mod:`raycoll.transport.links` (addresses, the listener, the hello and the
goodbye, a group's connections),
:mod:`raycoll.transport.native_tcp` (the
native executor's runs) and this one (:class:`TcpTransport`, what a group's collectives on
sockets hold: the links, the native runs, the coordinator's checks and the counters); the
names other modules use are importable from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from raycoll.transport.base import RoundTransport
from raycoll.transport.cores import host_ranks, oversubscribed
from raycoll.transport.links import (
    CLOSED_GRACE_S,
    IFNAME_ENV,
    Links,
    listen_address,
    listener,
    tcp_possible,
)
from raycoll.transport.native_tcp import NativeSockets

if TYPE_CHECKING:  # pragma: no cover
    from raycoll.context import Call, GroupContext

__all__ = ["listen_address", "listener", "tcp_possible", "Links", "TcpTransport", 
           "IFNAME_ENV", "CLOSED_GRACE_S"]


class TcpTransport(RoundTransport):
    """A group's collectives over direct connections on this rank: each a plan of the
    native executor (:attr:`native`), checked with the coordinator while it waits. Made only
    where every rank of the group has the native core."""

    name = "direct connection"
    kind = "tcp"

    def __init__(self, ctx: "GroupContext", links: Links) -> None:
        super().__init__(ctx)
        self.links = links
        self.failure_grace_s = CLOSED_GRACE_S
        #: the native runs of the group's plans
        self.native = NativeSockets(self, oversubscribed(host_ranks(ctx)))
        #: what runs ``raycoll.all_reduce``'s short path on this group (its native runs)
        self.fast = self.native

    def run_native(self, call: "Call", plan: Any, flat: Any, codes: Any, op: Any,
                   more: Sequence[Any] = ()) -> None:
        """Run a native ``plan`` for ``call`` (see :mod:`.native_tcp`)."""
        self.native.run(call, plan, flat, codes, op, more)
        self._done = (call.op, call.seq)
        self.calls += 1
        if self._report_timer is None:  # (else the timer's report is on its way)
            self.report()

    def fail_broken(self) -> None:
        """A native run broke the group: close, so that a rank arriving late fails too."""
        self._poisoned = True
        try:
            self._shut()
        except Exception:  # noqa: BLE001 - best effort: the coordinator knows
            pass

    def _shut(self) -> None:
        self.links.close()  # broken: the peers must fail too

    def close(self) -> None:
        self.native.close()
        super().close()
