"""Shared test data: deterministic per-rank arrays and numpy references."""

from __future__ import annotations

from typing import Any, Sequence, Tuple

import numpy as np

DTYPES = ("int32", "int64", "float32", "float64", "bool", "complex64")

OPS_BY_KIND = {
    "i": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"),
    "f": ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"),
    "b": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
    "c": ("SUM", "PRODUCT", "AVG"),
}


def data(rank: int, shape: Any, dtype: str, salt: int = 0) -> np.ndarray:
    """The deterministic input of ``rank``."""
    rng = np.random.default_rng(1000 * salt + rank + 1)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.random(shape) > 0.5
    if dt.kind in "iu":
        return rng.integers(-4, 5, shape).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    return rng.standard_normal(shape).astype(dt)


def op_of(name: str) -> Any:
    import raycoll

    return raycoll.ReduceOp.PREMUL_SUM(2.0) if name == "PREMUL_SUM" else getattr(raycoll.ReduceOp, name)


def reference(op: str, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """What reducing ``arrays`` with ``op`` must give."""
    ufunc = {"SUM": np.add, "AVG": np.add, "PREMUL_SUM": np.add, "PRODUCT": np.multiply,
             "MIN": np.minimum, "MAX": np.maximum, "BAND": np.bitwise_and,
             "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
    out = arrays[0].copy()
    for a in arrays[1:]:
        out = ufunc(out, a).astype(out.dtype)
    if op == "AVG":
        out = (out / len(arrays)).astype(out.dtype) if out.dtype.kind in "fc" else \
            np.trunc(out / len(arrays)).astype(out.dtype)
    if op == "PREMUL_SUM":
        out = (out * 2.0).astype(out.dtype)
    return out


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if want.dtype.kind in "fc":
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def cases(sizes: Sequence[int]) -> Tuple[Tuple[str, str, int], ...]:
    return tuple((dt, op, n) for dt in DTYPES for op in OPS_BY_KIND[np.dtype(dt).kind]
                 for n in sizes)


def store_used() -> Tuple[int, int]:
    """Object-store bytes in use and object count, summed over the cluster's nodes."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.object_store_bytes_used), int(reply.store_stats.num_local_objects)


def soak_module() -> Any:
    """``benchmarks/soak.py`` as a module whose functions travel to the ranks by value."""
    import importlib.util
    import sys
    from pathlib import Path

    import ray

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("raycoll_soak", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["raycoll_soak"] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # the ranks cannot import benchmarks/
    return module
