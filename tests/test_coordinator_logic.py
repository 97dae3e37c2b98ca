"""The coordinator's pure logic (raycoll.coordinator.logic) and its step matching, without Ray.

The logic module is plain Python; the actor's class is driven here directly on an asyncio
loop (no Ray cluster, no actor): its matching, error texts and Join answers are the ones the
ranks get.
"""

from __future__ import annotations

import ast
import asyncio
import inspect

import numpy as np
import pytest

from raycoll import errors
from raycoll.coordinator import logic
from raycoll.coordinator.actor import Coordinator
from raycoll.coordinator.client import CoordinatorClient
from raycoll.reduce_op import ReduceOp

pytestmark = pytest.mark.timeout(60)


def test_the_logic_module_imports_neither_ray_nor_asyncio() -> None:
    tree = ast.parse(inspect.getsource(logic))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert not names & {"ray", "asyncio", "numpy", "torch", "cupy"}, names


def test_the_client_has_a_method_for_every_rpc() -> None:
    rpcs = {n for n, f in inspect.getmembers(Coordinator, inspect.isfunction)
            if not n.startswith("_")}
    covered = {"exchange_packed": "exchange", "join_round_packed": "join_round",
               "lease": "hold_lease", "watch": "hold_lease",
               "lease_hosted": "hold_hosted_lease", "watch_hosted": "hold_hosted_lease",
               "hosted": "wait"}  # every method reaches a hosted coordinator (hosting.Hosted)
    client = set(dir(CoordinatorClient))
    lacking = sorted(n for n in rpcs
                     if not {covered.get(n, n), f"submit_{covered.get(n, n)}"} & client)
    assert not lacking, f"RPCs without a CoordinatorClient method: {lacking}"


# ---------------------------------------------------------------------- results
def test_ok_unwraps_to_its_value() -> None:
    assert logic.unwrap(logic.ok([1, 2]), {}) == [1, 2]
    assert logic.unwrap(logic.ok(), {}) is None


@pytest.mark.parametrize("kind, cls", [
    ("mismatch", errors.CollectiveMismatchError), ("peer_arg", errors.PeerArgumentError),
    ("aborted", errors.GroupBrokenError), ("timeout", errors.DistTimeoutError),
    ("rank_failed", errors.RankFailedError),
    ("protocol", errors.CollectiveError), ("no such kind", errors.CollectiveError),
])
def test_err_unwraps_to_the_exception_of_its_kind_with_the_context(kind, cls) -> None:
    ctx = {"op": "all_reduce", "seq": 3, "group": "g", "rank": 1}
    with pytest.raises(cls, match="it broke") as info:
        logic.unwrap(logic.err(kind, "it broke"), ctx)
    assert type(info.value) is cls
    got = info.value
    assert (got.op, got.seq, got.group, got.rank) == ("all_reduce", 3, "g", 1)


def test_value_errors_are_plain_value_errors() -> None:
    with pytest.raises(ValueError, match="rank=5 is out of range"):
        logic.unwrap(logic.err("value", "rank=5 is out of range"), {"group": "g"})


def test_a_timeout_carries_the_missing_ranks_and_a_death_the_failed_ones() -> None:
    with pytest.raises(errors.DistTimeoutError) as timeout:
        logic.unwrap(logic.err("timeout", "late", missing=[2, 3]), {"group": "g"})
    assert list(timeout.value.missing) == [2, 3]
    with pytest.raises(errors.RankFailedError) as failed:
        logic.unwrap(logic.err("rank_failed", "dead", failed_ranks=[1]), {"group": "g"})
    assert list(failed.value.failed_ranks) == [1]


def test_every_error_kind_the_coordinator_answers_with_has_its_exception() -> None:
    """The kinds the coordinator's modules produce (``err("kind", ...)``, the ranks'
    ``abort`` kinds) are exactly the table's: none unknown, none dead."""
    import pathlib
    import re

    package = pathlib.Path(logic.__file__).resolve().parent.parent
    made = set()
    for path in package.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        made |= set(re.findall(r'\berr\(\s*"([a-z_]+)"', text))
        made |= set(re.findall(r'abort\(\s*[\w.]+,\s*"([a-z_]+)"', text))
        for pair in re.findall(r'kind = "([a-z_]+)" if \w+ else "([a-z_]+)"', text):
            made |= set(pair)
    assert made - {"value"} == set(logic.ERRORS), made


