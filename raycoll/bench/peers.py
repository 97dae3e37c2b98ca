"""The peers that ``raycoll-bench --vs`` compares raycoll against, run inside Ray actors.

A *peer* runs the same collective, at the same size, with another library, so that the
benchmark can print raycoll's time over the peer's time:

- :class:`GlooPeer`: ``torch.distributed`` with the gloo backend, one rank per Ray actor,
  rendezvous over a TCP store on a free port picked on rank 0's node.
- :class:`RayCollectivePeer`: ``ray.util.collective`` with its ``"gloo"`` backend. In Ray 2.60
  that backend is ``TorchGLOOGroup``, a thin wrapper around ``torch.distributed`` gloo (pygloo is
  gone); it offers fewer operations, and its ``reducescatter`` is ``world_size`` all_reduces.

Sizes follow nccl-tests: for ``all_reduce``, ``broadcast``, ``reduce`` and ``send_recv`` (a round trip
between rank 0 and the last rank), ``nbytes`` is each rank's buffer; for the gathering, scattering and all-to-all operations it is
the large buffer (the gathered output, the reduce-scatter input, the all-to-all send buffer)
and each rank's share is ``nbytes / world_size``. :func:`effective_nbytes` gives the size run
after rounding down to whole elements (at least one element per rank).

Timing: every rank runs ``warmup`` untimed iterations, one barrier of the peer library, then
``iters`` back-to-back iterations, each timed alone with ``time.perf_counter`` around the
blocking call and nothing else in between. :meth:`Peer.run` returns, for each iteration, the
maximum over ranks. Torch is imported only inside the actors and the functions that need it.
"""

from __future__ import annotations

import abc
import os
import socket
import time
import uuid
from datetime import timedelta
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayTaskError

__all__ = [
    "OPS",
    "NotSupportedByPeer",
    "Peer",
    "GlooPeer",
    "RayCollectivePeer",
    "canonical_op",
    "effective_nbytes",
    "CHUNKED_OPS",
    "DEFAULT_TIMEOUT",
]

OPS: Tuple[str, ...] = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "gather", "scatter", "barrier", "send_recv",
)  # fmt: skip
_ALIASES: Dict[str, str] = {
    "allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all", "sendrecv": "send_recv", "send/recv": "send_recv",
}  # fmt: skip
#: Operations whose ``nbytes`` is the large buffer, cut in ``world_size`` equal chunks.
CHUNKED_OPS: FrozenSet[str] = frozenset(OPS) - {
    "all_reduce", "broadcast", "reduce", "barrier", "send_recv",
}  # fmt: skip
DEFAULT_TIMEOUT = timedelta(seconds=300)
#: A peer's rank placement: one ``.options()`` dict for all ranks, or one per rank.
ActorOptions = Union[None, Dict[str, Any], Sequence[Optional[Dict[str, Any]]]]


class NotSupportedByPeer(Exception):
    """The peer library cannot run this operation (or dtype); the benchmark prints no ratio."""

    def __init__(self, peer: str, op: str, reason: str) -> None:
        self.peer = peer
        self.op = op
        self.reason = reason
        super().__init__(f"peer {peer!r} does not support {op!r}: {reason}")

    def __reduce__(self) -> Tuple[Any, Tuple[str, str, str]]:  # crosses Ray task boundaries
        return (type(self), (self.peer, self.op, self.reason))


# How gloo refuses what it cannot run (the refusal is local, so every rank raises it).
_REFUSALS = ("does not support", "not supported", "Invalid scalar type", "Cannot use")


def canonical_op(op: str) -> str:
    """Return the name in :data:`OPS` for ``op`` (ray.util.collective spellings accepted)."""
    name = _ALIASES.get(op.lower(), op.lower())
    if name not in OPS:
        raise ValueError(f"op: expected one of {', '.join(OPS)}; got {op!r}")
    return name


def _itemsize(dtype: str) -> int:
    if dtype == "bfloat16":
        return 2
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError as exc:
        raise ValueError(f"dtype: expected a dtype name like 'float32'; got {dtype!r}") from exc


def _count(op: str, nbytes: int, dtype: str, world_size: int) -> int:
    """Elements per buffer (non-chunked ops) or per rank's chunk (chunked ops), at least 1."""
    if nbytes < 0:
        raise ValueError(f"nbytes: expected a size >= 0; got {nbytes}")
    elements = nbytes // _itemsize(dtype)
    if op in CHUNKED_OPS:
        elements //= world_size
    return max(1, elements)


