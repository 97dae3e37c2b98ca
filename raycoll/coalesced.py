"""torch's coalesced collectives (deprecated in torch 2.13 but present): many tensors, one call.

``all_reduce_coalesced`` and ``all_gather_coalesced`` keep torch's signatures and return, with
``async_op=True``, a future (as torch's do, not a ``Work``). CPU tensors go as one fused
collective: they are packed into one flat buffer, reduced or gathered in one round, and
unpacked in place. Tensors on other devices take one collective each. Every rank's list of
shapes is part of the fingerprint, so ranks that disagree get ``CollectiveMismatchError``
(torch does not check).
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional, Sequence, Union

import numpy as np

from raycoll import errors
from raycoll.collectives import (Prepared, Tensor, _backend, _reduce_op, _run, _tensor,
                                 all_gather, all_reduce)
from raycoll.process_group import ProcessGroup
from raycoll.world import GroupLike
from raycoll.reduce_op import ReduceOp
from raycoll.tensors import TensorInfo, device_type, host_view, is_tensor
from raycoll.work import Future, Work

__all__ = ["all_reduce_coalesced", "all_gather_coalesced"]


_REAL = {"complex64": "float32", "complex128": "float64"}


def _same_dtype(infos: Sequence[TensorInfo], name: str) -> None:
    """One dtype (a complex dtype may go with its element type, as in torch), one device."""
    base = _REAL.get(infos[0].dtype, infos[0].dtype)
    for i, info in enumerate(infos):
        if _REAL.get(info.dtype, info.dtype) != base:
            raise errors.TensorTypeError(
                f"tensors must all have the same type: {name}[{i}] has dtype {info.dtype}, "
                f"expected {infos[0].dtype} (that of {name}[0])")
        if info.device != infos[0].device:
            raise ValueError(f"{name}[{i}] is on {info.device}, expected {infos[0].device}")


def _tensors(values: Any, name: str, *, writable: bool) -> List[TensorInfo]:
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(values).__name__}")
    if not values:
        raise errors.InvalidArgumentError(f"requires non-empty tensor list: {name} must hold "
                                          "at least one tensor")
    infos = [_tensor(v, f"{name}[{i}]", writable=writable) for i, v in enumerate(values)]
    _same_dtype(infos, name)
    return infos


def _as_real(infos: Sequence[TensorInfo]) -> bool:
    """Whether complex tensors travel as pairs of reals (a list mixing complex and real)."""
    return len({i.dtype for i in infos}) > 1


def _pack(tensors: Sequence[Tensor], as_real: bool) -> np.ndarray:
    parts = []
    for t in tensors:
        flat = host_view(t).reshape(-1)
        parts.append(flat.view(_REAL[flat.dtype.name]) if as_real and flat.dtype.kind == "c"
                     else flat)
    return np.concatenate(parts)


def _unpack(flat: np.ndarray, tensors: Sequence[Tensor], as_real: bool) -> None:
    offset = 0
    for t in tensors:
        view = host_view(t)
        n = view.size * (2 if as_real and view.dtype.kind == "c" else 1)
        part = flat[offset:offset + n]
        view[...] = (part.view(view.dtype) if n != view.size else part).reshape(view.shape)
        offset += n


def _future(work: Optional[Work]) -> Optional[Future]:
    return work.get_future() if work is not None else None


def _joined(works: List[Optional[Work]], outputs: List[Any]) -> Optional[Future]:
    """One future over several ``Work``s: the outputs once all are done, or the first error."""
    live = [w for w in works if w is not None]
    if not live:
        return None
    out, left, lock = Future(), [len(live)], threading.Lock()

    def done(fut: Future) -> None:
        try:
            fut.wait()
            error: Optional[BaseException] = None
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            error = exc
        with lock:
            left[0] -= 1
            if out.done():
                return
            if error is not None:
                out.set_exception(error)
            elif left[0] == 0:
                out.set_result(outputs)

    for w in live:
        w.get_future().add_done_callback(done)
    return out


def all_reduce_coalesced(tensors: Union[Tensor, List[Tensor]], op: Any = ReduceOp.SUM,
                         group: GroupLike = None, async_op: bool = False) -> Optional[Future]:
    """Reduce every tensor of ``tensors`` (one dtype, one device) across ranks, in place, in
    one fused round for CPU tensors; with ``async_op`` returns a future of the tensors."""
    if is_tensor(tensors):
        tensors = [tensors]
    tensors = list(tensors) if isinstance(tensors, (list, tuple)) else tensors

    def prepare(pg: ProcessGroup) -> Prepared:
        infos = _tensors(tensors, "tensors", writable=True)
        rop = [_reduce_op(op, info) for info in infos][0]
        as_real = _as_real(infos)
        if as_real and rop.name == "PRODUCT":
            raise errors.UnsupportedOpError(f"all_reduce_coalesced does not support {rop!r} "
                                            "on a list mixing complex and real tensors")
        backend = _backend(pg, infos[0])
        fp = {"dtypes": tuple(i.dtype for i in infos), "shapes": tuple(i.shape for i in infos),
              "reduce_op": rop.key, "device": infos[0].device}

        def fused(call: Any) -> None:
            flat = _pack(tensors, as_real)
            backend.all_reduce(flat, rop, call)
            _unpack(flat, tensors, as_real)

        return fp, fused

    if _on_cpu(tensors):
        return _future(_run("all_reduce_coalesced", group, async_op, prepare, list(tensors)))
    works = [all_reduce(t, op, group, async_op) for t in tensors]
    return _joined(works, list(tensors)) if async_op else None


def all_gather_coalesced(output_tensor_lists: List[List[Tensor]], input_tensor_list: List[Tensor],
                         group: GroupLike = None, async_op: bool = False) -> Optional[Future]:
    """Gather every rank's ``input_tensor_list``: ``output_tensor_lists[r][i]`` gets rank r's
    ``input_tensor_list[i]``, in one fused round for CPU tensors; with ``async_op`` returns a
    future of the output tensors."""
    def prepare(pg: ProcessGroup) -> Prepared:
        if not isinstance(output_tensor_lists, list) or not all(
                isinstance(o, (list, tuple)) for o in output_tensor_lists):
            raise TypeError("Invalid function argument: output_tensor_lists must be a list of "
                            "lists of tensors (one list per rank)")
        ins = _tensors(input_tensor_list, "input_tensor_list", writable=False)
        if len(output_tensor_lists) != pg.size():
            raise errors.TensorSizeError(
                f"output lists should be equal to world size: output_tensor_lists must have "
                f"one list per rank, expected {pg.size()}, got {len(output_tensor_lists)}")
        for r, outs in enumerate(output_tensor_lists):
            name = f"output_tensor_lists[{r}]"
            infos = _tensors(outs, name, writable=True)
            if len(infos) != len(ins):
                raise errors.TensorSizeError(f"{name} must have one tensor per input tensor: "
                                             f"expected {len(ins)}, got {len(infos)}")
            for i, (out, inp) in enumerate(zip(infos, ins)):
                if out.numel != inp.numel:
                    raise errors.TensorSizeError(
                        f"invalid size of output tensor at index {i}: {name}[{i}] has shape "
                        f"{out.shape}, expected {inp.numel} elements (input_tensor_list[{i}] "
                        f"has shape {inp.shape})")
                if out.dtype != inp.dtype:
                    raise errors.TensorTypeError(f"invalid tensor type at index {i}: {name}[{i}] "
                                                 f"has dtype {out.dtype}, expected {inp.dtype}")
        backend = _backend(pg, ins[0])
        as_real = _as_real(ins)
        fp = {"dtypes": tuple(i.dtype for i in ins), "shapes": tuple(i.shape for i in ins),
              "device": ins[0].device}

        def fused(call: Any) -> None:
            flat = _pack(input_tensor_list, as_real)
            total = flat.size
            out = np.empty(total * pg.size(), dtype=flat.dtype)
            backend.all_gather_into_tensor(out, flat, call)
            for r, outs in enumerate(output_tensor_lists):
                _unpack(out[r * total:(r + 1) * total], outs, as_real)

        return fp, fused

    outputs = [t for outs in output_tensor_lists for t in outs] \
        if isinstance(output_tensor_lists, list) and all(
            isinstance(o, (list, tuple)) for o in output_tensor_lists) else None
    if _on_cpu(input_tensor_list):
        return _future(_run("all_gather_coalesced", group, async_op, prepare, outputs))
    works = [all_gather([outs[i] for outs in output_tensor_lists], t, group, async_op)
             for i, t in enumerate(input_tensor_list)]
    return _joined(works, outputs or []) if async_op else None


def _on_cpu(tensors: Any) -> bool:
    """Whether the fused CPU path applies (anything it cannot judge goes there, to be
    rejected with a clear error by the argument checks)."""
    if not isinstance(tensors, (list, tuple)) or not tensors or not is_tensor(tensors[0]):
        return True
    try:
        return all(device_type(t) == "cpu" for t in tensors)
    except TypeError:
        return True
