"""GPU helpers shared by the GPU backends: lazy cupy, device choice, raw views of GPU tensors.

Nothing here imports cupy or torch at module import: ``import raycoll`` works without either.
What a GPU backend needs is reached through functions that import lazily and raise
:class:`~raycoll.errors.BackendUnavailableError` naming what is missing.

:class:`GpuArray` describes any GPU tensor (cupy array, torch CUDA tensor, or an object with
``__cuda_array_interface__``) by pointer, shape, strides, dtype and device, and gives a
zero-copy cupy view of its memory. torch tensors are viewed through ``cupy.cuda.UnownedMemory``
on ``data_ptr()`` (not through ``__cuda_array_interface__``, which may synchronize a stream and
refuses bfloat16); bfloat16 memory is viewed as ``uint16`` (cupy has no bfloat16) and
arithmetic on it goes through float32 (:func:`bf16_to_f32` / :func:`f32_to_bf16_`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from raycoll.errors import BackendUnavailableError

__all__ = [
    "GpuArray",
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

_CUPY_HINT = "install cupy for your CUDA version (e.g. pip install cupy-cuda12x)"


def cupy_module(purpose: str = "GPU collectives") -> Any:
    """``import cupy``, or raise ``BackendUnavailableError`` saying what is missing and why."""
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(
            f"{purpose} need cupy, which cannot be imported here ({exc}); {_CUPY_HINT}"
        ) from exc
    return cupy


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


# ---------------------------------------------------------------------- tensors
def storage_dtype(dtype: str) -> np.dtype:
    """The numpy/cupy dtype that holds ``dtype``'s bits (bfloat16 -> uint16)."""
    if dtype == "bfloat16":
        return np.dtype(np.uint16)
    try:
        return np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"GPU tensors of dtype {dtype} are not supported") from exc


@dataclass(frozen=True)
class GpuArray:
    """A GPU tensor seen as memory: where it is, how it is laid out, what it holds."""

    obj: Any
    lib: str  # "cupy" | "torch" | "cuda-array"
    dtype: str  # logical dtype name ("bfloat16", "float32", ...)
    shape: Tuple[int, ...]
    strides: Optional[Tuple[int, ...]]  # in bytes; None for C-contiguous
    ptr: int
    device: int
    itemsize: int
    numel: int
    contiguous: bool

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @classmethod
    def of(cls, value: Any, name: str = "tensor") -> "GpuArray":
        """Describe a GPU tensor; ``TypeError`` naming ``name`` when it is not one."""
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            if value.device.type != "cuda":
                raise TypeError(f"{name} is on {value.device}, expected a CUDA tensor")
            size = value.element_size()
            return cls(value, "torch", str(value.dtype).replace("torch.", ""),
                       tuple(int(s) for s in value.shape),
                       tuple(int(s) * size for s in value.stride()), int(value.data_ptr()),
                       int(value.device.index if value.device.index is not None
                           else torch.cuda.current_device()),
                       size, int(value.numel()), bool(value.is_contiguous()))
        cupy = sys.modules.get("cupy")
        if cupy is not None and isinstance(value, cupy.ndarray):
            return cls(value, "cupy", value.dtype.name, tuple(value.shape), tuple(value.strides),
                       int(value.data.ptr), int(value.device.id), value.dtype.itemsize,
                       int(value.size), bool(value.flags.c_contiguous))
        iface = getattr(value, "__cuda_array_interface__", None)
        if iface is not None:
            cp = cupy_module(f"{name} (a __cuda_array_interface__ object)")
            arr = cp.asarray(value)  # zero copy
            described = cls.of(arr, name)
            return cls(value, "cuda-array", described.dtype, described.shape, described.strides,
                       described.ptr, described.device, described.itemsize, described.numel,
                       described.contiguous)
        raise TypeError(f"{name} must be a GPU tensor (cupy array or torch CUDA tensor), "
                        f"got {type(value).__name__}")

    def cupy_view(self) -> Any:
        """A cupy array sharing this tensor's memory (bfloat16 viewed as uint16)."""
        cp = cupy_module("GPU tensors")
        if self.lib == "cupy":
            return self.obj
        if self.lib == "cuda-array":
            return cp.asarray(self.obj)
        dtype = storage_dtype(self.dtype)
        if self.numel == 0:
            with cp.cuda.Device(self.device):
                return cp.empty(self.shape, dtype=dtype)
        strides = self.strides or ()
        span = self.itemsize * (1 + sum((n - 1) * s // self.itemsize
                                        for n, s in zip(self.shape, strides)))
        mem = cp.cuda.UnownedMemory(self.ptr, span, self.obj, self.device)
        return cp.ndarray(self.shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0),
                          strides=strides)

    def flat_view(self) -> Any:
        """A 1-D cupy view of a C-contiguous tensor's memory (never a copy)."""
        if not self.contiguous:
            raise ValueError("flat_view() needs a contiguous tensor")
        cp = cupy_module("GPU tensors")
        if self.lib != "torch":
            arr = self.cupy_view()
            flat = arr.reshape(-1)
            if self.numel and flat.data.ptr != arr.data.ptr:  # pragma: no cover - defensive
                raise RuntimeError("cupy copied a contiguous array on reshape")
            return flat
        dtype = storage_dtype(self.dtype)
        if self.numel == 0:
            with cp.cuda.Device(self.device):
                return cp.empty((0,), dtype=dtype)
        mem = cp.cuda.UnownedMemory(self.ptr, self.nbytes, self.obj, self.device)
        return cp.ndarray((self.numel,), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0))

    def caller_stream(self) -> Any:
        """The calling thread's current stream for this tensor's library, as a cupy stream."""
        cp = cupy_module("GPU tensors")
        if self.lib == "torch":
            torch = sys.modules["torch"]
            ptr = int(torch.cuda.current_stream(self.device).cuda_stream)
            return cp.cuda.Stream.null if ptr == 0 else cp.cuda.ExternalStream(ptr, self.device)
        with cp.cuda.Device(self.device):
            return cp.cuda.get_current_stream()


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
