"""The one tensor adapter: arrays are recognised by protocol, not only by library.

Each test body runs over every array kind present here (numpy; objects that expose only
``__array_interface__`` or only ``__dlpack__``; torch CPU tensors where torch is installed):
whatever a numpy array can do, they can, in place and without copies.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from typing import Any, Callable, Dict, List

import numpy as np
import pytest

import raycoll
from raycoll import tensors
from raycoll.tensors import describe, describe_gpu, device_type, host_view, is_tensor


class InterfaceArray:
    """Not an array library: a numpy array's memory behind ``__array_interface__`` only."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    @property
    def __array_interface__(self) -> Dict[str, Any]:
        return self._array.__array_interface__


class DlpackArray:
    """Not an array library: a numpy array's memory behind ``__dlpack__`` only."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._array.__dlpack_device__()


class CudaDlpack:
    """An object claiming a CUDA device through DLPack (its memory is never touched here)."""

    def __dlpack__(self, **kwargs: Any) -> Any:  # pragma: no cover - never called without cupy
        raise AssertionError("no memory behind this")

    def __dlpack_device__(self) -> Any:
        return (2, 0)  # kDLCUDA, device 0


class FakeCudaArray:
    """``__cuda_array_interface__`` only, with explicit C-order strides."""

    def __init__(self, shape: Any, strides: Any = None, readonly: bool = False) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "strides": strides,
                                         "data": (0, readonly), "version": 3}


def _torch_cpu(array: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(array)


#: (name, wrap a numpy array as that kind) for every kind present here.
KINDS: List[Any] = [("numpy", lambda a: a), ("array-interface", InterfaceArray),
                    ("dlpack-cpu", DlpackArray)]
try:
    import torch  # noqa: F401 - only to know whether torch tensors can be tested

    KINDS.append(("torch", _torch_cpu))
except ImportError:  # pragma: no cover - torch is an optional extra
    pass


def _read_only(shape: Any = (3,)) -> np.ndarray:
    arr = np.ones(shape)
    arr.flags.writeable = False
    return arr


# ---------------------------------------------------------------------- the adapter, no Ray
@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind,wrap", KINDS, ids=[k for k, _ in KINDS])
def test_every_kind_is_described_and_viewed_without_copy(kind: str, wrap: Callable) -> None:
    base = np.arange(6, dtype=np.float32).reshape(2, 3)
    value = wrap(base)
    assert is_tensor(value) and device_type(value) == "cpu"
    info = describe(value, "x")
    assert (info.kind, info.device, info.shape, info.dtype) == (kind, "cpu", (2, 3), "float32")
    assert (info.numel, info.nbytes, info.contiguous, info.writable) == (6, 24, True, True)
    assert info.obj is value
    view = host_view(value, "x")
    view[1, 2] = 42.0  # the view shares the memory of the original
    assert base[1, 2] == 42.0
    with pytest.raises(TypeError, match="x (must be a GPU tensor|is on cpu, expected a CUDA)"):
        describe_gpu(value, "x")


@pytest.mark.timeout(30)
def test_read_only_protocol_objects_are_described_read_only() -> None:
    assert describe(InterfaceArray(_read_only())).writable is False
    assert describe(DlpackArray(_read_only())).writable is False
    assert describe(FakeCudaArray((4,), readonly=True)).writable is False
    assert describe(np.ones(3)[::2]).contiguous is False
    assert describe(InterfaceArray(np.ones(3)[::2])).contiguous is False


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", [np.float64(1.0), np.int32(3), [1.0, 2.0], b"abcd", "abc",
                                   None, 3, memoryview(b"ab")])
def test_values_that_are_not_tensors_are_refused(value: Any) -> None:
    assert not is_tensor(value)
    with pytest.raises(TypeError, match="t must be a numpy array, torch tensor or cupy array"):
        describe(value, "t")
    with pytest.raises(TypeError, match="t must be a CPU array"):
        host_view(value, "t")


@pytest.mark.timeout(30)
def test_gpu_protocol_objects_are_gpu_tensors_without_cupy() -> None:
    for value in (FakeCudaArray((2, 3)), CudaDlpack()):
        assert is_tensor(value) and device_type(value) == "cuda"
        with pytest.raises(TypeError, match="must be a CPU array"):
            host_view(value)
    info = describe_gpu(FakeCudaArray((2, 3)), "out")
    assert (info.kind, info.device, info.shape, info.dtype, info.numel, info.itemsize) == \
        ("cuda-array", "cuda", (2, 3), "float32", 6, 4)


_NO_CUPY = importlib.util.find_spec("cupy") is None


@pytest.mark.timeout(30)
@pytest.mark.skipif(not _NO_CUPY, reason="checks the error raised where cupy is missing")
def test_gpu_memory_of_a_protocol_object_needs_cupy_only_when_asked() -> None:
    info = describe_gpu(FakeCudaArray((2, 3)))  # described from the protocol, no cupy
    for attribute in ("ptr", "strides", "device_index"):
        with pytest.raises(raycoll.BackendUnavailableError,
                           match=r"__cuda_array_interface__ object\) need cupy"):
            getattr(info, attribute)
    with pytest.raises(raycoll.BackendUnavailableError,
                       match=r"x \(a __dlpack__ object on a CUDA device\) need cupy"):
        describe(CudaDlpack(), "x")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shape,strides,want", [
    ((2, 3), None, True), ((2, 3), (12, 4), True), ((2, 3), (4, 8), False),
    ((3, 1), (4, 99), True), ((0, 3), (4, 4), True), ((2, 3), (24, 4), False),
])
def test_contiguity_from_the_cuda_array_interface(shape: Any, strides: Any, want: bool) -> None:
    assert describe(FakeCudaArray(shape, strides)).contiguous is want


@pytest.mark.timeout(30)
def test_storage_dtype_holds_bfloat16_bits() -> None:
    assert tensors.storage_dtype("bfloat16") == np.dtype(np.uint16)
    assert tensors.storage_dtype("float32") == np.dtype(np.float32)
    with pytest.raises(TypeError, match="GPU tensors of dtype nosuch are not supported"):
        tensors.storage_dtype("nosuch")


@pytest.mark.torch
@pytest.mark.timeout(30)
def test_torch_bfloat16_cpu_is_described_but_not_viewed() -> None:
    torch = pytest.importorskip("torch")
    t = torch.ones(3, dtype=torch.bfloat16)
    info = describe(t)
    assert (info.kind, info.device, info.dtype, info.itemsize) == ("torch", "cpu", "bfloat16", 2)
    with pytest.raises(TypeError, match="has dtype torch.bfloat16, which numpy cannot view"):
        host_view(t)
    with pytest.raises(TypeError, match="is on cpu, expected a CUDA tensor"):
        describe_gpu(t, "tensor")


_LAZY = textwrap.dedent("""
    import sys
    import numpy as np
    import raycoll
    from raycoll.tensors import describe, is_tensor

    class Wrapped:
        def __init__(self, a):
            self.__array_interface__ = a.__array_interface__
            self._keep = a

    assert is_tensor(Wrapped(np.ones(2))) and describe(np.ones(2)).kind == "numpy"
    loaded = [m for m in ("torch", "cupy") if sys.modules.get(m) is not None]
    assert not loaded, loaded
    print("OK")
