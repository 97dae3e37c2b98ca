"""No leaks: object-store memory returns to its baseline after many collectives."""

from __future__ import annotations

import time

import numpy as np
import pytest

from helpers import store_used


def _many(rank, count, n):
    import raycoll

    x = np.ones(n, dtype=np.float32)
    for i in range(count):
        x[:] = 1.0
        if i % 4 == 2:
            raycoll.all_gather_into_tensor(np.empty(n * raycoll.get_world_size(), np.float32),
                                           x)
        else:
            raycoll.all_reduce(x)
    return float(x[0])


@pytest.mark.timeout(600)
def test_object_store_returns_to_baseline_after_1000_collectives_of_1_mib(ranks):
    # the first collectives set up the shared-memory lane: its channels stay (a fixed cost)
    assert ranks.run(_many, 2, 4, 1 << 18, timeout=120) == [2.0, 2.0]
    deadline = time.monotonic() + 30
    baseline = store_used()[0]
    while baseline and time.monotonic() < deadline:  # settle what earlier tests left
        time.sleep(0.5)
        baseline = store_used()[0]
    results = ranks.run(_many, 2, 1000, 1 << 18, timeout=300)  # 1 MiB of float32
    assert results == [2.0, 2.0]
    used = store_used()[0]
    deadline = time.monotonic() + 20
    while used > baseline and time.monotonic() < deadline:  # Ray frees asynchronously
        time.sleep(0.2)
        used = store_used()[0]
    assert used <= baseline, f"object store holds {used - baseline} bytes more than before"
