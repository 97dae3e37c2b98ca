"""The public collective functions, with ``torch.distributed``'s names and signatures
(point to point: :mod:`raycoll.p2p`).

Every collective has the same shape: resolve the group (``None`` -> default group, a name,
or a ``ProcessGroup``; a non-member gets torch's non-member behaviour), take the next sequence
number, validate the arguments (errors name the parameter, what was expected and what came;
a rank that rejects its arguments tells its peers, which raise ``PeerArgumentError`` instead
of waiting), pick the backend for the tensors' device, and run, waiting unless ``async_op``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, overload

import numpy as np

from raycoll import errors
from raycoll import sparse as _sparse
from raycoll.backends.base import CollectiveBackend
from raycoll.call_options import call_timeout_s
from raycoll.context import Call
from raycoll.process_group import ProcessGroup
from raycoll.world import GroupLike, _NonMember, world
from raycoll.reduce_op import ReduceOp, as_reduce_op, check_op_dtype
from raycoll.sparse import is_sparse
from raycoll.tensors import TensorInfo, describe
from raycoll.work import Work

logger = logging.getLogger("raycoll")

Tensor = Any
Prepared = Tuple[Dict[str, Any], Callable[[Call], Any]]

__all__ = [
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "all_gather_single", "reduce_scatter_single", "barrier", "monitored_barrier",
]

_REJECTED = (ValueError, TypeError, errors.BackendUnavailableError)


# ---------------------------------------------------------------------- helpers
def _resolve(group: GroupLike, op: str) -> Optional[ProcessGroup]:
    pg = world().resolve(group)
    if isinstance(pg, _NonMember):
        warnings.warn(f"Running {op} on a rank which does not belong to the given group.",
                      stacklevel=3)
        return None
    return pg


def _run(op: str, group: GroupLike, async_op: bool, prepare: Callable[[ProcessGroup], Prepared],
         outputs: Optional[List[Any]] = None) -> Optional[Work]:
    pg = _resolve(group, op)  # checks that the group is usable: once per call
    if pg is None:
        return None
    seq = pg.take_seq()
    try:
        fp, fn = prepare(pg)
    except _REJECTED as exc:
        pg.reject(Call(op, seq, pg.timeout_s, {"op": op}), exc)
        raise
    fp["op"] = op
    call = Call(op, seq, call_timeout_s(pg.timeout_s), fp)  # an Options' timeout, if set
    return pg.run(call, lambda: fn(call), async_op, outputs)


def _tensor(value: Any, name: str, *, writable: bool = False) -> TensorInfo:
    if getattr(value, "is_sparse", False) or getattr(value, "is_sparse_csr", False):
        raise errors.TensorTypeError(
            f"invalid tensor layout: {name} is a sparse tensor ({value.layout}); raycoll "
            "takes sparse COO tensors in all_reduce (SUM) only, as gloo: pass "
            f"{name}.to_dense()")
    info = describe(value, name)
    if info.dtype == "object":
        raise TypeError(f"{name} has dtype object: tensors hold numbers (or bool, str, dates); "
                        "send Python objects with the *_object collectives (e.g. "
                        "all_gather_object)")
    if writable and not info.writable:
        raise ValueError(
            f"{name} is read-only: numpy arguments of Ray actor methods and arrays from ray.get "
            f"are read-only views of the object store, and writing into them would change what "
            f"other readers see. Copy it first: {name} = {name}.copy() (or np.array({name}))"
        )
    return info


def _tensor_list(values: Any, name: str, size: int, *, writable: bool = False,
                 like: Optional[TensorInfo] = None) -> List[TensorInfo]:
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(values).__name__}")
    if len(values) != size:
        raise errors.TensorSizeError(f"{name} must have one tensor per rank: expected {size}, "
                                     f"got {len(values)}")
    infos = [_tensor(v, f"{name}[{i}]", writable=writable) for i, v in enumerate(values)]
    if like is not None:
        for i, info in enumerate(infos):
            _same(info, like, f"{name}[{i}]")
    return infos


def _same(info: TensorInfo, like: TensorInfo, name: str, *, shape: bool = True) -> None:
    """``info`` like ``like`` (gloo's words first: torch's tests match on them)."""
    if info.dtype != like.dtype:
        raise errors.TensorTypeError(f"invalid tensor type: {name} has dtype {info.dtype}, "
                                     f"expected {like.dtype}")
    if info.device != like.device:
        raise ValueError(f"{name} is on {info.device}, expected {like.device}")
    if shape and info.numel != like.numel:
        raise errors.TensorSizeError(f"invalid tensor size: {name} has shape {info.shape}, "
                                     f"expected {like.numel} elements (shape {like.shape})")


def _np_dtype(info: TensorInfo) -> Optional[np.dtype]:
    if info.dtype == "bfloat16":  # no numpy bfloat16: check ops as on another float dtype
        return np.dtype(np.float16)
    try:
        return np.dtype(info.dtype)
    except TypeError:
        return None  # checked by the backend that can hold it


def _reduce_op(op: Any, info: TensorInfo) -> ReduceOp:
    rop = as_reduce_op(op)
    dtype = _np_dtype(info)
    if dtype is not None:
        check_op_dtype(rop, dtype)
    return rop


@overload
def _peer(pg: ProcessGroup, global_rank: Optional[int], group_rank: Optional[int], name: str,
          group_name: str) -> int: ...


@overload
def _peer(pg: ProcessGroup, global_rank: Optional[int], group_rank: Optional[int], name: str,
          group_name: str, *, required: bool) -> Optional[int]: ...


def _peer(pg: ProcessGroup, global_rank: Optional[int], group_rank: Optional[int], name: str,
          group_name: str, *, required: bool = True) -> Optional[int]:
    """A group rank from a global rank (``src``/``dst``) or a group rank (``group_src``...)."""
    if global_rank is not None and group_rank is not None:
        raise ValueError(f"pass either {name} or {group_name}, not both "
                         f"(got {name}={global_rank}, {group_name}={group_rank})")
    if group_rank is not None:
        if not isinstance(group_rank, (int, np.integer)) or isinstance(group_rank, bool):
            raise TypeError(f"{group_name} must be an int, got {group_rank!r}")
        if not 0 <= group_rank < pg.size():
            raise ValueError(f"{group_name}={group_rank} is out of range for group "
                             f"{pg.name!r} of size {pg.size()}")
        return int(group_rank)
    if global_rank is None:
        if required:
            raise ValueError(f"{name} (a global rank) or {group_name} (a group rank) is required")
        return None
    if not isinstance(global_rank, (int, np.integer)) or isinstance(global_rank, bool):
        raise TypeError(f"{name} must be an int, got {global_rank!r}")
    if int(global_rank) not in pg.global_ranks:
        raise ValueError(f"{name}={global_rank} is not a rank of group {pg.name!r} "
                         f"(its global ranks: {list(pg.global_ranks)})")
    return pg.global_ranks.index(int(global_rank))


def _given(value: Any) -> bool:
    """Whether a root-only list argument was given (not ``None`` or ``[]``; no truth test)."""
    return value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0)


def _backend(pg: ProcessGroup, info: TensorInfo) -> CollectiveBackend:
    if info.dtype == "bfloat16" and info.device == "cpu":
        return pg.bfloat16_backend()  # through float32 / int16 host copies
    return pg.backend(info.device)


# ---------------------------------------------------------------------- reductions
def all_reduce(tensor: Tensor, op: Any = ReduceOp.SUM, group: GroupLike = None,
               async_op: bool = False) -> Optional[Work]:
    """Reduce ``tensor`` across all ranks, in place; every rank gets the result. A sparse
    COO tensor is summed as gloo sums it (:mod:`raycoll.sparse`)."""
    if is_sparse(tensor):
        return all_reduce_sparse([tensor], op, group, async_op)
    if not async_op and type(tensor) is np.ndarray and type(op) is ReduceOp:  # short path
        pg = world().default if group is None else (
            world().groups.get(group) if type(group) is str else group)
        if type(pg) is ProcessGroup and pg.fast_all_reduce(tensor, op):
            return None

    def prepare(pg: ProcessGroup) -> Prepared:
        info = _tensor(tensor, "tensor", writable=True)
        rop = _reduce_op(op, info)
        backend = _backend(pg, info)
        fp = {"dtype": info.dtype, "shape": info.shape, "reduce_op": rop.key, "device": info.device}
        return fp, lambda call: backend.all_reduce(tensor, rop, call)

    return _run("all_reduce", group, async_op, prepare, [tensor])


def all_reduce_sparse(tensors: List[Tensor], op: Any = ReduceOp.SUM, group: GroupLike = None,
                      async_op: bool = False) -> Optional[Work]:
    """Sum sparse COO ``tensors`` over the list and the ranks, in place (gloo's sparse
    ``allreduce``; see :mod:`raycoll.sparse`)."""
    return _sparse.all_reduce_sparse(tensors, op, group, async_op, _run)


def reduce(tensor: Tensor, dst: Optional[int] = None, op: Any = ReduceOp.SUM,
           group: GroupLike = None, async_op: bool = False,
           group_dst: Optional[int] = None) -> Optional[Work]:
    """Reduce ``tensor`` across all ranks into ``dst``'s tensor (in place on ``dst``)."""
    def prepare(pg: ProcessGroup) -> Prepared:
        info = _tensor(tensor, "tensor", writable=True)
        root = _peer(pg, dst, group_dst, "dst", "group_dst")
        rop = _reduce_op(op, info)
        backend = _backend(pg, info)
        fp = {"dtype": info.dtype, "shape": info.shape, "reduce_op": rop.key, "root": root,
              "device": info.device}
        return fp, lambda call: backend.reduce(tensor, root, rop, call)

    return _run("reduce", group, async_op, prepare, [tensor])


