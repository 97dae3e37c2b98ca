"""``ray.util.collective.types`` for the drop-in: ``Backend`` and ``ReduceOp``, as Ray has them.

``ReduceOp`` has Ray's members and values (``SUM``, ``PRODUCT``, ``MIN``, ``MAX``); the
drop-in's collectives also take Ray's own ``ReduceOp`` and :class:`raycoll.ReduceOp` (which
adds ``AVG`` and the bitwise ops). ``Backend(name)`` normalises a backend name as Ray does
(``"torch_gloo"`` is ``Backend.GLOO``); which raycoll backend each name maps to is
:data:`raycoll.util.collective.BACKENDS`.
"""

from __future__ import annotations

import importlib.util
from enum import Enum

__all__ = ["Backend", "ReduceOp", "torch_available", "cupy_available"]


class Backend:
    """Ray's backend names: ``Backend.NCCL == "NCCL"``, ``Backend.GLOO == "GLOO"``;
    ``Backend("torch_gloo")`` is ``"GLOO"``, an unknown name raises ValueError."""

    NCCL = "NCCL"
    GLOO = "GLOO"
    UNRECOGNIZED = "unrecognized"

    def __new__(cls, name: str) -> str:  # type: ignore[misc]
        upper = str(name).upper()
        if upper == "TORCH_GLOO":
            return cls.GLOO
        if upper in (cls.NCCL, cls.GLOO):
            return upper
        raise ValueError(f"Unrecognized backend: {name!r}. Only NCCL and GLOO are supported "
                         "(raycoll.util.collective also takes raycoll's backend strings, such "
                         "as 'objstore' or 'cpu:objstore,cuda:nccl', where a backend is asked)")


class ReduceOp(Enum):
    """Ray's ``ReduceOp``: ``SUM``, ``PRODUCT``, ``MIN``, ``MAX`` (same values as Ray's)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3


def torch_available() -> bool:
    """Whether torch can be imported here (Ray's ``types.torch_available``)."""
    return importlib.util.find_spec("torch") is not None


def cupy_available() -> bool:
    """Whether cupy can be imported here (Ray's ``types.cupy_available``)."""
    return importlib.util.find_spec("cupy") is not None
