"""``backend="raycoll"`` in Ray's own ``ray.util.collective``: a ``BaseGroup`` over raycoll.

Ray 2.60 keeps a registry of collective backends (``ray.util.collective.backend_registry``):
a backend is a subclass of Ray's ``BaseGroup`` that Ray's module instantiates, in each rank,
as ``cls(world_size, rank, group_name)``, and calls with Ray's list-wrapped arguments and
options objects. :class:`RaycollGroup` is such a class: each instance is a raycoll root
group of the same name (its rendezvous by name, its data plane, NCCL for GPU tensors, its
named errors), so that code written for Ray's module runs on raycoll by naming the backend:

    import ray.util.collective as col
    import raycoll.util.collective  # registers "raycoll" in Ray's registry (or: register())
    col.init_collective_group(2, rank, backend="raycoll", group_name="dp")
    col.allreduce(x, group_name="dp")

Ray's rule holds: the backend must be registered in the driver and in every process that
joins a group (:func:`register`, which importing :mod:`raycoll.util.collective` calls; for
processes that import nothing of raycoll, Ray's ``worker_process_setup_hook``:
``ray.init(runtime_env={"worker_process_setup_hook": "raycoll.util.collective.register"})``).

Ray's semantics are kept where code relies on them: results in place, read-only numpy arrays
written into as Ray's gloo group writes them (with a one-time warning, :mod:`.readonly`),
``reduce`` leaving the other ranks' tensors as they were, ``reducescatter`` leaving its
input list as it was. The calls' checks before data moves, the errors and the timeouts are
raycoll's (see docs/util-collective.md). The group's timeout is raycoll's default
(:data:`raycoll.process_group.DEFAULT_TIMEOUT_S`): Ray passes none to a registered backend.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

from ray.util.collective.collective_group.base_collective_group import BaseGroup

from raycoll.groups import destroy_process_group, join_named_group
from raycoll.process_group import DEFAULT_TIMEOUT_S, ProcessGroup
from raycoll.util.collective import collective as dropin

__all__ = ["RaycollGroup", "BACKEND_NAME", "register", "is_registered"]

logger = logging.getLogger("raycoll")

#: The name the group class is registered under in Ray's registry (Ray upper-cases names).
BACKEND_NAME = "RAYCOLL"


def _one(values: Any, name: str, fn: str) -> Any:
    """The one tensor of Ray's list-wrapped argument: raycoll runs one GPU per rank."""
    if not isinstance(values, (list, tuple)) or len(values) != 1:
        count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise NotImplementedError(
            f"{fn}: backend 'raycoll' runs one tensor per rank (an actor per GPU), so {name} "
            f"must hold exactly one tensor (got {count}); start one actor per GPU and call the "
            "single-tensor collective in each")
    return values[0]


def _opt(options: Any, field: str, default: Any) -> Any:
    """A field of Ray's options (an instance, or the class Ray's allreduce passes)."""
    return default if options is None else getattr(options, field, default)