def test_first_line_is_the_last_line_of_the_text_or_the_type() -> None:
    assert logic.first_line(RuntimeError("header\n  detail\nthe reason ")) == "the reason"
    assert logic.first_line(RuntimeError("")) == "RuntimeError"
    assert len(logic.first_line(RuntimeError("x" * 1000))) == 300


# ---------------------------------------------------------------------- matching
def test_agreeing_fingerprints_have_no_mismatch() -> None:
    fp = {"op": "all_reduce", "shape": (3,), "dtype": "float32"}
    assert logic.fingerprint_mismatch({0: dict(fp), 1: dict(fp), 2: dict(fp)}, [0, 1, 2]) is None
    assert logic.fingerprint_mismatch({}, []) is None


def test_a_fingerprint_mismatch_names_each_side_by_global_rank() -> None:
    fps = {0: {"op": "all_reduce", "shape": (4,)}, 1: {"op": "all_reduce", "shape": (5,)},
           2: {"op": "all_reduce", "shape": (4,)}}
    assert logic.fingerprint_mismatch(fps, [4, 6, 7]) == (
        "ranks disagree on shape: ranks [4, 7] passed (4,), ranks [6] passed (5,)")


def test_a_key_only_one_rank_has_is_a_mismatch() -> None:
    why = logic.fingerprint_mismatch({0: {"op": "a"}, 1: {"op": "a", "root": 0}}, [0, 1])
    assert why == "ranks disagree on root: ranks [0] passed None, ranks [1] passed 0"


def test_several_disagreements_are_listed_by_key() -> None:
    why = logic.fingerprint_mismatch({0: {"op": "a", "n": 1}, 1: {"op": "b", "n": 2}}, [0, 1])
    assert why is not None
    assert why.index("disagree on n") < why.index("disagree on op")


def test_metadata_that_agree_have_no_mismatch() -> None:
    m = ("float32", (2,))
    send = {0: [None, m], 1: [m, None]}
    recv = {0: [None, m], 1: [m, None]}
    assert logic.meta_mismatch(send, recv, [0, 1]) is None


def test_a_metadata_mismatch_names_sender_receiver_and_both_sides() -> None:
    send = {0: [None, ("float32", (2,))], 1: [None, None]}
    recv = {1: [("float32", (3,)), None]}
    assert logic.meta_mismatch(send, recv, [5, 9]) == (
        "rank 5 sends rank 9 dtype=float32, shape=(2,) but rank 9 expects "
        "dtype=float32, shape=(3,)")
    assert logic.meta_mismatch({0: None, 1: None}, {1: [("int8", [1]), None]}, [0, 1]) == (
        "rank 0 sends rank 1 nothing but rank 1 expects dtype=int8, shape=(1,)")


def test_a_long_metadata_mismatch_lists_four_pairs_and_counts_the_rest() -> None:
    size = 4
    send = {s: [("f", (1,))] * size for s in range(size)}
    recv = {r: [("f", (2,))] * size for r in range(size)}
    why = logic.meta_mismatch(send, recv, list(range(size)))
    assert why is not None
    assert why.count(" expects ") == 4 and why.endswith("... and 12 more")


def test_p2p_metadata_must_agree() -> None:
    assert logic.p2p_mismatch("g", [0, 3], 0, 1, 7, ("f", (2,)), ("f", (2,))) is None
    error = logic.p2p_mismatch("g", [0, 3], 0, 1, 7, ("f", (2,)), ("f", (3,)))
    assert error == logic.err(
        "mismatch", "send from rank 0 to rank 3 (tag 7) on group 'g': the sender sent "
        "dtype=f, shape=(2,) but the receiver expects dtype=f, shape=(3,)")


def test_route_hands_each_rank_what_every_source_sent_it() -> None:
    got = logic.route([["a0", "a1", "a2"], None, ["c0", "c1", "c2"]])
    assert got == {0: ["a0", None, "c0"], 1: ["a1", None, "c1"], 2: ["a2", None, "c2"]}


