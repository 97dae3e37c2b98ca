"""The algorithms' costs, exactly (raycoll.algorithms.counters: bytes split same node /
other node, messages, rounds, peers, for each algorithm's formula) and the cost model's
choice (raycoll.algorithms.cost), without Ray."""

from __future__ import annotations

import math
from typing import List

import pytest

from raycoll.algorithms.catalog import build
from raycoll.algorithms.cost import DEFAULT, CostModel, LinkCost, choose, predict
from raycoll.algorithms.counters import COUNTER_NAMES, expected
from raycoll.algorithms.schedule import ALGORITHMS
from raycoll.algorithms.topology import Topology
from raycoll.options import GroupOptions

WORLDS = [3, 4, 5, 7, 8, 16]
NODE_MAPS = [[4], [2, 2], [3, 1], [4, 4], [2, 2, 2, 2]]
ITEM = 4


def _n(world: int) -> int:
    return world * 8 * 3  # divisible by W, by 8 and by every node count here


def _sent(c: dict) -> int:
    return c["bytes_sent_same_node"] + c["bytes_sent_other_node"]


def _recv(c: dict) -> int:
    return c["bytes_recv_same_node"] + c["bytes_recv_other_node"]


@pytest.mark.parametrize("world", WORLDS)
def test_ring_all_reduce_sends_2_w_minus_1_over_w_n_a_rank_to_its_two_neighbours(world):
    n = _n(world)
    counts = expected(build("all_reduce", "ring", Topology.flat(world), n), Topology.flat(world),
                      ITEM)
    for c in counts:
        assert _sent(c) == _recv(c) == 2 * (world - 1) * n // world * ITEM
        assert c["messages_sent"] == c["messages_recv"] == c["rounds"] == 2 * (world - 1)
        assert c["peers"] == 2
        assert c["bytes_sent_other_node"] == 0


