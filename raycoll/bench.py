"""``raycoll-bench``: the collective benchmark of raycoll, in the spirit of nccl-tests.

Run it as ``raycoll-bench`` or ``python -m raycoll.bench``::

    raycoll-bench --op all_reduce --sizes 4:64M:x4 --world-size 2 --check --vs gloo

For every operation, size and world size it forms one raycoll group of zero-CPU rank actors,
runs ``--warmup`` untimed iterations, one checked iteration with ``--check``, one barrier,
then ``--iters`` timed iterations, each timed alone inside every rank with
``time.perf_counter``; an iteration's time is the maximum over ranks (the same method as the
``--vs`` peers of :mod:`raycoll._peers`, which run interleaved with raycoll, size by size, in
the same Ray). It prints an nccl-tests style table: size, element count, time (median over
iterations), algorithm bandwidth (``bytes / time``), bus bandwidth (algbw times nccl-tests'
factor for the operation) and the number of wrong elements.

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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import ray

from raycoll._peers import (
    OPS,
    GlooPeer,
    NotSupportedByPeer,
    Peer,
    RayCollectivePeer,
    actor_round_trip_seconds,
    canonical_op,
    plain_get_seconds,
)

__all__ = ["main", "parse_sizes", "parse_size", "bus_factor", "Row", "ROW_FIELDS", "run_bench"]

#: Seconds any single benchmark call (all iterations of one size) may take.
CALL_TIMEOUT_S = 600.0

# Operations whose size is the large buffer, cut into ``world_size`` equal chunks.
_CHUNKED = frozenset(OPS) - {"all_reduce", "broadcast", "reduce", "barrier", "send_recv"}

_PEERS: Dict[str, Callable[[], Peer]] = {"gloo": GlooPeer, "ray-collective": RayCollectivePeer}

_NODE_SLOT = "raycoll_bench_rank_slot"
_PEER_SLOT = "raycoll_bench_peer_slot"
_FAR_NODE = "raycoll_bench_far_node"
_FREE_PERIOD_ENV = "RAY_free_objects_period_milliseconds"

#: The fields of every row in ``--json`` output, in order.
ROW_FIELDS: Tuple[str, ...] = (
    "op", "bytes", "count", "dtype", "world_size", "nodes", "backend", "time_us", "min_us",
    "max_us", "algbw", "busbw", "wrong", "peer", "peer_time_us", "ratio",
)  # fmt: skip


# ---------------------------------------------------------------------- pure logic
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"4"``, ``"4K"``, ``"256KiB"``, ``"64M"``, ``"1G"`` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"--sizes: expected a size like 4, 4K, 256K, 64M or 1G; got {text!r}")
    return int(match.group(1)) * _UNITS[unit]


def parse_sizes(text: str) -> List[int]:
    """A comma list (``4,4K,64M``) or a range ``MIN:MAX:xFACTOR`` (``4:64M:x4``), or both."""
    sizes: List[int] = []
    for part in text.split(","):
        if not part.strip():
            continue
        if ":" not in part:
            sizes.append(parse_size(part))
            continue
        pieces = part.split(":")
        if len(pieces) not in (2, 3):
            raise ValueError(f"--sizes: a range is MIN:MAX[:xFACTOR]; got {part!r}")
        low, high = parse_size(pieces[0]), parse_size(pieces[1])
        factor_text = pieces[2].strip().lstrip("xX") if len(pieces) == 3 else "2"
        try:
            factor = int(factor_text)
        except ValueError:
            factor = 0
        if factor < 2 or low < 1 or high < low:
            raise ValueError(f"--sizes: a range needs 1 <= MIN <= MAX and a factor >= 2 "
                             f"(e.g. 4:64M:x4); got {part!r}")
        size = low
        while size <= high:
            sizes.append(size)
            size *= factor
    if not sizes:
        raise ValueError(f"--sizes: no size given in {text!r}")
    return sizes


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth factor: busbw = algbw * factor."""
    n = world_size
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("broadcast", "reduce", "send_recv"):
        return 1.0
    if op == "barrier":
        return 0.0
    return (n - 1) / n  # all_gather*, reduce_scatter*, all_to_all*, gather, scatter


def element_count(op: str, nbytes: int, itemsize: int, world_size: int) -> int:
    """Elements in each rank's buffer, or in each rank's chunk for chunked ops (>= 1)."""
    elements = nbytes // itemsize
    if op in _CHUNKED:
        elements //= world_size
    return max(1, elements)


