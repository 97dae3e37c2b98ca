"""The hierarchical plans (raycoll.algorithms.node_plans) without Ray: every rank's plan run
by a small model of the executor (a node's segment steps as barriers with two halves a rank,
socket rounds as messages matched by sender, receiver and the XFER's step number, as the
executor's message headers carry it), on layouts a one-machine
cluster cannot hold (4 + 4, 3 + 2, 2 + 1 + 1, ranks interleaved over nodes): results right,
every rank's result the same, the local ranks' steps aligned, each message's size the one its
receiver expects, and the bytes that leave each node."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np
import pytest

from raycoll.algorithms import node_plans as npl
from raycoll.algorithms.native_plans import (FINAL, LOCAL, MREDUCE, RECV, SEND, XFER)
from raycoll.algorithms.segment_plans import COPY, REDUCE, SYNC, WRITE

LAYOUTS = {"2+2": "aabb", "3+1": "aaab", "1+3": "abbb", "4+4": "aaaabbbb", "3+2": "aaabb",
           "2+1+1": "aabc", "interleaved 2+2": "abab", "2+2+2": "abcabc"}


def _run(plans: Sequence[np.ndarray], bufs: List[List[np.ndarray]], nodes: str,
         half: int) -> Dict[Tuple[int, int], int]:
    """Run every rank's plan (buffers ``bufs[r]``, uint8; reductions as int64 sums);
    returns the bytes each (sender, receiver) pair sent."""
    size = len(plans)
    mates = {r: [j for j in range(size) if nodes[j] == nodes[r]] for r in range(size)}
    halves = [[np.zeros(half, np.uint8), np.zeros(half, np.uint8)] for _ in range(size)]
    step = [0] * size
    pc = [0] * size
    posted: Dict[Tuple[int, int, int], List[bytes]] = {}
    sent: Dict[Tuple[int, int], int] = {}

    def i64(b: np.ndarray) -> np.ndarray:
        return b.view(np.int64)

    def run_local(r: int) -> str:
        """Run rank r up to a SYNC, an XFER or the end; say which."""
        ops = plans[r]
        while pc[r] < len(ops):
            kind, a, a_off, n, b, b_off, flags, extra = (int(v) for v in ops[pc[r]])
            if kind in (SYNC, XFER):
                return "sync" if kind == SYNC else "xfer"
            me = mates[r]
            if kind == WRITE:
                halves[r][(step[r] + 1) & 1][b_off:b_off + n] = bufs[r][a][a_off:a_off + n]
            elif kind == COPY:
                src = halves[me[b]][step[r] & 1]
                bufs[r][a][a_off:a_off + n] = src[b_off:b_off + n]
            elif kind == REDUCE:
                total = sum(i64(halves[j][step[r] & 1][b_off:b_off + n]) for j in me)
                bufs[r][a][a_off:a_off + n] = np.asarray(total, np.int64).view(np.uint8)
            elif kind == LOCAL:
                bufs[r][a][a_off:a_off + n] = bufs[r][b][b_off:b_off + n].copy()
            elif kind == MREDUCE:
                total = sum(i64(bufs[r][b][b_off + j * extra:b_off + j * extra + n])
                            for j in range(flags))
                bufs[r][a][a_off:a_off + n] = np.asarray(total, np.int64).view(np.uint8)
            elif kind == FINAL:
                pass
            elif kind not in (SEND, RECV):
                raise AssertionError(f"unknown operation {kind}")
            pc[r] += 1
        return "done"

    def xfer_ready(r: int) -> bool:
        ops = plans[r]
        i = pc[r] - 1
        while i >= 0 and int(ops[i][0]) in (SEND, RECV):
            i -= 1
        recvs = [o for o in ops[i + 1:pc[r]] if int(o[0]) == RECV]
        return all((int(o[4]), r, int(ops[pc[r]][7])) in posted for o in recvs)

    waiting: Dict[int, str] = {}
    for _ in range(100_000):
        progress = False
        for r in range(size):
            if waiting.get(r) in (None,):
                state = run_local(r)
                if state == "xfer":  # post this round's sends (one message a peer)
                    ops = plans[r]
                    i = pc[r] - 1
                    while i >= 0 and int(ops[i][0]) in (SEND, RECV):
                        i -= 1
                    by_peer: Dict[int, List[bytes]] = {}
                    for o in ops[i + 1:pc[r]]:
                        if int(o[0]) == SEND:
                            n, off = int(o[3]), int(o[2])
                            by_peer.setdefault(int(o[4]), []).append(
                                bytes(bufs[r][int(o[1])][off:off + n]))
                    for peer, parts in by_peer.items():
                        assert nodes[peer] != nodes[r], "sockets only between nodes"
                        key = (r, peer, int(ops[pc[r]][7]))
                        assert key not in posted, ("two messages of one step", key)
                        posted[key] = parts
                        sent[(r, peer)] = sent.get((r, peer), 0) + sum(map(len, parts))
                waiting[r] = state
                progress = True
        for r, state in list(waiting.items()):
            if state == "xfer" and xfer_ready(r):
                ops = plans[r]
                i = pc[r] - 1
                while i >= 0 and int(ops[i][0]) in (SEND, RECV):
                    i -= 1
                got: Dict[int, List[bytes]] = {}
                for o in ops[i + 1:pc[r]]:
                    if int(o[0]) == RECV:
                        src = int(o[4])
                        parts = got.setdefault(src, list(posted[(src, r, int(ops[pc[r]][7]))]))
                        data = parts.pop(0)
                        assert len(data) == int(o[3]), ("message size", src, r, len(data), o)
                        bufs[r][int(o[1])][int(o[2]):int(o[2]) + len(data)] = \
                            np.frombuffer(data, np.uint8)
                assert all(not p for p in got.values()), "a message part left unread"
                pc[r] += 1
                del waiting[r]
                progress = True
        for node in set(nodes):
            local = [r for r in range(size) if nodes[r] == node]
            if all(waiting.get(r) == "sync" for r in local):
                first = step[local[0]]
                for r in local:
                    assert step[r] == first, "local ranks' steps aligned"
                    step[r] += 1
                    pc[r] += 1
                    del waiting[r]
                progress = True
        if all(waiting.get(r) == "done" for r in range(size)):
            return sent
        if not progress:
            raise AssertionError(f"deadlock: {waiting}, pcs {pc}")
    raise AssertionError("too many rounds")


def _with_scratch(plan: npl.NativePlan, *bufs: np.ndarray) -> List[np.ndarray]:
    return [bufs[0], np.zeros(plan.scratch, np.uint8), *bufs[1:]]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("count", [1, 5, 700, 9_001])
def test_all_reduce_plans_give_the_sum_on_every_rank(layout, count):
    nodes = LAYOUTS[layout]
    size, half = len(nodes), 4096
    ids = tuple(nodes)
    plans = [npl.all_reduce(count, 8, ids, r, half, False, small_bytes=1024)
             for r in range(size)]
    inputs = [np.arange(count, dtype=np.int64) * (r + 1) + r for r in range(size)]
    bufs = [_with_scratch(p, x.copy().view(np.uint8)) for p, x in zip(plans, inputs)]
    sent = _run([p.ops for p in plans], bufs, nodes, half)
    want = sum(inputs)
    for r in range(size):
        np.testing.assert_array_equal(bufs[r][0].view(np.int64), want, err_msg=f"rank {r}")
    lay = npl.layout(ids)
    if count * 8 > 1024:  # streamed: each node sends the buffer to each other node once
        for m, ranks in enumerate(lay.nodes):
            for other in range(len(lay.nodes)):
                if other != m:
                    out = sum(n for (s, d), n in sent.items()
                              if s in ranks and lay.node_of[d] == other)
                    assert out == count * 8, (layout, m, other, out)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("nbytes", [3, 5_000, 20_001])
def test_broadcast_plans_send_each_byte_into_a_node_once(layout, nbytes):
    nodes = LAYOUTS[layout]
    for root in range(len(nodes)):
        _, sent = _broadcast_from(nodes, nbytes, root, tree=False)
        assert sum(sent.values()) == nbytes * (len(set(nodes)) - 1), sent


def _broadcast_from(nodes: str, nbytes: int, root: int,
                    tree: bool) -> Tuple[List[npl.NativePlan], Dict[Tuple[int, int], int]]:
    """Every rank's broadcast plan of ``nbytes`` from ``root`` run on the model; every rank
    checked to hold the root's buffer: the plans, and the bytes sent by (sender, receiver)."""
    size, half = len(nodes), 4096
    plans = [npl.broadcast(nbytes, tuple(nodes), r, root, half, tree=tree) for r in range(size)]
    src = np.random.default_rng(root).integers(0, 255, nbytes, dtype=np.uint8)
    bufs = [[src.copy() if r == root else np.zeros(nbytes, np.uint8), np.zeros(0, np.uint8)]
            for r in range(size)]
    sent = _run([p.ops for p in plans], bufs, nodes, half)
    for r in range(size):
        np.testing.assert_array_equal(bufs[r][0], src, err_msg=f"root {root} rank {r}")
    return plans, sent


