"""The NCCL backend: GPU tensors (cupy arrays, torch CUDA tensors) through NCCL communicators.

One ``cupy.cuda.nccl.NcclCommunicator`` per (group, device), created lazily by the first GPU
operation on the group: every rank publishes its node and GPU in the coordinator's key-value
store, rank 0 adds the NCCL unique id, and each rank waits (bounded by the collective's
timeout, naming the ranks that never came) before the blocking ``ncclCommInitRank``. Ranks
that share a GPU are refused with a clear error (NCCL cannot run two ranks of one
communicator on one GPU; ``cuda:objstore`` can). With several devices per rank, ranks must
first use them in the same order (the n-th communicator of a group pairs the n-th devices).

Operations are stream-ordered, as in torch's ``ProcessGroupNCCL``: the raycoll stream of the
device waits for the caller's current stream, NCCL (and any pre/post step) is enqueued on the
raycoll stream, and an event is recorded. The operation returns a :class:`DevicePending` at
once; ``wait()`` (for synchronous calls, at once) makes the caller's current stream wait for
the event, ``is_completed()`` queries it. Tensors and temporaries stay referenced until the
device is done with them. ``options={"nccl_blocking_wait": True}`` (or
``RAYCOLL_NCCL_BLOCKING_WAIT=1``) makes waits block the host instead, like
``TORCH_NCCL_BLOCKING_WAIT``.

A watchdog per device aborts the communicator (``ncclCommAbort``) when an operation, or the
host-side enqueue of one, outlives its timeout; the waiters get
:class:`~raycoll.errors.DistTimeoutError`, the group is broken (later calls raise
``GroupBrokenError``), and it can be destroyed and formed again. NCCL errors are translated
into ``GroupBrokenError`` with the NCCL error as the cause.

Reductions map to NCCL's ops; what NCCL lacks is done on the raycoll stream: AVG (integers,
or NCCL < 2.10) and PREMUL_SUM (``factor * sum``, as the object-store backend does) as SUM
then an elementwise step; BAND/BOR/BXOR on integers by all-gather then a local reduction (on
bool: MIN/MAX/all-gather). bfloat16 arithmetic goes through float32. Data movement (broadcast,
gathers, scatter, all_to_all, p2p) moves bytes, so any dtype works. p2p and all_to_all use
NCCL group calls; ``batch_isend_irecv`` issues its operations as one group call. Tags are
ignored (NCCL matches messages between a pair in order), as in torch; ``recv`` needs ``src``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

from raycoll import errors
from raycoll.backends import _cuda
from raycoll.backends._cuda import GpuArray
from raycoll.backends.base import Call, CollectiveBackend, Completion, GroupContext, Outcome
from raycoll.reduce_op import ReduceOp
from raycoll.work import DevicePending

logger = logging.getLogger("raycoll")

__all__ = ["NcclBackend", "ReducePlan", "reduce_plan", "AVG_MIN_VERSION", "BLOCKING_ENV"]

#: ``ncclAvg`` exists from NCCL 2.10 (version code 21000).
AVG_MIN_VERSION = 21000
#: How often the watchdog asks NCCL for asynchronous errors while work is in flight.
ASYNC_ERROR_CHECK_S = 1.0
#: Environment variable that turns on blocking waits (as ``TORCH_NCCL_BLOCKING_WAIT``).
BLOCKING_ENV = "RAYCOLL_NCCL_BLOCKING_WAIT"

_NCCL_TYPES = {
    "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16",
    "bfloat16": "NCCL_BFLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
    "bool": "NCCL_UINT8",
}
_COMPLEX_TYPES = {"complex64": "NCCL_FLOAT32", "complex128": "NCCL_FLOAT64"}
_FLOATS = ("float16", "bfloat16", "float32", "float64")
_BYTES = "NCCL_UINT8"


# ---------------------------------------------------------------------- reduce-op mapping
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


# ---------------------------------------------------------------------- pending work
@dataclass(frozen=True)
class _What:
    """The operation behind some device work, for deadlines and error messages."""

    op: str
    seq: int
    timeout_s: float

    @classmethod
    def of(cls, call: Call) -> "_What":
        return cls(call.op, call.seq, call.timeout_s)

    def __str__(self) -> str:
        return f"{self.op} #{self.seq}" if self.seq >= 0 else self.op


class _Op:
    """One enqueued piece of device work: its event, deadline, outcome and kept references."""

    def __init__(self, state: "_DeviceState", what: _What, event: Any, keep: List[Any]) -> None:
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


class _Handle(DevicePending):
    """What an NCCL operation returns: waits on its :class:`_Op` from the caller's stream."""

    def __init__(self, op: _Op, array: GpuArray, source: Optional[int] = None) -> None:
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


