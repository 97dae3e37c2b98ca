"""raycoll as a Ray Compiled Graph communicator: :class:`RaycollCommunicator`.

Ray's Compiled Graphs (``dag.experimental_compile()``) move tensors between actors through a
*communicator*, an implementation of ``ray.experimental.channel.communicator.Communicator``
(a DeveloperAPI, alpha). A communicator passed as ``transport=`` to the collective nodes
``ray.experimental.collective.allreduce/allgather/reducescatter.bind(...)`` or to
``with_tensor_transport(transport=...)`` is pickled to every actor of the graph at compile
time, and Ray calls its ``initialize(rank)`` there (through ``__ray_call__``); from then on
the graph's execution loop calls its ``allreduce`` / ``allgather`` / ``reducescatter`` /
``send`` / ``recv`` inside the actors.

:class:`RaycollCommunicator` maps those calls onto one raycoll group formed over the actors:
its coordinator is started when the communicator is made (in the driver, which owns it),
each actor joins in ``initialize(rank)`` (a named group, never the actor's default group),
and every call runs raycoll's collective (on one node: the node segment; across nodes:
direct sockets). Ray's only CPU communicator,
``CPUCommunicator``, instead sends every collective's tensors to an async barrier actor.

What Ray 2.60 does with a communicator depends on its transport name:

- ``device="cpu"`` (``get_transport_name() == "cpu"``): the collective nodes run over raycoll.
  A p2p edge annotated ``with_tensor_transport(transport=comm)`` is accepted, but Ray moves
  CPU tensors of such an edge through its own shared-memory channel and never calls the
  communicator's ``send``/``recv`` (the accelerator channel refuses a CPU device), as it does
  for ``CPUCommunicator``.
- ``device="cuda"`` (``"accelerator"``): p2p edges and collectives both run over raycoll's
  ``nccl`` backend (needs cupy and a GPU on every actor; not yet run on a GPU).

The API is alpha in Ray: this module is pinned to the Ray versions it was tested with
(:data:`TESTED_RAY_VERSIONS`) and raises :class:`~raycoll.errors.BackendUnavailableError`
on a Ray without it.
"""

from __future__ import annotations

import logging
import os
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import ray
from ray.actor import ActorHandle

from raycoll import errors
from raycoll.collectives import all_gather_into_tensor, all_reduce, reduce_scatter_tensor
from raycoll.p2p import recv, send
from raycoll.reduce_op import ReduceOp

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("raycoll")

__all__ = ["RaycollCommunicator", "TESTED_RAY_VERSIONS", "ALLOW_UNTESTED_ENV"]

#: The Ray versions whose Compiled Graph communicator API this module was tested with.
TESTED_RAY_VERSIONS: Tuple[str, ...] = ("2.60",)

#: Set to ``1`` to use this module on a Ray outside :data:`TESTED_RAY_VERSIONS` that still
#: has the API (at your own risk: it is alpha and changes between releases).
ALLOW_UNTESTED_ENV = "RAYCOLL_ALLOW_UNTESTED_RAY"


def _ray_api() -> Tuple[Any, Any]:
    """Ray's ``CPUCommunicator`` and ``ReduceOp``, or BackendUnavailableError naming why not."""
    version = ray.__version__
    tested = any(version == v or version.startswith(v + ".") for v in TESTED_RAY_VERSIONS)
    if not tested and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise errors.BackendUnavailableError(
            f"raycoll.compiled implements Ray's Compiled Graph Communicator, an alpha API, and "
            f"was tested with Ray {', '.join(TESTED_RAY_VERSIONS)}; this is Ray {version}. "
            f"Install ray=={TESTED_RAY_VERSIONS[-1]}.* (or set {ALLOW_UNTESTED_ENV}=1 to try "
            "this Ray anyway)")
    try:
        from ray.experimental.channel.cpu_communicator import CPUCommunicator
        from ray.experimental.util.types import ReduceOp
    except ImportError as exc:
        raise errors.BackendUnavailableError(
            f"raycoll.compiled needs Ray's Compiled Graph Communicator API "
            f"(ray.experimental.channel.cpu_communicator), which Ray {version} lacks; tested "
            f"with Ray {', '.join(TESTED_RAY_VERSIONS)}") from exc
    return CPUCommunicator, ReduceOp


_CPUCommunicator, _RayReduceOp = _ray_api()