def effective_nbytes(op: str, nbytes: int, dtype: str, world_size: int) -> int:
    """The ``nbytes`` actually run for a requested size, in nccl-tests terms (0 for barrier)."""
    op = canonical_op(op)
    if op == "barrier":
        return 0
    chunks = world_size if op in CHUNKED_OPS else 1
    return _count(op, nbytes, dtype, world_size) * chunks * _itemsize(dtype)


def _torch_dtype(dtype: str) -> Any:
    import torch

    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype: expected a torch dtype name like 'float32'; got {dtype!r}")
    return value


def _gloo_step(op: str, count: int, dtype: str, rank: int, world: int) -> Callable[[], Any]:
    """Build one iteration of ``op`` with torch.distributed on the default (gloo) group."""
    import torch
    import torch.distributed as dist

    dt = _torch_dtype(dtype)

    def buf(n: int = count) -> Any:
        return torch.zeros(n, dtype=dt)

    def chunks() -> List[Any]:
        return [buf() for _ in range(world)]

    # torch >= 2.13 names the flat-tensor variants *_single and deprecates the old names.
    gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    x, big = buf(), buf(count * world)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x)
    if op == "broadcast":
        return lambda: dist.broadcast(x, src=0)
    if op == "reduce":
        return lambda: dist.reduce(x, dst=0)
    if op == "all_gather":
        out = chunks()
        return lambda: dist.all_gather(out, x)
    if op == "all_gather_into_tensor":
        return lambda: gather_flat(big, x)
    if op == "reduce_scatter":  # gloo has list reduce_scatter since torch 2.x; 2.13 runs it
        ins = chunks()
        return lambda: dist.reduce_scatter(x, ins)
    if op == "reduce_scatter_tensor":
        return lambda: rs_flat(x, big)
    if op == "all_to_all":
        ins, outs = chunks(), chunks()
        return lambda: dist.all_to_all(outs, ins)
    if op == "all_to_all_single":
        out_big = buf(count * world)
        return lambda: dist.all_to_all_single(out_big, big)
    if op == "gather":
        gathered = chunks() if rank == 0 else None
        return lambda: dist.gather(x, gathered, dst=0)
    if op == "scatter":
        pieces = chunks() if rank == 0 else None
        return lambda: dist.scatter(x, pieces, src=0)
    if op == "barrier":
        return lambda: dist.barrier()
    recv = buf()  # send_recv: a round trip between rank 0 and the last rank

    def send_recv() -> None:
        if rank == 0:
            dist.send(x, world - 1)
            dist.recv(recv, world - 1)
        elif rank == world - 1:
            dist.recv(recv, 0)
            dist.send(x, 0)

    return send_recv


def _ray_collective_step(
    op: str, count: int, dtype: str, rank: int, world: int, group: str
) -> Callable[[], Any]:
    """Build one iteration of ``op`` with ray.util.collective on ``group``."""
    import torch
    import ray.util.collective as col

    dt = _torch_dtype(dtype)

    def chunks() -> List[Any]:
        return [torch.zeros(count, dtype=dt) for _ in range(world)]

    x = torch.zeros(count, dtype=dt)
    if op == "all_reduce":
        return lambda: col.allreduce(x, group)
    if op == "broadcast":
        return lambda: col.broadcast(x, 0, group)
    if op == "reduce":
        return lambda: col.reduce(x, 0, group)
    if op == "all_gather":
        out = chunks()
        return lambda: col.allgather(out, x, group)
    if op == "reduce_scatter":
        ins = chunks()
        return lambda: col.reducescatter(x, ins, group)
    if op == "barrier":
        return lambda: col.barrier(group)
    recv = torch.zeros(count, dtype=dt)  # send_recv: a round trip, rank 0 <-> the last rank

    def send_recv() -> None:
        if rank == 0:
            col.send(x, world - 1, group)
            col.recv(recv, world - 1, group)
        elif rank == world - 1:
            col.recv(recv, 0, group)
            col.send(x, 0, group)

    return send_recv


#: The benchmark's patterns of calls (``--pattern``), and the pause of ``after-pause``.
PATTERNS = ("back-to-back", "after-barrier", "after-pause")
PAUSE_S = 1e-3


def timed_calls(step: Callable[[], Any], iters: int, pattern: str = "back-to-back",
                barrier: Optional[Callable[[], Any]] = None) -> List[float]:
    """Seconds each of ``iters`` calls of ``step`` took, each timed alone (``perf_counter``);
    ``pattern`` (:data:`PATTERNS`): each call right after the last, after an untimed
    ``barrier`` of the same library, or after an untimed pause of ``PAUSE_S``."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern: expected one of {', '.join(PATTERNS)}; got {pattern!r}")
    if pattern == "after-barrier" and barrier is None:
        raise ValueError("pattern 'after-barrier' needs the library's barrier")
    times = []
    for _ in range(iters):
        if pattern == "after-barrier":
            barrier()  # type: ignore[misc]
        elif pattern == "after-pause":
            time.sleep(PAUSE_S)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def process_usage() -> Tuple[int, int]:
    """This process's resident memory (bytes) and open file descriptors (Linux /proc)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        fds = len(os.listdir("/proc/self/fd"))
    except (OSError, ValueError, IndexError):
        return 0, 0
    return rss, fds


