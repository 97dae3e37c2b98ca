"""Host-staged GPU collectives (``"cuda:objstore"``): GPU tensors through the object store.

For ranks that cannot use NCCL (several actors sharing one GPU, no NCCL library) and for
testing GPU code on one GPU. Each operation copies its GPU inputs to host memory (pinned when
cupy or torch can pin it), runs the object-store backend on the host arrays (reusing it, not
a copy of it: same algorithms, same coordinator matching, errors and timeouts), and copies
the results back to the GPU tensors. Copies run on the caller's current stream and are
complete on return, so the operation is synchronous, as on the CPU path.

torch CUDA tensors are staged with torch (no cupy needed); cupy arrays and other
``__cuda_array_interface__`` / ``__dlpack__`` GPU arrays with cupy. bfloat16 (torch) is
reduced in float32 on the host and rounded back; other operations move its bits unchanged.
bfloat16 *CPU* tensors go the same way (numpy has no bfloat16): a group serves them with one
of these backends (``ProcessGroup.bfloat16_backend``).
"""

from __future__ import annotations

import sys
from typing import Any, List, Optional, Tuple, Union

import numpy as np

from raycoll.backends import _cuda
from raycoll.backends.base import Call, CollectiveBackend, Completion, GroupContext, Outcome
from raycoll.backends.cpu import ObjstoreBackend
from raycoll.reduce_op import ReduceOp
from raycoll.tensors import describe_gpu, is_torch
from raycoll.work import DevicePending

__all__ = ["StagedBackend"]


class _Stage:
    """One GPU tensor's host copy, and how to copy a host result back into the tensor."""

    def __init__(self, value: Any, *, reducing: bool = False, load: bool = True) -> None:
        self.value = value
        self.torch = is_torch(value)
        if self.torch:
            self._init_torch(reducing, load)
        else:
            self._init_cupy(load)

    # torch: pinned host tensors from torch's caching host allocator
    def _init_torch(self, reducing: bool, load: bool) -> None:
        torch = sys.modules["torch"]
        t = self.value
        if t.dtype == torch.bfloat16:
            self._device_view = t if reducing else t.view(torch.int16)
            host_dtype = torch.float32 if reducing else torch.int16
        else:
            self._device_view = t
            host_dtype = t.dtype
        pin = t.device.type == "cuda"  # a CPU bfloat16 tensor is staged as well (no numpy bf16)
        self._host_t = torch.empty(tuple(t.shape), dtype=host_dtype, pin_memory=pin)
        if load:
            self._host_t.copy_(self._device_view)  # synchronous: waits for the current stream
        self.host: np.ndarray = self._host_t.numpy()

    # cupy (and other libraries' GPU arrays, viewed through cupy by the tensor adapter)
    def _init_cupy(self, load: bool) -> None:
        cp = _cuda.cupy_module("staging GPU arrays through host memory")
        a = describe_gpu(self.value).cupy_view()
        self._array = a
        with cp.cuda.Device(a.device.id):
            self.host = _pinned(cp, a.shape, a.dtype)
            if load:
                src = cp.ascontiguousarray(a)
                src.get(stream=cp.cuda.get_current_stream(), out=self.host)  # blocking

    def store(self) -> None:
        """Copy the host array (the result) back into the GPU tensor; complete on return."""
        if self.torch:
            self._device_view.copy_(self._host_t)  # pinned source, non_blocking=False: synced
            return
        cp = _cuda.cupy_module("staging GPU arrays through host memory")
        a = self._array
        with cp.cuda.Device(a.device.id):
            stream = cp.cuda.get_current_stream()
            if a.flags.c_contiguous:
                a.set(self.host, stream=stream)
            else:
                a[...] = cp.asarray(self.host)
            stream.synchronize()  # the host buffer may be reused once we return


def _pinned(cp: Any, shape: Tuple[int, ...], dtype: Any) -> np.ndarray:
    """A numpy array in page-locked memory (cupy's pinned pool), pageable as a fallback."""
    try:
        import cupyx

        return cupyx.empty_pinned(shape, dtype=dtype)
    except Exception:  # noqa: BLE001 - no pinned memory available: pageable still works
        return np.empty(shape, dtype=dtype)


