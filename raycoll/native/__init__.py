"""raycoll's native core: the compiled executor of the CPU data plane.

Python plans, native code moves bytes. :mod:`raycoll.native._core` (C, built by
``pip install -e .`` with the platform's C compiler: ``setup.py``) holds

- the node segment (``segment.h`` states its shared-memory layout and protocol; ``segment.c``
  creates, maps, publishes, waits and runs a plan's operations with the GIL released);
- the reductions (``reduce.c``): every dtype and ``ReduceOp`` raycoll has, with numpy's
  semantics;
- the pair pipes (``pipe.h`` states their layout and protocol; ``pipe.c``): point-to-point
  messages between two ranks of a node in shared memory, large ones read across processes
  (:mod:`raycoll.transport.pipes` matches them to receives);
- the binding (``module.c``, ``pipemodule.c``), which only parses arguments and takes
  buffers.

Where the extension is absent (no compiler at install time) or turned off
(``RAYCOLL_NATIVE=0``), raycoll's CPU collectives go through the Ray object store instead,
the one fallback, with the same semantics, and point-to-point over Python sockets:
:func:`native_available` says which, :func:`native_status` why.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Dict, Optional, Tuple

import numpy as np

__all__ = ["native_available", "native_status", "core", "DTYPE_CODES", "OP_CODES", "dtype_code",
           "op_code", "CONN_DTYPE"]

#: Set to ``0`` to run without the native core (the object store's fallback), e.g. to compare.
ENV = "RAYCOLL_NATIVE"

core: Any = None
_why: str = ""


def _load() -> Tuple[Any, str]:
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None, f"turned off by {ENV}={os.environ[ENV]}"
    try:
        _core = importlib.import_module("raycoll.native._core")
    except ImportError as exc:
        return None, (f"the extension raycoll.native._core is not built ({exc}); reinstall "
                      "with a C compiler present (pip install -e .)")
    return _core, "in use"


core, _why = _load()
if core is not None:
    from raycoll import errors as _errors

    #: A check that raises one of these ends a run softly: the group goes on where the
    #: executor found the ranks' steps and streams whole (raycoll/native/core.h).
    SOFT_ERRORS = (_errors.PeerArgumentError, _errors.CollectiveMismatchError)
    core.set_soft_errors(SOFT_ERRORS)


def native_available() -> bool:
    """Whether raycoll's native core is in use in this process."""
    return core is not None


def native_status() -> str:
    """Why the native core is (or is not) in use: ``"in use"``, or the reason it is not."""
    return _why


#: numpy dtype -> the native dtype code (reduce.h's RC_DT_*); bfloat16 has no numpy dtype:
#: its code is ``DTYPE_CODES["bfloat16"]``.
DTYPE_CODES: Dict[Any, int] = {}
for _i, _name in enumerate(("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32",
                            "int64", "uint64", "float16", "bfloat16", "float32", "float64",
                            "longdouble", "complex64", "complex128")):
    if _name == "bfloat16":
        DTYPE_CODES[_name] = _i
    else:
        DTYPE_CODES[np.dtype(_name)] = _i
        DTYPE_CODES[_name] = _i
# a dtype whose byte order is not the machine's has no code: its reductions stay in numpy

#: A peer's connection state as the core keeps it between runs (net.h's ``rc_conn``), one
#: per peer slot in a buffer its caller owns: a header read ahead, whether the core shut
#: either connection, waits whose spin ran out on it, and what moved (payload bytes and whole
#: messages, each way, ever).
CONN_DTYPE = np.dtype([("held", "<u4"), ("spin_fails", "<u4"), ("msg", "V32"),
                       ("in_cut", "<u4"), ("out_cut", "<u4"), ("sent", "<u8"),
                       ("received", "<u8"), ("msgs_sent", "<u4"), ("msgs_received", "<u4")])
if core is not None and CONN_DTYPE.itemsize != core.CONN_BYTES:  # pragma: no cover - a bug
    raise ImportError(f"CONN_DTYPE is {CONN_DTYPE.itemsize} bytes, rc_conn {core.CONN_BYTES}")

#: ``ReduceOp`` name -> the native op code (reduce.h's RC_RED_*).
OP_CODES: Dict[str, int] = {name: i for i, name in enumerate(
    ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM"))}


def dtype_code(dtype: Any) -> Optional[int]:
    """The native code of a numpy dtype (or ``"bfloat16"``), or ``None`` if it has none."""
    try:
        return DTYPE_CODES.get(dtype)
    except TypeError:  # unhashable
        return None


def op_code(name: str) -> int:
    """The native code of a ``ReduceOp`` name."""
    return OP_CODES[name]
