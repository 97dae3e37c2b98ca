"""The planner of a group on several nodes (raycoll.algorithms.planner): the hierarchical
plans and the flat socket schedules priced by one cost model, without Ray."""

from __future__ import annotations

import pytest

from raycoll.algorithms import node_plans
from raycoll.algorithms.cost import DEFAULT, CostModel
from raycoll.algorithms.planner import (NODE_BROADCAST_BYTES, NODE_PLANS, node_plan_time,
                                        node_plan_wins, plan_time)

pytestmark = pytest.mark.timeout(60)

TWO_TWO = ("a", "a", "b", "b")
THREE_ONE = ("a", "a", "a", "b")
HALF = 2 << 20  # the default segment's half


@pytest.mark.parametrize("nbytes", [4, 1 << 20, 64 << 20])
def test_the_defaults_take_the_measured_all_reduce_plan_at_2_plus_2(nbytes):
    """benchmarks/node_segment.py's cases (2 + 2 ranks, all_reduce at 4 B, 1 MiB, 64 MiB):
    the hierarchical plan, as the measured rule took it."""
    assert node_plan_wins("all_reduce", TWO_TWO, nbytes, 4, HALF, DEFAULT)


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


def test_a_plan_is_priced_by_its_slowest_rank_and_grows_with_bytes():
    """The small all_reduce of 2 + 2: one segment step and one message a rank (the model's
    alpha each), its bytes at each link's beta; streamed, more."""
    model = CostModel.of({"segment": {"alpha": 1e-3, "beta": 0.0}, "socket": {"alpha": 1e-2,
                                                                              "beta": 0.0},
                          "gamma": 0.0})
    assert node_plan_time("all_reduce", TWO_TWO, 16, 4, HALF, model) == pytest.approx(11e-3)
    # 3 + 1: the third local rank gets the result in one more segment step
    assert node_plan_time("all_reduce", THREE_ONE, 16, 4, HALF, model) == pytest.approx(12e-3)
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
