"""The native core's pair pipes without Ray (raycoll/native/pipe.c, pipe.h): point-to-point
messages between two processes of one node through shared memory.

- messages keep their order and tags; a small send completes before anyone receives (eager),
  a message larger than the ring streams while the receiver reads, byte for byte;
- a receive whose dtype or shape differ rejects the message: ``MISMATCH`` on the receiver,
  and on the sender of a large message (it waits for its message to be taken);
- every copy is bounds-checked: a buffer of another size is refused before anything moves;
- failures never hang: a peer killed while this side waits ends the wait with ``DEAD``; a
  receiver that fails in the middle of a message breaks the pipe (the sender's wait ends
  with ``ABORTED``); a closed peer ends the wait at once.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import uuid
from typing import Any, Callable, Tuple

import numpy as np
import pytest

from raycoll.native import core, native_status

pytestmark = pytest.mark.skipif(core is None, reason=f"native core: {native_status()}")

RING = 64 << 10
WAIT = (0, 2_000_000, 20_000_000, 50_000_000)  # no spin, 2 ms ticks, checks from 20 ms
NO_WAIT = (0, 0, 0, 0)


def _pair(ring: int = RING) -> Tuple[Any, Any, str]:
    name = f"/rctp{uuid.uuid4().hex[:12]}"
    a = core.Pipe(name, 0, ring, 5.0)
    b = core.Pipe(name, 1, ring, 5.0)
    return a, b, name


def _deadline(seconds: float) -> Callable[[float, Any], None]:
    def check(waited_s: float, pending: Any) -> None:
        if waited_s > seconds:
            raise TimeoutError(f"waited {waited_s:.1f} s")
    return check


def test_messages_keep_their_order_and_tags_and_small_sends_complete_at_once():
    a, b, name = _pair()
    try:
        assert not os.path.exists(f"/dev/shm{name}")  # both mapped it: unlinked
        for i in range(5):  # nobody receives yet: each completes alone (eager)
            status, broke, _ = a.send(np.full(10, i, np.int32), i % 2, b"i32|10", False, False,
                                      False, NO_WAIT, None)
            assert (status, broke) == (core.OK, 0)
        got = np.empty(10, np.int32)
        for i in range(5):
            status, tag, nbytes, meta, _, _ = b.recv(got, i % 2, b"i32|10", WAIT, None)
            assert (status, tag, nbytes, meta) == (core.OK, i % 2, 40, b"i32|10")
            assert got.tolist() == [i] * 10
        # a message of another tag is left in the pipe: peek it, take it whole
        a.send(np.arange(3, dtype=np.int64), 7, b"i64|3", False, False, False, NO_WAIT, None)
        status, tag, nbytes, meta, _, _ = b.recv(np.empty(3, np.int64), 8, b"i64|3", WAIT, None)
        assert (status, tag, nbytes) == (core.PIPE_OTHER, 7, 24)
        assert b.peek(False, NO_WAIT, None)[:3] == (core.OK, 7, 24)
        other = np.empty(3, np.int64)
        assert b.take(other, False, WAIT, None)[0] == core.OK and other.tolist() == [0, 1, 2]
        assert b.peek(False, NO_WAIT, None)[0] == core.PIPE_AGAIN  # nothing left
    finally:
        a.close()
        b.close()


def _stream_sender(name: str, n: int, cma: bool) -> None:
    pipe = core.Pipe(name, 0, RING, 5.0)
    data = np.arange(n, dtype=np.uint32)
    status, _, _ = pipe.send(data, 1, b"u32", True, True, cma, WAIT, _deadline(30))
    os._exit(0 if status == core.OK else 10 + status)


@pytest.mark.parametrize("cma", [False, True], ids=["streamed", "cross-memory"])
def test_a_message_larger_than_the_ring_arrives_whole(cma):
    """Streamed through the ring while the receiver reads, or read from the sender's memory
    (process_vm_readv) where the receiver may."""
    name = f"/rctp{uuid.uuid4().hex[:12]}"
    n = 5 * RING // 4 + 7  # 5x the ring, and not a whole number of lines
    proc = multiprocessing.get_context("fork").Process(target=_stream_sender,
                                                      args=(name, n, cma))
    proc.start()
    pipe = core.Pipe(name, 1, RING, 5.0)
    try:
        got = np.zeros(n, np.uint32)
        status = pipe.recv(got, 1, b"u32", WAIT, _deadline(30))[0]
        assert status == core.OK
        assert np.array_equal(got, np.arange(n, dtype=np.uint32))
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        pipe.close()
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("cma", [False, True], ids=["streamed", "cross-memory"])
def test_a_mismatched_receive_rejects_the_message_on_both_sides_of_a_large_one(cma):
    name = f"/rctp{uuid.uuid4().hex[:12]}"
    n = RING  # 4 x the ring in bytes: the sender waits for it to be taken
    proc = multiprocessing.get_context("fork").Process(target=_stream_sender,
                                                      args=(name, n, cma))
    proc.start()
    pipe = core.Pipe(name, 1, RING, 5.0)
    try:
        status, tag, nbytes, meta, _, _ = pipe.recv(np.zeros(n - 1, np.uint32), 1, b"u32",
                                                    WAIT, _deadline(30))
        assert (status, nbytes, meta) == (core.MISMATCH, 4 * n, b"u32")
        proc.join(30)
        assert proc.exitcode == 10 + core.MISMATCH  # the sender was told
    finally:
        pipe.close()
        if proc.is_alive():
            proc.kill()
    a, b, _ = _pair()
    try:  # a small one: the sender completed already; the receiver says so
        a.send(np.zeros(4, np.float32), 0, b"float32|4", False, False, False, NO_WAIT, None)
        status, _, _, meta, _, _ = b.recv(np.zeros(5), 0, b"float64|5", WAIT, None)
        assert (status, meta) == (core.MISMATCH, b"float32|4")
        a.send(np.ones(2), 0, b"float64|2", False, False, False, NO_WAIT, None)  # it goes on
        assert b.recv(np.zeros(2), 0, b"float64|2", WAIT, None)[0] == core.OK
    finally:
        a.close()
        b.close()


def test_copies_are_bounds_checked_before_anything_moves():
    a, b, _ = _pair()
    try:
        with pytest.raises(ValueError, match="meta"):
            a.send(np.zeros(1), 0, b"x" * (core.PIPE_META_BYTES + 1), False, False, False,
                   NO_WAIT, None)
        a.send(np.arange(4.0), 0, b"f", False, False, False, NO_WAIT, None)
        with pytest.raises(RuntimeError, match="no message was peeked"):
            b.take(np.zeros(4), False, WAIT, None)
        assert b.peek(True, WAIT, None)[:3] == (core.OK, 0, 32)
        with pytest.raises(ValueError, match="the buffer has 24 bytes, the message 32"):
            b.take(np.zeros(3), False, WAIT, None)
        with pytest.raises(ValueError, match="read-only"):  # never written
            b.take(np.frombuffer(bytes(32)), False, WAIT, None)
        got = np.zeros(4)
        assert b.take(got, False, WAIT, None)[0] == core.OK and got.tolist() == [0, 1, 2, 3]
    finally:
        a.close()
        b.close()


def _sleeper(name: str) -> None:
    core.Pipe(name, 0, RING, 5.0)
    time.sleep(60)


def test_a_peer_killed_while_this_side_waits_ends_the_wait_with_dead():
    name = f"/rctp{uuid.uuid4().hex[:12]}"
    proc = multiprocessing.get_context("fork").Process(target=_sleeper, args=(name,))
    proc.start()
    pipe = core.Pipe(name, 1, RING, 5.0)
    try:
        deadline = time.monotonic() + 10
        while pipe.state["peer_pid"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        began = time.monotonic()
        status = pipe.recv(np.zeros(4), 0, b"f", WAIT, _deadline(30))[0]
        assert status == core.DEAD
        assert time.monotonic() - began < 10
    finally:
        pipe.close()
        proc.join(5)


def test_a_receiver_failing_mid_message_breaks_the_pipe_and_the_sender_stops_waiting():
    name = f"/rctp{uuid.uuid4().hex[:12]}"
    n = 4 * RING  # 16 x the ring: the sender waits for room while the receiver fails
    proc = multiprocessing.get_context("fork").Process(target=_stream_sender,
                                                      args=(name, n, False))
    proc.start()
    pipe = core.Pipe(name, 1, RING, 5.0)
    try:
        assert pipe.peek(True, WAIT, _deadline(30))[0] == core.OK  # the message began

        def interrupted(waited_s: float, pending: Any) -> None:
            raise KeyboardInterrupt("mid-message")

        # the ring is full and the sender waits: reading part of it and then failing is
        # what a receiver's interrupt does; here the take's check raises while it waits for
        # bytes that cannot come (the sender is stopped)
        os.kill(proc.pid, signal.SIGSTOP)
        status, broke, exc = pipe.take(np.zeros(n, np.uint32), False, WAIT, interrupted)
        assert (status, broke) == (core.CHECK, 1) and isinstance(exc, KeyboardInterrupt)
        assert pipe.state["abort"] == core.ABORT_FAILED
        os.kill(proc.pid, signal.SIGCONT)
        proc.join(30)
        assert proc.exitcode == 10 + core.ABORTED  # its wait ended: the pipe is broken
    finally:
        pipe.close()
        if proc.is_alive():
            proc.kill()


def test_a_closed_peer_ends_the_wait_at_once():
    a, b, _ = _pair()
    a.close()
    began = time.monotonic()
    status = b.recv(np.zeros(1), 0, b"f", WAIT, _deadline(30))[0]
    assert status == core.ABORTED and b.state["peer_abort"] == core.ABORT_CLOSED
    assert time.monotonic() - began < 5
    b.close()


def test_a_message_sent_before_its_sender_closed_reaches_a_peer_that_comes_later():
    name = f"/rctp{uuid.uuid4().hex[:12]}"
    a = core.Pipe(name, 0, RING, 5.0)
    a.send(np.arange(3.0), 4, b"f", False, False, False, NO_WAIT, None)
    a.close()  # as a group destroyed right after an eager send: the name stays for the peer
    b = core.Pipe(name, 1, RING, 5.0)
    try:
        assert not os.path.exists(f"/dev/shm{name}")  # the peer came: unlinked now
        got = np.zeros(3)
        assert b.recv(got, 4, b"f", WAIT, None)[0] == core.OK and got.tolist() == [0, 1, 2]
        status = b.recv(got, 4, b"f", WAIT, _deadline(30))[0]  # nothing more will come
        assert status == core.ABORTED and b.state["peer_abort"] == core.ABORT_CLOSED
    finally:
        b.close()
    alone = f"/rctp{uuid.uuid4().hex[:12]}"
    c = core.Pipe(alone, 0, RING, 5.0)
    assert os.path.exists(f"/dev/shm{alone}")
    c.close()  # nothing sent, nobody came: nothing left behind
    assert not os.path.exists(f"/dev/shm{alone}")