def run_bytes(op: str, count: int, itemsize: int, world_size: int) -> int:
    """The size actually run, in nccl-tests terms (0 for barrier)."""
    if op == "barrier":
        return 0
    return count * itemsize * (world_size if op in _CHUNKED else 1)


@dataclass
class Row:
    """One line of the table (and one object of ``--json``)."""

    op: str
    bytes: int
    count: int
    dtype: str
    world_size: int
    nodes: int
    backend: str
    time_us: float
    min_us: float
    max_us: float
    algbw: float
    busbw: float
    wrong: Optional[int]
    peer: Optional[str] = None
    peer_time_us: Optional[float] = None
    ratio: Optional[float] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> Dict[str, Any]:
        data = asdict(self)
        extra = data.pop("extra")
        data.update(extra)
        return data


def _stats(times: Sequence[float]) -> Tuple[float, float, float]:
    us = np.asarray(times, dtype=np.float64) * 1e6
    return float(np.median(us)), float(us.min()), float(us.max())


def make_row(op: str, nbytes: int, count: int, dtype: str, world_size: int, nodes: int,
             backend: str, times: Sequence[float], wrong: Optional[int]) -> Row:
    """A row from per-iteration times (seconds) of one op and size."""
    med, low, high = _stats(times)
    algbw = nbytes / (med * 1e-6) / 1e9 if med > 0 else 0.0
    return Row(op, nbytes, count, dtype, world_size, nodes, backend, med, low, high, algbw,
               algbw * bus_factor(op, world_size), wrong)


