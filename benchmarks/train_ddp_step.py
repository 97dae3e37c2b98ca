"""The DDP step of benchmarks/ddp_step.py inside Ray Train's workers: raycoll vs gloo, same run.

    python benchmarks/train_ddp_step.py [--params 20] [--batch 16] [--steps 8] [--warmup 3]
                                        [--rounds 3] [--placements pack,spread] [--json]

One driver starts two Ray nodes on this machine (``ray.cluster_utils.Cluster``, 2 CPUs
each; ``RAYCOLL_SOCKET_IFNAME=lo`` and ``GLOO_SOCKET_IFNAME=lo``: every socket on loopback).
A fit is one ``TorchTrainer`` run of 2 workers (1 CPU each) with ``torch_config`` either
``RaycollConfig()`` or ``TorchConfig(backend="gloo")``, and ``placement_strategy``
``STRICT_PACK`` (both workers on one node: raycoll's shared-memory lane) or
``STRICT_SPREAD`` (one worker a node: raycoll's direct connections). In each worker,
``ray.train.torch.prepare_model`` wraps ddp_step's MLP in DDP and ddp_step's step loop times
``--steps`` steps after ``--warmup`` (a barrier, untimed, before every step). Per round and
placement the two backends run one after the other, the first alternating between rounds.
``--placements`` may add ``actors``, the control without Ray Train: ddp_step.py's own
harness (``raycoll.spawn``, two zero-CPU actors on one node of the same cluster, each
backend's process group set up by hand, raycoll then gloo).
The figure is the median over a fit's steps of the slowest worker's step, then the median
over rounds; the ratio gloo / raycoll is taken per round (same machine state) and its
median printed, with the range.

Also the shared part of ``benchmarks/train_restart.py``: :func:`fit` and :data:`BACKENDS`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

import ray
import ray.cloudpickle

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp_step  # noqa: E402 - beside this file

ray.cloudpickle.register_pickle_by_value(ddp_step)  # Ray Train's workers cannot import it

BACKENDS = ("raycoll", "gloo")
PLACEMENTS = {"pack": "STRICT_PACK", "spread": "STRICT_SPREAD"}
#: ``--placements actors``: ddp_step.py's own harness (raycoll.spawn, plain zero-CPU actors,
#: torch.distributed set up by hand) on one node of the same cluster: the control, no Ray Train
ACTORS = "actors"


def torch_config(backend: str) -> Any:
    """The ``torch_config`` of ``backend``: raycoll or Ray Train's own gloo."""
    from ray.train.torch import TorchConfig

    from raycoll.train import RaycollConfig

    return RaycollConfig() if backend == "raycoll" else TorchConfig(backend=backend)


