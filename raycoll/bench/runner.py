"""The driver side of ``raycoll-bench``: the Ray it runs in, the rank actors, the loop over
operations, sizes and world sizes (with the ``--vs`` peer interleaved), the progress bar, the
object-store sampler of ``--memory`` and Ray's floors of ``--baselines``."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
import uuid
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import numpy as np
import ray

from raycoll.bench.floors import actor_round_trip_seconds, plain_get_seconds
from raycoll.bench.peers import GlooPeer, NotSupportedByPeer, Peer, RayCollectivePeer
from raycoll.bench.ranks import BenchRankRemote
from raycoll.bench.tables import (
    FREE_PERIOD_ENV,
    Options,
    Row,
    element_count,
    fmt_size,
    make_row,
    run_bytes,
    stats,
)

__all__ = ["run_bench", "configure_ray_env", "StoreSampler", "PEERS", "CALL_TIMEOUT_S"]

#: Seconds any single benchmark call (all iterations of one size) may take.
CALL_TIMEOUT_S = 600.0

#: The libraries ``--vs`` can name.
PEERS: Dict[str, Callable[[], Peer]] = {"gloo": GlooPeer, "ray-collective": RayCollectivePeer}

# Custom resources that place the ranks, the peers' ranks and the farthest node (--nodes).
_NODE_SLOT = "raycoll_bench_rank_slot"
_PEER_SLOT = "raycoll_bench_peer_slot"
_FAR_NODE = "raycoll_bench_far_node"


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
            from tqdm import tqdm
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



def configure_ray_env(opts: Options) -> None:
    """Settings for a Ray this run starts (none when Ray is already up in this process).

    Ray frees unused objects in batches, by default once a second; until then each put lands in
    store memory not touched lately, which costs page faults (figures in
    benchmarks/HISTORY.md). The raylets read the period from the environment; a user's
    value wins.
    """
    if opts.free_period_ms > 0 and not ray.is_initialized() and not opts.address:
        os.environ.setdefault(FREE_PERIOD_ENV, str(opts.free_period_ms))


class _Ray:
    """The Ray this run uses: the caller's, an embedded local one, or a local multi-node one."""

    def __init__(self, opts: Options) -> None:
        self.cluster: Any = None
        self.started = False
        self.spread = opts.spread
        self.one_node = opts.one_node
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

    def rank_options(self, rank: int = 0) -> Dict[str, Any]:
        """The ``.options()`` of rank ``rank``'s actor."""
        if self.cluster is not None:
            return {"num_cpus": 0, "resources": {_NODE_SLOT: 1}}
        if self.spread or self.one_node:
            # rank r on the r-th live node, round robin, or all on the first (Ray's "SPREAD"
            # is a hint: with 0 CPUs a rank asks for, it packed both of --calibrate's on one
            # node at times)
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
            return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(
                nodes[0 if self.one_node else rank % len(nodes)], soft=False)}
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
                 actor_options: List[Dict[str, Any]]) -> None:
        import raycoll

        self.world_size = world_size
        self.backend = backend
        self.group = f"bench-{uuid.uuid4().hex[:8]}"
        # Block placement: with resource slots per node, ranks fill node after node.
        self.actors = [BenchRankRemote.options(**actor_options[r]).remote()
                       for r in range(world_size)]
        try:
            places = ray.get([a.placement.remote() for a in self.actors], timeout=CALL_TIMEOUT_S)
            self.nodes = len(set(places))
            start = time.perf_counter()
            raycoll.create_group(self.actors, backend=backend, group_name=self.group,
                                 timeout=CALL_TIMEOUT_S, options=options)
            #: seconds to form the group (the actors already running)
            self.formation_s = time.perf_counter() - start
        except BaseException:
            self._kill()
            raise

    def run(self, op: str, count: int, dtype: str, iters: int, warmup: int,
            check: bool, pattern: str = "back-to-back") -> Tuple[List[float], Optional[int]]:
        refs = [a.bench.remote(op, count, dtype, iters, warmup, check, self.group, pattern)
                for a in self.actors]
        results = ray.get(refs, timeout=CALL_TIMEOUT_S)
        times = [max(t) for t in zip(*(r[0] for r in results))]
        wrongs = [r[1] for r in results]
        wrong = None if any(w is None for w in wrongs) else int(sum(wrongs))
        return times, wrong

    def usage(self) -> Tuple[int, int]:
        """The largest resident memory (bytes) and open descriptors of a rank now."""
        got = ray.get([a.usage.remote() for a in self.actors], timeout=CALL_TIMEOUT_S)
        return max(r for r, _ in got), max(f for _, f in got)

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
            ranks = _Ranks(world_size, opts.backend, opts.group_options,
                           [env.rank_options(r) for r in range(world_size)])
            peer: Optional[Peer] = None
            try:
                peer_formation_s = None
                if opts.vs:
                    peer = PEERS[opts.vs]()
                    start = time.perf_counter()
                    peer.setup(world_size, env.peer_options())
                    peer_formation_s = time.perf_counter() - start
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
                                             opts.check, opts.pattern)
                    row = make_row(op, real, count, opts.dtype, world_size, ranks.nodes,
                                   opts.backend, times, wrong)
                    if sampler is not None:
                        peak = sampler.stop()
                        after, settle_s = sampler.settle(baseline)
                        row.extra.update(store_baseline_bytes=baseline, store_peak_bytes=peak,
                                         store_after_bytes=after, store_settle_ms=settle_s * 1e3)
                    rss, fds = ranks.usage()
                    row.extra.update(formation_s=ranks.formation_s, rank_rss_bytes=rss,
                                     rank_fds=fds)
                    if peer is not None:
                        _add_peer(row, peer, op, real, opts)
                        rss, fds = peer.usage()
                        row.extra.update(peer_formation_s=peer_formation_s,
                                         peer_rss_bytes=rss, peer_fds=fds)
                    rows.append(row)
                    with progress.emitting():
                        emit(row)
                    progress.step(f"{op} {fmt_size(real)} x{world_size}")
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
        times = peer.run(op, nbytes, opts.dtype, opts.iters, opts.warmup, opts.pattern)
    except NotSupportedByPeer as exc:
        row.extra["peer_note"] = exc.reason
        return
    row.peer_time_us = stats(times)[0]
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