# ---------------------------------------------------------------------- inside the ranks
def _pattern(rank: int, chunk: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Small exact integers that differ per rank and chunk (sums stay exact in any dtype)."""
    return ((np.arange(count) + 7 * rank + 3 * chunk) % 13 + 1).astype(dtype)


Step = Callable[[], Any]
Check = Callable[[], int]


def _raycoll_step(op: str, count: int, dtype_name: str, rank: int, world: int,
                  group: str) -> Tuple[Step, Check]:
    """One iteration of ``op`` on ``group`` (zeros, like the peers), and a checked iteration
    that fills the inputs with :func:`_pattern`, runs once and counts wrong output elements."""
    import raycoll

    dt = np.dtype(dtype_name)
    W = world

    def zeros(n: int = count) -> np.ndarray:
        return np.zeros(n, dtype=dt)

    def pat(r: int, j: int = 0) -> np.ndarray:
        return _pattern(r, j, count, dt)

    def summed(j: int = 0) -> np.ndarray:
        return np.sum([pat(r, j) for r in range(W)], axis=0).astype(dt)

    def wrong(got: np.ndarray, want: np.ndarray) -> int:
        return int(np.count_nonzero(np.asarray(got).reshape(-1) != np.asarray(want).reshape(-1)))

    x = zeros()
    if op == "all_reduce":
        def check() -> int:
            x[:] = pat(rank)
            raycoll.all_reduce(x, group=group)
            return wrong(x, summed())
        return (lambda: raycoll.all_reduce(x, group=group)), check
    if op == "broadcast":
        def check() -> int:
            x[:] = pat(0) if rank == 0 else 0
            raycoll.broadcast(x, 0, group=group)
            return wrong(x, pat(0))
        return (lambda: raycoll.broadcast(x, 0, group=group)), check
    if op == "reduce":
        def check() -> int:
            x[:] = pat(rank)
            raycoll.reduce(x, 0, group=group)
            return wrong(x, summed()) if rank == 0 else 0
        return (lambda: raycoll.reduce(x, 0, group=group)), check
    if op == "all_gather":
        outs = [zeros() for _ in range(W)]

        def check() -> int:
            x[:] = pat(rank)
            raycoll.all_gather(outs, x, group=group)
            return sum(wrong(outs[s], pat(s)) for s in range(W))
        return (lambda: raycoll.all_gather(outs, x, group=group)), check
    if op == "all_gather_into_tensor":
        big = zeros(count * W)

        def check() -> int:
            x[:] = pat(rank)
            raycoll.all_gather_into_tensor(big, x, group=group)
            return wrong(big, np.concatenate([pat(s) for s in range(W)]))
        return (lambda: raycoll.all_gather_into_tensor(big, x, group=group)), check
    if op == "reduce_scatter":
        ins = [zeros() for _ in range(W)]

        def check() -> int:
            for j in range(W):
                ins[j][:] = pat(rank, j)
            raycoll.reduce_scatter(x, ins, group=group)
            return wrong(x, summed(rank))
        return (lambda: raycoll.reduce_scatter(x, ins, group=group)), check
    if op == "reduce_scatter_tensor":
        big = zeros(count * W)

        def check() -> int:
            big[:] = np.concatenate([pat(rank, j) for j in range(W)])
            raycoll.reduce_scatter_tensor(x, big, group=group)
            return wrong(x, summed(rank))
        return (lambda: raycoll.reduce_scatter_tensor(x, big, group=group)), check
    if op == "all_to_all":
        ins, outs = [zeros() for _ in range(W)], [zeros() for _ in range(W)]

        def check() -> int:
            for j in range(W):
                ins[j][:] = pat(rank, j)
            raycoll.all_to_all(outs, ins, group=group)
            return sum(wrong(outs[s], pat(s, rank)) for s in range(W))
        return (lambda: raycoll.all_to_all(outs, ins, group=group)), check
    if op == "all_to_all_single":
        src, dst = zeros(count * W), zeros(count * W)

        def check() -> int:
            src[:] = np.concatenate([pat(rank, j) for j in range(W)])
            raycoll.all_to_all_single(dst, src, group=group)
            return wrong(dst, np.concatenate([pat(s, rank) for s in range(W)]))
        return (lambda: raycoll.all_to_all_single(dst, src, group=group)), check
    if op == "gather":
        outs = [zeros() for _ in range(W)] if rank == 0 else None

        def check() -> int:
            x[:] = pat(rank)
            raycoll.gather(x, outs, 0, group=group)
            return sum(wrong(outs[s], pat(s)) for s in range(W)) if outs is not None else 0
        return (lambda: raycoll.gather(x, outs, 0, group=group)), check
    if op == "scatter":
        pieces = [zeros() for _ in range(W)] if rank == 0 else None

        def check() -> int:
            if pieces is not None:
                for j in range(W):
                    pieces[j][:] = pat(0, j)
            raycoll.scatter(x, pieces, 0, group=group)
            return wrong(x, pat(0, rank))
        return (lambda: raycoll.scatter(x, pieces, 0, group=group)), check
    if op == "barrier":
        def check() -> int:
            raycoll.barrier(group=group)
            return 0
        return (lambda: raycoll.barrier(group=group)), check
    if op == "send_recv":
        # a round trip between rank 0 and the last rank (on another node with --nodes)
        got = zeros()
        peer = W - 1 if rank == 0 else 0

        def ping_pong() -> None:
            if rank == 0:
                raycoll.send(x, peer, group=group)
                raycoll.recv(got, peer, group=group)
            elif rank == W - 1:
                raycoll.recv(got, peer, group=group)
                raycoll.send(x, peer, group=group)

        def check() -> int:
            x[:] = pat(rank)
            ping_pong()
            return wrong(got, pat(peer)) if rank in (0, W - 1) else 0
        return ping_pong, check
    raise ValueError(f"op: expected one of {', '.join(OPS)}; got {op!r}")


class BenchRank:
    """A benchmark rank: an actor that joins a raycoll group and times collectives on it."""

    def placement(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def bench(self, op: str, count: int, dtype: str, iters: int, warmup: int, check: bool,
              group: str) -> Tuple[List[float], Optional[int]]:
        import raycoll
        from raycoll.group import world as _world

        pg = _world().resolve(group)
        rank, world = pg.rank(), pg.size()  # type: ignore[union-attr]
        step, checked = _raycoll_step(op, count, dtype, rank, world, group)
        for _ in range(warmup):
            step()
        wrong = checked() if check else None
        raycoll.barrier(group=group)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return times, wrong


_BenchRankRemote: Any = ray.remote(BenchRank)


# ---------------------------------------------------------------------- progress
class _Progress:
    """tqdm when installed, else one updating line on stderr (nothing when not a TTY)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done = total, 0
        self.enabled = enabled and total > 1 and sys.stderr.isatty()
        self._bar: Any = None
        if not self.enabled:
            return
        try:
            from tqdm import tqdm  # type: ignore[import-untyped]
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, file=sys.stderr, leave=False, unit="row")

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description(label)
            self._bar.update(1)
        else:
            sys.stderr.write(f"\r[{self.done}/{self.total}] {label:<48}")
            sys.stderr.flush()

    def emitting(self) -> ContextManager[Any]:
        """Around printing a row: the bar steps aside and is redrawn after."""
        if self._bar is not None:
            return self._bar.external_write_mode(file=sys.stdout)
        if self.enabled:
            sys.stderr.write("\r" + " " * 64 + "\r")
        return contextlib.nullcontext()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            sys.stderr.write("\r" + " " * 64 + "\r")
            sys.stderr.flush()


