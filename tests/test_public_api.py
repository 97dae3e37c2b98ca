"""The public surface: ``raycoll.__all__`` is pinned, and every public name is documented.

Adding a public name is a deliberate act: add it to ``EXPECTED`` here too (httpx pins its
``__all__`` the same way).
"""

from __future__ import annotations

import inspect
from typing import Any, List

import pytest

import raycoll

EXPECTED = [
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


def test_all_is_pinned():
    assert len(raycoll.__all__) == len(set(raycoll.__all__)), "duplicates in raycoll.__all__"
    assert sorted(raycoll.__all__) == sorted(EXPECTED)


def test_every_public_name_exists():
    for name in raycoll.__all__:
        assert hasattr(raycoll, name), name
    # the torch.distributed names the design promises
    for name in ["Backend", "BackendConfig", "ProcessGroup", "Work", "Join", "Joinable",
                 "JoinHook", "ReduceOp", "P2POp"]:
        assert name in raycoll.__all__


def _own_doc(obj: Any) -> str:
    """A class's own docstring (not inherited), a function's docstring."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return (doc or "").strip()


@pytest.mark.parametrize("name", sorted(raycoll.__all__))
def test_public_name_has_a_docstring(name):
    assert _own_doc(getattr(raycoll, name)), f"raycoll.{name} has no docstring"


def _public_members(cls: type) -> List[str]:
    """Public methods and properties of ``cls`` without a docstring (an override of a
    documented base-class member inherits its docstring, as ``inspect.getdoc`` and Sphinx
    have it)."""
    names = []
    for key, value in vars(cls).items():
        if key.startswith("_"):
            continue
        member = getattr(cls, key)
        if isinstance(value, property) or inspect.isfunction(member) or inspect.ismethod(member):
            if not (inspect.getdoc(member) or "").strip():
                names.append(f"{cls.__name__}.{key}")
    return names


def test_public_methods_of_public_classes_have_docstrings():
    missing = []
    for name in raycoll.__all__:
        obj = getattr(raycoll, name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            missing += _public_members(obj)
    assert missing == []


def test_modules_have_docstrings_and_the_package_is_typed():
    import ast
    import importlib
    import importlib.util
    import pkgutil
    from pathlib import Path

    root = Path(raycoll.__file__).parent
    assert (root / "py.typed").exists()
    undocumented = []
    # Read each module's docstring from its source rather than importing it: some modules
    # (raycoll.torch_backend.process_group) import an optional extra, and the [test] extra
    # does not install it.
    for info in pkgutil.walk_packages([str(root)], prefix="raycoll."):
        spec = importlib.util.find_spec(info.name)
        if not spec.origin.endswith(".py"):  # the compiled core: its doc is in module.c
            assert importlib.import_module(info.name).__doc__, info.name
            continue
        source = Path(spec.origin).read_text()
        if not (ast.get_docstring(ast.parse(source)) or "").strip():
            undocumented.append(info.name)
    assert undocumented == []
