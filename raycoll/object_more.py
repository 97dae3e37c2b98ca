"""The rest of torch 2.13's ``ProcessGroup`` / ``ProcessGroupGloo`` public methods.

:class:`MoreObjectAPI` (a base of :class:`raycoll.object_api.ObjectAPI`) holds what a CPU
backend can honour beyond the collectives' list forms: the coalesced tensor calls
(``allgather_coalesced``, ``allgather_into_tensor_coalesced``,
``reduce_scatter_tensor_coalesced`` and the ``*_single*`` names), ``alltoall``,
``monitored_barrier``, ``set_timeout`` (gloo's ``_set_default_timeout``) and ``options``
(gloo's, with ``_timeout``), ``get_group_store``, ``shutdown``/``abort``, and gloo's
``supports_*`` answers. What raycoll cannot honour (``boxed``, ``merge_remote_group``,
``suspend``, a gloo ``Device``...) raises ``NotImplementedError`` saying what to use.

It also holds the hand-over of the module functions (:func:`provide`): they sit above
``ProcessGroup``, so this layer calls them through :func:`_fn`.
"""

from __future__ import annotations

import concurrent.futures
import enum
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Dict, List, NoReturn, Optional

from raycoll import call_options as co
from raycoll import object_checks as oc
from raycoll.work import Work

__all__ = ["MoreObjectAPI", "BackendOptions", "provide"]

#: The module functions (raycoll.collectives, raycoll.p2p, raycoll.coalesced, raycoll.multi,
#: raycoll.groups, raycoll.store), handed over by raycoll/__init__.py.
_FUNCTIONS: List[Any] = []


def provide(*modules: Any) -> None:
    """Hand this layer the module functions it calls (once, from ``raycoll/__init__.py``)."""
    _FUNCTIONS[:] = list(modules)


def _fn(name: str) -> Any:
    for module in _FUNCTIONS:
        found = getattr(module, name, None)
        if found is not None:
            return found
    raise RuntimeError(f"raycoll's {name} is not available: import raycoll (the package) "
                       "before using a ProcessGroup's methods")


def _from_future(future: Any, describe: str, outputs: List[Any]) -> Work:
    """A ``Work`` over a future (the coalesced module functions return one)."""
    inner: "concurrent.futures.Future[Any]" = concurrent.futures.Future()
    if future is None:  # not a member of the group
        inner.set_result(None)
        return Work(inner, describe=describe, outputs=outputs)

    def done(fut: Any) -> None:
        try:
            fut.value()
        except BaseException as exc:  # noqa: BLE001 - delivered through the Work
            inner.set_exception(exc)
        else:
            inner.set_result(None)

    future.add_done_callback(done)
    return Work(inner, describe=describe, outputs=outputs)


class BackendType(enum.IntEnum):
    """torch's ``ProcessGroup.BackendType`` (raycoll's groups answer ``CUSTOM``)."""

    UNDEFINED = 0
    GLOO = 1
    NCCL = 2
    UCC = 3
    MPI = 4
    XCCL = 5
    CUSTOM = 6


@dataclass(frozen=True)
class BackendOptions:
    """What ``pg.options`` answers (gloo's ``ProcessGroupGloo.Options``): the group's
    backend string and its collective timeout, ``_timeout``, as torch names them."""

    backend: str
    _timeout: timedelta


def _cannot(what: str, instead: str) -> NoReturn:
    raise NotImplementedError(f"raycoll's ProcessGroup has no {what}: {instead}")