# ---------------------------------------------------------------------- object-store memory
class StoreSampler:
    """Samples the object store's bytes in use, summed over all nodes, from a driver thread.

    Asks a raylet for its global memory info (what ``ray memory --stats-only`` prints) as fast
    as it answers (every few milliseconds): the peak it reports during an operation is the
    largest sample, so a lower bound of the true peak that is close to it when an operation
    lasts several sampling periods.
    """

    def __init__(self) -> None:
        try:
            from ray._private.grpc_utils import init_grpc_channel
            from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc
        except ImportError as exc:
            raise RuntimeError(f"--memory asks a raylet for the store's use over gRPC, which "
                               f"needs ray[default]: pip install 'raycoll[bench]' ({exc})") from exc

        node = next(n for n in ray.nodes() if n["Alive"])
        address = f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"
        self._stub = node_manager_pb2_grpc.NodeManagerServiceStub(init_grpc_channel(address))
        self._request = node_manager_pb2.FormatGlobalMemoryInfoRequest(include_memory_info=False)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.peak = 0

    def used(self) -> int:
        """Bytes in use in the object stores of all nodes now."""
        reply = self._stub.FormatGlobalMemoryInfo(self._request, timeout=30.0)
        return int(reply.store_stats.object_store_bytes_used)

    def start(self) -> None:
        self.peak = self.used()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="raycoll-bench-store", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30.0)
        return self.peak

    def settle(self, baseline: int, within_s: float = 2.0) -> Tuple[int, float]:
        """Bytes in use once back at ``baseline`` (or after ``within_s``), and how long it took
        (Ray frees objects asynchronously once their last reader drops them)."""
        start = time.perf_counter()
        used = self.used()
        while used > baseline and time.perf_counter() - start < within_s:
            self._stop.wait(0.02)  # a measurement interval, not a wait for an event
            used = self.used()
        return used, time.perf_counter() - start


# ---------------------------------------------------------------------- driver side
@dataclass
class Options:
    """Everything one run of the benchmark needs (the parsed command line)."""

    ops: List[str]
    sizes: List[int]
    world_sizes: List[int]
    nodes: int = 1
    address: Optional[str] = None
    backend: str = "objstore"
    dtype: str = "float32"
    iters: int = 20
    warmup: int = 5
    check: bool = False
    vs: Optional[str] = None
    group_options: Dict[str, Any] = field(default_factory=dict)
    baselines: bool = False
    memory: bool = False
    free_period_ms: int = 10
    object_store_mb: Optional[int] = None
    progress: bool = True


def configure_ray_env(opts: Options) -> None:
    """Settings for a Ray this run starts (none when Ray is already up in this process).

    Ray frees unused objects in batches, by default once a second; until then each put lands in
    store memory not touched lately, which costs page faults (large puts ~3x slower on the
    reference machine). The raylets read the period from the environment; a user's value wins.
    """
    if opts.free_period_ms > 0 and not ray.is_initialized() and not opts.address:
        os.environ.setdefault(_FREE_PERIOD_ENV, str(opts.free_period_ms))


