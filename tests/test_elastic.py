"""Elastic groups on real Ray actors: ``shrink_group`` after a rank is killed (``ray.kill``,
and SIGKILL of its process in the middle of a collective) and while every rank is alive,
``grow_group`` / ``admit_new_ranks`` bringing a replacement in, ``broadcast_state_dict``
handing it the state; every survivor's and newcomer's result checked after each change.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from datetime import timedelta
from typing import Any, Dict, List

import numpy as np
import pytest
import ray

import raycoll
from raycoll.coordinator import CoordinatorClient
from raycoll.launch import RankWorker

Worker = ray.remote(num_cpus=0)(RankWorker)

#: The groups' collective timeout: far above what any step here takes, so that a test
#: that waits it out fails by its own pytest timeout instead.
TIMEOUT_S = 60.0


def _run(actor: Any, fn: Any, rank: int, *args: Any) -> Any:
    return actor.run.remote(fn, rank, args, {})


@pytest.fixture(scope="module")
def pool(ray_local):
    """Rank actors reused from test to test (starting one takes seconds on a loaded
    machine): the ones a test killed are replaced, the newcomers it added kept."""
    actors: List[Any] = [Worker.remote() for _ in range(4)]
    yield actors
    for actor in actors:
        ray.kill(actor, no_restart=True)


def _alive(actor: Any) -> bool:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=60)
        return True
    except ray.exceptions.RayActorError:
        return False


@pytest.fixture
def team(pool):
    """Four rank actors of the pool in group ``el-<id>`` (default group in each)."""
    actors = pool[:4]
    name = f"el-{uuid.uuid4().hex[:6]}"
    raycoll.create_group(actors, group_name=name, timeout=TIMEOUT_S)
    extra: List[Any] = []
    yield actors, name, extra
    try:
        raycoll.destroy_group(name)
    except Exception:  # noqa: BLE001 - the test may have left it half gone
        pass
    live = [a for a in pool + extra if _alive(a)]
    pool[:] = live + [Worker.remote() for _ in range(4 - len(live))]


# ---------------------------------------------------------------------- rank-side functions
def _sum_of(ranks: List[int]) -> float:
    return float(sum(r + 1 for r in ranks))


def _reduce(rank: int, n: int = 1000) -> Dict[str, Any]:
    """One all_reduce of ``rank + 1`` on the default group: its value and where we are."""
    x = np.full(n, raycoll.get_rank() + 1.0)
    raycoll.all_reduce(x)
    return {"value": float(x[0]), "equal": bool((x == x[0]).all()), "rank": raycoll.get_rank(),
            "size": raycoll.get_world_size(), "pid": os.getpid()}


def _reduce_until_failure(rank: int, marker: str) -> Dict[str, Any]:
    """all_reduce 64 KiB arrays until one fails; the first one done writes ``marker``."""
    done = 0
    while True:
        x = np.full(8192, rank + 1.0)
        try:
            raycoll.all_reduce(x)
        except raycoll.RankFailedError as exc:
            return {"done": done, "type": type(exc).__name__, "failed": list(exc.failed_ranks)}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"done": done, "type": type(exc).__name__, "msg": str(exc), "failed": []}
        assert x[0] == 10.0, x[0]
        done += 1
        if done == 1:
            open(marker + f".{rank}", "w").close()


def _pid(rank: int) -> int:
    return os.getpid()


def _shrink_and_reduce(rank: int, excluded: List[int], flags: int) -> Dict[str, Any]:
    old = raycoll.group.WORLD.size()  # (get_world_size refuses a broken group)
    pg = raycoll.shrink_group(excluded, shrink_flags=flags)
    out = _reduce(rank)
    out.update(old_size=old, is_default=pg is raycoll.group.WORLD, name=pg.group_name,
               desc=pg.group_desc)
    return out


def _admit_and_share(rank: int, state: Any) -> Dict[str, Any]:
    raycoll.admit_new_ranks(timeout=TIMEOUT_S)
    return _share(rank, state)


def _share(rank: int, state: Any) -> Dict[str, Any]:
    got = raycoll.broadcast_state_dict(state, src=0, bucket_bytes=3000)
    out = _reduce(rank)
    out["w"] = got["model"]["w"].tolist()
    out["step"] = got["step"]
    out["opt"] = [float(v) for v in got["opt"][0]]
    return out


def _state(step: int) -> Dict[str, Any]:
    return {"model": {"w": np.arange(1000, dtype=np.float32) * step},
            "opt": (np.arange(7, dtype=np.float64), "adam"), "step": step}


# ---------------------------------------------------------------------- tests
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_killed_rank_survivors_shrink_then_a_replacement_grows_the_group(team, transport,
                                                                         tmp_path):
    """SIGKILL rank 2 mid-stream: the survivors fail with RankFailedError naming it, shrink
    (renumbered 0, 1, 2 from 0, 1, 3), reduce correctly; a new actor joins as rank 3, takes
    rank 0's state over the data plane, and the four reduce correctly."""
    actors, name, extra = team
    if transport == "tcp":  # the same test on direct connections rather than the segment
        raycoll.destroy_group(name)
        raycoll.create_group(actors, group_name=name, timeout=TIMEOUT_S,
                             options={"transport": "tcp"})
    pids = ray.get([_run(a, _pid, r) for r, a in enumerate(actors)], timeout=60)
    marker = str(tmp_path / "first")
    refs = [_run(a, _reduce_until_failure, r, marker) for r, a in enumerate(actors)]
    deadline = time.monotonic() + 60
    while not all(os.path.exists(f"{marker}.{r}") for r in range(4)):
        assert time.monotonic() < deadline, "the stream of all_reduces never started"
        time.sleep(0.01)
    os.kill(pids[2], signal.SIGKILL)
    outcomes = ray.get([refs[r] for r in (0, 1, 3)], timeout=60)
    for out in outcomes:
        assert out["type"] == "RankFailedError" and out["failed"] == [2], out
    shrunk = ray.get([_run(actors[r], _shrink_and_reduce, r, [2], raycoll.SHRINK_DEFAULT)
                      for r in (0, 1, 3)], timeout=60)
    assert [s["rank"] for s in shrunk] == [0, 1, 2]
    for s in shrunk:
        assert (s["old_size"], s["size"], s["value"], s["equal"]) == (4, 3, 6.0, True), s
        assert s["is_default"] and s["name"] == name and s["desc"] == "default:shrunken"
    newcomer = Worker.remote()
    extra.append(newcomer)
    survivors = [actors[r] for r in (0, 1, 3)]
    refs = [_run(a, _admit_and_share, r, _state(5) if r == 0 else None)
            for r, a in enumerate(survivors)]
    raycoll.grow_group(name, [newcomer], timeout=TIMEOUT_S)
    refs.append(_run(newcomer, _share, 3, None))
    grown = ray.get(refs, timeout=60)
    assert [g["rank"] for g in grown] == [0, 1, 2, 3]
    for g in grown:
        assert (g["size"], g["value"], g["equal"]) == (4, 10.0, True), g
        assert g["w"] == (np.arange(1000, dtype=np.float32) * 5).tolist()
        assert g["step"] == 5 and g["opt"] == list(range(7))
    # the driver's record follows: destroying the group reaches every live member
    raycoll.destroy_group(name)
    gone = ray.get([_run(a, _after_destroy, r, name) for r, a in enumerate(survivors + [newcomer])],
                   timeout=60)
    assert gone == ["GroupDestroyedError"] * 4


