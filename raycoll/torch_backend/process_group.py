"""The torch-facing half of :mod:`raycoll.torch_backend` (imports torch; imported lazily).

- :class:`RaycollProcessGroup`, a ``torch.distributed.ProcessGroup`` subclass whose methods
  are the ones torch's frontend (and DDP's C++ reducer) call, each mapped onto raycoll's
  collectives on one raycoll group: torch's default group is the rank's default raycoll
  group, a ``torch.distributed.new_group`` a raycoll subgroup of it.
- :class:`RaycollWork`, a ``torch.distributed.Work`` with a real ``torch.futures.Future``
  (DDP's comm hooks chain on it). raycoll's own errors (a dead rank, a timeout, a mismatch)
  reach ``wait()`` with their types, and the future's error with their messages.
- the store and rendezvous torch insists on are in :mod:`raycoll.torch_backend.rendezvous`.

Sparse COO tensors go to raycoll's sparse all_reduce (SUM, gloo's semantics; DDP over an
``nn.Embedding(sparse=True)``); every other call refuses them before anything moves.
Tensors raycoll cannot take as they are are staged (:class:`_Stage`): bfloat16 reduces in
float32 (numpy has no bfloat16) and moves as its int16 bits otherwise; non-contiguous tensors
travel as contiguous copies; results are copied back before the work completes.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from raycoll import collectives as rc
from raycoll import multi
from raycoll import p2p
from raycoll import errors
from raycoll.torch_backend.names import GroupNames
from raycoll.torch_backend.rendezvous import (_default_group, _install_rendezvous,
                                              _rank_and_size)
from raycoll.process_group import ProcessGroup as RaycollGroup
from raycoll.groups import destroy_process_group, new_group
from raycoll.reduce_op import ReduceOp, as_reduce_op
from raycoll.work import future_error

__all__ = ["RaycollProcessGroup", "RaycollWork", "register", "create_backend"]

_NAME = "raycoll"
_STARTED = Callable[[bool], Any]  # async_op -> raycoll Work (or list of them) / None


def create_backend(common: Any, backend_options: Any) -> "RaycollProcessGroup":
    """torch's backend factory (``extended_api=True``): a group over raycoll's group."""
    if backend_options is not None:
        raise ValueError(f"backend 'raycoll' takes no pg_options, got {backend_options!r}")
    default = _default_group()
    if default is None:
        _rank_and_size("")  # raises, saying what to do
        raise AssertionError("unreachable")
    ranks = [int(r) for r in common.global_ranks_in_group]
    if not ranks:  # torch's default group
        if (common.group_rank, common.group_size) != (default.rank(), default.size()):
            raise ValueError(
                f"torch's default group has rank {common.group_rank} of {common.group_size}, "
                f"this rank's raycoll group {default.name!r} rank {default.rank()} of "
                f"{default.size()}")
        return RaycollProcessGroup(default, owned=False)
    from torch.distributed.constants import default_pg_timeout

    # torch's default timeout means none was given: the subgroup keeps the raycoll group's
    timeout = None if common.timeout == default_pg_timeout else common.timeout
    sub = new_group(ranks, timeout=timeout)
    if not isinstance(sub, RaycollGroup):  # torch only asks members
        raise ValueError(f"this rank is not in new_group(ranks={ranks})")
    return RaycollProcessGroup(sub, owned=True)


def register(dist_module: Any) -> None:
    """Register the backend and the rendezvous (called once by torch_backend.register)."""
    if "RAYCOLL" not in dist_module.Backend._plugins:
        dist_module.Backend.register_backend(_NAME, create_backend, extended_api=True,
                                             devices=["cpu", "cuda"])
    _install_rendezvous()


# ---------------------------------------------------------------------- staging
_REDUCE_IN_FLOAT32 = (torch.bfloat16,)


class _Stage:
    """Tensors as raycoll takes them, and the copies back into torch's once done."""

    def __init__(self) -> None:
        self._back: List[Tuple[torch.Tensor, torch.Tensor]] = []

    @staticmethod
    def _staged(t: torch.Tensor, reduce: bool) -> torch.Tensor:
        if reduce and t.dtype in _REDUCE_IN_FLOAT32:
            return t.detach().to(torch.float32, memory_format=torch.contiguous_format)
        return t.detach() if t.is_contiguous() else t.detach().contiguous()

    @staticmethod
    def _raw(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16) if t.dtype == torch.bfloat16 else t

    def inp(self, t: torch.Tensor, reduce: bool = False) -> torch.Tensor:
        """What raycoll reads for ``t``."""
        return self._raw(self._staged(t, reduce))

    def out(self, t: torch.Tensor, reduce: bool = False) -> torch.Tensor:
        """What raycoll writes for ``t`` (copied back into ``t`` by :meth:`finish`)."""
        staged = self._staged(t, reduce)
        if staged.data_ptr() != t.data_ptr() or staged.dtype != t.dtype:
            self._back.append((t, staged))
        return self._raw(staged)

    def finish(self) -> None:
        with torch.no_grad():
            for t, staged in self._back:
                t.copy_(staged)