class _Ray:
    """The Ray this run uses: the caller's, an embedded local one, or a local multi-node one."""

    def __init__(self, opts: Options) -> None:
        self.cluster: Any = None
        self.started = False
        self.nodes = max(1, opts.nodes)
        most = max(opts.world_sizes)
        if ray.is_initialized():
            if opts.nodes > 1:
                raise ValueError("--nodes: Ray is already initialized in this process; "
                                 "--nodes starts its own local cluster and needs it not to be")
            return
        store = opts.object_store_mb
        configure_ray_env(opts)
        if opts.nodes > 1:
            from ray.cluster_utils import Cluster

            # The local nodes share this machine: direct connections stay on loopback (the
            # nodes' workers inherit the environment).
            os.environ.setdefault("RAYCOLL_SOCKET_IFNAME", "lo")

            per_node = math.ceil(most / opts.nodes)
            need = max(opts.sizes) * 3 * per_node + (256 << 20)
            store_bytes = (store << 20) if store else max(1 << 30, need)
            self.cluster = Cluster()
            for i in range(opts.nodes):
                resources = {_NODE_SLOT: per_node, _PEER_SLOT: per_node}
                if i == opts.nodes - 1:
                    resources[_FAR_NODE] = 1
                self.cluster.add_node(num_cpus=max(2, per_node), resources=resources,
                                      object_store_memory=store_bytes,
                                      include_dashboard=False)
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, log_to_driver=False)
        elif opts.address:
            ray.init(address=opts.address, log_to_driver=False)
        else:
            # address="local": a new embedded Ray even when a `ray start` cluster is running.
            kwargs: Dict[str, Any] = {"address": "local", "num_cpus": max(2, most),
                                      "include_dashboard": False, "log_to_driver": False}
            if store:
                kwargs["object_store_memory"] = store << 20
            ray.init(**kwargs)
        self.started = True

    def rank_options(self) -> Dict[str, Any]:
        if self.cluster is not None:
            return {"num_cpus": 0, "resources": {_NODE_SLOT: 1}}
        return {"num_cpus": 0}

    def peer_options(self) -> Dict[str, Any]:
        if self.cluster is not None:
            return {"resources": {_PEER_SLOT: 1}}
        return {}

    def close(self) -> None:
        if self.started:
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()


class _Ranks:
    """``world_size`` benchmark rank actors in one raycoll group."""

    def __init__(self, world_size: int, backend: str, options: Dict[str, Any],
                 actor_options: Dict[str, Any]) -> None:
        import raycoll

        self.world_size = world_size
        self.backend = backend
        self.group = f"bench-{uuid.uuid4().hex[:8]}"
        # Block placement: with resource slots per node, ranks fill node after node.
        self.actors = [_BenchRankRemote.options(**actor_options).remote()
                       for _ in range(world_size)]
        try:
            places = ray.get([a.placement.remote() for a in self.actors], timeout=CALL_TIMEOUT_S)
            self.nodes = len(set(places))
            raycoll.create_group(self.actors, backend=backend, group_name=self.group,
                                 timeout=CALL_TIMEOUT_S, options=options)
        except BaseException:
            self._kill()
            raise

    def run(self, op: str, count: int, dtype: str, iters: int, warmup: int,
            check: bool) -> Tuple[List[float], Optional[int]]:
        refs = [a.bench.remote(op, count, dtype, iters, warmup, check, self.group)
                for a in self.actors]
        results = ray.get(refs, timeout=CALL_TIMEOUT_S)
        times = [max(t) for t in zip(*(r[0] for r in results))]
        wrongs = [r[1] for r in results]
        wrong = None if any(w is None for w in wrongs) else int(sum(wrongs))  # type: ignore[arg-type]
        return times, wrong

    def _kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)

    def close(self) -> None:
        import raycoll

        try:
            raycoll.destroy_group(self.group)
        except ValueError:
            pass
        self._kill()


def _jobs(opts: Options) -> List[Tuple[int, str, int]]:
    jobs = []
    for world_size in opts.world_sizes:
        for op in opts.ops:
            for nbytes in ([0] if op == "barrier" else opts.sizes):
                jobs.append((world_size, op, nbytes))
    return jobs


