"""raycoll's native core without Ray (raycoll/native/): every reduction against numpy, the node
segment's plans run by threads and by processes of this test (each a rank), its bounds
checks, mismatches, rejections, a dead peer named at once, its file gone once mapped, a
/dev/shm too small for it, and cross-memory reads of another process (``cma_read``). Skipped, with the reason, where the extension is not built."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Callable, List, Sequence

import numpy as np
import pytest

from raycoll.algorithms import segment_plans as plans
from raycoll.native import DTYPE_CODES, OP_CODES, core, native_status
from raycoll.reduce_op import ReduceOp, check_op_dtype, combine, finalize

pytestmark = pytest.mark.skipif(core is None, reason=f"native core: {native_status()}")

PAGE = 4096
WAIT = (0, 2_000_000, 50_000_000, 200_000_000)  # no spin, 2 ms ticks, checks from 50 ms


def _name() -> str:
    return "/rct" + uuid.uuid4().hex[:20]


def _random(dtype: np.dtype, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype.kind == "b":
        return rng.integers(0, 2, n).astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(n) * 100 + 1j * rng.standard_normal(n) * 100).astype(dtype)
    a = (rng.standard_normal(n) * 100).astype(dtype)
    a[3] = np.nan
    a[5] = np.inf
    return a


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype.kind in "fc":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "longdouble", "complex64", "complex128"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_reduction_equals_numpys_rank_ordered_one(dtype):
    d = np.dtype(dtype)
    tried = 0
    for name, code in OP_CODES.items():
        op = ReduceOp("PREMUL_SUM", 0.37) if name == "PREMUL_SUM" else ReduceOp(name)
        try:
            check_op_dtype(op, d)
        except ValueError:
            assert not core.supported(DTYPE_CODES[d], code) or d.kind == "c", (dtype, name)
            continue
        if d.kind == "c" and name != "SUM":
            continue  # numpy's complex products and divisions: left to numpy
        srcs = [_random(d, 1001, seed) for seed in range(4)]
        want = srcs[0].copy()
        with np.errstate(all="ignore"):
            for s in srcs[1:]:
                combine(op, want, s)
            finalize(op, want, 4)
        got = np.empty_like(want)
        with np.errstate(all="ignore"):
            core.reduce(DTYPE_CODES[d], code, got, srcs)
            core.finalize(DTYPE_CODES[d], code, got, 4 if name == "AVG" else 0,
                          op.factor or 1.0)
        assert _same(got, want), (dtype, name)
        tried += 1
    assert tried >= (1 if d.kind == "c" else 3)


def test_bfloat16_rounds_to_nearest_even_through_float32():
    rng = np.random.default_rng(1)
    vals = [rng.standard_normal(999).astype(np.float32) * 10 for _ in range(3)]

    def to_bf16(x: np.ndarray) -> np.ndarray:  # round to nearest even, as torch does
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.astype(np.uint16)

    def from_bf16(b: np.ndarray) -> np.ndarray:
        return (b.astype(np.uint32) << 16).view(np.float32)

    srcs = [to_bf16(v) for v in vals]
    want = srcs[0]
    for s in srcs[1:]:
        want = to_bf16(from_bf16(want) + from_bf16(s))
    got = np.empty_like(srcs[0])
    core.reduce(DTYPE_CODES["bfloat16"], OP_CODES["SUM"], got, srcs)
    assert np.array_equal(got, want)


def test_reduce_refuses_bad_buffers():
    a = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="bytes"):
        core.reduce(DTYPE_CODES["float32"], OP_CODES["SUM"], a, [a, np.ones(3, np.float32)])
    with pytest.raises(ValueError, match="no native reduction"):
        core.reduce(DTYPE_CODES["float32"], OP_CODES["BAND"], a, [a, a])
    with pytest.raises((BufferError, ValueError), match="read-only"):
        ro = np.ones(4, np.float32)
        ro.setflags(write=False)
        core.reduce(DTYPE_CODES["float32"], OP_CODES["SUM"], ro, [a, a])


# ---------------------------------------------------------------------- segments in threads
def _open(name: str, n: int, r: int, half: int) -> Any:
    return core.Segment(name, n, r, half, r == 0)


def _in_threads(n: int, body: Callable[[int, Any], Any], half: int = 4 * PAGE) -> List[Any]:
    """Run ``body(rank, segment)`` in ``n`` threads sharing one segment; their results."""
    name = _name()
    created = threading.Event()
    results: List[Any] = [None] * n
    errors: List[BaseException] = []

    def rank(r: int) -> None:
        try:
            if r:
                assert created.wait(10)
            seg = _open(name, n, r, half)
            if r == 0:
                created.set()
            try:
                results[r] = body(r, seg)
            finally:
                seg.close()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            created.set()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    core.unlink(name)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def _run(seg: Any, plan: plans.Plan, bufs: Sequence[Any], dtype: int = 0, op: int = 0,
         divisor: int = 0, seq: int = 1, fp: bytes = b"fp", check: Any = None) -> Any:
    status, peer, _, _, exc = seg.run(plan.ops, tuple(bufs), dtype, op, 1.0, divisor, seq, fp,
                                      WAIT, check)
    if exc is not None:
        raise exc
    return status, peer


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("count", [1, 7, 1000, 20_000])
def test_all_reduce_plans_small_and_streamed(n, count):
    half = 4 * PAGE  # 20,000 float64 stream through many steps
    code = DTYPE_CODES["float64"]

    def body(r: int, seg: Any) -> Any:
        out = []
        for one_step in (0, 1 << 20):
            x = np.arange(count, dtype=np.float64) * (r + 1)
            plan = plans.all_reduce(count, 8, n, r, half, one_step)
            assert _run(seg, plan, [x], code, OP_CODES["AVG"], n) == (0, -1)
            out.append(x)
        red = np.full(count, r + 1.0)
        assert _run(seg, plans.reduce(count, 8, n, r, half, 0, 1), [red], code,
                    OP_CODES["MAX"]) == (0, -1)
        out.append(red)
        return out

    want = np.arange(count, dtype=np.float64) * sum(range(1, n + 1)) / n
    for r, (a, b, red) in enumerate(_in_threads(n, body, half)):
        assert np.array_equal(a, want) and np.array_equal(b, want)
        assert np.array_equal(red, np.full(count, float(n) if r == 1 else r + 1.0))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("nbytes", [0, 3, 5000, 50_000])
def test_data_movement_plans(n, nbytes):
    half = 2 * PAGE

    def body(r: int, seg: Any) -> Any:
        mine = np.full(nbytes, r + 1, dtype=np.uint8)
        b = mine.copy() if r == 1 else np.zeros(nbytes, np.uint8)
        assert _run(seg, plans.broadcast(nbytes, n, r, half, 1), [b]) == (0, -1)
        g = np.zeros(n * nbytes, np.uint8)
        assert _run(seg, plans.all_gather(nbytes, n, r, half), [mine, g]) == (0, -1)
        whole = np.concatenate([np.full(nbytes, 10 * j + r, np.uint8) for j in range(n)])
        s = np.zeros(nbytes, np.uint8)
        assert _run(seg, plans.scatter(nbytes, n, r, half, 0), [whole, s]) == (0, -1)
        s2 = np.zeros(nbytes, np.uint8)  # the root's pieces one buffer each
        assert _run(seg, plans.scatter(nbytes, n, r, half, 0, pieces=True),
                    [np.empty(0, np.uint8), s2] + [whole[j * nbytes:(j + 1) * nbytes]
                                                   for j in range(n)]) == (0, -1)
        assert np.array_equal(s, s2)
        g2 = [np.zeros(nbytes, np.uint8) for _ in range(n)]
        assert _run(seg, plans.all_gather(nbytes, n, r, half, pieces=True),
                    [mine, np.empty(0, np.uint8)] + g2) == (0, -1)
        assert np.array_equal(np.concatenate(g2), g)
        rs = np.zeros(nbytes, np.uint8)
        assert _run(seg, plans.reduce_scatter(nbytes, 1, n, r, half), [whole, rs],
                    DTYPE_CODES["uint8"], OP_CODES["SUM"]) == (0, -1)
        return b, g, s, rs

    for r, (b, g, s, rs) in enumerate(_in_threads(n, body, half)):
        assert (b == 2).all()
        assert np.array_equal(g, np.repeat(np.arange(1, n + 1, dtype=np.uint8), nbytes))
        assert (s == 10 * r).all()
        assert (rs == (10 * r * n + sum(range(n))) % 256).all()


def test_all_to_all_plans_with_uneven_pieces():
    n, half = 3, 2 * PAGE

    def body(r: int, seg: Any) -> Any:
        sizes = [(r + j + 1) * 1500 for j in range(n)]  # more than a region: several steps
        src = np.concatenate([np.full(k, 10 * r + j, np.uint8) for j, k in enumerate(sizes)])
        sends = tuple((1, off, k) for off, k in plans_layout(sizes))
        recvs = tuple((2, off, k) for off, k in plans_layout([(s + r + 1) * 1500
                                                              for s in range(n)]))
        meta = np.array([k for *_, k in sends] + [k for *_, k in recvs], dtype=np.int64)
        assert _run(seg, plans.all_to_all_first(sends, n, r, half), [meta, src]) == (0, -1)
        parity = seg.step & 1
        table = np.stack([np.frombuffer(memoryview(seg)[seg.half_offset(s, parity):][:16 * n],
                                        dtype=np.int64) for s in range(n)])
        assert np.array_equal(table[:, :n], table[:, n:].T)  # every pair agrees
        dst = np.zeros(sum(k for *_, k in recvs), np.uint8)
        longest = int(table[:, :n][~np.eye(n, dtype=bool)].max())
        rest = plans.all_to_all_rest(longest, sends, recvs, n, r, half)
        assert _run(seg, rest, [meta, src, dst]) == (0, -1)
        return dst, recvs

    for r, (dst, recvs) in enumerate(_in_threads(n, body, half)):
        for s, (_, off, k) in enumerate(recvs):
            assert (dst[off:off + k] == 10 * s + r).all(), (r, s)


def plans_layout(sizes: Sequence[int]) -> tuple:
    out, at = [], 0
    for k in sizes:
        out.append((at, k))
        at += k
    return tuple(out)


def test_a_mismatch_fails_the_call_on_every_rank_and_the_next_one_works():
    def body(r: int, seg: Any) -> Any:
        x = np.ones(4, np.float32)
        plan = plans.all_reduce(4, 4, 2, r, PAGE, 1 << 20)
        first = _run(seg, plan, [x], DTYPE_CODES["float32"], OP_CODES["SUM"],
                     fp=b"shape (4,)" if r == 0 else b"shape (5,)")
        fps = [seg.info(j, seg.step & 1)["fp"] for j in range(2)]
        x[:] = 1
        second = _run(seg, plan, [x], DTYPE_CODES["float32"], OP_CODES["SUM"], seq=2)
        return first, fps, second, x.tolist()

    for first, fps, second, x in _in_threads(2, body):
        assert first[0] == core.MISMATCH
        assert fps == [b"shape (4,)", b"shape (5,)"]
        assert second == (0, -1) and x == [2.0] * 4


def test_a_call_one_rank_left_out_fails_the_others_and_the_steps_stay_in_line():
    """Rank 1 rejected call 1 (or took another path for it): it took no step for it and
    goes on to call 2. Rank 0 meets it there: its call 1 fails naming rank 1, and rank 1's
    call 2 runs again from the next step, where rank 0's call 2 meets it."""
    def body(r: int, seg: Any) -> Any:
        first = None
        if r == 0:
            first = _run(seg, plans.broadcast(8, 2, 0, PAGE, 0), [np.zeros(8, np.uint8)], seq=1)
            time.sleep(0.05)
        x = np.ones(2)
        second = _run(seg, plans.all_reduce(2, 8, 2, r, PAGE, 1 << 20), [x],
                      DTYPE_CODES["float64"], OP_CODES["SUM"], seq=2)
        return first, second, x.tolist(), seg.step

    (first, second0, x0, step0), (_, second1, x1, step1) = _in_threads(2, body)
    assert first == (core.SEQ, 1)
    assert second0 == second1 == (0, -1) and x0 == x1 == [2.0, 2.0]
    assert step0 == step1 == 2


