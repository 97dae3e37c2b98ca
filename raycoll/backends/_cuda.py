"""GPU helpers shared by the GPU backends: lazy cupy and NCCL, device choice, bfloat16 math.

Nothing here imports cupy or torch at module import: ``import raycoll`` works without either.
What a GPU backend needs is reached through functions that import lazily and raise
:class:`~raycoll.errors.BackendUnavailableError` naming what is missing.

GPU tensors themselves (pointer, strides, device, cupy views) are described by the one tensor
adapter, :func:`raycoll.tensors.describe_gpu`; :func:`cupy_module` and :func:`storage_dtype`
live there and are re-exported here for the backends. cupy has no bfloat16, so arithmetic on
bfloat16 bits goes through float32 (:func:`bf16_to_f32` / :func:`f32_to_bf16_`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import Any, Optional, Sequence

from raycoll.errors import BackendUnavailableError
from raycoll.tensors import _CUPY_HINT, cupy_module, storage_dtype

__all__ = [
    "cupy_module",
    "nccl_module",
    "nccl_unavailable_reason",
    "device_ordinal",
    "ray_assigned_device",
    "select_device",
    "bf16_to_f32",
    "f32_to_bf16_",
    "storage_dtype",
]


def nccl_module() -> Any:
    """``cupy.cuda.nccl``, or raise ``BackendUnavailableError`` naming what is missing."""
    reason = nccl_unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"the NCCL backend is not available here: {reason}")
    from cupy.cuda import nccl

    return nccl


def _installed(name: str) -> bool:
    """Whether ``import name`` can work (without importing it)."""
    if name in sys.modules:
        return sys.modules[name] is not None  # None: import explicitly blocked
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=1)
def nccl_unavailable_reason() -> Optional[str]:
    """``None`` when cupy with NCCL and a CUDA GPU are usable in this process, else why not."""
    if not _installed("cupy"):
        return f"cupy is not installed; {_CUPY_HINT}"
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return f"cupy cannot be imported ({type(exc).__name__}: {exc})"
    if not getattr(nccl, "available", False):
        return "cupy cannot load the NCCL library (libnccl); install NCCL or nvidia-nccl-cu12"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError without a driver or GPU
        return f"no usable CUDA GPU ({type(exc).__name__}: {exc})"
    if count < 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return f"no CUDA GPU is visible to this process (CUDA_VISIBLE_DEVICES={visible!r})"
    return None


# ---------------------------------------------------------------------- devices
def device_ordinal(gpu_ids: Sequence[str], visible: Optional[str]) -> Optional[int]:
    """The local CUDA ordinal of the first of ``gpu_ids`` (Ray's ids), or ``None`` if none.

    Ray sets ``CUDA_VISIBLE_DEVICES`` (``visible``) to the assigned ids, so the ordinal is the
    id's position in that list (0 for a one-GPU actor); when ``CUDA_VISIBLE_DEVICES`` is left
    alone (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``) it is the id itself.
    """
    ids = [str(i) for i in gpu_ids]
    if not ids:
        return None
    if visible is not None:
        listed = [v.strip() for v in visible.split(",") if v.strip()]
        return listed.index(ids[0]) if ids[0] in listed else 0
    try:
        return int(ids[0])
    except ValueError:  # a GPU UUID: its ordinal is only known through CUDA_VISIBLE_DEVICES
        return 0


def ray_assigned_device() -> Optional[int]:
    """The local CUDA ordinal of the first GPU Ray assigned to this worker, or ``None``."""
    try:
        import ray

        ids = list(ray.get_gpu_ids())
    except Exception:  # noqa: BLE001 - not in a Ray worker, or Ray not initialized
        return None
    return device_ordinal([str(i) for i in ids], os.environ.get("CUDA_VISIBLE_DEVICES"))


def select_device() -> Optional[int]:
    """Make the GPU Ray assigned to this rank the current device of torch and cupy.

    Only libraries that are already imported are touched (importing them here would cost
    every CPU-only rank seconds); a library imported later starts on device 0, which is the
    assigned GPU whenever Ray set ``CUDA_VISIBLE_DEVICES``. Returns the device, or ``None``
    when Ray assigned no GPU.
    """
    device = ray_assigned_device()
    if device is None:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and device < torch.cuda.device_count():
        torch.cuda.set_device(device)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            cupy.cuda.Device(device).use()
        except Exception:  # noqa: BLE001 - cupy present but no usable GPU: nothing to select
            pass
    return device


# ---------------------------------------------------------------------- bfloat16
def bf16_to_f32(bits: Any) -> Any:
    """float32 values of bfloat16 bits held in a cupy uint16 array (a new array)."""
    cp = cupy_module("bfloat16 arithmetic")
    return (bits.astype(cp.uint32) << 16).view(cp.float32)


def f32_to_bf16_(values: Any, bits: Any) -> None:
    """Round float32 ``values`` to bfloat16 (nearest even) into the uint16 array ``bits``."""
    cp = cupy_module("bfloat16 arithmetic")
    u = cp.ascontiguousarray(values, dtype=cp.float32).view(cp.uint32)
    rounded = ((u + cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1))) >> 16).astype(cp.uint16)
    rounded = cp.where(cp.isnan(values), cp.uint16(0x7FC0), rounded)
    bits[...] = rounded.reshape(bits.shape)