""")


@pytest.mark.timeout(120)
def test_recognising_tensors_imports_neither_torch_nor_cupy() -> None:
    proc = subprocess.run([sys.executable, "-c", _LAZY], capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


# ---------------------------------------------------------------------- on real Ray actors
def _protocol_ops(rank: int, world_size: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for kind, wrap in (("array-interface", InterfaceArray), ("dlpack-cpu", DlpackArray)):
        base = np.full(4, float(rank + 1))
        raycoll.all_reduce(wrap(base))  # in place, through the protocol's view
        gathered = [np.zeros(2, dtype=np.int64) for _ in range(world_size)]
        raycoll.all_gather([wrap(g) for g in gathered], wrap(np.array([rank, -rank])))
        try:
            raycoll.all_reduce(wrap(_read_only()))
            refused = "accepted"
        except ValueError as exc:
            refused = str(exc)
        out[kind] = {"sum": base.tolist(), "gather": [g.tolist() for g in gathered],
                     "refused": refused}
    return out


@pytest.mark.timeout(180)
def test_protocol_objects_work_where_numpy_arrays_do(ranks: Any) -> None:
    results = ranks.run(_protocol_ops, 2, 2)
    for got in results:
        for kind in ("array-interface", "dlpack-cpu"):
            assert got[kind]["sum"] == [3.0] * 4, kind
            assert got[kind]["gather"] == [[0, 0], [1, -1]], kind
    # a read-only one is refused as a read-only numpy array is, with the same message
    for kind in ("array-interface", "dlpack-cpu"):
        refused = results[0][kind]["refused"]
        assert refused.startswith("tensor is read-only: numpy arguments of Ray actor methods")
        assert "Copy it first: tensor = tensor.copy() (or np.array(tensor))" in refused
