"""The native executor's failure paths without Ray (raycoll/native/exec.c, net.c, segment.c):
what a run does when it fails half-way, whatever its caller does next.

- A check that raises mid-plan (``KeyboardInterrupt``, ``SystemExit``, an error of any class)
  raises the rank's abort flag in C: a peer never completes a step with the data of the
  interrupted rank's next call (it gets ``ABORTED``); a soft error (a peer rejected its
  arguments) in a call's first step leaves the group usable.
- On sockets, a message is accepted only whole: truncated, oversized, cut-and-followed and
  garbage streams, and a goodbye shorter than a header, are each named; a run that leaves a
  message mid-way shuts that connection, so the peer reads its end, never a payload.
- A property-based fuzz of plans (hypothesis): whatever the operations, the executor returns a
  status (run again under AddressSanitizer and UndefinedBehaviorSanitizer by ``.ci/run``).
"""

from __future__ import annotations

import socket
import struct
import threading
import uuid
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raycoll import errors
from raycoll.algorithms import segment_plans as plans
from raycoll.native import CONN_DTYPE, DTYPE_CODES, OP_CODES, core, native_status
from raycoll.transport.links import GOODBYE

pytestmark = pytest.mark.skipif(core is None, reason=f"native core: {native_status()}")

PAGE = 4096
WAIT = (0, 2_000_000, 20_000_000, 50_000_000)  # no spin, 2 ms ticks, checks from 20 ms
F64, SUM = DTYPE_CODES["float64"], OP_CODES["SUM"]


# ---------------------------------------------------------------------- the segment
def _segments(n: int, half: int = PAGE) -> List[Any]:
    name = f"/rct-{uuid.uuid4().hex[:12]}"
    segs = [core.Segment(name, n, 0, half, True)]
    segs += [core.Segment(name, n, r, half, False) for r in range(1, n)]
    core.unlink(name)
    return segs


def _run(seg: Any, ops: Any, bufs: Sequence[Any], seq: int,
         check: Optional[Callable[[float, Tuple[int, ...]], None]] = None) -> Tuple[Any, ...]:
    return seg.run(ops, tuple(bufs), F64, SUM, 1.0, 0, seq, b"fp", WAIT, check)


def _raiser(exc: BaseException) -> Callable[[float, Tuple[int, ...]], None]:
    def check(waited: float, pending: Tuple[int, ...]) -> None:
        raise exc
    return check


def _steps(k: int) -> np.ndarray:
    """A call of ``k`` steps, each rank writing 8 bytes and reducing everyone's."""
    ops = []
    for s in range(k):
        ops.append(plans.write(0, 0, 8, 0))
        ops.append(plans.sync(first=s == 0))
        ops.append(plans.reduce_op(0, 0, 8, 0, False))
    return plans._plan(ops).ops


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3), MemoryError(),
                                 errors.DistTimeoutError("timed out"),
                                 errors.PeerArgumentError("a peer rejected its arguments")])
def test_a_check_that_raises_mid_plan_aborts_in_c_and_the_peer_never_reads_the_next_call(exc):
    """Rank 0 waits in the second step of a three-step call; rank 1 took only the first (its
    call had one step: it is out of step, as a rank interrupted mid-call would leave it).
    Rank 0's check raises: whatever its class, the core raised rank 0's abort flag, so rank
    1's next call, which publishes the step rank 0 is waiting on, fails instead of reading
    rank 0's data of another call as its own."""
    seg0, seg1 = _segments(2)
    try:
        x0, x1 = np.full(1, 1.0), np.full(1, 2.0)
        got: List[Any] = []

        def check(waited: float, pending: Tuple[int, ...]) -> None:
            if seg0.step >= 2:  # waiting in the second step (in the first: wait on)
                raise exc

        t = threading.Thread(target=lambda: got.append(_run(seg0, _steps(3), [x0], 1, check)))
        t.start()
        assert _run(seg1, _steps(1), [x1], 1)[:2] == (0, -1)
        t.join(10)
        status, _, _, broke, raised = got[0]
        assert status == core.CHECK and raised is exc and broke == 1
        assert seg1.info(0, 0)["abort"] == core.ABORT_FAILED
        y = np.full(1, 5.0)
        status, peer, _, _, _ = _run(seg1, _steps(1), [y], 2)
        assert (status, peer) == (core.ABORTED, 0)
        assert y.tolist() == [5.0]  # nothing of rank 0's was read into it
    finally:
        for seg in (seg0, seg1):
            seg.close()