def run_bench(opts: Options, emit: Callable[[Row], None] = lambda row: None) -> List[Row]:
    """Run the benchmark described by ``opts``; ``emit`` sees each row as soon as it is done."""
    env = _Ray(opts)
    rows: List[Row] = []
    itemsize = np.dtype(opts.dtype).itemsize
    progress = _Progress(len(_jobs(opts)), opts.progress)
    sampler = StoreSampler() if opts.memory else None
    try:
        rtt_before = _rtt_us() if opts.baselines else None
        for world_size in opts.world_sizes:
            ranks = _Ranks(world_size, opts.backend, opts.group_options, env.rank_options())
            peer: Optional[Peer] = None
            try:
                if opts.vs:
                    peer = _PEERS[opts.vs]()
                    peer.setup(world_size, env.peer_options())
                for ws, op, nbytes in _jobs(opts):
                    if ws != world_size:
                        continue
                    if op == "send_recv" and world_size < 2:
                        progress.step(f"{op} skipped (needs 2 ranks)")
                        continue
                    count = element_count(op, nbytes, itemsize, world_size)
                    real = run_bytes(op, count, itemsize, world_size)
                    if sampler is not None:
                        baseline = sampler.used()
                        sampler.start()
                    times, wrong = ranks.run(op, count, opts.dtype, opts.iters, opts.warmup,
                                             opts.check)
                    row = make_row(op, real, count, opts.dtype, world_size, ranks.nodes,
                                   opts.backend, times, wrong)
                    if sampler is not None:
                        peak = sampler.stop()
                        after, settle_s = sampler.settle(baseline)
                        row.extra.update(store_baseline_bytes=baseline, store_peak_bytes=peak,
                                         store_after_bytes=after, store_settle_ms=settle_s * 1e3)
                    if peer is not None:
                        _add_peer(row, peer, op, real, opts)
                    rows.append(row)
                    with progress.emitting():
                        emit(row)
                    progress.step(f"{op} {_fmt_size(real)} x{world_size}")
            finally:
                if peer is not None:
                    peer.close()
                ranks.close()
        if opts.baselines:
            _add_baselines(rows, opts, rtt_before, env)
    finally:
        progress.close()
        env.close()
    return rows


def _add_peer(row: Row, peer: Peer, op: str, nbytes: int, opts: Options) -> None:
    row.peer = peer.name
    try:
        times = peer.run(op, nbytes, opts.dtype, opts.iters, opts.warmup)
    except NotSupportedByPeer as exc:
        row.extra["peer_note"] = exc.reason
        return
    row.peer_time_us = _stats(times)[0]
    row.ratio = row.peer_time_us / row.time_us if row.time_us > 0 else None


def _rtt_us() -> List[float]:
    return [t * 1e6 for t in actor_round_trip_seconds(100, warmup=20)]


def _add_baselines(rows: List[Row], opts: Options, rtt_before: Optional[List[float]],
                   env: _Ray) -> None:
    """Ray's floors in this run: an actor-call round trip (before and after the rows), and one
    plain ``ray.get`` of the largest size (from the farthest node with ``--nodes``)."""
    rtt = float(np.median((rtt_before or []) + _rtt_us()))
    far = _FAR_NODE if env.cluster is not None else None
    nbytes = max(opts.sizes)
    get_s = float(np.median(plain_get_seconds(nbytes, max(3, min(opts.iters, 10)),
                                              node_resource=far)))
    get_gbps = nbytes / get_s / 1e9
    for row in rows:
        row.extra["ray_rtt_us"] = rtt
        row.extra["ray_get_bytes"] = nbytes
        row.extra["ray_get_GBps"] = get_gbps


# ---------------------------------------------------------------------- output
def _fmt_size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def header(opts: Options) -> str:
    peer = opts.vs or ""
    lines = [
        f"# raycoll-bench: backend={opts.backend} dtype={opts.dtype} iters={opts.iters} "
        f"warmup={opts.warmup} check={'on' if opts.check else 'off'} nodes={opts.nodes}"
        + (f" vs={peer}" if peer else "")
        + (f" options={opts.group_options}" if opts.group_options else "")
        + (f" {_FREE_PERIOD_ENV}={os.environ[_FREE_PERIOD_ENV]}"
           if _FREE_PERIOD_ENV in os.environ else ""),
        "# time: median over iterations of the slowest rank; algbw = bytes/time; "
        "busbw = algbw * nccl-tests factor",
    ]
    if peer:
        lines.append(f"# ratio = {peer} time / raycoll time (> 1: raycoll is faster)")
    if opts.memory:
        lines.append("# store+: peak object-store use above the baseline during the row (sampled); "
                     "after: above the baseline once the row is done")
    cols = (f"#{'op':>22} {'ranks':>5} {'size':>12} {'count':>11} {'type':>8} "
            f"{'time':>10} {'min':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>7}")
    units = (f"#{'':>22} {'':>5} {'(B)':>12} {'(elements)':>11} {'':>8} "
             f"{'(us)':>10} {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7}")
    if opts.memory:
        cols += f" {'store+':>9} {'after':>9}"
        units += f" {'(MiB)':>9} {'(MiB)':>9}"
    if peer:
        cols += f" {peer:>14} {'ratio':>7}"
        units += f" {'(us)':>14} {'':>7}"
    return "\n".join(lines + [cols, units])


