"""A drop-in for ``ray.util.collective``: ``import raycoll.util.collective as col``; and
backend ``"raycoll"`` of Ray's own ``ray.util.collective`` (:func:`register`).

Code written for Ray's collective library (Ray 2.60) moves to raycoll by changing that one
import: the same names, signatures and defaults (:mod:`.collective`), the same ``types``
(``col.types.ReduceOp``, ``col.types.Backend``), results in place, blocking calls, -1 from
``get_rank`` outside a group. The groups are raycoll groups (its data plane, its named errors
on every rank, its timeouts); the ``*_multigpu`` names take one GPU per rank. Results are
written into read-only numpy arrays as Ray writes them, with a one-time
:class:`ReadOnlyWriteWarning` (:mod:`.readonly`).

Code that keeps Ray's module names the backend instead: ``backend="raycoll"``
(:mod:`.ray_group`). The backend is registered in Ray's registry in every process that
imported raycoll, as soon as it imports ``ray.util.collective`` (:mod:`raycoll.ray_hooks`),
or by :func:`register`. See docs/util-collective.md for what maps to what and what differs.
"""

from raycoll.util.collective import types
from raycoll.util.collective.collective import (
    BACKENDS,
    allgather,
    allgather_multigpu,
    allreduce,
    allreduce_multigpu,
    barrier,
    broadcast,
    broadcast_multigpu,
    create_collective_group,
    destroy_collective_group,
    get_collective_group_size,
    get_group_handle,
    get_rank,
    gloo_available,
    init_collective_group,
    is_backend_available,
    is_group_initialized,
    nccl_available,
    recv,
    recv_multigpu,
    reduce,
    reduce_multigpu,
    reducescatter,
    reducescatter_multigpu,
    register_collective_backend,
    send,
    send_multigpu,
    synchronize,
)
from raycoll.util.collective.readonly import ReadOnlyWriteWarning
from raycoll.util.collective.types import Backend, ReduceOp


def register() -> None:
    """Register backend ``"raycoll"`` in Ray's own ``ray.util.collective`` in this process
    (:func:`raycoll.util.collective.ray_group.register`; imports Ray's module, and with it
    torch where installed). Also usable as Ray's ``worker_process_setup_hook``:
    ``ray.init(runtime_env={"worker_process_setup_hook":
    "raycoll.util.collective.register"})`` registers it in every worker of the job."""
    from raycoll.util.collective.ray_group import register as _register

    _register()


__all__ = [
    # ray.util.collective's __all__ (Ray 2.60)
    "nccl_available", "gloo_available", "is_backend_available", "is_group_initialized",
    "init_collective_group", "destroy_collective_group", "create_collective_group",
    "get_rank", "get_collective_group_size", "allreduce", "allreduce_multigpu", "barrier",
    "reduce", "reduce_multigpu", "broadcast", "broadcast_multigpu", "allgather",
    "allgather_multigpu", "reducescatter", "reducescatter_multigpu", "send", "send_multigpu",
    "recv", "recv_multigpu", "get_group_handle", "register_collective_backend",
    # also here: Ray's types (ray.util.collective.types), synchronize, the backend map
    "types", "ReduceOp", "Backend", "synchronize", "BACKENDS",
    # backend "raycoll" in Ray's own module; the warning of writes into read-only arrays
    "register", "ReadOnlyWriteWarning",
]
