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
goodbye, a group's connections) and :mod:`raycoll.transport.native_tcp`
(:class:`~raycoll.transport.native_tcp.NativeSockets`: a group's collectives on sockets, the
native executor's runs, the coordinator's checks and the counters); the names other modules
use are importable from here.
"""

from __future__ import annotations

from raycoll.transport.links import (
    CLOSED_GRACE_S,
    IFNAME_ENV,
    Links,
    listen_address,
    listener,
    tcp_possible,
)
from raycoll.transport.native_tcp import NativeSockets

__all__ = ["listen_address", "listener", "tcp_possible", "Links", "NativeSockets",
           "IFNAME_ENV", "CLOSED_GRACE_S"]
