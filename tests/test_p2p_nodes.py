"""Point-to-point across two Ray nodes (``ray.cluster_utils.Cluster`` on this machine) on the
native core's socket pipes (raycoll/native/sockpipe.c under raycoll/transport/pipes.py's
matching): the one-node tests' scenarios (tests/test_p2p_native.py) run with the ranks on
different nodes, so both kinds of pipe keep one set of semantics.

- order per destination, matching by tag in posting order, any-source receives (across a
  node-mate's shared-memory pipe and a remote rank's socket pipe in one group), small sends
  completing before their receive is posted, large ones streamed;
- a dtype or shape mismatch is ``CollectiveMismatchError`` on the receiver, and on the sender
  of a large message; the pair goes on after it;
- the short path of blocking calls keeps torch's matching and argument checks;
- a peer killed while a rank waits in a receive fails it with a named error, well within the
  group's timeout; a receive nobody sends to times out with ``DistTimeoutError``; a group
  destroyed on one rank ends the other node's waiting receive ("left the group").
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Dict, List

import numpy as np
import pytest
import ray

import test_p2p_native
from test_p2p_native import (_destroy_while_waiting, _kill_rank_1_mid_receive, _mismatch,
                             _short_path_edges, _traffic)

import raycoll
from raycoll.launch import RankWorker, run_on
from raycoll.native import native_available, native_status
from raycoll.world import world

# the one-node tests' rank functions run here too: ship them by value (test modules are not
# importable in Ray's workers; conftest registers only the modules collected)
ray.cloudpickle.register_pickle_by_value(test_p2p_native)

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(not native_available(), reason=f"native core: {native_status()}")]


def _pipes(rank: int) -> Dict[str, Any]:
    """Which kind of pipe this rank holds to each peer it talked to."""
    pipes = world().default.context.pair_pipes()
    return {"kind": type(pipes).__name__, "node": ray.get_runtime_context().get_node_id(),
            "pipes": {peer: type(p).__name__ for peer, p in getattr(pipes, "_pipes", {}).items()}}


def _actors(nodes: List[int]) -> List[Any]:
    worker = ray.remote(RankWorker)
    return [worker.options(num_cpus=0, resources={f"node{n}": 1}).remote() for n in nodes]


def _run(nodes: List[int], fn: Any, *args: Any) -> List[Any]:
    actors = _actors(nodes)
    try:
        name = f"p2pnodes-{uuid.uuid4().hex[:6]}"
        got = run_on(actors, lambda rank, *a: (fn(rank, *a), _pipes(rank)), args,
                     group_name=name, timeout=60)
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
    results, kinds = [g[0] for g in got], [g[1] for g in got]
    assert len({k["node"] for k in kinds}) == 2, kinds  # really spread over both nodes
    assert {k["kind"] for k in kinds} == {"PairPipes"}, kinds
    return [results, kinds]


@pytest.mark.timeout(240)
def test_order_tags_streaming_and_any_source_across_nodes_on_socket_pipes(two_nodes):
    n = 700_000  # 2.8 MB: streamed
    (got, kinds) = _run([0, 1, 1], _traffic, n)  # rank 0 on node0; ranks 1 and 2 on node1
    one = got[1]
    assert one["tags"] == [[1.0] * 4, [2.0] * 4, [3.0] * 4]
    assert one["big_ok"]
    assert one["order"] == [float(i) for i in range(10)]
    assert (one["any_src"], one["any_value"]) == (0, 42)
    assert kinds[1]["pipes"].get(0) == "SockPipe", kinds  # across nodes: a socket pipe


def _mixed_any_source(rank: int) -> Dict[str, Any]:
    """Rank 0 receives from any source while its node-mate (rank 1, shared memory) and a rank
    on the other node (rank 2, a socket pipe) send to it."""
    out: Dict[str, Any] = {}
    if rank == 0:
        got = []
        for _ in range(6):
            x = np.zeros(3)
            src = raycoll.recv(x, tag=4)
            got.append((src, float(x[0])))
        out["got"] = got
    else:
        for i in range(3):
            raycoll.send(np.full(3, float(10 * rank + i)), dst=0, tag=4)
    return out


@pytest.mark.timeout(240)
def test_any_source_takes_messages_from_a_node_mate_and_a_remote_rank_in_their_order(two_nodes):
    got, kinds = _run([0, 0, 1], _mixed_any_source)
    pairs = got[0]["got"]
    for sender in (1, 2):  # each sender's messages in its order, the value naming the sender
        assert [v for s, v in pairs if s == sender] == [10.0 * sender + i for i in range(3)]
    assert kinds[0]["pipes"] == {1: "Pipe", 2: "SockPipe"}, kinds


@pytest.mark.timeout(240)
def test_a_mismatch_across_nodes_fails_the_receiver_and_a_large_messages_sender(two_nodes):
    n = 100_000  # 400 KB: more than a send completes alone
    (sender, receiver), _ = _run([0, 1], _mismatch, n)
    kind, msg = receiver["small"]
    assert kind == "CollectiveMismatchError", receiver
    assert "the sender sent dtype=float32, shape=(4,)" in msg, msg
    assert sender["small"] == (None, "")  # it completed before the receive (as torch's)
    kind, msg = receiver["large"]
    assert kind == "CollectiveMismatchError" and f"shape=({n},)" in msg, receiver
    kind, msg = sender["large"]
    assert kind == "CollectiveMismatchError", sender
    assert "the receiver rejected the message" in msg and f"shape=({n},)" in msg, msg
    assert receiver["after"] == [7.0] * 3  # the pair goes on


@pytest.mark.timeout(240)
def test_the_short_path_across_nodes_keeps_torchs_matching_and_checks(two_nodes):
    (sender, receiver), _ = _run([0, 1], _short_path_edges)
    assert receiver["same_tag"] == [1.0, 2.0], receiver
    assert receiver["kept"] == [4.0, 3.0], receiver
    assert receiver["view"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert receiver["read_only"][0] == "ValueError", receiver
    assert receiver["after"] == [0, 1, 2], receiver
    assert sender["echo"] == [2.0 * i for i in range(200)]


def _recv_nothing(rank: int, group: str) -> Dict[str, Any]:
    x = np.zeros(2)
    raycoll.send(x, dst=1, group=group) if rank == 0 else raycoll.recv(x, src=0, group=group)
    if rank == 1:
        began = time.monotonic()
        try:
            raycoll.recv(x, src=0, group=group, tag=3)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"type": type(exc).__name__, "msg": str(exc),
                    "took": time.monotonic() - began}
    return {"type": None}


@pytest.mark.timeout(240)
def test_a_killed_peer_and_a_timeout_across_nodes_end_the_receive_with_named_errors(two_nodes,
                                                                                     tmp_path):
    team = _actors([0, 1])
    name, slow = f"p2pkill-{uuid.uuid4().hex[:6]}", f"p2pslow-{uuid.uuid4().hex[:6]}"
    try:
        raycoll.create_group(team, group_name=name, timeout=120)
        raycoll.create_group(team, group_name=slow, timeout=3)
        timed = ray.get([a.run.remote(_recv_nothing, r, (slow,), {})
                         for r, a in enumerate(team)], timeout=120)[1]
        assert timed["type"] == "DistTimeoutError", timed
        assert "got no message" in timed["msg"] and 2 < timed["took"] < 60, timed
        got = _kill_rank_1_mid_receive(team, name, tmp_path)
        assert got["type"] == "RankFailedError", got
        assert got["failed"] == [1], got
        assert got["took"] < 60, got  # well within the group's timeout (120 s): no hang
    finally:
        for group in (name, slow):
            raycoll.destroy_group(group)
        for a in team:
            ray.kill(a, no_restart=True)


@pytest.mark.timeout(240)
def test_destroying_the_group_ends_a_receive_waiting_on_the_other_node(two_nodes):
    team = _actors([0, 1])
    name = f"p2pdestroy-{uuid.uuid4().hex[:6]}"
    try:
        raycoll.create_group(team, group_name=name, timeout=120)
        got = ray.get([a.run.remote(_destroy_while_waiting, r, (name,), {})
                       for r, a in enumerate(team)], timeout=180)
    finally:
        raycoll.destroy_group(name)
        for a in team:
            ray.kill(a, no_restart=True)
    for rank, out in enumerate(got):
        assert out["type"] in ("GroupDestroyedError", "GroupBrokenError"), (rank, out)
        assert out["took"] < 60, (rank, out)  # not the group's timeout (120 s): no hang
    assert "left the group" in got[1]["msg"], got[1]
