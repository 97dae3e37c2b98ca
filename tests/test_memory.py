"""No leaks: object-store memory returns to its baseline after many collectives."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray


def _store_bytes_used() -> int:
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.object_store_bytes_used)


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
    deadline = time.monotonic() + 30
    baseline = _store_bytes_used()
    while baseline and time.monotonic() < deadline:  # settle what earlier tests left
        time.sleep(0.5)
        baseline = _store_bytes_used()
    results = ranks.run(_many, 2, 1000, 1 << 18, timeout=300)  # 1 MiB of float32
    assert results == [2.0, 2.0]
    used = _store_bytes_used()
    deadline = time.monotonic() + 20
    while used > baseline and time.monotonic() < deadline:  # Ray frees asynchronously
        time.sleep(0.2)
        used = _store_bytes_used()
    assert used <= baseline, f"object store holds {used - baseline} bytes more than before"
