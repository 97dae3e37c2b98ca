"""GPU tests (marked ``gpu``; skipped without cupy, NCCL and a CUDA GPU).

On one GPU a real NCCL communicator has one rank (NCCL refuses two ranks of a communicator
on one GPU), so the NCCL binding, dtypes, reduce-op mapping, streams, events, Work semantics
and the timeout abort are checked on one rank: first on the backend directly (no Ray), then
through the public API in a Ray actor holding the GPU. Multi-rank data movement of GPU
tensors is checked through ``cuda:objstore`` with 2 and 4 actors sharing the GPU
(``num_gpus=0.25``). Every result is compared with a numpy reference.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

import raycoll
from helpers import data, op_of, reference
from raycoll import ReduceOp
from raycoll.backends._cuda import nccl_unavailable_reason
from raycoll.backends.base import Call, GroupContext

_WHY_NOT = nccl_unavailable_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_WHY_NOT is not None, reason=f"needs cupy, NCCL and a GPU: {_WHY_NOT}"),
]

NCCL_DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool")
OPS = {"f": ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"),
       "i": ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"),
       "b": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")}


def _ops(dtype: str) -> Tuple[str, ...]:
    kind = np.dtype(dtype).kind
    return OPS["i" if kind == "u" else kind]


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if want.dtype == np.float16:
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2, err_msg=what)
    elif want.dtype.kind in "fc":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


# ---------------------------------------------------------------------- NCCL, no Ray
@pytest.fixture(scope="module")
def solo() -> Any:
    """A real one-rank NCCL backend in this process (no Ray, no coordinator)."""
    from raycoll.backends.nccl import NcclBackend

    failures: List[BaseException] = []
    ctx = GroupContext(group_name="solo", rank=0, global_ranks=[0], node_ids=["here"],
                       client=None, timeout_s=120.0, on_failure=failures.append)  # type: ignore[arg-type]
    backend = NcclBackend(ctx)
    yield backend
    assert not failures, failures
    backend.close()


def _call(op: str, reduce_op: ReduceOp = ReduceOp.SUM) -> Call:
    return Call(op, 1, 120.0, {"op": op, "reduce_op": reduce_op.key})


@pytest.mark.timeout(300)
def test_nccl_all_reduce_every_dtype_and_op(solo: Any) -> None:
    import cupy as cp

    for dtype in NCCL_DTYPES:
        for name in _ops(dtype):
            x = data(0, (1001,), dtype)
            dev = cp.asarray(x)
            handle = solo.all_reduce(dev, op_of(name), _call("all_reduce", op_of(name)))
            handle.wait()  # the current stream waits; asnumpy below runs on it
            _close(cp.asnumpy(dev), reference(name, [x]), f"all_reduce {name} {dtype}")
    strided = cp.asarray(data(0, (64, 3), "float32"))[:, 1]  # not contiguous: staged copies
    want = cp.asnumpy(strided) * 2.0
    solo.all_reduce(strided, ReduceOp.PREMUL_SUM(2.0), _call("all_reduce")).wait()
    _close(cp.asnumpy(strided), want, "all_reduce of a strided view")


@pytest.mark.timeout(300)
def test_nccl_every_collective_one_rank(solo: Any) -> None:
    import cupy as cp

    for dtype in ("float32", "int64", "float16", "uint8"):
        x = data(0, (6, 5), dtype)
        got: Dict[str, Any] = {}

        def run(name: str, fn: Any) -> None:
            handle = fn()
            assert handle is not None, f"{name} returned no pending work"
            handle.wait()

        t = cp.asarray(x)
        run("reduce", lambda: solo.reduce(t, 0, ReduceOp.MAX, _call("reduce", ReduceOp.MAX)))
        got["reduce"] = t
        b = cp.asarray(x)
        run("broadcast", lambda: solo.broadcast(b, 0, _call("broadcast")))
        got["broadcast"] = b
        outs = [cp.zeros_like(cp.asarray(x))]
        run("all_gather", lambda: solo.all_gather(outs, cp.asarray(x), _call("all_gather")))
        got["all_gather"] = outs[0]
        flat = cp.zeros(x.size, dtype=x.dtype)
        run("all_gather_into_tensor",
            lambda: solo.all_gather_into_tensor(flat, cp.asarray(x), _call("agt")))
        got["all_gather_into_tensor"] = flat.reshape(x.shape)
        rs = cp.zeros_like(cp.asarray(x))
        run("reduce_scatter", lambda: solo.reduce_scatter(rs, [cp.asarray(x)], ReduceOp.SUM,
                                                          _call("reduce_scatter")))
        got["reduce_scatter"] = rs
        rst = cp.zeros(x.size, dtype=x.dtype)
        run("reduce_scatter_tensor",
            lambda: solo.reduce_scatter_tensor(rst, cp.asarray(x).reshape(-1), ReduceOp.SUM,
                                               _call("rst")))
        got["reduce_scatter_tensor"] = rst.reshape(x.shape)
        a2a = [cp.zeros_like(cp.asarray(x))]
        run("all_to_all", lambda: solo.all_to_all(a2a, [cp.asarray(x)], _call("all_to_all")))
        got["all_to_all"] = a2a[0]
        single = cp.zeros_like(cp.asarray(x))
        run("all_to_all_single", lambda: solo.all_to_all_single(
            single, cp.asarray(x), [x.shape[0]], [x.shape[0]], _call("a2as")))
        got["all_to_all_single"] = single
        gathered = [cp.zeros_like(cp.asarray(x))]
        run("gather", lambda: solo.gather(cp.asarray(x), gathered, 0, _call("gather")))
        got["gather"] = gathered[0]
        scattered = cp.zeros_like(cp.asarray(x))
        run("scatter", lambda: solo.scatter(scattered, [cp.asarray(x)], 0, _call("scatter")))
        got["scatter"] = scattered
        for name, value in got.items():
            _close(cp.asnumpy(value), x, f"{name} {dtype}")
    solo.barrier(_call("barrier"))


@pytest.mark.timeout(300)
def test_nccl_streams_events_and_work(solo: Any) -> None:
    import cupy as cp

    side = cp.cuda.Stream(non_blocking=True)
    with side:  # the caller's current stream is a side stream: NCCL must follow it
        x = cp.arange(1 << 22, dtype=cp.float32)
        x *= 3  # queued on the side stream before the collective
        handle = solo.all_reduce(x, ReduceOp.AVG, _call("all_reduce", ReduceOp.AVG))
        handle.wait()  # the side stream waits for the raycoll stream's event
        x += 1  # ordered after the collective on the side stream
        got = cp.asnumpy(x)
    np.testing.assert_array_equal(got, np.arange(1 << 22, dtype=np.float32) * 3 + 1)
    side.synchronize()
    assert handle.query()
    handle.wait(timeout_s=30)  # blocks the host until the sync thread has settled it
    assert handle.exception() is None
    done: List[Any] = []
    handle.add_done_callback(done.append)
    assert done == [None]
    work = raycoll.Work.completed(handle, describe="all_reduce", outputs=[x])
    assert work.is_completed() and work.is_success() and work.wait(timeout=5)


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_nccl_torch_cuda_tensors_and_bfloat16(solo: Any) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int64,
                  torch.uint8, torch.int8, torch.float64):
        base = (torch.arange(64, device="cuda") % 50).reshape(8, 8).to(dtype)  # *2 fits int8
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PREMUL_SUM(2.0), ReduceOp.AVG):
            if op.name == "AVG" and not dtype.is_floating_point:
                continue
            t = base.clone()
            solo.all_reduce(t, op, _call("all_reduce", op)).wait()
            want = base * 2 if op.name == "PREMUL_SUM" else base
            assert torch.equal(t.cpu(), want.cpu()), (dtype, op, t)
        strided = base.clone().t()  # not contiguous
        solo.broadcast(strided, 0, _call("broadcast")).wait()
        assert torch.equal(strided.cpu(), base.t().cpu()), dtype
        outs = [torch.zeros_like(base)]
        solo.all_gather(outs, base, _call("all_gather")).wait()
        assert torch.equal(outs[0].cpu(), base.cpu()), dtype
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        y = torch.full((1 << 20,), 2.0, device="cuda", dtype=torch.bfloat16)
        solo.all_reduce(y, ReduceOp.PREMUL_SUM(0.5), _call("all_reduce")).wait()
        y += 1
    stream.synchronize()
    assert torch.all(y == 2.0).item()


_TIMEOUT_SCRIPT = textwrap.dedent("""
    import os, sys, threading, time
    import cupy as cp
    import raycoll
    from raycoll.backends.base import Call, GroupContext
    from raycoll.backends.nccl import NcclBackend

    def backend(blocking):
        failures = []
        ctx = GroupContext(group_name="t", rank=0, global_ranks=[0], node_ids=["here"],
                           client=None, timeout_s=1.5, on_failure=failures.append,
                           options={"nccl_blocking_wait": blocking})
        b = NcclBackend(ctx)
        b.all_reduce(cp.ones(4, dtype=cp.float32), raycoll.ReduceOp.SUM, call()).wait(30)
        return b, failures

    def call():
        return Call("all_reduce", 7, 1.5, {"reduce_op": ("SUM", None)})

    spin = cp.RawKernel(r'''
    extern "C" __global__ void raycoll_spin(unsigned long long ns) {
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
    }''', "raycoll_spin")
    a, a_failures = backend(True)
    b, b_failures = backend(False)
    stuck = cp.cuda.Stream(non_blocking=True)
    with stuck:  # the collective waits behind a kernel that runs for 8 s
        spin((1,), (1,), (cp.uint64(8_000_000_000),))
        start = time.monotonic()
        try:
            a.all_reduce(cp.ones(4, dtype=cp.float32), raycoll.ReduceOp.SUM, call()).wait()
        except raycoll.DistTimeoutError as exc:
            assert "all_reduce #7" in str(exc) and "aborted" in str(exc), exc
            assert a_failures and a_failures[0] is exc, a_failures
            print(f"BLOCKING-TIMEOUT {time.monotonic() - start:.2f}s", flush=True)
        else:
            raise AssertionError("no DistTimeoutError in blocking mode")
        try:
            a.all_reduce(cp.ones(4, dtype=cp.float32), raycoll.ReduceOp.SUM, call())
        except raycoll.DistTimeoutError:
            print("BROKEN-AFTER", flush=True)
        start = time.monotonic()
        handle = b.all_reduce(cp.ones(4, dtype=cp.float32), raycoll.ReduceOp.SUM, call())
        handle.wait()  # torch semantics: returns at once, the stream waits
        settled = threading.Event()
        box = []
        handle.add_done_callback(lambda error: (box.append(error), settled.set()))
        assert settled.wait(30), "the watchdog did not fire"
        assert isinstance(box[0], raycoll.DistTimeoutError), box
        assert b_failures and isinstance(b_failures[0], raycoll.DistTimeoutError)
        print(f"WATCHDOG-TIMEOUT {time.monotonic() - start:.2f}s", flush=True)
    os._exit(0)  # do not wait for the spinning kernel or the aborted communicators
