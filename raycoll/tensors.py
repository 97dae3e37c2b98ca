"""The tensor adapter: what kind of tensor a value is, where it lives, and zero-copy views of it.

One adapter serves every array library, recognised by type where a library is already
imported and by the array protocols otherwise:

- CPU: numpy arrays (the native currency of the object-store backend), torch CPU tensors
  (viewed as numpy through ``Tensor.numpy()``, which shares memory), and any object exposing
  ``__array_interface__`` / ``__array_struct__`` or ``__dlpack__`` with a CPU device (viewed
  through ``np.asarray`` / ``np.from_dlpack``, which share memory too);
- GPU: cupy arrays, torch CUDA tensors, and any object exposing ``__cuda_array_interface__``
  or ``__dlpack__`` with a CUDA device, handed to the backend registered for ``cuda``.

:func:`describe` gives a :class:`TensorInfo` (shape, dtype, device, layout, writability):
what the public layer validates and fingerprints. GPU backends take :func:`describe_gpu`,
whose :class:`TensorInfo` also knows the memory (pointer, byte strides, CUDA ordinal) and gives
a cupy view of it. torch tensors are viewed through ``cupy.cuda.UnownedMemory`` on
``data_ptr()`` (not through ``__cuda_array_interface__``, which may synchronize a stream and
refuses bfloat16); bfloat16 memory is viewed as ``uint16`` (cupy has no bfloat16).

Recognising a tensor imports neither torch nor cupy: a value is a torch tensor only if torch
is already imported (``sys.modules``), a cupy array only if cupy is. cupy is imported (through
:func:`cupy_module`) only for another library's GPU memory: to describe a CUDA ``__dlpack__``
object, or when a GPU backend asks where a ``__cuda_array_interface__`` object's memory is.
``import raycoll`` needs neither.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import numpy as np

from raycoll.errors import BackendUnavailableError

__all__ = ["TensorInfo", "describe", "describe_gpu", "host_view", "device_type", "is_tensor",
           "is_torch", "is_cupy", "dtype_name", "storage_dtype", "cupy_module"]

_CUPY_HINT = "install cupy for your CUDA version (e.g. pip install cupy-cuda12x)"

#: DLPack device types (``DLDeviceType``) raycoll can use.
_DLPACK_CPU = 1
_DLPACK_CUDA = 2


def cupy_module(purpose: str = "GPU collectives") -> Any:
    """``import cupy``, or raise ``BackendUnavailableError`` saying what is missing and why."""
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(
            f"{purpose} need cupy, which cannot be imported here ({exc}); {_CUPY_HINT}"
        ) from exc
    return cupy


# ---------------------------------------------------------------------- recognising
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


def _dlpack_device(value: Any) -> Optional[int]:
    """The DLPack device type of ``value`` (``None`` when it does not say)."""
    try:
        return int(value.__dlpack_device__()[0])
    except Exception:  # noqa: BLE001 - a broken or partial protocol: not a tensor to us
        return None


def _kind(value: Any) -> Optional[str]:
    """Which view of ``value`` the adapter takes; ``None`` when it is not a tensor.

    ``"numpy"``, ``"torch"``, ``"cupy"`` by type; then by protocol: ``"cuda-array"``
    (``__cuda_array_interface__``), ``"array-interface"`` (``__array_interface__`` or
    ``__array_struct__``), ``"dlpack-cpu"`` / ``"dlpack-cuda"`` (``__dlpack__``). numpy scalars
    expose ``__array_interface__`` but are values, not buffers to write into: not tensors.
    """
    if isinstance(value, np.ndarray):
        return "numpy"
    if isinstance(value, np.generic):
        return None
    if is_torch(value):
        return "torch"
    if is_cupy(value):
        return "cupy"
    if hasattr(value, "__cuda_array_interface__"):
        return "cuda-array"
    if hasattr(value, "__array_interface__") or hasattr(value, "__array_struct__"):
        return "array-interface"
    if hasattr(value, "__dlpack__"):
        device = _dlpack_device(value)
        if device == _DLPACK_CPU:
            return "dlpack-cpu"
        if device == _DLPACK_CUDA:
            return "dlpack-cuda"
    return None


_GPU_KINDS = ("cupy", "cuda-array", "dlpack-cuda")


def is_tensor(value: Any) -> bool:
    """True for numpy arrays, torch tensors, cupy arrays and array-protocol objects."""
    return _kind(value) is not None


def device_type(value: Any) -> str:
    """``"cpu"`` or ``"cuda"`` (the key used to pick a backend)."""
    kind = _kind(value)
    if kind == "torch":
        return str(value.device.type)
    if kind in _GPU_KINDS:
        return "cuda"
    if kind is not None:
        return "cpu"
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


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy/cupy dtype that holds ``dtype``'s bits (bfloat16 -> uint16)."""
    if dtype == "bfloat16":
        return np.dtype(np.uint16)
    try:
        return np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"GPU tensors of dtype {dtype} are not supported") from exc


