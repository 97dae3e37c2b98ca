"""Collectives spanning two Ray nodes (``ray.cluster_utils.Cluster`` on this machine): every
collective over direct connections, a rank killed mid-stream named within seconds (a rank on
the other node, or a node-mate), the two-level all_reduce's bytes between nodes, 3 + 1 ranks
with every algorithm against numpy and each rank's counts equal to the schedule's (every
step on the native executor: no setup step), an elastic group (a rank SIGKILLed, the
survivors on both nodes shrink, a replacement grows the group back); a Ray Direct Transport
object (raycoll.rdt) crossing the nodes over the producer's pull server."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

from helpers import every_op

import raycoll
from raycoll.launch import RankWorker, run_on

pytestmark = pytest.mark.cluster


def _spanning(rank, world_size):
    out = {"node": ray.get_runtime_context().get_node_id()}
    small = np.full(3, float(rank + 1))
    raycoll.all_reduce(small)
    out["small"] = small.tolist()
    big = np.arange(300_000, dtype=np.float32) * (rank + 1)  # beyond inline: object refs
    raycoll.all_reduce(big)
    out["big"] = (float(big[1]), float(big[-1]))
    lst = [np.empty(100_000, dtype=np.float64) for _ in range(world_size)]
    raycoll.all_gather(lst, np.full(100_000, float(rank)))
    out["gather"] = [float(x[0]) for x in lst]
    b = np.full(200_000, float(rank))
    raycoll.broadcast(b, src=world_size - 1)
    out["bcast"] = float(b[-1])
    rs = np.empty(50_000, dtype=np.float32)
    raycoll.reduce_scatter_tensor(rs, np.full(50_000 * world_size, float(rank), dtype=np.float32))
    out["rs"] = float(rs[0])
    outs = [np.empty(40_000) for _ in range(world_size)]
    raycoll.all_to_all(outs, [np.full(40_000, float(10 * rank + j)) for j in range(world_size)])
    out["a2a"] = [float(o[0]) for o in outs]
    return out


@pytest.mark.timeout(300)
def test_collectives_across_two_nodes(two_nodes):
    worker = ray.remote(RankWorker)
    actors = [worker.options(num_cpus=0, resources={f"node{r % 2}": 1}).remote() for r in range(4)]
    try:
        results = run_on(actors, _spanning, (4,), group_name="two-nodes", timeout=120)
    finally:
        for a in actors:
            ray.kill(a)
    assert len({r["node"] for r in results}) == 2  # really spread over both nodes
    for rank, got in enumerate(results):
        assert got["small"] == [10.0] * 3
        assert got["big"] == (10.0, 299_999.0 * 10)
        assert got["gather"] == [0.0, 1.0, 2.0, 3.0]
        assert got["bcast"] == 3.0
        assert got["rs"] == 6.0
        assert got["a2a"] == [float(10 * s + rank) for s in range(4)]


@pytest.mark.timeout(300)
def test_every_collective_and_p2p_across_two_nodes_over_direct_connections(two_nodes):
    """Four ranks, two per node: the group runs on direct connections (transport "tcp"),
    every collective and point-to-point call right against numpy, small and streamed."""
    worker = ray.remote(RankWorker)
    actors = [worker.options(num_cpus=0, resources={f"node{r // 2}": 1}).remote() for r in range(4)]
    try:
        for n in (7, 300_000):
            results = run_on(actors, every_op, (4, n), group_name=f"every-{n}", timeout=120)
            for rank, (bad, transport) in enumerate(results):
                assert transport == "tcp", (rank, transport)
                assert bad == [], (rank, n, bad)
    finally:
        for a in actors:
            ray.kill(a)


def _stream_until_failure(rank, seconds):
    import time as _time

    x = np.ones(4_000_000)  # 32 MB: every all_reduce streams in many rounds
    start = _time.time()
    try:
        while _time.time() - start < seconds:
            raycoll.all_reduce(x)
            x[:] = 1.0
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "msg": str(exc), "t": _time.time(),
                "failed_ranks": list(getattr(exc, "failed_ranks", ()))}
    return {"type": None}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("killed", [
    1,  # ranks 0 and 2 share a node; 1 is on the other node
    2,  # rank 0 loses its node-mate
], ids=["other-node", "node-mate"])
def test_a_rank_killed_mid_stream_across_nodes_fails_the_others_within_seconds(two_nodes, killed):
    worker = ray.remote(RankWorker)
    actors = [worker.options(num_cpus=0, resources={f"node{r % 2}": 1}).remote() for r in range(3)]
    raycoll.create_group(actors, group_name="kill-mid-stream", timeout=120)
    try:
        refs = [a.run.remote(_stream_until_failure, r, (60.0,), {}) for r, a in enumerate(actors)]
        import time as _time

        _time.sleep(3.0)  # well inside the streaming loop
        killed_at = _time.time()
        ray.kill(actors[killed], no_restart=True)
        for res in ray.get([r for i, r in enumerate(refs) if i != killed], timeout=120):
            assert res["type"] == "RankFailedError", res
            assert res["failed_ranks"] == [killed], res
            assert f"rank {killed}" in res["msg"], res
            assert res["t"] - killed_at < 5.0, (res["t"] - killed_at, res["msg"])
    finally:
        raycoll.destroy_group("kill-mid-stream")
        for a in actors:
            ray.kill(a)


def _torchrun_env(rank):
    import os

    return {"node": ray.get_runtime_context().get_node_id(),
            **{k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}}


@pytest.mark.timeout(300)
def test_spawn_environment_counts_local_ranks_per_node(two_nodes):
    worker = ray.remote(RankWorker)
    actors = [worker.options(num_cpus=0, resources={f"node{r % 2}": 1}).remote() for r in range(4)]
    try:  # spawn's path (torchrun_env=True), with the ranks placed by hand: 0, 2 | 1, 3
        results = run_on(actors, _torchrun_env, group_name="env-two-nodes", timeout=120,
                         torchrun_env=True)
    finally:
        for a in actors:
            ray.kill(a)
    assert results[0]["node"] == results[2]["node"] != results[1]["node"] == results[3]["node"]
    assert [(r["RANK"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"]) for r in results] == \
        [("0", "0", "2"), ("1", "0", "2"), ("2", "1", "2"), ("3", "1", "2")]


def _hierarchical(rank, n):
    from raycoll.world import world as the_world

    x = np.arange(n, dtype=np.float32) * (rank + 1)
    raycoll.all_reduce(x)
    group = the_world().default
    return {"ok": bool(np.allclose(x, np.arange(n) * 10.0)),
            "node": ray.get_runtime_context().get_node_id(),
            "algorithm": group.last_route.algorithm,
            "counters": group.counters()["collectives"]["all_reduce"]}


@pytest.mark.timeout(300)
def test_hierarchical_all_reduce_sends_2_m_minus_1_over_m_n_a_node_between_real_nodes(two_nodes):
    """Four ranks, two on each of two Ray nodes: the node-aware all_reduce sends
    2 (M - 1) / M * n bytes out of each node (n here: M = 2), half what each node sends in a
    flat ring over the same ranks, counted exactly on the ranks' direct connections."""
    worker = ray.remote(RankWorker)
    actors = [worker.options(num_cpus=0, resources={f"node{r // 2}": 1}).remote() for r in range(4)]
    n = 4 * 1024
    try:
        got = {algo: run_on(actors, _hierarchical, (n,), group_name=f"hier-{algo}", timeout=120,
                            options={"all_reduce_algo": algo})
               for algo in ("hierarchical", "ring")}
    finally:
        for a in actors:
            ray.kill(a)
    nbytes = n * 4
    for algo, results in got.items():
        assert all(r["ok"] and r["algorithm"] == algo for r in results), results
        nodes = {r["node"] for r in results}
        assert len(nodes) == 2
        out = {node: sum(r["counters"]["bytes_sent_other_node"] for r in results
                         if r["node"] == node) for node in nodes}
        if algo == "hierarchical":
            assert set(out.values()) == {2 * (2 - 1) * nbytes // 2}, out
        else:  # a ring over 0-1-2-3: one rank a node sends every step to the other node
            assert set(out.values()) == {2 * 3 * nbytes // 4}, out


def _counts(rank, n):
    from raycoll.world import world as the_world

    x = np.arange(n, dtype=np.float32) * (rank + 1)
    raycoll.all_reduce(x)
    group = the_world().default
    w = raycoll.get_world_size()
    return {"ok": bool(np.allclose(x, np.arange(n) * (w * (w + 1) / 2))),
            "algorithm": group.last_route.algorithm, "counters": group.counters(),
            "steps": group.last_route.steps}


def _three_and_one():
    worker = ray.remote(RankWorker)
    return [worker.options(num_cpus=0, resources={f"node{int(r == 3)}": 1}).remote()
            for r in range(4)]


@pytest.mark.timeout(300)
def test_three_and_one_ranks_run_every_all_reduce_natively_with_the_schedules_exact_counts(
        two_nodes):
    """Ranks 0-2 on one Ray node, rank 3 on the other: every all_reduce algorithm right, each
    rank's counted traffic the schedule's formula, and no setup step (no node lane to set
    up: the native executor runs every step, inside the node over Unix sockets)."""
    from raycoll.algorithms.catalog import build
    from raycoll.algorithms.counters import expected
    from raycoll.algorithms.schedule import ALGORITHMS
    from raycoll.algorithms.topology import Topology

    actors = _three_and_one()
    n = 3 * 1024
    topo = Topology([0, 0, 0, 1])
    try:
        for algo in [a for a in ALGORITHMS["all_reduce"] if a not in ("direct", "direct_rsag")]:
            got = run_on(actors, _counts, (n,), group_name=f"three-one-{algo}", timeout=120,
                         options={"all_reduce_algo": algo})
            want = expected(build("all_reduce", algo, topo, n), topo, 4)
            for rank, (g, w) in enumerate(zip(got, want)):
                assert g["ok"] and g["algorithm"] == algo, (algo, rank, g)
                assert g["steps"] == (), g
                assert g["counters"]["collectives"]["all_reduce"] == w, (algo, rank)
    finally:
        for a in actors:
            ray.kill(a)


@pytest.mark.timeout(300)
def test_every_collective_on_three_and_one_ranks_matches_numpy(two_nodes):
    """3 + 1 ranks, each collective forced to one scheduled algorithm after another, small
    and pipelined in segments: every collective and point-to-point call right against
    numpy."""
    from raycoll.algorithms.schedule import ALGORITHMS

    options = {"all_reduce": "all_reduce_algo", "reduce_scatter": "reduce_scatter_algo",
               "all_gather": "all_gather_algo", "broadcast": "broadcast_algo",
               "reduce": "reduce_algo"}
    scheduled = {c: [a for a in algos if a not in ("direct", "direct_rsag")]
                 for c, algos in ALGORITHMS.items()}
    actors = _three_and_one()
    try:
        for i in range(max(len(a) for a in scheduled.values())):
            forced = {"stream_bytes": 65536,
                      **{options[c]: a[i % len(a)] for c, a in scheduled.items()}}
            for n in (7, 40_003):
                results = run_on(actors, every_op, (4, n), group_name=f"three-one-{i}-{n}",
                                 timeout=120, options=forced)
                for rank, (bad, transport) in enumerate(results):
                    assert transport == "tcp", (rank, transport)
                    assert bad == [], (rank, n, forced, bad)
    finally:
        for a in actors:
            ray.kill(a)


def _pid_of(rank):
    import os

    return os.getpid()


def _reduce_until_failure(rank, marker):
    """all_reduces until one fails (RankFailedError expected); the first one done writes
    ``marker.<rank>``."""
    done = 0
    while True:
        x = np.full(8192, rank + 1.0)
        try:
            raycoll.all_reduce(x)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"done": done, "type": type(exc).__name__,
                    "failed": list(getattr(exc, "failed_ranks", ()))}
        done += 1
        if done == 1:
            open(f"{marker}.{rank}", "w").close()


def _elastic_reduce(rank, excluded, admit):
    """Shrink out ``excluded`` (or, with ``admit``, let the grow's newcomers in; or neither:
    a newcomer), then one all_reduce of ``rank + 1``."""
    if excluded:
        raycoll.shrink_group(excluded)
    if admit:
        raycoll.admit_new_ranks(timeout=60)
    x = np.full(1000, raycoll.get_rank() + 1.0)
    raycoll.all_reduce(x)
    return (raycoll.get_rank(), raycoll.get_world_size(), float(x[0]), bool((x == x[0]).all()))


@pytest.mark.timeout(300)
def test_elastic_across_nodes_a_killed_rank_shrinks_out_and_a_replacement_grows_in(two_nodes,
                                                                                    tmp_path):
    """2 + 2 ranks on two Ray nodes; rank 3's process (node 1) SIGKILLed mid-stream: the
    survivors, on both nodes, fail naming it, shrink to 3 ranks and reduce right; a
    replacement on node 1 grows the group back to 4, every rank's result checked."""
    import os
    import signal

    worker = ray.remote(RankWorker)
    actors = [worker.options(num_cpus=0, resources={f"node{r // 2}": 1}).remote()
              for r in range(4)]
    newcomer = worker.options(num_cpus=0, resources={"node1": 1}).remote()
    name = "elastic-two-nodes"
    raycoll.create_group(actors, group_name=name, timeout=60)
    try:
        pids = ray.get([a.run.remote(_pid_of, r, (), {}) for r, a in enumerate(actors)],
                       timeout=60)
        marker = str(tmp_path / "first")
        refs = [a.run.remote(_reduce_until_failure, r, (marker,), {})
                for r, a in enumerate(actors)]
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{marker}.{r}") for r in range(4)):
            assert time.monotonic() < deadline, "the stream of all_reduces never started"
            time.sleep(0.01)
        os.kill(pids[3], signal.SIGKILL)
        for out in ray.get(refs[:3], timeout=60):
            assert out["type"] == "RankFailedError" and out["failed"] == [3], out
        shrunk = ray.get([actors[r].run.remote(_elastic_reduce, r, ([3], False), {})
                          for r in range(3)], timeout=60)
        assert shrunk == [(r, 3, 6.0, True) for r in range(3)], shrunk
        refs = [actors[r].run.remote(_elastic_reduce, r, ([], True), {}) for r in range(3)]
        raycoll.grow_group(name, [newcomer], timeout=60)
        refs.append(newcomer.run.remote(_elastic_reduce, 3, ([], False), {}))
        grown = ray.get(refs, timeout=60)
        assert grown == [(r, 4, 10.0, True) for r in range(4)], grown
    finally:
        try:
            raycoll.destroy_group(name)
        except Exception:  # noqa: BLE001 - the test may have failed half way
            pass
        for a in actors + [newcomer]:
            ray.kill(a)


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_ray_direct_transport_object_crosses_nodes_over_tcp(two_nodes):
    """``tensor_transport="raycoll"`` (raycoll.rdt) between actors on two nodes: a small object
    inline, a large one pulled from the producer's server, and dropped once freed."""
    torch = pytest.importorskip("torch")
    import raycoll.rdt

    raycoll.rdt.register()

    @ray.remote(num_cpus=0, resources={"node0": 1})
    class Producer:
        def __init__(self):
            import raycoll.transport.pull  # noqa: F401 - before Ray's transfer thread does

        @ray.method(tensor_transport="raycoll")
        def make(self, n):
            return [torch.arange(n, dtype=torch.float64), torch.ones(3, dtype=torch.int8)]

        def kept(self):
            from raycoll.transport.pull import keeper

            return len(keeper())

    @ray.remote(num_cpus=0, resources={"node1": 1}, enable_tensor_transport=True)
    class Consumer:
        def __init__(self):
            import raycoll.transport.pull  # noqa: F401

        def sums(self, ts):
            from raycoll.transport.pull import puller

            return [float(t.sum()) for t in ts], dict(puller().by_path)

    p, c = Producer.remote(), Consumer.remote()
    try:
        for n, path in ((10, "inline"), (1_000_000, "socket")):  # 80 B, then 8 MB
            sums, paths = ray.get(c.sums.remote(p.make.remote(n)), timeout=60)
            assert sums == [n * (n - 1) / 2, 3.0] and paths[path] == 1 and paths["cma"] == 0
        for _ in range(100):
            if ray.get(p.kept.remote(), timeout=30) == 0:
                break
            time.sleep(0.1)
        assert ray.get(p.kept.remote(), timeout=30) == 0
    finally:
        for a in (p, c):
            ray.kill(a)


def _choices(rank, sizes):
    from raycoll.world import world as the_world

    out = []
    for n in sizes:
        x = np.arange(n, dtype=np.float32) % 7 * (rank + 1)
        raycoll.all_reduce(x)
        out.append((bool(np.array_equal(x, np.arange(n, dtype=np.float32) % 7 * 10)),
                    the_world().default.last_route.algorithm))
    return out


@pytest.mark.timeout(300)
def test_three_and_one_ranks_on_one_host_take_the_planners_choice(two_nodes):
    """3 + 1 ranks on two Ray nodes of this machine, the default group: all_reduce of 1 MiB
    and 8 MiB, right, each run as the planner prices it on the host's cores (the same on
    every rank): the plan or its cheapest flat schedule. On the project's 2-core machine,
    ``halving_doubling`` at 1 MiB and the plan at 8 MiB, what measured faster there
    (benchmarks/BENCHMARKS.md, "The planner")."""
    import os

    from raycoll.algorithms.cost import DEFAULT
    from raycoll.algorithms.planner import flat_times, node_plan_wins
    from raycoll.transport.segment import SEGMENT_BYTES

    ids, cores, hosts = ("a", "a", "a", "b"), os.cpu_count() or 1, ("host",) * 4
    want = []
    for nbytes in (1 << 20, 8 << 20):
        flat = flat_times("all_reduce", ids, nbytes, 4, DEFAULT, 0, cores, hosts)
        plan = node_plan_wins("all_reduce", ids, nbytes, 4, SEGMENT_BYTES // 2, DEFAULT, 0,
                              cores, hosts)
        want.append((True, "node_hierarchical" if plan else min(flat, key=flat.get)))
    if cores == 2:
        assert [w[1] for w in want] == ["halving_doubling", "node_hierarchical"]
    actors = _three_and_one()
    try:
        got = run_on(actors, _choices, ([(1 << 20) // 4, (8 << 20) // 4],),
                     group_name="three-one-choices", timeout=200)
    finally:
        for a in actors:
            ray.kill(a)
    for rank in range(4):
        assert got[rank] == want, (rank, got[rank], want)
