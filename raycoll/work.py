"""``Work`` handles for asynchronous collectives, and the ``Future`` they expose.

``Work`` mirrors ``torch.distributed.Work``: ``wait(timeout=None)``, ``is_completed()``,
``is_success()``, ``exception()``, ``get_future()``, ``result()``, ``source_rank()``.
A timeout in ``wait`` raises :class:`raycoll.errors.DistTimeoutError`, naming the ranks that
had not arrived, and breaks the group (as an NCCL abort does in torch).

Stream-ordered backends (NCCL) finish their host part at once and leave a
:class:`DevicePending` (a CUDA event on the backend's stream) as the operation's value:
``Work.wait()`` then makes the caller's current stream wait for that event, as torch does,
and ``is_completed()`` queries it.
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any, Callable, List, Optional, Union

from raycoll import errors

__all__ = ["Work", "Future", "DevicePending", "to_seconds"]

Timeout = Union[None, float, int, timedelta]


def to_seconds(timeout: Timeout, default: Optional[float] = None) -> Optional[float]:
    """Seconds from a ``timedelta`` or a number; ``None`` gives ``default``."""
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a datetime.timedelta or seconds, got {timeout!r}")
    if seconds <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return seconds


def _is_zero(timeout: Timeout) -> bool:
    """``timedelta(0)`` or ``0``: torch's ``kNoTimeout``, the default of ``Work.wait``."""
    if isinstance(timeout, timedelta):
        return timeout == timedelta(0)
    return isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout == 0


