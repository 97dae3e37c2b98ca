"""How each ReduceOp runs on NCCL, per dtype: an NCCL reduction, or a sum and an elementwise
step after it, or an all-gather and a local fold. Pure (no cupy, no GPU): unit-tested without
one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raycoll.reduce_op import ReduceOp

__all__ = ["ReducePlan", "reduce_plan", "AVG_MIN_VERSION"]

#: ``ncclAvg`` exists from NCCL 2.10 (version code 21000).
AVG_MIN_VERSION = 21000

_NCCL_TYPES = {
    "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16",
    "bfloat16": "NCCL_BFLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
    "bool": "NCCL_UINT8",
}
_COMPLEX_TYPES = {"complex64": "NCCL_FLOAT32", "complex128": "NCCL_FLOAT64"}
_FLOATS = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class ReducePlan:
    """How one ReduceOp on one dtype runs on NCCL (names of cupy.cuda.nccl constants)."""

    nccl_op: Optional[str]  # "NCCL_SUM", ...; None: no NCCL reduction (see ``fallback``)
    nccl_dtype: str  # "NCCL_FLOAT32", ...
    count_factor: int = 1  # NCCL elements per tensor element (2 for complex)
    post: Optional[str] = None  # "avg" | "premul": an elementwise step after the sum
    fallback: Optional[str] = None  # cupy ufunc reducing all-gathered copies ("bitwise_and")


def reduce_plan(op: ReduceOp, dtype: str, nccl_version: int) -> ReducePlan:
    """The plan for ``op`` on ``dtype``; ``TypeError`` when NCCL cannot reduce it."""
    name = op.name
    factor = 1
    if dtype in _COMPLEX_TYPES:
        if name not in ("SUM", "AVG", "PREMUL_SUM"):
            raise TypeError(f"op={op!r} is not supported on complex dtype {dtype} by NCCL "
                            "(SUM, AVG and PREMUL_SUM are)")
        nccl_dtype, factor, floating = _COMPLEX_TYPES[dtype], 2, True
    elif dtype in _NCCL_TYPES:
        nccl_dtype, floating = _NCCL_TYPES[dtype], dtype in _FLOATS
    else:
        raise TypeError(f"NCCL cannot reduce dtype {dtype}; reduce one of "
                        f"{sorted(_NCCL_TYPES) + sorted(_COMPLEX_TYPES)}")
    if name in ("BAND", "BOR", "BXOR"):
        if floating:
            raise TypeError(f"op={op!r} needs an integer or bool dtype, got {dtype}")
        if dtype == "bool" and name != "BXOR":
            return ReducePlan("NCCL_MIN" if name == "BAND" else "NCCL_MAX", nccl_dtype)
        ufunc = {"BAND": "bitwise_and", "BOR": "bitwise_or", "BXOR": "bitwise_xor"}[name]
        return ReducePlan(None, nccl_dtype, fallback=ufunc)
    if dtype == "bool":
        if name in ("AVG", "PREMUL_SUM"):
            raise TypeError(f"op={op!r} is not defined on bool tensors")
        return ReducePlan({"SUM": "NCCL_MAX", "PRODUCT": "NCCL_MIN", "MIN": "NCCL_MIN",
                           "MAX": "NCCL_MAX"}[name], nccl_dtype)
    if name == "AVG":
        if floating and nccl_version >= AVG_MIN_VERSION:
            return ReducePlan("NCCL_AVG", nccl_dtype, factor)
        return ReducePlan("NCCL_SUM", nccl_dtype, factor, post="avg")
    if name == "PREMUL_SUM":
        return ReducePlan("NCCL_SUM", nccl_dtype, factor, post="premul")
    direct = {"SUM": "NCCL_SUM", "PRODUCT": "NCCL_PROD", "MIN": "NCCL_MIN", "MAX": "NCCL_MAX"}
    if name not in direct:
        raise TypeError(f"op={op!r} is not supported by the NCCL backend")
    return ReducePlan(direct[name], nccl_dtype, factor)

