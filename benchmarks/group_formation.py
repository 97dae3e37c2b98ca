"""Forming a group over live actors: raycoll's ``create_group`` with a coordinator started
ahead, without one, and torch's gloo ``init_process_group``, same run.

    python benchmarks/group_formation.py [--world-size 2,4] [--rounds 10] [--gap 1.0]

One local Ray (4 logical CPUs); per world size, that many zero-CPU actors, started and
ready before anything is timed. Timed from the driver (``time.perf_counter``):

- *first group*: the driver's first ``create_group`` of the run (no coordinator ahead yet:
  it starts one, as every group did before);
- *ahead*: ``create_group`` once the coordinator started ahead after the previous group is
  up (``--gap`` seconds after the previous round; a Ray Train restart comes seconds apart);
- *no spare*: ``create_group`` with ``RAYCOLL_SPARE_COORDINATOR=0`` (each group starts its
  coordinator when it forms: raycoll before this change);
- *gloo*: every actor calls ``torch.distributed.init_process_group("gloo",
  init_method="tcp://127.0.0.1:<port>")`` (rank 0 hosts the TCPStore), the driver waits for
  all;

then, for each, the group's first 4-byte all_reduce (its transports' set-up: raycoll's node
segment and cross-memory probe, gloo's pairs), and its destruction. The three alternate
round by round (the first alternating), so that all see the same machine; medians over
``--rounds``, and the ratios other / ahead (above 1, the coordinator ahead is faster).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
import uuid
from datetime import timedelta
from typing import Any, Dict, List

import numpy as np
import ray

import raycoll
from raycoll.coordinator import spare
from raycoll.launch import RankWorker, start_ray


class Rank(RankWorker):
    """A rank of either library (``run`` for raycoll, the gloo methods for gloo)."""

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def gloo_init(self, rank: int, world_size: int, port: int) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))

    def gloo_first(self) -> None:
        import torch
        import torch.distributed as dist

        dist.all_reduce(torch.ones(1))

    def gloo_destroy(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def _first(rank: int, name: str) -> None:
    raycoll.all_reduce(np.ones(1, np.float32), group=name)


def _imports(rank: int) -> None:
    import torch  # noqa: F401


def _raycoll(actors: List[Any], ahead: bool) -> Dict[str, float]:
    if ahead:
        os.environ.pop(spare.ENV, None)
    else:
        os.environ[spare.ENV] = "0"
        spare.release()
    name = f"form-{uuid.uuid4().hex[:6]}"
    start = time.perf_counter()
    raycoll.create_group(actors, group_name=name, timeout=60)
    formed = time.perf_counter()
    ray.get([a.run.remote(_first, r, (name,), {}) for r, a in enumerate(actors)], timeout=60)
    first = time.perf_counter()
    raycoll.destroy_group(name)
    done = time.perf_counter()
    os.environ.pop(spare.ENV, None)
    spare.refill()  # for the next "ahead" round
    return {"form": formed - start, "first": first - formed, "destroy": done - first}


def _gloo(actors: List[Any]) -> Dict[str, float]:
    port = ray.get(actors[0].free_port.remote(), timeout=60)
    start = time.perf_counter()
    ray.get([a.gloo_init.remote(r, len(actors), port) for r, a in enumerate(actors)], timeout=60)
    formed = time.perf_counter()
    ray.get([a.gloo_first.remote() for a in actors], timeout=60)
    first = time.perf_counter()
    ray.get([a.gloo_destroy.remote() for a in actors], timeout=60)
    done = time.perf_counter()
    return {"form": formed - start, "first": first - formed, "destroy": done - first}


def _ms(values: List[float]) -> str:
    return f"{statistics.median(values) * 1e3:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", default="2,4")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--gap", type=float, default=1.0,
                        help="seconds between rounds (the coordinator ahead starts meanwhile)")
    args = parser.parse_args()
    start_ray(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    worker = ray.remote(num_cpus=0)(Rank)
    print(f"load average before: {os.getloadavg()}")
    for world_size in (int(w) for w in args.world_size.split(",")):
        actors = [worker.remote() for _ in range(world_size)]
        ray.get([a.run.remote(_imports, r, (), {}) for r, a in enumerate(actors)],
                timeout=120)  # the actors are up, torch and raycoll imported: untimed
        times: Dict[str, List[Dict[str, float]]] = {"ahead": [], "no spare": [], "gloo": []}
        if world_size == int(args.world_size.split(",")[0]):
            first = _raycoll(actors, ahead=True)
            print(f"W={world_size} first group of the run (no coordinator ahead yet): "
                  f"create_group {first['form'] * 1e3:.1f} ms, first all_reduce "
                  f"{first['first'] * 1e3:.1f} ms (coordinators started: {spare.counts()})")
        else:
            spare.refill()
        kinds = list(times)
        for r in range(args.rounds):
            order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
            for kind in order:
                time.sleep(args.gap)
                times[kind].append(_gloo(actors) if kind == "gloo"
                                   else _raycoll(actors, ahead=kind == "ahead"))
        print(f"W={world_size}, {args.rounds} rounds, medians (ms):")
        print(f"  {'':10s} {'form':>8s} {'1st op':>8s} {'destroy':>8s} {'form / ahead':>12s}")
        base = [t["form"] for t in times["ahead"]]
        for kind, rows in times.items():
            form = [t["form"] for t in rows]
            ratio = statistics.median([f / b for f, b in zip(form, base)])
            print(f"  {kind:10s} {_ms(form)} {_ms([t['first'] for t in rows])} "
                  f"{_ms([t['destroy'] for t in rows])} {ratio:11.2f}x")
        print(f"  ahead, every round (ms): {[round(b * 1e3, 1) for b in base]}")
        for actor in actors:
            ray.kill(actor)
    print(f"coordinators started: {spare.counts()}; load average after: {os.getloadavg()}")
    ray.shutdown()


if __name__ == "__main__":
    main()