def _after_destroy(rank: int, name: str) -> str:
    try:
        raycoll.all_reduce(np.zeros(1), group=name)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__
    return "no error"


def _ray_killed_then_shrink(rank: int, excluded: List[int]) -> Dict[str, Any]:
    try:
        raycoll.all_reduce(np.ones(4))
        first = "no error"
    except raycoll.RankFailedError as exc:
        first = f"RankFailedError {list(exc.failed_ranks)}"
    out = _shrink_and_reduce(rank, excluded, raycoll.SHRINK_ABORT)
    out["first"] = first
    return out


@pytest.mark.timeout(120)
def test_two_ranks_killed_between_collectives(team):
    """ray.kill ranks 0 and 2 while idle: the next call names them; the survivors 1 and 3
    shrink (SHRINK_ABORT) into ranks 0 and 1 and go on, twice, and under Join with uneven
    inputs."""
    actors, name, _extra = team
    assert ray.get([_run(a, _reduce, r) for r, a in enumerate(actors)], timeout=60)[0]["value"] == 10
    for r in (0, 2):
        ray.kill(actors[r], no_restart=True)
    _wait_dead(name, {0, 2})
    out = ray.get([_run(actors[r], _ray_killed_then_shrink, r, [0, 2]) for r in (1, 3)],
                  timeout=60)
    for o in out:
        assert o["first"] == "RankFailedError [0, 2]", o
        assert (o["size"], o["value"]) == (2, 3.0), o
    assert [o["rank"] for o in out] == [0, 1]
    again = ray.get([_run(actors[r], _reduce, r) for r in (1, 3)], timeout=60)
    assert [a["value"] for a in again] == [3.0, 3.0]
    joined = ray.get([_run(actors[r], _uneven, r) for r in (1, 3)], timeout=60)
    assert joined == [(-7.0, 2, 2), (-7.0, 4, 1)], joined  # (w, steps, last contributors)
    # the survivors hold their leases of the new generation (taken as it installs): the
    # coordinator finds new rank 1 dead by its own, with no call made
    ray.kill(actors[3], no_restart=True)
    dead = _wait_dead(name, {1})
    assert "lease" in dead[1], dead