#: Layouts of 3+ nodes, where broadcast may take the tree over the nodes.
MANY_NODES = {**{k: v for k, v in LAYOUTS.items() if len(set(v)) > 2},
              "4x2": "aabbccdd", "5 nodes": "aabcdde", "8x1": "abcdefgh",
              "3+1+2+1 interleaved": "abacbdca"}


@pytest.mark.parametrize("layout", sorted(MANY_NODES))
@pytest.mark.parametrize("nbytes", [3, 20_001])
def test_broadcast_trees_reach_every_rank_and_the_roots_node_sends_log2_nodes_times(layout,
                                                                                     nbytes):
    """The tree over the nodes' leaders, from every root: every rank gets the root's
    buffer, each byte enters a node once, and no node sends it more than ceil(log2 nodes)
    times (the star: the root's node nodes - 1 times)."""
    nodes = MANY_NODES[layout]
    nnodes = len(set(nodes))
    for root in range(len(nodes)):
        plans, sent = _broadcast_from(nodes, nbytes, root, tree=True)
        assert sum(sent.values()) == nbytes * (nnodes - 1), sent
        out = {nodes[s]: 0 for s, _ in sent}
        for (s, _), n in sent.items():
            out[nodes[s]] += n
        assert out[nodes[root]] == nbytes * (nnodes - 1).bit_length(), (root, out)
        assert max(out.values()) <= nbytes * (nnodes - 1).bit_length()
        for r, p in enumerate(plans):  # the peers it names are the ones it messages
            assert set(p.sends_to) == {d for (s, d) in sent if s == r}
            assert set(p.recvs_from) == {s for (s, d) in sent if d == r}
            assert p.rounds == len(set(p.sends_to)) + len(p.recvs_from)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("nbytes", [3, 6_000])
