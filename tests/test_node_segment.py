"""Groups on two Ray nodes (``ray.cluster_utils.Cluster`` on this machine) with a node
segment per node: all_reduce as one hierarchical plan (the segment in the node, sockets
between nodes, one native call) right against numpy for every op and dtype at 2 + 2 and
3 + 1 ranks, small and streamed through the segment; the route and counters showing the
one-call path; a killed rank on either node failing every survivor within seconds."""

from __future__ import annotations

import os

import time

import numpy as np
import pytest
import ray

from helpers import DTYPES, OPS_BY_KIND, data, op_of, reference

import raycoll
from raycoll.algorithms.cost import CostModel
from raycoll.algorithms.planner import node_plan_wins
from raycoll.launch import RankWorker, run_on

pytestmark = pytest.mark.cluster

#: group rank -> node, per layout
LAYOUTS = {"2+2": (0, 0, 1, 1), "3+1": (0, 0, 0, 1)}
#: A cost model that prices only the bytes through sockets (a free segment, no message or
#: reduction cost): the planner then takes the hierarchical plans for what these tests run
#: through them (with the defaults it prices, say, 3 + 1 all_reduce of 6 MB or a small
#: segment's many steps above the flat socket schedules: test_planner.py)
SOCKET_BYTES = {"segment": {"alpha": 0.0, "beta": 0.0}, "socket": {"alpha": 0.0}, "gamma": 0.0}


def _actors(layout):
    worker = ray.remote(RankWorker)
    return [worker.options(num_cpus=0, resources={f"node{n}": 1}).remote()
            for n in LAYOUTS[layout]]


def _reduce_every_case(rank, cases):
    """Each (dtype, op, n): all_reduce of the rank's data; the results, and each call's
    route (algorithm, coordinator steps, rounds) and counted bytes to the other node."""
    from raycoll.world import world as the_world

    group = the_world().default
    out = []
    for dtype, op, n in cases:
        x = data(rank, (n,), dtype, salt=n)
        before = group.counters()["collectives"].get("all_reduce", {})
        raycoll.all_reduce(x, op=op_of(op))
        after = group.counters()["collectives"]["all_reduce"]
        route = group.last_route
        sent = after["bytes_sent_other_node"] - before.get("bytes_sent_other_node", 0)
        out.append((x, route.algorithm, route.steps, route.rounds, sent))
    return out, ray.get_runtime_context().get_node_id()


def _check(results, cases, layout):
    nodes = {node for _, node in results}
    assert len(nodes) == 2, "the ranks really span both nodes"
    for i, (dtype, op, n) in enumerate(cases):
        want = reference(op, [data(r, (n,), dtype, salt=n) for r in range(len(results))])
        first = results[0][0][i][0]
        for rank, (got, _) in enumerate(results):
            x, algo, steps, rounds, sent = got[i]
            what = f"{layout} rank {rank} {dtype} {op} n={n}"
            native = not (dtype.startswith("complex") and op != "SUM")  # (numpy's, else)
            assert (algo == "node_hierarchical") == native, (what, algo)
            if native:  # one native call: no coordinator step but the first call's set-up
                assert rounds >= (1 if sent else 0), what
                assert set(steps) <= {"setup"} and (i == 0 or steps == ()), (what, steps)
            if want.dtype.kind in "fc":
                np.testing.assert_allclose(x, want, rtol=1e-4, atol=1e-5, err_msg=what)
            else:
                np.testing.assert_array_equal(x, want, err_msg=what)
            # every rank holds bitwise the same result (the node's partial reduced in
            # local-rank order, the nodes' in node order)
            assert not native or x.tobytes() == first.tobytes(), what


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_all_reduce_every_op_and_dtype_small_and_streamed(two_nodes, layout):
    """Every op on every dtype sample, a small buffer (one segment step, one exchange) and
    one streamed through a small segment in many chunks of uneven parts; then, on the
    default 4 MiB segment, buffers past a half (2 MiB)."""
    small_segment = [(dt, op, n) for dt in DTYPES for op in OPS_BY_KIND[np.dtype(dt).kind]
                     for n in (5, 20_011)]
    default_segment = [("float32", "SUM", 1_500_001), ("float64", "AVG", 700_001),
                       ("int32", "MAX", 4), ("float32", "SUM", 1)]
    actors = _actors(layout)
    try:
        results = run_on(actors, _reduce_every_case, (small_segment,), timeout=240,
                         group_name=f"node-seg-small-{layout}",
                         options={"node_segment_bytes": 65536, "cost_model": SOCKET_BYTES})
        _check(results, small_segment, layout)
        results = run_on(actors, _reduce_every_case, (default_segment,), timeout=240,
                         group_name=f"node-seg-default-{layout}",
                         options={"cost_model": SOCKET_BYTES})
        _check(results, default_segment, layout)
        if layout == "2+2":
            # a small all_reduce (4 int32): one round, each rank sends its node's partial
            # (16 bytes) to its rail peer once; a streamed one sends its part of each chunk
            for got, _ in results:
                assert got[2][3:] == (1, 16), got[2][1:]
            for node in ((0, 1), (2, 3)):  # each node sends the buffer out once, in parts
                assert sum(results[r][0][0][4] for r in node) == 1_500_001 * 4
    finally:
        for a in actors:
            ray.kill(a)


