"""Point-to-point on the native core's pair pipes (raycoll/transport/pipes.py), on real Ray
actors of one node: the default path where the core is built.

- send/recv/isend/irecv go through the pipes, in order, matched by tag, small sends complete
  before their receive is posted, large ones stream; any-source receives find them;
- a dtype or shape mismatch is a clear ``CollectiveMismatchError`` on the receiver, and on the
  sender too for a large message (which waits to be taken); the pair goes on after it;
- blocking calls of plain arrays take a short path that keeps the full path's matching (a
  receive posted earlier first, messages of other tags kept) and its argument checks;
- a peer killed while a rank waits in a receive fails that receive with ``RankFailedError``
  naming it, well within the call's timeout: no hang.

Skipped where the native core is not built (then point-to-point goes through the coordinator:
test_transport.py).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any, Dict, Iterator, List

import numpy as np
import pytest
import ray

import raycoll
from raycoll.launch import RankWorker
from raycoll.native import native_available, native_status
from raycoll.world import world

pytestmark = pytest.mark.skipif(not native_available(),
                                reason=f"native core: {native_status()}")

Worker = ray.remote(num_cpus=0)(RankWorker)


def _outcome(fn: Any) -> Any:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
        return type(exc).__name__, str(exc)
    return None, ""


def _traffic(rank: int, n: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {"kind": type(world().default.context.pair_pipes()).__name__}
    if rank == 0:
        for tag in (1, 2, 3):  # small: each completes before rank 1 posts a receive
            raycoll.send(np.full(4, float(tag)), dst=1, tag=tag)
        raycoll.send(np.arange(n, dtype=np.float32), dst=1, tag=9)  # streamed, ring x 4+
        works = [raycoll.isend(np.full(2, float(i)), dst=1, tag=5) for i in range(10)]
        for w in works:
            w.wait(timeout=60)
        raycoll.send(np.array([42], np.int64), dst=1, tag=11)
    elif rank == 1:
        time.sleep(0.2)
        got = [np.zeros(4) for _ in range(3)]
        for tag in (3, 1, 2):  # out of order by tag: the others are kept meanwhile
            raycoll.recv(got[tag - 1], src=0, tag=tag)
        out["tags"] = [g.tolist() for g in got]
        big = np.zeros(n, np.float32)
        raycoll.recv(big, src=0, tag=9)
        out["big_ok"] = bool(np.array_equal(big, np.arange(n, dtype=np.float32)))
        bufs = [np.zeros(2) for _ in range(10)]
        works = [raycoll.irecv(b, src=0, tag=5) for b in bufs]
        for w in works:
            w.wait(timeout=60)
        out["order"] = [b[0] for b in bufs]
        anyone = np.zeros(1, np.int64)
        out["any_src"] = raycoll.recv(anyone, tag=11)
        out["any_value"] = int(anyone[0])
    return out


@pytest.mark.timeout(180)
def test_point_to_point_runs_on_the_pipes_in_order_and_by_tag(ranks):
    n = 700_000  # 2.8 MB: more than the ring holds
    got = ranks.run(_traffic, 3, n, timeout=60)
    assert {g["kind"] for g in got} == {"PairPipes"}
    one = got[1]
    assert one["tags"] == [[1.0] * 4, [2.0] * 4, [3.0] * 4]
    assert one["big_ok"]
    assert one["order"] == [float(i) for i in range(10)]
    assert (one["any_src"], one["any_value"]) == (0, 42)


def _mismatch(rank: int, n: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if rank == 0:
        out["small"] = _outcome(lambda: raycoll.send(np.zeros(4, np.float32), dst=1))
        out["large"] = _outcome(lambda: raycoll.send(np.zeros(n, np.float32), dst=1, tag=1))
        raycoll.send(np.full(3, 7.0), dst=1, tag=2)
    elif rank == 1:
        out["small"] = _outcome(lambda: raycoll.recv(np.zeros(5), src=0))
        out["large"] = _outcome(lambda: raycoll.recv(np.zeros(n - 1, np.float32), src=0, tag=1))
        after = np.zeros(3)
        raycoll.recv(after, src=0, tag=2)
        out["after"] = after.tolist()
    return out


@pytest.mark.timeout(180)
def test_a_mismatch_is_named_on_the_receiver_and_on_the_sender_of_a_large_message(ranks):
    n = 100_000  # 400 KB: more than a send completes alone
    sender, receiver = ranks.run(_mismatch, 2, n, timeout=60)
    kind, msg = receiver["small"]
    assert kind == "CollectiveMismatchError", receiver
    assert "the sender sent dtype=float32, shape=(4,)" in msg, msg
    assert "expects dtype=float64, shape=(5,)" in msg, msg
    assert sender["small"] == (None, "")  # it completed before the receive (as torch's)
    kind, msg = receiver["large"]
    assert kind == "CollectiveMismatchError" and f"shape=({n},)" in msg, receiver
    kind, msg = sender["large"]
    assert kind == "CollectiveMismatchError", sender
    assert "the receiver rejected the message" in msg and f"shape=({n},)" in msg, msg
    assert receiver["after"] == [7.0] * 3  # the pair goes on


def _short_path_edges(rank: int) -> Dict[str, Any]:
    """Blocking send/recv of plain arrays take the short path (PairPipes.send_now /
    recv_now); where it cannot serve them (a receive posted earlier, a message kept, a
    view, a read-only array, bad arguments) the full path must, with torch's matching."""
    out: Dict[str, Any] = {}
    x = np.zeros(2)
    raycoll.send(x, dst=1) if rank == 0 else raycoll.recv(x, src=0)  # the pipe is up
    if rank == 0:
        for value in (1.0, 2.0):  # same tag: the earlier irecv must get the first
            raycoll.send(np.full(2, value), dst=1, tag=5)
        raycoll.send(np.full(2, 3.0), dst=1, tag=7)  # kept while tag 8 is received
        raycoll.send(np.full(2, 4.0), dst=1, tag=8)
        raycoll.send(np.arange(6.0).reshape(2, 3), dst=1, tag=np.int64(9))
        raycoll.send(np.arange(3, dtype=np.int32), dst=1)
        out["self"] = _outcome(lambda: raycoll.send(np.zeros(1), dst=0))
        out["stranger"] = _outcome(lambda: raycoll.send(np.zeros(1), dst=5))
        raycoll.barrier()
        for i in range(200):  # back and forth: the short path both ways
            raycoll.send(np.full(1, float(i)), dst=1)
            raycoll.recv(x[:1], src=1)
            out.setdefault("echo", []).append(float(x[0]))
    else:
        first, second = np.zeros(2), np.zeros(2)
        work = raycoll.irecv(first, src=0, tag=5)
        raycoll.recv(second, src=0, tag=5)
        work.wait(timeout=60)
        out["same_tag"] = [first[0], second[0]]
        eight, seven = np.zeros(2), np.zeros(2)
        raycoll.recv(eight, src=0, tag=8)
        raycoll.recv(seven, src=0, tag=7)
        out["kept"] = [eight[0], seven[0]]
        view = np.zeros((2, 6))[:, ::2]  # not contiguous: the full path copies into it
        out["view_src"] = raycoll.recv(view, src=0, tag=9)
        out["view"] = view.tolist()
        frozen = np.zeros(3, np.int32)
        frozen.flags.writeable = False
        out["read_only"] = _outcome(lambda: raycoll.recv(frozen, src=0))
        ok = np.zeros(3, np.int32)
        raycoll.recv(ok, src=0)
        out["after"] = ok.tolist()
        raycoll.barrier()
        got = np.zeros(1)
        for _ in range(200):
            raycoll.recv(got, src=0)
            raycoll.send(got * 2, dst=0)
    return out