def _uneven(rank: int) -> Any:
    """Under Join on the shrunk group: new rank 0 has 2 batches, rank 1 has 4; gradients
    rank + 1: averages 1.5, 1.5, then rank 1's 2.0 twice; rank 1's parameters everywhere."""
    w = np.zeros(3)
    avg = raycoll.GradientAverager([w])
    me = raycoll.get_rank()
    with raycoll.Join([avg]):
        for _ in range(2 if me == 0 else 4):
            avg.grads[0][...] = me + 1.0
            avg.average()
            w -= avg.grads[0]
    return float(w[0]), avg.steps, avg.contributors


def _wait_dead(name: str, ranks: set) -> Dict[int, str]:
    """Until the group's coordinator has found ``ranks`` dead (bounded); the dead ranks
    with the reason."""
    from raycoll.launch import DRIVER_GROUPS
    from raycoll.session import current

    client = CoordinatorClient(DRIVER_GROUPS.get(name, current()).spec.coordinator, name)
    deadline = time.monotonic() + 30
    while set(dead := client.dead_ranks(10.0)) < ranks:
        assert time.monotonic() < deadline, dead
        time.sleep(0.05)
    return dead


def _subgroup_then_shrink(rank: int) -> Dict[str, Any]:
    sub = raycoll.new_group([0, 1, 3])
    out: Dict[str, Any] = {}
    if rank == 2:  # excluded: it does not call; later its handle on the group is dropped
        return out
    small = raycoll.shrink_group([1], group=sub) if rank in (0, 3) else None
    if small is not None:
        x = np.full(3, rank + 1.0)
        raycoll.all_reduce(x, group=small)
        out["sub"] = (small.rank(), small.size(), float(x[0]), raycoll.get_process_group_ranks(small))
    new = raycoll.shrink_group([2])
    out.update(_reduce(rank))
    out["sub_after"] = raycoll.get_pg_count()
    out["name"] = new.group_name
    return out