@pytest.mark.parametrize("world", WORLDS)
def test_recursive_doubling_takes_log2_rounds_and_halving_doubling_the_optimal_bytes(world):
    n, topo = _n(world), Topology.flat(world)
    p = 2 ** int(math.log2(world))
    rem = world - p
    doubling = expected(build("all_reduce", "recursive_doubling", topo, n), topo, ITEM)
    rabens = expected(build("all_reduce", "halving_doubling", topo, n), topo, ITEM)
    for rank in range(world):
        folded = rank < 2 * rem and rank % 2 == 0  # hands its data over and sits out
        if folded:
            assert doubling[rank]["rounds"] == rabens[rank]["rounds"] == 2
            assert doubling[rank]["peers"] == 1
            continue
        extra = 1 if rank < 2 * rem else 0  # the fold and the unfold: one round each
        assert doubling[rank]["rounds"] == int(math.log2(p)) + 2 * extra
        assert _sent(doubling[rank]) == (int(math.log2(p)) + extra) * n * ITEM
        assert rabens[rank]["rounds"] == 2 * int(math.log2(p)) + 2 * extra
        # survivors: 2 (p - 1) / p * n over the butterfly, plus the unfold's copy
        assert _sent(rabens[rank]) == (2 * (p - 1) * n // p + extra * n) * ITEM


@pytest.mark.parametrize("sizes", NODE_MAPS)
def test_hierarchical_all_reduce_sends_2_m_minus_1_over_m_n_a_node_between_nodes(sizes):
    topo = Topology.from_sizes(sizes)
    m, n = topo.num_nodes, 240
    counts = expected(build("all_reduce", "hierarchical", topo, n), topo, ITEM)
    for node, members in enumerate(topo.node_ranks):
        out = sum(counts[r]["bytes_sent_other_node"] for r in members)
        into = sum(counts[r]["bytes_recv_other_node"] for r in members)
        assert out == into == 2 * (m - 1) * n // m * ITEM, (sizes, node)
    # against the flat ring, which sends 2 (W - 1) / W * n a rank, most of it between nodes
    flat = expected(build("all_reduce", "ring", topo, n), topo, ITEM)
    if m > 1:
        assert sum(c["bytes_sent_other_node"] for c in counts) \
            < sum(c["bytes_sent_other_node"] for c in flat) or m == topo.world_size


@pytest.mark.parametrize("world", WORLDS)
def test_rooted_algorithms_bytes_through_the_root(world):
    n, topo = _n(world), Topology.flat(world)
    binomial = expected(build("broadcast", "binomial", topo, n), topo, ITEM)
    vdg = expected(build("broadcast", "scatter_allgather", topo, n), topo, ITEM)
    star = expected(build("broadcast", "direct", topo, n), topo, ITEM)
    rounds = math.ceil(math.log2(world))
    assert binomial[0]["messages_sent"] == rounds and _sent(binomial[0]) == rounds * n * ITEM
    assert all(_recv(c) == n * ITEM for c in binomial[1:])
    assert _sent(star[0]) == (world - 1) * n * ITEM and star[0]["peers"] == world - 1
    # scatter + all-gather: the root sends about 2 n, not n log2 W (n - its block in the
    # scatter, then W - 1 blocks around the ring), every other rank W - 1 blocks or more
    assert _sent(vdg[0]) == 2 * (world - 1) * (n // world) * ITEM
    assert all(_sent(c) <= _sent(vdg[0]) for c in vdg)
    assert sum(_sent(c) for c in binomial) == sum(_recv(c) for c in binomial)


@pytest.mark.parametrize("sizes", NODE_MAPS)
@pytest.mark.parametrize("collective", list(ALGORITHMS))
def test_every_schedule_balances_and_splits_bytes_by_node(collective, sizes):
    topo = Topology.from_sizes(sizes)
    n = 240
    for algo in ALGORITHMS[collective]:
        counts = expected(build(collective, algo, topo, n), topo, ITEM)
        assert len(counts) == topo.world_size and set(counts[0]) == set(COUNTER_NAMES)
        for key in ("bytes_sent_same_node", "bytes_sent_other_node", "messages_sent"):
            recv_key = key.replace("sent", "recv")
            assert sum(c[key] for c in counts) == sum(c[recv_key] for c in counts), (algo, key)
        if topo.num_nodes == 1:
            assert all(c["bytes_sent_other_node"] == 0 for c in counts), algo


def test_ring_sockets_at_16_ranks_stay_within_4_log2_w():
    topo = Topology.flat(16)
    for collective, algo in [("all_reduce", "ring"), ("all_reduce", "recursive_doubling"),
                             ("all_reduce", "halving_doubling"), ("broadcast", "binomial")]:
        counts = expected(build(collective, algo, topo, 1600), topo, ITEM)
        # a connection each way per peer: 2 * peers sockets a rank
        assert max(2 * c["peers"] for c in counts) <= 4 * int(math.log2(16)), algo
    direct = expected(build("all_reduce", "direct", topo, 1600), topo, ITEM)
    assert max(2 * c["peers"] for c in direct) == 2 * 15


def _model(alpha: float, beta: float) -> CostModel:
    link = LinkCost(alpha, beta)
    return CostModel({"unix": link, "tcp": link}, gamma=0.0)


def test_the_model_picks_few_rounds_for_small_buffers_and_few_bytes_for_large_ones():
    topo = Topology.flat(16)
    latency_bound = _model(alpha=50e-6, beta=0.0)
    assert choose("all_reduce", topo, 4, model=latency_bound) == "recursive_doubling"
    bandwidth_bound = _model(alpha=0.0, beta=1e-9)
    big = choose("all_reduce", topo, 64 << 20, model=bandwidth_bound)
    times = predict("all_reduce", topo, 64 << 20, model=bandwidth_bound)
    assert times[big] == min(times.values())
    assert times["ring"] < times["recursive_doubling"] and times["direct"] > times["ring"]
    assert choose("broadcast", topo, 64 << 20, model=bandwidth_bound) == "scatter_allgather"
    assert choose("broadcast", topo, 4, model=latency_bound) == "binomial"


def test_at_two_ranks_every_tie_goes_to_the_direct_exchange():
    topo = Topology.flat(2)
    for nbytes in (4, 1 << 20, 64 << 20):
        assert choose("all_reduce", topo, nbytes) in ("direct", "direct_rsag")
        assert choose("broadcast", topo, nbytes) == "direct"


def test_node_aware_all_reduce_wins_when_links_between_nodes_are_slow():
    topo = Topology.from_sizes([4, 4])
    slow_between = CostModel({"unix": LinkCost(5e-6, 0.05e-9), "tcp": LinkCost(50e-6, 2e-9)},
                             gamma=0.0)
    assert choose("all_reduce", topo, 64 << 20, model=slow_between).startswith("hierarchical")


#: What ``raycoll-bench --calibrate`` measured across two netns nodes on 1 Gbit/s links
#: (benchmarks/results/netns_calibrate.txt): 1 byte each way took 2 beta = 8.4 ns.
NETNS_1GBIT = {"tcp": {"alpha": 4.4e-4, "beta": 4.18e-9}, "gamma": 6.8e-11, "nic": 8.36e-9}


def test_ranks_of_a_node_share_its_link_where_nic_is_set():
    """2+2, root 0: binomial sends two 64 MiB messages out of node 0 at once (0->2, 1->3),
    the node-aware broadcast one; over one shared 1 Gbit/s link, measured 1.13 s vs 0.56 s.
    Without ``nic`` the model saw two ranks each sending once, a tie it gave to binomial."""
    topo = Topology.from_sizes([2, 2])
    calibrated = CostModel.of(NETNS_1GBIT)
    times = predict("broadcast", topo, 64 << 20, model=calibrated)
    assert times["binomial"] == pytest.approx(2 * times["hierarchical"], rel=0.05)
    assert choose("broadcast", topo, 64 << 20, model=calibrated) == "hierarchical"
    no_nic = CostModel.of({**NETNS_1GBIT, "nic": 0})
    assert choose("broadcast", topo, 64 << 20, model=no_nic) == "binomial"
    # one message across: the link term is the one-way time the calibration measured
    assert times["hierarchical"] == pytest.approx(8.36e-9 * (64 << 20), rel=0.1)
    # the default (nic 0: Ray nodes on one machine share no link) predicts as before
    assert DEFAULT.nic == 0.0 and CostModel.of({"nic": 0}) == DEFAULT


@pytest.mark.parametrize("sizes", [[2, 2], [4, 4]])
def test_calibrated_on_a_shaped_network_the_model_picks_what_was_measured_fastest(sizes):
    """The rows of benchmarks/results/netns_calibrate.txt: large all_reduce and broadcast go
    node-aware, large reduce_scatter ring; all_gather node-aware (each block enters every other
    node once, in 2 steps: benchmarks/results/netns_all_gather_hierarchical.txt, the fastest
    forced algorithm at 1 MiB on 2+2 and 4+4 and at 64 MiB on 4+4, 1.33x the ring there)."""
    topo = Topology.from_sizes(sizes)
    model = CostModel.of(NETNS_1GBIT)
    assert choose("all_reduce", topo, 64 << 20, model=model).startswith("hierarchical")
    assert choose("broadcast", topo, 64 << 20, model=model) == "hierarchical"
    assert choose("all_gather", topo, 64 << 20, model=model) == "hierarchical"
    assert choose("reduce_scatter", topo, 64 << 20, model=model) == "ring"


def test_every_rank_makes_the_same_choice_from_the_same_inputs():
    topo = Topology(["b", "a", "b", "a", "c"])  # node ids in any order
    picks = {choose("all_reduce", topo, nbytes) for nbytes in [4] * 5}
    assert len(picks) == 1


def test_cost_model_option_is_validated_and_laid_over_the_defaults():
    model = CostModel.of({"tcp": {"alpha": 1e-5}, "gamma": 0})
    assert model.links["tcp"] == LinkCost(1e-5, DEFAULT.links["tcp"].beta)
    assert model.links["unix"] == DEFAULT.links["unix"] and model.gamma == 0.0
    assert CostModel.of(model.as_dict()) == model
    assert CostModel.of({"nic": 8e-9}).nic == 8e-9
    for bad in ({"udp": {"alpha": 1}}, {"tcp": {"alpha": -1}}, {"tcp": 3},
                {"tcp": {"alpha": float("nan")}}, {"tcp": {"latency": 1}}, {"nic": -1}):
        with pytest.raises(ValueError, match="cost_model"):
            CostModel.of(bad)
        with pytest.raises(ValueError, match="group option cost_model"):
            GroupOptions.of({"cost_model": bad})
    with pytest.raises(TypeError, match="cost_model"):
        CostModel.of([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'lane' was retired with the Ray-channel lane: .*'unix'"):
        CostModel.of({"lane": {"alpha": 1e-5}})


@pytest.mark.parametrize("name,good,bad", [
    ("all_reduce_algo", "ring", "binomial"), ("broadcast_algo", "scatter_allgather", "ring"),
    ("reduce_scatter_algo", "halving", "recursive_doubling"),
    ("all_gather_algo", "recursive_doubling", "halving"), ("reduce_algo", "rsgather", "ring"),
])
def test_forcing_an_algorithm_takes_only_that_collectives_names(name, good, bad):
    assert getattr(GroupOptions.of({name: good}), name) == good
    with pytest.raises(ValueError, match=f"group option {name}"):
        GroupOptions.of({name: bad})


def test_predicted_times_grow_with_bytes_for_every_algorithm():
    topo = Topology.from_sizes([2, 2, 2, 2])
    small: List[float] = list(predict("all_reduce", topo, 1 << 10).values())
    large: List[float] = list(predict("all_reduce", topo, 1 << 24).values())
    assert all(b > a for a, b in zip(small, large))


@pytest.mark.parametrize("collective,algo", [("all_reduce", "ring"),
                                             ("all_reduce", "halving_doubling"),
                                             ("all_reduce", "hierarchical"),
                                             ("broadcast", "scatter_allgather"),
                                             ("reduce", "binomial")])
def test_pipelined_segments_move_the_same_bytes_in_smaller_messages(collective, algo):
    topo = Topology.from_sizes([2, 2])
    n = 4000
    whole = expected(build(collective, algo, topo, n, root=1), topo, ITEM)
    piped = build(collective, algo, topo, n, root=1, segments=8)
    steps = len(build(collective, algo, topo, n // 8, root=1).steps)
    assert len(piped.steps) == steps + 7  # segment k starts k steps late
    for a, b in zip(whole, expected(piped, topo, ITEM)):
        assert _sent(a) == _sent(b) and _recv(a) == _recv(b)
        assert a["bytes_sent_other_node"] == b["bytes_sent_other_node"]
    with pytest.raises(ValueError, match="only all_reduce, broadcast, reduce are pipelined"):
        build("reduce_scatter", "ring", topo, n, segments=2)


def test_oversubscribed_ranks_take_fewer_steps():
    """Ranks that outnumber their node's cores run in turn: every step costs a wake-up
    chain, so the model trades bytes and messages for steps."""
    topo = Topology.flat(8)
    assert choose("all_reduce", topo, 4) == "recursive_doubling"
    assert choose("all_reduce", topo, 4, oversubscribed=True) == "direct"
    times = predict("all_reduce", topo, 4, oversubscribed=True)
    plain = predict("all_reduce", topo, 4)
    for algo in times:
        steps = len(build("all_reduce", algo, topo, 1).steps)
        assert times[algo] == pytest.approx(plain[algo] + steps * DEFAULT.wake)