def format_row(row: Row, with_peer: bool) -> str:
    wrong = "N/A" if row.wrong is None else str(row.wrong)
    text = (f" {row.op:>22} {row.world_size:>5} {row.bytes:>12} {row.count:>11} {row.dtype:>8} "
            f"{row.time_us:>10.1f} {row.min_us:>10.1f} {row.algbw:>7.2f} {row.busbw:>7.2f} "
            f"{wrong:>7}")
    if "store_peak_bytes" in row.extra:
        mib = 1 << 20
        text += (f" {(row.extra['store_peak_bytes'] - row.extra['store_baseline_bytes']) / mib:>9.1f}"
                 f" {(row.extra['store_after_bytes'] - row.extra['store_baseline_bytes']) / mib:>9.1f}")
    if with_peer:
        if row.peer_time_us is None:
            text += f" {'n/a':>14} {'':>7}"
        else:
            text += f" {row.peer_time_us:>14.1f} {row.ratio or 0.0:>7.2f}"
    return text


def footer(rows: Sequence[Row]) -> str:
    lines = []
    wrong = [r.wrong for r in rows if r.wrong is not None]
    if wrong:
        lines.append(f"# Out of bounds values : {sum(wrong)} {'OK' if sum(wrong) == 0 else 'FAILED'}")
    if rows and "ray_rtt_us" in rows[0].extra:
        extra = rows[0].extra
        lines.append(f"# Ray actor-call round trip (median): {extra['ray_rtt_us']:.1f} us")
        if extra["ray_get_bytes"] >= 1 << 20:  # a bandwidth only means something for MiBs
            lines.append(f"# plain ray.get of {_fmt_size(extra['ray_get_bytes'])}: "
                         f"{extra['ray_get_GBps']:.2f} GB/s")
    ratios = [r.ratio for r in rows if r.ratio]
    if ratios:
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        lines.append(f"# Geometric mean of ratios: {geo:.2f}")
    return "\n".join(lines)


def _require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(f"--plot needs matplotlib, which is not installed: pip install "
                          f"matplotlib (or pip install 'raycoll[bench]'); {exc}") from exc
    matplotlib.use("Agg")
    return matplotlib