@pytest.mark.timeout(120)
def test_shrink_while_every_rank_is_alive(team):
    """No failure: ranks 0 and 3 shrink a subgroup [0, 1, 3] to [0, 3]; then 0, 1, 3 shrink
    the group without rank 2 (alive, not calling): renumbered, reducing, their subgroups gone;
    rank 2's handle on the old group is destroyed, saying it was excluded."""
    actors, name, _extra = team
    out = ray.get([_run(a, _subgroup_then_shrink, r) for r, a in enumerate(actors)], timeout=90)
    assert out[0]["sub"] == (0, 2, 5.0, [0, 3]) and out[3]["sub"] == (1, 2, 5.0, [0, 3])
    assert [out[r]["rank"] for r in (0, 1, 3)] == [0, 1, 2]
    for r in (0, 1, 3):
        assert (out[r]["size"], out[r]["value"], out[r]["sub_after"]) == (3, 6.0, 1), out[r]
    deadline = time.monotonic() + 30
    while True:  # the survivors told rank 2 (a call of its own, run when it is free)
        after = ray.get(_run(actors[2], _excluded_view, 2), timeout=30)
        if after[0] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert after[0] == 0 and after[1].startswith("GroupDestroyedError"), after
    assert "excluded" in after[1], after


def _excluded_view(rank: int) -> Any:
    if raycoll.get_pg_count():  # not told yet (its old group must not be used: not called)
        return raycoll.get_pg_count(), ""
    try:
        raycoll.all_reduce(np.ones(2))
        error = "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {exc}"
    return raycoll.get_pg_count(), error


def _bad_shrinks(rank: int) -> Dict[str, str]:
    cases = {"not_list": ((1,), 0), "empty": ([], 0), "flags": ([1], 7), "bounds": ([2], 0),
             "dup": ([1, 1], 0), "all": ([0, 1], 0), "self": ([rank], 0), "type": (["1"], 0)}
    out = {}
    for key, (excl, flags) in cases.items():
        try:
            raycoll.shrink_group(excl, shrink_flags=flags)  # type: ignore[arg-type]
            out[key] = "no error"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[key] = f"{type(exc).__name__}: {exc}"
    try:
        raycoll.shrink_group([1 - rank], pg_options={"x": 1})
    except ValueError as exc:
        out["pg_options"] = f"ValueError: {exc}"
    x = np.full(2, rank + 1.0)
    raycoll.all_reduce(x)  # every refusal left the group as it was
    out["after"] = str(x[0])
    return out


@pytest.mark.timeout(60)
def test_bad_arguments_are_refused_as_torch_does(ranks):
    out = ranks.run(_bad_shrinks, 2)
    for o in out:
        assert o["not_list"].startswith("TypeError: ranks_to_exclude must be a list")
        assert o["empty"].startswith("ValueError: ranks_to_exclude cannot be empty")
        assert o["flags"].startswith("ValueError: Invalid shrink_flags value: 7")
        assert o["bounds"].startswith("ValueError: Rank 2 at index 0 is out of bounds")
        assert o["dup"].startswith("ValueError: Duplicate rank 1")
        assert o["all"].startswith("ValueError: Cannot exclude all 2 ranks")
        assert o["self"].startswith("RuntimeError: Current rank")
        assert o["type"].startswith("TypeError: All elements in ranks_to_exclude")
        assert "pg_options" in o["pg_options"] and o["after"] == "3.0"


def _admit_alone(rank: int) -> Dict[str, Any]:
    try:
        raycoll.admit_new_ranks(timeout=1.0)
        got = "no error"
    except raycoll.DistTimeoutError as exc:
        got = f"DistTimeoutError: {exc}"
    out = _reduce(rank)
    out["admit"] = got
    return out


@pytest.mark.timeout(60)
def test_a_grow_nobody_joins_times_out_and_the_group_goes_on(team):
    actors, _name, _extra = team
    out = ray.get([_run(a, _admit_alone, r) for r, a in enumerate(actors)], timeout=60)
    for o in out:
        assert o["admit"].startswith("DistTimeoutError") and "never arrived" in o["admit"], o
        assert (o["size"], o["value"]) == (4, 10.0), o


