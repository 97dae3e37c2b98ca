"""Inside the benchmark's ranks: the actor that joins a raycoll group and times one
operation on it, and each operation's step (zeros, like the peers) and checked step (exact
per-rank patterns, counting wrong output elements)."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import ray

from raycoll.bench.peers import OPS, process_usage, timed_calls

__all__ = ["BenchRank", "BenchRankRemote", "pattern"]


def pattern(rank: int, chunk: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Small exact integers that differ per rank and chunk (sums stay exact in any dtype)."""
    return ((np.arange(count) + 7 * rank + 3 * chunk) % 13 + 1).astype(dtype)


Step = Callable[[], Any]
Check = Callable[[], int]


def _raycoll_step(op: str, count: int, dtype_name: str, rank: int, world: int,
                  group: str) -> Tuple[Step, Check]:
    """One iteration of ``op`` on ``group`` (zeros, like the peers), and a checked iteration
    that fills the inputs with :func:`pattern`, runs once and counts wrong output elements."""
    import raycoll

    dt = np.dtype(dtype_name)
    W = world

    def zeros(n: int = count) -> np.ndarray:
        return np.zeros(n, dtype=dt)

    def pat(r: int, j: int = 0) -> np.ndarray:
        return pattern(r, j, count, dt)

    def summed(j: int = 0) -> np.ndarray:
        return np.sum([pat(r, j) for r in range(W)], axis=0).astype(dt)

    def wrong(got: np.ndarray, want: np.ndarray) -> int:
        return int(np.count_nonzero(np.asarray(got).reshape(-1) != np.asarray(want).reshape(-1)))

    x = zeros()
    if op == "all_reduce":
        def check() -> int:
            x[:] = pat(rank)
            raycoll.all_reduce(x, group=group)
            return wrong(x, summed())
        return (lambda: raycoll.all_reduce(x, group=group)), check
    if op == "broadcast":
        def check() -> int:
            x[:] = pat(0) if rank == 0 else 0
            raycoll.broadcast(x, 0, group=group)
            return wrong(x, pat(0))
        return (lambda: raycoll.broadcast(x, 0, group=group)), check
    if op == "reduce":
        def check() -> int:
            x[:] = pat(rank)
            raycoll.reduce(x, 0, group=group)
            return wrong(x, summed()) if rank == 0 else 0
        return (lambda: raycoll.reduce(x, 0, group=group)), check
    if op == "all_gather":
        outs = [zeros() for _ in range(W)]

        def check() -> int:
            x[:] = pat(rank)
            raycoll.all_gather(outs, x, group=group)
            return sum(wrong(outs[s], pat(s)) for s in range(W))
        return (lambda: raycoll.all_gather(outs, x, group=group)), check
    if op == "all_gather_into_tensor":
        big = zeros(count * W)

        def check() -> int:
            x[:] = pat(rank)
            raycoll.all_gather_into_tensor(big, x, group=group)
            return wrong(big, np.concatenate([pat(s) for s in range(W)]))
        return (lambda: raycoll.all_gather_into_tensor(big, x, group=group)), check
    if op == "reduce_scatter":
        ins = [zeros() for _ in range(W)]

        def check() -> int:
            for j in range(W):
                ins[j][:] = pat(rank, j)
            raycoll.reduce_scatter(x, ins, group=group)
            return wrong(x, summed(rank))
        return (lambda: raycoll.reduce_scatter(x, ins, group=group)), check
    if op == "reduce_scatter_tensor":
        big = zeros(count * W)

        def check() -> int:
            big[:] = np.concatenate([pat(rank, j) for j in range(W)])
            raycoll.reduce_scatter_tensor(x, big, group=group)
            return wrong(x, summed(rank))
        return (lambda: raycoll.reduce_scatter_tensor(x, big, group=group)), check
    if op == "all_to_all":
        ins, outs = [zeros() for _ in range(W)], [zeros() for _ in range(W)]

        def check() -> int:
            for j in range(W):
                ins[j][:] = pat(rank, j)
            raycoll.all_to_all(outs, ins, group=group)
            return sum(wrong(outs[s], pat(s, rank)) for s in range(W))
        return (lambda: raycoll.all_to_all(outs, ins, group=group)), check
    if op == "all_to_all_single":
        src, dst = zeros(count * W), zeros(count * W)

        def check() -> int:
            src[:] = np.concatenate([pat(rank, j) for j in range(W)])
            raycoll.all_to_all_single(dst, src, group=group)
            return wrong(dst, np.concatenate([pat(s, rank) for s in range(W)]))
        return (lambda: raycoll.all_to_all_single(dst, src, group=group)), check
    if op == "gather":
        gathered = [zeros() for _ in range(W)] if rank == 0 else None

        def check() -> int:
            x[:] = pat(rank)
            raycoll.gather(x, gathered, 0, group=group)
            return sum(wrong(gathered[s], pat(s)) for s in range(W)) if gathered is not None else 0
        return (lambda: raycoll.gather(x, gathered, 0, group=group)), check
    if op == "scatter":
        pieces = [zeros() for _ in range(W)] if rank == 0 else None

        def check() -> int:
            if pieces is not None:
                for j in range(W):
                    pieces[j][:] = pat(0, j)
            raycoll.scatter(x, pieces, 0, group=group)
            return wrong(x, pat(0, rank))
        return (lambda: raycoll.scatter(x, pieces, 0, group=group)), check
    if op == "barrier":
        def check() -> int:
            raycoll.barrier(group=group)
            return 0
        return (lambda: raycoll.barrier(group=group)), check
    if op == "send_recv":
        # a round trip between rank 0 and the last rank (on another node with --nodes)
        got = zeros()
        peer = W - 1 if rank == 0 else 0

        def ping_pong() -> None:
            if rank == 0:
                raycoll.send(x, peer, group=group)
                raycoll.recv(got, peer, group=group)
            elif rank == W - 1:
                raycoll.recv(got, peer, group=group)
                raycoll.send(x, peer, group=group)

        def check() -> int:
            x[:] = pat(rank)
            ping_pong()
            return wrong(got, pat(peer)) if rank in (0, W - 1) else 0
        return ping_pong, check
    raise ValueError(f"op: expected one of {', '.join(OPS)}; got {op!r}")


class BenchRank:
    """A benchmark rank: an actor that joins a raycoll group and times collectives on it."""

    def placement(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def usage(self) -> Tuple[int, int]:
        """This rank's resident memory (bytes) and open file descriptors."""
        return process_usage()

    def bench(self, op: str, count: int, dtype: str, iters: int, warmup: int, check: bool,
              group: str, pattern: str = "back-to-back") -> Tuple[List[float], Optional[int]]:
        import raycoll
        from raycoll.world import world as _world

        pg = _world().resolve(group)
        rank, world = pg.rank(), pg.size()  # type: ignore[union-attr]
        step, checked = _raycoll_step(op, count, dtype, rank, world, group)
        for _ in range(warmup):
            step()
        wrong = checked() if check else None
        raycoll.barrier(group=group)
        return timed_calls(step, iters, pattern, lambda: raycoll.barrier(group=group)), wrong


BenchRankRemote: Any = ray.remote(BenchRank)
