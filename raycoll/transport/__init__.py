"""How a collective's bytes move between ranks (see :mod:`raycoll.transport.base`).

- :mod:`raycoll.transport.base`: what the native transports share: the coordinator's checks
  while a call waits, progress reports, the waiting policy and the failure path;
- :mod:`raycoll.transport.segment`: ranks on one node, through the native core's node segment;
- :mod:`raycoll.transport.cores`: whether a node's ranks fit its cores (whether waits spin);
- :mod:`raycoll.transport.native_tcp`: direct sockets between ranks (any nodes), run by the
  native executor, over :mod:`~raycoll.transport.links` (the listener, the hello and the
  goodbye, a group's connections);
- :mod:`raycoll.transport.pipes` (point to point): pair pipes, shared memory on one node and
  :mod:`~raycoll.transport.sockpipes` (native socket pipes) across nodes;
- :mod:`raycoll.transport.selection`: which of them a group uses, and setting it up.

A group picks its transport once, at its first collective, the same on every rank (group
option ``transport``: ``"auto"``, ``"lane"``, ``"tcp"``, ``"store"``); what has none goes
through the coordinator and the Ray object store (raycoll.backends.cpu). The transports
run the native executor's plans (made in :mod:`raycoll.algorithms`) and point-to-point
messages.
"""