class StagedBackend(CollectiveBackend):
    """GPU tensors copied to host, through :class:`ObjstoreBackend`, and copied back."""

    devices = ("cuda",)

    def __init__(self, ctx: GroupContext) -> None:
        super().__init__(ctx)
        self.host = ObjstoreBackend(ctx)

    # -- reductions
    def all_reduce(self, tensor: Any, op: ReduceOp, call: Call) -> Outcome:
        s = _Stage(tensor, reducing=True)
        self.host.all_reduce(s.host, op, call)
        s.store()
        return None

    def reduce(self, tensor: Any, dst: int, op: ReduceOp, call: Call) -> Outcome:
        s = _Stage(tensor, reducing=True)
        self.host.reduce(s.host, dst, op, call)
        if self.ctx.rank == dst:
            s.store()
        return None

    def reduce_scatter(self, output: Any, inputs: List[Any], op: ReduceOp, call: Call) -> Outcome:
        out = _Stage(output, reducing=True, load=False)
        ins = [_Stage(t, reducing=True) for t in inputs]
        self.host.reduce_scatter(out.host, [s.host for s in ins], op, call)
        out.store()
        return None

    def reduce_scatter_tensor(self, output: Any, tensor: Any, op: ReduceOp, call: Call) -> Outcome:
        out = _Stage(output, reducing=True, load=False)
        src = _Stage(tensor, reducing=True)
        self.host.reduce_scatter_tensor(out.host, src.host, op, call)
        out.store()
        return None

    # -- data movement
    def broadcast(self, tensor: Any, src: int, call: Call) -> Outcome:
        root = self.ctx.rank == src
        s = _Stage(tensor, load=root)
        self.host.broadcast(s.host, src, call)
        if not root:
            s.store()
        return None

    def all_gather(self, outputs: List[Any], tensor: Any, call: Call) -> Outcome:
        mine = _Stage(tensor)
        outs = [_Stage(t, load=False) for t in outputs]
        self.host.all_gather([o.host for o in outs], mine.host, call)
        _store_all(outs)
        return None

    def all_gather_into_tensor(self, output: Any, tensor: Any, call: Call) -> Outcome:
        mine = _Stage(tensor)
        out = _Stage(output, load=False)
        self.host.all_gather_into_tensor(out.host, mine.host, call)
        out.store()
        return None

    def gather(self, tensor: Any, outputs: Optional[List[Any]], dst: int, call: Call) -> Outcome:
        mine = _Stage(tensor)
        outs = [_Stage(t, load=False) for t in outputs] if outputs is not None else None
        self.host.gather(mine.host, [o.host for o in outs] if outs is not None else None, dst,
                         call)
        _store_all(outs or [])
        return None

    def scatter(self, output: Any, inputs: Optional[List[Any]], src: int, call: Call) -> Outcome:
        out = _Stage(output, load=False)
        ins = [_Stage(t) for t in inputs] if inputs is not None else None
        self.host.scatter(out.host, [s.host for s in ins] if ins is not None else None, src, call)
        out.store()
        return None

    def all_to_all(self, outputs: List[Any], inputs: List[Any], call: Call) -> Outcome:
        ins = [_Stage(t) for t in inputs]
        outs = [_Stage(t, load=False) for t in outputs]
        self.host.all_to_all([o.host for o in outs], [s.host for s in ins], call)
        _store_all(outs)
        return None

    def all_to_all_single(self, output: Any, tensor: Any, output_splits: List[int],
                          input_splits: List[int], call: Call) -> Outcome:
        src = _Stage(tensor)
        out = _Stage(output, load=False)
        self.host.all_to_all_single(out.host, src.host, output_splits, input_splits, call)
        out.store()
        return None

    def barrier(self, call: Call) -> Outcome:
        self.host.barrier(call)
        return None

    # -- point to point
    def send(self, tensor: Any, dst: int, tag: int, timeout_s: float) -> Completion:
        s = _Stage(tensor)  # the data is captured now, as the object-store send does
        return self.host.send(s.host, dst, tag, timeout_s)

    def recv(self, tensor: Any, src: Optional[int], tag: int, timeout_s: float) -> Completion:
        s = _Stage(tensor, load=False)
        received = self.host.recv(s.host, src, tag, timeout_s)

        def wait() -> Union[Optional[int], DevicePending]:
            source = received()
            s.store()
            return source

        return wait

    def close(self) -> None:
        self.host.close()


def _store_all(stages: List[_Stage]) -> None:
    for stage in stages:
        stage.store()

