"""``raycoll-bench --calibrate``: measure the cost model's link costs on this cluster.

**Sockets.** Two ranks on direct connections (one node: a Unix socket, link class ``unix``;
with ``--nodes 2``, or ``--address`` of a cluster of several nodes, where the two ranks go to
two of its nodes: TCP, ``tcp``) all_reduce 4 B and a large buffer (the largest of
``--sizes``): one round in which each rank sends ``b`` bytes, receives ``b`` and reduces
them, so ``T(b) = alpha + 2 beta b + gamma b`` (:mod:`raycoll.algorithms.cost`). ``gamma``
(seconds a reduced byte) is timed here, on the driver's core. Between nodes, ``nic``, a byte
through the node's link that its ranks share, is ``2 beta``: what one byte each way took
here. The two ranks run the native executor, so the same figures are also the ``socket``
link class's (a native message: the planner's, :mod:`raycoll.algorithms.planner`).

**The node segment** (class ``segment``, where the native core is built): two ranks on one
node (the first) all_reduce 4 B, one segment step (``alpha``), and ``SEGMENT_PROBE_BYTES``,
streamed through the segment's halves (written in, reduce-scattered, copied out): its plan
(:func:`raycoll.algorithms.segment_plans.all_reduce`) priced as the planner prices plans
(:func:`raycoll.algorithms.planner.plan_time`, the node's cores shared) is linear in the
class's ``beta``, solved for the time measured.

Prints the group option that carries them: ``create_group(..., options={"cost_model":
{...}})``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Dict

import numpy as np

from raycoll.algorithms import segment_plans
from raycoll.algorithms.cost import CostModel
from raycoll.algorithms.planner import plan_time
from raycoll.bench.runner import run_bench
from raycoll.bench.tables import Options

__all__ = ["calibrate", "reduce_seconds_per_byte", "segment_beta", "SEGMENT_PROBE_BYTES"]

#: The segment's large probe: above one step (64 KiB), below cross-memory reads (1 MiB), so
#: it streams through the halves.
SEGMENT_PROBE_BYTES = 512 << 10


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


def segment_beta(seconds: float, nbytes: int, alpha: float, gamma: float, half: int,
                 one_step: int, cores: int) -> float:
    """The ``segment`` class's ``beta`` (>= 0) that prices a 2-rank all_reduce of ``nbytes``
    (float32) through a segment of halves ``half`` (one step up to ``one_step`` bytes) at
    ``seconds``, given the class's ``alpha``, ``gamma`` and the node's ``cores``."""
    plans = [segment_plans.all_reduce(nbytes // 4, 4, 2, me, half, one_step)
             for me in range(2)]
    nodes = ("node", "node")

    def price(beta: float) -> float:
        model = CostModel.of({"segment": {"alpha": alpha, "beta": beta}, "gamma": gamma})
        return plan_time(plans, nodes, model, cores)  # type: ignore[arg-type]

    base, unit = price(0.0), price(1e-9) - price(0.0)
    return max(0.0, (seconds - base) / unit * 1e-9) if unit > 0 else 0.0


def _segment(opts: Options, gamma: float) -> Dict[str, float]:
    """The ``segment`` class measured on two ranks of one node (empty without the core)."""
    from raycoll.native import core
    from raycoll.transport.segment import ONE_STEP_BYTES, SEGMENT_BYTES

    if core is None:
        return {}
    options = {k: v for k, v in opts.group_options.items() if k != "transport"}
    run = dataclasses.replace(opts, ops=["all_reduce"], sizes=[4, SEGMENT_PROBE_BYTES],
                              world_sizes=[2], nodes=1, vs=None, check=False, memory=False,
                              baselines=False, spread=False, one_node=True,
                              group_options=options)
    rows = run_bench(run)
    small, large = (next(r for r in rows if r.bytes == n) for n in (4, SEGMENT_PROBE_BYTES))
    alpha = small.min_us * 1e-6
    per_rank = int(options.get("node_segment_bytes") or SEGMENT_BYTES)
    half = max(core.PAGE, per_rank // 2 // core.PAGE * core.PAGE)
    beta = segment_beta(large.min_us * 1e-6, SEGMENT_PROBE_BYTES, alpha, gamma, half,
                        ONE_STEP_BYTES, os.cpu_count() or 1)
    return {"alpha": alpha, "beta": beta}


def calibrate(opts: Options) -> Dict[str, Any]:
    """The ``cost_model`` option measured with ``opts`` (its nodes, address, iterations and
    largest size; two ranks, ``transport="tcp"``; then two ranks on one node, the segment)."""
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
    segment = _segment(opts, gamma)
    if segment:
        model["segment"] = segment
    return model