class MoreObjectAPI:
    """torch's ``ProcessGroup`` methods beyond the collectives' list forms."""

    BackendType = BackendType
    UNDEFINED, GLOO, NCCL, UCC, MPI, XCCL, CUSTOM = tuple(BackendType)

    if TYPE_CHECKING:  # provided by ProcessGroup
        _timeout_s: float
        context: Any

        def size(self) -> int: ...
        @property
        def name(self) -> str: ...
        @property
        def backend_name(self) -> str: ...

    # -- coalesced tensor calls (one collective on the data plane for CPU tensors)
    def allgather_coalesced(self, output_lists: Any, input_list: Any, opts: Any = None) -> Work:
        """``all_gather_coalesced``: ``output_lists[r][i]`` gets rank r's ``input_list[i]``."""
        o = oc.options(opts, co.AllgatherOptions, "allgather_coalesced")
        outputs = [t for lst in output_lists for t in lst] \
            if isinstance(output_lists, (list, tuple)) else []
        with oc.torch_errors(), co.call_timeout(co.timeout_s(o)):
            future = _fn("all_gather_coalesced")(output_lists, input_list, group=self,
                                                 async_op=True)
        return _from_future(future, f"allgather_coalesced on group {self.name!r}", outputs)

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any,
                                        opts: Any = None) -> Work:
        """``all_gather_into_tensor(outputs[i], inputs[i])`` for every i, fused."""
        o = oc.options(opts, co.AllgatherOptions, "allgather_into_tensor_coalesced")
        with oc.torch_errors(), co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("all_gather_into_tensor_coalesced")(outputs, inputs, self, True)
        return work

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any,
                                        opts: Any = None) -> Work:
        """``reduce_scatter_tensor(outputs[i], inputs[i], opts.reduceOp)`` for every i, fused."""
        o = oc.options(opts, co.ReduceScatterOptions, "reduce_scatter_tensor_coalesced")
        with oc.torch_errors(), co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("reduce_scatter_tensor_coalesced")(outputs, inputs, o.reduceOp,
                                                                 self, True)
        return work

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> Work:
        """``all_gather_into_tensor(output, input)`` (torch's ``_allgather_base``)."""
        o = oc.options(opts, co.AllgatherOptions, "all_gather_single")
        with oc.torch_errors(), co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("all_gather_into_tensor")(output, input, group=self, async_op=True)
        return work

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, outputTensor: Any, inputTensor: Any,  # noqa: N803
                              opts: Any = None) -> Work:
        """``reduce_scatter_tensor`` (torch's ``_reduce_scatter_base``)."""
        o = oc.options(opts, co.ReduceScatterOptions, "reduce_scatter_single")
        with oc.torch_errors(), co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("reduce_scatter_tensor")(outputTensor, inputTensor, op=o.reduceOp,
                                                      group=self, async_op=True)
        return work

    _reduce_scatter_base = reduce_scatter_single

    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Work:
        """``all_to_all`` (one tensor per rank each way)."""
        o = oc.options(opts, co.AllToAllOptions, "alltoall")
        with oc.torch_errors(), co.call_timeout(co.timeout_s(o)):
            work: Work = _fn("all_to_all")(output_tensors, input_tensors, group=self,
                                           async_op=True)
        return work

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """``monitored_barrier`` on this group."""
        _fn("monitored_barrier")(group=self, timeout=timeout, wait_all_ranks=wait_all_ranks)

    # -- the group itself
    def set_timeout(self, timeout: timedelta) -> None:
        """The timeout of this group's later collectives (torch's ``set_timeout``)."""
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise TypeError(f"set_timeout: timeout must be a positive datetime.timedelta, got "
                            f"{timeout!r}")
        self._timeout_s = timeout.total_seconds()
        self.context.timeout_s = self._timeout_s

    _set_default_timeout = set_timeout

    @property
    def options(self) -> BackendOptions:
        """gloo's ``pg.options``: the backend and the timeout (``_timeout``)."""
        return BackendOptions(self.backend_name, timedelta(seconds=self._timeout_s))

    def get_group_store(self) -> Any:
        """The group's key-value store (:func:`raycoll.get_store`)."""
        return _fn("get_store")(self)

    def shutdown(self) -> None:
        """Destroy this group in this process (``destroy_process_group(pg)``)."""
        _fn("destroy_process_group")(self)

    abort = shutdown

    def _get_backend_name(self) -> str:
        return self.backend_name

    @property
    def bound_device_id(self) -> None:
        """raycoll binds no device to a group (a GPU rank uses the GPU Ray gave it)."""
        return None

    use_pg_for_symm_mem_rendezvous = False

    # -- gloo's capability answers
    supports_coalescing = True
    supports_splitting = False
    supports_shrinking = False
    supports_time_estimate = False

    def supports_tensor_alloc(self, device: Any) -> bool:
        """raycoll allocates no tensors for the caller."""
        return False

    def eager_connect_single_device(self, device: Any) -> None:
        """Nothing to do: raycoll connects a group's ranks when it forms."""

    def memory_stats(self) -> Dict[str, int]:
        """gloo keeps none; neither does raycoll (see ``group_status`` for its counters)."""
        return {}

    # -- what raycoll cannot honour, and what to use instead
    def split_group(self, ranks: Any, timeout: Any = None, opts: Any = None,
                    group_name: Optional[str] = None, group_desc: Optional[str] = None,
                    device_types: Any = None) -> NoReturn:
        _cannot("split_group", "call raycoll.split_group(parent_pg, split_ranks) or "
                "raycoll.new_group(ranks) on every rank")

    def merge_remote_group(self, store: Any, size: int, timeout: timedelta = timedelta(
            seconds=1800), group_name: Optional[str] = None,
            group_desc: Optional[str] = None) -> NoReturn:
        _cannot("merge_remote_group", "form one group over all the ranks with "
                "raycoll.create_group / init_process_group")

    def boxed(self) -> NoReturn:
        _cannot("boxed() (a torch C++ handle)", "for torch's own ProcessGroup object call "
                "torch.distributed.init_process_group('raycoll') inside the ranks")

    @staticmethod
    def unbox(obj: Any) -> NoReturn:
        _cannot("unbox() (a torch C++ handle)", "raycoll's ProcessGroup is a Python object")

    def shrink(self, *args: Any, **kwargs: Any) -> NoReturn:
        _cannot("shrink", "use raycoll.shrink_group")

    def suspend(self) -> NoReturn:
        _cannot("suspend", "destroy the group and form it again")

    def resume(self) -> NoReturn:
        _cannot("resume", "destroy the group and form it again")

    def allocate_tensor(self, *args: Any, **kwargs: Any) -> NoReturn:
        _cannot("allocate_tensor", "allocate with torch or numpy (supports_tensor_alloc is "
                "False)")

    def setUsePgForSymmMemRendezvous(self, value: bool) -> NoReturn:  # noqa: N802 - torch's
        _cannot("symmetric-memory rendezvous", "symmetric memory is a CUDA feature of NCCL")

    @property
    def mem_allocator(self) -> NoReturn:
        _cannot("mem_allocator", "raycoll allocates no tensors for the caller")

    @staticmethod
    def create_device(hostname: str = "", interface: str = "",
                      lazy_init: Optional[bool] = None) -> NoReturn:
        _cannot("gloo Device", "raycoll's ranks connect over what Ray knows of their nodes")

    @staticmethod
    def create_default_device(lazy_init: Optional[bool] = None) -> NoReturn:
        _cannot("gloo Device", "raycoll's ranks connect over what Ray knows of their nodes")

