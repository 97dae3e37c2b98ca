"""No leaks: object-store memory returns to its baseline after many collectives that go
through the object store (the group's transport forced to ``"store"``)."""

from __future__ import annotations

import time
from typing import Any, Dict

import numpy as np
import pytest

from helpers import store_used

#: Keep the group off the shared-memory lane, the node segment and direct connections: every
#: collective's arrays are put in the object store for the peers.
STORE = {"transport": "store"}


def _many(rank: int, count: int, n: int) -> Dict[str, Any]:
    import raycoll
    from raycoll.groups import world

    pg = world().default
    x = np.ones(n, dtype=np.float32)
    transports, through_store = set(), 0
    for i in range(count):
        x[:] = 1.0
        if i % 4 == 2:
            raycoll.all_gather_into_tensor(np.empty(n * raycoll.get_world_size(), np.float32),
                                           x)
        else:
            raycoll.all_reduce(x)
        route = pg.last_route
        transports.add(route.transport)
        # "objects:<k>": this rank put k objects in the store for its peers
        through_store += any(s.startswith("objects:") and s != "objects:0"
                             for s in route.steps)
    return {"value": float(x[0]), "transports": sorted(transports),
            "through_store": through_store}


@pytest.mark.timeout(600)
def test_object_store_returns_to_baseline_after_1000_collectives_of_1_mib(ranks):
    # the first collectives set up what stays for the group's life (a fixed cost)
    first = ranks.run(_many, 2, 4, 1 << 18, timeout=120, options=STORE)
    assert [r["value"] for r in first] == [2.0, 2.0], first
    deadline = time.monotonic() + 30
    baseline = store_used()[0]
    while baseline and time.monotonic() < deadline:  # settle what earlier tests left
        time.sleep(0.5)
        baseline = store_used()[0]
    results = ranks.run(_many, 2, 1000, 1 << 18, timeout=300, options=STORE)  # 1 MiB float32
    assert [r["value"] for r in results] == [2.0, 2.0], results
    # every collective went through the object store on both ranks
    assert all(r["transports"] == ["store"] and r["through_store"] == 1000 for r in results), \
        results
    used = store_used()[0]
    deadline = time.monotonic() + 30
    while used > baseline and time.monotonic() < deadline:  # Ray frees asynchronously
        time.sleep(0.2)
        used = store_used()[0]
    assert used <= baseline, f"object store holds {used - baseline} bytes more than before"