class DevicePending(ABC):
    """Device work a stream-ordered backend has enqueued: done when its CUDA event fires.

    ``source`` is the global rank a receive came from (``None`` for anything else).
    """

    source: Optional[int] = None

    @abstractmethod
    def query(self) -> bool:
        """True once the device work finished, or failed (never blocks)."""

    @abstractmethod
    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Make the calling thread's current stream wait for the work; raise its failure.

        With ``timeout_s`` (or in the backend's blocking mode) the host blocks until the
        work is done; past the deadline the communicator is aborted and
        ``DistTimeoutError`` raised.
        """

    @abstractmethod
    def exception(self) -> Optional[BaseException]:
        """The failure of the work (a timeout, an abort), ``None`` if none (yet)."""

    @abstractmethod
    def add_done_callback(self, callback: Callable[[Optional[BaseException]], None]) -> None:
        """Call ``callback(error_or_None)`` once the device work finished (at once if it has)."""


class Future:
    """A small ``torch.futures.Future``-like wrapper around ``concurrent.futures.Future``."""

    def __init__(self, inner: Optional["concurrent.futures.Future[Any]"] = None) -> None:
        self._inner: "concurrent.futures.Future[Any]" = inner or concurrent.futures.Future()

    def done(self) -> bool:
        """True once the result or the exception is set."""
        return self._inner.done()

    def wait(self, timeout: Timeout = None) -> Any:
        """Block until done; return the value or raise the error."""
        return self._inner.result(to_seconds(timeout))

    def value(self) -> Any:
        """The value of a completed future (raises its error; raises if not done)."""
        if not self._inner.done():
            raise RuntimeError("Future.value() called before the future completed")
        return self._inner.result()

    def set_result(self, result: Any) -> None:
        """Complete the future with ``result``."""
        self._inner.set_result(result)

    def set_exception(self, exc: BaseException) -> None:
        """Complete the future with the exception ``exc``."""
        self._inner.set_exception(exc)

    def add_done_callback(self, callback: Callable[["Future"], None]) -> None:
        """Call ``callback(future)`` once it completes (at once if it has)."""
        self._inner.add_done_callback(lambda _f: callback(self))

    def then(self, callback: Callable[["Future"], Any]) -> "Future":
        """A new future holding ``callback(self)`` once this one completes."""
        out = Future()

        def run(_f: "concurrent.futures.Future[Any]") -> None:
            try:
                out.set_result(callback(self))
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                out.set_exception(exc)

        self._inner.add_done_callback(run)
        return out


def future_error(exc: BaseException) -> Exception:
    """``exc`` as a torch future can hold it: torch's ``set_exception`` takes only an
    ``Exception`` (given anything else the future never completes), so the rest travel as a
    ``RuntimeError`` naming them."""
    return exc if isinstance(exc, Exception) else RuntimeError(f"{type(exc).__name__}: {exc}")


def _torch_future(outputs: List[Any]) -> Any:
    """A new ``torch.futures.Future`` if ``outputs`` hold a torch tensor, else ``None``."""
    torch = sys.modules.get("torch")
    if torch is not None and any(isinstance(t, torch.Tensor) for t in outputs):
        return torch.futures.Future()
    return None


class Work:
    """The handle of an operation issued with ``async_op=True``."""

    def __init__(
        self,
        inner: "concurrent.futures.Future[Any]",
        *,
        describe: str,
        on_timeout: Optional[Callable[[float], BaseException]] = None,
        outputs: Optional[List[Any]] = None,
        on_wait: Optional[Callable[[], None]] = None,
    ) -> None:
        self._inner = inner
        self._describe = describe
        self._on_timeout = on_timeout
        self._outputs = outputs or []
        self._on_wait = on_wait  # someone waits now (the operation's waits may spin)

    def __repr__(self) -> str:
        state = "completed" if self._inner.done() else "pending"
        return f"<raycoll.Work {self._describe} {state}>"

    def wait(self, timeout: Timeout = None) -> bool:
        """Wait for completion; raise the operation's error; ``True`` on success.

        ``timeout`` (a ``timedelta`` or seconds) bounds the wait; ``None`` or zero (torch's
        default, ``timedelta(0)``) means no bound of its own: the operation's, the group's
        timeout, applies."""
        seconds = None if _is_zero(timeout) else to_seconds(timeout)
        if self._on_wait is not None:
            self._on_wait()
        start = time.monotonic()
        try:
            value = self._inner.result(seconds)
        except concurrent.futures.TimeoutError as exc:
            if self._inner.done():  # finished with a TimeoutError of its own
                raise
            if self._on_timeout is not None:
                raise self._on_timeout(float(seconds or 0)) from exc
            raise errors.DistTimeoutError(
                f"{self._describe} did not complete within {seconds:g}s"
            ) from exc
        if isinstance(value, DevicePending):
            left = None if seconds is None else max(seconds - (time.monotonic() - start), 1e-3)
            value.wait(left)
        return True

    def _pending(self) -> Optional[DevicePending]:
        """The device work this operation left, once its host part is done (GPU backends)."""
        if self._inner.done() and self._inner.exception() is None:
            value = self._inner.result()
            if isinstance(value, DevicePending):
                return value
        return None

    def is_completed(self) -> bool:
        """True once the operation has finished, successfully or not (never blocks); for
        GPU work, once it finished on the device (its event is queried)."""
        pending = self._pending()
        return self._inner.done() and (pending is None or pending.query())

    def is_success(self) -> bool:
        """True if the operation has finished without an error (never blocks)."""
        return self.is_completed() and self.exception() is None

    def exception(self) -> Optional[BaseException]:
        """The error the operation raised, ``None`` if it succeeded or is still running."""
        if not self._inner.done():
            return None
        pending = self._pending()
        if pending is not None:
            return pending.exception()
        return self._inner.exception()

    def get_future(self) -> Any:
        """A future completed with the output tensors (torch returns them as a list): a
        ``torch.futures.Future`` when they are torch tensors (``then`` chains, DDP comm
        hooks and ``torch.futures.collect_all`` take it), else a raycoll :class:`Future`."""
        out = _torch_future(self._outputs) or Future()

        def settle(exc: Optional[BaseException]) -> None:
            if exc is not None:
                out.set_exception(future_error(exc))
            else:
                out.set_result(self._outputs)

        def done(f: "concurrent.futures.Future[Any]") -> None:
            exc = f.exception()
            value = None if exc is not None else f.result()
            if isinstance(value, DevicePending):  # complete once the device work is
                value.add_done_callback(settle)
            else:
                settle(exc)

        self._inner.add_done_callback(done)
        return out

    def result(self) -> List[Any]:
        """The output tensors, after waiting."""
        self.wait()
        return self._outputs

    def _source_rank(self) -> int:
        """torch's name for :meth:`source_rank` (its ``recv(src=None)`` tests call it)."""
        return self.source_rank()

    def source_rank(self) -> int:
        """For a receive: the global rank the message came from."""
        value = self._inner.result()
        if isinstance(value, DevicePending):
            value = value.source
        if not isinstance(value, int):
            raise RuntimeError(f"{self._describe} has no source rank")
        return value

    def synchronize(self) -> None:
        """Wait for the operation, like :meth:`wait` (torch's name for CUDA streams)."""
        self.wait()

    @staticmethod
    def completed(value: Any = None, describe: str = "completed", outputs: Optional[List[Any]] = None) -> "Work":
        """A ``Work`` that has already finished with ``value``."""
        fut: "concurrent.futures.Future[Any]" = concurrent.futures.Future()
        fut.set_result(value)
        return Work(fut, describe=describe, outputs=outputs)