def fit(train_fn: Callable[[Dict[str, Any]], None], backend: str, config: Dict[str, Any],
        storage: str, placement: str = "PACK", max_failures: int = 0) -> Tuple[Any, float]:
    """One ``TorchTrainer`` fit of 2 workers of 1 CPU on ``backend``, a fresh run name (Ray
    Train would restore a run of the same name); returns the result and its seconds."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_fn, train_loop_config=config, torch_config=torch_config(backend),
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1},
                                     placement_strategy=placement),
        run_config=RunConfig(name=f"{backend}-{uuid.uuid4().hex[:8]}", storage_path=storage,
                             failure_config=FailureConfig(max_failures=max_failures)))
    start = time.perf_counter()
    result = trainer.fit()
    return result, time.perf_counter() - start


def _train_fn(config: Dict[str, Any]) -> None:
    """Every worker: ddp_step's model under prepare_model (DDP), its step loop; rank 0
    writes every worker's step times and CPU to ``config["out"]`` (one machine: a local
    file; Ray Train keeps metrics only of reports with a checkpoint)."""
    import torch
    import torch.distributed as dist
    import ray.train
    import ray.train.torch

    torch.set_num_threads(config["threads"])
    rank = ray.train.get_context().get_world_rank()
    model = ray.train.torch.prepare_model(ddp_step.make_model(config["params"]))
    x = torch.randn(config["batch"], 2048, generator=torch.Generator().manual_seed(rank))
    cpu: Dict[str, List[float]] = {"main": [], "other": []}
    times = ddp_step._step_times(model, x, config, before=dist.barrier, cpu=cpu)
    transport = "gloo"
    if dist.get_backend() == "raycoll":
        import raycoll.train

        transport = raycoll.train.get_group().transport_name
    mine = {"times": times, "cpu_other": statistics.median(cpu["other"]), "transport": transport,
            "node": ray.get_runtime_context().get_node_id()}
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump(every, f)


def _start_cluster() -> Any:
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAYCOLL_SOCKET_IFNAME", "lo")  # before the nodes start: they
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")     # and their workers inherit these
    cluster = Cluster()
    for i in range(2):
        cluster.add_node(num_cpus=2, resources={f"node{i}": 2}, include_dashboard=False)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)  # the workers' logs: files
    return cluster


def _fit_once_more_on_flake(backend: str, cfg: Dict[str, Any], storage: str,
                            placement: str) -> None:
    """A fit; once more if Ray Train's PlacementGroupCleaner (Ray 2.60) removed the live run's
    placement group, taking it for a dead run's (seen once in ~20 fits on the loaded
    machine, on a Ray without dashboard: its workers die, "A worker health check failed")."""
    try:
        fit(_train_fn, backend, cfg, storage, placement)
    except Exception as e:  # noqa: BLE001 - Ray Train raises the run's error from fit()
        if "placement group was removed" not in str(e):
            raise
        print(f"  ({backend} {placement}: the run's placement group was removed under it "
              "by Ray Train's cleaner; fitting again)", flush=True)
        fit(_train_fn, backend, cfg, storage, placement)


def _control(cfg: Dict[str, Any]) -> Dict[str, List[Dict[str, Any]]]:
    """ddp_step.py's harness (both backends in the same 2 actors on node 0, raycoll first),
    as per-backend lists of what :func:`_train_fn` reports per worker."""
    import raycoll

    results = raycoll.spawn(ddp_step.bench_rank, 2,
                            args=({**cfg, "world_size": 2, "rounds": 1}, [ddp_step._free_port()]),
                            actor_options={"num_cpus": 0, "resources": {"node0": 1}})
    return {b: [{"times": res[b], "cpu_other": res["cpu"][b]["other"], "node": res["node"],
                 "transport": res["transport"] if b == "raycoll" else b} for res in results]
            for b in BACKENDS}


def _run(args: argparse.Namespace, placements: List[str],
         cfg: Dict[str, Any]) -> Dict[str, Dict[str, Dict[str, List[Any]]]]:
    """The fits, interleaved; per placement and backend, each round's median step (slowest
    worker), raycoll's transport, the number of nodes, the communication CPU a step."""
    storage = tempfile.mkdtemp(prefix="raycoll-train-bench-")
    rows: Dict[str, Dict[str, Dict[str, List[Any]]]] = {
        p: {b: {"median_s": [], "transport": [], "nodes": [], "cpu_other_s": []}
            for b in BACKENDS} for p in placements}
    for r in range(args.rounds):
        for p in placements:
            control = _control(cfg) if p == ACTORS else {}
            for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
                if p == ACTORS:
                    ranks = control[backend]
                else:
                    out = os.path.join(storage, f"{r}-{p}-{backend}.json")
                    _fit_once_more_on_flake(backend, {**cfg, "out": out}, storage, PLACEMENTS[p])
                    with open(out) as f:
                        ranks = json.load(f)
                slowest = [max(rk["times"][i] for rk in ranks) for i in range(args.steps)]
                row = rows[p][backend]
                row["median_s"].append(statistics.median(slowest))
                row["transport"].append(ranks[0]["transport"])
                row["nodes"].append(len({rk["node"] for rk in ranks}))
                row["cpu_other_s"].append(statistics.mean(rk["cpu_other"] for rk in ranks))
                print(f"round {r} {p:6s} {backend:8s} median {row['median_s'][-1] * 1e3:7.1f} "
                      f"ms  ({row['transport'][-1]}, {row['nodes'][-1]} node(s), load "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
    return rows


def _report(args: argparse.Namespace, placements: List[str],
            rows: Dict[str, Dict[str, Dict[str, List[Any]]]]) -> Dict[str, Any]:
    """Print the medians over rounds and the per-round ratios; return them."""
    numel = sum(p.numel() for p in ddp_step.make_model(args.params).parameters())
    print(f"\nDDP step under Ray Train (TorchTrainer, 2 workers, prepare_model), "
          f"{numel / 1e6:.1f}M float32 parameters, batch {args.batch}, {args.threads} torch "
          f"thread(s) per worker, {args.rounds} rounds x {args.steps} steps; medians over "
          f"rounds of each fit's median step (slowest worker)")
    summary: Dict[str, Any] = {"parameters": numel, "rows": rows}
    for p in placements:
        ratios = [g / c for g, c in zip(rows[p]["gloo"]["median_s"],
                                        rows[p]["raycoll"]["median_s"])]
        summary[p] = {"gloo_over_raycoll": statistics.median(ratios)}
        for backend in BACKENDS:
            row = rows[p][backend]
            rounds = ", ".join(f"{v * 1e3:.1f}" for v in row["median_s"])
            print(f"  {p:6s} {backend:8s} {statistics.median(row['median_s']) * 1e3:7.1f} ms  "
                  f"(rounds {rounds})  communication CPU a step per worker "
                  f"{statistics.median(row['cpu_other_s']) * 1e3:5.1f} ms  transport "
                  f"{sorted(set(row['transport']))}, nodes {sorted(set(row['nodes']))}")
        print(f"  {p:6s} gloo / raycoll: {statistics.median(ratios):.2f}x "
              f"(per round {', '.join(f'{v:.2f}' for v in ratios)})")
    return summary


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=20.0, help="millions of parameters")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--placements", default="pack,spread",
                        help="comma-separated: pack (one node), spread (one worker a node), "
                             "actors (the control: ddp_step.py's harness, no Ray Train)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(list(argv))
    placements = args.placements.split(",")
    cfg = {"params": args.params, "batch": args.batch, "steps": args.steps,
           "warmup": args.warmup, "threads": args.threads}
    cluster = _start_cluster()
    try:
        rows = _run(args, placements, cfg)
    finally:
        ray.shutdown()
        cluster.shutdown()
    summary = _report(args, placements, rows)
    summary["config"] = cfg
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