@pytest.mark.timeout(180)
def test_the_short_path_of_blocking_calls_keeps_torchs_matching_and_checks(ranks):
    sender, receiver = ranks.run(_short_path_edges, 2, timeout=60)
    assert receiver["same_tag"] == [1.0, 2.0], receiver  # posted order, as torch matches
    assert receiver["kept"] == [4.0, 3.0], receiver
    assert receiver["view_src"] == 0 and receiver["view"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    kind, msg = receiver["read_only"]
    assert kind == "ValueError" and "read-only" in msg, receiver
    assert receiver["after"] == [0, 1, 2], receiver
    assert sender["self"][0] == "ValueError" and "this rank" in sender["self"][1], sender
    assert sender["stranger"][0] == "ValueError" and "dst=5" in sender["stranger"][1], sender
    assert sender["echo"] == [2.0 * i for i in range(200)]


@pytest.fixture
def team(ray_local) -> Iterator[List[Any]]:
    actors = [Worker.remote() for _ in range(2)]
    yield actors
    for actor in actors:
        ray.kill(actor, no_restart=True)


def _pid(rank: int) -> int:
    return os.getpid()


def _wait_then_recv(rank: int, group: str, mark: str) -> Dict[str, Any]:
    x = np.zeros(1 << 16)
    raycoll.send(x, dst=1, group=group) if rank == 0 else raycoll.recv(x, src=0, group=group)
    if rank == 0:  # the pipe is up; rank 0 waits for a message that never comes
        with open(mark, "w") as fh:
            fh.write("waiting")
        began = time.monotonic()
        try:
            raycoll.recv(x, src=1, group=group)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"type": type(exc).__name__, "msg": str(exc),
                    "failed": list(getattr(exc, "failed_ranks", ()) or ()),
                    "took": time.monotonic() - began}
        return {"type": None}
    time.sleep(300)  # killed meanwhile
    return {}


