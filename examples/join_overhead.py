"""What a joined rank costs the ranks still working, per iteration (a quick figure).

    python examples/join_overhead.py [--world-size 2] [--iters 300]

Three loops of ``iters`` iterations, each one small ``all_reduce`` (one float64), timed on
the last rank (median and mean per iteration):

- ``plain``: no Join: the floor, one small all_reduce;
- ``join, none joined``: inside ``Join``, no rank has run out (each iteration adds the join
  round that ``notify_join_context`` posts without waiting);
- ``join, rank 0 joined``: rank 0 has no inputs at all and shadows every iteration.

torch's Join adds one small all-reduce per iteration; raycoll's adds one coordinator round
trip, so ``joined - plain`` should stay within about one ``plain``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Sequence

import numpy as np
import ray

import raycoll


class _Reducer(raycoll.Joinable):
    def __init__(self) -> None:
        super().__init__()
        self.buf = np.ones(1)

    def step(self) -> None:
        raycoll.Join.notify_join_context(self)
        self.buf[...] = 1.0
        raycoll.all_reduce(self.buf)

    def join_hook(self, **kwargs: Any) -> raycoll.JoinHook:
        reducer = self

        class Hook(raycoll.JoinHook):
            def main_hook(self) -> None:
                reducer.buf[...] = 0.0
                raycoll.all_reduce(reducer.buf)

        return Hook()

    @property
    def join_device(self) -> str:
        return "cpu"

    @property
    def join_process_group(self) -> Any:
        return None


def _timed(n: int, step: Any) -> List[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def measure(rank: int, iters: int, warmup: int) -> Dict[str, List[float]]:
    """Runs on every rank; returns per-iteration seconds of each loop."""
    times: Dict[str, List[float]] = {}
    buf = np.ones(1)
    _timed(warmup, lambda: raycoll.all_reduce(buf))
    raycoll.barrier()
    times["plain"] = _timed(iters, lambda: raycoll.all_reduce(buf))
    reducer = _Reducer()
    raycoll.barrier()
    with raycoll.Join([reducer]):
        times["join, none joined"] = _timed(iters, reducer.step)
    raycoll.barrier()
    with raycoll.Join([reducer]):
        n = 0 if rank == 0 else iters
        times["join, rank 0 joined"] = _timed(n, reducer.step)
    return times


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    args = parser.parse_args(list(argv))
    if not ray.is_initialized():  # the cluster in RAY_ADDRESS, else a Ray of its own
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:
            ray.init(address="local", include_dashboard=False)
    results = raycoll.spawn(measure, args.world_size, args=(args.iters, args.warmup),
                            actor_options={"num_cpus": 0})
    last = results[-1]
    plain = float(np.median(last["plain"]))
    print(f"world_size={args.world_size} iters={args.iters} (times on rank {args.world_size - 1})")
    for name, values in last.items():
        med = float(np.median(values))
        print(f"{name:22s} median {med * 1e3:7.3f} ms  mean {np.mean(values) * 1e3:7.3f} ms  "
              f"(+{(med - plain) * 1e3:.3f} ms over plain)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
