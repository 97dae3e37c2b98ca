"""raycoll against torch gloo across Ray nodes in network namespaces (a real, shaped network).

Starts a :class:`raycoll.testing_netns.NetnsCluster` (a head on a bridge, worker nodes in
namespaces behind veth links shaped with tc tbf), places the ranks per layout ("2+2": two
ranks on each of two nodes), and runs every (op, size) with raycoll and with gloo
(raycoll.bench.peers.GlooPeer) in the same run, at each link rate. Prints, per row: the
median time of each (the slowest rank per iteration), gloo's time over raycoll's, and the
bytes the busiest node sent per call: from the links' own counters (the host end of each
veth; all traffic, Ray's too) for both libraries, and from raycoll's exact counters
(``ProcessGroup.counters()``, bytes to ranks on other nodes, summed over the node's ranks).

Needs root, ``ip`` and ``tc`` (see docs/topology-testing.md). Run:

    sudo python benchmarks/netns.py                     # the default matrix
    python benchmarks/netns.py --layouts 4+4 --rates 1gbit --sizes 64M --ops all_reduce
    python benchmarks/netns.py --layouts 2+2 --ops all_reduce,send_recv --pattern after-barrier
    python benchmarks/netns.py --layouts 1+1 --pin auto  # ranks that fit their node's cores

``--pin``: each node's processes on CPUs of their own (``taskset``; ``auto``: node i on CPU
i-1, round robin over this machine's; or one CPU list a node, ``/``-separated: ``0/1``), its
Ray ``CPU`` resource their count: a layout with no more ranks a node than its CPUs is then
"ranks that fit their node's cores", the case real clusters have. Each rank's CPUs are
printed under the header.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

import ray

import raycoll
from raycoll.bench.peers import PATTERNS, GlooPeer, _count, timed_calls
from raycoll.launch import RankWorker
from raycoll.testing_netns import NetnsCluster, netns_unavailable

#: The default ops; ``send_recv`` (a round trip between rank 0 and the last rank, on
#: another node) and the other ops of ``raycoll-bench`` run too when named.
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def _size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    unit = text[-1] if text and text[-1] in UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * UNITS[unit])


def _label(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]} {unit}iB"
    return f"{n} B"


def _iters(nbytes: int) -> Tuple[int, int]:
    """(timed iterations, warmup) for a size: fewer for the large ones."""
    if nbytes >= 16 * 1024 ** 2:
        return 3, 1
    if nbytes >= 64 * 1024:
        return 8, 2
    return 30, 5


def _raycoll_bench(rank: int, group: str, op: str, count: int, world: int, iters: int,
                   warmup: int, pattern: str = "back-to-back") -> Tuple[List[float], int]:
    """Runs in each rank: ``warmup`` + 1 untimed calls, a barrier, ``iters`` timed calls
    following ``pattern`` (raycoll.bench's). Returns the times and the bytes this rank sent
    to other nodes over all those calls (the collectives' counters)."""
    from raycoll.bench.ranks import _raycoll_step
    from raycoll.groups import world as world_state

    step, _ = _raycoll_step(op, count, "float32", rank, world, group)
    pg = world_state().groups[group]

    def other_node() -> int:
        return sum(int(c.get("bytes_sent_other_node", 0))
                   for c in pg.counters()["collectives"].values())

    before = other_node()
    for _ in range(warmup + 1):
        step()
    raycoll.barrier(group=group)
    times = timed_calls(step, iters, pattern, lambda: raycoll.barrier(group=group))
    return times, other_node() - before


def _per_node(cluster: NetnsCluster, before: Dict[int, int], calls: int) -> int:
    after = cluster.sent_bytes()
    return max(after[i] - before[i] for i in after) // max(1, calls)


def _affinity(rank: int) -> List[int]:
    return sorted(os.sched_getaffinity(0))


def run_layout(cluster: NetnsCluster, layout: List[int], rates: List[str], sizes: List[int],
               ops: List[str], out: List[str], pattern: str = "back-to-back") -> None:
    placement = [i + 1 for i, n in enumerate(layout) for _ in range(n)]
    world = len(placement)
    options = [cluster.actor_options(node) for node in placement]
    actors = [ray.remote(RankWorker).options(**o).remote() for o in options]
    if cluster.pin:
        cpus = ray.get([a.run.remote(_affinity, 0, (), {}) for a in actors], timeout=600)
        line = "# ranks' CPUs: " + ", ".join(f"rank {r} (node {n}): {c}" for r, (n, c)
                                             in enumerate(zip(placement, cpus)))
        print(line, flush=True)
        out.append(line)
    group = f"netns-{uuid.uuid4().hex[:6]}"
    raycoll.create_group(actors, group_name=group, timeout=600)
    gloo = GlooPeer()
    gloo.setup(world, options)
    name = "+".join(str(n) for n in layout)
    try:
        for rate in rates:
            for node in cluster.nodes:
                cluster.set_rate(node.index, rate)
            for op in ops:
                for nbytes in sizes:
                    iters, warmup = _iters(nbytes)
                    count = _count(op, nbytes, "float32", world)
                    calls = iters + warmup + 1
                    before = cluster.sent_bytes()
                    got = ray.get([a.run.remote(_raycoll_bench, r, (group, op, count, world,
                                                                     iters, warmup, pattern),
                                                {})
                                   for r, a in enumerate(actors)], timeout=1800)
                    rc_link = _per_node(cluster, before, calls)
                    rc_times = [max(t) for t in zip(*[g[0] for g in got])]
                    by_node: Dict[int, int] = {}
                    for node, (_, sent) in zip(placement, got):
                        by_node[node] = by_node.get(node, 0) + sent
                    rc_counted = max(by_node.values()) // calls
                    before = cluster.sent_bytes()
                    gl_times = gloo.run(op, nbytes, "float32", iters=iters, warmup=warmup,
                                        pattern=pattern)
                    gl_link = _per_node(cluster, before, calls)
                    rc, gl = statistics.median(rc_times), statistics.median(gl_times)
                    line = (f"{name:>8} {rate:>7} {op:>15} {_label(nbytes):>8} "
                            f"{rc * 1e3:>11.2f} {gl * 1e3:>11.2f} {gl / rc:>7.2f}x "
                            f"{rc_link / 1e3:>10.1f} {rc_counted / 1e3:>10.1f} "
                            f"{gl_link / 1e3:>10.1f}")
                    print(line, flush=True)
                    out.append(line)
    finally:
        gloo.close()
        raycoll.destroy_group(group)
        for a in actors:
            ray.kill(a, no_restart=True)


def parse_matrix(args: Any, what: str
                 ) -> Optional[Tuple[List[List[int]], List[str], List[int], List[str]]]:
    """The layouts, rates, sizes and ops of ``args``; None (said why) where namespaces cannot
    be made here. Ranks take each node's own veth, not the driver's interface."""
    reason = netns_unavailable()
    if reason:
        print(f"{what} skipped: {reason}")
        return None
    os.environ.pop("RAYCOLL_SOCKET_IFNAME", None)
    layouts = [[int(n) for n in text.split("+")] for text in args.layouts.split(",")]
    return (layouts, args.rates.split(","), [_size(s) for s in args.sizes.split(",")],
            args.ops.split(","))


def pin_lists(pin: Optional[str], nodes: int) -> Optional[List[str]]:
    """``--pin``'s CPU lists for ``nodes`` nodes (None: not pinned)."""
    if not pin:
        return None
    if pin == "auto":
        return [str(i % (os.cpu_count() or 1)) for i in range(nodes)]
    return pin.split("/")


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="2+2,4+4", help="ranks per node, e.g. 2+2,4+4")
    parser.add_argument("--rates", default="1gbit,10gbit", help="link rates (tc tbf)")
    parser.add_argument("--sizes", default="4,1M,64M")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--pattern", choices=PATTERNS, default="back-to-back",
                        help="each timed call back to back, after an untimed barrier, or "
                             "after a 1 ms pause (raycoll-bench's --pattern)")
    parser.add_argument("--pin", default=None,
                        help="each node on CPUs of its own: 'auto' (node i on CPU i-1) or "
                             "one taskset CPU list a node, '/'-separated (e.g. 0/1)")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    matrix = parse_matrix(args, "netns benchmark")
    if matrix is None:
        return 0
    layouts, rates, sizes, ops = matrix
    header = (f"{'layout':>8} {'rate':>7} {'op':>15} {'size':>8} {'raycoll ms':>11} "
              f"{'gloo ms':>11} {'gloo/rc':>8} {'rc kB/node':>10} {'rc counted':>10} "
              f"{'gloo kB/nd':>10}")
    out = [f"# python benchmarks/netns.py {' '.join(argv)}".rstrip(),
           f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
           f"raycoll native: {raycoll.native_status()}", header]
    print("\n".join(out), flush=True)
    for nodes in sorted({len(layout) for layout in layouts}):
        # each node's Ray CPUs: the cores the planner reads for it (NodePaths._machines);
        # unpinned, the nodes share this machine's: each its share
        cpus = max(1, (os.cpu_count() or 1) // nodes)
        with NetnsCluster(nodes, rate=rates[0], cpus=cpus,
                          pin=pin_lists(args.pin, nodes)) as cluster:
            ray.init(address=cluster.address, log_to_driver=False)
            try:
                for layout in layouts:
                    if len(layout) == nodes:
                        run_layout(cluster, layout, rates, sizes, ops, out, args.pattern)
            finally:
                ray.shutdown()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
