"""The functions of ``ray.util.collective`` (Ray 2.60) on raycoll's groups and data plane.

Each function keeps Ray's name, signature and defaults, and the behaviours code relies on:
results in place in the caller's arrays (numpy arrays, torch tensors, cupy arrays), blocking
calls, ``allgather`` into a list of tensors, ``get_rank`` / ``get_collective_group_size``
returning -1 for a group this process is not in, ``destroy_collective_group`` of an unknown
name doing nothing (with a warning). Groups are raycoll root groups of the same name, reached
by name (``_all_reduce(t, group="dp")`` meets ``col.allreduce(t, group_name="dp")``);
any number of them per process. Everything else is raycoll's: its named errors on every rank
of a call (a mismatch, a rank that died, a timeout naming the missing ranks). Results are
written into read-only numpy arrays as Ray writes them, with a one-time warning
(:mod:`.readonly`). Ranks passed here are group ranks (``dst_rank``, ``src_rank``), as in
Ray.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Set

import numpy as np

from raycoll import errors
from raycoll.availability import is_backend_available as _is_backend_available
from raycoll.backends import is_nccl_available as _is_nccl_available
from raycoll.collectives import (all_gather as _all_gather, all_reduce as _all_reduce,
                                 barrier as _barrier, broadcast as _broadcast,
                                 reduce as _reduce, reduce_scatter as _reduce_scatter)
from raycoll.groups import destroy_process_group as _destroy_process_group
from raycoll.groups import get_group as _get_group
from raycoll.launch import create_group as _create_group, destroy_group as _destroy_group
from raycoll.p2p import recv as _recv, send as _send
from raycoll.reduce_op import ReduceOp as _RcReduceOp
from raycoll.backends import backend_config
from raycoll.context import Call
from raycoll.groups import join_named_group
from raycoll.launch import DRIVER_GROUPS
from raycoll.process_group import ProcessGroup
from raycoll.reduce_op import as_reduce_op
from raycoll.session import current as _current_session
from raycoll.util.collective import types
from raycoll.util.collective.readonly import writable, writable_list
from raycoll.world import world

__all__ = [
    "nccl_available", "gloo_available", "is_backend_available", "is_group_initialized",
    "init_collective_group", "destroy_collective_group", "create_collective_group",
    "get_rank", "get_collective_group_size", "allreduce", "allreduce_multigpu", "barrier",
    "reduce", "reduce_multigpu", "broadcast", "broadcast_multigpu", "allgather",
    "allgather_multigpu", "reducescatter", "reducescatter_multigpu", "send", "send_multigpu",
    "recv", "recv_multigpu", "get_group_handle", "register_collective_backend", "synchronize",
    "BACKENDS",
]

logger = logging.getLogger("raycoll")

#: Ray's backend names (any case) and the raycoll backend each forms a group with. GPU
#: tensors of a ``"nccl"`` group go through NCCL; its CPU arrays (which Ray's NCCL group
#: refuses) through raycoll's CPU path. Any raycoll backend string is taken as it is.
BACKENDS: Dict[str, str] = {
    "gloo": "objstore",
    "torch_gloo": "objstore",
    "nccl": "cpu:objstore,cuda:nccl",
}


def _backend(backend: Any) -> str:
    """The raycoll backend string for a ``ray.util.collective`` backend name."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str such as 'gloo' or 'nccl', got {backend!r}")
    mapped = BACKENDS.get(backend.lower())
    if mapped is not None:
        return mapped
    try:
        backend_config(backend)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"backend={backend!r} is neither one of ray.util.collective's "
                         f"({sorted(BACKENDS)}) nor a raycoll backend string: {exc}") from exc
    return backend


def _timeout(gloo_timeout: Any) -> timedelta:
    if not isinstance(gloo_timeout, int) or isinstance(gloo_timeout, bool) or gloo_timeout <= 0:
        raise ValueError(f"gloo_timeout must be a positive int of milliseconds, got {gloo_timeout!r}")
    return timedelta(milliseconds=gloo_timeout)


