"""raycoll's CPU collective algorithms, written once over the round transports
(:mod:`raycoll.transport`), one module per family, with their topology, cost model and
counters. They know nothing of sockets or channels."""
