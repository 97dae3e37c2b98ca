"""raycoll's CPU collective algorithms: the schedules (one module per family) and the
plans the native executor runs (over sockets, a node segment, or both), the topology, the
cost model and the planner that choose among them, the counters that prove their costs,
and the object-store steps of the fallback."""