def _kill_rank_1_mid_receive(team: List[Any], name: str, tmp_path: Any) -> Dict[str, Any]:
    """Rank 0 of group ``name`` (over ``team``) waits in a receive from rank 1, whose process
    is then SIGKILLed: rank 0's outcome (:func:`_wait_then_recv`'s)."""
    pids = ray.get([a.run.remote(_pid, r, (), {}) for r, a in enumerate(team)], timeout=60)
    mark = str(tmp_path / "waiting")
    runs = [a.run.remote(_wait_then_recv, r, (name, mark), {}) for r, a in enumerate(team)]
    deadline = time.monotonic() + 60
    while not os.path.exists(mark):
        assert time.monotonic() < deadline, "rank 0 never began its receive"
        time.sleep(0.01)
    time.sleep(0.3)  # rank 0 sleeps in the native wait by now
    os.kill(pids[1], signal.SIGKILL)
    return ray.get(runs[0], timeout=90)


@pytest.mark.timeout(180)
def test_a_peer_killed_while_a_rank_waits_in_a_receive_fails_it_naming_the_rank(team, tmp_path):
    name = f"p2pkill-{uuid.uuid4().hex[:6]}"
    raycoll.create_group(team, group_name=name, timeout=120)
    try:
        got = _kill_rank_1_mid_receive(team, name, tmp_path)
        assert got["type"] in ("RankFailedError", "GroupBrokenError"), got
        if got["type"] == "RankFailedError":
            assert got["failed"] == [1], got
        assert got["took"] < 60, got  # well within the group's timeout (120 s): no hang
    finally:
        raycoll.destroy_group(name)


def _destroy_while_waiting(rank: int, group: str) -> Dict[str, Any]:
    pg = world().resolve(group)
    x = np.zeros(4)
    raycoll.send(x, dst=1, group=group) if rank == 0 else raycoll.recv(x, src=0, group=group)
    began = time.monotonic()
    if rank == 0:  # an async receive that nothing will satisfy, then the group destroyed
        work = raycoll.irecv(x, src=1, group=group)
        time.sleep(0.5)  # it waits inside the pipe by now
        raycoll.destroy_process_group(pg)
        outcome = _outcome(lambda: work.wait(timeout=60))
    else:  # waits for rank 0, which leaves instead
        outcome = _outcome(lambda: raycoll.recv(x, src=0, group=group))
    return {"type": outcome[0], "msg": outcome[1], "took": time.monotonic() - began}


@pytest.mark.timeout(180)
def test_destroying_the_group_ends_a_waiting_receive_on_both_ranks_with_a_named_error(team):
    name = f"p2pdestroy-{uuid.uuid4().hex[:6]}"
    raycoll.create_group(team, group_name=name, timeout=120)
    try:
        got = ray.get([a.run.remote(_destroy_while_waiting, r, (name,), {})
                       for r, a in enumerate(team)], timeout=120)
    finally:
        raycoll.destroy_group(name)
    for rank, out in enumerate(got):
        assert out["type"] in ("GroupDestroyedError", "GroupBrokenError"), (rank, out)
        assert out["took"] < 60, (rank, out)  # not the group's timeout (120 s): no hang
    assert "left the group" in got[1]["msg"], got[1]
