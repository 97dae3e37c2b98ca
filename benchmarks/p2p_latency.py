"""Point-to-point round trips, raycoll against torch.distributed gloo in the same Ray actors,
timed two ways (issue 43):

- **back to back**: rank 0 sends to the last rank and receives its reply, again and again;
- **after a barrier**: each round trip comes right after a barrier of the same library (as
  in a loop that does other work between calls: the peer is not already waiting in a spin).

Both libraries run in the same actors, interleaved size by size, so the ratio is a same-run
ratio. Reported: the median of rank 0's round trip (send + recv) in microseconds, and
``x gloo`` = gloo's median / raycoll's (> 1: raycoll is faster).

Usage: ``python benchmarks/p2p_latency.py [--world-size 2,4,8] [--sizes 4,1M,64M]
[--iters 2000] [--layers]`` (``--layers``: a 4 B round trip of 2 ranks through the public
functions, the group's pair pipes, and the native pipe alone). The ranks are zero-CPU actors on one Ray node (this machine).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import ray

import raycoll
from raycoll.bench.tables import parse_sizes
from raycoll.testing import RankPool


def _label(n: int) -> str:
    for unit, k in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k}{unit}"
    return str(n)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _round_trips(rank: int, world: int, port: int, sizes: List[int], iters: int,
                 ) -> Dict[str, Any]:
    """In a rank: raycoll's and gloo's round trips (rank 0 <-> the last rank), back to back
    and after a barrier, each size in turn. Only rank 0's times are returned."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    last = world - 1
    out: Dict[str, Any] = {}

    def trip(send: Callable[..., Any], recv: Callable[..., Any], x: Any, y: Any) -> None:
        if rank == 0:
            send(x, last)
            recv(y, last)
        elif rank == last:
            recv(y, 0)
            send(x, 0)

    try:
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            reps = iters if nbytes <= 1 << 16 else max(10, iters // (100 if nbytes > 1 << 22 else 20))
            xs: Dict[str, Any] = {"raycoll": np.ones(n, np.float32), "gloo": torch.ones(n)}
            ys: Dict[str, Any] = {"raycoll": np.zeros(n, np.float32), "gloo": torch.zeros(n)}
            calls: Dict[str, Tuple[Callable[..., Any], ...]] = {
                     "raycoll": (raycoll.send, raycoll.recv, raycoll.barrier),
                     "gloo": (dist.send, dist.recv, dist.barrier)}
            for pattern in ("back to back", "after a barrier"):
                for lib in ("raycoll", "gloo"):
                    send, recv, barrier = calls[lib]
                    for _ in range(max(3, reps // 10)):
                        trip(send, recv, xs[lib], ys[lib])
                    barrier()
                    times = []
                    for _ in range(reps):
                        if pattern == "after a barrier":
                            barrier()
                        t0 = time.perf_counter()
                        trip(send, recv, xs[lib], ys[lib])
                        times.append(time.perf_counter() - t0)
                    if rank in (0, last) and float(ys[lib][0]) != 1.0:
                        raise AssertionError(f"{lib} received {ys[lib][0]}, expected 1.0")
                    out.setdefault(f"{lib}|{pattern}", {})[nbytes] = times
        from raycoll.world import world as _world

        pipes = _world().default.context.pair_pipes()  # type: ignore[union-attr]
        out["path"] = type(pipes).__name__
    finally:
        dist.destroy_process_group()
    return out if rank == 0 else {}


def _layers(rank: int, iters: int) -> Dict[str, float]:
    """In a rank of 2: a 4 B round trip's median (us) through the public functions, through
    the group's pair pipes (:class:`raycoll.transport.pipes.PairPipes`: matching, no
    argument checks) and through the native pipe alone (``Pipe.send`` / ``Pipe.recv``)."""
    from raycoll.world import world as _world

    x, y = np.ones(1, np.float32), np.zeros(1, np.float32)
    peer = 1 - rank
    box = _world().default.context.pair_pipes()  # type: ignore[union-attr]
    meta = ("float32", (1,))

    def public() -> None:
        if rank == 0:
            raycoll.send(x, peer)
            raycoll.recv(y, peer)
        else:
            raycoll.recv(y, peer)
            raycoll.send(x, peer)

    def matched() -> None:
        if rank == 0:
            box.send(x, peer, 0, meta, 60.0)()
            box.recv(y, peer, 0, meta, 60.0)()
        else:
            box.recv(y, peer, 0, meta, 60.0)()
            box.send(x, peer, 0, meta, 60.0)()

    out: Dict[str, float] = {}
    for name, step in (("raycoll.send / raycoll.recv", public), ("PairPipes", matched)):
        for _ in range(iters // 10):
            step()
        raycoll.barrier()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e6
    pipe = box._pipe(peer)
    code = b"float32|1"
    wait = (int(200e3), int(10e6), int(100e6), int(1e9))
    raycoll.barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        if rank == 0:
            pipe.send(x, 0, code, True, False, False, wait, None)
            pipe.recv(y, 0, code, wait, None)
        else:
            pipe.recv(y, 0, code, wait, None)
            pipe.send(x, 0, code, True, False, False, wait, None)
        times.append(time.perf_counter() - t0)
    out["native pipe alone"] = statistics.median(times) * 1e6
    # CPU per call, robust to a loaded node: rank 0 sends n messages (each completes at once:
    # they fit the ring), then rank 1 receives them (each already there): no waiting
    n = 1000
    for name, send, recv in (
            ("raycoll.send / raycoll.recv", lambda: raycoll.send(x, peer),
             lambda: raycoll.recv(y, peer)),
            ("PairPipes", lambda: box.send(x, peer, 0, meta, 60.0)(),
             lambda: box.recv(y, peer, 0, meta, 60.0)()),
            ("native pipe alone", lambda: pipe.send(x, 0, code, False, False, False,
                                                    (0, 0, 0, 0), None),
             lambda: pipe.recv(y, 0, code, wait, None))):
        raycoll.barrier()
        c0 = time.thread_time()
        for _ in range(n):
            send() if rank == 0 else None
        raycoll.barrier()
        if rank == 1:
            c0 = time.thread_time()
            for _ in range(n):
                recv()
        out[f"CPU a {'send' if rank == 0 else 'recv'}: {name}"] = (
            (time.thread_time() - c0) / n * 1e6)
        raycoll.barrier()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", default="2")
    parser.add_argument("--sizes", default="4,1M,64M")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--layers", action="store_true",
                        help="also time a 4 B round trip of 2 ranks layer by layer")
    args = parser.parse_args()
    sizes = parse_sizes(args.sizes)
    worlds = [int(w) for w in args.world_size.split(",")]
    ray.init(address="local", num_cpus=max(4, max(worlds)), include_dashboard=False,
             log_to_driver=False)
    print(f"# p2p_latency: round trip rank 0 <-> last rank, float32, one node; median of rank "
          f"0 over the iterations (us); gloo in the same actors, same run; native core: "
          f"{raycoll.native_status()}")
    print(f"{'ranks':>5} {'size':>6} {'pattern':>16} {'raycoll us':>11} {'gloo us':>10} "
          f"{'x gloo':>7}")
    with RankPool(max_world_size=max(worlds)) as pool:
        for world in worlds:
            got = pool.run(_round_trips, world, world, _free_port(), sizes, args.iters,
                           timeout=900)[0]
            print(f"# {world} ranks: raycoll's p2p path: {got['path']}")
            for nbytes in sizes:
                for pattern in ("back to back", "after a barrier"):
                    ours = statistics.median(got[f"raycoll|{pattern}"][nbytes]) * 1e6
                    theirs = statistics.median(got[f"gloo|{pattern}"][nbytes]) * 1e6
                    print(f"{world:>5} {_label(nbytes):>6} {pattern:>16} {ours:>11.1f} "
                          f"{theirs:>10.1f} {theirs / ours:>7.2f}", flush=True)
        if args.layers:
            both = pool.run(_layers, 2, args.iters, timeout=900)
            print("# a 4 B round trip of 2 ranks, layer by layer (median us, rank 0), and "
                  "the CPU of one call (us; send: rank 0, recv: rank 1, nothing waited for):")
            for name, us in list(both[0].items()) + [
                    kv for kv in both[1].items() if kv[0].startswith("CPU a recv")]:
                print(f"#   {name}: {us:.1f}")


if __name__ == "__main__":
    main()
