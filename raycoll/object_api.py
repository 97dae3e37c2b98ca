"""The ``ProcessGroup`` object API: torch's ``pg.allreduce([t], opts).wait()`` and kin.

torch's tests and libraries drive a process group object directly, with tensor lists and an
Options object (:mod:`raycoll.call_options`). :class:`ObjectAPI`, a base of
:class:`raycoll.ProcessGroup`, gives raycoll's groups those methods with torch's argument
conventions: one tensor per list (raycoll's backends take one, as torch's do), roots as
ranks *in the group* (``opts.rootRank``, ``dstRank``, ``srcRank``), the op in
``opts.reduceOp``, a per-call ``opts.timeout``. Each method checks what only it takes and
calls the module function (``raycoll.all_reduce``, ...) on this group with
``async_op=True``: the same path, the same checks, the same errors. Each returns a
:class:`~raycoll.Work`; a receive's ``source_rank()`` is the sender's rank in this group,
as torch's object API has it. An Options object may be raycoll's or torch's (its fields are
read and checked).

The module functions sit above ``ProcessGroup`` (they resolve groups and call into them), so
this module does not import them: ``raycoll/__init__.py`` hands them over with
:func:`provide` when the package is imported, keeping the layers one-way.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import fields
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Type, TypeVar

from raycoll import call_options as co
from raycoll.tensors import is_tensor
from raycoll.work import Work

__all__ = ["ObjectAPI", "provide"]

T = TypeVar("T")

#: The module functions (raycoll.collectives, raycoll.p2p and raycoll.coalesced), handed over
#: by raycoll/__init__.py.
_FUNCTIONS: List[Any] = []


def provide(*modules: Any) -> None:
    """Hand this module the module functions it calls (once, from ``raycoll/__init__.py``)."""
    _FUNCTIONS[:] = list(modules)


def _fn(name: str) -> Any:
    for module in _FUNCTIONS:
        found = getattr(module, name, None)
        if found is not None:
            return found
    raise RuntimeError(f"raycoll's {name} is not available: import raycoll (the package) "
                       "before using a ProcessGroup's methods")


def _options(opts: Any, cls: Type[T], op: str) -> T:
    """``opts`` as ``cls``: ``None`` gives the defaults; raycoll's, or torch's (or anything
    with the same fields: each one is read and checked)."""
    if opts is None:
        return cls()
    if isinstance(opts, cls):
        return opts
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]  # the Options dataclasses
    lacking = [n for n in names if not hasattr(opts, n)]
    if lacking:
        raise TypeError(f"{op}: opts must be a raycoll.{cls.__name__} (or torch's), got "
                        f"{type(opts).__name__} without {', '.join(lacking)}")
    return cls(**{n: getattr(opts, n) for n in names})


def _one(values: Any, name: str, op: str) -> Any:
    """The one tensor of a torch-style tensor list (a bare tensor is taken as it is)."""
    if is_tensor(values):
        return values
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list holding one tensor, got "
                        f"{type(values).__name__}")
    if len(values) != 1:
        raise ValueError(f"{op}: {name} must hold one tensor (raycoll takes one tensor per "
                         f"call, as torch's backends do), got {len(values)}")
    return values[0]


def _rooted(values: Any, name: str, op: str, is_root: bool, role: str) -> Optional[List[Any]]:
    """The one list of a torch-style list of lists (``[[t0, ..., tn]]``), given on the root
    only (an empty list elsewhere)."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list of lists of tensors, got "
                        f"{type(values).__name__}")
    if not is_root:
        if len(values) and not (len(values) == 1 and not values[0]):
            raise ValueError(f"{op}: {name} must be empty on a rank that is not the {role} "
                             f"(got {len(values)} list(s))")
        return None
    if len(values) != 1 or not isinstance(values[0], (list, tuple)):
        raise ValueError(f"{op}: {name} must be [[one tensor per rank]] on the {role}, got "
                         f"{len(values)} entries")
    return list(values[0])