class _RankActor:
    """One rank of a peer group; ``kind`` is the peer's name, ``"gloo"`` or ``"ray-collective"``."""

    def __init__(self, kind: str, rank: int, world_size: int) -> None:
        self.kind, self.rank, self.world_size = kind, rank, world_size
        self.group = ""

    def placement(self) -> Tuple[str, str]:
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address()

    def usage(self) -> Tuple[int, int]:
        return process_usage()

    def free_port(self, host: str) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return int(sock.getsockname()[1])

    def init(self, rendezvous: Dict[str, Any]) -> None:
        # The interface: the driver's choice, else this rank's own RAYCOLL_SOCKET_IFNAME
        # (set per node, e.g. by raycoll.testing_netns: each node's own veth).
        ifname = rendezvous.get("ifname") or os.environ.get("RAYCOLL_SOCKET_IFNAME")
        if ifname:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
        timeout = timedelta(seconds=rendezvous["timeout_s"])
        if self.kind == "gloo":
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{rendezvous['host']}:{rendezvous['port']}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timeout,
            )
        else:
            import ray.util.collective as col

            self.group = rendezvous["group"]
            col.init_collective_group(
                self.world_size, self.rank, backend="gloo",  # type: ignore[arg-type]
                group_name=self.group,
                gloo_timeout=int(timeout.total_seconds() * 1000),
            )  # fmt: skip

    def bench(self, op: str, count: int, dtype: str, iters: int, warmup: int,
              pattern: str = "back-to-back") -> List[float]:
        if self.kind == "gloo":
            import torch.distributed as dist

            step = _gloo_step(op, count, dtype, self.rank, self.world_size)
            sync: Callable[[], Any] = dist.barrier
        else:
            import ray.util.collective as col

            step = _ray_collective_step(op, count, dtype, self.rank, self.world_size, self.group)
            sync = lambda: col.barrier(self.group)  # noqa: E731
        try:
            step()  # one untimed call up front, so that a refusal surfaces as NotSupportedByPeer
        except RuntimeError as exc:
            if any(text in str(exc) for text in _REFUSALS):
                raise NotSupportedByPeer(self.kind, op, f"{dtype}: {exc}") from exc
            raise
        for _ in range(warmup):
            step()
        sync()
        return timed_calls(step, iters, pattern, sync)


_RankRemote: Any = ray.remote(num_cpus=0)(_RankActor)


def _loopback_ifname() -> Optional[str]:
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else None