def _name(group_name: Any) -> str:
    if not isinstance(group_name, str) or not group_name or "/" in group_name:
        raise ValueError(f"group_name must be a non-empty str without '/', got {group_name!r}")
    return group_name


def _group(group_name: str) -> Optional[ProcessGroup]:
    """This process's group ``group_name``, or None (groups of an ended Ray session are
    forgotten first)."""
    w = world()
    w.drop_ended()
    with w.lock:
        return w.groups.get(group_name)


# ---------------------------------------------------------------------- groups
def nccl_available() -> bool:
    """Whether GPU tensors can go through NCCL here (cupy with NCCL, and a GPU)."""
    return _is_nccl_available()


def gloo_available() -> bool:
    """True: the ``"gloo"`` backend is raycoll's own CPU path, always there."""
    return True


def is_backend_available(backend: str) -> bool:
    """Whether ``backend`` (``"gloo"``, ``"nccl"``, ``"torch_gloo"``, or a raycoll backend
    name) can be used in this process; False for an unknown name."""
    name = str(backend).lower()
    if name == "nccl":
        return nccl_available()
    if name in BACKENDS:
        return True
    return _is_backend_available(name)


def is_group_initialized(group_name: str) -> bool:
    """Whether this process is a rank of group ``group_name`` (formed, and not destroyed)."""
    col = sys.modules.get("ray.util.collective") if _FOREIGN_BACKENDS else None
    return _group(group_name) is not None or bool(col and col.is_group_initialized(group_name))


