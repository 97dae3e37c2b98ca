"""The planner of a group on several nodes (raycoll.algorithms.planner): the hierarchical
plans and the flat socket schedules priced by one cost model, without Ray."""

from __future__ import annotations

import pytest

from raycoll.algorithms import node_plans
from raycoll.algorithms.catalog import build
from raycoll.algorithms.cost import DEFAULT, CostModel
from raycoll.algorithms.planner import (NODE_BROADCAST_BYTES, NODE_PLANS, broadcast_tree,
                                        busiest_cores, flat_times, node_plan_time,
                                        node_plan_wins, plan_time)
from raycoll.algorithms.topology import Topology

pytestmark = pytest.mark.timeout(60)

TWO_TWO = ("a", "a", "b", "b")
THREE_ONE = ("a", "a", "a", "b")
TWO_ONE_ONE = ("a", "a", "b", "c")
FOUR_TWOS = ("a", "a", "b", "b", "c", "c", "d", "d")
FOUR_ONES = ("a", "b", "c", "d")
HALF = 2 << 20  # the default segment's half


@pytest.mark.parametrize("nbytes", [4, 1 << 20, 64 << 20])
def test_the_defaults_take_the_measured_all_reduce_plan_at_2_plus_2(nbytes):
    """benchmarks/node_segment.py's cases (2 + 2 ranks, all_reduce at 4 B, 1 MiB, 64 MiB):
    the hierarchical plan, as the measured rule took it."""
    assert node_plan_wins("all_reduce", TWO_TWO, nbytes, 4, HALF, DEFAULT)


@pytest.mark.parametrize("nbytes", [4, 64 << 10, 1 << 20, 64 << 20])
def test_the_defaults_take_the_measured_all_reduce_plan_at_3_plus_1(nbytes):
    """3 + 1 ranks, all_reduce: the plan was measured faster than the socket schedules at
    4 B, 1 MiB and 64 MiB (1.12x, 1.25x, 1.61x back to back, benchmarks/BENCHMARKS.md),
    where one rank reduces and sends the whole buffer: priced by the node's ranks' work
    added up (they share its cores), not each rank's alone."""
    assert node_plan_wins("all_reduce", THREE_ONE, nbytes, 4, HALF, DEFAULT)


#: The defaults' choices, by layout and collective, at 4 B / 64 KiB / 1 MiB / 64 MiB (a
#: rank's buffer; reduce_scatter's and all_gather's the whole, so no 4 B): ``P`` the plan,
#: ``f`` a flat socket schedule.
CHOICES = {
    (TWO_TWO, "all_reduce"): "PPPP", (TWO_TWO, "reduce_scatter"): "-PPP",
    (TWO_TWO, "all_gather"): "-PPP", (TWO_TWO, "broadcast"): "ffPP",
    (THREE_ONE, "all_reduce"): "PPPP", (THREE_ONE, "reduce_scatter"): "-PfP",
    (THREE_ONE, "all_gather"): "-PPP", (THREE_ONE, "broadcast"): "ffPP",
    (TWO_ONE_ONE, "all_reduce"): "PPff", (TWO_ONE_ONE, "all_gather"): "-PPP",
    (TWO_ONE_ONE, "broadcast"): "ffPP",
    (FOUR_TWOS, "all_reduce"): "ffff", (FOUR_TWOS, "reduce_scatter"): "-PPP",
    (FOUR_TWOS, "all_gather"): "-PPP", (FOUR_TWOS, "broadcast"): "ffPP",
    (FOUR_ONES, "all_reduce"): "ffff", (FOUR_ONES, "all_gather"): "-fff",
}


@pytest.mark.parametrize("ids,collective", sorted(CHOICES))
def test_the_defaults_choices_by_layout(ids, collective):
    """2 + 2 and 3 + 1 take every plan (as measured, broadcast from 1 MiB; 3 + 1
    reduce_scatter's 1 MiB is one serial chunk, see
    :func:`test_one_serial_chunk_costs_every_ranks_work`); 2 + 1 + 1 and 4 nodes of 2
    exchange the whole buffer between every two nodes in all_reduce's plan, more than a
    ring's bytes from 1 MiB or 4 nodes; 4 nodes of 1 rank have no segment to share."""
    got = "".join("-" if size < 16 and collective in ("reduce_scatter", "all_gather") else
                  "P" if node_plan_wins(collective, ids, size, 4, HALF, DEFAULT) else "f"
                  for size in (4, 64 << 10, 1 << 20, 64 << 20))
    assert got == CHOICES[(ids, collective)]