#: What part of Ray's Compiled Graph get timeout (``RAY_CGRAPH_get_timeout``, 10 s by
#: default) a call waits for the other ranks by default. Ray cannot cancel a collective that
#: a rank never joins (a rank whose upstream task raised skips it): the others must give up
#: on their own, before the driver's ``ray.get`` does, so that the step's error is raycoll's
#: naming the missing ranks and ``teardown()`` finds the actors free.
DEFAULT_TIMEOUT_FRACTION = 0.8

_DEVICES = ("cpu", "cuda")

#: From this many bytes an out-of-place CPU allreduce (Ray's collective node hands a new
#: output tensor) runs as a reduce-scatter into the rank's chunk of the output and an
#: all-gather in place, rather than a copy of the input into the output and an all_reduce
#: in place: the same bytes cross between the ranks, without the copy (two calls instead of
#: one: slower below a few MiB; benchmarks/BENCHMARKS.md, "Compiled Graphs").
SPLIT_BYTES = 4 << 20


def _seconds(timeout: Union[None, float, int, timedelta]) -> float:
    if timeout is None:
        from ray.dag.context import DAGContext

        return max(1.0, DEFAULT_TIMEOUT_FRACTION * float(DAGContext.get_current().get_timeout))
    if isinstance(timeout, timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise TypeError(f"timeout must be seconds (a number) or a timedelta, got {timeout!r}")
    if value <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {value:g}")
    return value


class RaycollCommunicator(_CPUCommunicator):  # type: ignore[misc, valid-type]
    """A Ray Compiled Graph communicator over a raycoll group of ``actors`` (rank = position).

    Make it in the driver, before ``experimental_compile()``, and pass it as ``transport=`` to
    ``ray.experimental.collective.allreduce.bind(nodes, transport=comm)`` (and ``allgather``,
    ``reducescatter``) or to ``node.with_tensor_transport(transport=comm)``. One communicator
    serves any number of graphs over the same actors; call :meth:`destroy` from the driver
    once they are torn down to free the group (Ray 2.60 does not destroy a user's
    communicator at teardown).

    ``device``: ``"cpu"`` (torch CPU tensors) or ``"cuda"`` (CUDA tensors through raycoll's
    ``nccl`` backend; needs cupy and one GPU per actor). ``timeout``: how long a call waits
    for the other ranks before it raises :class:`~raycoll.errors.DistTimeoutError` (seconds
    or a ``timedelta``; default: 0.8 x Ray's Compiled Graph get timeout, 8 s with Ray's
    default ``RAY_CGRAPH_get_timeout=10``, so that a rank that never joins is named before
    the driver's ``ray.get`` gives up). ``options``: raycoll group options, as in
    :func:`raycoll.create_group`.

    It derives from Ray's ``CPUCommunicator`` because Ray 2.60 lets actors without an
    accelerator use a custom communicator only then; nothing of it is used.
    """

    def __init__(self, actors: Sequence[ActorHandle], device: str = "cpu",
                 timeout: Union[None, float, int, timedelta] = None,
                 options: Any = None) -> None:
        from raycoll.coordinator import coordinator_name, start_coordinator
        from raycoll.options import GroupOptions
        from raycoll.process_group import GroupSpec
        from raycoll.session import require

        if not isinstance(actors, (list, tuple)) or not actors:
            raise ValueError("actors must be a non-empty list of Ray actor handles")
        for i, actor in enumerate(actors):
            if not isinstance(actor, ActorHandle):
                raise TypeError(f"actors[{i}] must be a Ray actor handle, got "
                                f"{type(actor).__name__}")
        ids = [a._actor_id for a in actors]
        if len(set(ids)) != len(ids):
            raise ValueError("actors must be distinct: the same actor appears twice")
        if device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {device!r}")
        seconds = _seconds(timeout)
        group_options = GroupOptions.of(options)
        super().__init__(len(actors), list(actors))
        self._device = device
        self._name = f"compiled-{uuid.uuid4().hex[:12]}"
        now = require("RaycollCommunicator")
        backend = "nccl" if device == "cuda" else None
        handle = start_coordinator(self._name, len(actors), coordinator_name(now[1], self._name))
        self._spec: Optional[GroupSpec] = GroupSpec(self._name, len(actors), backend, seconds,
                                                    handle, group_options)
        self._actor_ids = ids
        self._rank: Optional[int] = None
        self._pg: Any = None  # the rank's ProcessGroup, inside an actor after initialize()
        self._torch: Any = None

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_pg"] = None  # a rank's group stays in its process
        state["_torch"] = None
        state["_rank"] = None
        state["barriers"] = set()
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (f"RaycollCommunicator(group={self._name!r}, world_size={self._world_size}, "
                f"device={self._device!r}, rank={self._rank})")

    # ------------------------------------------------------------------ setup (Ray calls these)
    @property
    def group_name(self) -> str:
        """The name of the raycoll group under the communicator (``group=`` of raycoll's own
        calls inside the actors, after the graph is compiled)."""
        return self._name

    def initialize(self, rank: int) -> None:
        """Join the raycoll group as ``rank`` (Ray calls it in each actor at compile time).
        A second graph compiled with the same communicator finds the group already there."""
        from raycoll.world import join_root_group, world

        import torch

        self._torch = torch
        self._rank = rank
        found = world().groups.get(self._name)
        if found is not None and found.rank() == rank:
            self._pg = found
            return
        if self._spec is None:
            raise errors.GroupDestroyedError(
                f"{self!r} was destroyed: make a new RaycollCommunicator for the next graph")
        if self._device == "cuda":
            from raycoll.backends._cuda import nccl_unavailable_reason

            why = nccl_unavailable_reason()
            if why is None and not torch.cuda.is_available():
                why = "this torch has no CUDA"
            if why is not None:
                raise errors.BackendUnavailableError(
                    f"{self!r}: rank {rank} cannot use device='cuda' (raycoll's nccl backend): "
                    f"{why}")
        self._pg = join_root_group(self._spec, rank, make_default=False)
        if self._device == "cuda":
            # NCCL's communicator forms at a group's first GPU call, which every rank must
            # make: make it now, while Ray initializes every rank at once, rather than at a
            # p2p edge that only two of the ranks take
            all_reduce(torch.zeros(1, device="cuda"), group=self._pg)

    def get_actor_handles(self) -> List[ActorHandle]:
        """The actors, in rank order. In the driver, after :meth:`destroy`:
        GroupDestroyedError (Ray asks for them when a graph that uses it is built)."""
        if self._rank is None and self._spec is None:
            raise errors.GroupDestroyedError(
                f"{self!r} was destroyed: make a new RaycollCommunicator for the next graph")
        return list(self._actor_handles)

    def get_rank(self, actor: ActorHandle) -> int:
        """``actor``'s rank; ValueError naming the group when it is not a member."""
        try:
            return self._actor_ids.index(actor._actor_id)
        except ValueError:
            raise ValueError(f"actor {actor} is not in {self!r}") from None

    def get_self_rank(self) -> Optional[int]:
        """This actor's rank (``None`` before ``initialize``, and in the driver)."""
        return self._rank

    def get_world_size(self) -> int:
        """The number of actors."""
        return int(self._world_size)

    def get_transport_name(self) -> str:
        """``"cpu"`` or ``"accelerator"`` (``device="cuda"``): what Ray's type hints read."""
        return "accelerator" if self._device == "cuda" else "cpu"

    @classmethod
    def generate_communicator_id(cls) -> str:
        """A unique id (Ray's own communicators use one to rendezvous; raycoll needs none)."""
        return str(uuid.uuid4())

    @property
    def recv_stream(self) -> Any:
        """The stream receives run on: torch's current CUDA stream; ``None`` on CPU."""
        return self._torch.cuda.current_stream() if self._device == "cuda" else None

    @property
    def send_stream(self) -> Any:
        """The stream sends run on: torch's current CUDA stream; ``None`` on CPU."""
        return self._torch.cuda.current_stream() if self._device == "cuda" else None

    # ------------------------------------------------------------------ data (the graph's loop)
    def _group(self, what: str) -> Any:
        if self._pg is None:
            raise errors.GroupNotFoundError(
                f"{what}: {self!r} is not initialized in this process (Ray calls initialize() "
                "in each actor when a graph that uses it is compiled)")
        return self._pg

    def send(self, value: "torch.Tensor", peer_rank: int) -> None:
        """Send ``value`` to ``peer_rank`` (returns once the peer has taken it)."""
        send(value, peer_rank, group=self._group("send"))

    def recv(self, shape: Tuple[int], dtype: "torch.dtype", peer_rank: int,
             allocator: Optional[Callable[[Tuple[int], "torch.dtype"], "torch.Tensor"]] = None,
             ) -> "torch.Tensor":
        """Receive a tensor of ``shape`` and ``dtype`` from ``peer_rank`` into a new buffer
        (from ``allocator`` when given)."""
        pg = self._group("recv")
        if allocator is not None:
            buf = allocator(shape, dtype)
        else:
            buf = self._torch.empty(shape, dtype=dtype, device=self._device)
        recv(buf, peer_rank, group=pg)
        if self._device == "cuda":  # Ray reads the buffer from any stream once this returns
            self._torch.cuda.current_stream().synchronize()
        return buf

    def allreduce(self, send_buf: "torch.Tensor", recv_buf: "torch.Tensor",
                  op: Any = None) -> None:
        """``recv_buf`` = ``op`` over every rank's ``send_buf`` (they may be the same tensor)."""
        pg = self._group("allreduce")
        rop = _reduce_op(op)
        if recv_buf.data_ptr() != send_buf.data_ptr():
            if self._split(send_buf, recv_buf):
                # large: reduce-scatter out of send_buf into this rank's chunk of recv_buf,
                # then all-gather the chunks in place: no copy of send_buf first
                flat = recv_buf.view(-1)
                chunk = flat.numel() // self._world_size
                me = int(pg.rank())
                mine = flat[me * chunk:(me + 1) * chunk]
                reduce_scatter_tensor(mine, send_buf.view(-1), rop, group=pg)
                all_gather_into_tensor(flat, mine, group=pg)
                return
            recv_buf.copy_(send_buf)
        if self._device == "cpu" and recv_buf.is_contiguous():
            # a numpy view takes raycoll's short path (the node segment, no argument layer)
            all_reduce(recv_buf.numpy(), rop, group=pg)
        else:
            all_reduce(recv_buf, rop, group=pg)

    def _split(self, send_buf: "torch.Tensor", recv_buf: "torch.Tensor") -> bool:
        """Whether an out-of-place allreduce runs as reduce-scatter + all-gather."""
        return (self._device == "cpu" and send_buf.numel() * send_buf.element_size() >= SPLIT_BYTES
                and send_buf.numel() % self._world_size == 0 and send_buf.is_contiguous()
                and recv_buf.is_contiguous() and recv_buf.shape == send_buf.shape
                and recv_buf.dtype == send_buf.dtype)

    def allgather(self, send_buf: "torch.Tensor", recv_buf: "torch.Tensor") -> None:
        """``recv_buf`` = every rank's ``send_buf``, concatenated in rank order."""
        all_gather_into_tensor(recv_buf, send_buf, group=self._group("allgather"))

    def reducescatter(self, send_buf: "torch.Tensor", recv_buf: "torch.Tensor",
                      op: Any = None) -> None:
        """Rank i's ``recv_buf`` = chunk i of ``op`` over every rank's ``send_buf``."""
        reduce_scatter_tensor(recv_buf, send_buf, _reduce_op(op),
                              group=self._group("reducescatter"))

    # ------------------------------------------------------------------ teardown
    def destroy(self) -> None:
        """In the driver: free the group (every actor leaves it, its coordinator stops); the
        communicator cannot serve another graph afterwards. Calling it twice does nothing.

        In an actor, where Ray 2.60 calls it when a graph's CUDA p2p channel closes at
        teardown: nothing, as the group may still serve the graph's other channels and later
        graphs (a call stuck on a peer ends at the communicator's timeout)."""
        from raycoll.launch import _kill

        if self._rank is not None:  # inside an actor
            return
        spec, self._spec = self._spec, None
        if spec is None:
            return
        refs = []
        for actor in self._actor_handles:
            try:
                refs.append(actor.__ray_call__.remote(_leave, self._name))
            except Exception:  # noqa: BLE001 - a dead actor's handle may refuse calls
                pass
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=_TEARDOWN_S)
        _kill(spec.coordinator)


_TEARDOWN_S = 10.0


def _leave(actor_self: Any, group_name: str) -> None:
    """Runs inside each actor: leave the communicator's group if this process joined it."""
    from raycoll.world import world

    world().remove(group_name, "RaycollCommunicator.destroy() was called from the driver")


def _reduce_op(op: Any) -> Any:
    """Ray's ``ReduceOp`` (``None``: SUM) as raycoll's; UnsupportedOpError otherwise."""
    try:
        return _OPS[op]
    except (KeyError, TypeError):
        raise errors.UnsupportedOpError(
            f"op must be one of Ray's ReduceOp {[o.name for o in _OPS if o is not None]}, "
            f"got {op!r}") from None


_OPS = {None: ReduceOp.SUM, **{getattr(_RayReduceOp, name): getattr(ReduceOp, name)
                               for name in ("SUM", "PRODUCT", "MAX", "MIN", "AVG")}}