def test_a_call_every_rank_left_out_takes_no_step():
    def body(r: int, seg: Any) -> Any:  # call 1 went through the coordinator everywhere
        x = np.ones(2)
        done = _run(seg, plans.all_reduce(2, 8, 2, r, PAGE, 1 << 20), [x],
                    DTYPE_CODES["float64"], OP_CODES["SUM"], seq=2)
        return done, x.tolist(), seg.step

    assert _in_threads(2, body) == [((0, -1), [2.0, 2.0], 1)] * 2


def test_ranks_at_different_calls_are_told_apart():
    def body(r: int, seg: Any) -> Any:
        got = [_run(seg, plans.barrier(), [], seq=5 if r == 0 else 6)]
        if r == 0:  # it goes on to call 6, where rank 1 (which ran call 6 again) meets it
            got.append(_run(seg, plans.barrier(), [], seq=6))
        return got

    assert _in_threads(2, body) == [[(core.SEQ, 1), (0, -1)], [(0, -1)]]


def test_every_copy_is_bounds_checked_before_anything_moves():
    def body(r: int, seg: Any) -> Any:
        small = np.zeros(8, np.uint8)
        out = []
        for op in [plans.write(0, 4, 8, 0),           # past the buffer
                   plans.write(0, 0, 8, PAGE - 4),    # past the half
                   plans.copy(0, 0, 8, 7, 0),         # no such rank
                   plans.local(0, 0, 8, 3, 0),        # no such buffer
                   (99, 0, 0, 0, 0, 0, 0, 0)]:        # no such operation
            out.append(_run(seg, plans._plan([op]), [small]))
        ro = np.zeros(8, np.uint8)
        ro.setflags(write=False)
        out.append(_run(seg, plans._plan([plans.copy(0, 0, 8, 0, 0)]), [ro]))  # read-only
        return out, seg.step

    for statuses, step in _in_threads(2, body, PAGE):
        assert [s for s, _ in statuses] == [core.BADPLAN] * 6
        assert [i for _, i in statuses] == [0] * 6
        assert step == 0  # nothing was published