def _state_roundtrip(rank: int) -> Dict[str, Any]:
    import torch

    state = None
    if rank == 1:
        state = {"layer": {"weight": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
                           "bias": torch.ones(3, dtype=torch.float64)},
                 "buffers": [np.arange(5, dtype=np.int32), np.zeros((0, 2))],
                 "meta": {"epoch": 3, "name": "run"}, "scalar": np.float32(2.5)}
    got = raycoll.broadcast_state_dict(state, src=1, bucket_bytes=7)
    w = got["layer"]["weight"]
    return {"w": (str(w.dtype), w.float().tolist()), "b": (str(got["layer"]["bias"].dtype),
            got["layer"]["bias"].tolist()), "buf": [b.tolist() for b in got["buffers"]],
            "buf_dtype": str(got["buffers"][0].dtype), "meta": got["meta"],
            "scalar": float(got["scalar"]), "same": got is state}


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_broadcast_state_dict_nested_torch_and_numpy(ranks):
    """A nested state of torch tensors (bfloat16 too), numpy arrays (an empty one) and
    Python values, in 7-byte buckets (arrays split across buckets): equal on every rank."""
    out = ranks.run(_state_roundtrip, 3)
    for r, o in enumerate(out):
        assert o["w"] == ("torch.bfloat16", [[float(4 * i + j) for j in range(4)] for i in range(3)])
        assert o["b"] == ("torch.float64", [1.0, 1.0, 1.0])
        assert o["buf"] == [[0, 1, 2, 3, 4], []] and o["buf_dtype"] == "int32"
        assert o["meta"] == {"epoch": 3, "name": "run"} and o["scalar"] == 2.5
        assert o["same"] == (r == 1)


def _abort_in_flight(rank: int) -> Dict[str, Any]:
    """Ranks 0-2 have an all_reduce in flight that rank 3 (alive) never joins; they shrink
    without it under SHRINK_ABORT: the call in flight fails, the new group works."""
    if rank == 3:
        return {}
    work = raycoll.all_reduce(np.ones(1000), async_op=True)
    time.sleep(0.3)  # well inside the wait
    start = time.monotonic()
    new = raycoll.shrink_group([3], shrink_flags=raycoll.SHRINK_ABORT)
    shrink_s = time.monotonic() - start
    try:
        work.wait(timeout=30)
        pending = "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        pending = type(exc).__name__
    out = _reduce(rank)
    out.update(pending=pending, shrink_s=shrink_s, group_size=new.size())
    return out


@pytest.mark.timeout(90)
def test_shrink_abort_fails_the_call_in_flight_and_the_group_goes_on(team):
    actors, _name, _extra = team
    out = ray.get([_run(a, _abort_in_flight, r) for r, a in enumerate(actors)], timeout=80)
    for o in out[:3]:
        assert o["pending"] != "no error" and o["shrink_s"] < TIMEOUT_S / 2, o
        assert (o["size"], o["value"], o["group_size"]) == (3, 6.0, 3), o


def _by_name(rank: int, name: str, size: int, newcomer: bool) -> Dict[str, Any]:
    if newcomer:  # it joined through the driver's grow_group
        return _reduce(rank)
    raycoll.init_process_group(world_size=size, rank=rank, group_name=name,
                               timeout=timedelta(seconds=TIMEOUT_S))
    before = _reduce(rank)
    raycoll.admit_new_ranks(group=name)
    out = _reduce(rank)
    out["before"] = before["value"]
    return out


