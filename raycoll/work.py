"""``Work`` handles for asynchronous collectives, and the ``Future`` they expose.

``Work`` mirrors ``torch.distributed.Work``: ``wait(timeout=None)``, ``is_completed()``,
``is_success()``, ``exception()``, ``get_future()``, ``result()``, ``source_rank()``.
A timeout in ``wait`` raises :class:`raycoll.errors.DistTimeoutError`, naming the ranks that
had not arrived, and breaks the group (as an NCCL abort does in torch).
"""

from __future__ import annotations

import concurrent.futures
from datetime import timedelta
from typing import Any, Callable, List, Optional, Union

from raycoll import errors

__all__ = ["Work", "Future", "to_seconds"]

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


class Work:
    """The handle of an operation issued with ``async_op=True``."""

    def __init__(
        self,
        inner: "concurrent.futures.Future[Any]",
        *,
        describe: str,
        on_timeout: Optional[Callable[[float], BaseException]] = None,
        outputs: Optional[List[Any]] = None,
    ) -> None:
        self._inner = inner
        self._describe = describe
        self._on_timeout = on_timeout
        self._outputs = outputs or []

    def __repr__(self) -> str:
        state = "completed" if self._inner.done() else "pending"
        return f"<raycoll.Work {self._describe} {state}>"

    def wait(self, timeout: Timeout = None) -> bool:
        """Wait for completion; raise the operation's error; ``True`` on success."""
        seconds = to_seconds(timeout)
        try:
            self._inner.result(seconds)
        except concurrent.futures.TimeoutError as exc:
            if self._inner.done():  # finished with a TimeoutError of its own
                raise
            if self._on_timeout is not None:
                raise self._on_timeout(float(seconds or 0)) from exc
            raise errors.DistTimeoutError(
                f"{self._describe} did not complete within {seconds:g}s"
            ) from exc
        return True

    def is_completed(self) -> bool:
        """True once the operation has finished, successfully or not (never blocks)."""
        return self._inner.done()

    def is_success(self) -> bool:
        """True if the operation has finished without an error (never blocks)."""
        return self._inner.done() and self._inner.exception() is None

    def exception(self) -> Optional[BaseException]:
        """The error the operation raised, ``None`` if it succeeded or is still running."""
        if not self._inner.done():
            return None
        return self._inner.exception()

    def get_future(self) -> Future:
        """A future completed with the output tensors (torch returns them as a list)."""
        out = Future()

        def done(f: "concurrent.futures.Future[Any]") -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(self._outputs)

        self._inner.add_done_callback(done)
        return out

    def result(self) -> List[Any]:
        """The output tensors, after waiting."""
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        """For a receive: the global rank the message came from."""
        value = self._inner.result()
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
