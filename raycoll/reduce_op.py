"""``ReduceOp`` and how each op reduces numpy arrays (pure numpy, no Ray).

The ops are those of ``torch.distributed.ReduceOp``. ``PREMUL_SUM`` is, as in c10d, a factory:
``ReduceOp.PREMUL_SUM(factor)`` makes an op that sums ``factor * x`` over ranks.

``raycoll.reduce_op`` is this module, and so also stands where torch's deprecated
``reduce_op`` class does: ``raycoll.reduce_op.SUM`` (``PRODUCT``, ``MIN``, ``MAX``) is
``ReduceOp.SUM``, with torch's deprecation warning.
"""

from __future__ import annotations

import warnings

from typing import Any, ClassVar, Optional, Tuple

import numpy as np

from raycoll.errors import UnsupportedOpError

__all__ = ["ReduceOp", "check_op_dtype", "supports_complex", "combine", "combine_into",
           "finalize", "reduce_arrays"]


class ReduceOp:
    """A reduction operation for ``all_reduce``, ``reduce``, ``reduce_scatter``.

    Compare with ``==``; ``ReduceOp.SUM``, ``ReduceOp.AVG``, ... are the instances to use.
    """

    SUM: ClassVar["ReduceOp"]
    PRODUCT: ClassVar["ReduceOp"]
    MIN: ClassVar["ReduceOp"]
    MAX: ClassVar["ReduceOp"]
    BAND: ClassVar["ReduceOp"]
    BOR: ClassVar["ReduceOp"]
    BXOR: ClassVar["ReduceOp"]
    AVG: ClassVar["ReduceOp"]
    PREMUL_SUM: ClassVar["_PremulSum"]

    __slots__ = ("name", "factor")
    name: str
    factor: Optional[float]

    def __init__(self, name: Any, factor: Optional[float] = None) -> None:
        if isinstance(name, ReduceOp):  # ReduceOp(ReduceOp.SUM), as torch's constructor takes
            name, factor = name.name, name.factor if factor is None else factor
        if not isinstance(name, str):
            raise TypeError(f"ReduceOp(name): name must be a str or a ReduceOp, got {name!r}")
        self.name = name
        self.factor = factor

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ReduceOp):
            return (self.name, self.factor) == (other.name, other.factor)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.name, self.factor))

    def __repr__(self) -> str:
        if self.factor is not None:
            return f"ReduceOp.PREMUL_SUM({self.factor!r})"
        return f"ReduceOp.{self.name}"

    def __reduce__(self) -> Tuple[Any, ...]:
        return (ReduceOp, (self.name, self.factor))

    @property
    def key(self) -> Tuple[str, Optional[float]]:
        """A plain, picklable identity used in fingerprints."""
        return (self.name, self.factor)


class _PremulSum(ReduceOp):
    """``ReduceOp.PREMUL_SUM``: call it with the factor to get a usable op."""

    def __init__(self) -> None:
        super().__init__("PREMUL_SUM", None)

    def __call__(self, factor: Any) -> ReduceOp:
        return ReduceOp("PREMUL_SUM", _factor(factor))

    def __reduce__(self) -> Tuple[Any, ...]:
        return (_PremulSum, ())


ReduceOp.SUM = ReduceOp("SUM")
ReduceOp.PRODUCT = ReduceOp("PRODUCT")
ReduceOp.MIN = ReduceOp("MIN")
ReduceOp.MAX = ReduceOp("MAX")
ReduceOp.BAND = ReduceOp("BAND")
ReduceOp.BOR = ReduceOp("BOR")
ReduceOp.BXOR = ReduceOp("BXOR")
ReduceOp.AVG = ReduceOp("AVG")
ReduceOp.PREMUL_SUM = _PremulSum()


class _RedOpType:
    """``ReduceOp.RedOpType``: torch's enum of the ops, here the same ``ReduceOp`` values."""

    SUM = ReduceOp.SUM
    AVG = ReduceOp.AVG
    PRODUCT = ReduceOp.PRODUCT
    MIN = ReduceOp.MIN
    MAX = ReduceOp.MAX
    BAND = ReduceOp.BAND
    BOR = ReduceOp.BOR
    BXOR = ReduceOp.BXOR
    PREMUL_SUM = ReduceOp.PREMUL_SUM


ReduceOp.RedOpType = _RedOpType  # type: ignore[attr-defined]

_NAMES = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM")


def __getattr__(name: str) -> ReduceOp:
    """torch's deprecated ``reduce_op.SUM`` (``PRODUCT``, ``MIN``, ``MAX``)."""
    if name in ("SUM", "PRODUCT", "MIN", "MAX"):
        warnings.warn("raycoll.reduce_op is deprecated (as torch.distributed.reduce_op is), "
                      "please use raycoll.ReduceOp instead", FutureWarning, stacklevel=2)
        op: ReduceOp = getattr(ReduceOp, name)
        return op
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_UFUNC = {
    "SUM": np.add,
    "AVG": np.add,
    "PREMUL_SUM": np.add,
    "PRODUCT": np.multiply,
    "MIN": np.minimum,
    "MAX": np.maximum,
    "BAND": np.bitwise_and,
    "BOR": np.bitwise_or,
    "BXOR": np.bitwise_xor,
}