def _c_contiguous(shape: Tuple[int, ...], strides: Optional[Tuple[int, ...]],
                  itemsize: int) -> bool:
    """Whether byte ``strides`` lay ``shape`` out in C order (numpy's rule: dimensions of
    length 1 do not count, an empty array is contiguous)."""
    if strides is None or 0 in shape:
        return True
    expected = itemsize
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


# ---------------------------------------------------------------------- the adapter
@dataclass(frozen=True)
class TensorInfo:
    """One tensor as raycoll sees it: what the public layer validates and fingerprints, and,
    for a GPU tensor, its memory (``ptr``, ``strides``, ``device_index``) and cupy views."""

    kind: str  # see _kind: "numpy" | "torch" | "cupy" | "cuda-array" | "array-interface" | ...
    device: str  # "cpu" | "cuda"
    shape: Tuple[int, ...]
    dtype: str  # numpy-style name: "float32", "bfloat16", "bool", ...
    numel: int
    itemsize: int
    contiguous: bool
    writable: bool
    obj: Any = field(default=None, repr=False, compare=False)  # the tensor itself

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    # -- GPU memory (computed on first use: only GPU backends ask)
    @functools.cached_property
    def _cupy(self) -> Any:
        """A cupy array over the memory of a tensor that is not torch's (cupy's own, or
        another library's through its protocol; zero copy)."""
        if self.kind == "cupy":
            return self.obj
        what = "__cuda_array_interface__" if self.kind == "cuda-array" else "__dlpack__"
        cp = cupy_module(f"GPU tensors (a {what} object)")
        return cp.asarray(self.obj) if self.kind == "cuda-array" else cp.from_dlpack(self.obj)

    @functools.cached_property
    def ptr(self) -> int:
        """The device address of the first element."""
        return int(self.obj.data_ptr()) if self.kind == "torch" else int(self._cupy.data.ptr)

    @functools.cached_property
    def strides(self) -> Tuple[int, ...]:
        """Strides in bytes."""
        if self.kind == "torch":
            return tuple(int(s) * self.itemsize for s in self.obj.stride())
        return tuple(self._cupy.strides)

    @functools.cached_property
    def device_index(self) -> int:
        """The CUDA ordinal of the GPU holding the tensor."""
        if self.kind == "torch":
            index = self.obj.device.index
            return int(index if index is not None else sys.modules["torch"].cuda.current_device())
        return int(self._cupy.device.id)

    def cupy_view(self) -> Any:
        """A cupy array sharing this GPU tensor's memory (bfloat16 viewed as uint16)."""
        if self.kind != "torch":
            return self._cupy
        cp = cupy_module("GPU tensors")
        dtype = storage_dtype(self.dtype)
        if self.numel == 0:
            with cp.cuda.Device(self.device_index):
                return cp.empty(self.shape, dtype=dtype)
        strides = self.strides
        span = self.itemsize * (1 + sum((n - 1) * s // self.itemsize
                                        for n, s in zip(self.shape, strides)))
        mem = cp.cuda.UnownedMemory(self.ptr, span, self.obj, self.device_index)
        return cp.ndarray(self.shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0),
                          strides=strides)

    def flat_view(self) -> Any:
        """A 1-D cupy view of a C-contiguous GPU tensor's memory (never a copy)."""
        if not self.contiguous:
            raise ValueError("flat_view() needs a contiguous tensor")
        cp = cupy_module("GPU tensors")
        if self.kind != "torch":
            arr = self.cupy_view()
            flat = arr.reshape(-1)
            if self.numel and flat.data.ptr != arr.data.ptr:  # pragma: no cover - defensive
                raise RuntimeError("cupy copied a contiguous array on reshape")
            return flat
        dtype = storage_dtype(self.dtype)
        if self.numel == 0:
            with cp.cuda.Device(self.device_index):
                return cp.empty((0,), dtype=dtype)
        mem = cp.cuda.UnownedMemory(self.ptr, self.nbytes, self.obj, self.device_index)
        return cp.ndarray((self.numel,), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0))

    def caller_stream(self) -> Any:
        """The calling thread's current stream for this tensor's library, as a cupy stream."""
        cp = cupy_module("GPU tensors")
        if self.kind == "torch":
            torch = sys.modules["torch"]
            ptr = int(torch.cuda.current_stream(self.device_index).cuda_stream)
            return (cp.cuda.Stream.null if ptr == 0
                    else cp.cuda.ExternalStream(ptr, self.device_index))
        with cp.cuda.Device(self.device_index):
            return cp.cuda.get_current_stream()