def test_a_check_that_raises_ends_the_wait_with_its_error():
    name = _name()
    seg = core.Segment(name, 2, 0, PAGE, True)
    try:
        calls: List[float] = []

        def check(waited_s: float, pending: tuple) -> None:
            calls.append(waited_s)
            assert pending == (1,)
            if waited_s > 0.15:
                raise TimeoutError("rank 1 never came")

        start = time.monotonic()
        with pytest.raises(TimeoutError, match="never came"):
            _run(seg, plans.barrier(), [], check=check)
        assert 0.15 < time.monotonic() - start < 2.0
        assert len(calls) >= 2
    finally:
        seg.close()
        core.unlink(name)


def test_closing_from_another_thread_ends_a_wait_and_tells_the_peers():
    name = _name()
    seg = core.Segment(name, 2, 0, PAGE, True)
    peer = core.Segment(name, 2, 1, PAGE, False)
    core.unlink(name)
    got: List[Any] = []
    t = threading.Thread(target=lambda: got.append(_run(seg, plans.barrier(), [])))
    t.start()
    time.sleep(0.05)
    seg.close()
    t.join(5)
    assert got == [(core.CLOSED, 0)]
    assert peer.info(0, 0)["abort"] == core.ABORT_CLOSED
    # rank 0 had arrived at that barrier before it gave up: the peer fails it all the same
    # (rank 0's caller got an error for it), and the next one
    assert _run(peer, plans.barrier(), []) == (core.ABORTED, 0)
    assert _run(peer, plans.barrier(), [], seq=2) == (core.ABORTED, 0)
    peer.close()