def reduce_scatter(output: Tensor, input_list: List[Tensor], op: Any = ReduceOp.SUM,
                   group: GroupLike = None, async_op: bool = False) -> Optional[Work]:
    """Reduce ``input_list[i]`` over ranks into rank i's ``output``. As gloo, the ranks'
    outputs may differ in size: ``input_list[i]`` has rank i's size (the same list of sizes
    on every rank)."""
    def prepare(pg: ProcessGroup) -> Prepared:
        info = _tensor(output, "output", writable=True)
        ins = _tensor_list(input_list, "input_list", pg.size())
        for i, x in enumerate(ins):
            _same(x, info, f"input_list[{i}]", shape=False)
        mine = ins[pg.rank()]
        if mine.numel != info.numel:
            raise errors.TensorSizeError(
                f"invalid tensor size: input_list[{pg.rank()}] (this rank's part) has shape "
                f"{mine.shape}, output has {info.numel} elements (shape {info.shape})")
        rop = _reduce_op(op, info)
        backend = _backend(pg, info)
        numels = tuple(x.numel for x in ins)
        fp = {"dtype": info.dtype, "numels": numels, "reduce_op": rop.key,
              "device": info.device}
        if len(set(numels)) > 1:
            if info.device != "cpu" or info.dtype == "bfloat16":
                raise ValueError(f"input_list's parts differ in size {list(numels)}: raycoll "
                                 "takes parts of several sizes on CPU tensors (not bfloat16)")
            return fp, lambda call: _reduce_scatter_uneven(backend, output, input_list,
                                                           numels, rop, call)
        return fp, lambda call: backend.reduce_scatter(output, list(input_list), rop, call)

    return _run("reduce_scatter", group, async_op, prepare, [output])


