"""Flat views of numpy arrays, copies and reductions of *segments* (the flat pieces an array
travels in), and chunk boundaries: the pure array pieces the CPU algorithms share
(:mod:`raycoll.algorithms.direct`, :mod:`raycoll.algorithms.store`)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from raycoll.reduce_op import ReduceOp, combine, finalize
from raycoll.reduce_op import combine_into as _combine_into
from raycoll.tensors import dtype_name

__all__ = ["Segments", "chunk_bounds", "array_meta", "flat_out", "flat_in", "split", "spans", "copy_into",
           "reduce_into", "reduce_received"]

#: A received piece: flat segments that, concatenated, are the sender's array.
Segments = List[np.ndarray]


def array_meta(arr: np.ndarray) -> Any:
    """What a receiver checks an array against: its dtype's name and its shape."""
    return (dtype_name(arr.dtype), tuple(arr.shape))


@contextmanager
def flat_out(arr: np.ndarray) -> Iterator[np.ndarray]:
    """A flat, writable, contiguous view of ``arr`` (via a temporary copied back if needed)."""
    if arr.flags.c_contiguous:
        yield arr.reshape(-1)
        return
    tmp = np.ascontiguousarray(arr)
    yield tmp.reshape(-1)
    np.copyto(arr, tmp.reshape(arr.shape))


def flat_in(arr: np.ndarray) -> np.ndarray:
    """``arr`` flat and contiguous (a view when it already is, else a copy)."""
    return np.ascontiguousarray(arr).reshape(-1)


def split(flat: np.ndarray, segment_bytes: int) -> Segments:
    """Views of ``flat`` of at most ``segment_bytes`` each (at least one)."""
    step = max(1, segment_bytes // max(1, flat.itemsize))
    if flat.size <= step:
        return [flat]
    return [flat[i:i + step] for i in range(0, flat.size, step)]


def spans(segs: Segments) -> Iterator[Tuple[int, int, np.ndarray]]:
    offset = 0
    for seg in segs:
        yield offset, offset + seg.size, seg
        offset += seg.size


def copy_into(dst: np.ndarray, segs: Segments) -> None:
    """Copy the concatenated ``segs`` into ``dst`` (any shape, contiguous or not)."""
    if len(segs) == 1 and np.shares_memory(dst, segs[0]):
        return
    with flat_out(dst) as flat:
        for lo, hi, seg in spans(segs):
            np.copyto(flat[lo:hi], seg)


def reduce_into(op: ReduceOp, out: np.ndarray, segs: Segments,
                 first: Optional[np.ndarray] = None) -> None:
    """``out = out (op) segs``; or, with ``first``, ``out = first (op) segs`` in one pass."""
    for lo, hi, seg in spans(segs):
        if first is None:
            combine(op, out[lo:hi], seg)
        else:
            _combine_into(op, out[lo:hi], first[lo:hi], seg)


def reduce_received(op: ReduceOp, out: np.ndarray, own: np.ndarray,
                    received: Dict[int, Segments], size: int) -> None:
    """``out = own (op) received[s] ...`` (sources in rank order), in one pass per term, then
    ``op``'s finishing step for ``size`` ranks."""
    own = flat_in(own)
    first: Optional[np.ndarray] = None if np.shares_memory(out, own) else own
    for s in sorted(received):
        reduce_into(op, out, received[s], first)
        first = None
    if first is not None:
        np.copyto(out, first)
    finalize(op, out, size)


def chunk_bounds(n: int, parts: int) -> List[int]:
    """``parts + 1`` offsets splitting ``n`` elements into near-equal contiguous chunks.

    The first ``n % parts`` chunks get one element more, so sizes differ by at most one.
    """
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds
