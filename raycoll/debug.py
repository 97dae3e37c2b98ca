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
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Iterable, Optional

__all__ = ["logger", "DEBUG_ENV", "debug_enabled", "configure_from_env", "message_bytes",
           "trace"]

logger = logging.getLogger("raycoll")

#: The environment variable that turns the collective trace on (any value but "" and "0").
DEBUG_ENV = "RAYCOLL_DEBUG"

_HANDLER_NAME = "raycoll-debug"


def debug_enabled() -> bool:
    """True when ``RAYCOLL_DEBUG`` is set to something other than ``""`` or ``"0"``."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def configure_from_env() -> bool:
    """Make the trace visible when ``RAYCOLL_DEBUG`` is set; returns whether it is.

    Sets the ``raycoll`` logger to ``DEBUG`` and adds one stderr handler unless a handler
    already sees its records (one on ``raycoll`` or an ancestor, e.g. the root logger after
    ``logging.basicConfig``: then those handlers show the trace, once). Idempotent.
    """
    if not debug_enabled():
        return False
    logger.setLevel(logging.DEBUG)
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(_HANDLER_NAME)
        handler.setLevel(logging.DEBUG)
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s pid=%(process)d: %(message)s"))
        logger.addHandler(handler)
    return True


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