def _reduce_scatter_uneven(backend: CollectiveBackend, output: Tensor, inputs: List[Tensor],
                           numels: Sequence[int], rop: ReduceOp, call: Call) -> None:
    """reduce_scatter of parts of several sizes: each padded to the largest, one
    ``reduce_scatter_tensor``, this rank's part taken back (CPU tensors)."""
    from raycoll.tensors import host_view

    widest = max(numels)
    views = [host_view(x, f"input_list[{i}]").reshape(-1) for i, x in enumerate(inputs)]
    flat = np.zeros((len(views), widest), dtype=views[0].dtype)
    for i, view in enumerate(views):
        flat[i, :view.size] = view
    out = np.empty(widest, dtype=flat.dtype)
    backend.reduce_scatter_tensor(out, flat.reshape(-1), rop, call)
    target = host_view(output, "output")
    target[...] = out[:target.size].reshape(target.shape)


def reduce_scatter_tensor(output: Tensor, input: Tensor, op: Any = ReduceOp.SUM,
                          group: GroupLike = None, async_op: bool = False) -> Optional[Work]:
    """Reduce ``input`` (world_size chunks) over ranks; rank i's ``output`` gets chunk i."""
    def prepare(pg: ProcessGroup) -> Prepared:
        out = _tensor(output, "output", writable=True)
        inp = _tensor(input, "input")
        _same(inp, out, "input", shape=False)
        if inp.numel != out.numel * pg.size():
            raise errors.TensorSizeError(
                f"input must have world_size * output.numel() = {pg.size()} * {out.numel} "
                f"elements, got {inp.numel} (shape {inp.shape})")
        rop = _reduce_op(op, out)
        backend = _backend(pg, out)
        fp = {"dtype": out.dtype, "numel": out.numel, "reduce_op": rop.key, "device": out.device}
        return fp, lambda call: backend.reduce_scatter_tensor(output, input, rop, call)

    return _run("reduce_scatter_tensor", group, async_op, prepare, [output])


