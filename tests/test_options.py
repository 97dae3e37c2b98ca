"""Group options (:mod:`raycoll.options`): built once from the user's dict, frozen, validated;
unknown names and bad values are refused by ``create_group`` and ``spawn`` before anything
starts."""

from __future__ import annotations

import dataclasses
import re
import uuid
from typing import Any, Dict, List

import numpy as np
import pytest
import ray

import raycoll
from raycoll import options as options_module
from raycoll.context import _transport_option
from raycoll.world import world
from raycoll.options import GroupOptions, or_default


# ---------------------------------------------------------------------- pure
def test_every_option_has_a_rule_and_the_defaults_pass_it():
    names = [f.name for f in dataclasses.fields(GroupOptions)]
    assert sorted(options_module._RULES) == sorted(names)
    assert GroupOptions.of(None) == GroupOptions() == GroupOptions.of({})


def test_a_group_options_is_taken_as_it_is_and_a_dict_becomes_one():
    given = GroupOptions(lane_bytes=4096, put="per_peer")
    assert GroupOptions.of(given) is given
    assert GroupOptions.of({"lane_bytes": 4096, "put": "per_peer"}) == given


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GroupOptions().lane_bytes = 1  # type: ignore[misc]


def test_an_unknown_key_names_it_its_close_matches_and_the_valid_keys():
    with pytest.raises(ValueError) as info:
        GroupOptions.of({"lane_bytse": 4096})
    text = str(info.value)
    assert "unknown group option 'lane_bytse'" in text
    assert "did you mean 'lane_bytes'" in text
    for name in ("transport", "stream_bytes", "nccl_blocking_wait"):
        assert name in text.split("the group options are:")[1]


def test_an_unknown_key_without_a_close_match_lists_the_valid_keys():
    with pytest.raises(ValueError, match=r"unknown group option 'by_name'; the group options "
                                         r"are: transport, lane_bytes, "):
        GroupOptions.of({"by_name": True})


def test_options_that_are_not_a_mapping_are_refused():
    with pytest.raises(TypeError, match="options must be a dict of group options or a "
                                        "GroupOptions, got list"):
        GroupOptions.of([("put", "auto")])  # type: ignore[arg-type]


@pytest.mark.parametrize("name,value", [
    ("transport", "udp"), ("transport", 1), ("lane_bytes", -1),
    ("lane_bytes", "4M"), ("lane_bytes", True), ("lane_bytes", 4096.0), ("lane_max_ranks", -1),
    ("stream_bytes", 0), ("inline_bytes", -1), ("direct_bytes", 1.5),
    ("direct_max_ranks", False), ("segment_bytes", 0), ("all_reduce_algo", "binomial"),
    ("put", None), ("put", "sometimes"), ("nccl_blocking_wait", 1),
])
def test_a_bad_value_names_the_option_what_was_expected_and_what_came(name: str, value: Any):
    with pytest.raises(ValueError, match=rf"group option {name}: expected .*, got {re.escape(repr(value))}$"):
        GroupOptions.of({name: value})
    with pytest.raises(ValueError, match=rf"group option {name}: "):
        GroupOptions(**{name: value})


@pytest.mark.parametrize("name,value", [
    ("transport", "tcp"), ("transport", "store"), ("lane_bytes", 0), ("lane_max_ranks", 0),
    ("stream_bytes", 1),
    ("inline_bytes", 0), ("direct_bytes", 0), ("direct_max_ranks", 8), ("segment_bytes", 1),
    ("all_reduce_algo", "rs_ag"), ("put", "per_peer"), ("nccl_blocking_wait", False),
])
def test_values_at_the_edge_of_their_range_are_taken(name: str, value: Any):
    assert getattr(GroupOptions.of({name: value}), name) == value


def test_or_default_keeps_a_given_zero_and_fills_none():
    assert or_default(0, 5) == 0 and or_default(None, 5) == 5 and or_default(False, True) is False


def test_the_transport_option_and_the_removed_lane_spelling():
    assert _transport_option(GroupOptions()) == "auto"
    assert _transport_option(GroupOptions(transport="store")) == "store"
    with pytest.raises(ValueError, match=r"'lane' was removed: use transport='store'"):
        GroupOptions.of({"lane": False})
    with pytest.raises(TypeError):
        GroupOptions(lane=False)  # type: ignore[call-arg]


@pytest.mark.parametrize("name,value,says", [
    ("node_lanes", True, r"'node_lanes' was retired with the node lanes .*native executor.*"
                         r"drop the option"),
    ("node_lanes", None, r"'node_lanes' was retired"),
    ("lane_yield_s", 0.25, r"'lane_yield_s' was retired with the Ray-channel lane.*"
                           r"segment_spin_s.*drop the option"),
    ("stream", False, r"'stream' was retired with the streamed rounds: every collective runs "
                      r"on the native executor.*use transport='store'"),
])
def test_a_retired_option_names_what_replaced_it(name: str, value: Any, says: str):
    with pytest.raises(ValueError, match=says):
        GroupOptions.of({name: value})