def test_a_flat_schedule_costs_at_least_its_busiest_nodes_work():
    """3 + 1, all_reduce of 1 MiB: node ``a``'s three ranks each do a whole rank's work of
    the flat schedule; they share the node's cores, so the schedule takes at least their
    work added up, more than its critical path alone."""
    topology = Topology(THREE_ONE)
    times = flat_times("all_reduce", THREE_ONE, 1 << 20, 4, DEFAULT)
    for algo, t in times.items():
        schedule = build("all_reduce", algo, topology, (1 << 20) // 4, 0)
        native = CostModel({k: DEFAULT.links["socket"] for k in DEFAULT.links}, DEFAULT.gamma)
        work = native.work(schedule, topology, 4)
        assert t == pytest.approx(max(native.time(schedule, topology, 4),
                                      work[0] + work[1] + work[2], work[3]))
        assert t > native.time(schedule, topology, 4)


@pytest.mark.parametrize("ids", [TWO_TWO, THREE_ONE])
def test_a_broadcast_under_a_mebibyte_keeps_the_sockets_and_one_past_it_takes_the_plan(ids):
    for root in range(len(ids)):
        assert not node_plan_wins("broadcast", ids, NODE_BROADCAST_BYTES - 4, 4, HALF,
                                  DEFAULT, root)
        assert node_plan_wins("broadcast", ids, 8 * NODE_BROADCAST_BYTES, 4, HALF, DEFAULT,
                              root)


@pytest.mark.parametrize("collective", sorted(NODE_PLANS))
def test_a_dear_segment_or_nothing_to_move_keeps_the_sockets(collective):
    """A segment step priced at a second: the flat schedules; an empty buffer: no plan."""
    dear = CostModel.of({"segment": {"alpha": 1.0}})
    assert not node_plan_wins(collective, TWO_TWO, 16 << 20, 4, HALF, dear)
    assert not node_plan_wins(collective, TWO_TWO, 0, 4, HALF, DEFAULT)


def test_a_plan_is_priced_by_its_busiest_node_and_grows_with_bytes():
    """The small all_reduce of 2 + 2: one segment step and one message a rank (the model's
    alpha each), its bytes at each link's beta; a node's two ranks share its cores: their
    work added up; streamed, more."""
    model = CostModel.of({"segment": {"alpha": 1e-3, "beta": 0.0}, "socket": {"alpha": 1e-2,
                                                                              "beta": 0.0},
                          "gamma": 0.0})
    assert node_plan_time("all_reduce", TWO_TWO, 16, 4, HALF, model) == pytest.approx(22e-3)
    # 3 + 1: the third local rank gets the result in one more segment step (each local
    # rank's two steps, the rail rank's message)
    assert node_plan_time("all_reduce", THREE_ONE, 16, 4, HALF, model) == pytest.approx(16e-3)
    # one node of one rank each: the slowest rank
    assert node_plan_time("all_reduce", FOUR_ONES, 16, 4, HALF, model) == pytest.approx(3e-2)
    times = [node_plan_time("all_reduce", TWO_TWO, n, 4, HALF, DEFAULT)
             for n in (4, 1 << 20, 64 << 20)]
    assert times == sorted(times) and times[0] < times[2] / 100


def test_plan_time_counts_one_message_a_peer_a_round():
    """All_gather's local rank 0 sends its node's pieces to one peer in one round: one
    socket alpha, however many pieces."""
    model = CostModel.of({"segment": {"alpha": 0.0, "beta": 0.0}, "socket": {"alpha": 1.0,
                                                                             "beta": 0.0},
                          "gamma": 0.0})
    plans = [node_plans.all_gather(8, THREE_ONE, r, HALF, True) for r in range(4)]
    assert plan_time(plans, THREE_ONE, model) == pytest.approx(1.0)


def test_every_rank_makes_the_same_choice_from_the_same_inputs():
    for collective in NODE_PLANS:
        for nbytes in (64, 1 << 20, 8 << 20):
            answers = {node_plan_wins(collective, THREE_ONE, nbytes, 4, HALF, DEFAULT)
                       for _ in range(3)}
            assert len(answers) == 1


def test_the_cost_model_option_takes_the_native_link_classes():
    model = CostModel.of({"segment": {"alpha": 2e-6}, "socket": {"beta": 1e-9}})
    assert model.links["segment"].alpha == 2e-6
    assert model.links["socket"].beta == 1e-9
    assert CostModel.of(model.as_dict()) == model
    with pytest.raises(ValueError, match="segment.alpha"):
        CostModel.of({"segment": {"alpha": -1.0}})


@pytest.mark.parametrize("ids,tree", [(TWO_TWO, False), (TWO_ONE_ONE, False),
                                      (("a", "a", "b", "b", "c", "c"), False),
                                      (FOUR_TWOS, True), (FOUR_ONES, True),
                                      (tuple("aabcdefgh"), True)])
def test_broadcast_takes_the_tree_over_the_nodes_from_4_nodes(ids, tree):
    """The tree's root sends the buffer ceil(log2 nodes) times, the star's nodes - 1: the
    same on 3 nodes (2 and 2, the tree then one more send on another node: the star), fewer
    from 4; 2 nodes have no tree. Every root and size alike; the plan priced is the cheaper."""
    for root in range(len(ids)):
        for nbytes in (NODE_BROADCAST_BYTES, 64 << 20):
            assert broadcast_tree(ids, nbytes, HALF, DEFAULT, root) is tree
            star = plan_time([node_plans.broadcast(nbytes, ids, r, root, HALF)
                              for r in range(len(ids))], ids, DEFAULT)
            priced = node_plan_time("broadcast", ids, nbytes, 1, HALF, DEFAULT, root)
            assert (priced < star) is tree and priced <= star


def test_on_shared_node_links_the_tree_halves_the_roots_nodes_bytes_out():
    """With ``nic`` (a node's network link shared by its ranks, as on the netns harness's
    shaped links), 4 nodes of 2 ranks: the star's root node sends the buffer 3 times, the
    tree's 2, and the link prices them so: the tree."""
    model = CostModel.of({"nic": 1e-9})
    nbytes = NODE_BROADCAST_BYTES
    star = plan_time([node_plans.broadcast(nbytes, FOUR_TWOS, r, 0, HALF) for r in range(8)],
                     FOUR_TWOS, model)
    assert star == pytest.approx(3 * nbytes * 1e-9)
    assert node_plan_time("broadcast", FOUR_TWOS, nbytes, 1, HALF, model) == \
        pytest.approx(2 * nbytes * 1e-9)
    assert broadcast_tree(FOUR_TWOS, nbytes, HALF, model)


#: Ray nodes on one machine of 2 cores (this project's; ``NodePaths._machines``): one host.
ONE_HOST = {"cores": 2, "hosts": ("host",) * 4}


@pytest.mark.parametrize("nbytes,plan", [(1 << 20, False), (8 << 20, True), (64 << 20, True)])
def test_3_plus_1_all_reduce_on_one_host_takes_what_measured_faster(nbytes, plan):
    """3 + 1 ranks on two Ray nodes of one 2-core machine (benchmarks/BENCHMARKS.md, "The
    planner"): the flat socket schedule measured faster at 1 MiB (the plan one serial chunk),
    the plan from 8 MiB; the planner, given the machine's cores, picks those."""
    assert node_plan_wins("all_reduce", THREE_ONE, nbytes, 4, HALF, DEFAULT,
                          **ONE_HOST) is plan


def test_busiest_cores_spreads_a_machines_work_over_its_cores():
    work = [3.0, 3.0, 3.0, 1.0]
    assert busiest_cores(work, THREE_ONE, 1) == pytest.approx(9.0)  # one core: added up
    assert busiest_cores(work, THREE_ONE, 2) == pytest.approx(4.5)
    assert busiest_cores(work, THREE_ONE, 64) == pytest.approx(3.0)  # a core a rank
    assert busiest_cores(work, THREE_ONE, {"a": 3, "b": 1}) == pytest.approx(3.0)
    assert busiest_cores(work, ("h",) * 4, 2) == pytest.approx(5.0)  # nodes sharing a host
    for bad in (0, True, {"a": 0}):
        with pytest.raises(ValueError, match="cores: expected an int >= 1"):
            busiest_cores(work, THREE_ONE, bad)


@pytest.mark.parametrize("ids", [TWO_TWO, THREE_ONE, FOUR_TWOS])
def test_ranks_that_fit_their_cores_cost_their_critical_path(ids):
    """Nodes with a core a rank (a real cluster): a flat schedule costs its critical path and
    a plan its slowest rank (no node's work added up), each at most what it costs on one
    core a node."""
    cores = {n: len(ids) for n in ids}
    topology = Topology(ids)
    native = CostModel({k: DEFAULT.links["socket"] for k in DEFAULT.links}, DEFAULT.gamma)
    for nbytes in (1 << 20, 64 << 20):
        spread = flat_times("all_reduce", ids, nbytes, 4, DEFAULT, cores=cores)
        summed = flat_times("all_reduce", ids, nbytes, 4, DEFAULT)
        for algo, t in spread.items():
            schedule = build("all_reduce", algo, topology, nbytes // 4, 0)
            assert t == pytest.approx(native.time(schedule, topology, 4))
            assert t <= summed[algo]
        plans = [node_plans.all_reduce(nbytes // 4, 4, ids, r, HALF, False)
                 for r in range(len(ids))]
        assert plan_time(plans, ids, DEFAULT, cores) <= plan_time(plans, ids, DEFAULT)


def test_one_serial_chunk_costs_every_ranks_work():
    """A reduction of one chunk whose node funnels through fewer rails than ranks (3 + 1,
    1 MiB) runs its stages one after the other: priced at every rank's work added up (what
    one core for all of them costs), however many cores; 2 + 2 (a rail a rank) and 3 + 1
    pipelined (8 MiB) are not."""
    def times(ids, nbytes):
        plans = [node_plans.all_reduce(nbytes // 4, 4, ids, r, HALF, False)
                 for r in range(len(ids))]
        return (plan_time(plans, ids, DEFAULT, 64),
                plan_time(plans, ids, DEFAULT, 1, ("h",) * len(ids)))
    spread, summed = times(THREE_ONE, 1 << 20)
    assert spread == pytest.approx(summed)
    for ids, nbytes in ((TWO_TWO, 1 << 20), (THREE_ONE, 8 << 20)):
        spread, summed = times(ids, nbytes)
        assert spread < summed / 1.5