def _reduce_op(opts: Any) -> ReduceOp:
    """raycoll's op for torch's ``opts.reduceOp``: every torch op, PREMUL_SUM with its factor
    too (FSDP2's ``set_gradient_divide_factor``; gloo refuses it)."""
    return as_reduce_op(getattr(opts, "reduceOp", dist.ReduceOp.SUM))


def _one(tensors: Sequence[Any], name: str) -> Any:
    if len(tensors) != 1:
        raise ValueError(f"backend 'raycoll' takes one tensor per call in {name}, got "
                         f"{len(tensors)} (one per device is not supported)")
    return tensors[0]


def _root(opts: Any) -> int:
    """The root's rank in the group (torch 2.13 passes group ranks)."""
    return int(getattr(opts, "rootRank", 0)) if opts is not None else 0


def _seconds(timeout: Any) -> Optional[float]:
    """torch's ``Work.wait`` timeout: a timedelta (0: none, c10d's kNoTimeout) or seconds."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return seconds if seconds > 0 else None


# ---------------------------------------------------------------------- work
def _unwrap(fut: torch.futures.Future) -> Any:
    return fut.value()  # raises the operation's error


class RaycollWork(dist.Work):
    """torch's ``Work`` over one or more raycoll ``Work`` handles (coalesced calls)."""

    def __init__(self, works: Sequence[Any], outputs: List[torch.Tensor],
                 finish: Optional[Callable[[], None]] = None,
                 source: Optional[Callable[[int], int]] = None) -> None:
        super().__init__()
        self._works = list(works)
        self._outputs = outputs
        self._finish = finish
        self._source = source
        # torch.futures.Future.set_exception stores the exception as the value, which only
        # Python unwraps: DDP's C++ reducer would read it as a result. A callback that raises
        # gives the chained future a real error, which C++ sees.
        self._settled: torch.futures.Future = torch.futures.Future()
        self._future: torch.futures.Future = self._settled.then(_unwrap)
        self._error: Optional[BaseException] = None
        self._left = len(self._works)
        self._lock = threading.Lock()
        if not self._works:
            self._complete()
        for work in self._works:
            work.get_future().add_done_callback(self._one_done)

    def _one_done(self, fut: Any) -> None:
        error: Optional[BaseException] = None
        try:
            fut.value()
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            error = exc
        with self._lock:
            self._left -= 1
            if error is not None and self._error is None:
                self._error = error
            last = self._left == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        if self._error is None and self._finish is not None:
            try:
                self._finish()
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                self._error = exc
        if self._error is not None:
            self._settled.set_exception(future_error(self._error))
        else:
            self._settled.set_result(self._outputs)

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the operation; raise raycoll's error (typed) if it failed."""
        seconds = _seconds(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        for work in self._works:  # one timeout for them all, as torch's wait(timeout)
            work.wait(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
        self._future.wait()  # the copies back are done too
        return True

    def get_future(self) -> torch.futures.Future:
        """torch's future (the C++ one, as gloo's), completed with the output tensors (a
        list), or with raycoll's error."""
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def _source_rank(self) -> int:
        """For ``recv`` from any source: the sender's rank in this group."""
        if self._source is None or len(self._works) != 1:
            raise RuntimeError("_source_rank() is only defined for a receive")
        return self._source(self._works[0].source_rank())

    source_rank = _source_rank


# ---------------------------------------------------------------------- the process group
class RaycollProcessGroup(GroupNames, dist.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` whose collectives run on a raycoll group.

    torch's Python backend API calls these methods as its C++ ``ProcessGroup`` declares them
    (tensors in lists, then an options object); torch's stubs declare the Python-facing
    overloads instead, with other parameter names, so each override carries ``type: ignore``
    for that.
    """

    def __init__(self, group: RaycollGroup, owned: bool) -> None:
        # (rank, size): the constructor with a store makes a plain C++ group, not the
        # Python-overridable one (pybind: "not an alias instance"); torch's stubs declare
        # only the one with a store
        super().__init__(group.rank(), group.size())  # type: ignore[call-arg, arg-type]
        self._rc = group
        self._owned = owned  # a subgroup torch's new_group made: destroyed with it

    @property
    def raycoll_group(self) -> RaycollGroup:
        """The raycoll group this torch group runs on."""
        return self._rc

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return _NAME

    def __repr__(self) -> str:
        return f"<RaycollProcessGroup over {self._rc!r}>"

    def shutdown(self) -> None:
        """torch's destroy_process_group: a subgroup goes; the default raycoll group stays
        (the rank's launcher owns it)."""
        if self._owned:
            try:
                destroy_process_group(self._rc)
            except errors.RaycollError:
                pass

    def abort(self) -> None:
        self.shutdown()

    # -- the one path every operation takes
    def _launch(self, opts: Any, outputs: List[torch.Tensor],
                finish: Optional[Callable[[], None]], start: _STARTED) -> RaycollWork:
        """Run ``start(async_op)``: at once when torch's ``opts.asyncOp`` is false, else as a
        work that runs ``finish`` (the copies back, e.g. ``_Stage.finish``) before it
        completes."""
        if opts is not None and not getattr(opts, "asyncOp", True):
            start(False)
            if finish is not None:
                finish()
            return RaycollWork([], outputs)
        started = start(True)
        works = [w for w in (started if isinstance(started, list) else [started]) if w is not None]
        return RaycollWork(works, outputs, finish)

    # -- reductions
    def allreduce(  # type: ignore[override]  # C++ signature: see the class docstring
            self, tensors: List[torch.Tensor], opts: Any = None) -> RaycollWork:
        if any(x.is_sparse for x in tensors):  # DDP's gradients of a sparse nn.Embedding
            op = _reduce_op(opts)
            return self._launch(opts, list(tensors), None, lambda a: rc.all_reduce_sparse(
                list(tensors), op=op, group=self._rc, async_op=a))
        if len(tensors) > 1:  # gloo's: every tensor of every rank reduced together
            op, stage = _reduce_op(opts), _Stage()
            xs = [stage.out(x, reduce=True) for x in tensors]
            return self._launch(opts, list(tensors), stage.finish,
                                lambda a: multi.all_reduce_multi(xs, op, self._rc, a))
        t = _one(tensors, "allreduce")
        op, stage = _reduce_op(opts), _Stage()
        x = stage.out(t, reduce=True)
        return self._launch(opts, [t], stage.finish,
                            lambda a: rc.all_reduce(x, op=op, group=self._rc, async_op=a))

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> RaycollWork:
        if not tensors:
            return RaycollWork([], [])
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise ValueError(f"allreduce_coalesced needs tensors of one dtype, got {dtypes}")
        op = _reduce_op(opts)
        dtype = torch.float32 if tensors[0].dtype in _REDUCE_IN_FLOAT32 else tensors[0].dtype
        flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])

        def finish() -> None:
            offset = 0
            with torch.no_grad():
                for t in tensors:
                    t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()

        return self._launch(opts, list(tensors), finish, lambda a: rc.all_reduce(
            flat, op=op, group=self._rc, async_op=a))

    def reduce(  # type: ignore[override]  # C++ signature: see the class docstring
            self, tensors: List[torch.Tensor], opts: Any = None) -> RaycollWork:
        t = _one(tensors, "reduce")
        op, stage, root = _reduce_op(opts), _Stage(), _root(opts)
        x = stage.out(t, reduce=True)
        return self._launch(opts, [t], stage.finish, lambda a: rc.reduce(
            x, op=op, group=self._rc, async_op=a, group_dst=root))

    def reduce_scatter(  # type: ignore[override]  # C++ signature: see the class docstring
            self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]],
            opts: Any = None) -> RaycollWork:
        out, ins = _one(output_tensors, "reduce_scatter"), _one(input_tensors, "reduce_scatter")
        op, stage = _reduce_op(opts), _Stage()
        o = stage.out(out, reduce=True)
        i = [stage.inp(t, reduce=True) for t in ins]
        return self._launch(opts, [out], stage.finish, lambda a: rc.reduce_scatter(
            o, i, op=op, group=self._rc, async_op=a))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> RaycollWork:
        op, stage = _reduce_op(opts), _Stage()
        o, i = stage.out(output, reduce=True), stage.inp(input, reduce=True)
        return self._launch(opts, [output], stage.finish, lambda a: rc.reduce_scatter_tensor(
            o, i, op=op, group=self._rc, async_op=a))

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # C++ signature

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor],
                                        inputs: List[torch.Tensor], opts: Any = None) -> RaycollWork:
        return self._coalesced([(self.reduce_scatter_single, (o, i)) for o, i in zip(outputs, inputs)],
                               list(outputs), opts)

    # the C++ signature (see the class docstring)
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    # -- data movement
    def broadcast(  # type: ignore[override]  # C++ signature: see the class docstring
            self, tensors: List[torch.Tensor], opts: Any = None) -> RaycollWork:
        if len(tensors) > 1:  # gloo's: the root's tensors[rootTensor] into every tensor
            stage, root = _Stage(), _root(opts)
            xs = [stage.out(x) for x in tensors]
            index = int(getattr(opts, "rootTensor", 0))
            return self._launch(opts, list(tensors), stage.finish,
                                lambda a: multi.broadcast_multi(xs, root, index, self._rc, a))
        t = _one(tensors, "broadcast")
        stage, root = _Stage(), _root(opts)
        x = stage.out(t) if self._rc.rank() != root else stage.inp(t)
        return self._launch(opts, [t], stage.finish, lambda a: rc.broadcast(
            x, group=self._rc, async_op=a, group_src=root))

    def allgather(  # type: ignore[override]  # C++ signature: see the class docstring
            self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor],
            opts: Any = None) -> RaycollWork:
        outs, t = _one(output_tensors, "allgather"), _one(input_tensors, "allgather")
        stage = _Stage()
        o, i = [stage.out(x) for x in outs], stage.inp(t)
        return self._launch(opts, list(outs), stage.finish, lambda a: rc.all_gather(
            o, i, group=self._rc, async_op=a))

    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]],
                            input_list: List[torch.Tensor], opts: Any = None) -> RaycollWork:
        """``output_lists[r][i]`` gets rank r's ``input_list[i]`` (torch's layout)."""
        if len(output_lists) != self.size():
            raise ValueError(f"output_tensor_lists must have one list per rank ({self.size()}), "
                             f"got {len(output_lists)}")
        calls = [(self.allgather, ([[output_lists[r][i] for r in range(self.size())]], [t]))
                 for i, t in enumerate(input_list)]
        return self._coalesced(calls, [t for lst in output_lists for t in lst], opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> RaycollWork:
        stage = _Stage()
        o, i = stage.out(output), stage.inp(input)
        return self._launch(opts, [output], stage.finish, lambda a: rc.all_gather_into_tensor(
            o, i, group=self._rc, async_op=a))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    opts: Any = None) -> RaycollWork:
        return self._coalesced([(self.all_gather_single, (o, i)) for o, i in zip(outputs, inputs)],
                               list(outputs), opts)

    # the C++ signature (see the class docstring)
    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def _coalesced(self, calls: List[Tuple[Callable[..., RaycollWork], tuple]],
                   outputs: List[torch.Tensor], opts: Any) -> RaycollWork:
        works = [fn(*args, opts) for fn, args in calls]
        # the parts still running (none when they ran synchronously), waited alike
        return RaycollWork([w for w in works if w._works], outputs)

    def gather(  # type: ignore[override]  # C++ signature: see the class docstring
            self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor],
            opts: Any = None) -> RaycollWork:
        t, root, stage = _one(input_tensors, "gather"), _root(opts), _Stage()
        outs = list(output_tensors[0]) if self._rc.rank() == root and output_tensors else None
        o = [stage.out(x) for x in outs] if outs is not None else None
        i = stage.inp(t)
        return self._launch(opts, outs or [], stage.finish, lambda a: rc.gather(
            i, o, group=self._rc, async_op=a, group_dst=root))

    def scatter(  # type: ignore[override]  # C++ signature: see the class docstring
            self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]],
            opts: Any = None) -> RaycollWork:
        t, root, stage = _one(output_tensors, "scatter"), _root(opts), _Stage()
        ins = list(input_tensors[0]) if self._rc.rank() == root and input_tensors else None
        i = [stage.inp(x) for x in ins] if ins is not None else None
        o = stage.out(t)
        return self._launch(opts, [t], stage.finish, lambda a: rc.scatter(
            o, i, group=self._rc, async_op=a, group_src=root))

    def alltoall(self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor],
                 opts: Any = None) -> RaycollWork:
        stage = _Stage()
        o, i = [stage.out(x) for x in output_tensors], [stage.inp(x) for x in input_tensors]
        return self._launch(opts, list(output_tensors), stage.finish, lambda a: rc.all_to_all(
            o, i, group=self._rc, async_op=a))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: List[int], input_split_sizes: List[int],
                          opts: Any = None) -> RaycollWork:
        stage = _Stage()
        o, i = stage.out(output), stage.inp(input)
        outs = [int(s) for s in output_split_sizes] or None
        ins = [int(s) for s in input_split_sizes] or None
        return self._launch(opts, [output], stage.finish, lambda a: rc.all_to_all_single(
            o, i, outs, ins, group=self._rc, async_op=a))

    alltoall_base = all_to_all_single  # type: ignore[assignment]  # C++ signature

    # -- point to point (always asynchronous: torch waits when it wants to)
    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> RaycollWork:
        t = _one(tensors, "send")
        x = _Stage().inp(t)
        return RaycollWork([p2p.isend(x, group=self._rc, tag=int(tag), group_dst=int(dst))],
                           [t])

    def _recv(self, t: torch.Tensor, src: Optional[int], tag: int) -> RaycollWork:
        stage = _Stage()
        x = stage.out(t)
        work = p2p.irecv(x, group=self._rc, tag=int(tag), group_src=src)
        return RaycollWork([work], [t], stage.finish, source=self._rc.global_ranks.index)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> RaycollWork:
        return self._recv(_one(tensors, "recv"), int(src), tag)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> RaycollWork:
        return self._recv(_one(tensors, "recv_anysource"), None, tag)

    # -- synchronization
    def barrier(self, opts: Any = None) -> RaycollWork:
        return self._launch(opts, [], None, lambda a: rc.barrier(group=self._rc, async_op=a))

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """raycoll's monitored barrier (torch's frontend only lets gloo groups call it; call
        ``group.monitored_barrier(...)`` on this group directly)."""
        rc.monitored_barrier(group=self._rc, timeout=timeout, wait_all_ranks=wait_all_ranks)