def _factor(value: Any) -> float:
    try:
        return float(np.asarray(value.item() if hasattr(value, "item") else value))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"a PREMUL_SUM factor must be one number (a float or a one-element "
                         f"tensor), got {value!r}") from exc


def as_reduce_op(op: Any) -> ReduceOp:
    """Accept a ``ReduceOp``, a torch ``ReduceOp`` (an enum value such as
    ``torch.distributed.ReduceOp.SUM`` or a ``RedOpType`` member, a ``ReduceOp(...)``
    instance, a premul-sum made by ``torch.distributed._make_nccl_premul_sum(factor)``) or an
    op's name; reject anything else."""
    if isinstance(op, _PremulSum):
        raise ValueError(
            "op=ReduceOp.PREMUL_SUM needs a factor: pass ReduceOp.PREMUL_SUM(factor)"
        )
    if isinstance(op, ReduceOp):
        return op
    inner = getattr(op, "op", None)  # a torch.distributed.ReduceOp instance wraps a RedOpType
    kind = inner if isinstance(getattr(inner, "name", None), str) else op
    name = getattr(kind, "name", kind)
    if isinstance(name, str) and name.upper() == "PREMUL_SUM":
        try:
            factor = getattr(op, "factor", None) if kind is not op else None
        except RuntimeError:  # torch: "Only PREMUL_SUM supports accessing factor"
            factor = None
        if factor is None:
            raise ValueError(f"op={op!r} (PREMUL_SUM) needs a factor: pass "
                             "ReduceOp.PREMUL_SUM(factor) (or torch's _make_nccl_premul_sum)")
        return ReduceOp("PREMUL_SUM", _factor(factor))
    if isinstance(name, str) and name.upper() in _NAMES:
        return ReduceOp(name.upper())
    raise TypeError(f"op must be a raycoll.ReduceOp (e.g. ReduceOp.SUM) or a "
                    f"torch.distributed.ReduceOp, got {op!r}")


def check_op_dtype(op: ReduceOp, dtype: np.dtype) -> None:
    """Raise ``UnsupportedOpError`` (a ``ValueError`` and a ``TypeError``) if ``op`` is not
    defined on ``dtype``."""
    kind = dtype.kind
    if op.name in ("BAND", "BOR", "BXOR") and kind not in "biu":
        raise UnsupportedOpError(f"op={op!r} needs an integer or bool dtype, got {dtype}")
    if op.name in ("MIN", "MAX") and kind == "c":
        raise UnsupportedOpError(f"op={op!r} is not supported on complex tensors "
                                 f"(dtype {dtype}); torch refuses it too")
    if op.name in ("AVG", "PREMUL_SUM") and kind == "b":
        raise UnsupportedOpError(f"op={op!r} is not defined on bool tensors")
    if kind not in "biufc":
        raise UnsupportedOpError(f"cannot reduce dtype {dtype}: numeric or bool dtypes only")


def supports_complex(reduceOp: Any) -> bool:  # noqa: N803 - torch's name
    """Whether raycoll's collectives reduce complex tensors with ``reduceOp`` (a raycoll or
    torch ``ReduceOp``): SUM, AVG, PREMUL_SUM and PRODUCT (numpy multiplies complex numbers;
    torch refuses PRODUCT), not MIN, MAX or the bitwise ops. Read from the check the
    collectives make (:func:`check_op_dtype`), so the two never disagree."""
    try:
        op = as_reduce_op(reduceOp)
    except ValueError:  # PREMUL_SUM without its factor: still that op
        op = ReduceOp("PREMUL_SUM", 1.0)
    try:
        check_op_dtype(op, np.dtype(np.complex128))
    except UnsupportedOpError:
        return False
    return True


def combine(op: ReduceOp, out: np.ndarray, other: np.ndarray) -> None:
    """``out = out (op) other``, in place, elementwise."""
    _UFUNC[op.name](out, other, out=out)


def combine_into(op: ReduceOp, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """``out = a (op) b``, elementwise, in one pass over memory (``out`` may be ``a`` or ``b``)."""
    _UFUNC[op.name](a, b, out=out)


def finalize(op: ReduceOp, out: np.ndarray, world_size: int) -> None:
    """Apply what an op does after the elementwise reduction (AVG's division, PREMUL's factor)."""
    if op.name == "AVG" and world_size > 1:
        if out.dtype.kind in "fc":
            np.divide(out, world_size, out=out)
        else:  # integer average truncates, as NCCL's ncclAvg does
            np.copyto(out, np.trunc(out / world_size), casting="unsafe")
    elif op.name == "PREMUL_SUM":
        factor = op.factor if op.factor is not None else 1.0
        if out.dtype.kind in "fc":
            np.multiply(out, factor, out=out, casting="unsafe")
        else:
            np.copyto(out, out * factor, casting="unsafe")


def reduce_arrays(op: ReduceOp, arrays: "list[np.ndarray]") -> np.ndarray:
    """Reduce a list of same-shaped arrays into a new array (used for small inline payloads)."""
    out = np.array(arrays[0], copy=True)
    for a in arrays[1:]:
        combine(op, out, a)
    finalize(op, out, len(arrays))
    return out