def write_plot(rows: Sequence[Row], path: str) -> None:
    """Time against size (or against world size when only one size ran), log-log."""
    _require_matplotlib()
    import matplotlib.pyplot as plt
    sizes = {r.bytes for r in rows}
    by_world = len(sizes) == 1 and len({r.world_size for r in rows}) > 1
    fig, ax = plt.subplots(figsize=(8, 5))
    series: Dict[Tuple[str, Any], List[Tuple[float, float, Optional[float]]]] = {}
    for r in rows:
        key = (r.op, r.bytes if by_world else r.world_size)
        x = float(r.world_size if by_world else max(r.bytes, 1))
        series.setdefault(key, []).append((x, r.time_us, r.peer_time_us))
    for (op, label), points in sorted(series.items(), key=lambda kv: str(kv[0])):
        points.sort()
        xs = [p[0] for p in points]
        tag = f"{op} {_fmt_size(label)}B" if by_world else f"{op} x{label}"
        line = ax.plot(xs, [p[1] for p in points], marker="o", label=f"raycoll {tag}")[0]
        peer = [(p[0], p[2]) for p in points if p[2] is not None]
        if peer:
            name = next((r.peer for r in rows if r.peer), "peer")
            ax.plot([p[0] for p in peer], [p[1] for p in peer], linestyle="--", marker="x",
                    color=line.get_color(), label=f"{name} {tag}")
    ax.set_xscale("log", base=2 if by_world else 10)
    ax.set_yscale("log")
    ax.set_xlabel("world size (ranks)" if by_world else "size (bytes)")
    ax.set_ylabel("time (us, median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------- command line
def _parse_set(items: Iterable[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set: expected KEY=VALUE; got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="raycoll-bench",
        description="Benchmark raycoll collectives on Ray actors (nccl-tests style).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--op", default="all_reduce",
                   help=f"comma list of operations, or 'all': {', '.join(OPS)}")
    p.add_argument("--sizes", default="4,4K,256K,4M,64M",
                   help="comma list (4,4K,64M) or range MIN:MAX:xFACTOR (4:64M:x4)")
    p.add_argument("--world-size", default="2", help="ranks; a comma list runs each in turn")
    p.add_argument("--nodes", type=int, default=1,
                   help="start N Ray nodes on this machine (ray.cluster_utils.Cluster)")
    p.add_argument("--address", default=None, help="join an existing Ray cluster")
    p.add_argument("--backend", default="objstore", help="raycoll backend (e.g. objstore)")
    p.add_argument("--dtype", default="float32", help="numpy dtype of the buffers")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per size")
    p.add_argument("--check", action="store_true", help="verify results, count wrong elements")
    p.add_argument("--vs", choices=sorted(_PEERS), default=None,
                   help="run this library too, interleaved, and print the time ratio")
    p.add_argument("--baselines", action="store_true",
                   help="also measure Ray's floors: an actor-call round trip and a plain "
                        "ray.get of the largest size (cross-node with --nodes)")
    p.add_argument("--memory", action="store_true",
                   help="sample object-store use: peak above the baseline during each row, "
                        "and what is left once it is done")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a raycoll group option, e.g. inline_bytes=65536 (repeatable)")
    p.add_argument("--ray-free-period-ms", type=int, default=10,
                   help="when this run starts Ray: how often its raylets free unused objects "
                        f"({_FREE_PERIOD_ENV}; Ray's default is 1000); 0 keeps Ray's default")
    p.add_argument("--object-store-mb", type=int, default=None,
                   help="object store size per node when this run starts Ray")
    p.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="plot time against size")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_options(argv: Optional[Sequence[str]] = None) -> Tuple[Options, argparse.Namespace]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        names = [s.strip() for s in args.op.split(",") if s.strip()]
        ops = list(OPS) if names == ["all"] else [canonical_op(n) for n in names]
        if not ops:
            raise ValueError(f"--op: expected an operation or 'all'; got {args.op!r}")
        sizes = parse_sizes(args.sizes)
        worlds = [int(w) for w in args.world_size.split(",") if w.strip()]
        if not worlds or min(worlds) < 1:
            raise ValueError(f"--world-size: expected positive ints; got {args.world_size!r}")
        if args.nodes < 1 or (args.nodes > 1 and args.address):
            raise ValueError(f"--nodes: expected >= 1, and not with --address; got {args.nodes}")
        if args.nodes > min(worlds):
            raise ValueError(f"--nodes={args.nodes}: needs --world-size >= nodes; "
                             f"got {args.world_size}")
        if args.iters < 1 or args.warmup < 0:
            raise ValueError(f"--iters/--warmup: expected >= 1 / >= 0; "
                             f"got {args.iters} / {args.warmup}")
        dtype = np.dtype(args.dtype)
        if dtype.kind not in "iuf":
            raise ValueError(f"--dtype: expected an integer or float dtype; got {args.dtype!r}")
        group_options = _parse_set(args.set)
        if args.plot:
            _require_matplotlib()
    except (ValueError, TypeError, ImportError) as exc:
        parser.error(str(exc))
    opts = Options(ops=ops, sizes=sizes, world_sizes=worlds, nodes=args.nodes,
                   address=args.address, backend=args.backend, dtype=dtype.name,
                   iters=args.iters, warmup=args.warmup, check=args.check, vs=args.vs,
                   group_options=group_options, baselines=args.baselines, memory=args.memory,
                   free_period_ms=args.ray_free_period_ms,
                   object_store_mb=args.object_store_mb, progress=not args.no_progress)
    return opts, args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``raycoll-bench`` entry point; returns the exit status (1 if any result was wrong)."""
    opts, args = parse_options(argv)
    with_peer = opts.vs is not None
    configure_ray_env(opts)
    print(header(opts), flush=True)

    def emit(row: Row) -> None:
        print(format_row(row, with_peer), flush=True)

    rows = run_bench(opts, emit)
    text = footer(rows)
    if text:
        print(text, flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump([r.as_json() for r in rows], fh, indent=1)
            fh.write("\n")
    if args.plot:
        write_plot(rows, args.plot)
    return 1 if any(r.wrong for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
