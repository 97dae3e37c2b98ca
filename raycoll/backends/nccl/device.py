"""Device work of the NCCL backend: what each enqueued operation is, its event and deadline,
the handle a caller waits on, and per device the raycoll stream, the in-flight queue, the
thread that settles operations in stream order, and the watchdog that times them out and
aborts the communicator.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Protocol, Tuple

from raycoll import errors
from raycoll.backends.base import Call, Completion, GroupContext
from raycoll.tensors import TensorInfo
from raycoll.work import DevicePending

logger = logging.getLogger("raycoll")

__all__ = ["What", "DeviceOp", "Handle", "DeviceState", "Deferred", "NcclOwner",
           "ASYNC_ERROR_CHECK_S"]

#: How often the watchdog asks NCCL for asynchronous errors while work is in flight.
ASYNC_ERROR_CHECK_S = 1.0


class NcclOwner(Protocol):
    """What the device machinery and the communicator setup use of the backend."""

    ctx: GroupContext
    cp: Any  # the cupy module
    nccl: Any  # cupy.cuda.nccl
    version: int  # NCCL's version code
    blocking: bool  # waits block the host (nccl_blocking_wait)

    def err_ctx(self, what: "What") -> Dict[str, Any]: ...


@dataclass(frozen=True)
class What:
    """The operation behind some device work, for deadlines and error messages."""

    op: str
    seq: int
    timeout_s: float

    @classmethod
    def of(cls, call: Call) -> "What":
        return cls(call.op, call.seq, call.timeout_s)

    def __str__(self) -> str:
        return f"{self.op} #{self.seq}" if self.seq >= 0 else self.op


class DeviceOp:
    """One enqueued piece of device work: its event, deadline, outcome and kept references."""

    def __init__(self, state: "DeviceState", what: What, event: Any, keep: List[Any]) -> None:
        self.state = state
        self.what = what
        self.event = event
        self.keep: Optional[List[Any]] = keep
        self.deadline = time.monotonic() + what.timeout_s
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self._callbacks: List[Callable[[Optional[BaseException]], None]] = []
        self._lock = threading.Lock()

    def event_done(self) -> bool:
        try:
            done = self.event.done  # a property in cupy; tolerate a method
            return bool(done() if callable(done) else done)
        except Exception:  # noqa: BLE001 - a broken context: not done as far as we know
            return False

    def finish(self, error: Optional[BaseException] = None) -> None:
        """Settle once: success (``None``) or ``error``; run the callbacks."""
        with self._lock:
            if self.done.is_set():
                return
            self.error = error
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(error)
            except Exception:  # noqa: BLE001 - a user callback must not kill the watchdog
                logger.exception("a done-callback of %s raised", self.what)

    def add_callback(self, callback: Callable[[Optional[BaseException]], None]) -> None:
        with self._lock:
            if not self.done.is_set():
                self._callbacks.append(callback)
                return
        callback(self.error)


class Handle(DevicePending):
    """What an NCCL operation returns: waits on its :class:`DeviceOp` from the caller's stream."""

    def __init__(self, op: DeviceOp, array: TensorInfo, source: Optional[int] = None) -> None:
        self._op = op
        self._array = array
        self.source = source

    def query(self) -> bool:
        return self._op.done.is_set() or self._op.event_done()

    def exception(self) -> Optional[BaseException]:
        return self._op.error if self._op.done.is_set() else None

    def add_done_callback(self, callback: Callable[[Optional[BaseException]], None]) -> None:
        self._op.add_callback(callback)

    def wait(self, timeout_s: Optional[float] = None) -> None:
        self._op.state.wait(self._op, self._array, timeout_s)

    def __repr__(self) -> str:
        return f"<NCCL work {self._op.what} {'done' if self.query() else 'pending'}>"