def _move_every_case(rank, sizes):
    """broadcast and reduce from every root and all_gather (list, and into one tensor) of each size;
    the results and the algorithm each call took."""
    from raycoll.world import world as the_world

    group = the_world().default
    w = raycoll.get_world_size()
    out = []
    for n in sizes:
        for root in range(w):
            x = data(rank, (n,), "float32", salt=root)
            raycoll.broadcast(x, src=root)
            out.append((x, group.last_route.algorithm))
            y = data(rank, (n,), "int64", salt=root)
            raycoll.reduce(y, dst=root)  # the others' buffers stay as they were
            out.append((y, group.last_route.algorithm))
        rs = np.empty(n, dtype=np.int64)
        raycoll.reduce_scatter_tensor(rs, data(rank, (n * w,), "int64", salt=7))
        out.append((rs, group.last_route.algorithm))
        rs_list = np.empty(n, dtype=np.float64)
        raycoll.reduce_scatter(rs_list, [data(rank, (n,), "float64", salt=j) for j in range(w)],
                               op=raycoll.ReduceOp.AVG)
        out.append((rs_list, group.last_route.algorithm))
        mine = data(rank, (n,), "int64")
        lst = [np.empty(n, dtype=np.int64) for _ in range(w)]
        raycoll.all_gather(lst, mine)
        out.append((np.concatenate(lst), group.last_route.algorithm))
        whole = np.empty(n * w, dtype=np.int64)
        raycoll.all_gather_into_tensor(whole, mine)
        out.append((whole, group.last_route.algorithm))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_broadcast_reduce_reduce_scatter_and_all_gather_node_aware(two_nodes, layout):
    """broadcast and reduce from every root, reduce_scatter (one tensor, and a list with
    AVG) and all_gather, small and streamed through a small segment: right against numpy (a
    reduce leaves the other ranks' buffers as they were), on the node-aware plans."""
    sizes = (3, 300_001)  # 300_001 float32: past NODE_BROADCAST_BYTES (1 MiB)
    actors = _actors(layout)
    try:
        results = run_on(actors, _move_every_case, (sizes,), timeout=240,
                         group_name=f"node-seg-move-{layout}",
                         options={"node_segment_bytes": 65536, "cost_model": SOCKET_BYTES})
    finally:
        for a in actors:
            ray.kill(a)
    w = len(actors)
    ids = tuple(str(n) for n in LAYOUTS[layout])
    model = CostModel.of(SOCKET_BYTES)

    def node(collective, nbytes, itemsize, root):  # the planner's choice, the test's model
        # (the Ray nodes share this machine: its cores, NodePaths._machines)
        return node_plan_wins(collective, ids, nbytes, itemsize, 32768, model, root,
                              os.cpu_count() or 1, ("host",) * w)

    for rank, got in enumerate(results):
        wants = []
        for n in sizes:
            for root in range(w):
                # (a broadcast under NODE_BROADCAST_BYTES keeps the socket schedule, as a
                # reduce where the flat schedule's nodes move fewer bytes: 2 + 2's small
                # plan sends the whole buffer on both rails)
                wants.append((data(root, (n,), "float32", salt=root),
                              node("broadcast", n * 4, 4, root)))
                mine = data(rank, (n,), "int64", salt=root)
                wants.append((sum(data(r, (n,), "int64", salt=root) for r in range(w))
                              if rank == root else mine, node("reduce", n * 8, 8, root)))
            rs = sum(data(r, (n * w,), "int64", salt=7) for r in range(w))
            wants.append((rs[rank * n:(rank + 1) * n], True))
            wants.append((sum(data(r, (n,), "float64", salt=rank) for r in range(w)) / w, True))
            gathered = np.concatenate([data(r, (n,), "int64") for r in range(w)])
            wants += [(gathered, True), (gathered, True)]
        assert len(got) == len(wants)
        assert sum(hier for _, hier in wants) >= len(wants) * 2 // 3, wants  # (plans tested)
        for i, ((x, algo), (want, hier)) in enumerate(zip(got, wants)):
            assert (algo == "node_hierarchical") == hier, (layout, rank, i, algo)
            if want.dtype.kind == "f" and want.dtype.itemsize == 8:  # (AVG's sums' order)
                np.testing.assert_allclose(x, want, rtol=1e-12, atol=1e-12,
                                           err_msg=f"{layout} {rank} {i}")
            else:
                np.testing.assert_array_equal(x, want, err_msg=f"{layout} rank {rank} case {i}")


