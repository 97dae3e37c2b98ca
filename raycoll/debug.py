"""Logging for raycoll: the ``raycoll`` logger and the ``RAYCOLL_DEBUG`` collective trace.

raycoll never prints: everything goes through ``logging.getLogger("raycoll")``, which a user
configures like any other library logger (``logging.basicConfig(level=logging.DEBUG)``, or a
handler on ``"raycoll"``).

Setting ``RAYCOLL_DEBUG=1`` in a process's environment before raycoll is imported there
(inside Ray actors: ``runtime_env={"env_vars": {"RAYCOLL_DEBUG": "1"}}``, or export it before
``ray.init()`` starts the local cluster, whose workers inherit it) turns on a trace of every
collective and point-to-point operation, at ``DEBUG`` on the ``raycoll`` logger::

    raycoll trace rank=1 group=dp op=all_reduce seq=7 bytes=4096 time=0.812ms status=ok

and makes it visible: the logger's level is set to ``DEBUG`` and, unless a handler already
receives its records (on ``raycoll`` or the root logger), a stream handler to stderr is added
(Ray forwards actors' stderr to the driver).
Each trace record also carries the fields as ``record.raycoll_trace`` (a dict with ``rank``,
``group``, ``op``, ``seq``, ``bytes``, ``time_ms``, ``status``) for handlers that want them.
``bytes`` is what the operation writes into this rank's tensors (its output buffers; what a
send sends), ``None`` for object collectives. With the variable unset the trace costs one
boolean test per operation.

torch's debug levels (:class:`DebugLevel`, :func:`get_debug_level`) come from torch's
``TORCH_DISTRIBUTED_DEBUG`` (``OFF``, ``INFO``, ``DETAIL``) and from raycoll's own setting
(``RAYCOLL_DEBUG`` counts as ``DETAIL``), the higher of the two. ``DETAIL`` turns the trace
on, as ``RAYCOLL_DEBUG`` does; ``INFO`` makes the ``raycoll`` logger's ``INFO`` records
visible (a stderr handler as above, unless one already receives them); ``OFF`` changes
nothing. raycoll's cross-rank checks (what torch's ``DETAIL`` adds to its backends:
shapes, dtypes, ops and roots compared across ranks, missing ranks named) are always on.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import sys
from typing import Any, Iterable, Iterator, Optional

__all__ = ["logger", "DEBUG_ENV", "TORCH_DEBUG_ENV", "DebugLevel", "get_debug_level",
           "debug_enabled", "configure_from_env", "message_bytes", "trace", "record_comm"]

logger = logging.getLogger("raycoll")

#: The environment variable that turns the collective trace on (any value but "" and "0").
DEBUG_ENV = "RAYCOLL_DEBUG"

#: torch's debug-level variable (``OFF``, ``INFO``, ``DETAIL``), read by raycoll too.
TORCH_DEBUG_ENV = "TORCH_DISTRIBUTED_DEBUG"

_HANDLER_NAME = "raycoll-debug"


class DebugLevel(enum.IntEnum):
    """torch's ``DebugLevel``: ``OFF``, ``INFO``, ``DETAIL`` (see :func:`get_debug_level`)."""

    OFF = 0
    INFO = 1
    DETAIL = 2


def _torch_level(strict: bool) -> DebugLevel:
    text = os.environ.get(TORCH_DEBUG_ENV, "OFF").strip().upper() or "OFF"
    if text not in DebugLevel.__members__:
        if strict:
            raise ValueError(f"{TORCH_DEBUG_ENV} must be OFF, INFO or DETAIL, got "
                             f"{os.environ.get(TORCH_DEBUG_ENV)!r}")
        return DebugLevel.OFF
    return DebugLevel[text]


def _level(strict: bool) -> DebugLevel:
    ours = DebugLevel.DETAIL if os.environ.get(DEBUG_ENV, "") not in ("", "0") else DebugLevel.OFF
    return max(ours, _torch_level(strict))


def get_debug_level() -> DebugLevel:
    """The debug level now: the higher of torch's ``TORCH_DISTRIBUTED_DEBUG`` (``OFF``,
    ``INFO``, ``DETAIL``; anything else raises ``ValueError``) and raycoll's own
    (``RAYCOLL_DEBUG`` set: ``DETAIL``). What each level changes: see the module docstring
    (groups read it when they form, the logger when raycoll is imported)."""
    return _level(strict=True)


def debug_enabled() -> bool:
    """True when the trace is on: ``RAYCOLL_DEBUG`` is set to something other than ``""`` or
    ``"0"``, or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``."""
    return _level(strict=False) >= DebugLevel.DETAIL


@contextlib.contextmanager
def record_comm(name: str) -> Iterator[None]:
    """torch's profiling title for the collectives issued inside the block. raycoll's
    collectives carry no profiler titles (its trace names each operation itself), so the
    name is checked and otherwise has no effect."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}: {name!r:.80}")
    yield


def configure_from_env() -> bool:
    """Make the trace visible when it is on (see :func:`debug_enabled`); returns whether it is.
    At ``INFO`` (:func:`get_debug_level`), the ``INFO`` records only.

    Sets the ``raycoll`` logger to ``DEBUG`` (``INFO``) and adds one stderr handler unless a
    handler already sees its records (one on ``raycoll`` or an ancestor, e.g. the root logger
    after ``logging.basicConfig``: then those handlers show the trace, once). Idempotent.
    """
    level = _level(strict=False)
    if level == DebugLevel.OFF:
        return False
    wanted = logging.DEBUG if level >= DebugLevel.DETAIL else logging.INFO
    if logger.level == logging.NOTSET or logger.level > wanted:
        logger.setLevel(wanted)
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(_HANDLER_NAME)
        handler.setLevel(wanted)
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s pid=%(process)d: %(message)s"))
        logger.addHandler(handler)
    return level >= DebugLevel.DETAIL


def message_bytes(outputs: Optional[Iterable[Any]]) -> Optional[int]:
    """The bytes of the tensors in ``outputs`` (``None`` when there are none to count)."""
    if outputs is None:
        return None
    from raycoll.tensors import describe

    total = 0
    for tensor in outputs:
        try:
            total += describe(tensor).nbytes
        except TypeError:  # not a tensor: the operation will reject it
            return None
    return total


def trace(*, rank: int, group: str, op: str, seq: Optional[int], nbytes: Optional[int],
          seconds: float, error: Optional[BaseException] = None) -> None:
    """Log one operation's trace record at ``DEBUG`` on the ``raycoll`` logger."""
    fields = {"rank": rank, "group": group, "op": op, "seq": seq, "bytes": nbytes,
              "time_ms": seconds * 1e3,
              "status": "ok" if error is None else type(error).__name__}
    logger.debug(
        "raycoll trace rank=%d group=%s op=%s seq=%s bytes=%s time=%.3fms status=%s",
        rank, group, op, "-" if seq is None else seq, "-" if nbytes is None else nbytes,
        seconds * 1e3, fields["status"], extra={"raycoll_trace": fields})


configure_from_env()