""")


@pytest.mark.timeout(300)
def test_nccl_timeout_aborts_and_raises_dist_timeout() -> None:
    proc = subprocess.run([sys.executable, "-c", _TIMEOUT_SCRIPT], capture_output=True,
                          text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    assert "BLOCKING-TIMEOUT" in out and "BROKEN-AFTER" in out and "WATCHDOG-TIMEOUT" in out, out
    for line in out.splitlines():
        if line.endswith("s") and "TIMEOUT" in line:
            assert 1.0 < float(line.split()[-1][:-1]) < 8.0, line  # at the deadline, not after


# ---------------------------------------------------------------------- public API, Ray actors
def _one_rank(rank: int) -> Dict[str, Any]:
    import cupy as cp
    from raycoll.world import world

    pg = world().default
    assert pg is not None
    out: Dict[str, Any] = {"device": int(cp.cuda.runtime.getDevice()),
                           "map": pg.backend_config.get_device_backend_map()}
    x = data(0, (1000,), "float32")
    for name in ("SUM", "AVG", "PREMUL_SUM", "MAX"):
        t = cp.asarray(x)
        raycoll.all_reduce(t, op=op_of(name))
        out[f"all_reduce {name}"] = cp.asnumpy(t)
    t = cp.asarray(x)
    raycoll.broadcast(t, src=0)
    out["broadcast"] = cp.asnumpy(t)
    gathered = [cp.zeros(1000, dtype=cp.float32)]
    raycoll.all_gather(gathered, cp.asarray(x))
    out["all_gather"] = cp.asnumpy(gathered[0])
    single = cp.zeros(1000, dtype=cp.float32)
    raycoll.all_to_all_single(single, cp.asarray(x))
    out["all_to_all_single"] = cp.asnumpy(single)
    big = cp.ones(1 << 22, dtype=cp.float32)
    work = raycoll.all_reduce(big, async_op=True)
    assert work is not None
    work.wait()
    out["async sum"] = float(big.sum())
    cp.cuda.get_current_stream().synchronize()
    out["completed"] = work.is_completed() and work.is_success()
    raycoll.barrier()
    out["backend"] = type(pg.backend("cuda")).__name__
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            tt = torch.arange(8, device="cuda", dtype=torch.bfloat16)
            raycoll.all_reduce(tt, op=ReduceOp.PREMUL_SUM(2.0))
            out["torch bf16"] = tt.float().cpu().numpy()
    return out


@pytest.mark.timeout(300)
def test_public_api_one_rank_nccl_in_a_gpu_actor(ray_local: Any) -> None:
    got = raycoll.spawn(_one_rank, world_size=1, actor_options={"num_gpus": 1, "num_cpus": 0},
                        timeout=240)[0]
    x = data(0, (1000,), "float32")
    assert got["device"] == 0 and got["map"] == {"cpu": "objstore", "cuda": "nccl"}
    assert got["backend"] == "NcclBackend"  # the default backend picks NCCL where it can
    for name in ("SUM", "AVG", "PREMUL_SUM", "MAX"):
        _close(got[f"all_reduce {name}"], reference(name, [x]), name)
    for name in ("broadcast", "all_gather", "all_to_all_single"):
        _close(got[name], x, name)
    assert got["async sum"] == float(1 << 22) and got["completed"]
    if "torch bf16" in got:
        np.testing.assert_array_equal(got["torch bf16"], np.arange(8) * 2.0)


def _share_gpu_nccl(rank: int) -> str:
    import cupy as cp

    raycoll.all_reduce(cp.ones(4, dtype=cp.float32))
    return "no error"


@pytest.mark.timeout(300)
def test_nccl_refuses_ranks_that_share_a_gpu(ray_local: Any) -> None:
    with pytest.raises(raycoll.SpawnError) as info:
        raycoll.spawn(_share_gpu_nccl, world_size=2, backend="cpu:objstore,cuda:nccl",
                      actor_options={"num_gpus": 0.5, "num_cpus": 0}, timeout=120)
    assert isinstance(info.value.__cause__, raycoll.BackendUnavailableError), info.value
    assert "use the same GPU" in str(info.value) and "cuda:objstore" in str(info.value)


def _staged(rank: int, world_size: int) -> Dict[str, Any]:
    import cupy as cp

    W = world_size
    out: Dict[str, Any] = {}
    for dtype in ("float32", "int64", "float16"):
        for name in _ops(dtype):
            t = cp.asarray(data(rank, (257,), dtype))
            raycoll.all_reduce(t, op=op_of(name))
            out[f"all_reduce {name} {dtype}"] = cp.asnumpy(t)
    big = cp.asarray(data(rank, (300_001,), "float32"))  # beyond the inline size
    raycoll.all_reduce(big)
    out["all_reduce big"] = cp.asnumpy(big)
    strided = cp.asarray(data(rank, (40, 3), "float32"))[:, 2]
    raycoll.all_reduce(strided, op=ReduceOp.MAX)
    out["all_reduce strided"] = cp.asnumpy(strided)
    x = cp.asarray(data(rank, (12,), "float32"))
    t = x.copy()
    raycoll.reduce(t, dst=W - 1)
    out["reduce"] = cp.asnumpy(t)
    t = x.copy()
    raycoll.broadcast(t, src=1)
    out["broadcast"] = cp.asnumpy(t)
    outs = [cp.zeros(12, dtype=cp.float32) for _ in range(W)]
    raycoll.all_gather(outs, x)
    out["all_gather"] = [cp.asnumpy(o) for o in outs]
    flat = cp.zeros(12 * W, dtype=cp.float32)
    raycoll.all_gather_into_tensor(flat, x)
    out["all_gather_into_tensor"] = cp.asnumpy(flat)
    gl = [cp.zeros(12, dtype=cp.float32) for _ in range(W)] if rank == 0 else None
    raycoll.gather(x, gl, dst=0)
    out["gather"] = [cp.asnumpy(o) for o in gl] if gl is not None else None
    sl = [cp.full(3, 10.0 * j, dtype=cp.float32) for j in range(W)] if rank == 0 else None
    s = cp.zeros(3, dtype=cp.float32)
    raycoll.scatter(s, sl, src=0)
    out["scatter"] = cp.asnumpy(s)
    rs = cp.zeros(3, dtype=cp.float32)
    raycoll.reduce_scatter(rs, [cp.asarray(data(rank, (3,), "float32", salt=j)) for j in range(W)])
    out["reduce_scatter"] = cp.asnumpy(rs)
    rst = cp.zeros(5, dtype=cp.float32)
    raycoll.reduce_scatter_tensor(rst, cp.asarray(data(rank, (5 * W,), "float32")))
    out["reduce_scatter_tensor"] = cp.asnumpy(rst)
    a2a = [cp.zeros(j + 1, dtype=cp.float32) for j in range(W)]
    raycoll.all_to_all(a2a, [cp.full(rank + 1, 100.0 * rank + j, dtype=cp.float32)
                             for j in range(W)])
    out["all_to_all"] = [cp.asnumpy(o) for o in a2a]
    sizes_in = [(rank + j) % 3 for j in range(W)]
    sizes_out = [(j + rank) % 3 for j in range(W)]
    src = cp.arange(sum(sizes_in), dtype=cp.float32) + 1000 * rank
    dst = cp.zeros(sum(sizes_out), dtype=cp.float32)
    raycoll.all_to_all_single(dst, src, sizes_out, sizes_in)
    out["all_to_all_single"] = cp.asnumpy(dst)
    recv = cp.zeros(4, dtype=cp.float32)
    ops = [raycoll.P2POp(raycoll.isend, cp.full(4, float(rank), dtype=cp.float32), (rank + 1) % W),
           raycoll.P2POp(raycoll.irecv, recv, (rank - 1) % W)]
    for work in raycoll.batch_isend_irecv(ops):
        work.wait()
    out["ring"] = cp.asnumpy(recv)
    if rank == 0:
        raycoll.send(cp.arange(6, dtype=cp.int32), dst=1)
    elif rank == 1:
        got = cp.zeros(6, dtype=cp.int32)
        out["recv from"] = raycoll.recv(got, src=0)
        out["recv"] = cp.asnumpy(got)
    raycoll.barrier()
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            tt = torch.full((1000,), rank + 1.0, device="cuda", dtype=torch.bfloat16)
            raycoll.all_reduce(tt)
            out["torch bf16 sum"] = tt.float().cpu().numpy()
            tb = torch.arange(6, device="cuda", dtype=torch.bfloat16) * (rank + 1)
            raycoll.broadcast(tb, src=0)
            out["torch bf16 broadcast"] = tb.float().cpu().numpy()
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_staged_gpu_collectives_with_actors_sharing_the_gpu(ray_local: Any, world_size: int) -> None:
    W = world_size
    results = raycoll.spawn(_staged, world_size=W, args=(W,), backend="cpu:objstore,cuda:objstore",
                            actor_options={"num_gpus": 1.0 / W, "num_cpus": 0}, timeout=300)
    check_staged(results, W)


def check_staged(results: List[Dict[str, Any]], W: int) -> None:
    """Compare what ``_staged`` returned on each of ``W`` ranks with numpy references."""
    for dtype in ("float32", "int64", "float16"):
        for name in _ops(dtype):
            want = reference(name, [data(r, (257,), dtype) for r in range(W)])
            for r in range(W):
                _close(results[r][f"all_reduce {name} {dtype}"], want, f"{name} {dtype} r{r}")
    want_big = reference("SUM", [data(r, (300_001,), "float32") for r in range(W)])
    want_strided = reference("MAX", [data(r, (40, 3), "float32")[:, 2] for r in range(W)])
    xs = [data(r, (12,), "float32") for r in range(W)]
    for r, got in enumerate(results):
        _close(got["all_reduce big"], want_big, f"big r{r}")
        _close(got["all_reduce strided"], want_strided, f"strided r{r}")
        if r == W - 1:
            _close(got["reduce"], reference("SUM", xs), "reduce")
        _close(got["broadcast"], xs[1], f"broadcast r{r}")
        for j in range(W):
            _close(got["all_gather"][j], xs[j], f"all_gather r{r}[{j}]")
        _close(got["all_gather_into_tensor"], np.concatenate(xs), f"agt r{r}")
        if r == 0:
            for j in range(W):
                _close(got["gather"][j], xs[j], f"gather[{j}]")
        _close(got["scatter"], np.full(3, 10.0 * r, dtype=np.float32), f"scatter r{r}")
        _close(got["reduce_scatter"],
               reference("SUM", [data(s, (3,), "float32", salt=r) for s in range(W)]),
               f"reduce_scatter r{r}")
        _close(got["reduce_scatter_tensor"],
               reference("SUM", [data(s, (5 * W,), "float32")[5 * r:5 * r + 5] for s in range(W)]),
               f"rst r{r}")
        for j in range(W):
            _close(got["all_to_all"][j], np.full(j + 1, 100.0 * j + r, dtype=np.float32),
                   f"all_to_all r{r}[{j}]")
        pieces = []
        for s in range(W):
            sizes_s = [(s + j) % 3 for j in range(W)]
            start = sum(sizes_s[:r])
            pieces.append(np.arange(sum(sizes_s), dtype=np.float32)[start:start + sizes_s[r]]
                          + 1000 * s)
        _close(got["all_to_all_single"], np.concatenate(pieces), f"all_to_all_single r{r}")
        _close(got["ring"], np.full(4, float((r - 1) % W), dtype=np.float32), f"ring r{r}")
        if r == 1:
            assert got["recv from"] == 0
            _close(got["recv"], np.arange(6, dtype=np.int32), "recv")
        if "torch bf16 sum" in got:
            np.testing.assert_array_equal(got["torch bf16 sum"], np.full(1000, W * (W + 1) / 2))
            np.testing.assert_array_equal(got["torch bf16 broadcast"], np.arange(6.0))
