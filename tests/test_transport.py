"""Direct connections between ranks (raycoll/transport/links.py, native_tcp.py) on one node:
collectives with ``transport="tcp"`` (on the native sockets; without the native core, through
the object store), point-to-point (direct on the pair pipes; without the native core, through
the coordinator), security, garbled frames, failures and
file descriptors."""

from __future__ import annotations

import os
import socket
import struct
import time
import uuid
from typing import Any, Dict, List

import numpy as np
import pytest
import ray

from helpers import every_op

import raycoll
from raycoll.native import core, native_available, native_status
from raycoll.world import world


def _outcome(fn: Any) -> Any:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, "", time.monotonic() - start


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [5, 300_000], ids=["small", "large"])
def test_every_collective_and_p2p_over_tcp_match_numpy(ranks, n):
    results = ranks.run(every_op, 3, 3, n, options={"transport": "tcp"}, timeout=120)
    for rank, (bad, transport) in enumerate(results):
        # the native sockets; without the native core, the object store
        assert transport == ("tcp" if core is not None else "store"), (rank, transport)
        assert bad == [], (rank, bad)


def _pair_pipes_used(rank: int) -> Any:
    x = np.full(4, float(rank))
    if rank == 0:
        raycoll.send(x, dst=1)
    elif rank == 1:
        raycoll.recv(x, src=0)
    return world().default.context.pair_pipes() is not None, x.tolist()


@pytest.mark.timeout(120)
def test_point_to_point_goes_straight_between_the_pair(ranks):
    results = ranks.run(_pair_pipes_used, 3)
    # on the pair pipes where the native core runs; without it, through the coordinator
    assert all(direct == (core is not None) for direct, _ in results)
    assert results[1][1] == [0.0] * 4
    stored = ranks.run(_pair_pipes_used, 3, options={"transport": "store"})
    assert not any(direct for direct, _ in stored)  # forced through the coordinator
    assert stored[1][1] == [0.0] * 4


def _send_send(rank: int, n: int) -> Any:
    """Both ranks send first, then receive: small sends complete once handed over."""
    if rank > 1:
        return None
    mine = np.full(n, float(rank))
    got = np.zeros(n)
    raycoll.send(mine, dst=1 - rank)
    raycoll.recv(got, src=1 - rank)
    return float(got[0])


@pytest.mark.timeout(120)
def test_a_send_send_exchange_of_small_messages_does_not_deadlock(ranks):
    assert ranks.run(_send_send, 3, 1000)[:2] == [1.0, 0.0]


def _posted_late(rank: int, n: int) -> Any:
    """Rank 1 begins reading each big message before its receive is posted (a small one
    right ahead of it is what it waits for), then rank 2 reads rank 0's and rank 1's big
    messages at once, in parts that interleave."""
    if rank == 0:
        raycoll.send(np.ones(2), dst=1)
        raycoll.send(np.arange(n, dtype=np.float64), dst=1, tag=3)
    if rank == 1:
        time.sleep(0.5)  # both messages wait in the kernel: the first read takes both starts
        small, big = np.empty(2), np.empty(n)
        raycoll.recv(small, src=0)
        raycoll.recv(big, src=0, tag=3)
        got = [small.tolist(), float(big.sum())]
    if rank < 2:
        raycoll.send(np.full(n, float(rank + 1)), dst=2, tag=rank)
        return got if rank == 1 else None
    bufs = [np.empty(n), np.empty(n)]
    works = [raycoll.irecv(bufs[1], tag=1), raycoll.irecv(bufs[0], tag=0)]
    sources = [w.wait(timeout=60) and w.source_rank() for w in works]
    return sources, [float(b.min()) for b in bufs], [float(b.max()) for b in bufs]