# ---------------------------------------------------------------------- data movement
def broadcast(tensor: Tensor, src: Optional[int] = None, group: GroupLike = None,
              async_op: bool = False, group_src: Optional[int] = None) -> Optional[Work]:
    """Copy ``src``'s tensor into every rank's tensor."""
    def prepare(pg: ProcessGroup) -> Prepared:
        root = _peer(pg, src, group_src, "src", "group_src")
        info = _tensor(tensor, "tensor", writable=pg.rank() != root)
        backend = _backend(pg, info)
        fp = {"dtype": info.dtype, "shape": info.shape, "root": root, "device": info.device}
        return fp, lambda call: backend.broadcast(tensor, root, call)

    return _run("broadcast", group, async_op, prepare, [tensor])


def all_gather(tensor_list: List[Tensor], tensor: Tensor, group: GroupLike = None,
               async_op: bool = False) -> Optional[Work]:
    """Gather every rank's ``tensor`` into ``tensor_list`` on every rank."""
    def prepare(pg: ProcessGroup) -> Prepared:
        info = _tensor(tensor, "tensor")
        _tensor_list(tensor_list, "tensor_list", pg.size(), writable=True, like=info)
        backend = _backend(pg, info)
        fp = {"dtype": info.dtype, "shape": info.shape, "device": info.device}
        return fp, lambda call: backend.all_gather(list(tensor_list), tensor, call)

    return _run("all_gather", group, async_op, prepare, list(tensor_list)
                if isinstance(tensor_list, (list, tuple)) else None)


def all_gather_into_tensor(output_tensor: Tensor, input_tensor: Tensor, group: GroupLike = None,
                           async_op: bool = False) -> Optional[Work]:
    """Gather every rank's ``input_tensor`` into one ``output_tensor`` (rank order)."""
    def prepare(pg: ProcessGroup) -> Prepared:
        out = _tensor(output_tensor, "output_tensor", writable=True)
        inp = _tensor(input_tensor, "input_tensor")
        _same(out, inp, "output_tensor", shape=False)
        if out.numel != inp.numel * pg.size():
            raise errors.TensorSizeError(
                f"output_tensor must have world_size * input_tensor.numel() = {pg.size()} * "
                f"{inp.numel} elements, got {out.numel} (shape {out.shape})")
        backend = _backend(pg, inp)
        fp = {"dtype": inp.dtype, "numel": inp.numel, "device": inp.device}
        return fp, lambda call: backend.all_gather_into_tensor(output_tensor, input_tensor, call)

    return _run("all_gather_into_tensor", group, async_op, prepare, [output_tensor])


def gather(tensor: Tensor, gather_list: Optional[List[Tensor]] = None, dst: Optional[int] = None,
           group: GroupLike = None, async_op: bool = False,
           group_dst: Optional[int] = None) -> Optional[Work]:
    """Gather every rank's ``tensor`` into ``gather_list`` on ``dst``."""
    def prepare(pg: ProcessGroup) -> Prepared:
        root = _peer(pg, 0 if dst is None and group_dst is None else dst, group_dst, "dst",
                     "group_dst")
        info = _tensor(tensor, "tensor")
        if pg.rank() == root:
            if gather_list is None:
                raise ValueError("gather_list is required on the destination rank")
            _tensor_list(gather_list, "gather_list", pg.size(), writable=True, like=info)
        elif _given(gather_list):
            raise ValueError("gather_list must not be given on a non-destination rank")
        backend = _backend(pg, info)
        fp = {"dtype": info.dtype, "shape": info.shape, "root": root, "device": info.device}
        outs = list(gather_list) if pg.rank() == root and gather_list is not None else None
        return fp, lambda call: backend.gather(tensor, outs, root, call)

    return _run("gather", group, async_op, prepare,
                list(gather_list) if isinstance(gather_list, (list, tuple)) else [])


