"""The benchmark's peers and Ray's floors (raycoll.bench.peers, raycoll.bench.floors) on a real
local Ray: gloo, ray.util.collective, an actor-call round trip, a plain ray.get."""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Iterator, Type

import pytest
import ray

from raycoll.bench.floors import actor_round_trip_seconds, plain_get_seconds
from raycoll.bench.peers import (
    OPS,
    GlooPeer,
    NotSupportedByPeer,
    Peer,
    RayCollectivePeer,
    canonical_op,
    effective_nbytes,
)

PEERS = [GlooPeer, RayCollectivePeer]


@pytest.fixture(scope="module")
def peers_ray() -> Iterator[None]:
    """A local Ray for this module, or the one already running (left running then)."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module", params=PEERS, ids=lambda cls: cls.name)
def peer(request: pytest.FixtureRequest, peers_ray: None) -> Iterator[Peer]:
    cls: Type[Peer] = request.param
    with cls() as p:
        p.setup(2)
        yield p


@pytest.mark.timeout(10)
def test_sizes_follow_nccl_tests() -> None:
    assert effective_nbytes("all_reduce", 4, "float32", 2) == 4
    assert effective_nbytes("allgather", 1 << 20, "float32", 4) == 1 << 20
    assert effective_nbytes("all_gather", 4, "float32", 2) == 8  # one element per rank at least
    assert effective_nbytes("reduce_scatter_tensor", 12, "float32", 2) == 8
    assert effective_nbytes("barrier", 1 << 20, "float32", 2) == 0
    assert canonical_op("send/recv") == "send_recv"
    with pytest.raises(ValueError, match="op: expected one of"):
        canonical_op("all_reduce_coalesced")
    with pytest.raises(ValueError, match="dtype"):
        effective_nbytes("all_reduce", 4, "float33", 2)


@pytest.mark.timeout(10)
def test_not_supported_survives_pickling() -> None:
    err = pickle.loads(pickle.dumps(NotSupportedByPeer("gloo", "scatter", "why")))
    assert (err.peer, err.op, err.reason) == ("gloo", "scatter", "why")


@pytest.mark.torch
@pytest.mark.timeout(120)  # the first test of each peer also pays for ray.init and setup
@pytest.mark.parametrize("nbytes", [4, 1 << 20])
def test_all_reduce_times(peer: Peer, nbytes: int) -> None:
    times = peer.run("all_reduce", nbytes, "float32", iters=5, warmup=1)
    assert len(times) == 5
    assert all(t > 0 for t in times)


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_every_supported_op_runs(peer: Peer) -> None:
    for op in sorted(peer.supported_ops):
        times = peer.run(op, 4096, "float32", iters=1, warmup=0)
        assert len(times) == 1 and times[0] > 0, op


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_unsupported_op_raises(peer: Peer) -> None:
    missing = sorted(set(OPS) - peer.supported_ops)
    if not missing:  # gloo runs every op; a dtype it refuses takes the same path
        with pytest.raises(NotSupportedByPeer, match="uint16") as refused:
            peer.run("all_reduce", 4, "uint16", iters=1, warmup=0)
        assert type(refused.value) is NotSupportedByPeer  # unwrapped from RayTaskError
        assert peer.run("all_reduce", 4, "float32", iters=1, warmup=0)[0] > 0  # group intact
        return
    with pytest.raises(NotSupportedByPeer) as info:
        peer.run(missing[0], 1024, "float32", iters=1, warmup=0)
    assert info.value.peer == peer.name and info.value.op == missing[0]


@pytest.mark.timeout(30)
def test_ray_collective_lacks_all_to_all() -> None:
    with pytest.raises(NotSupportedByPeer, match="all_to_all"):
        RayCollectivePeer().run("alltoall", 1024, "float32", iters=1, warmup=0)


@pytest.mark.timeout(30)
def test_run_before_setup_is_refused() -> None:
    with pytest.raises(RuntimeError, match="before setup"):
        GlooPeer().run("all_reduce", 4, "float32", iters=1, warmup=0)


@pytest.mark.timeout(30)
def test_actor_round_trip(peers_ray: None) -> None:
    times = actor_round_trip_seconds(iters=5, warmup=1)
    assert len(times) == 5 and all(0 < t < 5 for t in times)


@pytest.mark.timeout(30)
def test_plain_get(peers_ray: None) -> None:
    times = plain_get_seconds(1 << 20, iters=3, warmup=1)
    assert len(times) == 3 and all(t > 0 for t in times)
    with pytest.raises(ValueError, match="node_resource"):
        plain_get_seconds(4, iters=1, node_resource="no_such_node")


@pytest.mark.torch
@pytest.mark.timeout(90)
def test_run_timeout_fires_and_closes(peers_ray: None) -> None:
    peer = GlooPeer()
    peer.setup(1)  # one rank starts fastest; its all_reduce still takes ~0.1 ms per call
    peer.timeout = timedelta(seconds=0.5)
    with pytest.raises(TimeoutError, match="did not finish within"):
        peer.run("all_reduce", 1 << 20, "float32", iters=1_000_000, warmup=0)
    with pytest.raises(RuntimeError, match="before setup"):  # closed by the timeout
        peer.run("all_reduce", 4, "float32", iters=1, warmup=0)