class _GroupRankWork(Work):
    """A receive's ``Work`` whose ``source_rank()`` is the sender's rank in the group."""

    def __init__(self, work: Work, global_ranks: Sequence[int]) -> None:
        super().__init__(work._inner, describe=work._describe, on_timeout=work._on_timeout,
                         outputs=work._outputs, on_wait=work._on_wait)
        self._global_ranks = tuple(global_ranks)

    def source_rank(self) -> int:
        """The rank in this group the message came from."""
        return self._global_ranks.index(super().source_rank())


def _from_future(future: Any, describe: str, outputs: List[Any]) -> Work:
    """A ``Work`` over a future (``all_reduce_coalesced`` returns one)."""
    inner: "concurrent.futures.Future[Any]" = concurrent.futures.Future()

    def done(fut: Any) -> None:
        try:
            fut.value()
        except BaseException as exc:  # noqa: BLE001 - delivered through the Work
            inner.set_exception(exc)
        else:
            inner.set_result(None)

    future.add_done_callback(done)
    return Work(inner, describe=describe, outputs=outputs)


class ObjectAPI:
    """torch's ``ProcessGroup`` methods (a base of :class:`raycoll.ProcessGroup`)."""

    if TYPE_CHECKING:  # provided by ProcessGroup
        def rank(self) -> int: ...
        def size(self) -> int: ...
        @property
        def name(self) -> str: ...
        @property
        def global_ranks(self) -> Tuple[int, ...]: ...

    def _root_rank(self, opts: Any, op: str) -> int:
        root = int(opts.rootRank)
        if root >= self.size():
            raise ValueError(f"{op}: opts.rootRank={root} is out of range for group "
                             f"{self.name!r} of size {self.size()} (a rank in the group)")
        if getattr(opts, "rootTensor", 0) != 0:
            raise ValueError(f"{op}: opts.rootTensor must be 0 (raycoll takes one tensor per "
                             f"call), got {opts.rootTensor}")
        return root

    # -- reductions
    def allreduce(self, tensors: Any, opts: Any = None) -> Work:
        """``all_reduce`` of the one tensor of ``tensors`` with ``opts.reduceOp``."""
        o = _options(opts, co.AllreduceOptions, "allreduce")
        t = _one(tensors, "tensors", "allreduce")
        with co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("all_reduce")(t, op=o.reduceOp, group=self, async_op=True)
        return work

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Work:
        """``all_reduce_coalesced`` of ``tensors`` (one dtype) with ``opts.reduceOp``."""
        o = _options(opts, co.AllreduceCoalescedOptions, "allreduce_coalesced")
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"allreduce_coalesced: tensors must be a list of tensors, got "
                            f"{type(tensors).__name__}")
        with co.call_timeout(co.timeout_s(o)):
            future = _fn("all_reduce_coalesced")(list(tensors), op=o.reduceOp, group=self,
                                                 async_op=True)
        return _from_future(future, f"allreduce_coalesced on group {self.name!r}", list(tensors))

    def reduce(self, tensors: Any, opts: Any = None) -> Work:
        """``reduce`` of the one tensor of ``tensors`` into group rank ``opts.rootRank``."""
        o = _options(opts, co.ReduceOptions, "reduce")
        t, root = _one(tensors, "tensors", "reduce"), self._root_rank(o, "reduce")
        with co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("reduce")(t, op=o.reduceOp, group=self, async_op=True,
                                       group_dst=root)
        return work

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Work:
        """``reduce_scatter`` into ``output_tensors[0]`` of ``input_tensors[0]`` (a list)."""
        o = _options(opts, co.ReduceScatterOptions, "reduce_scatter")
        out = _one(output_tensors, "output_tensors", "reduce_scatter")
        ins = _rooted(input_tensors, "input_tensors", "reduce_scatter", True, "rank")
        with co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("reduce_scatter")(out, ins, op=o.reduceOp, group=self,
                                               async_op=True)
        return work

    # -- data movement
    def broadcast(self, tensors: Any, opts: Any = None) -> Work:
        """``broadcast`` of the one tensor of ``tensors`` from group rank ``opts.rootRank``."""
        o = _options(opts, co.BroadcastOptions, "broadcast")
        t, root = _one(tensors, "tensors", "broadcast"), self._root_rank(o, "broadcast")
        with co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("broadcast")(t, group=self, async_op=True, group_src=root)
        return work

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Work:
        """``all_gather`` of ``input_tensors[0]`` into ``output_tensors[0]`` (a list)."""
        o = _options(opts, co.AllgatherOptions, "allgather")
        outs = _rooted(output_tensors, "output_tensors", "allgather", True, "rank")
        t = _one(input_tensors, "input_tensors", "allgather")
        with co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("all_gather")(outs, t, group=self, async_op=True)
        return work

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Work:
        """``gather`` of ``input_tensors[0]`` into ``output_tensors[0]`` on group rank
        ``opts.rootRank`` (``output_tensors`` empty elsewhere)."""
        o = _options(opts, co.GatherOptions, "gather")
        root = self._root_rank(o, "gather")
        outs = _rooted(output_tensors, "output_tensors", "gather", self.rank() == root, "root")
        t = _one(input_tensors, "input_tensors", "gather")
        with co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("gather")(t, outs, group=self, async_op=True, group_dst=root)
        return work

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Work:
        """``scatter`` of ``input_tensors[0]`` (on group rank ``opts.rootRank``; empty
        elsewhere) into ``output_tensors[0]``."""
        o = _options(opts, co.ScatterOptions, "scatter")
        root = self._root_rank(o, "scatter")
        t = _one(output_tensors, "output_tensors", "scatter")
        ins = _rooted(input_tensors, "input_tensors", "scatter", self.rank() == root, "root")
        with co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("scatter")(t, ins, group=self, async_op=True, group_src=root)
        return work

    def alltoall_base(self, output: Any, input: Any, output_split_sizes: Any,
                      input_split_sizes: Any, opts: Any = None) -> Work:
        """``all_to_all_single`` (empty split lists: even splits)."""
        o = _options(opts, co.AllToAllOptions, "alltoall_base")
        outs = list(output_split_sizes) or None
        ins = list(input_split_sizes) or None
        with co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("all_to_all_single")(output, input, outs, ins, group=self,
                                                  async_op=True)
        return work

    def barrier(self, opts: Any = None) -> Work:
        """``barrier``, bounded by ``opts.timeout`` when set."""
        o = _options(opts, co.BarrierOptions, "barrier")
        work: Work = _fn("barrier")(group=self, async_op=True,
                                    device_ids=list(o.device_ids) or None,
                                    timeout=co.timeout_s(o))
        return work

    # -- point to point (group ranks)
    def send(self, tensors: Any, dstRank: int, tag: int) -> Work:  # noqa: N803 - torch's
        """``isend`` of the one tensor of ``tensors`` to group rank ``dstRank``."""
        t = _one(tensors, "tensors", "send")
        work: Work = _fn("isend")(t, group=self, tag=tag, group_dst=dstRank)
        return work

    def recv(self, tensors: Any, srcRank: int, tag: int) -> Work:  # noqa: N803 - torch's
        """``irecv`` into the one tensor of ``tensors`` from group rank ``srcRank``."""
        t = _one(tensors, "tensors", "recv")
        return _GroupRankWork(_fn("irecv")(t, group=self, tag=tag, group_src=srcRank),
                              self.global_ranks)

    def recv_anysource(self, tensors: Any, tag: int) -> Work:
        """``irecv`` from any rank; ``source_rank()`` then says which (in the group)."""
        t = _one(tensors, "tensors", "recv_anysource")
        return _GroupRankWork(_fn("irecv")(t, group=self, tag=tag), self.global_ranks)