@pytest.mark.timeout(90)
def test_grow_a_group_formed_by_name_in_the_actors(pool):
    """Three actors form a group by name (init_process_group, no driver record); the
    driver's grow_group finds it by name and adds a fourth."""
    name = f"byname-{uuid.uuid4().hex[:6]}"
    refs = [_run(a, _by_name, r, name, 3, False) for r, a in enumerate(pool[:3])]
    deadline = time.monotonic() + 60
    while True:  # until the three are in (the group's coordinator started by them)
        try:
            raycoll.grow_group(name, [pool[3]], timeout=TIMEOUT_S)
            break
        except raycoll.GroupNotFoundError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    out = ray.get(refs + [_run(pool[3], _by_name, 3, name, 4, True)], timeout=60)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert [o.get("before") for o in out[:3]] == [6.0] * 3
    assert all((o["size"], o["value"]) == (4, 10.0) for o in out), out
    ray.get([_run(a, lambda r: raycoll.destroy_process_group(), r) for r, a in enumerate(pool)],
            timeout=60)


def _admit_then_shrink(rank: int) -> Dict[str, Any]:
    start = time.monotonic()
    try:
        raycoll.admit_new_ranks(timeout=TIMEOUT_S)
        admit = "no error"
    except raycoll.RankFailedError as exc:
        admit = f"RankFailedError {list(exc.failed_ranks)}"
    waited = time.monotonic() - start
    raycoll.shrink_group([3])
    out = _reduce(rank)
    out.update(admit=admit, waited=waited)
    return out


@pytest.mark.timeout(90)
def test_a_member_dying_during_a_grow_fails_it_and_the_survivors_shrink(team):
    """Ranks 0-2 wait in admit_new_ranks; rank 3 (not calling) is killed: the grow fails at
    once on the three, naming it (not at its timeout), and they shrink without it."""
    actors, _name, _extra = team
    refs = [_run(a, _admit_then_shrink, r) for r, a in enumerate(actors[:3])]
    time.sleep(0.5)
    ray.kill(actors[3], no_restart=True)
    out = ray.get(refs, timeout=80)
    for o in out:
        assert o["admit"] == "RankFailedError [3]" and o["waited"] < TIMEOUT_S / 2, o
        assert (o["size"], o["value"]) == (3, 6.0), o


def _ncoll_inodes() -> Dict[str, Any]:
    """This rank's native-plane connections in its default group, by (direction, peer): the
    kernel's inode of each socket (the same inode: the same connection), and how many
    connections the group's links made and took over."""
    links = raycoll.group.WORLD.context._transports.links
    conns = {f"out{p}": os.fstat(o.sock.fileno()).st_ino
             for (p, purpose), o in links._out.items() if purpose == "ncoll"}
    conns.update({f"in{p}": os.fstat(s.fileno()).st_ino
                  for (p, purpose), s in links._in.items() if purpose == "ncoll"})
    return {"conns": conns, "connected": links.connected, "adopted": links.adopted}


def _reduce_links(rank: int) -> Dict[str, Any]:
    out = _reduce(rank)
    out.update(_ncoll_inodes())
    return out


def _shrink_links(rank: int, excluded: List[int]) -> Dict[str, Any]:
    raycoll.shrink_group(excluded)
    return _reduce_links(rank)


def _admit_links(rank: int) -> Dict[str, Any]:
    raycoll.admit_new_ranks(timeout=TIMEOUT_S)
    return _reduce_links(rank)