def _mismatched(rank, odd):
    """A first all_reduce to set the segments up, then one where rank ``odd`` passes another
    shape (past the small form: streamed), then one all agree on."""
    out = []
    raycoll.all_reduce(np.ones(8))
    x = np.ones(100_001 if rank == odd else 100_000)
    try:
        raycoll.all_reduce(x)
        out.append(None)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.append((type(exc).__name__, str(exc)))
    y = np.full(5, float(rank))
    raycoll.all_reduce(y)
    out.append(float(y[0]))
    return out


@pytest.mark.timeout(300)
def test_a_shape_mismatch_fails_every_rank_and_the_group_goes_on(two_nodes):
    """2 + 2 ranks: rank 1 passes another shape: every rank fails the call with
    ``CollectiveMismatchError`` (rank 1's node-mate naming the shapes, from the segment's
    fingerprints), and the next all_reduce is right on every rank."""
    actors = _actors("2+2")
    try:
        got = run_on(actors, _mismatched, (1,), group_name="node-seg-mismatch", timeout=120)
    finally:
        for a in actors:
            ray.kill(a)
    for rank, (failure, after) in enumerate(got):
        assert failure is not None and failure[0] == "CollectiveMismatchError", (rank, failure)
        assert after == 6.0, (rank, after)
    assert "shape" in got[0][0][1], got[0][0]


def _socket_schedule(rank):
    x = np.full(1000, float(rank + 1))
    raycoll.all_reduce(x)
    from raycoll.world import world as the_world

    return float(x[0]), the_world().default.last_route.algorithm


@pytest.mark.timeout(300)
def test_transport_tcp_and_a_forced_algorithm_keep_the_socket_schedules(two_nodes):
    """``transport="tcp"`` or a forced ``all_reduce_algo``: no node segment, the socket
    schedule named."""
    actors = _actors("2+2")
    try:
        for options, algo in (({"transport": "tcp"}, None),
                              ({"all_reduce_algo": "ring"}, "ring")):
            got = run_on(actors, _socket_schedule, (), group_name="node-seg-off",
                         timeout=120, options=options)
            for value, used in got:
                assert value == 10.0
                assert used != "node_hierarchical" and (algo is None or used == algo), used
    finally:
        for a in actors:
            ray.kill(a)


def _reduce_until_failure(rank, seconds):
    from raycoll.world import world as the_world

    x = np.ones(1_000_000)  # 8 MB: streamed through the segment in many steps
    start = time.time()
    done, algo = 0, None
    try:
        while time.time() - start < seconds:
            raycoll.all_reduce(x)
            x[:] = 1.0
            done += 1
            algo = the_world().default.last_route.algorithm
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "msg": str(exc), "t": time.time(), "done": done,
                "algo": algo, "failed_ranks": list(getattr(exc, "failed_ranks", ()))}
    return {"type": None, "done": done, "algo": algo}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("killed", [1, 2], ids=["node-mate", "other-node"])
def test_a_killed_rank_fails_every_survivor_within_seconds(two_nodes, killed):
    """2 + 2 ranks streaming hierarchical all_reduces; rank ``killed`` SIGKILLed (rank 0's
    node-mate, or a rank on the other node): every survivor fails with ``RankFailedError``
    naming it within seconds."""
    actors = _actors("2+2")
    raycoll.create_group(actors, group_name="node-seg-kill", timeout=120)
    try:
        refs = [a.run.remote(_reduce_until_failure, r, (60.0,), {})
                for r, a in enumerate(actors)]
        time.sleep(3.0)  # well inside the loop
        killed_at = time.time()
        ray.kill(actors[killed], no_restart=True)
        for res in ray.get([r for i, r in enumerate(refs) if i != killed], timeout=120):
            assert res["type"] == "RankFailedError", res
            assert res["done"] > 0 and res["algo"] == "node_hierarchical", res
            assert res["failed_ranks"] == [killed], res
            assert res["t"] - killed_at < 10.0, (res["t"] - killed_at, res["msg"])
    finally:
        raycoll.destroy_group("node-seg-kill")
        for a in actors:
            ray.kill(a)