# ---------------------------------------------------------------------- segments in processes
def _child(name: str, n: int, r: int, half: int, mode: str, q: Any) -> None:
    seg = core.Segment(name, n, r, half, False)
    q.put(("mapped", r, os.getpid()))
    if mode == "hang":
        time.sleep(60)
    x = np.full(3, r + 1.0)
    q.put(("done", _run(seg, plans.all_reduce(3, 8, n, r, half, 1 << 20), [x],
                        DTYPE_CODES["float64"], OP_CODES["SUM"]), x.tolist()))


def test_processes_share_a_segment_and_its_file_is_gone_once_mapped():
    ctx = multiprocessing.get_context("fork")
    name, n, half = _name(), 3, PAGE
    seg = core.Segment(name, n, 0, half, True)
    q = ctx.Queue()
    kids = [ctx.Process(target=_child, args=(name, n, r, half, "run", q)) for r in (1, 2)]
    for k in kids:
        k.start()
    try:
        mapped = [q.get(timeout=20) for _ in kids]
        assert sorted(m[1] for m in mapped) == [1, 2]
        assert seg.attached == n
        core.unlink(name)  # every rank mapped it: the file may go
        assert not os.path.exists("/dev/shm" + name)
        x = np.full(3, 1.0)
        assert _run(seg, plans.all_reduce(3, 8, n, 0, half, 1 << 20), [x],
                    DTYPE_CODES["float64"], OP_CODES["SUM"]) == (0, -1)
        assert x.tolist() == [6.0] * 3
        done = [q.get(timeout=20) for _ in kids]
        assert all(d[1] == (0, -1) and d[2] == [6.0] * 3 for d in done)
    finally:
        for k in kids:
            k.join(10)
        seg.close()
        core.unlink(name)


