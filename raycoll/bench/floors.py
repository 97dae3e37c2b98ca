"""Ray's floors, which ``raycoll-bench --baselines`` measures a raycoll collective against:
one actor-to-actor call (:func:`actor_round_trip_seconds`), and one ``ray.get`` of an array
another actor put, on another node where one exists (:func:`plain_get_seconds`). Both run in
zero-CPU actors and time with ``time.perf_counter`` inside them, as the benchmark's ranks do.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Dict, List, Optional

import numpy as np
import ray

from raycoll.bench.peers import DEFAULT_TIMEOUT

__all__ = ["actor_round_trip_seconds", "plain_get_seconds"]


class _ProbeActor:
    """Measures the Ray floors: actor call round trips, and plain puts and gets."""

    def __init__(self) -> None:
        self.array = np.zeros(0, dtype=np.uint8)

    def ping(self) -> None:
        return None

    def call_ping(self, other: Any, iters: int, warmup: int, timeout_s: float) -> List[float]:
        times = []
        for i in range(warmup + iters):
            start = time.perf_counter()
            ray.get(other.ping.remote(), timeout=timeout_s)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return times

    def put(self, nbytes: int) -> List[Any]:
        if self.array.nbytes != nbytes:
            self.array = np.ones(nbytes, dtype=np.uint8)
        return [ray.put(self.array)]  # in a list, so that the caller gets the reference

    def timed_get(self, refs: List[Any], timeout_s: float) -> float:
        start = time.perf_counter()
        value = ray.get(refs[0], timeout=timeout_s)
        elapsed = time.perf_counter() - start
        del value
        return elapsed


_ProbeRemote: Any = ray.remote(num_cpus=0)(_ProbeActor)


def _here() -> Dict[str, Any]:
    """Actor options that pin an actor to the driver's node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def actor_round_trip_seconds(
    iters: int, warmup: int = 10, timeout: timedelta = DEFAULT_TIMEOUT
) -> List[float]:
    """Seconds per ``ray.get(b.ping.remote())`` made by actor ``a``, both on the driver's node."""
    timeout_s = timeout.total_seconds()
    caller, callee = (_ProbeRemote.options(**_here()).remote() for _ in range(2))
    try:
        ref = caller.call_ping.remote(callee, iters, warmup, timeout_s)
        return list(ray.get(ref, timeout=timeout_s))
    finally:
        ray.kill(caller, no_restart=True)
        ray.kill(callee, no_restart=True)


def plain_get_seconds(
    nbytes: int,
    iters: int,
    node_resource: Optional[str] = None,
    warmup: int = 2,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> List[float]:
    """Seconds per ``ray.get`` of a fresh ``nbytes`` uint8 array, in an actor on the driver's node.

    The array is put by a second actor: on the node holding the custom resource
    ``node_resource`` when given (with ``ray.cluster_utils.Cluster``:
    ``cluster.add_node(resources={"peer_node": 1})``, then ``node_resource="peer_node"``),
    else on the driver's node, where the get is a zero-copy map of shared memory.
    """
    timeout_s = timeout.total_seconds()
    resources: Dict[str, float] = ray.cluster_resources()
    if node_resource is None:
        putter_options = _here()
    elif resources.get(node_resource, 0) <= 0:
        known = sorted(resources)
        raise ValueError(f"node_resource: expected one of {known}; got {node_resource!r}")
    else:
        putter_options = {"resources": {node_resource: 0.001}}
    putter = _ProbeRemote.options(**putter_options).remote()
    getter = _ProbeRemote.options(**_here()).remote()
    try:
        times = []
        for i in range(warmup + iters):
            refs = ray.get(putter.put.remote(nbytes), timeout=timeout_s)
            elapsed = ray.get(getter.timed_get.remote(refs, timeout_s), timeout=timeout_s)
            del refs  # frees the object before the next put
            if i >= warmup:
                times.append(float(elapsed))
        return times
    finally:
        ray.kill(putter, no_restart=True)
        ray.kill(getter, no_restart=True)