def init_collective_group(world_size: int, rank: int, backend: str = types.Backend.NCCL,
                          group_name: str = "default", gloo_timeout: int = 30000) -> None:
    """Join group ``group_name`` as ``rank`` of ``world_size`` (called by every rank, inside
    its actor or task; the driver may be a rank too). Blocks until all ranks have joined.

    ``backend``: ``"gloo"`` / ``"torch_gloo"`` (raycoll's CPU path; GPU tensors staged through
    host memory), ``"nccl"`` (GPU tensors through NCCL, CPU arrays through the CPU path), or a
    raycoll backend string. ``gloo_timeout`` (milliseconds) bounds the rendezvous and every
    collective of the group (raycoll raises ``DistTimeoutError`` naming the missing ranks).
    A process may hold any number of groups; a name it already holds raises ValueError."""
    name = _name(group_name)
    for value, label in ((world_size, "world_size"), (rank, "rank")):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{label} must be an int, got {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is out of range for world_size={world_size}")
    if _foreign(backend):
        from ray.util.collective import init_collective_group as ray_init

        ray_init(world_size, rank, backend, name, gloo_timeout)  # type: ignore[arg-type]
        return
    mapped = _backend(backend)
    seconds = _timeout(gloo_timeout).total_seconds()
    if _group(name) is not None:
        raise ValueError(f"group {name!r} is already initialized in this process (Ray: "
                         "'Trying to initialize a group a second time'); "
                         f"destroy_collective_group({name!r}) it first")
    join_named_group(name, world_size, rank, mapped, seconds)


def create_collective_group(actors: List[Any], world_size: int, ranks: List[int],
                            backend: str = types.Backend.NCCL, group_name: str = "default",
                            gloo_timeout: int = 30000) -> None:
    """Form group ``group_name`` among ``actors`` from the driver, ``actors[i]`` as rank
    ``ranks[i]``; the actors then call the collectives with ``group_name``.

    Unlike Ray, which records the group and lets each actor join at its first collective,
    the actors join now: this returns once they all have (``DistTimeoutError`` naming the
    ranks that did not join within ``gloo_timeout``), and ``get_rank`` answers inside them at
    once. ``backend`` and ``gloo_timeout`` as in :func:`init_collective_group`. Destroy it
    with :func:`destroy_collective_group` from the driver (from the actors too, each for
    itself)."""
    name = _name(group_name)
    if not isinstance(actors, (list, tuple)) or not isinstance(ranks, (list, tuple)):
        raise TypeError("actors and ranks must be lists")
    if len(ranks) != len(actors):
        raise ValueError(f"Each actor should correspond to one rank: got {len(ranks)} ranks "
                         f"but {len(actors)} actors")
    if sorted(ranks) != list(range(len(ranks))):
        raise ValueError(f"ranks must be a permutation of 0..{len(ranks) - 1}, got {list(ranks)}")
    if world_size != len(actors):
        raise ValueError(f"world_size={world_size} must equal the number of actors "
                         f"({len(actors)}): every rank of a group formed from the driver is "
                         "one of its actors")
    if _foreign(backend):
        from ray.util.collective import create_collective_group as ray_create

        ray_create(list(actors), world_size, list(ranks), backend, name,  # type: ignore[arg-type]
                   gloo_timeout)
        return
    mapped = _backend(backend)
    timeout = _timeout(gloo_timeout)
    ordered: List[Any] = [None] * len(actors)
    for actor, r in zip(actors, ranks):
        ordered[r] = actor
    _create_group(ordered, backend=mapped, group_name=name, timeout=timeout)


def destroy_collective_group(group_name: str = "default") -> None:
    """Destroy group ``group_name``: in a rank, this rank leaves it (its later calls on the
    group raise ``GroupDestroyedError``); in the driver that formed it with
    :func:`create_collective_group`, every actor leaves it and the name is free again. An
    unknown name logs a warning and does nothing, as in Ray."""
    col = _ray_module(group_name)
    if col is not None:
        col.destroy_collective_group(group_name)
    elif _group(group_name) is not None:
        _destroy_process_group(group_name)
    elif group_name in DRIVER_GROUPS.names(_current_session()):
        _destroy_group(group_name)
    else:
        logger.warning("raycoll.util.collective: the group %r does not exist.", group_name)


def get_rank(group_name: str = "default") -> int:
    """This process's rank in group ``group_name``; -1 if it is not a rank of it."""
    pg = _group(group_name)
    col = _ray_module(group_name) if pg is None else None
    return col.get_rank(group_name) if col is not None else -1 if pg is None else pg.rank()


def get_collective_group_size(group_name: str = "default") -> int:
    """The number of ranks of group ``group_name``; -1 if this process is not a rank of it."""
    pg = _group(group_name)
    col = _ray_module(group_name) if pg is None else None
    if col is not None:
        return int(col.get_collective_group_size(group_name))
    return -1 if pg is None else pg.size()


def get_group_handle(group_name: str = "default") -> ProcessGroup:
    """The group's :class:`raycoll.ProcessGroup` (``rank()``, ``size()``, torch's object API);
    ``GroupNotFoundError`` (a RuntimeError) if this process is not a rank of it."""
    return _get_group(group_name)


def register_collective_backend(name: str, group_cls: Any) -> None:
    """Register a ``ray.util.collective`` backend class (a subclass of Ray's ``BaseGroup``)
    under ``name``, in Ray's own registry, as Ray's function of this name does; then this
    module forms groups with ``backend=name`` through Ray's module with that class, and its
    collectives on such a group are Ray's. Ray's rule holds: register it in the driver and
    in every actor that joins such a group; registering the same class again does nothing.
    (raycoll's own class is registered as ``"raycoll"`` by :func:`raycoll.util.collective.
    register`; groups of that backend are formed through Ray's module.)"""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if name.lower() in BACKENDS:
        raise ValueError(f"register_collective_backend: {name!r} is one of this module's own "
                         f"backends ({sorted(BACKENDS)}); pick another name")
    from ray.util.collective.backend_registry import _global_registry
    from ray.util.collective.backend_registry import register_collective_backend as ray_register

    if not (_global_registry.is_registered(name) and _global_registry.get(name) is group_cls):
        ray_register(name, group_cls)  # Ray's checks: a BaseGroup, a name not taken
    _FOREIGN_BACKENDS.add(name.upper())


#: Backends registered here with :func:`register_collective_backend` (upper case): groups of
#: these are Ray's, formed and called through Ray's own module.
_FOREIGN_BACKENDS: Set[str] = set()


def _foreign(backend: Any) -> bool:
    return bool(_FOREIGN_BACKENDS) and isinstance(backend, str) and \
        backend.upper() in _FOREIGN_BACKENDS


def _ray_module(group_name: Any) -> Any:
    """Ray's ``ray.util.collective`` when ``group_name`` is a group of a backend registered
    with :func:`register_collective_backend` (formed here, or recorded by Ray's
    ``create_collective_group`` and formed now, as Ray forms it at the first call); else
    None. One falsy test when no such backend was registered."""
    if not _FOREIGN_BACKENDS or not isinstance(group_name, str) or _group(group_name):
        return None
    col = sys.modules.get("ray.util.collective")
    if col is None:
        return None
    if not col.is_group_initialized(group_name):
        try:
            col.get_group_handle(group_name)
        except RuntimeError:
            return None
    return col


def _ray_op(op: Any) -> Any:
    """Ray's own ReduceOp for one of this module's (by member name)."""
    from ray.util.collective.types import ReduceOp as RayReduceOp

    return RayReduceOp[op.name] if hasattr(op, "name") and op.name in RayReduceOp.__members__ \
        else op


def synchronize(gpu_id: int) -> None:
    """Wait for the work queued on GPU ``gpu_id`` (cupy), as Ray's ``synchronize``."""
    try:
        import cupy
    except ImportError as exc:
        raise errors.BackendUnavailableError("synchronize needs cupy and a CUDA GPU") from exc
    cupy.cuda.Device(gpu_id).synchronize()


# ---------------------------------------------------------------------- collectives
_OPS: Dict[Any, _RcReduceOp] = {
    member: getattr(_RcReduceOp, member.name) for member in types.ReduceOp}
_OPS.update({op: op for op in (_RcReduceOp.SUM, _RcReduceOp.PRODUCT,
                                _RcReduceOp.MIN, _RcReduceOp.MAX, _RcReduceOp.AVG,
                                _RcReduceOp.BAND, _RcReduceOp.BOR,
                                _RcReduceOp.BXOR)})


def _op(op: Any) -> _RcReduceOp:
    """raycoll's ReduceOp for this module's (a lookup: the hot path), raycoll's own, Ray's
    enum or any other spelling ``_all_reduce`` takes (by member name)."""
    try:
        return _OPS[op]
    except (KeyError, TypeError):  # TypeError: an unhashable op, refused below
        return as_reduce_op(op)


def _read_only(tensor: Any) -> bool:
    return isinstance(tensor, np.ndarray) and not tensor.flags.writeable


def _rank_is(group_name: str, rank: Any) -> bool:
    """Whether this process is rank ``rank`` of group ``group_name`` (False outside it)."""
    pg = _group(group_name) if isinstance(group_name, str) else None
    return pg is not None and pg.rank() == rank


def allreduce(tensor: Any, group_name: str = "default", op: Any = types.ReduceOp.SUM) -> None:
    """Reduce ``tensor`` over the group, in place on every rank."""
    col = _ray_module(group_name)
    if col is not None:
        return col.allreduce(tensor, group_name, _ray_op(op))
    _all_reduce(writable(tensor, "allreduce", "tensor"), _op(op), group=group_name)


def barrier(group_name: str = "default") -> None:
    """Block until every rank of the group has called it."""
    col = _ray_module(group_name)
    if col is not None:
        return col.barrier(group_name)
    _barrier(group=group_name)


def reduce(tensor: Any, dst_rank: int = 0, group_name: str = "default",
           op: Any = types.ReduceOp.SUM) -> None:
    """Reduce ``tensor`` over the group into ``dst_rank``'s tensor (in place there; the other
    ranks' tensors are left as they were)."""
    col = _ray_module(group_name)
    if col is not None:
        return col.reduce(tensor, dst_rank, group_name, _ray_op(op))
    if _read_only(tensor):  # the root writes into it, as Ray does; the others send a copy
        tensor = writable(tensor, "reduce", "tensor") if _rank_is(group_name, dst_rank) \
            else tensor.copy()  # (Ray's gloo group reduces a clone there: nothing written)
    _reduce(tensor, op=_op(op), group=group_name, group_dst=dst_rank)


def broadcast(tensor: Any, src_rank: int = 0, group_name: str = "default") -> None:
    """Copy ``src_rank``'s tensor into every rank's ``tensor``."""
    col = _ray_module(group_name)
    if col is not None:
        return col.broadcast(tensor, src_rank, group_name)
    if _read_only(tensor) and not _rank_is(group_name, src_rank):
        tensor = writable(tensor, "broadcast", "tensor")
    _broadcast(tensor, group=group_name, group_src=src_rank)


def allgather(tensor_list: list, tensor: Any, group_name: str = "default") -> None:
    """Gather every rank's ``tensor`` into ``tensor_list`` (one tensor per rank, in place)."""
    col = _ray_module(group_name)
    if col is not None:
        return col.allgather(tensor_list, tensor, group_name)
    _all_gather(writable_list(tensor_list, "allgather", "tensor_list"), tensor,
                       group=group_name)


def reducescatter(tensor: Any, tensor_list: list, group_name: str = "default",
                  op: Any = types.ReduceOp.SUM) -> None:
    """Reduce ``tensor_list[i]`` over the ranks into rank i's ``tensor`` (``tensor_list`` is
    left as it was)."""
    col = _ray_module(group_name)
    if col is not None:
        return col.reducescatter(tensor, tensor_list, group_name, _ray_op(op))
    _reduce_scatter(writable(tensor, "reducescatter", "tensor"), tensor_list, _op(op),
                           group=group_name)


def send(tensor: Any, dst_rank: int, group_name: str = "default") -> None:
    """Send ``tensor`` to ``dst_rank``; returns once the receiver has taken it."""
    col = _ray_module(group_name)
    if col is not None:
        return col.send(tensor, dst_rank, group_name)
    _send(tensor, group=group_name, group_dst=dst_rank)


def recv(tensor: Any, src_rank: int, group_name: str = "default") -> None:
    """Receive into ``tensor`` from ``src_rank``."""
    col = _ray_module(group_name)
    if col is not None:
        return col.recv(tensor, src_rank, group_name)
    _recv(writable(tensor, "recv", "tensor"), group=group_name, group_src=src_rank)


# ---------------------------------------------------------------------- the *_multigpu names
def _one(values: Any, name: str, fn: str, single: str) -> Any:
    """The one tensor of a per-GPU list: raycoll runs one GPU per rank."""
    if not isinstance(values, (list, tuple)) or len(values) != 1:
        count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise NotImplementedError(
            f"{fn}: raycoll runs one GPU per rank (an actor per GPU, num_gpus=1), so {name} "
            f"must hold exactly one tensor (got {count}); start one actor per GPU and call "
            f"col.{single}(...) in each")
    return values[0]


def _index(value: Any, name: str, fn: str) -> None:
    if value != 0:
        raise NotImplementedError(f"{fn}: {name}={value!r}: raycoll runs one GPU per rank, "
                                  f"whose index is 0; start one actor per GPU")


def _first(tensor: Any, n_elements: int, fn: str) -> Any:
    """``tensor``'s first ``n_elements`` elements, as a view (0: the whole tensor)."""
    if not isinstance(n_elements, int) or n_elements < 0:
        raise ValueError(f"{fn}: n_elements must be an int >= 0, got {n_elements!r}")
    if n_elements == 0:
        return tensor
    contiguous = getattr(tensor, "is_contiguous", None)
    flags = getattr(tensor, "flags", None)
    if not (contiguous() if callable(contiguous) else getattr(flags, "c_contiguous", False)):
        raise ValueError(f"{fn}: n_elements={n_elements} needs a contiguous tensor")
    flat = tensor.reshape(-1)
    if n_elements > flat.shape[0]:
        raise ValueError(f"{fn}: n_elements={n_elements} exceeds the tensor's {flat.shape[0]} "
                         "elements")
    return flat[:n_elements]


@contextlib.contextmanager
def _refused(group_name: str, op: str) -> Iterator[None]:
    """Arguments this module refuses before calling the collective ``op``: the peers, which
    called ``op``, are told (they raise ``PeerArgumentError``) instead of waiting for it."""
    try:
        yield
    except (ValueError, TypeError, NotImplementedError) as exc:
        pg = _group(group_name) if isinstance(group_name, str) else None
        if pg is not None:
            pg.reject(Call(op, pg.take_seq(), pg.timeout_s, {"op": op}), exc)
        raise


def allreduce_multigpu(tensor_list: list, group_name: str = "default",
                       op: Any = types.ReduceOp.SUM) -> None:
    """:func:`allreduce` of the one tensor in ``tensor_list`` (one GPU per rank)."""
    with _refused(group_name, "all_reduce"):
        tensor = _one(tensor_list, "tensor_list", "allreduce_multigpu", "allreduce")
    allreduce(tensor, group_name, op)


def reduce_multigpu(tensor_list: list, dst_rank: int = 0, dst_tensor: int = 0,
                    group_name: str = "default", op: Any = types.ReduceOp.SUM) -> None:
    """:func:`reduce` of the one tensor in ``tensor_list`` (``dst_tensor`` must be 0)."""
    with _refused(group_name, "reduce"):
        _index(dst_tensor, "dst_tensor", "reduce_multigpu")
        tensor = _one(tensor_list, "tensor_list", "reduce_multigpu", "reduce")
    reduce(tensor, dst_rank, group_name, op)


def broadcast_multigpu(tensor_list: list, src_rank: int = 0, src_tensor: int = 0,
                       group_name: str = "default") -> None:
    """:func:`broadcast` of the one tensor in ``tensor_list`` (``src_tensor`` must be 0)."""
    with _refused(group_name, "broadcast"):
        _index(src_tensor, "src_tensor", "broadcast_multigpu")
        tensor = _one(tensor_list, "tensor_list", "broadcast_multigpu", "broadcast")
    broadcast(tensor, src_rank, group_name)


def allgather_multigpu(output_tensor_lists: list, input_tensor_list: list,
                       group_name: str = "default") -> None:
    """:func:`allgather` of the one input tensor into the one output list."""
    fn = "allgather_multigpu"
    with _refused(group_name, "all_gather"):
        outputs = list(_one(output_tensor_lists, "output_tensor_lists", fn, "allgather"))
        tensor = _one(input_tensor_list, "input_tensor_list", fn, "allgather")
    allgather(outputs, tensor, group_name)


def reducescatter_multigpu(output_tensor_list: list, input_tensor_lists: list,
                           group_name: str = "default", op: Any = types.ReduceOp.SUM) -> None:
    """:func:`reducescatter` of the one input list into the one output tensor."""
    fn = "reducescatter_multigpu"
    with _refused(group_name, "reduce_scatter"):
        output = _one(output_tensor_list, "output_tensor_list", fn, "reducescatter")
        inputs = list(_one(input_tensor_lists, "input_tensor_lists", fn, "reducescatter"))
    reducescatter(output, inputs, group_name, op)


def send_multigpu(tensor: Any, dst_rank: int, dst_gpu_index: int, group_name: str = "default",
                  n_elements: int = 0) -> None:
    """:func:`send` (``dst_gpu_index`` must be 0); ``n_elements`` > 0 sends the first ones."""
    _index(dst_gpu_index, "dst_gpu_index", "send_multigpu")
    send(_first(tensor, n_elements, "send_multigpu"), dst_rank, group_name)


def recv_multigpu(tensor: Any, src_rank: int, src_gpu_index: int, group_name: str = "default",
                  n_elements: int = 0) -> None:
    """:func:`recv` (``src_gpu_index`` must be 0); ``n_elements`` > 0 fills the first ones."""
    _index(src_gpu_index, "src_gpu_index", "recv_multigpu")
    recv(_first(tensor, n_elements, "recv_multigpu"), src_rank, group_name)

