"""Sparse COO tensors in ``all_reduce`` (SUM), as gloo reduces them.

DDP's gradients of an ``nn.Embedding(sparse=True)`` are sparse COO tensors, and gloo
all_reduces them: every rank's indices and values are gathered, and each rank's tensor
becomes their sum, coalesced, bitwise the same on every rank. raycoll does it in two
collectives on the data plane: the ranks' byte counts (one small ``all_gather``), then every
rank's indices and values packed into one byte buffer, padded to the longest
(``all_gather_into_tensor``). Several tensors of one rank (the object API's
``pg.allreduce([s1, s2])``) are summed on the rank first.

Every check runs before the first step (the peers are told of a rejection): a list that
mixes layouts, dtypes or sizes, an op other than SUM, a dtype numpy cannot hold. Every other
collective refuses sparse tensors up front (``raycoll.collectives._tensor``). The call is
synchronous (its second step's size comes from the first); with ``async_op`` it returns a
completed ``Work``. Torch is imported lazily: only torch makes sparse tensors.

This module sits below :mod:`raycoll.collectives` and :mod:`raycoll.process_group` (the
object API asks it :func:`is_sparse`): the caller hands it its ``run``, and a group arrives
as a ``ProcessGroup`` without this module naming the type.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from raycoll import errors
from raycoll.reduce_op import ReduceOp, as_reduce_op
from raycoll.work import Work

__all__ = ["is_sparse", "all_reduce_sparse"]

Run = Callable[..., Optional[Work]]


def is_sparse(value: Any) -> bool:
    """Whether ``value`` is a torch sparse COO tensor."""
    return bool(getattr(value, "is_sparse", False))


def _check(tensors: List[Any], op: Any) -> Tuple[Any, str]:
    """The checks gloo makes (its words first), then what raycoll needs; the first tensor's
    size and the values' numpy dtype."""
    import torch

    if not tensors:
        raise errors.InvalidArgumentError("requires non-empty tensor list")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not is_sparse(t):
            raise errors.TensorTypeError(
                f"invalid tensor layout at index {i}: tensors[{i}] is "
                f"{getattr(t, 'layout', type(t).__name__)}, expected torch.sparse_coo (a "
                "list is all sparse or all dense)")
        if t.dtype != first.dtype:
            raise errors.TensorTypeError(f"invalid tensor type: tensors[{i}] has dtype "
                                         f"{t.dtype}, expected {first.dtype}")
        if t.size() != first.size() or t.sparse_dim() != first.sparse_dim():
            raise errors.TensorSizeError(
                f"invalid tensor size: tensors[{i}] has size {tuple(t.size())} (sparse dims "
                f"{t.sparse_dim()}), expected {tuple(first.size())} ({first.sparse_dim()})")
    rop = as_reduce_op(op)
    if rop.name != ReduceOp.SUM.name:
        raise errors.InvalidArgumentError(
            f"unsupported reduction operation {rop!r} for sparse tensors: all_reduce takes "
            "them with ReduceOp.SUM only (as gloo)")
    try:
        np_dtype = torch.empty(0, dtype=first.dtype).numpy().dtype.str
    except TypeError as exc:
        raise errors.TensorTypeError(f"invalid tensor type: sparse values of dtype "
                                     f"{first.dtype} cannot be viewed by numpy") from exc
    return first.size(), np_dtype


def _payload(total: Any) -> Tuple[np.ndarray, int]:
    """The coalesced local sum as bytes: its indices (int64), then its values."""
    idx = np.ascontiguousarray(total.indices().numpy())
    val = np.ascontiguousarray(total.values().numpy())
    return np.concatenate([idx.view(np.uint8).ravel(), val.view(np.uint8).ravel()]), \
        int(total._nnz())


def _assemble(rows: np.ndarray, counts: np.ndarray, like: Any, np_dtype: str) -> Any:
    """Every rank's indices and values, concatenated in rank order and coalesced."""
    import torch

    sdim, dense = like.sparse_dim(), tuple(like.size())[like.sparse_dim():]
    indices, values = [], []
    for row, (nbytes, nnz) in zip(rows, counts):
        cut = sdim * int(nnz) * 8
        data = row[:int(nbytes)].tobytes()
        indices.append(np.frombuffer(data[:cut], dtype=np.int64).reshape(sdim, int(nnz)))
        values.append(np.frombuffer(data[cut:], dtype=np_dtype).reshape((int(nnz),) + dense))
    summed = torch.sparse_coo_tensor(torch.from_numpy(np.concatenate(indices, axis=1)),
                                     torch.from_numpy(np.concatenate(values, axis=0)),
                                     like.size())
    return summed.coalesce()


def all_reduce_sparse(tensors: List[Any], op: Any, group: Any, async_op: bool,
                      run: Run) -> Optional[Work]:
    """Sum sparse COO ``tensors`` over every rank (and over the list), in place on each:
    gloo's sparse ``allreduce``. ``run`` is :func:`raycoll.collectives._run`."""
    import torch

    tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
    state: Dict[str, Any] = {}

    def counts(pg: Any) -> Tuple[Dict[str, Any], Callable[[Any], None]]:
        size, np_dtype = _check(tensors, op)
        total = tensors[0].detach().cpu()
        for t in tensors[1:]:
            total = total + t.detach().cpu()
        payload, nnz = _payload(total.coalesce())
        state.update(pg=pg, payload=payload, np_dtype=np_dtype)
        backend = pg.backend("cpu")
        fp = {"layout": "sparse_coo", "dtype": str(tensors[0].dtype), "size": tuple(size),
              "sparse_dim": tensors[0].sparse_dim()}

        def gather(call: Any) -> None:
            out = np.empty(2 * pg.size(), dtype=np.int64)
            backend.all_gather_into_tensor(out, np.array([payload.size, nnz], np.int64), call)
            state["counts"] = out.reshape(pg.size(), 2)

        return fp, gather

    run("all_reduce_sparse", group, False, counts)
    if "counts" not in state:  # not a member of the group
        return None
    pg, payload = state["pg"], state["payload"]
    widest = max(int(state["counts"][:, 0].max()), 1)

    def data(pg: Any) -> Tuple[Dict[str, Any], Callable[[Any], None]]:
        backend = pg.backend("cpu")

        def gather(call: Any) -> None:
            mine = np.zeros(widest, dtype=np.uint8)
            mine[:payload.size] = payload
            out = np.empty(widest * pg.size(), dtype=np.uint8)
            backend.all_gather_into_tensor(out, mine, call)
            state["rows"] = out.reshape(pg.size(), widest)

        return {"layout": "sparse_coo", "bytes": widest}, gather

    run("all_reduce_sparse", pg, False, data)
    result = _assemble(state["rows"], state["counts"], tensors[0], state["np_dtype"])
    with torch.no_grad():
        for t in tensors:
            t.copy_(result.to(t.device))
    if not async_op:
        return None
    done: "concurrent.futures.Future[Any]" = concurrent.futures.Future()
    done.set_result(None)
    return Work(done, describe=f"all_reduce of sparse tensors on group {pg.name!r}",
                outputs=tensors)
