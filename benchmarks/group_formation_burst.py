"""Groups formed back to back and in bulk: raycoll's ``create_group`` against torch's gloo,
same run (the spaced rows, a coordinator started ahead 1 s before, are
``benchmarks/group_formation.py``'s).

    python benchmarks/group_formation_burst.py [--rounds 5] [--bulk 8] [--repeats 3]
        [--sections b2b,by-name,bulk]

One local Ray (4 logical CPUs), zero-CPU actors started and ready (torch and raycoll
imported) before anything is timed; times from the driver (``time.perf_counter``), medians.

- *back to back*: 2 ranks, ``--rounds`` rounds of form then destroy with nothing between
  them (a notebook or a test suite forming a group per cell or test): raycoll's
  ``create_group`` + ``destroy_group``; gloo's ``init_process_group`` (rank 0 hosts the
  TCPStore) + ``destroy_process_group`` in the same actors. The form and the destroy are
  timed apart.
- *by name*: the same 2 ranks form one group name by name inside themselves
  (``init_process_group`` then ``destroy_process_group``, as Ray's module's
  ``init_collective_group`` with ``backend="raycoll"`` does), ``--rounds`` rounds in a row,
  timed from the driver; against gloo's init + destroy.
- *bulk*: ``--bulk`` root groups, each over the same ``--bulk`` actors (threaded actors:
  each takes part in every group's rendezvous at once), formed at once from as many driver
  threads; against one group over those actors formed alone. Cold: the process has one
  coordinator idle (the first bulk of a session starts the others); warm: after a bulk was
  destroyed (its coordinators recycled). gloo: one world ``init_process_group`` over the
  actors then ``--bulk`` ``new_group`` calls (torch's way to many groups over the same
  processes), against its world alone. Also: the same ``--bulk`` groups formed by one
  ``raycoll.create_groups`` call (every actor joins them all in one call), warm.

Ratios: gloo / raycoll for back to back (above 1: raycoll faster), for the form alone and
for the whole round (form + destroy); bulk / one group for raycoll (the target: at most 2).
``--sections`` runs only those named (default: all three).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import threading
import time
import uuid
from datetime import timedelta
from typing import Any, Dict, List

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

    def gloo_init(self, rank: int, world_size: int, port: int, groups: int = 0) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        for _ in range(groups):
            dist.new_group(list(range(world_size)), backend="gloo")

    def gloo_destroy(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def _imports(rank: int) -> None:
    import torch  # noqa: F401


def _by_name(rank: int, name: str) -> None:
    """Inside a rank: form ``name`` by name (``init_process_group``) and destroy it."""
    raycoll.init_process_group(world_size=2, rank=rank, group_name=name,
                               timeout=timedelta(seconds=60))
    raycoll.destroy_process_group(name)


def _raycoll_by_name(actors: List[Any], name: str) -> Dict[str, float]:
    start = time.perf_counter()
    ray.get([a.run.remote(_by_name, r, (name,), {}) for r, a in enumerate(actors)],
            timeout=120)
    return {"form": time.perf_counter() - start, "destroy": 0.0}


def _gloo(actors: List[Any], groups: int = 0) -> Dict[str, float]:
    port = ray.get(actors[0].free_port.remote(), timeout=60)
    start = time.perf_counter()
    ray.get([a.gloo_init.remote(r, len(actors), port, groups) for r, a in enumerate(actors)],
            timeout=120)
    formed = time.perf_counter()
    ray.get([a.gloo_destroy.remote() for a in actors], timeout=60)
    return {"form": formed - start, "destroy": time.perf_counter() - formed}


def _raycoll(actors: List[Any]) -> Dict[str, float]:
    name = f"b2b-{uuid.uuid4().hex[:6]}"
    start = time.perf_counter()
    raycoll.create_group(actors, group_name=name, timeout=60)
    formed = time.perf_counter()
    raycoll.destroy_group(name)
    return {"form": formed - start, "destroy": time.perf_counter() - formed}


def _bulk(actors: List[Any], count: int) -> float:
    """``count`` groups over ``actors`` formed at once (a driver thread each); destroyed
    after the timing."""
    names = [f"bulk-{uuid.uuid4().hex[:6]}" for _ in range(count)]
    errors: List[BaseException] = []

    def form(name: str) -> None:
        try:
            raycoll.create_group(actors, group_name=name, timeout=120)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=form, args=(n,)) for n in names]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - start
    for name in names:
        try:
            raycoll.destroy_group(name)
        except raycoll.GroupNotFoundError:  # its formation failed: raised below
            pass
    if errors:
        raise errors[0]
    return took


def _bulk_call(actors: List[Any], count: int) -> float:
    """``count`` groups over ``actors`` formed by one ``create_groups`` call; destroyed after
    the timing."""
    names = [f"bulk-{uuid.uuid4().hex[:6]}" for _ in range(count)]
    start = time.perf_counter()
    raycoll.create_groups(actors, names, timeout=120)
    took = time.perf_counter() - start
    for name in names:
        raycoll.destroy_group(name)
    return took


#: The script's sections, in the order they run.
_SECTIONS = ("b2b", "by-name", "bulk")


def _ms(values: List[float]) -> str:
    return f"{statistics.median(values) * 1e3:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bulk", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sections", default=",".join(_SECTIONS),
                        help=f"comma-separated, of {', '.join(_SECTIONS)} (default: all)")
    args = parser.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(_SECTIONS))
    if unknown:
        parser.error(f"--sections: expected names of {list(_SECTIONS)}, got {unknown}")
    start_ray(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    worker = ray.remote(num_cpus=0)(Rank)
    print(f"load average before: {os.getloadavg()}")
    pair = [worker.remote() for _ in range(2)]
    ray.get([a.run.remote(_imports, r, (), {}) for r, a in enumerate(pair)], timeout=300)
    spare.refill()
    time.sleep(2.0)  # the first coordinator ahead is up: what a process has after a while
    if "b2b" in sections:
        _back_to_back(pair, args.rounds, args.repeats)
    if "by-name" in sections:
        _by_name_rounds(pair, args.rounds, args.repeats)
    for actor in pair:
        ray.kill(actor)
    if "bulk" in sections:
        _bulk_section(worker, args.bulk, args.repeats)
    print(f"coordinators: {spare.counts()}; load average after: {os.getloadavg()}")
    ray.shutdown()


def _back_to_back(pair: List[Any], rounds: int, repeats: int) -> None:
    """``rounds`` rounds of form then destroy, ``repeats`` times, each library in turn."""
    b2b: Dict[str, List[Dict[str, float]]] = {"raycoll": [], "gloo": []}
    for repeat in range(repeats):
        for kind in (("raycoll", "gloo") if repeat % 2 == 0 else ("gloo", "raycoll")):
            for _ in range(rounds):  # back to back: nothing between the rounds
                b2b[kind].append(_raycoll(pair) if kind == "raycoll" else _gloo(pair))
    print(f"back to back, 2 ranks, {repeats} x {rounds} rounds, medians (ms):")
    print(f"  {'':8s} {'form':>8s} {'destroy':>8s} {'round':>8s}")
    for kind, rows in b2b.items():
        print(f"  {kind:8s} {_ms([r['form'] for r in rows])} {_ms([r['destroy'] for r in rows])} "
              f"{_ms([r['form'] + r['destroy'] for r in rows])}")

    def ratio(key: Any) -> float:
        return statistics.median(key(r) for r in b2b["gloo"]) / \
            statistics.median(key(r) for r in b2b["raycoll"])

    print(f"  gloo / raycoll (above 1: raycoll faster): form alone "
          f"{ratio(lambda r: r['form']):.2f}x, whole round (form + destroy) "
          f"{ratio(lambda r: r['form'] + r['destroy']):.2f}x")
    if repeats > 1:  # without each library's first repeat: the first round fetches the
        # ranks' infos, and the coordinator the pool's refill starts then (a Ray worker
        # process) takes the cores under the next rounds
        later = {k: rows[rounds:] for k, rows in b2b.items()}
        form = [statistics.median(r["form"] for r in later[k]) for k in ("gloo", "raycoll")]
        whole = [statistics.median(r["form"] + r["destroy"] for r in later[k])
                 for k in ("gloo", "raycoll")]
        print(f"  without each library's first {rounds} rounds (ms): form raycoll "
              f"{form[1] * 1e3:.1f}, gloo {form[0] * 1e3:.1f} ({form[0] / form[1]:.2f}x); "
              f"round raycoll {whole[1] * 1e3:.1f}, gloo {whole[0] * 1e3:.1f} "
              f"({whole[0] / whole[1]:.2f}x)")
    print(f"  raycoll every round's form (ms): "
          f"{[round(r['form'] * 1e3, 1) for r in b2b['raycoll']]}")


def _by_name_rounds(pair: List[Any], rounds: int, repeats: int) -> None:
    """One name formed by name inside the ranks, ``rounds`` rounds, ``repeats`` times."""
    by_name: Dict[str, List[float]] = {"raycoll": [], "gloo": []}
    name = f"named-{uuid.uuid4().hex[:6]}"  # one name, formed again and again (Ray's tests)
    for repeat in range(repeats):
        for kind in (("raycoll", "gloo") if repeat % 2 == 0 else ("gloo", "raycoll")):
            for _ in range(rounds):
                if kind == "raycoll":
                    by_name[kind].append(_raycoll_by_name(pair, name)["form"])
                else:
                    took = _gloo(pair)
                    by_name[kind].append(took["form"] + took["destroy"])
    print(f"by name inside the ranks (init_process_group + destroy_process_group of one name "
          f"in a row), {repeats} x {rounds} rounds, medians (ms): raycoll "
          f"{_ms(by_name['raycoll'])}, gloo init+destroy {_ms(by_name['gloo'])}: gloo / raycoll "
          f"{statistics.median(by_name['gloo']) / statistics.median(by_name['raycoll']):.2f}x; "
          f"raycoll every round: {[round(t * 1e3, 1) for t in by_name['raycoll']]}")


def _bulk_section(worker: Any, bulk: int, repeats: int) -> None:
    """``bulk`` groups over ``bulk`` actors: cold, warm, one create_groups call, gloo."""
    many = [worker.options(max_concurrency=bulk).remote() for _ in range(bulk)]
    ray.get([a.run.remote(_imports, r, (), {}) for r, a in enumerate(many)], timeout=300)
    spare.release()
    spare.refill()
    time.sleep(2.0)
    cold = _bulk(many, bulk)
    print(f"bulk, {bulk} groups over {bulk} actors at once, cold (1 coordinator "
          f"idle): {cold * 1e3:.1f} ms; coordinators: {spare.counts()}")
    one: List[float] = []
    warm: List[float] = []
    call: List[float] = []
    gloo_one: List[float] = []
    gloo_bulk: List[float] = []
    for repeat in range(repeats):
        one.append(_bulk(many, 1))
        if repeat % 2 == 0:  # threads and one call alternate which goes first
            warm.append(_bulk(many, bulk))
            call.append(_bulk_call(many, bulk))
        else:
            call.append(_bulk_call(many, bulk))
            warm.append(_bulk(many, bulk))
        gloo_one.append(_gloo(many)["form"])
        gloo_bulk.append(_gloo(many, bulk)["form"])
    print(f"bulk, {repeats} repeats, medians (ms):")
    print(f"  raycoll one group {_ms(one)}, {bulk} at once (warm) {_ms(warm)}: "
          f"{statistics.median(warm) / statistics.median(one):.2f}x one group; one "
          f"create_groups call {_ms(call)}: {statistics.median(call) / statistics.median(one):.2f}x")
    print(f"  every repeat (ms): one group {[round(t * 1e3) for t in one]}, threads "
          f"{[round(t * 1e3) for t in warm]}, create_groups {[round(t * 1e3) for t in call]}")
    print(f"  gloo world alone {_ms(gloo_one)}, world + {bulk} new_group {_ms(gloo_bulk)}: "
          f"{statistics.median(gloo_bulk) / statistics.median(gloo_one):.2f}x")
    print(f"  {bulk} groups, gloo / raycoll: "
          f"{statistics.median(gloo_bulk) / statistics.median(warm):.2f}x")


if __name__ == "__main__":
    main()
