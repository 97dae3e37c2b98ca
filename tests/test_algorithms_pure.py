"""The pure pieces of raycoll.algorithms, without Ray: chunk boundaries, flat views, segment
splits, copies and reductions of segments."""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import pytest

from raycoll.algorithms.flat import (
    array_meta,
    chunk_bounds,
    copy_into,
    flat_in,
    flat_out,
    reduce_into,
    reduce_received,
    spans,
    split,
)
from raycoll.reduce_op import ReduceOp


@pytest.mark.parametrize("n", [0, 1, 5, 7, 64, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_chunk_bounds_cover_n_in_near_equal_contiguous_chunks(n: int, parts: int) -> None:
    bounds = chunk_bounds(n, parts)
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == n
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger chunks come first


def test_chunk_bounds_give_the_first_chunks_the_extra_elements() -> None:
    assert chunk_bounds(10, 4) == [0, 3, 6, 8, 10]


@pytest.mark.parametrize("parts", [0, -1])
def test_chunk_bounds_refuse_a_part_count_that_is_not_positive(parts: int) -> None:
    with pytest.raises(ValueError, match="parts must be positive"):
        chunk_bounds(10, parts)


def test_split_gives_views_of_at_most_segment_bytes_and_spans_locate_them() -> None:
    flat = np.arange(10, dtype=np.int32)
    segs = split(flat, 12)  # 3 elements per segment
    assert [s.size for s in segs] == [3, 3, 3, 1]
    assert all(np.shares_memory(s, flat) for s in segs)
    assert [(lo, hi) for lo, hi, _ in spans(segs)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert len(split(flat, 1 << 20)) == 1 and len(split(flat, 1)) == 10


def test_flat_in_is_a_view_when_contiguous_and_a_copy_otherwise() -> None:
    a = np.arange(12.0).reshape(3, 4)
    assert np.shares_memory(flat_in(a), a)
    t = a.T
    f = flat_in(t)
    assert not np.shares_memory(f, a) and np.array_equal(f, t.reshape(-1))


def test_flat_out_writes_back_into_a_non_contiguous_array() -> None:
    a = np.zeros((4, 6))
    view = a[:, ::2]  # not contiguous
    with flat_out(view) as flat:
        flat[:] = np.arange(flat.size)
    assert np.array_equal(view, np.arange(12.0).reshape(4, 3))
    assert np.array_equal(a[:, 1::2], np.zeros((4, 3)))  # the other columns untouched


def test_copy_into_concatenates_segments_into_any_shape() -> None:
    src = np.arange(12, dtype=np.int64)
    dst = np.empty((3, 4), dtype=np.int64)
    copy_into(dst, split(src, 40))  # 5 elements per segment
    assert np.array_equal(dst, src.reshape(3, 4))
    out = np.zeros((4, 6), dtype=np.int64)
    copy_into(out[:, ::2], split(src, 16))
    assert np.array_equal(out[:, ::2], src.reshape(4, 3))


def test_reduce_into_reduces_segment_by_segment_with_and_without_a_first_term() -> None:
    out = np.ones(7)
    other = np.arange(7.0)
    reduce_into(ReduceOp.SUM, out, split(other, 24))
    assert np.array_equal(out, 1 + other)
    first = np.full(7, 10.0)
    reduce_into(ReduceOp.MAX, out, split(np.full(7, 5.0), 16), first)
    assert np.array_equal(out, np.full(7, 10.0))


def test_reduce_received_matches_numpy_in_rank_order_and_finishes_avg() -> None:
    rng = np.random.default_rng(0)
    own = rng.standard_normal(9)
    received: Dict[int, List[np.ndarray]] = {s: split(rng.standard_normal(9), 16)
                                             for s in (2, 1)}
    out = np.empty(9)
    reduce_received(ReduceOp.AVG, out, own, received, size=3)
    expected = (own + np.concatenate(received[1]) + np.concatenate(received[2])) / 3
    np.testing.assert_allclose(out, expected)
    # in place: the output is the rank's own buffer
    buf = own.copy()
    reduce_received(ReduceOp.SUM, buf, buf, received, size=3)
    np.testing.assert_allclose(buf, expected * 3)


def test_array_meta_names_dtype_and_shape() -> None:
    assert array_meta(np.zeros((2, 3), dtype=np.float32)) == ("float32", (2, 3))
