"""The NCCL backend's collectives: each one an NCCL call (or a group call) on the raycoll stream
of the tensors' device, with what NCCL lacks done there too (see the package's docstring).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from raycoll import errors
from raycoll.backends import _cuda
from raycoll.backends.base import Call, CollectiveBackend, Completion, GroupContext, Outcome
from raycoll.backends.nccl.comm import create_communicator
from raycoll.backends.nccl.device import Deferred, DeviceOp, DeviceState, Handle, What
from raycoll.backends.nccl.plan import ReducePlan, reduce_plan
from raycoll.reduce_op import ReduceOp
from raycoll.tensors import TensorInfo, describe_gpu

__all__ = ["NcclBackend", "BLOCKING_ENV"]

#: Environment variable that turns on blocking waits (as ``TORCH_NCCL_BLOCKING_WAIT``).
BLOCKING_ENV = "RAYCOLL_NCCL_BLOCKING_WAIT"
#: The NCCL type of data-movement operations: bytes, so that any dtype moves.
_BYTES = "NCCL_UINT8"


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
        self._states: Dict[int, DeviceState] = {}
        self._lock = threading.Lock()
        self._comm_count = 0
        self._batch = threading.local()
        self._closed = False

    # -- plumbing
    def err_ctx(self, what: What) -> Dict[str, Any]:
        return {"op": what.op, "seq": what.seq if what.seq >= 0 else None,
                "group": self.ctx.group_name, "rank": self.ctx.global_ranks[self.ctx.rank]}

    def _const(self, name: str) -> int:
        value = getattr(self.nccl, name, None)
        if value is None:
            raise TypeError(f"this cupy's NCCL binding lacks {name} (cupy {self.cp.__version__})")
        return int(value)

    def _state(self, device: int) -> DeviceState:
        with self._lock:
            if self._closed:
                raise errors.GroupDestroyedError(
                    f"group {self.ctx.group_name!r} was destroyed; its NCCL backend is closed")
            state = self._states.get(device)
            if state is None:
                state = self._states[device] = DeviceState(self, device)
            return state

    def _comm(self, state: DeviceState, what: What) -> Any:
        if state.comm is None:
            with self._lock:
                index = self._comm_count
                self._comm_count += 1
            state.comm = create_communicator(self, state.device, index, what)
        return state.comm

    def _launch(self, what: What, arrays: Sequence[TensorInfo],
                body: Callable[[Any, Any], List[Any]]) -> DeviceOp:
        """Enqueue ``body(comm, stream)`` on the raycoll stream after the callers' streams."""
        main = arrays[0]
        for a in arrays[1:]:
            if a.device_index != main.device_index:
                raise ValueError(f"{what}: all tensors must be on one GPU, got "
                                 f"cuda:{main.device_index} and cuda:{a.device_index}")
        state = self._state(main.device_index)
        cp = self.cp
        with cp.cuda.Device(main.device_index), state.lock:
            state.check()
            comm = self._comm(state, what)
            for lib_first in {a.kind: a for a in arrays}.values():
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
            op = DeviceOp(state, what, event, [a.obj for a in arrays] + keep)
            state.track(op)
        return op

    def _translate(self, state: DeviceState, what: What, exc: Exception) -> BaseException:
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
    def _flat_in(self, a: TensorInfo) -> Any:
        """A contiguous 1-D cupy array with ``a``'s data (a view when ``a`` is contiguous)."""
        if a.contiguous:
            return a.flat_view()
        return self.cp.ascontiguousarray(a.cupy_view()).reshape(-1)

    def _flat_out(self, a: TensorInfo, init: bool = False) -> Tuple[Any, Callable[[], None]]:
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

    def _plan(self, op: ReduceOp, a: TensorInfo) -> ReducePlan:
        return reduce_plan(op, a.dtype, self.version)

    def _handle(self, op: DeviceOp, array: TensorInfo, source: Optional[int] = None) -> Handle:
        return Handle(op, array, source)

    # -- reductions
    def all_reduce(self, tensor: Any, op: ReduceOp, call: Call) -> Outcome:
        a = describe_gpu(tensor)
        plan = self._plan(op, a)

        def body(comm: Any, stream: Any) -> List[Any]:
            flat, write_back = self._flat_out(a, init=True)
            keep = self._reduce_flat(comm, stream, flat, a.dtype, plan, op, None)
            write_back()
            return keep + [flat]

        return self._handle(self._launch(What.of(call), [a], body), a)

    def reduce(self, tensor: Any, dst: int, op: ReduceOp, call: Call) -> Outcome:
        a = describe_gpu(tensor)
        plan = self._plan(op, a)

        def body(comm: Any, stream: Any) -> List[Any]:
            flat, write_back = self._flat_out(a, init=True)
            keep = self._reduce_flat(comm, stream, flat, a.dtype, plan, op, dst)
            if self.ctx.rank == dst:
                write_back()
            return keep + [flat]

        return self._handle(self._launch(What.of(call), [a], body), a)

    def reduce_scatter(self, output: Any, inputs: List[Any], op: ReduceOp, call: Call) -> Outcome:
        out = describe_gpu(output, "output")
        ins = [describe_gpu(t, f"input_list[{j}]") for j, t in enumerate(inputs)]

        def body(comm: Any, stream: Any) -> List[Any]:
            n = out.numel
            packed = self.cp.empty(n * len(ins), dtype=_cuda.storage_dtype(out.dtype))
            for j, a in enumerate(ins):
                packed[j * n:(j + 1) * n] = a.cupy_view().reshape(-1)
            return self._reduce_scatter_flat(comm, stream, packed, out, op) + [packed]

        return self._handle(self._launch(What.of(call), [out] + ins, body), out)

    def reduce_scatter_tensor(self, output: Any, tensor: Any, op: ReduceOp, call: Call) -> Outcome:
        out = describe_gpu(output, "output")
        src = describe_gpu(tensor, "input")

        def body(comm: Any, stream: Any) -> List[Any]:
            packed = self._flat_in(src)
            return self._reduce_scatter_flat(comm, stream, packed, out, op) + [packed]

        return self._handle(self._launch(What.of(call), [out, src], body), out)

    def _reduce_scatter_flat(self, comm: Any, stream: Any, packed: Any, out: TensorInfo,
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
        a = describe_gpu(tensor)

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

        return self._handle(self._launch(What.of(call), [a], body), a)

    def all_gather(self, outputs: List[Any], tensor: Any, call: Call) -> Outcome:
        a = describe_gpu(tensor)
        outs = [describe_gpu(t, f"tensor_list[{j}]") for j, t in enumerate(outputs)]

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

        return self._handle(self._launch(What.of(call), [a] + outs, body), a)

    def all_gather_into_tensor(self, output: Any, tensor: Any, call: Call) -> Outcome:
        out = describe_gpu(output, "output_tensor")
        a = describe_gpu(tensor, "input_tensor")

        def body(comm: Any, stream: Any) -> List[Any]:
            mine = self._flat_in(a)
            flat, write_back = self._flat_out(out)
            if mine.nbytes:
                comm.allGather(mine.data.ptr, flat.data.ptr, mine.nbytes, self._const(_BYTES),
                               stream.ptr)
            write_back()
            return [mine, flat]

        return self._handle(self._launch(What.of(call), [out, a], body), out)

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
        a = describe_gpu(tensor)
        outs = [describe_gpu(t, f"gather_list[{j}]") for j, t in enumerate(outputs or [])]

        def body(comm: Any, stream: Any) -> List[Any]:
            mine = self._flat_in(a)
            targets = [self._flat_out(o) for o in outs] if self.ctx.rank == dst else []
            self._exchange(comm, stream, [(dst, mine)],
                           [(j, buf) for j, (buf, _) in enumerate(targets)])
            for _, write_back in targets:
                write_back()
            return [mine] + [buf for buf, _ in targets]

        return self._handle(self._launch(What.of(call), [a] + outs, body), a)

    def scatter(self, output: Any, inputs: Optional[List[Any]], src: int, call: Call) -> Outcome:
        out = describe_gpu(output)
        ins = [describe_gpu(t, f"scatter_list[{j}]") for j, t in enumerate(inputs or [])]

        def body(comm: Any, stream: Any) -> List[Any]:
            sources = [self._flat_in(a) for a in ins] if self.ctx.rank == src else []
            flat, write_back = self._flat_out(out)
            self._exchange(comm, stream, list(enumerate(sources)), [(src, flat)])
            write_back()
            return sources + [flat]

        return self._handle(self._launch(What.of(call), [out] + ins, body), out)

    def all_to_all(self, outputs: List[Any], inputs: List[Any], call: Call) -> Outcome:
        outs = [describe_gpu(t, f"output_tensor_list[{j}]") for j, t in enumerate(outputs)]
        ins = [describe_gpu(t, f"input_tensor_list[{j}]") for j, t in enumerate(inputs)]

        def body(comm: Any, stream: Any) -> List[Any]:
            sources = [self._flat_in(a) for a in ins]
            targets = [self._flat_out(o) for o in outs]
            self._exchange(comm, stream, list(enumerate(sources)),
                           [(j, buf) for j, (buf, _) in enumerate(targets)])
            for _, write_back in targets:
                write_back()
            return sources + [buf for buf, _ in targets]

        return self._handle(self._launch(What.of(call), outs + ins, body), outs[0])

    def all_to_all_single(self, output: Any, tensor: Any, output_splits: List[int],
                          input_splits: List[int], call: Call) -> Outcome:
        out = describe_gpu(output, "output")
        src = describe_gpu(tensor, "input")

        def offsets(a: TensorInfo, splits: List[int]) -> List[int]:
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

        return self._handle(self._launch(What.of(call), [out, src], body), out)

    def barrier(self, call: Call) -> Outcome:
        """Wait (host) for this rank's GPU work on the group, then meet the others."""
        what = What.of(call)
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
        a = describe_gpu(tensor)
        pending: Optional[List[Deferred]] = getattr(self._batch, "ops", None)
        if pending is not None:
            item = Deferred(kind, a, peer, timeout_s, threading.Event())
            pending.append(item)
            return item.completion()
        what = What(kind, -1, timeout_s)

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
        ops: List[Deferred] = []
        self._batch.ops = ops
        ok = False
        try:
            yield
            ok = True
        finally:
            self._batch.ops = None
            self._issue(ops, ok)

    def _issue(self, items: List[Deferred], ok: bool) -> None:
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
        by_device: Dict[int, List[Deferred]] = collections.defaultdict(list)
        for item in items:
            by_device[item.array.device_index].append(item)
        for group in by_device.values():
            what = What("batch_isend_irecv", -1, max(i.timeout_s for i in group))

            def body(comm: Any, stream: Any, group: List[Deferred] = group) -> List[Any]:
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