def test_a_timeout_names_the_missing_ranks_and_what_each_last_completed() -> None:
    result = logic.timeout_error("g", "all_reduce", 4, [1, 3], {1: ("barrier", 3), 3: None}, 2.5)
    assert result == logic.err(
        "timeout", "all_reduce #4 on group 'g' timed out after 2.5s: ranks [1, 3] never "
        "arrived (rank 1 last completed barrier #3; rank 3 completed nothing on this group)",
        missing=[1, 3])


def test_breaking_a_group_breaks_its_subgroups_only() -> None:
    groups = ["dp", "dp/0-1#0", "dp/2-3#1", "dpx", "other/dp"]
    assert logic.subgroup_keys("dp", groups) == {"dp", "dp/0-1#0", "dp/2-3#1"}
    assert logic.subgroup_keys("dp/0-1#0", groups) == {"dp/0-1#0"}
    assert logic.subgroup_keys("new", groups) == {"new"}


def test_coordinator_names_are_namespaced_by_job() -> None:
    assert logic.coordinator_name("02000000", "dp") == "raycoll:02000000:dp"


# ---------------------------------------------------------------------- join
def test_join_outcome_while_ranks_still_have_inputs() -> None:
    outcome, order, ended = logic.join_outcome([10, 11, 12], [None, 4, None], None, False)
    assert outcome == {"nonjoined": [10, 12], "join_order": [11], "all_joined": False,
                       "is_last_joiner": False}
    assert order == [(4, 1)] and not ended


def test_join_outcome_when_all_joined_names_the_last_joiners() -> None:
    seqs = [5, 3, 5]
    last = logic.join_outcome([0, 1, 2], seqs, 5, False)
    early = logic.join_outcome([0, 1, 2], seqs, 3, False)
    assert last[0]["join_order"] == [1, 0, 2] and last[0]["all_joined"]
    assert last[0]["is_last_joiner"] and not early[0]["is_last_joiner"]
    assert last[2] and early[2]


def test_join_outcome_under_throw_ends_at_the_first_joiner() -> None:
    assert logic.join_outcome([0, 1], [None, None], None, True)[2] is False
    assert logic.join_outcome([0, 1], [None, 2], None, True)[2] is True
    assert logic.join_outcome([0, 1], [None, 2], None, False)[2] is False


def test_join_summary() -> None:
    assert logic.join_summary([7, 8, 9], 6, [(3, 1), (6, 0), (6, 2)], True) == {
        "join_order": [8, 7, 9], "last_joiners": [7, 9], "final_seq": 6,
        "terminated_early": True}
    assert logic.join_summary([7], 1, [], False)["last_joiners"] == []


# ---------------------------------------------------------------------- liveness
def test_death_cause_is_one_line_from_rays_many() -> None:
    text = ("The actor died unexpectedly before finishing this task.\n"
            "\tclass_name: RankWorker\n\tactor_id: abc\n\tpid: 4242\n\tip: 10.0.0.1\n"
            "The actor is dead because its worker process has died. Worker exit type: ...\n"
            "Node Id: 0123456789abcdef")
    assert logic.death_cause(RuntimeError(text)) == (
        "its worker process has died (actor class_name RankWorker, pid 4242, ip 10.0.0.1, "
        "node 01234567)")
    assert logic.death_cause(KeyError()) == "KeyError"


# ---------------------------------------------------------------------- the actor, no Ray
def _run(coro_fn):
    return asyncio.run(asyncio.wait_for(coro_fn(), 30))


def _exchange(c, rank, fp, payload, mode="route", ranks=(0, 1), seq=1, timeout_s=5.0):
    return c.exchange("g", ranks, seq, 0, rank, fp, None, None, payload, mode, None, timeout_s)


def test_a_route_step_hands_each_rank_its_share() -> None:
    async def body():
        c = Coordinator("g", 2)
        fp = {"op": "all_to_all"}
        return await asyncio.gather(_exchange(c, 0, fp, ["00", "01"]),
                                    _exchange(c, 1, fp, ["10", "11"]))

    assert _run(body) == [("ok", ["00", "10"]), ("ok", ["01", "11"])]