# ---------------------------------------------------------------------- per-device state
class _DeviceState:
    """One device of one group: communicator, raycoll stream, in-flight work, watchdog."""

    def __init__(self, backend: "NcclBackend", device: int) -> None:
        cp = backend.cp
        self.backend = backend
        self.device = device
        self.lock = threading.RLock()  # serializes enqueues (a communicator is not thread-safe)
        self.cond = threading.Condition()
        self.inflight: Deque[_Op] = collections.deque()
        self.enqueuing: Optional[Tuple[float, _What]] = None
        self.failed: Optional[BaseException] = None
        self.closed = False
        self.comm: Any = None
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
        self._synced: "queue.SimpleQueue[Optional[_Op]]" = queue.SimpleQueue()
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

    def track(self, op: _Op) -> None:
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
    def enqueue_guard(self, what: _What) -> Iterator[None]:
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
            expired: Optional[Tuple[_What, Optional[_Op]]] = None
            with self.cond:
                if self.closed or self.failed is not None:
                    return
                candidates: List[Tuple[float, _What, Optional[_Op]]] = []
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

    def _check_async_error(self, comm: Any, what: _What) -> None:
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
    def wait(self, op: _Op, array: GpuArray, timeout_s: Optional[float]) -> None:
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

    def time_out(self, what: _What, seconds: float, op: Optional[_Op]) -> bool:
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

    def fail(self, exc: BaseException, what: _What) -> None:
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
class _Deferred:
    """A send or receive posted inside ``batch_p2p``, issued when the batch ends."""

    kind: str  # "send" | "recv"
    array: GpuArray
    peer: int
    timeout_s: float
    ready: threading.Event
    handle: Optional[_Handle] = None
    error: Optional[BaseException] = None

    def completion(self) -> Completion:
        def wait() -> _Handle:
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