def scatter(tensor: Tensor, scatter_list: Optional[List[Tensor]] = None, src: Optional[int] = None,
            group: GroupLike = None, async_op: bool = False,
            group_src: Optional[int] = None) -> Optional[Work]:
    """Send ``scatter_list[i]`` from ``src`` into rank i's ``tensor``."""
    def prepare(pg: ProcessGroup) -> Prepared:
        root = _peer(pg, 0 if src is None and group_src is None else src, group_src, "src",
                     "group_src")
        info = _tensor(tensor, "tensor", writable=True)
        if pg.rank() == root:
            if scatter_list is None:
                raise ValueError("scatter_list is required on the source rank")
            _tensor_list(scatter_list, "scatter_list", pg.size(), like=info)
        elif _given(scatter_list):
            raise ValueError("scatter_list must not be given on a non-source rank")
        backend = _backend(pg, info)
        fp = {"dtype": info.dtype, "shape": info.shape, "root": root, "device": info.device}
        ins = list(scatter_list) if pg.rank() == root and scatter_list is not None else None
        return fp, lambda call: backend.scatter(tensor, ins, root, call)

    return _run("scatter", group, async_op, prepare, [tensor])


def all_to_all(output_tensor_list: List[Tensor], input_tensor_list: List[Tensor],
               group: GroupLike = None, async_op: bool = False) -> Optional[Work]:
    """Send ``input_tensor_list[j]`` to rank j; receive rank i's into ``output_tensor_list[i]``.

    Sizes may differ per peer; every pair's sizes are checked across ranks.
    """
    def prepare(pg: ProcessGroup) -> Prepared:
        outs = _tensor_list(output_tensor_list, "output_tensor_list", pg.size(), writable=True)
        ins = _tensor_list(input_tensor_list, "input_tensor_list", pg.size())
        for i, info in enumerate(ins + outs):
            _same(info, outs[0], "input_tensor_list" if i < len(ins) else "output_tensor_list",
                  shape=False)
        me = pg.rank()
        if ins[me].numel != outs[me].numel:
            raise ValueError(
                f"input_tensor_list[{me}] (what this rank sends itself) has {ins[me].numel} "
                f"elements but output_tensor_list[{me}] has {outs[me].numel}")
        backend = _backend(pg, outs[0])
        fp = {"dtype": outs[0].dtype, "device": outs[0].device}
        return fp, lambda call: backend.all_to_all(list(output_tensor_list),
                                                   list(input_tensor_list), call)

    return _run("all_to_all", group, async_op, prepare, list(output_tensor_list)
                if isinstance(output_tensor_list, (list, tuple)) else None)