def test_a_killed_peer_is_named_within_a_second():
    ctx = multiprocessing.get_context("fork")
    name, n, half = _name(), 2, PAGE
    seg = core.Segment(name, n, 0, half, True)
    q = ctx.Queue()
    kid = ctx.Process(target=_child, args=(name, n, 1, half, "hang", q))
    kid.start()
    try:
        _, _, pid = q.get(timeout=20)
        core.unlink(name)
        threading.Timer(0.2, lambda: os.kill(pid, signal.SIGKILL)).start()
        start = time.monotonic()
        status, who = _run(seg, plans.barrier(), [], check=lambda waited, pending: None)
        took = time.monotonic() - start
        assert (status, who) == (core.DEAD, 1)
        assert took < 1.2, took  # killed at 0.2 s, named within a second of it
    finally:
        kid.join(10)
        seg.close()
        core.unlink(name)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare to give a process a small /dev/shm")
def test_a_dev_shm_too_small_is_a_clear_error_not_a_sigbus():
    code = (
        "from raycoll.native import core\n"
        "try:\n"
        "    core.Segment('/rctsmall', 2, 0, 1 << 20, True)\n"
        "except core.SegmentError as exc:\n"
        "    print('errno', exc.errno, exc.strerror)\n"
        "seg = core.Segment('/rctsmall2', 2, 0, 64 << 10, True)\n"
        "print('small ok', seg.half_bytes)\n"
    )
    script = ("mount -t tmpfs -o size=1m tmpfs /dev/shm && "
              f"{sys.executable} -c \"{code}\"")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=60)
    if "mount" in done.stderr and done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert "errno 28" in done.stdout and "reserving" in done.stdout, done.stdout
    assert "small ok 65536" in done.stdout


# ---------------------------------------------------------------------- sockets
from raycoll.algorithms.catalog import build  # noqa: E402
from schedule_reference import simulate  # noqa: E402
from raycoll.algorithms.native_plans import plan_schedule  # noqa: E402
from raycoll.algorithms.topology import Topology  # noqa: E402

SEND, RECV, XFER = core.OP_SEND, core.OP_RECV, core.OP_XFER


class _Mesh:
    """``n`` ranks joined by socket pairs (one per ordered pair, as the group's direct
    connections are): each rank's out / in descriptors by peer, and its connection state."""

    def __init__(self, n: int) -> None:
        import socket

        self.n = n
        self.socks = []
        self.out = [np.full(n, -1, np.int64) for _ in range(n)]
        self.inn = [np.full(n, -1, np.int64) for _ in range(n)]
        self.conns = [np.zeros(n * core.CONN_BYTES, np.uint8) for _ in range(n)]
        for s in range(n):
            for d in range(n):
                if s != d:
                    a, b = socket.socketpair()
                    a.setblocking(False)
                    b.setblocking(False)
                    self.socks += [a, b]
                    self.out[s][d] = a.fileno()
                    self.inn[d][s] = b.fileno()

    def net(self, r: int, fp: int = 7) -> tuple:
        return (self.out[r], self.inn[r], self.conns[r], fp)

    def close(self) -> None:
        for s in self.socks:
            s.close()