@pytest.mark.timeout(120)
def test_a_message_read_before_its_receive_is_posted_reaches_that_receive(ranks):
    n = 400_000  # 3.2 MB: more than the socket buffers hold
    _, first, third = ranks.run(_posted_late, 3, n)
    assert first == [[1.0, 1.0], float(n * (n - 1) // 2)]
    assert third == ([1, 0], [1.0, 2.0], [1.0, 2.0])


def _p2p_errors(rank: int) -> Any:
    if rank == 0:
        raycoll.send(np.zeros(4, dtype=np.float32), dst=1)
        return None
    if rank == 1:
        out = {"mismatch": _outcome(lambda: raycoll.recv(np.zeros(5), src=0))}
        out["timeout"] = _outcome(lambda: raycoll.irecv(np.zeros(4), src=2, tag=3).wait())
        return out
    return None


@pytest.mark.timeout(120)
def test_p2p_mismatch_and_timeout_are_named_on_the_receiver(ranks):
    got = ranks.run(_p2p_errors, 3, timeout=6.0)[1]
    kind, msg, _ = got["mismatch"]
    assert kind == "CollectiveMismatchError", got
    assert "the sender sent dtype=float32, shape=(4,)" in msg and "expects dtype=float64" in msg
    kind, msg, took = got["timeout"]
    assert kind == "DistTimeoutError", got
    assert "from rank 2 (tag 3)" in msg and "got no message within 6s" in msg, msg
    assert took < 15


def _address_and_use(rank: int, hold_s: float) -> Any:
    ctx = world().default.context
    x = np.ones(8)
    raycoll.all_reduce(x)
    addr = ctx.addresses[rank]
    time.sleep(hold_s)  # the test connects to our port meanwhile
    raycoll.all_reduce(x)
    return tuple(addr), float(x[0])


def _stranger(where: Any, payload: bytes) -> bytes:
    """Connect to a rank's port (or its Unix socket), send ``payload``, return what comes
    back before the connection is closed (nothing for a refused stranger)."""
    if isinstance(where, str):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(where)
    else:
        s = socket.create_connection(where, timeout=5)
    with s:
        s.settimeout(15)
        try:
            s.sendall(payload)
            return s.recv(100)
        except (ConnectionResetError, BrokenPipeError):
            return b""


@pytest.mark.timeout(120)
def test_a_stranger_connecting_to_a_rank_is_closed_and_the_group_goes_on(rank_actors):
    team = rank_actors[:2]
    name = f"tcp-{uuid.uuid4().hex[:8]}"
    raycoll.create_group(team, group_name=name, options={"transport": "tcp"}, timeout=30)
    try:
        results = ray.get([a.run.remote(_address_and_use, r, (0.0,), {})
                           for r, a in enumerate(team)], timeout=60)
        host, port, unix = results[0][0]
        assert host == "127.0.0.1" and unix
        # garbage, a hello with a wrong secret, and a hello naming the group with a wrong one,
        # to the TCP port and to the Unix socket
        for where in ((host, port), unix):
            for payload in (b"GET / HTTP/1.0\r\n\r\n" * 4,
                            struct.pack("!4s16sIBH", b"RCL1", b"\0" * 16, 1, 0, len(name))
                            + name.encode() + b"\xff" * 1000,
                            os.urandom(5000)):
                assert _stranger(where, payload) == b""
        assert [r[1] for r in results] == [4.0, 4.0]
        # and the group still works after the strangers
        again = ray.get([a.run.remote(_address_and_use, r, (0.0,), {})
                         for r, a in enumerate(team)], timeout=60)
        assert [r[1] for r in again] == [4.0, 4.0]
    finally:
        raycoll.destroy_group(name)


def _garble(rank: int) -> Any:
    ctx = world().default.context
    x = np.ones(4)
    raycoll.all_reduce(x)  # connections are up
    if rank == 1:  # on the connection the collectives use (the native core's)
        out = ctx._transports.links.outgoing(0, "ncoll", 10.0)
        out.sock.setblocking(True)
        out.sock.sendall(b"\xde\xad" * 64)  # not a frame
        out.sock.setblocking(False)
    first = _outcome(lambda: raycoll.all_reduce(x))
    return first, _outcome(lambda: raycoll.all_reduce(x)), x.tolist()


@pytest.mark.timeout(120)
@pytest.mark.skipif(core is None, reason=f"collectives on sockets are native: {native_status()}")
def test_a_garbled_frame_breaks_the_group_with_a_clear_error_on_every_rank(ranks):
    """Rank 0 reads garbage from rank 1: it breaks the group saying so. Rank 1 got rank 0's
    whole message, so its call may complete (with the right data); its next one fails."""
    (r0, r0_next, _), (r1, r1_next, r1_data) = ranks.run(_garble, 2,
                                                         options={"transport": "tcp"})
    assert r0[0] == "GroupBrokenError" and "garbled frame" in r0[1], r0
    assert r0_next[0] == "GroupBrokenError", r0_next
    if r1[0] is None:
        assert r1_data == [4.0] * 4  # 2 + 2: never wrong data
    else:
        assert r1[0] == "GroupBrokenError", r1
    assert r1_next[0] == "GroupBrokenError", r1_next
    assert all(took < 15 for _, _, took in (r0, r0_next, r1, r1_next))


def _fds(rank: int) -> int:
    return len(os.listdir("/proc/self/fd"))


def _traffic(rank: int, group: Any = None) -> float:
    x = np.full(3, float(rank))
    raycoll.all_reduce(x, group=group)
    if rank == 0:
        raycoll.send(x, dst=1, group=group)
    elif rank == 1:
        raycoll.recv(np.zeros(3), src=0, group=group)
    return float(x[0])


def _fds_then_traffic(rank: int) -> Any:
    """This process's fds as the group starts (none of its connections open yet), then
    :func:`_traffic`."""
    return _fds(rank), _traffic(rank)


def _subgroups(rank: int, times: int) -> Any:
    """Form, use and destroy a subgroup ``times`` times; this process's fds before/after."""
    _traffic(rank)
    before = _fds(rank)
    for _ in range(times):
        sub = raycoll.new_group([0, 1])
        assert _traffic(rank, sub) == 1.0
        raycoll.destroy_process_group(sub)
    return before, _fds(rank)


@pytest.mark.timeout(300)
def test_re_forming_a_group_100_times_leaks_no_file_descriptor(ranks):
    """A group's sockets close with it: 100 subgroups formed, used (collective and
    point-to-point, each its own connections) and destroyed, then root groups re-formed
    from the driver (each with a new coordinator, so fewer), leave every rank's file
    descriptors where they were."""
    for before, after in ranks.run(_subgroups, 2, 100, options={"transport": "tcp"}):
        assert after <= before, (before, after)
    ranks.run(_traffic, 2, options={"transport": "tcp"})  # the listeners are up
    # each rank's descriptors counted as each group starts, before it carries anything
    before = [fds for fds, _ in ranks.run(_fds_then_traffic, 2, options={"transport": "tcp"})]
    for _ in range(5):
        got = ranks.run(_fds_then_traffic, 2, options={"transport": "tcp"})
        assert [value for _, value in got] == [1.0, 1.0]
    after = [fds for fds, _ in got]
    # (Ray's own connections to the coordinators come and go: a little slack, not a trend)
    assert all(a <= b + 2 for a, b in zip(after, before)), (before, after)


def test_a_peer_whose_data_is_still_unread_counts_as_closed_once_it_closed():
    """A dead peer's last frames may still sit unread in this rank's buffer: it is
    suspected all the same (a peek would see its data, not the end); a live peer with
    unread data is not."""
    from raycoll.transport.links import Links

    links = Links(key=f"closed-{uuid.uuid4().hex[:8]}", rank=0, size=3, secret=b"s",
                  addresses=[None] * 3, nodes=["n"] * 3)
    ends = {}
    try:
        for src in (1, 2):
            mine, theirs = socket.socketpair()
            theirs.sendall(b"frame" * 1000)
            links.accepted(src, "ncoll", mine)
            ends[src] = theirs
        assert links.closed_peers() == []
        ends.pop(1).close()
        assert links.closed_peers() == [1]
    finally:
        links.close()
        for sock in ends.values():
            sock.close()


def _fallback_warnings(rank: int, name: str) -> Any:
    """Two all_reduces, each on a new subgroup of group ``name`` (the first in this process
    warns, the next does not), with the warnings each raised and where the data went."""
    import warnings

    import raycoll.native

    out = []
    for _ in range(2):  # a group of its own each time: the second does not warn again
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = np.full(3, float(rank + 1))
            sub = raycoll.new_group([0, 1])
            raycoll.all_reduce(x, group=sub)
        out.append([str(w.message) for w in caught if w.category is RuntimeWarning])
    return out, x.tolist(), sub.transport_name, raycoll.native.native_status()


@pytest.mark.timeout(120)
def test_a_rank_without_the_native_core_sends_the_group_through_the_store_warning_once():
    """One rank has the native core turned off: the group's collectives go through the object
    store (the one fallback) on every rank, and each process says so once, naming why: the
    rank without the core its own reason, the other that a rank of the group lacks it."""
    from raycoll.launch import RankWorker

    if not native_available():  # (RAYCOLL_NATIVE=0 here reaches every rank: none has it)
        pytest.skip(f"needs the native core in this process: {native_status()}")

    worker = ray.remote(num_cpus=0)(RankWorker)
    team = [worker.options(runtime_env={"env_vars": {"RAYCOLL_NATIVE": "0"}}).remote(),
            worker.remote()]
    name = f"fallback-{uuid.uuid4().hex[:8]}"
    raycoll.create_group(team, group_name=name, timeout=60)
    try:
        got = ray.get([a.run.remote(_fallback_warnings, r, (name,), {})
                       for r, a in enumerate(team)], timeout=90)
    finally:
        raycoll.destroy_group(name)
        for a in team:
            ray.kill(a)
    (off_warned, off_x, off_via, off_status), (on_warned, on_x, on_via, on_status) = got
    assert off_x == on_x == [3.0] * 3
    assert off_via == on_via == "store"
    assert off_status == "turned off by RAYCOLL_NATIVE=0" and on_status == "in use"
    assert len(off_warned[0]) == 1 and off_warned[1] == [], off_warned
    assert "Ray object store" in off_warned[0][0] and "RAYCOLL_NATIVE=0" in off_warned[0][0]
    assert len(on_warned[0]) == 1 and on_warned[1] == [], on_warned
    assert "a rank of the group runs without the native core" in on_warned[0][0]