# ---------------------------------------------------------------------- on Ray
def _seen(rank: int) -> Dict[str, Any]:
    x = np.full(4, float(rank + 1))
    raycoll.all_reduce(x)
    pg = world().default
    return {"sum": x.tolist(), "options": pg.context.options, "transport": pg.transport_name,
            "lane_active": pg.lane_active, "lane_calls": pg.context.transport_calls,
            "nodes": len(pg.node_ids), "client": pg.client is pg.context.client}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("given", [{"transport": "store", "inline_bytes": 0},
                                   GroupOptions(transport="store", inline_bytes=0)],
                         ids=["dict", "GroupOptions"])
def test_a_dict_and_a_group_options_both_reach_every_rank(ranks: Any, given: Any):
    """``RankPool.run(..., options=...)`` forms its group with them: the store ran the
    all_reduce, not the lane a group of one node gets by default."""
    for got in ranks.run(_seen, 2, options=given):
        assert got["sum"] == [3.0] * 4
        assert got["options"] == GroupOptions(transport="store", inline_bytes=0)
        assert got["transport"] == "store" and got["lane_active"] is False
        assert got["lane_calls"] == 0
        assert got["nodes"] == 2 and got["client"] is True
    for got in ranks.run(_seen, 2):  # the same pool without options: the lane carried it
        assert got["transport"] == "lane" and got["lane_calls"] == 1


@pytest.mark.timeout(120)
def test_the_pool_refuses_a_bad_option_before_it_forms_a_group(ranks: Any):
    groups = raycoll.launch.DRIVER_GROUPS.names(raycoll.session.current())
    with pytest.raises(ValueError, match=r"unknown group option 'stream_byts'.*did you mean 'stream_bytes'"):
        ranks.run(_seen, 2, options={"stream_byts": 4096})
    with pytest.raises(TypeError, match=r"options must be a dict of group options"):
        ranks.run(_seen, 2, options=["transport"])
    assert raycoll.launch.DRIVER_GROUPS.names(raycoll.session.current()) == groups


@pytest.mark.timeout(120)
def test_create_group_refuses_an_unknown_option_before_anything_starts(rank_actors: List[Any],
                                                                       ranks: Any):
    name = f"opts-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ValueError, match=r"unknown group option 'stream_byts'.*did you mean 'stream_bytes'"):
        raycoll.create_group(rank_actors[:2], group_name=name, options={"stream_byts": 4096})
    with pytest.raises(ValueError, match=r"group option lane_bytes: expected an int >= 0"):
        raycoll.create_group(rank_actors[:2], group_name=name, options={"lane_bytes": -4})
    # nothing was left behind: the name forms at once
    raycoll.create_group(rank_actors[:2], group_name=name, timeout=60)
    raycoll.destroy_group(name)
    # and a group formed without options is on the lane by default
    got = ranks.run(_seen, 2)
    assert [g["transport"] for g in got] == ["lane", "lane"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("given", [{"transport": "store", "inline_bytes": 0},
                                   GroupOptions(transport="store", inline_bytes=0)],
                         ids=["dict", "GroupOptions"])
def test_spawn_forms_its_group_with_the_options(ray_local: Any, given: Any):
    """``spawn(..., options=...)`` takes them as ``create_group`` does: every rank's group
    has them, and the store (not the lane a one-node group gets by default) carried the
    all_reduce."""
    got = raycoll.spawn(_seen, 2, options=given, actor_options={"num_cpus": 0})
    for rank in got:
        assert rank["sum"] == [3.0] * 4
        assert rank["options"] == GroupOptions(transport="store", inline_bytes=0)
        assert rank["transport"] == "store" and rank["lane_calls"] == 0


@pytest.mark.timeout(60)
def test_spawn_refuses_a_bad_option_before_any_actor_starts(ray_local: Any):
    """Checked first, as in create_group: the resources asked for here can never be
    scheduled, and the option's error, not that one, is what comes back."""
    never = {"num_cpus": 0, "resources": {"no-such-resource": 1}}
    with pytest.raises(ValueError, match=r"unknown group option 'stream_byts'.*did you mean 'stream_bytes'"):
        raycoll.spawn(_seen, 2, options={"stream_byts": 4096}, actor_options=never)
    with pytest.raises(ValueError, match=r"group option lane_bytes: expected an int >= 0"):
        raycoll.spawn(_seen, 2, options={"lane_bytes": -4}, actor_options=never)
    with pytest.raises(TypeError, match=r"options must be a dict of group options"):
        raycoll.spawn(_seen, 2, options=["transport"], actor_options=never)
    with pytest.raises(ValueError, match="can never be scheduled"):  # the check that came next
        raycoll.spawn(_seen, 2, options={"transport": "store"}, actor_options=never)