def test_a_soft_error_in_the_first_step_leaves_the_group_usable():
    """A check that raises ``PeerArgumentError`` while the call waits in its first step (the
    peer rejected its arguments and takes no step for it) sets no abort flag: the peer's next
    call meets the left step at a later call and both go on."""
    seg0, seg1 = _segments(2)
    try:
        x0 = np.full(1, 1.0)
        status, _, _, broke, raised = _run(
            seg0, _steps(2), [x0], 1, _raiser(errors.PeerArgumentError("rank 1 rejected")))
        assert status == core.CHECK and isinstance(raised, errors.PeerArgumentError)
        assert broke == 0 and seg1.info(0, 0)["abort"] == 0
        out: List[Any] = [None, None]

        def rank0() -> None:
            out[0] = (_run(seg0, _steps(2), [x0], 2), x0.tolist())

        t = threading.Thread(target=rank0)
        t.start()
        y = np.full(1, 2.0)
        first = _run(seg1, _steps(2), [y], 2)  # meets rank 0's step of call 1: stands in, again
        t.join(10)
        assert first[:2] == (0, -1) and out[0][0][:2] == (0, -1)
        assert y.tolist() == [6.0] and out[0][1] == [6.0]  # (1 + 2) twice, on both
    finally:
        for seg in (seg0, seg1):
            seg.close()


# ---------------------------------------------------------------------- the sockets
HEADER = struct.Struct("<IIQQQ")  # magic, step, call_seq, fingerprint hash, bytes
TRAILER = struct.Struct("<IIQQ")  # magic, step, call_seq, bytes


def _message(payload: bytes, seq: int = 1, step: int = 0, fp: int = 7,
             nbytes: Optional[int] = None, end: Optional[bytes] = None) -> bytes:
    n = len(payload) if nbytes is None else nbytes
    trailer = TRAILER.pack(core.END_MAGIC, step, seq, n) if end is None else end
    return HEADER.pack(core.MSG_MAGIC, step, seq, fp, n) + payload + trailer


class _Pair:
    """One connection each way between rank 0 (the test, writing raw bytes) and rank 1 (the
    core), as socket pairs; rank 1's out / in descriptors and connection state."""

    def __init__(self) -> None:
        self.to1, self.at1 = socket.socketpair()  # rank 0 writes to1, the core reads at1
        self.from1, self.at0 = socket.socketpair()  # the core writes from1, rank 0 reads at0
        for s in (self.to1, self.at1, self.from1, self.at0):
            s.setblocking(False)
        self.conns = np.zeros(2, CONN_DTYPE)

    def net(self) -> tuple:
        return (np.array([-1, self.from1.fileno()], np.int64),
                np.array([-1, self.at1.fileno()], np.int64), self.conns, 7)

    def recv(self, dst: np.ndarray, seq: int = 1, check: Any = None) -> Tuple[Any, ...]:
        ops = np.array([(core.OP_RECV, 0, 0, dst.nbytes, 1, 0, 0, 0),
                        (core.OP_XFER, 0, 0, 0, 0, 0, 0, 0)], np.int64)
        return core.execute(None, ops, (dst,), 0, 0, 1.0, 0, seq, b"", WAIT,
                            check or _deadline(2.0), self.net())

    def close(self) -> None:
        for s in (self.to1, self.at1, self.from1, self.at0):
            s.close()


def _deadline(seconds: float) -> Callable[[float, Tuple[int, ...]], None]:
    def check(waited: float, pending: Tuple[int, ...]) -> None:
        if waited > seconds:
            raise TimeoutError(f"nothing came in {seconds} s")
    return check


@pytest.mark.parametrize("case", ["truncated", "oversized", "cut_then_another", "bad_trailer",
                                  "garbage", "short_goodbye", "whole"])
