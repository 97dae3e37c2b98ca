"""Failures that never corrupt, on real Ray actors (the native executor's failure paths,
raycoll/native/core.h): a rank that fails half-way through a collective, whatever the cause,
leaves every other rank with a named error or the right values, never wrong values, never a
socket error of a descriptor it no longer owns.

- a rank SIGKILLed inside the executor (a stream of large all_reduces), on the node segment
  and on the native sockets: the survivors raise ``RankFailedError`` / ``GroupBrokenError``,
  and every result they returned before was right;
- a check that raises ``KeyboardInterrupt`` or ``SystemExit`` mid-plan on one rank (its peer
  stopped with SIGSTOP, so that it waits inside a call): the interrupted rank re-raises it,
  its next call and its peer's get ``GroupBrokenError``, nothing wrong is returned;
- ``destroy_process_group`` on a rank while its async all_reduce sends inside the executor,
  with another thread opening sockets meanwhile: the call ends with a named error, and not a
  byte of the tensor reaches the new sockets (which may reuse the closed descriptors'
  numbers); the peer fails with a named error, it does not hang.

Skipped where the native core is not built. Synchronisation is by files the ranks write
and the test polls with deadlines, never by sleeping.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
import uuid
from pathlib import Path
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
TRANSPORTS = {"segment": {}, "sockets": {"transport": "tcp", "all_reduce_algo": "ring"}}
BAD = ("RankFailedError", "GroupBrokenError", "GroupDestroyedError", "DistTimeoutError")


@pytest.fixture
def team(ray_local) -> Iterator[List[Any]]:
    actors = [Worker.remote() for _ in range(3)]
    yield actors
    for actor in actors:
        ray.kill(actor, no_restart=True)


@pytest.fixture
def mark_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="rcfail-") as d:
        yield Path(d)


def _poll(what: Any, seconds: float, why: str) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, f"waited {seconds} s for {why}"
        time.sleep(0.01)


def _mark(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _form(team: List[Any], options: Dict[str, Any]) -> str:
    name = f"fail-{uuid.uuid4().hex[:6]}"
    raycoll.create_group(team, group_name=name, timeout=60, options=options)
    return name


def _pid(rank: int) -> int:
    return os.getpid()


def _error(exc: BaseException) -> Dict[str, Any]:
    return {"type": type(exc).__name__, "msg": str(exc),
            "failed": list(getattr(exc, "failed_ranks", ()) or ())}


# ---------------------------------------------------------------------- a rank killed
def _stream(rank: int, group: str, marks: str, n: int) -> Dict[str, Any]:
    """All_reduces of ``n`` float64 until one fails; every result checked."""
    done, wrong = 0, 0
    size = raycoll.get_world_size(group)
    want = float(sum(range(1, size + 1)))
    x = np.empty(n)
    while True:
        x.fill(rank + 1.0)
        try:
            raycoll.all_reduce(x, group=group)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {**_error(exc), "done": done, "wrong": wrong}
        wrong += int(not np.all(x == want))
        done += 1
        if done == 3:
            _mark(f"{marks}/{rank}", "streaming")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_rank_killed_inside_the_executor_fails_its_peers_never_corrupts(team, mark_dir,
                                                                         transport):
    name = _form(team, TRANSPORTS[transport])
    try:
        pids = ray.get([a.run.remote(_pid, r, (), {}) for r, a in enumerate(team)], timeout=60)
        runs = [a.run.remote(_stream, r, (name, str(mark_dir), 1 << 19), {})
                for r, a in enumerate(team)]  # 4 MiB each: several steps a call
        _poll(lambda: all((mark_dir / str(r)).exists() for r in range(3)), 60, "the streams")
        os.kill(pids[2], signal.SIGKILL)
        for got in ray.get(runs[:2], timeout=90):
            assert got["wrong"] == 0, got  # never a wrong value, before or at the failure
            assert got["done"] >= 3 and got["type"] in BAD[:2], got
            if got["type"] == "RankFailedError":
                assert got["failed"] == [2], got
    finally:
        raycoll.destroy_group(name)


# ---------------------------------------------------------------------- an interrupt
def _interrupted(rank: int, group: str, marks: str, exc_name: str) -> Dict[str, Any]:
    """Rank 1: its transport's wait check raises ``exc_name`` (as a signal's handler or a
    ``sys.exit`` would, inside the core's wait); rank 0 streams. Both report every call."""
    pg = world().resolve(group)
    x = np.empty(1 << 19)
    out: Dict[str, Any] = {"done": 0, "wrong": 0}
    if rank == 1:
        x.fill(rank + 1.0)
        raycoll.all_reduce(x, group=group)  # the transport is set up: arm its check
        out["wrong"] += int(not np.all(x == 3.0))
        plane = pg.context._plane
        cls = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[exc_name]

        def check(waited_s: float, pending: Any) -> None:
            raise cls("interrupted inside the core's wait")

        plane._check = check  # the node segment's, or the native sockets'
        _mark(f"{marks}/armed", "1")
    while True:
        x.fill(rank + 1.0)
        try:
            raycoll.all_reduce(x, group=group)
        except BaseException as exc:  # noqa: BLE001 - an interrupt too: reported
            out["first"] = _error(exc)
            break
        out["wrong"] += int(not np.all(x == 3.0))
        out["done"] += 1
    if rank == 1:  # (its interrupted call left it; the next call is below)
        _mark(f"{marks}/interrupted", "1")
    x.fill(rank + 1.0)
    try:  # the next call
        raycoll.all_reduce(x, group=group)
        out["next"] = {"type": None, "ok": bool(np.all(x == 3.0))}
    except BaseException as exc:  # noqa: BLE001 - reported
        out["next"] = _error(exc)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("exc_name", ["KeyboardInterrupt", "SystemExit"])
