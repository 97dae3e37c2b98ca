"""Several tensors in one collective, with gloo's semantics, each one round on the data plane.

What torch's ``ProcessGroup`` object API takes in a list and gloo honours:

- :func:`all_reduce_multi` (``pg.allreduce([t1, t2])``): every tensor of every rank reduced
  together, the result in each tensor;
- :func:`broadcast_multi` (``pg.broadcast([t1, t2], opts)``): the root's
  ``tensors[root_tensor]`` into every tensor of every rank;
- :func:`all_gather_multi` (``pg.allgather([[...], [...]], [t1, t2])``): every output list
  gets every rank's inputs, rank by rank;
- :func:`all_gather_into_tensor_coalesced` and :func:`reduce_scatter_tensor_coalesced`
  (torch's ``ProcessGroup`` methods of those names): one ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor`` per pair, fused.

The tensors are combined or packed into one buffer, moved by one call of the backend, and
unpacked in place when the group's worker runs the call (not when it is issued), so calls
queued before it see the tensors as they were. CPU tensors that numpy can view (the fused
path packs host views); other devices take one collective per tensor (the coalesced ones) or
are refused before anything moves. Every check runs before the call's first step, and a
rejected call tells the peers (as every raycoll collective does).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from raycoll import errors
from raycoll.coalesced import _joined, _pack, _unpack
from raycoll.collectives import (Prepared, Tensor, _backend, _reduce_op, _run, _tensor,
                                 all_gather_into_tensor, reduce_scatter_tensor)
from raycoll.process_group import ProcessGroup
from raycoll.reduce_op import ReduceOp, combine
from raycoll.tensors import TensorInfo, device_type, host_view, is_tensor
from raycoll.work import Work
from raycoll.world import GroupLike

__all__ = ["all_reduce_multi", "broadcast_multi", "all_gather_multi",
           "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"]


def _list(values: Any, name: str) -> List[Any]:
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(values).__name__}")
    if not values:
        raise errors.InvalidArgumentError(f"requires non-empty tensor list: {name} is empty")
    return list(values)


def _alike(values: Sequence[Any], name: str, *, writable: bool, shape: bool = True,
           like: Optional[TensorInfo] = None) -> List[TensorInfo]:
    """Each tensor of ``values`` described, of one dtype and device (and, with ``shape``,
    one size: gloo's "invalid tensor type" / "invalid tensor size")."""
    infos = [_tensor(v, f"{name}[{i}]", writable=writable) for i, v in enumerate(values)]
    first = like or infos[0]
    for i, info in enumerate(infos):
        if info.dtype != first.dtype or info.device != first.device:
            raise errors.TensorTypeError(
                f"invalid tensor type: {name}[{i}] is {info.dtype} on {info.device}, "
                f"expected {first.dtype} on {first.device}")
        if shape and info.numel != first.numel:
            raise errors.TensorSizeError(
                f"invalid tensor size: {name}[{i}] has shape {info.shape}, expected "
                f"{first.numel} elements (shape {first.shape})")
    return infos


def _host(values: Sequence[Any], name: str) -> List[np.ndarray]:
    """Host views of CPU tensors, checked now (before the call's first step)."""
    views = []
    for i, v in enumerate(values):
        if device_type(v) != "cpu":
            raise errors.InvalidArgumentError(
                f"{name}[{i}] is on {device_type(v)}: raycoll takes several tensors in one "
                "list on CPU tensors only; pass one tensor per call")
        views.append(host_view(v, f"{name}[{i}]"))
    return views


def all_reduce_multi(tensors: List[Tensor], op: Any = ReduceOp.SUM, group: GroupLike = None,
                     async_op: bool = False) -> Optional[Work]:
    """Reduce every tensor of every rank's ``tensors`` (one dtype, one size) together; each
    tensor gets the result (gloo's ``allreduce`` of a list)."""
    tensors = _list(tensors, "tensors")

    def prepare(pg: ProcessGroup) -> Prepared:
        infos = _alike(tensors, "tensors", writable=True)
        rop = _reduce_op(op, infos[0])
        views = _host(tensors, "tensors")
        backend = _backend(pg, infos[0])
        fp = {"dtype": infos[0].dtype, "shape": infos[0].shape, "count": len(tensors),
              "reduce_op": rop.key, "device": infos[0].device}

        def fused(call: Any) -> None:
            acc = np.array(views[0], copy=True, order="C")
            for view in views[1:]:
                combine(rop, acc, view)  # AVG and PREMUL_SUM add here, as SUM
            if rop.name == "AVG":  # the mean over ranks of each rank's mean
                np.divide(acc, len(views), out=acc, casting="unsafe")
            backend.all_reduce(acc, rop, call)
            for view in views:
                view[...] = acc

        return fp, fused

    return _run("all_reduce", group, async_op, prepare, tensors)


def broadcast_multi(tensors: List[Tensor], group_src: int, root_tensor: int,
                    group: GroupLike = None, async_op: bool = False) -> Optional[Work]:
    """Copy group rank ``group_src``'s ``tensors[root_tensor]`` into every tensor of every
    rank (gloo's ``broadcast`` of a list)."""
    tensors = _list(tensors, "tensors")

    def prepare(pg: ProcessGroup) -> Prepared:
        infos = _alike(tensors, "tensors", writable=True)
        views = _host(tensors, "tensors")
        backend = _backend(pg, infos[0])
        fp = {"dtype": infos[0].dtype, "shape": infos[0].shape, "root": group_src,
              "device": infos[0].device}

        def fused(call: Any) -> None:
            if pg.rank() == group_src:
                buf = np.array(views[root_tensor], copy=True, order="C")
            else:
                buf = np.empty(views[0].shape, dtype=views[0].dtype)
            backend.broadcast(buf, group_src, call)
            for view in views:
                view[...] = buf

        return fp, fused

    return _run("broadcast", group, async_op, prepare, tensors)


def all_gather_multi(output_lists: List[List[Tensor]], inputs: List[Tensor],
                     group: GroupLike = None, async_op: bool = False) -> Optional[Work]:
    """Gather every rank's ``inputs`` (n tensors of one dtype and size): each of the n
    ``output_lists`` gets, at ``r * n + i``, rank r's ``inputs[i]`` (gloo's ``allgather``)."""
    inputs = _list(inputs, "input_tensors")
    outputs = [t for lst in output_lists for t in lst]

    def prepare(pg: ProcessGroup) -> Prepared:
        ins = _alike(inputs, "input_tensors", writable=False)
        n, size = len(inputs), pg.size()
        for j, lst in enumerate(output_lists):
            if len(lst) != n * size:
                raise errors.TensorSizeError(
                    f"invalid output tensor list at index {j}: expected {n * size} tensors "
                    f"(world size {size} * {n} inputs), got {len(lst)}")
            _alike(lst, f"output_tensors[{j}]", writable=True, like=ins[0])
        _host(inputs, "input_tensors")
        outs = [_host(lst, f"output_tensors[{j}]") for j, lst in enumerate(output_lists)]
        backend = _backend(pg, ins[0])
        fp = {"dtype": ins[0].dtype, "shape": ins[0].shape, "count": n,
              "device": ins[0].device}

        def fused(call: Any) -> None:
            flat = _pack(inputs, False)
            out = np.empty(flat.size * size, dtype=flat.dtype)
            backend.all_gather_into_tensor(out, flat, call)
            pieces = out.reshape(n * size, -1)
            for views in outs:
                for k, view in enumerate(views):
                    view[...] = pieces[k].reshape(view.shape)

        return fp, fused

    return _run("all_gather", group, async_op, prepare, outputs)


def _pairs(outputs: Any, inputs: Any, factor: str) -> None:
    """Two lists of the same length (gloo's coalesced tensor calls)."""
    _list(outputs, "outputs")
    _list(inputs, "inputs")
    if len(outputs) != len(inputs):
        raise errors.TensorSizeError(f"outputs and inputs must have the same length ({factor}"
                                     f" per pair), got {len(outputs)} and {len(inputs)}")


def _on_cpu(tensors: Sequence[Any]) -> bool:
    return all(is_tensor(t) and device_type(t) == "cpu" for t in tensors)


def all_gather_into_tensor_coalesced(outputs: List[Tensor], inputs: List[Tensor],
                                     group: GroupLike = None,
                                     async_op: bool = False) -> Optional[Work]:
    """``all_gather_into_tensor(outputs[i], inputs[i])`` for every i, as one collective:
    ``outputs[i]`` gets every rank's ``inputs[i]`` in rank order."""
    _pairs(outputs, inputs, "world size * input elements")
    if not _on_cpu(list(outputs) + list(inputs)):
        works = [all_gather_into_tensor(o, i, group, async_op) for o, i in zip(outputs, inputs)]
        return _work(works, list(outputs), async_op)

    def prepare(pg: ProcessGroup) -> Prepared:
        ins = _alike(inputs, "inputs", writable=False, shape=False)
        outs = _alike(outputs, "outputs", writable=True, shape=False, like=ins[0])
        size = pg.size()
        for i, (o, x) in enumerate(zip(outs, ins)):
            if o.numel != x.numel * size:
                raise errors.TensorSizeError(
                    f"invalid tensor size: outputs[{i}] must have world size * inputs[{i}]"
                    f".numel() = {size} * {x.numel} elements, got {o.numel} (shape {o.shape})")
        views = _host(outputs, "outputs")
        _host(inputs, "inputs")
        backend = _backend(pg, ins[0])
        fp = {"dtype": ins[0].dtype, "numels": tuple(x.numel for x in ins),
              "device": ins[0].device}

        def fused(call: Any) -> None:
            flat = _pack(inputs, False)
            out = np.empty(flat.size * size, dtype=flat.dtype).reshape(size, -1)
            backend.all_gather_into_tensor(out.reshape(-1), flat, call)
            offset = 0
            for view, x in zip(views, ins):
                view[...] = out[:, offset:offset + x.numel].reshape(view.shape)
                offset += x.numel

        return fp, fused

    return _run("all_gather_into_tensor_coalesced", group, async_op, prepare, list(outputs))


def reduce_scatter_tensor_coalesced(outputs: List[Tensor], inputs: List[Tensor],
                                    op: Any = ReduceOp.SUM, group: GroupLike = None,
                                    async_op: bool = False) -> Optional[Work]:
    """``reduce_scatter_tensor(outputs[i], inputs[i], op)`` for every i, as one collective:
    rank r's ``outputs[i]`` gets chunk r of ``inputs[i]`` reduced over the ranks."""
    _pairs(outputs, inputs, "world size * output elements")
    if not _on_cpu(list(outputs) + list(inputs)):
        works = [reduce_scatter_tensor(o, i, op, group, async_op)
                 for o, i in zip(outputs, inputs)]
        return _work(works, list(outputs), async_op)

    def prepare(pg: ProcessGroup) -> Prepared:
        outs = _alike(outputs, "outputs", writable=True, shape=False)
        ins = _alike(inputs, "inputs", writable=False, shape=False, like=outs[0])
        size = pg.size()
        for i, (o, x) in enumerate(zip(outs, ins)):
            if x.numel != o.numel * size:
                raise errors.TensorSizeError(
                    f"invalid tensor size: inputs[{i}] must have world size * outputs[{i}]"
                    f".numel() = {size} * {o.numel} elements, got {x.numel} (shape {x.shape})")
        rop = _reduce_op(op, outs[0])
        _host(outputs, "outputs")  # checked now: host tensors (written by _unpack)
        in_views = _host(inputs, "inputs")
        backend = _backend(pg, outs[0])
        fp = {"dtype": outs[0].dtype, "numels": tuple(o.numel for o in outs),
              "reduce_op": rop.key, "device": outs[0].device}

        def fused(call: Any) -> None:  # row r: every input's chunk r, in order
            flat = np.concatenate([v.reshape(size, -1) for v in in_views], axis=1)
            out = np.empty(flat.shape[1], dtype=flat.dtype)
            backend.reduce_scatter_tensor(out, flat.reshape(-1), rop, call)
            _unpack(out, outputs, False)

        return fp, fused

    return _run("reduce_scatter_tensor_coalesced", group, async_op, prepare, list(outputs))


def _work(works: List[Optional[Work]], outputs: List[Any], async_op: bool) -> Optional[Work]:
    """One ``Work`` over the per-tensor calls of a device the fused path does not take."""
    if not async_op:
        return None
    import concurrent.futures

    joined = _joined(works, outputs)
    inner: "concurrent.futures.Future[Any]" = concurrent.futures.Future()
    if joined is None:
        inner.set_result(None)
    else:
        def done(fut: Any) -> None:
            try:
                fut.wait()
            except BaseException as exc:  # noqa: BLE001 - delivered through the Work
                inner.set_exception(exc)
            else:
                inner.set_result(None)

        joined.add_done_callback(done)
    return Work(inner, describe="coalesced tensor calls", outputs=outputs)
