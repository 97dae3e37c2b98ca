"""raycoll: the ``torch.distributed`` (c10d) collective API for Ray actors.

Layers, top to bottom (data flows one way):

- public functions (:mod:`raycoll.collectives`, :mod:`raycoll.p2p`,
  :mod:`raycoll.object_collectives`, :mod:`raycoll.coalesced`, :mod:`raycoll.groups`,
  driver-side :mod:`raycoll.launch` and :mod:`raycoll.status`):
  resolve the group, validate, dispatch;
- :class:`ProcessGroup` (:mod:`raycoll.process_group`, the per-process registry of groups in
  :mod:`raycoll.world`): ranks, sequence numbers, issue order, device -> backend dispatch;
- backends (:mod:`raycoll.backends`): ``objstore`` for CPU arrays through the Ray object
  store, others registered per device;
- the coordinator actor (:mod:`raycoll.coordinator`): rendezvous, arrival matching,
  fingerprints, failures — control only, plus small inline payloads.

:mod:`raycoll.torch_backend` makes raycoll a ``torch.distributed`` backend
(``init_process_group("raycoll")``); importing raycoll registers it without importing torch.
Likewise :mod:`raycoll.ray_hooks` registers ``"raycoll"`` in Ray's ``ray.util.collective``
once that is imported, and as a Ray Direct Transport once torch is.
"""

from raycoll.availability import (
    ProcessGroupGloo,
    get_default_backend_for_device,
    is_backend_available,
    is_gloo_available,
    is_mpi_available,
    is_torchelastic_launched,
    is_ucc_available,
    is_xccl_available,
)
from raycoll.backends import Backend, BackendConfig, is_nccl_available
from raycoll.call_options import (
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from raycoll import coalesced as _coalesced, collectives as _collectives, p2p as _p2p
from raycoll import multi as _multi
from raycoll.coalesced import all_gather_coalesced, all_reduce_coalesced
from raycoll.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    monitored_barrier,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
)
from raycoll.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from raycoll.debug import DebugLevel, get_debug_level, record_comm
from raycoll.errors import (
    BackendUnavailableError,
    CollectiveError,
    CollectiveMismatchError,
    CoordinatorDiedError,
    DistTimeoutError,
    GroupBrokenError,
    GroupDestroyedError,
    GroupError,
    GroupNotFoundError,
    PeerArgumentError,
    RaycollError,
    RankFailedError,
    SpawnError,
    CodeNotShippableError,
    RaySessionError,
    InvalidArgumentError,
    TensorSizeError,
    TensorTypeError,
    UnsupportedOpError,
)
from raycoll.gradients import GradientAverager
from raycoll.native import native_available, native_status
from raycoll.process_group import ProcessGroup
from raycoll.world import GroupMember
from raycoll.world import group as _world_group
from raycoll.join import Join, JoinHook, Joinable
from raycoll.launch import create_group, destroy_group, spawn
from raycoll.bulk import create_groups
from raycoll.elastic import SHRINK_ABORT, SHRINK_DEFAULT, admit_new_ranks, grow_group
from raycoll.state_transfer import broadcast_state_dict
from raycoll.status import group_status
from raycoll.options import GroupOptions
from raycoll.object_collectives import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from raycoll.groups import (
    destroy_process_group,
    get_backend,
    get_backend_config,
    get_global_rank,
    get_group,
    get_group_rank,
    get_node_local_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    GroupName,
    default_pg_timeout,
    get_pg_count,
    shrink_group,
    init_process_group,
    is_available,
    is_initialized,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    split_group,
)
from raycoll.object_api import provide as _provide_object_api
from raycoll.reduce_op import ReduceOp, supports_complex
from raycoll.store import PrefixStore, Store, get_store
from raycoll import groups as _groups, store as _store
from raycoll.work import Future, Work
from raycoll import ray_hooks as _ray_hooks, torch_backend as _torch_backend

__version__ = "0.1.0"

__all__ = [
    # groups
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank",
    "get_world_size", "new_group", "new_subgroups", "get_group_rank", "get_global_rank",
    "get_process_group_ranks", "get_group", "ProcessGroup", "GroupMember",
    "get_node_local_rank", "is_available", "get_backend", "get_backend_config", "group",
    "new_subgroups_by_enumeration", "split_group", "shrink_group", "get_pg_count", "GroupName",
    "default_pg_timeout",
    # collectives
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp",
    "all_reduce_coalesced", "all_gather_coalesced",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
    # the ProcessGroup object API's options
    "AllreduceOptions", "AllreduceCoalescedOptions", "AllToAllOptions", "BarrierOptions",
    "BroadcastOptions", "GatherOptions", "ReduceOptions", "ReduceScatterOptions",
    "ScatterOptions",
    # the key-value store
    "Store", "PrefixStore", "get_store",
    # availability and debugging
    "is_backend_available", "is_gloo_available", "is_mpi_available", "is_ucc_available",
    "is_xccl_available", "is_torchelastic_launched", "get_default_backend_for_device",
    "supports_complex", "ProcessGroupGloo", "DebugLevel", "get_debug_level", "record_comm",
    # types
    "ReduceOp", "Backend", "BackendConfig", "Work", "Future", "is_nccl_available",
    "native_available", "native_status",
    # uneven inputs
    "Join", "Joinable", "JoinHook", "GradientAverager",
    # driver side
    "create_group", "create_groups", "destroy_group", "spawn", "group_status", "GroupOptions",
    # elastic groups
    "SHRINK_DEFAULT", "SHRINK_ABORT", "grow_group", "admit_new_ranks", "broadcast_state_dict",
    # errors
    "RaycollError", "GroupError", "GroupNotFoundError", "GroupDestroyedError",
    "CollectiveError", "CollectiveMismatchError", "PeerArgumentError", "DistTimeoutError",
    "GroupBrokenError", "RankFailedError", "CoordinatorDiedError", "BackendUnavailableError",
    "SpawnError", "CodeNotShippableError", "RaySessionError", "TensorSizeError",
    "TensorTypeError", "InvalidArgumentError", "UnsupportedOpError",
]

#: torch's ``dist.group`` (``group.WORLD``, the default group); no module is named ``group``.
group = _world_group

# ProcessGroup's object API (pg.allreduce([t], opts)) calls the module functions, which sit
# above ProcessGroup: they are handed down here rather than imported from below
_provide_object_api(_collectives, _p2p, _coalesced, _multi, _groups, _store)

_torch_backend.install()  # registers now if torch is imported, else right after it is
_ray_hooks.install()  # "raycoll" in ray.util.collective and as Ray Direct Transport, likewise
