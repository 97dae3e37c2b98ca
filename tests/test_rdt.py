"""raycoll as a Ray Direct Transport (raycoll.rdt): ``@ray.method(tensor_transport="raycoll")``
on real actors, as users meet it: tensors of many shapes and dtypes (4 B to 64 MiB) by both
paths (cross-memory reads, and the pull server's sockets as between nodes), a chain of three
actors, one object consumed by two actors and the driver, a producer that died (a named error
at once, the consumers and their raycoll group still working), memory back to its baseline after many transfers; and
the data plane (raycoll.transport.pull) without Ray: a freed object, an abort, a timeout."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import threading
import time

import numpy as np
import pytest
import ray

import raycoll
import raycoll.rdt
from raycoll.errors import BackendUnavailableError, TransferError
from raycoll.native import core
from raycoll.transport.pull import CMA_ENV, INLINE_BYTES, Keeper, Puller, PullError

import helpers

torch = pytest.importorskip("torch", reason=helpers.TORCH_MISSING)

MiB = 1024 * 1024
pytestmark = pytest.mark.torch
raycoll.rdt.register()  # before the classes: ray.method checks the transport's name


def _tensors(big: int):
    """Tensors of several shapes and dtypes: 4 B, odd sizes, a non-contiguous view, an empty
    one, bfloat16, and one of ``big`` bytes."""
    g = torch.Generator().manual_seed(7)
    base = torch.randint(-100, 100, (6, 10), generator=g, dtype=torch.int8)
    return {
        "scalar": torch.tensor(123456, dtype=torch.int32),           # 4 B
        "f32": torch.randn(3, 5, generator=g),
        "f64": torch.randn(2, 3, 4, generator=g, dtype=torch.float64),
        "bf16": torch.randn(17, generator=g).to(torch.bfloat16),
        "bool": torch.rand(9, generator=g) > 0.5,
        "view": base.t(),                                          # not contiguous
        "empty": torch.zeros(0, 3),
        "big": torch.arange(big // 4, dtype=torch.float32),
        "meta": "not a tensor",
    }


def _digest(d) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor):
            raw = v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            out[k] = (tuple(v.shape), str(v.dtype), hashlib.sha1(raw).hexdigest())
        else:
            out[k] = v
    return out


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self):
        import raycoll.transport.pull  # noqa: F401 - see Consumer.__init__

    @ray.method(tensor_transport="raycoll")
    def make(self, big: int):
        self.last = _tensors(big)
        return self.last

    def digest(self):
        return _digest(self.last)

    @ray.method(tensor_transport="raycoll")
    def blob(self, nbytes: int):
        return torch.ones(nbytes // 4)

    def memory(self):
        import psutil

        from raycoll.transport.pull import keeper

        self.last = None
        return psutil.Process().memory_info().rss, len(keeper())

    def pid(self):
        return os.getpid()


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Consumer:
    def __init__(self):
        # Imported here, before Ray's transfer thread runs: a method importing raycoll for
        # the first time while that thread imports it too can meet a half-imported module.
        import raycoll.transport.pull  # noqa: F401

    def digest(self, d):
        return _digest(d)

    @ray.method(tensor_transport="raycoll")
    def plus_one(self, d):
        return {"big": d["big"] + 1, "f32": d["f32"] * 2}

    def all_reduce(self, value):
        t = torch.full((4,), float(value))
        raycoll.all_reduce(t, group="rdt")
        return t.tolist()

    def digest_one(self, t):
        return _digest({"t": t})

    def nbytes(self, t):
        return t.numel() * t.element_size()

    def paths(self):
        from raycoll.transport.pull import puller

        return dict(puller().by_path)

    def ping(self):
        return "ok"


@pytest.fixture(scope="module")
def actors(ray_local):
    """A producer, a consumer reading by cross-memory reads and one pulling over sockets
    (as between nodes), shared by the tests (starting actors is most of their time)."""
    raycoll.rdt.register()  # again: does nothing
    made = {"p": Producer.remote(), "cma": Consumer.remote(),
            "socket": Consumer.options(runtime_env={"env_vars": {CMA_ENV: "0"}}).remote()}
    # the consumers also form a raycoll group: transfers and collectives side by side
    raycoll.create_group([made["cma"], made["socket"]], group_name="rdt")
    yield made
    if ray.is_initialized():
        raycoll.destroy_group("rdt")
        for a in made.values():
            ray.kill(a, no_restart=True)


def test_register_guards_the_ray_version(monkeypatch):
    monkeypatch.setattr(raycoll.rdt, "TESTED_RAY", ("1.0",))
    with pytest.raises(BackendUnavailableError, match="not a version"):
        raycoll.rdt._check_ray(False)
    raycoll.rdt._check_ray(True)  # allowed when asked


@pytest.mark.timeout(90)
@pytest.mark.parametrize("path", ["cma", "socket"])
def test_shapes_and_dtypes_by_both_paths(actors, path):
    if path == "cma" and core is None:
        pytest.skip("cross-memory reads need raycoll's native core")
    p, c = actors["p"], actors[path]
    before = ray.get(c.paths.remote(), timeout=30)[path]
    big = 64 * MiB if path == "cma" else 8 * MiB
    got = ray.get(c.digest.remote(p.make.remote(big)), timeout=60)
    assert got == ray.get(p.digest.remote(), timeout=30)
    assert ray.get(c.paths.remote(), timeout=30)[path] == before + 1
    # a small object (here under 1 KiB) travels in its metadata, on any path
    inline = ray.get(c.paths.remote(), timeout=30)["inline"]
    assert ray.get(c.digest.remote(p.make.remote(16)), timeout=30) == \
        ray.get(p.digest.remote(), timeout=30)
    assert ray.get(c.paths.remote(), timeout=30)["inline"] == inline + 1


@pytest.mark.timeout(60)
def test_chain_of_three_and_one_object_consumed_twice(actors):
    p, b, c = actors["p"], actors["cma"], actors["socket"]
    ref = p.make.remote(4 * MiB)
    want = ray.get(p.digest.remote(), timeout=30)
    # one object, two consumers and the driver
    assert ray.get([b.digest.remote(ref), c.digest.remote(ref)], timeout=30) == [want, want]
    assert _digest(ray.get(ref, timeout=30)) == want
    # a chain: p -> b (computes, returns over raycoll) -> c
    out = ray.get(c.digest.remote(b.plus_one.remote(ref)), timeout=30)
    src = _tensors(4 * MiB)
    assert out == _digest({"big": src["big"] + 1, "f32": src["f32"] * 2})
    # the driver as the producer: ray.put(..., _tensor_transport="raycoll")
    from raycoll.transport.pull import keeper

    put = ray.put(src["big"], _tensor_transport="raycoll")
    assert ray.get(b.digest_one.remote(put), timeout=30) == _digest({"t": src["big"]})
    assert len(keeper()) == 1
    del put
    helpers.wait_for(lambda: len(keeper()) == 0, timeout=20, what="the driver's object freed")


@pytest.mark.timeout(60)
def test_a_producer_that_died_is_named_and_the_consumers_go_on(actors):
    dying = Producer.remote()
    ref = dying.blob.remote(MiB)
    pid = ray.get(dying.pid.remote(), timeout=30)  # the object exists (tasks run in order)
    ray.kill(dying, no_restart=True)
    helpers.wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=20,
                     what="the producer's process to end")
    for path in ("cma", "socket"):  # (without the native core both take the sockets)
        c = actors[path]
        began = time.monotonic()
        with pytest.raises(TransferError, match="is gone"):  # Ray's RayTaskError, as its cause
            ray.get(c.nbytes.remote(ref), timeout=30)
        assert time.monotonic() - began < 20
        # the consumer is alive and takes the next object from a live producer
        assert ray.get(c.digest.remote(actors["p"].make.remote(16)), timeout=30) == \
            ray.get(actors["p"].digest.remote(), timeout=30)
    # and their raycoll group is untouched
    assert ray.get([actors["cma"].all_reduce.remote(1), actors["socket"].all_reduce.remote(2)],
                   timeout=60) == [[3.0] * 4] * 2


@pytest.mark.timeout(90)
def test_memory_of_the_producer_back_to_baseline(actors):
    p, c = actors["p"], actors["cma"]
    size = 32 * MiB
    ray.get(c.nbytes.remote(p.blob.remote(size)), timeout=30)  # warm up (the server, pools)
    helpers.wait_for(lambda: ray.get(p.memory.remote())[1] == 0, timeout=20,
                     what="the warm-up object to be freed")
    base, _ = ray.get(p.memory.remote(), timeout=10)
    for i in range(12):
        assert ray.get(actors["cma" if i % 2 else "socket"].nbytes.remote(p.blob.remote(size)),
                       timeout=30) == size
    helpers.wait_for(lambda: ray.get(p.memory.remote())[1] == 0, timeout=30,
                     what="every object to be freed")
    rss, kept = ray.get(p.memory.remote(), timeout=10)
    assert kept == 0
    assert rss - base < 2 * size, f"producer grew by {(rss - base) / MiB:.0f} MiB"


# ---------------------------------------------------------------- the data plane, no Ray
def test_a_freed_object_is_named_by_both_paths():
    k, p = Keeper(), Puller()
    data = np.arange(INLINE_BYTES + 1000, dtype=np.uint8)
    kept = k.keep("obj-1", [data], node_id="n")
    out = np.empty_like(data)
    same_node = "cma" if core is not None else "socket"
    assert p.pull(kept, [out], node_id="n", timeout_s=5) == same_node
    assert (out == data).all()
    out[:] = 0
    assert p.pull(kept, [out], node_id="other", timeout_s=5) == "socket"
    assert (out == data).all()
    small = k.keep("obj-0", [data[:100]], node_id="n")  # travels in its metadata
    assert p.pull(small, [out[:100]], node_id="other", timeout_s=5) == "inline"
    with pytest.raises(PullError, match="buffer 0 has 10 bytes"):
        p.pull(kept, [out[:10]], node_id="n", timeout_s=5)
    assert k.drop("obj-1") and not k.drop("obj-1")
    with pytest.raises(PullError, match="freed"):
        p.pull(kept, [out], node_id="n", timeout_s=5)
    with pytest.raises(PullError, match="freed"):
        p.pull(kept, [out], node_id="other", timeout_s=5)


def test_a_stalled_keeper_times_out_and_a_pull_can_be_aborted():
    k, p = Keeper(), Puller()
    kept = k.keep("obj-2", [np.zeros(INLINE_BYTES + 8, dtype=np.uint8)], node_id="n")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # accepts (the kernel does) and never answers
    stalled = dataclasses.replace(kept, port=silent.getsockname()[1])
    out = np.empty(INLINE_BYTES + 8, dtype=np.uint8)
    began = time.monotonic()
    with pytest.raises(PullError, match="no reply within"):
        p.pull(stalled, [out], node_id="other", timeout_s=0.3)
    assert time.monotonic() - began < 3
    threading.Timer(0.3, p.abort, args=("obj-2",)).start()
    began = time.monotonic()
    with pytest.raises(PullError, match="aborted"):
        p.pull(stalled, [out], node_id="other", timeout_s=30)
    assert time.monotonic() - began < 5
    # the real keeper still serves
    assert p.pull(kept, [out], node_id="other", timeout_s=5) == "socket"
    silent.close()

