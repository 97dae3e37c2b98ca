"""DDP step time, raycoll backend vs gloo, same actors, same run.

    python benchmarks/ddp_step.py [--world-size 2] [--params 20] [--steps 10] [--rounds 3]
                                  [--nodes 1]

``--world-size`` Ray actors (``raycoll.spawn``) each build the same MLP of about ``--params``
million float32 parameters and train it with torch's ``DistributedDataParallel`` (SGD, batch
``--batch``), once over ``torch.distributed.init_process_group("raycoll")`` and once over
gloo (``init_method=tcp://127.0.0.1:<free port>``, ``GLOO_SOCKET_IFNAME=lo``: every socket
stays on loopback). The two alternate for ``--rounds`` rounds of ``--steps`` timed steps
(after ``--warmup`` untimed ones), so that both see the same machine. A step is forward,
backward (DDP's bucketed gradient all_reduces overlap it) and ``optimizer.step()``, timed on
every rank; the figure is the median over steps of the slowest rank. Each rank also reports
the CPU a step costs it: its main thread (forward, backward, DDP's reducer and bucket copies,
the optimizer) and its other threads (the backend's communication: raycoll's worker thread,
gloo's threads), medians over steps, averaged over ranks. ``--nodes N`` starts N Ray nodes
on this machine (``ray.cluster_utils.Cluster``) with the ranks spread over them in blocks, so
raycoll runs across nodes (its direct connections, on loopback); the transport it used is
printed. ``--json`` prints the numbers as JSON too.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import ray

import raycoll
from raycoll.launch import start_ray


def make_model(params_m: float, width: int = 2048) -> Any:
    import torch

    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    mods: List[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _step_times(model: Any, x: Any, cfg: Dict[str, Any],
                before: Callable[[], Any] = lambda: None,
                cpu: Optional[Dict[str, List[float]]] = None) -> List[float]:
    """Seconds of each of ``cfg["steps"]`` training steps (forward, backward, SGD step),
    after ``cfg["warmup"]`` untimed ones; ``before()`` runs untimed ahead of every step.
    ``cpu``: gets each step's CPU seconds of this thread (``main``) and of the process's
    other threads (``other``)."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    times = []
    for i in range(cfg["warmup"] + cfg["steps"]):
        before()
        start, main, proc = time.perf_counter(), time.thread_time(), time.process_time()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if i >= cfg["warmup"]:
            times.append(time.perf_counter() - start)
            if cpu is not None:
                main = time.thread_time() - main
                cpu["main"].append(main)
                cpu["other"].append(time.process_time() - proc - main)
    return times


def _time_steps(rank: int, backend: str, port: int, cfg: Dict[str, Any],
                cpu: Dict[str, List[float]]) -> List[float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if backend == "raycoll":
        dist.init_process_group("raycoll")
    else:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=cfg["world_size"])
    try:
        model = DDP(make_model(cfg["params"]))
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(cfg["batch"], 2048, generator=g)
        return _step_times(model, x, cfg, before=dist.barrier, cpu=cpu)
    finally:
        dist.destroy_process_group()


def bench_rank(rank: int, cfg: Dict[str, Any], ports: List[int]) -> Dict[str, Any]:
    """Every rank: alternate the two backends for ``rounds`` rounds."""
    import torch

    torch.set_num_threads(cfg["threads"])
    out: Dict[str, Any] = {"raycoll": [], "gloo": []}
    cpu: Dict[str, Dict[str, List[float]]] = {b: {"main": [], "other": []} for b in out}
    for r in range(cfg["rounds"]):
        for backend in ("raycoll", "gloo") if r % 2 == 0 else ("gloo", "raycoll"):
            out[backend] += _time_steps(rank, backend, ports[r], cfg, cpu[backend])
    out["cpu"] = {b: {k: statistics.median(v) for k, v in c.items()} for b, c in cpu.items()}
    out["node"] = ray.get_runtime_context().get_node_id()
    out["transport"] = raycoll.group.WORLD.context.transport_name  # the rank's default group
    return out


def compute_only(cfg: Dict[str, Any]) -> float:
    """The same step in one process without DDP (the compute floor), median seconds."""
    import torch

    torch.set_num_threads(cfg["threads"])
    model = make_model(cfg["params"])  # seeds torch's generator: x after it, as before
    x = torch.randn(cfg["batch"], 2048)
    return statistics.median(_step_times(model, x, cfg))


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--params", type=float, default=20.0, help="millions of parameters")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--nodes", type=int, default=1,
                        help="start N Ray nodes on this machine (ray.cluster_utils.Cluster) "
                             "and spread the ranks over them")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(list(argv))
    cfg = {"world_size": args.world_size, "params": args.params, "batch": args.batch,
           "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
           "threads": args.threads}
    rank_options: Dict[str, Any] = {"num_cpus": 0}
    if args.nodes > 1:  # one machine, several Ray nodes: the ranks in blocks, one block a node
        from ray.cluster_utils import Cluster

        os.environ.setdefault("RAYCOLL_SOCKET_IFNAME", "lo")  # direct connections on loopback
        os.environ.setdefault("RAY_free_objects_period_milliseconds", "10")
        per_node = -(-args.world_size // args.nodes)
        cluster = Cluster()
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=per_node, resources={"ddp_rank": per_node},
                             include_dashboard=False)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        rank_options["resources"] = {"ddp_rank": 1}
    elif not ray.is_initialized():  # as raycoll.spawn would (raycoll's object-free period):
        if os.environ.get("RAY_ADDRESS"):  # the cluster in RAY_ADDRESS, else a Ray of its own
            start_ray()
        else:
            start_ray(address="local", include_dashboard=False)
    ports = [_free_port() for _ in range(args.rounds)]
    results = raycoll.spawn(bench_rank, args.world_size, args=(cfg, ports),
                            actor_options=rank_options)
    numel = sum(p.numel() for p in make_model(args.params).parameters())
    summary: Dict[str, Any] = {"config": cfg, "parameters": numel}
    for backend in ("raycoll", "gloo"):
        per_step = [max(r[backend][i] for r in results) for i in range(len(results[0][backend]))]
        summary[backend] = {"median_s": statistics.median(per_step), "min_s": min(per_step),
                            "cpu_main_s": statistics.mean(r["cpu"][backend]["main"] for r in results),
                            "cpu_other_s": statistics.mean(r["cpu"][backend]["other"]
                                                           for r in results)}
    summary["gloo_over_raycoll"] = summary["gloo"]["median_s"] / summary["raycoll"]["median_s"]
    summary["compute_only_s"] = compute_only(cfg)
    nodes = len({r["node"] for r in results})
    where = f" on {nodes} Ray nodes" if nodes > 1 else ""
    print(f"DDP step, {numel / 1e6:.1f}M float32 parameters, {args.world_size} ranks{where}, batch "
          f"{args.batch}, {args.threads} torch thread(s) per rank, "
          f"{args.rounds} x {args.steps} steps each")
    for backend in ("raycoll", "gloo"):
        s = summary[backend]
        print(f"  {backend:8s} median {s['median_s'] * 1e3:8.1f} ms   min {s['min_s'] * 1e3:8.1f} ms"
              f"   CPU a step per rank: main thread {s['cpu_main_s'] * 1e3:6.1f} ms, other "
              f"threads {s['cpu_other_s'] * 1e3:6.1f} ms")
    print(f"  compute only (one process, no DDP): {summary['compute_only_s'] * 1e3:.1f} ms")
    print(f"  raycoll's transport: {sorted({r['transport'] for r in results})}")
    print(f"  gloo / raycoll step time: {summary['gloo_over_raycoll']:.2f}x")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
