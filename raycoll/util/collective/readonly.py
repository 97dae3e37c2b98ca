"""Results written into read-only numpy arrays, as ``ray.util.collective`` writes them.

Ray hands an actor method its numpy arguments (and ``ray.get`` its caller the arrays it
returns) as read-only views: of the object store's shared memory for a large array, of the
call's argument buffer for a small one. Ray's own collective groups write into them anyway
(its torch gloo group goes through ``torch.from_numpy``, which ignores numpy's flag), and code
written for Ray relies on it: ``def set_buffer(self, x): self.buffer = x`` then
``col.allreduce(self.buffer)``. So the Ray-facing modules (the drop-in,
:mod:`raycoll.util.collective`, and the group class Ray's own module runs,
:mod:`raycoll.util.collective.ray_group`) do what Ray does: they write into the same memory,
through a writable view of it, and warn once per process (:class:`ReadOnlyWriteWarning`)
naming the hazard and the fix. raycoll's own API (``raycoll.all_reduce`` and kin) keeps
refusing such arrays with ``ValueError``.

The hazard: the memory is the object's, so the write changes the object for every reader of
it: ``ray.get`` of the same ``ObjectRef`` in the driver, other actors the same reference was
passed to. The fix: copy the array first (``self.buffer = x.copy()``), which makes it the
actor's own. An array read-only for another reason than Ray's (``np.broadcast_to``'s
zero-stride views, whose elements share memory) is still refused: a write there is no result.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, List

import numpy as np

__all__ = ["ReadOnlyWriteWarning", "writable", "writable_list"]


class ReadOnlyWriteWarning(UserWarning):
    """A collective of the Ray-facing API wrote its result into a read-only numpy array."""


_WARNED = False
_LOCK = threading.Lock()


def _warn_once(op: str, name: str) -> None:
    global _WARNED
    with _LOCK:
        if _WARNED:
            return
        _WARNED = True
    warnings.warn(
        f"{op}: writing the result into {name}, a read-only numpy array, as "
        "ray.util.collective does. Ray hands actor methods (and ray.get) read-only views of "
        "the object's memory, so this write changes the object for every reader of it (ray.get "
        "of the same ObjectRef, other actors it was passed to). Copy the array first "
        f"({name} = {name}.copy()) to make it this process's own; raycoll's own API "
        "(raycoll.all_reduce and kin) refuses read-only arrays. Shown once per process.",
        ReadOnlyWriteWarning, stacklevel=4)


class _Alias:
    """An array interface over another array's memory, writable (keeps the array alive)."""

    def __init__(self, arr: np.ndarray) -> None:
        interface = dict(arr.__array_interface__)
        interface["data"] = (interface["data"][0], False)
        self.__array_interface__ = interface
        self.base = arr


def writable(tensor: Any, op: str, name: str) -> Any:
    """``tensor``, or, for a read-only numpy array, a writable view of the same memory (the
    first time in this process with a :class:`ReadOnlyWriteWarning`). Anything else, and an
    array whose elements overlap (a zero stride), is returned as it is, for the collective to
    judge."""
    if not isinstance(tensor, np.ndarray) or tensor.flags.writeable:
        return tensor
    if any(stride == 0 and n > 1 for stride, n in zip(tensor.strides, tensor.shape)):
        return tensor  # elements share memory: refused by the collective, naming it
    try:  # an array made read-only over memory it may write (arr.flags.writeable = False)
        view = tensor.view()
        view.flags.writeable = True
    except ValueError:  # memory lent read-only (Ray's buffers): write through its address
        view = np.asarray(_Alias(tensor))
    _warn_once(op, name)
    return view


def writable_list(tensors: Any, op: str, name: str) -> Any:
    """:func:`writable` of each tensor of a list (anything else as it is)."""
    if not isinstance(tensors, list):
        return tensors
    out: List[Any] = [writable(t, op, f"{name}[{i}]") for i, t in enumerate(tensors)]
    return out