def _numpy_info(arr: np.ndarray, kind: str, obj: Any) -> TensorInfo:
    return TensorInfo(kind, "cpu", arr.shape, dtype_name(arr.dtype), arr.size,
                      arr.dtype.itemsize, arr.flags.c_contiguous, arr.flags.writeable, obj)


def _not_a_tensor(value: Any, name: str) -> TypeError:
    return TypeError(
        f"{name} must be a numpy array, torch tensor or cupy array, got {type(value).__name__}"
    )


def describe(value: Any, name: str = "tensor") -> TensorInfo:
    """Describe ``value``; raise ``TypeError`` naming ``name`` if it is not a tensor."""
    if isinstance(value, np.ndarray):  # first: the common case, kept short
        return _numpy_info(value, "numpy", value)
    kind = _kind(value)
    if kind == "torch":
        return TensorInfo(
            "torch",
            str(value.device.type),
            tuple(int(s) for s in value.shape),
            str(value.dtype).replace("torch.", ""),
            int(value.numel()),
            int(value.element_size()),
            bool(value.is_contiguous()),
            True,
            value,
        )
    if kind == "cupy":
        return TensorInfo("cupy", "cuda", tuple(value.shape), dtype_name(value.dtype),
                          int(value.size), value.dtype.itemsize, bool(value.flags.c_contiguous),
                          True, value)
    if kind == "cuda-array":
        iface = value.__cuda_array_interface__
        dtype = np.dtype(iface["typestr"])
        shape = tuple(int(n) for n in iface["shape"])
        strides = iface.get("strides")
        return TensorInfo(
            "cuda-array",
            "cuda",
            shape,
            dtype_name(dtype),
            int(np.prod(shape, dtype=np.int64)),
            dtype.itemsize,
            _c_contiguous(shape, None if strides is None else tuple(strides), dtype.itemsize),
            not iface["data"][1],
            value,
        )
    if kind == "dlpack-cuda":
        arr = cupy_module(f"{name} (a __dlpack__ object on a CUDA device)").from_dlpack(value)
        return TensorInfo("dlpack-cuda", "cuda", tuple(arr.shape), dtype_name(arr.dtype),
                          int(arr.size), arr.dtype.itemsize, bool(arr.flags.c_contiguous),
                          True, value)
    if kind is not None:  # a CPU protocol object
        return _numpy_info(_protocol_view(value, kind, name), kind, value)
    raise _not_a_tensor(value, name)


def describe_gpu(value: Any, name: str = "tensor") -> TensorInfo:
    """Describe a GPU tensor; ``TypeError`` naming ``name`` when it is not one."""
    kind = _kind(value)
    if kind == "torch" and value.device.type != "cuda":
        raise TypeError(f"{name} is on {value.device}, expected a CUDA tensor")
    if kind != "torch" and kind not in _GPU_KINDS:
        raise TypeError(f"{name} must be a GPU tensor (cupy array or torch CUDA tensor), "
                        f"got {type(value).__name__}")
    return describe(value, name)


def _protocol_view(value: Any, kind: str, name: str) -> np.ndarray:
    """The numpy view of a CPU array-protocol object (shares its memory)."""
    try:
        return np.asarray(value) if kind == "array-interface" else np.from_dlpack(value)
    except (TypeError, ValueError, BufferError) as exc:  # e.g. a dtype numpy has not
        raise TypeError(f"{name} ({type(value).__name__}) cannot be viewed as a numpy "
                        f"array: {exc}") from exc


def host_view(value: Any, name: str = "tensor") -> np.ndarray:
    """A numpy array sharing memory with a CPU tensor (no copy)."""
    if isinstance(value, np.ndarray):
        return value
    kind = _kind(value)
    if kind == "torch":
        if value.device.type != "cpu":
            raise TypeError(f"{name} is on {value.device}, expected a CPU tensor")
        try:
            return value.detach().numpy()
        except TypeError as exc:  # e.g. bfloat16: numpy has no such dtype
            raise TypeError(
                f"{name} has dtype {value.dtype}, which numpy cannot view; "
                "convert it (e.g. .float()) or use a GPU backend"
            ) from exc
    if kind in ("array-interface", "dlpack-cpu"):
        return _protocol_view(value, kind, name)
    raise TypeError(f"{name} must be a CPU array (numpy or torch), got {type(value).__name__}")