def test_all_gather_plans_gather_every_piece(layout, nbytes):
    nodes = LAYOUTS[layout]
    size, half = len(nodes), 4096
    plans = [npl.all_gather(nbytes, tuple(nodes), r, half, True) for r in range(size)]
    pieces = [np.full(nbytes, r + 1, np.uint8) for r in range(size)]
    bufs = [[pieces[r].copy(), np.zeros(0, np.uint8)]
            + [np.zeros(nbytes, np.uint8) for _ in range(size)] for r in range(size)]
    sent = _run([p.ops for p in plans], bufs, nodes, half)
    for r in range(size):
        for j in range(size):
            np.testing.assert_array_equal(bufs[r][2 + j], pieces[j], err_msg=f"rank {r} piece {j}")
    lay = npl.layout(tuple(nodes))
    for m, ranks in enumerate(lay.nodes):  # each node's pieces enter every other node once
        out = sum(n for (s, _), n in sent.items() if s in ranks)
        assert out == nbytes * len(ranks) * (len(lay.nodes) - 1), (layout, m, out)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("count", [1, 7, 3_001])
def test_reduce_scatter_plans_reduce_each_piece_into_its_rank(layout, count):
    nodes = LAYOUTS[layout]
    size, half = len(nodes), 4096
    plans = [npl.reduce_scatter(count, 8, tuple(nodes), r, half, False) for r in range(size)]
    inputs = [np.arange(count * size, dtype=np.int64) * (r + 1) + r for r in range(size)]
    bufs = [[inputs[r].copy().view(np.uint8), np.zeros(p.scratch, np.uint8),
             np.zeros(count * 8, np.uint8)] for r, p in enumerate(plans)]
    sent = _run([p.ops for p in plans], bufs, nodes, half)
    total = sum(inputs)
    for r in range(size):
        np.testing.assert_array_equal(bufs[r][2].view(np.int64),
                                      total[r * count:(r + 1) * count], err_msg=f"rank {r}")
    lay = npl.layout(tuple(nodes))
    for m, ranks in enumerate(lay.nodes):  # each remote rank's piece leaves the node once
        out = sum(n for (s_, _), n in sent.items() if s_ in ranks)
        assert out == count * 8 * (size - len(ranks)), (layout, m, out)
