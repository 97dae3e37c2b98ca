"""The ``ProcessGroup`` object API: torch's ``pg.allreduce([t], opts).wait()`` and kin.

torch's tests and libraries drive a process group object directly, with tensor lists and an
Options object (:mod:`raycoll.call_options`). :class:`ObjectAPI`, a base of
:class:`raycoll.ProcessGroup`, gives raycoll's groups those methods with torch's argument
conventions and gloo's semantics: several tensors in a list where gloo takes them
(``allreduce``, ``broadcast``, ``allgather``: one collective on the data plane, see
:mod:`raycoll.multi`), sparse COO tensors in ``allreduce`` (:mod:`raycoll.sparse`), roots as
ranks *in the group* (``opts.rootRank``, ``dstRank``, ``srcRank``), the op in
``opts.reduceOp``, a per-call ``opts.timeout``, and torch's overloads (``pg.broadcast(x,
root=0)``, ``pg.allreduce(x, op)``). Each method makes gloo's checks in gloo's order
(:mod:`raycoll.object_checks`; errors are ``RuntimeError`` as torch's), then calls the
module function (``raycoll.all_reduce``, ...) on this group with ``async_op=True``: the same
path, the same checks. A call refused on this rank still takes its sequence number and tells
the peers (they raise ``PeerArgumentError``), so a refused call never breaks the group. Each
returns a :class:`~raycoll.Work`; a receive's ``source_rank()`` is the sender's rank in this
group. The rest of torch's ``ProcessGroup`` methods are in :mod:`raycoll.object_more`.

The module functions sit above ``ProcessGroup`` (they resolve groups and call into them), so
this module does not import them: ``raycoll/__init__.py`` hands them over with
:func:`provide` when the package is imported, keeping the layers one-way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

from raycoll import call_options as co
from raycoll import errors
from raycoll import object_checks as oc
from raycoll.context import Call
from raycoll.object_more import MoreObjectAPI, _fn, _from_future, provide
from raycoll.sparse import is_sparse
from raycoll.tensors import is_tensor
from raycoll.work import Work

__all__ = ["ObjectAPI", "provide"]


class _GroupRankWork(Work):
    """A receive's ``Work`` whose ``source_rank()`` is the sender's rank in the group."""

    def __init__(self, work: Work, global_ranks: Sequence[int]) -> None:
        super().__init__(work._inner, describe=work._describe, on_timeout=work._on_timeout,
                         outputs=work._outputs, on_wait=work._on_wait)
        self._global_ranks = tuple(global_ranks)

    def source_rank(self) -> int:
        """The rank in this group the message came from."""
        return self._global_ranks.index(super().source_rank())


class ObjectAPI(MoreObjectAPI):
    """torch's ``ProcessGroup`` collective methods (a base of :class:`raycoll.ProcessGroup`)."""

    if TYPE_CHECKING:  # provided by ProcessGroup
        def rank(self) -> int: ...
        @property
        def global_ranks(self) -> Tuple[int, ...]: ...
        @property
        def timeout_s(self) -> float: ...
        def check_usable(self) -> None: ...
        def take_seq(self) -> int: ...
        def reject(self, call: Call, exc: BaseException) -> None: ...

    def _refuse(self, op: str, exc: BaseException) -> BaseException:
        """``exc`` for a call this rank refused before calling a module function: the call
        still takes its sequence number and the peers are told, as the module functions do."""
        self.check_usable()
        self.reject(Call(op, self.take_seq(), self.timeout_s, {"op": op}), exc)
        return exc

    def _checked(self, op: str, check: Any, *args: Any) -> Any:
        try:
            return check(*args)
        except (ValueError, TypeError) as exc:
            with oc.torch_errors():
                raise self._refuse(op, exc)

    def _root_of(self, opts: Any, op: str) -> int:
        root = int(opts.rootRank)
        self._checked(op, oc.check_root, root, self.size(), op)
        return root

    # -- reductions
    def allreduce(self, tensors: Any, opts: Any = None, op: Any = None,
                  timeout: Any = None) -> Work:
        """``all_reduce`` of ``tensors`` with ``opts.reduceOp``: several tensors (one dtype
        and size) are reduced together, each gets the result; sparse COO ones are summed."""
        o = oc.options(opts, co.AllreduceOptions, "allreduce", reduce_op=op,
                       timeout=oc.timeout_given(timeout))
        ts = oc.tensor_list(tensors, "tensors", "allreduce")
        if not ts:
            raise self._refuse("allreduce", errors.InvalidArgumentError(
                "requires non-empty tensor list (allreduce: tensors is empty)"))
        with oc.torch_errors(), co.call_timeout(co.timeout_s(o)):
            if any(is_sparse(t) for t in ts):
                work = _fn("all_reduce_sparse")(ts, o.reduceOp, self, True)
            elif len(ts) == 1:
                work = _fn("all_reduce")(ts[0], op=o.reduceOp, group=self, async_op=True)
            else:
                work = _fn("all_reduce_multi")(ts, o.reduceOp, self, True)
        return work  # the module functions' Work

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Work:
        """``all_reduce_coalesced`` of ``tensors`` (one dtype, dense) with ``opts.reduceOp``."""
        o = oc.options(opts, co.AllreduceCoalescedOptions, "allreduce_coalesced")
        ts = self._checked("allreduce_coalesced", _coalesced_list, tensors)
        with oc.torch_errors(), co.call_timeout(co.timeout_s(o)):
            future = _fn("all_reduce_coalesced")(ts, op=o.reduceOp, group=self, async_op=True)
        return _from_future(future, f"allreduce_coalesced on group {self.name!r}", ts)

    def reduce(self, tensors: Any, opts: Any = None, op: Any = None, timeout: Any = None,
               root: Optional[int] = None) -> Work:
        """``reduce`` of the one tensor of ``tensors`` into group rank ``opts.rootRank``
        (or the overload's ``root``)."""
        o = oc.options(opts, co.ReduceOptions, "reduce", root=root, reduce_op=op,
                       timeout=oc.timeout_given(timeout))
        ts = oc.tensor_list(tensors, "tensors", "reduce")
        at = self._root_of(o, "reduce")
        self._checked("reduce", oc.check_root_tensor, int(o.rootTensor), len(ts), "reduce")
        t = self._checked("reduce", oc.single, ts, "tensor list", "reduce")
        with oc.torch_errors(), co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("reduce")(t, op=o.reduceOp, group=self, async_op=True,
                                       group_dst=at)
        return work

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None,
                       op: Any = None, timeout: Any = None) -> Work:
        """``reduce_scatter`` into ``output_tensors[0]`` of ``input_tensors[0]`` (a list,
        whose parts may differ in size as gloo's); the overload takes a tensor and a list."""
        o = oc.options(opts, co.ReduceScatterOptions, "reduce_scatter", reduce_op=op,
                       timeout=oc.timeout_given(timeout))
        if is_tensor(output_tensors):
            out, ins = output_tensors, input_tensors
        else:
            outs = oc.tensor_list(output_tensors, "output_tensors", "reduce_scatter")
            out = self._checked("reduce_scatter", oc.single, outs, "output tensor list",
                                "reduce_scatter")
            ins = self._checked("reduce_scatter", oc.single, list(input_tensors),
                                "input list", "reduce_scatter")
        with oc.torch_errors(), co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("reduce_scatter")(out, ins, op=o.reduceOp, group=self,
                                               async_op=True)
        return work

    # -- data movement
    def broadcast(self, tensors: Any, opts: Any = None, timeout: Any = None,
                  root: Optional[int] = None) -> Work:
        """``broadcast`` from group rank ``opts.rootRank`` (or the overload's ``root``): its
        ``tensors[opts.rootTensor]`` into every tensor of ``tensors`` on every rank."""
        o = oc.options(opts, co.BroadcastOptions, "broadcast", root=root,
                       timeout=oc.timeout_given(timeout))
        ts = oc.tensor_list(tensors, "tensors", "broadcast")
        at = self._root_of(o, "broadcast")
        index = int(o.rootTensor)
        self._checked("broadcast", oc.check_root_tensor, index, len(ts), "broadcast")
        with oc.torch_errors(), co.call_timeout(co.timeout_s(o)):
            if len(ts) == 1:
                work = _fn("broadcast")(ts[0], group=self, async_op=True, group_src=at)
            else:
                work = _fn("broadcast_multi")(ts, at, index, self, True)
        return work  # the module functions' Work

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None,
                  timeout: Any = None) -> Work:
        """``all_gather``: each ``output_tensors[j]`` (world size * n tensors) gets every
        rank's n ``input_tensors`` in rank order; the overload takes a list and a tensor."""
        o = oc.options(opts, co.AllgatherOptions, "allgather", timeout=oc.timeout_given(timeout))
        with co.call_timeout(co.timeout_s(o)):
            if is_tensor(input_tensors):
                with oc.torch_errors():
                    work = _fn("all_gather")(output_tensors, input_tensors, group=self,
                                             async_op=True)
                return work  # the module functions' Work
            ins = oc.tensor_list(input_tensors, "input_tensors", "allgather")
            outs = self._checked("allgather", _allgather_lists, output_tensors, ins, self.size())
            with oc.torch_errors():
                if len(ins) == 1:
                    work = _fn("all_gather")(outs[0], ins[0], group=self, async_op=True)
                else:
                    work = _fn("all_gather_multi")(outs, ins, self, True)
                    work._outputs = outs  # torch's future: the lists, as gloo's
        return work  # the module functions' Work

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None,
               timeout: Any = None, root: Optional[int] = None) -> Work:
        """``gather`` of ``input_tensors[0]`` into ``output_tensors[0]`` on group rank
        ``opts.rootRank`` (``output_tensors`` empty elsewhere); the overload takes a list,
        a tensor and ``root``."""
        o = oc.options(opts, co.GatherOptions, "gather", root=root,
                       timeout=oc.timeout_given(timeout))
        at = self._root_of(o, "gather")
        if is_tensor(input_tensors):
            t, outs = input_tensors, (list(output_tensors) if self.rank() == at else None)
        else:
            ins = oc.tensor_list(input_tensors, "input_tensors", "gather")
            t = self._checked("gather", oc.single, ins, "input tensor list", "gather")
            outs = self._checked("gather", oc.rooted, output_tensors, "output_tensors",
                                 "output list", self.size(), self.rank() == at, "gather",
                                 "Output")
        with oc.torch_errors(), co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("gather")(t, outs, group=self, async_op=True, group_dst=at)
        return work

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None,
                timeout: Any = None, root: Optional[int] = None) -> Work:
        """``scatter`` of ``input_tensors[0]`` (on group rank ``opts.rootRank``; empty
        elsewhere) into ``output_tensors[0]``; the overload takes a tensor, a list and
        ``root``."""
        o = oc.options(opts, co.ScatterOptions, "scatter", root=root,
                       timeout=oc.timeout_given(timeout))
        at = self._root_of(o, "scatter")
        if is_tensor(output_tensors):
            t, ins = output_tensors, (list(input_tensors) if self.rank() == at else None)
        else:
            outs = oc.tensor_list(output_tensors, "output_tensors", "scatter")
            t = self._checked("scatter", oc.single, outs, "output tensor list", "scatter")
            ins = self._checked("scatter", oc.rooted, input_tensors, "input_tensors",
                                "input list", self.size(), self.rank() == at, "scatter", "Input")
        with oc.torch_errors(), co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("scatter")(t, ins, group=self, async_op=True, group_src=at)
        return work

    def alltoall_base(self, output: Any, input: Any, output_split_sizes: Any,
                      input_split_sizes: Any, opts: Any = None, timeout: Any = None) -> Work:
        """``all_to_all_single`` (empty split lists: even splits)."""
        o = oc.options(opts, co.AllToAllOptions, "alltoall_base",
                       timeout=oc.timeout_given(timeout))
        outs = list(output_split_sizes) or None
        ins = list(input_split_sizes) or None
        with oc.torch_errors(), co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("all_to_all_single")(output, input, outs, ins, group=self,
                                                  async_op=True)
        return work

    all_to_all_single = alltoall_base

    def barrier(self, opts: Any = None, timeout: Any = None) -> Work:
        """``barrier``, bounded by ``opts.timeout`` (or the overload's ``timeout``) when set."""
        o = oc.options(opts, co.BarrierOptions, "barrier", timeout=oc.timeout_given(timeout))
        with oc.torch_errors():
            work: Work = _fn("barrier")(group=self, async_op=True,
                                        device_ids=list(o.device_ids) or None,
                                        timeout=co.timeout_s(o))
        return work

    # -- point to point (group ranks)
    def _p2p_tensor(self, tensors: Any, op: str) -> Any:
        return self._checked(op, oc.single, oc.tensor_list(tensors, "tensors", op),
                             "tensor list", op)

    def send(self, tensors: Any, dstRank: int, tag: int) -> Work:  # noqa: N803 - torch's
        """``isend`` of the one tensor of ``tensors`` to group rank ``dstRank``."""
        t = self._p2p_tensor(tensors, "send")
        with oc.torch_errors():
            work: Work = _fn("isend")(t, group=self, tag=tag, group_dst=dstRank)
        return work

    def recv(self, tensors: Any, srcRank: int, tag: int) -> Work:  # noqa: N803 - torch's
        """``irecv`` into the one tensor of ``tensors`` from group rank ``srcRank``."""
        t = self._p2p_tensor(tensors, "recv")
        with oc.torch_errors():
            return _GroupRankWork(_fn("irecv")(t, group=self, tag=tag, group_src=srcRank),
                                  self.global_ranks)

    def recv_anysource(self, tensors: Any, tag: int) -> Work:
        """``irecv`` from any rank; ``source_rank()`` then says which (in the group)."""
        t = self._p2p_tensor(tensors, "recv_anysource")
        with oc.torch_errors():
            return _GroupRankWork(_fn("irecv")(t, group=self, tag=tag), self.global_ranks)


