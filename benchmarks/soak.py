"""Soak: a long run of mixed collectives that checks memory stays flat.

Several groups run at once, each on its own actors. Every rank runs rounds of small
collectives (all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor,
all_to_all_single, a send/recv ring, barrier, all_gather_object, an async all_reduce) and,
every few rounds, large ones (all_reduce, all_gather_into_tensor, broadcast of ``--large-mb``),
checking every result. Groups take turns: even-numbered groups run on the native plane (the
default: the node segment), odd-numbered ones through the object store (group option
``transport="store"``, the fallback), so both paths soak. A warm-up phase comes first; then the driver records the baseline
(object-store bytes once settled, each rank's and the coordinator's RSS), runs the main phase,
and records them again. Flat means: the object store is back to its baseline and no process
grew by more than a few MB, and the coordinator's tables hold nothing left over.

Run it alone (it is a benchmark: other load skews the figures)::

    python benchmarks/soak.py                       # about 4 x 2 x 9 x 400 small collectives
    python benchmarks/soak.py --rounds 100 --json   # shorter; one JSON line at the end

``tests/test_soak.py`` runs a shortened form of the same code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import ray

import raycoll
from raycoll.coordinator.spare import find as find_coordinator
from raycoll.launch import RankWorker

__all__ = ["SoakConfig", "SoakReport", "run", "store_used", "store_created", "rss_bytes", "main"]


@dataclass(frozen=True)
class SoakConfig:
    """What to run: ``groups`` groups of ``world_size`` ranks, ``rounds`` rounds each."""

    groups: int = 2
    world_size: int = 2
    rounds: int = 400
    warmup_rounds: int = 40
    large_every: int = 5
    large_mb: float = 8.0
    small_elems: int = 64


@dataclass
class SoakReport:
    """The figures of one soak run (bytes, seconds, counts)."""

    config: Dict[str, Any]
    collectives: Dict[str, int]
    seconds: float
    store_baseline: int
    store_peak: int
    store_final: int
    store_created: int
    rank_rss_warm: List[int]
    rank_rss_end: List[int]
    coordinator_rss_warm: List[int]
    coordinator_rss_end: List[int]
    coordinator_tables: List[Dict[str, int]] = field(default_factory=list)

    def rank_growth(self) -> int:
        return max(e - w for w, e in zip(self.rank_rss_warm, self.rank_rss_end))

    def coordinator_growth(self) -> int:
        return max(e - w for w, e in zip(self.coordinator_rss_warm, self.coordinator_rss_end))

    def summary(self) -> str:
        mb = 1e6
        small = sum(v for k, v in self.collectives.items() if not k.startswith("large"))
        large = sum(v for k, v in self.collectives.items() if k.startswith("large"))
        return "\n".join([
            f"soak: {self.config['groups']} groups x {self.config['world_size']} ranks, "
            f"{small} small + {large} large collectives per rank-set in {self.seconds:.1f}s "
            f"({(small + large) * self.config['groups'] / self.seconds:.0f} collectives/s over "
            "all groups)",
            f"  object store: baseline {self.store_baseline / mb:.2f} MB, peak "
            f"{self.store_peak / mb:.1f} MB (sampled), final {self.store_final / mb:.2f} MB; "
            f"{self.store_created / mb:.1f} MB created during the run",
            f"  rank private RSS (MB, warm -> end): " + ", ".join(
                f"{w / mb:.0f}->{e / mb:.0f}" for w, e in zip(self.rank_rss_warm, self.rank_rss_end))
            + f"; max growth {self.rank_growth() / mb:+.1f} MB",
            f"  coordinator private RSS (MB, warm -> end): " + ", ".join(
                f"{w / mb:.0f}->{e / mb:.0f}" for w, e in
                zip(self.coordinator_rss_warm, self.coordinator_rss_end))
            + f"; max growth {self.coordinator_growth() / mb:+.1f} MB",
            f"  coordinator tables at the end: {self.coordinator_tables}",
            "  per rank-set: " + ", ".join(f"{k} {v}" for k, v in sorted(self.collectives.items())),
        ])


# ---------------------------------------------------------------------- measurements
def rss_bytes(pid: Optional[int] = None) -> int:
    """Private resident memory (``RssAnon``) of ``pid`` (default: this process), from /proc
    (Linux). Object-store pages a process has read are shared memory, counted in VmRSS but
    not here: they belong to the store, whose use is measured apart."""
    with open(f"/proc/{pid or os.getpid()}/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon in /proc/{pid}/status")


def _store_stats() -> Any:
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    return get_memory_info_reply(
        get_state_from_address(ray.get_runtime_context().gcs_address)).store_stats


def store_used() -> int:
    """Object-store bytes in use, summed over the cluster's nodes."""
    return int(_store_stats().object_store_bytes_used)