class Peer(abc.ABC):
    """A library that runs collectives across ``world_size`` Ray actors, for comparison."""

    name: str = "peer"
    supported_ops: FrozenSet[str] = frozenset()

    @abc.abstractmethod
    def setup(self, world_size: int, actor_options: ActorOptions = None) -> None:
        """Start ``world_size`` rank actors (``num_cpus=0`` unless overridden), form the group.
        ``actor_options``: one dict for every rank, or a list of one dict per rank (to place
        each rank on a node of its own choosing)."""

    @abc.abstractmethod
    def run(self, op: str, nbytes: int, dtype: str, iters: int, warmup: int,
            pattern: str = "back-to-back") -> List[float]:
        """Seconds per timed iteration of ``op`` (max over ranks), the calls following each
        other as ``pattern`` says (:func:`timed_calls`); raises NotSupportedByPeer."""

    @abc.abstractmethod
    def close(self) -> None:
        """Kill the rank actors; safe to call twice."""

    def usage(self) -> Tuple[int, int]:
        """The largest resident memory (bytes) and open descriptors of a rank now, where
        the peer can tell (``(0, 0)`` otherwise)."""
        return 0, 0

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _ActorPeer(Peer):
    """Shared driver side of the peers: one ``_RankActor`` per rank, timed by ``bench``."""

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout
        self.world_size = 0
        self._actors: List[Any] = []

    def setup(self, world_size: int, actor_options: ActorOptions = None) -> None:
        if self._actors:
            raise RuntimeError(f"{self.name}: setup() called twice; call close() first")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: expected an int >= 1; got {world_size!r}")
        if actor_options is None or isinstance(actor_options, dict):
            per_rank = [{"num_cpus": 0, **(actor_options or {})}] * world_size
        else:
            if len(actor_options) != world_size:
                raise ValueError(f"actor_options: expected one dict per rank ({world_size}); "
                                 f"got {len(actor_options)}")
            per_rank = [{"num_cpus": 0, **(o or {})} for o in actor_options]
        self.world_size = world_size
        self._actors = [
            _RankRemote.options(**per_rank[rank]).remote(self.name, rank, world_size)
            for rank in range(world_size)
        ]
        try:
            places = self._get([a.placement.remote() for a in self._actors])
            one_node = len({node for node, _ in places}) == 1
            # RAYCOLL_SOCKET_IFNAME (raycoll's GLOO_SOCKET_IFNAME) names the interface for the
            # peer too, so that both run over the same network (loopback in tests).
            ifname = os.environ.get("RAYCOLL_SOCKET_IFNAME") or (
                _loopback_ifname() if one_node else None)
            host = "127.0.0.1" if one_node or ifname == "lo" else places[0][1]
            rendezvous: Dict[str, Any] = {"timeout_s": self.timeout.total_seconds(),
                                          "ifname": ifname}
            rendezvous.update(self._rendezvous(host))
            self._get([a.init.remote(rendezvous) for a in self._actors])
        except BaseException:
            self.close()
            raise

    @abc.abstractmethod
    def _rendezvous(self, host: str) -> Dict[str, Any]:
        """What each rank needs to join the peer's own group (address, port, group name)."""

    def run(self, op: str, nbytes: int, dtype: str = "float32", iters: int = 20,
            warmup: int = 5, pattern: str = "back-to-back") -> List[float]:  # fmt: skip
        op = canonical_op(op)
        if op not in self.supported_ops:
            supported = ", ".join(sorted(self.supported_ops))
            raise NotSupportedByPeer(self.name, op, f"it offers only {supported}")
        if not self._actors:
            raise RuntimeError(f"{self.name}: run() before setup()")
        if op == "send_recv" and self.world_size < 2:
            raise ValueError(f"world_size: send_recv needs >= 2 ranks; got {self.world_size}")
        if iters < 1 or warmup < 0:
            raise ValueError(f"iters/warmup: expected >= 1 / >= 0; got {iters} / {warmup}")
        count = _count(op, nbytes, dtype, self.world_size)
        try:
            per_rank = self._get(
                [a.bench.remote(op, count, dtype, iters, warmup, pattern)
                 for a in self._actors]
            )
        except RayTaskError as exc:
            if isinstance(exc.cause, NotSupportedByPeer):
                raise exc.cause from None
            raise
        except GetTimeoutError as exc:
            self.close()  # the ranks are stuck inside the peer library: the group is gone
            raise TimeoutError(
                f"{self.name}: {op} of {nbytes} B {dtype} x {warmup + iters + 1} iterations on "
                f"{self.world_size} ranks did not finish within {self.timeout}; peer closed"
            ) from exc
        return [max(times) for times in zip(*per_rank)]

    def usage(self) -> Tuple[int, int]:
        """The largest resident memory (bytes) and open descriptors of a rank now."""
        got = self._get([a.usage.remote() for a in self._actors])
        return max(r for r, _ in got), max(f for _, f in got)

    def close(self) -> None:
        actors, self._actors = self._actors, []
        if not ray.is_initialized():  # Ray already shut down: the actors went with it
            return
        for actor in actors:
            ray.kill(actor, no_restart=True)

    def _get(self, refs: List[Any]) -> List[Any]:
        return list(ray.get(refs, timeout=self.timeout.total_seconds()))


class GlooPeer(_ActorPeer):
    """``torch.distributed`` gloo (CPU), one process group per peer, every op of :data:`OPS`."""

    name = "gloo"
    supported_ops = frozenset(OPS)

    def _rendezvous(self, host: str) -> Dict[str, Any]:
        port = self._get([self._actors[0].free_port.remote(host)])[0]
        return {"host": host, "port": port}


class RayCollectivePeer(_ActorPeer):
    """``ray.util.collective`` with backend ``"gloo"`` (Ray 2.60: torch.distributed gloo inside).

    Offers all_reduce, broadcast, reduce, all_gather, reduce_scatter (``world_size``
    all_reduces), barrier and send/recv; the rest raise :class:`NotSupportedByPeer`.
    """

    name = "ray-collective"
    supported_ops = frozenset(
        {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "barrier",
         "send_recv"}
    )  # fmt: skip

    def _rendezvous(self, host: str) -> Dict[str, Any]:
        # A fresh name: the group's internal_kv rendezvous key is not namespaced per job.
        return {"group": f"raycoll-peer-{uuid.uuid4().hex[:12]}"}
