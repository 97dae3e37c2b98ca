"""Array adapters: what kind of tensor a value is, where it lives, and a zero-copy numpy view.

numpy arrays are the native currency of the object-store backend. torch CPU tensors are
viewed as numpy without a copy (``Tensor.numpy()`` shares memory). GPU arrays (cupy, torch
CUDA, anything with ``__cuda_array_interface__``) are recognised here and handed to the
backend registered for the ``cuda`` device. torch and cupy are imported lazily: raycoll needs
neither.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import numpy as np

__all__ = ["TensorInfo", "describe", "host_view", "device_type", "is_tensor", "is_torch", "is_cupy"]


@dataclass(frozen=True)
class TensorInfo:
    """What raycoll needs to know of a tensor to validate and fingerprint a call."""

    kind: str  # "numpy" | "torch" | "cupy" | "cuda-array"
    device: str  # "cpu" | "cuda"
    shape: Tuple[int, ...]
    dtype: str  # numpy-style name: "float32", "bfloat16", "bool", ...
    numel: int
    itemsize: int
    contiguous: bool
    writable: bool

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def _torch_tensor_type() -> Any:
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def is_torch(value: Any) -> bool:
    """True for a torch tensor (without importing torch)."""
    cls = _torch_tensor_type()
    return cls is not None and isinstance(value, cls)


def is_cupy(value: Any) -> bool:
    """True for a cupy array (without importing cupy)."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(value, cupy.ndarray)


def is_tensor(value: Any) -> bool:
    """True for numpy arrays, torch tensors, cupy arrays and array-protocol objects."""
    return (
        isinstance(value, np.ndarray)
        or is_torch(value)
        or is_cupy(value)
        or hasattr(value, "__cuda_array_interface__")
    )


def device_type(value: Any) -> str:
    """``"cpu"`` or ``"cuda"`` (the key used to pick a backend)."""
    if isinstance(value, np.ndarray):
        return "cpu"
    if is_torch(value):
        return str(value.device.type)
    if is_cupy(value) or hasattr(value, "__cuda_array_interface__"):
        return "cuda"
    raise TypeError(f"expected a numpy array, torch tensor or cupy array, got {type(value).__name__}")


_DTYPE_NAMES: Dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """``dtype.name``, cached (numpy computes it in Python, a few microseconds a call, and
    every collective and send asks)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        name = _DTYPE_NAMES[dtype] = dtype.name
        return name
    except TypeError:  # an unhashable dtype-like
        return dtype.name


def describe(value: Any, name: str = "tensor") -> TensorInfo:
    """Describe ``value``; raise ``TypeError`` naming ``name`` if it is not a tensor."""
    if isinstance(value, np.ndarray):
        return TensorInfo(
            "numpy",
            "cpu",
            tuple(value.shape),
            dtype_name(value.dtype),
            int(value.size),
            value.dtype.itemsize,
            bool(value.flags.c_contiguous),
            bool(value.flags.writeable),
        )
    if is_torch(value):
        return TensorInfo(
            "torch",
            str(value.device.type),
            tuple(int(s) for s in value.shape),
            str(value.dtype).replace("torch.", ""),
            int(value.numel()),
            int(value.element_size()),
            bool(value.is_contiguous()),
            True,
        )
    if is_cupy(value):
        return TensorInfo(
            "cupy",
            "cuda",
            tuple(value.shape),
            dtype_name(value.dtype),
            int(value.size),
            value.dtype.itemsize,
            bool(value.flags.c_contiguous),
            True,
        )
    if hasattr(value, "__cuda_array_interface__"):
        iface = value.__cuda_array_interface__
        dtype = np.dtype(iface["typestr"])
        shape = tuple(iface["shape"])
        return TensorInfo(
            "cuda-array",
            "cuda",
            shape,
            dtype_name(dtype),
            int(np.prod(shape, dtype=np.int64)),
            dtype.itemsize,
            iface.get("strides") is None,
            not iface["data"][1],
        )
    raise TypeError(
        f"{name} must be a numpy array, torch tensor or cupy array, got {type(value).__name__}"
    )


def host_view(value: Any, name: str = "tensor") -> np.ndarray:
    """A numpy array sharing memory with a CPU tensor (no copy)."""
    if isinstance(value, np.ndarray):
        return value
    if is_torch(value):
        if value.device.type != "cpu":
            raise TypeError(f"{name} is on {value.device}, expected a CPU tensor")
        try:
            return value.detach().numpy()
        except TypeError as exc:  # e.g. bfloat16: numpy has no such dtype
            raise TypeError(
                f"{name} has dtype {value.dtype}, which numpy cannot view; "
                "convert it (e.g. .float()) or use a GPU backend"
            ) from exc
    raise TypeError(f"{name} must be a CPU array (numpy or torch), got {type(value).__name__}")