def _stall_then_reduce(rank, stalled, head, seconds):
    """An all_reduce on the hierarchical plan (the path set up by a first one); rank
    ``stalled`` sleeps ``seconds`` before the second, the ranks but it and ``head`` 1.5 s
    (so that ``head``'s wait times out first): every rank's error, as a dict."""
    x = np.ones(8)
    raycoll.all_reduce(x)
    raycoll.barrier()
    if rank == stalled:
        time.sleep(seconds)
    elif rank != head:
        time.sleep(1.5)
    try:
        raycoll.all_reduce(x)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "msg": str(exc),
                "missing": list(getattr(exc, "missing", None) or ())}
    return {"type": None}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stalled,head", [(1, 2), (3, 0)], ids=["node-mate", "other-node"])
def test_a_timeout_names_the_stalled_rank_on_every_rank(two_nodes, stalled, head):
    """2 + 2 ranks, rank ``stalled`` late past the timeout. Rank ``head``, whose wait times
    out first, waits on a rank that itself waits for the stalled one (rank 2's socket step
    on rank 0, which waits at its segment step for rank 1; rank 0's socket step on rank 2,
    which waits at its segment step for rank 3): it names the stalled rank, not the rank it
    waited on; so does every rank's error (the group breaks with it), the stalled rank's own
    included."""
    actors = _actors("2+2")
    ray.get([a.__ray_ready__.remote() for a in actors], timeout=60)
    name = f"node-seg-stall-{stalled}"
    raycoll.create_group(actors, group_name=name, timeout=5.0)  # the calls' timeout too
    try:
        got = ray.get([a.run.remote(_stall_then_reduce, r, (stalled, head, 10.0), {})
                       for r, a in enumerate(actors)], timeout=120)
    finally:
        raycoll.destroy_group(name)
        for a in actors:
            ray.kill(a)
    for rank, res in enumerate(got):
        assert res["type"] == "DistTimeoutError", (rank, res)
        assert f"ranks [{stalled}] never arrived" in res["msg"], (rank, res["msg"])


def _broadcast_from_every_root(rank, n):
    """broadcast of ``n`` float32 from every root: the results, the algorithm and the bytes
    this rank sent to other nodes, each call."""
    from raycoll.world import world as the_world

    group = the_world().default
    out = []
    for root in range(raycoll.get_world_size()):
        before = group.counters()["collectives"].get("broadcast", {})
        x = data(rank, (n,), "float32", salt=root)
        raycoll.broadcast(x, src=root)
        after = group.counters()["collectives"]["broadcast"]
        sent = after["bytes_sent_other_node"] - before.get("bytes_sent_other_node", 0)
        out.append((x, group.last_route.algorithm, sent))
    return out


#: SOCKET_BYTES with a node link (``nic``) that the tree spares: on one host the nodes'
#: work is spread over the host's cores, where the star and the tree move the same bytes.
TREE_MODEL = {**SOCKET_BYTES, "nic": 1e-9}


@pytest.mark.timeout(300)
def test_broadcast_on_four_nodes_takes_the_tree_over_the_nodes(two_nodes):
    """Two more Ray nodes, ranks on nodes 0 1 0 2 3 (interleaved): a 1.2 MB broadcast from
    every root is right on every rank, on the node plan, and as the tree over the nodes: 3
    buffers cross between nodes, 2 of them out of the root's node (the star: 3)."""
    from raycoll.algorithms.planner import broadcast_tree

    extra = [two_nodes.add_node(num_cpus=1, resources={f"node{i}": 8},
                                object_store_memory=100 * 1024 ** 2) for i in (2, 3)]
    placement = (0, 1, 0, 2, 3)
    worker = ray.remote(RankWorker)
    actors = [worker.options(num_cpus=0, resources={f"node{m}": 1}).remote()
              for m in placement]
    n = 300_001  # float32: past NODE_BROADCAST_BYTES
    try:
        results = run_on(actors, _broadcast_from_every_root, (n,), timeout=240,
                         group_name="node-seg-tree",
                         options={"node_segment_bytes": 65536, "cost_model": TREE_MODEL})
    finally:
        for a in actors:
            ray.kill(a)
        for node in extra:
            two_nodes.remove_node(node)
    ids = tuple(str(m) for m in placement)
    w = len(placement)
    for root in range(w):  # (the planner's choice with the test's model: the tree)
        assert broadcast_tree(ids, n * 4, 32768, CostModel.of(TREE_MODEL), root,
                              os.cpu_count() or 1, ("host",) * w)
        for rank in range(w):
            x, algo, _ = results[rank][root]
            assert algo == "node_hierarchical", (root, rank, algo)
            np.testing.assert_array_equal(x, data(root, (n,), "float32", salt=root),
                                          err_msg=f"root {root} rank {rank}")
        sent = [results[rank][root][2] for rank in range(w)]
        assert sum(sent) == 3 * n * 4, (root, sent)
        home = [r for r in range(w) if placement[r] == placement[root]]
        assert sum(sent[r] for r in home) == 2 * n * 4, (root, sent)
