"""Does the cost model, calibrated on a real (shaped) network, pick the fastest algorithm?

Starts a :class:`raycoll.testing_netns.NetnsCluster` (worker nodes in network namespaces
behind veth links shaped with tc tbf), runs ``raycoll-bench --calibrate`` on it (a separate
driver joining the harness's head, ``--address``), then, per layout and link rate, times every
algorithm of each collective forced (the ``<op>_algo`` group option) and the cost model's own
choice with the calibrated ``cost_model`` option, each in a group of its own among the same
rank actors, in turn (3 passes below 16 MiB, each group's best median kept: the machine's
other load comes in bursts). Prints, per (layout, rate, op, size): the best forced
algorithm and its time, what the calibrated model picked and the time of that group, and
``auto/best`` (the target: <= 1.2 in every row). Times: the median over iterations of the
slowest rank.

Needs root, ``ip`` and ``tc`` (see docs/topology-testing.md). Run:

    python benchmarks/netns_calibrate.py --out benchmarks/results/netns_calibrate.txt
    python benchmarks/netns_calibrate.py --layouts 4+4 --rates 1gbit --ops all_reduce
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any, Dict, List, Tuple

import ray

import raycoll
from raycoll.algorithms.schedule import ALGORITHMS
from raycoll.bench.peers import _count
from raycoll.launch import RankWorker
from raycoll.testing_netns import NetnsCluster

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns import OPS, _label, _raycoll_bench, parse_matrix  # noqa: E402

TARGET = 1.2


def _iters(nbytes: int) -> Tuple[int, int]:
    """(timed iterations, warmup) for a size: few for the large ones (64 MiB over 1 Gbit/s
    takes ~0.6 s a call)."""
    if nbytes >= 16 * 1024 ** 2:
        return 3, 0
    if nbytes >= 64 * 1024:
        return 6, 1
    return 20, 3


def _passes(nbytes: int) -> int:
    """Passes over all groups: 3 where a call takes milliseconds, 1 for the large sizes."""
    return 1 if nbytes >= 16 * 1024 ** 2 else 3


def calibrate_on(cluster: NetnsCluster) -> Dict[str, Any]:
    """``raycoll-bench --calibrate`` run against the harness (its own driver process)."""
    cmd = [sys.executable, "-m", "raycoll.bench", "--calibrate", "--address", cluster.address,
           "--sizes", "4,16M", "--iters", "5", "--warmup", "1"]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in os.environ.items()
                              if k != "RAYCOLL_SOCKET_IFNAME"})
    if got.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{got.stdout}\n{got.stderr}")
    return dict(json.loads(got.stdout.strip().splitlines()[-1]))


def _time(actors: List[Any], group: str, op: str, nbytes: int) -> float:
    world = len(actors)
    iters, warmup = _iters(nbytes)
    count = _count(op, nbytes, "float32", world)
    got = ray.get([a.run.remote(_raycoll_bench, r, (group, op, count, world, iters, warmup), {})
                   for r, a in enumerate(actors)], timeout=1800)
    return statistics.median(max(t) for t in zip(*[g[0] for g in got]))


def run_layout(cluster: NetnsCluster, layout: List[int], rates: List[str], sizes: List[int],
               ops: List[str], model: Dict[str, Any], out: List[str]) -> List[float]:
    placement = [i + 1 for i, n in enumerate(layout) for _ in range(n)]
    actors = [ray.remote(RankWorker).options(**cluster.actor_options(node)).remote()
              for node in placement]
    name = "+".join(str(n) for n in layout)
    ratios = []
    groups: Dict[Tuple[str, str], str] = {}
    try:
        for op in ops:
            for algo in ALGORITHMS[op] + ("auto",):
                group = f"cal-{uuid.uuid4().hex[:6]}"
                options = ({"cost_model": model} if algo == "auto"
                           else {f"{op}_algo": algo})
                raycoll.create_group(actors, group_name=group, timeout=600, options=options)
                groups[(op, algo)] = group
        for rate in rates:
            for node in cluster.nodes:
                cluster.set_rate(node.index, rate)
            for op in ops:
                for nbytes in sizes:
                    # passes over every group in turn, the best of each group's medians:
                    # a burst of the machine's other load hits one pass, not one group
                    runs: Dict[str, List[float]] = {}
                    for _ in range(_passes(nbytes)):
                        for algo in ALGORITHMS[op] + ("auto",):
                            runs.setdefault(algo, []).append(
                                _time(actors, groups[(op, algo)], op, nbytes))
                    times = {algo: min(runs[algo]) for algo in ALGORITHMS[op]}
                    auto_t = min(runs["auto"])
                    picked = raycoll.group_status(groups[(op, "auto")])["algorithms"].get(op, "?")
                    best = min(times, key=lambda a: times[a])
                    ratio = auto_t / times[best]
                    ratios.append(ratio)
                    line = (f"{name:>5} {rate:>7} {op:>15} {_label(nbytes):>7} "
                            f"{best:>21} {times[best] * 1e3:>9.2f} {picked:>21} "
                            f"{times.get(picked, float('nan')) * 1e3:>9.2f} "
                            f"{auto_t * 1e3:>9.2f} {ratio:>6.2f}x"
                            f"{'' if ratio <= TARGET else '  MISS'}")
                    print(line, flush=True)
                    print("      all: " + ", ".join(f"{a} {t * 1e3:.2f}"
                                                    for a, t in times.items()), flush=True)
                    out.append(line)
                    out.append("      all ms: " + ", ".join(f"{a} {t * 1e3:.2f}"
                                                        for a, t in times.items()))
    finally:
        for group in groups.values():
            raycoll.destroy_group(group)
        for a in actors:
            ray.kill(a, no_restart=True)
    return ratios


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="2+2,4+4", help="ranks per node, e.g. 2+2,4+4")
    parser.add_argument("--rates", default="1gbit", help="link rates (tc tbf)")
    parser.add_argument("--sizes", default="4,1M,64M")
    parser.add_argument("--ops", default="all_reduce")
    parser.add_argument("--model", help="a cost_model (JSON) to use instead of calibrating")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the harness down
    matrix = parse_matrix(args, "netns calibration check")
    if matrix is None:
        return 0
    layouts, rates, sizes, ops = matrix
    for op in ops:
        if op not in OPS:
            raise SystemExit(f"--ops: expected some of {', '.join(OPS)}, got {op!r}")
    out = [f"# python benchmarks/netns_calibrate.py {' '.join(argv)}".rstrip(),
           f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
           f"raycoll native: {raycoll.native_status()}"]
    print("\n".join(out), flush=True)
    ratios: List[float] = []
    for nodes in sorted({len(layout) for layout in layouts}):
        cpus = max(max(layout) for layout in layouts if len(layout) == nodes)
        with NetnsCluster(nodes, rate=rates[0], cpus=cpus) as cluster:
            model = json.loads(args.model) if args.model else calibrate_on(cluster)
            note = f"# cost_model ({'given' if args.model else 'raycoll-bench --calibrate'}" \
                   f" at {rates[0]}): {json.dumps(model)}"
            header = (f"{'lay':>5} {'rate':>7} {'op':>15} {'size':>7} {'best forced':>21} "
                      f"{'ms':>9} {'auto picked':>21} {'forced ms':>9} {'auto ms':>9} "
                      f"{'auto/best':>7}")
            out += [note, header]
            print(note + "\n" + header, flush=True)
            ray.init(address=cluster.address, log_to_driver=False)
            try:
                for layout in layouts:
                    if len(layout) == nodes:
                        ratios += run_layout(cluster, layout, rates, sizes, ops, model, out)
            finally:
                ray.shutdown()
    worst = max(ratios, default=float("nan"))
    tail = (f"# worst auto/best: {worst:.2f}x; rows within {TARGET}x: "
            f"{sum(r <= TARGET for r in ratios)}/{len(ratios)}")
    print(tail)
    out.append(tail)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
