"""Shared test data: deterministic per-rank arrays and numpy references."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence, Tuple

import numpy as np

#: torch is an optional extra: tests marked ``torch`` skip with this reason without it.
HAS_TORCH = importlib.util.find_spec("torch") is not None
TORCH_MISSING = ("needs torch, an optional extra the [test] extra does not install: "
                 "pip install -e '.[torch]' (on a CPU-only machine: pip install torch==2.13.0)")

DTYPES = ("int32", "int64", "float32", "float64", "bool", "complex64")

OPS_BY_KIND = {
    "i": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"),
    "f": ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"),
    "b": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
    "c": ("SUM", "PRODUCT", "AVG"),
}


def data(rank: int, shape: Any, dtype: str, salt: int = 0) -> np.ndarray:
    """The deterministic input of ``rank``."""
    rng = np.random.default_rng(1000 * salt + rank + 1)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.random(shape) > 0.5
    if dt.kind in "iu":
        return rng.integers(-4, 5, shape).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    return rng.standard_normal(shape).astype(dt)


def op_of(name: str) -> Any:
    import raycoll

    return raycoll.ReduceOp.PREMUL_SUM(2.0) if name == "PREMUL_SUM" else getattr(raycoll.ReduceOp, name)


def reference(op: str, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """What reducing ``arrays`` with ``op`` must give."""
    ufunc = {"SUM": np.add, "AVG": np.add, "PREMUL_SUM": np.add, "PRODUCT": np.multiply,
             "MIN": np.minimum, "MAX": np.maximum, "BAND": np.bitwise_and,
             "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
    out = arrays[0].copy()
    for a in arrays[1:]:
        out = ufunc(out, a).astype(out.dtype)
    if op == "AVG":
        out = (out / len(arrays)).astype(out.dtype) if out.dtype.kind in "fc" else \
            np.trunc(out / len(arrays)).astype(out.dtype)
    if op == "PREMUL_SUM":
        out = (out * 2.0).astype(out.dtype)
    return out


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if want.dtype.kind in "fc":
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def cases(sizes: Sequence[int]) -> Tuple[Tuple[str, str, int], ...]:
    return tuple((dt, op, n) for dt in DTYPES for op in OPS_BY_KIND[np.dtype(dt).kind]
                 for n in sizes)


def store_used() -> Tuple[int, int]:
    """Object-store bytes in use and object count, summed over the cluster's nodes."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.object_store_bytes_used), int(reply.store_stats.num_local_objects)