def test_an_interrupt_inside_the_core_breaks_the_group_on_every_rank(team, mark_dir,
                                                                    transport, exc_name):
    pair = team[:2]
    name = _form(pair, TRANSPORTS[transport])
    try:
        pids = ray.get([a.run.remote(_pid, r, (), {}) for r, a in enumerate(pair)], timeout=60)
        runs = [a.run.remote(_interrupted, r, (name, str(mark_dir), exc_name), {})
                for r, a in enumerate(pair)]
        _poll(lambda: (mark_dir / "armed").exists(), 60, "rank 1 to arm its check")
        os.kill(pids[0], signal.SIGSTOP)  # rank 1 now waits inside a call for rank 0
        try:
            _poll(lambda: (mark_dir / "interrupted").exists(), 60, "the interrupt")
        finally:
            os.kill(pids[0], signal.SIGCONT)
        zero, one = ray.get(runs, timeout=90)
        assert one["first"]["type"] == exc_name, one
        assert one["next"]["type"] == "GroupBrokenError", one
        assert zero["wrong"] == 0 and one["wrong"] == 0, (zero, one)
        assert zero["first"]["type"] in BAD, zero  # at the call it was in, or the next
        assert zero["next"]["type"] in BAD, zero
    finally:
        raycoll.destroy_group(name)


# ---------------------------------------------------------------------- a destroy
def _destroy_mid_send(rank: int, group: str, marks: str) -> Dict[str, Any]:
    """Rank 0: an async 32 MiB all_reduce that rank 1 does not join yet (its sends fill the
    socket buffers: it waits inside the core mid-message), then destroy; meanwhile another
    thread opens socket pairs. Rank 1: waits, then calls."""
    import socket
    import threading

    x = np.ones(4)
    raycoll.all_reduce(x, group=group)  # the connections exist
    if rank == 1:
        _poll(lambda: os.path.exists(f"{marks}/destroyed"), 60, "rank 0's destroy")
        try:
            raycoll.all_reduce(np.ones(1 << 22), group=group)
            return {"type": None}
        except Exception as exc:  # noqa: BLE001 - reported
            return _error(exc)
    big = np.ones(1 << 22)
    work = raycoll.all_reduce(big, group=group, async_op=True)
    plane = world().resolve(group).context._plane
    _poll(lambda: plane._waiting is not None, 30, "the call to wait inside the core")
    pairs: List[Any] = []
    stop = threading.Event()

    def open_sockets() -> None:  # descriptors the closed connections' numbers may go to
        while not stop.is_set() and len(pairs) < 400:
            pairs.append(socket.socketpair())

    opener = threading.Thread(target=open_sockets)
    opener.start()
    raycoll.destroy_process_group(world().resolve(group))
    try:
        work.wait(timeout=60)
        out: Dict[str, Any] = {"type": None}
    except Exception as exc:  # noqa: BLE001 - reported
        out = _error(exc)
    stop.set()
    opener.join(10)
    _mark(f"{marks}/destroyed", "1")
    leaked = 0
    for a, b in pairs:
        for s in (a, b):
            s.setblocking(False)
            try:
                leaked += len(s.recv(1 << 20))
            except BlockingIOError:
                pass
        a.close()
        b.close()
    out["leaked"] = leaked
    out["pairs"] = len(pairs)
    return out


@pytest.mark.timeout(180)
def test_destroy_during_an_async_collective_ends_it_named_and_touches_no_reused_fd(team,
                                                                                  mark_dir):
    pair = team[:2]
    name = _form(pair, {"transport": "tcp", "all_reduce_algo": "direct"})
    try:
        zero, one = ray.get([a.run.remote(_destroy_mid_send, r, (name, str(mark_dir)), {})
                             for r, a in enumerate(pair)], timeout=120)
        assert zero["type"] == "GroupDestroyedError", zero
        assert zero["pairs"] > 0 and zero["leaked"] == 0, zero
        assert one["type"] in BAD, one  # named, not a hang
    finally:
        try:
            raycoll.destroy_group(name)
        except raycoll.RaycollError:
            pass