def test_a_reduce_step_reduces_at_the_coordinator() -> None:
    async def body():
        c = Coordinator("g", 2)
        fp = {"op": "all_reduce", "reduce_op": ReduceOp.SUM.key}
        return await asyncio.gather(_exchange(c, 0, fp, np.ones(2), "reduce"),
                                    _exchange(c, 1, fp, np.ones(2) * 2, "reduce"))

    results = _run(body)
    assert [r[0] for r in results] == ["ok", "ok"]
    assert all(list(r[1]) == [3.0, 3.0] for r in results)


def test_a_mismatched_step_fails_on_every_rank_and_then_status_shows_it() -> None:
    async def body():
        c = Coordinator("g", 2)
        out = await asyncio.gather(_exchange(c, 0, {"op": "all_reduce", "n": 1}, [None, None]),
                                   _exchange(c, 1, {"op": "all_reduce", "n": 2}, [None, None]))
        return out, c.status()

    (a, b), status = _run(body)
    assert a == b and a[:2] == ("err", "mismatch")
    assert a[2] == ("all_reduce #1 on group 'g': ranks disagree on n: ranks [0] passed 1, "
                    "ranks [1] passed 2")
    # a mismatch does not break the group; neither completed the collective
    assert status[1]["groups"]["g"][0]["last_completed"] is None
    assert "broken" not in status[1]["groups"]["g"]


def test_a_step_times_out_naming_the_missing_rank_and_breaks_the_group() -> None:
    async def body():
        c = Coordinator("g", 2)
        first = await _exchange(c, 0, {"op": "barrier"}, None, timeout_s=0.05)
        later = await _exchange(c, 1, {"op": "barrier"}, None, seq=2)
        return first, later

    first, later = _run(body)
    assert first[:2] == ("err", "timeout") and first[3] == {"missing": [1]}
    assert "ranks [1] never arrived (rank 1 completed nothing on this group)" in first[2]
    assert later == first  # the group is broken: later calls fail at once with the cause


def test_a_rejected_step_fails_the_others_with_the_rejecting_rank() -> None:
    async def body():
        c = Coordinator("g", 2)
        waiting = asyncio.ensure_future(_exchange(c, 0, {"op": "broadcast"}, [None, None]))
        await asyncio.sleep(0)
        assert c.reject("g", (0, 1), 1, 1, "broadcast", "src=9 is out of range") == ("ok", None)
        return await waiting

    result = _run(body)
    assert result == logic.err("peer_arg", "broadcast #1 on group 'g' cannot run: rank 1 "
                               "rejected its arguments: src=9 is out of range", source=1)


def test_an_abort_fails_waiting_steps_and_messages_of_the_group_and_its_subgroups() -> None:
    async def body():
        c = Coordinator("g", 2)
        sub = asyncio.ensure_future(c.exchange("g/0-1#0", (0, 1), 1, 0, 0, {"op": "x"}, None,
                                               None, None, "route", None, 5.0))
        recv = asyncio.ensure_future(c.p2p_recv("g", 1, 0, 0, None, 5.0))
        await asyncio.sleep(0)
        c.abort("g", "aborted", "rank 1 failed", {})
        return await sub, await recv, await c.p2p_send("g", 0, 1, 0, None, None, 1.0)

    results = _run(body)
    assert all(r == logic.err("aborted", "rank 1 failed") for r in results)


def test_point_to_point_matches_by_source_and_tag_and_checks_metadata() -> None:
    async def body():
        c = Coordinator("g", 2)
        meta = ("float32", (2,))
        send = asyncio.ensure_future(c.p2p_send("g", 0, 1, 5, meta, "data", 5.0))
        await asyncio.sleep(0)
        other_tag = await c.p2p_recv("g", 0, 1, 6, meta, 0.05)
        got = await c.p2p_recv("g", None, 1, 5, meta, 5.0)
        bad_send = asyncio.ensure_future(c.p2p_send("g", 0, 1, 5, meta, "x", 5.0))
        await asyncio.sleep(0)
        bad = await c.p2p_recv("g", 0, 1, 5, ("float32", (3,)), 5.0)
        return other_tag, got, await send, bad, await bad_send

    other_tag, got, sent, bad, bad_send = _run(body)
    assert other_tag == logic.err("timeout", "recv at rank 1 from rank 0 (tag 6) on group 'g' "
                                  "got no message within 0.05s")
    assert got == ("ok", (0, "data")) and sent == ("ok", None)
    assert bad[:2] == ("err", "mismatch") and bad_send == bad