def test_a_message_is_accepted_only_whole(case):
    pair = _Pair()
    try:
        payload = bytes(range(8)) * 8  # 64 bytes
        if case == "truncated":  # its sender died half-way
            pair.to1.sendall(_message(payload)[:HEADER.size + 20])
            pair.to1.close()
            want = core.PEER_CLOSED
        elif case == "oversized":  # a header claiming more than any message may carry
            pair.to1.sendall(HEADER.pack(core.MSG_MAGIC, 0, 1, 7, 1 << 60))
            want = core.GARBLED
        elif case == "cut_then_another":  # half a message, then a whole one of the next call
            pair.to1.sendall(_message(payload)[:HEADER.size + 30] + _message(payload, seq=2))
            want = core.GARBLED
        elif case == "bad_trailer":
            pair.to1.sendall(_message(payload, end=TRAILER.pack(core.END_MAGIC, 0, 9, 64)))
            want = core.GARBLED
        elif case == "garbage":
            pair.to1.sendall(b"\xde\xad\xbe\xef" * 40)
            want = core.GARBLED
        elif case == "short_goodbye":  # what a rank writes as it closes (links.close), the end
            pair.to1.sendall(GOODBYE)
            pair.to1.close()
            want = core.FOREIGN
        else:
            pair.to1.sendall(_message(payload))
            want = core.OK
        dst = np.zeros(64, np.uint8)
        status, peer, _, broke, exc = pair.recv(dst)
        assert exc is None and status == want, (case, status)
        if want == core.OK:
            assert dst.tobytes() == payload
            return
        assert peer == 1 and broke == 1
        # the connection was shut by the core: nothing reads or writes it again
        assert pair.conns["in_cut"][1] == 1
        status, _, _, _, _ = pair.recv(np.zeros(64, np.uint8), seq=2)
        assert status == core.BADPLAN
    finally:
        pair.close()


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), errors.PeerArgumentError("rejected")])
def test_a_send_left_mid_way_shuts_its_connection_so_the_peer_reads_its_end(exc):
    """The core sends rank 0 a message larger than the socket buffers while rank 0 does not
    read; the check raises. Soft or not, the stream lost its framing: the core shuts the
    connection and says the group broke; rank 0 reads part of a message and then the end
    of the stream, never another message's bytes where the rest should be."""
    pair = _Pair()
    try:
        big = np.full(4 << 20, 7, np.uint8)
        ops = np.array([(core.OP_SEND, 0, 0, big.nbytes, 1, 0, 0, 0),
                        (core.OP_XFER, 0, 0, 0, 0, 0, 0, 0)], np.int64)
        status, _, _, broke, raised = core.execute(None, ops, (big,), 0, 0, 1.0, 0, 1, b"",
                                                   WAIT, _raiser(exc), pair.net())
        assert status == core.CHECK and raised is exc and broke == 1
        got = bytearray()
        pair.at0.setblocking(True)
        pair.at0.settimeout(5)
        while True:
            chunk = pair.at0.recv(1 << 20)
            if not chunk:
                break
            got += chunk
        assert HEADER.size < len(got) < HEADER.size + big.nbytes + TRAILER.size
        magic, _, seq, _, nbytes = HEADER.unpack(bytes(got[:HEADER.size]))
        assert (magic, seq, nbytes) == (core.MSG_MAGIC, 1, big.nbytes)
    finally:
        pair.close()


# ---------------------------------------------------------------------- plans, fuzzed
KINDS = list(range(0, 15))
_word = st.one_of(st.integers(-3, 6), st.integers(0, 4200), st.sampled_from(
    [-(1 << 62), (1 << 62), (1 << 63) - 1, -(1 << 63), 1 << 32, 4095, 4096, 8191]))
_op = st.tuples(st.sampled_from(KINDS), st.integers(-3, 5), _word, _word, st.integers(-3, 3),
                _word, st.one_of(st.integers(0, 3), _word), st.one_of(st.integers(0, 3), _word))


@settings(max_examples=400, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, min_size=1, max_size=10),
       sizes=st.lists(st.integers(0, 5000), min_size=0, max_size=4),
       readonly=st.integers(0, 15), dtype=st.integers(-1, 17), op=st.integers(-1, 10))
def test_any_plan_returns_a_status(ops, sizes, readonly, dtype, op):
    """Whatever the operations (kinds, buffer ids, offsets, counts, peers, flags), the
    executor checks them before anything moves, or runs them within their bounds: a status,
    never a crash (the sanitizer run makes any out-of-bounds access or undefined behaviour
    fatal). One rank on its own segment, its sockets joined to itself."""
    seg = _segments(1)[0]
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        b.setblocking(False)
        bufs = []
        for i, n in enumerate(sizes):
            arr = np.arange(n, dtype=np.uint8)
            if readonly & (1 << i):
                arr.setflags(write=False)
            bufs.append(arr)
        net = (np.array([a.fileno()], np.int64), np.array([b.fileno()], np.int64),
               np.zeros(1, CONN_DTYPE), 7)
        plan = np.array(ops, dtype=np.int64)
        status, peer, _, broke, exc = core.execute(seg, plan, tuple(bufs), dtype, op, 2.0, 2, 1,
                                                   b"fp", WAIT, _deadline(0.05), net)
        assert isinstance(status, int) and isinstance(peer, int)
        assert status == core.OK or status > 0
        assert exc is None or isinstance(exc, TimeoutError)
    finally:
        a.close()
        b.close()
        seg.close()
