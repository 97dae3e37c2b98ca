"""How a collective's bytes move between ranks (see :mod:`raycoll.transport.base`).

- :mod:`raycoll.transport.base`: the round interface every CPU algorithm is written against,
  and the round loop, fingerprint checks and waiting policy all transports share;
- :mod:`raycoll.transport.segment`: ranks on one node, through the native core's node segment;
- :mod:`raycoll.transport.cores`: whether a node's ranks fit its cores (whether waits spin);
- :mod:`raycoll.transport.tcp`: direct sockets between ranks (any nodes): collective rounds,
  built on :mod:`~raycoll.transport.frames` (the wire format), :mod:`~raycoll.transport.links`
  (the listener and a group's connections);
- :mod:`raycoll.transport.pipes` (point to point): pair pipes, shared memory on one node and
  :mod:`~raycoll.transport.sockpipes` (native socket pipes) across nodes;
- :mod:`raycoll.transport.selection`: which of them a group uses, and setting it up.

A group picks its transport once, at its first collective, the same on every rank (group
option ``transport``: ``"auto"``, ``"lane"``, ``"tcp"``, ``"store"``); what has none goes
through the coordinator and the Ray object store (raycoll.backends.cpu). Transports
know nothing of collectives: they move rounds of payloads and point-to-point messages.
"""