def test_join_rounds_answer_every_rank_and_keep_the_summary() -> None:
    async def body():
        c = Coordinator("g", 2)
        first = await asyncio.gather(c.join_round("g", (0, 1), 1, 0, None, False, 5.0),
                                     c.join_round("g", (0, 1), 1, 1, 1, False, 5.0))
        second = await asyncio.gather(c.join_round("g", (0, 1), 2, 0, 2, False, 5.0),
                                      c.join_round("g", (0, 1), 2, 1, 1, False, 5.0))
        return first, second, c.status()[1]["groups"]["g"]["join"]

    first, second, join = _run(body)
    assert first[0] == ("ok", {"nonjoined": [0], "join_order": [1], "all_joined": False,
                               "is_last_joiner": False})
    assert second[0][1]["all_joined"] and second[0][1]["is_last_joiner"]
    assert not second[1][1]["is_last_joiner"]
    assert join == {"joined": [], "last": {"join_order": [1, 0], "last_joiners": [0],
                                           "final_seq": 2, "terminated_early": False}}


def test_join_rounds_out_of_step_break_the_group_with_the_hint() -> None:
    async def body():
        c = Coordinator("g", 2)
        return await asyncio.gather(c.join_round("g", (0, 1), 1, 0, None, False, 5.0),
                                    c.join_round("g", (0, 1), 1, 1, None, True, 5.0))

    a, b = _run(body)
    assert a[:2] == ("err", "mismatch") and a[2].endswith(logic.JOIN_OUT_OF_STEP)
    assert b == a


@pytest.mark.parametrize("waits,missing,named", [
    ({2: (3,)}, [2], [3]),  # rank 1 waits on rank 2, which waits on rank 3 (stalled)
    ({2: (0,), 0: (3,)}, [2], [3]),  # two waits deep
    ({2: (0, 3), 0: ()}, [2], [0, 3]),  # each branch to its end
    ({0: (2,), 2: (0,)}, [0], [2]),  # 0 and 2 wait on each other: 1 names 0's peer
    ({0: (1,)}, [0], [0]),  # 0 waits on the rank that timed out: 0 is named
    ({}, [2], [2]),  # rank 2 never checked in: it is the one
], ids=["one", "two-deep", "branches", "crossed", "back", "unknown"])
def test_a_transport_timeout_names_the_ranks_behind_the_waits(waits, missing, named) -> None:
    """Rank 1's wait times out on a rank that itself waits in the same collective (its
    checks said on whom): the timeout names the ranks at the end of the waits (the rank
    behind a node-mate's wait, not the node-mate)."""
    async def body():
        c = Coordinator("g", 4)
        ranks = (10, 11, 12, 13)
        fp = {"op": "all_reduce"}
        for r, on in waits.items():
            assert c.transport_check("g", ranks, 5, r, fp, {}, on, 0.5, "tcp") == ("ok", None)
        return c.transport_timeout("g", ranks, 5, 1, "all_reduce", missing, {}, 3.0, "tcp")

    status, kind, message, extra = _run(body)
    assert (status, kind) == ("err", "timeout") and extra["missing"] == [10 + r for r in named]
    assert f"ranks [{', '.join(str(10 + r) for r in named)}] never arrived" in message


def test_an_abort_of_an_earlier_generation_breaks_nothing() -> None:
    """A rank's failing call that reports after its group shrank or grew under the same name
    (the generation moved on) must not break the new group; one of the current generation
    does."""
    async def body():
        c = Coordinator("g", 2)
        c._generation = 3
        stale = c.abort("g", "aborted", "late report of generation 2", {}, 2)
        fp = {"op": "all_to_all"}
        routed = await asyncio.gather(_exchange(c, 0, fp, ["00", "01"]),
                                      _exchange(c, 1, fp, ["10", "11"]))
        current = c.abort("g", "aborted", "generation 3 broke", {}, 3)
        failed = await _exchange(c, 0, fp, ["00", "01"], seq=2)
        return stale, routed, current, failed

    stale, routed, current, failed = _run(body)
    assert stale == current == ("ok", None)
    assert routed == [("ok", ["00", "10"]), ("ok", ["01", "11"])]
    assert failed[:3] == ("err", "aborted", "generation 3 broke")
