"""The Options types of the ``ProcessGroup`` object API: torch's ``AllreduceOptions`` and kin.

Small dataclasses with torch's field names and defaults, set as torch's are, attribute by
attribute (``opts = AllreduceOptions(); opts.reduceOp = ReduceOp.MAX``) or as keywords.
Every assignment is type-checked: an unknown field raises ``AttributeError`` listing the
fields, a value of the wrong type ``TypeError`` naming the field, what it takes and what came.
Ranges (a root rank in the group, a root tensor in the list) are the call's to check, as in
torch: ``opts.rootRank = -1`` is taken, ``pg.broadcast([t], opts)`` refuses it.

``timeout`` defaults to torch's "unset" value (``timedelta(milliseconds=-1)``): the group's
timeout applies. A set one bounds that one call (see :func:`call_timeout`).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional

from raycoll.reduce_op import ReduceOp, as_reduce_op

__all__ = ["AllreduceOptions", "AllreduceCoalescedOptions", "AllToAllOptions", "BarrierOptions",
           "AllgatherOptions",
           "BroadcastOptions", "GatherOptions", "ReduceOptions", "ReduceScatterOptions",
           "ScatterOptions", "UNSET_TIMEOUT", "timeout_s", "call_timeout", "call_timeout_s"]

#: torch's ``kUnsetTimeout``: the options' default timeout, meaning "the group's".
UNSET_TIMEOUT = timedelta(milliseconds=-1)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {value!r:.80}")
    return value


def _rank(value: Any, name: str) -> int:
    """An int; its range is checked by the call that reads it (as torch's: a negative
    ``rootRank`` is taken here and refused by ``pg.broadcast``)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r:.80}")
    return int(value)


def _timeout(value: Any, name: str) -> timedelta:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta):
        raise TypeError(f"{name} must be a datetime.timedelta (or seconds), got "
                        f"{type(value).__name__}: {value!r:.80}")
    if value <= timedelta(0) and value != UNSET_TIMEOUT:
        raise ValueError(f"{name} must be positive (or the unset default "
                         f"{UNSET_TIMEOUT!r}), got {value!r}")
    return value


def _op(value: Any, name: str) -> ReduceOp:
    try:
        return as_reduce_op(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


def _device_ids(value: Any, name: str) -> List[int]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of int, got {type(value).__name__}: "
                        f"{value!r:.80}")
    return [_rank(v, f"{name}[{i}]") for i, v in enumerate(value)]


def _any(value: Any, name: str) -> Any:
    return value


#: Each field's check (and conversion), by field name.
_CHECKS: Dict[str, Callable[[Any, str], Any]] = {
    "reduceOp": _op, "timeout": _timeout, "asyncOp": _bool, "rootRank": _rank,
    "rootTensor": _rank, "device_ids": _device_ids, "device": _any,
}


class _Options:
    """The base of the Options types: every assignment checked, unknown fields refused."""

    def __setattr__(self, name: str, value: Any) -> None:
        known = [f.name for f in fields(self)]  # type: ignore[arg-type]  # dataclasses below
        if name not in known:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}; its fields: "
                                 f"{', '.join(known)}")
        object.__setattr__(self, name, _CHECKS[name](value, f"{type(self).__name__}.{name}"))


@dataclass(eq=True)
class AllreduceOptions(_Options):
    """torch's ``AllreduceOptions``: the op, a per-call timeout, ``asyncOp``."""

    reduceOp: ReduceOp = ReduceOp.SUM
    timeout: timedelta = UNSET_TIMEOUT
    asyncOp: bool = True


@dataclass(eq=True)
class AllreduceCoalescedOptions(AllreduceOptions):
    """torch's ``AllreduceCoalescedOptions`` (the fields of :class:`AllreduceOptions`)."""


@dataclass(eq=True)
class BroadcastOptions(_Options):
    """torch's ``BroadcastOptions``: the root's rank in the group, the root tensor's index
    in the root's list (the tensor every tensor of every rank gets), a per-call timeout,
    ``asyncOp``."""

    rootRank: int = 0
    rootTensor: int = 0
    timeout: timedelta = UNSET_TIMEOUT
    asyncOp: bool = True


@dataclass(eq=True)
class ReduceOptions(_Options):
    """torch's ``ReduceOptions``: the op, the root's rank in the group, the root tensor's
    index (0), a per-call timeout, ``asyncOp``."""

    reduceOp: ReduceOp = ReduceOp.SUM
    rootRank: int = 0
    rootTensor: int = 0
    timeout: timedelta = UNSET_TIMEOUT
    asyncOp: bool = True


@dataclass(eq=True)
class AllgatherOptions(_Options):
    """torch's ``AllgatherOptions`` (not in c10d's ``__all__``): a per-call timeout."""

    timeout: timedelta = UNSET_TIMEOUT
    asyncOp: bool = True


@dataclass(eq=True)
class GatherOptions(_Options):
    """torch's ``GatherOptions``: the root's rank in the group, a per-call timeout."""

    rootRank: int = 0
    timeout: timedelta = UNSET_TIMEOUT
    asyncOp: bool = True


@dataclass(eq=True)
class ScatterOptions(_Options):
    """torch's ``ScatterOptions``: the root's rank in the group, a per-call timeout."""

    rootRank: int = 0
    timeout: timedelta = UNSET_TIMEOUT
    asyncOp: bool = True


@dataclass(eq=True)
class ReduceScatterOptions(_Options):
    """torch's ``ReduceScatterOptions``: the op, a per-call timeout, ``asyncOp``."""

    reduceOp: ReduceOp = ReduceOp.SUM
    timeout: timedelta = UNSET_TIMEOUT
    asyncOp: bool = True


@dataclass(eq=True)
class AllToAllOptions(_Options):
    """torch's ``AllToAllOptions``: a per-call timeout, ``asyncOp``."""

    timeout: timedelta = UNSET_TIMEOUT
    asyncOp: bool = True


@dataclass(eq=True)
class BarrierOptions(_Options):
    """torch's ``BarrierOptions``: ``device_ids`` and ``device`` (accepted; raycoll's barrier
    needs no device), a per-call timeout, ``asyncOp``."""

    device_ids: List[int] = field(default_factory=list)
    timeout: timedelta = UNSET_TIMEOUT
    device: Any = None
    asyncOp: bool = True


def timeout_s(opts: Any) -> Optional[float]:
    """The per-call timeout an Options object sets, in seconds; ``None`` when unset."""
    timeout = getattr(opts, "timeout", UNSET_TIMEOUT)
    return None if timeout == UNSET_TIMEOUT else float(timeout.total_seconds())


#: The timeout of the collectives this thread (context) issues now, if one was set.
_CALL_TIMEOUT: "contextvars.ContextVar[Optional[float]]" = contextvars.ContextVar(
    "raycoll_call_timeout", default=None)


@contextlib.contextmanager
def call_timeout(seconds: Optional[float]) -> Iterator[None]:
    """Collectives issued inside the block time out after ``seconds`` (``None``: the
    group's timeout): how an Options object's ``timeout`` reaches the one call it is for."""
    token = _CALL_TIMEOUT.set(seconds)
    try:
        yield
    finally:
        _CALL_TIMEOUT.reset(token)


def call_timeout_s(default: float) -> float:
    """The timeout of a collective issued now: one set by :func:`call_timeout`, else
    ``default`` (the group's)."""
    seconds = _CALL_TIMEOUT.get()
    return default if seconds is None else seconds
