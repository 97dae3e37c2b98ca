"""Handing a live rank's state to the others over the data plane: ``broadcast_state_dict``.

What a rank that joins a live group (:func:`raycoll.grow_group`) needs first: the model and
optimizer state of a rank that has it. The state travels the way collectives do, not
through the driver: its structure and Python objects in one ``broadcast_object_list``, its
arrays and tensors packed as bytes into buckets of ``bucket_bytes`` and sent by one
``broadcast`` each (the node segment and direct connections where the group has them), so
that no rank holds more than one bucket beyond the state itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from raycoll.collectives import broadcast
from raycoll.groups import get_rank
from raycoll.object_collectives import broadcast_object_list
from raycoll.world import GroupLike

__all__ = ["broadcast_state_dict", "DEFAULT_BUCKET_BYTES"]

#: The default size of one bucket of ``broadcast_state_dict``'s arrays.
DEFAULT_BUCKET_BYTES = 16 << 20


@dataclass(frozen=True)
class _Leaf:
    """Where array number ``index`` sits in the structure sent."""

    index: int


@dataclass(frozen=True)
class _Layout:
    """One array's place in the byte stream and how to make it again."""

    kind: str  # "numpy" or "torch"
    dtype: str  # numpy's dtype string (torch: the dtype of its bits as numpy sees them)
    shape: Tuple[int, ...]
    offset: int
    nbytes: int
    torch_dtype: Optional[str] = None  # torch's dtype name, for a torch tensor


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def _host_array(value: Any) -> Tuple[np.ndarray, Optional[str]]:
    """``value`` as a C-contiguous numpy array of its bytes, and torch's dtype name."""
    if _is_torch(value):
        import torch

        t = value.detach().to("cpu").contiguous()
        name = str(t.dtype).replace("torch.", "")
        if t.dtype == torch.bfloat16:  # numpy has none: its bits
            t = t.view(torch.int16)
        return t.numpy(), name
    return np.ascontiguousarray(value), None


def _split(obj: Any, arrays: List[Any]) -> Any:
    """``obj``'s structure with every array and tensor replaced by a :class:`_Leaf`."""
    if isinstance(obj, np.ndarray) or _is_torch(obj):
        arrays.append(obj)
        return _Leaf(len(arrays) - 1)
    if isinstance(obj, dict):
        return type(obj)((k, _split(v, arrays)) for k, v in obj.items()) \
            if type(obj) is not dict else {k: _split(v, arrays) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_split(v, arrays) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_split(v, arrays) for v in obj)
    return obj


def _fill(obj: Any, arrays: List[Any]) -> Any:
    """The structure :func:`_split` made, its leaves replaced by ``arrays``."""
    if isinstance(obj, _Leaf):
        return arrays[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, arrays) for k, v in obj.items()} if type(obj) is dict \
            else type(obj)((k, _fill(v, arrays)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_fill(v, arrays) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_fill(v, arrays) for v in obj)
    return obj


def broadcast_state_dict(state_dict: Optional[Dict[str, Any]], src: int = 0,
                         group: GroupLike = None,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Dict[str, Any]:
    """Every rank of ``group`` gets rank ``src``'s ``state_dict`` (a global rank, as
    ``broadcast``'s; the other ranks pass ``None`` or anything: it is not read). Returns it:
    on ``src`` its own object, elsewhere a new one of the same structure (dicts, lists and
    tuples nested at will), numpy arrays as numpy arrays and torch tensors as CPU torch
    tensors of the same dtype (GPU tensors go through the host: move them with ``.to``),
    every other value as pickled. Called by every rank of the group, as a collective.

    The arrays move over the data plane in buckets of ``bucket_bytes`` (one ``broadcast``
    each), never through the driver or the object store's objects."""
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    me = get_rank(group)
    header: List[Any] = [None]
    host: List[np.ndarray] = []
    if me == src:
        if not isinstance(state_dict, dict):
            raise TypeError(f"broadcast_state_dict: state_dict on the source rank {src} must "
                            f"be a dict, got {type(state_dict).__name__}")
        arrays: List[Any] = []
        skeleton = _split(state_dict, arrays)
        layouts, offset = [], 0
        for value in arrays:
            arr, torch_dtype = _host_array(value)
            host.append(arr)
            layouts.append(_Layout("torch" if torch_dtype else "numpy", arr.dtype.str,
                                   tuple(arr.shape), offset, arr.nbytes, torch_dtype))
            offset += arr.nbytes
        header = [(skeleton, layouts, offset)]
    broadcast_object_list(header, src=src, group=group)
    skeleton, layouts, total = header[0]
    if me != src:
        host = [np.empty(lay.shape, dtype=np.dtype(lay.dtype)) for lay in layouts]
    for start in range(0, total, bucket_bytes):
        bucket = np.empty(min(bucket_bytes, total - start), dtype=np.uint8)
        if me == src:
            _copy(host, layouts, start, bucket, into_bucket=True)
        broadcast(bucket, src=src, group=group)
        if me != src:
            _copy(host, layouts, start, bucket, into_bucket=False)
    if me == src:
        return state_dict  # type: ignore[return-value]
    return _fill(skeleton, [_rebuild(arr, lay) for arr, lay in zip(host, layouts)])


def _copy(host: List[np.ndarray], layouts: List[_Layout], start: int, bucket: np.ndarray,
          into_bucket: bool) -> None:
    """Copy the bytes of the arrays that overlap ``[start, start + len(bucket))`` between
    them and ``bucket``."""
    end = start + bucket.nbytes
    for arr, lay in zip(host, layouts):
        lo, hi = max(lay.offset, start), min(lay.offset + lay.nbytes, end)
        if lo >= hi:
            continue
        flat = arr.reshape(-1).view(np.uint8)
        if into_bucket:
            bucket[lo - start:hi - start] = flat[lo - lay.offset:hi - lay.offset]
        else:
            flat[lo - lay.offset:hi - lay.offset] = bucket[lo - start:hi - start]


def _rebuild(arr: np.ndarray, lay: _Layout) -> Any:
    if lay.kind == "numpy":
        return arr
    import torch

    tensor = torch.from_numpy(arr)
    want = getattr(torch, lay.torch_dtype or "")
    return tensor.view(want) if tensor.dtype != want else tensor
