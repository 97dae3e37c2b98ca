"""``raycoll-bench``: the collective benchmark of raycoll, in the spirit of nccl-tests.

Run it as ``raycoll-bench`` or ``python -m raycoll.bench``::

    raycoll-bench --op all_reduce --sizes 4:64M:x4 --world-size 2 --check --vs gloo

For every operation, size and world size it forms one raycoll group of zero-CPU rank actors,
runs ``--warmup`` untimed iterations, one checked iteration with ``--check``, one barrier,
then ``--iters`` timed iterations, each timed alone inside every rank with
``time.perf_counter``; an iteration's time is the maximum over ranks (the same method as the
``--vs`` peers of :mod:`raycoll.bench.peers`, which run interleaved with raycoll, size by size, in
the same Ray). It prints an nccl-tests style table: size, element count, time (median over
iterations), algorithm bandwidth (``bytes / time``), bus bandwidth (algbw times nccl-tests'
factor for the operation) and the number of wrong elements.

``--pattern`` says how the timed calls follow each other: ``back-to-back`` (the default),
``after-barrier`` (each right after an untimed barrier of the same library, in raycoll and
in the peer alike) or ``after-pause`` (each after an untimed 1 ms sleep, as a loop that
computes between collectives): a wait strategy that spins well back to back may sleep
through the next call after a pause.

``send_recv`` times a round trip: rank 0 sends to the last rank (on another node with
``--nodes``), which sends it back.

Sizes follow nccl-tests: for ``all_reduce``, ``broadcast``, ``reduce`` and ``send_recv`` a
size is each rank's buffer; for the gathering, scattering and all-to-all operations it is the
large buffer (the gathered output, the reduce-scatter input, the all-to-all send buffer) and
each rank's share is ``size / world_size``.

Ray: an embedded local Ray by default (started here, stopped at the end); ``--address`` joins
an existing cluster; ``--nodes N`` starts N Ray nodes on this machine with
``ray.cluster_utils.Cluster`` and spreads the ranks over them in blocks (custom resources pin
them), so that cross-node paths can be measured on one machine.

``--json FILE`` writes a JSON array with one object per table row, with the fields of
:data:`ROW_FIELDS`: ``op``, ``bytes`` (the size run, nccl-tests terms), ``count`` (elements
per buffer, or per rank's chunk), ``dtype``, ``world_size``, ``nodes`` (distinct Ray nodes the
ranks ran on), ``backend``, ``time_us`` (median), ``min_us``, ``max_us``, ``algbw`` and
``busbw`` (GB/s, from the median), ``wrong`` (elements that failed ``--check``; ``null``
without it), ``peer``, ``peer_time_us`` (its median) and ``ratio`` (``peer_time_us /
time_us``; > 1: raycoll is faster) with ``--vs``. ``--baselines`` adds ``ray_rtt_us``,
``ray_get_bytes`` and ``ray_get_GBps``; ``--memory`` adds ``store_baseline_bytes``,
``store_peak_bytes``, ``store_after_bytes`` and ``store_settle_ms``.

The package, by concern: :mod:`~raycoll.bench.cli` (the command line and :func:`main`),
:mod:`~raycoll.bench.runner` (the driver: Ray, the rank actors, the loop, ``--memory``,
``--baselines``), :mod:`~raycoll.bench.ranks` (what runs inside a rank),
:mod:`~raycoll.bench.tables` (sizes, bandwidths, rows and the printed table: no Ray),
:mod:`~raycoll.bench.peers` (the ``--vs`` libraries) and :mod:`~raycoll.bench.floors` (Ray's
floors).
"""

from __future__ import annotations

from raycoll.bench.cli import main
from raycoll.bench.runner import run_bench
from raycoll.bench.tables import (
    ROW_FIELDS,
    Row,
    bus_factor,
    element_count,
    make_row,
    parse_size,
    parse_sizes,
    run_bytes,
    write_plot,
)

__all__ = ["main", "parse_sizes", "parse_size", "bus_factor", "element_count", "run_bytes",
           "make_row", "write_plot", "Row", "ROW_FIELDS", "run_bench"]