def store_created() -> int:
    """Bytes ever created in the object stores of the cluster's nodes (a counter that only
    grows: unlike a sampled peak, it cannot miss an object that lived for a millisecond)."""
    return int(_store_stats().cumulative_created_bytes)


def store_settled(limit: int, timeout_s: float = 30.0) -> int:
    """Object-store use once at most ``limit`` bytes (Ray frees objects a moment after their
    last reference goes), or as it is after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    used = store_used()
    while used > limit and time.monotonic() < deadline:
        time.sleep(0.1)
        used = store_used()
    return used


class _StoreSampler:
    """Samples object-store use in a background thread; ``peak`` is the largest seen."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period_s,), daemon=True)

    def __enter__(self) -> "_StoreSampler":
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            self.peak = max(self.peak, store_used())


# ---------------------------------------------------------------------- rank side
def _check(got: np.ndarray, want: Any, what: str) -> None:
    if not np.array_equal(got, np.broadcast_to(np.asarray(want, dtype=got.dtype), got.shape)):
        raise AssertionError(f"{what}: got {got.reshape(-1)[:4]}..., want {np.asarray(want).reshape(-1)[:4]}...")


def soak_rank(rank: int, group: str, rounds: int, start: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Rounds ``start .. start+rounds`` of mixed collectives on ``group``, every result checked.
    Returns this process's RSS at the end and how many of each collective ran."""
    w = raycoll.get_world_size(group)
    n = cfg["small_elems"]
    big = max(w, int(cfg["large_mb"] * 1e6 / 4) // w * w)
    counts: Dict[str, int] = {}

    def count(name: str) -> None:
        counts[name] = counts.get(name, 0) + 1

    total = w * (w - 1) // 2
    for i in range(start, start + rounds):
        x = np.full(n, float(rank + i), dtype=np.float32)
        raycoll.all_reduce(x, group=group)
        _check(x, np.float32(total + w * i), "all_reduce")
        count("all_reduce")

        src = i % w
        y = np.full(n, float(rank), dtype=np.float64)
        raycoll.broadcast(y, src=src, group=group)
        _check(y, float(src), "broadcast")
        count("broadcast")

        out = np.empty(n * w, dtype=np.int32)
        raycoll.all_gather_into_tensor(out, np.full(n, rank + i, dtype=np.int32), group=group)
        _check(out, np.repeat(np.arange(w, dtype=np.int32) + i, n), "all_gather_into_tensor")
        count("all_gather_into_tensor")

        rs = np.empty(n, dtype=np.int64)
        raycoll.reduce_scatter_tensor(rs, np.full(n * w, rank, dtype=np.int64), group=group)
        _check(rs, total, "reduce_scatter_tensor")
        count("reduce_scatter_tensor")

        a2a = np.empty(w * 2, dtype=np.float32)
        raycoll.all_to_all_single(a2a, np.full(w * 2, float(rank), dtype=np.float32), group=group)
        _check(a2a, np.repeat(np.arange(w, dtype=np.float32), 2), "all_to_all_single")
        count("all_to_all_single")

        if w > 1:
            ring = np.empty(n, dtype=np.float32)
            send = raycoll.isend(np.full(n, float(rank), dtype=np.float32), dst=(rank + 1) % w,
                                 group=group, tag=i)
            raycoll.recv(ring, src=(rank - 1) % w, group=group, tag=i)
            send.wait()
            _check(ring, float((rank - 1) % w), "send/recv")
            count("send_recv")

        raycoll.barrier(group=group)
        count("barrier")

        objs: List[Any] = [None] * w
        raycoll.all_gather_object(objs, {"rank": rank, "i": i}, group=group)
        if objs != [{"rank": r, "i": i} for r in range(w)]:
            raise AssertionError(f"all_gather_object: {objs}")
        count("all_gather_object")

        z = np.full(n, 1.0, dtype=np.float32)
        raycoll.all_reduce(z, group=group, async_op=True).wait(timeout=600)
        _check(z, float(w), "async all_reduce")
        count("async_all_reduce")

        if i % cfg["large_every"] == 0:
            large = np.full(big, float(rank + 1), dtype=np.float32)
            raycoll.all_reduce(large, group=group)
            _check(large[:: max(1, big // 64)], float(w * (w + 1) // 2), "large all_reduce")
            count("large_all_reduce")
            gathered = np.empty(big, dtype=np.float32)
            raycoll.all_gather_into_tensor(gathered, np.full(big // w, float(rank), np.float32),
                                           group=group)
            _check(gathered[:: big // w], np.arange(w, dtype=np.float32), "large all_gather")
            count("large_all_gather")
            raycoll.broadcast(large, src=(i // cfg["large_every"]) % w, group=group)
            count("large_broadcast")
            del large, gathered
    return {"rss": rss_bytes(), "counts": counts}


# ---------------------------------------------------------------------- driver
def _coordinator_pid(self: Any) -> int:
    return os.getpid()


def run(cfg: SoakConfig, log: Any = print) -> SoakReport:
    """Run a soak with ``cfg`` on the connected Ray; returns the figures (raises if a
    collective gave a wrong result)."""
    worker = ray.remote(num_cpus=0)(RankWorker)
    job = ray.get_runtime_context().get_job_id()
    teams: List[Tuple[str, List[Any]]] = []
    try:
        for g in range(cfg.groups):
            actors = [worker.remote() for _ in range(cfg.world_size)]
            name = f"soak-{uuid.uuid4().hex[:6]}"
            raycoll.create_group(actors, group_name=name, timeout=600,
                                 options={"transport": "auto" if g % 2 == 0 else "store"})
            teams.append((name, actors))
        coordinators = [find_coordinator(job, name) for name, _ in teams]
        coordinator_pids = ray.get([c.__ray_call__.remote(_coordinator_pid) for c in coordinators],
                                   timeout=60)
        conf = asdict(cfg)

        def phase(start: int, rounds: int) -> List[Dict[str, Any]]:
            refs = [a.run.remote(soak_rank, r, (name, rounds, start, conf), {})
                    for name, actors in teams for r, a in enumerate(actors)]
            return ray.get(refs, timeout=3600)

        log(f"soak: warm-up, {cfg.warmup_rounds} rounds ...")
        warm = phase(0, cfg.warmup_rounds)
        baseline = store_settled(1_000_000)
        coordinator_warm = [rss_bytes(p) for p in coordinator_pids]
        log(f"soak: main phase, {cfg.rounds} rounds ...")
        started = time.perf_counter()
        created_before = store_created()
        with _StoreSampler() as sampler:
            end = phase(cfg.warmup_rounds, cfg.rounds)
        seconds = time.perf_counter() - started
        created = store_created() - created_before
        final = store_settled(baseline + 1_000_000)
        tables = ray.get([c.state_sizes.remote() for c in coordinators], timeout=60)
        report = SoakReport(
            config=conf, collectives=end[0]["counts"], seconds=seconds,
            store_baseline=baseline, store_peak=max(sampler.peak, baseline), store_final=final,
            store_created=created,
            rank_rss_warm=[r["rss"] for r in warm], rank_rss_end=[r["rss"] for r in end],
            coordinator_rss_warm=coordinator_warm,
            coordinator_rss_end=[rss_bytes(p) for p in coordinator_pids],
            coordinator_tables=[t[1] for t in tables])
    finally:
        for name, actors in teams:
            try:
                raycoll.destroy_group(name)
            except ValueError:
                pass
            for actor in actors:
                ray.kill(actor, no_restart=True)
    return report


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = SoakConfig()
    parser.add_argument("--groups", type=int, default=defaults.groups)
    parser.add_argument("--world-size", type=int, default=defaults.world_size)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--warmup-rounds", type=int, default=defaults.warmup_rounds)
    parser.add_argument("--large-every", type=int, default=defaults.large_every)
    parser.add_argument("--large-mb", type=float, default=defaults.large_mb)
    parser.add_argument("--address", default=None, help="Ray address (default: start one)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args(argv)
    cfg = SoakConfig(groups=args.groups, world_size=args.world_size, rounds=args.rounds,
                     warmup_rounds=args.warmup_rounds, large_every=args.large_every,
                     large_mb=args.large_mb)
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=max(4, cfg.groups * cfg.world_size), include_dashboard=False)
    report = run(cfg)
    print(report.summary())
    if args.json:
        print(json.dumps(asdict(report)))
    flat = (report.store_final <= report.store_baseline + 1_000_000
            and report.rank_growth() < 32e6 and report.coordinator_growth() < 32e6)
    print("soak: memory " + ("FLAT" if flat else "GREW"))
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
