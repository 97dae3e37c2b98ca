"""A Ray Compiled Graph's allreduce step: raycoll's communicator vs Ray's CPUCommunicator.

    python benchmarks/compiled_graph.py [--sizes 4,1M,64M] [--repeats 3] [--iters 300,50,5]

One driver, one local Ray (4 logical CPUs), three pairs of zero-CPU actors on this node, one
graph compiled on each pair, all three live at once. Each actor holds a float32 tensor of
each size, made once; a graph step is ``make(n)`` on both actors (returns the held tensor),
a ``ray.experimental.collective.allreduce`` node (SUM) with ``transport=`` the
communicator, and ``first(t)`` (the result's first element, so that the driver reads 4
bytes whatever the size). ``execute(n)`` then ``ray.get`` is one step. The three graphs:

- ``raycoll``: :class:`raycoll.compiled.RaycollCommunicator`;
- ``cpu``: Ray 2.60's ``CPUCommunicator`` (every collective goes through an async barrier
  actor: each rank sends its tensor there and ``ray.get``s the result);
- ``none``: the same graph without the allreduce node (``make`` -> ``first``).

For each size, ``--repeats`` rounds; in each round every graph runs ``--warmup`` untimed
then ``--iters`` timed steps, the graphs in turn (the first rotating per round), so the
three see the same machine state. Per round and graph, the medians of:

- ``step``: the whole step as the driver sees it (``execute`` -> ``ray.get``);
- ``allreduce share``: ``step`` minus the ``none`` graph's step of the same round: what the
  allreduce node adds to a step;
- ``in the actor``: the communicator's ``allreduce`` call timed inside the actors, of the
  rank that came to it last each step (the faster of the two calls: the other one also
  waited for its peer to arrive, which the graph's scheduling sets, not the communicator).

Ratios are cpu / raycoll per round, then their median: above 1, raycoll took less time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Tuple

import ray


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B") or "0"
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _label(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


class Member:
    """A graph's actor: holds one tensor per size; records its communicator's call times."""

    def __init__(self, rank: int, sizes: List[int]) -> None:
        import torch

        self.held = {n: torch.full((n // 4,), float(rank + 1)) for n in sizes}

    def make(self, nbytes: int) -> Any:
        return self.held[nbytes]

    def first(self, t: Any) -> Any:
        return t[:1].clone()


def _timed(cls: Any) -> Any:
    """``cls`` with its ``allreduce`` timed into ``self.times`` (nbytes, seconds)."""

    class Timed(cls):  # type: ignore[misc, valid-type]
        def allreduce(self, send_buf: Any, recv_buf: Any, op: Any = None) -> None:
            start = time.perf_counter()
            if op is None:
                super().allreduce(send_buf, recv_buf)
            else:
                super().allreduce(send_buf, recv_buf, op)
            self.__dict__.setdefault("times", []).append(
                (send_buf.numel() * 4, time.perf_counter() - start))

    Timed.__name__ = Timed.__qualname__ = f"Timed{cls.__name__}"
    return Timed


def _take_times(actor_self: Any) -> List[Tuple[int, float]]:
    from ray.experimental.channel import ChannelContext

    out: List[Tuple[int, float]] = []
    for comm in ChannelContext.get_current().communicators.values():
        out += comm.__dict__.pop("times", [])
    return out


def _graph(actors: List[Any], comm: Any) -> Any:
    import ray.experimental.collective as rcol
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as inp:
        xs = [a.make.bind(inp) for a in actors]
        if comm is not None:
            xs = rcol.allreduce.bind(xs, transport=comm)
        return MultiOutputNode([a.first.bind(x) for a, x in zip(actors, xs)]).experimental_compile()


def _steps(graph: Any, nbytes: int, iters: int, warmup: int, expect: float) -> List[float]:
    for _ in range(warmup):
        got = ray.get(graph.execute(nbytes), timeout=600)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        got = ray.get(graph.execute(nbytes), timeout=600)
        times.append(time.perf_counter() - start)
    if float(got[0][0]) != expect:
        raise SystemExit(f"wrong result at {nbytes} B: {float(got[0][0])} != {expect}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="4,1M,64M")
    parser.add_argument("--iters", default="200,30,4", help="timed steps per size and round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="rounds per size")
    args = parser.parse_args()
    sizes = [_size(s) for s in args.sizes.split(",")]
    iters = [int(i) for i in args.iters.split(",")]
    iters += [iters[-1]] * (len(sizes) - len(iters))

    from ray.experimental.channel.cpu_communicator import CPUCommunicator

    from raycoll.compiled import RaycollCommunicator

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    print(f"# python {' '.join(sys.argv)}   ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{os.cpu_count()} cores; load before: {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    pairs = {kind: [ray.remote(num_cpus=0)(Member).remote(r, sizes) for r in range(2)]
             for kind in ("raycoll", "cpu", "none")}
    comms = {"raycoll": _timed(RaycollCommunicator)(pairs["raycoll"]),
             "cpu": _timed(CPUCommunicator)(2, pairs["cpu"]), "none": None}
    graphs = {kind: _graph(pairs[kind], comms[kind]) for kind in pairs}
    expect = {"raycoll": 3.0, "cpu": 3.0, "none": 1.0}
    kinds = list(graphs)
    # per (kind, size): per round (step median, in-actor median)
    results: Dict[Tuple[str, int], List[Tuple[float, float]]] = {}
    for n, it in zip(sizes, iters):
        for rnd in range(args.repeats):
            order = kinds[rnd % 3:] + kinds[:rnd % 3]
            for kind in order:
                step = statistics.median(_steps(graphs[kind], n, it, args.warmup, expect[kind]))
                inner = float("nan")
                if comms[kind] is not None:
                    per_rank = ray.get([a.__ray_call__.remote(_take_times) for a in pairs[kind]])
                    ranks = [[t for b, t in times if b == n][-it:] for times in per_rank]
                    inner = statistics.median(min(pair) for pair in zip(*ranks))
                results.setdefault((kind, n), []).append((step, inner))
            line = "  ".join(f"{k} {results[(k, n)][-1][0] * 1e6:8.0f} us" for k in kinds)
            print(f"{_label(n):>7s} round {rnd}  step: {line}  in the actor: raycoll "
                  f"{results[('raycoll', n)][-1][1] * 1e6:.0f} us, cpu "
                  f"{results[('cpu', n)][-1][1] * 1e6:.0f} us  (load {os.getloadavg()[0]:.1f})",
                  flush=True)
    for graph in graphs.values():
        graph.teardown()
    comms["raycoll"].destroy()
    comms["cpu"].destroy()  # kills its barrier actor
    print()
    print("A compiled graph's allreduce step, 2 actors on one node, float32 SUM; medians over "
          f"{args.repeats} rounds (us); ratio = cpu / raycoll, the median of the per-round ratios")
    header = ("size", "step raycoll", "step cpu", "ratio", "step none", "share raycoll",
              "share cpu", "ratio", "in actor raycoll", "in actor cpu", "ratio")
    print("  ".join(f"{h:>16s}" if i else f"{h:>8s}" for i, h in enumerate(header)))
    for n in sizes:
        r, c, z = results[("raycoll", n)], results[("cpu", n)], results[("none", n)]
        med = statistics.median
        share_r = [rr[0] - zz[0] for rr, zz in zip(r, z)]
        share_c = [cc[0] - zz[0] for cc, zz in zip(c, z)]
        row = [_label(n), f"{med(x[0] for x in r) * 1e6:.0f}", f"{med(x[0] for x in c) * 1e6:.0f}",
               f"{med(cc[0] / rr[0] for rr, cc in zip(r, c)):.1f}x",
               f"{med(x[0] for x in z) * 1e6:.0f}",
               f"{med(share_r) * 1e6:.0f}", f"{med(share_c) * 1e6:.0f}",
               f"{med(sc / sr for sr, sc in zip(share_r, share_c) if sr > 0) if any(sr > 0 for sr in share_r) else float('nan'):.1f}x",
               f"{med(x[1] for x in r) * 1e6:.0f}", f"{med(x[1] for x in c) * 1e6:.0f}",
               f"{med(cc[1] / rr[1] for rr, cc in zip(r, c)):.1f}x"]
        print("  ".join(f"{v:>16s}" if i else f"{v:>8s}" for i, v in enumerate(row)))
    print(f"# load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for pair in pairs.values():
        for a in pair:
            ray.kill(a)
    ray.shutdown()


if __name__ == "__main__":
    main()
