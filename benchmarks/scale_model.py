"""The paper-scale case this machine cannot run: the cost model's predicted all_reduce time
for 64, 256 and 1,024 ranks, 8 a node, 25 Gb/s between nodes, shared memory inside, for every
all_reduce algorithm raycoll has; the flat ring is also what torch's gloo runs (it knows no
node map). Prints a markdown table (HISTORY.md, "Many ranks").

    python benchmarks/scale_model.py [--worlds 64,256,1024] [--per-node 8]

The model (raycoll.algorithms.cost): a step costs each rank alpha + beta * bytes per message
it sends, beta * bytes (+ gamma * bytes reduced) per message it receives; a step lasts as
long as its slowest rank. Here beta is half a byte's wire time at each end (a full-duplex
link moves a ring step's send and receive at once), alpha a message's latency.
"""

from __future__ import annotations

import argparse
import time
from typing import Dict, List

from raycoll.algorithms.cost import CostModel, LinkCost, predict
from raycoll.algorithms.schedule import ALGORITHMS
from raycoll.algorithms.topology import Topology

#: 25 Gb/s between nodes with 15 us of latency; shared memory inside a node (10 GB/s copies,
#: 3 us a message); reductions at 10 GB/s.
PAPER = CostModel({
    "unix": LinkCost(3e-6, 0.5 / 10e9),
    "tcp": LinkCost(15e-6, 0.5 / (25e9 / 8)),
}, gamma=1 / 10e9)

SIZES = {"4 B": 4, "1 MiB": 1 << 20, "64 MiB": 64 << 20}


def _fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def table(worlds: List[int], per_node: int, algorithms: List[str]) -> str:
    lines = ["| ranks (nodes) | size | " + " | ".join(algorithms) + " | best / ring |",
             "|---|---|" + "---|" * (len(algorithms) + 1)]
    for world in worlds:
        topo = Topology.from_sizes([per_node] * (world // per_node))
        for label, nbytes in SIZES.items():
            times: Dict[str, float] = predict("all_reduce", topo, nbytes, 4, PAPER,
                                              algorithms=algorithms)
            best = min(times, key=times.__getitem__)
            cells = [(f"**{_fmt(t)}**" if a == best else _fmt(t)) for a, t in times.items()]
            lines.append(f"| {world} ({topo.num_nodes}) | {label} | " + " | ".join(cells)
                         + f" | {times['ring'] / times[best]:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="64,256,1024")
    parser.add_argument("--per-node", type=int, default=8)
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    # the full mesh's one step of W^2 messages is left out past 64 ranks (it only loses)
    algorithms = [a for a in ALGORITHMS["all_reduce"] if a not in ("direct", "direct_rsag")]
    start = time.monotonic()
    print(table(worlds, args.per_node, algorithms))
    print(f"\n(model: {PAPER.as_dict()}; computed in {time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