@pytest.mark.timeout(120)
def test_shrink_and_grow_keep_the_ranks_connections(team):
    """On direct connections (a ring all_reduce: each rank connects to the next), rank 3
    (alive) is shrunk out: the survivors' connections with each other are the same
    sockets after (renumbered), only the ring's new edge 2 -> 0 is made; a newcomer grows
    the group: the existing ranks keep all theirs, and only edges with it are made."""
    actors, name, extra = team
    raycoll.destroy_group(name)
    raycoll.create_group(actors, group_name=name, timeout=TIMEOUT_S,
                         options={"transport": "tcp", "all_reduce_algo": "ring"})
    before = ray.get([_run(a, _reduce_links, r) for r, a in enumerate(actors)], timeout=60)
    assert [b["value"] for b in before] == [10.0] * 4
    assert [sorted(b["conns"]) for b in before] == [["in3", "out1"], ["in0", "out2"],
                                                    ["in1", "out3"], ["in2", "out0"]]
    shrunk = ray.get([_run(a, _shrink_links, r, [3]) for r, a in enumerate(actors[:3])],
                     timeout=60)
    assert [(s["size"], s["value"]) for s in shrunk] == [(3, 6.0)] * 3
    # the edges among the survivors are the very sockets they had (the same inodes)
    assert shrunk[0]["conns"]["out1"] == before[0]["conns"]["out1"]
    assert shrunk[1]["conns"]["in0"] == before[1]["conns"]["in0"]
    assert shrunk[1]["conns"]["out2"] == before[1]["conns"]["out2"]
    assert shrunk[2]["conns"]["in1"] == before[2]["conns"]["in1"]
    assert [s["adopted"] for s in shrunk] == [1, 2, 1]
    assert [s["connected"] for s in shrunk] == [0, 0, 1]  # the ring's new edge 2 -> 0
    newcomer = Worker.remote()
    extra.append(newcomer)
    refs = [_run(a, _admit_links, r) for r, a in enumerate(actors[:3])]
    raycoll.grow_group(name, [newcomer], timeout=TIMEOUT_S)
    grown = ray.get(refs + [_run(newcomer, _reduce_links, 3)], timeout=60)
    assert [(g["size"], g["value"]) for g in grown] == [(4, 10.0)] * 4
    for old, new in zip(shrunk, grown):  # every connection of the shrunk group is kept
        assert {k: v for k, v in new["conns"].items() if k in old["conns"]} == old["conns"]
    assert [g["adopted"] for g in grown] == [2, 2, 2, 0]
    assert [g["connected"] for g in grown] == [0, 0, 1, 1]  # 2 -> 3 and 3 -> 0


@pytest.mark.timeout(90)
def test_grow_refuses_a_member_and_a_group_with_a_dead_rank(team):
    """The coordinator numbers the newcomers (the driver asks nothing first), and refuses
    an actor that is a member already, and any newcomer while a rank of the group is dead."""
    actors, name, extra = team
    with pytest.raises(ValueError, match="already rank 1 of the group"):
        raycoll.grow_group(name, [actors[1]], timeout=10)
    ray.kill(actors[3], no_restart=True)
    _wait_dead(name, {3})
    newcomer = Worker.remote()
    extra.append(newcomer)
    with pytest.raises(raycoll.GroupBrokenError, match="shrink_group first"):
        raycoll.grow_group(name, [newcomer], timeout=10)


def _torch_shrink(rank: int) -> Dict[str, Any]:
    """torch's shrink_group on the "raycoll" backend is refused (torch asks the group for a
    per-device c10d Backend, which raycoll's group is not); the documented way goes on: raycoll's
    shrink_group, then torch's default group formed again over the shrunk raycoll group."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("raycoll")
    out: Dict[str, Any] = {}
    if rank == 2:  # excluded: takes no part
        dist.destroy_process_group()
        return out
    try:
        dist.shrink_group([2])
        out["torch"] = "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["torch"] = f"{type(exc).__name__}: {exc}"
    raycoll.shrink_group([2])
    dist.destroy_process_group()
    dist.init_process_group("raycoll")
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    out.update(sum=t.tolist(), who=(dist.get_rank(), dist.get_world_size()))
    dist.destroy_process_group()
    return out


@pytest.mark.torch
@pytest.mark.timeout(90)
def test_torch_shrink_group_is_refused_and_the_documented_way_works(ranks):
    pytest.importorskip("torch")
    out = ranks.run(_torch_shrink, 3)
    for r in (0, 1):
        assert out[r]["torch"].startswith("RuntimeError: Cannot access device backend"), out[r]
        assert out[r]["sum"] == [3.0] * 3 and out[r]["who"] == (r, 2), out[r]
