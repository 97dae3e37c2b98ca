"""``raycoll-bench --calibrate``: measure the cost model's link costs on this cluster.

Two ranks on direct connections (one node: a Unix socket, link class ``unix``; with
``--nodes 2``, or ``--address`` of a cluster of several nodes, where the two ranks go to two
of its nodes: TCP, ``tcp``) all_reduce 4 B and a
large buffer (the largest of ``--sizes``): one round in which each rank sends ``b`` bytes,
receives ``b`` and reduces them, so ``T(b) = alpha + 2 beta b + gamma b``
(:mod:`raycoll.algorithms.cost`). ``gamma`` (seconds a reduced byte) is timed here, on the
driver's core. Between nodes, ``nic``, a byte through the node's link that its ranks share,
is ``2 beta``: what one byte each way took here. Prints the group option that carries them:
``create_group(..., options={"cost_model": {...}})``. The two ranks run the native executor,
so the same figures are also the ``socket`` link class's (a native message: the planner's,
:mod:`raycoll.algorithms.planner`); the ``segment`` class keeps its default (not measured
here yet).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict

import numpy as np

from raycoll.bench.runner import run_bench
from raycoll.bench.tables import Options

__all__ = ["calibrate", "reduce_seconds_per_byte"]


def reduce_seconds_per_byte(nbytes: int = 4 << 20, repeats: int = 20) -> float:
    """Seconds numpy takes to add one float32 byte into another (median of ``repeats``)."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.ones_like(a)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.add(a, b, out=a)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / a.nbytes


def calibrate(opts: Options) -> Dict[str, Any]:
    """The ``cost_model`` option measured with ``opts`` (its nodes, address, iterations and
    largest size; two ranks, ``transport="tcp"``)."""
    big = max(max(opts.sizes), 1 << 20)
    run = dataclasses.replace(opts, ops=["all_reduce"], sizes=[4, big], world_sizes=[2],
                              vs=None, check=False, memory=False, baselines=False, spread=True,
                              group_options={**opts.group_options, "transport": "tcp"})
    rows = run_bench(run)
    small, large = (next(r for r in rows if r.bytes == n) for n in (4, big))
    link = "tcp" if small.nodes > 1 else "unix"
    gamma = reduce_seconds_per_byte()
    # the fastest iteration of each size: the model prices the link, and anything slower is
    # other work on the machine (a stall of a loaded machine once priced alpha at 62 ms)
    alpha = small.min_us * 1e-6
    beta = max(0.0, (large.min_us * 1e-6 - alpha - gamma * big) / (2 * big))
    model: Dict[str, Any] = {link: {"alpha": alpha, "beta": beta},
                             "socket": {"alpha": alpha, "beta": beta}, "gamma": gamma}
    if link == "tcp":
        # the link between nodes, which a node's ranks share: a byte crosses it in 2 beta
        model["nic"] = 2 * beta
    return model
