"""The native core's socket pipes without Ray (raycoll/native/sockpipe.c, sockpipe.h): the
pair pipes' interface over two connected sockets (here ``socket.socketpair``), as
point-to-point across nodes uses it.

- messages keep their order and tags; a small send completes before anyone receives (eager),
  a large one streams while the receiver reads, byte for byte, and waits to be taken;
- a receive whose dtype or shape differ rejects the message: ``MISMATCH`` on the receiver,
  and on the sender of a large message; the pair goes on;
- copies are bounds-checked: a buffer of another size is refused before anything moves;
- failures never hang: a peer's connection closed ends a wait with ``PEER_CLOSED``, a
  goodbye (a write that starts with its two bytes) with ``FOREIGN``, garbage with ``GARBLED``; a
  receive nobody sends to ends when its check raises (a timeout).
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Callable, List, Tuple

import numpy as np
import pytest

from raycoll.native import core, native_status

pytestmark = pytest.mark.skipif(core is None, reason=f"native core: {native_status()}")

WAIT = (0, 2_000_000, 20_000_000, 50_000_000)  # no spin, 2 ms ticks, checks from 20 ms
NO_WAIT = (0, 0, 0, 0)
META = b"float64|4"


def _pair() -> Tuple[Any, Any, List[socket.socket]]:
    ab, ba = socket.socketpair(), socket.socketpair()  # a -> b, b -> a
    a = core.SockPipe(ab[0].fileno(), ba[1].fileno())
    b = core.SockPipe(ba[0].fileno(), -1)
    assert not b.attached
    b.attach_in(ab[1].fileno())  # the peer's connection, once it came
    return a, b, [*ab, *ba]


def _deadline(seconds: float) -> Callable[[float, Any], None]:
    def check(waited_s: float, pending: Any) -> None:
        if waited_s > seconds:
            raise TimeoutError(f"waited {waited_s:.1f} s")
    return check


@pytest.mark.timeout(60)
def test_messages_keep_their_order_and_tags_and_small_sends_complete_at_once():
    a, b, socks = _pair()
    for tag in (1, 2, 3):  # nobody receives yet: each goes at once (eager)
        status, broke, _ = a.send(np.full(4, float(tag)), tag, META, False, False, False,
                                  NO_WAIT, None)
        assert (status, broke) == (core.OK, 0)
    out = np.zeros(4)
    got = b.recv(out, 2, META, WAIT, _deadline(5))  # the next one has tag 1: left there
    assert got[0] == core.PIPE_OTHER and got[1] == 1
    for tag in (1, 2, 3):
        status, tag_got, nbytes, meta, broke, _ = b.peek(True, WAIT, _deadline(5))
        assert (status, tag_got, nbytes, meta) == (core.OK, tag, 32, META)
        assert b.take(out, False, WAIT, _deadline(5))[0] == core.OK
        assert out.tolist() == [float(tag)] * 4
    assert b.peek(False, NO_WAIT, None)[0] == core.PIPE_AGAIN  # nothing more
    for s in socks:
        s.close()


@pytest.mark.timeout(60)
def test_a_large_message_streams_whole_and_a_mismatch_fails_both_sides():
    a, b, socks = _pair()
    n = 3_000_000  # 24 MB: far beyond the sockets' buffers
    data = np.arange(n, dtype=np.float64)
    sent: List[Any] = []
    sender = threading.Thread(target=lambda: sent.extend([
        a.send(data, 7, b"float64|big", True, True, False, WAIT, _deadline(30)),
        a.send(data, 8, b"float64|big", True, True, False, WAIT, _deadline(30)),
        a.send(np.full(2, 5.0), 9, b"float64|2", True, False, False, WAIT, _deadline(30))]))
    sender.start()
    out = np.zeros(n)
    assert b.recv(out, 7, b"float64|big", WAIT, _deadline(30))[0] == core.OK
    assert np.array_equal(out, data)
    got = b.recv(np.zeros(n - 1), 8, b"float64|big", WAIT, _deadline(30))  # another shape
    assert got[0] == core.MISMATCH and got[3] == b"float64|big"
    after = np.zeros(2)
    assert b.recv(after, 9, b"float64|2", WAIT, _deadline(30))[0] == core.OK
    sender.join(30)
    assert [s[0] for s in sent] == [core.OK, core.MISMATCH, core.OK]  # the sender told
    assert after.tolist() == [5.0, 5.0]
    for s in socks:
        s.close()


@pytest.mark.timeout(60)
def test_copies_are_bounds_checked_before_anything_moves():
    a, b, socks = _pair()
    a.send(np.ones(4), 1, META, True, False, False, WAIT, None)
    assert b.peek(True, WAIT, _deadline(5))[2] == 32
    with pytest.raises(ValueError, match="the buffer has 24 bytes, the message 32"):
        b.take(np.zeros(3), False, WAIT, None)
    out = np.zeros(4)
    assert b.take(out, False, WAIT, None)[0] == core.OK and out.tolist() == [1.0] * 4
    with pytest.raises(ValueError, match="meta"):
        a.send(np.ones(1), 1, b"x" * (core.PIPE_META_BYTES + 1), True, False, False, WAIT, None)
    for s in socks:
        s.close()


@pytest.mark.timeout(60)
def test_a_closed_peer_a_goodbye_garbage_and_a_timeout_end_the_wait():
    a, b, socks = _pair()
    status, _, _, _, _, exc = b.peek(True, WAIT, _deadline(0.2))  # nobody sends: the check
    assert status == core.CHECK and isinstance(exc, TimeoutError)
    socks[0].close()  # a's connection to b gone (its process died)
    a.close()
    assert b.peek(True, WAIT, _deadline(5))[0] == core.PEER_CLOSED
    a, b, socks = _pair()
    socks[0].send(b"RC" + bytes(200))  # a goodbye's two bytes leading a longer write
    assert b.peek(True, WAIT, _deadline(5))[0] == core.FOREIGN
    a, b, socks = _pair()
    socks[0].send(bytes(range(128)))  # not a header
    status, _, _, _, broke, _ = b.peek(True, WAIT, _deadline(5))
    assert status == core.GARBLED and broke == 1
    for s in socks:
        s.close()