def _splits(value: Optional[Sequence[int]], name: str, dim0: int, size: int) -> List[int]:
    if value is None or len(value) == 0:
        if dim0 % size:
            raise ValueError(f"{name} is not given, so dim 0 ({dim0}) must divide evenly "
                             f"by world_size {size}")
        return [dim0 // size] * size
    splits = [int(v) for v in value]
    if len(splits) != size:
        raise ValueError(f"{name} must have one size per rank: expected {size}, got {len(splits)}")
    if any(v < 0 for v in splits):
        raise ValueError(f"{name} must be non-negative, got {splits}")
    if sum(splits) != dim0:
        raise ValueError(f"{name} must sum to dim 0 of the tensor ({dim0}), got sum {sum(splits)}")
    return splits


def all_to_all_single(output: Tensor, input: Tensor,
                      output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None,
                      group: GroupLike = None, async_op: bool = False) -> Optional[Work]:
    """Split ``input`` along dim 0 (``input_split_sizes``), send piece j to rank j, and
    concatenate what arrives into ``output`` (``output_split_sizes``)."""
    def prepare(pg: ProcessGroup) -> Prepared:
        out = _tensor(output, "output", writable=True)
        inp = _tensor(input, "input")
        _same(inp, out, "input", shape=False)
        if len(out.shape) != len(inp.shape) or out.shape[1:] != inp.shape[1:]:
            raise ValueError(f"input and output must match beyond dim 0: input {inp.shape}, "
                             f"output {out.shape}")
        dim_in = inp.shape[0] if inp.shape else inp.numel
        dim_out = out.shape[0] if out.shape else out.numel
        ins = _splits(input_split_sizes, "input_split_sizes", dim_in, pg.size())
        outs = _splits(output_split_sizes, "output_split_sizes", dim_out, pg.size())
        me = pg.rank()
        if ins[me] != outs[me]:
            raise ValueError(f"input_split_sizes[{me}]={ins[me]} (sent to self) must equal "
                             f"output_split_sizes[{me}]={outs[me]}")
        backend = _backend(pg, out)
        fp = {"dtype": out.dtype, "device": out.device, "trailing": tuple(out.shape[1:])}
        return fp, lambda call: backend.all_to_all_single(output, input, outs, ins, call)

    return _run("all_to_all_single", group, async_op, prepare, [output])


#: torch 2.13's newer names.
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


def barrier(group: GroupLike = None, async_op: bool = False,
            device_ids: Optional[List[int]] = None, timeout: Any = None) -> Optional[Work]:
    """Wait until every rank of the group has reached the barrier.

    ``timeout`` (a ``timedelta`` or seconds; default: the group's timeout) bounds this
    rank's wait, as in torch: past it ``DistTimeoutError`` names the missing ranks (and the
    group is broken, as after any collective's timeout). ``device_ids`` is accepted for
    torch's signature (raycoll's barrier needs no device)."""
    from raycoll.work import to_seconds

    seconds = to_seconds(timeout)

    def prepare(pg: ProcessGroup) -> Prepared:
        # a GPU-only group (backend="nccl") meets through its GPU backend, as in c10d
        serves_cpu = pg.backend_config.serves("cpu")
        backend = pg.backend("cpu" if serves_cpu else "cuda")
        if seconds is None:
            return {}, backend.barrier
        return {}, lambda call: backend.barrier(Call(call.op, call.seq, seconds, dict(call.fp)))

    return _run("barrier", group, async_op, prepare)


def monitored_barrier(group: GroupLike = None, timeout: Any = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that reports which ranks failed to arrive within ``timeout`` (c10d's).

    ``timeout`` (seconds or ``timedelta``; default: the group's timeout) bounds the wait. If
    some ranks have not arrived by then, every rank that did raises
    :class:`~raycoll.errors.DistTimeoutError` whose ``missing`` lists the ranks that failed
    to arrive, each with the last collective it completed. torch's rank 0 checks ranks one
    by one and, unless ``wait_all_ranks``, stops at the first missing one; the coordinator
    sees every arrival at once, so raycoll always reports all of them and ``wait_all_ranks``
    only orders the message (first missing rank first, as torch words it).

    Unlike a timeout in any other collective, a monitored_barrier timeout does not break the
    group: it is a diagnostic. Every rank still consumes the barrier's sequence number, and a
    rank that arrives late raises ``DistTimeoutError`` saying so, after which the group stays
    usable on all ranks (a rank that never arrives will time out the next collective). A rank
    that died fails it at once with ``RankFailedError``, as in every collective.
    """
    from raycoll.work import to_seconds

    if not isinstance(wait_all_ranks, bool):
        raise TypeError(f"wait_all_ranks must be a bool, got {wait_all_ranks!r}")
    pg = _resolve(group, "monitored_barrier")
    if pg is None:
        return None
    seconds = float(to_seconds(timeout, pg.timeout_s) or pg.timeout_s)
    call = pg.new_call("monitored_barrier")
    call = Call(call.op, call.seq, seconds, dict(call.fp))
    timed_out: List[errors.DistTimeoutError] = []

    def wait() -> None:
        try:
            pg.backend("cpu").barrier(call)
        except errors.DistTimeoutError as exc:  # kept, not raised here: it must not break pg
            timed_out.append(exc)

    pg.run(call, wait, False)
    if timed_out:
        raise _monitored_timeout(timed_out[0], pg, call, wait_all_ranks)
    return None


def _monitored_timeout(exc: errors.DistTimeoutError, pg: ProcessGroup, call: Call,
                       wait_all_ranks: bool) -> errors.DistTimeoutError:
    """monitored_barrier's error: who failed to arrive, or that this rank came too late."""
    me = pg.global_ranks[pg.rank()]
    missing = list(exc.missing)
    where = f"monitored_barrier #{call.seq} on group {pg.name!r}"
    if me in missing:
        message = (f"rank {me} reached {where} after it had timed out on the other ranks "
                   f"(timeout {call.timeout_s:g}s); the group stays usable")
    elif missing:  # torch's (gloo's) words first: scripts match on them
        who = f"Rank {missing[0]}" if len(missing) == 1 or not wait_all_ranks else \
            f"Ranks {', '.join(str(r) for r in missing)}"
        message = (f"{who} failed to pass monitoredBarrier in {call.timeout_s * 1000:.0f} ms "
                   f"(Timed out: {where}; {exc})")
    else:
        message = str(exc)
    out = errors.DistTimeoutError(message, missing=missing, op=call.op, seq=call.seq,
                                  group=pg.name, rank=me)
    out.__cause__ = exc.__cause__
    return out
