"""Elastic groups: from a rank's SIGKILL to the survivors' next step and the replacement's
first, by ``shrink_group`` + ``grow_group`` against a full re-form, same run.

    python benchmarks/elastic.py [--ranks 4] [--repeats 3] [--bytes 4096] [--json]

One driver, one local Ray. Each repeat starts ``--ranks`` zero-CPU actors and two spare ones
(already started: a replacement's start is Ray's, timed apart as "actor start"), then:

- **elastic**: the ranks form a group and all_reduce ``--bytes`` in a loop; the driver
  SIGKILLs rank 1's process. Each survivor, at its ``RankFailedError``, calls
  ``shrink_group([1])`` and does its next all_reduce on the shrunk group. Then the driver
  calls ``grow_group`` with a spare while the survivors call ``admit_new_ranks``; every rank
  then runs one all_reduce (the replacement's first step). Timed: kill -> every survivor's
  next all_reduce done; ``shrink_group`` itself (the slowest survivor's call); the driver's
  ``grow_group``; kill -> the replacement's first all_reduce done.
- **re-form**: the grown group's ranks form a new group, loop the same way, and the driver
  SIGKILLs one again. At the survivors' error the driver destroys the group and forms it
  again over the survivors and the other spare (``destroy_group`` + ``create_group``); every
  rank runs one all_reduce. Timed: kill -> that all_reduce done on every rank (survivors and
  replacement alike: a re-form serves both at once).

Times are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the
machine). Medians over repeats, and the ratio re-form / elastic per repeat (above 1: the
elastic path took less time). Ray Train's restart (BENCHMARKS.md, "Forming a group and Ray
Train restarts": 12.5 s from a kill to both new workers' first step) is not rerun here: it
needs ``ray[train]`` and a minute a fit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
import uuid
from typing import Any, Dict, List

import numpy as np
import ray

import raycoll


@ray.remote(num_cpus=0)
class Rank:
    """A rank of the benchmark: all_reduce loops, shrink, grow."""

    def pid(self) -> int:
        return os.getpid()

    def reduce(self, nbytes: int) -> float:
        x = np.ones(max(1, nbytes // 8))
        raycoll.all_reduce(x)
        if x[0] != raycoll.get_world_size():
            raise AssertionError(f"all_reduce gave {x[0]}, not {raycoll.get_world_size()}")
        return time.monotonic()

    def loop(self, nbytes: int, elastic: bool) -> Dict[str, Any]:
        """all_reduce until a rank fails; ``elastic``: then shrink and do the next one."""
        done = 0
        while True:
            try:
                self.reduce(nbytes)
                done += 1
            except raycoll.RankFailedError as exc:
                failed_at = time.monotonic()
                if not elastic:
                    return {"failed_at": failed_at, "done": done}
                start = time.perf_counter()
                raycoll.shrink_group(sorted(exc.failed_ranks))
                shrink_s = time.perf_counter() - start
                return {"failed_at": failed_at, "shrink_s": shrink_s, "done": done,
                        "next_at": self.reduce(nbytes)}

    def admit(self, nbytes: int) -> float:
        raycoll.admit_new_ranks(timeout=120)
        return self.reduce(nbytes)


def _kill_during_loop(team: List[Any], victim: int, nbytes: int, elastic: bool
                      ) -> Dict[str, Any]:
    pid = ray.get(team[victim].pid.remote(), timeout=60)
    refs = [a.loop.remote(nbytes, elastic) for a in team]
    time.sleep(0.3)  # the loops are running
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    out = ray.get([r for i, r in enumerate(refs) if i != victim], timeout=120)
    return {"killed_at": killed_at, "survivors": out}


def _repeat(ranks: int, nbytes: int) -> Dict[str, float]:
    start = time.monotonic()
    spares = [Rank.remote() for _ in range(2)]
    team = [Rank.remote() for _ in range(ranks)]
    ray.get([a.pid.remote() for a in team + spares], timeout=120)
    actor_start_s = time.monotonic() - start
    name = f"elastic-{uuid.uuid4().hex[:6]}"
    victim = 1
    try:
        # ---- elastic: shrink inside the survivors, then grow with a started spare
        raycoll.create_group(team, group_name=name)
        ray.get([a.reduce.remote(nbytes) for a in team], timeout=60)
        got = _kill_during_loop(team, victim, nbytes, elastic=True)
        killed_at, survivors = got["killed_at"], got["survivors"]
        team = [a for i, a in enumerate(team) if i != victim]
        admitted = [a.admit.remote(nbytes) for a in team]
        grow_start = time.monotonic()
        raycoll.grow_group(name, [spares[0]], timeout=120)
        grow_s = time.monotonic() - grow_start
        first = ray.get(spares[0].reduce.remote(nbytes), timeout=60)
        ray.get(admitted, timeout=60)
        team.append(spares[0])
        elastic = {"survivors_next_s": max(s["next_at"] for s in survivors) - killed_at,
                   "detect_s": max(s["failed_at"] for s in survivors) - killed_at,
                   "shrink_s": max(s["shrink_s"] for s in survivors),
                   "grow_s": grow_s, "replacement_first_s": first - killed_at}
        raycoll.destroy_group(name)
        # ---- re-form: destroy and create over the survivors and the other spare
        raycoll.create_group(team, group_name=name)
        ray.get([a.reduce.remote(nbytes) for a in team], timeout=60)
        got = _kill_during_loop(team, victim, nbytes, elastic=False)
        killed_at = got["killed_at"]
        team = [a for i, a in enumerate(team) if i != victim] + [spares[1]]
        raycoll.destroy_group(name)
        raycoll.create_group(team, group_name=name)
        done = ray.get([a.reduce.remote(nbytes) for a in team], timeout=60)
        reform = {"reform_next_s": max(done) - killed_at,
                  "reform_detect_s": max(s["failed_at"] for s in got["survivors"]) - killed_at}
        return dict(elastic, **reform, actor_start_s=actor_start_s)
    finally:
        try:
            raycoll.destroy_group(name)
        except Exception:  # noqa: BLE001 - already destroyed
            pass
        for actor in team + spares:
            ray.kill(actor, no_restart=True)


LABELS = {
    "detect_s": "elastic: kill -> survivors' RankFailedError",
    "shrink_s": "elastic: shrink_group itself (slowest survivor)",
    "survivors_next_s": "elastic: kill -> survivors' next all_reduce done",
    "grow_s": "elastic: grow_group (driver), replacement already started",
    "replacement_first_s": "elastic: kill -> replacement's first all_reduce done",
    "reform_detect_s": "re-form: kill -> survivors' RankFailedError",
    "reform_next_s": "re-form: kill -> every rank's next all_reduce done",
    "actor_start_s": f"starting the repeat's actors (Ray)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    _repeat(args.ranks, args.bytes)  # untimed: Ray's worker processes, imports
    runs = [_repeat(args.ranks, args.bytes) for _ in range(args.repeats)]
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    ratios = [r["reform_next_s"] / r["survivors_next_s"] for r in runs]
    ratios_new = [r["reform_next_s"] / r["replacement_first_s"] for r in runs]
    if args.json:
        print(json.dumps({"runs": runs, "medians": medians}, indent=1))
    print(f"{args.ranks} ranks, {args.bytes} B all_reduces, medians of {args.repeats} repeats "
          f"(load {os.getloadavg()[0]:.1f}):")
    for key, label in LABELS.items():
        print(f"  {label:<62} {medians[key] * 1e3:9.1f} ms")
    print(f"  re-form / elastic, survivors' next step: {statistics.median(ratios):.1f}x "
          f"(per repeat: {', '.join(f'{r:.1f}' for r in ratios)})")
    print(f"  re-form / elastic, replacement's first step: {statistics.median(ratios_new):.1f}x "
          f"(per repeat: {', '.join(f'{r:.1f}' for r in ratios_new)})")
    ray.shutdown()


if __name__ == "__main__":
    main()