def _coalesced_list(tensors: Any) -> List[Any]:
    """gloo's checks of ``allreduce_coalesced``'s list, in gloo's order."""
    ts = oc.tensor_list(tensors, "tensors", "allreduce_coalesced")
    if not ts:
        raise errors.InvalidArgumentError(
            "requires non-empty tensor list (allreduce_coalesced: tensors is empty)")
    if is_sparse(ts[0]):
        raise errors.TensorTypeError("unsupported layout: allreduce_coalesced takes dense "
                                        "tensors (sum sparse ones with allreduce)")
    for i, t in enumerate(ts):
        if is_sparse(t):
            raise errors.TensorTypeError(f"invalid tensor layout at index {i}: tensors[{i}] "
                                            "is sparse, tensors[0] dense")
        if getattr(t, "dtype", None) != getattr(ts[0], "dtype", None):
            raise errors.TensorTypeError(
                f"tensors must all have the same type: tensors[{i}] is {t.dtype}, tensors[0] "
                f"{ts[0].dtype}")
    return ts


def _allgather_lists(output_tensors: Any, ins: List[Any], size: int) -> List[List[Any]]:
    """gloo's checks of ``allgather``'s lists, in gloo's order (the tensors' own checks are
    the module functions')."""
    if not ins:
        raise errors.InvalidArgumentError(
            "requires non-empty input tensor list (allgather: input_tensors is empty)")
    if not isinstance(output_tensors, (list, tuple)) or \
            not all(isinstance(x, (list, tuple)) for x in output_tensors):
        raise TypeError("allgather: output_tensors must be a list of lists of tensors")
    if len(output_tensors) != len(ins):
        raise errors.InvalidArgumentError(
            f"requires input/output tensor lists to have the same length (allgather: "
            f"{len(output_tensors)} output lists, {len(ins)} inputs)")
    for j, lst in enumerate(output_tensors):
        if len(lst) != size * len(ins):
            raise errors.TensorSizeError(
                f"invalid output tensor list at index {j} (allgather: expected world size "
                f"{size} * {len(ins)} inputs = {size * len(ins)} tensors, got {len(lst)})")
    return [list(x) for x in output_tensors]
