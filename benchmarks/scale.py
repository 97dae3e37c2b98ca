"""The scale harness: raycoll against torch's gloo as the ranks and Ray nodes grow, on this
machine (Ray nodes from ``ray.cluster_utils.Cluster``), each pair in the same run.

For every (ranks, nodes) it runs ``raycoll-bench`` in a fresh Ray (a subprocess each: a
multi-node run starts its own cluster), ranks as zero-CPU actors, gloo interleaved row by
row, and prints per config: the group's formation time, all_reduce at 4 B / 1 MiB / 64 MiB
and broadcast at 64 MiB (gloo time / raycoll time: above 1 raycoll wins), and the largest
resident memory and open descriptors of a rank, raycoll's and gloo's. ``--plot`` draws the
ratios against the number of ranks.

    python benchmarks/scale.py --worlds 2,4,8,16,32 --nodes 1,2,4 --json results/scale.json

64 MiB rows run up to ``--big-up-to`` ranks (16 by default: past that, 2 cores move 64 MiB
per rank for minutes). The paper-scale case (64-1,024 ranks) is the cost model's:
benchmarks/scale_model.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

COLUMNS = [("all_reduce", 4), ("all_reduce", 1 << 20), ("all_reduce", 64 << 20),
           ("broadcast", 64 << 20)]


def _label(op: str, nbytes: int) -> str:
    size = {4: "4 B", 1 << 20: "1 MiB", 64 << 20: "64 MiB"}[nbytes]
    return f"{op} {size}"


def run_config(world: int, nodes: int, iters: int, big: bool,
               timeout_s: float) -> List[Dict[str, Any]]:
    """The rows of one ``raycoll-bench`` run for ``world`` ranks on ``nodes`` Ray nodes."""
    sizes = "4,1M,64M" if big else "4,1M"
    ops = "all_reduce,broadcast" if big else "all_reduce"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "raycoll.bench", "--op", ops, "--sizes", sizes,
               "--world-size", str(world), "--nodes", str(nodes), "--vs", "gloo",
               "--iters", str(iters), "--warmup", "2", "--no-progress", "--json", out]
        env = dict(os.environ, RAYCOLL_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo")
        subprocess.run(cmd, check=True, timeout=timeout_s, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out, encoding="utf-8") as fh:
            rows: List[Dict[str, Any]] = json.load(fh)
    # broadcast ran at every size; keep the columns asked for
    return [r for r in rows if (r["op"], r["bytes"]) in COLUMNS]


def _cell(rows: List[Dict[str, Any]], op: str, nbytes: int) -> str:
    for r in rows:
        if r["op"] == op and r["bytes"] == nbytes and r.get("ratio"):
            return f"{r['ratio']:.2f}x"
    return "-"


def table(results: List[Tuple[int, int, List[Dict[str, Any]]]]) -> str:
    head = ["ranks", "nodes", "formed (raycoll / gloo)"] + [_label(*c) for c in COLUMNS] + [
        "RSS a rank MiB (raycoll / gloo)", "fds a rank (raycoll / gloo)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for world, nodes, rows in results:
        first = rows[0] if rows else {}
        mib = 1 << 20
        lines.append("| " + " | ".join(
            [str(world), str(nodes),
             f"{first.get('formation_s', 0):.2f} s / {first.get('peer_formation_s') or 0:.2f} s"]
            + [_cell(rows, *c) for c in COLUMNS]
            + [f"{max(r.get('rank_rss_bytes', 0) for r in rows) / mib:.0f} / "
               f"{max(r.get('peer_rss_bytes', 0) for r in rows) / mib:.0f}",
               f"{max(r.get('rank_fds', 0) for r in rows)} / "
               f"{max(r.get('peer_fds', 0) for r in rows)}"]) + " |")
    return "\n".join(lines)


def plot(results: List[Tuple[int, int, List[Dict[str, Any]]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(COLUMNS), figsize=(4 * len(COLUMNS), 3.5), sharey=True)
    for ax, (op, nbytes) in zip(axes, COLUMNS):
        for nodes in sorted({n for _, n, _ in results}):
            pts = [(w, r["ratio"]) for w, n, rows in results if n == nodes for r in rows
                   if r["op"] == op and r["bytes"] == nbytes and r.get("ratio")]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=f"{nodes} node(s)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(_label(op, nbytes))
        ax.set_xlabel("ranks")
    axes[0].set_ylabel("gloo time / raycoll time")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4,8,16,32")
    parser.add_argument("--nodes", default="1,2,4")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--big-up-to", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a config")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    results = []
    for world in [int(w) for w in args.worlds.split(",")]:
        for nodes in [int(n) for n in args.nodes.split(",")]:
            if nodes > world:
                continue
            rows = run_config(world, nodes, args.iters, world <= args.big_up_to, args.timeout)
            results.append((world, nodes, rows))
            print(f"{world} ranks on {nodes} node(s): "
                  + ", ".join(f"{_label(r['op'], r['bytes'])} {r.get('ratio') or 0:.2f}x"
                              for r in rows), flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump([{"ranks": w, "nodes": n, "rows": rows} for w, n, rows in results], fh,
                      indent=1)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