class DeviceState:
    """One device of one group: communicator, raycoll stream, in-flight work, watchdog."""

    def __init__(self, backend: NcclOwner, device: int) -> None:
        cp = backend.cp
        self.backend = backend
        self.device = device
        self.lock = threading.RLock()  # serializes enqueues (a communicator is not thread-safe)
        self.cond = threading.Condition()
        self.inflight: Deque[DeviceOp] = collections.deque()
        self.enqueuing: Optional[Tuple[float, What]] = None
        self.failed: Optional[BaseException] = None
        self.closed = False
        self.comm: Any = None
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
        self._synced: "queue.SimpleQueue[Optional[DeviceOp]]" = queue.SimpleQueue()
        name = f"raycoll-nccl-{backend.ctx.group_name}-cuda{device}"
        for target, role in ((self._sync_loop, "sync"), (self._watch_loop, "watchdog")):
            threading.Thread(target=target, name=f"{name}-{role}", daemon=True).start()

    # -- bookkeeping
    def check(self) -> None:
        if self.failed is not None:
            raise self.failed
        if self.closed:
            raise errors.GroupDestroyedError(
                f"group {self.backend.ctx.group_name!r} was destroyed; its NCCL communicator "
                "is closed")

    def track(self, op: DeviceOp) -> None:
        with self.cond:
            failed = self.failed
            if failed is None:
                self.inflight.append(op)
                self.cond.notify_all()
        if failed is not None:  # failed while this op was being enqueued
            broken = errors.GroupBrokenError(
                f"{op.what} on group {self.backend.ctx.group_name!r} was aborted: {failed}",
                **self.backend.err_ctx(op.what))
            broken.__cause__ = failed
            op.finish(broken)
        self._synced.put(op)

    @contextlib.contextmanager
    def enqueue_guard(self, what: What) -> Iterator[None]:
        """Bound a host-side enqueue (NCCL may block in it, e.g. connecting to peers)."""
        with self.cond:
            self.enqueuing = (time.monotonic() + what.timeout_s, what)
            self.cond.notify_all()
        try:
            yield
        finally:
            with self.cond:
                self.enqueuing = None

    # -- threads
    def _sync_loop(self) -> None:
        """Wait for each op's event in stream order and settle it (no polling)."""
        cp = self.backend.cp
        while True:
            op = self._synced.get()
            if op is None:
                return
            error: Optional[BaseException] = None
            try:
                with cp.cuda.Device(self.device):
                    op.event.synchronize()
            except Exception as exc:  # noqa: BLE001 - a CUDA error: the device is unusable
                error = errors.GroupBrokenError(
                    f"{op.what} on group {self.backend.ctx.group_name!r}: CUDA reported an "
                    f"error on cuda:{self.device}: {exc}", **self.backend.err_ctx(op.what))
                error.__cause__ = exc
            with self.cond:
                if self.inflight and self.inflight[0] is op:
                    self.inflight.popleft()
                self.cond.notify_all()
            if error is not None:
                self.fail(error, op.what)
                continue
            op.keep = None  # the device is done with the memory
            op.finish(None)

    def _watch_loop(self) -> None:
        """Sleep until the earliest deadline (or a change); time out what is late. While work
        is in flight, ask NCCL for asynchronous errors (a peer died, the network failed) every
        ``ASYNC_ERROR_CHECK_S``, as torch's watchdog does: NCCL has no event for them."""
        while True:
            expired: Optional[Tuple[What, Optional[DeviceOp]]] = None
            with self.cond:
                if self.closed or self.failed is not None:
                    return
                candidates: List[Tuple[float, What, Optional[DeviceOp]]] = []
                if self.inflight:
                    head = self.inflight[0]
                    candidates.append((head.deadline, head.what, head))
                if self.enqueuing is not None:
                    candidates.append((self.enqueuing[0], self.enqueuing[1], None))
                if not candidates:
                    self.cond.wait()
                    continue
                deadline, what, op = min(candidates, key=lambda c: c[0])
                now = time.monotonic()
                if deadline > now:
                    self.cond.wait(min(deadline - now, ASYNC_ERROR_CHECK_S))
                else:
                    expired = (what, op)
                comm = self.comm
            if expired is None:
                self._check_async_error(comm, what)
                continue
            if not self.time_out(expired[0], expired[0].timeout_s, expired[1]):
                with self.cond:  # it finished just now: wait for the sync thread to settle it
                    if self.inflight and self.inflight[0] is expired[1] and not self.closed:
                        self.cond.wait()

    def _check_async_error(self, comm: Any, what: What) -> None:
        if comm is None:
            return
        try:
            comm.check_async_error()
        except Exception as exc:  # noqa: BLE001 - NcclError: the communicator is unusable
            err = errors.GroupBrokenError(
                f"{what} on group {self.backend.ctx.group_name!r}: NCCL reported an error on "
                f"cuda:{self.device}: {exc} (a peer rank died or the network failed); the "
                "communicator was aborted and the group is broken (destroy it and form it "
                "again)", **self.backend.err_ctx(what))
            err.__cause__ = exc
            self.fail(err, what)

    # -- waiting and failing
    def wait(self, op: DeviceOp, array: TensorInfo, timeout_s: Optional[float]) -> None:
        """``DevicePending.wait``: host-block when asked to; else order the caller's stream."""
        if timeout_s is not None or self.backend.blocking:
            limit = timeout_s if timeout_s is not None else max(op.deadline - time.monotonic(), 0.0)
            if not op.done.wait(limit):
                self.time_out(op.what, limit if timeout_s is not None else op.what.timeout_s, op)
        if op.error is not None:
            raise op.error
        if not op.done.is_set():
            cp = self.backend.cp
            with cp.cuda.Device(self.device):
                array.caller_stream().wait_event(op.event)

    def time_out(self, what: What, seconds: float, op: Optional[DeviceOp]) -> bool:
        """``what`` outlived ``seconds``: fail it (DistTimeoutError) and abort the communicator.

        Returns False (and does nothing) when ``op`` turns out to have finished.
        """
        if op is not None and (op.done.is_set() or op.event_done()):
            return False  # it finished after all; the sync thread settles it
        exc = errors.DistTimeoutError(
            f"{what} on group {self.backend.ctx.group_name!r} did not complete on "
            f"cuda:{self.device} within {seconds:g}s (NCCL: a rank did not reach it, or one "
            "is stuck); the NCCL communicator was aborted and the group is broken: destroy "
            "it and form it again", **self.backend.err_ctx(what))
        self.fail(exc, what)
        return True

    def fail(self, exc: BaseException, what: What) -> None:
        """Fail everything in flight with ``exc`` (the first failure wins) and abort."""
        with self.cond:
            first = self.failed is None
            if first:
                self.failed = exc
            cause = self.failed
            victims = list(self.inflight)
            self.inflight.clear()
            self.cond.notify_all()
        for victim in victims:
            if victim.what is what or not first:
                victim.finish(cause)
            else:
                broken = errors.GroupBrokenError(
                    f"{victim.what} on group {self.backend.ctx.group_name!r} was aborted: "
                    f"{cause}", **self.backend.err_ctx(victim.what))
                broken.__cause__ = cause
                victim.finish(broken)
        if first:
            self.backend.ctx.fail(exc)
            self.release(abort=True)

    def release(self, abort: bool) -> None:
        """Drop the communicator: abort or destroy it on a daemon thread (either may block)."""
        comm, self.comm = self.comm, None
        if comm is None:
            return

        def run() -> None:
            try:
                comm.abort() if abort else comm.destroy()
            except Exception:  # noqa: BLE001 - best effort on teardown
                logger.exception("releasing the NCCL communicator on cuda:%d failed", self.device)

        threading.Thread(target=run, name=f"raycoll-nccl-release-cuda{self.device}",
                         daemon=True).start()

    def close(self) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            busy = bool(self.inflight) or self.failed is not None
            self.cond.notify_all()
        self._synced.put(None)
        self.release(abort=busy)

@dataclass
class Deferred:
    """A send or receive posted inside ``batch_p2p``, issued when the batch ends."""

    kind: str  # "send" | "recv"
    array: TensorInfo
    peer: int
    timeout_s: float
    ready: threading.Event
    handle: Optional[Handle] = None
    error: Optional[BaseException] = None

    def completion(self) -> Completion:
        def wait() -> Handle:
            if not self.ready.wait(self.timeout_s):
                raise errors.DistTimeoutError(
                    f"batch_isend_irecv: the batch holding this {self.kind} was not issued "
                    f"within {self.timeout_s:g}s")
            if self.error is not None:
                raise self.error
            if self.handle is None:  # set together with ready: a bug if ever reached
                raise errors.CollectiveError(f"batch_isend_irecv: the {self.kind} was issued "
                                             "without a handle")
            return self.handle

        return wait