# ---------------------------------------------------------------------- the backend
class NcclBackend(CollectiveBackend):
    """GPU collectives through NCCL (cupy's binding), stream-ordered as in torch."""

    devices = ("cuda",)
    stream_ordered = True

    def __init__(self, ctx: GroupContext) -> None:
        super().__init__(ctx)
        self.nccl = _cuda.nccl_module()
        self.cp = _cuda.cupy_module()
        self.version = int(self.nccl.get_version())
        option = ctx.options.nccl_blocking_wait
        env = os.environ.get(BLOCKING_ENV, "").lower() in ("1", "true", "yes")
        self.blocking = bool(option) if option is not None else env
        self._states: Dict[int, _DeviceState] = {}
        self._lock = threading.Lock()
        self._comm_count = 0
        self._batch = threading.local()
        self._closed = False

    # -- plumbing
    def err_ctx(self, what: _What) -> Dict[str, Any]:
        return {"op": what.op, "seq": what.seq if what.seq >= 0 else None,
                "group": self.ctx.group_name, "rank": self.ctx.global_ranks[self.ctx.rank]}

    def _const(self, name: str) -> int:
        value = getattr(self.nccl, name, None)
        if value is None:
            raise TypeError(f"this cupy's NCCL binding lacks {name} (cupy {self.cp.__version__})")
        return int(value)

    def _state(self, device: int) -> _DeviceState:
        with self._lock:
            if self._closed:
                raise errors.GroupDestroyedError(
                    f"group {self.ctx.group_name!r} was destroyed; its NCCL backend is closed")
            state = self._states.get(device)
            if state is None:
                state = self._states[device] = _DeviceState(self, device)
            return state

    def _comm(self, state: _DeviceState, what: _What) -> Any:
        if state.comm is None:
            with self._lock:
                index = self._comm_count
                self._comm_count += 1
            state.comm = self._create_comm(state.device, index, what)
        return state.comm

    def _create_comm(self, device: int, index: int, what: _What) -> Any:
        """Rendezvous through the coordinator's kv store, then ``ncclCommInitRank``."""
        ctx, nccl = self.ctx, self.nccl
        deadline = time.monotonic() + what.timeout_s
        if ctx.size == 1:
            uid = nccl.get_unique_id()
        else:
            uid = self._exchange_uid(device, index, what, deadline)
        box: Dict[str, Any] = {}
        done = threading.Event()

        def init() -> None:
            try:
                with self.cp.cuda.Device(device):
                    box["comm"] = nccl.NcclCommunicator(ctx.size, uid, ctx.rank)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=init, name=f"raycoll-nccl-init-cuda{device}", daemon=True).start()
        if not done.wait(max(deadline - time.monotonic(), 0.0)):
            raise errors.DistTimeoutError(
                f"{what} on group {ctx.group_name!r}: creating the NCCL communicator on "
                f"cuda:{device} did not finish within {what.timeout_s:g}s (a rank died or "
                "cannot reach the others over the network)", **self.err_ctx(what))
        if "error" in box:
            exc = box["error"]
            raise errors.GroupBrokenError(
                f"{what} on group {ctx.group_name!r}: creating the NCCL communicator on "
                f"cuda:{device} failed: {type(exc).__name__}: {exc}", **self.err_ctx(what)
            ) from exc
        logger.debug("group %r rank %d: NCCL communicator %d on cuda:%d (NCCL %d)",
                     ctx.group_name, ctx.rank, index, device, self.version)
        return box["comm"]

    def _exchange_uid(self, device: int, index: int, what: _What, deadline: float) -> Any:
        ctx = self.ctx
        me = ctx.rank
        base = f"raycoll/nccl/{ctx.group_name}/{index}"
        mine = {"node": ctx.node_ids[me], "gpu": self._gpu_id(device), "device": device,
                "uid": self.nccl.get_unique_id() if me == 0 else None}
        where = self.err_ctx(what)
        ctx.client.call("kv_set", f"{base}/{me}", mine, timeout_s=what.timeout_s, **where)
        left = max(deadline - time.monotonic(), 0.001)
        refs = [ctx.client.submit("kv_get", f"{base}/{r}", left) for r in range(ctx.size)]
        infos: List[Dict[str, Any]] = []
        missing: List[int] = []
        for r, ref in enumerate(refs):
            try:
                infos.append(ctx.client.wait(ref, left, **where))
            except errors.DistTimeoutError:
                missing.append(ctx.global_ranks[r])
                infos.append({})
        if missing:
            raise errors.DistTimeoutError(
                f"{what} on group {ctx.group_name!r}: ranks {missing} did not start creating "
                f"the group's NCCL communicator within {what.timeout_s:g}s (every rank of the "
                "group must issue a GPU operation on it)", missing=missing, **where)
        seen: Dict[Tuple[str, str], int] = {}
        for r, info in enumerate(infos):
            if info.get("gpu") is None:
                continue
            key = (str(info.get("node")), str(info.get("gpu")))
            if key in seen:
                raise errors.BackendUnavailableError(
                    f"{what} on group {ctx.group_name!r}: ranks {ctx.global_ranks[seen[key]]} and "
                    f"{ctx.global_ranks[r]} use the same GPU ({key[1]}); NCCL needs one GPU per "
                    "rank: give each actor its own GPU (num_gpus=1), or stage GPU tensors "
                    "through the object store with backend='cpu:objstore,cuda:objstore'")
            seen[key] = r
        return infos[0]["uid"]

    def _gpu_id(self, device: int) -> Optional[str]:
        cp = self.cp
        try:
            return str(cp.cuda.Device(device).pci_bus_id)
        except Exception:  # noqa: BLE001 - older cupy: ask the runtime
            try:
                return str(cp.cuda.runtime.deviceGetPCIBusId(device))
            except Exception:  # noqa: BLE001 - unknown: skip the duplicate check
                return None

    def _launch(self, what: _What, arrays: Sequence[GpuArray],
                body: Callable[[Any, Any], List[Any]]) -> _Op:
        """Enqueue ``body(comm, stream)`` on the raycoll stream after the callers' streams."""
        main = arrays[0]
        for a in arrays[1:]:
            if a.device != main.device:
                raise ValueError(f"{what}: all tensors must be on one GPU, got cuda:{main.device} "
                                 f"and cuda:{a.device}")
        state = self._state(main.device)
        cp = self.cp
        with cp.cuda.Device(main.device), state.lock:
            state.check()
            comm = self._comm(state, what)
            for lib_first in {a.lib: a for a in arrays}.values():
                ready = cp.cuda.Event(disable_timing=True)
                ready.record(lib_first.caller_stream())
                state.stream.wait_event(ready)
            try:
                with state.enqueue_guard(what), state.stream:
                    keep = body(comm, state.stream)
            except Exception as exc:
                raise self._translate(state, what, exc) from exc
            event = cp.cuda.Event(block=True, disable_timing=True)
            event.record(state.stream)
            op = _Op(state, what, event, [a.obj for a in arrays] + keep)
            state.track(op)
        return op

    def _translate(self, state: _DeviceState, what: _What, exc: Exception) -> BaseException:
        if isinstance(exc, errors.RaycollError):
            return exc
        if state.failed is not None:  # the watchdog aborted a blocked enqueue
            return state.failed
        err = errors.GroupBrokenError(
            f"{what} on group {self.ctx.group_name!r}: NCCL failed on cuda:{state.device}: "
            f"{type(exc).__name__}: {exc}; the communicator was aborted and the group is broken "
            "(destroy it and form it again)", **self.err_ctx(what))
        err.__cause__ = exc
        state.fail(err, what)
        return err

    # -- buffers
    def _flat_in(self, a: GpuArray) -> Any:
        """A contiguous 1-D cupy array with ``a``'s data (a view when ``a`` is contiguous)."""
        if a.contiguous:
            return a.flat_view()
        return self.cp.ascontiguousarray(a.cupy_view()).reshape(-1)

    def _flat_out(self, a: GpuArray, init: bool = False) -> Tuple[Any, Callable[[], None]]:
        """A contiguous 1-D buffer to write ``a``'s result into, and the write-back step."""
        if a.contiguous:
            return a.flat_view(), lambda: None
        view = a.cupy_view()
        cp = self.cp
        tmp = (cp.ascontiguousarray(view) if init else cp.empty(view.shape, view.dtype)).reshape(-1)

        def write_back() -> None:
            view[...] = tmp.reshape(view.shape)

        return tmp, write_back

    def _post(self, buf: Any, dtype: str, plan: ReducePlan, op: ReduceOp) -> None:
        """AVG's division / PREMUL_SUM's factor on the (contiguous) result, in stream order."""
        if plan.post is None:
            return
        cp = self.cp
        size = self.ctx.size
        if dtype == "bfloat16":
            values = _cuda.bf16_to_f32(buf)
            if plan.post == "avg":
                values /= size
            else:
                values *= float(op.factor if op.factor is not None else 1.0)
            _cuda.f32_to_bf16_(values, buf)
        elif plan.post == "avg":
            if size > 1:
                if buf.dtype.kind in "fc":
                    cp.divide(buf, size, out=buf)
                else:  # truncating, as the object-store backend and ncclAvg do
                    cp.copyto(buf, cp.trunc(buf / size), casting="unsafe")
        else:
            factor = float(op.factor if op.factor is not None else 1.0)
            if buf.dtype.kind in "fc":
                cp.multiply(buf, factor, out=buf, casting="unsafe")
            else:
                cp.copyto(buf, buf * factor, casting="unsafe")

    def _gathered(self, comm: Any, stream: Any, flat: Any) -> Any:
        """Every rank's ``flat``, as a (world_size, n) array (for the bitwise fallback)."""
        out = self.cp.empty((self.ctx.size, flat.size), dtype=flat.dtype)
        comm.allGather(flat.data.ptr, out.data.ptr, flat.nbytes, self._const(_BYTES), stream.ptr)
        return out

    def _fold(self, ufunc: str, rows: Any, out: Any) -> None:
        fn = getattr(self.cp, ufunc)
        out[...] = rows[0]
        for j in range(1, rows.shape[0]):
            fn(out, rows[j], out=out)

    def _reduce_flat(self, comm: Any, stream: Any, flat: Any, dtype: str, plan: ReducePlan,
                     op: ReduceOp, root: Optional[int]) -> List[Any]:
        """Reduce ``flat`` in place over the group (into ``root`` only, when given)."""
        if flat.size == 0:
            return []
        me = self.ctx.rank
        if plan.fallback is not None:
            rows = self._gathered(comm, stream, flat)
            if root is None or me == root:
                self._fold(plan.fallback, rows, flat)
            return [rows]
        count = flat.size * plan.count_factor
        dtype_code, op_code = self._const(plan.nccl_dtype), self._const(plan.nccl_op or "")
        if root is None:
            comm.allReduce(flat.data.ptr, flat.data.ptr, count, dtype_code, op_code, stream.ptr)
        else:
            comm.reduce(flat.data.ptr, flat.data.ptr, count, dtype_code, op_code, root, stream.ptr)
        if root is None or me == root:
            self._post(flat, dtype, plan, op)
        return []

    @contextlib.contextmanager
    def _group_call(self) -> Iterator[None]:
        self.nccl.groupStart()
        try:
            yield
        finally:
            self.nccl.groupEnd()

    def _plan(self, op: ReduceOp, a: GpuArray) -> ReducePlan:
        return reduce_plan(op, a.dtype, self.version)

    def _handle(self, op: _Op, array: GpuArray, source: Optional[int] = None) -> _Handle:
        return _Handle(op, array, source)

    # -- reductions
    def all_reduce(self, tensor: Any, op: ReduceOp, call: Call) -> Outcome:
        a = GpuArray.of(tensor)
        plan = self._plan(op, a)

        def body(comm: Any, stream: Any) -> List[Any]:
            flat, write_back = self._flat_out(a, init=True)
            keep = self._reduce_flat(comm, stream, flat, a.dtype, plan, op, None)
            write_back()
            return keep + [flat]

        return self._handle(self._launch(_What.of(call), [a], body), a)

    def reduce(self, tensor: Any, dst: int, op: ReduceOp, call: Call) -> Outcome:
        a = GpuArray.of(tensor)
        plan = self._plan(op, a)

        def body(comm: Any, stream: Any) -> List[Any]:
            flat, write_back = self._flat_out(a, init=True)
            keep = self._reduce_flat(comm, stream, flat, a.dtype, plan, op, dst)
            if self.ctx.rank == dst:
                write_back()
            return keep + [flat]

        return self._handle(self._launch(_What.of(call), [a], body), a)

    def reduce_scatter(self, output: Any, inputs: List[Any], op: ReduceOp, call: Call) -> Outcome:
        out = GpuArray.of(output, "output")
        ins = [GpuArray.of(t, f"input_list[{j}]") for j, t in enumerate(inputs)]

        def body(comm: Any, stream: Any) -> List[Any]:
            n = out.numel
            packed = self.cp.empty(n * len(ins), dtype=_cuda.storage_dtype(out.dtype))
            for j, a in enumerate(ins):
                packed[j * n:(j + 1) * n] = a.cupy_view().reshape(-1)
            return self._reduce_scatter_flat(comm, stream, packed, out, op) + [packed]

        return self._handle(self._launch(_What.of(call), [out] + ins, body), out)

    def reduce_scatter_tensor(self, output: Any, tensor: Any, op: ReduceOp, call: Call) -> Outcome:
        out = GpuArray.of(output, "output")
        src = GpuArray.of(tensor, "input")

        def body(comm: Any, stream: Any) -> List[Any]:
            packed = self._flat_in(src)
            return self._reduce_scatter_flat(comm, stream, packed, out, op) + [packed]

        return self._handle(self._launch(_What.of(call), [out, src], body), out)

    def _reduce_scatter_flat(self, comm: Any, stream: Any, packed: Any, out: GpuArray,
                             op: ReduceOp) -> List[Any]:
        plan = self._plan(op, out)
        flat, write_back = self._flat_out(out)
        n, me = out.numel, self.ctx.rank
        keep: List[Any] = [flat]
        if n:
            if plan.fallback is not None:
                rows = self._gathered(comm, stream, packed)
                self._fold(plan.fallback, rows[:, me * n:(me + 1) * n], flat)
                keep.append(rows)
            else:
                comm.reduceScatter(packed.data.ptr, flat.data.ptr, n * plan.count_factor,
                                   self._const(plan.nccl_dtype), self._const(plan.nccl_op or ""),
                                   stream.ptr)
                self._post(flat, out.dtype, plan, op)
        write_back()
        return keep

    # -- data movement (bytes, so any dtype moves)
    def broadcast(self, tensor: Any, src: int, call: Call) -> Outcome:
        a = GpuArray.of(tensor)

        def body(comm: Any, stream: Any) -> List[Any]:
            if self.ctx.rank == src:
                flat, write_back = self._flat_in(a), (lambda: None)
            else:
                flat, write_back = self._flat_out(a)
            if flat.nbytes:
                comm.broadcast(flat.data.ptr, flat.data.ptr, flat.nbytes, self._const(_BYTES),
                               src, stream.ptr)
            write_back()
            return [flat]

        return self._handle(self._launch(_What.of(call), [a], body), a)

    def all_gather(self, outputs: List[Any], tensor: Any, call: Call) -> Outcome:
        a = GpuArray.of(tensor)
        outs = [GpuArray.of(t, f"tensor_list[{j}]") for j, t in enumerate(outputs)]

        def body(comm: Any, stream: Any) -> List[Any]:
            mine = self._flat_in(a)
            n = mine.size
            every = self.cp.empty(n * self.ctx.size, dtype=mine.dtype)
            if mine.nbytes:
                comm.allGather(mine.data.ptr, every.data.ptr, mine.nbytes, self._const(_BYTES),
                               stream.ptr)
            for j, o in enumerate(outs):
                view = o.cupy_view()
                view[...] = every[j * n:(j + 1) * n].reshape(view.shape)
            return [mine, every]

        return self._handle(self._launch(_What.of(call), [a] + outs, body), a)

    def all_gather_into_tensor(self, output: Any, tensor: Any, call: Call) -> Outcome:
        out = GpuArray.of(output, "output_tensor")
        a = GpuArray.of(tensor, "input_tensor")

        def body(comm: Any, stream: Any) -> List[Any]:
            mine = self._flat_in(a)
            flat, write_back = self._flat_out(out)
            if mine.nbytes:
                comm.allGather(mine.data.ptr, flat.data.ptr, mine.nbytes, self._const(_BYTES),
                               stream.ptr)
            write_back()
            return [mine, flat]

        return self._handle(self._launch(_What.of(call), [out, a], body), out)

    def _exchange(self, comm: Any, stream: Any, sends: Sequence[Tuple[int, Any]],
                  recvs: Sequence[Tuple[int, Any]]) -> None:
        """One NCCL group call: ``sends``/``recvs`` are (peer, contiguous buffer) pairs.

        Issued peer by peer, each send next to the receive from the same peer (NCCL wants a
        send to self next to its matching receive). Empty buffers are skipped on both sides.
        """
        code = self._const(_BYTES)
        ops = [(peer, 0, buf) for peer, buf in sends] + [(peer, 1, buf) for peer, buf in recvs]
        with self._group_call():
            for peer, kind, buf in sorted(ops, key=lambda o: (o[0], o[1])):
                if not buf.nbytes:
                    continue
                if kind == 0:
                    comm.send(buf.data.ptr, buf.nbytes, code, peer, stream.ptr)
                else:
                    comm.recv(buf.data.ptr, buf.nbytes, code, peer, stream.ptr)

    def gather(self, tensor: Any, outputs: Optional[List[Any]], dst: int, call: Call) -> Outcome:
        a = GpuArray.of(tensor)
        outs = [GpuArray.of(t, f"gather_list[{j}]") for j, t in enumerate(outputs or [])]

        def body(comm: Any, stream: Any) -> List[Any]:
            mine = self._flat_in(a)
            targets = [self._flat_out(o) for o in outs] if self.ctx.rank == dst else []
            self._exchange(comm, stream, [(dst, mine)],
                           [(j, buf) for j, (buf, _) in enumerate(targets)])
            for _, write_back in targets:
                write_back()
            return [mine] + [buf for buf, _ in targets]

        return self._handle(self._launch(_What.of(call), [a] + outs, body), a)

    def scatter(self, output: Any, inputs: Optional[List[Any]], src: int, call: Call) -> Outcome:
        out = GpuArray.of(output)
        ins = [GpuArray.of(t, f"scatter_list[{j}]") for j, t in enumerate(inputs or [])]

        def body(comm: Any, stream: Any) -> List[Any]:
            sources = [self._flat_in(a) for a in ins] if self.ctx.rank == src else []
            flat, write_back = self._flat_out(out)
            self._exchange(comm, stream, list(enumerate(sources)), [(src, flat)])
            write_back()
            return sources + [flat]

        return self._handle(self._launch(_What.of(call), [out] + ins, body), out)

    def all_to_all(self, outputs: List[Any], inputs: List[Any], call: Call) -> Outcome:
        outs = [GpuArray.of(t, f"output_tensor_list[{j}]") for j, t in enumerate(outputs)]
        ins = [GpuArray.of(t, f"input_tensor_list[{j}]") for j, t in enumerate(inputs)]

        def body(comm: Any, stream: Any) -> List[Any]:
            sources = [self._flat_in(a) for a in ins]
            targets = [self._flat_out(o) for o in outs]
            self._exchange(comm, stream, list(enumerate(sources)),
                           [(j, buf) for j, (buf, _) in enumerate(targets)])
            for _, write_back in targets:
                write_back()
            return sources + [buf for buf, _ in targets]

        return self._handle(self._launch(_What.of(call), outs + ins, body), outs[0])

    def all_to_all_single(self, output: Any, tensor: Any, output_splits: List[int],
                          input_splits: List[int], call: Call) -> Outcome:
        out = GpuArray.of(output, "output")
        src = GpuArray.of(tensor, "input")

        def offsets(a: GpuArray, splits: List[int]) -> List[int]:
            rows = a.shape[0] if a.shape else a.numel
            per_row = a.numel // rows if rows else 0
            bounds = [0]
            for s in splits:
                bounds.append(bounds[-1] + s * per_row)
            return bounds

        def body(comm: Any, stream: Any) -> List[Any]:
            mine = self._flat_in(src)
            flat, write_back = self._flat_out(out)
            ib, ob = offsets(src, input_splits), offsets(out, output_splits)
            size = self.ctx.size
            self._exchange(comm, stream, [(j, mine[ib[j]:ib[j + 1]]) for j in range(size)],
                           [(j, flat[ob[j]:ob[j + 1]]) for j in range(size)])
            write_back()
            return [mine, flat]

        return self._handle(self._launch(_What.of(call), [out, src], body), out)

    def barrier(self, call: Call) -> Outcome:
        """Wait (host) for this rank's GPU work on the group, then meet the others."""
        what = _What.of(call)
        with self._lock:
            states = list(self._states.values())
        for state in states:
            with state.cond:
                last = state.inflight[-1] if state.inflight else None
            if last is not None:
                if not last.done.wait(what.timeout_s):
                    state.time_out(last.what, what.timeout_s, last)
                if last.error is not None:
                    raise last.error
        self.ctx.exchange(call, 0, None)
        return None

    # -- point to point
    def _p2p(self, kind: str, tensor: Any, peer: int, timeout_s: float) -> Completion:
        a = GpuArray.of(tensor)
        pending: Optional[List[_Deferred]] = getattr(self._batch, "ops", None)
        if pending is not None:
            item = _Deferred(kind, a, peer, timeout_s, threading.Event())
            pending.append(item)
            return item.completion()
        what = _What(kind, -1, timeout_s)

        def body(comm: Any, stream: Any) -> List[Any]:
            if kind == "send":
                buf = self._flat_in(a)
                self._exchange(comm, stream, [(peer, buf)], [])
                return [buf]
            buf, write_back = self._flat_out(a)
            self._exchange(comm, stream, [], [(peer, buf)])
            write_back()
            return [buf]

        handle = self._handle(self._launch(what, [a], body), a,
                              peer if kind == "recv" else None)
        return lambda: handle

    def send(self, tensor: Any, dst: int, tag: int, timeout_s: float) -> Completion:
        return self._p2p("send", tensor, dst, timeout_s)

    def recv(self, tensor: Any, src: Optional[int], tag: int, timeout_s: float) -> Completion:
        if src is None:
            raise ValueError("recv from any source (src=None) is not supported by the NCCL "
                             "backend: pass src")
        return self._p2p("recv", tensor, src, timeout_s)

    @contextlib.contextmanager
    def batch_p2p(self) -> Iterator[None]:
        if getattr(self._batch, "ops", None) is not None:  # nested: part of the outer batch
            yield
            return
        ops: List[_Deferred] = []
        self._batch.ops = ops
        ok = False
        try:
            yield
            ok = True
        finally:
            self._batch.ops = None
            self._issue(ops, ok)

    def _issue(self, items: List[_Deferred], ok: bool) -> None:
        """Issue a batch's sends and receives as one NCCL group call per device."""
        if not items:
            return
        if not ok:
            error = errors.CollectiveError("batch_isend_irecv failed before its operations "
                                           "were issued", group=self.ctx.group_name)
            for item in items:
                item.error = error
                item.ready.set()
            return
        by_device: Dict[int, List[_Deferred]] = collections.defaultdict(list)
        for item in items:
            by_device[item.array.device].append(item)
        for group in by_device.values():
            what = _What("batch_isend_irecv", -1, max(i.timeout_s for i in group))

            def body(comm: Any, stream: Any, group: List[_Deferred] = group) -> List[Any]:
                sends = [(i.peer, self._flat_in(i.array)) for i in group if i.kind == "send"]
                targets = [(i.peer, self._flat_out(i.array)) for i in group if i.kind == "recv"]
                self._exchange(comm, stream, sends, [(p, buf) for p, (buf, _) in targets])
                for _, (_, write_back) in targets:
                    write_back()
                return [buf for _, buf in sends] + [buf for _, (buf, _) in targets]

            try:
                op = self._launch(what, [i.array for i in group], body)
            except BaseException as exc:
                for item in group:
                    item.error = exc
                    item.ready.set()
                raise
            for item in group:
                item.handle = self._handle(op, item.array,
                                           item.peer if item.kind == "recv" else None)
                item.ready.set()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            states = list(self._states.values())
        for state in states:
            state.close()
