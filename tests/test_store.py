"""The key-value store (c10d's ``Store``, ``PrefixStore``, ``raycoll.get_store``): served by the
group's coordinator to every rank, on one Ray node and across two; c10d's semantics, checked
against torch's own ``HashStore``; timeouts that name the missing keys; races between ranks;
one store per group, none outliving its group."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Dict, List

import numpy as np
import pytest
import ray

import raycoll
from raycoll.launch import RankWorker, run_on


# ---------------------------------------------------------------------- semantics
def _basics(rank: int) -> Dict[str, Any]:
    store = raycoll.get_store()
    out: Dict[str, Any] = {"is_store": isinstance(store, raycoll.Store)}
    store.set(f"rank{rank}", f"hello from {rank}")
    store.set(f"bytes{rank}", bytes([rank, 0, 255]))
    store.wait([f"rank{r}" for r in range(2)] + [f"bytes{r}" for r in range(2)])
    out["got"] = [store.get(f"rank{r}") for r in range(2)]
    out["bytes"] = [store.get(f"bytes{r}") for r in range(2)]
    raycoll.barrier()
    out["num_keys"] = store.num_keys()
    out["check"] = (store.check(["rank0", "rank1"]), store.check(["rank0", "nope"]))
    out["list"] = sorted(store.list_keys())
    raycoll.barrier()
    if rank == 0:
        store.append("log", "a")
        store.append("log", b"b")
        store.multi_set(["m1", "m2"], ["x", b"y"])
        out["deleted"] = (store.delete_key("rank0"), store.delete_key("rank0"))
        store.queue_push("q", "first")
        store.queue_push("q", "second")
    raycoll.barrier()
    out["log"] = store.get("log")
    out["multi"] = store.multi_get(["m1", "m2"])
    out["after_delete"] = store.check(["rank0"])
    raycoll.barrier()
    if rank == 1:
        out["queue"] = (store.queue_len("q"), store.queue_pop("q"), store.queue_pop("q"),
                        store.queue_len("q"))
        try:
            store.queue_pop("q", block=False)
        except LookupError as exc:
            out["empty"] = str(exc)
    return out


@pytest.mark.timeout(60)
def test_every_rank_reaches_the_same_store_with_c10ds_operations(ranks):
    r0, r1 = ranks.run(_basics, 2)
    for got in (r0, r1):
        assert got["is_store"]
        assert got["got"] == [b"hello from 0", b"hello from 1"]
        assert got["bytes"] == [bytes([0, 0, 255]), bytes([1, 0, 255])]
        assert got["num_keys"] == 4
        assert got["check"] == (True, False)
        assert got["list"] == ["bytes0", "bytes1", "rank0", "rank1"]
        assert got["log"] == b"ab" and got["multi"] == [b"x", b"y"]
        assert got["after_delete"] is False
    assert r0["deleted"] == (True, False)
    assert r1["queue"] == (2, b"first", b"second", 0)
    assert "queue 'q'" in r1["empty"] and "empty" in r1["empty"]


def _counting(rank: int, n: int) -> Dict[str, Any]:
    store = raycoll.get_store()
    # every rank adds from two threads at once: the total is exact only if add is atomic
    seen: List[int] = []

    def add() -> None:
        for _ in range(n):
            seen.append(store.add("counter", 1))

    threads = [threading.Thread(target=add) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    raycoll.barrier()
    # compare_set race: every rank tries to claim the same key; exactly one wins
    won = store.compare_set("leader", "", f"rank{rank}")
    raycoll.barrier()
    # a counter moved only by compare_set: each rank bumps it once, retrying until it wins
    # (each value names its writer, so that a rank never takes another's swap for its own)
    tries = 0
    while True:
        tries += 1
        now = store.get("cas") if store.check(["cas"]) else b""
        nxt = f"{int(now.split(b':')[0] or b'0') + 1}:{rank}".encode()
        if store.compare_set("cas", now, nxt) == nxt:
            break
    raycoll.barrier()
    return {"seen": seen, "total": store.add("counter", 0), "won": won,
            "leader": store.get("leader"), "cas": store.get("cas"), "tries": tries}


@pytest.mark.timeout(90)
def test_add_is_atomic_and_compare_set_races_have_one_winner(ranks):
    n, world = 25, 3
    got = ranks.run(_counting, world, n)
    seen = sorted(v for g in got for v in g["seen"])
    assert seen == list(range(1, 2 * n * world + 1))  # every add returned a distinct value
    assert {g["total"] for g in got} == {2 * n * world}
    leader = got[0]["leader"]
    assert leader in {b"rank0", b"rank1", b"rank2"}
    assert all(g["leader"] == leader for g in got)
    assert all(g["won"] == leader for g in got)  # the winner and the losers see the winner
    assert all(g["cas"].split(b":")[0] == str(world).encode() for g in got)


def _blocking(rank: int) -> Any:
    store = raycoll.get_store()
    if rank == 1:
        time.sleep(0.5)  # the scenario: the key comes late
        store.set("late", "here")
        return None
    start = time.monotonic()
    value = store.get("late")  # blocks until rank 1 sets it
    return value, time.monotonic() - start


@pytest.mark.timeout(60)
def test_get_blocks_until_another_rank_sets_the_key(ranks):
    (value, waited), _ = ranks.run(_blocking, 2)
    assert value == b"here" and waited >= 0.3


def _timeouts(rank: int) -> Dict[str, Any]:
    store = raycoll.get_store()
    out: Dict[str, Any] = {"default": store.timeout}
    store.set("present", "1")
    start = time.monotonic()
    try:
        store.wait(["present", "absent"], timedelta(seconds=1))
    except raycoll.DistTimeoutError as exc:
        out["wait"] = (str(exc), exc.op, exc.group, exc.rank, time.monotonic() - start)
    store.set_timeout(timedelta(seconds=1))
    start = time.monotonic()
    try:
        store.get("never")
    except raycoll.DistTimeoutError as exc:
        out["get"] = (str(exc), time.monotonic() - start)
    out["timeout"] = store.timeout
    raycoll.all_reduce(np.ones(2))  # the group is not broken by a store timeout
    return out


@pytest.mark.timeout(60)
def test_wait_and_get_time_out_naming_the_missing_keys(ranks):
    got = ranks.run(_timeouts, 1, timeout=45)[0]
    assert got["default"] == timedelta(seconds=45)  # the group's timeout
    text, op, group, rank, took = got["wait"]
    assert "'absent'" in text and "Timed out" in text
    assert "['absent'] never set" in text  # the missing one, not the one that is there
    assert op == "store.wait" and group.startswith("test-") and rank == 0
    assert 0.9 <= took < 15
    text, took = got["get"]
    assert "'never'" in text and 0.9 <= took < 15
    assert got["timeout"] == timedelta(seconds=1)


# ---------------------------------------------------------------------- groups and lifetimes
def _two_groups(rank: int) -> Dict[str, Any]:
    root = raycoll.get_store()
    sub = raycoll.new_group([0, 1])
    other = raycoll.new_group([0, 1])  # same ranks, another group: another store
    out: Dict[str, Any] = {}
    root.set("k", "root")
    if rank in (0, 1):
        raycoll.get_store(sub).set("k", "sub")
        raycoll.get_store(other).set("only-other", "x")
    raycoll.barrier()
    out["root"] = root.get("k")
    out["root_keys"] = sorted(root.list_keys())
    if rank in (0, 1):
        s = raycoll.get_store(sub)
        out["sub"] = (s.get("k"), sorted(s.list_keys()))
        out["by_name"] = raycoll.get_store(sub.group_name).get("k")
        raycoll.destroy_process_group(sub)
        try:
            s.get("k")
        except raycoll.GroupDestroyedError as exc:
            out["after_destroy"] = str(exc)
    else:
        try:
            raycoll.get_store(sub)
        except ValueError as exc:
            out["non_member"] = str(exc)
    return out


@pytest.mark.timeout(60)
def test_each_group_has_its_own_store_and_it_outlives_no_group(ranks):
    got = ranks.run(_two_groups, 3)
    for rank, g in enumerate(got):
        assert g["root"] == b"root" and g["root_keys"] == ["k"]
        if rank < 2:
            assert g["sub"] == (b"sub", ["k"])
            assert g["by_name"] == b"sub"
            assert "destroyed" in g["after_destroy"]
        else:
            assert "NON_GROUP_MEMBER" in g["non_member"]


@pytest.mark.timeout(60)
def test_a_new_group_starts_with_an_empty_store(ranks):
    def fill(rank: int) -> int:
        store = raycoll.get_store()
        n = store.num_keys()
        raycoll.barrier()  # every rank has counted before any rank adds its key
        store.set(f"left-over-{rank}", "x")
        return n

    assert ranks.run(fill, 2) == [0, 0]
    assert ranks.run(fill, 2) == [0, 0]


@pytest.mark.timeout(30)
def test_get_store_without_a_group_says_what_to_do(ray_local):
    with pytest.raises(raycoll.GroupNotFoundError, match="init_process_group"):
        raycoll.get_store()
    with pytest.raises(raycoll.GroupNotFoundError, match="no group named 'nope'"):
        raycoll.get_store("nope")
    with pytest.raises(TypeError, match="group must be"):
        raycoll.get_store(3)  # type: ignore[arg-type]


def _bad_arguments(rank: int) -> List[str]:
    store = raycoll.get_store()
    out = []
    for call in (lambda: store.set(1, "x"), lambda: store.set("k", 1.5),
                 lambda: store.add("k", "1"), lambda: store.wait("k"),
                 lambda: store.multi_set(["a"], ["x", "y"]),
                 lambda: store.set_timeout(timedelta(0))):
        try:
            call()
            out.append("no error")
        except (TypeError, ValueError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    store.set("text", "not a number")
    try:
        store.add("text", 1)
    except ValueError as exc:
        out.append(str(exc))
    return out


@pytest.mark.timeout(60)
def test_bad_arguments_are_refused_naming_the_parameter(ranks):
    got = ranks.run(_bad_arguments, 1)[0]
    assert got[0].startswith("TypeError: key must be a str, got int")
    assert got[1].startswith("TypeError: value must be str or bytes, got float")
    assert got[2].startswith("TypeError: value must be an int, got str")
    assert got[3].startswith("TypeError: keys must be a list of str, got str")
    assert got[4].startswith("ValueError: values must be a list as long as keys (1)")
    assert got[5].startswith("ValueError: timeout must be")
    assert "key='text'" in got[6] and "not an integer" in got[6]


# ---------------------------------------------------------------------- PrefixStore
def _prefixed(rank: int) -> Dict[str, Any]:
    store = raycoll.get_store()
    a = raycoll.PrefixStore("a", store)
    ab = raycoll.PrefixStore("b", a)
    a.set("k", "in a")
    ab.set("k", "in a/b")
    out: Dict[str, Any] = {
        "plain": store.get("a/k"), "nested": store.get("a/b/k"), "via": (a.get("k"), ab.get("k")),
        "add": (ab.add("n", 5), store.get("a/b/n")),
        "num_keys": ab.num_keys(),  # the whole underlying store, as torch's PrefixStore
        "list": (sorted(a.list_keys()), sorted(ab.list_keys())),
        "check": (a.check(["k"]), a.check(["n"])),
        "cas": ab.compare_set("k", "in a/b", "swapped"),
        "underlying": (a.underlying_store is store, ab._underlying_non_prefix_store is store),
    }
    try:
        ab.wait(["missing"], timedelta(seconds=0.5))
    except raycoll.DistTimeoutError as exc:
        out["timeout"] = str(exc)
    try:
        raycoll.PrefixStore("p", object())
    except TypeError as exc:
        out["not_a_store"] = str(exc)
    return out


@pytest.mark.timeout(60)
def test_prefix_store_puts_its_prefix_before_every_key(ranks):
    got = ranks.run(_prefixed, 1)[0]
    assert got["plain"] == b"in a" and got["nested"] == b"in a/b"
    assert got["via"] == (b"in a", b"in a/b")
    assert got["add"] == (5, b"5")
    assert got["num_keys"] == 3
    assert got["list"] == (["b/k", "b/n", "k"], ["k", "n"])
    assert got["check"] == (True, False)
    assert got["cas"] == b"swapped"
    assert got["underlying"] == (True, True)
    assert "'a/b/missing'" in got["timeout"]
    assert "store must be a store" in got["not_a_store"] and "object" in got["not_a_store"]


def _script(store: Any) -> List[Any]:
    """One sequence of calls, run on torch's store and on raycoll's: the answers must agree."""
    out: List[Any] = []
    store.set("a", "1")
    store.set("b", b"\x00\xff")
    out += [store.get("a"), store.get("b"), store.add("a", 4), store.get("a"),
            store.add("fresh", -2), store.get("fresh")]
    out += [store.compare_set("c", "", "new"),        # unset + empty expected: set
            store.compare_set("c", "wrong", "other"),  # mismatch: the current value
            store.compare_set("c", "new", "next"),    # match: swapped
            store.compare_set("unset", "x", "y"),      # unset + expected: expected back
            store.check(["unset"])]
    out += [store.num_keys(), store.check(["a", "b"]), store.check(["a", "zz"]),
            store.delete_key("b"), store.delete_key("b"), store.num_keys()]
    store.append("app", "x")
    store.append("app", "yz")
    store.multi_set(["m1", "m2"], ["v1", "v2"])
    out += [store.get("app"), store.multi_get(["m1", "m2", "a"])]
    return out


def _against_hashstore(rank: int) -> Any:
    import torch.distributed as dist

    return _script(dist.HashStore()), _script(raycoll.get_store()), \
        _script(raycoll.PrefixStore("p", dist.HashStore()))


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_store_answers_as_torchs_hashstore_does(ranks):
    torchs, ours, prefixed_torch = ranks.run(_against_hashstore, 1)[0]
    assert ours == torchs
    assert prefixed_torch == torchs  # PrefixStore wraps a torch store too


@pytest.mark.torch
@pytest.mark.timeout(30)
def test_store_methods_are_torchs():
    import torch.distributed as dist

    ours = {m for m in vars(raycoll.Store) if not m.startswith("_")}
    theirs = {m for m in vars(dist.Store) if not m.startswith("_")}
    assert theirs <= ours, f"torch's Store methods raycoll lacks: {sorted(theirs - ours)}"
    with pytest.raises(NotImplementedError, match="Store does not implement Store.get"):
        raycoll.Store().get("k")


# ---------------------------------------------------------------------- two Ray nodes
def _across_nodes(rank: int, world_size: int) -> Dict[str, Any]:
    store = raycoll.get_store()
    node = ray.get_runtime_context().get_node_id()
    store.set(f"node/{rank}", node)
    store.wait([f"node/{r}" for r in range(world_size)])
    won = store.compare_set("leader", "", str(rank))
    for _ in range(10):
        store.add("total", rank + 1)
    raycoll.barrier()
    return {"node": node, "nodes": [store.get(f"node/{r}").decode() for r in range(world_size)],
            "won": won, "total": store.add("total", 0)}


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_ranks_on_two_ray_nodes_share_the_store(two_nodes):
    worker = ray.remote(RankWorker)
    actors = [worker.options(num_cpus=0, resources={f"node{r % 2}": 1}).remote()
              for r in range(4)]
    try:
        got = run_on(actors, _across_nodes, (4,), group_name="store-two-nodes", timeout=120)
    finally:
        for a in actors:
            ray.kill(a)
    nodes = [g["node"] for g in got]
    assert len(set(nodes)) == 2  # really spread over both nodes
    for g in got:
        assert g["nodes"] == nodes
        assert g["won"] == got[0]["won"] and g["won"] in {b"0", b"1", b"2", b"3"}
        assert g["total"] == 10 * (1 + 2 + 3 + 4)