class RaycollGroup(BaseGroup):
    """A raycoll root group as a ``ray.util.collective`` backend (``backend="raycoll"``).

    Ray's module creates it in each rank (at ``init_collective_group``, or at the first
    collective of a group declared by ``create_collective_group``): the rank rendezvouses
    by name with the group's other ranks, as ``raycoll.init_process_group`` does. A group of
    that name this process already holds in raycoll, of the same size and rank, is taken as
    it is (formed by ``raycoll.create_group`` from the driver, say)."""

    def __init__(self, world_size: int, rank: int, group_name: str) -> None:
        super().__init__(world_size, rank, group_name)
        held = dropin._group(group_name)
        if held is not None:
            if (held.size(), held.rank()) != (world_size, rank):
                raise ValueError(
                    f"group {group_name!r}: this process already holds a raycoll group of that "
                    f"name as rank {held.rank()} of {held.size()}, not rank {rank} of "
                    f"{world_size}; destroy it first or pick another group_name")
            self._pg: ProcessGroup = held
        else:
            self._pg = join_named_group(group_name, world_size, rank, None, DEFAULT_TIMEOUT_S)

    @classmethod
    def backend(cls) -> str:
        """Ray's name of this backend."""
        return BACKEND_NAME

    @classmethod
    def check_backend_availability(cls) -> bool:
        """Always True: raycoll's CPU path needs nothing more (GPU tensors need NCCL, which
        a GPU collective checks, naming what is missing)."""
        return True

    def destroy_group(self) -> None:
        """Leave the raycoll group (Ray's ``destroy_collective_group`` in this rank)."""
        if dropin._group(self._group_name) is self._pg:
            destroy_process_group(self._group_name)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensor: List[Any], allreduce_options: Any = None) -> None:
        """``tensor[0]`` reduced over the group, in place on every rank."""
        op = _opt(allreduce_options, "reduceOp", dropin.types.ReduceOp.SUM)
        dropin.allreduce(_one(tensor, "tensor", "allreduce"), self._group_name, op)

    def barrier(self, barrier_options: Any = None) -> None:
        """Block until every rank of the group has called it."""
        dropin.barrier(self._group_name)

    def reduce(self, tensor: List[Any], reduce_options: Any = None) -> None:
        """``tensor[0]`` reduced into the root rank's (the others' left as they were)."""
        self._index(reduce_options, "root_tensor", "reduce")
        dropin.reduce(_one(tensor, "tensor", "reduce"), _opt(reduce_options, "root_rank", 0),
                      self._group_name, _opt(reduce_options, "reduceOp",
                                             dropin.types.ReduceOp.SUM))

    def allgather(self, tensor_list: List[List[Any]], tensor: List[Any],
                  allgather_options: Any = None) -> None:
        """Every rank's ``tensor[0]`` into ``tensor_list[0]`` (one tensor per rank)."""
        outputs = _one(tensor_list, "tensor_list", "allgather")
        if not isinstance(outputs, list):
            outputs = list(outputs)
        dropin.allgather(outputs, _one(tensor, "tensor", "allgather"), self._group_name)

    def broadcast(self, tensor: List[Any], broadcast_options: Any = None) -> None:
        """The root rank's ``tensor[0]`` copied into every rank's."""
        self._index(broadcast_options, "root_tensor", "broadcast")
        dropin.broadcast(_one(tensor, "tensor", "broadcast"),
                         _opt(broadcast_options, "root_rank", 0), self._group_name)

    def reducescatter(self, tensor: List[Any], tensor_list: List[List[Any]],
                      reducescatter_options: Any = None) -> None:
        """``tensor_list[0][i]`` reduced over the ranks into rank i's ``tensor[0]``."""
        inputs = _one(tensor_list, "tensor_list", "reducescatter")
        dropin.reducescatter(_one(tensor, "tensor", "reducescatter"), list(inputs),
                             self._group_name, _opt(reducescatter_options, "reduceOp",
                                                    dropin.types.ReduceOp.SUM))

    def send(self, tensor: List[Any], send_options: Any) -> None:
        """``tensor[0]`` to ``send_options.dst_rank`` (its first ``n_elements`` if set)."""
        self._index(send_options, "dst_gpu_index", "send")
        dropin.send_multigpu(_one(tensor, "tensor", "send"), send_options.dst_rank, 0,
                             self._group_name, _opt(send_options, "n_elements", 0))

    def recv(self, tensor: List[Any], recv_options: Any) -> None:
        """Into ``tensor[0]`` from ``recv_options.src_rank`` (its first ``n_elements``)."""
        self._index(recv_options, "src_gpu_index", "recv")
        dropin.recv_multigpu(_one(tensor, "tensor", "recv"), recv_options.src_rank, 0,
                             self._group_name, _opt(recv_options, "n_elements", 0))

    @staticmethod
    def _index(options: Any, field: str, fn: str) -> None:
        value = _opt(options, field, 0)
        if value != 0:
            raise NotImplementedError(f"{fn}: {field}={value!r}: backend 'raycoll' runs one "
                                      "GPU per rank, whose index is 0; start one actor per GPU")


def _registry() -> Optional[Any]:
    """Ray's backend registry, or None on a Ray without one (before 2.60's)."""
    try:
        from ray.util.collective import backend_registry
    except ImportError:
        return None
    return backend_registry


def is_registered() -> bool:
    """Whether ``"raycoll"`` is a backend of Ray's ``ray.util.collective`` in this process."""
    registry = _registry()
    return registry is not None and registry._global_registry.is_registered(BACKEND_NAME)


def register() -> None:
    """Register :class:`RaycollGroup` as backend ``"raycoll"`` of Ray's ``ray.util.collective``
    in this process (and ``Backend.RAYCOLL`` in Ray's types); nothing if it is already.

    Ray's rule: every process that uses the backend registers it (the driver, and each
    actor before it joins a group); importing :mod:`raycoll.util.collective` does. Raises
    ``RuntimeError`` on a Ray without the registry, naming the version needed."""
    registry = _registry()
    if registry is None:
        import ray

        raise RuntimeError(f"register(): Ray {ray.__version__}'s ray.util.collective has no "
                           "backend registry (register_collective_backend, Ray 2.60 and later); "
                           "use the drop-in instead: import raycoll.util.collective as col")
    if registry._global_registry.is_registered(BACKEND_NAME):
        held = registry._global_registry.get(BACKEND_NAME)
        if held is not RaycollGroup:
            raise ValueError(f"register(): Ray's backend {BACKEND_NAME!r} is already "
                             f"registered to {held!r}, not raycoll's RaycollGroup")
        return
    registry.register_collective_backend(BACKEND_NAME, RaycollGroup)
    logger.debug("raycoll: registered backend %r in ray.util.collective", BACKEND_NAME)



try:  # importing this module imported Ray's: register, as raycoll.ray_hooks would have
    register()
except Exception as _exc:  # noqa: BLE001 - register() raises the reason when called
    logger.debug("raycoll: registering backend %r in ray.util.collective failed: %s",
                 BACKEND_NAME, _exc)
