"""``ProcessGroup``: one group of ranks, its sequence numbers and its device -> backend map.

A ``ProcessGroup`` knows its ranks (its members' global ranks, in group-rank order), the
coordinator it talks to, its device -> backend map, and its sequence numbers. It runs every
operation either inline (a synchronous call with nothing queued) or on its own single worker
thread, so that operations on one group complete in issue order. Backends are created lazily,
one per device kind.

The per-process registry of groups (the default group, groups by name) is
:mod:`raycoll.world`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from raycoll import debug, errors
from raycoll.backends import BackendConfig
from raycoll.backends.base import CollectiveBackend, Completion
from raycoll.context import Call, GroupContext, Route
from raycoll.coordinator import CoordinatorClient
from raycoll.object_api import ObjectAPI
from raycoll.options import GroupOptions
from raycoll.transport.base import overlapping
from raycoll.transport.selection import GroupTransports
from raycoll.work import DevicePending, Work

logger = logging.getLogger("raycoll")

__all__ = ["ProcessGroup", "GroupSpec", "DEFAULT_TIMEOUT_S"]

#: The default collective timeout (torch's default process-group timeout, 30 minutes).
DEFAULT_TIMEOUT_S = 30 * 60.0
#: How long a rank that found its group broken waits for the coordinator to record it.
ABORT_RECORD_S = 2.0

#: The key of the backend for bfloat16 CPU tensors among a group's backends.
_BFLOAT16_CPU = "cpu:bfloat16"


@dataclass(frozen=True)
class GroupSpec:
    """What a rank needs to join a root group: sent by the driver or built by the rank."""

    name: str
    world_size: int
    backend: Optional[str]
    timeout_s: float
    coordinator: Any  # ActorHandle
    options: GroupOptions = field(default_factory=GroupOptions)
    by_name: bool = False  # formed by init_process_group (rendezvous by name)


@dataclass
class _Root:
    """State shared by a root group and its subgroups."""

    name: str
    client: CoordinatorClient
    members: List[Dict[str, Any]]
    options: GroupOptions
    secret: Optional[bytes] = None
    by_name: bool = False
    generation: int = 0  # of the membership, moved on by shrink and grow (raycoll.elastic)


class ProcessGroup(ObjectAPI):
    """A group of ranks that run collectives together (``torch.distributed.ProcessGroup``);
    torch's object API (``pg.allreduce([t], opts)``, ...) comes from
    :class:`raycoll.object_api.ObjectAPI`."""

    def __init__(
        self,
        *,
        name: str,
        rank: int,
        global_ranks: Sequence[int],
        root: _Root,
        config: BackendConfig,
        timeout_s: float,
        parent: Optional["ProcessGroup"] = None,
        backend_name: Optional[str] = None,
        group_desc: Optional[str] = None,
    ) -> None:
        self._name = name
        self._backend_name = backend_name
        self._group_desc = group_desc
        self._rank = rank
        self._global_ranks = tuple(global_ranks)
        self._root = root
        self._config = config
        self._timeout_s = timeout_s
        self._parent = parent
        self._lock = threading.Lock()
        self._seq = 0
        self._outstanding = 0
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._p2p_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._backends: Dict[str, CollectiveBackend] = {}
        self._broken: Optional[BaseException] = None
        self._destroyed: Optional[str] = None
        self._subgroup_calls: Dict[tuple, int] = defaultdict(int)
        self._debug = debug.debug_enabled()  # RAYCOLL_DEBUG: trace every operation
        #: Whether this is the process's default group (kept by :mod:`raycoll.world`).
        self.is_default = False
        self.context = GroupContext(
            group_name=name,
            rank=rank,
            global_ranks=self._global_ranks,
            node_ids=[root.members[g].get("node_id", "") for g in self._global_ranks],
            client=root.client,
            timeout_s=timeout_s,
            on_failure=self._on_backend_failure,
            options=root.options,
            actors=[root.members[g].get("actor") for g in self._global_ranks],
            addresses=[root.members[g].get("addr") for g in self._global_ranks],
            secret=root.secret,
            transports=GroupTransports,
            native=all(root.members[g].get("native", False) for g in self._global_ranks),
        )

    # ------------------------------------------------------------------ torch-like accessors
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    def size(self) -> int:
        """The number of ranks in the group."""
        return len(self._global_ranks)

    @property
    def group_name(self) -> str:
        """The group's name (subgroups: ``root/ranks#n``)."""
        return self._name

    @property
    def name(self) -> str:
        """The same as :attr:`group_name`."""
        return self._name

    @property
    def global_ranks(self) -> tuple:
        """Members' global ranks, indexed by group rank."""
        return self._global_ranks

    @property
    def timeout_s(self) -> float:
        """The group's collective timeout, in seconds."""
        return self._timeout_s

    @property
    def backend_config(self) -> BackendConfig:
        """The group's device -> backend map."""
        return self._config

    @property
    def backend_name(self) -> str:
        """The backend string the group was formed with, lower case (``"undefined"`` for
        ``None``), as torch's ``get_backend`` reports it; :attr:`backend_config` is the map."""
        given = self._backend_name
        return "undefined" if given is None else given.strip().lower()

    @property
    def group_desc(self) -> str:
        """The description given to ``new_group(group_desc=...)``; else torch's defaults,
        ``"default_pg"`` for this process's default group and ``"undefined"`` otherwise."""
        if self._group_desc is not None:
            return self._group_desc
        return "default_pg" if self.is_default else "undefined"

    @property
    def root_name(self) -> str:
        """The name of the root group this (sub)group belongs to."""
        return self._root.name

    @property
    def by_name(self) -> bool:
        """True for a root group formed by ``init_process_group`` (rendezvous by name)."""
        return self._root.by_name and self._parent is None

    @property
    def client(self) -> CoordinatorClient:
        """The line to the coordinator of the group's root group."""
        return self._root.client

    @property
    def node_ids(self) -> Tuple[str, ...]:
        """Each member's Ray node id, indexed by group rank."""
        return self.context.node_ids

    @property
    def transport_name(self) -> str:
        """The round transport the group uses: ``"lane"``, ``"tcp"``, ``"store"``, or
        ``"undecided"`` before its first collective (see :mod:`raycoll.transport`)."""
        return self.context.transport_name

    @property
    def lane_active(self) -> bool:
        """Whether the group's node segment is set up, on which join rounds run (alike on
        every rank between collectives)."""
        return self.context.transport_active

    @property
    def last_route(self) -> Optional[Route]:
        """How this rank's last CPU collective on the group moved its data: the transport,
        its rounds and its steps through the coordinator (:class:`raycoll.context.Route`),
        or ``None`` before the first one. Read-only; for tests and debugging."""
        return self.context.last_route

    def counters(self) -> Dict[str, Any]:
        """This rank's traffic on the group's direct connections, exact (for tests, tuning
        and ``group_status``): ``{"collectives": {op: counts}, "sockets": n, "p2p_sockets":
        n, "peak_recv_buffer_bytes": n}``, where ``counts`` has the bytes sent and received to
        ranks on the same node and on other nodes, the messages each way, the rounds this rank
        took part in and its distinct peers (:data:`raycoll.transport.counters.COUNTER_NAMES`),
        summed since the group formed. Empty ``collectives`` where the group has no direct connections (the lane, the
        store)."""
        return self.context.counters()

    def gather_round(self, call: Call, seq: Optional[int]) -> Optional[List[Optional[int]]]:
        """Every rank's join sequence number ``seq`` for ``call``, by group rank, through the
        node segment; ``None`` when the group has none."""
        return self.context.gather_round(call, seq)

    def report_progress(self, wait_s: float = 0.0) -> None:
        """Send the coordinator what this rank's round transport knows of every rank's
        progress (for ``group_status``; waiting up to ``wait_s`` for it to be taken)."""
        self.context.transport_report(wait_s)

    def error_context(self, call: Call) -> Dict[str, Any]:
        """The keyword arguments of a raycoll error about ``call`` on this rank."""
        return self.context.ctx(call)

    def __repr__(self) -> str:
        return f"<raycoll.ProcessGroup {self._name!r} rank={self._rank} size={self.size()}>"

    # ------------------------------------------------------------------ dispatch
    def backend(self, device: str) -> CollectiveBackend:
        """The backend serving ``device`` tensors, created on first use."""
        backend = self._backends.get(device)
        if backend is None:
            backend = self._config.create(device, self.context, self._name)
            self._backends[device] = backend
        return backend

    def bfloat16_backend(self) -> CollectiveBackend:
        """The backend for bfloat16 CPU tensors, which numpy cannot hold: the CPU path through
        host copies (:mod:`raycoll.backends.staged`: reduced in float32 and rounded back, moved
        as their bits), created on first use."""
        backend = self._backends.get(_BFLOAT16_CPU)
        if backend is None:
            from raycoll.backends.cpu import ObjstoreBackend
            from raycoll.backends.staged import StagedBackend

            if not isinstance(self.backend("cpu"), ObjstoreBackend):
                raise TypeError(
                    f"group {self._name!r} serves CPU tensors with backend "
                    f"{self._config.device_backend_map['cpu']!r}, which cannot hold bfloat16 "
                    "(numpy has none): convert the tensor (.float())")
            backend = self._backends[_BFLOAT16_CPU] = StagedBackend(self.context)
        return backend

    def outstanding(self) -> int:
        """How many operations are queued or running on the group's worker thread."""
        with self._lock:
            return self._outstanding

    def check_usable(self) -> None:
        """Raise ``GroupDestroyedError`` / ``GroupBrokenError`` if the group is unusable."""
        if self._destroyed is not None:
            raise errors.GroupDestroyedError(
                f"group {self._name!r} was destroyed ({self._destroyed}); form it again to use it"
            )
        if self._broken is not None:
            raise errors.GroupBrokenError(
                f"group {self._name!r} is broken by an earlier failure ({self._broken}); destroy "
                "it and form it again", group=self._name, rank=self.global_ranks[self._rank],
            ) from self._broken

    def take_seq(self) -> int:
        """The next collective's sequence number (the caller checked the group is usable)."""
        with self._lock:
            self._seq += 1
            return self._seq

    def new_call(self, op: str) -> Call:
        """Take the next sequence number for collective ``op`` (fingerprint set later)."""
        self.check_usable()
        return Call(op, self.take_seq(), self._timeout_s, {"op": op})

    def with_fingerprint(self, call: Call, **fp: Any) -> Call:
        """``call`` with its fingerprint (compared across ranks) set to ``fp``."""
        return Call(call.op, call.seq, call.timeout_s, dict(fp, op=call.op))

    def fast_all_reduce(self, arr: Any, op: Any) -> bool:
        """``raycoll.all_reduce``'s short path: a synchronous all_reduce of a plain numpy
        array on a group whose node segment, or native sockets, are set up, with nothing
        queued before it, run straight on them (a few microseconds of Python, not tens).
        ``False`` (nothing done, no sequence number taken) where any of that does not hold:
        the caller takes the full path, which checks the arguments and raises their errors."""
        plane = getattr(self.context._plane, "fast", None)  # the segment, or native sockets
        if (plane is None or self._outstanding or self._debug
                or self._broken is not None or self._destroyed is not None):
            return False
        flags = arr.flags
        if not (flags.writeable and flags.c_contiguous):
            return False
        entry = plane.fast_plan(arr, op)
        if entry is False:
            return False
        try:
            plane.run_fast(entry, self.take_seq(), self._timeout_s, arr)
            return True
        except (errors.GroupBrokenError, errors.DistTimeoutError) as exc:
            if self._broken is None:
                self._broken = exc
            raise

    def pair_pipes(self) -> Any:
        """The pair pipes of ``raycoll.send``/``recv``'s short path (the cpu backend's, once
        set up) where the group is usable and untraced; else ``None``: the full path."""
        if self._destroyed is not None or self._broken is not None or self._debug:
            return None
        return getattr(self._backends.get("cpu"), "pair_pipes", None)

    def reject(self, call: Call, exc: BaseException) -> None:
        """Tell the peers that this rank rejected its arguments for ``call`` (no wait)."""
        if self.size() > 1:
            self._root.client.submit_reject(self._name, self._global_ranks, call.seq,
                                            self._rank, call.op, str(exc))

    def run(self, call: Call, fn: Callable[[], Any], async_op: bool,
            outputs: Optional[List[Any]] = None) -> Optional[Work]:
        """Run ``fn`` for ``call`` in issue order; a ``Work`` when ``async_op``."""
        nbytes = debug.message_bytes(outputs) if self._debug else None
        if self._stream_ordered(call):
            return self._run_on_stream(call, fn, async_op, outputs, nbytes)
        if not async_op:
            if not self.outstanding():  # the caller checked the group just now
                self._execute(call, fn, nbytes, checked=True)
            else:
                self._submit(call, fn, nbytes).result()
            return None
        # until someone waits for the Work, the caller computes beside it: no spinning
        waited = threading.Event()
        future = self._submit(call, fn, nbytes, waited)
        return Work(future, describe=f"{call.op} #{call.seq} on group {self._name!r}",
                    on_timeout=lambda s: self._work_timed_out(call, s), outputs=outputs,
                    on_wait=waited.set)

    # -- stream-ordered backends (NCCL): enqueue in the caller's thread, in issue order
    def _stream_ordered(self, call: Call) -> bool:
        backend = self._backends.get(str(call.fp.get("device", "")))
        return bool(backend is not None and backend.stream_ordered)

    def _drain(self) -> None:
        """Wait until what is queued on the worker thread has run, so that device work is
        enqueued in issue order (each queued operation is bounded by its own timeout)."""
        with self._lock:
            queued, executor = self._outstanding, self._executor
        if queued and executor is not None:
            executor.submit(lambda: None).result(timeout=self._timeout_s * (queued + 1) + 60.0)

    def _run_on_stream(self, call: Call, fn: Callable[[], Any], async_op: bool,
                       outputs: Optional[List[Any]], nbytes: Optional[int]) -> Optional[Work]:
        """Enqueue now; the device work stays pending (torch's semantics for NCCL): a sync call
        makes the caller's current stream wait for it, ``Work.wait()`` does so later."""
        self._drain()
        result = self._execute(call, fn, nbytes)
        if async_op:
            done: "concurrent.futures.Future[Any]" = concurrent.futures.Future()
            done.set_result(result)
            return Work(done, describe=f"{call.op} #{call.seq} on group {self._name!r}",
                        outputs=outputs)
        if isinstance(result, DevicePending):
            result.wait(None)
        return None

    def _global_source(self, value: Any) -> Any:
        """A p2p completion's value with the source rank made global."""
        if isinstance(value, DevicePending):
            if value.source is not None:
                value.source = self._global_ranks[value.source]
            return value
        return self._global_ranks[value] if value is not None else None

    def run_p2p(self, post: Callable[[], Completion], async_op: bool, describe: str,
                outputs: Optional[List[Any]] = None,
                op: str = "p2p", ordered: bool = False) -> Union[Work, Optional[int]]:
        """Post a send/recv now; wait for it now, or return a ``Work``. ``ordered``: the
        backend is stream-ordered (queued operations are enqueued first)."""
        self.check_usable()
        if ordered:
            self._drain()
        start = time.perf_counter()
        completion = post()

        def finish() -> Any:
            if not self._debug:
                return self._global_source(completion())
            error: Optional[BaseException] = None
            try:
                return self._global_source(completion())
            except BaseException as exc:
                error = exc
                raise
            finally:
                debug.trace(rank=self.global_ranks[self._rank], group=self._name, op=op,
                            seq=None, nbytes=debug.message_bytes(outputs),
                            seconds=time.perf_counter() - start, error=error)

        if not async_op:
            value = finish()
            if isinstance(value, DevicePending):
                value.wait(None)
                return value.source
            return value
        with self._lock:
            if self._p2p_pool is None:
                self._p2p_pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=4, thread_name_prefix=f"raycoll-p2p-{self._name}")
        waited = threading.Event()  # as for collectives: no spinning until someone waits

        def overlapped() -> Any:
            with overlapping(waited):
                return finish()

        return Work(self._p2p_pool.submit(overlapped), describe=describe, outputs=outputs,
                    on_wait=waited.set)

    def _submit(self, call: Call, fn: Callable[[], Any], nbytes: Optional[int] = None,
                waited: Optional[threading.Event] = None) -> "concurrent.futures.Future[Any]":
        """Queue ``fn`` on the group's worker thread; ``waited``: set once someone waits for
        it (until then its transport waits do not spin: see ``transport.base.overlapping``)."""
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"raycoll-{self._name}")
            self._outstanding += 1
        try:
            future = self._executor.submit(self._execute, call, fn, nbytes, waited)
        except RuntimeError:
            with self._lock:
                self._outstanding -= 1
            self.check_usable()
            raise
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: "concurrent.futures.Future[Any]") -> None:
        with self._lock:
            self._outstanding -= 1

    def _execute(self, call: Call, fn: Callable[[], Any], nbytes: Optional[int] = None,
                 waited: Optional[threading.Event] = None, checked: bool = False) -> Any:
        if waited is not None:
            with overlapping(waited):
                return self._execute(call, fn, nbytes)
        if not checked:  # queued: the group may have broken meanwhile
            self.check_usable()
        fn = self._guarded(call, fn)
        if self._debug:
            return self._execute_traced(call, fn, nbytes)
        try:
            return fn()
        except (errors.GroupBrokenError, errors.DistTimeoutError) as exc:
            if self._broken is None:
                self._broken = exc
            raise

    def _execute_traced(self, call: Call, fn: Callable[[], Any], nbytes: Optional[int]) -> Any:
        """``_execute`` with the ``RAYCOLL_DEBUG`` trace record (see :mod:`raycoll.debug`)."""
        start = time.perf_counter()
        error: Optional[BaseException] = None
        try:
            return fn()
        except BaseException as exc:
            error = exc
            if isinstance(exc, (errors.GroupBrokenError, errors.DistTimeoutError)) \
                    and self._broken is None:
                self._broken = exc
            raise
        finally:
            debug.trace(rank=self.global_ranks[self._rank], group=self._name, op=call.op,
                        seq=call.seq, nbytes=nbytes, seconds=time.perf_counter() - start,
                        error=error)

    def _guarded(self, call: Call, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn``, breaking the group if it fails with an unexpected (non-raycoll) error of
        any class (an interrupt, ``SystemExit`` and ``MemoryError`` included).

        Such an error comes after the call was issued (arguments are checked before), so the
        peers may be waiting for this rank inside the collective: they get GroupBrokenError
        naming this rank and the error at once, instead of waiting out the timeout.
        """
        def guarded() -> Any:
            try:
                return fn()
            except errors.RaycollError:
                raise
            except BaseException as exc:  # KeyboardInterrupt, SystemExit, MemoryError too
                if self._broken is None:
                    self._broken = exc
                if self.size() > 1 and self._destroyed is None:  # (see _on_backend_failure)
                    me = self.global_ranks[self._rank]
                    self._root.client.submit_abort(
                        self._name, "aborted",
                        f"{call.op} #{call.seq} on group {self._name!r}: rank {me} failed inside "
                        f"it ({type(exc).__name__}: {exc}); the group is broken", {},
                        self._root.generation)
                raise

        return guarded

    def _on_backend_failure(self, exc: BaseException) -> None:
        if self._broken is None:
            self._broken = exc
        if self._destroyed is not None:  # its own close failed it: tell no one (the name may
            return  # serve the group's next generation already, raycoll.elastic)
        failed = getattr(exc, "failed_ranks", ())
        key = self._root.name if failed else self._name
        kind = "rank_failed" if failed else "aborted"
        # Recorded before the caller closes this rank's connections: a peer that sees them
        # close then asks the coordinator and learns why, rather than taking this rank for dead.
        try:
            self._root.client.abort(key, kind, str(exc), {"failed_ranks": list(failed)},
                                    timeout_s=ABORT_RECORD_S, generation=self._root.generation)
        except errors.RaycollError:
            pass  # the coordinator is gone or stuck: the peers judge by their connections

    def _work_timed_out(self, call: Call, seconds: float) -> BaseException:
        missing: List[int] = []
        detail = ""
        try:
            on_transport = self.context.transport_missing(call.seq)
            if on_transport is not None:  # the call waits on the round transport
                waiting, done = on_transport
                missing = [self._global_ranks[r] for r in waiting]
                lasts = {self._global_ranks[r]: done.get(r) for r in waiting}
            else:
                info = self._root.client.pending(self._name, call.seq)
                missing = list(info["missing"])
                lasts = info.get("last", {})
            detail = "; ".join(
                f"rank {g} last completed {last[0]} #{last[1]}" if (last := lasts.get(g))
                else f"rank {g} completed nothing on this group" for g in missing)
        except errors.RaycollError as exc:  # the coordinator itself is gone or stuck
            detail = f"the coordinator could not say who is missing: {exc}"
        who = f"ranks {missing} had not arrived" if missing else "all ranks had arrived"
        err = errors.DistTimeoutError(
            f"{call.op} #{call.seq} on group {self._name!r} did not complete within "
            f"{seconds:g}s: {who} ({detail})",
            missing=missing, op=call.op, seq=call.seq, group=self._name,
            rank=self.global_ranks[self._rank],
        )
        if self._broken is None:
            self._broken = err
        if self._destroyed is None:  # (see _on_backend_failure)
            self._root.client.submit_abort(self._name, "timeout", str(err), {"missing": missing},
                                           self._root.generation)
        return err

    def close(self, reason: str) -> None:
        """Mark destroyed, release the backends and worker threads (does not wait)."""
        if self._destroyed is not None:
            return
        self._destroyed = reason
        if self._broken is not None:  # its frames hold the failed call's arrays and object refs
            traceback.clear_frames(self._broken.__traceback__)
        for pool in (self._executor, self._p2p_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        for backend in self._backends.values():
            try:
                backend.close()
            except Exception:  # noqa: BLE001 - best effort on teardown
                logger.exception("closing backend of group %r failed", self._name)
        self._backends.clear()
        self.context.close()

    def next_subgroup_name(self, ranks: Sequence[int]) -> str:
        """A name every member derives alike: the ranks and how often they were grouped."""
        key = tuple(ranks)
        with self._lock:
            count = self._subgroup_calls[key]
            self._subgroup_calls[key] += 1
        return f"{self._root.name}/{'-'.join(map(str, key))}#{count}"
