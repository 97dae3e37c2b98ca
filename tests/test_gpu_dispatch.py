"""GPU support that needs no GPU: backend strings, per-device dispatch, errors, the reduce-op
plan of the NCCL backend, device choice, import without cupy, a third-party backend.

Everything that moves data runs on real Ray actors. GPU tensors cannot exist here; where a
test needs one only to reach the dispatch (the error comes before any data moves), it uses
an object exposing ``__cuda_array_interface__``, the protocol raycoll recognises.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import textwrap
import threading
import uuid
from typing import Any, Callable, List, Optional

import numpy as np
import pytest

import raycoll
from raycoll import Backend, BackendConfig, ReduceOp
from raycoll.backends import _cuda
from raycoll.backends.base import Call, CollectiveBackend, Completion, GroupContext, Outcome
from raycoll.backends.nccl import NcclBackend
from raycoll.backends.nccl.plan import AVG_MIN_VERSION, reduce_plan
from raycoll.backends.cpu import ObjstoreBackend
from raycoll.backends.staged import StagedBackend
from raycoll.work import DevicePending, Work


class FakeGpuArray:
    """Not an array library: just the ``__cuda_array_interface__`` protocol (no memory)."""

    def __init__(self, n: int = 4) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (0, False),
                                         "version": 3, "strides": None}


# ---------------------------------------------------------------------- backend strings
@pytest.mark.timeout(30)
def test_backend_strings_map_devices_as_c10d() -> None:
    assert BackendConfig("nccl").get_device_backend_map() == {"cuda": "nccl"}
    assert BackendConfig("NCCL").get_device_backend_map() == {"cuda": "nccl"}
    assert BackendConfig("objstore").get_device_backend_map() == {"cpu": "objstore",
                                                                 "cuda": "objstore"}
    assert BackendConfig("cpu:objstore,cuda:nccl").get_device_backend_map() == {
        "cpu": "objstore", "cuda": "nccl"}
    assert BackendConfig(" cuda:objstore ").get_device_backend_map() == {"cuda": "objstore"}
    assert repr(BackendConfig("cpu:objstore,cuda:nccl")) == "cpu:objstore,cuda:nccl"
    copied = BackendConfig(BackendConfig("cuda:nccl"))
    assert copied.get_device_backend_map() == {"cuda": "nccl"}
    assert Backend("NCCL") == Backend.NCCL == "nccl"


@pytest.mark.timeout(30)
def test_default_backend_is_nccl_for_cuda_only_where_available() -> None:
    for text in (None, "undefined"):
        config = BackendConfig(text)
        assert config.serves("cpu") and config.serves("cuda")
        assert "nccl if available" in repr(config)  # decided lazily, at the first GPU tensor
        want = "nccl" if raycoll.is_nccl_available() else "objstore"
        assert config.get_device_backend_map() == {"cpu": "objstore", "cuda": want}
    assert raycoll.is_nccl_available() == (_cuda.nccl_unavailable_reason() is None)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text, match", [
    ("cpu:nccl", "does not serve device 'cpu'"),
    ("gpu:nccl", "expected 'device:name' pairs"),
    ("cuda:", "expected 'device:name' pairs"),
    ("cuda:nccl,cuda:objstore", "'cuda' given twice"),
    ("nccl,objstore", "give one name"),
    ("gloo", r"unknown backend 'gloo'; registered: \[.*'nccl'.*'objstore'"),
    ("cpu:gloo", r"unknown backend 'gloo'"),
])
def test_bad_backend_strings_are_refused_with_the_reason(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BackendConfig(text)


@pytest.mark.timeout(30)
def test_registry_is_loud() -> None:
    with pytest.raises(ValueError, match="already registered"):
        Backend.register_backend("nccl", NcclBackend, devices=["cuda"])
    with pytest.raises(ValueError, match="devices must be"):
        Backend.register_backend("tpu_thing", NcclBackend, devices=["tpu"])
    with pytest.raises(ValueError, match="identifier"):
        Backend.register_backend("not a name", NcclBackend)
    with pytest.raises(TypeError, match="callable"):
        Backend.register_backend("not_callable", 42)  # type: ignore[arg-type]
    assert Backend.registered()["nccl"] == ("cuda",)
    assert set(Backend.registered()["objstore"]) == {"cpu", "cuda"}
    with pytest.raises(ValueError, match="unknown backend"):
        Backend("no_such_backend")


# ---------------------------------------------------------------------- pure logic
@pytest.mark.timeout(30)
def test_nccl_reduce_plan_maps_every_op() -> None:
    new, old = AVG_MIN_VERSION, AVG_MIN_VERSION - 1
    plan = reduce_plan(ReduceOp.SUM, "float32", new)
    assert (plan.nccl_op, plan.nccl_dtype, plan.post, plan.fallback) == (
        "NCCL_SUM", "NCCL_FLOAT32", None, None)
    assert reduce_plan(ReduceOp.PRODUCT, "int64", new).nccl_op == "NCCL_PROD"
    assert reduce_plan(ReduceOp.AVG, "bfloat16", new).nccl_op == "NCCL_AVG"
    assert reduce_plan(ReduceOp.AVG, "float16", old).post == "avg"  # NCCL < 2.10: SUM, divide
    int_avg = reduce_plan(ReduceOp.AVG, "int32", new)  # truncating, as the CPU path
    assert (int_avg.nccl_op, int_avg.post) == ("NCCL_SUM", "avg")
    premul = reduce_plan(ReduceOp.PREMUL_SUM(0.5), "float64", new)
    assert (premul.nccl_op, premul.post) == ("NCCL_SUM", "premul")
    band = reduce_plan(ReduceOp.BAND, "uint8", new)
    assert (band.nccl_op, band.fallback) == (None, "bitwise_and")  # NCCL has no bitwise ops
    assert reduce_plan(ReduceOp.BXOR, "int64", new).fallback == "bitwise_xor"
    assert reduce_plan(ReduceOp.SUM, "bool", new).nccl_op == "NCCL_MAX"  # logical or
    assert reduce_plan(ReduceOp.PRODUCT, "bool", new).nccl_op == "NCCL_MIN"  # logical and
    assert reduce_plan(ReduceOp.BAND, "bool", new).nccl_op == "NCCL_MIN"
    assert reduce_plan(ReduceOp.BOR, "bool", new).nccl_op == "NCCL_MAX"
    cplx = reduce_plan(ReduceOp.SUM, "complex64", new)
    assert (cplx.nccl_dtype, cplx.count_factor) == ("NCCL_FLOAT32", 2)
    for dtype in ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32",
                  "int64"):
        assert reduce_plan(ReduceOp.MAX, dtype, new).nccl_op == "NCCL_MAX"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("op, dtype, match", [
    (ReduceOp.BAND, "float32", "integer or bool"),
    (ReduceOp.MIN, "complex64", "not supported on complex"),
    (ReduceOp.PRODUCT, "complex128", "not supported on complex"),
    (ReduceOp.SUM, "int16", "NCCL cannot reduce dtype int16"),
    (ReduceOp.AVG, "bool", "not defined on bool"),
])
def test_nccl_reduce_plan_refuses_what_it_cannot_do(op: ReduceOp, dtype: str, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        reduce_plan(op, dtype, AVG_MIN_VERSION)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ids, visible, want", [
    ([], "0", None),  # no GPU assigned
    (["3"], "3", 0),  # Ray's usual case: only the assigned GPU is visible
    (["3"], "1,3", 1),
    (["2"], None, 2),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: the id is the ordinal
    (["GPU-1234"], None, 0),
])
def test_device_ordinal_from_ray_gpu_ids(ids: List[str], visible: Optional[str],
                                         want: Optional[int]) -> None:
    assert _cuda.device_ordinal(ids, visible) == want


# ---------------------------------------------------------------------- Work over device work
class _EventPending(DevicePending):
    """Device-like pending work completed by a host event (exercises ``Work``'s protocol)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.waited: List[Optional[float]] = []
        self._callbacks: List[Callable[[Optional[BaseException]], None]] = []

    def complete(self, error: Optional[BaseException] = None) -> None:
        self.error = error
        self.done.set()
        for callback in self._callbacks:
            callback(error)

    def query(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout_s: Optional[float] = None) -> None:
        self.waited.append(timeout_s)
        if timeout_s is not None and not self.done.wait(timeout_s):
            raise raycoll.DistTimeoutError(f"not done within {timeout_s}s")
        if self.error is not None:
            raise self.error

    def exception(self) -> Optional[BaseException]:
        return self.error if self.done.is_set() else None

    def add_done_callback(self, callback: Callable[[Optional[BaseException]], None]) -> None:
        if self.done.is_set():
            callback(self.error)
        else:
            self._callbacks.append(callback)


@pytest.mark.timeout(30)
def test_work_over_device_work_queries_and_waits_on_it() -> None:
    pending = _EventPending()
    work = Work.completed(pending, describe="all_reduce #1", outputs=["out"])
    future = work.get_future()
    assert not work.is_completed() and not future.done()  # enqueued, not done on the device
    assert work.wait() is True and pending.waited == [None]  # stream-wait: no host block
    with pytest.raises(raycoll.DistTimeoutError):
        work.wait(timeout=0.05)  # a timeout blocks the host, and fails past it
    pending.complete()
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert future.wait(timeout=5) == ["out"]
    pending.source = 3
    assert work.source_rank() == 3

    failing = _EventPending()
    work = Work.completed(failing, describe="broadcast #2")
    failing.complete(raycoll.GroupBrokenError("aborted"))
    assert work.is_completed() and not work.is_success()
    assert isinstance(work.exception(), raycoll.GroupBrokenError)
    with pytest.raises(raycoll.GroupBrokenError):
        work.wait()
    with pytest.raises(raycoll.GroupBrokenError):
        work.get_future().wait(timeout=5)


# ---------------------------------------------------------------------- import without cupy
_NO_CUPY = textwrap.dedent("""
    import sys
    sys.modules["cupy"] = None  # `import cupy` now raises ImportError, as if not installed
    import raycoll
    from raycoll import errors
    from raycoll.backends import BackendConfig, _cuda
    assert raycoll.is_nccl_available() is False
    reason = _cuda.nccl_unavailable_reason()
    assert "cupy" in reason and "not installed" in reason, reason
    assert BackendConfig(None).get_device_backend_map() == {"cpu": "objstore", "cuda": "objstore"}
    try:
        BackendConfig("nccl").create("cuda", None, "g")
    except errors.BackendUnavailableError as exc:
        assert "backend 'nccl'" in str(exc) and "cupy" in str(exc), exc
    else:
        raise AssertionError("no error for NCCL without cupy")
    try:
        _cuda.cupy_module("staging GPU arrays")
    except errors.BackendUnavailableError as exc:
        assert "need cupy" in str(exc) and "pip install cupy" in str(exc), exc
    else:
        raise AssertionError("no error for a missing cupy")
    assert "cupy" not in [m for m, v in sys.modules.items() if v is not None]
    print("OK")
""")


@pytest.mark.timeout(120)
def test_import_raycoll_without_cupy() -> None:
    proc = subprocess.run([sys.executable, "-c", _NO_CUPY], capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


# ---------------------------------------------------------------------- dispatch on real actors
def _gpu_tensor_errors(rank: int) -> List[str]:
    """Rank 0 passes a GPU tensor; both ranks report what they got."""
    seen = []
    for _ in range(2):
        x = FakeGpuArray() if rank == 0 else np.ones(4, dtype=np.float32)
        try:
            raycoll.all_reduce(x)
            seen.append("ok")
        except raycoll.RaycollError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
    return seen


@pytest.mark.timeout(120)
def test_gpu_tensor_in_a_cpu_only_group_is_refused_on_every_rank(ranks: Any) -> None:
    got = ranks.run(_gpu_tensor_errors, 2, backend="cpu:objstore")
    for attempt in got[0]:
        assert attempt.startswith("BackendUnavailableError"), attempt
        assert "no backend for 'cuda' tensors" in attempt and "cuda:nccl" in attempt
    for attempt in got[1]:  # the peer is told, instead of waiting for rank 0
        assert attempt.startswith("PeerArgumentError") and "rank 0 rejected" in attempt, attempt


@pytest.mark.timeout(120)
def test_nccl_without_cupy_names_what_is_missing(ranks: Any) -> None:
    if raycoll.is_nccl_available():
        pytest.skip("NCCL is available here")
    got = ranks.run(_gpu_tensor_errors, 2, backend="cpu:objstore,cuda:nccl")
    assert got[0][0].startswith("BackendUnavailableError"), got[0]
    assert "backend 'nccl' for 'cuda' tensors" in got[0][0] and "cupy" in got[0][0]
    assert got[1][0].startswith("PeerArgumentError"), got[1]


def _per_device(rank: int) -> List[Any]:
    x = np.full(3, rank + 1.0)
    raycoll.all_reduce(x)
    raycoll.barrier()
    from raycoll.world import world

    group = world().default
    assert group is not None
    kinds = [type(group.backend("cpu")).__name__, type(group.backend("cuda")).__name__]
    return [x.tolist(), kinds, repr(group.backend_config)]


@pytest.mark.timeout(120)
def test_one_group_has_a_backend_per_device(ranks: Any) -> None:
    got = ranks.run(_per_device, 2, backend="cpu:objstore,cuda:objstore")
    for x, kinds, config in got:
        assert x == [3.0, 3.0, 3.0]
        assert kinds == [ObjstoreBackend.__name__, StagedBackend.__name__]
        assert config == "cpu:objstore,cuda:objstore"


def _cuda_only_group(rank: int) -> List[str]:
    out = []
    try:
        raycoll.all_reduce(np.ones(2))
    except raycoll.BackendUnavailableError as exc:
        out.append(str(exc))
    raycoll.barrier()  # a GPU-only group still meets (through its GPU backend)
    objs: List[Any] = [None, None]
    raycoll.all_gather_object(objs, rank)
    out.append(repr(objs))
    return out


@pytest.mark.timeout(120)
def test_gpu_only_group_refuses_cpu_tensors_but_meets(ranks: Any) -> None:
    got = ranks.run(_cuda_only_group, 2, backend="cuda:objstore")
    for refused, gathered in got:
        assert "no backend for 'cpu' tensors" in refused
        assert gathered == "[0, 1]"


def _nccl_only_barrier(rank: int) -> str:
    try:
        raycoll.barrier()
    except raycoll.BackendUnavailableError as exc:
        return str(exc)
    return "ok"


@pytest.mark.timeout(120)
def test_barrier_of_an_nccl_group_without_nccl_says_why(ranks: Any) -> None:
    if raycoll.is_nccl_available():
        pytest.skip("NCCL is available here")
    for message in ranks.run(_nccl_only_barrier, 2, backend="nccl"):
        assert "backend 'nccl'" in message and "cupy" in message


@pytest.mark.timeout(60)
def test_spawn_with_gpus_on_a_cluster_without_gpus_is_refused(ray_local: Any) -> None:
    import ray

    if ray.cluster_resources().get("GPU", 0) >= 1:
        pytest.skip("this cluster has a GPU")
    with pytest.raises(ValueError, match="GPU: needs 2, cluster has 0"):
        raycoll.spawn(lambda rank: rank, world_size=2, actor_options={"num_gpus": 1})


# ---------------------------------------------------------------------- a third-party backend
class HostQueueBackend(CollectiveBackend):
    """A tiny, real third-party backend: all_reduce / broadcast / barrier through the group's
    coordinator, run on its own thread and stream-ordered (it returns pending work, as a
    device backend does), so it also drives ``ProcessGroup``'s stream-ordered path."""

    devices = ("cpu",)
    stream_ordered = True

    def __init__(self, ctx: GroupContext) -> None:
        super().__init__(ctx)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hostqueue")
        self.calls: List[str] = []

    def _enqueue(self, name: str, job: Callable[[], None]) -> Outcome:
        self.calls.append(name)
        return _FuturePending(self.pool.submit(job))

    def all_reduce(self, tensor: Any, op: ReduceOp, call: Call) -> Outcome:
        def job() -> None:
            tensor[...] = self.ctx.exchange(call, 0, np.ascontiguousarray(tensor),
                                            mode="reduce").reshape(tensor.shape)
        return self._enqueue("all_reduce", job)

    def broadcast(self, tensor: Any, src: int, call: Call) -> Outcome:
        def job() -> None:
            me = self.ctx.rank
            sent = [tensor.copy() if me == src and j != me else None for j in range(self.ctx.size)]
            got = self.ctx.exchange(call, 0, sent)
            if me != src:
                tensor[...] = got[src]
        return self._enqueue("broadcast", job)

    def barrier(self, call: Call) -> Outcome:
        self.calls.append("barrier")
        self.ctx.exchange(call, 0, None)
        return None

    def _unsupported(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("HostQueueBackend only does all_reduce, broadcast, barrier")

    reduce = all_gather = all_gather_into_tensor = gather = scatter = _unsupported
    reduce_scatter = reduce_scatter_tensor = all_to_all = all_to_all_single = _unsupported

    def send(self, tensor: Any, dst: int, tag: int, timeout_s: float) -> Completion:
        raise NotImplementedError("no p2p")

    def recv(self, tensor: Any, src: Optional[int], tag: int, timeout_s: float) -> Completion:
        raise NotImplementedError("no p2p")

    def close(self) -> None:
        self.pool.shutdown(wait=False)


class _FuturePending(DevicePending):
    """HostQueueBackend's pending work: its "stream" is a thread, so waits block the host."""

    def __init__(self, future: "concurrent.futures.Future[None]") -> None:
        self.future = future

    def query(self) -> bool:
        return self.future.done()

    def wait(self, timeout_s: Optional[float] = None) -> None:
        self.future.result(timeout=timeout_s if timeout_s is not None else 60.0)

    def exception(self) -> Optional[BaseException]:
        return self.future.exception() if self.future.done() else None

    def add_done_callback(self, callback: Callable[[Optional[BaseException]], None]) -> None:
        self.future.add_done_callback(lambda f: callback(f.exception()))


def _register_host_queue() -> None:
    if "hostqueue" not in Backend.registered():
        Backend.register_backend("hostqueue", HostQueueBackend, devices=["cpu"])


def _third_party(rank: int, name: str) -> List[Any]:
    _register_host_queue()  # registration is per process, as in c10d
    raycoll.init_process_group("cpu:hostqueue,cuda:objstore", world_size=2, rank=rank,
                               group_name=name, timeout=60)
    try:
        x = np.arange(4.0) + rank
        raycoll.all_reduce(x, group=name)  # sync: waits for the pending work
        y = np.full(3, float(rank))
        work = raycoll.broadcast(y, src=1, group=name, async_op=True)
        assert work is not None
        work.wait()
        done = work.is_completed()
        z = np.ones(2) * (rank + 1)
        work = raycoll.all_reduce(z, group=name, async_op=True)
        assert work is not None
        result = work.get_future().wait(timeout=30)
        raycoll.barrier(group=name)
        backend = raycoll.get_group(name).backend("cpu")
        assert isinstance(backend, HostQueueBackend)
        return [x.tolist(), y.tolist(), done, [r.tolist() for r in result], type(backend).__name__,
                list(backend.calls)]
    finally:
        raycoll.destroy_process_group(name)


@pytest.mark.timeout(120)
def test_third_party_backend_end_to_end(ranks: Any) -> None:
    _register_host_queue()  # the driver validates backend strings too
    assert getattr(Backend, "HOSTQUEUE") == "hostqueue"
    assert BackendConfig("cpu:hostqueue").get_device_backend_map() == {"cpu": "hostqueue"}
    name = f"hq-{uuid.uuid4().hex[:6]}"
    got = ranks.run(_third_party, 2, name)
    for x, y, done, gathered, kind, calls in got:
        assert x == [1.0, 3.0, 5.0, 7.0]
        assert y == [1.0, 1.0, 1.0] and done is True
        assert gathered == [[3.0, 3.0]]
        assert kind == "HostQueueBackend"
        assert calls == ["all_reduce", "broadcast", "all_reduce", "barrier"]
