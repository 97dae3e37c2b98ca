"""A drop-in for ``ray.util.collective``: ``import raycoll.util.collective as col``.

Code written for Ray's collective library (Ray 2.60) moves to raycoll by changing that one
import: the same names, signatures and defaults (:mod:`.collective`), the same ``types``
(``col.types.ReduceOp``, ``col.types.Backend``), results in place, blocking calls, -1 from
``get_rank`` outside a group. The groups are raycoll groups (its data plane, its named errors
on every rank, its timeouts); the ``*_multigpu`` names take one GPU per rank. See
docs/util-collective.md for what maps to what and what differs.
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
from raycoll.util.collective.types import Backend, ReduceOp

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
]
