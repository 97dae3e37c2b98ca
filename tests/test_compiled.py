"""raycoll.compiled.RaycollCommunicator in real Ray Compiled Graphs (two actors, one node):
collective nodes against torch references, p2p edges, several executions, reuse by a second
graph, teardown and destroy, and bad input giving named errors rather than hangs."""

from __future__ import annotations

import time

import pytest
import ray

from helpers import TORCH_MISSING

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch", reason=TORCH_MISSING)

W = 2


class Member:
    """A compiled graph's actor: makes rank-dependent tensors, reads results."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def make(self, spec):
        import torch

        shape, dtype, salt = spec
        if salt < 0 and self.rank == 1:
            raise ValueError("bad input on rank 1")
        if salt == 999:  # a mismatch: rank 1's tensor is one element longer
            shape = (shape[0] + self.rank,) + tuple(shape[1:])
        n = 1
        for d in shape:
            n *= d
        base = torch.arange(n, dtype=torch.float64).reshape(shape)
        return ((base * (self.rank + 1) + salt) % 7 - 3).to(getattr(torch, dtype))

    def double(self, t):
        return t * 2


def _groups(actor_self):
    import raycoll
    from raycoll.world import world

    return sorted(world().groups), raycoll.is_initialized()


def _expected(spec):
    import torch

    shape, dtype, salt = spec
    n = 1
    for d in shape:
        n *= d
    base = torch.arange(n, dtype=torch.float64).reshape(shape)
    return [((base * (r + 1) + salt) % 7 - 3).to(getattr(torch, dtype)) for r in range(W)]


@pytest.fixture(scope="module")
def members(ray_local):
    actor = ray.remote(num_cpus=0)(Member)
    actors = [actor.remote(r) for r in range(W)]
    yield actors
    for a in actors:
        ray.kill(a, no_restart=True)


def test_collective_nodes_match_torch(members):
    import torch
    import ray.experimental.collective as rcol
    from ray.dag import InputNode, MultiOutputNode
    from ray.experimental.util.types import ReduceOp

    from raycoll.compiled import RaycollCommunicator

    comm = RaycollCommunicator(members)
    with InputNode() as inp:
        xs = [m.make.bind(inp) for m in members]
        summed = rcol.allreduce.bind(xs, transport=comm)
        top = rcol.allreduce.bind(xs, op=ReduceOp.MAX, transport=comm)
        gathered = rcol.allgather.bind(xs, transport=comm)
        scattered = rcol.reducescatter.bind(xs, transport=comm)
        dag = MultiOutputNode(summed + top + gathered + scattered)
    graph = dag.experimental_compile()
    try:
        for spec in [((4,), "float32", 0), ((6, 3), "int64", 1), ((1000, 5), "float64", 2),
                     ((524288, 2), "float32", 3), ((4,), "float32", 4)]:
            inputs = _expected(spec)
            got = ray.get(graph.execute(spec), timeout=60)
            total = inputs[0] + inputs[1]
            chunk = spec[0][0] // W
            for r in range(W):
                assert torch.equal(got[r], total)
                assert torch.equal(got[W + r], torch.maximum(inputs[0], inputs[1]))
                assert torch.equal(got[2 * W + r], torch.cat(inputs))
                assert torch.equal(got[3 * W + r], total[r * chunk:(r + 1) * chunk])
        # the group is a named one in each actor, never the actor's default group
        for names, has_default in ray.get([m.__ray_call__.remote(_groups) for m in members]):
            assert names == [comm.group_name] and not has_default
    finally:
        graph.teardown()
        comm.destroy()
    assert ray.get([m.__ray_call__.remote(_groups) for m in members]) == [([], False)] * W


def test_p2p_edge_and_reuse_by_a_second_graph(members):
    import torch
    import ray.experimental.collective as rcol
    from ray.dag import InputNode, MultiOutputNode

    from raycoll.compiled import RaycollCommunicator
    from raycoll.errors import GroupDestroyedError

    def build(comm):
        with InputNode() as inp:
            xs = [m.make.bind(inp) for m in members]
            summed = rcol.allreduce.bind(xs, transport=comm)
            edge = summed[0].with_tensor_transport(transport=comm)
            return MultiOutputNode([members[1].double.bind(edge), summed[1]])

    comm = RaycollCommunicator(members)
    for _ in range(2):  # the second graph finds the group formed by the first
        graph = build(comm).experimental_compile()
        try:
            for spec in [((1,), "float32", 0), ((3, 4), "int32", 1), ((257, 31), "float64", 2)]:
                inputs = _expected(spec)
                doubled, summed_1 = ray.get(graph.execute(spec), timeout=60)
                assert torch.equal(summed_1, inputs[0] + inputs[1])
                assert torch.equal(doubled, (inputs[0] + inputs[1]) * 2)
        finally:
            graph.teardown()
    comm.destroy()
    with pytest.raises(GroupDestroyedError, match="was destroyed"):
        build(comm).experimental_compile()


def test_bad_input_gives_named_errors_not_hangs(members):
    import torch
    import ray.experimental.collective as rcol
    from ray.dag import InputNode, MultiOutputNode

    from raycoll.compiled import RaycollCommunicator
    from raycoll.errors import CollectiveMismatchError, DistTimeoutError, GroupBrokenError

    comm = RaycollCommunicator(members, timeout=2)
    with InputNode() as inp:
        dag = MultiOutputNode(rcol.allreduce.bind([m.make.bind(inp) for m in members],
                                                  transport=comm))
    graph = dag.experimental_compile()
    try:
        # ranks disagree on the shape: both raise at once, and the graph goes on
        start = time.monotonic()
        with pytest.raises(CollectiveMismatchError, match=r"ranks disagree on shape"):
            ray.get(graph.execute(((5,), "float32", 999)), timeout=60)
        assert time.monotonic() - start < 5
        good = ((5,), "float32", 0)
        assert torch.equal(ray.get(graph.execute(good), timeout=60)[0], sum(_expected(good)))
        # rank 1's task raises, so Ray skips its collective: rank 0 waits its timeout, then
        # names rank 1; the group is broken from then on, and says so at once
        with pytest.raises(ValueError, match="bad input on rank 1"):
            ray.get(graph.execute(((5,), "float32", -1)), timeout=60)
        start = time.monotonic()
        with pytest.raises(DistTimeoutError, match=r"ranks \[1\] never arrived"):
            ray.get(graph.execute(good), timeout=60)
        assert time.monotonic() - start < 10
        with pytest.raises(GroupBrokenError, match="broken by an earlier failure"):
            ray.get(graph.execute(good), timeout=60)
    finally:
        graph.teardown()
        comm.destroy()


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the GPU-less case")
def test_cuda_on_actors_without_a_gpu_is_refused_at_compile(members):
    import ray.experimental.collective as rcol
    from ray.dag import InputNode, MultiOutputNode

    from raycoll.compiled import RaycollCommunicator
    from raycoll.errors import BackendUnavailableError

    comm = RaycollCommunicator(members, device="cuda")
    assert comm.get_transport_name() == "accelerator"
    with InputNode() as inp:
        dag = MultiOutputNode(rcol.allreduce.bind([m.make.bind(inp) for m in members],
                                                  transport=comm))
    try:
        with pytest.raises(BackendUnavailableError, match=r"cannot use device='cuda'"):
            dag.experimental_compile()
    finally:
        comm.destroy()


def test_arguments_and_the_ray_version_guard(members, monkeypatch):
    import raycoll.compiled as compiled
    from raycoll.errors import BackendUnavailableError, UnsupportedOpError

    with pytest.raises(ValueError, match="non-empty list"):
        compiled.RaycollCommunicator([])
    with pytest.raises(TypeError, match=r"actors\[1\] must be a Ray actor handle"):
        compiled.RaycollCommunicator([members[0], "x"])
    with pytest.raises(ValueError, match="distinct"):
        compiled.RaycollCommunicator([members[0], members[0]])
    with pytest.raises(ValueError, match="device must be one of"):
        compiled.RaycollCommunicator(members, device="tpu")
    with pytest.raises(ValueError, match="timeout must be > 0"):
        compiled.RaycollCommunicator(members, timeout=0)
    with pytest.raises(UnsupportedOpError, match="Ray's ReduceOp"):
        compiled._reduce_op("SUM")
    comm = compiled.RaycollCommunicator(members)
    # a call gives up before the driver's ray.get of the step does (Ray's default: 10 s)
    assert comm._spec.timeout_s == 8.0
    assert [comm.get_rank(m) for m in members] == [0, 1]
    assert comm.get_world_size() == W and comm.get_self_rank() is None
    assert comm.get_transport_name() == "cpu"
    comm.destroy()
    comm.destroy()  # twice: nothing more to do
    monkeypatch.setattr(ray, "__version__", "2.59.0")
    monkeypatch.delenv(compiled.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(BackendUnavailableError, match=r"tested with Ray 2\.60; this is Ray 2\.59"):
        compiled._ray_api()
    monkeypatch.setenv(compiled.ALLOW_UNTESTED_ENV, "1")
    compiled._ray_api()