def soak_module() -> Any:
    """``benchmarks/soak.py`` as a module whose functions travel to the ranks by value."""
    import importlib.util
    import sys
    from pathlib import Path

    import ray

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("raycoll_soak", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["raycoll_soak"] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # the ranks cannot import benchmarks/
    return module


def every_op(rank: int, world_size: int, n: int) -> Any:
    """Every collective and point-to-point call on the default group with ``n``-element
    arrays (strided and uneven ones among them), each checked here against numpy. Returns
    ``(failures, transport)``: what came out wrong (empty when all is right) and the round
    transport the group used."""
    import raycoll
    from raycoll.world import world

    W, me = world_size, rank
    bad = []

    def mine(r: int, k: int = n, salt: int = 0) -> np.ndarray:
        return data(r, (k,), "float64", salt)

    def check(what: str, got: Any, want: Any) -> None:
        if not np.allclose(np.asarray(got), np.asarray(want)):
            bad.append(what)

    x = mine(me)
    raycoll.all_reduce(x)
    check("all_reduce", x, sum(mine(r) for r in range(W)))
    strided = np.zeros((n, 2))
    strided[:, 0] = mine(me)
    raycoll.all_reduce(strided[:, 0], op=raycoll.ReduceOp.MAX)  # non-contiguous, in place
    check("all_reduce strided MAX", strided[:, 0], np.max([mine(r) for r in range(W)], axis=0))
    x = mine(me)
    raycoll.reduce(x, dst=W - 1)
    if me == W - 1:
        check("reduce", x, sum(mine(r) for r in range(W)))
    x = mine(me) if me == 1 else np.zeros(n)
    raycoll.broadcast(x, src=1)
    check("broadcast", x, mine(1))
    outs = [np.zeros(n) for _ in range(W)]
    raycoll.all_gather(outs, mine(me))
    check("all_gather", np.stack(outs), np.stack([mine(r) for r in range(W)]))
    flat = np.zeros(n * W)
    raycoll.all_gather_into_tensor(flat, mine(me))
    check("all_gather_into_tensor", flat, np.concatenate([mine(r) for r in range(W)]))
    gathered = [np.zeros(n) for _ in range(W)] if me == 0 else None
    raycoll.gather(mine(me), gathered, dst=0)
    if me == 0:
        check("gather", np.stack(gathered), np.stack([mine(r) for r in range(W)]))
    out = np.zeros(n)
    raycoll.scatter(out, [mine(j, salt=5) for j in range(W)] if me == 0 else None, src=0)
    check("scatter", out, mine(me, salt=5))
    out = np.zeros(n)
    raycoll.reduce_scatter(out, [mine(me, salt=j) for j in range(W)])
    check("reduce_scatter", out, sum(mine(r, salt=me) for r in range(W)))
    out = np.zeros(n)
    raycoll.reduce_scatter_tensor(out, np.concatenate([mine(me, salt=j) for j in range(W)]))
    check("reduce_scatter_tensor", out, sum(mine(r, salt=me) for r in range(W)))
    # uneven: rank r sends (r + j + 1) elements to rank j
    sends = [mine(me, me + j + 1, salt=j) for j in range(W)]
    recvs = [np.zeros(s + me + 1) for s in range(W)]
    raycoll.all_to_all(recvs, sends)
    for s in range(W):
        check(f"all_to_all from {s}", recvs[s], mine(s, s + me + 1, salt=me))
    in_splits = [me + j + 1 for j in range(W)]
    out_splits = [s + me + 1 for s in range(W)]
    got = np.zeros(sum(out_splits))
    raycoll.all_to_all_single(got, np.concatenate(sends), out_splits, in_splits)
    check("all_to_all_single", got, np.concatenate([mine(s, s + me + 1, salt=me)
                                                    for s in range(W)]))
    raycoll.barrier()
    # point to point: a ring, then any-source and tags towards rank 0, in order
    nxt, prv = (me + 1) % W, (me - 1) % W
    got = np.zeros(n)
    works = raycoll.batch_isend_irecv([raycoll.P2POp(raycoll.isend, mine(me, salt=9), nxt),
                                       raycoll.P2POp(raycoll.irecv, got, prv)])
    for w in works:
        w.wait()
    check("ring", got, mine(prv, salt=9))
    if me == 0:
        seen = set()
        for _ in range(W - 1):
            buf = np.zeros((3, 2))
            src = raycoll.recv(buf, tag=7)
            seen.add(src)
            check(f"recv any from {src}", buf, np.full((3, 2), float(src)))
        if seen != set(range(1, W)):
            bad.append(f"any-source saw {sorted(seen)}")
        for k in range(3):  # messages from one rank with one tag keep their order
            buf = np.zeros(n)
            raycoll.recv(buf, src=W - 1, tag=8)
            check(f"ordered {k}", buf, mine(W - 1, salt=20 + k))
    else:
        raycoll.send(np.full((3, 2), float(me)), dst=0, tag=7)
        if me == W - 1:
            strided = np.zeros((n, 3))
            for k in range(3):
                strided[:, 1] = mine(me, salt=20 + k)
                raycoll.send(strided[:, 1], dst=0, tag=8)  # non-contiguous
    return bad, world().default.context.transport_name


@contextlib.contextmanager
def example_module(filename: str) -> Iterator[Any]:
    """``examples/<filename>`` imported as a module, shipped to the ranks by value (they
    cannot import it by name)."""
    import ray.cloudpickle

    path = Path(__file__).resolve().parents[1] / "examples" / filename
    spec = importlib.util.spec_from_file_location(f"{path.stem}_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    try:
        yield module
    finally:
        ray.cloudpickle.unregister_pickle_by_value(module)
        sys.modules.pop(spec.name, None)


# ---------------------------------------------------------------------- torch ranks (torch is
# imported inside: the [test] extra does not install it)
def torch_init(backend: str = "raycoll") -> Any:
    """In a rank: ``torch.distributed`` initialised on ``backend`` (one torch thread: the
    ranks share the machine's cores); returns the module."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend)
    return dist


def toy_model() -> Any:
    """The same small MLP on every rank (seeded)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def toy_data(n: int = 64) -> Any:
    """``n`` seeded (input, target) rows for :func:`toy_model`."""
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def mse(model: Any, x: Any, y: Any) -> Any:
    """The mean squared error of ``model`` on ``(x, y)``."""
    return ((model(x) - y) ** 2).mean()


def one_process(steps: int, optimizer: str, lr: float, loss_scale: float = 1.0) -> Any:
    """:func:`toy_model` trained in this process on all of :func:`toy_data` for ``steps``
    steps (``optimizer`` "sgd" or "adam"): the reference a distributed run must reach."""
    import torch

    model = toy_model()
    make = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer]
    opt = make(model.parameters(), lr=lr)
    x, y = toy_data()
    for _ in range(steps):
        (mse(model, x, y) * loss_scale).backward()
        opt.step()
        opt.zero_grad()
    return model


def wait_for(predicate: Any, timeout: float = 30.0, every: float = 0.05, what: str = "") -> Any:
    """Poll ``predicate()`` until it returns something truthy (returned), at most ``timeout``
    seconds; then fail naming ``what`` and the last value. For tests: a bounded wait for a
    condition instead of a sleep."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            break
        time.sleep(every)
    assert value, f"not within {timeout:g}s: {what or predicate} (last: {value!r})"
    return value


def wait_in_collective(name: str, ranks: Sequence[int], where: Any,
                       within_s: float = 60.0) -> None:
    """Poll the group's status until ``ranks`` wait inside collective ``where`` (its op and
    sequence number), failing the test past ``within_s``."""
    import time

    import pytest
    import raycoll

    deadline = time.monotonic() + within_s
    status: Any = {}
    while time.monotonic() < deadline:
        status = raycoll.group_status(name)["ranks"]
        if all(status[r]["waiting"] and tuple(status[r]["last_collective"] or ()) == where
               for r in ranks):
            return
        time.sleep(0.05)
    pytest.fail(f"ranks {list(ranks)} did not wait in {where} within {within_s}s: {status}")


def sanitize() -> str:
    """The sanitizers the native core loaded in this process was built with (``""``: none)."""
    from raycoll.native import core

    return core.SANITIZE if core is not None else "(no native core)"


def all_reduces_on_one_core(calls: int, stats: Any) -> Any:
    """``calls`` + 1 all_reduces of 1.0 on this rank pinned to the machine's first core (two
    ranks pinned alike share it: a spinning wait never helps), then ``stats(sum)``."""
    import os

    import raycoll

    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    try:
        x = np.ones(1, dtype=np.float32)
        for _ in range(calls):
            raycoll.all_reduce(x)
            x[:] = 1.0
        raycoll.all_reduce(x)
        return stats(float(x[0]))
    finally:
        os.sched_setaffinity(0, cores)


def _rank_sum(rank: int, name: str) -> float:
    import raycoll

    x = np.full(3, rank + 1.0)
    raycoll.all_reduce(x, group=name)
    return float(x[0])


def group_sums(actors: Sequence[Any], name: str) -> Any:
    """Each rank's sum of ``rank + 1`` over group ``name`` (an all_reduce in every actor of
    ``actors``, raycoll's ``RankWorker`` s, rank = position)."""
    import ray

    return ray.get([a.run.remote(_rank_sum, r, (name,), {}) for r, a in enumerate(actors)],
                   timeout=60)



@contextlib.contextmanager
def rank_actors(count: int) -> Iterator[Any]:
    """``count`` zero-CPU sync ``RankWorker`` actors (one method at a time), killed after."""
    import ray

    from raycoll.launch import RankWorker

    actors = [ray.remote(RankWorker).options(num_cpus=0).remote() for _ in range(count)]
    try:
        yield actors
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)


def join_by_name(rank: int, name: str) -> None:
    """In a rank: join group ``name`` of 2 ranks by name (``init_process_group``)."""
    import raycoll

    raycoll.init_process_group(world_size=2, rank=rank, group_name=name, timeout=60)


def leave_by_name(rank: int, name: str) -> None:
    """In a rank: destroy its group ``name``."""
    import raycoll

    raycoll.destroy_process_group(name)