def _exec(mesh: _Mesh, r: int, ops: Any, bufs: Sequence[Any], dtype: int = 0, op: int = 0,
          divisor: int = 0, seq: int = 1, fp: int = 7, check: Any = None) -> Any:
    status, peer, err, _, exc = core.execute(None, ops, tuple(bufs), dtype, op, 1.0, divisor,
                                             seq, b"", WAIT, check, mesh.net(r, fp))
    if exc is not None:
        raise exc
    return status, peer, err


def _threads(n: int, body: Callable[[int], Any]) -> List[Any]:
    out: List[Any] = [None] * n
    errs: List[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = body(r)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errs.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errs:
        raise errs[0]
    return out


@pytest.mark.parametrize("collective,algorithm", [
    ("all_reduce", "direct"), ("all_reduce", "ring"), ("all_reduce", "recursive_doubling"),
    ("all_reduce", "halving_doubling"), ("reduce_scatter", "ring"), ("all_gather", "ring"),
    ("all_gather", "recursive_doubling"), ("broadcast", "binomial"), ("reduce", "binomial")])
@pytest.mark.parametrize("n", [3, 4, 5])
def test_schedules_run_natively_over_sockets_equal_the_simulation(collective, algorithm, n):
    count = 1001
    schedule = build(collective, algorithm, Topology.flat(n), count, root=1)
    reducing = collective in ("all_reduce", "reduce_scatter", "reduce")
    inputs = [np.random.default_rng(r).standard_normal(count) for r in range(n)]
    want = [x.copy() for x in inputs]
    simulate(schedule, want, ReduceOp.SUM if reducing else ReduceOp.SUM)
    mesh = _Mesh(n)
    try:
        def body(r: int) -> Any:
            plan = plan_schedule(schedule, r, 8, False)
            flat = inputs[r].copy()
            got = _exec(mesh, r, plan.ops, [flat, np.empty(plan.scratch, np.uint8)],
                        DTYPE_CODES["float64"], OP_CODES["SUM"])
            return got, flat, plan

        results = _threads(n, body)
    finally:
        mesh.close()
    for r, (got, flat, plan) in enumerate(results):
        assert got == (0, -1, 0), (r, got)
        lo, hi = schedule.results[r]
        if algorithm == "direct" or collective != "all_reduce":
            assert np.allclose(flat[lo:hi], want[r][lo:hi]), r
        else:
            assert np.array_equal(flat[lo:hi], want[r][lo:hi]), r
    if algorithm == "direct":  # reduced in rank order everywhere: bitwise the same result
        assert all(np.array_equal(results[0][1], res[1]) for res in results)


def _pair(sends: int, recvs: int, peer: int, nbytes: int = 8) -> np.ndarray:
    ops = [(SEND, 0, 0, nbytes, peer, 0, 0, 0)] * sends + \
          [(RECV, 1, 0, nbytes, peer, 0, 0, 0)] * recvs + [(XFER, 0, 0, 0, 0, 0, 0, 0)]
    return np.array(ops, dtype=np.int64)


def test_a_stale_message_is_skipped_and_a_later_one_kept_for_its_call():
    mesh = _Mesh(2)
    try:
        src, dst = np.full(8, 5, np.uint8), np.zeros(8, np.uint8)
        # rank 0 sends for call 1, which rank 1 left out (it failed there, say)
        assert _exec(mesh, 0, _pair(1, 0, 1), [src, dst], seq=1) == (0, -1, 0)
        # rank 0 sends for call 3 too; rank 1 is at call 2 and receives: call 1's is
        # skipped, call 3's kept for call 3, and call 2 fails naming rank 0
        assert _exec(mesh, 0, _pair(1, 0, 1), [np.full(8, 9, np.uint8), dst], seq=3) == \
            (0, -1, 0)
        assert _exec(mesh, 1, _pair(0, 1, 0), [src, dst], seq=2) == (core.SEQ, 0, 0)
        assert _exec(mesh, 1, _pair(0, 1, 0), [src, dst], seq=3) == (0, -1, 0)
        assert dst.tolist() == [9] * 8
    finally:
        mesh.close()


def test_a_message_of_another_call_fails_both_ranks_and_the_streams_stay_whole():
    mesh = _Mesh(2)
    try:
        def body(r: int) -> Any:
            big = np.full(100_000, r + 1, np.uint8)  # more than a socket buffer
            first = _exec(mesh, r, _pair(1, 1, 1 - r, 100_000 if r else 100_000),
                          [big, np.zeros(100_000, np.uint8)], fp=7 + r)  # fingerprints differ
            out = np.zeros(8, np.uint8)
            second = _exec(mesh, r, _pair(1, 1, 1 - r), [np.full(8, r + 1, np.uint8), out],
                           seq=2)
            return first, second, out.tolist()

        (f0, s0, o0), (f1, s1, o1) = _threads(2, body)
    finally:
        mesh.close()
    assert f0 == (core.MISMATCH, 1, 0) and f1 == (core.MISMATCH, 0, 0)
    assert s0 == s1 == (0, -1, 0) and o0 == [2] * 8 and o1 == [1] * 8


def test_a_closed_peer_a_garbled_stream_and_a_python_frame_are_named():
    for junk, status in [(None, core.PEER_CLOSED), (b"\xde\xad" * 32, core.GARBLED),
                         (b"RC" + b"\0" * 40, core.FOREIGN)]:
        mesh = _Mesh(2)
        try:
            sock = next(s for s in mesh.socks if s.fileno() == mesh.out[0][1])
            if junk is None:
                sock.close()
            else:
                sock.sendall(junk)
            got = _exec(mesh, 1, _pair(0, 1, 0), [np.zeros(8, np.uint8), np.zeros(8, np.uint8)],
                        check=lambda waited, pending: None)
            assert got[:2] == (status, 0), (junk, got)
        finally:
            mesh.close()


def test_socket_operations_are_bounds_checked():
    mesh = _Mesh(2)
    try:
        small = np.zeros(8, np.uint8)
        for ops in [[(SEND, 0, 4, 8, 1, 0, 0, 0), (XFER, 0, 0, 0, 0, 0, 0, 0)],  # past the buffer
                    [(SEND, 0, 0, 8, 5, 0, 0, 0), (XFER, 0, 0, 0, 0, 0, 0, 0)],  # no such peer
                    [(SEND, 0, 0, 8, 1, 0, 0, 0)],                                # no XFER
                    [(SEND, 0, 0, 8, 1, 0, 0, 0), (core.OP_LOCAL, 0, 0, 1, 0, 1, 0, 0),
                     (XFER, 0, 0, 0, 0, 0, 0, 0)]]:                              # mixed in
            got = _exec(mesh, 0, np.array(ops, dtype=np.int64), [small])
            assert got[0] == core.BADPLAN, ops
    finally:
        mesh.close()


# ---------------------------------------------------------------------- across processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_vm_readv is Linux's")
@pytest.mark.parametrize("n", [2, 3, 5])
def test_cross_memory_plans_read_the_peers_buffers(n):
    count = 10_007  # parts of different sizes, more than a reduction block of some

    def body(r: int, seg: Any) -> Any:
        deadline = time.monotonic() + 10
        while seg.attached < n and time.monotonic() < deadline:
            time.sleep(0.001)
        assert seg.probe_cma()  # threads of one process may read its memory
        f64, fsum = DTYPE_CODES["float64"], OP_CODES["SUM"]
        x = np.arange(count, dtype=np.float64) * (r + 1)
        assert _run(seg, plans.cma_all_reduce(count, 8, n, r), [x], f64, fsum) == (0, -1)
        red = np.full(count, r + 1.0)
        assert _run(seg, plans.cma_all_reduce(count, 8, n, r, root=1), [red], f64,
                    OP_CODES["MAX"], seq=2) == (0, -1)
        whole = np.concatenate([np.full(count, 10.0 * j + r) for j in range(n)])
        rs = np.zeros(count)
        assert _run(seg, plans.cma_reduce_scatter(count, 8, n, r), [whole, rs], f64, fsum,
                    seq=3) == (0, -1)
        b = np.arange(count, dtype=np.float64) if r == 1 else np.zeros(count)
        assert _run(seg, plans.cma_broadcast(count * 8, n, r, 1), [b], seq=4) == (0, -1)
        g = np.zeros(n * count)
        assert _run(seg, plans.cma_all_gather(count * 8, n, r), [np.full(count, r + 0.5), g],
                    seq=5) == (0, -1)
        sc = np.zeros(count)
        assert _run(seg, plans.cma_scatter(count * 8, n, r, 0), [whole, sc], seq=6) == (0, -1)
        sc2 = np.zeros(count)
        assert _run(seg, plans.cma_scatter(count * 8, n, r, 0, pieces=True),
                    [np.empty(0), sc2] + [whole[j * count:(j + 1) * count] for j in range(n)],
                    seq=7) == (0, -1)
        g2 = [np.zeros(count) for _ in range(n)]
        assert _run(seg, plans.cma_all_gather(count * 8, n, r, pieces=True),
                    [np.full(count, r + 0.5), np.empty(0)] + g2, seq=8) == (0, -1)
        assert np.array_equal(sc, sc2) and np.array_equal(np.concatenate(g2), g)
        return x, red, rs, b, g, sc

    for r, (x, red, rs, b, g, sc) in enumerate(_in_threads(n, body, PAGE)):
        assert np.array_equal(x, np.arange(count, dtype=np.float64) * sum(range(1, n + 1)))
        assert np.array_equal(red, np.full(count, float(n) if r == 1 else r + 1.0))
        assert np.array_equal(rs, np.full(count, 10.0 * r * n + sum(range(n))))
        assert np.array_equal(b, np.arange(count, dtype=np.float64))
        assert np.array_equal(g, np.repeat(np.arange(n) + 0.5, count))
        assert np.array_equal(sc, np.full(count, 10.0 * r))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_vm_readv is Linux's")
def test_a_cross_memory_read_past_a_peers_buffer_is_refused():
    def body(r: int, seg: Any) -> Any:
        mine = np.zeros(16, np.uint8)
        plan = plans._plan([plans.sync(first=True), plans.cread(0, 0, 16, 1 - r, 8)])
        return _run(seg, plan, [mine])  # the peer published 16 bytes: [8, 24) is past them

    # the first rank refused breaks the group (its abort flag): the other rank is refused
    # too, or sees that flag on its way out of the step
    got = sorted(status for status, _ in _in_threads(2, body))
    assert got in ([core.BADPLAN] * 2, [core.ABORTED, core.BADPLAN]), got


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_vm_readv is Linux's")
def test_cma_read_reads_another_process_and_checks_every_range():
    """core.cma_read (cma.c, raycoll.rdt's same-node path): a child's buffers, many ranges in
    one call (more than IOV_MAX, so in several system calls), and the checks before any copy:
    a buffer of another length, a range at address 0, a pid that is gone."""
    data = np.arange(3000, dtype=np.uint32)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child keeps `data` (copy on write: the same addresses) until killed
        os.close(r)
        os.write(w, b"1")
        time.sleep(60)
        os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"1"
        at = data.ctypes.data
        pieces = [(at + 4 * i, 4 * (i % 3)) for i in range(1500)]  # 1,500 ranges, some empty
        outs = [np.empty(n, np.uint8) for _, n in pieces]
        assert core.cma_read(pid, pieces, outs) == (core.OK, 0)
        raw = data.view(np.uint8)
        assert all(np.array_equal(o, raw[a - at:a - at + len(o)]) for (a, _), o in
                   zip(pieces, outs))
        whole = np.empty(data.nbytes, np.uint8)
        assert core.cma_read(pid, [(at, data.nbytes)], [whole]) == (core.OK, 0)
        assert np.array_equal(whole, raw)
        with pytest.raises(ValueError, match="its buffer 16 bytes"):
            core.cma_read(pid, [(at, 8)], [np.empty(16, np.uint8)])
        with pytest.raises(ValueError, match="at address 0"):
            core.cma_read(pid, [(0, 8)], [np.empty(8, np.uint8)])
        with pytest.raises(ValueError, match="2 ranges for 1 buffers"):
            core.cma_read(pid, [(at, 8), (at, 8)], [np.empty(8, np.uint8)])
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
    status, err = core.cma_read(pid, [(at, 8)], [np.empty(8, np.uint8)])
    assert status == core.DEAD and err == 3  # ESRCH
